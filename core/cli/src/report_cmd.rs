//! `attnbench report`: one report from the measurements of earlier runs — runs of several
//! pipelines, interrupted runs, runs made on other machines and copied back — without running a
//! pipeline. A sweep that did not fit one session or one batch job still ends in one report.
//! Cost-model predictions found beside the measurements are drawn too.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::SystemTime;

use anyhow::{anyhow, bail, Context, Result};
use attnbench_runtime::host::plugin::Registry;
use attnbench_runtime::record::RunRecord;
use attnbench_sdk::measure::{Measurement, Predictions};
use attnbench_sdk::InputArtifact;
use clap::Args;
use serde_json::{json, Map, Value};

#[derive(Args)]
pub struct ReportArgs {
    /// Run directories (or their run.json), cache directories, or any folders holding
    /// measurement records; a cell measured more than once is reported from its newest record.
    #[arg(required = true, value_name = "PATH")]
    paths: Vec<PathBuf>,
    /// The folder to write the report into (created; must be empty if it exists).
    #[arg(long, value_name = "DIR")]
    out: PathBuf,
    #[arg(long, default_value = "attnbench report")]
    title: String,
    /// Only the tables (results.csv, results.json, summary.md), no plots or HTML.
    #[arg(long)]
    table: bool,
}

/// One measurement found on disk, with what identifies its cell.
struct Found {
    cell: String,
    /// When it was recorded (see [`recorded_at`]): the newest record of a cell wins.
    recorded: (SystemTime, SystemTime),
    input: InputArtifact,
}

pub fn run(args: ReportArgs, plugin_dirs: &[PathBuf]) -> Result<ExitCode> {
    let inputs: Vec<InputArtifact> = newest_by_cell(&args.paths)?.into_values().collect();
    if args.out.exists()
        && std::fs::read_dir(&args.out)
            .with_context(|| format!("{}", args.out.display()))?
            .next()
            .is_some()
    {
        bail!(
            "{}: not empty; give --out a new or empty folder",
            args.out.display()
        );
    }
    std::fs::create_dir_all(&args.out).with_context(|| format!("{}", args.out.display()))?;
    let registry = Registry::discover(plugin_dirs);
    let plugin = registry.get("report").ok_or_else(|| {
        anyhow!("the report plugin was not found; build it with `cargo build --release --workspace` or pass --plugin-dir")
    })?;
    let mut given = Map::new();
    given.insert("title".into(), json!(args.title));
    let stage = if args.table { "table" } else { "html" };
    let count = inputs.len();
    let result = plugin
        .call(stage, &given, 0, &args.out, inputs)
        .map_err(|err| anyhow!("report/{stage}: {err}"))?;
    let main_file = if args.table {
        "summary.md"
    } else {
        "report.html"
    };
    println!(
        "{count} measurements, {} not ok → {}",
        result["failed"].as_u64().unwrap_or(0),
        args.out.join(main_file).display()
    );
    Ok(ExitCode::SUCCESS)
}

/// The records under `paths` (see [`ReportArgs::paths`]), the newest of each cell, by what
/// identifies the cell; a path without any is an error.
pub fn newest_by_cell(paths: &[PathBuf]) -> Result<BTreeMap<String, InputArtifact>> {
    let mut found = Vec::new();
    for path in paths {
        let before = found.len();
        collect(path, &mut found)?;
        if found.len() == before {
            bail!(
                "{}: no measurement records ({}) in it or below it; give a run directory, a cache directory or a folder of measurements",
                path.display(),
                Measurement::FILE
            );
        }
    }
    // The newest record of each cell wins: a rerun replaces what it measured again.
    let mut cells: BTreeMap<String, Found> = BTreeMap::new();
    for item in found {
        match cells.get(&item.cell) {
            Some(kept) if kept.recorded > item.recorded => {}
            _ => {
                cells.insert(item.cell.clone(), item);
            }
        }
    }
    Ok(cells.into_iter().map(|(cell, f)| (cell, f.input)).collect())
}

