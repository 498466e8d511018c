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
use tokio::sync::mpsc;

use crate::gateway::plugin_file::Fingerprint;
use crate::gateway::slot::PluginSlot;

/// How often the file behind the plugin path is looked at (one `stat`).
pub const POLL_INTERVAL: Duration = Duration::from_secs(2);

/// Watches the directory of `slot`'s plugin file, and the file behind the
/// path, and reloads once the file has been quiet for `debounce` (at most
/// ten times that in all) after a finished write, a rename, or a change of
/// which file the path leads to. The watch lasts as long as the returned
/// watcher lives.
pub fn watch_plugin_file(
    slot: Arc<PluginSlot>,
    debounce: Duration,
) -> anyhow::Result<Option<RecommendedWatcher>> {
    let Some(path) = slot.source().map(Path::to_path_buf) else {
        return Ok(None);
    };
    let file_name = path
        .file_name()
        .map(|n| n.to_os_string())
        .context("the plugin path has no file name")?;
    let dir = match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir.to_path_buf(),
        _ => std::path::PathBuf::from("."),
    };
    let (events, mut rx) = mpsc::unbounded_channel();
    // The poll holds a weak sender: once the watcher (which holds the
    // strong one) is dropped, the poll and the reload task end.
    let polls = events.downgrade();
    let mut watcher = notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
        let Ok(event) = event else { return };
        // The plugin file's own finished write, rename into place, or
        // removal (not its creation, nor the modify events in the middle of
        // a write); or an entry whose name starts with `..` created,
        // renamed or removed, which is how Kubernetes flips the `..data`
        // symlink of a mounted ConfigMap.
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
            _ => false,
        };
        if trigger {
            let _ = events.send(());
        }
    })
    .context("starting the plugin file watcher")?;
    watcher
        .watch(&dir, RecursiveMode::NonRecursive)
        .with_context(|| format!("watching the plugin directory {}", dir.display()))?;

    // What the file behind the path was when a reload last read it: the
    // poll asks only about a file no reload has tried yet, so a bad build
    // is refused (and counted) once.
    let tried = Arc::new(Mutex::new(None::<Fingerprint>));
    let look = {
        let path = path.clone();
        move || {
            let path = path.clone();
            tokio::task::spawn_blocking(move || Fingerprint::of(&path))
        }
    };

    // The backstop: ask for a reload when the file behind the path is one
    // no reload has tried and has stayed as it is for one interval (so
    // that a slow write in place is not read half done).
    let poll_tried = tried.clone();
    let poll_look = look.clone();
    tokio::spawn(async move {
        let Ok(first) = poll_look().await else { return };
        lock(&poll_tried).get_or_insert(first.clone());
        let mut previous = first;
        loop {
            tokio::time::sleep(POLL_INTERVAL).await;
            let Ok(now) = poll_look().await else { return };
            let Some(tx) = polls.upgrade() else { return };
            let untried = lock(&poll_tried).as_ref() != Some(&now);
            if now == previous && untried && tx.send(()).is_err() {
                return; // the reload task is gone
            }
            previous = now;
        }
    });

    tokio::spawn(async move {
        while rx.recv().await.is_some() {
            // Debounce: wait until the file has been quiet for a while, but
            // no longer than ten quiet times in all (a directory that never
            // goes quiet must not put reloads off for ever).
            let give_up = tokio::time::Instant::now() + debounce.saturating_mul(10);
            loop {
                let quiet = tokio::time::Instant::now() + debounce;
                match tokio::time::timeout_at(quiet.min(give_up), rx.recv()).await {
                    Ok(Some(())) => continue,
                    Ok(None) => return,
                    Err(_quiet) => break,
                }
            }
            if let Ok(seen) = look().await {
                *lock(&tried) = Some(seen);
            }
            let _ = slot.reload().await;
        }
    });
    Ok(Some(watcher))
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Reloads the plugin on every SIGHUP.
pub fn reload_on_sighup(slot: Arc<PluginSlot>) -> anyhow::Result<()> {
    let mut hangups = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())
        .context("listening for SIGHUP")?;
    tokio::spawn(async move {
        while hangups.recv().await.is_some() {
            tracing::info!("SIGHUP: reloading the plugin");
            let _ = slot.reload().await;
        }
    });
    Ok(())
}
