//! Correctness checks: a kernel's outputs against a reference computed on the same inputs.

use serde_json::{json, Map};

use attnbench_sdk::reference::relative_error;

use crate::problem::{Forward, Grads, HeadMasks, Inputs, Shape};

/// Errors of every output present in both.
pub fn compare(
    forward: &Forward,
    reference: &Forward,
    grads: Option<(&Grads, &Grads)>,
) -> Map<String, serde_json::Value> {
    let mut errors = Map::new();
    errors.insert(
        "out".into(),
        json!(relative_error(&forward.out, &reference.out)),
    );
    errors.insert(
        "lse".into(),
        json!(relative_error(&forward.lse, &reference.lse)),
    );
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
pub fn reference_rows(
    shape: &Shape,
    masks: &HeadMasks,
    inputs: &Inputs,
    rows: &[usize],
    with_dq: bool,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let (s, d) = (shape.seqlen, shape.head_dim);
    let scale = shape.scale() as f64;
    let (mut out, mut lse, mut dq) = (Vec::new(), Vec::new(), Vec::new());
    for h in 0..shape.heads_q {
        let kv = shape.kv_head(h);
        let mask = &masks.set.masks[masks.index_of_head[h]];
        for &q in rows {
            let query = &inputs.q[(h * s + q) * d..(h * s + q + 1) * d];
            let mut keys: Vec<usize> = (0..s)
                .filter(|&k| mask.allows(q as u64, k as u64))
                .collect();
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
            let mut o = vec![0f64; d];
            for (&k, score) in keys.iter().zip(&scores) {
                let p = (score - row_lse).exp();
                for (x, v) in o
                    .iter_mut()
                    .zip(&inputs.v[(kv * s + k) * d..(kv * s + k + 1) * d])
                {
                    *x += p * *v as f64;
                }
            }
            if with_dq {
                let d_out = &inputs.d_out[(h * s + q) * d..(h * s + q + 1) * d];
                let delta: f64 = d_out.iter().zip(&o).map(|(a, b)| *a as f64 * b).sum();
                let mut g = vec![0f64; d];
                for (&k, score) in keys.iter().zip(&scores) {
                    let p = (score - row_lse).exp();
                    let value = &inputs.v[(kv * s + k) * d..(kv * s + k + 1) * d];
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
