//! The mask IR: a mask is the union of slices `(q_range, k_range, kind)`. Every kernel encoding
//! (dense bitmap, block mask, FlashMask columns, varlen + window) and every FLOPs figure is derived
//! from it, so a kernel and its FLOPs can never disagree about which cells it computed.
//!
//! Geometry of a slice with local row `i = q − q.start`, column `j = k − k.start`, lengths `Lq`, `Lk`
//! and `d = Lk − Lq`:
//!
//! | kind        | allowed (i, j)         | notes                                   |
//! |-------------|------------------------|-----------------------------------------|
//! | `full`      | always                 |                                         |
//! | `causal`    | `j ≤ i + d`            | bottom-right aligned; with `d < 0` the first `−d` rows are empty |
//! | `inv_causal`| `j ≥ i`                | top-left aligned                        |
//! | `bi_causal` | `i ≤ j ≤ i + d`        | a band; empty when `d < 0`              |
//!
//! For every kind the allowed keys of a row form one interval whose ends never decrease from one
//! row to the next (and likewise the allowed rows of a key): the encodings rely on that.

mod encode;
mod set;
mod tables;
mod window;

use serde::{Deserialize, Serialize};

pub use encode::{BlockMask, Dense, FlashMask, NotExpressible, Tile, Varlen};
pub use set::{HeadScope, HeadsError, MaskSet};
pub use tables::{BlockGrid, RowRuns};
pub use window::window_slices;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SliceKind {
    Full,
    Causal,
    InvCausal,
    BiCausal,
}

impl SliceKind {
    /// The kind's name in mask files.
    pub fn name(self) -> &'static str {
        match self {
            SliceKind::Full => "full",
            SliceKind::Causal => "causal",
            SliceKind::InvCausal => "inv_causal",
            SliceKind::BiCausal => "bi_causal",
        }
    }
}

/// A half-open range `[start, end)` of token positions.
pub type Span = [u64; 2];

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Slice {
    pub q: Span,
    pub k: Span,
    pub kind: SliceKind,
}

impl Slice {
    pub fn new(q: Span, k: Span, kind: SliceKind) -> Self {
        Slice { q, k, kind }
    }

    fn lengths(&self) -> (i64, i64) {
        (
            (self.q[1] - self.q[0]) as i64,
            (self.k[1] - self.k[0]) as i64,
        )
    }

    /// Allowed keys of row `q` (which must lie in the slice's q-range), or `None`.
    #[inline]
    pub fn keys_of_row(&self, q: u64) -> Option<(u64, u64)> {
        let (lq, lk) = self.lengths();
        let i = (q - self.q[0]) as i64;
        let d = lk - lq;
        let (lo, hi) = match self.kind {
            SliceKind::Full => (0, lk),
            SliceKind::Causal => (0, (i + d + 1).min(lk)),
            SliceKind::InvCausal => (i, lk),
            SliceKind::BiCausal => (i, (i + d + 1).min(lk)),
        };
        (hi > lo && lo < lk && hi > 0)
            .then(|| (self.k[0] + lo.max(0) as u64, self.k[0] + hi as u64))
    }

    /// Allowed rows of key `k` (which must lie in the slice's k-range), or `None`.
    #[inline]
    pub fn rows_of_key(&self, k: u64) -> Option<(u64, u64)> {
        let (lq, lk) = self.lengths();
        let j = (k - self.k[0]) as i64;
        let d = lk - lq;
        let (lo, hi) = match self.kind {
            SliceKind::Full => (0, lq),
            SliceKind::Causal => ((j - d).max(0), lq),
            SliceKind::InvCausal => (0, (j + 1).min(lq)),
            SliceKind::BiCausal => ((j - d).max(0), (j + 1).min(lq)),
        };
        (hi > lo).then(|| (self.q[0] + lo as u64, self.q[0] + hi as u64))
    }

    /// The rows that have at least one allowed key, as a range (they are contiguous).
    pub fn nonempty_rows(&self) -> Option<(u64, u64)> {
        let (lq, lk) = self.lengths();
        let d = lk - lq;
        let (lo, hi) = match self.kind {
            SliceKind::Full => (0, lq),
            SliceKind::Causal => ((-d).max(0), lq),
            SliceKind::InvCausal => (0, lq.min(lk)),
            SliceKind::BiCausal => (0, if d >= 0 { lq } else { 0 }),
        };
        (hi > lo && lk > 0).then(|| (self.q[0] + lo as u64, self.q[0] + hi as u64))
    }

    /// Number of allowed cells, saturating at `u64::MAX`: a slice of a [`Mask`] never gets there
    /// (masks of more than `u64::MAX` cells are refused), see [`Slice::exact_area`] otherwise.
    pub fn area(&self) -> u64 {
        u64::try_from(self.exact_area()).unwrap_or(u64::MAX)
    }

