//! The naive GPU kernel: per head, scores = scale·Q·Kᵀ with cuBLAS (f32), a masked softmax kernel
//! (CUDA C compiled by NVRTC for the device) that reads the mask's row intervals straight from the
//! IR and writes P and the LSE, then O = P·V with cuBLAS. It materialises S×S scores per head, so
//! it is the GPU's reference, not a fast kernel.

use std::ffi::c_void;
use std::sync::Arc;

use attnbench_sdk::reference::{HeadMasks, Inputs, Shape};
use attnbench_sdk::PluginError;
use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType};
use cudarc::driver::{
    CudaFunction, CudaSlice, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg,
};

use crate::gpu::Gpu;

/// CUDA C of the masked softmax, one block per row. P is written in the inputs' precision
/// (bf16 as raw bits, rounded to nearest even, or f32). Rows with no allowed key: P = 0, LSE = −∞.
const SOURCE: &str = r#"
__device__ __forceinline__ bool allowed(unsigned k, const unsigned* iv, unsigned n) {
    for (unsigned t = 0; t < n; ++t) { if (k >= iv[2 * t] && k < iv[2 * t + 1]) return true; }
    return false;
}
__device__ __forceinline__ unsigned short to_bf16(float x) {
    unsigned bits = __float_as_uint(x);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (unsigned short)(bits >> 16);
}
__device__ float block_reduce(float value, bool take_max) {
    __shared__ float shared[32];
    for (int offset = 16; offset > 0; offset >>= 1) {
        float other = __shfl_down_sync(0xffffffffu, value, offset);
        value = take_max ? fmaxf(value, other) : value + other;
    }
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) shared[warp] = value;
    __syncthreads();
    int warps = (blockDim.x + 31) >> 5;
    value = threadIdx.x < warps ? shared[threadIdx.x] : (take_max ? __int_as_float(0xff800000) : 0.0f);
    if (warp == 0) {
        for (int offset = 16; offset > 0; offset >>= 1) {
            float other = __shfl_down_sync(0xffffffffu, value, offset);
            value = take_max ? fmaxf(value, other) : value + other;
        }
    }
    if (threadIdx.x == 0) shared[0] = value;
    __syncthreads();
    float result = shared[0];
    __syncthreads();
    return result;
}
template <bool BF16>
__device__ void masked_softmax(const float* scores, void* probs, float* lse,
                               const unsigned* row_start, const unsigned* intervals, int s) {
    const int row = blockIdx.x;
    const float* line = scores + (size_t)row * s;
    const unsigned begin = row_start[row], count = row_start[row + 1] - begin;
    const unsigned* iv = intervals + 2 * begin;
    const float minus_inf = __int_as_float(0xff800000);
    float m = minus_inf;
    for (int k = threadIdx.x; k < s; k += blockDim.x) if (allowed(k, iv, count)) m = fmaxf(m, line[k]);
    m = block_reduce(m, true);
    float sum = 0.0f;
    if (m != minus_inf) for (int k = threadIdx.x; k < s; k += blockDim.x) if (allowed(k, iv, count)) sum += expf(line[k] - m);
    sum = block_reduce(sum, false);
    const float l = (m == minus_inf) ? minus_inf : m + logf(sum);
    for (int k = threadIdx.x; k < s; k += blockDim.x) {
        const float p = (m != minus_inf && allowed(k, iv, count)) ? expf(line[k] - l) : 0.0f;
        if (BF16) ((unsigned short*)probs)[(size_t)row * s + k] = to_bf16(p);
        else ((float*)probs)[(size_t)row * s + k] = p;
    }
    if (threadIdx.x == 0) lse[row] = l;
}
extern "C" __global__ void masked_softmax_bf16(const float* a, void* b, float* c, const unsigned* d, const unsigned* e, int s) { masked_softmax<true>(a, b, c, d, e, s); }
extern "C" __global__ void masked_softmax_f32(const float* a, void* b, float* c, const unsigned* d, const unsigned* e, int s) { masked_softmax<false>(a, b, c, d, e, s); }
"#;

/// Input precision on the device.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Precision {
    Bf16,
    F32,
}

impl Precision {
    fn bytes(self) -> usize {
        match self {
            Precision::Bf16 => 2,
            Precision::F32 => 4,
        }
    }

    fn cuda_type(self) -> cudaDataType {
        match self {
            Precision::Bf16 => cudaDataType::CUDA_R_16BF,
            Precision::F32 => cudaDataType::CUDA_R_32F,
        }
    }
}

