//! `cp`: context-parallel attention. `cp/threads` runs one of the five methods with its ranks as
//! threads of one process on CPU tensors: outputs checked against the single-device reference,
//! bytes each rank sent checked against the method's formula, per-rank time as the paper defines
//! per-GPU throughput (global FLOPs / ranks / the slowest rank's time). `cp/model` predicts each
//! method's per-GPU throughput from 8 to 1024 GPUs (see `model`); `cp/links` measures the NCCL
//! collectives those methods use between this machine's GPUs (see `links`).

mod balance;
mod comm;
mod decode;
mod decode_gpu;
mod device;
mod gpu_rank;
mod launch;
mod layout;
mod links;
mod local;
mod methods;
mod model;
mod nccl;
mod processes;
mod protocol;
mod sharding;
mod stopping;
mod tcp;
mod threads;
mod volume;

use std::collections::BTreeMap;

use attnbench_sdk::bench::{self, Cell, Options};
use attnbench_sdk::measure::{
    CpRank, CpRun, Direction, Harness, Measurement, PassTimes, Quantiles, Throughput,
};
use attnbench_sdk::reference::{
    self, CheckMode, Element, Forward, Grads, HeadMasks, Inputs, Shape,
};
use attnbench_sdk::{
    write_json, CacheScope, Host, Isolation, ParamSpec, ParamType, Plugin, PluginError,
    PluginManifest, StageRequest, StageSpec,
};
use device::GpuError;
use links::Collective;
use protocol::{pass_times, CpBench, Ranks};
use serde::Deserialize;
use serde_json::{json, Value};

pub use layout::{Layout, LayoutError, Placement};
pub use methods::{Method, Setup};
pub use processes::rank_main;
pub use sharding::{imbalance, rank_shares, row_work, Sharding, ShardingKind};

struct Cp;

pub(crate) fn default_harness() -> Harness {
    Harness {
        timer: "wall clock of the slowest rank (threads of one process)".into(),
        warmup_reps: 1,
        warmup_s: 0.0,
        min_reps: 3,
        max_reps: 20,
        max_time_s: 2.0,
        target_rel_ci: 0.05,
    }
}

