//! Where requests go after the middleware: a real upstream over a pool of
//! keep-alive connections (`upstream_pool`),
//! or the built-in echo upstream (`echo`).

use std::convert::Infallible;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use anyhow::Context as _;
use bytes::Bytes;
use http::header::{self, HeaderMap};
use http::uri::PathAndQuery;
use http::{Request, Response, StatusCode, Uri};
use http_body::Body;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};
use tower_service::Service;

use crate::gateway::body_limit::BodyTooLarge;
use crate::gateway::client_body::{BodyProgress, ClientFault};
use crate::gateway::client_gone;
use crate::gateway::client_gone::ClientGone;
use crate::gateway::config::UpstreamTimeouts;
use crate::gateway::config::{host_and_port_problem, without_credentials};
use crate::gateway::dot_segments;
use crate::gateway::echo;
use crate::gateway::error_chain;
use crate::gateway::hop_by_hop::{strip_hop_by_hop, strip_response_hop_by_hop};
use crate::gateway::metrics::{Metrics, UpstreamError};
use crate::gateway::responses;
use crate::gateway::transfer_coding;
use crate::gateway::upstream_pool::{
    ConnectionPool, PooledBody, SendError, Sending, Unreachable, MAX_RESPONSE_HEAD_BYTES,
};
use crate::gateway::upstream_read_timeout::UpstreamReadTimeout;
use crate::gateway::upstream_turns::UpstreamTurns;
use crate::log_throttle::LogThrottle;

/// Any error a body may carry (defined with the client's body).
pub use crate::gateway::client_body::BoxError;

/// A body on its way through the upstream: the request sent to it, or the
/// response streamed from it or made here.
pub type UpstreamBody = BoxBody<Bytes, BoxError>;

/// The service behind the middleware.
#[derive(Clone)]
pub enum Upstream {
    /// An HTTP server at a base URL.
    Http(Arc<HttpUpstream>),
    /// Answers every request with a JSON description of it, body included.
    Echo,
}

/// A real upstream: base URL and a keep-alive connection pool.
pub struct HttpUpstream {
    base: Uri,
    /// The `Host` header every request gets: the base URL's host, and its
    /// port unless it is 80. Made once, not for every request.
    host: header::HeaderValue,
    timeouts: UpstreamTimeouts,
    metrics: Arc<Metrics>,
    pool: ConnectionPool,
    /// How many idle connections each worker's pool keeps at most.
    max_idle: usize,
    /// The addresses new connections failed to reach lately, shared by
    /// every worker's pool.
    unreachable: Arc<Unreachable>,
    /// The bound on requests in flight, shared by every worker's pool.
    turns: Option<Arc<UpstreamTurns>>,
}

/// The base URL `url` of an upstream, checked for what the gateway can use
/// (`http://host:port[/prefix]`, no credentials, query or fragment), and the `Host`
/// header its requests get. Errors name the problem and the URL, its
/// credentials shown as `***`.
pub fn base_url(url: &str) -> anyhow::Result<(Uri, header::HeaderValue)> {
    let shown = without_credentials(url);
    let base: Uri = url
        .parse()
        .with_context(|| format!("--upstream {shown:?} is not a URL"))?;
    match base.scheme_str() {
        Some("http") => {}
        Some(other) => {
            anyhow::bail!("--upstream {shown:?}: scheme {other} is not supported; use http://")
        }
        None => anyhow::bail!("--upstream {shown:?} needs a scheme, e.g. http://{shown}"),
    }
    let Some(authority) = base.authority() else {
        anyhow::bail!("--upstream {shown:?} needs a host, e.g. http://127.0.0.1:8000");
    };
    anyhow::ensure!(
        !authority.as_str().contains('@'),
        "--upstream {shown:?}: credentials in the URL are not supported (they would not be sent)"
    );
    // A password with a `/` in it reads as host and port: then the port
    // is the password's end, not shown.
    if let Some(problem) = host_and_port_problem(authority, url, &shown) {
        anyhow::bail!("--upstream {shown:?}: {problem}, e.g. http://127.0.0.1:8000");
    }
    anyhow::ensure!(
        base.query().is_none(),
        "--upstream {shown:?}: a query is not supported; give the upstream's base URL"
    );
    // The URI parser ends the authority or path at a `#` and drops the
    // rest, which would leave a fragment's text silently unused.
    anyhow::ensure!(
        !url.contains('#'),
        "--upstream {shown:?}: a fragment (#...) is not supported; give the upstream's base URL"
    );
    let host = host_header(&base)
        .with_context(|| format!("--upstream {shown:?}: its host cannot be a Host header"))?;
    Ok((base, host))
}

