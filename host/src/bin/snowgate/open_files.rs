//! The open file limit a gateway needs: every client connection is a file
//! descriptor, and so is the upstream connection it uses. systemd's default
//! soft limit (1024) is a quarter of what the default `--max-connections`
//! (4096) needs; past it, accepting fails with `EMFILE` on both listeners,
//! and the admin endpoints stop answering with the rest. So `serve` raises
//! its soft limit to the hard one, as Go's runtime and nginx's
//! `worker_rlimit_nofile` do, and where even that is too low takes no more
//! connections than it has descriptors for.

use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};

/// Descriptors the gateway uses besides its connections and its workers:
/// listeners, the main event loop and its wake-ups, the plugin file and
/// its watch, the compile cache, etcd, the log (14 at rest), and the
/// connections chosen to close at the limit that are still open, their
/// slots handed on (at most 32: `reclaim::MAX_CLOSING`).
const BESIDES_CONNECTIONS: u64 = 128;

/// Descriptors each worker takes: its event loop and wake-ups (measured:
/// 22 open at rest with 2 workers, 78 with 16, 174 with 40).
const PER_WORKER: u64 = 4;

/// The most a soft limit is raised to when the hard one is unlimited: the
/// kernel's default `fs.nr_open`, above which `setrlimit` fails.
const UNLIMITED_AS: u64 = 1 << 20;

/// Descriptors `max_connections` client connections need with a request
/// each, on top of the gateway's others (`besides`): each client's, an
/// upstream connection in use for each, and as many upstream connections
/// kept idle (the workers' pools keep at most that many in all, see
/// `Upstream::keeping_idle_at_most`: a load moving from one worker to
/// another leaves the first one's open beside the second one's new ones).
/// An HTTP/2 client's connection carries up to
/// `--max-streams-per-connection` requests, each with an upstream
/// connection of its own: too many to count on (128 times 4096), so the
/// warning says so instead.
fn needed(max_connections: usize, besides: u64) -> u64 {
    (max_connections as u64)
        .saturating_mul(PER_CONNECTION)
        .saturating_add(besides)
}

/// Descriptors each client connection may need: its own, an upstream
/// connection in use and one kept idle.
const PER_CONNECTION: u64 = 3;

/// The descriptors a gateway of `workers` uses besides its connections.
fn besides_connections(workers: usize) -> u64 {
    (workers as u64)
        .saturating_mul(PER_WORKER)
        .saturating_add(BESIDES_CONNECTIONS)
}

/// Raises the soft open file limit to the hard one; the connections the
/// gateway takes at once: `max_connections`, or, where the limit is below
/// what they need, as many as it has descriptors for (at least one), with
/// a warning. Past the limit, accepting took the descriptors that upstream
/// connections closed gave back, and the clients already served got 502s
/// (`Too many open files`) while new ones connected; at the lowered cap,
/// new clients wait, and idle ones make room, as at `--max-connections`.
/// Never fails: the gateway serves with the limit it has.
pub fn raise_for(max_connections: usize, workers: usize) -> usize {
    let limit = getrlimit(Resource::Nofile);
    let hard = limit.maximum.unwrap_or(UNLIMITED_AS);
    let mut soft = limit.current.unwrap_or(UNLIMITED_AS);
    if soft < hard {
        let raised = Rlimit {
            current: Some(hard),
            maximum: limit.maximum,
        };
        match setrlimit(Resource::Nofile, raised) {
            Ok(()) => {
                tracing::debug!("raised the open file limit from {soft} to {hard}");
                soft = hard;
            }
            Err(e) => tracing::warn!(
                error = %e,
                "could not raise the open file limit from {soft} to its hard limit {hard}"
            ),
        }
    }
    let besides = besides_connections(workers);
    let needed = needed(max_connections, besides);
    if soft >= needed {
        return max_connections;
    }
    let fits = usize::try_from(soft.saturating_sub(besides) / PER_CONNECTION)
        .unwrap_or(usize::MAX)
        .max(1);
    tracing::warn!(
        "the open file limit ({soft}, hard limit {hard}) is below the {needed} that \
         --max-connections {max_connections} may need (a client, an upstream connection in use \
         and one kept idle each, and {besides} more for {workers} workers and the rest; an \
         HTTP/2 connection's \
         requests each take an upstream connection of their own): serving at most {fits} \
         connections at once, as if --max-connections were {fits}; raise the limit \
         (LimitNOFILE= under systemd, ulimit -n) to serve more"
    );
    fits
}
