//! Where ids go: a validating, byte-preserving walk over a JSON body that
//! finds every effective `disaggregated_params` object needing an id.
//!
//! The walk reads JSON the way Python's `json` and serde_json agree on (where
//! they differ, see `README.md`: it refuses `NaN` and nesting past
//! [`MAX_NESTING_DEPTH`], and takes lone surrogate escapes and `1e400`, as
//! Python does): keys match after unescaping, the last of duplicate keys wins (so only the effective
//! member's value counts), and string contents are data. It never rewrites
//! anything: it returns the byte positions where an id must be inserted or
//! where a `null` must be replaced, and [`crate::stamp`] splices ids in there.

use std::borrow::Cow;
use std::fmt;

use crate::edits_by_key::EditsByKey;

mod scan;
use scan::skip_plain_words;

/// The most digits an integer may have: Python refuses to convert longer
/// decimal strings to `int` (since 3.11, 3.10.7 and 3.9.14, against
/// CVE-2020-10735), so `json.loads` refuses such a body.
const MAX_INTEGER_DIGITS: usize = 4300;

/// The deepest nesting of arrays and objects a body may have (serde_json's
/// default stops one level earlier); requests nest a handful of levels.
pub const MAX_NESTING_DEPTH: usize = 128;

/// The key that holds the parameters.
pub(crate) const PARAMS_KEY: &[u8] = b"disaggregated_params";
/// The member that says which phase the request is for.
pub(crate) const REQUEST_TYPE_KEY: &[u8] = b"request_type";
/// The member that carries the id.
pub(crate) const ID_KEY: &[u8] = b"disagg_request_id";
/// The only request type that gets a new id.
pub(crate) const CONTEXT_ONLY: &[u8] = b"context_only";
/// A UTF-8 byte order mark: valid UTF-8, but not JSON.
const UTF8_BOM: &[u8] = b"\xEF\xBB\xBF";

/// One change that an id makes to the body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Edit {
    /// Insert `"disagg_request_id":ID` at byte `at`, preceded by a comma when
    /// the object already has members.
    InsertMember {
        /// Byte offset just after the object's last member value (or just
        /// after `{` for an empty object).
        at: usize,
        /// Whether a `,` must precede the new member.
        comma: bool,
    },
    /// Replace the 4-byte `null` starting at byte `at` with the id.
    ReplaceNull {
        /// Byte offset of the `n` of `null`.
        at: usize,
    },
}

impl Edit {
    /// The byte offset the edit applies at.
    pub fn at(self) -> usize {
        match self {
            Edit::InsertMember { at, .. } | Edit::ReplaceNull { at } => at,
        }
    }
}

/// Why a body cannot be read as JSON.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BodyError {
    /// The body is empty or only whitespace.
    Empty,
    /// The body is not valid UTF-8.
    InvalidUtf8 {
        /// Byte offset of the first invalid byte.
        offset: usize,
    },
    /// The body breaks the JSON grammar.
    Syntax {
        /// Byte offset where the problem was found.
        offset: usize,
        /// Line (1-based) of `offset`.
        line: usize,
        /// Column (1-based, in bytes) of `offset`.
        column: usize,
        /// What the grammar wanted there, or what was wrong.
        problem: &'static str,
    },
    /// Arrays and objects nest deeper than [`MAX_NESTING_DEPTH`].
    TooDeep {
        /// Byte offset of the opening bracket that went too deep.
        offset: usize,
    },
}

impl BodyError {
    /// A short machine-readable code for the error.
    pub fn code(&self) -> &'static str {
        match self {
            BodyError::Empty => "empty_body",
            BodyError::InvalidUtf8 { .. } => "invalid_utf8",
            BodyError::Syntax { .. } => "invalid_json",
            BodyError::TooDeep { .. } => "nesting_too_deep",
        }
    }
}

impl fmt::Display for BodyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BodyError::Empty => {
                f.write_str("the request body is empty or only whitespace; send a JSON object")
            }
            BodyError::InvalidUtf8 { offset } => {
                write!(f, "the request body is not valid UTF-8 (first bad byte at offset {offset}); JSON must be UTF-8")
            }
            BodyError::Syntax { offset, line, column, problem } => write!(
                f,
                "the request body is not valid JSON: {problem} at line {line} column {column} (byte {offset})"
            ),
            BodyError::TooDeep { offset } => write!(
                f,
                "the request body nests arrays and objects deeper than {MAX_NESTING_DEPTH} levels (at byte {offset})"
            ),
        }
    }
}

impl std::error::Error for BodyError {}

