//! `cuda/decode`: one decode step of a batch through attnbench's split-KV kernel
//! (`kernels/decode.cu`), timed with the GPU harness and checked against the f64 reference. A
//! decode step is bound by memory, so the record puts the bytes the step must move over its time
//! beside the device's own copy bandwidth, measured in the same stage with the same harness.

use std::sync::Arc;

use attnbench_sdk::decode::{
    check_step, declare_step, step_record, unchecked, DecodeInputs, DecodeProblem, StepCheck,
    StepParams,
};
use attnbench_sdk::measure::{Harness, Quantiles};
use attnbench_sdk::nvml;
use attnbench_sdk::reference::Element;
use attnbench_sdk::{
    write_json, CacheScope, Isolation, ParamSpec, ParamType, PluginError, StageRequest, StageSpec,
};
use cudarc::driver::{CudaFunction, CudaModule, DeviceRepr, LaunchConfig, PushKernelArg};
use serde::Deserialize;
use serde_json::{json, Value};

use crate::gpu::{allow_shared, failed, Buffer, Gpu};
use crate::nvrtc::CudaSource;

pub(crate) const SOURCE: CudaSource =
    CudaSource::single("decode.cu", include_str!("../kernels/decode.cu"));

/// m16 tiles of query rows one block of the split kernel takes (its `MT`): one when the KV head's
/// group of rows fits 16 (GQA 8 with one or two new tokens), else two, so few rows do not pay
/// for 32.
pub(crate) fn m_tiles(group_rows: u64) -> u64 {
    if group_rows <= 16 {
        1
    } else {
        2
    }
}
/// Warps of the split kernel's blocks, each its own split (`WARPS` in decode.cu).
const WARPS: u64 = 4;
/// Keys a warp stages at once, and tiles in its ring (`TILE`, `STAGES` in decode.cu).
const TILE: u64 = 32;
const STAGES: u64 = 3;
/// Rows of a KV head's group one merge block folds, a warp each (`MERGE_ROWS` in decode.cu).
const MERGE_ROWS: u32 = 4;
/// Fewest keys a split of the longest sequence gets when the count is chosen: shorter ones cost
/// more in the ring's start and the merge than their parallelism gains.
pub const MIN_SPLIT_KEYS: u64 = 256;
/// Waves of resident blocks the split count aims for: sequences of a batch differ in length, and
/// with a second wave the blocks of the short ones fill in behind the long ones' (which start
/// first: the grid's slowest index is the sequence, longest first). More waves cost more than
/// they balance, and one wave leaves the short sequences' SMs idle: on an H100 (2026-12-07, batch
/// 8 stepping down from the longest cache, 64:8 heads, d 128), 24 splits a sequence (2 waves)
/// took 425.8 µs at 64K keys and one new token against 439.6 µs at 72 (6 waves) and 444.6 at 96,
/// 448.1 µs with four new tokens against 462–466 at 16, and 144.6 µs at 16K with four new tokens
/// against 159.5 at 12 (one wave, which a cap on the merge's share of the traffic had chosen).
const WAVES: u64 = 2;

/// Dynamic shared memory of a split block: Q's rows and each warp's ring of K and V tiles, rows
/// padded by 8 values (decode.cu's formula).
pub(crate) fn shared_bytes(head_dim: u64, m_tiles: u64) -> u64 {
    2 * (head_dim + 8) * (16 * m_tiles + 2 * WARPS * STAGES * TILE)
}
/// Split blocks that fit an SM of `sm_bytes` shared memory at once, 1 KB of it reserved per
/// block: on Hopper's 228 KB, two at d 64, one at d 128.
fn resident_blocks(head_dim: u64, m_tiles: u64, sm_bytes: u64) -> u64 {
    (sm_bytes / (shared_bytes(head_dim, m_tiles) + 1024)).max(1)
}

