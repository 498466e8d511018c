//! Loading a plugin: compile once, link once, check that it implements the
//! world and accepts its configuration, before it may serve.

use std::fmt;
use std::sync::Arc;
use std::time::SystemTime;

use sha2::{Digest, Sha256};
use wasmtime::component::{Component, ComponentExportIndex, InstancePre};
use wasmtime::error::Context as _;

use crate::bindings::exports::snowgate::middleware::handler::Setting;
use crate::bindings::MiddlewarePre;
use crate::compile_cache::{is_over_the_limits, CompileCache, Compiled};
use crate::compile_process::CompileFailure;
use crate::engine::PluginEngine;
use crate::state::HostState;
use crate::text_limits::{plugin_reason, plugin_text, MAX_PLUGIN_NAME, MAX_PLUGIN_TEXT};

/// The version of the `snowgate:middleware` contract (`wit/middleware.wit`)
/// this host implements. Plugins built against a version not in
/// [`LOADS_VERSIONS`] are refused at load time, naming both.
pub const CONTRACT_VERSION: &str = "0.2.1";

/// The versions of the contract whose plugins this host loads: 0.2.1 only
/// added an import (`header-edits`) to 0.2.0, so a 0.2.0 plugin runs as it
/// was built (wasmtime's linker gives its 0.2.0 imports the 0.2.1 ones).
pub const LOADS_VERSIONS: [&str; 2] = ["0.2.0", CONTRACT_VERSION];

/// The contract's package, with its version: a plugin implements its
/// world, `middleware`.
pub const PACKAGE: &str = "snowgate:middleware@0.2.1";

/// What is known about a loaded plugin.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PluginInfo {
    /// The name the plugin reports.
    pub name: String,
    /// The version the plugin reports.
    pub version: String,
    /// Hex SHA-256 of the component bytes as loaded.
    pub sha256: String,
    /// When it was loaded.
    pub loaded_at: SystemTime,
    /// Whether it was compiled at load or read from the compile cache.
    pub compiled: Compiled,
}

/// The plugin's `configure` export refused the settings it was given (its
/// message): the settings are at fault, not the plugin. Found in the chain
/// of the error [`Plugin::load`] returns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigurationRefused(pub String);

impl fmt::Display for ConfigurationRefused {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "the plugin refused its configuration: {}", self.0)
    }
}

impl std::error::Error for ConfigurationRefused {}

/// The setting the host hands every plugin first, from the engine's id
/// layout. A caller's setting of this name is refused ([`Plugin::load`],
/// [`layout_setting_problem`]): coming after the host's, it would configure
/// the plugin for one layout while the machine id is checked for another.
pub const LAYOUT_SETTING: &str = "id-layout";

/// Why a caller's plugin setting named `name` cannot be given, if it
/// cannot: it is [`LAYOUT_SETTING`], which the host sets from its layout.
pub fn layout_setting_problem(name: &str) -> Option<String> {
    (name == LAYOUT_SETTING).then(|| {
        format!(
            "the plugin setting {LAYOUT_SETTING} is the host's own: it is always handed to the \
             plugin from the id layout (--layout, or the config file's layout), so that the \
             plugin's layout and the machine id's cannot differ; set the layout there"
        )
    })
}

/// A compiled, linked and validated plugin, ready to serve requests. Cheap
/// to share: calls on it run in parallel, each in its own store.
pub struct Plugin {
    pub(crate) engine: PluginEngine,
    pub(crate) pre: MiddlewarePre<HostState>,
    /// The same, linked for async calls (see [`Plugin::handle_async`]).
    pub(crate) pre_async: InstancePre<HostState>,
    /// Where the handler's `configure` and `handle` exports are.
    pub(crate) exports: HandlerExports,
    /// Instances kept between async calls (see [`Plugin::handle_async`]);
    /// `None` once [`Plugin::retire`] ran: keep none any more.
    pub(crate) idle: std::sync::Mutex<Option<Vec<crate::call::Reusable>>>,
    /// Whether the log said already that an instance of this build was
    /// not kept for what it did (see `Plugin::give_back`).
    pub(crate) told_not_kept: std::sync::atomic::AtomicBool,
    pub(crate) settings: Arc<[Setting]>,
    pub(crate) name: Arc<str>,
    info: PluginInfo,
}

impl fmt::Debug for Plugin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Plugin")
            .field("info", &self.info)
            .finish_non_exhaustive()
    }
}

/// A plugin compiled and linked, none of its code run yet (see
/// [`Plugin::link`]).
pub struct LinkedPlugin(Plugin);

