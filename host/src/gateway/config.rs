//! The gateway's settings: built-in defaults, a TOML file, then flags.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context as _;
use serde::Deserialize;
use snowgate_plugin::SnowflakeLayout;

use crate::compile_process::CompileProcess;
use crate::gateway::body_memory::default_limit;
use crate::gateway::plugin_file::read_regular_file;
use crate::gateway::upstream_turns::MAX_UPSTREAM_REQUESTS;
use crate::lease::LeaseConfig;
use crate::limits::PluginLimits;

/// The longest plugin call deadline a configuration may set: an hour.
const MAX_PLUGIN_DEADLINE_MS: u64 = 3_600_000;

/// The most plugin instance slots a configuration may ask for: each
/// reserves about 4 GiB of address space, and 4096 take an eighth of
/// x86-64's 128 TiB.
const MAX_PLUGIN_INSTANCES: u32 = 4096;

/// The most memory for request bodies a configuration may give, in MiB:
/// 1 TiB.
const MAX_BODY_MEMORY_MIB: usize = 1 << 20;
/// The least address space a plugin's compile process may be given: the
/// process itself (its code, threads and allocator) needs about 100 MiB
/// before compiling anything.
const MIN_COMPILE_MEMORY_MIB: u64 = 256;
/// The most: 1 TiB.
const MAX_COMPILE_MEMORY_MIB: u64 = 1 << 20;
/// The most CPU time a compile may be given: a day.
const MAX_COMPILE_CPU_SECS: u64 = 86_400;

/// The most client connections a configuration may allow at once.
const MAX_CONNECTIONS: usize = 1 << 20;

/// The largest request head `--max-header-bytes` may allow: 512 KiB. An
/// HTTP/2 header list counts 32 bytes beside each field's name and value,
/// so one this large holds at most some 15,000 fields. A map of headers
/// holds at most 24,576, and adding one to a full map panics: a limit of
/// about 860 KB would let a client's 24,576 three-letter names fill it
/// before the gateway adds its own (`X-Forwarded-For`, `Host`).
pub const MAX_HEADER_BYTES: usize = 512 << 10;

/// The smallest request head `--max-header-bytes` may allow: hyper's
/// HTTP/1 read buffer is no smaller.
pub const MIN_HEADER_BYTES: usize = 8192;

/// The most `--max-streams-per-connection` may be.
const MAX_STREAMS_PER_CONNECTION: u32 = 10_000;

/// The shortest and longest machine-id lease, in seconds (see
/// [`crate::lease::MIN_TTL`] and [`crate::lease::MAX_TTL`]).
const MIN_MACHINE_ID_TTL_SECS: u64 = crate::lease::MIN_TTL.as_secs();
const MAX_MACHINE_ID_TTL_SECS: u64 = crate::lease::MAX_TTL.as_secs();

/// The longest timeout (or reload quiet time) a configuration may set: a day.
const MAX_TIMEOUT_MS: u64 = 86_400_000;

/// What the gateway does when the plugin errs, traps or hits a limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum FailurePolicy {
    /// Answer 503 and do not forward: an unstamped context-only request
    /// would crash or mix up the workers behind the gateway.
    #[default]
    FailClosed,
    /// Forward the request unchanged.
    FailOpen,
}

impl std::str::FromStr for FailurePolicy {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "fail-closed" => Ok(FailurePolicy::FailClosed),
            "fail-open" => Ok(FailurePolicy::FailOpen),
            _ => Err(format!(
                "unknown failure policy {s:?}: use fail-closed or fail-open"
            )),
        }
    }
}

/// Everything `snowgate serve` can be told. Every field has a key of the
/// same name (kebab-case) in the TOML file and a flag.
#[derive(Debug, Clone, PartialEq)]
pub struct GatewayConfig {
    /// Where clients connect.
    pub listen: SocketAddr,
    /// Base URL of the upstream (e.g. `http://127.0.0.1:8000`); `None` runs
    /// the built-in echo upstream.
    pub upstream: Option<String>,
    /// This replica's machine id; `None` means 0, with a warning.
    pub machine_id: Option<u32>,
    /// Where to keep the fixed machine id's high-water mark, so that ids
    /// never repeat across restarts, crashes and wall clock steps (see
    /// [`high_water_file`](crate::high_water_file)); `None` waits out the
    /// id clock's lead at a stop instead, which a crash cannot. Not with
    /// [`GatewayConfig::lease`], whose mark is kept in etcd.
    pub high_water_file: Option<PathBuf>,
    /// The id layout.
    pub layout: SnowflakeLayout,
    /// The plugin file to load and watch; `None` runs the bundled plugin.
    pub plugin: Option<PathBuf>,
    /// Extra settings handed to the plugin's `configure`.
    pub plugin_settings: BTreeMap<String, String>,
    /// Where compiled plugins are kept between loads (see
    /// [`CompileCache`](crate::CompileCache)); `None` compiles at every load.
    pub plugin_cache_dir: Option<PathBuf>,
    /// The child process plugins are compiled in, under limits of its own
    /// (see [`CompileProcess`]); `None` compiles them in the gateway's own
    /// process, unlimited (the default of the library, which cannot know
    /// of a program to run). `snowgate serve` compiles in
    /// `snowgate compile-plugin`.
    pub compile_process: Option<CompileProcess>,
    /// Where the admin endpoints listen.
    pub admin_listen: SocketAddr,
    /// The largest request body accepted.
    pub max_body_bytes: usize,
    /// The most memory the request bodies read whole (for the plugin) may
    /// hold at once, in bytes (see
    /// [`BodyMemory`](crate::gateway::body_memory::BodyMemory)); `None` is
    /// [`default_limit`] of `max_body_bytes`.
    pub body_memory: Option<usize>,
    /// What to do when the plugin fails.
    pub failure_policy: FailurePolicy,
    /// Limits of each plugin call.
    pub plugin_limits: PluginLimits,
    /// How long in-flight requests may take to finish on shutdown.
    pub shutdown_grace: Duration,
    /// Quiet time after the last change to the plugin file before reloading.
    pub reload_debounce: Duration,
    /// Limits on client connections.
    pub connections: ConnectionLimits,
    /// How long the gateway waits on the upstream.
    pub upstream_timeouts: UpstreamTimeouts,
    /// The most requests in flight to the upstream at once (each holds a
    /// connection until its response has ended); more wait for a turn up
    /// to the connect timeout, then get 503 `upstream_busy`. `None`: no
    /// bound, as nginx's `max_conns` has none by default.
    pub max_upstream_requests: Option<usize>,
    /// Bearer token every admin request must carry; required when the
    /// admin listener is not on a loopback address.
    pub admin_token: Option<String>,
    /// Lease the machine id in etcd instead of using `machine_id`.
    pub lease: Option<LeaseConfig>,
    /// Threads that serve client connections, each with its own event loop
    /// and upstream connection pool; `None` is one per CPU.
    pub workers: Option<usize>,
}

/// Limits that keep slow, huge or idle clients from starving others.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectionLimits {
    /// A client must send a request's complete headers within this time
    /// (also bounds how long an idle keep-alive connection is held).
    pub header_read_timeout: Duration,
    /// The longest a client may pause while sending a request body (the
    /// gateway waiting for more); then it gets 408. Only time the gateway
    /// waits on the client counts. Also the longest a request waits for
    /// room for its body, and for a plugin call slot once it is read (see
    /// [`SnowgateLayer::with_body_memory`](crate::gateway::middleware::SnowgateLayer::with_body_memory)).
    pub body_read_timeout: Duration,
    /// The longest a client may take none of a response the gateway has
    /// for it (its socket full, or over HTTP/2 its flow-control window
    /// used up); then its connection is closed.
    pub send_timeout: Duration,
    /// The largest request head (request line and headers) accepted, in
    /// bytes; larger heads get 431. At least [`MIN_HEADER_BYTES`]; at most
    /// [`MAX_HEADER_BYTES`] is used.
    pub max_header_bytes: usize,
    /// Client connections served at once. At the limit the connection idle
    /// longest (for at least a second) is closed to make room; with none
    /// idle, new clients wait in the listen backlog.
    pub max_connections: usize,
    /// Requests one HTTP/2 connection may have open at once (its
    /// `SETTINGS_MAX_CONCURRENT_STREAMS`): each may hold an upstream
    /// connection of its own, so this bounds what one client connection
    /// costs the upstream and the gateway's file descriptors.
    pub max_streams_per_connection: u32,
}

impl Default for ConnectionLimits {
    fn default() -> Self {
        ConnectionLimits {
            header_read_timeout: Duration::from_secs(10),
            body_read_timeout: Duration::from_secs(60),
            send_timeout: Duration::from_secs(60),
            max_header_bytes: 64 << 10,
            max_connections: 4096,
            max_streams_per_connection: 128,
        }
    }
}

/// How long the gateway waits on the upstream, so that an upstream that
/// hangs costs a client a clear 504, not a request that never ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UpstreamTimeouts {
    /// Opening a TCP connection to the upstream, its host name's lookup
    /// included.
    pub connect: Duration,
    /// From handing a request to the upstream client until the upstream's
    /// response headers arrive: connecting and sending the request body
    /// count too.
    /// Generous by default: a non-streaming completion sends its headers
    /// only when generation ends. The response body that follows (a token
    /// stream) is limited by [`UpstreamTimeouts::read`] alone.
    pub response: Duration,
    /// The longest the upstream may pause within a response body, once
    /// its headers came: then the response is cut off. Only time the
    /// gateway waits on the upstream counts, not time the client takes to
    /// read.
    pub read: Duration,
    /// How long an idle upstream connection is kept for reuse. Below the
    /// upstream's own keep-alive timeout (uvicorn's default is 5 s), so the
    /// gateway never sends a request on a connection the upstream is
    /// closing at that moment.
    pub idle: Duration,
}

