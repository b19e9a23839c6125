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
    attend, declare_batch, reference, split_range, BatchParams, DecodeInputs, DecodeProblem,
    Partial,
};
use attnbench_sdk::reference::Element;
use attnbench_sdk::{
    write_json, CacheScope, ParamSpec, ParamType, PluginError, StageRequest, StageSpec,
};
use serde_json::{json, Value};

use crate::comm::{Group, World};
use crate::model::Machine;

attnbench_sdk::named_enum! {
    /// How the ranks' partials combine.
    pub enum DecodeMethod { Tree = "tree", Ring = "ring" }
}

/// Tag space of the decode group (0–2 are the prefill methods').
const SPACE: u32 = 3;
const PARTIAL: u32 = 1;

/// What a decode across `world` ranks came to.
pub struct DecodeOutcome {
    /// The combined O and LSE, on rank 0.
    pub partial: Partial,
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

/// Rank `rank`'s shard of each sequence's keys.
fn shard(
    problem: &DecodeProblem,
    rank: usize,
    world: usize,
) -> impl Fn(usize) -> std::ops::Range<u64> + '_ {
    move |b| split_range(problem.kv_lens[b], world as u64, rank as u64)
}

fn pack(partial: Partial) -> Vec<f64> {
    let mut values = partial.out;
    values.extend(partial.lse);
    values
}

fn unpack(mut values: Vec<f64>, rows: usize) -> Partial {
    let lse = values.split_off(values.len() - rows);
    Partial { out: values, lse }
}

/// One rank's part: its shard's partial, then its sends and merges under `method`.
fn run_rank(
    world: Arc<World>,
    rank: usize,
    size: usize,
    problem: &DecodeProblem,
    inputs: &DecodeInputs,
    method: DecodeMethod,
) -> Option<Partial> {
    let group = Group::new(world, (0..size).collect(), rank, SPACE);
    let (d, rows) = (
        problem.head_dim as usize,
        (problem.heads_q * problem.rows()) as usize,
    );
    let mut mine = attend(problem, inputs, shard(problem, rank, size));
    match method {
        DecodeMethod::Tree => {
            let mut stride = 1;
            while stride < size {
                if rank % (2 * stride) == stride {
                    group.send(rank - stride, PARTIAL, pack(mine));
                    return None;
                }
                if rank + stride < size {
                    mine.merge(&unpack(group.take(rank + stride, PARTIAL), rows), d);
                }
                stride *= 2;
            }
        }
        DecodeMethod::Ring => {
            if rank + 1 < size {
                mine.merge(&unpack(group.take(rank + 1, PARTIAL), rows), d);
            }
            if rank > 0 {
                group.send(rank - 1, PARTIAL, pack(mine));
                return None;
            }
        }
    }
    Some(mine)
}

/// Decodes `problem` with its cache split over `size` ranks, threads of this process.
pub fn run(
    problem: &DecodeProblem,
    inputs: &DecodeInputs,
    method: DecodeMethod,
    size: usize,
) -> DecodeOutcome {
    let world = World::new(size);
    let results: Vec<Option<Partial>> = std::thread::scope(|scope| {
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
    let partial = results
        .into_iter()
        .next()
        .flatten()
        .expect("rank 0 ends with the combined partial");
    DecodeOutcome {
        partial,
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

/// `cp/decode` as the manifest declares it.
pub fn spec() -> StageSpec {
    declare_batch(StageSpec::new("decode"), 4, "4k", (8, 2, 16))
        .doc("Decodes a batch with each sequence's KV cache split over ranks (threads), the partials combined by a tree or a ring: outputs checked against the f64 reference, each rank's sent values against the formula.")
        .param(ParamSpec::new("method", ParamType::one_of(DecodeMethod::NAMES)).default("tree").doc("`tree`: partials combined by a binary tree (Tree Attention, ⌈log₂ world⌉ rounds); `ring`: passed along the ring, merged at each hop (world − 1 sends in a row)."))
        .param(ParamSpec::new("world", ParamType::Int).default(4).doc("Ranks, each holding a contiguous shard of every sequence's KV cache."))
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
    if let Some(table) = problem.page_table(request.seed) {
        // What a paged kernel reads: the cache through its page table.
        inputs.k = table.from_pool(&problem, &table.to_pool(&problem, &inputs.k));
        inputs.v = table.from_pool(&problem, &table.to_pool(&problem, &inputs.v));
    }
    let start = std::time::Instant::now();
    let outcome = run(&problem, &inputs, p.method, p.world);
    let seconds = start.elapsed().as_secs_f64();
    let whole = reference(&problem, &inputs);
    let max_error = whole.max_difference(&outcome.partial);
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
    let partial_values = whole.values() as u64;
    let expected: Vec<u64> = (0..p.world)
        .map(|rank| if rank == 0 { 0 } else { partial_values })
        .collect();
    let result = json!({
        "method": p.method,
        "world": p.world,
        "kv_lens": problem.kv_lens,
        "queries": problem.queries,
        "page_size": problem.page_size,
        "flops": problem.flops(),
        "bytes": problem.bytes(element_bytes),
        "depth": depth(p.method, p.world),
        "sent_values": outcome.sent,
        "expected_sent_values": expected,
        "traffic_matches": outcome.sent == expected,
        "max_error": max_error,
        "passed": max_error < 1e-9 && outcome.sent == expected,
        "seconds": seconds,
        "timer": "wall clock of the threads, f64 on the CPU: exactness and traffic, not speed",
        "predicted": predicted,
    });
    write_json(&request.output_dir, "decode.json", &result)?;
    Ok(result)
}

#[cfg(test)]
#[path = "decode_tests.rs"]
mod tests;
