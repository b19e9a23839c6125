//! Decoding across ranks. Each rank holds a contiguous shard of every sequence's KV cache and
//! computes the partial O and LSE of every new token over its shard; the partials then combine
//! by their LSE into the exact result on rank 0:
//! - `tree` (Tree Attention): a binary tree, ⌈log₂ N⌉ rounds, each a set of pairwise sends that
//!   run at once;
//! - `ring`: the partial passed along the ring from the last rank to rank 0, merged at each hop:
//!   N − 1 sends one after another.
//!
//! Both send N − 1 partials in all; what differs is the depth, the number of sends on the
//! critical path, which sets decode latency once the shards are small ([`depth`], and
//! [`decode_seconds`] in the cost model).

use std::sync::Arc;

use attnbench_sdk::decode::{
    self as sdk_decode, attend, declare_batch, reference, split_range, BatchParams, DecodeInputs,
    DecodeProblem,
};
use attnbench_sdk::reference::Element;
use attnbench_sdk::{
    write_json, CacheScope, ParamSpec, ParamType, PluginError, StageRequest, StageSpec,
};
use serde_json::{json, Value};

use crate::comm::{Group, PointToPoint, World};
use crate::local::{HostStore, Partial, Store};
use crate::model::Machine;

attnbench_sdk::named_enum! {
    /// How the ranks' partials combine.
    pub enum DecodeMethod { Tree = "tree", Ring = "ring" }
}

attnbench_sdk::named_enum! {
    /// Where `cp/decode` runs its ranks.
    pub enum DecodeBackend { Threads = "threads", Nccl = "nccl" }
}

/// Tag space of the decode group (0–2 are the prefill methods').
pub(crate) const SPACE: u32 = 3;
const PARTIAL: u32 = 1;

/// What a decode across `world` ranks came to.
pub struct DecodeOutcome {
    /// The combined O and LSE, on rank 0.
    pub partial: sdk_decode::Partial,
    /// Values each rank sent.
    pub sent: Vec<u64>,
}

/// Sends on the critical path with `world` ranks.
pub fn depth(method: DecodeMethod, world: usize) -> usize {
    match method {
        DecodeMethod::Tree => world.next_power_of_two().trailing_zeros() as usize,
        DecodeMethod::Ring => world.saturating_sub(1),
    }
}

/// One step of a rank's part in combining the partials.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hop {
    /// Take member `from`'s partial and merge it into this rank's.
    Receive(usize),
    /// Hand this rank's merged partial to member `to`; the rank is done.
    Send(usize),
}

/// Rank `rank`'s hops among `size` ranks: in a tree, round `s` (stride 2^s) pairs rank
/// `r + 2^s` with `r` for every `r` divisible by 2^(s+1); in a ring the partial passes from the
/// last rank down to rank 0, merged at each. Rank 0 only receives, and ends with every partial.
pub fn hops(method: DecodeMethod, rank: usize, size: usize) -> Vec<Hop> {
    let mut hops = Vec::new();
    match method {
        DecodeMethod::Tree => {
            let mut stride = 1;
            while stride < size {
                if rank % (2 * stride) == stride {
                    hops.push(Hop::Send(rank - stride));
                    break;
                }
                if rank + stride < size {
                    hops.push(Hop::Receive(rank + stride));
                }
                stride *= 2;
            }
        }
        DecodeMethod::Ring => {
            if rank + 1 < size {
                hops.push(Hop::Receive(rank + 1));
            }
            if rank > 0 {
                hops.push(Hop::Send(rank - 1));
            }
        }
    }
    hops
}

