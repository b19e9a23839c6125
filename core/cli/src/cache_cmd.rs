//! `attnbench cache ls | verify | gc | export | import`.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use attnbench_runtime::cache::{copy_tree, is_key, live_keys, Cache};
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
    /// Remove entries that no pipeline's latest runs need, and leftovers of killed runs
    ///
    /// Kept: what each pipeline's runs named, back to its newest run that did every node, and
    /// what an unfinished run (stopped, out of time budget, killed) may need when resumed.
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
    /// Everything is copied into a staging folder and checked there first — every entry's
    /// digests and key, every run record — links and special files are refused, and only then
    /// is anything moved in; if anything fails, nothing is imported. Entries this cache already
    /// has are left as they are. An export is trusted input: its digests prove it arrived as it
    /// was made, not who made it, so import only exports from people and machines you trust.
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
                // A failure seen while a run replaces the entry (`--force`) is not corruption:
                // only a check under the key's lock, where no commit is under way, counts.
                let recheck = |reason: attnbench_runtime::cache::EntryError| {
                    let key = path
                        .file_name()
                        .and_then(|n| n.to_str())
                        .unwrap_or_default();
                    match is_key(key).then(|| cache.lock_key(key)) {
                        Some(Ok(_lock)) => cache.verify_dir(path).map(|_| ()),
                        _ => Err(reason),
                    }
                };
                if let Err(reason) = cache.verify_dir(path).map(|_| ()).or_else(recheck) {
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
            let entries = cache.entries();
            let mut keep = HashSet::new();
            if !all {
                let mut records = Vec::new();
                for dir in run_dirs(&cache.runs_dir()) {
                    // An unreadable record might be the one naming what a resumed run needs.
                    let record = RunRecord::read(&dir).map_err(|err| {
                        anyhow::anyhow!(
                            "{err}; gc cannot tell what that run needs: fix or remove {}, or use `cache gc --all`",
                            display_path(&dir)
                        )
                    })?;
                    records.push(record);
                }
                let metas: Vec<_> = entries
                    .iter()
                    .filter_map(|(_, meta)| meta.as_ref().ok().cloned())
                    .collect();
                keep = live_keys(&records, &metas);
            }
            let mut removed = 0;
            let mut kept = 0;
            let mut freed = 0u64;
            for (path, meta) in entries {
                let key = meta.as_ref().map(|m| m.key.clone()).unwrap_or_default();
                if keep.contains(&key) {
                    kept += 1;
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
                kept
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
        for node in record.nodes {
            match node.key {
                Some(key) if is_key(&key) => {
                    keys.insert(key);
                }
                Some(key) => bail!(
                    "{}: node `{}` has key `{key}`, not 64 hex digits; that record is damaged",
                    display_path(&run.join("run.json")),
                    node.id
                ),
                None => {}
            }
        }
    }
    let target = Cache::open(dir).with_context(|| display_path(dir))?;
    let mut copied = 0;
    for key in &keys {
        let entry = cache.entry_dir(key);
        if entry.exists() {
            // Checked and copied without following links, so an export carries only what the
            // entry was committed with.
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
    for dir in dirs {
        if !dir.join("cache").is_dir() {
            bail!(
                "{}: not a cache or an export (it has no cache/ folder)",
                display_path(dir)
            );
        }
    }
    let _store = cache.lock_store(false)?;
    match attnbench_runtime::cache::import(cache, dirs) {
        Ok(imported) => {
            println!(
                "imported {} entries ({} already here) and {} run records into {}",
                imported.added,
                imported.present,
                imported.runs,
                display_path(&cache.root)
            );
            Ok(ExitCode::SUCCESS)
        }
        Err(failed) => {
            for problem in &failed.problems {
                println!("rejected {problem}");
            }
            let count = failed.problems.len();
            let plural = if count == 1 { "" } else { "s" };
            if failed.placed == 0 {
                println!(
                    "imported nothing: {count} problem{plural} found; {} is unchanged (fix them at the source: `attnbench --cache DIR cache verify --repair` removes damaged entries)",
                    display_path(&cache.root)
                );
            } else {
                println!(
                    "every check passed, but moving into {} failed after {} entries and run records were in: {count} problem{plural}",
                    display_path(&cache.root),
                    failed.placed
                );
            }
            Ok(ExitCode::from(1))
        }
    }
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
        copy_tree(run, &destination).map_err(anyhow::Error::msg)?;
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
