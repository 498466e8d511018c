//! Reload triggers: changes to the plugin file (an atomic rename into place,
//! an in-place rewrite, a symlink flipped as Kubernetes does for a
//! ConfigMap, the directory replaced), debounced; and SIGHUP.
//!
//! Changes are seen two ways: at once, from the events of the file's
//! directory (the file's own, and those of `..` entries, which Kubernetes
//! uses); and, as a backstop for what those miss (a symlink flipped in
//! another directory, the directory itself moved or replaced, which ends
//! its watch), by looking at the file behind the path every
//! [`POLL_INTERVAL`]. Either only asks for a reload; the reload compares
//! contents, so a false alarm costs a read of the file.

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context as _;
use notify::event::{AccessKind, AccessMode, ModifyKind};
use notify::{EventKind, RecommendedWatcher, RecursiveMode, Watcher};
use tokio::signal::unix::Signal;
use tokio::sync::mpsc;

use crate::gateway::plugin_file::Fingerprint;
use crate::gateway::slot::{NoReload, PluginSlot, Reloaded};
use crate::unpoisoned::LockUnpoisoned as _;

/// How often the file behind the plugin path is looked at (one `stat`).
pub const POLL_INTERVAL: Duration = Duration::from_secs(2);

/// The watch of a plugin file's directory: it lasts as long as this lives.
pub struct PluginWatch {
    /// The directory's watch, where the system gave one.
    _watcher: Option<Arc<Mutex<RecommendedWatcher>>>,
    /// The poll and the reload task end once this is dropped.
    _events: mpsc::UnboundedSender<Nudge>,
}

/// Why the reload task is asked for a reload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Nudge {
    /// The watch saw the file (or its directory) change.
    Changed,
    /// The poll found a build no reload has read yet, unchanged for a
    /// whole poll interval. It asks again at each poll until a reload has
    /// read it.
    Due,
    /// The plugin file is being written: created, or written to, in the
    /// middle of a write. It asks for no reload, but starts the quiet time
    /// of one asked for again: a file removed or renamed away, then written
    /// anew (`install`, `kubectl cp`, an editor's backup by rename), was
    /// read half written once the quiet time after the removal ran out.
    Busy,
}

/// Whether the plugin file is being written: written to (not merely
/// created, as `ln` does) with no close, rename or removal of it since, and
/// not longer ago than [`WRITE_PAUSE`]. No reload reads it then, whether
/// asked by the watch or by the poll: a writer that paused mid-write for
/// longer than the quiet time, or the poll's interval, had its file read
/// half written, refused, and counted and raised as a failed reload.
#[derive(Default)]
struct Writing(Mutex<Option<tokio::time::Instant>>);

/// The longest pause in a write after which the write counts as over
/// though its writer never closed the file (it holds it open, or died
/// without the close being seen): the file is then read as it is.
const WRITE_PAUSE: Duration = Duration::from_secs(30);

impl Writing {
    fn wrote(&self) {
        *lock(&self.0) = Some(tokio::time::Instant::now());
    }

    fn ended(&self) {
        *lock(&self.0) = None;
    }

    fn under_way(&self) -> bool {
        lock(&self.0).is_some_and(|last| last.elapsed() < WRITE_PAUSE)
    }
}

/// The directory a watch is on, as the file system knows it: another
/// directory moved to the same path has another identity.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct DirIdentity {
    dev: u64,
    ino: u64,
}

impl DirIdentity {
    fn of(dir: &Path) -> Option<DirIdentity> {
        use std::os::unix::fs::MetadataExt as _;
        let metadata = std::fs::metadata(dir).ok()?;
        Some(DirIdentity {
            dev: metadata.dev(),
            ino: metadata.ino(),
        })
    }
}

