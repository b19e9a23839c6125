use super::*;
use crate::reference::Element;

fn problem(kv_lens: &[u64], queries: u64, page: Option<u64>) -> DecodeProblem {
    DecodeProblem::new(kv_lens.to_vec(), queries, (4, 2, 8), page).unwrap()
}

#[test]
fn the_mask_view_gives_each_query_its_prefix_of_its_own_sequence() {
    let p = problem(&[5, 3], 2, None);
    let mask = p.mask().unwrap();
    assert_eq!((mask.seqlen_q, mask.seqlen_k), (4, 8));
    // Sequence 0: queries see keys 0..=3 and 0..=4; sequence 1 (keys 5..8): 5..=6 and 5..=7.
    let allowed: Vec<Vec<u64>> = (0..4)
        .map(|q| (0..8).filter(|&k| mask.allows(q, k)).collect())
        .collect();
    assert_eq!(
        allowed,
        [
            vec![0, 1, 2, 3],
            vec![0, 1, 2, 3, 4],
            vec![5, 6],
            vec![5, 6, 7]
        ]
    );
    assert_eq!(mask.area(), 4 + 5 + 2 + 3);
    assert_eq!(p.flops(), 4 * 14 * 4 * 8);
    // K and V: 8 keys × 2 heads × 8; Q and O: 4 rows × 4 heads × 8; bf16.
    assert_eq!(p.bytes(2), (2 * 8 * 2 * 8 + 2 * 4 * 4 * 8) * 2);
}

#[test]
fn split_kv_merged_by_lse_equals_the_whole_softmax() {
    let p = problem(&[37, 5, 64], 3, None);
    let inputs = DecodeInputs::random(&p, 7, Element::Bf16);
    let whole = reference(&p, &inputs);
    for splits in [1, 2, 3, 8, 64] {
        let split = split_kv(&p, &inputs, splits);
        assert!(whole.max_difference(&split) < 1e-12, "{splits} splits");
    }
}

#[test]
fn merging_is_order_free_and_empty_partials_change_nothing() {
    let p = problem(&[40], 1, None);
    let inputs = DecodeInputs::random(&p, 3, Element::F32);
    let parts: Vec<Partial> = (0..4)
        .map(|s| attend(&p, &inputs, |_| split_range(40, 4, s)))
        .collect();
    let d = p.head_dim as usize;
    let mut forward = Partial::empty(&p);
    for part in &parts {
        forward.merge(part, d);
    }
    let mut backward = Partial::empty(&p);
    for part in parts.iter().rev() {
        backward.merge(part, d);
    }
    // A tree: (0 + 1) + (2 + 3).
    let (mut left, mut right) = (parts[0].clone(), parts[2].clone());
    left.merge(&parts[1], d);
    right.merge(&parts[3], d);
    left.merge(&right, d);
    left.merge(&Partial::empty(&p), d);
    for other in [&backward, &left] {
        assert!(forward.max_difference(other) < 1e-12);
    }
    assert!(forward.max_difference(&reference(&p, &inputs)) < 1e-12);
}

#[test]
fn a_paged_cache_holds_the_same_keys_in_a_shuffled_pool() {
    let p = problem(&[33, 70, 16], 2, Some(16));
    let table = p.page_table(11).unwrap();
    assert_eq!(
        table.pages.iter().map(Vec::len).collect::<Vec<_>>(),
        [3, 5, 1]
    );
    assert_eq!(table.pool_pages, 9);
    let mut every: Vec<u32> = table.pages.concat();
    every.sort_unstable();
    assert_eq!(every, (0..9).collect::<Vec<u32>>());
    assert_ne!(
        table.pages.concat(),
        (0..9).collect::<Vec<u32>>(),
        "pages are dealt at random"
    );
    let inputs = DecodeInputs::random(&p, 5, Element::Bf16);
    let pool = table.to_pool(&p, &inputs.k);
    assert_eq!(pool.len(), 9 * 16 * 2 * 8);
    assert_eq!(table.from_pool(&p, &pool), inputs.k);
    assert_eq!(problem(&[10], 1, None).page_table(11), None);
}

