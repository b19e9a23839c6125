//! Attention of one rank's queries against one block of keys, in f64: the local call every
//! context-parallel step makes. Rows and keys carry their global positions, so the mask is the
//! whole sequence's mask restricted to the block whatever the sharding, and a block's partial
//! results merge exactly.
//!
//! Tensors are head-major: `[heads][tokens][head_dim]`; LSE `[heads][tokens]`.

use std::ops::Range;

use attnbench_sdk::attention::{Backend, HostBlock, RowIntervals};
use attnbench_sdk::mask::Mask;

/// Tokens of one side of a block: their global positions and, per head, their vectors.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Tokens {
    pub positions: Vec<u32>,
    /// Global head indices of the heads held (query heads for Q, KV heads for K and V).
    pub heads: Vec<usize>,
    pub data: Vec<f64>,
}

impl Tokens {
    pub fn len(&self) -> usize {
        self.positions.len()
    }

    /// Other values over the same tokens and heads.
    pub fn like(&self, data: Vec<f64>) -> Tokens {
        Tokens {
            positions: self.positions.clone(),
            heads: self.heads.clone(),
            data,
        }
    }
}

/// The masks of the heads: `mask_of_head[h]` indexes `masks` for global query head `h`; query head
/// `h` reads global KV head `h / group`. Blocks run on `backend` — a kernel plugin's in-process
/// attention backend — or, when it is `None`, on the SDK's f64 host block directly.
#[derive(Clone, Copy)]
pub struct Problem<'a> {
    pub masks: &'a [Mask],
    pub mask_of_head: &'a [usize],
    pub group: usize,
    pub head_dim: usize,
    pub scale: f64,
    pub backend: Option<&'a Backend>,
}

/// A block's or a merged result: O normalised over the keys seen so far, and their LSE.
#[derive(Debug, Clone)]
pub struct Partial {
    pub out: Vec<f64>,
    pub lse: Vec<f64>,
}

impl Partial {
    /// Nothing seen yet: O = 0, LSE = −∞ (the empty-row convention).
    pub fn empty(heads: usize, tokens: usize, d: usize) -> Partial {
        Partial {
            out: vec![0.0; heads * tokens * d],
            lse: vec![f64::NEG_INFINITY; heads * tokens],
        }
    }

    /// Folds `other` (over other keys of the same rows) into this one.
    pub fn merge(&mut self, other: &Partial, d: usize) {
        for (row, (lse, other_lse)) in self.lse.iter_mut().zip(&other.lse).enumerate() {
            if *other_lse == f64::NEG_INFINITY {
                continue;
            }
            let merged = if *lse == f64::NEG_INFINITY {
                *other_lse
            } else {
                let top = lse.max(*other_lse);
                top + ((*lse - top).exp() + (*other_lse - top).exp()).ln()
            };
            let (mine, theirs) = ((*lse - merged).exp(), (*other_lse - merged).exp());
            for i in row * d..(row + 1) * d {
                self.out[i] = self.out[i] * mine + other.out[i] * theirs;
            }
            *lse = merged;
        }
    }
}

/// Gradients of one block: dQ for the rows, dK and dV for the block's keys.
#[derive(Debug, Clone)]
pub struct BlockGrads {
    pub dq: Vec<f64>,
    pub dk: Vec<f64>,
    pub dv: Vec<f64>,
}

/// One call of a block: the query heads it covers (all of the block's, or one) with the KV
/// heads they read, and their mask restricted to the block.
struct Call {
    /// Query heads `q_heads` and KV heads `kv_heads` of the block's tensors (index ranges).
    q_heads: Range<usize>,
    kv_heads: Range<usize>,
    /// For each query head of the call, its KV head within `kv_heads`.
    kv_head_of: Vec<u32>,
    rows: RowIntervals,
}

