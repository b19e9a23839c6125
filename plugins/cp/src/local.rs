//! Attention of one rank's queries against one block of keys: the local call every
//! context-parallel step makes. Rows and keys carry their global positions, so the mask is the
//! whole sequence's mask restricted to the block whatever the sharding, and a block's partial
//! results merge exactly.
//!
//! Tensors are head-major: `[heads][tokens][head_dim]`; LSE `[heads][tokens]`. Where their
//! values live is a [`Store`]'s business: [`HostStore`] keeps f64 vectors on the host (exact, what
//! the threads and processes backends run); a GPU store keeps device buffers.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::{Arc, Mutex};

use attnbench_sdk::attention::{AttentionError, Backend, HostBlock, RowIntervals};
use attnbench_sdk::mask::Mask;

/// The memory a rank's tensors live in and the arithmetic the methods do on them.
pub trait Store {
    /// The values of one tensor.
    type Values: Clone;

    /// Elements of `x`.
    fn len(&self, x: &Self::Values) -> usize;
    /// `count` zeros, to accumulate results in (f32 on a GPU, whose inputs are 16-bit).
    fn zeros(&self, count: usize) -> Self::Values;
    /// `count` times −∞ (the LSE of rows without keys).
    fn negative_infinities(&self, count: usize) -> Self::Values;
    /// `count` values that a block's calls overwrite in full before anything reads them (a
    /// forward's O and LSE, a backward's dQ: the calls cover every query head, and a call writes
    /// every row of its heads). A store may leave them unfilled; one that fills them puts `fill`
    /// there.
    fn for_overwrite(&self, count: usize, fill: f64) -> Self::Values;
    /// The concatenation of ranges of tensors (of one kind).
    fn gather(&self, parts: &[(&Self::Values, Range<usize>)]) -> Self::Values;
    /// `target[at..at + len(source)] += source`.
    fn add(&self, target: &mut Self::Values, at: usize, source: &Self::Values);
    /// Folds `other` (O and LSE over other keys of the same rows) into `done`.
    fn merge(&self, done: &mut Partial<Self::Values>, other: &Partial<Self::Values>, d: usize);
    /// O and LSE of `block` into `out[spans.rows]` and `lse[spans.lse]`, from
    /// `q[spans.rows]`, `k[spans.keys]` and `v[spans.keys]`.
    fn forward(
        &self,
        block: &HostBlock<'_>,
        spans: &Span,
        qkv: (&Self::Values, &Self::Values, &Self::Values),
        out: &mut Self::Values,
        lse: &mut Self::Values,
    ) -> Result<(), AttentionError>;
    /// The block's dQ into `dq[spans.rows]` and its dK and dV (keys × head_dim each, for the
    /// block's KV heads), given the rows' final O and LSE and dO.
    fn backward(
        &self,
        block: &HostBlock<'_>,
        spans: &Span,
        qkv: (&Self::Values, &Self::Values, &Self::Values),
        done: (&Self::Values, &Self::Values, &Self::Values),
        dq: &mut Self::Values,
    ) -> Result<(Self::Values, Self::Values), AttentionError>;
}

/// Tokens of one side of a block: their global positions and, per head, their vectors.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Tokens<V> {
    pub positions: Vec<u32>,
    /// Global head indices of the heads held (query heads for Q, KV heads for K and V).
    pub heads: Vec<usize>,
    pub data: V,
}

impl<V> Tokens<V> {
    pub fn len(&self) -> usize {
        self.positions.len()
    }

    /// Other values over the same tokens and heads.
    pub fn like<W>(&self, data: W) -> Tokens<W> {
        Tokens {
            positions: self.positions.clone(),
            heads: self.heads.clone(),
            data,
        }
    }
}

/// A block's or a merged result: O normalised over the keys seen so far, and their LSE.
#[derive(Debug, Clone)]
pub struct Partial<V> {
    pub out: V,
    pub lse: V,
}

impl<V> Partial<V> {
    /// Nothing seen yet: O = 0, LSE = −∞ (the empty-row convention).
    pub fn empty<S: Store<Values = V>>(store: &S, heads: usize, tokens: usize, d: usize) -> Self {
        Partial {
            out: store.zeros(heads * tokens * d),
            lse: store.negative_infinities(heads * tokens),
        }
    }

    /// Folds a block's result into what the rows have seen so far. The first block is taken as
    /// it is: merged into an empty partial it would only be copied (O·1 + 0, the same LSE).
    pub fn fold<S: Store<Values = V>>(store: &S, seen: &mut Option<Self>, block: Self, d: usize) {
        match seen {
            Some(seen) => store.merge(seen, &block, d),
            None => *seen = Some(block),
        }
    }

