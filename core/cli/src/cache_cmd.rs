//! `attnbench cache ls | verify | gc`.

use std::collections::HashSet;
use std::process::ExitCode;

use anyhow::Result;
use attnbench_runtime::cache::Cache;
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
