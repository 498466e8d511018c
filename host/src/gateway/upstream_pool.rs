//! One worker thread's keep-alive HTTP/1.1 connections to one upstream.
//!
//! A connection is opened when no idle one is at hand, and goes back to
//! the pool only once its response body has ended: a response that streams
//! for minutes (server-sent events) keeps its connection to itself, and the
//! requests meanwhile get others. The newest idle connection is reused
//! first; one left idle for the idle timeout is closed. A request that a
//! reused connection never sent (the upstream closed it just then) is sent
//! again on another. A connection whose exchange is abandoned before its
//! response head (the response timeout ran out, or the client went away)
//! is closed, and so is one whose request body the upstream is still not
//! taking an idle timeout after its response ended: hyper would otherwise
//! go on trying to write the body to an upstream that does not read it,
//! and hold the body, the connection and, for a streamed body, the
//! client's connection, for good.
//!
//! It replaces hyper-util's general-purpose client, whose pool is shared
//! between threads, hashes every request's scheme and authority to find
//! its connections (SipHash), and waits for each connection's readiness in
//! a future of its own: 7,000 to 8,000 instructions a request spent on one
//! upstream that this worker alone uses (BENCHMARKS.md).

use std::collections::VecDeque;
use std::fmt;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::task::{ready, Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, Response};
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;
use hyper::client::conn::http1::{self, SendRequest};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;
use tokio::task::AbortHandle;

use crate::gateway::hop_by_hop::strip_trailers;
use crate::gateway::upstream::UpstreamBody as RequestBody;
use crate::gateway::upstream_resolve::{ResolveError, Resolver};
use crate::gateway::upstream_turns::Turn;
use crate::log_throttle::LogThrottle;
use crate::unpoisoned::LockUnpoisoned as _;

/// The largest response head (status line and headers) taken from the
/// upstream, in bytes: as large as the request heads clients may send by
/// default (`--max-header-bytes`). A larger one fails the request with
/// 502, as nginx's `upstream sent too big header` does (its limit is 4 or
/// 8 KiB), rather than reaching a client that may refuse it: an HTTP/2
/// client's `SETTINGS_MAX_HEADER_LIST_SIZE`, or its memory. hyper's own
/// limit is about 400 KiB.
///
/// Also the bound on an upstream connection's reads. While a response body
/// comes faster than it is passed on, hyper reads ahead, each read twice
/// the last, until its buffer holds this much: at most 120 KiB of the body
/// waits there. With hyper's default (about 400 KiB) it was 504 KiB, held
/// for a client that reads slowly or not at all (a review saw 1,000 such
/// clients hold 470 MiB).
pub const MAX_RESPONSE_HEAD_BYTES: usize = 64 << 10;

/// Keep-alive connections to the upstream at one host and port.
pub struct ConnectionPool {
    shared: Arc<Shared>,
}

/// What the pool and the response bodies it lends connections to share.
struct Shared {
    /// The host and port to connect to.
    resolver: Resolver,
    connect_timeout: Duration,
    idle_timeout: Duration,
    idle: Mutex<Idle>,
    /// Wakes the reaper early: a connection given back is due to close
    /// before the time the reaper sleeps until.
    reaper_wake: Arc<tokio::sync::Notify>,
    /// Which of the addresses a new connection tries first (see
    /// [`in_turn`]).
    turn: AtomicUsize,
    /// How many idle connections this pool keeps at most: its worker's
    /// share of those all workers keep (see `Upstream::keeping_idle_at_most`).
    max_idle: usize,
    /// The addresses new connections failed to reach lately, shared by the
    /// pools of one upstream.
    unreachable: Arc<Unreachable>,
}

/// The connections waiting for a request, oldest first.
struct Idle {
    connections: VecDeque<IdleConnection>,
    /// Whether a task is on its way to close those idle too long.
    reaper: bool,
    /// When the reaper wakes next, while it sleeps (`None` while it looks
    /// at the connections, or when none runs).
    reaper_wakes: Option<Instant>,
}

/// One connection: what sends requests on it, and the task that drives it
/// (aborting the task closes the connection).
struct Connection {
    sender: SendRequest<RequestBody>,
    task: AbortHandle,
    /// The address it went to.
    peer: SocketAddr,
}

/// Aborts a connection's task when dropped, unless disarmed first.
struct CloseOnDrop(Option<AbortHandle>);

impl CloseOnDrop {
    /// Keeps the connection open; returns its task.
    fn disarm(mut self) -> AbortHandle {
        self.0.take().expect("armed until disarmed")
    }
}

impl Drop for CloseOnDrop {
    fn drop(&mut self) {
        if let Some(task) = self.0.take() {
            task.abort();
        }
    }
}

/// A connection ready for its next request, and since when.
struct IdleConnection {
    connection: Connection,
    since: Instant,
}

/// Why a request got no response from the upstream.
#[derive(Debug)]
pub enum SendError {
    /// No connection could be opened within the connect timeout.
    ConnectTimedOut(Duration),
    /// Opening a connection failed.
    Connect(std::io::Error),
    /// The connection to the address (of those the upstream's name
    /// resolves to) failed before the response head arrived; the request
    /// may have been sent.
    Request(hyper::Error, SocketAddr),
}

impl SendError {
    /// The address whose connection failed, where one was made: for the
    /// log, as the upstream's name may resolve to several.
    pub fn address(&self) -> Option<SocketAddr> {
        match self {
            SendError::Request(_, address) => Some(*address),
            SendError::ConnectTimedOut(_) | SendError::Connect(_) => None,
        }
    }
}

impl fmt::Display for SendError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SendError::ConnectTimedOut(after) => {
                write!(f, "no connection within {} ms", after.as_millis())
            }
            SendError::Connect(e) => write!(f, "connecting failed: {e}"),
            SendError::Request(e, _) => write!(f, "{e}"),
        }
    }
}

impl std::error::Error for SendError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            SendError::ConnectTimedOut(_) => None,
            SendError::Connect(e) => e.source(),
            SendError::Request(e, _) => Some(e),
        }
    }
}

impl ConnectionPool {
    /// An empty pool for `host` (brackets of an IPv6 literal allowed) and
    /// `port`: a connection may take `connect_timeout` to open and is
    /// closed once idle for `idle_timeout`, and at most `max_idle` are kept
    /// idle. The pool notes in `unreachable`, which other pools may share,
    /// the addresses it could not connect to, and tries them last.
    pub fn new(
        host: &str,
        port: u16,
        connect_timeout: Duration,
        idle_timeout: Duration,
        max_idle: usize,
        unreachable: Arc<Unreachable>,
    ) -> ConnectionPool {
        let host = host
            .strip_prefix('[')
            .and_then(|h| h.strip_suffix(']'))
            .unwrap_or(host);
        ConnectionPool {
            shared: Arc::new(Shared {
                resolver: Resolver::new(host, port),
                connect_timeout,
                idle_timeout,
                idle: Mutex::new(Idle {
                    connections: VecDeque::new(),
                    reaper: false,
                    reaper_wakes: None,
                }),
                reaper_wake: Arc::default(),
                turn: AtomicUsize::new(0),
                max_idle,
                unreachable,
            }),
        }
    }

    /// Sends `request`, whose URI must be in origin form (`/path?query`)
    /// and which must carry its `Host` header, on an idle connection or a
    /// new one; resolves with the response head. The connection goes back
    /// to the pool when the response body has ended.
    #[cfg(test)]
    pub async fn send(
        &self,
        request: Request<RequestBody>,
    ) -> Result<Response<PooledBody>, SendError> {
        self.send_telling(request, &Sending::default(), None).await
    }