/// Combines the ranks' partials under `method`, each rank calling this with its own: rank 0
/// gets the exact result over every rank's keys, the others `None` once they have sent.
pub fn combine<S: Store, C: PointToPoint<Values = S::Values>>(
    store: &S,
    comm: &C,
    mut mine: Partial<S::Values>,
    method: DecodeMethod,
    head_dim: usize,
) -> Option<Partial<S::Values>> {
    for hop in hops(method, comm.rank(), comm.size()) {
        match hop {
            Hop::Receive(from) => {
                let theirs = comm.receive_partial(from, PARTIAL, &mine);
                store.merge(&mut mine, &theirs, head_dim);
            }
            Hop::Send(to) => {
                comm.send_partial(to, PARTIAL, mine);
                return None;
            }
        }
    }
    Some(mine)
}

/// Rank `rank`'s shard of each sequence's keys.
pub(crate) fn shard(
    problem: &DecodeProblem,
    rank: usize,
    world: usize,
) -> impl Fn(usize) -> std::ops::Range<u64> + '_ {
    move |b| split_range(problem.kv_lens[b], world as u64, rank as u64)
}

/// One thread's rank: its shard's partial in f64, then its hops.
fn run_rank(
    world: Arc<World>,
    rank: usize,
    size: usize,
    problem: &DecodeProblem,
    inputs: &DecodeInputs,
    method: DecodeMethod,
) -> Option<Partial<Vec<f64>>> {
    let group = Group::new(world, (0..size).collect(), rank, SPACE);
    let own = attend(problem, inputs, shard(problem, rank, size));
    let mine = Partial {
        out: own.out,
        lse: own.lse,
    };
    combine(
        &HostStore { backend: None },
        &group,
        mine,
        method,
        problem.head_dim as usize,
    )
}

/// Decodes `problem` with its cache split over `size` ranks, threads of this process.
pub fn run(
    problem: &DecodeProblem,
    inputs: &DecodeInputs,
    method: DecodeMethod,
    size: usize,
) -> DecodeOutcome {
    let world = World::new(size);
    let results: Vec<Option<Partial<Vec<f64>>>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..size)
            .map(|rank| {
                let world = world.clone();
                scope.spawn(move || run_rank(world, rank, size, problem, inputs, method))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("a decode rank panicked"))
            .collect()
    });
    let combined = results
        .into_iter()
        .next()
        .flatten()
        .expect("rank 0 ends with the combined partial");
    DecodeOutcome {
        partial: sdk_decode::Partial {
            out: combined.out,
            lse: combined.lse,
        },
        sent: (0..size).map(|r| world.sent_elements(r)).collect(),
    }
}

/// Seconds of one decode step at `world` GPUs: each GPU reads its share of the cache at
/// `bandwidth` bytes/s (decode is bound by memory), then the partials combine, `depth` sends of
/// one partial each, on NVLink inside a node and InfiniBand between nodes. A tree's first
/// ⌈log₂ gpus_per_node⌉ rounds stay inside nodes; a ring crosses a node boundary once per node.
pub fn decode_seconds(
    problem: &DecodeProblem,
    method: DecodeMethod,
    world: usize,
    machine: &Machine,
    bandwidth: f64,
    element_bytes: u64,
) -> f64 {
    let read = problem.bytes(element_bytes) as f64 / world as f64 / bandwidth;
    // O in the element type, LSE in f32.
    let rows = (problem.heads_q * problem.rows()) as f64;
    let message = rows * (problem.head_dim as f64 * element_bytes as f64 + 4.0);
    let hop = |on_node: bool| {
        if on_node {
            machine.nvlink_latency + message / machine.nvlink
        } else {
            machine.infiniband_latency + message / machine.infiniband
        }
    };
    let per_node = machine.gpus_per_node.max(1);
    let nodes = world.div_ceil(per_node);
    let sends = depth(method, world);
    let off_node = match method {
        DecodeMethod::Tree => sends.saturating_sub(depth(DecodeMethod::Tree, per_node.min(world))),
        DecodeMethod::Ring => nodes - 1,
    };
    read + (sends - off_node) as f64 * hop(true) + off_node as f64 * hop(false)
}

