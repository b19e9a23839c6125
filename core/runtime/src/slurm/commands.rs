//! Slurm's commands, as the queue uses them: `sbatch` for a wave's job array, `scontrol` for the
//! jobs' states, `scancel` to stop them. Job states are read from `scontrol -o show job`, which
//! needs no accounting database (`sacct` does).

use std::path::{Path, PathBuf};
use std::process::Command;

/// Why a Slurm job could not be submitted, asked about or run.
#[derive(Debug, thiserror::Error)]
pub enum JobError {
    #[error("cannot run {program}: {source}")]
    Spawn {
        program: &'static str,
        source: std::io::Error,
    },
    #[error("sbatch refused the job: {0}")]
    Refused(String),
    #[error("sbatch printed no job id: `{0}`")]
    NoJobId(String),
    #[error("scontrol show job {job}: {stderr}")]
    Query { job: String, stderr: String },
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{}: not a task file: {source}", path.display())]
    TaskFile {
        path: PathBuf,
        source: serde_json::Error,
    },
    #[error("no --index given and SLURM_ARRAY_TASK_ID is not set")]
    NoIndex,
    #[error("{} holds {count} tasks; there is no task {index}", path.display())]
    NoTask {
        path: PathBuf,
        count: usize,
        index: usize,
    },
    #[error("encoding {what}: {source}")]
    Encode {
        what: &'static str,
        source: serde_json::Error,
    },
    #[error("the Slurm queue has stopped")]
    QueueStopped,
    #[error("the Slurm queue stopped before the job ended")]
    QueueStoppedBeforeEnd,
}

impl JobError {
    pub(super) fn io(path: &Path) -> impl FnOnce(std::io::Error) -> JobError + '_ {
        move |source| JobError::Io {
            path: path.to_path_buf(),
            source,
        }
    }
}

/// What the resources of one job are; nodes with equal resources share a job array.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Resources {
    pub nodes: usize,
    pub tasks: usize,
    pub gpus_per_node: usize,
    /// Minutes, rounded up, with one more for the job's own start.
    pub minutes: Option<u64>,
    /// Whole nodes: benchmarks must not share their machine.
    pub exclusive: bool,
}

/// A job's state as `scontrol` names it, in the groups attnbench tells apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JobState {
    Pending,
    Running,
    Completed,
    Failed,
    Timeout,
    Cancelled,
    NodeFail,
    OutOfMemory,
    /// Ended in a state attnbench has no better name for (`BOOT_FAIL`, `DEADLINE`, `PREEMPTED`).
    Ended,
}

impl JobState {
    pub fn parse(name: &str) -> JobState {
        match name {
            "PENDING" | "CONFIGURING" | "REQUEUED" | "RESV_DEL_HOLD" | "SUSPENDED" => {
                JobState::Pending
            }
            "RUNNING" | "COMPLETING" | "STAGE_OUT" | "SIGNALING" | "RESIZING" => JobState::Running,
            "COMPLETED" => JobState::Completed,
            "FAILED" => JobState::Failed,
            "TIMEOUT" => JobState::Timeout,
            "CANCELLED" => JobState::Cancelled,
            "NODE_FAIL" => JobState::NodeFail,
            "OUT_OF_MEMORY" => JobState::OutOfMemory,
            _ => JobState::Ended,
        }
    }

    pub fn is_final(self) -> bool {
        !matches!(self, JobState::Pending | JobState::Running)
    }
}

/// One array task's line of `scontrol -o show job`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TaskState {
    pub index: usize,
    pub state: JobState,
    /// `JobState` as Slurm wrote it, and its `Reason`.
    pub raw: String,
    pub reason: String,
    pub host: Option<String>,
}

/// The array tasks named in `scontrol -o show job ARRAY` output. Tasks still pending together are
/// one line with a range (`ArrayTaskId=2-5`); each gets that line's state.
pub fn parse_array(text: &str) -> Vec<TaskState> {
    let mut tasks = Vec::new();
    for line in text.lines() {
        let field = |name: &str| {
            line.split_whitespace()
                .find_map(|word| word.strip_prefix(name)?.strip_prefix('='))
        };
        let (Some(ids), Some(raw)) = (field("ArrayTaskId"), field("JobState")) else {
            continue;
        };
        let reason = field("Reason").unwrap_or("None").to_string();
        let host = field("BatchHost").map(str::to_string);
        for index in task_ids(ids) {
            tasks.push(TaskState {
                index,
                state: JobState::parse(raw),
                raw: raw.to_string(),
                reason: reason.clone(),
                host: host.clone(),
            });
        }
    }
    tasks
}

/// `0`, `2-5`, `1,3-4`, `0-9%2` → the indices.
fn task_ids(ids: &str) -> Vec<usize> {
    let ids = ids.split('%').next().unwrap_or_default();
    let mut out = Vec::new();
    for part in ids.split(',') {
        match part.split_once('-') {
            Some((a, b)) => {
                if let (Ok(a), Ok(b)) = (a.parse::<usize>(), b.parse::<usize>()) {
                    out.extend(a..=b);
                }
            }
            None => out.extend(part.parse::<usize>().ok()),
        }
    }
    out
}

/// The commands attnbench runs that are not on `PATH`.
pub fn missing_commands() -> Vec<&'static str> {
    ["sbatch", "scontrol", "scancel", "srun"]
        .into_iter()
        .filter(|name| which(name).is_none())
        .collect()
}

