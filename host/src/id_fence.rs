//! Where the ids a plugin call made are checked before they leave: they
//! go out only if the machine id they carry is still this process's, the
//! id clock refused the call nothing, and none could repeat an id made
//! before. Otherwise the request gets the host's 503 in place of the
//! plugin's answer. Also where a 503 for want of ids is told from a
//! plugin's own.

use snowgate_plugin::SnowflakeLayout;
use wasmtime::Store;

use crate::bindings::exports::snowgate::middleware::handler::{Action, Rejection};
use crate::id_clock::TicksTaken;
use crate::identity::{MachineIdentity, GRANT_CHANGED};
use crate::log_throttle::LogThrottle;
use crate::plugin::Plugin;
use crate::state::HostState;

/// The error codes of a 503 that says no id could be issued: the host's,
/// when it withholds a call's ids, and the bundled plugin's.
pub const ID_OUTAGE_CODES: [&str; 4] = [
    "no_machine_id",
    "no_unique_id",
    "id_rate_exceeded",
    "id_clock_exhausted",
];

/// Whether `action` rejects a request because no id could be issued for
/// it: a 503, after the host refused the call ids (`refused_ids`), or with
/// a code of [`ID_OUTAGE_CODES`].
fn for_want_of_ids(action: &Action, refused_ids: bool) -> bool {
    matches!(action, Action::Reject(r)
        if r.status == 503 && (refused_ids || ID_OUTAGE_CODES.contains(&r.code.as_str())))
}

/// A call's answer after the host's check of the ids it made.
#[derive(Debug)]
pub struct Fenced {
    /// What to do with the request: the plugin's answer, or the host's 503
    /// when it withheld the ids.
    pub action: Action,
    /// Whether the host withheld the ids the call made, answering a 503 in
    /// place of the plugin's answer: `no_machine_id` (the machine id they
    /// carry was no longer this process's to use, or they were past the
    /// high-water mark), `no_unique_id` (an id that could repeat one made
    /// before), or the id clock's refusal (`id_rate_exceeded`,
    /// `id_clock_exhausted`).
    pub ids_withheld: bool,
    /// Whether `action` rejects the request because no id could be issued
    /// for it: the host withheld the ids the call made (`ids_withheld`),
    /// or the plugin answered 503 after the host refused it the machine id
    /// or a tick of the id clock, or with one of the codes that say so
    /// ([`ID_OUTAGE_CODES`]; the bundled plugin's `no_unique_id` in the
    /// minute before a `trtllm-v2` stamp wraps is its own).
    pub ids_unavailable: bool,
    /// The ticks of the host's id clock the call took, if it took any.
    pub ticks: Option<TicksTaken>,
}

impl Plugin {
    /// Lets the ids a call made leave only if the machine id they carry is
    /// still this process's to use (see [`MachineIdentity::confirm`]), the
    /// id clock did not refuse the call a tick, and no id could repeat one
    /// made before: otherwise the request is refused with a 503 naming
    /// which (see [`Fenced::ids_withheld`]), whatever the plugin answered. Only answers
    /// that forward are checked; a call that took no tick made no id.
    pub(crate) fn fence(&self, action: Action, store: &Store<HostState>) -> Fenced {
        let state = store.data();
        let issued = state.issued;
        let let_out = |action| Fenced {
            ids_unavailable: for_want_of_ids(&action, issued.refused_ids()),
            action,
            ids_withheld: false,
            ticks: issued.taken,
        };
        // A call that asked only for the machine id (a plugin that asks
        // on every request, as the WIT invites) made no id.
        if !issued.asked_for_ticks() {
            return let_out(action);
        }
        if matches!(action, Action::Reject(_)) {
            return let_out(action);
        }
        // Ids made without asking for the machine id in this call use one
        // kept from an earlier call: of the instance's grant at the latest.
        // So a call that asked must have been given that same grant: a
        // plugin may have used a kept machine id as well.
        let other_grant = issued.grant.is_some_and(|g| g != state.created_under);
        let confirmed = if let Some(refused) = issued.refused {
            Err((refused.code(), refused.to_string()))
        } else if issued.mixed || other_grant {
            Err(("no_machine_id", GRANT_CHANGED.to_string()))
        } else {
            let identity = &self.engine.services.identity;
            identity
                .confirm(
                    Some(state.created_under),
                    issued.taken.map_or(0, |taken| taken.last.millis),
                )
                .map_err(|reason| ("no_machine_id", reason))
                .and_then(|()| unique_in(identity, issued.taken))
        };
        match confirmed {
            Ok(()) => let_out(action),
            Err((code, reason)) => {
                // Every request that needs an id is refused for the same
                // reason while it lasts: one warning a second.
                static WITHHELD: LogThrottle = LogThrottle::new();
                if let Some(held_back) = WITHHELD.admit() {
                    tracing::warn!(
                        plugin = %self.name,
                        reason = %reason,
                        "ids withheld, request answered 503 {code} {held_back}"
                    );
                }
                Fenced {
                    action: Action::Reject(Rejection {
                        status: 503,
                        code: code.to_string(),
                        message: format!(
                            "this gateway cannot issue request ids right now: {reason}"
                        ),
                    }),
                    ids_withheld: true,
                    ids_unavailable: true,
                    ticks: issued.taken,
                }
            }
        }
    }
}