impl Plugin for Cp {
    fn manifest() -> PluginManifest {
        PluginManifest::new("cp", env!("CARGO_PKG_VERSION"))
            .description("Context-parallel attention: Ulysses, Ring P2P, Ring AllGather, USP, LoongTrain.")
            .stage(
                default_harness().declare(
                    StageSpec::new("threads")
                        .doc("Runs one method with its ranks as threads on CPU tensors: exact outputs, counted bytes.")
                        .tasks_from("world")
                        .gpu_when("backend", "nccl")
                        .param(ParamSpec::new("method", ParamType::one_of(Method::NAMES)).default("ring_p2p"))
                        .param(ParamSpec::new("world", ParamType::Int).default(4).doc("Ranks."))
                        .param(ParamSpec::new("ulysses", ParamType::Int).default(0).doc("Ulysses group size for usp and loongtrain (0: the largest divisor U of world with U² ≤ world)."))
                        .param(ParamSpec::new("windows", ParamType::Int).default(0).doc("LoongTrain's ring windows (0: the largest divisor m of the ring size R with m² ≤ R, as LongCA-bench)."))
                        .param(ParamSpec::new("placement", ParamType::one_of(Placement::NAMES)).default("ring_inner").doc("Which group is made of consecutive ranks."))
                        .param(ParamSpec::new("sharding", ParamType::one_of(ShardingKind::NAMES)).default("zigzag").doc("How the sequence is dealt over the ring: `contiguous` pieces, `zigzag` dual chunks (even causal work), `striped` (stripes of `stripe` tokens round robin, Striped Attention), or `balanced`: chunks of `chunk` tokens given to ranks so that each rank's attention area is even for this mask."))
                        .param(ParamSpec::new("stripe", ParamType::Int).default(1).doc("`striped`: the stripe's width in tokens (1: token-level, as the paper; a tile's width keeps tiles whole)."))
                        .param(ParamSpec::new("chunk", ParamType::Int).default(64).doc("`balanced`: the chunk the solver moves, in tokens."))
                        .param(ParamSpec::new("backend", ParamType::one_of(Backend::NAMES)).default("threads").doc("`threads`: ranks as threads of the worker; `processes`: one `attnbench-cp-rank` process per rank, joined over TCP on loopback (as srun/mpirun/torchrun would start them across machines); `nccl`: one such process per GPU, tensors on the GPUs (bf16/fp16 inputs, f32 results), NCCL between them, blocks on `attention`'s device backend (e.g. cuda/flash), outputs checked on 16 rows of every head."))
                        .param(ParamSpec::new("attention", ParamType::Backend).default("builtin").doc("The local attention of every block: `builtin` (f64, in this plugin) or a kernel plugin's in-process backend, e.g. `cpu/reference`."))
                        .param(ParamSpec::new("direction", ParamType::one_of(Direction::NAMES)).default("fwd"))
                        .param(ParamSpec::new("heads_q", ParamType::Int).default(8))
                        .param(ParamSpec::new("heads_kv", ParamType::Int).default(4))
                        .param(ParamSpec::new("head_dim", ParamType::Int).default(16))
                        .param(attnbench_sdk::shapes::shape_param())
                        .param(ParamSpec::new("dtype", ParamType::one_of(Element::NAMES)).default("bf16").doc("Inputs are rounded to it; bytes are counted in it."))
                        .param(ParamSpec::new("outputs", ParamType::Bool).default(false).doc("Also write the gathered outputs (out.f32, lse.f32 and, with a backward, dq/dk/dv.f32) for checking (threads and processes backends).")),
                )
                .measures_masks()
                // A hung kernel or worker ends the node, not the run; `timeout:` in a pipeline overrides.
                .timeout_s(1800.0),
            )
            .stage(
                StageSpec::new("links")
                    .doc("Measures NCCL between this machine's GPUs, one process per GPU: a send/recv ring, all-to-all, all-gather, reduce-scatter and all-reduce from `min_bytes` to `max_bytes`, every result checked; algorithm and bus bandwidth per size, latency and bus bandwidth per collective (a line fitted through the sizes).")
                    .param(ParamSpec::new("ranks", ParamType::Int).default(0).doc("GPUs (one rank each); 0: every GPU the driver lists."))
                    .param(ParamSpec::new("min_bytes", ParamType::Size).default("4k"))
                    .param(ParamSpec::new("max_bytes", ParamType::Size).default("1g").doc("Sizes go from min_bytes to max_bytes, ×4 apart."))
                    .param(ParamSpec::new("collectives", ParamType::List(Box::new(ParamType::one_of(&Collective::ALL.map(Collective::name))))).default(json!(Collective::ALL.map(Collective::name))))
                    .param(ParamSpec::new("samples", ParamType::Int).default(5).doc("Timed samples per collective and size (the median counts), each ≥ 5 ms of calls."))
                    .output("links")
                    .isolation(Isolation::Worker)
                    .exclusive()
                    .cache_scope(CacheScope::Machine)
                    .timeout_s(1800.0),
            )
            .stage(
                StageSpec::new("model")
                    .doc("Predicts each method's per-GPU TFLOP/s at every world size from a kernel's throughput, the links and the traffic formulas.")
                    .param(ParamSpec::new("mask", ParamType::one_of(ModelMask::NAMES)).default("causal"))
                    .param(ParamSpec::new("direction", Direction::param_type(&[Direction::Fwd, Direction::Bwd])).default("fwd"))
                    .param(ParamSpec::new("tokens_per_gpu", ParamType::Size).default("8k"))
                    .param(ParamSpec::new("heads_q", ParamType::Int).default(64))
                    .param(ParamSpec::new("heads_kv", ParamType::Int).default(8))
                    .param(ParamSpec::new("head_dim", ParamType::Int).default(128))
                        .param(attnbench_sdk::shapes::shape_param())
                    .param(ParamSpec::new("dtype", ParamType::one_of(Element::NAMES)).default("bf16"))
                    .param(ParamSpec::new("kernel_tflops", ParamType::Float).default(0.0).doc("The attention kernel's measured TFLOP/s; 0: sdpa-flash (FA2) on one H200 at 8K tokens, full mask, as measured by pipelines/dense-kernels.yaml (351 forward, 296 backward)."))
                    .param(ParamSpec::new("worlds", ParamType::List(Box::new(ParamType::Int))).default(json!([8, 16, 32, 64, 128, 256, 512, 1024])))
                    .with_params(link_params())
                    .param(ParamSpec::new("placement", ParamType::one_of(Placement::NAMES)).default("ulysses_inner").doc("Which group is made of consecutive ranks (on one node first)."))
                    .param(ParamSpec::new("sharding", ParamType::one_of(ShardingKind::NAMES)).default("zigzag").doc("How the sequence is dealt over each ring: its imbalance on the mask (most loaded rank over the mean) slows the slowest rank's compute."))
                    .param(ParamSpec::new("stripe", ParamType::Int).default(1).doc("`striped`: the stripe's width in tokens."))
                    .param(ParamSpec::new("chunk", ParamType::Int).default(64).doc("`balanced`: the chunk the solver moves, in tokens."))
                    .output("predictions")
                    .cache_scope(CacheScope::Pure),
            )
            .stage(decode::spec().with_params(link_params()))
    }

    fn run(stage: &str, request: StageRequest, host: &Host) -> Result<Value, PluginError> {
        match stage {
            "threads" => threads_stage(&request, host),
            "model" => model_stage(&request),
            "links" => links_stage(&request, host),
            "decode" => decode::stage(&request),
            other => Err(PluginError::UnknownStage {
                stage: other.into(),
                known: "threads, links, model, decode".into(),
            }),
        }
    }
}

attnbench_sdk::named_enum! {
    /// Where `cp/threads` runs its ranks.
    enum Backend { Threads = "threads", Processes = "processes", Nccl = "nccl" }
}

attnbench_sdk::named_enum! {
    /// The masks the cost model takes.
    pub(crate) enum ModelMask { Full = "full", Causal = "causal" }
}

#[derive(Deserialize)]
struct Params {
    method: Method,
    world: usize,
    ulysses: usize,
    windows: usize,
    placement: Placement,
    sharding: ShardingKind,
    stripe: usize,
    chunk: usize,
    backend: Backend,
    attention: String,
    direction: Direction,
    heads_q: usize,
    heads_kv: usize,
    head_dim: usize,
    dtype: Element,
    outputs: bool,
    #[serde(flatten)]
    harness: attnbench_sdk::measure::HarnessParams,
}

impl Params {
    fn sharding(&self) -> Sharding {
        Sharding::of(self.sharding, self.stripe, self.chunk)
    }
}

