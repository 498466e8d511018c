//! The built-in echo upstream, which answers with the request it received
//! (the gateway's upstream when `--upstream` is not given).
//!
//! Its answer is made as it is sent, from the body it read: a JSON body
//! goes out as it came, without a copy, and any other body as a JSON
//! string, escaped a piece at a time. A body of control bytes escapes to
//! six times its size (`\u0000`), which the echo never holds whole.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::header::{self, HeaderMap};
use http::{Request, Response};
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;

use crate::gateway::client_body::{BodyProgress, ClientFault};
use crate::gateway::read_body::{read_limited, ReadBodyError};
use crate::gateway::upstream::{client_fault, UpstreamBody};

/// The largest body the echo upstream reads back.
const ECHO_MAX_BODY: usize = 64 << 20;

/// The most bytes of a non-JSON body escaped into one frame of the answer
/// (at most six times as many bytes out).
const PIECE: usize = 64 << 10;

/// Answers with the request it received, as
/// `{"method":…,"path":…,"headers":{…},"body":…}`. A header sent once is a
/// string; one sent on several lines, an array of its values in order. A
/// JSON body is embedded byte for byte; any other body as a string (bytes
/// that are not UTF-8 as U+FFFD); none as `null`.
pub async fn echo(request: Request<UpstreamBody>) -> Response<UpstreamBody> {
    let (parts, body) = request.into_parts();
    // A body that fails is the client's fault, answered and counted as an
    // upstream's would be: 413 for one too large, 408 for one that
    // stalled, 400 for one broken off.
    let body = match read_limited(body, ECHO_MAX_BODY).await {
        Ok(bytes) => bytes,
        Err(ReadBodyError::TooLarge) => {
            let message = "the request body is larger than the gateway's limit (--max-body-bytes) \
                           or the echo upstream's (64 MiB)";
            return client_fault(ClientFault::TooLarge, message);
        }
        Err(ReadBodyError::Failed(why)) => {
            let fault = parts
                .extensions
                .get::<Arc<BodyProgress>>()
                .and_then(|progress| progress.fault())
                .unwrap_or(ClientFault::Broken);
            let message = format!("the request body could not be read: {why}");
            return client_fault(fault, &message);
        }
        // The echo reads into no body memory.
        Err(ReadBodyError::NoRoom(no_room)) => {
            return client_fault(ClientFault::Broken, &no_room.to_string())
        }
    };
    let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
    let head = format!(
        "{{\"method\":{},\"path\":{},\"headers\":{},\"body\":",
        serde_json::Value::from(parts.method.as_str()),
        serde_json::Value::from(path),
        headers_json(&parts.headers)
    );
    let answer = EchoBody::new(Bytes::from(head), body);
    // Stated, so that a HEAD answer, whose body the server drops, still
    // says the length a GET's would have.
    let length = answer.length;
    let mut response = Response::new(answer.map_err(|never| match never {}).boxed());
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("application/json"),
    );
    response
        .headers_mut()
        .insert(header::CONTENT_LENGTH, header::HeaderValue::from(length));
    response
}

/// The headers as a JSON object: each name once, with its one value or
/// an array of its values.
fn headers_json(headers: &HeaderMap) -> serde_json::Value {
    let object: serde_json::Map<String, serde_json::Value> = headers
        .keys()
        .map(|name| {
            let mut values = headers
                .get_all(name)
                .iter()
                .map(|v| serde_json::Value::from(String::from_utf8_lossy(v.as_bytes())));
            let value = match (values.next(), values.next()) {
                (Some(only), None) => only,
                (first, second) => first.into_iter().chain(second).chain(values).collect(),
            };
            (name.as_str().to_string(), value)
        })
        .collect();
    serde_json::Value::Object(object)
}

/// Where [`EchoBody`] is in its answer.
enum Part {
    /// The head, up to `"body":`.
    Head,
    /// The body, from this offset.
    Body(usize),
    /// What closes the body and the object.
    Tail,
    Done,
}

/// The echo's answer, made a frame at a time.
struct EchoBody {
    head: Bytes,
    body: Bytes,
    /// The body goes out as a JSON string, escaped.
    as_text: bool,
    part: Part,
    /// The whole answer's length in bytes.
    length: u64,
}

impl EchoBody {
    fn new(head: Bytes, body: Bytes) -> EchoBody {
        let as_text =
            !body.is_empty() && serde_json::from_slice::<serde::de::IgnoredAny>(&body).is_err();
        let body_length = if body.is_empty() {
            "null".len()
        } else if as_text {
            2 + text_length(&body)
        } else {
            body.len()
        };
        EchoBody {
            length: (head.len() + body_length + "}\n".len()) as u64,
            head,
            body,
            as_text,
            part: Part::Head,
        }
    }

    fn next_frame(&mut self) -> Option<Bytes> {
        match self.part {
            Part::Head => {
                self.part = Part::Body(0);
                let head = std::mem::take(&mut self.head);
                Some(match (self.body.is_empty(), self.as_text) {
                    (true, _) => Bytes::from([&head[..], b"null"].concat()),
                    (false, true) => Bytes::from([&head[..], b"\""].concat()),
                    (false, false) => head,
                })
            }
            Part::Body(at) if at < self.body.len() => {
                if !self.as_text {
                    self.part = Part::Tail;
                    return Some(self.body.clone());
                }
                let (text, used) = escape_piece(&self.body[at..]);
                self.part = Part::Body(at + used);
                Some(Bytes::from(text))
            }
            Part::Body(_) => {
                self.part = Part::Tail;
                self.next_frame()
            }
            Part::Tail => {
                self.part = Part::Done;
                Some(Bytes::from_static(if self.as_text {
                    b"\"}\n"
                } else {
                    b"}\n"
                }))
            }
            Part::Done => None,
        }
    }
}

