// The mma.sync forward (any architecture from sm_80) and its instantiations. Needs
// primitives.cuh and mask.cuh.
#pragma once

// Every forward kernel's parameters: Q, K, V, O, LSE, the work lists (per query tile its key
// tiles, and the order to start the query tiles), the rows' key intervals, each head's mask
// (the kernels take them from their FlashParams).
#define FORWARD_PARAMS const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v, \
    float* __restrict__ out, float* __restrict__ lse, const unsigned* __restrict__ tile_start, \
    const unsigned* __restrict__ tiles, const unsigned* __restrict__ order, const unsigned* __restrict__ row_start, \
    const unsigned* __restrict__ intervals, const int* __restrict__ mask_of_head, int seqlen, int group, float scale_log2

// Forward: one CTA of WARPS warps per (16·M·WARPS-row query tile, query head), each warp 16·M
// rows (M 16-row blocks sharing every K and V fragment it loads: at M = 2, half the shared-memory
// traffic per product of 16-row warps; M = 1 for masks whose blocks split 128-row tiles, see
// flash.rs, and past head_dim 128, where a warp's accumulators of 32 rows would not fit its
// registers and 8 warps make the 128-row tile). Q stays in shared memory; K and V tiles arrive by
// cp.async into one buffer each, overlapped with compute: V(j) loads during S = Q·K(j)ᵀ, K(j+1)
// during the softmax and O += P·V(j). DV is V's and O's head dim (MLA's differs from Q's and
// K's). Dynamic shared memory: (rows + 64)·tile_stride<D>() + 64·tile_stride<DV>() 16-bit
// elements.
template <int E, int D, int DV, int M, int WARPS>
__device__ void flash_forward(FORWARD_PARAMS) {
    constexpr int BM_FWD = 16 * M * WARPS, FWD_M = M, FWD_THREADS = 32 * WARPS, S = tile_stride<D>();
    extern __shared__ __align__(128) u16 dynamic_shared[];
    u16* sq = dynamic_shared;
    u16* sk = sq + BM_FWD * S;
    u16* sv = sk + BN * S;
    const int head = blockIdx.x, kv_head = head / group, mask = mask_of_head[head];
    const int q_tiles = (seqlen + BM_FWD - 1) / BM_FWD;
    // Longest work lists first, so the last wave is short.
    const int q_tile = order[mask * q_tiles + blockIdx.y];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int q0 = q_tile * BM_FWD;
    const u16* kh = k + ((size_t)kv_head * seqlen) * D;
    const u16* vh = v + ((size_t)kv_head * seqlen) * DV;
    const unsigned list = mask * q_tiles + q_tile;
    const unsigned begin = tile_start[list], end = tile_start[list + 1];

    load_tile_async<BM_FWD, D, FWD_THREADS>(sq, q + ((size_t)head * seqlen + q0) * D, min(BM_FWD, seqlen - q0));
    if (begin < end) {
        const int k0 = (int)(tiles[begin] & 0x7fffffffu) * BN;
        load_tile_async<BN, D, FWD_THREADS>(sk, kh + (size_t)k0 * D, min(BN, seqlen - k0));
    }
    commit_copies();

    // This thread's 4 rows ("slots"): q0 + warp·32 + block·16 + g, and 8 rows further.
    const unsigned* table_rows = row_start + (size_t)mask * (seqlen + 1);
    const int row0 = q0 + warp * 16 * FWD_M + g;
    auto row_of = [&](int slot) { return row0 + (slot >> 1) * 16 + (slot & 1) * 8; };
    Allowed keys[2 * FWD_M];
    #pragma unroll
    for (int slot = 0; slot < 2 * FWD_M; ++slot) keys[slot] = Allowed(table_rows, row_of(slot), seqlen, intervals);

    float acc[FWD_M][DV / 8][4];
    #pragma unroll
    for (int mb = 0; mb < FWD_M; ++mb)
        #pragma unroll
        for (int n = 0; n < DV / 8; ++n) acc[mb][n][0] = acc[mb][n][1] = acc[mb][n][2] = acc[mb][n][3] = 0.0f;
    const float minus_inf = __int_as_float(0xff800000);
    float m[2 * FWD_M], l[2 * FWD_M];
    #pragma unroll
    for (int slot = 0; slot < 2 * FWD_M; ++slot) { m[slot] = minus_inf; l[slot] = 0.0f; }

    for (unsigned w = begin; w < end; ++w) {
        const unsigned entry = tiles[w];
        const bool partial = entry >> 31;
        const int k0 = (int)(entry & 0x7fffffffu) * BN;
        __syncthreads();  // every warp is done with V(j-1)
        load_tile_async<BN, DV, FWD_THREADS>(sv, vh + (size_t)k0 * DV, min(BN, seqlen - k0));
        commit_copies();
        wait_copies<1>();  // K(j) (and Q) have landed
        __syncthreads();

        // S = Q·Kᵀ for the warp's 32 rows × 64 keys.
        float s[FWD_M][BN / 8][4];
        #pragma unroll
        for (int mb = 0; mb < FWD_M; ++mb)
            #pragma unroll
            for (int n = 0; n < BN / 8; ++n) s[mb][n][0] = s[mb][n][1] = s[mb][n][2] = s[mb][n][3] = 0.0f;
        #pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            u32 qa[FWD_M][4];
            #pragma unroll
            for (int mb = 0; mb < FWD_M; ++mb) a_fragment<D>(qa[mb], sq, warp * 16 * FWD_M + mb * 16, kk);
            #pragma unroll
            for (int n16 = 0; n16 < BN / 16; ++n16) {
                u32 b[4];
                bt_fragments<D>(b, sk, n16 * 16, kk);
                #pragma unroll
                for (int mb = 0; mb < FWD_M; ++mb) {
                    mma<E>(s[mb][2 * n16], qa[mb], b);
                    mma<E>(s[mb][2 * n16 + 1], qa[mb], b + 2);
                }
            }
        }
        __syncthreads();  // every warp is done with K(j): fetch K(j+1) while this tile finishes
        if (w + 1 < end) {
            const int k1 = (int)(tiles[w + 1] & 0x7fffffffu) * BN;
            load_tile_async<BN, D, FWD_THREADS>(sk, kh + (size_t)k1 * D, min(BN, seqlen - k1));
        }
        commit_copies();

        // Mask what the tile does not allow (and keys past the end). Scores stay unscaled: the
        // scale into the log2 domain joins the exponent below (one FFMA per score).
        if (partial || k0 + BN > seqlen) {
            if (partial) {
                #pragma unroll
                for (int slot = 0; slot < 2 * FWD_M; ++slot) keys[slot].seek(k0, intervals);
            }
            #pragma unroll
            for (int mb = 0; mb < FWD_M; ++mb)
                #pragma unroll
                for (int n = 0; n < BN / 8; ++n)
                    #pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        const int slot = mb * 2 + (i >> 1);
                        const int key = k0 + n * 8 + t * 2 + (i & 1);
                        bool ok = key < seqlen;
                        if (ok && partial) ok = keys[slot].holds(key, intervals);
                        if (!ok) s[mb][n][i] = minus_inf;
                    }
        }
        // Online softmax per row: maxima over the 4 threads that share a row (in the log2
        // domain; the scale is positive), then rescale.
        #pragma unroll
        for (int slot = 0; slot < 2 * FWD_M; ++slot) {
            const int mb = slot >> 1, i0 = (slot & 1) * 2;
            float mx = minus_inf;
            #pragma unroll
            for (int n = 0; n < BN / 8; ++n) mx = fmaxf(mx, fmaxf(s[mb][n][i0], s[mb][n][i0 + 1]));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            mx = fmaxf(m[slot], mx * scale_log2);
            const float base = (mx == minus_inf) ? 0.0f : mx;
            const float shrink = fast_exp2(m[slot] - base);
            // O needs rescaling only where a row's maximum moved; the warp votes, so that it
            // stays on one path (most tiles past the first few move no maximum).
            const bool moved = __any_sync(0xffffffffu, mx != m[slot]);
            m[slot] = mx;
            float sum = 0.0f;
            #pragma unroll
            for (int n = 0; n < BN / 8; ++n) {
                s[mb][n][i0] = fast_exp2(fmaf(s[mb][n][i0], scale_log2, -base));
                s[mb][n][i0 + 1] = fast_exp2(fmaf(s[mb][n][i0 + 1], scale_log2, -base));
                sum += s[mb][n][i0] + s[mb][n][i0 + 1];
            }
            l[slot] = l[slot] * shrink + sum;
            if (moved) {
                #pragma unroll
                for (int n = 0; n < DV / 8; ++n) { acc[mb][n][i0] *= shrink; acc[mb][n][i0 + 1] *= shrink; }
            }
        }
        wait_copies<1>();  // V(j) has landed
        __syncthreads();
        // O += P·V: P's accumulators become A fragments, 16 keys at a time.
        #pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
            u32 pa[FWD_M][4];
            #pragma unroll
            for (int mb = 0; mb < FWD_M; ++mb) {
                pa[mb][0] = pack2<E>(s[mb][2 * kk][0], s[mb][2 * kk][1]);
                pa[mb][1] = pack2<E>(s[mb][2 * kk][2], s[mb][2 * kk][3]);
                pa[mb][2] = pack2<E>(s[mb][2 * kk + 1][0], s[mb][2 * kk + 1][1]);
                pa[mb][3] = pack2<E>(s[mb][2 * kk + 1][2], s[mb][2 * kk + 1][3]);
            }
            #pragma unroll
            for (int c2 = 0; c2 < DV / 16; ++c2) {
                u32 b[4];
                b_fragments<DV>(b, sv, kk * 16, c2);
                #pragma unroll
                for (int mb = 0; mb < FWD_M; ++mb) {
                    mma<E>(acc[mb][2 * c2], pa[mb], b);
                    mma<E>(acc[mb][2 * c2 + 1], pa[mb], b + 2);
                }
            }
        }
    }
    // Row sums over the 4 threads of a row, then O = acc / l and LSE = ln(l) + m·ln 2.
    const float ln2 = 0.6931471805599453f;
    #pragma unroll
    for (int slot = 0; slot < 2 * FWD_M; ++slot) {
        const int mb = slot >> 1, i0 = (slot & 1) * 2;
        float sum = l[slot];
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        const float inv = (m[slot] == minus_inf || sum == 0.0f) ? 0.0f : 1.0f / sum;
        const int r = row_of(slot);
        if (r >= seqlen) continue;
        float* o_row = out + ((size_t)head * seqlen + r) * DV;
        #pragma unroll
        for (int n = 0; n < DV / 8; ++n)
            *reinterpret_cast<float2*>(o_row + n * 8 + t * 2) = make_float2(acc[mb][n][i0] * inv, acc[mb][n][i0 + 1] * inv);
        if (t == 0) lse[(size_t)head * seqlen + r] = (inv == 0.0f) ? minus_inf : (m[slot] * ln2 + logf(sum));
    }
}

