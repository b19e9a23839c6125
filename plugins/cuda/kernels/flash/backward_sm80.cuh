// The mma.sync backward (any architecture from sm_80): D, dQ per query tile, dK and dV (and the
// fused dQ) per key tile, and their instantiations.
#pragma once

// D[h][q] = Σ dO∘O over the value head dimension, one warp per row; the row of dQ is cleared
// for the atomic sums of the fused backward.
template <int E, int D, int DV>
__device__ void flash_delta(const u16* __restrict__ d_out, const float* __restrict__ out, float* __restrict__ delta,
                            float* __restrict__ dq, int rows) {
    const int row = blockIdx.x * (THREADS / 32) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (row >= rows) return;
    float sum = 0.0f;
    for (int i = lane; i < DV; i += 32) sum += to_float<E>(d_out[(size_t)row * DV + i]) * out[(size_t)row * DV + i];
    for (int i = lane; i < D; i += 32) dq[(size_t)row * D + i] = 0.0f;
    for (int offset = 16; offset > 0; offset >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    if (lane == 0) delta[row] = sum;
}

// The backward's paired products for the warp's 16 rows × N rows of two shared tiles:
// x = xa·xtᵀ over DX columns and y = ya·ytᵀ over DY (S and dP, or Sᵀ and dPᵀ: the query/key
// and the value head dims), each B fragment feeding one product; `a_fragments(kk, xa, ya)`
// supplies the A fragments of the 16 columns at kk·16 (ya only while kk < DY/16, xa while
// kk < DX/16).
template <int E, int DX, int DY, int N, class Fragments>
__device__ __forceinline__ void paired_products(float (*x)[4], float (*y)[4], Fragments a_fragments, const u16* xt, const u16* yt) {
    #pragma unroll
    for (int n = 0; n < N / 8; ++n) {
        x[n][0] = x[n][1] = x[n][2] = x[n][3] = 0.0f;
        y[n][0] = y[n][1] = y[n][2] = y[n][3] = 0.0f;
    }
    #pragma unroll
    for (int kk = 0; kk < (DX > DY ? DX : DY) / 16; ++kk) {
        u32 xa[4], ya[4];
        a_fragments(kk, xa, ya);
        #pragma unroll
        for (int n16 = 0; n16 < N / 16; ++n16) {
            u32 b[4];
            if (kk < DX / 16) {
                bt_fragments<DX>(b, xt, n16 * 16, kk);
                mma<E>(x[2 * n16], xa, b);
                mma<E>(x[2 * n16 + 1], xa, b + 2);
            }
            if (kk < DY / 16) {
                bt_fragments<DY>(b, yt, n16 * 16, kk);
                mma<E>(y[2 * n16], ya, b);
                mma<E>(y[2 * n16 + 1], ya, b + 2);
            }
        }
    }
}

// dQ of one (64-row query tile, query head): S and P recomputed per key tile as in the forward
// pass, dP = dO·Vᵀ, dS = P∘(dP − D), dQ += dS·K; scaled at the end. Up to head_dim 128, Q and dO
// are staged through the K and V buffers into registers (static shared memory); past it their
// fragments would not fit beside dQ's accumulators, so they stay in shared tiles of their own
// (dynamic shared memory: Q, dO, two K buffers and V, 64 rows each). K(j+1) (into the other of
// two K buffers) and V(j+1) load while dS and dQ of tile j are computed. DV is V's and dO's head
// dim.
template <int E, int D, int DV>
__device__ void flash_backward_dq(const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v,
                                  const u16* __restrict__ d_out, const float* __restrict__ lse, const float* __restrict__ delta,
                                  float* __restrict__ dq,
                                  const unsigned* __restrict__ tile_start, const unsigned* __restrict__ tiles,
                                  const unsigned* __restrict__ row_start, const unsigned* __restrict__ intervals,
                                  const int* __restrict__ mask_of_head, int seqlen, int group, float scale, float scale_log2) {
    constexpr int S = tile_stride<D>(), SV = tile_stride<DV>();
    constexpr bool RESIDENT = D <= RESIDENT_HEAD_DIM;  // Q's and dO's fragments in registers
    __shared__ __align__(128) u16 static_tiles[RESIDENT ? 2 * BN * S + BN * SV : 1];
    extern __shared__ __align__(128) u16 dynamic_shared[];
    u16* const k_buffers = RESIDENT ? static_tiles : dynamic_shared;
    u16* const sv = k_buffers + 2 * BN * S;
    // Where Q and dO go: through the first K buffer and V into registers, or to tiles of their own.
    u16* const sq = RESIDENT ? k_buffers : sv + BN * SV;
    u16* const sdo = RESIDENT ? sv : sq + BM * S;
    const int q_tile = blockIdx.y, head = blockIdx.x, kv_head = head / group;
    const int mask = mask_of_head[head];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int q0 = q_tile * BM;
    const int r0 = q0 + warp * 16 + g, r1 = r0 + 8;
    const float minus_inf = __int_as_float(0xff800000), log2e = 1.4426950408889634f;
    const unsigned* table_rows = row_start + (size_t)mask * (seqlen + 1);
    Allowed keys0(table_rows, r0, seqlen, intervals), keys1(table_rows, r1, seqlen, intervals);
    const float lse0 = r0 < seqlen ? lse[(size_t)head * seqlen + r0] * log2e : minus_inf;
    const float lse1 = r1 < seqlen ? lse[(size_t)head * seqlen + r1] * log2e : minus_inf;
    const float d0 = r0 < seqlen ? delta[(size_t)head * seqlen + r0] : 0.0f;
    const float d1 = r1 < seqlen ? delta[(size_t)head * seqlen + r1] : 0.0f;

    u32 qa[RESIDENT ? D / 16 : 1][4], da[RESIDENT ? DV / 16 : 1][4];
    load_tile_async<BM, D, THREADS>(sq, q + ((size_t)head * seqlen + q0) * D, min(BM, seqlen - q0));
    load_tile_async<BM, DV, THREADS>(sdo, d_out + ((size_t)head * seqlen + q0) * DV, min(BM, seqlen - q0));
    if constexpr (RESIDENT) {
        commit_copies();
        wait_copies<0>();
        __syncthreads();
        #pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) a_fragment<D>(qa[kk], sq, warp * 16, kk);
        #pragma unroll
        for (int kk = 0; kk < DV / 16; ++kk) a_fragment<DV>(da[kk], sdo, warp * 16, kk);
        __syncthreads();
    }

    float acc[D / 8][4];
    #pragma unroll
    for (int n = 0; n < D / 8; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
    const u16* kh = k + ((size_t)kv_head * seqlen) * D;
    const u16* vh = v + ((size_t)kv_head * seqlen) * DV;
    const unsigned list = mask * ((seqlen + BM - 1) / BM) + q_tile;
    const unsigned begin = tile_start[list], end = tile_start[list + 1];
    if (begin < end) {
        const int k0 = (int)(tiles[begin] & 0x7fffffffu) * BN;
        load_tile_async<BN, D, THREADS>(k_buffers, kh + (size_t)k0 * D, min(BN, seqlen - k0));
        load_tile_async<BN, DV, THREADS>(sv, vh + (size_t)k0 * DV, min(BN, seqlen - k0));
    }
    commit_copies();
    for (unsigned w = begin; w < end; ++w) {
        const unsigned entry = tiles[w];
        const bool partial = entry >> 31;
        const int k0 = (int)(entry & 0x7fffffffu) * BN;
        const u16* sk = k_buffers + ((w - begin) & 1) * BN * S;
        wait_copies<0>();  // K(j) and V(j)
        __syncthreads();  // ... for every thread; and every warp is done with K(j-1)'s buffer
        float s[BN / 8][4], dp[BN / 8][4];
        paired_products<E, D, DV, BN>(s, dp, [&](int kk, u32* xa, u32* ya) {
            if constexpr (RESIDENT) {
                #pragma unroll
                for (int i = 0; i < 4; ++i) {
                    if (kk < D / 16) xa[i] = qa[kk][i];
                    if (kk < DV / 16) ya[i] = da[kk][i];
                }
            } else {
                if (kk < D / 16) a_fragment<D>(xa, sq, warp * 16, kk);
                if (kk < DV / 16) a_fragment<DV>(ya, sdo, warp * 16, kk);
            }
        }, sk, sv);
        __syncthreads();  // every warp is done with V(j)
        if (w + 1 < end) {
            const int k1 = (int)(tiles[w + 1] & 0x7fffffffu) * BN;
            load_tile_async<BN, D, THREADS>(k_buffers + ((w + 1 - begin) & 1) * BN * S, kh + (size_t)k1 * D, min(BN, seqlen - k1));
            load_tile_async<BN, DV, THREADS>(sv, vh + (size_t)k1 * DV, min(BN, seqlen - k1));
        }
        commit_copies();
        // dS = P∘(dP − D), P = exp2(S·scale·log2e − LSE·log2e); masked cells contribute nothing.
        // A full tile inside the sequence needs no test: every cell is allowed, so every row has
        // a key and a finite LSE.
        if (!partial && k0 + BN <= seqlen && q0 + BM <= seqlen) {
            #pragma unroll
            for (int n = 0; n < BN / 8; ++n) {
                #pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const bool upper = i < 2;
                    const float p = fast_exp2(fmaf(s[n][i], scale_log2, -(upper ? lse0 : lse1)));
                    s[n][i] = p * (dp[n][i] - (upper ? d0 : d1));
                }
            }
        } else {
            if (partial) { keys0.seek(k0, intervals); keys1.seek(k0, intervals); }
            #pragma unroll
            for (int n = 0; n < BN / 8; ++n) {
                #pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int key = k0 + n * 8 + t * 2 + (i & 1);
                    const bool upper = i < 2;
                    const float row_lse = upper ? lse0 : lse1;
                    bool ok = key < seqlen && row_lse != minus_inf;
                    if (ok && partial) ok = (upper ? keys0 : keys1).holds(key, intervals);
                    const float p = ok ? fast_exp2(s[n][i] * scale_log2 - row_lse) : 0.0f;
                    s[n][i] = p * (dp[n][i] - (upper ? d0 : d1));
                }
            }
        }
        // dQ += dS·K, 16 keys at a time.
        #pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
            u32 pa[4] = {pack2<E>(s[2 * kk][0], s[2 * kk][1]), pack2<E>(s[2 * kk][2], s[2 * kk][3]),
                         pack2<E>(s[2 * kk + 1][0], s[2 * kk + 1][1]), pack2<E>(s[2 * kk + 1][2], s[2 * kk + 1][3])};
            #pragma unroll
            for (int c2 = 0; c2 < D / 16; ++c2) {
                u32 b[4];
                b_fragments<D>(b, sk, kk * 16, c2);
                mma<E>(acc[2 * c2], pa, b);
                mma<E>(acc[2 * c2 + 1], pa, b + 2);
            }
        }
    }
    float* dqh = dq + ((size_t)head * seqlen) * D;
    #pragma unroll
    for (int n = 0; n < D / 8; ++n) {
        const int col = n * 8 + t * 2;
        if (r0 < seqlen) *reinterpret_cast<float2*>(dqh + (size_t)r0 * D + col) = make_float2(acc[n][0] * scale, acc[n][1] * scale);
        if (r1 < seqlen) *reinterpret_cast<float2*>(dqh + (size_t)r1 * D + col) = make_float2(acc[n][2] * scale, acc[n][3] * scale);
    }
}

