//! `snowgate serve` end to end: the real binary with the real (bundled)
//! plugin, over loopback HTTP, in front of a recording upstream in the test
//! process.

mod support;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Method, StatusCode};
use http_body_util::{BodyExt, Full};
use serde_json::Value;
use snowgate_host::gateway::{Gateway as LibraryGateway, GatewayConfig};
use snowgate_host::{IdClock, SystemClock, WallClock};
use snowgate_plugin::SnowflakeLayout;
use support::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

// ---------------------------------------------------------------------------
// Stamping and pass-through
// ---------------------------------------------------------------------------

/// Many clients at once, dealt to three worker threads, with instances
/// replaced every two requests: every request is stamped once, every id
/// is distinct, and the metrics count each call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_clients_across_workers_each_get_one_distinct_id() {
    const CLIENTS: usize = 24;
    const EACH: usize = 20;
    let upstream = TestUpstream::start().await;
    let gateway = Gateway::start(&[
        "--upstream",
        &upstream.url(),
        "--workers",
        "3",
        "--plugin-calls-per-instance",
        "2",
    ])
    .await;
    let addr = gateway.addr;
    let clients: Vec<_> = (0..CLIENTS)
        .map(|c| {
            tokio::spawn(async move {
                let mut client = Client::connect(addr).await;
                let mut ids = Vec::new();
                for n in 0..EACH {
                    let body = format!(
                        r#"{{"prompt":"client {c} request {n}","disaggregated_params":{{"request_type":"context_only"}}}}"#
                    );
                    let reply = client.post_json("/v1/completions", body).await;
                    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
                    ids.push(stamped_id(&reply.body));
                }
                ids
            })
        })
        .collect();
    let mut ids = Vec::new();
    for client in clients {
        ids.extend(client.await.expect("a client task"));
    }
    assert_eq!(ids.len(), CLIENTS * EACH);
    let distinct: std::collections::HashSet<u64> = ids.iter().copied().collect();
    assert_eq!(distinct.len(), ids.len(), "an id was repeated");
    assert_eq!(upstream.seen().len(), CLIENTS * EACH);
    let metrics = gateway.metrics().await;
    assert!(
        metrics.contains(&format!(
            "snowgate_plugin_call_seconds_count {}\n",
            CLIENTS * EACH
        )),
        "{metrics}"
    );
}

/// A context-only body arrives upstream with an integer id, a correct
/// Content-Length, and every other byte as the client sent it; the
/// upstream's answer comes back to the client.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stamps_context_only_requests_with_a_correct_content_length() {
    let upstream = TestUpstream::start().await;
    let gateway = Gateway::start(&["--upstream", &upstream.url()]).await;

    // Odd spacing, an escape and a newline: the plugin must keep them all.
    let sent = "{\"model\":\"m\", \"prompt\":\"Hello \\u00e9\\n\",\"max_tokens\":16,\n \"disaggregated_params\":{\"request_type\":\"context_only\",\"schedule_style\":0}}";
    let reply = post_json(gateway.addr, "/v1/completions?x=1", sent).await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
    assert_eq!(reply.header("x-upstream"), Some("seen"));

    let seen = upstream.only_seen();
    assert_eq!(seen.method, Method::POST);
    assert_eq!(seen.path, "/v1/completions?x=1");
    let id = stamped_id(&seen.body);
    assert_fresh_v1_id(id);
    let expected = sent.replace(
        "\"schedule_style\":0}",
        &format!("\"schedule_style\":0,\"disagg_request_id\":{id}}}"),
    );
    assert_eq!(
        std::str::from_utf8(&seen.body).unwrap(),
        expected,
        "only the id is added"
    );
    assert_eq!(
        seen.header("content-length"),
        Some(seen.body.len().to_string().as_str()),
        "Content-Length matches the rewritten body"
    );
    assert_eq!(seen.header("transfer-encoding"), None);
    assert_eq!(seen.header("content-type"), Some("application/json"));
    // The upstream echoes what it got: the client sees the stamped body.
    assert_eq!(reply.body, seen.body);

    // A chunked JSON body is stamped and forwarded with a Content-Length.
    let body = chunked(&[
        br#"{"prompt":"chunk","disaggregated_params":"#,
        br#"{"request_type":"context_only","disagg_request_id":null}}"#,
    ]);
    let mut request = b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n".to_vec();
    request.extend_from_slice(&body);
    let raw = raw_exchange(gateway.addr, &request).await;
    assert_eq!(raw.status, 200, "{:?}", String::from_utf8_lossy(&raw.body));
    let seen = upstream.seen().pop().expect("a second upstream request");
    let second = stamped_id(&seen.body);
    assert_fresh_v1_id(second);
    assert_ne!(second, id);
    assert_eq!(
        std::str::from_utf8(&seen.body).unwrap(),
        format!(
            r#"{{"prompt":"chunk","disaggregated_params":{{"request_type":"context_only","disagg_request_id":{second}}}}}"#
        ),
        "a null id is replaced in place"
    );
    assert_eq!(
        seen.header("content-length"),
        Some(seen.body.len().to_string().as_str())
    );
    assert_eq!(seen.header("transfer-encoding"), None);
}

/// A client that asks `Expect: 100-continue` (curl does for large bodies)
/// gets the interim answer, sends its body, and has it stamped; the body
/// goes upstream whole, without the `Expect` already answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stamps_a_body_sent_after_100_continue() {
    let upstream = TestUpstream::start().await;
    let gateway = Gateway::start(&["--upstream", &upstream.url()]).await;

    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\nContent-Length: {}\r\nExpect: 100-continue\r\nConnection: close\r\n\r\n",
        CONTEXT_ONLY.len()
    );
    let raw = raw_expect_continue(gateway.addr, head.as_bytes(), CONTEXT_ONLY.as_bytes()).await;
    assert_eq!(raw.status, 200, "{:?}", String::from_utf8_lossy(&raw.body));
    let seen = upstream.only_seen();
    assert_fresh_v1_id(stamped_id(&seen.body));
    assert_eq!(
        seen.header("content-length"),
        Some(seen.body.len().to_string().as_str())
    );
    assert_eq!(seen.header("expect"), None);

    // Nor with a body streamed through without the plugin: an upstream
    // that refuses expectations would answer 417 to a body already sent.
    let head = "POST /upload HTTP/1.1\r\nHost: gw\r\nContent-Type: text/plain\r\nContent-Length: 5\r\nExpect: 100-continue\r\nConnection: close\r\n\r\n";
    let raw = raw_expect_continue(gateway.addr, head.as_bytes(), b"plain").await;
    assert_eq!(raw.status, 200, "{:?}", String::from_utf8_lossy(&raw.body));
    let seen = upstream.seen().pop().expect("the streamed request");
    assert_eq!(seen.body, &b"plain"[..]);
    assert_eq!(seen.header("expect"), None, "{:?}", seen.headers);
}

/// A GET without a body goes upstream as it is, and the upstream's answer
/// comes back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn passes_a_get_through() {
    let upstream = TestUpstream::start().await;
    let gateway = Gateway::start(&["--upstream", &upstream.url()]).await;

    let mut client = Client::connect(gateway.addr).await;
    let request = client
        .builder(Method::GET, "/v1/models?limit=2")
        .header("accept", "application/json")
        .body(Full::default())
        .unwrap();
    let reply = client.send(request).await;
    assert_eq!(reply.status, StatusCode::OK);
    assert_eq!(reply.header("x-upstream"), Some("seen"));
    assert!(reply.body.is_empty());

    let seen = upstream.only_seen();
    assert_eq!(seen.method, Method::GET);
    assert_eq!(seen.path, "/v1/models?limit=2");
    assert!(seen.body.is_empty());
    assert_eq!(seen.header("accept"), Some("application/json"));

    // The same keep-alive connection serves the next request.
    let again = client.get("/v1/models").await;
    assert_eq!(again.status, StatusCode::OK);
    assert_eq!(upstream.seen().len(), 2);
}

/// A body that is not JSON passes through byte for byte, with a
/// Content-Length or chunked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn passes_non_json_bodies_through_untouched() {
    let upstream = TestUpstream::start().await;
    let gateway = Gateway::start(&["--upstream", &upstream.url()]).await;

    // Looks like a context-only request, but is declared text: not touched.
    let text = r#"{"disaggregated_params":{"request_type":"context_only"}} and some text {"#;
    let mut client = Client::connect(gateway.addr).await;
    let request = client
        .builder(Method::POST, "/upload")
        .header("content-type", "text/plain")
        .body(Full::new(Bytes::from(text)))
        .unwrap();
    let reply = client.send(request).await;
    assert_eq!(reply.status, StatusCode::OK);
    assert_eq!(reply.body, text.as_bytes());
    let seen = upstream.only_seen();
    assert_eq!(seen.body, text.as_bytes());
    assert_eq!(seen.header("content-type"), Some("text/plain"));
    assert_eq!(
        seen.header("content-length"),
        Some(text.len().to_string().as_str())
    );

    // Binary bytes, chunked.
    let binary: Vec<u8> = (0..=255u8).cycle().take(3000).collect();
    let mut request = b"POST /bin HTTP/1.1\r\nHost: gw\r\nContent-Type: application/octet-stream\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n".to_vec();
    request.extend_from_slice(&chunked(&[&binary[..1000], &binary[1000..]]));
    let raw = raw_exchange(gateway.addr, &request).await;
    assert_eq!(raw.status, 200);
    assert_eq!(raw.body, binary);
    assert_eq!(upstream.seen()[1].body, binary);
}

/// JSON the plugin has nothing to do for (generation-only, no params, an
/// id already set) is forwarded byte for byte.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forwards_json_without_a_missing_id_byte_for_byte() {
    let upstream = TestUpstream::start().await;
    let gateway = Gateway::start(&["--upstream", &upstream.url()]).await;

    let bodies = [
        r#"{"model":"m","prompt":"x","disaggregated_params":{"request_type":"generation_only","disagg_request_id":1099511628800,"ctx_request_id":5}}"#,
        "{ \"model\" : \"m\" ,\n \"messages\": [{\"role\":\"user\",\"content\":\"hi\"}] }",
        r#"{"disaggregated_params":{"request_type":"context_only","disagg_request_id":4398046511104}}"#,
    ];
    let mut client = Client::connect(gateway.addr).await;
    for body in bodies {
        let reply = client.post_json("/v1/completions", body).await;
        assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
        let seen = upstream.seen().pop().expect("forwarded");
        assert_eq!(std::str::from_utf8(&seen.body).unwrap(), body);
        assert_eq!(
            seen.header("content-length"),
            Some(body.len().to_string().as_str())
        );
    }

    // Chunked, generation-only: still byte for byte.
    let body = bodies[0].as_bytes();
    let mut request = b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n".to_vec();
    request.extend_from_slice(&chunked(&[&body[..10], &body[10..]]));
    let raw = raw_exchange(gateway.addr, &request).await;
    assert_eq!(raw.status, 200);
    let seen = upstream.seen().pop().expect("forwarded");
    assert_eq!(seen.body, body);
    assert_eq!(upstream.seen().len(), 4);
}

/// Hop-by-hop headers (the fixed list and those `Connection` names) stop at
/// the gateway in both directions; end-to-end headers pass; the client's
/// address is appended to `X-Forwarded-For`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn strips_hop_by_hop_headers_and_passes_the_rest() {
    let upstream = TestUpstream::start().await;
    let gateway = Gateway::start(&["--upstream", &upstream.url()]).await;

    let body = CONTEXT_ONLY;
    let request = format!(
        "POST /hop HTTP/1.1\r\n\
         Host: gateway.example\r\n\
         Content-Type: application/json\r\n\
         Content-Length: {}\r\n\
         Connection: close, X-Secret\r\n\
         X-Secret: 1\r\n\
         Keep-Alive: timeout=5\r\n\
         Proxy-Connection: keep-alive\r\n\
         Proxy-Authorization: Basic c2VjcmV0\r\n\
         TE: deflate;q=0.5, trailers\r\n\
         Authorization: Bearer token-1\r\n\
         X-Request-Id: abc-123\r\n\
         X-Forwarded-For: 10.0.0.1\r\n\
         User-Agent: snowgate-test\r\n\
         \r\n{body}",
        body.len()
    );
    let raw = raw_exchange(gateway.addr, request.as_bytes()).await;
    assert_eq!(raw.status, 200, "{:?}", String::from_utf8_lossy(&raw.body));

    let seen = upstream.only_seen();
    for hop in [
        "x-secret",
        "keep-alive",
        "proxy-connection",
        "proxy-authorization",
        "transfer-encoding",
    ] {
        assert_eq!(
            seen.header(hop),
            None,
            "{hop} reached the upstream: {:?}",
            seen.headers
        );
    }
    if let Some(connection) = seen.header("connection") {
        let connection = connection.to_ascii_lowercase();
        assert!(
            !connection.contains("x-secret") && !connection.contains("close"),
            "the client's Connection header reached the upstream: {connection}"
        );
    }
    // The gateway passes trailers on, so it says it accepts them; the
    // client's other transfer codings were for the client's hop only.
    assert_eq!(seen.header("te"), Some("trailers"));
    assert_eq!(seen.header("authorization"), Some("Bearer token-1"));
    assert_eq!(seen.header("x-request-id"), Some("abc-123"));
    assert_eq!(seen.header("user-agent"), Some("snowgate-test"));
    assert_eq!(seen.header("x-forwarded-for"), Some("10.0.0.1, 127.0.0.1"));
    assert_eq!(
        seen.header("host"),
        Some(upstream.addr.to_string().as_str()),
        "Host names the upstream"
    );
    // The body still went through the plugin.
    assert_fresh_v1_id(stamped_id(&seen.body));

    // The upstream's hop-by-hop response headers stop at the gateway too.
    assert_eq!(raw.header("x-resp-secret"), None, "{:?}", raw.headers);
    assert_eq!(raw.header("keep-alive"), None, "{:?}", raw.headers);
    assert_eq!(raw.header("x-upstream"), Some("seen"));
    assert_eq!(raw.body, b"hop");
}

/// Server-sent events reach the client one by one: the upstream sends its
/// second event only after the client has received the first through the
/// gateway, so a buffering gateway would never deliver anything.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_server_sent_events_as_they_arrive() {
    let upstream = TestUpstream::start().await;
    let gateway = Gateway::start(&["--upstream", &upstream.url()]).await;

    let mut client = Client::connect(gateway.addr).await;
    let body =
        r#"{"prompt":"hi","stream":true,"disaggregated_params":{"request_type":"context_only"}}"#;
    let request = client
        .builder(Method::POST, "/sse/v1/completions")
        .header("content-type", "application/json")
        .header("accept", "text/event-stream")
        .body(Full::new(Bytes::from(body)))
        .unwrap();
    let response = client.send_streaming(request).await;
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(
        response.headers().get("content-type").unwrap(),
        "text/event-stream"
    );
    let mut body = response.into_body();
    let mut received = Vec::new();
    bounded(
        "event 1 through the gateway before the upstream sends event 2",
        STEP,
        async {
            while !String::from_utf8_lossy(&received).contains("event 1\n\n") {
                let frame = body
                    .frame()
                    .await
                    .expect("the stream ended before event 1")
                    .expect("a body frame");
                if let Ok(data) = frame.into_data() {
                    received.extend_from_slice(&data);
                }
            }
        },
    )
    .await;
    assert!(!String::from_utf8_lossy(&received).contains("event 2"));
    // The stamped request reached the upstream before it started streaming.
    assert_fresh_v1_id(stamped_id(&upstream.only_seen().body));

    received.extend_from_slice(&release_the_rest_of_the_events(&upstream.state, body).await);
    assert_eq!(
        String::from_utf8_lossy(&received),
        "data: event 1\n\ndata: event 2\n\ndata: [DONE]\n\n"
    );
}

/// One worker keeps its upstream connection open across requests, and
/// lends it to no other request while a response streams on it: a request
/// sent meanwhile gets a connection of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_connections_are_reused_but_not_while_a_response_streams() {
    let upstream = TestUpstream::start().await;
    let gateway = Gateway::start(&["--upstream", &upstream.url(), "--workers", "1"]).await;
    let opened = || {
        upstream
            .state
            .accepted
            .load(std::sync::atomic::Ordering::SeqCst)
    };
    for _ in 0..3 {
        let reply = post_json(gateway.addr, "/v1/completions", CONTEXT_ONLY).await;
        assert_eq!(reply.status, StatusCode::OK);
        assert_eq!(get(gateway.addr, "/v1/models").await.status, StatusCode::OK);
    }
    assert_eq!(opened(), 1);

    let mut client = Client::connect(gateway.addr).await;
    let request = client
        .builder(Method::GET, "/sse/v1/completions")
        .body(Full::new(Bytes::new()))
        .unwrap();
    let mut body = client.send_streaming(request).await.into_body();
    let first = bounded("the first event", STEP, body.frame()).await;
    let first = first.expect("a frame").expect("data").into_data().unwrap();
    assert!(String::from_utf8_lossy(&first).contains("event 1"));
    let reply = bounded(
        "a request while a response streams",
        STEP,
        get(gateway.addr, "/v1/models"),
    )
    .await;
    assert_eq!(reply.status, StatusCode::OK);
    assert_eq!(opened(), 2);

    let rest = release_the_rest_of_the_events(&upstream.state, body).await;
    assert!(String::from_utf8_lossy(&rest).ends_with("data: [DONE]\n\n"));
    // Both connections are idle again, and serve what comes next.
    for _ in 0..3 {
        assert_eq!(get(gateway.addr, "/v1/models").await.status, StatusCode::OK);
    }
    assert_eq!(opened(), 2);
}

// ---------------------------------------------------------------------------
// Refusals
// ---------------------------------------------------------------------------

/// A declared 33 MiB body gets 413 as soon as its head arrives: the test
/// sends only the head and a few bytes, so a gateway that read on would
/// hang. The gateway keeps serving afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refuses_a_declared_oversized_body_with_413_without_reading_it() {
    let upstream = TestUpstream::start().await;
    let gateway = Gateway::start(&["--upstream", &upstream.url()]).await;

    let declared = 33 << 20;
    let mut request = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\nContent-Length: {declared}\r\n\r\n"
    )
    .into_bytes();
    request.extend_from_slice(br#"{"prompt":"aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"#);
    let raw = bounded(
        "413 before the body is sent",
        Duration::from_secs(10),
        raw_exchange(gateway.addr, &request),
    )
    .await;
    assert_eq!(raw.status, 413, "{:?}", String::from_utf8_lossy(&raw.body));
    let message = assert_openai_error(&raw.json(), "body_too_large", "invalid_request_error");
    assert!(message.contains("33554432"), "names the limit: {message}");

    // Not JSON, same limit: a declared length is checked before anything.
    let raw = raw_exchange(
        gateway.addr,
        format!("POST /upload HTTP/1.1\r\nHost: gw\r\nContent-Type: application/octet-stream\r\nContent-Length: {declared}\r\n\r\nabc").as_bytes(),
    )
    .await;
    assert_eq!(raw.status, 413);
    assert!(upstream.seen().is_empty(), "nothing went upstream");

    // Still healthy, still stamping.
    let reply = post_json(gateway.addr, "/v1/completions", CONTEXT_ONLY).await;
    assert_eq!(reply.status, StatusCode::OK);
    assert_fresh_v1_id(stamped_id(&upstream.only_seen().body));
    assert_eq!(get(gateway.admin, "/healthz").await.status, StatusCode::OK);
}

/// A connection that closes after its answer (the client said
/// `Connection: close`, spoke HTTP/1.0, or framed its body both ways) with
/// the start of a pipelined request behind it, which hyper read ahead,
/// lingers: what the client sends next is read and thrown away, and the
/// client sees the end, not a reset. Before, the socket held nothing
/// unread when it closed, so it closed at once, and the kernel reset the
/// connection under the client's next write (a fuzz review's client lost
/// its answers that way).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_closed_after_its_answer_reads_on_what_was_pipelined_behind() {
    let gateway = Gateway::start(&[]).await;
    let behind = "POST /v1/models HTTP/1.1\r\nHo";
    for first in [
        "GET /v1/models HTTP/1.1\r\nHost: gw\r\nConnection: close\r\n\r\n",
        "GET /v1/models HTTP/1.0\r\n\r\n",
        "POST /v1/models HTTP/1.1\r\nHost: gw\r\nTransfer-Encoding: chunked\r\n\
         Content-Length: 5\r\n\r\n0\r\n\r\n",
    ] {
        let mut stream = TcpStream::connect(gateway.addr).await.expect("connect");
        bounded("the answer, and what the client sends then", STEP, async {
            stream
                .write_all(format!("{first}{behind}").as_bytes())
                .await
                .unwrap();
            // The answer has come, unread (a client that writes before it
            // reads): a reset now would throw it away. The client goes on
            // writing, more than the socket buffers hold, so the gateway
            // is done with the connection while it writes.
            let mut peeked = [0u8; 1];
            while stream.peek(&mut peeked).await.unwrap() == 0 {}
            let rest = [
                b"st: gw\r\nContent-Length: 16777216\r\n\r\n".as_slice(),
                &[b'a'; 16 << 20],
            ]
            .concat();
            let written = stream.write_all(&rest).await;
            assert!(
                written.is_ok(),
                "{first:?}: read on, not reset: {written:?}"
            );
            stream.shutdown().await.unwrap();
            let mut answer = Vec::new();
            let read = stream.read_to_end(&mut answer).await;
            assert!(
                read.is_ok(),
                "{first:?}: closed, not reset: {read:?} after {:?}",
                String::from_utf8_lossy(&answer)
            );
            assert!(
                answer.starts_with(b"HTTP/1.1 200") || answer.starts_with(b"HTTP/1.0 200"),
                "{first:?}: {}",
                String::from_utf8_lossy(&answer)
            );
        })
        .await;
    }
}

/// A client that sends its whole request before it reads (Python's
/// `http.client` and `requests` do) gets the answer that says why its body
/// or head is too large, 413 or 431: the gateway reads and throws away
/// what the client still sends after the answer (a lingering close, as
/// nginx's). Closed at once with the body unread, the connection was reset
/// under the answer, and the client saw a broken pipe instead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_sends_all_before_it_reads_gets_the_413_or_431() {
    let upstream = TestUpstream::start().await;
    let gateway =
        Gateway::start(&["--upstream", &upstream.url(), "--max-body-bytes", "1048576"]).await;

    let body = vec![b'a'; 16 << 20];
    let request = raw_post_request(
        "/v1/completions",
        b"Content-Type: application/json\r\n",
        &body,
    );
    for _ in 0..3 {
        let raw = raw_exchange(gateway.addr, &request).await;
        assert_eq!(raw.status, 413, "{:?}", String::from_utf8_lossy(&raw.body));
        let message = assert_openai_error(&raw.json(), "body_too_large", "invalid_request_error");
        assert!(message.contains("1048576"), "{message}");
    }
    let head = format!(
        "GET /v1/models HTTP/1.1\r\nHost: gw\r\nX-Big: {}\r\n\r\n",
        "a".repeat(4 << 20)
    );
    assert_eq!(
        raw_exchange(gateway.addr, head.as_bytes()).await.status,
        431
    );

    // A body that comes after the answer, a round trip behind its head
    // (Python writes the two apart): the gateway has answered and ended
    // its side before any of it came, and still reads it, not reset.
    let body_at = request
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("a head")
        + 4;
    let mut stream = TcpStream::connect(gateway.addr).await.expect("connect");
    bounded("the 413 and the gateway's end", STEP, async {
        stream.write_all(&request[..body_at]).await.unwrap();
        let mut answer = Vec::new();
        stream.read_to_end(&mut answer).await.unwrap();
        assert!(
            answer.starts_with(b"HTTP/1.1 413"),
            "{}",
            String::from_utf8_lossy(&answer)
        );
    })
    .await;
    bounded("the body, after the answer", STEP, async {
        stream
            .write_all(&request[body_at..])
            .await
            .expect("the body after the answer is read on");
        stream.shutdown().await.unwrap();
        let mut end = [0u8; 1];
        assert_eq!(stream.read(&mut end).await.expect("closed, not reset"), 0);
    })
    .await;
    assert!(upstream.seen().is_empty(), "nothing went upstream");
    let reply = post_json(gateway.addr, "/v1/completions", CONTEXT_ONLY).await;
    assert_eq!(reply.status, StatusCode::OK);
}

/// An answer given before the request's body is read (413 for a body
/// declared or chunked past the limit, 415 for a compressed one, 405 for
/// CONNECT or TRACE) says `Connection: close`, as the connection then ends:
/// Python's `http.client`, told nothing, kept the connection and failed its
/// next request on it. A 405 without a body keeps the connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_before_the_body_is_read_says_the_connection_closes() {
    let upstream = TestUpstream::start().await;
    let gateway =
        Gateway::start(&["--upstream", &upstream.url(), "--max-body-bytes", "1024"]).await;
    let partly = |method: &str, headers: &str| {
        format!("{method} /v1/completions HTTP/1.1\r\nHost: gw\r\n{headers}\r\n{{\"prompt\":\"a")
    };
    let json = "Content-Type: application/json\r\n";
    let cases = [
        (
            partly("POST", &format!("{json}Content-Length: 2000\r\n")),
            413,
        ),
        (
            partly("POST", &format!("{json}Transfer-Encoding: chunked\r\n")).replace(
                "{\"prompt\":\"a",
                &format!("800\r\n{}\r\n", "a".repeat(2048)),
            ),
            413,
        ),
        (
            partly(
                "POST",
                &format!("{json}Content-Encoding: gzip\r\nContent-Length: 500\r\n"),
            ),
            415,
        ),
        (
            partly("TRACE", &format!("{json}Content-Length: 500\r\n")),
            405,
        ),
    ];
    for (request, status) in cases {
        let raw = raw_exchange(gateway.addr, request.as_bytes()).await;
        assert_eq!(raw.status, status, "{request:?}");
        assert_eq!(raw.header("connection"), Some("close"), "{request:?}");
    }
    let raw = raw_exchange(
        gateway.addr,
        b"TRACE /v1/models HTTP/1.1\r\nHost: gw\r\n\r\n",
    )
    .await;
    assert_eq!(raw.status, 405);
    assert_eq!(raw.header("connection"), None);
    assert!(upstream.seen().is_empty());
}

/// A chunked JSON body (no length declared) that grows past
/// `--max-body-bytes` gets 413 once the limit is passed, without the end
/// of the body ever being sent; at the limit it is accepted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refuses_a_chunked_body_over_max_body_bytes_with_413() {
    let upstream = TestUpstream::start().await;
    let gateway =
        Gateway::start(&["--upstream", &upstream.url(), "--max-body-bytes", "1024"]).await;

    let filler = vec![b'a'; 600];
    let mut request = b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n".to_vec();
    for part in [&br#"{"prompt":""#[..], &filler, &filler] {
        request.extend_from_slice(format!("{:x}\r\n", part.len()).as_bytes());
        request.extend_from_slice(part);
        request.extend_from_slice(b"\r\n");
    }
    // No last chunk: the body never ends, the gateway must not wait for it.
    let raw = raw_exchange(gateway.addr, &request).await;
    assert_eq!(raw.status, 413, "{:?}", String::from_utf8_lossy(&raw.body));
    let message = assert_openai_error(&raw.json(), "body_too_large", "invalid_request_error");
    assert!(message.contains("1024"), "{message}");
    assert!(upstream.seen().is_empty());

    // Exactly at the limit: accepted and stamped.
    let prefix = r#"{"disaggregated_params":{"request_type":"context_only"},"prompt":""#;
    let body = format!("{prefix}{}\"}}", "b".repeat(1024 - prefix.len() - 2));
    assert_eq!(body.len(), 1024);
    let reply = post_json(gateway.addr, "/v1/completions", body).await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
    assert_fresh_v1_id(stamped_id(&upstream.only_seen().body));
}

/// A context-only JSON body of exactly `size` bytes.
fn context_only_of(size: usize) -> Vec<u8> {
    let head = r#"{"disaggregated_params":{"request_type":"context_only"},"prompt":""#;
    let mut body = head.as_bytes().to_vec();
    body.resize(size - 2, b'p');
    body.extend_from_slice(b"\"}");
    body
}

/// A gateway in front of `upstream` that takes bodies of up to 1 MiB and
/// holds at most 1 MiB of them at once, with `more` flags.
async fn with_one_mib_of_body_memory(upstream: &TestUpstream, more: &[&str]) -> Gateway {
    with_one_mib_of_body_memory_logging(upstream, more, "info").await
}

