//! Kernel encodings derived from the mask IR, and their decoders (used by property tests and by
//! kernels that want to check what they were given).

use serde::{Deserialize, Serialize};

use super::{Mask, Slice};

/// Why a mask cannot be given to a kernel in a particular encoding.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("not expressible as {encoding}: {reason}")]
pub struct NotExpressible {
    pub encoding: &'static str,
    pub reason: String,
}

pub(super) fn refuse<T>(
    encoding: &'static str,
    reason: impl Into<String>,
) -> Result<T, NotExpressible> {
    Err(NotExpressible {
        encoding,
        reason: reason.into(),
    })
}

// ---------------------------------------------------------------------------------------------

/// A dense bitmap, row-major, one bit per cell.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dense {
    pub seqlen_q: u64,
    pub seqlen_k: u64,
    words_per_row: usize,
    bits: Vec<u64>,
}

impl Dense {
    /// Largest number of cells a dense bitmap is built for (16K × 16K = 32 MiB).
    pub const MAX_CELLS: u64 = 1 << 28;

    pub fn get(&self, q: u64, k: u64) -> bool {
        let word = self.bits[q as usize * self.words_per_row + (k / 64) as usize];
        word >> (k % 64) & 1 == 1
    }

    fn set_range(&mut self, q: u64, a: u64, b: u64) {
        let row = q as usize * self.words_per_row;
        for k in a..b {
            self.bits[row + (k / 64) as usize] |= 1 << (k % 64);
        }
    }

    pub fn count(&self) -> u64 {
        self.bits.iter().map(|w| w.count_ones() as u64).sum()
    }

    /// Row `q` as booleans.
    pub fn row(&self, q: u64) -> Vec<bool> {
        (0..self.seqlen_k).map(|k| self.get(q, k)).collect()
    }
}

impl Mask {
    /// The mask as a dense bitmap, for masks of at most [`Dense::MAX_CELLS`] cells.
    pub fn dense(&self) -> Result<Dense, NotExpressible> {
        let cells = self.seqlen_q.saturating_mul(self.seqlen_k);
        if cells > Dense::MAX_CELLS {
            return refuse(
                "a dense bitmap",
                format!(
                    "{} × {} cells exceed the limit of {}",
                    self.seqlen_q,
                    self.seqlen_k,
                    Dense::MAX_CELLS
                ),
            );
        }
        let words_per_row = self.seqlen_k.div_ceil(64) as usize;
        let mut dense = Dense {
            seqlen_q: self.seqlen_q,
            seqlen_k: self.seqlen_k,
            words_per_row,
            bits: vec![0; words_per_row * self.seqlen_q as usize],
        };
        self.for_each_row(|q, intervals| {
            for &(a, b) in intervals {
                dense.set_range(q, a, b);
            }
        });
        Ok(dense)
    }
}

// ---------------------------------------------------------------------------------------------

/// How much of a tile is allowed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Tile {
    Empty,
    Partial,
    Full,
}

/// The mask at tile granularity: for every row of query tiles, the non-empty key tiles in order,
/// each full or partial. Kernels skip empty tiles, run full ones unmasked and mask partial ones.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockMask {
    pub block_q: u64,
    pub block_k: u64,
    pub seqlen_q: u64,
    pub seqlen_k: u64,
    /// `row_start[t]..row_start[t + 1]` indexes the tiles of query tile row `t`.
    pub row_start: Vec<usize>,
    pub key_tiles: Vec<u32>,
    pub full: Vec<bool>,
}

impl BlockMask {
    pub fn q_tiles(&self) -> u64 {
        self.seqlen_q.div_ceil(self.block_q)
    }

    pub fn k_tiles(&self) -> u64 {
        self.seqlen_k.div_ceil(self.block_k)
    }

    /// The non-empty tiles of query tile row `t`: (key tile, full?).
    pub fn row(&self, t: usize) -> impl Iterator<Item = (u32, bool)> + '_ {
        let range = self.row_start[t]..self.row_start[t + 1];
        self.key_tiles[range.clone()]
            .iter()
            .copied()
            .zip(self.full[range].iter().copied())
    }

    pub fn tile(&self, qt: u64, kt: u64) -> Tile {
        let range = self.row_start[qt as usize]..self.row_start[qt as usize + 1];
        match self.key_tiles[range.clone()].binary_search(&(kt as u32)) {
            Ok(index) if self.full[range.start + index] => Tile::Full,
            Ok(_) => Tile::Partial,
            Err(_) => Tile::Empty,
        }
    }

    /// (full tiles, partial tiles).
    pub fn counts(&self) -> (usize, usize) {
        let full = self.full.iter().filter(|f| **f).count();
        (full, self.full.len() - full)
    }
}