impl Upstream {
    /// An upstream at `url` (`http://host:port[/prefix]`), waited on for at
    /// most `timeouts`; failures to reach it are counted in `metrics`.
    pub fn http(
        url: &str,
        timeouts: UpstreamTimeouts,
        metrics: Arc<Metrics>,
    ) -> anyhow::Result<Upstream> {
        let (base, host) = base_url(url)?;
        let unreachable = Arc::<Unreachable>::default();
        let pool = connection_pool(&base, timeouts, usize::MAX, &unreachable);
        Ok(Upstream::Http(Arc::new(HttpUpstream {
            base,
            host,
            timeouts,
            metrics,
            pool,
            max_idle: usize::MAX,
            unreachable,
            turns: None,
        })))
    }

    /// The same upstream with at most `max` requests in flight to it at
    /// once (`--max-upstream-requests`); more wait for a turn. The echo
    /// upstream is not bounded.
    pub fn bounded(self, max: usize) -> Upstream {
        match self {
            Upstream::Http(http) => {
                let turns = UpstreamTurns::new(max, &http.metrics);
                Upstream::Http(Arc::new(http.with_new_pool(Some(turns), http.max_idle)))
            }
            Upstream::Echo => Upstream::Echo,
        }
    }

    /// The same upstream keeping at most `max` idle connections in each
    /// pool [`Upstream::with_own_pool`] makes from it, closing the oldest
    /// past that: a worker's share of the clients the gateway takes, so
    /// that with each client's upstream connection in use the gateway needs
    /// three file descriptors a client at most. Each worker keeping all it
    /// had, a load that moved from one worker to another within the idle
    /// timeout left the first one's open beside the second one's new ones
    /// (a review ran a gateway out of descriptors below the cap the open
    /// file limit sets, and its clients got 502s).
    pub fn keeping_idle_at_most(self, max: usize) -> Upstream {
        match self {
            Upstream::Http(http) => {
                Upstream::Http(Arc::new(http.with_new_pool(http.turns.clone(), max)))
            }
            Upstream::Echo => Upstream::Echo,
        }
    }

    /// The same upstream with a connection pool of its own, for one worker
    /// thread: a pooled connection is driven by the thread that opened it,
    /// so sharing a pool between threads would hand requests across them.
    /// The bound on requests in flight, if any, is shared, and so are the
    /// addresses that could not be reached lately.
    pub fn with_own_pool(&self) -> Upstream {
        match self {
            Upstream::Http(http) => Upstream::Http(Arc::new(
                http.with_new_pool(http.turns.clone(), http.max_idle),
            )),
            Upstream::Echo => Upstream::Echo,
        }
    }

    /// Why a request for `uri` cannot be forwarded, if it cannot: its `..`
    /// segments climb above the base URL's path prefix. The gateway asks
    /// before it reads the body, so a refused request costs no plugin call
    /// and no ids; [`Service::call`] refuses it with 400 `bad_path` in any
    /// case.
    pub fn path_problem(&self, uri: &Uri) -> Option<String> {
        match self {
            Upstream::Http(http) => http.path_problem(uri),
            Upstream::Echo => None,
        }
    }

    /// A short description for logs and `/status`.
    pub fn describe(&self) -> String {
        match self {
            Upstream::Http(http) => http.base.to_string(),
            Upstream::Echo => "built-in echo".to_string(),
        }
    }
}

/// The `Host` header for requests to `base`, as hyper's client would make
/// it: the host, then `:port` unless the port is http's default.
fn host_header(base: &Uri) -> anyhow::Result<header::HeaderValue> {
    let host = base.host().context("no host")?;
    let value = match base.port_u16() {
        Some(port) if port != 80 => format!("{host}:{port}"),
        _ => host.to_string(),
    };
    Ok(header::HeaderValue::try_from(value)?)
}

