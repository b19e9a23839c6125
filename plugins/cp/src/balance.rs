//! The balanced sharding's solver: chunks of the sequence to ranks, the same number each, so that
//! the most loaded rank carries as little work as it can. The idea is MagiAttention's mask-aware
//! dispatch; the algorithm here is the longest-processing-time rule under an equal-count
//! constraint, then swaps between the most and the least loaded ranks.
//!
//! Where several assignments are about as even (a full mask: all are; a causal mask: zigzag is
//! already), the one whose ranks hold the fewest separate runs of chunks wins: the bytes sent are
//! the same for every sharding, but fewer runs mean fewer, larger local kernel calls.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

/// Assignments within this fraction of the best one's maximum load count as equally even.
const EVEN: f64 = 0.005;

/// `ranks` lists of `work.len() / ranks` chunk indices each (ascending), every chunk in one
/// list, the largest per-rank sum of `work` small. `work.len()` must be a multiple of `ranks`.
pub fn assign(work: &[u64], ranks: usize) -> Vec<Vec<usize>> {
    let per = work.len() / ranks;
    let mut candidates = vec![contiguous(ranks, per)];
    if per.is_multiple_of(2) {
        candidates.push(zigzag(ranks, per));
    }
    candidates.push(swapped(work, longest_first(work, ranks, per)));
    let loads: Vec<u64> = candidates.iter().map(|c| max_load(work, c)).collect();
    let best = *loads.iter().min().unwrap_or(&0) as f64;
    let chosen = (0..candidates.len())
        .filter(|&i| loads[i] as f64 <= best * (1.0 + EVEN))
        .min_by_key(|&i| runs(&candidates[i]))
        .unwrap_or(0);
    let mut chosen = candidates.swap_remove(chosen);
    for chunks in &mut chosen {
        chunks.sort_unstable();
    }
    chosen
}

fn contiguous(ranks: usize, per: usize) -> Vec<Vec<usize>> {
    (0..ranks)
        .map(|r| (r * per..(r + 1) * per).collect())
        .collect()
}

fn zigzag(ranks: usize, per: usize) -> Vec<Vec<usize>> {
    let half = per / 2;
    (0..ranks)
        .map(|r| {
            (r * half..(r + 1) * half)
                .chain((2 * ranks - 1 - r) * half..(2 * ranks - r) * half)
                .collect()
        })
        .collect()
}

/// Chunks by decreasing work, each to the least loaded rank with room (ties: the lower rank).
fn longest_first(work: &[u64], ranks: usize, per: usize) -> Vec<Vec<usize>> {
    let mut order: Vec<usize> = (0..work.len()).collect();
    order.sort_by_key(|&c| (Reverse(work[c]), c));
    let mut ranks_by_load: BinaryHeap<Reverse<(u64, usize)>> =
        (0..ranks).map(|r| Reverse((0, r))).collect();
    let mut assigned = vec![Vec::with_capacity(per); ranks];
    for chunk in order {
        let Some(Reverse((load, rank))) = ranks_by_load.pop() else {
            break;
        };
        assigned[rank].push(chunk);
        if assigned[rank].len() < per {
            ranks_by_load.push(Reverse((load + work[chunk], rank)));
        }
    }
    assigned
}

