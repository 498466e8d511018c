//! The names of the cache's files: a build is
//! `<component sha256>-<engine settings sha256, 16 digits>.cwasm`, and a
//! store under way writes `.<that name>.<pid>-<count>-<nanos>.tmp`. Only
//! names of these two shapes are ever removed.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::SystemTime;

use sha2::{Digest, Sha256};
use wasmtime::Engine;

/// The file name of the build of the component whose hex SHA-256 is
/// `sha256`, for `engine`'s compile settings.
pub(super) fn build(engine: &Engine, sha256: &str) -> String {
    let mut settings = HashInto(Sha256::new());
    std::hash::Hash::hash(&engine.precompile_compatibility_hash(), &mut settings);
    let settings = hex(&settings.0.finalize()[..8]);
    format!("{sha256}-{settings}.cwasm")
}

/// A name for a new temporary file for the build `build`: unique among the
/// processes and threads that may share the directory (two containers may
/// both be PID 1).
pub(super) fn temporary(build: &str) -> String {
    static STORES: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!(
        ".{build}.{}-{}-{nanos}.tmp",
        std::process::id(),
        STORES.fetch_add(1, Ordering::Relaxed)
    )
}

/// Whether `name` is a build's file name.
pub(super) fn is_build(name: &str) -> bool {
    let Some(stem) = name.strip_suffix(".cwasm") else {
        return false;
    };
    let Some((component, settings)) = stem.split_once('-') else {
        return false;
    };
    is_hex(component, 64) && is_hex(settings, 16)
}

/// Whether `name` is a temporary file's name.
pub(super) fn is_temporary(name: &str) -> bool {
    let Some(inner) = name.strip_prefix('.').and_then(|n| n.strip_suffix(".tmp")) else {
        return false;
    };
    let Some((build, unique)) = inner.rsplit_once('.') else {
        return false;
    };
    let mut parts = unique.split('-');
    is_build(build)
        && (0..3).all(|_| {
            parts
                .next()
                .is_some_and(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()))
        })
        && parts.next().is_none()
}

fn is_hex(text: &str, digits: usize) -> bool {
    text.len() == digits
        && text
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
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

#[cfg(test)]
mod tests {
    use super::*;

    const BUILD: &str =
        "00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff-0123456789abcdef.cwasm";

    #[test]
    fn only_the_cache_s_own_names_are_recognised() {
        assert!(is_build(BUILD));
        let temporary = temporary(BUILD);
        assert!(is_temporary(&temporary), "{temporary}");
        assert_ne!(temporary, super::temporary(BUILD), "unique");
        for other in [
            "module.cwasm",
            &BUILD.replace('a', "A"),
            &BUILD.replace("-0123", "-123"),
            &BUILD.replace(".cwasm", ".wasm"),
            &format!("{BUILD}.tmp"),
            &format!(".{BUILD}.1-2.tmp"),
            &format!(".{BUILD}.1-2-x.tmp"),
            &format!(".{BUILD}.1-2-3-4.tmp"),
            ".notes.tmp",
        ] {
            assert!(!is_build(other) && !is_temporary(other), "{other}");
        }
    }
}
