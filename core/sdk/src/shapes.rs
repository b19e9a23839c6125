//! Model shapes by name: the attention layout of published models, so that a pipeline says
//! `shape: llama3-70b` instead of three numbers it has to look up — and cannot get wrong.
//!
//! A stage takes presets by declaring the optional [`SHAPE_PARAM`] ([`shape_param`]); a preset
//! then sets whichever of [`ModelShape::params`] the stage declares. Values written beside it
//! must agree with it: a conflict is an error that names both, never a silent winner.

use serde_json::Value;

use crate::manifest::{ParamSpec, ParamType, StageSpec};

/// The parameter that names a preset.
pub const SHAPE_PARAM: &str = "shape";

/// The parameters a preset sets, in the order of [`ModelShape::params`].
pub const PRESET_PARAMS: [&str; 4] = ["heads_q", "heads_kv", "head_dim", "head_dim_v"];

/// One model's attention layout, as its published configuration gives it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModelShape {
    pub name: &'static str,
    pub model: &'static str,
    pub heads_q: u64,
    pub heads_kv: u64,
    /// Query and key head dim.
    pub head_dim: u64,
    /// Value (and output) head dim: equal to `head_dim` except for MLA.
    pub head_dim_v: u64,
    /// Where the numbers come from.
    pub source: &'static str,
}

/// Every preset, smallest model of each family first. Where a configuration gives `head_dim`, it
/// is taken as written: heads × head_dim is not the hidden size in Qwen3 or Gemma 3.
pub const MODEL_SHAPES: &[ModelShape] = &[
    ModelShape {
        name: "llama3-8b",
        model: "Llama 3.1 8B",
        heads_q: 32,
        heads_kv: 8,
        head_dim: 128,
        head_dim_v: 128,
        source: "Meta's model list: dim 4096, 32 heads, 8 KV heads; head_dim = dim / heads",
    },
    ModelShape {
        name: "llama3-70b",
        model: "Llama 3.1 70B",
        heads_q: 64,
        heads_kv: 8,
        head_dim: 128,
        head_dim_v: 128,
        source: "Meta's model list: dim 8192, 64 heads, 8 KV heads; head_dim = dim / heads",
    },
    ModelShape {
        name: "llama3-405b",
        model: "Llama 3.1 405B",
        heads_q: 128,
        heads_kv: 8,
        head_dim: 128,
        head_dim_v: 128,
        source: "Meta's model list: dim 16384, 128 heads, 8 KV heads; head_dim = dim / heads",
    },
    ModelShape {
        name: "qwen3-8b",
        model: "Qwen3 8B",
        heads_q: 32,
        heads_kv: 8,
        head_dim: 128,
        head_dim_v: 128,
        source: "Qwen/Qwen3-8B config.json",
    },
    ModelShape {
        name: "qwen3-32b",
        model: "Qwen3 32B",
        heads_q: 64,
        heads_kv: 8,
        head_dim: 128,
        head_dim_v: 128,
        source: "Qwen/Qwen3-32B config.json",
    },
    ModelShape {
        name: "qwen3-235b-a22b",
        model: "Qwen3 235B-A22B (MoE)",
        heads_q: 64,
        heads_kv: 4,
        head_dim: 128,
        head_dim_v: 128,
        source: "Qwen/Qwen3-235B-A22B config.json",
    },
    ModelShape {
        name: "gemma3-12b",
        model: "Gemma 3 12B",
        heads_q: 16,
        heads_kv: 8,
        head_dim: 256,
        head_dim_v: 256,
        source: "google/gemma-3-12b-pt config.json",
    },
    ModelShape {
        name: "gemma3-27b",
        model: "Gemma 3 27B",
        heads_q: 32,
        heads_kv: 16,
        head_dim: 128,
        head_dim_v: 128,
        source: "google/gemma-3-27b-pt config.json",
    },
    ModelShape {
        name: "deepseek-v3",
        model: "DeepSeek-V3 (MLA, training: K and V per head)",
        heads_q: 128,
        heads_kv: 128,
        head_dim: 192,
        head_dim_v: 128,
        source: "deepseek-ai/DeepSeek-V3 config.json: qk_nope_head_dim 128 + qk_rope_head_dim 64, v_head_dim 128",
    },
];

/// The preset called `name`.
pub fn find(name: &str) -> Option<&'static ModelShape> {
    MODEL_SHAPES.iter().find(|shape| shape.name == name)
}

/// The optional `shape` parameter: one of the presets' names.
pub fn shape_param() -> ParamSpec {
    let names = MODEL_SHAPES.iter().map(|shape| shape.name.to_string());
    ParamSpec::new(SHAPE_PARAM, ParamType::Enum(names.collect()))
        .optional()
        .doc("A model's attention shape by name (`attnbench shapes` lists them): sets heads_q, heads_kv, head_dim and head_dim_v where the stage has them; values written beside it must agree.")
}

