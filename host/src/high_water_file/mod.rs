//! A fixed machine id's high-water mark, kept in a local file so that ids
//! never repeat across restarts of a gateway without etcd: not after a
//! crash or `SIGKILL`, which leave no time to wait out the id clock's lead,
//! and not after the wall clock stepped back (an NTP step), which no
//! waiting covers. Not a VM restored from a snapshot of a disk that holds
//! the file: that restores the file too, to the mark of the snapshot's
//! time.
//!
//! While it serves, the gateway keeps a mark in the file ahead of its id
//! clock (see [`keeper`]), and no id leaves past the mark last written
//! ([`MachineIdentity::bound_by_file_mark`](crate::MachineIdentity::bound_by_file_mark)).
//! The next gateway on the file starts its id clock after that mark,
//! wherever its wall clock is. Only one process at a time may use a file:
//! it holds an exclusive lock (`flock`) on it while it runs, and a second
//! one is refused at start. See the `record` module for what the file holds.

pub mod keeper;
pub mod lead;
mod record;

use std::fs::File;
use std::io::Read as _;
use std::os::unix::fs::{FileExt as _, OpenOptionsExt as _};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, SystemTime};

use anyhow::Context as _;
use snowgate_plugin::SnowflakeLayout;

use crate::unpoisoned::LockUnpoisoned as _;
use crate::utc::{format_millis, millis_of};
use record::{Record, BLOCK, FILE_BYTES};

/// The furthest past this host's wall clock a mark may be when it is read:
/// a gateway sets it at most about 14 s ahead (its id clock's
/// [lead](crate::id_clock::MAX_LEAD) and the [mark's](lead::LONGEST_LEAD)), so a mark
/// further ahead means a wall clock that stepped back by more than a day,
/// or a file that is not what it seems. The gateway then refuses to start
/// rather than wait that out.
pub const FURTHEST_AHEAD: Duration = Duration::from_secs(86_400);

/// Why a high-water file could not be taken: another process holds its
/// lock (the cause under the message that says so).
#[derive(Debug)]
pub struct InUseByAnother;

impl std::fmt::Display for InUseByAnother {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("another process holds the file's lock")
    }
}

impl std::error::Error for InUseByAnother {}

/// An open high-water file, locked for this process until dropped.
#[derive(Debug)]
pub struct HighWaterFile {
    /// The file the path led to when it was last written; another one
    /// when the path was found leading elsewhere (see
    /// [`HighWaterFile::write`]).
    file: Mutex<File>,
    path: PathBuf,
    layout: SnowflakeLayout,
    machine_id: u32,
    /// Whether the directory's entry for the file is known to be on disk.
    entry_synced: AtomicBool,
}

