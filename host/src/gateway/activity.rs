//! What a client connection is doing: the requests in flight on it, and
//! when it last moved a byte, so that a connection that serves nothing is
//! closed whatever its protocol. hyper closes an idle HTTP/1 connection by
//! itself (its header read timeout); an HTTP/2 connection with no stream,
//! or one that never finished the HTTP/2 preface, it would keep for ever.

use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::watch;
use tokio::time::Instant;

/// The requests in flight on one connection, and its last I/O.
#[derive(Clone)]
pub struct Activity {
    in_flight: watch::Sender<usize>,
    shared: Arc<Shared>,
}

struct Shared {
    /// When the connection was opened: `last_io` counts from here.
    opened: Instant,
    /// Milliseconds from `opened` to the last read or write of a byte.
    last_io: AtomicU64,
    /// Whether a request came in over HTTP/1, whose idle connections
    /// hyper closes by itself.
    http1: AtomicBool,
}

impl Default for Activity {
    fn default() -> Self {
        Activity {
            in_flight: watch::Sender::new(0),
            shared: Arc::new(Shared {
                opened: Instant::now(),
                last_io: AtomicU64::new(0),
                http1: AtomicBool::new(false),
            }),
        }
    }
}

impl Activity {
    /// A request begins, over `version`: it is in flight until the guard
    /// is dropped (with its response body, once hyper has taken the last
    /// of it).
    pub fn begin(&self, version: http::Version) -> InFlight {
        if version < http::Version::HTTP_2 {
            self.shared.http1.store(true, Ordering::Relaxed);
        }
        self.in_flight.send_modify(|n| *n += 1);
        InFlight {
            in_flight: self.in_flight.clone(),
        }
    }

    /// Resolves once no request has been in flight for `timeout` straight,
    /// on a connection that is not HTTP/1 (hyper closes those itself, and
    /// a second timer would race its own); never for HTTP/1.
    pub async fn idle_for(&self, timeout: Duration) {
        let mut in_flight = self.in_flight.subscribe();
        loop {
            // Never closed: `self` holds the sender.
            let _ = in_flight.wait_for(|n| *n == 0).await;
            if self.shared.http1.load(Ordering::Relaxed) {
                return std::future::pending().await;
            }
            tokio::select! {
                // A request that came in as the time ran out wins.
                biased;
                _ = in_flight.wait_for(|n| *n > 0) => {}
                () = tokio::time::sleep(timeout) => {
                    if *self.in_flight.borrow() == 0 {
                        return;
                    }
                }
            }
        }
    }

    /// Resolves once the connection has neither had a request in flight
    /// nor moved a byte for `timeout`: nothing it does can still finish.
    /// A response hyper is still writing to a slow reader moves bytes.
    pub async fn dormant_for(&self, timeout: Duration) {
        let mut in_flight = self.in_flight.subscribe();
        // Since when nothing has been in flight (at the latest, now).
        let mut quiet_since = Instant::now();
        loop {
            if *self.in_flight.borrow() != 0 {
                let _ = in_flight.wait_for(|n| *n == 0).await;
                quiet_since = Instant::now();
            }
            let last_io = self.last_io();
            let moved = self.shared.opened + Duration::from_millis(last_io);
            let due = quiet_since.max(moved) + timeout;
            tokio::select! {
                biased;
                _ = in_flight.wait_for(|n| *n > 0) => {}
                () = tokio::time::sleep_until(due) => {
                    if *self.in_flight.borrow() == 0 && self.last_io() == last_io {
                        return;
                    }
                }
            }
        }
    }

    fn last_io(&self) -> u64 {
        self.shared.last_io.load(Ordering::Relaxed)
    }

