//! The downloader against a server that cannot be trusted: endless or oversized bodies, stalls,
//! redirects elsewhere, resumes answered with the wrong bytes, links planted in the cache, and
//! shards nobody pinned.

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use attnbench_tests::http::{Behaviour, HttpServer};
use attnbench_tests::{workspace_root, Sandbox};
use sha2::{Digest, Sha256};

use super::{corpus, data_files, node, result_of, sha256};

/// A manifest of one shard, pinned to `sha` when given.
fn manifest(url: &str, sha: Option<&str>, extra: &str) -> String {
    let pin = sha
        .map(|s| format!("    sha256: {s}\n"))
        .unwrap_or_default();
    format!("name: hostile\n{extra}shards:\n  - url: {url}\n{pin}")
}

/// Writes `corpus.yaml` and a pipeline of one `datasets/lengths` node reading it.
fn setup(sandbox: &Sandbox, manifest: &str, with: &str) {
    sandbox.write("corpus.yaml", manifest);
    sandbox.write(
        "p.yaml",
        &format!(
            "stages:\n  lengths:\n    uses: datasets/lengths\n    with: {{source: corpus.yaml, {with}}}\n"
        ),
    );
}

/// A server with one hostile route serving `shard`, and a sandbox whose manifest pins that
/// shard's sha256; `with` are the stage's parameters.
fn pinned_shard(
    name: &str,
    behaviour: Behaviour,
    shard: &[u8],
    with: &str,
) -> (HttpServer, Sandbox, String) {
    let server = HttpServer::serve(HashMap::from([(name.to_string(), behaviour)]));
    let sandbox = Sandbox::new();
    let url = server.url(name);
    setup(&sandbox, &manifest(&url, Some(&sha256(shard)), ""), with);
    (server, sandbox, url)
}

struct Finished {
    code: Option<i32>,
    stderr: String,
    elapsed: Duration,
}

fn start(sandbox: &Sandbox) -> Child {
    let log = |name: &str| std::fs::File::create(sandbox.path().join(name)).expect("a log file");
    sandbox
        .command(&["run", "p.yaml"])
        .stdout(Stdio::from(log("stdout.log")))
        .stderr(Stdio::from(log("stderr.log")))
        .spawn()
        .expect("attnbench starts")
}

