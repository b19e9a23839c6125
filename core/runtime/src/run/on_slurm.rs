//! A node computed as a Slurm job: its request becomes a task of the queue's next wave, and the
//! job's end becomes the node's result or failure.

use std::path::Path;

use attnbench_sdk::{FailureKind, StageFailure};
use serde_json::Value;

use super::node::NodeFailure;
use crate::pipeline::Stage;
use crate::plan::Params;
use crate::record::SlurmRecord;
use crate::slurm::commands::{JobState, Resources};
use crate::slurm::config::SlurmSettings;
use crate::slurm::task::TaskSpec;
use crate::slurm::{JobEnd, SlurmQueue};

/// Lines of a job's own log quoted when it died without an outcome.
const LOG_TAIL: usize = 3;

/// What a node of `stage` asks Slurm for.
pub(super) fn resources(stage: &Stage, params: &Params, settings: &SlurmSettings) -> Resources {
    let tasks = stage
        .spec
        .tasks_from
        .as_deref()
        .and_then(|param| params.get(param))
        .and_then(Value::as_u64)
        .unwrap_or(1)
        .max(1) as usize;
    let on_gpus = stage.spec.needs_gpu
        || stage.spec.gpu_when.as_ref().is_some_and(|when| {
            params.get(&when.param).and_then(Value::as_str) == Some(when.value.as_str())
        });
    let (nodes, gpus_per_node) = if on_gpus {
        let per_node = settings.gpus_per_node;
        (tasks.div_ceil(per_node), tasks.min(per_node))
    } else {
        (1, 0)
    };
    Resources {
        nodes,
        tasks,
        gpus_per_node,
        minutes: stage.timeout.map(|t| t.as_secs().div_ceil(60) + 1),
        exclusive: stage.spec.exclusive,
    }
}

/// Runs the node's request as a job and waits: the result text, or why there is none.
pub(super) fn run_as_job(
    queue: &SlurmQueue,
    spec: TaskSpec,
    stage: &str,
    resources: Resources,
    stopped: impl Fn() -> bool,
    record: &mut Option<SlurmRecord>,
) -> Result<String, NodeFailure> {
    let minutes = resources.minutes;
    let end = queue
        .run(spec, stage, resources)
        .map_err(|err| NodeFailure::Error(err.to_string()))?;
    if !end.job.is_empty() {
        *record = Some(SlurmRecord {
            job: end.job.clone(),
            host: end.host.clone(),
            state: format!("{:?}", end.state),
            job_log: end.job_log.clone(),
        });
    }
    job_result(end, minutes, stopped())
}

/// The node's result from how its job ended.
fn job_result(end: JobEnd, minutes: Option<u64>, stopped: bool) -> Result<String, NodeFailure> {
    let job = &end.job;
    let on = end
        .host
        .as_deref()
        .map(|host| format!(" on {host}"))
        .unwrap_or_default();
    match end.state {
        JobState::Completed | JobState::Failed if end.outcome.is_some() => end
            .outcome
            .expect("checked above")
            .into_result()
            .map_err(NodeFailure::Stage),
        JobState::Completed | JobState::Failed | JobState::Ended => {
            Err(NodeFailure::Crashed(format!(
                "Slurm job {job} ended {}{on} before its task wrote an outcome{}",
                end.detail,
                tail(&end.job_log)
            )))
        }
        JobState::Timeout => Err(NodeFailure::Timeout(format!(
            "Slurm job {job} ran past its {}-minute limit{on} and Slurm ended it",
            minutes.unwrap_or_default()
        ))),
        JobState::OutOfMemory => Err(NodeFailure::Stage(StageFailure::new(
            FailureKind::OutOfMemory,
            format!("Slurm job {job} ran out of memory{on} (OUT_OF_MEMORY)"),
        ))),
        JobState::NodeFail => Err(NodeFailure::Crashed(format!(
            "Slurm job {job}: its node failed{on} (NODE_FAIL); a rerun computes the node"
        ))),
        JobState::Cancelled if stopped => Err(NodeFailure::Interrupted(format!(
            "the run was stopped and Slurm job {job} was cancelled"
        ))),
        JobState::Cancelled => Err(NodeFailure::Interrupted(format!(
            "Slurm job {job} was cancelled (scancel){on}; a rerun computes the node"
        ))),
        JobState::Pending | JobState::Running => {
            Err(NodeFailure::NotStarted(match job.is_empty() {
                true => end.detail,
                false => format!("Slurm job {job} {}", end.detail),
            }))
        }
    }
}

/// The last lines of a job's own log, as `: line | line`.
fn tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().rev().take(LOG_TAIL).collect();
    match lines.is_empty() {
        true => String::new(),
        false => format!(
            ": {}",
            lines.into_iter().rev().collect::<Vec<_>>().join(" | ")
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::Status;
    use crate::slurm::task::Outcome;

    fn end(state: JobState, outcome: Option<Outcome>) -> JobEnd {
        JobEnd {
            job: "41_2".into(),
            state,
            detail: "X (None)".into(),
            host: Some("node7".into()),
            outcome,
            job_log: std::path::PathBuf::from("/nonexistent"),
        }
    }

    #[test]
    fn job_states_become_node_statuses() {
        let status =
            |state, outcome, stopped| match job_result(end(state, outcome), Some(3), stopped) {
                Ok(_) => Status::Ok,
                Err(failure) => failure.status(),
            };
        let ok = Outcome {
            ok: true,
            output: "{}".into(),
            failure: None,
        };
        assert_eq!(status(JobState::Completed, Some(ok), false), Status::Ok);
        assert_eq!(status(JobState::Completed, None, false), Status::Crashed);
        assert_eq!(status(JobState::Failed, None, false), Status::Crashed);
        assert_eq!(status(JobState::Timeout, None, false), Status::Timeout);
        assert_eq!(status(JobState::OutOfMemory, None, false), Status::Error);
        assert_eq!(status(JobState::NodeFail, None, false), Status::Crashed);
        assert_eq!(
            status(JobState::Cancelled, None, false),
            Status::Interrupted
        );
        assert_eq!(status(JobState::Cancelled, None, true), Status::Interrupted);
        assert_eq!(status(JobState::Pending, None, false), Status::Skipped);
        let failed = Outcome {
            ok: false,
            output: "no".into(),
            failure: Some(FailureKind::Params),
        };
        match job_result(end(JobState::Completed, Some(failed)), None, false) {
            Err(NodeFailure::Stage(failure)) => assert_eq!(failure.kind, FailureKind::Params),
            other => panic!("{other:?}"),
        }
    }
}
