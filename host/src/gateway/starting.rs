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

use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use tokio::net::TcpListener;
use tokio::sync::oneshot;

use crate::gateway::admin::{serve_connections, text};
use crate::gateway::responses;
use crate::unpoisoned::LockUnpoisoned as _;

/// The admin listener, answering while the gateway starts.
pub struct WhileStarting {
    /// What the start is doing now, for `/readyz`.
    stage: Arc<Mutex<String>>,
    /// Sent to end the answering: the accept loop gives the listener back.
    done: oneshot::Sender<()>,
    accepting: tokio::task::JoinHandle<TcpListener>,
}

impl WhileStarting {
    /// Answers on `listener` from now on, as the gateway's own admin
    /// endpoints serve it (the same bounds on connections and heads, with
    /// `header_read_timeout`), but one request per connection: a probe's
    /// connection kept alive would go on hearing "starting" after the
    /// start. `stage` is what the start is doing.
    pub fn answer_on(listener: TcpListener, header_read_timeout: Duration, stage: &str) -> Self {
        let stage = Arc::new(Mutex::new(stage.to_string()));
        let (done, finished) = oneshot::channel();
        let now = stage.clone();
        let route = move |request: Request<Incoming>| {
            let answer = answer(&request, &now.lock_unpoisoned());
            async move { answer }
        };
        let until = async {
            let _ = finished.await;
        };
        let accepting = tokio::spawn(serve_connections(
            listener,
            header_read_timeout,
            false,
            route,
            until,
        ));
        WhileStarting {
            stage,
            done,
            accepting,
        }
    }

    /// The start is now doing `stage` (what `/readyz` says it waits for).
    pub fn now(&self, stage: impl Into<String>) {
        *self.stage.lock_unpoisoned() = stage.into();
    }

    /// Ends the answering and gives the listener back, for the gateway's
    /// own admin endpoints. A connection accepted before is still answered
    /// (its one request), as the start's endpoints answer.
    pub async fn hand_over(self) -> anyhow::Result<TcpListener> {
        let _ = self.done.send(());
        self.accepting
            .await
            .map_err(|e| anyhow::anyhow!("the admin listener's start-up task failed: {e}"))
    }
}

/// The answer to `request` while the start is doing `stage`.
fn answer(request: &Request<Incoming>, stage: &str) -> Response<Full<Bytes>> {
    let get = matches!(*request.method(), Method::GET | Method::HEAD);
    match request.uri().path() {
        "/healthz" if get => text(StatusCode::OK, "text/plain", "ok\n".to_string()),
        "/readyz" if get => text(
            StatusCode::SERVICE_UNAVAILABLE,
            "text/plain",
            format!("not ready: the gateway is starting: {stage}\n"),
        ),
        _ => responses::retry_in_a_second(responses::error(
            StatusCode::SERVICE_UNAVAILABLE,
            "starting",
            "the gateway is starting, and answers its admin endpoints once it serves; \
                 /readyz says what the start waits for",
        )),
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;

    use super::*;
    use crate::gateway::admin::MAX_ADMIN_CONNECTIONS;

    async fn starting() -> (WhileStarting, std::net::SocketAddr) {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("address");
        let timeout = Duration::from_secs(30);
        (
            WhileStarting::answer_on(listener, timeout, "loading the plugin"),
            addr,
        )
    }

    async fn answer_to(mut stream: TcpStream, rest: &[u8]) -> String {
        stream.write_all(rest).await.expect("write");
        let mut answer = Vec::new();
        stream.read_to_end(&mut answer).await.expect("an answer");
        String::from_utf8_lossy(&answer).into_owned()
    }

    /// A request whose connection came before the hand-over is answered
    /// (as the start's endpoints answer), not closed unanswered: before, a
    /// connection still sending its head at the hand-over was shut down
    /// and saw only the end.
    #[tokio::test]
    async fn a_request_begun_before_the_hand_over_is_answered() {
        let (starting, addr) = starting().await;
        let mut begun = TcpStream::connect(addr).await.expect("connect");
        begun
            .write_all(b"GET /readyz HTTP/1.1\r\n")
            .await
            .expect("write");
        // Served: the same listener answers a whole request meanwhile.
        let probe = TcpStream::connect(addr).await.expect("connect");
        let probed = answer_to(probe, b"GET /healthz HTTP/1.1\r\nHost: a\r\n\r\n").await;
        assert!(probed.starts_with("HTTP/1.1 200"), "{probed}");
        let listener = starting.hand_over().await.expect("the listener");
        let answer = answer_to(begun, b"Host: a\r\n\r\n").await;
        assert!(answer.starts_with("HTTP/1.1 503"), "{answer}");
        assert!(answer.contains("starting: loading the plugin"), "{answer}");
        drop(listener);
    }

    /// At the connection cap, a new probe gets the slot of a connection
    /// idle longest, as at the gateway's own admin endpoints: before, it
    /// was closed, so 64 connections that sent part of a head kept every
    /// liveness probe out for the whole start.
    #[tokio::test]
    async fn at_the_cap_a_probe_gets_the_slot_of_one_idle_longest() {
        let (_starting, addr) = starting().await;
        let mut held = Vec::new();
        for _ in 0..MAX_ADMIN_CONNECTIONS {
            let mut stream = TcpStream::connect(addr).await.expect("connect");
            stream
                .write_all(b"GET /healthz HTTP/1.1\r\n")
                .await
                .expect("write");
            held.push(stream);
        }
        let probe = TcpStream::connect(addr).await.expect("connect");
        let answer = tokio::time::timeout(
            Duration::from_secs(20),
            answer_to(probe, b"GET /healthz HTTP/1.1\r\nHost: a\r\n\r\n"),
        )
        .await
        .expect("answered within the bound");
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        assert!(answer.ends_with("ok\n"), "{answer}");
    }
}
