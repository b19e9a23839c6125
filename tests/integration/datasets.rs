//! Corpus downloads against a real HTTP server on loopback, and the histograms they give.

mod hostile;

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};

use attnbench_tests::http::HttpServer;
use attnbench_tests::{stderr, Sandbox};
use sha2::{Digest, Sha256};

/// 300 JSON-lines documents of known whitespace-token lengths, zstd-compressed.
fn corpus() -> (Vec<u8>, Vec<u64>) {
    let mut text = String::new();
    let mut lengths = Vec::new();
    for i in 0..300u64 {
        let words = 1 + (i * 37) % 700;
        lengths.push(words);
        let body: Vec<String> = (0..words).map(|w| format!("w{w}")).collect();
        text.push_str(&serde_json::json!({"text": body.join(" "), "meta": {"i": i}}).to_string());
        text.push('\n');
    }
    let compressed = ruzstd::encoding::compress_to_vec(
        text.as_bytes(),
        ruzstd::encoding::CompressionLevel::Fastest,
    );
    (compressed, lengths)
}

fn sha256(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn pipeline(sandbox: &Sandbox, url: &str, sha: &str) -> String {
    sandbox.write(
        "corpus.yaml",
        &format!("name: test-corpus\nshards:\n  - url: {url}\n    sha256: {sha}\n"),
    );
    sandbox.write(
        "p.yaml",
        "name: corpus\nseed: 42\nstages:\n  lengths:\n    uses: datasets/lengths\n    with: {source: corpus.yaml, retries: 2}\n  masks:\n    uses: masks/generate\n    needs: [lengths]\n    with: {mask: causal_document, seqlen: 8k, distribution: input}\n",
    );
    "p.yaml".to_string()
}

/// Every file under `dir` that could hold data (lock files only serialise downloads).
fn data_files(dir: &Path) -> Vec<PathBuf> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let path = entry.path();
        if path.is_dir() {
            found.extend(data_files(&path));
        } else if !path.to_string_lossy().ends_with(".lock") {
            found.push(path);
        }
    }
    found
}

fn node<'a>(record: &'a serde_json::Value, id: &str) -> &'a serde_json::Value {
    record["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|n| n["id"] == id)
        .unwrap()
}

fn result_of(node: &serde_json::Value) -> serde_json::Value {
    let entry = std::path::Path::new(node["artifact"].as_str().unwrap())
        .parent()
        .unwrap()
        .join("result.json");
    serde_json::from_str(&std::fs::read_to_string(entry).unwrap()).unwrap()
}

#[test]
fn a_corpus_is_downloaded_counted_and_feeds_the_masks() {
    let (shard, lengths) = corpus();
    let server = HttpServer::start(
        HashMap::from([("shard.jsonl.zst".to_string(), shard.clone())]),
        HashSet::new(),
    );
    let sandbox = Sandbox::new();
    let p = pipeline(&sandbox, &server.url("shard.jsonl.zst"), &sha256(&shard));
    let output = sandbox.run(&["run", &p]);
    assert!(output.status.success(), "{}", stderr(&output));
    let record = sandbox.last_record();
    let summary = result_of(node(&record, "lengths"));
    assert_eq!(summary["documents"], 300);
    assert_eq!(summary["tokens"], lengths.iter().sum::<u64>());
    assert_eq!(summary["max"], *lengths.iter().max().unwrap());
    let masks = result_of(node(&record, "masks"));
    let documents: Vec<u64> = masks["documents"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d.as_u64().unwrap())
        .collect();
    assert_eq!(documents.iter().sum::<u64>(), 8192);
    assert!(
        documents.iter().all(|&d| d <= 704),
        "documents come from the corpus histogram: {documents:?}"
    );
    assert_eq!(server.seen().len(), 1);

    // A second pipeline with the same shard reuses the download.
    let rerun = sandbox.run(&["run", &p, "--set", "stages.lengths.with.bucket_ratio=1.5"]);
    assert!(rerun.status.success(), "{}", stderr(&rerun));
    assert_eq!(
        server.seen().len(),
        1,
        "the verified shard was not fetched again"
    );
}

