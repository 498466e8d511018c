//! The snowgate middleware as a tower [`Layer`]: where the plugin sits in a
//! request path. `CONNECT` and `TRACE` get 405, and a declared length over
//! the limit 413. Bodies that could be JSON, and MessagePack bodies (any
//! `X-TRTLLM-Msgpack` header), are read (bounded), run through the serving
//! plugin, and forwarded, rewritten or answered; such a body under a
//! `Content-Encoding` gets 415, since neither the plugin nor the server
//! behind reads it. Everything else passes through untouched, its body
//! streamed.
//!
//! # Example
//! Adding snowgate in front of any tower service:
//! ```
//! use std::sync::Arc;
//! use bytes::Bytes;
//! use http_body_util::{BodyExt, Full};
//! use snowgate_host::gateway::middleware::ForwardBody;
//! use snowgate_host::gateway::{FailurePolicy, Metrics, PluginSlot, SnowgateLayer};
//! use snowgate_host::{HostServices, IdClock, MachineIdentity, PluginEngine, PluginLimits};
//! use snowgate_plugin::SnowflakeLayout;
//! use tower::{service_fn, Layer, ServiceExt};
//!
//! # #[tokio::main(flavor = "multi_thread")]
//! # async fn main() -> anyhow::Result<()> {
//! let services = HostServices {
//!     clock: Arc::new(IdClock::system()),
//!     identity: Arc::new(MachineIdentity::fixed(SnowflakeLayout::TrtllmV1, 3)?),
//! };
//! let engine = PluginEngine::new(services, PluginLimits::default())?;
//! let metrics = Arc::new(Metrics::default());
//! let slot = Arc::new(PluginSlot::load(engine, None, Vec::new(), metrics.clone())?);
//! let layer = SnowgateLayer::new(slot, metrics, FailurePolicy::FailClosed, 32 << 20);
//!
//! // Your service; here one that answers with the body it was given (in
//! // memory, or the original streaming through, cut off at the limit).
//! let app = service_fn(|request: http::Request<ForwardBody<Full<Bytes>>>| async move {
//!     let body = request.into_body().collect().await?.to_bytes();
//!     Ok::<_, Box<dyn std::error::Error + Send + Sync>>(http::Response::new(Full::new(body)))
//! });
//! let service = layer.layer(app);
//!
//! let request = http::Request::post("/v1/completions")
//!     .header("content-type", "application/json")
//!     .body(Full::new(Bytes::from_static(br#"{"disaggregated_params":{"request_type":"context_only"}}"#)))?;
//! let response = service.oneshot(request).await.map_err(|e| anyhow::anyhow!(e))?;
//! let body = response.into_body().collect().await.map_err(|e| anyhow::anyhow!(e))?.to_bytes();
//! assert!(std::str::from_utf8(&body)?.contains("\"disagg_request_id\":"));
//! # Ok(())
//! # }
//! ```

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{header, HeaderMap, HeaderName, Request, Response, StatusCode};
use http_body::Body;
use http_body_util::{Either, Full};
use tokio::sync::Semaphore;
use tower_layer::Layer;
use tower_service::Service;

use crate::bindings::exports::snowgate::middleware::handler::Action;
use crate::gateway::body_digests;
use crate::gateway::body_limit::{BodyTooLarge, Capped};
use crate::gateway::body_memory::{self, BodyMemory, NoRoom, Unreserved};
use crate::gateway::body_pace::{keeping_pace, pace_kib_per_sec, paced_length, TooSlow};
use crate::gateway::client_body::{BodyProgress, BoxError, ClientFault};
use crate::gateway::client_gone::{self, ClientGone};
use crate::gateway::config::{ConnectionLimits, FailurePolicy};
use crate::gateway::header_order::remove_in_order;
use crate::gateway::metrics::{Metrics, Outcome};
use crate::gateway::queued::Queued;
use crate::gateway::read_body::{read_limited_in, room_after_read, ReadBodyError, ReadProgress};
use crate::gateway::responses;
use crate::gateway::slot::PluginSlot;
use crate::log_throttle::LogThrottle;
use crate::request::Request as PluginRequest;
use crate::CallError;
use snowgate_plugin::MSGPACK_HEADER;

/// The header that has TensorRT-LLM decode a body as MessagePack, whatever
/// its content type says; made once, not parsed from text per request.
static MSGPACK: HeaderName = HeaderName::from_static(MSGPACK_HEADER);

/// The body type the inner service receives: the (possibly rewritten) body
/// in memory (its bytes hold their room in the layer's body memory until
/// the last reference to them is gone), or the original body streaming
/// through, cut off at the body limit.
pub type ForwardBody<B> = Either<Full<Bytes>, Capped<B>>;

/// The response body: the gateway's own answer, or the inner service's.
pub type AnswerBody<B> = Either<Full<Bytes>, B>;

