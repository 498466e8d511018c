//! `snowgate serve`: the gateway proxy.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Context as _;
use clap::Args;
use snowgate_host::gateway::{
    parse_listen_address, ConfigFile, FailurePolicy, Gateway, GatewayConfig,
};
use snowgate_plugin::SnowflakeLayout;

use crate::compile_flags::CompileFlags;
use crate::Failure;

/// Flags of `snowgate serve`. Each overrides the same key of `--config`.
#[derive(Args)]
pub struct ServeArgs {
    /// TOML file with any of these settings (same names, kebab-case);
    /// flags override it (--machine-id or --etcd also puts aside the
    /// file's settings of the other). Relative paths in it are taken from
    /// its directory.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Address clients connect to [default: 127.0.0.1:8080].
    #[arg(long, value_name = "ADDR", value_parser = parse_listen_address)]
    listen: Option<SocketAddr>,
    /// Base URL of the OpenAI-compatible server behind the gateway, e.g.
    /// http://127.0.0.1:8000. Without it a built-in echo upstream answers
    /// with the request it received.
    #[arg(long, value_name = "URL")]
    upstream: Option<String>,
    /// This replica's machine id, unique among the replicas behind one
    /// router: 0..=1022 for trtllm-v1, 0..=16383 for trtllm-v2
    /// [default: 0, with a warning].
    #[arg(long, value_name = "N")]
    machine_id: Option<u32>,
    /// Keep the machine id's high-water mark in FILE (created if missing,
    /// locked while the gateway runs), so that its ids never repeat across
    /// restarts: not after a crash or SIGKILL, and not after the wall clock
    /// stepped back. Without it a stop waits out the id clock's lead, which
    /// a crash cannot. Not with --etcd, which keeps the mark in etcd
    /// [default: none].
    #[arg(long, value_name = "FILE")]
    high_water_file: Option<PathBuf>,
    /// Id layout: trtllm-v1 (TensorRT-LLM up to 1.3.0rc21) or trtllm-v2
    /// (1.3.0rc22 and later) [default: trtllm-v1].
    #[arg(long, value_name = "LAYOUT")]
    layout: Option<SnowflakeLayout>,
    /// Plugin component to load and watch for new builds; the bundled
    /// plugin when absent.
    #[arg(long, value_name = "PATH")]
    plugin: Option<PathBuf>,
    /// A setting handed to the plugin's configure export; repeatable.
    #[arg(long = "plugin-setting", value_name = "NAME=VALUE", value_parser = parse_setting)]
    plugin_settings: Vec<(String, String)>,
    /// Keep compiled plugins in DIR and load them from there, so a restart,
    /// or a reload back to a build served before, skips compiling (seconds
    /// for a plugin in Python or JavaScript). DIR is created mode 0700; it
    /// and its files must belong to snowgate's user and be writable by no
    /// one else, as their code is run unchecked [default: compile at every
    /// load].
    #[arg(long, value_name = "DIR")]
    plugin_cache_dir: Option<PathBuf>,
    /// Address of the admin endpoints (/status, /reload, /healthz, /readyz, /metrics)
    /// [default: 127.0.0.1:9901].
    #[arg(long, value_name = "ADDR", value_parser = parse_listen_address)]
    admin_listen: Option<SocketAddr>,
    /// Largest request body accepted; larger ones get 413 [default: 33554432].
    #[arg(long, value_name = "BYTES")]
    max_body_bytes: Option<usize>,
    /// The most memory the request bodies read whole for the plugin may
    /// hold at once, until each is sent upstream, in MiB; at least
    /// --max-body-bytes. A body takes room for its declared length before
    /// it is read (one that declares none, for 1 MiB or --max-body-bytes if
    /// smaller, taking more as it arrives where that is free); a request that finds no room waits for it, in the order
    /// requests came, at most --body-read-timeout-ms (at most 8 of one
    /// connection at once), and then gets 503 body_memory_full; a body given
    /// room must arrive whole within that time too. A body the plugin made
    /// larger (ids) is sent even where no more room is free, by up to its
    /// own room (/metrics shows that as overdrawn); larger still, it gets
    /// 503 body_memory_full [default: 1024, or --max-body-bytes where that
    /// is larger].
    #[arg(long, value_name = "MIB")]
    body_memory_mib: Option<usize>,
    /// When the plugin fails: fail-closed answers 503, fail-open forwards
    /// the request unchanged [default: fail-closed].
    #[arg(long, value_name = "POLICY")]
    failure_policy: Option<FailurePolicy>,
    /// Memory limit of one plugin call, in MiB [default: 256].
    #[arg(long, value_name = "MIB")]
    plugin_memory_mib: Option<usize>,
    /// Deadline of one plugin call, in milliseconds of wall-clock running
    /// time [default: 1000]. Time a long call waits for its turn on a busy worker does not count, but while requests queue for a call slot a call ends within four deadlines in all.
    #[arg(long, value_name = "MS")]
    plugin_deadline_ms: Option<u64>,
    /// Requests one plugin instance may serve before a fresh one replaces
    /// it; 1 gives every request a fresh instance (slower; nothing a plugin
    /// keeps in its memory can reach the next request). An instance whose
    /// call trapped, ran out of time or memory, answered what the gateway
    /// cannot use, wrote to stderr or grew its memory by more than 4 MiB
    /// after configure is never reused; one that returned its own
    /// plugin-error is [default: 1000].
    #[arg(long, value_name = "N")]
    plugin_calls_per_instance: Option<u32>,
    /// Plugin instances alive at once, 2 to 4096 [default: 64]: the slots
    /// of the instance pool. Calls in flight, kept idle instances and a
    /// reload's check (one slot is kept for it) share them (with 64, 47
    /// calls run at once and more wait their turn). Each slot reserves
    /// about 4 GiB of virtual address space (not memory), so lower it where
    /// address space is limited (`ulimit -v`, valgrind); plugin memory in
    /// use is at most this many times --plugin-memory-mib.
    #[arg(long, value_name = "N")]
    plugin_instances: Option<u32>,
    #[command(flatten)]
    compile: CompileFlags,
    /// How long in-flight requests may finish after SIGTERM, in seconds
    /// [default: 30]; a second SIGTERM or SIGINT, a second or more after
    /// the first, ends it at once (a reload's plugin calls under way are
    /// still waited for, each within --plugin-deadline-ms). The stop may
    /// then take up to 10 s more, after a burst of ids (or, with --etcd,
    /// soon after claiming a slot), until the wall clock has passed the
    /// last id issued.
    #[arg(long, value_name = "SECS")]
    shutdown_grace_secs: Option<u64>,
    /// Quiet time after a plugin file change before reloading, in
    /// milliseconds [default: 200].
    #[arg(long, value_name = "MS")]
    reload_debounce_ms: Option<u64>,
    /// A client must send complete request headers within this time, in
    /// milliseconds; also how long an idle keep-alive connection is kept
    /// [default: 10000].
    #[arg(long, value_name = "MS")]
    header_read_timeout_ms: Option<u64>,
    /// The longest a client may pause while sending a request body, in
    /// milliseconds; then it gets 408. Also the longest a request waits for
    /// room for its body (--body-memory-mib), the longest a body read for
    /// the plugin may take to arrive whole once it has room, and the
    /// longest a request whose body is read waits for a plugin call slot
    /// (--plugin-instances), then getting 503 plugin_busy [default: 60000].
    #[arg(long, value_name = "MS")]
    body_read_timeout_ms: Option<u64>,
    /// The longest a client may take none of a response the gateway has
    /// for it (it stops reading, or over HTTP/2 grants no flow-control
    /// window), in milliseconds; then its connection is closed
    /// [default: 60000].
    #[arg(long, value_name = "MS")]
    send_timeout_ms: Option<u64>,
    /// Largest request head (request line plus headers) in bytes; larger
    /// ones get 431 (414 for a request target over 65,534 bytes,
    /// when this allows one) [default: 65536, 8192 to 524288].
    #[arg(long, value_name = "BYTES")]
    max_header_bytes: Option<usize>,
    /// Client connections served at once. At the limit, the connection
    /// idle longest (for at least 1 s) is closed to make room (counted in
    /// snowgate_connections_reclaimed_total); with none idle, new clients
    /// wait in the listen backlog [default: 4096].
    #[arg(long, value_name = "N")]
    max_connections: Option<usize>,
    /// Requests one HTTP/2 client connection may have open at once (its
    /// SETTINGS_MAX_CONCURRENT_STREAMS, as nginx's
    /// http2_max_concurrent_streams); each may hold an upstream connection
    /// of its own. A connection whose client resets 100 requests within a
    /// second of sending them (a rapid reset) is closed, counted in
    /// snowgate_connections_closed_for_resets_total [default: 128, at most
    /// 10000].
    #[arg(long, value_name = "N")]
    max_streams_per_connection: Option<u32>,
    /// Requests in flight to --upstream at once, each holding one upstream
    /// connection until its response has ended (a stream included); more
    /// wait for a turn, in order, up to --upstream-connect-timeout-ms, then
    /// get 503 upstream_busy with Retry-After [default: no bound, at most
    /// 1000000].
    #[arg(long, value_name = "N")]
    max_upstream_requests: Option<usize>,
    /// How long opening a TCP connection to the upstream may take, its host
    /// name's lookup included, in milliseconds; then the client gets 504
    /// [default: 5000].
    #[arg(long, value_name = "MS")]
    upstream_connect_timeout_ms: Option<u64>,
    /// How long the upstream may take to send its response headers, counted
    /// from when the request goes upstream (connecting and sending a
    /// streamed request body included; a body read whole for the plugin is
    /// read before), in milliseconds; then the client gets 504. A non-streaming completion
    /// sends them only when generation ends; the body after them is
    /// limited by --upstream-read-timeout-ms [default: 600000, ten minutes].
    #[arg(long, value_name = "MS")]
    upstream_response_timeout_ms: Option<u64>,
    /// The longest the upstream may pause within a response body once its
    /// headers came (a token stream between two tokens), in milliseconds;
    /// then the response is cut off, counted and logged. Time the client
    /// takes to read does not count [default: 600000, ten minutes].
    #[arg(long, value_name = "MS")]
    upstream_read_timeout_ms: Option<u64>,
    /// How long an idle upstream connection is kept for reuse, in
    /// milliseconds; keep it below the upstream's keep-alive timeout
    /// (uvicorn's default: 5 s) [default: 4000].
    #[arg(long, value_name = "MS")]
    upstream_idle_timeout_ms: Option<u64>,
    /// Threads serving client connections, each with its own event loop
    /// and upstream connection pool; a connection stays on one thread
    /// [default: one per CPU].
    #[arg(long, value_name = "N")]
    workers: Option<usize>,
    /// Lease this replica's machine id from etcd instead of --machine-id:
    /// the lowest free id of the layout, held by an etcd lease, unique in
    /// the fleet by construction. Comma-separated endpoint URLs of one
    /// cluster, used one at a time: the next that answers when one fails.
    #[arg(long, value_name = "URL[,URL...]")]
    etcd: Option<String>,
    /// Time to live of the machine id lease, in seconds, 3 to 86400; a
    /// replica whose renewal etcd has not confirmed within this time less a
    /// second stops stamping [default: 10].
    #[arg(long, value_name = "SECONDS")]
    machine_id_ttl: Option<u64>,
    /// Key prefix for machine id leases in etcd, starting with / (one
    /// spelling per prefix: `snowgate` would be another namespace than
    /// `/snowgate`, so it is refused) [default: /snowgate].
    #[arg(long, value_name = "PREFIX")]
    etcd_prefix: Option<String>,
    /// Bearer token the admin endpoints require (all but the health probes,
    /// GET or HEAD of /healthz and /readyz); required when --admin-listen
    /// is not a loopback address.
    #[arg(
        long,
        env = "SNOWGATE_ADMIN_TOKEN",
        value_name = "TOKEN",
        hide_env_values = true,
        value_parser = AdminTokenParser
    )]
    admin_token: Option<String>,
}

