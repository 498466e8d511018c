//! Compiled plugins kept on disk, so that a restart, or a reload back to a
//! build served before, skips compiling: a plugin written in Python or
//! JavaScript takes 8 to 17 s of both CPUs to compile.
//!
//! A cached file is machine code that wasmtime runs without checking it,
//! so the cache trusts its directory exactly as much as the `snowgate`
//! binary: the directory and every file read from it must belong to the
//! user snowgate runs as and be writable by no one else, or they are
//! refused (the checks are made on the file opened, not on its path).
//!
//! Files are keyed by the SHA-256 of the component and of the engine's
//! compilation settings (wasmtime's version, the CPU features, the memory
//! layout the code assumes), so a build for another engine is never read.
//! Each is written under a name of its own, then renamed into place, so a
//! reader never sees half a file; and ends with the SHA-256 of the build
//! and of its component, checked before wasmtime sees it, so a damaged or
//! misnamed file is compiled again instead of crashing the gateway. A build
//! is read into memory, not mapped, so the file may then change or go.
//! Only builds the caller accepted are stored ([`Plugin::keep_compiled`]),
//! and only the [`KEPT_BUILDS`] used last are kept.
//!
//! [`Plugin::keep_compiled`]: crate::Plugin::keep_compiled

use std::fs;
use std::io::{Read as _, Write as _};
use std::os::unix::fs::{DirBuilderExt as _, MetadataExt as _, OpenOptionsExt as _};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::SystemTime;

use anyhow::Context as _;
use sha2::{Digest, Sha256};
use wasmtime::component::Component;
use wasmtime::Engine;

/// A directory of compiled plugins.
#[derive(Debug)]
pub struct CompileCache {
    dir: PathBuf,
}

