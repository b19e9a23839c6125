//! The flash kernel: tiles of 128 (forward) or 64 (backward) queries × 64 keys driven by the mask
//! IR — for every query tile, the list of key tiles the mask touches, each marked full (no
//! masking) or partial (masked element-wise from each row's key intervals); empty tiles are never
//! visited. Tensor-core products (mma.sync, f32 accumulation, ldmatrix from swizzled shared
//! tiles filled by cp.async) and an online softmax in registers; bf16 or fp16, the head dims
//! of [`HEAD_DIMS`], MHA and GQA. The backward pass (`Backward::Split`, deterministic) walks,
//! per key tile, the transposed work list (the query tiles that touch it) for dK and dV, and
//! per query tile the forward one for dQ, recomputing S and dP: seven products per tile pair.
//! `Backward::Fused` adds each step's share of dQ from the key-tile walk with atomics instead
//! (five products; the order of the sums varies run to run). On Hopper (sm_90a, head_dim 128) the forward and both
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

/// A problem's head dims: Q's and K's, and V's (and O's).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HeadDims {
    pub qk: usize,
    pub v: usize,
}

impl HeadDims {
    const fn equal(d: usize) -> HeadDims {
        HeadDims { qk: d, v: d }
    }

    /// How the kernels compiled for these dims end their names (`flash.cu`).
    pub(crate) fn suffix(self) -> String {
        if self.qk == self.v {
            format!("d{}", self.qk)
        } else {
            format!("d{}_v{}", self.qk, self.v)
        }
    }
}

/// The head dims the flash kernel is compiled for: one for Q, K and V at 64 to 256, and MLA's
/// 192 for Q and K with 128 for V. The wgmma kernels take 128 only, the mma.sync ones all.
pub const HEAD_DIMS: [HeadDims; 6] = [
    HeadDims::equal(64),
    HeadDims::equal(96),
    HeadDims::equal(128),
    HeadDims::equal(192),
    HeadDims { qk: 192, v: 128 },
    HeadDims::equal(256),
];

/// Why the flash kernel cannot run this problem, if it cannot.
pub fn unsupported(shape: &Shape, element: Element) -> Option<String> {
    if element == Element::F32 {
        return Some("the flash kernel runs bf16 and fp16 inputs (tensor cores), not f32".into());
    }
    unsupported_head_dims(HeadDims {
        qk: shape.head_dim,
        v: shape.value_dim(),
    })
}

/// Why the flash kernel cannot take these head dims, if it cannot.
fn unsupported_head_dims(dims: HeadDims) -> Option<String> {
    (!HEAD_DIMS.contains(&dims)).then(|| {
        let value = if dims.v == dims.qk {
            String::new()
        } else {
            format!(" with head_dim_v {}", dims.v)
        };
        format!(
            "the flash kernel is compiled for head_dim 64, 96, 128, 192 and 256 (one for Q, K and V) and for MLA's 192 with head_dim_v 128, not head_dim {}{value}",
            dims.qk
        )
    })
}

/// Bytes the flash kernel needs on the device, besides the work lists.
pub fn bytes_needed(shape: &Shape, element: Element, backward: bool) -> usize {
    let lse = shape.heads_q * shape.seqlen * 4;
    let inputs = shape.q_len() + shape.kv_len() + shape.v_len();
    let forward = inputs * element.bytes() + shape.out_len() * 4 + lse;
    if !backward {
        return forward;
    }
    // dO, D, and f32 dQ, dK, dV.
    forward + shape.out_len() * element.bytes() + lse + inputs * 4
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The head dims a cell may ask for: the compiled pairs run, any other pair is refused with
    /// both of its dims named, and the wgmma suffix stays the one-dim name.
    #[test]
    fn compiled_head_dims_run_and_others_are_refused_by_name() {
        let shape = |d, v| Shape::new(8, 2, 1000, d).with_value_dim(Some(v));
        for head in HEAD_DIMS {
            assert_eq!(
                unsupported(&shape(head.qk, head.v), Element::Bf16),
                None,
                "{head:?}"
            );
        }
        let refused = unsupported(&shape(256, 128), Element::F16).unwrap();
        assert!(
            refused.contains("head_dim 256 with head_dim_v 128"),
            "{refused}"
        );
        let refused = unsupported(&shape(80, 80), Element::Bf16).unwrap();
        assert!(refused.ends_with("not head_dim 80"), "{refused}");
        assert!(unsupported(&shape(128, 128), Element::F32).is_some());
        assert_eq!(HeadDims::equal(128).suffix(), "d128");
        assert_eq!(HeadDims { qk: 192, v: 128 }.suffix(), "d192_v128");
    }
}
