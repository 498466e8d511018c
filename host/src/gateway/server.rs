//! Where a request enters: the client listener, one task per connection on
//! one of the worker threads, HTTP/1.1 and HTTP/2 (h2c), and a graceful
//! drain on shutdown.

use std::future::Future;
use std::net::SocketAddr;
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::header::{Entry, HeaderName, HeaderValue};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Either, Empty};
use hyper::body::Incoming;
use hyper::Request;
use std::sync::Arc;

use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::{GracefulConnection, GracefulShutdown};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tower_layer::Layer;
use tower_service::Service;

use crate::gateway::access_log::{self, AccessLine};
use crate::gateway::activity::{ActiveBody, Activity};
use crate::gateway::body_memory::{ClientConnection, ConnectionWaits};
use crate::gateway::client_body::{BodyProgress, ClientBody, ConnectionWindow};
use crate::gateway::client_gone::{ClientGone, ClientSocket, CLIENT_GONE_STATUS};
use crate::gateway::config::{ConnectionLimits, MAX_HEADER_BYTES, MIN_HEADER_BYTES};
use crate::gateway::error_chain;
use crate::gateway::hop_by_hop::take_in_client_headers;
use crate::gateway::lingering_close::{self, has_unread, HandBack};
use crate::gateway::metrics::{Metrics, Outcome};
use crate::gateway::middleware::SnowgateLayer;
use crate::gateway::reclaim::{room_at_the_limit, OpenConnections};
use crate::gateway::responses;
use crate::gateway::send_timeout::SendTimeout;
use crate::gateway::stream_resets::MAX_CUT_SHORT;
use crate::gateway::transfer_coding;
use crate::gateway::upstream::Upstream;
use crate::gateway::workers::Workers;
use crate::log_throttle::LogThrottle;

const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");

/// How much of one HTTP/2 request body the gateway accepts before it has
/// passed any of it on (hyper's default).
const HTTP2_STREAM_WINDOW: u32 = 1 << 20;

/// How much of one HTTP/2 response body the gateway holds for its client
/// beyond what the connection has sent: hyper's default, 400 KiB, let a
/// client that opens streams and reads none of them hold that much for
/// each (a review saw 1,024 such streams hold 680 MiB). One read from the
/// upstream (`MAX_RESPONSE_HEAD_BYTES`).
const HTTP2_STREAM_SEND_BUFFER: usize = 64 << 10;

/// How much of all of one HTTP/2 connection's request bodies the gateway
/// accepts before it has passed any of it on: sixteen streams' windows.
/// With hyper's default, one stream's window, a single body waiting on its
/// upstream (a connection still being made, an upstream reading slowly)
/// held up every other stream of the connection, even those the gateway
/// answers itself; now that takes sixteen at once. It also bounds the
/// bodies waiting to be passed on that a connection can make the gateway
/// keep in memory; not those read whole for the plugin, which give their
/// window back as they come once they have room in the body memory (each
/// at most the body limit, all at most the body memory, and timed by the
/// body read timeout, see `ClientBody`). Streams waiting for that room do
/// not read yet: at most half of this window's worth of them wait at once
/// (`body_memory::MAX_WAITING_PER_CONNECTION`).
const HTTP2_CONNECTION_WINDOW: u32 = 16 * HTTP2_STREAM_WINDOW;

/// A request's metrics while hyper has not yet polled its future: dropped
/// unpolled, it counts the request as abandoned (if `counts`).
struct Unpolled {
    metrics: Arc<Metrics>,
    counts: bool,
}

impl Unpolled {
    /// The request's future runs: from here on the middleware counts it.
    fn polled(&mut self) -> &Metrics {
        self.counts = false;
        &self.metrics
    }
}

impl Drop for Unpolled {
    fn drop(&mut self) {
        if self.counts {
            self.metrics.request(Outcome::Abandoned);
        }
    }
}

/// When the server stops, and how long it lets in-flight requests finish.
pub struct Stop<B, C> {
    /// Resolves when the stop begins: no more connections are accepted.
    pub begins: B,
    /// The longest in-flight requests may then take to finish.
    pub grace: Duration,
    /// Resolves when the drain is to end at once (an operator's second
    /// stop signal), whatever is left of `grace`.
    pub cut_short: C,
}