/// `cp/decode`'s parameters.
#[derive(serde::Deserialize)]
pub struct DecodeParams {
    method: DecodeMethod,
    world: usize,
    backend: DecodeBackend,
    attention: String,
    #[serde(flatten)]
    harness: attnbench_sdk::measure::HarnessParams,
    dtype: Element,
    #[serde(flatten)]
    shape: BatchParams,
    worlds: Vec<usize>,
    memory_gbs: f64,
    gpus_per_node: usize,
    nvlink_gbs: f64,
    infiniband_gbs: f64,
    nvlink_latency_us: f64,
    infiniband_latency_us: f64,
}

/// The stopping rule of `backend: nccl` (rank 0's step time; threads compute exactly, untimed):
/// a step is tens of microseconds to milliseconds, so a warm-up of a few steps and at most two
/// seconds of repetitions.
fn gpu_harness() -> attnbench_sdk::measure::Harness {
    attnbench_sdk::measure::Harness {
        timer: "CUDA events on each rank's compute stream from a barrier; rank 0's step".into(),
        warmup_reps: 3,
        warmup_s: 0.0,
        min_reps: 10,
        max_reps: 200,
        max_time_s: 2.0,
        target_rel_ci: 0.01,
    }
}

/// `cp/decode` as the manifest declares it.
pub fn spec() -> StageSpec {
    gpu_harness().declare(declare_batch(StageSpec::new("decode"), 4, "4k", (8, 2, 16)))
        .doc("Decodes a batch with each sequence's KV cache split over ranks (threads, or one process per GPU over NCCL), the partials combined by a tree or a ring: outputs checked against the f64 reference, each rank's sent values against the formula.")
        .gpu_when("backend", "nccl")
        .param(ParamSpec::new("method", ParamType::one_of(DecodeMethod::NAMES)).default("tree").doc("`tree`: partials combined by a binary tree (Tree Attention, ⌈log₂ world⌉ rounds); `ring`: passed along the ring, merged at each hop (world − 1 sends in a row)."))
        .param(ParamSpec::new("world", ParamType::Int).default(4).doc("Ranks, each holding a contiguous shard of every sequence's KV cache."))
        .param(ParamSpec::new("backend", ParamType::one_of(DecodeBackend::NAMES)).default("threads").doc("`threads`: ranks as threads, f64 on the CPU (exactness and traffic); `nccl`: one `attnbench-cp-rank` process per GPU, partials on `attention`'s device backend, combined over NCCL and timed with CUDA events."))
        .param(ParamSpec::new("attention", ParamType::Backend).default("builtin").doc("`nccl`: the kernel plugin's in-process backend each rank computes its partial with: cuda/decode (a call a sequence)."))
        .param(attnbench_sdk::shapes::shape_param())
        .param(ParamSpec::new("dtype", ParamType::one_of(Element::NAMES)).default("bf16").doc("Inputs are rounded to it; bytes are counted in it."))
        .param(ParamSpec::new("worlds", ParamType::List(Box::new(ParamType::Int))).default(json!([8, 16, 32, 64, 128, 256, 512, 1024])).doc("GPU counts the cost model predicts both methods' step time at."))
        .param(ParamSpec::new("memory_gbs", ParamType::Float).default(4800.0).doc("Memory bandwidth per GPU for the model, GB/s (a decode step reads its cache share at it; 4800: the H200's published HBM3e figure)."))
        .output("decode")
        .cache_scope(CacheScope::Pure)
}