/// [`with_one_mib_of_body_memory`], with `filter` as the log filter.
async fn with_one_mib_of_body_memory_logging(
    upstream: &TestUpstream,
    more: &[&str],
    filter: &str,
) -> Gateway {
    let url = upstream.url();
    let mut args = vec![
        "--upstream",
        &url,
        "--max-body-bytes",
        "1048576",
        "--body-memory-mib",
        "1",
    ];
    args.extend_from_slice(more);
    Gateway::start_logging(&args, filter).await
}

/// A request body an HTTP/2 test sends.
type H2Body = http_body_util::combinators::BoxBody<Bytes, std::convert::Infallible>;

/// A JSON POST of `body` to `/v1/completions` on the HTTP/2 connection
/// `sender`, sent from a task of its own.
fn post_json_h2(
    sender: &hyper::client::conn::http2::SendRequest<H2Body>,
    gateway: &Gateway,
    body: H2Body,
) -> tokio::task::JoinHandle<hyper::Result<http::Response<hyper::body::Incoming>>> {
    let request = http::Request::post(format!("http://{}/v1/completions", gateway.addr))
        .version(http::Version::HTTP_2)
        .header("content-type", "application/json")
        .body(body)
        .expect("a request");
    let mut sender = sender.clone();
    tokio::spawn(async move { sender.send_request(request).await })
}

/// A client that has sent the head of a context-only POST declaring
/// `size` bytes, and the first KiB of its body: the gateway takes room for
/// the whole body at once. Returns the connection and the rest of the body.
async fn hold_body_memory(gateway: &Gateway, size: usize) -> (TcpStream, Vec<u8>) {
    let mut stream = TcpStream::connect(gateway.addr).await.expect("connect");
    let mut rest = context_only_of(size);
    let first: Vec<u8> = rest.drain(..1024).collect();
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\nContent-Length: {size}\r\n\r\n"
    );
    stream
        .write_all(head.as_bytes())
        .await
        .expect("write the head");
    stream.write_all(&first).await.expect("write the first KiB");
    gateway
        .wait_metric("snowgate_body_memory_bytes", size as f64)
        .await;
    (stream, rest)
}

/// A context-only POST of 500 KiB, sent from a task of its own once it
/// waits for room behind a [`hold_body_memory`] of 700 KiB in 1 MiB, as the
/// `in_line`-th request that waits.
async fn queue_for_room(gateway: &Gateway, in_line: f64) -> tokio::task::JoinHandle<Reply> {
    let waiter = tokio::spawn(post_json(
        gateway.addr,
        "/v1/completions",
        context_only_of(500 << 10),
    ));
    gateway
        .wait_metric("snowgate_body_memory_waiting", in_line)
        .await;
    waiter
}

/// Bodies read whole for the plugin share `--body-memory-mib`: a request
/// that finds no room waits, without reaching the plugin or the upstream,
/// until a body that holds room has been sent upstream, and then goes
/// through; every body's room is given back once it has gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_waits_for_room_in_the_body_memory_and_then_goes_through() {
    let upstream = TestUpstream::start().await;
    let gateway = with_one_mib_of_body_memory(&upstream, &[]).await;
    let metrics = gateway.metrics().await;
    assert_eq!(
        metric(&metrics, "snowgate_body_memory_max_bytes"),
        1048576.0
    );

    let (mut holder, rest) = hold_body_memory(&gateway, 700 << 10).await;
    let waiter = queue_for_room(&gateway, 1.0).await;
    assert!(upstream.seen().is_empty(), "nothing went upstream yet");
    assert!(!waiter.is_finished());

    holder.write_all(&rest).await.expect("write the rest");
    let held = read_raw_response(&mut BufReader::new(holder)).await;
    assert_eq!(
        held.status,
        200,
        "{:?}",
        String::from_utf8_lossy(&held.body)
    );
    let waited = bounded("the waiting request", STEP, waiter)
        .await
        .expect("joined");
    assert_eq!(waited.status, StatusCode::OK, "{}", waited.text());

    let seen = upstream.seen();
    assert_eq!(seen.len(), 2);
    let ids: Vec<u64> = seen.iter().map(|s| stamped_id(&s.body)).collect();
    assert_unique(&ids);
    // In either order: the waiter went on once the holder's body had been
    // handed to the upstream connection, which may still be writing it.
    let mut sizes: Vec<usize> = seen.iter().map(|s| s.body.len()).collect();
    sizes.sort();
    assert!(sizes[0] > 500 << 10 && sizes[1] > 700 << 10, "{sizes:?}");
    gateway.wait_metric("snowgate_body_memory_bytes", 0.0).await;
    let metrics = gateway
        .wait_metric("snowgate_body_memory_waiting", 0.0)
        .await;
    assert_eq!(requests_with_outcome(&metrics, "body_memory_full"), 0.0);
}

/// One HTTP/2 connection's streams share the body memory too. A body that
/// declares no length (no `content-length`, sent as it is made) takes 1
/// MiB at once, here the whole body memory, so the streams after it wait,
/// holding nothing, in the order they came; once its body is read it keeps
/// only its size, and once sent, nothing. Then every one is stamped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_http2_connections_streams_share_the_body_memory() {
    let upstream = TestUpstream::start().await;
    let gateway = with_one_mib_of_body_memory(&upstream, &[]).await;
    let sender = http2_to(gateway.addr).await;
    let streamed = || {
        let (chunks, channel) = tokio::sync::mpsc::channel(8);
        (
            chunks,
            post_json_h2(&sender, &gateway, ChannelBody(channel).boxed()),
        )
    };

    let body = context_only_of(401 << 10);
    let (first, first_response) = streamed();
    first
        .send(Bytes::copy_from_slice(&body[..400 << 10]))
        .await
        .expect("most of the body");
    gateway
        .wait_metric("snowgate_body_memory_bytes", 1048576.0)
        .await;
    let declared = Full::new(Bytes::from(context_only_of(300 << 10))).boxed();
    let declared_response = post_json_h2(&sender, &gateway, declared);
    gateway
        .wait_metric("snowgate_body_memory_waiting", 1.0)
        .await;
    let (third, third_response) = streamed();
    gateway
        .wait_metric("snowgate_body_memory_waiting", 2.0)
        .await;
    assert!(upstream.seen().is_empty(), "no body is whole yet");

    first
        .send(Bytes::copy_from_slice(&body[400 << 10..]))
        .await
        .expect("the rest");
    drop(first);
    third
        .send(Bytes::from(context_only_of(200 << 10)))
        .await
        .expect("the third body");
    drop(third);
    for response in [first_response, declared_response, third_response] {
        let response = bounded("a stream's answer", STEP, response)
            .await
            .expect("joined")
            .expect("a response");
        assert_eq!(response.status(), StatusCode::OK);
    }
    let mut sizes: Vec<usize> = upstream.seen().iter().map(|s| s.body.len()).collect();
    sizes.sort();
    assert!(
        sizes.len() == 3 && sizes[0] > 200 << 10 && sizes[1] > 300 << 10 && sizes[2] > 401 << 10,
        "{sizes:?}"
    );
    let ids: Vec<u64> = upstream
        .seen()
        .iter()
        .map(|s| stamped_id(&s.body))
        .collect();
    assert_unique(&ids);
    gateway.wait_metric("snowgate_body_memory_bytes", 0.0).await;
}

/// The head of a POST that declares `length` bytes (or, without one, a
/// chunked body) and waits for `100 Continue` before it sends any: the
/// gateway answers without reading a byte of it.
fn head_expecting_continue(length: Option<usize>) -> String {
    let framing = match length {
        Some(length) => format!("Content-Length: {length}"),
        None => "Transfer-Encoding: chunked".to_string(),
    };
    format!(
        "POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n{framing}\r\nExpect: 100-continue\r\n\r\n"
    )
}

/// An upstream that takes connections and reads nothing from them, and a
/// gateway in front of it that takes bodies of up to 16 MiB and holds at
/// most 16 MiB of them at once, with `more` flags. Its plugin deadline is
/// 20 s, not the default second: these tests are about body memory, and a
/// debug build stamps a batch of 294,000 params in about 0.9 s here alone.
async fn sixteen_mib_before_a_silent_upstream(more: &[&str]) -> (tokio::net::TcpListener, Gateway) {
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let upstream = format!("http://{}", silent.local_addr().expect("address"));
    let mut args = vec![
        "--upstream",
        &upstream,
        "--max-body-bytes",
        "16777216",
        "--body-memory-mib",
        "16",
        "--plugin-deadline-ms",
        "20000",
    ];
    args.extend_from_slice(more);
    (silent, Gateway::start(&args).await)
}

/// A request that finds no room within `--body-read-timeout-ms` gets 503
/// `body_memory_full`, with `Retry-After`, naming the flag, and its
/// connection closes; nothing of it reaches the plugin or the upstream. A
/// body of no declared length takes 1 MiB at once, beside the holder, and
/// more as it arrives: one that grows past the room that is free is
/// refused then, at once. Here the room is held by a stamped body the
/// upstream does not read: room is held until the body is written out,
/// not just read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_that_finds_no_room_in_time_gets_503_body_memory_full() {
    let (silent, gateway) =
        sixteen_mib_before_a_silent_upstream(&["--body-read-timeout-ms", "2000"]).await;
    // 12 MiB: more than loopback's socket buffers take while nobody reads.
    let holder = tokio::spawn(post_json(
        gateway.addr,
        "/v1/completions",
        context_only_of(12 << 20),
    ));
    let (upstream_side, _) = bounded("the stamped body going upstream", STEP, silent.accept())
        .await
        .expect("a connection to the upstream");
    let metrics = gateway.metrics().await;
    assert!(
        metric(&metrics, "snowgate_body_memory_bytes") > f64::from(12 << 20),
        "the stamped body holds its room while it is written: {metrics}"
    );

    let started = Instant::now();
    let refused = raw_exchange(
        gateway.addr,
        head_expecting_continue(Some(8 << 20)).as_bytes(),
    )
    .await;
    assert_eq!(
        refused.status,
        503,
        "{:?}",
        String::from_utf8_lossy(&refused.body)
    );
    assert!(started.elapsed() >= Duration::from_secs(2));
    assert_eq!(refused.header("retry-after"), Some("1"));
    assert_eq!(refused.header("connection"), Some("close"));
    let message = assert_openai_error(&refused.json(), "body_memory_full", "server_error");
    assert!(message.contains("(16 MiB, --body-memory-mib)"), "{message}");
    assert!(message.contains("within 2000 ms"), "{message}");

    // Of no declared length (HTTP/2 without `content-length`): 1 MiB at
    // once, with no wait, however large the body limit (16 MiB); then more
    // as it comes, until more than the 3-odd MiB left is needed.
    let held = metric(&gateway.metrics().await, "snowgate_body_memory_bytes");
    let sender = http2_to(gateway.addr).await;
    let (chunks, channel) = tokio::sync::mpsc::channel(1);
    let streamed = post_json_h2(&sender, &gateway, ChannelBody(channel).boxed());
    let body = context_only_of(8 << 20);
    chunks
        .send(Bytes::copy_from_slice(&body[..1024]))
        .await
        .expect("the first KiB");
    gateway
        .wait_metric("snowgate_body_memory_bytes", held + f64::from(1 << 20))
        .await;
    let metrics = gateway.metrics().await;
    assert_eq!(metric(&metrics, "snowgate_body_memory_waiting"), 0.0);
    for piece in body[1024..].chunks(64 << 10) {
        // Refused: the gateway resets the stream, and hyper drops the body.
        if chunks.send(Bytes::copy_from_slice(piece)).await.is_err() {
            break;
        }
    }
    let refused = bounded("the streamed body's answer", STEP, streamed)
        .await
        .expect("joined")
        .expect("a response");
    // Refused at once, not after a wait for room: the message says which
    // ("grew past its room", not "within 2000 ms").
    assert_eq!(refused.status(), StatusCode::SERVICE_UNAVAILABLE);
    let refused = Reply::read(refused).await;
    let message = assert_openai_error(&refused.json(), "body_memory_full", "server_error");
    assert!(message.contains("grew past its room"), "{message}");

    // The upstream goes away: the holder gets its 502, and its room is
    // given back.
    drop((upstream_side, silent));
    let held = bounded("the holder's answer", STEP, holder)
        .await
        .expect("joined");
    assert_eq!(held.status, StatusCode::BAD_GATEWAY, "{}", held.text());
    let metrics = gateway.wait_metric("snowgate_body_memory_bytes", 0.0).await;
    assert_eq!(requests_with_outcome(&metrics, "body_memory_full"), 2.0);
    assert_eq!(metric(&metrics, "snowgate_plugin_call_seconds_count"), 1.0);
}

/// A body the plugin makes larger than the room its request took, where no
/// more room is free, is sent anyway (it is in memory already), and what
/// it holds beyond its room shows as `snowgate_body_memory_overdrawn_bytes`
/// until it has gone: here a batch of bare context-only params nearly as
/// large as the whole body memory, which stamping makes some 70 % larger,
/// held by an upstream that reads nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rewritten_body_beyond_the_free_room_is_counted_as_overdrawn() {
    let (silent, gateway) = sixteen_mib_before_a_silent_upstream(&[]).await;
    let element = r#"{"disaggregated_params":{"request_type":"context_only"}}"#;
    let count = ((16 << 20) - 2) / (element.len() + 1);
    let body = format!("[{}]", vec![element; count].join(","));
    let holder = tokio::spawn(post_json(gateway.addr, "/v1/completions", body));
    let (upstream_side, _) = bounded("the stamped body going upstream", STEP, silent.accept())
        .await
        .expect("a connection to the upstream");
    let metrics = bounded("the overdraft to show", STEP, async {
        loop {
            let metrics = gateway.metrics().await;
            if metric(&metrics, "snowgate_body_memory_overdrawn_bytes") > 0.0 {
                return metrics;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    let room = metric(&metrics, "snowgate_body_memory_bytes");
    let overdrawn = metric(&metrics, "snowgate_body_memory_overdrawn_bytes");
    assert!(room <= f64::from(16 << 20), "{metrics}");
    assert!(
        room + overdrawn > f64::from(24 << 20),
        "the stamped body, some 27 MiB, is all counted: {metrics}"
    );

    drop((upstream_side, silent));
    let held = bounded("the holder's answer", STEP, holder)
        .await
        .expect("joined");
    assert_eq!(held.status, StatusCode::BAD_GATEWAY, "{}", held.text());
    gateway
        .wait_metric("snowgate_body_memory_overdrawn_bytes", 0.0)
        .await;
    gateway.wait_metric("snowgate_body_memory_bytes", 0.0).await;
}

/// WASI resources (pollables, streams) live in host memory, outside the
/// plugin's memory limit, and an instance kept for reuse keeps them: a
/// plugin that keeps making them traps once it holds 1,024, and its
/// instance goes. Before the cap, 47 instances holding 99,000 each (the
/// store's default limit was 100,000) held 1.1 GB of the gateway's memory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plugin_instance_holds_at_most_1024_host_resources() {
    let (_dir, path) = hostile_plugin_file("handles");
    // One worker, one connection at a time: each call reuses the instance
    // the last one gave back.
    let gateway = Gateway::start(&["--plugin", path.to_str().unwrap(), "--workers", "1"]).await;
    let mut kept = Vec::new();
    let failed = loop {
        let reply = misbehaving(gateway.addr, "handles").await;
        if reply.status != StatusCode::IM_A_TEAPOT {
            break reply;
        }
        kept.push(
            reply.json()["error"]["message"]
                .as_str()
                .unwrap()
                .to_string(),
        );
        assert!(kept.len() <= 10, "2,000 resources kept: {kept:?}");
    };
    // Each pollable of a duration takes two entries, itself and its
    // deadline: the third call's would make 1,200.
    assert_eq!(kept, ["200", "400"]);
    assert_eq!(
        failed.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{}",
        failed.text()
    );
    assert_openai_error(&failed.json(), "middleware_failed", "server_error");
    let metrics = gateway.metrics().await;
    assert_eq!(
        metric(&metrics, r#"snowgate_plugin_failures_total{kind="trap"}"#),
        1.0,
        "{metrics}"
    );
    // The trapped instance went with its resources: the next starts anew.
    let reply = misbehaving(gateway.addr, "handles").await;
    assert_eq!(reply.json()["error"]["message"], "200", "{}", reply.text());
}

/// WASI's random bytes are made inside the host call, where no deadline
/// reaches: a plugin may ask for 256 KiB at a time, and a call asking for
/// more traps instead of holding its worker thread (64 MiB, wasmtime's
/// limit, held it some 150 ms, delaying every request on it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plugin_gets_at_most_256_kib_of_random_bytes_a_call() {
    let (_dir, path) = hostile_plugin_file("random");
    let gateway = Gateway::start(&["--plugin", path.to_str().unwrap()]).await;
    let random = |bytes: u64| {
        let addr = gateway.addr;
        async move {
            let bytes = bytes.to_string();
            misbehaving_with(addr, "random", &[("x-hostile-bytes", &bytes)], b"{}").await
        }
    };
    let reply = random(256 << 10).await;
    assert_eq!(reply.status, StatusCode::IM_A_TEAPOT, "{}", reply.text());
    assert_eq!(reply.json()["error"]["message"], (256 << 10).to_string());
    let reply = random((256 << 10) + 1).await;
    assert_eq!(
        reply.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{}",
        reply.text()
    );
    gateway.wait_log("exceeds limit 262144").await;
}

/// A plugin's header changes (`header-edits`, contract 0.2.1) reach the
/// upstream with the stamped body; a change the host refuses reaches
/// nothing, and the request is answered as the plugin decided (the
/// fixture rejects with the host's reason).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plugins_header_changes_reach_the_upstream() {
    let (_dir, path) = hostile_plugin_file("edit-headers");
    let gateway = Gateway::start(&["--plugin", path.to_str().unwrap()]).await;
    let addr = gateway.addr;
    let send = |edits: &'static str| async move {
        let extra = [
            ("x-tenant", "t1"),
            ("cookie", "a=1"),
            ("x-hostile-edits", edits),
        ];
        misbehaving_with(addr, "edit-headers", &extra, CONTEXT_ONLY.as_bytes()).await
    };
    let reply = send(
        "set x-disagg-route prefill-1, remove x-tenant, append cookie c=3, \
         append x-route-hint a, append x-route-hint b, set x-hostile-edits done",
    )
    .await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
    let received = reply.json();
    let headers = &received["headers"];
    assert_eq!(headers["x-disagg-route"], "prefill-1", "{received}");
    assert_eq!(headers["x-hostile-edits"], "done", "{received}");
    assert!(headers.get("x-tenant").is_none(), "removed: {received}");
    // Appended lines reach the upstream as lines of their own, in order.
    assert_eq!(
        headers["x-route-hint"],
        serde_json::json!(["a", "b"]),
        "{received}"
    );
    // One cookie line, as HTTP/1 servers read them (the echo would show
    // two lines as an array).
    assert_eq!(headers["cookie"], "a=1; c=3", "{received}");
    assert!(
        received["body"]["disaggregated_params"]["disagg_request_id"].is_u64(),
        "stamped as usual: {received}"
    );
    // The new body's length is the host's, whatever the plugin did.
    let sent = received["body"].to_string().len();
    assert_eq!(headers["content-length"], sent.to_string(), "{received}");

    let reply = send("set x-ok 1, set content-length 1").await;
    assert_eq!(reply.status.as_u16(), 422, "{}", reply.text());
    let message = assert_openai_error(&reply.json(), "edit_refused", "invalid_request_error");
    assert!(
        message.contains("the header content-length is the host's to set"),
        "{message}"
    );
    gateway.stop().await;
}

/// The digests a client sent of its body (`Content-Digest`, `Repr-Digest`,
/// `Digest`, `Content-MD5`) do not go upstream with the body the plugin
/// stamped, which they no longer match: an upstream that checks them would
/// refuse every stamped request. A body sent on unchanged keeps them, and
/// a plugin may set a digest of its own new body.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stamped_body_goes_upstream_without_the_clients_digests_of_it() {
    const DIGESTS: [(&str, &str); 4] = [
        (
            "content-digest",
            "sha-256=:RK/0qy18MlBSVnWgjwz6lZEWjP/lF5HF9bvEF8FabDg=:",
        ),
        (
            "repr-digest",
            "sha-256=:RK/0qy18MlBSVnWgjwz6lZEWjP/lF5HF9bvEF8FabDg=:",
        ),
        (
            "digest",
            "SHA-256=RK/0qy18MlBSVnWgjwz6lZEWjP/lF5HF9bvEF8FabDg=",
        ),
        ("content-md5", "Q2hlY2sgSW50ZWdyaXR5IQ=="),
    ];
    let upstream = TestUpstream::start().await;
    let gateway = Gateway::start(&["--upstream", &upstream.url()]).await;
    let mut head = b"Content-Type: application/json\r\nX-Tenant: t1\r\n".to_vec();
    for (name, value) in DIGESTS {
        head.extend_from_slice(format!("{name}: {value}\r\n").as_bytes());
    }

    let stamped = raw_post(
        gateway.addr,
        "/v1/completions",
        &head,
        CONTEXT_ONLY.as_bytes(),
    )
    .await;
    assert_eq!(
        stamped.status,
        200,
        "{:?}",
        String::from_utf8_lossy(&stamped.body)
    );
    let seen = upstream.seen().pop().expect("the stamped request");
    assert_fresh_v1_id(stamped_id(&seen.body));
    for (name, _) in DIGESTS {
        assert_eq!(
            seen.header(name),
            None,
            "{name} went on with a changed body"
        );
    }
    assert_eq!(seen.header("x-tenant"), Some("t1"), "other headers go on");

    // Already stamped: sent on byte for byte, with its digests.
    let kept = CONTEXT_ONLY.replace(
        r#""request_type":"context_only""#,
        r#""request_type":"context_only","disagg_request_id":7"#,
    );
    let unchanged = raw_post(gateway.addr, "/v1/completions", &head, kept.as_bytes()).await;
    assert_eq!(
        unchanged.status,
        200,
        "{:?}",
        String::from_utf8_lossy(&unchanged.body)
    );
    let seen = upstream.seen().pop().expect("the unchanged request");
    assert_eq!(seen.body, kept.as_bytes());
    for (name, value) in DIGESTS {
        assert_eq!(
            seen.header(name),
            Some(value),
            "{name} of an unchanged body"
        );
    }
    gateway.stop().await;

    // A plugin that stamps and sets a digest of its own: the client's is
    // removed first, the plugin's goes on.
    let (_dir, path) = hostile_plugin_file("edit-headers");
    let gateway = Gateway::start(&["--plugin", path.to_str().unwrap()]).await;
    let extra = [
        ("content-digest", DIGESTS[0].1),
        ("digest", DIGESTS[2].1),
        ("x-hostile-edits", "set content-digest sha-512=:cGx1Z2lu:"),
    ];
    let reply = misbehaving_with(
        gateway.addr,
        "edit-headers",
        &extra,
        CONTEXT_ONLY.as_bytes(),
    )
    .await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
    let received = reply.json();
    let headers = &received["headers"];
    assert_eq!(
        headers["content-digest"], "sha-512=:cGx1Z2lu:",
        "{received}"
    );
    assert!(headers.get("digest").is_none(), "{received}");
    assert!(
        received["body"]["disaggregated_params"]["disagg_request_id"].is_u64(),
        "{received}"
    );
    gateway.stop().await;
}

/// The echo upstream answers a body that is not JSON as a JSON string
/// made a piece at a time: 32 MiB of NUL bytes, which escape to 192 MiB
/// (`\u0000`), come back whole and exact while the gateway's peak memory
/// grows by less than twice the body (the body itself, read whole). Built
/// whole, the answer grew it by about 430 MiB for each such request
/// (1,761 MiB peak for four at once, against 158 MiB now).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_echo_escapes_a_text_body_without_holding_the_escaped_copy() {
    const BODY: usize = 32 << 20;
    let gateway = Gateway::start(&[]).await;
    let peak_before = peak_rss_kib(gateway.pid());
    let mut client = Client::connect(gateway.addr).await;
    let request = client
        .builder(Method::POST, "/upload")
        .header("content-type", "text/plain")
        .body(Full::new(Bytes::from(vec![0u8; BODY])))
        .unwrap();
    let reply = client.send(request).await;
    let grown_mib = peak_rss_kib(gateway.pid()).saturating_sub(peak_before) >> 10;
    assert_eq!(reply.status, StatusCode::OK);
    let stated: usize = reply
        .header("content-length")
        .expect("a length")
        .parse()
        .expect("a number");
    assert_eq!(stated, reply.body.len());
    let echoed = reply.json();
    let text = echoed["body"].as_str().expect("the body as a string");
    assert!(
        text.len() == BODY && text.bytes().all(|b| b == 0),
        "{} bytes echoed",
        text.len()
    );
    assert!(
        grown_mib < 2 * (BODY as u64 >> 20),
        "the peak grew by {grown_mib} MiB for a {} MiB body",
        BODY >> 20
    );
    gateway.stop().await;
}

/// An instance not kept for another request for what the plugin did with
/// it (here its memory grew by more than 4 MiB, reading and answering a
/// 6 MiB body) is said in the log, once per build: before, nothing told a
/// plugin's author that such requests each paid a fresh instance.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_not_kept_for_what_the_plugin_did_is_said_once_per_build() {
    let gateway = Gateway::start(&[]).await;
    let body = format!(
        r#"{{"prompt":"{}","disaggregated_params":{{"request_type":"context_only"}}}}"#,
        "x".repeat(6 << 20)
    );
    for _ in 0..2 {
        let reply = post_json(gateway.addr, "/v1/completions", body.clone()).await;
        assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
    }
    let not_kept = "an instance of this build was not kept for another request: its memory grew by";
    gateway.wait_log(not_kept).await;
    gateway.stop().await;
    assert_eq!(gateway.stderr_text().matches(not_kept).count(), 1);
}

/// A plugin may make a body larger where room for it is free, or by as
/// much as the body's own room where none is; an answer larger than that
/// where no room is free is refused with 503 `body_memory_full` and goes
/// nowhere. Without the bound, a plugin answering 4 MiB (64 MiB in the
/// review that found it) to every two-byte request held that much for
/// each until its upstream took it: 2.85 GB for 40 clients against a
/// 16 MiB body memory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plugin_cannot_overdraw_the_body_memory_past_a_bodys_own_room() {
    let (_dir, path) = hostile_plugin_file("bloat");
    let path = path.to_str().unwrap();
    let bloat = |addr| async move {
        let mut client = Client::connect(addr).await;
        let request = client
            .builder(Method::POST, "/v1/completions")
            .header("content-type", "application/json")
            .header("x-hostile", "bloat")
            .body(Full::new(Bytes::from_static(b"{}")))
            .unwrap();
        client.send(request).await
    };

    // Room is free: the 4 MiB answer takes it and goes upstream.
    let roomy = Gateway::start(&["--plugin", path]).await;
    let reply = bloat(roomy.addr).await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
    let echoed = reply.json()["body"].as_str().map(str::len);
    assert_eq!(echoed, Some(4 << 20), "the echo of 4 MiB of spaces");
    roomy.stop().await;

    // 1 MiB in all: no room for it, and 4 MiB is far past the two bytes'
    // room (a KiB).
    let tight = Gateway::start(&[
        "--plugin",
        path,
        "--body-memory-mib",
        "1",
        "--max-body-bytes",
        "65536",
    ])
    .await;
    let reply = bloat(tight.addr).await;
    assert_eq!(
        reply.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{}",
        reply.text()
    );
    assert_eq!(reply.header("retry-after"), Some("1"));
    let message = assert_openai_error(&reply.json(), "body_memory_full", "server_error");
    assert!(message.contains("more than twice its size"), "{message}");
    let metrics = tight.metrics().await;
    assert_eq!(
        requests_with_outcome(&metrics, "body_memory_full"),
        1.0,
        "{metrics}"
    );
    assert_eq!(
        metric(&metrics, "snowgate_body_memory_overdrawn_bytes"),
        0.0
    );
    tight.wait_metric("snowgate_body_memory_bytes", 0.0).await;
    // Stamping still goes through: its growth fits in the room.
    let reply = post_json(tight.addr, "/v1/completions", CONTEXT_ONLY).await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
    stamped_id(&serde_json::to_vec(&reply.json()["body"]).unwrap());
}

