//! `datasets/lengths`: a document-length histogram (LongCA-bench's JSON format) from a histogram
//! file, the built-in synthetic histogram, or a dataset manifest whose shards are downloaded
//! (resumable, size-capped, pinned by SHA-256): corpus text that is counted, or a published
//! histogram used as it is.

mod corpus;
mod download;
mod manifest;
mod partial;
mod policy;

use std::path::{Path, PathBuf};
use std::time::Duration;

use attnbench_sdk::histogram::{Bucket, Histogram};
use attnbench_sdk::{
    write_atomically, Host, ParamSpec, ParamType, Plugin, PluginError, PluginManifest,
    StageRequest, StageSpec,
};
use serde::Deserialize;
use serde_json::{json, Value};

pub use download::{fetch, Fetched, Rules};
pub use manifest::DatasetManifest;

/// The file this stage writes, read by `masks/generate` with `distribution: input`.
pub const HISTOGRAM_FILE: &str = "histogram.json";

struct Datasets;

#[derive(Deserialize)]
struct Params {
    source: String,
    max_documents: u64,
    bucket_ratio: f64,
    retries: u32,
    downloads: String,
    tokenizer: String,
    max_bytes: u64,
    idle_timeout: f64,
    allow_unpinned: bool,
}

impl Plugin for Datasets {
    fn manifest() -> PluginManifest {
        PluginManifest::new("datasets", env!("CARGO_PKG_VERSION"))
            .description("Document-length histograms from histogram files, a synthetic default, or downloaded corpora.")
            .stage(
                StageSpec::new("lengths")
                    .doc("Writes a document-length histogram (LongCA-bench's JSON format) to histogram.json.")
                    .param(ParamSpec::new("source", ParamType::File).default("synthetic").doc(
                        "`synthetic` (built in: log-uniform 32–64K tokens, not a corpus), a LongCA-bench histogram .json, or a dataset manifest .yaml under datasets/.",
                    ))
                    .param(ParamSpec::new("max_documents", ParamType::Int).default(0).doc("Count at most this many documents of a corpus (0 = all)."))
                    .param(ParamSpec::new("bucket_ratio", ParamType::Float).default(1.25).doc("Corpus histograms: each bucket this much wider than the last (from 32 tokens)."))
                    .param(ParamSpec::new("tokenizer", ParamType::File).default("").doc(
                        "Count corpus documents in tokens of this Hugging Face tokenizer.json (default: whitespace-separated tokens, LongCA-bench's proxy).",
                    ))
                    .param(ParamSpec::new("retries", ParamType::Int).default(4).doc("Download attempts after the first, resuming where the last stopped."))
                    .param(ParamSpec::new("downloads", ParamType::String).default("").doc(
                        "Where shards are kept between runs (default: `downloads/` in attnbench's cache folder, else artifacts/downloads).",
                    ))
                    .param(ParamSpec::new("max_bytes", ParamType::Size).default("4G").doc(
                        "Refuse a shard larger than this (announced or sent); a shard's own `max_bytes:` in the manifest overrides it.",
                    ))
                    .param(ParamSpec::new("idle_timeout", ParamType::Float).default(60.0).doc(
                        "Seconds without a byte from the server before an attempt is given up (and retried).",
                    ))
                    .param(ParamSpec::new("allow_unpinned", ParamType::Bool).default(false).doc(
                        "Download shards whose manifest entry pins no sha256 (refused otherwise); the result records the sha256 each one had, to pin.",
                    ))
                    .output("histogram"),
            )
    }

    fn run(stage: &str, request: StageRequest, host: &Host) -> Result<Value, PluginError> {
        if stage != "lengths" {
            return Err(PluginError::UnknownStage {
                stage: stage.into(),
                known: "lengths".into(),
            });
        }
        let params: Params = request.params()?;
        if params.bucket_ratio.is_nan() || params.bucket_ratio <= 1.0 {
            return Err(PluginError::Params(format!(
                "bucket_ratio must be greater than 1, got {}",
                params.bucket_ratio
            )));
        }
        if params.max_bytes == 0 {
            return Err(PluginError::Params(
                "max_bytes must be more than 0 (a size such as 4G)".into(),
            ));
        }
        if !params.idle_timeout.is_finite() || params.idle_timeout <= 0.0 {
            return Err(PluginError::Params(format!(
                "idle_timeout must be a positive number of seconds, got {}",
                params.idle_timeout
            )));
        }
        let (histogram, mut summary) = match params.source.as_str() {
            "synthetic" => (Histogram::synthetic(), json!({"source": "synthetic"})),
            path if path.ends_with(".yaml") || path.ends_with(".yml") => {
                from_manifest(Path::new(path), &params, host)?
            }
            path => {
                let text = std::fs::read_to_string(path)
                    .map_err(|err| PluginError::Params(format!("source {path}: {err}")))?;
                let histogram = Histogram::from_longca_json(&text)
                    .map_err(|err| PluginError::Params(format!("source {path}: {err}")))?;
                (histogram, json!({"source": path}))
            }
        };
        write_atomically(
            &request.output_dir,
            HISTOGRAM_FILE,
            histogram.to_longca_json().as_bytes(),
        )?;
        summary["buckets"] = json!(histogram.buckets.len());
        Ok(summary)
    }
}

fn downloads_dir(params: &Params, host: &Host) -> PathBuf {
    if !params.downloads.is_empty() {
        return PathBuf::from(&params.downloads);
    }
    host.cache_dir()
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("artifacts"))
        .join("downloads")
}