/// Puts the serving plugin in front of a service.
#[derive(Clone)]
pub struct SnowgateLayer {
    shared: Arc<Shared>,
}

#[derive(Clone)]
struct Shared {
    slot: Arc<PluginSlot>,
    metrics: Arc<Metrics>,
    policy: FailurePolicy,
    max_body_bytes: usize,
    /// Room for the bodies read whole, each taken before it is read.
    body_memory: Arc<BodyMemory>,
    /// One permit per call the pool has room for next to kept instances
    /// and a reload ([`PluginLimits::concurrent_calls`](crate::PluginLimits::concurrent_calls)):
    /// a burst of requests queues here instead of failing with `Busy`.
    calls: Arc<Semaphore>,
    /// How many requests wait in that queue: the engine's count, which
    /// bounds the waits of the calls running meanwhile.
    queued: Arc<AtomicUsize>,
}

impl SnowgateLayer {
    /// A layer that runs `slot`'s plugin on JSON requests, refuses bodies
    /// over `max_body_bytes` with 413, and applies `policy` when the plugin
    /// fails. The bodies it reads whole hold at most
    /// [`body_memory::default_limit`] bytes at once (1 GiB, or
    /// `max_body_bytes` where that is larger), and a request waits at most
    /// the default body read timeout (60 s) for room, and as long for a
    /// plugin call slot: see
    /// [`SnowgateLayer::with_body_memory`].
    ///
    /// The plugin-call gauges of `metrics` report the first layer made
    /// with it: give each layer its own [`Metrics`].
    pub fn new(
        slot: Arc<PluginSlot>,
        metrics: Arc<Metrics>,
        policy: FailurePolicy,
        max_body_bytes: usize,
    ) -> Self {
        let plugin = slot.current();
        let slots = plugin.engine().limits().concurrent_calls() as usize;
        let queued = plugin.engine().queued_calls.clone();
        let calls = Arc::new(Semaphore::new(slots));
        metrics.gauge_plugin_calls(calls.clone(), slots, queued.clone());
        let body_memory = Arc::new(BodyMemory::new(
            body_memory::default_limit(max_body_bytes),
            ConnectionLimits::default().body_read_timeout,
        ));
        metrics.gauge_body_memory(body_memory.clone());
        SnowgateLayer {
            shared: Arc::new(Shared {
                slot,
                metrics,
                policy,
                max_body_bytes,
                body_memory,
                calls,
                queued,
            }),
        }
    }

    /// Bounds the memory the bodies this layer reads whole (for the
    /// plugin) hold at once, until each is sent upstream, at `limit`
    /// bytes; a request that finds no room waits for it, in the order
    /// requests came, at most `wait`, and is then answered 503
    /// `body_memory_full`; a body given room must arrive whole within
    /// `wait` too, or it is answered 408 `body_timeout`. A request whose
    /// body is read waits for a plugin call slot at most `wait` too, and
    /// is then answered 503 `plugin_busy`. Requests whose
    /// `BodyProgress` (an extension the server adds) names their
    /// [`ClientConnection`](body_memory::ClientConnection) (the gateway's
    /// server's do) wait at most
    /// [`body_memory::MAX_WAITING_PER_CONNECTION`] at a time per
    /// connection, and leave the line when their client is seen to go
    /// away. Fails when `limit` is below the largest body the layer
    /// takes, which could then never be read.
    pub fn with_body_memory(mut self, limit: usize, wait: Duration) -> anyhow::Result<Self> {
        let max_body_bytes = self.shared.max_body_bytes;
        anyhow::ensure!(
            limit >= max_body_bytes,
            "the body memory ({limit} bytes) must hold at least the largest body taken \
             ({max_body_bytes} bytes, --max-body-bytes), or such a body could never be read"
        );
        let memory = Arc::new(BodyMemory::new(limit, wait));
        self.shared.metrics.gauge_body_memory(memory.clone());
        Arc::make_mut(&mut self.shared).body_memory = memory;
        Ok(self)
    }

    /// The metrics the layer counts requests in.
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.shared.metrics
    }
}

impl<S> Layer<S> for SnowgateLayer {
    type Service = Snowgate<S>;

    fn layer(&self, inner: S) -> Snowgate<S> {
        Snowgate {
            inner,
            shared: self.shared.clone(),
        }
    }
}

/// The service [`SnowgateLayer`] makes.
#[derive(Clone)]
pub struct Snowgate<S> {
    inner: S,
    shared: Arc<Shared>,
}

impl<S, B, ResB: 'static> Service<Request<B>> for Snowgate<S>
where
    S: Service<Request<ForwardBody<B>>, Response = Response<ResB>> + Clone + Send + 'static,
    S::Future: Send,
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    type Response = Response<AnswerBody<ResB>>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        // The clone that was driven to readiness serves this call.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let shared = self.shared.clone();
        // Made here, not in `handle`: a server may drop the future without
        // ever polling it (hyper does when the client's end of stream came
        // with the head), and the request is still counted.
        let verdict = Verdict::new(shared.metrics.clone());
        Box::pin(shared.handle(inner, request, verdict))
    }
}

