//! One node: a cache hit, or computed — in process or in a worker — into a new cache entry;
//! and the records of nodes that did not start.

use std::fs::File;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use attnbench_sdk::{FailureKind, InputArtifact, Isolation, StageFailure, StageRequest};
use serde_json::Value;

use super::{on_slurm, Event, Observer, Shared};
use crate::cache::{CacheError, Entry, Lookup};
use crate::host::machine_lock::{self, MachineLockError};
use crate::host::node_sink::NodeSink;
use crate::host::worker::WorkerOutcome;
use crate::key::{backends_of, key_parts};
use crate::key::{InputDigest, KeyParts};
use crate::pipeline::Stage;
use crate::plan::Plan;
use crate::record::{node_file_name, NodeRecord, Status};
use crate::slurm::task::TaskSpec;

/// Why a node produced no artifact: the status its record gets, with what happened.
#[derive(Debug)]
pub(crate) enum NodeFailure {
    /// The host around the stage failed (the cache, a thread, a malformed result).
    Error(String),
    /// The stage returned a failure of its own.
    Stage(StageFailure),
    /// The node's worker process or thread died.
    Crashed(String),
    /// It ran past its stage's `timeout:`; its worker was killed.
    Timeout(String),
    /// The run was stopped and the node was not done within the grace.
    Interrupted(String),
    /// It never started: its Slurm job was refused, or did not start within its limit.
    NotStarted(String),
}

impl NodeFailure {
    pub fn status(&self) -> Status {
        match self {
            NodeFailure::Error(_) | NodeFailure::Stage(_) => Status::Error,
            NodeFailure::Crashed(_) => Status::Crashed,
            NodeFailure::Timeout(_) => Status::Timeout,
            NodeFailure::Interrupted(_) => Status::Interrupted,
            NodeFailure::NotStarted(_) => Status::Skipped,
        }
    }

    /// The failure's kind, for the stage's own failures.
    fn kind(&self) -> Option<FailureKind> {
        match self {
            NodeFailure::Stage(failure) => Some(failure.kind),
            _ => None,
        }
    }

    fn into_message(self) -> String {
        match self {
            NodeFailure::Stage(failure) => failure.message,
            NodeFailure::Error(m)
            | NodeFailure::Crashed(m)
            | NodeFailure::Timeout(m)
            | NodeFailure::Interrupted(m)
            | NodeFailure::NotStarted(m) => m,
        }
    }
}

impl From<CacheError> for NodeFailure {
    fn from(err: CacheError) -> NodeFailure {
        NodeFailure::Error(err.to_string())
    }
}

/// A finished node as its dependents see it.
#[derive(Clone)]
pub(super) struct Output {
    pub digest: String,
    pub files_dir: PathBuf,
    pub result: Value,
}

pub(super) struct Task {
    pub node: usize,
    pub inputs: Vec<InputArtifact>,
    pub digests: Vec<InputDigest>,
}

pub(super) struct Finished {
    pub node: usize,
    pub record: NodeRecord,
    pub output: Option<Output>,
}

/// How `input` reaches a node that reads it: its artifact and output digest, or — for a
/// collected input that failed — its status and reason, with a digest of those.
pub(super) fn input_artifact(
    plan: &Plan,
    input: usize,
    output: Option<&Output>,
    record: Option<&NodeRecord>,
) -> (InputArtifact, InputDigest) {
    let upstream = &plan.nodes[input];
    let status = record.map(|r| r.status).unwrap_or(Status::Skipped);
    let mut artifact = InputArtifact {
        node: upstream.id.clone(),
        uses: plan.stage_of(upstream).uses.clone(),
        params: upstream.params.to_map(),
        coords: upstream
            .coords
            .iter()
            .map(|(k, v)| (k.clone(), Value::String(v.clone())))
            .collect(),
        dir: PathBuf::new(),
        result: Value::Null,
        status: status.as_str().to_string(),
        error: None,
    };
    let digest = match output {
        Some(output) => {
            artifact.dir = output.files_dir.clone();
            artifact.result = output.result.clone();
            output.digest.clone()
        }
        None => {
            artifact.error = record.and_then(|r| r.error.clone());
            let reason = blake3::hash(artifact.error.as_deref().unwrap_or_default().as_bytes());
            format!("failed:{}:{}", status.as_str(), reason.to_hex())
        }
    };
    (
        artifact,
        InputDigest {
            node: upstream.id.clone(),
            digest,
        },
    )
}

/// The key parts a node that was not started would have had, when every input's output is
/// known: recorded so that `cache gc` keeps what a resumed run will reuse.
pub(super) fn known_parts(
    shared: &Shared,
    index: usize,
    outputs: &[Option<Output>],
) -> Option<KeyParts> {
    let plan = shared.plan;
    let inputs = plan.nodes[index]
        .inputs
        .iter()
        .map(|&input| {
            Some(InputDigest {
                node: plan.nodes[input].id.clone(),
                digest: outputs[input].as_ref()?.digest.clone(),
            })
        })
        .collect::<Option<Vec<_>>>()?;
    Some(key_parts(plan, index, inputs, &shared.fingerprint))
}

