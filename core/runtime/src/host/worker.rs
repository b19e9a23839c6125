//! Worker processes: `attnbench worker --plugin LIB` loads one plugin and runs node after node
//! for the host, speaking JSON lines. A segfault, abort or hang kills only the worker; the host
//! records the node and starts a fresh worker for the next one.

use std::collections::VecDeque;
use std::fs::File;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use attnbench_abi::LogLevel;
use attnbench_sdk::{FailureKind, StageFailure};
use serde::{Deserialize, Serialize};

use crate::host::plugin::Plugin;
use crate::host::services::ServiceSink;

/// How long a worker may take to load its plugin and say it is ready.
const START_TIMEOUT: Duration = Duration::from_secs(60);
/// Lines of a dead worker's stderr quoted in the node's error.
const STDERR_TAIL: usize = 4;
/// Written to stderr by the worker after each node, so the host knows the node's stderr is complete.
const STDERR_MARK: &str = "\u{1}attnbench-node-done";

#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum ToWorker {
    Run { stage: String, request: String },
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum FromWorker {
    Ready {
        plugin: String,
        pid: u32,
    },
    Fatal {
        error: String,
    },
    Log {
        level: String,
        message: String,
    },
    Progress {
        done: u64,
        total: u64,
        message: String,
    },
    Done {
        ok: bool,
        output: String,
        /// The failure's kind when `ok` is false.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        failure: Option<FailureKind>,
    },
}

// ---------------------------------------------------------------------------------------------
// The worker's side.

/// Runs the worker loop on stdin/stdout until the host closes stdin.
pub fn serve(plugin_path: &Path) -> std::io::Result<()> {
    // The protocol gets its own copy of stdout; fd 1 is pointed at stderr, so whatever a plugin
    // prints ends up in the node's log instead of corrupting the protocol.
    let protocol = unsafe {
        let fd = libc::dup(1);
        if fd < 0 || libc::dup2(2, 1) < 0 {
            return Err(std::io::Error::last_os_error());
        }
        #[cfg(target_os = "linux")]
        libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
        // A stop is the host's to handle (it lets running nodes finish and ends workers itself):
        // Ctrl-C, and the SIGTERM that `timeout` and batch schedulers send the whole process
        // group, would otherwise kill the node the host is waiting for. Ignored dispositions
        // survive exec, so interpreters a plugin starts are covered too.
        libc::signal(libc::SIGINT, libc::SIG_IGN);
        libc::signal(libc::SIGTERM, libc::SIG_IGN);
        <File as std::os::fd::FromRawFd>::from_raw_fd(fd)
    };
    let channel = Protocol(Mutex::new(protocol));
    let plugin = match Plugin::load(plugin_path) {
        Ok(plugin) => plugin,
        Err(err) => {
            channel.send(&FromWorker::Fatal {
                error: err.to_string(),
            });
            std::process::exit(1);
        }
    };
    channel.send(&FromWorker::Ready {
        plugin: plugin.manifest.name.clone(),
        pid: std::process::id(),
    });
    for line in std::io::stdin().lock().lines() {
        let line = line?;
        if line.trim().is_empty() {
            continue;
        }
        let ToWorker::Run { stage, request } = match serde_json::from_str(&line) {
            Ok(message) => message,
            Err(err) => {
                channel.send(&FromWorker::Done {
                    ok: false,
                    output: format!("worker received a malformed message: {err}"),
                    failure: Some(FailureKind::Failed),
                });
                continue;
            }
        };
        let outcome = plugin.run(&stage, &request, &channel);
        let (ok, output, failure) = match outcome {
            Ok(result) => (true, result, None),
            Err(err) => (false, err.message, Some(err.kind)),
        };
        eprintln!("{STDERR_MARK}");
        channel.send(&FromWorker::Done {
            ok,
            output,
            failure,
        });
    }
    Ok(())
}

struct Protocol(Mutex<File>);