impl Problem<'_> {
    /// Index in `kv.heads` of the KV head query head `h` reads.
    fn kv_index(&self, kv: &Tokens, h: usize) -> usize {
        let wanted = h / self.group;
        kv.heads
            .iter()
            .position(|&k| k == wanted)
            .unwrap_or_else(|| {
                panic!("query head {h} needs KV head {wanted}, which this block does not hold")
            })
    }

    /// The block's calls: one for all heads when they share a mask (the common case, one
    /// backend call), else one per head.
    fn calls(&self, q: &Tokens, kv: &Tokens) -> Vec<Call> {
        let mask_of = |hi: usize| self.mask_of_head[q.heads[hi]];
        let restrict =
            |m: usize| RowIntervals::restrict(&self.masks[m], &q.positions, &kv.positions);
        if (0..q.heads.len()).all(|hi| mask_of(hi) == mask_of(0)) {
            return vec![Call {
                q_heads: 0..q.heads.len(),
                kv_heads: 0..kv.heads.len(),
                kv_head_of: q
                    .heads
                    .iter()
                    .map(|&h| self.kv_index(kv, h) as u32)
                    .collect(),
                rows: restrict(mask_of(0)),
            }];
        }
        (0..q.heads.len())
            .map(|hi| {
                let ki = self.kv_index(kv, q.heads[hi]);
                Call {
                    q_heads: hi..hi + 1,
                    kv_heads: ki..ki + 1,
                    kv_head_of: vec![0],
                    rows: restrict(mask_of(hi)),
                }
            })
            .collect()
    }

    /// Attention of `q` over the keys of `kv` only.
    pub fn forward(&self, q: &Tokens, k: &Tokens, v: &Tokens) -> Result<Partial, String> {
        let mut result = Partial::empty(q.heads.len(), q.len(), self.head_dim);
        self.each_call(q, k, |block, Span { rows, keys, lse }| {
            self.run_forward(
                block,
                (&q.data[rows.clone()], &k.data[keys.clone()], &v.data[keys]),
                &mut result.out[rows],
                &mut result.lse[lse],
            )
        })?;
        Ok(result)
    }

    /// The block's share of the gradients, given the rows' final O and LSE (over all keys) and
    /// dO.
    pub fn backward(
        &self,
        q: &Tokens,
        k: &Tokens,
        v: &Tokens,
        done: &Partial,
        d_out: &[f64],
    ) -> Result<BlockGrads, String> {
        let mut grads = BlockGrads {
            dq: vec![0.0; q.data.len()],
            dk: vec![0.0; k.data.len()],
            dv: vec![0.0; v.data.len()],
        };
        self.each_call(q, k, |block, Span { rows, keys, lse }| {
            // A KV head's gradients add up over the calls of the heads that read it.
            let (mut dk, mut dv) = (vec![0.0; keys.len()], vec![0.0; keys.len()]);
            self.run_backward(
                block,
                (
                    &q.data[rows.clone()],
                    &k.data[keys.clone()],
                    &v.data[keys.clone()],
                ),
                (
                    &done.out[rows.clone()],
                    &done.lse[lse],
                    &d_out[rows.clone()],
                ),
                (&mut grads.dq[rows], &mut dk, &mut dv),
            )?;
            add(&mut grads.dk[keys.clone()], &dk);
            add(&mut grads.dv[keys], &dv);
            Ok(())
        })?;
        Ok(grads)
    }

    /// Runs `work` on every call of the block `q` × `kv`, with the call's host block and where
    /// its heads lie in the block's tensors.
    fn each_call(
        &self,
        q: &Tokens,
        kv: &Tokens,
        mut work: impl FnMut(&HostBlock<'_>, Span) -> Result<(), String>,
    ) -> Result<(), String> {
        let (d, ql, kl) = (self.head_dim, q.len(), kv.len());
        for call in self.calls(q, kv) {
            let block = HostBlock {
                head_dim: d,
                q_len: ql,
                k_len: kl,
                scale: self.scale,
                kv_head_of: &call.kv_head_of,
                heads_kv: call.kv_heads.len(),
                rows: &call.rows,
            };
            let scaled = |heads: &Range<usize>, per_head: usize| {
                heads.start * per_head..heads.end * per_head
            };
            let span = Span {
                rows: scaled(&call.q_heads, ql * d),
                keys: scaled(&call.kv_heads, kl * d),
                lse: scaled(&call.q_heads, ql),
            };
            work(&block, span)?;
        }
        Ok(())
    }

    fn run_forward(
        &self,
        block: &HostBlock<'_>,
        qkv: (&[f64], &[f64], &[f64]),
        out: &mut [f64],
        lse: &mut [f64],
    ) -> Result<(), String> {
        match self.backend {
            Some(backend) => backend.forward_host(block, qkv, out, lse),
            None => {
                block.forward(qkv.0, qkv.1, qkv.2, out, lse);
                Ok(())
            }
        }
    }

    fn run_backward(
        &self,
        block: &HostBlock<'_>,
        qkv: (&[f64], &[f64], &[f64]),
        (out, lse, d_out): (&[f64], &[f64], &[f64]),
        (dq, dk, dv): (&mut [f64], &mut [f64], &mut [f64]),
    ) -> Result<(), String> {
        match self.backend {
            Some(backend) => backend.backward_host(block, qkv, out, lse, d_out, (dq, dk, dv)),
            None => {
                block.backward(qkv, out, lse, d_out, dq, dk, dv);
                Ok(())
            }
        }
    }
}

/// Where a call's heads lie in the block's head-major tensors: its query rows (Q, O, dO, dQ),
/// its keys (K, V, dK, dV) and its LSE entries.
struct Span {
    rows: Range<usize>,
    keys: Range<usize>,
    lse: Range<usize>,
}

/// `target += source`, element by element.
pub fn add(target: &mut [f64], source: &[f64]) {
    for (t, s) in target.iter_mut().zip(source) {
        *t += s;
    }
}