impl Default for UpstreamTimeouts {
    fn default() -> Self {
        UpstreamTimeouts {
            connect: Duration::from_secs(5),
            response: Duration::from_secs(600),
            read: Duration::from_secs(600),
            idle: Duration::from_secs(4),
        }
    }
}

impl Default for GatewayConfig {
    fn default() -> Self {
        GatewayConfig {
            listen: SocketAddr::from(([127, 0, 0, 1], 8080)),
            upstream: None,
            machine_id: None,
            high_water_file: None,
            layout: SnowflakeLayout::TrtllmV1,
            plugin: None,
            plugin_settings: BTreeMap::new(),
            plugin_cache_dir: None,
            compile_process: None,
            admin_listen: SocketAddr::from(([127, 0, 0, 1], 9901)),
            max_body_bytes: 32 << 20,
            body_memory: None,
            failure_policy: FailurePolicy::FailClosed,
            plugin_limits: PluginLimits::default(),
            shutdown_grace: Duration::from_secs(30),
            reload_debounce: Duration::from_millis(200),
            connections: ConnectionLimits::default(),
            upstream_timeouts: UpstreamTimeouts::default(),
            max_upstream_requests: None,
            admin_token: None,
            lease: None,
            workers: None,
        }
    }
}

impl GatewayConfig {
    /// The most memory request bodies read whole may hold at once, in
    /// bytes: the one given, or the default for the body limit.
    pub fn body_memory_limit(&self) -> usize {
        self.body_memory
            .unwrap_or_else(|| default_limit(self.max_body_bytes))
    }

    /// The threads that serve client connections: the number given, or
    /// one per CPU.
    pub fn worker_count(&self) -> usize {
        self.workers.unwrap_or_else(|| {
            std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get)
        })
    }
}

/// Reads a listen address: an IP address and a port, as `127.0.0.1:8080`
/// or `[::1]:8080`. Host names are not resolved (one name can stand for
/// several addresses), and an address left out is not taken to mean every
/// interface: the error says what to write instead.
pub fn parse_listen_address(text: &str) -> Result<SocketAddr, String> {
    if let Ok(address) = text.parse() {
        return Ok(address);
    }
    let example = |port: u16| {
        format!("write 127.0.0.1:{port} for this host only, or 0.0.0.0:{port} for every interface")
    };
    // An address alone, IPv6 in brackets or not.
    let bare = text
        .strip_prefix('[')
        .and_then(|t| t.strip_suffix(']'))
        .unwrap_or(text);
    if let Ok(ip) = bare.parse::<IpAddr>() {
        let with_port = match ip {
            IpAddr::V4(ip) => format!("{ip}:PORT"),
            // `::1:8080` is an IPv6 address, but more likely `::1` and a
            // port outside brackets.
            IpAddr::V6(ip) => match bare.rsplit_once(':') {
                Some((host, port))
                    if bare == text
                        && !host.ends_with(':')
                        && host.parse::<IpAddr>().is_ok()
                        && port.parse::<u16>().is_ok() =>
                {
                    format!("[{ip}]:PORT, or, if {port} is the port, [{host}]:{port}")
                }
                _ => format!("[{ip}]:PORT"),
            },
        };
        return Err(format!(
            "{text:?} is an address without a port: write {with_port}"
        ));
    }
    let problem = match text.rsplit_once(':') {
        None => match text.parse::<u16>() {
            Ok(port) => format!("is a port without an address: {}", example(port)),
            Err(_) => "is not an IP address and a port, e.g. 127.0.0.1:8080".to_string(),
        },
        Some((host, port)) => match (host, port.parse::<u16>()) {
            (_, Err(_)) => format!("has no port from 0 to 65535 after its last ':' ({port:?})"),
            ("", Ok(port)) => format!("has no address before the port: {}", example(port)),
            (host, Ok(port)) if host.parse::<IpAddr>().is_ok() => {
                format!("is an IPv6 address with a port outside brackets: write [{host}]:{port}")
            }
            (host, Ok(port)) if !host.starts_with('[') => format!(
                "names a host, and host names are not resolved: {}",
                example(port)
            ),
            _ => "is not an IP address and a port, e.g. [::1]:8080".to_string(),
        },
    };
    Err(format!("{text:?} {problem}"))
}

/// [`parse_listen_address`] for the config file; a bare number is taken
/// as the text it is written as (a port without an address).
fn listen_address<'de, D: serde::Deserializer<'de>>(
    deserializer: D,
) -> Result<Option<SocketAddr>, D::Error> {
    let text = match toml::Value::deserialize(deserializer)? {
        toml::Value::String(text) => text,
        toml::Value::Integer(n) => n.to_string(),
        other => {
            return Err(serde::de::Error::custom(format!(
                "a {} is not an address: write a string such as \"127.0.0.1:8080\"",
                other.type_str()
            )))
        }
    };
    parse_listen_address(&text)
        .map(Some)
        .map_err(serde::de::Error::custom)
}

/// One layer of the gateway's settings, every key optional: the TOML file
/// of `--config`, or the flags of `serve` (each flag is a key with `--`
/// before it). [`ConfigFile::apply`] lays a layer over a [`GatewayConfig`];
/// [`ConfigFile::check`] and [`ConfigFile::check_plugin`] check the result.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct ConfigFile {
    /// See [`GatewayConfig::listen`].
    #[serde(default, deserialize_with = "listen_address")]
    pub listen: Option<SocketAddr>,
    /// See [`GatewayConfig::upstream`].
    pub upstream: Option<String>,
    /// See [`GatewayConfig::machine_id`].
    pub machine_id: Option<u32>,
    /// See [`GatewayConfig::high_water_file`].
    pub high_water_file: Option<PathBuf>,
    /// See [`GatewayConfig::layout`].
    pub layout: Option<String>,
    /// See [`GatewayConfig::plugin`].
    pub plugin: Option<PathBuf>,
    /// See [`GatewayConfig::plugin_settings`].
    pub plugin_settings: Option<BTreeMap<String, String>>,
    /// See [`GatewayConfig::plugin_cache_dir`].
    pub plugin_cache_dir: Option<PathBuf>,
    /// See [`GatewayConfig::admin_listen`].
    #[serde(default, deserialize_with = "listen_address")]
    pub admin_listen: Option<SocketAddr>,
    /// See [`GatewayConfig::max_body_bytes`].
    pub max_body_bytes: Option<usize>,
    /// See [`GatewayConfig::body_memory`], in MiB.
    pub body_memory_mib: Option<usize>,
    /// See [`GatewayConfig::failure_policy`].
    pub failure_policy: Option<FailurePolicy>,
    /// Plugin memory limit in MiB.
    pub plugin_memory_mib: Option<usize>,
    /// Plugin call deadline in milliseconds.
    pub plugin_deadline_ms: Option<u64>,
    /// See [`PluginLimits::calls_per_instance`].
    pub plugin_calls_per_instance: Option<u32>,
    /// See [`PluginLimits::max_instances`].
    pub plugin_instances: Option<u32>,
    /// See [`CompileLimits::memory_bytes`](crate::CompileLimits::memory_bytes),
    /// in MiB.
    pub plugin_compile_memory_mib: Option<u64>,
    /// See [`CompileLimits::cpu`](crate::CompileLimits::cpu), in seconds.
    pub plugin_compile_cpu_secs: Option<u64>,
    /// Compile plugins in the gateway's own process, without the compile
    /// limits: for where it cannot start itself again (valgrind, a seccomp
    /// profile without `execve`).
    pub plugin_compile_in_process: Option<bool>,
    /// Shutdown grace period in seconds.
    pub shutdown_grace_secs: Option<u64>,
    /// Reload debounce in milliseconds.
    pub reload_debounce_ms: Option<u64>,
    /// See [`ConnectionLimits::header_read_timeout`], in milliseconds.
    pub header_read_timeout_ms: Option<u64>,
    /// See [`ConnectionLimits::body_read_timeout`], in milliseconds.
    pub body_read_timeout_ms: Option<u64>,
    /// See [`ConnectionLimits::send_timeout`], in milliseconds.
    pub send_timeout_ms: Option<u64>,
    /// See [`ConnectionLimits::max_header_bytes`].
    pub max_header_bytes: Option<usize>,
    /// See [`ConnectionLimits::max_connections`].
    pub max_connections: Option<usize>,
    /// See [`ConnectionLimits::max_streams_per_connection`].
    pub max_streams_per_connection: Option<u32>,
    /// See [`GatewayConfig::max_upstream_requests`].
    pub max_upstream_requests: Option<usize>,
    /// See [`UpstreamTimeouts::connect`], in milliseconds.
    pub upstream_connect_timeout_ms: Option<u64>,
    /// See [`UpstreamTimeouts::response`], in milliseconds.
    pub upstream_response_timeout_ms: Option<u64>,
    /// See [`UpstreamTimeouts::read`], in milliseconds.
    pub upstream_read_timeout_ms: Option<u64>,
    /// See [`UpstreamTimeouts::idle`], in milliseconds.
    pub upstream_idle_timeout_ms: Option<u64>,
    /// See [`GatewayConfig::admin_token`].
    pub admin_token: Option<String>,
    /// See [`GatewayConfig::workers`].
    pub workers: Option<usize>,
    /// etcd endpoints, comma-separated: lease the machine id there.
    pub etcd: Option<String>,
    /// TTL of the machine id lease, in seconds (default 10).
    pub machine_id_ttl: Option<u64>,
    /// Key prefix in etcd (default `/snowgate`).
    pub etcd_prefix: Option<String>,
}

/// The largest config file read: settings take a few hundred bytes, and a
/// device or a runaway file must not be read without end.
pub const MAX_CONFIG_FILE_BYTES: u64 = 1 << 20;

