//! One rank of a context-parallel run on GPUs (`backend: nccl`): its GPU, its NCCL groups, its
//! shard of the inputs in 16-bit, the method on the [`DeviceStore`] with blocks on a kernel
//! plugin's device backend (`cuda/flash`), timed with CUDA events (every repetition starts at a
//! barrier) until the harness's rule, applied by rank 0 to the slowest rank's time, stops every
//! rank at once ([`SharedRun`]); its outputs written back as f32 files for the stage to check.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use attnbench_sdk::attention::{Backend, DType};
use attnbench_sdk::measure::{Direction, Harness};
use attnbench_sdk::reference::{Element, HeadMasks, RandomInputs, Tensor};
use attnbench_sdk::PluginError;
use cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT;
use cudarc::driver::{CudaContext, CudaStream};
use serde::{Deserialize, Serialize};

use crate::comm::{rank_groups, Communicator};
use crate::device::{DeviceStore, DeviceValues, GpuError, Kind};
use crate::launch::RankInfo;
use crate::local::Tokens;
use crate::methods::{Groups, Rank};
use crate::nccl::NcclGroup;
use crate::processes::{RankError, RankProblem};
use crate::protocol::pass_times;
use crate::stopping::{Counted, SharedRun};

/// Everything a GPU rank needs; read by `attnbench-cp-rank` (`"kind": "gpu"`).
#[derive(Serialize, Deserialize)]
#[serde(tag = "kind", rename = "gpu")]
pub struct GpuJob {
    /// The problem, its dtype bf16 or fp16.
    #[serde(flatten)]
    pub problem: RankProblem,
    /// The device backend: a plugin library and its in-process kernel.
    pub attention: (PathBuf, String),
    /// The passes a repetition times.
    pub direction: Direction,
    /// The stopping rule, applied by rank 0 for every rank.
    pub harness: Harness,
    /// Each rank writes `rank-<r>.json` and its f32 output files here.
    pub results: PathBuf,
}

/// What one GPU rank reports: its device, per-repetition times, bytes sent, and where its
/// outputs are (file names in `results`, with their tokens and heads).
#[derive(Serialize, Deserialize)]
pub struct GpuRankResult {
    pub device: String,
    pub forward_s: Vec<f64>,
    pub backward_s: Vec<f64>,
    /// Per repetition: seconds in the blocks' kernels, and seconds the NCCL streams were busy.
    pub forward_parts_s: Vec<(f64, f64)>,
    pub backward_parts_s: Vec<(f64, f64)>,
    /// Bytes sent in one forward and one backward pass.
    pub sent: (u64, u64),
    /// Why the repetitions stopped (rank 0's record; `None` on the others).
    pub stopped: Option<String>,
    pub out: Tokens<String>,
    pub lse: Tokens<String>,
    pub grads: Option<[Tokens<String>; 3]>,
}

/// Restricts this process to its GPU before CUDA starts: under a launcher that already gave
/// each rank one GPU (`CUDA_VISIBLE_DEVICES` naming one), that one; else the `LOCAL_RANK`-th of
/// those visible.
pub(crate) fn select_gpu(info: &RankInfo) -> Result<(), RankError> {
    let visible = std::env::var("CUDA_VISIBLE_DEVICES").ok();
    let chosen = match visible.as_deref() {
        Some(list) if !list.contains(',') && !list.trim().is_empty() => return Ok(()),
        Some(list) if !list.trim().is_empty() => list
            .split(',')
            .nth(info.local_rank)
            .map(str::to_string)
            .ok_or_else(|| RankError::Visible {
                local_rank: info.local_rank,
                visible: list.to_string(),
            })?,
        _ => info.local_rank.to_string(),
    };
    // SAFETY: the rank's threads that could read the environment do not exist yet.
    unsafe { std::env::set_var("CUDA_VISIBLE_DEVICES", chosen) };
    Ok(())
}

/// Writes `values` as little-endian f32 to `dir/name`.
pub(crate) fn write_f32(dir: &Path, name: &str, values: &[f32]) -> Result<(), RankError> {
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    let path = dir.join(name);
    std::fs::write(&path, bytes).map_err(|source| RankError::Io { path, source })
}

