//! The changes a plugin makes to the headers of the request it forwards,
//! through the `header-edits` import (contract 0.2.1): checked as the
//! plugin asks for each, kept in its call's state, and made on the request
//! sent upstream once the call answers `forward` or `forward-with-body`.

use http::header::{self, HeaderMap, HeaderName, HeaderValue};

use crate::bindings::snowgate::middleware::header_edits;
use crate::request::join_cookies;
use crate::state::HostState;

/// The most changes one call may make; more fail, naming the limit.
pub const MAX_HEADER_EDITS: usize = 64;

/// The longest header name a change may name, in bytes.
pub const MAX_HEADER_NAME_BYTES: usize = 256;

/// The longest value a change may give a header, in bytes.
pub const MAX_HEADER_VALUE_BYTES: usize = 8 << 10;

/// The most bytes of names and values the changes of one call may hold
/// together: as much as a whole request head may (`--max-header-bytes`'s
/// default), so that a plugin cannot send upstream a head far larger than
/// any the gateway takes in.
pub const MAX_HEADER_EDIT_BYTES: usize = 64 << 10;

/// Headers the host manages, which a plugin may not change: the target's
/// host, the body's framing (the host sets `Content-Length` for a new
/// body; `Trailer` names trailer fields, which a body read whole for the
/// plugin does not carry on), `Expect` (the body is read already),
/// `X-Forwarded-For` (the client's address, which the gateway vouches
/// for) and the hop-by-hop headers, which belong to one connection and are
/// removed before the request goes upstream.
const MANAGED: [&str; 13] = [
    "host",
    "content-length",
    "expect",
    "x-forwarded-for",
    "connection",
    "keep-alive",
    "proxy-connection",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

/// Whether `name` (lower case, as a [`HeaderName`] is) is one the host
/// manages (`MANAGED`), under any spelling with `_` for `-`.
pub fn is_host_managed(name: &str) -> bool {
    MANAGED.contains(&name) || aliases_a_managed_name(name)
}

/// Whether `name` is a name the host manages (`MANAGED`) under another
/// spelling: with `_` for `-` (`x_forwarded_for`, `content_length`), which
/// servers that read headers into CGI-style variables (WSGI, CGI, PHP)
/// take for the same header, so that a second `X-Forwarded-For` or a
/// body's framing could reach them past the host. nginx drops every name
/// with `_` by default (`underscores_in_headers off`).
pub fn aliases_a_managed_name(name: &str) -> bool {
    name.contains('_')
        && MANAGED.iter().any(|managed| {
            managed.len() == name.len()
                && managed
                    .bytes()
                    .zip(name.bytes())
                    .all(|(m, n)| m == n.to_ascii_lowercase() || (m == b'-' && n == b'_'))
        })
}

/// One change to a request's headers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HeaderEdit {
    /// The header gets this one value, in place of any it had.
    Set(HeaderName, HeaderValue),
    /// The value is added after those the header has.
    Append(HeaderName, HeaderValue),
    /// The header is removed, with all its values.
    Remove(HeaderName),
}

/// As a line of a tool's output or a log: `set NAME: VALUE`, `append
/// NAME: VALUE` or `remove NAME`, the value's bytes other than printable
/// ASCII escaped (`\t`, `\xe2`), so that no value can move a terminal's
/// cursor or reorder its text, and none is lost.
impl std::fmt::Display for HeaderEdit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let shown = |value: &HeaderValue| value.as_bytes().escape_ascii().to_string();
        match self {
            HeaderEdit::Set(name, value) => write!(f, "set {name}: {}", shown(value)),
            HeaderEdit::Append(name, value) => write!(f, "append {name}: {}", shown(value)),
            HeaderEdit::Remove(name) => write!(f, "remove {name}"),
        }
    }
}

/// The changes one call made, in the order it asked for them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HeaderEdits(Vec<HeaderEdit>);

/// The bytes of names and values `edit` holds.
fn bytes_of(edit: &HeaderEdit) -> usize {
    match edit {
        HeaderEdit::Set(name, value) | HeaderEdit::Append(name, value) => {
            name.as_str().len() + value.len()
        }
        HeaderEdit::Remove(name) => name.as_str().len(),
    }
}

impl HeaderEdits {
    /// Whether the call made no change.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The changes, in order.
    pub fn iter(&self) -> impl Iterator<Item = &HeaderEdit> {
        self.0.iter()
    }

