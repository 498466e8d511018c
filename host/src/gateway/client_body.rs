//! A client's request body on its way in: how long it may pause, and a
//! record of how it ended, so that a client that stalls or breaks off its
//! body is told so, and is not reported as a failure of the upstream.

use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use tokio::time::Instant;

use crate::gateway::body_memory::{ClientConnection, ConnectionWaits};
use crate::gateway::client_gone;
use crate::gateway::hop_by_hop::strip_request_trailers;
use crate::gateway::wait_timer::WaitTimer;
use crate::unpoisoned::LockUnpoisoned as _;

/// The error type of the bodies this module wraps.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// How a request body is coming along, shared between the body and
/// whoever forwards the request (it travels in the request's extensions).
#[derive(Debug, Default)]
pub struct BodyProgress {
    state: AtomicU8,
    /// Whether the reader takes the whole body into memory as it comes.
    read_whole: AtomicBool,
    /// Whether the request's answer has come (the upstream answered before
    /// it had the whole body, for one streamed through).
    answered: AtomicBool,
    /// The body's client connection, where the server tells (for its
    /// requests waiting for room in the body memory, or for a turn to the
    /// upstream).
    connection: Option<ClientConnection>,
}

/// Frames are handed out as they come; the reader has not asked for more.
const FLOWING: u8 = 0;
/// The reader asked for more and waits on the client.
const WAITING_ON_CLIENT: u8 = 1;
/// The whole body arrived.
const COMPLETE: u8 = 2;
/// The client's stream failed (it went away, or sent bad chunking).
const BROKEN: u8 = 3;
/// The client paused longer than the body read timeout.
const STALLED: u8 = 4;
/// The client went away mid-body (see [`client_gone::went_away`]).
const GONE: u8 = 5;

/// What a client did wrong with its request body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClientFault {
    /// Its stream failed: it went away mid-body, or framed it badly (400).
    Broken,
    /// It paused longer than the body read timeout (408).
    Stalled,
    /// It sent more than the body limit without declaring its length
    /// (413).
    TooLarge,
    /// It went away mid-body: closed or reset its connection, or reset
    /// its HTTP/2 stream. No response is counted, the access log says 499,
    /// and the request counts as abandoned (read for the plugin) or passed
    /// through (streamed, as far as it came). An HTTP/1 client that only
    /// shut down its sending side looks the same, and may still read the
    /// 400 `client_gone` it is sent, as one that did so while its request
    /// waited for room does.
    Gone,
}

impl ClientFault {
    /// The status and error code the client is answered with.
    pub fn answer(self) -> (http::StatusCode, &'static str) {
        match self {
            ClientFault::Broken => (http::StatusCode::BAD_REQUEST, "body_read_error"),
            ClientFault::Stalled => (http::StatusCode::REQUEST_TIMEOUT, "body_timeout"),
            ClientFault::TooLarge => (http::StatusCode::PAYLOAD_TOO_LARGE, "body_too_large"),
            ClientFault::Gone => (http::StatusCode::BAD_REQUEST, "client_gone"),
        }
    }
}

impl BodyProgress {
    /// The progress of a body that comes on `connection`.
    pub fn on_connection(connection: ClientConnection) -> BodyProgress {
        BodyProgress {
            connection: Some(connection),
            ..BodyProgress::default()
        }
    }

    /// The body's client connection, if its server tells.
    pub fn connection(&self) -> Option<ClientConnection> {
        self.connection.clone()
    }

    /// The client's fault, if its body failed because of the client.
    pub fn fault(&self) -> Option<ClientFault> {
        match self.state.load(Ordering::Acquire) {
            BROKEN => Some(ClientFault::Broken),
            STALLED => Some(ClientFault::Stalled),
            GONE => Some(ClientFault::Gone),
            _ => None,
        }
    }

    /// Whether the reader is waiting for the client to send more: the
    /// body is incomplete because of the client, not because its reader
    /// (the upstream) stopped taking it.
    pub fn waiting_on_client(&self) -> bool {
        self.state.load(Ordering::Acquire) == WAITING_ON_CLIENT
    }

