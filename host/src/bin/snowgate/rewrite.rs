//! `snowgate rewrite`: one body through the plugin, stdin to stdout.

use std::io::Read;
use std::path::PathBuf;
use std::str::FromStr;
use std::sync::Arc;

use anyhow::Context as _;
use clap::Args;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use snowgate_host::gateway::config::memory_advice;
use snowgate_host::gateway::header_order::remove_in_order;
use snowgate_host::gateway::hop_by_hop::take_in_client_headers;
use snowgate_host::gateway::middleware::plugin_sees;
use snowgate_host::id_clock::MAX_CATCH_UP;
use snowgate_host::{
    plugin_reason, plugin_text, Action, Answer, CallError, CompileCache, FixedClock, HostServices,
    IdClock, Plugin, PluginEngine, Request,
};
use snowgate_plugin::MSGPACK_HEADER;
use snowgate_plugin_bundle::{memory_needed, IdDensity};

use crate::plugin_flags::PluginFlags;
use crate::rewrite_high_water::RunMark;
use crate::Failure;

/// Flags of `snowgate rewrite`.
#[derive(Args)]
pub struct RewriteArgs {
    #[command(flatten)]
    plugin: PluginFlags,
    /// This process's machine id, unique in the fleet: 0..=1022 for
    /// trtllm-v1, 0..=16383 for trtllm-v2.
    #[arg(long, value_name = "N")]
    machine_id: u32,
    /// Id clock: `system` (the real-time clock) or `fixed:MS`, a clock that
    /// always reads MS, so the n-th id uses sequence n in MS (then MS+1, ...):
    /// for reproducible runs and examples.
    #[arg(long, default_value = "system", value_name = "CLOCK")]
    clock: ClockChoice,
    /// Keep the machine id's high-water mark in FILE (created if missing,
    /// locked while rewrite runs), as `serve --high-water-file` does: ids
    /// continue after the mark the last run or gateway on the file wrote,
    /// wherever the wall clock is, and the body is written only once the
    /// last id's millisecond is on disk. Only with the system clock.
    #[arg(long, value_name = "FILE")]
    high_water_file: Option<PathBuf>,
    /// Keep the compiled plugin in DIR and read it from there next time,
    /// as `serve --plugin-cache-dir` does: for repeated runs of a plugin
    /// that is slow to compile.
    #[arg(long, value_name = "DIR")]
    plugin_cache_dir: Option<PathBuf>,
    /// A header of the request the plugin sees, as `NAME: VALUE`;
    /// repeatable. The plugin sees them as the gateway hands them on:
    /// grouped by name, without hop-by-hop headers (`connection`, `upgrade`,
    /// ...). `content-type` replaces the default `application/json`.
    #[arg(long = "header", short = 'H', value_name = "NAME: VALUE", value_parser = parse_header)]
    headers: Vec<(HeaderName, HeaderValue)>,
    /// The path (and query) of the request the plugin sees.
    #[arg(long, default_value = "/", value_name = "PATH", value_parser = parse_path)]
    path: String,
    /// The body is MessagePack, as TensorRT-LLM's orchestrator sends it with
    /// `X-TRTLLM-Msgpack: 1`, instead of JSON.
    #[arg(long)]
    msgpack: bool,
}

/// The `--clock` flag.
#[derive(Clone, Copy, Debug)]
enum ClockChoice {
    System,
    Fixed(u64),
}

impl FromStr for ClockChoice {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.split_once(':') {
            None if s == "system" => Ok(ClockChoice::System),
            Some(("fixed", ms)) => ms.parse().map(ClockChoice::Fixed).map_err(|_| {
                format!(
                    "fixed:{ms} needs milliseconds since the Unix epoch, e.g. fixed:1764000000000"
                )
            }),
            _ => Err(format!("unknown clock {s:?}: use system or fixed:MS")),
        }
    }
}

