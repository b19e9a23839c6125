use proptest::prelude::*;

use super::*;

fn kind() -> impl Strategy<Value = SliceKind> {
    prop_oneof![
        Just(SliceKind::Full),
        Just(SliceKind::Causal),
        Just(SliceKind::InvCausal),
        Just(SliceKind::BiCausal)
    ]
}

/// Random masks of up to 40 × 40 cells with up to 5 slices, overlaps allowed.
fn mask() -> impl Strategy<Value = Mask> {
    (1u64..40, 1u64..40).prop_flat_map(|(sq, sk)| {
        let slice = (0..=sq, 0..=sq, 0..=sk, 0..=sk, kind()).prop_map(|(a, b, c, d, kind)| {
            Slice::new([a.min(b), a.max(b)], [c.min(d), c.max(d)], kind)
        });
        proptest::collection::vec(slice, 0..5)
            .prop_map(move |slices| Mask::new(sq, sk, slices).unwrap())
    })
}

fn brute_area(mask: &Mask) -> u64 {
    let mut area = 0;
    for q in 0..mask.seqlen_q {
        for k in 0..mask.seqlen_k {
            area += mask.allows(q, k) as u64;
        }
    }
    area
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    #[test]
    fn area_and_dense_agree_with_the_predicate(mask in mask()) {
        let dense = mask.dense().unwrap();
        for q in 0..mask.seqlen_q {
            for k in 0..mask.seqlen_k {
                prop_assert_eq!(dense.get(q, k), mask.allows(q, k), "cell ({}, {})", q, k);
            }
        }
        prop_assert_eq!(mask.area(), brute_area(&mask));
        prop_assert_eq!(dense.count(), mask.area());
    }

    #[test]
    fn block_masks_classify_every_tile(mask in mask(), bq in 1u64..9, bk in 1u64..9) {
        let blocks = mask.block_mask(bq, bk);
        for qt in 0..blocks.q_tiles() {
            for kt in 0..blocks.k_tiles() {
                let (mut allowed, mut cells) = (0, 0);
                for q in qt * bq..((qt + 1) * bq).min(mask.seqlen_q) {
                    for k in kt * bk..((kt + 1) * bk).min(mask.seqlen_k) {
                        cells += 1;
                        allowed += mask.allows(q, k) as u64;
                    }
                }
                let expected = if allowed == 0 { Tile::Empty } else if allowed == cells { Tile::Full } else { Tile::Partial };
                prop_assert_eq!(blocks.tile(qt, kt), expected, "tile ({}, {})", qt, kt);
            }
            let row: Vec<u32> = blocks.row(qt as usize).map(|(kt, _)| kt).collect();
            prop_assert!(row.windows(2).all(|w| w[0] < w[1]), "tiles sorted and unique: {:?}", row);
        }
    }

    #[test]
    fn flashmask_decodes_back_when_expressible(mask in mask()) {
        if let Ok(encoding) = mask.flashmask() {
            for q in 0..mask.seqlen_q {
                for k in 0..mask.seqlen_k {
                    prop_assert_eq!(encoding.allows(q, k), mask.allows(q, k), "cell ({}, {})", q, k);
                }
            }
        }
    }

    #[test]
    fn varlen_decodes_back_when_expressible(mask in mask()) {
        if let Ok(encoding) = mask.varlen() {
            for q in 0..mask.seqlen_q {
                let (a, b) = encoding.keys_of_row(q);
                for k in 0..mask.seqlen_k {
                    prop_assert_eq!(a <= k && k < b, mask.allows(q, k), "cell ({}, {})", q, k);
                }
            }
        }
    }

    #[test]
    fn row_runs_decode_back(mask in mask()) {
        let runs = mask.row_runs();
        prop_assert_eq!(runs.rows.first().copied(), Some(0));
        prop_assert_eq!(runs.rows.last().copied(), Some(mask.seqlen_q));
        prop_assert_eq!(runs.offsets.len(), runs.rows.len());
        let mut rows = 0;
        mask.for_each_row(|q, intervals| {
            rows += 1;
            assert_eq!(runs.keys_of_row(q), intervals.to_vec(), "row {q} of {runs:?}");
        });
        prop_assert_eq!(rows, mask.seqlen_q);
    }

    #[test]
    fn block_grids_decode_back_or_say_why_not(mask in mask(), other in mask()) {
        let masks = [&mask, &other];
        match BlockGrid::of(&masks) {
            Ok(grid) => {
                for (m, mask) in masks.iter().enumerate() {
                    for q in 0..mask.seqlen_q {
                        for k in 0..mask.seqlen_k {
                            prop_assert_eq!(grid.allows(m, q, k), mask.allows(q, k), "mask {} cell ({}, {})", m, q, k);
                        }
                    }
                }
            }
            Err(refusal) => prop_assert!(
                (mask.seqlen_q, mask.seqlen_k) != (other.seqlen_q, other.seqlen_k)
                    || masks.iter().any(|m| m.slices.iter().any(|s| s.kind != SliceKind::Full)),
                "refused: {}", refusal
            ),
        }
    }

    #[test]
    fn document_masks_are_expressible_everywhere(lengths in proptest::collection::vec(1u64..12, 1..6), causal in any::<bool>()) {
        let kind = if causal { SliceKind::Causal } else { SliceKind::Full };
        let mut slices = Vec::new();
        let mut cu = vec![0];
        for length in &lengths {
            let start = *cu.last().unwrap();
            slices.push(Slice::new([start, start + length], [start, start + length], kind));
            cu.push(start + length);
        }
        let mask = Mask::square(*cu.last().unwrap(), slices).unwrap();
        let varlen = mask.varlen().unwrap();
        // A causal document of one token is also a full one.
        let right = if causal && lengths.iter().any(|&l| l > 1) { 0 } else { -1 };
        prop_assert_eq!(varlen.right, right);
        prop_assert_eq!(varlen.left, -1);
        prop_assert!(mask.flashmask().is_ok());
        // Documents are the coarsest only when they differ from what the window allows; they
        // always decode back to the mask.
        for q in 0..mask.seqlen_q {
            let (a, b) = varlen.keys_of_row(q);
            for k in 0..mask.seqlen_k {
                prop_assert_eq!(a <= k && k < b, mask.allows(q, k));
            }
        }
    }
}