impl HighWaterFile {
    /// Opens (creating it if needed) and locks the high-water file at
    /// `path` for a gateway stamping `machine_id` in `layout`, and reads
    /// the mark it holds: `None` for a new file.
    ///
    /// Refused, with a message naming the file: when another process holds
    /// its lock; when it is not a regular file; when neither copy of its
    /// mark reads (damaged, or not a high-water file); and when its mark is
    /// more than [`FURTHEST_AHEAD`] past this host's clock. One damaged
    /// copy is logged as a warning, and the other is used.
    pub fn open(
        path: &Path,
        layout: SnowflakeLayout,
        machine_id: u32,
    ) -> anyhow::Result<(HighWaterFile, Option<u64>)> {
        let shown = path.display();
        let mut file = File::options()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o644)
            .open(path)
            .with_context(|| format!("opening the high-water file {shown}"))?;
        let metadata = file
            .metadata()
            .with_context(|| format!("reading the metadata of the high-water file {shown}"))?;
        anyhow::ensure!(
            metadata.is_file(),
            "the high-water file {shown} is not a regular file"
        );
        match rustix::fs::flock(&file, rustix::fs::FlockOperation::NonBlockingLockExclusive) {
            Ok(()) => {}
            Err(rustix::io::Errno::WOULDBLOCK) => {
                return Err(anyhow::Error::new(InUseByAnother).context(format!(
                    "the high-water file {shown} is in use by another process, which holds its \
                     lock: two processes on one high-water file would issue the same ids; give \
                     each gateway its own --machine-id and --high-water-file, and run `snowgate \
                     rewrite` on one only while no gateway uses it"
                )))
            }
            Err(e) => {
                return Err(e).with_context(|| format!("locking the high-water file {shown}"))
            }
        }
        anyhow::ensure!(
            metadata.len() <= FILE_BYTES as u64,
            "the high-water file {shown} is {} bytes long, not a high-water file (at most \
             {FILE_BYTES}); check the path",
            metadata.len()
        );
        let mut contents = Vec::with_capacity(FILE_BYTES);
        (&mut file)
            .take(FILE_BYTES as u64 + 1)
            .read_to_end(&mut contents)
            .with_context(|| format!("reading the high-water file {shown}"))?;
        let now = millis_of(SystemTime::now());
        let record = read_record(&contents, now)
            .map_err(|problem| anyhow::anyhow!("the high-water file {shown} {problem}"))?;
        if let Some(other) = record.and_then(|r| another_gateways(&r, layout, machine_id)) {
            tracing::warn!("the high-water file {shown} {other}");
        }
        let mark = record.map(|record| record.millis);
        if mark.is_none() && !contents.is_empty() {
            tracing::warn!(
                "the high-water file {shown} holds {} bytes but no mark: a gateway stopped \
                 before its first write was whole on disk (its second copy was never written, so \
                 no id was let out against it); taken as a new file",
                contents.len()
            );
        }
        let found = HighWaterFile {
            file: Mutex::new(file),
            path: path.to_path_buf(),
            layout,
            machine_id,
            // Synced once by each process, even for a file that holds a
            // mark: whoever wrote it may have died before syncing its
            // entry, or it may have been copied in.
            entry_synced: AtomicBool::new(false),
        };
        Ok((found, mark))
    }

    /// Where the file is.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Writes `millis` as the file's mark, both copies, each synced to
    /// disk before the next step: when this returns `Ok`, a restart after
    /// a crash or power loss reads this mark or a later one. Blocks for
    /// two `fdatasync`s (and, on the first write to a new file, a sync of
    /// its directory).
    ///
    /// The path must still lead to the file written: a mark written to a
    /// file that was removed (or replaced by another) while the gateway
    /// ran would not be read by the next start. So where the path leads
    /// elsewhere, the file there is opened as at a start (made anew when
    /// there is none, locked, its mark read), logged at WARN, and the
    /// higher of the two marks written to it. One another process holds
    /// locked is an error, as at a start.
    ///
    /// Returns the mark written: `millis`, or the higher mark of a file
    /// taken over, which the caller's ids must then stay above (its id
    /// clock advanced past it), as after a start that read it.
    pub fn write(&self, millis: u64) -> anyhow::Result<u64> {
        let mut file = self.file.lock_unpoisoned();
        self.write_to(&file, millis)?;
        if self.still_at_path(&file)? {
            return Ok(millis);
        }
        self.follow_path(&mut file, millis)
    }

    /// After `millis` was written to `file` and the path was found to lead
    /// elsewhere or nowhere: takes over the file the path leads to now
    /// (see [`HighWaterFile::write`]). Where that cannot be opened and the
    /// path leads to `file` again, nothing was lost: it led nowhere for a
    /// moment (the file moved away and back, or a network file system
    /// answered "not found" once), and `file`'s own lock, this gateway's,
    /// refused the open. That was taken for another process's lock, and
    /// the gateway stopped stamping for good (a review found it by
    /// failing one lookup with `strace`).
    fn follow_path(&self, file: &mut File, millis: u64) -> anyhow::Result<u64> {
        let (found, stored) = match HighWaterFile::open(&self.path, self.layout, self.machine_id) {
            Ok(opened) => opened,
            Err(e) if matches!(self.still_at_path(file), Ok(true)) => {
                // Its directory entry came back (moved away and back, say):
                // synced, or a crash could lose it, and the next start would
                // find no mark.
                self.entry_synced.store(false, Ordering::Relaxed);
                self.sync_entry()?;
                tracing::warn!(
                    "the high-water file {} was not found at its path for a moment ({e:#}); it \
                     is there again, and holds the mark {}",
                    self.path.display(),
                    format_millis(millis)
                );
                return Ok(millis);
            }
            Err(e) => {
                return Err(
                    e.context("the high-water file was removed or replaced while this gateway ran")
                )
            }
        };
        let found = found.file.into_inner().unwrap_or_else(|p| p.into_inner());
        self.entry_synced.store(false, Ordering::Relaxed);
        let mark = millis.max(stored.unwrap_or(0));
        self.write_to(&found, mark)?;
        tracing::warn!(
            "the high-water file {} was removed or replaced while this gateway ran: its marks \
             went to a file the path no longer leads to, which the next start would not read; \
             they go to the file now at the path ({}), from the mark {}",
            self.path.display(),
            match stored {
                Some(stored) => format!("holding the mark {}", format_millis(stored)),
                None => "made anew".to_string(),
            },
            format_millis(mark)
        );
        *file = found;
        Ok(mark)
    }

    /// [`HighWaterFile::write`] to `file`, whatever the path leads to.
    fn write_to(&self, file: &File, millis: u64) -> anyhow::Result<()> {
        let block = record::encode(&Record {
            millis,
            layout: self.layout,
            machine_id: self.machine_id,
        });
        let shown = self.path.display();
        for (copy, offset) in [("first", 0), ("second", BLOCK as u64)] {
            file.write_all_at(&block, offset)
                .and_then(|()| file.sync_data())
                .with_context(|| {
                    format!("writing the {copy} copy of the high-water mark to {shown}")
                })?;
        }
        self.sync_entry()
    }

    /// Syncs the file's directory entry, unless it is synced already.
    fn sync_entry(&self) -> anyhow::Result<()> {
        if !self.entry_synced.load(Ordering::Relaxed) {
            sync_directory_of(&self.path).with_context(|| {
                format!(
                    "syncing the directory entry of the high-water file {}",
                    self.path.display()
                )
            })?;
            self.entry_synced.store(true, Ordering::Relaxed);
        }
        Ok(())
    }

    /// Whether the path still leads to `file` (`false` when it leads
    /// nowhere).
    fn still_at_path(&self, file: &File) -> anyhow::Result<bool> {
        use std::os::unix::fs::MetadataExt as _;
        let shown = self.path.display();
        let ours = file
            .metadata()
            .with_context(|| format!("reading the metadata of the high-water file {shown}"))?;
        match std::fs::metadata(&self.path) {
            Ok(there) => Ok(there.dev() == ours.dev() && there.ino() == ours.ino()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
            Err(e) => Err(e).with_context(|| format!("looking up the high-water file {shown}")),
        }
    }
}