/// The plugin memory limit `plugin-memory-mib` sets, in bytes: 1 to 4096
/// MiB, as a wasm32 memory cannot be larger than 4 GiB.
pub fn plugin_memory_bytes(mib: usize) -> anyhow::Result<usize> {
    anyhow::ensure!(
        (1..=MAX_PLUGIN_MEMORY_MIB as usize).contains(&mib),
        "plugin-memory-mib must be between 1 and {MAX_PLUGIN_MEMORY_MIB}, not {mib}"
    );
    Ok(mib << 20)
}

/// The largest plugin memory limit, in MiB: a wasm32 memory's 4 GiB.
pub const MAX_PLUGIN_MEMORY_MIB: u64 = 4096;

/// What to tell an operator whose plugin memory cannot hold a body that
/// needs `few_mib` (with few ids) to `densest_mib` (dense with ids):
/// raise `--plugin-memory-mib` where a limit can hold it, and otherwise
/// `smaller` (what makes the body smaller), since no limit can.
pub fn memory_advice(few_mib: u64, densest_mib: u64, smaller: &str) -> String {
    let most = MAX_PLUGIN_MEMORY_MIB;
    if densest_mib <= most {
        "raise --plugin-memory-mib".to_string()
    } else if few_mib <= most {
        format!(
            "raise --plugin-memory-mib; at its most, {most} MiB, a body of that size dense with \
             ids still does not fit: {smaller}"
        )
    } else {
        format!("no --plugin-memory-mib can hold such a body (at most {most} MiB): {smaller}")
    }
}

/// The plugin call deadline `plugin-deadline-ms` sets: 1 ms to an hour.
pub fn plugin_deadline(ms: u64) -> anyhow::Result<Duration> {
    anyhow::ensure!(
        (1..=MAX_PLUGIN_DEADLINE_MS).contains(&ms),
        "plugin-deadline-ms must be between 1 and {MAX_PLUGIN_DEADLINE_MS} (an hour), not {ms}"
    );
    Ok(Duration::from_millis(ms))
}

