//! The plugin authoring kit: `attnbench plugin new` scaffolds a plugin crate, `attnbench plugins
//! check` runs the conformance suite on a library.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use attnbench_runtime::conformance;
use attnbench_runtime::host::plugin::Registry;
use clap::{Subcommand, ValueEnum};

use crate::display_path;

#[derive(Subcommand)]
pub enum PluginCommand {
    /// Write a new plugin crate (outside any workspace) with a working example stage and a test.
    New {
        /// The plugin's name: letters, digits, `-` and `_`.
        name: String,
        #[arg(long, value_enum, default_value_t = Kind::Kernel)]
        kind: Kind,
        /// The folder to create the crate in [default: the current folder].
        #[arg(long, value_name = "DIR")]
        path: Option<PathBuf>,
        /// The attnbench-sdk to depend on: a path to core/sdk of an attnbench checkout
        /// [default: the one this attnbench was built from, if it is still there].
        #[arg(long, value_name = "PATH")]
        sdk: Option<PathBuf>,
    },
}

#[derive(Clone, Copy, ValueEnum)]
pub enum Kind {
    /// A kernel: reads a mask, writes a measurement (checked against the reference).
    Kernel,
    /// Any other stage.
    Stage,
}

const CARGO_TOML: &str = include_str!("../templates/Cargo.toml.txt");
const KERNEL: &str = include_str!("../templates/kernel.rs.txt");
const STAGE: &str = include_str!("../templates/stage.rs.txt");
const README: &str = include_str!("../templates/README.md.txt");

fn default_sdk() -> Option<PathBuf> {
    let built_from = Path::new(env!("CARGO_MANIFEST_DIR")).join("../sdk");
    built_from
        .join("Cargo.toml")
        .is_file()
        .then(|| built_from.canonicalize().unwrap_or(built_from))
}

pub fn run(command: PluginCommand) -> Result<ExitCode> {
    let PluginCommand::New {
        name,
        kind,
        path,
        sdk,
    } = command;
    let valid = !name.is_empty()
        && name.chars().next().is_some_and(|c| c.is_ascii_alphabetic())
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_');
    if !valid {
        bail!(
            "`{name}` is not a plugin name: start with a letter, then letters, digits, `-` or `_`"
        );
    }
    let sdk = match sdk.or_else(default_sdk) {
        Some(sdk) if sdk.join("Cargo.toml").is_file() => sdk.canonicalize()?,
        Some(sdk) => bail!("--sdk {}: no Cargo.toml there; point it at core/sdk of an attnbench checkout", sdk.display()),
        None => bail!("this attnbench was not built from a checkout that is still here; pass --sdk PATH/TO/attnbench/core/sdk"),
    };
    let dir = path.unwrap_or_else(|| PathBuf::from(".")).join(&name);
    if dir.exists() {
        bail!(
            "{} already exists; choose another name or --path",
            dir.display()
        );
    }
    let library = name.replace('-', "_");
    let (source, stage, needs, kind_name) = match kind {
        Kind::Kernel => (KERNEL, "attention", "[masks]", "kernel"),
        Kind::Stage => (STAGE, "count", "{masks: all}", "stage"),
    };
    let fill = |template: &str| {
        template
            .replace("{{name}}", &name)
            .replace("{{crate}}", &name)
            .replace("{{lib}}", &library)
            .replace("{{stage}}", stage)
            .replace("{{needs}}", needs)
            .replace("{{kind}}", kind_name)
            .replace(
                "{{sdk}}",
                &format!("path = {:?}", sdk.display().to_string()),
            )
    };
    std::fs::create_dir_all(dir.join("src"))
        .with_context(|| format!("cannot create {}", dir.display()))?;
    std::fs::write(dir.join("Cargo.toml"), fill(CARGO_TOML))?;
    std::fs::write(dir.join("src/lib.rs"), fill(source))?;
    std::fs::write(dir.join("README.md"), fill(README))?;
    std::fs::write(dir.join(".gitignore"), "/target\n")?;
    println!(
        "created {} ({kind_name} plugin `{name}`, stage `{name}/{stage}`)",
        display_path(&dir)
    );
    println!("next: cd {} && cargo build --release && attnbench plugins check target/release/lib{library}.so", display_path(&dir));
    Ok(ExitCode::SUCCESS)
}

/// `attnbench plugins check LIB...`: prints each check; exit status 1 if any failed.
pub fn check(libraries: &[PathBuf], plugin_dirs: &[PathBuf], json: bool) -> Result<ExitCode> {
    let registry = Registry::discover(plugin_dirs);
    let exe =
        std::env::current_exe().context("cannot find the attnbench binary to start workers")?;
    let discovery = attnbench_gpu_libs::discover();
    let setup = crate::workers::check_setup(&discovery);
    let reports: Vec<conformance::Report> = libraries
        .iter()
        .map(|library| conformance::check(library, &registry, &exe, &setup))
        .collect();
    if json {
        println!("{}", serde_json::to_string_pretty(&reports)?);
    } else {
        for report in &reports {
            println!(
                "{} ({})",
                display_path(&report.library),
                report.plugin.as_deref().unwrap_or("not loaded")
            );
            for check in &report.checks {
                println!(
                    "  {} {}: {}",
                    match (check.skipped, check.passed) {
                        (true, _) => "skip",
                        (false, true) => "pass",
                        (false, false) => "FAIL",
                    },
                    check.name,
                    check.detail
                );
            }
            let failed = report.checks.iter().filter(|c| !c.passed).count();
            let skipped = report.checks.iter().filter(|c| c.skipped).count();
            let skipped = if skipped > 0 {
                format!(", {skipped} skipped")
            } else {
                String::new()
            };
            println!("  {} checks, {failed} failed{skipped}", report.checks.len());
        }
    }
    Ok(if reports.iter().all(conformance::Report::passed) {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}