#[test]
fn slice_areas_follow_the_closed_forms() {
    let causal = Slice::new([0, 8192], [0, 8192], SliceKind::Causal);
    assert_eq!(causal.area(), 8192 * 8193 / 2);
    // Lq > Lk: the first Lq − Lk rows are empty.
    let tall = Slice::new([0, 10], [0, 4], SliceKind::Causal);
    assert_eq!(tall.area(), 10);
    assert_eq!(tall.keys_of_row(5), None);
    assert_eq!(tall.keys_of_row(6), Some((0, 1)));
    let band = Slice::new([0, 3], [0, 6], SliceKind::BiCausal);
    assert_eq!(band.area(), 12);
    assert_eq!(Slice::new([0, 6], [0, 3], SliceKind::BiCausal).area(), 0);
}

#[test]
fn overlapping_slices_are_counted_once() {
    let mask = Mask::square(
        16,
        vec![
            Slice::new([0, 16], [0, 16], SliceKind::Causal),
            Slice::new([0, 16], [0, 16], SliceKind::Full),
        ],
    )
    .unwrap();
    assert!(!mask.slices_disjoint());
    assert_eq!(mask.area(), 256);
}

#[test]
fn flops_follow_the_papers_accounting() {
    let flops = Flops::of(33_558_528, 64, 128, 128);
    assert_eq!(flops.fwd, 1_099_645_845_504);
    assert_eq!(flops.bwd, flops.fwd * 5 / 2);
    assert_eq!(flops.fwd_bwd, flops.fwd * 7 / 2);
    // MLA's head dims: QKᵀ over 192, PV over 128.
    let mla = Flops::of(1000, 128, 192, 128);
    assert_eq!(mla.fwd, 2 * 1000 * 128 * (192 + 128));
}