/// Device copies of the inputs (as raw bytes in the chosen precision) and the kernel's buffers.
pub struct Problem {
    pub shape: Shape,
    precision: Precision,
    q: CudaSlice<u8>,
    k: CudaSlice<u8>,
    v: CudaSlice<u8>,
    scores: CudaSlice<f32>,
    probs: CudaSlice<u8>,
    pub out: CudaSlice<f32>,
    pub lse: CudaSlice<f32>,
    /// Per mask of the set: CSR row starts and (start, end) key intervals.
    rows: Vec<(CudaSlice<u32>, CudaSlice<u32>)>,
    mask_of_head: Vec<usize>,
    softmax: CudaFunction,
}

/// Bytes the naive kernel needs on the device.
pub fn bytes_needed(shape: &Shape, precision: Precision) -> usize {
    let s = shape.seqlen;
    let inputs = (shape.q_len() + 2 * shape.kv_len()) * precision.bytes();
    inputs + s * s * (4 + precision.bytes()) + shape.q_len() * 4 + shape.heads_q * s * 4
}

fn encode(values: &[f32], precision: Precision) -> Vec<u8> {
    match precision {
        Precision::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        // Inputs are already bf16 values: the top 16 bits are exact.
        Precision::Bf16 => values
            .iter()
            .flat_map(|v| ((v.to_bits() >> 16) as u16).to_le_bytes())
            .collect(),
    }
}

fn failed(what: &'static str) -> impl Fn(cudarc::driver::DriverError) -> PluginError {
    move |err| PluginError::failed(format!("{what}: {err}"))
}

impl Problem {
    pub fn upload(
        gpu: &Gpu,
        softmax: &CudaFunction,
        shape: Shape,
        precision: Precision,
        masks: &HeadMasks,
        inputs: &Inputs,
    ) -> Result<Problem, PluginError> {
        let s = shape.seqlen;
        let stream = &gpu.stream;
        let mut rows = Vec::new();
        for index in 0..masks.set.masks.len() {
            let mut starts = vec![0u32];
            let mut intervals = Vec::new();
            for row in masks.rows(index) {
                for (a, b) in row {
                    intervals.extend([a, b]);
                }
                starts.push((intervals.len() / 2) as u32);
            }
            intervals.extend([0, 0]);
            rows.push((
                stream.clone_htod(&starts).map_err(failed("upload mask"))?,
                stream
                    .clone_htod(&intervals)
                    .map_err(failed("upload mask"))?,
            ));
        }
        Ok(Problem {
            shape,
            precision,
            q: stream
                .clone_htod(&encode(&inputs.q, precision))
                .map_err(failed("upload Q"))?,
            k: stream
                .clone_htod(&encode(&inputs.k, precision))
                .map_err(failed("upload K"))?,
            v: stream
                .clone_htod(&encode(&inputs.v, precision))
                .map_err(failed("upload V"))?,
            scores: stream.alloc_zeros::<f32>(s * s).map_err(failed("scores"))?,
            probs: stream
                .alloc_zeros::<u8>(s * s * precision.bytes())
                .map_err(failed("probabilities"))?,
            out: stream
                .alloc_zeros::<f32>(shape.q_len())
                .map_err(failed("output"))?,
            lse: stream
                .alloc_zeros::<f32>(shape.heads_q * s)
                .map_err(failed("LSE"))?,
            rows,
            mask_of_head: masks.index_of_head.clone(),
            softmax: softmax.clone(),
        })
    }