/// Serves clients on `listener` through `layer` in front of `upstream` until
/// `stop` begins; then stops accepting and lets in-flight requests finish
/// for up to its grace period, or until it is cut short, whichever comes
/// first. Returns whether they all finished.
///
/// Connections are accepted here and dealt round-robin to `workers`
/// threads; each worker has its own upstream connection pool, so a request
/// runs start to end on one thread.
pub async fn serve(
    listener: TcpListener,
    layer: SnowgateLayer,
    upstream: Upstream,
    limits: ConnectionLimits,
    workers: Workers,
    stop: Stop<impl Future<Output = ()>, impl Future<Output = ()>>,
) -> bool {
    let Stop {
        begins: shutdown,
        grace,
        cut_short,
    } = stop;
    // Each worker's pool keeps idle upstream connections of its own: at
    // most its share of the clients the gateway takes, so that a load
    // moving between workers stays within the descriptors
    // `--max-connections` is given.
    let share = (limits.max_connections / workers.len()).max(1);
    let upstream = upstream.keeping_idle_at_most(share);
    let services: Vec<_> = (0..workers.len())
        .map(|_| layer.layer(upstream.with_own_pool()))
        .collect();
    let mut next_worker = 0usize;
    for worker in 0..workers.len() {
        workers.spawn(worker, keep_a_timer_armed(limits.header_read_timeout / 2));
    }
    // Within the bounds the configuration checks, for an embedder's too
    // (see `MAX_HEADER_BYTES`: what a header map holds).
    let header_bytes = limits
        .max_header_bytes
        .clamp(MIN_HEADER_BYTES, MAX_HEADER_BYTES);
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout)
        .max_buf_size(header_bytes);
    builder
        .http2()
        .timer(TokioTimer::new())
        .initial_stream_window_size(HTTP2_STREAM_WINDOW)
        .initial_connection_window_size(HTTP2_CONNECTION_WINDOW)
        .max_header_list_size(header_bytes as u32)
        .max_send_buf_size(HTTP2_STREAM_SEND_BUFFER)
        // Stated: hyper's default (200) is not the gateway's to keep, and
        // each stream may hold an upstream connection of its own.
        .max_concurrent_streams(limits.max_streams_per_connection);
    // `/metrics` shows the limit once the caller registered it
    // (`Metrics::gauge_connections`), before it serves the admin listener.
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    let graceful = GracefulShutdown::new();
    // Tells connections still waiting for their first byte to give up on
    // shutdown: they hold a graceful watcher, but no request.
    let (stopping_tx, stopping_rx) = tokio::sync::watch::channel(false);
    // Tells connections serving requests to close, when the gateway stops
    // (or this future is dropped): through the same signal as choosing one
    // to close at the limit (see `reclaim`).
    let open_connections = Arc::new(OpenConnections::new(limits.max_connections));
    // Set when the grace period ends with requests left, which are then
    // dropped: their access log lines say the gateway dropped them.
    let dropping = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let close_all = TellAllOnDrop(open_connections.clone());
    tokio::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    static FAILED: LogThrottle = LogThrottle::new();
                    pause_after_accept_error(&e, "accepting a connection failed", &FAILED).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        // At the connection limit, the longest idle connection is closed to
        // make room, and its slot is this client's at once (see `reclaim`);
        // while none is idle, this client waits here, and the next ones in
        // the kernel's backlog, until a connection ends or turns idle.
        let permit = match slots.clone().try_acquire_owned() {
            Ok(permit) => permit,
            Err(_no_slot) => {
                let metrics = layer.metrics();
                let max = limits.max_connections;
                let room = room_at_the_limit(&slots, &open_connections, || {
                    static AT_THE_LIMIT: LogThrottle = LogThrottle::new();
                    metrics.connection_reclaimed();
                    if let Some(held_back) = AT_THE_LIMIT.admit() {
                        tracing::warn!(
                            "{max} connections open, the limit (--max-connections): closed the \
                             one idle longest to make room for a new client {held_back}"
                        );
                    }
                });
                tokio::select! {
                    permit = room => match permit {
                        Some(permit) => permit,
                        None => break,
                    },
                    () = &mut shutdown => break,
                }
            }
        };
        let _ = stream.set_nodelay(true);
        // Taken off this thread's reactor, to be registered with the
        // worker's: otherwise every readiness event of the connection would
        // be a cross-thread wake-up from here.
        let stream = match stream.into_std() {
            Ok(stream) => stream,
            Err(e) => {
                tracing::warn!(%peer, error = %e, "handing a connection to a worker failed");
                continue;
            }
        };
        let worker = next_worker;
        next_worker = next_worker.wrapping_add(1);
        let service = services[worker % services.len()].clone();
        // For its path check, made before a request's body is read.
        let upstream = upstream.clone();
        let activity = Activity::default();
        let requests = activity.clone();
        // Its place among the connections one may be chosen from to close
        // at the limit.
        let place = open_connections.register(&activity, permit);
        let metrics = layer.metrics().clone();
        let connection_metrics = metrics.clone();
        let open = metrics.connection_opened();
        let forwarded_for = forwarded_for_value(peer);
        let dropping = dropping.clone();
        // How many of this connection's requests wait for room in the body
        // memory (see `body_memory::MAX_WAITING_PER_CONNECTION`).
        let waits = Arc::new(ConnectionWaits::default());
        // Its request bodies that may hold its HTTP/2 flow-control window
        // unread (see `ClientBody`).
        let window = Arc::new(ConnectionWindow::new(
            (HTTP2_CONNECTION_WINDOW / HTTP2_STREAM_WINDOW) as usize,
            waits.clone(),
        ));
        // Watched while one of its HTTP/1 requests waits for that room, or
        // for a turn to the upstream (`--max-upstream-requests`).
        // SAFETY: given below only to HTTP/1 requests, whose futures the
        // connection runs inside its own and drops with it.
        let socket = unsafe { ClientSocket::new(stream.as_raw_fd()) };
        // Set while the last HTTP/1 request answered was answered with its
        // body not all come (a 413 by its declared length): its client may
        // still be sending it when the connection closes (see
        // `lingering_close`).
        let left_unread = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let unread_at_close = left_unread.clone();
        let per_request = hyper::service::service_fn(move |mut request: Request<Incoming>| {
            let arrived = Instant::now();
            // In flight until hyper has taken its whole response body (or
            // dropped it).
            let in_flight = requests.begin(request.version());
            give_an_empty_path_its_slash(request.uri_mut());
            // Written when the response's headers are ready, or as 499
            // when hyper drops the request before (its client went away).
            let path = request.uri().path_and_query().map_or("", |p| p.as_str());
            let access = AccessLine::begin(peer, request.method(), path, arrived, &dropping);
            // hyper decodes only chunked, and takes `gzip, chunked` as
            // chunked: the rest of the coding would reach the upstream
            // unlabelled. Looked at before the header goes with the other
            // hop-by-hop ones.
            let refusal = transfer_coding::unsupported(request.headers())
                .map(|coding| not_implemented(&coding))
                .or_else(|| malformed_head(&request).map(bad_head))
                .or_else(|| upstream.path_problem(request.uri()).map(bad_path));
            if refusal.is_some() {
                metrics.request(Outcome::ClientError);
            }
            take_in_client_headers(request.headers_mut());
            append_forwarded_for(&mut request, &forwarded_for);
            // A body may pause at most the body read timeout (see
            // `ClientBody` for HTTP/2); how it ends travels with the
            // request, for whoever reads it.
            let http2 = request.version() >= http::Version::HTTP_2;
            let progress = Arc::new(BodyProgress::on_connection(ClientConnection {
                waits: waits.clone(),
                // HTTP/2 requests run on tasks of their own, which may
                // outlive the socket; and hyper sees their client go.
                socket: (!http2).then_some(socket),
            }));
            request.extensions_mut().insert(progress.clone());
            let pause = limits.body_read_timeout;
            // HTTP/1 answers its requests in turn: the last one answered
            // says whether its client may still be sending.
            let has_body = !http_body::Body::is_end_stream(request.body());
            let unread = (!http2).then(|| (progress.clone(), has_body, left_unread.clone()));
            let window = http2.then(|| window.clone());
            let request = request.map(|body| ClientBody::new(body, pause, window, progress));
            let is_head = request.method() == http::Method::HEAD;
            let http10 = request.version() == http::Version::HTTP_10;
            let mut service = service.clone();
            // hyper may drop this future without ever polling it (when the
            // client's end of stream came with the head): then the request
            // is counted as abandoned here, as the middleware counts it
            // once called. A refused one is counted already.
            let mut unpolled = Unpolled {
                metrics: metrics.clone(),
                counts: refusal.is_none(),
            };
            async move {
                let metrics = unpolled.polled();
                let mut response = match refusal {
                    Some(refusal) => refusal.map(Either::Left),
                    None => service.call(request).await?,
                };
                if let Some((progress, has_body, left_unread)) = unread {
                    let unread = has_body && !progress.complete();
                    left_unread.store(unread, std::sync::atomic::Ordering::Relaxed);
                }
                // An HTTP/1.0 client cannot take a chunked body: one of no
                // known length ends when the connection closes, which hyper
                // does while its head says `keep-alive` to a client that
                // asked for it (and pipelined requests behind are lost).
                // nginx says `close` there.
                if http10
                    && !is_head
                    && http_body::Body::size_hint(response.body())
                        .exact()
                        .is_none()
                    && !response
                        .headers()
                        .contains_key(http::header::CONTENT_LENGTH)
                {
                    response.headers_mut().insert(
                        http::header::CONNECTION,
                        http::HeaderValue::from_static("close"),
                    );
                    // hyper adds its `keep-alive` to a response it takes
                    // for HTTP/1.1 (the upstream's version), and closes on
                    // an HTTP/1.0 one without it.
                    *response.version_mut() = http::Version::HTTP_10;
                }
                let took = arrived.elapsed();
                // A request whose client went away gets no answer anyone
                // reads: not counted as one, and logged as nginx logs it.
                let gone = response.extensions().get::<ClientGone>().is_some();
                if !gone {
                    metrics.response(response.status(), took);
                }
                if let Some(access) = access {
                    let status = if gone {
                        CLIENT_GONE_STATUS
                    } else {
                        response.status().as_u16()
                    };
                    access.answered(status);
                }
                Ok::<_, std::convert::Infallible>(response.map(|body| {
                    // A HEAD answer has a GET's headers and no body. hyper
                    // drops the body for HTTP/1 clients but sends it over
                    // HTTP/2, where the client resets the stream; and the
                    // gateway's own answers (a 502, a 413) have bodies.
                    let body = if is_head {
                        Either::Right(Empty::<Bytes>::new())
                    } else {
                        Either::Left(body)
                    };
                    ActiveBody::new(body.map_err(BodyError), in_flight).boxed()
                }))
            }
        });
        let builder = builder.clone();
        let watcher = graceful.watcher();
        let first_byte_timeout = limits.header_read_timeout;
        // As long as hyper keeps an idle HTTP/1 connection.
        let idle_timeout = limits.header_read_timeout;
        let send_timeout = limits.send_timeout;
        let mut stopping = stopping_rx.clone();
        workers.spawn(worker, async move {
            let sent = has_unread(&stream);
            let stream = match tokio::net::TcpStream::from_std(stream) {
                Ok(stream) => stream,
                Err(e) => {
                    tracing::warn!(%peer, error = %e, "registering a connection with a worker failed");
                    return;
                }
            };
            let sent = sent
                || tokio::select! {
                    biased;
                    sent = client_sends(&stream, first_byte_timeout, &mut stopping) => sent,
                    () = place.told_to_close() => false,
                };
            if !sent {
                tracing::debug!(%peer, "closed a connection that sent nothing");
                return;
            }
            let stream = SendTimeout::new(stream, send_timeout, activity.socket_full())
                .counting_reads_in(activity.bytes_in());
            let (stream, returned) = HandBack::new(stream);
            let connection = builder
                .serve_connection(TokioIo::new(stream), per_request)
                .into_owned();
            // The watcher, while alive, holds the drain open; the stop
            // itself comes through `place` (see `serve_until_stopped`).
            let idle = activity.idle_for(idle_timeout);
            let idle_again = activity.idle_for(idle_timeout);
            let idle_after_stop = activity.unanswered_after_stop(STOP_IDLE);
            let stalled = async {
                tokio::select! {
                    () = activity.stalled_for(send_timeout) => {
                        let ms = send_timeout.as_millis();
                        tracing::debug!(%peer, "closed an HTTP/2 connection: its client took none of a response for {ms} ms (--send-timeout-ms)");
                    }
                    // Told GOAWAY at the first bound (below) and still
                    // opening streams to reset: it has not answered the
                    // GOAWAY's ping, so h2 takes them all.
                    () = activity.resets().far_too_many() => {
                        static DROPPED: LogThrottle = LogThrottle::new();
                        if let Some(held_back) = DROPPED.admit() {
                            tracing::warn!(%peer, "dropped an HTTP/2 connection: its client went on cutting requests short after it was told to close {held_back}");
                        }
                    }
                }
            };
            // Also closed, as at a stop, once its client has cut short
            // too many requests (see `stream_resets`).
            let told_to_close = async {
                tokio::select! {
                    () = place.told_to_close() => {}
                    () = activity.resets().too_many() => {
                        connection_metrics.connection_closed_for_resets();
                        static CUT_SHORT: LogThrottle = LogThrottle::new();
                        if let Some(held_back) = CUT_SHORT.admit() {
                            tracing::warn!(%peer, "closing an HTTP/2 connection: its client ended {MAX_CUT_SHORT} requests within a second of sending them, before their answers, as a rapid-reset attack does {held_back}");
                        }
                    }
                }
            };
            let idles = Idles {
                idle,
                idle_again,
                idle_after_stop,
                told_to_close,
            };
            let ended = serve_until_stopped(connection, stopping, idles, stalled);
            if let Err(e) = ended.await {
                // hyper's own words ("error writing a body to connection")
                // do not say why: its causes do (a send timeout, a reset).
                let why = error_chain::describe(&*e);
                tracing::debug!(%peer, error = %why, "client connection ended with an error");
                // A head hyper could not parse never reached the service:
                // counted and logged here, as nginx logs its 400s.
                if let Some(status) = access_log::answered_by_hyper(&*e) {
                    // The rest of the head, and what follows, may still come.
                    unread_at_close.store(true, std::sync::atomic::Ordering::Relaxed);
                    connection_metrics.request(Outcome::ClientError);
                    connection_metrics.response_status(status);
                    access_log::malformed(peer, status, &why);
                }
            }
            // A stop does not wait for a client still sending after its
            // answer, but the connection's slot does.
            drop(watcher);
            if let Ok(returned) = returned.await {
                // Also where hyper ended the connection after an answer:
                // a client that pipelined requests behind one that closes
                // it may still be sending them, and those hyper read ahead
                // are no longer in the socket to show it. (A client that
                // ended its side is read from once, and is gone.)
                let client_may_send = unread_at_close.load(std::sync::atomic::Ordering::Relaxed)
                    || returned.shut_down;
                let thrown = lingering_close::close(
                    returned.io.into_inner(),
                    client_may_send,
                    place.told_to_close(),
                )
                .await;
                if thrown > 0 {
                    tracing::debug!(%peer, thrown, "closed a connection after reading on what its client still sent");
                }
            }
            // Its slot under the connection limit, if it was not handed on.
            drop(place);
            drop(open);
        });
    }
    drop(listener);
    let _ = stopping_tx.send(true);
    drop(close_all);
    tracing::info!("shutting down: no new connections; waiting for in-flight requests");
    let drained = tokio::select! {
        () = graceful.shutdown() => {
            tracing::info!("all connections closed");
            true
        }
        why = async {
            tokio::select! {
                () = tokio::time::sleep(grace) => "after the grace period",
                () = cut_short => "when told to stop at once",
            }
        } => {
            dropping.store(true, std::sync::atomic::Ordering::Relaxed);
            // Those holding slots, and those chosen to close at the limit
            // that have handed theirs on.
            let open = limits.max_connections - slots.available_permits()
                + open_connections.closing();
            tracing::warn!(
                grace_secs = grace.as_secs(),
                "{open} connection(s) still open {why}, with requests still running or \
                 responses not yet taken by their clients: closing them"
            );
            false
        }
    };
    workers.stop();
    drained
}

