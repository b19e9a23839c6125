//! `cuda`: attention on NVIDIA GPUs through cudarc — CUDA C compiled by NVRTC for the device and
//! cuBLAS — timed with the GPU variant of the harness.
//!
//! Stages: `devices` (what `attnbench doctor` shows), `gemm` (a cuBLAS GEMM: the harness against
//! the machine's ceiling), `benchmark` (attention kernels over any mask of the IR) and `decode`
//! (a split-KV decode step). On a machine without a GPU the plugin loads, and its stages fail
//! with one sentence.

mod backend_check;
mod decode;
mod decode_backend;
mod decode_backend_check;
mod flash;
mod gpu;
mod kept;
mod kernel_bench;
mod naive;
mod nvrtc;

use std::sync::Mutex;

use attnbench_sdk::attention::{AttentionCall, AttentionError};
use attnbench_sdk::bench::{self, Cell, Options};
use attnbench_sdk::measure::{Direction, Harness, Quantiles, Throughput};
use attnbench_sdk::nvml;
use attnbench_sdk::reference::{Element, HeadMasks, Inputs, Shape};
use attnbench_sdk::{
    kinds, write_json, CacheScope, Host, Isolation, ParamSpec, ParamType, Plugin, PluginError,
    PluginManifest, StageRequest, StageSpec,
};
use serde::Deserialize;
use serde_json::{json, Value};

use gpu::Gpu;
use kernel_bench::CudaBench;

struct Cuda;

/// The device and the compiled kernels, kept for the life of the worker process.
struct State {
    gpu: Gpu,
    naive: Option<naive::Kernels>,
    flash: Option<flash::Kernels>,
    decode: Option<decode::Kernels>,
    /// The in-process `decode` backend's prepared call shapes.
    decode_shapes: decode_backend::Shapes,
}

static STATE: Mutex<Option<State>> = Mutex::new(None);

fn with_gpu<T>(work: impl FnOnce(&mut State) -> Result<T, PluginError>) -> Result<T, PluginError> {
    let mut guard = STATE
        .lock()
        .map_err(|_| PluginError::failed("the GPU state was poisoned by an earlier failure"))?;
    if guard.is_none() {
        *guard = Some(State {
            gpu: Gpu::open()?,
            naive: None,
            flash: None,
            decode: None,
            decode_shapes: decode_backend::Shapes::default(),
        });
    }
    work(guard.as_mut().expect("initialised above"))
}

fn default_harness() -> Harness {
    Harness::gpu()
}

