//! `attnbench cache ls | verify | gc | export | import`.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use attnbench_runtime::cache::{copy_tree, Cache};
use attnbench_runtime::record::{run_dirs, RunRecord};
use clap::Subcommand;

use crate::display_path;

#[derive(Subcommand)]
pub enum CacheCommand {
    /// List cache entries: node, stage, size, age.
    Ls,
    /// Re-hash every entry and report those that do not match their digests.
    Verify {
        /// Remove corrupted entries (the next run recomputes them).
        #[arg(long)]
        repair: bool,
    },
    /// Remove entries that the latest run of every pipeline did not use, and leftovers of killed runs.
    Gc {
        /// Remove every entry.
        #[arg(long)]
        all: bool,
        /// Only say what would be removed.
        #[arg(long)]
        dry_run: bool,
    },
    /// Copy the entries and records of runs (default: the latest) into DIR, laid out as a cache
    ///
    /// Carry DIR to another machine and `cache import` it there: a sweep cut short on one
    /// machine resumes on the next, and its report covers both.
    Export {
        dir: PathBuf,
        /// A run id (a folder name under the cache's runs/); repeatable.
        #[arg(long = "run", value_name = "ID")]
        runs: Vec<String>,
    },
    /// Add the entries and run records of other caches or exports to this one
    ///
    /// Every entry's digests and key are checked; entries this cache already has are left as
    /// they are.
    Import {
        #[arg(required = true, value_name = "DIR")]
        dirs: Vec<PathBuf>,
    },
}

pub fn run(command: CacheCommand, cache: &Cache) -> Result<ExitCode> {
    match command {
        CacheCommand::Ls => {
            let entries = cache.entries();
            let mut total = 0u64;
            for (path, meta) in &entries {
                match meta {
                    Ok(meta) => {
                        total += meta.bytes;
                        println!(
                            "{}  {:>9}  {}  {:<24} {}",
                            &meta.key[..12],
                            human_bytes(meta.bytes),
                            meta.created,
                            meta.uses,
                            meta.node
                        );
                    }
                    Err(reason) => println!("{}  unreadable: {reason}", display_path(path)),
                }
            }
            println!(
                "{} entries, {} in {}",
                entries.len(),
                human_bytes(total),
                display_path(&cache.root)
            );
            Ok(ExitCode::SUCCESS)
        }
        CacheCommand::Verify { repair } => {
            let _store = cache.lock_store(repair)?;
            let entries = cache.entries();
            let mut bad = 0;
            for (path, _) in &entries {
                if let Err(reason) = cache.verify_dir(path) {
                    bad += 1;
                    println!("corrupted {}: {reason}", display_path(path));
                    if repair {
                        cache.discard(path);
                    }
                }
            }
            println!(
                "{} entries checked, {bad} corrupted{}",
                entries.len(),
                if repair && bad > 0 {
                    " and removed"
                } else {
                    ""
                }
            );
            Ok(if bad > 0 && !repair {
                ExitCode::from(1)
            } else {
                ExitCode::SUCCESS
            })
        }
        CacheCommand::Export { dir, runs } => export(cache, &dir, &runs),
        CacheCommand::Import { dirs } => import(cache, &dirs),
        CacheCommand::Gc { all, dry_run } => {
            let _store = cache.lock_store(true)?;
            let mut keep = HashSet::new();
            if !all {
                let mut seen = HashSet::new();
                for dir in run_dirs(&cache.runs_dir()) {
                    let Ok(record) = RunRecord::read(&dir) else {
                        continue;
                    };
                    if seen.insert(record.pipeline.clone()) {
                        keep.extend(record.nodes.into_iter().filter_map(|n| n.key));
                    }
                }
            }
            let mut removed = 0;
            let mut freed = 0u64;
            for (path, meta) in cache.entries() {
                let key = meta.as_ref().map(|m| m.key.clone()).unwrap_or_default();
                if keep.contains(&key) {
                    continue;
                }
                removed += 1;
                freed += meta.map(|m| m.bytes).unwrap_or(0);
                if dry_run {
                    println!("would remove {}", display_path(&path));
                } else {
                    cache.discard(&path);
                }
            }
            // Staging directories of killed runs and lock files: nothing holds them now.
            for sub in ["tmp", "locks"] {
                if let Ok(entries) = std::fs::read_dir(cache.root.join(sub)) {
                    for entry in entries.flatten() {
                        if !dry_run {
                            let path = entry.path();
                            let _ = if path.is_dir() {
                                std::fs::remove_dir_all(&path)
                            } else {
                                std::fs::remove_file(&path)
                            };
                        }
                    }
                }
            }
            let verb = if dry_run { "would remove" } else { "removed" };
            println!(
                "{verb} {removed} entries ({}); kept {}",
                human_bytes(freed),
                keep.len()
            );
            Ok(ExitCode::SUCCESS)
        }
    }
}

