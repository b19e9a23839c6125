//! Dataset manifests (`datasets/*.yaml`): where a corpus's shards live and how to read them.

use std::path::Path;

use attnbench_sdk::PluginError;
use serde::Deserialize;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DatasetManifest {
    pub name: String,
    #[serde(default)]
    pub description: String,
    /// The JSON field holding a document's text.
    #[serde(default = "text_field")]
    pub text_field: String,
    pub shards: Vec<Shard>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Shard {
    /// `.jsonl` or `.jsonl.zst`.
    pub url: String,
    /// Hex SHA-256 of the shard; downloads that do not match are removed.
    #[serde(default)]
    pub sha256: Option<String>,
}

fn text_field() -> String {
    "text".into()
}

impl DatasetManifest {
    pub fn load(path: &Path) -> Result<DatasetManifest, PluginError> {
        let text = std::fs::read_to_string(path).map_err(|err| {
            PluginError::Params(format!("dataset manifest {}: {err}", path.display()))
        })?;
        let manifest: DatasetManifest = serde_norway::from_str(&text).map_err(|err| {
            PluginError::Params(format!("dataset manifest {}: {err}", path.display()))
        })?;
        if manifest.shards.is_empty() {
            return Err(PluginError::Params(format!(
                "dataset manifest {} lists no shards",
                path.display()
            )));
        }
        for shard in &manifest.shards {
            if !(shard.url.starts_with("http://") || shard.url.starts_with("https://")) {
                return Err(PluginError::Params(format!(
                    "dataset manifest {}: `{}` is not an http(s) URL",
                    path.display(),
                    shard.url
                )));
            }
            if let Some(sha) = &shard.sha256 {
                if sha.len() != 64 || !sha.chars().all(|c| c.is_ascii_hexdigit()) {
                    return Err(PluginError::Params(format!(
                        "dataset manifest {}: sha256 of {} must be 64 hex digits",
                        path.display(),
                        shard.url
                    )));
                }
            }
        }
        Ok(manifest)
    }
}