/// Watches the directory of `slot`'s plugin file, and the file behind the
/// path, and reloads once the file has been quiet for `debounce` (at most
/// ten times that in all) after a finished write, a rename, or a change of
/// which file the path leads to. A directory replaced by another (`mv
/// dir dir.old && mv dir.new dir`) is watched anew once the poll sees it: its watch went
/// with the old directory, and later changes would otherwise wait for the
/// poll. The watch lasts as long as the returned [`PluginWatch`] lives.
pub fn watch_plugin_file(
    slot: Arc<PluginSlot>,
    debounce: Duration,
) -> anyhow::Result<Option<PluginWatch>> {
    let Some(path) = slot.source().map(Path::to_path_buf) else {
        return Ok(None);
    };
    let file_name = path
        .file_name()
        .map(|n| n.to_os_string())
        .with_context(|| {
            format!(
                "the plugin path {} names no file to watch: give the path of the plugin's file",
                path.display()
            )
        })?;
    let dir = match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir.to_path_buf(),
        _ => std::path::PathBuf::from("."),
    };
    let (events, mut rx) = mpsc::unbounded_channel();
    let writing = Arc::new(Writing::default());
    let watch_writing = writing.clone();
    // The poll holds a weak sender: once the watch (which holds the strong
    // ones) is dropped, the poll and the reload task end.
    let polls = events.downgrade();
    let watch_events = events.clone();
    let watcher = notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
        let Ok(event) = event else { return };
        // The plugin file's own finished write, rename into place, or
        // removal (its creation, and the modify events in the middle of a
        // write, only keep a reload waiting); or an entry whose name starts
        // with `..` created, renamed or removed, which is how Kubernetes
        // flips the `..data` symlink of a mounted ConfigMap.
        let named = |wanted: &dyn Fn(&std::ffi::OsStr) -> bool| {
            event
                .paths
                .iter()
                .any(|p| p.file_name().is_some_and(wanted))
        };
        let plugin_file = named(&|name| name == file_name.as_os_str());
        let kubernetes = named(&|name| name.as_encoded_bytes().starts_with(b".."));
        let trigger = match event.kind {
            EventKind::Access(AccessKind::Close(AccessMode::Write)) => plugin_file,
            EventKind::Modify(ModifyKind::Name(_)) | EventKind::Remove(_) => {
                plugin_file || kubernetes
            }
            EventKind::Create(_) => kubernetes,
            // The system's queue of events overflowed: any of them may
            // have been the plugin file's.
            _ => event.need_rescan(),
        };
        let written = matches!(
            event.kind,
            EventKind::Modify(ModifyKind::Data(_) | ModifyKind::Any)
        );
        let busy = plugin_file && (written || matches!(event.kind, EventKind::Create(_)));
        if plugin_file && written {
            watch_writing.wrote();
        } else if trigger && (plugin_file || event.need_rescan()) {
            // Closed after a write, renamed, or removed (or its events
            // lost: the poll then judges the file).
            watch_writing.ended();
        }
        if trigger {
            let _ = watch_events.send(Nudge::Changed);
        } else if busy {
            let _ = watch_events.send(Nudge::Busy);
        }
    });
    // Where the system gives no watch (inotify's limits on instances and
    // watches are per user, and a busy node runs out), the gateway serves
    // on, and the poll sees every change, only later.
    let unwatched = |e: &dyn std::fmt::Display| {
        tracing::warn!(
            error = %e,
            "could not watch the plugin directory {}: its changes are seen by the poll every \
             {} s",
            dir.display(),
            POLL_INTERVAL.as_secs()
        );
    };
    let watcher = match watcher {
        Ok(mut watcher) => match watcher.watch(&dir, RecursiveMode::NonRecursive) {
            Ok(()) => Some(watcher),
            Err(e) => {
                unwatched(&e);
                None
            }
        },
        Err(e) => {
            unwatched(&e);
            None
        }
    };
    // The directory the watch was last set up for, whether that worked or
    // not: it is tried again only for another directory, not at every poll.
    let mut watched = DirIdentity::of(&dir);
    let watcher = watcher.map(|watcher| Arc::new(Mutex::new(watcher)));
    let rewatch = watcher.as_ref().map(Arc::downgrade);

    // What the file behind the path was when a reload last read it, and
    // how that went: the poll asks about a file no reload has read yet,
    // and about one whose reload failed in a way that may pass (a
    // self-check that ran out of time on a busy machine) only after a
    // pause (15 s, doubling with each failure up to 5 min), so that such a
    // build is not refused, and counted, every two seconds. A build refused
    // for what it is is not tried again until the file changes: compiling
    // it (minutes of both CPUs, for a large one) would refuse it again.
    let tried = Arc::new(Mutex::new(None::<Tried>));
    let look = {
        let path = path.clone();
        move || {
            let path = path.clone();
            tokio::task::spawn_blocking(move || Fingerprint::of(&path))
        }
    };

    // The backstop: ask for a reload when the file behind the path is due
    // (see above) and has stayed as it is for one interval (so that a slow
    // write in place is not read half done).
    let poll_tried = tried.clone();
    let poll_writing = writing.clone();
    let poll_look = look.clone();
    let services = slot.engine().services().clone();
    // Weak: the reload task holds the slot as long as the watch lives.
    let poll_slot = Arc::downgrade(&slot);
    tokio::spawn(async move {
        // The first look is not taken as the file already loaded: the file
        // may have been replaced between the load and this look, with the
        // directory's events going to a watch set up too late (or to the
        // old directory, when the directory itself was replaced; seen on a
        // loaded machine). Until a reload has read the file, the file is
        // due: the first one compares contents and finds it unchanged.
        let Ok(first) = poll_look().await else { return };
        let mut previous = first;
        loop {
            tokio::time::sleep(POLL_INTERVAL).await;
            let Ok(now) = poll_look().await else { return };
            let Some(tx) = polls.upgrade() else { return };
            let dir_now = {
                let dir = dir.clone();
                tokio::task::spawn_blocking(move || DirIdentity::of(&dir)).await
            };
            let watcher = rewatch.as_ref().and_then(std::sync::Weak::upgrade);
            if let (Ok(Some(dir_now)), Some(watcher)) = (dir_now, watcher) {
                if watched != Some(dir_now) {
                    watch_anew(&watcher, &dir);
                    watched = Some(dir_now);
                }
            }
            let ids_may_leave = || services.ids_may_leave_now().is_ok();
            let slot = poll_slot.upgrade();
            let put_off = || slot.as_ref().is_some_and(|s| s.deferred().is_some());
            // A reload asked by hand that runs now reads the file itself,
            // and this watch's record does not learn how it went: the next
            // poll judges after it.
            let due = !slot.as_ref().is_some_and(|s| s.reload_under_way())
                && poll_asks(lock(&poll_tried).as_ref(), &now, ids_may_leave, put_off)
                && !poll_writing.under_way();
            drop(slot);
            if now == previous && due && tx.send(Nudge::Due).is_err() {
                return; // the reload task is gone
            }
            previous = now;
        }
    });

    tokio::spawn(async move {
        while let Some(nudge) = rx.recv().await {
            if nudge == Nudge::Busy {
                continue;
            }
            match quiet_for(&mut rx, debounce, &writing).await {
                Quiet::Settled => {}
                // Its close, or the poll once it stays as it is, asks again.
                Quiet::StillWritten => continue,
                Quiet::Gone => return,
            }
            let seen = look().await;
            // While this reload runs, the file it read is not due: a build
            // that takes longer than a poll interval to compile would
            // otherwise be queued again behind itself, and a bad one
            // compiled and refused twice before its pause began.
            let failed_before = seen.as_ref().ok().map(|seen| {
                let mut tried = lock(&tried);
                let failed_before = tried
                    .as_ref()
                    .filter(|last| last.fingerprint == *seen)
                    .map_or(0, |last| last.failures);
                *tried = Some(Tried::reloading(seen.clone(), failed_before));
                failed_before
            });
            let outcome = slot.reload().await;
            if let (Ok(seen), Some(failed_before)) = (seen, failed_before) {
                let (failures, deferred, refused) = match outcome {
                    Ok(_) => (0, false, false),
                    Err(NoReload::Failed(e)) => (failed_before + 1, false, !e.may_pass),
                    // Nothing was read: the file is neither good nor bad.
                    Err(NoReload::NotPossible(_)) => (failed_before, false, false),
                    // Not judged: asked about again at the next poll.
                    Err(NoReload::Deferred(_)) => (failed_before, true, false),
                };
                *lock(&tried) = Some(Tried {
                    fingerprint: seen,
                    failures,
                    deferred,
                    refused,
                    at: tokio::time::Instant::now(),
                    reloading: false,
                });
            }
        }
    });
    Ok(Some(PluginWatch {
        _watcher: watcher,
        _events: events,
    }))
}