/// Room is no place to rest: once a body has room, all of it must arrive
/// within `--body-read-timeout-ms`, however it trickles in. A client that
/// sends a byte every 100 ms (never pausing for the timeout) gets 408
/// `body_timeout` when that time is up, and the request waiting behind it
/// gets the room and goes through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_with_room_must_arrive_whole_within_the_body_read_timeout() {
    let upstream = TestUpstream::start().await;
    let gateway = with_one_mib_of_body_memory(&upstream, &["--body-read-timeout-ms", "3000"]).await;
    let started = Instant::now();
    let (mut holder, rest) = hold_body_memory(&gateway, 700 << 10).await;
    let waiter = queue_for_room(&gateway, 1.0).await;

    let cut_off = gateway.wait_metric("snowgate_requests_total{outcome=\"client_error\"}", 1.0);
    let mut cut_off = std::pin::pin!(cut_off);
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    let mut trickle = rest.iter();
    loop {
        tokio::select! {
            _ = &mut cut_off => break,
            _ = tick.tick() => {
                // The gateway may have closed the connection already.
                let byte = trickle.next().expect("the body outlasts the test");
                let _ = holder.write_all(std::slice::from_ref(byte)).await;
            }
        }
    }
    assert!(started.elapsed() >= Duration::from_millis(3000));
    let answer = read_raw_response(&mut BufReader::new(holder)).await;
    let message = body_timeout_message(&answer);
    assert!(message.contains("within 3000 ms"), "{message}");
    assert!(message.contains("--body-read-timeout-ms"), "{message}");
    the_waiter_gets_the_room(&gateway, &upstream, waiter).await;
}

/// The message of `answer`, a 408 `body_timeout`.
fn body_timeout_message(answer: &RawReply) -> String {
    assert_eq!(
        answer.status,
        408,
        "{:?}",
        String::from_utf8_lossy(&answer.body)
    );
    assert_openai_error(&answer.json(), "body_timeout", "invalid_request_error")
}

/// The request `waiter`, which waited for room behind a body cut off, goes
/// through stamped, and then the body memory holds nothing.
async fn the_waiter_gets_the_room(
    gateway: &Gateway,
    upstream: &TestUpstream,
    waiter: tokio::task::JoinHandle<Reply>,
) {
    let waited = bounded("the waiting request", STEP, waiter)
        .await
        .expect("joined");
    assert_eq!(waited.status, StatusCode::OK, "{}", waited.text());
    assert_fresh_v1_id(stamped_id(&upstream.only_seen().body));
    gateway.wait_metric("snowgate_body_memory_bytes", 0.0).await;
}

/// A holder of room cut off for its pace was cut off no sooner than the
/// slack after `started` (before it got its room), and the request that
/// waited behind it goes through.
async fn it_gave_way_after_the_slack(
    started: Instant,
    gateway: &Gateway,
    upstream: &TestUpstream,
    waiter: tokio::task::JoinHandle<Reply>,
) {
    assert!(
        started.elapsed() >= snowgate_host::gateway::body_pace::PACE_SLACK,
        "cut off within the slack: {:?}",
        started.elapsed()
    );
    the_waiter_gets_the_room(gateway, upstream, waiter).await;
}

/// A body that holds room while it does not arrive gives way to those
/// waiting: with the default 60 s body read timeout, a client that declared
/// 700 KiB and sent 1 KiB is cut off with 408 once a request waits for
/// room, about 5 s (the slack) after it got its room, not after 60 s; the
/// request waiting gets the room and goes through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_that_holds_room_without_arriving_gives_way_to_those_waiting() {
    let upstream = TestUpstream::start().await;
    let gateway = with_one_mib_of_body_memory(&upstream, &[]).await;
    let started = Instant::now();
    let (holder, _rest) = hold_body_memory(&gateway, 700 << 10).await;
    let waiter = queue_for_room(&gateway, 1.0).await;
    let answer = bounded(
        "the holder to be cut off",
        Duration::from_secs(30),
        read_raw_response(&mut BufReader::new(holder)),
    )
    .await;
    let message = body_timeout_message(&answer);
    assert!(message.contains("slower than 12 KiB/s"), "{message}");
    assert!(message.contains("while other requests waited"), "{message}");
    it_gave_way_after_the_slack(started, &gateway, &upstream, waiter).await;
}

/// A body of no declared length gives way too: an HTTP/2 stream that sent
/// a JSON head and nothing more holds 1 MiB of room, and once a request
/// waits for room it is cut off with 408 about 5 s after it got its room,
/// told to declare its length; the waiting request gets the room. (Before,
/// such a body was not paced, and held its room for the whole 60 s.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_of_no_declared_length_that_does_not_arrive_gives_way_too() {
    let upstream = TestUpstream::start().await;
    let gateway = with_one_mib_of_body_memory(&upstream, &[]).await;
    let sender = http2_to(gateway.addr).await;
    let started = Instant::now();
    let (_chunks, channel) = tokio::sync::mpsc::channel(1);
    let holder = post_json_h2(&sender, &gateway, ChannelBody(channel).boxed());
    gateway
        .wait_metric("snowgate_body_memory_bytes", 1048576.0)
        .await;
    let waiter = queue_for_room(&gateway, 1.0).await;
    let cut_off = bounded("the holder to be cut off", Duration::from_secs(30), holder)
        .await
        .expect("joined")
        .expect("a response");
    let answer = Reply::read(cut_off).await;
    assert_eq!(
        answer.status,
        StatusCode::REQUEST_TIMEOUT,
        "{}",
        answer.text()
    );
    let message = assert_openai_error(&answer.json(), "body_timeout", "invalid_request_error");
    assert!(message.contains("of no declared length"), "{message}");
    assert!(message.contains("64 KiB per 60000 ms"), "{message}");
    assert!(message.contains("Content-Length"), "{message}");
    it_gave_way_after_the_slack(started, &gateway, &upstream, waiter).await;
}

/// A body of no declared length that keeps its pace does not keep the
/// room it does not use: an HTTP/2 stream that sent 64 KiB holds 1 MiB, the
/// whole body memory, and once a request waits for room it keeps, from
/// about 5 s (the slack) on, what it holds of the body and 64 KiB more.
/// The waiting request gets the rest and goes through while the stream
/// still comes; the stream then ends and goes through too. (Before, it
/// held its 1 MiB at a pace of about 1 KiB a second for the whole 60 s.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_of_no_declared_length_keeps_only_what_it_uses_while_others_wait() {
    let upstream = TestUpstream::start().await;
    let gateway = with_one_mib_of_body_memory(&upstream, &[]).await;
    let sender = http2_to(gateway.addr).await;
    let started = Instant::now();
    let (chunks, channel) = tokio::sync::mpsc::channel(1);
    let holder = post_json_h2(&sender, &gateway, ChannelBody(channel).boxed());
    let paced = snowgate_host::gateway::body_pace::UNDECLARED_PACED_BYTES;
    chunks
        .send(Bytes::from(vec![b' '; paced]))
        .await
        .expect("the holder's whitespace");
    gateway
        .wait_metric("snowgate_body_memory_bytes", 1048576.0)
        .await;
    let waiter = queue_for_room(&gateway, 1.0).await;
    the_waiter_gets_the_room_meanwhile(started, &gateway, &upstream, waiter).await;
    // What it holds: its 64 KiB (in a buffer of up to twice that, where
    // it came in several frames) and 64 KiB more.
    // The waiter's room goes once its body has gone upstream.
    let headroom = snowgate_host::gateway::body_pace::UNDECLARED_HEADROOM;
    let most = (2 * paced + headroom) as f64;
    let metrics = gateway
        .wait_metric_where("snowgate_body_memory_bytes", "the holder's alone", |held| {
            held <= most
        })
        .await;
    let held = metric(&metrics, "snowgate_body_memory_bytes");
    assert!(
        held >= (paced + headroom) as f64,
        "the holder keeps {held} bytes of room"
    );
    assert!(!holder.is_finished(), "the holder is still sending");
    the_holder_ends_and_goes_through(chunks, holder).await;
    gateway.wait_metric("snowgate_body_memory_bytes", 0.0).await;
    let ids: Vec<u64> = upstream
        .seen()
        .iter()
        .map(|s| stamped_id(&s.body))
        .collect();
    assert_eq!(ids.len(), 2);
    assert_unique(&ids);
}

/// The HTTP/2 request `holder`, whose body of no declared length comes
/// from `chunks`, ends with a context-only request and goes through.
async fn the_holder_ends_and_goes_through(
    chunks: tokio::sync::mpsc::Sender<Bytes>,
    holder: tokio::task::JoinHandle<hyper::Result<http::Response<hyper::body::Incoming>>>,
) {
    chunks
        .send(Bytes::from(CONTEXT_ONLY))
        .await
        .expect("the holder's body");
    drop(chunks);
    let held = bounded("the holder", STEP, holder)
        .await
        .expect("joined")
        .expect("a response");
    assert_eq!(held.status(), StatusCode::OK);
}

/// The request `waiter`, which waited for room behind a body that keeps
/// coming, goes through stamped, no sooner than the slack after `started`
/// (before the holder got its room).
async fn the_waiter_gets_the_room_meanwhile(
    started: Instant,
    gateway: &Gateway,
    upstream: &TestUpstream,
    waiter: tokio::task::JoinHandle<Reply>,
) {
    let waited = bounded("the waiting request", STEP, waiter)
        .await
        .expect("joined");
    assert_eq!(waited.status, StatusCode::OK, "{}", waited.text());
    assert!(
        started.elapsed() >= snowgate_host::gateway::body_pace::PACE_SLACK,
        "room given back within the slack: {:?}",
        started.elapsed()
    );
    assert_fresh_v1_id(stamped_id(&upstream.only_seen().body));
    assert_eq!(
        metric(&gateway.metrics().await, "snowgate_body_memory_waiting"),
        0.0
    );
}

/// At most 8 requests of one connection wait for room at once (an HTTP/2
/// stream that waits does not read its body, and sixteen such would use up
/// the connection's flow-control window, leaving none for the streams that
/// hold room): the ninth is refused at once, naming the connection, while
/// other connections' requests still wait their turn; then all that waited
/// go through. A small body (up to 64 KiB) meanwhile takes room in the
/// small bodies' lane and goes through at once, ahead of those waiting:
/// before, it waited behind them all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_connection_has_at_most_8_requests_waiting_for_room() {
    let upstream = TestUpstream::start().await;
    let gateway = with_one_mib_of_body_memory(&upstream, &[]).await;
    let sender = http2_to(gateway.addr).await;
    let send = |body| post_json_h2(&sender, &gateway, body);
    // A body of no declared length takes all the room while it comes.
    // It opens with as much JSON whitespace as keeps its pace while the
    // others wait, and uses all but the headroom of its room, so that a
    // slow run sees it neither cut off nor giving room back.
    let (chunks, channel) = tokio::sync::mpsc::channel(2);
    let holder = send(ChannelBody(channel).boxed());
    let headroom = snowgate_host::gateway::body_pace::UNDECLARED_HEADROOM;
    chunks
        .send(Bytes::from(vec![b' '; (1 << 20) - headroom]))
        .await
        .expect("the holder's whitespace");
    gateway
        .wait_metric("snowgate_body_memory_bytes", 1048576.0)
        .await;
    // Larger than a small body, which would take room in its lane.
    let larger = || context_only_of(snowgate_host::gateway::body_memory::SMALL_BODY + 1024);
    let waiters: Vec<_> = (0..8)
        .map(|_| send(Full::new(Bytes::from(larger())).boxed()))
        .collect();
    gateway
        .wait_metric("snowgate_body_memory_waiting", 8.0)
        .await;
    let ninth = send(Full::new(Bytes::from(larger())).boxed());
    let refused = bounded("the ninth, at once", STEP, ninth)
        .await
        .expect("joined")
        .expect("a response");
    let refused = Reply::read(refused).await;
    assert_eq!(refused.status, StatusCode::SERVICE_UNAVAILABLE);
    let message = assert_openai_error(&refused.json(), "body_memory_full", "server_error");
    assert!(
        message.contains("8 other requests of this connection"),
        "{message}"
    );
    let elsewhere = tokio::spawn(post_json(gateway.addr, "/v1/completions", larger()));
    gateway
        .wait_metric("snowgate_body_memory_waiting", 9.0)
        .await;
    let small = post_json(gateway.addr, "/v1/completions", CONTEXT_ONLY).await;
    assert_eq!(small.status, StatusCode::OK, "{}", small.text());
    assert_eq!(
        metric(&gateway.metrics().await, "snowgate_body_memory_waiting"),
        9.0
    );

    the_holder_ends_and_goes_through(chunks, holder).await;
    for waiter in waiters {
        let response = bounded("a waiter", STEP, waiter)
            .await
            .expect("joined")
            .expect("a response");
        assert_eq!(response.status(), StatusCode::OK);
    }
    let reply = bounded("the other connection's", STEP, elsewhere)
        .await
        .expect("joined");
    assert_eq!(reply.status, StatusCode::OK);
    let ids: Vec<u64> = upstream
        .seen()
        .iter()
        .map(|s| stamped_id(&s.body))
        .collect();
    assert_eq!(ids.len(), 11);
    assert_unique(&ids);
}

/// An HTTP/1 client that goes away while its request waits for room
/// leaves the line then, not when the wait runs out (60 s here): hyper
/// reads nothing of a connection while its request's body is unread, so
/// the gateway watches the socket for the hang-up, whether the client sent
/// only the head or part of the body too. Each is counted as abandoned,
/// and as no response (the access log says 499, as nginx's does); the
/// request behind them goes through once the holder's body has gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http1_client_that_goes_away_while_waiting_for_room_leaves_the_line() {
    let upstream = TestUpstream::start().await;
    let gateway =
        with_one_mib_of_body_memory_logging(&upstream, &[], "info,snowgate::access=debug").await;
    let (mut holder, rest) = hold_body_memory(&gateway, 700 << 10).await;
    let head = |length: usize| {
        format!(
            "POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\nContent-Length: {length}\r\n\r\n"
        )
    };
    let mut head_only = TcpStream::connect(gateway.addr).await.expect("connect");
    head_only
        .write_all(head(500 << 10).as_bytes())
        .await
        .expect("the head");
    gateway
        .wait_metric("snowgate_body_memory_waiting", 1.0)
        .await;
    let mut partway = TcpStream::connect(gateway.addr).await.expect("connect");
    partway
        .write_all(head(400 << 10).as_bytes())
        .await
        .expect("the head");
    partway
        .write_all(&context_only_of(400 << 10)[..64 << 10])
        .await
        .expect("part of the body");
    gateway
        .wait_metric("snowgate_body_memory_waiting", 2.0)
        .await;
    let behind = queue_for_room(&gateway, 3.0).await;

    drop((head_only, partway));
    gateway
        .wait_metric(r#"snowgate_requests_total{outcome="abandoned"}"#, 2.0)
        .await;
    gateway
        .wait_metric("snowgate_body_memory_waiting", 1.0)
        .await;
    gateway.wait_log_times("status=499", 2).await;
    let metrics = gateway.metrics().await;
    assert_eq!(
        metric(&metrics, r#"snowgate_responses_total{code="4xx"}"#),
        0.0,
        "{metrics}"
    );
    assert!(upstream.seen().is_empty());

    holder.write_all(&rest).await.expect("write the rest");
    let held = read_raw_response(&mut BufReader::new(holder)).await;
    assert_eq!(held.status, 200);
    let behind = bounded("the request behind", STEP, behind)
        .await
        .expect("joined");
    assert_eq!(behind.status, StatusCode::OK, "{}", behind.text());
    assert_eq!(upstream.seen().len(), 2);
    gateway.wait_metric("snowgate_body_memory_bytes", 0.0).await;
}

/// A request whose client's end of stream came with its head (it sent a
/// GET and shut down its sending side at once) is counted, though hyper
/// may drop it without ever running it: every request received is in
/// `snowgate_requests_total`, as `abandoned` if it went no further.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_whose_client_left_with_its_head_is_counted() {
    let upstream = TestUpstream::start().await;
    let gateway = Gateway::start(&["--upstream", &upstream.url()]).await;
    let all_outcomes = |metrics: &str| -> f64 {
        metrics
            .lines()
            .filter(|line| line.starts_with("snowgate_requests_total{"))
            .map(|line| line.rsplit(' ').next().unwrap().parse::<f64>().unwrap())
            .sum()
    };
    let mut client = TcpStream::connect(gateway.addr).await.expect("connect");
    client
        .write_all(b"GET /v1/models HTTP/1.1\r\nHost: gw\r\n\r\n")
        .await
        .expect("the request");
    client.shutdown().await.expect("shut down the sending side");
    bounded("the request to be counted", STEP, async {
        while all_outcomes(&gateway.metrics().await) < 1.0 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    assert_eq!(all_outcomes(&gateway.metrics().await), 1.0);
}

/// Once `gauge` reads 1, resets the HTTP/2 stream of the request `sending`
/// sends (by dropping its response future), and waits until the gateway
/// has counted `abandoned` requests in all and `gauge` reads 0 again.
async fn reset_while<T>(
    gateway: &Gateway,
    sending: tokio::task::JoinHandle<T>,
    gauge: &str,
    abandoned: f64,
) {
    gateway.wait_metric(gauge, 1.0).await;
    sending.abort();
    gateway
        .wait_metric(r#"snowgate_requests_total{outcome="abandoned"}"#, abandoned)
        .await;
    gateway.wait_metric(gauge, 0.0).await;
}

/// A request whose client goes away before the gateway has decided what to
/// do with it is counted as `abandoned`, so that the outcomes add up to
/// the requests received: here an HTTP/2 stream reset while it waits for
/// room for its body, and one reset while the plugin works on it. Neither
/// reaches the upstream, and neither keeps a place in the queue or a call
/// slot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_its_client_abandons_before_its_fate_is_decided_is_counted_as_abandoned() {
    let (_dir, path) = hostile_plugin_file("abandoned");
    let upstream = TestUpstream::start().await;
    let gateway = with_one_mib_of_body_memory(
        &upstream,
        &[
            "--plugin",
            path.to_str().unwrap(),
            "--plugin-deadline-ms",
            "120000",
        ],
    )
    .await;
    let abandoned = r#"snowgate_requests_total{outcome="abandoned"}"#;
    let sender = http2_to(gateway.addr).await;

    let (holder, rest) = hold_body_memory(&gateway, 700 << 10).await;
    let waiting = post_json_h2(
        &sender,
        &gateway,
        Full::new(Bytes::from(context_only_of(500 << 10))).boxed(),
    );
    reset_while(&gateway, waiting, "snowgate_body_memory_waiting", 1.0).await;
    // The holder, whose connection closes partway through its body, went
    // away too: abandoned, not a client error, and answered to nobody.
    drop((holder, rest));
    gateway.wait_metric("snowgate_body_memory_bytes", 0.0).await;
    gateway.wait_metric(abandoned, 2.0).await;
    let calls_before = metric(
        &gateway.metrics().await,
        "snowgate_plugin_call_seconds_count",
    );

    // `sleep` waits a minute inside the call: a WASI wait that would end
    // past the deadline ends the call at once, so the deadline is longer.
    let request = http::Request::post(format!("http://{}/v1/completions", gateway.addr))
        .version(http::Version::HTTP_2)
        .header("content-type", "application/json")
        .header("x-hostile", "sleep")
        .body(Full::new(Bytes::from(CONTEXT_ONLY)).boxed())
        .expect("a request");
    let mut call_sender = sender.clone();
    let sleeping = tokio::spawn(async move { call_sender.send_request(request).await });
    reset_while(&gateway, sleeping, "snowgate_plugin_calls_running", 3.0).await;
    assert!(upstream.seen().is_empty(), "{:?}", upstream.seen().len());
    // The call given up on is timed, up to when it was: a plugin slower
    // than its clients' patience shows in the histogram.
    let metrics = gateway.metrics().await;
    assert_eq!(
        metric(&metrics, "snowgate_plugin_call_seconds_count"),
        calls_before + 1.0,
        "{metrics}"
    );

    // The connection, and the gateway, serve on.
    let after = post_json_h2(
        &sender,
        &gateway,
        Full::new(Bytes::from(CONTEXT_ONLY)).boxed(),
    );
    let after = bounded("a request after both", STEP, after)
        .await
        .expect("joined")
        .expect("a response");
    assert_eq!(after.status(), StatusCode::OK);
    assert_fresh_v1_id(stamped_id(&upstream.only_seen().body));
    let metrics = gateway.metrics().await;
    assert_eq!(metric(&metrics, abandoned), 3.0, "{metrics}");
    assert_eq!(
        requests_with_outcome(&metrics, "client_error"),
        0.0,
        "{metrics}"
    );
    // Only the request answered was a response: none of the abandoned.
    assert_eq!(responses_by_class(&metrics), [1.0, 0.0, 0.0], "{metrics}");
}

/// A body limit the plugin's memory cannot stamp is named at start, with
/// the flag to raise and what is needed; a memory that holds only bodies
/// with few ids is named too; a fitting pair is not. (The built-in echo
/// upstream's warning is logged after the check: once it is in, so is the
/// check's.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn warns_at_start_when_the_plugin_memory_cannot_hold_the_largest_body() {
    let after_the_check = "no --upstream given";
    let body = "209715200";
    let needs = "needs 422 MiB for a body of that size with few ids, and up to 842 MiB for one \
                 dense with ids: raise --plugin-memory-mib";
    for (memory, warning) in [
        ("256", Some("fail as memory_limit even with one id")),
        (
            "512",
            Some("fail as memory_limit when they are dense with ids"),
        ),
        ("842", None),
    ] {
        let gateway =
            Gateway::start(&["--max-body-bytes", body, "--plugin-memory-mib", memory]).await;
        gateway.wait_log(after_the_check).await;
        let log = gateway.stderr_text();
        match warning {
            Some(warning) => {
                let start = format!(
                    "--max-body-bytes {body} with a plugin memory limit of {memory} MiB: the \
                     largest bodies will {warning}"
                );
                assert!(log.contains(&start), "{log}");
                assert!(log.contains(needs), "{log}");
            }
            None => assert!(!log.contains("--plugin-memory-mib"), "{log}"),
        }
    }
}

/// The same for a body streamed through to the upstream without the
/// plugin (not JSON): one that declares no length is cut off and refused
/// with 413 as soon as it passes `--max-body-bytes`, not forwarded whole;
/// at the limit it goes through unchanged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refuses_a_chunked_body_streamed_through_over_max_body_bytes_with_413() {
    let upstream = TestUpstream::start().await;
    let gateway =
        Gateway::start(&["--upstream", &upstream.url(), "--max-body-bytes", "1024"]).await;

    let filler = vec![b'a'; 600];
    let mut request = b"POST /upload HTTP/1.1\r\nHost: gw\r\nContent-Type: text/plain\r\nTransfer-Encoding: chunked\r\n\r\n".to_vec();
    for part in [&filler, &filler] {
        request.extend_from_slice(format!("{:x}\r\n", part.len()).as_bytes());
        request.extend_from_slice(part);
        request.extend_from_slice(b"\r\n");
    }
    // No last chunk: the body never ends, the gateway must not wait for it.
    let raw = bounded(
        "413 once the limit is passed",
        Duration::from_secs(10),
        raw_exchange(gateway.addr, &request),
    )
    .await;
    assert_eq!(raw.status, 413, "{:?}", String::from_utf8_lossy(&raw.body));
    let message = assert_openai_error(&raw.json(), "body_too_large", "invalid_request_error");
    assert!(message.contains("1024"), "{message}");
    let metrics = get(gateway.admin, "/metrics").await;
    assert!(
        metrics
            .text()
            .contains("snowgate_requests_total{outcome=\"too_large\"} 1\n"),
        "{}",
        metrics.text()
    );

    // Exactly at the limit, chunked: forwarded as it came.
    let body = "c".repeat(1024);
    let mut request = b"POST /upload HTTP/1.1\r\nHost: gw\r\nContent-Type: text/plain\r\nTransfer-Encoding: chunked\r\n\r\n".to_vec();
    request.extend_from_slice(format!("{:x}\r\n{body}\r\n0\r\n\r\n", body.len()).as_bytes());
    let raw = raw_exchange(gateway.addr, &request).await;
    assert_eq!(raw.status, 200, "{:?}", String::from_utf8_lossy(&raw.body));
    let forwarded = upstream.seen().into_iter().last().expect("forwarded");
    assert_eq!(forwarded.body, body.as_bytes());
}

/// A body streamed through that passes `--max-body-bytes` after the
/// upstream has answered (it answered before reading the whole body) can
/// get no 413: it is cut off, the upstream sees it end short, and the
/// gateway warns, naming the request. Before, nothing was logged: the
/// access log showed a 200, and the metrics a request passed through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn warns_of_a_body_streamed_through_cut_off_after_its_answer() {
    // Answers as soon as the head has come, then reads the body to its end
    // and tells how much of it came.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind the upstream");
    let upstream = listener.local_addr().expect("upstream address");
    let (read_tx, read_rx) = tokio::sync::oneshot::channel();
    tokio::spawn(async move {
        let (mut stream, _) = listener.accept().await.expect("the gateway connects");
        let (mut seen, head_end) = read_request_head(&mut stream).await;
        stream
            .write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello")
            .await
            .expect("answer");
        let mut buf = [0u8; 4096];
        while let Ok(n @ 1..) = stream.read(&mut buf).await {
            seen.extend_from_slice(&buf[..n]);
        }
        let _ = read_tx.send(seen.split_off(head_end));
    });
    let gateway = Gateway::start(&[
        "--upstream",
        &format!("http://{upstream}"),
        "--max-body-bytes",
        "1024",
    ])
    .await;

    let chunk = format!("258\r\n{}\r\n", "a".repeat(600));
    let mut client = TcpStream::connect(gateway.addr).await.expect("connect");
    client
        .write_all(
            format!(
                "POST /upload?part=1&\u{2028}x=2 HTTP/1.1\r\nHost: gw\r\n\
                 Content-Type: text/plain\r\nTransfer-Encoding: chunked\r\n\r\n{chunk}"
            )
            .as_bytes(),
        )
        .await
        .expect("head and a first chunk");
    let mut answer = Vec::new();
    let mut buf = [0u8; 4096];
    while !answer.ends_with(b"hello") {
        let n = bounded("the upstream's answer", STEP, client.read(&mut buf))
            .await
            .expect("read the answer");
        assert!(n > 0, "closed before the answer: {answer:?}");
        answer.extend_from_slice(&buf[..n]);
    }
    assert!(answer.starts_with(b"HTTP/1.1 200 OK\r\n"), "{answer:?}");

    // Past the limit, after the answer.
    let _ = client.write_all(format!("{chunk}{chunk}").as_bytes()).await;
    gateway
        .wait_log("passed --max-body-bytes (1024 bytes) after the upstream had answered it")
        .await;
    let log = gateway.stderr_text();
    let warning = log
        .lines()
        .find(|line| line.contains("after the upstream had answered it"))
        .expect("the warning");
    // The path as the access log has it: quoted, a line separator
    // escaped, so that a client cannot start a line of its own.
    assert!(
        warning.contains(r#"path="/upload?part=1&\u{2028}x=2""#),
        "{warning}"
    );
    assert!(warning.contains("POST"), "{warning}");

    // The upstream saw the body end short, and the client's connection
    // closes.
    let body = bounded("the upstream's connection to close", STEP, read_rx)
        .await
        .expect("the upstream's read");
    let body = body.as_slice();
    assert!(
        !body.ends_with(b"0\r\n\r\n"),
        "{:?}",
        String::from_utf8_lossy(body)
    );
    assert!(body.len() < 3 * chunk.len(), "{}", body.len());
    let rest = bounded("the client's connection to close", STEP, async {
        let mut rest = Vec::new();
        client.read_to_end(&mut rest).await.map(|_| rest)
    })
    .await;
    assert!(rest.map_or(true, |rest| rest.is_empty()));
}

