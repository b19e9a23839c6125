//! `cp/decode` on GPUs (`backend: nccl`): one `attnbench-cp-rank` process per GPU. Each rank
//! draws only its shard of every sequence's K and V (the stage's seeded stream, so the values
//! are those of the whole batch), computes its partial O and LSE of every new token with a
//! kernel plugin's in-process device backend (`cuda/decode`: a call a sequence, its new tokens
//! against the rank's block of its cache), and the partials combine over NCCL by the same hops
//! as on threads ([`crate::decode::combine`]). The rank's tensors are sequence-major (`[batch]
//! [heads][tokens][d]`), so each sequence's block is one contiguous call and the partial of the
//! whole batch one message. Each repetition starts at a barrier; rank 0's time is the step's
//! latency, since the step is done when the root holds the merged result, and the harness's
//! rule on it stops every rank at once ([`SharedRun`]).

use std::path::{Path, PathBuf};

use attnbench_sdk::attention::HostBlock;
use attnbench_sdk::decode::{block_rows, split_range, DecodeProblem};
use attnbench_sdk::measure::Harness;
use attnbench_sdk::reference::{Element, UniformStream};
use cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT;
use serde::{Deserialize, Serialize};

use crate::comm::{Communicator, Group};
use crate::decode::{combine, DecodeMethod, SPACE};
use crate::device::{DeviceValues, GpuError, Kind};
use crate::gpu_rank::{
    gpu_input, require_libraries, seconds_between, select_gpu, write_f32, RankGpu,
};
use crate::launch::RankInfo;
use crate::local::{Partial, Span, Store};
use crate::nccl::NcclGroup;
use crate::processes::RankError;
use crate::stopping::{Counted, SharedRun};

/// Everything a GPU decode rank needs; read by `attnbench-cp-rank` (`"kind": "gpu-decode"`).
#[derive(Serialize, Deserialize)]
#[serde(tag = "kind", rename = "gpu-decode")]
pub struct DecodeJob {
    pub problem: DecodeProblem,
    /// bf16 or fp16.
    pub dtype: Element,
    pub method: DecodeMethod,
    pub seed: u64,
    pub world: usize,
    /// The device backend: a plugin library and its in-process kernel.
    pub attention: (PathBuf, String),
    /// The stopping rule, applied by rank 0 to its step time for every rank.
    pub harness: Harness,
    /// Each rank writes `rank-<r>.json`, rank 0 its combined O and LSE as f32 files, here.
    pub results: PathBuf,
}

/// What one GPU decode rank reports.
#[derive(Serialize, Deserialize)]
pub struct DecodeRankResult {
    pub device: String,
    /// Keys of the batch this rank holds.
    pub keys: u64,
    /// Per timed repetition: from the barrier to this rank's part done (rank 0: the merged
    /// result; another rank: its partial handed on), and the local attention alone.
    pub step_s: Vec<f64>,
    pub local_s: Vec<f64>,
    /// Bytes this rank sent in one step.
    pub sent_bytes: u64,
    /// Why the repetitions stopped (rank 0's; `None` on the others).
    pub stopped: Option<String>,
    /// Rank 0: the files of the combined O (`[batch][heads_q][queries][head_dim]`) and LSE
    /// (`[batch][heads_q][queries]`), f32.
    pub outputs: Option<(String, String)>,
}

/// Runs this process's rank of the decode job and writes its result.
pub fn rank_main(text: &[u8], path: &Path) -> Result<(), RankError> {
    let job: DecodeJob =
        serde_json::from_slice(text).map_err(RankError::job(path, "a GPU decode job"))?;
    let info = RankInfo::from_env()?;
    select_gpu(&info)?;
    crate::processes::run_rank_catching(&job.results, info.rank, || run(&job, &info))
}

/// Rank `rank`'s keys of sequence `b`.
fn shard_of(
    problem: &DecodeProblem,
    b: usize,
    (rank, world): (usize, usize),
) -> std::ops::Range<u64> {
    split_range(problem.kv_lens[b], world as u64, rank as u64)
}

