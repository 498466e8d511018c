//! The admin listener: `/status`, `/reload`, `/healthz`, `/readyz`, `/metrics`.

use std::convert::Infallible;
use std::fmt::Write as _;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{header, Method, Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

use crate::engine::HostServices;
use crate::gateway::activity::Activity;
use crate::gateway::process_metrics;
use crate::gateway::reclaim::{room_at_the_limit, OpenConnections};
use crate::gateway::responses;
use crate::gateway::server::{pause_after_accept_error, sends_within};
use crate::gateway::slot::{NoReload, PluginSlot, Reloaded};
use crate::high_water_file::keeper::FileMarkStatus;
use crate::lease::LeaseStatus;
use crate::log_throttle::LogThrottle;
use crate::utc::{format_millis, millis_of};

/// What the admin endpoints read.
pub struct Admin {
    /// The serving plugin and reload state.
    pub slot: Arc<PluginSlot>,
    /// The clock and machine id.
    pub services: HostServices,
    /// Where requests go, for `/status`.
    pub upstream: String,
    /// The failure policy, for `/status`.
    pub failure_policy: &'static str,
    /// When set, every request must carry `Authorization: Bearer <token>`.
    pub token: Option<String>,
    /// The etcd lease of the machine id, when there is one.
    pub lease: Option<Arc<LeaseStatus>>,
    /// The high-water file of a fixed machine id, when there is one.
    pub high_water_file: Option<Arc<FileMarkStatus>>,
    /// Set once the gateway has been told to stop (it then drains).
    pub stopping: Arc<AtomicBool>,
    /// How long a connection may take to send its first byte, and then
    /// each request head (the gateway's `--header-read-timeout-ms`).
    pub header_read_timeout: Duration,
}

/// At most this many admin connections are served at once; more wait in
/// the kernel's backlog. Enough for scrapers and operators, few enough that
/// idle connections cannot use up the process's file descriptors.
pub const MAX_ADMIN_CONNECTIONS: usize = 64;

/// The most admin sockets open at once: the connections served, and those
/// told to close to make room for new ones (their slots handed on at once)
/// that have not closed yet, at most 32, as for client connections. On a
/// busy machine the tasks of those told to close may not have run yet: a
/// test's flood of idle admin connections saw 12 of them open past the 64
/// under CPU load.
pub const MAX_ADMIN_SOCKETS: usize =
    MAX_ADMIN_CONNECTIONS + crate::gateway::reclaim::closing_at_most(MAX_ADMIN_CONNECTIONS);

/// How long an admin connection may stay silent before its first byte (at
/// most the header read timeout).
pub const ADMIN_FIRST_BYTE_TIMEOUT: Duration = Duration::from_secs(1);

impl Admin {
    /// Whether a request that needs an id can get one now: the gateway is
    /// not stopping, holds a machine id (with a live lease, if leased), and
    /// the next id would be within the slot's confirmed high-water mark.
    fn readiness(&self) -> Result<(), String> {
        if self.stopping.load(Ordering::Acquire) {
            return Err("the gateway is stopping".to_string());
        }
        self.services.ids_may_leave_now()
    }

    /// Serves admin requests on `listener` until the task is dropped (see
    /// `serve_connections`).
    pub async fn serve(self: Arc<Self>, listener: TcpListener) {
        let timeout = self.header_read_timeout;
        let route = move |request: Request<Incoming>| {
            let admin = self.clone();
            async move { admin.route(request).await }
        };
        serve_connections(listener, timeout, true, route, std::future::pending()).await;
    }

    async fn route(&self, request: Request<Incoming>) -> Response<Full<Bytes>> {
        if let Some(problem) = self.web_page_problem(&request) {
            return responses::error(StatusCode::FORBIDDEN, "forbidden", &problem);
        }
        if !is_probe(&request) && !self.authorized(&request) {
            let mut response = responses::error(
                StatusCode::UNAUTHORIZED,
                "unauthorized",
                "this admin endpoint needs the header Authorization: Bearer <admin token>",
            );
            response.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                header::HeaderValue::from_static("Bearer"),
            );
            return response;
        }
        // HEAD is GET without the body, which hyper leaves out itself.
        let method = match request.method() {
            &Method::HEAD => &Method::GET,
            method => method,
        };
        match (method, request.uri().path()) {
            (&Method::GET, "/healthz") => text(StatusCode::OK, "text/plain", "ok\n".to_string()),
            // Ready while requests that need an id can get one: for a
            // readiness probe, so that no traffic comes while the machine
            // id is being leased, waited for, or was lost.
            (&Method::GET, "/readyz") => match self.readiness() {
                Ok(()) => text(StatusCode::OK, "text/plain", "ready\n".to_string()),
                Err(reason) => text(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "text/plain",
                    format!("not ready: {reason}\n"),
                ),
            },
            (&Method::GET, "/status") => text(
                StatusCode::OK,
                "application/json",
                self.status().to_string(),
            ),
            (&Method::GET, "/metrics") => {
                let mut body = self.slot.metrics().render(self.services.clock.issued());
                body.push_str(&self.plugin_metrics());
                body.push_str(&self.id_metrics());
                body.push_str(&process_metrics::render());
                if let Some(lease) = &self.lease {
                    body.push_str(&lease.render_metrics());
                }
                if let Some(file) = &self.high_water_file {
                    body.push_str(&file.render_metrics());
                }
                text(StatusCode::OK, "text/plain; version=0.0.4", body)
            }
            (&Method::POST, "/reload") => match self.slot.reload().await {
                Ok(Reloaded::Swapped(sha)) => {
                    let body = serde_json::json!({"result": "swapped", "sha256": sha});
                    text(StatusCode::OK, "application/json", body.to_string())
                }
                Ok(Reloaded::Unchanged) => {
                    let body = serde_json::json!({"result": "unchanged", "sha256": self.slot.current().info().sha256});
                    text(StatusCode::OK, "application/json", body.to_string())
                }
                Err(NoReload::Failed(error)) => responses::error(
                    StatusCode::UNPROCESSABLE_ENTITY,
                    "reload_failed",
                    &error.message,
                ),
                Err(NoReload::NotPossible(message)) => {
                    responses::error(StatusCode::CONFLICT, "reload_not_possible", &message)
                }
                Err(NoReload::Deferred(message)) => {
                    let mut response = responses::error(
                        StatusCode::SERVICE_UNAVAILABLE,
                        "reload_deferred",
                        &message,
                    );
                    // The host holds a machine id again within a lease
                    // renewal or a disk sync, seconds at most when healthy.
                    response
                        .headers_mut()
                        .insert(header::RETRY_AFTER, header::HeaderValue::from_static("5"));
                    response
                }
            },
            (_, path @ ("/healthz" | "/readyz" | "/status" | "/metrics" | "/reload")) => {
                let allow = if path == "/reload" {
                    "POST"
                } else {
                    "GET, HEAD"
                };
                let mut response = responses::error(
                    StatusCode::METHOD_NOT_ALLOWED,
                    "method_not_allowed",
                    &format!("{path} answers {allow} only"),
                );
                response
                    .headers_mut()
                    .insert(header::ALLOW, header::HeaderValue::from_static(allow));
                response
            }
            (_, path) => responses::error(
                StatusCode::NOT_FOUND,
                "not_found",
                &format!(
                    "no admin endpoint {path}; try /status, /reload, /healthz, /readyz or /metrics"
                ),
            ),
        }
    }

    /// Which build serves, since when, and whether the last reload failed,
    /// in Prometheus text format: what a fleet's dashboards need to see a
    /// replica left on an old build.
    fn plugin_metrics(&self) -> String {
        let plugin = self.slot.current();
        let info = plugin.info();
        let loaded = millis_of(info.loaded_at) as f64 / 1000.0;
        let failing = u8::from(self.slot.last_error().is_some());
        let deferred = u8::from(self.slot.deferred().is_some());
        format!(
            "# HELP snowgate_plugin_info The plugin serving now (always 1).\n\
             # TYPE snowgate_plugin_info gauge\n\
             snowgate_plugin_info{{name=\"{}\",version=\"{}\",sha256=\"{}\"}} 1\n\
             # HELP snowgate_plugin_loaded_timestamp_seconds When the plugin serving now was loaded.\n\
             # TYPE snowgate_plugin_loaded_timestamp_seconds gauge\n\
             snowgate_plugin_loaded_timestamp_seconds {loaded:.3}\n\
             # HELP snowgate_plugin_reload_failing 1 while the last reload failed (an older build serves).\n\
             # TYPE snowgate_plugin_reload_failing gauge\n\
             snowgate_plugin_reload_failing {failing}\n\
             # HELP snowgate_plugin_reload_deferred 1 while a new build in the plugin file waits for the host to hold a machine id (an older build serves).\n\
             # TYPE snowgate_plugin_reload_deferred gauge\n\
             snowgate_plugin_reload_deferred {deferred}\n",
            label_value(&info.name),
            label_value(&info.version),
            label_value(&info.sha256),
        )
    }

    /// Whether requests that need an id can get one, the machine id held,
    /// and the id clock's lead, in Prometheus text format: what alerts on
    /// an id outage (a gauge, where the counters of its causes move once
    /// and then stand still while it lasts) and on two replicas holding one
    /// machine id need.
    fn id_metrics(&self) -> String {
        let ready = u8::from(self.readiness().is_ok());
        let lead = self.services.clock.lead_over_latest_reading().as_secs_f64();
        let max_lead = crate::id_clock::MAX_LEAD.as_secs();
        let identity = &self.services.identity;
        let mut out = format!(
            "# HELP snowgate_ready 1 while /readyz answers ready: requests that need an id can get one now (a machine id held, its lease live, the next id within its confirmed high-water mark, the gateway not stopping); 0 otherwise, the reason in /readyz.\n\
             # TYPE snowgate_ready gauge\n\
             snowgate_ready {ready}\n\
             # HELP snowgate_id_clock_lead_seconds How far the id clock runs ahead of the highest wall clock reading yet: ids asked for faster than the layout makes them a millisecond (a wall clock stepped back adds nothing). Past {max_lead} s ids are refused (ids_unavailable, id_rate_exceeded).\n\
             # TYPE snowgate_id_clock_lead_seconds gauge\n\
             snowgate_id_clock_lead_seconds {lead:.3}\n\
             # HELP snowgate_machine_id_info The machine id this replica holds, and its layout (always 1; no series while it holds none): two replicas with one machine id and layout behind a router may repeat each other's ids.\n\
             # TYPE snowgate_machine_id_info gauge\n",
        );
        if let Ok(id) = identity.current() {
            let _ = writeln!(
                out,
                "snowgate_machine_id_info{{machine_id=\"{}\",layout=\"{}\"}} 1",
                id.value,
                identity.layout().name()
            );
        }
        out
    }

    /// Why `request` looks sent by a web page, which the admin endpoints
    /// do not answer, if it does (a probe never does: what it learns is no
    /// secret). A page open in a browser on the gateway's machine could
    /// otherwise `POST /reload` to a loopback listener without a token (a
    /// form, or `fetch` with `no-cors`, needs no preflight), and read
    /// `/status` through a name it points at 127.0.0.1 (DNS rebinding).
    /// Admin clients (curl, Prometheus, probes) send no `Origin`, and name
    /// the listener by its address.
    fn web_page_problem(&self, request: &Request<Incoming>) -> Option<String> {
        if is_probe(request) {
            return None;
        }
        if let Some(origin) = request.headers().get(header::ORIGIN) {
            return Some(format!(
                "this admin request carries an Origin header ({}), so a web page sent it: the \
                 admin endpoints answer no web page",
                String::from_utf8_lossy(&origin.as_bytes()[..origin.len().min(200)]).escape_debug()
            ));
        }
        // With a token a page cannot present it: the name it uses does not
        // matter then.
        if self.token.is_some() {
            return None;
        }
        // A Host that does not parse is no address either (only one that is
        // missing, from an HTTP/1.0 client, lets the request in).
        let host = match request.uri().authority() {
            Some(authority) => Some(authority.host().to_string()),
            None => request.headers().get(header::HOST).map(|value| {
                value
                    .to_str()
                    .ok()
                    .and_then(|text| text.parse::<http::uri::Authority>().ok())
                    .map_or_else(
                        || String::from_utf8_lossy(value.as_bytes()).into_owned(),
                        |authority| authority.host().to_string(),
                    )
            }),
        };
        match host {
            Some(host) if !names_this_machine(&host) => Some(format!(
                "this admin request names the host {:?}, not an IP address or localhost: \
                 without --admin-token the admin listener answers only requests to an address, \
                 as a name may be a web page's pointed at this machine (DNS rebinding); use \
                 http://127.0.0.1:PORT, or set --admin-token",
                host.chars().take(200).collect::<String>()
            )),
            _ => None,
        }
    }

    /// Whether the request carries the admin token (or none is needed).
    fn authorized(&self, request: &Request<Incoming>) -> bool {
        let Some(token) = self.token.as_deref() else {
            return true;
        };
        let presented = request
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(bearer_token)
            .unwrap_or("");
        constant_time_eq(presented.as_bytes(), token.as_bytes())
    }

    /// The `/status` document.
    pub fn status(&self) -> serde_json::Value {
        // The serving build first: a reload is counted before its swap
        // (see `PluginSlot::reload`), so the counts below include it.
        let plugin = self.slot.current();
        let info = plugin.info();
        let (succeeded, failed) = self.slot.metrics().reloads();
        let loaded_ms = millis_of(info.loaded_at);
        let identity = &self.services.identity;
        let (machine_id, machine_id_error) = match identity.current() {
            Ok(id) => (Some(id.value), None),
            Err(reason) => (None, Some(reason)),
        };
        serde_json::json!({
            "plugin": {
                "name": info.name,
                "version": info.version,
                "sha256": info.sha256,
                "loaded_at": format_millis(loaded_ms),
                "loaded_at_ms": loaded_ms,
                "compiled": info.compiled.name(),
                "source": self.slot.source().map_or("bundled".to_string(), |p| p.display().to_string()),
            },
            "reloads": { "succeeded": succeeded, "failed": failed },
            "last_reload_error": self.slot.last_error().map(|e| serde_json::json!({
                "message": e.message,
                "at": format_millis(millis_of(e.at)),
                "may_pass": e.may_pass,
            })),
            "deferred_reload": self.slot.deferred().map(|d| serde_json::json!({
                "sha256": d.sha256,
                "message": d.message,
                "since": format_millis(millis_of(d.since)),
            })),
            "machine_id": machine_id,
            "machine_id_error": machine_id_error,
            "id_layout": identity.layout().name(),
            "lease": self.lease.as_ref().map(|l| l.to_json()),
            "high_water_file": self.high_water_file.as_ref().map(|f| f.to_json()),
            "upstream": self.upstream,
            "failure_policy": self.failure_policy,
        })
    }
}