fn export(cache: &Cache, dir: &Path, ids: &[String]) -> Result<ExitCode> {
    let runs: Vec<PathBuf> = if ids.is_empty() {
        let latest = run_dirs(&cache.runs_dir()).into_iter().next();
        vec![latest.with_context(|| {
            format!(
                "{}: no runs to export; run a pipeline first",
                display_path(&cache.root)
            )
        })?]
    } else {
        ids.iter()
            .map(|id| {
                let dir = cache.runs_dir().join(id);
                if dir.join("run.json").is_file() {
                    Ok(dir)
                } else {
                    bail!(
                        "--run {id}: no such run in {}; the folder names under its runs/ are the ids",
                        display_path(&cache.root)
                    )
                }
            })
            .collect::<Result<_>>()?
    };
    let mut keys = HashSet::new();
    for run in &runs {
        let record = RunRecord::read(run).map_err(anyhow::Error::msg)?;
        keys.extend(record.nodes.into_iter().filter_map(|n| n.key));
    }
    let target = Cache::open(dir).with_context(|| display_path(dir))?;
    let mut copied = 0;
    for key in &keys {
        let entry = cache.entry_dir(key);
        if entry.exists() {
            target
                .adopt(&entry)
                .map_err(|reason| anyhow::anyhow!("{}: {reason}", display_path(&entry)))?;
            copied += 1;
        }
    }
    let recorded = copy_runs(&runs, &target)?;
    println!(
        "exported {copied} entries and {recorded} run records to {}",
        display_path(dir)
    );
    Ok(ExitCode::SUCCESS)
}

fn import(cache: &Cache, dirs: &[PathBuf]) -> Result<ExitCode> {
    let _store = cache.lock_store(false)?;
    let (mut added, mut present, mut rejected, mut recorded) = (0, 0, 0, 0);
    for dir in dirs {
        if !dir.join("cache").is_dir() {
            bail!(
                "{}: not a cache or an export (it has no cache/ folder)",
                display_path(dir)
            );
        }
        // Read in place: importing must not write into the source.
        let source = Cache {
            root: dir.canonicalize().with_context(|| display_path(dir))?,
        };
        for (path, _) in source.entries() {
            match cache.adopt(&path) {
                Ok(true) => added += 1,
                Ok(false) => present += 1,
                Err(reason) => {
                    rejected += 1;
                    println!("rejected {}: {reason}", display_path(&path));
                }
            }
        }
        recorded += copy_runs(&run_dirs(&source.runs_dir()), cache)?;
    }
    println!(
        "imported {added} entries ({present} already here, {rejected} rejected) and {recorded} run records into {}",
        display_path(&cache.root)
    );
    Ok(if rejected > 0 {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    })
}

/// Copies run records that `target` does not have, pointing their nodes at `target`'s entries.
fn copy_runs(runs: &[PathBuf], target: &Cache) -> Result<usize> {
    let mut copied = 0;
    for run in runs {
        let Some(id) = run.file_name() else { continue };
        let destination = target.runs_dir().join(id);
        if destination.exists() {
            continue;
        }
        copy_tree(run, &destination).with_context(|| display_path(&destination))?;
        let mut record = RunRecord::read(&destination).map_err(anyhow::Error::msg)?;
        for node in &mut record.nodes {
            node.artifact = node
                .key
                .as_ref()
                .map(|key| target.entry_dir(key))
                .filter(|entry| entry.exists())
                .map(|entry| entry.join("files"));
        }
        record
            .write(&destination)
            .with_context(|| display_path(&destination))?;
        copied += 1;
    }
    Ok(copied)
}

pub fn human_bytes(bytes: u64) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < units.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.1} {}", units[unit])
    }
}
