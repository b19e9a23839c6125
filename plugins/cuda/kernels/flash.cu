// attnbench flash attention. Forward: one CTA per (64-row query tile, query head), 4 warps of 16
// rows; 64-key tiles from the mask IR's per-tile work list (full tiles unmasked, partial tiles
// masked element-wise from each row's key intervals, empty tiles never visited); QKᵀ and PV on
// tensor cores (mma.sync m16n8k16, f32 accumulation); online softmax in registers.
// Rows with no allowed key: O = 0, LSE = −∞.
// Backward (deterministic: every output has one writer): D = rowsum(dO∘O); dK and dV per
// (64-key tile, KV head), summing the group's query heads in order over the query tiles that
// touch the key tile (the transposed work list); dQ per (64-row query tile, query head).
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

// Copies ROWS × D elements (16-bit) from global rows of D into shared memory, zero past `valid`.
template <int ROWS, int D>
__device__ __forceinline__ void load_tile(u16* dst, const u16* src, int valid) {
    const int chunks = ROWS * D / 8;  // 16-byte chunks
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
    load_tile<BM, D>(sq, qh + (size_t)q0 * D, min(BM, seqlen - q0));
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
        load_tile<BN, D>(sk, kh + (size_t)k0 * D, min(BN, seqlen - k0));
        load_tile<BN, D>(sv, vh + (size_t)k0 * D, min(BN, seqlen - k0));
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

template <int E> __device__ __forceinline__ float to_float(u16 x);
template <> __device__ __forceinline__ float to_float<1>(u16 x) { return __uint_as_float((u32)x << 16); }
template <> __device__ __forceinline__ float to_float<2>(u16 x) { float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x)); return f; }

// A fragments (16 rows × 16 columns at column kk·16) of a row-major shared tile of width D.
template <int D>
__device__ __forceinline__ void a_fragment(u32* a, const u16* tile, int row0, int kk, int g, int t) {
    const u16* base = tile + row0 * D + kk * 16 + t * 2;
    a[0] = *reinterpret_cast<const u32*>(base + g * D);
    a[1] = *reinterpret_cast<const u32*>(base + (g + 8) * D);
    a[2] = *reinterpret_cast<const u32*>(base + g * D + 8);
    a[3] = *reinterpret_cast<const u32*>(base + (g + 8) * D + 8);
}

// B fragment of Xᵀ (16 of D × 8 rows of X at row n8) from a row-major tile X of width D.
template <int D>
__device__ __forceinline__ void bt_fragment(u32* b, const u16* tile, int n8, int kk, int g, int t) {
    const u16* base = tile + (n8 + g) * D + kk * 16 + t * 2;
    b[0] = *reinterpret_cast<const u32*>(base);
    b[1] = *reinterpret_cast<const u32*>(base + 8);
}

// B fragment of X (16 rows of X at row k16 × 8 columns at n8) from a row-major tile X of width D.
template <int D>
__device__ __forceinline__ void b_fragment(u32* b, const u16* tile, int k16, int n8, int g, int t) {
    const u16* col = tile + (k16 + t * 2) * D + n8 + g;
    b[0] = (u32)col[0] | ((u32)col[D] << 16);
    b[1] = (u32)col[8 * D] | ((u32)col[9 * D] << 16);
}

