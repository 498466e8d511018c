//! What a client connection is doing: the requests in flight on it, so
//! that an HTTP/2 connection that serves nothing is closed, and whether its
//! client takes the responses, so that one whose client stops taking them
//! is closed too. hyper closes an idle HTTP/1 connection by itself (its
//! header read timeout); an HTTP/2 connection with no stream, or one that
//! never finished the HTTP/2 preface, it would keep for ever. An HTTP/2
//! client that stops granting flow-control window leaves the socket
//! writable, so [`SendTimeout`](crate::gateway::send_timeout::SendTimeout)
//! does not see it.

use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use tokio::sync::watch;

use crate::gateway::stream_resets::{StreamResets, CUT_SHORT_WITHIN};

/// The largest piece of a response body handed to an HTTP/2 connection at
/// once: its frame size. hyper takes the next piece only once the client's
/// flow-control window has room, so a response counts as in flight until
/// at most this much (twice over) is left to send.
const HTTP2_PIECE: usize = 16 << 10;

/// The requests in flight on one connection.
#[derive(Clone)]
pub struct Activity {
    in_flight: watch::Sender<usize>,
    /// Every request open now, over any version, and since when none is
    /// (see [`Activity::idle_for_micros`]).
    open: Arc<OpenRequests>,
    /// Whether a request came in over HTTP/1, whose idle connections
    /// hyper closes by itself.
    http1: Arc<AtomicBool>,
    /// How HTTP/2 response bodies are being taken.
    taking: Arc<Taking>,
    /// Whether a write to the client's socket waits for room (set by
    /// [`SendTimeout`](crate::gateway::send_timeout::SendTimeout)).
    socket_full: Arc<AtomicBool>,
    /// Bytes read from the client so far (counted by `SendTimeout`).
    bytes_in: Arc<AtomicU64>,
    /// Its HTTP/2 requests cut short.
    resets: Arc<StreamResets>,
}

/// The requests open on a connection, over any version, and when the last
/// one ended: what [`Activity::idle_for`] and
/// [`reclaim`](crate::gateway::reclaim) judge idleness by. On tokio's
/// clock, so that tests with paused time see it move.
#[derive(Debug)]
struct OpenRequests {
    count: AtomicUsize,
    /// When the count last fell to 0 (or the connection opened), in
    /// microseconds since [`OpenRequests::origin`].
    idle_since: AtomicU64,
    origin: tokio::time::Instant,
}

impl Default for OpenRequests {
    fn default() -> Self {
        OpenRequests {
            count: AtomicUsize::new(0),
            idle_since: AtomicU64::new(0),
            origin: tokio::time::Instant::now(),
        }
    }
}

impl OpenRequests {
    fn now(&self) -> u64 {
        u64::try_from(self.origin.elapsed().as_micros()).unwrap_or(u64::MAX)
    }
}

/// How a connection's HTTP/2 response bodies are being taken by hyper,
/// which takes the next piece of a body only once the client's
/// flow-control window has room for it. Time is cut into epochs of one
/// timeout each (see [`Activity::stalled_for`]); each body owed a take
/// counts in the epoch it became owed in.
#[derive(Default)]
struct Taking {
    /// The current epoch.
    epoch: AtomicU64,
    /// Bodies that handed hyper a piece and have not been asked for the
    /// next one since, by the epoch they did so in, modulo 3: only the
    /// last three epochs can hold any (see [`Activity::stalled_for`]).
    owed: [AtomicUsize; 3],
}

impl Default for Activity {
    fn default() -> Self {
        Activity {
            in_flight: watch::Sender::new(0),
            open: Arc::default(),
            http1: Arc::new(AtomicBool::new(false)),
            taking: Arc::default(),
            socket_full: Arc::default(),
            bytes_in: Arc::default(),
            resets: Arc::default(),
        }
    }
}

