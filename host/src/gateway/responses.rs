//! Answers the gateway makes itself: OpenAI-style JSON errors.

use bytes::Bytes;
use http::{header, Response, StatusCode};
use http_body_util::Full;

/// An OpenAI-style error response:
/// `{"error":{"message":…,"type":…,"param":null,"code":…}}`.
pub fn error(status: StatusCode, code: &str, message: &str) -> Response<Full<Bytes>> {
    let kind = if status.is_server_error() {
        "server_error"
    } else {
        "invalid_request_error"
    };
    let body = serde_json::json!({
        "error": { "message": message, "type": kind, "param": null, "code": code }
    });
    let mut response = Response::new(Full::new(Bytes::from(body.to_string())));
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("application/json"),
    );
    response
}

/// [`error`], closing the connection after it: for a request whose body
/// is not read (all or the rest of it), which would otherwise be read as
/// the next request.
pub fn closing_error(status: StatusCode, code: &str, message: &str) -> Response<Full<Bytes>> {
    let mut response = error(status, code, message);
    response.headers_mut().insert(
        header::CONNECTION,
        header::HeaderValue::from_static("close"),
    );
    response
}