impl Shared {
    async fn handle<S, B, ResB>(
        self: Arc<Self>,
        mut inner: S,
        request: Request<B>,
        mut verdict: Verdict,
    ) -> Result<Response<AnswerBody<ResB>>, S::Error>
    where
        S: Service<Request<ForwardBody<B>>, Response = Response<ResB>>,
        B: Body<Data = Bytes>,
        B::Error: Into<BoxError>,
    {
        let own = |response: Response<Full<Bytes>>| Ok(response.map(Either::Left));
        // A reverse proxy for one upstream has no tunnels to open, and a
        // TRACE would echo the request's cookies and credentials back to
        // a script (cross-site tracing; nginx refuses it too). Refused
        // before any body is read or reaches the plugin. In any case:
        // methods are case-sensitive (RFC 9110 section 9.1), but an
        // upstream that reads them without case would take `trace` for
        // TRACE.
        let method = request.method().as_str();
        let refused = if method.eq_ignore_ascii_case("CONNECT") {
            Some("CONNECT is not supported: this gateway is a reverse proxy for one upstream")
        } else if method.eq_ignore_ascii_case("TRACE") {
            Some("TRACE is not forwarded: it would echo the request's credentials back")
        } else {
            None
        };
        // An answer to a request whose body is not read says that the
        // connection ends after it, as it does (RFC 9110 section 10.1.1): a
        // client that kept it (Python's `http.client`) failed its next
        // request on it.
        let answer = |has_body: bool| {
            if has_body {
                responses::closing_error
            } else {
                responses::error
            }
        };
        let has_body = !request.body().is_end_stream();
        if let Some(why) = refused {
            verdict.count(Outcome::ClientError);
            let mut response =
                answer(has_body)(StatusCode::METHOD_NOT_ALLOWED, "method_not_allowed", why);
            response.headers_mut().insert(
                header::ALLOW,
                header::HeaderValue::from_static("GET, HEAD, POST, PUT, PATCH, DELETE, OPTIONS"),
            );
            return own(response);
        }
        let declared = declared_length(request.headers());
        if declared.is_some_and(|len| len > self.max_body_bytes as u64) {
            verdict.count(Outcome::TooLarge);
            return own(self.too_large());
        }
        // Whether there is a body at all comes from the body, which hyper
        // framed from the headers before any were removed, not from the
        // framing headers (`Transfer-Encoding` is hop-by-hop and gone).
        let label = body_label(request.headers(), has_body);
        if label == BodyLabel::Other {
            // Counted when the answer comes, or when the client goes away
            // before it (the request is then dropped here).
            verdict.fallback = Outcome::PassedThrough;
            // A body without a declared length is cut off at the limit as
            // it streams through.
            // Told apart once the answer has come, in the body's progress
            // (which the server gives every request).
            let progress = request.extensions().get::<Arc<BodyProgress>>().cloned();
            let (method, target) = (request.method().clone(), request.uri().clone());
            let capped = request.map(|body| {
                Either::Right(
                    Capped::new(body, self.max_body_bytes).warning_when_cut_after_answer(
                        progress.clone(),
                        method,
                        target,
                    ),
                )
            });
            let response = inner.call(capped).await?;
            if let Some(progress) = progress {
                progress.answered();
            }
            // A body the client stalled, broke off or sent too much of is
            // the client's error. One it went away from partway went
            // upstream as far as it came: passed through, as a request
            // whose client goes away while it streams is counted, with no
            // response counted (the server sees the `ClientGone`).
            match response.extensions().get::<ClientFault>() {
                Some(ClientFault::TooLarge) => verdict.fallback = Outcome::TooLarge,
                Some(ClientFault::Gone) => {}
                Some(_) => verdict.fallback = Outcome::ClientError,
                // It went away while its request waited for a turn to the
                // upstream.
                None if response.extensions().get::<ClientGone>().is_some() => {
                    verdict.fallback = Outcome::Abandoned
                }
                None => {}
            }
            return Ok(response.map(Either::Right));
        }
        // Neither the plugin nor the server behind it (vLLM, TensorRT-LLM)
        // reads a compressed body: refuse it, rather than forward a body
        // that may hold a context-only request unstamped.
        if let Some(coding) = content_coding(request.headers()) {
            verdict.count(Outcome::ClientError);
            let message = format!(
                "the request body has Content-Encoding {coding:?}; this gateway stamps request ids \
                 into JSON bodies sent without a content coding: send the body uncompressed"
            );
            return own(answer(has_body)(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "unsupported_content_encoding",
                &message,
            ));
        }

        // How the client's body ends, when it came from a client.
        let progress = request.extensions().get::<Arc<BodyProgress>>().cloned();
        let (mut parts, body) = request.into_parts();
        // The body is forwarded whole from memory, without the client's
        // trailers: no `Trailer` header may promise them.
        remove_in_order(&mut parts.headers, &header::TRAILER);
        // Room for the body before any of it is read: its declared length
        // (never more than the limit, checked above), or, when it declares
        // none, `UNDECLARED_ROOM`, grown as it arrives where that is free
        // at once, and cut to what it holds and 64 KiB while others wait
        // (see `body_pace`); shrunk to the body once it is read. Nothing is
        // held while it waits.
        let declared = declared.map(|len| len as usize);
        let first_room = declared.unwrap_or(self.max_body_bytes.min(body_memory::UNDECLARED_ROOM));
        let reserved = self.body_memory.reserve(first_room, || {
            progress.as_ref().and_then(|p| p.connection())
        });
        let room = match reserved.await {
            Ok(room) => Mutex::new(room),
            Err(Unreserved::NoRoom(no_room)) => {
                verdict.count(Outcome::BodyMemoryFull);
                return own(body_memory_full(no_room));
            }
            // An answer nobody is meant to read (a client that only shut
            // down its sending side does): it ends the connection, and
            // the server counts it as no answer.
            Err(Unreserved::ClientGone) => {
                verdict.count(Outcome::Abandoned);
                return own(client_gone::answer("room in the gateway's body memory"));
            }
        };
        // Read whole, the body's waits are the client's, over HTTP/2 too.
        if let Some(progress) = &progress {
            progress.reading_whole();
        }
        // With room taken, the whole body must come within the wait for
        // room, and keep pace while others wait for room, or a client
        // could hold room by sending a byte now and then (see `body_pace`).
        let within = self.body_memory.wait();
        // Paced by its declared length, or, where it declared none, as if
        // it were `UNDECLARED_PACED_BYTES` long (at most its room).
        let paced = paced_length(declared, first_room);
        let read_progress = ReadProgress::default();
        // A body that is here already (most small ones) is read at once,
        // without arming a timer for it.
        let read = {
            let read = read_limited_in(
                body,
                self.max_body_bytes,
                declared,
                &self.body_memory,
                &room,
                &read_progress,
            );
            let mut read = std::pin::pin!(read);
            match std::future::poll_fn(|cx| Poll::Ready(read.as_mut().poll(cx))).await {
                Poll::Ready(read) => Ok(read),
                Poll::Pending => {
                    let memory = &self.body_memory;
                    let undeclared = declared.is_none().then_some(&room);
                    keeping_pace(read, &read_progress, paced, within, memory, undeclared).await
                }
            }
        };
        let mut room = room.into_inner().unwrap_or_else(|p| p.into_inner());
        let bytes = match read {
            Ok(Ok(bytes)) => bytes,
            Ok(Err(ReadBodyError::TooLarge)) => {
                verdict.count(Outcome::TooLarge);
                return own(self.too_large());
            }
            // The rest of the body is not read in the cases below: the
            // connection ends.
            Ok(Err(ReadBodyError::NoRoom(no_room))) => {
                verdict.count(Outcome::BodyMemoryFull);
                return own(body_memory_full(no_room));
            }
            Ok(Err(ReadBodyError::Failed(e))) => {
                // A body that did not come through the server's wrapper
                // can only have failed.
                let fault = progress
                    .and_then(|p| p.fault())
                    .unwrap_or(ClientFault::Broken);
                if fault == ClientFault::Gone {
                    verdict.count(Outcome::Abandoned);
                    return own(client_gone::answer_mid_body(&e));
                }
                verdict.count(Outcome::ClientError);
                let message = format!("the request body could not be read: {e}");
                let (status, code) = fault.answer();
                return own(responses::closing_error(status, code, &message));
            }
            Err(too_slow) => {
                verdict.count(Outcome::ClientError);
                let message = match too_slow {
                    TooSlow::TimedOut => format!(
                        "the request body did not arrive whole within {} ms of the room taken for \
                         it in the gateway's body memory (--body-read-timeout-ms); send it faster",
                        within.as_millis()
                    ),
                    TooSlow::BehindPace => match declared {
                        Some(length) => format!(
                            "the request body arrived slower than {} KiB/s, the pace that brings \
                             it whole within {} ms (--body-read-timeout-ms), while other requests \
                             waited for room in the gateway's body memory; send it faster",
                            pace_kib_per_sec(length, within),
                            within.as_millis()
                        ),
                        None => format!(
                            "the request body, of no declared length, arrived slower than {} \
                             KiB per {} ms (--body-read-timeout-ms) while other requests waited \
                             for room in the gateway's body memory; send it faster, or declare \
                             its length (Content-Length)",
                            paced.div_ceil(1024),
                            within.as_millis()
                        ),
                    },
                };
                let (status, code) = ClientFault::Stalled.answer();
                return own(responses::closing_error(status, code, &message));
            }
        };
        room.shrink_to(room_after_read(&bytes, &read_progress));
        let loosely_typed_and_not_json = label == BodyLabel::Loose && !could_be_json(&bytes);
        if bytes.is_empty() || loosely_typed_and_not_json {
            // Nothing to stamp: an empty body (e.g. a GET that declares a
            // JSON type), or an untyped or form-typed body that is not JSON.
            verdict.count(Outcome::PassedThrough);
            let body = Full::new(body_memory::hold(bytes, room));
            let response = inner
                .call(Request::from_parts(parts, Either::Left(body)))
                .await?;
            return Ok(response.map(Either::Right));
        }

        let plugin_request = PluginRequest {
            method: parts.method.as_str().to_string(),
            path: parts
                .uri
                .path_and_query()
                .map_or("/", |p| p.as_str())
                .to_string(),
            // Lent to the call, not copied: the plugin copies in only the
            // headers it asks for, and the map comes back below.
            headers: std::mem::take(&mut parts.headers).into(),
            // No copy when the body was read in several chunks (it is then
            // one unshared buffer); the original comes back out below.
            body: Vec::from(bytes),
        };
        // Wait for a free instance slot (never closed, so this cannot fail),
        // counted as queued while it waits, and for as long as a request
        // waits for room for its body: holding its body's room meanwhile.
        let permit = match self.calls.try_acquire() {
            Ok(permit) => Some(permit),
            Err(_) => {
                let _queued = Queued::join(&self.queued);
                let wait = self.body_memory.wait();
                match tokio::time::timeout(wait, self.calls.acquire()).await {
                    Ok(permit) => permit.ok(),
                    Err(_) => {
                        verdict.count(Outcome::PluginBusy);
                        return own(plugin_busy(wait, self.queued.load(Ordering::Relaxed)));
                    }
                }
            }
        };
        let plugin = self.slot.current();
        // Recorded when the call ends, or when its client goes away and
        // this request is dropped mid-call.
        let timer = self.metrics.time_plugin_call();
        // Runs on this worker thread; a call that runs long yields back at
        // every epoch tick (see `YIELD_AFTER`), so it holds up only this
        // request.
        let answer = plugin.answer_async(&plugin_request).await;
        // Not held while the upstream answers: a replaced build's instances
        // go back to the pool as soon as its calls end.
        drop(plugin);
        drop(permit);
        match &answer {
            Err(CallError::Busy(_)) => timer.did_not_run(),
            _ => drop(timer),
        }
        let PluginRequest { headers, body, .. } = plugin_request;
        parts.headers = headers.into_map();

        // The plugin's changes to the headers, made on a request it
        // forwards (an answer that rejects carries none), after the
        // client's digests of a body it changed are removed.
        let answer = answer.map(|answer| {
            if let Action::ForwardWithBody(new_body) = &answer.action {
                body_digests::forget_stale(&mut parts.headers, &body, new_body);
            }
            answer.header_edits.apply(&mut parts.headers);
            (answer.action, answer.ids_unavailable)
        });
        let forward_body = match answer {
            Ok((Action::Forward, _)) => {
                verdict.count(Outcome::Forwarded);
                Bytes::from(body)
            }
            Ok((Action::ForwardWithBody(new_body), _)) => {
                // The original is not sent: let it go now, not when the
                // response comes (for a completion that is not streamed,
                // when generation ends).
                drop(body);
                // The room follows the body sent: a smaller one gives some
                // back, a larger one takes more where it is free, and is
                // otherwise counted as overdrawn (the answer is in memory
                // already) up to its room; an answer larger still is
                // refused, and let go at once.
                if let Err(no_room) = self.body_memory.resize_for(&mut room, new_body.len()) {
                    drop(new_body);
                    verdict.count(Outcome::BodyMemoryFull);
                    return own(rewritten_body_too_large(no_room));
                }
                verdict.count(Outcome::Rewritten);
                parts.headers.remove(header::TRANSFER_ENCODING);
                parts.headers.insert(
                    header::CONTENT_LENGTH,
                    header::HeaderValue::from(new_body.len()),
                );
                Bytes::from(new_body)
            }
            Ok((Action::Reject(r), ids_unavailable)) => {
                verdict.count(if ids_unavailable {
                    Outcome::IdsUnavailable
                } else {
                    Outcome::Rejected
                });
                let status = StatusCode::from_u16(r.status).unwrap_or(StatusCode::BAD_REQUEST);
                return own(responses::error(status, &r.code, &r.message));
            }
            Err(failure) => {
                self.metrics.plugin_failure(&failure);
                match self.policy {
                    FailurePolicy::FailClosed => {
                        // Once a second for each kind of failure, so that
                        // one kind's flood does not hide another's.
                        static REFUSED: [LogThrottle; CallError::KINDS.len()] =
                            [const { LogThrottle::new() }; CallError::KINDS.len()];
                        if let Some(held_back) = REFUSED[failure.kind_index()].admit() {
                            tracing::warn!(
                                error = %failure,
                                "plugin failed; request refused (fail-closed) {held_back}"
                            );
                        }
                        verdict.count(Outcome::FailedClosed);
                        let message = format!(
                            "the plugin failed, so the request was not forwarded: {}",
                            failure.public_message()
                        );
                        let mut response = responses::error(
                            StatusCode::SERVICE_UNAVAILABLE,
                            "middleware_failed",
                            &message,
                        );
                        // OpenAI's client libraries retry a 503 twice
                        // unless told not to: the plugin would fail the
                        // same way each time.
                        if failure.fails_again() {
                            responses::would_fail_again(&mut response);
                        }
                        return own(response);
                    }
                    FailurePolicy::FailOpen => {
                        static FORWARDED: [LogThrottle; CallError::KINDS.len()] =
                            [const { LogThrottle::new() }; CallError::KINDS.len()];
                        if let Some(held_back) = FORWARDED[failure.kind_index()].admit() {
                            tracing::warn!(
                                error = %failure,
                                "plugin failed; request forwarded unchanged (fail-open) {held_back}"
                            );
                        }
                        verdict.count(Outcome::FailedOpen);
                        Bytes::from(body)
                    }
                }
            }
        };
        // The room goes with the body sent: the one read, or the plugin's
        // answer, which replaced it.
        let response = inner
            .call(Request::from_parts(
                parts,
                Either::Left(Full::new(body_memory::hold(forward_body, room))),
            ))
            .await?;
        Ok(response.map(Either::Right))
    }

