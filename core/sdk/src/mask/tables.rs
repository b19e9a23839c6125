//! The two table encodings that library adapters build their own masks from (dense tensors,
//! `mask_mod` lookups, block-sparse lists): the allowed keys of every row as runs of rows, and
//! block tables on a shared grid. They are computed here, from the IR, so that an adapter in
//! another language expands them instead of interpreting the slices a second time.

use serde::{Deserialize, Serialize};

use super::encode::refuse;
use super::{Mask, NotExpressible, Slice, SliceKind};

/// The allowed keys of every row, as runs of consecutive rows whose key intervals keep their
/// number and move by a whole step per row: in run `r` (rows `rows[r]..rows[r + 1]`), interval
/// `j` of row `q` is `[lo + lo_step·(q − rows[r]), hi + hi_step·(q − rows[r]))`, each step
/// 0 or 1. A causal mask is one run, a document mask a run a document, a block table a run a
/// band of blocks: the size follows the mask's slices, not its rows.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RowRuns {
    /// Run edges, from 0 to `seqlen_q`.
    pub rows: Vec<u64>,
    /// Run `r`'s intervals are `intervals[offsets[r]..offsets[r + 1]]`, sorted and disjoint.
    pub offsets: Vec<u64>,
    /// Each interval as `[lo, lo_step, hi, hi_step]` at the run's first row.
    pub intervals: Vec<[u64; 4]>,
}

impl RowRuns {
    /// Allowed keys of row `q` under this encoding.
    pub fn keys_of_row(&self, q: u64) -> Vec<(u64, u64)> {
        let run = self.rows.partition_point(|&first| first <= q) - 1;
        let step = q - self.rows[run];
        let span = self.offsets[run] as usize..self.offsets[run + 1] as usize;
        self.intervals[span]
            .iter()
            .map(|[lo, lo_step, hi, hi_step]| (lo + lo_step * step, hi + hi_step * step))
            .collect()
    }
}

/// A run being extended: its first row, that row's intervals, and their steps once a second row
/// has fixed them.
struct OpenRun {
    first: u64,
    base: Vec<(u64, u64)>,
    steps: Option<Vec<(u64, u64)>>,
}

impl OpenRun {
    /// Whether row `q` with these intervals continues the run (fixing its steps at its second row).
    fn continues(&mut self, q: u64, intervals: &[(u64, u64)]) -> bool {
        if intervals.len() != self.base.len() {
            return false;
        }
        let distance = q - self.first;
        match &self.steps {
            Some(steps) => self.base.iter().zip(steps).zip(intervals).all(
                |(((lo, hi), (lo_step, hi_step)), (a, b))| {
                    *a == lo + lo_step * distance && *b == hi + hi_step * distance
                },
            ),
            None => {
                let step = |from: u64, to: u64| (to >= from && to - from <= 1).then(|| to - from);
                let steps: Option<Vec<(u64, u64)>> = self
                    .base
                    .iter()
                    .zip(intervals)
                    .map(|((lo, hi), (a, b))| Some((step(*lo, *a)?, step(*hi, *b)?)))
                    .collect();
                self.steps = steps;
                self.steps.is_some()
            }
        }
    }
}

impl Mask {
    /// The rows' allowed keys as [`RowRuns`]; every mask has one.
    pub fn row_runs(&self) -> RowRuns {
        let mut runs = RowRuns {
            rows: Vec::new(),
            offsets: vec![0],
            intervals: Vec::new(),
        };
        let close = |runs: &mut RowRuns, run: OpenRun| {
            let steps = run.steps.unwrap_or_else(|| vec![(0, 0); run.base.len()]);
            runs.rows.push(run.first);
            for ((lo, hi), (lo_step, hi_step)) in run.base.into_iter().zip(steps) {
                runs.intervals.push([lo, lo_step, hi, hi_step]);
            }
            runs.offsets.push(runs.intervals.len() as u64);
        };
        let mut open: Option<OpenRun> = None;
        self.for_each_row(|q, intervals| {
            if let Some(run) = open.as_mut() {
                if run.continues(q, intervals) {
                    return;
                }
            }
            let next = OpenRun {
                first: q,
                base: intervals.to_vec(),
                steps: None,
            };
            if let Some(run) = open.replace(next) {
                close(&mut runs, run);
            }
        });
        if let Some(run) = open {
            close(&mut runs, run);
        }
        runs.rows.push(self.seqlen_q);
        runs
    }
}

