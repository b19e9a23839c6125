//! `attnbench plugins list | info`.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{bail, Result};
use attnbench_runtime::diagnostic::suggestion;
use attnbench_runtime::host::plugin::{Plugin, Registry};
use clap::Subcommand;

use crate::display_path;

#[derive(Subcommand)]
pub enum PluginsCommand {
    /// Every plugin found on the search path, and libraries that could not be loaded.
    List,
    /// A plugin's manifest: stages, parameters, caching and isolation.
    Info {
        /// A plugin name, or the path of a plugin library.
        plugin: String,
        /// Print the manifest as JSON.
        #[arg(long)]
        json: bool,
    },
    /// The conformance suite: loads, valid manifest, bad parameters refused, kernels match the
    /// reference on every mask they claim and say `unsupported` on the others.
    Check {
        /// Plugin libraries (paths) or names of installed plugins.
        #[arg(required = true)]
        libraries: Vec<String>,
        /// One JSON report instead of text.
        #[arg(long)]
        json: bool,
    },
}

pub fn run(command: PluginsCommand, plugin_dirs: &[PathBuf]) -> Result<ExitCode> {
    match command {
        PluginsCommand::Check { libraries, json } => {
            let registry = Registry::discover(plugin_dirs);
            let mut paths = Vec::new();
            for library in &libraries {
                if Path::new(library).is_file() || library.contains('/') {
                    paths.push(PathBuf::from(library));
                } else {
                    match registry.get(library) {
                        Some(plugin) => paths.push(plugin.path.clone()),
                        None => bail!(
                            "no plugin `{library}`; {}",
                            suggestion(library, registry.names(), "installed plugins")
                        ),
                    }
                }
            }
            crate::plugin_kit::check(&paths, plugin_dirs, json)
        }
        PluginsCommand::List => {
            let registry = Registry::discover(plugin_dirs);
            if registry.plugins().next().is_none() {
                let dirs: Vec<String> = registry.dirs.iter().map(|d| display_path(d)).collect();
                println!("no plugins found; searched {}", dirs.join(", "));
            }
            for plugin in registry.plugins() {
                let stages: Vec<&str> = plugin
                    .manifest
                    .stages
                    .iter()
                    .map(|s| s.name.as_str())
                    .collect();
                println!(
                    "{:<12} {:<8} abi {:<6} {}",
                    plugin.manifest.name,
                    plugin.manifest.version,
                    plugin.manifest.abi,
                    display_path(&plugin.path)
                );
                println!("{:<12} stages: {}", "", stages.join(", "));
            }
            for (path, reason) in &registry.rejected {
                println!("skipped {}: {reason}", display_path(path));
            }
            Ok(ExitCode::SUCCESS)
        }
        PluginsCommand::Info { plugin, json } => {
            let loaded;
            let registry;
            let plugin_ref: &Plugin = if Path::new(&plugin).is_file() || plugin.contains('/') {
                loaded = Plugin::describe(Path::new(&plugin))?;
                &loaded
            } else {
                registry = Registry::discover(plugin_dirs);
                match registry.get(&plugin) {
                    Some(found) => found,
                    None => bail!(
                        "no plugin `{plugin}`; {}",
                        suggestion(&plugin, registry.names(), "installed plugins")
                    ),
                }
            };
            let manifest = &plugin_ref.manifest;
            if json {
                println!("{}", serde_json::to_string_pretty(manifest)?);
                return Ok(ExitCode::SUCCESS);
            }
            println!(
                "{} {} (ABI {}) — {}",
                manifest.name,
                manifest.version,
                manifest.abi,
                display_path(&plugin_ref.path)
            );
            if !manifest.description.is_empty() {
                println!("{}", manifest.description);
            }
            if !manifest.attention.is_empty() {
                let kernels: Vec<String> = manifest
                    .attention
                    .iter()
                    .map(|kernel| format!("{}/{kernel}", manifest.name))
                    .collect();
                println!("in-process attention backend: {}", kernels.join(", "));
            }
            for stage in &manifest.stages {
                println!();
                println!(
                    "{}/{}  [cache: {}, isolation: {}]",
                    manifest.name, stage.name, stage.cache_scope, stage.isolation
                );
                if !stage.doc.is_empty() {
                    println!("  {}", stage.doc);
                }
                for param in &stage.params {
                    let default = match &param.default {
                        Some(d) => format!(" = {d}"),
                        None if param.optional => " (optional)".into(),
                        None => " (required)".into(),
                    };
                    println!(
                        "  {:<16} {:<14}{default}  {}",
                        param.name,
                        param.ty.to_string(),
                        param.doc
                    );
                }
            }
            Ok(ExitCode::SUCCESS)
        }
    }
}
