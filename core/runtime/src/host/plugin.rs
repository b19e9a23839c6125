//! Finding plugin libraries, knowing their manifests, and loading and calling them.
//!
//! Knowing a plugin and loading it are separate steps. Discovery learns each library's manifest
//! from a cache keyed by the library's content hash, filled by a short-lived helper process (see
//! [`configure_manifests`]), so a command that only validates or plans never runs a plugin's
//! code in attnbench's own process. A library is loaded on the first in-process call of one of
//! its stages, and only that library.

mod manifests;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use attnbench_abi::abi_stable::library::{lib_header_from_path, LibraryError};
use attnbench_abi::abi_stable::std_types::{RResult, RStr};
use attnbench_abi::{PluginModRef, ABI_VERSION};
use attnbench_sdk::{FailureKind, PluginManifest, StageFailure, StageSpec};

use crate::host::services::{services_for, ServiceSink};

pub use manifests::{configure_manifests, serve_manifest};

/// Why a library could not be used as a plugin; always one sentence.
#[derive(Debug, Clone, thiserror::Error)]
pub enum LoadError {
    #[error("plugin library {0} does not exist")]
    Missing(PathBuf),
    #[error("cannot load {path}: {reason}")]
    Open { path: PathBuf, reason: String },
    #[error("{0} is a shared library but not an attnbench plugin: it exports no attnbench root module (plugins call attnbench_sdk::export_plugin!)")]
    NotAPlugin(PathBuf),
    #[error("{path} was built for plugin ABI {found} but this attnbench speaks ABI {ABI_VERSION}; rebuild the plugin against an attnbench-sdk of ABI major {major}", major = attnbench_abi::abi_major())]
    OtherMajor { path: PathBuf, found: String },
    #[error("{path} was built for plugin ABI major {found}, but its interface layout differs from this attnbench's ABI {ABI_VERSION}; rebuild the plugin against the attnbench-sdk this attnbench ships")]
    Layout { path: PathBuf, found: String },
    #[error("{path} failed to initialise: {reason}")]
    Init { path: PathBuf, reason: String },
    #[error("{path} has an invalid manifest: {reason}")]
    Manifest { path: PathBuf, reason: String },
    #[error("reading the manifest of {path} failed: {reason}; rebuild the library or take it off the plugin path")]
    Inspect { path: PathBuf, reason: String },
    #[error("{0} changed since attnbench read its manifest; run the command again")]
    Changed(PathBuf),
}

/// Why a stage called directly (not as a pipeline node) gave no result.
#[derive(Debug, thiserror::Error)]
pub enum CallError {
    #[error("plugin `{plugin}` has no stage `{stage}`")]
    NoStage { plugin: String, stage: String },
    #[error(transparent)]
    Params(#[from] attnbench_sdk::ParamsError),
    #[error("encoding the request: {0}")]
    Request(serde_json::Error),
    /// The stage ran and failed; its message says why.
    #[error("{0}")]
    Stage(String),
    #[error("malformed result: {0}")]
    Result(serde_json::Error),
}

/// A plugin library: its manifest always, its code once a stage runs in this process. Loaded
/// libraries stay loaded for the life of the process.
pub struct Plugin {
    pub path: PathBuf,
    /// blake3 of the library file: part of every cache key, so a rebuilt plugin reruns its nodes.
    pub library_hash: String,
    pub manifest: PluginManifest,
    /// Loaded on the first in-process call; a failure is kept, so it is reported the same way
    /// by every node instead of retried.
    module: OnceLock<Result<PluginModRef, LoadError>>,
}

impl std::fmt::Debug for Plugin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Plugin")
            .field("path", &self.path)
            .field("name", &self.manifest.name)
            .field("loaded", &matches!(self.module.get(), Some(Ok(_))))
            .finish()
    }
}

