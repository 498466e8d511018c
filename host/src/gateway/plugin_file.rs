//! The plugin file on disk: read safely (a regular file, within a size
//! limit, without blocking on a FIFO, as the config file is too), and
//! fingerprinted, so that a change
//! is noticed however it was made (a rewrite, a rename, a symlink flipped,
//! the directory replaced).

use std::fs::{Metadata, OpenOptions};
use std::io::Read as _;
use std::os::unix::fs::{FileTypeExt as _, MetadataExt as _, OpenOptionsExt as _};
use std::path::Path;

/// The largest plugin file that is read; a larger one is refused before
/// any of it is read. Plugin components are kilobytes to a few megabytes.
pub const MAX_PLUGIN_FILE_BYTES: u64 = 128 << 20;

/// Reads the plugin file at `path` (following symlinks). Refuses anything
/// that is not a regular file (a FIFO would block the read until a writer
/// comes, a device could be endless) and anything over
/// [`MAX_PLUGIN_FILE_BYTES`], with a message that names the path.
pub fn read_plugin_file(path: &Path) -> anyhow::Result<Vec<u8>> {
    read_regular_file(path, "the plugin", MAX_PLUGIN_FILE_BYTES)
}

/// A file that could not be read, as opposed to one read and refused (not
/// a regular file, too large): the system's error may pass (an NFS server
/// away, a file being replaced). What was read, where and why is in the
/// message.
#[derive(Debug)]
pub struct ReadFailed {
    /// What was read, and where.
    reading: String,
    /// Why it could not be.
    error: std::io::Error,
}

impl ReadFailed {
    /// `reading` ("reading the plugin PATH") failed with `error`.
    pub fn new(reading: String, error: std::io::Error) -> ReadFailed {
        ReadFailed { reading, error }
    }

    /// Whether reading again may work: not for a file that is not there,
    /// which is read again once it is.
    pub fn may_pass(&self) -> bool {
        self.error.kind() != std::io::ErrorKind::NotFound
    }
}

impl std::fmt::Display for ReadFailed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.reading, self.error)
    }
}

impl std::error::Error for ReadFailed {}

/// Reads `path` (following symlinks), `what` it is in messages ("the
/// plugin"): only a regular file (a FIFO would block the read until a
/// writer comes, a device could be endless) of at most `limit` bytes,
/// refused otherwise with a message that names the path.
pub fn read_regular_file(path: &Path, what: &str, limit: u64) -> anyhow::Result<Vec<u8>> {
    let shown = path.display();
    let failed = |e: std::io::Error| {
        anyhow::Error::new(ReadFailed::new(format!("reading {what} {shown}"), e))
    };
    // Non-blocking: opening a FIFO for reading would wait for a writer.
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .map_err(failed)?;
    let metadata = file.metadata().map_err(failed)?;
    if !metadata.is_file() {
        anyhow::bail!(
            "reading {what} {shown}: it is {}, not a regular file",
            kind(&metadata)
        );
    }
    let too_big = |size: u64| {
        anyhow::anyhow!(
            "reading {what} {shown}: it is {size} bytes, over the {limit} byte limit for {what}"
        )
    };
    if metadata.len() > limit {
        return Err(too_big(metadata.len()));
    }
    let mut bytes = Vec::with_capacity(metadata.len() as usize);
    file.take(limit + 1)
        .read_to_end(&mut bytes)
        .map_err(failed)?;
    // It grew while it was read.
    if bytes.len() as u64 > limit {
        return Err(too_big(bytes.len() as u64));
    }
    whole(bytes, metadata.len()).map_err(failed)
}

/// `bytes`, read from a file that was `size` bytes long when opened, or,
/// where fewer or more came, an error that lets the read be tried again
/// (not [`NotFound`](std::io::ErrorKind::NotFound)): the file changed
/// while it was read (rewritten in place), or its file system answered
/// short. Taken as it came, such a read was a build refused for good
/// (`may_pass` false) and not read again until the file changed (a
/// review's short read, by `strace`, of a valid build).
fn whole(bytes: Vec<u8>, size: u64) -> std::io::Result<Vec<u8>> {
    if bytes.len() as u64 == size {
        return Ok(bytes);
    }
    Err(std::io::Error::other(format!(
        "it was {size} bytes long when opened, and {} bytes were read: it changed while it was read, or its file system answered short",
        bytes.len()
    )))
}

/// What kind of file `metadata` describes, for a message.
fn kind(metadata: &Metadata) -> &'static str {
    let kind = metadata.file_type();
    if kind.is_dir() {
        "a directory"
    } else if kind.is_fifo() {
        "a FIFO"
    } else if kind.is_socket() {
        "a socket"
    } else if kind.is_char_device() {
        "a character device"
    } else if kind.is_block_device() {
        "a block device"
    } else {
        "not a regular file"
    }
}

