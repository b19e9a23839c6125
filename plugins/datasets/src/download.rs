//! Downloading corpus shards: resumable (HTTP Range), retried with backoff, verified by SHA-256,
//! and never left looking complete when they are not (data lands in `<name>.partial` and is
//! renamed only once it is whole and verified).

use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

use attnbench_sdk::{Host, PluginError};
use reqwest::blocking::Client;
use reqwest::StatusCode;
use sha2::{Digest, Sha256};

/// Why one attempt failed, and whether another could succeed.
enum Attempt {
    Retry(String),
    Fatal(String),
}

/// Downloads `url` into `dir` (once: a verified file already there is reused) and returns its path.
pub fn fetch(
    url: &str,
    dir: &Path,
    sha256: Option<&str>,
    retries: u32,
    host: &Host,
) -> Result<PathBuf, PluginError> {
    std::fs::create_dir_all(dir).map_err(|err| PluginError::io(dir, err))?;
    let target = dir.join(local_name(url));
    let name = target
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or("shard")
        .to_string();
    let partial = target.with_file_name(format!("{name}.partial"));
    // One download of a shard at a time, across nodes and runs: the others wait, then reuse it.
    let lock_path = target.with_file_name(format!("{name}.lock"));
    let lock = File::create(&lock_path).map_err(|err| PluginError::io(&lock_path, err))?;
    lock.lock()
        .map_err(|err| PluginError::io(&lock_path, err))?;
    if target.is_file() {
        match sha256 {
            Some(expected) if file_sha256(&target)? != expected.to_ascii_lowercase() => {
                host.warn(&format!(
                    "{} does not match its checksum any more; downloading it again",
                    target.display()
                ));
                std::fs::remove_file(&target).map_err(|err| PluginError::io(&target, err))?;
            }
            _ => return Ok(target),
        }
    }
    let client = Client::builder()
        .connect_timeout(Duration::from_secs(30))
        .timeout(None::<Duration>)
        .build()
        .map_err(|err| PluginError::failed(format!("cannot start an HTTP client: {err}")))?;
    let mut attempt = 0;
    loop {
        match download_once(&client, url, &partial, host) {
            Ok(()) => break,
            Err(Attempt::Fatal(reason)) => return Err(PluginError::failed(reason)),
            Err(Attempt::Retry(reason)) if attempt < retries => {
                attempt += 1;
                let wait = Duration::from_millis(200 << attempt.min(6));
                host.warn(&format!("{reason}; retrying in {:.1}s ({attempt}/{retries}), resuming where it stopped", wait.as_secs_f64()));
                std::thread::sleep(wait);
            }
            Err(Attempt::Retry(reason)) => {
                return Err(PluginError::failed(format!("{reason}; gave up after {} attempts (the partial download is kept for the next run)", retries + 1)))
            }
        }
    }
    if let Some(expected) = sha256 {
        let actual = file_sha256(&partial)?;
        if actual != expected.to_ascii_lowercase() {
            let _ = std::fs::remove_file(&partial);
            return Err(PluginError::failed(format!(
                "checksum mismatch for {url}: expected sha256 {expected}, got {actual}; the download was removed"
            )));
        }
    }
    std::fs::rename(&partial, &target).map_err(|err| PluginError::io(&target, err))?;
    Ok(target)
}

/// One GET, resuming from what `partial` already holds.
fn download_once(client: &Client, url: &str, partial: &Path, host: &Host) -> Result<(), Attempt> {
    let offset = std::fs::metadata(partial).map(|m| m.len()).unwrap_or(0);
    let mut request = client.get(url);
    if offset > 0 {
        request = request.header(reqwest::header::RANGE, format!("bytes={offset}-"));
    }
    let mut response = request
        .send()
        .map_err(|err| Attempt::Retry(format!("{url}: {}", brief(&err))))?;
    let status = response.status();
    let (mut file, start) = match status {
        StatusCode::PARTIAL_CONTENT => (open(partial, true)?, offset),
        StatusCode::OK => (open(partial, false)?, 0),
        StatusCode::RANGE_NOT_SATISFIABLE => {
            // What we hold is not a prefix of what the server has now: start over.
            let _ = std::fs::remove_file(partial);
            return Err(Attempt::Retry(format!(
                "{url}: the server refused to resume"
            )));
        }
        status if status.is_server_error() || status == StatusCode::TOO_MANY_REQUESTS => {
            return Err(Attempt::Retry(format!(
                "{url}: the server answered {status}"
            )))
        }
        status => {
            return Err(Attempt::Fatal(format!(
                "download of {url} failed: the server answered {status}"
            )))
        }
    };
    let total = response.content_length().map(|length| length + start);
    let mut done = start;
    let mut buffer = vec![0u8; 1 << 16];
    loop {
        let read = response.read(&mut buffer).map_err(|err| {
            Attempt::Retry(format!(
                "{url}: the connection broke after {done} bytes ({err})"
            ))
        })?;
        if read == 0 {
            break;
        }
        file.write_all(&buffer[..read])
            .map_err(|err| Attempt::Fatal(format!("{}: {err}", partial.display())))?;
        done += read as u64;
        host.progress(done, total.unwrap_or(0), "bytes");
        if host.is_cancelled() {
            return Err(Attempt::Fatal(format!(
                "{url}: cancelled after {done} bytes"
            )));
        }
    }
    file.sync_all()
        .map_err(|err| Attempt::Fatal(format!("{}: {err}", partial.display())))?;
    match total {
        Some(total) if done < total => Err(Attempt::Retry(format!(
            "{url}: the connection closed after {done} of {total} bytes"
        ))),
        _ => Ok(()),
    }
}

fn open(path: &Path, append: bool) -> Result<File, Attempt> {
    let mut options = OpenOptions::new();
    options.create(true).write(true);
    if append {
        options.append(true);
    } else {
        options.truncate(true);
    }
    options
        .open(path)
        .map_err(|err| Attempt::Fatal(format!("{}: {err}", path.display())))
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
    let base: String = base
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || ".-_".contains(c) {
                c
            } else {
                '_'
            }
        })
        .collect();
    let digest = Sha256::digest(url.as_bytes());
    let prefix: String = digest.iter().take(6).map(|b| format!("{b:02x}")).collect();
    format!("{prefix}-{base}")
}

fn file_sha256(path: &Path) -> Result<String, PluginError> {
    let mut file = File::open(path).map_err(|err| PluginError::io(path, err))?;
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