/// How a debounce ended.
#[derive(Debug, PartialEq, Eq)]
enum Quiet {
    /// Quiet for a whole quiet time, or given up on after ten: reload.
    Settled,
    /// Given up on while the plugin file was still being written (within
    /// the last quiet time): no reload of a file half written; its close
    /// asks again.
    StillWritten,
    /// The senders are gone.
    Gone,
}

/// The debounce, after a first nudge: waits until the file has been quiet
/// for `debounce`, but no longer than ten quiet times in all (a directory
/// that never goes quiet must not put reloads off for ever), unless the
/// file itself is still being written then. Only a change, or a write
/// under way, starts the quiet time again: the poll, asking every 2 s
/// about a build it found unchanged for 2 s, says nothing new, and with a
/// debounce over 2 s it kept every reload waiting the ten quiet times.
///
/// A write under way (`writing`) is waited out, however long it pauses
/// (up to [`WRITE_PAUSE`]), and its close, rename or removal ends it: a
/// change after writes, which starts the quiet time again and does not
/// count as a write then, so that a close that comes while the ten quiet
/// times run out asks for its reload (before, it was used up here and
/// the reload waited for the poll).
async fn quiet_for(
    rx: &mut mpsc::UnboundedReceiver<Nudge>,
    debounce: Duration,
    writing: &Writing,
) -> Quiet {
    let start = tokio::time::Instant::now();
    let give_up = start + debounce.saturating_mul(10);
    let mut quiet = start + debounce;
    let mut written_until = None;
    loop {
        match tokio::time::timeout_at(quiet.min(give_up), rx.recv()).await {
            Ok(Some(nudge @ (Nudge::Changed | Nudge::Busy))) => {
                let now = tokio::time::Instant::now();
                quiet = now + debounce;
                written_until = (nudge == Nudge::Busy).then_some(quiet);
            }
            Ok(Some(Nudge::Due)) => {}
            Ok(None) => return Quiet::Gone,
            Err(_quiet) => {
                let now = tokio::time::Instant::now();
                let written = written_until.is_some_and(|until| now < until);
                if written || writing.under_way() {
                    if now < give_up {
                        // Paused longer than the quiet time: wait on.
                        quiet = now + debounce;
                        continue;
                    }
                    return Quiet::StillWritten;
                }
                return Quiet::Settled;
            }
        }
    }
}