    /// [`ConnectionPool::send`], telling `sending` how far it got, for a
    /// caller that gives up on it (a timeout): whether it is opening a
    /// connection for a request not yet written (the upstream never
    /// reached, not one that never answered), and to which address the
    /// request went. The response's body holds `turn` (see
    /// [`PooledBody`]).
    pub async fn send_telling(
        &self,
        mut request: Request<RequestBody>,
        sending: &Sending,
        turn: Option<Turn>,
    ) -> Result<Response<PooledBody>, SendError> {
        // Once a request was written and lost with a reused connection, it
        // goes once more on a new one, and no more.
        let mut lost_once = false;
        loop {
            let idle = if lost_once {
                None
            } else {
                self.shared.checkout()
            };
            let (connection, reused) = match idle {
                Some(connection) => (connection, true),
                None => {
                    sending.connecting.store(!lost_once, Ordering::Relaxed);
                    let opened = self.shared.connect().await;
                    sending.connecting.store(false, Ordering::Relaxed);
                    (opened?, false)
                }
            };
            let Connection {
                mut sender,
                task,
                peer,
            } = connection;
            sending.set_peer(peer);
            // Until the response head arrives, dropping this future (the
            // response timeout, a client gone) closes the connection.
            let abandoned = CloseOnDrop(Some(task));
            // What to send again, on a new connection, if this reused one
            // turns out closed by the upstream after the request was
            // written and before any answer (its keep-alive ended as the
            // request went out): a bodiless GET, HEAD or OPTIONS, which
            // cannot have done anything twice. nginx does the same.
            let again = reused.then(|| resendable(&request)).flatten();
            match sender.try_send_request(request).await {
                Ok(response) => {
                    let back = GiveBack {
                        pool: self.shared.clone(),
                        connection: Connection {
                            sender,
                            task: abandoned.disarm(),
                            peer,
                        },
                    };
                    return Ok(response.map(|body| PooledBody::new(body, back, turn)));
                }
                Err(mut failed) => match (failed.take_message(), again) {
                    // Never written: the connection closed while idle. A new
                    // connection that fails so is not tried again.
                    (Some(unsent), _) if reused => request = unsent,
                    (None, Some(again)) if lost_unanswered(failed.error()) => {
                        request = again;
                        lost_once = true;
                    }
                    _ => return Err(SendError::Request(failed.into_error(), peer)),
                },
            }
        }
    }

    /// How many connections wait idle.
    #[cfg(test)]
    pub fn idle_count(&self) -> usize {
        self.shared.lock().connections.len()
    }
}

/// Whether a written request's connection ended before any answer: closed
/// (an incomplete message), reset, or broken, as an upstream that closes
/// with the request unread does.
fn lost_unanswered(error: &hyper::Error) -> bool {
    use std::io::ErrorKind;
    if error.is_incomplete_message() {
        return true;
    }
    let mut cause: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(error);
    while let Some(error) = cause {
        if let Some(io) = error.downcast_ref::<std::io::Error>() {
            return matches!(
                io.kind(),
                ErrorKind::ConnectionReset | ErrorKind::ConnectionAborted | ErrorKind::BrokenPipe
            );
        }
        cause = error.source();
    }
    false
}

/// A copy of `request` to send again, if it is a GET, HEAD or OPTIONS with
/// no body (see [`UpstreamPool::send_telling`]).
fn resendable(request: &Request<RequestBody>) -> Option<Request<RequestBody>> {
    use http_body_util::BodyExt as _;
    let idempotent = matches!(
        *request.method(),
        http::Method::GET | http::Method::HEAD | http::Method::OPTIONS
    );
    if !idempotent || !request.body().is_end_stream() {
        return None;
    }
    let mut again = Request::new(
        http_body_util::Empty::new()
            .map_err(|never| match never {})
            .boxed(),
    );
    *again.method_mut() = request.method().clone();
    *again.uri_mut() = request.uri().clone();
    *again.version_mut() = request.version();
    *again.headers_mut() = request.headers().clone();
    Some(again)
}

/// How far a request given to [`ConnectionPool::send_telling`] got, for a
/// caller that gives up on it before its answer.
#[derive(Debug, Default)]
pub struct Sending {
    /// Whether a connection is being opened for it, not yet written.
    connecting: AtomicBool,
    /// The address of the connection it went on, once it has one.
    peer: std::sync::Mutex<Option<SocketAddr>>,
}

impl Sending {
    /// Whether a connection is being opened for the request: it was never
    /// written.
    pub fn connecting(&self) -> bool {
        self.connecting.load(Ordering::Relaxed)
    }

    /// The address of the connection the request went on (the last one,
    /// where it went again on a new one), if any.
    pub fn peer(&self) -> Option<SocketAddr> {
        *self.peer.lock_unpoisoned()
    }

    fn set_peer(&self, peer: SocketAddr) {
        *self.peer.lock_unpoisoned() = Some(peer);
    }
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, Idle> {
        self.idle.lock_unpoisoned()
    }

    /// The newest idle connection that is still ready, to an address the
    /// upstream's name still has (see [`Resolver::moved_from`]); the
    /// others are closed. Under steady load a connection never idles long
    /// enough to be closed, so without the second rule the gateway stayed
    /// on the addresses of its first connections for good, whatever the
    /// name came to resolve to (a service moved, blue/green by DNS).
    fn checkout(&self) -> Option<Connection> {
        let mut idle = self.lock();
        while let Some(waiting) = idle.connections.pop_back() {
            let connection = waiting.connection;
            // Idle for the idle timeout, and not yet closed by the reaper
            // (its task is late on a busy thread): the upstream may be
            // closing it now (uvicorn's keep-alive race it exists for).
            let stale = waiting.since.elapsed() >= self.idle_timeout;
            if stale || self.resolver.moved_from(connection.peer) {
                connection.task.abort();
            } else if connection.sender.is_ready() {
                return Some(connection);
            }
        }
        None
    }

    /// Opens a connection, Nagle off, and leaves it to a task of this
    /// thread's runtime.
    async fn connect(&self) -> Result<Connection, SendError> {
        let deadline = tokio::time::Instant::now() + self.connect_timeout;
        let timed_out = || SendError::ConnectTimedOut(self.connect_timeout);
        let addresses = self
            .resolver
            .addresses(deadline)
            .await
            .map_err(|e| match e {
                ResolveError::TimedOut => timed_out(),
                ResolveError::Failed(e) => SendError::Connect(e),
            })?;
        let turn = self.turn.fetch_add(1, Ordering::Relaxed);
        let order = self
            .unreachable
            .tried_last(in_turn(&addresses, turn), Instant::now());
        let mut failed = Vec::new();
        let connected = connect_to_any(&order, deadline, &mut failed).await;
        let reached = connected.as_ref().ok().map(|(_, peer)| *peer);
        self.unreachable.note(&failed, reached, Instant::now());
        if let (Some(reached), Some((address, why))) = (reached, failed.first()) {
            static PASSED_OVER: LogThrottle = LogThrottle::new();
            if let Some(held_back) = PASSED_OVER.admit() {
                tracing::warn!(
                    host = self.resolver.host(),
                    %address,
                    %reached,
                    problem = %why,
                    "an upstream address took no connection, another did: it is tried after the \
                     others for {} s {held_back}",
                    UNREACHABLE_FOR.as_secs()
                );
            }
        }
        let (stream, peer) = connected.map_err(|e| e.unwrap_or_else(timed_out))?;
        stream.set_nodelay(true).map_err(SendError::Connect)?;
        let (sender, connection) = http1::Builder::new()
            .max_header_size(MAX_RESPONSE_HEAD_BYTES)
            // Also bounds what a response body holds in reads ahead (see
            // `MAX_RESPONSE_HEAD_BYTES`).
            .max_buf_size(MAX_RESPONSE_HEAD_BYTES)
            .handshake(TokioIo::new(stream))
            .await
            .map_err(|e| SendError::Request(e, peer))?;
        let task = tokio::spawn(async move {
            if let Err(e) = connection.await {
                tracing::debug!(
                    problem = %crate::gateway::error_chain::describe(&e),
                    "an upstream connection ended with an error"
                );
            }
        });
        Ok(Connection {
            sender,
            task: task.abort_handle(),
            peer,
        })
    }

