//! The content-addressed artifact store.
//!
//! Layout under the cache root (`artifacts/` or `ATTNBENCH_CACHE`):
//! `cache/<2 hex>/<key>/` holds one finished node: `files/` (what the plugin wrote),
//! `result.json` and `entry.json` (key parts, digests). An entry appears by renaming a complete
//! staging directory from `tmp/`, so it is either whole or absent; a killed run leaves only
//! `tmp/` debris, which `cache gc` removes. Reads re-hash the files, so a corrupted entry is
//! noticed and recomputed instead of trusted; a file in an entry that its metadata does not list
//! makes the entry invalid too, since nothing vouches for it.

mod gc;
mod import;
mod lock;
mod tree;
mod verify;

pub use gc::live_keys;
pub use import::{import, ImportFailed, Imported};
use lock::exchange;
pub use lock::KeyLock;
pub use tree::{copy_tree, is_key, TreeError};
pub use verify::{verify_entry, EntryError};

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::key::KeyParts;

#[derive(Debug, thiserror::Error)]
pub enum CacheError {
    #[error("cache {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cache entry {} is unreadable: {source}", path.display())]
    Entry { path: PathBuf, source: EntryError },
    #[error("{source}; a stage's output must be regular files and folders")]
    Output { source: TreeError },
    /// Copying an entry for an export (`adopt`) failed.
    #[error(transparent)]
    Copy(#[from] TreeError),
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> CacheError + '_ {
    move |source| CacheError::Io {
        path: path.to_path_buf(),
        source,
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct EntryMeta {
    pub key: String,
    pub node: String,
    pub uses: String,
    pub key_parts: KeyParts,
    /// Digest of the node's output (result and files): what dependents' keys are built from.
    pub output_digest: String,
    pub result_digest: String,
    /// Relative path under `files/` → blake3.
    pub files: BTreeMap<String, String>,
    pub bytes: u64,
    pub created: String,
    pub duration_s: f64,
}

/// A verified cache entry.
#[derive(Debug, Clone)]
pub struct Entry {
    pub meta: EntryMeta,
    pub files_dir: PathBuf,
    pub result: Value,
}

pub enum Lookup {
    Hit(Box<Entry>),
    Miss,
    /// The entry exists but does not match its metadata, checked again under the key's lock;
    /// it has been removed (or, if that lock could not be taken, left for the recompute to
    /// replace).
    Corrupted(EntryError),
}

#[derive(Debug, Clone)]
pub struct Cache {
    pub root: PathBuf,
}

/// A directory where a node writes its output before it becomes a cache entry.
pub struct Staging {
    pub dir: PathBuf,
}

impl Staging {
    pub fn files_dir(&self) -> PathBuf {
        self.dir.join("files")
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl Cache {
    pub fn open(root: &Path) -> Result<Cache, CacheError> {
        for sub in ["cache", "tmp", "runs", "locks"] {
            let dir = root.join(sub);
            std::fs::create_dir_all(&dir).map_err(io(&dir))?;
        }
        let root = root.canonicalize().map_err(io(root))?;
        Ok(Cache { root })
    }

    /// The default root: `ATTNBENCH_CACHE`, else `artifacts/` in the current directory.
    pub fn default_root() -> PathBuf {
        std::env::var_os("ATTNBENCH_CACHE")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from("artifacts"))
    }

    pub fn entry_dir(&self, key: &str) -> PathBuf {
        self.root
            .join("cache")
            .join(&key[..2.min(key.len())])
            .join(key)
    }

    pub fn runs_dir(&self) -> PathBuf {
        self.root.join("runs")
    }

    /// Held (shared) by every run and (exclusive) by `gc`, so gc never removes what a run reads.
    pub fn lock_store(&self, exclusive: bool) -> Result<File, CacheError> {
        lock_file(&self.root.join("store.lock"), exclusive)
    }

    /// Held while one node is computed or an entry is placed, so two runs never compute the
    /// same key at once (the second waits and then finds the entry) and a reader can settle
    /// whether an entry is really corrupted.
    pub fn lock_key(&self, key: &str) -> Result<KeyLock, CacheError> {
        let file = lock_file(&self.root.join("locks").join(format!("{key}.lock")), true)?;
        Ok(KeyLock::new(file, key))
    }

    /// The verified entry of `key`. A reader outside the key lock may catch an entry while a
    /// forced run replaces it, so a failed check is only believed, and the entry only
    /// discarded, when it fails again under the lock, where no commit can be under way.
    pub fn lookup(&self, key: &str) -> Lookup {
        if !is_key(key) {
            return Lookup::Miss;
        }
        let dir = self.entry_dir(key);
        if !dir.exists() {
            return Lookup::Miss;
        }
        let first = match verify_entry(&dir) {
            Ok(entry) => return Lookup::Hit(Box::new(entry)),
            Err(reason) => reason,
        };
        let _lock = if KeyLock::held_here(key) {
            None
        } else {
            match self.lock_key(key) {
                Ok(lock) => Some(lock),
                // Unprovable without the lock: recomputing is safe, discarding is not.
                Err(_) => return Lookup::Corrupted(first),
            }
        };
        if !dir.exists() {
            return Lookup::Miss;
        }
        match verify_entry(&dir) {
            Ok(entry) => Lookup::Hit(Box::new(entry)),
            Err(reason) => {
                self.discard(&dir);
                Lookup::Corrupted(reason)
            }
        }
    }

    /// Reads an entry and checks every digest; `Err` says what does not match.
    pub fn verify_dir(&self, dir: &Path) -> Result<Entry, EntryError> {
        verify_entry(dir)
    }

    /// Removes an entry (renamed away first, so readers never see it half-deleted).
    pub fn discard(&self, dir: &Path) {
        let doomed = self
            .root
            .join("tmp")
            .join(format!("discarded-{}", unique_suffix()));
        if std::fs::rename(dir, &doomed).is_ok() {
            let _ = std::fs::remove_dir_all(&doomed);
        }
    }

    pub fn staging(&self) -> Result<Staging, CacheError> {
        let dir = self
            .root
            .join("tmp")
            .join(format!("staging-{}", unique_suffix()));
        let files = dir.join("files");
        std::fs::create_dir_all(&files).map_err(io(&files))?;
        Ok(Staging { dir })
    }

    /// Hashes the staged output, writes the entry's metadata and moves it into place.
    pub fn commit(
        &self,
        staging: Staging,
        key_parts: KeyParts,
        node: &str,
        uses: &str,
        result: &Value,
        duration_s: f64,
    ) -> Result<Entry, CacheError> {
        let key = key_parts.key();
        let files_dir = staging.files_dir();
        let mut files = BTreeMap::new();
        let mut bytes = 0u64;
        let written =
            tree::regular_files(&files_dir).map_err(|source| CacheError::Output { source })?;
        for (relative, path) in written {
            let (digest, length) = tree::hash_file(&path).map_err(io(&path))?;
            bytes += length;
            files.insert(relative, digest);
        }
        let result_bytes = serde_json::to_vec_pretty(result).unwrap_or_default();
        let result_digest = blake3::hash(&result_bytes).to_hex().to_string();
        let output_digest = output_digest(&result_digest, &files);
        let meta = EntryMeta {
            key: key.clone(),
            node: node.to_string(),
            uses: uses.to_string(),
            key_parts,
            output_digest,
            result_digest,
            files,
            bytes: bytes + result_bytes.len() as u64,
            created: humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string(),
            duration_s,
        };
        let result_path = staging.dir.join("result.json");
        std::fs::write(&result_path, &result_bytes).map_err(io(&result_path))?;
        let meta_path = staging.dir.join("entry.json");
        let meta_bytes = serde_json::to_vec_pretty(&meta).unwrap_or_default();
        std::fs::write(&meta_path, meta_bytes).map_err(io(&meta_path))?;

        let target = self.entry_dir(&key);
        if let Some(parent) = target.parent() {
            std::fs::create_dir_all(parent).map_err(io(parent))?;
        }
        self.place(&staging.dir, &target).map_err(io(&target))?;
        drop(staging);
        self.verify_dir(&target)
            .map_err(|source| CacheError::Entry {
                path: target,
                source,
            })
    }

    /// Moves the complete entry at `staged` to `target` in one step. An entry already there
    /// (`--force`, or a corrupted one being recomputed) is exchanged with it atomically, so a
    /// reader sees the old entry or the new one, never neither; the old one is left at `staged`
    /// for its owner to remove. The caller holds the key's lock.
    fn place(&self, staged: &Path, target: &Path) -> std::io::Result<()> {
        match std::fs::rename(staged, target) {
            Ok(()) => return Ok(()),
            Err(_) if target.exists() => {}
            Err(err) => return Err(err),
        }
        if exchange(staged, target).is_ok() {
            return Ok(());
        }
        // A file system without atomic exchange: readers may briefly find no entry and wait
        // for the key lock, which is held until the new one is in place.
        self.discard(target);
        std::fs::rename(staged, target)
    }

    /// Adds the entry at `dir`, taken from this cache for an export, after checking it (see
    /// [`verify_entry`]) and copying it without following links. `Ok(false)`: this cache has
    /// that key already.
    pub fn adopt(&self, dir: &Path) -> Result<bool, CacheError> {
        let invalid = |path: &Path| {
            let path = path.to_path_buf();
            move |source| CacheError::Entry { path, source }
        };
        let key = verify_entry(dir).map_err(invalid(dir))?.meta.key;
        let target = self.entry_dir(&key);
        if target.exists() {
            return Ok(false);
        }
        let staging = self.staging_dir("adopt")?;
        let staged = staging.dir.join(&key);
        copy_tree(dir, &staged)?;
        // The copy is what goes in, so the copy is what is checked.
        verify_entry(&staged).map_err(invalid(&staged))?;
        let _lock = self.lock_key(&key)?;
        if target.exists() {
            return Ok(false);
        }
        std::fs::create_dir_all(target.parent().unwrap_or(&self.root))
            .and_then(|_| std::fs::rename(&staged, &target))
            .map_err(io(&target))?;
        Ok(true)
    }

    /// The keys of all entries, from directory listings alone: cheaper than probing each key
    /// when a plan asks about many nodes.
    pub fn keys(&self) -> std::collections::HashSet<String> {
        let mut keys = std::collections::HashSet::new();
        let Ok(shards) = std::fs::read_dir(self.root.join("cache")) else {
            return keys;
        };
        for shard in shards.flatten() {
            let Ok(dirs) = std::fs::read_dir(shard.path()) else {
                continue;
            };
            keys.extend(
                dirs.flatten()
                    .filter_map(|d| d.file_name().into_string().ok()),
            );
        }
        keys
    }

    /// Every entry's metadata (unverified), for `cache ls` and `gc`.
    pub fn entries(&self) -> Vec<(PathBuf, Result<EntryMeta, String>)> {
        let mut entries = Vec::new();
        let Ok(shards) = std::fs::read_dir(self.root.join("cache")) else {
            return entries;
        };
        for shard in shards.flatten() {
            let Ok(dirs) = std::fs::read_dir(shard.path()) else {
                continue;
            };
            for dir in dirs.flatten() {
                let path = dir.path();
                let meta = std::fs::read(path.join("entry.json"))
                    .map_err(|err| err.to_string())
                    .and_then(|bytes| {
                        serde_json::from_slice::<EntryMeta>(&bytes).map_err(|err| err.to_string())
                    });
                entries.push((path, meta));
            }
        }
        entries.sort_by(|a, b| a.0.cmp(&b.0));
        entries
    }
}

/// Opens (creating) `path` and takes its lock; the lock lasts as long as the file is open.
fn lock_file(path: &Path, exclusive: bool) -> Result<File, CacheError> {
    let file = File::options()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)
        .map_err(io(path))?;
    if exclusive {
        file.lock()
    } else {
        file.lock_shared()
    }
    .map_err(io(path))?;
    Ok(file)
}

fn output_digest(result_digest: &str, files: &BTreeMap<String, String>) -> String {
    let mut hasher = blake3::Hasher::new();
    hasher.update(result_digest.as_bytes());
    for (path, digest) in files {
        hasher.update(b"\n");
        hasher.update(path.as_bytes());
        hasher.update(b"\0");
        hasher.update(digest.as_bytes());
    }
    hasher.finalize().to_hex().to_string()
}

/// A name part unique across processes and calls.
pub fn unique_suffix() -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    format!(
        "{}-{}-{nanos:x}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    )
}

#[cfg(test)]
mod tests;