impl Plugin {
    /// Loads the library into this process now (worker processes, the conformance suite).
    pub fn load(path: &Path) -> Result<Plugin, LoadError> {
        let (path, library_hash) = identify(path)?;
        let (module, _) = open_library(&path)?;
        let manifest_json = (module.manifest())();
        let manifest = checked_manifest(&path, manifest_json.as_str())?;
        Ok(Plugin {
            path,
            library_hash,
            manifest,
            module: OnceLock::from(Ok(module)),
        })
    }

    /// The plugin's manifest, without loading the library into this process (unless no helper
    /// was configured, see [`configure_manifests`]); its code is loaded on the first
    /// in-process call.
    pub fn describe(path: &Path) -> Result<Plugin, LoadError> {
        let (path, library_hash) = identify(path)?;
        let known = manifests::manifest_of(&path, &library_hash)?;
        let manifest = checked_manifest(&path, &known.manifest)?;
        let module = OnceLock::new();
        if let Some(loaded) = known.module {
            let _ = module.set(Ok(loaded));
        }
        Ok(Plugin {
            path,
            library_hash,
            manifest,
            module,
        })
    }

    /// The library's entry points, loading it on first use.
    fn module(&self) -> Result<PluginModRef, LoadError> {
        self.module
            .get_or_init(|| {
                tracing::debug!("loading {}", self.path.display());
                // The hash is in the keys of the nodes this code computes: code rebuilt since the
                // manifest was read must not be run under it.
                match hash_file(&self.path) {
                    Ok(hash) if hash == self.library_hash => {}
                    Ok(_) => return Err(LoadError::Changed(self.path.clone())),
                    Err(err) => {
                        return Err(LoadError::Open {
                            path: self.path.clone(),
                            reason: err.to_string(),
                        })
                    }
                }
                open_library(&self.path).map(|(module, _)| module)
            })
            .clone()
    }

    /// Runs one node in this process: the result JSON text, or the stage's typed failure.
    pub fn run(
        &self,
        stage: &str,
        request_json: &str,
        sink: &impl ServiceSink,
    ) -> Result<String, StageFailure> {
        let module = self
            .module()
            .map_err(|err| StageFailure::new(FailureKind::Failed, err.to_string()))?;
        let services = services_for(sink);
        match (module.run())(
            RStr::from_str(stage),
            RStr::from_str(request_json),
            &services,
        ) {
            RResult::ROk(text) => Ok(text.into_string()),
            RResult::RErr(text) => Err(StageFailure::from_wire(
                &self.manifest.abi,
                text.into_string(),
            )),
        }
    }

    pub fn stage(&self, name: &str) -> Option<&StageSpec> {
        self.manifest.find_stage(name)
    }
}

/// The canonical path of an existing library and the blake3 of its bytes.
fn identify(path: &Path) -> Result<(PathBuf, String), LoadError> {
    if !path.is_file() {
        return Err(LoadError::Missing(path.to_path_buf()));
    }
    let path = path.canonicalize().unwrap_or_else(|_| path.to_path_buf());
    let hash = hash_file(&path).map_err(|err| LoadError::Open {
        path: path.clone(),
        reason: err.to_string(),
    })?;
    Ok((path, hash))
}

/// Streamed, so that a large GPU plugin is never held in memory just to be identified.
fn hash_file(path: &Path) -> std::io::Result<String> {
    let file = std::fs::File::open(path)?;
    let mut hasher = blake3::Hasher::new();
    hasher.update_reader(file)?;
    Ok(hasher.finalize().to_hex().to_string())
}

/// Maps the library into this process (running its initialisers) and checks its ABI; returns
/// its root module and the ABI version it was built for.
fn open_library(path: &Path) -> Result<(PluginModRef, String), LoadError> {
    let header = lib_header_from_path(path).map_err(|err| classify(path, err))?;
    let found = header.version_strings().version.to_string();
    let found_major = found.split('.').next().and_then(|m| m.parse::<u32>().ok());
    if found_major != Some(attnbench_abi::abi_major()) {
        return Err(LoadError::OtherMajor {
            path: path.to_path_buf(),
            found,
        });
    }
    let module = header
        .init_root_module::<PluginModRef>()
        .map_err(|err| match err {
            LibraryError::AbiInstability(_) | LibraryError::IncompatibleVersionNumber { .. } => {
                LoadError::Layout {
                    path: path.to_path_buf(),
                    found: found.split('.').next().unwrap_or_default().to_string(),
                }
            }
            other => classify(path, other),
        })?;
    Ok((module, found))
}

