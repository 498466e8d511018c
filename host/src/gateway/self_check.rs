//! The self-check every new plugin build passes before it serves: canned
//! requests on one fresh instance (the first call is made again, up to
//! twice, each on a fresh instance, while it took the first tick of its
//! millisecond), called as the gateway's kept instances
//! are, whose ids must be made of the host's layout, its machine id and
//! the very ticks each call took from the host's id clock. A build whose
//! ids are its own would repeat ids, and the host's check of each call,
//! which looks only at the ticks taken, would not see it.
//!
//! `run` makes the calls and judges each answer; the reload slot
//! ([`crate::gateway::slot`]) loads a build, runs it, and swaps in only a
//! build that passed.

use anyhow::Context as _;
use snowgate_plugin::SnowflakeLayout;

use crate::bindings::exports::snowgate::middleware::handler::{Action, Rejection};
use crate::call::{CallError, SelfCheckAnswer};
use crate::engine::PluginEngine;
use crate::id_clock::{Tick, TicksTaken};
use crate::id_fence::Fenced;
use crate::plugin::Plugin;
use crate::request::Request;
use crate::text_limits::{plugin_reason, plugin_text, MAX_PLUGIN_TEXT};

/// The body of the canned request every new build must stamp (or reject
/// for want of credentials) before it may serve. The WIT's package docs describe this request.
const SELF_CHECK_BODY: &[u8] =
    br#"{"model":"snowgate-self-check","prompt":"","max_tokens":1,"disaggregated_params":{"request_type":"context_only"}}"#;

/// Runs the self-check on `plugin`, loaded in `engine` (see
/// [`load_checked`](crate::gateway::slot::load_checked) for what it asks):
/// what it could not see of a build that may serve (a call the build
/// rejected for want of credentials, or a batch it does not take), or why
/// the build may not serve, or cannot be judged now ([`CannotCheckNow`]).
pub(crate) fn run(engine: &PluginEngine, plugin: &Plugin) -> anyhow::Result<Vec<String>> {
    let identity = &engine.services().identity;
    let grant = identity.generation();
    let first_call = || {
        let mut instance = plugin.instance_for_self_check()?;
        let answer = instance.handle(&Canned::One.request())?;
        Ok::<_, CallError>((instance, answer))
    };
    let (mut instance, mut answer) = first_call().with_context(|| Canned::One.failed())?;
    // The build's one tick the first of its millisecond: the millisecond
    // turned between the host's spare tick and the build's, and a build
    // that drops the sequence would pass. Asked again, up to twice, each
    // time on a fresh instance.
    for _ in 0..SELF_CHECK_RETRIES {
        let first_of_its_millisecond = answer
            .fenced
            .ticks
            .is_some_and(|taken| taken.count == 1 && taken.first.sequence == 0);
        if !first_of_its_millisecond {
            break;
        }
        // Let go first: the check holds one of the pool's slots, not two.
        drop(instance);
        (instance, answer) = first_call().with_context(|| Canned::One.failed())?;
    }
    let made = HostIds {
        layout: identity.layout(),
        machine_id: identity.current().ok().map(|machine| machine.value),
    };
    let no_ids_now = || {
        why_no_ids_may_leave(engine).or_else(|| {
            // An id granted during the call: the plugin may have asked
            // before, and found none.
            (identity.generation() != grant)
                .then(|| "the machine id changed during the self-check".to_string())
        })
    };
    // A build that stamped the one request is called again on the same
    // instance, as kept instances are: with the same request, where one
    // that keeps an id (or what it made one of) from its instance's first
    // call shows it, and then with a batch, where one that repeats an id
    // within a call does.
    // A call the id clock refused a tick (ids asked for faster than the
    // layout makes them, the clock at its lead) cannot show what the
    // build does either: its 503 is the host's doing, and passes.
    let judge = |canned, answer: SelfCheckAnswer| {
        let refused = answer.clock_refused;
        judge_self_check(plugin, canned, answer.fenced, &answer.ticks, &made, || {
            no_ids_now().or_else(|| {
                refused.map(|refused| format!("the id clock refused it a tick: {refused}"))
            })
        })
    };
    let mut unchecked = Vec::new();
    match judge(Canned::One, answer)? {
        Judged::Unchecked(what) => unchecked.push(what),
        Judged::Stamped => {
            for canned in [Canned::Again, Canned::Batch] {
                let answer = instance
                    .handle(&canned.request())
                    .with_context(|| canned.failed())?;
                if let Judged::Unchecked(what) = judge(canned, answer)? {
                    unchecked.push(what);
                }
            }
        }
    }
    drop(instance);
    Ok(unchecked)
}

