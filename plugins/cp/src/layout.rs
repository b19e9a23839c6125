//! Who holds which tokens and heads. A world of `U × R` ranks: Ulysses groups of `U` ranks split
//! heads, ring groups of `R` ranks split the sequence. The sequence is first dealt over the ring
//! in zigzag (dual-chunk) order — ring rank r holds chunks r and 2R−1−r of 2R, so causal work is
//! even — then each ring shard is split contiguously over its Ulysses group. Ulysses alone is
//! `U = N, R = 1` (contiguous pieces); the rings alone are `U = 1, R = N`.
//!
//! Unlike LongCA-bench, chunks are cut from the whole sequence, not per document: the mask (any
//! mask of the IR) decides which pairs are computed, so documents need no padding.

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

#[derive(Debug, Clone, Copy, serde::Serialize, serde::Deserialize)]
pub struct Layout {
    pub seqlen: usize,
    pub ulysses: usize,
    pub ring: usize,
    pub placement: Placement,
}

impl Layout {
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

    /// Why this layout cannot shard the sequence, if it cannot.
    pub fn check(&self) -> Result<(), String> {
        let pieces = 2 * self.ring * self.ulysses;
        if self.ulysses == 0 || self.ring == 0 || !self.seqlen.is_multiple_of(pieces) {
            return Err(format!(
                "seqlen {} must be a multiple of 2·ring·ulysses = {pieces}",
                self.seqlen
            ));
        }
        Ok(())
    }

    /// The tokens of ring rank r (zigzag chunks r and 2R−1−r), in order.
    pub fn ring_positions(&self, r: usize) -> Vec<u32> {
        let chunk = self.seqlen / (2 * self.ring);
        let head = r * chunk..(r + 1) * chunk;
        let tail = (2 * self.ring - 1 - r) * chunk..(2 * self.ring - r) * chunk;
        head.chain(tail).map(|p| p as u32).collect()
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
    fn every_token_is_held_by_exactly_one_rank() {
        for (ulysses, ring) in [(1, 4), (4, 1), (2, 3), (3, 2), (2, 4)] {
            for placement in [Placement::RingInner, Placement::UlyssesInner] {
                let layout = Layout {
                    seqlen: 48,
                    ulysses,
                    ring,
                    placement,
                };
                layout.check().unwrap();
                let mut seen: Vec<u32> = (0..layout.world())
                    .flat_map(|w| layout.positions(w))
                    .collect();
                seen.sort();
                assert_eq!(seen, (0..48).collect::<Vec<_>>());
                for w in 0..layout.world() {
                    let (u, r) = layout.coords(w);
                    assert_eq!(layout.world_rank(u, r), w);
                }
            }
        }
        let zigzag = Layout {
            seqlen: 8,
            ulysses: 1,
            ring: 2,
            placement: Placement::RingInner,
        };
        assert_eq!(zigzag.positions(0), vec![0, 1, 6, 7]);
        assert_eq!(zigzag.positions(1), vec![2, 3, 4, 5]);
    }
}
