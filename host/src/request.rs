//! The request a plugin is asked about, as the host holds it, and how it
//! reaches the plugin: method, path and body are copied into the plugin's
//! memory with the call; the headers stay in the host, and the plugin reads
//! those it needs through the `request-headers` import.

use std::sync::Arc;

use http::HeaderMap;
use wasmtime::component::{ComponentType, Lower};

use crate::bindings::snowgate::middleware::request_headers;
use crate::state::HostState;

/// A request's headers: names in lower case and raw values, in the order
/// received (from a map: grouped by name, names in the order they first
/// came). Shared, not copied, with the plugin call that reads them.
/// Made from a list (`vec![...].into()`) or from an `http::HeaderMap`,
/// which the gateway lends to the call and takes back after it
/// ([`Headers::into_map`]): a request's headers are never copied but for
/// those the plugin asks for.
#[derive(Debug, Clone)]
pub struct Headers(Arc<Source>);

#[derive(Debug)]
enum Source {
    List(Vec<(String, Vec<u8>)>),
    Map(HeaderMap),
}

impl Headers {
    /// Every header, in order: name and raw value.
    pub fn iter(&self) -> Box<dyn Iterator<Item = (&str, &[u8])> + '_> {
        match &*self.0 {
            Source::List(list) => Box::new(list.iter().map(|(n, v)| (n.as_str(), v.as_slice()))),
            Source::Map(map) => Box::new(map.iter().map(|(n, v)| (n.as_str(), v.as_bytes()))),
        }
    }

    /// Every header, copied: name and raw value.
    pub fn to_vec(&self) -> Vec<(String, Vec<u8>)> {
        self.iter()
            .map(|(name, value)| (name.to_string(), value.to_vec()))
            .collect()
    }

    /// The values of the header `name` (ASCII case ignored), in order,
    /// copied.
    pub fn values(&self, name: &str) -> Vec<Vec<u8>> {
        match &*self.0 {
            Source::List(list) => list
                .iter()
                .filter(|(n, _)| n.eq_ignore_ascii_case(name))
                .map(|(_, v)| v.clone())
                .collect(),
            // The map finds a name in any case; a name that is not a valid
            // header name has no values.
            Source::Map(map) => map
                .get_all(name)
                .iter()
                .map(|v| v.as_bytes().to_vec())
                .collect(),
        }
    }

    /// The `HeaderMap` these headers were made from, without a copy when
    /// nothing else holds them any more (a plugin call gives its share back
    /// when it ends); otherwise, or for a list, a map built from them
    /// (entries that are not valid HTTP headers are left out).
    pub fn into_map(self) -> HeaderMap {
        match Arc::try_unwrap(self.0) {
            Ok(Source::Map(map)) => map,
            Ok(Source::List(list)) => list_to_map(&list),
            Err(shared) => match &*shared {
                Source::Map(map) => map.clone(),
                Source::List(list) => list_to_map(list),
            },
        }
    }
}

fn list_to_map(list: &[(String, Vec<u8>)]) -> HeaderMap {
    let mut map = HeaderMap::with_capacity(list.len());
    for (name, value) in list {
        let name = http::HeaderName::from_bytes(name.as_bytes());
        let value = http::HeaderValue::from_bytes(value);
        if let (Ok(name), Ok(value)) = (name, value) {
            map.append(name, value);
        }
    }
    map
}

impl Default for Headers {
    fn default() -> Headers {
        Headers(Arc::new(Source::List(Vec::new())))
    }
}

/// Equal when they hold the same headers in the same order, whatever
/// they were made from.
impl PartialEq for Headers {
    fn eq(&self, other: &Headers) -> bool {
        self.iter().eq(other.iter())
    }
}

impl Eq for Headers {}

/// Names are lowered (ASCII), as the contract promises plugins.
impl From<Vec<(String, Vec<u8>)>> for Headers {
    fn from(mut list: Vec<(String, Vec<u8>)>) -> Headers {
        for (name, _) in &mut list {
            name.make_ascii_lowercase();
        }
        Headers(Arc::new(Source::List(list)))
    }
}

impl From<HeaderMap> for Headers {
    fn from(map: HeaderMap) -> Headers {
        Headers(Arc::new(Source::Map(map)))
    }
}