impl Protocol {
    fn send(&self, message: &FromWorker) {
        let mut line = serde_json::to_string(message).unwrap_or_default();
        line.push('\n');
        if let Ok(mut out) = self.0.lock() {
            // The host is gone if this fails; the worker then dies with its parent.
            let _ = out.write_all(line.as_bytes()).and_then(|_| out.flush());
        }
    }
}

impl ServiceSink for Protocol {
    fn log(&self, level: LogLevel, message: &str) {
        self.send(&FromWorker::Log {
            level: level.as_str().into(),
            message: message.into(),
        });
    }

    fn progress(&self, done: u64, total: u64, message: &str) {
        self.send(&FromWorker::Progress {
            done,
            total,
            message: message.into(),
        });
    }

    fn is_cancelled(&self) -> bool {
        // A worker node is stopped by killing the worker, never by asking.
        false
    }
}

// ---------------------------------------------------------------------------------------------
// The host's side.

/// How a node sent to a worker ended.
#[derive(Debug)]
pub enum WorkerOutcome {
    /// The plugin returned: its result JSON, or its typed failure.
    Finished(Result<String, StageFailure>),
    /// The worker died; the reason names the signal or exit status and quotes its stderr.
    Crashed(String),
    TimedOut,
    /// The run was stopped and the node was not done [`STOP_GRACE`] later: its worker was killed.
    Stopped,
}

/// How long a running node may still finish once the run is stopped. Schedulers follow their
/// SIGTERM with a SIGKILL (`timeout -k`, Slurm's KillWait of 30 s): a node that ran on would take
/// the run record down with it.
pub const STOP_GRACE: Duration = Duration::from_secs(10);
const STOP_POLL: Duration = Duration::from_millis(200);

/// Where a worker's stderr goes: the log of the node it is running.
type StderrTarget = Arc<Mutex<(Option<File>, VecDeque<String>)>>;

pub struct Worker {
    pub plugin_path: PathBuf,
    pub pid: u32,
    child: Child,
    stdin: Option<ChildStdin>,
    messages: Receiver<FromWorker>,
    stderr: StderrTarget,
    stderr_marks: Receiver<()>,
}

/// Why a worker process did not become ready.
#[derive(Debug, thiserror::Error)]
pub enum SpawnError {
    #[error("cannot start a worker ({}): {source}", exe.display())]
    Start {
        exe: PathBuf,
        source: std::io::Error,
    },
    /// The worker could not load the plugin, in its own words.
    #[error("{0}")]
    Fatal(String),
    #[error("worker sent {0} before it was ready")]
    Protocol(String),
    #[error("worker did not start: {0}")]
    Died(String),
}

