//! Keeps the high-water file's mark ahead of the id clock while the gateway
//! serves, and writes the last millisecond used when it stops.
//!
//! The mark is kept a [lead](super::lead) past the later of the wall clock
//! and the id clock (2 s on a quick disk, more on one that has lately been
//! slow to write), and raised every [`RAISE_EVERY`], or as soon as ids come
//! within half the lead of it. An id whose millisecond is past the mark
//! last written does not leave the process (a 503 says why): so a disk
//! that stops taking writes stops stamping within the lead, and never lets
//! an id out that a restart could repeat.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use anyhow::Context as _;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::lead::{Lead, LONGEST_LEAD, RAISE_EVERY, SHORTEST_LEAD};
use super::{HighWaterFile, InUseByAnother};
use crate::engine::HostServices;
use crate::log_throttle::LogThrottle;
use crate::unpoisoned::LockUnpoisoned as _;
use crate::utc::{format_millis, millis_of};

/// How soon a write that failed is tried again.
const RETRY_AFTER: Duration = Duration::from_millis(250);

/// A write that takes longer than this is shown on `/status` and logged
/// while it goes on: ids stop at the mark within the lead of it.
const SLOW_WRITE: Duration = Duration::from_secs(1);

/// The longest a start waits for the first mark to be written: a disk that
/// hangs fails the start, naming the file, instead of hanging it.
const FIRST_WRITE_WAIT: Duration = Duration::from_secs(10);

/// The longest a stop waits for a write under way (a disk that hangs), and
/// then for its own last write, before it lets the gateway end with the
/// mark written before, which is higher.
const STOP_WAIT: Duration = Duration::from_secs(5);

/// The high-water file as `/status` and `/metrics` show it.
#[derive(Debug)]
pub struct FileMarkStatus {
    path: PathBuf,
    /// The mark last written (Unix milliseconds); 0 before the first.
    mark: AtomicU64,
    /// The lead of the next mark, in milliseconds.
    lead: AtomicU64,
    /// The slowest of the latest writes, in microseconds.
    slowest_write: AtomicU64,
    writes: AtomicU64,
    failures: AtomicU64,
    last_error: Mutex<Option<String>>,
}

impl FileMarkStatus {
    fn new(path: PathBuf) -> FileMarkStatus {
        FileMarkStatus {
            path,
            mark: AtomicU64::new(0),
            lead: AtomicU64::new(SHORTEST_LEAD.as_millis() as u64),
            slowest_write: AtomicU64::new(0),
            writes: AtomicU64::new(0),
            failures: AtomicU64::new(0),
            last_error: Mutex::new(None),
        }
    }

    fn last_error(&self) -> std::sync::MutexGuard<'_, Option<String>> {
        self.last_error.lock_unpoisoned()
    }

    /// The mark last written, in Unix milliseconds.
    pub fn mark(&self) -> u64 {
        self.mark.load(Ordering::Relaxed)
    }

    /// How far ahead of the ids the next mark goes, in milliseconds.
    pub fn lead_millis(&self) -> u64 {
        self.lead.load(Ordering::Relaxed)
    }

    /// The `high_water_file` object of `/status`.
    pub fn to_json(&self) -> serde_json::Value {
        let mark = self.mark();
        serde_json::json!({
            "path": self.path.display().to_string(),
            "mark": mark,
            "mark_utc": format_millis(mark),
            "lead_ms": self.lead_millis(),
            "slowest_write_ms": self.slowest_write.load(Ordering::Relaxed) as f64 / 1000.0,
            "writes": self.writes.load(Ordering::Relaxed),
            "failures": self.failures.load(Ordering::Relaxed),
            "last_error": *self.last_error(),
        })
    }

    /// The high-water file's metrics in Prometheus text format.
    pub fn render_metrics(&self) -> String {
        let writes = self.writes.load(Ordering::Relaxed);
        let failures = self.failures.load(Ordering::Relaxed);
        let mark = self.mark() as f64 / 1000.0;
        let lead = self.lead_millis() as f64 / 1000.0;
        format!(
            "# HELP snowgate_high_water_file_writes_total High-water marks written to the high-water file.\n\
             # TYPE snowgate_high_water_file_writes_total counter\n\
             snowgate_high_water_file_writes_total {writes}\n\
             # HELP snowgate_high_water_file_failures_total Writes to the high-water file that failed.\n\
             # TYPE snowgate_high_water_file_failures_total counter\n\
             snowgate_high_water_file_failures_total {failures}\n\
             # HELP snowgate_high_water_file_mark_seconds The mark last written, in Unix seconds: no id leaves past it.\n\
             # TYPE snowgate_high_water_file_mark_seconds gauge\n\
             snowgate_high_water_file_mark_seconds {mark:.3}\n\
             # HELP snowgate_high_water_file_lead_seconds How far ahead of the ids the next mark goes: longer while the disk is slow to write.\n\
             # TYPE snowgate_high_water_file_lead_seconds gauge\n\
             snowgate_high_water_file_lead_seconds {lead:.3}\n"
        )
    }
}

