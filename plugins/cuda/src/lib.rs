//! `cuda`: attention on NVIDIA GPUs through cudarc — CUDA C compiled by NVRTC for the device and
//! cuBLAS — timed with the GPU variant of the harness.
//!
//! Stages: `devices` (what `attnbench doctor` shows), `gemm` (a cuBLAS GEMM: the harness against
//! the machine's ceiling) and `benchmark` (attention kernels over any mask of the IR). On a
//! machine without a GPU the plugin loads, and its stages fail with one sentence.

mod backend_check;
mod flash;
mod gpu;
mod naive;

use std::sync::Mutex;

use attnbench_sdk::attention::AttentionCall;
use attnbench_sdk::measure::{
    Direction, Harness, MeasureStatus, Measurement, Memory, Quantiles, Throughput,
};
use attnbench_sdk::nvml;
use attnbench_sdk::reference::{
    self, CheckMode, Element, Forward, Grads, HeadMasks, Inputs, Shape,
};
use attnbench_sdk::{
    kinds, write_json, CacheScope, Host, Isolation, ParamSpec, ParamType, Plugin, PluginError,
    PluginManifest, StageRequest, StageSpec,
};
use serde::Deserialize;
use serde_json::{json, Value};

use gpu::Gpu;

struct Cuda;

