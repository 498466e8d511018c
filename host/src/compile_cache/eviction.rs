//! Which builds the cache keeps: the [`KEPT_BUILDS`] used last (by the
//! time they were last stored or read), and no temporary file a store that
//! died left behind. Only regular files with the cache's own names are ever
//! removed.

use std::time::{Duration, SystemTime};

use rustix::fs::{AtFlags, FileType};

use super::{names, CompileCache, KEPT_BUILDS};

/// A temporary file this old is a store that died, not one under way.
const ABANDONED_AFTER: Duration = Duration::from_secs(3600);

impl CompileCache {
    /// Removes the builds used least recently (by the time they were last
    /// stored or read), leaving room for `keep`'s, so that at most
    /// [`KEPT_BUILDS`] remain with it; and temporary files that a store that
    /// died left behind. Only regular files with the cache's own names are
    /// removed. Each failure is a warning, and the rest goes on.
    pub(super) fn evict(&self, keep: &str) {
        let entries = match rustix::fs::Dir::read_from(&self.dir) {
            Ok(entries) => entries,
            Err(e) => {
                tracing::warn!(dir = %self.path.display(), error = %e, "listing the compile cache failed");
                return;
            }
        };
        let mut builds = Vec::new();
        for entry in entries.flatten() {
            let Ok(name) = entry.file_name().to_str().map(str::to_owned) else {
                continue;
            };
            let (build, temporary) = (names::is_build(&name), names::is_temporary(&name));
            if !(build || temporary) || name == keep {
                continue;
            }
            let Ok(stat) = rustix::fs::statat(&self.dir, &*name, AtFlags::SYMLINK_NOFOLLOW) else {
                continue;
            };
            if FileType::from_raw_mode(stat.st_mode) != FileType::RegularFile {
                continue;
            }
            let used = SystemTime::UNIX_EPOCH
                + Duration::new(
                    u64::try_from(stat.st_mtime).unwrap_or(0),
                    u32::try_from(stat.st_mtime_nsec).unwrap_or(0),
                );
            if build {
                builds.push((used, name));
            } else if used.elapsed().is_ok_and(|age| age > ABANDONED_AFTER) {
                self.remove(&name, "an abandoned temporary file");
            }
        }
        builds.sort_by_key(|(used, _)| std::cmp::Reverse(*used));
        for (_, name) in builds.into_iter().skip(KEPT_BUILDS - 1) {
            self.remove(
                &name,
                &format!("an old build (the {KEPT_BUILDS} used last are kept)"),
            );
        }
    }

    /// Removes `name`, saying why.
    fn remove(&self, name: &str, why: &str) {
        match rustix::fs::unlinkat(&self.dir, name, AtFlags::empty()) {
            // Another gateway sharing the directory was first.
            Ok(()) | Err(rustix::io::Errno::NOENT) => {
                tracing::info!(file = %self.path.join(name).display(), "removed {why} from the compile cache")
            }
            Err(e) => tracing::warn!(
                file = %self.path.join(name).display(),
                error = %e,
                "removing {why} from the compile cache failed"
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::fs;

    use super::super::tests::scratch;
    use super::*;

    #[test]
    fn the_directory_opened_is_used_whatever_its_path_names_later() {
        let dir = scratch("moved");
        let cache = CompileCache::open(&dir).expect("opened");
        // The path now names another directory; the cache still lists and
        // removes in the one it opened.
        let moved = dir.with_extension("moved");
        let _ = fs::remove_dir_all(&moved);
        fs::rename(&dir, &moved).expect("moved");
        fs::create_dir_all(&dir).expect("a new directory at the old path");
        let old = format!("{}-{}.cwasm", "a".repeat(64), "b".repeat(16));
        let stale = format!("{}-{}.cwasm", "c".repeat(64), "b".repeat(16));
        for (i, name) in [&stale, &old].iter().enumerate() {
            for place in [&dir, &moved] {
                let file = fs::File::create(place.join(name)).expect("created");
                let at = SystemTime::now() - Duration::from_secs(60 * (i as u64 + 1));
                file.set_modified(at).expect("dated");
            }
        }
        for n in 0..KEPT_BUILDS {
            let name = format!(
                "{}-{}.cwasm",
                format!("{n:x}").repeat(64)[..64].to_owned(),
                "d".repeat(16)
            );
            fs::File::create(moved.join(name)).expect("created");
        }
        cache.evict("none");
        assert!(!moved.join(&old).exists() && !moved.join(&stale).exists());
        assert!(dir.join(&old).exists() && dir.join(&stale).exists());
        let _ = fs::remove_dir_all(&dir);
        let _ = fs::remove_dir_all(&moved);
    }

    #[test]
    fn only_the_builds_used_last_are_kept_and_abandoned_stores_go() {
        let dir = scratch("evict");
        let cache = CompileCache::open(&dir).expect("opened");
        let now = SystemTime::now();
        let age = |secs: u64| now - Duration::from_secs(secs);
        let touch = |name: &str, at: SystemTime| {
            let file = fs::File::create(dir.join(name)).expect("created");
            file.set_modified(at).expect("dated");
        };
        let build = |n: u64| format!("{}-{}.cwasm", format!("{n:02}").repeat(32), "e".repeat(16));
        // Build n was last used n minutes ago.
        for n in 0..KEPT_BUILDS as u64 + 3 {
            touch(&build(n), age(60 * n));
        }
        let left_behind = format!(".{}.1-0-0.tmp", build(99));
        let under_way = format!(".{}.2-0-0.tmp", build(98));
        touch(&left_behind, age(2 * 3600));
        touch(&under_way, age(1));
        // Not the cache's: never removed, however old.
        let foreign = ["README", "module.cwasm", ".notes.tmp"];
        for name in foreign {
            touch(name, age(10 * 3600));
        }
        fs::create_dir(dir.join(build(50))).expect("a directory with a build's name");
        // The build about to be stored is counted among the 8.
        cache.evict(&build(40));

        let mut left: Vec<String> = fs::read_dir(&dir)
            .expect("listed")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .collect();
        left.sort();
        let mut expected: Vec<String> = (0..KEPT_BUILDS as u64 - 1).map(build).collect();
        expected.extend([under_way, build(50)]);
        expected.extend(foreign.map(String::from));
        expected.sort();
        assert_eq!(left, expected);
        let _ = fs::remove_dir_all(&dir);
    }
}
