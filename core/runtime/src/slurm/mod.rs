//! The Slurm executor: the coordinator (this process) keeps the DAG, the cache and the run
//! record; each worker-isolated node that must be computed runs as one task of a Slurm job array.
//! Nodes that become ready together (within [`GATHER`]) and ask for the same resources form one
//! wave, one `sbatch --array`. The cache's root must be a folder every Slurm node sees: tasks
//! read their inputs from it, write into its staging folder and leave their outcome beside their
//! task file, and the coordinator commits what finished, node by node, as it always does — so a
//! cancelled or failed job loses nothing that finished, and a rerun resumes from the cache.

pub mod commands;
pub mod config;
pub mod task;

use std::path::{Path, PathBuf};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::Mutex;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

pub use commands::JobError;
use commands::{JobState, Resources, TaskState};
use config::SlurmSettings;
use task::{Outcome, TaskSpec};

use crate::stop::StopToken;

/// How long the queue waits for more ready nodes before it submits a wave.
const GATHER: Duration = Duration::from_millis(300);

#[derive(Debug, thiserror::Error)]
pub enum SlurmError {
    #[error(
        "--executor slurm: {} not found on PATH; run on a Slurm login node, or use --executor local",
        .0.join(", ")
    )]
    NoSlurm(Vec<&'static str>),
    #[error("cannot prepare the Slurm jobs' folder {path}: {source}")]
    Folder {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// How one node's job ended, as the coordinator records it.
#[derive(Debug)]
pub struct JobEnd {
    /// `ARRAY_INDEX`, as `squeue` and `scancel` name it.
    pub job: String,
    pub state: JobState,
    /// What Slurm said (state and reason), or what the queue did.
    pub detail: String,
    pub host: Option<String>,
    /// What the task wrote, if it ran its stage.
    pub outcome: Option<Outcome>,
    /// The job's own output file (the task's start and anything before its log opened).
    pub job_log: PathBuf,
}

struct Request {
    spec: TaskSpec,
    /// The pipeline stage: a wave holds one stage's nodes, and its jobs are named after it.
    stage: String,
    resources: Resources,
    reply: Sender<JobEnd>,
}

/// Submits nodes as Slurm jobs and reports how each ended; one per run.
pub struct SlurmQueue {
    inbox: Mutex<Option<Sender<Request>>>,
    thread: Mutex<Option<JoinHandle<()>>>,
    pub settings: SlurmSettings,
    /// Where waves keep their task files, scripts and job logs (in the run's record).
    dir: PathBuf,
}

impl SlurmQueue {
    /// Starts the queue; `exe` is the `attnbench` binary the jobs run, `env` what their
    /// environment gets beyond the submitting one's (GPU libraries).
    pub fn start(
        settings: SlurmSettings,
        dir: PathBuf,
        exe: PathBuf,
        env: Vec<(String, String)>,
        stop: StopToken,
    ) -> Result<SlurmQueue, SlurmError> {
        let missing = commands::missing_commands();
        if !missing.is_empty() {
            return Err(SlurmError::NoSlurm(missing));
        }
        std::fs::create_dir_all(&dir).map_err(|source| SlurmError::Folder {
            path: dir.clone(),
            source,
        })?;
        let (inbox, requests) = mpsc::channel();
        let mut queue = Queue {
            settings: settings.clone(),
            dir: dir.clone(),
            exe,
            env,
            stop,
            pending: Vec::new(),
            pending_since: None,
            waves: Vec::new(),
        };
        let thread = std::thread::Builder::new()
            .name("attnbench-slurm".into())
            .spawn(move || queue.serve(requests))
            .map_err(|source| SlurmError::Folder {
                path: dir.clone(),
                source,
            })?;
        Ok(SlurmQueue {
            inbox: Mutex::new(Some(inbox)),
            thread: Mutex::new(Some(thread)),
            settings,
            dir,
        })
    }

    /// The folder of the run's Slurm files.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Runs `spec`, a node of pipeline stage `stage`, as a job with `resources`, and waits for
    /// it to end.
    pub fn run(
        &self,
        spec: TaskSpec,
        stage: &str,
        resources: Resources,
    ) -> Result<JobEnd, JobError> {
        let (reply, ended) = mpsc::channel();
        let request = Request {
            spec,
            stage: stage.to_string(),
            resources,
            reply,
        };
        let sent = match self.inbox.lock() {
            Ok(inbox) => inbox
                .as_ref()
                .is_some_and(|inbox| inbox.send(request).is_ok()),
            Err(_) => false,
        };
        if !sent {
            return Err(JobError::QueueStopped);
        }
        ended.recv().map_err(|_| JobError::QueueStoppedBeforeEnd)
    }

    /// Ends the queue once its jobs have ended.
    pub fn close(&self) {
        if let Ok(mut inbox) = self.inbox.lock() {
            inbox.take();
        }
        if let Some(thread) = self.thread.lock().ok().and_then(|mut t| t.take()) {
            let _ = thread.join();
        }
    }
}

/// A node of a submitted wave that has not been answered yet.
struct Waiting {
    reply: Sender<JobEnd>,
    outcome: PathBuf,
    started: bool,
}

struct Wave {
    job: String,
    submitted: Instant,
    tasks: Vec<Option<Waiting>>,
    log_dir: PathBuf,
}

impl Wave {
    fn job_log(&self, index: usize) -> PathBuf {
        self.log_dir.join(format!("job-{}_{index}.log", self.job))
    }

    /// Answers task `index`, once.
    fn answer(&mut self, index: usize, state: JobState, detail: String, host: Option<String>) {
        let job_log = self.job_log(index);
        let job = format!("{}_{index}", self.job);
        if let Some(waiting) = self.tasks.get_mut(index).and_then(Option::take) {
            let _ = waiting.reply.send(JobEnd {
                job,
                state,
                detail,
                host,
                outcome: Outcome::read(&waiting.outcome),
                job_log,
            });
        }
    }

    fn open(&self) -> bool {
        self.tasks.iter().any(Option::is_some)
    }
}

/// The queue's own thread: gathers requests into waves, submits them, follows their jobs.
struct Queue {
    settings: SlurmSettings,
    dir: PathBuf,
    exe: PathBuf,
    env: Vec<(String, String)>,
    stop: StopToken,
    pending: Vec<Request>,
    pending_since: Option<Instant>,
    waves: Vec<Wave>,
}

impl Queue {
    fn serve(&mut self, requests: Receiver<Request>) {
        let mut open = true;
        let mut last_poll = Instant::now();
        let mut cancelled = false;
        loop {
            if !open && self.pending.is_empty() && !self.waves.iter().any(Wave::open) {
                return;
            }
            let wait = if self.pending.is_empty() {
                self.settings.poll.min(Duration::from_millis(200))
            } else {
                GATHER.min(Duration::from_millis(50))
            };
            if open {
                match requests.recv_timeout(wait) {
                    Ok(request) => {
                        self.pending_since.get_or_insert_with(Instant::now);
                        self.pending.push(request);
                    }
                    Err(RecvTimeoutError::Timeout) => {}
                    Err(RecvTimeoutError::Disconnected) => open = false,
                }
            } else {
                std::thread::sleep(wait);
            }
            if self.stop.requested() && !cancelled {
                cancelled = true;
                self.cancel_all();
            }
            let gathered = self.pending_since.is_some_and(|t| t.elapsed() >= GATHER);
            if gathered || (!open && !self.pending.is_empty()) {
                self.submit_pending();
            }
            if last_poll.elapsed() >= self.settings.poll {
                last_poll = Instant::now();
                self.poll();
            }
        }
    }

    /// Every pending request as waves: one stage's nodes of equal resources each.
    fn submit_pending(&mut self) {
        self.pending_since = None;
        let mut pending = std::mem::take(&mut self.pending);
        pending.sort_by(|a, b| (&a.stage, &a.resources).cmp(&(&b.stage, &b.resources)));
        while !pending.is_empty() {
            let same =
                |r: &Request| r.stage == pending[0].stage && r.resources == pending[0].resources;
            let split = pending
                .iter()
                .position(|r| !same(r))
                .unwrap_or(pending.len());
            let rest = pending.split_off(split);
            self.submit_wave(pending);
            pending = rest;
        }
    }

    fn submit_wave(&mut self, requests: Vec<Request>) {
        if self.stop.requested() {
            for request in requests {
                let _ = request.reply.send(not_submitted(
                    "the run was stopped before the job was submitted".into(),
                ));
            }
            return;
        }
        let dir = self.dir.join(format!("wave-{}", self.waves.len()));
        let submitted = write_wave(&dir, &requests, &self.exe, &self.env).and_then(|script| {
            let args = commands::sbatch_args(
                &self.settings,
                &requests[0].resources,
                requests.len(),
                &format!("attnbench-{}", requests[0].stage),
                &dir.join("job-%A_%a.log"),
            );
            // What was asked of Slurm, beside the script, for whoever reads the wave's folder.
            let _ = std::fs::write(dir.join("sbatch.args"), args.join("\n") + "\n");
            commands::submit(&args, &script)
        });
        match submitted {
            Ok(job) => {
                tracing::info!(
                    "submitted {} node(s) as Slurm job array {job}",
                    requests.len()
                );
                self.waves.push(Wave {
                    job,
                    submitted: Instant::now(),
                    tasks: requests
                        .into_iter()
                        .map(|request| {
                            Some(Waiting {
                                reply: request.reply,
                                outcome: request.spec.outcome,
                                started: false,
                            })
                        })
                        .collect(),
                    log_dir: dir,
                });
            }
            Err(reason) => {
                let reason = reason.to_string();
                for request in requests {
                    let _ = request.reply.send(not_submitted(reason.clone()));
                }
            }
        }
    }

    /// Asks Slurm about every wave with open tasks and answers those that ended.
    fn poll(&mut self) {
        let start_within = self.settings.start_within;
        for wave in self.waves.iter_mut().filter(|w| w.open()) {
            let states = match commands::query(&wave.job) {
                Ok(Some(states)) => states,
                Ok(None) => {
                    // Slurm has forgotten the job (past `MinJobAge`): what it left says how it went.
                    for index in 0..wave.tasks.len() {
                        let state = match &wave.tasks[index] {
                            Some(w) if w.outcome.is_file() => JobState::Completed,
                            _ => JobState::Ended,
                        };
                        let detail = "Slurm no longer knows the job".to_string();
                        wave.answer(index, state, detail, None);
                    }
                    continue;
                }
                Err(err) => {
                    tracing::warn!("{err}; asking again");
                    continue;
                }
            };
            for TaskState {
                index,
                state,
                raw,
                reason,
                host,
            } in states
            {
                let Some(waiting) = wave.tasks.get_mut(index).and_then(Option::as_mut) else {
                    continue;
                };
                if state == JobState::Running {
                    waiting.started = true;
                }
                if state.is_final() {
                    wave.answer(index, state, format!("{raw} ({reason})"), host);
                } else if state == JobState::Pending && !waiting.started {
                    if let Some(limit) = start_within.filter(|&l| wave.submitted.elapsed() > l) {
                        commands::cancel(&format!("{}_{index}", wave.job));
                        let detail = format!(
                            "still pending after {} ({reason}); cancelled",
                            humantime::format_duration(limit)
                        );
                        wave.answer(index, JobState::Pending, detail, None);
                    }
                }
            }
        }
    }

    /// The run was stopped: every job is cancelled, and the states that come back say so.
    fn cancel_all(&mut self) {
        for wave in self.waves.iter().filter(|w| w.open()) {
            commands::cancel(&wave.job);
        }
    }
}

/// The answer for a node whose job was never submitted: it did not start.
fn not_submitted(detail: String) -> JobEnd {
    JobEnd {
        job: String::new(),
        state: JobState::Pending,
        detail,
        host: None,
        outcome: None,
        job_log: PathBuf::new(),
    }
}

/// Writes a wave's task file and job script; the script's path.
fn write_wave(
    dir: &Path,
    requests: &[Request],
    exe: &Path,
    env: &[(String, String)],
) -> Result<PathBuf, JobError> {
    std::fs::create_dir_all(dir).map_err(JobError::io(dir))?;
    let specs: Vec<&TaskSpec> = requests.iter().map(|r| &r.spec).collect();
    let tasks = dir.join("tasks.json");
    task::write_whole(&tasks, &specs)?;
    let mut script = String::from("#!/bin/sh\n# One node of an attnbench run per array task.\n");
    for (name, value) in env {
        script.push_str(&format!("export {name}={}\n", quote(value)));
    }
    // CP stages start their ranks with srun inside the job's allocation.
    script.push_str("export ATTNBENCH_RANK_LAUNCHER=srun\n");
    script.push_str(&format!(
        "exec {} slurm-task {}\n",
        quote(&exe.display().to_string()),
        quote(&tasks.display().to_string())
    ));
    let path = dir.join("job.sh");
    std::fs::write(&path, script).map_err(JobError::io(&path))?;
    Ok(path)
}

/// `value` in single quotes for sh.
fn quote(value: &str) -> String {
    format!("'{}'", value.replace('\'', r"'\''"))
}