#define FLASH_FORWARD_TILE(NAME, SUFFIX, E, D, DV, M, WARPS, BLOCKS) \
extern "C" __global__ void __launch_bounds__(32 * WARPS, BLOCKS) NAME##_##SUFFIX(const FlashParams p) { \
    flash_forward<E, D, DV, M, WARPS>(p.q, p.k, p.v, p.out, p.lse, p.tile_start, p.tiles, p.order, p.interval_start, p.intervals, \
                           p.mask_of_head, p.seqlen, p.group, p.scale_log2); }
// Each head dim's 128-row (`flash_forward`) and 64-row (`flash_forward_narrow`) kernels. Past
// head_dim 128 a warp keeps 16 rows (up to D/2 accumulators a thread), so the 128-row tile takes
// 8 warps, one CTA an SM. Instantiated with the backward in flash.cu.
#define FLASH_FORWARD(SUFFIX, E, D, DV) \
    FLASH_FORWARD_TILE(flash_forward, SUFFIX, E, D, DV, (D > RESIDENT_HEAD_DIM ? 1 : 2), (D > RESIDENT_HEAD_DIM ? 8 : 4), \
                       (D > RESIDENT_HEAD_DIM ? 1 : 2)) \
    FLASH_FORWARD_TILE(flash_forward_narrow, SUFFIX, E, D, DV, 1, 4, 2)
