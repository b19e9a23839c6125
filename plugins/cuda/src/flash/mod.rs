//! The flash kernel: tiles of 128 (forward) or 64 (backward) queries × 64 keys driven by the mask
//! IR — for every query tile, the list of key tiles the mask touches, each marked full (no
//! masking) or partial (masked element-wise from each row's key intervals); empty tiles are never
//! visited. Tensor-core products (mma.sync, f32 accumulation, ldmatrix from swizzled shared
//! tiles filled by cp.async) and an online softmax in registers; bf16 or fp16, the head dims
//! of [`HEAD_DIMS`], MHA and GQA. The backward pass (`Backward::Split`, deterministic) walks, per key tile,
//! the transposed work list (the query tiles that touch it) for dK and dV, and per query tile
//! the forward one for dQ, recomputing S and dP: seven products per tile pair. `Backward::Fused`
//! adds each step's share of dQ from the key-tile walk with atomics instead (five products; the
//! order of the sums varies run to run). On Hopper (sm_90a, head_dim 128) the forward and both
//! backwards also come as warpgroup-MMA (wgmma) kernels reading their operands from shared
//! memory (see [`Instructions`]): the forward on 128 × 128 tiles (64 × 64 where the masks' blocks
//! split those) with each tile's softmax overlapping the previous tile's P·V, the fused backward
//! where the masks keep 128-row tiles. Where the masks keep 128-row tiles every wgmma kernel is
//! warp-specialised: a producer warpgroup loads the tiles by TMA (swizzled as wgmma reads them,
//! signalled through mbarriers) and two consumer warpgroups compute without a block-wide barrier
//! per tile; on 64 × 64 tiles the forward is too, the backward loads by cp.async.
//! The CUDA C is `kernels/flash.cu`, which includes its parts by concern from `kernels/flash/`.

use std::sync::Arc;

use attnbench_sdk::reference::{Element, Shape};
use attnbench_sdk::PluginError;
use cudarc::driver::CudaModule;

use crate::gpu::Gpu;
use crate::kept::Kept;
use crate::nvrtc::CudaSource;

mod backend;
mod device;
mod functions;
mod launch;
mod params;
mod problem;
mod tables;

pub(crate) use backend::follow;
pub use backend::{accepts, attend};
use device::DeviceTables;
pub use launch::{Backward, Instructions, Schedule};
pub use problem::Problem;

/// One header of the flash kernel, as `flash.cu` includes it.
macro_rules! header {
    ($name:literal) => {
        (
            concat!("flash/", $name),
            include_str!(concat!("../../kernels/flash/", $name)),
        )
    };
}

/// The flash kernel: `flash.cu` and its parts by concern, in the order it includes them.
pub(crate) const SOURCE: CudaSource = CudaSource {
    name: "flash.cu",
    text: include_str!("../../kernels/flash.cu"),
    headers: &[
        header!("primitives.cuh"),
        header!("params.cuh"),
        header!("mask.cuh"),
        header!("forward_sm80.cuh"),
        header!("sm90_primitives.cuh"),
        header!("softmax.cuh"),
        header!("epilogue.cuh"),
        header!("pipeline.cuh"),
        header!("scheduler.cuh"),
        header!("forward_sm90.cuh"),
        header!("work_lists.cuh"),
        header!("backward_sm80.cuh"),
        header!("backward_sm90.cuh"),
    ],
};

/// Query and key rows per tile of the backward pass (`BM`, `BN` in the source).
const TILE: u64 = 64;
/// Query rows per tile of the forward pass (`BM_FWD`; its key tiles are `TILE` long), unless
/// the mask set's blocks split such tiles (then `TILE`, see [`Tables::forward_rows`]).
const FORWARD_TILE: u64 = 128;
/// Keys per tile of the wgmma forward and of the wgmma dK/dV kernel with two warpgroups.
const WIDE_TILE: u64 = 128;

pub struct Kernels {
    module: Arc<CudaModule>,
    /// The work lists of blocks that in-process calls brought, by a digest of their shape and
    /// rows: a context-parallel run brings the same blocks every repetition, and building their
    /// lists takes more host time than some of their kernels take.
    blocks: Kept<[u8; 32], DeviceTables>,
    multiprocessors: usize,
}

/// Blocks whose work lists [`Kernels`] keeps (all of them are dropped past this many).
const KEPT_BLOCKS: usize = 512;

pub fn compile(gpu: &Gpu) -> Result<Kernels, PluginError> {
    Ok(Kernels {
        module: gpu.compile("the flash kernel", &SOURCE)?,
        blocks: Kept::new(KEPT_BLOCKS),
        multiprocessors: gpu.describe().multiprocessors.unwrap_or(1).max(1) as usize,
    })
}

/// The head dims the flash kernel is compiled for (one for Q, K and V): the wgmma kernels take
/// 128, the mma.sync ones all of them.
pub const HEAD_DIMS: [usize; 5] = [64, 96, 128, 192, 256];

/// Why the flash kernel cannot run this problem, if it cannot.
pub fn unsupported(shape: &Shape, element: Element) -> Option<String> {
    if element == Element::F32 {
        return Some("the flash kernel runs bf16 and fp16 inputs (tensor cores), not f32".into());
    }
    unsupported_head_dim(shape.head_dim)
}

/// Why the flash kernel cannot take head dim `d`, if it cannot.
fn unsupported_head_dim(d: usize) -> Option<String> {
    (!HEAD_DIMS.contains(&d)).then(|| {
        format!("the flash kernel is compiled for head_dim 64, 96, 128, 192 and 256, not {d}")
    })
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
