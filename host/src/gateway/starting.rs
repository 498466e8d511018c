//! The admin listener while the gateway starts (its plugin compiling, a
//! high-water mark far ahead of the wall clock waited out): `/healthz`
//! answers ok, as the process lives and a liveness probe must not restart
//! it for waiting; `/readyz` answers 503 saying what the start waits for;
//! every other endpoint answers 503 `starting`. Once the start is done the
//! listener is handed to the gateway's own admin endpoints
//! ([`admin`](crate::gateway::admin)).
//!
//! Before, the admin listener was bound only at the end of the start, so a
//! high-water mark up to a day ahead kept every admin endpoint refusing
//! connections that long, and a liveness probe restarted the gateway into
//! the same wait, over and over.

use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use http::{header, Method, Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio::sync::{watch, Semaphore};

use bytes::Bytes;

use crate::gateway::admin::{ADMIN_FIRST_BYTE_TIMEOUT, MAX_ADMIN_CONNECTIONS};
use crate::gateway::responses;
use crate::gateway::server::{pause_after_accept_error, sends_within};
use crate::log_throttle::LogThrottle;

/// The admin listener, answering while the gateway starts.
pub struct WhileStarting {
    /// What the start is doing now, for `/readyz`.
    stage: Arc<Mutex<String>>,
    /// Set to end the answering: the accept loop gives the listener back,
    /// and open connections close once their request in flight, if any, is
    /// answered.
    done: watch::Sender<bool>,
    accepting: tokio::task::JoinHandle<TcpListener>,
}

impl WhileStarting {
    /// Answers on `listener` from now on; `header_read_timeout` bounds a
    /// connection's request heads, as the gateway's own admin endpoints
    /// do, and `stage` is what the start is doing.
    pub fn answer_on(listener: TcpListener, header_read_timeout: Duration, stage: &str) -> Self {
        let stage = Arc::new(Mutex::new(stage.to_string()));
        let (done, finished) = watch::channel(false);
        let accepting = tokio::spawn(accept(
            listener,
            stage.clone(),
            finished,
            header_read_timeout,
        ));
        WhileStarting {
            stage,
            done,
            accepting,
        }
    }

    /// The start is now doing `stage` (what `/readyz` says it waits for).
    pub fn now(&self, stage: impl Into<String>) {
        *self.stage.lock().unwrap_or_else(|p| p.into_inner()) = stage.into();
    }

    /// Ends the answering and gives the listener back, for the gateway's
    /// own admin endpoints.
    pub async fn hand_over(self) -> anyhow::Result<TcpListener> {
        let _ = self.done.send(true);
        self.accepting
            .await
            .map_err(|e| anyhow::anyhow!("the admin listener's start-up task failed: {e}"))
    }
}

/// Accepts connections until `finished` is set, then gives `listener`
/// back. At most [`MAX_ADMIN_CONNECTIONS`] are served at once; past that a
/// new one is closed at once (a start lasts seconds to a day, and silent
/// connections are closed within [`ADMIN_FIRST_BYTE_TIMEOUT`]).
async fn accept(
    listener: TcpListener,
    stage: Arc<Mutex<String>>,
    mut finished: watch::Receiver<bool>,
    header_read_timeout: Duration,
) -> TcpListener {
    let slots = Arc::new(Semaphore::new(MAX_ADMIN_CONNECTIONS));
    loop {
        let accepted = tokio::select! {
            biased;
            () = until_set(&mut finished) => return listener,
            accepted = listener.accept() => accepted,
        };
        let stream = match accepted {
            Ok((stream, _)) => stream,
            Err(e) => {
                static FAILED: LogThrottle = LogThrottle::new();
                pause_after_accept_error(&e, "accepting an admin connection failed", &FAILED).await;
                continue;
            }
        };
        let Ok(permit) = slots.clone().try_acquire_owned() else {
            continue;
        };
        let (stage, mut finished) = (stage.clone(), finished.clone());
        tokio::spawn(async move {
            let _permit = permit;
            if !sends_within(&stream, header_read_timeout.min(ADMIN_FIRST_BYTE_TIMEOUT)).await {
                return;
            }
            let service = hyper::service::service_fn(move |request: Request<Incoming>| {
                let answer = answer(&request, &stage.lock().unwrap_or_else(|p| p.into_inner()));
                async move { Ok::<_, Infallible>(answer) }
            });
            let connection = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(header_read_timeout)
                .serve_connection(TokioIo::new(stream), service);
            tokio::pin!(connection);
            tokio::select! {
                _ = connection.as_mut() => {}
                // A kept-alive connection would go on answering "starting"
                // after the start: it closes once its request in flight is
                // answered.
                () = until_set(&mut finished) => {
                    connection.as_mut().graceful_shutdown();
                    let _ = connection.await;
                }
            }
        });
    }
}

/// Resolves once `finished` is set, or its sender is gone.
async fn until_set(finished: &mut watch::Receiver<bool>) {
    let _ = finished.wait_for(|done| *done).await;
}

/// The answer to `request` while the start is doing `stage`.
fn answer(request: &Request<Incoming>, stage: &str) -> Response<Full<Bytes>> {
    let get = matches!(*request.method(), Method::GET | Method::HEAD);
    match request.uri().path() {
        "/healthz" if get => plain(StatusCode::OK, "ok\n".to_string()),
        "/readyz" if get => plain(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready: the gateway is starting: {stage}\n"),
        ),
        _ => {
            let mut response = responses::error(
                StatusCode::SERVICE_UNAVAILABLE,
                "starting",
                "the gateway is starting, and answers its admin endpoints once it serves; \
                 /readyz says what the start waits for",
            );
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, header::HeaderValue::from_static("1"));
            response
        }
    }
}

/// A plain-text answer.
fn plain(status: StatusCode, body: String) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("text/plain"),
    );
    response
}