    /// Whether the whole body arrived (none of it may still come).
    pub fn complete(&self) -> bool {
        self.state.load(Ordering::Acquire) == COMPLETE
    }

    /// The request's answer has come: what of its body is cut off from
    /// now on can get no 413 (see [`Capped`](crate::gateway::body_limit::Capped)).
    pub fn answered(&self) {
        self.answered.store(true, Ordering::Release);
    }

    /// Whether the request's answer has come.
    pub fn was_answered(&self) -> bool {
        self.answered.load(Ordering::Acquire)
    }

    /// The reader takes the whole body into memory (for the plugin),
    /// taking every frame as soon as it comes: from now on its waits are
    /// on the client whatever the HTTP version, and are timed.
    pub fn reading_whole(&self) {
        self.read_whole.store(true, Ordering::Release);
    }

    fn set(&self, state: u8) {
        self.state.store(state, Ordering::Release);
    }
}

/// What may hold one HTTP/2 connection's flow-control window unread, so
/// that its clients cannot send more on any stream: bodies whose reader
/// took a frame and has not asked for more since (an upstream reading
/// slowly), and requests waiting for room in the body memory, which read
/// nothing meanwhile. A body whose reader waits on its client holds none
/// (hyper gives the window back as frames are taken). Bodies not yet read
/// at all (waiting for a turn to the upstream, or for its connection) are
/// not counted: those waits end within the connect timeout, and counting
/// them let a client keep sixteen empty streams queued for turns, and so
/// every wait of the connection untimed.
#[derive(Debug)]
pub struct ConnectionWindow {
    holders: AtomicUsize,
    /// The connection's requests waiting for room.
    room_waits: Arc<ConnectionWaits>,
    /// How many streams' windows fill the connection's.
    streams_to_fill: usize,
    /// When the window last stopped being possibly used up.
    freed: Mutex<Option<Instant>>,
}

impl ConnectionWindow {
    /// A connection whose window is `streams_to_fill` streams' windows,
    /// with `room_waits` its requests waiting for room.
    pub fn new(streams_to_fill: usize, room_waits: Arc<ConnectionWaits>) -> ConnectionWindow {
        ConnectionWindow {
            holders: AtomicUsize::new(0),
            room_waits,
            streams_to_fill,
            freed: Mutex::new(None),
        }
    }

    /// Whether what holds window unread may have used it all up, with
    /// `holders` bodies holding some.
    fn used_up_with(&self, holders: usize) -> bool {
        holders + self.room_waits.now() >= self.streams_to_fill
    }

    /// Whether a client may have been unable to send since `since`: the
    /// window may be used up now, or was after `since`.
    fn may_have_kept_clients_waiting(&self, since: Instant) -> bool {
        self.used_up_with(self.holders.load(Ordering::Acquire))
            || self
                .freed
                .lock_unpoisoned()
                .is_some_and(|freed| freed > since)
    }
}

/// One body's count among its connection's [`ConnectionWindow`] holders.
struct WindowShare {
    window: Arc<ConnectionWindow>,
    holding: bool,
}

impl WindowShare {
    fn hold(&mut self) {
        if !std::mem::replace(&mut self.holding, true) {
            self.window.holders.fetch_add(1, Ordering::AcqRel);
        }
    }

    fn release(&mut self) {
        if std::mem::replace(&mut self.holding, false) {
            let window = &self.window;
            let before = window.holders.fetch_sub(1, Ordering::AcqRel);
            if window.used_up_with(before) && !window.used_up_with(before - 1) {
                *window.freed.lock_unpoisoned() = Some(Instant::now());
            }
        }
    }
}

impl Drop for WindowShare {
    fn drop(&mut self) {
        self.release();
    }
}

