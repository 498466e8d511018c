//! The upstream's response body on its way to the client: how long the
//! upstream may pause within it, so that an upstream that hangs after its
//! headers (a stuck worker mid-stream) costs the client a response that
//! ends, not one that never does; and an upstream whose connection fails
//! within it (a worker that crashed mid-stream) is logged and counted, not
//! only seen by the client.

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::uri::PathAndQuery;
use http_body::{Body, Frame, SizeHint};

use crate::gateway::client_body::BoxError;
use crate::gateway::metrics::Metrics;
use crate::gateway::upstream::LoggedAddress;
use crate::gateway::wait_timer::WaitTimer;
use crate::log_throttle::LogThrottle;

/// A response body that fails with a
/// [`WaitedTooLong`](crate::gateway::wait_timer::WaitedTooLong) when the upstream
/// sends nothing for the read timeout while the gateway waits for more;
/// the response is then cut off (the client sees it end short), counted
/// and logged. Only time spent waiting on the upstream counts: a client
/// that reads slowly does not make the upstream late.
pub struct UpstreamReadTimeout<B> {
    inner: B,
    timer: WaitTimer,
    metrics: Arc<Metrics>,
    /// The upstream path of the request, for the log.
    path: Option<PathAndQuery>,
    /// The address the response comes from, for the log.
    address: Option<SocketAddr>,
}

impl<B> UpstreamReadTimeout<B> {
    /// `inner`, which may pause at most `timeout` each time; a cut-off is
    /// counted in `metrics`.
    pub fn new(inner: B, timeout: Duration, metrics: Arc<Metrics>) -> UpstreamReadTimeout<B> {
        UpstreamReadTimeout {
            inner,
            timer: WaitTimer::new(
                timeout,
                "the upstream sent no more of its response body",
                "--upstream-read-timeout-ms",
            ),
            metrics,
            path: None,
            address: None,
        }
    }

    /// Names the request's upstream `path`, and the `address` its response
    /// comes from, when a cut-off is logged.
    pub fn naming(self, path: Option<PathAndQuery>, address: SocketAddr) -> UpstreamReadTimeout<B> {
        UpstreamReadTimeout {
            path,
            address: Some(address),
            ..self
        }
    }
}

impl<B> Body for UpstreamReadTimeout<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(Some(Err(e))) => {
                let e: BoxError = e.into();
                let path = this.path.as_ref().map_or("", PathAndQuery::path);
                let problem = crate::gateway::error_chain::describe(&*e);
                static FAILED: LogThrottle = LogThrottle::new();
                if let Some(held_back) = FAILED.admit() {
                    tracing::warn!(
                        path,
                        address = %LoggedAddress(this.address),
                        %problem,
                        "cut off a response: its upstream failed within the body {held_back}"
                    );
                }
                this.metrics.upstream_cut_off();
                Poll::Ready(Some(Err(e)))
            }
            Poll::Ready(frame) => {
                this.timer.progressed();
                Poll::Ready(frame.map(|frame| frame.map_err(Into::into)))
            }
            Poll::Pending if !this.timer.expired(cx) => Poll::Pending,
            Poll::Pending => {
                let paused = this.timer.error();
                let path = this.path.as_ref().map_or("", PathAndQuery::path);
                static PAUSED: LogThrottle = LogThrottle::new();
                if let Some(held_back) = PAUSED.admit() {
                    tracing::warn!(
                        path,
                        address = %LoggedAddress(this.address),
                        problem = %paused,
                        "cut off a response: its upstream stopped sending {held_back}"
                    );
                }
                this.metrics.upstream_cut_off();
                Poll::Ready(Some(Err(Box::new(paused))))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}
