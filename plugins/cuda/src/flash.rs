//! The flash kernel: tiles of 128 (forward) or 64 (backward) queries × 64 keys driven by the mask
//! IR — for every query tile, the list of key tiles the mask touches, each marked full (no
//! masking) or partial (masked element-wise from each row's key intervals); empty tiles are never
//! visited. Tensor-core products (mma.sync, f32 accumulation, ldmatrix from swizzled shared
//! tiles filled by cp.async) and an online softmax in registers; bf16 or fp16, head dimension 64
//! or 128, MHA and GQA. The backward pass is deterministic: dK/dV per key tile walk the
//! transposed work list (the query tiles that touch it), dQ per query tile the forward one.
//! The CUDA C is `kernels/flash.cu`.

use std::sync::Arc;

use attnbench_sdk::reference::{Element, HeadMasks, Inputs, Shape};
use attnbench_sdk::PluginError;
use cudarc::driver::{CudaFunction, CudaModule, LaunchConfig, PushKernelArg};

use crate::gpu::{failed, Buffer, Gpu};
use crate::naive::Grads;

const SOURCE: &str = include_str!("../kernels/flash.cu");

/// Query and key rows per tile of the backward pass (`BM`, `BN` in the source).
const TILE: u64 = 64;
/// Query rows per tile of the forward pass (`BM_FWD`; its key tiles are `TILE` long).
const FORWARD_TILE: u64 = 128;

pub struct Kernels {
    module: Arc<CudaModule>,
}

pub fn compile(gpu: &Gpu) -> Result<Kernels, PluginError> {
    Ok(Kernels {
        module: gpu.compile("the flash kernel", SOURCE)?,
    })
}

/// Why the flash kernel cannot run this problem, if it cannot.
pub fn unsupported(shape: &Shape, element: Element) -> Option<String> {
    if element == Element::F32 {
        return Some("the flash kernel runs bf16 and fp16 inputs (tensor cores), not f32".into());
    }
    if shape.head_dim != 64 && shape.head_dim != 128 {
        return Some(format!(
            "the flash kernel is compiled for head_dim 64 and 128, not {}",
            shape.head_dim
        ));
    }
    None
}

/// The work lists: per mask and query tile, the key tiles to visit (bit 31: partial) — for the
/// forward's 128-row and the backward's 64-row query tiles — with the forward's query tiles of
/// each mask ordered longest list first; per mask and key tile, the query tiles that visit it
/// (the backward's dK/dV); and per mask, every row's key intervals (CSR over one shared interval
/// array).
struct Tables {
    forward_tile_start: Vec<u32>,
    forward_tiles: Vec<u32>,
    forward_order: Vec<u32>,
    tile_start: Vec<u32>,
    tiles: Vec<u32>,
    key_tile_start: Vec<u32>,
    key_tiles: Vec<u32>,
    row_start: Vec<u32>,
    intervals: Vec<u32>,
}

fn tables(masks: &HeadMasks) -> Tables {
    let mut t = Tables {
        forward_tile_start: vec![0],
        forward_tiles: Vec::new(),
        forward_order: Vec::new(),
        tile_start: vec![0],
        tiles: Vec::new(),
        key_tile_start: vec![0],
        key_tiles: Vec::new(),
        row_start: Vec::new(),
        intervals: Vec::new(),
    };
    for (index, mask) in masks.set.masks.iter().enumerate() {
        let blocks = mask.block_mask(FORWARD_TILE, TILE);
        let mut lengths = Vec::new();
        for q_tile in 0..blocks.q_tiles() as usize {
            let before = t.forward_tiles.len();
            for (k_tile, full) in blocks.row(q_tile) {
                t.forward_tiles
                    .push(k_tile | if full { 0 } else { 1 << 31 });
            }
            t.forward_tile_start.push(t.forward_tiles.len() as u32);
            lengths.push((t.forward_tiles.len() - before, q_tile as u32));
        }
        lengths.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
        t.forward_order
            .extend(lengths.iter().map(|&(_, q_tile)| q_tile));

        let blocks = mask.block_mask(TILE, TILE);
        let mut by_key: Vec<Vec<u32>> = vec![Vec::new(); blocks.k_tiles() as usize];
        for q_tile in 0..blocks.q_tiles() as usize {
            for (k_tile, full) in blocks.row(q_tile) {
                let partial = if full { 0 } else { 1 << 31 };
                t.tiles.push(k_tile | partial);
                by_key[k_tile as usize].push(q_tile as u32 | partial);
            }
            t.tile_start.push(t.tiles.len() as u32);
        }
        for list in by_key {
            t.key_tiles.extend(list);
            t.key_tile_start.push(t.key_tiles.len() as u32);
        }
        t.row_start.push((t.intervals.len() / 2) as u32);
        for row in masks.rows(index) {
            for (a, b) in row {
                t.intervals.extend([a, b]);
            }
            t.row_start.push((t.intervals.len() / 2) as u32);
        }
    }
    // No buffer is empty.
    t.intervals.extend([0, 0]);
    t.forward_tiles.push(0);
    t.tiles.push(0);
    t.key_tiles.push(0);
    t
}

