//! `cuda`: attention on NVIDIA GPUs through cudarc — CUDA C compiled by NVRTC for the device and
//! cuBLAS — timed with the GPU variant of the harness.
//!
//! Stages: `devices` (what `attnbench doctor` shows), `gemm` (a cuBLAS GEMM: the harness against
//! the machine's ceiling) and `benchmark` (attention kernels over any mask of the IR). On a
//! machine without a GPU the plugin loads, and its stages fail with one sentence.

mod gpu;
mod naive;
mod nvml;

use std::collections::HashMap;
use std::sync::Mutex;

use attnbench_sdk::measure::{
    Correctness, Harness, MeasureStatus, Measurement, Memory, Quantiles, Shape as MeasuredShape,
    Throughput,
};
use attnbench_sdk::reference::{self, relative_error, HeadMasks, Inputs, Shape};
use attnbench_sdk::{
    kinds, write_json, CacheScope, Host, Isolation, ParamSpec, ParamType, Plugin, PluginError,
    PluginManifest, StageRequest, StageSpec,
};
use cudarc::driver::CudaFunction;
use serde::Deserialize;
use serde_json::{json, Value};

use gpu::Gpu;
use naive::Precision;

struct Cuda;

/// The device and the compiled kernels, kept for the life of the worker process.
struct State {
    gpu: Gpu,
    kernels: HashMap<&'static str, CudaFunction>,
    nvml: Option<nvml::Nvml>,
}

impl State {
    /// Clocks and throttle reasons now, for the measurement's environment.
    fn clocks(&self) -> serde_json::Value {
        self.nvml
            .as_ref()
            .map(|n| n.sample())
            .unwrap_or(serde_json::Value::Null)
    }
}

static STATE: Mutex<Option<State>> = Mutex::new(None);

fn with_gpu<T>(work: impl FnOnce(&mut State) -> Result<T, PluginError>) -> Result<T, PluginError> {
    let mut guard = STATE
        .lock()
        .map_err(|_| PluginError::failed("the GPU state was poisoned by an earlier failure"))?;
    if guard.is_none() {
        *guard = Some(State {
            gpu: Gpu::open()?,
            kernels: HashMap::new(),
            nvml: nvml::Nvml::open(),
        });
    }
    work(guard.as_mut().expect("initialised above"))
}

fn choice(options: &[&str]) -> ParamType {
    ParamType::Enum(options.iter().map(|o| o.to_string()).collect())
}

/// The GPU harness's settings when a pipeline does not change them.
fn default_harness() -> Harness {
    Harness {
        timer: "CUDA events, L2 flushed (2× its size) before every repetition".into(),
        warmup_reps: 3,
        warmup_s: 0.1,
        min_reps: 10,
        max_reps: 200,
        max_time_s: 5.0,
        target_rel_ci: 0.01,
    }
}

impl Plugin for Cuda {
    fn manifest() -> PluginManifest {
        PluginManifest::new("cuda", env!("CARGO_PKG_VERSION"))
            .description("Attention on NVIDIA GPUs: NVRTC-compiled CUDA C and cuBLAS, with the GPU harness.")
            .stage(StageSpec::new("devices").doc("The GPUs, the driver and NVRTC versions.").isolation(Isolation::Worker).cache_scope(CacheScope::Machine))
            .stage(
                default_harness().declare(
                    StageSpec::new("gemm")
                        .doc("Times a cuBLAS GEMM (C = A·B, f32 accumulation): the practical ceiling for attention kernels.")
                        .param(ParamSpec::new("m", ParamType::Size).default("8k"))
                        .param(ParamSpec::new("n", ParamType::Size).default("8k"))
                        .param(ParamSpec::new("k", ParamType::Size).default("8k"))
                        .param(ParamSpec::new("dtype", choice(&["bf16", "f32"])).default("bf16")),
                )
                .output("gemm")
                .cache_scope(CacheScope::Machine)
                .isolation(Isolation::Worker)
                .exclusive(),
            )
            .stage(
                default_harness().declare(
                    StageSpec::new("benchmark")
                        .doc("Times one kernel on one mask (from a masks/generate node), checked against the reference first.")
                        .param(ParamSpec::new("kernel", choice(&["naive"])).default("naive").doc("`naive`: cuBLAS GEMMs around a masked softmax; S×S scores per head."))
                        .param(ParamSpec::new("direction", choice(&["fwd", "bwd", "fwd_bwd"])).default("fwd").doc("The naive GPU kernel has a forward pass only, for now."))
                        .param(ParamSpec::new("heads_q", ParamType::Int).default(64))
                        .param(ParamSpec::new("heads_kv", ParamType::Int).default(8))
                        .param(ParamSpec::new("head_dim", ParamType::Int).default(128))
                        .param(ParamSpec::new("dtype", choice(&["bf16", "f32", "fp16"])).default("bf16"))
                        .param(ParamSpec::new("outputs", ParamType::Bool).default(false).doc("Also write out.f32 and lse.f32."))
                        .param(ParamSpec::new("check_max_seqlen", ParamType::Size).default("2k").doc("Longest sequence checked against the CPU reference (f64) before timing.")),
                )
                .input(kinds::MASK)
                .output(kinds::MEASUREMENT)
                .cache_scope(CacheScope::Machine)
                .isolation(Isolation::Worker)
                .exclusive(),
            )
    }