impl LinkedPlugin {
    /// Runs a first instance of the plugin: asks for its name and version
    /// and hands it its settings, under the same limits as a request. The
    /// plugin, once it accepts them.
    pub fn configure(self) -> anyhow::Result<Plugin> {
        let mut plugin = self.0;
        let (name, version) = plugin
            .describe()
            .map_err(|e| e.context("the plugin failed its load-time check"))?;
        plugin.name = Arc::from(name.as_str());
        plugin.info.name = name;
        plugin.info.version = version;
        Ok(plugin)
    }
}

impl Plugin {
    /// Compiles `bytes` (a WebAssembly component), links it against the
    /// host's imports, and checks it: it must implement the
    /// `snowgate:middleware/middleware` world, report a name and version, and
    /// accept `settings` plus the id layout of the engine's machine id.
    ///
    /// This blocks (it compiles, and calls the plugin through the sync path,
    /// like [`Plugin::handle`]): from async code, call it on a blocking
    /// thread (`tokio::task::spawn_blocking`), as the gateway does.
    ///
    /// The error says what is wrong: not a component, a missing import or
    /// export, or a refused setting (among them [`LAYOUT_SETTING`], which
    /// the host sets itself).
    pub fn load(
        engine: &PluginEngine,
        bytes: &[u8],
        settings: &[(String, String)],
    ) -> anyhow::Result<Plugin> {
        Plugin::link(engine, bytes, settings)?.configure()
    }

    /// [`Plugin::load`]'s first half: compiles `bytes` (or reads the build
    /// from the compile cache) and links it, running none of its code. The
    /// other half, [`LinkedPlugin::configure`], runs a first instance of it:
    /// a caller that must know when plugin code runs (a stopping gateway
    /// waits for a reload's plugin calls, not for its compile) takes its
    /// turn between the two.
    pub fn link(
        engine: &PluginEngine,
        bytes: &[u8],
        settings: &[(String, String)],
    ) -> anyhow::Result<LinkedPlugin> {
        if let Some(problem) = settings
            .iter()
            .find_map(|(name, _)| layout_setting_problem(name))
        {
            anyhow::bail!(problem);
        }
        let sha256 = hex_sha256(bytes);
        let cached = match &engine.compile_cache {
            Some(cache) => cache.lookup(&engine.engine, &sha256, |e| refused(engine, e))?,
            None => None,
        };
        let (component, compiled) = match cached {
            Some(component) => (component, Compiled::FromCache),
            None => (compile(engine, bytes)?, Compiled::Now),
        };
        check_contract_version(engine, &component)?;
        let instance_pre = engine
            .linker
            .instantiate_pre(&component)
            .map_err(one_line)
            .with_context(|| {
                format!(
                "the plugin imports something the host does not provide (the host provides the \
                 {PACKAGE} contract's clock, identity, log, request-headers and header-edits, and \
                 WASI 0.2's cli, \
                 clocks, filesystem, io, random and sockets, with nothing behind them; not \
                 wasi:http)"
            )
            })?;
        let pre = MiddlewarePre::new(instance_pre)
            .map_err(one_line)
            .with_context(|| {
                format!(
                    "the plugin does not export the {} interface",
                    HandlerExports::INTERFACE
                )
            })?;
        // Already type-checked by `MiddlewarePre::new` above.
        let pre_async = engine
            .async_linker
            .instantiate_pre(&component)
            .map_err(one_line)
            .context("linking the plugin for async calls")?;
        let exports = HandlerExports::find(&component)?;

        let layout = engine.services.identity.layout();
        let settings: Arc<[Setting]> = std::iter::once(Setting {
            name: LAYOUT_SETTING.into(),
            value: layout.name().into(),
        })
        .chain(settings.iter().map(|(name, value)| Setting {
            name: name.clone(),
            value: value.clone(),
        }))
        .collect();

        Ok(LinkedPlugin(Plugin {
            engine: engine.clone(),
            pre,
            pre_async,
            exports,
            idle: std::sync::Mutex::new(Some(Vec::new())),
            told_not_kept: std::sync::atomic::AtomicBool::new(false),
            settings,
            name: Arc::from("unnamed plugin"),
            info: PluginInfo {
                name: String::new(),
                version: String::new(),
                sha256,
                loaded_at: SystemTime::now(),
                compiled,
            },
        }))
    }

    /// What is known about the plugin.
    pub fn info(&self) -> &PluginInfo {
        &self.info
    }

    /// The engine the plugin was loaded into.
    pub fn engine(&self) -> &PluginEngine {
        &self.engine
    }

