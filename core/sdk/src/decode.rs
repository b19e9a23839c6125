//! Decoding problems: a batch of sequences, each with its own KV cache and 1–16 new query tokens
//! (speculative decoding gives several), causal within the new tokens; the cache contiguous or in
//! pages. One packed mask-IR view of the batch gives FLOPs and checks from the same place as
//! prefill; the f64 reference works on partial results (O and LSE over a range of keys) that
//! merge exactly, which is what split-KV kernels and Tree Attention both do.
//!
//! Layout, packed over the batch: Q and O `[heads_q][queries · batch][head_dim]`, K and V
//! `[heads_kv][Σ kv_len][head_dim]`, LSE `[heads_q][queries · batch]`. Sequence `b`'s new tokens
//! are the last `queries` of its `kv_lens[b]` keys: query `i` sees keys `0 ..= kv_len − queries + i`.

use serde::{Deserialize, Serialize};

use crate::attention::RowIntervals;
use crate::mask::{Mask, MaskError, Slice, SliceKind};
use crate::rng::PyRandom;

/// New tokens per sequence a decode step may have (speculative decoding verifies up to 16).
pub const MAX_QUERIES: u64 = 16;

/// Page sizes of a paged KV cache, as serving engines use them.
pub const PAGE_SIZES: [u64; 2] = [16, 64];

/// Why a decode problem cannot be formed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("a decode batch needs at least one sequence")]
    EmptyBatch,
    #[error("kv_len must be at least 1 token")]
    EmptyCache,
    #[error("queries must be 1 to {MAX_QUERIES} new tokens per sequence, got {0}")]
    Queries(u64),
    #[error("sequence {index} has {kv_len} KV tokens, fewer than its {queries} new tokens")]
    ShortCache {
        index: usize,
        kv_len: u64,
        queries: u64,
    },
    #[error("page_size must be one of 16 or 64, got {0}")]
    PageSize(u64),
    #[error("heads_q ({heads_q}) must be a positive multiple of heads_kv ({heads_kv}), and head_dim positive")]
    Heads { heads_q: u64, heads_kv: u64 },
    #[error(transparent)]
    Mask(#[from] MaskError),
}

/// One decode step of a batch.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DecodeProblem {
    /// Each sequence's KV tokens, the new ones included.
    pub kv_lens: Vec<u64>,
    /// New tokens per sequence.
    pub queries: u64,
    pub heads_q: u64,
    pub heads_kv: u64,
    pub head_dim: u64,
    /// Tokens per page of a paged cache; `None`: each sequence's cache is contiguous.
    pub page_size: Option<u64>,
}

impl DecodeProblem {
    pub fn new(
        kv_lens: Vec<u64>,
        queries: u64,
        (heads_q, heads_kv, head_dim): (u64, u64, u64),
        page_size: Option<u64>,
    ) -> Result<DecodeProblem, DecodeError> {
        if kv_lens.is_empty() {
            return Err(DecodeError::EmptyBatch);
        }
        if !(1..=MAX_QUERIES).contains(&queries) {
            return Err(DecodeError::Queries(queries));
        }
        if let Some((index, &kv_len)) = kv_lens.iter().enumerate().find(|(_, &l)| l < queries) {
            return Err(DecodeError::ShortCache {
                index,
                kv_len,
                queries,
            });
        }
        if let Some(page) = page_size.filter(|p| !PAGE_SIZES.contains(p)) {
            return Err(DecodeError::PageSize(page));
        }
        if heads_q == 0 || heads_kv == 0 || head_dim == 0 || !heads_q.is_multiple_of(heads_kv) {
            return Err(DecodeError::Heads { heads_q, heads_kv });
        }
        let problem = DecodeProblem {
            kv_lens,
            queries,
            heads_q,
            heads_kv,
            head_dim,
            page_size,
        };
        problem.mask()?;
        Ok(problem)
    }

    /// The batch the decode stages describe: `batch` sequences whose KV lengths step down from
    /// `kv_len` by `kv_len / batch` (never under `queries`), so one step mixes long and short
    /// caches as a serving batch does; `page_size` 0 keeps each cache contiguous.
    pub fn stepped(
        batch: usize,
        kv_len: u64,
        queries: u64,
        heads: (u64, u64, u64),
        page_size: u64,
    ) -> Result<DecodeProblem, DecodeError> {
        if batch == 0 {
            return Err(DecodeError::EmptyBatch);
        }
        if kv_len == 0 {
            return Err(DecodeError::EmptyCache);
        }
        let kv_lens = (0..batch as u64)
            .map(|b| (kv_len - b * (kv_len / batch as u64)).max(queries))
            .collect();
        DecodeProblem::new(
            kv_lens,
            queries,
            heads,
            (page_size > 0).then_some(page_size),
        )
    }

