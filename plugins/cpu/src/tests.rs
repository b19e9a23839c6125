use attnbench_mask_catalogue::{generate, Params as MaskParams, Pattern};
use attnbench_sdk::histogram::{Bucket, Histogram};
use attnbench_sdk::mask::{HeadScope, Mask, MaskSet, Slice, SliceKind};
use serde_json::Map;

use attnbench_sdk::reference::{self as naive, relative_error};

use crate::problem::{Forward, Grads, HeadMasks, Inputs, Shape};
use crate::tiled;
use attnbench_sdk::reference::{pick_rows, reference_rows, sample_rows};

fn mask_params(mask: &str, seqlen: u64) -> MaskParams {
    MaskParams {
        window: 9,
        block_size: 25,
        long_min: 30,
        long_max: 60,
        density: 0.4,
        sparse_block: 32,
        min_block: 16,
        heads_q: 4,
        heads_kv: 2,
        ..MaskParams::new(
            Pattern::from_name(mask).expect("a catalogue pattern"),
            seqlen,
        )
    }
}

const SHAPE: Shape = Shape {
    heads_q: 4,
    heads_kv: 2,
    seqlen: 200,
    head_dim: 16,
    head_dim_v: None,
};

fn documents() -> Histogram {
    Histogram {
        buckets: vec![Bucket {
            lo: 1,
            hi: 70,
            weight: 1.0,
        }],
    }
}

/// Checks the tiled kernel against the naive one on `pattern`, forward and backward; returns
/// the inputs, the naive forward and gradients, and the masks.
fn tiled_against_naive(shape: &Shape, pattern: &str) -> (Inputs, Forward, Grads, MaskSet) {
    let set = generate(&mask_params(pattern, 200), &documents(), 5)
        .unwrap_or_else(|err| panic!("{pattern}: {err}"));
    let masks = HeadMasks::new(&set, shape);
    let inputs = Inputs::random(shape, 11, false);
    let reference = naive::forward(shape, &masks, &inputs);
    let fast = tiled::forward(shape, &masks, &inputs, 3);
    assert!(
        relative_error(&fast.out, &reference.out) < 1e-4,
        "{pattern}: out"
    );
    assert!(
        relative_error(&fast.lse, &reference.lse) < 1e-5,
        "{pattern}: lse"
    );
    let expected = naive::backward(shape, &masks, &inputs, &reference);
    let grads = tiled::backward(shape, &masks, &inputs, &fast, 3);
    for (name, a, b) in [
        ("dq", &grads.dq, &expected.dq),
        ("dk", &grads.dk, &expected.dk),
        ("dv", &grads.dv, &expected.dv),
    ] {
        let error = relative_error(a, b);
        assert!(error < 1e-4, "{pattern}: {name} error {error}");
    }
    (inputs, reference, expected, set)
}

#[test]
fn tiled_and_naive_agree_on_every_catalogue_mask_forward_and_backward() {
    for pattern in Pattern::NAMES {
        tiled_against_naive(&SHAPE, pattern);
    }
}

#[test]
fn naive_gradients_match_finite_differences() {
    // Equal head dims, and a value dim of half the query/key dim (as MLA's 128 of 192).
    for (head_dim_v, v_index) in [(None, 191), (Some(4), 90)] {
        let shape = Shape {
            heads_q: 2,
            heads_kv: 1,
            seqlen: 24,
            head_dim: 8,
            head_dim_v,
        };
        finite_differences(&shape, v_index);
    }
}

fn finite_differences(shape: &Shape, v_index: usize) {
    let set =
        single(Mask::square(24, vec![Slice::new([0, 24], [0, 24], SliceKind::Causal)]).unwrap());
    let masks = HeadMasks::new(&set, shape);
    let inputs = Inputs::random(shape, 3, false);
    let forward = naive::forward(shape, &masks, &inputs);
    let grads = naive::backward(shape, &masks, &inputs, &forward);
    // L = Σ O ∘ dO, so dL/dx is what backward returns for dO.
    let loss = |inputs: &Inputs| -> f64 {
        let out = naive::forward(shape, &masks, inputs).out;
        out.iter()
            .zip(&inputs.d_out)
            .map(|(o, g)| *o as f64 * *g as f64)
            .sum()
    };
    let eps = 1e-2f32;
    for (which, index) in [(0, 5), (0, 300), (1, 17), (1, 150), (2, 9), (2, v_index)] {
        let mut plus = inputs.clone();
        let mut minus = inputs.clone();
        let (p, m, analytic) = match which {
            0 => (&mut plus.q[index], &mut minus.q[index], grads.dq[index]),
            1 => (&mut plus.k[index], &mut minus.k[index], grads.dk[index]),
            _ => (&mut plus.v[index], &mut minus.v[index], grads.dv[index]),
        };
        *p += eps;
        *m -= eps;
        let numeric = (loss(&plus) - loss(&minus)) / (2.0 * eps as f64);
        assert!(
            (numeric - analytic as f64).abs() < 2e-3 * (1.0 + numeric.abs()),
            "{shape:?}, input {which}[{index}]: numeric {numeric}, analytic {analytic}"
        );
    }
}

