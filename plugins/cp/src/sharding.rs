//! How the sequence is dealt over a ring: which tokens each ring rank holds. Every rank holds
//! the same number of tokens (the ring passes equal K/V shards, Ulysses splits equal pieces), so a
//! sharding decides only *which* tokens go together. Its quality is the balance of the ranks'
//! work: a rank computes its queries against every key the mask allows, so its work is the mask's
//! area over its query rows. The bytes sent do not depend on the sharding (every K/V shard goes
//! round the ring once), but the number of pieces a rank's tokens come in does: fewer pieces,
//! fewer and larger local kernel calls.

use attnbench_sdk::mask::MaskSet;

use crate::balance;
use crate::layout::{Layout, LayoutError};

attnbench_sdk::named_enum! {
    /// The shardings a stage names.
    pub enum ShardingKind {
        Contiguous = "contiguous",
        Zigzag = "zigzag",
        Striped = "striped",
        Balanced = "balanced",
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Sharding {
    /// Ring rank r holds the r-th of R equal pieces.
    Contiguous,
    /// Dual chunks: rank r holds chunks r and 2R−1−r of 2R, so causal work is even.
    Zigzag,
    /// Stripes of `width` tokens dealt round robin (Striped Attention): token t goes to rank
    /// ⌊t / width⌋ mod R. Width 1 is the paper's token-level permutation; wider stripes keep
    /// tiles whole.
    Striped { width: usize },
    /// Chunks of `chunk` tokens given to ranks by [`balance::assign`], so that each rank's
    /// attention area is even for the mask at hand.
    Balanced { chunk: usize },
}

impl Sharding {
    /// The sharding a stage's `sharding`, `stripe` and `chunk` parameters name.
    pub fn of(kind: ShardingKind, stripe: usize, chunk: usize) -> Sharding {
        match kind {
            ShardingKind::Contiguous => Sharding::Contiguous,
            ShardingKind::Zigzag => Sharding::Zigzag,
            ShardingKind::Striped => Sharding::Striped { width: stripe },
            ShardingKind::Balanced => Sharding::Balanced { chunk },
        }
    }

    /// As a record names it: `zigzag`, `striped(64)`, `balanced(128)`.
    pub fn name(&self) -> String {
        match self {
            Sharding::Contiguous => "contiguous".into(),
            Sharding::Zigzag => "zigzag".into(),
            Sharding::Striped { width } => format!("striped({width})"),
            Sharding::Balanced { chunk } => format!("balanced({chunk})"),
        }
    }

    /// Why this sharding cannot deal `seqlen` tokens over a ring of `ring` ranks whose shards
    /// split into `ulysses` equal pieces, if it cannot.
    pub fn check(&self, seqlen: usize, ring: usize, ulysses: usize) -> Result<(), LayoutError> {
        let need = |unit: usize, what: String| {
            if unit == 0 || !seqlen.is_multiple_of(unit) {
                Err(LayoutError::Seqlen { seqlen, what, unit })
            } else {
                Ok(())
            }
        };
        if ring == 0 || ulysses == 0 {
            return Err(LayoutError::EmptyGroup);
        }
        match *self {
            Sharding::Contiguous => need(ring * ulysses, "ring·ulysses".into()),
            Sharding::Zigzag => need(2 * ring * ulysses, "2·ring·ulysses".into()),
            Sharding::Striped { width } => {
                need(width * ring, format!("stripe·ring ({width}·{ring})"))?;
                need(ring * ulysses, "ring·ulysses".into())
            }
            Sharding::Balanced { chunk } => {
                need(chunk * ring, format!("chunk·ring ({chunk}·{ring})"))?;
                need(ring * ulysses, "ring·ulysses".into())
            }
        }
    }

    /// The tokens of every ring rank, ascending. `work` gives each token's work (its row's area
    /// summed over the query heads); only the balanced sharding reads it.
    pub fn shards(
        &self,
        seqlen: usize,
        ring: usize,
        work: impl FnOnce() -> Vec<u64>,
    ) -> Vec<Vec<u32>> {
        match *self {
            Sharding::Contiguous => {
                let piece = seqlen / ring;
                (0..ring).map(|r| range(r * piece, piece)).collect()
            }
            Sharding::Zigzag => {
                let chunk = seqlen / (2 * ring);
                (0..ring)
                    .map(|r| {
                        let mut tokens = range(r * chunk, chunk);
                        tokens.extend(range((2 * ring - 1 - r) * chunk, chunk));
                        tokens
                    })
                    .collect()
            }
            Sharding::Striped { width } => (0..ring)
                .map(|r| {
                    (r * width..seqlen)
                        .step_by(width * ring)
                        .flat_map(|start| range(start, width))
                        .collect()
                })
                .collect(),
            Sharding::Balanced { chunk } => {
                let work = work();
                let per_chunk: Vec<u64> = work.chunks(chunk).map(|c| c.iter().sum()).collect();
                balance::assign(&per_chunk, ring)
                    .into_iter()
                    .map(|chunks| {
                        chunks
                            .into_iter()
                            .flat_map(|c| range(c * chunk, chunk))
                            .collect()
                    })
                    .collect()
            }
        }
    }
}

fn range(start: usize, len: usize) -> Vec<u32> {
    (start as u32..(start + len) as u32).collect()
}

/// Each query token's attention area summed over the query heads: the unit of a rank's work.
pub fn row_work(set: &MaskSet, heads_q: u64, heads_kv: u64) -> Vec<u64> {
    let mut heads_of = vec![0u64; set.masks.len()];
    for head in 0..heads_q {
        heads_of[set.mask_index(head, heads_q, heads_kv)] += 1;
    }
    let mut work = vec![0u64; set.seqlen as usize];
    for (mask, heads) in set.masks.iter().zip(heads_of) {
        if heads > 0 {
            mask.for_each_row(|q, intervals| {
                work[q as usize] += heads * intervals.iter().map(|(a, b)| b - a).sum::<u64>();
            });
        }
    }
    work
}

/// max / mean of the ranks' work: 1 is perfect balance.
pub fn imbalance(rank_work: &[u64]) -> f64 {
    let total: u64 = rank_work.iter().sum();
    if total == 0 {
        return 1.0;
    }
    let mean = total as f64 / rank_work.len() as f64;
    rank_work.iter().copied().max().unwrap_or(0) as f64 / mean
}

/// The pieces (runs of consecutive tokens) a rank's tokens come in.
pub fn pieces(tokens: &[u32]) -> usize {
    tokens.windows(2).filter(|w| w[1] != w[0] + 1).count() + usize::from(!tokens.is_empty())
}

/// Each world rank's (attention area, pieces): the allowed keys of its ring shard's query rows
/// over its Ulysses group's share of the query heads, and the runs its tokens come in.
pub fn rank_shares(
    layout: &Layout,
    set: &MaskSet,
    heads_q: usize,
    heads_kv: usize,
) -> Vec<(u64, u64)> {
    // Each distinct mask's row areas, computed once.
    let mut rows_of: Vec<Option<Vec<u64>>> = vec![None; set.masks.len()];
    let per_member = heads_q / layout.ulysses;
    (0..layout.world())
        .map(|w| {
            let (u, r) = layout.coords(w);
            let shard = layout.ring_positions(r);
            let mut area = 0;
            for head in u * per_member..(u + 1) * per_member {
                let index = set.mask_index(head as u64, heads_q as u64, heads_kv as u64);
                let rows = rows_of[index].get_or_insert_with(|| {
                    let mut rows = vec![0u64; set.seqlen as usize];
                    set.masks[index].for_each_row(|q, intervals| {
                        rows[q as usize] = intervals.iter().map(|(a, b)| b - a).sum();
                    });
                    rows
                });
                area += shard.iter().map(|&q| rows[q as usize]).sum::<u64>();
            }
            (area, pieces(&layout.positions(w)) as u64)
        })
        .collect()
}

/// The imbalance `sharding` leaves on a ring of `ring` ranks over `seqlen` tokens of the cost
/// model's masks: every row alike (full) or row q holding q + 1 keys (causal). Ulysses groups
/// split heads evenly, so only the ring matters.
pub fn model_imbalance(
    sharding: Sharding,
    causal: bool,
    seqlen: usize,
    ring: usize,
) -> Result<f64, LayoutError> {
    sharding.check(seqlen, ring, 1)?;
    let work = || -> Vec<u64> {
        (0..seqlen as u64)
            .map(|q| if causal { q + 1 } else { seqlen as u64 })
            .collect()
    };
    let row = |q: u32| if causal { q as u64 + 1 } else { seqlen as u64 };
    let areas: Vec<u64> = sharding
        .shards(seqlen, ring, work)
        .iter()
        .map(|shard| shard.iter().map(|&q| row(q)).sum())
        .collect();
    Ok(imbalance(&areas))
}
