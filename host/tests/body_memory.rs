//! What a request's body keeps in memory while the request is upstream.
//!
//! A context-only body the plugin stamped goes upstream as the plugin's new
//! body; the original is never sent again. A completion that is not streamed
//! sends its response headers only when it ends, seconds to minutes later,
//! so an original kept until then doubles what every such request holds.
//!
//! This binary counts the bytes its allocator has handed out and not taken
//! back, so it holds one test: others running beside it would move the
//! count.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use snowgate_host::gateway::middleware::ForwardBody;
use snowgate_host::gateway::{FailurePolicy, Metrics, PluginSlot, SnowgateLayer};
use snowgate_host::{HostServices, IdClock, MachineIdentity, PluginEngine, PluginLimits};
use snowgate_plugin::SnowflakeLayout;
use tower::{service_fn, Layer, ServiceExt};

/// The system allocator, counting the bytes it holds for the program.
struct Counting;

static LIVE_BYTES: AtomicIsize = AtomicIsize::new(0);

// SAFETY: every call goes to `System` unchanged; the count is a side note.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE_BYTES.fetch_add(layout.size() as isize, Ordering::Relaxed);
        System.alloc(layout)
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        LIVE_BYTES.fetch_add(layout.size() as isize, Ordering::Relaxed);
        System.alloc_zeroed(layout)
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE_BYTES.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        System.dealloc(ptr, layout)
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LIVE_BYTES.fetch_add(
            new_size as isize - layout.size() as isize,
            Ordering::Relaxed,
        );
        System.realloc(ptr, layout, new_size)
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

fn live_bytes() -> isize {
    LIVE_BYTES.load(Ordering::Relaxed)
}

/// A context-only request whose prompt fills `size` bytes.
fn context_only_body(size: usize) -> Bytes {
    let head = br#"{"model":"m","prompt":""#;
    let tail = br#"","disaggregated_params":{"request_type":"context_only"}}"#;
    let mut body = Vec::with_capacity(size);
    body.extend_from_slice(head);
    body.resize(size - tail.len(), b'a');
    body.extend_from_slice(tail);
    Bytes::from(body)
}

#[tokio::test(flavor = "current_thread")]
async fn a_stamped_request_holds_only_its_new_body_while_it_is_upstream() -> anyhow::Result<()> {
    const BODY: usize = 16 << 20;
    let services = HostServices {
        clock: Arc::new(IdClock::system()),
        identity: Arc::new(MachineIdentity::fixed(SnowflakeLayout::TrtllmV1, 3)?),
    };
    // The test is about memory, not time: a debug build copies 16 MiB slowly.
    let limits = PluginLimits {
        deadline: Duration::from_secs(20),
        ..PluginLimits::default()
    };
    let engine = PluginEngine::new(services, limits)?;
    let metrics = Arc::new(Metrics::default());
    let slot = Arc::new(PluginSlot::load(engine, None, Vec::new(), metrics.clone())?);
    let layer = SnowgateLayer::new(slot, metrics, FailurePolicy::FailClosed, 32 << 20);
    // A bound on all bodies below one body of the limit is refused, naming
    // both; the bound of the default, 1 GiB, is kept.
    let refused = layer
        .clone()
        .with_body_memory(16 << 20, Duration::from_secs(1))
        .err()
        .expect("a body memory smaller than one body");
    assert_eq!(
        refused.to_string(),
        "the body memory (16777216 bytes) must hold at least the largest body taken \
         (33554432 bytes, --max-body-bytes), or such a body could never be read"
    );

    // The upstream takes the body the gateway sends and lets it go, as
    // hyper's client does once it has written it; what the gateway still
    // holds for the request is then counted, before the response exists.
    let upstream = service_fn(
        |request: http::Request<ForwardBody<Full<Bytes>>>| async move {
            let sent = request
                .into_body()
                .collect()
                .await
                .map_err(|e| anyhow::anyhow!("{e}"))?
                .to_bytes();
            let stamped =
                std::str::from_utf8(&sent[sent.len() - 100..])?.contains("disagg_request_id");
            let sent_len = sent.len();
            drop(sent);
            let held = live_bytes();
            Ok::<_, anyhow::Error>(http::Response::new(Full::new(Bytes::from(format!(
                "{stamped} {sent_len} {held}"
            )))))
        },
    );
    let service = layer.layer(upstream);

    // The request's body is counted from here: one of the body's size is
    // what the gateway holds until the plugin has answered (the plugin's
    // copy is in the instance's linear memory, not this allocator's).
    let before = live_bytes();
    let request = http::Request::post("/v1/completions")
        .header("content-type", "application/json")
        .body(Full::new(context_only_body(BODY)))?;
    let response = service
        .oneshot(request)
        .await
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let answer = response
        .into_body()
        .collect()
        .await
        .map_err(|e| anyhow::anyhow!("{e}"))?
        .to_bytes();
    let answer = String::from_utf8(answer.to_vec())?;
    let [stamped, sent_len, held] = answer.split(' ').collect::<Vec<_>>()[..] else {
        anyhow::bail!("unexpected answer {answer:?}");
    };
    assert_eq!(stamped, "true", "the plugin stamped the body");
    assert!(
        sent_len.parse::<usize>()? > BODY,
        "the new body went upstream"
    );
    let held = held.parse::<isize>()? - before;
    // Kept until the response, the original alone would be 16 MiB more.
    assert!(
        held < (BODY / 4) as isize,
        "the gateway held {held} bytes more than before the request, once the upstream \
         had taken its stamped body: the {BODY}-byte original was kept"
    );
    Ok(())
}