/// HTTP/1.1 heads hyper lets through but RFC 9112 refuses get 400 and
/// reach no upstream: no `Host`, two `Host`s, and a target in authority
/// form on a method other than CONNECT (it went on as `/`), in HTTP/1.0
/// too, and the target `*` on a method other than OPTIONS (it went on as
/// it came). A TRACE gets 405: it would echo the request's cookies back.
/// HTTP/1.0 needs no Host.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refuses_heads_without_one_host_or_with_an_authority_target_and_trace() {
    let upstream = TestUpstream::start().await;
    let gateway = Gateway::start(&["--upstream", &upstream.url()]).await;
    for (request, status, says) in [
        (&b"GET /x HTTP/1.1\r\n\r\n"[..], 400, "has 0"),
        (
            b"GET /x HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n",
            400,
            "has 2",
        ),
        (
            b"GET evil.example:80 HTTP/1.1\r\nHost: evil.example\r\n\r\n",
            400,
            "authority form",
        ),
        (
            b"POST evil.example:80 HTTP/1.0\r\nContent-Length: 2\r\n\r\n{}",
            400,
            "authority form",
        ),
        (
            b"GET * HTTP/1.1\r\nHost: a\r\n\r\n",
            400,
            "only for OPTIONS",
        ),
        (
            b"TRACE /x HTTP/1.1\r\nHost: a\r\nCookie: s=1\r\n\r\n",
            405,
            "TRACE",
        ),
        // Methods are case-sensitive, but an upstream that is not would
        // echo these (before, they went on).
        (
            b"trace /x HTTP/1.1\r\nHost: a\r\nCookie: s=1\r\n\r\n",
            405,
            "TRACE",
        ),
        (
            b"Trace /x HTTP/1.1\r\nHost: a\r\nCookie: s=1\r\n\r\n",
            405,
            "TRACE",
        ),
    ] {
        let raw = raw_exchange(gateway.addr, request).await;
        let text = String::from_utf8_lossy(&raw.body).into_owned();
        assert_eq!(
            raw.status,
            status,
            "{}: {text}",
            String::from_utf8_lossy(request)
        );
        assert!(text.contains(says), "{text}");
    }
    assert!(upstream.seen().is_empty(), "{:?}", upstream.seen());
    let raw = raw_exchange(gateway.addr, b"GET /old HTTP/1.0\r\n\r\n").await;
    assert_eq!(raw.status, 200);
    assert_eq!(upstream.only_seen().path, "/old");
}

/// Under an upstream base path, a request whose `..` segments climb above
/// its root gets 400 `bad_path` and nothing goes upstream: forwarded as
/// `/api/../admin`, an upstream that resolves dot segments would serve
/// `/admin`, outside the base path. Dot segments that stay within the
/// request's own path go as they came, after the base path. The path is
/// refused before the body is read: a context-only body sent there costs
/// no plugin call, and so no ids.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refuses_a_path_that_climbs_out_of_the_upstream_base_path() {
    let upstream = TestUpstream::start().await;
    let base = format!("{}/api", upstream.url());
    let gateway = Gateway::start(&["--upstream", &base]).await;
    for target in [
        "/../admin",
        "/v1/%2e%2e/..%2fadmin?q=1",
        "/..;/admin",
        "/v1\\..\\..\\admin",
    ] {
        let request = format!("GET {target} HTTP/1.1\r\nHost: a\r\n\r\n");
        let raw = raw_exchange(gateway.addr, request.as_bytes()).await;
        let text = String::from_utf8_lossy(&raw.body).into_owned();
        assert_eq!(raw.status, 400, "{target}: {text}");
        assert!(text.contains("bad_path"), "{target}: {text}");
        assert!(
            text.contains("climb above the upstream's base path"),
            "{text}"
        );
    }
    let body = br#"{"disaggregated_params":{"request_type":"context_only"}}"#;
    let request = format!(
        "POST /v1/../../admin HTTP/1.1\r\nHost: a\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{}",
        body.len(),
        String::from_utf8_lossy(body)
    );
    let raw = raw_exchange(gateway.addr, request.as_bytes()).await;
    assert_eq!(raw.status, 400, "{:?}", String::from_utf8_lossy(&raw.body));
    assert!(String::from_utf8_lossy(&raw.body).contains("bad_path"));
    assert!(upstream.seen().is_empty(), "{:?}", upstream.seen());
    let metrics = gateway.metrics().await;
    assert_eq!(metric(&metrics, "snowgate_plugin_call_seconds_count"), 0.0);
    let raw = raw_exchange(
        gateway.addr,
        b"GET /v1/x/../models?q=.. HTTP/1.1\r\nHost: a\r\n\r\n",
    )
    .await;
    assert_eq!(raw.status, 200);
    assert_eq!(upstream.only_seen().path, "/api/v1/x/../models?q=..");
}

/// An absolute-form target without a path (`http://host?q=1`) asks for `/`
/// (RFC 9112 section 3.2.1): the upstream, under its base path or not, and
/// the built-in echo (which shows what the plugin is given) see `/?q=1`.
/// They saw `?q=1`, and under a base path `/api?q=1`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_absolute_form_target_without_a_path_asks_for_the_root() {
    let upstream = TestUpstream::start().await;
    let base = format!("{}/api", upstream.url());
    let request = |target: &str| {
        raw_post_request(
            target,
            b"Content-Type: application/json\r\n",
            CONTEXT_ONLY.as_bytes(),
        )
    };
    for (base, prefix) in [(base.as_str(), "/api"), (&upstream.url(), "")] {
        let gateway = Gateway::start(&["--upstream", base]).await;
        for (target, forwarded) in [
            ("http://elsewhere.test?q=1", "/?q=1"),
            ("http://elsewhere.test/?q=1", "/?q=1"),
            // A fragment is not sent; the empty path was, as nothing.
            ("http://elsewhere.test#f", "/"),
        ] {
            let raw = raw_exchange(gateway.addr, &request(target)).await;
            assert_eq!(raw.status, 200, "{target}");
            let seen = upstream.seen().pop().expect("a request upstream");
            assert_eq!(
                seen.path,
                format!("{prefix}{forwarded}"),
                "{target} under {base}"
            );
            assert_fresh_v1_id(stamped_id(&seen.body));
        }
    }
    let echo = Gateway::start(&[]).await;
    let raw = raw_exchange(echo.addr, &request("http://elsewhere.test?q=1")).await;
    assert_eq!(raw.status, 200);
    assert_eq!(raw.json()["path"], "/?q=1");
}

/// An HTTP/2 `:path` without its leading `/` reaches no upstream. Joined
/// to the base path as it came, `x/../admin` under `/api` would ask for
/// `/apix/../admin` (which resolves to `/admin`) and `-internal/keys` for
/// `/api-internal/keys`. h2 checks only that the path is not empty; the
/// `http` crate refuses the rest (since 1.4.1), and the stream is reset; the
/// upstream path's own check stands behind it. Sent as raw frames: no
/// HTTP/2 client here sends such a path.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http2_path_without_its_leading_slash_reaches_no_upstream() {
    let upstream = TestUpstream::start().await;
    let base = format!("{}/api", upstream.url());
    let gateway = Gateway::start(&["--upstream", &base]).await;
    for path in ["x/../admin", "-internal/keys"] {
        let block = support::h2_literal_block(&[
            (":method", "GET"),
            (":scheme", "http"),
            (":authority", "a"),
            (":path", path),
        ]);
        let frames = h2_frame(0x01, END_STREAM_AND_HEADERS, &block);
        assert_stream_1_refused(gateway.addr, &frames, path).await;
    }
    assert!(upstream.seen().is_empty(), "{:?}", upstream.seen());
    // With its `/`, a path goes through, after the base path.
    let mut sender = http2_to::<Full<Bytes>>(gateway.addr).await;
    let request = http::Request::get(format!("http://{}/v1/models", gateway.addr))
        .body(Full::new(Bytes::new()))
        .expect("a request");
    let response = sender.send_request(request).await.expect("an answer");
    assert_eq!(response.status(), 200);
    assert_eq!(upstream.only_seen().path, "/api/v1/models");
}

/// An HTTP/2 request without `:path` (nor `:authority`) is refused with
/// 400, not sent upstream: it went on as `GET  HTTP/1.1`, a request line
/// without a target, and the client got 502. So does one whose pseudo
/// fields come after a regular field, its block split over HEADERS and
/// CONTINUATION with a cut inside `:path`, which h2 (0.4.20) takes without
/// its `:path` and `:authority` (in one frame it resets the stream): the
/// block of a fuzz review's case, as its HPACK encoder wrote it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http2_request_without_a_path_reaches_no_upstream() {
    // Records every request head it reads, whatever its request line.
    let upstream = RawUpstream::start(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n").await;
    let gateway = Gateway::start(&["--upstream", &upstream.url()]).await;
    let frame = h2_frame;
    // `:method GET`, `:scheme http` (HPACK's static entries 2 and 6).
    let no_path = frame(0x01, END_STREAM_AND_HEADERS, &[0x82, 0x86]);
    // `:method GET`, `:scheme http`, `x-a: 1`, `:path /x?fz=1020-0`,
    // `:authority example.com`, `content-type: application/json`,
    // `content-length: 0`: HEADERS with END_STREAM, two CONTINUATIONs, and
    // one with END_HEADERS.
    let parts: [&[u8]; 4] = [
        &[
            0x82, 0x86, 0x40, 0x83, 0xf2, 0xb0, 0xff, 0x81, 0x0f, 0x44, 0x8a, 0x63, 0xcf, 0xf9,
            0x2f, 0xb8, 0x02, 0x01,
        ],
        &[
            0x01, 0x60, 0x7f, 0x41, 0x88, 0x2f, 0x91, 0xd3, 0x5d, 0x05, 0x5c, 0x87, 0xa7, 0x5f,
            0x8b, 0x1d, 0x75, 0xd0, 0x62, 0x0d, 0x26,
        ],
        &[0x3d, 0x4c, 0x74],
        &[0x41, 0xea, 0x5c, 0x81, 0x07],
    ];
    let split = [
        frame(0x01, 0x01, parts[0]),
        frame(0x09, 0x00, parts[1]),
        frame(0x09, 0x00, parts[2]),
        frame(0x09, 0x04, parts[3]),
    ]
    .concat();
    for (case, frames) in [
        ("no :path", no_path),
        ("pseudo fields after a field, split", split),
    ] {
        assert_stream_1_refused(gateway.addr, &frames, case).await;
    }
    assert!(upstream.heads().is_empty(), "{:?}", upstream.heads());
}

/// An HTTP/2 client's preface and an empty SETTINGS frame.
const H2_PREFACE_AND_SETTINGS: &[u8] =
    b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00";

/// The flags END_STREAM and END_HEADERS of a HEADERS frame.
const END_STREAM_AND_HEADERS: u8 = 0x05;

/// Sends `frames` after the preface on a connection of its own, and
/// asserts that stream 1 is refused: reset, or answered 400 (`:status` 400
/// is HPACK's static entry 12).
async fn assert_stream_1_refused(addr: SocketAddr, frames: &[u8], case: &str) {
    let mut stream = TcpStream::connect(addr).await.expect("connect");
    let sent = [H2_PREFACE_AND_SETTINGS, frames].concat();
    stream.write_all(&sent).await.expect("write");
    let answer = bounded(
        "the gateway's answer to stream 1",
        Duration::from_secs(10),
        stream_1_answer(&mut stream),
    )
    .await;
    assert!(
        answer == H2Answer::Reset || answer == H2Answer::Headers(0x8c),
        "{case}: {answer:?}"
    );
}

/// A frame of `kind` with `flags` on stream 1.
fn h2_frame(kind: u8, flags: u8, payload: &[u8]) -> Vec<u8> {
    support::h2_frame_on(1, kind, flags, payload)
}

/// An HTTP/2 body streamed through (not JSON) that goes on past its
/// content-length, after a pause, never reaches the upstream whole: its
/// last declared byte is held until the client's stream ends, and this one
/// ends in h2's refusal. Before, the upstream had the whole request as soon
/// as the declared bytes came, and ran it, while the client had its stream
/// reset as malformed (RFC 9113 section 8.1.1: a proxy must not forward
/// it; a fuzz review found the upstream running 3 or 4 of 10).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http2_body_past_its_content_length_never_reaches_the_upstream_whole() {
    // Tells when a request head came, then how much of its body came
    // before the gateway closed the connection, answering a whole one.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind the upstream");
    let upstream = listener.local_addr().expect("upstream address");
    let (head_tx, head_rx) = tokio::sync::oneshot::channel();
    let (body_tx, body_rx) = tokio::sync::oneshot::channel();
    tokio::spawn(async move {
        let (mut stream, _) = listener.accept().await.expect("the gateway connects");
        let (mut seen, head_end) = read_request_head(&mut stream).await;
        let _ = head_tx.send(());
        let mut buf = [0u8; 4096];
        while seen.len() - head_end < 5 {
            match stream.read(&mut buf).await {
                Ok(n @ 1..) => seen.extend_from_slice(&buf[..n]),
                _ => break,
            }
        }
        if seen.len() - head_end >= 5 {
            let _ = stream
                .write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
                .await;
        }
        let _ = body_tx.send(seen[head_end..].to_vec());
    });
    let gateway = Gateway::start(&["--upstream", &format!("http://{upstream}")]).await;

    let mut client = TcpStream::connect(gateway.addr).await.expect("connect");
    let head = support::h2_literal_block(&[
        (":method", "POST"),
        (":scheme", "http"),
        (":authority", "a"),
        (":path", "/upload"),
        ("content-type", "text/plain"),
        ("content-length", "5"),
    ]);
    // HEADERS with END_HEADERS only, then DATA without END_STREAM.
    let start = [
        H2_PREFACE_AND_SETTINGS,
        &h2_frame(0x01, 0x04, &head),
        &h2_frame(0x00, 0x00, b"hello"),
    ]
    .concat();
    client
        .write_all(&start)
        .await
        .expect("the head and 5 bytes");
    bounded("the request head upstream", STEP, head_rx)
        .await
        .expect("a head");
    // One byte more, and the end.
    client
        .write_all(&h2_frame(0x00, 0x01, b"!"))
        .await
        .expect("a byte past the length");
    let answer = bounded(
        "the gateway's answer to stream 1",
        STEP,
        stream_1_answer(&mut client),
    )
    .await;
    let body = bounded("the upstream's connection to end", STEP, body_rx)
        .await
        .expect("the body upstream");
    assert!(
        body.len() < 5,
        "the upstream had the whole body {:?} (the client: {answer:?})",
        String::from_utf8_lossy(&body)
    );
    assert_eq!(answer, H2Answer::Reset, "malformed: reset by h2");
}

/// How the gateway answered an HTTP/2 stream 1.
#[derive(Debug, PartialEq, Eq)]
enum H2Answer {
    /// RST_STREAM.
    Reset,
    /// HEADERS, whose field block starts with this byte.
    Headers(u8),
    /// GOAWAY, or the connection closed first.
    Closed,
}

/// Reads frames until one answers stream 1.
async fn stream_1_answer(stream: &mut TcpStream) -> H2Answer {
    use tokio::io::AsyncReadExt as _;
    loop {
        let mut head = [0u8; 9];
        if stream.read_exact(&mut head).await.is_err() {
            return H2Answer::Closed;
        }
        let length = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
        let mut payload = vec![0u8; length];
        if stream.read_exact(&mut payload).await.is_err() {
            return H2Answer::Closed;
        }
        let stream_id = u32::from_be_bytes([head[5], head[6], head[7], head[8]]) & 0x7fff_ffff;
        match (head[3], stream_id) {
            (0x03, 1) => return H2Answer::Reset,
            (0x01, 1) => {
                // PADDED and PRIORITY put bytes before the field block.
                let padded = usize::from(head[4] & 0x08 != 0);
                let priority = if head[4] & 0x20 != 0 { 5 } else { 0 };
                return H2Answer::Headers(payload.get(padded + priority).copied().unwrap_or(0));
            }
            (0x07, _) => return H2Answer::Closed,
            _ => {}
        }
    }
}

/// A request body sent with a transfer coding other than chunked (`gzip,
/// chunked`, which hyper reads as chunked) gets 501, as RFC 9112 asks, and
/// nothing goes upstream: forwarded, it would reach the upstream gzipped
/// and unlabelled. So does one chunked twice, in one line or two: hyper
/// takes one layer off, and the other would go on as the body. `Chunked`
/// in any case is read as usual.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refuses_a_transfer_coding_other_than_chunked_with_501() {
    let upstream = TestUpstream::start().await;
    let gateway = Gateway::start(&["--upstream", &upstream.url()]).await;
    // `abc` chunked (13 bytes), chunked again.
    let twice = "d\r\n3\r\nabc\r\n0\r\n\r\n\r\n0\r\n\r\n";
    for (coding, body, named) in [
        ("gzip, chunked", "3\r\nabc\r\n0\r\n\r\n", "gzip, chunked"),
        ("chunked, chunked", twice, "chunked, chunked"),
        (
            "chunked\r\nTransfer-Encoding: chunked",
            twice,
            "chunked, chunked",
        ),
    ] {
        for content_type in ["text/plain", "application/json"] {
            let request = format!(
                "POST /upload HTTP/1.1\r\nHost: gw\r\nContent-Type: {content_type}\r\n\
                 Transfer-Encoding: {coding}\r\n\r\n{body}"
            );
            let raw = raw_exchange(gateway.addr, request.as_bytes()).await;
            assert_eq!(raw.status, 501, "{:?}", String::from_utf8_lossy(&raw.body));
            let message =
                assert_openai_error(&raw.json(), "unsupported_transfer_encoding", "server_error");
            assert!(message.contains(named), "{message}");
            assert_eq!(raw.header("connection"), Some("close"));
        }
    }
    assert!(upstream.seen().is_empty(), "nothing went upstream");
    let raw = raw_exchange(
        gateway.addr,
        b"POST /upload HTTP/1.1\r\nHost: gw\r\nContent-Type: text/plain\r\n\
          Transfer-Encoding: Chunked\r\nConnection: close\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
    )
    .await;
    assert_eq!(raw.status, 200, "{:?}", String::from_utf8_lossy(&raw.body));
    assert_eq!(upstream.only_seen().body, "abc");
}

/// Malformed JSON gets 400 with an OpenAI-style error that says what is
/// wrong and where; nothing goes upstream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_malformed_json_with_400_naming_the_problem() {
    let upstream = TestUpstream::start().await;
    let gateway = Gateway::start(&["--upstream", &upstream.url()]).await;

    let mut client = Client::connect(gateway.addr).await;
    let reply = client
        .post_json(
            "/v1/completions",
            "{\"prompt\":\"hi\",\n \"max_tokens\":16,}",
        )
        .await;
    assert_eq!(reply.status, StatusCode::BAD_REQUEST);
    assert_eq!(reply.header("content-type"), Some("application/json"));
    let message = assert_openai_error(&reply.json(), "invalid_json", "invalid_request_error");
    assert!(message.contains("not valid JSON"), "{message}");
    assert!(message.contains("line 2"), "names the line: {message}");
    assert!(reply.json()["error"].get("param").is_some());

    let reply = client
        .post_json("/v1/completions", "{\"prompt\":\"unterminated")
        .await;
    assert_eq!(reply.status, StatusCode::BAD_REQUEST);
    let message = assert_openai_error(&reply.json(), "invalid_json", "invalid_request_error");
    assert!(message.contains("ends inside a string"), "{message}");

    let reply = client
        .post_json("/v1/completions", &b"{\"prompt\":\"\xff\"}"[..])
        .await;
    assert_eq!(reply.status, StatusCode::BAD_REQUEST);
    let message = assert_openai_error(&reply.json(), "invalid_utf8", "invalid_request_error");
    assert!(message.contains("UTF-8"), "{message}");

    assert!(upstream.seen().is_empty(), "nothing went upstream");
    // The connection is still usable after refusals.
    let reply = client.post_json("/v1/completions", CONTEXT_ONLY).await;
    assert_eq!(reply.status, StatusCode::OK);
}

/// A plugin rejection reaches the client with the plugin's status and
/// message: MessagePack that is cut short gets 400 naming the format.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relays_a_plugin_rejection_with_its_status() {
    let upstream = TestUpstream::start().await;
    let gateway = Gateway::start(&["--upstream", &upstream.url()]).await;

    let mut client = Client::connect(gateway.addr).await;
    let request = client
        .builder(Method::POST, "/v1/completions")
        .header("content-type", "application/json")
        .header("x-trtllm-msgpack", "1")
        .body(Full::new(Bytes::from_static(b"\x82\xa6prompt\xa2hi")))
        .unwrap();
    let reply = client.send(request).await;
    assert_eq!(reply.status, StatusCode::BAD_REQUEST);
    let message = assert_openai_error(&reply.json(), "invalid_msgpack", "invalid_request_error");
    assert!(message.contains("not valid MessagePack"), "{message}");
    assert!(upstream.seen().is_empty());
}

/// A real MessagePack client and upstream: Python's msgspec, which
/// TensorRT-LLM uses for `X-TRTLLM-Msgpack: 1`, encodes requests and
/// decodes what the gateway forwards (`tests/clients/msgspec_client.py`
/// says what it checks). Skipped where python3 has no msgspec, except in
/// CI, where `.ci/run` installs it.
#[test]
fn msgspec_decodes_what_the_gateway_stamped() {
    let has_msgspec = std::process::Command::new("python3")
        .args(["-c", "import msgspec"])
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|status| status.success());
    if !tool_present(has_msgspec, "python3 with msgspec", "pip install msgspec") {
        return;
    }
    let output = std::process::Command::new("python3")
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/clients/msgspec_client.py"
        ))
        .arg(env!("CARGO_BIN_EXE_snowgate"))
        .output()
        .expect("running python3");
    assert!(
        output.status.success(),
        "msgspec_client.py: {}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}

/// The plugin deadline counts the time a call runs, not the time it waits
/// for its turn on a busy worker: a burst of long calls on one worker
/// thread, each well within the deadline alone, is stamped, not refused.
/// (Counting wall time, 14 of 16 concurrent 22 MiB bodies got 503.) Here
/// the hostile fixture's `spin` (some 30 ms of CPU) is timed alone first,
/// the quickest of ten (so that a busy moment during the timing does not
/// stretch the deadline past the burst); the deadline is then 20 such
/// calls, and 40 of them at once take the worker some two deadlines: on a
/// faster or a busier machine alike, each call stays far within the
/// deadline (a call stretched twentyfold by the machine's other work
/// would fail it) and the burst runs past it. 40 is
/// fewer than the calls the gateway runs at once: none waits for a slot,
/// which would bound its waits to four deadlines.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_long_calls_is_not_refused_for_waiting_its_turn() {
    const BURST: usize = 40;
    let (_dir, path) = hostile_plugin_file("burst");
    let plugin = path.to_str().unwrap();

    // The quickest of ten calls alone, as the client sees it.
    let alone = Gateway::start(&["--plugin", plugin, "--workers", "1"]).await;
    let mut one_call = Duration::MAX;
    for _ in 0..10 {
        let started = Instant::now();
        let reply = misbehaving(alone.addr, "spin").await;
        assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
        one_call = one_call.min(started.elapsed());
    }
    alone.stop().await;
    let deadline = (one_call * 20).max(Duration::from_millis(50));

    let upstream = TestUpstream::start().await;
    let gateway = Gateway::start(&[
        "--plugin",
        plugin,
        "--upstream",
        &upstream.url(),
        "--workers",
        "1",
        "--plugin-deadline-ms",
        &deadline.as_millis().to_string(),
    ])
    .await;
    let started = Instant::now();
    let replies: Vec<_> = (0..BURST)
        .map(|_| tokio::spawn(misbehaving(gateway.addr, "spin")))
        .collect();
    for reply in replies {
        let reply = reply.await.expect("the request task");
        assert_eq!(
            reply.status,
            StatusCode::OK,
            "one call took {one_call:?} alone: {}",
            reply.text()
        );
    }
    let ids: Vec<u64> = upstream
        .seen()
        .iter()
        .map(|seen| stamped_id(&seen.body))
        .collect();
    assert_eq!(ids.len(), BURST);
    assert_unique(&ids);
    // The burst did take the worker longer than one deadline: otherwise
    // this test would pass with waits counted too.
    let took = started.elapsed();
    assert!(
        took > deadline,
        "the burst took {took:?}, the deadline is {deadline:?}"
    );
}

/// What a plugin says reaches the log escaped: its log lines, its error
/// message and its panic text cannot start a line of their own, return the
/// carriage or colour a terminal. And a plugin failure of one kind does not
/// hold back the next second's first failure of another: the panic right
/// after a plugin error is logged too, where one throttle for all kinds
/// kept it out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plugin_cannot_forge_gateway_log_lines() {
    const ESCAPED: &str =
        r"forged\nERROR snowgate_host::gateway: FAKE reload succeeded\r\n\u{1b}[31mred\u{0}";
    let (_dir, path) = hostile_plugin_file("forge");
    let gateway = Gateway::start(&["--plugin", path.to_str().unwrap()]).await;
    for behaviour in ["forge", "forge-panic"] {
        let reply = misbehaving(gateway.addr, behaviour).await;
        assert_eq!(
            reply.status,
            StatusCode::SERVICE_UNAVAILABLE,
            "{}",
            reply.text()
        );
    }
    // Its log line, the plugin error's line, and the panic's.
    gateway.wait_log_times(ESCAPED, 3).await;
    let log = gateway.stderr_text();
    for raw in ['\r', '\u{1b}', '\0'] {
        assert!(!log.contains(raw), "{raw:?} in the log:\n{log}");
    }
    for line in log
        .lines()
        .filter(|line| line.contains("FAKE reload succeeded"))
    {
        assert!(line.contains(ESCAPED), "a forged line: {line:?}");
    }
    assert!(log.contains("plugin failed; request refused"), "{log}");
    assert!(log.contains("the plugin failed: forged"), "{log}");
    assert!(log.contains("the plugin trapped: "), "{log}");
}

/// A plugin that traps on every request writes its backtrace to the log
/// once a second, not once a request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plugin_trapping_on_every_request_is_logged_once_a_second() {
    const REQUESTS: u64 = 30;
    let (_dir, path) = hostile_plugin_file("trap-flood");
    let gateway = Gateway::start(&["--plugin", path.to_str().unwrap()]).await;
    let started = Instant::now();
    for _ in 0..REQUESTS {
        let reply = misbehaving(gateway.addr, "trap").await;
        assert_eq!(
            reply.status,
            StatusCode::SERVICE_UNAVAILABLE,
            "{}",
            reply.text()
        );
    }
    let seconds = started.elapsed().as_secs() + 1;
    gateway
        .wait_log("WARN snowgate_host::call: the plugin trapped")
        .await;
    let log = gateway.stderr_text();
    let lines = log.matches("the plugin trapped (").count() as u64;
    assert!(
        (1..=seconds.min(REQUESTS - 1)).contains(&lines),
        "{lines} backtraces for {REQUESTS} traps in {seconds} s:\n{log}"
    );
}

/// A context-only request in MessagePack, as TensorRT-LLM's orchestrator
/// sends it to workers with `TRTLLM_SERVE_ENABLE_MSGSPEC=1`, reaches the
/// upstream stamped, still MessagePack, with its new length.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stamps_a_messagepack_request() {
    let upstream = TestUpstream::start().await;
    let gateway = Gateway::start(&["--upstream", &upstream.url()]).await;

    // {"prompt": "hi", "disaggregated_params": {"request_type": "context_only"}}
    let mut body = b"\x82\xa6prompt\xa2hi\xb4disaggregated_params".to_vec();
    let header = body.len();
    body.extend_from_slice(b"\x81\xacrequest_type\xaccontext_only");
    let mut client = Client::connect(gateway.addr).await;
    let request = client
        .builder(Method::POST, "/v1/completions")
        .header("content-type", "application/json")
        .header("x-trtllm-msgpack", "1")
        .body(Full::new(Bytes::from(body.clone())))
        .unwrap();
    let reply = client.send(request).await;
    assert_eq!(reply.status, StatusCode::OK);

    let seen = upstream.only_seen();
    assert_eq!(seen.header("x-trtllm-msgpack"), Some("1"));
    let out = &seen.body;
    assert_eq!(
        seen.header("content-length"),
        Some(out.len().to_string().as_str())
    );
    assert_eq!(out.len(), body.len() + 1 + 17 + 9);
    assert_eq!(out[..header], body[..header]);
    assert_eq!(out[header], 0x82, "the params map counts one pair more");
    assert_eq!(out[header + 1..body.len()], body[header + 1..]);
    assert_eq!(
        out[body.len()..body.len() + 19],
        *b"\xb1disagg_request_id\xcf"
    );
    let id = u64::from_be_bytes(out[body.len() + 19..].try_into().expect("8 bytes"));
    assert_fresh_v1_id(id);
}

