//! Compiling a plugin in a child process, under limits of its own.
//!
//! Compiling is the one step of a load whose cost the plugin's author sets
//! and no call limit bounds: Cranelift's memory and time grow with the
//! component, and a large or pathological one (a huge function with
//! thousands of values alive at once) can need gigabytes and minutes of
//! both CPUs. In the gateway's own process that could get the gateway
//! killed for want of memory, or starve the requests it serves. So the
//! gateway hands the component to a child process (the `snowgate` binary
//! itself, `snowgate compile-plugin`), which compiles it with the same
//! compile settings as the engine ([`compile_config`](crate::engine)) at a
//! lower CPU priority, under an address-space limit and a CPU-time limit,
//! and writes the compiled build back; the gateway then loads that build
//! as it loads one from its [compile cache](crate::CompileCache). A child
//! that hits a limit dies alone, and the load fails with an error that
//! names the limit; the build serving before goes on serving.
//!
//! The build the child writes is machine code the gateway runs without
//! checks, so the child must be this same binary (the gateway starts
//! `/proc/self/exe`): it is trusted as the gateway's own code is. wasmtime
//! refuses a build made by another wasmtime version or with other compile
//! settings.

use std::ffi::OsString;
use std::io::{Read, Write};
use std::path::PathBuf;
use std::process::{Command, ExitStatus, Stdio};
use std::time::Duration;

use anyhow::Context as _;
use wasmtime::Engine;

use crate::text_limits::plugin_text;

/// The most of the child's stderr kept for an error message.
const MAX_CHILD_MESSAGE: usize = 16 << 10;

/// The exit status of a child that refused the component (not a valid
/// component for this host): its stderr says why.
pub const REFUSED_STATUS: i32 = 2;

/// The exit status of a child whose compile ran out of memory as an error
/// (a mapping refused), not as an abort: told by the child, which sees the
/// error's kind, not read from its words, which may quote the component's
/// own names.
pub const OUT_OF_MEMORY_STATUS: i32 = 3;

/// The exit status of a child that failed before it could compile, or
/// while writing the build (an I/O error): the same component may pass.
pub const FAILED_STATUS: i32 = 1;

/// The largest component the child reads: the gateway loads files of at
/// most 128 MiB.
const MAX_COMPONENT_BYTES: u64 = 1 << 30;

/// What the child compiling a plugin may use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CompileLimits {
    /// The most address space the child may map (`RLIMIT_AS`), its code,
    /// stacks and allocator's reservations included: a compile that needs
    /// more fails to allocate, and the child dies.
    pub memory_bytes: u64,
    /// The most CPU time the child may use, over all its threads
    /// (`RLIMIT_CPU`, whole seconds; at least 1).
    pub cpu: Duration,
}

impl Default for CompileLimits {
    /// 4 GiB of address space and 10 minutes of CPU. The bundled plugin
    /// compiles in about 75 ms of CPU and some 200 MiB; an 18 MB plugin
    /// written in Python in about 10 s of CPU and under 1 GiB.
    fn default() -> Self {
        CompileLimits {
            memory_bytes: 4 << 30,
            cpu: Duration::from_secs(600),
        }
    }
}

/// A program that compiles plugins as `snowgate compile-plugin` does (see
/// [`compile_for_parent`]), and the limits it runs under.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CompileProcess {
    /// The program to start, whose builds are run unchecked.
    program: PathBuf,
    /// Its arguments, e.g. `["compile-plugin"]`.
    args: Vec<OsString>,
    /// What it may use.
    pub limits: CompileLimits,
}

impl CompileProcess {
    /// The running binary (`/proc/self/exe`, which still leads to it if
    /// its file was replaced on disk since it started), run with `args`,
    /// which must make it answer as [`compile_for_parent`] does.
    pub fn this_binary(args: &[&str], limits: CompileLimits) -> CompileProcess {
        CompileProcess {
            program: PathBuf::from("/proc/self/exe"),
            args: args.iter().map(OsString::from).collect(),
            limits,
        }
    }

    /// Another program, run with `args`.
    ///
    /// # Safety
    ///
    /// What it writes is loaded as machine code and run unchecked: it must
    /// be a build of this same crate that answers as [`compile_for_parent`]
    /// does (a test's `CARGO_BIN_EXE_snowgate`, say), trusted as this
    /// process's own code is.
    pub unsafe fn of_program(
        program: impl Into<PathBuf>,
        args: &[&str],
        limits: CompileLimits,
    ) -> CompileProcess {
        CompileProcess {
            program: program.into(),
            args: args.iter().map(OsString::from).collect(),
            limits,
        }
    }

    /// The program it starts.
    pub fn program(&self) -> &std::path::Path {
        &self.program
    }