    /// Keeps this plugin's build in the engine's compile cache, if it has
    /// one and the build was compiled at load. Call it once the plugin is
    /// accepted, after any checks of your own, so that only builds that
    /// serve are kept (the gateway calls it once the build serves, after
    /// its self-check, on a thread of its own). It blocks for the write.
    pub fn keep_compiled(&self) {
        if let Some(cache) = self.cache_to_keep_in() {
            cache.store(
                &self.engine.engine,
                &self.info.sha256,
                self.pre_async.component(),
            );
        }
    }

    /// Whether [`Plugin::keep_compiled`] has a build to keep: the engine
    /// has a compile cache, and the build was compiled at load, not read
    /// from it.
    pub fn has_build_to_keep(&self) -> bool {
        self.cache_to_keep_in().is_some()
    }

    /// The compile cache this plugin's build is to be kept in, if any (see
    /// [`Plugin::has_build_to_keep`]).
    fn cache_to_keep_in(&self) -> Option<&CompileCache> {
        let cache = self.engine.compile_cache.as_deref()?;
        (self.info.compiled == Compiled::Now).then_some(cache)
    }

    /// Instantiates once, asks for name and version, and hands over the
    /// configuration, under the same limits as a request.
    fn describe(&self) -> anyhow::Result<(String, String)> {
        let (mut store, instance) = self.instantiate_checked()?;
        let handler = instance.snowgate_middleware_handler();
        // A trap or the deadline here is told as in a request's call: the
        // panic's text, the limit it hit; not wasmtime's backtrace.
        let failed = |store: &wasmtime::Store<_>, export: &str, e: wasmtime::Error| {
            anyhow::Error::new(self.classify(e, store))
                .context(format!("calling the plugin's {export} export"))
        };
        let name = handler
            .call_name(&mut store)
            .map_err(|e| failed(&store, "name", e))?;
        // Both go on every log line of the plugin's, on /status and the
        // metrics: bounded and escaped. `configure`'s lines carry the name.
        let name = plugin_text(name, MAX_PLUGIN_NAME);
        store.data_mut().set_plugin_name(Arc::from(name.as_str()));
        let version = handler
            .call_version(&mut store)
            .map_err(|e| failed(&store, "version", e))?;
        handler
            .call_configure(&mut store, &self.settings)
            .map_err(|e| failed(&store, "configure", e))?
            .map_err(|refusal| {
                anyhow::Error::new(ConfigurationRefused(plugin_reason(
                    refusal,
                    MAX_PLUGIN_TEXT,
                )))
            })?;
        Ok((name, plugin_text(version, MAX_PLUGIN_NAME)))
    }
}

/// Compiles `bytes`: in the engine's compile process if it has one, here
/// otherwise.
fn compile(engine: &PluginEngine, bytes: &[u8]) -> anyhow::Result<Component> {
    if let Some(what) = not_a_component(bytes) {
        anyhow::bail!("the plugin is not a valid WebAssembly component for this host: {what}");
    }
    let Some(process) = &engine.compile_process else {
        return Component::new(&engine.engine, bytes).map_err(|e| refused(engine, e));
    };
    let build = process.compile(bytes).map_err(|failure| match failure {
        CompileFailure::Refused(message) => anyhow::anyhow!(message)
            .context("the plugin is not a valid WebAssembly component for this host"),
        failure => anyhow::Error::new(failure),
    })?;
    // SAFETY: the build was just written by the compile process, which is
    // this binary or one its embedder vouched for (`CompileProcess::
    // of_program` is unsafe), from these bytes: trusted as this process's
    // own compile would be. wasmtime checks that it was made by this
    // wasmtime with this engine's settings.
    unsafe { Component::deserialize(&engine.engine, &build) }.map_err(|e| refused(engine, e))
}

/// What a file that cannot be a component is, in one line, when its first
/// eight bytes tell: wasmtime would say it in a multi-line dump.
fn not_a_component(bytes: &[u8]) -> Option<String> {
    const MAGIC: &[u8] = b"\0asm";
    const CORE_MODULE: &[u8] = &[1, 0, 0, 0];
    if !bytes.starts_with(MAGIC) {
        if bytes.is_empty() {
            return Some("the file is empty".to_string());
        }
        let head = &bytes[..bytes.len().min(8)];
        let hex: Vec<String> = head.iter().map(|b| format!("{b:02x}")).collect();
        let text: String = head
            .iter()
            .map(|&b| {
                if b.is_ascii_graphic() || b == b' ' {
                    b as char
                } else {
                    '.'
                }
            })
            .collect();
        return Some(format!(
            "no WebAssembly magic header (\\0asm): the file starts with {} ({text:?})",
            hex.join(" ")
        ));
    }
    (bytes.get(4..8) == Some(CORE_MODULE)).then(|| {
        "it is a core WebAssembly module, not a component: build it for wasm32-wasip2, or \
         make it a component with `wasm-tools component new`"
            .to_string()
    })
}