/// The largest divisor x of n with x² ≤ n.
fn balanced_divisor(n: usize) -> usize {
    (1..=n)
        .filter(|x| n.is_multiple_of(*x) && x * x <= n)
        .max()
        .unwrap_or(1)
}

/// The method's group sizes for `world` ranks, or why they do not fit.
pub fn setup(
    method: Method,
    world: usize,
    ulysses: usize,
    windows: usize,
    placement: Placement,
    seqlen: usize,
) -> Result<Setup, LayoutError> {
    if world == 0 {
        return Err(LayoutError::EmptyWorld);
    }
    let u = match method {
        Method::Ulysses => world,
        Method::RingP2p | Method::RingAllGather => 1,
        Method::Usp | Method::LoongTrain if ulysses == 0 => balanced_divisor(world),
        Method::Usp | Method::LoongTrain => ulysses,
    };
    if !world.is_multiple_of(u) {
        return Err(LayoutError::UlyssesWorld { ulysses: u, world });
    }
    let ring = world / u;
    let windows = match method {
        Method::LoongTrain if windows == 0 => balanced_divisor(ring),
        Method::LoongTrain => windows,
        _ => 1,
    };
    if !ring.is_multiple_of(windows) {
        return Err(LayoutError::Windows { windows, ring });
    }
    Ok(Setup {
        method,
        layout: Layout::new(seqlen, u, ring, placement, Sharding::Zigzag, Vec::new)?,
        windows,
    })
}

/// What every rank of a `cp/threads` node computes.
fn rank_problem(
    p: &Params,
    setup: Setup,
    set: &attnbench_sdk::mask::MaskSet,
    seed: u64,
) -> processes::RankProblem {
    processes::RankProblem {
        setup,
        heads_q: p.heads_q,
        heads_kv: p.heads_kv,
        head_dim: p.head_dim,
        dtype: p.dtype,
        seed,
        backward: p.direction.backward(),
        mask: set.clone(),
    }
}

/// The library and kernel an `attention` parameter names (`None`: builtin).
pub(crate) fn attention_library(
    request: &StageRequest,
    attention: &str,
) -> Result<Option<(std::path::PathBuf, String)>, PluginError> {
    let Some((plugin, kernel)) = attention.split_once('/') else {
        return Ok(None);
    };
    let path = request.plugins.get(plugin).ok_or_else(|| {
        PluginError::Params(format!(
            "attention `{attention}`: the host did not hand over plugin `{plugin}`'s library"
        ))
    })?;
    Ok(Some((path.clone(), kernel.to_string())))
}

/// The machine the cost models assume: GPUs per node and the links' bandwidths and latencies.
fn link_params() -> Vec<ParamSpec> {
    vec![
        ParamSpec::new("gpus_per_node", ParamType::Int).default(8),
        ParamSpec::new("nvlink_gbs", ParamType::Float).default(370.0).doc("NVLink bandwidth per GPU, GB/s; with a cp/links node in `needs`, its measured send/recv ring's instead (and its latency for nvlink_latency_us)."),
        ParamSpec::new("infiniband_gbs", ParamType::Float).default(48.0).doc("InfiniBand bandwidth per GPU, GB/s."),
        ParamSpec::new("nvlink_latency_us", ParamType::Float).default(5.0),
        ParamSpec::new("infiniband_latency_us", ParamType::Float).default(10.0),
    ]
}

