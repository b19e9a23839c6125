//! What a launch reads on the device: the work lists uploaded, tensor addresses, and the TMA
//! descriptors of the 16-bit inputs.

use std::ffi::c_void;

use attnbench_sdk::PluginError;
use cudarc::driver::sys::{
    CUtensorMapDataType, CUtensorMapFloatOOBfill, CUtensorMapInterleave, CUtensorMapL2promotion,
    CUtensorMapSwizzle,
};
use cudarc::driver::DeviceRepr;

use super::tables::Tables;
use super::HeadDims;
use crate::gpu::{failed, Buffer, Gpu};

/// A mask's work lists and row intervals on the device.
pub(super) struct DeviceTables {
    pub(super) forward_rows: u64,
    pub(super) forward_tile_start: Buffer<u32>,
    pub(super) forward_tiles: Buffer<u32>,
    pub(super) forward_order: Buffer<u32>,
    pub(super) wide_forward_tile_start: Buffer<u32>,
    pub(super) wide_forward_tiles: Buffer<u32>,
    pub(super) wide_forward_order: Buffer<u32>,
    pub(super) tile_start: Buffer<u32>,
    pub(super) tiles: Buffer<u32>,
    pub(super) key_tile_start: Buffer<u32>,
    pub(super) key_tiles: Buffer<u32>,
    pub(super) key_order: Buffer<u32>,
    pub(super) wide_key_tile_start: Buffer<u32>,
    pub(super) wide_key_tiles: Buffer<u32>,
    pub(super) wide_key_order: Buffer<u32>,
    pub(super) row_start: Buffer<u32>,
    pub(super) intervals: Buffer<u32>,
    pub(super) column_start: Buffer<u32>,
    pub(super) column_intervals: Buffer<u32>,
    pub(super) mask_of_head: Buffer<i32>,
}

impl DeviceTables {
    pub(super) fn upload(
        gpu: &Gpu,
        t: &Tables,
        mask_of_head: &[i32],
    ) -> Result<DeviceTables, PluginError> {
        Ok(DeviceTables {
            forward_rows: t.forward_rows,
            forward_tile_start: gpu.upload("forward tile lists", &t.forward_tile_start)?,
            forward_tiles: gpu.upload("forward tiles", &t.forward_tiles)?,
            forward_order: gpu.upload("forward tile order", &t.forward_order)?,
            wide_forward_tile_start: gpu
                .upload("wide forward tile lists", &t.wide_forward_tile_start)?,
            wide_forward_tiles: gpu.upload("wide forward tiles", &t.wide_forward_tiles)?,
            wide_forward_order: gpu.upload("wide forward tile order", &t.wide_forward_order)?,
            tile_start: gpu.upload("tile lists", &t.tile_start)?,
            tiles: gpu.upload("tiles", &t.tiles)?,
            key_tile_start: gpu.upload("key tile lists", &t.key_tile_start)?,
            key_tiles: gpu.upload("key tiles", &t.key_tiles)?,
            key_order: gpu.upload("key tile order", &t.key_order)?,
            wide_key_tile_start: gpu.upload("wide key tile lists", &t.wide_key_tile_start)?,
            wide_key_tiles: gpu.upload("wide key tiles", &t.wide_key_tiles)?,
            wide_key_order: gpu.upload("wide key tile order", &t.wide_key_order)?,
            row_start: gpu.upload("mask rows", &t.row_start)?,
            intervals: gpu.upload("mask intervals", &t.intervals)?,
            column_start: gpu.upload("mask columns", &t.column_start)?,
            column_intervals: gpu.upload("mask column intervals", &t.column_intervals)?,
            mask_of_head: gpu.upload("masks of heads", mask_of_head)?,
        })
    }
}

/// The sizes of one launch: query and key lengths are equal.
#[derive(Clone, Copy)]
pub struct Dims {
    pub(super) heads_q: usize,
    pub(super) heads_kv: usize,
    pub(super) len: usize,
    pub(super) head: HeadDims,
    pub(super) scale: f32,
}

/// Device addresses of a launch's tensors: Q, K, V (16-bit), O and LSE (f32); for the backward
/// also dO (16-bit), D (scratch) and the f32 dQ, dK, dV.
pub(super) struct Tensors {
    pub(super) q: u64,
    pub(super) k: u64,
    pub(super) v: u64,
    pub(super) out: u64,
    pub(super) lse: u64,
}

pub(super) struct GradTensors {
    pub(super) d_out: u64,
    pub(super) delta: u64,
    pub(super) dq: u64,
    pub(super) dk: u64,
    pub(super) dv: u64,
}

/// A TMA descriptor (`CUtensorMap`) as a kernel parameter: 128 opaque bytes, 64-byte aligned.
#[repr(C, align(64))]
#[derive(Clone, Copy)]
pub(super) struct TensorMap([u64; 16]);

impl TensorMap {
    /// No map: what kernels that read by address get.
    pub(super) const ZERO: TensorMap = TensorMap([0; 16]);
}
// SAFETY: plain bytes, passed by value as the kernel's `__grid_constant__ TensorMap`.
unsafe impl DeviceRepr for TensorMap {}

/// The TMA map of a `[heads][len][128]` 16-bit tensor at `address`, read in boxes of 64 columns
/// × `rows` rows with the 128-byte swizzle (the wgmma kernels' panels); rows past `len` read as
/// zeros.
pub(super) fn tensor_map(
    address: u64,
    heads: usize,
    len: usize,
    rows: u64,
    data_type: CUtensorMapDataType,
) -> Result<TensorMap, PluginError> {
    let mut map = TensorMap::ZERO;
    let dims = [128, len as u64, heads as u64];
    let strides = [128 * 2, len as u64 * 128 * 2];
    let boxes = [64u32, rows as u32, 1];
    let element_strides = [1u32; 3];
    // SAFETY: `map` is 128 writable bytes; the arrays hold `rank` (3) entries, strides one fewer.
    unsafe {
        cudarc::driver::sys::cuTensorMapEncodeTiled(
            (&mut map as *mut TensorMap).cast(),
            data_type,
            3,
            address as *mut c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            boxes.as_ptr(),
            element_strides.as_ptr(),
            CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
            CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    }
    .result()
    .map_err(failed("TMA map"))?;
    Ok(map)
}