/// Reads the admin token as text. Bytes that are not UTF-8 are refused
/// with a message that names the flag and the variable, and not the
/// bytes (a secret): clap's own said only "invalid UTF-8 was detected in
/// one or more arguments", which named neither when the token came from
/// the environment.
#[derive(Clone)]
struct AdminTokenParser;

impl clap::builder::TypedValueParser for AdminTokenParser {
    type Value = String;

    fn parse_ref(
        &self,
        command: &clap::Command,
        _arg: Option<&clap::Arg>,
        value: &std::ffi::OsStr,
    ) -> Result<String, clap::Error> {
        value.to_str().map(str::to_owned).ok_or_else(|| {
            clap::Error::raw(
                clap::error::ErrorKind::InvalidUtf8,
                "the admin token (--admin-token or SNOWGATE_ADMIN_TOKEN) is not UTF-8; a bearer \
                 token is visible ASCII\n",
            )
            .with_cmd(command)
        })
    }
}

/// Reads a `--plugin-setting NAME=VALUE`.
pub(crate) fn parse_setting(s: &str) -> Result<(String, String), String> {
    let (name, value) = s
        .split_once('=')
        .ok_or_else(|| format!("{s:?} is not NAME=VALUE"))?;
    match snowgate_host::layout_setting_problem(name) {
        Some(problem) => Err(problem),
        None => Ok((name.to_string(), value.to_string())),
    }
}