/// How many connections the kernel holds for the gateway before it
/// accepts them (the listen backlog): nginx's default, 511, not the 128 of
/// `std`, whose overflow a burst of new clients at the connection limit
/// met as dropped connection attempts. Linux caps it at
/// `net.core.somaxconn` (4096 by default since 5.4).
const LISTEN_BACKLOG: u32 = 511;

/// A listener on `addr` for clients, with `LISTEN_BACKLOG`.
pub fn listen(addr: SocketAddr) -> std::io::Result<TcpListener> {
    let socket = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    // As `std` and tokio's own `bind` do: a restarted gateway can listen
    // again while the old one's connections linger in TIME_WAIT.
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(LISTEN_BACKLOG)
}

/// Whether the client sends its first byte within `timeout`, before
/// shutdown begins. hyper times a request head out only once it has begun:
/// a connection that sends nothing at all is closed by this.
async fn client_sends(
    stream: &tokio::net::TcpStream,
    timeout: Duration,
    stopping: &mut tokio::sync::watch::Receiver<bool>,
) -> bool {
    tokio::select! {
        biased;
        sent = sends_within(stream, timeout) => sent,
        _ = stopping.wait_for(|stopping| *stopping) => false,
    }
}

/// Whether the client sends its first byte within `timeout` (it is left
/// unread).
pub(crate) async fn sends_within(stream: &tokio::net::TcpStream, timeout: Duration) -> bool {
    let mut probe = [0u8; 1];
    let first = tokio::time::timeout(timeout, stream.peek(&mut probe)).await;
    matches!(first, Ok(Ok(n)) if n > 0)
}