fn threads_stage(request: &StageRequest, host: &Host) -> Result<Value, PluginError> {
    let p: Params = request.params()?;
    let set = request.mask_set()?;
    set.check_heads(p.heads_q as u64, p.heads_kv as u64, p.head_dim as u64)?;
    let (method, placement) = (p.method, p.placement);
    let shape = Shape {
        heads_q: p.heads_q,
        heads_kv: p.heads_kv,
        seqlen: set.seqlen as usize,
        head_dim: p.head_dim,
        head_dim_v: None,
    };
    let work = || sharding::row_work(&set, p.heads_q as u64, p.heads_kv as u64);
    let setup = setup(
        method,
        p.world,
        p.ulysses,
        p.windows,
        placement,
        shape.seqlen,
    )
    .and_then(|setup| setup.sharded(p.sharding(), work))
    .map_err(|err| PluginError::Params(err.to_string()))?;
    let element = p.dtype;
    let harness = p.harness.apply(default_harness());
    let measurement = Measurement::for_kernel(
        &format!("cp-{method}"),
        ("cp", env!("CARGO_PKG_VERSION")),
        &set,
        shape,
        p.dtype,
        p.direction,
        harness.clone(),
    );
    let backward = p.direction.backward();
    let attention = attention_library(request, &p.attention)?;
    if p.backend == Backend::Nccl {
        let inputs = Inputs::random_as(&shape, request.seed, element);
        let run = GpuRun {
            p: &p,
            set: &set,
            shape,
            setup,
            inputs: &inputs,
            element,
        };
        return run.measure(request, attention, measurement, &harness);
    }
    let opened = attention
        .as_ref()
        .map(|(path, kernel)| processes::open_attention(path, kernel))
        .transpose()?;
    let ranks_dir = request.output_dir.join("ranks");
    let job = processes::Job {
        problem: rank_problem(&p, setup.clone(), &set, request.seed),
        results: ranks_dir.clone(),
        attention,
    };
    // The job as `attnbench-cp-rank` reads it: kept with the measurement, so the same run can be
    // started on a cluster (srun … attnbench-cp-rank job.json).
    write_json(&request.output_dir, "job.json", &job)?;
    let job_file = request.output_dir.join("job.json");
    let ranks = match p.backend {
        Backend::Processes => Ranks::Processes {
            job: &job,
            path: &job_file,
        },
        Backend::Threads | Backend::Nccl => Ranks::Threads {
            setup: &setup,
            set: &set,
            attention: opened.as_ref(),
        },
    };
    let cell = Cell {
        set: &set,
        shape,
        element,
        direction: p.direction,
        seed: request.seed,
    };
    let options = Options {
        outputs_dir: p.outputs.then_some(request.output_dir.as_path()),
        no_check: false,
    };
    host.debug("the gathered outputs are checked against the single-device reference");
    let mut bench = CpBench::new(ranks, shape, backward);
    let outcome = bench::run(&mut bench, &cell, &harness, measurement, options);
    // The ranks' job, logs and results were the means, not the artifact.
    let _ = std::fs::remove_dir_all(&ranks_dir);
    let mut measurement = outcome?;
    let Some(first) = bench.first else {
        return measurement.write(&request.output_dir);
    };
    let sizes = volume::Sizes {
        tokens: (shape.seqlen / setup.layout.world()) as u64,
        heads_q: p.heads_q as u64,
        heads_kv: p.heads_kv as u64,
        head_dim: p.head_dim as u64,
        element: element.bytes() as u64,
    };
    let (formula_fwd, formula_bwd) = volume::bytes(&setup, &sizes);
    let counted = |elements: &[u64]| {
        elements
            .iter()
            .map(|e| e * element.bytes() as u64)
            .collect::<Vec<_>>()
    };
    let per_rank_flops = measurement.flops / setup.layout.world() as u64;
    measurement.tflops = measurement
        .time_s
        .map(|t| Throughput::of(per_rank_flops, &t));
    let pass = |times: &[f64], rank: usize| PassTimes {
        total_s: times.get(rank).copied(),
        ..PassTimes::default()
    };
    let mut cp = cp_section(&p, &setup, &set, launcher_of(p.backend));
    cp.throughput = "per rank: global FLOPs / ranks / slowest rank's time".into();
    cp.mean_rank_tflops = mean_tflops(per_rank_flops, &bench.mean_rank_s);
    (cp.bytes_sent_forward, cp.formula_forward) = (counted(&first.sent_forward), formula_fwd);
    (cp.bytes_sent_backward, cp.formula_backward) = (counted(&first.sent_backward), formula_bwd);
    for (r, rank) in cp.ranks.iter_mut().enumerate() {
        rank.forward = pass(&first.forward_s, r);
        rank.backward = pass(&first.backward_s, r);
    }
    measurement.cp = Some(cp);
    measurement.write(&request.output_dir)
}

/// A `cp/threads` record's cp section as far as the layout and the mask decide it: the groups,
/// the sharding, each rank's area and pieces and the imbalance. The caller adds times and bytes.
fn cp_section(
    p: &Params,
    setup: &Setup,
    set: &attnbench_sdk::mask::MaskSet,
    launcher: &str,
) -> CpRun {
    let shares = sharding::rank_shares(&setup.layout, set, p.heads_q, p.heads_kv);
    let areas: Vec<u64> = shares.iter().map(|s| s.0).collect();
    CpRun {
        method: setup.method.to_string(),
        world: setup.layout.world() as u64,
        ulysses: setup.layout.ulysses as u64,
        ring: setup.layout.ring as u64,
        windows: setup.windows as u64,
        placement: p.placement.to_string(),
        sharding: setup.layout.sharding.name(),
        imbalance: Some(sharding::imbalance(&areas)),
        backend: p.backend.to_string(),
        attention: p.attention.to_string(),
        launcher: launcher.into(),
        throughput: String::new(),
        mean_rank_tflops: None,
        bytes_sent_forward: Vec::new(),
        formula_forward: 0,
        bytes_sent_backward: Vec::new(),
        formula_backward: 0,
        bytes_note: None,
        ranks: shares
            .into_iter()
            .map(|(area, pieces)| CpRank {
                device: None,
                area,
                pieces,
                forward: PassTimes::default(),
                backward: PassTimes::default(),
            })
            .collect(),
    }
}

/// Per-rank TFLOP/s by LongCA-bench's rule: the median over repetitions of the ranks' mean time.
fn mean_tflops(per_rank_flops: u64, mean_samples: &[f64]) -> Option<f64> {
    Quantiles::of(mean_samples).map(|t| per_rank_flops as f64 / t.p50 / 1e12)
}

/// Who started the ranks: the worker's threads, or processes started here or by `srun`.
fn launcher_of(backend: Backend) -> &'static str {
    match backend {
        Backend::Threads => "threads",
        Backend::Processes | Backend::Nccl => processes::Launch::from_env().name(),
    }
}

/// A GPU rank's medians over repetitions: the pass, its blocks' kernels, its busy NCCL streams,
/// and what of the pass was not kernels (exposed communication and the store's own work).
fn time_parts(total: &[f64], parts: &[(f64, f64)]) -> PassTimes {
    let median = |values: Vec<f64>| Quantiles::of(&values).map(|q| q.p50);
    let (compute, busy): (Vec<f64>, Vec<f64>) = parts.iter().copied().unzip();
    let exposed = total.iter().zip(&compute).map(|(t, c)| t - c).collect();
    PassTimes {
        total_s: median(total.to_vec()),
        kernels_s: median(compute),
        communication_busy_s: median(busy),
        not_kernels_s: median(exposed),
    }
}