/// Reads a file [`write_f32`] wrote.
pub fn read_f32(dir: &Path, name: &str) -> Result<Vec<f32>, PluginError> {
    let path = dir.join(name);
    let bytes = std::fs::read(&path).map_err(|err| PluginError::io(&path, err))?;
    Ok(bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect())
}

/// Runs this process's rank of `job` and writes its result.
pub fn rank_main(text: &[u8], path: &Path) -> Result<(), RankError> {
    let job: GpuJob = serde_json::from_slice(text).map_err(RankError::job(path, "a GPU job"))?;
    let info = RankInfo::from_env()?;
    select_gpu(&info)?;
    crate::processes::run_rank_catching(&job.results, info.rank, || run(&job, &info))
}

pub(crate) fn seconds_between(
    start: &cudarc::driver::CudaEvent,
    end: &cudarc::driver::CudaEvent,
) -> Result<f64, GpuError> {
    start
        .elapsed_ms(end)
        .map(|ms| ms as f64 * 1e-3)
        .map_err(GpuError::driver("timing events"))
}

/// A rank's GPU: its context (every stream order explicit: events between the compute and NCCL
/// streams), its name, and a store on a compute stream whose blocks run on a device backend.
pub(crate) struct RankGpu {
    ctx: Arc<CudaContext>,
    pub device: String,
    pub store: DeviceStore,
}

/// The backend's input type for a GPU rank's `dtype`.
pub(crate) fn gpu_input(dtype: Element) -> Result<DType, RankError> {
    match dtype {
        Element::Bf16 => Ok(DType::Bf16),
        Element::F16 => Ok(DType::F16),
        Element::F32 => Err(RankError::GpuDtype),
    }
}

impl RankGpu {
    /// Device 0 of this process (see [`select_gpu`]), with `attention` (a plugin library and its
    /// in-process kernel) taking `dtype` inputs.
    pub(crate) fn open(
        attention: &(PathBuf, String),
        dtype: Element,
    ) -> Result<RankGpu, RankError> {
        let input = gpu_input(dtype)?;
        let ctx = CudaContext::new(0).map_err(GpuError::driver("cannot open the rank's GPU"))?;
        // SAFETY: no buffer exists yet.
        unsafe { ctx.disable_event_tracking() };
        let device = ctx.name().map_err(GpuError::driver("device name"))?;
        let backend = Backend::open(&attention.0, &attention.1)?;
        let compute = ctx
            .new_stream()
            .map_err(GpuError::driver("compute stream"))?;
        let store = DeviceStore::new(&ctx, compute, backend, input)?;
        Ok(RankGpu { ctx, device, store })
    }

    /// A new stream for an NCCL group.
    pub(crate) fn stream(&self, what: &str) -> Result<Arc<CudaStream>, GpuError> {
        self.ctx
            .new_stream()
            .map_err(GpuError::driver(format!("{what} stream")))
    }
}

/// The libraries a GPU rank needs, before it joins the others.
pub(crate) fn require_libraries() -> Result<(), RankError> {
    attnbench_sdk::libraries::require("libcuda", "NVIDIA driver").map_err(GpuError::from)?;
    attnbench_sdk::libraries::require("libnccl", "NCCL").map_err(GpuError::from)?;
    Ok(())
}

