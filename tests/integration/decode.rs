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
    let nodes = record["nodes"].as_array().unwrap();
    assert_eq!(nodes.len(), 2 * 2 * 2);
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