/// Where a loaded plugin's compiled code came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compiled {
    /// Compiled at load time (no cache, or the cache had no usable build).
    Now,
    /// Read from the compile cache.
    FromCache,
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
    /// Opens `dir`, creating it (mode 0700) if it is missing. Refused when
    /// it is not a directory, belongs to another user, or others may write
    /// to it.
    pub fn open(dir: &Path) -> anyhow::Result<CompileCache> {
        let what = || format!("the plugin compile cache {}", dir.display());
        if !dir.exists() {
            fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(dir)
                .with_context(|| format!("creating {}", what()))?;
        }
        let metadata = fs::metadata(dir).with_context(what)?;
        anyhow::ensure!(metadata.is_dir(), "{} is not a directory", what());
        only_ours(&metadata).with_context(what)?;
        Ok(CompileCache {
            dir: dir.to_path_buf(),
        })
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The build of the component whose hex SHA-256 is `sha256` for
    /// `engine`, if the cache holds a usable one. One that is unusable
    /// (damaged, from another wasmtime, writable by others) is a warning
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
        let path = self.path_for(engine, sha256);
        match self.read(engine, sha256, &path) {
            Ok(Some(component)) => {
                tracing::debug!(file = %path.display(), "plugin read from the compile cache");
                Ok(Some(component))
            }
            Ok(None) => Ok(None),
            Err(Unusable::ByTheEngine(e)) if is_over_the_limits(&e) => Err(refused(e)),
            Err(e) => {
                let e = anyhow::Error::from(e);
                tracing::warn!(
                    file = %path.display(),
                    error = %format!("{e:#}"),
                    "the compile cache's build of the plugin is unusable; compiling it again"
                );
                Ok(None)
            }
        }
    }

    /// Stores `component`, the build of the component whose hex SHA-256 is
    /// `sha256`, then removes all but the [`KEPT_BUILDS`] builds used
    /// last. Failing is a warning: the cache is only a shortcut.
    pub(crate) fn store(&self, engine: &Engine, sha256: &str, component: &Component) {
        let path = self.path_for(engine, sha256);
        match self.write(component, sha256, &path) {
            Ok(()) => {
                tracing::debug!(file = %path.display(), "plugin compiled and stored in the compile cache")
            }
            Err(e) => tracing::warn!(
                file = %path.display(),
                error = %format!("{e:#}"),
                "the compiled plugin could not be stored in the compile cache"
            ),
        }
        if let Err(e) = self.evict() {
            tracing::warn!(
                dir = %self.dir.display(),
                error = %format!("{e:#}"),
                "removing old builds from the compile cache failed"
            );
        }
    }

    /// `DIR/<component sha256>-<engine settings sha256, 16 digits>.cwasm`.
    fn path_for(&self, engine: &Engine, sha256: &str) -> PathBuf {
        let mut settings = HashInto(Sha256::new());
        std::hash::Hash::hash(&engine.precompile_compatibility_hash(), &mut settings);
        let settings = hex(&settings.0.finalize()[..8]);
        self.dir.join(format!("{sha256}-{settings}.{EXTENSION}"))
    }

    /// The cached build at `path` of the component whose hex SHA-256 is
    /// `sha256`; `None` when there is none.
    fn read(
        &self,
        engine: &Engine,
        sha256: &str,
        path: &Path,
    ) -> Result<Option<Component>, Unusable> {
        // The directory may have been opened up since the start.
        only_ours(&fs::metadata(&self.dir).context("the cache directory")?)
            .context("the cache directory")?;
        let mut file = match fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW)
            .open(path)
        {
            Ok(file) => file,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            // O_NOFOLLOW fails a symbolic link with ELOOP.
            Err(e) if e.raw_os_error() == Some(libc::ELOOP) => {
                return Err(
                    anyhow::anyhow!("it is a symbolic link, not a file the cache wrote").into(),
                )
            }
            Err(e) => return Err(anyhow::Error::from(e).context("opening it").into()),
        };
        // The checks are of the file opened, not of whatever the path
        // names by now; and one name only, so that it cannot be another
        // user's link to a file of ours.
        let metadata = file.metadata().context("reading its metadata")?;
        if !metadata.is_file() || metadata.nlink() != 1 {
            return Err(anyhow::anyhow!("it is not a regular file with one name").into());
        }
        only_ours(&metadata)?;
        let mut stored = Vec::with_capacity(metadata.len() as usize);
        file.read_to_end(&mut stored).context("reading it")?;
        let build = checked(&stored, sha256)?;
        // SAFETY: `build` is wasmtime's own serialization of this component
        // for an engine with these settings: the file is named by them, was
        // written by this module with the checksum just verified (so it is
        // whole, undamaged, and of this component), and is a file, in a
        // directory, that only this user can write (checked above, on the
        // file opened). wasmtime checks its version and settings again, and
        // copies it into memory of its own, so later changes to the file
        // cannot reach it.
        let component =
            unsafe { Component::deserialize(engine, build) }.map_err(Unusable::ByTheEngine)?;
        // Used now: the last to be removed (see `evict`).
        let _ = file.set_modified(std::time::SystemTime::now());
        Ok(Some(component))
    }

    /// Stores `component`, the build of the component whose hex SHA-256 is
    /// `sha256`, at `path`, with its checksum: written to a new file of a
    /// name no one else uses, synced, and renamed into place.
    fn write(&self, component: &Component, sha256: &str, path: &Path) -> anyhow::Result<()> {
        static STORES: AtomicU64 = AtomicU64::new(0);
        let mut bytes = component
            .serialize()
            .map_err(anyhow::Error::from)
            .context("serializing the compiled plugin")?;
        let trailer = Trailer::of(&bytes, sha256);
        bytes.extend_from_slice(&trailer);
        // Unique among the processes and threads that may share the
        // directory (two containers may both be PID 1).
        let nanos = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let temporary = self.dir.join(format!(
            ".{}.{}-{}-{nanos}.{TEMPORARY}",
            path.file_name()
                .map_or_else(Default::default, |n| n.to_string_lossy()),
            std::process::id(),
            STORES.fetch_add(1, Ordering::Relaxed),
        ));
        let written = fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .custom_flags(libc::O_NOFOLLOW)
            .mode(0o600)
            .open(&temporary)
            .and_then(|mut file| {
                file.write_all(&bytes)?;
                file.sync_all()
            })
            .and_then(|()| fs::rename(&temporary, path))
            .and_then(|()| fs::File::open(&self.dir)?.sync_all());
        if written.is_err() {
            let _ = fs::remove_file(&temporary);
        }
        written.with_context(|| format!("writing it (through {})", temporary.display()))
    }

    /// Removes all but the [`KEPT_BUILDS`] builds used last (by the time
    /// they were last stored or read), and temporary files a store that
    /// died left behind.
    fn evict(&self) -> anyhow::Result<()> {
        let mut builds = Vec::new();
        for entry in fs::read_dir(&self.dir).context("listing it")? {
            let entry = entry.context("listing it")?;
            let path = entry.path();
            let used = entry.metadata().and_then(|m| m.modified()).ok();
            if path.extension().is_some_and(|e| e == EXTENSION) {
                builds.push((used, path));
            } else if path.extension().is_some_and(|e| e == TEMPORARY)
                && used.is_some_and(|t| t.elapsed().is_ok_and(|age| age > ABANDONED_AFTER))
            {
                let _ = fs::remove_file(&path);
            }
        }
        // Most recently used first; one whose time cannot be read goes
        // first to go.
        builds.sort_by_key(|(used, _)| std::cmp::Reverse(*used));
        for (_, path) in builds.into_iter().skip(KEPT_BUILDS) {
            fs::remove_file(&path).with_context(|| format!("removing {}", path.display()))?;
            tracing::debug!(file = %path.display(), "old build removed from the compile cache");
        }
        Ok(())
    }
}

