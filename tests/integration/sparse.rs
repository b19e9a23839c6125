//! The block-sparse protocol at CPU size (narrowed for CI): every kernel cell is checked against
//! the reference, and FLOPs come from the exact selected area — `k = floor(ρ·n)` key blocks per
//! query block — never from the nominal `ρ·S²`.

use attnbench_tests::{measurements, stderr, workspace_root, Sandbox};

#[test]
fn sparse_cells_are_correct_and_count_the_flops_of_the_blocks_they_keep() {
    let sandbox = Sandbox::new();
    let pipeline = workspace_root().join("pipelines/sparse-kernels-cpu.yaml");
    let run = sandbox.run(&[
        "run",
        pipeline.to_str().unwrap(),
        "-q",
        "--set",
        "stages.uniform.matrix.seqlen=[1k]",
        "--set",
        "stages.uniform.matrix.density=[0.1, 0.9]",
        "--set",
        "stages.variable.matrix.density=[0.5]",
        "--set",
        "stages.variable.matrix.sparse_block=[256]",
    ]);
    assert!(run.status.success(), "{}", stderr(&run));
    let record = sandbox.last_record();
    let mut uniform = 0;
    for (id, m) in measurements(&record, "tiled_") {
        assert_eq!(m["status"], "ok", "{id}: {m}");
        assert_eq!(
            m["correctness"]["passed"], true,
            "{id}: {}",
            m["correctness"]
        );
        if !id.starts_with("tiled_uniform") {
            continue;
        }
        let params = &m["mask"]["params"];
        let (density, block) = (
            params["density"].as_f64().unwrap(),
            params["sparse_block"].as_u64().unwrap(),
        );
        let seqlen = m["mask"]["seqlen"].as_u64().unwrap();
        let blocks = seqlen / block;
        let kept = ((density * blocks as f64).floor() as u64).clamp(1, blocks);
        let (heads, d) = (
            m["shape"]["heads_q"].as_u64().unwrap(),
            m["shape"]["head_dim"].as_u64().unwrap(),
        );
        let forward = 4 * seqlen * seqlen * kept / blocks * heads * d;
        let expected = if m["direction"] == "fwd" {
            forward
        } else {
            forward / 2 * 5
        };
        assert_eq!(m["flops"].as_u64().unwrap(), expected, "{id}");
        uniform += 1;
    }
    // 1 length × 2 blocks × 2 densities × (MHA, GQA) × (fwd, bwd)
    assert_eq!(uniform, 16);
}