    /// Compiles `component` in the child and returns the compiled build,
    /// for [`Component::deserialize`](wasmtime::component::Component::deserialize).
    /// Blocks until the child ends.
    ///
    /// The error says which: the component was refused (the child's
    /// message), the compile needed more memory or CPU time than its limit,
    /// or the child could not be started or failed otherwise.
    pub fn compile(&self, component: &[u8]) -> Result<Vec<u8>, CompileFailure> {
        #[cfg(unix)]
        keep_children_for_waiting();
        let mut command = Command::new(&self.program);
        command
            .args(&self.args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        self.limit(&mut command);
        let mut child = command.spawn().map_err(|e| {
            CompileFailure::Other(format!(
                "starting the compile process {}: {e}",
                self.program.display()
            ))
        })?;
        // Written from another thread while this one reads the child's
        // output, so that neither side can wait on a full pipe; a scoped
        // one, which borrows the component rather than a copy of it. The
        // child reads everything before it writes; one that died early
        // closes its end, and the write's error is then the child's
        // status's.
        let mut stdin = child.stdin.take().expect("stdin is piped");
        let output = std::thread::scope(|scope| {
            let writer = std::thread::Builder::new()
                .name("snowgate-compile-input".into())
                .spawn_scoped(scope, move || {
                    let _ = stdin.write_all(component);
                });
            // Without the writer the child reads an empty component (its
            // stdin is closed) and fails; it is still waited for.
            let output = wait_with_cpu_time(child, self.wall_limit() + WATCHDOG_MARGIN);
            match writer {
                Ok(writer) => {
                    let _ = writer.join();
                    output.map_err(|e| format!("reading from the compile process: {e}"))
                }
                Err(e) => Err(format!("starting a thread: {e}")),
            }
        })
        .map_err(CompileFailure::Other)?;
        let Waited {
            output,
            cpu_used,
            overran,
        } = output;
        if output.status.success() {
            return Ok(output.stdout);
        }
        if overran {
            return Err(self.out_of_wall_time(cpu_used, true));
        }
        Err(self.failure(output.status, &output.stderr, cpu_used))
    }

    /// Sets the child's limits and priority, and ties its life to the
    /// thread that starts it: a gateway that dies mid-compile takes the
    /// child with it.
    fn limit(&self, command: &mut Command) {
        #[cfg(target_os = "linux")]
        {
            use std::os::unix::process::CommandExt as _;

            // Never above the gateway's own hard limits, which an
            // unprivileged process cannot raise (`ulimit -v` in its
            // service's unit): the lower of the two holds then.
            let within = |resource, soft: libc::rlim_t, hard: libc::rlim_t| {
                let mut current = libc::rlimit {
                    rlim_cur: 0,
                    rlim_max: libc::RLIM_INFINITY,
                };
                // SAFETY: getrlimit writes the struct it is given.
                if unsafe { libc::getrlimit(resource, &mut current) } != 0 {
                    current.rlim_max = libc::RLIM_INFINITY;
                }
                (soft.min(current.rlim_max), hard.min(current.rlim_max))
            };
            let memory = within(
                libc::RLIMIT_AS,
                self.limits.memory_bytes as libc::rlim_t,
                self.limits.memory_bytes as libc::rlim_t,
            );
            let seconds = self.limits.cpu.as_secs().max(1) as libc::rlim_t;
            // SIGXCPU at the limit, SIGKILL a second later.
            let cpu = within(libc::RLIMIT_CPU, seconds, seconds + 1);
            let wall = u32::try_from(self.wall_limit().as_secs()).unwrap_or(u32::MAX);
            let gateway = std::process::id() as libc::pid_t;
            // SAFETY: between fork and exec only async-signal-safe calls
            // (setrlimit, nice, signal, sigemptyset, sigaddset,
            // sigprocmask, alarm, prctl, getppid) are made, on plain
            // values, and nothing is allocated.
            unsafe {
                command.pre_exec(move || {
                    let set = |resource, soft, hard| {
                        let limit = libc::rlimit {
                            rlim_cur: soft,
                            rlim_max: hard,
                        };
                        if libc::setrlimit(resource, &limit) != 0 {
                            return Err(std::io::Error::last_os_error());
                        }
                        Ok(())
                    };
                    set(libc::RLIMIT_AS, memory.0, memory.1)?;
                    set(libc::RLIMIT_CPU, cpu.0, cpu.1)?;
                    // A child killed at its limit writes no core file of
                    // gigabytes.
                    set(libc::RLIMIT_CORE, 0, 0)?;
                    // The wall-clock bound: SIGALRM, whose default ends
                    // the process, and whose timer `exec` keeps. Its
                    // disposition and the signal mask pass through exec:
                    // one ignored or blocked by whoever started the
                    // gateway would keep the alarm from ending the child.
                    // So would SIGXCPU's keep the soft CPU limit from
                    // ending it: the hard limit's SIGKILL would, later,
                    // and look like the OOM killer's.
                    let mut ours = std::mem::zeroed::<libc::sigset_t>();
                    libc::sigemptyset(&mut ours);
                    for signal in [libc::SIGALRM, libc::SIGXCPU] {
                        libc::signal(signal, libc::SIG_DFL);
                        libc::sigaddset(&mut ours, signal);
                    }
                    libc::sigprocmask(libc::SIG_UNBLOCK, &ours, std::ptr::null_mut());
                    libc::alarm(wall);
                    // Requests first: the compile takes the CPU they leave,
                    // ten steps below the gateway's thread (not at nice 10,
                    // which was above a gateway started at 11 or more, for
                    // a gateway allowed to raise it).
                    libc::nice(10);
                    if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    // The gateway died before the line above: nobody waits.
                    if libc::getppid() != gateway {
                        return Err(std::io::Error::from_raw_os_error(libc::ESRCH));
                    }
                    Ok(())
                });
            }
        }
    }

    /// The longest a compile may take in wall-clock time: twice its CPU
    /// time, and at least [`MIN_WALL_LIMIT`]. A compile at a low priority
    /// on a saturated machine may get little CPU, and it holds the reload
    /// that waits on it; before, only its CPU time was bounded.
    fn wall_limit(&self) -> Duration {
        self.limits.cpu.saturating_mul(2).max(MIN_WALL_LIMIT)
    }

    /// The compile ran past [`wall_limit`](Self::wall_limit), having used
    /// `cpu_used`; `stopped`: the gateway killed it, its own alarm not
    /// having ended it.
    fn out_of_wall_time(&self, cpu_used: Duration, stopped: bool) -> CompileFailure {
        CompileFailure::OutOfWallTime {
            limit: self.wall_limit(),
            cpu_used,
            starved: cpu_used < self.limits.cpu / 2,
            stopped,
        }
    }

    /// What the child's end says: refused, a limit hit, or a failure;
    /// `cpu_used` is the CPU time it used.
    fn failure(&self, status: ExitStatus, stderr: &[u8], cpu_used: Duration) -> CompileFailure {
        let message = String::from_utf8_lossy(&stderr[..stderr.len().min(MAX_CHILD_MESSAGE)])
            .trim()
            .to_string();
        let signal = {
            #[cfg(unix)]
            {
                std::os::unix::process::ExitStatusExt::signal(&status)
            }
            #[cfg(not(unix))]
            {
                None::<i32>
            }
        };
        // Allocations fail once the address space is used up: Rust's
        // allocator then aborts with "memory allocation of N bytes failed"
        // (its words, with SIGABRT: a refusal's words, with its own status,
        // may quote the component's names, and are not read for it), and
        // the child tells a failed mapping by its status.
        #[cfg(unix)]
        let allocation_aborted =
            signal == Some(libc::SIGABRT) && message.contains("memory allocation of");
        #[cfg(not(unix))]
        let allocation_aborted = false;
        if allocation_aborted || status.code() == Some(OUT_OF_MEMORY_STATUS) {
            return CompileFailure::OutOfMemory {
                limit_bytes: self.limits.memory_bytes,
            };
        }
        // SIGKILL is the hard CPU limit's (a second past the soft one's
        // SIGXCPU), and also the kernel's out-of-memory killer's, or an
        // operator's: the CPU limit only where the child used it up.
        #[cfg(unix)]
        if signal == Some(libc::SIGXCPU)
            || (signal == Some(libc::SIGKILL) && cpu_used >= self.limits.cpu)
        {
            return CompileFailure::OutOfCpuTime {
                limit: self.limits.cpu,
                killed: signal == Some(libc::SIGKILL),
            };
        }
        #[cfg(unix)]
        if signal == Some(libc::SIGKILL) {
            return CompileFailure::Other(format!(
                "the compile process {} was killed (SIGKILL) after {:.1} s of CPU time, under its \
                 limit of {} s: the system's out-of-memory killer sends that signal, or an \
                 operator did",
                self.program.display(),
                cpu_used.as_secs_f64(),
                self.limits.cpu.as_secs().max(1)
            ));
        }
        #[cfg(unix)]
        if signal == Some(libc::SIGALRM) {
            return self.out_of_wall_time(cpu_used, false);
        }
        let crashed = crashed(status, &message);
        // The child's words quote the component's own (an invalid import
        // name, byte for byte) and span lines: written as one line, with
        // its control characters escaped, so a component cannot write
        // lines of its own into the gateway's log.
        let message = plugin_text(message, MAX_CHILD_MESSAGE);
        if status.code() == Some(REFUSED_STATUS) {
            return CompileFailure::Refused(message);
        }
        let told = format!(
            "the compile process {} {} ({status}){}",
            self.program.display(),
            if crashed { "crashed" } else { "failed" },
            if message.is_empty() {
                String::new()
            } else {
                format!(": {message}")
            }
        );
        if crashed {
            CompileFailure::Crashed(told)
        } else {
            CompileFailure::Other(told)
        }
    }
}

/// Why compiling in the child did not give a build.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CompileFailure {
    /// The component is not one this host can compile; the child's
    /// message.
    Refused(String),
    /// The compile needed more address space than the limit.
    OutOfMemory {
        /// The limit, in bytes.
        limit_bytes: u64,
    },
    /// The compile used the CPU time of the limit (`killed`: the child
    /// died by SIGKILL, the hard limit's signal, which the system's
    /// out-of-memory killer or an operator may also have sent).
    OutOfCpuTime {
        /// The limit.
        limit: Duration,
        /// Whether the child was killed rather than told to stop.
        killed: bool,
    },
    /// The compile ran past its wall-clock bound (twice its CPU time): the
    /// machine left it too little CPU, which may pass.
    OutOfWallTime {
        /// The bound.
        limit: Duration,
        /// The CPU time the compile used by then.
        cpu_used: Duration,
        /// Whether that was under half its CPU time: the machine starved
        /// it, which may pass. Otherwise the build's cost is most of it (a
        /// parallel compile on an idle machine reaches its CPU limit
        /// first), and it would run out again.
        starved: bool,
        /// Whether its own alarm did not end it, and the gateway killed it:
        /// it was stopped (SIGSTOP, a frozen cgroup), which may pass.
        stopped: bool,
    },
    /// The child could not be started, failed before compiling or while
    /// handing the build back (an I/O error), was ended by a signal from
    /// outside, or panicked for want of a resource of the moment; why.
    Other(String),
    /// The child crashed while compiling: a panic, or a death by a fault's
    /// signal (a stack overflow's abort, a segmentation fault). The same
    /// component would crash it again.
    Crashed(String),
}

