//! Downloading corpus shards from servers that are not trusted: resumable (HTTP Range, and only
//! onto bytes the server proves it continues), retried with backoff, capped in size, cut short
//! when the server goes quiet or the run is stopped, redirected only where the manifest allows,
//! and verified by SHA-256. Data lands in a private folder and is renamed into the downloads
//! folder only once it is whole and verified, so nothing there ever looks complete when it is not.

use std::fs::{File, OpenOptions};
use std::future::Future;
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use attnbench_sdk::{format_size, Host, PluginError};
use reqwest::header::{CONTENT_RANGE, LOCATION, RANGE};
use reqwest::{Client, StatusCode, Url};
use sha2::{Digest, Sha256};

use crate::{partial, policy};

/// More redirects than this is a loop, not a file host.
const MAX_REDIRECTS: usize = 10;
/// How often a wait on the network looks at the host's stop request.
const POLL: Duration = Duration::from_millis(100);

/// How one shard may be downloaded.
pub struct Rules<'a> {
    pub sha256: Option<&'a str>,
    pub retries: u32,
    pub max_bytes: u64,
    pub idle_timeout: Duration,
    pub redirect_hosts: &'a [String],
    /// The manifest the shard comes from, named in errors that point at one of its fields.
    pub manifest: &'a Path,
}

/// A shard on disk, and how it got there.
pub struct Fetched {
    pub path: PathBuf,
    pub sha256: String,
    pub bytes: u64,
    /// Where the bytes came from after redirects (the shard's URL when none, or when reused).
    pub final_url: String,
    /// Every URL a redirect led to, in order.
    pub redirects: Vec<String>,
    /// False when a file from an earlier run was reused.
    pub downloaded: bool,
}

fn partial_failed(err: partial::PartialError) -> PluginError {
    PluginError::failed(err.to_string())
}

/// Why one attempt failed, and whether another could succeed.
enum Attempt {
    Retry(String),
    Fatal(String),
}

/// Where a download of one attempt ended up.
struct Landed {
    final_url: String,
    redirects: Vec<String>,
}

/// Downloads `url` into `dir` (once: a verified file already there is reused).
pub fn fetch(url: &str, dir: &Path, rules: &Rules, host: &Host) -> Result<Fetched, PluginError> {
    let start = Url::parse(url)
        .map_err(|err| PluginError::failed(format!("shard URL `{url}` is not a URL: {err}")))?;
    std::fs::create_dir_all(dir).map_err(|err| PluginError::io(dir, err))?;
    let private = partial::private_folder(dir).map_err(partial_failed)?;
    let name = local_name(url);
    let target = dir.join(&name);
    let partial_path = private.join(&name);
    // One download of a shard at a time, across nodes and runs: the others wait, then reuse it.
    let lock_path = private.join(format!("{name}.lock"));
    let lock = partial::open(&lock_path).map_err(partial_failed)?;
    if !partial::lock(&lock, &lock_path, POLL, || host.is_cancelled()).map_err(partial_failed)? {
        return Err(PluginError::failed(cancelled(url, None)));
    }
    if let Some(found) = reuse(&target, url, rules, host)? {
        return Ok(found);
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|err| PluginError::failed(format!("cannot start the downloader: {err}")))?;
    let client = Client::builder()
        // Redirects are followed by hand, each one checked against the manifest.
        .redirect(reqwest::redirect::Policy::none())
        .connect_timeout(Duration::from_secs(30))
        .build()
        .map_err(|err| PluginError::failed(format!("cannot start an HTTP client: {err}")))?;
    let mut attempt = 0;
    let landed = loop {
        if host.is_cancelled() {
            return Err(PluginError::failed(cancelled(url, None)));
        }
        match runtime.block_on(download_once(&client, &start, &partial_path, rules, host)) {
            Ok(landed) => break landed,
            Err(Attempt::Fatal(reason)) => {
                // An empty partial is only clutter; one with data may still be resumed.
                if std::fs::symlink_metadata(&partial_path)
                    .is_ok_and(|m| m.is_file() && m.len() == 0)
                {
                    let _ = std::fs::remove_file(&partial_path);
                }
                return Err(PluginError::failed(reason));
            }
            Err(Attempt::Retry(reason)) if attempt < rules.retries => {
                attempt += 1;
                let wait = Duration::from_millis(200 << attempt.min(6));
                host.warn(&format!(
                    "{reason}; retrying in {:.1}s ({attempt}/{})",
                    wait.as_secs_f64(),
                    rules.retries
                ));
                pause(wait, host);
            }
            Err(Attempt::Retry(reason)) => {
                let attempts = rules.retries + 1;
                let plural = if attempts == 1 { "" } else { "s" };
                return Err(PluginError::failed(format!(
                    "{reason}; gave up after {attempts} attempt{plural} (what arrived is kept for the next run to resume)"
                )));
            }
        }
    };
    let mut file = partial::open(&partial_path).map_err(partial_failed)?;
    let actual = sha256_of(&mut file, &partial_path)?;
    let bytes = file
        .metadata()
        .map_err(|err| PluginError::io(&partial_path, err))?
        .len();
    drop(file);
    match rules.sha256 {
        Some(expected) if actual != expected.to_ascii_lowercase() => {
            let _ = std::fs::remove_file(&partial_path);
            return Err(PluginError::failed(format!(
                "checksum mismatch for {url}: expected sha256 {expected}, got {actual}; the download was removed"
            )));
        }
        Some(_) => {}
        None => host.warn(&format!(
            "{url} is not verified: its download has sha256 {actual}; pin it with `sha256: {actual}` under its url in {} once you trust it",
            rules.manifest.display()
        )),
    }
    std::fs::rename(&partial_path, &target).map_err(|err| PluginError::io(&target, err))?;
    Ok(Fetched {
        path: target,
        sha256: actual,
        bytes,
        final_url: landed.final_url,
        redirects: landed.redirects,
        downloaded: true,
    })
}