    /// The answer to a body past the limit, declared or read: the rest of
    /// it is not read, so the connection ends.
    fn too_large(&self) -> Response<Full<Bytes>> {
        // Worded as when a streamed body passes the limit.
        let message = BodyTooLarge {
            limit: self.max_body_bytes as u64,
        };
        let (status, code) = ClientFault::TooLarge.answer();
        responses::closing_error(status, code, &message.to_string())
    }
}

/// The answer to a request that found no room for its body: refused before
/// all of its body is read, so its connection ends.
fn body_memory_full(no_room: NoRoom) -> Response<Full<Bytes>> {
    responses::retry_in_a_second(responses::closing_error(
        StatusCode::SERVICE_UNAVAILABLE,
        "body_memory_full",
        &no_room.to_string(),
    ))
}

/// The answer to a request whose rewritten body found no room: its body
/// was read whole, so its connection may serve on.
fn rewritten_body_too_large(no_room: NoRoom) -> Response<Full<Bytes>> {
    responses::retry_in_a_second(responses::error(
        StatusCode::SERVICE_UNAVAILABLE,
        "body_memory_full",
        &no_room.to_string(),
    ))
}

/// The answer to a request that waited `wait` for a plugin call slot, as
/// long as a request may wait for room for its body, and found none free
/// (`queued` requests wait for one, itself included): its body was read
/// whole, so its connection may serve on.
fn plugin_busy(wait: Duration, queued: usize) -> Response<Full<Bytes>> {
    let message = format!(
        "no plugin call slot came free within {} ms (--body-read-timeout-ms): every slot \
         (--plugin-instances) was running a call (requests waiting for one: {queued}); the plugin \
         is the bottleneck, try again",
        wait.as_millis()
    );
    responses::retry_in_a_second(responses::error(
        StatusCode::SERVICE_UNAVAILABLE,
        "plugin_busy",
        &message,
    ))
}