/// The kernels' one argument, as `DecodeArgs` in decode.cu lays it out (its size is checked on
/// both sides).
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct DecodeArgs {
    pub(crate) q: u64,
    pub(crate) k: u64,
    pub(crate) v: u64,
    pub(crate) part_out: u64,
    pub(crate) part_lse: u64,
    pub(crate) out: u64,
    pub(crate) lse: u64,
    pub(crate) kv_lens: u64,
    pub(crate) key_offsets: u64,
    pub(crate) page_offsets: u64,
    pub(crate) pages: u64,
    pub(crate) batch: u32,
    pub(crate) heads_kv: u32,
    pub(crate) group: u32,
    pub(crate) queries: u32,
    pub(crate) splits: u32,
    pub(crate) row_tiles: u32,
    pub(crate) rows: u32,
    pub(crate) page_size: u32,
    pub(crate) keys: u64,
    pub(crate) scale_log2: f32,
    /// Keys of the sequence past those given, which its new tokens see too (0: a whole cache).
    pub(crate) keys_after: u32,
}
const _: () = assert!(std::mem::size_of::<DecodeArgs>() == 136);
// SAFETY: plain `#[repr(C)]` data of the layout the kernels read; its addresses are device
// pointers that outlive every launch (the buffers are held until the stream is synchronised).
unsafe impl DeviceRepr for DecodeArgs {}

/// `cuda/decode`'s parameters.
#[derive(Deserialize)]
pub struct DecodeParams {
    dtype: Element,
    splits: u64,
    #[serde(flatten)]
    step: StepParams,
}

/// `cuda/decode` as the manifest declares it.
pub fn spec() -> StageSpec {
    declare_step(StageSpec::new("decode"), &Harness::gpu(), 8, "32k", (64, 8, 128))
        .doc("Times one decode step of a batch with attnbench's split-KV (Flash-Decoding) kernel, checked against the f64 reference; records latency and the bandwidth reached beside the device's copy bandwidth.")
        .param(ParamSpec::new("dtype", Element::param_type(&[Element::Bf16, Element::F16])).default("bf16"))
        .param(ParamSpec::new("splits", ParamType::Int).default(0).doc("KV splits per sequence, a multiple of 4 (each warp of a block is one); 0 chooses from the KV lengths, the rows and the multiprocessors (the record says how)."))
        .output("decode")
        .cache_scope(CacheScope::Machine)
        .isolation(Isolation::Worker)
        .exclusive()
        .needs_gpu()
        .timeout_s(1800.0)
}

/// The split count for `problem` on a device with `multiprocessors` SMs, a multiple of
/// [`WARPS`] (a warp is a split): [`WAVES`] waves of resident blocks, with no split under
/// [`MIN_SPLIT_KEYS`] keys of the longest sequence. Returns the count and why.
pub fn choose_splits(
    problem: &DecodeProblem,
    multiprocessors: u64,
    sm_bytes: u64,
) -> (u64, String) {
    let group_rows = problem.heads_q / problem.heads_kv * problem.queries;
    let tiles = m_tiles(group_rows);
    let blocks = problem.batch() as u64 * problem.heads_kv * group_rows.div_ceil(16 * tiles);
    let per_sm = resident_blocks(problem.head_dim, tiles, sm_bytes);
    let wave = (per_sm * multiprocessors).div_ceil(blocks);
    let longest = problem.kv_lens.iter().copied().max().unwrap_or(1);
    let key_cap = (longest / (MIN_SPLIT_KEYS * WARPS)).max(1);
    let per_block = (wave * WAVES).min(key_cap).max(1);
    let why = format!(
        "{blocks} blocks unsplit, {per_sm} an SM on {multiprocessors} SMs: {wave} blocks a sequence \
         ({WARPS} splits each) fill a wave, {WAVES} waves would take {}; splits of at least \
         {MIN_SPLIT_KEYS} keys allow {key_cap}; {per_block} blocks of {WARPS} splits a sequence",
        wave * WAVES
    );
    (per_block * WARPS, why)
}