pub fn run(args: RewriteArgs) -> Result<(), Failure> {
    if args.msgpack && args.headers.iter().any(|(name, _)| name == MSGPACK_HEADER) {
        return Err(Failure::BadInput(format!(
            "--msgpack sends {MSGPACK_HEADER}: 1 itself, and a --header {MSGPACK_HEADER} was \
             given too: give one of them"
        )));
    }
    let layout = args.plugin.layout();
    let identity = args.plugin.identity(args.machine_id)?;
    let clock = Arc::new(match args.clock {
        ClockChoice::System => IdClock::system(),
        ClockChoice::Fixed(ms) => IdClock::new(FixedClock(ms)),
    });
    // Before the plugin is loaded: every id it makes, in `configure` too,
    // comes after the ids of the last run on the file.
    let run_mark =
        match (&args.high_water_file, args.clock) {
            (None, _) => None,
            (Some(path), ClockChoice::System) => {
                Some(RunMark::take_over(path, layout, args.machine_id, &clock)?)
            }
            (Some(_), ClockChoice::Fixed(_)) => return Err(Failure::BadInput(
                "--high-water-file needs --clock system: a fixed clock is for reproducible runs, \
                 which ids continuing after a mark are not"
                    .into(),
            )),
        };
    let services = HostServices {
        clock: clock.clone(),
        identity: Arc::new(identity),
    };
    let mut limits = args.plugin.limits()?;
    // Nothing is forwarded here: the memory limit, which the answer is
    // built within, bounds it well enough.
    limits.max_output_body_bytes = limits.memory_bytes;
    let slots = limits.max_instances;
    let mut engine = PluginEngine::new(services, limits).with_context(|| {
        format!(
            "starting the plugin engine with {slots} instance slots, each reserving about 4 GiB \
             of address space: where that is limited (ulimit -v), raise the limit"
        )
    })?;
    if let Some(dir) = &args.plugin_cache_dir {
        engine = engine.with_compile_cache(CompileCache::open(dir).context("--plugin-cache-dir")?);
    }
    let settings = crate::plugin_flags::settings_once_each(args.plugin.plugin_settings.clone())?;
    let plugin = Plugin::load(&engine, &args.plugin.build()?, &settings)
        .with_context(|| format!("loading {}", args.plugin.named()))?;
    plugin.keep_compiled();

    let body = read_body(std::io::stdin().lock(), limits.memory_bytes)?;
    let headers = request_headers(args.headers, args.msgpack, body.len());
    if !plugin_sees(&headers, &body) {
        say!(
            "snowgate: note: a gateway would not run the plugin on this request (its content \
             type, or an empty body, says it is not JSON) but forward it unchanged; running it \
             all the same"
        );
    }
    let request = Request {
        method: "POST".into(),
        path: args.path,
        headers: headers.into(),
        body,
    };
    let answer = plugin.answer(&request);
    // The next run on the file continues after the mark written here.
    let recorded = run_mark
        .as_ref()
        .map_or(Ok(()), |run_mark| run_mark.record(&clock));
    // A process on this machine id without the file starts its clock at
    // the wall clock: after a burst (more ids than a millisecond's sequence
    // space), or a start after a mark ahead of the wall clock, this one
    // must not end before the wall clock has passed its last id. It waits
    // before anything else, so that no error on the way out skips it. A
    // fixed clock is for reproducible runs and never catches up.
    if matches!(args.clock, ClockChoice::System) {
        if let Err(too_far) = clock.wait_for_wall_clock(MAX_CATCH_UP) {
            say!("snowgate: warning: {too_far}");
        }
    }
    let answer = match (answer, recorded) {
        (answer, Ok(())) => answer,
        // Only a body that goes out needs its ids recorded: a failed
        // call's error, or a rejection, says more than the mark's.
        (
            answer @ (Err(_)
            | Ok(Answer {
                action: Action::Reject(_),
                ..
            })),
            Err(unrecorded),
        ) => {
            say!("snowgate: warning: {unrecorded:#}");
            answer
        }
        (Ok(_), Err(unrecorded)) => return Err(Failure::Failed(unrecorded)),
    };
    let Answer {
        action,
        header_edits,
        ..
    } = answer.map_err(|e| call_failure(e, args.plugin.plugin.is_none(), request.body.len()))?;
    // Only the body goes to stdout; what a gateway would also change on
    // the forwarded request is told on stderr.
    if !header_edits.is_empty() {
        say!("snowgate: the plugin changes the forwarded request's headers:");
        for edit in header_edits.iter() {
            say!("  {}", plugin_text(edit.to_string(), usize::MAX));
        }
    }
    let out = match &action {
        Action::Forward => &request.body,
        Action::ForwardWithBody(body) => body,
        // The plugin's words reach a terminal: control characters escaped,
        // as in the gateway's log (the message is already cut to 4 KiB).
        Action::Reject(rejection) => {
            let code = match rejection.code.as_str() {
                "" => String::new(),
                code => format!("{}, ", plugin_text(code.to_string(), usize::MAX)),
            };
            return Err(Failure::BadInput(format!(
                "{} ({code}HTTP {})",
                plugin_reason(rejection.message.clone(), usize::MAX),
                rejection.status
            )));
        }
    };
    crate::write_stdout(out)?;
    Ok(())
}