    fn run(stage: &str, request: StageRequest, host: &Host) -> Result<Value, PluginError> {
        match stage {
            "devices" => with_gpu(|state| {
                let count = cudarc::driver::CudaContext::device_count().unwrap_or(0);
                Ok(
                    json!({"devices": count, "device0": state.gpu.describe(), "nvrtc": gpu::nvrtc_version()}),
                )
            }),
            "gemm" => gemm(&request),
            "benchmark" => benchmark(&request, host),
            other => Err(PluginError::UnknownStage {
                stage: other.into(),
                known: "devices, gemm, benchmark".into(),
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
    use cudarc::driver::DevicePtrMut;
    let p: GemmParams = request.params()?;
    let (kind, bytes) = if p.dtype == "bf16" {
        (cudaDataType::CUDA_R_16BF, 2)
    } else {
        (cudaDataType::CUDA_R_32F, 4)
    };
    let harness = p.harness.apply(default_harness());
    with_gpu(|state| {
        let clocks_before = state.clocks();
        let gpu = &mut state.gpu;
        let failed =
            |err: cudarc::driver::DriverError| PluginError::failed(format!("GEMM buffers: {err}"));
        // Random operands: zeros would let the chip run cooler and faster than any real workload.
        let random = |count: usize| -> Vec<u8> {
            let shape = Shape {
                heads_q: 1,
                heads_kv: 1,
                seqlen: count,
                head_dim: 1,
            };
            let values = Inputs::random(&shape, 11, p.dtype == "bf16").q;
            if p.dtype == "bf16" {
                values
                    .iter()
                    .flat_map(|v| ((v.to_bits() >> 16) as u16).to_le_bytes())
                    .collect()
            } else {
                values.iter().flat_map(|v| v.to_le_bytes()).collect()
            }
        };
        let mut a = gpu.stream.clone_htod(&random(p.m * p.k)).map_err(failed)?;
        let mut b = gpu.stream.clone_htod(&random(p.k * p.n)).map_err(failed)?;
        let mut c = gpu
            .stream
            .alloc_zeros::<u8>(p.m * p.n * bytes)
            .map_err(failed)?;
        let (pa, pb, pc) = {
            let address = |(pointer, _guard): (u64, cudarc::driver::SyncOnDrop<'_>)| pointer;
            (
                address(a.device_ptr_mut(&gpu.stream)),
                address(b.device_ptr_mut(&gpu.stream)),
                address(c.device_ptr_mut(&gpu.stream)),
            )
        };
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
        let clocks_after = state.clocks();
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

#[derive(Deserialize)]
struct BenchParams {
    kernel: String,
    direction: String,
    heads_q: usize,
    heads_kv: usize,
    head_dim: usize,
    dtype: String,
    outputs: bool,
    check_max_seqlen: usize,
    #[serde(flatten)]
    harness: attnbench_sdk::measure::HarnessParams,
}

/// Relative error allowed against the f64 reference: f32 accumulation, P rounded to the inputs'
/// precision before P·V.
fn tolerance(precision: Precision) -> f64 {
    match precision {
        Precision::F32 => 1e-4,
        Precision::Bf16 => 2e-2,
    }
}

fn benchmark(request: &StageRequest, host: &Host) -> Result<Value, PluginError> {
    let p: BenchParams = request.params()?;
    let set = request.mask_set()?;
    set.check_heads(p.heads_q as u64, p.heads_kv as u64, p.head_dim as u64)
        .map_err(PluginError::Params)?;
    let shape = Shape {
        heads_q: p.heads_q,
        heads_kv: p.heads_kv,
        seqlen: set.seqlen as usize,
        head_dim: p.head_dim,
    };
    let harness = p.harness.apply(default_harness());
    let measured_shape = MeasuredShape {
        batch: 1,
        heads_q: p.heads_q as u64,
        heads_kv: p.heads_kv as u64,
        head_dim: p.head_dim as u64,
        dtype: p.dtype.clone(),
    };
    let kernel = format!("cuda-{}", p.kernel);
    let plugin = ("cuda", env!("CARGO_PKG_VERSION"));
    let mut measurement = Measurement::for_kernel(
        &kernel,
        plugin,
        &set,
        measured_shape,
        &p.direction,
        harness.clone(),
    );
    let unsupported = |m: Measurement, reason: String| -> Result<Value, PluginError> {
        let m = m.unsupported(reason);
        write_json(&request.output_dir, Measurement::FILE, &m)?;
        serde_json::to_value(&m).map_err(|err| PluginError::failed(err.to_string()))
    };
    if p.direction != "fwd" {
        return unsupported(
            measurement,
            "the naive GPU kernel has no backward pass yet".into(),
        );
    }
    let precision = match p.dtype.as_str() {
        "bf16" => Precision::Bf16,
        "f32" => Precision::F32,
        other => {
            return unsupported(
                measurement,
                format!("the naive GPU kernel does not take {other} inputs (bf16 or f32)"),
            )
        }
    };
    with_gpu(|state| {
        for (key, value) in state
            .gpu
            .describe()
            .as_object()
            .cloned()
            .unwrap_or_default()
        {
            measurement.environment.insert(key, value);
        }
        let needed = naive::bytes_needed(&shape, precision);
        let free = state.gpu.free_bytes()?;
        if needed > free {
            measurement.status = MeasureStatus::Oom;
            measurement.reason = Some(format!(
                "needs {:.1} GiB on the device, {:.1} GiB are free",
                needed as f64 / (1u64 << 30) as f64,
                free as f64 / (1u64 << 30) as f64
            ));
            write_json(&request.output_dir, Measurement::FILE, &measurement)?;
            return serde_json::to_value(&measurement)
                .map_err(|err| PluginError::failed(err.to_string()));
        }
        let name: &'static str = if precision == Precision::Bf16 {
            "softmax_bf16"
        } else {
            "softmax_f32"
        };
        if !state.kernels.contains_key(name) {
            host.info("compiling the masked softmax with NVRTC");
            let function = naive::compile(&state.gpu, precision)?;
            state.kernels.insert(name, function);
        }
        let masks = HeadMasks::new(&set, &shape);
        let inputs = Inputs::random(&shape, request.seed, precision == Precision::Bf16);
        let mut problem = naive::Problem::upload(
            &state.gpu,
            &state.kernels[name],
            shape,
            precision,
            &masks,
            &inputs,
        )?;
        problem.forward(&state.gpu)?;
        let download = |slice: &cudarc::driver::CudaSlice<f32>| {
            state
                .gpu
                .stream
                .clone_dtoh(slice)
                .map_err(|err| PluginError::failed(format!("download: {err}")))
        };
        let (out, lse) = (download(&problem.out)?, download(&problem.lse)?);
        if p.outputs {
            reference::write_tensor(&request.output_dir, "out.f32", &out)?;
            reference::write_tensor(&request.output_dir, "lse.f32", &lse)?;
        }
        if shape.seqlen <= p.check_max_seqlen {
            let expected = reference::forward(&shape, &masks, &inputs);
            let mut errors = serde_json::Map::new();
            errors.insert("out".into(), json!(relative_error(&out, &expected.out)));
            errors.insert("lse".into(), json!(relative_error(&lse, &expected.lse)));
            let limit = tolerance(precision);
            let passed = errors
                .values()
                .all(|e| e.as_f64().is_some_and(|e| e <= limit));
            measurement.correctness = Some(Correctness {
                reference: "cpu reference (f64) on the same inputs".into(),
                checked: "O, LSE: every element".into(),
                errors,
                tolerance: limit,
                passed,
            });
        }
        measurement
            .environment
            .insert("clocks_before".into(), state.clocks());
        let timing = state.gpu.time(&harness, |gpu| problem.forward(gpu))?;
        measurement
            .environment
            .insert("clocks_after".into(), state.clocks());
        let times = Quantiles::of(&timing.samples);
        measurement.tflops = times.map(|t| Throughput::of(measurement.flops, &t));
        measurement.time_s = times;
        measurement.timing = Some(timing);
        let input_bytes = ((shape.q_len() + 2 * shape.kv_len())
            * if precision == Precision::Bf16 { 2 } else { 4 }) as u64;
        measurement.memory = Some(Memory {
            peak_bytes: needed as u64,
            above_inputs_bytes: needed as u64 - input_bytes,
            method: "sum of the device buffers the kernel allocates".into(),
        });
        write_json(&request.output_dir, Measurement::FILE, &measurement)?;
        serde_json::to_value(&measurement).map_err(|err| PluginError::failed(err.to_string()))
    })
}

attnbench_sdk::export_plugin!(Cuda);