impl Activity {
    /// A request begins, over `version`: it is in flight until the guard
    /// is dropped (with its response body, once hyper has taken the last
    /// of it; see [`ActiveBody`]).
    pub fn begin(&self, version: http::Version) -> InFlight {
        let http2 = version >= http::Version::HTTP_2;
        self.open.count.fetch_add(1, Ordering::Relaxed);
        // Over HTTP/1 only the connection's first request is counted. It
        // wakes the waiters, which then see an HTTP/1 connection and wait
        // for nothing more (hyper closes those itself); counting every
        // request would wake each of them twice a request for nothing.
        let counted = http2 || !self.http1.swap(true, Ordering::Relaxed);
        let in_flight = counted.then(|| {
            self.in_flight.send_modify(|n| *n += 1);
            self.in_flight.clone()
        });
        InFlight {
            in_flight,
            open: self.open.clone(),
            taking: http2.then(|| self.taking.clone()),
            owed_in: None,
            resets: http2.then(|| {
                (
                    self.resets.clone(),
                    tokio::time::Instant::now() + CUT_SHORT_WITHIN,
                )
            }),
            answered: false,
        }
    }

    /// The connection's HTTP/2 requests cut short (see [`StreamResets`]).
    pub fn resets(&self) -> &StreamResets {
        &self.resets
    }

    /// How long, in microseconds, no request has been open on the
    /// connection (since it opened, or since its last request ended);
    /// `None` while one is.
    pub fn idle_for_micros(&self) -> Option<u64> {
        if self.open.count.load(Ordering::Acquire) > 0 {
            return None;
        }
        let since = self.open.idle_since.load(Ordering::Acquire);
        Some(self.open.now().saturating_sub(since))
    }

    /// Resolves once no request has been in flight for `timeout` straight,
    /// on a connection that is not HTTP/1 (hyper closes those itself, and
    /// a second timer would race its own); never for HTTP/1.
    ///
    /// A request that begins and ends while this is not looking (between
    /// two polls of its task, as a quick one does) leaves `in_flight` as
    /// it was, but not the time the last request ended: the timeout then
    /// starts over. Without that, an HTTP/1 connection whose first request
    /// was that quick was closed under its client a timeout after it
    /// opened, however busy.
    pub async fn idle_for(&self, timeout: Duration) {
        let mut in_flight = self.in_flight.subscribe();
        loop {
            // Never closed: `self` holds the sender.
            let _ = in_flight.wait_for(|n| *n == 0).await;
            if self.http1.load(Ordering::Relaxed) {
                return std::future::pending().await;
            }
            tokio::select! {
                // A request that came in as the time ran out wins.
                biased;
                _ = in_flight.wait_for(|n| *n > 0) => {}
                () = tokio::time::sleep(timeout) => {
                    let quiet = self
                        .idle_for_micros()
                        .is_some_and(|idle| u128::from(idle) >= timeout.as_micros());
                    if quiet {
                        return;
                    }
                }
            }
        }
    }

    /// Resolves once, after a stop began (when this is first polled),
    /// nothing has been in flight for `timeout` and the client has sent
    /// nothing at all: it did not answer the GOAWAY's ping. A pooled
    /// HTTP/2 client reads its socket only while it has a request out, so
    /// it never answers, and hyper would wait for it until the grace
    /// period ends. A client that answers is left to hyper's graceful
    /// shutdown, which ends the connection once its streams have gone out
    /// (the last bytes of a response may wait for the client's window
    /// after hyper has taken them from its body). Never for HTTP/1.
    pub async fn unanswered_after_stop(&self, timeout: Duration) {
        let at_stop = self.bytes_in.load(Ordering::Relaxed);
        self.idle_for(timeout).await;
        if self.bytes_in.load(Ordering::Relaxed) != at_stop {
            std::future::pending::<()>().await;
        }
    }

    /// The counter the connection's socket counts the bytes it reads
    /// from the client in, to give to its
    /// [`SendTimeout`](crate::gateway::send_timeout::SendTimeout).
    pub fn bytes_in(&self) -> Arc<AtomicU64> {
        self.bytes_in.clone()
    }

    /// The flag the connection's socket sets while a write to it waits
    /// for room, to give to its [`SendTimeout`](crate::gateway::send_timeout::SendTimeout).
    pub fn socket_full(&self) -> Arc<AtomicBool> {
        self.socket_full.clone()
    }

