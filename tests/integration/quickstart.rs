//! The README's quickstart pipeline, at test sizes: it runs, a rerun is served from the cache,
//! and changing one matrix value reruns only the nodes it touches.

use std::collections::BTreeMap;

use attnbench_tests::{stderr, workspace_root, Sandbox};

fn counts(statuses: &BTreeMap<String, String>) -> BTreeMap<String, usize> {
    let mut counts = BTreeMap::new();
    for status in statuses.values() {
        *counts.entry(status.clone()).or_insert(0) += 1;
    }
    counts
}

#[test]
fn the_quickstart_runs_caches_and_reruns_only_what_changed() {
    let sandbox = Sandbox::new();
    let pipeline = workspace_root().join("pipelines/quickstart.yaml");
    let pipeline = pipeline.to_str().unwrap();
    let small = [
        "--set",
        "stages.masks.matrix.mask=[causal, causal_document]",
        "--set",
        "stages.bench.with.max_time_s=0.05",
    ];
    let run = |seqlens: &str| {
        let mut args = vec!["run", pipeline, "--set", seqlens];
        args.extend_from_slice(&small);
        let output = sandbox.run(&args);
        assert!(output.status.success(), "{}", stderr(&output));
        let said = stderr(&output);
        assert!(
            said.contains("report: ") && said.contains("reports/quickstart/report.html"),
            "the run says where the report is, at the pipeline's stable path: {said}"
        );
        let page = sandbox
            .path()
            .join("artifacts/reports/quickstart/report.html");
        assert!(page.is_file(), "the latest report is at {}", page.display());
        counts(&sandbox.statuses())
    };
    let first = run("stages.masks.matrix.seqlen=[256, 512]");
    // 2 masks × 2 lengths, × 2 kernels × 2 directions, and the report.
    assert_eq!(first.get("ok"), Some(&(4 + 16 + 1)), "{first:?}");

    let again = run("stages.masks.matrix.seqlen=[256, 512]");
    assert_eq!(
        again.get("cached"),
        Some(&21),
        "a rerun is fully cached: {again:?}"
    );

    let changed = run("stages.masks.matrix.seqlen=[256, 1k]");
    // New: 2 masks at 1k, their 8 measurements, and the report that collects them.
    assert_eq!(changed.get("ok"), Some(&(2 + 8 + 1)), "{changed:?}");
    assert_eq!(changed.get("cached"), Some(&(2 + 8)), "{changed:?}");
}
