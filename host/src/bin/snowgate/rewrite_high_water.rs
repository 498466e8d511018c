//! `snowgate rewrite --high-water-file`: one run's ids continue after the
//! mark the last run (or gateway) on the file wrote, and the body goes out
//! only once the run's last id's millisecond is on disk.
//!
//! Unlike the gateway (`high_water_file::keeper`), a run needs no mark
//! kept ahead of its ids: nothing leaves before the call has ended, so
//! the run writes the last millisecond its id clock used, then the body.
//! A crash before that write loses the body, never the mark.

use std::path::Path;
use std::sync::mpsc;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use snowgate_host::high_water_file::keeper::wait_until_near_blocking;
use snowgate_host::high_water_file::HighWaterFile;
use snowgate_host::IdClock;
use snowgate_plugin::SnowflakeLayout;

/// The longest a run waits to open and read the file, or to write its
/// mark: a hung disk fails the run, naming the file, instead of hanging it
/// (as a gateway's start does).
const DISK_WAIT: Duration = Duration::from_secs(10);

/// The high-water file of one run, locked until the run ends.
pub struct RunMark {
    file: Arc<HighWaterFile>,
}

impl RunMark {
    /// Opens and locks the file at `path`, and starts `clock` after the
    /// mark it holds: first waiting, logged, while that mark is further
    /// ahead of the wall clock than ids may run (the clock stepped back).
    pub fn take_over(
        path: &Path,
        layout: SnowflakeLayout,
        machine_id: u32,
        clock: &IdClock,
    ) -> anyhow::Result<RunMark> {
        let owned = path.to_path_buf();
        let (file, stored) = within(path, "opening and reading", move || {
            HighWaterFile::open(&owned, layout, machine_id)
        })?;
        if let Some(stored) = stored {
            wait_until_near_blocking(stored, path);
            clock.advance_past(stored);
        }
        Ok(RunMark {
            file: Arc::new(file),
        })
    }

    /// Writes the last millisecond `clock` used as the file's mark, if it
    /// issued any id: the next run continues after it.
    pub fn record(&self, clock: &IdClock) -> anyhow::Result<()> {
        let Some(last) = clock.last_tick().filter(|_| clock.issued() > 0) else {
            return Ok(());
        };
        let file = self.file.clone();
        let written = within(self.file.path(), "writing the mark to", move || {
            file.write(last.millis)
        })
        .context("the ids made are not recorded, so the body is not written")?;
        // The file was replaced during the run by one with a higher mark:
        // the ids made, below it, may be ones its writer made.
        anyhow::ensure!(
            written <= last.millis,
            "the high-water file {} was replaced during the run by one whose mark, {}, is past \
             the ids made, which may repeat ids made before; the body is not written",
            self.file.path().display(),
            written
        );
        Ok(())
    }
}

/// Runs `work` on a thread of its own and waits for it at most
/// [`DISK_WAIT`].
fn within<T: Send + 'static>(
    path: &Path,
    doing: &str,
    work: impl FnOnce() -> anyhow::Result<T> + Send + 'static,
) -> anyhow::Result<T> {
    let (done, result) = mpsc::channel();
    std::thread::Builder::new()
        .name("high-water-file".into())
        .spawn(move || {
            let _ = done.send(work());
        })
        .context("starting a thread for the high-water file")?;
    match result.recv_timeout(DISK_WAIT) {
        Ok(outcome) => outcome.context("--high-water-file"),
        Err(mpsc::RecvTimeoutError::Timeout) => anyhow::bail!(
            "--high-water-file: {doing} {} did not end within {} s: the disk is hung or very slow",
            path.display(),
            DISK_WAIT.as_secs()
        ),
        Err(mpsc::RecvTimeoutError::Disconnected) => anyhow::bail!(
            "--high-water-file: {doing} {} failed: its thread ended without an outcome",
            path.display()
        ),
    }
}