#[test]
fn a_value_dim_apart_from_the_head_dim_runs_through_both_kernels_and_the_check() {
    let shape = Shape {
        head_dim_v: Some(8),
        ..SHAPE
    };
    for pattern in ["full", "causal_document", "share_question"] {
        let (inputs, reference, expected, set) = tiled_against_naive(&shape, pattern);
        assert_eq!(
            (inputs.v.len(), inputs.d_out.len()),
            (2 * 200 * 8, 4 * 200 * 8)
        );
        assert_eq!(
            (reference.out.len(), expected.dv.len()),
            (shape.out_len(), shape.v_len())
        );
        let masks = HeadMasks::new(&set, &shape);
        let rows = sample_rows(200, 16);
        let (out, lse, dq) = reference_rows(&shape, &masks, &inputs, &rows, true);
        assert!(relative_error(&pick_rows(&shape, &reference.out, &rows, 8), &out) < 1e-6);
        assert!(relative_error(&pick_rows(&shape, &reference.lse, &rows, 1), &lse) < 1e-6);
        assert!(relative_error(&pick_rows(&shape, &expected.dq, &rows, 16), &dq) < 1e-5);
    }
}

fn single(mask: Mask) -> MaskSet {
    MaskSet {
        pattern: "test".into(),
        seqlen: mask.seqlen_q,
        params: Map::new(),
        documents: vec![],
        scope: HeadScope::Shared,
        masks: vec![mask],
    }
}

#[test]
fn rows_without_keys_give_zero_and_minus_infinity_never_nan() {
    // Rows 0..4 see no key: the slice's q-range is longer than its k-range (bottom-right causal).
    let shape = Shape {
        heads_q: 2,
        heads_kv: 2,
        seqlen: 70,
        head_dim: 8,
        head_dim_v: None,
    };
    let set =
        single(Mask::square(70, vec![Slice::new([0, 70], [0, 66], SliceKind::Causal)]).unwrap());
    let masks = HeadMasks::new(&set, &shape);
    let inputs = Inputs::random(&shape, 1, true);
    for forward in [
        naive::forward(&shape, &masks, &inputs),
        tiled::forward(&shape, &masks, &inputs, 2),
    ] {
        assert!(forward.out[..4 * 8].iter().all(|x| *x == 0.0));
        assert!(forward.lse[..4].iter().all(|x| *x == f32::NEG_INFINITY));
        assert!(forward.out.iter().chain(&forward.lse).all(|x| !x.is_nan()));
        let grads = tiled::backward(&shape, &masks, &inputs, &forward, 2);
        assert!(grads
            .dq
            .iter()
            .chain(&grads.dk)
            .chain(&grads.dv)
            .all(|x| x.is_finite()));
        assert!(grads.dq[..4 * 8].iter().all(|x| *x == 0.0));
    }
}

#[test]
fn the_sampled_reference_agrees_with_the_naive_kernel() {
    let set = generate(&mask_params("share_question", 200), &documents(), 2).unwrap();
    let masks = HeadMasks::new(&set, &SHAPE);
    let inputs = Inputs::random(&SHAPE, 4, false);
    let forward = naive::forward(&SHAPE, &masks, &inputs);
    let grads = naive::backward(&SHAPE, &masks, &inputs, &forward);
    let rows = sample_rows(200, 16);
    let (out, lse, dq) = reference_rows(&SHAPE, &masks, &inputs, &rows, true);
    assert!(relative_error(&pick_rows(&SHAPE, &forward.out, &rows, 16), &out) < 1e-6);
    assert!(relative_error(&pick_rows(&SHAPE, &forward.lse, &rows, 1), &lse) < 1e-6);
    assert!(relative_error(&pick_rows(&SHAPE, &grads.dq, &rows, 16), &dq) < 1e-5);
}
