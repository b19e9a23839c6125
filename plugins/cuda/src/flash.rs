//! The flash kernel (forward): tiles of 64 queries × 64 keys driven by the mask IR — for every
//! query tile, the list of key tiles the mask touches, each marked full (no masking) or partial
//! (masked element-wise from each row's key intervals); empty tiles are never visited. Tensor-core
//! products (mma.sync, f32 accumulation) and an online softmax in registers; bf16 or fp16, head
//! dimension 64 or 128, MHA and GQA. The CUDA C is `kernels/flash_forward.cu`.

use std::sync::Arc;

use attnbench_sdk::reference::{Element, HeadMasks, Inputs, Shape};
use attnbench_sdk::PluginError;
use cudarc::driver::{CudaFunction, CudaModule, LaunchConfig, PushKernelArg};

use crate::gpu::{Buffer, Gpu};

const SOURCE: &str = include_str!("../kernels/flash_forward.cu");

/// Query and key rows per tile (`BM`, `BN` in the source).
const TILE: u64 = 64;

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

/// The work lists: per mask and query tile, the key tiles to visit (bit 31: partial); and per
/// mask, every row's key intervals (CSR over one shared interval array).
struct Tables {
    tile_start: Vec<u32>,
    tiles: Vec<u32>,
    row_start: Vec<u32>,
    intervals: Vec<u32>,
}

fn tables(masks: &HeadMasks) -> Tables {
    let mut t = Tables {
        tile_start: vec![0],
        tiles: Vec::new(),
        row_start: Vec::new(),
        intervals: Vec::new(),
    };
    for (index, mask) in masks.set.masks.iter().enumerate() {
        let blocks = mask.block_mask(TILE, TILE);
        for q_tile in 0..blocks.q_tiles() as usize {
            for (k_tile, full) in blocks.row(q_tile) {
                t.tiles.push(k_tile | if full { 0 } else { 1 << 31 });
            }
            t.tile_start.push(t.tiles.len() as u32);
        }
        t.row_start.push((t.intervals.len() / 2) as u32);
        for row in masks.rows(index) {
            for (a, b) in row {
                t.intervals.extend([a, b]);
            }
            t.row_start.push((t.intervals.len() / 2) as u32);
        }
    }
    t.intervals.extend([0, 0]);
    t
}

/// Bytes the flash kernel needs on the device, besides the work lists.
pub fn bytes_needed(shape: &Shape, element: Element) -> usize {
    (shape.q_len() + 2 * shape.kv_len()) * element.bytes()
        + shape.q_len() * 4
        + shape.heads_q * shape.seqlen * 4
}

pub struct Problem {
    shape: Shape,
    q: Buffer<u8>,
    k: Buffer<u8>,
    v: Buffer<u8>,
    pub out: Buffer<f32>,
    pub lse: Buffer<f32>,
    tile_start: Buffer<u32>,
    tiles: Buffer<u32>,
    row_start: Buffer<u32>,
    intervals: Buffer<u32>,
    mask_of_head: Buffer<i32>,
    function: CudaFunction,
}

impl Problem {
    pub fn upload(
        gpu: &Gpu,
        kernels: &Kernels,
        shape: Shape,
        element: Element,
        masks: &HeadMasks,
        inputs: &Inputs,
    ) -> Result<Problem, PluginError> {
        let t = tables(masks);
        let suffix = match element {
            Element::F16 => "f16",
            _ => "bf16",
        };
        let name = format!("flash_forward_{suffix}_d{}", shape.head_dim);
        let function = kernels
            .module
            .load_function(&name)
            .map_err(|err| PluginError::failed(format!("{name}: {err}")))?;
        let mask_of_head: Vec<i32> = masks.index_of_head.iter().map(|&i| i as i32).collect();
        Ok(Problem {
            shape,
            q: gpu.upload("Q", &element.encode(&inputs.q))?,
            k: gpu.upload("K", &element.encode(&inputs.k))?,
            v: gpu.upload("V", &element.encode(&inputs.v))?,
            out: gpu.alloc("O", shape.q_len())?,
            lse: gpu.alloc("LSE", shape.heads_q * shape.seqlen)?,
            tile_start: gpu.upload("tile lists", &t.tile_start)?,
            tiles: gpu.upload("tiles", &t.tiles)?,
            row_start: gpu.upload("mask rows", &t.row_start)?,
            intervals: gpu.upload("mask intervals", &t.intervals)?,
            mask_of_head: gpu.upload("masks of heads", &mask_of_head)?,
            function,
        })
    }

    pub fn forward(&self, gpu: &Gpu) -> Result<(), PluginError> {
        let stream = &gpu.stream;
        let s = self.shape.seqlen;
        let addresses = [
            self.q.address(stream),
            self.k.address(stream),
            self.v.address(stream),
            self.out.address(stream),
            self.lse.address(stream),
            self.tile_start.address(stream),
            self.tiles.address(stream),
            self.row_start.address(stream),
            self.intervals.address(stream),
            self.mask_of_head.address(stream),
        ];
        let (seqlen, group) = (s as i32, self.shape.group() as i32);
        let scale_log2 = self.shape.scale() * std::f32::consts::LOG2_E;
        let mut launch = stream.launch_builder(&self.function);
        for address in &addresses {
            launch.arg(address);
        }
        launch.arg(&seqlen).arg(&group).arg(&scale_log2);
        let config = LaunchConfig {
            grid_dim: (
                s.div_ceil(TILE as usize) as u32,
                self.shape.heads_q as u32,
                1,
            ),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the buffers hold the extents the kernel reads and writes for this shape, and the
        // tables were built for this mask set and sequence length.
        unsafe { launch.launch(config) }
            .map(|_| ())
            .map_err(|err| PluginError::failed(format!("flash forward: {err}")))
    }
}