/// When `record` was written by a gateway that stamped another machine id
/// or layout than `machine_id` in `layout`: what that means, worded to
/// follow the file's name. Its mark still bounds where ids start, which
/// is safe; but the machine id's own history, if another gateway stamped
/// it before, is in that gateway's file (a machine id moved between
/// hosts, or a file copied with a configuration).
fn another_gateways(record: &Record, layout: SnowflakeLayout, machine_id: u32) -> Option<String> {
    if record.machine_id == machine_id && record.layout == layout {
        return None;
    }
    Some(format!(
        "was last written by a gateway stamping machine id {} in {}; this one stamps machine id \
         {machine_id} in {layout}. Ids start after its mark all the same, but the file holds no \
         history of machine id {machine_id}: if another gateway stamped it before, start this one \
         on that gateway's high-water file, or after that gateway's last id",
        record.machine_id, record.layout
    ))
}

/// The record of a file's `contents` read at `now` (Unix milliseconds):
/// `None` when it is empty, the higher of the two copies that read, or
/// what is wrong (worded to follow the file's name).
fn read_record(contents: &[u8], now: u64) -> Result<Option<Record>, String> {
    if contents.is_empty() {
        return Ok(None);
    }
    let (first, second) = contents.split_at(contents.len().min(BLOCK));
    let copies = [
        ("first", record::decode(first)),
        ("second", record::decode(second)),
    ];
    let newest = copies
        .iter()
        .filter_map(|(_, read)| read.as_ref().ok().copied().flatten())
        .max_by_key(|record| record.millis);
    // A gateway writes the second copy only once the first is on disk, so
    // a file that reaches into the second copy had a whole first one.
    let past_the_first_copy = contents.len() > BLOCK;
    if newest.is_none() {
        // The first write of a new file, torn by a crash or power loss (or
        // not begun): its second copy was never written, so that write
        // never ended, and no id was let out against the file. Refusing it
        // would keep every restart from starting until someone removed the
        // file.
        if !past_the_first_copy
            && (matches!(copies[0].1, Ok(None)) || record::starts_like_a_record(first))
        {
            return Ok(None);
        }
        let [first, second] = copies.map(|(_, read)| match read {
            Err(problem) => problem,
            Ok(_) if past_the_first_copy => "all zero bytes".to_string(),
            Ok(_) => "never written".to_string(),
        });
        // Not a new file's first write cut short: only a disk (or virtual
        // machine) that does not keep what it confirmed written, or someone
        // else's write, leaves such a file.
        let lost = if past_the_first_copy {
            format!(
                ", and at {} bytes it is longer than a new file's first write cut short leaves one",
                contents.len()
            )
        } else {
            String::new()
        };
        return Err(format!(
            "holds no readable high-water mark (first copy: {first}; second copy: \
             {second}){lost}: it is damaged or not a high-water file, so snowgate cannot tell \
             which ids its machine id was used for. If the wall clock never stepped back, ids \
             are safe again 20 seconds after the last gateway on the file stopped: then remove \
             the file and start again"
        ));
    }
    for (copy, read) in &copies {
        if let Err(problem) = read {
            tracing::warn!(
                "the {copy} copy of the high-water mark in the file is unreadable ({problem}); \
                 using the other"
            );
        }
    }
    let furthest = now.saturating_add(FURTHEST_AHEAD.as_millis() as u64);
    match newest {
        Some(Record { millis: mark, .. }) if mark > furthest => Err(format!(
            "holds the mark {mark} ({}), later than {}: more than a day past this host's clock, \
             further than a gateway sets it. The wall clock stepped back by more than a day, or \
             the file is not this host's; set the clock right, or remove the file if no \
             gateway issued ids with its machine id up to that time",
            format_millis(mark),
            format_millis(furthest)
        )),
        newest => Ok(newest),
    }
}

