//! The tiled kernel: FlashAttention's algorithm on the CPU. Queries and keys are cut into
//! 64-token tiles; only the tiles the block mask marks non-empty are visited, partial ones are
//! masked row by row, and the softmax is computed online so no score matrix is ever held. The
//! backward pass recomputes probabilities from the LSE, in two deterministic passes (dK/dV by key
//! tile, then dQ by query tile) that need no atomics. Work is spread over threads by tile.

use attnbench_sdk::mask::BlockMask;

use crate::problem::{axpy, dot, parallel, Forward, Grads, HeadMasks, Inputs, Shape};

pub const TILE: usize = 64;

/// Per-mask data shared by all heads that use it.
struct MaskTiles {
    blocks: BlockMask,
    rows: Vec<Vec<(u32, u32)>>,
    /// For each key tile, the query tiles that touch it: (query tile, full).
    columns: Vec<Vec<(u32, bool)>>,
}

fn prepare(masks: &HeadMasks) -> Vec<Option<MaskTiles>> {
    let mut prepared: Vec<Option<MaskTiles>> = (0..masks.set.masks.len()).map(|_| None).collect();
    for &index in &masks.index_of_head {
        if prepared[index].is_some() {
            continue;
        }
        let blocks = masks.set.masks[index].block_mask(TILE as u64, TILE as u64);
        let mut columns = vec![Vec::new(); blocks.k_tiles() as usize];
        for qt in 0..blocks.q_tiles() as usize {
            for (kt, full) in blocks.row(qt) {
                columns[kt as usize].push((qt as u32, full));
            }
        }
        prepared[index] = Some(MaskTiles {
            rows: masks.rows(index),
            blocks,
            columns,
        });
    }
    prepared
}

/// The query rows of head `h`, and the key and value rows of its KV head.
fn head_view<'a>(shape: &Shape, inputs: &'a Inputs, h: usize) -> (&'a [f32], &'a [f32], &'a [f32]) {
    let (s, d, dv) = (shape.seqlen, shape.head_dim, shape.value_dim());
    let kv = shape.kv_head(h);
    (
        &inputs.q[h * s * d..(h + 1) * s * d],
        &inputs.k[kv * s * d..(kv + 1) * s * d],
        &inputs.v[kv * s * dv..(kv + 1) * s * dv],
    )
}

/// Scores of a tile: `scores[r·TILE + c] = scale · q_r·k_c`, −∞ where the mask forbids.
#[allow(clippy::too_many_arguments)]
fn tile_scores(
    shape: &Shape,
    q: &[f32],
    k: &[f32],
    rows: (usize, usize),
    cols: (usize, usize),
    full: bool,
    intervals: &[Vec<(u32, u32)>],
    scores: &mut [f32],
) {
    let d = shape.head_dim;
    let scale = shape.scale();
    for r in rows.0..rows.1 {
        let query = &q[r * d..(r + 1) * d];
        let line = &mut scores[(r - rows.0) * TILE..(r - rows.0) * TILE + (cols.1 - cols.0)];
        for (c, score) in (cols.0..cols.1).zip(line.iter_mut()) {
            *score = dot(query, &k[c * d..(c + 1) * d]) * scale;
        }
        if !full {
            for (c, score) in (cols.0..cols.1).zip(line.iter_mut()) {
                let allowed = intervals[r]
                    .iter()
                    .any(|&(a, b)| a as usize <= c && c < b as usize);
                if !allowed {
                    *score = f32::NEG_INFINITY;
                }
            }
        }
    }
}

