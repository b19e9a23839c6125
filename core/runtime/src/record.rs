//! Run records: `runs/<id>/run.json` says what a run did (the resolved DAG, each node's key parts,
//! status, timings and log), with the plugins and environment it ran with.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::key::KeyParts;
use crate::slurm::config::ExecutorKind;
use attnbench_sdk::environment::Environment;

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    /// Reused from the cache.
    Cached,
    /// Computed in this run.
    Ok,
    /// The plugin returned an error, or a result that is not a JSON object.
    Error,
    /// The worker process died (signal, abort, exit).
    Crashed,
    /// The node ran past its time limit and its worker was killed.
    Timeout,
    /// Not run because an input did not succeed, or because the run was stopped first.
    Skipped,
    /// Running when the run was stopped, and not done within the stop's grace period: its
    /// worker was killed.
    Interrupted,
}

impl Status {
    pub fn succeeded(self) -> bool {
        matches!(self, Status::Cached | Status::Ok)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Status::Cached => "cached",
            Status::Ok => "ok",
            Status::Error => "error",
            Status::Crashed => "crashed",
            Status::Timeout => "timeout",
            Status::Skipped => "skipped",
            Status::Interrupted => "interrupted",
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct NodeRecord {
    pub id: String,
    pub stage: String,
    pub uses: String,
    pub params: Map<String, Value>,
    pub inputs: Vec<String>,
    pub status: Status,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key_parts: Option<KeyParts>,
    pub duration_s: f64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// The kind of a stage's own failure (`params`, `io`, `panicked`, `failed`, …), beside `error`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure: Option<attnbench_sdk::FailureKind>,
    /// Something worth knowing that did not fail the node (e.g. a corrupted entry was recomputed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub log: Option<PathBuf>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub artifact: Option<PathBuf>,
    /// The Slurm job that computed the node, under `--executor slurm`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slurm: Option<SlurmRecord>,
}

/// Which Slurm job ran a node, where, how it ended and where its own output went.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct SlurmRecord {
    /// `ARRAY_INDEX`, as `squeue`, `sacct` and `scancel` name it.
    pub job: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<String>,
    pub state: String,
    pub job_log: PathBuf,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PluginRecord {
    pub name: String,
    pub version: String,
    pub abi: String,
    pub path: PathBuf,
    pub library_hash: String,
}

/// Why a run's record cannot be read.
#[derive(Debug, thiserror::Error)]
pub enum RecordError {
    #[error("{}: {source}", path.display())]
    Unreadable {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{}: {source}", path.display())]
    Malformed {
        path: PathBuf,
        source: serde_json::Error,
    },
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RunRecord {
    pub id: String,
    pub pipeline: String,
    pub file: PathBuf,
    pub seed: u64,
    pub argv: Vec<String>,
    pub jobs: usize,
    /// Where the nodes ran.
    #[serde(default)]
    pub executor: ExecutorKind,
    pub started: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finished: Option<String>,
    pub environment: Environment,
    pub plugins: Vec<PluginRecord>,
    pub counts: BTreeMap<Status, usize>,
    pub nodes: Vec<NodeRecord>,
}

impl RunRecord {
    pub fn write(&self, dir: &Path) -> std::io::Result<()> {
        let bytes = serde_json::to_vec_pretty(self).map_err(std::io::Error::other)?;
        let partial = dir.join("run.json.partial");
        std::fs::write(&partial, bytes)?;
        std::fs::rename(partial, dir.join("run.json"))
    }

    pub fn read(dir: &Path) -> Result<RunRecord, RecordError> {
        let path = dir.join("run.json");
        let bytes = std::fs::read(&path).map_err(|source| RecordError::Unreadable {
            path: path.clone(),
            source,
        })?;
        serde_json::from_slice(&bytes).map_err(|source| RecordError::Malformed { path, source })
    }

    pub fn failed(&self) -> usize {
        self.nodes
            .iter()
            .filter(|node| !node.status.succeeded())
            .count()
    }
}

/// Run directories under `runs_dir`, newest first (ids sort by start time).
pub fn run_dirs(runs_dir: &Path) -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(runs_dir)
        .map(|entries| {
            entries
                .flatten()
                .map(|e| e.path())
                .filter(|p| p.join("run.json").is_file())
                .collect()
        })
        .unwrap_or_default();
    dirs.sort();
    dirs.reverse();
    dirs
}

/// A run id that sorts by start time: `20261129-153400.123-<suffix>`.
pub fn new_run_id() -> String {
    let now = humantime::format_rfc3339_millis(std::time::SystemTime::now()).to_string();
    let compact: String = now.chars().filter(|c| c.is_ascii_digit()).collect();
    let (date, rest) = compact.split_at(8.min(compact.len()));
    let (time, millis) = rest.split_at(6.min(rest.len()));
    let suffix = blake3::hash(crate::cache::unique_suffix().as_bytes()).to_hex()[..6].to_string();
    format!("{date}-{time}.{millis}-{suffix}")
}

/// A file name for a node id: readable, and unique through a short hash.
pub fn node_file_name(node: &str) -> String {
    let readable: String = attnbench_sdk::file_name_part(node, "-_=")
        .chars()
        .take(80)
        .collect();
    format!(
        "{readable}-{}",
        &blake3::hash(node.as_bytes()).to_hex()[..8]
    )
}