    /// Number of allowed cells, exactly: the intermediate products of the closed forms pass
    /// 2⁶⁴ at 2³² tokens even where the area itself fits.
    pub fn exact_area(&self) -> u128 {
        let lq = u128::from(self.q[1].saturating_sub(self.q[0]));
        let lk = u128::from(self.k[1].saturating_sub(self.k[0]));
        match self.kind {
            SliceKind::Full => lq * lk,
            SliceKind::Causal | SliceKind::InvCausal => {
                let h = lq.min(lk);
                (2 * lk - h + 1) * h / 2
            }
            SliceKind::BiCausal => {
                if lk >= lq {
                    (lk - lq + 1) * lq
                } else {
                    0
                }
            }
        }
    }

    fn is_empty(&self) -> bool {
        self.q[1] <= self.q[0] || self.k[1] <= self.k[0] || self.nonempty_rows().is_none()
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MaskError {
    #[error("slice {index} has q-range [{start}, {end}) outside [0, {seqlen})")]
    QOutOfRange {
        index: usize,
        start: u64,
        end: u64,
        seqlen: u64,
    },
    #[error("slice {index} has k-range [{start}, {end}) outside [0, {seqlen})")]
    KOutOfRange {
        index: usize,
        start: u64,
        end: u64,
        seqlen: u64,
    },
    #[error("a {seqlen_q} × {seqlen_k} mask has {cells} cells, more than the 2^64 − 1 that areas and FLOPs are counted in; use at most 4294967295 tokens (2^32 − 1) on each side")]
    TooLarge {
        seqlen_q: u64,
        seqlen_k: u64,
        cells: u128,
    },
}

/// A mask over `seqlen_q × seqlen_k` cells: the union of its slices.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Mask {
    pub seqlen_q: u64,
    pub seqlen_k: u64,
    pub slices: Vec<Slice>,
}

/// FLOPs of attention over a mask: `fwd = 2·area·h_q·(d_qk + d_v)` (S = QKᵀ and O = PV; with
/// equal head dims `4·area·h_q·d`), `bwd = 2.5·fwd`, `fwd_bwd = 3.5·fwd`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Flops {
    pub fwd: u64,
    pub bwd: u64,
    pub fwd_bwd: u64,
}

impl Flops {
    /// `area` counted over the query heads (`heads_q`), as LongCA-bench counts them; `None`
    /// when a count does not fit in 64 bits (about 1.8·10¹⁹).
    pub fn checked_of(area: u64, heads_q: u64, head_dim: u64, value_dim: u64) -> Option<Flops> {
        let dims = u128::from(head_dim) + u128::from(value_dim);
        let fwd = 2 * u128::from(area) * u128::from(heads_q) * dims;
        Some(Flops {
            fwd: u64::try_from(fwd).ok()?,
            bwd: u64::try_from(fwd / 2 * 5).ok()?,
            fwd_bwd: u64::try_from(fwd / 2 * 7).ok()?,
        })
    }

    /// Like [`Flops::checked_of`], saturating at `u64::MAX` instead of wrapping: kernels check
    /// with [`MaskSet::check_heads`] first, which refuses counts that do not fit.
    pub fn of(area: u64, heads_q: u64, head_dim: u64, value_dim: u64) -> Flops {
        Flops::checked_of(area, heads_q, head_dim, value_dim).unwrap_or(Flops {
            fwd: u64::MAX,
            bwd: u64::MAX,
            fwd_bwd: u64::MAX,
        })
    }

    pub fn for_direction(&self, direction: crate::measure::Direction) -> u64 {
        use crate::measure::Direction;
        match direction {
            Direction::Fwd => self.fwd,
            Direction::Bwd => self.bwd,
            Direction::FwdBwd => self.fwd_bwd,
        }
    }
}

impl Mask {
    /// A mask from slices; empty slices are dropped, ranges outside the sequence refused.
    pub fn new(seqlen_q: u64, seqlen_k: u64, slices: Vec<Slice>) -> Result<Mask, MaskError> {
        Mask::check_size(seqlen_q, seqlen_k)?;
        for (index, slice) in slices.iter().enumerate() {
            if slice.q[0] > slice.q[1] || slice.q[1] > seqlen_q {
                return Err(MaskError::QOutOfRange {
                    index,
                    start: slice.q[0],
                    end: slice.q[1],
                    seqlen: seqlen_q,
                });
            }
            if slice.k[0] > slice.k[1] || slice.k[1] > seqlen_k {
                return Err(MaskError::KOutOfRange {
                    index,
                    start: slice.k[0],
                    end: slice.k[1],
                    seqlen: seqlen_k,
                });
            }
        }
        let slices = slices.into_iter().filter(|s| !s.is_empty()).collect();
        Ok(Mask {
            seqlen_q,
            seqlen_k,
            slices,
        })
    }

