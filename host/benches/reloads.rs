//! Reload cost: how long a new plugin build takes to serve after it is
//! renamed into place, and whether memory stays flat across 1000 reloads.
//!
//! Run: `cargo bench -p snowgate-host --bench reloads`
//! (`-- --reloads N` to change the count). Prints a report; asserts nothing
//! about time.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use snowgate_host::gateway::{watch, Metrics, PluginSlot, Reloaded};
use snowgate_host::{HostServices, IdClock, MachineIdentity, PluginEngine, PluginLimits};
use snowgate_plugin::SnowflakeLayout;

/// The bundled component with a custom section appended: same behaviour,
/// different bytes (and so a different sha256).
fn variant(n: u32) -> Vec<u8> {
    let mut bytes = snowgate_plugin_bundle::PLUGIN_WASM.to_vec();
    let name = b"snowgate-variant";
    let payload = n.to_le_bytes();
    let size = 1 + name.len() + payload.len();
    bytes.push(0); // custom section id
    bytes.push(size as u8); // LEB128, fits in one byte
    bytes.push(name.len() as u8);
    bytes.extend_from_slice(name);
    bytes.extend_from_slice(&payload);
    bytes
}

/// Resident set size of this process, in KiB.
fn rss_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

fn install(dir: &Path, file: &Path, bytes: &[u8]) {
    let tmp = dir.join(".plugin.wasm.tmp");
    std::fs::write(&tmp, bytes).expect("writing the new build");
    std::fs::rename(&tmp, file).expect("renaming the new build into place");
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn main() {
    let reloads: u32 = std::env::args()
        .skip_while(|a| a != "--reloads")
        .nth(1)
        .and_then(|n| n.parse().ok())
        .unwrap_or(1000);
    let dir: PathBuf =
        std::env::temp_dir().join(format!("snowgate-reload-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let file = dir.join("plugin.wasm");
    install(&dir, &file, &variant(0));

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async {
        let services = HostServices {
            clock: Arc::new(IdClock::system()),
            identity: Arc::new(
                MachineIdentity::fixed(SnowflakeLayout::TrtllmV1, 1).expect("in range"),
            ),
        };
        let engine = PluginEngine::new(services, PluginLimits::default()).expect("engine");
        let metrics = Arc::new(Metrics::default());
        let slot = Arc::new(
            PluginSlot::load(engine, Some(file.clone()), Vec::new(), metrics).expect("first build"),
        );

        // 1. Reload latency through the file watcher: rename -> serving.
        let debounce = Duration::from_millis(200);
        let _watcher = watch::watch_plugin_file(slot.clone(), debounce).expect("watcher");
        let mut via_watcher = Vec::new();
        for n in 1..=10 {
            let before = slot.current().info().sha256.clone();
            let started = Instant::now();
            install(&dir, &file, &variant(n));
            while slot.current().info().sha256 == before {
                assert!(
                    started.elapsed() < Duration::from_secs(30),
                    "the watcher never reloaded"
                );
                tokio::task::yield_now().await;
            }
            via_watcher.push(started.elapsed());
        }
        drop(_watcher);

        // 2. Reload cost itself (read, compile, self-check, swap) and memory
        // across many reloads.
        let warmup = 20;
        for n in 0..warmup {
            install(&dir, &file, &variant(1000 + n));
            assert!(matches!(slot.reload().await, Ok(Reloaded::Swapped(_))));
        }
        let rss_before = rss_kib();
        let mut direct = Vec::with_capacity(reloads as usize);
        for n in 0..reloads {
            install(&dir, &file, &variant(2000 + n));
            let started = Instant::now();
            let outcome = slot.reload().await;
            direct.push(started.elapsed());
            assert!(
                matches!(outcome, Ok(Reloaded::Swapped(_))),
                "reload {n}: {outcome:?}"
            );
        }
        let rss_after = rss_kib();

        println!(
            "reload latency, rename until the new build serves (watcher, {} ms debounce):",
            debounce.as_millis()
        );
        println!(
            "  median {:?}, max {:?} over {} renames",
            median(via_watcher.clone()),
            via_watcher.iter().max().unwrap(),
            via_watcher.len()
        );
        println!("reload cost without the debounce (read + compile + check + swap):");
        println!(
            "  median {:?}, max {:?} over {} reloads",
            median(direct.clone()),
            direct.iter().max().unwrap(),
            direct.len()
        );
        println!("RSS after {warmup} warm-up reloads: {} KiB", rss_before);
        println!(
            "RSS after {reloads} more reloads:   {} KiB ({:+} KiB)",
            rss_after,
            rss_after as i64 - rss_before as i64
        );
    });
    let _ = std::fs::remove_dir_all(&dir);
}
