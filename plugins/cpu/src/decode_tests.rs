use super::*;

fn problem(
    kv_lens: Vec<u64>,
    queries: u64,
    heads: (u64, u64, u64),
    page: Option<u64>,
) -> DecodeProblem {
    DecodeProblem::new(kv_lens, queries, heads, page).unwrap()
}

/// Largest difference of the kernel's O and LSE from the f64 reference.
fn error_against_reference(problem: &DecodeProblem, splits: u64, threads: usize) -> f64 {
    let inputs = DecodeInputs::random(problem, 7, Element::Bf16);
    let table = problem.page_table(7);
    let pooled = table
        .as_ref()
        .map(|t| (t.to_pool(problem, &inputs.k), t.to_pool(problem, &inputs.v)));
    let cache = match (&table, &pooled) {
        (Some(table), Some((k, v))) => Cache::Paged { k, v, table },
        _ => Cache::Packed {
            k: &inputs.k,
            v: &inputs.v,
        },
    };
    let output = decode(problem, &inputs.q, &cache, splits, threads);
    let checked = check_step(
        problem,
        &inputs,
        (&output.out, Some(&output.lse)),
        StepCheck::Full,
        0.0,
    );
    checked["max_error"].as_f64().unwrap()
}

#[test]
fn split_kv_matches_the_reference_on_packed_and_paged_caches() {
    for page in [None, Some(16), Some(64)] {
        for (queries, splits, threads) in [(1, 1, 1), (1, 4, 2), (4, 3, 3), (16, 7, 2)] {
            let p = problem(vec![300, 17, 129], queries, (8, 2, 32), page);
            let error = error_against_reference(&p, splits, threads);
            assert!(
                error < Arithmetic::F32.tolerance(),
                "page {page:?}, {queries} queries, {splits} splits, {threads} threads: error {error}"
            );
        }
    }
}

#[test]
fn more_splits_than_keys_leave_empty_splits_that_merge_away() {
    // 17 keys in 40 splits: most splits of the short sequence hold no key.
    let p = problem(vec![17, 5], 2, (4, 4, 16), None);
    assert!(error_against_reference(&p, 40, 2) < Arithmetic::F32.tolerance());
}

#[test]
fn a_wrong_kernel_is_caught_by_the_same_comparison() {
    // The comparison the stage records must fail on a kernel that drops the last key.
    let p = problem(vec![64], 1, (2, 1, 8), None);
    let inputs = DecodeInputs::random(&p, 3, Element::F32);
    let short = problem(vec![63], 1, (2, 1, 8), None);
    let mut short_inputs = inputs.clone();
    short_inputs.k.truncate(63 * 8);
    short_inputs.v.truncate(63 * 8);
    let cache = Cache::Packed {
        k: &short_inputs.k,
        v: &short_inputs.v,
    };
    let output = decode(&short, &inputs.q, &cache, 2, 1);
    let checked = check_step(
        &p,
        &inputs,
        (&output.out, Some(&output.lse)),
        StepCheck::Full,
        Arithmetic::F32.tolerance(),
    );
    assert_eq!(checked["passed"], false, "{checked}");
    let error = checked["max_error"].as_f64().unwrap();
    assert!(error > Arithmetic::F32.tolerance(), "error {error}");
}

#[test]
fn the_stage_times_alone() {
    // Two timings sharing the cores halve each other's figures.
    assert!(spec().exclusive);
}

#[test]
fn split_count_fills_the_threads_without_splits_under_the_minimum() {
    let long = problem(vec![64 * 1024], 1, (32, 8, 128), None);
    // 8 items for 16 threads: 4 splits give two items a thread.
    assert_eq!(choose_splits(&long, 16).0, 4);
    // A short cache caps the count: 600 keys allow 2 splits of at least 256, 300 keys one.
    let short = problem(vec![600], 1, (32, 1, 128), None);
    assert_eq!(choose_splits(&short, 64).0, 2);
    let shorter = problem(vec![300], 1, (32, 1, 128), None);
    assert_eq!(choose_splits(&shorter, 64).0, 1);
    // Enough items already: no split.
    let wide = problem(vec![4096; 16], 1, (32, 8, 128), None);
    assert_eq!(choose_splits(&wide, 16).0, 1);
}