impl Body for EchoBody {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        Poll::Ready(
            self.get_mut()
                .next_frame()
                .map(|data| Ok(Frame::data(data))),
        )
    }

    fn is_end_stream(&self) -> bool {
        matches!(self.part, Part::Done)
    }

    fn size_hint(&self) -> SizeHint {
        // Exact until the first frame; hyper reads it before then.
        SizeHint::with_exact(self.length)
    }
}

/// The length of `body` escaped as the contents of a JSON string, as
/// [`escape_piece`] writes it.
fn text_length(body: &[u8]) -> usize {
    body.utf8_chunks()
        .map(|chunk| {
            let valid: usize = chunk.valid().chars().map(escaped_length).sum();
            let replaced = if chunk.invalid().is_empty() {
                0
            } else {
                '\u{FFFD}'.len_utf8()
            };
            valid + replaced
        })
        .sum()
}

/// How many bytes `c` takes in a JSON string, as serde_json writes it.
fn escaped_length(c: char) -> usize {
    match c {
        '"' | '\\' | '\u{8}' | '\u{c}' | '\n' | '\r' | '\t' => 2,
        '\0'..='\u{1f}' => 6,
        c => c.len_utf8(),
    }
}

/// Escapes about [`PIECE`] bytes from the start of `rest` as the contents
/// of a JSON string (a run that is not UTF-8 as one U+FFFD, as
/// `String::from_utf8_lossy` reads it): the text, and how many bytes of
/// `rest` it took. A piece ends between two characters or after a run
/// that is not UTF-8, where reading the rest alone reads it as reading the
/// whole would.
fn escape_piece(rest: &[u8]) -> (String, usize) {
    let mut text = String::with_capacity(PIECE.min(rest.len()) + 16);
    let mut used = 0;
    for chunk in rest.utf8_chunks() {
        let valid = chunk.valid();
        let room = PIECE - used;
        if valid.len() > room {
            // A character is at most 4 bytes and a first piece's room is
            // all of `PIECE`: it always takes something.
            let mut cut = room;
            while !valid.is_char_boundary(cut) {
                cut -= 1;
            }
            push_escaped(&mut text, &valid[..cut]);
            return (text, used + cut);
        }
        push_escaped(&mut text, valid);
        used += valid.len();
        if !chunk.invalid().is_empty() {
            text.push('\u{FFFD}');
            used += chunk.invalid().len();
        }
        if used >= PIECE {
            break;
        }
    }
    (text, used)
}

/// Appends `text` escaped as in a JSON string, as serde_json writes it.
fn push_escaped(out: &mut String, text: &str) {
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\0'..='\u{1f}' => {
                const HEX: &[u8; 16] = b"0123456789abcdef";
                let byte = c as usize;
                out.push_str("\\u00");
                out.push(char::from(HEX[byte >> 4]));
                out.push(char::from(HEX[byte & 0xf]));
            }
            c => out.push(c),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The whole answer of `EchoBody` for `body`, frame by frame.
    fn answer(body: &[u8]) -> (Vec<u8>, u64, usize) {
        let mut echo = EchoBody::new(
            Bytes::from_static(b"{\"body\":"),
            Bytes::from(body.to_vec()),
        );
        let length = echo.length;
        let mut out = Vec::new();
        let mut frames = 0;
        while let Some(frame) = echo.next_frame() {
            assert!(
                frame.len() <= 6 * PIECE + 16,
                "a frame of {} bytes",
                frame.len()
            );
            out.extend_from_slice(&frame);
            frames += 1;
        }
        assert!(echo.is_end_stream());
        (out, length, frames)
    }

    /// Bodies of every kind come back as serde_json would write them whole,
    /// in as many bytes as the answer says, a piece at a time.
    #[test]
    fn a_body_is_echoed_as_a_json_string_or_as_it_came_in_the_length_stated() {
        let mut random = 0x2545_f491_4f6c_dd1d_u64;
        let mut byte = move || {
            random ^= random << 13;
            random ^= random >> 7;
            random ^= random << 17;
            random as u8
        };
        let mut bodies: Vec<Vec<u8>> = vec![
            Vec::new(),
            br#"{"a":[1,2,"x"]}"#.to_vec(),
            b"plain text".to_vec(),
            vec![0; 3 * PIECE + 5],
            "\u{e9}\u{1F600}\"\\\n".repeat(PIECE / 3).into_bytes(),
            // Runs that are not UTF-8, and characters cut at piece ends.
            b"\xF0\x9F\x98".repeat(PIECE / 2),
            [
                vec![b'a'; PIECE - 1],
                "\u{1F600}".as_bytes().to_vec(),
                vec![0xFF; 9],
            ]
            .concat(),
        ];
        bodies.extend((0..20).map(|n| (0..n * 9_001).map(|_| byte()).collect()));
        for body in bodies {
            let (out, length, frames) = answer(&body);
            let expected = if body.is_empty() {
                "null".to_string()
            } else if serde_json::from_slice::<serde::de::IgnoredAny>(&body).is_ok() {
                String::from_utf8(body.clone()).unwrap()
            } else {
                serde_json::Value::from(String::from_utf8_lossy(&body)).to_string()
            };
            let expected = format!("{{\"body\":{expected}}}\n");
            assert_eq!(out.len() as u64, length, "the length stated");
            assert!(out == expected.as_bytes(), "a body of {} bytes", body.len());
            assert!(
                frames <= 3 + body.len().div_ceil(PIECE) + 1,
                "{frames} frames"
            );
        }
    }
}
