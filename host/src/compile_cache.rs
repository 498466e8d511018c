//! Compiled plugins kept on disk, so that a restart, or a reload back to a
//! build served before, skips compiling: a plugin written in Python or
//! JavaScript takes 8 to 17 s of both CPUs to compile.
//!
//! A cached file is machine code that wasmtime maps and runs without
//! checking it, so the cache trusts its directory exactly as much as the
//! `snowgate` binary: the directory and every file read from it must belong
//! to the user snowgate runs as and be writable by no one else, or they are
//! refused. Files are keyed by the SHA-256 of the component and of the
//! engine's compilation settings (wasmtime's version, the CPU features, the
//! memory limits that shape the code), so a build for another engine is
//! never read; and written whole under a temporary name, then renamed, so
//! a reader never sees half a file.

use std::fs;
use std::io::Write as _;
use std::os::unix::fs::{DirBuilderExt as _, MetadataExt as _, OpenOptionsExt as _};
use std::path::{Path, PathBuf};

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

    /// The component `bytes` (whose hex SHA-256 is `sha256`) compiled for
    /// `engine`: read from the cache if it holds a usable build, otherwise
    /// compiled by `compile` and stored. A cache that cannot be read or
    /// written costs a compile and a warning, never the load.
    pub(crate) fn component(
        &self,
        engine: &Engine,
        sha256: &str,
        compile: impl FnOnce() -> anyhow::Result<Component>,
    ) -> anyhow::Result<(Component, Compiled)> {
        let path = self.path_for(engine, sha256);
        match self.read(engine, &path) {
            Ok(Some(component)) => {
                tracing::debug!(file = %path.display(), "plugin read from the compile cache");
                return Ok((component, Compiled::FromCache));
            }
            Ok(None) => {}
            Err(e) => tracing::warn!(
                file = %path.display(),
                error = %format!("{e:#}"),
                "the compile cache's build of the plugin is unusable; compiling it again"
            ),
        }
        let component = compile()?;
        match self.write(&component, &path) {
            Ok(()) => {
                tracing::debug!(file = %path.display(), "plugin compiled and stored in the compile cache")
            }
            Err(e) => {
                tracing::warn!(
                    file = %path.display(),
                    error = %format!("{e:#}"),
                    "the compiled plugin could not be stored in the compile cache"
                )
            }
        }
        Ok((component, Compiled::Now))
    }

    /// `DIR/<component sha256>-<engine settings sha256, 16 digits>.cwasm`.
    fn path_for(&self, engine: &Engine, sha256: &str) -> PathBuf {
        let mut settings = HashInto(Sha256::new());
        std::hash::Hash::hash(&engine.precompile_compatibility_hash(), &mut settings);
        let settings = hex(&settings.0.finalize()[..8]);
        self.dir.join(format!("{sha256}-{settings}.cwasm"))
    }

    /// The cached build at `path`; `None` when there is none.
    fn read(&self, engine: &Engine, path: &Path) -> anyhow::Result<Option<Component>> {
        let metadata = match fs::symlink_metadata(path) {
            Ok(metadata) => metadata,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e).context("reading its metadata"),
        };
        anyhow::ensure!(metadata.is_file(), "it is not a regular file");
        only_ours(&metadata)?;
        // SAFETY: the file is wasmtime's own serialization of a component
        // for an engine with these settings: it is named by them and was
        // written by this module, in a directory, and as a file, that only
        // this user can write (checked above). It is never changed in place
        // (files are replaced by rename), which `deserialize_file`'s mapping
        // of it requires. wasmtime checks its version and settings again.
        let component = unsafe { Component::deserialize_file(engine, path) }
            .map_err(anyhow::Error::from)
            .context("wasmtime refused it")?;
        Ok(Some(component))
    }

    /// Stores `component` at `path`: written under a temporary name, synced,
    /// and renamed into place.
    fn write(&self, component: &Component, path: &Path) -> anyhow::Result<()> {
        let bytes = component
            .serialize()
            .map_err(anyhow::Error::from)
            .context("serializing the compiled plugin")?;
        let temporary = path.with_extension(format!("{}.tmp", std::process::id()));
        let written = fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&temporary)
            .and_then(|mut file| {
                file.write_all(&bytes)?;
                file.sync_all()
            })
            .and_then(|()| fs::rename(&temporary, path));
        if written.is_err() {
            let _ = fs::remove_file(&temporary);
        }
        written.context("writing it")
    }
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

    #[test]
    fn a_file_in_place_of_the_directory_is_refused() {
        let dir = scratch("file");
        fs::write(&dir, b"x").expect("written");
        let error = format!("{:#}", CompileCache::open(&dir).expect_err("refused"));
        assert!(error.contains("is not a directory"), "{error}");
        let _ = fs::remove_file(&dir);
    }
}