/// Syncs the directories that hold `path`, so that a new file's entry
/// survives a power loss: the one of `path` itself, and, where `path` is
/// a symbolic link (or under one), the one of the file it leads to, where
/// the gateway made the file.
fn sync_directory_of(path: &Path) -> std::io::Result<()> {
    for dir in directories_holding(path)? {
        File::open(&dir)?.sync_all()?;
    }
    Ok(())
}

/// The directory of `path` as given, and that of the file it leads to
/// where that is another (not where the path leads nowhere now: the file
/// was then moved or removed, which the keeper finds on its own).
fn directories_holding(path: &Path) -> std::io::Result<Vec<PathBuf>> {
    let given = match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let target_dir = std::fs::canonicalize(path)
        .ok()
        .and_then(|target| target.parent().map(Path::to_path_buf));
    let mut dirs = vec![given];
    if let Some(dir) = target_dir {
        if std::fs::canonicalize(&dirs[0])? != dir {
            dirs.push(dir);
        }
    }
    Ok(dirs)
}

#[cfg(test)]
mod tests {
    use super::*;

    const NOW: u64 = 1_796_448_728_439;

    fn record(millis: u64) -> [u8; BLOCK] {
        record::encode(&Record {
            millis,
            layout: SnowflakeLayout::TrtllmV1,
            machine_id: 5,
        })
    }

    fn file_of(first: &[u8], second: &[u8]) -> Vec<u8> {
        [first, second].concat()
    }

