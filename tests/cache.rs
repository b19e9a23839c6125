//! The artifact cache: hits, precise invalidation, corruption, concurrent runs, resume after kill.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use attnbench_tests::{statuses, stderr, stdout, Sandbox};

const CHAIN: &str = r#"
name: chain
seed: 3
stages:
  a:
    uses: testkit/echo
    matrix: {size: [1k, 2k]}
  b:
    uses: testkit/echo
    needs: [a]
    with: {value: first}
  c:
    uses: testkit/echo
    needs: {b: all}
"#;

fn count(statuses: &BTreeMap<String, String>, status: &str) -> usize {
    statuses.values().filter(|s| *s == status).count()
}

fn entry_count(sandbox: &Sandbox) -> usize {
    let Ok(shards) = std::fs::read_dir(sandbox.cache().join("cache")) else {
        return 0;
    };
    shards
        .flatten()
        .map(|shard| {
            std::fs::read_dir(shard.path())
                .map(|d| d.count())
                .unwrap_or(0)
        })
        .sum()
}

#[test]
fn a_rerun_is_served_from_the_cache() {
    let sandbox = Sandbox::new();
    let pipeline = sandbox.write("chain.yaml", CHAIN);
    let pipeline = pipeline.to_str().unwrap();
    assert!(sandbox.run(&["run", pipeline]).status.success());
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
    let pipeline = sandbox.write("chain.yaml", CHAIN);
    let pipeline = pipeline.to_str().unwrap();
    assert!(sandbox.run(&["run", pipeline]).status.success());

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
    let pipeline = sandbox.write("chain.yaml", CHAIN);
    let pipeline = pipeline.to_str().unwrap();
    assert!(sandbox.run(&["run", pipeline]).status.success());
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
    let mut child = sandbox
        .command(&["run", "-q", "-j", "1", pipeline])
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while entry_count(&sandbox) < 3 {
        assert!(Instant::now() < deadline, "the run made no progress");
        std::thread::sleep(Duration::from_millis(20));
    }
    unsafe { libc::kill(child.id() as i32, libc::SIGKILL) };
    let _ = child.wait();
    let finished = entry_count(&sandbox);
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
    let pipeline = sandbox.write("chain.yaml", CHAIN);
    let pipeline = pipeline.to_str().unwrap();
    assert!(sandbox.run(&["run", pipeline]).status.success());
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

/// A sweep cut short on one machine resumes on another: `cache export` there, `cache import`
/// here, and the run is served from what was carried over. A tampered entry is refused.
#[test]
fn an_export_carried_to_another_cache_is_reused_and_tampering_is_refused() {
    let first = Sandbox::new();
    let pipeline = first.write("chain.yaml", CHAIN);
    assert!(first
        .run(&["run", pipeline.to_str().unwrap(), "-q"])
        .status
        .success());
    let carried = first.path().join("carried");
    let export = first.run(&["cache", "export", carried.to_str().unwrap()]);
    assert!(export.status.success(), "{}", stderr(&export));
    assert!(
        stdout(&export).contains("exported 5 entries and 1 run records"),
        "{}",
        stdout(&export)
    );

    let second = Sandbox::new();
    let pipeline = second.write("chain.yaml", CHAIN);
    let import = second.run(&["cache", "import", carried.to_str().unwrap()]);
    assert!(import.status.success(), "{}", stderr(&import));
    assert!(
        stdout(&import)
            .contains("imported 5 entries (0 already here, 0 rejected) and 1 run records"),
        "{}",
        stdout(&import)
    );
    let imported_run = std::fs::read_dir(second.cache().join("runs"))
        .unwrap()
        .flatten()
        .find(|e| e.path().join("run.json").is_file())
        .expect("the run record came along")
        .path();
    let record: serde_json::Value =
        serde_json::from_slice(&std::fs::read(imported_run.join("run.json")).unwrap()).unwrap();
    for node in record["nodes"].as_array().unwrap() {
        let artifact = node["artifact"].as_str().unwrap();
        assert!(
            std::path::Path::new(artifact).starts_with(second.cache().canonicalize().unwrap()),
            "{artifact} points into this cache"
        );
    }
    assert!(second
        .run(&["run", pipeline.to_str().unwrap(), "-q"])
        .status
        .success());
    assert_eq!(
        count(&second.statuses(), "cached"),
        5,
        "{:?}",
        second.statuses()
    );

    // One entry's file altered after the export: refused, the others still come in.
    let victim = walk_files(&carried.join("cache"))
        .into_iter()
        .find(|p| p.file_name().is_some_and(|n| n == "echo.json"))
        .expect("an entry file");
    std::fs::write(&victim, b"{\"tampered\": true}").unwrap();
    let third = Sandbox::new();
    let import = third.run(&["cache", "import", carried.to_str().unwrap()]);
    assert_eq!(import.status.code(), Some(1), "{}", stdout(&import));
    let text = stdout(&import);
    assert!(
        text.contains("does not match its digest")
            && text.contains("imported 4 entries (0 already here, 1 rejected)"),
        "{text}"
    );
    let missing = third.run(&[
        "cache",
        "import",
        third.path().join("nothing").to_str().unwrap(),
    ]);
    assert!(
        !missing.status.success() && stderr(&missing).contains("not a cache or an export"),
        "{}",
        stderr(&missing)
    );
}

fn walk_files(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap().flatten() {
        if entry.path().is_dir() {
            files.extend(walk_files(&entry.path()));
        } else {
            files.push(entry.path());
        }
    }
    files
}