/// One slice's contribution to a band of query tiles: a run of key tiles.
#[derive(Clone, Copy)]
struct Run {
    start: u32,
    end: u32,
    full: bool,
}

impl Mask {
    /// The block mask at `block_q × block_k` tiles (any positive sizes).
    pub fn block_mask(&self, block_q: u64, block_k: u64) -> BlockMask {
        assert!(block_q > 0 && block_k > 0, "tile sizes must be positive");
        let q_tiles = self.seqlen_q.div_ceil(block_q) as usize;
        let mut order: Vec<&Slice> = self.slices.iter().collect();
        order.sort_by_key(|s| s.q[0]);
        let mut next = 0;
        let mut active: Vec<&Slice> = Vec::new();
        let mut result = BlockMask {
            block_q,
            block_k,
            seqlen_q: self.seqlen_q,
            seqlen_k: self.seqlen_k,
            row_start: Vec::with_capacity(q_tiles + 1),
            key_tiles: Vec::new(),
            full: Vec::new(),
        };
        let mut runs: Vec<Run> = Vec::new();
        let mut events: Vec<(u32, i32, i32)> = Vec::new();
        for t in 0..q_tiles as u64 {
            result.row_start.push(result.key_tiles.len());
            let (r0, r1) = (t * block_q, ((t + 1) * block_q).min(self.seqlen_q));
            active.retain(|s| s.q[1] > r0);
            while next < order.len() && order[next].q[0] < r1 {
                if order[next].q[1] > r0 {
                    active.push(order[next]);
                }
                next += 1;
            }
            runs.clear();
            for slice in &active {
                self.slice_runs(slice, r0, r1, block_k, &mut runs);
            }
            if runs.is_empty() {
                continue;
            }
            if runs.len() == 1 {
                self.push_run(&mut result, runs[0]);
                continue;
            }
            // Several slices touch this band: sweep their runs. A tile is full if one slice makes
            // it full; a tile that only several partial runs touch is counted exactly.
            events.clear();
            for run in &runs {
                events.push((
                    run.start,
                    if run.full { 1 } else { 0 },
                    if run.full { 0 } else { 1 },
                ));
                events.push((
                    run.end,
                    if run.full { -1 } else { 0 },
                    if run.full { 0 } else { -1 },
                ));
            }
            events.sort_unstable_by_key(|e| e.0);
            let (mut fulls, mut partials) = (0i32, 0i32);
            let mut index = 0;
            while index < events.len() {
                let position = events[index].0;
                while index < events.len() && events[index].0 == position {
                    fulls += events[index].1;
                    partials += events[index].2;
                    index += 1;
                }
                let Some(&(end, _, _)) = events.get(index) else {
                    break;
                };
                for kt in position..end {
                    if fulls > 0 {
                        result.key_tiles.push(kt);
                        result.full.push(true);
                    } else if partials == 1 {
                        result.key_tiles.push(kt);
                        result.full.push(false);
                    } else if partials > 1 {
                        result.key_tiles.push(kt);
                        result.full.push(self.tile_is_full(
                            &active,
                            r0,
                            r1,
                            kt as u64 * block_k,
                            ((kt as u64 + 1) * block_k).min(self.seqlen_k),
                        ));
                    }
                }
            }
        }
        result.row_start.push(result.key_tiles.len());
        result
    }

    fn push_run(&self, result: &mut BlockMask, run: Run) {
        result.key_tiles.extend(run.start..run.end);
        result.full.extend(std::iter::repeat_n(
            run.full,
            (run.end - run.start) as usize,
        ));
    }