/// A request body that fails with a
/// [`WaitedTooLong`](crate::gateway::wait_timer::WaitedTooLong) when the client sends
/// nothing for `pause` while its reader waits, and records in its
/// [`BodyProgress`] how it went. Only time spent waiting on the client
/// counts: a reader that stops reading (an upstream not yet connected, or
/// not taking more) does not make the client late.
///
/// Over HTTP/2 a stream's client may also be unable to send because the
/// connection's flow-control window is used up ([`ConnectionWindow`]): a
/// wait that lasts the timeout while the window may have been used up
/// (now, or at some time since the wait began) is the gateway's, not the
/// client's, and starts afresh. Before, HTTP/2 bodies streamed through
/// were not timed at all, so one connection's 128 streams, each sending a
/// piece and then nothing, held 128 upstream turns (or connections) for
/// the whole response timeout, 10 min. A body read whole for the plugin
/// ([`BodyProgress::reading_whole`], once it has room in the body memory,
/// see `gateway::body_memory`) is timed whatever the window.
///
/// A body that ends before the length it declared (its content-length)
/// fails as broken. HTTP/1 framing already fails such a body; over HTTP/2
/// hyper ends a body whose client reset its stream with `NO_ERROR` as if it
/// were whole, and the client that did so has abandoned the request.
///
/// The frame that brings the last byte of the length it declared is held
/// until the body's end is seen too, where it does not end with it (an
/// HTTP/2 client that sends `END_STREAM` later): a reader that knows the
/// length (hyper's client) asks for nothing more once it has it, and the
/// upstream had the whole request while the client went on sending. A
/// client that sent more than it declared had its stream reset by h2 as
/// malformed, and the upstream ran the request all the same (RFC 9113
/// section 8.1.1: a proxy must not forward it).
pub struct ClientBody<B> {
    inner: B,
    /// Times the waits on the client.
    pause: WaitTimer,
    /// Its share of its HTTP/2 connection's window.
    window: Option<WindowShare>,
    /// When the wait under way began.
    waiting_since: Option<Instant>,
    progress: Arc<BodyProgress>,
    /// The length the body declared, if it did.
    declared: Option<u64>,
    /// Data bytes received so far (handed out, or held).
    received: u64,
    /// The frame that brought the last declared byte, until the body ends.
    held: Option<Frame<Bytes>>,
    /// Trailers that came after it, handed out next.
    trailers_after_held: Option<Frame<Bytes>>,
}

/// A body that went on past the length it declared.
#[derive(Debug)]
pub struct WentOnPastItsLength {
    /// Bytes the content-length declared.
    pub declared: u64,
}

impl std::fmt::Display for WentOnPastItsLength {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "the client's request body went on past the {} bytes its content-length declares",
            self.declared
        )
    }
}

impl std::error::Error for WentOnPastItsLength {}

/// A body that ended before the length it declared.
#[derive(Debug)]
pub struct EndedShort {
    /// Bytes that came.
    pub received: u64,
    /// Bytes the content-length declared.
    pub declared: u64,
}

impl std::fmt::Display for EndedShort {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "the client's request body ended after {} of the {} bytes its content-length declares \
             (over HTTP/2: the client reset the stream), so the request was abandoned",
            self.received, self.declared
        )
    }
}

impl std::error::Error for EndedShort {}

impl<B: Body> ClientBody<B> {
    /// Wraps `inner`, whose client may pause at most `pause`; its progress
    /// is recorded in `progress`. `window` is its HTTP/2 connection's (none
    /// over HTTP/1). Its exact size hint, if it has one, is the length it
    /// declared.
    pub fn new(
        inner: B,
        pause: Duration,
        window: Option<Arc<ConnectionWindow>>,
        progress: Arc<BodyProgress>,
    ) -> ClientBody<B> {
        let what = "the client sent no more of the request body";
        let window = window.map(|window| WindowShare {
            window,
            holding: false,
        });
        ClientBody {
            declared: inner.size_hint().exact(),
            received: 0,
            held: None,
            trailers_after_held: None,
            inner,
            pause: WaitTimer::new(pause, what, "--body-read-timeout-ms"),
            window,
            waiting_since: None,
            progress,
        }
    }
}

