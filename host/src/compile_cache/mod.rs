//! Compiled plugins kept on disk, so that a restart, or a reload back to a
//! build served before, skips compiling: a plugin written in Python or
//! JavaScript takes 5 to 17 s of both CPUs to compile.
//!
//! A cached file is machine code that wasmtime runs without checking it,
//! so the cache trusts its directory exactly as much as the `snowgate`
//! binary. The directory is opened once, when the cache is opened, and
//! every file is then opened, created, renamed and removed relative to that
//! open directory, never by path: whatever later happens to the path (a
//! parent directory others may write to, a symbolic link changed) cannot
//! put another directory in its place. The directory and every file read
//! must belong to the user snowgate runs as and be writable by no one else
//! (checked on what was opened, not on a path), a file must be a regular
//! file with one name, and every symbolic link on the way to the directory
//! must be that user's or root's (see `links`).
//!
//! Files are named by the SHA-256 of the component and of the engine's
//! compilation settings (wasmtime's version, the CPU features, the memory
//! layout the code assumes), so a build for another engine is never read
//! (see `names`). Each is written under a name of its own, then renamed
//! into place, so a reader never sees half a file; and ends with the
//! SHA-256 of the build and of its component (see `trailer`), checked
//! before wasmtime sees it, so a damaged or misnamed file is compiled again
//! instead of crashing the gateway. A build is read into memory, not
//! mapped, so its file may then change or go. Only builds the caller
//! accepted are stored ([`Plugin::keep_compiled`]), and only the
//! [`KEPT_BUILDS`] used last are kept (see `eviction`).
//!
//! [`Plugin::keep_compiled`]: crate::Plugin::keep_compiled

mod eviction;
mod links;
mod names;
mod trailer;

use std::fs;
use std::io::{Read as _, Write as _};
use std::os::fd::OwnedFd;
use std::os::unix::fs::{DirBuilderExt as _, MetadataExt as _};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::SystemTime;

use anyhow::Context as _;
use rustix::fs::{AtFlags, FileType, Mode, OFlags};
use wasmtime::component::Component;
use wasmtime::Engine;

/// How many builds the cache keeps: the ones used last.
pub const KEPT_BUILDS: usize = 8;

/// The largest file read as a build: far above any build of a plugin the
/// gateway accepts (at most 128 MiB of component), and far below what would
/// exhaust memory if a file were huge by mistake.
const MAX_BUILD_BYTES: u64 = 1 << 30;

/// A directory of compiled plugins.
#[derive(Debug)]
pub struct CompileCache {
    /// The path it was opened by, for messages.
    path: PathBuf,
    /// The directory, opened once: every file operation is relative to it.
    dir: OwnedFd,
    /// Whether the path was found to name another directory since, and
    /// said so.
    moved_warned: AtomicBool,
}

/// Where a loaded plugin's compiled code came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compiled {
    /// Compiled at load time (no cache, or the cache had no usable build).
    Now = 0,
    /// Read from the compile cache.
    FromCache = 1,
}

impl Compiled {
    /// `"now"` or `"cache"`, as `/status` reports it.
    pub fn name(self) -> &'static str {
        match self {
            Compiled::Now => "now",
            Compiled::FromCache => "cache",
        }
    }
}

impl CompileCache {
    /// Opens `path`, creating it (mode 0700) if it is missing. Refused when
    /// it is not a directory, when it or (if it is one) its symbolic link
    /// belongs to another user, or when others may write to it.
    pub fn open(path: &Path) -> anyhow::Result<CompileCache> {
        let what = || format!("the plugin compile cache {}", path.display());
        links::check(path).with_context(what)?;
        let dir = open_or_make(path).map_err(|e| match e {
            Opened::NotADirectory => anyhow::anyhow!("{} is not a directory", what()),
            Opened::Failed(e) => e.context(what()),
        })?;
        let cache = CompileCache {
            path: path.to_path_buf(),
            dir,
            moved_warned: AtomicBool::new(false),
        };
        cache.check_directory().with_context(|| {
            format!(
                "{}: give snowgate a directory of its own, or name one that does not exist yet, \
                 which it creates mode 0700 (a volume mounted writable by all, such as a \
                 Kubernetes emptyDir, stays so: name a directory inside it)",
                what()
            )
        })?;
        // What stores that died left behind goes now, not only at the
        // next store: a gateway killed while storing, again and again,
        // would otherwise leave a build's worth of disk at every start.
        cache.evict(None);
        Ok(cache)
    }