/// Validates `body` as one JSON value and returns, in byte order, the edits
/// that give every effective context-only `disaggregated_params` object
/// without an id its id.
///
/// UTF-8 is checked in the same pass: the walk accepts only ASCII outside
/// strings and checks each string that holds other bytes, so a body it
/// accepts is valid UTF-8. A body it refuses is checked whole, so that
/// invalid UTF-8 anywhere is reported as such, before any grammar error.
pub fn find_edits(body: &[u8]) -> Result<Vec<Edit>, BodyError> {
    walk_body(body).map_err(|e| match std::str::from_utf8(body) {
        Err(bad) => BodyError::InvalidUtf8 {
            offset: bad.valid_up_to(),
        },
        Ok(_) => e,
    })
}

/// [`find_edits`] before its errors are ranked.
fn walk_body(body: &[u8]) -> Result<Vec<Edit>, BodyError> {
    let mut walk = Walk {
        bytes: body,
        pos: 0,
        depth: 0,
        edits: Vec::new(),
    };
    if body.starts_with(UTF8_BOM) {
        return Err(walk.syntax(
            "the body starts with a UTF-8 byte order mark (BOM), which JSON does not allow",
        ));
    }
    // JSON text never holds a zero byte; one among the first two is how
    // UTF-16 and UTF-32 text without a byte order mark begins.
    if body.iter().take(2).any(|&b| b == 0) {
        return Err(walk.syntax(
            "the body looks like UTF-16 or UTF-32 (a zero byte among its first two); JSON must \
             be UTF-8",
        ));
    }
    walk.skip_whitespace();
    if walk.pos == body.len() {
        return Err(BodyError::Empty);
    }
    walk.value(false)?;
    walk.skip_whitespace();
    if walk.pos != body.len() {
        return Err(walk.syntax("unexpected data after the JSON value"));
    }
    let mut edits = live_edits(walk.edits);
    // An object's own edit is recorded when it closes, after its children's.
    // Each is at a byte of its own, so an unstable sort (which needs no
    // scratch memory: a stable one takes up to 8 MB for a dense body) gives
    // the one order.
    edits.sort_unstable_by_key(|e| e.at());
    Ok(edits)
}

/// The edits not under a key that a later duplicate key overrode. `None`
/// takes no more room than an edit, so they are gathered in the walk's own
/// list rather than a second one: a dense body's edits are most of the
/// plugin's memory after the body itself.
// `filter_map` is collected in place, into the same allocation; `flatten`,
// which clippy would have here, is not, and takes a second list.
#[allow(clippy::filter_map_identity)]
pub(crate) fn live_edits<E>(edits: Vec<Option<E>>) -> Vec<E> {
    edits.into_iter().filter_map(|e| e).collect()
}

/// What kind of value was just read, with what the params logic needs.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Value {
    /// A string; `start..end` is its content between the quotes.
    String {
        start: usize,
        end: usize,
        escaped: bool,
    },
    /// The literal `null`, starting at `at`.
    Null { at: usize },
    /// Anything else.
    Other,
}

/// The state of a `disaggregated_params` object while it is read.
enum IdMember {
    Missing,
    Null { at: usize },
    Set,
}

/// The walker: a recursive-descent validator that records edits as it goes.
struct Walk<'a> {
    bytes: &'a [u8],
    pos: usize,
    depth: usize,
    /// Edits in the order found; `None` once the edit sits in a member
    /// that a later duplicate key overrides.
    edits: Vec<Option<Edit>>,
}

impl<'a> Walk<'a> {
    fn syntax(&self, problem: &'static str) -> BodyError {
        let offset = self.pos.min(self.bytes.len());
        let before = &self.bytes[..offset];
        let line = before.iter().filter(|&&b| b == b'\n').count() + 1;
        let column = offset
            - before
                .iter()
                .rposition(|&b| b == b'\n')
                .map_or(0, |p| p + 1)
            + 1;
        BodyError::Syntax {
            offset,
            line,
            column,
            problem,
        }
    }

    fn peek(&self) -> Option<u8> {
        self.bytes.get(self.pos).copied()
    }

    fn skip_whitespace(&mut self) {
        while let Some(b' ' | b'\t' | b'\n' | b'\r') = self.peek() {
            self.pos += 1;
        }
    }