impl std::fmt::Display for CompileFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CompileFailure::Refused(message) => write!(f, "{message}"),
            CompileFailure::OutOfMemory { limit_bytes } => write!(
                f,
                "compiling the plugin needed more than its {} MiB of address space \
                 (--plugin-compile-memory-mib): the component is too large or complex to compile \
                 within it",
                limit_bytes >> 20
            ),
            CompileFailure::OutOfCpuTime { limit, killed } => write!(
                f,
                "compiling the plugin {} its {} s of CPU time (--plugin-compile-cpu-secs){}",
                if *killed { "was killed at" } else { "used up" },
                limit.as_secs().max(1),
                if *killed {
                    ", or the system killed it for want of memory"
                } else {
                    ""
                }
            ),
            CompileFailure::OutOfWallTime {
                limit,
                cpu_used,
                starved,
                stopped,
            } => write!(
                f,
                "compiling the plugin took longer than {} s of wall-clock time (twice \
                 --plugin-compile-cpu-secs, at least {} s), having used {:.1} s of CPU time{}",
                limit.as_secs(),
                MIN_WALL_LIMIT.as_secs(),
                cpu_used.as_secs_f64(),
                if *stopped {
                    ": it did not end at its own alarm, which a stopped process (SIGSTOP, a \
                     frozen cgroup) does not take, and the gateway killed it"
                } else if *starved {
                    ": the machine left it too little CPU"
                } else {
                    ""
                }
            ),
            CompileFailure::Other(message) | CompileFailure::Crashed(message) => {
                write!(f, "{message}")
            }
        }
    }
}

