//! The flags that say how plugin builds are compiled: shared by `serve`,
//! which compiles every build it loads, and `check`, which compiles a build
//! as a gateway of the same flags would.

use clap::Args;
use snowgate_host::gateway::ConfigFile;

/// Where plugin builds compile, and under which limits.
#[derive(Args)]
pub struct CompileFlags {
    /// Address space the process that compiles each plugin build may map,
    /// in MiB, 256 or more [default: 4096]. Builds are compiled in a child
    /// process (`snowgate compile-plugin`, at a lower CPU priority), so that
    /// one whose compile needs more memory or time than its limit fails
    /// alone: the load is refused, naming the limit, and the build serving
    /// before goes on serving.
    #[arg(long, value_name = "MIB")]
    plugin_compile_memory_mib: Option<u64>,
    /// CPU time, over all its threads, the process that compiles each
    /// plugin build may use, in seconds; it may run for twice that in
    /// wall-clock time, at least 10 s [default: 600].
    #[arg(long, value_name = "SECS")]
    plugin_compile_cpu_secs: Option<u64>,
    /// Compile plugin builds in the gateway's own process instead of a
    /// child, without the two limits above: a build whose compile needs
    /// too much then costs the gateway itself. Only where the gateway
    /// cannot start itself again: under valgrind (where `/proc/self/exe`
    /// is valgrind), or a seccomp profile without `execve`.
    #[arg(long, conflicts_with_all = ["plugin_compile_memory_mib", "plugin_compile_cpu_secs"])]
    plugin_compile_in_process: bool,
}

impl CompileFlags {
    /// `settings`, with the compile settings these flags give.
    pub fn over(&self, settings: ConfigFile) -> ConfigFile {
        ConfigFile {
            plugin_compile_memory_mib: self.plugin_compile_memory_mib,
            plugin_compile_cpu_secs: self.plugin_compile_cpu_secs,
            plugin_compile_in_process: self.plugin_compile_in_process.then_some(true),
            ..settings
        }
    }
}