/// Waits for `child`, killing it (and failing the test) if it is not done within `limit`.
fn finish(sandbox: &Sandbox, mut child: Child, started: Instant, limit: Duration) -> Finished {
    let stderr = || std::fs::read_to_string(sandbox.path().join("stderr.log")).unwrap_or_default();
    loop {
        if let Some(status) = child.try_wait().expect("wait for attnbench") {
            return Finished {
                code: status.code(),
                stderr: stderr(),
                elapsed: started.elapsed(),
            };
        }
        if started.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "attnbench was still running after {limit:?} and was killed; stderr:\n{}",
                stderr()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn run_within(sandbox: &Sandbox, limit: Duration) -> Finished {
    let started = Instant::now();
    let child = start(sandbox);
    finish(sandbox, child, started, limit)
}

fn lengths_error(sandbox: &Sandbox) -> String {
    let record = sandbox.last_record();
    let lengths = node(&record, "lengths");
    assert_eq!(lengths["status"], "error", "{lengths}");
    lengths["error"].as_str().unwrap_or_default().to_string()
}

/// The name the downloader gives `url` in the downloads folder.
fn local_name(url: &str) -> String {
    let prefix: String = Sha256::digest(url.as_bytes())
        .iter()
        .take(6)
        .map(|b| format!("{b:02x}"))
        .collect();
    format!("{prefix}-{}", url.rsplit('/').next().unwrap_or_default())
}

fn downloads(sandbox: &Sandbox) -> PathBuf {
    sandbox.cache().join("downloads")
}

#[test]
fn an_endless_response_is_cut_off_at_max_bytes() {
    let server = HttpServer::serve(HashMap::from([(
        "endless.jsonl".to_string(),
        Behaviour::Endless,
    )]));
    let sandbox = Sandbox::new();
    let url = server.url("endless.jsonl");
    setup(
        &sandbox,
        &manifest(&url, Some(&"0".repeat(64)), ""),
        "max_bytes: 1M, retries: 0",
    );
    let run = run_within(&sandbox, Duration::from_secs(60));
    assert_eq!(run.code, Some(1), "{}", run.stderr);
    let error = lengths_error(&sandbox);
    assert!(
        error.contains(&url) && error.contains("max_bytes") && error.contains("1M"),
        "the error names the URL, the limit and how to raise it: {error}"
    );
    let left: u64 = data_files(&downloads(&sandbox))
        .iter()
        .map(|f| std::fs::metadata(f).map(|m| m.len()).unwrap_or(0))
        .sum();
    assert_eq!(left, 0, "the oversized partial download was removed");
}

#[test]
fn a_content_length_past_max_bytes_is_refused_before_reading() {
    let server = HttpServer::serve(HashMap::from([(
        "huge.jsonl".to_string(),
        Behaviour::Huge(10 << 30),
    )]));
    let sandbox = Sandbox::new();
    let url = server.url("huge.jsonl");
    setup(
        &sandbox,
        &manifest(&url, Some(&"0".repeat(64)), ""),
        "max_bytes: 1M, retries: 0",
    );
    let run = run_within(&sandbox, Duration::from_secs(60));
    assert_eq!(run.code, Some(1), "{}", run.stderr);
    let error = lengths_error(&sandbox);
    assert!(
        error.contains(&url) && error.contains("10G") && error.contains("max_bytes = 1M"),
        "{error}"
    );
    assert!(data_files(&downloads(&sandbox)).is_empty());
}

#[test]
fn a_stalled_server_fails_after_the_idle_timeout() {
    let (shard, _) = corpus();
    let (_server, sandbox, url) = pinned_shard(
        "stall.jsonl.zst",
        Behaviour::Stall(shard.clone()),
        &shard,
        "idle_timeout: 0.5, retries: 0",
    );
    let run = run_within(&sandbox, Duration::from_secs(30));
    assert_eq!(run.code, Some(1), "{}", run.stderr);
    assert!(run.elapsed < Duration::from_secs(15), "{:?}", run.elapsed);
    let error = lengths_error(&sandbox);
    assert!(
        error.contains(&url) && error.contains("idle_timeout"),
        "{error}"
    );
}

#[test]
fn sigterm_stops_a_download_from_a_stalled_server() {
    let (shard, _) = corpus();
    let server = HttpServer::serve(HashMap::from([(
        "stall.jsonl.zst".to_string(),
        Behaviour::Stall(shard.clone()),
    )]));
    let sandbox = Sandbox::new();
    let url = server.url("stall.jsonl.zst");
    // The idle timeout is far away: only the stop request can end this download in time.
    setup(
        &sandbox,
        &manifest(&url, Some(&sha256(&shard)), ""),
        "idle_timeout: 600, retries: 0",
    );
    let started = Instant::now();
    let child = start(&sandbox);
    while server.seen().is_empty() && started.elapsed() < Duration::from_secs(30) {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(!server.seen().is_empty(), "the download never started");
    std::thread::sleep(Duration::from_millis(300));
    // SAFETY: signalling a child this test started and has not reaped.
    unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
    let stopped = Instant::now();
    let run = finish(&sandbox, child, started, Duration::from_secs(60));
    assert!(
        stopped.elapsed() < Duration::from_secs(8),
        "the run took {:?} to stop after SIGTERM",
        stopped.elapsed()
    );
    assert_ne!(run.code, Some(0), "{}", run.stderr);
    let error = lengths_error(&sandbox);
    assert!(error.contains("interrupted"), "{error}");
}

#[test]
fn a_redirect_to_another_origin_is_refused() {
    let (shard, _) = corpus();
    let elsewhere = HttpServer::start(
        HashMap::from([("shard.jsonl.zst".to_string(), shard.clone())]),
        Default::default(),
    );
    let target = elsewhere.url("shard.jsonl.zst");
    let (_server, sandbox, url) = pinned_shard(
        "moved.jsonl.zst",
        Behaviour::Redirect(target.clone()),
        &shard,
        "retries: 0",
    );
    let run = run_within(&sandbox, Duration::from_secs(60));
    assert_eq!(run.code, Some(1), "{}", run.stderr);
    let error = lengths_error(&sandbox);
    assert!(
        error.contains(&url) && error.contains(&target) && error.contains("redirect_hosts"),
        "the error names both URLs and the opt-in: {error}"
    );
    assert!(
        elsewhere.seen().is_empty(),
        "the other origin was never asked"
    );
}

#[test]
fn a_redirect_within_the_origin_is_followed_and_recorded() {
    let (shard, _) = corpus();
    let server = HttpServer::serve(HashMap::from([
        (
            "old.jsonl.zst".to_string(),
            Behaviour::Redirect("/new.jsonl.zst".to_string()),
        ),
        ("new.jsonl.zst".to_string(), Behaviour::File(shard.clone())),
    ]));
    let sandbox = Sandbox::new();
    let url = server.url("old.jsonl.zst");
    setup(
        &sandbox,
        &manifest(&url, Some(&sha256(&shard)), ""),
        "retries: 0",
    );
    let run = run_within(&sandbox, Duration::from_secs(60));
    assert_eq!(run.code, Some(0), "{}", run.stderr);
    let summary = result_of(node(&sandbox.last_record(), "lengths"));
    let recorded = &summary["shards"][0];
    assert_eq!(recorded["url"], url.as_str());
    assert_eq!(recorded["final_url"], server.url("new.jsonl.zst").as_str());
    assert_eq!(
        recorded["redirects"],
        serde_json::json!([server.url("new.jsonl.zst")]),
        "{summary}"
    );
    assert_eq!(recorded["documents"], 300);
}

#[test]
fn a_redirect_to_a_host_the_manifest_allows_is_followed() {
    let (shard, _) = corpus();
    let mirror = HttpServer::start(
        HashMap::from([("shard.jsonl.zst".to_string(), shard.clone())]),
        Default::default(),
    );
    let target = mirror.url("shard.jsonl.zst");
    let server = HttpServer::serve(HashMap::from([(
        "moved.jsonl.zst".to_string(),
        Behaviour::Redirect(target.clone()),
    )]));
    let sandbox = Sandbox::new();
    let url = server.url("moved.jsonl.zst");
    let allow = format!("redirect_hosts: [\"{}\"]\n", mirror.addr);
    setup(
        &sandbox,
        &manifest(&url, Some(&sha256(&shard)), &allow),
        "retries: 0",
    );
    let run = run_within(&sandbox, Duration::from_secs(60));
    assert_eq!(run.code, Some(0), "{}", run.stderr);
    let summary = result_of(node(&sandbox.last_record(), "lengths"));
    assert_eq!(
        summary["shards"][0]["redirects"],
        serde_json::json!([target])
    );
}

#[test]
fn a_206_with_the_wrong_content_range_restarts_from_zero() {
    let (shard, _) = corpus();
    let (server, sandbox, _url) = pinned_shard(
        "range.jsonl.zst",
        Behaviour::WrongRange(shard.clone()),
        &shard,
        "retries: 3",
    );
    let run = run_within(&sandbox, Duration::from_secs(60));
    assert_eq!(run.code, Some(0), "{}", run.stderr);
    let ranges: Vec<Option<String>> = server.seen().into_iter().map(|s| s.range).collect();
    assert_eq!(
        ranges,
        vec![None, Some(format!("bytes={}-", shard.len() / 2)), None],
        "cut, resume refused for its Content-Range, then a fresh download"
    );
    assert!(
        run.stderr.contains("Content-Range"),
        "the restart says why: {}",
        run.stderr
    );
    let summary = result_of(node(&sandbox.last_record(), "lengths"));
    assert_eq!(summary["documents"], 300);
}

#[test]
fn a_symlink_planted_at_the_old_partial_and_lock_paths_is_not_followed() {
    let (shard, _) = corpus();
    let server = HttpServer::start(
        HashMap::from([("victim.jsonl.zst".to_string(), shard.clone())]),
        Default::default(),
    );
    let sandbox = Sandbox::new();
    let url = server.url("victim.jsonl.zst");
    let victim = sandbox.write("victim.txt", "precious\n");
    let dir = downloads(&sandbox);
    std::fs::create_dir_all(&dir).unwrap();
    let name = local_name(&url);
    for suffix in ["partial", "lock"] {
        std::os::unix::fs::symlink(&victim, dir.join(format!("{name}.{suffix}"))).unwrap();
    }
    setup(
        &sandbox,
        &manifest(&url, Some(&sha256(&shard)), ""),
        "retries: 0",
    );
    let run = run_within(&sandbox, Duration::from_secs(60));
    assert!(
        std::fs::read(&victim).unwrap() == b"precious\n",
        "the link's target was written"
    );
    assert_eq!(run.code, Some(0), "{}", run.stderr);
}

#[test]
fn a_symlink_inside_the_partials_folder_is_refused() {
    let (shard, _) = corpus();
    let server = HttpServer::start(
        HashMap::from([("victim.jsonl.zst".to_string(), shard.clone())]),
        Default::default(),
    );
    let sandbox = Sandbox::new();
    let url = server.url("victim.jsonl.zst");
    let victim = sandbox.write("victim.txt", "precious\n");
    let private = downloads(&sandbox).join(".partial");
    std::fs::create_dir_all(&private).unwrap();
    std::fs::set_permissions(
        &private,
        std::os::unix::fs::PermissionsExt::from_mode(0o700),
    )
    .unwrap();
    let planted = private.join(local_name(&url));
    std::os::unix::fs::symlink(&victim, &planted).unwrap();
    setup(
        &sandbox,
        &manifest(&url, Some(&sha256(&shard)), ""),
        "retries: 0",
    );
    let run = run_within(&sandbox, Duration::from_secs(60));
    assert_eq!(run.code, Some(1), "{}", run.stderr);
    assert!(
        std::fs::read(&victim).unwrap() == b"precious\n",
        "the link's target was written"
    );
    let error = lengths_error(&sandbox);
    assert!(
        error.contains(&planted.display().to_string()) && error.contains("symbolic link"),
        "{error}"
    );
}

#[test]
fn a_partials_folder_open_to_others_is_refused() {
    let (shard, _) = corpus();
    let server = HttpServer::start(
        HashMap::from([("shard.jsonl.zst".to_string(), shard.clone())]),
        Default::default(),
    );
    let sandbox = Sandbox::new();
    let private = downloads(&sandbox).join(".partial");
    std::fs::create_dir_all(&private).unwrap();
    std::fs::set_permissions(
        &private,
        std::os::unix::fs::PermissionsExt::from_mode(0o777),
    )
    .unwrap();
    let url = server.url("shard.jsonl.zst");
    setup(
        &sandbox,
        &manifest(&url, Some(&sha256(&shard)), ""),
        "retries: 0",
    );
    let run = run_within(&sandbox, Duration::from_secs(60));
    assert_eq!(run.code, Some(1), "{}", run.stderr);
    let error = lengths_error(&sandbox);
    assert!(
        error.contains(&private.display().to_string())
            && error.contains("0777")
            && error.contains("chmod 700"),
        "{error}"
    );
    assert!(server.seen().is_empty(), "nothing was downloaded");
}

#[test]
fn an_unpinned_shard_is_refused_unless_allowed_and_its_sha256_is_recorded() {
    let (shard, _) = corpus();
    let server = HttpServer::start(
        HashMap::from([("shard.jsonl.zst".to_string(), shard.clone())]),
        Default::default(),
    );
    let sandbox = Sandbox::new();
    let url = server.url("shard.jsonl.zst");
    setup(&sandbox, &manifest(&url, None, ""), "retries: 0");
    let refused = run_within(&sandbox, Duration::from_secs(60));
    assert_eq!(refused.code, Some(1), "{}", refused.stderr);
    let error = lengths_error(&sandbox);
    assert!(
        error.contains(&url) && error.contains("sha256:") && error.contains("allow_unpinned"),
        "{error}"
    );
    assert!(server.seen().is_empty(), "refused before any download");

    setup(
        &sandbox,
        &manifest(&url, None, ""),
        "retries: 0, allow_unpinned: true",
    );
    let allowed = run_within(&sandbox, Duration::from_secs(60));
    assert_eq!(allowed.code, Some(0), "{}", allowed.stderr);
    let summary = result_of(node(&sandbox.last_record(), "lengths"));
    assert_eq!(summary["shards"][0]["sha256"], sha256(&shard).as_str());
    assert_eq!(summary["shards"][0]["sha256_verified"], false);
    assert!(
        allowed.stderr.contains(&sha256(&shard)),
        "the log says what to pin: {}",
        allowed.stderr
    );
}

#[test]
fn the_shipped_manifests_are_pinned_or_refused_before_any_download() {
    for entry in std::fs::read_dir(workspace_root().join("datasets")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().and_then(|e| e.to_str()) != Some("yaml") {
            continue;
        }
        let text = std::fs::read_to_string(&path).unwrap();
        let urls: Vec<&str> = text
            .lines()
            .filter_map(|l| l.trim().strip_prefix("- url:"))
            .map(str::trim)
            .collect();
        let pins = text
            .lines()
            .filter(|l| l.trim().starts_with("sha256:"))
            .count();
        if pins == urls.len() {
            continue;
        }
        let sandbox = Sandbox::new();
        sandbox.write(
            "p.yaml",
            &format!(
                "stages:\n  lengths:\n    uses: datasets/lengths\n    with: {{source: {}, retries: 0}}\n",
                path.display()
            ),
        );
        let run = run_within(&sandbox, Duration::from_secs(60));
        assert_eq!(run.code, Some(1), "{}", run.stderr);
        let error = lengths_error(&sandbox);
        assert!(
            error.contains("pins no sha256") && error.contains("allow_unpinned"),
            "{}: {error}",
            path.display()
        );
        assert!(
            !downloads(&sandbox).exists(),
            "{}: nothing was downloaded",
            path.display()
        );
    }
}
