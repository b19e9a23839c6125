//! The naive GPU kernel: per head, scores = scale·Q·Kᵀ with cuBLAS (f32), a masked softmax kernel
//! (CUDA C compiled by NVRTC for the device) that reads the mask's row intervals straight from the
//! IR and writes P and the LSE, then O = P·V with cuBLAS. The backward pass recomputes P per head
//! (S² scratch per head rather than per problem), then dV += Pᵀ·dO, dP = dO·Vᵀ, dS = P∘(dP − D)
//! with D = Σ P∘dP per row (a second kernel), dQ = dS·K, dK += dSᵀ·Q; GQA groups accumulate into
//! their KV head. It materialises S×S scores per head, so it is the GPU's reference, not a fast
//! kernel.

use std::ffi::c_void;
use std::sync::Arc;

use attnbench_sdk::reference::{Element, Grads, HeadMasks, Inputs, Shape};
use attnbench_sdk::PluginError;
use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType};
use cudarc::driver::{CudaFunction, CudaModule, LaunchConfig, PushKernelArg};

use crate::gpu::{failed, Buffer, Gpu};
use crate::nvrtc::CudaSource;

/// CUDA C of the two row kernels, one block per row, for each element type (0 = f32, 1 = bf16,
/// 2 = fp16; probabilities and dS are written in the inputs' type). Rows with no allowed key:
/// P = 0, LSE = −∞, dS = 0.
pub(crate) const SOURCE: CudaSource =
    CudaSource::single("naive_rows.cu", include_str!("../kernels/naive_rows.cu"));

fn cuda_type(element: Element) -> cudaDataType {
    match element {
        Element::F32 => cudaDataType::CUDA_R_32F,
        Element::Bf16 => cudaDataType::CUDA_R_16BF,
        Element::F16 => cudaDataType::CUDA_R_16F,
    }
}

fn suffix(element: Element) -> &'static str {
    match element {
        Element::F32 => "f32",
        Element::Bf16 => "bf16",
        Element::F16 => "f16",
    }
}

/// The compiled row kernels of one device.
pub struct Kernels {
    module: Arc<CudaModule>,
}

impl Kernels {
    fn function(&self, name: &str, element: Element) -> Result<CudaFunction, PluginError> {
        self.module
            .load_function(&format!("{name}_{}", suffix(element)))
            .map_err(failed("load function"))
    }
}

/// Bytes the naive kernel needs on the device for one direction.
pub fn bytes_needed(shape: &Shape, element: Element, backward: bool) -> usize {
    let (s, e) = (shape.seqlen, element.bytes());
    let inputs = (shape.q_len() + 2 * shape.kv_len()) * e;
    let forward = s * s * (4 + e) + shape.q_len() * 4 + shape.heads_q * s * 4;
    if !backward {
        return inputs + forward;
    }
    // dO, the S×S dP, and f32 dQ, dK, dV.
    inputs + forward + shape.q_len() * e + s * s * 4 + (shape.q_len() + 2 * shape.kv_len()) * 4
}

/// Row-major attention matrices in cuBLAS's column-major terms: a row-major r×c matrix is a
/// column-major c×r one with leading dimension c. Every product accumulates in f32 into f32.
struct Gemm {
    handle: cudarc::cublas::sys::cublasHandle_t,
    kind: cudaDataType,
}

