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