/// An empty pool of connections to `base`'s host and port (80 when it
/// names none), opened within the connect timeout and closed when idle for
/// the idle timeout.
fn connection_pool(
    base: &Uri,
    timeouts: UpstreamTimeouts,
    max_idle: usize,
    unreachable: &Arc<Unreachable>,
) -> ConnectionPool {
    ConnectionPool::new(
        base.host().unwrap_or_default(),
        base.port_u16().unwrap_or(80),
        timeouts.connect,
        timeouts.idle,
        max_idle,
        unreachable.clone(),
    )
}

impl<B> Service<Request<B>> for Upstream
where
    B: Body<Data = Bytes> + Send + Sync + 'static,
    B::Error: Into<BoxError>,
{
    type Response = Response<UpstreamBody>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        // Boxed here, outside the futures, so they are not generic over B.
        let request = request.map(|body| body.map_err(Into::into).boxed());
        match self {
            Upstream::Http(http) => {
                let http = http.clone();
                Box::pin(async move { Ok(http.forward(request).await) })
            }
            Upstream::Echo => Box::pin(async move { Ok(echo::echo(request).await) }),
        }
    }
}

impl HttpUpstream {
    /// The same upstream with a new, empty connection pool keeping at most
    /// `max_idle` idle, and `turns`.
    fn with_new_pool(&self, turns: Option<Arc<UpstreamTurns>>, max_idle: usize) -> HttpUpstream {
        HttpUpstream {
            base: self.base.clone(),
            host: self.host.clone(),
            timeouts: self.timeouts,
            metrics: self.metrics.clone(),
            pool: connection_pool(&self.base, self.timeouts, max_idle, &self.unreachable),
            max_idle,
            unreachable: self.unreachable.clone(),
            turns,
        }
    }