/// Q (`[batch][heads_q][queries][d]`), or K or V of this rank's keys (`[batch][heads_kv][shard]
/// [d]`, `first` = where the tensor starts in the stream), drawn from the stage's stream: the
/// values [`attnbench_sdk::decode::DecodeInputs::random`] gives the whole batch.
fn draw(
    draws: &UniformStream,
    problem: &DecodeProblem,
    place: (usize, usize),
    tensor: Option<u64>,
) -> Vec<f32> {
    let d = problem.head_dim;
    let mut values = Vec::new();
    for b in 0..problem.batch() {
        match tensor {
            None => {
                for head in 0..problem.heads_q {
                    let at = (head * problem.rows() + b as u64 * problem.queries) * d;
                    values.extend(draws.fill(at, (problem.queries * d) as usize));
                }
            }
            Some(first) => {
                let keys = shard_of(problem, b, place);
                for head in 0..problem.heads_kv {
                    let at =
                        first + (head * problem.keys() + problem.key_offset(b) + keys.start) * d;
                    values.extend(draws.fill(at, ((keys.end - keys.start) * d) as usize));
                }
            }
        }
    }
    values
}

fn run(job: &DecodeJob, info: &RankInfo) -> Result<DecodeRankResult, RankError> {
    require_libraries()?;
    if info.world != job.world {
        return Err(RankError::World {
            started: info.world,
            launcher: info.source,
            needed: job.world,
        });
    }
    gpu_input(job.dtype)?;
    let problem = &job.problem;
    let (rank, size) = (info.rank, job.world);

    let world = crate::tcp::join(info)?;
    let host = Group::new(world, (0..size).collect(), rank, SPACE);
    let gpu = RankGpu::open(&job.attention, job.dtype)?;
    let (device, store) = (gpu.device.clone(), &gpu.store);
    let nccl = NcclGroup::join(&host, gpu.stream("decode")?, store)?;

    let draws = UniformStream::new(job.seed, job.dtype);
    let (hq, hkv, d) = (
        problem.heads_q as usize,
        problem.heads_kv as usize,
        problem.head_dim as usize,
    );
    let (place, queries) = ((rank, size), problem.queries as usize);
    let q_values = problem.heads_q * problem.rows() * problem.head_dim;
    let kv_values = problem.heads_kv * problem.keys() * problem.head_dim;
    let upload = |values: Vec<f32>| store.upload(&job.dtype.encode(&values), Kind::Input);
    let q = upload(draw(&draws, problem, place, None));
    let k = upload(draw(&draws, problem, place, Some(q_values)));
    let v = upload(draw(&draws, problem, place, Some(q_values + kv_values)));
    let kv_head_of: Vec<u32> = (0..hq).map(|h| (h / (hq / hkv)) as u32).collect();
    // Each sequence's block: its keys here, its rows' masks, where it lies in Q, K/V, O and LSE.
    let mut blocks = Vec::new();
    let mut key_at = 0;
    for b in 0..problem.batch() {
        let keys = shard_of(problem, b, place);
        let len = (keys.end - keys.start) as usize;
        let rows_at = b * hq * queries;
        if len > 0 {
            let span = Span {
                rows: rows_at * d..(rows_at + hq * queries) * d,
                keys: key_at * d..(key_at + hkv * len) * d,
                lse: rows_at..rows_at + hq * queries,
            };
            blocks.push((
                len,
                block_rows(problem.kv_lens[b], problem.queries, keys),
                span,
            ));
        }
        key_at += hkv * len;
    }
    let scale = 1.0 / (d as f64).sqrt();
    let local = || -> Result<Partial<DeviceValues>, RankError> {
        let mut partial = Partial::empty(store, hq, problem.rows() as usize, d);
        for (len, rows, span) in &blocks {
            let block = HostBlock {
                head_dim: d,
                q_len: queries,
                k_len: *len,
                scale,
                kv_head_of: &kv_head_of,
                heads_kv: hkv,
                rows,
            };
            store.forward(
                &block,
                span,
                (&q, &k, &v),
                &mut partial.out,
                &mut partial.lse,
            )?;
        }
        Ok(partial)
    };

    let event = || {
        store
            .stream
            .record_event(Some(CU_EVENT_DEFAULT))
            .map_err(GpuError::driver("timing event"))
    };
    let (mut step_s, mut local_s, mut sent_bytes) = (Vec::new(), Vec::new(), None);
    let mut shared = SharedRun::new(&host, &job.harness, Counted::Root);
    let combined = loop {
        nccl.barrier();
        let before = nccl.sent_bytes();
        let start = event()?;
        let mine = local()?;
        let computed = event()?;
        let combined = combine(store, &nccl, mine, job.method, d);
        let end = event()?;
        sent_bytes.get_or_insert(nccl.sent_bytes() - before);
        let step = seconds_between(&start, &end)?;
        let verdict = shared.after(step);
        if verdict.timed {
            step_s.push(step);
            local_s.push(seconds_between(&start, &computed)?);
        }
        if verdict.done {
            break combined;
        }
    };
    nccl.barrier();
    let outputs = match combined {
        Some(partial) => {
            let names = ("rank-0-out.f32".to_string(), "rank-0-lse.f32".to_string());
            write_f32(&job.results, &names.0, &store.download_f32(&partial.out))?;
            write_f32(&job.results, &names.1, &store.download_f32(&partial.lse))?;
            Some(names)
        }
        None => None,
    };
    Ok(DecodeRankResult {
        device,
        keys: (0..problem.batch())
            .map(|b| shard_of(problem, b, place))
            .map(|r| r.end - r.start)
            .sum(),
        step_s,
        local_s,
        sent_bytes: sent_bytes.unwrap_or_default(),
        stopped: shared.stopped().map(str::to_string),
        outputs,
    })
}