    /// What the rows have seen, or nothing seen when no block came.
    pub fn seen<S: Store<Values = V>>(
        store: &S,
        seen: Option<Self>,
        heads: usize,
        tokens: usize,
        d: usize,
    ) -> Self {
        seen.unwrap_or_else(|| Partial::empty(store, heads, tokens, d))
    }
}

/// Gradients of one block: dQ for the rows, dK and dV for the block's keys.
#[derive(Debug, Clone)]
pub struct BlockGrads<V> {
    pub dq: V,
    pub dk: V,
    pub dv: V,
}

/// The masks of the heads: `mask_of_head[h]` indexes `masks` for global query head `h`; query head
/// `h` reads global KV head `h / group`.
#[derive(Clone)]
pub struct Problem<'a> {
    pub masks: &'a [Mask],
    pub mask_of_head: &'a [usize],
    pub group: usize,
    pub head_dim: usize,
    pub scale: f64,
    pub calls: Arc<CallCache>,
}

/// The calls of the blocks a rank has met. A block's calls (its mask restricted to its rows and
/// keys) depend only on the mask, the grouping and where the rows and keys lie, so each is
/// worked out once — at the warm-up — as training works out a batch's mask metadata once for all
/// the calls of its forward and backward passes.
#[derive(Default)]
pub struct CallCache(Mutex<HashMap<CallKey, Arc<Vec<Call>>>>);

/// The grouping, the query and KV heads, and the rows' and keys' positions.
type CallKey = (usize, Vec<usize>, Vec<usize>, Vec<u32>, Vec<u32>);

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

/// Where a call's heads lie in the block's head-major tensors: its query rows (Q, O, dO, dQ),
/// its keys (K, V, dK, dV) and its LSE entries.
pub struct Span {
    pub rows: Range<usize>,
    pub keys: Range<usize>,
    pub lse: Range<usize>,
}