pub(super) fn bare_record(
    plan: &Plan,
    index: usize,
    status: Status,
    error: Option<String>,
    parts: Option<KeyParts>,
) -> NodeRecord {
    let node = &plan.nodes[index];
    let stage = plan.stage_of(node);
    NodeRecord {
        id: node.id.clone(),
        stage: stage.name.clone(),
        uses: stage.uses.clone(),
        params: node.params.to_map(),
        inputs: node
            .inputs
            .iter()
            .map(|&i| plan.nodes[i].id.clone())
            .collect(),
        status,
        key: parts.as_ref().map(KeyParts::key),
        key_parts: parts,
        duration_s: 0.0,
        error,
        failure: None,
        note: None,
        log: None,
        artifact: None,
        slurm: None,
    }
}

pub(super) fn run_node(shared: &Shared, task: Task) -> Finished {
    let plan = shared.plan;
    let index = task.node;
    // Queued before an interrupt, not yet started: it does not start now.
    if shared.stop.requested() {
        return Finished {
            node: index,
            record: bare_record(
                plan,
                index,
                Status::Skipped,
                Some(shared.stop.reason().into()),
                Some(key_parts(plan, index, task.digests, &shared.fingerprint)),
            ),
            output: None,
        };
    }
    let parts = key_parts(plan, index, task.digests, &shared.fingerprint);
    let key = parts.key();
    let mut record = bare_record(plan, index, Status::Ok, None, None);
    record.key = Some(key.clone());
    record.key_parts = Some(parts.clone());
    let hit = |record: &mut NodeRecord, entry: Entry| {
        record.status = Status::Cached;
        record.artifact = Some(entry.files_dir.clone());
        Some(Output {
            digest: entry.meta.output_digest,
            files_dir: entry.files_dir,
            result: entry.result,
        })
    };
    if !shared.forced[index] {
        match shared.cache.lookup(&key) {
            Lookup::Hit(entry) => {
                let output = hit(&mut record, *entry);
                return Finished {
                    node: index,
                    record,
                    output,
                };
            }
            Lookup::Corrupted(reason) => {
                tracing::warn!(
                    "cache entry of {} was corrupted ({reason}); recomputing it",
                    record.id
                );
                record.note = Some(format!("corrupted cache entry recomputed: {reason}"));
            }
            Lookup::Miss => {}
        }
    }
    let _lock = match shared.cache.lock_key(&key) {
        Ok(lock) => lock,
        Err(err) => return failed(index, record, NodeFailure::Error(err.to_string())),
    };
    if !shared.forced[index] {
        // Another run may have computed it while this one waited for the lock.
        if let Lookup::Hit(entry) = shared.cache.lookup(&key) {
            let output = hit(&mut record, *entry);
            return Finished {
                node: index,
                record,
                output,
            };
        }
    }
    // A Slurm job gets its node to itself from Slurm (`--exclusive`), not from this machine.
    let exclusive = plan.stage_of(&plan.nodes[index]).spec.exclusive
        && shared
            .queue_for(plan.stage_of(&plan.nodes[index]))
            .is_none();
    let waiting = || {
        tracing::info!(
            "{}: waiting for another run on this cache to finish its measurement",
            record.id
        )
    };
    let _machine = match machine_lock::acquire(&shared.cache.root, exclusive, &shared.stop, waiting)
    {
        Ok(lock) => lock,
        Err(MachineLockError::Stopped) => {
            record.status = Status::Skipped;
            record.error = Some(shared.stop.reason().into());
            return Finished {
                node: index,
                record,
                output: None,
            };
        }
        Err(err) => return failed(index, record, NodeFailure::Error(err.to_string())),
    };
    shared.observer.event(Event::Started { node: &record.id });
    let started = Instant::now();
    let outcome = compute(shared, index, &task.inputs, parts, &mut record);
    record.duration_s = started.elapsed().as_secs_f64();
    match outcome {
        Ok(entry) => {
            record.artifact = Some(entry.files_dir.clone());
            let output = Output {
                digest: entry.meta.output_digest,
                files_dir: entry.files_dir,
                result: entry.result,
            };
            Finished {
                node: index,
                record,
                output: Some(output),
            }
        }
        Err(failure) => failed(index, record, failure),
    }
}

fn failed(index: usize, mut record: NodeRecord, failure: NodeFailure) -> Finished {
    record.status = failure.status();
    record.failure = failure.kind();
    record.error = Some(failure.into_message());
    Finished {
        node: index,
        record,
        output: None,
    }
}