/// A self-check that cannot judge a build now: the host holds no machine
/// id it may use (why is inside), so the build's refusal for want of one
/// cannot be told from a build that refuses everything.
#[derive(Debug)]
pub(crate) struct CannotCheckNow {
    /// Why the host holds no machine id it may use now.
    pub(crate) reason: String,
    /// The build's.
    pub(crate) sha256: String,
}

impl CannotCheckNow {
    /// `plugin`'s build cannot be checked now, for `reason`.
    pub(crate) fn of(plugin: &Plugin, reason: String) -> CannotCheckNow {
        CannotCheckNow {
            reason,
            sha256: plugin.info().sha256.clone(),
        }
    }
}

impl std::fmt::Display for CannotCheckNow {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "self-check: the host holds no machine id it may use now ({}), so the build cannot \
             show that it stamps",
            self.reason
        )
    }
}

impl std::error::Error for CannotCheckNow {}

/// How many times the self-check asks again when the build's one tick was
/// the first of its millisecond (see [`run`]).
const SELF_CHECK_RETRIES: usize = 2;

/// The self-check's calls, as a tool that reports on it names them.
pub const SELF_CHECK_CALLS: &str =
    "a context-only request, the same again on the same instance, and a batch of two";

/// The canned requests of the self-check, one after another on one
/// instance.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Canned {
    /// One context-only request ([`SELF_CHECK_BODY`]), the instance's
    /// first call.
    One,
    /// The same again, the instance's second call.
    Again,
    /// A batch of two, the instance's third call: a JSON array of
    /// [`SELF_CHECK_BODY`] twice.
    Batch,
}

impl Canned {
    /// The request, `POST /v1/completions` of JSON.
    fn request(self) -> Request {
        let body = match self {
            Canned::One | Canned::Again => SELF_CHECK_BODY.to_vec(),
            Canned::Batch => [&b"["[..], SELF_CHECK_BODY, b",", SELF_CHECK_BODY, b"]"].concat(),
        };
        Request {
            method: "POST".into(),
            path: "/v1/completions".into(),
            headers: vec![("content-type".into(), b"application/json".to_vec())].into(),
            body,
        }
    }

    /// What the self-check's messages call it.
    fn named(self) -> &'static str {
        match self {
            Canned::One => "a canned context-only request",
            Canned::Again => "a canned context-only request again (its instance's second call)",
            Canned::Batch => {
                "a canned batch of two context-only requests (its instance's third call)"
            }
        }
    }

    /// The self-check's words for a call that failed.
    fn failed(self) -> String {
        format!("self-check: the plugin failed on {}", self.named())
    }

    /// The ids of the answer's body `value`, in order, or which one is
    /// missing.
    fn ids(self, value: &serde_json::Value) -> Result<Vec<u64>, &'static str> {
        let id = |request: &serde_json::Value| {
            request["disaggregated_params"]["disagg_request_id"].as_u64()
        };
        match self {
            Canned::One | Canned::Again => id(value).map(|id| vec![id]).ok_or("the request"),
            Canned::Batch => match value.as_array().map(Vec::as_slice) {
                Some([first, second]) => {
                    let first = id(first).ok_or("the batch's first request")?;
                    let second = id(second).ok_or("the batch's second request")?;
                    Ok(vec![first, second])
                }
                _ => Err("a batch of two (the body is no longer an array of two)"),
            },
        }
    }
}

/// What the self-check's id must carry besides a tick of the call: the
/// host's layout and machine id.
struct HostIds {
    layout: SnowflakeLayout,
    machine_id: Option<u32>,
}