// ---------------------------------------------------------------------------
// Failure policy
// ---------------------------------------------------------------------------

/// An 8 MiB context-only body: more than a 4 MiB plugin memory limit
/// allows, so the call fails for real (the memory limit, not a mock).
fn oversized_for_plugin() -> String {
    format!(
        r#"{{"prompt":"{}","disaggregated_params":{{"request_type":"context_only"}}}}"#,
        "a".repeat(8 << 20)
    )
}

/// Fail-closed (the default): a plugin that hits its memory limit gets the
/// request refused with 503 and a message that says why; the upstream is
/// not called; small requests keep working.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fails_closed_with_503_when_the_plugin_fails() {
    let upstream = TestUpstream::start().await;
    let gateway =
        Gateway::start(&["--upstream", &upstream.url(), "--plugin-memory-mib", "4"]).await;

    let reply = post_json(gateway.addr, "/v1/completions", oversized_for_plugin()).await;
    assert_eq!(reply.status, StatusCode::SERVICE_UNAVAILABLE);
    let message = assert_openai_error(&reply.json(), "middleware_failed", "server_error");
    assert!(message.contains("not forwarded"), "{message}");
    assert!(message.contains("4 MiB memory limit"), "{message}");
    assert!(
        upstream.seen().is_empty(),
        "a failed request must not go upstream"
    );

    let metrics = gateway.metrics().await;
    assert_eq!(requests_with_outcome(&metrics, "failed_closed"), 1.0);
    assert_eq!(
        metric(
            &metrics,
            r#"snowgate_plugin_failures_total{kind="memory_limit"}"#
        ),
        1.0
    );
    gateway.wait_log("fail-closed").await;

    let reply = post_json(gateway.addr, "/v1/completions", CONTEXT_ONLY).await;
    assert_eq!(reply.status, StatusCode::OK);
    assert_fresh_v1_id(stamped_id(&upstream.only_seen().body));
}

/// Fail-open: the same failing call forwards the request unchanged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fails_open_forwarding_the_body_unchanged_when_configured() {
    let upstream = TestUpstream::start().await;
    let gateway = Gateway::start(&[
        "--upstream",
        &upstream.url(),
        "--plugin-memory-mib",
        "4",
        "--failure-policy",
        "fail-open",
    ])
    .await;

    let body = oversized_for_plugin();
    let reply = post_json(gateway.addr, "/v1/completions", body.clone()).await;
    assert_eq!(reply.status, StatusCode::OK);
    let seen = upstream.only_seen();
    assert!(
        seen.body == body.as_bytes(),
        "the body went upstream unchanged"
    );
    assert_eq!(
        seen.header("content-length"),
        Some(body.len().to_string().as_str())
    );

    let metrics = gateway.metrics().await;
    assert_eq!(requests_with_outcome(&metrics, "failed_open"), 1.0);
    assert_eq!(
        metric(
            &metrics,
            r#"snowgate_plugin_failures_total{kind="memory_limit"}"#
        ),
        1.0
    );
    assert_eq!(gateway.status().await["failure_policy"], "fail-open");
}

/// An upstream nobody listens on gets 502 with a JSON error, counted. The
/// log names the upstream's address; the client's answer does not (an
/// internal address is the operator's business).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_502_when_the_upstream_is_down() {
    let dead = dead_address().await;
    let gateway = Gateway::start(&["--upstream", &format!("http://{dead}")]).await;

    let first_sent = Instant::now();
    let reply = post_json(gateway.addr, "/v1/completions", CONTEXT_ONLY).await;
    assert_eq!(reply.status, StatusCode::BAD_GATEWAY);
    let message = assert_openai_error(&reply.json(), "upstream_unreachable", "server_error");
    assert!(
        message.starts_with("the upstream could not be reached"),
        "{message}"
    );
    let address = dead.to_string();
    let port = address.rsplit(':').next().expect("a port");
    assert!(
        !message.contains(port),
        "names the upstream's address: {message}"
    );
    gateway
        .wait_log_until("a warning naming the upstream", move |log| {
            log.lines()
                .any(|l| l.contains("upstream request failed") && l.contains(&address))
        })
        .await;
    let reply = get(gateway.addr, "/v1/models").await;
    assert_eq!(reply.status, StatusCode::BAD_GATEWAY);

    let metrics = gateway.metrics().await;
    assert_eq!(upstream_errors(&metrics, Some("unreachable")), 2.0);
    assert_eq!(upstream_errors(&metrics, None), 2.0);
    assert_eq!(get(gateway.admin, "/healthz").await.status, StatusCode::OK);

    // An outage is not a warning per request: one a second, then one
    // that counts the rest.
    fn counts(log: &str) -> Vec<usize> {
        log.lines()
            .filter_map(|l| l.split("upstream request failed (").nth(1))
            .map(|rest| {
                rest.split(' ')
                    .next()
                    .and_then(|n| n.parse().ok())
                    .expect("a count")
            })
            .collect()
    }
    let started = Instant::now();
    let mut sent = 2;
    loop {
        let reply = get(gateway.addr, "/v1/models").await;
        assert_eq!(reply.status, StatusCode::BAD_GATEWAY);
        sent += 1;
        let log = gateway.stderr_text();
        if counts(&log).iter().any(|&held_back| held_back > 0) {
            break;
        }
        assert!(started.elapsed() < STEP, "no summary line:\n{log}");
    }
    // Requests sent after the summary was written, but before the test
    // read it from the pipe, belong to the next window. Once that window
    // has passed, one more request closes it with a line that counts
    // them, so the lines account for every request exactly.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let reply = get(gateway.addr, "/v1/models").await;
    assert_eq!(reply.status, StatusCode::BAD_GATEWAY);
    sent += 1;
    gateway
        .wait_log_until(
            &format!("warnings accounting for {sent} requests"),
            move |log| {
                counts(log)
                    .iter()
                    .map(|held_back| 1 + held_back)
                    .sum::<usize>()
                    >= sent
            },
        )
        .await;
    let log = gateway.stderr_text();
    let counts = counts(&log);
    assert_eq!(
        counts.iter().map(|held_back| 1 + held_back).sum::<usize>(),
        sent,
        "{log}"
    );
    // One line a second at most, however slowly the requests went.
    let seconds = first_sent.elapsed().as_secs();
    assert!(
        counts.len() as u64 <= seconds + 2,
        "{sent} requests, {} warnings in {seconds} s",
        counts.len()
    );
    let metrics = gateway.metrics().await;
    assert_eq!(upstream_errors(&metrics, None), sent as f64);
}

/// The 502 says why the upstream could not be reached, not only that it
/// could not: the cause of the client error is in the message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_502_names_the_cause() {
    let dead = dead_address().await;
    let gateway = Gateway::start(&["--upstream", &format!("http://{dead}")]).await;
    let reply = get(gateway.addr, "/v1/models").await;
    assert_eq!(reply.status, StatusCode::BAD_GATEWAY);
    let message = assert_openai_error(&reply.json(), "upstream_unreachable", "server_error");
    assert!(
        message.to_ascii_lowercase().contains("connection refused"),
        "{message}"
    );
}

/// An upstream whose listen queue is full drops the gateway's connection
/// attempts (Linux drops a SYN when the accept queue is full): after
/// --upstream-connect-timeout-ms the client gets 504 naming that limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_that_cannot_be_connected_to_gets_a_504_after_the_connect_timeout() {
    let socket = tokio::net::TcpSocket::new_v4().expect("a socket");
    socket
        .bind("127.0.0.1:0".parse().expect("an address"))
        .expect("bind");
    let full = socket.listen(0).expect("listen with a backlog of 0");
    let addr = full.local_addr().expect("address");
    // Fill the accept queue (a backlog of 0 holds one connection) and keep
    // it full: nobody ever accepts.
    let mut fillers = Vec::new();
    for _ in 0..2 {
        fillers.push(tokio::spawn(tokio::net::TcpStream::connect(addr)));
    }
    // The 504's message, from a gateway with `timeouts`, and how long it
    // took.
    let timed_out = |timeouts: &'static [&'static str]| async move {
        let upstream = format!("http://{addr}");
        let gateway =
            Gateway::start(&[&["--upstream", upstream.as_str()][..], timeouts].concat()).await;
        let started = Instant::now();
        let reply = bounded(
            "a request to an upstream nobody can connect to",
            Duration::from_secs(20),
            get(gateway.addr, "/v1/models"),
        )
        .await;
        let took = started.elapsed();
        assert_eq!(
            reply.status,
            StatusCode::GATEWAY_TIMEOUT,
            "{}",
            reply.text()
        );
        let message = assert_openai_error(&reply.json(), "upstream_timeout", "server_error");
        gateway.stop().await;
        (message, took)
    };
    let (message, took) = timed_out(&["--upstream-connect-timeout-ms", "500"]).await;
    assert!(took >= Duration::from_millis(500));
    assert!(
        message.contains("500 ms") && message.contains("--upstream-connect-timeout-ms"),
        "{message}"
    );
    // A response timeout shorter than the connect timeout runs out first:
    // the answer says the upstream was never reached, not that it sent no
    // response.
    let (message, _) = timed_out(&[
        "--upstream-connect-timeout-ms",
        "5000",
        "--upstream-response-timeout-ms",
        "300",
    ])
    .await;
    assert!(
        message.contains("could not be connected to within 300 ms")
            && message.contains("--upstream-connect-timeout-ms is 5000 ms"),
        "{message}"
    );
    for filler in fillers {
        filler.abort();
    }
    drop(full);
}

/// A gateway, started with `args`, whose upstream is `upstream.test` at
/// `port`, looked up through the preloaded `getaddrinfo` of
/// `tests/shims/slow_getaddrinfo.c` (built in `dir`) as `shim` sets it up:
/// its `SLOW_GETADDRINFO_*` variables, named without the prefix. `None`
/// where there is no C compiler to build it.
async fn gateway_with_shim_dns(
    dir: &Path,
    port: u16,
    args: &[&str],
    shim: &[(&str, String)],
) -> Option<Gateway> {
    let library = text(&built_shim(dir, "slow_getaddrinfo")?);
    let upstream = format!("http://upstream.test:{port}");
    let mut all = vec!["--upstream", upstream.as_str()];
    all.extend_from_slice(args);
    let named: Vec<(String, &str)> = shim
        .iter()
        .map(|(name, value)| (format!("SLOW_GETADDRINFO_{name}"), value.as_str()))
        .collect();
    let mut env = vec![
        ("LD_PRELOAD", library.as_str()),
        ("SLOW_GETADDRINFO_HOST", "upstream.test"),
    ];
    env.extend(named.iter().map(|(name, value)| (name.as_str(), *value)));
    Some(Gateway::start_with_env(&all, &env).await)
}

/// `path` as the text an environment variable holds.
fn text(path: &Path) -> String {
    path.to_str().expect("a UTF-8 path").to_string()
}

/// An upstream named by a host whose DNS lookups hang (here: take 1.5 s,
/// with a 200 ms connect timeout) costs each request a 504, not a blocking
/// thread: one lookup runs at a time for the worker, whatever number of
/// requests wait, and once it ends its addresses serve the requests after
/// it. Before, every connection attempt started a lookup of its own, each
/// holding a thread of the blocking pool until it ended: 16 at once here.
///
/// The slow DNS is a preloaded `getaddrinfo` (`tests/shims/slow_getaddrinfo.c`)
/// that answers 127.0.0.1 late: a real resolver cannot be slowed here.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_name_that_resolves_slowly_is_looked_up_once_at_a_time() {
    let dir = TempDir::new("slow-dns");
    let log = dir.path().join("lookups.log");
    let upstream = TestUpstream::start().await;
    let Some(gateway) = gateway_with_shim_dns(
        dir.path(),
        upstream.addr.port(),
        &["--upstream-connect-timeout-ms", "200", "--workers", "1"],
        &[("MS", "1500".into()), ("LOG", text(&log))],
    )
    .await
    else {
        return;
    };
    let addr = gateway.addr;
    let waiting: Vec<_> = (0..16)
        .map(|_| tokio::spawn(async move { get(addr, "/v1/models").await }))
        .collect();
    for request in waiting {
        let reply = request.await.expect("a request");
        assert_eq!(
            reply.status,
            StatusCode::GATEWAY_TIMEOUT,
            "{}",
            reply.text()
        );
    }
    // Requests one after another until the lookup under way has ended and
    // its addresses serve (polled, at most STEP).
    let deadline = Instant::now() + STEP;
    loop {
        let reply = get(addr, "/v1/models").await;
        if reply.status == StatusCode::OK {
            break;
        }
        assert!(Instant::now() < deadline, "never served: {}", reply.text());
    }
    let lookups = std::fs::read_to_string(&log).expect("the shim's log");
    let most_at_once = lookups
        .lines()
        .filter_map(|line| line.strip_prefix("start ")?.parse::<u32>().ok())
        .max()
        .expect("a lookup");
    assert_eq!(most_at_once, 1, "lookups under way at once: {lookups}");
    gateway.stop().await;
}

/// A gateway that found the upstream's addresses goes on connecting to
/// them while the DNS server fails or hangs: a request that needs a new
/// connection is answered, and the name is looked up again in the
/// background meanwhile. Before, addresses over a second old were not used
/// again, and each such request got 502 (a failing lookup) or 504 (one
/// that hangs), though the upstream answered at them.
///
/// The DNS server is the preloaded `getaddrinfo` of
/// `tests/shims/slow_getaddrinfo.c`, told what to do through a file.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn addresses_found_before_serve_while_the_dns_server_fails_or_hangs() {
    let dir = TempDir::new("failing-dns");
    let (log, control) = (dir.path().join("lookups.log"), dir.path().join("dns"));
    std::fs::write(&control, "127.0.0.1").expect("the DNS control file");
    let upstream = TestUpstream::start().await;
    let Some(gateway) = gateway_with_shim_dns(
        dir.path(),
        upstream.addr.port(),
        &[
            "--upstream-connect-timeout-ms",
            "300",
            // Every request after a pause needs a new connection.
            "--upstream-idle-timeout-ms",
            "1",
            "--workers",
            "1",
        ],
        &[
            ("MS", "5000".into()),
            ("LOG", text(&log)),
            ("CONTROL", text(&control)),
        ],
    )
    .await
    else {
        return;
    };
    let lookups = || {
        std::fs::read_to_string(&log)
            .map(|text| text.lines().count())
            .unwrap_or(0)
    };
    let reply = get(gateway.addr, "/v1/models").await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
    // "hang": the lookup answers only after 5 s.
    for dns in ["fail", "hang"] {
        std::fs::write(&control, dns).expect("the DNS control file");
        let before = lookups();
        // The time under test: the addresses age past the second they are
        // kept as they are (KEEP_ADDRESSES).
        tokio::time::sleep(Duration::from_millis(1100)).await;
        let reply = get(gateway.addr, "/v1/models").await;
        assert_eq!(reply.status, StatusCode::OK, "{dns}: {}", reply.text());
        // And the name was looked up again meanwhile (polled, at most STEP).
        let deadline = Instant::now() + STEP;
        while lookups() == before {
            assert!(Instant::now() < deadline, "{dns}: no lookup was tried");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    gateway.stop().await;
}

/// A gateway whose upstream name comes to resolve to another address (a
/// service moved, a blue/green switch by DNS) sends its requests there
/// within about 15 s, even on connections it keeps busy: a kept connection
/// to an address no lookup has returned for 10 s is closed, not reused.
/// Before, a client that kept sending held its first connection, and the
/// old address, for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kept_upstream_connections_follow_the_name_to_its_new_address() {
    let dir = TempDir::new("moving-dns");
    let control = dir.path().join("dns");
    std::fs::write(&control, "127.0.0.1").expect("the DNS control file");
    let old = TestUpstream::start().await;
    let new = TestUpstream::start_at(&format!("127.0.0.2:{}", old.addr.port())).await;
    let Some(gateway) = gateway_with_shim_dns(
        dir.path(),
        old.addr.port(),
        &["--workers", "1"],
        &[("CONTROL", text(&control))],
    )
    .await
    else {
        return;
    };
    let mut client = Client::connect(gateway.addr).await;
    let reply = client.get("/v1/models").await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
    assert_eq!(old.seen().len(), 1);

    std::fs::write(&control, "127.0.0.2").expect("the DNS control file");
    // Requests one after another (the gateway's upstream connection never
    // idles) until one reaches the new address, polled for at most 30 s.
    let deadline = Instant::now() + Duration::from_secs(30);
    while new.seen().is_empty() {
        assert!(
            Instant::now() < deadline,
            "still on the old address after {} requests",
            old.seen().len()
        );
        let reply = client.get("/v1/models").await;
        assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let on_old = old.seen().len();
    for _ in 0..20 {
        let reply = client.get("/v1/models").await;
        assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
    }
    assert_eq!(
        old.seen().len(),
        on_old,
        "a request went to the old address"
    );
    assert_eq!(new.seen().len(), 21);
    gateway.stop().await;
}

/// An upstream that takes the request and never answers costs the client
/// a 504 after --upstream-response-timeout-ms, not a request that hangs;
/// a response that starts in time streams on for as long as it lasts. The
/// warning names the address that never answered, where it said `none
/// connected`, as if it had never been reached.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_that_never_answers_gets_a_504_after_the_response_timeout() {
    let upstream = TestUpstream::start().await;
    let gateway = Gateway::start(&[
        "--upstream",
        &upstream.url(),
        "--upstream-response-timeout-ms",
        "1000",
    ])
    .await;

    let started = Instant::now();
    let reply = tokio::spawn(bounded(
        "a request to an upstream that never answers",
        Duration::from_secs(20),
        get(gateway.addr, "/hold"),
    ));
    bounded(
        "the request reaching the upstream",
        STEP,
        upstream.state.held.notified(),
    )
    .await;
    let reply = reply.await.expect("the request task");
    assert!(started.elapsed() >= Duration::from_millis(1000));
    assert_eq!(reply.status, StatusCode::GATEWAY_TIMEOUT);
    let message = assert_openai_error(&reply.json(), "upstream_timeout", "server_error");
    assert!(
        message.contains("1000 ms") && message.contains("--upstream-response-timeout-ms"),
        "{message}"
    );
    let metrics = gateway.metrics().await;
    assert_eq!(upstream_errors(&metrics, Some("timed_out")), 1.0);
    assert_eq!(upstream_errors(&metrics, None), 1.0);
    wait_for_a_failure_naming(&gateway, upstream.addr).await;

    // The timeout is for the response headers only.
    let mut client = Client::connect(gateway.addr).await;
    let request = client
        .builder(Method::GET, "/sse")
        .body(Full::new(Bytes::new()))
        .expect("a request");
    let mut response = client.send_streaming(request).await;
    assert_eq!(response.status(), StatusCode::OK);
    let first = bounded("the first event", STEP, response.body_mut().frame()).await;
    assert!(first.is_some());
    // The time under test: the stream outlives the response timeout.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let rest = release_the_rest_of_the_events(&upstream.state, response.into_body()).await;
    assert!(
        String::from_utf8_lossy(&rest).contains("[DONE]"),
        "{rest:?}"
    );
}

/// An upstream that stops sending partway through a response body is cut
/// off after --upstream-read-timeout-ms: the client's body ends with an
/// error instead of never, and the cut-off is counted and logged. A pause
/// shorter than the timeout is not cut off.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_that_stops_mid_body_is_cut_off_after_the_read_timeout() {
    let upstream = TestUpstream::start().await;
    let gateway = Gateway::start(&[
        "--upstream",
        &upstream.url(),
        "--upstream-read-timeout-ms",
        "2000",
    ])
    .await;
    let mut client = Client::connect(gateway.addr).await;
    let sse = |client: &Client| {
        client
            .builder(Method::GET, "/sse")
            .body(Full::new(Bytes::new()))
            .expect("a request")
    };

    let mut response = client.send_streaming(sse(&client)).await;
    let first = bounded("the first event", STEP, response.body_mut().frame()).await;
    assert!(first.is_some());
    // The time under test: the upstream pauses, for a fifth of the timeout
    // (the rest is room for a busy machine).
    tokio::time::sleep(Duration::from_millis(400)).await;
    let rest = release_the_rest_of_the_events(&upstream.state, response.into_body()).await;
    assert!(
        String::from_utf8_lossy(&rest).contains("[DONE]"),
        "{rest:?}"
    );

    // Taken before the request: the gateway's timer starts when it has
    // forwarded the first event, which is after this and before the
    // client reads that event.
    let paused = Instant::now();
    let mut response = client.send_streaming(sse(&client)).await;
    let first = bounded("the first event", STEP, response.body_mut().frame()).await;
    assert!(first.is_some());
    let rest = bounded(
        "the stream to be cut off",
        STEP,
        response.into_body().collect(),
    )
    .await;
    assert!(rest.is_err(), "the body ended cleanly: {rest:?}");
    assert!(
        paused.elapsed() >= Duration::from_millis(2000),
        "{:?}",
        paused.elapsed()
    );
    gateway.wait_log("cut off a response").await;
    let log = gateway.stderr_text();
    let cut_off = log.lines().find(|l| l.contains("cut off a response"));
    let cut_off = cut_off.expect("logged");
    assert!(
        cut_off.contains("2000 ms (--upstream-read-timeout-ms)"),
        "{cut_off}"
    );
    assert!(cut_off.contains("/sse"), "names the path: {cut_off}");
    let metrics = gateway.metrics().await;
    assert_eq!(metric(&metrics, "snowgate_upstream_cut_offs_total"), 1.0);
    assert_eq!(upstream_errors(&metrics, None), 0.0);
}

/// `--max-upstream-requests` bounds the requests in flight to the
/// upstream: with 1, while one is held, another that finds no turn within
/// `--upstream-connect-timeout-ms` gets 503 `upstream_busy` with
/// `Retry-After` and never reaches the upstream; one that is waiting when
/// the held response ends goes next; and the gauges show it all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_beyond_max_upstream_requests_wait_their_turn_or_get_503() {
    let upstream = TestUpstream::start().await;
    let gateway = Gateway::start(&[
        "--upstream",
        &upstream.url(),
        "--max-upstream-requests",
        "1",
        "--upstream-connect-timeout-ms",
        "5000",
    ])
    .await;
    let addr = gateway.addr;
    let held = tokio::spawn(post_json(addr, "/hold/v1/completions", CONTEXT_ONLY));
    bounded(
        "the held request to reach the upstream",
        STEP,
        upstream.state.held.notified(),
    )
    .await;

    let busy = post_json(addr, "/v1/completions", CONTEXT_ONLY).await;
    assert_eq!(
        busy.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{}",
        busy.text()
    );
    assert_eq!(busy.header("retry-after"), Some("1"));
    let message = assert_openai_error(&busy.json(), "upstream_busy", "server_error");
    assert!(
        message.contains("--max-upstream-requests") && message.contains("5000 ms"),
        "{message}"
    );

    let waiting = tokio::spawn(post_json(addr, "/v1/completions", CONTEXT_ONLY));
    let metrics = gateway
        .wait_metric("snowgate_upstream_requests_waiting", 1.0)
        .await;
    assert_eq!(
        metric(&metrics, "snowgate_upstream_requests_in_flight"),
        1.0
    );
    assert_eq!(metric(&metrics, "snowgate_upstream_requests_max"), 1.0);
    assert_eq!(metric(&metrics, "snowgate_upstream_busy_total"), 1.0);
    upstream.state.release.notify_one();
    let held = bounded("the held request", STEP, held)
        .await
        .expect("joined");
    assert_eq!(held.status, StatusCode::OK, "{}", held.text());
    let waited = bounded("the waiting request", STEP, waiting)
        .await
        .expect("joined");
    assert_eq!(waited.status, StatusCode::OK, "{}", waited.text());
    // The refused request never reached the upstream.
    assert_eq!(upstream.seen().len(), 2);
    gateway
        .wait_metric("snowgate_upstream_requests_in_flight", 0.0)
        .await;
}

/// An HTTP/1 client that goes away while its request waits for a turn to
/// the upstream (`--max-upstream-requests`) gives its place up at once: its
/// body streams through, so nothing reads the connection while it waits,
/// and the gateway watches the socket for the hang-up. The request is
/// counted as abandoned, logged as 499 and never reaches the upstream;
/// without the watch it would wait out the two-minute connect timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_gone_while_waiting_for_an_upstream_turn_leaves_the_line() {
    let upstream = TestUpstream::start().await;
    let gateway = Gateway::start_logging(
        &[
            "--upstream",
            &upstream.url(),
            "--max-upstream-requests",
            "1",
            "--upstream-connect-timeout-ms",
            "120000",
        ],
        "info,snowgate::access=debug",
    )
    .await;
    let held = tokio::spawn(post_json(
        gateway.addr,
        "/hold/v1/completions",
        CONTEXT_ONLY,
    ));
    bounded(
        "the held request to reach the upstream",
        STEP,
        upstream.state.held.notified(),
    )
    .await;

    // Not JSON, so not read for the plugin: it streams through once its
    // turn comes. hyper reads ahead one piece of a body nobody reads yet,
    // and watches a connection itself once the whole body is read; a body
    // larger than that piece is what leaves the client unwatched. The part
    // sent fits the socket buffers, so the client's close is not queued
    // behind unsent bytes.
    let mut waiting = TcpStream::connect(gateway.addr).await.expect("connect");
    waiting
        .write_all(
            b"POST /v1/upload HTTP/1.1\r\nHost: gw\r\nContent-Type: text/plain\r\n\
              Content-Length: 4194304\r\n\r\n",
        )
        .await
        .expect("the head");
    waiting
        .write_all(&vec![b'x'; 64 << 10])
        .await
        .expect("part of the body");
    gateway
        .wait_metric("snowgate_upstream_requests_waiting", 1.0)
        .await;
    drop(waiting);
    gateway
        .wait_metric("snowgate_upstream_requests_waiting", 0.0)
        .await;
    gateway
        .wait_log_until("a 499 line for the request that waited", |log| {
            log.lines()
                .any(|l| l.contains("path=\"/v1/upload\"") && l.contains("status=499"))
        })
        .await;
    let metrics = gateway
        .wait_metric(r#"snowgate_requests_total{outcome="abandoned"}"#, 1.0)
        .await;
    assert_eq!(
        metric(&metrics, "snowgate_upstream_requests_in_flight"),
        1.0,
        "the held request keeps its turn: {metrics}"
    );
    assert_eq!(metric(&metrics, "snowgate_upstream_busy_total"), 0.0);

    upstream.state.release.notify_one();
    let held = bounded("the held request", STEP, held)
        .await
        .expect("joined");
    assert_eq!(held.status, StatusCode::OK, "{}", held.text());
    let seen = upstream.seen();
    assert_eq!(seen.len(), 1, "only the held request: {seen:#?}");
}

/// An upstream whose connection fails within a response body (a worker
/// that crashed mid-stream): the client sees the response end short, and
/// the gateway logs it as a warning naming the path and counts it as a
/// cut-off, where it used to leave no trace at its default log level. The
/// line names the path without its query, which may hold what a client
/// meant to keep to itself (a key in `?api_key=`): only the opt-in debug
/// access log shows it. It names the address that failed, of those the
/// upstream's name resolves to (here `localhost`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_that_fails_mid_body_is_logged_and_counted() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind a raw upstream");
    let address = listener.local_addr().expect("its address");
    let url = format!("http://localhost:{}", address.port());
    let upstream = tokio::spawn(async move {
        use tokio::io::AsyncWriteExt as _;
        let (mut stream, _) = listener.accept().await.expect("the gateway connects");
        read_request_head(&mut stream).await;
        // A promised 100 bytes, then 10 of them, then the connection ends.
        stream
            .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\ndata: one\n")
            .await
            .expect("writing the first part");
    });
    let gateway = Gateway::start(&["--upstream", &url]).await;
    let mut client = Client::connect(gateway.addr).await;
    let request = client
        .builder(Method::GET, "/v1/stream?api_key=sk-secret")
        .body(Full::new(Bytes::new()))
        .expect("a request");
    let response = client.send_streaming(request).await;
    assert_eq!(response.status(), StatusCode::OK);
    bounded("the raw upstream", STEP, upstream)
        .await
        .expect("the raw upstream task");
    let rest = bounded("the body to end", STEP, response.into_body().collect()).await;
    assert!(rest.is_err(), "the body ended cleanly: {rest:?}");
    gateway
        .wait_log("cut off a response: its upstream failed within the body")
        .await;
    let log = gateway.stderr_text();
    let line = log
        .lines()
        .find(|l| l.contains("its upstream failed within the body"))
        .expect("logged");
    assert!(line.contains("WARN"), "{line}");
    assert!(line.contains("/v1/stream"), "names the path: {line}");
    assert!(
        line.contains(&format!("address={address}")),
        "names the address: {line}"
    );
    assert!(!log.contains("sk-secret"), "the query is logged: {log}");
    let metrics = gateway.metrics().await;
    assert_eq!(metric(&metrics, "snowgate_upstream_cut_offs_total"), 1.0);
    assert_eq!(upstream_errors(&metrics, None), 0.0);
}

