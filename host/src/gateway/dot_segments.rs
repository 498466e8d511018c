//! Whether a request path climbs above its root through `..` segments.
//!
//! Under an upstream base path (`--upstream http://host/api`) the gateway
//! asks the upstream for the base path followed by the request's path. A
//! request for `/../admin` would go as `/api/../admin`, which an upstream
//! that resolves dot segments (RFC 3986 section 5.2.4) serves as `/admin`:
//! outside the base path the operator gave. Such a request is refused
//! instead of forwarded; one whose `..` segments stay within its own path
//! (`/v1/x/../completions`) goes as it came.
//!
//! Servers disagree on what a segment is, so the count is the one that
//! climbs furthest under any common reading: `%2e` is a dot; `\`, `%2f` and
//! `%5c` end a segment as `/` does (Windows servers, and servers that decode
//! before they resolve); a segment ends its name at `;` or `%3b` (`..;x` is
//! `..` to Tomcat); and an empty segment does not count as a level, as
//! servers that merge slashes drop it. Only the path is read, never the
//! query.

/// Whether `path` (a request's path, without its query) has more `..`
/// segments at some point than segments to climb out of.
pub(crate) fn climbs_above_root(path: &str) -> bool {
    // Most paths have no dot, backslash or escape at all.
    if !path.bytes().any(|b| matches!(b, b'.' | b'%' | b'\\')) {
        return false;
    }
    let bytes = path.as_bytes();
    let mut depth: usize = 0;
    let mut segment = Segment::default();
    let mut at = 0;
    while at < bytes.len() {
        let (byte, width) = match (bytes[at], escaped(&bytes[at..])) {
            (b'%', Some(decoded)) => (decoded, 3),
            (byte, _) => (byte, 1),
        };
        at += width;
        if matches!(byte, b'/' | b'\\') {
            if segment.ends(&mut depth) {
                return true;
            }
            segment = Segment::default();
        } else {
            segment.push(byte);
        }
    }
    segment.ends(&mut depth)
}

/// The byte a `%XX` escape at the start of `bytes` stands for, when it is
/// one of those that matter here: a dot, a slash, a backslash or a
/// semicolon (`..%3b` is `..;`, so `..`, to a server that decodes before it
/// cuts a segment's parameters off).
fn escaped(bytes: &[u8]) -> Option<u8> {
    let hex = bytes.get(1..3)?;
    match [hex[0].to_ascii_lowercase(), hex[1].to_ascii_lowercase()] {
        [b'2', b'e'] => Some(b'.'),
        [b'2', b'f'] => Some(b'/'),
        [b'3', b'b'] => Some(b';'),
        [b'5', b'c'] => Some(b'\\'),
        _ => None,
    }
}

/// What has been read of one segment's name (up to any `;`).
#[derive(Default)]
struct Segment {
    /// Dots at the start of the name.
    dots: usize,
    /// Whether the name holds anything but dots.
    other: bool,
    /// Whether a `;` ended the name: the rest is parameters.
    in_parameters: bool,
}

impl Segment {
    /// Adds `byte` to the segment.
    fn push(&mut self, byte: u8) {
        if self.in_parameters {
            return;
        }
        match byte {
            b';' => self.in_parameters = true,
            b'.' if !self.other => self.dots += 1,
            _ => self.other = true,
        }
    }

    /// Ends the segment at `depth` levels below the root: whether it
    /// climbed above the root.
    fn ends(&self, depth: &mut usize) -> bool {
        match (self.other, self.dots) {
            // `..`: up a level.
            (false, 2) => match depth.checked_sub(1) {
                Some(up) => *depth = up,
                None => return true,
            },
            // Empty or `.`: the same level.
            (false, 0 | 1) => {}
            // A name (`...` is one too).
            _ => *depth += 1,
        }
        false
    }
}

#[cfg(test)]
mod tests {
    use super::climbs_above_root;

    #[test]
    fn paths_that_climb_above_their_root_are_found_however_they_are_written() {
        for path in [
            "/..",
            "/../admin",
            "/v1/../../admin",
            "/%2e%2e/admin",
            "/%2E%2E/admin",
            "/.%2e/admin",
            "/..%2fadmin",
            "/..%2Fadmin",
            "/..%5cadmin",
            "/..\\admin",
            "/v1\\..\\..\\admin",
            "/..;/admin",
            "/..;jsessionid=1/admin",
            "/..%3b/admin",
            "/..%3Bx/admin",
            // An empty segment is no level: merged, `//` is `/`.
            "/v1//../../admin",
            "/./../admin",
            "/v1/%2e%2e/%2e%2e",
        ] {
            assert!(climbs_above_root(path), "{path}");
        }
    }

    #[test]
    fn paths_that_stay_within_their_root_are_not() {
        for path in [
            "/",
            "",
            "/v1/completions",
            "/v1/x/../completions",
            "/v1/./completions",
            "/v1/...",
            "/.../admin",
            "/..a/admin",
            "/a../admin",
            "/v1/models/meta-llama%2FLlama-3",
            "/v1/%2e",
            "/v1/%2x%2e",
            "/v1/file.json",
            "/v1/a;b/../c",
            "/%",
            "/..%",
            "/..%2",
        ] {
            assert!(!climbs_above_root(path), "{path}");
        }
    }
}
