//! The flash kernel: tiles of 128 (forward) or 64 (backward) queries × 64 keys driven by the mask
//! IR — for every query tile, the list of key tiles the mask touches, each marked full (no
//! masking) or partial (masked element-wise from each row's key intervals); empty tiles are never
//! visited. Tensor-core products (mma.sync, f32 accumulation, ldmatrix from swizzled shared
//! tiles filled by cp.async) and an online softmax in registers; bf16 or fp16, head dimension 64
//! or 128, MHA and GQA. The backward pass (`Backward::Split`, deterministic) walks, per key tile,
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

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex};

use attnbench_sdk::attention::{
    require_tensors, AttentionCall, AttentionError, DType, Memory, RowIntervals,
};
use attnbench_sdk::mask::BlockMask;
use attnbench_sdk::reference::{Element, Grads, HeadMasks, Inputs, Shape};
use attnbench_sdk::PluginError;
use cudarc::driver::sys::{
    CUtensorMapDataType, CUtensorMapFloatOOBfill, CUtensorMapInterleave, CUtensorMapL2promotion,
    CUtensorMapSwizzle,
};
use cudarc::driver::{
    CudaFunction, CudaModule, CudaStream, DeviceRepr, LaunchConfig, PushKernelArg,
};

use crate::gpu::{allow_shared, failed, Buffer, Gpu};
use crate::nvrtc::CudaSource;

/// One header of the flash kernel, as `flash.cu` includes it.
macro_rules! header {
    ($name:literal) => {
        (
            concat!("flash/", $name),
            include_str!(concat!("../kernels/flash/", $name)),
        )
    };
}

