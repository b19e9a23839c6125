//! Who holds which tokens and heads. A world of `U × R` ranks: Ulysses groups of `U` ranks split
//! heads, ring groups of `R` ranks split the sequence. The sequence is first dealt over the ring
//! by a [`Sharding`] (zigzag, dual chunks, by default: ring rank r holds chunks r and 2R−1−r of
//! 2R, so causal work is even), then each ring shard is split into equal consecutive pieces over
//! its Ulysses group. Ulysses alone is `U = N, R = 1`; the rings alone are `U = 1, R = N`.
//!
//! Unlike LongCA-bench, chunks are cut from the whole sequence, not per document: the mask (any
//! mask of the IR) decides which pairs are computed, so documents need no padding.

use crate::sharding::Sharding;

attnbench_sdk::named_enum! {
    /// Which of the two groups is made of consecutive world ranks (the fast, intra-node,
    /// dimension when ranks are numbered node by node).
    pub enum Placement {
        /// Ring groups are consecutive ranks: world rank = u·R + r.
        RingInner = "ring_inner",
        /// Ulysses groups are consecutive ranks: world rank = r·U + u.
        UlyssesInner = "ulysses_inner",
    }
}

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Layout {
    pub seqlen: usize,
    pub ulysses: usize,
    pub ring: usize,
    pub placement: Placement,
    pub sharding: Sharding,
    /// The tokens of each ring rank, ascending: the sharding applied once.
    shards: Vec<Vec<u32>>,
}

/// Why a method's groups or a sharding cannot be laid over a problem: a parameter problem.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LayoutError {
    #[error("world must be at least 1")]
    EmptyWorld,
    #[error("the ring and the Ulysses group need at least one rank each")]
    EmptyGroup,
    #[error("ulysses ({ulysses}) must divide world ({world})")]
    UlyssesWorld { ulysses: usize, world: usize },
    #[error("windows ({windows}) must divide the ring size ({ring})")]
    Windows { windows: usize, ring: usize },
    /// `unit` is what the sharding deals in, `what` says of which factors.
    #[error("seqlen {seqlen} must be a multiple of {what} = {unit}")]
    Seqlen {
        seqlen: usize,
        what: String,
        unit: usize,
    },
    #[error("the layout is for {layout} tokens, the mask for {mask}")]
    Length { layout: usize, mask: usize },
    #[error("{heads_q} query heads cannot be split over {ulysses} Ulysses ranks")]
    QueryHeads { heads_q: usize, ulysses: usize },
    #[error("{heads_kv} KV heads cannot be split over {ulysses} Ulysses ranks, nor repeated to fill them")]
    KvHeads { heads_kv: usize, ulysses: usize },
}

impl Layout {
    /// The layout of `seqlen` tokens over `ulysses × ring` ranks, or why the sharding cannot deal
    /// them. `work` gives each token's work (see [`crate::sharding::row_work`]); only the balanced
    /// sharding reads it.
    pub fn new(
        seqlen: usize,
        ulysses: usize,
        ring: usize,
        placement: Placement,
        sharding: Sharding,
        work: impl FnOnce() -> Vec<u64>,
    ) -> Result<Layout, LayoutError> {
        sharding.check(seqlen, ring, ulysses)?;
        Ok(Layout {
            seqlen,
            ulysses,
            ring,
            placement,
            sharding,
            shards: sharding.shards(seqlen, ring, work),
        })
    }

    /// The groups alone, with no tokens dealt: what the cost model needs of a layout.
    pub fn groups(seqlen: usize, ulysses: usize, ring: usize, placement: Placement) -> Layout {
        Layout {
            seqlen,
            ulysses,
            ring,
            placement,
            sharding: Sharding::Zigzag,
            shards: Vec::new(),
        }
    }

    pub fn world(&self) -> usize {
        self.ulysses * self.ring
    }

    /// (Ulysses index u, ring index r) of a world rank.
    pub fn coords(&self, world_rank: usize) -> (usize, usize) {
        match self.placement {
            Placement::RingInner => (world_rank / self.ring, world_rank % self.ring),
            Placement::UlyssesInner => (world_rank % self.ulysses, world_rank / self.ulysses),
        }
    }

    pub fn world_rank(&self, u: usize, r: usize) -> usize {
        match self.placement {
            Placement::RingInner => u * self.ring + r,
            Placement::UlyssesInner => r * self.ulysses + u,
        }
    }

    /// The tokens of ring rank r, ascending.
    pub fn ring_positions(&self, r: usize) -> &[u32] {
        &self.shards[r]
    }

    /// The tokens of a world rank: its piece of its ring shard.
    pub fn positions(&self, world_rank: usize) -> Vec<u32> {
        let (u, r) = self.coords(world_rank);
        let shard = self.ring_positions(r);
        let piece = shard.len() / self.ulysses;
        shard[u * piece..(u + 1) * piece].to_vec()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_token_is_held_by_exactly_one_rank_under_every_sharding() {
        let causal = || (1..=48).collect::<Vec<u64>>();
        for sharding in [
            Sharding::Contiguous,
            Sharding::Zigzag,
            Sharding::Striped { width: 1 },
            Sharding::Striped { width: 2 },
            Sharding::Balanced { chunk: 2 },
        ] {
            for (ulysses, ring) in [(1, 4), (4, 1), (2, 3), (3, 2), (2, 4)] {
                for placement in [Placement::RingInner, Placement::UlyssesInner] {
                    let layout =
                        Layout::new(48, ulysses, ring, placement, sharding, causal).unwrap();
                    let mut seen: Vec<u32> = (0..layout.world())
                        .flat_map(|w| layout.positions(w))
                        .collect();
                    seen.sort();
                    assert_eq!(
                        seen,
                        (0..48).collect::<Vec<_>>(),
                        "{sharding:?} {ulysses}×{ring}"
                    );
                    for w in 0..layout.world() {
                        let (u, r) = layout.coords(w);
                        assert_eq!(layout.world_rank(u, r), w);
                        assert_eq!(layout.positions(w).len(), 48 / layout.world());
                    }
                }
            }
        }
    }

    #[test]
    fn each_sharding_deals_the_tokens_it_names() {
        let layout =
            |sharding| Layout::new(8, 1, 2, Placement::RingInner, sharding, Vec::new).unwrap();
        let zigzag = layout(Sharding::Zigzag);
        assert_eq!(zigzag.positions(0), vec![0, 1, 6, 7]);
        assert_eq!(zigzag.positions(1), vec![2, 3, 4, 5]);
        assert_eq!(layout(Sharding::Contiguous).positions(1), vec![4, 5, 6, 7]);
        assert_eq!(
            layout(Sharding::Striped { width: 1 }).positions(1),
            vec![1, 3, 5, 7]
        );
        assert_eq!(
            layout(Sharding::Striped { width: 2 }).positions(0),
            vec![0, 1, 4, 5]
        );
        let refused = Layout::new(
            10,
            1,
            4,
            Placement::RingInner,
            Sharding::Striped { width: 2 },
            Vec::new,
        );
        assert_eq!(
            refused.unwrap_err().to_string(),
            "seqlen 10 must be a multiple of stripe·ring (2·4) = 8"
        );
    }
}