    /// A high-water file reached through a symbolic link: its directory
    /// entry is made in the target's directory, which is synced too (only
    /// the link's was, so a file the gateway made there could lose its
    /// entry on power loss).
    #[test]
    fn syncs_the_directory_a_symbolic_link_leads_to() {
        let root = scratch("symlinked");
        let root = root.parent().expect("the scratch dir");
        let (links, files) = (root.join("links"), root.join("files"));
        std::fs::create_dir(&links).expect("links dir");
        std::fs::create_dir(&files).expect("files dir");
        let link = links.join("high-water");
        std::os::unix::fs::symlink(files.join("mark"), &link).expect("symlink");
        std::fs::write(files.join("mark"), b"").expect("the target");
        let canonical = |p: &Path| std::fs::canonicalize(p).expect("canonical");
        let dirs: Vec<_> = directories_holding(&link)
            .expect("directories")
            .iter()
            .map(|d| canonical(d))
            .collect();
        assert_eq!(dirs, [canonical(&links), canonical(&files)]);

        let plain = files.join("mark");
        let dirs = directories_holding(&plain).expect("directories");
        assert_eq!(dirs.len(), 1, "{dirs:?}");
        assert_eq!(canonical(&dirs[0]), canonical(&files));
        sync_directory_of(&link).expect("both synced");
    }

    fn read_mark(contents: &[u8], now: u64) -> Result<Option<u64>, String> {
        read_record(contents, now).map(|record| record.map(|r| r.millis))
    }

    /// A file last written for another machine id or layout is used (its
    /// mark is a safe floor), and what that means is said.
    #[test]
    fn a_record_of_another_machine_id_or_layout_is_told_apart() {
        let written = Record {
            millis: NOW,
            layout: SnowflakeLayout::TrtllmV1,
            machine_id: 5,
        };
        let read = read_record(&file_of(&record(NOW), &record(NOW)), NOW);
        assert_eq!(read, Ok(Some(written)));
        assert_eq!(
            another_gateways(&written, SnowflakeLayout::TrtllmV1, 5),
            None
        );
        let other_id = another_gateways(&written, SnowflakeLayout::TrtllmV1, 6).expect("told");
        assert!(
            other_id
                .contains("machine id 5 in trtllm-v1; this one stamps machine id 6 in trtllm-v1"),
            "{other_id}"
        );
        assert!(
            other_id.contains("no history of machine id 6"),
            "{other_id}"
        );
        let other_layout = another_gateways(&written, SnowflakeLayout::TrtllmV2, 5).expect("told");
        assert!(other_layout.contains("in trtllm-v2"), "{other_layout}");
    }

    #[test]
    fn the_mark_is_the_higher_copy_that_reads() {
        assert_eq!(read_mark(&[], NOW), Ok(None));
        assert_eq!(read_mark(&[0; BLOCK], NOW), Ok(None));
        let both = file_of(&record(NOW), &record(NOW - 5));
        assert_eq!(read_mark(&both, NOW), Ok(Some(NOW)));
        let both = file_of(&record(NOW - 5), &record(NOW));
        assert_eq!(read_mark(&both, NOW), Ok(Some(NOW)));
        // A write torn in the first copy: the second holds the last mark.
        let mut torn = record(NOW + 2_000);
        torn[100..].copy_from_slice(&record(NOW)[100..]);
        assert_eq!(read_mark(&file_of(&torn, &record(NOW)), NOW), Ok(Some(NOW)));
        // A first write torn in the second copy: the first is whole.
        assert_eq!(
            read_mark(&file_of(&record(NOW), &record(NOW)[..300]), NOW),
            Ok(Some(NOW))
        );
        assert_eq!(read_mark(&record(NOW), NOW), Ok(Some(NOW)));
    }

    /// A new file's first write torn by a crash: whatever part of the
    /// first copy reached the disk, with the second never written, it is
    /// a new file, not a damaged one. Only the start of a record counts:
    /// other bytes are still refused, and so is a file that reaches into
    /// the second copy, even one of zeros: the gateway writes that copy
    /// only once the first is on disk, so a first copy lost after that
    /// may have let ids out (a crash review made an 8 KiB file of zeros,
    /// which started as a new file).
    #[test]
    fn a_first_write_torn_before_its_second_copy_is_a_new_file() {
        let whole = record(NOW);
        for cut in [1, 10, 27, 28, 200, BLOCK - 1] {
            let mut torn = [0u8; BLOCK];
            torn[..cut].copy_from_slice(&whole[..cut]);
            assert_eq!(read_mark(&torn, NOW), Ok(None), "zeros from byte {cut}");
            assert_eq!(read_mark(&whole[..cut], NOW), Ok(None), "cut at byte {cut}");
            let with_second = file_of(&torn, &[0; BLOCK]);
            let problem = read_mark(&with_second, NOW).expect_err("second zeros");
            assert!(
                problem.contains("second copy: all zero bytes)")
                    && problem.contains("at 8192 bytes it is longer than a new file's first write"),
                "second zeros, {cut}: {problem}"
            );
        }
        let mut damaged = whole;
        damaged[30] = b'9';
        assert!(read_mark(&damaged, NOW).is_err(), "a whole block, damaged");
        assert!(read_mark(&file_of(&damaged, &damaged), NOW).is_err());
        assert!(read_mark(b"snowgate-high-water-mark v2 ", NOW).is_err());
        assert!(read_mark(b"snowmelt", NOW).is_err());
        let mut late = [0u8; BLOCK];
        late[512..].copy_from_slice(&whole[512..]);
        assert!(read_mark(&late, NOW).is_err(), "no start of a record");
    }