    async fn forward(&self, request: Request<UpstreamBody>) -> Response<UpstreamBody> {
        let (mut parts, body) = request.into_parts();
        // Origin form: the connection is to the upstream itself.
        parts.uri = match self.target(&parts.uri) {
            Ok(path_and_query) => Uri::from(path_and_query),
            Err(e) => return own(responses::error(StatusCode::BAD_REQUEST, "bad_path", &e)),
        };
        strip_hop_by_hop(&mut parts.headers);
        one_content_length(&mut parts.headers);
        // Set by the server when the body came from a client: says whether
        // a failure is the client's.
        let progress = parts.extensions.get::<Arc<BodyProgress>>().cloned();
        // What is left of an HTTP/1 client's `TE` says whether it takes
        // trailers; hyper sends them to HTTP/2 clients in any case.
        let client_takes_trailers =
            parts.version >= http::Version::HTTP_2 || parts.headers.contains_key(header::TE);
        // Host names the upstream, as proxies usually do.
        parts.headers.insert(header::HOST, self.host.clone());
        if parts.version >= http::Version::HTTP_2 {
            crate::request::join_cookies(&mut parts.headers);
        }
        parts.version = http::Version::HTTP_11;
        // A body of unknown length goes on chunked. hyper's client does that
        // by itself except for GET, HEAD and CONNECT, whose bodies it would
        // drop without a `Transfer-Encoding` header saying so.
        if !body.is_end_stream() && body.size_hint().exact().is_none() {
            parts.headers.insert(
                header::TRANSFER_ENCODING,
                header::HeaderValue::from_static("chunked"),
            );
        }
        // A sender of `TE` lists it in `Connection` (RFC 9110 section 10.1.4).
        if parts.headers.contains_key(header::TE) {
            parts
                .headers
                .insert(header::CONNECTION, header::HeaderValue::from_static("te"));
        }
        // For the log, should the response be cut off.
        let path = parts.uri.path_and_query().cloned();
        let request = Request::from_parts(parts, body);
        // Held until the response body has ended or gone.
        let turn = match &self.turns {
            None => None,
            // An HTTP/1 client's socket is watched while the request
            // waits: a request whose body streams through has not had its
            // body read yet, so hyper would not see the client go, and the
            // request would keep its place until the wait ran out.
            Some(turns) => tokio::select! {
                // A free turn is taken without setting up the watch.
                biased;
                turn = turns.take(self.timeouts.connect) => match turn {
                    Some(turn) => Some(turn),
                    None => return self.busy(turns),
                },
                () = client_gone::gone(
                    progress.as_ref().and_then(|p| p.connection()).and_then(|c| c.socket),
                ) => {
                    return own(client_gone::answer(
                        "a turn to the upstream (--max-upstream-requests)",
                    ));
                }
            },
        };
        // Connecting and sending the request body count too: the timeout is
        // for the whole wait for a response head, not for the body after it.
        let sending = Sending::default();
        let answer = tokio::time::timeout(
            self.timeouts.response,
            self.pool.send_telling(request, &sending, turn),
        );
        // The address of the connection that failed, for the log.
        let mut address = None;
        let failure = match answer.await {
            Ok(Ok(response)) => match unusable(&response) {
                Some(why) => {
                    address = Some(response.body().address());
                    UpstreamFailure::Unusable(why)
                }
                None => return self.pass_on(response, client_takes_trailers, path),
            },
            Ok(Err(e)) => {
                address = e.address();
                // The request body is the client's: when reading it failed,
                // or it passed the body limit, the client is told, and the
                // upstream is not blamed.
                let too_large =
                    error_chain::causes(&e).find_map(|c| c.downcast_ref::<BodyTooLarge>());
                if let Some(too_large) = too_large {
                    return client_fault(ClientFault::TooLarge, &too_large.to_string());
                }
                if let Some(fault) = progress.as_ref().and_then(|p| p.fault()) {
                    // The innermost cause is the body's own error; the rest
                    // is the upstream client's wording around it.
                    let why = UpstreamFailure::innermost_cause(&e);
                    return client_fault(
                        fault,
                        &format!("the request body could not be read: {why}"),
                    );
                }
                UpstreamFailure::from_send_error(&e)
            }
            Err(_elapsed) if progress.as_ref().is_some_and(|p| p.waiting_on_client()) => {
                return client_fault(
                    ClientFault::Stalled,
                    &format!(
                        "the request body was still arriving when the upstream response timeout \
                         ran out ({} ms from the request, --upstream-response-timeout-ms)",
                        self.timeouts.response.as_millis()
                    ),
                );
            }
            // The response timeout is shorter than the connect timeout,
            // and ran out first: the request was never sent.
            Err(_elapsed) if sending.connecting() => UpstreamFailure::TooSlow(format!(
                "could not be connected to within {} ms of the request \
                     (--upstream-response-timeout-ms, which also bounds connecting; \
                     --upstream-connect-timeout-ms is {} ms)",
                self.timeouts.response.as_millis(),
                self.timeouts.connect.as_millis()
            )),
            Err(_elapsed) => {
                address = sending.peer();
                UpstreamFailure::TooSlow(format!(
                    "sent no response headers within {} ms of the request (--upstream-response-timeout-ms)",
                    self.timeouts.response.as_millis()
                ))
            }
        };
        self.metrics.upstream_error(failure.counted_as());
        // While the upstream is down every request fails alike: one
        // warning a second for each kind of failure, with a count of the
        // rest, not one per request (a soak test logged 10 MB a minute).
        static UNREACHABLE: LogThrottle = LogThrottle::new();
        static FAILED: LogThrottle = LogThrottle::new();
        static TOO_SLOW: LogThrottle = LogThrottle::new();
        // The upstream answered, with what the gateway cannot pass on: it
        // would answer the same request so again, and a non-streaming
        // completion answers only once it has generated it all.
        let fails_again = matches!(failure, UpstreamFailure::Unusable(_));
        let (status, code, problem, throttle) = match failure {
            UpstreamFailure::Unreachable(why) => (
                StatusCode::BAD_GATEWAY,
                "upstream_unreachable",
                why,
                &UNREACHABLE,
            ),
            UpstreamFailure::Failed(why) | UpstreamFailure::Unusable(why) => {
                (StatusCode::BAD_GATEWAY, "upstream_failed", why, &FAILED)
            }
            UpstreamFailure::TooSlow(why) => (
                StatusCode::GATEWAY_TIMEOUT,
                "upstream_timeout",
                why,
                &TOO_SLOW,
            ),
        };
        if let Some(held_back) = throttle.admit() {
            tracing::warn!(
                upstream = %self.base,
                address = %LoggedAddress(address),
                code,
                problem,
                "upstream request failed {held_back}"
            );
        }
        // The client learns why, not where: the upstream's address is the
        // operator's (it is in the warning above), as nginx's 502 page
        // names none.
        let message = format!("the upstream {problem}");
        let mut response = responses::error(status, code, &message);
        if fails_again {
            responses::would_fail_again(&mut response);
        }
        own(response)
    }

