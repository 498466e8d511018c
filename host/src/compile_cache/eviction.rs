//! Which builds the cache keeps: the [`KEPT_BUILDS`] used last (by the
//! time they were last stored or read), and no temporary file a store that
//! died left behind. Only regular files with the cache's own names are ever
//! removed.

use std::time::{Duration, SystemTime};

use rustix::fs::{AtFlags, FileType, FlockOperation, Mode, OFlags};

use super::{names, CompileCache, KEPT_BUILDS};

/// A temporary file this old is a store that died, not one under way,
/// whatever its lock: the rule for filesystems without locks.
const ABANDONED_AFTER: Duration = Duration::from_secs(3600);

/// A temporary file that nobody holds locked is a store that died once it
/// is this old: a store creates its file, then locks it, so a younger one
/// may be a store between the two.
const UNLOCKED_AFTER: Duration = Duration::from_secs(10);

impl CompileCache {
    /// Removes the builds used least recently (by the time they were last
    /// stored or read), so that at most [`KEPT_BUILDS`] remain, `room_for`'s
    /// among them when a build is about to be stored; and temporary files
    /// that a store that died left behind: those no store holds locked,
    /// and any over an hour old. Only regular files with the cache's own
    /// names are removed. Each failure is a warning, and the rest goes on.
    pub(super) fn evict(&self, room_for: Option<&str>) {
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
            if !(build || temporary) || Some(name.as_str()) == room_for {
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
            let age = used.elapsed().unwrap_or_default();
            if build {
                builds.push((used, name));
            } else if age > ABANDONED_AFTER {
                self.remove(&name, "an abandoned temporary file");
            } else if age > UNLOCKED_AFTER {
                // Removed while locked here, so that no store can take it.
                if let Some(_locked) = self.lock_abandoned(&name) {
                    self.remove(&name, "a temporary file that a store that died left behind");
                }
            }
        }
        builds.sort_by_key(|(used, _)| std::cmp::Reverse(*used));
        let kept = KEPT_BUILDS - usize::from(room_for.is_some());
        for (_, name) in builds.into_iter().skip(kept) {
            self.remove(
                &name,
                &format!("an old build (the {KEPT_BUILDS} used last are kept)"),
            );
        }
    }

    /// The temporary file `name`, locked, if no store holds it locked.
    fn lock_abandoned(&self, name: &str) -> Option<std::os::fd::OwnedFd> {
        let file = rustix::fs::openat(
            &self.dir,
            name,
            OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .ok()?;
        rustix::fs::flock(&file, FlockOperation::NonBlockingLockExclusive).ok()?;
        Some(file)
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
        cache.evict(Some("none"));
        assert!(!moved.join(&old).exists() && !moved.join(&stale).exists());
        assert!(dir.join(&old).exists() && dir.join(&stale).exists());
        let _ = fs::remove_dir_all(&dir);
        let _ = fs::remove_dir_all(&moved);
    }

    /// A gateway killed while storing, at every start, leaves no pile of
    /// half-written builds: opening the cache removes them.
    #[test]
    fn opening_the_cache_removes_what_stores_that_died_left_behind() {
        let dir = scratch("died");
        fs::create_dir_all(&dir).expect("created");
        let build = format!("{}-{}.cwasm", "a".repeat(64), "b".repeat(16));
        let died = format!(".{build}.7-0-0.tmp");
        let file = fs::File::create(dir.join(&died)).expect("created");
        file.set_modified(SystemTime::now() - Duration::from_secs(60))
            .expect("dated");
        drop(file);
        let _cache = CompileCache::open(&dir).expect("opened");
        assert!(!dir.join(&died).exists(), "{died} is left");
        let _ = fs::remove_dir_all(&dir);
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
        let just_made = format!(".{}.3-0-0.tmp", build(97));
        let died = format!(".{}.4-0-0.tmp", build(96));
        touch(&left_behind, age(2 * 3600));
        touch(&just_made, age(1));
        touch(&died, age(60));
        // A slow store, a minute in: it holds its file locked.
        touch(&under_way, age(60));
        let store = fs::File::open(dir.join(&under_way)).expect("opened");
        rustix::fs::flock(&store, FlockOperation::NonBlockingLockExclusive).expect("locked");
        // Not the cache's: never removed, however old.
        let foreign = ["README", "module.cwasm", ".notes.tmp"];
        for name in foreign {
            touch(name, age(10 * 3600));
        }
        fs::create_dir(dir.join(build(50))).expect("a directory with a build's name");
        // The build about to be stored is counted among the 8.
        cache.evict(Some(&build(40)));
        drop(store);

        let mut left: Vec<String> = fs::read_dir(&dir)
            .expect("listed")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .collect();
        left.sort();
        let mut expected: Vec<String> = (0..KEPT_BUILDS as u64 - 1).map(build).collect();
        expected.extend([under_way, just_made, build(50)]);
        expected.extend(foreign.map(String::from));
        expected.sort();
        assert_eq!(left, expected);
        let _ = fs::remove_dir_all(&dir);
    }
}