/// After an error accepting a connection (out of file descriptors and the
/// like): log it, once a second at most for each listener (`throttle` is
/// its own: out of descriptors, every accept fails until one closes, and
/// one listener's failures must not hide the other's), and pause before
/// the next accept instead of spinning.
pub(crate) async fn pause_after_accept_error(
    error: &std::io::Error,
    what: &str,
    throttle: &LogThrottle,
) {
    if let Some(held_back) = throttle.admit() {
        tracing::warn!(error = %error, "{what} {held_back}");
    }
    tokio::time::sleep(Duration::from_millis(10)).await;
}

/// Drives `connection` to its end, and shuts it down gracefully (the
/// request in progress is answered, then the connection closes) once it
/// is told to close (the gateway stops, or it was chosen to close at the
/// connection limit), or once `idle` resolves (no request in flight for
/// the idle timeout). After an idle shutdown, a connection that has not
/// ended is dropped once `idle_again` resolves: requests its client
/// started as the shutdown began are answered first, but pings, window
/// updates or a trickle of bytes do not keep it; if the gateway begins to
/// stop meanwhile (`stopping` turns true or its sender is gone), once
/// `idle_after_stop` resolves. After being told to close, likewise once
/// `idle_after_stop` resolves. Whenever
/// `stalled` resolves (the client takes none of its responses), the
/// connection is dropped at once.
///
/// The connection is polled before the stop is looked at, every time, so a
/// request the client had already sent when shutdown began is read and
/// answered. hyper-util's `Watcher::watch` looks at the stop first, which
/// closes a connection accepted in that instant without reading it.
/// (One case still closes unanswered: a first read that holds only part of
/// what tells HTTP/1 from HTTP/2, such as a lone `P`; the client had not
/// yet sent a request line.)
async fn serve_until_stopped<C: GracefulConnection, I, J, K, L>(
    connection: C,
    mut stopping: tokio::sync::watch::Receiver<bool>,
    idles: Idles<I, J, K, L>,
    stalled: impl Future<Output = ()>,
) -> Result<(), C::Error>
where
    I: Future<Output = ()>,
    J: Future<Output = ()>,
    K: Future<Output = ()>,
    L: Future<Output = ()>,
{
    let Idles {
        idle,
        idle_again,
        idle_after_stop,
        told_to_close,
    } = idles;
    tokio::pin!(connection);
    tokio::pin!(stalled);
    // Told to close: the gateway stops, or the connection was chosen to
    // close at the connection limit; either way it ends at once if nothing
    // is in flight on it.
    let idle = tokio::select! {
        biased;
        done = connection.as_mut() => return done,
        () = stalled.as_mut() => return Ok(()),
        () = told_to_close => false,
        () = idle => true,
    };
    connection.as_mut().graceful_shutdown();
    if !idle {
        // Told to close (the gateway stops, or the connection was chosen at
        // the limit): an HTTP/2 client that does not answer the GOAWAY's
        // ping (a pooled client reads only while it has a request out)
        // would hold the drain for the whole grace period. Requests in
        // flight are answered; if the client has sent nothing since, the
        // connection is dropped once none has been in flight for
        // `STOP_IDLE` (see `unanswered_after_stop`); if it has (pings, a
        // stream opened after the GOAWAY), once none has been for another
        // idle timeout, as after an idle shutdown. Before, such a client
        // kept a connection chosen at the limit open for ever.
        return tokio::select! {
            biased;
            done = connection => done,
            () = stalled => Ok(()),
            () = idle_after_stop => Ok(()),
            () = idle_again => Ok(()),
        };
    }
    // HTTP/2 says GOAWAY and ends once the client acknowledges it and
    // every stream it started meanwhile is answered. A client that does
    // not acknowledge it is dropped once nothing has been in flight for
    // another timeout: what is left of a response then is at most a piece
    // or two (see `ActiveBody`) that the client has not read for that
    // long. If the gateway begins to stop meanwhile, a client that has
    // sent nothing since is dropped after `STOP_IDLE` instead.
    let stopped_and_idle = async {
        let _ = stopping.wait_for(|stopping| *stopping).await;
        idle_after_stop.await;
    };
    tokio::select! {
        biased;
        done = connection => done,
        () = stalled => Ok(()),
        () = idle_again => Ok(()),
        () = stopped_and_idle => Ok(()),
    }
}