impl std::error::Error for CompileFailure {}

impl CompileFailure {
    /// Whether the same component may compile at another time: the child
    /// could not start or failed on I/O, was killed by a SIGKILL the
    /// system's out-of-memory killer also sends, or ran out of wall-clock
    /// time starved of CPU. Not a refusal, a crash, nor a limit the
    /// component's own cost reaches.
    pub fn may_pass(&self) -> bool {
        match self {
            CompileFailure::Other(_) => true,
            CompileFailure::OutOfCpuTime { killed, .. } => *killed,
            CompileFailure::OutOfWallTime {
                starved, stopped, ..
            } => *starved || *stopped,
            CompileFailure::Refused(_)
            | CompileFailure::Crashed(_)
            | CompileFailure::OutOfMemory { .. } => false,
        }
    }
}

/// Whether the child crashed on the component, and would again: it
/// panicked (Rust's exit status 101), not for want of a thread or a
/// resource of the moment (EAGAIN), or died by a fault's signal (a stack
/// overflow's abort, a segmentation fault). Its own I/O failure (exit 1),
/// a signal from outside (SIGTERM to its group, SIGPIPE) and any other end
/// may pass.
fn crashed(status: ExitStatus, message: &str) -> bool {
    #[cfg(unix)]
    if let Some(signal) = std::os::unix::process::ExitStatusExt::signal(&status) {
        return matches!(
            signal,
            libc::SIGSEGV
                | libc::SIGBUS
                | libc::SIGILL
                | libc::SIGFPE
                | libc::SIGABRT
                | libc::SIGSYS
        );
    }
    let of_the_moment = [
        "Resource temporarily unavailable",
        "os error 11",
        "failed to spawn",
    ]
    .iter()
    .any(|words| message.contains(words));
    status.code() == Some(PANIC_STATUS) && !of_the_moment
}

/// The exit status of a Rust program that panicked.
const PANIC_STATUS: i32 = 101;

/// The least wall-clock time a compile is given (see
/// `CompileProcess::wall_limit`): starting the child (a large binary, at a
/// low priority) takes part of it.
const MIN_WALL_LIMIT: Duration = Duration::from_secs(10);

/// How long past its wall-clock limit the gateway waits for a compile's
/// own alarm before it kills the child itself (see [`wait_with_cpu_time`]).
const WATCHDOG_MARGIN: Duration = Duration::from_secs(1);

/// How a compile child ended, as [`wait_with_cpu_time`] saw it.
struct Waited {
    /// Its exit status and what it wrote.
    output: std::process::Output,
    /// The CPU time it used.
    cpu_used: Duration,
    /// Whether the gateway killed it, still running at its bound.
    overran: bool,
}

