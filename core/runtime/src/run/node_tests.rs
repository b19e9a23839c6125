//! What a node's record and its readers get when it fails, when it ran, and when it never started.

use attnbench_sdk::{FailureKind, Isolation, StageFailure};
use serde_json::json;

use super::*;
use crate::plan::tests::{plan, PIPELINE};

#[test]
fn each_failure_sets_its_status_kind_and_message_on_the_record() {
    let plan = plan(PIPELINE).unwrap();
    let cases = [
        (NodeFailure::Error("cache full".into()), Status::Error, None),
        (
            NodeFailure::Stage(StageFailure::new(FailureKind::OutOfMemory, "needs 9 GiB")),
            Status::Error,
            Some(FailureKind::OutOfMemory),
        ),
        (
            NodeFailure::Crashed("signal 11".into()),
            Status::Crashed,
            None,
        ),
        (
            NodeFailure::Timeout("past 90 s".into()),
            Status::Timeout,
            None,
        ),
        (
            NodeFailure::Interrupted("stopped".into()),
            Status::Interrupted,
            None,
        ),
        (
            NodeFailure::NotStarted("job refused".into()),
            Status::Skipped,
            None,
        ),
    ];
    for (failure, status, kind) in cases {
        let message = match &failure {
            NodeFailure::Stage(stage) => stage.message.clone(),
            NodeFailure::Error(m)
            | NodeFailure::Crashed(m)
            | NodeFailure::Timeout(m)
            | NodeFailure::Interrupted(m)
            | NodeFailure::NotStarted(m) => m.clone(),
        };
        let record = bare_record(&plan, 4, Status::Ok, None, None);
        let finished = failed(4, record, failure);
        assert!(finished.output.is_none());
        assert_eq!(finished.record.status, status, "{message}");
        assert_eq!(finished.record.failure, kind, "{message}");
        assert_eq!(finished.record.error.as_deref(), Some(message.as_str()));
    }
}

#[test]
fn a_record_of_a_node_that_did_not_start_names_its_stage_and_inputs() {
    let plan = plan(PIPELINE).unwrap();
    let record = bare_record(
        &plan,
        5,
        Status::Skipped,
        Some("upstream failed".into()),
        None,
    );
    assert_eq!(record.id, "run[mask=full,seqlen=1k,kernel=b]");
    assert_eq!(
        (record.stage.as_str(), record.uses.as_str()),
        ("run", "bench/run")
    );
    assert_eq!(record.inputs, ["masks[mask=full,seqlen=1k]"]);
    assert_eq!(record.params.get("kernel"), Some(&json!("b")));
    assert_eq!(record.key, None, "no key without every input's output");
    assert_eq!(record.duration_s, 0.0);
}

#[test]
fn a_finished_input_reaches_its_reader_with_its_files_result_and_digest() {
    let plan = plan(PIPELINE).unwrap();
    let output = Output {
        digest: "abc".into(),
        files_dir: "/cache/ab/abc/files".into(),
        result: json!({"rows": 3}),
    };
    let record = bare_record(&plan, 0, Status::Ok, None, None);
    let (artifact, digest) = input_artifact(&plan, 0, Some(&output), Some(&record));
    assert_eq!(
        (artifact.node.as_str(), artifact.uses.as_str()),
        ("masks[mask=full,seqlen=1k]", "gen/masks")
    );
    assert_eq!(artifact.status, "ok");
    assert_eq!(artifact.dir, output.files_dir);
    assert_eq!(artifact.result, output.result);
    assert_eq!(artifact.coords.get("mask"), Some(&json!("full")));
    assert_eq!(artifact.error, None);
    assert_eq!(
        (digest.node, digest.digest),
        (artifact.node, "abc".to_string())
    );
}

#[test]
fn a_failed_collected_input_carries_its_status_and_reason_into_the_key() {
    let plan = plan(PIPELINE).unwrap();
    let record = |error: &str| bare_record(&plan, 4, Status::Crashed, Some(error.into()), None);
    let (artifact, first) = input_artifact(&plan, 4, None, Some(&record("signal 11")));
    assert_eq!(artifact.status, "crashed");
    assert_eq!(artifact.error.as_deref(), Some("signal 11"));
    assert_eq!(artifact.dir, PathBuf::new());
    assert!(
        first.digest.starts_with("failed:crashed:"),
        "{}",
        first.digest
    );
    // Another reason is another input: the collecting node is not taken from the cache.
    let (_, second) = input_artifact(&plan, 4, None, Some(&record("signal 6")));
    assert_ne!(first.digest, second.digest);
    // No record at all (it never ran): skipped.
    let (artifact, digest) = input_artifact(&plan, 4, None, None);
    assert_eq!(artifact.status, "skipped");
    assert!(digest.digest.starts_with("failed:skipped:"));
}

#[test]
fn a_stage_with_a_timeout_runs_in_a_worker_whatever_its_manifest_says() {
    let mut plan = plan(PIPELINE).unwrap();
    let stage = &mut plan.pipeline.stages[0];
    assert_eq!(stage_isolation(stage), Isolation::InProcess);
    stage.timeout = Some(std::time::Duration::from_secs(5));
    assert_eq!(stage_isolation(stage), Isolation::Worker);
}

#[test]
fn a_brief_value_is_cut_at_sixty_characters_never_inside_one() {
    assert_eq!(brief(&json!([1, 2])), "[1,2]");
    let long = json!("→".repeat(100));
    let cut = brief(&long);
    assert_eq!(cut.chars().count(), 61, "{cut}");
    assert!(cut.ends_with('…'));
}
