//! The naive kernel: materialises each head's full score matrix in f64, like a textbook
//! `softmax(QKᵀ·scale)·V`. It is the reference the other kernels are checked against.

use super::{Forward, Grads, HeadMasks, Inputs, Shape};

/// Bytes of the score (and probability) matrix the naive kernel holds at once.
pub fn score_bytes(shape: &Shape) -> u64 {
    (shape.seqlen as u64).pow(2) * 8
}

fn row<'a>(data: &'a [f32], head: usize, position: usize, shape: &Shape) -> &'a [f32] {
    let start = (head * shape.seqlen + position) * shape.head_dim;
    &data[start..start + shape.head_dim]
}

fn dot64(a: &[f32], b: &[f32]) -> f64 {
    a.iter().zip(b).map(|(x, y)| *x as f64 * *y as f64).sum()
}

/// Probabilities `P = exp(S − LSE)` of head `h` (0 where masked), with the LSE of each row.
fn probabilities(
    shape: &Shape,
    masks: &HeadMasks,
    inputs: &Inputs,
    h: usize,
    scores: &mut [f64],
) -> Vec<f64> {
    let s = shape.seqlen;
    let scale = shape.scale() as f64;
    let kv = shape.kv_head(h);
    scores.fill(f64::NEG_INFINITY);
    masks.set.masks[masks.index_of_head[h]].for_each_row(|q, intervals| {
        let q = q as usize;
        let query = row(&inputs.q, h, q, shape);
        for &(a, b) in intervals {
            for k in a as usize..b as usize {
                scores[q * s + k] = dot64(query, row(&inputs.k, kv, k, shape)) * scale;
            }
        }
    });
    let mut lse = vec![f64::NEG_INFINITY; s];
    for q in 0..s {
        let line = &mut scores[q * s..(q + 1) * s];
        let max = line.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        if max == f64::NEG_INFINITY {
            line.fill(0.0);
            continue;
        }
        let total: f64 = line.iter().map(|x| (x - max).exp()).sum();
        lse[q] = max + total.ln();
        for x in line.iter_mut() {
            *x = (*x - lse[q]).exp();
        }
    }
    lse
}

pub fn forward(shape: &Shape, masks: &HeadMasks, inputs: &Inputs) -> Forward {
    let (s, d) = (shape.seqlen, shape.head_dim);
    let mut out = vec![0f32; shape.q_len()];
    let mut lse_out = vec![f32::NEG_INFINITY; shape.heads_q * s];
    let mut p = vec![0f64; s * s];
    let mut acc = vec![0f64; d];
    for h in 0..shape.heads_q {
        let kv = shape.kv_head(h);
        let lse = probabilities(shape, masks, inputs, h, &mut p);
        for q in 0..s {
            acc.fill(0.0);
            for k in 0..s {
                let weight = p[q * s + k];
                if weight != 0.0 {
                    for (a, value) in acc.iter_mut().zip(row(&inputs.v, kv, k, shape)) {
                        *a += weight * *value as f64;
                    }
                }
            }
            let start = (h * s + q) * d;
            for (o, a) in out[start..start + d].iter_mut().zip(&acc) {
                *o = *a as f32;
            }
            lse_out[h * s + q] = lse[q] as f32;
        }
    }
    Forward { out, lse: lse_out }
}

pub fn backward(shape: &Shape, masks: &HeadMasks, inputs: &Inputs, forward: &Forward) -> Grads {
    let (s, d) = (shape.seqlen, shape.head_dim);
    let scale = shape.scale() as f64;
    let mut dq = vec![0f64; shape.q_len()];
    let mut dk = vec![0f64; shape.kv_len()];
    let mut dv = vec![0f64; shape.kv_len()];
    let mut p = vec![0f64; s * s];
    for h in 0..shape.heads_q {
        let kv = shape.kv_head(h);
        probabilities(shape, masks, inputs, h, &mut p);
        for q in 0..s {
            let d_out = row(&inputs.d_out, h, q, shape);
            let delta = dot64(d_out, row(&forward.out, h, q, shape));
            for k in 0..s {
                let weight = p[q * s + k];
                if weight == 0.0 {
                    continue;
                }
                let value = row(&inputs.v, kv, k, shape);
                let dp = dot64(d_out, value);
                let ds = weight * (dp - delta) * scale;
                let (key, query) = (row(&inputs.k, kv, k, shape), row(&inputs.q, h, q, shape));
                let (dq_row, kv_row) = ((h * s + q) * d, (kv * s + k) * d);
                for i in 0..d {
                    dv[kv_row + i] += weight * d_out[i] as f64;
                    dq[dq_row + i] += ds * key[i] as f64;
                    dk[kv_row + i] += ds * query[i] as f64;
                }
            }
        }
    }
    let narrow = |x: Vec<f64>| x.into_iter().map(|v| v as f32).collect();
    Grads {
        dq: narrow(dq),
        dk: narrow(dk),
        dv: narrow(dv),
    }
}