impl HostIds {
    /// Why `id` was not made as the contract says (see [`run`]),
    /// if it was not: of this layout and machine id, and of a tick the call
    /// took (`taken`, each of which is in `exact` where it holds them
    /// all). A build whose id is its own (a counter, a constant, another
    /// layout or machine id, the millisecond without the sequence, the
    /// tick after one it took) would repeat ids, and the host's check of
    /// each call's ids, which looks at the ticks it took, would not see it.
    fn misfit(&self, id: u64, taken: Option<TicksTaken>, exact: &[Tick]) -> Option<String> {
        let layout = self.layout;
        let Some(taken) = taken else {
            if let Err(e) = layout.decode(id) {
                return Some(format!("it is not an id of layout {layout}: {e}"));
            }
            return Some("the plugin took no tick of the host's id clock to make it".to_string());
        };
        // As `layout` keeps the millisecond (39 bits of it in trtllm-v2).
        let kept = |layout: SnowflakeLayout, tick: Tick| (layout.stamp(tick.millis), tick.sequence);
        // One tick taken: the id must be made of it. More: of one of them
        // where each is known; else of one from the first to the last
        // (other calls' ticks fall between), any across a 39-bit wrap
        // (2039).
        let all_known = taken.count == exact.len() as u64;
        let of_the_call = |layout: SnowflakeLayout, made: (u64, u32)| {
            let (first, last) = (kept(layout, taken.first), kept(layout, taken.last));
            match taken.count {
                1 => made == first,
                _ if all_known => exact.iter().any(|&tick| kept(layout, tick) == made),
                _ => first > last || (first..=last).contains(&made),
            }
        };
        let machine = |machine_id: u32| self.machine_id.is_none_or(|held| held == machine_id);
        // Whether `id` is of `layout`, made of the host's machine id and a
        // tick of the call. A v1 id from 2039 on reads two ways (see
        // `readings`).
        let made_in = |layout: SnowflakeLayout| {
            layout.decode(id).is_ok()
                && layout
                    .readings(id)
                    .any(|p| machine(p.machine_id) && of_the_call(layout, (p.millis, p.sequence)))
        };
        if made_in(layout) {
            return None;
        }
        // A build that ignores the layout the machine-id import names: its
        // id reads as a wrong machine id or tick in the host's layout,
        // which would send its author after the wrong fault.
        if let Some(other) = SnowflakeLayout::ALL
            .into_iter()
            .find(|&other| other != layout && made_in(other))
        {
            return Some(format!(
                "it is an id of layout {other}, not of the host's {layout}: the plugin must make \
                 ids of the layout the machine-id import names, or refuse to"
            ));
        }
        let read = match layout.decode(id) {
            Ok(read) => read,
            Err(e) => return Some(format!("it is not an id of layout {layout}: {e}")),
        };
        let (first, last) = (kept(layout, taken.first), kept(layout, taken.last));
        let ticks = match taken.count {
            1 => format!("the one it took, {first:?}"),
            n if all_known => {
                let each: Vec<_> = exact.iter().map(|&tick| kept(layout, tick)).collect();
                format!("one of the {n} it took, {each:?}")
            }
            n => format!("from its first, {first:?}, to its last, {last:?} ({n} taken)"),
        };
        Some(
            match self.machine_id.filter(|&held| held != read.machine_id) {
                Some(held) => format!(
                    "it carries machine id {}, not the host's {held}",
                    read.machine_id
                ),
                None => format!(
                    "its (millisecond, sequence), ({}, {}), is not a tick the host's id clock \
                     gave the call: {ticks}",
                    read.millis, read.sequence
                ),
            },
        )
    }
}

/// How the self-check judged one answer that lets the build serve.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Judged {
    /// Stamped with ids made as the contract says.
    Stamped,
    /// Rejected, sending nothing on: what was not checked, and why.
    Unchecked(String),
}

/// Whether the self-check's answer to `canned` lets the build serve (see
/// [`run`]), the call having taken `ticks` (all of them, or none
/// known); `made` is what its ids must be made of, and `no_ids_now` tells
/// why the host holds no machine id it may use now, if it holds none.
fn judge_self_check(
    plugin: &Plugin,
    canned: Canned,
    answer: Fenced,
    ticks: &[Tick],
    made: &HostIds,
    no_ids_now: impl Fn() -> Option<String>,
) -> anyhow::Result<Judged> {
    let asked = canned.named();
    match answer.action {
        Action::ForwardWithBody(body) => {
            let value: serde_json::Value = serde_json::from_slice(&body).with_context(|| {
                format!("self-check: the plugin answered {asked} with a body that is not JSON")
            })?;
            let ids = canned.ids(&value).map_err(|which| {
                anyhow::anyhow!(
                    "self-check: the plugin did not stamp an integer disagg_request_id on {which} \
                     of {asked}"
                )
            })?;
            for &id in &ids {
                if let Some(misfit) = made.misfit(id, answer.ticks, ticks) {
                    // The machine id changed after the host let the id out.
                    if let Some(reason) = no_ids_now() {
                        return Err(CannotCheckNow::of(plugin, reason).into());
                    }
                    anyhow::bail!(
                        "self-check: on {asked}, the plugin stamped the id {id}, which is not made \
                         of the host's clock and machine id, so it could repeat: {misfit}"
                    );
                }
            }
            if let [first, second] = ids[..] {
                if first == second {
                    anyhow::bail!(
                        "self-check: the plugin stamped the same id, {first}, on both requests of \
                         {asked}: it would repeat ids"
                    );
                }
            }
        }
        // The host withheld the self-check's id: the plugin took a tick,
        // and the refusal is the host's, so what the plugin would have
        // sent on is not known.
        Action::Reject(_) if answer.ids_withheld => {
            return Err(
                CannotCheckNow::of(plugin, "it withheld the id the self-check took".into()).into(),
            )
        }
        // The plugin refused for want of a machine id, or refuses
        // everything: which, cannot be told until the host holds one.
        Action::Reject(r) if r.status == 503 => {
            return Err(match no_ids_now() {
                Some(reason) => CannotCheckNow::of(plugin, reason).into(),
                None => refused(canned, r),
            });
        }
        // For want of credentials, on the instance's first call (its
        // second, the same request, was stamped by the first: a 401 there
        // is what the instance kept from it); or a plugin that takes no
        // batches.
        Action::Reject(r)
            if (canned == Canned::One && matches!(r.status, 401 | 403))
                || (canned == Canned::Batch && r.status < 500) =>
        {
            let (sends, what) = match canned {
                Canned::Batch => ("no batch on", "it stamps batches"),
                _ => ("nothing on without an id", "it stamps"),
            };
            let unchecked = format!(
                "the plugin rejected {asked} ({} {}: {}); it may serve, as it sends {sends}, but \
                 whether {what} was not checked",
                r.status,
                plugin_text(r.code, MAX_PLUGIN_TEXT),
                plugin_reason(r.message, MAX_PLUGIN_TEXT)
            );
            tracing::warn!(plugin = %plugin.info().name, "self-check: {unchecked}");
            return Ok(Judged::Unchecked(unchecked));
        }
        Action::Reject(r) => return Err(refused(canned, r)),
        Action::Forward => {
            anyhow::bail!("self-check: the plugin forwarded {asked} unstamped")
        }
    }
    Ok(Judged::Stamped)
}

