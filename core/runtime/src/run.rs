//! The scheduler: runs a plan's nodes in dependency order, independent ones in parallel, each
//! either a cache hit or computed in process or in a worker, and records everything.

use std::collections::{BTreeMap, VecDeque};
use std::fs::File;
use std::path::PathBuf;
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use attnbench_sdk::{CacheScope, InputArtifact, Isolation, StageRequest};
use serde_json::Value;

use crate::cache::{Cache, CacheError, Entry, InputDigest, KeyParts, Lookup};
use crate::diagnostic::suggestion;
use crate::machine_lock::{self, MachineLockError};
use crate::node_sink::NodeSink;
use crate::plan::Plan;
use crate::record::{new_run_id, node_file_name, NodeRecord, PluginRecord, RunRecord, Status};
use crate::stop;
use crate::worker::{WorkerOutcome, WorkerPool};
use attnbench_sdk::environment::Environment;

#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error(transparent)]
    Cache(#[from] CacheError),
    #[error("--force {pattern}: no node or stage of that name; {hint}")]
    UnknownForce { pattern: String, hint: String },
    #[error("cannot write the run record in {path}: {source}")]
    Record {
        path: PathBuf,
        source: std::io::Error,
    },
}

pub struct RunOptions {
    pub jobs: usize,
    /// Node ids or stage names to recompute even when cached.
    pub force: Vec<String>,
    /// The `attnbench` binary, started as `attnbench worker` for worker-isolated stages.
    pub worker_exe: PathBuf,
    pub argv: Vec<String>,
    /// Stop starting nodes once this much time has passed, as a stop signal would (running
    /// nodes get their grace, the record is written, what finished stays cached).
    pub time_budget: Option<Duration>,
}

/// What the scheduler reports while it runs; the CLI draws it.
pub enum Event<'a> {
    Started {
        node: &'a str,
    },
    Progress {
        node: &'a str,
        done: u64,
        total: u64,
        message: &'a str,
    },
    Finished {
        record: &'a NodeRecord,
    },
}

pub trait Observer: Sync {
    fn event(&self, event: Event<'_>);
}

/// The plugins whose in-process backends the node's `backend` parameters name.
fn backends_of(plan: &Plan, node: usize) -> impl Iterator<Item = &Arc<crate::plugin::Plugin>> {
    let node = &plan.nodes[node];
    plan.stage_of(node)
        .spec
        .params
        .iter()
        .filter(|p| p.ty == attnbench_sdk::ParamType::Backend)
        .filter_map(|p| node.params.get(&p.name)?.as_str()?.split_once('/'))
        .filter_map(|(plugin, _)| plan.pipeline.backends.get(plugin))
}

/// The key parts of a node whose inputs' output digests are known.
pub fn key_parts(
    plan: &Plan,
    node: usize,
    inputs: Vec<InputDigest>,
    environment: &str,
) -> KeyParts {
    let backends = backends_of(plan, node)
        .map(|plugin| (plugin.manifest.name.clone(), plugin.library_hash.clone()))
        .collect();
    let node = &plan.nodes[node];
    let stage = plan.stage_of(node);
    let files = stage
        .spec
        .params
        .iter()
        .filter(|p| p.ty == attnbench_sdk::ParamType::File)
        .filter_map(|p| node.params.get(&p.name)?.as_str())
        .filter_map(|path| {
            Some((
                path.to_string(),
                plan.pipeline.file_digests.get(path)?.clone(),
            ))
        })
        .collect();
    KeyParts {
        plugin: stage.plugin.manifest.name.clone(),
        plugin_version: stage.plugin.manifest.version.clone(),
        library_hash: stage.plugin.library_hash.clone(),
        stage: stage.spec.name.clone(),
        params: Value::Object(node.params.to_map()),
        seed: plan.pipeline.seed,
        inputs,
        files,
        backends,
        environment: (stage.spec.cache_scope == CacheScope::Machine)
            .then(|| environment.to_string()),
    }
}

/// A finished node as its dependents see it.
#[derive(Clone)]
struct Output {
    digest: String,
    files_dir: PathBuf,
    result: Value,
}

struct Task {
    node: usize,
    inputs: Vec<InputArtifact>,
    digests: Vec<InputDigest>,
}

struct Finished {
    node: usize,
    record: NodeRecord,
    output: Option<Output>,
}

struct Shared<'a> {
    plan: &'a Plan,
    cache: &'a Cache,
    pool: WorkerPool,
    fingerprint: String,
    forced: Vec<bool>,
    logs_dir: PathBuf,
    observer: &'a dyn Observer,
    /// When the time budget ends, if there is one.
    deadline: Option<Instant>,
}

