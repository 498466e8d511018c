//! What the gateway takes out of the headers it passes on, either way:
//! the hop-by-hop headers and those a `Connection` header names (RFC 9110
//! section 7.6.1), a client's `Expect`, the aliases of names the gateway
//! manages (`X_Forwarded_For`), and the same fields in trailers.
//!
//! A request's headers go through [`take_in_client_headers`] as they come
//! in, before the plugin sees them; a response's through
//! [`strip_response_hop_by_hop`]; trailers through [`strip_trailers`] and
//! [`strip_request_trailers`].

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName};
use http_body::Frame;

use crate::gateway::header_order::{rebuild_in_order, remove_in_order, Change};
use crate::header_edits::{aliases_a_managed_name, is_host_managed};

/// Headers that describe one connection, not the message: a proxy must not
/// forward them (RFC 9110 section 7.6.1). `Trailer` is not one of them: it
/// names the trailer fields that end a chunked message, and without it
/// hyper does not send them on. A static: a const would be built and
/// dropped wherever it is used, on every request.
static HOP_BY_HOP: [HeaderName; HOP_BY_HOP_COUNT] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
    header::TE,
    header::TRANSFER_ENCODING,
];

/// How many names [`HOP_BY_HOP`] holds.
const HOP_BY_HOP_COUNT: usize = 7;

/// Where `Connection` and `TE` are in [`HOP_BY_HOP`].
const HOP_BY_HOP_CONNECTION: usize = 0;
const HOP_BY_HOP_TE: usize = 5;

/// Bit n is set when a name in [`HOP_BY_HOP`], or `Upgrade`, is n bytes
/// long (2, 7, 10, 16, 17, 18, 19). Most headers' names (`host`,
/// `content-type`, `authorization`) are not, and are passed over on their
/// length alone, not compared with eight names.
const HOP_BY_HOP_LENGTHS: u32 = 1 << 2 | 1 << 7 | 1 << 10 | 1 << 16 | 1 << 17 | 1 << 18 | 1 << 19;

/// Whether `name` has the length of a hop-by-hop name.
fn may_be_hop_by_hop(name: &HeaderName) -> bool {
    let length = name.as_str().len();
    length < 32 && HOP_BY_HOP_LENGTHS & (1 << length) != 0
}

/// End-to-end headers a `Connection` header may not remove (RFC 9110
/// section 7.6.1: a sender must not name them). They say whether and how a
/// request reaches the plugin; a client naming them must not be able to
/// send a JSON body past it.
const NEVER_CONNECTION_OPTIONS: [HeaderName; 4] = [
    header::CONTENT_LENGTH,
    header::CONTENT_TYPE,
    header::CONTENT_ENCODING,
    header::HOST,
];

/// Removes hop-by-hop headers, including those the `Connection` header names
/// (except `Content-Length`, `Content-Type`, `Content-Encoding` and `Host`,
/// which a sender must not name there). A `TE` that accepts trailers
/// becomes `TE: trailers`: the gateway passes trailers on, so the next hop
/// may send them.
///
/// It runs on every request and response, most of which carry none of
/// these headers: one pass over the names present finds those to remove,
/// and only they are looked up (a removal of an absent name hashes it all
/// the same).
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    strip(headers, true)
}

/// A client's request head as the gateway takes it in, before the plugin
/// or the upstream sees it: without the hop-by-hop headers (see
/// [`strip_hop_by_hop`]; first, so that a client cannot name the
/// gateway's own `X-Forwarded-For` in its `Connection` header to have it
/// removed), `Expect` and the aliases of managed names (see
/// [`drop_managed_aliases`]). The order of those left is kept.
///
/// hyper took the client's `Expect: 100-continue` when it parsed the head,
/// and answers it once the body is read: the upstream must not be asked
/// again, for a body that is already on its way (one that refuses
/// expectations answered 417 to a body the client was told to send).
/// nginx never forwards it either.
pub fn take_in_client_headers(headers: &mut HeaderMap) {
    strip_hop_by_hop(headers);
    remove_in_order(headers, &header::EXPECT);
    drop_managed_aliases(headers);
}