    /// Makes the changes on `headers`, in order. A value appended to
    /// `Cookie` joins the cookies there with `; ` on one line: HTTP/1
    /// servers read one `Cookie` line, some only the first.
    pub fn apply(self, headers: &mut HeaderMap) {
        for edit in self.0 {
            match edit {
                HeaderEdit::Set(name, value) => {
                    headers.insert(name, value);
                }
                HeaderEdit::Append(name, value) => {
                    let cookie = name == header::COOKIE;
                    headers.append(name, value);
                    if cookie {
                        join_cookies(headers);
                    }
                }
                HeaderEdit::Remove(name) => {
                    headers.remove(name);
                }
            }
        }
    }

    /// Adds `edit` if the call may make one more change, of its size.
    fn push(&mut self, edit: HeaderEdit) -> Result<(), String> {
        if self.0.len() >= MAX_HEADER_EDITS {
            return Err(format!(
                "more than {MAX_HEADER_EDITS} header changes in one call"
            ));
        }
        let held: usize = self.0.iter().map(bytes_of).sum();
        if held + bytes_of(&edit) > MAX_HEADER_EDIT_BYTES {
            return Err(format!(
                "the header changes of one call would hold more than {MAX_HEADER_EDIT_BYTES} \
                 bytes of names and values"
            ));
        }
        self.0.push(edit);
        Ok(())
    }
}

/// `name` as a header name a plugin may change, or why not.
fn editable_name(name: &str) -> Result<HeaderName, String> {
    if name.len() > MAX_HEADER_NAME_BYTES {
        return Err(format!(
            "the header name {} is {} bytes long, over the {MAX_HEADER_NAME_BYTES} byte limit",
            shown(name),
            name.len()
        ));
    }
    let parsed = HeaderName::from_bytes(name.as_bytes()).map_err(|_| {
        format!(
            "{} is not an HTTP header name (letters, digits and !#$%&'*+-.^_`|~ only)",
            shown(name)
        )
    })?;
    if is_host_managed(parsed.as_str()) {
        return Err(format!(
            "the header {} is the host's to set, not a plugin's (the host manages host, \
             content-length, expect, x-forwarded-for and the hop-by-hop headers, under any \
             spelling with _ for -)",
            parsed.as_str()
        ));
    }
    Ok(parsed)
}

/// `value` as a header value, or why not.
fn header_value(name: &HeaderName, value: &[u8]) -> Result<HeaderValue, String> {
    if value.len() > MAX_HEADER_VALUE_BYTES {
        return Err(format!(
            "the value for the header {} is {} bytes long, over the {MAX_HEADER_VALUE_BYTES} \
             byte limit",
            name.as_str(),
            value.len()
        ));
    }
    HeaderValue::from_bytes(value).map_err(|_| {
        format!(
            "the value for the header {} holds a carriage return, a line feed, a NUL or \
             another control byte, which a header value may not",
            name.as_str()
        )
    })
}

/// A name for a message: quoted, and only its start.
fn shown(name: &str) -> String {
    let start: String = name.chars().take(64).collect();
    let more = if start.len() < name.len() { "..." } else { "" };
    format!("{start:?}{more}")
}

/// Why a change asked for outside `handle` is refused.
const NOT_HANDLING: &str = "headers can be changed only while handling a request";

/// What a plugin asks of a header through the `header-edits` import.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum EditAsked {
    /// `set`.
    Set,
    /// `append`.
    Append,
    /// `remove`.
    Remove,
}

impl EditAsked {
    /// Its function's name in the import.
    pub(crate) fn function(self) -> &'static str {
        match self {
            EditAsked::Set => "set",
            EditAsked::Append => "append",
            EditAsked::Remove => "remove",
        }
    }
}

impl HostState {
    /// The change `asked` of the header `name` (to `value`, which `remove`
    /// ignores), if the call may make it now, or why not. Reads `name` and
    /// `value` where they lie (in the plugin's memory, for the import) and
    /// copies them only once they are within their limits.
    pub(crate) fn header_edit(
        &self,
        asked: EditAsked,
        name: &str,
        value: &[u8],
    ) -> Result<HeaderEdit, String> {
        if !self.takes_header_edits() {
            return Err(NOT_HANDLING.to_string());
        }
        let name = editable_name(name)?;
        Ok(match asked {
            EditAsked::Set => {
                let value = header_value(&name, value)?;
                HeaderEdit::Set(name, value)
            }
            EditAsked::Append => {
                let value = header_value(&name, value)?;
                HeaderEdit::Append(name, value)
            }
            EditAsked::Remove => HeaderEdit::Remove(name),
        })
    }