pub struct RunSummary {
    pub record: RunRecord,
    pub dir: PathBuf,
}

pub fn execute(
    plan: &Plan,
    cache: &Cache,
    options: &RunOptions,
    observer: &dyn Observer,
) -> Result<RunSummary, RunError> {
    let mut forced = vec![false; plan.nodes.len()];
    for pattern in &options.force {
        let selected = plan.select(pattern);
        if selected.is_empty() {
            let names: Vec<&str> = plan
                .pipeline
                .stages
                .iter()
                .map(|s| s.name.as_str())
                .collect();
            return Err(RunError::UnknownForce {
                pattern: pattern.clone(),
                hint: suggestion(pattern, names, "stages"),
            });
        }
        for index in selected {
            forced[index] = true;
        }
    }
    let _store = cache.lock_store(false)?;
    let id = new_run_id();
    let dir = cache.runs_dir().join(&id);
    let logs_dir = dir.join("logs");
    std::fs::create_dir_all(&logs_dir).map_err(|source| RunError::Record {
        path: logs_dir.clone(),
        source,
    })?;
    let environment = Environment::detect();
    let mut record = RunRecord {
        id: id.clone(),
        pipeline: plan.pipeline.name.clone(),
        file: plan.pipeline.file.clone(),
        seed: plan.pipeline.seed,
        argv: options.argv.clone(),
        jobs: options.jobs,
        started: now(),
        finished: None,
        environment: environment.clone(),
        plugins: plugin_records(plan),
        counts: BTreeMap::new(),
        nodes: Vec::new(),
    };
    record.write(&dir).map_err(|source| RunError::Record {
        path: dir.clone(),
        source,
    })?;

    let shared = Shared {
        plan,
        cache,
        pool: WorkerPool::new(options.worker_exe.clone(), cache.root.join("cuda-libs")),
        fingerprint: crate::cache::environment_fingerprint(&environment),
        forced,
        logs_dir,
        observer,
        // A budget past what a clock can represent is no budget at all.
        deadline: options
            .time_budget
            .and_then(|budget| Instant::now().checked_add(budget)),
    };
    stop::forget_spent_budget();
    // The record on disk follows the run: if it is killed outright (SIGKILL, a lost machine),
    // run.json still names every node that finished, with its artifact. Rewrites are spaced so
    // that they never cost more than a tenth of the run.
    let mut last_write = Instant::now();
    let mut spacing = Duration::from_secs(2);
    let mut checkpoint = |finished: &[Option<NodeRecord>]| {
        if last_write.elapsed() < spacing {
            return;
        }
        let started = Instant::now();
        let mut partial = record.clone();
        partial.nodes = finished.iter().flatten().cloned().collect();
        for node in &partial.nodes {
            *partial.counts.entry(node.status).or_insert(0) += 1;
        }
        let _ = partial.write(&dir);
        spacing = spacing.max(started.elapsed() * 10);
        last_write = Instant::now();
    };
    let records = schedule(&shared, options.jobs.max(1), &mut checkpoint);
    for node in &records {
        *record.counts.entry(node.status).or_insert(0) += 1;
    }
    record.nodes = records;
    record.finished = Some(now());
    record.write(&dir).map_err(|source| RunError::Record {
        path: dir.clone(),
        source,
    })?;
    let _ = std::fs::write(cache.runs_dir().join("latest"), format!("{id}\n"));
    Ok(RunSummary { record, dir })
}

