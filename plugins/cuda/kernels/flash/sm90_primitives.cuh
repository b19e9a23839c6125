// Hopper's primitives (sm_90a): warpgroup MMAs, descriptors of swizzled panels, panel copies,
// named barriers and the dynamic shared memory's aligned start. Needs primitives.cuh.
#pragma once

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

// Hopper kernels (sm_90a), head_dim 128. Products run as warpgroup MMAs (wgmma) in two forms:
// scores, X = A·Bᵀ over the 128 columns (64 × 64 or 64 × 128 per warpgroup), and values,
// Y += A·B over 64 or 128 keys or queries (64 × 128). B always comes straight from shared memory
// through a descriptor —
// no ldmatrix, no per-fragment addresses; A comes from registers (Q, dO, P, dS: loaded once or
// computed in place) or, where a kernel has no registers to spare, from shared memory. Tiles sit
// in shared memory as the 128-byte swizzle lays them out: 64-column panels of 128-byte rows,
// 16-byte chunk c of row r at chunk c ^ (r mod 8), every panel 1024-byte aligned; they arrive by
// cp.async into one buffer while another is computed on.
//
// The forward: one CTA per (query tile, query head), a warpgroup per 64 rows — two on 128 × 128
// tiles, one on 64 × 64 — with the masking and softmax of flash_forward.

// A shared-memory matrix descriptor with the 128-byte swizzle: start address, leading and stride
// byte offsets (PTX's wgmma matrix descriptor; addresses and offsets in 16-byte units).
__device__ __forceinline__ unsigned long long swizzled_descriptor(const void* p, unsigned leading, unsigned stride) {
    const unsigned long long address = shared_address(p);
    return ((address & 0x3FFFF) >> 4) | ((unsigned long long)((leading >> 4) & 0x3FFF) << 16) |
           ((unsigned long long)((stride >> 4) & 0x3FFF) << 32) | (1ull << 62);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
// Until at most N committed groups of this warpgroup's products are still in flight.
template <int N> __device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;" :: "n"(N) : "memory"); }
// What cp.async wrote (the generic proxy) becomes visible to wgmma's reads (the async proxy).
__device__ __forceinline__ void shared_writes_to_async_proxy() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
// The registers of an asynchronous product are settled here: nothing that reads or writes them
// moves across this point.
template <int N> __device__ __forceinline__ void settle(float* r) {
    #pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i]) :: "memory");
}

// X (64 × 64, f32) += A·Bᵀ over 16 columns, the rows of A and of B from swizzled shared memory
// (K·Qᵀ and V·dOᵀ in the dK/dV kernel); `accumulate` 0 starts from zero. With TRANSPOSED_B,
// X += A·B over 16 rows of B, B's rows read transposed (dQ = dS·K in the fused dK/dV kernel).
template <int E, int TRANSPOSED_B = 0> __device__ __forceinline__ void wgmma_scores(float* d, unsigned long long a, unsigned long long b, int accumulate) {
    if constexpr (E == 1) {
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, %35;\n}\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
                     : "l"(a), "l"(b), "r"(accumulate), "n"(TRANSPOSED_B));
    } else {
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, %35;\n}\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
                     : "l"(a), "l"(b), "r"(accumulate), "n"(TRANSPOSED_B));
    }
}

// Y (64 × 128, f32) += A·B over 16 rows of B: A in registers (fragments as mma.sync lays them
// out: P, or dS in the backward), B's rows in swizzled shared memory, read transposed (V for P·V
// is stored key-major; so are K, Q and dO for the backward's products).
template <int E> __device__ __forceinline__ void wgmma_values(float* d, const u32* a, unsigned long long b);
template <> __device__ __forceinline__ void wgmma_values<1>(float* d, const u32* a, unsigned long long b) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "n"(1));
}
template <> __device__ __forceinline__ void wgmma_values<2>(float* d, const u32* a, unsigned long long b) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "n"(1));
}

// X (64 × 64, f32) += A·Bᵀ over 16 columns: A in registers (mma.sync's A layout: Q or dO), B's
// rows (K or V) from swizzled shared memory; `accumulate` 0 starts from zero.
template <int E> __device__ __forceinline__ void wgmma_scores_registers(float* d, const u32* a, unsigned long long b, int accumulate);
template <> __device__ __forceinline__ void wgmma_scores_registers<1>(float* d, const u32* a, unsigned long long b, int accumulate) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate));
}
template <> __device__ __forceinline__ void wgmma_scores_registers<2>(float* d, const u32* a, unsigned long long b, int accumulate) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate));
}

