//! Runs a method's ranks — as threads of this process, or as processes joined over TCP (see
//! `processes`) — and gathers what they computed back into global tensors, with what each rank
//! sent and how long each took.

use attnbench_sdk::attention::Backend;
use std::sync::Arc;
use std::time::Instant;

use attnbench_sdk::mask::MaskSet;
use attnbench_sdk::reference::{HeadMasks, Inputs, Shape};
use serde::{Deserialize, Serialize};

use crate::comm::{rank_groups, Communicator, World};
use crate::layout::LayoutError;
use crate::local::{HostStore, Tokens};

/// A rank's tokens on the host.
type HostTokens = Tokens<Vec<f64>>;
use crate::methods::{Groups, MethodError, Rank, Setup};
use crate::processes::LaunchError;

/// Global outputs and per-rank traffic and times.
pub struct Outcome {
    pub out: Vec<f32>,
    pub lse: Vec<f32>,
    /// dQ, dK, dV when the backward pass ran.
    pub grads: Option<[Vec<f32>; 3]>,
    /// Elements each rank sent in the forward and in the backward pass.
    pub sent_forward: Vec<u64>,
    pub sent_backward: Vec<u64>,
    pub forward_s: Vec<f64>,
    pub backward_s: Vec<f64>,
}

/// What one rank computed, in its own tokens and heads.
#[derive(Serialize, Deserialize)]
pub struct RankResult {
    out: HostTokens,
    lse: HostTokens,
    grads: Option<[HostTokens; 3]>,
    sent: (u64, u64),
    seconds: (f64, f64),
}

/// A rank's shard of a global `[heads][seqlen][head_dim]` tensor: `heads` at `positions`.
pub fn shard(data: &[f32], positions: &[u32], heads: &[usize], shape: &Shape) -> Vec<f32> {
    let d = shape.head_dim;
    let mut gathered = Vec::with_capacity(heads.len() * positions.len() * d);
    for &h in heads {
        for &p in positions {
            let start = (h * shape.seqlen + p as usize) * d;
            gathered.extend_from_slice(&data[start..start + d]);
        }
    }
    gathered
}

fn gather(data: &[f32], positions: &[u32], heads: &[usize], shape: &Shape) -> HostTokens {
    Tokens {
        positions: positions.to_vec(),
        heads: heads.to_vec(),
        data: shard(data, positions, heads, shape)
            .into_iter()
            .map(f64::from)
            .collect(),
    }
}

/// Writes a rank's tokens into a global `[heads][seqlen][width]` tensor.
pub fn scatter<V: std::ops::Index<usize, Output = T>, T: Copy + Into<f64>>(
    global: &mut [f32],
    tokens: &Tokens<V>,
    seqlen: usize,
    width: usize,
) {
    for (hi, &h) in tokens.heads.iter().enumerate() {
        for (t, &p) in tokens.positions.iter().enumerate() {
            let from = (hi * tokens.len() + t) * width;
            let to = (h * seqlen + p as usize) * width;
            for i in 0..width {
                global[to + i] = tokens.data[from + i].into() as f32;
            }
        }
    }
}

/// Why this problem cannot run with `setup`, if it cannot.
pub fn check(setup: &Setup, shape: &Shape) -> Result<(), LayoutError> {
    let layout = &setup.layout;
    layout
        .sharding
        .check(layout.seqlen, layout.ring, layout.ulysses)?;
    if setup.layout.seqlen != shape.seqlen {
        return Err(LayoutError::Length {
            layout: setup.layout.seqlen,
            mask: shape.seqlen,
        });
    }
    crate::methods::kv_repeat(shape.heads_q, shape.heads_kv, setup.layout.ulysses).map(|_| ())
}