impl Gemm {
    /// C (m×n, column-major, f32) = alpha·op(A)·op(B) + beta·C.
    #[allow(clippy::too_many_arguments)]
    fn run(
        &self,
        what: &str,
        (transpose_a, transpose_b): (bool, bool),
        (m, n, k): (usize, usize, usize),
        alpha: f32,
        (a, lda): (u64, usize),
        (b, ldb): (u64, usize),
        beta: f32,
        (c, ldc): (u64, usize),
        b_kind: Option<cudaDataType>,
    ) -> Result<(), PluginError> {
        let op = |t| {
            if t {
                cublasOperation_t::CUBLAS_OP_T
            } else {
                cublasOperation_t::CUBLAS_OP_N
            }
        };
        // SAFETY: callers pass addresses of device buffers covering these extents.
        unsafe {
            cudarc::cublas::result::gemm_ex(
                self.handle,
                op(transpose_a),
                op(transpose_b),
                m as i32,
                n as i32,
                k as i32,
                &alpha as *const f32 as *const c_void,
                a as *const c_void,
                self.kind,
                lda as i32,
                b as *const c_void,
                b_kind.unwrap_or(self.kind),
                ldb as i32,
                &beta as *const f32 as *const c_void,
                c as *mut c_void,
                cudaDataType::CUDA_R_32F,
                ldc as i32,
                cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|err| PluginError::failed(format!("cuBLAS {what}: {err}")))
    }
}

/// Device copies of the inputs (raw bytes in the inputs' type) and the kernel's buffers.
pub struct Problem {
    pub shape: Shape,
    element: Element,
    q: Buffer<u8>,
    k: Buffer<u8>,
    v: Buffer<u8>,
    scores: Buffer<f32>,
    probs: Buffer<u8>,
    pub out: Buffer<f32>,
    pub lse: Buffer<f32>,
    /// Per mask of the set: CSR row starts and (start, end) key intervals.
    rows: Vec<(Buffer<u32>, Buffer<u32>)>,
    mask_of_head: Vec<usize>,
    softmax: CudaFunction,
    grad: Option<Backward>,
}

/// What only the backward pass needs.
struct Backward {
    d_out: Buffer<u8>,
    dp: Buffer<f32>,
    pub dq: Buffer<f32>,
    pub dk: Buffer<f32>,
    pub dv: Buffer<f32>,
    softmax_grad: CudaFunction,
}

impl Problem {
    #[allow(clippy::too_many_arguments)]
    pub fn upload(
        gpu: &Gpu,
        kernels: &Kernels,
        shape: Shape,
        element: Element,
        masks: &HeadMasks,
        inputs: &Inputs,
        backward: bool,
    ) -> Result<Problem, PluginError> {
        let s = shape.seqlen;
        let mut rows = Vec::new();
        for index in 0..masks.set.masks.len() {
            let mut table = masks.row_intervals(index);
            table.intervals.extend([0, 0]); // never an empty buffer
            rows.push((
                gpu.upload("mask rows", &table.row_start)?,
                gpu.upload("mask intervals", &table.intervals)?,
            ));
        }
        let grad = if backward {
            Some(Backward {
                d_out: gpu.upload("dO", &element.encode(&inputs.d_out))?,
                dp: gpu.alloc("dP", s * s)?,
                dq: gpu.alloc("dQ", shape.q_len())?,
                dk: gpu.alloc("dK", shape.kv_len())?,
                dv: gpu.alloc("dV", shape.kv_len())?,
                softmax_grad: kernels.function("softmax_grad", element)?,
            })
        } else {
            None
        };
        Ok(Problem {
            shape,
            element,
            q: gpu.upload("Q", &element.encode(&inputs.q))?,
            k: gpu.upload("K", &element.encode(&inputs.k))?,
            v: gpu.upload("V", &element.encode(&inputs.v))?,
            scores: gpu.alloc("scores", s * s)?,
            probs: gpu.alloc("probabilities", s * s * element.bytes())?,
            out: gpu.alloc("O", shape.q_len())?,
            lse: gpu.alloc("LSE", shape.heads_q * s)?,
            rows,
            mask_of_head: masks.index_of_head.clone(),
            softmax: kernels.function("masked_softmax", element)?,
            grad,
        })
    }

    fn gemm(&self, gpu: &Gpu) -> Gemm {
        Gemm {
            handle: *gpu.blas.handle(),
            kind: cuda_type(self.element),
        }
    }

    /// Bytes of one head's Q (or K, V) block in the inputs' type.
    fn head_bytes(&self) -> u64 {
        (self.shape.seqlen * self.shape.head_dim * self.element.bytes()) as u64
    }

