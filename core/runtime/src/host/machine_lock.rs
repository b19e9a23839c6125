//! One lock per cache for the machine's measurements, so concurrent runs queue instead of timing
//! each other.
//!
//! A run keeps its own exclusive nodes alone, but two runs on one cache (two terminals, two batch
//! jobs on one node) would otherwise measure at the same time and cache each other's contention.
//! So every computed node holds the lock: shared for ordinary work, exclusive for a measurement.
//! Key locks are always taken before this one and never while it is held, so the two cannot
//! deadlock.

use std::fs::{File, TryLockError};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::stop::StopToken;

/// How often a waiting node tries again, and so how soon it notices a stop.
const POLL: Duration = Duration::from_millis(50);

pub struct MachineLock {
    _file: File,
}

#[derive(Debug, thiserror::Error)]
pub enum MachineLockError {
    #[error("cannot open the machine lock {path}: {source}")]
    Open {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("the run was stopped while the node waited for another run's measurement")]
    Stopped,
}

/// The lock file of the cache at `root`.
pub fn path(root: &Path) -> PathBuf {
    root.join("locks").join("machine.lock")
}

/// Waits for the lock (exclusive for a measurement), calling `waiting` once if another run holds
/// it; gives up when the run is stopped.
pub fn acquire(
    root: &Path,
    exclusive: bool,
    stop: &StopToken,
    waiting: impl FnOnce(),
) -> Result<MachineLock, MachineLockError> {
    let path = path(root);
    let open = |source| MachineLockError::Open {
        path: path.clone(),
        source,
    };
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent).map_err(open)?;
    }
    let file = File::options()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(open)?;
    let mut waiting = Some(waiting);
    let started = Instant::now();
    loop {
        let attempt = if exclusive {
            file.try_lock()
        } else {
            file.try_lock_shared()
        };
        match attempt {
            Ok(()) => return Ok(MachineLock { _file: file }),
            Err(TryLockError::WouldBlock) => {}
            Err(TryLockError::Error(source)) => return Err(open(source)),
        }
        if stop.requested() {
            return Err(MachineLockError::Stopped);
        }
        if started.elapsed() >= POLL {
            if let Some(waiting) = waiting.take() {
                waiting();
            }
        }
        std::thread::sleep(POLL);
    }
}
