//! Running a plan: nodes in dependency order, independent ones in parallel (the bookkeeping in
//! [`frontier`]), each a cache hit or computed in process or in a worker ([`node`]), and a run
//! record that follows the run on disk ([`checkpoint`]).

mod checkpoint;
mod frontier;
mod node;
mod on_slurm;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use attnbench_sdk::environment::Environment;
use attnbench_sdk::{InputArtifact, Isolation};

use crate::cache::{Cache, CacheError};
use crate::diagnostic::suggestion;
use crate::host::worker::{WorkerEnv, WorkerPool};
use crate::key::InputDigest;
use crate::plan::Plan;
use crate::record::{new_run_id, NodeRecord, PluginRecord, RunRecord, Status};
use crate::slurm::config::{ExecutorKind, SlurmSettings};
use crate::slurm::{SlurmError, SlurmQueue};
use crate::stop::StopToken;
use checkpoint::Checkpoint;
use frontier::Frontier;
pub(crate) use node::NodeFailure;
use node::{bare_record, input_artifact, known_parts, run_node, Finished, Output, Task};

#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error(transparent)]
    Cache(#[from] CacheError),
    #[error("--force {pattern}: no node or stage of that name; {hint}")]
    UnknownForce { pattern: String, hint: String },
    #[error(transparent)]
    Slurm(#[from] SlurmError),
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
    /// The run's stop request: the CLI hands the same token to the signal handler.
    pub stop: StopToken,
    /// What worker processes' environments get beyond the host's (GPU libraries, caches).
    pub worker_env: WorkerEnv,
    /// Slurm's settings when worker-isolated nodes run as Slurm jobs; `None` runs them here.
    pub slurm: Option<SlurmSettings>,
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
    stop: StopToken,
    slurm: Option<SlurmQueue>,
}

impl Shared<'_> {
    /// The Slurm queue, when `stage`'s nodes run as Slurm jobs (worker-isolated stages do).
    fn queue_for(&self, stage: &crate::pipeline::Stage) -> Option<&SlurmQueue> {
        match node::stage_isolation(stage) {
            Isolation::Worker => self.slurm.as_ref(),
            Isolation::InProcess => None,
        }
    }
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
    // Slurm's commands are checked before anything of the run exists.
    let pool = WorkerPool::new(options.worker_exe.clone(), Arc::clone(&options.worker_env));
    let slurm = match &options.slurm {
        Some(settings) => Some(SlurmQueue::start(
            settings.clone(),
            dir.join("slurm"),
            options.worker_exe.clone(),
            pool.env().to_vec(),
            options.stop.clone(),
        )?),
        None => None,
    };
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
        executor: match options.slurm {
            Some(_) => ExecutorKind::Slurm,
            None => ExecutorKind::Local,
        },
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
        pool,
        fingerprint: crate::key::environment_fingerprint(&environment),
        forced,
        logs_dir,
        observer,
        // A budget past what a clock can represent is no budget at all.
        deadline: options
            .time_budget
            .and_then(|budget| Instant::now().checked_add(budget)),
        stop: options.stop.clone(),
        slurm,
    };
    let mut checkpoint = Checkpoint::new(&record, &dir);
    let records = schedule(&shared, options.jobs.max(1), &mut checkpoint);
    if let Some(queue) = &shared.slurm {
        queue.close();
    }
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
fn schedule(shared: &Shared, jobs: usize, checkpoint: &mut Checkpoint) -> Vec<NodeRecord> {
    let plan = shared.plan;
    let count = plan.nodes.len();
    let mut frontier = Frontier::new(plan.nodes.iter().map(|node| node.inputs.as_slice()));
    let mut outputs: Vec<Option<Output>> = vec![None; count];
    let mut records: Vec<Option<NodeRecord>> = vec![None; count];

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

        while !frontier.all_finished() {
            shared.stop.spend_budget(shared.deadline);
            while let Some(index) = frontier.next_ready() {
                let node = &plan.nodes[index];
                let fan_out = &node.inputs[..node.fan_out_inputs];
                let failed_input = fan_out.iter().find(|&&input| outputs[input].is_none());
                if failed_input.is_some() || shared.stop.requested() {
                    let reason = match failed_input {
                        Some(&failed) => {
                            format!("input `{}` did not succeed", plan.nodes[failed].id)
                        }
                        None => shared.stop.reason().to_string(),
                    };
                    let parts = failed_input
                        .is_none()
                        .then(|| known_parts(shared, index, &outputs))
                        .flatten();
                    let record = bare_record(plan, index, Status::Skipped, Some(reason), parts);
                    shared.observer.event(Event::Finished { record: &record });
                    records[index] = Some(record);
                    frontier.skipped(index);
                    continue;
                }
                let stage = plan.stage_of(node);
                let exclusive = stage.spec.exclusive && shared.queue_for(stage).is_none();
                if !frontier.try_start(index, exclusive) {
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
                let task = Task {
                    node: index,
                    inputs,
                    digests,
                };
                if task_sender.send(task).is_err() {
                    break;
                }
            }
            if frontier.in_flight() == 0 {
                if frontier.release_held() {
                    continue;
                }
                break;
            }
            // Short waits, so a time budget ends while nodes run.
            let finished = loop {
                match done_receiver.recv_timeout(Duration::from_millis(200)) {
                    Ok(finished) => break Some(finished),
                    Err(mpsc::RecvTimeoutError::Timeout) => {
                        shared.stop.spend_budget(shared.deadline)
                    }
                    Err(mpsc::RecvTimeoutError::Disconnected) => break None,
                }
            };
            let Some(finished) = finished else {
                break;
            };
            shared.observer.event(Event::Finished {
                record: &finished.record,
            });
            frontier.finished(finished.node);
            outputs[finished.node] = finished.output;
            records[finished.node] = Some(finished.record);
            checkpoint.maybe_write(&records);
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