    pub fn batch(&self) -> usize {
        self.kv_lens.len()
    }

    /// Query rows over the batch.
    pub fn rows(&self) -> u64 {
        self.queries * self.batch() as u64
    }

    /// KV tokens over the batch.
    pub fn keys(&self) -> u64 {
        self.kv_lens.iter().sum()
    }

    /// Where sequence `b`'s keys start in the packed K and V.
    pub fn key_offset(&self, b: usize) -> u64 {
        self.kv_lens[..b].iter().sum()
    }

    /// The batch as one mask: sequence `b`'s rows against its own keys, causal from the bottom
    /// right (its last query sees every key).
    pub fn mask(&self) -> Result<Mask, MaskError> {
        let slices = (0..self.batch())
            .map(|b| {
                let (row, key) = (b as u64 * self.queries, self.key_offset(b));
                Slice::new(
                    [row, row + self.queries],
                    [key, key + self.kv_lens[b]],
                    SliceKind::Causal,
                )
            })
            .collect();
        Mask::new(self.rows(), self.keys(), slices)
    }

    /// Forward FLOPs, `4 · area · heads_q · head_dim`, as for prefill.
    pub fn flops(&self) -> u64 {
        let area = self.mask().map(|m| m.area()).unwrap_or(u64::MAX);
        crate::mask::Flops::of(area, self.heads_q, self.head_dim, self.head_dim).fwd
    }

    /// Bytes a kernel must move at least: K and V read once per KV head, Q read and O written
    /// once, at `element_bytes` per value (the LSE is not counted).
    pub fn bytes(&self, element_bytes: u64) -> u64 {
        let kv = 2 * self.keys() * self.heads_kv * self.head_dim;
        let qo = 2 * self.rows() * self.heads_q * self.head_dim;
        (kv + qo) * element_bytes
    }

    /// The physical page of each logical page of each sequence, for a paged cache: every page of
    /// the batch in one pool, dealt in a seeded random order (so no sequence's pages are
    /// contiguous, as in a serving engine's pool after many requests). `None` when not paged.
    pub fn page_table(&self, seed: u64) -> Option<PageTable> {
        let page = self.page_size?;
        let counts: Vec<u64> = self.kv_lens.iter().map(|l| l.div_ceil(page)).collect();
        let total: u64 = counts.iter().sum();
        let mut physical: Vec<u32> = (0..total as u32).collect();
        PyRandom::new(seed).shuffle(&mut physical);
        let mut next = physical.into_iter();
        let pages = counts
            .iter()
            .map(|&count| next.by_ref().take(count as usize).collect())
            .collect();
        Some(PageTable {
            page_size: page,
            pool_pages: total,
            pages,
        })
    }
}

#[path = "decode_stage.rs"]
mod stage;
pub use stage::{
    check_step, declare_batch, declare_step, step_record, unchecked, BatchParams, StepCheck,
    StepParams, FULL_CHECK_WORK,
};

/// |x − y|, with equal values (infinities included) 0 and a NaN on either side infinite.
fn difference(x: f64, y: f64) -> f64 {
    if x == y {
        0.0
    } else if x.is_nan() || y.is_nan() {
        f64::INFINITY
    } else {
        (x - y).abs()
    }
}

/// A paged cache's pages: sequence `b`'s logical page `p` lives in pool page `pages[b][p]`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PageTable {
    pub page_size: u64,
    pub pool_pages: u64,
    pub pages: Vec<Vec<u32>>,
}

impl PageTable {
    /// A packed `[heads_kv][Σ kv_len][head_dim]` tensor laid out in the pool:
    /// `[pool_pages · page_size][heads_kv][head_dim]`, as paged kernels read it (unused slots 0).
    pub fn to_pool(&self, problem: &DecodeProblem, packed: &[f32]) -> Vec<f32> {
        let (h, d) = (problem.heads_kv as usize, problem.head_dim as usize);
        let keys = problem.keys() as usize;
        let mut pool = vec![0f32; self.pool_pages as usize * self.page_size as usize * h * d];
        self.for_each_token(problem, |packed_token, slot| {
            for head in 0..h {
                let from = (head * keys + packed_token) * d;
                let to = (slot * h + head) * d;
                pool[to..to + d].copy_from_slice(&packed[from..from + d]);
            }
        });
        pool
    }