/// What the keeper's task and its owner share.
struct Shared {
    file: HighWaterFile,
    services: HostServices,
    status: Arc<FileMarkStatus>,
    /// The latest writes' times, which size the lead.
    lead: Mutex<Lead>,
}

/// A mark on disk, and the lead it was written with (milliseconds).
#[derive(Debug, Clone, Copy)]
struct Raised {
    mark: u64,
    lead: u64,
}

impl Raised {
    /// From which millisecond ids count as near the mark: half its lead
    /// below it.
    fn raise_from(&self) -> u64 {
        self.mark.saturating_sub(self.lead / 2)
    }
}

/// Keeps a high-water file's mark ahead of the ids until
/// [`MarkKeeper::release`]. Dropped without it (a gateway that failed to
/// start), it stops raising the mark; the last one written stands.
pub struct MarkKeeper {
    shared: Arc<Shared>,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<()>>,
}

impl MarkKeeper {
    /// Takes over the machine id's history from `file`, whose mark was
    /// `stored`: starts the id clock after it, writes a first mark ahead of
    /// the clock, bounds the ids by it, and raises it from then on in a
    /// task of its own. Fails when the first mark cannot be written.
    ///
    /// A stored mark further ahead of the wall clock than
    /// [`START_LEAD`] (the clock stepped back, or a gateway crashed with
    /// its id clock far ahead) is first waited out to within it, logged,
    /// writing nothing meanwhile: the id clock refuses ids more than
    /// [`MAX_LEAD`](crate::id_clock::MAX_LEAD) ahead, the plugin's self-check
    /// among them, and a mark written ahead of a floor no id has used yet
    /// would push the next start further out.
    pub async fn start(
        file: HighWaterFile,
        stored: Option<u64>,
        services: HostServices,
    ) -> anyhow::Result<MarkKeeper> {
        if let Some(stored) = stored {
            wait_until_near(stored, file.path()).await;
            services.clock.advance_past(stored);
        }
        let status = Arc::new(FileMarkStatus::new(file.path().to_path_buf()));
        let shared = Arc::new(Shared {
            file,
            services,
            status,
            lead: Mutex::new(Lead::default()),
        });
        let first = tokio::time::timeout(FIRST_WRITE_WAIT, shared.first_raise())
            .await
            .map_err(|_| {
                anyhow::anyhow!(
                    "writing the first high-water mark to {} did not end within {} s: the disk \
                     is hung or very slow",
                    shared.file.path().display(),
                    FIRST_WRITE_WAIT.as_secs()
                )
            })?
            .context("writing the first high-water mark")?;
        shared
            .services
            .identity
            .bound_by_file_mark(first.mark, first.raise_from());
        let first = first.mark;
        let now = millis_of(SystemTime::now());
        match stored {
            Some(stored) if stored > now => tracing::warn!(
                path = %shared.file.path().display(),
                "the high-water file's mark {} is {} ms ahead of the wall clock (it stepped \
                 back, or the last gateway stopped without writing its last id): ids continue \
                 after the mark, ahead of the wall clock",
                format_millis(stored),
                stored - now
            ),
            Some(stored) => tracing::info!(
                path = %shared.file.path().display(),
                "ids continue after the high-water file's mark {}",
                format_millis(stored)
            ),
            // Said loudly: a file lost (kept where a restart does not find
            // it) looks the same, and then the last gateway's ids, up to
            // seconds ahead of the wall clock, may come again.
            None => tracing::warn!(
                path = %shared.file.path().display(),
                "a new high-water file: its mark starts at {}; if a gateway used this machine id \
                 before, its file was lost, and ids it made ahead of the wall clock may repeat: \
                 keep the file on storage that outlives the process and its host",
                format_millis(first)
            ),
        }
        let (stop, stopped) = oneshot::channel();
        let task = tokio::spawn(shared.clone().keep(stopped));
        Ok(MarkKeeper {
            shared,
            stop: Some(stop),
            task: Some(task),
        })
    }

    /// What `/status` and `/metrics` show of the file.
    pub fn status(&self) -> Arc<FileMarkStatus> {
        self.shared.status.clone()
    }

