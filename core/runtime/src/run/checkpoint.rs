//! The run record on disk follows the run: if the run is killed outright (SIGKILL, a lost
//! machine), run.json still names every node that finished, with its artifact.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::record::{NodeRecord, RunRecord};

/// Rewrites of the partial record, spaced so that they never cost more than a tenth of the run.
pub(super) struct Checkpoint {
    record: RunRecord,
    dir: PathBuf,
    last_write: Instant,
    spacing: Duration,
}

impl Checkpoint {
    pub fn new(record: &RunRecord, dir: &Path) -> Checkpoint {
        Checkpoint {
            record: record.clone(),
            dir: dir.to_path_buf(),
            last_write: Instant::now(),
            spacing: Duration::from_secs(2),
        }
    }

    /// Writes the records so far, unless the last write was too recent.
    pub fn maybe_write(&mut self, finished: &[Option<NodeRecord>]) {
        if self.last_write.elapsed() < self.spacing {
            return;
        }
        let started = Instant::now();
        let mut partial = self.record.clone();
        partial.nodes = finished.iter().flatten().cloned().collect();
        for node in &partial.nodes {
            *partial.counts.entry(node.status).or_insert(0) += 1;
        }
        // A failed rewrite leaves the previous one: the final record is written either way.
        let _ = partial.write(&self.dir);
        self.spacing = self.spacing.max(started.elapsed() * 10);
        self.last_write = Instant::now();
    }
}