/// The self-check's refusal of a build that rejected its valid `canned`
/// request.
fn refused(canned: Canned, r: Rejection) -> anyhow::Error {
    let (valid, may_pass) = match canned {
        Canned::One => (
            "context-only request",
            "only 401 and 403, for credentials the canned request cannot carry",
        ),
        Canned::Again => (
            "context-only request (its instance's second call)",
            "none, since its first call stamped the same request: it kept something from that \
             call",
        ),
        Canned::Batch => (
            "batch of two context-only requests (its instance's third call)",
            "only a status under 500, from a plugin that takes no batches",
        ),
    };
    anyhow::anyhow!(
        "self-check: the plugin rejected a valid {valid} with {} {}: {} ({may_pass}, may pass)",
        r.status,
        plugin_text(r.code, MAX_PLUGIN_TEXT),
        plugin_reason(r.message, MAX_PLUGIN_TEXT)
    )
}

/// Why the host would not let an id made now out, if it would not (see
/// [`HostServices::ids_may_leave_now`]).
pub(crate) fn why_no_ids_may_leave(engine: &PluginEngine) -> Option<String> {
    engine.services().ids_may_leave_now().err()
}

#[cfg(test)]
pub(crate) mod tests {
    use std::sync::Arc;
    use std::time::SystemTime;

    use snowgate_plugin::SnowflakeLayout;

    use super::*;
    use crate::engine::HostServices;
    use crate::gateway::slot::load_checked;
    use crate::id_clock::IdClock;
    use crate::identity::MachineIdentity;
    use crate::limits::PluginLimits;
    use crate::utc::millis_of;

    /// An engine on the system clock with machine id 3 in trtllm-v1, and
    /// the bundled plugin loaded in it (not checked).
    pub(crate) fn bundled_with_machine_id_3() -> (PluginEngine, Plugin) {
        let identity = Arc::new(MachineIdentity::fixed(SnowflakeLayout::TrtllmV1, 3).unwrap());
        let services = HostServices {
            clock: Arc::new(IdClock::system()),
            identity,
        };
        let engine = PluginEngine::new(services, PluginLimits::default()).expect("an engine");
        let plugin =
            Plugin::load(&engine, snowgate_plugin_bundle::PLUGIN_WASM, &[]).expect("loads");
        (engine, plugin)
    }

    /// A build whose tick the id clock refused (ids asked for faster than
    /// the layout makes them: the clock at its lead) answers 503, which is
    /// the host's doing: the build cannot be judged now, and is checked
    /// again later, not refused (and a refusal is remembered, and not
    /// compiled again, until its file changes).
    #[test]
    fn a_build_whose_tick_the_clock_refused_is_judged_later() {
        use crate::id_clock::FixedClock;
        let clock = Arc::new(
            IdClock::new(FixedClock(1_764_000_000_000)).with_max_lead(std::time::Duration::ZERO),
        );
        while clock.next_tick(4096).is_ok() {}
        let services = HostServices {
            clock,
            identity: Arc::new(MachineIdentity::fixed(SnowflakeLayout::TrtllmV1, 3).unwrap()),
        };
        let engine = PluginEngine::new(services, PluginLimits::default()).expect("an engine");
        let settings = [("hostile-ids".to_string(), "reject-refused".to_string())];
        let plugin =
            Plugin::load(&engine, snowgate_test_fixtures::HOSTILE_WASM, &settings).expect("loads");
        let error = run(&engine, &plugin).expect_err("not passed");
        let later = error
            .chain()
            .find_map(|cause| cause.downcast_ref::<CannotCheckNow>())
            .unwrap_or_else(|| panic!("refused, not put off: {error:#}"));
        assert!(
            later.reason.contains("the id clock refused it a tick"),
            "{later:?}"
        );
    }