    /// The tiles `slice` touches in the band of rows `[r0, r1)`: partial runs around a full run.
    fn slice_runs(&self, slice: &Slice, r0: u64, r1: u64, bk: u64, runs: &mut Vec<Run>) {
        let Some((n0, n1)) = slice.nonempty_rows() else {
            return;
        };
        let (c, e) = (n0.max(r0), n1.min(r1));
        if c >= e {
            return;
        }
        let (Some(first), Some(last)) = (slice.keys_of_row(c), slice.keys_of_row(e - 1)) else {
            return;
        };
        // Ends of the row intervals never decrease, so the band covers [first.0, last.1) and every
        // row covers [last.0, first.1).
        let (touch0, touch1) = ((first.0 / bk) as u32, last.1.div_ceil(bk) as u32);
        let covers_band = c == r0 && e == r1;
        let (mut full0, mut full1) = (touch1, touch1);
        if covers_band && first.1 > last.0 {
            let f0 = last.0.div_ceil(bk);
            // The last key tile may be short: it is full when the interval reaches the sequence end.
            let f1 = if first.1 == self.seqlen_k {
                self.seqlen_k.div_ceil(bk)
            } else {
                first.1 / bk
            };
            if f1 > f0 {
                (full0, full1) = (f0 as u32, f1 as u32);
            }
        }
        if full0 >= full1 {
            runs.push(Run {
                start: touch0,
                end: touch1,
                full: false,
            });
            return;
        }
        if touch0 < full0 {
            runs.push(Run {
                start: touch0,
                end: full0,
                full: false,
            });
        }
        runs.push(Run {
            start: full0,
            end: full1,
            full: true,
        });
        if full1 < touch1 {
            runs.push(Run {
                start: full1,
                end: touch1,
                full: false,
            });
        }
    }

    /// Whether every cell of the tile rows `[r0, r1)` × keys `[k0, k1)` is allowed by the union.
    fn tile_is_full(&self, active: &[&Slice], r0: u64, r1: u64, k0: u64, k1: u64) -> bool {
        // Only slices over the tile's keys matter (a band of a block-sparse mask has hundreds).
        let touching: Vec<&Slice> = active
            .iter()
            .copied()
            .filter(|s| s.k[0] < k1 && k0 < s.k[1])
            .collect();
        let mut intervals = Vec::new();
        (r0..r1).all(|q| {
            intervals.clear();
            intervals.extend(
                touching
                    .iter()
                    .filter(|s| s.q[0] <= q && q < s.q[1])
                    .filter_map(|s| s.keys_of_row(q)),
            );
            super::merge(&mut intervals);
            intervals.iter().any(|&(a, b)| a <= k0 && k1 <= b)
        })
    }
}

// ---------------------------------------------------------------------------------------------

/// FlashMask's column-wise encoding: for key column `j`, rows `[lts, lte)` and `[uts, ute)` are
/// masked out, and with `causal` also every row above the diagonal (`q < j`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FlashMask {
    pub causal: bool,
    pub lts: Vec<u64>,
    pub lte: Vec<u64>,
    pub uts: Vec<u64>,
    pub ute: Vec<u64>,
}

impl FlashMask {
    pub fn allows(&self, q: u64, k: u64) -> bool {
        let j = k as usize;
        let masked_causally = self.causal && q < k;
        let in_lower_band = self.lts[j] <= q && q < self.lte[j];
        let in_upper_band = self.uts[j] <= q && q < self.ute[j];
        !(masked_causally || in_lower_band || in_upper_band)
    }
}

impl Mask {
    /// The FlashMask encoding, when every column's masked rows fit its two intervals.
    pub fn flashmask(&self) -> Result<FlashMask, NotExpressible> {
        const NAME: &str = "FlashMask column bounds";
        let s = self.seqlen_q;
        let mut causal = self.seqlen_q == self.seqlen_k;
        if causal {
            self.for_each_column(|k, rows| {
                if rows.first().is_some_and(|&(a, _)| a < k) {
                    causal = false;
                }
            });
        }
        let n = self.seqlen_k as usize;
        let mut encoding = FlashMask {
            causal,
            lts: vec![s; n],
            lte: vec![s; n],
            uts: vec![0; n],
            ute: vec![0; n],
        };
        let mut failure: Option<String> = None;
        self.for_each_column(|k, rows| {
            if failure.is_some() {
                return;
            }
            let j = k as usize;
            // Masked rows: the complement of `rows` within [floor, s).
            let floor = if causal { k } else { 0 };
            let mut masked = Vec::with_capacity(3);
            let mut cursor = floor;
            for &(a, b) in rows {
                if a > cursor {
                    masked.push((cursor, a));
                }
                cursor = cursor.max(b);
            }
            if cursor < s {
                masked.push((cursor, s));
            }
            match (causal, masked.as_slice()) {
                (_, []) => {}
                (true, [(a, b)]) => (encoding.lts[j], encoding.lte[j]) = (*a, *b),
                (false, [(a, b)]) => (encoding.uts[j], encoding.ute[j]) = (*a, *b),
                (false, [(a, b), (c, d)]) => {
                    (encoding.uts[j], encoding.ute[j]) = (*a, *b);
                    (encoding.lts[j], encoding.lte[j]) = (*c, *d);
                }
                (_, more) => {
                    failure = Some(format!(
                        "key {k} has {} masked row intervals; FlashMask allows {}",
                        more.len(),
                        if causal { 1 } else { 2 }
                    ));
                }
            }
        });
        match failure {
            Some(reason) => refuse(NAME, reason),
            None => Ok(encoding),
        }
    }
}