    /// Resolves once an HTTP/2 response body has waited for the client to
    /// take its last piece for at least `timeout` (and at most twice
    /// that): the client has taken none of that response for that long,
    /// whatever it does with the connection's other streams. Never for
    /// HTTP/1, whose stalls [`SendTimeout`](crate::gateway::send_timeout::SendTimeout)
    /// sees at the socket; nor while the socket is full, which is
    /// `SendTimeout`'s to judge too: a client that reads the socket slowly
    /// leaves the pieces owed because the socket is full, not because it
    /// grants no window.
    pub async fn stalled_for(&self, timeout: Duration) {
        let mut in_flight = self.in_flight.subscribe();
        loop {
            // Never closed: `self` holds the sender.
            let _ = in_flight.wait_for(|n| *n > 0).await;
            if self.http1.load(Ordering::Relaxed) {
                return std::future::pending().await;
            }
            tokio::time::sleep(timeout).await;
            // Epoch n + 1 begins. A body still owed since epoch n - 1 has
            // been owed since before epoch n began, a whole timeout ago.
            // That count's slot, (n - 1) mod 3, is reused for epoch n + 2;
            // bodies left in it (while the socket was full) are then
            // checked as that epoch's, later than their own (up to three
            // timeouts after the socket has room), never sooner.
            let n = self.taking.epoch.fetch_add(1, Ordering::Relaxed);
            let before_last = ((n + 2) % 3) as usize;
            if self.taking.owed[before_last].load(Ordering::Relaxed) > 0
                && !self.socket_full.load(Ordering::Relaxed)
            {
                return;
            }
        }
    }
}

/// One request in flight (see [`Activity::begin`]).
pub struct InFlight {
    /// The connection's count, if this request is counted in it (see
    /// [`Activity::begin`]).
    in_flight: Option<watch::Sender<usize>>,
    /// Every open request of the connection.
    open: Arc<OpenRequests>,
    /// Over HTTP/2: how the connection's bodies are being taken.
    taking: Option<Arc<Taking>>,
    /// The slot of the epoch this request's body handed hyper a piece in,
    /// if it has not been asked for the next one since.
    owed_in: Option<usize>,
    /// Over HTTP/2: where it counts if cut short, and until when an end
    /// before its response's counts so.
    resets: Option<(Arc<StreamResets>, tokio::time::Instant)>,
    /// Whether its response body has ended (or failed): hyper took or
    /// was handed all of it.
    answered: bool,
}