    /// A plugin's own 503 (no tick taken) is judged only while the host
    /// holds a machine id: refused then, and while it holds none, neither
    /// passed nor refused but put off, naming why.
    #[test]
    fn a_plugins_503_is_put_off_while_the_host_holds_no_machine_id() {
        let (_engine, plugin) = bundled_with_machine_id_3();
        let refusal = || Fenced {
            action: Action::Reject(Rejection {
                status: 503,
                code: "no_machine_id".into(),
                message: "no machine id".into(),
            }),
            ids_withheld: false,
            ids_unavailable: true,
            ticks: None,
        };
        let error = judge_self_check(&plugin, Canned::One, refusal(), &[], &host_ids(), || {
            Some("the lease lapsed".into())
        })
        .expect_err("not passed");
        let put_off = error
            .downcast_ref::<CannotCheckNow>()
            .expect("put off, not refused");
        assert_eq!(put_off.sha256, plugin.info().sha256);
        assert!(
            format!("{error:#}").contains("(the lease lapsed)"),
            "{error:#}"
        );
        let error = judge_self_check(&plugin, Canned::One, refusal(), &[], &host_ids(), || None)
            .expect_err("refused");
        assert!(error.downcast_ref::<CannotCheckNow>().is_none());
        assert!(
            format!("{error:#}").contains("rejected a valid context-only request with 503"),
            "{error:#}"
        );
    }

    /// A host idle past its high-water mark (the disk stopped taking
    /// writes, no request since) holds no id it may let out, though no
    /// tick has passed the mark yet: a build is not checked then. Before,
    /// the question looked only at the last tick, the self-check's id was
    /// withheld, and a withheld id passed the build unseen. A withheld id is
    /// put off even once the mark is raised before the answer is judged (as
    /// the keeper raises it as soon as ids reach it), not refused as the
    /// plugin's own 503.
    #[test]
    fn a_build_is_not_checked_past_the_mark_even_before_any_id_passes_it() {
        let identity = Arc::new(MachineIdentity::fixed(SnowflakeLayout::TrtllmV1, 3).unwrap());
        let past = millis_of(SystemTime::now()) - 1_000;
        identity.bound_by_file_mark(past, past);
        let services = HostServices {
            clock: Arc::new(IdClock::system()),
            identity: identity.clone(),
        };
        let engine = PluginEngine::new(services, PluginLimits::default()).expect("an engine");
        let idle = why_no_ids_may_leave(&engine).expect("past the mark, idle");
        assert!(idle.contains("past the high-water mark"), "{idle}");
        let error = load_checked(&engine, snowgate_plugin_bundle::PLUGIN_WASM, &[])
            .expect_err("not checked past the mark");
        assert!(
            error.downcast_ref::<CannotCheckNow>().is_some(),
            "{error:#}"
        );

        let plugin =
            Plugin::load(&engine, snowgate_plugin_bundle::PLUGIN_WASM, &[]).expect("loads");
        let answer = plugin
            .instance_for_self_check()
            .and_then(|mut instance| instance.handle(&Canned::One.request()))
            .expect("answers")
            .fenced;
        assert!(answer.ids_withheld, "{:?}", answer.action);
        // The keeper raises the mark before the answer is judged.
        identity.ceiling_raised(past + 60_000, past + 30_000);
        assert_eq!(why_no_ids_may_leave(&engine), None, "the mark is raised");
        let error = judge_self_check(&plugin, Canned::One, answer, &[], &host_ids(), || {
            why_no_ids_may_leave(&engine)
        })
        .expect_err("put off");
        assert!(
            error
                .downcast_ref::<CannotCheckNow>()
                .is_some_and(|c| c.reason.contains("withheld")),
            "{error:#}"
        );
        // And with the mark raised, the build stamps.
        load_checked(&engine, snowgate_plugin_bundle::PLUGIN_WASM, &[]).expect("stamps");
    }

