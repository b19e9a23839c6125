//! Speed of the orchestrator itself, on the release binary and the real testkit plugin:
//!
//! - `plan` of a 100,000-node matrix pipeline (target: under 1 s);
//! - a fully cached rerun of 10,000 in-process nodes (target: under 2 s);
//! - the overhead of dispatching one node to a warm worker (target: under 5 ms), measured as the
//!   difference per node between the same pipeline run in workers and in process.
//!
//! Run with `cargo build --release --workspace && cargo bench --bench orchestrator`.

use std::time::{Duration, Instant};

use attnbench_tests::{stderr, Sandbox};

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
}
