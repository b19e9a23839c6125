//! The five context-parallel methods over one communicator trait: Ulysses (all-to-all of heads),
//! Ring P2P (KV blocks passed around a ring, double-buffered: the next block is in flight while
//! this one is computed), Ring AllGather (all KV gathered, dK/dV reduce-scattered), USP (Ulysses ×
//! ring) and LoongTrain (Ulysses × a double ring of `windows` windows). Every local call goes
//! through [`Problem`], which works on global positions, so any mask of the IR runs exactly.
//! The methods are written once for any [`Store`] (where the tensors live) and
//! [`Communicator`] over its values.

use std::ops::Range;

use crate::comm::Communicator;
use crate::layout::{Layout, LayoutError};
use crate::local::{Partial, Problem, Store, Tokens};
use crate::sharding::Sharding;
use attnbench_sdk::attention::AttentionError;

/// Why a method could not run on a rank: its groups do not fit the heads, or a local attention
/// call failed.
#[derive(Debug, thiserror::Error)]
pub enum MethodError {
    #[error(transparent)]
    Layout(#[from] LayoutError),
    #[error(transparent)]
    Attention(#[from] AttentionError),
}

attnbench_sdk::named_enum! {
    /// The five context-parallel methods, as the `method` parameter and records name them.
    pub enum Method {
        Ulysses = "ulysses",
        RingP2p = "ring_p2p",
        RingAllGather = "ring_allgather",
        Usp = "usp",
        LoongTrain = "loongtrain",
    }
}

/// A method with its group sizes: `ulysses × ring` ranks, the ring in `windows` windows
/// (LoongTrain; 1 otherwise).
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Setup {
    pub method: Method,
    pub layout: Layout,
    pub windows: usize,
}

impl Setup {
    /// The same groups with the sequence dealt by `sharding` (`work`: each token's work, read
    /// by the balanced sharding), or why it cannot deal it.
    pub fn sharded(
        self,
        sharding: Sharding,
        work: impl FnOnce() -> Vec<u64>,
    ) -> Result<Setup, LayoutError> {
        let Layout {
            seqlen,
            ulysses,
            ring,
            placement,
            ..
        } = self.layout;
        Ok(Setup {
            layout: Layout::new(seqlen, ulysses, ring, placement, sharding, work)?,
            ..self
        })
    }
}

/// dQ of the local rows, dK and dV of the local keys.
type Grads<V> = (V, V, V);

/// A ring member's K and V.
type KvBlock<V> = (Tokens<V>, Tokens<V>);

// Message tags, one per kind of traffic.
const A2A: [u32; 8] = [10, 11, 12, 13, 14, 15, 16, 17];
const FWD_KV: u32 = 20;
const FWD_INTER_KV: u32 = 21;
const GATHER_K: u32 = 22;
const GATHER_V: u32 = 23;
const BWD_KV: u32 = 24;
const BWD_INTER_KV: u32 = 25;
const BWD_DKV: u32 = 26;
const BWD_INTER_DKV: u32 = 27;
const SCATTER_DK: u32 = 28;
const SCATTER_DV: u32 = 29;

/// What a rank keeps from its forward pass for the backward, in the layout the ring ran in.
pub struct Saved<V> {
    q: Tokens<V>,
    k: Tokens<V>,
    v: Tokens<V>,
    done: Partial<V>,
    /// Each KV head repeated this many times (Ulysses with more ranks than KV heads).
    kv_repeat: usize,
}

/// A rank's forward results: O in its own tokens (all heads), and the LSE of the rows and heads
/// it computed (after Ulysses' all-to-all: its heads over its ring shard).
pub struct Forward<V> {
    pub out: Tokens<V>,
    pub lse: Tokens<V>,
    pub saved: Saved<V>,
}

/// A rank's gradients, in its own tokens and all heads.
pub struct Gradients<V> {
    pub dq: Tokens<V>,
    pub dk: Tokens<V>,
    pub dv: Tokens<V>,
}

/// The communicators of one rank.
pub struct Groups<'a, V> {
    pub ulysses: &'a dyn Communicator<Values = V>,
    pub ring: &'a dyn Communicator<Values = V>,
}

/// `x` with every head repeated `times` times, in place (head h becomes h·times … h·times+times−1).
fn repeat_heads<S: Store>(
    store: &S,
    x: &Tokens<S::Values>,
    times: usize,
    d: usize,
) -> Tokens<S::Values> {
    if times == 1 {
        return x.clone();
    }
    let block = x.len() * d;
    let mut parts = Vec::new();
    let mut heads = Vec::new();
    for (index, &head) in x.heads.iter().enumerate() {
        for copy in 0..times {
            parts.push((&x.data, index * block..(index + 1) * block));
            heads.push(head * times + copy);
        }
    }
    Tokens {
        positions: x.positions.clone(),
        heads,
        data: store.gather(&parts),
    }
}

/// Sums the copies of every head made by [`repeat_heads`].
fn sum_repeats<S: Store>(
    store: &S,
    x: Tokens<S::Values>,
    times: usize,
    d: usize,
) -> Tokens<S::Values> {
    if times == 1 {
        return x;
    }
    let block = x.len() * d;
    let heads: Vec<usize> = x.heads.iter().step_by(times).map(|h| h / times).collect();
    let mut data = store.zeros(heads.len() * block);
    for index in 0..x.heads.len() {
        let copy = store.gather(&[(&x.data, index * block..(index + 1) * block)]);
        store.add(&mut data, (index / times) * block, &copy);
    }
    Tokens {
        positions: x.positions,
        heads,
        data,
    }
}

/// The range of values of head `index` in a head-major tensor of `rows` values per head.
fn head(index: usize, rows: usize) -> Range<usize> {
    index * rows..(index + 1) * rows
}

/// Sequence-sharded, all heads → this member's heads over the whole group's tokens (in member
/// order): one all-to-all.
fn seq_to_heads<S: Store>(
    store: &S,
    comm: &dyn Communicator<Values = S::Values>,
    tag: u32,
    x: &Tokens<S::Values>,
    positions_of: &dyn Fn(usize) -> Vec<u32>,
    d: usize,
) -> Tokens<S::Values> {
    let (me, n) = (comm.rank(), comm.size());
    let per = x.heads.len() / n;
    let block = per * x.len() * d;
    let chunks = (0..n)
        .map(|j| store.gather(&[(&x.data, head(j, block))]))
        .collect();
    let received = comm.all_to_all(tag, chunks);
    let positions: Vec<Vec<u32>> = (0..n).map(positions_of).collect();
    let mut parts = Vec::new();
    for h in 0..per {
        for (from, part) in received.iter().enumerate() {
            parts.push((part, head(h, positions[from].len() * d)));
        }
    }
    Tokens {
        positions: positions.concat(),
        heads: x.heads[me * per..(me + 1) * per].to_vec(),
        data: store.gather(&parts),
    }
}

/// The inverse of [`seq_to_heads`]: this member's heads over the group's tokens → its own tokens,
/// all of the group's heads.
fn heads_to_seq<S: Store>(
    store: &S,
    comm: &dyn Communicator<Values = S::Values>,
    tag: u32,
    x: &Tokens<S::Values>,
    positions_of: &dyn Fn(usize) -> Vec<u32>,
    d: usize,
) -> Tokens<S::Values> {
    let (me, n) = (comm.rank(), comm.size());
    let lengths: Vec<usize> = (0..n).map(|j| positions_of(j).len()).collect();
    let offsets: Vec<usize> = lengths
        .iter()
        .scan(0, |sum, &l| {
            *sum += l;
            Some(*sum - l)
        })
        .collect();
    let total = x.len();
    let chunks = (0..n)
        .map(|j| {
            let parts: Vec<_> = (0..x.heads.len())
                .map(|h| {
                    let start = (h * total + offsets[j]) * d;
                    (&x.data, start..start + lengths[j] * d)
                })
                .collect();
            store.gather(&parts)
        })
        .collect();
    let received = comm.all_to_all(tag, chunks);
    let per = x.heads.len();
    let first_head = x.heads[0] - me * per;
    let whole: Vec<_> = received
        .iter()
        .map(|part| (part, 0..store.len(part)))
        .collect();
    Tokens {
        positions: positions_of(me),
        heads: (first_head..first_head + per * n).collect(),
        data: store.gather(&whole),
    }
}

/// Two tensors as one message (K and V, or dK and dV).
fn pack<S: Store>(store: &S, a: &S::Values, b: &S::Values) -> S::Values {
    store.gather(&[(a, 0..store.len(a)), (b, 0..store.len(b))])
}

/// The halves of a [`pack`]ed message.
fn unpack<S: Store>(store: &S, message: &S::Values) -> (S::Values, S::Values) {
    let half = store.len(message) / 2;
    (
        store.gather(&[(message, 0..half)]),
        store.gather(&[(message, half..2 * half)]),
    )
}

/// The ring part of a method, on one ring group.
struct RingStep<'a, S: Store> {
    store: &'a S,
    problem: &'a Problem<'a>,
    comm: &'a dyn Communicator<Values = S::Values>,
    /// Tokens of each ring member's shard.
    positions_of: &'a dyn Fn(usize) -> Vec<u32>,
    windows: usize,
}