/// Whether ids of the ticks `taken` with `identity`'s machine id are
/// unique in its layout: a trtllm-v2 id of the last 2^16 ms before its 39-bit stamp
/// wraps (next on 2039-09-07) equals one of the wrap's first 2^16 ms,
/// however the plugin made it. The bundled plugin refuses to make one (503
/// `no_unique_id`); a plugin that packs ids as TensorRT-LLM's formula does,
/// without that check, is held to it here. Within one period an id's
/// composition grows with its tick, so the call's last tick (the highest
/// sequence of its millisecond) tells for all; ticks that pass a wrap
/// (a long call, a wall clock stepped) may have folded in between.
fn unique_in(
    identity: &MachineIdentity,
    taken: Option<TicksTaken>,
) -> Result<(), (&'static str, String)> {
    // v1's stamp folds in 2039 too, but onto ids of 1970, which no
    // gateway made: only v2's can repeat. (The check costs a composition,
    // and v1 calls skip it.)
    let layout = identity.layout();
    let Some(taken) = taken.filter(|_| layout == SnowflakeLayout::TrtllmV2) else {
        return Ok(());
    };
    let machine_id = identity
        .current()
        .map_or(layout.max_machine_id(), |id| id.value);
    let period = 1u64 << 39;
    let (first, last) = (taken.first.millis, taken.last.millis);
    if last - first >= period || last % period < first % period {
        return Err((
            "no_unique_id",
            format!(
                "the call's ids span the {layout} timestamp's wrap (milliseconds {first} to \
                 {last}), where ids of the minute before it equal ids of the minute after"
            ),
        ));
    }
    layout
        .compose_unique(last, machine_id, taken.last.sequence)
        .map(drop)
        .map_err(|e| ("no_unique_id", e.to_string()))
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::call::tests::{ask_machine_id, let_out, plugin, take_tick, withheld};
    use crate::engine::{HostServices, PluginEngine};
    use crate::limits::PluginLimits;

    /// Which rejects are for want of ids: a 503 after the host refused the
    /// call ids, or with a code that says so (the bundled plugin answers
    /// `no_unique_id` itself in the minute before a `trtllm-v2` stamp
    /// wraps, which a review found counted as `rejected`); not another
    /// status, nor another 503 of a call the host refused nothing.
    #[test]
    fn a_503_for_want_of_ids_is_told_by_its_code_or_by_what_the_host_refused() {
        let reject = |status: u16, code: &str| {
            Action::Reject(Rejection {
                status,
                code: code.into(),
                message: String::new(),
            })
        };
        for code in ID_OUTAGE_CODES {
            assert!(for_want_of_ids(&reject(503, code), false), "{code}");
        }
        assert!(for_want_of_ids(&reject(503, "its_own"), true));
        assert!(!for_want_of_ids(&reject(503, "its_own"), false));
        assert!(!for_want_of_ids(&reject(400, "invalid_json"), true));
        assert!(!for_want_of_ids(&reject(429, "no_machine_id"), false));
        assert!(!for_want_of_ids(&Action::Forward, true));
    }

    #[test]
    fn ids_made_while_the_machine_id_grant_changed_are_withheld() {
        let plugin = plugin(PluginLimits::default());
        let identity = plugin.engine.services.identity.clone();
        let stamped = || Action::ForwardWithBody(b"{}".to_vec());

        // The control: asked once, under the grant the instance was made
        // under, and still current.
        let mut store = plugin.new_store();
        assert_eq!(ask_machine_id(&mut store), 7);
        take_tick(&mut store);
        assert!(let_out(&plugin.fence(stamped(), &store)));

        // Given machine ids of two grants in one call (a plugin that asks
        // once per id): the ids carry two machine ids, one no longer ours.
        let mut store = plugin.new_store();
        assert_eq!(ask_machine_id(&mut store), 7);
        take_tick(&mut store);
        identity.assign(8).expect("in range");
        assert_eq!(ask_machine_id(&mut store), 8);
        take_tick(&mut store);
        let answer = plugin.fence(stamped(), &store);
        assert!(withheld(&answer), "{answer:?}");

        // An instance made under the old grant that asks once, under the
        // new one: it may also have used a machine id it kept.
        let mut store = plugin.new_store();
        identity.assign(9).expect("in range");
        assert_eq!(ask_machine_id(&mut store), 9);
        take_tick(&mut store);
        let answer = plugin.fence(stamped(), &store);
        assert!(withheld(&answer), "{answer:?}");

        // Ids made without asking, by an instance of an earlier grant:
        // with a kept machine id that is no longer ours.
        let mut store = plugin.new_store();
        identity.assign(10).expect("in range");
        take_tick(&mut store);
        let answer = plugin.fence(stamped(), &store);
        assert!(withheld(&answer), "{answer:?}");
        // The same answer with no id made passes: there is nothing to
        // withhold; so does one whose call asked for the machine id, of
        // another grant, but took no tick.
        let store = plugin.new_store();
        identity.assign(11).expect("in range");
        assert!(let_out(&plugin.fence(stamped(), &store)));
        let mut store = plugin.new_store();
        identity.assign(12).expect("in range");
        assert_eq!(ask_machine_id(&mut store), 12);
        assert!(let_out(&plugin.fence(stamped(), &store)));
        identity.assign(11).expect("in range");

        // And a fresh instance under the current grant stamps again.
        let mut store = plugin.new_store();
        assert_eq!(ask_machine_id(&mut store), 11);
        take_tick(&mut store);
        assert!(let_out(&plugin.fence(stamped(), &store)));
    }

    /// A trtllm-v2 id of the minute before its stamp wraps (2039) equals
    /// one of the minute after: withheld however the plugin made it.
    #[test]
    fn v2_ids_of_the_minute_before_the_stamp_wraps_are_withheld() {
        let wrap = 4u64 << 39;
        // Compiled once: each case's engine reads the build from here.
        let cache = std::env::temp_dir().join(format!("snowgate-v2-fold-{}", std::process::id()));
        // A call that takes a tick at each of `millis` (the wall clock
        // moved on between them).
        let fenced = |millis: &[u64]| {
            let (clock, wall) = crate::id_clock::tests::hand_clock(millis[0]);
            let services = HostServices {
                clock: Arc::new(clock),
                identity: Arc::new(
                    MachineIdentity::fixed(SnowflakeLayout::TrtllmV2, 3).expect("in range"),
                ),
            };
            let engine = PluginEngine::new(services, PluginLimits::default())
                .expect("engine")
                .with_compile_cache(crate::CompileCache::open(&cache).expect("a cache"));
            let plugin = Plugin::load(&engine, snowgate_plugin_bundle::PLUGIN_WASM, &[])
                .expect("bundled plugin");
            plugin.keep_compiled();
            let mut store = plugin.new_store();
            for &at in millis {
                wall.store(at, std::sync::atomic::Ordering::SeqCst);
                take_tick(&mut store);
            }
            plugin.fence(Action::ForwardWithBody(b"{}".to_vec()), &store)
        };
        let no_unique_id = |answer: &Fenced| {
            answer.ids_withheld
                && matches!(&answer.action, Action::Reject(r) if r.status == 503 && r.code == "no_unique_id")
        };
        let answer = fenced(&[wrap - 1000]);
        assert!(no_unique_id(&answer), "{answer:?}");
        // Ticks on both sides of the minute, and of the wrap.
        let answer = fenced(&[wrap - 70_000, wrap - 1000, wrap + 10]);
        assert!(no_unique_id(&answer), "{answer:?}");
        let answer = fenced(&[wrap - 70_000, wrap + 10]);
        assert!(no_unique_id(&answer), "{answer:?}");
        // The minute's exact edge, for machine 3 (not one millisecond more,
        // as for the largest machine id), and the wrap itself.
        for millis in [wrap - (1 << 16) - 1, wrap, wrap + 70_000] {
            assert!(let_out(&fenced(&[millis])), "{millis}");
        }
        let _ = std::fs::remove_dir_all(&cache);
    }
}