// ---------------------------------------------------------------------------------------------

/// Variable-length documents with a sliding window inside each: what FlashAttention's varlen
/// entry points take. Document `i` is `[cu_seqlens[i], cu_seqlens[i+1])`; within it, query `q`
/// sees keys `k` with `q − k ≤ left` and `k − q ≤ right` (−1 = unbounded). Causal is `right = 0`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Varlen {
    pub cu_seqlens: Vec<u64>,
    pub max_seqlen: u64,
    pub left: i64,
    pub right: i64,
}

impl Varlen {
    pub fn is_causal(&self) -> bool {
        self.right == 0
    }

    /// Allowed keys of row `q` under this encoding.
    pub fn keys_of_row(&self, q: u64) -> (u64, u64) {
        let doc = self.cu_seqlens.partition_point(|&c| c <= q) - 1;
        let (start, end) = (self.cu_seqlens[doc], self.cu_seqlens[doc + 1]);
        let lo = if self.left < 0 {
            start
        } else {
            start.max(q.saturating_sub(self.left as u64))
        };
        let hi = if self.right < 0 {
            end
        } else {
            end.min(q + self.right as u64 + 1)
        };
        (lo, hi)
    }
}

impl Mask {
    /// The varlen + window encoding, when the mask is block-diagonal with one window everywhere.
    pub fn varlen(&self) -> Result<Varlen, NotExpressible> {
        const NAME: &str = "varlen documents with a window";
        if self.seqlen_q != self.seqlen_k {
            return refuse(NAME, "queries and keys have different lengths");
        }
        let s = self.seqlen_q;
        let mut rows: Vec<(u64, u64)> = Vec::with_capacity(s as usize);
        let mut failure = None;
        self.for_each_row(|q, intervals| match intervals {
            [one] if failure.is_none() => rows.push(*one),
            _ if failure.is_none() => {
                failure = Some(if intervals.is_empty() {
                    format!("row {q} has no allowed key")
                } else {
                    format!("row {q} has {} separate key intervals", intervals.len())
                })
            }
            _ => {}
        });
        if let Some(reason) = failure {
            return refuse(NAME, reason);
        }
        // Document boundaries: positions no row's interval crosses.
        let mut cu_seqlens = vec![0];
        let mut reach = 0;
        let mut suffix_min = vec![u64::MAX; s as usize + 1];
        for q in (0..s as usize).rev() {
            suffix_min[q] = suffix_min[q + 1].min(rows[q].0);
        }
        for p in 1..s {
            reach = reach.max(rows[p as usize - 1].1);
            if reach <= p && suffix_min[p as usize] >= p {
                cu_seqlens.push(p);
            }
        }
        cu_seqlens.push(s);
        // The window: the widest reach of rows that the document does not clip.
        let (mut left, mut right) = (-1i64, -1i64);
        for bounds in cu_seqlens.windows(2) {
            for q in bounds[0]..bounds[1] {
                let (a, b) = rows[q as usize];
                // Signed: a row whose keys do not surround its query is no window; the check
                // below refuses it.
                if a > bounds[0] {
                    left = left.max(q as i64 - a as i64);
                }
                if b < bounds[1] {
                    right = right.max(b as i64 - 1 - q as i64);
                }
            }
        }
        let max_seqlen = cu_seqlens
            .windows(2)
            .map(|w| w[1] - w[0])
            .max()
            .unwrap_or(0);
        let encoding = Varlen {
            cu_seqlens,
            max_seqlen,
            left,
            right,
        };
        for q in 0..s {
            if encoding.keys_of_row(q) != rows[q as usize] {
                return refuse(
                    NAME,
                    format!(
                        "row {q} allows keys [{}, {}), which no single window gives",
                        rows[q as usize].0, rows[q as usize].1
                    ),
                );
            }
        }
        Ok(encoding)
    }
}