/// Computes one node into a new cache entry.
fn compute(
    shared: &Shared,
    index: usize,
    inputs: &[InputArtifact],
    parts: KeyParts,
    record: &mut NodeRecord,
) -> Result<Entry, NodeFailure> {
    let plan = shared.plan;
    let node = &plan.nodes[index];
    let stage = plan.stage_of(node);
    let started = Instant::now();
    let staging = shared.cache.staging()?;
    let request = StageRequest {
        node: node.id.clone(),
        stage: stage.spec.name.clone(),
        params: node.params.to_map(),
        seed: plan.pipeline.seed,
        output_dir: staging.files_dir(),
        inputs: inputs.to_vec(),
        plugins: backends_of(plan, index)
            .map(|plugin| (plugin.manifest.name.clone(), plugin.path.clone()))
            .collect(),
        cache_dir: Some(shared.cache.root.clone()),
    };
    let request_json =
        serde_json::to_string(&request).map_err(|err| NodeFailure::Error(err.to_string()))?;
    let log_path = shared
        .logs_dir
        .join(format!("{}.log", node_file_name(&node.id)));
    let log = File::create(&log_path).ok();
    record.log = Some(log_path.clone());
    let sink = NodeSink {
        node: node.id.clone(),
        plugin: stage.plugin.manifest.name.clone(),
        log: Mutex::new(log.as_ref().and_then(|f| f.try_clone().ok())),
        stop: shared.stop.clone(),
        progress: |done, total, message: &str| {
            progress(shared.observer, &node.id, done, total, message)
        },
    };
    let result_text = match stage_isolation(stage) {
        Isolation::Worker if shared.queue_for(stage).is_some() => {
            let queue = shared.queue_for(stage).expect("checked by the guard");
            let spec = TaskSpec {
                node: node.id.clone(),
                plugin: stage.plugin.path.clone(),
                stage: stage.spec.name.clone(),
                request: request_json,
                log: log_path.clone(),
                outcome: queue
                    .dir()
                    .join(format!("{}.outcome.json", node_file_name(&node.id))),
            };
            let resources = on_slurm::resources(stage, &node.params, &queue.settings);
            on_slurm::run_as_job(
                queue,
                spec,
                &stage.name,
                resources,
                || shared.stop.requested(),
                &mut record.slurm,
            )?
        }
        Isolation::InProcess => crate::host::node_sink::run_detached(
            Arc::clone(&stage.plugin),
            stage.spec.name.clone(),
            request_json,
            node.id.clone(),
            log.as_ref().and_then(|f| f.try_clone().ok()),
            &shared.stop,
            &|done, total, message| progress(shared.observer, &node.id, done, total, message),
        )?,
        Isolation::Worker => {
            let mut worker = shared
                .pool
                .acquire(&stage.plugin.path)
                .map_err(|err| NodeFailure::Crashed(format!("worker could not start: {err}")))?;
            let stderr_log = log.as_ref().and_then(|f| f.try_clone().ok());
            match worker.run(
                &stage.spec.name,
                &request_json,
                stage.timeout,
                shared.stop.flag(),
                &sink,
                stderr_log,
            ) {
                WorkerOutcome::Finished(outcome) => {
                    shared.pool.release(worker);
                    outcome.map_err(NodeFailure::Stage)?
                }
                WorkerOutcome::Crashed(reason) => return Err(NodeFailure::Crashed(reason)),
                WorkerOutcome::TimedOut => {
                    let limit = stage
                        .timeout
                        .map(|t| format!("{:.1}s", t.as_secs_f64()))
                        .unwrap_or_default();
                    return Err(NodeFailure::Timeout(format!(
                        "did not finish within its {limit} limit; its worker was killed"
                    )));
                }
                WorkerOutcome::Stopped => {
                    return Err(NodeFailure::Interrupted(format!(
                        "the run was stopped and the node was not done {}s later; its worker was killed",
                        crate::host::worker::STOP_GRACE.as_secs()
                    )))
                }
            }
        }
    };
    let result: Value = serde_json::from_str(&result_text).map_err(|err| {
        NodeFailure::Error(format!(
            "malformed result from `{}`: not JSON ({err})",
            stage.uses
        ))
    })?;
    if !result.is_object() {
        return Err(NodeFailure::Error(format!(
            "malformed result from `{}`: expected a JSON object, got {}",
            stage.uses,
            brief(&result)
        )));
    }
    let duration = started.elapsed().as_secs_f64();
    shared
        .cache
        .commit(staging, parts, &node.id, &stage.uses, &result, duration)
        .map_err(NodeFailure::from)
}

/// Where a stage's nodes run. A limit can only be held by killing what runs past it, so a stage
/// with a `timeout:` runs in a worker process even when it would run in process.
pub(super) fn stage_isolation(stage: &Stage) -> Isolation {
    match stage.timeout {
        Some(_) => Isolation::Worker,
        None => stage.spec.isolation,
    }
}

/// A value cut to its first 60 characters for a one-line message (characters, not bytes: a cut
/// inside a multi-byte character would panic).
fn brief(value: &Value) -> String {
    let text = value.to_string();
    match text.char_indices().nth(60) {
        Some((end, _)) => format!("{}…", &text[..end]),
        None => text,
    }
}

fn progress(observer: &dyn Observer, node: &str, done: u64, total: u64, message: &str) {
    observer.event(Event::Progress {
        node,
        done,
        total,
        message,
    });
}

#[cfg(test)]
#[path = "node_tests.rs"]
mod tests;