/// Which file is at the plugin path, and its state: device, inode, size,
/// and modification and change times (of the file a symlink leads to), or
/// the error that reading them gave. Two different fingerprints mean the
/// file may have changed; the reload then compares contents.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fingerprint {
    /// The file's identity and state.
    File {
        /// The device the file is on.
        dev: u64,
        /// The file's inode number on that device.
        ino: u64,
        /// Its size in bytes.
        size: u64,
        /// Its last modification, in nanoseconds since the Unix epoch.
        mtime_ns: i128,
        /// Its last status change (a rename or `chmod` too), in
        /// nanoseconds since the Unix epoch.
        ctime_ns: i128,
    },
    /// No file could be looked at (missing, no permission, ...).
    Unreadable(std::io::ErrorKind),
}

impl Fingerprint {
    /// The fingerprint of the file at `path` now.
    pub fn of(path: &Path) -> Fingerprint {
        match std::fs::metadata(path) {
            Ok(m) => Fingerprint::File {
                dev: m.dev(),
                ino: m.ino(),
                size: m.size(),
                mtime_ns: i128::from(m.mtime()) * 1_000_000_000 + i128::from(m.mtime_nsec()),
                ctime_ns: i128::from(m.ctime()) * 1_000_000_000 + i128::from(m.ctime_nsec()),
            },
            Err(e) => Fingerprint::Unreadable(e.kind()),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::fs::File;

    use super::*;

    /// A read that came short of (or past) the size the file had when
    /// opened is a failure that may pass, which the file watch tries
    /// again, naming both sizes; a whole read is the bytes.
    #[test]
    fn a_read_that_came_short_may_pass_and_names_both_sizes() {
        assert_eq!(whole(b"abc".to_vec(), 3).expect("whole"), b"abc");
        for (read, size) in [(&b""[..], 600_000), (&b"abc"[..], 2)] {
            let error = whole(read.to_vec(), size).expect_err("not whole");
            let failed = ReadFailed::new("reading the plugin p.wasm".to_string(), error);
            assert!(failed.may_pass());
            let message = failed.to_string();
            assert!(
                message.contains(&format!("{size} bytes long when opened"))
                    && message.contains(&format!("{} bytes were read", read.len())),
                "{message}"
            );
        }
    }

    fn temp_dir(name: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "snowgate-plugin-file-{name}-{}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("a temporary directory");
        dir
    }

    #[test]
    fn a_fifo_is_refused_at_once_instead_of_blocking() {
        let dir = temp_dir("fifo");
        let path = dir.join("plugin.wasm");
        let status = std::process::Command::new("mkfifo")
            .arg(&path)
            .status()
            .expect("mkfifo runs");
        assert!(status.success());
        let error = read_plugin_file(&path).expect_err("a FIFO").to_string();
        assert!(
            error.contains("it is a FIFO, not a regular file"),
            "{error}"
        );
        assert!(error.contains(&path.display().to_string()), "{error}");
        let error = read_plugin_file(&dir).expect_err("a directory").to_string();
        assert!(error.contains("it is a directory"), "{error}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_file_over_the_limit_is_refused_without_being_read() {
        let dir = temp_dir("big");
        let path = dir.join("plugin.wasm");
        // Sparse: no disk space, and reading it would take a while.
        let file = File::create(&path).expect("create");
        file.set_len(MAX_PLUGIN_FILE_BYTES + 1).expect("set_len");
        let error = read_plugin_file(&path).expect_err("too big").to_string();
        assert!(
            error.contains(&format!(
                "it is {} bytes, over the {MAX_PLUGIN_FILE_BYTES} byte limit",
                MAX_PLUGIN_FILE_BYTES + 1
            )),
            "{error}"
        );
        file.set_len(5).expect("set_len");
        assert_eq!(read_plugin_file(&path).expect("read"), vec![0; 5]);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_fingerprint_changes_with_the_file_behind_a_flipped_symlink() {
        let dir = temp_dir("fingerprint");
        std::fs::write(dir.join("a"), b"same").expect("write");
        std::fs::write(dir.join("b"), b"same").expect("write");
        let link = dir.join("plugin.wasm");
        std::os::unix::fs::symlink("a", &link).expect("symlink");
        let before = Fingerprint::of(&link);
        assert_eq!(Fingerprint::of(&link), before, "nothing changed");
        let flipped = dir.join("flipped");
        std::os::unix::fs::symlink("b", &flipped).expect("symlink");
        std::fs::rename(&flipped, &link).expect("flip");
        assert_ne!(Fingerprint::of(&link), before);
        std::fs::remove_file(&link).expect("remove");
        assert_eq!(
            Fingerprint::of(&link),
            Fingerprint::Unreadable(std::io::ErrorKind::NotFound)
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