pub fn forward(shape: &Shape, masks: &HeadMasks, inputs: &Inputs, threads: usize) -> Forward {
    // Output rows have the value dim.
    let (s, d) = (shape.seqlen, shape.value_dim());
    let tiles = prepare(masks);
    let mut out = vec![0f32; shape.out_len()];
    let mut lse = vec![f32::NEG_INFINITY; shape.heads_q * s];
    let mut jobs = Vec::new();
    for (h, (out_head, lse_head)) in out.chunks_mut(s * d).zip(lse.chunks_mut(s)).enumerate() {
        for (qt, (o, l)) in out_head
            .chunks_mut(TILE * d)
            .zip(lse_head.chunks_mut(TILE))
            .enumerate()
        {
            jobs.push((h, qt, o, l));
        }
    }
    parallel(jobs, threads, |(h, qt, o, l)| {
        let mask = tiles[masks.index_of_head[h]]
            .as_ref()
            .expect("prepared for every head");
        let (q, k, v) = head_view(shape, inputs, h);
        let (r0, r1) = (qt * TILE, ((qt + 1) * TILE).min(s));
        let mut scores = vec![0f32; TILE * TILE];
        let mut max = vec![f32::NEG_INFINITY; TILE];
        let mut sum = vec![0f32; TILE];
        for (kt, full) in mask.blocks.row(qt) {
            let (c0, c1) = (kt as usize * TILE, ((kt as usize + 1) * TILE).min(s));
            tile_scores(
                shape,
                q,
                k,
                (r0, r1),
                (c0, c1),
                full,
                &mask.rows,
                &mut scores,
            );
            for r in 0..r1 - r0 {
                let line = &scores[r * TILE..r * TILE + (c1 - c0)];
                let tile_max = line.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                if tile_max == f32::NEG_INFINITY {
                    continue;
                }
                let new_max = max[r].max(tile_max);
                let correction = (max[r] - new_max).exp();
                let acc = &mut o[r * d..(r + 1) * d];
                if correction != 1.0 {
                    sum[r] *= correction;
                    acc.iter_mut().for_each(|x| *x *= correction);
                }
                for (c, &score) in line.iter().enumerate() {
                    if score != f32::NEG_INFINITY {
                        let p = (score - new_max).exp();
                        sum[r] += p;
                        axpy(p, &v[(c0 + c) * d..(c0 + c + 1) * d], acc);
                    }
                }
                max[r] = new_max;
            }
        }
        for r in 0..r1 - r0 {
            if sum[r] > 0.0 {
                o[r * d..(r + 1) * d].iter_mut().for_each(|x| *x /= sum[r]);
                l[r] = max[r] + sum[r].ln();
            }
        }
    });
    Forward { out, lse }
}

