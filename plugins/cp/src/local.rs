//! Attention of one rank's queries against one block of keys, in f64: the local call every
//! context-parallel step makes. Rows and keys carry their global positions, so the mask is the
//! whole sequence's mask whatever the sharding, and a block's partial results merge exactly.
//!
//! Tensors are head-major: `[heads][tokens][head_dim]`; LSE `[heads][tokens]`.

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

    fn row(&self, head: usize, token: usize, d: usize) -> &[f64] {
        let start = (head * self.len() + token) * d;
        &self.data[start..start + d]
    }
}

/// The masks of the heads: `mask_of_head[h]` indexes `masks` for global query head `h`; query head
/// `h` reads global KV head `h / group`.
pub struct Problem<'a> {
    pub masks: &'a [Mask],
    pub mask_of_head: &'a [usize],
    pub group: usize,
    pub head_dim: usize,
    pub scale: f64,
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

    /// Allowed keys of `kv` for query row `q` of head `h`: indices into the block.
    fn allowed<'b>(&self, h: usize, q: u32, kv: &'b Tokens) -> impl Iterator<Item = usize> + 'b {
        let mask = &self.masks[self.mask_of_head[h]];
        let mut keys = Vec::new();
        for (j, &k) in kv.positions.iter().enumerate() {
            if mask.allows(q as u64, k as u64) {
                keys.push(j);
            }
        }
        keys.into_iter()
    }

    /// Scores of row `t` of head index `hi` against the allowed keys of the block.
    fn scores(&self, q: &Tokens, hi: usize, t: usize, kv: &Tokens) -> (usize, Vec<(usize, f64)>) {
        let d = self.head_dim;
        let h = q.heads[hi];
        let ki = self.kv_index(kv, h);
        let query = q.row(hi, t, d);
        let scores = self
            .allowed(h, q.positions[t], kv)
            .map(|j| {
                let key = kv.row(ki, j, d);
                let dot: f64 = query.iter().zip(key).map(|(a, b)| a * b).sum();
                (j, dot * self.scale)
            })
            .collect();
        (ki, scores)
    }

    /// Attention of `q` over the keys of `kv` only.
    pub fn forward(&self, q: &Tokens, k: &Tokens, v: &Tokens) -> Partial {
        let d = self.head_dim;
        let mut result = Partial::empty(q.heads.len(), q.len(), d);
        for hi in 0..q.heads.len() {
            for t in 0..q.len() {
                let (ki, scores) = self.scores(q, hi, t, k);
                if scores.is_empty() {
                    continue;
                }
                let top = scores.iter().map(|s| s.1).fold(f64::NEG_INFINITY, f64::max);
                let total: f64 = scores.iter().map(|s| (s.1 - top).exp()).sum();
                let lse = top + total.ln();
                let row = hi * q.len() + t;
                let out = &mut result.out[row * d..(row + 1) * d];
                for &(j, score) in &scores {
                    let p = (score - lse).exp();
                    for (o, x) in out.iter_mut().zip(v.row(ki, j, d)) {
                        *o += p * x;
                    }
                }
                result.lse[row] = lse;
            }
        }
        result
    }

    /// The block's share of the gradients, given the rows' final O and LSE (over all keys) and
    /// dO: P = exp(S − LSE), dS = P∘(dO·Vᵀ − rowsum(dO∘O))·scale.
    pub fn backward(
        &self,
        q: &Tokens,
        k: &Tokens,
        v: &Tokens,
        done: &Partial,
        d_out: &[f64],
    ) -> BlockGrads {
        let d = self.head_dim;
        let mut grads = BlockGrads {
            dq: vec![0.0; q.data.len()],
            dk: vec![0.0; k.data.len()],
            dv: vec![0.0; v.data.len()],
        };
        for hi in 0..q.heads.len() {
            for t in 0..q.len() {
                let row = hi * q.len() + t;
                let lse = done.lse[row];
                if lse == f64::NEG_INFINITY {
                    continue;
                }
                let (ki, scores) = self.scores(q, hi, t, k);
                let d_o = &d_out[row * d..(row + 1) * d];
                let delta: f64 = d_o
                    .iter()
                    .zip(&done.out[row * d..(row + 1) * d])
                    .map(|(a, b)| a * b)
                    .sum();
                let query = q.row(hi, t, d).to_vec();
                for (j, score) in scores {
                    let p = (score - lse).exp();
                    let value = v.row(ki, j, d);
                    let dp: f64 = d_o.iter().zip(value).map(|(a, b)| a * b).sum();
                    let ds = p * (dp - delta) * self.scale;
                    let key = k.row(ki, j, d).to_vec();
                    let kv_row = (ki * k.len() + j) * d;
                    for i in 0..d {
                        grads.dq[row * d + i] += ds * key[i];
                        grads.dk[kv_row + i] += ds * query[i];
                        grads.dv[kv_row + i] += p * d_o[i];
                    }
                }
            }
        }
        grads
    }
}
