//! Correctness checks: a kernel's outputs against a reference computed on the same inputs —
//! every element against the naive kernel at small sizes, or sampled rows against an independent
//! per-row reference where S×S scores would not fit.

use serde_json::{json, Map};

use super::{relative_error, Forward, Grads, HeadMasks, Inputs, Shape};
use crate::measure::Correctness;

/// How much of a kernel's output is compared.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CheckMode {
    /// Every element of O, LSE (and dQ, dK, dV) against the naive f64 kernel.
    Full,
    /// O, LSE (and dQ) of this many evenly spread rows of every head, from the mask's slices.
    Sampled { rows: usize },
}

/// Checks a kernel's outputs (`grads` when it ran backward) against the reference on the same
/// inputs; passed when every error is at most `tolerance`. A kernel whose API gives no LSE
/// (`forward.lse` empty) is checked on O (and the gradients), and the record says so.
pub fn check(
    shape: &Shape,
    masks: &HeadMasks,
    inputs: &Inputs,
    forward: &Forward,
    grads: Option<&Grads>,
    mode: CheckMode,
    tolerance: f64,
) -> Correctness {
    let has_lse = !forward.lse.is_empty();
    let lse = if has_lse { ", LSE" } else { "" };
    let (reference, mut checked, errors) = match mode {
        CheckMode::Full => {
            let expected = super::forward(shape, masks, inputs);
            let expected_grads = grads.map(|_| super::backward(shape, masks, inputs, &expected));
            let grads_checked = if grads.is_some() { ", dQ, dK, dV" } else { "" };
            (
                "naive kernel (f64 accumulation) on the same inputs".to_string(),
                format!("O{lse}{grads_checked}: every element"),
                compare(forward, &expected, grads.zip(expected_grads.as_ref())),
            )
        }
        CheckMode::Sampled { rows } => {
            let rows = sample_rows(shape.seqlen, rows);
            let (out, lse_rows, dq) = reference_rows(shape, masks, inputs, &rows, grads.is_some());
            let mut errors = Map::new();
            let mut error = |name: &str, data: &[f32], width: usize, expected: &[f32]| {
                let picked = pick_rows(shape, data, &rows, width);
                errors.insert(name.into(), json!(relative_error(&picked, expected)));
            };
            error("out", &forward.out, shape.value_dim(), &out);
            if has_lse {
                error("lse", &forward.lse, 1, &lse_rows);
            }
            if let Some(grads) = grads {
                error("dq", &grads.dq, shape.head_dim, &dq);
            }
            let dq_checked = if grads.is_some() { ", dQ" } else { "" };
            (
                "per-row f64 reference from the mask's slices".to_string(),
                format!("O{lse}{dq_checked}: {} rows of every head", rows.len()),
                errors,
            )
        }
    };
    if !has_lse {
        checked.push_str("; no LSE (the kernel gives none)");
    }
    let passed = errors
        .values()
        .all(|e| e.as_f64().is_some_and(|e| e <= tolerance));
    Correctness {
        reference,
        checked,
        errors,
        tolerance,
        passed,
    }
}

/// Errors of every output present in both.
fn compare(
    forward: &Forward,
    reference: &Forward,
    grads: Option<(&Grads, &Grads)>,
) -> Map<String, serde_json::Value> {
    let mut errors = Map::new();
    errors.insert(
        "out".into(),
        json!(relative_error(&forward.out, &reference.out)),
    );
    if !forward.lse.is_empty() {
        errors.insert(
            "lse".into(),
            json!(relative_error(&forward.lse, &reference.lse)),
        );
    }
    if let Some((actual, expected)) = grads {
        errors.insert("dq".into(), json!(relative_error(&actual.dq, &expected.dq)));
        errors.insert("dk".into(), json!(relative_error(&actual.dk, &expected.dk)));
        errors.insert("dv".into(), json!(relative_error(&actual.dv, &expected.dv)));
    }
    errors
}

/// Evenly spread rows of the sequence, always including the first and the last.
pub fn sample_rows(seqlen: usize, count: usize) -> Vec<usize> {
    if seqlen <= count {
        return (0..seqlen).collect();
    }
    (0..count).map(|i| i * (seqlen - 1) / (count - 1)).collect()
}

