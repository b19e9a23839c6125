//! Speed of the orchestrator itself, on the release binary and the real testkit plugin:
//!
//! - `plan` of a 100,000-node matrix pipeline of the testkit's one-parameter stage (target: under
//!   1 s);
//! - `plan` of 100,000 nodes of the real `masks/generate` stage, 5 masks × 20,000 lengths, with
//!   its two dozen parameters per node (targets: under 1 s and under 200 MB peak RSS);
//! - a fully cached rerun of 10,000 in-process nodes (target: under 2 s);
//! - the overhead of dispatching one node to a warm worker (target: under 5 ms), measured as the
//!   difference per node between the same pipeline run in workers and in process.
//!
//! Run with `cargo build --release --workspace && cargo bench --bench orchestrator`.

use std::time::{Duration, Instant};

use attnbench_tests::{stderr, Sandbox};

/// 5 masks × `lengths` sequence lengths of `masks/generate`.
fn masks_pipeline(lengths: usize) -> String {
    let seqlens: Vec<String> = (0..lengths).map(|n| (1024 + n).to_string()).collect();
    format!(
        "name: bench-masks\nstages:\n  masks:\n    uses: masks/generate\n    matrix:\n      mask: [full, causal, causal_document, share_question, sliding_window_causal]\n      seqlen: [{}]\n    with: {{distribution: short.json}}\n",
        seqlens.join(", ")
    )
}

/// Wall-clock time and peak RSS (bytes) of `attnbench ARGS`, which must succeed. The child is
/// reaped with `wait4` so that its own resource usage, not the bench's, is read.
fn measured(sandbox: &Sandbox, args: &[&str]) -> (Duration, u64) {
    let mut command = sandbox.command(args);
    command
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null());
    let start = Instant::now();
    // Reaped by `wait4` below, which std does not know about.
    #[allow(clippy::zombie_processes)]
    let child = command.spawn().expect("attnbench starts");
    let mut status = 0;
    // SAFETY: an all-zero rusage is a valid value for wait4 to overwrite.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: the pid is our unreaped child; status and usage are valid for writes.
    let reaped = unsafe { libc::wait4(child.id() as libc::pid_t, &mut status, 0, &mut usage) };
    let elapsed = start.elapsed();
    assert_eq!(reaped, child.id() as libc::pid_t, "wait4 reaps attnbench");
    assert!(
        libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
        "attnbench {args:?} failed (status {status}); run it by hand to see why"
    );
    // Linux reports ru_maxrss in KiB.
    (elapsed, usage.ru_maxrss as u64 * 1024)
}

fn matrix_pipeline(stage: &str, sizes: usize, values: usize) -> String {
    let sizes: Vec<String> = (1..=sizes).map(|n| n.to_string()).collect();
    let values: Vec<String> = (1..=values).map(|n| format!("v{n}")).collect();
    format!(
        "name: bench-{stage}\nstages:\n  grid:\n    uses: testkit/{stage}\n    matrix:\n      size: [{}]\n      value: [{}]\n",
        sizes.join(", "),
        values.join(", ")
    )
}

/// Best of `tries` wall-clock times of `attnbench ARGS`, which must succeed.
fn best_of(sandbox: &Sandbox, args: &[&str], tries: usize) -> Duration {
    (0..tries)
        .map(|_| {
            let start = Instant::now();
            let output = sandbox.run(args);
            let elapsed = start.elapsed();
            assert!(
                output.status.success(),
                "attnbench {args:?} failed:\n{}",
                stderr(&output)
            );
            elapsed
        })
        .min()
        .unwrap_or_default()
}