/// Runs `cp/decode`: the batch decoded over `world` threads, checked against the f64 reference,
/// with each rank's sent values against the formula.
pub fn stage(request: &StageRequest) -> Result<Value, PluginError> {
    let p: DecodeParams = request.params()?;
    if p.world == 0 {
        return Err(PluginError::Params("world must be at least 1 rank".into()));
    }
    let problem = p
        .shape
        .problem()
        .map_err(|err| PluginError::Params(err.to_string()))?;
    let mut inputs = DecodeInputs::random(&problem, request.seed, p.dtype);
    if let (Some(table), DecodeBackend::Threads) = (problem.page_table(request.seed), p.backend) {
        // What a paged kernel reads: the cache through its page table.
        inputs.k = table.from_pool(&problem, &table.to_pool(&problem, &inputs.k));
        inputs.v = table.from_pool(&problem, &table.to_pool(&problem, &inputs.v));
    }
    let machine = Machine {
        gpus_per_node: p.gpus_per_node,
        nvlink: p.nvlink_gbs * 1e9,
        infiniband: p.infiniband_gbs * 1e9,
        nvlink_latency: p.nvlink_latency_us * 1e-6,
        infiniband_latency: p.infiniband_latency_us * 1e-6,
    };
    let element_bytes = p.dtype.bytes() as u64;
    let predicted: Vec<Value> = p
        .worlds
        .iter()
        .map(|&world| {
            let at = |method| {
                decode_seconds(&problem, method, world, &machine, p.memory_gbs * 1e9, element_bytes)
            };
            json!({"gpus": world, "tree_s": at(DecodeMethod::Tree), "ring_s": at(DecodeMethod::Ring)})
        })
        .collect();
    let measured = match p.backend {
        DecodeBackend::Threads => on_threads(&problem, &inputs, &p),
        DecodeBackend::Nccl => {
            let attention = crate::attention_library(request, &p.attention)?.ok_or_else(|| {
                PluginError::Params(
                    "attention: backend nccl computes each rank's partial on a kernel plugin's in-process device backend; set it to one: cuda/decode".into(),
                )
            })?;
            crate::decode_gpu::measure(
                request,
                crate::decode_gpu::GpuDecode {
                    problem: &problem,
                    inputs: &inputs,
                    method: p.method,
                    world: p.world,
                    dtype: p.dtype,
                    attention,
                    harness: p.harness.apply(gpu_harness()),
                },
            )?
        }
    };
    let mut result = json!({
        "method": p.method,
        "world": p.world,
        "kv_lens": problem.kv_lens,
        "queries": problem.queries,
        "heads_q": problem.heads_q,
        "heads_kv": problem.heads_kv,
        "head_dim": problem.head_dim,
        "page_size": problem.page_size,
        "dtype": p.dtype,
        "flops": problem.flops(),
        "bytes": problem.bytes(element_bytes),
        "depth": depth(p.method, p.world),
        "predicted": predicted,
    });
    if let (Some(all), Value::Object(part)) = (result.as_object_mut(), measured) {
        all.extend(part);
    }
    write_json(&request.output_dir, "decode.json", &result)?;
    Ok(result)
}

/// The batch decoded by `p.world` threads in f64: the combined output against the reference,
/// each rank's sent values against the formula.
fn on_threads(problem: &DecodeProblem, inputs: &DecodeInputs, p: &DecodeParams) -> Value {
    let start = std::time::Instant::now();
    let outcome = run(problem, inputs, p.method, p.world);
    let seconds = start.elapsed().as_secs_f64();
    let whole = reference(problem, inputs);
    let max_error = whole.max_difference(&outcome.partial);
    let partial_values = whole.values() as u64;
    let expected: Vec<u64> = (0..p.world)
        .map(|rank| if rank == 0 { 0 } else { partial_values })
        .collect();
    json!({
        "backend": "threads",
        "sent_values": outcome.sent,
        "expected_sent_values": expected,
        "traffic_matches": outcome.sent == expected,
        "max_error": max_error,
        "passed": max_error < 1e-9 && outcome.sent == expected,
        "seconds": seconds,
        "timer": "wall clock of the threads, f64 on the CPU: exactness and traffic, not speed",
    })
}

#[cfg(test)]
#[path = "decode_tests.rs"]
mod tests;