/// How long a stopping gateway keeps an HTTP/2 connection with nothing in
/// flight: time for requests the client sent before it read the GOAWAY to
/// arrive (a round trip), not for a client that never acknowledges it.
const STOP_IDLE: Duration = Duration::from_secs(1);

/// What ends a connection other than its client (see
/// `serve_until_stopped`): the first three resolve once no request has
/// been in flight for a while (never for HTTP/1, which hyper closes
/// itself), the last when the gateway wants the connection closed.
struct Idles<I, J, K, L> {
    /// For the header read timeout: the connection is shut down gracefully.
    idle: I,
    /// For another such timeout after that: it is dropped.
    idle_again: J,
    /// For [`STOP_IDLE`] once the gateway is stopping: it is dropped.
    idle_after_stop: K,
    /// Resolves once the connection is told to close: the gateway stops,
    /// it was chosen to close at the connection limit (see
    /// [`reclaim`](crate::gateway::reclaim)), or its client cut too many
    /// requests short (see [`stream_resets`](crate::gateway::stream_resets)).
    told_to_close: L,
}

/// Tells every open connection to close when dropped (see
/// [`OpenConnections::tell_all_to_close`]).
struct TellAllOnDrop(Arc<OpenConnections>);

impl Drop for TellAllOnDrop {
    fn drop(&mut self) {
        self.0.tell_all_to_close();
    }
}