#define BQ 32
// The column parts of a key tile's dK and dV (one CTA each; the launch's grid z, flash/launch.rs).
#define KEY_TILE_PARTS(D) ((D) > RESIDENT_HEAD_DIM ? 2 : 1)

// The key-tile kernels' parameters after their four 16-bit inputs (Q, K, V and dO, by address
// or by TMA map): LSE, D, the f32 gradients, the key tiles' work lists and order, the mask's
// columns.
#define KEY_TILE_TAIL const float* __restrict__ lse, const float* __restrict__ delta, \
    float* __restrict__ dq, float* __restrict__ dk, float* __restrict__ dv, \
    const unsigned* __restrict__ tile_start, const unsigned* __restrict__ tiles, const unsigned* __restrict__ order, \
    const unsigned* __restrict__ column_start, const unsigned* __restrict__ column_intervals, \
    const int* __restrict__ mask_of_head, int seqlen, int group, float scale, float scale_log2
// ... and the same taken from a launch's FlashParams.
#define KEY_TILE_TAIL_ARGS(p) p.lse, p.delta, p.dq, p.dk, p.dv, p.tile_start, p.tiles, p.order, p.interval_start, p.intervals, \
    p.mask_of_head, p.seqlen, p.group, p.scale, p.scale_log2
#define KEY_TILE_PARAMS const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v, const u16* __restrict__ d_out, KEY_TILE_TAIL
#define KEY_TILE_ARGS(p) p.q, p.k, p.v, p.d_out, KEY_TILE_TAIL_ARGS(p)