/// Why a cached build was not used.
enum Unusable {
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
            Unusable::File(e) => e,
        }
    }
}

/// Whether wasmtime refused a component for the engine's limits (the
/// instance pool's), not for its contents.
pub(crate) fn is_over_the_limits(e: &wasmtime::Error) -> bool {
    format!("{e:#}").contains("minimum byte size")
}

/// What follows a build in its file: the SHA-256 of the build, the SHA-256
/// of the component it was compiled from, and [`MAGIC`].
struct Trailer;

impl Trailer {
    const LEN: usize = 32 + 32 + MAGIC.len();

    fn of(build: &[u8], sha256: &str) -> Vec<u8> {
        let mut trailer = Vec::with_capacity(Trailer::LEN);
        trailer.extend_from_slice(&Sha256::digest(build));
        trailer.extend_from_slice(&component_digest(sha256));
        trailer.extend_from_slice(MAGIC);
        trailer
    }
}

/// The hex SHA-256 `sha256` as its 32 bytes (zeros if it is not hex,
/// which matches no file).
fn component_digest(sha256: &str) -> [u8; 32] {
    let mut digest = [0; 32];
    for (i, byte) in digest.iter_mut().enumerate() {
        *byte = sha256
            .get(2 * i..2 * i + 2)
            .and_then(|h| u8::from_str_radix(h, 16).ok())
            .unwrap_or(0);
    }
    digest
}

/// How many builds the cache keeps: the ones used last.
pub const KEPT_BUILDS: usize = 8;

/// The extension of a build's file.
const EXTENSION: &str = "cwasm";

/// The end of every file the cache writes.
const MAGIC: &[u8; 16] = b"snowgate-cache-1";

/// The extension of a store's temporary file.
const TEMPORARY: &str = "tmp";

/// A temporary file this old is a store that died, not one under way.
const ABANDONED_AFTER: std::time::Duration = std::time::Duration::from_secs(3600);

/// The build in a cache file of the component whose hex SHA-256 is
/// `sha256`: its bytes, once the trailer shows them whole and of that
/// component.
fn checked<'a>(stored: &'a [u8], sha256: &str) -> anyhow::Result<&'a [u8]> {
    anyhow::ensure!(
        stored.len() > Trailer::LEN && stored.ends_with(MAGIC),
        "it is not a file the compile cache wrote (no checksum at its end)"
    );
    let (build, trailer) = stored.split_at(stored.len() - Trailer::LEN);
    anyhow::ensure!(
        Sha256::digest(build).as_slice() == &trailer[..32],
        "its checksum does not match: the file is damaged"
    );
    anyhow::ensure!(
        trailer[32..64] == component_digest(sha256),
        "it holds the build of another component"
    );
    Ok(build)
}