/// Keeps a timer pending on this worker that always fires before any
/// header-read timeout would.
///
/// hyper arms a header-read timer for every request, and tokio wakes a
/// worker's event loop through its eventfd (a syscall, and a spurious
/// wake-up later) whenever a timer is armed earlier than every timer it
/// already has, which, between requests, is none: so once per request.
/// With this timer always due sooner, arming a header timer never does.
async fn keep_a_timer_armed(period: Duration) {
    let period = period.max(Duration::from_millis(1));
    loop {
        tokio::time::sleep(period).await;
    }
}

/// A response body's error as one concrete type, so that connection
/// futures are `Send` without higher-ranked trait-object conversions.
#[derive(Debug)]
pub struct BodyError(pub crate::gateway::upstream::BoxError);

impl std::fmt::Display for BodyError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl std::error::Error for BodyError {}

/// The response body a connection writes.
pub type ResponseBody = BoxBody<Bytes, BodyError>;

/// The answer to a request sent with a transfer coding the gateway does
/// not decode.
fn not_implemented(coding: &str) -> http::Response<http_body_util::Full<Bytes>> {
    let message = format!(
        "the request has Transfer-Encoding {coding:?}; this gateway decodes only chunked, \
         applied once: send the body without another transfer coding"
    );
    responses::closing_error(
        http::StatusCode::NOT_IMPLEMENTED,
        "unsupported_transfer_encoding",
        &message,
    )
}

/// An absolute-form target without a path (`http://host?q=1`,
/// `http://host#f`) asks for `/` (RFC 9112 section 3.2.1): it is given its
/// `/`, so that the plugin, the upstream and the access log see `/?q=1`,
/// where they saw `?q=1`, and the upstream `/`, where it was sent an empty
/// target.
fn give_an_empty_path_its_slash(uri: &mut http::Uri) {
    // An empty one (`http://host#fragment`) reads as `/` but is written as
    // nothing, so `/` is written anew too. `*` (an HTTP/2 `OPTIONS *`,
    // which has a scheme) is no path either.
    let text = uri.path_and_query().map_or("", |p| p.as_str());
    if uri.scheme().is_none() || !(text.is_empty() || text == "/" || text.starts_with('?')) {
        return;
    }
    let rooted = format!("/{}", text.trim_start_matches('/'));
    let mut parts = uri.clone().into_parts();
    parts.path_and_query = http::uri::PathAndQuery::try_from(rooted).ok();
    if let Ok(rooted) = http::Uri::from_parts(parts) {
        *uri = rooted;
    }
}

