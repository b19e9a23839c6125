//! `shape:` presets in a stage: checked against what the stage writes beside them, and applied.
//! One preset in `with` sets the stage's parameters here; a `shape` matrix axis is applied per
//! node by the plan ([`node_params`]), after every value was checked here.

use attnbench_sdk::shapes::{self, SHAPE_PARAM};
use attnbench_sdk::StageSpec;
use serde_json::{Map, Value};

use super::checker::Checker;

/// Checks the stage's presets, in `with` or its matrix, against the values the pipeline writes
/// for the same parameters (`with`, the pipeline's `defaults`, a matrix axis), and puts a `with`
/// preset's values into `params`.
pub(super) fn check_presets(
    checker: &mut Checker,
    stage_name: &str,
    spec: &StageSpec,
    written: &Map<String, Value>,
    matrix: &[(String, Vec<Value>)],
    params: &mut Map<String, Value>,
) {
    let axis = |key: &str| matrix.iter().find(|(k, _)| k == key);
    let (presets, at): (Vec<&Value>, Vec<&str>) = match (params.get(SHAPE_PARAM), axis(SHAPE_PARAM))
    {
        (Some(preset), _) => (vec![preset], vec!["with", SHAPE_PARAM]),
        (None, Some((_, values))) => (values.iter().collect(), vec!["matrix", SHAPE_PARAM]),
        (None, None) => return,
    };
    let mut path = vec!["stages", stage_name];
    path.extend(&at);
    for param in shapes::PRESET_PARAMS {
        if spec.find_param(param).is_some() && axis(param).is_some() {
            checker.at_key(
                &["stages", stage_name, "matrix", param],
                format!("`{param}` varies in `matrix` while `shape` sets it"),
                Some(format!("drop `{param}` from the matrix, or `shape`")),
            );
        }
    }
    let mut set = Vec::new();
    for value in presets {
        let Some(preset) = value.as_str().and_then(shapes::find) else {
            continue; // the parameter's type check has already reported it
        };
        match preset.apply_to(spec, |param| written.get(param)) {
            Ok(values) => set = values,
            Err(err) => checker.at_value(&path, err.to_string(), None),
        }
    }
    if axis(SHAPE_PARAM).is_none() {
        for (param, value) in set {
            params.insert(param.into(), value);
        }
    }
}

/// The parameters a node's `shape` axis value sets (checked by [`check_presets`]).
pub fn node_params(spec: &StageSpec, key: &str, value: &Value) -> Vec<(&'static str, Value)> {
    match value.as_str().and_then(shapes::find) {
        Some(preset) if key == SHAPE_PARAM => preset.apply_to(spec, |_| None).unwrap_or_default(),
        _ => Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use crate::plan::tests::plan;

    fn pipeline(attend: &str) -> String {
        format!("stages:\n  masks: {{uses: gen/masks}}\n  attend:\n    uses: model/attend\n    needs: [masks]\n{attend}")
    }

    fn heads(node: &crate::plan::Node) -> [Option<u64>; 3] {
        ["heads_q", "heads_kv", "head_dim"].map(|key| node.params.get(key).and_then(|v| v.as_u64()))
    }

    #[test]
    fn a_preset_in_with_or_in_a_matrix_sets_each_node_s_heads() {
        let one = plan(&pipeline("    with: {shape: gemma3-12b}\n")).unwrap();
        assert_eq!(heads(&one.nodes[1]), [Some(16), Some(8), Some(256)]);
        let plan = plan(&pipeline(
            "    matrix: {shape: [llama3-8b, qwen3-235b-a22b]}\n",
        ))
        .unwrap();
        let ids: Vec<&str> = plan.nodes.iter().map(|n| n.id.as_str()).collect();
        assert_eq!(
            ids,
            [
                "masks",
                "attend[shape=llama3-8b]",
                "attend[shape=qwen3-235b-a22b]"
            ]
        );
        assert_eq!(heads(&plan.nodes[1]), [Some(32), Some(8), Some(128)]);
        assert_eq!(heads(&plan.nodes[2]), [Some(64), Some(4), Some(128)]);
        assert_eq!(
            plan.nodes[2].params.get("shape"),
            Some(&json!("qwen3-235b-a22b"))
        );
    }

    #[test]
    fn without_a_preset_the_stage_has_no_shape_and_its_defaults() {
        let plan = plan(&pipeline("")).unwrap();
        assert_eq!(heads(&plan.nodes[1]), [Some(64), Some(8), Some(128)]);
        assert!(plan.nodes[1].params.get("shape").is_none());
    }

    #[test]
    fn values_beside_a_preset_must_agree_with_it() {
        // Agreeing values, in `with` or the pipeline's defaults, are fine.
        let agreeing = format!(
            "defaults: {{heads_kv: 8}}\n{}",
            pipeline("    with: {shape: llama3-70b, heads_q: 64}\n")
        );
        assert!(plan(&agreeing).is_ok());
        for (text, expected) in [
            (
                pipeline("    with: {shape: llama3-70b, heads_q: 32}\n"),
                "`shape: llama3-70b` sets heads_q = 64, but heads_q = 32 is given too",
            ),
            (
                format!("defaults: {{head_dim: 64}}\n{}", pipeline("    matrix: {shape: [llama3-8b]}\n")),
                "`shape: llama3-8b` sets head_dim = 128, but head_dim = 64 is given too",
            ),
            (
                pipeline("    matrix: {shape: [llama3-8b], heads_kv: [8]}\n"),
                "`heads_kv` varies in `matrix` while `shape` sets it",
            ),
            (
                pipeline("    with: {shape: deepseek-v3}\n"),
                "has query/key head dim 192 and value head dim 128, but this stage takes one head_dim",
            ),
        ] {
            let err = plan(&text).unwrap_err().to_string();
            assert!(err.contains(expected), "{err}");
        }
    }
}