    /// The answer to a request that found no turn within the connect
    /// timeout: 503 `upstream_busy`, to be tried again.
    fn busy(&self, turns: &UpstreamTurns) -> Response<UpstreamBody> {
        self.metrics.upstream_busy();
        static BUSY: LogThrottle = LogThrottle::new();
        if let Some(held_back) = BUSY.admit() {
            tracing::warn!(
                upstream = %self.base,
                max = turns.max(),
                "a request found no turn for the upstream in time (--max-upstream-requests) {held_back}"
            );
        }
        let message = format!(
            "the upstream has {} requests in flight, as many as the gateway sends it at once \
             (--max-upstream-requests), and none ended within {} ms \
             (--upstream-connect-timeout-ms); try again",
            turns.max(),
            self.timeouts.connect.as_millis()
        );
        own(responses::retry_in_a_second(responses::error(
            StatusCode::SERVICE_UNAVAILABLE,
            "upstream_busy",
            &message,
        )))
    }

    /// The upstream's `response` as the client gets it, its body streamed
    /// as it arrives (server-sent events are not buffered) and timed by the
    /// upstream read timeout; `path` names it in the log, should it be cut
    /// off.
    fn pass_on(
        &self,
        response: Response<PooledBody>,
        client_takes_trailers: bool,
        path: Option<PathAndQuery>,
    ) -> Response<UpstreamBody> {
        let (mut parts, body) = response.into_parts();
        // hyper reads a response with both as chunked (RFC 9112 section 6.3);
        // 1.12 left the `Content-Length`, which would cut the chunked body
        // short on the way to the client (1.13 removes it; kept here as a
        // defence). A 204 has no body, so no length
        // (RFC 9110 section 8.6): hyper drops it for HTTP/1 clients but
        // would pass it to HTTP/2 ones.
        if parts.status == StatusCode::NO_CONTENT
            || parts.headers.contains_key(header::TRANSFER_ENCODING)
        {
            parts.headers.remove(header::CONTENT_LENGTH);
        }
        strip_response_hop_by_hop(&mut parts.headers);
        one_content_length(&mut parts.headers);
        // The gateway speaks its own HTTP version to the client (RFC 9110
        // section 6.2): an HTTP/1.0 upstream must not turn off keep-alive
        // and chunking for HTTP/1.1 clients.
        parts.version = http::Version::HTTP_11;
        // hyper drops trailers an HTTP/1 client did not ask for: do not
        // announce them either.
        if !client_takes_trailers {
            parts.headers.remove(header::TRAILER);
        }
        let address = body.address();
        let body = UpstreamReadTimeout::new(body, self.timeouts.read, self.metrics.clone())
            .naming(path, address);
        Response::from_parts(parts, body.boxed())
    }

    /// The base URL's path prefix, without a trailing `/`: empty when the
    /// base URL names no path.
    fn prefix(&self) -> &str {
        self.base.path().trim_end_matches('/')
    }

    /// See [`Upstream::path_problem`].
    fn path_problem(&self, uri: &Uri) -> Option<String> {
        let prefix = self.prefix();
        let path = uri.path();
        // `OPTIONS *` asks about the server and goes as it came.
        if prefix.is_empty() || path == "*" {
            return None;
        }
        // Joined as it came, a path without its `/` would leave the base
        // path: `x/../admin` under `/api` is `/apix/../admin`, `/admin`.
        // The `http` crate refuses such a path (since 1.4.1; h2 checks
        // only that `:path` is not empty), so this only stands behind it.
        // (An authority-form target, whose path is empty, is refused with
        // the head.)
        if !path.is_empty() && !path.starts_with('/') {
            return Some(unforwardable(path, &"it does not start with /"));
        }
        if !dot_segments::climbs_above_root(path) {
            return None;
        }
        Some(unforwardable(
            path,
            &format_args!("its `..` segments climb above the upstream's base path {prefix:?}"),
        ))
    }