/// The shard from an earlier run, if it is there and (when pinned) still matches.
fn reuse(
    target: &Path,
    url: &str,
    rules: &Rules,
    host: &Host,
) -> Result<Option<Fetched>, PluginError> {
    let meta = match std::fs::symlink_metadata(target) {
        Ok(meta) => meta,
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(err) => return Err(PluginError::io(target, err)),
    };
    if !meta.file_type().is_file() {
        return Err(PluginError::failed(format!(
            "{} is not a regular file (a symbolic link?); a downloaded shard must be one (remove it to download again)",
            target.display()
        )));
    }
    let mut file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(target)
        .map_err(|err| PluginError::io(target, err))?;
    let actual = sha256_of(&mut file, target)?;
    if let Some(expected) = rules.sha256 {
        if actual != expected.to_ascii_lowercase() {
            host.warn(&format!(
                "{} does not match its checksum any more; downloading it again",
                target.display()
            ));
            std::fs::remove_file(target).map_err(|err| PluginError::io(target, err))?;
            return Ok(None);
        }
    }
    Ok(Some(Fetched {
        path: target.to_path_buf(),
        sha256: actual,
        bytes: meta.len(),
        final_url: url.to_string(),
        redirects: Vec::new(),
        downloaded: false,
    }))
}

/// One GET (after its redirects), resuming from what the partial download already holds.
async fn download_once(
    client: &Client,
    start: &Url,
    partial_path: &Path,
    rules: &Rules<'_>,
    host: &Host<'_>,
) -> Result<Landed, Attempt> {
    let url = start.as_str();
    let fatal_io =
        |err: std::io::Error| Attempt::Fatal(format!("{}: {err}", partial_path.display()));
    let mut file = partial::open(partial_path).map_err(|err| Attempt::Fatal(err.to_string()))?;
    let mut offset = file.metadata().map_err(fatal_io)?.len();
    if offset > rules.max_bytes {
        file.set_len(0).map_err(fatal_io)?;
        offset = 0;
    }
    let (mut response, landed) = request(client, start, offset, rules, host).await?;
    let status = response.status();
    let length = response.content_length();
    let content_range = response
        .headers()
        .get(CONTENT_RANGE)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let (from, total) = match status {
        StatusCode::PARTIAL_CONTENT => {
            match policy::check_content_range(content_range.as_deref(), offset, length) {
                Ok(continuation) => (offset, continuation.total),
                Err(reason) => {
                    file.set_len(0).map_err(fatal_io)?;
                    return Err(Attempt::Retry(format!(
                        "{url}: the server answered 206 Partial Content, but {reason}; the partial download was discarded and the next attempt starts from zero"
                    )));
                }
            }
        }
        // A full answer, even to a range request: it replaces whatever the partial held.
        StatusCode::OK => (0, length),
        StatusCode::RANGE_NOT_SATISFIABLE => {
            if offset > 0 && policy::unsatisfied_total(content_range.as_deref()) == Some(offset) {
                return Ok(landed);
            }
            file.set_len(0).map_err(fatal_io)?;
            return Err(Attempt::Retry(format!(
                "{url}: the server refused to resume from byte {offset}; starting again from zero"
            )));
        }
        status if status.is_server_error() || status == StatusCode::TOO_MANY_REQUESTS => {
            return Err(Attempt::Retry(format!(
                "{url}: the server answered {status}"
            )))
        }
        status => {
            let via = if landed.redirects.is_empty() {
                String::new()
            } else {
                format!(" (at {}, after redirects)", landed.final_url)
            };
            return Err(Attempt::Fatal(format!(
                "download of {url} failed: the server answered {status}{via}"
            )));
        }
    };
    if let Some(total) = total.filter(|&total| total > rules.max_bytes) {
        drop(file);
        let _ = std::fs::remove_file(partial_path);
        let size = format_size(total);
        let shown = if size == total.to_string() {
            String::new()
        } else {
            format!(" ({size})")
        };
        return Err(Attempt::Fatal(too_big(
            url,
            &format!("the server announces {total} bytes{shown}, more than"),
            total.next_power_of_two(),
            rules,
        )));
    }
    file.set_len(from).map_err(fatal_io)?;
    file.seek(SeekFrom::Start(from)).map_err(fatal_io)?;
    let mut done = from;
    loop {
        let chunk = match wait(response.chunk(), rules.idle_timeout, host).await {
            Ok(Ok(Some(chunk))) => chunk,
            Ok(Ok(None)) => break,
            Ok(Err(err)) => {
                return Err(Attempt::Retry(format!(
                    "{url}: the connection broke after {done} bytes ({})",
                    brief(&err)
                )))
            }
            Err(Waited::Idle) => {
                return Err(Attempt::Retry(format!(
                    "{url}: no data for {} s after {done} bytes (idle_timeout)",
                    rules.idle_timeout.as_secs_f64()
                )))
            }
            Err(Waited::Cancelled) => return Err(Attempt::Fatal(cancelled(url, Some(done)))),
        };
        if done + chunk.len() as u64 > rules.max_bytes {
            drop(file);
            let _ = std::fs::remove_file(partial_path);
            return Err(Attempt::Fatal(too_big(
                url,
                "the body runs on past",
                rules.max_bytes.saturating_mul(2),
                rules,
            )));
        }
        file.write_all(&chunk).map_err(fatal_io)?;
        done += chunk.len() as u64;
        host.progress(done, total.unwrap_or(0), "bytes");
        if host.is_cancelled() {
            return Err(Attempt::Fatal(cancelled(url, Some(done))));
        }
    }
    file.sync_all().map_err(fatal_io)?;
    match total {
        Some(total) if done < total => Err(Attempt::Retry(format!(
            "{url}: the connection closed after {done} of {total} bytes"
        ))),
        _ => Ok(landed),
    }
}

