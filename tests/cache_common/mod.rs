//! What the cache tests share: a small pipeline and ways to look into a sandbox's cache.

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use attnbench_tests::Sandbox;

pub const CHAIN: &str = r#"
name: chain
seed: 3
stages:
  a:
    uses: testkit/echo
    matrix: {size: [1k, 2k]}
  b:
    uses: testkit/echo
    needs: [a]
    with: {value: first}
  c:
    uses: testkit/echo
    needs: {b: all}
"#;

pub fn count(statuses: &BTreeMap<String, String>, status: &str) -> usize {
    statuses.values().filter(|s| *s == status).count()
}

pub fn entry_count(sandbox: &Sandbox) -> usize {
    let Ok(shards) = std::fs::read_dir(sandbox.cache().join("cache")) else {
        return 0;
    };
    shards
        .flatten()
        .map(|shard| {
            std::fs::read_dir(shard.path())
                .map(|d| d.count())
                .unwrap_or(0)
        })
        .sum()
}

/// Every file under `dir`.
pub fn walk_files(dir: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap().flatten() {
        if entry.path().is_dir() {
            files.extend(walk_files(&entry.path()));
        } else {
            files.push(entry.path());
        }
    }
    files
}

pub fn run_folders(sandbox: &Sandbox) -> Vec<PathBuf> {
    std::fs::read_dir(sandbox.cache().join("runs"))
        .map(|d| {
            d.flatten()
                .map(|e| e.path())
                .filter(|p| p.is_dir())
                .collect()
        })
        .unwrap_or_default()
}

pub fn artifact_of(record: &serde_json::Value, id: &str) -> PathBuf {
    PathBuf::from(
        attnbench_tests::node(record, id)["artifact"]
            .as_str()
            .unwrap(),
    )
}
