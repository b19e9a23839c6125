//! Dataset manifests (`datasets/*.yaml`): where a corpus's shards live and how to read them, or
//! where a published document-length histogram lives.

use std::path::Path;

use attnbench_sdk::{parse_size, PluginError};
use serde::Deserialize;

use crate::policy::check_host_pattern;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DatasetManifest {
    pub name: String,
    #[serde(default)]
    pub description: String,
    /// The JSON field holding a document's text.
    #[serde(default = "text_field")]
    pub text_field: String,
    /// Hosts other than a shard's own origin that its URL may redirect to (`cdn.example.org`,
    /// `cdn.example.org:8443`, `*.example.org`): a file host that serves through a CDN.
    #[serde(default)]
    pub redirect_hosts: Vec<String>,
    /// What the shards hold.
    #[serde(default)]
    pub format: ShardFormat,
    pub shards: Vec<Shard>,
}

/// What a manifest's shards hold.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ShardFormat {
    /// Corpus text, one JSON document a line (`.jsonl` or `.jsonl.zst`), counted into a histogram.
    #[default]
    Jsonl,
    /// One document-length histogram in LongCA-bench's JSON format, used as it is: a paper's
    /// published distribution, fetched by URL and pinned by SHA-256.
    Histogram,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Shard {
    /// `.jsonl` or `.jsonl.zst`.
    pub url: String,
    /// Hex SHA-256 of the shard; downloads that do not match are removed.
    #[serde(default)]
    pub sha256: Option<String>,
    /// The most bytes this shard may have (`600M`, `16G`); overrides the stage's `max_bytes`.
    #[serde(default)]
    pub max_bytes: Option<SizeText>,
}

/// A size as YAML gives it: a plain integer or text with a suffix (`16G`).
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum SizeText {
    Bytes(u64),
    Text(String),
}

impl Shard {
    /// The shard's own size limit, if the manifest sets one (checked by [`DatasetManifest::load`]).
    pub fn max_bytes(&self) -> Option<u64> {
        match self.max_bytes.as_ref()? {
            SizeText::Bytes(bytes) => Some(*bytes),
            SizeText::Text(text) => parse_size(text).ok(),
        }
    }
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
        if manifest.format == ShardFormat::Histogram && manifest.shards.len() != 1 {
            return Err(PluginError::Params(format!(
                "dataset manifest {}: `format: histogram` takes exactly one shard (the histogram's URL), not {}",
                path.display(),
                manifest.shards.len()
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
            if let Some(SizeText::Text(text)) = &shard.max_bytes {
                parse_size(text).map_err(|err| {
                    PluginError::Params(format!(
                        "dataset manifest {}: max_bytes of {}: {err}",
                        path.display(),
                        shard.url
                    ))
                })?;
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
        for pattern in &manifest.redirect_hosts {
            check_host_pattern(pattern).map_err(|err| {
                PluginError::Params(format!(
                    "dataset manifest {}: redirect_hosts: {err}",
                    path.display()
                ))
            })?;
        }
        Ok(manifest)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_shipped_manifests_load() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../datasets");
        let mut loaded = 0;
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().and_then(|e| e.to_str()) == Some("yaml") {
                let manifest = DatasetManifest::load(&path).unwrap_or_else(|err| panic!("{err}"));
                assert!(!manifest.shards.is_empty());
                loaded += 1;
            }
        }
        assert!(loaded > 0);
    }

    #[test]
    fn bad_fields_are_one_clear_sentence() {
        let dir = std::env::temp_dir().join(format!("attnbench-manifest-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("m.yaml");
        let cases = [
            (
                "redirect_hosts: [\"https://cdn.example.org/\"]\n",
                "redirect_hosts: `https://cdn.example.org/` is not a host",
            ),
            ("", ""),
        ];
        for (extra, expected) in cases {
            std::fs::write(
                &path,
                format!("name: m\n{extra}shards:\n  - url: https://example.org/a.jsonl\n    max_bytes: 2G\n"),
            )
            .unwrap();
            match DatasetManifest::load(&path) {
                Ok(manifest) => {
                    assert!(expected.is_empty(), "{expected}");
                    assert_eq!(manifest.shards[0].max_bytes(), Some(2 << 30));
                }
                Err(err) => assert!(
                    !expected.is_empty() && err.to_string().contains(expected),
                    "{err}"
                ),
            }
        }
        std::fs::write(
            &path,
            "name: m\nshards:\n  - url: https://example.org/a.jsonl\n    max_bytes: lots\n",
        )
        .unwrap();
        let err = DatasetManifest::load(&path).unwrap_err().to_string();
        assert!(
            err.contains("max_bytes of https://example.org/a.jsonl")
                && err.contains("suffix k, M or G"),
            "{err}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