/// Waits for `child`, reading its stdout and stderr meanwhile, and returns
/// them with its exit status and the CPU time it used: its own, from
/// `wait4`, not `RUSAGE_CHILDREN`'s, which also counts other children
/// (two gateways in one process compile at once) and would make a starved
/// compile look costly.
///
/// A child still running after `bound` is killed (SIGKILL): the child's
/// own alarm does not end a child that is stopped (SIGSTOP, a debugger, a
/// cgroup freezer), which keeps its SIGALRM pending, and every reload
/// after it waited for it without end. The kill is sent only while the
/// child is not yet reaped, so that it cannot reach another process that
/// took its id.
fn wait_with_cpu_time(mut child: std::process::Child, bound: Duration) -> std::io::Result<Waited> {
    #[cfg(unix)]
    {
        use std::os::unix::process::ExitStatusExt as _;

        let mut stdout = child.stdout.take().expect("stdout is piped");
        let mut stderr = child.stderr.take().expect("stderr is piped");
        let pid = child.id() as libc::pid_t;
        let (exited, exit) = std::sync::mpsc::channel::<()>();
        let watchdog = std::thread::Builder::new()
            .name("snowgate-compile-watchdog".into())
            .spawn(move || {
                let overran = matches!(
                    exit.recv_timeout(bound),
                    Err(std::sync::mpsc::RecvTimeoutError::Timeout)
                );
                if overran {
                    // SAFETY: kill only sends a signal, to a child not yet
                    // reaped: the reap below waits for this thread.
                    unsafe { libc::kill(pid, libc::SIGKILL) };
                }
                overran
            });
        let read = std::thread::scope(|scope| {
            let stderr = std::thread::Builder::new()
                .name("snowgate-compile-stderr".into())
                .spawn_scoped(scope, move || {
                    let mut text = Vec::new();
                    stderr.read_to_end(&mut text).map(|_| text)
                })?;
            let mut build = Vec::new();
            let read = stdout.read_to_end(&mut build);
            let text = stderr
                .join()
                .unwrap_or_else(|_| Err(std::io::Error::other("reading stderr panicked")));
            read.and(text).map(|text| (build, text))
        });
        // Reaped whatever the reads came to: a child still writing finds
        // its pipe closed and ends.
        drop(stdout);
        // Its end waited for, not reaped, before the watchdog is told.
        wait_unreaped(pid)?;
        drop(exited);
        // A watchdog that could not start leaves the child's own alarm.
        let overran = watchdog.is_ok_and(|watchdog| watchdog.join().unwrap_or(false));
        let mut status = 0;
        let mut usage = std::mem::MaybeUninit::<libc::rusage>::zeroed();
        loop {
            // SAFETY: wait4 writes the status and the usage it is given,
            // all of the usage when it succeeds; `pid` is our child, not
            // yet reaped (std's `Child` reaps only when waited on).
            if unsafe { libc::wait4(pid, &mut status, 0, usage.as_mut_ptr()) } == pid {
                break;
            }
            let error = std::io::Error::last_os_error();
            if error.kind() != std::io::ErrorKind::Interrupted {
                return Err(error);
            }
        }
        // SAFETY: written above.
        let usage = unsafe { usage.assume_init() };
        let time = |t: libc::timeval| {
            Duration::from_secs(t.tv_sec.max(0) as u64)
                + Duration::from_micros(t.tv_usec.max(0) as u64)
        };
        let (stdout, stderr) = read?;
        let output = std::process::Output {
            status: ExitStatus::from_raw(status),
            stdout,
            stderr,
        };
        Ok(Waited {
            output,
            cpu_used: time(usage.ru_utime) + time(usage.ru_stime),
            overran,
        })
    }
    #[cfg(not(unix))]
    {
        let _ = bound;
        child.wait_with_output().map(|output| Waited {
            output,
            cpu_used: Duration::ZERO,
            overran: false,
        })
    }
}

/// The child's side: reads a component on `input`, compiles it with the
/// engine's compile settings and writes the build on `output`. An error
/// names what failed; [`RefusedComponent`] when wasmtime refused the
/// component (exit with [`REFUSED_STATUS`] then), [`CompileOutOfMemory`]
/// when it ran out of memory (exit with [`OUT_OF_MEMORY_STATUS`]).
pub fn compile_for_parent(mut input: impl Read, mut output: impl Write) -> anyhow::Result<()> {
    let mut component = Vec::new();
    input
        .by_ref()
        .take(MAX_COMPONENT_BYTES + 1)
        .read_to_end(&mut component)
        .context("reading the component on stdin")?;
    anyhow::ensure!(
        component.len() as u64 <= MAX_COMPONENT_BYTES,
        "the component on stdin is larger than {} MiB",
        MAX_COMPONENT_BYTES >> 20
    );
    let engine = Engine::new(&crate::engine::compile_config()).map_err(|e| {
        let message = format!("creating the wasmtime engine to compile with: {e:#}");
        if out_of_memory(&e) {
            anyhow::Error::new(CompileOutOfMemory(message))
        } else {
            anyhow::anyhow!(message)
        }
    })?;
    let build = engine.precompile_component(&component).map_err(|e| {
        let message = format!("{e:#}");
        if out_of_memory(&e) {
            anyhow::Error::new(CompileOutOfMemory(message))
        } else {
            anyhow::Error::new(RefusedComponent(message))
        }
    })?;
    output
        .write_all(&build)
        .and_then(|()| output.flush())
        .context("writing the compiled build on stdout")
}

/// Whether wasmtime's error is an allocation or a mapping that failed:
/// its out-of-memory error, or an OS error of that kind (ENOMEM), anywhere
/// in its chain.
fn out_of_memory(error: &wasmtime::Error) -> bool {
    error.is::<wasmtime::OutOfMemory>()
        || error.chain().any(|cause| {
            cause.is::<wasmtime::OutOfMemory>()
                || cause
                    .downcast_ref::<std::io::Error>()
                    .is_some_and(|e| e.kind() == std::io::ErrorKind::OutOfMemory)
        })
}

/// wasmtime ran out of memory compiling the component; its message.
#[derive(Debug)]
pub struct CompileOutOfMemory(pub String);

