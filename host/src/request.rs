//! The request a plugin is asked about, as the host holds it, and how it
//! reaches the plugin: method, path and body are copied into the plugin's
//! memory with the call; the headers stay in the host, and the plugin reads
//! those it needs through the `request-headers` import.

use std::sync::Arc;

use wasmtime::component::{ComponentType, Lower};

use crate::bindings::snowgate::middleware::request_headers;
use crate::state::HostState;

/// A request's headers: names in lower case and raw values, in the order
/// received. Shared, not copied, with the plugin call that reads them
/// (`vec![...].into()` makes one).
pub type Headers = Arc<[(String, Vec<u8>)]>;

/// One HTTP request, as a plugin sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    /// The method, upper case, e.g. `POST`.
    pub method: String,
    /// The path and query, e.g. `/v1/completions?x=1`.
    pub path: String,
    /// Header names (lower case) and raw values, in the order received.
    pub headers: Headers,
    /// The complete request body.
    pub body: Vec<u8>,
}

/// The `request` record of the world's `handler` interface, lowered from
/// a borrowed [`Request`] without copying it first.
#[derive(ComponentType, Lower, Clone, Copy)]
#[component(record)]
pub(crate) struct RequestRecord<'r> {
    method: &'r str,
    path: &'r str,
    body: &'r [u8],
}

impl<'r> RequestRecord<'r> {
    /// The record of `request`, borrowing its parts.
    pub(crate) fn of(request: &'r Request) -> RequestRecord<'r> {
        RequestRecord {
            method: &request.method,
            path: &request.path,
            body: &request.body,
        }
    }
}

/// The values of the header `name` (ASCII case ignored), in order.
fn values(headers: &[(String, Vec<u8>)], name: &str) -> Vec<Vec<u8>> {
    headers
        .iter()
        .filter(|(n, _)| n.eq_ignore_ascii_case(name))
        .map(|(_, v)| v.clone())
        .collect()
}

impl request_headers::Host for HostState {
    fn get(&mut self, name: String) -> Vec<Vec<u8>> {
        self.request_headers()
            .map_or_else(Vec::new, |headers| values(headers, &name))
    }

    fn entries(&mut self) -> Vec<(String, Vec<u8>)> {
        self.request_headers()
            .map_or_else(Vec::new, |headers| headers.to_vec())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_match_names_ignoring_ascii_case_and_keep_their_order() {
        let headers: Headers = vec![
            ("accept".to_string(), b"a".to_vec()),
            ("x-trtllm-msgpack".to_string(), b"1".to_vec()),
            ("accept".to_string(), b"b".to_vec()),
        ]
        .into();
        assert_eq!(
            values(&headers, "Accept"),
            vec![b"a".to_vec(), b"b".to_vec()]
        );
        assert_eq!(values(&headers, "X-TRTLLM-Msgpack"), vec![b"1".to_vec()]);
        assert!(values(&headers, "content-type").is_empty());
        // Not a prefix or a substring match.
        assert!(values(&headers, "accep").is_empty());
    }
}