    #[test]
    fn a_file_with_no_readable_copy_is_refused_saying_why() {
        let problem = read_mark(b"hello\n", NOW).expect_err("garbage");
        assert!(
            problem.starts_with("holds no readable high-water mark (first copy: it is cut short"),
            "{problem}"
        );
        assert!(problem.contains("second copy: never written"), "{problem}");
        let mut damaged = record(NOW);
        damaged[30] = b'9';
        let problem =
            read_mark(&file_of(&damaged, &damaged), NOW).expect_err("both copies damaged");
        assert_eq!(
            problem.matches("checksum does not match").count(),
            2,
            "{problem}"
        );
        assert!(problem.contains("remove the file"), "{problem}");
        let problem = read_mark(&[0; FILE_BYTES], NOW).expect_err("8 KiB of zeros");
        assert!(
            problem.starts_with(
                "holds no readable high-water mark (first copy: all zero bytes; second copy: all \
                 zero bytes), and at 8192 bytes it is longer than a new file's first write cut \
                 short leaves one: it is damaged"
            ),
            "{problem}"
        );
    }

    /// A path in an empty directory of the test's own.
    pub(super) fn scratch(name: &str) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("snowgate-high-water-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("a temporary directory");
        dir.join("ids.mark")
    }

    fn open(path: &Path) -> anyhow::Result<(HighWaterFile, Option<u64>)> {
        HighWaterFile::open(path, SnowflakeLayout::TrtllmV1, 5)
    }

    #[test]
    fn a_mark_written_is_read_by_the_next_opener_and_the_file_is_locked_meanwhile() {
        let path = scratch("locked");
        let (file, mark) = open(&path).expect("a new file");
        assert_eq!(mark, None);
        let other = open(&path).expect_err("locked");
        let message = format!("{other:#}");
        assert!(
            message.contains("is in use by another process"),
            "{message}"
        );
        assert!(message.contains(&path.display().to_string()), "{message}");
        file.write(NOW + 2_000).expect("written");
        file.write(NOW).expect("lowered at a stop");
        assert_eq!(
            std::fs::metadata(&path).expect("there").len(),
            FILE_BYTES as u64
        );
        drop(file);
        let (file, mark) = open(&path).expect("unlocked once dropped");
        assert_eq!(mark, Some(NOW));
        drop(file);
        // A copy damaged on disk: the other one is read.
        let mut contents = std::fs::read(&path).expect("read");
        contents[10] = b'X';
        std::fs::write(&path, &contents).expect("damaged");
        assert_eq!(open(&path).expect("one copy reads").1, Some(NOW));
    }