/// Watches `dir` again after it was replaced by another directory (the
/// old watch went with the old one); says in the log whether that worked.
fn watch_anew(watcher: &Mutex<RecommendedWatcher>, dir: &Path) {
    let mut watcher = lock(watcher);
    // The old directory's watch, if it still exists somewhere.
    let _ = watcher.unwatch(dir);
    match watcher.watch(dir, RecursiveMode::NonRecursive) {
        Ok(()) => {
            tracing::info!(
                "the plugin directory {} was replaced by another: watching the new one",
                dir.display()
            );
        }
        Err(e) => {
            tracing::warn!(
                error = %e,
                "the plugin directory {} was replaced by another, and watching the new one \
                 failed: its changes are seen by the poll every {} s",
                dir.display(),
                POLL_INTERVAL.as_secs()
            );
        }
    }
}

/// The file a reload last read, and how many reloads of it failed in a row.
struct Tried {
    fingerprint: Fingerprint,
    failures: u32,
    /// Its last reload was put off until the host holds a machine id
    /// (checked before the build is compiled, so asking at every poll
    /// costs a read of the file).
    deferred: bool,
    /// Its last reload refused its build for what it is (see
    /// `ReloadError::may_pass`): not tried again.
    refused: bool,
    at: tokio::time::Instant,
    /// The reload of this file is still running.
    reloading: bool,
}

/// The pause before a file whose reload failed is tried again; it doubles
/// with each failure in a row, up to [`MAX_RETRY_PAUSE`].
const RETRY_PAUSE: Duration = Duration::from_secs(15);

/// The longest pause before a file whose reloads failed is tried again.
const MAX_RETRY_PAUSE: Duration = Duration::from_secs(300);