/// Counts one request once: with the outcome it is given as soon as its
/// fate is decided, or, when dropped before that, with `fallback`:
/// [`Outcome::Abandoned`] (its client went away, or the gateway dropped it
/// at the end of a shutdown's grace period) unless the request was sent
/// on as it came, which is counted when its answer comes or its client
/// goes.
struct Verdict {
    metrics: Arc<Metrics>,
    counted: bool,
    fallback: Outcome,
}

impl Verdict {
    fn new(metrics: Arc<Metrics>) -> Verdict {
        Verdict {
            metrics,
            counted: false,
            fallback: Outcome::Abandoned,
        }
    }

    fn count(&mut self, outcome: Outcome) {
        if !self.counted {
            self.metrics.request(outcome);
            self.counted = true;
        }
    }
}

impl Drop for Verdict {
    fn drop(&mut self) {
        if !self.counted {
            self.metrics.request(self.fallback);
        }
    }
}

/// The `Content-Length` the client declared, if it is a number.
fn declared_length(headers: &HeaderMap) -> Option<u64> {
    headers
        .get(header::CONTENT_LENGTH)?
        .to_str()
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// Whether a body without a JSON content type could be read as JSON by the
/// server behind the gateway, so that it must go to the plugin: its first
/// non-whitespace byte opens an object or an array (a request the plugin
/// could stamp is one or the other), or it is not UTF-8 to Python's
/// `json.loads`, which also reads a body that starts with a byte order mark
/// or has a zero byte among its first two (UTF-16 and UTF-32). The plugin
/// refuses those with a 400, rather than let one through unstamped.
fn could_be_json(body: &[u8]) -> bool {
    const BOMS: [&[u8]; 3] = [b"\xEF\xBB\xBF", b"\xFE\xFF", b"\xFF\xFE"];
    let opens_like_json = matches!(
        body.iter().find(|b| !b.is_ascii_whitespace()),
        Some(b'{' | b'[')
    );
    let other_encoding =
        BOMS.iter().any(|bom| body.starts_with(bom)) || body.iter().take(2).any(|&b| b == 0);
    opens_like_json || other_encoding
}

/// The body's content coding, when it has one other than `identity`
/// (`gzip`, `br`, ...), as the client wrote it.
fn content_coding(headers: &HeaderMap) -> Option<String> {
    let codings: Vec<String> = headers
        .get_all(header::CONTENT_ENCODING)
        .iter()
        .map(|value| String::from_utf8_lossy(value.as_bytes()).into_owned())
        .collect();
    let encoded = codings
        .iter()
        .flat_map(|value| value.split(','))
        .any(|coding| !coding.trim().is_empty() && !coding.trim().eq_ignore_ascii_case("identity"));
    encoded.then(|| codings.join(", "))
}

/// The body's media type: the `Content-Type` value before any parameters,
/// without the whitespace around it, to be compared ignoring ASCII case.
/// The header is read as Latin-1, as Python servers read header bytes, so
/// that a stray non-ASCII byte in a parameter does not hide
/// `application/json`, and the Latin-1 spaces `\x85` and `\xA0` are
/// whitespace too, as `str.strip` takes them in Rust and Python. Read in
/// place: it runs on every request.
fn media_type(headers: &HeaderMap) -> Option<&[u8]> {
    let value = headers.get(header::CONTENT_TYPE)?.as_bytes();
    let end = value.iter().position(|&b| b == b';').unwrap_or(value.len());
    let mime = &value[..end];
    let space = |b: &u8| matches!(b, b'\t'..=b'\r' | b' ' | 0x85 | 0xA0);
    let start = mime.iter().position(|b| !space(b)).unwrap_or(mime.len());
    let stop = mime
        .iter()
        .rposition(|b| !space(b))
        .map_or(start, |i| i + 1);
    Some(&mime[start..stop])
}

/// Whether a media type is JSON's (`application/json`, `…+json`).
fn is_json_media(mime: &[u8]) -> bool {
    const SUFFIX: &[u8] = b"+json";
    mime.eq_ignore_ascii_case(b"application/json")
        || (mime.len() >= SUFFIX.len()
            && mime[mime.len() - SUFFIX.len()..].eq_ignore_ascii_case(SUFFIX))
}

/// Whether the gateway runs the plugin on a request with `headers` and
/// the whole `body`, or streams it through: for a tool that shows a
/// plugin's answer (`snowgate rewrite`) and says when the gateway would
/// not ask it.
pub fn plugin_sees(headers: &HeaderMap, body: &[u8]) -> bool {
    match body_label(headers, !body.is_empty()) {
        BodyLabel::Json => true,
        BodyLabel::Loose => could_be_json(body),
        BodyLabel::Other => false,
    }
}

/// What a request's headers say its body is: read once per request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum BodyLabel {
    /// Declared JSON (`application/json`, `…+json`), or MessagePack
    /// (`X-TRTLLM-Msgpack`, which the bundled plugin stamps too): the
    /// plugin sees it.
    Json,
    /// No content type, an empty one (FastAPI parses both as JSON), or the
    /// form type `curl -d` sends by default: the plugin sees it if the body,
    /// once read, could be JSON.
    Loose,
    /// Any other type, or no body at all: it streams through.
    Other,
}

