//! Transparent huge pages off for the process, unless the operator asks
//! for them. Every command does this first thing; it matters for `serve`,
//! a process that runs for months.
//!
//! mimalloc reserves its heap as one 1 GiB arena and asks the kernel for
//! huge pages on it (`madvise(MADV_HUGEPAGE)`), which the kernel grants
//! under its `madvise` policy as under `always`
//! (`/sys/kernel/mm/transparent_hugepage/enabled`). The first touch of any
//! 2 MiB stretch of the arena then faults in a whole huge page, and
//! mimalloc gives memory back in pieces smaller than that, which a huge
//! page keeps resident until the kernel splits it. An idle gateway had
//! 103 MiB resident, 84 MiB of it huge pages (44 MiB with this), and under
//! load with 1000 reloads its RSS climbed from 81 to 147 MiB (with this: 43
//! to 76 MiB, then level). Requests cost no more CPU without them
//! (BENCHMARKS.md, "Reloads and memory"). Redis turns THP off for itself
//! for the same reason.
//!
//! `MIMALLOC_ALLOW_THP`, mimalloc's own switch, is honoured when set: `0`
//! turns THP off as this does, `1` keeps the kernel's policy.

/// mimalloc's environment variable for transparent huge pages.
pub const ALLOW_THP_VARIABLE: &str = "MIMALLOC_ALLOW_THP";

/// Turns transparent huge pages off for this process (Linux's
/// `PR_SET_THP_DISABLE`), unless [`ALLOW_THP_VARIABLE`] is set. Memory
/// already in huge pages stays; every later fault is of a small page. A
/// kernel that refuses (before Linux 3.15) leaves the policy as it was:
/// the error is for a warning, as THP costs memory, not correctness.
pub fn keep_to_small_pages() -> std::io::Result<()> {
    if std::env::var_os(ALLOW_THP_VARIABLE).is_some() {
        return Ok(());
    }
    #[cfg(target_os = "linux")]
    {
        // SAFETY: PR_SET_THP_DISABLE takes integer arguments only and
        // changes a flag of this process; no memory is passed.
        if unsafe { libc::prctl(libc::PR_SET_THP_DISABLE, 1, 0, 0, 0) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}
