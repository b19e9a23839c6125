use attnbench_tests::{stderr, workspace_root, Sandbox};

/// Runs `pipelines/decode-cpu.yaml` in `sandbox` with `--set` overrides.
fn run_decode(sandbox: &Sandbox, overrides: &[&str]) -> std::process::Output {
    let pipeline = workspace_root().join("pipelines/decode-cpu.yaml");
    let mut args = vec!["run", pipeline.to_str().unwrap(), "-q"];
    for value in overrides {
        args.extend(["--set", value]);
    }
    sandbox.run(&args)
}

#[test]
fn a_cpu_decode_step_is_checked_and_reports_latency_and_bandwidth() {
    let sandbox = Sandbox::new();
    let run = run_decode(
        &sandbox,
        &[
            "stages.decode.matrix.kv_len=[1k, 4k]",
            "stages.decode.with.max_time_s=0.2",
        ],
    );
    assert!(run.status.success(), "{}", stderr(&run));
    let record = sandbox.last_record();
    let nodes: Vec<&serde_json::Value> = record["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|n| n["id"].as_str().unwrap().starts_with("decode"))
        .collect();
    assert_eq!(nodes.len(), 2 * 2 * 2);
    let report = sandbox.cache().join("reports/decode-cpu/report.html");
    let page = std::fs::read_to_string(&report).unwrap();
    assert!(
        page.contains("<h2>Decoding</h2>") && page.contains("id=\"decode\""),
        "{}",
        report.display()
    );
    // Per new-token count and cache: a bandwidth and a latency chart.
    assert_eq!(
        page.matches("<svg").count(),
        2 * 2 * 2,
        "{}",
        report.display()
    );
    for node in nodes {
        let path = std::path::Path::new(node["artifact"].as_str().unwrap()).join("decode.json");
        let result: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        assert_eq!(
            result["correctness"]["passed"], true,
            "{}: {result}",
            node["id"]
        );
        assert!(result["latency_us"].as_f64().unwrap() > 0.0, "{result}");
        assert!(result["bandwidth_gbs"].as_f64().unwrap() > 0.0, "{result}");
        assert!(result["copy_gbs"].as_f64().unwrap() > 0.0, "{result}");
        assert!(result["splits"].as_u64().unwrap() >= 1, "{result}");
        // Bytes: K and V once per KV head, Q and O once, f32.
        let kv: u64 = result["kv_lens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|l| l.as_u64().unwrap())
            .sum();
        let queries = result["queries"].as_u64().unwrap();
        let expected = 4 * (2 * kv * 2 * 64 + 2 * 4 * queries * 8 * 64);
        assert_eq!(result["bytes"].as_u64().unwrap(), expected, "{result}");
    }
}

#[test]
fn a_decode_step_with_no_new_token_is_refused_with_the_allowed_range() {
    let sandbox = Sandbox::new();
    let run = run_decode(
        &sandbox,
        &[
            "stages.decode.matrix.queries=[0]",
            "stages.decode.matrix.kv_len=[1k]",
            "stages.decode.matrix.page_size=[0]",
        ],
    );
    assert!(!run.status.success());
    let said = stderr(&run);
    assert!(said.contains("queries must be 1 to 16"), "{said}");
}

/// A pipeline of `python/decode` cells in `sandbox`, on the test interpreter.
fn python_decode(sandbox: &Sandbox, kernel: &str, matrix: &str) -> serde_json::Value {
    let python = attnbench_tests::python_with_numpy().display().to_string();
    sandbox.write(
        "p.yaml",
        &format!(
            r#"name: python-decode
seed: 5
stages:
  decode:
    uses: python/decode
    matrix: {matrix}
    with: {{kernel: {kernel}, python: "{python}", batch: 3, kv_len: 700, heads_q: 8, heads_kv: 2, head_dim: 32, max_time_s: 0.2}}
"#
        ),
    );
    let run = sandbox.run(&["run", "p.yaml", "-q"]);
    assert!(run.status.success(), "{}", stderr(&run));
    sandbox.last_record()
}

fn decode_json(node: &serde_json::Value) -> serde_json::Value {
    let path = std::path::Path::new(node["artifact"].as_str().unwrap()).join("decode.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

#[test]
fn the_bridges_numpy_decode_matches_the_reference_on_packed_and_paged_caches() {
    let sandbox = Sandbox::new();
    let record = python_decode(&sandbox, "numpy", "{queries: [1, 4], page_size: [0, 16]}");
    let nodes = record["nodes"].as_array().unwrap();
    assert_eq!(nodes.len(), 4);
    for node in nodes {
        let result = decode_json(node);
        assert_eq!(result["status"], "ok", "{result}");
        assert_eq!(
            result["correctness"]["passed"], true,
            "{}: {result}",
            node["id"]
        );
        assert!(
            result["correctness"]["checked"]
                .as_str()
                .unwrap()
                .contains("O and LSE"),
            "{result}"
        );
        assert!(result["latency_us"].as_f64().unwrap() > 0.0, "{result}");
        assert!(result["copy_gbs"].as_f64().unwrap() > 0.0, "{result}");
        assert_eq!(
            result["kv_lens"],
            serde_json::json!([700, 467, 234]),
            "{result}"
        );
    }
}

#[test]
fn a_gpu_decode_peer_without_its_package_or_device_is_unsupported_with_the_reason() {
    let sandbox = Sandbox::new();
    let record = python_decode(&sandbox, "fa4", "{queries: [1]}");
    let result = decode_json(&record["nodes"][0]);
    assert_eq!(result["status"], "unsupported", "{result}");
    assert_eq!(result["scope"], "machine", "{result}");
    assert!(!result["reason"].as_str().unwrap().is_empty(), "{result}");
}