    /// The build of the component whose hex SHA-256 is `sha256` for
    /// `engine`, if the cache holds a usable one (a build of another
    /// wasmtime or other settings has another name, and is never read). One
    /// that is unusable (damaged, misnamed, writable by others) is a warning
    /// and `None`: the caller compiles, and [`store`](Self::store) replaces
    /// it. A build the engine refuses for its limits (a memory that starts
    /// larger than the limit) is the error `refused` makes of it: compiling
    /// again would be refused the same way.
    pub(crate) fn lookup(
        &self,
        engine: &Engine,
        sha256: &str,
        refused: impl FnOnce(wasmtime::Error) -> anyhow::Error,
    ) -> anyhow::Result<Option<Component>> {
        let name = names::build(engine, sha256);
        match self.read(engine, sha256, &name) {
            Ok(Some(component)) => {
                tracing::debug!(file = %self.path.join(&name).display(), "plugin read from the compile cache");
                Ok(Some(component))
            }
            Ok(None) => Ok(None),
            Err(Unusable::ByTheEngine(e)) if is_over_the_limits(&e) => Err(refused(e)),
            Err(Unusable::Directory(e)) => {
                tracing::warn!(
                    dir = %self.path.display(),
                    error = %format!("{e:#}"),
                    "the compile cache directory can no longer be used; compiling the plugin"
                );
                Ok(None)
            }
            Err(e) => {
                let e = anyhow::Error::from(e);
                tracing::warn!(
                    file = %self.path.join(&name).display(),
                    error = %format!("{e:#}"),
                    "the compile cache's build of the plugin is unusable; compiling it again"
                );
                Ok(None)
            }
        }
    }

    /// Stores `component`, the build of the component whose hex SHA-256 is
    /// `sha256`, after removing all but the builds used last, so that the
    /// directory holds at most [`KEPT_BUILDS`]. Failing is a warning: the
    /// cache is only a shortcut.
    pub(crate) fn store(&self, engine: &Engine, sha256: &str, component: &Component) {
        let name = names::build(engine, sha256);
        if let Err(e) = self.check_directory() {
            tracing::warn!(
                dir = %self.path.display(),
                error = %format!("{e:#}"),
                "the compiled plugin was not stored: the compile cache directory can no longer be used"
            );
            return;
        }
        // First, so that a full disk has room for the newest build.
        self.evict(Some(&name));
        match self.write(component, sha256, &name) {
            Ok(()) => {
                tracing::debug!(file = %self.path.join(&name).display(), "plugin compiled and stored in the compile cache")
            }
            Err(e) => tracing::warn!(
                file = %self.path.join(&name).display(),
                error = %format!("{e:#}"),
                "the compiled plugin could not be stored in the compile cache"
            ),
        }
    }

