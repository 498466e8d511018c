//! The process's own metrics, under the names Prometheus's client libraries
//! give them (`process_*`), read from `/proc` when `/metrics` is scraped,
//! and the build's version: what an operator's dashboards and alerts
//! expect of any service (memory, file descriptors against their limit,
//! CPU time, restarts).

use std::fmt::Write as _;

/// The process metrics and `snowgate_build_info`, in Prometheus text
/// format. A value that cannot be read (no `/proc`) is left out, with its
/// family's help and type.
pub fn render() -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "# HELP snowgate_build_info The snowgate build serving (always 1).\n\
         # TYPE snowgate_build_info gauge\n\
         snowgate_build_info{{version=\"{}\"}} 1",
        env!("CARGO_PKG_VERSION")
    );
    let stat = ProcessStat::read();
    let page = page_size();
    family(
        &mut out,
        "process_cpu_seconds_total",
        "counter",
        "CPU time the process used, user and system, in seconds.",
        stat.as_ref().map(|s| s.cpu_seconds()),
    );
    family(
        &mut out,
        "process_resident_memory_bytes",
        "gauge",
        "Resident memory of the process, in bytes.",
        stat.as_ref()
            .and_then(|s| Some(s.rss_pages? as f64 * page?)),
    );
    family(
        &mut out,
        "process_virtual_memory_bytes",
        "gauge",
        "Virtual address space of the process, in bytes: mostly the plugin instance slots' reservations, about 4 GiB each (--plugin-instances), not memory.",
        stat.as_ref().map(|s| s.vsize_bytes as f64),
    );
    family(
        &mut out,
        "process_start_time_seconds",
        "gauge",
        "When the process started, in Unix seconds.",
        stat.as_ref().and_then(ProcessStat::start_time_seconds),
    );
    family(
        &mut out,
        "process_open_fds",
        "gauge",
        "File descriptors the process has open: client and upstream connections, listeners, files.",
        open_fds().map(|n| n as f64),
    );
    family(
        &mut out,
        "process_max_fds",
        "gauge",
        "The most file descriptors the process may open (its soft RLIMIT_NOFILE).",
        max_fds().map(|n| n as f64),
    );
    out
}

/// One family of one sample, `value` left out where it could not be read.
fn family(out: &mut String, name: &str, kind: &str, help: &str, value: Option<f64>) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {kind}");
    if let Some(value) = value {
        let _ = writeln!(out, "{name} {value}");
    }
}

/// What `/proc/self/stat` and `/proc/self/statm` say of the process.
#[derive(Debug, Clone, Copy, PartialEq)]
struct ProcessStat {
    /// User and system CPU time, in clock ticks.
    cpu_ticks: u64,
    /// When it started, in clock ticks after the machine booted.
    start_ticks: u64,
    /// Its virtual memory size, in bytes.
    vsize_bytes: u64,
    /// Its resident set, in pages.
    rss_pages: Option<u64>,
}

impl ProcessStat {
    fn read() -> Option<ProcessStat> {
        let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
        let statm = std::fs::read_to_string("/proc/self/statm").ok();
        ProcessStat::parse(&stat, statm.as_deref())
    }

    /// The fields of `stat` (`/proc/self/stat`) and `statm`. The command
    /// name, in parentheses, may hold spaces and parentheses itself: the
    /// fields are counted from the last `)`.
    fn parse(stat: &str, statm: Option<&str>) -> Option<ProcessStat> {
        let after_name = &stat[stat.rfind(')')? + 1..];
        // The fields after the name, from the third (state) on.
        let fields: Vec<&str> = after_name.split_whitespace().collect();
        let field = |n: usize| -> Option<u64> { fields.get(n - 3)?.parse().ok() };
        Some(ProcessStat {
            cpu_ticks: field(14)? + field(15)?,
            start_ticks: field(22)?,
            vsize_bytes: field(23)?,
            rss_pages: statm
                .and_then(|statm| statm.split_whitespace().nth(1))
                .and_then(|rss| rss.parse().ok()),
        })
    }

    fn cpu_seconds(&self) -> f64 {
        self.cpu_ticks as f64 / clock_ticks_per_second()
    }

    fn start_time_seconds(&self) -> Option<f64> {
        let stat = std::fs::read_to_string("/proc/stat").ok()?;
        let boot: u64 = stat
            .lines()
            .find_map(|line| line.strip_prefix("btime "))?
            .trim()
            .parse()
            .ok()?;
        Some(boot as f64 + self.start_ticks as f64 / clock_ticks_per_second())
    }
}

fn clock_ticks_per_second() -> f64 {
    // SAFETY: sysconf reads a constant of the system.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if ticks > 0 {
        ticks as f64
    } else {
        100.0
    }
}

fn page_size() -> Option<f64> {
    // SAFETY: sysconf reads a constant of the system.
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    (size > 0).then_some(size as f64)
}

fn open_fds() -> Option<usize> {
    Some(std::fs::read_dir("/proc/self/fd").ok()?.count())
}

fn max_fds() -> Option<u64> {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes the struct it is given.
    (unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } == 0).then_some(limit.rlim_cur)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A command name with spaces and parentheses does not shift the
    /// fields, which are counted from its last `)`.
    #[test]
    fn reads_the_fields_after_a_command_name_with_spaces_and_parentheses() {
        let stat = "1234 (snow gate) (x)) S 1 1234 1234 0 -1 4194560 100 0 0 0 \
                    250 50 0 0 20 0 9 0 777 4096000 300 18446744073709551615";
        let read = ProcessStat::parse(stat, Some("1000 300 50 1 0 200 0\n")).expect("parsed");
        assert_eq!(
            read,
            ProcessStat {
                cpu_ticks: 300,
                start_ticks: 777,
                vsize_bytes: 4_096_000,
                rss_pages: Some(300),
            }
        );
        assert_eq!(ProcessStat::parse("1234 (no fields)", None), None);
    }

    /// This process's own: CPU time used, memory resident, a start in the
    /// past, descriptors open within their limit; every family typed.
    #[test]
    fn renders_this_processs_own_metrics() {
        let text = render();
        let value = |name: &str| -> f64 {
            let line = text
                .lines()
                .find(|l| l.starts_with(&format!("{name} ")))
                .unwrap_or_else(|| panic!("{name} in {text}"));
            line.rsplit(' ').next().unwrap().parse().unwrap()
        };
        assert!(value("process_resident_memory_bytes") > 1e6, "{text}");
        assert!(value("process_virtual_memory_bytes") >= value("process_resident_memory_bytes"));
        let started = value("process_start_time_seconds");
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs_f64();
        assert!(
            started <= now + 1.0 && started > now - 86_400.0,
            "{started} {now}"
        );
        let open = value("process_open_fds");
        assert!(open >= 3.0 && open <= value("process_max_fds"), "{text}");
        assert!(value("process_cpu_seconds_total") >= 0.0);
        assert!(text.contains(&format!(
            "snowgate_build_info{{version=\"{}\"}} 1\n",
            env!("CARGO_PKG_VERSION")
        )));
        assert_eq!(text.matches("# TYPE ").count(), 7, "{text}");
    }
}