// dK and dV of one (64-key tile, KV head): for each step of the walk, Sᵀ = K·Qᵀ, Pᵀ,
// dV += Pᵀ·dO, dPᵀ = V·dOᵀ, dSᵀ = Pᵀ∘(dPᵀ − D), dK += dSᵀ·Q; dK scaled at the end. K and V stay
// in shared memory; Q and dO of the next step load into the other of two buffers while this one
// runs. With DQ, each step also adds its share of dQ = dS·K (the step's 32 rows over the tile's
// 64 keys, through shared memory) into the f32 dQ with vector atomics: five products per step
// instead of the seven of the deterministic pair (this kernel without DQ, then the dQ kernel,
// which recomputes S and dP). dQ must be zero beforehand (the D kernel clears it).
// Past head_dim 128 the dK and dV accumulators of every column (D + DV a thread) would not fit
// the registers: a CTA keeps KEY_TILE_PARTS(D) = 2 parts' columns of each (blockIdx.z the part)
// and the two CTAs of a key tile each compute its Sᵀ and dPᵀ over the whole head dims.
// Dynamic shared memory: [stage][Q | dO] (2·2·BQ rows), K and V (BN rows each), in rows of
// tile_stride<D>() elements (tile_stride<DV>() for V and dO), and dS (BQ × BN).
template <int E, int D, int DV, bool DQ>
__device__ void flash_backward_dkdv(KEY_TILE_PARAMS) {
    constexpr int S = tile_stride<D>(), SV = tile_stride<DV>(), STAGE = BQ * (S + SV);
    // The part's 16-column blocks of dK (and of dQ) and of dV.
    constexpr int PARTS = KEY_TILE_PARTS(D), BLOCKS = D / PARTS / 16, V_BLOCKS = DV / PARTS / 16;
    const int part = PARTS > 1 ? (int)blockIdx.z : 0;
    const int first_block = part * BLOCKS, first_v_block = part * V_BLOCKS;
    extern __shared__ __align__(128) u16 dynamic_shared[];
    u16* buffers = dynamic_shared;
    u16* sk = buffers + 2 * STAGE;
    u16* sv = sk + BN * S;
    u16* sds = sv + BN * SV;
    __shared__ __align__(16) float s_lse[2][BQ];
    __shared__ __align__(16) float s_delta[2][BQ];
    // The key tiles start longest list first (by the group's first head's mask).
    const int kv_head = blockIdx.x, k_tiles = (seqlen + BN - 1) / BN;
    const int k_tile = order[mask_of_head[kv_head * group] * k_tiles + blockIdx.y];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int k0 = k_tile * BN;
    const int key0 = k0 + warp * 16 + g, key1 = key0 + 8;
    const float minus_inf = __int_as_float(0xff800000);

    load_tile_async<BN, D, THREADS>(sk, k + ((size_t)kv_head * seqlen + k0) * D, min(BN, seqlen - k0));
    load_tile_async<BN, DV, THREADS>(sv, v + ((size_t)kv_head * seqlen + k0) * DV, min(BN, seqlen - k0));
    commit_copies();

    KeyTileWalk<BQ> walk(tile_start, tiles, mask_of_head, seqlen, k_tile, kv_head, group);
    auto issue = [&](int stage) {
        if (walk.done()) return;
        const int head = walk.head, q0 = walk.row0();
        u16* sq = buffers + stage * STAGE;
        load_tile_async<BQ, D, THREADS>(sq, q + ((size_t)head * seqlen + q0) * D, min(BQ, seqlen - q0));
        load_tile_async<BQ, DV, THREADS>(sq + BQ * S, d_out + ((size_t)head * seqlen + q0) * DV, min(BQ, seqlen - q0));
        stage_row_statistics<BQ, THREADS>(s_lse[stage], s_delta[stage], lse, delta, (size_t)head * seqlen, q0, seqlen);
    };
    issue(0);
    commit_copies();

    float dk_acc[2 * BLOCKS][4], dv_acc[2 * V_BLOCKS][4];
    #pragma unroll
    for (int n = 0; n < 2 * BLOCKS; ++n) dk_acc[n][0] = dk_acc[n][1] = dk_acc[n][2] = dk_acc[n][3] = 0.0f;
    #pragma unroll
    for (int n = 0; n < 2 * V_BLOCKS; ++n) dv_acc[n][0] = dv_acc[n][1] = dv_acc[n][2] = dv_acc[n][3] = 0.0f;
    KeyColumns columns;
    for (int stage = 0; !walk.done(); stage ^= 1) {
        const int step_head = walk.head;
        const bool partial = walk.entry() >> 31;
        const int q0 = walk.row0();
        columns.follow(step_head, mask_of_head[step_head], column_start, column_intervals, key0, seqlen);
        walk.advance();
        // The other buffer was last read two steps ago, behind the barrier that ended that step.
        issue(stage ^ 1);
        commit_copies();
        wait_copies<1>();  // this step's Q and dO (and, on the first step, K and V)
        __syncthreads();
        const u16* sq = buffers + stage * STAGE;
        const u16* sdo = sq + BQ * S;
        // Sᵀ and dPᵀ for the warp's 16 keys × 32 queries.
        float st[BQ / 8][4], dpt[BQ / 8][4];
        paired_products<E, D, DV, BQ>(st, dpt, [&](int kk, u32* ka, u32* va) {
            if (kk < D / 16) a_fragment<D>(ka, sk, warp * 16, kk);
            if (kk < DV / 16) a_fragment<DV>(va, sv, warp * 16, kk);
        }, sq, sdo);
        // Pᵀ (kept in st) and dSᵀ (in dpt). A full step inside the sequence needs no test: every
        // cell is allowed, so every row has a key and a finite LSE; a thread's columns come in
        // pairs, read as one 8-byte word each.
        if (!partial && q0 + BQ <= seqlen && k0 + BN <= seqlen) {
            #pragma unroll
            for (int n = 0; n < BQ / 8; ++n) {
                const float2 row_lse = *reinterpret_cast<const float2*>(&s_lse[stage][n * 8 + t * 2]);
                const float2 row_delta = *reinterpret_cast<const float2*>(&s_delta[stage][n * 8 + t * 2]);
                #pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const float p = fast_exp2(fmaf(st[n][i], scale_log2, -((i & 1) ? row_lse.y : row_lse.x)));
                    st[n][i] = p;
                    dpt[n][i] = p * (dpt[n][i] - ((i & 1) ? row_delta.y : row_delta.x));
                }
            }
        } else {
            if (partial) { columns.queries[0].seek(q0, column_intervals); columns.queries[1].seek(q0, column_intervals); }
            #pragma unroll
            for (int n = 0; n < BQ / 8; ++n) {
                #pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int column = n * 8 + t * 2 + (i & 1);
                    const int row_q = q0 + column;
                    const int slot = i >> 1, key = slot ? key1 : key0;
                    const float row_lse = s_lse[stage][column];
                    bool ok = key < seqlen && row_q < seqlen && row_lse != minus_inf;
                    if (ok && partial) ok = columns.queries[slot].holds(row_q, column_intervals);
                    const float p = ok ? fast_exp2(st[n][i] * scale_log2 - row_lse) : 0.0f;
                    st[n][i] = p;
                    dpt[n][i] = p * (dpt[n][i] - s_delta[stage][column]);
                }
            }
        }
        if constexpr (DQ) {
            // dS, query-major, for dQ's A fragments (rounded as the products round it).
            #pragma unroll
            for (int n = 0; n < BQ / 8; ++n)
                #pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int column = n * 8 + t * 2 + (i & 1), tile_key = warp * 16 + g + (i >> 1) * 8;
                    sds[swizzled<BN>(column, tile_key >> 3) + (tile_key & 7)] = to_bits<E>(dpt[n][i]);
                }
        }
        // dV += Pᵀ·dO and dK += dSᵀ·Q (the part's columns), 16 queries at a time.
        #pragma unroll
        for (int kk = 0; kk < BQ / 16; ++kk) {
            u32 pa[4] = {pack2<E>(st[2 * kk][0], st[2 * kk][1]), pack2<E>(st[2 * kk][2], st[2 * kk][3]),
                         pack2<E>(st[2 * kk + 1][0], st[2 * kk + 1][1]), pack2<E>(st[2 * kk + 1][2], st[2 * kk + 1][3])};
            u32 sa[4] = {pack2<E>(dpt[2 * kk][0], dpt[2 * kk][1]), pack2<E>(dpt[2 * kk][2], dpt[2 * kk][3]),
                         pack2<E>(dpt[2 * kk + 1][0], dpt[2 * kk + 1][1]), pack2<E>(dpt[2 * kk + 1][2], dpt[2 * kk + 1][3])};
            #pragma unroll
            for (int c2 = 0; c2 < (BLOCKS > V_BLOCKS ? BLOCKS : V_BLOCKS); ++c2) {
                u32 b[4];
                if (c2 < V_BLOCKS) {
                    b_fragments<DV>(b, sdo, kk * 16, first_v_block + c2);
                    mma<E>(dv_acc[2 * c2], pa, b);
                    mma<E>(dv_acc[2 * c2 + 1], pa, b + 2);
                }
                if (c2 < BLOCKS) {
                    b_fragments<D>(b, sq, kk * 16, first_block + c2);
                    mma<E>(dk_acc[2 * c2], sa, b);
                    mma<E>(dk_acc[2 * c2 + 1], sa, b + 2);
                }
            }
        }
        if constexpr (DQ) {
            __syncthreads();  // every warp's dS is in place
            // This warp's C2 16-column blocks of the part's columns of the step's dQ rows, over the
            // tile's 64 keys (at head_dim 96 the last warp has none).
            constexpr int C2 = (BLOCKS + 3) / 4;
            float acc[BQ / 16][2 * C2][4];
            #pragma unroll
            for (int mb = 0; mb < BQ / 16; ++mb)
                #pragma unroll
                for (int n = 0; n < 2 * C2; ++n) acc[mb][n][0] = acc[mb][n][1] = acc[mb][n][2] = acc[mb][n][3] = 0.0f;
            #pragma unroll
            for (int kk = 0; kk < BN / 16; ++kk) {
                u32 a[BQ / 16][4];
                #pragma unroll
                for (int mb = 0; mb < BQ / 16; ++mb) a_fragment<BN>(a[mb], sds, mb * 16, kk);
                #pragma unroll
                for (int c = 0; c < C2; ++c) {
                    if (BLOCKS % 4 != 0 && warp * C2 + c >= BLOCKS) continue;
                    u32 b[4];
                    b_fragments<D>(b, sk, kk * 16, first_block + warp * C2 + c);
                    #pragma unroll
                    for (int mb = 0; mb < BQ / 16; ++mb) {
                        mma<E>(acc[mb][2 * c], a[mb], b);
                        mma<E>(acc[mb][2 * c + 1], a[mb], b + 2);
                    }
                }
            }
            float* dqh = dq + (size_t)step_head * seqlen * D;
            #pragma unroll
            for (int mb = 0; mb < BQ / 16; ++mb)
                #pragma unroll
                for (int n = 0; n < 2 * C2; ++n) {
                    if (BLOCKS % 4 != 0 && warp * C2 + (n >> 1) >= BLOCKS) continue;
                    const int col = (first_block + warp * C2 + (n >> 1)) * 16 + (n & 1) * 8 + t * 2;
                    const int r0 = q0 + mb * 16 + g, r1 = r0 + 8;
                    if (r0 < seqlen) add_pair(dqh + (size_t)r0 * D + col, acc[mb][n][0] * scale, acc[mb][n][1] * scale);
                    if (r1 < seqlen) add_pair(dqh + (size_t)r1 * D + col, acc[mb][n][2] * scale, acc[mb][n][3] * scale);
                }
        }
        __syncthreads();  // every warp is done with this buffer (and dS) before it is refilled
    }
    float* dkh = dk + ((size_t)kv_head * seqlen) * D;
    float* dvh = dv + ((size_t)kv_head * seqlen) * DV;
    #pragma unroll
    for (int n = 0; n < 2 * (BLOCKS > V_BLOCKS ? BLOCKS : V_BLOCKS); ++n) {
        const int col = first_block * 16 + n * 8 + t * 2, v_col = first_v_block * 16 + n * 8 + t * 2;
        if (key0 < seqlen) {
            if (n < 2 * BLOCKS) *reinterpret_cast<float2*>(dkh + (size_t)key0 * D + col) = make_float2(dk_acc[n][0] * scale, dk_acc[n][1] * scale);
            if (n < 2 * V_BLOCKS) *reinterpret_cast<float2*>(dvh + (size_t)key0 * DV + v_col) = make_float2(dv_acc[n][0], dv_acc[n][1]);
        }
        if (key1 < seqlen) {
            if (n < 2 * BLOCKS) *reinterpret_cast<float2*>(dkh + (size_t)key1 * D + col) = make_float2(dk_acc[n][2] * scale, dk_acc[n][3] * scale);
            if (n < 2 * V_BLOCKS) *reinterpret_cast<float2*>(dvh + (size_t)key1 * DV + v_col) = make_float2(dv_acc[n][2], dv_acc[n][3]);
        }
    }
}

