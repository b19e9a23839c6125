//! Expansion of pipelines over plugins known by their manifests alone: node ids and order,
//! matrix joins with upstream nodes, collected inputs, size axes and the refusals.

use std::path::Path;

use attnbench_sdk::{kinds, ParamSpec, ParamType, PluginManifest, StageSpec};

use super::*;
use crate::host::plugin::Registry;

/// `gen/masks` (mask, seqlen) → `bench/run` (kernel, one node per mask node) → `bench/report`
/// (collects every run); `model/attend` takes model shapes. The pipeline checker's tests use it too.
pub(crate) fn registry() -> Registry {
    let masks = PluginManifest::new("gen", "0").stage(
        StageSpec::new("masks")
            .param(ParamSpec::new("mask", ParamType::one_of(&["full", "causal"])).default("full"))
            .param(ParamSpec::new("seqlen", ParamType::Size).default(1024))
            .param(ParamSpec::new("source", ParamType::File).default(""))
            .output(kinds::MASK),
    );
    let bench = PluginManifest::new("bench", "0")
        .stage(
            StageSpec::new("run")
                .param(ParamSpec::new("kernel", ParamType::one_of(&["a", "b"])).default("a"))
                .param(ParamSpec::new("seqlen", ParamType::Size).default(1024))
                .input(kinds::MASK)
                .output(kinds::MEASUREMENT),
        )
        .stage(
            StageSpec::new("report")
                .param(ParamSpec::new("title", ParamType::String).default(""))
                .input(kinds::MEASUREMENT),
        );
    let model = PluginManifest::new("model", "0").stage(
        StageSpec::new("attend")
            .param(ParamSpec::new("heads_q", ParamType::Int).default(64))
            .param(ParamSpec::new("heads_kv", ParamType::Int).default(8))
            .param(ParamSpec::new("head_dim", ParamType::Int).default(128))
            .param(attnbench_sdk::shapes::shape_param())
            .input(kinds::MASK)
            .output(kinds::MEASUREMENT),
    );
    Registry::of_manifests(vec![masks, bench, model])
}

pub(crate) fn plan(text: &str) -> Result<Plan, PipelineError> {
    let pipeline = crate::pipeline::parse(Path::new("test.yaml"), text, &[], &registry())?;
    Plan::expand(pipeline)
}

fn ids(plan: &Plan) -> Vec<&str> {
    plan.nodes.iter().map(|n| n.id.as_str()).collect()
}

pub(crate) const PIPELINE: &str = "
name: t
stages:
  masks:
    uses: gen/masks
    matrix: {mask: [full, causal], seqlen: [1k, 2k]}
  run:
    uses: bench/run
    needs: [masks]
    matrix: {kernel: [a, b]}
  report:
    uses: bench/report
    needs: {run: all}
";

#[test]
fn a_matrix_expands_last_axis_fastest_and_fans_out_per_upstream_node() {
    let plan = plan(PIPELINE).unwrap();
    let nodes = ids(&plan);
    assert_eq!(
        &nodes[..4],
        [
            "masks[mask=full,seqlen=1k]",
            "masks[mask=full,seqlen=2k]",
            "masks[mask=causal,seqlen=1k]",
            "masks[mask=causal,seqlen=2k]"
        ]
    );
    // One run node per (mask node, kernel), named by the upstream coordinates and its own.
    assert_eq!(nodes[4], "run[mask=full,seqlen=1k,kernel=a]");
    assert_eq!(nodes[5], "run[mask=full,seqlen=1k,kernel=b]");
    assert_eq!(nodes.len(), 4 + 8 + 1);
    let run = &plan.nodes[5];
    assert_eq!((run.inputs.clone(), run.fan_out_inputs), (vec![0], 1));
    assert_eq!(run.params.get("kernel"), Some(&serde_json::json!("b")));
    // A size axis is canonical (tokens) in the parameters and short in the id.
    assert_eq!(
        plan.nodes[1].params.get("seqlen"),
        Some(&serde_json::json!(2048))
    );
    // The report collects every run node, after all of them.
    let report = plan.nodes.last().unwrap();
    assert_eq!(report.id, "report");
    assert_eq!(report.inputs, (4..12).collect::<Vec<_>>());
    assert_eq!(report.fan_out_inputs, 0);
    for (index, node) in plan.nodes.iter().enumerate() {
        assert!(
            node.inputs.iter().all(|&i| i < index),
            "{} before its inputs",
            node.id
        );
    }
}

#[test]
fn a_matrix_key_the_upstream_fixed_joins_instead_of_multiplying() {
    let text = PIPELINE.replace(
        "matrix: {kernel: [a, b]}",
        "matrix: {kernel: [a], seqlen: [1k, 2k]}",
    );
    let plan = plan(&text).unwrap();
    let runs: Vec<&str> = ids(&plan)
        .into_iter()
        .filter(|id| id.starts_with("run"))
        .collect();
    // seqlen pairs with the mask node's seqlen: 4 mask nodes, one run each, not 8.
    assert_eq!(runs.len(), 4, "{runs:?}");
    for node in plan.nodes.iter().filter(|n| n.id.starts_with("run")) {
        let upstream = &plan.nodes[node.inputs[0]];
        assert_eq!(
            node.params.get("seqlen"),
            upstream.params.get("seqlen"),
            "{}",
            node.id
        );
    }
}

#[test]
fn a_join_with_no_agreeing_values_is_refused_with_the_stage_named() {
    let text = PIPELINE.replace(
        "matrix: {kernel: [a, b]}",
        "matrix: {kernel: [a], seqlen: [4k]}",
    );
    let message = plan(&text).unwrap_err().to_string();
    assert!(
        message.contains("stage `run` expands to no nodes"),
        "{message}"
    );
}

#[test]
fn select_takes_a_node_id_or_a_whole_stage() {
    let plan = plan(PIPELINE).unwrap();
    assert_eq!(plan.select("run").len(), 8);
    assert_eq!(plan.select("masks[mask=causal,seqlen=1k]"), vec![2]);
    assert!(plan.select("nothing").is_empty());
    assert_eq!(nodes_per_stage(&plan)["run"], 8);
}
