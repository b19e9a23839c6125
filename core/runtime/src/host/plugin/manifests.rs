//! What a plugin library declares, without loading it: manifests cached under the artifact cache
//! by the blake3 of the library's bytes, and on a miss read by a short-lived helper process that
//! loads the library instead of this one, so that a plugin's initialisers, and any crash or hang
//! in them, stay out of the commands that only need to know what it offers.

use std::io::Write;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, OnceLock};
use std::time::Duration;

use attnbench_abi::{PluginModRef, ABI_VERSION};
use serde::{Deserialize, Serialize};

use super::{open_library, LoadError, Plugin};

/// How long a helper may take to load a library and answer; initialisers that hang longer are
/// reported instead of waited for.
const READ_TIMEOUT: Duration = Duration::from_secs(60);
/// Lines of a failed helper's stderr quoted in the error.
const STDERR_TAIL: usize = 3;

/// How this process learns manifests.
struct Settings {
    /// Where entries live; `None` caches nothing.
    dir: Option<PathBuf>,
    /// The executable that reads a manifest in its own process; `None` loads the library here.
    reader: Option<PathBuf>,
    timeout: Duration,
}

static SETTINGS: OnceLock<Settings> = OnceLock::new();

/// Caches manifests under `manifests/` of the artifact cache at `cache_root` (none: nothing is
/// cached), and has `reader` read the manifest of a library not seen before, as
/// `reader worker --plugin LIB --manifest` (which calls [`serve_manifest`]). Takes effect once
/// per process, before the first discovery. Without it nothing is cached and a library is
/// loaded into this process to be read, which is what an embedder of the runtime without an
/// attnbench binary gets.
pub fn configure_manifests(cache_root: Option<&Path>, reader: Option<PathBuf>) {
    let _ = SETTINGS.set(Settings {
        // A host of another ABI checks libraries differently, so it keeps its own entries.
        dir: cache_root.map(|root| root.join("manifests").join(ABI_VERSION)),
        reader,
        timeout: READ_TIMEOUT,
    });
}

fn settings() -> &'static Settings {
    SETTINGS.get_or_init(|| Settings {
        dir: None,
        reader: None,
        timeout: READ_TIMEOUT,
    })
}

/// What loading a library showed; what a helper answers and an entry holds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
enum Found {
    Plugin { abi: String, manifest: String },
    Refused(Refusal),
}

/// A [`LoadError`] without its path: an entry is valid wherever its bytes are found.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
enum Refusal {
    NotAPlugin,
    OtherMajor { found: String },
    Layout { found: String },
    Open { reason: String },
    Init { reason: String },
}

impl Refusal {
    fn from_error(err: LoadError) -> Refusal {
        match err {
            LoadError::NotAPlugin(_) => Refusal::NotAPlugin,
            LoadError::OtherMajor { found, .. } => Refusal::OtherMajor { found },
            LoadError::Layout { found, .. } => Refusal::Layout { found },
            LoadError::Open { reason, .. } => Refusal::Open { reason },
            LoadError::Missing(_) => Refusal::Open {
                reason: "no such file".into(),
            },
            LoadError::Changed(_) => Refusal::Open {
                reason: "the library changed while it was read".into(),
            },
            LoadError::Init { reason, .. }
            | LoadError::Manifest { reason, .. }
            | LoadError::Inspect { reason, .. } => Refusal::Init { reason },
        }
    }

    fn into_error(self, path: &Path) -> LoadError {
        let path = path.to_path_buf();
        match self {
            Refusal::NotAPlugin => LoadError::NotAPlugin(path),
            Refusal::OtherMajor { found } => LoadError::OtherMajor { path, found },
            Refusal::Layout { found } => LoadError::Layout { path, found },
            Refusal::Open { reason } => LoadError::Open { path, reason },
            Refusal::Init { reason } => LoadError::Init { path, reason },
        }
    }
}

impl Found {
    /// Whether the answer follows from the bytes alone. A library that fails to open or to
    /// initialise may work once a library it needs is installed, so that is asked again.
    fn lasting(&self) -> bool {
        !matches!(
            self,
            Found::Refused(Refusal::Open { .. } | Refusal::Init { .. })
        )
    }
}