pub fn backward(
    shape: &Shape,
    masks: &HeadMasks,
    inputs: &Inputs,
    forward: &Forward,
    threads: usize,
) -> Grads {
    let (s, d, dv) = (shape.seqlen, shape.head_dim, shape.value_dim());
    let scale = shape.scale();
    let tiles = prepare(masks);
    // D_i = dO_i · O_i, the row term of the softmax gradient.
    let delta: Vec<f32> = (0..shape.heads_q * s)
        .map(|row| {
            dot(
                &inputs.d_out[row * dv..(row + 1) * dv],
                &forward.out[row * dv..(row + 1) * dv],
            )
        })
        .collect();
    // Probabilities and dS of one tile, from recomputed scores.
    let tile_grads = |h: usize, qt: usize, kt: usize, full: bool, p: &mut [f32], ds: &mut [f32]| {
        let mask = tiles[masks.index_of_head[h]]
            .as_ref()
            .expect("prepared for every head");
        let (q, k, v) = head_view(shape, inputs, h);
        let (r0, r1) = (qt * TILE, ((qt + 1) * TILE).min(s));
        let (c0, c1) = (kt * TILE, ((kt + 1) * TILE).min(s));
        tile_scores(shape, q, k, (r0, r1), (c0, c1), full, &mask.rows, p);
        for r in r0..r1 {
            let lse = forward.lse[h * s + r];
            let d_out = &inputs.d_out[(h * s + r) * dv..(h * s + r + 1) * dv];
            for c in c0..c1 {
                let at = (r - r0) * TILE + (c - c0);
                let score = p[at];
                p[at] = if score == f32::NEG_INFINITY || lse == f32::NEG_INFINITY {
                    0.0
                } else {
                    (score - lse).exp()
                };
                ds[at] = if p[at] == 0.0 {
                    0.0
                } else {
                    p[at] * (dot(d_out, &v[c * dv..(c + 1) * dv]) - delta[h * s + r]) * scale
                };
            }
        }
        (r0, r1, c0, c1)
    };

    let mut dk = vec![0f32; shape.kv_len()];
    let mut d_values = vec![0f32; shape.v_len()];
    let mut jobs = Vec::new();
    let heads = dk.chunks_mut(s * d).zip(d_values.chunks_mut(s * dv));
    for (kv, (dk_head, dv_head)) in heads.enumerate() {
        for (kt, (dk_tile, dv_tile)) in dk_head
            .chunks_mut(TILE * d)
            .zip(dv_head.chunks_mut(TILE * dv))
            .enumerate()
        {
            jobs.push((kv, kt, dk_tile, dv_tile));
        }
    }
    parallel(jobs, threads, |(kv, kt, dk_tile, dv_tile)| {
        let mut p = vec![0f32; TILE * TILE];
        let mut ds = vec![0f32; TILE * TILE];
        for h in kv * shape.group()..(kv + 1) * shape.group() {
            let mask = tiles[masks.index_of_head[h]]
                .as_ref()
                .expect("prepared for every head");
            for &(qt, full) in &mask.columns[kt] {
                let (r0, r1, c0, c1) = tile_grads(h, qt as usize, kt, full, &mut p, &mut ds);
                for r in r0..r1 {
                    let d_out = &inputs.d_out[(h * s + r) * dv..(h * s + r + 1) * dv];
                    let query = &inputs.q[(h * s + r) * d..(h * s + r + 1) * d];
                    for c in c0..c1 {
                        let at = (r - r0) * TILE + (c - c0);
                        if p[at] != 0.0 {
                            axpy(p[at], d_out, &mut dv_tile[(c - c0) * dv..(c - c0 + 1) * dv]);
                            axpy(ds[at], query, &mut dk_tile[(c - c0) * d..(c - c0 + 1) * d]);
                        }
                    }
                }
            }
        }
    });

    let mut dq = vec![0f32; shape.q_len()];
    let mut jobs = Vec::new();
    for (h, dq_head) in dq.chunks_mut(s * d).enumerate() {
        for (qt, dq_tile) in dq_head.chunks_mut(TILE * d).enumerate() {
            jobs.push((h, qt, dq_tile));
        }
    }
    parallel(jobs, threads, |(h, qt, dq_tile)| {
        let mut p = vec![0f32; TILE * TILE];
        let mut ds = vec![0f32; TILE * TILE];
        let mask = tiles[masks.index_of_head[h]]
            .as_ref()
            .expect("prepared for every head");
        let kv = shape.kv_head(h);
        for (kt, full) in mask.blocks.row(qt) {
            let (r0, r1, c0, c1) = tile_grads(h, qt, kt as usize, full, &mut p, &mut ds);
            for r in r0..r1 {
                let target = &mut dq_tile[(r - r0) * d..(r - r0 + 1) * d];
                for c in c0..c1 {
                    let at = (r - r0) * TILE + (c - c0);
                    if ds[at] != 0.0 {
                        axpy(
                            ds[at],
                            &inputs.k[(kv * s + c) * d..(kv * s + c + 1) * d],
                            target,
                        );
                    }
                }
            }
        }
    });
    Grads {
        dq,
        dk,
        dv: d_values,
    }
}

/// Bytes of scratch the tiled kernel holds per thread.
pub fn workspace_bytes_per_thread() -> u64 {
    (2 * TILE * TILE + 2 * TILE) as u64 * 4
}