    /// The path and query to ask the upstream for: the base URL's path
    /// prefix, then the request's own path and query.
    fn target(&self, uri: &Uri) -> Result<PathAndQuery, String> {
        let prefix = self.prefix();
        let path_and_query = match uri.path_and_query() {
            // Without a prefix, the request's own, shared rather than
            // written out and parsed again: this runs on every request.
            Some(own) if prefix.is_empty() => own.clone(),
            // `OPTIONS *` asks about the server, not a path under the
            // prefix: `*` goes as it came, not as `/prefix*`.
            Some(own) if own.as_str() == "*" => own.clone(),
            own => {
                if let Some(problem) = self.path_problem(uri) {
                    return Err(problem);
                }
                let own = own.map_or("/", |p| p.as_str());
                PathAndQuery::try_from(format!("{prefix}{own}"))
                    .map_err(|e| unforwardable(own, &e))?
            }
        };
        Ok(path_and_query)
    }
}

/// Why the request path `path` cannot be forwarded: `e`.
fn unforwardable(path: &str, e: &dyn fmt::Display) -> String {
    format!("the request path {path:?} cannot be forwarded: {e}")
}

/// The answer to a request whose body the client stalled, broke off or
/// went away from: 408 or 400, marked with the [`ClientFault`] for the
/// request counters, and, for a client gone, as [`ClientGone`]: nobody
/// reads it.
pub(crate) fn client_fault(fault: ClientFault, message: &str) -> Response<UpstreamBody> {
    tracing::debug!(?fault, message, "request body failed on the client's side");
    let (status, code) = fault.answer();
    let mut response = own(responses::error(status, code, message));
    response.extensions_mut().insert(fault);
    if fault == ClientFault::Gone {
        response.extensions_mut().insert(ClientGone);
    }
    response
}

/// The address (of those the upstream's name resolves to) a failure came
/// from, in the log: `none connected` where no connection was made.
pub(crate) struct LoggedAddress(pub(crate) Option<std::net::SocketAddr>);

impl std::fmt::Display for LoggedAddress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            Some(address) => write!(f, "{address}"),
            None => f.write_str("none connected"),
        }
    }
}

/// Why a request to the upstream got no response.
enum UpstreamFailure {
    /// No connection could be opened (502).
    Unreachable(String),
    /// The connection failed after the request was sent (502).
    Failed(String),
    /// The upstream answered with a response the gateway cannot pass on
    /// (502, `x-should-retry: false`).
    Unusable(String),
    /// A timeout ran out (504).
    TooSlow(String),
}

impl UpstreamFailure {
    /// How `/metrics` counts it.
    fn counted_as(&self) -> UpstreamError {
        match self {
            UpstreamFailure::Unreachable(_) => UpstreamError::Unreachable,
            UpstreamFailure::Failed(_) => UpstreamError::Failed,
            UpstreamFailure::Unusable(_) => UpstreamError::Unusable,
            UpstreamFailure::TooSlow(_) => UpstreamError::TimedOut,
        }
    }

    /// The last cause in `error`'s chain.
    fn innermost_cause(error: &SendError) -> String {
        let innermost = error_chain::causes(error).last();
        innermost.map_or_else(|| error.to_string(), ToString::to_string)
    }

    /// Sorts a failure to get a response, and words it with every cause in
    /// its chain (hyper's own text only says what failed, not why).
    fn from_send_error(error: &SendError) -> UpstreamFailure {
        match error {
            SendError::ConnectTimedOut(after) => UpstreamFailure::TooSlow(format!(
                "could not be connected to within {} ms (--upstream-connect-timeout-ms)",
                after.as_millis()
            )),
            // The kernel's own limit on connecting ran out first.
            SendError::Connect(e) if e.kind() == std::io::ErrorKind::TimedOut => {
                UpstreamFailure::TooSlow(format!("could not be connected to: {e}"))
            }
            SendError::Connect(e) => {
                UpstreamFailure::Unreachable(format!("could not be reached: {e}"))
            }
            SendError::Request(e, _) if e.is_parse_too_large() => {
                UpstreamFailure::Unusable(format!(
                    "answered with a response head over {} KiB or of more than 100 header \
                 fields, more than the gateway takes (its status line and headers; the body \
                 is not limited)",
                    MAX_RESPONSE_HEAD_BYTES >> 10
                ))
            }
            // A head hyper cannot read (a bad status line or header line,
            // an obsolete folded line, lengths that disagree) is the
            // upstream's answer, not a connection lost: it would answer so
            // again. Bytes left over from an earlier response cannot be
            // what was read: a connection with bytes past its response's
            // end is not reused.
            SendError::Request(e, _) if e.is_parse() => UpstreamFailure::Unusable(format!(
                "answered with a response head that is not valid HTTP/1.1: {}",
                error_chain::describe(e)
            )),
            SendError::Request(e, _) => UpstreamFailure::Failed(format!(
                "failed to answer the request: {}",
                error_chain::describe(e)
            )),
        }
    }
}

