//! The CPU context-parallel pipeline end to end (narrowed to CI size): every method at every
//! world size is exact against the single-device reference, every rank's bytes equal the
//! method's formula, and the report is written.

use attnbench_tests::{measurements, node, stderr, stdout, workspace_root, Sandbox};

#[test]
fn the_cpu_context_parallel_pipeline_is_exact_and_its_traffic_matches_the_formulas() {
    let sandbox = Sandbox::new();
    let pipeline = workspace_root().join("pipelines/context-parallel-cpu.yaml");
    let run = sandbox.run(&[
        "run",
        pipeline.to_str().unwrap(),
        "--set",
        "stages.masks.matrix.seqlen=[96]",
        "--set",
        "stages.cp.matrix.world=[2, 4]",
        "--set",
        "stages.cp.with.min_reps=1",
        "--set",
        "stages.cp.with.warmup_reps=0",
        "--set",
        "stages.cp.matrix.sharding=[zigzag, balanced]",
    ]);
    assert!(run.status.success(), "{}", stderr(&run));
    let said = format!("{}{}", stdout(&run), stderr(&run));
    assert!(said.contains("report: "), "{said}");
    let record = sandbox.last_record();
    let mut checked = 0;
    for (id, m) in measurements(&record, "cp[") {
        assert_eq!(m["status"], "ok", "{id}: {m}");
        assert_eq!(
            m["correctness"]["passed"], true,
            "{id}: {}",
            m["correctness"]
        );
        let cp = &m["cp"];
        let formula_forward = cp["formula_forward"].as_u64().unwrap();
        assert!(formula_forward > 0, "{id}: {cp}");
        for sent in cp["bytes_sent_forward"].as_array().unwrap() {
            assert_eq!(sent.as_u64().unwrap(), formula_forward, "{id}: {cp}");
        }
        if m["direction"] != "fwd" {
            let formula_backward = cp["formula_backward"].as_u64().unwrap();
            for sent in cp["bytes_sent_backward"].as_array().unwrap() {
                assert_eq!(sent.as_u64().unwrap(), formula_backward, "{id}: {cp}");
            }
        }
        let areas: Vec<u64> = cp["ranks"]
            .as_array()
            .unwrap()
            .iter()
            .map(|rank| rank["area"].as_u64().unwrap())
            .collect();
        let mean = areas.iter().sum::<u64>() as f64 / areas.len() as f64;
        let imbalance = cp["imbalance"].as_f64().unwrap();
        assert!(
            (imbalance - *areas.iter().max().unwrap() as f64 / mean).abs() < 1e-9,
            "{id}: {cp}"
        );
        assert!(cp["mean_rank_tflops"].as_f64().unwrap() > 0.0, "{id}: {cp}");
        checked += 1;
    }
    // 3 masks × 5 methods × 2 world sizes × 2 directions × 2 shardings
    assert_eq!(checked, 120);
}

