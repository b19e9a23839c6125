//! The work lists the kernels walk, built on the host from the mask IR: per query tile the key
//! tiles it visits (and per key tile the query tiles), the order to start them, and every row's
//! and column's key intervals.

use attnbench_sdk::attention::RowIntervals;
use attnbench_sdk::mask::BlockMask;
use attnbench_sdk::reference::HeadMasks;

use super::{FORWARD_TILE, TILE, WIDE_TILE};

/// The work lists: per mask and query tile, the key tiles to visit (bit 31: partial) — for the
/// forward's and the backward's 64-row query tiles — with the forward's query tiles of each mask
/// ordered longest list first; per mask and key tile, the 64-row query tiles that visit it (the
/// backward's dK/dV), for 64-key tiles and for the wgmma kernel's 128-key ones; and per mask,
/// every row's key intervals (CSR over one shared interval array).
#[derive(Debug, PartialEq)]
pub(super) struct Tables {
    /// The forward's query rows per tile: 128, or 64 when the masks' blocks split 128-row tiles
    /// (block-sparse masks on 64-token blocks: every 128 × 64 tile partial, every row testing
    /// its key intervals, against none at 64 rows).
    pub(super) forward_rows: u64,
    pub(super) forward_tile_start: Vec<u32>,
    pub(super) forward_tiles: Vec<u32>,
    pub(super) forward_order: Vec<u32>,
    /// The wgmma forward's, at 128 rows × 128 keys.
    pub(super) wide_forward_tile_start: Vec<u32>,
    pub(super) wide_forward_tiles: Vec<u32>,
    pub(super) wide_forward_order: Vec<u32>,
    pub(super) tile_start: Vec<u32>,
    pub(super) tiles: Vec<u32>,
    pub(super) key_tile_start: Vec<u32>,
    pub(super) key_tiles: Vec<u32>,
    /// Per mask, its key tiles longest list first (the key-tile kernels' start order).
    pub(super) key_order: Vec<u32>,
    pub(super) wide_key_tile_start: Vec<u32>,
    pub(super) wide_key_tiles: Vec<u32>,
    pub(super) wide_key_order: Vec<u32>,
    pub(super) row_start: Vec<u32>,
    pub(super) intervals: Vec<u32>,
    /// Per key, the rows that see it (CSR like the rows'): the key-tile kernels' threads hold
    /// fixed keys and test a partial tile's queries against these.
    pub(super) column_start: Vec<u32>,
    pub(super) column_intervals: Vec<u32>,
}

/// One mask as the tables need it: its tiles at the forward's and the backward's sizes, and its
/// rows' key intervals.
pub(super) struct MaskTiles {
    /// At the forward's wide tiles (128 rows × 64 keys).
    pub(super) forward: BlockMask,
    /// At the wgmma forward's (128 rows × 128 keys).
    pub(super) forward_wide: BlockMask,
    pub(super) backward: BlockMask,
    /// At 64 rows × 128 keys.
    pub(super) wide_keys: BlockMask,
    pub(super) rows: RowIntervals,
}

impl MaskTiles {
    /// From a block's rows, as an in-process attention call brings them.
    pub(super) fn of_rows(rows: RowIntervals, k_len: u64) -> MaskTiles {
        MaskTiles {
            forward: rows.block_mask(k_len, FORWARD_TILE, TILE),
            forward_wide: rows.block_mask(k_len, FORWARD_TILE, WIDE_TILE),
            backward: rows.block_mask(k_len, TILE, TILE),
            wide_keys: rows.block_mask(k_len, TILE, WIDE_TILE),
            rows,
        }
    }

    /// The masks of a benchmark's mask set, their tiles from their slices.
    pub(super) fn of_set(masks: &HeadMasks) -> Vec<MaskTiles> {
        (0..masks.set.masks.len())
            .map(|index| {
                let mask = &masks.set.masks[index];
                MaskTiles {
                    forward: mask.block_mask(FORWARD_TILE, TILE),
                    forward_wide: mask.block_mask(FORWARD_TILE, WIDE_TILE),
                    backward: mask.block_mask(TILE, TILE),
                    wide_keys: mask.block_mask(TILE, WIDE_TILE),
                    rows: masks.row_intervals(index),
                }
            })
            .collect()
    }
}

/// The forward's query tile for a mask set: 128 rows, unless their partial tiles cover more
/// than twice the rows that 64-row tiles' do and more than a quarter of what 128-row tiles visit
/// (a partial tile tests each row's key intervals; a full one does not).
pub(super) fn forward_rows(masks: &[MaskTiles]) -> u64 {
    let partial = |blocks: &BlockMask| blocks.full.iter().filter(|full| !**full).count() as u64;
    let (wide, wide_visited, narrow) = masks.iter().fold((0, 0, 0), |(w, v, n), mask| {
        (
            w + partial(&mask.forward),
            v + mask.forward.full.len() as u64,
            n + partial(&mask.backward),
        )
    });
    if wide * FORWARD_TILE > 2 * narrow * TILE && 4 * wide > wide_visited {
        TILE
    } else {
        FORWARD_TILE
    }
}