    /// Records `edit` (from [`HostState::header_edit`]) for the request
    /// being handled, within the call's limits, or why it cannot be.
    pub(crate) fn record_header_edit(&mut self, edit: HeaderEdit) -> Result<(), String> {
        match self.header_edits_mut() {
            Some(edits) => edits.push(edit),
            None => Err(NOT_HANDLING.to_string()),
        }
    }

    /// [`HostState::header_edit`], then [`HostState::record_header_edit`].
    fn edit(&mut self, asked: EditAsked, name: &str, value: &[u8]) -> Result<(), String> {
        let edit = self.header_edit(asked, name, value)?;
        self.record_header_edit(edit)
    }
}

// `set`, `append` and `remove` are never called by the engine:
// `in_place_imports` links versions that read the name and value in the
// plugin's memory, through the same `HostState::edit`.
impl header_edits::Host for HostState {
    fn set(&mut self, name: String, value: Vec<u8>) -> Result<(), String> {
        self.edit(EditAsked::Set, &name, &value)
    }

    fn append(&mut self, name: String, value: Vec<u8>) -> Result<(), String> {
        self.edit(EditAsked::Append, &name, &value)
    }

    fn remove(&mut self, name: String) -> Result<(), String> {
        self.edit(EditAsked::Remove, &name, &[])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn name(text: &'static str) -> HeaderName {
        HeaderName::from_static(text)
    }

    fn value(text: &'static str) -> HeaderValue {
        HeaderValue::from_static(text)
    }

    /// Changes are made in order: set replaces every value, append adds
    /// after them, remove takes all.
    #[test]
    fn edits_apply_in_order() {
        let mut headers = HeaderMap::new();
        headers.append("accept", value("a"));
        headers.append("accept", value("b"));
        headers.insert("x-tenant", value("t"));
        let edits = HeaderEdits(vec![
            HeaderEdit::Set(name("accept"), value("c")),
            HeaderEdit::Append(name("accept"), value("d")),
            HeaderEdit::Remove(name("x-tenant")),
            HeaderEdit::Append(name("x-new"), value("1")),
            HeaderEdit::Remove(name("x-absent")),
        ]);
        edits.apply(&mut headers);
        let values = |n| {
            headers
                .get_all(n)
                .iter()
                .map(|v| v.to_str().unwrap().to_string())
                .collect::<Vec<_>>()
        };
        assert_eq!(values("accept"), ["c", "d"]);
        assert!(values("x-tenant").is_empty());
        assert_eq!(values("x-new"), ["1"]);
    }

    /// A cookie appended joins the request's cookies on one line, as
    /// HTTP/1 servers read them.
    #[test]
    fn an_appended_cookie_joins_the_cookie_line() {
        let mut headers = HeaderMap::new();
        headers.append("cookie", value("a=1"));
        headers.append("cookie", value("b=2"));
        HeaderEdits(vec![HeaderEdit::Append(name("cookie"), value("c=3"))]).apply(&mut headers);
        let cookies: Vec<_> = headers.get_all("cookie").iter().collect();
        assert_eq!(cookies, [value("a=1; b=2; c=3")]);
        let mut none = HeaderMap::new();
        HeaderEdits(vec![HeaderEdit::Append(name("cookie"), value("c=3"))]).apply(&mut none);
        assert_eq!(none.get("cookie"), Some(&value("c=3")));
    }

    /// The changes of one call hold at most as many bytes as a request
    /// head the gateway takes in.
    #[test]
    fn a_call_changes_at_most_the_limit_of_bytes() {
        let mut edits = HeaderEdits::default();
        let big = HeaderValue::from_bytes(&[b'v'; MAX_HEADER_VALUE_BYTES]).unwrap();
        // 7 of 8 KiB and a 3-byte name fit; the 8th does not.
        for _ in 0..7 {
            edits
                .push(HeaderEdit::Append(name("x-a"), big.clone()))
                .expect("fits");
        }
        let problem = edits
            .push(HeaderEdit::Append(name("x-a"), big.clone()))
            .expect_err("over");
        assert!(problem.contains("more than 65536 bytes"), "{problem}");
        edits
            .push(HeaderEdit::Remove(name("x-b")))
            .expect("a few bytes still fit");
    }

    #[test]
    fn names_the_host_manages_or_that_are_not_names_are_refused() {
        for managed in MANAGED {
            let problem = editable_name(&managed.to_ascii_uppercase()).expect_err(managed);
            assert!(problem.contains("the host's to set"), "{problem}");
            // Under `_` for `-`, which CGI-style servers read as the same.
            let aliased = managed.replace('-', "_");
            if aliased != *managed {
                let problem = editable_name(&aliased).expect_err(&aliased);
                assert!(problem.contains("the host's to set"), "{problem}");
            }
        }
        // Other names with `_` are a plugin's to change.
        assert!(editable_name("x_route").is_ok());
        assert!(editable_name("content_type").is_ok());
        for bad in ["", "a b", "x:y", "é", ":authority", "a\r\nb"] {
            let problem = editable_name(bad).expect_err(bad);
            assert!(problem.contains("is not an HTTP header name"), "{problem}");
        }
        assert!(editable_name(&"x".repeat(MAX_HEADER_NAME_BYTES)).is_ok());
        let problem = editable_name(&"x".repeat(100_000)).expect_err("too long");
        assert!(
            problem.contains("100000 bytes long, over the 256 byte limit"),
            "{problem}"
        );
        assert!(
            problem.len() < 200,
            "the name is cut in the message: {problem}"
        );
        assert_eq!(
            editable_name("X-Disagg-Request-Id"),
            Ok(name("x-disagg-request-id"))
        );
    }

    #[test]
    fn values_with_line_breaks_or_over_the_limit_are_refused() {
        let header = name("x-a");
        for bad in [&b"a\r\nInjected: 1"[..], b"a\nb", b"a\0b", b"\x7f"] {
            let problem = header_value(&header, bad).expect_err("refused");
            assert!(problem.contains("x-a"), "{problem}");
        }
        assert!(header_value(&header, &[b'v'; MAX_HEADER_VALUE_BYTES]).is_ok());
        let problem =
            header_value(&header, &[b'v'; MAX_HEADER_VALUE_BYTES + 1]).expect_err("too long");
        assert!(problem.contains("over the 8192 byte limit"), "{problem}");
        assert_eq!(header_value(&header, b"\xff tab\t").map(|_| ()), Ok(()));
    }

    /// Changes are taken only during `handle` (the headers are lent), and
    /// the end of the call takes them all.
    #[test]
    fn changes_are_taken_only_while_a_request_is_handled() {
        use std::sync::Arc;

        use header_edits::Host as _;

        use crate::engine::HostServices;
        use crate::id_clock::IdClock;
        use crate::identity::MachineIdentity;
        use crate::request::Headers;

        let services = HostServices {
            clock: Arc::new(IdClock::system()),
            identity: Arc::new(
                MachineIdentity::fixed(snowgate_plugin::SnowflakeLayout::TrtllmV1, 1)
                    .expect("in range"),
            ),
        };
        let mut state = HostState::new(services, 1 << 20, Arc::from("test"));
        for outside in [
            state.set("x-a".into(), b"1".to_vec()),
            state.set("host".into(), b"h".to_vec()),
        ] {
            assert_eq!(
                outside,
                Err("headers can be changed only while handling a request".to_string())
            );
        }
        state.lend_headers(&Headers::from(Vec::new()));
        state
            .set("x-a".into(), b"1".to_vec())
            .expect("during handle");
        state.remove("x-b".into()).expect("during handle");
        assert!(state.set("Host".into(), b"h".to_vec()).is_err());
        let taken = state.take_back_headers();
        assert_eq!(
            taken,
            HeaderEdits(vec![
                HeaderEdit::Set(name("x-a"), value("1")),
                HeaderEdit::Remove(name("x-b")),
            ])
        );
        assert!(
            state.append("x-a".into(), b"2".to_vec()).is_err(),
            "after the call"
        );
        assert!(state.take_back_headers().is_empty());
    }

    #[test]
    fn a_call_makes_at_most_the_limit_of_changes() {
        let mut edits = HeaderEdits::default();
        for _ in 0..MAX_HEADER_EDITS {
            edits
                .push(HeaderEdit::Remove(name("x-a")))
                .expect("within the limit");
        }
        let problem = edits
            .push(HeaderEdit::Remove(name("x-a")))
            .expect_err("over");
        assert!(problem.contains("more than 64 header changes"), "{problem}");
        assert_eq!(edits.iter().count(), MAX_HEADER_EDITS);
    }
}