/// The compiled decode kernels, kept for the worker's life.
pub struct Kernels {
    module: Arc<CudaModule>,
}

pub fn compile(gpu: &Gpu) -> Result<Kernels, PluginError> {
    Ok(Kernels {
        module: gpu.compile("the decode kernels", &SOURCE)?,
    })
}

/// What stays on the device for the timed repetitions.
struct Device {
    _buffers: Vec<Buffer<u8>>,
    _index: Vec<Buffer<u32>>,
    _offsets: Buffer<u64>,
    out: Buffer<u8>,
    lse: Buffer<f32>,
    _parts: (Buffer<f32>, Buffer<f32>),
    args: DecodeArgs,
}

fn upload(
    gpu: &Gpu,
    problem: &DecodeProblem,
    inputs: &DecodeInputs,
    element: Element,
    splits: u64,
    seed: u64,
) -> Result<Device, PluginError> {
    let stream = &gpu.stream;
    let table = problem.page_table(seed);
    let (k, v) = match &table {
        Some(table) => (
            table.to_pool(problem, &inputs.k),
            table.to_pool(problem, &inputs.v),
        ),
        None => (inputs.k.clone(), inputs.v.clone()),
    };
    let q = gpu.upload("Q", &element.encode(&inputs.q))?;
    let k = gpu.upload("K", &element.encode(&k))?;
    let v = gpu.upload("V", &element.encode(&v))?;
    let kv_lens: Vec<u32> = problem.kv_lens.iter().map(|&l| l as u32).collect();
    let key_offsets: Vec<u64> = (0..problem.batch())
        .map(|b| problem.key_offset(b))
        .collect();
    let (page_offsets, pages): (Vec<u32>, Vec<u32>) = match &table {
        Some(table) => {
            let offsets = table.pages.iter().scan(0u32, |at, p| {
                let here = *at;
                *at += p.len() as u32;
                Some(here)
            });
            (offsets.collect(), table.pages.concat())
        }
        None => (vec![0], vec![0]),
    };
    let kv_lens = gpu.upload("KV lengths", &kv_lens)?;
    let page_offsets = gpu.upload("page offsets", &page_offsets)?;
    let pages = gpu.upload("page table", &pages)?;
    let key_offsets = gpu.upload("key offsets", &key_offsets)?;
    let d = problem.head_dim;
    let group = problem.heads_q / problem.heads_kv;
    let group_rows = group * problem.queries;
    let items = (problem.batch() as u64 * problem.heads_kv)
        .checked_mul(splits * group_rows)
        .and_then(|items| items.checked_mul(d).map(|_| items))
        .ok_or_else(|| {
            PluginError::Params(format!(
                "splits: {splits} splits of {} sequences × {} KV heads × {group_rows} rows overflow the partials' size",
                problem.batch(),
                problem.heads_kv
            ))
        })?;
    let part_out = gpu.alloc::<f32>("split partial O", (items * d) as usize)?;
    let part_lse = gpu.alloc::<f32>("split partial LSE", items as usize)?;
    let rows = problem.heads_q * problem.rows();
    let out = gpu.alloc::<u8>("O", (rows * d) as usize * element.bytes())?;
    let lse = gpu.alloc::<f32>("LSE", rows as usize)?;
    let args = DecodeArgs {
        q: q.address(stream),
        k: k.address(stream),
        v: v.address(stream),
        part_out: part_out.address(stream),
        part_lse: part_lse.address(stream),
        out: out.address(stream),
        lse: lse.address(stream),
        kv_lens: kv_lens.address(stream),
        key_offsets: key_offsets.address(stream),
        page_offsets: page_offsets.address(stream),
        pages: pages.address(stream),
        batch: problem.batch() as u32,
        heads_kv: problem.heads_kv as u32,
        group: group as u32,
        queries: problem.queries as u32,
        splits: splits as u32,
        row_tiles: group_rows.div_ceil(16 * m_tiles(group_rows)) as u32,
        rows: problem.rows() as u32,
        page_size: problem.page_size.unwrap_or(0) as u32,
        keys: problem.keys(),
        scale_log2: std::f32::consts::LOG2_E / (d as f32).sqrt(),
        keys_after: 0,
    };
    Ok(Device {
        _buffers: vec![q, k, v],
        _index: vec![kv_lens, page_offsets, pages],
        _offsets: key_offsets,
        out,
        lse,
        _parts: (part_out, part_lse),
        args,
    })
}

