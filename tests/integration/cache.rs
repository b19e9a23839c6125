//! The artifact cache: hits, precise invalidation, corruption, concurrent runs, resume after
//! kill, gc after a stopped or killed run, entries that hold more than they list, streaming hashes.

use std::time::{Duration, Instant};

use crate::cache_common::{artifact_of, count, entry_count, kill_after_entries, run_chain};
use attnbench_tests::{statuses, stderr, stdout, Sandbox};

#[test]
fn a_rerun_is_served_from_the_cache() {
    let sandbox = Sandbox::new();
    let pipeline = run_chain(&sandbox);
    let pipeline = pipeline.as_str();
    assert_eq!(count(&sandbox.statuses(), "ok"), 5);
    let again = sandbox.run(&["run", pipeline]);
    assert!(again.status.success(), "{}", stderr(&again));
    assert_eq!(
        count(&sandbox.statuses(), "cached"),
        5,
        "{:?}",
        sandbox.statuses()
    );
    let plan = stdout(&sandbox.run(&["plan", pipeline]));
    assert!(
        plan.contains("pipeline chain: 5 nodes, 5 cached, 0 to run"),
        "{plan}"
    );
}

#[test]
fn a_changed_parameter_reruns_only_its_nodes_and_their_dependents() {
    let sandbox = Sandbox::new();
    let pipeline = run_chain(&sandbox);
    let pipeline = pipeline.as_str();

    let changed = sandbox.run(&["run", pipeline, "--set", "stages.a.matrix.size=[1k, 4k]"]);
    assert!(changed.status.success(), "{}", stderr(&changed));
    let statuses = sandbox.statuses();
    assert_eq!(statuses["a[size=1k]"], "cached");
    assert_eq!(statuses["b[size=1k]"], "cached");
    assert_eq!(statuses["a[size=4k]"], "ok");
    assert_eq!(statuses["b[size=4k]"], "ok");
    assert_eq!(
        statuses["c"], "ok",
        "c collects b, whose set of nodes changed"
    );

    // `explain` names the parameter that changed since the cached result.
    let explained = sandbox.run(&[
        "explain",
        pipeline,
        "b[size=2k]",
        "--set",
        "stages.b.with.value=second",
    ]);
    let text = stdout(&explained);
    assert!(explained.status.success(), "{}", stderr(&explained));
    assert!(
        text.contains("parameter `value` changed: first → second"),
        "{text}"
    );
    let cached = stdout(&sandbox.run(&["explain", pipeline, "a[size=2k]"]));
    assert!(cached.contains("is cached"), "{cached}");
}

