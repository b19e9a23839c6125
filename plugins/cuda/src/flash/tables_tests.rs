use super::*;
use attnbench_sdk::mask::{window_slices, HeadScope, Mask, MaskSet, Slice, SliceKind};
use attnbench_sdk::reference::Shape;

/// The tables an in-process call builds from its rows are the benchmark's, built from slices
/// (at a length that is no multiple of any tile).
#[test]
fn tables_from_rows_equal_tables_from_slices() {
    let s = 1000u64;
    let square = |slices| Mask::square(s, slices).expect("a valid mask");
    let mut global = window_slices([0, s], [0, s], 96, 0);
    global.push(Slice::new([0, s], [0, 24], SliceKind::Full));
    let masks = vec![
        square(vec![Slice::new([0, s], [0, s], SliceKind::Causal)]),
        square(vec![
            Slice::new([0, 300], [0, 300], SliceKind::Full),
            Slice::new([300, s], [300, s], SliceKind::Causal),
        ]),
        square(window_slices([0, s], [0, s], 130, 70)),
        square(global),
    ];
    let set = MaskSet {
        pattern: "mixed".into(),
        seqlen: s,
        params: Default::default(),
        documents: Vec::new(),
        scope: HeadScope::PerHead,
        masks,
    };
    let shape = Shape {
        heads_q: 4,
        heads_kv: 2,
        seqlen: s as usize,
        head_dim: 64,
        head_dim_v: None,
    };
    let from_slices = tables(&MaskTiles::of_set(&HeadMasks::new(&set, &shape)));
    let all: Vec<u32> = (0..s as u32).collect();
    let from_rows: Vec<MaskTiles> = set
        .masks
        .iter()
        .map(|mask| MaskTiles::of_rows(RowIntervals::restrict(mask, &all, &all), s))
        .collect();
    assert_eq!(tables(&from_rows), from_slices);
}

/// The length and tables of a mask whose windows and first columns cut tiles of both sizes
/// at many places, for the tests that compare 128-key lists with pairs of 64-key ones.
const PAIRED_TILES_LEN: u64 = 1000;
fn paired_tiles_tables() -> Tables {
    let s = PAIRED_TILES_LEN;
    let all: Vec<u32> = (0..s as u32).collect();
    let mut slices = window_slices([0, s], [0, s], 130, 70);
    slices.push(Slice::new([0, s], [0, 24], SliceKind::Full));
    let mask = Mask::square(s, slices).expect("a valid mask");
    tables(&[MaskTiles::of_rows(
        RowIntervals::restrict(&mask, &all, &all),
        s,
    )])
}

/// Entry `i` of a CSR work list: (tile, full).
fn list(start: &[u32], tiles: &[u32], i: usize) -> Vec<(u32, bool)> {
    tiles[start[i] as usize..start[i + 1] as usize]
        .iter()
        .map(|entry| (entry & 0x7fff_ffff, entry >> 31 == 0))
        .collect()
}

/// The wgmma dK/dV kernel's lists for 128-key tiles hold, per pair of 64-key tiles, the query
/// tiles that visit either, full where every half inside the sequence holds them full.
#[test]
fn wide_key_lists_join_pairs_of_key_tiles() {
    let (s, t) = (PAIRED_TILES_LEN, paired_tiles_tables());
    let key_tiles = s.div_ceil(TILE) as usize;
    assert_eq!(
        t.wide_key_tile_start.len(),
        s.div_ceil(WIDE_TILE) as usize + 1
    );
    for wide in 0..s.div_ceil(WIDE_TILE) as usize {
        let halves: Vec<Vec<(u32, bool)>> = [2 * wide, 2 * wide + 1]
            .into_iter()
            .filter(|&k| k < key_tiles)
            .map(|k| list(&t.key_tile_start, &t.key_tiles, k))
            .collect();
        let mut expected: Vec<(u32, bool)> = halves
            .iter()
            .flatten()
            .map(|&(q, _)| q)
            .collect::<std::collections::BTreeSet<_>>()
            .into_iter()
            .map(|q| (q, halves.iter().all(|half| half.contains(&(q, true)))))
            .collect();
        expected.sort();
        assert_eq!(
            list(&t.wide_key_tile_start, &t.wide_key_tiles, wide),
            expected,
            "wide key tile {wide}"
        );
    }
}

/// The wgmma forward's lists for 128-key tiles hold, per 128-row query tile, the pairs of
/// 64-key tiles its 64-key list visits, full where every half inside the sequence is full.
#[test]
fn wide_forward_lists_join_pairs_of_key_tiles() {
    let (s, t) = (PAIRED_TILES_LEN, paired_tiles_tables());
    let key_tiles = s.div_ceil(TILE) as u32;
    for q_tile in 0..s.div_ceil(FORWARD_TILE) as usize {
        let narrow = list(&t.forward_tile_start, &t.forward_tiles, q_tile);
        let mut expected: Vec<(u32, bool)> = narrow
            .iter()
            .map(|&(k, _)| k / 2)
            .collect::<std::collections::BTreeSet<_>>()
            .into_iter()
            .map(|wide| {
                let full = [2 * wide, 2 * wide + 1]
                    .into_iter()
                    .filter(|&k| k < key_tiles)
                    .all(|k| narrow.contains(&(k, true)));
                (wide, full)
            })
            .collect();
        expected.sort();
        assert_eq!(
            list(&t.wide_forward_tile_start, &t.wide_forward_tiles, q_tile),
            expected,
            "query tile {q_tile}"
        );
    }
    assert_eq!(t.wide_forward_order.len(), t.forward_order.len());
}