/// An upstream response with both `Transfer-Encoding: chunked` and a
/// `Content-Length` is chunked (RFC 9112 section 6.3): the client gets the
/// whole body, not the first `Content-Length` bytes of it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chunked_response_with_a_stale_content_length_reaches_the_client_whole() {
    let upstream = RawUpstream::start(
        b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nTransfer-Encoding: chunked\r\n\
          Content-Length: 3\r\n\r\n5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n",
    )
    .await;
    let gateway = Gateway::start(&["--upstream", &upstream.url()]).await;
    let raw = raw_exchange(
        gateway.addr,
        b"GET /x HTTP/1.1\r\nHost: gateway.example\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert_eq!(raw.status, 200);
    assert_eq!(raw.body, b"hello world", "{:?}", raw.headers);
    assert_eq!(raw.header("content-length"), None, "{:?}", raw.headers);
}

/// An upstream that answers 101 Switching Protocols to a request that asked
/// for no upgrade (the gateway forwards none) is failing: the client gets
/// 502, and its connection serves the next request. The 502 says not to
/// retry, as the upstream would answer so again; one for a connection
/// closed before any answer does not. The warning names the address that
/// answered so, where a 101 was logged as `none connected`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unasked_101_from_the_upstream_is_a_502() {
    let closes = RawUpstream::start(b"").await;
    let gateway = Gateway::start(&["--upstream", &closes.url()]).await;
    let reply = get(gateway.addr, "/v1/models").await;
    assert_eq!(reply.status, StatusCode::BAD_GATEWAY, "{}", reply.text());
    assert_openai_error(&reply.json(), "upstream_failed", "server_error");
    assert_eq!(reply.header("x-should-retry"), None);

    let upstream = RawUpstream::start(
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n",
    )
    .await;
    let gateway = Gateway::start(&["--upstream", &upstream.url()]).await;
    let mut client = Client::connect(gateway.addr).await;
    for _ in 0..2 {
        let reply = client.get("/socket").await;
        assert_eq!(reply.status, StatusCode::BAD_GATEWAY, "{}", reply.text());
        let message = assert_openai_error(&reply.json(), "upstream_failed", "server_error");
        assert!(message.contains("101 Switching Protocols"), "{message}");
        // It would answer so again: OpenAI's clients are told not to retry.
        assert_eq!(reply.header("x-should-retry"), Some("false"));
    }
    // A 101 has no body: the warning names the address all the same.
    wait_for_a_failure_naming(&gateway, upstream.addr).await;
}

/// Waits until `gateway` has logged an upstream failure whose `address` is
/// `address`.
async fn wait_for_a_failure_naming(gateway: &Gateway, address: SocketAddr) {
    let named = format!("address={address}");
    gateway
        .wait_log_until("a warning naming the address", move |log| {
            log.lines()
                .any(|l| l.contains("upstream request failed") && l.contains(&named))
        })
        .await;
}

/// An upstream response head over 64 KiB is a 502 naming the limit, as
/// nginx's "upstream sent too big header", not passed on to a client that
/// may refuse it; one just under passes whole. The body is not limited.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_response_head_over_64_kib_is_a_502() {
    fn response_with_header_of(bytes: usize) -> &'static [u8] {
        let mut response = format!(
            "HTTP/1.1 200 OK\r\nContent-Length: 200000\r\nX-Big: {}\r\n\r\n",
            "b".repeat(bytes)
        )
        .into_bytes();
        response.extend_from_slice(&[b'.'; 200_000]);
        response.leak()
    }
    let fits = RawUpstream::start(response_with_header_of(60 << 10)).await;
    let gateway = Gateway::start(&["--upstream", &fits.url()]).await;
    let reply = get(gateway.addr, "/v1/models").await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
    assert_eq!(reply.header("x-big").map(str::len), Some(60 << 10));
    assert_eq!(reply.body.len(), 200_000);

    let too_big = RawUpstream::start(response_with_header_of(100 << 10)).await;
    let gateway = Gateway::start(&["--upstream", &too_big.url()]).await;
    let mut client = Client::connect(gateway.addr).await;
    for _ in 0..2 {
        let reply = client.get("/v1/models").await;
        assert_eq!(reply.status, StatusCode::BAD_GATEWAY, "{}", reply.text());
        let message = assert_openai_error(&reply.json(), "upstream_failed", "server_error");
        assert!(message.contains("response head over 64 KiB"), "{message}");
        assert_eq!(reply.header("x-should-retry"), Some("false"));
    }
}

/// An upstream response head hyper cannot read is a 502 that says so, and
/// says not to retry: the upstream would answer so again (before, it was
/// the 502 of a connection lost, which OpenAI's clients retry twice, each a
/// whole generation for a non-streaming completion). The warning names the
/// address that answered so, of those the upstream's name resolves to
/// (here `localhost`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_response_head_that_is_not_http_is_a_502_not_to_retry() {
    for response in [
        &b"HTTP/1.1 OK\r\nContent-Length: 2\r\n\r\nok"[..],
        &b"HTTP/1.1 200 OK\r\nbad header line\r\nContent-Length: 2\r\n\r\nok"[..],
        &b"HTTP/1.1 200 OK\r\nX-A: 1\r\n folded\r\nContent-Length: 2\r\n\r\nok"[..],
        &b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\nok"[..],
    ] {
        let upstream = RawUpstream::start(response).await;
        let by_name = format!("http://localhost:{}", upstream.addr.port());
        let gateway = Gateway::start(&["--upstream", &by_name]).await;
        let mut client = Client::connect(gateway.addr).await;
        for _ in 0..2 {
            let reply = client.get("/v1/models").await;
            let shown = String::from_utf8_lossy(response);
            assert_eq!(
                reply.status,
                StatusCode::BAD_GATEWAY,
                "{shown}: {}",
                reply.text()
            );
            let message = assert_openai_error(&reply.json(), "upstream_failed", "server_error");
            assert!(
                message.contains("response head that is not valid HTTP/1.1"),
                "{shown}: {message}"
            );
            assert_eq!(reply.header("x-should-retry"), Some("false"), "{shown}");
        }
        wait_for_a_failure_naming(&gateway, upstream.addr).await;
    }
}

/// An upstream response in a transfer coding other than chunked (`gzip,
/// chunked`) is a 502: hyper takes it out of its chunks only, and passed on
/// it would reach the client as gzip bytes with nothing saying so. So is
/// one chunked twice, or whose coding list ends in an empty element (hyper
/// reads that one to the connection's end), whose chunks would reach the
/// client as the body.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_transfer_coding_other_than_chunked_is_a_502() {
    for (response, named) in [
        (
            &b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nTransfer-Encoding: gzip, chunked\r\n\r\n\
               5\r\nhello\r\n0\r\n\r\n"[..],
            "\"gzip, chunked\"",
        ),
        (
            &b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nTransfer-Encoding: chunked\r\n\
               Transfer-Encoding: chunked\r\n\r\nf\r\n5\r\nhello\r\n0\r\n\r\n\r\n0\r\n\r\n"[..],
            "\"chunked, chunked\"",
        ),
        // Ending in an empty element, which hyper takes as not chunked.
        (
            &b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nTransfer-Encoding: chunked, \r\n\r\n\
               5\r\nhello\r\n0\r\n\r\n"[..],
            // hyper trims the value's trailing space.
            "\"chunked,\"",
        ),
    ] {
        let upstream = RawUpstream::start(response).await;
        let gateway = Gateway::start(&["--upstream", &upstream.url()]).await;
        let reply = get(gateway.addr, "/coded").await;
        assert_eq!(reply.status, StatusCode::BAD_GATEWAY, "{}", reply.text());
        let message = assert_openai_error(&reply.json(), "upstream_failed", "server_error");
        assert!(message.contains(named), "{message}");
        assert_eq!(reply.header("x-should-retry"), Some("false"));
    }
}

/// `TE` is a request header: one an upstream sends back is not passed on
/// to the client, with the other hop-by-hop headers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstreams_te_header_does_not_reach_the_client() {
    let upstream = RawUpstream::start(
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nTE: trailers\r\nKeep-Alive: timeout=5\r\n\r\nok",
    )
    .await;
    let gateway = Gateway::start(&["--upstream", &upstream.url()]).await;
    let reply = get(gateway.addr, "/hop").await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
    assert_eq!(reply.text(), "ok");
    assert_eq!(reply.header("te"), None);
    assert_eq!(reply.header("keep-alive"), None);
}

/// A `Content-Length` sent more than once with one value (`2, 2`, or in
/// two lines), which hyper accepts from an upstream and h2 from an HTTP/2
/// client, goes on as one value: passed on as it came, clients that refuse
/// such a list (llhttp, h11, every HTTP/2 stack) would fail the response.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_content_length_sent_more_than_once_goes_on_as_one_value() {
    let lengths = |headers: &[(String, String)]| -> Vec<String> {
        headers
            .iter()
            .filter(|(name, _)| name == "content-length")
            .map(|(_, value)| value.clone())
            .collect()
    };
    let upstream = RawUpstream::start(
        b"HTTP/1.1 200 OK\r\nContent-Length: 2, 2\r\nContent-Length: 2\r\n\r\nok",
    )
    .await;
    let gateway = Gateway::start(&["--upstream", &upstream.url()]).await;
    let raw = raw_exchange(
        gateway.addr,
        b"GET /twice HTTP/1.1\r\nHost: gw\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert_eq!(raw.status, 200, "{:?}", String::from_utf8_lossy(&raw.body));
    assert_eq!(lengths(&raw.headers), ["2"]);
    assert_eq!(raw.body, b"ok");

    // An HTTP/2 client's two `content-length` fields (hyper refuses them
    // from an HTTP/1 one).
    let upstream = TestUpstream::start().await;
    let gateway = Gateway::start(&["--upstream", &upstream.url()]).await;
    let mut sender = http2_to::<Full<Bytes>>(gateway.addr).await;
    let request = http::Request::post(format!("http://{}/upload", gateway.addr))
        .version(http::Version::HTTP_2)
        .header("content-type", "text/plain")
        .header("content-length", "3")
        .header("content-length", "3")
        .body(Full::new(Bytes::from_static(b"abc")))
        .unwrap();
    let response = bounded("an answer", STEP, sender.send_request(request))
        .await
        .expect("an answer");
    assert_eq!(response.status(), StatusCode::OK);
    let seen = upstream.only_seen();
    assert_eq!(seen.body, "abc");
    let seen_lengths: Vec<_> = seen.headers.get_all("content-length").iter().collect();
    assert_eq!(seen_lengths, ["3"]);
}

/// An upstream 204 with a `Content-Length` reaches an HTTP/2 client
/// without it, as it reaches HTTP/1 ones (RFC 9110 section 8.6).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_204_reaches_an_http2_client_without_a_content_length() {
    let upstream =
        RawUpstream::start(b"HTTP/1.1 204 No Content\r\nContent-Length: 5\r\n\r\n").await;
    let gateway = Gateway::start(&["--upstream", &upstream.url()]).await;
    let mut sender = http2_to::<Full<Bytes>>(gateway.addr).await;
    let request = http::Request::get(format!("http://{}/nothing", gateway.addr))
        .version(http::Version::HTTP_2)
        .body(Full::new(Bytes::new()))
        .unwrap();
    let response = sender.send_request(request).await.expect("an answer");
    assert_eq!(response.status(), StatusCode::NO_CONTENT);
    assert_eq!(response.headers().get("content-length"), None);
}

/// An HTTP/2 client's cookies, one field each, reach the HTTP/1.1
/// upstream as one `Cookie` line (RFC 9113 section 8.2.3).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http2_clients_cookies_reach_the_upstream_on_one_line() {
    let upstream = TestUpstream::start().await;
    let gateway = Gateway::start(&["--upstream", &upstream.url()]).await;
    let mut sender = http2_to::<Full<Bytes>>(gateway.addr).await;
    let request = http::Request::get(format!("http://{}/page", gateway.addr))
        .header("cookie", "a=1")
        .header("cookie", "b=2")
        .version(http::Version::HTTP_2)
        .body(Full::new(Bytes::new()))
        .unwrap();
    let response = sender.send_request(request).await.expect("an answer");
    assert_eq!(response.status(), StatusCode::OK);
    let seen = upstream.only_seen();
    let cookies: Vec<_> = seen.headers.get_all("cookie").iter().collect();
    assert_eq!(cookies, ["a=1; b=2"]);
}

/// Trailer fields the upstream sends after a chunked body reach a client
/// that accepts them (`TE: trailers`), with the `Trailer` header that
/// names them, and without the fields of the upstream's hop (which would
/// make an HTTP/2 client's stream malformed: its client saw it reset after
/// the whole body); the upstream is told the gateway accepts them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trailers_from_the_upstream_reach_a_client_that_accepts_them() {
    let upstream = RawUpstream::start(
        b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nTransfer-Encoding: chunked\r\n\
          Trailer: x-checksum, connection, keep-alive\r\n\r\n5\r\nhello\r\n0\r\n\
          x-checksum: abc123\r\nConnection: close\r\nKeep-Alive: timeout=5\r\n\r\n",
    )
    .await;
    let gateway = Gateway::start(&["--upstream", &upstream.url()]).await;
    let raw = raw_exchange(
        gateway.addr,
        b"GET /t HTTP/1.1\r\nHost: gateway.example\r\nTE: trailers\r\n\
          Connection: close, TE\r\n\r\n",
    )
    .await;
    assert_eq!(raw.status, 200);
    assert_eq!(raw.body, b"hello");
    assert_eq!(
        raw.header("trailer"),
        Some("x-checksum, connection, keep-alive"),
        "{:?}",
        raw.headers
    );
    assert_eq!(
        raw.trailers,
        [("x-checksum".to_string(), "abc123".to_string())]
    );
    let head = upstream.heads()[0].to_ascii_lowercase();
    assert!(head.contains("\r\nte: trailers\r\n"), "{head:?}");
    assert!(head.contains("\r\nconnection: te\r\n"), "{head:?}");

    // A client that did not ask for trailers gets none, and no `Trailer`
    // header announcing them.
    let raw = raw_exchange(
        gateway.addr,
        b"GET /t HTTP/1.1\r\nHost: gateway.example\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert_eq!(raw.status, 200);
    assert_eq!(raw.body, b"hello");
    assert_eq!(raw.header("trailer"), None, "{:?}", raw.headers);
    assert!(raw.trailers.is_empty(), "{:?}", raw.trailers);
}

/// An HTTP/1.0 client that asks for keep-alive, answered a body of no
/// known length (chunked from the upstream; HTTP/1.0 has no chunking), is
/// told the connection closes after it, as nginx tells it: hyper said
/// `keep-alive` and then closed, and a request pipelined behind was lost
/// without a word. One of known length keeps its connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http_1_0_client_is_told_when_a_body_of_unknown_length_ends_its_connection() {
    let upstream = RawUpstream::start(
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
    )
    .await;
    let gateway = Gateway::start(&["--upstream", &upstream.url()]).await;
    let raw = raw_exchange(
        gateway.addr,
        b"GET /v1/models HTTP/1.0\r\nConnection: keep-alive\r\n\r\n",
    )
    .await;
    assert_eq!(raw.status, 200);
    assert_eq!(raw.body, b"hello");
    assert_eq!(raw.header("connection"), Some("close"), "{:?}", raw.headers);

    // The gateway's own answers have a length: keep-alive stays.
    let raw = raw_exchange(
        gateway.addr,
        b"POST /v1/completions HTTP/1.0\r\nContent-Type: application/json\r\n\
          Content-Length: 5\r\nConnection: keep-alive\r\n\r\n{oops",
    )
    .await;
    assert_eq!(raw.status, 400);
    assert_eq!(
        raw.header("connection"),
        Some("keep-alive"),
        "{:?}",
        raw.headers
    );
}

/// An upstream that answers in HTTP/1.0 (Python's `http.server` by
/// default) does not turn the gateway's answers to HTTP/1.1 clients into
/// HTTP/1.0 ones, which would close their connections after every
/// response.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http_1_0_upstream_leaves_clients_on_keep_alive_http_1_1() {
    let upstream = RawUpstream::start(
        b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 2\r\n\r\nok",
    )
    .await;
    let gateway = Gateway::start(&["--upstream", &upstream.url()]).await;
    let mut client = Client::connect(gateway.addr).await;
    for _ in 0..2 {
        let request = client
            .builder(Method::GET, "/v1/models")
            .body(Full::new(Bytes::new()))
            .expect("request");
        // On one connection: the second would fail had the first closed it.
        let response = client.send_streaming(request).await;
        assert_eq!(response.version(), http::Version::HTTP_11);
        assert_eq!(response.status(), StatusCode::OK);
        assert_eq!(response.headers().get("connection"), None);
        let body = response
            .into_body()
            .collect()
            .await
            .expect("body")
            .to_bytes();
        assert_eq!(body, "ok");
    }
    assert_eq!(upstream.heads().len(), 2);
}

/// The gateway is a reverse proxy: `CONNECT` is refused with 405 and an
/// `Allow` header, before its body is read or reaches the plugin, and is
/// never sent on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_is_refused_with_405() {
    let upstream = RawUpstream::start(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n").await;
    let gateway = Gateway::start(&["--upstream", &upstream.url()]).await;
    let json = format!(
        "CONNECT upstream.example:443 HTTP/1.1\r\nHost: upstream.example:443\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{CONTEXT_ONLY}",
        CONTEXT_ONLY.len()
    );
    for request in [
        "CONNECT upstream.example:443 HTTP/1.1\r\nHost: upstream.example:443\r\n\r\n",
        // In any case, as an upstream reading methods without case would.
        "connect upstream.example:443 HTTP/1.1\r\nHost: upstream.example:443\r\n\r\n",
        json.as_str(),
    ] {
        let raw = raw_exchange(gateway.addr, request.as_bytes()).await;
        assert_eq!(raw.status, 405);
        assert!(raw
            .header("allow")
            .is_some_and(|allow| allow.contains("POST")));
        let body: Value = serde_json::from_slice(&raw.body).expect("a JSON error");
        let message = assert_openai_error(&body, "method_not_allowed", "invalid_request_error");
        assert!(message.contains("CONNECT"), "{message}");
    }
    assert!(upstream.heads().is_empty(), "{:?}", upstream.heads());
    let metrics = gateway.metrics().await;
    assert_eq!(requests_with_outcome(&metrics, "client_error"), 3.0);
    assert_eq!(metric(&metrics, "snowgate_plugin_call_seconds_count"), 0.0);
}

/// A request streaming through to the upstream is counted even when its
/// client goes away before the answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pass_through_request_its_client_abandons_is_still_counted() {
    let upstream = TestUpstream::start().await;
    let gateway = Gateway::start(&["--upstream", &upstream.url()]).await;
    drop(held_request(&gateway, &upstream).await);
    let counted = r#"snowgate_requests_total{outcome="passed_through"}"#;
    bounded("the abandoned request to be counted", STEP, async {
        while metric(&gateway.metrics().await, counted) < 1.0 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    upstream.state.release.notify_one();
}

/// Neither the plugin nor the server behind the gateway reads a compressed
/// request body, which may hold a context-only request: one that would go
/// to the plugin is refused with 415 naming the coding. Bodies that never
/// go to the plugin pass with theirs; `identity` is no coding.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_compressed_body_that_may_be_json_is_refused_with_415_naming_the_coding() {
    let upstream = TestUpstream::start().await;
    let gateway = Gateway::start(&["--upstream", &upstream.url()]).await;
    for (headers, coding) in [
        (
            "Content-Type: application/json\r\nContent-Encoding: gzip\r\n",
            "gzip",
        ),
        ("Content-Encoding: br\r\n", "br"),
        // The form type curl sends: its body is not looked into.
        (
            "Content-Type: application/x-www-form-urlencoded\r\nContent-Encoding: gzip\r\n",
            "gzip",
        ),
        // MessagePack, whatever the content type says.
        (
            "Content-Type: text/plain\r\nX-TRTLLM-Msgpack: 1\r\nContent-Encoding: gzip\r\n",
            "gzip",
        ),
        (
            "Content-Type: application/json\r\nContent-Encoding: identity, deflate\r\n",
            "identity, deflate",
        ),
    ] {
        let raw = raw_post(
            gateway.addr,
            "/v1/completions",
            headers.as_bytes(),
            b"\x1f\x8b\x08\x00compressed",
        )
        .await;
        assert_eq!(raw.status, 415, "{headers:?}");
        let body: Value = serde_json::from_slice(&raw.body).expect("a JSON error");
        let message = assert_openai_error(
            &body,
            "unsupported_content_encoding",
            "invalid_request_error",
        );
        assert!(message.contains(coding), "{message}");
    }
    assert!(upstream.seen().is_empty());

    let plain = raw_post(
        gateway.addr,
        "/upload",
        b"Content-Type: text/plain\r\nContent-Encoding: gzip\r\n",
        b"\x1f\x8b\x08\x00compressed",
    )
    .await;
    assert_eq!(plain.status, 200);
    let identity = raw_post(
        gateway.addr,
        "/v1/completions",
        b"Content-Type: application/json\r\nContent-Encoding: identity\r\n",
        CONTEXT_ONLY.as_bytes(),
    )
    .await;
    assert_eq!(identity.status, 200);
    let seen = upstream.seen();
    assert_eq!(seen.len(), 2);
    assert_eq!(seen[0].body.as_ref(), b"\x1f\x8b\x08\x00compressed");
    stamped_id(&seen[1].body);
}

/// A client that breaks off a body streaming through to the upstream (bad
/// chunking here) gets 400 naming the problem: its error, not the
/// upstream's, in the answer, the log level and the counters.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pass_through_body_the_client_breaks_off_is_a_400_not_an_upstream_failure() {
    let upstream = TestUpstream::start().await;
    let gateway = Gateway::start(&["--upstream", &upstream.url()]).await;
    let raw = raw_exchange(
        gateway.addr,
        b"POST /upload HTTP/1.1\r\nHost: gateway.example\r\nContent-Type: text/plain\r\n\
          Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\nzz\r\n",
    )
    .await;
    assert_eq!(raw.status, 400);
    let body: Value = serde_json::from_slice(&raw.body).expect("a JSON error");
    let message = assert_openai_error(&body, "body_read_error", "invalid_request_error");
    assert!(
        message.contains("request body could not be read"),
        "{message}"
    );
    assert!(message.contains("chunk size"), "{message}");

    // One read for the plugin says what was wrong the same way (it said
    // only hyper's "error reading a body from connection").
    let raw = raw_exchange(
        gateway.addr,
        b"POST /v1/completions HTTP/1.1\r\nHost: gateway.example\r\n\
          Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\nzz\r\n",
    )
    .await;
    assert_eq!(raw.status, 400);
    let body: Value = serde_json::from_slice(&raw.body).expect("a JSON error");
    let message = assert_openai_error(&body, "body_read_error", "invalid_request_error");
    assert!(message.contains("chunk size"), "{message}");
    let metrics = gateway.metrics().await;
    assert_eq!(requests_with_outcome(&metrics, "client_error"), 2.0);
    assert_eq!(requests_with_outcome(&metrics, "passed_through"), 0.0);
    assert_eq!(upstream_errors(&metrics, None), 0.0);
    assert!(
        !gateway.stderr_text().contains("upstream request failed"),
        "{}",
        gateway.stderr_text()
    );
}

/// A JSON body reaches the plugin however the client frames or labels it:
/// chunked with no content type (as Python `requests` sends a generator
/// body), or with `Content-Type` and `Content-Length` named in
/// `Connection`, which may not remove them. A `Trailer` header is dropped
/// with the trailers when the body is forwarded from memory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_json_body_reaches_the_plugin_however_it_is_framed_or_labelled() {
    let upstream = TestUpstream::start().await;
    let gateway = Gateway::start(&["--upstream", &upstream.url()]).await;

    let mut untyped_chunked = b"POST /v1/completions HTTP/1.1\r\nHost: gateway.example\r\n\
                               Transfer-Encoding: chunked\r\nTrailer: x-sum\r\n\
                               Connection: close\r\n\r\n"
        .to_vec();
    untyped_chunked.extend_from_slice(&chunked(&[CONTEXT_ONLY.as_bytes()]));
    let raw = raw_exchange(gateway.addr, &untyped_chunked).await;
    assert_eq!(raw.status, 200, "{:?}", String::from_utf8_lossy(&raw.body));
    let seen = upstream.only_seen();
    assert_fresh_v1_id(stamped_id(&seen.body));
    assert_eq!(seen.header("trailer"), None, "{:?}", seen.headers);

    let named = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: gateway.example\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\
         Connection: close, content-type, content-length, host\r\n\r\n{CONTEXT_ONLY}",
        CONTEXT_ONLY.len()
    );
    let raw = raw_exchange(gateway.addr, named.as_bytes()).await;
    assert_eq!(raw.status, 200, "{:?}", String::from_utf8_lossy(&raw.body));
    let seen = upstream.seen().pop().expect("a second request");
    assert_fresh_v1_id(stamped_id(&seen.body));
    assert_eq!(seen.header("content-type"), Some("application/json"));
}

/// A body without a JSON content type (none, or the form type `curl -d`
/// sends) goes to the plugin when the server behind could read it as JSON:
/// it opens like JSON (stamped), or it starts with a byte order mark or is
/// UTF-16, which Python's `json.loads` reads and the plugin refuses. Other
/// bodies pass through untouched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn loosely_typed_bodies_reach_the_plugin_when_the_server_could_read_them_as_json() {
    let upstream = TestUpstream::start().await;
    let gateway = Gateway::start(&["--upstream", &upstream.url()]).await;
    let send = |content_type: &str, body: Vec<u8>| {
        let (addr, headers) = (gateway.addr, content_type.as_bytes().to_vec());
        async move { raw_post(addr, "/v1/completions", &headers, &body).await }
    };
    let form = "Content-Type: application/x-www-form-urlencoded\r\n";
    let utf16be: Vec<u8> = CONTEXT_ONLY.bytes().flat_map(|b| [0, b]).collect();
    let with_bom = [&b"\xEF\xBB\xBF"[..], CONTEXT_ONLY.as_bytes()].concat();

    for content_type in ["", form] {
        let raw = send(content_type, CONTEXT_ONLY.as_bytes().to_vec()).await;
        assert_eq!(raw.status, 200, "{content_type:?}");
        let seen = upstream.seen().pop().expect("forwarded");
        assert_fresh_v1_id(stamped_id(&seen.body));

        for (body, problem) in [
            (with_bom.clone(), "byte order mark"),
            (utf16be.clone(), "not valid JSON"),
        ] {
            let before = upstream.seen().len();
            let raw = send(content_type, body).await;
            assert_eq!(raw.status, 400, "{content_type:?} {problem}");
            let message = raw.json()["error"]["message"]
                .as_str()
                .unwrap_or_default()
                .to_string();
            assert!(message.contains(problem), "{message}");
            assert_eq!(upstream.seen().len(), before, "not forwarded");
        }

        let raw = send(content_type, b"prompt=hello&max_tokens=16".to_vec()).await;
        assert_eq!(raw.status, 200);
        let seen = upstream.seen().pop().expect("forwarded");
        assert_eq!(seen.body, "prompt=hello&max_tokens=16");
    }
}