    /// Refuses masks whose cell count does not fit in `u64`, so that no area can overflow.
    pub fn check_size(seqlen_q: u64, seqlen_k: u64) -> Result<(), MaskError> {
        let cells = u128::from(seqlen_q) * u128::from(seqlen_k);
        if cells > u128::from(u64::MAX) {
            return Err(MaskError::TooLarge {
                seqlen_q,
                seqlen_k,
                cells,
            });
        }
        Ok(())
    }

    /// A square mask.
    pub fn square(seqlen: u64, slices: Vec<Slice>) -> Result<Mask, MaskError> {
        Mask::new(seqlen, seqlen, slices)
    }

    /// Whether the slices' bounding rectangles are pairwise disjoint, so that areas simply add.
    pub fn slices_disjoint(&self) -> bool {
        let mut order: Vec<&Slice> = self.slices.iter().collect();
        order.sort_by_key(|s| s.q[0]);
        let mut active: Vec<&Slice> = Vec::new();
        for slice in order {
            active.retain(|a| a.q[1] > slice.q[0]);
            if active
                .iter()
                .any(|a| a.k[0] < slice.k[1] && slice.k[0] < a.k[1])
            {
                return false;
            }
            active.push(slice);
        }
        true
    }

    /// The exact number of allowed cells, overlaps counted once.
    pub fn area(&self) -> u64 {
        if self.slices_disjoint() {
            // Disjoint slices cover at most seqlen_q × seqlen_k cells, which `new` keeps within
            // u64; a mask read from a file past that saturates rather than wraps.
            let exact: u128 = self.slices.iter().map(Slice::exact_area).sum();
            return u64::try_from(exact).unwrap_or(u64::MAX);
        }
        let mut area = 0;
        self.for_each_row(|_, intervals| area += intervals.iter().map(|(a, b)| b - a).sum::<u64>());
        area
    }

    /// Calls `visit(q, intervals)` for every row, with the row's allowed keys as sorted, merged,
    /// disjoint intervals.
    pub fn for_each_row(&self, visit: impl FnMut(u64, &[(u64, u64)])) {
        sweep(
            &self.slices,
            self.seqlen_q,
            |s| s.q,
            Slice::keys_of_row,
            visit,
        );
    }

    /// Like [`Mask::for_each_row`], by key column: the allowed rows of every key.
    pub fn for_each_column(&self, visit: impl FnMut(u64, &[(u64, u64)])) {
        sweep(
            &self.slices,
            self.seqlen_k,
            |s| s.k,
            Slice::rows_of_key,
            visit,
        );
    }

    /// Whether cell (q, k) is allowed, straight from the slices (for tests and small pictures).
    pub fn allows(&self, q: u64, k: u64) -> bool {
        self.slices.iter().any(|s| {
            s.q[0] <= q && q < s.q[1] && s.keys_of_row(q).is_some_and(|(a, b)| a <= k && k < b)
        })
    }

    /// Fraction of the `seqlen_q × seqlen_k` cells that are allowed.
    pub fn density(&self) -> f64 {
        let cells = self.seqlen_q as f64 * self.seqlen_k as f64;
        if cells == 0.0 {
            0.0
        } else {
            self.area() as f64 / cells
        }
    }
}

/// Visits positions `0..length` along one axis (rows or keys), keeping the slices whose `span`
/// covers the position active, and hands `visit` the merged intervals `cross` gives there.
fn sweep(
    slices: &[Slice],
    length: u64,
    span: impl Fn(&Slice) -> Span,
    cross: impl Fn(&Slice, u64) -> Option<(u64, u64)>,
    mut visit: impl FnMut(u64, &[(u64, u64)]),
) {
    let mut order: Vec<&Slice> = slices.iter().collect();
    order.sort_by_key(|s| span(s)[0]);
    let mut next = 0;
    let mut active: Vec<&Slice> = Vec::new();
    let mut intervals = Vec::new();
    for position in 0..length {
        active.retain(|s| span(s)[1] > position);
        while next < order.len() && span(order[next])[0] <= position {
            if span(order[next])[1] > position {
                active.push(order[next]);
            }
            next += 1;
        }
        intervals.clear();
        intervals.extend(active.iter().filter_map(|s| cross(s, position)));
        merge(&mut intervals);
        visit(position, &intervals);
    }
}

/// Sorts and merges intervals in place (touching intervals merge too).
fn merge(intervals: &mut Vec<(u64, u64)>) {
    if intervals.len() < 2 {
        return;
    }
    intervals.sort_unstable();
    let mut write = 0;
    for read in 1..intervals.len() {
        if intervals[read].0 <= intervals[write].1 {
            intervals[write].1 = intervals[write].1.max(intervals[read].1);
        } else {
            write += 1;
            intervals[write] = intervals[read];
        }
    }
    intervals.truncate(write + 1);
}

#[cfg(test)]
mod tests;
