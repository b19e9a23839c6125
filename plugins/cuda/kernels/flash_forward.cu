// attnbench flash attention, forward: one CTA per (64-row query tile, query head), 4 warps of 16
// rows; 64-key tiles from the mask IR's per-tile work list (full tiles unmasked, partial tiles
// masked element-wise from each row's key intervals, empty tiles never visited); QKᵀ and PV on
// tensor cores (mma.sync m16n8k16, f32 accumulation); online softmax in registers.
// Rows with no allowed key: O = 0, LSE = −∞.
#define BM 64
#define BN 64
#define THREADS 128

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

__device__ __forceinline__ bool allowed(unsigned k, const unsigned* iv, unsigned n) {
    for (unsigned t = 0; t < n; ++t) { if (k >= iv[2 * t] && k < iv[2 * t + 1]) return true; }
    return false;
}

// Copies `rows` × D elements (16-bit) from global rows of D into shared memory, zero past `valid`.
template <int D>
__device__ __forceinline__ void load_tile(u16* dst, const u16* src, int valid) {
    const int chunks = BM * D / 8;  // 16-byte chunks
    for (int i = threadIdx.x; i < chunks; i += THREADS) {
        const int row = i / (D / 8), col = (i % (D / 8)) * 8;
        uint4 value = make_uint4(0, 0, 0, 0);
        if (row < valid) value = *reinterpret_cast<const uint4*>(src + (size_t)row * D + col);
        *reinterpret_cast<uint4*>(dst + row * D + col) = value;
    }
}

