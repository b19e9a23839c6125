//! Misbehaving plugins are recorded with their status while independent nodes finish.

use attnbench_tests::{stderr, Sandbox};

const PIPELINE: &str = r#"
name: faults
stages:
  good:
    uses: testkit/echo
    matrix: {value: [1, 2, 3]}
    with: {sleep_ms: 20}
  good-in-worker:
    uses: testkit/echo-worker
    needs: [good]
  panics-in-process: {uses: testkit/panic}
  panics-in-worker: {uses: testkit/panic-worker}
  aborts: {uses: testkit/abort}
  segfaults: {uses: testkit/segfault}
  hangs: {uses: testkit/hang, timeout: 1.5}
  malformed: {uses: testkit/malformed}
  fails: {uses: testkit/fail}
  prints: {uses: testkit/noisy}
  after-crash:
    uses: testkit/echo
    needs: [segfaults]
  after-good:
    uses: testkit/echo-worker
    needs: {good-in-worker: all}
"#;

#[test]
fn every_fault_is_recorded_and_independent_nodes_finish() {
    let sandbox = Sandbox::new();
    let pipeline = sandbox.write("faults.yaml", PIPELINE);
    let output = sandbox.run(&["run", "-j", "2", pipeline.to_str().unwrap()]);
    assert_eq!(
        output.status.code(),
        Some(1),
        "a run with failed nodes exits 1:\n{}",
        stderr(&output)
    );
    let statuses = sandbox.statuses();
    let expect = [
        ("good[value=1]", "ok"),
        ("good[value=3]", "ok"),
        ("good-in-worker[value=2]", "ok"),
        ("after-good", "ok"),
        ("prints", "ok"),
        ("panics-in-process", "error"),
        ("panics-in-worker", "error"),
        ("malformed", "error"),
        ("fails", "error"),
        ("aborts", "crashed"),
        ("segfaults", "crashed"),
        ("hangs", "timeout"),
        ("after-crash", "skipped"),
    ];
    for (node, status) in expect {
        assert_eq!(
            statuses.get(node).map(String::as_str),
            Some(status),
            "status of {node} in {statuses:?}"
        );
    }

    let record = sandbox.last_record();
    let field_of = |id: &str, field: &str| {
        record["nodes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|n| n["id"] == id)
            .unwrap()[field]
            .as_str()
            .map(str::to_string)
    };
    let error_of = |id: &str| field_of(id, "error").unwrap_or_default();
    assert!(
        error_of("segfaults").contains("SIGSEGV"),
        "{}",
        error_of("segfaults")
    );
    assert!(
        error_of("aborts").contains("SIGABRT"),
        "{}",
        error_of("aborts")
    );
    assert!(
        error_of("panics-in-process").contains("testkit panics on purpose"),
        "{}",
        error_of("panics-in-process")
    );
    assert!(
        error_of("panics-in-worker").contains("lib.rs"),
        "the panic location is kept: {}",
        error_of("panics-in-worker")
    );
    assert!(
        error_of("malformed").contains("expected a JSON object"),
        "{}",
        error_of("malformed")
    );
    assert!(error_of("hangs").contains("1.5s"), "{}", error_of("hangs"));
    // A stage's own failure carries its kind across the ABI; the host's failures around a stage
    // (a crash, a malformed result) have none.
    for (node, kind) in [
        ("panics-in-process", Some("panicked")),
        ("panics-in-worker", Some("panicked")),
        ("fails", Some("failed")),
        ("segfaults", None),
        ("malformed", None),
    ] {
        assert_eq!(
            field_of(node, "failure").as_deref(),
            kind,
            "failure kind of {node}"
        );
    }
    assert!(
        error_of("after-crash").contains("segfaults"),
        "{}",
        error_of("after-crash")
    );

    // The summary names every failed node; a plugin's panic never reaches the terminal raw.
    let text = stderr(&output);
    assert!(text.contains("crashed  segfaults"), "{text}");
    assert!(!text.contains("stack backtrace"), "{text}");

    // What a plugin printed to stdout in a worker landed in its node log, not in the protocol.
    let prints = record["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|n| n["id"] == "prints")
        .unwrap();
    let log = std::fs::read_to_string(prints["log"].as_str().unwrap()).unwrap();
    assert!(
        log.contains("must not corrupt the worker protocol"),
        "{log}"
    );
}

#[test]
fn a_worker_serves_many_nodes_and_a_fresh_one_replaces_a_crashed_one() {
    let sandbox = Sandbox::new();
    let pipeline = sandbox.write(
        "workers.yaml",
        "stages:\n  first:\n    uses: testkit/echo-worker\n    matrix: {value: [1, 2, 3, 4]}\n  crash:\n    uses: testkit/segfault\n    needs: {first: all}\n  second:\n    uses: testkit/echo-worker\n    needs: {crash: all}\n  third:\n    uses: testkit/echo-worker\n    needs: {first: all}\n    matrix: {value: [5, 6]}\n",
    );
    let output = sandbox.run(&["run", "-j", "1", pipeline.to_str().unwrap()]);
    assert_eq!(output.status.code(), Some(1));
    let record = sandbox.last_record();
    let nodes = record["nodes"].as_array().unwrap();
    let pid_of = |id: &str| -> Option<u64> {
        let node = nodes.iter().find(|n| n["id"] == id)?;
        let result =
            std::fs::read_to_string(format!("{}/echo.json", node["artifact"].as_str()?)).ok()?;
        serde_json::from_str::<serde_json::Value>(&result).ok()?["pid"].as_u64()
    };
    let first: Vec<Option<u64>> = (1..=4)
        .map(|v| pid_of(&format!("first[value={v}]")))
        .collect();
    assert!(
        first.iter().all(|pid| pid.is_some() && *pid == first[0]),
        "one warm worker served all of them: {first:?}"
    );
    assert_ne!(first[0], Some(u64::from(std::process::id())));
    let third = pid_of("third[value=5]");
    assert!(third.is_some());
    let statuses = sandbox.statuses();
    assert_eq!(statuses["crash"], "crashed");
    // `second` collects `crash` (`all`): it still runs, and sees the failed input for what it is.
    assert_eq!(statuses["second"], "ok");
    assert_eq!(
        statuses["third[value=6]"], "ok",
        "the run went on after the crash: {statuses:?}"
    );
}