impl Worker {
    pub fn spawn(
        exe: &Path,
        plugin_path: &Path,
        env: &[(String, String)],
    ) -> Result<Worker, SpawnError> {
        let mut child = Command::new(exe)
            .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .arg("worker")
            .arg("--plugin")
            .arg(plugin_path)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|source| SpawnError::Start {
                exe: exe.to_path_buf(),
                source,
            })?;
        let stdout = child.stdout.take().expect("piped above");
        let stderr = child.stderr.take().expect("piped above");
        let (sender, messages) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                match serde_json::from_str::<FromWorker>(&line) {
                    Ok(message) => {
                        if sender.send(message).is_err() {
                            break;
                        }
                    }
                    Err(_) => tracing::warn!("worker sent a line that is not protocol: {line}"),
                }
            }
        });
        let target: StderrTarget = Arc::new(Mutex::new((None, VecDeque::new())));
        let stderr_target = Arc::clone(&target);
        let (mark_sender, stderr_marks) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                if line == STDERR_MARK {
                    let _ = mark_sender.send(());
                    continue;
                }
                if let Ok(mut guard) = stderr_target.lock() {
                    let (log, tail) = &mut *guard;
                    if let Some(log) = log.as_mut() {
                        let _ = writeln!(log, "[stderr] {line}");
                    }
                    tail.push_back(line);
                    if tail.len() > STDERR_TAIL {
                        tail.pop_front();
                    }
                }
            }
        });
        let pid = child.id();
        let stdin = child.stdin.take();
        let mut worker = Worker {
            plugin_path: plugin_path.to_path_buf(),
            pid,
            child,
            stdin,
            messages,
            stderr: target,
            stderr_marks,
        };
        match worker.messages.recv_timeout(START_TIMEOUT) {
            Ok(FromWorker::Ready { .. }) => Ok(worker),
            Ok(FromWorker::Fatal { error }) => Err(SpawnError::Fatal(error)),
            Ok(other) => Err(SpawnError::Protocol(format!("{other:?}"))),
            Err(_) => Err(SpawnError::Died(worker.death_reason())),
        }
    }

    /// Sends one node and waits for it, forwarding logs and progress to `sink` and stderr to `log`;
    /// once `stop` is set the node has [`STOP_GRACE`] left.
    pub fn run(
        &mut self,
        stage: &str,
        request: &str,
        timeout: Option<Duration>,
        stop: &AtomicBool,
        sink: &dyn ServiceSink,
        log: Option<File>,
    ) -> WorkerOutcome {
        if let Ok(mut guard) = self.stderr.lock() {
            *guard = (log, VecDeque::new());
        }
        let message = ToWorker::Run {
            stage: stage.to_string(),
            request: request.to_string(),
        };
        let mut line = serde_json::to_string(&message).unwrap_or_default();
        line.push('\n');
        let sent = self
            .stdin
            .as_mut()
            .map(|stdin| stdin.write_all(line.as_bytes()).and_then(|_| stdin.flush()));
        if !matches!(sent, Some(Ok(()))) {
            return WorkerOutcome::Crashed(self.death_reason());
        }
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut stopped_at: Option<Instant> = None;
        let outcome = loop {
            // Checked before every wait: a node that keeps reporting progress never lets one
            // time out.
            let ended = if deadline.is_some_and(|d| Instant::now() >= d) {
                Some(WorkerOutcome::TimedOut)
            } else if stop.load(Ordering::Relaxed)
                && stopped_at.get_or_insert_with(Instant::now).elapsed() >= STOP_GRACE
            {
                Some(WorkerOutcome::Stopped)
            } else {
                None
            };
            if let Some(outcome) = ended {
                let _ = self.child.kill();
                let _ = self.child.wait();
                break outcome;
            }
            // Short waits, so a stop is noticed while the node runs.
            let wait = deadline
                .map(|d| d.saturating_duration_since(Instant::now()))
                .unwrap_or(STOP_POLL)
                .min(STOP_POLL);
            match self.messages.recv_timeout(wait) {
                Ok(FromWorker::Log { level, message }) => {
                    sink.log(LogLevel::parse(&level).unwrap_or(LogLevel::Info), &message)
                }
                Ok(FromWorker::Progress {
                    done,
                    total,
                    message,
                }) => sink.progress(done, total, &message),
                Ok(FromWorker::Done {
                    ok,
                    output,
                    failure,
                }) => {
                    // Everything the node wrote to stderr precedes the mark.
                    let _ = self.stderr_marks.recv_timeout(Duration::from_secs(1));
                    break WorkerOutcome::Finished(if ok {
                        Ok(output)
                    } else {
                        Err(StageFailure::new(
                            failure.unwrap_or(FailureKind::Failed),
                            output,
                        ))
                    });
                }
                Ok(other) => {
                    break WorkerOutcome::Crashed(format!(
                        "worker broke the protocol: sent {other:?} while running a node"
                    ))
                }
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => {
                    break WorkerOutcome::Crashed(self.death_reason())
                }
            }
        };
        if let Ok(mut guard) = self.stderr.lock() {
            guard.0 = None;
        }
        outcome
    }

    /// Why the worker is gone: its signal or exit status and the last lines of its stderr.
    fn death_reason(&mut self) -> String {
        // The pipes close a moment before the process is reaped.
        let deadline = Instant::now() + Duration::from_secs(5);
        let status = loop {
            match self.child.try_wait() {
                Ok(Some(status)) => break Some(status),
                Ok(None) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(5))
                }
                _ => break None,
            }
        };
        // Let the stderr reader drain what the dying process wrote.
        std::thread::sleep(Duration::from_millis(20));
        let mut reason = match status {
            Some(status) => match status.signal() {
                Some(signal) => format!("worker died of signal {signal} ({})", signal_name(signal)),
                None => format!("worker exited with status {}", status.code().unwrap_or(-1)),
            },
            None => "worker stopped answering".to_string(),
        };
        if let Ok(guard) = self.stderr.lock() {
            let tail: Vec<&str> = guard
                .1
                .iter()
                .map(String::as_str)
                .filter(|l| !l.trim().is_empty())
                .collect();
            if !tail.is_empty() {
                reason.push_str(&format!("; its last stderr: {}", tail.join(" | ")));
            }
        }
        reason
    }

    pub fn is_alive(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        // Closing stdin asks the worker to exit; one that does not is killed.
        self.stdin.take();
        let deadline = Instant::now() + Duration::from_millis(500);
        while Instant::now() < deadline {
            if !matches!(self.child.try_wait(), Ok(None)) {
                return;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn signal_name(signal: i32) -> &'static str {
    match signal {
        libc::SIGSEGV => "SIGSEGV: invalid memory access",
        libc::SIGABRT => "SIGABRT: aborted",
        libc::SIGBUS => "SIGBUS: bus error",
        libc::SIGFPE => "SIGFPE: arithmetic fault",
        libc::SIGILL => "SIGILL: illegal instruction",
        libc::SIGKILL => "SIGKILL: killed, possibly by the out-of-memory killer",
        libc::SIGTERM => "SIGTERM: terminated",
        _ => "signal",
    }
}

/// Idle workers kept warm between nodes, one plugin library each.
pub struct WorkerPool {
    exe: PathBuf,
    idle: Mutex<Vec<Worker>>,
    /// The caller's part of every worker's environment, asked for on first use.
    extra_env: WorkerEnv,
    env: std::sync::OnceLock<Vec<(String, String)>>,
}

/// What workers' environments get beyond the host's own, from whoever starts the run (the CLI:
/// the GPU libraries it found, the folder plugins keep their caches in). The runtime knows neither;
/// it asks once, when the first worker starts.
pub type WorkerEnv = Arc<dyn Fn() -> Vec<(String, String)> + Send + Sync>;

impl WorkerPool {
    pub fn new(exe: PathBuf, extra_env: WorkerEnv) -> Self {
        WorkerPool {
            exe,
            idle: Mutex::new(Vec::new()),
            extra_env,
            env: std::sync::OnceLock::new(),
        }
    }

    /// The environment workers start with.
    pub fn env(&self) -> &[(String, String)] {
        self.env.get_or_init(|| (self.extra_env)())
    }

    /// A warm worker for `plugin`, or a new one.
    pub fn acquire(&self, plugin: &Path) -> Result<Worker, SpawnError> {
        if let Ok(mut idle) = self.idle.lock() {
            while let Some(position) = idle.iter().position(|w| w.plugin_path == plugin) {
                let mut worker = idle.swap_remove(position);
                if worker.is_alive() {
                    return Ok(worker);
                }
            }
        }
        Worker::spawn(&self.exe, plugin, self.env())
    }

    pub fn release(&self, worker: Worker) {
        if let Ok(mut idle) = self.idle.lock() {
            idle.push(worker);
        }
    }
}

#[cfg(test)]
#[path = "worker_tests.rs"]
mod tests;