/// Bytes the flash kernel needs on the device, besides the work lists.
pub fn bytes_needed(shape: &Shape, element: Element, backward: bool) -> usize {
    let lse = shape.heads_q * shape.seqlen * 4;
    let forward = (shape.q_len() + 2 * shape.kv_len()) * element.bytes() + shape.q_len() * 4 + lse;
    if !backward {
        return forward;
    }
    // dO, D, and f32 dQ, dK, dV.
    forward + shape.q_len() * element.bytes() + lse + (shape.q_len() + 2 * shape.kv_len()) * 4
}

/// What only the backward pass needs.
struct Backward {
    d_out: Buffer<u8>,
    delta: Buffer<f32>,
    dq: Buffer<f32>,
    dk: Buffer<f32>,
    dv: Buffer<f32>,
    key_tile_start: Buffer<u32>,
    key_tiles: Buffer<u32>,
    delta_kernel: CudaFunction,
    dq_kernel: CudaFunction,
    dkdv_kernel: CudaFunction,
}

pub struct Problem {
    shape: Shape,
    q: Buffer<u8>,
    k: Buffer<u8>,
    v: Buffer<u8>,
    pub out: Buffer<f32>,
    pub lse: Buffer<f32>,
    forward_tile_start: Buffer<u32>,
    forward_tiles: Buffer<u32>,
    forward_order: Buffer<u32>,
    tile_start: Buffer<u32>,
    tiles: Buffer<u32>,
    row_start: Buffer<u32>,
    intervals: Buffer<u32>,
    mask_of_head: Buffer<i32>,
    forward_kernel: CudaFunction,
    grad: Option<Backward>,
}

/// The forward kernel's dynamic shared memory: a Q tile and one K and one V tile, 16-bit.
fn forward_shared_bytes(head_dim: usize) -> u32 {
    ((FORWARD_TILE + 2 * TILE) as usize * head_dim * 2) as u32
}

/// The forward kernel, allowed the shared memory it takes (more than the 48 KiB a kernel gets
/// unasked at head_dim 128).
fn forward_kernel(function: CudaFunction, head_dim: usize) -> Result<CudaFunction, PluginError> {
    use cudarc::driver::sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES as MAX_DYNAMIC_SHARED;
    function
        .set_attribute(MAX_DYNAMIC_SHARED, forward_shared_bytes(head_dim) as i32)
        .map_err(failed("flash forward: shared memory size"))?;
    Ok(function)
}