    /// A file removed while its gateway runs would take the marks to a
    /// file no path leads to, and the next start would find none: the
    /// next write makes it anew at the path, locked, with the mark. One
    /// replaced by another file (a restored copy) is taken over, keeping
    /// the higher mark. One that another process holds locked is refused,
    /// as at a start: two processes on one file would issue the same ids.
    #[test]
    fn a_file_removed_or_replaced_while_in_use_is_made_anew_at_its_path() {
        let path = scratch("removed");
        let (file, _) = open(&path).expect("a new file");
        file.write(NOW).expect("written");
        std::fs::remove_file(&path).expect("removed");
        file.write(NOW + 1_000).expect("written anew");
        let message = format!("{:#}", open(&path).expect_err("locked by the writer"));
        assert!(message.contains("in use by another process"), "{message}");
        let read = |path: &Path| read_mark(&std::fs::read(path).expect("there"), NOW);
        assert_eq!(read(&path), Ok(Some(NOW + 1_000)));

        // Replaced by a copy holding a higher mark: the higher one stays.
        let copy = path.with_extension("copy");
        std::fs::write(&copy, file_of(&record(NOW + 9_000), &record(NOW + 9_000))).expect("copy");
        std::fs::rename(&copy, &path).expect("replaced");
        // The higher mark is told, for the writer's ids to stay above.
        assert_eq!(file.write(NOW + 2_000).expect("taken over"), NOW + 9_000);
        assert_eq!(read(&path), Ok(Some(NOW + 9_000)));
        assert_eq!(file.write(NOW + 10_000).expect("written"), NOW + 10_000);
        assert_eq!(read(&path), Ok(Some(NOW + 10_000)));

        // Removed, and a second gateway made it anew first: refused.
        std::fs::remove_file(&path).expect("removed");
        let (second, _) = open(&path).expect("another gateway's new file");
        let message = format!("{:#}", file.write(NOW + 11_000).expect_err("in use"));
        assert!(
            message.contains("removed or replaced while this gateway ran"),
            "{message}"
        );
        assert!(message.contains("in use by another process"), "{message}");
        drop(second);
    }

    /// A path that led nowhere for a moment when a write looked it up, and
    /// leads to the writer's own file again when it is opened: the open,
    /// refused by the writer's own lock, is no other process's, and the
    /// mark written stands. The writer stopped stamping for good before.
    #[test]
    fn a_path_leading_to_the_writers_own_file_again_is_not_another_process() {
        let path = scratch("back-again");
        let (file, _) = open(&path).expect("a new file");
        file.write(NOW).expect("written");
        // What `write` does after a lookup that said "not found".
        let mut held = file.file.lock_unpoisoned();
        file.write_to(&held, NOW + 1_000).expect("written");
        let written = file.follow_path(&mut held, NOW + 1_000);
        drop(held);
        assert_eq!(written.expect("its own file"), NOW + 1_000);
        let read = |path: &Path| read_mark(&std::fs::read(path).expect("there"), NOW);
        assert_eq!(read(&path), Ok(Some(NOW + 1_000)));
        assert_eq!(file.write(NOW + 2_000).expect("written"), NOW + 2_000);
        assert_eq!(read(&path), Ok(Some(NOW + 2_000)));
    }

    #[test]
    fn what_is_not_a_high_water_file_is_refused_naming_it() {
        let path = scratch("not-a-file");
        std::fs::create_dir(&path).expect("a directory");
        let message = format!("{:#}", open(&path).expect_err("a directory"));
        assert!(message.contains("opening the high-water file"), "{message}");
        std::fs::remove_dir(&path).expect("removed");
        std::fs::write(&path, vec![b'x'; 10_000]).expect("written");
        let message = format!("{:#}", open(&path).expect_err("too long"));
        assert!(
            message.contains("is 10000 bytes long, not a high-water file"),
            "{message}"
        );
        std::fs::write(&path, b"hello\n").expect("written");
        let message = format!("{:#}", open(&path).expect_err("not a mark"));
        assert!(
            message.contains("holds no readable high-water mark"),
            "{message}"
        );
        let missing = path.with_file_name("no-such-dir").join("ids.mark");
        let message = format!("{:#}", open(&missing).expect_err("no directory"));
        assert!(message.contains("opening the high-water file"), "{message}");
    }

    #[test]
    fn a_mark_more_than_a_day_ahead_is_refused() {
        let day = FURTHEST_AHEAD.as_millis() as u64;
        let at_limit = file_of(&record(NOW + day), &record(NOW + day));
        assert_eq!(read_mark(&at_limit, NOW), Ok(Some(NOW + day)));
        let past = file_of(&record(NOW + day + 1), &record(NOW));
        let problem = read_mark(&past, NOW).expect_err("too far ahead");
        assert!(
            problem.contains("more than a day past this host's clock"),
            "{problem}"
        );
        assert!(problem.contains("2026-12-06T05:32:08.440Z"), "{problem}");
    }
}