// D[h][q] = Σ dO∘O over the head dimension: one warp per row.
template <int E, int D>
__device__ void flash_delta(const u16* __restrict__ d_out, const float* __restrict__ out, float* __restrict__ delta, int rows) {
    const int row = blockIdx.x * (THREADS / 32) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (row >= rows) return;
    float sum = 0.0f;
    for (int i = lane; i < D; i += 32) sum += to_float<E>(d_out[(size_t)row * D + i]) * out[(size_t)row * D + i];
    for (int offset = 16; offset > 0; offset >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    if (lane == 0) delta[row] = sum;
}

// dQ of one (64-row query tile, query head): S and P recomputed per key tile as in the forward
// pass, dP = dO·Vᵀ, dS = P∘(dP − D), dQ += dS·K; scaled at the end.
template <int E, int D>
__device__ void flash_backward_dq(const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v,
                                  const u16* __restrict__ d_out, const float* __restrict__ lse, const float* __restrict__ delta,
                                  float* __restrict__ dq,
                                  const unsigned* __restrict__ tile_start, const unsigned* __restrict__ tiles,
                                  const unsigned* __restrict__ row_start, const unsigned* __restrict__ intervals,
                                  const int* __restrict__ mask_of_head, int seqlen, int group, float scale, float scale_log2) {
    __shared__ __align__(16) u16 stage[BM * D];
    __shared__ __align__(16) u16 sk[BN * D];
    __shared__ __align__(16) u16 sv[BN * D];
    const int q_tile = blockIdx.x, head = blockIdx.y, kv_head = head / group;
    const int mask = mask_of_head[head];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int q0 = q_tile * BM;
    const int r0 = q0 + warp * 16 + g, r1 = r0 + 8;
    const float minus_inf = __int_as_float(0xff800000), log2e = 1.4426950408889634f;
    const unsigned* table_rows = row_start + (size_t)mask * (seqlen + 1);
    unsigned iv0_begin = 0, iv0_count = 0, iv1_begin = 0, iv1_count = 0;
    if (r0 < seqlen) { iv0_begin = table_rows[r0]; iv0_count = table_rows[r0 + 1] - iv0_begin; }
    if (r1 < seqlen) { iv1_begin = table_rows[r1]; iv1_count = table_rows[r1 + 1] - iv1_begin; }
    const float lse0 = r0 < seqlen ? lse[(size_t)head * seqlen + r0] * log2e : minus_inf;
    const float lse1 = r1 < seqlen ? lse[(size_t)head * seqlen + r1] * log2e : minus_inf;
    const float d0 = r0 < seqlen ? delta[(size_t)head * seqlen + r0] : 0.0f;
    const float d1 = r1 < seqlen ? delta[(size_t)head * seqlen + r1] : 0.0f;

    u32 qa[D / 16][4], da[D / 16][4];
    load_tile<BM, D>(stage, q + ((size_t)head * seqlen + q0) * D, min(BM, seqlen - q0));
    __syncthreads();
    #pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) a_fragment<D>(qa[kk], stage, warp * 16, kk, g, t);
    __syncthreads();
    load_tile<BM, D>(stage, d_out + ((size_t)head * seqlen + q0) * D, min(BM, seqlen - q0));
    __syncthreads();
    #pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) a_fragment<D>(da[kk], stage, warp * 16, kk, g, t);

    float acc[D / 8][4];
    #pragma unroll
    for (int n = 0; n < D / 8; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
    const u16* kh = k + ((size_t)kv_head * seqlen) * D;
    const u16* vh = v + ((size_t)kv_head * seqlen) * D;
    const unsigned list = mask * ((seqlen + BM - 1) / BM) + q_tile;
    for (unsigned w = tile_start[list]; w < tile_start[list + 1]; ++w) {
        const unsigned entry = tiles[w];
        const bool partial = entry >> 31;
        const int k0 = (int)(entry & 0x7fffffffu) * BN;
        __syncthreads();
        load_tile<BN, D>(sk, kh + (size_t)k0 * D, min(BN, seqlen - k0));
        load_tile<BN, D>(sv, vh + (size_t)k0 * D, min(BN, seqlen - k0));
        __syncthreads();
        float s[BN / 8][4], dp[BN / 8][4];
        #pragma unroll
        for (int n = 0; n < BN / 8; ++n) {
            s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
            dp[n][0] = dp[n][1] = dp[n][2] = dp[n][3] = 0.0f;
            #pragma unroll
            for (int kk = 0; kk < D / 16; ++kk) {
                u32 b[2];
                bt_fragment<D>(b, sk, n * 8, kk, g, t);
                mma<E>(s[n], qa[kk], b);
                bt_fragment<D>(b, sv, n * 8, kk, g, t);
                mma<E>(dp[n], da[kk], b);
            }
        }
        // dS = P∘(dP − D), P = exp2(S·scale·log2e − LSE·log2e); masked cells contribute nothing.
        #pragma unroll
        for (int n = 0; n < BN / 8; ++n) {
            #pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int key = k0 + n * 8 + t * 2 + (i & 1);
                const bool upper = i < 2;
                const int row = upper ? r0 : r1;
                const float row_lse = upper ? lse0 : lse1;
                bool ok = key < seqlen && row < seqlen && row_lse != minus_inf;
                if (ok && partial) ok = upper ? allowed(key, intervals + 2 * iv0_begin, iv0_count)
                                              : allowed(key, intervals + 2 * iv1_begin, iv1_count);
                const float p = ok ? exp2f(s[n][i] * scale_log2 - row_lse) : 0.0f;
                s[n][i] = p * (dp[n][i] - (upper ? d0 : d1));
            }
        }
        // dQ += dS·K, 16 keys at a time.
        #pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
            u32 pa[4] = {pack2<E>(s[2 * kk][0], s[2 * kk][1]), pack2<E>(s[2 * kk][2], s[2 * kk][3]),
                         pack2<E>(s[2 * kk + 1][0], s[2 * kk + 1][1]), pack2<E>(s[2 * kk + 1][2], s[2 * kk + 1][3])};
            #pragma unroll
            for (int n = 0; n < D / 8; ++n) {
                u32 b[2];
                b_fragment<D>(b, sk, kk * 16, n * 8, g, t);
                mma<E>(acc[n], pa, b);
            }
        }
    }
    float* dqh = dq + ((size_t)head * seqlen) * D;
    #pragma unroll
    for (int n = 0; n < D / 8; ++n) {
        const int col = n * 8 + t * 2;
        if (r0 < seqlen) { dqh[(size_t)r0 * D + col] = acc[n][0] * scale; dqh[(size_t)r0 * D + col + 1] = acc[n][1] * scale; }
        if (r1 < seqlen) { dqh[(size_t)r1 * D + col] = acc[n][2] * scale; dqh[(size_t)r1 * D + col + 1] = acc[n][3] * scale; }
    }
}