impl<B> ClientBody<B> {
    /// The reader got something from the client (or its end).
    fn progressed(&mut self, state: u8) {
        self.pause.progressed();
        self.waiting_since = None;
        self.progress.set(state);
        if let Some(share) = &mut self.window {
            // Until its reader asks for more, what comes next stays unread.
            if state == FLOWING {
                share.hold();
            } else {
                share.release();
            }
        }
    }

    /// Whether a wait that began at `since` and lasted the timeout may be
    /// the gateway's: over HTTP/2, for a body streamed through, while its
    /// connection's window may have been used up.
    fn window_may_have_held_it_up(&self, since: Instant) -> bool {
        self.window.as_ref().is_some_and(|share| {
            !self.progress.read_whole.load(Ordering::Acquire)
                && share.window.may_have_kept_clients_waiting(since)
        })
    }
}

impl<B> Body for ClientBody<B>
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
        if let Some(trailers) = this.trailers_after_held.take() {
            return Poll::Ready(Some(Ok(trailers)));
        }
        loop {
            let frame = match Pin::new(&mut this.inner).poll_frame(cx) {
                Poll::Ready(Some(Ok(frame))) => frame,
                Poll::Ready(Some(Err(e))) => {
                    this.held = None;
                    let e: BoxError = e.into();
                    this.progressed(if client_gone::went_away(&*e) {
                        GONE
                    } else {
                        BROKEN
                    });
                    return Poll::Ready(Some(Err(e)));
                }
                Poll::Ready(None) => return Poll::Ready(this.ended()),
                Poll::Pending => return this.waiting(cx),
            };
            let size = frame.data_ref().map_or(0, |data| data.len() as u64);
            this.received += size;
            // Trailers: their hop-by-hop fields stay on this hop, and
            // those the gateway manages in a head go nowhere.
            let frame = strip_request_trailers(frame);
            if let Some(held) = this.held.take() {
                if size > 0 {
                    this.progressed(BROKEN);
                    let declared = this.declared.unwrap_or_default();
                    return Poll::Ready(Some(Err(Box::new(WentOnPastItsLength { declared }))));
                }
                if frame.is_data() {
                    // An empty DATA frame (one that carries only the end).
                    this.held = Some(held);
                    this.progressed(FLOWING);
                    continue;
                }
                this.progressed(COMPLETE);
                this.trailers_after_held = Some(frame);
                return Poll::Ready(Some(Ok(held)));
            }
            if size > 0 && this.declared == Some(this.received) && !this.inner.is_end_stream() {
                this.held = Some(frame);
                this.progressed(FLOWING);
                continue;
            }
            // A body of a declared length ends with its last frame: a
            // reader that knows it (hyper's client) never asks again.
            let state = if this.inner.is_end_stream() {
                COMPLETE
            } else {
                FLOWING
            };
            this.progressed(state);
            return Poll::Ready(Some(Ok(frame)));
        }
    }

    fn is_end_stream(&self) -> bool {
        self.held.is_none() && self.trailers_after_held.is_none() && self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        match &self.held {
            Some(held) => SizeHint::with_exact(held.data_ref().map_or(0, |data| data.len() as u64)),
            None => self.inner.size_hint(),
        }
    }
}

impl<B> ClientBody<B> {
    /// The client's body ended: the frame held for its end, if any, or
    /// the end (an error where it came short of its declared length).
    fn ended(&mut self) -> Option<Result<Frame<Bytes>, BoxError>> {
        if let Some(held) = self.held.take() {
            self.progressed(COMPLETE);
            return Some(Ok(held));
        }
        match self.declared {
            Some(declared) if self.received < declared => {
                self.progressed(BROKEN);
                let received = self.received;
                Some(Err(Box::new(EndedShort { received, declared })))
            }
            _ => {
                self.progressed(COMPLETE);
                None
            }
        }
    }

