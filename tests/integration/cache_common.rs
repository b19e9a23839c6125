//! What the cache tests share: a small pipeline and ways to look into a sandbox's cache.

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

/// Writes [`CHAIN`] into the sandbox and runs it once; returns the pipeline's path.
pub fn run_chain(sandbox: &Sandbox) -> String {
    let pipeline = sandbox.write("chain.yaml", CHAIN);
    let pipeline = pipeline.to_str().unwrap().to_string();
    let run = sandbox.run(&["run", "-q", &pipeline]);
    assert!(run.status.success(), "{}", attnbench_tests::stderr(&run));
    pipeline
}

/// Runs `pipeline` with one job and kills it outright (SIGKILL) once the cache holds `entries`
/// entries; returns how many it holds then.
pub fn kill_after_entries(sandbox: &Sandbox, pipeline: &str, entries: usize) -> usize {
    let mut child = sandbox
        .command(&["run", "-q", "-j", "1", pipeline])
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while entry_count(sandbox) < entries {
        assert!(
            std::time::Instant::now() < deadline,
            "the run made no progress"
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    // SAFETY: kills the child this test started.
    unsafe { libc::kill(child.id() as i32, libc::SIGKILL) };
    let _ = child.wait();
    entry_count(sandbox)
}

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