/// Serves admin connections on `listener`, each request answered by
/// `route`, until `until` resolves, then gives the listener back
/// (connections already accepted are served on; with `keep_alive` false,
/// each ends after one answer): at most [`MAX_ADMIN_CONNECTIONS`] at once,
/// each closed if it sends nothing within [`ADMIN_FIRST_BYTE_TIMEOUT`], or
/// not a whole request head within `header_read_timeout`. At the cap, a
/// new client gets the slot of the connection idle longest (no request
/// open on it for a second or more; see
/// [`reclaim`](crate::gateway::reclaim)), so that kept-alive or slow
/// connections cannot keep a probe out: `/healthz` and `/readyz` take no
/// token, and anyone who reaches the listener could otherwise hold every
/// slot, and time the kubelet's probes out.
pub(crate) async fn serve_connections<R, F>(
    listener: TcpListener,
    header_read_timeout: Duration,
    keep_alive: bool,
    route: R,
    until: impl Future<Output = ()>,
) -> TcpListener
where
    R: Fn(Request<Incoming>) -> F + Clone + Send + 'static,
    F: Future<Output = Response<Full<Bytes>>> + Send + 'static,
{
    let slots = Arc::new(Semaphore::new(MAX_ADMIN_CONNECTIONS));
    let open = Arc::new(OpenConnections::new(MAX_ADMIN_CONNECTIONS));
    let mut until = std::pin::pin!(until);
    loop {
        let accepted = tokio::select! {
            biased;
            () = &mut until => return listener,
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
        let permit = match slots.clone().try_acquire_owned() {
            Ok(permit) => permit,
            Err(_) => {
                let closed = || {
                    static AT_THE_LIMIT: LogThrottle = LogThrottle::new();
                    if let Some(held_back) = AT_THE_LIMIT.admit() {
                        tracing::warn!(
                            "{MAX_ADMIN_CONNECTIONS} admin connections open, the most: closed \
                             the one idle longest to make room for a new client {held_back}"
                        );
                    }
                };
                match room_at_the_limit(&slots, &open, closed).await {
                    Some(permit) => permit,
                    None => return listener, // never closed
                }
            }
        };
        let activity = Activity::default();
        let place = open.register(&activity, permit);
        let route = route.clone();
        tokio::spawn(async move {
            // The stream bound after the place, so dropped before it: the
            // slot is given back only once this connection's socket is
            // closed (or handed to a new client when it is chosen to
            // close, which drops it at once), and the cap counts open
            // sockets, not tasks.
            let place = place;
            let stream = stream;
            let serve = async {
                // A client that connects sends at once: a short wait for
                // the first byte, so that silent connections cannot hold
                // the admin listener's slots for a whole header timeout.
                let first_byte = header_read_timeout.min(ADMIN_FIRST_BYTE_TIMEOUT);
                if !sends_within(&stream, first_byte).await {
                    return;
                }
                let service = hyper::service::service_fn(move |request: Request<Incoming>| {
                    // Not idle, and not to be chosen, while it is open.
                    let open = activity.begin(request.version());
                    let answer = route(request);
                    async move {
                        let response = answer.await;
                        drop(open);
                        Ok::<_, Infallible>(response)
                    }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .timer(TokioTimer::new())
                    .header_read_timeout(header_read_timeout)
                    .keep_alive(keep_alive)
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            };
            tokio::select! {
                () = serve => {}
                () = place.told_to_close() => {}
            }
        });
    }
}

/// Whether `host` (a request's, without its port) is an IP address or
/// `localhost`, as an admin client names the listener.
fn names_this_machine(host: &str) -> bool {
    let literal = host.trim_start_matches('[').trim_end_matches(']');
    literal.parse::<std::net::IpAddr>().is_ok()
        || host.eq_ignore_ascii_case("localhost")
        || host.eq_ignore_ascii_case("localhost.")
}

/// Whether `request` is a health probe (`GET` or `HEAD` of `/healthz` or
/// `/readyz`), which needs no admin token: a Kubernetes probe reaches the
/// admin listener off loopback, where a token is required, and can carry
/// one only written out in the pod's spec, not from a Secret. What a probe
/// learns (up, ready, or why not) is no secret.
fn is_probe(request: &Request<Incoming>) -> bool {
    matches!(*request.method(), Method::GET | Method::HEAD)
        && matches!(request.uri().path(), "/healthz" | "/readyz")
}

/// Whether `presented` is `token`, compared in a time that depends on
/// `presented` alone: response time reveals neither how much of a guessed
/// token was right nor the token's length.
fn constant_time_eq(presented: &[u8], token: &[u8]) -> bool {
    // An empty token is refused at start; none matches it here either.
    if token.is_empty() {
        return false;
    }
    let mut differs = u8::from(presented.len() != token.len());
    for (i, byte) in presented.iter().enumerate() {
        differs |= byte ^ token[i % token.len()];
    }
    differs == 0
}

/// An answer of `body`, of `content_type`, with `status`.
pub(crate) fn text(
    status: StatusCode,
    content_type: &'static str,
    body: String,
) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static(content_type),
    );
    response
}

/// `value` as a Prometheus label value: backslash, double quote and line
/// feed escaped (a plugin names itself, so its name is not trusted).
fn label_value(value: &str) -> String {
    let mut escaped = String::with_capacity(value.len());
    for c in value.chars() {
        match c {
            '\\' => escaped.push_str("\\\\"),
            '"' => escaped.push_str("\\\""),
            '\n' => escaped.push_str("\\n"),
            c => escaped.push(c),
        }
    }
    escaped
}

/// The token of an `Authorization: Bearer TOKEN` value; the scheme's name
/// matched ignoring case, as RFC 9110 section 11.1 has it.
fn bearer_token(value: &str) -> Option<&str> {
    let (scheme, token) = value.trim().split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then(|| token.trim_start_matches(' '))
}

#[cfg(test)]
mod tests {
    #[test]
    fn token_comparison_needs_every_byte() {
        assert!(super::constant_time_eq(b"abc", b"abc"));
        assert!(!super::constant_time_eq(b"abc", b"abd"));
        assert!(!super::constant_time_eq(b"abc", b"ab"));
        // Longer than the token, though its bytes repeat the token's.
        assert!(!super::constant_time_eq(b"abcabc", b"abc"));
        assert!(!super::constant_time_eq(b"", b"abc"));
        assert!(!super::constant_time_eq(b"", b""));
        assert!(!super::constant_time_eq(b"a", b""));
    }

    #[test]
    fn label_values_are_escaped() {
        use super::label_value;
        assert_eq!(label_value("snowgate-disagg-id"), "snowgate-disagg-id");
        assert_eq!(
            label_value("a\\b\"c\nd} 1\nfake 2"),
            "a\\\\b\\\"c\\nd} 1\\nfake 2"
        );
    }
}