/// Sends the GET and follows the redirects the rules allow; the answer is not a redirect.
async fn request(
    client: &Client,
    start: &Url,
    offset: u64,
    rules: &Rules<'_>,
    host: &Host<'_>,
) -> Result<(reqwest::Response, Landed), Attempt> {
    let mut current = start.clone();
    let mut redirects = Vec::new();
    loop {
        let mut request = client.get(current.clone());
        if offset > 0 {
            request = request.header(RANGE, format!("bytes={offset}-"));
        }
        let response = match wait(request.send(), rules.idle_timeout, host).await {
            Ok(Ok(response)) => response,
            Ok(Err(err)) => return Err(Attempt::Retry(format!("{current}: {}", brief(&err)))),
            Err(Waited::Idle) => {
                return Err(Attempt::Retry(format!(
                    "{current}: no answer for {} s (idle_timeout)",
                    rules.idle_timeout.as_secs_f64()
                )))
            }
            Err(Waited::Cancelled) => return Err(Attempt::Fatal(cancelled(start.as_str(), None))),
        };
        let location = match response.headers().get(LOCATION) {
            Some(location) if response.status().is_redirection() => location,
            _ => {
                let landed = Landed {
                    final_url: current.to_string(),
                    redirects,
                };
                return Ok((response, landed));
            }
        };
        let refuse = |why: String| Attempt::Fatal(format!("download of {start} refused: {why}"));
        let location = location.to_str().map_err(|_| {
            refuse(format!(
                "{current} redirects to a Location that is not text"
            ))
        })?;
        let next = current.join(location).map_err(|err| {
            refuse(format!(
                "{current} redirects to `{location}`, not a URL ({err})"
            ))
        })?;
        if !policy::redirect_allowed(&current, &next, rules.redirect_hosts) {
            let from = if current == *start {
                "it".to_string()
            } else {
                current.to_string()
            };
            return Err(refuse(policy::redirect_refusal(
                &from,
                &current,
                &next,
                rules.manifest,
            )));
        }
        if redirects.len() >= MAX_REDIRECTS {
            return Err(refuse(format!(
                "more than {MAX_REDIRECTS} redirects (the last to {next})"
            )));
        }
        redirects.push(next.to_string());
        current = next;
    }
}