    /// The client sent nothing more yet: pending, or, once it paused past
    /// the timeout that is its own, stalled.
    fn waiting(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        self.progress.set(WAITING_ON_CLIENT);
        if let Some(share) = &mut self.window {
            share.release();
        }
        let since = *self.waiting_since.get_or_insert_with(Instant::now);
        if !self.pause.expired(cx) {
            return Poll::Pending;
        }
        if self.window_may_have_held_it_up(since) {
            // Timed afresh, from now.
            self.waiting_since = Some(Instant::now());
            self.pause.progressed();
            if !self.pause.expired(cx) {
                return Poll::Pending;
            }
        }
        self.progress.set(STALLED);
        Poll::Ready(Some(Err(Box::new(self.pause.error()))))
    }
}

#[cfg(test)]
mod tests {
    use std::future::Future;

    use http_body_util::BodyExt;
    use tokio::sync::mpsc;

    use super::*;

    type Sent = Result<Frame<Bytes>, std::io::Error>;

    /// A body whose frames the test sends, as a client's arrive.
    struct Channel(mpsc::Receiver<Sent>);

    impl Body for Channel {
        type Data = Bytes;
        type Error = std::io::Error;

        fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Sent>> {
            self.0.poll_recv(cx)
        }
    }

    fn body(pause: Duration) -> (ClientBody<Channel>, Arc<BodyProgress>, mpsc::Sender<Sent>) {
        let (tx, rx) = mpsc::channel(4);
        let progress = Arc::new(BodyProgress::default());
        (
            ClientBody::new(Channel(rx), pause, None, progress.clone()),
            progress,
            tx,
        )
    }

    /// A body that ends with its last frame (a declared length) is
    /// complete once that frame is taken, though its reader never asks for
    /// the end: the gateway then has nothing of it left to read.
    #[tokio::test]
    async fn a_body_is_complete_with_its_last_frame() {
        let progress = Arc::new(BodyProgress::default());
        let whole = http_body_util::Full::new(Bytes::from_static(b"{}"));
        let mut declared = ClientBody::new(whole, Duration::from_secs(60), None, progress.clone());
        assert!(!progress.complete());
        declared.frame().await.expect("a frame").expect("data");
        assert!(declared.is_end_stream());
        assert!(progress.complete());

        let (mut body, progress, tx) = body(Duration::from_secs(60));
        tx.send(Ok(Frame::data(Bytes::from_static(b"{"))))
            .await
            .unwrap();
        body.frame().await.expect("a frame").expect("data");
        assert!(!progress.complete(), "more may come");
        drop(tx);
        assert!(body.frame().await.is_none());
        assert!(progress.complete());
    }