    /// The packed tensor back from the pool (what a kernel reading through the table sees).
    pub fn from_pool(&self, problem: &DecodeProblem, pool: &[f32]) -> Vec<f32> {
        let (h, d) = (problem.heads_kv as usize, problem.head_dim as usize);
        let keys = problem.keys() as usize;
        let mut packed = vec![0f32; h * keys * d];
        self.for_each_token(problem, |packed_token, slot| {
            for head in 0..h {
                let to = (head * keys + packed_token) * d;
                let from = (slot * h + head) * d;
                packed[to..to + d].copy_from_slice(&pool[from..from + d]);
            }
        });
        packed
    }

    /// Visits every token as (its index in the packed layout, its slot in the pool).
    fn for_each_token(&self, problem: &DecodeProblem, mut visit: impl FnMut(usize, usize)) {
        let page = self.page_size as usize;
        for (b, pages) in self.pages.iter().enumerate() {
            let offset = problem.key_offset(b) as usize;
            for token in 0..problem.kv_lens[b] as usize {
                let slot = pages[token / page] as usize * page + token % page;
                visit(offset + token, slot);
            }
        }
    }
}

/// O (normalised over the keys seen) and LSE of every query row over some of its keys:
/// `[heads_q][rows][head_dim]` and `[heads_q][rows]`. Rows that saw no key have O 0, LSE −∞.
#[derive(Debug, Clone, PartialEq)]
pub struct Partial {
    pub out: Vec<f64>,
    pub lse: Vec<f64>,
}

impl Partial {
    pub fn empty(problem: &DecodeProblem) -> Partial {
        let rows = (problem.heads_q * problem.rows()) as usize;
        Partial {
            out: vec![0.0; rows * problem.head_dim as usize],
            lse: vec![f64::NEG_INFINITY; rows],
        }
    }

    /// Folds `other` (the same rows over other keys) into `self`: the exact softmax over both.
    pub fn merge(&mut self, other: &Partial, head_dim: usize) {
        for (row, (lse, &theirs)) in self.lse.iter_mut().zip(&other.lse).enumerate() {
            if theirs == f64::NEG_INFINITY {
                continue;
            }
            let merged = if *lse == f64::NEG_INFINITY {
                theirs
            } else {
                let high = lse.max(theirs);
                high + ((*lse - high).exp() + (theirs - high).exp()).ln()
            };
            let (mine, weight) = ((*lse - merged).exp(), (theirs - merged).exp());
            let span = row * head_dim..(row + 1) * head_dim;
            for (o, t) in self.out[span.clone()].iter_mut().zip(&other.out[span]) {
                *o = *o * mine + t * weight;
            }
            *lse = merged;
        }
    }

    /// Values a rank sends when it hands this partial on: O and LSE.
    pub fn values(&self) -> usize {
        self.out.len() + self.lse.len()
    }

    /// Largest absolute difference over O and LSE. Rows that saw no key on both sides (LSE −∞)
    /// agree; one side −∞ and the other finite, a NaN, or partials of different sizes are an
    /// infinite difference, not a match.
    pub fn max_difference(&self, other: &Partial) -> f64 {
        if self.out.len() != other.out.len() || self.lse.len() != other.lse.len() {
            return f64::INFINITY;
        }
        self.out
            .iter()
            .zip(&other.out)
            .chain(self.lse.iter().zip(&other.lse))
            .map(|(&x, &y)| difference(x, y))
            .fold(0.0, f64::max)
    }
}

/// The packed inputs of a decode problem.
#[derive(Debug, Clone)]
pub struct DecodeInputs {
    pub q: Vec<f32>,
    pub k: Vec<f32>,
    pub v: Vec<f32>,
}

impl DecodeInputs {
    /// Uniform in [−1, 1), from `seed`, rounded to `element`: one index-addressed stream through
    /// Q, K and V, drawn on every core (a 1M-token batch holds billions of values).
    pub fn random(problem: &DecodeProblem, seed: u64, element: crate::reference::Element) -> Self {
        let stream = crate::reference::UniformStream::new(seed, element);
        let d = problem.head_dim;
        let q_len = problem.heads_q * problem.rows() * d;
        let kv_len = problem.heads_kv * problem.keys() * d;
        DecodeInputs {
            q: stream.fill(0, q_len as usize),
            k: stream.fill(q_len, kv_len as usize),
            v: stream.fill(q_len + kv_len, kv_len as usize),
        }
    }
}