#[test]
fn areas_at_two_to_the_32_tokens_do_not_overflow() {
    // The closed form's intermediate (2·Lk − h + 1)·h passes 2⁶⁴ though the area does not.
    let s = (1u64 << 32) - 1;
    let causal = Mask::square(s, vec![Slice::new([0, s], [0, s], SliceKind::Causal)]).unwrap();
    assert_eq!(
        u128::from(causal.area()),
        u128::from(s) * u128::from(s + 1) / 2
    );
    let full = Mask::square(s, vec![Slice::new([0, s], [0, s], SliceKind::Full)]).unwrap();
    assert_eq!(u128::from(full.area()), u128::from(s) * u128::from(s));
    // One more token and the cells no longer fit: refused, not wrapped.
    let err = Mask::square(
        1 << 32,
        vec![Slice::new([0, 1 << 32], [0, 1 << 32], SliceKind::Full)],
    )
    .unwrap_err();
    assert!(matches!(err, MaskError::TooLarge { .. }), "{err}");
    assert!(err.to_string().contains("more than the 2^64 − 1"), "{err}");
    // FLOPs over heads are checked, and saturate instead of wrapping where unchecked.
    assert_eq!(Flops::checked_of(causal.area(), 64, 128, 128), None);
    assert_eq!(Flops::of(causal.area(), 64, 128, 128).fwd, u64::MAX);
    let set = MaskSet {
        pattern: "causal".into(),
        seqlen: s,
        params: Default::default(),
        documents: Vec::new(),
        scope: HeadScope::Shared,
        masks: vec![causal],
    };
    let err = set.check_heads(64, 8, 128).unwrap_err();
    assert!(matches!(err, super::HeadsError::Flops { .. }), "{err:?}");
    assert!(
        err.to_string().contains("more FLOPs than the 2^64 − 1"),
        "{err}"
    );
    assert_eq!(set.checked_area_over_heads(64, 8), None);
}

#[test]
fn out_of_range_slices_are_refused() {
    let err = Mask::square(8, vec![Slice::new([0, 9], [0, 8], SliceKind::Full)]).unwrap_err();
    assert_eq!(err.to_string(), "slice 0 has q-range [0, 9) outside [0, 8)");
}

#[test]
fn sliding_windows_are_expressible_as_varlen_but_not_as_two_documents() {
    // Keys within 3 before the query: one window over the whole sequence.
    let mask = Mask::square(
        16,
        vec![
            Slice::new([0, 3], [0, 3], SliceKind::Causal),
            Slice::new([3, 16], [0, 16], SliceKind::BiCausal),
        ],
    )
    .unwrap();
    let varlen = mask.varlen().unwrap();
    assert_eq!(
        (varlen.cu_seqlens.clone(), varlen.left, varlen.right),
        (vec![0, 16], 3, 0)
    );
    // Two separate key intervals in one row cannot be a window.
    let gaps = Mask::square(
        8,
        vec![
            Slice::new([0, 8], [0, 2], SliceKind::Full),
            Slice::new([0, 8], [5, 8], SliceKind::Full),
        ],
    )
    .unwrap();
    let err = gaps.varlen().unwrap_err();
    assert!(
        err.to_string().contains("2 separate key intervals"),
        "{err}"
    );
}

