//! Whether a client connection is serving anything: the requests in flight
//! on it, so that a connection with none for the idle timeout is closed,
//! whatever its protocol. hyper closes an idle HTTP/1 connection by itself
//! (its header read timeout); an HTTP/2 connection, or one that never
//! finished the HTTP/2 preface, it would keep for ever.

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use tokio::sync::watch;

/// The requests in flight on one connection.
#[derive(Clone)]
pub struct Activity {
    in_flight: watch::Sender<usize>,
}

impl Default for Activity {
    fn default() -> Self {
        Activity {
            in_flight: watch::Sender::new(0),
        }
    }
}

impl Activity {
    /// A request begins: it is in flight until the guard is dropped (with
    /// its response body, once that is sent).
    pub fn begin(&self) -> InFlight {
        self.in_flight.send_modify(|n| *n += 1);
        InFlight {
            in_flight: self.in_flight.clone(),
        }
    }

    /// Resolves once no request has been in flight for `timeout` straight.
    pub async fn idle_for(&self, timeout: Duration) {
        let mut in_flight = self.in_flight.subscribe();
        loop {
            // Never closed: `self` holds the sender.
            let _ = in_flight.wait_for(|n| *n == 0).await;
            tokio::select! {
                () = tokio::time::sleep(timeout) => return,
                _ = in_flight.wait_for(|n| *n > 0) => {}
            }
        }
    }
}

/// One request in flight (see [`Activity::begin`]).
pub struct InFlight {
    in_flight: watch::Sender<usize>,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.in_flight.send_modify(|n| *n -= 1);
    }
}

/// A response body that keeps its request in flight until it is dropped.
pub struct ActiveBody<B> {
    inner: B,
    _in_flight: InFlight,
}

impl<B> ActiveBody<B> {
    /// `inner`, keeping `in_flight` alive as long as it is.
    pub fn new(inner: B, in_flight: InFlight) -> ActiveBody<B> {
        ActiveBody {
            inner,
            _in_flight: in_flight,
        }
    }
}

impl<B: Body<Data = Bytes> + Unpin> Body for ActiveBody<B> {
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        Pin::new(&mut self.get_mut().inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn idle_means_nothing_in_flight_for_the_whole_timeout() {
        let activity = Activity::default();
        let timeout = Duration::from_secs(10);
        let started = tokio::time::Instant::now();
        // A request from 5 s to 12 s: idle only from 12 s, so until 22 s.
        let busy = activity.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(5)).await;
            let request = busy.begin();
            tokio::time::sleep(Duration::from_secs(7)).await;
            drop(request);
        });
        activity.idle_for(timeout).await;
        assert_eq!(started.elapsed(), Duration::from_secs(22));
    }

    #[tokio::test(start_paused = true)]
    async fn a_request_in_flight_is_never_idle() {
        let activity = Activity::default();
        let _streaming = activity.begin();
        let idle = tokio::time::timeout(
            Duration::from_secs(3600),
            activity.idle_for(Duration::from_secs(10)),
        );
        assert!(idle.await.is_err(), "idle while a request was in flight");
    }
}