template <int E, int D>
__device__ void flash_forward(const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v,
                              float* __restrict__ out, float* __restrict__ lse,
                              const unsigned* __restrict__ tile_start, const unsigned* __restrict__ tiles,
                              const unsigned* __restrict__ row_start, const unsigned* __restrict__ intervals,
                              const int* __restrict__ mask_of_head,
                              int seqlen, int group, float scale_log2) {
    __shared__ __align__(16) u16 sq[BM * D];
    __shared__ __align__(16) u16 sk[BN * D];
    __shared__ __align__(16) u16 sv[BN * D];
    const int q_tile = blockIdx.x, head = blockIdx.y, kv_head = head / group;
    const int mask = mask_of_head[head];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int q0 = q_tile * BM;
    const u16* qh = q + ((size_t)head * seqlen) * D;
    const u16* kh = k + ((size_t)kv_head * seqlen) * D;
    const u16* vh = v + ((size_t)kv_head * seqlen) * D;
    load_tile<D>(sq, qh + (size_t)q0 * D, min(BM, seqlen - q0));
    __syncthreads();

    // This thread's rows: r0 = q0 + warp·16 + g and r1 = r0 + 8.
    const int r0 = q0 + warp * 16 + g, r1 = r0 + 8;
    const unsigned* table_rows = row_start + (size_t)mask * (seqlen + 1);
    const unsigned* table_iv = intervals;
    unsigned iv0_begin = 0, iv0_count = 0, iv1_begin = 0, iv1_count = 0;
    if (r0 < seqlen) { iv0_begin = table_rows[r0]; iv0_count = table_rows[r0 + 1] - iv0_begin; }
    if (r1 < seqlen) { iv1_begin = table_rows[r1]; iv1_count = table_rows[r1 + 1] - iv1_begin; }

    // Q fragments for the warp's 16 rows, all of D.
    u32 qa[D / 16][4];
    #pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
        const u16* base = sq + (warp * 16) * D + kk * 16 + t * 2;
        qa[kk][0] = *reinterpret_cast<const u32*>(base + g * D);
        qa[kk][1] = *reinterpret_cast<const u32*>(base + (g + 8) * D);
        qa[kk][2] = *reinterpret_cast<const u32*>(base + g * D + 8);
        qa[kk][3] = *reinterpret_cast<const u32*>(base + (g + 8) * D + 8);
    }

    float acc[D / 8][4];
    #pragma unroll
    for (int n = 0; n < D / 8; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
    const float minus_inf = __int_as_float(0xff800000);
    float m0 = minus_inf, m1 = minus_inf, l0 = 0.0f, l1 = 0.0f;

    const unsigned list = mask * ((seqlen + BM - 1) / BM) + q_tile;
    for (unsigned w = tile_start[list]; w < tile_start[list + 1]; ++w) {
        const unsigned entry = tiles[w];
        const bool partial = entry >> 31;
        const int k0 = (int)(entry & 0x7fffffffu) * BN;
        __syncthreads();
        load_tile<D>(sk, kh + (size_t)k0 * D, min(BN, seqlen - k0));
        load_tile<D>(sv, vh + (size_t)k0 * D, min(BN, seqlen - k0));
        __syncthreads();

        // S = Q·Kᵀ for the warp's 16 rows × 64 keys: 8 n-blocks of 8 keys.
        float s[BN / 8][4];
        #pragma unroll
        for (int n = 0; n < BN / 8; ++n) {
            s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
            #pragma unroll
            for (int kk = 0; kk < D / 16; ++kk) {
                const u16* base = sk + (n * 8 + g) * D + kk * 16 + t * 2;
                u32 b[2] = {*reinterpret_cast<const u32*>(base), *reinterpret_cast<const u32*>(base + 8)};
                mma<E>(s[n], qa[kk], b);
            }
        }
        // Scale into the log2 domain; mask what the tile does not allow (and keys past the end).
        #pragma unroll
        for (int n = 0; n < BN / 8; ++n) {
            #pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int key = k0 + n * 8 + t * 2 + (i & 1);
                const int row = (i < 2) ? r0 : r1;
                bool ok = key < seqlen && row < seqlen;
                if (ok && partial) ok = (i < 2) ? allowed(key, table_iv + 2 * iv0_begin, iv0_count)
                                                : allowed(key, table_iv + 2 * iv1_begin, iv1_count);
                s[n][i] = ok ? s[n][i] * scale_log2 : minus_inf;
            }
        }
        // Online softmax: new row maxima over the 4 threads that share a row.
        float mx0 = m0, mx1 = m1;
        #pragma unroll
        for (int n = 0; n < BN / 8; ++n) {
            mx0 = fmaxf(mx0, fmaxf(s[n][0], s[n][1]));
            mx1 = fmaxf(mx1, fmaxf(s[n][2], s[n][3]));
        }
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
        const float base0 = (mx0 == minus_inf) ? 0.0f : mx0, base1 = (mx1 == minus_inf) ? 0.0f : mx1;
        const float shrink0 = exp2f(m0 - base0), shrink1 = exp2f(m1 - base1);
        m0 = mx0; m1 = mx1;
        float sum0 = 0.0f, sum1 = 0.0f;
        #pragma unroll
        for (int n = 0; n < BN / 8; ++n) {
            s[n][0] = exp2f(s[n][0] - base0); s[n][1] = exp2f(s[n][1] - base0);
            s[n][2] = exp2f(s[n][2] - base1); s[n][3] = exp2f(s[n][3] - base1);
            sum0 += s[n][0] + s[n][1];
            sum1 += s[n][2] + s[n][3];
        }
        l0 = l0 * shrink0 + sum0;
        l1 = l1 * shrink1 + sum1;
        #pragma unroll
        for (int n = 0; n < D / 8; ++n) {
            acc[n][0] *= shrink0; acc[n][1] *= shrink0;
            acc[n][2] *= shrink1; acc[n][3] *= shrink1;
        }
        // O += P·V: P's accumulators become A fragments, 16 keys at a time.
        #pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
            u32 pa[4] = {pack2<E>(s[2 * kk][0], s[2 * kk][1]), pack2<E>(s[2 * kk][2], s[2 * kk][3]),
                         pack2<E>(s[2 * kk + 1][0], s[2 * kk + 1][1]), pack2<E>(s[2 * kk + 1][2], s[2 * kk + 1][3])};
            #pragma unroll
            for (int n = 0; n < D / 8; ++n) {
                const u16* col = sv + (kk * 16 + t * 2) * D + n * 8 + g;
                u32 b[2] = {(u32)col[0] | ((u32)col[D] << 16), (u32)col[8 * D] | ((u32)col[9 * D] << 16)};
                mma<E>(acc[n], pa, b);
            }
        }
    }
    // Row sums over the 4 threads of a row, then O = acc / l and LSE = ln(l) + m·ln 2.
    l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
    l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
    const float inv0 = (m0 == minus_inf || l0 == 0.0f) ? 0.0f : 1.0f / l0;
    const float inv1 = (m1 == minus_inf || l1 == 0.0f) ? 0.0f : 1.0f / l1;
    float* oh = out + ((size_t)head * seqlen) * D;
    #pragma unroll
    for (int n = 0; n < D / 8; ++n) {
        const int col = n * 8 + t * 2;
        if (r0 < seqlen) { oh[(size_t)r0 * D + col] = acc[n][0] * inv0; oh[(size_t)r0 * D + col + 1] = acc[n][1] * inv0; }
        if (r1 < seqlen) { oh[(size_t)r1 * D + col] = acc[n][2] * inv1; oh[(size_t)r1 * D + col + 1] = acc[n][3] * inv1; }
    }
    if (t == 0) {
        const float ln2 = 0.6931471805599453f;
        if (r0 < seqlen) lse[(size_t)head * seqlen + r0] = (inv0 == 0.0f) ? minus_inf : (m0 * ln2 + logf(l0));
        if (r1 < seqlen) lse[(size_t)head * seqlen + r1] = (inv1 == 0.0f) ? minus_inf : (m1 * ln2 + logf(l1));
    }
}

#define FLASH_FORWARD(SUFFIX, E, D) \
extern "C" __global__ void __launch_bounds__(THREADS) flash_forward_##SUFFIX( \
    const u16* q, const u16* k, const u16* v, float* out, float* lse, const unsigned* tile_start, const unsigned* tiles, \
    const unsigned* row_start, const unsigned* intervals, const int* mask_of_head, \
    int seqlen, int group, float scale_log2) { \
    flash_forward<E, D>(q, k, v, out, lse, tile_start, tiles, row_start, intervals, mask_of_head, seqlen, group, scale_log2); }
FLASH_FORWARD(bf16_d64, 1, 64)
FLASH_FORWARD(bf16_d128, 1, 128)
FLASH_FORWARD(f16_d64, 2, 64)
FLASH_FORWARD(f16_d128, 2, 128)