#[test]
fn rows_whose_keys_end_before_the_query_are_refused_as_varlen_not_a_panic() {
    // Found by the property test: rows 7–15 allow keys 0–6, which lie wholly before them.
    let mask = Mask::new(16, 16, vec![Slice::new([0, 16], [0, 7], SliceKind::Full)]).unwrap();
    match mask.varlen() {
        Ok(encoding) => {
            for q in 0..16 {
                let (a, b) = encoding.keys_of_row(q);
                for k in 0..16 {
                    assert_eq!(a <= k && k < b, mask.allows(q, k), "cell ({q}, {k})");
                }
            }
        }
        Err(reason) => assert!(!reason.to_string().is_empty()),
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    /// The tiles a kernel visits come out the same from a mask's slices and from its rows.
    #[test]
    fn block_masks_from_rows_equal_those_from_slices(
        mask in mask(), block_q in 1u64..40, block_k in 1u64..40,
    ) {
        let rows: Vec<u32> = (0..mask.seqlen_q as u32).collect();
        let keys: Vec<u32> = (0..mask.seqlen_k as u32).collect();
        let block = crate::attention::RowIntervals::restrict(&mask, &rows, &keys);
        prop_assert_eq!(block.block_mask(mask.seqlen_k, block_q, block_k), mask.block_mask(block_q, block_k));
    }

    /// A block's row intervals say exactly what the mask allows between the block's rows and
    /// keys, whatever positions the block holds and in whatever order.
    #[test]
    fn restricted_row_intervals_agree_with_the_predicate(
        (mask, rows, keys) in mask().prop_flat_map(|mask| {
            let (sq, sk) = (mask.seqlen_q as u32, mask.seqlen_k as u32);
            (
                Just(mask),
                proptest::sample::subsequence((0..sq).collect::<Vec<_>>(), 0..=sq as usize).prop_shuffle(),
                proptest::sample::subsequence((0..sk).collect::<Vec<_>>(), 0..=sk as usize).prop_shuffle(),
            )
        })
    ) {
        let block = crate::attention::RowIntervals::restrict(&mask, &rows, &keys);
        prop_assert_eq!(block.row_start.len(), rows.len() + 1);
        for (r, &q) in rows.iter().enumerate() {
            let intervals: Vec<(usize, usize)> = block.row(r).collect();
            for pair in intervals.windows(2) {
                prop_assert!(pair[0].1 < pair[1].0, "row {}: sorted, disjoint, merged: {:?}", q, intervals);
            }
            for (j, &k) in keys.iter().enumerate() {
                let local = intervals.iter().any(|&(a, b)| a <= j && j < b);
                prop_assert_eq!(local, mask.allows(q as u64, k as u64), "row {}, key {}", q, k);
            }
        }
    }
}

#[test]
fn row_runs_follow_the_slices_not_the_rows() {
    let causal = Mask::square(
        1 << 20,
        vec![Slice::new([0, 1 << 20], [0, 1 << 20], SliceKind::Causal)],
    )
    .unwrap();
    assert_eq!(causal.row_runs().intervals, vec![[0, 0, 1, 1]]);
    let documents = Mask::square(
        96,
        vec![
            Slice::new([0, 32], [0, 32], SliceKind::Causal),
            Slice::new([32, 96], [32, 96], SliceKind::Causal),
        ],
    )
    .unwrap();
    assert_eq!(documents.row_runs().rows, vec![0, 32, 96]);
    // Blocks: one run a band of 16-token row blocks.
    let blocks: Vec<Slice> = (0..4u64)
        .flat_map(|r| {
            (0..=r).map(move |c| {
                Slice::new(
                    [16 * r, 16 * r + 16],
                    [16 * c, 16 * c + 16],
                    SliceKind::Full,
                )
            })
        })
        .collect();
    let table = Mask::square(64, blocks).unwrap();
    assert_eq!(table.row_runs().rows, vec![0, 16, 32, 48, 64]);
    let grid = BlockGrid::of(&[&table]).unwrap();
    assert_eq!(grid.rows, vec![0, 16, 32, 48, 64]);
    assert_eq!(
        grid.kept[0],
        vec![[0, 0, 1], [1, 0, 2], [2, 0, 3], [3, 0, 4]]
    );
    let refused = BlockGrid::of(&[&documents]).unwrap_err();
    assert_eq!(refused.reason, "it has causal slices, not only full blocks");
}
