//! Transfer codings the gateway cannot pass on. It decodes `chunked`, once,
//! and nothing else, in either direction: a body in another coding (`gzip,
//! chunked`) would otherwise go on with its coding's label dropped, as
//! `Transfer-Encoding` is hop-by-hop, and arrive as undecodable bytes. So
//! would a body chunked twice (`chunked, chunked`, which RFC 9112 section
//! 6.1 forbids a sender to make): hyper decodes one layer and would pass
//! the other on as the body.

use http::header::TRANSFER_ENCODING;
use http::HeaderMap;

/// The `Transfer-Encoding` of `headers`, in all its lines, unless it is
/// `chunked` once and nothing else, as hyper reads it: a request's gets
/// 501 (RFC 9112 section 6.1, as nginx answers), an upstream response's
/// 502. hyper frames a message as chunked when the last element of the
/// last line is `chunked`, so a list that ends in an empty element
/// (`chunked, `, or a `chunked` line and an empty one) is refused too: a
/// response so framed is read to the connection's end, its chunks passed
/// on as the body.
pub(crate) fn unsupported(headers: &HeaderMap) -> Option<String> {
    let values = headers.get_all(TRANSFER_ENCODING);
    // No header at all: nothing to decode.
    values.iter().next()?;
    let mut chunked = 0;
    let only_chunked = values.iter().all(|value| {
        value.to_str().is_ok_and(|codings| {
            codings
                .split(',')
                .map(str::trim)
                .filter(|coding| !coding.is_empty())
                .all(|coding| {
                    chunked += 1;
                    coding.eq_ignore_ascii_case("chunked")
                })
        })
    });
    let last_chunked = values
        .iter()
        .next_back()
        .and_then(|value| value.to_str().ok())
        .and_then(|codings| codings.rsplit(',').next())
        .is_some_and(|coding| coding.trim().eq_ignore_ascii_case("chunked"));
    if only_chunked && chunked == 1 && last_chunked {
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
    fn only_chunked_once_is_understood() {
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
        // hyper reads these as not chunked, to the connection's end.
        assert_eq!(coded(&["chunked, "]), Some("chunked, ".into()));
        assert_eq!(coded(&["chunked", ""]), Some("chunked, ".into()));
        assert_eq!(coded(&[""]), Some("".into()));
        assert_eq!(coded(&[" chunked "]), None);
        assert_eq!(
            coded(&["chunked, chunked"]),
            Some("chunked, chunked".into())
        );
        assert_eq!(
            coded(&["chunked", "chunked"]),
            Some("chunked, chunked".into())
        );
    }
}