#[test]
fn downloads_are_kept_in_the_cache_the_run_was_given() {
    // The cache folder reaches the plugin from the host, so `--cache` places the downloads as
    // well as the artifacts, with no environment variable set.
    let (shard, _) = corpus();
    let server = HttpServer::start(
        HashMap::from([("shard.jsonl.zst".to_string(), shard.clone())]),
        HashSet::new(),
    );
    let sandbox = Sandbox::new();
    let p = pipeline(&sandbox, &server.url("shard.jsonl.zst"), &sha256(&shard));
    let output = sandbox
        .command(&["run", &p, "--cache", "elsewhere"])
        .env_remove("ATTNBENCH_CACHE")
        .output()
        .unwrap();
    assert!(output.status.success(), "{}", stderr(&output));
    let kept = data_files(&sandbox.path().join("elsewhere").join("downloads"));
    assert_eq!(kept.len(), 1, "the verified shard: {kept:?}");
    assert!(
        !sandbox.path().join("artifacts").exists(),
        "nothing in the default cache"
    );
}

#[test]
fn a_download_cut_in_the_middle_resumes_with_a_range_request() {
    let (shard, _) = corpus();
    let server = HttpServer::start(
        HashMap::from([("cut.jsonl.zst".to_string(), shard.clone())]),
        HashSet::from(["cut.jsonl.zst".to_string()]),
    );
    let sandbox = Sandbox::new();
    let p = pipeline(&sandbox, &server.url("cut.jsonl.zst"), &sha256(&shard));
    let output = sandbox.run(&["run", &p]);
    assert!(output.status.success(), "{}", stderr(&output));
    let seen = server.seen();
    assert_eq!(seen.len(), 2, "{seen:?}");
    assert_eq!(seen[0].range, None);
    let resumed_at = seen[1]
        .range
        .as_deref()
        .and_then(|r| r.strip_prefix("bytes="))
        .and_then(|r| r.trim_end_matches('-').parse::<usize>().ok());
    assert_eq!(resumed_at, Some(shard.len() / 2), "{seen:?}");
    assert_eq!(
        result_of(node(&sandbox.last_record(), "lengths"))["documents"],
        300
    );
}

#[test]
fn a_checksum_mismatch_fails_and_leaves_nothing_that_looks_valid() {
    let (shard, _) = corpus();
    let server = HttpServer::start(
        HashMap::from([("bad.jsonl.zst".to_string(), shard)]),
        HashSet::new(),
    );
    let sandbox = Sandbox::new();
    let p = pipeline(&sandbox, &server.url("bad.jsonl.zst"), &"0".repeat(64));
    let output = sandbox.run(&["run", &p]);
    assert_eq!(output.status.code(), Some(1));
    let record = sandbox.last_record();
    let lengths = node(&record, "lengths");
    assert_eq!(lengths["status"], "error");
    assert!(
        lengths["error"]
            .as_str()
            .unwrap()
            .contains("checksum mismatch"),
        "{lengths}"
    );
    assert_eq!(node(&record, "masks")["status"], "skipped");
    let downloads = data_files(&sandbox.cache().join("downloads"));
    assert!(
        downloads.is_empty(),
        "no shard or partial file is left: {downloads:?}"
    );
    assert!(lengths["artifact"].is_null(), "no cache entry");
}

#[test]
fn a_missing_shard_is_one_clear_sentence() {
    let server = HttpServer::start(HashMap::new(), HashSet::new());
    let sandbox = Sandbox::new();
    let p = pipeline(&sandbox, &server.url("nowhere.jsonl"), &"0".repeat(64));
    let output = sandbox.run(&["run", &p]);
    assert_eq!(output.status.code(), Some(1));
    let record = sandbox.last_record();
    let error = node(&record, "lengths")["error"]
        .as_str()
        .unwrap()
        .to_string();
    assert_eq!(
        error,
        format!(
            "download of {} failed: the server answered 404 Not Found",
            server.url("nowhere.jsonl")
        )
    );
}

