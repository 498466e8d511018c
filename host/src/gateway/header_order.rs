//! Removing a request's headers without reordering the others.
//!
//! `http`'s `HeaderMap::remove` moves the map's last name into the place of
//! the one removed. A request whose client sent `Connection: keep-alive`
//! first (Python's `requests` and `httpx` do, and curl sends `Expect` for
//! larger bodies) reached the plugin with its last header moved up, where
//! the contract promises the headers in the order received (names in the
//! order they first came). So the gateway removes a request's headers by
//! rebuilding the map in order, and only when one of them is there.

use http::header::{HeaderMap, HeaderName, HeaderValue};

/// What becomes of one name's values when a map is rebuilt.
pub enum Change {
    /// They stay as they are.
    Keep,
    /// They go.
    Remove,
    /// They give way to this one value, where the first of them was.
    Replace(HeaderValue),
}

/// Rebuilds `headers` with each name's values as `change` says (asked once
/// a name), keeping the order of what stays.
pub fn rebuild_in_order(headers: &mut HeaderMap, mut change: impl FnMut(&HeaderName) -> Change) {
    let old = std::mem::take(headers);
    // Room for its names, not its values: a name's values are not bounded
    // by the map's capacity, and `reserve` panics past 24,576 entries,
    // which an HTTP/2 client with a large `--max-header-bytes` could send.
    headers.reserve(old.keys_len());
    // `into_iter` gives a name with its first value only.
    let mut current: Option<(HeaderName, Change)> = None;
    for (name, value) in old {
        if let Some(name) = name {
            let what = change(&name);
            if let Change::Replace(by) = &what {
                headers.append(name.clone(), by.clone());
            }
            current = Some((name, what));
        }
        if let Some((name, Change::Keep)) = &current {
            headers.append(name.clone(), value);
        }
    }
}

/// Removes `name`'s values from `headers`, keeping the order of the others.
pub fn remove_in_order(headers: &mut HeaderMap, name: &HeaderName) {
    if headers.contains_key(name) {
        rebuild_in_order(headers, |n| {
            if n == name {
                Change::Remove
            } else {
                Change::Keep
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in pairs {
            map.append(
                HeaderName::from_bytes(name.as_bytes()).expect("a name"),
                HeaderValue::from_str(value).expect("a value"),
            );
        }
        map
    }

    fn pairs(map: &HeaderMap) -> Vec<(String, String)> {
        map.iter()
            .map(|(n, v)| (n.to_string(), v.to_str().expect("text").to_string()))
            .collect()
    }

    /// More values of one name than a map's capacity may hold (40,000
    /// `a` lines, as an HTTP/2 client may send with a large header limit)
    /// are rebuilt, not refused with a panic.
    #[test]
    fn many_values_of_one_name_are_rebuilt() {
        let mut headers = HeaderMap::new();
        headers.append("connection", HeaderValue::from_static("close"));
        for _ in 0..40_000 {
            headers.append("a", HeaderValue::from_static("1"));
        }
        remove_in_order(&mut headers, &http::header::CONNECTION);
        assert_eq!(headers.len(), 40_000);
        assert_eq!(headers.keys_len(), 1);
    }

    #[test]
    fn the_headers_that_stay_keep_their_order_and_their_values() {
        let mut headers = map(&[
            ("connection", "keep-alive"),
            ("accept", "*/*"),
            ("x-a", "1"),
            ("x-a", "2"),
            ("te", "gzip"),
            ("te", "trailers"),
            ("content-type", "application/json"),
            ("expect", "100-continue"),
        ]);
        // `HeaderMap::remove` alone moves the last name up.
        let mut swapped = headers.clone();
        swapped.remove("connection");
        assert_eq!(swapped.keys().next().expect("a name"), "expect");

        rebuild_in_order(&mut headers, |name| match name.as_str() {
            "connection" => Change::Remove,
            "te" => Change::Replace(HeaderValue::from_static("trailers")),
            _ => Change::Keep,
        });
        remove_in_order(&mut headers, &http::header::EXPECT);
        remove_in_order(&mut headers, &http::header::TRAILER);
        let kept: Vec<(String, String)> = [
            ("accept", "*/*"),
            ("x-a", "1"),
            ("x-a", "2"),
            ("te", "trailers"),
            ("content-type", "application/json"),
        ]
        .iter()
        .map(|(n, v)| (n.to_string(), v.to_string()))
        .collect();
        assert_eq!(pairs(&headers), kept);
    }
}