#[test]
fn a_corrupted_entry_is_detected_and_recomputed() {
    let sandbox = Sandbox::new();
    let pipeline = run_chain(&sandbox);
    let pipeline = pipeline.as_str();
    let record = sandbox.last_record();
    let victim = record["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|n| n["id"] == "a[size=2k]")
        .unwrap();
    let file = format!("{}/echo.json", victim["artifact"].as_str().unwrap());
    std::fs::write(&file, "{\"tampered\": true}").unwrap();

    let verify = sandbox.run(&["cache", "verify"]);
    assert_eq!(
        verify.status.code(),
        Some(1),
        "verify reports corruption: {}",
        stdout(&verify)
    );
    assert!(
        stdout(&verify).contains("echo.json does not match its digest"),
        "{}",
        stdout(&verify)
    );

    let rerun = sandbox.run(&["run", pipeline]);
    assert!(rerun.status.success(), "{}", stderr(&rerun));
    let record = sandbox.last_record();
    let node = record["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|n| n["id"] == "a[size=2k]")
        .unwrap();
    assert_eq!(node["status"], "ok");
    assert!(
        node["note"]
            .as_str()
            .unwrap_or_default()
            .contains("corrupted"),
        "{node}"
    );
    assert_eq!(sandbox.statuses()["a[size=1k]"], "cached");
    let restored =
        std::fs::read_to_string(format!("{}/echo.json", node["artifact"].as_str().unwrap()))
            .unwrap();
    assert!(!restored.contains("tampered"));
    assert!(sandbox.run(&["cache", "verify"]).status.success());
}

#[test]
fn two_concurrent_runs_share_one_cache_without_corrupting_it() {
    let sandbox = Sandbox::new();
    let pipeline = sandbox.write(
        "slow.yaml",
        "name: slow\nstages:\n  s:\n    uses: testkit/echo\n    with: {sleep_ms: 150}\n    matrix: {value: [1, 2, 3, 4, 5, 6]}\n  w:\n    uses: testkit/echo-worker\n    needs: [s]\n",
    );
    let pipeline = pipeline.to_str().unwrap();
    let first = sandbox
        .command(&["run", "-q", "-j", "2", pipeline])
        .spawn()
        .unwrap();
    let second = sandbox
        .command(&["run", "-q", "-j", "2", pipeline])
        .spawn()
        .unwrap();
    let (first, second) = (
        first.wait_with_output().unwrap(),
        second.wait_with_output().unwrap(),
    );
    assert!(first.status.success(), "{}", stderr(&first));
    assert!(second.status.success(), "{}", stderr(&second));

    // Each node was computed by exactly one of the two runs; the other reused it.
    let mut computed = 0;
    for dir in std::fs::read_dir(sandbox.cache().join("runs"))
        .unwrap()
        .flatten()
    {
        let Ok(text) = std::fs::read_to_string(dir.path().join("run.json")) else {
            continue;
        };
        let record: serde_json::Value = serde_json::from_str(&text).unwrap();
        let statuses = statuses(&record);
        assert_eq!(
            count(&statuses, "ok") + count(&statuses, "cached"),
            12,
            "{statuses:?}"
        );
        computed += count(&statuses, "ok");
    }
    assert_eq!(computed, 12);
    assert_eq!(entry_count(&sandbox), 12);
    let verify = sandbox.run(&["cache", "verify"]);
    assert!(verify.status.success(), "{}", stdout(&verify));
}

/// The run record follows the run: killed outright, it still names what finished.
#[test]
fn a_run_killed_outright_leaves_a_record_of_what_finished() {
    let sandbox = Sandbox::new();
    let pipeline = sandbox.write(
        "slow.yaml",
        "name: slow\nstages:\n  s:\n    uses: testkit/echo\n    with: {sleep_ms: 900}\n    matrix: {value: [1, 2, 3, 4, 5, 6]}\n",
    );
    let mut child = sandbox
        .command(&["run", "-q", "-j", "1", pipeline.to_str().unwrap()])
        .spawn()
        .unwrap();
    let runs = sandbox.cache().join("runs");
    let recorded = || -> Option<serde_json::Value> {
        let dir = std::fs::read_dir(&runs)
            .ok()?
            .flatten()
            .find(|e| e.path().is_dir())?;
        let record: serde_json::Value =
            serde_json::from_slice(&std::fs::read(dir.path().join("run.json")).ok()?).ok()?;
        (!record["nodes"].as_array()?.is_empty()).then_some(record)
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    let record = loop {
        if let Some(record) = recorded() {
            break record;
        }
        assert!(Instant::now() < deadline, "no node reached the record");
        std::thread::sleep(Duration::from_millis(50));
    };
    unsafe { libc::kill(child.id() as i32, libc::SIGKILL) };
    let _ = child.wait();
    assert!(record["finished"].is_null(), "{record}");
    for node in record["nodes"].as_array().unwrap() {
        assert_eq!(node["status"], "ok", "{node}");
        let artifact = std::path::PathBuf::from(node["artifact"].as_str().unwrap());
        assert!(artifact.is_dir(), "{node}");
    }
}

#[test]
fn a_run_killed_mid_way_resumes_with_only_the_unfinished_nodes() {
    let sandbox = Sandbox::new();
    let pipeline = sandbox.write(
        "long.yaml",
        "name: long\nstages:\n  s:\n    uses: testkit/echo\n    with: {sleep_ms: 250}\n    matrix: {value: [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]}\n",
    );
    let pipeline = pipeline.to_str().unwrap();
    let finished = kill_after_entries(&sandbox, pipeline, 3);
    assert!(finished < 10, "killed before the end");

    let resumed = sandbox.run(&["run", "-q", pipeline]);
    assert!(resumed.status.success(), "{}", stderr(&resumed));
    let statuses = sandbox.statuses();
    assert_eq!(count(&statuses, "cached"), finished, "{statuses:?}");
    assert_eq!(count(&statuses, "ok"), 10 - finished);
    assert!(sandbox.run(&["cache", "verify"]).status.success());
}

#[test]
fn gc_keeps_what_the_latest_run_used() {
    let sandbox = Sandbox::new();
    let pipeline = run_chain(&sandbox);
    let pipeline = pipeline.as_str();
    assert!(sandbox
        .run(&["run", pipeline, "--set", "stages.b.with.value=other"])
        .status
        .success());
    assert_eq!(
        entry_count(&sandbox),
        8,
        "a and the two versions of b and c"
    );
    let gc = sandbox.run(&["cache", "gc"]);
    assert!(stdout(&gc).contains("removed 3 entries"), "{}", stdout(&gc));
    assert_eq!(entry_count(&sandbox), 5);
    let rerun = sandbox.run(&["run", pipeline, "--set", "stages.b.with.value=other"]);
    assert!(rerun.status.success());
    assert_eq!(count(&sandbox.statuses(), "cached"), 5);
}

/// The documented resume workflow: a run stopped by its time budget (or a signal) before it
/// reached its nodes must not make gc delete what the pipeline still needs.
#[test]
fn gc_after_a_stopped_run_keeps_what_the_pipeline_still_needs() {
    let sandbox = Sandbox::new();
    let pipeline = run_chain(&sandbox);
    let pipeline = pipeline.as_str();
    sandbox.run(&["run", "-q", pipeline, "--time-budget", "0s"]);
    let stopped = sandbox.last_record();

    let gc = sandbox.run(&["cache", "gc"]);
    assert!(gc.status.success(), "{}", stderr(&gc));
    assert!(stdout(&gc).contains("removed 0 entries"), "{}", stdout(&gc));
    assert_eq!(entry_count(&sandbox), 5);
    let first = attnbench_tests::node(&stopped, "a[size=1k]");
    assert_eq!(first["status"], "skipped", "{first}");
    assert!(
        first["key"].as_str().is_some_and(|k| k.len() == 64),
        "a skipped node whose inputs are known has its key: {first}"
    );
    assert!(sandbox.run(&["run", "-q", pipeline]).status.success());
    assert_eq!(
        count(&sandbox.statuses(), "cached"),
        5,
        "{:?}",
        sandbox.statuses()
    );
}

/// Killed outright between two rewrites of its record, a run has committed entries that its
/// record does not name yet; gc keeps them for the resumed run.
#[test]
fn gc_after_a_killed_run_keeps_what_it_computed_but_had_not_recorded() {
    let sandbox = Sandbox::new();
    let pipeline = sandbox.write(
        "slow.yaml",
        "name: slow\nstages:\n  s:\n    uses: testkit/echo\n    with: {sleep_ms: 900}\n    matrix: {value: [1, 2, 3, 4, 5, 6]}\n",
    );
    let pipeline = pipeline.to_str().unwrap();
    // The record is first rewritten 2 s in; the second node is done at about 1.8 s.
    let computed = kill_after_entries(&sandbox, pipeline, 2);

    let gc = sandbox.run(&["cache", "gc"]);
    assert!(gc.status.success(), "{}", stderr(&gc));
    assert_eq!(entry_count(&sandbox), computed, "{}", stdout(&gc));
    assert!(sandbox.run(&["run", "-q", pipeline]).status.success());
    assert_eq!(count(&sandbox.statuses(), "cached"), computed);
}

/// A file put into an entry after it was committed is not vouched for by anything: the entry is
/// invalid for `cache verify`, for a run (which recomputes it) and for `report`.
#[test]
fn a_file_added_to_an_entry_invalidates_it_and_is_never_reported() {
    let sandbox = Sandbox::new();
    let pipeline = run_chain(&sandbox);
    let pipeline = pipeline.as_str();
    let artifact = artifact_of(&sandbox.last_record(), "a[size=2k]");
    std::fs::write(artifact.join("measurement.json"), b"{\"planted\": true}").unwrap();

    let verify = sandbox.run(&["cache", "verify"]);
    assert_eq!(verify.status.code(), Some(1), "{}", stdout(&verify));
    assert!(
        stdout(&verify).contains("measurement.json is not listed"),
        "{}",
        stdout(&verify)
    );

    let out = sandbox.path().join("report");
    let cache = sandbox.cache();
    let report = sandbox.run(&[
        "report",
        "--table",
        "--out",
        out.to_str().unwrap(),
        cache.to_str().unwrap(),
    ]);
    assert!(
        !report.status.success(),
        "the planted record was reported: {}",
        stdout(&report)
    );
    assert!(
        stderr(&report).contains("skipping cache entry")
            && stderr(&report).contains("measurement.json is not listed"),
        "{}",
        stderr(&report)
    );

    assert!(sandbox.run(&["run", "-q", pipeline]).status.success());
    let record = sandbox.last_record();
    assert_eq!(attnbench_tests::node(&record, "a[size=2k]")["status"], "ok");
    assert!(!artifact_of(&record, "a[size=2k]")
        .join("measurement.json")
        .exists());
}

/// Hashing streams: checking an entry with a 512 MiB file does not hold it in memory.
#[test]
fn verifying_a_large_entry_does_not_read_it_into_memory() {
    let sandbox = Sandbox::new();
    run_chain(&sandbox);
    let artifact = artifact_of(&sandbox.last_record(), "a[size=1k]");
    let big = std::fs::File::create(artifact.join("big.bin")).unwrap();
    big.set_len(512 << 20).unwrap();
    let entry_json = artifact.parent().unwrap().join("entry.json");
    let mut meta: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&entry_json).unwrap()).unwrap();
    // Listed, with a digest that does not match: the whole file is hashed before that is known.
    meta["files"]["big.bin"] = "0".repeat(64).into();
    std::fs::write(&entry_json, meta.to_string()).unwrap();

    // Reaped by wait4 below, which also reports its peak memory.
    #[allow(clippy::zombie_processes)]
    let child = sandbox
        .command(&["cache", "verify"])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut status = 0;
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // wait4 gives this child's own peak memory, whatever other tests' children use.
    let waited = unsafe { libc::wait4(child.id() as i32, &mut status, 0, &mut usage) };
    assert_eq!(waited, child.id() as i32);
    let peak_mib = usage.ru_maxrss / 1024;
    let mut text = String::new();
    std::io::Read::read_to_string(&mut child.stdout.unwrap(), &mut text).unwrap();
    assert!(text.contains("big.bin does not match its digest"), "{text}");
    assert!(
        peak_mib < 128,
        "cache verify peaked at {peak_mib} MiB for a 512 MiB file"
    );
}
