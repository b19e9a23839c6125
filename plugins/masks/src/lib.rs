//! `masks/generate`: one mask pattern at one sequence length, as mask IR (`mask.json`), with every
//! parameter it used or drew, its documents, area and density.

use std::path::Path;

use attnbench_sdk::histogram::Histogram;
use attnbench_sdk::{
    Host, ParamSpec, ParamType, Plugin, PluginError, PluginManifest, StageRequest, StageSpec,
};
use serde_json::{json, Value};

use attnbench_mask_catalogue::{generate, Params, Pattern};
use attnbench_sdk::mask::HeadScope;

/// The histogram file a `datasets/lengths` node writes.
pub const HISTOGRAM_FILE: &str = "histogram.json";

struct Masks;

pub fn generate_stage() -> StageSpec {
    StageSpec::new("generate")
        .doc("Builds one mask pattern at one sequence length as mask IR, drawing documents and parameters like LongCA-bench.")
        .param(ParamSpec::new("mask", ParamType::one_of(Pattern::NAMES)).doc("The pattern."))
        .param(ParamSpec::new("seqlen", ParamType::Size).doc("Tokens (queries = keys)."))
        .param(
            ParamSpec::new("distribution", ParamType::File)
                .default("synthetic")
                .doc("Document lengths: `synthetic` (built in), `input` (a datasets/lengths node this stage needs), or a LongCA-bench histogram JSON file."),
        )
        .param(ParamSpec::new("window", ParamType::Size).default(1024).doc("Sliding windows: keys at most this far from the query."))
        .param(ParamSpec::new("prefix", ParamType::Int).default(-1).doc("Prefix-LM: prefix length; −1 draws it like LongCA-bench."))
        .param(ParamSpec::new("global_tokens", ParamType::Int).default(-1).doc("Global window: global tokens g; −1 draws max(1, randint(1, S//3 − 1))."))
        .param(ParamSpec::new("global_window", ParamType::Int).default(-1).doc("Global window: the window W; −1 uses g."))
        .param(ParamSpec::new("block_size", ParamType::Size).default(1024).doc("Block-causal documents: block size."))
        .param(ParamSpec::new("short_fraction", ParamType::Float).default(0.4).doc("`_long` documents: share of tokens drawn from the distribution; the rest are long documents."))
        .param(ParamSpec::new("long_min", ParamType::Size).default(8192).doc("`_long` documents: shortest long document."))
        .param(ParamSpec::new("long_max", ParamType::Size).default(30720).doc("`_long` documents: longest long document."))
        .param(ParamSpec::new("density", ParamType::Float).default(0.5).doc("Block-sparse: fraction of key blocks each query block keeps."))
        .param(ParamSpec::new("sparse_block", ParamType::Size).default(128).doc("Block-sparse: block size (variable: the average)."))
        .param(ParamSpec::new("min_block", ParamType::Size).default(128).doc("Variable block-sparse: the smallest block."))
        .param(
            ParamSpec::new("sparse_scope", ParamType::one_of(HeadScope::NAMES))
                .default("per_kv_group")
                .doc("Block-sparse: one pattern for all heads, per KV group, or per query head."),
        )
        .param(ParamSpec::new("heads_q", ParamType::Int).default(64).doc("Query heads (block-sparse scopes)."))
        .param(ParamSpec::new("heads_kv", ParamType::Int).default(8).doc("Key/value heads (block-sparse scopes)."))
        .input("histogram")
        .output("mask")
}

impl Plugin for Masks {
    fn manifest() -> PluginManifest {
        PluginManifest::new("masks", env!("CARGO_PKG_VERSION"))
            .description("The mask catalogue: 16 patterns as mask IR, sampled bit-compatibly with LongCA-bench.")
            .stage(generate_stage())
    }

    fn run(stage: &str, request: StageRequest, host: &Host) -> Result<Value, PluginError> {
        if stage != "generate" {
            return Err(PluginError::UnknownStage {
                stage: stage.into(),
                known: "generate".into(),
            });
        }
        let params: Params = request.params()?;
        let distribution = request
            .params
            .get("distribution")
            .and_then(Value::as_str)
            .unwrap_or("synthetic");
        let histogram = resolve_histogram(distribution, &request)?;
        let set = generate(&params, &histogram, request.seed)
            .map_err(|err| PluginError::Params(err.to_string()))?;
        let area: u64 = set.masks.iter().map(|m| m.area()).sum();
        let slices: usize = set.masks.iter().map(|m| m.slices.len()).sum();
        host.debug(&format!(
            "{}: {} documents, {slices} slices, area {area}",
            request.node,
            set.documents.len()
        ));
        set.save(&request.output_dir)?;
        Ok(json!({
            "pattern": set.pattern,
            "seqlen": set.seqlen,
            "params": set.params,
            "documents": set.documents,
            "scope": set.scope,
            "masks": set.masks.len(),
            "slices": slices,
            "area": area,
            "density": area as f64 / (set.masks.len() as f64 * set.seqlen as f64 * set.seqlen as f64),
        }))
    }
}

fn resolve_histogram(distribution: &str, request: &StageRequest) -> Result<Histogram, PluginError> {
    match distribution {
        "synthetic" => Ok(Histogram::synthetic()),
        "input" => {
            let input = request.inputs_from("lengths").next().ok_or_else(|| {
                PluginError::Params(
                    "distribution `input` needs a datasets/lengths node in `needs`".into(),
                )
            })?;
            read_histogram(&input.dir.join(HISTOGRAM_FILE))
        }
        path => read_histogram(Path::new(path)),
    }
}

fn read_histogram(path: &Path) -> Result<Histogram, PluginError> {
    let text = std::fs::read_to_string(path)
        .map_err(|err| PluginError::Params(format!("distribution {}: {err}", path.display())))?;
    Histogram::from_longca_json(&text)
        .map_err(|err| PluginError::Params(format!("distribution {}: {err}", path.display())))
}

attnbench_sdk::export_plugin!(Masks);