/// What is wrong with a request's head that hyper lets through: in an
/// HTTP/1.1 one, a `Host` missing or repeated (RFC 9112 section 3.2
/// answers both with 400, as nginx does); in any version, a target in
/// authority form (`host:port`), which only CONNECT may use and which
/// would otherwise go on as `/`, or the target `*` (asterisk form) on a
/// method other than OPTIONS, the only one it serves (RFC 9112 section
/// 3.2.4): it went on to the upstream as it came; or no target at all.
fn malformed_head<B>(request: &Request<B>) -> Option<String> {
    if request.uri().path() == "*" && request.method() != http::Method::OPTIONS {
        return Some(format!(
            "the request target * (asterisk form) is only for OPTIONS, and this is a {}: send a \
             path",
            request.method()
        ));
    }
    // In any version: an HTTP/1.0 one would otherwise go on as `/`. (An
    // HTTP/2 request's target has a scheme beside its authority.)
    let uri = request.uri();
    // CONNECT in any case, as the middleware refuses it: 405, not this.
    let connect = request.method().as_str().eq_ignore_ascii_case("CONNECT");
    if !connect && uri.scheme().is_none() && uri.authority().is_some() {
        return Some(format!(
            "the request target {uri} is in authority form, which only CONNECT uses: send a path"
        ));
    }
    // An HTTP/2 request without `:path` (h2 lets one through that has no
    // `:authority` either, or whose pseudo fields it lost): it went
    // upstream as a request line without a target. (Its `path_and_query`
    // reads as `/`; only `path` tells it is empty.)
    if !connect && uri.path().is_empty() {
        return Some(
            "the request has no target: an HTTP/2 request needs a :path (RFC 9113 section \
             8.3.1)"
                .to_string(),
        );
    }
    if request.version() != http::Version::HTTP_11 {
        return None;
    }
    let hosts = request.headers().get_all(http::header::HOST).iter().count();
    if hosts != 1 {
        return Some(format!(
            "an HTTP/1.1 request needs exactly one Host header, and this one has {hosts}"
        ));
    }
    None
}

/// The answer to a request whose head [`malformed_head`] refuses.
fn bad_head(problem: String) -> http::Response<http_body_util::Full<Bytes>> {
    responses::closing_error(
        http::StatusCode::BAD_REQUEST,
        "invalid_request_head",
        &problem,
    )
}

/// The answer to a request whose path [`Upstream::path_problem`] refuses:
/// given before the body is read, so it costs no plugin call.
fn bad_path(problem: String) -> http::Response<http_body_util::Full<Bytes>> {
    responses::closing_error(http::StatusCode::BAD_REQUEST, "bad_path", &problem)
}

/// The client's address as `X-Forwarded-For` gets it, made once per
/// connection: an IPv4 client of a dual-stack listener as `127.0.0.1`, not
/// `::ffff:127.0.0.1`.
fn forwarded_for_value(peer: SocketAddr) -> HeaderValue {
    let address = peer.ip().to_canonical().to_string();
    // An address is digits, hex letters, dots and colons: always a value.
    HeaderValue::from_str(&address).unwrap_or_else(|_| HeaderValue::from_static("unknown"))
}

/// Adds the client's address (`peer`, from [`forwarded_for_value`]) to
/// `X-Forwarded-For`, as one line after the addresses of every line the
/// client sent (RFC 9110 section 5.3: they read as one comma-separated
/// list). A line that is not text is dropped.
fn append_forwarded_for<B>(request: &mut Request<B>, peer: &HeaderValue) {
    let mut entry = match request.headers_mut().entry(X_FORWARDED_FOR) {
        Entry::Vacant(entry) => {
            entry.insert(peer.clone());
            return;
        }
        Entry::Occupied(entry) => entry,
    };
    let mut value = Vec::new();
    for line in entry.iter() {
        if line.to_str().is_ok() {
            value.extend_from_slice(line.as_bytes());
            value.extend_from_slice(b", ");
        }
    }
    value.extend_from_slice(peer.as_bytes());
    if let Ok(value) = HeaderValue::from_bytes(&value) {
        entry.insert(value);
    }
}

#[cfg(test)]
mod tests {
    use std::convert::Infallible;

    use http_body_util::Full;
    use hyper::Response;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    /// The client's address goes after every line the client sent, in
    /// order, as one line; a line that is not text is dropped; without a
    /// line the address is the value.
    #[test]
    fn the_client_address_follows_every_text_line_of_x_forwarded_for() {
        let peer = forwarded_for_value("192.0.2.9:1".parse().expect("an address"));
        let mut request = Request::new(());
        append_forwarded_for(&mut request, &peer);
        assert_eq!(request.headers()[&X_FORWARDED_FOR], "192.0.2.9");
        let mut request = Request::new(());
        let headers = request.headers_mut();
        headers.append(
            X_FORWARDED_FOR,
            HeaderValue::from_static("10.0.0.1, 10.0.0.2"),
        );
        headers.append(
            X_FORWARDED_FOR,
            HeaderValue::from_bytes(b"10.0.0.\xff").unwrap(),
        );
        headers.append(X_FORWARDED_FOR, HeaderValue::from_static("10.0.0.3"));
        append_forwarded_for(&mut request, &peer);
        let lines: Vec<_> = request.headers().get_all(&X_FORWARDED_FOR).iter().collect();
        assert_eq!(lines, ["10.0.0.1, 10.0.0.2, 10.0.0.3, 192.0.2.9"]);
    }