fn which(name: &str) -> Option<std::path::PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(name))
        .find(|candidate| candidate.is_file())
}

/// `sbatch`'s options for a job array of `count` tasks with `resources`.
pub fn sbatch_args(
    settings: &super::config::SlurmSettings,
    resources: &Resources,
    count: usize,
    name: &str,
    log_pattern: &Path,
) -> Vec<String> {
    let mut args = vec![
        "--parsable".to_string(),
        format!("--job-name={name}"),
        format!("--array=0-{}", count.saturating_sub(1)),
        format!("--nodes={}", resources.nodes),
        format!("--ntasks={}", resources.tasks),
        format!("--output={}", log_pattern.display()),
    ];
    if resources.gpus_per_node > 0 {
        args.push(format!("--gpus-per-node={}", resources.gpus_per_node));
    }
    if let Some(minutes) = resources.minutes {
        args.push(format!("--time={minutes}"));
    }
    if resources.exclusive {
        args.push("--exclusive".into());
    }
    for (flag, value) in [
        ("partition", &settings.partition),
        ("account", &settings.account),
        ("qos", &settings.qos),
    ] {
        if let Some(value) = value {
            args.push(format!("--{flag}={value}"));
        }
    }
    args.extend(settings.extra.iter().cloned());
    args
}

/// Submits `script` with `args`: the array's job id, or what `sbatch` said.
pub fn submit(args: &[String], script: &Path) -> Result<String, JobError> {
    let output = Command::new("sbatch")
        .args(args)
        .arg(script)
        .output()
        .map_err(|source| JobError::Spawn {
            program: "sbatch",
            source,
        })?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    if !output.status.success() {
        let stderr = String::from_utf8_lossy(&output.stderr);
        return Err(JobError::Refused(
            stderr
                .trim()
                .trim_start_matches("sbatch: error: ")
                .to_string(),
        ));
    }
    // `--parsable` prints `id` or `id;cluster`.
    let id = stdout
        .trim()
        .split(';')
        .next()
        .unwrap_or_default()
        .to_string();
    if id.is_empty() || !id.chars().all(|c| c.is_ascii_digit()) {
        return Err(JobError::NoJobId(stdout.trim().to_string()));
    }
    Ok(id)
}

/// The states of array `job`'s tasks; `None` when Slurm no longer knows the job.
pub fn query(job: &str) -> Result<Option<Vec<TaskState>>, JobError> {
    let output = Command::new("scontrol")
        .args(["-o", "show", "job", job])
        .output()
        .map_err(|source| JobError::Spawn {
            program: "scontrol",
            source,
        })?;
    if !output.status.success() {
        let stderr = String::from_utf8_lossy(&output.stderr);
        if stderr.contains("Invalid job id") {
            return Ok(None);
        }
        return Err(JobError::Query {
            job: job.to_string(),
            stderr: stderr.trim().to_string(),
        });
    }
    Ok(Some(parse_array(&String::from_utf8_lossy(&output.stdout))))
}

/// Cancels `job` (a whole array, or `ARRAY_INDEX` for one task).
pub fn cancel(job: &str) {
    let _ = Command::new("scancel").arg(job).output();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn array_lines_give_each_task_its_state() {
        let text = "JobId=12 ArrayJobId=10 ArrayTaskId=2-3 JobName=x JobState=PENDING Reason=Resources Dependency=(null)\n\
                    JobId=11 ArrayJobId=10 ArrayTaskId=1 JobState=RUNNING Reason=None BatchHost=node7\n\
                    JobId=10 ArrayJobId=10 ArrayTaskId=0 JobState=OUT_OF_MEMORY Reason=OutOfMemory BatchHost=node7\n";
        let tasks = parse_array(text);
        let states: Vec<(usize, JobState)> = tasks.iter().map(|t| (t.index, t.state)).collect();
        assert_eq!(
            states,
            [
                (2, JobState::Pending),
                (3, JobState::Pending),
                (1, JobState::Running),
                (0, JobState::OutOfMemory)
            ]
        );
        assert_eq!(tasks[0].reason, "Resources");
        assert_eq!(tasks[2].host.as_deref(), Some("node7"));
        assert_eq!(task_ids("1,3-4%2"), [1, 3, 4]);
    }

    #[test]
    fn sbatch_args_carry_resources_and_site_flags() {
        let settings = super::super::config::ExecutorSection {
            partition: Some("gpu".into()),
            extra: Some(vec!["--constraint=h200".into()]),
            ..Default::default()
        }
        .slurm();
        let resources = Resources {
            nodes: 2,
            tasks: 16,
            gpus_per_node: 8,
            minutes: Some(11),
            exclusive: true,
        };
        let args = sbatch_args(&settings, &resources, 3, "cp", Path::new("/c/%A_%a.log"));
        for expected in [
            "--array=0-2",
            "--nodes=2",
            "--ntasks=16",
            "--gpus-per-node=8",
            "--time=11",
            "--exclusive",
            "--partition=gpu",
            "--constraint=h200",
            "--output=/c/%A_%a.log",
        ] {
            assert!(args.iter().any(|a| a == expected), "{expected} in {args:?}");
        }
        assert!(!args.iter().any(|a| a.starts_with("--account")));
    }
}