/// The device and the compiled kernels, kept for the life of the worker process.
struct State {
    gpu: Gpu,
    naive: Option<naive::Kernels>,
    flash: Option<flash::Kernels>,
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
                        .param(ParamSpec::new("kernel", ParamType::one_of(Kernel::NAMES)).default("naive").doc("`naive`: cuBLAS GEMMs around a masked softmax, S×S scores per head (the GPU reference). `flash`: tiled tensor-core kernel driven by the mask IR (forward and backward; bf16/fp16; head_dim 64 or 128)."))
                        .param(ParamSpec::new("instructions", ParamType::one_of(flash::Instructions::NAMES)).default("auto").doc("`flash`'s tensor-core instructions: `mma` (mma.sync, any GPU from sm_80), `wgmma` (Hopper's warpgroup MMA reading its operands from shared memory, tiles loaded by TMA in warp-specialised kernels; head_dim 128; the forward, pipelined so each tile's softmax overlaps the previous tile's P·V; the split backward; the fused one where the masks' blocks keep 128-row tiles), or `auto`, wgmma where it runs. What ran is the record's `details.flash_forward` and `flash_backward`; chosen by name, it is also in the kernel's name (`cuda-flash-mma`, `cuda-flash-wgmma`)."))
                        .param(ParamSpec::new("backward", ParamType::one_of(flash::Backward::NAMES)).default("split").doc("`flash`'s backward: `split` (deterministic) computes dK and dV per key tile and dQ per query tile in a second kernel, which recomputes S and dP; `fused` adds dQ from the key-tile kernel with atomics (two of seven products saved; the order of the sums, so the last bits, vary run to run). Recorded as kernel `cuda-flash-fused`; `details.flash_backward` says whether it ran on wgmma or mma.sync."))
                        .param(ParamSpec::new("direction", ParamType::one_of(Direction::NAMES)).default("fwd").doc("`bwd` is timed alone: the forward runs once, outside the timed region."))
                        .param(ParamSpec::new("heads_q", ParamType::Int).default(64))
                        .param(ParamSpec::new("heads_kv", ParamType::Int).default(8))
                        .param(ParamSpec::new("head_dim", ParamType::Int).default(128))
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
                    .param(ParamSpec::new("dtype", Element::param_type(&[Element::Bf16, Element::F16])).default("bf16"))
                    .param(ParamSpec::new("block", ParamType::Size).default(256).doc("Rows (and keys) of each block: two chunks of half as many tokens."))
                    .input(kinds::MASK)
                    .isolation(Isolation::Worker)
                    .cache_scope(CacheScope::Machine),
            )
            .attention_kernel("flash")
    }

    /// `flash`: one block of a context-parallel method on the caller's device pointers and
    /// stream (bf16/fp16 in, f32 out; see `flash::attend`).
    fn attention(kernel: &str, call: &AttentionCall<'_>) -> Result<(), String> {
        if kernel != "flash" {
            return Err(format!(
                "no in-process attention kernel `{kernel}`; the cuda plugin offers `flash`"
            ));
        }
        flash::accepts(call)?;
        with_gpu(|state| {
            let kernels = match state.flash.take() {
                Some(kernels) => kernels,
                None => flash::compile(&state.gpu)?,
            };
            let result = flash::attend(&state.gpu, &kernels, call);
            state.flash = Some(kernels);
            result.map_err(PluginError::Failed)
        })
        .map_err(|err| err.to_string())
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
            other => Err(PluginError::UnknownStage {
                stage: other.into(),
                known: "devices, gemm, benchmark, backend-check".into(),
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
    #[serde(flatten)]
    common: attnbench_sdk::measure::KernelParams,
}

fn gib(bytes: usize) -> f64 {
    bytes as f64 / (1u64 << 30) as f64
}

fn benchmark(request: &StageRequest, host: &Host) -> Result<Value, PluginError> {
    let p: BenchParams = request.params()?;
    let set = request.mask_set()?;
    set.check_heads(
        p.common.heads_q as u64,
        p.common.heads_kv as u64,
        p.common.head_dim as u64,
    )
    .map_err(PluginError::Params)?;
    let shape = p.common.shape(set.seqlen as usize);
    let element = p.common.dtype;
    let harness = p.common.harness.apply(default_harness());
    let measured_shape = p.common.measured_shape();
    let kernel = match (p.kernel, p.backward, p.instructions) {
        (Kernel::Flash, flash::Backward::Fused, _) => "cuda-flash-fused".to_string(),
        (Kernel::Flash, _, chosen @ (flash::Instructions::Mma | flash::Instructions::Wgmma)) => {
            format!("cuda-flash-{chosen}")
        }
        (name, _, _) => format!("cuda-{name}"),
    };
    let plugin = ("cuda", env!("CARGO_PKG_VERSION"));
    let mut measurement = Measurement::for_kernel(
        &kernel,
        plugin,
        &set,
        measured_shape,
        p.common.direction,
        harness.clone(),
    );
    let backward = p.common.backward();
    with_gpu(|state| {
        measurement.gpu = Some(state.gpu.describe());
        let flash = p.kernel == Kernel::Flash;
        if let Some(reason) = flash.then(|| flash::unsupported(&shape, element)).flatten() {
            return measurement.unsupported(reason).write(&request.output_dir);
        }
        let needed = if flash {
            flash::bytes_needed(&shape, element, backward)
        } else {
            naive::bytes_needed(&shape, element, backward)
        };
        let free = state.gpu.free_bytes()?;
        let out_of_memory = |mut m: Measurement, reason: String| {
            m.status = MeasureStatus::Oom;
            m.reason = Some(reason);
            m.write(&request.output_dir)
        };
        if needed > free {
            return out_of_memory(
                measurement,
                format!(
                    "needs {:.1} GiB on the device, {:.1} GiB are free",
                    gib(needed),
                    gib(free)
                ),
            );
        }
        if flash && state.flash.is_none() {
            host.info("compiling the flash kernel with NVRTC");
            state.flash = Some(flash::compile(&state.gpu)?);
        }
        if !flash && state.naive.is_none() {
            host.info("compiling the naive kernel's row kernels with NVRTC");
            state.naive = Some(naive::compile(&state.gpu)?);
        }
        // Where a cell's time goes besides its repetitions, as the Python plugin reports it.
        let mut phases = serde_json::Map::new();
        let mut clock = std::time::Instant::now();
        let mut lap = |phases: &mut serde_json::Map<String, Value>, name: &str| {
            phases.insert(name.into(), json!(clock.elapsed().as_secs_f64()));
            clock = std::time::Instant::now();
        };
        let masks = HeadMasks::new(&set, &shape);
        let inputs = Inputs::random_as(&shape, request.seed, element);
        lap(&mut phases, "inputs_s");
        let gpu = &state.gpu;
        let base = gpu.memory.current();
        gpu.memory.reset_peak();
        let uploaded = match (&state.flash, &state.naive) {
            (Some(kernels), _) if flash => flash::Problem::upload(
                gpu, kernels, shape, element, &masks, &inputs, backward,
            )
            .map(|mut problem| {
                problem.backward = p.backward;
                problem.instructions = p.instructions;
                Problem::Flash(Box::new(problem))
            }),
            (_, Some(kernels)) => {
                naive::Problem::upload(gpu, kernels, shape, element, &masks, &inputs, backward)
                    .map(|problem| Problem::Naive(Box::new(problem)))
            }
            _ => unreachable!("the kernel was compiled above"),
        };
        let mut problem = match uploaded {
            Err(PluginError::OutOfMemory(message)) => return out_of_memory(measurement, message),
            other => other?,
        };
        if let Problem::Flash(flash) = &problem {
            match flash.instructions_used() {
                Ok((forward, backward)) => {
                    let details = &mut measurement.details;
                    details.insert("flash_forward".into(), forward.into());
                    if let Some(backward) = backward {
                        details.insert("flash_backward".into(), backward.into());
                    }
                }
                Err(PluginError::Failed(reason)) => {
                    return measurement.unsupported(reason).write(&request.output_dir)
                }
                Err(other) => return Err(other),
            }
        }
        lap(&mut phases, "upload_s");
        problem.forward(gpu)?;
        if backward {
            problem.backward(gpu)?;
        }
        let forward = problem.outputs(gpu)?;
        let grads = problem.grads(gpu)?;
        lap(&mut phases, "first_run_s");
        if p.common.outputs {
            reference::write_outputs(&request.output_dir, &forward, grads.as_ref())?;
        }
        let mode = if shape.seqlen <= p.check_max_seqlen {
            CheckMode::Full
        } else {
            CheckMode::Sampled { rows: 16 }
        };
        host.debug("checking the outputs against the reference");
        measurement.correctness = Some(reference::check(
            &shape,
            &masks,
            &inputs,
            &forward,
            grads.as_ref(),
            mode,
            element.tolerance(),
        ));
        drop((forward, grads, inputs));
        lap(&mut phases, "check_s");
        if let Some(gpu) = measurement.gpu.as_mut() {
            gpu.clocks_before = nvml::clocks();
        }
        let gpu = &mut state.gpu;
        let timing = match p.common.direction {
            Direction::Fwd => gpu.time(&harness, |gpu| problem.forward(gpu))?,
            Direction::Bwd => gpu.time(&harness, |gpu| problem.backward(gpu))?,
            Direction::FwdBwd => gpu.time(&harness, |gpu| {
                problem.forward(gpu)?;
                problem.backward(gpu)
            })?,
        };
        let peak = gpu.memory.peak() - base;
        drop(problem);
        lap(&mut phases, "timing_s");
        measurement.phases = phases;
        if let Some(gpu) = measurement.gpu.as_mut() {
            gpu.clocks_after = nvml::clocks();
        }
        let times = Quantiles::of(&timing.samples);
        measurement.tflops = times.map(|t| Throughput::of(measurement.flops, &t));
        measurement.time_s = times;
        measurement.timing = Some(timing);
        let inputs_bytes =
            (shape.q_len() * if backward { 2 } else { 1 } + 2 * shape.kv_len()) * element.bytes();
        measurement.memory = Some(Memory {
            peak_bytes: peak as u64,
            above_inputs_bytes: peak.saturating_sub(inputs_bytes) as u64,
            method: "the plugin's tracking allocator: the most device memory the kernel's buffers held at once (cuBLAS's own workspace not included)".into(),
        });
        measurement.write(&request.output_dir)
    })
}

/// One kernel's device problem.
enum Problem {
    Naive(Box<naive::Problem>),
    Flash(Box<flash::Problem>),
}

impl Problem {
    fn forward(&self, gpu: &Gpu) -> Result<(), PluginError> {
        match self {
            Problem::Naive(p) => p.forward(gpu),
            Problem::Flash(p) => p.forward(gpu),
        }
    }

    fn backward(&mut self, gpu: &Gpu) -> Result<(), PluginError> {
        match self {
            Problem::Naive(p) => p.backward(gpu),
            Problem::Flash(p) => p.backward(gpu),
        }
    }

    fn outputs(&self, gpu: &Gpu) -> Result<Forward, PluginError> {
        let (out, lse) = match self {
            Problem::Naive(p) => (&p.out, &p.lse),
            Problem::Flash(p) => (&p.out, &p.lse),
        };
        Ok(Forward {
            out: gpu.download(out)?,
            lse: gpu.download(lse)?,
        })
    }

    fn grads(&self, gpu: &Gpu) -> Result<Option<Grads>, PluginError> {
        match self {
            Problem::Naive(p) => p.grads(gpu),
            Problem::Flash(p) => p.grads(gpu),
        }
    }
}

attnbench_sdk::export_plugin!(Cuda);
