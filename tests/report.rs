//! The HTML report in a real browser: every plot renders and the console stays clean.

use std::path::PathBuf;
use std::process::Command;

use attnbench_tests::{stderr, target_dir, Sandbox};

const PIPELINE: &str = r#"
name: report-check
seed: 7
defaults: {heads_q: 2, heads_kv: 1, head_dim: 32}
stages:
  masks:
    uses: masks/generate
    matrix: {mask: [causal, causal_document], seqlen: [256, 512]}
    with: {distribution: short.json}
  bench:
    uses: cpu/benchmark
    needs: [masks]
    matrix: {kernel: [tiled, naive], direction: [fwd, bwd]}
    with: {min_reps: 2, max_time_s: 0.05, max_scores_bytes: 1M}
  report:
    uses: report/html
    needs: {bench: all}
"#;

fn report_path(stderr_text: &str) -> PathBuf {
    let line = stderr_text
        .lines()
        .find_map(|l| l.strip_prefix("report: "))
        .expect("the run prints where the report is");
    PathBuf::from(line.trim())
}

fn chromium() -> Command {
    let mut command = Command::new("chromium");
    command.args([
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--enable-logging=stderr",
        "--v=0",
    ]);
    command
}

#[test]
fn the_report_renders_every_plot_in_chromium_without_console_errors() {
    let sandbox = Sandbox::new();
    sandbox.write("short.json", r#"{"[16,64)": 1, "[64,200)": 1}"#);
    sandbox.write("p.yaml", PIPELINE);
    let output = sandbox.run(&["run", "p.yaml"]);
    assert!(output.status.success(), "{}", stderr(&output));
    let report = sandbox.path().join(report_path(&stderr(&output)));
    let html = std::fs::read_to_string(&report).unwrap();
    for fetch in ["src=\"http", "href=\"http", "url(http", "@import"] {
        assert!(
            !html.contains(fetch),
            "the report fetches nothing, but has {fetch}"
        );
    }
    // The naive kernel refuses 512 tokens (1 MiB of scores at most): the support matrix says so.
    assert!(
        html.contains("unsupported"),
        "the support matrix shows the naive kernel's refusals"
    );
    for file in [
        "results.csv",
        "results.json",
        "summary.md",
        "plots/tflops-causal---fwd.png",
        "plots/memory-bwd.png",
    ] {
        assert!(
            report.with_file_name(file).is_file(),
            "{file} is written beside the report"
        );
    }

    let profile = tempfile::tempdir().unwrap();
    let dom = chromium()
        .arg(format!("--user-data-dir={}", profile.path().display()))
        .arg("--dump-dom")
        .arg(format!("file://{}", report.display()))
        .output()
        .unwrap_or_else(|err| {
            panic!("headless Chromium is needed for this test (apt-get install chromium): {err}")
        });
    let dom_text = String::from_utf8_lossy(&dom.stdout);
    let body = dom_text
        .split("<body")
        .nth(1)
        .and_then(|b| b.split('>').next())
        .expect("a body element");
    let attribute = |name: &str| -> usize {
        body.split(&format!("{name}=\""))
            .nth(1)
            .and_then(|r| r.split('"').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or(0)
    };
    let (plots, rendered) = (attribute("data-plots"), attribute("data-rendered-plots"));
    assert_eq!(
        plots, 6,
        "4 throughput plots (2 masks × 2 directions) and 2 memory plots: {body}"
    );
    assert_eq!(rendered, plots, "every plot has a drawn area: {body}");
    let console: Vec<String> = String::from_utf8_lossy(&dom.stderr)
        .lines()
        .filter(|l| l.contains(":CONSOLE"))
        .map(String::from)
        .collect();
    assert!(console.is_empty(), "the console is clean: {console:?}");

    // A screenshot for people, kept next to the build.
    let screenshot = target_dir().join("report-screenshot.png");
    let shot = chromium()
        .arg(format!("--user-data-dir={}", profile.path().display()))
        .arg("--window-size=1400,2400")
        .arg(format!("--screenshot={}", screenshot.display()))
        .arg(format!("file://{}", report.display()))
        .output()
        .unwrap();
    assert!(
        shot.status.success() && screenshot.is_file(),
        "{}",
        String::from_utf8_lossy(&shot.stderr)
    );
}