/// Why the engine refused a component: a memory that starts larger than the
/// pool allows, named with its flag; otherwise its contents.
fn refused(engine: &PluginEngine, e: wasmtime::Error) -> anyhow::Error {
    let e = if is_over_the_limits(&e) {
        let bytes = engine.limits.memory_bytes;
        let limit = if bytes.is_multiple_of(1 << 20) {
            format!("{} MiB", bytes >> 20)
        } else {
            format!("{bytes} byte")
        };
        e.context(format!(
            "the plugin's memory starts larger than the {limit} plugin memory limit \
             allows (`snowgate serve --plugin-memory-mib`)"
        ))
    } else {
        one_line(e).context("the plugin is not a valid WebAssembly component for this host")
    };
    anyhow::Error::from(e)
}

/// wasmtime's error about a component, as one line with its control
/// characters escaped: wasmparser quotes an invalid name byte for byte,
/// and wasmtime's linker a valid `url=<…>` import name, which may hold a
/// newline or an escape; either would otherwise let a plugin file forge
/// lines in the gateway's log. As a compile process's refusal is.
fn one_line(e: wasmtime::Error) -> wasmtime::Error {
    wasmtime::Error::msg(plugin_text(format!("{e:#}"), MAX_PLUGIN_TEXT))
}

/// Refuses a component that imports or exports an interface of a version
/// of the `snowgate:middleware` contract this host does not load (see
/// [`LOADS_VERSIONS`]), naming both versions: the
/// plain "does not provide" or "does not export" that would follow says
/// less about what to do (rebuild against this host's WIT).
fn check_contract_version(engine: &PluginEngine, component: &Component) -> anyhow::Result<()> {
    let ty = component.component_type();
    let imports = ty
        .imports(&engine.engine)
        .map(|(name, _)| ("imports", name));
    let exports = ty
        .exports(&engine.engine)
        .map(|(name, _)| ("exports", name));
    for (direction, name) in imports.chain(exports) {
        let Some(interface) = name.strip_prefix("snowgate:middleware/") else {
            continue;
        };
        let version = interface.rsplit_once('@').map_or("", |(_, v)| v);
        anyhow::ensure!(
            LOADS_VERSIONS.contains(&version),
            "the plugin was built for {} (it {direction} `{name}`), but this host implements \
             {PACKAGE} (and loads plugins built for {}): rebuild it against this snowgate's \
             wit/middleware.wit",
            if version.is_empty() {
                "an unversioned snowgate:middleware".to_string()
            } else {
                format!("snowgate:middleware@{version}")
            },
            LOADS_VERSIONS.join(" and "),
        );
    }
    Ok(())
}

/// The export indices of the handler functions a request call uses, found
/// once at load time.
pub(crate) struct HandlerExports {
    pub(crate) name: ComponentExportIndex,
    pub(crate) version: ComponentExportIndex,
    pub(crate) configure: ComponentExportIndex,
    pub(crate) handle: ComponentExportIndex,
}

impl HandlerExports {
    /// Found also in a plugin built for 0.2.0: wasmtime looks up a
    /// semver-compatible export when there is no exact one.
    const INTERFACE: &'static str = "snowgate:middleware/handler@0.2.1";

    fn find(component: &Component) -> anyhow::Result<HandlerExports> {
        let interface = component
            .get_export_index(None, Self::INTERFACE)
            .with_context(|| format!("the plugin does not export {}", Self::INTERFACE))?;
        let function = |name: &str| {
            component
                .get_export_index(Some(&interface), name)
                .with_context(|| format!("the plugin's {} has no {name}", Self::INTERFACE))
        };
        Ok(HandlerExports {
            name: function("name")?,
            version: function("version")?,
            configure: function("configure")?,
            handle: function("handle")?,
        })
    }
}