/// The flash kernel: `flash.cu` and its parts by concern, in the order it includes them.
pub(crate) const SOURCE: CudaSource = CudaSource {
    name: "flash.cu",
    text: include_str!("../kernels/flash.cu"),
    headers: &[
        header!("primitives.cuh"),
        header!("mask.cuh"),
        header!("forward_sm80.cuh"),
        header!("sm90_primitives.cuh"),
        header!("softmax.cuh"),
        header!("epilogue.cuh"),
        header!("pipeline.cuh"),
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
    blocks: Mutex<HashMap<[u8; 32], Arc<DeviceTables>>>,
}

/// Blocks whose work lists [`Kernels`] keeps (all of them are dropped past this many).
const KEPT_BLOCKS: usize = 512;

pub fn compile(gpu: &Gpu) -> Result<Kernels, PluginError> {
    Ok(Kernels {
        module: gpu.compile("the flash kernel", &SOURCE)?,
        blocks: Mutex::new(HashMap::new()),
    })
}

/// What identifies a call's work lists: its lengths, heads and rows.
fn block_digest(call: &AttentionCall<'_>) -> [u8; 32] {
    let mut digest = blake3::Hasher::new();
    for number in [call.q_len, call.k_len, call.heads_q as u64] {
        digest.update(&number.to_le_bytes());
    }
    for list in [&call.row_start, &call.intervals] {
        digest.update(&(list.len() as u64).to_le_bytes());
        let bytes: Vec<u8> = list.iter().flat_map(|value| value.to_le_bytes()).collect();
        digest.update(&bytes);
    }
    digest.finalize().into()
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
/// forward's and the backward's 64-row query tiles — with the forward's query tiles of each mask
/// ordered longest list first; per mask and key tile, the 64-row query tiles that visit it (the
/// backward's dK/dV), for 64-key tiles and for the wgmma kernel's 128-key ones; and per mask,
/// every row's key intervals (CSR over one shared interval array).
#[derive(Debug, PartialEq)]
struct Tables {
    /// The forward's query rows per tile: 128, or 64 when the masks' blocks split 128-row tiles
    /// (block-sparse masks on 64-token blocks: every 128 × 64 tile partial, every row testing
    /// its key intervals, against none at 64 rows).
    forward_rows: u64,
    forward_tile_start: Vec<u32>,
    forward_tiles: Vec<u32>,
    forward_order: Vec<u32>,
    /// The wgmma forward's, at 128 rows × 128 keys.
    wide_forward_tile_start: Vec<u32>,
    wide_forward_tiles: Vec<u32>,
    wide_forward_order: Vec<u32>,
    tile_start: Vec<u32>,
    tiles: Vec<u32>,
    key_tile_start: Vec<u32>,
    key_tiles: Vec<u32>,
    /// Per mask, its key tiles longest list first (the key-tile kernels' start order).
    key_order: Vec<u32>,
    wide_key_tile_start: Vec<u32>,
    wide_key_tiles: Vec<u32>,
    wide_key_order: Vec<u32>,
    row_start: Vec<u32>,
    intervals: Vec<u32>,
    /// Per key, the rows that see it (CSR like the rows'): the key-tile kernels' threads hold
    /// fixed keys and test a partial tile's queries against these.
    column_start: Vec<u32>,
    column_intervals: Vec<u32>,
}

/// One mask as the tables need it: its tiles at the forward's and the backward's sizes, and its
/// rows' key intervals.
struct MaskTiles {
    /// At the forward's wide tiles (128 rows × 64 keys).
    forward: BlockMask,
    /// At the wgmma forward's (128 rows × 128 keys).
    forward_wide: BlockMask,
    backward: BlockMask,
    /// At 64 rows × 128 keys.
    wide_keys: BlockMask,
    rows: RowIntervals,
}

impl MaskTiles {
    /// From a block's rows, as an in-process attention call brings them.
    fn of_rows(rows: RowIntervals, k_len: u64) -> MaskTiles {
        MaskTiles {
            forward: rows.block_mask(k_len, FORWARD_TILE, TILE),
            forward_wide: rows.block_mask(k_len, FORWARD_TILE, WIDE_TILE),
            backward: rows.block_mask(k_len, TILE, TILE),
            wide_keys: rows.block_mask(k_len, TILE, WIDE_TILE),
            rows,
        }
    }

    /// The masks of a benchmark's mask set, their tiles from their slices.
    fn of_set(masks: &HeadMasks) -> Vec<MaskTiles> {
        (0..masks.set.masks.len())
            .map(|index| {
                let mask = &masks.set.masks[index];
                MaskTiles {
                    forward: mask.block_mask(FORWARD_TILE, TILE),
                    forward_wide: mask.block_mask(FORWARD_TILE, WIDE_TILE),
                    backward: mask.block_mask(TILE, TILE),
                    wide_keys: mask.block_mask(TILE, WIDE_TILE),
                    rows: masks.row_intervals(index),
                }
            })
            .collect()
    }
}

/// The forward's query tile for a mask set: 128 rows, unless their partial tiles cover more
/// than twice the rows that 64-row tiles' do and more than a quarter of what 128-row tiles visit
/// (a partial tile tests each row's key intervals; a full one does not).
fn forward_rows(masks: &[MaskTiles]) -> u64 {
    let partial = |blocks: &BlockMask| blocks.full.iter().filter(|full| !**full).count() as u64;
    let (wide, wide_visited, narrow) = masks.iter().fold((0, 0, 0), |(w, v, n), mask| {
        (
            w + partial(&mask.forward),
            v + mask.forward.full.len() as u64,
            n + partial(&mask.backward),
        )
    });
    if wide * FORWARD_TILE > 2 * narrow * TILE && 4 * wide > wide_visited {
        TILE
    } else {
        FORWARD_TILE
    }
}

fn tables(masks: &[MaskTiles]) -> Tables {
    let mut t = Tables {
        forward_rows: FORWARD_TILE,
        forward_tile_start: vec![0],
        forward_tiles: Vec::new(),
        forward_order: Vec::new(),
        wide_forward_tile_start: vec![0],
        wide_forward_tiles: Vec::new(),
        wide_forward_order: Vec::new(),
        tile_start: vec![0],
        tiles: Vec::new(),
        key_tile_start: vec![0],
        key_tiles: Vec::new(),
        key_order: Vec::new(),
        wide_key_tile_start: vec![0],
        wide_key_tiles: Vec::new(),
        wide_key_order: Vec::new(),
        row_start: Vec::new(),
        intervals: Vec::new(),
        column_start: Vec::new(),
        column_intervals: Vec::new(),
    };
    let forward_rows = forward_rows(masks);
    t.forward_rows = forward_rows;
    for mask in masks {
        let blocks = if forward_rows == FORWARD_TILE {
            &mask.forward
        } else {
            &mask.backward
        };
        push_query_lists(
            blocks,
            &mut t.forward_tile_start,
            &mut t.forward_tiles,
            &mut t.forward_order,
        );
        push_query_lists(
            &mask.forward_wide,
            &mut t.wide_forward_tile_start,
            &mut t.wide_forward_tiles,
            &mut t.wide_forward_order,
        );

        let blocks = &mask.backward;
        for q_tile in 0..blocks.q_tiles() as usize {
            for (k_tile, full) in blocks.row(q_tile) {
                t.tiles.push(k_tile | if full { 0 } else { 1 << 31 });
            }
            t.tile_start.push(t.tiles.len() as u32);
        }
        push_key_lists(
            blocks,
            &mut t.key_tile_start,
            &mut t.key_tiles,
            &mut t.key_order,
        );
        push_key_lists(
            &mask.wide_keys,
            &mut t.wide_key_tile_start,
            &mut t.wide_key_tiles,
            &mut t.wide_key_order,
        );
        push_intervals(&mask.rows, &mut t.row_start, &mut t.intervals);
        // The key-tile kernels read a mask's columns on its partial tiles only — the wide ones
        // where the forward keeps 128-row tiles (so the wgmma kernels take them) — and a
        // block-sparse mask on its own block size has none: its columns would cost as many
        // intervals as its rows, hundreds per key at long lengths.
        let partial = |blocks: &BlockMask| blocks.full.iter().any(|full| !full);
        let k_len = mask.rows.row_start.len() - 1;
        let columns = if partial(&mask.backward)
            || (forward_rows == FORWARD_TILE && partial(&mask.wide_keys))
        {
            mask.rows.transpose(k_len)
        } else {
            RowIntervals {
                row_start: vec![0; k_len + 1],
                intervals: Vec::new(),
            }
        };
        push_intervals(&columns, &mut t.column_start, &mut t.column_intervals);
    }
    // No buffer is empty.
    t.intervals.extend([0, 0]);
    t.column_intervals.extend([0, 0]);
    t.forward_tiles.push(0);
    t.wide_forward_tiles.push(0);
    t.tiles.push(0);
    t.key_tiles.push(0);
    t.wide_key_tiles.push(0);
    t
}

/// One mask's intervals appended to a set's: its starts offset past the intervals before it.
fn push_intervals(of: &RowIntervals, start: &mut Vec<u32>, intervals: &mut Vec<u32>) {
    let base = (intervals.len() / 2) as u32;
    start.extend(of.row_start.iter().map(|&first| base + first));
    intervals.extend_from_slice(&of.intervals);
}

/// Per query tile of `blocks`, the key tiles it visits (bit 31: partial), appended to a CSR list,
/// and the query tiles in the order to start them: longest list first.
fn push_query_lists(
    blocks: &BlockMask,
    start: &mut Vec<u32>,
    lists: &mut Vec<u32>,
    order: &mut Vec<u32>,
) {
    let mut lengths = Vec::new();
    for q_tile in 0..blocks.q_tiles() as usize {
        let before = lists.len();
        for (k_tile, full) in blocks.row(q_tile) {
            lists.push(k_tile | if full { 0 } else { 1 << 31 });
        }
        start.push(lists.len() as u32);
        lengths.push(lists.len() - before);
    }
    push_longest_first(lengths.into_iter(), order);
}

/// Per key tile of `blocks`, the query tiles that visit it (bit 31: partial), appended to a CSR
/// list.
fn push_key_lists(
    blocks: &BlockMask,
    start: &mut Vec<u32>,
    lists: &mut Vec<u32>,
    order: &mut Vec<u32>,
) {
    let mut by_key: Vec<Vec<u32>> = vec![Vec::new(); blocks.k_tiles() as usize];
    for q_tile in 0..blocks.q_tiles() as usize {
        for (k_tile, full) in blocks.row(q_tile) {
            by_key[k_tile as usize].push(q_tile as u32 | if full { 0 } else { 1 << 31 });
        }
    }
    push_longest_first(by_key.iter().map(Vec::len), order);
    for list in by_key {
        lists.extend(list);
        start.push(lists.len() as u32);
    }
}

/// The tiles in the order to start their blocks, longest list first (ties by index): the
/// blocks that take longest do not start last and keep SMs busy while the rest end.
fn push_longest_first(lengths: impl Iterator<Item = usize>, order: &mut Vec<u32>) {
    let mut lengths: Vec<(usize, u32)> = lengths.zip(0..).collect();
    lengths.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
    order.extend(lengths.iter().map(|&(_, tile)| tile));
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

/// The kernels of one element type and head dimension.
struct Functions {
    forward: CudaFunction,
    forward_narrow: CudaFunction,
    /// The wgmma kernels (Hopper, head_dim 128), where the module has them.
    hopper: Option<HopperFunctions>,
    delta: CudaFunction,
    dq: CudaFunction,
    dkdv: CudaFunction,
    fused: CudaFunction,
}

impl Kernels {
    fn functions(&self, element: Element, head_dim: usize) -> Result<Functions, PluginError> {
        let suffix = match element {
            Element::F16 => "f16",
            _ => "bf16",
        };
        let function = |kind: &str| {
            let name = format!("flash_{kind}_{suffix}_d{head_dim}");
            self.module
                .load_function(&name)
                .map_err(|err| PluginError::failed(format!("{name}: {err}")))
        };
        Ok(Functions {
            forward: allow_shared(
                function("forward")?,
                forward_shared_bytes(FORWARD_TILE, head_dim),
            )?,
            forward_narrow: allow_shared(
                function("forward_narrow")?,
                forward_shared_bytes(TILE, head_dim),
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
            dq: function("backward_dq")?,
            dkdv: allow_shared(
                function("backward_dkdv")?,
                key_tile_shared_bytes(head_dim, false),
            )?,
            fused: allow_shared(
                function("backward_fused")?,
                key_tile_shared_bytes(head_dim, true),
            )?,
        })
    }
}

/// A mask's work lists and row intervals on the device.
struct DeviceTables {
    forward_rows: u64,
    forward_tile_start: Buffer<u32>,
    forward_tiles: Buffer<u32>,
    forward_order: Buffer<u32>,
    wide_forward_tile_start: Buffer<u32>,
    wide_forward_tiles: Buffer<u32>,
    wide_forward_order: Buffer<u32>,
    tile_start: Buffer<u32>,
    tiles: Buffer<u32>,
    key_tile_start: Buffer<u32>,
    key_tiles: Buffer<u32>,
    key_order: Buffer<u32>,
    wide_key_tile_start: Buffer<u32>,
    wide_key_tiles: Buffer<u32>,
    wide_key_order: Buffer<u32>,
    row_start: Buffer<u32>,
    intervals: Buffer<u32>,
    column_start: Buffer<u32>,
    column_intervals: Buffer<u32>,
    mask_of_head: Buffer<i32>,
}

impl DeviceTables {
    fn upload(gpu: &Gpu, t: &Tables, mask_of_head: &[i32]) -> Result<DeviceTables, PluginError> {
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
    heads_q: usize,
    heads_kv: usize,
    len: usize,
    head_dim: usize,
    scale: f32,
}

/// Device addresses of a launch's tensors: Q, K, V (16-bit), O and LSE (f32); for the backward
/// also dO (16-bit), D (scratch) and the f32 dQ, dK, dV.
struct Tensors {
    q: u64,
    k: u64,
    v: u64,
    out: u64,
    lse: u64,
}

struct GradTensors {
    d_out: u64,
    delta: u64,
    dq: u64,
    dk: u64,
    dv: u64,
}

/// The wgmma kernels of a module compiled for sm_90a.
struct HopperFunctions {
    /// The forward on 128 × 128 tiles: two warpgroups compute, a third loads every tile by TMA.
    forward_tma: CudaFunction,
    /// The 16-bit element type, for the TMA maps.
    tensor_type: CUtensorMapDataType,
    /// The forward on 64 × 64 tiles: two warpgroups compute a query tile each, a third loads
    /// their K and V tiles by TMA.
    forward_narrow: CudaFunction,
    dq: CudaFunction,
    /// dQ on the forward's 128-row tiles: two warpgroups compute, a third loads every K and V
    /// tile by TMA.
    dq_tma: CudaFunction,
    dkdv: CudaFunction,
    /// dK and dV on 128-key tiles: two warpgroups compute, a third loads every tile by TMA.
    dkdv_tma: CudaFunction,
    /// As `dkdv_tma`, dQ added with atomics.
    fused_tma: CudaFunction,
}

attnbench_sdk::named_enum! {
    /// Which tensor-core instructions the kernels use: mma.sync (any GPU from sm_80), wgmma
    /// (Hopper, head_dim 128; the forward, the split backward, the fused one where the masks keep
    /// 128-row tiles), or wgmma where it runs and mma.sync elsewhere.
    pub enum Instructions { Auto = "auto", Mma = "mma", Wgmma = "wgmma" }
}

impl Instructions {
    /// The wgmma kernels where this choice takes them (`fits`: the pass can run on them), `None`
    /// for the mma.sync ones; an error where wgmma was asked for and cannot run.
    fn hopper(self, f: &Functions, fits: bool) -> Result<Option<&HopperFunctions>, PluginError> {
        match (self, &f.hopper) {
            (Instructions::Wgmma | Instructions::Auto, Some(hopper)) if fits => Ok(Some(hopper)),
            (Instructions::Wgmma, _) => Err(PluginError::failed(
                "the wgmma kernels run head_dim 128 on Hopper (sm_90): the forward, the split backward, and the fused backward where the masks' blocks keep 128-row tiles; use `instructions: mma` or `auto`",
            )),
            _ => Ok(None),
        }
    }

    /// The wgmma kernels the forward takes (on 128- and 64-row tiles alike).
    fn forward(self, f: &Functions) -> Result<Option<&HopperFunctions>, PluginError> {
        self.hopper(f, true)
    }

    /// The wgmma kernels a backward of kind `backward` takes where the forward's tiles have
    /// `forward_rows` rows (the fused one shares the key tiles of two warpgroups' dQ columns, so
    /// it needs the 128-row ones).
    fn backward(
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

/// A TMA descriptor (`CUtensorMap`) as a kernel parameter: 128 opaque bytes, 64-byte aligned.
#[repr(C, align(64))]
#[derive(Clone, Copy)]
struct TensorMap([u64; 16]);
// SAFETY: plain bytes, passed by value as the kernel's `__grid_constant__ TensorMap`.
unsafe impl DeviceRepr for TensorMap {}

/// The TMA map of a `[heads][len][128]` 16-bit tensor at `address`, read in boxes of 64 columns
/// × `rows` rows with the 128-byte swizzle (the wgmma kernels' panels); rows past `len` read as
/// zeros.
fn tensor_map(
    address: u64,
    heads: usize,
    len: usize,
    rows: u64,
    data_type: CUtensorMapDataType,
) -> Result<TensorMap, PluginError> {
    let mut map = TensorMap([0; 16]);
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

/// The wgmma kernels' dynamic shared memory for `rows` rows of tiles (16-bit, head_dim 128),
/// with room to align the first tile to 1024 bytes.
fn hopper_shared_bytes(rows: u64) -> u32 {
    (rows as usize * 128 * 2 + 1024) as u32
}
/// The TMA forward's rows: a 128-row Q tile, two 128-key buffers each of K and V.
const HOPPER_FORWARD_ROWS: u64 = FORWARD_TILE + 4 * WIDE_TILE;
/// The TMA forward's on 64-row tiles (Q stays in registers): for each of its two query tiles,
/// three 64-key buffers each of K and V.
const HOPPER_NARROW_FORWARD_ROWS: u64 = 2 * 2 * 3 * TILE;
/// The wgmma dQ kernels' (Q and dO stay in registers): two 64-row buffers each of K and V.
const HOPPER_DQ_ROWS: u64 = 4 * TILE;
/// The TMA dQ kernel's: three 64-row buffers each of K and V.
const HOPPER_DQ_TMA_ROWS: u64 = 6 * TILE;
/// The wgmma dK/dV kernel's: K and V (64 keys each), two 64-row buffers each of Q and dO.
const HOPPER_DKDV_ROWS: u64 = 6 * TILE;
/// The TMA dK/dV kernel's: K and V tiles of 128 keys, two 64-row buffers each of Q and dO.
const HOPPER_KEY_TMA_ROWS: u64 = 2 * WIDE_TILE + 4 * TILE;
/// The fused TMA kernel's: the dK/dV kernel's, then two buffers of dS (64 queries × 128 keys).
const HOPPER_FUSED_TMA_ROWS: u64 = HOPPER_KEY_TMA_ROWS + 2 * TILE;

/// The forward kernel's dynamic shared memory: a Q tile and one K and one V tile, 16-bit.
fn forward_shared_bytes(rows: u64, head_dim: usize) -> u32 {
    ((rows + 2 * TILE) as usize * head_dim * 2) as u32
}

/// The key-tile backward kernel's dynamic shared memory: two stages of 32-row Q and dO tiles,
/// the key tile's K and V, and (fused, for dQ) a step's 32 × 64 dS, all 16-bit.
fn key_tile_shared_bytes(head_dim: usize, fused: bool) -> u32 {
    let rows = 2 * 2 * 32 + 2 * TILE as usize;
    let ds = if fused { 32 * TILE as usize } else { 0 };
    ((rows * head_dim + ds) * 2) as u32
}

/// A grid of x × y 128-thread CTAs with `shared` bytes of dynamic shared memory: the backward
/// pass's, x the heads and y the tiles where a CTA takes one (head, tile). Blocks start x first,
/// so every head's first tile in the order — its longest list — starts before any head's
/// second: a head's long lists never wait behind the other heads' short ones.
fn grid(x: usize, y: usize, shared: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (x as u32, y as u32, 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: shared,
    }
}

/// O and LSE of `x` on `stream`.
///
/// # Safety
/// The addresses hold the extents `dims` gives (Q, O: heads_q × len × head_dim; K, V: heads_kv ×
/// len × head_dim; LSE: heads_q × len) and `tables` were built for this mask and length.
unsafe fn launch_forward(
    stream: &Arc<CudaStream>,
    f: &Functions,
    dims: Dims,
    x: &Tensors,
    t: &DeviceTables,
    instructions: Instructions,
) -> Result<(), PluginError> {
    let (len, group) = (dims.len as i32, (dims.heads_q / dims.heads_kv) as i32);
    let scale_log2 = dims.scale * std::f32::consts::LOG2_E;
    let rows = t.forward_rows;
    let hopper = instructions.forward(f)?;
    let wide = rows == FORWARD_TILE;
    // The wgmma forward on 128-row tiles walks 128-key tiles; the others 64-key ones.
    let (start, tiles, order) = match hopper {
        Some(_) if wide => (
            &t.wide_forward_tile_start,
            &t.wide_forward_tiles,
            &t.wide_forward_order,
        ),
        _ => (&t.forward_tile_start, &t.forward_tiles, &t.forward_order),
    };
    let addresses = [
        x.out,
        x.lse,
        start.address(stream),
        tiles.address(stream),
        order.address(stream),
        t.row_start.address(stream),
        t.intervals.address(stream),
        t.mask_of_head.address(stream),
    ];
    let (function, shared_mem_bytes) = match (hopper, wide) {
        (Some(hopper), true) => (
            &hopper.forward_tma,
            hopper_shared_bytes(HOPPER_FORWARD_ROWS),
        ),
        (Some(hopper), false) => (
            &hopper.forward_narrow,
            hopper_shared_bytes(HOPPER_NARROW_FORWARD_ROWS),
        ),
        (None, true) => (&f.forward, forward_shared_bytes(rows, dims.head_dim)),
        (None, false) => (&f.forward_narrow, forward_shared_bytes(rows, dims.head_dim)),
    };
    // The TMA forwards read K and V through maps of boxes of their tiles' rows and Q through
    // a map (128-row tiles, Q in shared memory) or its address (64-row tiles, Q in registers);
    // the others read all three through their addresses.
    let maps = match hopper {
        Some(hopper) => Some([
            tensor_map(x.q, dims.heads_q, dims.len, rows, hopper.tensor_type)?,
            tensor_map(x.k, dims.heads_kv, dims.len, rows, hopper.tensor_type)?,
            tensor_map(x.v, dims.heads_kv, dims.len, rows, hopper.tensor_type)?,
        ]),
        None => None,
    };
    let mut launch = stream.launch_builder(function);
    match &maps {
        Some(maps) => {
            maps.iter().for_each(|map| {
                launch.arg(map);
            });
            launch.arg(&x.q);
        }
        None => [&x.q, &x.k, &x.v].into_iter().for_each(|address| {
            launch.arg(address);
        }),
    }
    for address in &addresses {
        launch.arg(address);
    }
    launch.arg(&len).arg(&group).arg(&scale_log2);
    // One CTA per (query head, query tile) — 128 threads, or with wgmma two consumer
    // warpgroups and a producer, which on 64-row tiles take two query tiles: the heads of a KV
    // group sit side by side in the grid and read the same K and V tiles while they are in L2.
    let (tiles_per_block, threads) = match hopper {
        Some(_) if wide => (1, 3 * 128),
        Some(_) => (2, 3 * 128),
        None => (1, 128),
    };
    let config = LaunchConfig {
        grid_dim: (
            dims.heads_q as u32,
            dims.len.div_ceil(rows as usize).div_ceil(tiles_per_block) as u32,
            1,
        ),
        block_dim: (threads, 1, 1),
        shared_mem_bytes,
    };
    // SAFETY: the caller vouches for the extents (above).
    unsafe { launch.launch(config) }
        .map(|_| ())
        .map_err(failed("flash forward"))
}

/// dQ, dK and dV of `x` (its O and LSE from the forward) on `stream`.
///
/// # Safety
/// As [`launch_forward`]; dO is heads_q × len × head_dim, D heads_q × len, dQ like Q, dK and dV
/// like K.
#[allow(clippy::too_many_arguments)]
unsafe fn launch_backward(
    stream: &Arc<CudaStream>,
    f: &Functions,
    dims: Dims,
    x: &Tensors,
    g: &GradTensors,
    t: &DeviceTables,
    backward: Backward,
    instructions: Instructions,
) -> Result<(), PluginError> {
    let rows = (dims.heads_q * dims.len) as i32;
    let mut launch = stream.launch_builder(&f.delta);
    launch
        .arg(&g.d_out)
        .arg(&x.out)
        .arg(&g.delta)
        .arg(&g.dq)
        .arg(&rows);
    // SAFETY: D has one value per row of dO, O and dQ, which hold rows × d values.
    unsafe { launch.launch(grid((rows as usize).div_ceil(4), 1, 0)) }
        .map_err(failed("flash backward (D)"))?;

    let (len, group) = (dims.len as i32, (dims.heads_q / dims.heads_kv) as i32);
    let scale_log2 = dims.scale * std::f32::consts::LOG2_E;
    let addresses = [x.q, x.k, x.v, g.d_out].map(KernelInput::Address);
    let statistics = [x.lse, g.delta];
    // The dQ kernels test a partial tile's keys against their rows' intervals, the key-tile
    // kernels its queries against their keys' (columns').
    let (rows, columns) = (
        (&t.row_start, &t.intervals),
        (&t.column_start, &t.column_intervals),
    );
    let lists = |start: &Buffer<u32>,
                 tiles: &Buffer<u32>,
                 order: Option<&Buffer<u32>>,
                 (interval_start, intervals): (&Buffer<u32>, &Buffer<u32>)| {
        let mut lists = vec![start.address(stream), tiles.address(stream)];
        lists.extend(order.map(|order| order.address(stream)));
        lists.extend([
            interval_start.address(stream),
            intervals.address(stream),
            t.mask_of_head.address(stream),
        ]);
        lists
    };
    let tiles = dims.len.div_ceil(TILE as usize);
    let key_tiles = |fused| {
        grid(
            dims.heads_kv,
            tiles,
            key_tile_shared_bytes(dims.head_dim, fused),
        )
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
    let (key_tile_inputs, query_tile_inputs) = match hopper {
        Some(h) if wide => {
            let map =
                |address, heads, rows| tensor_map(address, heads, dims.len, rows, h.tensor_type);
            (
                [
                    map(x.q, dims.heads_q, TILE)?,
                    map(x.k, dims.heads_kv, WIDE_TILE)?,
                    map(x.v, dims.heads_kv, WIDE_TILE)?,
                    map(g.d_out, dims.heads_q, TILE)?,
                ]
                .map(KernelInput::Map),
                [
                    KernelInput::Map(map(x.k, dims.heads_kv, TILE)?),
                    KernelInput::Map(map(x.v, dims.heads_kv, TILE)?),
                    KernelInput::Address(x.q),
                    KernelInput::Address(g.d_out),
                ],
            )
        }
        _ => (addresses, addresses),
    };
    let (dq, dq_lists, dq_config) = match hopper {
        // The forward's 128-row tiles (its lists and order, its grid): two warpgroups share
        // each K and V tile.
        Some(h) if wide => (
            &h.dq_tma,
            lists(
                &t.forward_tile_start,
                &t.forward_tiles,
                Some(&t.forward_order),
                rows,
            ),
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
            lists(&t.tile_start, &t.tiles, Some(&t.forward_order), rows),
            grid(dims.heads_q, tiles, hopper_shared_bytes(HOPPER_DQ_ROWS)),
        ),
        None => (
            &f.dq,
            lists(&t.tile_start, &t.tiles, None, rows),
            grid(dims.heads_q, tiles, 0),
        ),
    };
    let wide_key_lists = || {
        lists(
            &t.wide_key_tile_start,
            &t.wide_key_tiles,
            Some(&t.wide_key_order),
            columns,
        )
    };
    let narrow_key_lists = || lists(&t.key_tile_start, &t.key_tiles, Some(&t.key_order), columns);
    let (dkdv, dkdv_lists, dkdv_config) = match hopper {
        Some(h) if wide => (
            &h.dkdv_tma,
            wide_key_lists(),
            tma_key_tiles(HOPPER_KEY_TMA_ROWS),
        ),
        Some(h) => (
            &h.dkdv,
            narrow_key_lists(),
            grid(dims.heads_kv, tiles, hopper_shared_bytes(HOPPER_DKDV_ROWS)),
        ),
        None => (&f.dkdv, narrow_key_lists(), key_tiles(false)),
    };
    let launches = if backward == Backward::Split {
        vec![
            (
                dq,
                query_tile_inputs,
                vec![g.dq],
                dq_lists,
                dq_config,
                "flash backward (dQ)",
            ),
            (
                dkdv,
                key_tile_inputs,
                vec![g.dq, g.dk, g.dv],
                dkdv_lists,
                dkdv_config,
                "flash backward (dK, dV)",
            ),
        ]
    } else {
        let (fused, fused_lists, fused_config) = match hopper {
            Some(h) => (
                &h.fused_tma,
                wide_key_lists(),
                tma_key_tiles(HOPPER_FUSED_TMA_ROWS),
            ),
            None => (&f.fused, narrow_key_lists(), key_tiles(true)),
        };
        vec![(
            fused,
            key_tile_inputs,
            vec![g.dq, g.dk, g.dv],
            fused_lists,
            fused_config,
            "flash backward",
        )]
    };
    for (kernel, inputs, outputs, tables, config, what) in &launches {
        let mut launch = stream.launch_builder(kernel);
        for input in inputs {
            match input {
                KernelInput::Map(map) => launch.arg(map),
                KernelInput::Address(address) => launch.arg(address),
            };
        }
        for address in statistics.iter().chain(outputs).chain(tables) {
            launch.arg(address);
        }
        launch
            .arg(&len)
            .arg(&group)
            .arg(&dims.scale)
            .arg(&scale_log2);
        // SAFETY: the caller vouches for the extents (above).
        unsafe { launch.launch(*config) }.map_err(failed(what))?;
    }
    Ok(())
}

/// A 16-bit input of a backward kernel: its address, or its TMA map.
#[derive(Clone, Copy)]
enum KernelInput {
    Address(u64),
    Map(TensorMap),
}

attnbench_sdk::named_enum! {
    /// How the backward pass computes dQ (see the module's documentation).
    pub enum Backward { Split = "split", Fused = "fused" }
}

/// What only the backward pass needs.
struct Gradients {
    d_out: Buffer<u8>,
    delta: Buffer<f32>,
    dq: Buffer<f32>,
    dk: Buffer<f32>,
    dv: Buffer<f32>,
}

pub struct Problem {
    dims: Dims,
    q: Buffer<u8>,
    k: Buffer<u8>,
    v: Buffer<u8>,
    pub out: Buffer<f32>,
    pub lse: Buffer<f32>,
    tables: DeviceTables,
    functions: Functions,
    grad: Option<Gradients>,
    pub backward: Backward,
    pub instructions: Instructions,
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
        let mask_of_head: Vec<i32> = masks.index_of_head.iter().map(|&i| i as i32).collect();
        let tables = DeviceTables::upload(gpu, &tables(&MaskTiles::of_set(masks)), &mask_of_head)?;
        let grad = if backward {
            Some(Gradients {
                d_out: gpu.upload("dO", &element.encode(&inputs.d_out))?,
                delta: gpu.alloc("D", shape.heads_q * shape.seqlen)?,
                dq: gpu.alloc("dQ", shape.q_len())?,
                dk: gpu.alloc("dK", shape.kv_len())?,
                dv: gpu.alloc("dV", shape.kv_len())?,
            })
        } else {
            None
        };
        Ok(Problem {
            dims: Dims {
                heads_q: shape.heads_q,
                heads_kv: shape.heads_kv,
                len: shape.seqlen,
                head_dim: shape.head_dim,
                scale: shape.scale(),
            },
            q: gpu.upload("Q", &element.encode(&inputs.q))?,
            k: gpu.upload("K", &element.encode(&inputs.k))?,
            v: gpu.upload("V", &element.encode(&inputs.v))?,
            out: gpu.alloc("O", shape.q_len())?,
            lse: gpu.alloc("LSE", shape.heads_q * shape.seqlen)?,
            tables,
            functions: kernels.functions(element, shape.head_dim)?,
            grad,
            backward: Backward::Split,
            instructions: Instructions::Auto,
        })
    }

    /// The instructions (`wgmma` or `mma`) the forward runs on here, and the backward's where
    /// the problem has one; an error where the choice cannot run.
    pub fn instructions_used(&self) -> Result<(&'static str, Option<&'static str>), PluginError> {
        let name =
            |hopper: Option<&HopperFunctions>| if hopper.is_some() { "wgmma" } else { "mma" };
        let (instructions, f) = (self.instructions, &self.functions);
        let backward = match self.grad {
            Some(_) => Some(name(instructions.backward(
                f,
                self.backward,
                self.tables.forward_rows,
            )?)),
            None => None,
        };
        Ok((name(instructions.forward(f)?), backward))
    }

    fn tensors(&self, gpu: &Gpu) -> Tensors {
        let stream = &gpu.stream;
        Tensors {
            q: self.q.address(stream),
            k: self.k.address(stream),
            v: self.v.address(stream),
            out: self.out.address(stream),
            lse: self.lse.address(stream),
        }
    }

    pub fn forward(&self, gpu: &Gpu) -> Result<(), PluginError> {
        // SAFETY: the buffers were allocated for these dimensions and the tables built for this
        // mask set and length.
        unsafe {
            launch_forward(
                &gpu.stream,
                &self.functions,
                self.dims,
                &self.tensors(gpu),
                &self.tables,
                self.instructions,
            )
        }
    }

    /// dQ, dK and dV from the forward pass's O and LSE (the forward must have run).
    pub fn backward(&self, gpu: &Gpu) -> Result<(), PluginError> {
        let Some(grad) = &self.grad else {
            return Err(PluginError::failed(
                "the problem was uploaded without backward buffers",
            ));
        };
        let stream = &gpu.stream;
        let g = GradTensors {
            d_out: grad.d_out.address(stream),
            delta: grad.delta.address(stream),
            dq: grad.dq.address(stream),
            dk: grad.dk.address(stream),
            dv: grad.dv.address(stream),
        };
        // SAFETY: as in `forward`; the gradient buffers were allocated for these dimensions.
        unsafe {
            launch_backward(
                stream,
                &self.functions,
                self.dims,
                &self.tensors(gpu),
                &g,
                &self.tables,
                self.backward,
                self.instructions,
            )
        }
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

/// What of `call` the flash kernel runs (its element type and sizes), or why it cannot; checked
/// before any device work, so a caller with host memory hears why rather than about the GPU.
pub fn accepts(call: &AttentionCall<'_>) -> Result<(Element, Dims), AttentionError> {
    let element = match call.input {
        DType::Bf16 => Element::Bf16,
        DType::F16 => Element::F16,
        other => {
            return Err(AttentionError::Unsupported(format!(
                "the flash kernel takes bf16 or fp16 inputs, not {other:?}"
            )))
        }
    };
    if call.memory != Memory::Cuda || call.output != DType::F32 {
        return Err(AttentionError::Unsupported(format!(
            "the flash kernel runs device memory with f32 outputs, not {:?} memory with {:?} outputs",
            call.memory, call.output
        )));
    }
    let (hq, hkv, d) = (
        call.heads_q as usize,
        call.heads_kv as usize,
        call.head_dim as usize,
    );
    if d != 64 && d != 128 {
        return Err(AttentionError::Unsupported(format!(
            "the flash kernel is compiled for head_dim 64 and 128, not {d}"
        )));
    }
    if call.q_len != call.k_len {
        return Err(AttentionError::Unsupported(format!(
            "the flash kernel runs blocks of as many queries as keys, not {} × {}",
            call.q_len, call.k_len
        )));
    }
    if hkv == 0
        || hq % hkv != 0
        || call.kv_head_of.len() != hq
        || call
            .kv_head_of
            .iter()
            .enumerate()
            .any(|(h, &kv)| kv as usize != h / (hq / hkv))
    {
        return Err(AttentionError::Unsupported(format!(
            "the flash kernel maps query head h to KV head h / (heads_q / heads_kv); the call's kv_head_of for {hq} query and {hkv} KV heads does not"
        )));
    }
    require_tensors(call)?;
    let dims = Dims {
        heads_q: hq,
        heads_kv: hkv,
        len: call.q_len as usize,
        head_dim: d,
        scale: call.scale as f32,
    };
    Ok((element, dims))
}

/// One block of an in-process attention call (see `attnbench_sdk::attention`) on the caller's
/// device pointers, ordered after the work already on its stream and before what it queues
/// next. Runs bf16/fp16 inputs with f32 outputs, equal query and key lengths (every block the
/// context-parallel methods make) and the usual KV-head grouping; refuses the rest with why.
pub fn attend(
    gpu: &Gpu,
    kernels: &Kernels,
    call: &AttentionCall<'_>,
) -> Result<(), AttentionError> {
    let (element, dims) = accepts(call)?;
    let (hq, len) = (dims.heads_q, dims.len);
    let as_message = |err: PluginError| AttentionError::Failed(err.to_string());
    let digest = block_digest(call);
    let kept = kernels
        .blocks
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get(&digest)
        .cloned();
    let tables = match kept {
        Some(tables) => tables,
        None => {
            let rows = RowIntervals::of_call(call)?;
            let made = Arc::new(
                DeviceTables::upload(
                    gpu,
                    &tables(&[MaskTiles::of_rows(rows, call.k_len)]),
                    &vec![0; hq],
                )
                .map_err(as_message)?,
            );
            let mut blocks = kernels.blocks.lock().unwrap_or_else(|e| e.into_inner());
            if blocks.len() >= KEPT_BLOCKS {
                blocks.clear();
            }
            blocks.insert(digest, made.clone());
            made
        }
    };
    let functions = kernels
        .functions(element, dims.head_dim)
        .map_err(as_message)?;
    let address = |p: *const c_void| p as u64;
    let x = Tensors {
        q: address(call.q),
        k: address(call.k),
        v: address(call.v),
        out: address(call.out),
        lse: address(call.lse),
    };
    let caller = call.stream as cudarc::driver::sys::CUstream;
    // The caller's queued work first, ours next, and the caller's later work after ours.
    follow(caller, gpu.stream.cu_stream()).map_err(|err| {
        AttentionError::Failed(format!("ordering after the caller's stream: {err}"))
    })?;
    let delta = if call.backward {
        Some(gpu.alloc::<f32>("D", hq * len).map_err(as_message)?)
    } else {
        None
    };
    // SAFETY: the call's contract gives these extents to its pointers (AttentionCall); the tables
    // were built from its rows.
    let launched = unsafe {
        match &delta {
            None => launch_forward(
                &gpu.stream,
                &functions,
                dims,
                &x,
                &tables,
                Instructions::Auto,
            ),
            Some(delta) => {
                let g = GradTensors {
                    d_out: address(call.d_out),
                    delta: delta.address(&gpu.stream),
                    dq: address(call.dq as *const c_void),
                    dk: address(call.dk as *const c_void),
                    dv: address(call.dv as *const c_void),
                };
                launch_backward(
                    &gpu.stream,
                    &functions,
                    dims,
                    &x,
                    &g,
                    &tables,
                    Backward::Split,
                    Instructions::Auto,
                )
            }
        }
    };
    launched.map_err(as_message)?;
    follow(gpu.stream.cu_stream(), caller).map_err(|err| {
        AttentionError::Failed(format!(
            "ordering the caller's stream after the kernels: {err}"
        ))
    })
}

/// Makes `later` wait for the work queued on `earlier` so far (an event between them).
pub(crate) fn follow(
    earlier: cudarc::driver::sys::CUstream,
    later: cudarc::driver::sys::CUstream,
) -> Result<(), cudarc::driver::DriverError> {
    use cudarc::driver::result::{event, stream};
    use cudarc::driver::sys::{CUevent_flags, CUevent_wait_flags};
    let marker = event::create(CUevent_flags::CU_EVENT_DISABLE_TIMING)?;
    // SAFETY: both streams belong to this process's context; an event may be destroyed while
    // work still waits on it (its resources go once that work completes).
    unsafe {
        let ordered = event::record(marker, earlier).and_then(|_| {
            stream::wait_event(later, marker, CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT)
        });
        let _ = event::destroy(marker);
        ordered
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use attnbench_sdk::mask::{window_slices, HeadScope, Mask, MaskSet, Slice, SliceKind};

    /// The tables an in-process call builds from its rows are the benchmark's, built from slices
    /// (at a length that is no multiple of any tile).
    #[test]
    fn tables_from_rows_equal_tables_from_slices() {
        let s = 1000u64;
        let square = |slices| Mask::square(s, slices).expect("a valid mask");
        let mut global = window_slices([0, s], [0, s], 96, 0);
        global.push(Slice::new([0, s], [0, 24], SliceKind::Full));
        let masks = vec![
            square(vec![Slice::new([0, s], [0, s], SliceKind::Causal)]),
            square(vec![
                Slice::new([0, 300], [0, 300], SliceKind::Full),
                Slice::new([300, s], [300, s], SliceKind::Causal),
            ]),
            square(window_slices([0, s], [0, s], 130, 70)),
            square(global),
        ];
        let set = MaskSet {
            pattern: "mixed".into(),
            seqlen: s,
            params: Default::default(),
            documents: Vec::new(),
            scope: HeadScope::PerHead,
            masks,
        };
        let shape = Shape {
            heads_q: 4,
            heads_kv: 2,
            seqlen: s as usize,
            head_dim: 64,
            head_dim_v: None,
        };
        let from_slices = tables(&MaskTiles::of_set(&HeadMasks::new(&set, &shape)));
        let all: Vec<u32> = (0..s as u32).collect();
        let from_rows: Vec<MaskTiles> = set
            .masks
            .iter()
            .map(|mask| MaskTiles::of_rows(RowIntervals::restrict(mask, &all, &all), s))
            .collect();
        assert_eq!(tables(&from_rows), from_slices);
    }

    /// The length and tables of a mask whose windows and first columns cut tiles of both sizes
    /// at many places, for the tests that compare 128-key lists with pairs of 64-key ones.
    const PAIRED_TILES_LEN: u64 = 1000;
    fn paired_tiles_tables() -> Tables {
        let s = PAIRED_TILES_LEN;
        let all: Vec<u32> = (0..s as u32).collect();
        let mut slices = window_slices([0, s], [0, s], 130, 70);
        slices.push(Slice::new([0, s], [0, 24], SliceKind::Full));
        let mask = Mask::square(s, slices).expect("a valid mask");
        tables(&[MaskTiles::of_rows(
            RowIntervals::restrict(&mask, &all, &all),
            s,
        )])
    }

    /// Entry `i` of a CSR work list: (tile, full).
    fn list(start: &[u32], tiles: &[u32], i: usize) -> Vec<(u32, bool)> {
        tiles[start[i] as usize..start[i + 1] as usize]
            .iter()
            .map(|entry| (entry & 0x7fff_ffff, entry >> 31 == 0))
            .collect()
    }

    /// The wgmma dK/dV kernel's lists for 128-key tiles hold, per pair of 64-key tiles, the query
    /// tiles that visit either, full where every half inside the sequence holds them full.
    #[test]
    fn wide_key_lists_join_pairs_of_key_tiles() {
        let (s, t) = (PAIRED_TILES_LEN, paired_tiles_tables());
        let key_tiles = s.div_ceil(TILE) as usize;
        assert_eq!(
            t.wide_key_tile_start.len(),
            s.div_ceil(WIDE_TILE) as usize + 1
        );
        for wide in 0..s.div_ceil(WIDE_TILE) as usize {
            let halves: Vec<Vec<(u32, bool)>> = [2 * wide, 2 * wide + 1]
                .into_iter()
                .filter(|&k| k < key_tiles)
                .map(|k| list(&t.key_tile_start, &t.key_tiles, k))
                .collect();
            let mut expected: Vec<(u32, bool)> = halves
                .iter()
                .flatten()
                .map(|&(q, _)| q)
                .collect::<std::collections::BTreeSet<_>>()
                .into_iter()
                .map(|q| (q, halves.iter().all(|half| half.contains(&(q, true)))))
                .collect();
            expected.sort();
            assert_eq!(
                list(&t.wide_key_tile_start, &t.wide_key_tiles, wide),
                expected,
                "wide key tile {wide}"
            );
        }
    }

    /// The wgmma forward's lists for 128-key tiles hold, per 128-row query tile, the pairs of
    /// 64-key tiles its 64-key list visits, full where every half inside the sequence is full.
    #[test]
    fn wide_forward_lists_join_pairs_of_key_tiles() {
        let (s, t) = (PAIRED_TILES_LEN, paired_tiles_tables());
        let key_tiles = s.div_ceil(TILE) as u32;
        for q_tile in 0..s.div_ceil(FORWARD_TILE) as usize {
            let narrow = list(&t.forward_tile_start, &t.forward_tiles, q_tile);
            let mut expected: Vec<(u32, bool)> = narrow
                .iter()
                .map(|&(k, _)| k / 2)
                .collect::<std::collections::BTreeSet<_>>()
                .into_iter()
                .map(|wide| {
                    let full = [2 * wide, 2 * wide + 1]
                        .into_iter()
                        .filter(|&k| k < key_tiles)
                        .all(|k| narrow.contains(&(k, true)));
                    (wide, full)
                })
                .collect();
            expected.sort();
            assert_eq!(
                list(&t.wide_forward_tile_start, &t.wide_forward_tiles, q_tile),
                expected,
                "query tile {q_tile}"
            );
        }
        assert_eq!(t.wide_forward_order.len(), t.forward_order.len());
    }

    /// For every mask of a set, the column tables (what the key-tile kernels test a partial
    /// step's queries against) allow exactly what the row tables do, read as the kernels read
    /// them: `start[mask · (len + 1) + position]`, offsets into the set's interval array.
    #[test]
    fn column_tables_allow_what_row_tables_allow() {
        let s = 300u64;
        let all: Vec<u32> = (0..s as u32).collect();
        let window = Mask::square(s, window_slices([0, s], [0, s], 40, 25)).expect("a valid mask");
        let mut slices = vec![Slice::new([0, 120], [0, 120], SliceKind::Causal)];
        slices.push(Slice::new([120, s], [120, s], SliceKind::Full));
        slices.push(Slice::new([200, s], [0, 16], SliceKind::Full));
        let documents = Mask::square(s, slices).expect("a valid mask");
        let t = tables(
            &[window, documents]
                .iter()
                .map(|mask| MaskTiles::of_rows(RowIntervals::restrict(mask, &all, &all), s))
                .collect::<Vec<_>>(),
        );
        let holds = |start: &[u32], intervals: &[u32], mask: usize, at: usize, x: usize| {
            let base = mask * (s as usize + 1) + at;
            (start[base]..start[base + 1]).any(|i| {
                intervals[2 * i as usize] as usize <= x
                    && x < intervals[2 * i as usize + 1] as usize
            })
        };
        for mask in 0..2 {
            for r in 0..s as usize {
                for k in 0..s as usize {
                    assert_eq!(
                        holds(&t.row_start, &t.intervals, mask, r, k),
                        holds(&t.column_start, &t.column_intervals, mask, k, r),
                        "mask {mask}, row {r}, key {k}"
                    );
                }
            }
        }
    }

    /// Every order list holds each tile of its mask once, longest work list first.
    #[test]
    fn orders_start_the_longest_lists_first() {
        let t = paired_tiles_tables();
        for (start, order) in [
            (&t.forward_tile_start, &t.forward_order),
            (&t.wide_forward_tile_start, &t.wide_forward_order),
            (&t.key_tile_start, &t.key_order),
            (&t.wide_key_tile_start, &t.wide_key_order),
        ] {
            let length = |tile: u32| start[tile as usize + 1] - start[tile as usize];
            let mut sorted = order.clone();
            sorted.sort_unstable();
            assert_eq!(sorted, (0..order.len() as u32).collect::<Vec<_>>());
            assert_eq!(start.len(), order.len() + 1);
            assert!(order.windows(2).all(|w| length(w[0]) >= length(w[1])));
        }
    }

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

    /// Every static mask of the catalogue keeps 128-row forward tiles (the 64-row ones are
    /// slower on them); block-sparse masks take 64-row tiles on 64-token blocks only.
    #[test]
    fn catalogue_masks_choose_their_forward_tiles() {
        use attnbench_mask_catalogue::{generate, Params, Pattern};
        use attnbench_sdk::histogram::{Bucket, Histogram};
        let histogram = Histogram {
            buckets: vec![Bucket {
                lo: 64,
                hi: 4096,
                weight: 1.0,
            }],
        };
        let s = 8192u64;
        let shape = Shape {
            heads_q: 8,
            heads_kv: 1,
            seqlen: s as usize,
            head_dim: 64,
            head_dim_v: None,
        };
        let rows_of = |params: &Params| {
            let set = generate(params, &histogram, 3).expect("a catalogue mask");
            tables(&MaskTiles::of_set(&HeadMasks::new(&set, &shape))).forward_rows
        };
        for &pattern in Pattern::ALL
            .iter()
            .filter(|p| !p.as_str().starts_with("block_sparse"))
        {
            assert_eq!(rows_of(&Params::new(pattern, s)), 128, "{pattern}");
        }
        for (block, rows) in [(64, 64), (128, 128)] {
            let params = Params {
                sparse_block: block,
                heads_q: 8,
                heads_kv: 1,
                ..Params::new(Pattern::BlockSparseUniform, s)
            };
            assert_eq!(rows_of(&params), rows, "block {block}");
        }
    }

    /// Block-sparse masks on 64-token blocks split 128-row forward tiles (every visited one
    /// partial): their forward runs 64-row tiles, all full; causal keeps 128-row tiles.
    #[test]
    fn forward_tiles_follow_the_masks_blocks() {
        let s = 1024u64;
        let all: Vec<u32> = (0..s as u32).collect();
        let rows_of = |mask: &Mask| {
            tables(&[MaskTiles::of_rows(
                RowIntervals::restrict(mask, &all, &all),
                s,
            )])
        };
        let causal = Mask::square(s, vec![Slice::new([0, s], [0, s], SliceKind::Causal)])
            .expect("a valid mask");
        assert_eq!(rows_of(&causal).forward_rows, 128);
        // A checkerboard of 64-token blocks.
        let blocks = (0..s / 64)
            .flat_map(|i| (0..s / 64).map(move |j| (i, j)))
            .filter(|(i, j)| (i + j) % 2 == 0)
            .map(|(i, j)| {
                Slice::new(
                    [i * 64, i * 64 + 64],
                    [j * 64, j * 64 + 64],
                    SliceKind::Full,
                )
            })
            .collect();
        let sparse = Mask::square(s, blocks).expect("a valid mask");
        let t = rows_of(&sparse);
        assert_eq!(t.forward_rows, 64);
        assert_eq!(t.forward_tile_start.len() as u64, s / 64 + 1);
        assert!(t.forward_tiles[..t.forward_tiles.len() - 1]
            .iter()
            .all(|entry| entry >> 31 == 0));
    }
}