/// World rank `w`'s part: its shard of the inputs, forward (and backward), timed.
#[allow(clippy::too_many_arguments)]
pub fn run_rank(
    world: Arc<World>,
    w: usize,
    setup: &Setup,
    shape: &Shape,
    set: &MaskSet,
    inputs: &Inputs,
    backward: bool,
    attention: Option<&Backend>,
) -> Result<RankResult, MethodError> {
    let layout = &setup.layout;
    let head_masks = HeadMasks::new(set, shape);
    let [everyone, ulysses, ring] = rank_groups(&world, layout, w);
    let groups = Groups {
        ulysses: &ulysses,
        ring: &ring,
    };
    let rank = Rank::new(setup.clone(), w, set, &head_masks, shape);
    let (q_heads, kv_heads): (Vec<usize>, Vec<usize>) =
        ((0..shape.heads_q).collect(), (0..shape.heads_kv).collect());
    let positions = layout.positions(w);
    let q = gather(&inputs.q, &positions, &q_heads, shape);
    let k = gather(&inputs.k, &positions, &kv_heads, shape);
    let v = gather(&inputs.v, &positions, &kv_heads, shape);
    everyone.barrier();
    let start = Instant::now();
    let store = HostStore { backend: attention };
    let forward = rank.forward(&store, &groups, &q, &k, &v)?;
    let forward_s = start.elapsed().as_secs_f64();
    let sent_forward = world.sent_elements(w);
    let mut grads = None;
    let mut backward_s = 0.0;
    if backward {
        let d_out = gather(&inputs.d_out, &positions, &q_heads, shape);
        everyone.barrier();
        let start = Instant::now();
        let g = rank.backward(&store, &groups, &forward.saved, &d_out)?;
        backward_s = start.elapsed().as_secs_f64();
        grads = Some([g.dq, g.dk, g.dv]);
    }
    // Nobody leaves (or closes its links) before everyone is done.
    let sent_backward = world.sent_elements(w) - sent_forward;
    everyone.barrier();
    Ok(RankResult {
        out: forward.out,
        lse: forward.lse,
        grads,
        sent: (sent_forward, sent_backward),
        seconds: (forward_s, backward_s),
    })
}

/// Why a pass of the ranks gave no outcome.
#[derive(Debug, thiserror::Error)]
pub enum PassError {
    #[error(transparent)]
    Layout(#[from] LayoutError),
    #[error(transparent)]
    Method(#[from] MethodError),
    #[error("rank {0} panicked")]
    Panicked(usize),
    #[error(transparent)]
    Launch(#[from] LaunchError),
}

/// All ranks as threads of this process.
pub fn run(
    setup: &Setup,
    shape: &Shape,
    set: &MaskSet,
    inputs: &Inputs,
    backward: bool,
    attention: Option<&Backend>,
) -> Result<Outcome, PassError> {
    check(setup, shape)?;
    let n = setup.layout.world();
    let world = World::new(n);
    let results: Vec<Result<RankResult, PassError>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..n)
            .map(|w| {
                let world = world.clone();
                scope.spawn(move || {
                    run_rank(world, w, setup, shape, set, inputs, backward, attention)
                })
            })
            .collect();
        handles
            .into_iter()
            .enumerate()
            .map(|(w, h)| match h.join() {
                Ok(result) => result.map_err(PassError::from),
                Err(_) => Err(PassError::Panicked(w)),
            })
            .collect()
    });
    Ok(assemble(
        shape,
        results.into_iter().collect::<Result<_, _>>()?,
        backward,
    ))
}

/// The global tensors and per-rank figures from every rank's result.
pub fn assemble(shape: &Shape, results: Vec<RankResult>, backward: bool) -> Outcome {
    let (s, d) = (shape.seqlen, shape.head_dim);
    let mut out = vec![0f32; shape.q_len()];
    let mut lse = vec![f32::NEG_INFINITY; shape.heads_q * s];
    let mut grads = backward.then(|| {
        [
            vec![0f32; shape.q_len()],
            vec![0f32; shape.kv_len()],
            vec![0f32; shape.kv_len()],
        ]
    });
    for result in &results {
        scatter(&mut out, &result.out, s, d);
        scatter(&mut lse, &result.lse, s, 1);
        if let (Some(global), Some(local)) = (grads.as_mut(), result.grads.as_ref()) {
            for (g, l) in global.iter_mut().zip(local) {
                scatter(g, l, s, d);
            }
        }
    }
    Outcome {
        out,
        lse,
        grads,
        sent_forward: results.iter().map(|r| r.sent.0).collect(),
        sent_backward: results.iter().map(|r| r.sent.1).collect(),
        forward_s: results.iter().map(|r| r.seconds.0).collect(),
        backward_s: results.iter().map(|r| r.seconds.1).collect(),
    }
}
