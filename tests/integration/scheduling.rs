//! Independent nodes run in parallel; exclusive nodes (measurements) run alone.

use attnbench_tests::{stderr, stdout, Sandbox};

/// (started, finished) in microseconds of every node, from the echo results.
fn intervals(sandbox: &Sandbox) -> Vec<(String, u128, u128)> {
    let record = sandbox.last_record();
    record["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|node| {
            let text = std::fs::read_to_string(format!(
                "{}/echo.json",
                node["artifact"].as_str().unwrap()
            ))
            .unwrap();
            let result: serde_json::Value = serde_json::from_str(&text).unwrap();
            let time = |key: &str| result[key].as_u64().unwrap() as u128;
            (
                node["id"].as_str().unwrap().to_string(),
                time("started_us"),
                time("finished_us"),
            )
        })
        .collect()
}

#[test]
fn independent_nodes_overlap_and_exclusive_ones_run_alone() {
    let sandbox = Sandbox::new();
    sandbox.write(
        "p.yaml",
        "stages:\n  work:\n    uses: testkit/echo-worker\n    with: {sleep_ms: 300}\n    matrix: {value: [1, 2, 3, 4]}\n  measure:\n    uses: testkit/measure\n    with: {sleep_ms: 200}\n    matrix: {value: [1, 2, 3]}\n",
    );
    let output = sandbox.run(&["run", "-j", "4", "p.yaml"]);
    assert!(output.status.success(), "{}", stderr(&output));
    let all = intervals(&sandbox);
    let overlaps = |a: &(String, u128, u128), b: &(String, u128, u128)| a.1 < b.2 && b.1 < a.2;
    let work: Vec<_> = all.iter().filter(|n| n.0.starts_with("work")).collect();
    let parallel = work
        .iter()
        .enumerate()
        .any(|(i, a)| work[i + 1..].iter().any(|b| overlaps(a, b)));
    assert!(
        parallel,
        "independent nodes ran in parallel with -j 4: {work:?}"
    );
    for measure in all.iter().filter(|n| n.0.starts_with("measure")) {
        for other in all.iter().filter(|n| n.0 != measure.0) {
            assert!(
                !overlaps(measure, other),
                "{} overlapped {}",
                measure.0,
                other.0
            );
        }
    }
}

/// Two runs on one cache (two terminals, two batch jobs on one node) queue for the machine:
/// neither's measurement overlaps any node the other computes.
#[test]
fn concurrent_runs_on_one_cache_never_measure_at_the_same_time() {
    let sandbox = Sandbox::new();
    for (name, values) in [("a.yaml", "[1, 2, 3]"), ("b.yaml", "[4, 5, 6]")] {
        sandbox.write(
            name,
            &format!("stages:\n  measure:\n    uses: testkit/measure\n    with: {{sleep_ms: 250}}\n    matrix: {{value: {values}}}\n  work:\n    uses: testkit/echo-worker\n    with: {{sleep_ms: 250}}\n    matrix: {{value: {values}}}\n"),
        );
    }
    let start = |name: &str| {
        sandbox
            .command(&["run", name, "-j", "2", "-q"])
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("attnbench starts")
    };
    let (a, b) = (start("a.yaml"), start("b.yaml"));
    for child in [a, b] {
        let output = child.wait_with_output().unwrap();
        assert!(output.status.success(), "{}", stderr(&output));
    }
    let mut all = Vec::new();
    for run in std::fs::read_dir(sandbox.cache().join("runs")).unwrap() {
        let run = run.unwrap().path();
        let Ok(text) = std::fs::read_to_string(run.join("run.json")) else {
            continue;
        };
        let record: serde_json::Value = serde_json::from_str(&text).unwrap();
        for node in record["nodes"].as_array().unwrap() {
            let echo: serde_json::Value = serde_json::from_str(
                &std::fs::read_to_string(format!(
                    "{}/echo.json",
                    node["artifact"].as_str().unwrap()
                ))
                .unwrap(),
            )
            .unwrap();
            let time = |key: &str| echo[key].as_u64().unwrap();
            let id = format!("{}:{}", record["file"], node["id"].as_str().unwrap());
            all.push((id, time("started_us"), time("finished_us")));
        }
    }
    assert_eq!(all.len(), 12, "{all:?}");
    let overlaps = |a: &(String, u64, u64), b: &(String, u64, u64)| a.1 < b.2 && b.1 < a.2;
    for measure in all.iter().filter(|n| n.0.contains("measure")) {
        for other in all.iter().filter(|n| n.0 != measure.0) {
            assert!(
                !overlaps(measure, other),
                "{} overlapped {}",
                measure.0,
                other.0
            );
        }
    }
}

/// Where a test's SIGTERM goes.
#[derive(Clone, Copy, PartialEq)]
enum Target {
    Process,
    /// The whole process group, as `timeout` and batch schedulers do.
    Group,
}