    /// Reads one value at `pos` (whitespace already skipped). `params` says
    /// the value belongs to a `disaggregated_params` key.
    ///
    /// Inlined into its callers, so that only objects and arrays are calls
    /// of their own: in wasm every call of the walk's large functions pays
    /// a prologue of some 70 instructions, and most values are strings.
    #[inline(always)]
    fn value(&mut self, params: bool) -> Result<Value, BodyError> {
        match self.peek() {
            Some(b'{') => self.object(params).map(|()| Value::Other),
            Some(b'[') => self.array().map(|()| Value::Other),
            Some(b'"') => self.string().map(|(start, end, escaped)| Value::String {
                start,
                end,
                escaped,
            }),
            Some(b'n') => {
                let at = self.pos;
                self.literal(b"null").map(|()| Value::Null { at })
            }
            Some(b't') => self.literal(b"true").map(|()| Value::Other),
            Some(b'f') => self.literal(b"false").map(|()| Value::Other),
            Some(b'-' | b'0'..=b'9') => self.number().map(|()| Value::Other),
            Some(_) => Err(self.syntax(
                self.python_only_number(self.pos)
                    .unwrap_or("expected a JSON value"),
            )),
            None => Err(self.syntax("the body ends where a JSON value was expected")),
        }
    }

    /// What is wrong with a word at `at` that Python's `json` reads as a
    /// number and JSON has not (`NaN`, `Infinity`, `-Infinity`), when one
    /// is there: named, since "expected a JSON value" would leave a client
    /// that sent it from Python wondering.
    fn python_only_number(&self, at: usize) -> Option<&'static str> {
        let rest = &self.bytes[at.min(self.bytes.len())..];
        [&b"NaN"[..], b"Infinity", b"-Infinity"]
            .iter()
            .any(|word| rest.starts_with(word))
            .then_some(
                "NaN and Infinity are not JSON: Python's json module reads them, but a body \
                 that is not strict JSON is refused",
            )
    }

    fn literal(&mut self, word: &'static [u8]) -> Result<(), BodyError> {
        if self.bytes[self.pos..].starts_with(word) {
            self.pos += word.len();
            Ok(())
        } else {
            Err(self.syntax("expected a JSON value (true, false, null, a number, a string, an array or an object)"))
        }
    }

    fn digits(&mut self) -> usize {
        let start = self.pos;
        while let Some(b'0'..=b'9') = self.peek() {
            self.pos += 1;
        }
        self.pos - start
    }

    /// Reads a number. Inlined like the string reader: as a call of its own
    /// its frame cost some 160 instructions a number in wasm.
    #[inline(always)]
    fn number(&mut self) -> Result<(), BodyError> {
        let start = self.pos;
        if self.peek() == Some(b'-') {
            self.pos += 1;
        }
        let integer_digits = match self.peek() {
            Some(b'0') => {
                self.pos += 1;
                if let Some(b'0'..=b'9') = self.peek() {
                    return Err(
                        self.syntax("a number has a leading zero, which JSON does not allow")
                    );
                }
                1
            }
            Some(b'1'..=b'9') => self.digits(),
            _ => {
                let problem = self.python_only_number(start);
                return Err(self.syntax(problem.unwrap_or("expected a digit in a number")));
            }
        };
        let integer_end = self.pos;
        if self.peek() == Some(b'.') {
            self.pos += 1;
            if self.digits() == 0 {
                return Err(self.syntax("expected a digit after the decimal point"));
            }
        }
        if let Some(b'e' | b'E') = self.peek() {
            self.pos += 1;
            if let Some(b'+' | b'-') = self.peek() {
                self.pos += 1;
            }
            if self.digits() == 0 {
                return Err(self.syntax("expected a digit in the exponent"));
            }
        }
        // An integer: no fraction, no exponent.
        if self.pos == integer_end && integer_digits > MAX_INTEGER_DIGITS {
            self.pos = start;
            return Err(self.syntax(
                "an integer has more than 4300 digits, which Python's json module refuses \
                 (sys.int_info.default_max_str_digits)",
            ));
        }
        Ok(())
    }

    /// Reads a string; returns its content range and whether it has escapes.
    /// Inlined into its two callers (values and keys): in wasm a call costs
    /// a stack-limit and an epoch check, and the 1 KiB chat request of the
    /// benchmarks holds 23 strings, keys included.
    #[inline(always)]
    fn string(&mut self) -> Result<(usize, usize, bool), BodyError> {
        self.pos += 1; // the opening quote
        let start = self.pos;
        let mut escaped = false;
        let mut non_ascii = false;
        loop {
            let (pos, skipped_non_ascii) = skip_plain_words(self.bytes, self.pos);
            self.pos = pos;
            non_ascii |= skipped_non_ascii;
            match self.peek() {
                Some(b'"') => {
                    let end = self.pos;
                    if non_ascii {
                        if let Err(bad) = std::str::from_utf8(&self.bytes[start..end]) {
                            return Err(BodyError::InvalidUtf8 {
                                offset: start + bad.valid_up_to(),
                            });
                        }
                    }
                    self.pos += 1;
                    return Ok((start, end, escaped));
                }
                Some(b'\\') => {
                    escaped = true;
                    self.pos += 1;
                    match self.peek() {
                        Some(b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't') => {
                            self.pos += 1
                        }
                        Some(b'u') => {
                            self.pos += 1;
                            let hex = self.bytes.get(self.pos..self.pos + 4);
                            if !hex.is_some_and(|h| h.iter().all(u8::is_ascii_hexdigit)) {
                                return Err(self.syntax("expected four hex digits after \\u"));
                            }
                            self.pos += 4;
                        }
                        _ => return Err(self.syntax("invalid escape in a string")),
                    }
                }
                Some(0x00..=0x1f) => {
                    return Err(self.syntax("control character inside a string (escape it)"))
                }
                Some(b) => {
                    non_ascii |= !b.is_ascii();
                    self.pos += 1
                }
                None => return Err(self.syntax("the body ends inside a string")),
            }
        }
    }

    fn enter(&mut self) -> Result<(), BodyError> {
        if self.depth == MAX_NESTING_DEPTH {
            return Err(BodyError::TooDeep { offset: self.pos });
        }
        self.depth += 1;
        self.pos += 1; // the opening bracket
        Ok(())
    }

    #[inline(never)]
    fn array(&mut self) -> Result<(), BodyError> {
        self.enter()?;
        self.skip_whitespace();
        if self.peek() == Some(b']') {
            self.pos += 1;
            self.depth -= 1;
            return Ok(());
        }
        loop {
            self.skip_whitespace();
            self.value(false)?;
            self.skip_whitespace();
            match self.peek() {
                Some(b',') => self.pos += 1,
                Some(b']') => {
                    self.pos += 1;
                    self.depth -= 1;
                    return Ok(());
                }
                Some(_) => return Err(self.syntax("expected ',' or ']' after an array element")),
                None => return Err(self.syntax("the body ends inside an array")),
            }
        }
    }

    /// Reads an object. When `params` is set, it is a `disaggregated_params`
    /// value: decide from its effective members whether it needs an id.
    #[inline(never)]
    fn object(&mut self, params: bool) -> Result<(), BodyError> {
        let open = self.pos;
        self.enter()?;
        // The edits of each member whose value produced some, by unescaped
        // key, so that a later duplicate key can cancel them. Not a list:
        // scanning every earlier member for each key made bodies with many
        // members quadratic (4 MiB took seconds).
        let mut with_edits: EditsByKey<Cow<'a, [u8]>> = EditsByKey::new();
        let mut context_only = false;
        let mut id = IdMember::Missing;
        let mut last_value_end = None;
        self.skip_whitespace();
        if self.peek() == Some(b'}') {
            self.pos += 1;
        } else {
            loop {
                self.skip_whitespace();
                if self.peek() != Some(b'"') {
                    return Err(self.syntax(if self.pos == self.bytes.len() {
                        "the body ends inside an object"
                    } else {
                        "expected a string key in an object"
                    }));
                }
                let (start, end, escaped) = self.string()?;
                let key = text(self.bytes, start, end, escaped);
                self.skip_whitespace();
                if self.peek() != Some(b':') {
                    return Err(self.syntax("expected ':' after an object key"));
                }
                self.pos += 1;
                self.skip_whitespace();
                if let Some(range) = with_edits.remove(key.as_ref()) {
                    self.edits[range].iter_mut().for_each(|e| *e = None);
                }
                let first_edit = self.edits.len();
                let value = self.value(key.as_ref() == PARAMS_KEY)?;
                if params {
                    if key.as_ref() == REQUEST_TYPE_KEY {
                        context_only = match value {
                            Value::String {
                                start,
                                end,
                                escaped,
                            } => text(self.bytes, start, end, escaped)
                                .eq_ignore_ascii_case(CONTEXT_ONLY),
                            _ => false,
                        };
                    } else if key.as_ref() == ID_KEY {
                        id = match value {
                            Value::Null { at } => IdMember::Null { at },
                            _ => IdMember::Set,
                        };
                    }
                }
                if self.edits.len() > first_edit {
                    with_edits.insert(key, first_edit..self.edits.len());
                }
                last_value_end = Some(self.pos);
                self.skip_whitespace();
                match self.peek() {
                    Some(b',') => self.pos += 1,
                    Some(b'}') => {
                        self.pos += 1;
                        break;
                    }
                    Some(_) => {
                        return Err(self.syntax("expected ',' or '}' after an object member"))
                    }
                    None => return Err(self.syntax("the body ends inside an object")),
                }
            }
        }
        self.depth -= 1;
        if params && context_only {
            let edit = match id {
                IdMember::Missing => Some(match last_value_end {
                    Some(at) => Edit::InsertMember { at, comma: true },
                    None => Edit::InsertMember {
                        at: open + 1,
                        comma: false,
                    },
                }),
                IdMember::Null { at } => Some(Edit::ReplaceNull { at }),
                IdMember::Set => None,
            };
            if let Some(edit) = edit {
                self.edits.push(Some(edit));
            }
        }
        Ok(())
    }
}