impl std::fmt::Display for CompileOutOfMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)
    }
}

impl std::error::Error for CompileOutOfMemory {}

/// wasmtime refused the component; its message.
#[derive(Debug)]
pub struct RefusedComponent(pub String);

impl std::fmt::Display for RefusedComponent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)
    }
}

impl std::error::Error for RefusedComponent {}

/// Waits until the child `pid` has ended, leaving it to be reaped: until it
/// is, its pid stays its own, so that a kill sent meanwhile (by a watchdog
/// that timed it out) cannot reach another process that took the pid.
#[cfg(unix)]
pub fn wait_unreaped(pid: libc::pid_t) -> std::io::Result<()> {
    loop {
        let mut info = std::mem::MaybeUninit::<libc::siginfo_t>::zeroed();
        // SAFETY: waitid writes the info it is given; WNOWAIT leaves the
        // child to be reaped.
        let waited = unsafe {
            libc::waitid(
                libc::P_PID,
                pid as libc::id_t,
                info.as_mut_ptr(),
                libc::WEXITED | libc::WNOWAIT,
            )
        };
        if waited == 0 {
            return Ok(());
        }
        let error = std::io::Error::last_os_error();
        if error.kind() != std::io::ErrorKind::Interrupted {
            return Err(error);
        }
    }
}