/// A `cp/threads` node with `backend: nccl`: one rank process per GPU.
struct GpuRun<'a> {
    p: &'a Params,
    set: &'a attnbench_sdk::mask::MaskSet,
    shape: Shape,
    setup: Setup,
    inputs: &'a Inputs,
    element: Element,
}

impl GpuRun<'_> {
    /// Runs the ranks once (a warm-up and the timed repetitions inside each), checks the gathered
    /// outputs on 16 rows of every head, and records per-GPU throughput from the slowest rank of
    /// each repetition.
    fn measure(
        &self,
        request: &StageRequest,
        attention: Option<(std::path::PathBuf, String)>,
        mut measurement: Measurement,
        harness: &Harness,
    ) -> Result<Value, PluginError> {
        let (p, shape, setup) = (self.p, &self.shape, &self.setup);
        let attention = attention.ok_or_else(|| {
            PluginError::Params(
                "backend nccl runs every block on a GPU kernel's in-process backend: set `attention` to one, e.g. cuda/flash".into(),
            )
        })?;
        if self.element == Element::F32 {
            return Err(PluginError::Params(
                "dtype f32: GPU ranks take bf16 or fp16 inputs".into(),
            ));
        }
        let tolerance = self.element.tolerance();
        let n = setup.layout.world();
        // The stage starts every rank on this machine, one GPU each.
        let gpus = gpu_count().map_err(|err| PluginError::failed(err.to_string()))?;
        if n > gpus {
            return Err(PluginError::Params(format!(
                "world {n}: one GPU per rank, and the driver lists {gpus} here; set `world` to at most {gpus}"
            )));
        }
        let ranks_dir = request.output_dir.join("ranks");
        std::fs::create_dir_all(&ranks_dir)
            .map_err(|err| PluginError::failed(format!("{}: {err}", ranks_dir.display())))?;
        let job = gpu_rank::GpuJob {
            problem: rank_problem(p, setup.clone(), self.set, request.seed),
            attention,
            direction: p.direction,
            // At least 10 timed repetitions, as the GPU kernel stages take: a stage's defaults
            // suit threads (3), and three passes of ranks over NCCL bound the median loosely.
            harness: Harness {
                min_reps: harness.min_reps.max(10),
                max_reps: harness.max_reps.max(10),
                ..harness.clone()
            },
            results: ranks_dir.clone(),
        };
        write_json(&request.output_dir, "job.json", &job)?;
        processes::start_ranks(
            &request.output_dir.join("job.json"),
            n,
            &ranks_dir,
            std::time::Duration::from_secs(1500),
        )
        .map_err(ranks_failed)?;
        let results: Vec<gpu_rank::GpuRankResult> =
            processes::read_rank_results(&ranks_dir, n).map_err(ranks_failed)?;

        let (s, d) = (shape.seqlen, shape.head_dim);
        let mut out = vec![0f32; shape.q_len()];
        let mut lse = vec![f32::NEG_INFINITY; shape.heads_q * s];
        let mut grads = job.problem.backward.then(|| {
            [
                vec![0f32; shape.q_len()],
                vec![0f32; shape.kv_len()],
                vec![0f32; shape.kv_len()],
            ]
        });
        let read =
            |tokens: &local::Tokens<String>| -> Result<local::Tokens<Vec<f32>>, PluginError> {
                gpu_rank::read_f32(&ranks_dir, &tokens.data).map(|values| tokens.like(values))
            };
        for result in &results {
            threads::scatter(&mut out, &read(&result.out)?, s, d);
            threads::scatter(&mut lse, &read(&result.lse)?, s, 1);
            if let (Some(global), Some(local)) = (grads.as_mut(), result.grads.as_ref()) {
                for (g, l) in global.iter_mut().zip(local) {
                    threads::scatter(g, &read(l)?, s, d);
                }
            }
        }
        let _ = std::fs::remove_dir_all(&ranks_dir);
        let grads = grads.map(|[dq, dk, dv]| Grads { dq, dk, dv });
        measurement.correctness = Some(reference::check(
            shape,
            &HeadMasks::new(self.set, shape),
            self.inputs,
            &Forward { out, lse },
            grads.as_ref(),
            CheckMode::Sampled { rows: 16 },
            tolerance,
        ));
        // Each repetition's time on every rank, by both rules: the slowest rank, and the mean.
        let at = |times: &Vec<f64>, rep: usize| vec![times.get(rep).copied().unwrap_or(0.0)];
        let reps = results.iter().map(|r| r.forward_s.len()).min().unwrap_or(0);
        let per_rep: Vec<Vec<f64>> = (0..reps)
            .map(|rep| {
                results
                    .iter()
                    .map(|r| {
                        pass_times(p.direction, &at(&r.forward_s, rep), &at(&r.backward_s, rep))[0]
                    })
                    .collect()
            })
            .collect();
        let samples: Vec<f64> = per_rep
            .iter()
            .map(|t| t.iter().copied().fold(0.0, f64::max))
            .collect();
        let mean_samples: Vec<f64> = per_rep
            .iter()
            .map(|t| t.iter().sum::<f64>() / t.len().max(1) as f64)
            .collect();
        let per_rank_flops = measurement.flops / n as u64;
        let times = Quantiles::of(&samples);
        measurement.tflops = times.map(|t| Throughput::of(per_rank_flops, &t));
        measurement.time_s = times;
        measurement.harness.timer = "CUDA events around each pass on every rank's compute stream, each repetition after a barrier; the slowest rank per repetition".into();
        measurement.timing = Some(attnbench_sdk::measure::Timing {
            rel_ci: attnbench_sdk::measure::median_rel_ci(&samples),
            samples,
            stopped: results
                .first()
                .and_then(|r| r.stopped.clone())
                .unwrap_or_else(|| "rank 0 did not say".into()),
        });
        let sizes = volume::Sizes {
            tokens: (s / n) as u64,
            heads_q: p.heads_q as u64,
            heads_kv: p.heads_kv as u64,
            head_dim: p.head_dim as u64,
            element: self.element.bytes() as u64,
        };
        let (formula_fwd, formula_bwd) = volume::bytes(setup, &sizes);
        let mut cp = cp_section(p, setup, self.set, processes::Launch::from_env().name());
        cp.throughput =
            "per GPU: global FLOPs / ranks / the slowest rank's time of each repetition".into();
        cp.mean_rank_tflops = mean_tflops(per_rank_flops, &mean_samples);
        cp.bytes_sent_forward = results.iter().map(|r| r.sent.0).collect();
        cp.bytes_sent_backward = results.iter().map(|r| r.sent.1).collect();
        (cp.formula_forward, cp.formula_backward) = (formula_fwd, formula_bwd);
        cp.bytes_note = Some(
            "on GPUs K and V travel in the inputs' 16-bit type, dK and dV accumulators in f32"
                .into(),
        );
        for (rank, r) in cp.ranks.iter_mut().zip(&results) {
            rank.device = Some(r.device.clone());
            rank.forward = time_parts(&r.forward_s, &r.forward_parts_s);
            rank.backward = time_parts(&r.backward_s, &r.backward_parts_s);
        }
        measurement.cp = Some(cp);
        measurement.write(&request.output_dir)
    }
}