// ROWS × 128 16-bit elements (global rows of 128) into two 64-column swizzled panels; rows at or
// past `valid` become zeros.
template <int ROWS, int NT>
__device__ __forceinline__ void load_panels_async(u16* dst, const u16* src, int valid) {
    #pragma unroll
    for (int i = threadIdx.x; i < ROWS * 16; i += NT) {
        const int row = i >> 4, chunk = i & 15;
        const bool in = row < valid;
        copy_async(dst + (chunk >> 3) * ROWS * 64 + swizzled<64>(row, chunk & 7), src + (size_t)(in ? row : 0) * 128 + chunk * 8, in);
    }
}

// S (64 rows × 128 keys, f32) += A·Bᵀ over 16 columns, A and B (K-major) from swizzled shared
// memory; `accumulate` 0 starts from zero.
template <int E>
__device__ __forceinline__ void wgmma_scores_n128(float* d, unsigned long long a, unsigned long long b, int accumulate) {
    if constexpr (E == 1) {
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
                     : "l"(a), "l"(b), "r"(accumulate));
    } else {
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
                     : "l"(a), "l"(b), "r"(accumulate));
    }
}

// 64 rows (from `rows`) of a tile of TILE_ROWS rows: the 16-column step `step` (0..7) of its two
// 64-column panels, as a scores operand.
template <int TILE_ROWS> __device__ __forceinline__ unsigned long long panel_step(const u16* rows, int step) {
    return swizzled_descriptor(rows + (step >> 2) * TILE_ROWS * 64 + (step & 3) * 16, 16, 1024);
}
// Rows 16·step.. of a tile of TILE_ROWS rows, read transposed, as a values operand.
template <int TILE_ROWS = 64> __device__ __forceinline__ unsigned long long transposed_rows(const u16* tile, int step) {
    return swizzled_descriptor(tile + step * 16 * 64, TILE_ROWS * 64 * 2, 1024);
}
// X = A·Bᵀ for 64 rows of A (from a tile of A_ROWS rows) and a 64-row tile B in shared memory
// (both 128 columns).
template <int E, int A_ROWS> __device__ __forceinline__ void scores_from_shared(float* x, const u16* a, const u16* b) {
    #pragma unroll
    for (int step = 0; step < 8; ++step) wgmma_scores<E>(x, panel_step<A_ROWS>(a, step), panel_step<64>(b, step), step);
}
// X = A·Bᵀ, A (64 × 128) as eight 16-column fragments in registers, B a 64-row tile in shared
// memory: only B crosses the shared-memory port, half the bytes of scores_from_shared.
template <int E> __device__ __forceinline__ void scores_from_registers(float* x, const u32 (*a)[4], const u16* b) {
    #pragma unroll
    for (int step = 0; step < 8; ++step) wgmma_scores_registers<E>(x, a[step], panel_step<64>(b, step), step);
}
// X (64 × 128) = A·Bᵀ for 64 rows of A (from a tile of A_ROWS rows) and a 128-row tile B, both in
// shared memory.
template <int E, int A_ROWS> __device__ __forceinline__ void scores_from_shared_n128(float* x, const u16* a, const u16* b) {
    #pragma unroll
    for (int step = 0; step < 8; ++step) wgmma_scores_n128<E>(x, panel_step<A_ROWS>(a, step), panel_step<128>(b, step), step);
}
// Y += A·B, A (64 × KEYS) as KEYS / 16 fragments in registers, B a tile of KEYS rows in shared
// memory.
template <int E, int KEYS = 64> __device__ __forceinline__ void values_product(float* y, const u32 (*a)[4], const u16* b) {
    #pragma unroll
    for (int step = 0; step < KEYS / 16; ++step) wgmma_values<E>(y, a[step], transposed_rows<KEYS>(b, step));
}
// A 64 × (16·STEPS) accumulator (mma.sync's C layout per warp) as A fragments for
// values_product.
template <int E, int STEPS = 4> __device__ __forceinline__ void as_fragments(u32 (*a)[4], const float* x) {
    #pragma unroll
    for (int step = 0; step < STEPS; ++step) {
        a[step][0] = pack2<E>(x[8 * step + 0], x[8 * step + 1]);
        a[step][1] = pack2<E>(x[8 * step + 2], x[8 * step + 3]);
        a[step][2] = pack2<E>(x[8 * step + 4], x[8 * step + 5]);
        a[step][3] = pack2<E>(x[8 * step + 6], x[8 * step + 7]);
    }
}
// Y += A·B as one committed group of this warpgroup's products, A the 64 × 64 accumulator `x`
// rounded to 16 bits.
template <int E> __device__ __forceinline__ void issue_values_product(float* y, const float* x, const u16* b) {
    u32 a[4][4];
    as_fragments<E>(a, x);
    settle<64>(y);
    wgmma_fence();
    values_product<E>(y, a, b);
    wgmma_commit();
}