fn checked_manifest(path: &Path, json: &str) -> Result<PluginManifest, LoadError> {
    parse_manifest(json).map_err(|reason| LoadError::Manifest {
        path: path.to_path_buf(),
        reason,
    })
}

fn parse_manifest(json: &str) -> Result<PluginManifest, String> {
    let value: serde_json::Value =
        serde_json::from_str(json).map_err(|err| format!("not JSON ({err})"))?;
    if let Some(message) = value.get("manifest_error").and_then(|v| v.as_str()) {
        return Err(message.to_string());
    }
    let manifest: PluginManifest = serde_json::from_value(value).map_err(|err| err.to_string())?;
    manifest.validate().map_err(|err| err.to_string())?;
    Ok(manifest)
}

fn classify(path: &Path, err: LibraryError) -> LoadError {
    let path = path.to_path_buf();
    match err {
        LibraryError::OpenError { err, .. } => LoadError::Open { path, reason: first_line(&err.to_string()) },
        LibraryError::GetSymbolError { .. } => LoadError::NotAPlugin(path),
        LibraryError::RootModule { err, .. } => LoadError::Init { path, reason: first_line(&err.to_string()) },
        LibraryError::InvalidAbiHeader(_) | LibraryError::InvalidCAbi { .. } => LoadError::Init {
            path,
            reason: "it was built with an incompatible abi_stable; rebuild it against this attnbench's attnbench-sdk".into(),
        },
        other => LoadError::Init { path, reason: first_line(&other.to_string()) },
    }
}

fn first_line(text: &str) -> String {
    text.lines().next().unwrap_or_default().trim().to_string()
}

/// Where plugins are looked for, in order: `--plugin-dir`s, `ATTNBENCH_PLUGIN_PATH`, then the
/// folder of the running binary (a workspace's `target/<profile>`) and `../plugins` beside it.
pub fn search_path(plugin_dirs: &[PathBuf]) -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = plugin_dirs.to_vec();
    if let Some(paths) = std::env::var_os("ATTNBENCH_PLUGIN_PATH") {
        dirs.extend(std::env::split_paths(&paths).filter(|p| !p.as_os_str().is_empty()));
    }
    if let Some(exe_dir) = std::env::current_exe()
        .ok()
        .and_then(|exe| exe.parent().map(Path::to_path_buf))
    {
        dirs.push(exe_dir.join("../plugins"));
        dirs.push(exe_dir);
    }
    let mut unique = Vec::new();
    for dir in dirs {
        let dir = dir.canonicalize().unwrap_or(dir);
        if !unique.contains(&dir) {
            unique.push(dir);
        }
    }
    unique
}

fn is_library(path: &Path) -> bool {
    let name = path
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or_default();
    name.ends_with(std::env::consts::DLL_SUFFIX) && path.is_file()
}

/// The plugins found on the search path, by name. The first library of a name wins.
#[derive(Debug, Default)]
pub struct Registry {
    pub dirs: Vec<PathBuf>,
    plugins: BTreeMap<String, Arc<Plugin>>,
    /// Libraries that were found but could not be used, with the reason.
    pub rejected: Vec<(PathBuf, String)>,
}

impl Registry {
    /// Every library on the search path, known by its manifest; none is loaded into this
    /// process once [`configure_manifests`] has named a reader.
    pub fn discover(plugin_dirs: &[PathBuf]) -> Registry {
        let dirs = search_path(plugin_dirs);
        let mut libraries = Vec::new();
        for dir in &dirs {
            let Ok(entries) = std::fs::read_dir(dir) else {
                continue;
            };
            let mut found: Vec<PathBuf> = entries
                .flatten()
                .map(|e| e.path())
                .filter(|p| is_library(p))
                .collect();
            found.sort();
            libraries.extend(found);
        }
        let mut registry = Registry {
            dirs,
            ..Registry::default()
        };
        for (library, described) in libraries.iter().zip(manifests::describe_all(&libraries)) {
            registry.add(library, described);
        }
        registry
    }