impl Plugin for Cuda {
    fn manifest() -> PluginManifest {
        PluginManifest::new("cuda", env!("CARGO_PKG_VERSION"))
            .description("Attention on NVIDIA GPUs: NVRTC-compiled CUDA C and cuBLAS, with the GPU harness.")
            .stage(StageSpec::new("devices").doc("The GPUs, the driver and NVRTC versions.").isolation(Isolation::Worker).cache_scope(CacheScope::Machine).needs_gpu())
            .stage(
                default_harness().declare(
                    StageSpec::new("gemm")
                        .doc("Times a cuBLAS GEMM (C = A·B, f32 accumulation): the practical ceiling for attention kernels.")
                        .param(ParamSpec::new("m", ParamType::Size).default("8k"))
                        .param(ParamSpec::new("n", ParamType::Size).default("8k"))
                        .param(ParamSpec::new("k", ParamType::Size).default("8k"))
                        .param(ParamSpec::new("dtype", Element::param_type(&[Element::Bf16, Element::F32])).default("bf16")),
                )
                .output("gemm")
                .cache_scope(CacheScope::Machine)
                .isolation(Isolation::Worker)
                .exclusive()
                .needs_gpu()
                // A hung kernel or worker ends the node, not the run; `timeout:` in a pipeline overrides.
                .timeout_s(1800.0),
            )
            .stage(
                default_harness().declare(
                    StageSpec::new("benchmark")
                        .doc("Times one kernel on one mask (from a masks/generate node), checked against the reference first.")
                        .param(ParamSpec::new("kernel", ParamType::one_of(Kernel::NAMES)).default("naive").doc("`naive`: cuBLAS GEMMs around a masked softmax, S×S scores per head (the GPU reference). `flash`: tiled tensor-core kernel driven by the mask IR (forward and backward; bf16/fp16; head_dim 64, 96, 128, 192 or 256, wgmma at 128)."))
                        .param(ParamSpec::new("instructions", ParamType::one_of(flash::Instructions::NAMES)).default("auto").doc("`flash`'s tensor-core instructions: `mma` (mma.sync, any GPU from sm_80), `wgmma` (Hopper's warpgroup MMA reading its operands from shared memory, tiles loaded by TMA in warp-specialised kernels; head_dim 128; the forward, pipelined so each tile's softmax overlaps the previous tile's P·V; the split backward; the fused one where the masks' blocks keep 128-row tiles), or `auto`, wgmma where it runs. What ran is the record's `details.flash_forward` and `flash_backward`; chosen by name, it is also in the kernel's name (`cuda-flash-mma`, `cuda-flash-wgmma`)."))
                        .param(ParamSpec::new("schedule", ParamType::one_of(flash::Schedule::NAMES)).default("grid").doc("How `flash`'s wgmma forward hands out its query tiles: `grid`, a block per (query head, tile) in each mask's longest-first order; `persistent`, one block an SM walking the same order, launch and set-up paid once a block. Chosen `persistent`, it is in the kernel's name (`cuda-flash schedule=persistent`); other forwards take `grid` only."))
                        .param(ParamSpec::new("backward", ParamType::one_of(flash::Backward::NAMES)).default("split").doc("`flash`'s backward: `split` (deterministic) computes dK and dV per key tile and dQ per query tile in a second kernel, which recomputes S and dP; `fused` adds dQ from the key-tile kernel with atomics (two of seven products saved; the order of the sums, so the last bits, vary run to run). Recorded as kernel `cuda-flash-fused`; `details.flash_backward` says whether it ran on wgmma or mma.sync."))
                        .param(ParamSpec::new("direction", ParamType::one_of(Direction::NAMES)).default("fwd").doc("`bwd` is timed alone: the forward runs once, outside the timed region."))
                        .param(ParamSpec::new("heads_q", ParamType::Int).default(64))
                        .param(ParamSpec::new("heads_kv", ParamType::Int).default(8))
                        .param(ParamSpec::new("head_dim", ParamType::Int).default(128))
                        .param(attnbench_sdk::shapes::value_dim_param())
                        .param(attnbench_sdk::shapes::shape_param())
                        .param(ParamSpec::new("dtype", ParamType::one_of(Element::NAMES)).default("bf16"))
                        .param(ParamSpec::new("outputs", ParamType::Bool).default(false).doc("Also write out.f32 and lse.f32."))
                        .param(ParamSpec::new("check_max_seqlen", ParamType::Size).default("2k").doc("Longest sequence whose every output is checked against the f64 reference before timing; longer ones check 16 rows of every head against an independent per-row reference.")),
                )
                .measures_masks()
                .needs_gpu()
                // A hung kernel or worker ends the node, not the run; `timeout:` in a pipeline overrides.
                .timeout_s(1800.0),
            )
            .stage(
                StageSpec::new("backend-check")
                    .doc("Checks the in-process `flash` backend (what context-parallel plugins call) against the host's f64 block, forward and backward, on a zigzag shard's diagonal and off-diagonal blocks of a masks/generate node's mask.")
                    .param(ParamSpec::new("heads_q", ParamType::Int).default(8))
                    .param(ParamSpec::new("heads_kv", ParamType::Int).default(2))
                    .param(ParamSpec::new("head_dim", ParamType::Int).default(128))
                        .param(attnbench_sdk::shapes::shape_param())
                    .param(ParamSpec::new("dtype", Element::param_type(&[Element::Bf16, Element::F16])).default("bf16"))
                    .param(ParamSpec::new("block", ParamType::Size).default(256).doc("Rows (and keys) of each block: two chunks of half as many tokens."))
                    .input(kinds::MASK)
                    .isolation(Isolation::Worker)
                    .cache_scope(CacheScope::Machine),
            )
            .stage(
                StageSpec::new("decode-backend-check")
                    .doc("Checks the in-process `decode` backend (what cp/decode's GPU ranks call) against the host's f64 block on the blocks decoding across ranks makes of one sequence: its whole cache, an early shard, a middle one and a last one shorter than the new tokens.")
                    .param(ParamSpec::new("heads_q", ParamType::Int).default(16))
                    .param(ParamSpec::new("heads_kv", ParamType::Int).default(2))
                    .param(ParamSpec::new("head_dim", ParamType::Int).default(128))
                    .param(ParamSpec::new("dtype", Element::param_type(&[Element::Bf16, Element::F16])).default("bf16"))
                    .param(ParamSpec::new("queries", ParamType::Int).default(4).doc("New tokens of the sequence."))
                    .param(ParamSpec::new("kv_len", ParamType::Int).default(1000).doc("Keys of the sequence, the new tokens' included."))
                    .isolation(Isolation::Worker)
                    .needs_gpu()
                    .cache_scope(CacheScope::Machine),
            )
            .stage(decode::spec())
            .attention_kernel("flash")
            .attention_kernel("decode")
    }

