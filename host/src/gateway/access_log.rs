//! The access log: a line per request at debug level under the target
//! [`ACCESS_LOG`] (`SNOWGATE_LOG=info,snowgate::access=debug`), when its
//! response's headers are ready, or when its client went away first; and
//! one for a request whose head hyper could not parse and answered itself.

use std::error::Error;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use http::Method;

use crate::gateway::client_gone::CLIENT_GONE_STATUS;

/// The log target of the access log.
pub const ACCESS_LOG: &str = "snowgate::access";

/// The status the access log gives a request the gateway itself dropped
/// unanswered, when a shutdown's grace period ended: nginx's code for a
/// connection it closed without a response. Not 499, which would blame
/// the client.
pub const DROPPED_BY_GATEWAY_STATUS: u16 = 444;

/// One request's access log line, written once: with its response's status
/// when the response's headers are ready ([`AccessLine::answered`]), or,
/// when hyper drops the request before that (its client went away while
/// the plugin or the upstream worked on it: an HTTP/1 client that closed
/// its connection, an HTTP/2 one that reset its stream), as nginx logs
/// it, with status 499 (or [`DROPPED_BY_GATEWAY_STATUS`] when the gateway
/// dropped it at the end of a shutdown's grace period). Without that a
/// cancelled request left no line at all, though LLM clients cancel long
/// completions often.
pub struct AccessLine {
    peer: SocketAddr,
    /// Set once the gateway drops the requests left at the end of a
    /// shutdown's grace period.
    dropping: Arc<AtomicBool>,
    method: Method,
    /// The path with its query string.
    path: String,
    arrived: Instant,
    written: bool,
}

impl AccessLine {
    /// The line of a request with `method` and `path` from `peer` that
    /// arrived at `arrived`, if the access log is on; `dropping` is set
    /// once the gateway drops the requests left after a shutdown's grace.
    pub fn begin(
        peer: SocketAddr,
        method: &Method,
        path: &str,
        arrived: Instant,
        dropping: &Arc<AtomicBool>,
    ) -> Option<Self> {
        tracing::enabled!(target: ACCESS_LOG, tracing::Level::DEBUG).then(|| AccessLine {
            peer,
            dropping: dropping.clone(),
            method: method.clone(),
            path: path.to_owned(),
            arrived,
            written: false,
        })
    }

    /// The response's headers are ready, with `status`.
    pub fn answered(mut self, status: u16) {
        self.write(status);
    }

    fn write(&mut self, status: u16) {
        self.written = true;
        let ms = format!("{:.3}", self.arrived.elapsed().as_secs_f64() * 1e3);
        let (peer, method, path) = (self.peer, &self.method, self.path.as_str());
        tracing::debug!(target: ACCESS_LOG, %peer, %method, path, status, %ms, "answered");
    }
}

impl Drop for AccessLine {
    fn drop(&mut self) {
        if !self.written {
            let status = if self.dropping.load(Ordering::Relaxed) {
                DROPPED_BY_GATEWAY_STATUS
            } else {
                CLIENT_GONE_STATUS
            };
            self.write(status);
        }
    }
}

/// The status hyper answered by itself when a client connection ended with
/// `error`: a request head it could not parse gets 400 (431 when too large,
/// 414 for a target too long) and the connection is closed, before any
/// request reaches the gateway's code. `None` for every other error (a
/// reset, a timeout, an HTTP/2 preface, a failed write), after which hyper
/// sent nothing of its own.
pub fn answered_by_hyper(error: &(dyn Error + 'static)) -> Option<u16> {
    let hyper = error.downcast_ref::<hyper::Error>()?;
    if !hyper.is_parse() || hyper.is_parse_version_h2() || hyper.is_parse_status() {
        return None;
    }
    if !hyper.is_parse_too_large() {
        return Some(400);
    }
    // hyper tells a target over its length limit from a head over the
    // buffer only in its words.
    Some(if hyper.to_string().contains("URI") {
        414
    } else {
        431
    })
}

/// The access log line of a request head from `peer` that hyper answered
/// with `status` by itself (see [`answered_by_hyper`]): method and path
/// are `-`, as the head could not be read, and `error` says what was wrong
/// with it.
pub fn malformed(peer: SocketAddr, status: u16, error: &str) {
    tracing::debug!(target: ACCESS_LOG, %peer, method = "-", path = "-", status, error, "answered by hyper: malformed request head");
}