impl<S: Store> RingStep<'_, S> {
    fn d(&self) -> usize {
        self.problem.head_dim
    }

    fn forward_block(
        &self,
        q: &Tokens<S::Values>,
        k: &Tokens<S::Values>,
        v: &Tokens<S::Values>,
    ) -> Result<Partial<S::Values>, MethodError> {
        Ok(self.problem.forward(self.store, q, k, v)?)
    }

    /// The K and V block of ring member `source`, received from member `from` (a [`pack`]ed
    /// message: the positions are known from the layout, so they never travel).
    fn receive_kv(
        &self,
        from: usize,
        tag: u32,
        source: usize,
        heads: &[usize],
    ) -> (Tokens<S::Values>, Tokens<S::Values>) {
        let (k, v) = unpack(self.store, &self.comm.recv(from, tag));
        let positions = (self.positions_of)(source);
        let tokens = |data| Tokens {
            positions: positions.clone(),
            heads: heads.to_vec(),
            data,
        };
        (tokens(k), tokens(v))
    }

    fn p2p_forward(
        &self,
        q: &Tokens<S::Values>,
        k: &Tokens<S::Values>,
        v: &Tokens<S::Values>,
    ) -> Result<Partial<S::Values>, MethodError> {
        let (r, n, d) = (self.comm.rank(), self.comm.size(), self.d());
        let mut done = None;
        let (mut k_now, mut v_now) = (k.clone(), v.clone());
        for step in 0..n {
            if step + 1 < n {
                // The next step's block travels while this one is computed.
                self.comm.exchange(
                    (r + 1) % n,
                    (r + n - 1) % n,
                    FWD_KV,
                    pack(self.store, &k_now.data, &v_now.data),
                );
            }
            let block = self.forward_block(q, &k_now, &v_now)?;
            Partial::fold(self.store, &mut done, block, d);
            if step + 1 < n {
                let source = (r + n - step - 1) % n;
                (k_now, v_now) = self.receive_kv((r + n - 1) % n, FWD_KV, source, &k.heads);
            }
        }
        Ok(Partial::seen(self.store, done, q.heads.len(), q.len(), d))
    }

    /// dQ of the local rows and dK, dV of the local block. Each block's dK/dV accumulator travels
    /// with it, one hop behind: started by the next rank, completed by the owner.
    fn p2p_backward(
        &self,
        q: &Tokens<S::Values>,
        k: &Tokens<S::Values>,
        v: &Tokens<S::Values>,
        done: &Partial<S::Values>,
        d_out: &S::Values,
    ) -> Result<Grads<S::Values>, MethodError> {
        let store = self.store;
        let (r, n) = (self.comm.rank(), self.comm.size());
        let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
        let own = self.problem.backward(store, q, k, v, done, d_out)?;
        let mut dq = own.dq;
        let (mut k_now, mut v_now) = (k.clone(), v.clone());
        for step in 1..n {
            self.comm
                .exchange(next, prev, BWD_KV, pack(store, &k_now.data, &v_now.data));
            let source = (r + n - step) % n;
            (k_now, v_now) = self.receive_kv(prev, BWD_KV, source, &k.heads);
            let grads = self
                .problem
                .backward(store, q, &k_now, &v_now, done, d_out)?;
            store.add(&mut dq, 0, &grads.dq);
            let mut accumulator = pack(store, &grads.dk, &grads.dv);
            if step > 1 {
                store.add(&mut accumulator, 0, &self.comm.recv(prev, BWD_DKV));
            }
            self.comm.exchange(next, prev, BWD_DKV, accumulator);
        }
        let (mut dk, mut dv) = (own.dk, own.dv);
        if n > 1 {
            let (k_part, v_part) = unpack(store, &self.comm.recv(prev, BWD_DKV));
            store.add(&mut dk, 0, &k_part);
            store.add(&mut dv, 0, &v_part);
        }
        Ok((dq, dk, dv))
    }

    /// Every ring member's K and V block, gathered.
    fn gathered(&self, k: &Tokens<S::Values>, v: &Tokens<S::Values>) -> Vec<KvBlock<S::Values>> {
        let ks = self.comm.all_gather(GATHER_K, k.data.clone());
        let vs = self.comm.all_gather(GATHER_V, v.data.clone());
        ks.into_iter()
            .zip(vs)
            .enumerate()
            .map(|(s, (k_block, v_block))| {
                let tokens = |data| Tokens {
                    positions: (self.positions_of)(s),
                    heads: k.heads.clone(),
                    data,
                };
                (tokens(k_block), tokens(v_block))
            })
            .collect()
    }

    /// The gathered keys block by block, merged: the same result as one block of all keys, with
    /// every local call as long in queries as in keys (what a flash kernel takes).
    fn allgather_forward(
        &self,
        q: &Tokens<S::Values>,
        k: &Tokens<S::Values>,
        v: &Tokens<S::Values>,
    ) -> Result<Partial<S::Values>, MethodError> {
        let d = self.d();
        let mut done = None;
        for (k_block, v_block) in self.gathered(k, v) {
            let block = self.forward_block(q, &k_block, &v_block)?;
            Partial::fold(self.store, &mut done, block, d);
        }
        Ok(Partial::seen(self.store, done, q.heads.len(), q.len(), d))
    }

    fn allgather_backward(
        &self,
        q: &Tokens<S::Values>,
        k: &Tokens<S::Values>,
        v: &Tokens<S::Values>,
        done: &Partial<S::Values>,
        d_out: &S::Values,
    ) -> Result<Grads<S::Values>, MethodError> {
        let store = self.store;
        // K and V are gathered again rather than kept from the forward pass.
        let mut dq = store.zeros(store.len(&q.data));
        let (mut dks, mut dvs) = (Vec::new(), Vec::new());
        for (k_block, v_block) in self.gathered(k, v) {
            let grads = self
                .problem
                .backward(store, q, &k_block, &v_block, done, d_out)?;
            store.add(&mut dq, 0, &grads.dq);
            dks.push(grads.dk);
            dvs.push(grads.dv);
        }
        let dk = self.comm.reduce_scatter(SCATTER_DK, dks);
        let dv = self.comm.reduce_scatter(SCATTER_DV, dvs);
        Ok((dq, dk, dv))
    }

    /// Ring rank of window `window`, position `index` in it; windows are consecutive ring ranks.
    fn member(&self, window: usize, index: usize) -> usize {
        let w = self.comm.size() / self.windows;
        (window % self.windows) * w + index % w
    }

    /// (window, index in it, window size) of this rank.
    fn place(&self) -> (usize, usize, usize) {
        let w = self.comm.size() / self.windows;
        (self.comm.rank() / w, self.comm.rank() % w, w)
    }

    fn double_forward(
        &self,
        q: &Tokens<S::Values>,
        k: &Tokens<S::Values>,
        v: &Tokens<S::Values>,
    ) -> Result<Partial<S::Values>, MethodError> {
        let (m, d) = (self.windows, self.d());
        let (j, a, w) = self.place();
        let store = self.store;
        let mut done = None;
        let (mut k_window, mut v_window) = (k.clone(), v.clone());
        for t in 0..m {
            if t + 1 < m {
                // The next window's block travels during this whole window.
                self.comm.exchange(
                    self.member(j + 1, a),
                    self.member(j + m - 1, a),
                    FWD_INTER_KV,
                    pack(store, &k_window.data, &v_window.data),
                );
            }
            let (mut k_now, mut v_now) = (k_window.clone(), v_window.clone());
            for i in 0..w {
                if i + 1 < w {
                    self.comm.exchange(
                        self.member(j, a + 1),
                        self.member(j, a + w - 1),
                        FWD_KV,
                        pack(store, &k_now.data, &v_now.data),
                    );
                }
                let block = self.forward_block(q, &k_now, &v_now)?;
                Partial::fold(store, &mut done, block, d);
                if i + 1 < w {
                    let source = self.member(j + m - t, a + w - i - 1);
                    (k_now, v_now) =
                        self.receive_kv(self.member(j, a + w - 1), FWD_KV, source, &k.heads);
                }
            }
            if t + 1 < m {
                let source = self.member(j + m - t - 1, a);
                (k_window, v_window) =
                    self.receive_kv(self.member(j + m - 1, a), FWD_INTER_KV, source, &k.heads);
            }
        }
        Ok(Partial::seen(store, done, q.heads.len(), q.len(), d))
    }

    /// The double ring's backward: KV moves as in the forward pass; each block's dK/dV
    /// accumulator goes round its window with it (w sends per window) and then on to the next
    /// window (one send), and is back with its owner after the last window.
    fn double_backward(
        &self,
        q: &Tokens<S::Values>,
        k: &Tokens<S::Values>,
        v: &Tokens<S::Values>,
        done: &Partial<S::Values>,
        d_out: &S::Values,
    ) -> Result<Grads<S::Values>, MethodError> {
        let store = self.store;
        let m = self.windows;
        let (j, a, w) = self.place();
        let (intra_next, intra_prev) = (self.member(j, a + 1), self.member(j, a + w - 1));
        let (inter_next, inter_prev) = (self.member(j + 1, a), self.member(j + m - 1, a));
        let mut dq = store.zeros(store.len(&q.data));
        let (mut k_window, mut v_window) = (k.clone(), v.clone());
        let mut completed = None;
        for t in 0..m {
            if t + 1 < m {
                self.comm.exchange(
                    inter_next,
                    inter_prev,
                    BWD_INTER_KV,
                    pack(store, &k_window.data, &v_window.data),
                );
            }
            let (mut k_now, mut v_now) = (k_window.clone(), v_window.clone());
            let mut returned = None;
            for i in 0..w {
                if i + 1 < w {
                    self.comm.exchange(
                        intra_next,
                        intra_prev,
                        BWD_KV,
                        pack(store, &k_now.data, &v_now.data),
                    );
                }
                let grads = self
                    .problem
                    .backward(store, q, &k_now, &v_now, done, d_out)?;
                store.add(&mut dq, 0, &grads.dq);
                let mut accumulator = pack(store, &grads.dk, &grads.dv);
                if i > 0 {
                    store.add(&mut accumulator, 0, &self.comm.recv(intra_prev, BWD_DKV));
                } else if t > 0 {
                    store.add(
                        &mut accumulator,
                        0,
                        &self.comm.recv(inter_prev, BWD_INTER_DKV),
                    );
                }
                if w > 1 {
                    self.comm
                        .exchange(intra_next, intra_prev, BWD_DKV, accumulator);
                } else {
                    returned = Some(accumulator);
                }
                if i + 1 < w {
                    let source = self.member(j + m - t, a + w - i - 1);
                    (k_now, v_now) = self.receive_kv(intra_prev, BWD_KV, source, &k.heads);
                }
            }
            if w > 1 {
                // The window-start block's accumulator, back after going round the window.
                returned = Some(self.comm.recv(intra_prev, BWD_DKV));
            }
            let returned = returned.expect("a window has at least one member");
            if m > 1 {
                self.comm
                    .exchange(inter_next, inter_prev, BWD_INTER_DKV, returned);
            } else {
                completed = Some(returned);
            }
            if t + 1 < m {
                let source = self.member(j + m - t - 1, a);
                (k_window, v_window) = self.receive_kv(inter_prev, BWD_INTER_KV, source, &k.heads);
            }
        }
        let completed = match completed {
            Some(completed) => completed,
            None => self.comm.recv(inter_prev, BWD_INTER_DKV),
        };
        let (dk, dv) = unpack(store, &completed);
        Ok((dq, dk, dv))
    }

    fn forward(
        &self,
        method: Method,
        q: &Tokens<S::Values>,
        k: &Tokens<S::Values>,
        v: &Tokens<S::Values>,
    ) -> Result<Partial<S::Values>, MethodError> {
        match method {
            Method::Ulysses => self.forward_block(q, k, v),
            Method::RingP2p | Method::Usp => self.p2p_forward(q, k, v),
            Method::RingAllGather => self.allgather_forward(q, k, v),
            Method::LoongTrain => self.double_forward(q, k, v),
        }
    }

    fn backward(
        &self,
        method: Method,
        saved: &Saved<S::Values>,
        d_out: &S::Values,
    ) -> Result<Grads<S::Values>, MethodError> {
        let (q, k, v, done) = (&saved.q, &saved.k, &saved.v, &saved.done);
        match method {
            Method::Ulysses => {
                let g = self.problem.backward(self.store, q, k, v, done, d_out)?;
                Ok((g.dq, g.dk, g.dv))
            }
            Method::RingP2p | Method::Usp => self.p2p_backward(q, k, v, done, d_out),
            Method::RingAllGather => self.allgather_backward(q, k, v, done, d_out),
            Method::LoongTrain => self.double_backward(q, k, v, done, d_out),
        }
    }
}