    /// Refuses the open directory if it has been removed, or opened up to
    /// others, since; and says once if its path now names another one.
    fn check_directory(&self) -> anyhow::Result<()> {
        let stat = rustix::fs::fstat(&self.dir)
            .map_err(std::io::Error::from)
            .context("the cache directory")?;
        anyhow::ensure!(
            stat.st_nlink > 0,
            "the cache directory opened at start was removed; restart snowgate to use {} again",
            self.path.display()
        );
        only_ours(stat.st_uid, stat.st_mode).context("the cache directory")?;
        let same = fs::metadata(&self.path)
            .is_ok_and(|now| now.dev() == stat.st_dev && now.ino() == stat.st_ino);
        if !same && !self.moved_warned.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                dir = %self.path.display(),
                "the path no longer names the compile cache directory opened at start (it was \
                 moved or replaced); the cache keeps using the directory it opened: restart \
                 snowgate to use the new one"
            );
        }
        Ok(())
    }

    /// The cached build `name` of the component whose hex SHA-256 is
    /// `sha256`; `None` when there is none.
    fn read(
        &self,
        engine: &Engine,
        sha256: &str,
        name: &str,
    ) -> Result<Option<Component>, Unusable> {
        self.check_directory().map_err(Unusable::Directory)?;
        // O_NONBLOCK: a FIFO in its place cannot make the open wait.
        let file = match rustix::fs::openat(
            &self.dir,
            name,
            OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC,
            Mode::empty(),
        ) {
            Ok(file) => file,
            Err(rustix::io::Errno::NOENT) => return Ok(None),
            Err(rustix::io::Errno::ACCESS) => {
                return Err(anyhow::anyhow!(
                    "snowgate's user may not read it: it belongs to another user"
                )
                .into())
            }
            Err(rustix::io::Errno::LOOP) => {
                return Err(
                    anyhow::anyhow!("it is a symbolic link, not a file the cache wrote").into(),
                )
            }
            Err(e) => {
                return Err(anyhow::Error::from(std::io::Error::from(e))
                    .context("opening it")
                    .into())
            }
        };
        // The checks are of the file opened; and one name only, so that it
        // cannot be another user's link to a file of ours.
        let stat = rustix::fs::fstat(&file)
            .map_err(std::io::Error::from)
            .context("reading its metadata")?;
        if FileType::from_raw_mode(stat.st_mode) != FileType::RegularFile || stat.st_nlink != 1 {
            return Err(anyhow::anyhow!("it is not a regular file with one name").into());
        }
        only_ours(stat.st_uid, stat.st_mode)?;
        let size = u64::try_from(stat.st_size).unwrap_or(u64::MAX);
        if size > MAX_BUILD_BYTES {
            return Err(anyhow::anyhow!(
                "it is {size} bytes, more than any build ({MAX_BUILD_BYTES} bytes at most)"
            )
            .into());
        }
        let mut file = fs::File::from(file);
        let mut stored = Vec::with_capacity(size as usize);
        (&mut file)
            .take(MAX_BUILD_BYTES + 1)
            .read_to_end(&mut stored)
            .context("reading it")?;
        let build = trailer::checked(&stored, sha256)?;
        // SAFETY: `build` is wasmtime's own serialization of this component
        // for an engine with these settings: the file is named by them, was
        // written by this module with the trailer just verified (so it is
        // whole, undamaged, and of this component), and is a file with one
        // name in a directory that only this user can write, both checked
        // on what was opened. wasmtime checks its version and settings
        // again, and copies it into memory of its own, so later changes to
        // the file cannot reach it.
        let component =
            unsafe { Component::deserialize(engine, build) }.map_err(Unusable::ByTheEngine)?;
        // Used now: among the last to be removed (see `evict`).
        let _ = file.set_modified(SystemTime::now());
        Ok(Some(component))
    }

    /// Stores `component`, the build of the component whose hex SHA-256 is
    /// `sha256`, as `name`, with its trailer: written to a new file of a
    /// name no one else uses, synced, and renamed into place.
    fn write(&self, component: &Component, sha256: &str, name: &str) -> anyhow::Result<()> {
        let mut bytes = component
            .serialize()
            .map_err(anyhow::Error::from)
            .context("serializing the compiled plugin")?;
        bytes.extend_from_slice(&trailer::of(&bytes, sha256));
        // `read` refuses it: writing it would cost a write at every start.
        anyhow::ensure!(
            bytes.len() as u64 <= MAX_BUILD_BYTES,
            "the build is {} bytes, more than a build read back may be ({MAX_BUILD_BYTES} \
             bytes); not stored",
            bytes.len()
        );
        let temporary = names::temporary(name);
        let written = rustix::fs::openat(
            &self.dir,
            &*temporary,
            OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::from_raw_mode(0o600),
        )
        .map_err(std::io::Error::from)
        .and_then(|file| {
            // Locked while the store is under way, renamed included: a
            // temporary file nobody holds locked is a store that died (see
            // `evict`). Where the filesystem has no locks (NFS without its
            // lock service) none is held, and none can be taken to evict
            // it: it is left for the hour's rule.
            let _ = rustix::fs::flock(&file, rustix::fs::FlockOperation::LockExclusive);
            let mut file = fs::File::from(file);
            file.write_all(&bytes)?;
            file.sync_all()?;
            rustix::fs::renameat(&self.dir, &*temporary, &self.dir, name)?;
            Ok(())
        });
        if let Err(e) = written {
            let _ = rustix::fs::unlinkat(&self.dir, &*temporary, AtFlags::empty());
            return Err(anyhow::Error::from(e).context(format!("writing it (as {temporary})")));
        }
        // Stored; the rename's durability is a shortcut's, so a failure to
        // sync the directory only costs a compile after a crash.
        let _ = rustix::fs::fsync(&self.dir);
        Ok(())
    }
}

/// Why a cached build was not used.
enum Unusable {
    /// The directory can no longer be used.
    Directory(anyhow::Error),
    /// wasmtime refused it.
    ByTheEngine(wasmtime::Error),
    /// The file: missing checks, damage, or an I/O error.
    File(anyhow::Error),
}

impl From<anyhow::Error> for Unusable {
    fn from(e: anyhow::Error) -> Self {
        Unusable::File(e)
    }
}

impl From<Unusable> for anyhow::Error {
    fn from(e: Unusable) -> Self {
        match e {
            Unusable::ByTheEngine(e) => anyhow::Error::from(e).context("wasmtime refused it"),
            Unusable::File(e) | Unusable::Directory(e) => e,
        }
    }
}