    /// In the 65.536 s before trtllm-v2's stamp wraps, where the plugin
    /// answers 503 `no_unique_id`, the host says no id may leave (so
    /// `/readyz` answers 503), and a build is put off, not refused as one
    /// that rejects valid requests.
    #[test]
    fn a_build_is_put_off_in_the_minute_before_the_v2_stamp_wraps() {
        let v2 = SnowflakeLayout::TrtllmV2;
        let wrap = 4u64 << 39;
        let services = |millis: u64| HostServices {
            clock: Arc::new(IdClock::new(crate::id_clock::FixedClock(millis))),
            identity: Arc::new(MachineIdentity::fixed(v2, 3).unwrap()),
        };
        let folding = services(wrap - 1000);
        let why = folding.ids_may_leave_now().expect_err("no unique id");
        assert!(
            why.contains("before the layout's 39-bit timestamp wraps"),
            "{why}"
        );
        let engine = PluginEngine::new(folding, PluginLimits::default()).expect("an engine");
        let error = load_checked(&engine, snowgate_plugin_bundle::PLUGIN_WASM, &[])
            .expect_err("not checked");
        assert!(
            error.downcast_ref::<CannotCheckNow>().is_some(),
            "{error:#}"
        );
        for millis in [wrap - (1 << 16) - 2, wrap] {
            let engine =
                PluginEngine::new(services(millis), PluginLimits::default()).expect("an engine");
            assert_eq!(engine.services().ids_may_leave_now(), Ok(()), "{millis}");
            load_checked(&engine, snowgate_plugin_bundle::PLUGIN_WASM, &[])
                .unwrap_or_else(|e| panic!("{millis}: {e:#}"));
        }
    }

    /// A wall clock a millisecond further at every reading: every tick
    /// of the id clock is the first of its millisecond.
    struct Racing(std::sync::atomic::AtomicU64);

    impl crate::id_clock::WallClock for Racing {
        fn now_millis(&self) -> u64 {
            self.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        }
    }

    /// Where the build's one tick is the first of its millisecond (the
    /// millisecond turned after the host's spare tick), the self-check asks
    /// again, twice at most, each time on a fresh instance: a build that
    /// drops the sequence would pass such a check. Where it is not, once.
    /// The same again and the batch are asked once, after the last. Each
    /// check lets its instance go before the next is made: the check holds
    /// one of the pool's slots, and here the pool has only one.
    #[test]
    fn a_self_check_whose_tick_began_a_millisecond_is_asked_again() {
        let ticks_taken = |clock: IdClock| {
            let clock = Arc::new(clock);
            let services = HostServices {
                clock: clock.clone(),
                identity: Arc::new(MachineIdentity::fixed(SnowflakeLayout::TrtllmV1, 3).unwrap()),
            };
            let one_slot = PluginLimits {
                max_instances: 1,
                ..PluginLimits::default()
            };
            let engine = PluginEngine::new(services, one_slot).expect("an engine");
            load_checked(&engine, snowgate_plugin_bundle::PLUGIN_WASM, &[]).expect("stamps");
            clock.issued()
        };
        let now = millis_of(SystemTime::now());
        // Two ticks a check of the one request (the host's spare, the
        // build's); then, once, one for the same again and two for the
        // batch.
        assert_eq!(
            ticks_taken(IdClock::new(crate::id_clock::FixedClock(now))),
            2 + 1 + 2
        );
        let racing = Racing(std::sync::atomic::AtomicU64::new(now));
        assert_eq!(
            ticks_taken(IdClock::new(racing)),
            2 * (1 + SELF_CHECK_RETRIES as u64) + 1 + 2
        );
    }

    /// Machine id 3 in trtllm-v1.
    fn host_ids() -> HostIds {
        HostIds {
            layout: SnowflakeLayout::TrtllmV1,
            machine_id: Some(3),
        }
    }

    /// The ticks of a call that took `count`, from `first` to `last`.
    fn took(first: (u64, u32), last: (u64, u32), count: u64) -> Option<TicksTaken> {
        let tick = |(millis, sequence)| Tick { millis, sequence };
        Some(TicksTaken {
            first: tick(first),
            last: tick(last),
            count,
        })
    }