fn run(job: &GpuJob, info: &RankInfo) -> Result<GpuRankResult, RankError> {
    require_libraries()?;
    let problem = &job.problem;
    problem.check_world(info)?;
    let setup = &problem.setup;
    let layout = &setup.layout;
    let element = problem.dtype;
    gpu_input(element)?;
    let shape = problem.shape();
    crate::threads::check(setup, &shape)?;
    let w = info.rank;

    // The TCP mesh carries the NCCL ids; the host groups name each NCCL group's members.
    let world = crate::tcp::join(info)?;
    let [everyone, ulysses_host, ring_host] = rank_groups(&world, layout, w);

    let gpu = RankGpu::open(&job.attention, element)?;
    let (device, store) = (gpu.device.clone(), &gpu.store);
    let world_nccl = NcclGroup::join(&everyone, gpu.stream("world")?, store)?;
    let ulysses = NcclGroup::join(&ulysses_host, gpu.stream("Ulysses")?, store)?;
    let ring = NcclGroup::join(&ring_host, gpu.stream("ring")?, store)?;
    let groups = Groups {
        ulysses: &ulysses,
        ring: &ring,
    };

    // The rank's own share of the inputs, drawn alone: the same values as the stage's whole
    // tensors, without every rank holding them.
    let draws = RandomInputs::new(&shape, problem.seed, element);
    let head_masks = HeadMasks::new(&problem.mask, &shape);
    let rank = Rank::new(setup.clone(), w, &problem.mask, &head_masks, &shape);
    let positions = layout.positions(w);
    let (q_heads, kv_heads): (Vec<usize>, Vec<usize>) =
        ((0..shape.heads_q).collect(), (0..shape.heads_kv).collect());
    let upload = |tensor: Tensor, heads: &[usize]| Tokens {
        positions: positions.clone(),
        heads: heads.to_vec(),
        data: store.upload(
            &element.encode(&draws.shard(tensor, heads, &positions)),
            Kind::Input,
        ),
    };
    let (q, k, v) = (
        upload(Tensor::Q, &q_heads),
        upload(Tensor::K, &kv_heads),
        upload(Tensor::V, &kv_heads),
    );
    let d_out = problem.backward.then(|| upload(Tensor::DOut, &q_heads));

    let sent = || ulysses.sent_bytes() + ring.sent_bytes();
    let event = || {
        store
            .stream
            .record_event(Some(CU_EVENT_DEFAULT))
            .map_err(GpuError::driver("timing event"))
    };
    let (mut forward_s, mut backward_s) = (Vec::new(), Vec::new());
    let (mut forward_parts_s, mut backward_parts_s) = (Vec::new(), Vec::new());
    // Where a pass's time went, read once its work is done: kernels, and busy NCCL streams.
    let parts = || {
        (
            store.take_block_seconds(),
            ulysses.take_busy_seconds() + ring.take_busy_seconds(),
        )
    };
    let mut sent_per_pass = None;
    let mut shared = SharedRun::new(&everyone, &job.harness, Counted::Slowest);
    let (forward, grads) = loop {
        world_nccl.barrier();
        let before = sent();
        let start = event()?;
        let forward = rank.forward(store, &groups, &q, &k, &v)?;
        let end = event()?;
        let forward_time = seconds_between(&start, &end)?;
        let forward_parts = parts();
        let forward_sent = sent() - before;
        let mut grads = None;
        let mut backward_time = None;
        if let Some(d_out) = &d_out {
            world_nccl.barrier();
            let start = event()?;
            grads = Some(rank.backward(store, &groups, &forward.saved, d_out)?);
            let end = event()?;
            backward_time = Some((seconds_between(&start, &end)?, parts()));
        }
        sent_per_pass.get_or_insert((forward_sent, sent() - before - forward_sent));
        let backward_seconds = backward_time.map_or(0.0, |(time, _)| time);
        let verdict =
            shared.after(pass_times(job.direction, &[forward_time], &[backward_seconds])[0]);
        if verdict.timed {
            forward_s.push(forward_time);
            forward_parts_s.push(forward_parts);
            if let Some((time, parts)) = backward_time {
                backward_s.push(time);
                backward_parts_s.push(parts);
            }
        }
        if verdict.done {
            break (forward, grads);
        }
    };
    world_nccl.barrier();
    let dir = &job.results;
    let write = |name: &str, tokens: &Tokens<DeviceValues>| -> Result<Tokens<String>, RankError> {
        let file = format!("rank-{w}-{name}.f32");
        write_f32(dir, &file, &store.download_f32(&tokens.data))?;
        Ok(tokens.like(file))
    };
    Ok(GpuRankResult {
        device,
        forward_s,
        backward_s,
        forward_parts_s,
        backward_parts_s,
        sent: sent_per_pass.unwrap_or_default(),
        stopped: shared.stopped().map(str::to_string),
        out: write("out", &forward.out)?,
        lse: write("lse", &forward.lse)?,
        grads: grads
            .map(|g| -> Result<[Tokens<String>; 3], RankError> {
                Ok([
                    write("dq", &g.dq)?,
                    write("dk", &g.dk)?,
                    write("dv", &g.dv)?,
                ])
            })
            .transpose()?,
    })
}