/// Labels the server behind reads differently from their face value still
/// send the body to the plugin: an empty `Content-Type` (FastAPI parses
/// the body as JSON, as with none), a JSON type with a non-ASCII byte in a
/// parameter (Python reads header bytes as Latin-1), and `X-TRTLLM-Msgpack`
/// on a body labelled anything (TensorRT-LLM decodes it as MessagePack),
/// which the plugin stamps in MessagePack.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn labels_the_server_reads_as_json_or_msgpack_send_the_body_to_the_plugin() {
    let upstream = TestUpstream::start().await;
    let gateway = Gateway::start(&["--upstream", &upstream.url()]).await;
    let send = |headers: &'static [u8], body: &'static [u8]| {
        raw_post(gateway.addr, "/v1/completions", headers, body)
    };

    for headers in [
        &b"Content-Type:\r\n"[..],
        b"Content-Type: application/json; x=\xff\r\n",
    ] {
        let raw = send(headers, CONTEXT_ONLY.as_bytes()).await;
        assert_eq!(raw.status, 200, "{:?}", String::from_utf8_lossy(headers));
        let seen = upstream.seen().pop().expect("forwarded");
        assert_fresh_v1_id(stamped_id(&seen.body));
    }

    // {"model":"m","prompt":"hi","disaggregated_params":{"request_type":"context_only"}}
    let msgpack = b"\x83\xa5model\xa1m\xa6prompt\xa2hi\xb4disaggregated_params\
                    \x81\xacrequest_type\xaccontext_only";
    for headers in [
        &b"X-TRTLLM-Msgpack: 1\r\n"[..],
        b"X-TRTLLM-Msgpack: 1\r\nContent-Type: application/json; x=\xff\r\n",
        b"X-TRTLLM-Msgpack: 1\r\nContent-Type: text/plain\r\n",
    ] {
        let raw = send(headers, msgpack).await;
        assert_eq!(raw.status, 200, "{:?}", String::from_utf8_lossy(headers));
        let seen = upstream.seen().pop().expect("forwarded");
        let (body, id) = seen.body.split_at(seen.body.len() - 8);
        // The params map (the last 27 bytes) counts one pair more.
        let header = msgpack.len() - 27;
        assert_eq!(body[header], 0x82);
        assert_eq!(body[..header], msgpack[..header]);
        assert_eq!(body[header + 1..msgpack.len()], msgpack[header + 1..]);
        assert_eq!(body[msgpack.len()..], *b"\xb1disagg_request_id\xcf");
        assert_fresh_v1_id(u64::from_be_bytes(id.try_into().expect("8 bytes")));
    }
}

/// HTTP/2 clients (prior knowledge, as gRPC-style clients and some load
/// balancers speak it) get the same gateway: a JSON body streamed in two
/// DATA frames without a `content-length` is stamped, `te: trailers` (the
/// one connection header HTTP/2 allows) goes on as HTTP/1.1's
/// `TE: trailers` with `Connection: te`, and server-sent events stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http2_clients_are_stamped_and_streamed_like_http1_ones() {
    let upstream = TestUpstream::start().await;
    let gateway = Gateway::start(&["--upstream", &upstream.url()]).await;
    let mut sender = http2_to(gateway.addr).await;

    let (chunks, body) = tokio::sync::mpsc::channel(2);
    let request = http::Request::post(format!("http://{}/v1/completions", gateway.addr))
        .version(http::Version::HTTP_2)
        .header("content-type", "application/json")
        .header("te", "trailers")
        .body(ChannelBody(body).boxed())
        .expect("a request");
    let (head, tail) = CONTEXT_ONLY.split_at(CONTEXT_ONLY.len() / 2);
    chunks.send(Bytes::from(head)).await.expect("first frame");
    let response = tokio::spawn(sender.send_request(request));
    chunks.send(Bytes::from(tail)).await.expect("second frame");
    drop(chunks);
    let response = bounded("an HTTP/2 response", STEP, response)
        .await
        .expect("the request task")
        .expect("a response");
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(response.version(), http::Version::HTTP_2);
    let seen = upstream.only_seen();
    assert_eq!(
        seen.header("content-length"),
        Some(seen.body.len().to_string().as_str())
    );
    assert_fresh_v1_id(stamped_id(&seen.body));
    assert_eq!(seen.header("te"), Some("trailers"));
    assert_eq!(seen.header("connection"), Some("te"));

    let sse = http::Request::get(format!("http://{}/sse", gateway.addr))
        .version(http::Version::HTTP_2)
        .body(Full::new(Bytes::new()).boxed())
        .expect("a request");
    let mut response = bounded("an HTTP/2 event stream", STEP, sender.send_request(sse))
        .await
        .expect("a response");
    let first = bounded("the first event", STEP, response.body_mut().frame())
        .await
        .expect("a frame")
        .expect("no error")
        .into_data()
        .expect("data");
    assert_eq!(first, "data: event 1\n\n");
    let rest = release_the_rest_of_the_events(&upstream.state, response.into_body()).await;
    assert!(
        String::from_utf8_lossy(&rest).contains("[DONE]"),
        "{rest:?}"
    );
}

/// A GET with a chunked body (not JSON, so streamed through) reaches the
/// upstream with its body: hyper's client would send it without one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_get_with_a_chunked_body_keeps_its_body() {
    let upstream = TestUpstream::start().await;
    let gateway = Gateway::start(&["--upstream", &upstream.url()]).await;
    let mut request = b"GET /g HTTP/1.1\r\nHost: gateway.example\r\nContent-Type: text/plain\r\n\
                        Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
        .to_vec();
    request.extend_from_slice(&chunked(&[b"hel", b"lo"]));
    let raw = raw_exchange(gateway.addr, &request).await;
    assert_eq!(raw.status, 200, "{:?}", String::from_utf8_lossy(&raw.body));
    let seen = upstream.only_seen();
    assert_eq!(seen.method, Method::GET);
    assert_eq!(seen.body, "hello");
    assert_eq!(raw.body, b"hello", "the upstream echoed it back");
}

/// `X-Forwarded-For`: every line the client sent, then the client's
/// address; a client that names the header in `Connection` removes its
/// own lines, not the gateway's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn x_forwarded_for_keeps_every_line_and_always_ends_with_the_client() {
    let upstream = TestUpstream::start().await;
    let gateway = Gateway::start(&["--upstream", &upstream.url()]).await;
    for (headers, expected) in [
        (
            "X-Forwarded-For: 1.1.1.1\r\nX-Forwarded-For: 2.2.2.2, 3.3.3.3\r\n",
            "1.1.1.1, 2.2.2.2, 3.3.3.3, 127.0.0.1",
        ),
        (
            "Connection: X-Forwarded-For\r\nX-Forwarded-For: 1.1.1.1\r\n",
            "127.0.0.1",
        ),
        // A CGI-style upstream (WSGI, PHP) reads `X_Forwarded_For` as the
        // same header: it goes nowhere (before, it went on beside the
        // gateway's line).
        (
            "X-Forwarded-For: 1.1.1.1\r\nX_Forwarded_For: 6.6.6.6\r\n",
            "1.1.1.1, 127.0.0.1",
        ),
        ("", "127.0.0.1"),
    ] {
        let request = format!(
            "GET /xff HTTP/1.1\r\nHost: gateway.example\r\n{headers}Connection: close\r\n\r\n"
        );
        let raw = raw_exchange(gateway.addr, request.as_bytes()).await;
        assert_eq!(raw.status, 200);
        let seen = upstream.seen();
        let last = seen.last().expect("a request reached the upstream");
        let lines: Vec<&str> = last
            .headers
            .get_all("x-forwarded-for")
            .iter()
            .map(|v| v.to_str().expect("text"))
            .collect();
        assert_eq!(lines, [expected], "{headers:?}");
        assert!(!last.headers.contains_key("x_forwarded_for"), "{headers:?}");
    }
    // Other names with `_`, and framing under another spelling: the one
    // goes on, the other goes nowhere.
    let request = "POST /u HTTP/1.1\r\nHost: gateway.example\r\nContent-Type: text/plain\r\n\
                   X_Custom: kept\r\nTransfer_Encoding: chunked\r\nContent-Length: 2\r\n\
                   Connection: close\r\n\r\nok";
    let raw = raw_exchange(gateway.addr, request.as_bytes()).await;
    assert_eq!(raw.status, 200);
    let seen = upstream.seen();
    let last = seen.last().expect("a request reached the upstream");
    assert_eq!(last.header("x_custom"), Some("kept"));
    assert!(!last.headers.contains_key("transfer_encoding"));
    assert_eq!(&last.body[..], b"ok");
}

/// An upstream connection left idle for --upstream-idle-timeout-ms is
/// closed by the gateway, before an upstream with a short keep-alive
/// (uvicorn's is 5 s) can close it under a request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_upstream_connections_are_closed_after_the_idle_timeout() {
    let upstream = TestUpstream::start().await;
    let gateway = Gateway::start(&[
        "--upstream",
        &upstream.url(),
        "--upstream-idle-timeout-ms",
        "1000",
    ])
    .await;
    let closed = || {
        upstream
            .state
            .closed
            .load(std::sync::atomic::Ordering::SeqCst)
    };
    assert_eq!(get(gateway.addr, "/idle").await.status, StatusCode::OK);
    let answered = Instant::now();
    // With hyper's default of 90 s this would run into the bound.
    bounded(
        "the gateway closing its idle upstream connection",
        Duration::from_secs(10),
        upstream.state.closed_one.notified(),
    )
    .await;
    // Not closed at once: it went idle before the answer arrived here, so
    // half the timeout is a bound no slow machine can break.
    assert!(answered.elapsed() >= Duration::from_millis(500));
    assert_eq!(closed(), 1);
    // The next request opens a new connection and is answered.
    assert_eq!(get(gateway.addr, "/idle").await.status, StatusCode::OK);
}

/// Without --upstream the built-in echo answers with the request it got:
/// the stamped body, embedded as JSON.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn echoes_the_stamped_request_without_an_upstream() {
    let gateway = Gateway::start(&[]).await;
    assert!(
        gateway.ready_line.contains("upstream built-in echo"),
        "{}",
        gateway.ready_line
    );

    let reply = post_json(gateway.addr, "/v1/completions", CONTEXT_ONLY).await;
    assert_eq!(reply.status, StatusCode::OK);
    let echo = reply.json();
    assert_eq!(echo["method"], "POST");
    assert_eq!(echo["path"], "/v1/completions");
    let body = serde_json::to_vec(&echo["body"]).unwrap();
    let id = stamped_id(&body);
    assert_fresh_v1_id(id);
    assert_eq!(echo["body"]["prompt"], "Hello");
    let length: usize = echo["headers"]["content-length"]
        .as_str()
        .expect("content-length echoed")
        .parse()
        .unwrap();
    assert_eq!(
        length,
        CONTEXT_ONLY.len() + format!(",\"disagg_request_id\":{id}").len(),
        "the echo saw the rewritten length"
    );

    let reply = get(gateway.addr, "/v1/models").await;
    assert_eq!(reply.status, StatusCode::OK);
    assert_eq!(reply.json()["method"], "GET");
    assert_eq!(reply.json()["body"], Value::Null);
    assert_eq!(gateway.status().await["upstream"], "built-in echo");
}

/// The echo answers a streamed body's faults as an upstream's are answered,
/// and counts them so: 408 `body_timeout` for a body that stalls, 413
/// `body_too_large` for one past `--max-body-bytes`, counted as
/// `client_error` and `too_large`. (It answered 400 with a debug dump for
/// the first, and counted the second as passed through.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_echo_answers_a_streamed_bodys_faults_as_the_clients() {
    let gateway =
        Gateway::start(&["--body-read-timeout-ms", "500", "--max-body-bytes", "1024"]).await;
    let head = "POST /upload HTTP/1.1\r\nHost: gw\r\nContent-Type: text/plain\r\n\
                Transfer-Encoding: chunked\r\n\r\n";
    // A first chunk, then nothing.
    let stalled = format!("{head}3\r\nabc\r\n");
    let raw = bounded(
        "408 once the body stalls",
        Duration::from_secs(10),
        raw_exchange(gateway.addr, stalled.as_bytes()),
    )
    .await;
    assert_eq!(raw.status, 408, "{:?}", String::from_utf8_lossy(&raw.body));
    let message = assert_openai_error(&raw.json(), "body_timeout", "invalid_request_error");
    assert!(message.contains("could not be read"), "{message}");
    assert!(!message.contains("Failed("), "{message}");

    let filler = "a".repeat(600);
    let too_large = format!("{head}258\r\n{filler}\r\n258\r\n{filler}\r\n");
    let raw = bounded(
        "413 once the limit is passed",
        Duration::from_secs(10),
        raw_exchange(gateway.addr, too_large.as_bytes()),
    )
    .await;
    assert_eq!(raw.status, 413, "{:?}", String::from_utf8_lossy(&raw.body));
    assert_openai_error(&raw.json(), "body_too_large", "invalid_request_error");
    let metrics = gateway.metrics().await;
    assert_eq!(requests_with_outcome(&metrics, "client_error"), 1.0);
    assert_eq!(requests_with_outcome(&metrics, "too_large"), 1.0);
    assert_eq!(requests_with_outcome(&metrics, "passed_through"), 0.0);
}

// ---------------------------------------------------------------------------
// Admin endpoints
// ---------------------------------------------------------------------------

/// /healthz, /status (the bundled plugin's real SHA-256, name, version,
/// the machine id and layout) and the admin's own errors.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_endpoints_describe_the_serving_plugin() {
    let gateway = Gateway::start(&["--layout", "trtllm-v2", "--machine-id", "300"]).await;

    let health = get(gateway.admin, "/healthz").await;
    assert_eq!(health.status, StatusCode::OK);
    assert_eq!(health.text(), "ok\n");

    let status = gateway.status().await;
    let bundled = sha256_hex(snowgate_plugin_bundle::PLUGIN_WASM);
    assert_eq!(status["plugin"]["sha256"], bundled.as_str(), "{status:#}");
    assert!(
        gateway.ready_line.contains(&bundled),
        "{}",
        gateway.ready_line
    );
    assert_eq!(status["plugin"]["name"], snowgate_plugin::PLUGIN_NAME);
    assert_eq!(status["plugin"]["version"], snowgate_plugin::PLUGIN_VERSION);
    assert_eq!(status["plugin"]["source"], "bundled");
    assert!(
        status["plugin"]["loaded_at_ms"].as_u64().is_some(),
        "{status:#}"
    );
    assert_eq!(status["reloads"]["succeeded"], 0);
    assert_eq!(status["reloads"]["failed"], 0);
    assert_eq!(status["last_reload_error"], Value::Null);
    assert_eq!(status["machine_id"], 300);
    assert_eq!(status["machine_id_error"], Value::Null);
    assert_eq!(status["id_layout"], "trtllm-v2");
    assert_eq!(status["failure_policy"], "fail-closed");
    // /metrics names the same build, for dashboards across a fleet.
    let metrics = gateway.metrics().await;
    let info = format!(
        "snowgate_plugin_info{{name=\"{}\",version=\"{}\",sha256=\"{bundled}\"}} 1\n",
        snowgate_plugin::PLUGIN_NAME,
        snowgate_plugin::PLUGIN_VERSION
    );
    assert!(metrics.contains(&info), "{metrics}");
    assert!(
        metrics.contains("snowgate_plugin_reload_failing 0\n"),
        "{metrics}"
    );
    assert!(
        metrics.contains("snowgate_plugin_loaded_timestamp_seconds 1"),
        "{metrics}"
    );

    // Ids follow the layout and machine id /status reports.
    let reply = post_json(gateway.addr, "/v1/completions", CONTEXT_ONLY).await;
    let id = stamped_id(&serde_json::to_vec(&reply.json()["body"]).unwrap());
    let parts = SnowflakeLayout::TrtllmV2.decode(id).unwrap();
    assert_eq!(parts.machine_id, 300);

    // The bundled plugin has no file to reload from: no reload is
    // possible, which is not a failed one (a bad build's 422).
    let reload = post_empty(gateway.admin, "/reload").await;
    assert_eq!(reload.status, StatusCode::CONFLICT);
    let message = assert_openai_error(
        &reload.json(),
        "reload_not_possible",
        "invalid_request_error",
    );
    assert!(message.contains("--plugin"), "{message}");
    let status = get(gateway.admin, "/status").await.json();
    assert_eq!(status["reloads"]["failed"], 0, "{status}");
    assert!(status["last_reload_error"].is_null(), "{status}");

    assert_eq!(
        get(gateway.admin, "/reload").await.status,
        StatusCode::METHOD_NOT_ALLOWED
    );
    let missing = get(gateway.admin, "/nope").await;
    assert_eq!(missing.status, StatusCode::NOT_FOUND);
    assert_openai_error(&missing.json(), "not_found", "invalid_request_error");
}

/// The check every `/metrics` fetch of these tests goes through refuses
/// what a scraper would: each of these texts breaks one rule of it.
#[test]
fn the_exposition_check_refuses_what_a_scraper_would() {
    let good = "# HELP a_total A.\n# TYPE a_total counter\na_total{k=\"v\\\"\\n\"} 1\n\
                # HELP h H.\n# TYPE h histogram\nh_bucket{le=\"1\"} 1\nh_bucket{le=\"+Inf\"} 2\n\
                h_sum 3.5\nh_count 2\n";
    assert_exposition(good);
    let bad = [
        ("no TYPE", good.replace("# TYPE a_total counter\n", "")),
        ("no HELP", good.replace("# HELP h H.\n", "")),
        (
            "a gauge named _total",
            good.replace("a_total counter", "a_total gauge"),
        ),
        (
            "a counter without _total",
            good.replace("# TYPE h histogram", "# TYPE h counter"),
        ),
        (
            "falling buckets",
            good.replace("le=\"1\"} 1", "le=\"1\"} 3"),
        ),
        (
            "no +Inf bucket",
            good.replace("h_bucket{le=\"+Inf\"} 2\n", ""),
        ),
        (
            "a _count other than +Inf's",
            good.replace("h_count 2", "h_count 5"),
        ),
        ("no _sum", good.replace("h_sum 3.5\n", "")),
        ("a raw quote", good.replace("v\\\"", "v\"")),
        ("an unknown escape", good.replace("v\\\"", "v\\t")),
        ("a family split", format!("{good}a_total{{k=\"w\"}} 1\n")),
        (
            "a series twice",
            good.replace("h_sum 3.5\n", "h_sum 3.5\nh_sum 3.5\n"),
        ),
        ("no last newline", good.trim_end().to_string()),
    ];
    for (what, text) in bad {
        let refused = std::panic::catch_unwind(|| assert_exposition(&text)).is_err();
        assert!(refused, "{what}: passed\n{text}");
    }
}

/// /metrics counts every request by how it ended and every response by its
/// status class and time, as the test sent them; the access log, when on,
/// has a line for each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_count_requests_by_outcome() {
    let upstream = TestUpstream::start().await;
    let gateway = Gateway::start_logging(
        &["--upstream", &upstream.url(), "--max-body-bytes", "4096"],
        "info,snowgate::access=debug",
    )
    .await;

    let mut client = Client::connect(gateway.addr).await;
    for _ in 0..3 {
        assert_eq!(
            client
                .post_json("/v1/completions", CONTEXT_ONLY)
                .await
                .status,
            StatusCode::OK
        );
    }
    let generation = r#"{"disaggregated_params":{"request_type":"generation_only","disagg_request_id":1099511628800}}"#;
    assert_eq!(
        client.post_json("/v1/completions", generation).await.status,
        StatusCode::OK
    );
    assert_eq!(client.get("/v1/models").await.status, StatusCode::OK);
    let text = client
        .builder(Method::POST, "/upload")
        .header("content-type", "text/plain")
        .body(Full::new(Bytes::from_static(b"plain")))
        .unwrap();
    assert_eq!(client.send(text).await.status, StatusCode::OK);
    assert_eq!(
        client.post_json("/v1/completions", "{oops").await.status,
        StatusCode::BAD_REQUEST
    );
    let too_large = raw_exchange(
        gateway.addr,
        b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\nContent-Length: 5000\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert_eq!(too_large.status, 413);

    let metrics = gateway.metrics().await;
    for (outcome, count) in [
        ("rewritten", 3.0),
        ("forwarded", 1.0),
        ("passed_through", 2.0),
        ("rejected", 1.0),
        ("too_large", 1.0),
        ("failed_closed", 0.0),
        ("failed_open", 0.0),
        ("client_error", 0.0),
        ("body_memory_full", 0.0),
        ("plugin_busy", 0.0),
        ("abandoned", 0.0),
    ] {
        assert_eq!(
            metric(
                &metrics,
                &format!("snowgate_requests_total{{outcome=\"{outcome}\"}}")
            ),
            count,
            "{outcome}:\n{metrics}"
        );
    }
    for (class, count) in [
        ("1xx", 0.0),
        ("2xx", 6.0),
        ("3xx", 0.0),
        ("4xx", 2.0),
        ("5xx", 0.0),
    ] {
        assert_eq!(
            metric(
                &metrics,
                &format!("snowgate_responses_total{{code=\"{class}\"}}")
            ),
            count,
            "{class}:\n{metrics}"
        );
    }
    assert_eq!(
        metric(&metrics, "snowgate_response_headers_seconds_count"),
        8.0
    );
    assert_eq!(
        metric(
            &metrics,
            r#"snowgate_response_headers_seconds_bucket{le="+Inf"}"#
        ),
        8.0
    );
    gateway.wait_log("status=413").await;
    let log = gateway.stderr_text();
    let access: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("snowgate::access"))
        .collect();
    assert_eq!(access.len(), 8, "{log}");
    assert!(
        access.iter().any(|l| l.contains("method=GET")
            && l.contains("path=\"/v1/models\"")
            && l.contains("status=200")),
        "{log}"
    );
    assert!(
        access
            .iter()
            .any(|l| l.contains("method=POST") && l.contains("status=400")),
        "{log}"
    );
    // Five plugin calls: three stamps, one forward, one rejection.
    assert_eq!(metric(&metrics, "snowgate_plugin_call_seconds_count"), 5.0);
    assert_eq!(
        metric(
            &metrics,
            r#"snowgate_plugin_call_seconds_bucket{le="+Inf"}"#
        ),
        5.0
    );
    assert!(metric(&metrics, "snowgate_ids_stamped_total") >= 3.0);
    assert_eq!(upstream_errors(&metrics, None), 0.0);
    assert_eq!(
        metric(&metrics, r#"snowgate_reloads_total{result="succeeded"}"#),
        0.0
    );
    assert!(metrics.contains("# TYPE snowgate_requests_total counter"));
    assert!(metrics.contains("# TYPE snowgate_plugin_call_seconds histogram"));
    assert_eq!(upstream.seen().len(), 6);
}

// ---------------------------------------------------------------------------
// Shutdown
// ---------------------------------------------------------------------------

/// SIGTERM: the listener closes at once (new connections are refused),
/// `/readyz` says not ready, reloads are refused (a new build in the
/// plugin file is not compiled), the request in flight finishes with 200,
/// then the process exits 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_stops_accepting_and_drains_in_flight_requests() {
    let dir = TempDir::new("drain");
    let plugin = dir.path().join("plugin.wasm");
    std::fs::write(&plugin, plugin_variant(0)).expect("write the plugin");
    let upstream = TestUpstream::start().await;
    let gateway = Gateway::start(&["--upstream", &upstream.url(), "--plugin", arg(&plugin)]).await;
    let serving = get(gateway.admin, "/status").await.json()["plugin"]["sha256"].clone();

    let addr = gateway.addr;
    let in_flight =
        tokio::spawn(async move { post_json(addr, "/hold/v1/completions", CONTEXT_ONLY).await });
    bounded(
        "the held request to reach the upstream",
        STEP,
        upstream.state.held.notified(),
    )
    .await;

    assert_eq!(get(gateway.admin, "/readyz").await.status, StatusCode::OK);
    gateway.signal("TERM");
    wait_refused(gateway.addr, Duration::from_secs(10)).await;
    assert!(
        gateway.exited().is_none(),
        "the gateway exited with a request in flight"
    );
    // Draining: not ready, so that a load balancer sends nothing more.
    let readiness = get(gateway.admin, "/readyz").await;
    assert_eq!(readiness.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(readiness.text(), "not ready: the gateway is stopping\n");
    replace_by_rename(&plugin, &plugin_variant(1));
    let reload = post_empty(gateway.admin, "/reload").await;
    assert_eq!(reload.status, StatusCode::CONFLICT, "{}", reload.text());
    let message = assert_openai_error(
        &reload.json(),
        "reload_not_possible",
        "invalid_request_error",
    );
    assert!(message.contains("stopping"), "{message}");
    let status = get(gateway.admin, "/status").await.json();
    assert_eq!(status["plugin"]["sha256"], serving, "{status}");

    upstream.state.release.notify_one();
    let reply = bounded("the in-flight request", STEP, in_flight)
        .await
        .expect("the client task");
    assert_eq!(reply.status, StatusCode::OK);
    assert_eq!(reply.text(), "released");
    assert_fresh_v1_id(stamped_id(&upstream.only_seen().body));

    let status = gateway.wait_exit(STEP).await;
    assert_eq!(status.code(), Some(0), "exit status {status:?}");
    assert!(gateway.stderr_text().contains("SIGTERM"));
}

/// A client that goes away while the upstream works on its request (an
/// HTTP/1 client closing its connection, an HTTP/2 one resetting its
/// stream) leaves an access log line with status 499, as nginx logs it,
/// and its upstream exchange is abandoned: the upstream sees its
/// connection close.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_gone_while_the_upstream_works_is_logged_as_499_and_cancelled_upstream() {
    let upstream = TestUpstream::start().await;
    let gateway = Gateway::start_logging(
        &["--upstream", &upstream.url()],
        "info,snowgate::access=debug",
    )
    .await;
    let waited = |what| bounded(what, STEP, upstream.state.held.notified());
    let closed = || {
        upstream
            .state
            .closed
            .load(std::sync::atomic::Ordering::SeqCst)
    };

    // HTTP/1: the client closes its connection.
    let mut stream = TcpStream::connect(gateway.addr).await.expect("connect");
    stream
        .write_all(b"GET /hold/h1 HTTP/1.1\r\nHost: gateway.example\r\n\r\n")
        .await
        .expect("write the request");
    waited("the HTTP/1 request to reach the upstream").await;
    let closed_before = closed();
    drop(stream);
    gateway
        .wait_log_until("a 499 line for the HTTP/1 request", |log| {
            log.lines()
                .any(|l| l.contains("path=\"/hold/h1\"") && l.contains("status=499"))
        })
        .await;
    bounded("the upstream connection to close", STEP, async {
        while closed() == closed_before {
            upstream.state.closed_one.notified().await;
        }
    })
    .await;

    // HTTP/2: the client resets its stream (hyper does when the response
    // future is dropped); the connection stays.
    let mut sender = http2_to::<Full<Bytes>>(gateway.addr).await;
    let request = http::Request::get(format!("http://{}/hold/h2", gateway.addr))
        .body(Full::default())
        .expect("a request");
    let response = sender.send_request(request);
    let abandoned = tokio::spawn(response);
    waited("the HTTP/2 request to reach the upstream").await;
    let closed_before = closed();
    abandoned.abort();
    gateway
        .wait_log_until("a 499 line for the HTTP/2 request", |log| {
            log.lines()
                .any(|l| l.contains("path=\"/hold/h2\"") && l.contains("status=499"))
        })
        .await;
    bounded(
        "the HTTP/2 request's upstream connection to close",
        STEP,
        async {
            while closed() == closed_before {
                upstream.state.closed_one.notified().await;
            }
        },
    )
    .await;
    let request = http::Request::get(format!("http://{}/v1/models", gateway.addr))
        .body(Full::default())
        .expect("a request");
    let response = bounded(
        "an answer on the same connection",
        STEP,
        sender.send_request(request),
    )
    .await
    .expect("a response");
    assert_eq!(response.status(), StatusCode::OK);
}

/// The drain is bounded: a request that never finishes does not keep the
/// gateway up past --shutdown-grace-secs; it still exits 0, and the access
/// log gives the dropped request status 444.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_gives_up_on_stuck_requests_after_the_grace_period() {
    let log = stop_with_a_stuck_request("1", None).await;
    assert!(log.contains("still open after the grace period"), "{log}");
}

/// A second SIGTERM or SIGINT cuts the drain short: the gateway stops at
/// once, well inside a 10-minute grace period, exits 0, and logs the
/// request it dropped as 444. A repeat right after the first (GNU
/// `timeout` signals the process and then its group) is the same stop.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_stop_signal_cuts_the_grace_period_short() {
    let log = stop_with_a_stuck_request("600", Some("INT")).await;
    assert!(
        log.contains("SIGTERM again within a second of the first: taken as the same stop"),
        "{log}"
    );
    assert!(log.contains("SIGINT again: stopping at once"), "{log}");
    assert!(
        log.contains("still open when told to stop at once"),
        "{log}"
    );
}