impl InFlight {
    /// hyper asks the body for its next piece.
    fn asked(&mut self) {
        if let (Some(taking), Some(slot)) = (&self.taking, self.owed_in.take()) {
            taking.owed[slot].fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// The body handed hyper a piece of data.
    fn handed(&mut self) {
        if let (Some(taking), None) = (&self.taking, self.owed_in) {
            let slot = (taking.epoch.load(Ordering::Relaxed) % 3) as usize;
            taking.owed[slot].fetch_add(1, Ordering::Relaxed);
            self.owed_in = Some(slot);
        }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.asked();
        if let Some((resets, until)) = self.resets.take() {
            resets.ended(!self.answered && tokio::time::Instant::now() < until);
        }
        // The time first, then the count: a look in between must not see
        // a connection busy until now as idle since long before.
        if self.open.count.load(Ordering::Acquire) == 1 {
            self.open
                .idle_since
                .store(self.open.now(), Ordering::Release);
        }
        self.open.count.fetch_sub(1, Ordering::AcqRel);
        if let Some(in_flight) = &self.in_flight {
            in_flight.send_modify(|n| *n -= 1);
        }
    }
}

/// hyper drops a body it has found at its end without asking it for more
/// (an empty one, or one whose last piece it took): its response ended.
impl<B: Body> Drop for ActiveBody<B> {
    fn drop(&mut self) {
        if self.rest.is_empty() && self.inner.is_end_stream() {
            self.in_flight.answered = true;
        }
    }
}

/// A response body that keeps its request in flight until hyper has taken
/// the last of it. Over HTTP/2 it is handed over in pieces of at most
/// `HTTP2_PIECE` (16 KiB): hyper would take a whole body at once into the
/// connection's send buffer, and the request would then no longer count
/// as in flight while a slow reader is still receiving it. (hyper takes
/// the next piece once the one before fits the client's flow-control
/// window, and ends the body right after its last piece: up to a piece
/// may still wait for window after that.)
pub struct ActiveBody<B: Body> {
    inner: B,
    /// The rest of a data frame larger than a piece.
    rest: Bytes,
    in_flight: InFlight,
}

impl<B: Body> ActiveBody<B> {
    /// `inner`, keeping `in_flight` alive as long as it is.
    pub fn new(inner: B, in_flight: InFlight) -> ActiveBody<B> {
        ActiveBody {
            inner,
            rest: Bytes::new(),
            in_flight,
        }
    }

    /// The next piece of `data` to hand over, keeping the rest.
    fn piece(&mut self, mut data: Bytes) -> Bytes {
        if self.in_flight.taking.is_some() && data.len() > HTTP2_PIECE {
            self.rest = data.split_off(HTTP2_PIECE);
        }
        self.in_flight.handed();
        data
    }
}

impl<B: Body<Data = Bytes> + Unpin> Body for ActiveBody<B> {
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        let this = self.get_mut();
        this.in_flight.asked();
        if !this.rest.is_empty() {
            let rest = std::mem::take(&mut this.rest);
            return Poll::Ready(Some(Ok(Frame::data(this.piece(rest)))));
        }
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                Ok(data) => Poll::Ready(Some(Ok(Frame::data(this.piece(data))))),
                // Trailers end a body; hyper asks for nothing after them,
                // and a chunked upstream body does not say it has ended.
                Err(frame) => {
                    this.in_flight.answered = true;
                    Poll::Ready(Some(Ok(frame)))
                }
            },
            other => {
                if matches!(other, Poll::Ready(None | Some(Err(_)))) {
                    this.in_flight.answered = true;
                }
                other
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.rest.is_empty() && self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        let mut hint = self.inner.size_hint();
        let rest = self.rest.len() as u64;
        // The upper bound first: `set_lower` asserts it is not above the
        // upper one, which an exact hint of the inner body's rest would be.
        if let Some(upper) = hint.upper() {
            hint.set_upper(upper + rest);
        }
        hint.set_lower(hint.lower() + rest);
        hint
    }
}

#[cfg(test)]
mod tests {
    use http::Version;
    use tokio::time::Instant;

    use super::*;

    const TIMEOUT: Duration = Duration::from_secs(10);

    /// An HTTP/2 request counts as cut short when its stream ends before
    /// its response within `CUT_SHORT_WITHIN` of its start: dropped before
    /// it had a response, or with its body not taken to the end. One whose
    /// body ended, or that ended later, does not; HTTP/1 requests are not
    /// counted at all (their client can only close the connection).
    #[tokio::test(start_paused = true)]
    async fn http2_requests_ended_before_their_answers_soon_after_they_began_are_cut_short() {
        let activity = Activity::default();
        // No response yet: the client reset it as it went upstream.
        drop(activity.begin(Version::HTTP_2));
        assert_eq!(activity.resets.cut_short(), 1);
        // A body not taken to its end.
        let body = ActiveBody::new(
            http_body_util::Full::new(Bytes::from_static(b"answer")),
            activity.begin(Version::HTTP_2),
        );
        drop(body);
        assert_eq!(activity.resets.cut_short(), 2);
        // A body taken to its end, polled until it says so.
        let mut body = ActiveBody::new(
            http_body_util::Full::new(Bytes::from_static(b"answer")),
            activity.begin(Version::HTTP_2),
        );
        let taken = http_body_util::BodyExt::collect(&mut body).await;
        assert!(taken.is_ok());
        drop(body);
        assert_eq!(activity.resets.cut_short(), 2);
        // A body that ends with trailers: hyper asks for nothing after them,
        // and drops it (a chunked upstream body still says it has not
        // ended). A review's client saw every such answer counted.
        let mut body = ActiveBody::new(DataThenTrailers(0), activity.begin(Version::HTTP_2));
        loop {
            let frame = http_body_util::BodyExt::frame(&mut body).await;
            let frame = frame.expect("a frame").expect("no error");
            if frame.is_trailers() {
                break;
            }
        }
        drop(body);
        assert_eq!(activity.resets.cut_short(), 2);
        // An empty body, which hyper drops without asking it for anything.
        drop(ActiveBody::new(
            http_body_util::Empty::<Bytes>::new(),
            activity.begin(Version::HTTP_2),
        ));
        assert_eq!(activity.resets.cut_short(), 2);
        // Given up on later than `CUT_SHORT_WITHIN`: a client tired of a
        // slow answer, not an attack.
        let slow = activity.begin(Version::HTTP_2);
        tokio::time::sleep(CUT_SHORT_WITHIN).await;
        drop(slow);
        assert_eq!(activity.resets.cut_short(), 2);
        // HTTP/1: not counted.
        drop(activity.begin(Version::HTTP_11));
        assert_eq!(activity.resets.cut_short(), 2);
    }