/// Runs the plan's nodes; `checkpoint` sees the records so far after each finished node.
fn schedule(
    shared: &Shared,
    jobs: usize,
    checkpoint: &mut dyn FnMut(&[Option<NodeRecord>]),
) -> Vec<NodeRecord> {
    let plan = shared.plan;
    let count = plan.nodes.len();
    let mut dependents: Vec<Vec<usize>> = vec![Vec::new(); count];
    let mut pending: Vec<usize> = vec![0; count];
    for (index, node) in plan.nodes.iter().enumerate() {
        pending[index] = node.inputs.len();
        for &input in &node.inputs {
            dependents[input].push(index);
        }
    }
    let mut outputs: Vec<Option<Output>> = vec![None; count];
    let mut records: Vec<Option<NodeRecord>> = vec![None; count];
    let mut ready: VecDeque<usize> = (0..count).filter(|&i| pending[i] == 0).collect();

    let (task_sender, task_receiver) = mpsc::channel::<Task>();
    let task_receiver = Arc::new(Mutex::new(task_receiver));
    let (done_sender, done_receiver) = mpsc::channel::<Finished>();
    std::thread::scope(|scope| {
        for _ in 0..jobs.min(count.max(1)) {
            let tasks = Arc::clone(&task_receiver);
            let done = done_sender.clone();
            scope.spawn(move || loop {
                let task = match tasks.lock() {
                    Ok(receiver) => receiver.recv(),
                    Err(_) => break,
                };
                let Ok(task) = task else { break };
                let finished = run_node(shared, task);
                if done.send(finished).is_err() {
                    break;
                }
            });
        }
        drop(done_sender);

        let mut in_flight = 0usize;
        let mut finished_count = 0usize;
        // Exclusive nodes (measurements) run alone: they wait for the machine to be idle, and
        // nothing starts while one runs.
        let mut running_exclusive: Option<usize> = None;
        let mut held: VecDeque<usize> = VecDeque::new();
        while finished_count < count {
            stop::spend_budget(shared.deadline);
            while let Some(index) = ready.pop_front() {
                let node = &plan.nodes[index];
                let fan_out = &node.inputs[..node.fan_out_inputs];
                let failed_input = fan_out.iter().find(|&&input| outputs[input].is_none());
                let interrupted = stop::requested();
                if failed_input.is_some() || interrupted {
                    let reason = match failed_input {
                        Some(&failed) => {
                            format!("input `{}` did not succeed", plan.nodes[failed].id)
                        }
                        None => stop::reason().to_string(),
                    };
                    let parts = failed_input
                        .is_none()
                        .then(|| known_parts(shared, index, &outputs))
                        .flatten();
                    let record = bare_record(plan, index, Status::Skipped, Some(reason), parts);
                    shared.observer.event(Event::Finished { record: &record });
                    records[index] = Some(record);
                    finished_count += 1;
                    for &dependent in &dependents[index] {
                        pending[dependent] -= 1;
                        if pending[dependent] == 0 {
                            ready.push_back(dependent);
                        }
                    }
                    continue;
                }
                let (inputs, digests): (Vec<InputArtifact>, Vec<InputDigest>) = node
                    .inputs
                    .iter()
                    .map(|&input| {
                        input_artifact(
                            plan,
                            input,
                            outputs[input].as_ref(),
                            records[input].as_ref(),
                        )
                    })
                    .unzip();
                let exclusive = plan.stage_of(node).spec.exclusive;
                if running_exclusive.is_some() || (exclusive && in_flight > 0) {
                    held.push_back(index);
                    continue;
                }
                if exclusive {
                    running_exclusive = Some(index);
                }
                if task_sender
                    .send(Task {
                        node: index,
                        inputs,
                        digests,
                    })
                    .is_err()
                {
                    break;
                }
                in_flight += 1;
            }
            if in_flight == 0 {
                if held.is_empty() {
                    break;
                }
                ready.extend(held.drain(..));
                continue;
            }
            // Short waits, so a time budget ends while nodes run.
            let finished = loop {
                match done_receiver.recv_timeout(Duration::from_millis(200)) {
                    Ok(finished) => break Some(finished),
                    Err(mpsc::RecvTimeoutError::Timeout) => stop::spend_budget(shared.deadline),
                    Err(mpsc::RecvTimeoutError::Disconnected) => break None,
                }
            };
            let Some(finished) = finished else {
                break;
            };
            in_flight -= 1;
            finished_count += 1;
            shared.observer.event(Event::Finished {
                record: &finished.record,
            });
            if running_exclusive == Some(finished.node) {
                running_exclusive = None;
            }
            ready.extend(held.drain(..));
            outputs[finished.node] = finished.output;
            records[finished.node] = Some(finished.record);
            checkpoint(&records);
            for &dependent in &dependents[finished.node] {
                pending[dependent] -= 1;
                if pending[dependent] == 0 {
                    ready.push_back(dependent);
                }
            }
        }
        drop(task_sender);
    });
    records
        .into_iter()
        .enumerate()
        .map(|(index, record)| {
            record.unwrap_or_else(|| {
                let parts = known_parts(shared, index, &outputs);
                bare_record(
                    plan,
                    index,
                    Status::Skipped,
                    Some("never scheduled".into()),
                    parts,
                )
            })
        })
        .collect()
}