#[derive(Deserialize)]
pub(crate) struct ModelParams {
    mask: ModelMask,
    direction: Direction,
    tokens_per_gpu: u64,
    heads_q: u64,
    heads_kv: u64,
    head_dim: u64,
    dtype: Element,
    kernel_tflops: f64,
    worlds: Vec<usize>,
    gpus_per_node: usize,
    nvlink_gbs: f64,
    infiniband_gbs: f64,
    nvlink_latency_us: f64,
    infiniband_latency_us: f64,
    placement: Placement,
    sharding: ShardingKind,
    stripe: usize,
    chunk: usize,
}

fn model_stage(request: &StageRequest) -> Result<Value, PluginError> {
    let p: ModelParams = request.params()?;
    let element = p.dtype;
    let backward = p.direction == Direction::Bwd;
    let kernel_tflops = match (p.kernel_tflops, backward) {
        (t, _) if t > 0.0 => t,
        (_, false) => 350.6,
        (_, true) => 295.7,
    };
    if p.gpus_per_node == 0 || p.nvlink_gbs <= 0.0 || p.infiniband_gbs <= 0.0 {
        return Err(PluginError::Params(
            "gpus_per_node, nvlink_gbs and infiniband_gbs must be positive".into(),
        ));
    }
    if let Some(world) = p.worlds.iter().find(|&&w| w == 0) {
        return Err(PluginError::Params(format!(
            "worlds: {world} is not a world size"
        )));
    }
    let (nvlink_gbs, nvlink_latency_us, nvlink_source) = match measured_link(request)? {
        Link::Measured(gbs, us) => (
            gbs,
            us,
            "cp/links: the send/recv ring's fitted bus bandwidth and latency".to_string(),
        ),
        Link::Parameters => (p.nvlink_gbs, p.nvlink_latency_us, "parameters".to_string()),
        Link::NotMeasured(note) => (p.nvlink_gbs, p.nvlink_latency_us, note),
    };
    let machine = model::Machine {
        gpus_per_node: p.gpus_per_node,
        nvlink: nvlink_gbs * 1e9,
        infiniband: p.infiniband_gbs * 1e9,
        nvlink_latency: nvlink_latency_us * 1e-6,
        infiniband_latency: p.infiniband_latency_us * 1e-6,
    };
    let workload = model::Workload {
        sizes: volume::Sizes {
            tokens: p.tokens_per_gpu,
            heads_q: p.heads_q,
            heads_kv: p.heads_kv,
            head_dim: p.head_dim,
            element: element.bytes() as u64,
        },
        causal: p.mask == ModelMask::Causal,
        backward,
        imbalance: 1.0,
        kernel_flops: kernel_tflops * 1e12,
    };
    let placement = p.placement;
    let sharding = Sharding::of(p.sharding, p.stripe, p.chunk);
    // The sharding's imbalance depends on the ring's size and the tokens only: computed once each.
    let mut imbalances: BTreeMap<(usize, usize), Result<f64, LayoutError>> = BTreeMap::new();
    let points = Method::ALL
        .iter()
        .flat_map(|&method| p.worlds.iter().map(move |&world| (method, world)))
        .map(|(method, world)| {
            let seqlen = p.tokens_per_gpu as usize * world;
            let setup = model::paper_setup(method, world, placement, seqlen);
            let ring = setup.layout.ring;
            let imbalance = imbalances
                .entry((ring, seqlen))
                .or_insert_with(|| {
                    sharding::model_imbalance(sharding, workload.causal, seqlen, ring)
                })
                .clone();
            let mut prediction = match &imbalance {
                Ok(imbalance) => model::predict_setup(
                    &setup,
                    &machine,
                    &model::Workload {
                        imbalance: *imbalance,
                        ..workload.clone()
                    },
                ),
                Err(_) => model::predict_setup(&setup, &machine, &workload),
            };
            prediction.sharding = Some(sharding.name());
            match imbalance {
                Ok(imbalance) => prediction.imbalance = Some(imbalance),
                Err(why) => {
                    prediction.reason = Some(format!("{}: {why}", sharding.name()));
                    (prediction.tflops_per_gpu, prediction.time_s) = (None, None);
                    (prediction.compute_s, prediction.exposed_communication_s) = (None, None);
                }
            }
            prediction
        })
        .collect();
    let mut assumptions = serde_json::Map::new();
    for (key, value) in [
        ("kernel_tflops", json!(kernel_tflops)),
        ("gpus_per_node", json!(p.gpus_per_node)),
        ("nvlink_gbs", json!(nvlink_gbs)),
        ("infiniband_gbs", json!(p.infiniband_gbs)),
        ("nvlink_latency_us", json!(nvlink_latency_us)),
        ("nvlink_from", json!(nvlink_source)),
        ("infiniband_latency_us", json!(p.infiniband_latency_us)),
        ("placement", json!(p.placement)),
        ("groups", json!("USP and LoongTrain: Ulysses groups of min(world, 8), LoongTrain windows: the largest m with m² ≤ ring size (LongCA-bench's choices)")),
    ] {
        assumptions.insert(key.into(), value);
    }
    let predictions = attnbench_sdk::measure::Predictions {
        model: assumptions,
        points,
        against_measurements: against_measurements(request, &p, &machine)?,
    };
    write_json(
        &request.output_dir,
        attnbench_sdk::measure::Predictions::FILE,
        &predictions,
    )?;
    serde_json::to_value(&predictions).map_err(|err| PluginError::failed(err.to_string()))
}