/// How many times each KV head is repeated so that Ulysses can split KV heads over `ulysses`
/// ranks, or why it cannot.
pub fn kv_repeat(heads_q: usize, heads_kv: usize, ulysses: usize) -> Result<usize, LayoutError> {
    if !heads_q.is_multiple_of(ulysses) {
        return Err(LayoutError::QueryHeads { heads_q, ulysses });
    }
    if heads_kv.is_multiple_of(ulysses) {
        Ok(1)
    } else if ulysses.is_multiple_of(heads_kv) {
        Ok(ulysses / heads_kv)
    } else {
        Err(LayoutError::KvHeads { heads_kv, ulysses })
    }
}

/// One rank's view of a problem: the mask and scale (its `group` is the problem's GQA group).
pub struct Rank<'a> {
    pub setup: Setup,
    pub world_rank: usize,
    pub problem: Problem<'a>,
    pub heads_q: usize,
    pub heads_kv: usize,
}

impl<'a> Rank<'a> {
    /// World rank `w` of `setup` on the masks of `set` (`head_masks` says which head has which).
    pub fn new(
        setup: Setup,
        w: usize,
        set: &'a attnbench_sdk::mask::MaskSet,
        head_masks: &'a attnbench_sdk::reference::HeadMasks,
        shape: &attnbench_sdk::reference::Shape,
    ) -> Rank<'a> {
        Rank {
            setup,
            world_rank: w,
            problem: Problem {
                masks: &set.masks,
                mask_of_head: &head_masks.index_of_head,
                group: shape.group(),
                head_dim: shape.head_dim,
                scale: 1.0 / (shape.head_dim as f64).sqrt(),
                calls: Default::default(),
            },
            heads_q: shape.heads_q,
            heads_kv: shape.heads_kv,
        }
    }

    fn coords(&self) -> (usize, usize) {
        self.setup.layout.coords(self.world_rank)
    }

    /// Tokens of Ulysses member `u` in this rank's ring position.
    fn piece_of(&self) -> impl Fn(usize) -> Vec<u32> + '_ {
        let (_, r) = self.coords();
        move |u| {
            let layout = &self.setup.layout;
            layout.positions(layout.world_rank(u, r))
        }
    }

    /// Runs `work` with this rank's ring step, for KV heads repeated `repeat` times.
    fn with_ring<S: Store, T>(
        &self,
        store: &S,
        groups: &Groups<S::Values>,
        repeat: usize,
        work: impl FnOnce(&RingStep<S>) -> T,
    ) -> T {
        let problem = Problem {
            group: self.heads_q / (self.heads_kv * repeat),
            ..self.problem.clone()
        };
        let ring_of = |r| self.setup.layout.ring_positions(r).to_vec();
        work(&RingStep {
            store,
            problem: &problem,
            comm: groups.ring,
            positions_of: &ring_of,
            windows: self.setup.windows,
        })
    }

    pub fn forward<S: Store>(
        &self,
        store: &S,
        groups: &Groups<S::Values>,
        q: &Tokens<S::Values>,
        k: &Tokens<S::Values>,
        v: &Tokens<S::Values>,
    ) -> Result<Forward<S::Values>, MethodError> {
        let layout = &self.setup.layout;
        let d = self.problem.head_dim;
        let repeat = kv_repeat(self.heads_q, self.heads_kv, layout.ulysses)?;
        let (k, v) = (
            repeat_heads(store, k, repeat, d),
            repeat_heads(store, v, repeat, d),
        );
        let piece_of = self.piece_of();
        let (q, k, v) = if layout.ulysses > 1 {
            let u = groups.ulysses;
            (
                seq_to_heads(store, u, A2A[0], q, &piece_of, d),
                seq_to_heads(store, u, A2A[1], &k, &piece_of, d),
                seq_to_heads(store, u, A2A[2], &v, &piece_of, d),
            )
        } else {
            (q.clone(), k, v)
        };
        let done = self.with_ring(store, groups, repeat, |ring| {
            ring.forward(self.setup.method, &q, &k, &v)
        })?;
        let out = q.like(done.out.clone());
        let out = if layout.ulysses > 1 {
            heads_to_seq(store, groups.ulysses, A2A[3], &out, &piece_of, d)
        } else {
            out
        };
        let lse = q.like(done.lse.clone());
        Ok(Forward {
            out,
            lse,
            saved: Saved {
                q,
                k,
                v,
                done,
                kv_repeat: repeat,
            },
        })
    }

    pub fn backward<S: Store>(
        &self,
        store: &S,
        groups: &Groups<S::Values>,
        saved: &Saved<S::Values>,
        d_out: &Tokens<S::Values>,
    ) -> Result<Gradients<S::Values>, MethodError> {
        let layout = &self.setup.layout;
        let d = self.problem.head_dim;
        let piece_of = self.piece_of();
        let d_out = if layout.ulysses > 1 {
            seq_to_heads(store, groups.ulysses, A2A[4], d_out, &piece_of, d)
        } else {
            d_out.clone()
        };
        let (dq, dk, dv) = self.with_ring(store, groups, saved.kv_repeat, |ring| {
            ring.backward(self.setup.method, saved, &d_out.data)
        })?;
        let (dq, dk, dv) = (saved.q.like(dq), saved.k.like(dk), saved.v.like(dv));
        let (dq, dk, dv) = if layout.ulysses > 1 {
            let u = groups.ulysses;
            (
                heads_to_seq(store, u, A2A[5], &dq, &piece_of, d),
                heads_to_seq(store, u, A2A[6], &dk, &piece_of, d),
                heads_to_seq(store, u, A2A[7], &dv, &piece_of, d),
            )
        } else {
            (dq, dk, dv)
        };
        Ok(Gradients {
            dq,
            dk: sum_repeats(store, dk, saved.kv_repeat, d),
            dv: sum_repeats(store, dv, saved.kv_repeat, d),
        })
    }
}