// The transpose of a warpgroup's 64 × 64 accumulator, from its A fragments (as as_fragments gives
// them), into a swizzled 64-column panel: this warp's 16 rows become 16 columns of every row.
__device__ __forceinline__ void store_transposed_fragments(u16* panel, const u32 (*a)[4]) {
    const int lane = threadIdx.x & 31, matrix = lane >> 3, column_chunk = ((threadIdx.x >> 5) & 3) * 2 + (matrix & 1);
    #pragma unroll
    for (int step = 0; step < 4; ++step) {
        const int row = step * 16 + (matrix >> 1) * 8 + (lane & 7);
        asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};"
                     :: "r"(shared_address(panel + swizzled<64>(row, column_chunk))),
                        "r"(a[step][0]), "r"(a[step][1]), "r"(a[step][2]), "r"(a[step][3]) : "memory");
    }
}
// Until all NT threads of the block have arrived at named barrier `id` (barrier 0 is
// __syncthreads').
template <int NT> __device__ __forceinline__ void barrier_sync(int id) { asm volatile("bar.sync %0, %1;" :: "r"(id), "n"(NT) : "memory"); }

// This thread's A fragments (eight 16-column steps) of rows row0 and row0 + 8 of a matrix of
// 128-column 16-bit rows in global memory, as register-A wgmma takes them (mma.sync's A layout);
// rows at or past `seqlen` are zeros.
__device__ __forceinline__ void load_row_fragments(u32 (*a)[4], const u16* rows, int row0, int seqlen) {
    const int t = threadIdx.x & 3;
    const bool in0 = row0 < seqlen, in1 = row0 + 8 < seqlen;
    const u32* r0 = reinterpret_cast<const u32*>(rows + (size_t)(in0 ? row0 : 0) * 128);
    const u32* r1 = reinterpret_cast<const u32*>(rows + (size_t)(in1 ? row0 + 8 : 0) * 128);
    #pragma unroll
    for (int step = 0; step < 8; ++step) {
        a[step][0] = in0 ? r0[step * 8 + t] : 0u;
        a[step][1] = in1 ? r1[step * 8 + t] : 0u;
        a[step][2] = in0 ? r0[step * 8 + 4 + t] : 0u;
        a[step][3] = in1 ? r1[step * 8 + 4 + t] : 0u;
    }
}

// The K and V tiles of work-list entry `entry` (KEYS keys) into swizzled panels, by cp.async.
template <int NT, int KEYS = BN>
__device__ __forceinline__ void load_key_tile(u16* k_dst, u16* v_dst, const u16* kh, const u16* vh, unsigned entry, int seqlen) {
    const int k0 = (int)(entry & 0x7fffffffu) * KEYS;
    load_panels_async<KEYS, NT>(k_dst, kh + (size_t)k0 * 128, min(KEYS, seqlen - k0));
    load_panels_async<KEYS, NT>(v_dst, vh + (size_t)k0 * 128, min(KEYS, seqlen - k0));
}
// A walk over key tiles, between two tiles: waits for this tile's K and V (every thread's
// copies), shows them to wgmma, and — once every thread is past the previous tile, whose buffers
// the next copies may overwrite — starts copying the next entry's (`next`, if any) into `k_next`
// and `v_next`.
template <int NT, int KEYS = BN>
__device__ __forceinline__ void next_key_tile(u16* k_next, u16* v_next, const u16* kh, const u16* vh, const unsigned* next, int seqlen) {
    wait_copies<0>();
    shared_writes_to_async_proxy();
    __syncthreads();
    if (next) load_key_tile<NT, KEYS>(k_next, v_next, kh, vh, *next, seqlen);
    commit_copies();
}

#define HOPPER_WARPGROUP 128

extern __shared__ __align__(1024) u16 hopper_shared[];
// The Hopper kernels' dynamic shared memory from its first 1024-byte boundary (the swizzle's
// atoms are 1024 bytes; the host asks for 1024 bytes more than the tiles need).
__device__ __forceinline__ u16* hopper_tiles() {
    return hopper_shared + ((1024 - (shared_address(hopper_shared) & 1023)) & 1023) / 2;
}

#endif