/// Why an upstream response cannot be passed on, if it cannot:
/// - a 101: the gateway forwards no `Upgrade` (it is hop-by-hop), so it
///   answers nothing that was asked, and passed on it would end the
///   client's connection (or, over HTTP/2, reset its stream);
/// - a transfer coding other than chunked: hyper takes the body of `gzip,
///   chunked` out of its chunks only, so it would reach the client as gzip
///   bytes with nothing saying so (nginx answers 502 too).
fn unusable<B>(response: &Response<B>) -> Option<String> {
    if response.status() == StatusCode::SWITCHING_PROTOCOLS {
        return Some(
            "answered 101 Switching Protocols to a request that asked for no upgrade".to_string(),
        );
    }
    let coding = transfer_coding::unsupported(response.headers())?;
    Some(format!(
        "answered with Transfer-Encoding {coding:?}; the gateway decodes only chunked, \
         applied once"
    ))
}

/// Makes a `Content-Length` sent more than once (`42, 42`, or in two
/// lines) one value. hyper takes such a length when its values agree, as
/// RFC 9110 section 8.6 lets a recipient do, but a sender must not pass
/// the list on: many clients refuse it (llhttp, h11, HTTP/2 stacks) or
/// read to the connection's end. hyper refuses a message whose values
/// disagree, except where it reads no length (a response to HEAD, a 204 or
/// a 304) and an HTTP/2 request (h2 reads the first field): there the
/// first value goes on, as hyper or h2 itself takes it. For the same
/// reason a length that is no number (`abc`, `-1`, `+5`), which only those
/// let through, is removed: an HTTP/2 client resets a stream that has one.
fn one_content_length(headers: &mut HeaderMap) {
    let mut values = headers.get_all(header::CONTENT_LENGTH).iter();
    let Some(first) = values.next() else {
        return;
    };
    let digits = |text: &[u8]| !text.is_empty() && text.iter().all(u8::is_ascii_digit);
    let length_of = |text: &[u8]| {
        let text = text.trim_ascii();
        digits(text)
            .then(|| std::str::from_utf8(text).ok()?.parse::<u64>().ok())
            .flatten()
    };
    // One plain number, the usual case: as it is.
    if values.next().is_none() && digits(first.as_bytes()) && length_of(first.as_bytes()).is_some()
    {
        return;
    }
    let length = first
        .as_bytes()
        .split(|&b| b == b',')
        .next()
        .and_then(length_of);
    match length {
        Some(length) => {
            headers.insert(header::CONTENT_LENGTH, length.into());
        }
        None => {
            headers.remove(header::CONTENT_LENGTH);
        }
    }
}

