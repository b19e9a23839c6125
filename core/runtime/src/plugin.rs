//! Finding, loading and calling plugin libraries.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use attnbench_abi::abi_stable::library::{lib_header_from_path, LibraryError};
use attnbench_abi::abi_stable::std_types::{RResult, RStr};
use attnbench_abi::{PluginModRef, ABI_VERSION};
use attnbench_sdk::{PluginManifest, StageSpec};

use crate::services::{services_for, ServiceSink};

/// Why a library could not be used as a plugin; always one sentence.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("plugin library {0} does not exist")]
    Missing(PathBuf),
    #[error("cannot load {path}: {reason}")]
    Open { path: PathBuf, reason: String },
    #[error("{0} is a shared library but not an attnbench plugin: it exports no attnbench root module (plugins call attnbench_sdk::export_plugin!)")]
    NotAPlugin(PathBuf),
    #[error("{path} was built for plugin ABI {found} but this attnbench speaks ABI {ABI_VERSION}; rebuild the plugin against an attnbench-sdk of ABI major {major}", major = attnbench_abi::abi_major())]
    OtherMajor { path: PathBuf, found: String },
    #[error("{path} was built for plugin ABI {found}, whose interface layout differs from this attnbench's ABI {ABI_VERSION}; rebuild the plugin against the attnbench-sdk this attnbench ships")]
    Layout { path: PathBuf, found: String },
    #[error("{path} failed to initialise: {reason}")]
    Init { path: PathBuf, reason: String },
    #[error("{path} has an invalid manifest: {reason}")]
    Manifest { path: PathBuf, reason: String },
}

/// A loaded plugin library. Libraries stay loaded for the life of the process.
pub struct Plugin {
    pub path: PathBuf,
    /// blake3 of the library file: part of every cache key, so a rebuilt plugin reruns its nodes.
    pub library_hash: String,
    pub manifest: PluginManifest,
    module: PluginModRef,
}

impl std::fmt::Debug for Plugin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Plugin")
            .field("path", &self.path)
            .field("name", &self.manifest.name)
            .finish()
    }
}

impl Plugin {
    pub fn load(path: &Path) -> Result<Plugin, LoadError> {
        if !path.is_file() {
            return Err(LoadError::Missing(path.to_path_buf()));
        }
        let path = path.canonicalize().unwrap_or_else(|_| path.to_path_buf());
        let bytes = std::fs::read(&path).map_err(|err| LoadError::Open {
            path: path.clone(),
            reason: err.to_string(),
        })?;
        let library_hash = blake3::hash(&bytes).to_hex().to_string();
        let header = lib_header_from_path(&path).map_err(|err| classify(&path, err))?;
        let found = header.version_strings().version.to_string();
        let found_major = found.split('.').next().and_then(|m| m.parse::<u32>().ok());
        if found_major != Some(attnbench_abi::abi_major()) {
            return Err(LoadError::OtherMajor { path, found });
        }
        let module = header
            .init_root_module::<PluginModRef>()
            .map_err(|err| match err {
                LibraryError::AbiInstability(_)
                | LibraryError::IncompatibleVersionNumber { .. } => LoadError::Layout {
                    path: path.clone(),
                    found: found.clone(),
                },
                other => classify(&path, other),
            })?;
        let manifest_json = (module.manifest())();
        let manifest =
            parse_manifest(manifest_json.as_str()).map_err(|reason| LoadError::Manifest {
                path: path.clone(),
                reason,
            })?;
        Ok(Plugin {
            path,
            library_hash,
            manifest,
            module,
        })
    }

    /// Runs one node in this process. `Ok` carries the result JSON text, `Err` the plugin's message.
    pub fn run(
        &self,
        stage: &str,
        request_json: &str,
        sink: &impl ServiceSink,
    ) -> Result<String, String> {
        let services = services_for(sink);
        match (self.module.run())(
            RStr::from_str(stage),
            RStr::from_str(request_json),
            &services,
        ) {
            RResult::ROk(text) => Ok(text.into_string()),
            RResult::RErr(text) => Err(text.into_string()),
        }
    }

    pub fn stage(&self, name: &str) -> Option<&StageSpec> {
        self.manifest.find_stage(name)
    }
}

fn parse_manifest(json: &str) -> Result<PluginManifest, String> {
    let value: serde_json::Value =
        serde_json::from_str(json).map_err(|err| format!("not JSON ({err})"))?;
    if let Some(message) = value.get("manifest_error").and_then(|v| v.as_str()) {
        return Err(message.to_string());
    }
    let manifest: PluginManifest = serde_json::from_value(value).map_err(|err| err.to_string())?;
    manifest.validate()?;
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
    /// Libraries that were found but could not be loaded, with the reason.
    pub rejected: Vec<(PathBuf, String)>,
}

impl Registry {
    pub fn discover(plugin_dirs: &[PathBuf]) -> Registry {
        let dirs = search_path(plugin_dirs);
        let mut registry = Registry {
            dirs: dirs.clone(),
            ..Registry::default()
        };
        for dir in &dirs {
            let Ok(entries) = std::fs::read_dir(dir) else {
                continue;
            };
            let mut libraries: Vec<PathBuf> = entries
                .flatten()
                .map(|e| e.path())
                .filter(|p| is_library(p))
                .collect();
            libraries.sort();
            for library in libraries {
                registry.add_library(&library);
            }
        }
        registry
    }

    pub fn add_library(&mut self, path: &Path) {
        match Plugin::load(path) {
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
        crate::services::trace_plugin_log(self.plugin, "-", level, message);
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
    ) -> Result<serde_json::Value, String> {
        let spec = self
            .stage(stage)
            .ok_or_else(|| format!("plugin `{}` has no stage `{stage}`", self.manifest.name))?;
        let params = spec.resolve_params(given)?;
        let request = attnbench_sdk::StageRequest {
            node: format!("{}/{stage}", self.manifest.name),
            stage: stage.to_string(),
            params,
            seed,
            output_dir: output_dir.to_path_buf(),
            inputs,
            plugins: Default::default(),
        };
        let request = serde_json::to_string(&request).map_err(|err| err.to_string())?;
        let text = self.run(
            stage,
            &request,
            &StandaloneSink {
                plugin: &self.manifest.name,
            },
        )?;
        serde_json::from_str(&text).map_err(|err| format!("malformed result: {err}"))
    }
}
