//! Who chooses where the cache is: every symbolic link on the way to the
//! cache directory (the last part of the path, a part before it, and each
//! link a link leads to) must belong to snowgate's user or root. Another
//! user's link could point the cache at a directory of snowgate's user that
//! was never meant to hold code to run.

use std::fs;
use std::os::unix::fs::MetadataExt as _;
use std::path::{Component, Path, PathBuf};

use anyhow::Context as _;

/// Links followed before giving up, as the kernel does (`ELOOP`).
const MAX_LINKS: usize = 40;

/// Checks the links on the way to `path`.
pub(super) fn check(path: &Path) -> anyhow::Result<()> {
    let mut followed = 0;
    check_from(path, &mut followed)
}

fn check_from(path: &Path, followed: &mut usize) -> anyhow::Result<()> {
    // Part by part, without the trailing `/` or `.` that would make
    // `lstat` follow a link at the end.
    let mut walked = PathBuf::new();
    for part in path.components() {
        match part {
            Component::CurDir => continue,
            Component::ParentDir if walked.as_os_str().is_empty() => {
                walked.push("..");
                continue;
            }
            Component::ParentDir => {
                // `..` after a link is the link target's parent: resolve
                // what has been walked so far, its links already checked.
                walked = fs::canonicalize(&walked)
                    .with_context(|| format!("resolving {}", walked.display()))?;
                walked.pop();
                continue;
            }
            other => walked.push(other),
        }
        let Ok(metadata) = fs::symlink_metadata(&walked) else {
            // Missing: it is created as a directory, not a link.
            continue;
        };
        if !metadata.file_type().is_symlink() {
            continue;
        }
        ours_or_roots(&walked, &metadata)?;
        *followed += 1;
        anyhow::ensure!(
            *followed <= MAX_LINKS,
            "more than {MAX_LINKS} symbolic links on the way to {}",
            path.display()
        );
        let target = fs::read_link(&walked)
            .with_context(|| format!("reading the symbolic link {}", walked.display()))?;
        let target = match walked.parent() {
            Some(parent) if target.is_relative() => parent.join(target),
            _ => target,
        };
        check_from(&target, followed)?;
        walked = target;
    }
    Ok(())
}

/// Refuses the symbolic link `link`, whose own metadata (`lstat`'s) is
/// `metadata`, where it belongs to another user than snowgate's or root.
pub(super) fn ours_or_roots(link: &Path, metadata: &fs::Metadata) -> anyhow::Result<()> {
    let me = rustix::process::geteuid().as_raw();
    anyhow::ensure!(
        metadata.uid() == me || metadata.uid() == 0,
        "{} is a symbolic link that belongs to user {}: only snowgate's user or root may \
         choose where the cache is",
        link.display(),
        metadata.uid()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn links_of_this_user_are_followed_and_checked_all_the_way() {
        let dir = std::env::temp_dir().join(format!("snowgate-links-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(dir.join("real/cache")).expect("created");
        std::os::unix::fs::symlink("real", dir.join("to-real")).expect("a link");
        std::os::unix::fs::symlink(dir.join("to-real"), dir.join("to-link")).expect("a link");
        for path in [
            dir.join("to-link/cache"),
            dir.join("to-link/cache/"),
            dir.join("to-real/./cache/."),
            dir.join("to-real/../real/cache"),
        ] {
            check(&path).unwrap_or_else(|e| panic!("{}: {e:#}", path.display()));
        }
        // Another user's link, last, in the middle, or after a trailing
        // slash (only root may give a link away: elsewhere, say so).
        std::os::unix::fs::symlink("real", dir.join("theirs")).expect("a link");
        match std::os::unix::fs::lchown(dir.join("theirs"), Some(12345), None) {
            Ok(()) => {
                for path in [
                    dir.join("theirs"),
                    dir.join("theirs/"),
                    dir.join("theirs/cache"),
                ] {
                    let error = format!("{:#}", check(&path).expect_err("another user's"));
                    assert!(error.contains("belongs to user 12345"), "{error}");
                }
                std::os::unix::fs::symlink(dir.join("theirs"), dir.join("mine")).expect("a link");
                let error = format!("{:#}", check(&dir.join("mine")).expect_err("a chain"));
                assert!(error.contains("belongs to user 12345"), "{error}");
            }
            Err(e) => eprintln!("not root ({e}): another user's link is not tried"),
        }
        std::os::unix::fs::symlink("loop-b", dir.join("loop-a")).expect("a link");
        std::os::unix::fs::symlink("loop-a", dir.join("loop-b")).expect("a link");
        let error = format!("{:#}", check(&dir.join("loop-a")).expect_err("a loop"));
        assert!(error.contains("more than 40 symbolic links"), "{error}");
        let _ = fs::remove_dir_all(&dir);
    }
}
