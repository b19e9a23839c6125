//! `cache import`: bringing another cache's (or an export's) entries and run records into this
//! one. Everything is first copied into a staging folder inside this cache, without following
//! links, and checked there — the staged copy is what will be kept, so it is what is checked;
//! only when every entry and record passes is anything moved into place, one rename per entry
//! and per run. An import that fails leaves the cache as it was.
//!
//! The digests prove that what arrives is what was exported; they cannot prove who made it:
//! anyone who can write an export can also recompute its digests, so an export is trusted input.

use std::path::{Path, PathBuf};

use super::tree::{bad_name, copy_tree, is_key, kind, Kind};
use super::{unique_suffix, verify_entry, Cache, Staging};
use crate::record::RunRecord;

/// What an import brought in.
#[derive(Debug, Default)]
pub struct Imported {
    pub added: usize,
    /// Entries this cache had already.
    pub present: usize,
    pub runs: usize,
}

/// Why an import failed: one line per problem, each naming its path, and how much had already
/// been moved in (nothing, unless moving itself failed after every check passed).
#[derive(Debug, Default)]
pub struct ImportFailed {
    pub problems: Vec<String>,
    pub placed: usize,
}

struct Staged {
    entries: Vec<(String, PathBuf)>,
    runs: Vec<(String, PathBuf)>,
}

/// Imports `sources` into `cache` (whose store lock the caller holds), all or nothing.
pub fn import(cache: &Cache, sources: &[PathBuf]) -> Result<Imported, ImportFailed> {
    let fail = |problems| ImportFailed {
        problems,
        placed: 0,
    };
    let staging = cache
        .staging_dir("import")
        .map_err(|err| fail(vec![err.to_string()]))?;
    let mut staged = Staged {
        entries: Vec::new(),
        runs: Vec::new(),
    };
    let mut problems = Vec::new();
    let mut present = 0;
    for (index, source) in sources.iter().enumerate() {
        let into = staging.dir.join(index.to_string());
        if let Err(err) = stage_source(
            cache,
            source,
            &into,
            &mut staged,
            &mut present,
            &mut problems,
        ) {
            problems.push(err);
        }
    }
    if !problems.is_empty() {
        return Err(fail(problems));
    }
    let mut imported = Imported {
        present,
        ..Imported::default()
    };
    for (key, dir) in &staged.entries {
        match place_entry(cache, key, dir) {
            Ok(true) => imported.added += 1,
            Ok(false) => imported.present += 1,
            Err(err) => problems.push(err),
        }
    }
    for (id, dir) in &staged.runs {
        match place_run(cache, id, dir) {
            Ok(true) => imported.runs += 1,
            Ok(false) => {}
            Err(err) => problems.push(err),
        }
    }
    if problems.is_empty() {
        Ok(imported)
    } else {
        Err(ImportFailed {
            problems,
            placed: imported.added + imported.runs,
        })
    }
}

fn stage_source(
    cache: &Cache,
    source: &Path,
    into: &Path,
    staged: &mut Staged,
    present: &mut usize,
    problems: &mut Vec<String>,
) -> Result<(), String> {
    let root = source.join("cache");
    if !root.is_dir() {
        return Err(format!(
            "{}: not a cache or an export (it has no cache/ folder)",
            source.display()
        ));
    }
    kind(&root)?;
    let mut seen = std::collections::HashSet::new();
    for shard in read_dir(&root)? {
        let shard_name = plain_name(&shard)?;
        if kind(&shard)? != Kind::Dir {
            problems.push(format!("{}: not a cache shard folder", shard.display()));
            continue;
        }
        for dir in read_dir(&shard)? {
            let key = plain_name(&dir)?;
            if !is_key(&key) || !key.starts_with(&shard_name) || shard_name.len() != 2 {
                problems.push(format!(
                    "{}: not an entry folder (an entry is cache/<first 2 digits>/<64 hex digits>)",
                    dir.display()
                ));
                continue;
            }
            if kind(&dir)? != Kind::Dir {
                problems.push(format!("{}: not a folder", dir.display()));
                continue;
            }
            if cache.entry_dir(&key).exists() || !seen.insert(key.clone()) {
                // Already here: checked in place, so a damaged export is still reported.
                match verify_entry(&dir) {
                    Ok(_) => *present += 1,
                    Err(reason) => problems.push(format!("{}: {reason}", dir.display())),
                }
                continue;
            }
            let target = into.join("cache").join(&key);
            let checked = copy_tree(&dir, &target).and_then(|_| verify_entry(&target).map(|_| ()));
            match checked {
                Ok(()) => staged.entries.push((key, target)),
                Err(reason) => problems.push(format!("{}: {reason}", dir.display())),
            }
        }
    }

    let runs = source.join("runs");
    if !runs.exists() {
        return Ok(());
    }
    if kind(&runs)? != Kind::Dir {
        return Err(format!("{}: not a folder", runs.display()));
    }
    for run in read_dir(&runs)? {
        // Beside the run folders only `latest` (a file) is expected; files are not runs.
        match kind(&run) {
            Ok(Kind::File) => continue,
            Ok(Kind::Dir) => {}
            Err(err) => {
                problems.push(err);
                continue;
            }
        }
        let id = match plain_name(&run) {
            Ok(id) => id,
            Err(err) => {
                problems.push(err);
                continue;
            }
        };
        if !run.join("run.json").exists() || cache.runs_dir().join(&id).exists() {
            continue;
        }
        let target = into.join("runs").join(&id);
        match copy_tree(&run, &target).and_then(|_| check_run(&id, &target)) {
            Ok(()) => staged.runs.push((id, target)),
            Err(reason) => problems.push(reason),
        }
    }
    Ok(())
}