/// For every mask of a set, the column tables (what the key-tile kernels test a partial
/// step's queries against) allow exactly what the row tables do, read as the kernels read
/// them: `start[mask · (len + 1) + position]`, offsets into the set's interval array.
#[test]
fn column_tables_allow_what_row_tables_allow() {
    let s = 300u64;
    let all: Vec<u32> = (0..s as u32).collect();
    let window = Mask::square(s, window_slices([0, s], [0, s], 40, 25)).expect("a valid mask");
    let mut slices = vec![Slice::new([0, 120], [0, 120], SliceKind::Causal)];
    slices.push(Slice::new([120, s], [120, s], SliceKind::Full));
    slices.push(Slice::new([200, s], [0, 16], SliceKind::Full));
    let documents = Mask::square(s, slices).expect("a valid mask");
    let t = tables(
        &[window, documents]
            .iter()
            .map(|mask| MaskTiles::of_rows(RowIntervals::restrict(mask, &all, &all), s))
            .collect::<Vec<_>>(),
    );
    let holds = |start: &[u32], intervals: &[u32], mask: usize, at: usize, x: usize| {
        let base = mask * (s as usize + 1) + at;
        (start[base]..start[base + 1]).any(|i| {
            intervals[2 * i as usize] as usize <= x && x < intervals[2 * i as usize + 1] as usize
        })
    };
    for mask in 0..2 {
        for r in 0..s as usize {
            for k in 0..s as usize {
                assert_eq!(
                    holds(&t.row_start, &t.intervals, mask, r, k),
                    holds(&t.column_start, &t.column_intervals, mask, k, r),
                    "mask {mask}, row {r}, key {k}"
                );
            }
        }
    }
}

/// Every order list holds each tile of its mask once, longest work list first.
#[test]
fn orders_start_the_longest_lists_first() {
    let t = paired_tiles_tables();
    for (start, order) in [
        (&t.forward_tile_start, &t.forward_order),
        (&t.wide_forward_tile_start, &t.wide_forward_order),
        (&t.key_tile_start, &t.key_order),
        (&t.wide_key_tile_start, &t.wide_key_order),
    ] {
        let length = |tile: u32| start[tile as usize + 1] - start[tile as usize];
        let mut sorted = order.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..order.len() as u32).collect::<Vec<_>>());
        assert_eq!(start.len(), order.len() + 1);
        assert!(order.windows(2).all(|w| length(w[0]) >= length(w[1])));
    }
}

/// Every static mask of the catalogue keeps 128-row forward tiles (the 64-row ones are
/// slower on them); block-sparse masks take 64-row tiles on 64-token blocks only.
#[test]
fn catalogue_masks_choose_their_forward_tiles() {
    use attnbench_mask_catalogue::{generate, Params, Pattern};
    use attnbench_sdk::histogram::{Bucket, Histogram};
    let histogram = Histogram {
        buckets: vec![Bucket {
            lo: 64,
            hi: 4096,
            weight: 1.0,
        }],
    };
    let s = 8192u64;
    let shape = Shape {
        heads_q: 8,
        heads_kv: 1,
        seqlen: s as usize,
        head_dim: 64,
        head_dim_v: None,
    };
    let rows_of = |params: &Params| {
        let set = generate(params, &histogram, 3).expect("a catalogue mask");
        tables(&MaskTiles::of_set(&HeadMasks::new(&set, &shape))).forward_rows
    };
    for &pattern in Pattern::ALL
        .iter()
        .filter(|p| !p.as_str().starts_with("block_sparse"))
    {
        assert_eq!(rows_of(&Params::new(pattern, s)), 128, "{pattern}");
    }
    for (block, rows) in [(64, 64), (128, 128)] {
        let params = Params {
            sparse_block: block,
            heads_q: 8,
            heads_kv: 1,
            ..Params::new(Pattern::BlockSparseUniform, s)
        };
        assert_eq!(rows_of(&params), rows, "block {block}");
    }
}

/// Block-sparse masks on 64-token blocks split 128-row forward tiles (every visited one
/// partial): their forward runs 64-row tiles, all full; causal keeps 128-row tiles.
#[test]
fn forward_tiles_follow_the_masks_blocks() {
    let s = 1024u64;
    let all: Vec<u32> = (0..s as u32).collect();
    let rows_of = |mask: &Mask| {
        tables(&[MaskTiles::of_rows(
            RowIntervals::restrict(mask, &all, &all),
            s,
        )])
    };
    let causal =
        Mask::square(s, vec![Slice::new([0, s], [0, s], SliceKind::Causal)]).expect("a valid mask");
    assert_eq!(rows_of(&causal).forward_rows, 128);
    // A checkerboard of 64-token blocks.
    let blocks = (0..s / 64)
        .flat_map(|i| (0..s / 64).map(move |j| (i, j)))
        .filter(|(i, j)| (i + j) % 2 == 0)
        .map(|(i, j)| {
            Slice::new(
                [i * 64, i * 64 + 64],
                [j * 64, j * 64 + 64],
                SliceKind::Full,
            )
        })
        .collect();
    let sparse = Mask::square(s, blocks).expect("a valid mask");
    let t = rows_of(&sparse);
    assert_eq!(t.forward_rows, 64);
    assert_eq!(t.forward_tile_start.len() as u64, s / 64 + 1);
    assert!(t.forward_tiles[..t.forward_tiles.len() - 1]
        .iter()
        .all(|entry| entry >> 31 == 0));
}
