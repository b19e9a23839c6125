//! `cache import`: bringing another cache's (or an export's) entries and run records into this
//! one. Everything is first copied into a staging folder inside this cache, without following
//! links, and checked there — the staged copy is what will be kept, so it is what is checked;
//! only when every entry and record passes is anything moved into place, one rename per entry
//! and per run. An import that fails leaves the cache as it was.
//!
//! The digests prove that what arrives is what was exported; they cannot prove who made it:
//! anyone who can write an export can also recompute its digests, so an export is trusted input.

use std::path::{Path, PathBuf};

use super::tree::{bad_name, copy_tree, is_key, kind, plain_name, read_dir, Kind, TreeError};
use super::{unique_suffix, verify_entry, Cache, CacheError, EntryError, Staging};
use crate::record::{RecordError, RunRecord};

/// What an import brought in.
#[derive(Debug, Default)]
pub struct Imported {
    pub added: usize,
    /// Entries this cache had already.
    pub present: usize,
    pub runs: usize,
}

/// Why an import failed: every problem, each naming its path, and how much had already been
/// moved in (nothing, unless moving itself failed after every check passed).
#[derive(Debug, Default)]
pub struct ImportFailed {
    pub problems: Vec<ImportProblem>,
    pub placed: usize,
}

/// One thing wrong with what is imported, or with moving it in.
#[derive(Debug, thiserror::Error)]
pub enum ImportProblem {
    #[error("{}: not a cache or an export (it has no cache/ folder)", .0.display())]
    NotACache(PathBuf),
    #[error("{}: not a cache shard folder", .0.display())]
    NotAShard(PathBuf),
    #[error("{}: not an entry folder (an entry is cache/<first 2 digits>/<64 hex digits>)", .0.display())]
    NotAnEntry(PathBuf),
    #[error("{}: not a folder", .0.display())]
    NotAFolder(PathBuf),
    #[error("{}: {source}", path.display())]
    Entry { path: PathBuf, source: EntryError },
    #[error(transparent)]
    Tree(#[from] TreeError),
    #[error(transparent)]
    Record(#[from] RecordError),
    /// A run record that parses but cannot be this cache's: its id or a key is wrong.
    #[error("{}: {why}", path.display())]
    Run { path: PathBuf, why: String },
    #[error(transparent)]
    Cache(#[from] CacheError),
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
        .map_err(|err| fail(vec![err.into()]))?;
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
            Err(err) => problems.push(err.into()),
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
    problems: &mut Vec<ImportProblem>,
) -> Result<(), ImportProblem> {
    let root = source.join("cache");
    if !root.is_dir() {
        return Err(ImportProblem::NotACache(source.to_path_buf()));
    }
    kind(&root)?;
    let mut seen = std::collections::HashSet::new();
    for shard in read_dir(&root)? {
        let shard_name = plain_name(&shard)?;
        if kind(&shard)? != Kind::Dir {
            problems.push(ImportProblem::NotAShard(shard));
            continue;
        }
        for dir in read_dir(&shard)? {
            let key = plain_name(&dir)?;
            if !is_key(&key) || !key.starts_with(&shard_name) || shard_name.len() != 2 {
                problems.push(ImportProblem::NotAnEntry(dir));
                continue;
            }
            if kind(&dir)? != Kind::Dir {
                problems.push(ImportProblem::NotAFolder(dir));
                continue;
            }
            let invalid = |source| ImportProblem::Entry {
                path: dir.clone(),
                source,
            };
            if cache.entry_dir(&key).exists() || !seen.insert(key.clone()) {
                // Already here: checked in place, so a damaged export is still reported.
                match verify_entry(&dir) {
                    Ok(_) => *present += 1,
                    Err(source) => problems.push(invalid(source)),
                }
                continue;
            }
            let target = into.join("cache").join(&key);
            let checked = copy_tree(&dir, &target)
                .map_err(EntryError::from)
                .and_then(|_| verify_entry(&target).map(|_| ()));
            match checked {
                Ok(()) => staged.entries.push((key, target)),
                Err(source) => problems.push(invalid(source)),
            }
        }
    }

    let runs = source.join("runs");
    if !runs.exists() {
        return Ok(());
    }
    if kind(&runs)? != Kind::Dir {
        return Err(ImportProblem::NotAFolder(runs));
    }
    for run in read_dir(&runs)? {
        // Beside the run folders only `latest` (a file) is expected; files are not runs.
        match kind(&run) {
            Ok(Kind::File) => continue,
            Ok(Kind::Dir) => {}
            Err(err) => {
                problems.push(err.into());
                continue;
            }
        }
        let id = match plain_name(&run) {
            Ok(id) => id,
            Err(err) => {
                problems.push(err.into());
                continue;
            }
        };
        if !run.join("run.json").exists() || cache.runs_dir().join(&id).exists() {
            continue;
        }
        let target = into.join("runs").join(&id);
        match copy_tree(&run, &target)
            .map_err(ImportProblem::from)
            .and_then(|_| check_run(&id, &target))
        {
            Ok(()) => staged.runs.push((id, target)),
            Err(problem) => problems.push(problem),
        }
    }
    Ok(())
}

/// A staged run folder's record must parse, be the run its folder names, and name only keys.
fn check_run(id: &str, dir: &Path) -> Result<(), ImportProblem> {
    let record = RunRecord::read(dir)?;
    let refuse = |why| ImportProblem::Run {
        path: dir.join("run.json"),
        why,
    };
    if record.id != id {
        return Err(refuse(format!(
            "its id `{}` is not its folder's name `{id}`",
            record.id
        )));
    }
    for node in &record.nodes {
        if let Some(key) = node.key.as_ref().filter(|key| !is_key(key)) {
            return Err(refuse(format!(
                "node `{}` has key `{key}`, not 64 hex digits",
                node.id
            )));
        }
    }
    Ok(())
}

fn place_entry(cache: &Cache, key: &str, staged: &Path) -> Result<bool, CacheError> {
    let target = cache.entry_dir(key);
    let _lock = cache.lock_key(key)?;
    if target.exists() {
        return Ok(false);
    }
    std::fs::create_dir_all(target.parent().unwrap_or(&cache.root))
        .and_then(|_| std::fs::rename(staged, &target))
        .map_err(super::io(&target))?;
    Ok(true)
}

/// Points the record's nodes at this cache's entries and logs, then moves the run into place.
fn place_run(cache: &Cache, id: &str, staged: &Path) -> Result<bool, ImportProblem> {
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
    record.write(staged).map_err(super::io(staged))?;
    std::fs::rename(staged, &destination).map_err(super::io(&destination))?;
    Ok(true)
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