/// A staged run folder's record must parse, be the run its folder names, and name only keys.
fn check_run(id: &str, dir: &Path) -> Result<(), String> {
    let record = RunRecord::read(dir)?;
    let path = dir.join("run.json");
    if record.id != id {
        return Err(format!(
            "{}: its id `{}` is not its folder's name `{id}`",
            path.display(),
            record.id
        ));
    }
    for node in &record.nodes {
        if let Some(key) = &node.key {
            if !is_key(key) {
                return Err(format!(
                    "{}: node `{}` has key `{key}`, not 64 hex digits",
                    path.display(),
                    node.id
                ));
            }
        }
    }
    Ok(())
}

fn place_entry(cache: &Cache, key: &str, staged: &Path) -> Result<bool, String> {
    let target = cache.entry_dir(key);
    let _lock = cache.lock_key(key).map_err(|err| err.to_string())?;
    if target.exists() {
        return Ok(false);
    }
    std::fs::create_dir_all(target.parent().unwrap_or(&cache.root))
        .and_then(|_| std::fs::rename(staged, &target))
        .map_err(|err| format!("{}: {err}", target.display()))?;
    Ok(true)
}

/// Points the record's nodes at this cache's entries and logs, then moves the run into place.
fn place_run(cache: &Cache, id: &str, staged: &Path) -> Result<bool, String> {
    let destination = cache.runs_dir().join(id);
    if destination.exists() {
        return Ok(false);
    }
    let mut record = RunRecord::read(staged)?;
    for node in &mut record.nodes {
        node.artifact = node
            .key
            .as_deref()
            .filter(|key| is_key(key))
            .map(|key| cache.entry_dir(key))
            .filter(|entry| entry.exists())
            .map(|entry| entry.join("files"));
        node.log = node
            .log
            .as_ref()
            .and_then(|log| log.file_name())
            .and_then(|name| name.to_str())
            .filter(|name| bad_name(name).is_none())
            .filter(|name| staged.join("logs").join(name).is_file())
            .map(|name| destination.join("logs").join(name));
    }
    record
        .write(staged)
        .map_err(|err| format!("{}: {err}", staged.display()))?;
    std::fs::rename(staged, &destination)
        .map_err(|err| format!("{}: {err}", destination.display()))?;
    Ok(true)
}

fn read_dir(dir: &Path) -> Result<Vec<PathBuf>, String> {
    let mut paths = Vec::new();
    for item in std::fs::read_dir(dir).map_err(|err| format!("{}: {err}", dir.display()))? {
        paths.push(
            item.map_err(|err| format!("{}: {err}", dir.display()))?
                .path(),
        );
    }
    paths.sort();
    Ok(paths)
}

fn plain_name(path: &Path) -> Result<String, String> {
    let name = path
        .file_name()
        .and_then(|n| n.to_str())
        .ok_or_else(|| format!("{}: the name is not UTF-8", path.display()))?;
    match bad_name(name) {
        Some(why) => Err(format!("{}: {why}", path.display())),
        None => Ok(name.to_string()),
    }
}

impl Cache {
    /// A fresh folder under `tmp/`, removed when dropped.
    pub(crate) fn staging_dir(&self, purpose: &str) -> Result<Staging, super::CacheError> {
        let dir = self
            .root
            .join("tmp")
            .join(format!("{purpose}-{}", unique_suffix()));
        std::fs::create_dir_all(&dir).map_err(super::io(&dir))?;
        Ok(Staging { dir })
    }
}