/// Whether wasmtime refused a component for the engine's limits (the
/// instance pool's), not for its contents.
pub(crate) fn is_over_the_limits(e: &wasmtime::Error) -> bool {
    format!("{e:#}").contains("minimum byte size")
}

/// Why [`open_or_make`] gave no directory.
enum Opened {
    /// The path names something else.
    NotADirectory,
    /// Anything else, said.
    Failed(anyhow::Error),
}

/// The directory at `path`, opened, or made (mode 0700) and opened where
/// there is none, its links checked before (see [`links`]). What the
/// path's last part is, is read once, and the open holds to it: a link that
/// belongs to this user or root is followed (nobody else can replace it in
/// a directory with the sticky bit, as /tmp); anything else is opened
/// without following a link; where nothing is, the directory is made (see
/// [`make_and_open`]). Before, a link another user made in the moment
/// between the check of the links and the open, in a directory all may
/// write to, chose the directory opened: a review won that race 2 times in
/// 60.
fn open_or_make(path: &Path) -> Result<OwnedFd, Opened> {
    // Without a trailing `/` or `.`, which would have the last part
    // followed where it is a link.
    let path: PathBuf = path.components().collect();
    let flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC;
    let opened = |result: rustix::io::Result<OwnedFd>| {
        result.map_err(|e| match e {
            rustix::io::Errno::NOTDIR => Opened::NotADirectory,
            rustix::io::Errno::LOOP => Opened::Failed(anyhow::anyhow!(
                "it became a symbolic link while it was opened: another process is changing it"
            )),
            e => Opened::Failed(anyhow::Error::from(std::io::Error::from(e))),
        })
    };
    match fs::symlink_metadata(&path) {
        Ok(entry) if entry.file_type().is_symlink() => {
            links::ours_or_roots(&path, &entry).map_err(Opened::Failed)?;
            if fs::metadata(&path).is_err() {
                return Err(Opened::Failed(anyhow::anyhow!(
                    "it is a symbolic link to {}, which does not exist",
                    fs::read_link(&path).unwrap_or_default().display()
                )));
            }
            opened(rustix::fs::open(&path, flags, Mode::empty()))
        }
        Ok(_) => opened(rustix::fs::open(
            &path,
            flags | OFlags::NOFOLLOW,
            Mode::empty(),
        )),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            make_and_open(&path).map_err(Opened::Failed)
        }
        Err(e) => Err(Opened::Failed(anyhow::Error::from(e))),
    }
}

/// Makes the directory `path`, found missing (and its missing parents),
/// mode 0700, and opens it: made in its parent's open directory and opened
/// from there without following a link, so that what is opened is the
/// directory made. Whatever is at `path` by the time it is made (a link
/// another user made since it was found missing, another gateway's
/// directory) is refused.
fn make_and_open(path: &Path) -> anyhow::Result<OwnedFd> {
    let name = path
        .file_name()
        .with_context(|| format!("{} names no directory that could be made", path.display()))?;
    let parent = match path.parent() {
        Some(parent) if !parent.as_os_str().is_empty() => parent,
        _ => Path::new("."),
    };
    fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(parent)
        .with_context(|| format!("creating {}", parent.display()))?;
    let flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC;
    let parent_dir = rustix::fs::open(parent, flags, Mode::empty())
        .map_err(std::io::Error::from)
        .with_context(|| format!("opening {}", parent.display()))?;
    match rustix::fs::mkdirat(&parent_dir, name, Mode::from_raw_mode(0o700)) {
        Ok(()) => {}
        Err(rustix::io::Errno::EXIST) => {
            anyhow::bail!(
                "it appeared while it was being made (another process made it): start again"
            )
        }
        Err(e) => {
            return Err(std::io::Error::from(e))
                .with_context(|| format!("creating {}", path.display()))
        }
    }
    rustix::fs::openat(&parent_dir, name, flags | OFlags::NOFOLLOW, Mode::empty())
        .map_err(std::io::Error::from)
        .with_context(|| format!("opening {}, made", path.display()))
}

/// Refuses what belongs to another user (`uid`) or is writable by group or
/// others (`mode`).
fn only_ours(uid: u32, mode: u32) -> anyhow::Result<()> {
    let me = rustix::process::geteuid().as_raw();
    anyhow::ensure!(
        uid == me,
        "it belongs to user {uid}, not to user {me} that snowgate runs as; a cached build is run \
         unchecked, so only snowgate's own user may have written it"
    );
    anyhow::ensure!(
        mode & 0o022 == 0,
        "others may write to it (mode {:o}); a cached build is run unchecked, so only snowgate's \
         own user may write to it (chmod go-w)",
        mode & 0o7777
    );
    Ok(())
}