#[test]
fn impossible_problems_are_refused_with_the_reason() {
    let heads = (4, 2, 8);
    assert_eq!(
        DecodeProblem::new(vec![], 1, heads, None),
        Err(DecodeError::EmptyBatch)
    );
    assert_eq!(
        DecodeProblem::new(vec![8], 17, heads, None),
        Err(DecodeError::Queries(17))
    );
    assert_eq!(
        DecodeProblem::new(vec![8, 2], 4, heads, None),
        Err(DecodeError::ShortCache {
            index: 1,
            kv_len: 2,
            queries: 4
        })
    );
    assert_eq!(
        DecodeProblem::new(vec![8], 1, heads, Some(32)),
        Err(DecodeError::PageSize(32))
    );
    let err = DecodeProblem::new(vec![8], 1, (6, 4, 8), None).unwrap_err();
    assert!(err.to_string().contains("multiple of heads_kv"), "{err}");
}

#[test]
fn the_first_group_is_the_whole_steps_first_rows() {
    let whole = DecodeProblem::new(vec![40, 9], 2, (8, 4, 8), None).unwrap();
    let inputs = DecodeInputs::random(&whole, 5, Element::F32);
    let (group, group_inputs) = first_group(&whole, &inputs);
    assert_eq!((group.heads_q, group.heads_kv), (2, 1));
    let (whole_out, group_out) = (reference(&whole, &inputs), reference(&group, &group_inputs));
    let values = (group.heads_q * group.rows() * group.head_dim) as usize;
    assert_eq!(group_out.out[..], whole_out.out[..values]);
    assert_eq!(group_out.lse[..], whole_out.lse[..group_out.lse.len()]);
}

#[test]
fn a_step_check_fails_a_wrong_output_and_says_what_it_compared() {
    let problem = DecodeProblem::new(vec![40, 9], 2, (8, 4, 8), None).unwrap();
    let inputs = DecodeInputs::random(&problem, 5, Element::F32);
    let exact = reference(&problem, &inputs);
    let narrow = |values: &[f64]| values.iter().map(|&x| x as f32).collect::<Vec<f32>>();
    let (mut out, lse) = (narrow(&exact.out), narrow(&exact.lse));
    let good = check_step(&problem, &inputs, (&out, Some(&lse)), StepCheck::Full, 1e-5);
    assert_eq!(good["passed"], true, "{good}");
    out[3] += 0.5;
    let bad = check_step(&problem, &inputs, (&out, None), StepCheck::Group, 1e-5);
    assert_eq!(bad["passed"], false, "{bad}");
    assert!(
        bad["checked"].as_str().unwrap().contains("returns no LSE"),
        "{bad}"
    );
    assert_eq!(
        check_step(&problem, &inputs, (&out, None), StepCheck::Off, 0.0)["checked"],
        "off"
    );
    // NaN and missing values fail, however small the rest of the differences.
    let nan = vec![f32::NAN; out.len()];
    assert_eq!(
        check_step(&problem, &inputs, (&nan, None), StepCheck::Full, 1.0)["passed"],
        false
    );
    let short = &lse[..lse.len() - 1];
    let checked = check_step(
        &problem,
        &inputs,
        (&narrow(&exact.out), Some(short)),
        StepCheck::Full,
        1.0,
    );
    assert_eq!(checked["passed"], false, "{checked}");
}

#[test]
fn stepped_batches_mix_long_and_short_caches() {
    let stepped = DecodeProblem::stepped(4, 1000, 3, (8, 2, 16), 16).unwrap();
    assert_eq!(stepped.kv_lens, vec![1000, 750, 500, 250]);
    assert_eq!(stepped.page_size, Some(16));
    assert_eq!(
        DecodeProblem::stepped(0, 1000, 1, (8, 2, 16), 0),
        Err(DecodeError::EmptyBatch)
    );
    assert_eq!(
        DecodeProblem::stepped(2, 0, 1, (8, 2, 16), 0),
        Err(DecodeError::EmptyCache)
    );
}

#[test]
fn new_tokens_see_their_causal_prefix_of_each_block() {
    // 5 keys, the last 3 new (keys 2, 3, 4).
    let ends = |keys: std::ops::Range<u64>| {
        let rows = block_rows(5, 3, keys);
        (0..3)
            .map(|r| {
                let span = rows.row_start[r] as usize..rows.row_start[r + 1] as usize;
                rows.intervals[2 * span.start..2 * span.end].to_vec()
            })
            .collect::<Vec<_>>()
    };
    assert_eq!(ends(0..5), [vec![0, 3], vec![0, 4], vec![0, 5]]);
    assert_eq!(ends(0..2), [vec![0, 2], vec![0, 2], vec![0, 2]]);
    assert_eq!(ends(3..5), [vec![], vec![0, 1], vec![0, 2]]);
}