/// Removes the client's headers that spell a name the gateway manages
/// with `_` for `-` (`X_Forwarded_For`, `Transfer_Encoding`; see
/// [`aliases_a_managed_name`]): a CGI-style upstream would take them for
/// the gateway's own, a second client address or a body's framing. Other
/// names with `_` pass.
pub fn drop_managed_aliases(headers: &mut HeaderMap) {
    if !headers.keys().any(|name| name.as_str().contains('_')) {
        return;
    }
    for alias in names_where(headers, aliases_a_managed_name) {
        remove_in_order(headers, &alias);
    }
}

/// The names in `headers` that `matches`, to remove once looked at (the
/// map cannot change while it is read).
fn names_where(headers: &HeaderMap, matches: impl Fn(&str) -> bool) -> Vec<HeaderName> {
    headers
        .keys()
        .filter(|name| matches(name.as_str()))
        .cloned()
        .collect()
}

/// [`strip_hop_by_hop`] for a response: `TE` is a request header, so one an
/// upstream sends goes too, whatever it accepts.
pub fn strip_response_hop_by_hop(headers: &mut HeaderMap) {
    strip(headers, false)
}

/// A body's trailers with the hop-by-hop fields removed, as from a head
/// (`TE` too: it has no meaning there). Fields that name a connection are
/// malformed in HTTP/2 (RFC 9113 section 8.2.2): an upstream's
/// `Connection: close` trailer reset an HTTP/2 client's stream after its
/// whole body, and reached HTTP/1 clients and upstreams as it came.
pub fn strip_trailers(frame: Frame<Bytes>) -> Frame<Bytes> {
    match frame.into_trailers() {
        Ok(mut trailers) => {
            strip(&mut trailers, false);
            Frame::trailers(trailers)
        }
        Err(frame) => frame,
    }
}

/// A client's trailers as [`strip_trailers`] leaves them, less the
/// fields the gateway manages in a request's head ([`is_host_managed`]:
/// `X-Forwarded-For`, `Host`, the body's framing, under any spelling with
/// `_` for `-`): an upstream that merges trailers into the headers, as
/// Tomcat does, would take a client's `X-Forwarded-For` there for one the
/// gateway vouched for.
pub fn strip_request_trailers(frame: Frame<Bytes>) -> Frame<Bytes> {
    match strip_trailers(frame).into_trailers() {
        Ok(mut trailers) => {
            for name in names_where(&trailers, is_host_managed) {
                trailers.remove(&name);
            }
            Frame::trailers(trailers)
        }
        Err(frame) => frame,
    }
}

/// Removes hop-by-hop headers. With `request`, a `TE` that accepts
/// trailers becomes `TE: trailers`, and the headers that stay keep their
/// order (see [`header_order`](crate::gateway::header_order): the plugin
/// reads them); a response's or trailers' may be reordered, as removing
/// from the map in place does.
fn strip(headers: &mut HeaderMap, request: bool) {
    let mut present = [false; HOP_BY_HOP_COUNT];
    let mut upgrade = false;
    for name in headers.keys().filter(|name| may_be_hop_by_hop(name)) {
        match HOP_BY_HOP.iter().position(|hop| hop == name) {
            Some(i) => present[i] = true,
            None => upgrade |= name == header::UPGRADE,
        }
    }
    if !upgrade && !present.contains(&true) {
        return;
    }
    let accepts_trailers = request && present[HOP_BY_HOP_TE] && te_accepts_trailers(headers);
    let named: Vec<HeaderName> = if present[HOP_BY_HOP_CONNECTION] {
        // Token by token: a line with a byte no header name has still
        // names the others on it.
        headers
            .get_all(header::CONNECTION)
            .iter()
            .flat_map(|v| v.as_bytes().split(|&b| b == b','))
            .filter_map(|token| std::str::from_utf8(token).ok())
            .map(str::trim)
            // Those removed below anyway (nginx's `keep-alive`, say) need
            // no name made of their own.
            .filter(|name| {
                !name.eq_ignore_ascii_case(header::UPGRADE.as_str())
                    && !HOP_BY_HOP
                        .iter()
                        .any(|hop| name.eq_ignore_ascii_case(hop.as_str()))
            })
            .filter_map(|name| HeaderName::from_bytes(name.as_bytes()).ok())
            .filter(|name| !NEVER_CONNECTION_OPTIONS.contains(name))
            .collect()
    } else {
        Vec::new()
    };
    if request {
        // The usual `TE` of a request (gRPC clients send it) is left as it
        // is, without a rebuild: one `TE: trailers`, nothing else to go.
        let te_alone = accepts_trailers
            && !upgrade
            && named.is_empty()
            && present.iter().filter(|here| **here).count() == 1;
        if te_alone {
            let mut values = headers.get_all(header::TE).iter();
            if values.next().is_some_and(|v| v == "trailers") && values.next().is_none() {
                return;
            }
        }
        rebuild_in_order(headers, |name| {
            if accepts_trailers && name == header::TE {
                Change::Replace(header::HeaderValue::from_static("trailers"))
            } else if named.contains(name)
                || (may_be_hop_by_hop(name) && HOP_BY_HOP.contains(name))
                || name == header::UPGRADE
            {
                Change::Remove
            } else {
                Change::Keep
            }
        });
        return;
    }
    for name in &named {
        headers.remove(name);
    }
    for (name, _) in HOP_BY_HOP.iter().zip(present).filter(|(_, here)| *here) {
        headers.remove(name);
    }
    // `Upgrade` goes only with a `Connection: upgrade`, which was just removed.
    if upgrade {
        headers.remove(header::UPGRADE);
    }
}

