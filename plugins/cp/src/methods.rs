//! The five context-parallel methods over one communicator trait: Ulysses (all-to-all of heads),
//! Ring P2P (KV blocks passed around a ring, double-buffered: the next block is in flight while
//! this one is computed), Ring AllGather (all KV gathered, dK/dV reduce-scattered), USP (Ulysses ×
//! ring) and LoongTrain (Ulysses × a double ring of `windows` windows). Every local call goes
//! through [`Problem`], which works on global positions, so any mask of the IR runs exactly.

use crate::comm::Communicator;
use crate::layout::Layout;
use crate::local::{add, Partial, Problem, Tokens};

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Method {
    Ulysses,
    RingP2p,
    RingAllGather,
    Usp,
    LoongTrain,
}

impl Method {
    pub const ALL: [Method; 5] = [
        Method::Ulysses,
        Method::RingP2p,
        Method::RingAllGather,
        Method::Usp,
        Method::LoongTrain,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Method::Ulysses => "ulysses",
            Method::RingP2p => "ring_p2p",
            Method::RingAllGather => "ring_allgather",
            Method::Usp => "usp",
            Method::LoongTrain => "loongtrain",
        }
    }

    pub fn parse(name: &str) -> Option<Method> {
        Method::ALL.into_iter().find(|m| m.name() == name)
    }
}

/// A method with its group sizes: `ulysses × ring` ranks, the ring in `windows` windows
/// (LoongTrain; 1 otherwise).
#[derive(Debug, Clone, Copy, serde::Serialize, serde::Deserialize)]
pub struct Setup {
    pub method: Method,
    pub layout: Layout,
    pub windows: usize,
}

/// dQ of the local rows, dK and dV of the local keys.
type Grads = (Vec<f64>, Vec<f64>, Vec<f64>);

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
pub struct Saved {
    q: Tokens,
    k: Tokens,
    v: Tokens,
    done: Partial,
    /// Each KV head repeated this many times (Ulysses with more ranks than KV heads).
    kv_repeat: usize,
}

/// A rank's forward results: O in its own tokens (all heads), and the LSE of the rows and heads
/// it computed (after Ulysses' all-to-all: its heads over its ring shard).
pub struct Forward {
    pub out: Tokens,
    pub lse: Tokens,
    pub saved: Saved,
}

/// A rank's gradients, in its own tokens and all heads.
pub struct Gradients {
    pub dq: Tokens,
    pub dk: Tokens,
    pub dv: Tokens,
}

/// The communicators of one rank.
pub struct Groups<'a> {
    pub ulysses: &'a dyn Communicator,
    pub ring: &'a dyn Communicator,
}

/// `x` with every head repeated `times` times, in place (head h becomes h·times … h·times+times−1).
fn repeat_heads(x: &Tokens, times: usize, d: usize) -> Tokens {
    if times == 1 {
        return x.clone();
    }
    let block = x.len() * d;
    let mut data = Vec::with_capacity(x.data.len() * times);
    let mut heads = Vec::new();
    for (index, &head) in x.heads.iter().enumerate() {
        for copy in 0..times {
            data.extend_from_slice(&x.data[index * block..(index + 1) * block]);
            heads.push(head * times + copy);
        }
    }
    Tokens {
        positions: x.positions.clone(),
        heads,
        data,
    }
}

/// Sums the copies of every head made by [`repeat_heads`].
fn sum_repeats(x: Tokens, times: usize, d: usize) -> Tokens {
    if times == 1 {
        return x;
    }
    let block = x.len() * d;
    let heads: Vec<usize> = x.heads.iter().step_by(times).map(|h| h / times).collect();
    let mut data = vec![0.0; heads.len() * block];
    for (index, chunk) in x.data.chunks(block).enumerate() {
        let target = &mut data[(index / times) * block..(index / times + 1) * block];
        for (t, value) in target.iter_mut().zip(chunk) {
            *t += value;
        }
    }
    Tokens {
        positions: x.positions,
        heads,
        data,
    }
}