#[derive(Serialize, Deserialize)]
struct Entry {
    library_hash: String,
    found: Found,
}

/// A library's manifest JSON, and its module when learning it meant loading it here.
pub(super) struct Known {
    pub manifest: String,
    pub module: Option<PluginModRef>,
}

/// The manifest of the library at `path` (canonical) whose bytes hash to `hash`.
pub(super) fn manifest_of(path: &Path, hash: &str) -> Result<Known, LoadError> {
    settings().manifest_of(path, hash)
}

/// [`Plugin::describe`] of each library, side by side: on a first run every library is a miss,
/// and their helpers are independent processes.
pub(super) fn describe_all(paths: &[PathBuf]) -> Vec<Result<Plugin, LoadError>> {
    // Loading in this process is left sequential: initialisers are not written to race.
    let threads = if settings().reader.is_some() {
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1)
            .min(paths.len())
    } else {
        1
    };
    if threads <= 1 {
        return paths.iter().map(|path| Plugin::describe(path)).collect();
    }
    let next = AtomicUsize::new(0);
    let mut results: Vec<Option<Result<Plugin, LoadError>>> = paths.iter().map(|_| None).collect();
    std::thread::scope(|scope| {
        let workers: Vec<_> = (0..threads)
            .map(|_| {
                scope.spawn(|| {
                    let mut done = Vec::new();
                    loop {
                        let index = next.fetch_add(1, Ordering::Relaxed);
                        let Some(path) = paths.get(index) else { break };
                        done.push((index, Plugin::describe(path)));
                    }
                    done
                })
            })
            .collect();
        for worker in workers {
            for (index, result) in worker.join().unwrap_or_default() {
                results[index] = Some(result);
            }
        }
    });
    results
        .into_iter()
        .zip(paths)
        .map(|(result, path)| {
            result.unwrap_or_else(|| {
                Err(LoadError::Inspect {
                    path: path.clone(),
                    reason: "the thread reading it failed".into(),
                })
            })
        })
        .collect()
}

impl Settings {
    fn manifest_of(&self, path: &Path, hash: &str) -> Result<Known, LoadError> {
        if let Some(found) = self.dir.as_deref().and_then(|dir| read_entry(dir, hash)) {
            return known(path, found, None);
        }
        let (found, module) = match &self.reader {
            Some(reader) => {
                let found = read_in_helper(reader, path, self.timeout).map_err(|reason| {
                    LoadError::Inspect {
                        path: path.to_path_buf(),
                        reason,
                    }
                })?;
                (found, None)
            }
            None => match open_library(path) {
                Ok((module, abi)) => {
                    let manifest = (module.manifest())().into_string();
                    (Found::Plugin { abi, manifest }, Some(module))
                }
                Err(err) => (Found::Refused(Refusal::from_error(err)), None),
            },
        };
        if let Some(dir) = &self.dir {
            if found.lasting() {
                write_entry(dir, hash, &found);
            }
        }
        known(path, found, module)
    }
}

fn known(path: &Path, found: Found, module: Option<PluginModRef>) -> Result<Known, LoadError> {
    match found {
        Found::Plugin { manifest, .. } => Ok(Known { manifest, module }),
        Found::Refused(refusal) => Err(refusal.into_error(path)),
    }
}

fn entry_path(dir: &Path, hash: &str) -> PathBuf {
    dir.join(format!("{hash}.json"))
}

/// An entry that is missing, unreadable or not for `hash` is a miss: it is read again and
/// overwritten, never trusted.
fn read_entry(dir: &Path, hash: &str) -> Option<Found> {
    let bytes = std::fs::read(entry_path(dir, hash)).ok()?;
    let entry: Entry = serde_json::from_slice(&bytes).ok()?;
    (entry.library_hash == hash).then_some(entry.found)
}

/// Written whole under a temporary name and renamed, so a reader never sees half an entry and
/// concurrent writers of the same entry (equal content) cannot mix. A cache that cannot be
/// written only costs the next command another read.
fn write_entry(dir: &Path, hash: &str, found: &Found) {
    let written = (|| -> std::io::Result<()> {
        std::fs::create_dir_all(dir)?;
        let mut file = tempfile::NamedTempFile::new_in(dir)?;
        let entry = Entry {
            library_hash: hash.to_string(),
            found: found.clone(),
        };
        serde_json::to_writer(&mut file, &entry)?;
        file.flush()?;
        file.persist(entry_path(dir, hash))
            .map_err(|err| err.error)?;
        Ok(())
    })();
    if let Err(err) = written {
        tracing::debug!("cannot cache a manifest in {}: {err}", dir.display());
    }
}