impl Tried {
    fn reloading(fingerprint: Fingerprint, failures: u32) -> Tried {
        Tried {
            fingerprint,
            failures,
            deferred: false,
            refused: false,
            at: tokio::time::Instant::now(),
            reloading: true,
        }
    }

    /// Whether the file now at the path (`now`) is due for a reload: it is
    /// another file, or this one's reload was put off, or it failed and its
    /// pause is over, and it may pass (and it is not being reloaded now).
    fn due(&self, now: &Fingerprint) -> bool {
        self.due_after(now, self.at.elapsed())
    }

    /// Whether `now` is the file whose reload was put off until the host
    /// holds a machine id it may use.
    fn waits_for_an_id(&self, now: &Fingerprint) -> bool {
        self.deferred && *now == self.fingerprint
    }

    /// [`Tried::due`], `elapsed` after the reload.
    fn due_after(&self, now: &Fingerprint, elapsed: Duration) -> bool {
        if *now != self.fingerprint {
            return true;
        }
        if self.reloading {
            return false;
        }
        if self.deferred {
            return true;
        }
        if self.failures == 0 || self.refused {
            return false;
        }
        let pause = RETRY_PAUSE
            .saturating_mul(1 << (self.failures - 1).min(16))
            .min(MAX_RETRY_PAUSE);
        elapsed >= pause
    }
}

/// Whether the poll asks for a reload of the file now at the path (`now`),
/// given the watch's record of its last reload (`tried`) and whether the
/// slot holds a build put off (`put_off`, by any reload):
/// - a file the record says is due (see [`Tried::due`]);
/// - but a build the record says was put off only while the slot still
///   holds one (a reload asked by hand since may have judged it, which the
///   record does not learn) and once the host could check it
///   (`ids_may_leave`), since asking reads and hashes the whole file;
/// - and a build put off by a reload asked by hand (`POST /reload`, SIGHUP),
///   which the record does not know of (it may say the file's build was
///   refused, or serves), once the host could check it, but not while the
///   watch's own reload of the file runs, which would compile it twice.
fn poll_asks(
    tried: Option<&Tried>,
    now: &Fingerprint,
    ids_may_leave: impl Fn() -> bool,
    put_off: impl Fn() -> bool,
) -> bool {
    match tried {
        None => true,
        Some(t) if t.due(now) => !t.waits_for_an_id(now) || put_off() && ids_may_leave(),
        Some(t) => !t.reloading && put_off() && ids_may_leave(),
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock_unpoisoned()
}

/// Starts catching SIGHUP, whose default action would end the process:
/// from now on a hangup is held for [`reload_on_sighup`]. Called before the
/// plugin is loaded (which can take seconds), so that a hangup sent while
/// the gateway starts reloads the plugin once it is up instead of killing
/// the process.
pub fn catch_sighup() -> anyhow::Result<Signal> {
    tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())
        .context("listening for SIGHUP")
}

/// Reloads the plugin on every SIGHUP caught by `hangups` (from
/// [`catch_sighup`]), including one that came before this call, until the
/// slot's reloads are over: then the task ends, and lets the slot go (a
/// signal stream never ends by itself, and an embedder that runs one
/// gateway after another kept every stopped one's engine and plugin).
pub fn reload_on_sighup(mut hangups: Signal, slot: Arc<PluginSlot>) {
    tokio::spawn(async move {
        loop {
            let hangup = tokio::select! {
                hangup = hangups.recv() => hangup,
                () = slot.reloads_stopped() => None,
            };
            if hangup.is_none() {
                return;
            }
            tracing::info!("SIGHUP: reloading the plugin");
            // A swap and a failed load are logged by the reload itself;
            // what else comes of it is said here, where nobody else sees
            // it (`POST /reload` answers its client).
            match slot.reload().await {
                Ok(Reloaded::Unchanged) => tracing::info!(
                    "SIGHUP: the plugin file holds the build that serves; nothing changed"
                ),
                Ok(Reloaded::Swapped(_)) => {}
                Err(NoReload::Failed(_)) => {}
                // The reload warns once per build; whoever sent this
                // signal is told again.
                Err(NoReload::Deferred(message)) => {
                    tracing::info!("SIGHUP: reload put off: {message}")
                }
                Err(NoReload::NotPossible(message)) => {
                    tracing::warn!("SIGHUP: no reload: {message}")
                }
            }
        }
    });
}