    /// After the last request: withdraws the machine id, then writes the
    /// last millisecond the id clock used as the mark, so that the next
    /// start continues right after it instead of a lead later.
    /// If that write fails, or a write does not end within `STOP_WAIT` (5 s),
    /// the higher mark before it stands.
    pub async fn release(mut self) {
        let services = &self.shared.services;
        // First: no id leaves from here on, whatever the file does.
        services.identity.withdraw("the gateway is stopping");
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        let path = self.shared.file.path().display().to_string();
        if let Some(task) = self.task.take() {
            // A raise under way ends first, so that it cannot land after
            // the last write (a later, higher mark would be harmless, but
            // not what the operator reads).
            if tokio::time::timeout(STOP_WAIT, task).await.is_err() {
                tracing::warn!(
                    path,
                    "a write to the high-water file did not end within {} s; the mark {} \
                     written before stands",
                    STOP_WAIT.as_secs(),
                    format_millis(self.shared.status.mark())
                );
                return;
            }
        }
        let Some(last) = services.clock.last_tick().map(|tick| tick.millis) else {
            return;
        };
        let shared = self.shared.clone();
        let written = tokio::time::timeout(
            STOP_WAIT,
            tokio::task::spawn_blocking(move || shared.file.write(last)),
        )
        .await;
        let before = format_millis(self.shared.status.mark());
        match written {
            Ok(Ok(Ok(written))) if written > last => {
                self.shared.status.mark.store(written, Ordering::Relaxed);
                tracing::info!(
                    path,
                    "the high-water file, taken over, keeps its higher mark {}",
                    format_millis(written)
                );
            }
            Ok(Ok(Ok(_))) => {
                self.shared.status.mark.store(last, Ordering::Relaxed);
                tracing::info!(
                    path,
                    "the last id's millisecond, {}, is the high-water file's mark",
                    format_millis(last)
                );
            }
            Ok(Ok(Err(e))) => tracing::warn!("{e:#}; the mark {before} written before stands"),
            Ok(Err(e)) => tracing::warn!(
                error = %e,
                "writing the last high-water mark failed; the mark {before} written before stands"
            ),
            Err(_) => tracing::warn!(
                path,
                "the last write to the high-water file did not end within {} s; the mark \
                 {before} written before stands, unless the write ends later",
                STOP_WAIT.as_secs()
            ),
        }
    }
}

impl Drop for MarkKeeper {
    fn drop(&mut self) {
        if let Some(task) = &self.task {
            task.abort();
        }
    }
}

/// How far ahead of the wall clock a stored mark may be for a start to go
/// on at once: the id clock's [`MAX_LEAD`](crate::id_clock::MAX_LEAD) less
/// the [shortest lead](SHORTEST_LEAD), so that a first mark after it is
/// within the id clock's lead on a quick disk.
pub const START_LEAD: Duration = Duration::from_secs(7);

/// Waits until the wall clock is within [`START_LEAD`] of `stored`,
/// logging how long that takes, and again every 10 s.
async fn wait_until_near(stored: u64, path: &Path) {
    let mut said = None;
    while let Some(left) = left_until_near(stored, path, &mut said) {
        tokio::time::sleep(left).await;
    }
}

/// [`MarkKeeper::start`]'s wait for a stored mark far ahead of the wall
/// clock, for a process without an async runtime (`snowgate rewrite`):
/// blocks until the wall clock is within [`START_LEAD`] of `stored`,
/// logging how long that takes, and again every 10 s.
pub fn wait_until_near_blocking(stored: u64, path: &Path) {
    let mut said = None;
    while let Some(left) = left_until_near(stored, path, &mut said) {
        std::thread::sleep(left);
    }
}

/// How long a start must wait, at the wall clock's `now`, until it is
/// within [`START_LEAD`] of the stored mark `stored`; `None` when it is
/// already.
pub fn wait_for_mark(stored: u64, now: u64) -> Option<Duration> {
    let near = stored.saturating_sub(START_LEAD.as_millis() as u64);
    (now < near).then(|| Duration::from_millis(near - now))
}

/// How long to sleep before looking at the wall clock again, or `None`
/// once it is within [`START_LEAD`] of `stored`; logs the wait when it
/// starts, every 10 s (`said` is when it last did) and when it ends.
fn left_until_near(
    stored: u64,
    path: &Path,
    said: &mut Option<std::time::Instant>,
) -> Option<Duration> {
    let now = millis_of(SystemTime::now());
    let Some(left) = wait_for_mark(stored, now) else {
        if said.is_some() {
            tracing::info!("the wall clock is near the high-water file's mark: going on");
        }
        return None;
    };
    if said.is_none_or(|at| at.elapsed() >= Duration::from_secs(10)) {
        tracing::warn!(
            path = %path.display(),
            "the high-water file's mark {} is {} s ahead of the wall clock (it stepped back, \
             or the last process on the file ended with its ids ahead of it): waiting {} s until \
             it is within {} s, as ids may not run further ahead",
            format_millis(stored),
            (stored - now) / 1000,
            left.as_secs_f64().ceil(),
            START_LEAD.as_secs()
        );
        *said = Some(std::time::Instant::now());
    }
    // The wall clock may step again meanwhile: look at it each second.
    Some(left.min(Duration::from_secs(1)))
}