/// The kernels' names for an element type and head dim (`decode_split_bf16_128`, …), or why
/// there are none.
pub(crate) fn variant(element: Element, head_dim: u64) -> Result<String, String> {
    match (element, head_dim) {
        (Element::Bf16 | Element::F16, 64 | 128) => Ok(format!("{element}_{head_dim}")),
        _ => Err(format!(
            "the decode kernel is compiled for bf16/fp16 at head_dim 64 and 128, not {element} at {head_dim}"
        )),
    }
}

/// The two kernels of one variant, found once before any launch (so the timed region holds
/// launches only), with the split kernel's shared memory.
pub(crate) struct Step {
    split: CudaFunction,
    merge: CudaFunction,
    shared_bytes: u32,
}

impl Step {
    /// `f32_out`: the merge that writes O in f32 (for a caller that merges further).
    pub(crate) fn find(
        kernels: &Kernels,
        name: &str,
        head_dim: u64,
        m_tiles: u64,
        f32_out: bool,
    ) -> Result<Step, PluginError> {
        let load = |function: String| {
            kernels
                .module
                .load_function(&function)
                .map_err(failed("the decode kernels"))
        };
        let shared_bytes = shared_bytes(head_dim, m_tiles) as u32;
        Ok(Step {
            split: allow_shared(
                load(format!("decode_split_{name}_m{m_tiles}"))?,
                shared_bytes,
            )?,
            merge: load(format!(
                "decode_merge_{}{name}",
                if f32_out { "f32_" } else { "" }
            ))?,
            shared_bytes,
        })
    }
}