#[cfg(test)]
mod tests {
    /// The poll's asking does not put a reload off; changes do, up to ten
    /// quiet times.
    #[tokio::test(start_paused = true)]
    async fn only_changes_extend_the_debounce() {
        use super::{quiet_for, Nudge, Quiet, Writing, WRITE_PAUSE};
        use std::time::Duration;
        use tokio::time::Instant;

        let debounce = Duration::from_secs(5);
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let writing = std::sync::Arc::new(Writing::default());
        // `nudge` sent `times` times, `every` apart.
        let send_every = |every: u64, times: usize, nudge: Nudge| {
            let tx = tx.clone();
            tokio::spawn(async move {
                for _ in 0..times {
                    tokio::time::sleep(Duration::from_secs(every)).await;
                    let _ = tx.send(nudge);
                }
            })
        };
        // The poll asks every 2 s, for a minute.
        let poll = send_every(2, 30, Nudge::Due);
        let start = Instant::now();
        assert_eq!(quiet_for(&mut rx, debounce, &writing).await, Quiet::Settled);
        assert_eq!(start.elapsed(), debounce);
        poll.abort();

        // A change every second: given up on after ten quiet times.
        let changes = send_every(1, 100, Nudge::Changed);
        let start = Instant::now();
        assert_eq!(quiet_for(&mut rx, debounce, &writing).await, Quiet::Settled);
        assert_eq!(start.elapsed(), debounce * 10);
        changes.abort();

        // Writes to the file every second: given up on after ten quiet
        // times too, but not for a reload of a file half written.
        while rx.try_recv().is_ok() {}
        let writes = send_every(1, 100, Nudge::Busy);
        let start = Instant::now();
        assert_eq!(
            quiet_for(&mut rx, debounce, &writing).await,
            Quiet::StillWritten
        );
        assert_eq!(start.elapsed(), debounce * 10);
        writes.abort();

        // A change 3 s in starts the quiet time again.
        while rx.try_recv().is_ok() {}
        let late = send_every(3, 1, Nudge::Changed);
        let start = Instant::now();
        assert_eq!(quiet_for(&mut rx, debounce, &writing).await, Quiet::Settled);
        assert_eq!(start.elapsed(), Duration::from_secs(8));
        late.await.expect("the change was sent");

        // So does a write under way.
        let writing_nudge = send_every(3, 1, Nudge::Busy);
        let start = Instant::now();
        assert_eq!(quiet_for(&mut rx, debounce, &writing).await, Quiet::Settled);
        assert_eq!(start.elapsed(), Duration::from_secs(8));
        writing_nudge.await.expect("the write was sent");

        // A write under way that pauses longer than the quiet time, with
        // no event meanwhile, is waited out: its close asks for the reload,
        // a quiet time after it.
        writing.wrote();
        let close = tokio::spawn({
            let (tx, writing) = (tx.clone(), writing.clone());
            async move {
                tokio::time::sleep(Duration::from_secs(20)).await;
                writing.ended();
                let _ = tx.send(Nudge::Changed);
            }
        });
        let start = Instant::now();
        assert_eq!(quiet_for(&mut rx, debounce, &writing).await, Quiet::Settled);
        assert_eq!(start.elapsed(), Duration::from_secs(25));
        // A write never closed counts as over once it paused WRITE_PAUSE.
        writing.wrote();
        let start = Instant::now();
        assert_eq!(quiet_for(&mut rx, debounce, &writing).await, Quiet::Settled);
        assert_eq!(start.elapsed(), WRITE_PAUSE);
        close.await.expect("the close was sent");
        drop(tx);
        assert_eq!(quiet_for(&mut rx, debounce, &writing).await, Quiet::Gone);
    }

    use super::*;

    fn file(ino: u64) -> Fingerprint {
        Fingerprint::File {
            dev: 1,
            ino,
            size: 10,
            mtime_ns: 0,
            ctime_ns: 0,
        }
    }

    /// Whether `now` is due `ago` after a reload of file 1 that made
    /// `failures` failures in a row.
    fn due(failures: u32, ago: Duration, now: &Fingerprint) -> bool {
        tried(failures).due_after(now, ago)
    }