    /// Takes back a connection whose response has ended: into the pool
    /// when it is ready for the next request; when it is not yet (the
    /// upstream answered before it took the whole request body), once it
    /// is, within the idle timeout, and closed if it is not by then; not at
    /// all when it is closed. The request's `turn` is held until then: a
    /// connection still sending is in use (`--max-upstream-requests`
    /// bounds the connections in use too).
    /// Gives back `connection`, whose response the upstream ended at
    /// `since` at the latest (see [`PooledBody`]).
    fn put(self: &Arc<Self>, connection: Connection, turn: Option<Turn>, since: Instant) {
        if connection.sender.is_ready() {
            self.put_ready(connection, since);
        } else if !connection.sender.is_closed() {
            let Ok(runtime) = tokio::runtime::Handle::try_current() else {
                connection.task.abort();
                return;
            };
            let pool = self.clone();
            runtime.spawn(async move {
                let Connection {
                    mut sender,
                    task,
                    peer,
                } = connection;
                match tokio::time::timeout(pool.idle_timeout, sender.ready()).await {
                    Ok(Ok(())) => pool.put_ready(Connection { sender, task, peer }, since),
                    Ok(Err(_closed)) => {}
                    Err(_still_sending) => task.abort(),
                }
                drop(turn);
            });
        }
    }

    /// Keeps `connection`, idle since `since`, among the idle ones, which
    /// stay in the order they went idle (the reaper looks at the front
    /// only); or closes it if it is idle for the idle timeout already.
    /// Where the pool keeps as many idle as it may, its oldest is closed
    /// to make room, as nginx's `keepalive` closes the least recently used.
    fn put_ready(self: &Arc<Self>, connection: Connection, since: Instant) {
        if since.elapsed() >= self.idle_timeout {
            connection.task.abort();
            return;
        }
        let mut idle = self.lock();
        if idle.connections.len() >= self.max_idle {
            match idle.connections.pop_front() {
                Some(oldest) => oldest.connection.task.abort(),
                None => {
                    drop(idle);
                    connection.task.abort();
                    return;
                }
            }
        }
        // At the back but for a response read slowly (see `PooledBody`).
        let at = idle
            .connections
            .iter()
            .rposition(|other| other.since <= since)
            .map_or(0, |before| before + 1);
        idle.connections
            .insert(at, IdleConnection { connection, since });
        if !idle.reaper {
            // Outside a runtime (never so in the gateway) idle connections
            // are left for the upstream to close.
            if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                idle.reaper = true;
                runtime.spawn(reap(Arc::downgrade(self), self.reaper_wake.clone()));
            }
        } else if idle
            .reaper_wakes
            .is_some_and(|wakes| since + self.idle_timeout < wakes)
        {
            // The reaper sleeps past this one's time (given back idle since
            // before the one it sleeps for): most connections given back
            // are due after it, and wake no one.
            idle.reaper_wakes = None;
            self.reaper_wake.notify_one();
        }
    }
}

/// A connection to the first of `addresses` that takes one, trying them in
/// turn, each within an equal share of the time left until `deadline` (as
/// hyper-util's connector did), so that an address that never answers (an
/// IPv6 route that drops packets) does not use up the time of the next.
/// Fails with the last address's error, `None` for a timeout.
/// Those that failed are put in `failed`, each with why.
async fn connect_to_any(
    addresses: &[SocketAddr],
    deadline: tokio::time::Instant,
    failed: &mut Vec<(SocketAddr, String)>,
) -> Result<(TcpStream, SocketAddr), Option<SendError>> {
    let mut last = Some(SendError::Connect(std::io::Error::new(
        std::io::ErrorKind::NotFound,
        "the upstream's host name resolves to no address",
    )));
    for (i, address) in addresses.iter().enumerate() {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        let share = left / u32::try_from(addresses.len() - i).unwrap_or(u32::MAX);
        match tokio::time::timeout(share, TcpStream::connect(address)).await {
            Ok(Ok(stream)) => return Ok((stream, *address)),
            Ok(Err(e)) => {
                failed.push((*address, format!("connecting failed: {e}")));
                last = Some(SendError::Connect(e));
            }
            Err(_elapsed) => {
                let waited = share.as_millis();
                failed.push((*address, format!("no connection within {waited} ms")));
                last = None;
            }
        }
    }
    Err(last)
}

/// How long an address a new connection failed to reach is tried after
/// the others: as nginx's `fail_timeout`. Without it, an address that
/// drops packets (a node gone, its pod's address still in DNS) cost every
/// connection that tried it first its share of the connect timeout, in
/// turn every second or third connection (a review saw 2.5 s added to 5
/// of 12 requests).
const UNREACHABLE_FOR: Duration = Duration::from_secs(10);

/// The addresses new connections failed to reach lately, and when.
#[derive(Default)]
pub struct Unreachable(Mutex<Vec<(SocketAddr, Instant)>>);

impl Unreachable {
    /// `order`, with the addresses that failed within [`UNREACHABLE_FOR`]
    /// of `now` moved after the others, each part in its order.
    fn tried_last(&self, order: Vec<SocketAddr>, now: Instant) -> Vec<SocketAddr> {
        let failed = self.0.lock_unpoisoned();
        if failed.is_empty() {
            return order;
        }
        let lately = |address: &SocketAddr| {
            failed
                .iter()
                .any(|(a, at)| a == address && now.duration_since(*at) < UNREACHABLE_FOR)
        };
        let (last, first): (Vec<_>, Vec<_>) = order.into_iter().partition(lately);
        first.into_iter().chain(last).collect()
    }

    /// Notes the addresses that `failed` at `now`, and that `reached`, if
    /// any, failed no more; forgets failures older than
    /// [`UNREACHABLE_FOR`].
    fn note(&self, failed: &[(SocketAddr, String)], reached: Option<SocketAddr>, now: Instant) {
        let mut noted = self.0.lock_unpoisoned();
        noted.retain(|(address, at)| {
            Some(*address) != reached
                && now.duration_since(*at) < UNREACHABLE_FOR
                && !failed.iter().any(|(a, _)| a == address)
        });
        noted.extend(failed.iter().map(|(address, _)| (*address, now)));
    }
}

/// `addresses` in the order a new connection tries them, its `turn`-th:
/// those of the first one's family (the one the system prefers) in turn,
/// each first in its turn, so that new connections spread over a name's
/// addresses (the replicas behind a headless service) rather than all
/// going to the first; then the others, in their order, so that an
/// address family that does not answer (an IPv6 route that drops packets)
/// is tried only after the preferred one.
fn in_turn(addresses: &[SocketAddr], turn: usize) -> Vec<SocketAddr> {
    let Some(first) = addresses.first() else {
        return Vec::new();
    };
    let (mut preferred, others): (Vec<SocketAddr>, Vec<SocketAddr>) = addresses
        .iter()
        .partition(|address| address.is_ipv4() == first.is_ipv4());
    let len = preferred.len();
    preferred.rotate_left(turn % len);
    preferred.extend(others);
    preferred
}

/// Closes the pool's connections as their idle time runs out, then ends
/// when none are left idle; the next one given back starts another.
/// `wake` ends a sleep early, for a connection given back idle since
/// before the oldest one.
async fn reap(pool: Weak<Shared>, wake: Arc<tokio::sync::Notify>) {
    loop {
        let next = {
            let Some(pool) = pool.upgrade() else { return };
            let mut idle = pool.lock();
            let now = Instant::now();
            let mut expired = Vec::new();
            while let Some(oldest) = idle.connections.front() {
                if now.duration_since(oldest.since) < pool.idle_timeout {
                    break;
                }
                expired.extend(idle.connections.pop_front());
            }
            let next = idle
                .connections
                .front()
                .map(|oldest| oldest.since + pool.idle_timeout);
            if next.is_none() {
                idle.reaper = false;
            }
            idle.reaper_wakes = next;
            drop(idle);
            // Dropping a sender closes its connection.
            drop(expired);
            next
        };
        match next {
            Some(deadline) => tokio::select! {
                () = tokio::time::sleep_until(deadline.into()) => {}
                () = wake.notified() => {}
            },
            None => return,
        }
    }
}

/// A connection lent to one response, to give back when its body ends.
struct GiveBack {
    pool: Arc<Shared>,
    connection: Connection,
}