fn from_manifest(
    path: &Path,
    params: &Params,
    host: &Host,
) -> Result<(Histogram, Value), PluginError> {
    let manifest = DatasetManifest::load(path)?;
    if !params.allow_unpinned {
        if let Some(shard) = manifest.shards.iter().find(|s| s.sha256.is_none()) {
            return Err(PluginError::failed(format!(
                "dataset manifest {}: shard {} pins no sha256; add `sha256: <its 64 hex digits>` under its url (the publisher's checksum, e.g. the SHA256 of a Hugging Face file's Git LFS details), or set `allow_unpinned: true` on the stage to download it unverified and find the sha256 it had in the result",
                path.display(),
                shard.url
            )));
        }
    }
    let dir = downloads_dir(params, host);
    let fetch_shard = |shard: &manifest::Shard| {
        let rules = Rules {
            sha256: shard.sha256.as_deref(),
            retries: params.retries,
            max_bytes: shard.max_bytes().unwrap_or(params.max_bytes),
            idle_timeout: Duration::try_from_secs_f64(params.idle_timeout).unwrap_or(Duration::MAX),
            redirect_hosts: &manifest.redirect_hosts,
            manifest: path,
        };
        let fetched = fetch(&shard.url, &dir, &rules, host)?;
        let summary = json!({
            "url": shard.url,
            "final_url": fetched.final_url,
            "redirects": fetched.redirects,
            "downloaded": fetched.downloaded,
            "bytes": fetched.bytes,
            "sha256": fetched.sha256,
            "sha256_verified": shard.sha256.is_some(),
        });
        Ok::<_, PluginError>((fetched, summary))
    };
    if manifest.format == manifest::ShardFormat::Histogram {
        let (fetched, shard) = fetch_shard(&manifest.shards[0])?;
        let text = std::fs::read_to_string(&fetched.path)
            .map_err(|err| PluginError::io(&fetched.path, err))?;
        let histogram = Histogram::from_longca_json(&text).map_err(|err| {
            PluginError::failed(format!(
                "{}: {} is not a LongCA-bench histogram: {err}",
                path.display(),
                shard["url"]
            ))
        })?;
        let summary = json!({
            "source": path.display().to_string(),
            "dataset": manifest.name,
            "format": "histogram",
            "shards": [shard],
        });
        return Ok((histogram, summary));
    }
    let counter = if params.tokenizer.is_empty() {
        corpus::Counter::Whitespace
    } else {
        corpus::Counter::from_file(Path::new(&params.tokenizer))?
    };
    let mut lengths = Vec::new();
    let mut shards = Vec::new();
    for shard in &manifest.shards {
        if params.max_documents > 0 && lengths.len() as u64 >= params.max_documents {
            break;
        }
        let (fetched, mut summary) = fetch_shard(shard)?;
        let limit = if params.max_documents > 0 {
            params.max_documents - lengths.len() as u64
        } else {
            u64::MAX
        };
        let counted = corpus::count_tokens(&fetched.path, &manifest.text_field, &counter, limit)?;
        host.info(&format!("{}: {} documents", shard.url, counted.len()));
        summary["documents"] = json!(counted.len());
        shards.push(summary);
        lengths.extend(counted);
    }
    if lengths.is_empty() {
        return Err(PluginError::failed(format!(
            "{}: the shards hold no documents",
            path.display()
        )));
    }
    let histogram = bucket(&lengths, params.bucket_ratio);
    let tokens: u64 = lengths.iter().sum();
    lengths.sort_unstable();
    let summary = json!({
        "source": path.display().to_string(),
        "dataset": manifest.name,
        "counted_as": counter.describe(),
        "documents": lengths.len(),
        "tokens": tokens,
        "mean": tokens as f64 / lengths.len() as f64,
        "median": lengths[lengths.len() / 2],
        "max": lengths[lengths.len() - 1],
        "shards": shards,
    });
    Ok((histogram, summary))
}

/// A histogram of `lengths`: `[0, 32)`, then buckets each `ratio` times wider (multiples of 32),
/// up to the longest document. Empty buckets are left out.
pub fn bucket(lengths: &[u64], ratio: f64) -> Histogram {
    let longest = lengths.iter().copied().max().unwrap_or(0);
    let mut edges = vec![0u64, 32];
    while *edges.last().unwrap_or(&0) <= longest {
        let last = *edges.last().unwrap_or(&32);
        let next = (((last as f64 * ratio) / 32.0).ceil() as u64 * 32).max(last + 32);
        edges.push(next);
    }
    let mut counts = vec![0u64; edges.len() - 1];
    for &length in lengths {
        let index = edges.partition_point(|&e| e <= length) - 1;
        let last = counts.len() - 1;
        counts[index.min(last)] += 1;
    }
    let total = lengths.len() as f64;
    let buckets = counts
        .iter()
        .enumerate()
        .filter(|(_, &count)| count > 0)
        .map(|(i, &count)| Bucket {
            lo: edges[i],
            hi: edges[i + 1],
            weight: count as f64 / total,
        })
        .collect();
    Histogram { buckets }
}

attnbench_sdk::export_plugin!(Datasets);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_cover_every_length_once() {
        let lengths = [1, 31, 32, 100, 1000, 5000, 5000];
        let histogram = bucket(&lengths, 1.25);
        let total: f64 = histogram.buckets.iter().map(|b| b.weight).sum();
        assert!((total - 1.0).abs() < 1e-12);
        for length in lengths {
            assert!(
                histogram
                    .buckets
                    .iter()
                    .any(|b| b.lo <= length && length < b.hi),
                "{length}"
            );
        }
        assert_eq!(
            histogram.buckets[0],
            Bucket {
                lo: 0,
                hi: 32,
                weight: 2.0 / 7.0
            }
        );
    }
}
