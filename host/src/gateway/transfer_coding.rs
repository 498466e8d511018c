//! Transfer codings the gateway cannot pass on. It decodes `chunked` and
//! nothing else, in either direction: a body in another coding (`gzip,
//! chunked`) would otherwise go on with its coding's label dropped, as
//! `Transfer-Encoding` is hop-by-hop, and arrive as undecodable bytes.

use http::header::TRANSFER_ENCODING;
use http::HeaderMap;

/// The `Transfer-Encoding` of `headers`, when it names a coding other than
/// `chunked`: a request's gets 501 (RFC 9112 section 6.1), an upstream
/// response's 502.
pub(crate) fn unsupported(headers: &HeaderMap) -> Option<String> {
    let values = headers.get_all(TRANSFER_ENCODING);
    let understood = values.iter().all(|value| {
        value.to_str().is_ok_and(|codings| {
            codings
                .split(',')
                .map(str::trim)
                .all(|coding| coding.is_empty() || coding.eq_ignore_ascii_case("chunked"))
        })
    });
    if understood {
        return None;
    }
    let named: Vec<String> = values
        .iter()
        .map(|value| String::from_utf8_lossy(value.as_bytes()).into_owned())
        .collect();
    Some(named.join(", "))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_chunked_is_understood() {
        let coded = |values: &[&str]| {
            let mut headers = HeaderMap::new();
            for value in values {
                headers.append(TRANSFER_ENCODING, value.parse().unwrap());
            }
            unsupported(&headers)
        };
        assert_eq!(coded(&[]), None);
        assert_eq!(coded(&["chunked"]), None);
        assert_eq!(coded(&["Chunked"]), None);
        assert_eq!(coded(&["gzip, chunked"]), Some("gzip, chunked".into()));
        assert_eq!(coded(&["gzip", "chunked"]), Some("gzip, chunked".into()));
        assert_eq!(coded(&["chunked, gzip"]), Some("chunked, gzip".into()));
    }
}