/// How `input` reaches a node that reads it: its artifact and output digest, or — for a
/// collected input that failed — its status and reason, with a digest of those.
fn input_artifact(
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
fn known_parts(shared: &Shared, index: usize, outputs: &[Option<Output>]) -> Option<KeyParts> {
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

fn bare_record(
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
        note: None,
        log: None,
        artifact: None,
    }
}

fn run_node(shared: &Shared, task: Task) -> Finished {
    let plan = shared.plan;
    let index = task.node;
    // Queued before an interrupt, not yet started: it does not start now.
    if stop::requested() {
        return Finished {
            node: index,
            record: bare_record(
                plan,
                index,
                Status::Skipped,
                Some(stop::reason().into()),
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
        Err(err) => return failed(index, record, Status::Error, err.to_string()),
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
    let exclusive = plan.stage_of(&plan.nodes[index]).spec.exclusive;
    let waiting = || {
        tracing::info!(
            "{}: waiting for another run on this cache to finish its measurement",
            record.id
        )
    };
    let _machine = match machine_lock::acquire(&shared.cache.root, exclusive, waiting) {
        Ok(lock) => lock,
        Err(MachineLockError::Stopped) => {
            record.status = Status::Skipped;
            record.error = Some(stop::reason().into());
            return Finished {
                node: index,
                record,
                output: None,
            };
        }
        Err(err) => return failed(index, record, Status::Error, err.to_string()),
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
        Err((status, message)) => failed(index, record, status, message),
    }
}

fn failed(index: usize, mut record: NodeRecord, status: Status, message: String) -> Finished {
    record.status = status;
    record.error = Some(message);
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
) -> Result<Entry, (Status, String)> {
    let plan = shared.plan;
    let node = &plan.nodes[index];
    let stage = plan.stage_of(node);
    let started = Instant::now();
    let error = |err: CacheError| (Status::Error, err.to_string());
    let staging = shared.cache.staging().map_err(error)?;
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
    };
    let request_json =
        serde_json::to_string(&request).map_err(|err| (Status::Error, err.to_string()))?;
    let log_path = shared
        .logs_dir
        .join(format!("{}.log", node_file_name(&node.id)));
    let log = File::create(&log_path).ok();
    record.log = Some(log_path);
    let sink = NodeSink {
        node: node.id.clone(),
        plugin: stage.plugin.manifest.name.clone(),
        log: Mutex::new(log.as_ref().and_then(|f| f.try_clone().ok())),
        progress: |done, total, message: &str| {
            progress(shared.observer, &node.id, done, total, message)
        },
    };
    // A limit can only be held by killing what runs past it, so a stage with a `timeout:` runs
    // in a worker process even when it would run in process.
    let isolation = match stage.timeout {
        Some(_) => Isolation::Worker,
        None => stage.spec.isolation,
    };
    let result_text = match isolation {
        Isolation::InProcess => crate::node_sink::run_detached(
            Arc::clone(&stage.plugin),
            stage.spec.name.clone(),
            request_json,
            node.id.clone(),
            log.as_ref().and_then(|f| f.try_clone().ok()),
            &|done, total, message| progress(shared.observer, &node.id, done, total, message),
        )?,
        Isolation::Worker => {
            let mut worker = shared
                .pool
                .acquire(&stage.plugin.path)
                .map_err(|err| (Status::Crashed, format!("worker could not start: {err}")))?;
            let stderr_log = log.as_ref().and_then(|f| f.try_clone().ok());
            match worker.run(
                &stage.spec.name,
                &request_json,
                stage.timeout,
                &stop::INTERRUPTED,
                &sink,
                stderr_log,
            ) {
                WorkerOutcome::Finished(outcome) => {
                    shared.pool.release(worker);
                    outcome.map_err(|err| (Status::Error, err))?
                }
                WorkerOutcome::Crashed(reason) => return Err((Status::Crashed, reason)),
                WorkerOutcome::TimedOut => {
                    let limit = stage
                        .timeout
                        .map(|t| format!("{:.1}s", t.as_secs_f64()))
                        .unwrap_or_default();
                    return Err((
                        Status::Timeout,
                        format!("did not finish within its {limit} limit; its worker was killed"),
                    ));
                }
                WorkerOutcome::Stopped => {
                    return Err((
                        Status::Interrupted,
                        format!(
                            "the run was stopped and the node was not done {}s later; its worker was killed",
                            crate::worker::STOP_GRACE.as_secs()
                        ),
                    ))
                }
            }
        }
    };
    let result: Value = serde_json::from_str(&result_text).map_err(|err| {
        (
            Status::Error,
            format!("malformed result from `{}`: not JSON ({err})", stage.uses),
        )
    })?;
    if !result.is_object() {
        return Err((
            Status::Error,
            format!(
                "malformed result from `{}`: expected a JSON object, got {}",
                stage.uses,
                brief(&result)
            ),
        ));
    }
    let duration = started.elapsed().as_secs_f64();
    shared
        .cache
        .commit(staging, parts, &node.id, &stage.uses, &result, duration)
        .map_err(error)
}

fn brief(value: &Value) -> String {
    let text = value.to_string();
    if text.len() > 60 {
        format!("{}…", &text[..60])
    } else {
        text
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

fn plugin_records(plan: &Plan) -> Vec<PluginRecord> {
    let mut seen = BTreeMap::new();
    for stage in &plan.pipeline.stages {
        let plugin = &stage.plugin;
        seen.entry(plugin.manifest.name.clone())
            .or_insert_with(|| PluginRecord {
                name: plugin.manifest.name.clone(),
                version: plugin.manifest.version.clone(),
                abi: plugin.manifest.abi.clone(),
                path: plugin.path.clone(),
                library_hash: plugin.library_hash.clone(),
            });
    }
    seen.into_values().collect()
}

fn now() -> String {
    humantime::format_rfc3339_millis(std::time::SystemTime::now()).to_string()
}