fn main() {
    let mut rows = Vec::new();

    let sandbox = Sandbox::new();
    let pipeline = sandbox.write("plan.yaml", &matrix_pipeline("echo", 100, 1000));
    let pipeline = pipeline.to_str().unwrap_or_default();
    let plan = best_of(&sandbox, &["plan", "--summary", pipeline], 3);
    rows.push((
        "plan, 100,000 nodes",
        plan.as_secs_f64(),
        "< 1 s".to_string(),
    ));

    let sandbox = Sandbox::new();
    sandbox.write(
        "short.json",
        "{\"[32,64)\": 1.0, \"[64,128)\": 1.0, \"[128,256)\": 1.0, \"[256,512)\": 1.0}\n",
    );
    let pipeline = sandbox.write("masks.yaml", &masks_pipeline(20_000));
    let pipeline = pipeline.to_str().unwrap_or_default();
    let runs: Vec<(Duration, u64)> = (0..3)
        .map(|_| measured(&sandbox, &["plan", "--summary", pipeline]))
        .collect();
    let masks_time = runs.iter().map(|r| r.0).min().unwrap_or_default();
    let masks_peak = runs.iter().map(|r| r.1).max().unwrap_or_default();
    rows.push((
        "plan, 100,000 masks/generate nodes",
        masks_time.as_secs_f64(),
        "< 1 s".to_string(),
    ));

    let sandbox = Sandbox::new();
    let pipeline = sandbox.write("cached.yaml", &matrix_pipeline("echo", 100, 100));
    let pipeline = pipeline.to_str().unwrap_or_default();
    let first = best_of(&sandbox, &["run", "-q", pipeline], 1);
    rows.push((
        "first run, 10,000 in-process nodes",
        first.as_secs_f64(),
        "(fills the cache)".to_string(),
    ));
    let cached = best_of(&sandbox, &["run", "-q", pipeline], 3);
    rows.push((
        "fully cached rerun, 10,000 nodes",
        cached.as_secs_f64(),
        "< 2 s".to_string(),
    ));

    let nodes = 500;
    let one_at_a_time = |stage: &str| {
        let sandbox = Sandbox::new();
        let pipeline = sandbox.write("p.yaml", &matrix_pipeline(stage, 1, nodes));
        best_of(
            &sandbox,
            &[
                "run",
                "-q",
                "-j",
                "1",
                pipeline.to_str().unwrap_or_default(),
            ],
            1,
        )
    };
    let (in_process, in_worker) = (one_at_a_time("echo"), one_at_a_time("echo-worker"));
    let per_node_ms = (in_worker.as_secs_f64() - in_process.as_secs_f64()) / nodes as f64 * 1e3;
    rows.push((
        "500 nodes in process, -j 1",
        in_process.as_secs_f64(),
        String::new(),
    ));
    rows.push((
        "500 nodes in one warm worker, -j 1",
        in_worker.as_secs_f64(),
        String::new(),
    ));

    println!("{:<40} {:>10}  target", "measurement", "seconds");
    for (name, seconds, target) in rows {
        println!("{name:<40} {seconds:>10.3}  {target}");
    }
    println!(
        "{:<40} {:>10.3}  < 5 ms (worker minus in-process, per node, incl. worker start)",
        "dispatch overhead per node (ms)", per_node_ms
    );
    let masks_peak_mb = masks_peak as f64 / 1e6;
    println!(
        "{:<40} {:>10.1}  < 200 MB (peak RSS of the 100,000-node masks/generate plan)",
        "plan, masks/generate peak memory (MB)", masks_peak_mb
    );

    // Speed targets are checked here, not in the test suite: a loaded machine would make tests
    // flaky, a bench is run on purpose.
    let mut missed = Vec::new();
    if plan.as_secs_f64() >= 1.0 {
        missed.push(format!("plan of 100,000 testkit nodes took {plan:?}"));
    }
    if masks_time.as_secs_f64() >= 1.0 {
        missed.push(format!(
            "plan of 100,000 masks/generate nodes took {masks_time:?}"
        ));
    }
    if masks_peak_mb >= 200.0 {
        missed.push(format!(
            "plan of 100,000 masks/generate nodes peaked at {masks_peak_mb:.0} MB"
        ));
    }
    assert!(missed.is_empty(), "targets missed: {}", missed.join("; "));
}