#define BQ 32

// dK and dV of one (64-key tile, KV head): for each query head of the group, in order, and each
// query tile touching the key tile (in 32-row halves): Sᵀ = K·Qᵀ, Pᵀ, dV += Pᵀ·dO,
// dPᵀ = V·dOᵀ, dSᵀ = Pᵀ∘(dPᵀ − D), dK += dSᵀ·Q; dK scaled at the end.
template <int E, int D>
__device__ void flash_backward_dkdv(const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v,
                                    const u16* __restrict__ d_out, const float* __restrict__ lse, const float* __restrict__ delta,
                                    float* __restrict__ dk, float* __restrict__ dv,
                                    const unsigned* __restrict__ tile_start, const unsigned* __restrict__ tiles,
                                    const unsigned* __restrict__ row_start, const unsigned* __restrict__ intervals,
                                    const int* __restrict__ mask_of_head, int seqlen, int group, float scale, float scale_log2) {
    __shared__ __align__(16) u16 stage[BN * D];
    __shared__ __align__(16) u16 sq[BQ * D];
    __shared__ __align__(16) u16 sdo[BQ * D];
    __shared__ float s_lse[BQ], s_delta[BQ];
    const int k_tile = blockIdx.x, kv_head = blockIdx.y;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int k0 = k_tile * BN;
    const int key0 = k0 + warp * 16 + g, key1 = key0 + 8;
    const float minus_inf = __int_as_float(0xff800000), log2e = 1.4426950408889634f;
    const int k_tiles = (seqlen + BN - 1) / BN;

    u32 ka[D / 16][4], va[D / 16][4];
    load_tile<BN, D>(stage, k + ((size_t)kv_head * seqlen + k0) * D, min(BN, seqlen - k0));
    __syncthreads();
    #pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) a_fragment<D>(ka[kk], stage, warp * 16, kk, g, t);
    __syncthreads();
    load_tile<BN, D>(stage, v + ((size_t)kv_head * seqlen + k0) * D, min(BN, seqlen - k0));
    __syncthreads();
    #pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) a_fragment<D>(va[kk], stage, warp * 16, kk, g, t);

    float dk_acc[D / 8][4], dv_acc[D / 8][4];
    #pragma unroll
    for (int n = 0; n < D / 8; ++n) {
        dk_acc[n][0] = dk_acc[n][1] = dk_acc[n][2] = dk_acc[n][3] = 0.0f;
        dv_acc[n][0] = dv_acc[n][1] = dv_acc[n][2] = dv_acc[n][3] = 0.0f;
    }
    for (int head = kv_head * group; head < (kv_head + 1) * group; ++head) {
        const int mask = mask_of_head[head];
        const unsigned* table_rows = row_start + (size_t)mask * (seqlen + 1);
        const unsigned list = mask * k_tiles + k_tile;
        for (unsigned w = tile_start[list]; w < tile_start[list + 1]; ++w) {
            const unsigned entry = tiles[w];
            const bool partial = entry >> 31;
            for (int half = 0; half < BM / BQ; ++half) {
                const int q0 = (int)(entry & 0x7fffffffu) * BM + half * BQ;
                if (q0 >= seqlen) break;
                __syncthreads();
                load_tile<BQ, D>(sq, q + ((size_t)head * seqlen + q0) * D, min(BQ, seqlen - q0));
                load_tile<BQ, D>(sdo, d_out + ((size_t)head * seqlen + q0) * D, min(BQ, seqlen - q0));
                for (int i = threadIdx.x; i < BQ; i += THREADS) {
                    const bool in = q0 + i < seqlen;
                    s_lse[i] = in ? lse[(size_t)head * seqlen + q0 + i] * log2e : minus_inf;
                    s_delta[i] = in ? delta[(size_t)head * seqlen + q0 + i] : 0.0f;
                }
                __syncthreads();
                // Sᵀ and dPᵀ for the warp's 16 keys × 32 queries.
                float st[BQ / 8][4], dpt[BQ / 8][4];
                #pragma unroll
                for (int n = 0; n < BQ / 8; ++n) {
                    st[n][0] = st[n][1] = st[n][2] = st[n][3] = 0.0f;
                    dpt[n][0] = dpt[n][1] = dpt[n][2] = dpt[n][3] = 0.0f;
                    #pragma unroll
                    for (int kk = 0; kk < D / 16; ++kk) {
                        u32 b[2];
                        bt_fragment<D>(b, sq, n * 8, kk, g, t);
                        mma<E>(st[n], ka[kk], b);
                        bt_fragment<D>(b, sdo, n * 8, kk, g, t);
                        mma<E>(dpt[n], va[kk], b);
                    }
                }
                // Pᵀ (kept in st) and dSᵀ (in dpt).
                #pragma unroll
                for (int n = 0; n < BQ / 8; ++n) {
                    #pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        const int column = n * 8 + t * 2 + (i & 1);
                        const int row_q = q0 + column;
                        const int key = i < 2 ? key0 : key1;
                        const float row_lse = s_lse[column];
                        bool ok = key < seqlen && row_q < seqlen && row_lse != minus_inf;
                        if (ok && partial) {
                            const unsigned begin = table_rows[row_q];
                            ok = allowed(key, intervals + 2 * begin, table_rows[row_q + 1] - begin);
                        }
                        const float p = ok ? exp2f(st[n][i] * scale_log2 - row_lse) : 0.0f;
                        st[n][i] = p;
                        dpt[n][i] = p * (dpt[n][i] - s_delta[column]);
                    }
                }
                // dV += Pᵀ·dO and dK += dSᵀ·Q, 16 queries at a time.
                #pragma unroll
                for (int kk = 0; kk < BQ / 16; ++kk) {
                    u32 pa[4] = {pack2<E>(st[2 * kk][0], st[2 * kk][1]), pack2<E>(st[2 * kk][2], st[2 * kk][3]),
                                 pack2<E>(st[2 * kk + 1][0], st[2 * kk + 1][1]), pack2<E>(st[2 * kk + 1][2], st[2 * kk + 1][3])};
                    u32 sa[4] = {pack2<E>(dpt[2 * kk][0], dpt[2 * kk][1]), pack2<E>(dpt[2 * kk][2], dpt[2 * kk][3]),
                                 pack2<E>(dpt[2 * kk + 1][0], dpt[2 * kk + 1][1]), pack2<E>(dpt[2 * kk + 1][2], dpt[2 * kk + 1][3])};
                    #pragma unroll
                    for (int n = 0; n < D / 8; ++n) {
                        u32 b[2];
                        b_fragment<D>(b, sdo, kk * 16, n * 8, g, t);
                        mma<E>(dv_acc[n], pa, b);
                        b_fragment<D>(b, sq, kk * 16, n * 8, g, t);
                        mma<E>(dk_acc[n], sa, b);
                    }
                }
            }
        }
    }
    float* dkh = dk + ((size_t)kv_head * seqlen) * D;
    float* dvh = dv + ((size_t)kv_head * seqlen) * D;
    #pragma unroll
    for (int n = 0; n < D / 8; ++n) {
        const int col = n * 8 + t * 2;
        if (key0 < seqlen) {
            dkh[(size_t)key0 * D + col] = dk_acc[n][0] * scale; dkh[(size_t)key0 * D + col + 1] = dk_acc[n][1] * scale;
            dvh[(size_t)key0 * D + col] = dv_acc[n][0]; dvh[(size_t)key0 * D + col + 1] = dv_acc[n][1];
        }
        if (key1 < seqlen) {
            dkh[(size_t)key1 * D + col] = dk_acc[n][2] * scale; dkh[(size_t)key1 * D + col + 1] = dk_acc[n][3] * scale;
            dvh[(size_t)key1 * D + col] = dv_acc[n][2]; dvh[(size_t)key1 * D + col + 1] = dv_acc[n][3];
        }
    }
}