/// The listener among `listeners` that an upstream at `base` reaches by
/// its address as written, an IP address or `localhost`: the gateway would
/// send its requests to itself. That is the listener's own address, or a
/// loopback address (or `0.0.0.0` and `[::]`, which reach this host) of
/// its family where it listens on every address. Not looked at: a name
/// to be resolved, a numeric shorthand only the resolver reads (`127.1`),
/// another of this host's own addresses (whether an address is this
/// host's cannot be told by binding it where `ip_nonlocal_bind` is set),
/// and an IPv4 address under a listener on `[::]`, which takes IPv4 too
/// only where `net.ipv6.bindv6only` is 0: each to refuse no upstream that
/// is not the gateway.
fn listener_reached(
    base: &http::Uri,
    listeners: [(&'static str, SocketAddr); 2],
) -> Option<(&'static str, SocketAddr)> {
    use std::net::{Ipv4Addr, Ipv6Addr};
    let host = base.host()?;
    let port = base.port_u16().unwrap_or(80);
    let bracketed = host.strip_prefix('[').and_then(|h| h.strip_suffix(']'));
    let targets: Vec<IpAddr> = if host.eq_ignore_ascii_case("localhost") {
        vec![Ipv4Addr::LOCALHOST.into(), Ipv6Addr::LOCALHOST.into()]
    } else {
        let ip: IpAddr = bracketed.unwrap_or(host).parse().ok()?;
        vec![ip.to_canonical()]
    };
    listeners.into_iter().find(|(_, listener)| {
        let at = listener.ip().to_canonical();
        listener.port() == port
            && targets.iter().any(|&target| {
                target == at
                    || (at.is_unspecified()
                        && at.is_ipv4() == target.is_ipv4()
                        && (target.is_loopback() || target.is_unspecified()))
            })
    })
}

/// Where `error` is in the config file's `text` (line and column) and what
/// it is, without the file's own text: the TOML parser's report quotes the
/// line, and serde's "invalid type" and "invalid value" quote the value,
/// and with them a token or a password into the gateway's log (a
/// misspelled `admin_token = "..."`, an `admin-token` or a plugin
/// setting's key given as a number). A key the parser names (unknown
/// field `x`) is kept.
fn toml_problem(text: &str, error: &toml::de::Error) -> String {
    let message = without_values(error.message().trim_end());
    let Some(at) = error.span().map(|span| span.start.min(text.len())) else {
        return message;
    };
    let before = &text.as_bytes()[..at];
    let line_start = before
        .iter()
        .rposition(|&b| b == b'\n')
        .map_or(0, |i| i + 1);
    let line = before.iter().filter(|&&b| b == b'\n').count() + 1;
    // A byte order mark, which the parser takes, is no column.
    let in_line = &before[line_start..];
    let in_line = in_line
        .strip_prefix("\u{feff}".as_bytes())
        .unwrap_or(in_line);
    let column = String::from_utf8_lossy(in_line).chars().count() + 1;
    format!("line {line}, column {column}: {message}")
}

/// serde's `invalid type: string "...", expected a map` (or `invalid
/// value`) without the value that came: `invalid type: string, expected a
/// map`. Other messages are kept whole.
fn without_values(message: &str) -> String {
    for lead in ["invalid type: ", "invalid value: "] {
        if let Some(rest) = message.strip_prefix(lead) {
            // What is expected comes last, from the setting's type.
            let (came, expected) = rest.rsplit_once(", expected ").unwrap_or((rest, ""));
            // The kind (`integer`, `floating point`), then the value quoted.
            let kind = came.split(['`', '"']).next().unwrap_or("").trim_end();
            return match expected {
                "" => format!("{lead}{kind}"),
                expected => format!("{lead}{kind}, expected {expected}"),
            };
        }
    }
    message.to_string()
}

impl ConfigFile {
    /// Reads and parses a TOML configuration file: a regular file of at
    /// most [`MAX_CONFIG_FILE_BYTES`] in UTF-8. Relative paths in it
    /// (`plugin`, `high-water-file`, `plugin-cache-dir`) are taken from the
    /// file's directory, not from wherever the gateway was started: under
    /// systemd that is `/`, where a relative `high-water-file` would be
    /// another, empty file, with none of the ids made before.
    pub fn read(path: &Path) -> anyhow::Result<ConfigFile> {
        let bytes = read_regular_file(path, "the config file", MAX_CONFIG_FILE_BYTES)?;
        let text = String::from_utf8(bytes)
            .with_context(|| format!("reading the config file {}", path.display()))?;
        let mut file: ConfigFile = toml::from_str(&text).map_err(|e| {
            anyhow::anyhow!(
                "parsing the config file {}: {}",
                path.display(),
                toml_problem(&text, &e)
            )
        })?;
        let dir = path.parent().unwrap_or(Path::new(""));
        for (key, setting) in [
            ("plugin", &mut file.plugin),
            ("high-water-file", &mut file.high_water_file),
            ("plugin-cache-dir", &mut file.plugin_cache_dir),
        ] {
            // Joined to the file's directory, an empty path would be that
            // directory: compiled builds written beside the config file.
            anyhow::ensure!(
                setting.as_ref().is_none_or(|p| !p.as_os_str().is_empty()),
                "in the config file {}: {key} is empty; give a path, or leave the key out",
                path.display()
            );
            if let Some(relative) = setting.as_mut().filter(|p| p.is_relative()) {
                *relative = dir.join(&*relative);
            }
        }
        Ok(file)
    }

    /// Checks settings that only make sense together, or whole: the
    /// upstream URL must be one the gateway can use, a fixed machine id
    /// must fit the layout, and an admin listener reachable from other
    /// hosts must be protected by a token.
    pub fn check(config: &GatewayConfig) -> anyhow::Result<()> {
        // Before anything binds: a bad URL is a bad setting (status 2).
        if let Some(url) = &config.upstream {
            let (base, _) = crate::gateway::upstream::base_url(url)?;
            let listeners = [
                ("--listen", config.listen),
                ("--admin-listen", config.admin_listen),
            ];
            if let Some((flag, listener)) = listener_reached(&base, listeners) {
                anyhow::bail!(
                    "--upstream {} is the gateway's own {flag} {listener}: each request would \
                     be sent back to the gateway{}; give the upstream's own address",
                    without_credentials(url),
                    if flag == "--listen" {
                        ", again and again, until every connection is taken"
                    } else {
                        ", opening its admin endpoints to any client of the gateway"
                    }
                );
            }
        }
        // The echo upstream answers at once, and is not bounded: a bound
        // given for it is a mistake, not to be ignored.
        anyhow::ensure!(
            config.max_upstream_requests.is_none() || config.upstream.is_some(),
            "--max-upstream-requests bounds the requests sent to --upstream URL, which is not set \
             (the built-in echo answers)"
        );
        ConfigFile::check_plugin(config)?;
        if let Some(lease) = &config.lease {
            anyhow::ensure!(
                !lease.endpoints.is_empty(),
                "--machine-id-ttl and --etcd-prefix need --etcd URL[,URL...] to lease machine ids from"
            );
            one_machine_id_source(
                config.machine_id.is_some(),
                config.high_water_file.is_some(),
                true,
            )?;
        }
        if let Some(limit) = config.body_memory {
            anyhow::ensure!(
                limit >= config.max_body_bytes,
                "--body-memory-mib {} cannot hold one body of --max-body-bytes {}, so such a body \
                 could never be read: give at least {} MiB, or leave it out for the default \
                 (1024 MiB, or the body limit where that is larger)",
                limit >> 20,
                config.max_body_bytes,
                config.max_body_bytes.div_ceil(1 << 20)
            );
        }
        if let Some(lease) = &config.lease {
            let (least, most) = (crate::lease::MIN_TTL, crate::lease::MAX_TTL);
            anyhow::ensure!(
                (least..=most).contains(&lease.ttl),
                "machine-id-ttl must be between {} and {} seconds (a day), not {:?}",
                least.as_secs(),
                most.as_secs(),
                lease.ttl
            );
        }
        if let Some(token) = &config.admin_token {
            // An empty token matched a request without one: admin open to
            // anyone, from an empty SNOWGATE_ADMIN_TOKEN (a Kubernetes
            // secret's empty key, `Environment=...=` in a unit file).
            anyhow::ensure!(
                !token.is_empty(),
                "the admin token (--admin-token, SNOWGATE_ADMIN_TOKEN or the config file's \
                 admin-token) is empty, which would let any request in: give a token, or unset it"
            );
            // A header value sheds whitespace at its ends, and the gateway
            // reads only visible ASCII and spaces in it: a token with
            // anything else could never be presented.
            anyhow::ensure!(
                token.trim() == token && token.bytes().all(|b| b == b' ' || b.is_ascii_graphic()),
                "the admin token (--admin-token, SNOWGATE_ADMIN_TOKEN or the config file's \
                 admin-token) has whitespace at an end, or a control or non-ASCII character (a \
                 newline from a file?), which no Authorization header can carry whole: no \
                 request could present it"
            );
        }
        // Caught here, before the plugin compiles, as a bad setting; the
        // bind would fail anyway, later and with the OS's words.
        // The listeners take no IPV6_V6ONLY: `[::]` takes IPv4 too.
        let (requests, admin) = (config.listen, config.admin_listen);
        let (a, b) = (requests.ip().to_canonical(), admin.ip().to_canonical());
        let takes_all = |ip: std::net::IpAddr, other: std::net::IpAddr| {
            ip.is_unspecified() && (ip.is_ipv6() || other.is_ipv4())
        };
        let overlap = a == b || takes_all(a, b) || takes_all(b, a);
        anyhow::ensure!(
            requests.port() == 0 || requests.port() != admin.port() || !overlap,
            "--listen {requests} and --admin-listen {admin} would take the same port: give the \
             admin listener a port of its own"
        );
        // `[::ffff:127.0.0.1]` is loopback too.
        if !b.is_loopback() && config.admin_token.is_none() {
            anyhow::bail!(
                "the admin listener {} is not on a loopback address, so it needs a bearer token: \
                 set --admin-token or SNOWGATE_ADMIN_TOKEN, or listen on 127.0.0.1",
                config.admin_listen
            );
        }
        Ok(())
    }

    /// Checks the settings the plugin is loaded and checked with, which
    /// `snowgate check` takes from a gateway's settings: a fixed machine id
    /// must fit the layout, and no plugin setting may be the host's own
    /// `id-layout`. Part of [`ConfigFile::check`].
    pub fn check_plugin(config: &GatewayConfig) -> anyhow::Result<()> {
        if let Some(id) = config.machine_id {
            config
                .layout
                .check_machine_id(id)
                .map_err(|e| anyhow::anyhow!("--machine-id: {e}"))?;
        }
        if let Some(problem) = config
            .plugin_settings
            .keys()
            .find_map(|name| crate::plugin::layout_setting_problem(name))
        {
            anyhow::bail!(problem);
        }
        Ok(())
    }

    /// Lays this file's settings over `config`. The machine id comes from
    /// one source: settings that name one (`machine-id`, or `etcd`) put
    /// aside the other source's settings that `config` had from a layer
    /// before (the file, under the flags), so that a flag can move one
    /// replica from a fixed id to a leased one, or back.
    pub fn apply(self, config: &mut GatewayConfig) -> anyhow::Result<()> {
        macro_rules! set {
            ($field:ident) => {
                if let Some(value) = self.$field {
                    config.$field = value;
                }
            };
        }
        set!(listen);
        set!(admin_listen);
        if let Some(bytes) = self.max_body_bytes {
            // 0 means no limit to nginx (`client_max_body_size 0`); here
            // it would refuse every body, which nobody means.
            anyhow::ensure!(
                bytes > 0,
                "max-body-bytes must be at least 1, not 0: there is no unlimited body size \
                 (bodies read for the plugin are held in memory); give the largest body to take"
            );
            // Room in the body memory is counted in KiB, at most `u32::MAX`
            // of them for one body.
            anyhow::ensure!(
                bytes <= MAX_BODY_MEMORY_MIB << 20,
                "max-body-bytes must be at most {} (1 TiB), not {bytes}",
                MAX_BODY_MEMORY_MIB << 20
            );
            config.max_body_bytes = bytes;
        }
        set!(failure_policy);
        set!(plugin_settings);
        // Both in one layer are refused here: the next layer's choice
        // would put one aside, hiding the contradiction.
        one_machine_id_source(
            self.machine_id.is_some(),
            self.high_water_file.is_some(),
            self.etcd.is_some(),
        )?;
        if self.machine_id.is_some() {
            config.lease = None;
        }
        if self.etcd.is_some() {
            config.machine_id = None;
            config.high_water_file = None;
        }
        if self.upstream.is_some() {
            config.upstream = self.upstream;
        }
        if self.machine_id.is_some() {
            config.machine_id = self.machine_id;
        }
        if self.high_water_file.is_some() {
            config.high_water_file = self.high_water_file;
        }
        if self.plugin.is_some() {
            config.plugin = self.plugin;
        }
        if self.plugin_cache_dir.is_some() {
            config.plugin_cache_dir = self.plugin_cache_dir;
        }
        if let Some(layout) = self.layout {
            config.layout = layout.parse().context("config key layout")?;
        }
        if let Some(mib) = self.body_memory_mib {
            anyhow::ensure!(
                (1..=MAX_BODY_MEMORY_MIB).contains(&mib),
                "body-memory-mib must be between 1 and {MAX_BODY_MEMORY_MIB} (1 TiB), not {mib}"
            );
            config.body_memory = Some(mib << 20);
        }
        if let Some(mib) = self.plugin_memory_mib {
            config.plugin_limits.memory_bytes = plugin_memory_bytes(mib)?;
        }
        if let Some(ms) = self.plugin_deadline_ms {
            config.plugin_limits.deadline = plugin_deadline(ms)?;
        }
        if let Some(n) = self.plugin_calls_per_instance {
            anyhow::ensure!(
                n > 0,
                "plugin-calls-per-instance must be at least 1, not {n}"
            );
            config.plugin_limits.calls_per_instance = n;
        }
        if let Some(n) = self.plugin_instances {
            // With one slot a reload's check of a new build and a request's
            // call cannot run at once: whichever came second would fail as
            // busy, a client's 503 or a good build refused.
            anyhow::ensure!(
                (2..=MAX_PLUGIN_INSTANCES).contains(&n),
                "plugin-instances must be between 2 and {MAX_PLUGIN_INSTANCES} (one slot is kept \
                 for a reload's check of a new build), not {n}"
            );
            config.plugin_limits.max_instances = n;
        }
        // Drops the compile process an earlier layer gave, with its limits:
        // a layering that must not drop them says so before (as `snowgate
        // serve` does for a flag over its config file's limits).
        if self.plugin_compile_in_process == Some(true) {
            config.compile_process = None;
        }
        if self.plugin_compile_memory_mib.is_some() || self.plugin_compile_cpu_secs.is_some() {
            let Some(process) = config.compile_process.as_mut() else {
                anyhow::bail!(
                    "plugin-compile-memory-mib and plugin-compile-cpu-secs limit the process \
                     plugins are compiled in, and this gateway compiles them in its own"
                );
            };
            if let Some(mib) = self.plugin_compile_memory_mib {
                anyhow::ensure!(
                    (MIN_COMPILE_MEMORY_MIB..=MAX_COMPILE_MEMORY_MIB).contains(&mib),
                    "plugin-compile-memory-mib must be between {MIN_COMPILE_MEMORY_MIB} and \
                     {MAX_COMPILE_MEMORY_MIB} (1 TiB), not {mib}"
                );
                process.limits.memory_bytes = mib << 20;
            }
            if let Some(secs) = self.plugin_compile_cpu_secs {
                anyhow::ensure!(
                    (1..=MAX_COMPILE_CPU_SECS).contains(&secs),
                    "plugin-compile-cpu-secs must be between 1 and {MAX_COMPILE_CPU_SECS} (a day), \
                     not {secs}"
                );
                process.limits.cpu = Duration::from_secs(secs);
            }
        }
        if let Some(secs) = self.shutdown_grace_secs {
            anyhow::ensure!(
                secs <= MAX_TIMEOUT_MS / 1000,
                "shutdown-grace-secs must be at most {} (a day), not {secs}",
                MAX_TIMEOUT_MS / 1000
            );
            config.shutdown_grace = Duration::from_secs(secs);
        }
        if let Some(ms) = self.reload_debounce_ms {
            // The watcher adds ten quiet times to the clock: beyond a day
            // that could overflow it, and no rollout waits that long.
            anyhow::ensure!(
                ms <= MAX_TIMEOUT_MS,
                "reload-debounce-ms must be at most {MAX_TIMEOUT_MS} (a day), not {ms}"
            );
            config.reload_debounce = Duration::from_millis(ms);
        }
        if let Some(ms) = self.header_read_timeout_ms {
            // 0 would close every keep-alive connection after its response
            // and drop a request head split across two reads; a day is
            // beyond any slow-loris protection.
            anyhow::ensure!(
                (1..=MAX_TIMEOUT_MS).contains(&ms),
                "header-read-timeout-ms must be between 1 and {MAX_TIMEOUT_MS} (a day), not {ms}"
            );
            config.connections.header_read_timeout = Duration::from_millis(ms);
        }
        if let Some(ms) = self.body_read_timeout_ms {
            anyhow::ensure!(
                (1..=MAX_TIMEOUT_MS).contains(&ms),
                "body-read-timeout-ms must be between 1 and {MAX_TIMEOUT_MS} (a day), not {ms}"
            );
            config.connections.body_read_timeout = Duration::from_millis(ms);
        }
        if let Some(ms) = self.send_timeout_ms {
            anyhow::ensure!(
                (1..=MAX_TIMEOUT_MS).contains(&ms),
                "send-timeout-ms must be between 1 and {MAX_TIMEOUT_MS} (a day), not {ms}"
            );
            config.connections.send_timeout = Duration::from_millis(ms);
        }
        if let Some(bytes) = self.max_header_bytes {
            anyhow::ensure!(
                (MIN_HEADER_BYTES..=MAX_HEADER_BYTES).contains(&bytes),
                "max-header-bytes must be between {MIN_HEADER_BYTES} and {MAX_HEADER_BYTES} \
                 (512 KiB), not {bytes}"
            );
            config.connections.max_header_bytes = bytes;
        }
        if let Some(n) = self.max_connections {
            anyhow::ensure!(
                (1..=MAX_CONNECTIONS).contains(&n),
                "max-connections must be between 1 and {MAX_CONNECTIONS}, not {n}"
            );
            config.connections.max_connections = n;
        }
        if let Some(n) = self.max_streams_per_connection {
            anyhow::ensure!(
                (1..=MAX_STREAMS_PER_CONNECTION).contains(&n),
                "max-streams-per-connection must be between 1 and {MAX_STREAMS_PER_CONNECTION}, \
                 not {n}"
            );
            config.connections.max_streams_per_connection = n;
        }
        if let Some(n) = self.max_upstream_requests {
            anyhow::ensure!(
                (1..=MAX_UPSTREAM_REQUESTS).contains(&n),
                "max-upstream-requests must be between 1 and {MAX_UPSTREAM_REQUESTS}, not {n}"
            );
            config.max_upstream_requests = Some(n);
        }
        let timeouts = &mut config.upstream_timeouts;
        for (name, ms, field) in [
            (
                "upstream-connect-timeout-ms",
                self.upstream_connect_timeout_ms,
                &mut timeouts.connect,
            ),
            (
                "upstream-response-timeout-ms",
                self.upstream_response_timeout_ms,
                &mut timeouts.response,
            ),
            (
                "upstream-read-timeout-ms",
                self.upstream_read_timeout_ms,
                &mut timeouts.read,
            ),
            (
                "upstream-idle-timeout-ms",
                self.upstream_idle_timeout_ms,
                &mut timeouts.idle,
            ),
        ] {
            if let Some(ms) = ms {
                anyhow::ensure!(
                    (1..=MAX_TIMEOUT_MS).contains(&ms),
                    "{name} must be between 1 and {MAX_TIMEOUT_MS} (a day), not {ms}"
                );
                *field = Duration::from_millis(ms);
            }
        }
        if self.admin_token.is_some() {
            config.admin_token = self.admin_token;
        }
        if let Some(n) = self.workers {
            anyhow::ensure!(
                (1..=1024).contains(&n),
                "workers must be between 1 and 1024, not {n}"
            );
            config.workers = Some(n);
        }
        if let Some(endpoints) = self.etcd {
            let endpoints: Vec<String> = endpoints
                .split(',')
                .map(str::trim)
                .filter(|e| !e.is_empty())
                .map(String::from)
                .collect();
            anyhow::ensure!(
                !endpoints.is_empty(),
                "etcd needs at least one endpoint URL, e.g. http://127.0.0.1:2379"
            );
            for endpoint in &endpoints {
                let shown = without_credentials(endpoint);
                let uri: Option<http::Uri> = endpoint.parse().ok();
                let scheme = uri.as_ref().and_then(|u| u.scheme_str());
                // etcd-client is built without TLS: an https:// endpoint
                // could never be reached, only retried for ever.
                anyhow::ensure!(
                    scheme != Some("https"),
                    "etcd endpoint {shown:?}: https:// is not supported (snowgate's etcd client \
                     has no TLS); reach etcd over http:// on a trusted network, or through a \
                     local TLS proxy"
                );
                let authority = uri.as_ref().and_then(http::Uri::authority);
                let (Some("http"), Some(authority)) = (scheme, authority) else {
                    anyhow::bail!(
                        "etcd endpoint {shown:?} is not an http:// URL, e.g. http://127.0.0.1:2379"
                    );
                };
                // Not sent (no etcd authentication here), but shown on
                // /status and in every warning about the endpoint.
                anyhow::ensure!(
                    shown == *endpoint,
                    "etcd endpoint {shown:?}: credentials in the URL are not supported (they \
                     would not be sent; etcd authentication is not supported)"
                );
                if let Some(problem) = host_and_port_problem(authority, endpoint, &shown) {
                    anyhow::bail!("etcd endpoint {shown:?}: {problem}, e.g. http://127.0.0.1:2379");
                }
                // etcd's API is at the root: a path or query would be
                // dropped without a word.
                let extra = uri
                    .as_ref()
                    .and_then(http::Uri::path_and_query)
                    .map_or("", |p| p.as_str());
                anyhow::ensure!(
                    extra.is_empty() || extra == "/",
                    "etcd endpoint {shown:?}: a path or query ({extra}) is not supported; give \
                     the endpoint's scheme, host and port, e.g. http://127.0.0.1:2379"
                );
            }
            let lease = config
                .lease
                .get_or_insert_with(LeaseConfig::default_for_endpoints);
            lease.endpoints = endpoints;
        }
        if let Some(secs) = self.machine_id_ttl {
            anyhow::ensure!(
                (MIN_MACHINE_ID_TTL_SECS..=MAX_MACHINE_ID_TTL_SECS).contains(&secs),
                "machine-id-ttl must be between {MIN_MACHINE_ID_TTL_SECS} and {MAX_MACHINE_ID_TTL_SECS} seconds (a day), not {secs}"
            );
            config
                .lease
                .get_or_insert_with(LeaseConfig::default_for_endpoints)
                .ttl = Duration::from_secs(secs);
        }
        if let Some(prefix) = self.etcd_prefix {
            // etcd keys are bytes: `snowgate` and `/snowgate` (or
            // `//snowgate`) are different namespaces, and replicas started
            // under two spellings would lease the same machine ids. Only
            // one spelling of each is taken (trailing slashes aside).
            let trimmed = prefix.trim_end_matches('/');
            anyhow::ensure!(
                prefix.starts_with('/')
                    && !trimmed.contains("//")
                    && !prefix.chars().any(|c| c.is_whitespace() || c.is_control()),
                "etcd-prefix {prefix:?} must start with '/', without empty segments ('//'), \
                 whitespace or control characters: etcd keys are compared byte for byte, so \
                 replicas started under two spellings of one prefix (say snowgate and \
                 /snowgate) would lease the same machine ids"
            );
            config
                .lease
                .get_or_insert_with(LeaseConfig::default_for_endpoints)
                .prefix = prefix;
        }
        Ok(())
    }
}

/// Refuses a fixed machine id (or a high-water file, which is for one) set
/// together with a leased one.
fn one_machine_id_source(fixed: bool, high_water_file: bool, leased: bool) -> anyhow::Result<()> {
    anyhow::ensure!(
        !(fixed && leased),
        "use either --machine-id (a fixed id) or --etcd (a leased id), not both"
    );
    anyhow::ensure!(
        !(high_water_file && leased),
        "--high-water-file is for a fixed --machine-id; with --etcd the high-water mark is kept \
         in etcd"
    );
    Ok(())
}

/// Why `authority` (of the URL `url`, shown in messages as `shown`) names
/// no host and port to connect to, if it does not: an empty host (`http://:80`,
/// which would be looked up as a name and fail at every use), or a port
/// that is empty or outside 1..=65535 (which `http::Uri` takes, and a
/// client would replace with port 80). A port that may be the end of a password (`shown` is not
/// `url`) is shown as `***`.
pub(crate) fn host_and_port_problem(
    authority: &http::uri::Authority,
    url: &str,
    shown: &str,
) -> Option<String> {
    if authority.host().is_empty() {
        return Some("its host is empty".to_string());
    }
    // After an IPv6 host's closing bracket, if any.
    let after_host = &authority.as_str()[authority.as_str().rfind(']').unwrap_or(0)..];
    let (_, port) = after_host.rsplit_once(':')?;
    if port.parse::<u16>().is_ok_and(|p| p > 0) {
        return None;
    }
    // `http://host:` is port 80 to a URL parser, but more likely a
    // template's `${PORT}` left unset.
    if port.is_empty() {
        return Some("its port is empty (after the ':'); give one, or leave out the ':'".into());
    }
    let port = if shown == url { port } else { "***" };
    Some(format!("port {port} is not 1..=65535"))
}

/// `url` with everything between its scheme and its last `@` shown as
/// `***`: for error messages and `/status`, which must not repeat a
/// password. A password may hold `/`, `?` or `#` unescaped (base64 does),
/// so where the authority ends cannot be told; an `@` in a path is masked
/// with the rest, which costs only words in a message.
pub(crate) fn without_credentials(url: &str) -> String {
    let start = match url.find("://") {
        Some(i)
            if i > 0
                && url[..i]
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || "+-.".contains(c)) =>
        {
            i + 3
        }
        _ => 0,
    };
    match url[start..].rfind('@') {
        Some(at) => format!("{}***{}", &url[..start], &url[start + at..]),
        None => url.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_settings_override_defaults() {
        let file: ConfigFile = toml::from_str(
            r#"
            listen = "0.0.0.0:8000"
            upstream = "http://127.0.0.1:9000"
            machine-id = 12
            layout = "trtllm-v2"
            failure-policy = "fail-open"
            plugin-memory-mib = 64
            plugin-deadline-ms = 50
            plugin-calls-per-instance = 1
            plugin-instances = 8
            workers = 3
            upstream-response-timeout-ms = 30000
            upstream-idle-timeout-ms = 1500
            upstream-read-timeout-ms = 45000
            send-timeout-ms = 2500
            plugin-cache-dir = "/var/cache/snowgate"
            high-water-file = "/var/lib/snowgate/ids.mark"
            [plugin-settings]
            extra = "yes"
            "#,
        )
        .expect("valid config");
        let mut config = GatewayConfig::default();
        file.apply(&mut config).expect("applies");
        assert_eq!(config.listen, "0.0.0.0:8000".parse().unwrap());
        assert_eq!(config.machine_id, Some(12));
        assert_eq!(config.layout, SnowflakeLayout::TrtllmV2);
        assert_eq!(config.failure_policy, FailurePolicy::FailOpen);
        assert_eq!(config.plugin_limits.memory_bytes, 64 << 20);
        assert_eq!(config.plugin_limits.deadline, Duration::from_millis(50));
        assert_eq!(config.plugin_limits.calls_per_instance, 1);
        assert_eq!(config.plugin_limits.max_instances, 8);
        assert_eq!(config.workers, Some(3));
        assert_eq!(config.connections.send_timeout, Duration::from_millis(2500));
        assert_eq!(
            config.upstream_timeouts,
            UpstreamTimeouts {
                connect: Duration::from_secs(5),
                response: Duration::from_secs(30),
                read: Duration::from_secs(45),
                idle: Duration::from_millis(1500),
            }
        );
        assert_eq!(
            config.plugin_settings.get("extra").map(String::as_str),
            Some("yes")
        );
        assert_eq!(config.max_body_bytes, 32 << 20);
        assert_eq!(
            config.plugin_cache_dir.as_deref(),
            Some(Path::new("/var/cache/snowgate"))
        );
        assert_eq!(
            config.high_water_file.as_deref(),
            Some(Path::new("/var/lib/snowgate/ids.mark"))
        );
        ConfigFile::check(&config).expect("a fixed id with a high-water file");
    }

    /// A layer that names the machine id's source puts aside the other
    /// source's settings from the layer before: the flags can move one
    /// replica between a fixed id and a leased one. Within one layer both
    /// are still refused.
    #[test]
    fn a_later_layer_that_names_the_machine_ids_source_replaces_the_other() {
        let layer = |text: &str| toml::from_str::<ConfigFile>(text).expect("valid config");
        let fixed = "machine-id = 3\nhigh-water-file = \"/var/lib/snowgate/ids.mark\"";
        let leased = "etcd = \"http://127.0.0.1:2379\"\nmachine-id-ttl = 30";

        let mut config = GatewayConfig::default();
        layer(fixed).apply(&mut config).unwrap();
        layer("etcd = \"http://10.0.0.1:2379\"")
            .apply(&mut config)
            .unwrap();
        assert_eq!(
            (config.machine_id, config.high_water_file.as_ref()),
            (None, None)
        );
        let lease = config.lease.as_ref().expect("a lease");
        assert_eq!(lease.endpoints, ["http://10.0.0.1:2379"]);
        ConfigFile::check(&config).expect("a leased id alone");

        let mut config = GatewayConfig::default();
        layer(leased).apply(&mut config).unwrap();
        layer("machine-id = 7").apply(&mut config).unwrap();
        assert_eq!(config.machine_id, Some(7));
        assert!(config.lease.is_none(), "{:?}", config.lease);
        ConfigFile::check(&config).expect("a fixed id alone");

        // A layer that names neither keeps what came before.
        let mut config = GatewayConfig::default();
        layer(leased).apply(&mut config).unwrap();
        layer("workers = 2").apply(&mut config).unwrap();
        assert_eq!(config.lease.expect("kept").ttl, Duration::from_secs(30));

        // Both in one layer are refused, whatever the next layer says.
        for both in [
            "machine-id = 3\netcd = \"http://127.0.0.1:2379\"",
            "etcd = \"http://127.0.0.1:2379\"\nhigh-water-file = \"ids.mark\"",
        ] {
            let mut config = GatewayConfig::default();
            let err = layer(both).apply(&mut config).unwrap_err().to_string();
            assert!(err.contains("--etcd"), "{both}: {err}");
        }
    }

    /// Relative paths in a config file are taken from its directory;
    /// absolute ones as they are.
    #[test]
    fn relative_paths_in_a_config_file_are_taken_from_its_directory() {
        let dir = std::env::temp_dir().join(format!("snowgate-config-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("snowgate.toml");
        std::fs::write(
            &path,
            "plugin = \"plugins/p.wasm\"\nhigh-water-file = \"ids.mark\"\n\
             plugin-cache-dir = \"/var/cache/snowgate\"\n",
        )
        .unwrap();
        let file = ConfigFile::read(&path);
        std::fs::remove_dir_all(&dir).unwrap();
        let file = file.expect("read");
        assert_eq!(file.plugin, Some(dir.join("plugins/p.wasm")));
        assert_eq!(file.high_water_file, Some(dir.join("ids.mark")));
        assert_eq!(
            file.plugin_cache_dir,
            Some(PathBuf::from("/var/cache/snowgate"))
        );
    }

    /// A config file the parser refuses is reported by line and column,
    /// never with its text: a fuzz review saw a token on a line with a
    /// misspelled key, or given twice, or unquoted, printed whole, and the
    /// change's review a token given as a number, or plugin settings as a
    /// string, quoted in serde's message.
    #[test]
    fn a_bad_config_file_is_reported_without_its_text() {
        let dir = std::env::temp_dir().join(format!("snowgate-config-bad-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("snowgate.toml");
        let cases = [
            (
                "listen = \"127.0.0.1:8080\"\nadmin_token = \"s3cr3t-TOKEN\"\n",
                "line 2, column 1: unknown field `admin_token`, expected one of",
            ),
            (
                "admin-token = \"s3cr3t-TOKEN\"\r\n  admin-token = \"s3cr3t-TOKEN2\"\r\n",
                "line 2, column 3: duplicate key",
            ),
            (
                "admin-token = s3cr3t-TOKEN\n",
                "line 1, column 15: string values must be quoted",
            ),
            (
                "# é\n\"quoted\" = \"s3cr3t-TOKEN\"\n",
                "line 2, column 1: unknown field `quoted`",
            ),
            (
                "admin-token = 5\n[plugin-settings]\napi-key = 0x5EC12E7\n",
                "line 1, column 15: invalid type: integer, expected a string",
            ),
            (
                "[plugin-settings]\napi-key = 5.3e3\n",
                "line 2, column 11: invalid type: floating point, expected a string",
            ),
            (
                "plugin-settings = \"api-key=s3cr3t\"\n",
                "line 1, column 19: invalid type: string, expected a map",
            ),
            (
                "admin-token = \"\"\"\nabcs3cr3t=\\q\n\"\"\"\n",
                "line 2, column 12: missing escaped value",
            ),
            (
                "\u{feff}admin_token = \"s3cr3t\"\n",
                "line 1, column 1: unknown field",
            ),
        ];
        for (text, wanted) in cases {
            std::fs::write(&path, text).unwrap();
            let problem = format!("{:#}", ConfigFile::read(&path).expect_err(text));
            assert!(problem.contains(wanted), "{text:?}: {problem}");
            for secret in ["s3cr3t", "5EC12E7", "99357415", "5300"] {
                assert!(!problem.contains(secret), "{text:?}: {problem}");
            }
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_body_memory_holds_the_largest_body_by_default_and_must_when_given() {
        let config = GatewayConfig::default();
        assert_eq!(config.body_memory_limit(), 1 << 30);
        let large = GatewayConfig {
            max_body_bytes: (3 << 30) + 1,
            ..Default::default()
        };
        assert_eq!(large.body_memory_limit(), (3 << 30) + 1);
        assert!(ConfigFile::check(&large).is_ok());

        let mut config = GatewayConfig::default();
        toml::from_str::<ConfigFile>("body-memory-mib = 64")
            .unwrap()
            .apply(&mut config)
            .unwrap();
        assert_eq!(config.body_memory_limit(), 64 << 20);
        assert!(ConfigFile::check(&config).is_ok());
        config.max_body_bytes = (64 << 20) + 1;
        let err = ConfigFile::check(&config).unwrap_err().to_string();
        assert_eq!(
            err,
            "--body-memory-mib 64 cannot hold one body of --max-body-bytes 67108865, so such a \
             body could never be read: give at least 65 MiB, or leave it out for the default \
             (1024 MiB, or the body limit where that is larger)"
        );
    }

    /// A bound on upstream requests needs an upstream: the echo answers
    /// at once and is not bounded.
    #[test]
    fn a_bound_on_upstream_requests_needs_an_upstream() {
        let mut config = GatewayConfig::default();
        toml::from_str::<ConfigFile>("max-upstream-requests = 64")
            .unwrap()
            .apply(&mut config)
            .unwrap();
        assert_eq!(config.max_upstream_requests, Some(64));
        let err = ConfigFile::check(&config).unwrap_err().to_string();
        assert!(err.contains("--upstream URL, which is not set"), "{err}");
        config.upstream = Some("http://127.0.0.1:8000".to_string());
        ConfigFile::check(&config).expect("with an upstream");
    }

    #[test]
    fn an_exposed_admin_listener_needs_a_token() {
        let mut config = GatewayConfig {
            admin_listen: "0.0.0.0:9901".parse().unwrap(),
            ..Default::default()
        };
        let err = ConfigFile::check(&config).unwrap_err().to_string();
        assert!(err.contains("--admin-token"), "{err}");
        config.admin_token = Some("s3cret".into());
        assert!(ConfigFile::check(&config).is_ok());
        assert!(ConfigFile::check(&GatewayConfig::default()).is_ok());
        // Loopback however it is written: IPv6, and IPv4 mapped into it.
        for loopback in ["[::1]:9901", "[::ffff:127.0.0.1]:9901"] {
            let on_loopback = GatewayConfig {
                admin_listen: loopback.parse().unwrap(),
                ..Default::default()
            };
            assert!(ConfigFile::check(&on_loopback).is_ok(), "{loopback}");
        }
        // A space inside, `=`, `+` and `/` come through a header whole.
        config.admin_token = Some("two words+/=".into());
        assert!(ConfigFile::check(&config).is_ok());
    }

    #[test]
    fn the_admin_listener_needs_a_port_of_its_own() {
        let check = |listen: &str, admin: &str| {
            ConfigFile::check(&GatewayConfig {
                listen: listen.parse().unwrap(),
                admin_listen: admin.parse().unwrap(),
                ..Default::default()
            })
            .map_err(|e| e.to_string())
        };
        for (listen, admin) in [
            ("127.0.0.1:9000", "127.0.0.1:9000"),
            ("0.0.0.0:9000", "127.0.0.1:9000"),
            ("[::1]:9000", "[::]:9000"),
            ("[::]:9000", "127.0.0.1:9000"),
            ("0.0.0.0:9000", "[::]:9000"),
            ("[::ffff:127.0.0.1]:9000", "127.0.0.1:9000"),
        ] {
            let err = check(listen, admin).expect_err(listen);
            assert!(
                err.contains("would take the same port") && err.contains(admin),
                "{err}"
            );
        }
        for (listen, admin) in [
            ("127.0.0.1:9000", "127.0.0.1:9001"),
            ("127.0.0.2:9000", "127.0.0.1:9000"),
            ("0.0.0.0:9000", "[::1]:9000"),
            ("127.0.0.1:0", "127.0.0.1:0"),
        ] {
            assert_eq!(check(listen, admin), Ok(()), "{listen} {admin}");
        }
    }

    /// An upstream that is the gateway's own listener is refused: a fuzz
    /// review's gateway sent one request to itself until it held every
    /// connection, and one pointed at its admin listener opened /reload
    /// to any client.
    #[test]
    fn an_upstream_that_is_the_gateways_own_listener_is_refused() {
        let check = |listen: &str, upstream: &str| {
            ConfigFile::check(&GatewayConfig {
                listen: listen.parse().unwrap(),
                admin_listen: "127.0.0.1:9901".parse().unwrap(),
                upstream: Some(upstream.to_string()),
                ..Default::default()
            })
            .map_err(|e| e.to_string())
        };
        for (listen, upstream, flag) in [
            ("127.0.0.1:8080", "http://127.0.0.1:8080", "--listen"),
            ("127.0.0.1:8080", "http://localhost:8080/v1", "--listen"),
            ("[::1]:8080", "http://[::1]:8080", "--listen"),
            ("[::1]:8080", "http://localhost:8080", "--listen"),
            ("0.0.0.0:8080", "http://127.0.0.1:8080", "--listen"),
            ("0.0.0.0:8080", "http://127.0.0.2:8080", "--listen"),
            ("[::]:8080", "http://[::1]:8080", "--listen"),
            ("[::]:8080", "http://localhost:8080", "--listen"),
            ("0.0.0.0:8080", "http://0.0.0.0:8080", "--listen"),
            (
                "[::ffff:127.0.0.1]:8080",
                "http://127.0.0.1:8080",
                "--listen",
            ),
            ("127.0.0.1:80", "http://127.0.0.1", "--listen"),
            ("127.0.0.1:8080", "http://127.0.0.1:9901", "--admin-listen"),
        ] {
            let err = check(listen, upstream).expect_err(upstream);
            assert!(
                err.contains(&format!("is the gateway's own {flag}")),
                "{listen} {upstream}: {err}"
            );
        }
        for (listen, upstream) in [
            ("127.0.0.1:8080", "http://127.0.0.1:8000"),
            ("127.0.0.1:8080", "http://127.0.0.2:8080"),
            ("127.0.0.2:8080", "http://localhost:8080"),
            ("0.0.0.0:8080", "http://[::1]:8080"),
            // Not looked at: an address that may or may not be this
            // host's, a name, a shorthand, IPv4 under `[::]`.
            ("0.0.0.0:8080", "http://192.0.2.1:8080"),
            ("0.0.0.0:8080", "http://upstream.example:8080"),
            ("127.0.0.1:8080", "http://127.1:8080"),
            ("[::]:8080", "http://127.0.0.1:8080"),
            ("127.0.0.1:0", "http://127.0.0.1:8080"),
        ] {
            assert_eq!(check(listen, upstream), Ok(()), "{listen} {upstream}");
        }
    }

    #[test]
    fn memory_advice_names_no_limit_past_the_largest() {
        assert_eq!(
            memory_advice(19, 36, "smaller"),
            "raise --plugin-memory-mib"
        );
        assert_eq!(
            memory_advice(4096, 4096, "smaller"),
            "raise --plugin-memory-mib"
        );
        let some = memory_advice(2000, 4097, "lower --max-body-bytes");
        assert!(
            some.starts_with("raise --plugin-memory-mib; at its most, 4096 MiB")
                && some.ends_with("dense with ids still does not fit: lower --max-body-bytes"),
            "{some}"
        );
        assert_eq!(
            memory_advice(20030, 40000, "lower --max-body-bytes"),
            "no --plugin-memory-mib can hold such a body (at most 4096 MiB): lower \
             --max-body-bytes"
        );
    }

    #[test]
    fn a_lease_ttl_out_of_range_is_refused_before_anything_starts() {
        for (secs, ok) in [(2, false), (3, true), (86_400, true), (86_401, false)] {
            let config = GatewayConfig {
                lease: Some(crate::lease::LeaseConfig {
                    endpoints: vec!["http://127.0.0.1:2379".into()],
                    ttl: Duration::from_secs(secs),
                    ..crate::lease::LeaseConfig::default_for_endpoints()
                }),
                ..Default::default()
            };
            let checked = ConfigFile::check(&config);
            assert_eq!(checked.is_ok(), ok, "{secs}: {checked:?}");
        }
    }

    #[test]
    fn the_layout_is_no_plugin_setting() {
        let mut config = GatewayConfig::default();
        config
            .plugin_settings
            .insert("id-layout".into(), "trtllm-v2".into());
        let err = ConfigFile::check(&config).unwrap_err().to_string();
        assert!(
            err.contains("id-layout is the host's own") && err.contains("--layout"),
            "{err}"
        );
        config.plugin_settings.clear();
        config.plugin_settings.insert("extra".into(), "1".into());
        assert!(ConfigFile::check(&config).is_ok());
    }

    #[test]
    fn credentials_in_a_url_are_not_shown() {
        assert_eq!(
            without_credentials("http://root:hunter2@10.0.0.1:2379"),
            "http://***@10.0.0.1:2379"
        );
        // Passwords with `/`, `?` or `#` in them, and a `://` in a query.
        for (url, shown) in [
            (
                "http://root:Zm9v/YmFy@10.0.0.1:2379",
                "http://***@10.0.0.1:2379",
            ),
            (
                "http://root:s3#cret@10.0.0.1:2379",
                "http://***@10.0.0.1:2379",
            ),
            (
                "http://root:s3?cret@10.0.0.1:2379/x",
                "http://***@10.0.0.1:2379/x",
            ),
            (
                "root:hunter2@10.0.0.1:2379/?x=http://y",
                "***@10.0.0.1:2379/?x=http://y",
            ),
        ] {
            assert_eq!(without_credentials(url), shown, "{url}");
        }
        assert_eq!(without_credentials("u:p@host:80"), "***@host:80");
        assert_eq!(
            without_credentials("http://[::1]:2379"),
            "http://[::1]:2379"
        );
    }

    /// etcd endpoints with credentials (never sent) or https:// (no TLS
    /// client) are refused, without repeating the password.
    #[test]
    fn etcd_endpoints_with_credentials_or_https_are_refused() {
        for (etcd, named) in [
            (
                "http://root:hunter2@127.0.0.1:2379",
                "credentials in the URL are not supported",
            ),
            (
                "http://root:hunter2/x@127.0.0.1:2379",
                "credentials in the URL are not supported",
            ),
            (
                "http://root:hunter2#x@127.0.0.1:2379",
                "credentials in the URL are not supported",
            ),
            ("https://127.0.0.1:2379", "https:// is not supported"),
            (
                "http://127.0.0.1:2379,https://root:hunter2@10.0.0.2:2379",
                "https:// is not supported",
            ),
        ] {
            let file = ConfigFile {
                etcd: Some(etcd.to_string()),
                ..Default::default()
            };
            let err = format!(
                "{:#}",
                file.apply(&mut GatewayConfig::default()).unwrap_err()
            );
            assert!(err.contains(named), "{etcd}: {err}");
            assert!(!err.contains("hunter2"), "the password shown: {err}");
        }
    }

    /// An etcd prefix has one spelling: `/snowgate` and `/snowgate/` are the
    /// same namespace, and the spellings that would make another one for
    /// the same name (`snowgate`, `//snowgate`) are refused, as two
    /// replicas under them shared machine id 0 and repeated 260,114 ids.
    #[test]
    fn an_etcd_prefix_is_refused_unless_it_has_one_spelling() {
        for good in ["/snowgate", "/snowgate/", "/fleets/a", "/"] {
            let file = ConfigFile {
                etcd: Some("http://127.0.0.1:2379".to_string()),
                etcd_prefix: Some(good.to_string()),
                ..Default::default()
            };
            let mut config = GatewayConfig::default();
            file.apply(&mut config)
                .unwrap_or_else(|e| panic!("{good}: {e:#}"));
            assert_eq!(config.lease.expect("a lease").prefix, good);
        }
        for bad in [
            "snowgate",
            "",
            "//snowgate",
            "/fleets//a",
            "/snow gate",
            "/a\n",
        ] {
            let file = ConfigFile {
                etcd: Some("http://127.0.0.1:2379".to_string()),
                etcd_prefix: Some(bad.to_string()),
                ..Default::default()
            };
            let err = format!(
                "{:#}",
                file.apply(&mut GatewayConfig::default()).unwrap_err()
            );
            assert!(err.contains("must start with '/'"), "{bad:?}: {err}");
        }
    }

    /// The compile limits set the compile process's limits; where the
    /// gateway compiles in its own process, they are refused, not ignored.
    #[test]
    fn compile_limits_set_the_compile_process_or_are_refused_without_one() {
        // A gateway that compiles in `snowgate compile-plugin`, under the
        // default limits, as `snowgate serve`'s does.
        let with_compile_process = || GatewayConfig {
            compile_process: Some(CompileProcess::this_binary(
                &["compile-plugin"],
                crate::CompileLimits::default(),
            )),
            ..Default::default()
        };
        let file = || ConfigFile {
            plugin_compile_memory_mib: Some(1024),
            plugin_compile_cpu_secs: Some(30),
            ..Default::default()
        };
        let mut config = with_compile_process();
        file().apply(&mut config).unwrap();
        assert_eq!(
            config.compile_process.expect("a process").limits,
            crate::CompileLimits {
                memory_bytes: 1 << 30,
                cpu: Duration::from_secs(30),
            }
        );
        let err = format!(
            "{:#}",
            file().apply(&mut GatewayConfig::default()).unwrap_err()
        );
        assert!(err.contains("compiles them in its own"), "{err}");

        // In-process compiling in the same layer as the limits is refused;
        // in a later one, it drops the compile process.
        let err = format!(
            "{:#}",
            ConfigFile {
                plugin_compile_in_process: Some(true),
                ..file()
            }
            .apply(&mut with_compile_process())
            .unwrap_err()
        );
        assert!(err.contains("compiles them in its own"), "{err}");
        let mut config = with_compile_process();
        file().apply(&mut config).unwrap();
        ConfigFile {
            plugin_compile_in_process: Some(true),
            ..Default::default()
        }
        .apply(&mut config)
        .unwrap();
        assert!(config.compile_process.is_none());
    }

    /// An empty token, which would match a request without one, or one no
    /// header can carry, is refused on any admin listener, loopback too.
    #[test]
    fn an_empty_admin_token_or_one_no_header_can_carry_is_refused() {
        for listen in ["127.0.0.1:9901", "0.0.0.0:9901"] {
            for (token, named) in [
                ("", "is empty"),
                (
                    "s3cret\n",
                    "whitespace at an end, or a control or non-ASCII character",
                ),
                (
                    " s3cret",
                    "whitespace at an end, or a control or non-ASCII character",
                ),
                (
                    "pässwörd",
                    "whitespace at an end, or a control or non-ASCII character",
                ),
            ] {
                let config = GatewayConfig {
                    admin_listen: listen.parse().unwrap(),
                    admin_token: Some(token.into()),
                    ..Default::default()
                };
                let err = ConfigFile::check(&config).unwrap_err().to_string();
                assert!(err.contains(named), "{listen} {token:?}: {err}");
                assert!(
                    !err.contains(token) || token.is_empty(),
                    "the token shown: {err}"
                );
            }
        }
    }

    #[test]
    fn counts_and_plugin_limits_out_of_range_are_refused_by_name() {
        for (text, named) in [
            (
                "max-upstream-requests = 0",
                "max-upstream-requests must be between 1 and 1000000, not 0",
            ),
            ("workers = 0", "workers must be between 1 and 1024, not 0"),
            (
                "workers = 5000",
                "workers must be between 1 and 1024, not 5000",
            ),
            (
                "plugin-calls-per-instance = 0",
                "plugin-calls-per-instance must be at least 1",
            ),
            (
                "plugin-instances = 0",
                "plugin-instances must be between 2 and 4096 (one slot is kept for a reload's \
                 check of a new build), not 0",
            ),
            (
                "plugin-instances = 1",
                "plugin-instances must be between 2 and 4096 (one slot is kept for a reload's \
                 check of a new build), not 1",
            ),
            (
                "plugin-instances = 5000",
                "plugin-instances must be between 2 and 4096 (one slot is kept for a reload's \
                 check of a new build), not 5000",
            ),
            (
                "max-header-bytes = 8191",
                "max-header-bytes must be between 8192 and 524288 (512 KiB), not 8191",
            ),
            (
                "max-header-bytes = 524289",
                "max-header-bytes must be between 8192 and 524288 (512 KiB), not 524289",
            ),
            (
                "max-body-bytes = 0",
                "max-body-bytes must be at least 1, not 0: there is no unlimited body size",
            ),
            (
                "max-body-bytes = 1099511627777",
                "max-body-bytes must be at most 1099511627776 (1 TiB), not 1099511627777",
            ),
            (
                "body-memory-mib = 0",
                "body-memory-mib must be between 1 and 1048576 (1 TiB), not 0",
            ),
            (
                "body-memory-mib = 1048577",
                "body-memory-mib must be between 1 and 1048576 (1 TiB), not 1048577",
            ),
            (
                "plugin-deadline-ms = 0",
                "plugin-deadline-ms must be between 1 and 3600000 (an hour), not 0",
            ),
            (
                "plugin-deadline-ms = 9223372036854775807",
                "plugin-deadline-ms must be between 1 and 3600000 (an hour), not 9223372036854775807",
            ),
            (
                "upstream-connect-timeout-ms = 0",
                "upstream-connect-timeout-ms must be between 1 and 86400000 (a day), not 0",
            ),
            (
                "upstream-response-timeout-ms = 86400001",
                "upstream-response-timeout-ms must be between 1 and 86400000 (a day), not 86400001",
            ),
            (
                "max-connections = 3000000000000000000",
                "max-connections must be between 1 and 1048576, not 3000000000000000000",
            ),
            (
                "max-streams-per-connection = 0",
                "max-streams-per-connection must be between 1 and 10000, not 0",
            ),
            (
                "machine-id-ttl = 18446744073709551615",
                "machine-id-ttl must be between 3 and 86400 seconds (a day), not 18446744073709551615",
            ),
            (
                "machine-id-ttl = 2",
                "machine-id-ttl must be between 3 and 86400 seconds (a day), not 2",
            ),
            (
                "etcd = \"garbage\"",
                "etcd endpoint \"garbage\" is not an http:// URL",
            ),
            (
                "send-timeout-ms = 0",
                "send-timeout-ms must be between 1 and 86400000 (a day), not 0",
            ),
            (
                "reload-debounce-ms = 18446744073709551615",
                "reload-debounce-ms must be at most 86400000 (a day), not 18446744073709551615",
            ),
            (
                "header-read-timeout-ms = 0",
                "header-read-timeout-ms must be between 1 and 86400000 (a day), not 0",
            ),
            (
                "header-read-timeout-ms = 99999999999999",
                "header-read-timeout-ms must be between 1 and 86400000 (a day), not 99999999999999",
            ),
            (
                "body-read-timeout-ms = 86400001",
                "body-read-timeout-ms must be between 1 and 86400000 (a day), not 86400001",
            ),
            (
                "plugin-memory-mib = 0",
                "plugin-memory-mib must be between 1 and 4096, not 0",
            ),
            (
                "plugin-memory-mib = 17592186044416",
                "plugin-memory-mib must be between 1 and 4096, not 17592186044416",
            ),
        ] {
            let file: ConfigFile = toml::from_str(text).expect("parses");
            let err = file
                .apply(&mut GatewayConfig::default())
                .unwrap_err()
                .to_string();
            assert!(err.contains(named), "{text}: {err}");
        }
        assert_eq!(GatewayConfig::default().workers, None);
        assert_eq!(
            GatewayConfig::default().plugin_limits.calls_per_instance,
            1000
        );
    }

    #[test]
    fn listen_addresses_are_an_ip_and_a_port_and_the_error_says_what_to_write() {
        for good in ["127.0.0.1:8080", "0.0.0.0:0", "[::1]:8080", "[::]:443"] {
            assert_eq!(
                parse_listen_address(good),
                Ok(good.parse().unwrap()),
                "{good}"
            );
        }
        for (bad, says) in [
            (
                "localhost:8080",
                "host names are not resolved: write 127.0.0.1:8080",
            ),
            (":8080", "no address before the port: write 127.0.0.1:8080"),
            ("8080", "a port without an address: write 127.0.0.1:8080"),
            ("127.0.0.1:65536", "no port from 0 to 65535"),
            (
                "127.0.0.1",
                "an address without a port: write 127.0.0.1:PORT",
            ),
            ("::1", "an address without a port: write [::1]:PORT"),
            ("[::1]", "an address without a port: write [::1]:PORT"),
            (
                "::1:8080",
                "without a port: write [::1:8080]:PORT, or, if 8080 is the port, [::1]:8080",
            ),
            ("1:2:3:4:5:6:7:8:80", "write [1:2:3:4:5:6:7:8]:80"),
            ("[zz]:80", "not an IP address and a port"),
            ("", "not an IP address and a port"),
        ] {
            let err = parse_listen_address(bad).unwrap_err();
            assert!(err.contains(says), "{bad:?}: {err}");
            assert!(err.starts_with(&format!("{bad:?}")), "{bad:?}: {err}");
        }
        // The config file reads them the same way, and names the key.
        let file: ConfigFile = toml::from_str("listen = \"[::1]:8000\"").expect("parses");
        assert_eq!(file.listen, Some("[::1]:8000".parse().unwrap()));
        let err = toml::from_str::<ConfigFile>("admin-listen = \"localhost:9901\"")
            .unwrap_err()
            .to_string();
        assert!(err.contains("admin-listen"), "{err}");
        assert!(err.contains("write 127.0.0.1:9901"), "{err}");
        let err = toml::from_str::<ConfigFile>("listen = 8080")
            .unwrap_err()
            .to_string();
        assert!(err.contains("a port without an address"), "{err}");
        let err = toml::from_str::<ConfigFile>("listen = true")
            .unwrap_err()
            .to_string();
        assert!(err.contains("write a string such as"), "{err}");
        assert_eq!(
            toml::from_str::<ConfigFile>("").expect("parses").listen,
            None
        );
    }

    #[test]
    fn unknown_keys_are_named() {
        let err = toml::from_str::<ConfigFile>("listen-on = \"x\"")
            .unwrap_err()
            .to_string();
        assert!(err.contains("listen-on"), "{err}");
    }
}
