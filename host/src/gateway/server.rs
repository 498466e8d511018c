//! Where a request enters: the client listener, one task per connection,
//! HTTP/1.1 and HTTP/2 (h2c), and a graceful drain on shutdown.

use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http::header::{HeaderName, HeaderValue};
use http_body_util::combinators::BoxBody;
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::Request;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;
use tower_layer::Layer;
use tower_service::Service;

use crate::gateway::middleware::SnowgateLayer;
use crate::gateway::upstream::Upstream;

const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");

/// Serves clients on `listener` through `layer` in front of `upstream` until
/// `shutdown` resolves; then stops accepting and lets in-flight requests
/// finish for up to `grace`.
pub async fn serve(
    listener: TcpListener,
    layer: SnowgateLayer,
    upstream: Upstream,
    shutdown: impl Future<Output = ()>,
    grace: Duration,
) {
    let service = layer.layer(upstream);
    let builder = auto::Builder::new(TokioExecutor::new());
    let graceful = GracefulShutdown::new();
    tokio::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    // Out of file descriptors and the like: pass, then retry.
                    tracing::warn!(error = %e, "accepting a connection failed");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let _ = stream.set_nodelay(true);
        let service = service.clone();
        let per_request = hyper::service::service_fn(move |mut request: Request<Incoming>| {
            append_forwarded_for(&mut request, peer);
            let mut service = service.clone();
            async move {
                let response = service.call(request).await?;
                Ok::<_, std::convert::Infallible>(
                    response.map(|body| body.map_err(BodyError).boxed()),
                )
            }
        });
        let connection = builder
            .serve_connection(TokioIo::new(stream), per_request)
            .into_owned();
        let connection = graceful.watch(connection);
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                tracing::debug!(%peer, error = %e, "client connection ended with an error");
            }
        });
    }
    drop(listener);
    tracing::info!("shutting down: no new connections; waiting for in-flight requests");
    tokio::select! {
        () = graceful.shutdown() => tracing::info!("all connections closed"),
        () = tokio::time::sleep(grace) => {
            tracing::warn!(grace_secs = grace.as_secs(), "in-flight requests still running after the grace period");
        }
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

/// Adds the client's address to `X-Forwarded-For`.
fn append_forwarded_for<B>(request: &mut Request<B>, peer: SocketAddr) {
    let ip = peer.ip().to_string();
    let value = match request
        .headers()
        .get(&X_FORWARDED_FOR)
        .and_then(|v| v.to_str().ok())
    {
        Some(existing) => format!("{existing}, {ip}"),
        None => ip,
    };
    if let Ok(value) = HeaderValue::from_str(&value) {
        request.headers_mut().insert(X_FORWARDED_FOR, value);
    }
}
