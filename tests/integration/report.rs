//! The HTML report in a real browser: every plot renders and the console stays clean.

use std::path::PathBuf;
use std::process::Command;

use attnbench_tests::{stderr, stdout, target_dir, Sandbox};

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

/// `attnbench report` merges the measurements of several runs (here two halves of a sweep and a
/// rerun of one cell) into one report: every cell once, from its newest record.
#[test]
fn report_merges_runs_and_keeps_the_newest_record_of_a_cell() {
    let sandbox = Sandbox::new();
    sandbox.write("short.json", r#"{"[16,64)": 1, "[64,200)": 1}"#);
    sandbox.write("p.yaml", PIPELINE);
    let table = ["--set", "stages.report.uses=report/table"];
    let first = sandbox.run(
        &[
            &[
                "run",
                "p.yaml",
                "-q",
                "--set",
                "stages.masks.matrix.seqlen=[256]",
            ][..],
            &table[..],
        ]
        .concat(),
    );
    assert!(first.status.success(), "{}", stderr(&first));
    let first_run = sandbox.cache().join("runs").join(
        sandbox.last_record()["id"]
            .as_str()
            .expect("the record has an id"),
    );
    let second = sandbox.run(
        &[
            &[
                "run",
                "p.yaml",
                "-q",
                "--set",
                "stages.masks.matrix.seqlen=[512]",
            ][..],
            &table[..],
        ]
        .concat(),
    );
    assert!(second.status.success(), "{}", stderr(&second));
    let measured = |record: &serde_json::Value| {
        attnbench_tests::statuses(record)
            .keys()
            .filter(|id| id.starts_with("bench"))
            .count()
    };
    let first_count = measured(
        &serde_json::from_slice(&std::fs::read(first_run.join("run.json")).unwrap()).unwrap(),
    );
    let second_count = measured(&sandbox.last_record());
    // Measure one cell of the first half again: the report must show it once.
    let rerun = sandbox.run(
        &[
            &[
                "run",
                "p.yaml",
                "-q",
                "--set",
                "stages.masks.matrix.seqlen=[256]",
                "--force",
                "bench[mask=causal,seqlen=256,kernel=tiled,direction=fwd]",
            ][..],
            &table[..],
        ]
        .concat(),
    );
    assert!(rerun.status.success(), "{}", stderr(&rerun));

    let out = sandbox.path().join("merged");
    let cache = sandbox.cache();
    let report = sandbox.run(&[
        "report",
        "--table",
        "--title",
        "two halves",
        "--out",
        out.to_str().unwrap(),
        first_run.to_str().unwrap(),
        cache.to_str().unwrap(),
    ]);
    assert!(report.status.success(), "{}", stderr(&report));
    let csv = std::fs::read_to_string(out.join("results.csv")).unwrap();
    let rows = csv.lines().count() - 1;
    assert_eq!(rows, first_count + second_count, "{csv}");
    assert!(std::fs::read_to_string(out.join("summary.md"))
        .unwrap()
        .contains("two halves"));

    // A second report into the same folder, and a folder without measurements, are refused.
    let again = sandbox.run(&[
        "report",
        "--out",
        out.to_str().unwrap(),
        cache.to_str().unwrap(),
    ]);
    assert!(!again.status.success());
    assert!(stderr(&again).contains("not empty"), "{}", stderr(&again));
    let empty = sandbox.path().join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    let nothing = sandbox.run(&[
        "report",
        "--out",
        sandbox.path().join("other").to_str().unwrap(),
        empty.to_str().unwrap(),
    ]);
    assert!(!nothing.status.success());
    assert!(
        stderr(&nothing).contains("no measurement records"),
        "{}",
        stderr(&nothing)
    );
}

/// Records carried between caches keep their age: an older run imported after a newer one does
/// not take the newer one's place in a merged report (the copies get new file times; their cache
/// entries keep the time they were made).
#[test]
fn an_imported_older_record_does_not_replace_a_newer_one() {
    let run = |sandbox: &Sandbox, min_reps: &str| {
        sandbox.write("short.json", r#"{"[16,64)": 1, "[64,200)": 1}"#);
        sandbox.write("p.yaml", PIPELINE);
        let output = sandbox.run(&[
            "run",
            "p.yaml",
            "-q",
            "--set",
            "stages.report.uses=report/table",
            "--set",
            "stages.masks.matrix.seqlen=[256]",
            "--set",
            "stages.bench.matrix.kernel=[tiled]",
            "--set",
            &format!("stages.bench.with.min_reps={min_reps}"),
            "--set",
            "stages.bench.with.max_time_s=0.000001",
        ]);
        assert!(output.status.success(), "{}", stderr(&output));
    };
    let older = Sandbox::new();
    run(&older, "2");
    std::thread::sleep(std::time::Duration::from_millis(1100));
    let newer = Sandbox::new();
    run(&newer, "3");
    let carried = older.path().join("carried");
    let export = older.run(&["cache", "export", carried.to_str().unwrap()]);
    assert!(export.status.success(), "{}", stderr(&export));
    let import = newer.run(&["cache", "import", carried.to_str().unwrap()]);
    assert!(import.status.success(), "{}", stderr(&import));

    let out = newer.path().join("merged");
    let cache = newer.cache();
    let report = newer.run(&[
        "report",
        "--table",
        "--out",
        out.to_str().unwrap(),
        cache.to_str().unwrap(),
    ]);
    assert!(report.status.success(), "{}", stderr(&report));
    let rows: Vec<serde_json::Value> =
        serde_json::from_slice(&std::fs::read(out.join("results.json")).unwrap()).unwrap();
    assert_eq!(rows.len(), 4, "one row per cell");
    for row in &rows {
        assert_eq!(row["time_s"]["n"], 3, "the newer run's record: {row}");
    }
}

/// `attnbench compare`: records against themselves are the same everywhere; against copies with
/// one cell 50% slower and one cell failing its check, it says so, writes the verdicts as JSON,
/// and with `--fail-if-slower` exits with status 1. (The records are a real run's, with their
/// timing samples replaced by tight ones, so that the verdicts do not depend on this machine's
/// noise.)
#[test]
fn compare_finds_the_slower_cell_and_the_broken_one() {
    let sandbox = Sandbox::new();
    sandbox.write("short.json", r#"{"[16,64)": 1, "[64,200)": 1}"#);
    sandbox.write("p.yaml", PIPELINE);
    let run = sandbox.run(&[
        "run",
        "p.yaml",
        "-q",
        "--set",
        "stages.report.uses=report/table",
        "--set",
        "stages.masks.matrix.seqlen=[256]",
        "--set",
        "stages.masks.matrix.mask=[causal]",
    ]);
    assert!(run.status.success(), "{}", stderr(&run));
    let cells = attnbench_tests::measurements(&sandbox.last_record(), "bench");
    assert_eq!(cells.len(), 4);
    let write = |side: &str, edit: &dyn Fn(&str, &mut serde_json::Value)| {
        let root = sandbox.path().join(side);
        for (index, (id, measurement)) in cells.iter().enumerate() {
            let mut measurement = measurement.clone();
            let median = measurement["time_s"]["p50"].as_f64().unwrap();
            measurement["timing"]["samples"] =
                (0..10).map(|i| median * (1.0 + 0.001 * i as f64)).collect();
            edit(id, &mut measurement);
            let dir = root.join(index.to_string());
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(
                dir.join("measurement.json"),
                serde_json::to_vec(&measurement).unwrap(),
            )
            .unwrap();
        }
        root.to_str().unwrap().to_string()
    };
    let base = write("base", &|_, _| {});
    let new = write("new", &|id, m| {
        if id == "bench[mask=causal,seqlen=256,kernel=naive,direction=fwd]" {
            for sample in m["timing"]["samples"].as_array_mut().unwrap() {
                *sample = serde_json::json!(sample.as_f64().unwrap() * 1.5);
            }
        }
        if id == "bench[mask=causal,seqlen=256,kernel=tiled,direction=bwd]" {
            m["correctness"]["passed"] = serde_json::json!(false);
        }
    });

    let same = sandbox.run(&["compare", &base, &base, "--fail-if-slower"]);
    let text = stdout(&same);
    assert!(same.status.success(), "{text}{}", stderr(&same));
    assert!(
        text.contains("4 cells compared (threshold ±2.0%): 0 faster, 0 slower, 4 same"),
        "{text}"
    );

    let json = sandbox.path().join("verdicts.json");
    let compared = sandbox.run(&[
        "compare",
        &base,
        &new,
        "--fail-if-slower",
        "--json",
        json.to_str().unwrap(),
    ]);
    let text = stdout(&compared);
    assert_eq!(
        compared.status.code(),
        Some(1),
        "{text}{}",
        stderr(&compared)
    );
    let line = |needle: &str| {
        text.lines()
            .find(|l| l.contains(needle))
            .unwrap_or_else(|| panic!("no line with {needle}: {text}"))
            .to_string()
    };
    let slower = line("cpu-naive causal 256 fwd");
    assert!(
        slower.ends_with("slower") && slower.contains("+50.0%"),
        "{text}"
    );
    assert!(
        line("cpu-tiled causal 256 bwd").contains("ok → ok (check failed)"),
        "{text}"
    );
    assert!(
        text.contains("0 faster, 1 slower, 2 same, 0 unsure; 1 changed status"),
        "{text}"
    );
    let verdicts: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    assert_eq!(verdicts.as_array().unwrap().len(), 4);

    // One kernel against another in the same records: tiled against naive, cell by cell.
    let kernels = sandbox.run(&["compare", &base, &base, "--kernels", "cpu-naive:cpu-tiled"]);
    let text = stdout(&kernels);
    assert!(kernels.status.success(), "{text}{}", stderr(&kernels));
    assert!(
        text.contains("cpu-naive→cpu-tiled causal 256 fwd"),
        "{text}"
    );
    assert!(text.contains("2 cells compared"), "{text}");
    let unknown = sandbox.run(&["compare", &base, &base, "--kernels", "cpu-naive:nothing"]);
    assert!(
        stderr(&unknown).contains("no measurements of kernel `nothing`"),
        "{}",
        stderr(&unknown)
    );
}