    /// O and LSE of every head.
    pub fn forward(&mut self, gpu: &Gpu) -> Result<(), PluginError> {
        let (s, d) = (self.shape.seqlen as i32, self.shape.head_dim as i32);
        let element = self.precision.bytes() as u64;
        let stream = &gpu.stream;
        let handle = *gpu.blas.handle();
        let (scale, one, zero) = (self.shape.scale(), 1.0f32, 0.0f32);
        let kind = self.precision.cuda_type();
        // Raw addresses: one stream orders everything, so the guards can go at once.
        let address = |(pointer, _guard): (u64, cudarc::driver::SyncOnDrop<'_>)| pointer;
        let (q, k, v) = (
            address(self.q.device_ptr(stream)),
            address(self.k.device_ptr(stream)),
            address(self.v.device_ptr(stream)),
        );
        let scores = address(self.scores.device_ptr_mut(stream));
        let probs = address(self.probs.device_ptr_mut(stream));
        let out = address(self.out.device_ptr_mut(stream));
        let lse = address(self.lse.device_ptr_mut(stream));
        for h in 0..self.shape.heads_q {
            let kv = self.shape.kv_head(h);
            let head = (s * d) as u64 * element;
            // Row-major S = Q·Kᵀ is column-major Sᵀ = K·Qᵀ: (Kᵀ)ᵀ·Qᵀ with both stored d-major.
            // SAFETY: every pointer covers the extents cuBLAS reads and writes for these sizes.
            unsafe {
                cudarc::cublas::result::gemm_ex(
                    handle,
                    cublasOperation_t::CUBLAS_OP_T,
                    cublasOperation_t::CUBLAS_OP_N,
                    s,
                    s,
                    d,
                    &scale as *const f32 as *const c_void,
                    (k + kv as u64 * head) as *const c_void,
                    kind,
                    d,
                    (q + h as u64 * head) as *const c_void,
                    kind,
                    d,
                    &zero as *const f32 as *const c_void,
                    scores as *mut c_void,
                    cudaDataType::CUDA_R_32F,
                    s,
                    cublasComputeType_t::CUBLAS_COMPUTE_32F,
                    cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                )
                .map_err(|err| PluginError::failed(format!("cuBLAS Q·Kᵀ: {err}")))?;
            }
            let (row_start, intervals) = &self.rows[self.mask_of_head[h]];
            let head_lse = lse + (h * self.shape.seqlen * 4) as u64;
            let mut launch = stream.launch_builder(&self.softmax);
            launch
                .arg(&scores)
                .arg(&probs)
                .arg(&head_lse)
                .arg(row_start)
                .arg(intervals)
                .arg(&s);
            let config = LaunchConfig {
                grid_dim: (s as u32, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: the kernel reads s×s scores, writes s×s probabilities and s LSE values.
            unsafe { launch.launch(config) }.map_err(failed("masked softmax"))?;
            // Row-major O = P·V is column-major Oᵀ = Vᵀ·Pᵀ.
            // SAFETY: as above.
            unsafe {
                cudarc::cublas::result::gemm_ex(
                    handle,
                    cublasOperation_t::CUBLAS_OP_N,
                    cublasOperation_t::CUBLAS_OP_N,
                    d,
                    s,
                    s,
                    &one as *const f32 as *const c_void,
                    (v + kv as u64 * head) as *const c_void,
                    kind,
                    d,
                    probs as *const c_void,
                    kind,
                    s,
                    &zero as *const f32 as *const c_void,
                    (out + h as u64 * (s * d) as u64 * 4) as *mut c_void,
                    cudaDataType::CUDA_R_32F,
                    d,
                    cublasComputeType_t::CUBLAS_COMPUTE_32F,
                    cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                )
                .map_err(|err| PluginError::failed(format!("cuBLAS P·V: {err}")))?;
            }
        }
        Ok(())
    }
}

/// Compiles the softmax for this device (once per worker process).
pub fn compile(gpu: &Gpu, precision: Precision) -> Result<CudaFunction, PluginError> {
    let (major, minor) = gpu
        .ctx
        .compute_capability()
        .map_err(failed("compute capability"))?;
    let arch: &'static str = Box::leak(format!("sm_{major}{minor}").into_boxed_str());
    let ptx = cached_ptx(arch)?;
    let module: Arc<cudarc::driver::CudaModule> =
        gpu.ctx.load_module(ptx).map_err(failed("load module"))?;
    let name = match precision {
        Precision::Bf16 => "masked_softmax_bf16",
        Precision::F32 => "masked_softmax_f32",
    };
    module.load_function(name).map_err(failed("load function"))
}

/// PTX for `arch`, from the on-disk cache when this source, architecture and NVRTC version were
/// compiled before (`$ATTNBENCH_CACHE/nvrtc/<key>.ptx`), else compiled and stored.
fn cached_ptx(arch: &'static str) -> Result<cudarc::nvrtc::Ptx, PluginError> {
    let key = blake3::hash(format!("{SOURCE}\n{arch}\n{}", crate::gpu::nvrtc_version()).as_bytes())
        .to_hex();
    let root = std::env::var_os("ATTNBENCH_CACHE")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| "artifacts".into());
    let path = root.join("nvrtc").join(format!("{key}.ptx"));
    if let Ok(text) = std::fs::read_to_string(&path) {
        return Ok(cudarc::nvrtc::Ptx::from_src(text));
    }
    let options = cudarc::nvrtc::CompileOptions {
        arch: Some(arch),
        ..Default::default()
    };
    let ptx = cudarc::nvrtc::compile_ptx_with_opts(SOURCE, options).map_err(|err| {
        PluginError::failed(format!(
            "NVRTC could not compile the softmax for {arch}: {err}"
        ))
    })?;
    if let Some(dir) = path.parent() {
        // A cache that cannot be written only costs a compile next time.
        let _ = std::fs::create_dir_all(dir).and_then(|_| {
            let partial = path.with_extension("partial");
            std::fs::write(&partial, ptx.to_src()).and_then(|_| std::fs::rename(&partial, &path))
        });
    }
    Ok(ptx)
}
