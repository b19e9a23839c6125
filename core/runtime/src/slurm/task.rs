//! One node inside a Slurm job: `attnbench slurm-task TASKS.json` reads its task (the array
//! index Slurm gives it), runs the stage in this process and writes what came out beside it.
//! The job's own process is the isolation a worker gives locally: if it dies, the job's state
//! says how, and the coordinator records it.

use std::fs::{File, OpenOptions};
use std::path::{Path, PathBuf};

use attnbench_sdk::{FailureKind, StageFailure};
use serde::{Deserialize, Serialize};

use super::JobError;
use crate::host::node_sink::NodeSink;
use crate::host::plugin::Plugin;
use crate::stop::StopToken;

/// What one array task runs: everything is a path on the shared folder, or travels inline.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TaskSpec {
    pub node: String,
    pub plugin: PathBuf,
    pub stage: String,
    /// The node's `StageRequest`, as JSON (its output folder is the cache's staging folder).
    pub request: String,
    /// The node's log in the run record; the task appends to it.
    pub log: PathBuf,
    /// Where the task writes its [`Outcome`].
    pub outcome: PathBuf,
}

/// How the stage ended, as the worker protocol says it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Outcome {
    pub ok: bool,
    /// The result JSON, or the failure's message.
    pub output: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure: Option<FailureKind>,
}

impl Outcome {
    /// The outcome at `path`, if the task got as far as writing it.
    pub fn read(path: &Path) -> Option<Outcome> {
        let bytes = std::fs::read(path).ok()?;
        serde_json::from_slice(&bytes).ok()
    }

    pub fn into_result(self) -> Result<String, StageFailure> {
        if self.ok {
            Ok(self.output)
        } else {
            Err(StageFailure::new(
                self.failure.unwrap_or(FailureKind::Failed),
                self.output,
            ))
        }
    }
}

/// Runs task `index` of the task file `tasks` (`SLURM_ARRAY_TASK_ID` when `index` is `None`).
/// An error means the task never ran its stage; the stage's own failures are outcomes.
pub fn run_task(tasks: &Path, index: Option<usize>) -> Result<(), JobError> {
    let text = std::fs::read(tasks).map_err(JobError::io(tasks))?;
    let specs: Vec<TaskSpec> =
        serde_json::from_slice(&text).map_err(|source| JobError::TaskFile {
            path: tasks.to_path_buf(),
            source,
        })?;
    let index = match index {
        Some(index) => index,
        None => std::env::var("SLURM_ARRAY_TASK_ID")
            .ok()
            .and_then(|v| v.parse().ok())
            .ok_or(JobError::NoIndex)?,
    };
    let spec = specs.get(index).ok_or_else(|| JobError::NoTask {
        path: tasks.to_path_buf(),
        count: specs.len(),
        index,
    })?;
    let log = OpenOptions::new()
        .create(true)
        .append(true)
        .open(&spec.log)
        .map_err(JobError::io(&spec.log))?;
    redirect_output(&log);
    let stop = StopToken::new();
    // `scancel` sends SIGTERM first: the stage may see it through `is_cancelled`.
    let _ = crate::stop::install_handler(stop.clone());
    let outcome = match Plugin::load(&spec.plugin) {
        Ok(plugin) => {
            let sink = NodeSink {
                node: spec.node.clone(),
                plugin: plugin.manifest.name.clone(),
                log: std::sync::Mutex::new(log.try_clone().ok()),
                stop,
                progress: |_: u64, _: u64, _: &str| {},
            };
            match plugin.run(&spec.stage, &spec.request, &sink) {
                Ok(output) => Outcome {
                    ok: true,
                    output,
                    failure: None,
                },
                Err(failure) => Outcome {
                    ok: false,
                    output: failure.message,
                    failure: Some(failure.kind),
                },
            }
        }
        Err(err) => Outcome {
            ok: false,
            output: err.to_string(),
            failure: Some(FailureKind::Failed),
        },
    };
    write_whole(&spec.outcome, &outcome)
}

/// Points stdout and stderr at the node's log, so whatever the plugin prints lands there.
fn redirect_output(log: &File) {
    use std::os::fd::AsRawFd;
    unsafe {
        libc::dup2(log.as_raw_fd(), 1);
        libc::dup2(log.as_raw_fd(), 2);
    }
}

/// Writes `value` as JSON at `path`, whole or not at all.
pub(super) fn write_whole(path: &Path, value: &impl Serialize) -> Result<(), JobError> {
    let bytes = serde_json::to_vec(value).map_err(|source| JobError::Encode {
        what: "a Slurm task file",
        source,
    })?;
    let partial = path.with_extension("partial");
    std::fs::write(&partial, bytes)
        .and_then(|_| std::fs::rename(&partial, path))
        .map_err(JobError::io(path))
}