/// The unescaped text of the string content `bytes[start..end]`, as bytes.
/// A lone surrogate escape becomes its WTF-8 bytes, so it compares equal
/// only to itself, as in Python.
///
/// The common case, no escape, is inlined: in wasm the call alone cost some
/// 70 instructions a key, the frame the unescaping needs.
#[inline(always)]
fn text(bytes: &[u8], start: usize, end: usize, escaped: bool) -> Cow<'_, [u8]> {
    let raw = &bytes[start..end];
    if escaped {
        Cow::Owned(unescape(raw))
    } else {
        Cow::Borrowed(raw)
    }
}

/// The unescaped bytes of string content `raw` (validated by the walk).
#[inline(never)]
fn unescape(raw: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(raw.len());
    let mut i = 0;
    while i < raw.len() {
        if raw[i] != b'\\' {
            out.push(raw[i]);
            i += 1;
            continue;
        }
        let simple = match raw[i + 1] {
            b'b' => Some(0x08),
            b'f' => Some(0x0c),
            b'n' => Some(b'\n'),
            b'r' => Some(b'\r'),
            b't' => Some(b'\t'),
            b'u' => None,
            other => Some(other), // '"', '\\', '/'
        };
        if let Some(byte) = simple {
            out.push(byte);
            i += 2;
            continue;
        }
        let unit = hex4(&raw[i + 2..i + 6]);
        i += 6;
        let mut code = unit;
        if (0xD800..0xDC00).contains(&unit) && raw.get(i..i + 2) == Some(b"\\u") {
            let low = hex4(&raw[i + 2..i + 6]);
            if (0xDC00..0xE000).contains(&low) {
                code = 0x10000 + ((unit - 0xD800) << 10) + (low - 0xDC00);
                i += 6;
            }
        }
        push_wtf8(&mut out, code);
    }
    out
}

