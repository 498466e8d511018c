//! What the host copies out of a plugin's memory when the plugin calls an
//! import with text: only what the import keeps, never the whole string or
//! list. A plugin that hands a 32 MiB log line, header name or header value
//! to an import costs the host a few KiB, not 32 MiB for each.
//!
//! This binary counts the bytes its allocator hands out (a plugin's linear
//! memory is mapped by wasmtime, not allocated here), so it holds one test:
//! others running beside it would move the count.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, Ordering};
use std::sync::Arc;

use snowgate_host::{
    Action, FixedClock, HostServices, IdClock, MachineIdentity, Plugin, PluginEngine, PluginLimits,
    Request,
};
use snowgate_plugin::SnowflakeLayout;

/// The system allocator, counting the bytes it holds for the program and
/// the most it has held since the count was last reset.
struct Counting;

static LIVE_BYTES: AtomicIsize = AtomicIsize::new(0);
static PEAK_BYTES: AtomicIsize = AtomicIsize::new(0);

fn grew(by: isize) {
    let live = LIVE_BYTES.fetch_add(by, Ordering::Relaxed) + by;
    PEAK_BYTES.fetch_max(live, Ordering::Relaxed);
}

// SAFETY: every call goes to `System` unchanged; the count is a side note.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        grew(layout.size() as isize);
        System.alloc(layout)
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        grew(layout.size() as isize);
        System.alloc_zeroed(layout)
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE_BYTES.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        System.dealloc(ptr, layout)
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        grew(new_size as isize - layout.size() as isize);
        System.realloc(ptr, layout, new_size)
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// The most the allocator held above what it held when `f` began.
fn peak_growth_during<T>(f: impl FnOnce() -> T) -> (T, isize) {
    let before = LIVE_BYTES.load(Ordering::Relaxed);
    PEAK_BYTES.store(before, Ordering::Relaxed);
    let out = f();
    (out, PEAK_BYTES.load(Ordering::Relaxed) - before)
}

fn huge_imports_request() -> Request {
    Request {
        method: "POST".into(),
        path: "/v1/completions".into(),
        headers: vec![
            ("content-type".to_string(), b"application/json".to_vec()),
            ("x-hostile".to_string(), b"huge-imports".to_vec()),
        ]
        .into(),
        body: br#"{"disaggregated_params":{"request_type":"context_only"}}"#.to_vec(),
    }
}

#[test]
fn a_plugin_handing_imports_32_mib_costs_the_host_no_copy_of_it() {
    // The warn line is written (to nowhere): a line the log leaves out is
    // not read at all, and would show nothing.
    tracing::subscriber::set_global_default(
        tracing_subscriber::fmt()
            .with_max_level(tracing::Level::WARN)
            .with_writer(std::io::sink)
            .finish(),
    )
    .expect("the only subscriber");
    let services = HostServices {
        clock: Arc::new(IdClock::new(FixedClock(1_764_000_000_000))),
        identity: Arc::new(MachineIdentity::fixed(SnowflakeLayout::TrtllmV1, 3).unwrap()),
    };
    let engine = PluginEngine::new(services, PluginLimits::default()).expect("an engine");
    let plugin = Plugin::load(&engine, snowgate_test_fixtures::HOSTILE_WASM, &[])
        .expect("loading the hostile fixture");
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    let request = huge_imports_request();
    // Each path twice: the first call of an instance sets up what later
    // ones reuse.
    for round in 0..2 {
        for path in ["fresh instance", "reused instance"] {
            let (answer, grew) = peak_growth_during(|| match path {
                "fresh instance" => plugin.handle(&request),
                _ => runtime.block_on(plugin.handle_async(&request)),
            });
            assert!(
                matches!(answer, Ok(Action::ForwardWithBody(_))),
                "{path}: {answer:?}"
            );
            if round == 1 {
                assert!(
                    grew < 1 << 20,
                    "{path}: the host held {grew} bytes more during the call"
                );
            }
        }
    }
}