impl ServeArgs {
    /// Defaults, then the file, then the flags.
    fn into_config(self) -> Result<GatewayConfig, Failure> {
        let flags = ConfigFile {
            listen: self.listen,
            upstream: self.upstream,
            machine_id: self.machine_id,
            high_water_file: self.high_water_file,
            layout: self.layout.map(|l| l.name().to_string()),
            plugin: self.plugin,
            plugin_settings: None,
            plugin_cache_dir: self.plugin_cache_dir,
            admin_listen: self.admin_listen,
            max_body_bytes: self.max_body_bytes,
            body_memory_mib: self.body_memory_mib,
            failure_policy: self.failure_policy,
            plugin_memory_mib: self.plugin_memory_mib,
            plugin_deadline_ms: self.plugin_deadline_ms,
            plugin_calls_per_instance: self.plugin_calls_per_instance,
            plugin_instances: self.plugin_instances,
            plugin_compile_memory_mib: None,
            plugin_compile_cpu_secs: None,
            plugin_compile_in_process: None,
            shutdown_grace_secs: self.shutdown_grace_secs,
            reload_debounce_ms: self.reload_debounce_ms,
            header_read_timeout_ms: self.header_read_timeout_ms,
            body_read_timeout_ms: self.body_read_timeout_ms,
            send_timeout_ms: self.send_timeout_ms,
            max_header_bytes: self.max_header_bytes,
            max_connections: self.max_connections,
            max_streams_per_connection: self.max_streams_per_connection,
            max_upstream_requests: self.max_upstream_requests,
            upstream_connect_timeout_ms: self.upstream_connect_timeout_ms,
            upstream_response_timeout_ms: self.upstream_response_timeout_ms,
            upstream_read_timeout_ms: self.upstream_read_timeout_ms,
            upstream_idle_timeout_ms: self.upstream_idle_timeout_ms,
            admin_token: self.admin_token,
            workers: self.workers,
            etcd: self.etcd,
            machine_id_ttl: self.machine_id_ttl,
            etcd_prefix: self.etcd_prefix,
        };
        let flags = self.compile.over(flags);
        crate::gateway_config::layered(self.config.as_deref(), flags, self.plugin_settings)
    }
}