#[cfg(test)]
pub(super) mod tests {
    use std::os::unix::fs::PermissionsExt as _;

    use super::*;

    /// A path for a test's directory, empty.
    pub(in crate::compile_cache) fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "snowgate-compile-cache-{name}-{}",
            std::process::id()
        ));
        let _ = fs::remove_dir_all(&dir);
        dir
    }

    #[test]
    fn a_missing_directory_is_created_for_this_user_only() {
        let dir = scratch("create").join("nested");
        CompileCache::open(&dir).expect("created");
        let mode = fs::metadata(&dir).expect("exists").mode() & 0o777;
        assert_eq!(mode, 0o700);
        let _ = fs::remove_dir_all(dir.parent().expect("parent"));
    }

    /// A link another user makes at the path after its links were
    /// checked, in the moment before the directory is made or opened, is
    /// refused: it is there when the path's last part is read, and another
    /// user's, or it is there when the directory is made.
    #[test]
    fn a_link_made_at_the_path_before_it_is_made_or_opened_is_refused() {
        let root = scratch("raced");
        let victim = root.join("victim");
        fs::create_dir_all(&victim).expect("a directory of this user");
        let path = root.join("cache");
        std::os::unix::fs::symlink(&victim, &path).expect("a link");
        // Made after the path was found missing, before the making.
        let error = format!("{:#}", make_and_open(&path).expect_err("a link"));
        assert!(
            error.contains("appeared while it was being made"),
            "{error}"
        );
        // There when the last part is read.
        match std::os::unix::fs::lchown(&path, Some(12345), None) {
            Ok(()) => {
                let Err(Opened::Failed(error)) = open_or_make(&path) else {
                    panic!("opened through another user's link");
                };
                let error = format!("{error:#}");
                assert!(error.contains("belongs to user 12345"), "{error}");
            }
            Err(e) => eprintln!("not root ({e}): another user's link is not tried"),
        }
        // Made where nothing is: its parents too, each 0700.
        let made = root.join("a/b");
        make_and_open(&made).expect("made");
        for dir in [root.join("a"), made] {
            let mode = fs::metadata(&dir).expect("made").mode() & 0o777;
            assert_eq!(mode, 0o700, "{}", dir.display());
        }
        let _ = fs::remove_dir_all(&root);
    }

    #[test]
    fn a_directory_others_may_write_to_is_refused() {
        let dir = scratch("shared");
        fs::create_dir_all(&dir).expect("created");
        fs::set_permissions(&dir, fs::Permissions::from_mode(0o777)).expect("chmod");
        let error = format!("{:#}", CompileCache::open(&dir).expect_err("refused"));
        assert!(
            error.contains("others may write to it (mode 777)"),
            "{error}"
        );
        assert!(error.contains(&dir.display().to_string()), "{error}");
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_directory_changed_after_the_start_is_no_longer_used() {
        type Change = fn(&Path);
        let changes: [(&str, Change, &str); 2] = [
            (
                "opened-up",
                |dir| fs::set_permissions(dir, fs::Permissions::from_mode(0o777)).expect("chmod"),
                "others may write to it",
            ),
            (
                "removed",
                |dir| {
                    fs::remove_dir(dir).expect("removed");
                    fs::create_dir(dir).expect("another one at the path");
                },
                "was removed; restart snowgate",
            ),
        ];
        for (name, change, problem) in changes {
            let dir = scratch(name);
            let cache = CompileCache::open(&dir).expect("opened");
            cache.check_directory().expect("ours");
            change(&dir);
            let error = format!("{:#}", cache.check_directory().expect_err(name));
            assert!(error.contains(problem), "{name}: {error}");
            let _ = fs::remove_dir_all(&dir);
        }
    }

    #[test]
    fn a_link_to_nothing_is_named_as_such() {
        let link = scratch("dangling");
        std::os::unix::fs::symlink(scratch("nowhere"), &link).expect("a link");
        let error = format!("{:#}", CompileCache::open(&link).expect_err("dangling"));
        assert!(error.contains("is a symbolic link to"), "{error}");
        assert!(error.contains("which does not exist"), "{error}");
        let _ = fs::remove_file(&link);
    }

    #[test]
    fn a_file_in_place_of_the_directory_is_refused() {
        let dir = scratch("file");
        fs::write(&dir, b"x").expect("written");
        let error = format!("{:#}", CompileCache::open(&dir).expect_err("refused"));
        assert!(error.contains("is not a directory"), "{error}");
        let _ = fs::remove_file(&dir);
    }
}
