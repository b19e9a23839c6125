//! The kernels of one element type and head dimension, looked up in the compiled module, with
//! the dynamic shared memory each one is allowed.

use attnbench_sdk::reference::Element;
use attnbench_sdk::PluginError;
use cudarc::driver::sys::CUtensorMapDataType;
use cudarc::driver::CudaFunction;

use super::{HeadDims, Kernels, FORWARD_TILE, TILE, WIDE_TILE};
use crate::gpu::allow_shared;

/// The kernels of one element type and head dimension.
pub(super) struct Functions {
    /// The device's SMs: the persistent forward's grid.
    pub(super) multiprocessors: usize,
    pub(super) forward: CudaFunction,
    pub(super) forward_narrow: CudaFunction,
    /// The wgmma kernels (Hopper, head_dim 128), where the module has them.
    pub(super) hopper: Option<HopperFunctions>,
    pub(super) delta: CudaFunction,
    pub(super) dq: CudaFunction,
    pub(super) dkdv: CudaFunction,
    pub(super) fused: CudaFunction,
}

impl Kernels {
    pub(super) fn functions(
        &self,
        element: Element,
        head: HeadDims,
    ) -> Result<Functions, PluginError> {
        let suffix = match element {
            Element::F16 => "f16",
            _ => "bf16",
        };
        let function = |kind: &str| {
            let name = format!("flash_{kind}_{suffix}_{}", head.suffix());
            self.module
                .load_function(&name)
                .map_err(|err| PluginError::failed(format!("{name}: {err}")))
        };
        Ok(Functions {
            multiprocessors: self.multiprocessors,
            forward: allow_shared(
                function("forward")?,
                forward_shared_bytes(FORWARD_TILE, head),
            )?,
            forward_narrow: allow_shared(
                function("forward_narrow")?,
                forward_shared_bytes(TILE, head),
            )?,
            // A module compiled for sm_90a has the wgmma kernels.
            hopper: match function("forward_tma") {
                Ok(forward_tma) => Some(HopperFunctions {
                    forward_tma: allow_shared(
                        forward_tma,
                        hopper_shared_bytes(HOPPER_FORWARD_ROWS),
                    )?,
                    tensor_type: match element {
                        Element::F16 => CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
                        _ => CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
                    },
                    forward_narrow: allow_shared(
                        function("forward_narrow_tma")?,
                        hopper_shared_bytes(HOPPER_NARROW_FORWARD_ROWS),
                    )?,
                    forward_tma_persistent: allow_shared(
                        function("forward_tma_persistent")?,
                        hopper_shared_bytes(HOPPER_FORWARD_ROWS),
                    )?,
                    forward_narrow_persistent: allow_shared(
                        function("forward_narrow_tma_persistent")?,
                        hopper_shared_bytes(HOPPER_NARROW_FORWARD_ROWS),
                    )?,
                    dq: allow_shared(
                        function("backward_dq_hopper")?,
                        hopper_shared_bytes(HOPPER_DQ_ROWS),
                    )?,
                    dq_tma: allow_shared(
                        function("backward_dq_tma")?,
                        hopper_shared_bytes(HOPPER_DQ_TMA_ROWS),
                    )?,
                    dkdv: allow_shared(
                        function("backward_dkdv_hopper")?,
                        hopper_shared_bytes(HOPPER_DKDV_ROWS),
                    )?,
                    dkdv_tma: allow_shared(
                        function("backward_dkdv_tma")?,
                        hopper_shared_bytes(HOPPER_KEY_TMA_ROWS),
                    )?,
                    fused_tma: allow_shared(
                        function("backward_fused_tma")?,
                        hopper_shared_bytes(HOPPER_FUSED_TMA_ROWS),
                    )?,
                }),
                Err(_) => None,
            },
            delta: function("delta")?,
            dq: allow_shared(function("backward_dq")?, dq_shared_bytes(head))?,
            dkdv: allow_shared(
                function("backward_dkdv")?,
                key_tile_shared_bytes(head, false),
            )?,
            fused: allow_shared(
                function("backward_fused")?,
                key_tile_shared_bytes(head, true),
            )?,
        })
    }
}