    /// `flash`: one block of a context-parallel method on the caller's device pointers and
    /// stream (bf16/fp16 in, f32 out; see `flash::attend`). `decode`: one sequence's new tokens
    /// against a block of its cache (see `decode_backend`).
    fn attention(kernel: &str, call: &AttentionCall<'_>) -> Result<(), AttentionError> {
        match kernel {
            "flash" => {
                flash::accepts(call)?;
                // The GPU's own failures (no device, compilation) are the outer error; the call's the inner.
                with_gpu(|state| {
                    let kernels = match state.flash.take() {
                        Some(kernels) => kernels,
                        None => flash::compile(&state.gpu)?,
                    };
                    let result = flash::attend(&state.gpu, &kernels, call);
                    state.flash = Some(kernels);
                    Ok(result)
                })
                .map_err(|err| AttentionError::Failed(err.to_string()))?
            }
            "decode" => with_gpu(|state| {
                let kernels = match state.decode.take() {
                    Some(kernels) => kernels,
                    None => decode::compile(&state.gpu)?,
                };
                let result =
                    decode_backend::attend(&state.gpu, &kernels, &state.decode_shapes, call);
                state.decode = Some(kernels);
                Ok(result)
            })
            .map_err(|err| AttentionError::Failed(err.to_string()))?,
            other => Err(AttentionError::UnknownKernel {
                kernel: other.to_string(),
                offered: "the cuda plugin offers `flash` and `decode`".into(),
            }),
        }
    }

    fn run(stage: &str, request: StageRequest, host: &Host) -> Result<Value, PluginError> {
        if let Some(dir) = host.cache_dir() {
            // Compiled kernels outlive the worker in the host's cache. A GPU that does not open
            // here fails the stage below, with its reason.
            let _ = with_gpu(|state| {
                state.gpu.ptx_cache = Some(dir.join("nvrtc"));
                Ok(())
            });
        }
        match stage {
            "devices" => with_gpu(|state| {
                let count = cudarc::driver::CudaContext::device_count().unwrap_or(0);
                Ok(
                    json!({"devices": count, "device0": state.gpu.describe(), "nvrtc": gpu::nvrtc_version()}),
                )
            }),
            "gemm" => gemm(&request),
            "benchmark" => benchmark(&request, host),
            "backend-check" => backend_check::run(&request),
            "decode-backend-check" => decode_backend_check::run(&request),
            "decode" => with_gpu(|state| {
                let kernels = match state.decode.take() {
                    Some(kernels) => kernels,
                    None => decode::compile(&state.gpu)?,
                };
                let result = decode::run(&mut state.gpu, &kernels, &request);
                state.decode = Some(kernels);
                result
            }),
            other => Err(PluginError::UnknownStage {
                stage: other.into(),
                known: "devices, gemm, benchmark, backend-check, decode-backend-check, decode"
                    .into(),
            }),
        }
    }
}

#[derive(Deserialize)]
struct GemmParams {
    m: usize,
    n: usize,
    k: usize,
    dtype: String,
    #[serde(flatten)]
    harness: attnbench_sdk::measure::HarnessParams,
}