/// The upstream's response body. When it has ended its connection goes
/// back to the pool; a body dropped or failed before its end closes its
/// connection (which may still be sending the request body).
///
/// The connection's idle time counts from when the upstream ended the
/// response, where its keep-alive timer starts (uvicorn's), not from when
/// the gateway read the end: a client that reads slowly holds the end in
/// the socket buffers meanwhile, and a connection the gateway took for
/// fresh could be one the upstream is closing. While the body's reader
/// polls, the end is read as it comes; so it came at the latest the time
/// the reader kept the body waiting (between taking a frame and asking
/// for the next) before it was read.
pub struct PooledBody {
    body: Incoming,
    give_back: Option<GiveBack>,
    /// The address of the connection the body came on.
    address: SocketAddr,
    /// The request's turn, if turns bound requests in flight: held until
    /// the body has ended and its connection is ready again (or closed),
    /// or the body has gone.
    turn: Option<Turn>,
    /// When the reader took the last frame, until it asks for the next.
    taken_at: Option<Instant>,
    /// How long in all the reader kept the body waiting.
    kept_waiting: Duration,
}

impl PooledBody {
    /// The address of the connection the body comes on: for the log, as
    /// the upstream's name may resolve to several.
    pub fn address(&self) -> SocketAddr {
        self.address
    }

    fn new(body: Incoming, give_back: GiveBack, turn: Option<Turn>) -> PooledBody {
        let mut pooled = PooledBody {
            body,
            address: give_back.connection.peer,
            give_back: Some(give_back),
            turn,
            taken_at: None,
            kept_waiting: Duration::ZERO,
        };
        // A response without a body (HEAD, 204, `Content-Length: 0`) may
        // never be polled.
        if pooled.body.is_end_stream() {
            pooled.ended();
        }
        pooled
    }

    fn ended(&mut self) {
        let turn = self.turn.take();
        if let Some(GiveBack { pool, connection }) = self.give_back.take() {
            match Instant::now().checked_sub(self.kept_waiting) {
                Some(since) => pool.put(connection, turn, since),
                None => connection.task.abort(),
            }
        }
    }

    /// Closes the connection of a body that will not end.
    fn abandon(&mut self) {
        if let Some(back) = self.give_back.take() {
            back.connection.task.abort();
        }
        self.turn = None;
    }
}

impl Drop for PooledBody {
    fn drop(&mut self) {
        self.abandon();
    }
}

