use std::path::PathBuf;

use serde::{de::DeserializeOwned, Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::PluginError;

/// Everything one node of a stage gets: validated parameters (defaults applied, sizes as
/// integers), the pipeline seed, the directory to write its artifact files into, and the
/// artifacts of the nodes it needs.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StageRequest {
    /// The node's id in the pipeline, e.g. `bench[kernel=flash,seqlen=4096]`.
    pub node: String,
    pub stage: String,
    pub params: Map<String, Value>,
    pub seed: u64,
    /// An empty directory that becomes the node's artifact; files written here are cached.
    pub output_dir: PathBuf,
    pub inputs: Vec<InputArtifact>,
    /// The libraries of the plugins the node's `backend` parameters name, by plugin name: what
    /// [`crate::attention::Backend::open`] takes.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub plugins: std::collections::BTreeMap<String, PathBuf>,
    /// The host's cache folder (ABI 1.2): plugins read it as [`crate::Host::cache_dir`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_dir: Option<PathBuf>,
}

/// A finished upstream node, as its dependents see it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct InputArtifact {
    pub node: String,
    /// The `plugin/stage` that produced it.
    pub uses: String,
    pub params: Map<String, Value>,
    /// The matrix values the node was expanded with, its own and its inputs' (`mask=causal`, …).
    #[serde(default)]
    pub coords: Map<String, Value>,
    /// The artifact's files (read-only).
    pub dir: PathBuf,
    /// The JSON the producing stage returned (`null` when it failed).
    pub result: Value,
    /// `ok`, `cached`, or — only for inputs collected with `needs: {stage: all}` — how the node
    /// failed (`error`, `crashed`, `timeout`, `skipped`); then `error` says why and `dir` is empty.
    #[serde(default = "succeeded")]
    pub status: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

fn succeeded() -> String {
    "ok".into()
}

impl InputArtifact {
    /// Whether this input produced a result (failed inputs only reach collecting stages).
    pub fn succeeded(&self) -> bool {
        self.status == "ok" || self.status == "cached"
    }
}

impl StageRequest {
    /// The parameters as a typed struct; a mismatch is reported as a parameter error.
    pub fn params<T: DeserializeOwned>(&self) -> Result<T, PluginError> {
        serde_json::from_value(Value::Object(self.params.clone()))
            .map_err(|err| PluginError::Params(err.to_string()))
    }

    /// The mask set of the `masks/generate` node this kernel stage needs.
    pub fn mask_set(&self) -> Result<crate::mask::MaskSet, PluginError> {
        let input = self
            .inputs_from("masks/generate")
            .find(|i| i.succeeded())
            .ok_or_else(|| {
                PluginError::Params(format!(
                    "`{}` needs a masks/generate node in `needs`",
                    self.stage
                ))
            })?;
        crate::mask::MaskSet::load(&input.dir)
    }

    /// The inputs produced by `plugin/stage` (or any stage named `stage`).
    pub fn inputs_from<'a>(
        &'a self,
        uses: &'a str,
    ) -> impl Iterator<Item = &'a InputArtifact> + 'a {
        self.inputs
            .iter()
            .filter(move |input| input.uses == uses || input.uses.rsplit('/').next() == Some(uses))
    }
}
