//! Model shapes by name: `attnbench shapes`, a `shape` matrix measured by the real cpu plugin and
//! reported with its preset, and a conflicting value refused before anything runs.

use attnbench_tests::{measurements, stderr, stdout, Sandbox};

const PIPELINE: &str = r#"
name: shapes
seed: 3
stages:
  masks:
    uses: masks/generate
    with: {mask: causal, seqlen: 128}
  bench:
    uses: cpu/benchmark
    needs: [masks]
    matrix: {shape: [llama3-8b, gemma3-27b]}
    with: {kernel: tiled, min_reps: 1, max_reps: 2}
  table:
    uses: report/table
    needs: {bench: all}
"#;

#[test]
fn shapes_lists_every_preset_with_its_heads() {
    let output = Sandbox::new().run(&["shapes"]);
    assert!(output.status.success(), "{}", stderr(&output));
    let text = stdout(&output);
    let line = |name: &str| {
        let found = text.lines().find(|l| l.starts_with(&format!("{name} ")));
        found
            .unwrap_or_else(|| panic!("no {name} in\n{text}"))
            .split_whitespace()
            .take(5)
            .collect::<Vec<_>>()
            .join(" ")
    };
    assert_eq!(line("llama3-70b"), "llama3-70b 64 8 128 128");
    assert_eq!(line("deepseek-v3"), "deepseek-v3 128 128 192 128");
}

#[test]
fn a_shape_matrix_measures_each_model_s_heads_and_names_it_in_the_table() {
    let sandbox = Sandbox::new();
    sandbox.write("p.yaml", PIPELINE);
    let output = sandbox.run(&["run", "p.yaml", "-q"]);
    assert!(output.status.success(), "{}", stderr(&output));
    let record = sandbox.last_record();
    let heads: Vec<(String, u64, u64, u64, bool)> = measurements(&record, "bench")
        .into_iter()
        .map(|(id, m)| {
            let shape = &m["shape"];
            let passed = m["correctness"]["passed"] == true;
            (
                id,
                shape["heads_q"].as_u64().unwrap(),
                shape["heads_kv"].as_u64().unwrap(),
                shape["head_dim"].as_u64().unwrap(),
                passed,
            )
        })
        .collect();
    assert_eq!(
        heads,
        [
            ("bench[shape=llama3-8b]".to_string(), 32, 8, 128, true),
            ("bench[shape=gemma3-27b]".to_string(), 32, 16, 128, true),
        ]
    );
    let table = attnbench_tests::node(&record, "table")["artifact"]
        .as_str()
        .unwrap()
        .to_string();
    let csv = std::fs::read_to_string(std::path::Path::new(&table).join("results.csv")).unwrap();
    let header: Vec<&str> = csv.lines().next().unwrap().split(',').collect();
    let column = header
        .iter()
        .position(|c| *c == "shape")
        .expect("a shape column");
    let mut shapes: Vec<&str> = csv
        .lines()
        .skip(1)
        .map(|l| l.split(',').nth(column).unwrap())
        .collect();
    shapes.sort();
    assert_eq!(shapes, ["gemma3-27b", "llama3-8b"]);
}

#[test]
fn a_value_that_contradicts_the_preset_is_refused_naming_both() {
    let sandbox = Sandbox::new();
    sandbox.write(
        "p.yaml",
        &PIPELINE.replace("kernel: tiled,", "kernel: tiled, heads_kv: 4,"),
    );
    let output = sandbox.run(&["run", "p.yaml", "-q"]);
    assert_eq!(output.status.code(), Some(2), "{}", stderr(&output));
    let text = stderr(&output);
    assert!(
        text.contains("`shape: llama3-8b` sets heads_kv = 8, but heads_kv = 4 is given too"),
        "{text}"
    );
    assert!(!sandbox.cache().join("runs").exists(), "nothing ran");
}

#[test]
fn deepseek_v3_runs_with_its_own_value_head_dim_where_a_kernel_takes_one() {
    let sandbox = Sandbox::new();
    let pipeline = PIPELINE
        .replace("shape: [llama3-8b, gemma3-27b]", "shape: [deepseek-v3]")
        .replace("seqlen: 128", "seqlen: 64");
    sandbox.write("p.yaml", &pipeline);
    let output = sandbox.run(&["run", "p.yaml", "-q"]);
    assert!(output.status.success(), "{}", stderr(&output));
    let (_, m) = measurements(&sandbox.last_record(), "bench").remove(0);
    let shape = &m["shape"];
    assert_eq!(
        [
            &shape["heads_q"],
            &shape["heads_kv"],
            &shape["head_dim"],
            &shape["head_dim_v"]
        ],
        [128, 128, 192, 128]
    );
    assert_eq!(m["correctness"]["passed"], true, "{m}");
    // FLOPs: 2 · area · heads · (192 + 128), the causal area of 64 tokens being 64·65/2.
    assert_eq!(m["flops"], 2 * (64 * 65 / 2) * 128 * (192 + 128));
}