    /// A body of one data frame and then trailers, that never says it has
    /// ended: as a chunked upstream body with trailers seems to hyper.
    struct DataThenTrailers(u8);

    impl Body for DataThenTrailers {
        type Data = Bytes;
        type Error = std::convert::Infallible;

        fn poll_frame(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
            self.0 += 1;
            Poll::Ready(match self.0 {
                1 => Some(Ok(Frame::data(Bytes::from_static(b"answer")))),
                2 => Some(Ok(Frame::trailers(http::HeaderMap::new()))),
                _ => None,
            })
        }
    }

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

    /// The waiters of an HTTP/1 connection, already waiting when its first
    /// request comes, never resolve: not while requests come and go, nor
    /// long after the last one (hyper closes the connection itself).
    #[tokio::test(start_paused = true)]
    async fn an_http1_connection_is_never_idle_nor_stalled_after_its_first_request() {
        let activity = Activity::default();
        let (a, b, c) = (activity.clone(), activity.clone(), activity.clone());
        let idle = tokio::spawn(async move { a.idle_for(TIMEOUT).await });
        let stalled = tokio::spawn(async move { b.stalled_for(TIMEOUT).await });
        let after_stop = tokio::spawn(async move { c.unanswered_after_stop(TIMEOUT).await });
        tokio::time::sleep(TIMEOUT / 2).await;
        for _ in 0..3 {
            let request = activity.begin(Version::HTTP_11);
            tokio::time::sleep(TIMEOUT * 2).await;
            drop(request);
            tokio::time::sleep(TIMEOUT * 2).await;
        }
        tokio::time::sleep(Duration::from_secs(3600)).await;
        for (name, task) in [
            ("idle", idle),
            ("stalled", stalled),
            ("given up", after_stop),
        ] {
            assert!(!task.is_finished(), "an HTTP/1 connection was {name}");
            task.abort();
        }
    }