/// Every GPU cell among the inputs (`cp/threads` with `backend: nccl`) of this node's mask and
/// direction, beside the model's prediction for its method, world, groups and tokens at its own
/// kernel rate.
fn against_measurements(
    request: &StageRequest,
    p: &ModelParams,
    machine: &model::Machine,
) -> Result<Vec<attnbench_sdk::measure::Comparison>, PluginError> {
    let mut comparisons = Vec::new();
    for input in request.inputs_from("cp/threads").filter(|i| i.succeeded()) {
        let m: Measurement = serde_json::from_value(input.result.clone()).map_err(|err| {
            PluginError::failed(format!("{}: not a measurement: {err}", input.node))
        })?;
        let Some(cp) = m.cp.as_ref() else {
            continue;
        };
        if cp.backend != Backend::Nccl.as_str()
            || m.mask.pattern != p.mask.as_str()
            || m.direction != p.direction
        {
            continue;
        }
        let unreadable = |what: &str| {
            PluginError::failed(format!(
                "{}: its record's cp.{what} is not one this plugin knows",
                input.node
            ))
        };
        let setup = Setup {
            method: Method::from_name(&cp.method).ok_or_else(|| unreadable("method"))?,
            layout: Layout::groups(
                m.mask.seqlen as usize,
                cp.ulysses as usize,
                cp.ring as usize,
                Placement::from_name(&cp.placement).ok_or_else(|| unreadable("placement"))?,
            ),
            windows: cp.windows as usize,
        };
        let method = setup.method;
        let world = setup.layout.world();
        // The slowest rank's pass, split as it recorded it.
        let pass = |rank: &CpRank| {
            if p.direction == Direction::Bwd {
                rank.backward.clone()
            } else {
                rank.forward.clone()
            }
        };
        let slowest = cp
            .ranks
            .iter()
            .map(pass)
            .max_by(|a, b| {
                a.total_s
                    .unwrap_or(0.0)
                    .total_cmp(&b.total_s.unwrap_or(0.0))
            })
            .ok_or_else(|| unreadable("ranks"))?;
        let (Some(time), Some(tflops)) = (m.time_s.as_ref(), m.tflops.as_ref()) else {
            continue;
        };
        let kernels_s = slowest.kernels_s.unwrap_or(0.0);
        let element = m.dtype;
        let workload = model::Workload {
            sizes: volume::Sizes {
                tokens: m.mask.seqlen / world as u64,
                heads_q: m.shape.heads_q as u64,
                heads_kv: m.shape.heads_kv as u64,
                head_dim: m.shape.head_dim as u64,
                element: element.bytes() as u64,
            },
            causal: p.mask == ModelMask::Causal,
            backward: p.direction == Direction::Bwd,
            // The slowest rank's kernel time already holds the sharding's imbalance.
            imbalance: 1.0,
            kernel_flops: m.flops as f64 / world as f64 / kernels_s.max(1e-12),
        };
        comparisons.push(attnbench_sdk::measure::Comparison {
            method: method.to_string(),
            mask: p.mask.to_string(),
            direction: p.direction.to_string(),
            world: world as u64,
            tokens_per_gpu: workload.sizes.tokens,
            measured_time_s: time.p50,
            measured_tflops_per_gpu: tflops.p50,
            kernels_s,
            not_kernels_s: slowest.not_kernels_s.unwrap_or(0.0),
            communication_busy_s: slowest.communication_busy_s.unwrap_or(0.0),
            predicted: model::predict_setup(&setup, machine, &workload),
        });
    }
    comparisons.sort_by(|a, b| (a.world, &a.method).cmp(&(b.world, &b.method)));
    Ok(comparisons)
}

