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

/// The headers that digest the request's body, in lower case.
pub const BODY_DIGESTS: [HeaderName; 4] = [
    HeaderName::from_static("content-digest"),
    HeaderName::from_static("repr-digest"),
    HeaderName::from_static("digest"),
    HeaderName::from_static("content-md5"),
];

/// Removes the body's digests from `headers` when the body sent on,
/// `sent`, is not the body the client sent, `received`. The bodies are
/// compared only when a digest is there to remove.
pub fn forget_stale(headers: &mut HeaderMap, received: &[u8], sent: &[u8]) {
    let carries_one = BODY_DIGESTS.iter().any(|name| headers.contains_key(name));
    if carries_one && received != sent {
        for name in &BODY_DIGESTS {
            headers.remove(name);
        }
    }
}

#[cfg(test)]
mod tests {
    use http::HeaderValue;

    use super::*;

    fn with_every_digest() -> HeaderMap {
        let mut headers = HeaderMap::new();
        for name in &BODY_DIGESTS {
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
    fn the_same_body_sent_on_keeps_its_digests() {
        let mut headers = with_every_digest();
        forget_stale(&mut headers, b"{}", b"{}");
        assert_eq!(headers, with_every_digest());
    }
}