/// Starts `reader` on the library and takes its one-line answer; `Err` says in words why there
/// is none.
fn read_in_helper(reader: &Path, library: &Path, timeout: Duration) -> Result<Found, String> {
    let child = Command::new(reader)
        .arg("worker")
        .arg("--plugin")
        .arg(library)
        .arg("--manifest")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|err| format!("cannot start {} to read it ({err})", reader.display()))?;
    let pid = child.id();
    let (sender, answer) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = sender.send(child.wait_with_output());
    });
    let output = match answer.recv_timeout(timeout) {
        Ok(Ok(output)) => output,
        Ok(Err(err)) => return Err(format!("its helper process was lost ({err})")),
        Err(_) => {
            // The waiting thread still owns the child and reaps it once it dies.
            unsafe {
                libc::kill(pid as libc::pid_t, libc::SIGKILL);
            }
            return Err(format!(
                "loading it did not finish within {} (an initialiser hangs?)",
                humantime::format_duration(timeout)
            ));
        }
    };
    let stdout = String::from_utf8_lossy(&output.stdout);
    if let Some(found) = stdout
        .lines()
        .rev()
        .find(|line| !line.trim().is_empty())
        .and_then(|line| serde_json::from_str::<Found>(line).ok())
    {
        return Ok(found);
    }
    let mut reason = match output.status.signal() {
        Some(signal) => format!(
            "loading it crashed its helper process ({})",
            signal_name(signal)
        ),
        None => format!(
            "its helper process exited with status {} without an answer",
            output.status.code().unwrap_or(-1)
        ),
    };
    let stderr = String::from_utf8_lossy(&output.stderr);
    let tail: Vec<&str> = stderr
        .lines()
        .map(str::trim)
        .filter(|line| !line.is_empty())
        .collect();
    if !tail.is_empty() {
        let tail = &tail[tail.len().saturating_sub(STDERR_TAIL)..];
        reason.push_str(&format!(" — its last stderr: {}", tail.join(" | ")));
    }
    Err(reason)
}

fn signal_name(signal: i32) -> String {
    let name = match signal {
        libc::SIGSEGV => "SIGSEGV: invalid memory access",
        libc::SIGABRT => "SIGABRT: aborted",
        libc::SIGBUS => "SIGBUS: bus error",
        libc::SIGFPE => "SIGFPE: arithmetic fault",
        libc::SIGILL => "SIGILL: illegal instruction",
        libc::SIGKILL => "SIGKILL: killed",
        _ => "signal",
    };
    format!("signal {signal}, {name}")
}

/// The helper's side (`attnbench worker --plugin LIB --manifest`): loads the library, writes what
/// it found as one JSON line on stdout and ends the process without running the library's
/// destructors, whose only effect here could be a crash after the answer.
pub fn serve_manifest(library: &Path) -> ! {
    // The answer gets its own copy of stdout; fd 1 is pointed at stderr, so whatever an
    // initialiser prints cannot be mistaken for it.
    let answer = unsafe {
        let fd = libc::dup(1);
        if fd < 0 || libc::dup2(2, 1) < 0 {
            libc::_exit(1);
        }
        #[cfg(target_os = "linux")]
        libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
        <std::fs::File as std::os::fd::FromRawFd>::from_raw_fd(fd)
    };
    let found = match open_library(library) {
        Ok((module, abi)) => Found::Plugin {
            abi,
            manifest: (module.manifest())().into_string(),
        },
        Err(err) => Found::Refused(Refusal::from_error(err)),
    };
    let mut answer = answer;
    let written = serde_json::to_string(&found)
        .map_err(std::io::Error::other)
        .and_then(|line| writeln!(answer, "{line}").and_then(|_| answer.flush()));
    unsafe { libc::_exit(if written.is_ok() { 0 } else { 1 }) }
}

#[cfg(test)]
#[path = "manifests_tests.rs"]
mod tests;