pub(super) fn tables(masks: &[MaskTiles]) -> Tables {
    let mut t = Tables {
        forward_rows: FORWARD_TILE,
        forward_tile_start: vec![0],
        forward_tiles: Vec::new(),
        forward_order: Vec::new(),
        wide_forward_tile_start: vec![0],
        wide_forward_tiles: Vec::new(),
        wide_forward_order: Vec::new(),
        tile_start: vec![0],
        tiles: Vec::new(),
        key_tile_start: vec![0],
        key_tiles: Vec::new(),
        key_order: Vec::new(),
        wide_key_tile_start: vec![0],
        wide_key_tiles: Vec::new(),
        wide_key_order: Vec::new(),
        row_start: Vec::new(),
        intervals: Vec::new(),
        column_start: Vec::new(),
        column_intervals: Vec::new(),
    };
    let forward_rows = forward_rows(masks);
    t.forward_rows = forward_rows;
    for mask in masks {
        let blocks = if forward_rows == FORWARD_TILE {
            &mask.forward
        } else {
            &mask.backward
        };
        push_query_lists(
            blocks,
            &mut t.forward_tile_start,
            &mut t.forward_tiles,
            &mut t.forward_order,
        );
        push_query_lists(
            &mask.forward_wide,
            &mut t.wide_forward_tile_start,
            &mut t.wide_forward_tiles,
            &mut t.wide_forward_order,
        );

        let blocks = &mask.backward;
        for q_tile in 0..blocks.q_tiles() as usize {
            for (k_tile, full) in blocks.row(q_tile) {
                t.tiles.push(k_tile | if full { 0 } else { 1 << 31 });
            }
            t.tile_start.push(t.tiles.len() as u32);
        }
        push_key_lists(
            blocks,
            &mut t.key_tile_start,
            &mut t.key_tiles,
            &mut t.key_order,
        );
        push_key_lists(
            &mask.wide_keys,
            &mut t.wide_key_tile_start,
            &mut t.wide_key_tiles,
            &mut t.wide_key_order,
        );
        push_intervals(&mask.rows, &mut t.row_start, &mut t.intervals);
        // The key-tile kernels read a mask's columns on its partial tiles only — the wide ones
        // where the forward keeps 128-row tiles (so the wgmma kernels take them) — and a
        // block-sparse mask on its own block size has none: its columns would cost as many
        // intervals as its rows, hundreds per key at long lengths.
        let partial = |blocks: &BlockMask| blocks.full.iter().any(|full| !full);
        let k_len = mask.rows.row_start.len() - 1;
        let columns = if partial(&mask.backward)
            || (forward_rows == FORWARD_TILE && partial(&mask.wide_keys))
        {
            mask.rows.transpose(k_len)
        } else {
            RowIntervals {
                row_start: vec![0; k_len + 1],
                intervals: Vec::new(),
            }
        };
        push_intervals(&columns, &mut t.column_start, &mut t.column_intervals);
    }
    // No buffer is empty.
    t.intervals.extend([0, 0]);
    t.column_intervals.extend([0, 0]);
    t.forward_tiles.push(0);
    t.wide_forward_tiles.push(0);
    t.tiles.push(0);
    t.key_tiles.push(0);
    t.wide_key_tiles.push(0);
    t
}

/// One mask's intervals appended to a set's: its starts offset past the intervals before it.
pub(super) fn push_intervals(of: &RowIntervals, start: &mut Vec<u32>, intervals: &mut Vec<u32>) {
    let base = (intervals.len() / 2) as u32;
    start.extend(of.row_start.iter().map(|&first| base + first));
    intervals.extend_from_slice(&of.intervals);
}

/// Per query tile of `blocks`, the key tiles it visits (bit 31: partial), appended to a CSR list,
/// and the query tiles in the order to start them: longest list first.
pub(super) fn push_query_lists(
    blocks: &BlockMask,
    start: &mut Vec<u32>,
    lists: &mut Vec<u32>,
    order: &mut Vec<u32>,
) {
    let mut lengths = Vec::new();
    for q_tile in 0..blocks.q_tiles() as usize {
        let before = lists.len();
        for (k_tile, full) in blocks.row(q_tile) {
            lists.push(k_tile | if full { 0 } else { 1 << 31 });
        }
        start.push(lists.len() as u32);
        lengths.push(lists.len() - before);
    }
    push_longest_first(lengths.into_iter(), order);
}

/// Per key tile of `blocks`, the query tiles that visit it (bit 31: partial), appended to a CSR
/// list.
pub(super) fn push_key_lists(
    blocks: &BlockMask,
    start: &mut Vec<u32>,
    lists: &mut Vec<u32>,
    order: &mut Vec<u32>,
) {
    let mut by_key: Vec<Vec<u32>> = vec![Vec::new(); blocks.k_tiles() as usize];
    for q_tile in 0..blocks.q_tiles() as usize {
        for (k_tile, full) in blocks.row(q_tile) {
            by_key[k_tile as usize].push(q_tile as u32 | if full { 0 } else { 1 << 31 });
        }
    }
    push_longest_first(by_key.iter().map(Vec::len), order);
    for list in by_key {
        lists.extend(list);
        start.push(lists.len() as u32);
    }
}

/// The tiles in the order to start their blocks, longest list first (ties by index): the
/// blocks that take longest do not start last and keep SMs busy while the rest end.
pub(super) fn push_longest_first(lengths: impl Iterator<Item = usize>, order: &mut Vec<u32>) {
    let mut lengths: Vec<(usize, u32)> = lengths.zip(0..).collect();
    lengths.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
    order.extend(lengths.iter().map(|&(_, tile)| tile));
}

#[cfg(test)]
#[path = "tables_tests.rs"]
mod tests;