/// O, LSE and (with `d_out`) dQ of the sampled rows of every head, in f64, straight from the
/// slices (a code path independent of the kernels'): (out, lse, dq) flattened per head and row.
/// Heads are spread over the machine's cores: at long sequences each row reads every key.
pub fn reference_rows(
    shape: &Shape,
    masks: &HeadMasks,
    inputs: &Inputs,
    rows: &[usize],
    with_dq: bool,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let threads = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
        .min(shape.heads_q);
    let heads: Vec<usize> = (0..shape.heads_q).collect();
    let per_thread = heads.len().div_ceil(threads);
    let parts: Vec<_> = std::thread::scope(|scope| {
        let workers: Vec<_> = heads
            .chunks(per_thread)
            .map(|chunk| {
                scope.spawn(move || {
                    chunk
                        .iter()
                        .map(|&h| head_rows(shape, masks, inputs, rows, with_dq, h))
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        workers
            .into_iter()
            .flat_map(|w| w.join().expect("a reference thread panicked"))
            .collect()
    });
    let (mut out, mut lse, mut dq) = (Vec::new(), Vec::new(), Vec::new());
    for (o, l, g) in parts {
        out.extend(o);
        lse.extend(l);
        dq.extend(g);
    }
    (out, lse, dq)
}

/// [`reference_rows`] of one query head.
fn head_rows(
    shape: &Shape,
    masks: &HeadMasks,
    inputs: &Inputs,
    rows: &[usize],
    with_dq: bool,
    h: usize,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let (s, d, dv) = (shape.seqlen, shape.head_dim, shape.value_dim());
    let scale = shape.scale() as f64;
    let (mut out, mut lse, mut dq) = (Vec::new(), Vec::new(), Vec::new());
    let kv = shape.kv_head(h);
    let mask = &masks.set.masks[masks.index_of_head[h]];
    for &q in rows {
        let query = &inputs.q[(h * s + q) * d..(h * s + q + 1) * d];
        // The row's keys straight from the slices that hold it (not through the kernels' row
        // tables): a key allowed by several slices counts once.
        let mut keys: Vec<usize> = mask
            .slices
            .iter()
            .filter(|slice| slice.q[0] <= q as u64 && (q as u64) < slice.q[1])
            .filter_map(|slice| slice.keys_of_row(q as u64))
            .flat_map(|(a, b)| a as usize..b as usize)
            .collect();
        keys.sort_unstable();
        keys.dedup();
        let scores: Vec<f64> = keys
            .iter()
            .map(|&k| {
                query
                    .iter()
                    .zip(&inputs.k[(kv * s + k) * d..(kv * s + k + 1) * d])
                    .map(|(a, b)| *a as f64 * *b as f64)
                    .sum::<f64>()
                    * scale
            })
            .collect();
        let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let total: f64 = scores.iter().map(|x| (x - max).exp()).sum();
        let row_lse = if keys.is_empty() {
            f64::NEG_INFINITY
        } else {
            max + total.ln()
        };
        let mut o = vec![0f64; dv];
        for (&k, score) in keys.iter().zip(&scores) {
            let p = (score - row_lse).exp();
            for (x, v) in o
                .iter_mut()
                .zip(&inputs.v[(kv * s + k) * dv..(kv * s + k + 1) * dv])
            {
                *x += p * *v as f64;
            }
        }
        if with_dq {
            let d_out = &inputs.d_out[(h * s + q) * dv..(h * s + q + 1) * dv];
            let delta: f64 = d_out.iter().zip(&o).map(|(a, b)| *a as f64 * b).sum();
            let mut g = vec![0f64; d];
            for (&k, score) in keys.iter().zip(&scores) {
                let p = (score - row_lse).exp();
                let value = &inputs.v[(kv * s + k) * dv..(kv * s + k + 1) * dv];
                let dp: f64 = d_out
                    .iter()
                    .zip(value)
                    .map(|(a, b)| *a as f64 * *b as f64)
                    .sum();
                let ds = p * (dp - delta) * scale;
                for (x, key) in g
                    .iter_mut()
                    .zip(&inputs.k[(kv * s + k) * d..(kv * s + k + 1) * d])
                {
                    *x += ds * *key as f64;
                }
            }
            dq.extend(g.iter().map(|x| *x as f32));
        }
        out.extend(o.iter().map(|x| *x as f32));
        lse.push(row_lse as f32);
    }
    (out, lse, dq)
}
/// The sampled rows of a kernel's outputs, in the order `reference_rows` produces them.
pub fn pick_rows(shape: &Shape, data: &[f32], rows: &[usize], width: usize) -> Vec<f32> {
    let mut picked = Vec::with_capacity(shape.heads_q * rows.len() * width);
    for h in 0..shape.heads_q {
        for &q in rows {
            let start = (h * shape.seqlen + q) * width;
            picked.extend_from_slice(&data[start..start + width]);
        }
    }
    picked
}
