// attnbench flash attention. Forward: one CTA per (128-row query tile, query head), 4 warps of 32
// rows; 64-key tiles from the mask IR's per-tile work list (full tiles unmasked, partial tiles
// masked element-wise from each row's key intervals, empty tiles never visited); QKᵀ and PV on
// tensor cores (mma.sync m16n8k16, f32 accumulation) fed by ldmatrix from swizzled shared tiles
// that cp.async fills while the previous product runs; online softmax in registers.
// Rows with no allowed key: O = 0, LSE = −∞.
// Backward (deterministic: every output has one writer): D = rowsum(dO∘O); dK and dV per
// (64-key tile, KV head), summing the group's query heads in order over the query tiles that
// touch the key tile (the transposed work list); dQ per (64-row query tile, query head).
// On sm_90a the same work lists drive warpgroup-MMA kernels (head_dim 128), warp-specialised
// with TMA loads where the masks keep 128-row tiles (flash/forward_sm90.cuh).
//
// The parts, by concern, under flash/; included in this order, each after what it uses.
#include "flash/primitives.cuh"
#include "flash/params.cuh"
#include "flash/mask.cuh"
#include "flash/forward_sm80.cuh"
#include "flash/sm90_primitives.cuh"
#include "flash/softmax.cuh"
#include "flash/epilogue.cuh"
#include "flash/pipeline.cuh"
#include "flash/scheduler.cuh"
#include "flash/forward_sm90.cuh"
#include "flash/work_lists.cuh"
#include "flash/backward_sm80.cuh"
#include "flash/backward_sm90.cuh"

// The mma.sync kernels of every element type (1: bf16, 2: fp16) and head dims (Q's and K's, then
// V's): names end in _d{D}, or _d{D}_v{DV} where V's differs (flash/functions.rs looks them up).
#define FLASH_KERNELS(SUFFIX, E, D, DV) FLASH_FORWARD(SUFFIX, E, D, DV) FLASH_BACKWARD(SUFFIX, E, D, DV)
#define FLASH_KERNELS_OF(ELEMENT, E) \
    FLASH_KERNELS(ELEMENT##_d64, E, 64, 64) \
    FLASH_KERNELS(ELEMENT##_d96, E, 96, 96) \
    FLASH_KERNELS(ELEMENT##_d128, E, 128, 128) \
    FLASH_KERNELS(ELEMENT##_d192, E, 192, 192) \
    FLASH_KERNELS(ELEMENT##_d192_v128, E, 192, 128) \
    FLASH_KERNELS(ELEMENT##_d256, E, 256, 256)
FLASH_KERNELS_OF(bf16, 1)
FLASH_KERNELS_OF(f16, 2)