    /// A reload of file 1 that made `failures` failures in a row, each of
    /// which may pass.
    fn tried(failures: u32) -> Tried {
        Tried {
            fingerprint: file(1),
            failures,
            deferred: false,
            refused: false,
            at: tokio::time::Instant::now(),
            reloading: false,
        }
    }

    #[test]
    fn a_file_being_reloaded_is_not_due_again_but_a_newer_one_is() {
        for failures in [0, 1, 3] {
            let tried = Tried::reloading(file(1), failures);
            assert!(!tried.due_after(&file(1), Duration::from_secs(3600)));
            assert!(tried.due_after(&file(2), Duration::ZERO));
        }
    }

    #[test]
    fn another_file_is_due_at_once_and_a_good_one_never_again() {
        assert!(due(0, Duration::ZERO, &file(2)));
        assert!(due(3, Duration::ZERO, &file(2)));
        assert!(!due(0, Duration::from_secs(3600), &file(1)));
    }

    #[test]
    fn a_failed_file_is_tried_again_after_a_pause_that_doubles() {
        let secs = Duration::from_secs;
        assert!(!due(1, secs(14), &file(1)));
        assert!(due(1, secs(15), &file(1)));
        assert!(!due(2, secs(29), &file(1)));
        assert!(due(2, secs(30), &file(1)));
        assert!(!due(3, secs(59), &file(1)));
        // At most five minutes, however many failures.
        assert!(!due(40, secs(299), &file(1)));
        assert!(due(40, secs(300), &file(1)));
    }

    /// A build refused for what it is is not compiled again, however long
    /// ago; another file at the path is due at once.
    #[test]
    fn a_build_refused_for_what_it_is_is_not_tried_again() {
        let refused = Tried {
            refused: true,
            ..tried(1)
        };
        assert!(!refused.due_after(&file(1), Duration::from_secs(86_400)));
        assert!(refused.due_after(&file(2), Duration::ZERO));
    }

    /// A file whose reload was put off (the host held no machine id) is
    /// asked about again at the next poll, failures before it or not, but
    /// not while its reload runs.
    #[test]
    fn a_file_put_off_is_due_at_the_next_poll() {
        for failures in [0, 2] {
            let put_off = Tried {
                deferred: true,
                ..tried(failures)
            };
            assert!(put_off.due_after(&file(1), Duration::ZERO));
            assert!(put_off.waits_for_an_id(&file(1)));
            assert!(!put_off.waits_for_an_id(&file(2)));
            let running = Tried {
                reloading: true,
                ..put_off
            };
            assert!(!running.due_after(&file(1), Duration::from_secs(3600)));
        }
    }

    /// A build a reload asked by hand put off is asked for by the poll
    /// once ids may leave, whatever the record says of the file, but not
    /// while a reload of it runs: before, each poll during a long compile
    /// queued another, and a refused build was compiled and refused twice.
    #[test]
    fn a_build_put_off_is_asked_for_once_ids_may_leave_and_no_reload_runs() {
        use super::poll_asks;
        let (yes, no) = (|| true, || false);
        let refused = Tried {
            refused: true,
            ..tried(1)
        };
        assert!(!poll_asks(Some(&refused), &file(1), yes, no));
        assert!(poll_asks(Some(&refused), &file(1), yes, yes));
        assert!(!poll_asks(Some(&refused), &file(1), no, yes));
        let running = Tried::reloading(file(1), 1);
        assert!(!poll_asks(Some(&running), &file(1), yes, yes));
        // A file no reload has read, or another one, is asked for.
        assert!(poll_asks(None, &file(1), no, no));
        assert!(poll_asks(Some(&running), &file(2), yes, no));
        // One this watch put off is asked for while the slot still holds
        // a build put off; not once a reload asked by hand judged it (before,
        // the poll refused it a second time).
        let put_off = Tried {
            deferred: true,
            ..tried(0)
        };
        assert!(poll_asks(Some(&put_off), &file(1), yes, yes));
        assert!(!poll_asks(Some(&put_off), &file(1), yes, no));
        assert!(!poll_asks(Some(&put_off), &file(1), no, yes));
    }
}