    fn launch_config(&self) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (self.shape.seqlen as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    /// Scores and probabilities of head `h` (and its LSE row).
    fn probabilities(&self, gpu: &Gpu, h: usize) -> Result<(), PluginError> {
        let (s, d) = (self.shape.seqlen, self.shape.head_dim);
        let stream = &gpu.stream;
        let kv = self.shape.kv_head(h) as u64;
        let (q, k) = (self.q.address(stream), self.k.address(stream));
        let scores = self.scores.address(stream);
        // Row-major S = Q·Kᵀ is column-major Sᵀ = (Kᵀ)ᵀ·Qᵀ with both stored d-major.
        self.gemm(gpu).run(
            "Q·Kᵀ",
            (true, false),
            (s, s, d),
            self.shape.scale(),
            (k + kv * self.head_bytes(), d),
            (q + h as u64 * self.head_bytes(), d),
            0.0,
            (scores, s),
            None,
        )?;
        let (row_start, intervals) = &self.rows[self.mask_of_head[h]];
        let (row_start, intervals) = (row_start.address(stream), intervals.address(stream));
        let probs = self.probs.address(stream);
        let head_lse = self.lse.address(stream) + (h * s * 4) as u64;
        let s32 = s as i32;
        let mut launch = stream.launch_builder(&self.softmax);
        launch
            .arg(&scores)
            .arg(&probs)
            .arg(&head_lse)
            .arg(&row_start)
            .arg(&intervals)
            .arg(&s32);
        // SAFETY: the kernel reads s×s scores, writes s×s probabilities and s LSE values.
        unsafe { launch.launch(self.launch_config()) }.map_err(failed("masked softmax"))?;
        Ok(())
    }

    /// O and LSE of every head.
    pub fn forward(&self, gpu: &Gpu) -> Result<(), PluginError> {
        let (s, d) = (self.shape.seqlen, self.shape.head_dim);
        let stream = &gpu.stream;
        let (v, probs, out) = (
            self.v.address(stream),
            self.probs.address(stream),
            self.out.address(stream),
        );
        for h in 0..self.shape.heads_q {
            self.probabilities(gpu, h)?;
            let kv = self.shape.kv_head(h) as u64;
            // Row-major O = P·V is column-major Oᵀ = Vᵀ·Pᵀ.
            self.gemm(gpu).run(
                "P·V",
                (false, false),
                (d, s, s),
                1.0,
                (v + kv * self.head_bytes(), d),
                (probs, s),
                0.0,
                (out + (h * s * d * 4) as u64, d),
                None,
            )?;
        }
        Ok(())
    }

    /// dQ, dK and dV of every head (P recomputed per head).
    pub fn backward(&mut self, gpu: &Gpu) -> Result<(), PluginError> {
        let stream = &gpu.stream;
        let Some(grad) = self.grad.as_mut() else {
            return Err(PluginError::failed(
                "the problem was uploaded without backward buffers",
            ));
        };
        // dK and dV accumulate over the heads of a group.
        for buffer in [&mut grad.dk, &mut grad.dv] {
            stream
                .memset_zeros(&mut buffer.slice)
                .map_err(failed("zero gradients"))?;
        }
        let grad = self.grad.as_ref().expect("checked above");
        let (s, d) = (self.shape.seqlen, self.shape.head_dim);
        let gemm = self.gemm(gpu);
        let head = self.head_bytes();
        let (q, k, v) = (
            self.q.address(stream),
            self.k.address(stream),
            self.v.address(stream),
        );
        let (d_out, dp, probs, scores) = (
            grad.d_out.address(stream),
            grad.dp.address(stream),
            self.probs.address(stream),
            self.scores.address(stream),
        );
        let (dq, dk, dv) = (
            grad.dq.address(stream),
            grad.dk.address(stream),
            grad.dv.address(stream),
        );
        let f32_head = (s * d * 4) as u64;
        for h in 0..self.shape.heads_q {
            self.probabilities(gpu, h)?;
            let kv = self.shape.kv_head(h) as u64;
            let d_out_h = d_out + h as u64 * head;
            // dV += Pᵀ·dO: column-major dVᵀ = dOᵀ·P.
            gemm.run(
                "Pᵀ·dO",
                (false, true),
                (d, s, s),
                1.0,
                (d_out_h, d),
                (probs, s),
                1.0,
                (dv + kv * f32_head, d),
                None,
            )?;
            // dP = dO·Vᵀ, shaped like the scores.
            gemm.run(
                "dO·Vᵀ",
                (true, false),
                (s, s, d),
                1.0,
                (v + kv * head, d),
                (d_out_h, d),
                0.0,
                (dp, s),
                None,
            )?;
            let (row_start, intervals) = &self.rows[self.mask_of_head[h]];
            let (row_start, intervals) = (row_start.address(stream), intervals.address(stream));
            let head_lse = self.lse.address(stream) + (h * s * 4) as u64;
            let (s32, scale) = (s as i32, self.shape.scale());
            let mut launch = stream.launch_builder(&grad.softmax_grad);
            launch
                .arg(&scores)
                .arg(&head_lse)
                .arg(&dp)
                .arg(&probs)
                .arg(&row_start)
                .arg(&intervals)
                .arg(&s32)
                .arg(&scale);
            // SAFETY: reads s×s scores and dP and s LSE values, writes s×s dS over P.
            unsafe { launch.launch(self.launch_config()) }.map_err(failed("softmax gradient"))?;
            // dQ = dS·K: column-major dQᵀ = Kᵀ·dSᵀ.
            gemm.run(
                "dS·K",
                (false, false),
                (d, s, s),
                1.0,
                (k + kv * head, d),
                (probs, s),
                0.0,
                (dq + h as u64 * f32_head, d),
                None,
            )?;
            // dK += dSᵀ·Q: column-major dKᵀ = Qᵀ·dS.
            gemm.run(
                "dSᵀ·Q",
                (false, true),
                (d, s, s),
                1.0,
                (q + h as u64 * head, d),
                (probs, s),
                1.0,
                (dk + kv * f32_head, d),
                None,
            )?;
        }
        Ok(())
    }

    pub fn grads(&self, gpu: &Gpu) -> Result<Option<Grads>, PluginError> {
        let Some(grad) = &self.grad else {
            return Ok(None);
        };
        Ok(Some(Grads {
            dq: gpu.download(&grad.dq)?,
            dk: gpu.download(&grad.dk)?,
            dv: gpu.download(&grad.dv)?,
        }))
    }
}

/// Compiles the row kernels for this device (once per worker process).
pub fn compile(gpu: &Gpu) -> Result<Kernels, PluginError> {
    Ok(Kernels {
        module: gpu.compile("the naive kernel's row kernels", &SOURCE)?,
    })
}
