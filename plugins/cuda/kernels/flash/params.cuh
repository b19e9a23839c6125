// Every flash kernel's one parameter: what a launch reads, by name. The host fills a
// `FlashParams` (plugins/cuda/src/flash/params.rs, #[repr(C)]) per launch. The asserts below pin
// its size and alignment; a test on the host compiles a probe of every field's offset with NVRTC
// and compares them with the Rust struct's (NVRTC 13.0 has no offsetof in constant expressions).
#pragma once

// A TMA descriptor (CUtensorMap): 128 opaque bytes, 64-byte aligned.
struct __align__(64) TensorMap { unsigned long long opaque[16]; };

struct FlashParams {
    // The forward's fields first, in its old argument order: the mma.sync forward's register
    // allocation (255 registers, with spills at head_dim 128) follows the parameters' layout.
    const u16* __restrict__ q;
    const u16* __restrict__ k;
    const u16* __restrict__ v;
    float* __restrict__ out;
    float* __restrict__ lse;
    // The launch's work lists: per tile of its grid the tiles it visits (bit 31: partial), CSR,
    // and the order to start the tiles.
    const unsigned* __restrict__ tile_start;
    const unsigned* __restrict__ tiles;
    const unsigned* __restrict__ order;
    // The intervals a partial tile tests: the rows' keys (forward, dQ) or the keys' rows (dK/dV).
    const unsigned* __restrict__ interval_start;
    const unsigned* __restrict__ intervals;
    const int* __restrict__ mask_of_head;
    int seqlen;
    int group;
    float scale_log2;
    float scale;
    // The backward's.
    const u16* __restrict__ d_out;
    float* __restrict__ delta;
    float* __restrict__ dq;
    float* __restrict__ dk;
    float* __restrict__ dv;
    // Rows of O (heads_q · seqlen), for the D kernel.
    int rows;
    // Query heads, for the persistent scheduler's items.
    int heads;
    // The TMA kernels' maps of their 16-bit inputs (boxes of the rows each kernel's tiles take);
    // zeros for the others.
    TensorMap q_map, k_map, v_map, do_map;
};

static_assert(sizeof(FlashParams) == 704, "FlashParams changed size: update params.rs");
static_assert(alignof(FlashParams) == 64, "FlashParams changed alignment: update params.rs");