/// One step: the split kernel (a block a [`WARPS`] splits), then the merge.
pub(crate) fn launch(gpu: &Gpu, step: &Step, args: &DecodeArgs) -> Result<(), PluginError> {
    let split_grid = LaunchConfig {
        grid_dim: (
            args.splits / WARPS as u32,
            args.heads_kv * args.row_tiles,
            args.batch,
        ),
        block_dim: (WARPS as u32 * 32, 1, 1),
        shared_mem_bytes: step.shared_bytes,
    };
    let merge_grid = LaunchConfig {
        grid_dim: (
            (args.group * args.queries).div_ceil(MERGE_ROWS),
            args.heads_kv,
            args.batch,
        ),
        block_dim: (MERGE_ROWS * 32, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut first = gpu.stream.launch_builder(&step.split);
    first.arg(args);
    // SAFETY: `args` holds live device buffers sized by `upload` for this grid.
    unsafe { first.launch(split_grid) }.map_err(failed("the decode split kernel"))?;
    let mut second = gpu.stream.launch_builder(&step.merge);
    second.arg(args);
    // SAFETY: as above; the merge reads what the split kernel wrote, in stream order.
    unsafe { second.launch(merge_grid) }.map_err(failed("the decode merge kernel"))?;
    Ok(())
}

/// Device-to-device copy bandwidth, bytes read plus written per second, over `bytes` (at least
/// twice the L2, so the copy runs from memory), the median repetition under `harness`.
fn copy_bandwidth(gpu: &mut Gpu, bytes: usize, harness: &Harness) -> Result<f64, PluginError> {
    let bytes = bytes.max(2 * gpu.l2_bytes());
    let source = gpu.alloc::<u8>("copy source", bytes)?;
    let mut target = gpu.alloc::<u8>("copy target", bytes)?;
    let timing = gpu.time(harness, |gpu| {
        gpu.stream
            .memcpy_dtod(&source.slice, &mut target.slice)
            .map_err(failed("device copy"))
    })?;
    let median = Quantiles::of(&timing.samples).map_or(f64::INFINITY, |q| q.p50);
    Ok(2.0 * bytes as f64 / median)
}

/// Runs `cuda/decode` on the worker's GPU.
pub fn run(gpu: &mut Gpu, kernels: &Kernels, request: &StageRequest) -> Result<Value, PluginError> {
    let p: DecodeParams = request.params()?;
    let problem = p.step.problem()?;
    let name = match variant(p.dtype, problem.head_dim) {
        Ok(name) => name,
        Err(reason) => {
            let result =
                json!({"kernel": "cuda-decode", "status": "unsupported", "reason": reason});
            write_json(&request.output_dir, "decode.json", &result)?;
            return Ok(result);
        }
    };
    let group_rows = problem.heads_q / problem.heads_kv * problem.queries;
    let tiles = m_tiles(group_rows);
    let (block_bytes, sm_bytes) = gpu.shared_memory();
    let needed = shared_bytes(problem.head_dim, tiles);
    if needed > block_bytes {
        let reason = format!(
            "the decode kernel's K/V ring needs {needed} bytes of shared memory a block at head_dim {} \
             with {group_rows} rows a KV head; this GPU allows {block_bytes} (Hopper: 232448)",
            problem.head_dim
        );
        let result = json!({"kernel": "cuda-decode", "status": "unsupported", "reason": reason});
        write_json(&request.output_dir, "decode.json", &result)?;
        return Ok(result);
    }
    let multiprocessors = gpu.describe().multiprocessors.unwrap_or(1).max(1) as u64;
    // More splits than 32-key tiles of the longest sequence (per warp) leave warps without keys.
    let longest = problem.kv_lens.iter().copied().max().unwrap_or(1);
    let most = WARPS * longest.div_ceil(TILE);
    let (splits, splits_reason) = match p.splits {
        0 => choose_splits(&problem, multiprocessors, sm_bytes),
        n if n % WARPS == 0 && n <= most => (n, "set by the pipeline".to_string()),
        n => {
            return Err(PluginError::Params(format!(
                "splits: {n} is not a multiple of {WARPS} up to {most} (each of a block's {WARPS} warps is \
                 one split, and a split needs at least one {TILE}-key tile of the longest sequence); \
                 give such a multiple, or 0 to let the stage choose"
            )))
        }
    };
    let grid_y = problem.heads_kv * group_rows.div_ceil(16 * tiles);
    if grid_y > 65535 || problem.batch() > 65535 {
        return Err(PluginError::Params(format!(
            "heads_kv, batch: the decode grid would be {grid_y} (KV heads × row tiles) × {} sequences \
             high and deep; CUDA allows at most 65535 × 65535",
            problem.batch()
        )));
    }
    if let Some(&long) = problem
        .kv_lens
        .iter()
        .find(|&&l| l > u64::from(u32::MAX >> 1))
    {
        return Err(PluginError::Params(format!(
            "kv_len: a sequence of {long} KV tokens is beyond the decode kernel's 31-bit token indices"
        )));
    }
    let step = Step::find(kernels, &name, problem.head_dim, tiles, false)?;
    let inputs = DecodeInputs::random(&problem, request.seed, p.dtype);
    let device = upload(gpu, &problem, &inputs, p.dtype, splits, request.seed)?;
    let correctness = if p.step.check == StepCheck::Off {
        unchecked()
    } else {
        launch(gpu, &step, &device.args)?;
        let out = p.dtype.decode(&gpu.download(&device.out)?);
        let lse = gpu.download(&device.lse)?;
        check_step(
            &problem,
            &inputs,
            (&out, Some(&lse)),
            p.step.check,
            p.dtype.tolerance(),
        )
    };
    let harness = p.step.harness.apply(Harness::gpu());
    let clocks_before = nvml::clocks();
    let timing = gpu.time(&harness, |gpu| launch(gpu, &step, &device.args))?;
    let clocks_after = nvml::clocks();
    let times = Quantiles::of(&timing.samples)
        .ok_or_else(|| PluginError::failed("no repetition was timed"))?;
    let bytes = problem.bytes(p.dtype.bytes() as u64);
    drop(device);
    let copy = copy_bandwidth(gpu, bytes as usize, &harness)?;
    let result = step_record(
        &problem,
        p.dtype.bytes() as u64,
        &times,
        copy,
        json!({
            "kernel": "cuda-decode",
            "status": "ok",
            "dtype": p.dtype,
            "splits": splits,
            "splits_reason": splits_reason,
            "copy_counted": "bytes read plus bytes written per second by a device-to-device copy of at least twice the L2",
            "correctness": correctness,
            "timing": timing,
            "harness": harness,
            "device": gpu.describe(),
            "clocks_before": clocks_before,
            "clocks_after": clocks_after,
        }),
    );
    write_json(&request.output_dir, "decode.json", &result)?;
    Ok(result)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Shared memory of a Hopper SM.
    const HOPPER: u64 = 228 * 1024;

    #[test]
    fn splits_fill_two_waves_with_no_split_under_the_shortest() {
        // 8 sequences × 8 KV heads, 8 rows a group: 64 blocks, one an SM at d 128 (213 KB of
        // shared memory), 3 blocks a sequence fill a wave: two waves, 6 blocks of 4 splits.
        let long = DecodeProblem::stepped(8, 64 * 1024, 1, (64, 8, 128), 0).unwrap();
        assert_eq!(choose_splits(&long, 132, HOPPER).0, 6 * WARPS);
        // 32 rows (4 new tokens) are one block of rows as well: the same 6 blocks.
        let four = DecodeProblem::stepped(8, 64 * 1024, 4, (64, 8, 128), 0).unwrap();
        assert_eq!(choose_splits(&four, 132, HOPPER).0, 6 * WARPS);
        // One 64K sequence: 17 blocks fill a wave, 34 two, splits of 482 keys.
        let alone = DecodeProblem::stepped(1, 64 * 1024, 4, (64, 8, 128), 0).unwrap();
        assert_eq!(choose_splits(&alone, 132, HOPPER).0, 34 * WARPS);
        // 16K keys allow 16 blocks of 256-key splits; two waves take 6.
        let short_four = DecodeProblem::stepped(8, 16 * 1024, 4, (64, 8, 128), 0).unwrap();
        assert_eq!(choose_splits(&short_four, 132, HOPPER).0, 6 * WARPS);
        // A 1K cache caps the count at one block: 4 splits of 256 keys.
        let short = DecodeProblem::stepped(1, 1024, 1, (64, 8, 128), 0).unwrap();
        assert_eq!(choose_splits(&short, 132, HOPPER).0, WARPS);
        // Two blocks an SM at d 64.
        assert_eq!(resident_blocks(64, 1, HOPPER), 2);
        assert_eq!(resident_blocks(128, 2, HOPPER), 1);
        // An A100's 164 KB an SM still holds one d-64 block.
        assert_eq!(resident_blocks(64, 1, 167_936), 1);
    }

    #[test]
    fn kernels_exist_for_16_bit_types_at_head_dims_64_and_128() {
        assert_eq!(variant(Element::Bf16, 128).unwrap(), "bf16_128");
        assert_eq!(variant(Element::F16, 64).unwrap(), "fp16_64");
        let refused = variant(Element::Bf16, 96).unwrap_err();
        assert!(
            refused.contains("head_dim 64 and 128") && refused.contains("96"),
            "{refused}"
        );
        assert!(variant(Element::F32, 128).is_err());
    }
}