/// Sequence-sharded, all heads → this member's heads over the whole group's tokens (in member
/// order): one all-to-all.
fn seq_to_heads(
    comm: &dyn Communicator,
    tag: u32,
    x: &Tokens,
    positions_of: &dyn Fn(usize) -> Vec<u32>,
    d: usize,
) -> Tokens {
    let (me, n) = (comm.rank(), comm.size());
    let per = x.heads.len() / n;
    let block = per * x.len() * d;
    let chunks = (0..n)
        .map(|j| x.data[j * block..(j + 1) * block].to_vec())
        .collect();
    let received = comm.all_to_all(tag, chunks);
    let positions: Vec<Vec<u32>> = (0..n).map(positions_of).collect();
    let mut data = Vec::with_capacity(received.iter().map(Vec::len).sum());
    for head in 0..per {
        for (from, part) in received.iter().enumerate() {
            let rows = positions[from].len() * d;
            data.extend_from_slice(&part[head * rows..(head + 1) * rows]);
        }
    }
    Tokens {
        positions: positions.concat(),
        heads: x.heads[me * per..(me + 1) * per].to_vec(),
        data,
    }
}

/// The inverse of [`seq_to_heads`]: this member's heads over the group's tokens → its own tokens,
/// all of the group's heads.
fn heads_to_seq(
    comm: &dyn Communicator,
    tag: u32,
    x: &Tokens,
    positions_of: &dyn Fn(usize) -> Vec<u32>,
    d: usize,
) -> Tokens {
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
            let mut chunk = Vec::with_capacity(x.heads.len() * lengths[j] * d);
            for head in 0..x.heads.len() {
                let start = (head * total + offsets[j]) * d;
                chunk.extend_from_slice(&x.data[start..start + lengths[j] * d]);
            }
            chunk
        })
        .collect();
    let received = comm.all_to_all(tag, chunks);
    let per = x.heads.len();
    let first_head = x.heads[0] - me * per;
    Tokens {
        positions: positions_of(me),
        heads: (first_head..first_head + per * n).collect(),
        data: received.concat(),
    }
}

/// K and V as one message.
fn pack(k: &Tokens, v: &Tokens) -> Vec<f64> {
    [k.data.as_slice(), v.data.as_slice()].concat()
}

/// Blocks of the same heads over consecutive token segments, as one block.
fn concat(blocks: &[Tokens], d: usize) -> Tokens {
    let heads = blocks[0].heads.clone();
    let mut data = Vec::new();
    for head in 0..heads.len() {
        for block in blocks {
            let rows = block.len() * d;
            data.extend_from_slice(&block.data[head * rows..(head + 1) * rows]);
        }
    }
    Tokens {
        positions: blocks
            .iter()
            .flat_map(|b| b.positions.iter().copied())
            .collect(),
        heads,
        data,
    }
}

/// The per-segment parts of a concatenated block's tensor (the inverse of [`concat`]).
fn split(data: &[f64], heads: usize, lengths: &[usize], d: usize) -> Vec<Vec<f64>> {
    let total: usize = lengths.iter().sum();
    let mut offset = 0;
    lengths
        .iter()
        .map(|&length| {
            let mut part = Vec::with_capacity(heads * length * d);
            for head in 0..heads {
                let start = (head * total + offset) * d;
                part.extend_from_slice(&data[start..start + length * d]);
            }
            offset += length;
            part
        })
        .collect()
}

/// The ring part of a method, on one ring group.
struct RingStep<'a> {
    problem: &'a Problem<'a>,
    comm: &'a dyn Communicator,
    /// Tokens of each ring member's shard.
    positions_of: &'a dyn Fn(usize) -> Vec<u32>,
    windows: usize,
}