/// What the headers say the body is, for a request that `has_body`: an
/// unstamped context-only request must not slip through on a label.
fn body_label(headers: &HeaderMap, has_body: bool) -> BodyLabel {
    if !has_body {
        return BodyLabel::Other;
    }
    if headers.contains_key(&MSGPACK) {
        return BodyLabel::Json;
    }
    match media_type(headers) {
        None => BodyLabel::Loose,
        Some(mime) if is_json_media(mime) => BodyLabel::Json,
        Some(mime)
            if mime.is_empty()
                || mime.eq_ignore_ascii_case(b"application/x-www-form-urlencoded") =>
        {
            BodyLabel::Loose
        }
        Some(_) => BodyLabel::Other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        pairs
            .iter()
            .map(|(n, v)| {
                (
                    header::HeaderName::from_static(n),
                    header::HeaderValue::from_static(v),
                )
            })
            .collect()
    }

    #[test]
    fn an_untyped_body_goes_to_the_plugin_when_python_could_read_it_as_json() {
        assert!(could_be_json(b" \n{\"a\":1}"));
        assert!(could_be_json(b"[1]"));
        assert!(could_be_json(b"\xEF\xBB\xBF{}"), "UTF-8 with a BOM");
        assert!(could_be_json(b"\xFF\xFE{\x00}\x00"), "UTF-16 with a BOM");
        assert!(could_be_json(b"\x00{\x00}"), "UTF-16BE");
        assert!(could_be_json(b"{\x00}\x00"), "UTF-16LE");
        assert!(could_be_json(b"\x00\x00\x00{"), "UTF-32BE");
        assert!(!could_be_json(b"hello"));
        assert!(!could_be_json(b"a=1&b=%7B"));
        assert!(
            !could_be_json(b"h\x01\x00"),
            "a zero byte after the first two"
        );
        assert!(!could_be_json(b""));
    }

    /// What `media_type` was before it read the bytes in place: a String
    /// of the value read as Latin-1, cut, trimmed and lowered.
    fn media_type_as_text(headers: &HeaderMap) -> Option<String> {
        let value = headers.get(header::CONTENT_TYPE)?;
        let text: String = value.as_bytes().iter().map(|&b| char::from(b)).collect();
        Some(
            text.split(';')
                .next()
                .unwrap_or("")
                .trim()
                .to_ascii_lowercase(),
        )
    }

    /// Random content types, Latin-1 spaces and odd bytes among them, are
    /// sorted as the String-based reading sorted them.
    #[test]
    fn content_types_read_in_place_sort_as_read_as_text() {
        const PIECES: [&[u8]; 16] = [
            b"application/json",
            b"APPLICATION/Json",
            b"application/x-www-form-urlencoded",
            b"text/plain",
            b"+json",
            b"+JSON",
            b"json",
            b";",
            b" ",
            b"\t",
            b"\x85",
            b"\xA0",
            b"\x1C",
            b"\xFF",
            b"charset=utf-8",
            b"/",
        ];
        let mut seed = 0x2545_f491_4f6c_dd1d_u64;
        let mut next = |below: usize| {
            seed = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
            (seed >> 33) as usize % below
        };
        for _ in 0..20_000 {
            let value: Vec<u8> = (0..next(5))
                .flat_map(|_| PIECES[next(PIECES.len())].to_vec())
                .collect();
            let Ok(value) = header::HeaderValue::from_bytes(&value) else {
                continue;
            };
            let mut typed = HeaderMap::new();
            typed.insert(header::CONTENT_TYPE, value.clone());
            let text = media_type_as_text(&typed).expect("a content type");
            let was_json = text == "application/json" || text.ends_with("+json");
            let was_loose = text.is_empty() || text == "application/x-www-form-urlencoded";
            let expected = match (was_json, was_loose) {
                (true, _) => BodyLabel::Json,
                (false, true) => BodyLabel::Loose,
                (false, false) => BodyLabel::Other,
            };
            assert_eq!(body_label(&typed, true), expected, "{value:?}");
        }
    }

    #[test]
    fn json_content_types_go_through_the_plugin() {
        let label = |pairs| body_label(&headers(pairs), true);
        let json = |pairs| label(pairs) != BodyLabel::Other;
        assert_eq!(
            label(&[("content-type", "application/json")]),
            BodyLabel::Json
        );
        assert!(json(&[("content-type", "Application/JSON; charset=utf-8")]));
        assert_eq!(
            label(&[("content-type", "application/vnd.api+json")]),
            BodyLabel::Json
        );
        assert_eq!(
            label(&[]),
            BodyLabel::Loose,
            "an untyped body goes to the plugin"
        );
        assert_eq!(
            label(&[("content-type", "")]),
            BodyLabel::Loose,
            "FastAPI reads it as untyped"
        );
        assert!(json(&[("content-type", " ; charset=utf-8")]));
        assert_eq!(
            label(&[("content-type", "text/plain"), ("x-trtllm-msgpack", "1")]),
            BodyLabel::Json,
            "MessagePack, whatever the content type says"
        );
        let mut odd = HeaderMap::new();
        odd.insert(
            header::CONTENT_TYPE,
            header::HeaderValue::from_bytes(b"application/json; x=\xff").unwrap(),
        );
        assert_eq!(
            body_label(&odd, true),
            BodyLabel::Json,
            "read as Latin-1, as Python does"
        );
        assert!(json(&[(
            "content-type",
            "application/x-www-form-urlencoded"
        )]));
        assert!(!json(&[("content-type", "text/plain")]));
        assert!(!json(&[(
            "content-type",
            "multipart/form-data; boundary=x"
        )]));
        assert_eq!(
            body_label(&headers(&[("content-type", "application/json")]), false),
            BodyLabel::Other,
            "a request without a body passes through"
        );
    }
}