/// The wgmma kernels of a module compiled for sm_90a.
pub(super) struct HopperFunctions {
    /// The forward on 128 × 128 tiles: two warpgroups compute, a third loads every tile by TMA.
    pub(super) forward_tma: CudaFunction,
    /// The 16-bit element type, for the TMA maps.
    pub(super) tensor_type: CUtensorMapDataType,
    /// The forward on 64 × 64 tiles: two warpgroups compute a query tile each, a third loads
    /// their K and V tiles by TMA.
    pub(super) forward_narrow: CudaFunction,
    /// `forward_tma` and `forward_narrow` with the persistent scheduler: one block an SM.
    pub(super) forward_tma_persistent: CudaFunction,
    pub(super) forward_narrow_persistent: CudaFunction,
    pub(super) dq: CudaFunction,
    /// dQ on the forward's 128-row tiles: two warpgroups compute, a third loads every K and V
    /// tile by TMA.
    pub(super) dq_tma: CudaFunction,
    pub(super) dkdv: CudaFunction,
    /// dK and dV on 128-key tiles: two warpgroups compute, a third loads every tile by TMA.
    pub(super) dkdv_tma: CudaFunction,
    /// As `dkdv_tma`, dQ added with atomics.
    pub(super) fused_tma: CudaFunction,
}

/// The wgmma kernels' dynamic shared memory for `rows` rows of tiles (16-bit, head_dim 128),
/// with room to align the first tile to 1024 bytes.
pub(super) fn hopper_shared_bytes(rows: u64) -> u32 {
    (rows as usize * 128 * 2 + 1024) as u32
}
/// The TMA forward's rows: a 128-row Q tile, two 128-key buffers each of K and V.
pub(super) const HOPPER_FORWARD_ROWS: u64 = FORWARD_TILE + 4 * WIDE_TILE;
/// The TMA forward's on 64-row tiles (Q stays in registers): for each of its two query tiles,
/// three 64-key buffers each of K and V.
pub(super) const HOPPER_NARROW_FORWARD_ROWS: u64 = 2 * 2 * 3 * TILE;
/// The wgmma dQ kernels' (Q and dO stay in registers): two 64-row buffers each of K and V.
pub(super) const HOPPER_DQ_ROWS: u64 = 4 * TILE;
/// The TMA dQ kernel's: three 64-row buffers each of K and V.
pub(super) const HOPPER_DQ_TMA_ROWS: u64 = 6 * TILE;
/// The wgmma dK/dV kernel's: K and V (64 keys each), two 64-row buffers each of Q and dO.
pub(super) const HOPPER_DKDV_ROWS: u64 = 6 * TILE;
/// The TMA dK/dV kernel's: K and V tiles of 128 keys, two 64-row buffers each of Q and dO.
pub(super) const HOPPER_KEY_TMA_ROWS: u64 = 2 * WIDE_TILE + 4 * TILE;
/// The fused TMA kernel's: the dK/dV kernel's, then two buffers of dS (64 queries × 128 keys).
pub(super) const HOPPER_FUSED_TMA_ROWS: u64 = HOPPER_KEY_TMA_ROWS + 2 * TILE;

/// A shared tile's row in 16-bit elements: the head dim rounded up to 64, so that the swizzle
/// stays inside the row (`tile_stride` in `kernels/flash/primitives.cuh`).
fn tile_stride(head_dim: usize) -> usize {
    head_dim.div_ceil(64) * 64
}

/// The largest head dim whose mma.sync kernels keep their tiles' fragments and accumulators as
/// they do at 64 (`RESIDENT_HEAD_DIM` in `kernels/flash/primitives.cuh`); past it the forward's
/// 128-row tile takes 8 warps, the dQ kernel keeps Q and dO in dynamic shared memory instead of
/// registers, and two CTAs share a dK/dV key tile.
const RESIDENT_HEAD_DIM: usize = 128;

/// The mma.sync forward's threads on `rows`-row tiles: 4 warps, or 8 for 128-row tiles past
/// head_dim 128, where a warp keeps 16 rows (`FLASH_FORWARD` in `kernels/flash/forward_sm80.cuh`).
pub(super) fn forward_threads(rows: u64, head_dim: usize) -> u32 {
    if rows == FORWARD_TILE && head_dim > RESIDENT_HEAD_DIM {
        256
    } else {
        128
    }
}

/// The CTAs that share a key tile of the mma.sync dK/dV kernels, each for its part of the
/// columns: 2 past head_dim 128 (`KEY_TILE_PARTS` in `kernels/flash/backward_sm80.cuh`).
pub(super) fn key_tile_parts(head_dim: usize) -> u32 {
    if head_dim > RESIDENT_HEAD_DIM {
        2
    } else {
        1
    }
}