fn gemm(request: &StageRequest) -> Result<Value, PluginError> {
    use cudarc::cublas::sys::{
        cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType,
    };
    let p: GemmParams = request.params()?;
    let kind = if p.dtype == "bf16" {
        cudaDataType::CUDA_R_16BF
    } else {
        cudaDataType::CUDA_R_32F
    };
    let harness = p.harness.apply(default_harness());
    with_gpu(|state| {
        let clocks_before = nvml::clocks();
        let gpu = &mut state.gpu;
        let element = if p.dtype == "bf16" {
            Element::Bf16
        } else {
            Element::F32
        };
        // Random operands: zeros would let the chip run cooler and faster than any real workload.
        let random = |count: usize| -> Vec<u8> {
            let shape = Shape {
                heads_q: 1,
                heads_kv: 1,
                seqlen: count,
                head_dim: 1,
                head_dim_v: None,
            };
            element.encode(&Inputs::random_as(&shape, 11, element).q)
        };
        let a = gpu.upload("A", &random(p.m * p.k))?;
        let b = gpu.upload("B", &random(p.k * p.n))?;
        let c = gpu.alloc::<u8>("C", p.m * p.n * element.bytes())?;
        let (pa, pb, pc) = (
            a.address(&gpu.stream),
            b.address(&gpu.stream),
            c.address(&gpu.stream),
        );
        let (one, zero) = (1.0f32, 0.0f32);
        let timing = gpu.time(&harness, |gpu| {
            // SAFETY: a, b and c hold m×k, k×n and m×n elements of the type given.
            unsafe {
                cudarc::cublas::result::gemm_ex(
                    *gpu.blas.handle(),
                    cublasOperation_t::CUBLAS_OP_N,
                    cublasOperation_t::CUBLAS_OP_N,
                    p.m as i32,
                    p.n as i32,
                    p.k as i32,
                    &one as *const f32 as *const std::ffi::c_void,
                    pa as *const std::ffi::c_void,
                    kind,
                    p.m as i32,
                    pb as *const std::ffi::c_void,
                    kind,
                    p.k as i32,
                    &zero as *const f32 as *const std::ffi::c_void,
                    pc as *mut std::ffi::c_void,
                    kind,
                    p.m as i32,
                    cublasComputeType_t::CUBLAS_COMPUTE_32F,
                    cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                )
            }
            .map_err(|err| PluginError::failed(format!("cuBLAS GEMM: {err}")))
        })?;
        drop((a, b, c));
        let device = gpu.describe();
        let clocks_after = nvml::clocks();
        let flops = 2 * (p.m * p.n * p.k) as u64;
        let times = Quantiles::of(&timing.samples);
        let result = json!({
            "kernel": "cublas-gemm", "m": p.m, "n": p.n, "k": p.k, "dtype": p.dtype, "flops": flops,
            "time_s": times, "tflops": times.map(|t| Throughput::of(flops, &t)), "timing": timing,
            "harness": harness, "device": device, "clocks_before": clocks_before, "clocks_after": clocks_after,
        });
        write_json(&request.output_dir, "gemm.json", &result)?;
        Ok(result)
    })
}

attnbench_sdk::named_enum! {
    /// The cuda plugin's kernels.
    enum Kernel { Naive = "naive", Flash = "flash" }
}

#[derive(Deserialize)]
struct BenchParams {
    kernel: Kernel,
    check_max_seqlen: usize,
    backward: flash::Backward,
    instructions: flash::Instructions,
    schedule: flash::Schedule,
    #[serde(flatten)]
    common: attnbench_sdk::measure::KernelParams,
}

fn benchmark(request: &StageRequest, host: &Host) -> Result<Value, PluginError> {
    let p: BenchParams = request.params()?;
    let set = request.mask_set()?;
    set.check_heads(
        p.common.heads_q as u64,
        p.common.heads_kv as u64,
        p.common.head_dim as u64,
    )?;
    let harness = p.common.harness.apply(default_harness());
    let kernel = match (p.kernel, p.backward, p.instructions) {
        (Kernel::Flash, flash::Backward::Fused, _) => "cuda-flash-fused".to_string(),
        (Kernel::Flash, _, chosen @ (flash::Instructions::Mma | flash::Instructions::Wgmma)) => {
            format!("cuda-flash-{chosen}")
        }
        (name, _, _) => format!("cuda-{name}"),
    };
    let kernel = match p.schedule {
        flash::Schedule::Grid => kernel,
        chosen => format!("{kernel} schedule={chosen}"),
    };
    let cell = Cell::of(&p.common, &set, request.seed);
    let mut record = cell.record(
        &kernel,
        ("cuda", env!("CARGO_PKG_VERSION")),
        harness.clone(),
    );
    let options = Options::of(&p.common, &request.output_dir);
    with_gpu(|state| {
        record.gpu = Some(state.gpu.describe());
        let mut kernel = CudaBench::new(state, &p, HeadMasks::new(&set, &cell.shape), host);
        let mut measurement = bench::run(&mut kernel, &cell, &harness, record, options)?;
        if let Some(gpu) = measurement.gpu.as_mut() {
            (gpu.clocks_before, gpu.clocks_after) = std::mem::take(&mut kernel.clocks);
        }
        measurement.write(&request.output_dir)
    })
}

attnbench_sdk::export_plugin!(Cuda);
