// Types, tile sizes and the mma.sync-era primitives every flash kernel uses: 16-bit packing and
// conversion, tensor-core products, cp.async copies, ldmatrix fragments of swizzled tiles.
#pragma once

#define BM 64
#define BN 64
#define THREADS 128
// The largest head dim whose mma.sync kernels keep a warp's 32 rows of accumulators, or Q's and
// dO's fragments beside dQ's, in registers; past it they change layout (see each kernel and
// flash/functions.rs).
#define RESIDENT_HEAD_DIM 128

typedef unsigned short u16;
typedef unsigned int u32;

template <int E> __device__ __forceinline__ u32 pack2(float lo, float hi);
template <> __device__ __forceinline__ u32 pack2<1>(float lo, float hi) {
    u32 r; asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo)); return r;
}
template <> __device__ __forceinline__ u32 pack2<2>(float lo, float hi) {
    u32 r; asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo)); return r;
}

template <int E> __device__ __forceinline__ void mma(float* c, const u32* a, const u32* b);
template <> __device__ __forceinline__ void mma<1>(float* c, const u32* a, const u32* b) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
template <> __device__ __forceinline__ void mma<2>(float* c, const u32* a, const u32* b) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// A shared tile's row: D elements rounded up to a multiple of 64 (eight 16-byte chunks), so that
// the swizzle below stays inside its row (head_dim 96 takes rows of 128; 64, 128, 192, 256 their own).
template <int D> __host__ __device__ constexpr int tile_stride() { return (D + 63) / 64 * 64; }

// Shared tiles are stored swizzled: 16-byte chunk c of row r sits at chunk c ^ (r mod 8) of that
// row, so the 8 rows an ldmatrix (or a fragment load) touches fall into 8 different banks.
template <int D> __device__ __forceinline__ int swizzled(int row, int chunk) { return row * tile_stride<D>() + ((chunk ^ (row & 7)) << 3); }

__device__ __forceinline__ u32 shared_address(const void* p) { return (u32)__cvta_generic_to_shared(p); }

// 16 bytes global → shared without a register round trip; `valid` false writes zeros.
__device__ __forceinline__ void copy_async(void* dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(shared_address(dst)), "l"(src), "r"(valid ? 16 : 0) : "memory");
}
__device__ __forceinline__ void commit_copies() { asm volatile("cp.async.commit_group;" ::: "memory"); }
// Waits until at most N of this thread's committed copy groups are still in flight.
template <int N> __device__ __forceinline__ void wait_copies() { asm volatile("cp.async.wait_group %0;" :: "n"(N) : "memory"); }

// Starts copying ROWS × D 16-bit elements (global rows of width D) into a swizzled shared tile
// (rows of tile_stride<D>());
// rows at or past `valid` become zeros (keys past the end must not carry NaN into P·V).
template <int ROWS, int D, int NT>
__device__ __forceinline__ void load_tile_async(u16* dst, const u16* src, int valid) {
    constexpr int chunks = D / 8;
    #pragma unroll
    for (int i = threadIdx.x; i < ROWS * chunks; i += NT) {
        const int row = i / chunks, chunk = i % chunks;
        const bool in = row < valid;
        copy_async(dst + swizzled<D>(row, chunk), src + (size_t)(in ? row : 0) * D + chunk * 8, in);
    }
}

// Four 8×8 matrices of a swizzled tile into fragments: lane l names row `row0 + (l mod 8)` of
// matrix l / 8. `.trans` hands each thread a column pair instead of a row pair.
__device__ __forceinline__ void ldmatrix_x4(u32* r, const u16* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(shared_address(p)) : "memory");
}
__device__ __forceinline__ void ldmatrix_x4_trans(u32* r, const u16* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(shared_address(p)) : "memory");
}

// The A fragment (16 rows at row0 × 16 columns at kk·16) of a swizzled row-major tile.
template <int D> __device__ __forceinline__ void a_fragment(u32* a, const u16* tile, int row0, int kk) {
    const int lane = threadIdx.x & 31, m = lane >> 3;
    ldmatrix_x4(a, tile + swizzled<D>(row0 + (m & 1) * 8 + (lane & 7), kk * 2 + (m >> 1)));
}
// B fragments of Xᵀ for two 8-column blocks (rows n16..n16+15 of X) × 16 of D at kk·16, from a
// swizzled row-major tile X: b[0..1] for rows n16..+7, b[2..3] for rows n16+8..+15.
template <int D> __device__ __forceinline__ void bt_fragments(u32* b, const u16* tile, int n16, int kk) {
    const int lane = threadIdx.x & 31, m = lane >> 3;
    ldmatrix_x4(b, tile + swizzled<D>(n16 + (m >> 1) * 8 + (lane & 7), kk * 2 + (m & 1)));
}
// B fragments of X for 16 rows at k16 × two 8-column blocks at chunk c2·2 (columns c2·16..+15),
// from a swizzled row-major tile X: b[0..1] for the first 8 columns, b[2..3] for the next.
template <int D> __device__ __forceinline__ void b_fragments(u32* b, const u16* tile, int k16, int c2) {
    const int lane = threadIdx.x & 31, m = lane >> 3;
    ldmatrix_x4_trans(b, tile + swizzled<D>(k16 + (m & 1) * 8 + (lane & 7), c2 * 2 + (m >> 1)));
}

// 2^x on the special-function unit; 2^−∞ = 0, which masked scores rely on.
__device__ __forceinline__ float fast_exp2(float x) { float y; asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x)); return y; }

template <int E> __device__ __forceinline__ float to_float(u16 x);
template <> __device__ __forceinline__ float to_float<1>(u16 x) { return __uint_as_float((u32)x << 16); }
template <> __device__ __forceinline__ float to_float<2>(u16 x) { float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x)); return f; }

// Adds a pair of f32 values to adjacent global addresses (one vector reduction on sm_90).
__device__ __forceinline__ void add_pair(float* p, float a, float b) {
#if __CUDA_ARCH__ >= 900
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" :: "l"(p), "f"(a), "f"(b) : "memory");
#else
    atomicAdd(p, a);
    atomicAdd(p + 1, b);
#endif
}

template <int E> __device__ __forceinline__ u16 to_bits(float x);
template <> __device__ __forceinline__ u16 to_bits<1>(float x) { u16 r; asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(x)); return r; }
template <> __device__ __forceinline__ u16 to_bits<2>(float x) { u16 r; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(x)); return r; }
