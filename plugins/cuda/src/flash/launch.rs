//! Launching the forward and backward kernels: which instructions run a pass, grids, and each
//! launch's parameters.

use std::sync::Arc;

use attnbench_sdk::PluginError;
use cudarc::driver::{CudaStream, LaunchConfig, PushKernelArg};

use super::device::{tensor_map, DeviceTables, Dims, GradTensors, Tensors};
use super::functions::{
    dq_shared_bytes, forward_shared_bytes, forward_threads, hopper_shared_bytes, key_tile_parts,
    key_tile_shared_bytes, Functions, HopperFunctions, HOPPER_DKDV_ROWS, HOPPER_DQ_ROWS,
    HOPPER_DQ_TMA_ROWS, HOPPER_FORWARD_ROWS, HOPPER_FUSED_TMA_ROWS, HOPPER_KEY_TMA_ROWS,
    HOPPER_NARROW_FORWARD_ROWS,
};
use super::params::{FlashParams, Intervals, WorkLists};
use super::{FORWARD_TILE, TILE, WIDE_TILE};
use crate::gpu::failed;

attnbench_sdk::named_enum! {
    /// Which tensor-core instructions the kernels use: mma.sync (any GPU from sm_80), wgmma
    /// (Hopper, head_dim 128; the forward, the split backward, the fused one where the masks keep
    /// 128-row tiles), or wgmma where it runs and mma.sync elsewhere.
    pub enum Instructions { Auto = "auto", Mma = "mma", Wgmma = "wgmma" }
}

attnbench_sdk::named_enum! {
    /// How the wgmma forward hands out its query tiles (`kernels/flash/scheduler.cuh`): a block
    /// per (query head, tile position) on a grid, or one block an SM walking the same order.
    pub enum Schedule { Grid = "grid", Persistent = "persistent" }
}

impl Schedule {
    /// Whether the forward can run this schedule on `hopper` (the wgmma kernels, if it takes
    /// them); an error naming what would.
    pub(super) fn check(self, hopper: Option<&HopperFunctions>) -> Result<(), PluginError> {
        match (self, hopper) {
            (Schedule::Persistent, None) => Err(PluginError::failed(
                "`schedule: persistent` runs on the wgmma forward (Hopper, head_dim 128); use `schedule: grid`",
            )),
            _ => Ok(()),
        }
    }

    /// The launch's grid for `items` (query heads × tile positions) on `multiprocessors` SMs.
    fn grid(self, heads: usize, positions: usize, multiprocessors: usize) -> (u32, u32, u32) {
        match self {
            Schedule::Grid => (heads as u32, positions as u32, 1),
            Schedule::Persistent => ((heads * positions).min(multiprocessors).max(1) as u32, 1, 1),
        }
    }
}

impl Instructions {
    /// The wgmma kernels where this choice takes them (`fits`: the pass can run on them), `None`
    /// for the mma.sync ones; an error where wgmma was asked for and cannot run.
    pub(super) fn hopper(
        self,
        f: &Functions,
        fits: bool,
    ) -> Result<Option<&HopperFunctions>, PluginError> {
        match (self, &f.hopper) {
            (Instructions::Wgmma | Instructions::Auto, Some(hopper)) if fits => Ok(Some(hopper)),
            (Instructions::Wgmma, _) => Err(PluginError::failed(
                "the wgmma kernels run head_dim 128 on Hopper (sm_90): the forward, the split backward, and the fused backward where the masks' blocks keep 128-row tiles; use `instructions: mma` or `auto`",
            )),
            _ => Ok(None),
        }
    }

    /// The wgmma kernels the forward takes (on 128- and 64-row tiles alike).
    pub(super) fn forward(self, f: &Functions) -> Result<Option<&HopperFunctions>, PluginError> {
        self.hopper(f, true)
    }