/// Lower-case hex SHA-256 of `bytes`.
pub fn hex_sha256(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The names the host checks plugins against are those of the WIT the
    /// host's bindings are generated from.
    #[test]
    fn the_contract_names_are_those_of_the_wit() {
        let wit = include_str!("../../wit/middleware.wit");
        let package = wit
            .lines()
            .find_map(|line| line.strip_prefix("package "))
            .expect("the WIT names its package");
        assert_eq!(package, format!("{PACKAGE};"));
        assert_eq!(PACKAGE, format!("snowgate:middleware@{CONTRACT_VERSION}"));
        assert_eq!(
            HandlerExports::INTERFACE,
            format!("snowgate:middleware/handler@{CONTRACT_VERSION}")
        );
    }

    /// A component of `memories` core modules that each define a memory
    /// and are each instantiated.
    fn component_of_memories(memories: u32) -> Vec<u8> {
        let mut module = wasm_encoder::Module::new();
        let mut memory = wasm_encoder::MemorySection::new();
        memory.memory(wasm_encoder::MemoryType {
            minimum: 1,
            maximum: None,
            memory64: false,
            shared: false,
            page_size_log2: None,
        });
        module.section(&memory);
        let mut component = wasm_encoder::Component::new();
        let mut instances = wasm_encoder::InstanceSection::new();
        for index in 0..memories {
            component.section(&wasm_encoder::ModuleSection(&module));
            instances.instantiate(index, std::iter::empty::<(&str, wasm_encoder::ModuleArg)>());
        }
        component.section(&instances);
        component.finish()
    }

    /// An engine with the default limits, the system clock and machine id 1.
    fn engine() -> PluginEngine {
        let services = crate::engine::HostServices {
            clock: std::sync::Arc::new(crate::id_clock::IdClock::system()),
            identity: std::sync::Arc::new(
                crate::identity::MachineIdentity::fixed(
                    snowgate_plugin::SnowflakeLayout::TrtllmV1,
                    1,
                )
                .expect("machine id 1"),
            ),
        };
        PluginEngine::new(services, crate::limits::PluginLimits::default()).expect("an engine")
    }

    /// A component that needs more of the instance pool than a plugin
    /// instance may take (here two memories, where the pool holds one an
    /// instance) is refused when it is loaded, saying so. Before, it loaded,
    /// and then took two of the pool's memories for each instance.
    #[test]
    fn a_component_that_needs_more_of_the_pool_than_an_instance_may_take_is_refused() {
        let engine = engine();
        let error = compile(&engine, &component_of_memories(2)).expect_err("two memories");
        let error = format!("{error:#}");
        assert!(
            error.contains("2 Wasm linear memories") && error.contains("maximum of 1"),
            "{error}"
        );
        // One memory fits (the component is then refused for the world it
        // lacks, later in the load).
        compile(&engine, &component_of_memories(1)).expect("one memory");
    }

    /// wasmparser quotes an invalid import name byte for byte: a refusal
    /// reaches the log as one line, its control characters escaped, so a
    /// component cannot forge a line of the gateway's log. Before, the
    /// newline below began a line of its own.
    #[test]
    fn a_refusal_quoting_the_components_words_is_one_line() {
        let engine = engine();
        let name = b"x\n2026-12-06T00:00:00Z ERROR snowgate_host: forged\r\x1b[2K";
        // A component of one import section with one import of that name
        // (a component import of an instance type, which follows it).
        let mut section = vec![1, 0, name.len() as u8];
        section.extend_from_slice(name);
        section.extend_from_slice(&[3, 1]);
        let mut bytes = b"\0asm\x0d\0\x01\0\x0a".to_vec();
        bytes.push(section.len() as u8);
        bytes.extend_from_slice(&section);
        let error = compile(&engine, &bytes).expect_err("an invalid name");
        let error = format!("{error:#}");
        assert!(!error.chars().any(char::is_control), "{error:?}");
        assert!(
            error.contains(r"x\n2026-12-06T00:00:00Z ERROR snowgate_host: forged\r\u{1b}[2K"),
            "{error:?}"
        );

        // A valid `url=<…>` import name may hold a newline or an escape,
        // and wasmtime's linker quotes it when it refuses the import.
        let name = b"url=<x\n2026-12-06T00:00:00Z ERROR snowgate_host: forged\x1b[31m>";
        // One function type, then one import of that name of it.
        let mut bytes = b"\0asm\x0d\0\x01\0\x07\x05\x01\x40\x00\x01\x00\x0a".to_vec();
        let mut section = vec![1, 0, name.len() as u8];
        section.extend_from_slice(name);
        section.extend_from_slice(&[1, 0]);
        bytes.push(section.len() as u8);
        bytes.extend_from_slice(&section);
        let Err(error) = Plugin::load(&engine, &bytes, &[]) else {
            panic!("loaded, with an import the host lacks");
        };
        let error = format!("{error:#}");
        assert!(!error.chars().any(char::is_control), "{error:?}");
        assert!(
            error.contains(r"url=<x\n2026-12-06T00:00:00Z ERROR snowgate_host: forged\u{1b}[31m>"),
            "{error:?}"
        );
    }
}