pub fn run(args: ServeArgs) -> Result<(), Failure> {
    let file = args.config.clone();
    let mut config = args.into_config()?;
    crate::gateway_config::check_whole(&config, file.as_deref())?;
    config.connections.max_connections =
        crate::open_files::raise_for(config.connections.max_connections, config.worker_count());
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("snowgate")
        .build()
        .context("starting the async runtime")?;
    let served = runtime.block_on(async move {
        // Heard from the start: a stop while the gateway binds (its plugin
        // compiling, a high-water mark far ahead waited out) ends the start
        // with status 0, where the signal's default action killed it. No
        // machine id is leased yet: `serve_until` claims it.
        let (shutdown, cut_short) = stop_signals()?;
        let mut shutdown = Box::pin(shutdown);
        let gateway = tokio::select! {
            gateway = Gateway::bind(config.clone()) => gateway?,
            () = &mut shutdown => {
                tracing::info!("stopped before serving");
                return Ok(());
            }
        };
        let info = gateway.slot().current().info().clone();
        let ready = format!(
            "snowgate listening on http://{} (admin http://{}); upstream {}; plugin {} {} sha256 {}\n",
            gateway.local_addr()?,
            gateway.admin_addr()?,
            config.upstream.as_deref().unwrap_or("built-in echo"),
            info.name,
            info.version,
            info.sha256
        );
        // A gateway serves whether or not anyone reads its ready line.
        if let Err(e) = crate::write_stdout(ready.as_bytes()) {
            tracing::warn!(error = %format!("{e:#}"), "the ready line was not printed");
        }
        gateway.serve_until(shutdown, cut_short).await?;
        tracing::info!("stopped");
        Ok::<_, anyhow::Error>(())
    });
    // Every id is accounted for by now. A reload may still be compiling on
    // a blocking thread (see `PluginSlot::close`), which dropping the
    // runtime would wait for: leave it, and its compile process, to end
    // with this one.
    runtime.shutdown_background();
    served?;
    Ok(())
}