    /// A self-check call records each tick it took (not the host's spare
    /// one), in order, so that the batch's ids are judged against those
    /// ticks, not against the range from the first to the last; up to 16,
    /// past which the range serves.
    #[test]
    fn a_self_check_call_records_each_tick_it_took() {
        let (_engine, plugin) = bundled_with_machine_id_3();
        let mut instance = plugin.instance_for_self_check().expect("an instance");
        let one = instance.handle(&Canned::One.request()).expect("answers");
        let taken = one.fenced.ticks.expect("a tick");
        assert_eq!(one.ticks, vec![taken.first]);
        let batch = instance.handle(&Canned::Batch.request()).expect("answers");
        let taken = batch.fenced.ticks.expect("ticks");
        assert_eq!(batch.ticks, vec![taken.first, taken.last]);
        let Action::ForwardWithBody(body) = batch.fenced.action else {
            panic!("stamped: {:?}", batch.fenced.action);
        };
        let value: serde_json::Value = serde_json::from_slice(&body).expect("JSON");
        let ids = Canned::Batch.ids(&value).expect("two ids");
        for (id, tick) in ids.into_iter().zip(&batch.ticks) {
            let read = SnowflakeLayout::TrtllmV1.decode(id).expect("an id");
            assert_eq!((read.millis, read.sequence), (tick.millis, tick.sequence));
        }
        let twenty = Request {
            body: format!(
                "[{}]",
                vec![std::str::from_utf8(SELF_CHECK_BODY).unwrap(); 20].join(",")
            )
            .into_bytes(),
            ..Canned::One.request()
        };
        let many = instance.handle(&twenty).expect("answers");
        assert_eq!(many.fenced.ticks.map(|taken| taken.count), Some(20));
        assert_eq!(many.ticks.len(), 16);
    }

    /// The batch, the instance's third call, passes only with two
    /// distinct ids made of its own ticks; a plugin that takes no batches
    /// may reject it with a status under 500 (it sends none on), but not
    /// forward it unstamped or fail it with a 5xx of its own. The same
    /// request again, the second call, is judged as the first: only 401
    /// and 403 pass unchecked.
    #[test]
    fn the_batch_passes_with_two_distinct_ids_or_a_plugins_4xx() {
        let (_engine, plugin) = bundled_with_machine_id_3();
        let v1 = SnowflakeLayout::TrtllmV1;
        let now = millis_of(SystemTime::now());
        let one = |id: u64| {
            format!(
                r#"{{"disaggregated_params":{{"request_type":"context_only","disagg_request_id":{id}}}}}"#
            )
        };
        let tick = |sequence| Tick {
            millis: now - 2,
            sequence,
        };
        // Two ticks, 7 and 9, another call's 8 between them.
        let judged_of = |canned, action: Action, exact: &[Tick]| {
            let answer = Fenced {
                action,
                ids_withheld: false,
                ids_unavailable: false,
                ticks: took((now - 2, 7), (now - 2, 9), 2),
            };
            judge_self_check(&plugin, canned, answer, exact, &host_ids(), || None)
                .map_err(|e| format!("{e:#}"))
        };
        let judged = |action| judged_of(Canned::Batch, action, &[tick(7), tick(9)]);
        let batch = |body: String| Action::ForwardWithBody(body.into_bytes());
        let reject = |status| {
            Action::Reject(Rejection {
                status,
                code: "no_batches".into(),
                message: "send one request at a time".into(),
            })
        };
        let id = |sequence| v1.compose(now - 2, 3, sequence).unwrap();
        let (a, b) = (id(7), id(9));
        assert_eq!(
            judged(batch(format!("[{},{}]", one(a), one(b)))),
            Ok(Judged::Stamped)
        );
        let Ok(Judged::Unchecked(what)) = judged(reject(400)) else {
            panic!("a batch rejected with 400 passes unchecked");
        };
        assert!(
            what.contains("whether it stamps batches was not checked"),
            "{what}"
        );
        let again = |status| judged_of(Canned::Again, reject(status), &[]);
        // Not for want of credentials: its first call stamped the same
        // request.
        for status in [401, 403] {
            let error = again(status).expect_err("the same request again rejected");
            assert!(
                error.contains("its first call stamped the same request"),
                "{error}"
            );
        }
        let error = again(400).expect_err("the same request again rejected with 400");
        assert!(
            error.contains(
                "rejected a valid context-only request (its instance's second call) with 400"
            ),
            "{error}"
        );
        for (action, says) in [
            (
                batch(format!("[{},{}]", one(a), one(a))),
                format!("stamped the same id, {a}, on both requests of a canned batch of two"),
            ),
            (
                batch(format!("[{},{{}}]", one(a))),
                "did not stamp an integer disagg_request_id on the batch's second request".into(),
            ),
            (
                batch(one(a)),
                "the body is no longer an array of two".into(),
            ),
            (
                Action::Forward,
                "forwarded a canned batch of two context-only requests (its instance's third \
                 call) unstamped"
                    .into(),
            ),
            (
                reject(500),
                "rejected a valid batch of two context-only requests (its instance's third \
                 call) with 500"
                    .into(),
            ),
            // Made of a tick outside the call's: the instance kept it.
            (
                batch(format!(
                    "[{},{}]",
                    one(v1.compose(now - 9, 3, 7).unwrap()),
                    one(b)
                )),
                "on a canned batch of two context-only requests (its instance's third call), \
                 the plugin stamped the id"
                    .into(),
            ),
            // The tick after its first, assumed its own: another call's.
            (
                batch(format!("[{},{}]", one(a), one(id(8)))),
                "is not a tick the host's id clock gave the call: one of the 2 it took".into(),
            ),
        ] {
            let error = judged(action).expect_err(&says);
            assert!(error.contains(&says), "{says}: {error}");
        }
        // Where the call's ticks are not all known, any between its first
        // and last passes.
        let ranged = batch(format!("[{},{}]", one(a), one(id(8))));
        assert_eq!(judged_of(Canned::Batch, ranged, &[]), Ok(Judged::Stamped));
    }