/// Everything under `path`: a run record's measured nodes, or every measurement record found by
/// walking the folders.
fn collect(path: &Path, found: &mut Vec<Found>) -> Result<()> {
    let run_dir = if path.file_name().is_some_and(|name| name == "run.json") {
        path.parent().map(Path::to_path_buf)
    } else if path.join("run.json").is_file() {
        Some(path.to_path_buf())
    } else {
        None
    };
    if let Some(dir) = run_dir {
        let record = RunRecord::read(&dir).map_err(|err| anyhow!("{}: {err}", dir.display()))?;
        for node in record.nodes {
            let Some(artifact) = node.artifact else {
                continue;
            };
            if let Some(entry) = artifact.parent().filter(|e| e.join("entry.json").exists()) {
                if !entry_is_valid(entry) {
                    continue;
                }
            }
            if let Some(item) = read_artifact(&artifact, &node.id, &node.uses, node.params)? {
                found.push(item);
            }
        }
        return Ok(());
    }
    if !path.is_dir() {
        bail!(
            "{}: neither a run directory nor a folder (no such file or directory?)",
            path.display()
        );
    }
    // Given an entry's `files/` itself: the entry is checked as if walked into.
    if let Some(entry) = path
        .parent()
        .filter(|e| path.ends_with("files") && e.join("entry.json").exists())
    {
        if !entry_is_valid(entry) {
            return Ok(());
        }
    }
    walk(path, found)
}

/// Whether the cache entry at `dir` holds exactly what it was committed with; a measurement in an
/// entry that fails (a damaged file, or one added to it afterwards) is not reported. Says why on
/// stderr.
fn entry_is_valid(dir: &Path) -> bool {
    match attnbench_runtime::cache::verify_entry(dir) {
        Ok(_) => true,
        Err(reason) => {
            eprintln!(
                "skipping cache entry {}: {reason} (`attnbench cache verify` lists such entries)",
                dir.display()
            );
            false
        }
    }
}

fn walk(dir: &Path, found: &mut Vec<Found>) -> Result<()> {
    if dir.join("entry.json").exists() && !entry_is_valid(dir) {
        return Ok(());
    }
    let node = dir
        .file_name()
        .map(|name| name.to_string_lossy().into_owned())
        .unwrap_or_default();
    if let Some(item) = read_artifact(dir, &node, "", Map::new())? {
        found.push(item);
    }
    let entries = std::fs::read_dir(dir).with_context(|| format!("{}", dir.display()))?;
    for entry in entries.flatten() {
        if entry.file_type().is_ok_and(|t| t.is_dir()) {
            walk(&entry.path(), found)?;
        }
    }
    Ok(())
}

/// When a record was made: the creation time of its cache entry (to the second), which `cache
/// export` and `cache import` carry along where copies get new file times; then the file's
/// modification time.
fn recorded_at(path: &Path) -> (SystemTime, SystemTime) {
    let entry = path
        .parent()
        .and_then(Path::parent)
        .map(|dir| dir.join("entry.json"));
    let modified = std::fs::metadata(path)
        .and_then(|m| m.modified())
        .unwrap_or(SystemTime::UNIX_EPOCH);
    let created = entry
        .and_then(|entry| std::fs::read(entry).ok())
        .and_then(|bytes| serde_json::from_slice::<Value>(&bytes).ok())
        .and_then(|meta| humantime::parse_rfc3339(meta["created"].as_str()?).ok())
        .unwrap_or(modified);
    (created, modified)
}

/// The artifact in `dir` if it holds a measurement record or cost-model predictions.
fn read_artifact(
    dir: &Path,
    node: &str,
    uses: &str,
    params: Map<String, Value>,
) -> Result<Option<Found>> {
    let measurement = dir.join(Measurement::FILE);
    let (path, cell) = if let Ok(bytes) = std::fs::read(&measurement) {
        let record: Measurement = serde_json::from_slice(&bytes)
            .with_context(|| format!("{}: not a measurement record", measurement.display()))?;
        (measurement, record.cell())
    } else if dir.join(Predictions::FILE).is_file() {
        (dir.join(Predictions::FILE), dir.display().to_string())
    } else {
        return Ok(None);
    };
    Ok(Some(Found {
        cell,
        recorded: recorded_at(&path),
        input: InputArtifact {
            node: node.to_string(),
            uses: uses.to_string(),
            params,
            coords: Map::new(),
            dir: dir.to_path_buf(),
            result: Value::Null,
            status: "ok".into(),
            error: None,
        },
    }))
}