    /// After a stop, a connection is given up a timeout after its last
    /// request only if its client has sent nothing since the stop began.
    #[tokio::test(start_paused = true)]
    async fn only_a_client_that_sends_nothing_after_the_stop_is_given_up() {
        let activity = Activity::default();
        drop(activity.begin(Version::HTTP_2));
        activity.bytes_in().fetch_add(100, Ordering::Relaxed);
        let started = Instant::now();
        activity.unanswered_after_stop(TIMEOUT).await;
        assert_eq!(started.elapsed(), TIMEOUT);

        let answering = activity.unanswered_after_stop(TIMEOUT);
        tokio::pin!(answering);
        assert!(!ready(answering.as_mut()).await);
        // The client acknowledges the GOAWAY's ping.
        activity.bytes_in().fetch_add(17, Ordering::Relaxed);
        tokio::time::advance(TIMEOUT * 100).await;
        assert!(!ready(answering.as_mut()).await);
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

    /// A request that begins and ends between two polls of the waiter
    /// (the waiter's task was busy serving it) still counts: over HTTP/1
    /// the connection is then never idle, and over HTTP/2 the timeout
    /// starts over.
    #[tokio::test(start_paused = true)]
    async fn a_request_begun_and_ended_unseen_still_counts() {
        for version in [Version::HTTP_11, Version::HTTP_2] {
            let activity = Activity::default();
            let idle = activity.idle_for(TIMEOUT);
            tokio::pin!(idle);
            assert!(!ready(idle.as_mut()).await);
            tokio::time::advance(TIMEOUT / 2).await;
            drop(activity.begin(version));
            tokio::time::advance(TIMEOUT / 2).await;
            assert!(!ready(idle.as_mut()).await, "idle over {version:?}");
            tokio::time::advance(TIMEOUT * 2).await;
            let idle_now = ready(idle.as_mut()).await;
            assert_eq!(idle_now, version == Version::HTTP_2, "{version:?}");
        }
    }

    /// A response body of `pieces` whole HTTP/2 pieces, in flight on
    /// `activity` over `version`.
    fn body_of(
        activity: &Activity,
        pieces: usize,
        version: Version,
    ) -> ActiveBody<http_body_util::Full<Bytes>> {
        let whole = Bytes::from(vec![7u8; pieces * HTTP2_PIECE]);
        ActiveBody::new(http_body_util::Full::new(whole), activity.begin(version))
    }

    /// A body whose upstream has sent nothing yet.
    struct WaitingUpstream;

    impl Body for WaitingUpstream {
        type Data = Bytes;
        type Error = std::convert::Infallible;

        fn poll_frame(
            self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
            Poll::Pending
        }
    }

    /// An HTTP/2 body whose last piece hyper has not taken for a timeout
    /// (the client grants no window) is a stall, found within two.
    #[tokio::test(start_paused = true)]
    async fn an_http2_body_the_client_takes_nothing_of_is_a_stall() {
        use http_body_util::BodyExt;

        let activity = Activity::default();
        let mut body = body_of(&activity, 4, Version::HTTP_2);
        let started = Instant::now();
        let stalled = activity.stalled_for(TIMEOUT);
        tokio::pin!(stalled);
        // Taken: two pieces, half a timeout apart.
        for _ in 0..2 {
            assert!(!ready(stalled.as_mut()).await);
            body.frame().await.expect("a piece").expect("data");
            tokio::time::sleep(TIMEOUT / 2).await;
        }
        // Then nothing more is taken.
        tokio::time::timeout(10 * TIMEOUT, stalled)
            .await
            .expect("a stall was found");
        let stalled_after = started.elapsed() - TIMEOUT / 2;
        assert!(
            (TIMEOUT..=2 * TIMEOUT).contains(&stalled_after),
            "found {stalled_after:?} after the last piece"
        );
        drop(body);
        let owed = activity
            .taking
            .owed
            .iter()
            .map(|n| n.load(Ordering::Relaxed));
        assert_eq!(owed.sum::<usize>(), 0);
    }

    /// A stalled body is found even while the client takes pieces of
    /// another response on the same connection.
    #[tokio::test(start_paused = true)]
    async fn a_stalled_body_is_found_while_other_streams_flow() {
        use http_body_util::BodyExt;

        let activity = Activity::default();
        let mut stalled = body_of(&activity, 4, Version::HTTP_2);
        stalled.frame().await.expect("a piece").expect("data");
        let mut flowing = body_of(&activity, 256, Version::HTTP_2);
        let taker = tokio::spawn(async move {
            while flowing.frame().await.is_some() {
                tokio::time::sleep(TIMEOUT / 4).await;
            }
        });
        let started = Instant::now();
        tokio::time::timeout(10 * TIMEOUT, activity.stalled_for(TIMEOUT))
            .await
            .expect("the stalled body was found");
        let found = started.elapsed();
        assert!(
            (TIMEOUT..=2 * TIMEOUT).contains(&found),
            "found after {found:?}"
        );
        assert!(!taker.is_finished(), "the other stream still flows");
        taker.abort();
        drop(stalled);
    }

    /// While the socket is full, an owed body is the send timeout's to
    /// judge (the client may be reading the socket slowly); once it has
    /// room again, the stall is found within three timeouts (its count
    /// sits in a slot that has since been reused for a later epoch).
    #[tokio::test(start_paused = true)]
    async fn no_stall_is_found_while_the_socket_is_full() {
        use http_body_util::BodyExt;

        let activity = Activity::default();
        let mut body = body_of(&activity, 4, Version::HTTP_2);
        body.frame().await.expect("a piece").expect("data");
        let full = activity.socket_full();
        full.store(true, Ordering::Relaxed);
        let stalled = activity.stalled_for(TIMEOUT);
        tokio::pin!(stalled);
        let waited = tokio::time::timeout(20 * TIMEOUT, stalled.as_mut());
        assert!(waited.await.is_err(), "a stall while the socket was full");
        full.store(false, Ordering::Relaxed);
        let started = Instant::now();
        tokio::time::timeout(10 * TIMEOUT, stalled)
            .await
            .expect("the stall was found once the socket had room");
        assert!(started.elapsed() <= 3 * TIMEOUT, "{:?}", started.elapsed());
        drop(body);
    }

    /// A client that takes a piece every half timeout, a body waiting on
    /// its upstream, and an HTTP/1 connection never stall.
    #[tokio::test(start_paused = true)]
    async fn slow_takers_bodies_waiting_upstream_and_http1_never_stall() {
        use http_body_util::BodyExt;

        let activity = Activity::default();
        let mut body = body_of(&activity, 64, Version::HTTP_2);
        let taker = tokio::spawn(async move {
            while body.frame().await.is_some() {
                tokio::time::sleep(TIMEOUT / 2).await;
            }
        });
        let stalled = tokio::time::timeout(20 * TIMEOUT, activity.stalled_for(TIMEOUT));
        assert!(
            stalled.await.is_err(),
            "a client taking every piece stalled"
        );
        taker.abort();

        let activity = Activity::default();
        let mut body = ActiveBody::new(WaitingUpstream, activity.begin(Version::HTTP_2));
        let asked = std::future::poll_fn(|cx| Poll::Ready(Pin::new(&mut body).poll_frame(cx)));
        assert!(asked.await.is_pending());
        let stalled = tokio::time::timeout(20 * TIMEOUT, activity.stalled_for(TIMEOUT));
        assert!(
            stalled.await.is_err(),
            "a body waiting on its upstream stalled"
        );

        let activity = Activity::default();
        let mut body = body_of(&activity, 4, Version::HTTP_11);
        body.frame().await.expect("a frame").expect("data");
        let stalled = tokio::time::timeout(20 * TIMEOUT, activity.stalled_for(TIMEOUT));
        assert!(stalled.await.is_err(), "an HTTP/1 connection stalled");
    }

    /// Over HTTP/2 a large body is handed over in pieces, and counts as
    /// in flight until the last is taken; over HTTP/1 it goes whole.
    #[tokio::test]
    async fn http2_bodies_are_handed_over_in_pieces_while_in_flight() {
        use http_body_util::{BodyExt, Full};

        let whole = Bytes::from(vec![7u8; 3 * HTTP2_PIECE + 5]);
        let activity = Activity::default();
        let mut body = ActiveBody::new(Full::new(whole.clone()), activity.begin(Version::HTTP_2));
        let mut pieces = Vec::new();
        let mut left = whole.len() as u64;
        while let Some(frame) = body.frame().await {
            pieces.push(frame.expect("data").into_data().expect("data"));
            assert_eq!(*activity.in_flight.borrow(), 1);
            // What is left, the pieces held back counted: `Full` has
            // handed all of it over after the first frame.
            left -= pieces.last().map_or(0, |p| p.len() as u64);
            assert_eq!(body.size_hint().exact(), Some(left));
        }
        let sizes: Vec<usize> = pieces.iter().map(Bytes::len).collect();
        assert_eq!(sizes, [HTTP2_PIECE, HTTP2_PIECE, HTTP2_PIECE, 5]);
        assert_eq!(pieces.concat(), whole);
        assert!(body.is_end_stream());
        drop(body);
        assert_eq!(*activity.in_flight.borrow(), 0);

        let mut body = ActiveBody::new(Full::new(whole.clone()), activity.begin(Version::HTTP_11));
        let frame = body.frame().await.expect("a frame").expect("data");
        assert_eq!(frame.into_data().expect("data"), whole);
    }
}