    fn moved_bytes(&self) {
        let now = self.shared.opened.elapsed().as_millis() as u64;
        self.shared.last_io.fetch_max(now, Ordering::Relaxed);
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

/// A connection's socket that records in its [`Activity`] when it last
/// read or wrote a byte.
pub struct Watched<S> {
    inner: S,
    activity: Activity,
}

impl<S> Watched<S> {
    /// `inner`, recording its I/O in `activity`.
    pub fn new(inner: S, activity: Activity) -> Watched<S> {
        Watched { inner, activity }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Watched<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let polled = Pin::new(&mut this.inner).poll_read(cx, buf);
        if buf.filled().len() > before {
            this.activity.moved_bytes();
        }
        polled
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Watched<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.inner).poll_write(cx, buf);
        if matches!(polled, Poll::Ready(Ok(n)) if n > 0) {
            this.activity.moved_bytes();
        }
        polled
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.inner).poll_write_vectored(cx, bufs);
        if matches!(polled, Poll::Ready(Ok(n)) if n > 0) {
            this.activity.moved_bytes();
        }
        polled
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use http::Version;

    use super::*;

    const TIMEOUT: Duration = Duration::from_secs(10);

    #[tokio::test(start_paused = true)]
    async fn idle_means_nothing_in_flight_for_the_whole_timeout() {
        let activity = Activity::default();
        let started = Instant::now();
        // A request from 5 s to 12 s: idle only from 12 s, so until 22 s.
        let busy = activity.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(5)).await;
            let request = busy.begin(Version::HTTP_2);
            tokio::time::sleep(Duration::from_secs(7)).await;
            drop(request);
        });
        activity.idle_for(TIMEOUT).await;
        assert_eq!(started.elapsed(), Duration::from_secs(22));
    }

    #[tokio::test(start_paused = true)]
    async fn a_request_in_flight_or_an_http1_connection_is_never_idle() {
        let activity = Activity::default();
        let streaming = activity.begin(Version::HTTP_2);
        let idle = tokio::time::timeout(Duration::from_secs(3600), activity.idle_for(TIMEOUT));
        assert!(idle.await.is_err(), "idle while a request was in flight");
        drop(streaming);

        let activity = Activity::default();
        drop(activity.begin(Version::HTTP_11));
        let idle = tokio::time::timeout(Duration::from_secs(3600), activity.idle_for(TIMEOUT));
        assert!(idle.await.is_err(), "an HTTP/1 connection was idle");
    }

    /// Polls `future` once: whether it is ready.
    async fn ready(future: Pin<&mut impl std::future::Future<Output = ()>>) -> bool {
        let mut future = future;
        std::future::poll_fn(|cx| Poll::Ready(future.as_mut().poll(cx).is_ready())).await
    }

    /// A request that comes in as the timeout runs out (both ready when
    /// the connection task next runs) keeps the connection.
    #[tokio::test(start_paused = true)]
    async fn a_request_arriving_as_the_timeout_ends_wins() {
        let activity = Activity::default();
        let idle = activity.idle_for(TIMEOUT);
        tokio::pin!(idle);
        assert!(!ready(idle.as_mut()).await);
        tokio::time::advance(TIMEOUT).await;
        let request = activity.begin(Version::HTTP_2);
        assert!(!ready(idle.as_mut()).await, "idle with a request in flight");
        drop(request);
        assert!(!ready(idle.as_mut()).await);
        tokio::time::advance(TIMEOUT - Duration::from_millis(1)).await;
        assert!(!ready(idle.as_mut()).await);
        tokio::time::advance(Duration::from_millis(1)).await;
        assert!(ready(idle.as_mut()).await);
    }

    /// A request in flight (one the client started as the connection was
    /// told to go away, waiting on a slow upstream) keeps it from being
    /// dormant, however long nothing moves.
    #[tokio::test(start_paused = true)]
    async fn a_request_in_flight_keeps_a_connection_from_being_dormant() {
        let activity = Activity::default();
        let waiting = activity.begin(Version::HTTP_2);
        let dormant =
            tokio::time::timeout(Duration::from_secs(3600), activity.dormant_for(TIMEOUT));
        assert!(dormant.await.is_err(), "dormant with a request in flight");
        drop(waiting);
        let started = Instant::now();
        activity.dormant_for(TIMEOUT).await;
        assert_eq!(started.elapsed(), TIMEOUT);
    }

    /// Bytes still moving (a response written to a slow reader after its
    /// body was handed over) keep a connection from being dormant.
    #[tokio::test(start_paused = true)]
    async fn moving_bytes_keeps_a_connection_from_being_dormant() {
        let activity = Activity::default();
        let writer = activity.clone();
        tokio::spawn(async move {
            for _ in 0..6 {
                tokio::time::sleep(Duration::from_secs(5)).await;
                writer.moved_bytes();
            }
        });
        let started = Instant::now();
        activity.dormant_for(TIMEOUT).await;
        // The last byte at 30 s, then 10 s without one.
        assert_eq!(started.elapsed(), Duration::from_secs(40));
    }
}