#[test]
fn histograms_in_longca_format_and_the_synthetic_default_are_accepted() {
    let sandbox = Sandbox::new();
    sandbox.write("h.json", r#"{"[1,10)": 0.5, "[10,100)": 0.5}"#);
    sandbox.write("bad.json", r#"{"[1,10)": "lots"}"#);
    sandbox.write(
        "p.yaml",
        "stages:\n  lengths:\n    uses: datasets/lengths\n    matrix: {source: [synthetic, h.json, bad.json]}\n",
    );
    let output = sandbox.run(&["run", "p.yaml"]);
    assert_eq!(output.status.code(), Some(1));
    let statuses = sandbox.statuses();
    assert_eq!(statuses["lengths[source=synthetic]"], "ok");
    let record = sandbox.last_record();
    let bad = record["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|n| n["status"] == "error")
        .unwrap();
    assert!(
        bad["error"]
            .as_str()
            .unwrap()
            .contains("the weight must be a non-negative number"),
        "{bad}"
    );
    assert_eq!(
        record["nodes"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|n| n["status"] == "ok")
            .count(),
        2
    );
}

#[test]
fn documents_can_be_counted_with_a_tokenizer_json() {
    // Every document is "w0, w1, …" : n words, n − 1 commas.
    let mut text = String::new();
    for i in 0..50u64 {
        let words: Vec<String> = (0..=i).map(|w| format!("w{w}")).collect();
        text.push_str(&serde_json::json!({"text": words.join(", ")}).to_string());
        text.push('\n');
    }
    let shard = text.into_bytes();
    let server = HttpServer::start(
        HashMap::from([("p.jsonl".to_string(), shard.clone())]),
        HashSet::new(),
    );
    let sandbox = Sandbox::new();
    // A word-level tokenizer whose pre-tokenizer splits punctuation off: commas are tokens.
    sandbox.write(
        "tokenizer.json",
        r#"{"version": "1.0", "truncation": null, "padding": null, "added_tokens": [], "normalizer": null,
            "pre_tokenizer": {"type": "BertPreTokenizer"}, "post_processor": null, "decoder": null,
            "model": {"type": "WordLevel", "vocab": {"[UNK]": 0, ",": 1}, "unk_token": "[UNK]"}}"#,
    );
    sandbox.write(
        "corpus.yaml",
        &format!(
            "name: punctuated\nshards:\n  - url: {}\n    sha256: {}\n",
            server.url("p.jsonl"),
            sha256(&shard)
        ),
    );
    sandbox.write(
        "p.yaml",
        "stages:\n  words:\n    uses: datasets/lengths\n    with: {source: corpus.yaml}\n  tokens:\n    uses: datasets/lengths\n    with: {source: corpus.yaml, tokenizer: tokenizer.json}\n",
    );
    let output = sandbox.run(&["run", "p.yaml"]);
    assert!(output.status.success(), "{}", stderr(&output));
    let record = sandbox.last_record();
    let words = result_of(node(&record, "words"));
    let tokens = result_of(node(&record, "tokens"));
    let n: u64 = (1..=50).sum();
    assert_eq!(words["tokens"], n, "whitespace: one token per word");
    assert_eq!(
        tokens["tokens"],
        n + (n - 50),
        "the tokenizer also counts the commas"
    );
    assert_eq!(tokens["counted_as"], "tokens of the given tokenizer.json");
}

/// The manifest of a published histogram (`format: histogram`), with its URL and sha256.
fn histogram_manifest(sandbox: &Sandbox, url: &str, sha: &str) {
    sandbox.write(
        "histogram.yaml",
        &format!("name: published\nformat: histogram\nshards:\n  - url: {url}\n    sha256: {sha}\n    max_bytes: 1M\n"),
    );
    sandbox.write(
        "p.yaml",
        "name: published\nseed: 42\nstages:\n  lengths:\n    uses: datasets/lengths\n    with: {source: histogram.yaml, retries: 0}\n  masks:\n    uses: masks/generate\n    needs: [lengths]\n    with: {mask: causal_document, seqlen: 16k, distribution: input}\n",
    );
}

#[test]
fn a_published_histogram_is_fetched_pinned_and_drawn_from() {
    let histogram = br#"{"[0,32)": 0.25, "[32,1024)": 0.5, "[1024,4096)": 0.25}"#.to_vec();
    let server = HttpServer::start(
        HashMap::from([("h.json".to_string(), histogram.clone())]),
        HashSet::new(),
    );
    let sandbox = Sandbox::new();
    histogram_manifest(&sandbox, &server.url("h.json"), &sha256(&histogram));
    let run = sandbox.run(&["run", "p.yaml", "-q"]);
    assert!(run.status.success(), "{}", stderr(&run));
    let record = sandbox.last_record();
    let lengths = result_of(node(&record, "lengths"));
    assert_eq!(lengths["format"], "histogram", "{lengths}");
    assert_eq!(lengths["shards"][0]["sha256_verified"], true, "{lengths}");
    let masks = result_of(node(&record, "masks"));
    let documents = masks["documents"].as_array().unwrap();
    assert!(
        documents.len() > 4 && documents.iter().all(|d| d.as_u64().unwrap() < 4096 + 16384),
        "documents drawn from the published histogram: {masks}"
    );

    // The same URL serving other bytes is refused, not drawn from.
    let other = Sandbox::new();
    histogram_manifest(&other, &server.url("h.json"), &"0".repeat(64));
    let run = other.run(&["run", "p.yaml", "-q"]);
    assert_eq!(run.status.code(), Some(1), "{}", stderr(&run));
    let error = node(&other.last_record(), "lengths")["error"].to_string();
    assert!(error.contains("sha256"), "{error}");
}

/// The shipped manifests of LongCA-bench's histograms pin the files the paper's code holds: each
/// is served from loopback with the copy beside the project (when there is one) and must pass.
#[test]
fn the_shipped_longca_manifests_pin_the_papers_histograms() {
    let data = attnbench_tests::workspace_root().join("../shared/data/longca-distributions");
    if !data.is_dir() {
        eprintln!(
            "{} is not here: nothing to check the pins against",
            data.display()
        );
        return;
    }
    let mut checked = 0;
    for name in ["pile", "prolong64k", "prolong512k"] {
        let bytes = std::fs::read(data.join(format!("{name}.json"))).unwrap();
        let manifest = std::fs::read_to_string(
            attnbench_tests::workspace_root().join(format!("datasets/longca-{name}.yaml")),
        )
        .unwrap();
        let url = manifest
            .lines()
            .find_map(|l| l.trim().strip_prefix("- url: "))
            .unwrap()
            .to_string();
        let file = url.rsplit('/').next().unwrap().to_string();
        let server = HttpServer::start(HashMap::from([(file.clone(), bytes)]), HashSet::new());
        let sandbox = Sandbox::new();
        sandbox.write(
            "histogram.yaml",
            &manifest.replace(&url, &server.url(&file)),
        );
        sandbox.write(
            "p.yaml",
            "stages:\n  lengths:\n    uses: datasets/lengths\n    with: {source: histogram.yaml, retries: 0}\n",
        );
        let run = sandbox.run(&["run", "p.yaml", "-q"]);
        assert!(run.status.success(), "longca-{name}.yaml: {}", stderr(&run));
        checked += 1;
    }
    assert_eq!(checked, 3);
}