    pub fn add_library(&mut self, path: &Path) {
        self.add(path, Plugin::describe(path));
    }

    /// A registry of plugins known by their manifests alone, for tests of what runs before any
    /// plugin code does (checking, planning, keys): a library that is never loaded.
    #[cfg(test)]
    pub fn of_manifests(manifests: Vec<PluginManifest>) -> Registry {
        let mut registry = Registry::default();
        for manifest in manifests {
            let path = PathBuf::from(format!("/nonexistent/lib{}.so", manifest.name));
            let plugin = Plugin {
                library_hash: format!("hash of {}", manifest.name),
                path: path.clone(),
                manifest,
                module: OnceLock::new(),
            };
            registry.add(&path, Ok(plugin));
        }
        registry
    }

    fn add(&mut self, path: &Path, described: Result<Plugin, LoadError>) {
        match described {
            Ok(plugin) => {
                let name = plugin.manifest.name.clone();
                if let Some(existing) = self.plugins.get(&name) {
                    if existing.path != plugin.path {
                        tracing::warn!(
                            "plugin `{name}` at {} is shadowed by {} (earlier on the search path)",
                            plugin.path.display(),
                            existing.path.display()
                        );
                    }
                } else {
                    self.plugins.insert(name, Arc::new(plugin));
                }
            }
            Err(err) => {
                tracing::debug!("skipping {}: {err}", path.display());
                self.rejected.push((path.to_path_buf(), err.to_string()));
            }
        }
    }

    pub fn get(&self, name: &str) -> Option<&Arc<Plugin>> {
        self.plugins.get(name)
    }

    pub fn plugins(&self) -> impl Iterator<Item = &Arc<Plugin>> {
        self.plugins.values()
    }

    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.plugins.keys().map(String::as_str)
    }
}

/// A sink for nodes run outside a pipeline (`mask show`, `plugins check`): logs go to `tracing`.
struct StandaloneSink<'a> {
    plugin: &'a str,
}

impl ServiceSink for StandaloneSink<'_> {
    fn log(&self, level: attnbench_abi::LogLevel, message: &str) {
        crate::host::services::trace_plugin_log(self.plugin, "-", level, message);
    }

    fn progress(&self, _done: u64, _total: u64, _message: &str) {}

    fn is_cancelled(&self) -> bool {
        false
    }
}

impl Plugin {
    /// Runs `stage` once in this process with `given` parameters (defaults applied, types
    /// checked) and `inputs`, writing its files into `output_dir`; returns the result JSON.
    pub fn call(
        &self,
        stage: &str,
        given: &serde_json::Map<String, serde_json::Value>,
        seed: u64,
        output_dir: &Path,
        inputs: Vec<attnbench_sdk::InputArtifact>,
    ) -> Result<serde_json::Value, CallError> {
        let spec = self.stage(stage).ok_or_else(|| CallError::NoStage {
            plugin: self.manifest.name.clone(),
            stage: stage.to_string(),
        })?;
        let params = spec.resolve_params(given)?;
        let request = attnbench_sdk::StageRequest {
            node: format!("{}/{stage}", self.manifest.name),
            stage: stage.to_string(),
            params,
            seed,
            output_dir: output_dir.to_path_buf(),
            inputs,
            plugins: Default::default(),
            cache_dir: None,
        };
        let request = serde_json::to_string(&request).map_err(CallError::Request)?;
        let text = self
            .run(
                stage,
                &request,
                &StandaloneSink {
                    plugin: &self.manifest.name,
                },
            )
            .map_err(|failure| CallError::Stage(failure.message))?;
        serde_json::from_str(&text).map_err(CallError::Result)
    }
}