    /// The wgmma kernels a backward of kind `backward` takes where the forward's tiles have
    /// `forward_rows` rows (the fused one shares the key tiles of two warpgroups' dQ columns, so
    /// it needs the 128-row ones).
    pub(super) fn backward(
        self,
        f: &Functions,
        backward: Backward,
        forward_rows: u64,
    ) -> Result<Option<&HopperFunctions>, PluginError> {
        self.hopper(
            f,
            backward == Backward::Split || forward_rows == FORWARD_TILE,
        )
    }
}

/// A grid of x × y 128-thread CTAs with `shared` bytes of dynamic shared memory: the backward
/// pass's, x the heads and y the tiles where a CTA takes one (head, tile). Blocks start x first,
/// so every head's first tile in the order — its longest list — starts before any head's
/// second: a head's long lists never wait behind the other heads' short ones.
pub(super) fn grid(x: usize, y: usize, shared: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (x as u32, y as u32, 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: shared,
    }
}

/// O and LSE of `x` on `stream`.
///
/// # Safety
/// The addresses hold the extents `dims` gives (Q: heads_q × len × head.qk, O: heads_q × len ×
/// head.v; K: heads_kv × len × head.qk, V: heads_kv × len × head.v; LSE: heads_q × len) and
/// `tables` were built for this mask and length.
pub(super) unsafe fn launch_forward(
    stream: &Arc<CudaStream>,
    f: &Functions,
    dims: Dims,
    x: &Tensors,
    t: &DeviceTables,
    instructions: Instructions,
    schedule: Schedule,
) -> Result<(), PluginError> {
    let rows = t.forward_rows;
    let hopper = instructions.forward(f)?;
    schedule.check(hopper)?;
    let wide = rows == FORWARD_TILE;
    // The wgmma forward on 128-row tiles walks 128-key tiles; the others 64-key ones.
    let lists = match hopper {
        Some(_) if wide => WorkLists {
            start: &t.wide_forward_tile_start,
            tiles: &t.wide_forward_tiles,
            order: Some(&t.wide_forward_order),
        },
        _ => WorkLists {
            start: &t.forward_tile_start,
            tiles: &t.forward_tiles,
            order: Some(&t.forward_order),
        },
    };
    let row_intervals = Intervals {
        start: &t.row_start,
        intervals: &t.intervals,
    };
    let mut params =
        FlashParams::new(stream, dims, x, None, t).walking(stream, &lists, &row_intervals);
    let persistent = schedule == Schedule::Persistent;
    let (function, shared_mem_bytes) = match (hopper, wide) {
        (Some(hopper), true) => (
            if persistent {
                &hopper.forward_tma_persistent
            } else {
                &hopper.forward_tma
            },
            hopper_shared_bytes(HOPPER_FORWARD_ROWS),
        ),
        (Some(hopper), false) => (
            if persistent {
                &hopper.forward_narrow_persistent
            } else {
                &hopper.forward_narrow
            },
            hopper_shared_bytes(HOPPER_NARROW_FORWARD_ROWS),
        ),
        (None, true) => (&f.forward, forward_shared_bytes(rows, dims.head)),
        (None, false) => (&f.forward_narrow, forward_shared_bytes(rows, dims.head)),
    };
    // The TMA forwards read K and V through maps of boxes of their tiles' rows and Q through
    // a map (128-row tiles, Q in shared memory) or its address (64-row tiles, Q in registers);
    // the others read all three through their addresses.
    if let Some(hopper) = hopper {
        params.q_map = tensor_map(x.q, dims.heads_q, dims.len, rows, hopper.tensor_type)?;
        params.k_map = tensor_map(x.k, dims.heads_kv, dims.len, rows, hopper.tensor_type)?;
        params.v_map = tensor_map(x.v, dims.heads_kv, dims.len, rows, hopper.tensor_type)?;
    }
    // One CTA per (query head, query tile) — 128 threads, or with wgmma two consumer
    // warpgroups and a producer, which on 64-row tiles take two query tiles: the heads of a KV
    // group sit side by side in the grid and read the same K and V tiles while they are in L2.
    // The persistent schedule walks the same items with a CTA an SM.
    let (tiles_per_block, threads) = match hopper {
        Some(_) if wide => (1, 3 * 128),
        Some(_) => (2, 3 * 128),
        None => (1, forward_threads(rows, dims.head.qk)),
    };
    let positions = dims.len.div_ceil(rows as usize).div_ceil(tiles_per_block);
    let config = LaunchConfig {
        grid_dim: schedule.grid(dims.heads_q, positions, f.multiprocessors),
        block_dim: (threads, 1, 1),
        shared_mem_bytes,
    };
    let mut launch = stream.launch_builder(function);
    launch.arg(&params);
    // SAFETY: the caller vouches for the extents (above).
    unsafe { launch.launch(config) }
        .map(|_| ())
        .map_err(failed("flash forward"))
}