/// Where the model's NVLink figures come from.
enum Link {
    /// A `cp/links` node's send/recv ring fit (the pattern of a ring step): GB/s and µs.
    Measured(f64, f64),
    /// No `cp/links` node among the inputs: the parameters.
    Parameters,
    /// A `cp/links` node that measured no link between GPUs (one GPU): the parameters, and why.
    NotMeasured(String),
}

/// NVLink's figures from a `cp/links` node in `needs`.
fn measured_link(request: &StageRequest) -> Result<Link, PluginError> {
    let Some(input) = request.inputs_from("cp/links").find(|i| i.succeeded()) else {
        return Ok(Link::Parameters);
    };
    let path = input.dir.join(links::FILE);
    let text = std::fs::read(&path)
        .map_err(|err| PluginError::failed(format!("{}: {err}", path.display())))?;
    let links: Value = serde_json::from_slice(&text)
        .map_err(|err| PluginError::failed(format!("{}: {err}", path.display())))?;
    let fit = links["fits"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|fit| fit["collective"] == "send_recv");
    Ok(
        match fit.map(|fit| (fit["bus_gbs"].as_f64(), fit["latency_us"].as_f64())) {
            Some((Some(gbs), Some(us))) => Link::Measured(gbs, us),
            _ => Link::NotMeasured(format!(
                "parameters: {} has no send/recv bandwidth between GPUs (measured on {} GPU(s)); \
                 cp/links on 2 or more GPUs with send_recv measures it",
                path.display(),
                links["ranks"]
            )),
        },
    )
}

attnbench_sdk::export_plugin!(Cp);

#[derive(Deserialize)]
struct LinksParams {
    ranks: usize,
    min_bytes: u64,
    max_bytes: u64,
    collectives: Vec<String>,
    samples: usize,
}

/// GPUs the driver lists, or why there are none to use.
pub(crate) fn gpu_count() -> Result<usize, GpuError> {
    attnbench_sdk::libraries::require("libcuda", "NVIDIA driver")?;
    cudarc::driver::CudaContext::device_count()
        .map(|n| n.max(0) as usize)
        .map_err(GpuError::driver("cannot count the GPUs"))
}

fn links_stage(request: &StageRequest, host: &Host) -> Result<Value, PluginError> {
    let p: LinksParams = request.params()?;
    let collectives = p
        .collectives
        .iter()
        .map(|name| {
            Collective::parse(name).ok_or_else(|| {
                PluginError::Params(format!(
                    "collectives: unknown `{name}`; expected some of {}",
                    Collective::ALL.map(Collective::name).join(", ")
                ))
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    if p.min_bytes == 0 || p.min_bytes > p.max_bytes {
        return Err(PluginError::Params(format!(
            "min_bytes ({}) must be at least 1 and at most max_bytes ({})",
            p.min_bytes, p.max_bytes
        )));
    }
    let gpus = gpu_count().map_err(|err| PluginError::failed(err.to_string()))?;
    let ranks = if p.ranks == 0 { gpus } else { p.ranks };
    if ranks == 0 || ranks > gpus {
        return Err(PluginError::Params(format!(
            "ranks: {ranks} GPUs asked for, the driver lists {gpus}"
        )));
    }
    let ranks_dir = request.output_dir.join("ranks");
    let job = links::LinksJob {
        ranks,
        sizes: links::sizes(p.min_bytes, p.max_bytes, ranks),
        collectives,
        samples: p.samples,
        results: ranks_dir.clone(),
    };
    write_json(&request.output_dir, "job.json", &job)?;
    host.info(&format!(
        "{} collectives × {} sizes on {ranks} GPUs",
        job.collectives.len(),
        job.sizes.len()
    ));
    processes::start_ranks(
        &request.output_dir.join("job.json"),
        ranks,
        &ranks_dir,
        std::time::Duration::from_secs(1500),
    )
    .map_err(ranks_failed)?;
    let results: Vec<links::RankLinks> =
        processes::read_rank_results(&ranks_dir, ranks).map_err(ranks_failed)?;
    let _ = std::fs::remove_dir_all(&ranks_dir);
    let (rows, fits) = links::assemble(ranks, &results);
    let result = links::record(ranks, &results, &rows, &fits);
    for fit in &fits {
        host.info(&format!(
            "{}: {:.1} µs latency, {} bus bandwidth",
            fit.collective.name(),
            fit.latency_us,
            fit.bus_gbs
                .map_or("no".to_string(), |b| format!("{b:.0} GB/s"))
        ));
    }
    write_json(&request.output_dir, links::FILE, &result)?;
    Ok(json!({"ranks": ranks, "rows": rows.len(), "fits": fits}))
}

/// The rank processes' failure, as the stage's.
fn ranks_failed(err: processes::LaunchError) -> PluginError {
    PluginError::failed(err.to_string())
}

#[cfg(test)]
mod tests;