/// Swaps one chunk of the most loaded rank for one of the least loaded while that lowers the
/// larger of the two loads; each swap takes the pair that evens them best, found by a binary
/// search over the least loaded rank's chunks (a swap costs O(c log c) for c chunks a rank).
fn swapped(work: &[u64], mut assigned: Vec<Vec<usize>>) -> Vec<Vec<usize>> {
    let mut loads: Vec<u64> = assigned
        .iter()
        .map(|c| c.iter().map(|&i| work[i]).sum())
        .collect();
    for _ in 0..4 * assigned.len() {
        let most = (0..loads.len()).max_by_key(|&r| loads[r]).unwrap_or(0);
        let least = (0..loads.len()).min_by_key(|&r| loads[r]).unwrap_or(0);
        let gap = loads[most] - loads[least];
        // Moving d from `most` to `least` leaves max(most − d, least + d): best at d = gap / 2,
        // and a swap helps only for 0 < d < gap.
        let mut candidates: Vec<(u64, usize)> = assigned[least]
            .iter()
            .enumerate()
            .map(|(j, &b)| (work[b], j))
            .collect();
        candidates.sort_unstable();
        let mut best: Option<(u64, usize, usize)> = None;
        for (i, &a) in assigned[most].iter().enumerate() {
            let target = work[a].saturating_sub(gap / 2);
            let at = candidates.partition_point(|&(w, _)| w < target);
            for &(w_b, j) in candidates[at.saturating_sub(1)..(at + 1).min(candidates.len())].iter()
            {
                if work[a] <= w_b || work[a] - w_b >= gap {
                    continue;
                }
                let d = work[a] - w_b;
                let larger = (loads[most] - d).max(loads[least] + d);
                if best.is_none_or(|(l, _, _)| larger < l) {
                    best = Some((larger, i, j));
                }
            }
        }
        let Some((_, i, j)) = best else {
            break;
        };
        let (a, b) = (assigned[most][i], assigned[least][j]);
        assigned[most][i] = b;
        assigned[least][j] = a;
        loads[most] = loads[most] - work[a] + work[b];
        loads[least] = loads[least] + work[a] - work[b];
    }
    assigned
}

fn max_load(work: &[u64], assigned: &[Vec<usize>]) -> u64 {
    assigned
        .iter()
        .map(|chunks| chunks.iter().map(|&c| work[c]).sum())
        .max()
        .unwrap_or(0)
}

/// Runs of consecutive chunks over all ranks.
fn runs(assigned: &[Vec<usize>]) -> usize {
    assigned
        .iter()
        .map(|chunks| {
            let mut sorted = chunks.clone();
            sorted.sort_unstable();
            sorted.windows(2).filter(|w| w[1] != w[0] + 1).count() + 1
        })
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn loads(work: &[u64], assigned: &[Vec<usize>]) -> Vec<u64> {
        assigned
            .iter()
            .map(|c| c.iter().map(|&i| work[i]).sum())
            .collect()
    }

    #[test]
    fn every_chunk_goes_to_one_rank_and_every_rank_gets_as_many() {
        let work: Vec<u64> = (0..48).map(|i| (i * 7919 % 31) as u64).collect();
        for ranks in [1, 2, 3, 4, 8] {
            let assigned = assign(&work, ranks);
            assert_eq!(assigned.len(), ranks);
            assert!(assigned.iter().all(|c| c.len() == 48 / ranks));
            let mut all: Vec<usize> = assigned.concat();
            all.sort_unstable();
            assert_eq!(all, (0..48).collect::<Vec<_>>());
        }
    }

    #[test]
    fn a_uniform_mask_stays_contiguous_and_a_causal_one_takes_zigzag() {
        let full = vec![10u64; 32];
        assert_eq!(assign(&full, 4), contiguous(4, 8));
        // A causal mask's chunk work grows with the row: zigzag is exactly even.
        let causal: Vec<u64> = (0..32).map(|i| 2 * i + 1).collect();
        let assigned = assign(&causal, 4);
        let l = loads(&causal, &assigned);
        assert!(l.iter().all(|&x| x == l[0]), "{l:?}");
        assert_eq!(assigned, zigzag(4, 8));
    }

    #[test]
    fn skewed_work_is_spread_where_fixed_shardings_are_not() {
        // Documents of very different lengths, causal inside each: most work in one long one.
        let mut work = Vec::new();
        for length in [20u64, 4, 4, 2, 2] {
            work.extend((0..length).map(|i| (i + 1) * 3));
        }
        work.resize(32, 1);
        let assigned = assign(&work, 4);
        let total: u64 = work.iter().sum();
        let most = *loads(&work, &assigned).iter().max().unwrap();
        let fixed = max_load(&work, &zigzag(4, 8)).min(max_load(&work, &contiguous(4, 8)));
        assert!(most < fixed, "{most} vs {fixed}");
        assert!(
            (most as f64) < 1.1 * total as f64 / 4.0,
            "{most} of {total}"
        );
    }
}