/// A response the gateway made, as an upstream's.
pub(crate) fn own(response: Response<Full<Bytes>>) -> Response<UpstreamBody> {
    response.map(|body| body.map_err(|never| match never {}).boxed())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_length_sent_more_than_once_goes_on_as_one() {
        let lengths = |values: &[&str]| {
            let mut headers = HeaderMap::new();
            headers.insert(header::CONTENT_TYPE, "text/plain".parse().unwrap());
            for value in values {
                headers.append(header::CONTENT_LENGTH, value.parse().unwrap());
            }
            one_content_length(&mut headers);
            assert!(headers.contains_key(header::CONTENT_TYPE));
            let left: Vec<_> = headers
                .get_all(header::CONTENT_LENGTH)
                .iter()
                .map(|v| v.to_str().unwrap().to_string())
                .collect();
            left
        };
        assert_eq!(lengths(&[]), Vec::<String>::new());
        assert_eq!(lengths(&["42"]), ["42"]);
        assert_eq!(lengths(&["42, 42"]), ["42"]);
        assert_eq!(lengths(&["42,42, 42"]), ["42"]);
        assert_eq!(lengths(&["42", "42"]), ["42"]);
        assert_eq!(lengths(&["x, y"]), Vec::<String>::new());
        // Only a response to HEAD, a 204 or a 304 brings these through
        // hyper: no number, no length.
        for bad in ["abc", "-1", "+5", "", "4 2"] {
            assert_eq!(lengths(&[bad]), Vec::<String>::new(), "{bad:?}");
        }
        assert_eq!(lengths(&[" 42 "]), ["42"]);
    }

    #[test]
    fn upstream_urls_that_cannot_work_are_refused_by_name() {
        let upstream = |url: &str| {
            let metrics = Arc::new(Metrics::default());
            Upstream::http(url, UpstreamTimeouts::default(), metrics).map(|u| u.describe())
        };
        for (url, named) in [
            ("https://127.0.0.1:8000", "scheme https is not supported"),
            ("127.0.0.1:8000", "needs a scheme"),
            ("http://127.0.0.1:99999", "port 99999 is not 1..=65535"),
            ("http://127.0.0.1:0", "port 0 is not 1..=65535"),
            (
                "http://user:pw@127.0.0.1:8000",
                "credentials in the URL are not supported",
            ),
            ("http://127.0.0.1:8000/v1?x=1", "a query is not supported"),
            (
                "http://127.0.0.1:8000/v1#v2",
                "a fragment (#...) is not supported",
            ),
            (
                "http://127.0.0.1:8000#v2",
                "a fragment (#...) is not supported",
            ),
        ] {
            let err = upstream(url).expect_err(url).to_string();
            assert!(err.contains(named), "{url}: {err}");
            assert!(!err.contains("pw@"), "{url}: the password shown: {err}");
        }
        for url in [
            "http://127.0.0.1:8000",
            "http://[::1]:8000/v1",
            "http://[::1]",
            "http://host",
        ] {
            assert!(upstream(url).is_ok(), "{url}");
        }
    }

    #[test]
    fn joins_the_base_prefix_and_the_request_path() {
        let Ok(Upstream::Http(http)) = Upstream::http(
            "http://127.0.0.1:9000/api/",
            Default::default(),
            Default::default(),
        ) else {
            panic!("a valid upstream URL")
        };
        let uri = http
            .target(&"/v1/completions?x=1".parse().unwrap())
            .unwrap();
        assert_eq!(uri.as_str(), "/api/v1/completions?x=1");
        // The asterisk form (`OPTIONS *`) names the server, not a path.
        let uri = http.target(&"*".parse().unwrap()).unwrap();
        assert_eq!(uri.as_str(), "*");
        // `..` that climbs above the request's root would leave the prefix.
        let refused = http.target(&"/v1/../../admin?x".parse().unwrap());
        let message = refused.expect_err("a path climbing out of the prefix");
        assert!(message.contains("\"/v1/../../admin\""), "{message}");
        assert!(message.contains("\"/api\""), "{message}");
    }

    /// Without a prefix the request's path and query go as they came, an
    /// absolute-form request's own scheme and host left out.
    #[test]
    fn the_request_path_goes_as_it_came_without_a_prefix() {
        for base in ["http://127.0.0.1:9000", "http://127.0.0.1:9000/"] {
            let Ok(Upstream::Http(http)) =
                Upstream::http(base, Default::default(), Default::default())
            else {
                panic!("a valid upstream URL")
            };
            for (request, forwarded) in [
                ("/v1/completions?x=1&y=%20", "/v1/completions?x=1&y=%20"),
                ("http://elsewhere.test/a//b?q", "/a//b?q"),
                ("http://elsewhere.test", "/"),
            ] {
                let uri = http.target(&request.parse().unwrap()).unwrap();
                assert_eq!(uri.as_str(), forwarded, "{base} {request}");
            }
        }
    }

    /// `Host` is the upstream's host, with its port unless that is 80.
    #[test]
    fn the_host_header_names_the_upstream_as_hypers_client_would() {
        for (base, host) in [
            ("http://127.0.0.1:9000/api/", "127.0.0.1:9000"),
            ("http://upstream.test", "upstream.test"),
            ("http://upstream.test:80/v1", "upstream.test"),
            ("http://[::1]:8000", "[::1]:8000"),
            ("http://[::1]", "[::1]"),
        ] {
            let value = host_header(&base.parse().unwrap()).unwrap();
            assert_eq!(value, host, "{base}");
        }
    }

    #[test]
    fn refuses_urls_it_cannot_use() {
        let http = |url| Upstream::http(url, Default::default(), Default::default());
        assert!(http("https://example.test").is_err_and(|e| e.to_string().contains("use http://")));
        assert!(http("127.0.0.1:8000").is_err());
    }
}