#define FLASH_BACKWARD(SUFFIX, E, D) \
extern "C" __global__ void __launch_bounds__(THREADS) flash_delta_##SUFFIX(const u16* d_out, const float* out, float* delta, int rows) { \
    flash_delta<E, D>(d_out, out, delta, rows); } \
extern "C" __global__ void __launch_bounds__(THREADS) flash_backward_dq_##SUFFIX( \
    const u16* q, const u16* k, const u16* v, const u16* d_out, const float* lse, const float* delta, float* dq, \
    const unsigned* tile_start, const unsigned* tiles, const unsigned* row_start, const unsigned* intervals, \
    const int* mask_of_head, int seqlen, int group, float scale, float scale_log2) { \
    flash_backward_dq<E, D>(q, k, v, d_out, lse, delta, dq, tile_start, tiles, row_start, intervals, mask_of_head, seqlen, group, scale, scale_log2); } \
extern "C" __global__ void __launch_bounds__(THREADS) flash_backward_dkdv_##SUFFIX( \
    const u16* q, const u16* k, const u16* v, const u16* d_out, const float* lse, const float* delta, float* dk, float* dv, \
    const unsigned* tile_start, const unsigned* tiles, const unsigned* row_start, const unsigned* intervals, \
    const int* mask_of_head, int seqlen, int group, float scale, float scale_log2) { \
    flash_backward_dkdv<E, D>(q, k, v, d_out, lse, delta, dk, dv, tile_start, tiles, row_start, intervals, mask_of_head, seqlen, group, scale, scale_log2); }
FLASH_BACKWARD(bf16_d64, 1, 64)
FLASH_BACKWARD(bf16_d128, 1, 128)
FLASH_BACKWARD(f16_d64, 2, 64)
FLASH_BACKWARD(f16_d128, 2, 128)