/// The forward kernel's dynamic shared memory: a Q tile and one K and one V tile, 16-bit.
pub(super) fn forward_shared_bytes(rows: u64, head: HeadDims) -> u32 {
    let tile = TILE as usize;
    ((rows as usize + tile) * tile_stride(head.qk) * 2 + tile * tile_stride(head.v) * 2) as u32
}

/// The mma.sync dQ kernel's static shared memory up to [`RESIDENT_HEAD_DIM`]: two K buffers and
/// V, 64 rows each, 16-bit.
fn dq_static_bytes(head: HeadDims) -> usize {
    TILE as usize * (2 * tile_stride(head.qk) + tile_stride(head.v)) * 2
}

/// The mma.sync dQ kernel's dynamic shared memory: none up to [`RESIDENT_HEAD_DIM`], past it 64
/// rows each of Q, dO, two K buffers and V, 16-bit.
pub(super) fn dq_shared_bytes(head: HeadDims) -> u32 {
    if head.qk > RESIDENT_HEAD_DIM {
        let query_rows = TILE as usize * (tile_stride(head.qk) + tile_stride(head.v)) * 2;
        (dq_static_bytes(head) + query_rows) as u32
    } else {
        0
    }
}

/// The key-tile backward kernel's dynamic shared memory: two stages of 32-row Q and dO tiles,
/// the key tile's K and V, and (fused, for dQ) a step's 32 × 64 dS, all 16-bit.
pub(super) fn key_tile_shared_bytes(head: HeadDims, fused: bool) -> u32 {
    let rows = 2 * 32 + TILE as usize;
    let ds = if fused { 32 * TILE as usize } else { 0 };
    ((rows * (tile_stride(head.qk) + tile_stride(head.v)) + ds) * 2) as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each wgmma kernel's shared memory, with the static arrays of the dK/dV kernels (LSE and D
    /// of two 64-row stages and the mbarriers: 2 KiB as ptxas counts them), fits what one block
    /// of sm_90 may opt into (227 KiB): a kernel past it would fail at launch, on the GPU only.
    #[test]
    fn hopper_kernels_fit_shared_memory() {
        const SM90_BLOCK_SHARED: u32 = 227 * 1024;
        const STATIC_BYTES: u32 = 2048;
        for (kernel, rows) in [
            ("forward", HOPPER_FORWARD_ROWS),
            ("narrow forward", HOPPER_NARROW_FORWARD_ROWS),
            ("dQ", HOPPER_DQ_ROWS),
            ("TMA dQ", HOPPER_DQ_TMA_ROWS),
            ("dK/dV", HOPPER_DKDV_ROWS),
            ("TMA dK/dV", HOPPER_KEY_TMA_ROWS),
            ("TMA fused", HOPPER_FUSED_TMA_ROWS),
        ] {
            let bytes = hopper_shared_bytes(rows) + STATIC_BYTES;
            assert!(bytes <= SM90_BLOCK_SHARED, "{kernel}: {bytes} bytes");
        }
    }

    /// The mma.sync kernels' shared memory fits what one block of sm_80 may opt into (163 KiB)
    /// at every head dim the module is compiled for; the dQ kernel's static tiles stay within
    /// the 48 KiB a block has without opting in, and 96's rows are padded to 128.
    #[test]
    fn mma_kernels_fit_shared_memory_at_every_head_dim() {
        const SM80_BLOCK_SHARED: u32 = 163 * 1024;
        for d in super::super::HEAD_DIMS {
            for (kernel, bytes) in [
                ("forward", forward_shared_bytes(FORWARD_TILE, d)),
                ("narrow forward", forward_shared_bytes(TILE, d)),
                ("dQ", dq_shared_bytes(d)),
                ("dK/dV", key_tile_shared_bytes(d, false)),
                ("fused", key_tile_shared_bytes(d, true)),
            ] {
                assert!(
                    bytes <= SM80_BLOCK_SHARED,
                    "{kernel} at {d:?}: {bytes} bytes"
                );
            }
            if dq_shared_bytes(d) == 0 {
                let bytes = dq_static_bytes(d);
                assert!(bytes <= 48 * 1024, "dQ at {d:?}: {bytes} static bytes");
            }
        }
        assert_eq!(tile_stride(96), 128);
        assert_eq!(forward_threads(FORWARD_TILE, 256), 256);
        assert_eq!(forward_threads(TILE, 256), 128);
        assert_eq!((key_tile_parts(128), key_tile_parts(192)), (1, 2));
    }
}
