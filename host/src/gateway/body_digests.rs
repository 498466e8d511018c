//! The request headers that carry a digest of the body, which a body the
//! plugin rewrote no longer matches.
//!
//! A client may send a digest of its body for the upstream to check:
//! `Content-Digest` and `Repr-Digest` (RFC 9530), `Digest` (RFC 3230,
//! which RFC 9530 obsoletes) or `Content-MD5` (RFC 1864). Sent on with the
//! body the plugin stamped, the digest no longer matches it: an upstream
//! that checks digests would refuse every stamped request, as corrupted on
//! the way. So they are removed from a request whose body the plugin
//! changed, before the plugin's own header changes are made (a plugin that
//! computes a digest of its new body may set one). The gateway does not
//! compute new ones: it would vouch for a body it cannot tell matched the
//! client's digest. A body sent on unchanged keeps them.
//!
//! A signature over the request (`Signature`, RFC 9421) that covers the
//! body or a digest of it cannot match a changed body either; the gateway
//! leaves it alone, as only its signer could make it again.

use http::header::{HeaderMap, HeaderName};

/// The headers that digest the request's body, in lower case. Names as
/// text, not [`HeaderName`]s: a constant of those is made and dropped
/// again at each use, which cost a stamped request 250 instructions more.
pub const BODY_DIGESTS: [&str; 4] = ["content-digest", "repr-digest", "digest", "content-md5"];

/// Removes the body's digests from `headers` when the body sent on,
/// `sent`, is not the body the client sent, `received`. The bodies are
/// compared only when a digest is there to remove.
pub fn forget_stale(headers: &mut HeaderMap, received: &[u8], sent: &[u8]) {
    // One pass over the names, most of them passed over by their length:
    // a request carries a handful, and four lookups by hash cost a
    // stamped request about 150 instructions more.
    let carries_one = headers.keys().any(is_body_digest);
    if carries_one && received != sent {
        for name in BODY_DIGESTS {
            headers.remove(name);
        }
    }
}

/// Whether `name` is one of [`BODY_DIGESTS`].
fn is_body_digest(name: &HeaderName) -> bool {
    let name = name.as_str();
    matches!(name.len(), 6 | 11 | 14) && BODY_DIGESTS.contains(&name)
}

#[cfg(test)]
mod tests {
    use http::HeaderValue;

    use super::*;

    fn with_every_digest() -> HeaderMap {
        let mut headers = HeaderMap::new();
        for name in BODY_DIGESTS {
            headers.insert(name, HeaderValue::from_static("sha-256=:AAAA:"));
        }
        headers.insert("content-type", HeaderValue::from_static("application/json"));
        headers
    }

    #[test]
    fn a_changed_body_loses_every_digest_and_nothing_else() {
        let mut headers = with_every_digest();
        forget_stale(&mut headers, b"{}", b"{\"id\":1}");
        assert_eq!(headers.len(), 1, "{headers:?}");
        assert_eq!(headers["content-type"], "application/json");
    }

    #[test]
    fn each_digest_alone_is_found_and_removed() {
        for name in BODY_DIGESTS {
            let mut headers = HeaderMap::new();
            headers.insert(name, HeaderValue::from_static("x"));
            headers.insert("digests", HeaderValue::from_static("not one"));
            forget_stale(&mut headers, b"{}", b"[]");
            assert!(!headers.contains_key(name), "{name}");
            assert!(headers.contains_key("digests"), "{name}");
        }
    }

    #[test]
    fn the_same_body_sent_on_keeps_its_digests() {
        let mut headers = with_every_digest();
        forget_stale(&mut headers, b"{}", b"{}");
        assert_eq!(headers, with_every_digest());
    }
}