// Each head dims' backward kernels; instantiated with the forward in flash.cu.
#define FLASH_BACKWARD(SUFFIX, E, D, DV) \
extern "C" __global__ void __launch_bounds__(THREADS) flash_delta_##SUFFIX(const __grid_constant__ FlashParams p) { \
    flash_delta<E, D, DV>(p.d_out, p.out, p.delta, p.dq, p.rows); } \
extern "C" __global__ void __launch_bounds__(THREADS) flash_backward_dq_##SUFFIX(const __grid_constant__ FlashParams p) { \
    flash_backward_dq<E, D, DV>(p.q, p.k, p.v, p.d_out, p.lse, p.delta, p.dq, p.tile_start, p.tiles, p.interval_start, \
                            p.intervals, p.mask_of_head, p.seqlen, p.group, p.scale, p.scale_log2); } \
extern "C" __global__ void __launch_bounds__(THREADS) flash_backward_dkdv_##SUFFIX(const __grid_constant__ FlashParams p) { \
    flash_backward_dkdv<E, D, DV, false>(KEY_TILE_ARGS(p)); } \
extern "C" __global__ void __launch_bounds__(THREADS) flash_backward_fused_##SUFFIX(const __grid_constant__ FlashParams p) { \
    flash_backward_dkdv<E, D, DV, true>(KEY_TILE_ARGS(p)); }