/// The ranks' sequence-major O and LSE (`[batch][heads_q][queries]`) in the reference's order,
/// `[heads_q][rows]` with row `b · queries + i`.
fn heads_major(problem: &DecodeProblem, out: &[f32], lse: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let (hq, queries, d) = (
        problem.heads_q as usize,
        problem.queries as usize,
        problem.head_dim as usize,
    );
    let rows = problem.rows() as usize;
    let (mut o, mut l) = (vec![0f32; out.len()], vec![0f32; lse.len()]);
    for b in 0..problem.batch() {
        for h in 0..hq {
            for i in 0..queries {
                let from = (b * hq + h) * queries + i;
                let to = h * rows + b * queries + i;
                l[to] = lse[from];
                o[to * d..(to + 1) * d].copy_from_slice(&out[from * d..(from + 1) * d]);
            }
        }
    }
    (o, l)
}

/// A `cp/decode` node on GPUs: what the stage hands [`measure`].
pub struct GpuDecode<'a> {
    pub problem: &'a DecodeProblem,
    pub inputs: &'a attnbench_sdk::decode::DecodeInputs,
    pub method: DecodeMethod,
    pub world: usize,
    pub dtype: Element,
    pub attention: (PathBuf, String),
    pub harness: Harness,
}

fn median(values: &[f64]) -> f64 {
    attnbench_sdk::measure::Quantiles::of(values).map_or(f64::NAN, |q| q.p50)
}

