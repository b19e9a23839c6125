//! `--executor slurm` on a real single-node Slurm that the test starts and stops: the same
//! measurements and cache keys as a local run, a job cancelled mid-run recorded and resumed, and
//! CP ranks started by `srun`. One test, one cluster: the scenarios run in turn on it.

use attnbench_tests::slurm::SlurmCluster;
use attnbench_tests::{measurements, node, stderr, workspace_root, Sandbox};
use serde_json::Value;
use std::time::{Duration, Instant};

#[test]
fn slurm_runs_nodes_as_jobs_records_a_cancelled_one_and_starts_cp_ranks_with_srun() {
    let cluster = SlurmCluster::start();
    same_results_and_keys_as_a_local_run(&cluster);
    a_cancelled_job_is_recorded_and_the_rerun_completes(&cluster);
    cp_ranks_start_under_srun(&cluster);
    refusals_are_recorded_in_one_sentence(&cluster);
    a_stopped_run_cancels_its_jobs(&cluster);
}

/// SIGTERM to the coordinator cancels its jobs; the record says the run was stopped.
fn a_stopped_run_cancels_its_jobs(cluster: &SlurmCluster) {
    let sandbox = Sandbox::new();
    let pipeline = sandbox.write("stopped.yaml", SLOW);
    let mut run = cluster
        .attnbench(
            &sandbox,
            &[
                "run",
                pipeline.to_str().unwrap(),
                "-q",
                "--executor",
                "slurm",
            ],
        )
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    running_job(cluster, "attnbench-slow");
    let term = std::process::Command::new("kill")
        .args(["-TERM", &run.id().to_string()])
        .output()
        .unwrap();
    assert!(term.status.success());
    assert!(!run.wait().unwrap().success());
    let slow = node(&sandbox.last_record(), "slow").clone();
    assert_eq!(slow["status"], "interrupted", "{slow}");
    let error = slow["error"].as_str().unwrap();
    assert!(
        error.contains("the run was stopped and Slurm job"),
        "{error}"
    );
    for state in ["RUNNING", "PENDING"] {
        assert!(
            cluster.jobs("attnbench-slow", state).is_empty(),
            "no job left {state}"
        );
    }
}

/// The id of a running job named `name`, once there is one.
fn running_job(cluster: &SlurmCluster, name: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Some(job) = cluster.jobs(name, "RUNNING").pop() {
            return job;
        }
        assert!(Instant::now() < deadline, "no job {name} ever ran");
        std::thread::sleep(Duration::from_millis(100));
    }
}

const REFUSED: &str = r#"
name: refused
executor: {kind: slurm, partition: nowhere}
stages:
  quick:
    uses: testkit/echo-worker
    matrix: {value: [1, 2]}
  here: {uses: testkit/echo}
"#;

const ON_A_GPU: &str = r#"
name: on-a-gpu
executor: slurm
stages:
  masks:
    uses: masks/generate
    matrix: {mask: [causal], seqlen: [64]}
  torch:
    uses: python/benchmark
    needs: [masks]
    with: {kernel: sdpa-math, device: cuda}
"#;

/// The folder of wave `wave` of the run `record` describes.
fn wave_dir(record: &Value, wave: &str) -> std::path::PathBuf {
    let log = record["nodes"][0]["log"].as_str().expect("a node log");
    std::path::Path::new(log)
        .parent()
        .and_then(|logs| logs.parent())
        .expect("the run's folder")
        .join("slurm")
        .join(wave)
}

const NEVER_STARTS: &str = r#"
name: never-starts
executor: {kind: slurm, extra: [--begin=now+1hour], start_within: 3s, poll: 500ms}
stages:
  later: {uses: testkit/echo-worker}
"#;