impl Body for PooledBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let this = self.get_mut();
        if let Some(taken_at) = this.taken_at.take() {
            this.kept_waiting += taken_at.elapsed();
        }
        let frame = ready!(Pin::new(&mut this.body).poll_frame(cx));
        match &frame {
            None => this.ended(),
            Some(Ok(_)) if this.body.is_end_stream() => this.ended(),
            // Trailers are a body's last frame, after which its reader
            // (hyper) polls no more: the response has ended here, and the
            // connection may serve another. Their hop-by-hop fields stay
            // on this hop.
            Some(Ok(frame)) if frame.is_trailers() => this.ended(),
            Some(Ok(_)) => this.taken_at = Some(Instant::now()),
            Some(Err(_)) => this.abandon(),
        }
        Poll::Ready(frame.map(|frame| frame.map(strip_trailers)))
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use std::convert::Infallible;
    use std::net::SocketAddr;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use http::{HeaderMap, StatusCode};
    use http_body_util::{BodyExt, Empty, Full};
    use hyper::service::service_fn;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::sync::{mpsc, Notify};

    use super::*;

    /// A body whose chunks the test sends as it goes; it ends when the
    /// sender is dropped.
    struct Chunks(mpsc::UnboundedReceiver<Bytes>);

    impl Body for Chunks {
        type Data = Bytes;
        type Error = Infallible;

        fn poll_frame(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
            self.0
                .poll_recv(cx)
                .map(|chunk| chunk.map(|c| Ok(Frame::data(c))))
        }
    }

    /// `data`, then trailers: a body's last frame.
    struct WithTrailers(Option<Frame<Bytes>>, Option<HeaderMap>);

    impl Body for WithTrailers {
        type Data = Bytes;
        type Error = Infallible;

        fn poll_frame(
            mut self: Pin<&mut Self>,
            _cx: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
            let frame = match self.0.take() {
                Some(data) => Some(data),
                None => self.1.take().map(Frame::trailers),
            };
            Poll::Ready(frame.map(Ok))
        }
    }

    /// What the test upstream has seen.
    #[derive(Default)]
    struct Seen {
        accepted: AtomicUsize,
        closed: AtomicUsize,
        closed_one: Notify,
        /// The rest of the open `/stream` response.
        stream: Mutex<Option<mpsc::UnboundedSender<Bytes>>>,
    }

    /// A real HTTP/1.1 upstream on loopback: `/fixed` answers `ok`,
    /// `/close` the same with `Connection: close`, `/empty` 204,
    /// `/trailers` `ok` and an `x-checksum` trailer, and
    /// `/stream` one chunk, then whatever the test sends through
    /// [`Seen::stream`] until it drops it.
    async fn upstream() -> (SocketAddr, Arc<Seen>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let seen = Arc::new(Seen::default());
        let state = seen.clone();
        tokio::spawn(async move {
            loop {
                let (stream, _) = listener.accept().await.unwrap();
                state.accepted.fetch_add(1, Ordering::SeqCst);
                let state = state.clone();
                tokio::spawn(async move {
                    let per_request = state.clone();
                    let service = service_fn(move |request: Request<Incoming>| {
                        let state = per_request.clone();
                        async move {
                            let mut response = Response::new(match request.uri().path() {
                                "/stream" => {
                                    let (tx, rx) = mpsc::unbounded_channel();
                                    tx.send(Bytes::from_static(b"first")).unwrap();
                                    *state.stream.lock().unwrap() = Some(tx);
                                    Chunks(rx).boxed()
                                }
                                "/empty" => Empty::new().boxed(),
                                "/trailers" => {
                                    let mut trailers = HeaderMap::new();
                                    trailers.insert("x-checksum", "abc".parse().unwrap());
                                    WithTrailers(
                                        Some(Frame::data(Bytes::from_static(b"ok"))),
                                        Some(trailers),
                                    )
                                    .boxed()
                                }
                                _ => Full::new(Bytes::from_static(b"ok")).boxed(),
                            });
                            match request.uri().path() {
                                "/empty" => *response.status_mut() = StatusCode::NO_CONTENT,
                                // hyper sends only the trailers it was told of.
                                "/trailers" => {
                                    response.headers_mut().insert(
                                        http::header::TRAILER,
                                        http::HeaderValue::from_static("x-checksum"),
                                    );
                                }
                                "/close" => {
                                    response.headers_mut().insert(
                                        http::header::CONNECTION,
                                        http::HeaderValue::from_static("close"),
                                    );
                                }
                                _ => {}
                            }
                            Ok::<_, Infallible>(response)
                        }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                    state.closed.fetch_add(1, Ordering::SeqCst);
                    state.closed_one.notify_one();
                });
            }
        });
        (addr, seen)
    }

    fn pool_for(addr: SocketAddr, idle: Duration) -> ConnectionPool {
        ConnectionPool::new(
            &addr.ip().to_string(),
            addr.port(),
            Duration::from_secs(5),
            idle,
            usize::MAX,
            Arc::default(),
        )
    }

    fn get(path: &str) -> Request<RequestBody> {
        Request::get(path)
            .header(http::header::HOST, "upstream.test")
            .body(Empty::new().map_err(|never| match never {}).boxed())
            .unwrap()
    }

    async fn read_to_end(response: Response<PooledBody>) -> Bytes {
        response.into_body().collect().await.unwrap().to_bytes()
    }

    /// `n` responses of `/stream`, each on a connection of its own, their
    /// first chunk read.
    async fn streams_begun(pool: &ConnectionPool, n: usize) -> Vec<PooledBody> {
        let mut bodies = Vec::new();
        for _ in 0..n {
            let mut streaming = pool.send(get("/stream")).await.unwrap().into_body();
            streaming.frame().await.unwrap().unwrap();
            bodies.push(streaming);
        }
        bodies
    }

    /// Puts `connection` among `pool`'s idle ones, idle from now.
    fn idle_now(pool: &ConnectionPool, connection: Connection) {
        pool.shared.put_ready(connection, Instant::now());
    }

    fn accepted(seen: &Seen) -> usize {
        seen.accepted.load(Ordering::SeqCst)
    }

    #[tokio::test]
    async fn requests_one_after_another_share_one_connection() {
        let (addr, seen) = upstream().await;
        let pool = pool_for(addr, Duration::from_secs(60));
        for _ in 0..5 {
            let response = pool.send(get("/fixed")).await.unwrap();
            assert_eq!(read_to_end(response).await, "ok");
            assert_eq!(pool.idle_count(), 1);
        }
        assert_eq!(accepted(&seen), 1);
    }

    /// A pool keeps at most its share of idle connections: past it, it
    /// closes its oldest idle one for the one given back. Lent connections
    /// are not counted. Another pool (another worker's) keeps its own.
    #[tokio::test]
    async fn a_pool_keeps_at_most_its_share_of_idle_connections() {
        let (addr, seen) = upstream().await;
        let pool = || {
            ConnectionPool::new(
                &addr.ip().to_string(),
                addr.port(),
                Duration::from_secs(5),
                Duration::from_secs(60),
                2,
                Arc::default(),
            )
        };
        let (first, second) = (pool(), pool());
        let mut lent = Vec::new();
        for _ in 0..3 {
            lent.push(first.send(get("/fixed")).await.unwrap());
        }
        assert_eq!((accepted(&seen), first.idle_count()), (3, 0));
        for response in lent {
            assert_eq!(read_to_end(response).await, "ok");
        }
        assert_eq!(first.idle_count(), 2);
        bounded(seen.closed_one.notified()).await;
        assert_eq!(seen.closed.load(Ordering::SeqCst), 1, "the oldest closed");

        let response = second.send(get("/fixed")).await.unwrap();
        assert_eq!(read_to_end(response).await, "ok");
        assert_eq!((first.idle_count(), second.idle_count()), (2, 1));

        // Lent, one leaves the idle ones; given back, joins them again.
        let response = first.send(get("/fixed")).await.unwrap();
        assert_eq!(first.idle_count(), 1);
        assert_eq!(read_to_end(response).await, "ok");
        assert_eq!(first.idle_count(), 2);
        assert_eq!(accepted(&seen), 4);
        assert_eq!(seen.closed.load(Ordering::SeqCst), 1);
    }

    /// Server-sent events must not hold up other requests: a connection
    /// whose response still streams is not lent to another.
    #[tokio::test]
    async fn a_response_still_streaming_keeps_its_connection_to_itself() {
        let (addr, seen) = upstream().await;
        let pool = pool_for(addr, Duration::from_secs(60));
        let mut streaming = pool.send(get("/stream")).await.unwrap().into_body();
        let first = streaming
            .frame()
            .await
            .unwrap()
            .unwrap()
            .into_data()
            .unwrap();
        assert_eq!(first, "first");
        assert_eq!(pool.idle_count(), 0);

        let response = pool.send(get("/fixed")).await.unwrap();
        assert_eq!(read_to_end(response).await, "ok");
        assert_eq!(
            accepted(&seen),
            2,
            "the second request had a connection of its own"
        );
        assert_eq!(pool.idle_count(), 1);

        // The stream ends: its connection is given back too.
        let rest = seen.stream.lock().unwrap().take().unwrap();
        rest.send(Bytes::from_static(b"last")).unwrap();
        drop(rest);
        let last = streaming.collect().await.unwrap().to_bytes();
        assert_eq!(last, "last");
        assert_eq!(pool.idle_count(), 2);
        for _ in 0..2 {
            let response = pool.send(get("/fixed")).await.unwrap();
            assert_eq!(read_to_end(response).await, "ok");
        }
        assert_eq!(accepted(&seen), 2);
    }

    #[tokio::test]
    async fn a_body_dropped_before_its_end_takes_its_connection_with_it() {
        let (addr, seen) = upstream().await;
        let pool = pool_for(addr, Duration::from_secs(60));
        let mut streaming = pool.send(get("/stream")).await.unwrap().into_body();
        streaming.frame().await.unwrap().unwrap();
        drop(streaming);
        bounded(seen.closed_one.notified()).await;
        assert_eq!(pool.idle_count(), 0);
        let response = pool.send(get("/fixed")).await.unwrap();
        assert_eq!(read_to_end(response).await, "ok");
        assert_eq!(accepted(&seen), 2);
    }

    #[tokio::test]
    async fn a_connection_the_upstream_closes_after_its_answer_is_not_reused() {
        let (addr, seen) = upstream().await;
        let pool = pool_for(addr, Duration::from_secs(60));
        for n in 1..=3 {
            let response = pool.send(get("/close")).await.unwrap();
            assert_eq!(read_to_end(response).await, "ok");
            assert_eq!(accepted(&seen), n);
        }
    }

    #[tokio::test]
    async fn a_response_without_a_body_gives_its_connection_back_unread() {
        let (addr, seen) = upstream().await;
        let pool = pool_for(addr, Duration::from_secs(60));
        let response = pool.send(get("/empty")).await.unwrap();
        assert_eq!(response.status(), StatusCode::NO_CONTENT);
        // Not read, not even dropped yet.
        assert_eq!(pool.idle_count(), 1);
        let again = pool.send(get("/fixed")).await.unwrap();
        assert_eq!(read_to_end(again).await, "ok");
        assert_eq!(accepted(&seen), 1);
        drop(response);
    }

    /// A reader that stops at the trailers, as hyper's server does, has
    /// read the whole response: its connection serves the next request.
    #[tokio::test]
    async fn a_response_read_to_its_trailers_gives_its_connection_back() {
        let (addr, seen) = upstream().await;
        let pool = pool_for(addr, Duration::from_secs(60));
        for _ in 0..3 {
            let mut request = get("/trailers");
            request
                .headers_mut()
                .insert(http::header::TE, http::HeaderValue::from_static("trailers"));
            let mut body = pool.send(request).await.unwrap().into_body();
            let data = body.frame().await.unwrap().unwrap();
            assert_eq!(data.into_data().unwrap(), "ok");
            let trailers = body.frame().await.unwrap().unwrap();
            assert_eq!(trailers.trailers_ref().unwrap()["x-checksum"], "abc");
            drop(body);
            assert_eq!(pool.idle_count(), 1);
        }
        assert_eq!(accepted(&seen), 1);
    }

    #[tokio::test]
    async fn connections_idle_for_the_idle_timeout_are_closed() {
        let (addr, seen) = upstream().await;
        let idle = Duration::from_millis(200);
        let pool = pool_for(addr, idle);
        let response = pool.send(get("/fixed")).await.unwrap();
        // The connection is given back, and its idle time starts, as the
        // body's end is read: at or after this instant.
        let given_back = Instant::now();
        read_to_end(response).await;
        bounded(seen.closed_one.notified()).await;
        assert!(
            given_back.elapsed() >= idle,
            "closed after {:?}",
            given_back.elapsed()
        );
        assert_eq!(pool.idle_count(), 0);
        // The next request opens a new one; the reaper starts again.
        let response = pool.send(get("/fixed")).await.unwrap();
        read_to_end(response).await;
        assert_eq!(accepted(&seen), 2);
        bounded(seen.closed_one.notified()).await;
        assert_eq!(seen.closed.load(Ordering::SeqCst), 2);
    }

    /// A response its reader took slowly was ended by the upstream long
    /// before the gateway read its end, and the upstream's keep-alive timer
    /// started then: its connection, idle past the timeout counted so, is
    /// not reused.
    #[tokio::test]
    async fn a_connection_whose_response_was_read_slowly_is_idle_from_the_upstreams_end() {
        let (addr, seen) = upstream().await;
        let idle = Duration::from_millis(300);
        let pool = pool_for(addr, idle);
        let mut streaming = pool.send(get("/stream")).await.unwrap().into_body();
        streaming.frame().await.unwrap().unwrap();
        let rest = seen.stream.lock().unwrap().take().unwrap();
        rest.send(Bytes::from_static(b"last")).unwrap();
        drop(rest);
        // The reader is slow (its client is): the upstream ends meanwhile.
        tokio::time::sleep(idle + Duration::from_millis(100)).await;
        assert_eq!(streaming.collect().await.unwrap().to_bytes(), "last");
        let response = pool.send(get("/fixed")).await.unwrap();
        read_to_end(response).await;
        assert_eq!(accepted(&seen), 2, "the stale connection was reused");

        // Read at once, the same response's connection is reused.
        let mut streaming = pool.send(get("/stream")).await.unwrap().into_body();
        streaming.frame().await.unwrap().unwrap();
        let rest = seen.stream.lock().unwrap().take().unwrap();
        rest.send(Bytes::from_static(b"last")).unwrap();
        drop(rest);
        assert_eq!(streaming.collect().await.unwrap().to_bytes(), "last");
        let response = pool.send(get("/fixed")).await.unwrap();
        read_to_end(response).await;
        assert_eq!(accepted(&seen), 2, "a fresh connection was not reused");
    }

    /// The idle connections stay in the order they went idle, whenever
    /// they were given back, for the reaper, which looks at the oldest
    /// only.
    #[tokio::test]
    async fn a_connection_given_back_idle_for_long_joins_the_idle_in_order() {
        let (addr, seen) = upstream().await;
        let idle = Duration::from_secs(60);
        let pool = pool_for(addr, idle);
        let mut bodies = streams_begun(&pool, 3).await;
        assert_eq!(accepted(&seen), 3);
        let start = Instant::now();
        let order = [
            start - Duration::from_secs(3),
            start,
            start - Duration::from_secs(5),
        ];
        for (body, since) in bodies.iter_mut().zip(order) {
            let back = body.give_back.take().unwrap();
            back.pool.put_ready(back.connection, since);
        }
        let sinces: Vec<Instant> = pool
            .shared
            .lock()
            .connections
            .iter()
            .map(|c| c.since)
            .collect();
        assert_eq!(sinces, [order[2], order[0], order[1]]);

        // One idle for the idle timeout already is closed, not kept.
        let mut streaming = pool.send(get("/stream")).await.unwrap().into_body();
        streaming.frame().await.unwrap().unwrap();
        let back = streaming.give_back.take().unwrap();
        back.pool.put_ready(back.connection, start - idle);
        assert_eq!(pool.idle_count(), 2, "the stale one was kept");
        drop(bodies);
    }

    /// A connection given back idle since before the oldest idle one is
    /// closed when its own idle time runs out: the reaper, asleep until the
    /// oldest one's, is woken for it.
    #[tokio::test]
    async fn a_connection_given_back_older_than_the_oldest_is_closed_on_its_own_time() {
        let (addr, seen) = upstream().await;
        let idle = Duration::from_millis(600);
        let pool = pool_for(addr, idle);
        let bodies = streams_begun(&pool, 2).await;
        // Both responses end (the first's sender went with the second's
        // stream), and both connections are taken back by hand.
        drop(seen.stream.lock().unwrap().take());
        let mut backs = Vec::new();
        for mut body in bodies {
            backs.push(body.give_back.take().unwrap());
            body.collect().await.unwrap();
        }
        let now = Instant::now();
        for (back, since) in backs.into_iter().zip([now, now - idle / 2]) {
            back.pool.put_ready(back.connection, since);
            // The reaper, started by the first, runs and sleeps until its
            // time before the second comes (this test's runtime has one
            // thread, which takes tasks in turn).
            tokio::task::yield_now().await;
        }
        assert_eq!(pool.idle_count(), 2);
        bounded(seen.closed_one.notified()).await;
        assert_eq!(
            pool.idle_count(),
            1,
            "the older one went with the newer, at the newer one's time"
        );
    }

    /// A connection idle for the idle timeout is not handed out even when
    /// the reaper that closes it is late (its thread busy): the upstream
    /// may be closing it at that moment.
    #[tokio::test]
    async fn a_connection_idle_past_the_idle_timeout_is_not_reused_if_the_reaper_is_late() {
        let (addr, seen) = upstream().await;
        let idle = Duration::from_millis(200);
        let pool = pool_for(addr, idle);
        let response = pool.send(get("/fixed")).await.unwrap();
        read_to_end(response).await;
        while pool.idle_count() == 0 {
            tokio::task::yield_now().await;
        }
        // This thread runs the reaper: blocked, it is late.
        std::thread::sleep(idle + Duration::from_millis(100));
        let response = pool.send(get("/fixed")).await.unwrap();
        read_to_end(response).await;
        assert_eq!(accepted(&seen), 2, "the stale connection was reused");
    }

    /// New connections take the preferred family's addresses in turn, each
    /// first in its turn, and the other family's after them, in order.
    #[test]
    fn new_connections_take_the_preferred_familys_addresses_in_turn() {
        let at = |text: &str| text.parse::<SocketAddr>().expect("an address");
        let (a, b, c, v6) = (
            at("10.0.0.1:80"),
            at("10.0.0.2:80"),
            at("10.0.0.3:80"),
            at("[::1]:80"),
        );
        let addresses = [a, v6, b, c];
        assert_eq!(in_turn(&addresses, 0), [a, b, c, v6]);
        assert_eq!(in_turn(&addresses, 1), [b, c, a, v6]);
        assert_eq!(in_turn(&addresses, 2), [c, a, b, v6]);
        assert_eq!(in_turn(&addresses, 3), [a, b, c, v6]);
        assert_eq!(in_turn(&[v6, a], 1), [v6, a]);
        assert_eq!(in_turn(&[], 5), []);
    }

    /// An idle connection the upstream closed before the gateway noticed:
    /// the request, never written, goes on a new connection.
    #[tokio::test]
    async fn a_request_a_reused_connection_never_sent_is_sent_on_a_new_one() {
        let (addr, seen) = upstream().await;
        let pool = pool_for(addr, Duration::from_secs(60));
        // A connection to an in-memory peer, used once, then left ready in
        // the pool; the peer then goes away. This thread runs the
        // connection's task only once the request below is queued on it.
        let (mut sender, task, mut far) = in_memory_connection().await;
        let (response, ()) =
            tokio::join!(sender.send_request(get("/fixed")), answer_as_peer(&mut far));
        let body = response.unwrap().into_body().collect().await.unwrap();
        assert_eq!(body.to_bytes(), "peer");
        sender.ready().await.unwrap();
        // No await from here on: the connection's task cannot run.
        drop(far);
        assert!(
            sender.is_ready(),
            "the connection has not yet seen its peer go"
        );
        idle_now(
            &pool,
            Connection {
                sender,
                task,
                peer: addr,
            },
        );

        let response = pool.send(get("/fixed")).await.unwrap();
        assert_eq!(read_to_end(response).await, "ok");
        assert_eq!(accepted(&seen), 1);
    }

    /// A reused connection the upstream closes after the request is
    /// written and before any answer (its keep-alive ended as the request
    /// went out): a bodiless GET goes again on a new connection, as nginx
    /// sends it; a POST does not, as it may have been acted on.
    #[tokio::test]
    async fn a_get_a_reused_connection_lost_after_writing_it_goes_again_and_a_post_does_not() {
        use tokio::io::AsyncReadExt as _;
        let (addr, seen) = upstream().await;
        let pool = pool_for(addr, Duration::from_secs(60));
        // A connection to an in-memory peer that answers once, then reads
        // the next request's head and hangs up.
        let lost_after_writing = |request: Request<RequestBody>| {
            let pool = &pool;
            async move {
                let (mut sender, task, mut far) = in_memory_connection().await;
                let (response, ()) =
                    tokio::join!(sender.send_request(get("/fixed")), answer_as_peer(&mut far));
                let body = response.unwrap().into_body().collect().await.unwrap();
                assert_eq!(body.to_bytes(), "peer");
                sender.ready().await.unwrap();
                idle_now(
                    pool,
                    Connection {
                        sender,
                        task,
                        peer: addr,
                    },
                );
                let hang_up = async move {
                    let mut head = Vec::new();
                    while !head.ends_with(b"\r\n\r\n") {
                        head.push(far.read_u8().await.unwrap());
                    }
                    drop(far);
                };
                let (sent, ()) = tokio::join!(pool.send(request), hang_up);
                sent
            }
        };
        let response = lost_after_writing(get("/fixed")).await.expect("sent again");
        assert_eq!(read_to_end(response).await, "ok");
        assert_eq!(accepted(&seen), 1);
        let post = Request::post("/fixed")
            .header(http::header::HOST, "upstream.test")
            .body(Empty::new().map_err(|never| match never {}).boxed())
            .unwrap();
        let failed = lost_after_writing(post).await;
        assert!(
            matches!(failed, Err(SendError::Request(..))),
            "{:?}",
            failed.map(|response| response.status())
        );
        assert_eq!(accepted(&seen), 1, "the POST was sent again");
    }

    /// The GET goes once more, on a new connection: not on another idle
    /// one, which may be as stale (an upstream restarted under several).
    /// And a peer that resets the connection with the request unread
    /// (closing with unread data sends RST, not FIN) loses it as surely.
    #[tokio::test]
    async fn a_lost_get_goes_again_once_on_a_new_connection_after_a_close_or_a_reset() {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        async fn read_head(far: &mut TcpStream) {
            let mut head = Vec::new();
            while !head.ends_with(b"\r\n\r\n") {
                head.push(far.read_u8().await.unwrap());
            }
        }
        let (addr, seen) = upstream().await;
        let pool = pool_for(addr, Duration::from_secs(60));
        // A TCP peer that answers once, then reads the next request's head
        // and resets (`reset`) or closes; whether it read that head.
        let peer = |reset: bool| async move {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let near = TcpStream::connect(listener.local_addr().unwrap())
                .await
                .unwrap();
            let (mut far, _) = listener.accept().await.unwrap();
            let (mut sender, connection) = http1::handshake(TokioIo::new(near)).await.unwrap();
            let task = tokio::spawn(connection).abort_handle();
            let answer = async {
                read_head(&mut far).await;
                far.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\npeer")
                    .await
                    .unwrap();
            };
            let (response, ()) = tokio::join!(sender.send_request(get("/fixed")), answer);
            let body = response.unwrap().into_body().collect().await.unwrap();
            assert_eq!(body.to_bytes(), "peer");
            sender.ready().await.unwrap();
            let read = Arc::new(AtomicBool::new(false));
            let told = read.clone();
            tokio::spawn(async move {
                read_head(&mut far).await;
                told.store(true, Ordering::SeqCst);
                if reset {
                    // Deprecated for lingers that block on drop; a zero
                    // one resets at once.
                    #[allow(deprecated)]
                    far.set_linger(Some(Duration::ZERO)).unwrap();
                }
                drop(far);
            });
            (
                Connection {
                    sender,
                    task,
                    peer: addr,
                },
                read,
            )
        };
        for reset in [false, true] {
            let (older, older_read) = peer(reset).await;
            let (newer, newer_read) = peer(reset).await;
            pool.shared.put_ready(older, Instant::now());
            pool.shared.put_ready(newer, Instant::now());
            let before = accepted(&seen);
            let response = pool.send(get("/fixed")).await.expect("sent again");
            assert_eq!(read_to_end(response).await, "ok");
            assert!(
                newer_read.load(Ordering::SeqCst),
                "the newest idle one first"
            );
            assert!(
                !older_read.load(Ordering::SeqCst),
                "sent again on another idle connection (reset: {reset})"
            );
            assert_eq!(accepted(&seen), before + 1, "on a new connection");
            // The older one is still there; let it go.
            while let Some(idle) = pool.shared.checkout() {
                idle.task.abort();
            }
        }
    }

    /// A connection given back before it is ready for another request
    /// (its exchange still under way) joins the pool once it is.
    #[tokio::test]
    async fn a_connection_given_back_busy_joins_the_pool_when_ready() {
        let (addr, seen) = upstream().await;
        let pool = pool_for(addr, Duration::from_secs(60));
        let (mut sender, task, mut far) = in_memory_connection().await;
        let answer = sender.send_request(get("/fixed"));
        let (response, ()) = tokio::join!(
            async {
                // Given back while the request waits for its answer.
                tokio::task::yield_now().await;
                assert!(!sender.is_ready() && !sender.is_closed());
                pool.shared.put(
                    Connection {
                        sender,
                        task,
                        peer: addr,
                    },
                    None,
                    Instant::now(),
                );
                assert_eq!(pool.idle_count(), 0);
                answer.await
            },
            answer_as_peer(&mut far)
        );
        let body = response.unwrap().into_body().collect().await.unwrap();
        assert_eq!(body.to_bytes(), "peer");
        for _ in 0..1000 {
            if pool.idle_count() == 1 {
                break;
            }
            tokio::task::yield_now().await;
        }
        assert_eq!(pool.idle_count(), 1);
        // Reused: the in-memory peer answers, not the real upstream.
        let (again, ()) = tokio::join!(pool.send(get("/fixed")), answer_as_peer(&mut far));
        assert_eq!(read_to_end(again.unwrap()).await, "peer");
        assert_eq!(accepted(&seen), 0);
    }

    /// An upstream that takes connections and reads nothing from them, or
    /// (with `answer`) reads one request head and answers `200 ok` without
    /// reading the body; each accepted connection is sent on the channel.
    async fn deaf_upstream(answer: bool) -> (SocketAddr, mpsc::UnboundedReceiver<TcpStream>) {
        deaf_upstream_replying(answer.then_some(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"))
            .await
    }

    /// [`deaf_upstream`], answering `reply` (if any) to each request head.
    async fn deaf_upstream_replying(
        reply: Option<&'static [u8]>,
    ) -> (SocketAddr, mpsc::UnboundedReceiver<TcpStream>) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (accepted, connections) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                if let Some(reply) = reply {
                    let mut head = Vec::new();
                    while !head.ends_with(b"\r\n\r\n") {
                        head.push(stream.read_u8().await.unwrap());
                    }
                    stream.write_all(reply).await.unwrap();
                }
                let _ = accepted.send(stream);
            }
        });
        (addr, connections)
    }

    /// A POST whose body is what the test sends on the returned sender,
    /// 16 MiB of it already queued: more than loopback's buffers hold, so
    /// that a connection to an upstream that does not read stays busy.
    fn endless_post() -> (Request<RequestBody>, mpsc::UnboundedSender<Bytes>) {
        let (more, chunks) = mpsc::unbounded_channel();
        for _ in 0..256 {
            more.send(Bytes::from(vec![b'x'; 64 << 10])).unwrap();
        }
        let request = Request::post("/upload")
            .header(http::header::HOST, "upstream.test")
            .body(Chunks(chunks).map_err(|never| match never {}).boxed())
            .unwrap();
        (request, more)
    }

    /// Reads `stream` to its end: the gateway side closed it.
    async fn read_until_closed(mut stream: TcpStream) {
        use tokio::io::AsyncReadExt;
        let mut sink = vec![0; 64 << 10];
        while !matches!(stream.read(&mut sink).await, Ok(0) | Err(_)) {}
    }

    /// The response timeout runs out (or the client goes away) while the
    /// request body is still being written to an upstream that reads
    /// nothing: dropping the exchange closes its connection and frees its
    /// body, rather than leave hyper writing it for good.
    #[tokio::test]
    async fn an_exchange_abandoned_before_its_answer_closes_its_connection() {
        let (addr, mut connections) = deaf_upstream(false).await;
        let pool = pool_for(addr, Duration::from_secs(60));
        let (request, more) = endless_post();
        let sent = tokio::time::timeout(Duration::from_millis(300), pool.send(request)).await;
        assert!(sent.is_err(), "the deaf upstream answered");
        let connection = connections.recv().await.unwrap();
        bounded(more.closed()).await;
        bounded(read_until_closed(connection)).await;
        assert_eq!(pool.idle_count(), 0);
    }

    /// The upstream answers without taking the whole request body, and
    /// then takes no more of it: once the response has ended, the
    /// connection gets the idle timeout to finish sending, and is closed
    /// when it has not.
    #[tokio::test]
    async fn a_connection_still_sending_an_idle_timeout_after_its_answer_is_closed() {
        let (addr, mut connections) = deaf_upstream(true).await;
        let idle = Duration::from_millis(200);
        let pool = pool_for(addr, idle);
        let (request, more) = endless_post();
        let response = pool.send(request).await.unwrap();
        assert_eq!(read_to_end(response).await, "ok");
        let ended = Instant::now();
        let connection = connections.recv().await.unwrap();
        bounded(more.closed()).await;
        assert!(
            ended.elapsed() >= idle,
            "closed after {:?}",
            ended.elapsed()
        );
        bounded(read_until_closed(connection)).await;
        assert_eq!(pool.idle_count(), 0);
    }

    /// A connection still sending its request body after the response
    /// ended is in use: its request's turn (`--max-upstream-requests`) is
    /// held until the connection is closed, not given to the next request
    /// while the first still writes; so too after an answer with no body
    /// (a 413 with `content-length: 0`), which ends as it comes.
    #[tokio::test]
    async fn a_connection_still_sending_holds_its_requests_turn() {
        for (reply, body) in [
            (
                &b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"[..],
                &b"ok"[..],
            ),
            (
                b"HTTP/1.1 413 Payload Too Large\r\ncontent-length: 0\r\n\r\n",
                b"",
            ),
        ] {
            let (addr, mut connections) = deaf_upstream_replying(Some(reply)).await;
            let idle = Duration::from_millis(300);
            let pool = pool_for(addr, idle);
            let turns = crate::gateway::upstream_turns::UpstreamTurns::new(
                1,
                &crate::gateway::metrics::Metrics::default(),
            );
            let turn = turns.take(Duration::ZERO).await.expect("the one turn");
            let (request, more) = endless_post();
            let response = pool
                .send_telling(request, &Sending::default(), Some(turn))
                .await
                .unwrap();
            assert_eq!(read_to_end(response).await, body);
            let _connection = connections.recv().await.unwrap();
            assert!(
                turns.take(Duration::from_millis(50)).await.is_none(),
                "the turn was given while its connection still sent the request body"
            );
            // Closed at the idle timeout: the turn comes back.
            bounded(more.closed()).await;
            assert!(bounded(turns.take(Duration::from_secs(5))).await.is_some());
        }
    }

    /// A connection to an in-memory peer, its task spawned on this
    /// thread, and the peer's end, which [`answer_as_peer`] serves.
    async fn in_memory_connection() -> (
        SendRequest<RequestBody>,
        AbortHandle,
        tokio::io::DuplexStream,
    ) {
        let (near, far) = tokio::io::duplex(4096);
        let (sender, connection) = http1::handshake(TokioIo::new(near)).await.unwrap();
        let task = tokio::spawn(connection).abort_handle();
        (sender, task, far)
    }

    /// Reads one request head (the tests' requests have no body) and
    /// answers `200 peer`.
    async fn answer_as_peer(far: &mut tokio::io::DuplexStream) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut head = Vec::new();
        while !head.ends_with(b"\r\n\r\n") {
            head.push(far.read_u8().await.unwrap());
        }
        far.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\npeer")
            .await
            .unwrap();
    }

    async fn bounded<F: std::future::Future>(wait: F) -> F::Output {
        tokio::time::timeout(Duration::from_secs(10), wait)
            .await
            .expect("the upstream closed a connection within 10 s")
    }

    /// A response body the upstream sends faster than it is taken is read
    /// ahead until hyper's buffer holds `MAX_RESPONSE_HEAD_BYTES`: at most
    /// one read (of at most as much) more, 120 KiB. With hyper's default
    /// bound it read ahead 504 KiB, held until the client took it.
    #[tokio::test]
    async fn a_response_body_is_read_ahead_at_most_twice_64_kib() {
        const BODY: usize = 2 << 20;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let full = Arc::new(Notify::new());
        let filled = full.clone();
        tokio::spawn(async move {
            let (mut stream, _) = listener.accept().await.unwrap();
            let mut head = [0u8; 1024];
            let _ = stream.read(&mut head).await.unwrap();
            let mut response =
                format!("HTTP/1.1 200 OK\r\ncontent-length: {BODY}\r\n\r\n").into_bytes();
            response.resize(response.len() + BODY, b'x');
            let mut sent = 0;
            // Until the socket's buffers are full, then the rest.
            while sent < response.len() {
                match stream.try_write(&response[sent..]) {
                    Ok(n) => sent += n,
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                    Err(e) => panic!("{e}"),
                }
            }
            filled.notify_one();
            stream.write_all(&response[sent..]).await.unwrap();
        });
        let pool = pool_for(addr, Duration::from_secs(60));
        let mut body = pool.send(get("/large")).await.unwrap().into_body();
        bounded(full.notified()).await;
        let (mut total, mut largest) = (0, 0);
        while let Some(frame) = body.frame().await {
            let data = frame.unwrap().into_data().unwrap();
            total += data.len();
            largest = largest.max(data.len());
        }
        assert_eq!(total, BODY);
        assert!(
            largest < 2 * MAX_RESPONSE_HEAD_BYTES,
            "{largest} bytes read ahead"
        );
    }

    /// An address whose listen queue is full drops the connection
    /// attempt: it costs its share of the connect timeout, and the next
    /// address is tried within the rest.
    #[tokio::test]
    async fn an_address_that_never_answers_leaves_time_for_the_next() {
        let (live, _seen) = upstream().await;
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let full = socket.listen(0).unwrap();
        let silent = full.local_addr().unwrap();
        // A backlog of 0 holds one connection: once it is queued, the
        // kernel drops further attempts.
        let _filler = std::net::TcpStream::connect(silent).unwrap();
        let refused = {
            let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            listener.local_addr().unwrap()
        };
        let started = tokio::time::Instant::now();
        let deadline = started + Duration::from_secs(9);
        let mut failed = Vec::new();
        let (stream, peer) = connect_to_any(&[silent, refused, live], deadline, &mut failed)
            .await
            .expect("the live address takes the connection");
        let failed: Vec<_> = failed.iter().map(|(address, _)| *address).collect();
        assert_eq!(failed, [silent, refused], "the two before it failed");
        assert_eq!((stream.peer_addr().unwrap(), peer), (live, live));
        // The silent address was tried for its third of the time (3 s),
        // not for all of it (9 s): the two other attempts take
        // microseconds on loopback, which leaves 3 s of margin.
        let elapsed = started.elapsed();
        assert!(elapsed >= Duration::from_secs(3), "{elapsed:?}");
        assert!(elapsed < Duration::from_secs(6), "{elapsed:?}");

        let failed = connect_to_any(&[refused], deadline, &mut Vec::new())
            .await
            .unwrap_err();
        let Some(SendError::Connect(e)) = failed else {
            panic!("refused: {failed:?}")
        };
        assert_eq!(e.kind(), std::io::ErrorKind::ConnectionRefused);
        let none = connect_to_any(&[], deadline, &mut Vec::new())
            .await
            .unwrap_err();
        assert!(none.unwrap().to_string().contains("resolves to no address"));
        let deadline = tokio::time::Instant::now() + Duration::from_millis(100);
        assert!(connect_to_any(&[silent], deadline, &mut Vec::new())
            .await
            .unwrap_err()
            .is_none());
        drop(full);
    }

    /// An address a new connection failed to reach is tried after the
    /// others for `UNREACHABLE_FOR`, then in its turn again; reached, it is
    /// at once.
    #[test]
    fn an_address_that_failed_is_tried_last_for_a_while() {
        let [a, b, c]: [SocketAddr; 3] =
            ["10.0.0.1:80", "10.0.0.2:80", "10.0.0.3:80"].map(|a| a.parse().unwrap());
        let unreachable = Unreachable::default();
        let start = Instant::now();
        assert_eq!(unreachable.tried_last(vec![a, b, c], start), [a, b, c]);
        unreachable.note(&[(a, "no connection".into())], Some(b), start);
        assert_eq!(unreachable.tried_last(vec![a, b, c], start), [b, c, a]);
        assert_eq!(unreachable.tried_last(vec![c, a, b], start), [c, b, a]);
        let later = start + UNREACHABLE_FOR;
        assert_eq!(unreachable.tried_last(vec![a, b, c], later), [a, b, c]);
        unreachable.note(&[(c, "refused".into())], Some(a), start);
        assert_eq!(unreachable.tried_last(vec![c, a, b], start), [a, b, c]);
        unreachable.note(&[], Some(c), start);
        assert_eq!(unreachable.tried_last(vec![c, a, b], start), [c, a, b]);
    }

    #[test]
    fn an_ipv6_literal_is_connected_to_without_its_brackets() {
        let pool = ConnectionPool::new(
            "[::1]",
            8000,
            Duration::ZERO,
            Duration::ZERO,
            1,
            Arc::default(),
        );
        assert_eq!(pool.shared.resolver.host(), "::1");
        let pool = ConnectionPool::new(
            "upstream.test",
            80,
            Duration::ZERO,
            Duration::ZERO,
            1,
            Arc::default(),
        );
        assert_eq!(pool.shared.resolver.host(), "upstream.test");
    }
}