/// Runs `p.yaml` with one job, sends SIGTERM after `after_ms` to each target in turn, and
/// returns how the run ended and how long after the first signal.
fn stop_after(sandbox: &Sandbox, after_ms: u64, targets: &[Target]) -> (std::process::Output, f64) {
    use std::os::unix::process::CommandExt;
    let mut command = sandbox.command(&["run", "p.yaml", "-j", "1", "-q"]);
    if targets.contains(&Target::Group) {
        command.process_group(0);
    }
    let child = command
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("attnbench starts");
    std::thread::sleep(std::time::Duration::from_millis(after_ms));
    let stopped = std::time::Instant::now();
    for target in targets {
        let pid = match target {
            Target::Process => child.id() as i32,
            Target::Group => -(child.id() as i32),
        };
        // SAFETY: signals the child (or the process group) this test just made.
        unsafe { libc::kill(pid, libc::SIGTERM) };
        // Apart enough that the first has been handled when the next arrives.
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
    let output = finish_within(child, 40);
    (output, stopped.elapsed().as_secs_f64())
}

/// The child's output once it ends; a child still running after `seconds` is killed and the
/// test fails, instead of hanging.
fn finish_within(mut child: std::process::Child, seconds: u64) -> std::process::Output {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(seconds);
    while child.try_wait().expect("wait for attnbench").is_none() {
        if std::time::Instant::now() >= deadline {
            let _ = child.kill();
            let output = child.wait_with_output().expect("attnbench ends");
            panic!("attnbench still ran after {seconds}s: {}", stderr(&output));
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    child.wait_with_output().expect("attnbench ends")
}

/// GNU `timeout` signals the process, then its whole group: two SIGTERMs, a moment apart. The
/// second must not kill the run before its record and summary are written.
#[test]
fn a_sigterm_to_the_process_then_its_group_still_stops_cleanly() {
    for _ in 0..3 {
        let sandbox = Sandbox::new();
        sandbox.write(
            "p.yaml",
            "stages:\n  work:\n    uses: testkit/echo-worker\n    with: {sleep_ms: 700}\n    matrix: {value: [1, 2, 3, 4]}\n",
        );
        let (output, _) = stop_after(&sandbox, 900, &[Target::Process, Target::Group]);
        assert_eq!(output.status.code(), Some(1), "{}", stderr(&output));
        let record = sandbox.last_record();
        assert!(record["finished"].is_string(), "the final record: {record}");
        assert!(
            stdout(&output).contains("skipped") || stderr(&output).contains("skipped"),
            "the summary: {}",
            stderr(&output)
        );
    }
}

/// A node running in process that never asks whether it is cancelled does not hold the run past
/// the stop's grace: it is left behind, recorded as interrupted, and the record is written.
#[test]
fn a_blocked_in_process_node_does_not_hold_a_stopped_run() {
    let sandbox = Sandbox::new();
    sandbox.write(
        "p.yaml",
        "stages:\n  work:\n    uses: testkit/hang-in-process\n",
    );
    let (output, waited) = stop_after(&sandbox, 500, &[Target::Process]);
    assert!(
        (9.0..20.0).contains(&waited),
        "ended {waited:.1}s after the stop"
    );
    assert_eq!(output.status.code(), Some(1), "{}", stderr(&output));
    let record = sandbox.last_record();
    assert!(record["finished"].is_string(), "{record}");
    assert_eq!(sandbox.statuses()["work"], "interrupted", "{record}");
}

/// `timeout:` holds for stages that run in process: such a node runs in a worker, which is
/// killed at the limit, and nothing of it is cached.
#[test]
fn a_timeout_holds_for_in_process_stages() {
    let sandbox = Sandbox::new();
    sandbox.write(
        "p.yaml",
        "stages:\n  slow:\n    uses: testkit/echo\n    with: {sleep_ms: 5000}\n    timeout: 1\n  stuck:\n    uses: testkit/hang-in-process\n    timeout: 1\n",
    );
    let started = std::time::Instant::now();
    let child = sandbox
        .command(&["run", "p.yaml", "-q"])
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("attnbench starts");
    let run = finish_within(child, 30);
    assert!(started.elapsed().as_secs_f64() < 4.5, "{}", stderr(&run));
    assert_eq!(run.status.code(), Some(1), "{}", stderr(&run));
    let statuses = sandbox.statuses();
    assert_eq!(
        (statuses["slow"].as_str(), statuses["stuck"].as_str()),
        ("timeout", "timeout")
    );
    let rerun = sandbox.run(&["run", "p.yaml", "-q"]);
    assert_eq!(sandbox.statuses()["slow"], "timeout", "{}", stderr(&rerun));
}

/// `timeout` and batch schedulers signal the whole process group, workers included: the node
/// running in a worker still finishes instead of being recorded as crashed.
#[test]
fn sigterm_to_the_process_group_spares_running_worker_nodes() {
    let sandbox = Sandbox::new();
    sandbox.write(
        "p.yaml",
        "stages:\n  work:\n    uses: testkit/echo-worker\n    with: {sleep_ms: 700}\n    matrix: {value: [1, 2, 3, 4]}\n",
    );
    let (output, _) = stop_after(&sandbox, 1000, &[Target::Group]);
    assert_eq!(output.status.code(), Some(1), "{}", stderr(&output));
    let statuses = sandbox.statuses();
    assert!(
        statuses.values().all(|s| s == "ok" || s == "skipped"),
        "{statuses:?}"
    );
    assert!(statuses.values().any(|s| s == "ok"), "{statuses:?}");
}

#[test]
fn sigterm_lets_running_nodes_finish_and_writes_the_record() {
    let sandbox = Sandbox::new();
    sandbox.write(
        "p.yaml",
        "stages:\n  work:\n    uses: testkit/echo-worker\n    with: {sleep_ms: 700}\n    matrix: {value: [1, 2, 3, 4, 5, 6]}\n",
    );
    let (output, _) = stop_after(&sandbox, 1200, &[Target::Process]);
    assert_eq!(output.status.code(), Some(1), "{}", stderr(&output));
    let statuses = sandbox.statuses();
    let ok = statuses.values().filter(|s| *s == "ok").count();
    let skipped = statuses.values().filter(|s| *s == "skipped").count();
    assert!(ok >= 1 && skipped >= 1 && ok + skipped == 6, "{statuses:?}");
    // What finished is cached: the next run only computes the rest.
    let rerun = sandbox.run(&["run", "p.yaml", "-q"]);
    assert!(rerun.status.success(), "{}", stderr(&rerun));
    let cached = sandbox
        .statuses()
        .values()
        .filter(|s| *s == "cached")
        .count();
    assert_eq!(cached, ok, "{:?}", sandbox.statuses());
}

/// A node that would run on past a stop is ended after the grace period, so the run record is
/// written before the scheduler's SIGKILL follows its SIGTERM.
#[test]
fn a_node_that_outlasts_the_stop_grace_is_interrupted_and_the_record_written() {
    let sandbox = Sandbox::new();
    sandbox.write(
        "p.yaml",
        "stages:\n  work:\n    uses: testkit/echo-worker\n    with: {sleep_ms: 60000}\n    matrix: {value: [1, 2]}\n",
    );
    let (output, waited) = stop_after(&sandbox, 1000, &[Target::Process]);
    assert!(
        (9.0..30.0).contains(&waited),
        "ended {waited:.1}s after the stop"
    );
    assert_eq!(output.status.code(), Some(1), "{}", stderr(&output));
    let record = sandbox.last_record();
    let nodes = record["nodes"].as_array().unwrap();
    let status = |s: &str| nodes.iter().filter(|n| n["status"] == s).count();
    assert_eq!(
        (status("interrupted"), status("skipped")),
        (1, 1),
        "{record}"
    );
    let interrupted = nodes.iter().find(|n| n["status"] == "interrupted").unwrap();
    assert!(
        interrupted["error"]
            .as_str()
            .unwrap_or_default()
            .contains("was stopped"),
        "{interrupted}"
    );
}

/// A node that reports progress all the time still has a time limit.
#[test]
fn a_busy_node_still_times_out() {
    let sandbox = Sandbox::new();
    sandbox.write(
        "p.yaml",
        "stages:\n  work:\n    uses: testkit/echo-worker\n    with: {sleep_ms: 60000}\n    timeout: 1\n",
    );
    let started = std::time::Instant::now();
    let run = sandbox.run(&["run", "p.yaml", "-q"]);
    assert!(started.elapsed().as_secs() < 20, "{}", stderr(&run));
    assert_eq!(sandbox.statuses()["work"], "timeout", "{}", stderr(&run));
}

/// `--time-budget` ends a run as a stop would: no node starts after it, the record is written,
/// what finished is cached for the next run.
#[test]
fn a_time_budget_ends_the_run_cleanly_and_the_next_run_resumes() {
    let sandbox = Sandbox::new();
    sandbox.write(
        "p.yaml",
        "stages:\n  work:\n    uses: testkit/echo-worker\n    with: {sleep_ms: 700}\n    matrix: {value: [1, 2, 3, 4, 5, 6]}\n",
    );
    let started = std::time::Instant::now();
    let run = sandbox.run(&["run", "p.yaml", "-j", "1", "-q", "--time-budget", "1s"]);
    assert!(started.elapsed().as_secs_f64() < 5.0, "{}", stderr(&run));
    assert_eq!(run.status.code(), Some(1), "{}", stderr(&run));
    let record = sandbox.last_record();
    let nodes = record["nodes"].as_array().unwrap();
    let ok = nodes.iter().filter(|n| n["status"] == "ok").count();
    let skipped: Vec<_> = nodes.iter().filter(|n| n["status"] == "skipped").collect();
    assert!(
        ok >= 1 && !skipped.is_empty() && ok + skipped.len() == 6,
        "{record}"
    );
    for node in &skipped {
        assert_eq!(node["error"], "the run's time budget ran out", "{node}");
    }
    let rerun = sandbox.run(&["run", "p.yaml", "-q"]);
    assert!(rerun.status.success(), "{}", stderr(&rerun));
    let cached = sandbox
        .statuses()
        .values()
        .filter(|s| *s == "cached")
        .count();
    assert_eq!(cached, ok, "{:?}", sandbox.statuses());
}