/// Masks made only of full rectangles, on one grid of blocks that every mask's rectangles fit
/// exactly: what block-sparse kernels take. Blocks may have any sizes; the grid's edges are every
/// rectangle's ends.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockGrid {
    /// Row-block edges, from 0 to `seqlen_q`.
    pub rows: Vec<u64>,
    /// Column-block edges, from 0 to `seqlen_k`.
    pub cols: Vec<u64>,
    /// Per mask, its kept blocks as `[row block, first column block, end column block)` runs,
    /// by row block and then column.
    pub kept: Vec<Vec<[u64; 3]>>,
}

impl BlockGrid {
    /// The most blocks (grid cells times masks) a grid is built for: past it the worker's table
    /// of blocks (a byte a block) would take hundreds of megabytes, and no block-sparse kernel
    /// takes blocks that small.
    pub const MAX_CELLS: u64 = 1 << 28;

    /// Whether cell (q, k) of mask `m` is in a kept block.
    pub fn allows(&self, m: usize, q: u64, k: u64) -> bool {
        let row = self.rows.partition_point(|&edge| edge <= q) as u64 - 1;
        let col = self.cols.partition_point(|&edge| edge <= k) as u64 - 1;
        self.kept[m]
            .iter()
            .any(|&[r, c0, c1]| r == row && c0 <= col && col < c1)
    }

    /// The masks' rectangles on their shared grid, or why they have none: a slice that is not a
    /// full rectangle, lengths that differ, or a grid past [`BlockGrid::MAX_CELLS`].
    pub fn of(masks: &[&Mask]) -> Result<BlockGrid, NotExpressible> {
        const NAME: &str = "a block grid";
        let Some(first) = masks.first() else {
            return refuse(NAME, "there is no mask");
        };
        if masks
            .iter()
            .any(|m| (m.seqlen_q, m.seqlen_k) != (first.seqlen_q, first.seqlen_k))
        {
            return refuse(NAME, "the masks have different lengths");
        }
        let mut partial: Vec<&str> = masks
            .iter()
            .flat_map(|m| &m.slices)
            .filter(|s| s.kind != SliceKind::Full)
            .map(|s| s.kind.name())
            .collect();
        if !partial.is_empty() {
            partial.sort_unstable();
            partial.dedup();
            return refuse(
                NAME,
                format!("it has {} slices, not only full blocks", partial.join(", ")),
            );
        }
        let edges = |length: u64, ends: &dyn Fn(&Slice) -> [u64; 2]| {
            let mut edges: Vec<u64> = masks
                .iter()
                .flat_map(|m| m.slices.iter().flat_map(ends))
                .chain([0, length])
                .collect();
            edges.sort_unstable();
            edges.dedup();
            edges
        };
        let rows = edges(first.seqlen_q, &|s| s.q);
        let cols = edges(first.seqlen_k, &|s| s.k);
        let (r, c) = (rows.len() - 1, cols.len() - 1);
        if (r as u64 * c as u64).saturating_mul(masks.len() as u64) > Self::MAX_CELLS {
            return refuse(
                NAME,
                format!(
                    "its grid of {r} × {c} blocks ({} masks) is past {} cells",
                    masks.len(),
                    Self::MAX_CELLS
                ),
            );
        }
        let block_of = |edges: &[u64], position: u64| edges.partition_point(|&e| e < position);
        let kept = masks
            .iter()
            .map(|mask| {
                // Per row block, a difference array over column blocks counts the rectangles
                // covering each block.
                let mut cover = vec![0i32; r * (c + 1)];
                for s in mask.slices.iter().filter(|s| s.area() > 0) {
                    let (c0, c1) = (block_of(&cols, s.k[0]), block_of(&cols, s.k[1]));
                    for row in block_of(&rows, s.q[0])..block_of(&rows, s.q[1]) {
                        cover[row * (c + 1) + c0] += 1;
                        cover[row * (c + 1) + c1] -= 1;
                    }
                }
                let mut runs = Vec::new();
                for (row, line) in cover.chunks(c + 1).enumerate() {
                    let (mut depth, mut start) = (0, None);
                    for (col, delta) in line.iter().enumerate() {
                        depth += delta;
                        match (depth > 0, start) {
                            (true, None) => start = Some(col),
                            (false, Some(c0)) => {
                                runs.push([row as u64, c0 as u64, col as u64]);
                                start = None;
                            }
                            _ => {}
                        }
                    }
                }
                runs
            })
            .collect();
        Ok(BlockGrid { rows, cols, kept })
    }
}