impl Problem<'_> {
    /// Index in `kv.heads` of the KV head query head `h` reads.
    fn kv_index<V>(&self, kv: &Tokens<V>, h: usize) -> usize {
        let wanted = h / self.group;
        kv.heads
            .iter()
            .position(|&k| k == wanted)
            .unwrap_or_else(|| {
                panic!("query head {h} needs KV head {wanted}, which this block does not hold")
            })
    }

    /// The block's calls, worked out once per block (see [`CallCache`]).
    fn cached_calls<V>(&self, q: &Tokens<V>, kv: &Tokens<V>) -> Arc<Vec<Call>> {
        let key = (
            self.group,
            q.heads.clone(),
            kv.heads.clone(),
            q.positions.clone(),
            kv.positions.clone(),
        );
        let mut cache = self.calls.0.lock().unwrap_or_else(|e| e.into_inner());
        cache
            .entry(key)
            .or_insert_with(|| Arc::new(self.calls(q, kv)))
            .clone()
    }

    /// The block's calls: one for all heads when they share a mask (the common case, one
    /// backend call), else one per head.
    fn calls<V>(&self, q: &Tokens<V>, kv: &Tokens<V>) -> Vec<Call> {
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
    pub fn forward<S: Store>(
        &self,
        store: &S,
        q: &Tokens<S::Values>,
        k: &Tokens<S::Values>,
        v: &Tokens<S::Values>,
    ) -> Result<Partial<S::Values>, AttentionError> {
        let rows = q.heads.len() * q.len();
        let mut result = Partial {
            out: store.for_overwrite(rows * self.head_dim, 0.0),
            lse: store.for_overwrite(rows, f64::NEG_INFINITY),
        };
        self.each_call(q, k, |block, span| {
            store.forward(
                block,
                &span,
                (&q.data, &k.data, &v.data),
                &mut result.out,
                &mut result.lse,
            )
        })?;
        Ok(result)
    }

    /// The block's share of the gradients, given the rows' final O and LSE (over all keys) and
    /// dO.
    pub fn backward<S: Store>(
        &self,
        store: &S,
        q: &Tokens<S::Values>,
        k: &Tokens<S::Values>,
        v: &Tokens<S::Values>,
        done: &Partial<S::Values>,
        d_out: &S::Values,
    ) -> Result<BlockGrads<S::Values>, AttentionError> {
        let mut dq = store.for_overwrite(store.len(&q.data), 0.0);
        let mut parts = Vec::new();
        self.each_call(q, k, |block, span| {
            let (dk, dv) = store.backward(
                block,
                &span,
                (&q.data, &k.data, &v.data),
                (&done.out, &done.lse, d_out),
                &mut dq,
            )?;
            parts.push((span.keys.start, dk, dv));
            Ok(())
        })?;
        // One call (every head sharing the mask, the common case) gives the block's dK and dV
        // whole; per-head calls add up over the query heads that read a KV head.
        let whole = store.len(&k.data);
        if let [(0, dk, _)] = parts.as_slice() {
            if store.len(dk) == whole {
                let (_, dk, dv) = parts.pop().expect("one part");
                return Ok(BlockGrads { dq, dk, dv });
            }
        }
        let (mut dk, mut dv) = (store.zeros(whole), store.zeros(store.len(&v.data)));
        for (at, part_k, part_v) in &parts {
            store.add(&mut dk, *at, part_k);
            store.add(&mut dv, *at, part_v);
        }
        Ok(BlockGrads { dq, dk, dv })
    }

    /// Runs `work` on every call of the block `q` × `kv`, with the call's host block and where
    /// its heads lie in the block's tensors.
    fn each_call<V>(
        &self,
        q: &Tokens<V>,
        kv: &Tokens<V>,
        mut work: impl FnMut(&HostBlock<'_>, Span) -> Result<(), AttentionError>,
    ) -> Result<(), AttentionError> {
        let (d, ql, kl) = (self.head_dim, q.len(), kv.len());
        for call in self.cached_calls(q, kv).iter() {
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
}

/// Host memory, f64: blocks run on `backend` — a kernel plugin's in-process attention backend —
/// or, when it is `None`, on the SDK's f64 host block directly.
#[derive(Clone, Copy)]
pub struct HostStore<'a> {
    pub backend: Option<&'a Backend>,
}

impl Store for HostStore<'_> {
    type Values = Vec<f64>;

    fn len(&self, x: &Vec<f64>) -> usize {
        x.len()
    }

    fn zeros(&self, count: usize) -> Vec<f64> {
        vec![0.0; count]
    }

    fn negative_infinities(&self, count: usize) -> Vec<f64> {
        vec![f64::NEG_INFINITY; count]
    }

    fn for_overwrite(&self, count: usize, fill: f64) -> Vec<f64> {
        vec![fill; count]
    }

    fn gather(&self, parts: &[(&Vec<f64>, Range<usize>)]) -> Vec<f64> {
        let mut data = Vec::with_capacity(parts.iter().map(|(_, r)| r.len()).sum());
        for (x, range) in parts {
            data.extend_from_slice(&x[range.clone()]);
        }
        data
    }

    fn add(&self, target: &mut Vec<f64>, at: usize, source: &Vec<f64>) {
        for (t, s) in target[at..at + source.len()].iter_mut().zip(source) {
            *t += s;
        }
    }

    fn merge(&self, done: &mut Partial<Vec<f64>>, other: &Partial<Vec<f64>>, d: usize) {
        for (row, (lse, other_lse)) in done.lse.iter_mut().zip(&other.lse).enumerate() {
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
                done.out[i] = done.out[i] * mine + other.out[i] * theirs;
            }
            *lse = merged;
        }
    }

    fn forward(
        &self,
        block: &HostBlock<'_>,
        spans: &Span,
        (q, k, v): (&Vec<f64>, &Vec<f64>, &Vec<f64>),
        out: &mut Vec<f64>,
        lse: &mut Vec<f64>,
    ) -> Result<(), AttentionError> {
        let qkv = (
            &q[spans.rows.clone()],
            &k[spans.keys.clone()],
            &v[spans.keys.clone()],
        );
        let (out, lse) = (&mut out[spans.rows.clone()], &mut lse[spans.lse.clone()]);
        match self.backend {
            Some(backend) => backend.forward_host(block, qkv, out, lse),
            None => {
                block.forward(qkv.0, qkv.1, qkv.2, out, lse);
                Ok(())
            }
        }
    }

    fn backward(
        &self,
        block: &HostBlock<'_>,
        spans: &Span,
        (q, k, v): (&Vec<f64>, &Vec<f64>, &Vec<f64>),
        (out, lse, d_out): (&Vec<f64>, &Vec<f64>, &Vec<f64>),
        dq: &mut Vec<f64>,
    ) -> Result<(Vec<f64>, Vec<f64>), AttentionError> {
        let qkv = (
            &q[spans.rows.clone()],
            &k[spans.keys.clone()],
            &v[spans.keys.clone()],
        );
        let (out, lse, d_out) = (
            &out[spans.rows.clone()],
            &lse[spans.lse.clone()],
            &d_out[spans.rows.clone()],
        );
        let dq = &mut dq[spans.rows.clone()];
        let (mut dk, mut dv) = (vec![0.0; spans.keys.len()], vec![0.0; spans.keys.len()]);
        match self.backend {
            Some(backend) => {
                backend.backward_host(block, qkv, out, lse, d_out, (dq, &mut dk, &mut dv))?
            }
            None => block.backward(qkv, out, lse, d_out, dq, &mut dk, &mut dv),
        }
        Ok((dk, dv))
    }
}