/// Refuses what belongs to another user or is writable by group or others.
fn only_ours(metadata: &fs::Metadata) -> anyhow::Result<()> {
    // SAFETY: geteuid has no preconditions and cannot fail.
    let me = unsafe { libc::geteuid() };
    anyhow::ensure!(
        metadata.uid() == me,
        "it belongs to user {}, not to user {me} that snowgate runs as; a cached build is run \
         unchecked, so only snowgate's own user may have written it",
        metadata.uid()
    );
    anyhow::ensure!(
        metadata.mode() & 0o022 == 0,
        "others may write to it (mode {:o}); a cached build is run unchecked, so only snowgate's \
         own user may write to it (chmod go-w)",
        metadata.mode() & 0o7777
    );
    Ok(())
}

/// Feeds a [`Hash`](std::hash::Hash) into SHA-256, so the digest is the same
/// in every process (a `Hasher` of the standard library's may not be).
struct HashInto(Sha256);

impl std::hash::Hasher for HashInto {
    fn write(&mut self, bytes: &[u8]) {
        self.0.update(bytes);
    }

    fn finish(&self) -> u64 {
        let digest = self.0.clone().finalize();
        u64::from_le_bytes(digest[..8].try_into().expect("8 bytes"))
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt as _;

    use super::*;

    fn scratch(name: &str) -> PathBuf {
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

    const SHA: &str = "00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff";

    #[test]
    fn a_build_is_read_back_only_whole_undamaged_and_under_its_own_component() {
        let build = b"\x7fELF and the rest of a compiled plugin".to_vec();
        let mut stored = build.clone();
        stored.extend_from_slice(&Trailer::of(&build, SHA));
        assert_eq!(checked(&stored, SHA).expect("whole"), &build[..]);

        let mut damaged = stored.clone();
        damaged[5] ^= 1;
        let error = checked(&damaged, SHA).expect_err("damaged").to_string();
        assert!(error.contains("checksum does not match"), "{error}");

        let other = SHA.replace("00", "11");
        let error = checked(&stored, &other).expect_err("misnamed").to_string();
        assert!(error.contains("another component"), "{error}");

        for cut in [&stored[..stored.len() - 1], &build[..], &[][..]] {
            let error = checked(cut, SHA).expect_err("cut").to_string();
            assert!(
                error.contains("not a file the compile cache wrote"),
                "{error}"
            );
        }
    }

    #[test]
    fn only_the_builds_used_last_are_kept_and_abandoned_stores_go() {
        let dir = scratch("evict");
        let cache = CompileCache::open(&dir).expect("opened");
        let now = SystemTime::now();
        let age = |secs: u64| now - std::time::Duration::from_secs(secs);
        let touch = |name: &str, at: SystemTime| {
            let file = fs::File::create(dir.join(name)).expect("created");
            file.set_modified(at).expect("dated");
        };
        // Build n was last used n minutes ago.
        for n in 0..KEPT_BUILDS as u64 + 3 {
            touch(&format!("build-{n:02}.{EXTENSION}"), age(60 * n));
        }
        touch(
            &format!(".left-{EXTENSION}.1-0-0.{TEMPORARY}"),
            age(2 * 3600),
        );
        touch(&format!(".going-{EXTENSION}.2-0-0.{TEMPORARY}"), age(1));
        touch("README", age(10 * 3600));
        cache.evict().expect("evicted");

        let mut left: Vec<String> = fs::read_dir(&dir)
            .expect("listed")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .collect();
        left.sort();
        let mut expected: Vec<String> = (0..KEPT_BUILDS)
            .map(|n| format!("build-{n:02}.{EXTENSION}"))
            .collect();
        expected.push(format!(".going-{EXTENSION}.2-0-0.{TEMPORARY}"));
        expected.push("README".into());
        expected.sort();
        assert_eq!(left, expected);
        let _ = fs::remove_dir_all(&dir);
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