/// One HTTP request, as a plugin sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    /// The method as the client sent it, e.g. `POST` (methods are
    /// case-sensitive).
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

impl request_headers::Host for HostState {
    // Never called by the engine: `in_place_imports` links a version that
    // reads the text in the plugin's memory, with the same checks.
    fn get(&mut self, name: String) -> Vec<Vec<u8>> {
        self.request_headers()
            .map_or_else(Vec::new, |headers| headers.values(&name))
    }

    fn entries(&mut self) -> Vec<(String, Vec<u8>)> {
        self.request_headers()
            .map_or_else(Vec::new, Headers::to_vec)
    }
}

/// Joins the `cookie` fields of a request into one, `; ` between them, as
/// RFC 9113 section 8.2.3 asks of a request going on over HTTP/1.1: HTTP/2
/// clients send each cookie as a field of its own (and a plugin may append
/// one), and HTTP/1 servers read one `Cookie` line (some only the first).
pub(crate) fn join_cookies(headers: &mut HeaderMap) {
    let mut cookies = headers.get_all(http::header::COOKIE).iter();
    if cookies.next().is_none() || cookies.next().is_none() {
        return;
    }
    let mut joined = Vec::new();
    for cookie in headers.get_all(http::header::COOKIE) {
        if !joined.is_empty() {
            joined.extend_from_slice(b"; ");
        }
        joined.extend_from_slice(cookie.as_bytes());
    }
    // Made of valid field values and "; ": valid too.
    if let Ok(value) = http::HeaderValue::from_bytes(&joined) {
        headers.insert(http::header::COOKIE, value);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn list() -> Vec<(String, Vec<u8>)> {
        vec![
            ("accept".to_string(), b"a".to_vec()),
            ("x-trtllm-msgpack".to_string(), b"1".to_vec()),
            ("accept".to_string(), b"b".to_vec()),
        ]
    }

    /// A list and a map answer alike.
    #[test]
    fn values_match_names_ignoring_ascii_case_and_keep_their_order() {
        let from_list = Headers::from(list());
        let from_map = Headers::from(Headers::from(list()).into_map());
        for headers in [from_list, from_map] {
            let values = |name| headers.values(name);
            assert_eq!(values("Accept"), vec![b"a".to_vec(), b"b".to_vec()]);
            assert_eq!(values("X-TRTLLM-Msgpack"), vec![b"1".to_vec()]);
            assert!(values("content-type").is_empty());
            // Not a prefix or a substring match, and no panic on a name
            // that is not a header name.
            assert!(values("accep").is_empty());
            assert!(values("not a name").is_empty());
            assert!(values("").is_empty());
            assert!(values(&"x".repeat(100_000)).is_empty());
        }
    }

    /// The map a call gave back is the one lent, not a copy (a copy keeps
    /// its entries elsewhere); a shared one is copied.
    #[test]
    fn into_map_gives_back_the_lent_map() {
        let mut map = HeaderMap::new();
        map.append("accept", http::HeaderValue::from_static("a"));
        map.append("accept", http::HeaderValue::from_static("b"));
        let entries = |map: &HeaderMap| map.get("accept").map(std::ptr::from_ref);
        let expected = map.clone();
        assert_ne!(entries(&expected), entries(&map), "a copy would pass");
        let lent_at = entries(&map);
        let headers = Headers::from(map);
        drop(headers.clone());
        let back = headers.into_map();
        assert_eq!(back, expected);
        assert_eq!(entries(&back), lent_at);
        let map = back;
        let headers = Headers::from(map.clone());
        let _kept = headers.clone();
        assert_eq!(headers.into_map(), map);
    }

    /// Names from a list are lowered; a list and a map of the same
    /// headers are equal.
    #[test]
    fn list_names_are_lowered_and_lists_equal_maps() {
        let headers = Headers::from(vec![("Accept".to_string(), b"a".to_vec())]);
        assert_eq!(
            headers.to_vec(),
            vec![("accept".to_string(), b"a".to_vec())]
        );
        let mut map = HeaderMap::new();
        map.append("accept", http::HeaderValue::from_static("a"));
        assert_eq!(headers, Headers::from(map));
    }
}