#[test]
fn the_cost_model_pipeline_predicts_every_method_and_its_report_plots_the_curves() {
    let sandbox = Sandbox::new();
    let pipeline = workspace_root().join("pipelines/context-parallel-model.yaml");
    let run = sandbox.run(&["run", pipeline.to_str().unwrap(), "-q"]);
    assert!(run.status.success(), "{}", stderr(&run));
    let record = sandbox.last_record();
    let nodes = record["nodes"].as_array().unwrap();
    let model = nodes
        .iter()
        .find(|n| n["id"] == "model[mask=causal,direction=fwd,sharding=contiguous]")
        .unwrap();
    let path = std::path::Path::new(model["artifact"].as_str().unwrap()).join("predictions.json");
    let predictions: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let points = predictions["points"].as_array().unwrap();
    assert_eq!(points.len(), 5 * 8, "5 methods × 8 world sizes");
    for point in points {
        // Contiguous pieces leave a ring's last rank most of the causal work; Ulysses has no ring.
        let imbalance = point["imbalance"].as_f64().unwrap();
        let world = point["world"].as_u64().unwrap();
        let ring = match point["method"].as_str().unwrap() {
            "ulysses" => 1,
            "usp" | "loongtrain" => world / world.min(8),
            _ => world,
        };
        // Contiguous pieces of a causal mask: the last of R ranks carries (2R − 1)/R of the mean.
        let expected = (2 * ring - 1) as f64 / ring as f64;
        assert!((imbalance - expected).abs() < 1e-3, "{point}");
        match point["tflops_per_gpu"].as_f64() {
            Some(tflops) => assert!(tflops > 0.0 && tflops <= 350.6 + 1e-6, "{point}"),
            // Ulysses cannot split 64 heads over more than 64 ranks.
            None => assert!(
                point["method"] == "ulysses" && point["world"].as_u64().unwrap() > 64,
                "{point}"
            ),
        }
    }
    let report = node(&record, "report");
    let html = std::fs::read_to_string(
        std::path::Path::new(report["artifact"].as_str().unwrap()).join("report.html"),
    )
    .unwrap();
    assert!(html.contains("Predicted context-parallel throughput"));
    assert_eq!(
        html.matches("<figure><svg").count(),
        16,
        "one chart per mask, direction and sharding"
    );
}

#[test]
fn ranks_as_processes_joined_over_tcp_give_the_same_exact_results_and_traffic() {
    let sandbox = Sandbox::new();
    sandbox.write(
        "p.yaml",
        "stages:\n  masks:\n    uses: masks/generate\n    with: {mask: causal_document, seqlen: 96}\n  cp:\n    uses: cp/threads\n    needs: [masks]\n    matrix: {method: [ulysses, ring_p2p, ring_allgather, usp, loongtrain], direction: [bwd]}\n    with: {backend: processes, world: 4, heads_q: 8, heads_kv: 2, head_dim: 8, min_reps: 1, warmup_reps: 0}\n",
    );
    let run = sandbox.run(&["run", "p.yaml", "-q"]);
    assert!(run.status.success(), "{}", stderr(&run));
    let record = sandbox.last_record();
    let cells = measurements(&record, "cp[");
    assert_eq!(cells.len(), 5);
    for (id, m) in cells {
        assert_eq!(
            m["correctness"]["passed"], true,
            "{id}: {}",
            m["correctness"]
        );
        let cp = &m["cp"];
        for (sent, formula) in [
            ("bytes_sent_forward", "formula_forward"),
            ("bytes_sent_backward", "formula_backward"),
        ] {
            for bytes in cp[sent].as_array().unwrap() {
                assert_eq!(bytes, &cp[formula], "{id}: {cp}");
            }
        }
        assert_eq!(
            cp["bytes_sent_forward"].as_array().unwrap().len(),
            4,
            "{id}: four ranks"
        );
        assert_eq!(cp["backend"], "processes", "{id}");
    }
}