/// Makes sure this process's children can be waited for. A `SIGCHLD`
/// ignored by whoever started the gateway (the disposition passes through
/// `exec`), or set with `SA_NOCLDWAIT`, has the kernel reap children
/// itself, and waiting for one then fails with `ECHILD` once it ended:
/// every compile failed, and a gateway could not start (a review's wrapper
/// that ignored `SIGCHLD` and then ran `snowgate serve`). Set back to the
/// default, which leaves the signal unheard too, but children to be
/// waited for. Process-wide, as the disposition is; nothing else in this
/// crate relies on it.
#[cfg(unix)]
fn keep_children_for_waiting() {
    // SAFETY: sigaction reads the current disposition into a zeroed
    // struct, and replaces it only where children would not be kept.
    unsafe {
        let mut current = std::mem::zeroed::<libc::sigaction>();
        if libc::sigaction(libc::SIGCHLD, std::ptr::null(), &mut current) != 0 {
            return;
        }
        let reaped_for_us =
            current.sa_sigaction == libc::SIG_IGN || current.sa_flags & libc::SA_NOCLDWAIT != 0;
        if reaped_for_us {
            let mut default = std::mem::zeroed::<libc::sigaction>();
            default.sa_sigaction = libc::SIG_DFL;
            libc::sigaction(libc::SIGCHLD, &default, std::ptr::null_mut());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::process::ExitStatusExt as _;

    fn process() -> CompileProcess {
        CompileProcess::this_binary(
            &["compile-plugin"],
            CompileLimits {
                memory_bytes: 512 << 20,
                cpu: Duration::from_secs(3),
            },
        )
    }

    /// A wait status for an exit with `code`.
    fn exited(code: i32) -> ExitStatus {
        ExitStatus::from_raw(code << 8)
    }

    /// A wait status for a death by `signal`.
    fn killed_by(signal: i32) -> ExitStatus {
        ExitStatus::from_raw(signal)
    }

    #[test]
    fn a_failed_allocation_is_the_memory_limit() {
        let failure = process().failure(
            killed_by(libc::SIGABRT),
            b"memory allocation of 1048576 bytes failed\n",
            Duration::ZERO,
        );
        assert_eq!(
            failure,
            CompileFailure::OutOfMemory {
                limit_bytes: 512 << 20
            }
        );
        assert!(failure
            .to_string()
            .contains("more than its 512 MiB of address space (--plugin-compile-memory-mib)"));
        // wasmtime's own failed mapping, told by the child's status.
        let failure = process().failure(
            exited(OUT_OF_MEMORY_STATUS),
            b"failed to mmap: Cannot allocate memory (os error 12)",
            Duration::ZERO,
        );
        assert!(matches!(failure, CompileFailure::OutOfMemory { .. }));
    }

    /// A refusal's words may quote the component's own names: they are
    /// not read for an allocation that failed.
    #[test]
    fn a_refusal_that_speaks_of_memory_is_a_refusal() {
        for words in [
            &b"`out of memory` is not in kebab case"[..],
            b"import `memory allocation of 1 bytes failed`: Cannot allocate memory",
        ] {
            let failure = process().failure(exited(REFUSED_STATUS), words, Duration::ZERO);
            assert!(matches!(failure, CompileFailure::Refused(_)), "{failure:?}");
            assert!(!failure.may_pass());
        }
        // Nor does an exit with them, without the abort, make one.
        let failure = process().failure(exited(1), b"memory allocation of", Duration::ZERO);
        assert!(matches!(failure, CompileFailure::Other(_)), "{failure:?}");
    }

    /// A child that crashed (a panic, a signal no limit sends) would crash
    /// on the same component again: not tried again, unlike its own I/O
    /// failure.
    #[test]
    fn a_crash_is_not_tried_again_and_an_io_failure_is() {
        for status in [
            exited(101),
            killed_by(libc::SIGSEGV),
            killed_by(libc::SIGABRT),
        ] {
            let failure = process().failure(status, b"thread 'main' panicked", Duration::ZERO);
            assert!(matches!(failure, CompileFailure::Crashed(_)), "{failure:?}");
            assert!(!failure.may_pass(), "{failure:?}");
            assert!(failure.to_string().contains("crashed"), "{failure}");
        }
        // Ends that may not come again: a signal from outside, a thread
        // the system had no room for just then.
        for (status, words) in [
            (killed_by(libc::SIGTERM), &b""[..]),
            (killed_by(libc::SIGPIPE), b""),
            (
                exited(101),
                b"failed to spawn thread: Os { code: 11, kind: WouldBlock, message: \"Resource temporarily unavailable\" }",
            ),
        ] {
            let failure = process().failure(status, words, Duration::ZERO);
            assert!(matches!(failure, CompileFailure::Other(_)), "{failure:?}");
            assert!(failure.may_pass(), "{failure:?}");
        }
        let failure = process().failure(
            exited(FAILED_STATUS),
            b"writing the compiled build on stdout: Broken pipe",
            Duration::ZERO,
        );
        assert!(matches!(failure, CompileFailure::Other(_)), "{failure:?}");
        assert!(failure.may_pass());
        assert!(
            failure.to_string().contains("failed (exit status: 1)"),
            "{failure}"
        );
    }

    #[test]
    fn the_cpu_limits_signals_are_the_cpu_limit() {
        let failure = process().failure(killed_by(libc::SIGXCPU), b"", Duration::ZERO);
        assert_eq!(
            failure,
            CompileFailure::OutOfCpuTime {
                limit: Duration::from_secs(3),
                killed: false
            }
        );
        assert_eq!(
            failure.to_string(),
            "compiling the plugin used up its 3 s of CPU time (--plugin-compile-cpu-secs)"
        );
        let failure = process().failure(killed_by(libc::SIGKILL), b"", Duration::from_secs(4));
        assert!(failure
            .to_string()
            .contains("was killed at its 3 s of CPU time"));
        assert!(failure.to_string().contains("for want of memory"));
        assert!(failure.may_pass());
    }

    /// A SIGKILL before the CPU limit was used up is not the limit's: said
    /// as the system's or an operator's, with the CPU time used, and may
    /// pass. It was said to be the CPU limit, sending an operator to the
    /// wrong flag.
    #[test]
    fn a_kill_under_the_cpu_limit_is_not_said_to_be_the_limit() {
        let failure =
            process().failure(killed_by(libc::SIGKILL), b"", Duration::from_millis(1_200));
        assert!(matches!(failure, CompileFailure::Other(_)), "{failure:?}");
        assert!(failure.may_pass());
        let said = failure.to_string();
        assert!(
            said.contains("was killed (SIGKILL) after 1.2 s of CPU time, under its limit of 3 s")
                && said.contains("out-of-memory killer"),
            "{said}"
        );
    }

    /// A compile child that is stopped (SIGSTOP) keeps its own alarm
    /// pending and never ends by it: the gateway kills it a second past its
    /// wall-clock bound, and says it ran out of wall-clock time, starved.
    /// Before, the compile, and every reload after it, waited without end.
    #[cfg(target_os = "linux")]
    #[test]
    fn a_stopped_compile_is_killed_past_its_wall_clock_bound() {
        let limits = CompileLimits {
            memory_bytes: 512 << 20,
            cpu: Duration::from_secs(1),
        };
        // SAFETY: the program's output is not loaded: it stops itself.
        let stopped =
            unsafe { CompileProcess::of_program("sh", &["-c", "kill -STOP $$; sleep 60"], limits) };
        let failure = stopped.compile(b"").expect_err("ended");
        assert!(
            matches!(
                failure,
                CompileFailure::OutOfWallTime { limit, stopped: true, .. }
                    if limit == Duration::from_secs(10)
            ),
            "{failure:?}"
        );
        assert!(failure.may_pass());
        assert!(
            failure.to_string().contains("which a stopped process"),
            "{failure}"
        );
    }

    /// The compile runs ten steps of niceness below the thread that
    /// starts it, wherever that is: not at a fixed nice 10, which is above
    /// a gateway run at 11 or more.
    #[cfg(target_os = "linux")]
    #[test]
    fn a_compile_runs_ten_steps_below_the_gateways_priority() {
        let limits = CompileLimits {
            memory_bytes: 512 << 20,
            cpu: Duration::from_secs(10),
        };
        // SAFETY: the output (a number) is not loaded.
        let child = unsafe {
            CompileProcess::of_program("sh", &["-c", "cut -d ' ' -f 19 /proc/self/stat"], limits)
        };
        let nice_of_child = || -> i32 {
            let out = child.compile(b"").expect("the child's niceness");
            String::from_utf8_lossy(&out)
                .trim()
                .parse()
                .expect("a number")
        };
        // SAFETY: getpriority and setpriority change this test's own
        // thread only (a Linux thread has its own niceness), which ends
        // with the test.
        let own = || unsafe { libc::getpriority(libc::PRIO_PROCESS, 0) };
        let before = own();
        assert_eq!(nice_of_child(), (before + 10).min(19));
        // Raised, which needs no privilege (a fixed 10 gave 10 again).
        let raised = (before + 3).min(19);
        assert_eq!(
            unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, raised) },
            0
        );
        assert_eq!(own(), raised);
        assert_eq!(nice_of_child(), (raised + 10).min(19));
    }

    /// A compile that takes longer than twice its CPU time in wall-clock
    /// time (at least 10 s), however little CPU it uses (here a child that
    /// only sleeps), is ended, and says so; before, only CPU time was
    /// bounded. The CPU time is its own: another compile that ends
    /// meanwhile (here one that only spins, to its CPU limit) is not
    /// counted in it, as `RUSAGE_CHILDREN` counted it.
    ///
    /// The spinner runs at the compile's low priority, so a machine busy
    /// with other work may not give it its second of CPU within the
    /// sleeper's 10 s (a run beside three reviews and a CI run did not).
    /// Without that second the check means nothing, so such a round is run
    /// again, up to three times, and the test fails if none had it.
    #[cfg(target_os = "linux")]
    #[test]
    fn a_compile_past_twice_its_cpu_time_in_wall_clock_time_is_ended() {
        let limits = CompileLimits {
            memory_bytes: 512 << 20,
            cpu: Duration::from_secs(1),
        };
        // SAFETY: neither program's output is loaded: one only sleeps, the
        // other only spins.
        let sleeper = unsafe { CompileProcess::of_program("sleep", &["60"], limits) };
        let spinner =
            unsafe { CompileProcess::of_program("sh", &["-c", "while :; do :; done"], limits) };
        let mut starved_spinners = Vec::new();
        let failure = loop {
            let started = std::time::Instant::now();
            let (failure, spun) = std::thread::scope(|scope| {
                let spun = scope.spawn(|| spinner.compile(b""));
                (
                    sleeper.compile(b""),
                    spun.join().expect("the spinning compile"),
                )
            });
            let failure = failure.expect_err("ended");
            assert!(
                started.elapsed() < Duration::from_secs(25),
                "{:?}",
                started.elapsed()
            );
            match spun.expect_err("ended") {
                CompileFailure::OutOfCpuTime { .. } => break failure,
                // Not its CPU second in 10 s, however little it had.
                starved @ CompileFailure::OutOfWallTime { .. } if starved_spinners.len() < 2 => {
                    starved_spinners.push(starved)
                }
                spun => panic!("{spun:?}, after {starved_spinners:?}"),
            }
        };
        // It slept: it used no CPU to speak of, starved, which may pass.
        assert!(
            matches!(
                failure,
                CompileFailure::OutOfWallTime { limit, starved: true, .. }
                    if limit == Duration::from_secs(10)
            ),
            "{failure:?}"
        );
        assert!(failure.may_pass());
        assert!(failure
            .to_string()
            .contains("longer than 10 s of wall-clock time"));
        assert!(failure
            .to_string()
            .contains("the machine left it too little CPU"));
        // One that used most of its CPU time by then would run out again.
        let costly = process().failure(killed_by(libc::SIGALRM), b"", Duration::from_secs(2));
        assert!(
            matches!(costly, CompileFailure::OutOfWallTime { starved: false, .. }),
            "{costly:?}"
        );
        assert!(!costly.may_pass());
    }

    #[test]
    fn a_refusal_carries_the_childs_words() {
        let failure = process().failure(
            exited(REFUSED_STATUS),
            b"failed to parse: bad magic\n",
            Duration::ZERO,
        );
        assert_eq!(
            failure,
            CompileFailure::Refused("failed to parse: bad magic".to_string())
        );
    }

    /// wasmparser quotes an invalid import name byte for byte, and its
    /// messages and a panic's span lines: none reaches the log as a line
    /// of its own.
    #[test]
    fn the_childs_words_are_one_line_with_control_characters_escaped() {
        let forged = b"import name `x\n2026-12-06T00:00:00Z ERROR forged\r\x1b[2K` is not valid\n  at offset 9";
        for status in [REFUSED_STATUS, 101, 1] {
            let text = process()
                .failure(exited(status), forged, Duration::ZERO)
                .to_string();
            assert!(!text.chars().any(char::is_control), "{status}: {text:?}");
            assert!(
                text.contains(
                    r"`x\n2026-12-06T00:00:00Z ERROR forged\r\u{1b}[2K` is not valid\n  at offset 9"
                ),
                "{status}: {text:?}"
            );
        }
    }

    #[test]
    fn any_other_end_names_the_status_and_the_childs_words() {
        let failure = process().failure(
            exited(101),
            b"thread 'main' panicked at oops",
            Duration::ZERO,
        );
        let text = failure.to_string();
        assert!(
            text.starts_with("the compile process /proc/self/exe crashed (exit status: 101)"),
            "{text}"
        );
        assert!(text.ends_with(": thread 'main' panicked at oops"), "{text}");
        // A child's message is kept to a bounded length.
        let long = vec![b'x'; 10 * MAX_CHILD_MESSAGE];
        let text = process()
            .failure(exited(1), &long, Duration::ZERO)
            .to_string();
        assert!(text.len() < 2 * MAX_CHILD_MESSAGE, "{}", text.len());
    }

    #[test]
    fn the_child_refuses_bytes_that_are_no_component_and_names_wasmtimes_reason() {
        let mut out = Vec::new();
        let error = compile_for_parent(&b"\0asm\x0d\0\x01\0\x01"[..], &mut out).unwrap_err();
        assert!(error.is::<RefusedComponent>(), "{error:#}");
        assert!(out.is_empty());
    }
}