/// A grid of one 128-thread CTA per (tile, head): the backward pass.
fn grid(tiles: usize, heads: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (tiles as u32, heads as u32, 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: 0,
    }
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
        let t = tables(masks);
        let suffix = match element {
            Element::F16 => "f16",
            _ => "bf16",
        };
        let function = |kind: &str| {
            let name = format!("flash_{kind}_{suffix}_d{}", shape.head_dim);
            kernels
                .module
                .load_function(&name)
                .map_err(|err| PluginError::failed(format!("{name}: {err}")))
        };
        let grad = if backward {
            Some(Backward {
                d_out: gpu.upload("dO", &element.encode(&inputs.d_out))?,
                delta: gpu.alloc("D", shape.heads_q * shape.seqlen)?,
                dq: gpu.alloc("dQ", shape.q_len())?,
                dk: gpu.alloc("dK", shape.kv_len())?,
                dv: gpu.alloc("dV", shape.kv_len())?,
                key_tile_start: gpu.upload("key tile lists", &t.key_tile_start)?,
                key_tiles: gpu.upload("key tiles", &t.key_tiles)?,
                delta_kernel: function("delta")?,
                dq_kernel: function("backward_dq")?,
                dkdv_kernel: function("backward_dkdv")?,
            })
        } else {
            None
        };
        let mask_of_head: Vec<i32> = masks.index_of_head.iter().map(|&i| i as i32).collect();
        Ok(Problem {
            shape,
            q: gpu.upload("Q", &element.encode(&inputs.q))?,
            k: gpu.upload("K", &element.encode(&inputs.k))?,
            v: gpu.upload("V", &element.encode(&inputs.v))?,
            out: gpu.alloc("O", shape.q_len())?,
            lse: gpu.alloc("LSE", shape.heads_q * shape.seqlen)?,
            forward_tile_start: gpu.upload("forward tile lists", &t.forward_tile_start)?,
            forward_tiles: gpu.upload("forward tiles", &t.forward_tiles)?,
            forward_order: gpu.upload("forward tile order", &t.forward_order)?,
            tile_start: gpu.upload("tile lists", &t.tile_start)?,
            tiles: gpu.upload("tiles", &t.tiles)?,
            row_start: gpu.upload("mask rows", &t.row_start)?,
            intervals: gpu.upload("mask intervals", &t.intervals)?,
            mask_of_head: gpu.upload("masks of heads", &mask_of_head)?,
            forward_kernel: forward_kernel(function("forward")?, shape.head_dim)?,
            grad,
        })
    }

    fn tiles(&self) -> usize {
        self.shape.seqlen.div_ceil(TILE as usize)
    }

    pub fn forward(&self, gpu: &Gpu) -> Result<(), PluginError> {
        let stream = &gpu.stream;
        let addresses = [
            self.q.address(stream),
            self.k.address(stream),
            self.v.address(stream),
            self.out.address(stream),
            self.lse.address(stream),
            self.forward_tile_start.address(stream),
            self.forward_tiles.address(stream),
            self.forward_order.address(stream),
            self.row_start.address(stream),
            self.intervals.address(stream),
            self.mask_of_head.address(stream),
        ];
        let (seqlen, group) = (self.shape.seqlen as i32, self.shape.group() as i32);
        let scale_log2 = self.shape.scale() * std::f32::consts::LOG2_E;
        let mut launch = stream.launch_builder(&self.forward_kernel);
        for address in &addresses {
            launch.arg(address);
        }
        launch.arg(&seqlen).arg(&group).arg(&scale_log2);
        // SAFETY: the buffers hold the extents the kernel reads and writes for this shape, and the
        // tables were built for this mask set and sequence length.
        // One 128-thread CTA per (query head, 128-row query tile): the heads of a KV group sit side
        // by side in the grid and read the same K and V tiles while they are in L2.
        let config = LaunchConfig {
            grid_dim: (
                self.shape.heads_q as u32,
                self.shape.seqlen.div_ceil(FORWARD_TILE as usize) as u32,
                1,
            ),
            block_dim: (128, 1, 1),
            shared_mem_bytes: forward_shared_bytes(self.shape.head_dim),
        };
        unsafe { launch.launch(config) }
            .map(|_| ())
            .map_err(failed("flash forward"))
    }

    /// dQ, dK and dV from the forward pass's O and LSE (the forward must have run).
    pub fn backward(&self, gpu: &Gpu) -> Result<(), PluginError> {
        let Some(grad) = &self.grad else {
            return Err(PluginError::failed(
                "the problem was uploaded without backward buffers",
            ));
        };
        let stream = &gpu.stream;
        let rows = (self.shape.heads_q * self.shape.seqlen) as i32;
        let d_out = grad.d_out.address(stream);
        let (out, delta) = (self.out.address(stream), grad.delta.address(stream));
        let mut launch = stream.launch_builder(&grad.delta_kernel);
        launch.arg(&d_out).arg(&out).arg(&delta).arg(&rows);
        // SAFETY: D has one value per row of dO and O, which hold rows × d values.
        unsafe { launch.launch(grid((rows as usize).div_ceil(4), 1)) }
            .map_err(failed("flash backward (D)"))?;

        let (seqlen, group) = (self.shape.seqlen as i32, self.shape.group() as i32);
        let scale = self.shape.scale();
        let scale_log2 = scale * std::f32::consts::LOG2_E;
        let inputs = [
            self.q.address(stream),
            self.k.address(stream),
            self.v.address(stream),
            d_out,
            self.lse.address(stream),
            delta,
        ];
        let tables = |start: &Buffer<u32>, tiles: &Buffer<u32>| {
            [
                start.address(stream),
                tiles.address(stream),
                self.row_start.address(stream),
                self.intervals.address(stream),
                self.mask_of_head.address(stream),
            ]
        };
        let launches = [
            (
                &grad.dq_kernel,
                vec![grad.dq.address(stream)],
                tables(&self.tile_start, &self.tiles),
                grid(self.tiles(), self.shape.heads_q),
                "flash backward (dQ)",
            ),
            (
                &grad.dkdv_kernel,
                vec![grad.dk.address(stream), grad.dv.address(stream)],
                tables(&grad.key_tile_start, &grad.key_tiles),
                grid(self.tiles(), self.shape.heads_kv),
                "flash backward (dK, dV)",
            ),
        ];
        for (kernel, outputs, lists, config, what) in launches {
            let mut launch = stream.launch_builder(kernel);
            for address in inputs.iter().chain(&outputs).chain(&lists) {
                launch.arg(address);
            }
            launch.arg(&seqlen).arg(&group).arg(&scale).arg(&scale_log2);
            // SAFETY: dQ holds heads_q × s × d values, dK and dV heads_kv × s × d; the lists were
            // built for this mask set and length.
            unsafe { launch.launch(config) }.map_err(failed(what))?;
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
