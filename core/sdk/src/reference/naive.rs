//! The naive kernel: materialises each head's full score matrix in f64, like a textbook
//! `softmax(QKᵀ·scale)·V`. It is the reference the other kernels are checked against.

use super::{Forward, Grads, HeadMasks, Inputs, Shape};

/// Bytes of the score (and probability) matrix the naive kernel holds at once.
pub fn score_bytes(shape: &Shape) -> u64 {
    (shape.seqlen as u64).pow(2) * 8
}

/// Row `position` of `head` in a tensor of rows of `width` values.
fn row(data: &[f32], head: usize, position: usize, seqlen: usize, width: usize) -> &[f32] {
    let start = (head * seqlen + position) * width;
    &data[start..start + width]
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
        let query = row(&inputs.q, h, q, s, shape.head_dim);
        for &(a, b) in intervals {
            for k in a as usize..b as usize {
                scores[q * s + k] = dot64(query, row(&inputs.k, kv, k, s, shape.head_dim)) * scale;
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

/// Heads computed at once by [`forward`] and [`backward`]: every core, as long as their f64
/// score matrices fit in 4 GiB together.
fn reference_threads(shape: &Shape) -> usize {
    let cores = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    let by_memory = ((4u64 << 30) / score_bytes(shape).max(1)).max(1) as usize;
    cores.min(by_memory).max(1)
}

/// Runs `work` on each item, spread over `threads` scoped threads (contiguous runs of items, so
/// each thread keeps one scratch buffer); results are the same for any thread count.
fn spread<T: Send>(items: Vec<T>, threads: usize, work: impl Fn(Vec<T>) + Sync) {
    let threads = threads.clamp(1, items.len().max(1));
    let per_thread = items.len().div_ceil(threads).max(1);
    let mut items = items.into_iter();
    std::thread::scope(|scope| loop {
        let batch: Vec<T> = items.by_ref().take(per_thread).collect();
        if batch.is_empty() {
            break;
        }
        let work = &work;
        scope.spawn(move || work(batch));
    });
}

/// O and LSE of every head, heads spread over the machine's cores.
pub fn forward(shape: &Shape, masks: &HeadMasks, inputs: &Inputs) -> Forward {
    forward_with_threads(shape, masks, inputs, reference_threads(shape))
}

/// [`forward`] on `threads` threads (1: the textbook single-threaded kernel).
pub fn forward_with_threads(
    shape: &Shape,
    masks: &HeadMasks,
    inputs: &Inputs,
    threads: usize,
) -> Forward {
    let (s, d) = (shape.seqlen, shape.value_dim());
    let mut out = vec![0f32; shape.out_len()];
    let mut lse_out = vec![f32::NEG_INFINITY; shape.heads_q * s];
    let heads: Vec<_> = out
        .chunks_mut(s * d)
        .zip(lse_out.chunks_mut(s))
        .enumerate()
        .collect();
    spread(heads, threads, |heads| {
        let mut p = vec![0f64; s * s];
        let mut acc = vec![0f64; d];
        for (h, (out, lse_out)) in heads {
            let kv = shape.kv_head(h);
            let lse = probabilities(shape, masks, inputs, h, &mut p);
            for q in 0..s {
                acc.fill(0.0);
                for k in 0..s {
                    let weight = p[q * s + k];
                    if weight != 0.0 {
                        for (a, value) in acc.iter_mut().zip(row(&inputs.v, kv, k, s, d)) {
                            *a += weight * *value as f64;
                        }
                    }
                }
                for (o, a) in out[q * d..(q + 1) * d].iter_mut().zip(&acc) {
                    *o = *a as f32;
                }
                lse_out[q] = lse[q] as f32;
            }
        }
    });
    Forward { out, lse: lse_out }
}

/// dQ, dK and dV, KV groups spread over the machine's cores.
pub fn backward(shape: &Shape, masks: &HeadMasks, inputs: &Inputs, forward: &Forward) -> Grads {
    backward_with_threads(shape, masks, inputs, forward, reference_threads(shape))
}

/// [`backward`] on `threads` threads. Each KV group is summed by one thread in head order, so
/// the result does not depend on the thread count.
pub fn backward_with_threads(
    shape: &Shape,
    masks: &HeadMasks,
    inputs: &Inputs,
    forward: &Forward,
    threads: usize,
) -> Grads {
    let (s, d, dv_dim) = (shape.seqlen, shape.head_dim, shape.value_dim());
    let scale = shape.scale() as f64;
    let group = shape.group();
    let mut dq = vec![0f64; shape.q_len()];
    let mut dk = vec![0f64; shape.kv_len()];
    let mut dv = vec![0f64; shape.v_len()];
    let groups: Vec<_> = dq
        .chunks_mut(group * s * d)
        .zip(dk.chunks_mut(s * d).zip(dv.chunks_mut(s * dv_dim)))
        .enumerate()
        .collect();
    spread(groups, threads, |groups| {
        let mut p = vec![0f64; s * s];
        for (kv, (dq, (dk, dv))) in groups {
            for h in kv * group..(kv + 1) * group {
                probabilities(shape, masks, inputs, h, &mut p);
                let dq = &mut dq[(h - kv * group) * s * d..(h - kv * group + 1) * s * d];
                for q in 0..s {
                    let d_out = row(&inputs.d_out, h, q, s, dv_dim);
                    let delta = dot64(d_out, row(&forward.out, h, q, s, dv_dim));
                    let query = row(&inputs.q, h, q, s, d);
                    for k in 0..s {
                        let weight = p[q * s + k];
                        if weight == 0.0 {
                            continue;
                        }
                        let dp = dot64(d_out, row(&inputs.v, kv, k, s, dv_dim));
                        let ds = weight * (dp - delta) * scale;
                        for (slot, g) in dv[k * dv_dim..(k + 1) * dv_dim].iter_mut().zip(d_out) {
                            *slot += weight * *g as f64;
                        }
                        let key = row(&inputs.k, kv, k, s, d);
                        for i in 0..d {
                            dq[q * d + i] += ds * key[i] as f64;
                            dk[k * d + i] += ds * query[i] as f64;
                        }
                    }
                }
            }
        }
    });
    let narrow = |x: Vec<f64>| x.into_iter().map(|v| v as f32).collect();
    Grads {
        dq: narrow(dq),
        dk: narrow(dk),
        dv: narrow(dv),
    }
}