/// Holds a request at the upstream, sends SIGTERM (and with `second`,
/// SIGTERM again at once, then `second` once the gateway says a further
/// signal stops it at once), and waits for the gateway, under
/// `--shutdown-grace-secs grace`, to exit 0 well within 15 s, dropping the
/// request (444 in the access log; the client sees its connection close).
/// Returns the gateway's log.
async fn stop_with_a_stuck_request(grace: &str, second: Option<&str>) -> String {
    let upstream = TestUpstream::start().await;
    let gateway = Gateway::start_logging(
        &[
            "--upstream",
            &upstream.url(),
            "--shutdown-grace-secs",
            grace,
        ],
        "info,snowgate::access=debug",
    )
    .await;

    let addr = gateway.addr;
    let stuck = tokio::spawn(async move {
        let mut client = Client::connect(addr).await;
        let request = client
            .builder(Method::GET, "/hold/forever")
            .body(Full::default())
            .unwrap();
        // The gateway goes away mid-request: the connection breaks.
        client.sender.ready().await.ok();
        client.sender.send_request(request).await.is_err()
    });
    bounded(
        "the stuck request to reach the upstream",
        STEP,
        upstream.state.held.notified(),
    )
    .await;
    gateway.signal("TERM");
    if let Some(second) = second {
        // The same stop twice, as `timeout` sends it: the drain goes on.
        // Sent once the first is seen: a signal sent while the same one is
        // still pending is merged with it by the kernel.
        gateway.wait_log("SIGTERM: shutting down").await;
        gateway.signal("TERM");
        gateway
            .wait_log("a further SIGTERM or SIGINT stops at once")
            .await;
        assert!(gateway.exited().is_none(), "{}", gateway.stderr_text());
        gateway.signal(second);
    }
    let status = gateway.wait_exit(Duration::from_secs(15)).await;
    assert_eq!(status.code(), Some(0), "exit status {status:?}");
    let log = gateway.stderr_text();
    // The access log says the gateway dropped it (nginx's 444), not that
    // its client went away (499).
    let line = log
        .lines()
        .find(|l| l.contains("path=\"/hold/forever\""))
        .unwrap_or_else(|| panic!("no access log line: {log}"));
    assert!(line.contains("status=444"), "{line}");
    assert!(bounded("the client to see the close", STEP, stuck)
        .await
        .unwrap());
    log
}

/// SIGINT (Ctrl-C) also stops the gateway with status 0, closing idle
/// keep-alive connections instead of waiting for the grace period.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigint_exits_zero_and_closes_idle_connections() {
    let gateway = Gateway::start(&["--shutdown-grace-secs", "60"]).await;
    let mut idle = Client::connect(gateway.addr).await;
    assert_eq!(
        idle.post_json("/v1/completions", CONTEXT_ONLY).await.status,
        StatusCode::OK
    );

    gateway.signal("INT");
    let status = gateway.wait_exit(Duration::from_secs(15)).await;
    assert_eq!(status.code(), Some(0), "exit status {status:?}");
    assert!(gateway.stderr_text().contains("SIGINT"));
    drop(idle);
}

/// SIGTERM does not wait for a connection that was accepted but has sent
/// nothing yet (a pre-opened pool connection, a health checker): there is
/// no request in flight on it, so it is closed at once, as idle keep-alive
/// connections are.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_does_not_wait_for_connections_that_sent_nothing() {
    let gateway = Gateway::start(&[
        "--header-read-timeout-ms",
        "60000",
        "--shutdown-grace-secs",
        "60",
    ])
    .await;
    // Accepted first (the accept queue is FIFO), then silent.
    let silent = tokio::net::TcpStream::connect(gateway.addr).await.unwrap();
    let reply = post_json(gateway.addr, "/v1/completions", CONTEXT_ONLY).await;
    assert_eq!(reply.status, StatusCode::OK);

    gateway.signal("TERM");
    let status = gateway.wait_exit(Duration::from_secs(10)).await;
    assert_eq!(status.code(), Some(0), "exit status {status:?}");
    drop(silent);
}

// ---------------------------------------------------------------------------
// Restarts
// ---------------------------------------------------------------------------

/// The library gateway's settings for these tests: the bundled plugin, the
/// built-in echo and [`MACHINE_ID`], on free ports.
fn library_config() -> GatewayConfig {
    GatewayConfig {
        listen: ([127, 0, 0, 1], 0).into(),
        admin_listen: ([127, 0, 0, 1], 0).into(),
        machine_id: Some(MACHINE_ID),
        ..Default::default()
    }
}

/// A library gateway being served, and how to stop it.
struct LibraryServing {
    addr: SocketAddr,
    admin: SocketAddr,
    clock: Arc<IdClock>,
    stop: tokio::sync::oneshot::Sender<()>,
    served: tokio::task::JoinHandle<anyhow::Result<()>>,
}

/// Binds the library gateway with `config` and serves it until `stop`.
async fn serve_library_gateway(config: GatewayConfig) -> LibraryServing {
    let gateway = LibraryGateway::bind(config)
        .await
        .unwrap_or_else(|e| panic!("starting the gateway: {e:#}"));
    let addr = gateway.local_addr().expect("the gateway's address");
    let admin = gateway.admin_addr().expect("the admin address");
    let clock = gateway.clock().clone();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let served = tokio::spawn(gateway.serve(async move {
        let _ = stopped.await;
    }));
    LibraryServing {
        addr,
        admin,
        clock,
        stop,
        served,
    }
}

/// A library gateway that has stopped, or was bound and dropped, lets its
/// plugin slot go (its engine, its pooled instances' address space, its
/// build): an embedder that runs one gateway after another in one process
/// does not keep every stopped one. The SIGHUP task held it for as long as
/// the runtime lived.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_library_gateway_lets_its_plugin_slot_go() {
    let gateway = LibraryGateway::bind(library_config())
        .await
        .unwrap_or_else(|e| panic!("starting the gateway: {e:#}"));
    let slot = Arc::downgrade(gateway.slot());
    let addr = gateway.local_addr().expect("the gateway's address");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let served = tokio::spawn(gateway.serve(async move {
        let _ = stopped.await;
    }));
    let _ = echoed_id(addr).await;
    let _ = stop.send(());
    bounded("the gateway to stop", STEP, served)
        .await
        .expect("the serving task")
        .expect("served");
    bounded("the plugin slot to be let go", STEP, async {
        while slot.upgrade().is_some() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;

    // So does one bound and dropped without serving.
    let gateway = LibraryGateway::bind(library_config())
        .await
        .unwrap_or_else(|e| panic!("starting the gateway: {e:#}"));
    let slot = Arc::downgrade(gateway.slot());
    drop(gateway);
    bounded("the unserved gateway's slot to be let go", STEP, async {
        while slot.upgrade().is_some() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
}

/// The id the echo shows the plugin stamped into [`CONTEXT_ONLY`].
async fn echoed_id(addr: SocketAddr) -> u64 {
    let reply = post_json(addr, "/v1/completions", CONTEXT_ONLY).await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
    stamped_id(&serde_json::to_vec(&reply.json()["body"]).expect("the echoed body"))
}

/// The plugin may answer with twice the largest body the gateway takes, so
/// a body within `max_body_bytes` is never refused for the size of its
/// stamped answer, whatever answer limit the plugin limits were given.
/// Here the answer limit is 64 KiB and the body limit 128 KiB: a 100 KiB
/// body is stamped, not failed as an unusable answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_within_max_body_bytes_is_stamped_whatever_the_answer_limit() {
    let mut config = GatewayConfig {
        max_body_bytes: 128 << 10,
        ..library_config()
    };
    config.plugin_limits.max_output_body_bytes = 64 << 10;
    let LibraryServing {
        addr, stop, served, ..
    } = serve_library_gateway(config).await;
    let prompt = "a".repeat(100 << 10);
    let body = format!(
        r#"{{"disaggregated_params":{{"request_type":"context_only"}},"prompt":"{prompt}"}}"#
    );
    let reply = post_json(addr, "/v1/completions", body).await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
    let echoed = &reply.json()["body"];
    assert_eq!(echoed["prompt"], prompt.as_str());
    assert_fresh_v1_id(stamped_id(
        &serde_json::to_vec(echoed).expect("the echoed body"),
    ));
    let _ = stop.send(());
    served.await.expect("the serving task").expect("served");
}

/// Ids never repeat across a restart on one machine id. A process's id
/// clock starts at the wall clock, and a burst (more ids than a
/// millisecond's sequence space) leaves it ahead of the wall clock: a
/// gateway that stopped at once could be followed by one that issues ids
/// in milliseconds the first already used. So a stopping gateway waits
/// until the wall clock has passed its last id.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_on_the_same_machine_id_starts_after_the_last_id() {
    let LibraryServing {
        addr,
        clock,
        stop,
        served,
        ..
    } = serve_library_gateway(library_config()).await;
    // What a burst of about 1.6 million trtllm-v1 ids does to the clock;
    // a real one takes too long in a debug build to outrun the wall clock.
    let lead = Duration::from_millis(400);
    let now = SystemClock.now_millis();
    clock.advance_past(now + lead.as_millis() as u64);
    let last = SnowflakeLayout::TrtllmV1
        .decode(echoed_id(addr).await)
        .expect("a trtllm-v1 id");
    assert!(
        last.millis > now + 300,
        "the id was not made ahead: {last:?}"
    );

    // Taken before the lead, which is the time left from when it is read.
    let stopping = Instant::now();
    let lead = clock.lead();
    let _ = stop.send(());
    bounded("the first gateway to stop", Duration::from_secs(30), served)
        .await
        .expect("the serving task")
        .expect("the first gateway");
    let now = SystemClock.now_millis();
    assert!(
        now > last.millis,
        "stopped at {now} ms, before the wall clock passed its last id at {} ms",
        last.millis
    );
    // The lead is in whole wall-clock milliseconds: allow for the rounding.
    assert!(
        stopping.elapsed() + Duration::from_millis(2) >= lead,
        "stopped after {:?} with a {lead:?} lead",
        stopping.elapsed()
    );

    let LibraryServing {
        addr, stop, served, ..
    } = serve_library_gateway(library_config()).await;
    let first = SnowflakeLayout::TrtllmV1
        .decode(echoed_id(addr).await)
        .expect("a trtllm-v1 id");
    assert_eq!(first.machine_id, last.machine_id);
    assert!(
        first.millis > last.millis,
        "the restarted gateway's first id ({first:?}) is not after the last one ({last:?})"
    );
    let _ = stop.send(());
    bounded(
        "the second gateway to stop",
        Duration::from_secs(30),
        served,
    )
    .await
    .expect("the serving task")
    .expect("the second gateway");
}

/// Sends a bodiless `method` request for `/v1/models` on `sender` and
/// reads the whole answer; a reset stream fails the test.
async fn bodiless(
    sender: &mut hyper::client::conn::http2::SendRequest<Full<Bytes>>,
    addr: std::net::SocketAddr,
    method: http::Method,
) -> (StatusCode, http::HeaderMap, Bytes) {
    let request = http::Request::builder()
        .method(method.clone())
        .uri(format!("http://{addr}/v1/models"))
        .body(Full::new(Bytes::new()))
        .expect("a request");
    let response = bounded(method.as_str(), STEP, sender.send_request(request))
        .await
        .expect("a response");
    let (parts, body) = response.into_parts();
    let body = body.collect().await.expect("a body, not a reset stream");
    (parts.status, parts.headers, body.to_bytes())
}

/// HEAD gets a GET's headers and no body, over both protocols, whether the
/// upstream (here the built-in echo) or the gateway itself answers: over
/// HTTP/2 a body on a HEAD answer is a protocol error that resets the
/// stream.
#[tokio::test(flavor = "multi_thread")]
async fn head_is_answered_without_a_body() {
    let gateway = Gateway::start(&[]).await;
    let mut sender = http2_to(gateway.addr).await;
    let (_, headers, get_body) = bodiless(&mut sender, gateway.addr, http::Method::GET).await;
    assert_eq!(
        headers["content-length"],
        get_body.len().to_string().as_str()
    );
    let (status, headers, body) = bodiless(&mut sender, gateway.addr, http::Method::HEAD).await;
    assert_eq!(status, StatusCode::OK);
    // The length of the echo the request would get ("HEAD" is one letter
    // longer than "GET").
    let head_length = (get_body.len() + 1).to_string();
    assert_eq!(headers["content-length"], head_length.as_str());
    assert!(body.is_empty(), "{body:?}");

    let mut client = Client::connect(gateway.addr).await;
    let request = client
        .builder(http::Method::HEAD, "/v1/models")
        .body(Full::default())
        .expect("a request");
    let reply = client.send(request).await;
    assert_eq!(reply.status, StatusCode::OK);
    // Its own request's headers differ, so its echo's length does too.
    let length: usize = reply.headers["content-length"]
        .to_str()
        .expect("ASCII")
        .parse()
        .expect("a length");
    assert!(length > 0);
    assert!(reply.body.is_empty(), "{:?}", reply.body);
    // The connection is still good for the next request.
    assert_eq!(client.get("/v1/models").await.status, StatusCode::OK);

    // The gateway's own answer: 502, its upstream gone.
    let dead = dead_address().await;
    let gateway = Gateway::start(&["--upstream", &format!("http://{dead}")]).await;
    let mut sender = http2_to(gateway.addr).await;
    let (status, _, body) = bodiless(&mut sender, gateway.addr, http::Method::HEAD).await;
    assert_eq!(status, StatusCode::BAD_GATEWAY);
    assert!(body.is_empty(), "{body:?}");
}

/// A plugin that logs in a loop (10,000 lines of 5 KiB from one call)
/// writes at most 64 lines of at most 4 KiB per call into the gateway's
/// log, and a warning that the rest were dropped (once a second at most);
/// the request itself is served. A reject message of 1 MiB reaches the
/// client cut to 4 KiB.
#[tokio::test]
async fn a_plugin_cannot_flood_the_log_or_the_client_with_text() {
    let (_dir, path) = hostile_plugin_file("flood");
    let gateway = Gateway::start(&["--plugin", path.to_str().unwrap()]).await;
    let addr = gateway.addr;
    let misbehave = |behaviour: &'static str| misbehaving(addr, behaviour);
    let line = "l".repeat(4096);
    for call in 1..=2 {
        let reply = misbehave("log-flood").await;
        assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
        gateway.wait_log_times(&line, 64 * call).await;
        gateway
            .wait_log("the rest of this call's lines are dropped")
            .await;
        let log = gateway.stderr_text();
        assert_eq!(log.matches(line.as_str()).count(), 64 * call, "lines kept");
        assert!(!log.contains(&format!("{line}l")), "a line over 4 KiB");
    }

    let reply = misbehave("huge-reject").await;
    assert_eq!(reply.status, StatusCode::BAD_REQUEST);
    let message = reply.json()["error"]["message"]
        .as_str()
        .expect("a message")
        .to_string();
    assert!(message.len() < 4200, "{} bytes", message.len());
    assert!(reply.body.len() < 30 << 10, "{} bytes", reply.body.len());
    gateway.stop().await;
}

/// Plugins together write at most 1000 log lines a second: a plugin that
/// logs 64 lines (as many as one call may) on every request, under 400
/// requests on eight connections, loses the lines over that, and the log
/// says so (once a second), counting every line dropped: each one written
/// or counted in a warning, the last second's in a note at its end. Every
/// request is still served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plugins_write_at_most_a_thousand_log_lines_a_second() {
    const CONNECTIONS: usize = 8;
    const REQUESTS_EACH: usize = 50;
    const ASKED: usize = CONNECTIONS * REQUESTS_EACH * 64;
    let (_dir, path) = hostile_plugin_file("log-budget");
    let gateway = Gateway::start(&["--plugin", path.to_str().unwrap()]).await;
    let addr = gateway.addr;
    let connections: Vec<_> = (0..CONNECTIONS)
        .map(|_| {
            tokio::spawn(async move {
                for _ in 0..REQUESTS_EACH {
                    let reply = misbehaving(addr, "log-64").await;
                    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
                }
            })
        })
        .collect();
    for connection in connections {
        bounded("400 requests that log", 10 * STEP, connection)
            .await
            .expect("the requests");
    }
    // Every line asked for is written or counted, once the last second's
    // note is in. Before, the lines dropped after the last warning written
    // were counted by none (a review saw 4,000 dropped and told as none).
    let number_before = |line: &str, words: &str| -> u64 {
        let (before, _) = line.split_once(words).expect("the words");
        let digits = before.rsplit(|c: char| !c.is_ascii_digit()).next();
        digits.and_then(|d| d.parse().ok()).expect("a count")
    };
    let accounted = |log: &str| -> usize {
        let mut lines = 0u64;
        for line in log.lines() {
            if line.contains("log-64 line") {
                lines += 1;
            } else if line.contains("a plugin log line was dropped") {
                lines += 1 + number_before(line, " more since the last such warning");
            } else if line.contains("more plugin log lines were dropped in the second") {
                lines += number_before(line, " more plugin log lines");
            }
        }
        lines as usize
    };
    let deadline = Instant::now() + STEP;
    while accounted(&gateway.stderr_text()) != ASKED {
        assert!(
            Instant::now() < deadline,
            "{} of {ASKED} lines written or counted as dropped",
            accounted(&gateway.stderr_text())
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    gateway.stop().await;
    // The log comes through a pipe: once its last line is read, so is
    // every line before it.
    gateway.wait_log("snowgate::serve: stopped").await;
    let log = gateway.stderr_text();
    let times: Vec<f64> = log
        .lines()
        .filter(|line| line.contains("log-64 line"))
        .map(log_line_seconds)
        .collect();
    let written = times.len();
    assert!(
        written < ASKED,
        "all {ASKED} lines were written: none dropped, so the budget was never reached"
    );
    assert!(
        log.contains("a plugin log line was dropped"),
        "the drop is not logged"
    );
    // The budget counts whole seconds of the gateway's own clock: lines
    // that span `span` seconds of the log fall within at most
    // floor(span) + 2 of them. (Two workers write lines, so the log's
    // order need not be their times' order.)
    let first = times.iter().copied().fold(f64::INFINITY, f64::min);
    let last = times.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let span = last - first;
    let seconds = span.floor() as usize + 2;
    assert!(
        written <= 1000 * seconds,
        "{written} lines within {span:.3} s of the log, more than 1000 in each of {seconds} seconds"
    );
}

/// The time of a log line, in seconds since 1970, from its leading RFC 3339
/// timestamp (`2026-12-06T07:15:10.675368Z`).
fn log_line_seconds(line: &str) -> f64 {
    let stamp = line.split(' ').next().unwrap_or_default();
    let parsed = (|| {
        let (date, time) = stamp.strip_suffix('Z')?.split_once('T')?;
        let mut date = date.split('-').map(|part| part.parse::<i64>().ok());
        let (year, month, day) = (date.next()??, date.next()??, date.next()??);
        let mut parts = time.split(':');
        let hours: f64 = parts.next()?.parse().ok()?;
        let minutes: f64 = parts.next()?.parse().ok()?;
        let seconds: f64 = parts.next()?.parse().ok()?;
        // Days since 1970-01-01 of a proleptic Gregorian date (Howard
        // Hinnant's `days_from_civil`).
        let year = if month <= 2 { year - 1 } else { year };
        let era = year.div_euclid(400);
        let of_era = year - era * 400;
        let of_year = (153 * ((month + 9) % 12) + 2) / 5 + day - 1;
        let of_cycle = of_era * 365 + of_era / 4 - of_era / 100 + of_year;
        let days = era * 146_097 + of_cycle - 719_468;
        Some(((days as f64 * 24.0 + hours) * 60.0 + minutes) * 60.0 + seconds)
    })();
    parsed.unwrap_or_else(|| panic!("no timestamp at the start of the log line {line:?}"))
}

/// A plugin call that runs for seconds shares its worker thread: while it
/// loops, the worker's other connections are still read and answered.
/// With one worker and a deadline of a minute, 50 requests on another
/// connection are served while the looping call runs. (How long each
/// waits for the loop to yield is a latency, measured in benchmarks, not
/// here: before the call yielded through `tokio::task::yield_now`, the
/// worker read its sockets only every 61 slices of the loop, 30 to 80 ms.)
/// The deadline's own answer is tested with the hostile fixture elsewhere.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_looping_plugin_call_leaves_its_worker_serving_other_connections() {
    let (_dir, path) = hostile_plugin_file("loop");
    let gateway = Gateway::start(&[
        "--plugin",
        path.to_str().unwrap(),
        "--workers",
        "1",
        "--plugin-deadline-ms",
        "60000",
    ])
    .await;
    let addr = gateway.addr;
    let looping = tokio::spawn(misbehaving(addr, "loop"));
    gateway.wait_log("the hostile fixture starts to loop").await;

    let mut client = Client::connect(addr).await;
    for served in 0..50 {
        let reply = client.get("/v1/models").await;
        assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
        assert!(
            !looping.is_finished(),
            "the looping call ended before {served} other requests were served"
        );
    }
    looping.abort();
}

/// `/metrics` shows what is in use now: open client connections against
/// `--max-connections`, and plugin calls running and waiting for a slot
/// against the calls the gateway runs at once. Here two call slots (three
/// instances, none kept), three looping calls: two run, one waits; once
/// their deadlines have passed, none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_show_connections_and_plugin_calls_in_use() {
    let (_dir, mut config) = hostile_with_two_call_slots("in-use");
    config.connections.max_connections = 64;
    // The state waited for below lasts from the third request's arrival
    // until the first two calls reach their deadline: seconds, for a busy
    // machine to queue the third and show it.
    config.plugin_limits.deadline = Duration::from_secs(5);
    let LibraryServing {
        addr,
        admin,
        stop,
        served,
        ..
    } = serve_library_gateway(config).await;
    let wait_for = |wanted: Vec<(&'static str, f64)>| wait_metrics_at(admin, wanted);
    let text = wait_for(vec![
        ("snowgate_connections_open", 0.0),
        ("snowgate_plugin_calls_running", 0.0),
        ("snowgate_plugin_calls_waiting", 0.0),
    ])
    .await;
    assert_eq!(metric(&text, "snowgate_connections_max"), 64.0);
    assert_eq!(metric(&text, "snowgate_plugin_calls_max"), 2.0);

    let idle = connect_many(addr, 5).await;
    wait_for(vec![("snowgate_connections_open", 5.0)]).await;
    let loops: Vec<_> = (0..3)
        .map(|_| tokio::spawn(misbehaving(addr, "loop")))
        .collect();
    wait_for(vec![
        ("snowgate_connections_open", 8.0),
        ("snowgate_plugin_calls_running", 2.0),
        ("snowgate_plugin_calls_waiting", 1.0),
    ])
    .await;
    for looping in loops {
        let reply = looping.await.expect("a looping request");
        assert_eq!(
            reply.status,
            StatusCode::SERVICE_UNAVAILABLE,
            "{}",
            reply.text()
        );
    }
    drop(idle);
    wait_for(vec![
        ("snowgate_connections_open", 0.0),
        ("snowgate_plugin_calls_running", 0.0),
        ("snowgate_plugin_calls_waiting", 0.0),
    ])
    .await;
    let _ = stop.send(());
    served.await.expect("the serving task").expect("served");
}

/// A request that finds every plugin call slot taken waits for one as
/// long as a request waits for room for its body (`--body-read-timeout-ms`),
/// holding its body's room meanwhile, and then gets 503 `plugin_busy` with
/// `Retry-After`, counted as such; its connection serves on. Before, it
/// waited for as long as the calls ahead of it ran, however long that was.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_that_finds_no_plugin_call_slot_in_time_gets_503_plugin_busy() {
    let (_dir, mut config) = hostile_with_two_call_slots("busy");
    // The two looping calls hold both slots for this long: far longer
    // than the third request's wait, on a busy machine too.
    config.plugin_limits.deadline = Duration::from_secs(3);
    config.connections.body_read_timeout = Duration::from_millis(300);
    let LibraryServing {
        addr,
        admin,
        stop,
        served,
        ..
    } = serve_library_gateway(config).await;
    let loops: Vec<_> = (0..2)
        .map(|_| tokio::spawn(misbehaving(addr, "loop")))
        .collect();
    wait_metrics_at(admin, vec![("snowgate_plugin_calls_running", 2.0)]).await;
    let memory = "snowgate_body_memory_bytes";
    let held = metric(get(admin, "/metrics").await.text(), memory);

    let mut client = Client::connect(addr).await;
    let reply = client.post_json("/v1/completions", CONTEXT_ONLY).await;
    assert_eq!(
        reply.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{}",
        reply.text()
    );
    assert_eq!(reply.header("retry-after"), Some("1"));
    let message = assert_openai_error(&reply.json(), "plugin_busy", "server_error");
    assert!(
        message.contains("within 300 ms (--body-read-timeout-ms)")
            && message.contains("requests waiting for one: 1"),
        "{message}"
    );
    let text = get(admin, "/metrics").await.text().to_string();
    assert_eq!(requests_with_outcome(&text, "plugin_busy"), 1.0);
    assert_eq!(
        metric(&text, "snowgate_plugin_calls_waiting"),
        0.0,
        "{text}"
    );
    assert_eq!(metric(&text, memory), held, "its room is given back");

    for looping in loops {
        let reply = looping.await.expect("a looping request");
        assert_eq!(
            reply.status,
            StatusCode::SERVICE_UNAVAILABLE,
            "{}",
            reply.text()
        );
    }
    // The same connection, once the slots are free: stamped.
    let reply = client.post_json("/v1/completions", CONTEXT_ONLY).await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
    assert!(
        reply.json()["body"]["disaggregated_params"]["disagg_request_id"].is_u64(),
        "{}",
        reply.text()
    );
    let _ = stop.send(());
    served.await.expect("the serving task").expect("served");
}

/// Waits (at most `STEP`) until the admin listener at `admin` shows every
/// sample of `wanted` at its value; returns the metrics then.
async fn wait_metrics_at(admin: SocketAddr, wanted: Vec<(&'static str, f64)>) -> String {
    let started = Instant::now();
    loop {
        let text = get(admin, "/metrics").await.text().to_string();
        if wanted
            .iter()
            .all(|(name, value)| metric(&text, name) == *value)
        {
            return text;
        }
        assert!(started.elapsed() < STEP, "never {wanted:?}:\n{text}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A library gateway's configuration with the hostile fixture (written in
/// a directory named for `name`, kept while it lives) and two plugin call
/// slots: three instances, none kept.
fn hostile_with_two_call_slots(name: &str) -> (TempDir, GatewayConfig) {
    let (dir, path) = hostile_plugin_file(name);
    let mut config = GatewayConfig {
        plugin: Some(path),
        ..library_config()
    };
    config.plugin_limits.max_instances = 3;
    config.plugin_limits.calls_per_instance = 1;
    (dir, config)
}

/// The hostile test fixture written to `plugin.wasm` in a new temporary
/// directory named after `name` (kept while the directory lives).
fn hostile_plugin_file(name: &str) -> (TempDir, PathBuf) {
    let dir = TempDir::new(name);
    let path = dir.path().join("plugin.wasm");
    std::fs::write(&path, snowgate_test_fixtures::HOSTILE_WASM).unwrap();
    (dir, path)
}

/// Sends [`CONTEXT_ONLY`] on a new connection with `x-hostile: behaviour`,
/// for the hostile fixture to misbehave on.
async fn misbehaving(addr: SocketAddr, behaviour: &'static str) -> Reply {
    misbehaving_with(addr, behaviour, &[], CONTEXT_ONLY.as_bytes()).await
}

/// [`misbehaving`], with the headers `extra` after `x-hostile` and `body`.
async fn misbehaving_with(
    addr: SocketAddr,
    behaviour: &str,
    extra: &[(&str, &str)],
    body: &'static [u8],
) -> Reply {
    let mut client = Client::connect(addr).await;
    let mut request = client
        .builder(Method::POST, "/v1/completions")
        .header("content-type", "application/json")
        .header("x-hostile", behaviour);
    for (name, value) in extra {
        request = request.header(*name, *value);
    }
    let request = request.body(Full::new(Bytes::from_static(body))).unwrap();
    client.send(request).await
}
