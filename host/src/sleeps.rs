//! A plugin's sleeps never outlast its call's deadline.
//!
//! Call deadlines are enforced by epoch ticks, and a tick interrupts only
//! running wasm code. A plugin that sleeps (Rust's `std::thread::sleep` is
//! `wasi:clocks/monotonic-clock`'s `subscribe-duration`, then
//! `wasi:io/poll`'s `poll`) waits inside the host, where no tick reaches
//! it: it would hold its instance slot, its call permit and its request (or,
//! in a sync call, its thread) for as long as it asked.
//!
//! So the host replaces WASI's two clock subscriptions. A wait that ends
//! before the call's deadline works as WASI specifies. A wait that would end
//! after it ends the call at once with the deadline error: no plugin can
//! wait its way past its deadline, and the caller learns so without waiting.

use std::time::{Duration, Instant};

use wasmtime::component::{Linker, Resource, ResourceTable};
use wasmtime::error::Context as _;
use wasmtime::Trap;
use wasmtime_wasi::p2::{subscribe, DynPollable, Pollable};
use wasmtime_wasi::HostMonotonicClock;

use crate::state::HostState;

/// The WASI interface whose subscriptions are replaced, at the version
/// `wasmtime-wasi` defines it (a plugin importing an older 0.2 version is
/// linked to this one).
const MONOTONIC_CLOCK: &str = "wasi:clocks/monotonic-clock@0.2.12";

/// Replaces WASI's `subscribe-duration` and `subscribe-instant` in `linker`
/// (which must already have WASI) with ones bounded by the call's deadline.
pub(crate) fn bound_by_the_deadline(linker: &mut Linker<HostState>) -> anyhow::Result<()> {
    linker.allow_shadowing(true);
    let mut clock = linker
        .instance(MONOTONIC_CLOCK)
        .with_context(|| format!("finding {MONOTONIC_CLOCK} in the linker"))?;
    clock
        .func_wrap("subscribe-duration", |mut store, (nanos,): (u64,)| {
            let state: &mut HostState = store.data_mut();
            Ok((wait(state, Duration::from_nanos(nanos))?,))
        })
        .context("replacing monotonic-clock.subscribe-duration")?;
    clock
        .func_wrap("subscribe-instant", |mut store, (when,): (u64,)| {
            let state: &mut HostState = store.data_mut();
            let now = PluginMonotonicClock.now();
            Ok((wait(state, Duration::from_nanos(when.saturating_sub(now)))?,))
        })
        .context("replacing monotonic-clock.subscribe-instant")?;
    linker.allow_shadowing(false);
    Ok(())
}

/// A pollable that is ready `duration` from now, or the deadline error if
/// that is after the call's deadline.
fn wait(state: &mut HostState, duration: Duration) -> wasmtime::Result<Resource<DynPollable>> {
    let now = Instant::now();
    let until = now.checked_add(duration);
    // Every call sets a deadline before the plugin runs; without one (or
    // for a wait too long to represent) the wait is refused, not unbounded.
    let within = match (until, state.clock.deadline()) {
        (Some(until), Some(deadline)) => until <= deadline,
        _ => false,
    };
    let Some(until) = until.filter(|_| within) else {
        return Err(wasmtime::Error::new(Trap::Interrupt).context(format!(
            "the plugin asked to wait {duration:?}, past its call's deadline"
        )));
    };
    subscribe_sleep(state.resources(), until)
}

fn subscribe_sleep(
    table: &mut ResourceTable,
    until: Instant,
) -> wasmtime::Result<Resource<DynPollable>> {
    let sleep = table.push(Sleep {
        until: tokio::time::Instant::from_std(until),
    })?;
    subscribe(table, sleep)
}

/// A wait that the host's event loop (or, for sync calls, WASI's own
/// runtime) ends at `until`.
struct Sleep {
    until: tokio::time::Instant,
}

#[wasmtime_wasi::async_trait]
impl Pollable for Sleep {
    async fn ready(&mut self) {
        tokio::time::sleep_until(self.until).await;
    }
}

/// The monotonic clock plugins read: nanoseconds since the first reading in
/// this process. `subscribe-instant` takes instants on this clock, so the
/// host must know it; WASI's default clock is private to `wasmtime-wasi`.
pub(crate) struct PluginMonotonicClock;

impl HostMonotonicClock for PluginMonotonicClock {
    fn resolution(&self) -> u64 {
        1
    }

    fn now(&self) -> u64 {
        static START: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
        let start = *START.get_or_init(Instant::now);
        u64::try_from(start.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }
}