/// A refused submission and a job that never starts leave their nodes skipped with the reason;
/// what could run, ran.
fn refusals_are_recorded_in_one_sentence(cluster: &SlurmCluster) {
    let sandbox = Sandbox::new();
    let path = sandbox.write("refused.yaml", REFUSED);
    let run = cluster.run(&sandbox, &["run", path.to_str().unwrap(), "-q"]);
    assert!(!run.status.success());
    let record = sandbox.last_record();
    assert_eq!(node(&record, "here")["status"], "ok");
    let quick = node(&record, "quick[value=1]");
    assert_eq!(quick["status"], "skipped", "{quick}");
    let error = quick["error"].as_str().unwrap();
    assert!(
        error.starts_with("sbatch refused the job:") && error.contains("partition"),
        "{error}"
    );

    // The same partition from the user's config file, under a pipeline that names no executor.
    let config = sandbox.write(
        "config.yaml",
        "executor: {kind: slurm, partition: nowhere, account: lab}\n",
    );
    let plain = sandbox.write(
        "plain.yaml",
        &REFUSED.replace("executor: {kind: slurm, partition: nowhere}\n", ""),
    );
    let run = cluster
        .attnbench(&sandbox, &["run", plain.to_str().unwrap(), "-q"])
        .env("ATTNBENCH_CONFIG", &config)
        .output()
        .unwrap();
    assert!(!run.status.success());
    let record = sandbox.last_record();
    assert_eq!(record["executor"], "slurm");
    let error = node(&record, "quick[value=1]")["error"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(
        error.starts_with("sbatch refused the job:") && error.contains("partition"),
        "the config file's partition reached sbatch: {error}"
    );

    // A stage that runs on a GPU for `device: cuda` asks for one, which this cluster has not.
    let path = sandbox.write("gpu.yaml", ON_A_GPU);
    let run = cluster.run(&sandbox, &["run", path.to_str().unwrap(), "-q"]);
    assert!(!run.status.success());
    let record = sandbox.last_record();
    let gpu = node(&record, "torch[mask=causal,seqlen=64]");
    assert_eq!(gpu["status"], "skipped", "{gpu}");
    let args = std::fs::read_to_string(wave_dir(&record, "wave-0").join("sbatch.args")).unwrap();
    assert!(args.lines().any(|a| a == "--gpus-per-node=1"), "{args}");

    let path = sandbox.write("never-starts.yaml", NEVER_STARTS);
    let run = cluster.run(&sandbox, &["run", path.to_str().unwrap(), "-q"]);
    assert!(!run.status.success());
    let later = node(&sandbox.last_record(), "later").clone();
    assert_eq!(later["status"], "skipped", "{later}");
    let error = later["error"].as_str().unwrap();
    assert!(
        error.contains("still pending after 3s") && error.contains("cancelled"),
        "{error}"
    );
    assert!(
        cluster.jobs("attnbench-later", "PENDING").is_empty(),
        "the job was cancelled"
    );
}

#[test]
fn without_slurm_the_run_says_so_before_anything_runs() {
    let sandbox = Sandbox::new();
    let path = sandbox.write("refused.yaml", REFUSED);
    let empty = sandbox.path().join("empty-path");
    std::fs::create_dir_all(&empty).unwrap();
    let run = sandbox
        .command(&["run", path.to_str().unwrap(), "-q"])
        .env("PATH", &empty)
        .output()
        .unwrap();
    assert!(!run.status.success());
    let said = stderr(&run);
    assert!(
        said.contains("--executor slurm: sbatch, scontrol, scancel, srun not found on PATH"),
        "{said}"
    );
    let runs = sandbox.cache().join("runs");
    let started = std::fs::read_dir(&runs).map(|d| d.count()).unwrap_or(0);
    assert_eq!(
        started,
        0,
        "no run record was started in {}",
        runs.display()
    );
}

#[test]
fn a_pipeline_names_a_bad_executor_in_one_line() {
    let sandbox = Sandbox::new();
    let path = sandbox.write(
        "bad.yaml",
        "name: bad\nexecutor: k8s\nstages:\n  here: {uses: testkit/echo}\n",
    );
    let run = sandbox.run(&["run", path.to_str().unwrap()]);
    assert!(!run.status.success());
    let said = stderr(&run);
    assert!(
        said.contains("`executor`: `k8s` is not an executor; expected `local` or `slurm`"),
        "{said}"
    );
}

fn same_results_and_keys_as_a_local_run(cluster: &SlurmCluster) {
    let pipeline = workspace_root().join("pipelines/quickstart.yaml");
    let args = [
        "run",
        pipeline.to_str().unwrap(),
        "-q",
        "--set",
        "stages.masks.matrix.mask=[causal, causal_document]",
        "--set",
        "stages.masks.matrix.seqlen=[1k]",
    ];
    let local = Sandbox::new();
    let run = local.run(&args);
    assert!(run.status.success(), "{}", stderr(&run));
    let slurm = Sandbox::new();
    let run = cluster.run(&slurm, &[&args[..], &["--executor", "slurm"]].concat());
    assert!(run.status.success(), "{}", stderr(&run));
    let (local, slurm) = (local.last_record(), slurm.last_record());
    assert_eq!(slurm["executor"], "slurm");
    let nodes = |record: &Value| record["nodes"].as_array().unwrap().clone();
    let mut jobs = 0;
    for (here, there) in nodes(&local).iter().zip(nodes(&slurm).iter()) {
        assert_eq!(here["id"], there["id"]);
        // The report reads the measured times, which differ between any two runs.
        if here["stage"] != "report" {
            assert_eq!(here["key"], there["key"], "{}", here["id"]);
        }
        assert_eq!(there["status"], "ok", "{there}");
        if there["stage"] == "bench" {
            let job = there["slurm"]["job"].as_str().unwrap_or_default();
            assert!(
                job.contains('_'),
                "a bench node ran as an array task: {there}"
            );
            let log = std::fs::read_to_string(there["log"].as_str().unwrap()).unwrap();
            assert!(!log.is_empty(), "{}: the task wrote its log", there["id"]);
            jobs += 1;
        } else {
            assert!(
                there.get("slurm").is_none(),
                "in-process nodes run here: {there}"
            );
        }
    }
    assert_eq!(jobs, 8);
    let correct = |record: &Value| -> Vec<(String, Value)> {
        measurements(record, "bench[")
            .into_iter()
            .map(|(id, m)| (id, m["correctness"]["passed"].clone()))
            .collect()
    };
    assert_eq!(correct(&local), correct(&slurm));
    assert!(correct(&slurm).iter().all(|(_, passed)| passed == true));
}

const SLOW: &str = r#"
name: cancelled
stages:
  quick:
    uses: testkit/echo-worker
    matrix: {value: [1, 2]}
  slow:
    uses: testkit/echo-worker
    with: {sleep_ms: 8000}
"#;

fn a_cancelled_job_is_recorded_and_the_rerun_completes(cluster: &SlurmCluster) {
    let sandbox = Sandbox::new();
    let pipeline = sandbox.write("cancelled.yaml", SLOW);
    let path = pipeline.to_str().unwrap();
    let mut run = cluster
        .attnbench(&sandbox, &["run", path, "-q", "--executor", "slurm"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let job = running_job(cluster, "attnbench-slow");
    let cancel = cluster.command("scancel").arg(&job).output().unwrap();
    assert!(cancel.status.success());
    let status = run.wait().unwrap();
    assert!(!status.success(), "a run with an interrupted node fails");
    let record = sandbox.last_record();
    let slow = node(&record, "slow");
    assert_eq!(slow["status"], "interrupted", "{slow}");
    let error = slow["error"].as_str().unwrap();
    assert!(error.contains("was cancelled (scancel)"), "{error}");
    assert_eq!(slow["slurm"]["state"], "Cancelled", "{slow}");
    for quick in ["quick[value=1]", "quick[value=2]"] {
        assert_eq!(node(&record, quick)["status"], "ok");
    }
    let rerun = cluster.run(&sandbox, &["run", path, "-q", "--executor", "slurm"]);
    assert!(rerun.status.success(), "{}", stderr(&rerun));
    let statuses = sandbox.statuses();
    assert_eq!(statuses["slow"], "ok");
    assert_eq!(statuses["quick[value=1]"], "cached");
    assert_eq!(statuses["quick[value=2]"], "cached");
}

fn cp_ranks_start_under_srun(cluster: &SlurmCluster) {
    let sandbox = Sandbox::new();
    let pipeline = workspace_root().join("pipelines/context-parallel-cpu.yaml");
    let run = cluster.run(
        &sandbox,
        &[
            "run",
            pipeline.to_str().unwrap(),
            "-q",
            "--executor",
            "slurm",
            "--set",
            "stages.masks.matrix.mask=[causal]",
            "--set",
            "stages.masks.matrix.seqlen=[96]",
            "--set",
            "stages.cp.matrix.method=[ring_p2p]",
            "--set",
            "stages.cp.matrix.world=[2]",
            "--set",
            "stages.cp.matrix.direction=[bwd]",
            "--set",
            "stages.cp.matrix.sharding=[balanced]",
            "--set",
            "stages.cp.with.backend=processes",
            "--set",
            "stages.cp.with.min_reps=1",
            "--set",
            "stages.cp.with.warmup_reps=0",
        ],
    );
    assert!(run.status.success(), "{}", stderr(&run));
    let record = sandbox.last_record();
    let cells = measurements(&record, "cp[");
    assert_eq!(cells.len(), 1);
    let (id, m) = &cells[0];
    assert_eq!(
        m["correctness"]["passed"], true,
        "{id}: {}",
        m["correctness"]
    );
    let cp = &m["cp"];
    assert_eq!(cp["launcher"], "srun", "{id}: {cp}");
    assert_eq!(cp["world"], 2, "{id}: {cp}");
    assert_eq!(cp["sharding"], "balanced(8)", "{id}: {cp}");
}