/// The optional `head_dim_v` parameter of a kernel stage: the value head dim, when it differs.
pub fn value_dim_param() -> ParamSpec {
    ParamSpec::new("head_dim_v", ParamType::Int)
        .optional()
        .doc("Value (and output) head dim where it differs from head_dim (MLA: head_dim 192, head_dim_v 128); absent: equal.")
}

/// Why a preset cannot set a stage's parameters.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PresetError {
    #[error("`shape: {preset}` sets {param} = {preset_value}, but {param} = {given} is given too; drop one of them")]
    Conflict {
        preset: &'static str,
        param: &'static str,
        preset_value: u64,
        given: String,
    },
    #[error("`shape: {preset}` has query/key head dim {head_dim} and value head dim {head_dim_v}, but this stage takes one head_dim for both (it has no `head_dim_v`)")]
    SplitHeadDim {
        preset: &'static str,
        head_dim: u64,
        head_dim_v: u64,
    },
}

impl ModelShape {
    /// The parameters a preset sets, by name.
    pub fn params(&self) -> [(&'static str, u64); 4] {
        let values = [self.heads_q, self.heads_kv, self.head_dim, self.head_dim_v];
        std::array::from_fn(|i| (PRESET_PARAMS[i], values[i]))
    }

    /// What the preset sets on `stage`: each of its parameters the stage declares. `given` says
    /// what the pipeline wrote for a parameter beside the preset (not the manifest's default):
    /// a value that differs is a [`PresetError::Conflict`].
    pub fn apply_to<'v>(
        &self,
        stage: &StageSpec,
        given: impl Fn(&str) -> Option<&'v Value>,
    ) -> Result<Vec<(&'static str, Value)>, PresetError> {
        if self.head_dim_v != self.head_dim && stage.find_param("head_dim_v").is_none() {
            return Err(PresetError::SplitHeadDim {
                preset: self.name,
                head_dim: self.head_dim,
                head_dim_v: self.head_dim_v,
            });
        }
        let mut set = Vec::new();
        for (param, value) in self.params() {
            if stage.find_param(param).is_none() {
                continue;
            }
            if let Some(written) = given(param) {
                if written.as_u64() != Some(value) {
                    return Err(PresetError::Conflict {
                        preset: self.name,
                        param,
                        preset_value: value,
                        given: written.to_string(),
                    });
                }
            }
            set.push((param, Value::from(value)));
        }
        Ok(set)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn stage() -> StageSpec {
        StageSpec::new("benchmark")
            .param(ParamSpec::new("heads_q", ParamType::Int).default(64))
            .param(ParamSpec::new("heads_kv", ParamType::Int).default(8))
            .param(ParamSpec::new("head_dim", ParamType::Int).default(128))
            .param(shape_param())
    }

    #[test]
    fn a_preset_sets_the_parameters_the_stage_declares() {
        let set = find("llama3-8b")
            .unwrap()
            .apply_to(&stage(), |_| None)
            .unwrap();
        assert_eq!(
            set,
            [
                ("heads_q", json!(32)),
                ("heads_kv", json!(8)),
                ("head_dim", json!(128))
            ]
        );
    }

    #[test]
    fn an_agreeing_value_beside_a_preset_is_fine_and_a_different_one_names_both() {
        let preset = find("llama3-70b").unwrap();
        let same = json!(64);
        assert!(preset
            .apply_to(&stage(), |p| (p == "heads_q").then_some(&same))
            .is_ok());
        let other = json!(32);
        let err = preset
            .apply_to(&stage(), |p| (p == "heads_q").then_some(&other))
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "`shape: llama3-70b` sets heads_q = 64, but heads_q = 32 is given too; drop one of them"
        );
    }

    #[test]
    fn mla_needs_a_stage_with_a_value_head_dim() {
        let err = find("deepseek-v3")
            .unwrap()
            .apply_to(&stage(), |_| None)
            .unwrap_err();
        assert!(matches!(
            err,
            PresetError::SplitHeadDim {
                head_dim: 192,
                head_dim_v: 128,
                ..
            }
        ));
        let with_v = stage().param(ParamSpec::new("head_dim_v", ParamType::Int).default(128));
        let set = find("deepseek-v3")
            .unwrap()
            .apply_to(&with_v, |_| None)
            .unwrap();
        assert!(
            set.contains(&("head_dim", json!(192))) && set.contains(&("head_dim_v", json!(128)))
        );
    }

    #[test]
    fn presets_are_named_once_and_group_their_heads_evenly() {
        for (i, shape) in MODEL_SHAPES.iter().enumerate() {
            assert!(MODEL_SHAPES[..i].iter().all(|s| s.name != shape.name));
            assert_eq!(shape.heads_q % shape.heads_kv, 0, "{}", shape.name);
            assert!(shape.head_dim_v <= shape.head_dim, "{}", shape.name);
        }
    }
}
