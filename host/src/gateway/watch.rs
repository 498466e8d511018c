//! Reload triggers: changes to the plugin file (an atomic rename into place
//! or an in-place rewrite), debounced; and SIGHUP.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use notify::event::{AccessKind, AccessMode, ModifyKind};
use notify::{EventKind, RecommendedWatcher, RecursiveMode, Watcher};
use tokio::sync::mpsc;

use crate::gateway::slot::PluginSlot;

/// Watches the directory of `slot`'s plugin file and reloads once the file
/// has been quiet for `debounce` after a finished write or a rename. The
/// watch lasts as long as the returned watcher lives.
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
    let (tx, mut rx) = mpsc::unbounded_channel();
    let mut watcher = notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
        let Ok(event) = event else { return };
        // A finished write, a rename into place, or removal: not the
        // modify events in the middle of a write.
        let finished = matches!(
            event.kind,
            EventKind::Access(AccessKind::Close(AccessMode::Write))
                | EventKind::Modify(ModifyKind::Name(_))
                | EventKind::Remove(_)
        );
        if finished
            && event
                .paths
                .iter()
                .any(|p| p.file_name() == Some(file_name.as_os_str()))
        {
            let _ = tx.send(());
        }
    })
    .context("starting the plugin file watcher")?;
    watcher
        .watch(&dir, RecursiveMode::NonRecursive)
        .with_context(|| format!("watching the plugin directory {}", dir.display()))?;

    tokio::spawn(async move {
        while rx.recv().await.is_some() {
            // Debounce: wait until the file has been quiet for a while.
            loop {
                match tokio::time::timeout(debounce, rx.recv()).await {
                    Ok(Some(())) => continue,
                    Ok(None) => return,
                    Err(_quiet) => break,
                }
            }
            let _ = slot.reload().await;
        }
    });
    Ok(Some(watcher))
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