/// Signals this soon after the first stop signal are the same stop.
const SAME_STOP: std::time::Duration = std::time::Duration::from_secs(1);

/// Starts listening for SIGTERM and SIGINT. The first future resolves on
/// the first of them (the stop begins: the drain), the second on the next
/// one a second or more later (stop at once: what is still in flight is
/// dropped), as a second Ctrl-C does for most servers; the grace period
/// otherwise holds a stop up to 30 s with no way to hurry it short of
/// SIGKILL, which would skip giving up the machine id.
fn stop_signals() -> anyhow::Result<(
    impl std::future::Future<Output = ()>,
    impl std::future::Future<Output = ()>,
)> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut terminate = signal(SignalKind::terminate()).context("listening for SIGTERM")?;
    let mut interrupt = signal(SignalKind::interrupt()).context("listening for SIGINT")?;
    let (first_tx, first_rx) = tokio::sync::oneshot::channel::<()>();
    let (second_tx, second_rx) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(async move {
        let mut next = async || {
            tokio::select! {
                _ = interrupt.recv() => "SIGINT",
                _ = terminate.recv() => "SIGTERM",
            }
        };
        let name = next().await;
        tracing::info!("{name}: shutting down");
        let _ = first_tx.send(());
        // One stop can come as two signals at once: GNU `timeout` signals
        // the process and then its group, and a terminal's Ctrl-C reaches
        // a wrapper that forwards it too. Those are not a second stop.
        let window = tokio::time::sleep(SAME_STOP);
        tokio::pin!(window);
        loop {
            tokio::select! {
                () = &mut window => break,
                name = next() => tracing::info!(
                    "{name} again within a second of the first: taken as the same stop"
                ),
            }
        }
        tracing::info!("a further SIGTERM or SIGINT stops at once, dropping what is in flight");
        let name = next().await;
        tracing::warn!(
            "{name} again: stopping at once; requests still in flight are dropped, then the \
             machine id is given up"
        );
        let _ = second_tx.send(());
    });
    // A dropped sender (the task ended with the runtime) resolves too.
    Ok((
        async move {
            let _ = first_rx.await;
        },
        async move {
            let _ = second_rx.await;
        },
    ))
}