/// Attention of every query row over the keys of each sequence that fall in `share(b)` (a range
/// of that sequence's own key indices), in f64: one split of a split-KV kernel, or one rank's
/// shard of the cache.
pub fn attend(
    problem: &DecodeProblem,
    inputs: &DecodeInputs,
    share: impl Fn(usize) -> std::ops::Range<u64>,
) -> Partial {
    let d = problem.head_dim as usize;
    let (rows, keys) = (problem.rows() as usize, problem.keys() as usize);
    let group = (problem.heads_q / problem.heads_kv) as usize;
    let scale = 1.0 / (d as f64).sqrt();
    let mut partial = Partial::empty(problem);
    let mut scores = Vec::new();
    for head in 0..problem.heads_q as usize {
        let kv_head = head / group;
        for b in 0..problem.batch() {
            let kv_len = problem.kv_lens[b];
            let offset = problem.key_offset(b) as usize;
            let range = share(b);
            for i in 0..problem.queries {
                let row = b * problem.queries as usize + i as usize;
                let last = kv_len - problem.queries + i;
                let (start, end) = (range.start, range.end.min(last + 1));
                if start >= end {
                    continue;
                }
                let q = &inputs.q[(head * rows + row) * d..][..d];
                scores.clear();
                for key in start..end {
                    let at = (kv_head * keys + offset + key as usize) * d;
                    let dot: f64 = q
                        .iter()
                        .zip(&inputs.k[at..at + d])
                        .map(|(&a, &b)| f64::from(a) * f64::from(b))
                        .sum();
                    scores.push(dot * scale);
                }
                let high = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let sum: f64 = scores.iter().map(|s| (s - high).exp()).sum();
                let out = &mut partial.out[(head * rows + row) * d..][..d];
                for (key, s) in (start..end).zip(&scores) {
                    let weight = (s - high).exp() / sum;
                    let at = (kv_head * keys + offset + key as usize) * d;
                    for (o, &v) in out.iter_mut().zip(&inputs.v[at..at + d]) {
                        *o += weight * f64::from(v);
                    }
                }
                partial.lse[head * rows + row] = high + sum.ln();
            }
        }
    }
    partial
}

/// The step cut to KV head 0 and its group of query heads, with its inputs: a check of a long
/// cache at 1/heads_kv of the reference's cost. In the packed layouts both are prefixes, as are
/// the group's rows of a kernel's O and LSE.
pub fn first_group(
    problem: &DecodeProblem,
    inputs: &DecodeInputs,
) -> (DecodeProblem, DecodeInputs) {
    let group = DecodeProblem {
        heads_q: problem.heads_q / problem.heads_kv,
        heads_kv: 1,
        ..problem.clone()
    };
    let (q_len, kv_len) = (
        (group.heads_q * group.rows() * group.head_dim) as usize,
        (group.keys() * group.head_dim) as usize,
    );
    let inputs = DecodeInputs {
        q: inputs.q[..q_len].to_vec(),
        k: inputs.k[..kv_len].to_vec(),
        v: inputs.v[..kv_len].to_vec(),
    };
    (group, inputs)
}

/// The whole step's O and LSE, every key at once.
pub fn reference(problem: &DecodeProblem, inputs: &DecodeInputs) -> Partial {
    attend(problem, inputs, |b| 0..problem.kv_lens[b])
}

/// Sequence `b`'s keys split into `splits` near-equal ranges; split `s`'s range (empty where
/// the sequence has fewer keys than splits).
pub fn split_range(kv_len: u64, splits: u64, s: u64) -> std::ops::Range<u64> {
    let chunk = kv_len.div_ceil(splits.max(1));
    (s * chunk).min(kv_len)..((s + 1) * chunk).min(kv_len)
}

/// Flash-Decoding on the host: each sequence's keys in `splits` ranges, each range's partial
/// computed alone, the partials merged by their LSE.
pub fn split_kv(problem: &DecodeProblem, inputs: &DecodeInputs, splits: u64) -> Partial {
    let mut done = Partial::empty(problem);
    for s in 0..splits.max(1) {
        let part = attend(problem, inputs, |b| {
            split_range(problem.kv_lens[b], splits, s)
        });
        done.merge(&part, problem.head_dim as usize);
    }
    done
}

/// What a sequence's new tokens see of a block `keys` of its cache of `kv_len` keys (a
/// context-parallel rank's shard, or the whole cache), in the block's own coordinates: new token
/// `i` sees the sequence's keys up to `kv_len − queries + i`, so a row sees a prefix of the block,
/// empty where the block begins past its last key.
pub fn block_rows(kv_len: u64, queries: u64, keys: std::ops::Range<u64>) -> RowIntervals {
    let (mut row_start, mut intervals) = (vec![0], Vec::new());
    for i in 0..queries {
        let seen = (kv_len - queries + i + 1)
            .saturating_sub(keys.start)
            .min(keys.end - keys.start);
        if seen > 0 {
            intervals.extend([0, seen as u32]);
        }
        row_start.push((intervals.len() / 2) as u32);
    }
    RowIntervals {
        row_start,
        intervals,
    }
}

#[cfg(test)]
#[path = "decode_tests.rs"]
mod tests;