impl Shared {
    fn lead(&self) -> std::sync::MutexGuard<'_, Lead> {
        self.lead.lock_unpoisoned()
    }

    /// The start's first raise, and a second one at once when the first
    /// showed a disk slower than its lead allowed for: the gateway then
    /// begins serving with a lead the disk keeps up with.
    async fn first_raise(self: &Arc<Self>) -> anyhow::Result<Raised> {
        let first = self.raise().await?;
        if self.lead().now().as_millis() as u64 > first.lead {
            return self.raise().await;
        }
        Ok(first)
    }

    /// Writes a mark the lead past the later of the wall clock and the id
    /// clock (never below the one confirmed), and returns it; the time it
    /// took, from here until the mark is on disk, sizes the next leads.
    async fn raise(self: &Arc<Self>) -> anyhow::Result<Raised> {
        let began = Instant::now();
        let lead = self.lead().now().as_millis() as u64;
        let now = millis_of(SystemTime::now());
        let last = self
            .services
            .clock
            .last_tick()
            .map_or(0, |tick| tick.millis);
        let confirmed = self.services.identity.ceiling().unwrap_or(0);
        let mut mark = now.max(last).saturating_add(lead).max(confirmed);
        // A file taken over (replaced while this gateway ran) may hold a
        // higher mark: ids from now on stay above it, as after a start
        // that read it, and the mark is raised past it at once, the lead
        // ahead of the ids to come. Before, the next raise wrote this
        // gateway's lower mark over it, and its ids went on below it.
        loop {
            let shared = self.clone();
            let written = tokio::task::spawn_blocking(move || shared.file.write(mark))
                .await
                .context("the high-water file's writing task failed")??;
            if written <= mark {
                break;
            }
            self.services.clock.advance_past(written);
            mark = written.saturating_add(lead);
        }
        let (next_lead, slowest) = {
            let mut times = self.lead();
            times.record(began.elapsed());
            (times.now(), times.slowest())
        };
        let next_lead = next_lead.as_millis() as u64;
        if next_lead > lead && next_lead > self.status.lead_millis() {
            tracing::info!(
                path = %self.file.path().display(),
                "a write to the high-water file took {} ms: the mark now goes {} ms ahead of \
                 the ids (at most {} s) so that ids do not reach it between writes",
                slowest.as_millis(),
                next_lead,
                LONGEST_LEAD.as_secs()
            );
        }
        self.status.lead.store(next_lead, Ordering::Relaxed);
        self.status
            .slowest_write
            .store(slowest.as_micros() as u64, Ordering::Relaxed);
        self.status.mark.store(mark, Ordering::Relaxed);
        self.status.writes.fetch_add(1, Ordering::Relaxed);
        *self.status.last_error() = None;
        Ok(Raised { mark, lead })
    }

    /// [`Shared::raise`], shown on `/status` and logged while it takes
    /// longer than [`SLOW_WRITE`]. It is waited for however long it takes:
    /// a second write beside it could land before it and be overwritten
    /// by its lower mark.
    async fn raise_watched(self: &Arc<Self>) -> anyhow::Result<Raised> {
        let raise = self.raise();
        tokio::pin!(raise);
        match tokio::time::timeout(SLOW_WRITE, &mut raise).await {
            Ok(raised) => raised,
            Err(_) => {
                let slow = format!(
                    "a write to the high-water file {} has not ended within {} s (the disk is \
                     slow or hung); ids stop at the mark {} until it ends",
                    self.file.path().display(),
                    SLOW_WRITE.as_secs(),
                    format_millis(self.status.mark())
                );
                tracing::warn!("{slow}");
                *self.status.last_error() = Some(slow);
                raise.await
            }
        }
    }

    /// Raises the mark every [`RAISE_EVERY`], and whenever ids come near
    /// it, until `stop`; after a failed write, again in [`RETRY_AFTER`].
    async fn keep(self: Arc<Self>, mut stop: oneshot::Receiver<()>) {
        let identity = &self.services.identity;
        let mut due = Instant::now() + RAISE_EVERY;
        let mut failing = false;
        loop {
            tokio::select! {
                biased;
                _ = &mut stop => return,
                () = tokio::time::sleep_until(due) => {}
                // Retries keep their pace, however many requests wait.
                () = identity.ceiling_near(), if !failing => {}
            }
            // The next raise is due an interval after this one began, not
            // after it ended: a slow write does not eat into the lead twice.
            let began = Instant::now();
            match self.raise_watched().await {
                Ok(raised) => {
                    identity.ceiling_raised(raised.mark, raised.raise_from());
                    if failing {
                        tracing::info!("the high-water file takes writes again");
                    }
                    failing = false;
                    due = began + RAISE_EVERY;
                }
                Err(e) if e.chain().any(|cause| cause.is::<InUseByAnother>()) => {
                    // The file at the path is another process's: it was
                    // removed or replaced, and another gateway started on
                    // it, from its own mark. Ids made now up to this
                    // process's mark, seconds ahead, could be the same as
                    // the other's: none are made from here on.
                    let reason = format!(
                        "{e:#}; this gateway stops stamping: restart it with a --machine-id and \
                         --high-water-file of its own"
                    );
                    // Withdrawn before it is said: whoever reads the log
                    // line finds no id made after it.
                    identity.withdraw(reason.clone());
                    tracing::error!("{reason}");
                    *self.status.last_error() = Some(reason);
                    self.status.failures.fetch_add(1, Ordering::Relaxed);
                    return;
                }
                Err(e) => {
                    self.status.failures.fetch_add(1, Ordering::Relaxed);
                    *self.status.last_error() = Some(format!("{e:#}"));
                    static FAILED: LogThrottle = LogThrottle::new();
                    if let Some(held_back) = FAILED.admit() {
                        tracing::warn!(
                            "{e:#}: ids stop at the mark {} until a write succeeds {held_back}",
                            format_millis(self.status.mark())
                        );
                    }
                    failing = true;
                    due = Instant::now() + RETRY_AFTER;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::fs::File;
    use std::path::Path;

    use snowgate_plugin::SnowflakeLayout;

    use super::*;
    use crate::high_water_file::tests::scratch;
    use crate::id_clock::IdClock;
    use crate::identity::MachineIdentity;

    fn services() -> HostServices {
        HostServices {
            clock: Arc::new(IdClock::system()),
            identity: Arc::new(
                MachineIdentity::fixed(SnowflakeLayout::TrtllmV1, 5).expect("in range"),
            ),
        }
    }

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a runtime")
    }

    fn open(path: &Path) -> (HighWaterFile, Option<u64>) {
        HighWaterFile::open(path, SnowflakeLayout::TrtllmV1, 5).expect("opens")
    }

    /// A start continues after the stored mark, writes one ahead of the
    /// clock and bounds the ids by it; a stop writes the last id's
    /// millisecond, which the next start reads.
    #[test]
    fn a_start_takes_over_the_stored_mark_and_a_stop_writes_the_last_id() {
        let path = scratch("take-over");
        let services = services();
        let stored = millis_of(SystemTime::now()) + 5_000;
        runtime().block_on(async {
            let (file, _) = open(&path);
            let keeper = MarkKeeper::start(file, Some(stored), services.clone())
                .await
                .expect("starts");
            let first = keeper.status().mark();
            assert!(
                first >= stored + SHORTEST_LEAD.as_millis() as u64,
                "{first} after {stored}"
            );
            assert_eq!(services.identity.ceiling(), Some(first));
            let tick = services.clock.next_tick(4096).expect("a tick");
            assert_eq!(
                tick.millis,
                stored + 1,
                "the first id comes after the stored mark"
            );
            keeper.release().await;
            assert_eq!(services.identity.ceiling(), None, "withdrawn at the stop");
            let (_file, read) = open(&path);
            assert_eq!(read, Some(stored + 1), "the last id's millisecond");
        });
    }

    /// A file that takes no writes fails the start, naming the file.
    #[test]
    fn a_first_mark_that_cannot_be_written_fails_the_start() {
        let path = scratch("read-only");
        let (mut file, _) = open(&path);
        file.file = std::sync::Mutex::new(File::open(&path).expect("opens read-only"));
        let services = services();
        let error = runtime()
            .block_on(MarkKeeper::start(file, None, services.clone()))
            .err()
            .expect("no write, no start");
        let message = format!("{error:#}");
        assert!(
            message.contains("writing the first high-water mark"),
            "{message}"
        );
        assert!(message.contains(&path.display().to_string()), "{message}");
        assert_eq!(services.identity.ceiling(), None);
    }
}