/// Whether a `TE` of `headers` names the `trailers` coding (in any case,
/// with or without parameters).
fn te_accepts_trailers(headers: &HeaderMap) -> bool {
    headers
        .get_all(header::TE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|coding| {
            let name = coding.split(';').next().unwrap_or_default();
            name.trim().eq_ignore_ascii_case("trailers")
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A header the gateway takes out as hop-by-hop is one a plugin may
    /// not add back either (`header_edits`' own list): the two lists are
    /// kept apart, and nothing else ties them.
    #[test]
    fn every_hop_by_hop_name_is_one_a_plugin_may_not_edit() {
        for name in HOP_BY_HOP.iter().chain([&header::UPGRADE]) {
            assert!(is_host_managed(name.as_str()), "{name}");
        }
    }

    /// A client's trailers lose what the gateway manages in a head, under
    /// any spelling with `_` for `-`, as well as their hop-by-hop fields;
    /// before, an `X-Forwarded-For` trailer reached the upstream, which the
    /// gateway had not vouched for.
    #[test]
    fn a_clients_trailers_carry_nothing_the_gateway_manages() {
        let mut trailers = HeaderMap::new();
        for (name, value) in [
            ("x-forwarded-for", "6.6.6.6"),
            ("x_forwarded_for", "6.6.6.6"),
            ("host", "evil.example"),
            ("content-length", "5"),
            ("connection", "close"),
            ("x-checksum", "abc"),
            ("x_custom", "kept"),
        ] {
            trailers.append(HeaderName::from_static(name), value.parse().unwrap());
        }
        let left = strip_request_trailers(Frame::trailers(trailers))
            .into_trailers()
            .expect("trailers");
        let mut names: Vec<&str> = left.keys().map(HeaderName::as_str).collect();
        names.sort_unstable();
        assert_eq!(names, ["x-checksum", "x_custom"]);
    }

    #[test]
    fn strips_hop_by_hop_headers_and_those_connection_names() {
        let mut headers = HeaderMap::new();
        headers.insert(header::CONNECTION, "keep-alive, x-secret".parse().unwrap());
        // A line with a byte no name has still names the others on it.
        headers.append(
            header::CONNECTION,
            header::HeaderValue::from_bytes(b"x-internal, \xe9").unwrap(),
        );
        headers.insert("x-internal", "2".parse().unwrap());
        headers.insert("keep-alive", "timeout=5".parse().unwrap());
        headers.insert("x-secret", "1".parse().unwrap());
        headers.insert(header::TRANSFER_ENCODING, "chunked".parse().unwrap());
        headers.insert(header::AUTHORIZATION, "Bearer t".parse().unwrap());
        headers.insert(header::CONTENT_TYPE, "application/json".parse().unwrap());
        strip_hop_by_hop(&mut headers);
        let left: Vec<&str> = headers.keys().map(|k| k.as_str()).collect();
        assert_eq!(left, ["authorization", "content-type"]);
    }

    #[test]
    fn every_hop_by_hop_name_has_a_length_that_is_looked_at() {
        for name in HOP_BY_HOP.iter().chain([&header::UPGRADE]) {
            assert!(may_be_hop_by_hop(name), "{name}");
        }
        for name in [header::HOST, header::CONTENT_TYPE, header::CONTENT_LENGTH] {
            assert!(!may_be_hop_by_hop(&name), "{name}");
        }
        let long = HeaderName::from_bytes(&[b'x'; 40]).unwrap();
        assert!(!may_be_hop_by_hop(&long));
    }

    #[test]
    fn the_indices_of_connection_and_te_are_theirs() {
        assert_eq!(HOP_BY_HOP[HOP_BY_HOP_CONNECTION], header::CONNECTION);
        assert_eq!(HOP_BY_HOP[HOP_BY_HOP_TE], header::TE);
    }

    /// What `strip_hop_by_hop` did before it looked at the names present
    /// first: every name looked up and removed.
    fn strip_every_name(headers: &mut HeaderMap) {
        let accepts_trailers = te_accepts_trailers(headers);
        let named: Vec<HeaderName> = headers
            .get_all(header::CONNECTION)
            .iter()
            .flat_map(|v| v.as_bytes().split(|&b| b == b','))
            .filter_map(|name| HeaderName::from_bytes(name.trim_ascii()).ok())
            .filter(|name| !NEVER_CONNECTION_OPTIONS.contains(name))
            .collect();
        for name in named.iter().chain(HOP_BY_HOP.iter()) {
            headers.remove(name);
        }
        headers.remove(header::UPGRADE);
        if accepts_trailers {
            headers.insert(header::TE, header::HeaderValue::from_static("trailers"));
        }
    }

    /// Random sets of hop-by-hop, end-to-end and `Connection`-named
    /// headers come out of both alike, each name's values in their order.
    #[test]
    fn strips_what_looking_up_every_name_strips() {
        const HEADERS: [(&str, &[&str]); 13] = [
            (
                "connection",
                &[
                    "keep-alive",
                    "x-secret, Upgrade",
                    "TE",
                    "content-type, close",
                    " , x-a",
                ],
            ),
            ("keep-alive", &["timeout=5"]),
            ("proxy-connection", &["keep-alive"]),
            ("proxy-authorization", &["Basic e30="]),
            ("te", &["trailers", "gzip", "deflate, trailers;q=0.5"]),
            ("transfer-encoding", &["chunked"]),
            ("upgrade", &["h2c", "websocket"]),
            ("x-secret", &["1"]),
            ("x-a", &["2"]),
            ("content-type", &["application/json"]),
            ("authorization", &["Bearer t"]),
            ("trailer", &["x-checksum"]),
            // As long as `connection`, and not hop-by-hop.
            ("user-agent", &["OpenAI/Python"]),
        ];
        let mut seed = 0x9e37_79b9_7f4a_7c15_u64;
        let mut next = |below: usize| {
            seed = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
            (seed >> 33) as usize % below
        };
        // Each name's values in order; the order of different names is not
        // significant (RFC 9110 section 5.3), and removals move names.
        let listed = |headers: &HeaderMap| -> Vec<(String, Vec<String>)> {
            let mut listed: Vec<_> = headers
                .keys()
                .map(|name| {
                    let values = headers.get_all(name).iter();
                    let values = values.map(|v| v.to_str().unwrap().to_string());
                    (name.to_string(), values.collect())
                })
                .collect();
            listed.sort();
            listed
        };
        for _ in 0..5_000 {
            let mut headers = HeaderMap::new();
            for _ in 0..next(6) {
                let (name, values) = HEADERS[next(HEADERS.len())];
                let value = values[next(values.len())];
                headers.append(name, value.parse().unwrap());
            }
            let given = listed(&headers);
            let mut expected = headers.clone();
            strip_every_name(&mut expected);
            strip_hop_by_hop(&mut headers);
            assert_eq!(listed(&headers), listed(&expected), "from {given:?}");
        }
    }

    #[test]
    fn a_te_that_accepts_trailers_becomes_te_trailers() {
        for (te, kept) in [
            ("trailers", Some("trailers")),
            ("gzip;q=0.5, Trailers", Some("trailers")),
            ("gzip, deflate", None),
            ("trailersx", None),
        ] {
            let mut headers = HeaderMap::new();
            headers.insert(header::TE, te.parse().unwrap());
            headers.insert(header::CONNECTION, "TE".parse().unwrap());
            strip_hop_by_hop(&mut headers);
            let left = headers.get(header::TE).map(|v| v.to_str().unwrap());
            assert_eq!(left, kept, "{te}");
            assert_eq!(headers.get(header::CONNECTION), None);
        }
    }
}