/// dQ, dK and dV of `x` (its O and LSE from the forward) on `stream`.
///
/// # Safety
/// As [`launch_forward`]; dO is like O, D heads_q × len, dQ like Q, dK like K and dV like V.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn launch_backward(
    stream: &Arc<CudaStream>,
    f: &Functions,
    dims: Dims,
    x: &Tensors,
    g: &GradTensors,
    t: &DeviceTables,
    backward: Backward,
    instructions: Instructions,
) -> Result<(), PluginError> {
    let base = FlashParams::new(stream, dims, x, Some(g), t);
    let rows = dims.heads_q * dims.len;
    let mut launch = stream.launch_builder(&f.delta);
    launch.arg(&base);
    // SAFETY: D has one value per row of dO, O and dQ, which hold rows × d values.
    unsafe { launch.launch(grid(rows.div_ceil(4), 1, 0)) }.map_err(failed("flash backward (D)"))?;

    // The dQ kernels test a partial tile's keys against their rows' intervals, the key-tile
    // kernels its queries against their keys' (columns').
    let row_intervals = Intervals {
        start: &t.row_start,
        intervals: &t.intervals,
    };
    let column_intervals = Intervals {
        start: &t.column_start,
        intervals: &t.column_intervals,
    };
    let tiles = dims.len.div_ceil(TILE as usize);
    // Past head_dim 128 the mma.sync key tiles' columns are split over grid z.
    let key_tiles = |fused| {
        let mut config = grid(
            dims.heads_kv,
            tiles,
            key_tile_shared_bytes(dims.head, fused),
        );
        config.grid_dim.2 = key_tile_parts(dims.head.qk);
        config
    };
    let hopper = instructions.backward(f, backward, t.forward_rows)?;
    // Where the masks' blocks do not split the forward's 128-row tiles, two warpgroups share
    // each tile of the wgmma kernels.
    let wide = t.forward_rows == FORWARD_TILE;
    // 128-key tiles: two warpgroups share each step's Q and dO, a third loads them by TMA,
    // through maps of Q and dO in 64-row boxes (the steps) and K and V in 128-row ones.
    let tma_key_tiles = |rows| LaunchConfig {
        grid_dim: (
            dims.heads_kv as u32,
            dims.len.div_ceil(WIDE_TILE as usize) as u32,
            1,
        ),
        block_dim: (3 * 128, 1, 1),
        shared_mem_bytes: hopper_shared_bytes(rows),
    };
    // The TMA dQ kernel reads K and V through maps of 64-row boxes (its key tiles), Q and dO
    // by address.
    let (mut key_tile_base, mut query_tile_base) = (base, base);
    if let (Some(h), true) = (hopper, wide) {
        let map = |address, heads, rows| tensor_map(address, heads, dims.len, rows, h.tensor_type);
        key_tile_base.q_map = map(x.q, dims.heads_q, TILE)?;
        key_tile_base.k_map = map(x.k, dims.heads_kv, WIDE_TILE)?;
        key_tile_base.v_map = map(x.v, dims.heads_kv, WIDE_TILE)?;
        key_tile_base.do_map = map(g.d_out, dims.heads_q, TILE)?;
        query_tile_base.k_map = map(x.k, dims.heads_kv, TILE)?;
        query_tile_base.v_map = map(x.v, dims.heads_kv, TILE)?;
    }
    let query_tiles =
        |lists: WorkLists<'_>| query_tile_base.walking(stream, &lists, &row_intervals);
    let (dq, dq_params, dq_config) = match hopper {
        // The forward's 128-row tiles (its lists and order, its grid): two warpgroups share
        // each K and V tile.
        Some(h) if wide => (
            &h.dq_tma,
            query_tiles(WorkLists {
                start: &t.forward_tile_start,
                tiles: &t.forward_tiles,
                order: Some(&t.forward_order),
            }),
            LaunchConfig {
                grid_dim: (
                    dims.heads_q as u32,
                    dims.len.div_ceil(FORWARD_TILE as usize) as u32,
                    1,
                ),
                block_dim: (3 * 128, 1, 1),
                shared_mem_bytes: hopper_shared_bytes(HOPPER_DQ_TMA_ROWS),
            },
        ),
        // The order is not read with one warpgroup.
        Some(h) => (
            &h.dq,
            query_tiles(WorkLists {
                start: &t.tile_start,
                tiles: &t.tiles,
                order: Some(&t.forward_order),
            }),
            grid(dims.heads_q, tiles, hopper_shared_bytes(HOPPER_DQ_ROWS)),
        ),
        None => (
            &f.dq,
            query_tiles(WorkLists {
                start: &t.tile_start,
                tiles: &t.tiles,
                order: None,
            }),
            grid(dims.heads_q, tiles, dq_shared_bytes(dims.head)),
        ),
    };
    let wide_key_tiles = key_tile_base.walking(
        stream,
        &WorkLists {
            start: &t.wide_key_tile_start,
            tiles: &t.wide_key_tiles,
            order: Some(&t.wide_key_order),
        },
        &column_intervals,
    );
    let narrow_key_tiles = key_tile_base.walking(
        stream,
        &WorkLists {
            start: &t.key_tile_start,
            tiles: &t.key_tiles,
            order: Some(&t.key_order),
        },
        &column_intervals,
    );
    let (dkdv, dkdv_params, dkdv_config) = match hopper {
        Some(h) if wide => (
            &h.dkdv_tma,
            wide_key_tiles,
            tma_key_tiles(HOPPER_KEY_TMA_ROWS),
        ),
        Some(h) => (
            &h.dkdv,
            narrow_key_tiles,
            grid(dims.heads_kv, tiles, hopper_shared_bytes(HOPPER_DKDV_ROWS)),
        ),
        None => (&f.dkdv, narrow_key_tiles, key_tiles(false)),
    };
    let launches = if backward == Backward::Split {
        vec![
            (dq, dq_params, dq_config, "flash backward (dQ)"),
            (dkdv, dkdv_params, dkdv_config, "flash backward (dK, dV)"),
        ]
    } else {
        let (fused, fused_params, fused_config) = match hopper {
            Some(h) => (
                &h.fused_tma,
                wide_key_tiles,
                tma_key_tiles(HOPPER_FUSED_TMA_ROWS),
            ),
            None => (&f.fused, narrow_key_tiles, key_tiles(true)),
        };
        vec![(fused, fused_params, fused_config, "flash backward")]
    };
    for (kernel, params, config, what) in &launches {
        let mut launch = stream.launch_builder(kernel);
        launch.arg(params);
        // SAFETY: the caller vouches for the extents (above).
        unsafe { launch.launch(*config) }.map_err(failed(what))?;
    }
    Ok(())
}

attnbench_sdk::named_enum! {
    /// How the backward pass computes dQ (see the module's documentation).
    pub enum Backward { Split = "split", Fused = "fused" }
}