impl RingStep<'_> {
    fn d(&self) -> usize {
        self.problem.head_dim
    }

    /// The K and V block of ring member `source`, received from member `from` (a [`pack`]ed
    /// message: the positions are known from the layout, so they never travel).
    fn receive_kv(
        &self,
        from: usize,
        tag: u32,
        source: usize,
        heads: &[usize],
    ) -> (Tokens, Tokens) {
        let message = self.comm.recv(from, tag);
        let (k, v) = message.split_at(message.len() / 2);
        let positions = (self.positions_of)(source);
        let tokens = |data: &[f64]| Tokens {
            positions: positions.clone(),
            heads: heads.to_vec(),
            data: data.to_vec(),
        };
        (tokens(k), tokens(v))
    }

    fn p2p_forward(&self, q: &Tokens, k: &Tokens, v: &Tokens) -> Result<Partial, String> {
        let (r, n, d) = (self.comm.rank(), self.comm.size(), self.d());
        let mut done = Partial::empty(q.heads.len(), q.len(), d);
        let (mut k_now, mut v_now) = (k.clone(), v.clone());
        for step in 0..n {
            if step + 1 < n {
                // The next step's block travels while this one is computed.
                self.comm
                    .exchange((r + 1) % n, (r + n - 1) % n, FWD_KV, pack(&k_now, &v_now));
            }
            done.merge(&self.problem.forward(q, &k_now, &v_now)?, d);
            if step + 1 < n {
                let source = (r + n - step - 1) % n;
                (k_now, v_now) = self.receive_kv((r + n - 1) % n, FWD_KV, source, &k.heads);
            }
        }
        Ok(done)
    }

    /// dQ of the local rows and dK, dV of the local block. Each block's dK/dV accumulator travels
    /// with it, one hop behind: started by the next rank, completed by the owner.
    fn p2p_backward(
        &self,
        q: &Tokens,
        k: &Tokens,
        v: &Tokens,
        done: &Partial,
        d_out: &[f64],
    ) -> Result<Grads, String> {
        let (r, n) = (self.comm.rank(), self.comm.size());
        let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
        let own = self.problem.backward(q, k, v, done, d_out)?;
        let mut dq = own.dq;
        let (mut k_now, mut v_now) = (k.clone(), v.clone());
        for step in 1..n {
            self.comm.exchange(next, prev, BWD_KV, pack(&k_now, &v_now));
            let source = (r + n - step) % n;
            (k_now, v_now) = self.receive_kv(prev, BWD_KV, source, &k.heads);
            let grads = self.problem.backward(q, &k_now, &v_now, done, d_out)?;
            add(&mut dq, &grads.dq);
            let mut accumulator = [grads.dk, grads.dv].concat();
            if step > 1 {
                add(&mut accumulator, &self.comm.recv(prev, BWD_DKV));
            }
            self.comm.exchange(next, prev, BWD_DKV, accumulator);
        }
        let (mut dk, mut dv) = (own.dk, own.dv);
        if n > 1 {
            let others = self.comm.recv(prev, BWD_DKV);
            let (k_part, v_part) = others.split_at(dk.len());
            add(&mut dk, k_part);
            add(&mut dv, v_part);
        }
        Ok((dq, dk, dv))
    }

    fn gathered(&self, k: &Tokens, v: &Tokens) -> (Tokens, Tokens, Vec<usize>) {
        let n = self.comm.size();
        let ks = self.comm.all_gather(GATHER_K, k.data.clone());
        let vs = self.comm.all_gather(GATHER_V, v.data.clone());
        let block = |data: Vec<f64>, s: usize| Tokens {
            positions: (self.positions_of)(s),
            heads: k.heads.clone(),
            data,
        };
        let k_blocks: Vec<Tokens> = ks
            .into_iter()
            .enumerate()
            .map(|(s, x)| block(x, s))
            .collect();
        let v_blocks: Vec<Tokens> = vs
            .into_iter()
            .enumerate()
            .map(|(s, x)| block(x, s))
            .collect();
        let lengths = (0..n).map(|s| k_blocks[s].len()).collect();
        (
            concat(&k_blocks, self.d()),
            concat(&v_blocks, self.d()),
            lengths,
        )
    }

    fn allgather_forward(&self, q: &Tokens, k: &Tokens, v: &Tokens) -> Result<Partial, String> {
        let (k_all, v_all, _) = self.gathered(k, v);
        self.problem.forward(q, &k_all, &v_all)
    }

    fn allgather_backward(
        &self,
        q: &Tokens,
        k: &Tokens,
        v: &Tokens,
        done: &Partial,
        d_out: &[f64],
    ) -> Result<Grads, String> {
        // K and V are gathered again rather than kept from the forward pass.
        let (k_all, v_all, lengths) = self.gathered(k, v);
        let grads = self.problem.backward(q, &k_all, &v_all, done, d_out)?;
        let heads = k.heads.len();
        let dk = self
            .comm
            .reduce_scatter(SCATTER_DK, split(&grads.dk, heads, &lengths, self.d()));
        let dv = self
            .comm
            .reduce_scatter(SCATTER_DV, split(&grads.dv, heads, &lengths, self.d()));
        Ok((grads.dq, dk, dv))
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

    fn double_forward(&self, q: &Tokens, k: &Tokens, v: &Tokens) -> Result<Partial, String> {
        let (m, d) = (self.windows, self.d());
        let (j, a, w) = self.place();
        let mut done = Partial::empty(q.heads.len(), q.len(), d);
        let (mut k_window, mut v_window) = (k.clone(), v.clone());
        for t in 0..m {
            if t + 1 < m {
                // The next window's block travels during this whole window.
                self.comm.exchange(
                    self.member(j + 1, a),
                    self.member(j + m - 1, a),
                    FWD_INTER_KV,
                    pack(&k_window, &v_window),
                );
            }
            let (mut k_now, mut v_now) = (k_window.clone(), v_window.clone());
            for i in 0..w {
                if i + 1 < w {
                    self.comm.exchange(
                        self.member(j, a + 1),
                        self.member(j, a + w - 1),
                        FWD_KV,
                        pack(&k_now, &v_now),
                    );
                }
                done.merge(&self.problem.forward(q, &k_now, &v_now)?, d);
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
        Ok(done)
    }

    /// The double ring's backward: KV moves as in the forward pass; each block's dK/dV
    /// accumulator goes round its window with it (w sends per window) and then on to the next
    /// window (one send), and is back with its owner after the last window.
    fn double_backward(
        &self,
        q: &Tokens,
        k: &Tokens,
        v: &Tokens,
        done: &Partial,
        d_out: &[f64],
    ) -> Result<Grads, String> {
        let m = self.windows;
        let (j, a, w) = self.place();
        let (intra_next, intra_prev) = (self.member(j, a + 1), self.member(j, a + w - 1));
        let (inter_next, inter_prev) = (self.member(j + 1, a), self.member(j + m - 1, a));
        let mut dq = vec![0.0; q.data.len()];
        let (mut k_window, mut v_window) = (k.clone(), v.clone());
        let mut completed = Vec::new();
        for t in 0..m {
            if t + 1 < m {
                self.comm.exchange(
                    inter_next,
                    inter_prev,
                    BWD_INTER_KV,
                    pack(&k_window, &v_window),
                );
            }
            let (mut k_now, mut v_now) = (k_window.clone(), v_window.clone());
            let mut returned = Vec::new();
            for i in 0..w {
                if i + 1 < w {
                    self.comm
                        .exchange(intra_next, intra_prev, BWD_KV, pack(&k_now, &v_now));
                }
                let grads = self.problem.backward(q, &k_now, &v_now, done, d_out)?;
                add(&mut dq, &grads.dq);
                let mut accumulator = [grads.dk, grads.dv].concat();
                if i > 0 {
                    add(&mut accumulator, &self.comm.recv(intra_prev, BWD_DKV));
                } else if t > 0 {
                    add(&mut accumulator, &self.comm.recv(inter_prev, BWD_INTER_DKV));
                }
                if w > 1 {
                    self.comm
                        .exchange(intra_next, intra_prev, BWD_DKV, accumulator);
                } else {
                    returned = accumulator;
                }
                if i + 1 < w {
                    let source = self.member(j + m - t, a + w - i - 1);
                    (k_now, v_now) = self.receive_kv(intra_prev, BWD_KV, source, &k.heads);
                }
            }
            if w > 1 {
                // The window-start block's accumulator, back after going round the window.
                returned = self.comm.recv(intra_prev, BWD_DKV);
            }
            if m > 1 {
                self.comm
                    .exchange(inter_next, inter_prev, BWD_INTER_DKV, returned);
            } else {
                completed = returned;
            }
            if t + 1 < m {
                let source = self.member(j + m - t - 1, a);
                (k_window, v_window) = self.receive_kv(inter_prev, BWD_INTER_KV, source, &k.heads);
            }
        }
        if m > 1 {
            completed = self.comm.recv(inter_prev, BWD_INTER_DKV);
        }
        let (dk, dv) = completed.split_at(k.data.len());
        Ok((dq, dk.to_vec(), dv.to_vec()))
    }

    fn forward(
        &self,
        method: Method,
        q: &Tokens,
        k: &Tokens,
        v: &Tokens,
    ) -> Result<Partial, String> {
        match method {
            Method::Ulysses => self.problem.forward(q, k, v),
            Method::RingP2p | Method::Usp => self.p2p_forward(q, k, v),
            Method::RingAllGather => self.allgather_forward(q, k, v),
            Method::LoongTrain => self.double_forward(q, k, v),
        }
    }

    fn backward(&self, method: Method, saved: &Saved, d_out: &[f64]) -> Result<Grads, String> {
        let (q, k, v, done) = (&saved.q, &saved.k, &saved.v, &saved.done);
        match method {
            Method::Ulysses => {
                let g = self.problem.backward(q, k, v, done, d_out)?;
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
pub fn kv_repeat(heads_q: usize, heads_kv: usize, ulysses: usize) -> Result<usize, String> {
    if !heads_q.is_multiple_of(ulysses) {
        return Err(format!(
            "{heads_q} query heads cannot be split over {ulysses} Ulysses ranks"
        ));
    }
    if heads_kv.is_multiple_of(ulysses) {
        Ok(1)
    } else if ulysses.is_multiple_of(heads_kv) {
        Ok(ulysses / heads_kv)
    } else {
        Err(format!("{heads_kv} KV heads cannot be split over {ulysses} Ulysses ranks, nor repeated to fill them"))
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

impl Rank<'_> {
    fn coords(&self) -> (usize, usize) {
        self.setup.layout.coords(self.world_rank)
    }

    /// Tokens of Ulysses member `u` in this rank's ring position.
    fn piece_of(&self) -> impl Fn(usize) -> Vec<u32> + '_ {
        let (_, r) = self.coords();
        move |u| {
            let layout = self.setup.layout;
            layout.positions(layout.world_rank(u, r))
        }
    }

    /// Runs `work` with this rank's ring step, for KV heads repeated `repeat` times.
    fn with_ring<T>(&self, groups: &Groups, repeat: usize, work: impl FnOnce(&RingStep) -> T) -> T {
        let problem = Problem {
            group: self.heads_q / (self.heads_kv * repeat),
            ..self.problem
        };
        let ring_of = |r| self.setup.layout.ring_positions(r);
        work(&RingStep {
            problem: &problem,
            comm: groups.ring,
            positions_of: &ring_of,
            windows: self.setup.windows,
        })
    }

    pub fn forward(
        &self,
        groups: &Groups,
        q: &Tokens,
        k: &Tokens,
        v: &Tokens,
    ) -> Result<Forward, String> {
        let layout = self.setup.layout;
        let d = self.problem.head_dim;
        let repeat = kv_repeat(self.heads_q, self.heads_kv, layout.ulysses)?;
        let (k, v) = (repeat_heads(k, repeat, d), repeat_heads(v, repeat, d));
        let piece_of = self.piece_of();
        let (q, k, v) = if layout.ulysses > 1 {
            let u = groups.ulysses;
            (
                seq_to_heads(u, A2A[0], q, &piece_of, d),
                seq_to_heads(u, A2A[1], &k, &piece_of, d),
                seq_to_heads(u, A2A[2], &v, &piece_of, d),
            )
        } else {
            (q.clone(), k, v)
        };
        let done = self.with_ring(groups, repeat, |ring| {
            ring.forward(self.setup.method, &q, &k, &v)
        })?;
        let out = q.like(done.out.clone());
        let out = if layout.ulysses > 1 {
            heads_to_seq(groups.ulysses, A2A[3], &out, &piece_of, d)
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

    pub fn backward(
        &self,
        groups: &Groups,
        saved: &Saved,
        d_out: &Tokens,
    ) -> Result<Gradients, String> {
        let layout = self.setup.layout;
        let d = self.problem.head_dim;
        let piece_of = self.piece_of();
        let d_out = if layout.ulysses > 1 {
            seq_to_heads(groups.ulysses, A2A[4], d_out, &piece_of, d)
        } else {
            d_out.clone()
        };
        let (dq, dk, dv) = self.with_ring(groups, saved.kv_repeat, |ring| {
            ring.backward(self.setup.method, saved, &d_out.data)
        })?;
        let (dq, dk, dv) = (saved.q.like(dq), saved.k.like(dk), saved.v.like(dv));
        let (dq, dk, dv) = if layout.ulysses > 1 {
            let u = groups.ulysses;
            (
                heads_to_seq(u, A2A[5], &dq, &piece_of, d),
                heads_to_seq(u, A2A[6], &dk, &piece_of, d),
                heads_to_seq(u, A2A[7], &dv, &piece_of, d),
            )
        } else {
            (dq, dk, dv)
        };
        Ok(Gradients {
            dq,
            dk: sum_repeats(dk, saved.kv_repeat, d),
            dv: sum_repeats(dv, saved.kv_repeat, d),
        })
    }
}