/// The ranks' local attention through another plugin's in-process backend (`cpu/reference`,
/// loaded by the cp plugin from the library the host hands over): every method gives the same
/// results as the builtin blocks — with ranks as threads, and as processes that open the backend
/// themselves.
#[test]
fn local_attention_through_the_cpu_plugins_in_process_backend_matches_the_builtin() {
    let sandbox = Sandbox::new();
    sandbox.write(
        "p.yaml",
        "stages:\n  masks:\n    uses: masks/generate\n    with: {mask: causal_document, seqlen: 96}\n  cp:\n    uses: cp/threads\n    needs: [masks]\n    matrix: {method: [ulysses, ring_p2p, ring_allgather, usp, loongtrain], attention: [builtin, cpu/reference], backend: [threads, processes]}\n    with: {direction: bwd, world: 4, heads_q: 8, heads_kv: 2, head_dim: 8, min_reps: 1, warmup_reps: 0}\n",
    );
    let run = sandbox.run(&["run", "p.yaml", "-q"]);
    assert!(run.status.success(), "{}", stderr(&run));
    let record = sandbox.last_record();
    let cells = measurements(&record, "cp[");
    assert_eq!(cells.len(), 20);
    let errors_of = |method: &str, attention: &str, backend: &str| {
        let (id, m) = cells
            .iter()
            .find(|(id, _)| {
                id.contains(&format!("method={method},"))
                    && id.contains(&format!("attention={attention}"))
                    && id.contains(&format!("backend={backend}"))
            })
            .unwrap_or_else(|| panic!("no cell {method} {attention} {backend}"));
        assert_eq!(
            m["correctness"]["passed"], true,
            "{id}: {}",
            m["correctness"]
        );
        assert_eq!(m["cp"]["attention"], attention, "{id}");
        m["correctness"]["errors"].clone()
    };
    for method in ["ulysses", "ring_p2p", "ring_allgather", "usp", "loongtrain"] {
        let builtin = errors_of(method, "builtin", "threads");
        for backend in ["threads", "processes"] {
            assert_eq!(
                errors_of(method, "cpu/reference", backend),
                builtin,
                "{method} over {backend}: the same blocks, the same numbers"
            );
        }
    }
    // The key names the backend's library: a rerun is all cached.
    let rerun = sandbox.run(&["run", "p.yaml", "-q"]);
    assert!(rerun.status.success(), "{}", stderr(&rerun));
    assert!(sandbox
        .statuses()
        .iter()
        .all(|(id, s)| !id.starts_with("cp[") || s == "cached"));
}

#[test]
fn an_attention_backend_no_plugin_offers_is_refused_before_anything_runs() {
    let sandbox = Sandbox::new();
    sandbox.write(
        "p.yaml",
        "stages:\n  masks:\n    uses: masks/generate\n    with: {mask: causal, seqlen: 64}\n  cp:\n    uses: cp/threads\n    needs: [masks]\n    with: {attention: cpu/flash, world: 2}\n",
    );
    let run = sandbox.run(&["run", "p.yaml", "-q"]);
    assert!(!run.status.success());
    let said = stderr(&run);
    assert!(
        said.contains("cpu/flash") && said.contains("cpu/reference") && said.contains("attention"),
        "{said}"
    );
    assert!(
        !sandbox.cache().join("runs").exists() || sandbox.statuses().is_empty(),
        "{said}"
    );
}

#[test]
fn decoding_across_ranks_is_exact_and_sends_one_partial_per_rank() {
    let sandbox = Sandbox::new();
    let pipeline = workspace_root().join("pipelines/decode-cp-cpu.yaml");
    let run = sandbox.run(&["run", pipeline.to_str().unwrap(), "-q"]);
    assert!(run.status.success(), "{}", stderr(&run));
    let record = sandbox.last_record();
    let nodes = record["nodes"].as_array().unwrap();
    assert_eq!(nodes.len(), 2 * 3 * 2);
    for node in nodes {
        let path = std::path::Path::new(node["artifact"].as_str().unwrap()).join("decode.json");
        let result: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        assert_eq!(result["passed"], true, "{}: {result}", node["id"]);
        assert!(result["max_error"].as_f64().unwrap() < 1e-9, "{result}");
        let world = result["world"].as_u64().unwrap();
        let depth = result["depth"].as_u64().unwrap();
        match result["method"].as_str().unwrap() {
            "tree" => assert_eq!(depth, (world as f64).log2().ceil() as u64),
            _ => assert_eq!(depth, world - 1),
        }
        let predicted = result["predicted"].as_array().unwrap();
        let at_1024 = predicted.last().unwrap();
        assert_eq!(at_1024["gpus"], 1024);
        assert!(at_1024["tree_s"].as_f64().unwrap() < at_1024["ring_s"].as_f64().unwrap());
    }
}