/// Four hex digits (already validated by the walk) as a number.
fn hex4(digits: &[u8]) -> u32 {
    digits.iter().fold(0, |acc, &d| {
        acc * 16 + (d as char).to_digit(16).unwrap_or(0)
    })
}

/// Appends a code point in UTF-8, allowing surrogates (WTF-8).
fn push_wtf8(out: &mut Vec<u8>, code: u32) {
    match code {
        0..=0x7f => out.push(code as u8),
        0x80..=0x7ff => out.extend([0xc0 | (code >> 6) as u8, 0x80 | (code & 0x3f) as u8]),
        0x800..=0xffff => out.extend([
            0xe0 | (code >> 12) as u8,
            0x80 | ((code >> 6) & 0x3f) as u8,
            0x80 | (code & 0x3f) as u8,
        ]),
        _ => out.extend([
            0xf0 | (code >> 18) as u8,
            0x80 | ((code >> 12) & 0x3f) as u8,
            0x80 | ((code >> 6) & 0x3f) as u8,
            0x80 | (code & 0x3f) as u8,
        ]),
    }
}

#[cfg(test)]
mod tests {
    use super::{live_edits, Edit};

    /// The live edits are gathered in the walk's own list, not copied to a
    /// second one: on a dense body that second list was about a tenth of
    /// the plugin's memory.
    #[test]
    fn live_edits_are_gathered_in_the_walks_own_list() {
        let found: Vec<Option<Edit>> = (0..1000)
            .map(|at| (at % 3 != 0).then_some(Edit::ReplaceNull { at }))
            .collect();
        let buffer = found.as_ptr() as usize;
        let live = live_edits(found);
        assert_eq!(live.len(), 666);
        assert!(live.iter().all(|e| e.at() % 3 != 0));
        assert_eq!(live.as_ptr() as usize, buffer, "the edits were copied");
    }
}