/// Reads the body from `input`, refusing one larger than the plugin's
/// memory (`memory_bytes`), which it is copied into whole: no call could
/// take it, and reading all of an endless input (`< /dev/zero`) would
/// only end in the system killing the process.
fn read_body(input: impl Read, memory_bytes: usize) -> Result<Vec<u8>, Failure> {
    let mut body = Vec::new();
    input
        .take(memory_bytes as u64 + 1)
        .read_to_end(&mut body)
        .context("reading the body from stdin")?;
    if body.len() <= memory_bytes {
        return Ok(body);
    }
    let mib = (memory_bytes >> 20) as u64;
    let advice = memory_advice(mib + 1, mib + 1, "split the body");
    Err(Failure::BadInput(format!(
        "the body on stdin is larger than the plugin's memory, {memory_bytes} bytes \
         (--plugin-memory-mib {mib}), which it must be copied into: {advice}"
    )))
}

/// `--header NAME: VALUE`: a header name and value as HTTP allows them
/// on a header line (spaces and tabs around the value are not part of
/// it), the name lowercased.
fn parse_header(text: &str) -> Result<(HeaderName, HeaderValue), String> {
    let (name, value) = text
        .split_once(':')
        .ok_or_else(|| format!("{text:?} has no ':' between the header's name and value"))?;
    let name = HeaderName::from_bytes(name.as_bytes())
        .map_err(|_| format!("{name:?} is not a header name"))?;
    // Bytes, not text: a value in UTF-8 (`café`) reaches the plugin as
    // the gateway passes it on; http 1.6's `from_str` refuses non-ASCII.
    let value = HeaderValue::from_bytes(value.trim_matches([' ', '\t']).as_bytes())
        .map_err(|_| format!("the value of {name} holds a control character or DEL"))?;
    Ok((name, value))
}

/// The headers the plugin sees, as the gateway hands them to it: grouped
/// by name (the first name given first, each name's values in order),
/// taken in as a gateway takes a client's (without the hop-by-hop headers,
/// `Expect`, and the aliases of the names it manages), without `Trailer`
/// (the body is forwarded whole, its trailers not), and with the
/// `Content-Length` of the body, `body_length`, as from a client that sent
/// it with its length: one `given` had no body to be true of.
/// `content-type: application/json` unless `given` names a content type,
/// and `x-trtllm-msgpack: 1` with `msgpack`.
fn request_headers(
    given: Vec<(HeaderName, HeaderValue)>,
    msgpack: bool,
    body_length: usize,
) -> HeaderMap {
    let mut headers = HeaderMap::new();
    if !given.iter().any(|(name, _)| name == header::CONTENT_TYPE) {
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
    }
    if msgpack {
        headers.insert(MSGPACK_HEADER, HeaderValue::from_static("1"));
    }
    for (name, value) in given {
        headers.append(name, value);
    }
    take_in_client_headers(&mut headers);
    remove_in_order(&mut headers, &header::TRAILER);
    headers.insert(header::CONTENT_LENGTH, HeaderValue::from(body_length));
    headers
}

/// `--path`: a request target's path and query, as the gateway hands it to
/// a plugin.
fn parse_path(text: &str) -> Result<String, String> {
    match text.parse::<http::uri::PathAndQuery>() {
        Ok(path) if path.as_str().starts_with('/') && !text.contains('#') => {
            Ok(path.as_str().to_string())
        }
        _ => Err(format!(
            "{text:?} is not a path: a path starts with '/' and holds no spaces, control \
             characters or '#' (a fragment, which a client never sends)"
        )),
    }
}

/// How a failed plugin call ends `rewrite`. The bundled plugin's memory
/// grows with the body it reads, so its running out is the body's doing:
/// bad input (exit status 2), with the flag that raises the limit. Any
/// other failure, and any failure of a `--plugin` file, which may be that
/// plugin's own fault, is a failure (exit status 1).
fn call_failure(error: CallError, bundled: bool, body_bytes: usize) -> Failure {
    match error {
        CallError::MemoryLimit(_) if bundled => {
            let body = body_bytes as u64;
            let few = memory_needed(body, IdDensity::Few).div_ceil(1 << 20);
            let densest = memory_needed(body, IdDensity::Densest).div_ceil(1 << 20);
            let advice = memory_advice(few, densest, "split the body");
            Failure::BadInput(format!(
                "the {body_bytes} byte body is too large for the plugin's memory: {error}; \
                 {advice} (a body of this size needs about {few} MiB with few ids, up to \
                 {densest} MiB when dense with ids)"
            ))
        }
        error => Failure::Failed(anyhow::Error::new(error).context("running the plugin")),
    }
}