    /// An IPv4 client of a dual-stack (`[::]`) listener is appended to
    /// `X-Forwarded-For` as the IPv4 address it is.
    #[test]
    fn an_ipv4_client_of_a_dual_stack_listener_is_forwarded_as_ipv4() {
        for (peer, expected) in [
            ("[::ffff:192.0.2.7]:5000", "192.0.2.7"),
            ("[2001:db8::1]:5000", "2001:db8::1"),
            ("192.0.2.8:5000", "192.0.2.8"),
        ] {
            let mut request = Request::new(());
            let value = forwarded_for_value(peer.parse().expect("an address"));
            append_forwarded_for(&mut request, &value);
            assert_eq!(request.headers()[&X_FORWARDED_FOR], expected, "{peer}");
        }
    }

    /// A request sent before its connection reaches a worker counts as sent
    /// even when shutdown has begun by then; a silent connection does not.
    #[tokio::test]
    async fn bytes_sent_before_the_worker_looks_count_even_after_the_stop() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("a listener");
        let address = listener.local_addr().expect("address");
        let mut talker = std::net::TcpStream::connect(address).expect("connecting");
        let (talking, _) = listener.accept().expect("accepting");
        let _silent = std::net::TcpStream::connect(address).expect("connecting");
        let (silent, _) = listener.accept().expect("accepting");
        std::io::Write::write_all(&mut talker, b"GET / HTTP/1.1\r\nhost: g\r\n\r\n")
            .expect("sending");
        // As the accept loop hands them over: non-blocking std streams.
        for stream in [&talking, &silent] {
            stream.set_nonblocking(true).expect("non-blocking");
        }
        // The request is in the socket once `peek` can see it (loopback:
        // at once; this loop only guards against a slow kernel).
        let started = std::time::Instant::now();
        while !has_unread(&talking) {
            assert!(
                started.elapsed() < Duration::from_secs(10),
                "the request never arrived"
            );
            std::thread::yield_now();
        }
        assert!(!has_unread(&silent));

        let (_stop, mut stopping) = tokio::sync::watch::channel(true);
        let silent = tokio::net::TcpStream::from_std(silent).expect("registering");
        assert!(
            !client_sends(&silent, Duration::from_secs(30), &mut stopping).await,
            "a silent connection is let go at the stop, without waiting"
        );
    }

    /// A client's connection on loopback, and the server's end of it.
    async fn connected() -> (tokio::net::TcpStream, tokio::net::TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("a listener");
        let client = tokio::net::TcpStream::connect(listener.local_addr().expect("address"))
            .await
            .expect("connecting");
        let (server, _) = listener.accept().await.expect("accepting");
        (client, server)
    }

    /// A connection told to close whose client never answers the GOAWAY
    /// but keeps it open (sending pings, or nothing it reads) ends once it
    /// has had nothing in flight for another idle timeout (`idle_again`):
    /// before, only its end, or the stop's `idle_after_stop` (which a
    /// client that sent anything after the GOAWAY never met), ended it,
    /// and a connection chosen at the connection limit could stay open for
    /// ever.
    #[tokio::test]
    async fn a_connection_told_to_close_ends_after_another_idle_timeout() {
        let (mut client, server) = connected().await;
        client
            .write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00")
            .await
            .expect("the preface");
        let (_stop, stopping) = tokio::sync::watch::channel(false);
        let service = hyper::service::service_fn(|_: Request<Incoming>| async move {
            Ok::<_, Infallible>(Response::new(Full::new(Bytes::new())))
        });
        let builder = auto::Builder::new(TokioExecutor::new());
        let connection = builder.serve_connection(TokioIo::new(server), service);
        let never = || std::future::pending();
        let idles = Idles {
            idle: never(),
            idle_again: std::future::ready(()),
            idle_after_stop: never(),
            told_to_close: std::future::ready(()),
        };
        let ended = tokio::time::timeout(
            Duration::from_secs(10),
            serve_until_stopped(connection, stopping, idles, never()),
        )
        .await;
        assert!(ended.is_ok(), "still open, its client never answering");
        drop(client);
    }

    /// A connection whose request is already in the socket when shutdown
    /// has begun is still answered, then closed.
    #[tokio::test]
    async fn a_request_sent_before_the_stop_is_answered() {
        let (mut client, server) = connected().await;
        client
            .write_all(b"GET /x HTTP/1.1\r\nhost: gateway\r\n\r\n")
            .await
            .expect("sending a request");
        // Shutdown began before the connection was first polled.
        let (_stop, stopping) = tokio::sync::watch::channel(true);
        let service = hyper::service::service_fn(|request: Request<Incoming>| async move {
            let path = request.uri().path().to_string();
            Ok::<_, Infallible>(Response::new(Full::new(Bytes::from(path))))
        });
        let builder = auto::Builder::new(TokioExecutor::new());
        let connection = builder.serve_connection(TokioIo::new(server), service);
        let never = || std::future::pending();
        let idles = Idles {
            idle: never(),
            idle_again: never(),
            idle_after_stop: never(),
            told_to_close: std::future::ready(()),
        };
        serve_until_stopped(connection, stopping, idles, never())
            .await
            .expect("the connection ends cleanly");

        // To the end: the server closed the connection after answering.
        let mut answer = Vec::new();
        client
            .read_to_end(&mut answer)
            .await
            .expect("reading the answer");
        let answer = String::from_utf8_lossy(&answer);
        assert!(answer.starts_with("HTTP/1.1 200 OK\r\n"), "{answer}");
        assert!(answer.ends_with("\r\n\r\n/x"), "{answer}");
    }
}