    /// A client's trailers go on without the fields of its own hop.
    #[tokio::test]
    async fn a_clients_trailers_lose_their_hop_by_hop_fields() {
        let (mut body, _progress, tx) = body(Duration::from_secs(60));
        let mut trailers = http::HeaderMap::new();
        for (name, value) in [
            ("x-checksum", "abc"),
            ("connection", "close, x-private"),
            ("x-private", "1"),
            ("keep-alive", "timeout=5"),
            ("te", "trailers"),
        ] {
            trailers.insert(
                http::HeaderName::from_static(name),
                http::HeaderValue::from_static(value),
            );
        }
        tx.send(Ok(Frame::trailers(trailers))).await.unwrap();
        let frame = body.frame().await.expect("a frame").expect("trailers");
        let trailers = frame.into_trailers().expect("trailers");
        let names: Vec<&str> = trailers.keys().map(|n| n.as_str()).collect();
        assert_eq!(names, ["x-checksum"]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_client_that_pauses_too_long_is_stalled_and_one_that_keeps_sending_is_not() {
        let (mut body, progress, tx) = body(Duration::from_secs(60));
        // Chunks 59 s apart: never a pause of 60 s.
        for _ in 0..3 {
            let sender = tx.clone();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_secs(59)).await;
                let _ = sender.send(Ok(Frame::data(Bytes::from_static(b"x")))).await;
            });
            let frame = body.frame().await.expect("a frame").expect("data");
            assert_eq!(frame.into_data().expect("data"), "x");
            assert_eq!(progress.fault(), None);
        }
        // Then nothing: after 60 s of waiting, the body fails.
        let error = body.frame().await.expect("an end").expect_err("stalled");
        assert!(error.to_string().contains("for 60000 ms"), "{error}");
        assert_eq!(progress.fault(), Some(ClientFault::Stalled));
        drop(tx);
    }

    #[tokio::test(start_paused = true)]
    async fn time_the_reader_does_not_read_is_not_the_clients() {
        let (mut body, progress, tx) = body(Duration::from_secs(60));
        tx.send(Ok(Frame::data(Bytes::from_static(b"a"))))
            .await
            .expect("send");
        let _ = body.frame().await;
        // The reader takes two minutes before it asks again (an upstream
        // slow to connect): the client sent everything meanwhile.
        tokio::time::sleep(Duration::from_secs(120)).await;
        assert!(!progress.waiting_on_client());
        tx.send(Ok(Frame::data(Bytes::from_static(b"b"))))
            .await
            .expect("send");
        drop(tx);
        let rest = body.collect().await.expect("the rest").to_bytes();
        assert_eq!(rest, "b");
        assert_eq!(progress.fault(), None);
        assert!(!progress.waiting_on_client());
    }

    /// Whether `body`'s next frame is ready now.
    async fn ready_now(body: &mut ClientBody<Channel>) -> bool {
        let mut waiting = body.frame();
        std::future::poll_fn(|cx| Poll::Ready(Pin::new(&mut waiting).poll(cx).is_ready())).await
    }

    /// A body of an HTTP/2 connection whose window is `window`'s, and the
    /// sender of its frames.
    fn http2(
        window: &Arc<ConnectionWindow>,
    ) -> (ClientBody<Channel>, Arc<BodyProgress>, mpsc::Sender<Sent>) {
        let (tx, rx) = mpsc::channel(4);
        let progress = Arc::new(BodyProgress::default());
        let pause = Duration::from_secs(60);
        let body = ClientBody::new(Channel(rx), pause, Some(window.clone()), progress.clone());
        (body, progress, tx)
    }

    /// A body whose reader took a frame and asks for no more: it holds
    /// some of its connection's window.
    async fn holding(window: &Arc<ConnectionWindow>) -> (ClientBody<Channel>, mpsc::Sender<Sent>) {
        let (mut body, _, tx) = http2(window);
        tx.send(Ok(Frame::data(Bytes::from_static(b"a"))))
            .await
            .expect("send");
        body.frame().await.expect("a frame").expect("data");
        (body, tx)
    }

    /// Over HTTP/2 a body streamed through is timed as over HTTP/1 while
    /// the connection's window cannot have been used up; a wait that lasts
    /// the timeout while other streams' unread bodies, or requests waiting
    /// for room, may have used it up, at its end or at any time since it
    /// began, is the gateway's, and is timed afresh. A body read whole is
    /// timed whatever the window.
    #[tokio::test(start_paused = true)]
    async fn over_http2_waits_are_the_clients_unless_the_window_may_have_been_used_up() {
        let room_waits = Arc::new(ConnectionWaits::default());
        let window = Arc::new(ConnectionWindow::new(2, room_waits.clone()));

        // Alone on its connection: a stall is the client's.
        let (mut body, progress, _tx) = http2(&window);
        let error = body.frame().await.expect("an end").expect_err("stalled");
        assert!(error.to_string().contains("for 60000 ms"), "{error}");
        assert_eq!(progress.fault(), Some(ClientFault::Stalled));

        // Bodies not read yet (waiting for a turn) hold nothing: a client
        // cannot keep waits untimed with empty streams.
        let (mut body, progress, _tx) = http2(&window);
        let _queued = [http2(&window), http2(&window)];
        let error = body.frame().await.expect("an end").expect_err("stalled");
        assert!(error.to_string().contains("for 60000 ms"), "{error}");
        assert_eq!(progress.fault(), Some(ClientFault::Stalled));

        // Two bodies whose upstream reads slowly hold the whole window for
        // an hour: the wait is not the client's.
        let (mut body, progress, tx) = http2(&window);
        let slow = [holding(&window).await, holding(&window).await];
        assert!(!ready_now(&mut body).await);
        assert!(progress.waiting_on_client());
        for _ in 0..60 {
            tokio::time::sleep(Duration::from_secs(60)).await;
            assert!(!ready_now(&mut body).await);
            assert_eq!(progress.fault(), None);
        }
        // Read at last: from then, a whole timeout is the client's.
        drop(slow);
        let freed = Instant::now();
        let error = body.frame().await.expect("an end").expect_err("stalled");
        assert!(error.to_string().contains("for 60000 ms"), "{error}");
        assert!(
            freed.elapsed() >= Duration::from_secs(60),
            "{:?}",
            freed.elapsed()
        );
        drop(tx);

        // Used up from 0.5 s to 59.5 s of a wait, and free at its end: the
        // client could not send for most of it, and gets a whole timeout
        // more.
        let (mut body, progress, _tx) = http2(&window);
        assert!(!ready_now(&mut body).await);
        tokio::time::sleep(Duration::from_millis(500)).await;
        let slow = [holding(&window).await, holding(&window).await];
        tokio::time::sleep(Duration::from_secs(59)).await;
        drop(slow);
        tokio::time::sleep(Duration::from_millis(600)).await;
        assert!(!ready_now(&mut body).await);
        assert_eq!(progress.fault(), None, "cut off for the gateway's wait");
        let freed = Instant::now();
        let error = body.frame().await.expect("an end").expect_err("stalled");
        assert!(error.to_string().contains("for 60000 ms"), "{error}");
        assert!(
            freed.elapsed() >= Duration::from_secs(59),
            "{:?}",
            freed.elapsed()
        );

        // Requests waiting for room hold window too.
        let (mut body, progress, _tx) = http2(&window);
        room_waits.add_for_test(2);
        for _ in 0..10 {
            tokio::time::sleep(Duration::from_secs(60)).await;
            assert!(!ready_now(&mut body).await);
            assert_eq!(progress.fault(), None);
        }
        room_waits.add_for_test(-2);

        // Read whole, a body is timed whatever the window.
        let (mut body, progress, _tx) = http2(&window);
        let _slow = [holding(&window).await, holding(&window).await];
        progress.reading_whole();
        let error = body.frame().await.expect("an end").expect_err("stalled");
        assert!(error.to_string().contains("for 60000 ms"), "{error}");
    }

    /// A body holds its share of the window from each frame its reader
    /// takes until the reader asks for more, and none before its first
    /// frame, once it has ended, or once it is dropped.
    #[tokio::test]
    async fn a_body_holds_window_only_from_a_frame_until_its_reader_asks_for_more() {
        let window = Arc::new(ConnectionWindow::new(
            16,
            Arc::new(ConnectionWaits::default()),
        ));
        let holders = || window.holders.load(Ordering::Acquire);
        let (mut body, _, tx) = http2(&window);
        assert_eq!(holders(), 0);
        assert!(!ready_now(&mut body).await);
        assert_eq!(holders(), 0);
        tx.send(Ok(Frame::data(Bytes::from_static(b"a"))))
            .await
            .expect("send");
        body.frame().await.expect("a frame").expect("data");
        assert_eq!(holders(), 1);
        assert!(!ready_now(&mut body).await);
        assert_eq!(holders(), 0);
        tx.send(Ok(Frame::data(Bytes::from_static(b"b"))))
            .await
            .expect("send");
        body.frame().await.expect("a frame").expect("data");
        assert_eq!(holders(), 1);
        drop(tx);
        assert!(body.frame().await.is_none());
        assert_eq!(holders(), 0);
        // Dropped while holding.
        let (body, _tx) = holding(&window).await;
        assert_eq!(holders(), 1);
        drop(body);
        assert_eq!(holders(), 0);
    }

    /// A body with a declared length, as hyper's is with a content-length.
    struct Declared(Channel, u64);

    impl Body for Declared {
        type Data = Bytes;
        type Error = std::io::Error;

        fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Sent>> {
            Pin::new(&mut self.0).poll_frame(cx)
        }

        fn size_hint(&self) -> SizeHint {
            SizeHint::with_exact(self.1)
        }
    }

    #[tokio::test]
    async fn a_body_that_ends_before_its_declared_length_is_broken() {
        for (sent, declared, whole) in [
            (&b"abc"[..], 5, false),
            (b"abcde", 5, true),
            (b"", 1, false),
        ] {
            let (tx, rx) = mpsc::channel(4);
            let progress = Arc::new(BodyProgress::default());
            let pause = Duration::from_secs(60);
            let body = ClientBody::new(
                Declared(Channel(rx), declared),
                pause,
                None,
                progress.clone(),
            );
            if !sent.is_empty() {
                tx.send(Ok(Frame::data(Bytes::copy_from_slice(sent))))
                    .await
                    .expect("send");
            }
            drop(tx);
            let result = body.collect().await;
            if whole {
                assert_eq!(result.expect("whole").to_bytes(), sent);
                assert_eq!(progress.fault(), None);
            } else {
                let error = result.expect_err("ended short").to_string();
                let expected = format!("after {} of the {declared} bytes", sent.len());
                assert!(error.contains(&expected), "{error}");
                assert_eq!(progress.fault(), Some(ClientFault::Broken));
            }
        }
    }

    /// The frame that brings the last declared byte is handed out only
    /// with the body's end (here an empty DATA frame, trailers, then the
    /// end), in order: a reader that stops at the declared length would
    /// not see what comes after it. More data after it fails the body.
    #[tokio::test]
    async fn the_last_declared_byte_is_held_until_the_body_ends() {
        let data = |bytes: &'static [u8]| Ok(Frame::data(Bytes::from_static(bytes)));
        let (tx, rx) = mpsc::channel(8);
        let progress = Arc::new(BodyProgress::default());
        let pause = Duration::from_secs(60);
        let mut body = ClientBody::new(Declared(Channel(rx), 4), pause, None, progress.clone());
        tx.send(data(b"ab")).await.expect("send");
        let first = body.frame().await.expect("a frame").expect("data");
        assert_eq!(first.into_data().expect("data"), "ab");
        tx.send(data(b"cd")).await.expect("send");
        tx.send(data(b"")).await.expect("send");
        let polled = std::future::poll_fn(|cx| Poll::Ready(Pin::new(&mut body).poll_frame(cx)));
        assert!(polled.await.is_pending(), "held until the end");
        assert!(!body.is_end_stream());
        let mut fields = http::HeaderMap::new();
        fields.insert("x-checksum", http::HeaderValue::from_static("1"));
        tx.send(Ok(Frame::trailers(fields))).await.expect("send");
        drop(tx);
        let held = body.frame().await.expect("a frame").expect("data");
        assert_eq!(held.into_data().expect("data"), "cd");
        let trailers = body.frame().await.expect("a frame").expect("trailers");
        assert!(trailers.is_trailers());
        assert!(body.frame().await.is_none());
        assert_eq!(progress.fault(), None);

        let (tx, rx) = mpsc::channel(8);
        let progress = Arc::new(BodyProgress::default());
        let mut body = ClientBody::new(Declared(Channel(rx), 4), pause, None, progress.clone());
        tx.send(data(b"abcd")).await.expect("send");
        tx.send(data(b"e")).await.expect("send");
        let error = body.frame().await.expect("an end").expect_err("past");
        assert!(error.to_string().contains("past the 4 bytes"), "{error}");
        assert_eq!(progress.fault(), Some(ClientFault::Broken));
    }

    #[tokio::test]
    async fn a_broken_stream_is_the_clients_fault() {
        let (mut body, progress, tx) = body(Duration::from_secs(60));
        tx.send(Err(std::io::Error::other("bad chunk size")))
            .await
            .expect("send");
        let error = body.frame().await.expect("an end").expect_err("broken");
        assert!(error.to_string().contains("bad chunk size"));
        assert_eq!(progress.fault(), Some(ClientFault::Broken));
    }
}