    /// A build that stamps an id of its own, not made of a tick it took
    /// and the host's machine id, would repeat ids, and the host's check
    /// of each call, which looks at the ticks taken, does not see it: the
    /// self-check refuses it, saying what is wrong with the id. An id made
    /// of the call's tick and the host's machine id passes.
    #[test]
    fn a_build_that_stamps_an_id_of_its_own_is_refused() {
        let (engine, plugin) = bundled_with_machine_id_3();
        let v1 = SnowflakeLayout::TrtllmV1;
        let now = millis_of(SystemTime::now());
        let stamped = |id: u64, ticks: Option<TicksTaken>| {
            Fenced {
            action: Action::ForwardWithBody(
                format!(r#"{{"disaggregated_params":{{"request_type":"context_only","disagg_request_id":{id}}}}}"#)
                    .into_bytes(),
            ),
            ids_withheld: false,
            ids_unavailable: false,
            ticks,
        }
        };
        let judged = |id: u64, ticks: Option<TicksTaken>| {
            judge_self_check(
                &plugin,
                Canned::One,
                stamped(id, ticks),
                &[],
                &host_ids(),
                || None,
            )
            .map_err(|e| format!("{e:#}"))
        };
        let one = took((now - 2, 7), (now - 2, 7), 1);
        // Three ticks, with other calls' ticks between them.
        let three = took((now - 5, 0), (now, 2), 3);
        let good = v1.compose(now - 2, 3, 7).unwrap();
        assert_eq!(judged(good, one), Ok(Judged::Stamped));
        assert_eq!(judged(good, three), Ok(Judged::Stamped));
        for (id, ticks, says) in [
            // A constant, below the layout's smallest id.
            (1_099_511_628_800, one, "not an id of layout trtllm-v1"),
            (
                v1.compose(now - 2, 4, 7).unwrap(),
                one,
                "machine id 4, not the host's 3",
            ),
            (
                v1.compose(now - 60_000, 3, 7).unwrap(),
                one,
                "not a tick the host's id clock gave the call: the one it took",
            ),
            // The tick's millisecond, its sequence dropped.
            (
                v1.compose(now - 2, 3, 0).unwrap(),
                one,
                "is not a tick the host's id clock gave the call",
            ),
            // Another call's tick, between this one's.
            (
                v1.compose(now - 2, 3, 8).unwrap(),
                one,
                "is not a tick the host's id clock gave the call",
            ),
            (v1.compose(now + 1, 3, 0).unwrap(), three, "(3 taken)"),
            (good, None, "took no tick"),
            // The host's machine id and the call's tick, in the other
            // layout: named, not read as a wrong machine id or tick.
            (
                SnowflakeLayout::TrtllmV2.compose(now - 2, 3, 7).unwrap(),
                one,
                "it is an id of layout trtllm-v2, not of the host's trtllm-v1",
            ),
        ] {
            let error = judged(id, ticks).expect_err(says);
            assert!(error.contains(says), "{error}");
            assert!(error.contains("could repeat"), "{error}");
        }
        // A v1 id from 2039-09-07 15:30:06.976 UTC on is folded by the
        // rotation, and decodes as a 1970 time: it passes, read as made.
        let late = (1u64 << 41) + 5;
        let folded = v1.compose_unique(late, 3, 7).unwrap();
        assert_ne!(v1.decode(folded).unwrap().millis, late);
        let in_2039 = took((late, 7), (late, 7), 1);
        assert_eq!(judged(folded, in_2039), Ok(Judged::Stamped));
        assert!(judged(v1.compose_unique(late, 4, 7).unwrap(), in_2039).is_err());
        // Where the machine id changed meanwhile, the build is put off.
        let other = v1.compose(now - 2, 4, 7).unwrap();
        let error = judge_self_check(
            &plugin,
            Canned::One,
            stamped(other, one),
            &[],
            &host_ids(),
            || Some("the machine id changed during the self-check".into()),
        )
        .expect_err("put off");
        assert!(
            error.downcast_ref::<CannotCheckNow>().is_some(),
            "{error:#}"
        );
        // The bundled plugin's id passes, through the real call.
        load_checked(&engine, snowgate_plugin_bundle::PLUGIN_WASM, &[]).expect("stamps");
    }
}