fn too_big(url: &str, what: &str, suggestion: u64, rules: &Rules) -> String {
    format!(
        "download of {url} refused: {what} max_bytes = {}; raise `max_bytes` on the stage (e.g. `with: {{max_bytes: {}}}`) or the shard's `max_bytes:` in {} if that size is expected",
        format_size(rules.max_bytes),
        format_size(suggestion),
        rules.manifest.display()
    )
}

fn cancelled(url: &str, done: Option<u64>) -> String {
    let after = done
        .map(|d| format!(" after {d} bytes"))
        .unwrap_or_default();
    format!("download of {url} stopped: the run was interrupted{after} (what arrived is kept for the next run to resume)")
}

enum Waited {
    Idle,
    Cancelled,
}

/// Awaits `future`, giving up once `idle` passes without it finishing or the host asks to stop.
async fn wait<F: Future>(future: F, idle: Duration, host: &Host<'_>) -> Result<F::Output, Waited> {
    let mut future = std::pin::pin!(future);
    let started = Instant::now();
    loop {
        let left = idle.saturating_sub(started.elapsed());
        match tokio::time::timeout(left.min(POLL), future.as_mut()).await {
            Ok(output) => return Ok(output),
            Err(_) if host.is_cancelled() => return Err(Waited::Cancelled),
            Err(_) if started.elapsed() >= idle => return Err(Waited::Idle),
            Err(_) => {}
        }
    }
}

/// Sleeps `duration`, waking early when the host asks to stop.
fn pause(duration: Duration, host: &Host) {
    let until = Instant::now() + duration;
    while !host.is_cancelled() {
        let left = until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            break;
        }
        std::thread::sleep(left.min(POLL));
    }
}

fn brief(err: &reqwest::Error) -> String {
    let mut text = err.to_string();
    let mut source = std::error::Error::source(err);
    while let Some(cause) = source {
        text = format!("{text}: {cause}");
        source = cause.source();
    }
    text
}

/// A file name for `url` that keeps its extension (`.jsonl.zst`) and cannot collide.
fn local_name(url: &str) -> String {
    let base = url
        .rsplit('/')
        .next()
        .unwrap_or("shard")
        .split(['?', '#'])
        .next()
        .unwrap_or("shard");
    let base = attnbench_sdk::file_name_part(base, ".-_");
    let digest = Sha256::digest(url.as_bytes());
    let prefix: String = digest.iter().take(6).map(|b| format!("{b:02x}")).collect();
    format!("{prefix}-{base}")
}

fn sha256_of(file: &mut File, path: &Path) -> Result<String, PluginError> {
    file.seek(SeekFrom::Start(0))
        .map_err(|err| PluginError::io(path, err))?;
    let mut hasher = Sha256::new();
    let mut buffer = vec![0u8; 1 << 16];
    loop {
        let read = file
            .read(&mut buffer)
            .map_err(|err| PluginError::io(path, err))?;
        if read == 0 {
            break;
        }
        hasher.update(&buffer[..read]);
    }
    Ok(hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect())
}