/// Starts one rank process per GPU, checks rank 0's combined output against the f64
/// reference, and records the step: rank 0's time (the latency), the mean over ranks, the
/// bandwidth the batch's K, V, Q and O bytes came to, and each rank's keys, times and bytes
/// against the formula (every rank but the root sends one partial: O and LSE in f32).
pub fn measure(
    request: &attnbench_sdk::StageRequest,
    cell: GpuDecode<'_>,
) -> Result<serde_json::Value, attnbench_sdk::PluginError> {
    use attnbench_sdk::decode::{check_step, StepCheck};
    use attnbench_sdk::PluginError;
    let problem = cell.problem;
    if cell.dtype == Element::F32 {
        return Err(PluginError::Params(
            "dtype f32: GPU ranks take bf16 or fp16 inputs".into(),
        ));
    }
    if problem.page_size.is_some() {
        return Err(PluginError::Params(
            "page_size: backend nccl gives each rank its shard of the cache contiguous; leave page_size at 0".into(),
        ));
    }
    let gpus = crate::gpu_count().map_err(|err| PluginError::failed(err.to_string()))?;
    if cell.world > gpus {
        return Err(PluginError::Params(format!(
            "world {}: one GPU per rank, and the driver lists {gpus} here; set `world` to at most {gpus}",
            cell.world
        )));
    }
    let ranks_dir = request.output_dir.join("ranks");
    std::fs::create_dir_all(&ranks_dir).map_err(|err| PluginError::io(&ranks_dir, err))?;
    let job = DecodeJob {
        problem: problem.clone(),
        dtype: cell.dtype,
        method: cell.method,
        seed: request.seed,
        world: cell.world,
        attention: cell.attention,
        harness: cell.harness,
        results: ranks_dir.clone(),
    };
    attnbench_sdk::write_json(&request.output_dir, "job.json", &job)?;
    let failed = |err: crate::processes::LaunchError| PluginError::failed(err.to_string());
    crate::processes::start_ranks(
        &request.output_dir.join("job.json"),
        cell.world,
        &ranks_dir,
        std::time::Duration::from_secs(1500),
    )
    .map_err(failed)?;
    let results: Vec<DecodeRankResult> =
        crate::processes::read_rank_results(&ranks_dir, cell.world).map_err(failed)?;
    let (out_file, lse_file) = results[0]
        .outputs
        .clone()
        .ok_or_else(|| PluginError::failed("rank 0 wrote no combined output"))?;
    let (out, lse) = heads_major(
        problem,
        &crate::gpu_rank::read_f32(&ranks_dir, &out_file)?,
        &crate::gpu_rank::read_f32(&ranks_dir, &lse_file)?,
    );
    let _ = std::fs::remove_dir_all(&ranks_dir);
    let correctness = check_step(
        problem,
        cell.inputs,
        (&out, Some(&lse)),
        StepCheck::Auto,
        cell.dtype.tolerance(),
    );

    let root = &results[0].step_s;
    let mean_over_ranks: Vec<f64> = (0..root.len())
        .map(|rep| {
            results
                .iter()
                .map(|r| r.step_s.get(rep).copied().unwrap_or(0.0))
                .sum::<f64>()
                / results.len() as f64
        })
        .collect();
    let latency = median(root);
    let bytes = problem.bytes(cell.dtype.bytes() as u64);
    let partial_bytes = (problem.heads_q * problem.rows() * (problem.head_dim + 1)) * 4;
    let sent: Vec<u64> = results.iter().map(|r| r.sent_bytes).collect();
    let expected: Vec<u64> = (0..cell.world)
        .map(|rank| if rank == 0 { 0 } else { partial_bytes })
        .collect();
    let passed = correctness["passed"] == true && sent == expected;
    Ok(serde_json::json!({
        "backend": "nccl",
        "attention": format!("{}", job.attention.1),
        "correctness": correctness,
        "latency_us": latency * 1e6,
        "time_s": attnbench_sdk::measure::Quantiles::of(root),
        "mean_rank_us": median(&mean_over_ranks) * 1e6,
        "timer": "CUDA events on each rank's compute stream from a barrier; the latency is rank 0's (the step ends when the root holds the merged result), beside the mean over ranks",
        "bandwidth_gbs": bytes as f64 / latency / 1e9,
        "per_gpu_gbs": bytes as f64 / latency / 1e9 / cell.world as f64,
        "bytes_counted": "K and V read once per KV head, Q read and O written once, in the inputs' type",
        "ranks": results.iter().map(|r| serde_json::json!({
            "device": r.device,
            "keys": r.keys,
            "step_us": median(&r.step_s) * 1e6,
            "local_us": median(&r.local_s) * 1e6,
            "sent_bytes": r.sent_bytes,
        })).collect::<Vec<_>>(),
        "sent_bytes": sent,
        "expected_sent_bytes": expected,
        "traffic_matches": sent == expected,
        "reps": root.len(),
        "stopped": results[0].stopped,
        "passed": passed,
    }))
}

#[cfg(test)]
#[path = "decode_gpu_tests.rs"]
mod tests;
