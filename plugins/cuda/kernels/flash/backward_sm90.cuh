// The Hopper backward (sm_90a): dQ and dK/dV on warpgroup MMAs, cp.async and TMA variants, and
// their instantiations.
#pragma once

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

// Hopper backward (sm_90a), head_dim 128: the split backward's two kernels on warpgroup MMAs, a
// warpgroup per 64 rows; every product is a scores or a values one (above).

#define HOPPER_HEAD_DIM 128
// The TMA key-tile kernel's parameters: maps of Q, K, V and dO (boxes of 64 rows for Q and dO,
// 128 for K and V), then as the others'.
#define KEY_TMA_PARAMS const TensorMap* q_map, const TensorMap* k_map, const TensorMap* v_map, const TensorMap* do_map, KEY_TILE_TAIL

// The query-tile kernels' parameters after their four 16-bit inputs (Q, K, V and dO, by address
// or by TMA map).
#define QUERY_TILE_TAIL const float* __restrict__ lse, const float* __restrict__ delta, float* __restrict__ dq, \
    const unsigned* __restrict__ tile_start, const unsigned* __restrict__ tiles, const unsigned* __restrict__ order, \
    const unsigned* __restrict__ row_start, const unsigned* __restrict__ intervals, \
    const int* __restrict__ mask_of_head, int seqlen, int group, float scale, float scale_log2
#define QUERY_TILE_TAIL_ARGS(p) p.lse, p.delta, p.dq, p.tile_start, p.tiles, p.order, p.interval_start, p.intervals, p.mask_of_head, \
    p.seqlen, p.group, p.scale, p.scale_log2

// A warpgroup's 64 query rows of a wgmma dQ kernel (this thread's rows row0 and row0 + 8): their
// Q and dO fragments in registers, LSE·log2 e, D and key intervals.
struct QueryRows {
    u32 q[8][4], d_out[8][4];
    float lse[2], delta[2];
    Allowed keys[2];

    __device__ QueryRows(const u16* q_head, const u16* do_head, const float* lse_head, const float* delta_head,
                         const unsigned* table_rows, const unsigned* intervals, int row0, int seqlen) {
        const float log2e = 1.4426950408889634f;
        #pragma unroll
        for (int slot = 0; slot < 2; ++slot) {
            const int r = row0 + slot * 8;
            const bool in = r < seqlen;
            keys[slot] = Allowed(table_rows, r, seqlen, intervals);
            lse[slot] = in ? lse_head[r] * log2e : __int_as_float(0xff800000);
            delta[slot] = in ? delta_head[r] : 0.0f;
        }
        load_row_fragments(q, q_head, row0, seqlen);
        load_row_fragments(d_out, do_head, row0, seqlen);
    }
};

// One 64-key tile of a wgmma dQ kernel for a warpgroup's rows (sk, sv: the tile's K and V panels;
// `inside`: the query tile lies inside the sequence): S = Q·Kᵀ and dP = dO·Vᵀ in flight
// together, P and dS = P∘(dP − D) while dP lands, then dQ += dS·K issued and committed, not
// waited for.
template <int E>
__device__ __forceinline__ void query_tile_step(float* acc, QueryRows& rows, const u16* sk, const u16* sv, bool partial, int k0,
                                                bool inside, int seqlen, const unsigned* intervals, float scale_log2) {
    const int t = threadIdx.x & 3;
    const float minus_inf = __int_as_float(0xff800000);
    float s[BN / 2], dp[BN / 2];
    wgmma_fence();
    scores_from_registers<E>(s, rows.q, sk);
    wgmma_commit();
    scores_from_registers<E>(dp, rows.d_out, sv);
    wgmma_commit();
    wgmma_wait<1>();
    settle<BN / 2>(s);
    // s[4c + i]: row slot i / 2, key k0 + 8c + 2t + i mod 2. A full tile inside the sequence
    // needs no test: every cell is allowed, so every row has a key and a finite LSE.
    if (!partial && k0 + BN <= seqlen && inside) {
        #pragma unroll
        for (int i = 0; i < BN / 2; ++i) s[i] = fast_exp2(fmaf(s[i], scale_log2, -rows.lse[(i >> 1) & 1]));
    } else {
        if (partial) { rows.keys[0].seek(k0, intervals); rows.keys[1].seek(k0, intervals); }
        #pragma unroll
        for (int i = 0; i < BN / 2; ++i) {
            const int slot = (i >> 1) & 1, key = k0 + (i >> 2) * 8 + t * 2 + (i & 1);
            bool ok = key < seqlen && rows.lse[slot] != minus_inf;
            if (ok && partial) ok = rows.keys[slot].holds(key, intervals);
            s[i] = ok ? fast_exp2(s[i] * scale_log2 - rows.lse[slot]) : 0.0f;
        }
    }
    wgmma_wait<0>();
    settle<BN / 2>(dp);
    #pragma unroll
    for (int i = 0; i < BN / 2; ++i) s[i] *= dp[i] - rows.delta[(i >> 1) & 1];
    issue_values_product<E>(acc, s, sk);  // dQ += dS·K
}

// dQ of one (64-row query tile, query head), as flash_backward_dq, one warpgroup: query_tile_step
// over the tile's work list, K and V of the next tile loading by cp.async into the other of two
// buffers. For masks whose blocks split the 128-row tiles of flash_backward_dq_tma.
template <int E>
__device__ void flash_backward_dq_hopper(const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v,
                                         const u16* __restrict__ d_out, QUERY_TILE_TAIL) {
    constexpr int D = HOPPER_HEAD_DIM, TILE_ELEMENTS = 64 * D, ROWS = 64, NT = HOPPER_WARPGROUP;
    u16* tiles_base = hopper_tiles();
    auto key_buffer = [&](int i) { return tiles_base + i * TILE_ELEMENTS; };
    auto value_buffer = [&](int i) { return tiles_base + (2 + i) * TILE_ELEMENTS; };
    const int head = blockIdx.x, kv_head = head / group, mask = mask_of_head[head];
    const int q_tiles = (seqlen + ROWS - 1) / ROWS, q_tile = blockIdx.y;
    const int q0 = q_tile * ROWS, row0 = q0 + (threadIdx.x >> 5) * 16 + ((threadIdx.x & 31) >> 2);
    const size_t head_rows = (size_t)head * seqlen;
    QueryRows rows(q + head_rows * D, d_out + head_rows * D, lse + head_rows, delta + head_rows,
                         row_start + (size_t)mask * (seqlen + 1), intervals, row0, seqlen);
    const u16* kh = k + ((size_t)kv_head * seqlen) * D;
    const u16* vh = v + ((size_t)kv_head * seqlen) * D;
    const unsigned list = mask * q_tiles + q_tile;
    const unsigned begin = tile_start[list], end = tile_start[list + 1];
    if (begin < end) load_key_tile<NT>(key_buffer(0), value_buffer(0), kh, vh, tiles[begin], seqlen);
    commit_copies();

    float acc[D / 2];
    #pragma unroll
    for (int i = 0; i < D / 2; ++i) acc[i] = 0.0f;
    for (unsigned w = begin; w < end; ++w) {
        const int j = w - begin;
        const unsigned entry = tiles[w];
        // Past tile j−1's products, its buffers are free.
        next_key_tile<NT>(key_buffer((j + 1) & 1), value_buffer((j + 1) & 1), kh, vh, w + 1 < end ? tiles + w + 1 : nullptr, seqlen);
        query_tile_step<E>(acc, rows, key_buffer(j & 1), value_buffer(j & 1), entry >> 31, (int)(entry & 0x7fffffffu) * BN,
                           q0 + ROWS <= seqlen, seqlen, intervals, scale_log2);
        wgmma_wait<0>();
        settle<D / 2>(acc);
    }
    store_rows(dq + head_rows * D, acc, row0, seqlen, scale);
}

// dQ of one (128-row query tile, query head), warp-specialised as flash_forward_tma: one thread
// of the first warpgroup loads each 64-key tile's K and V of the work list by TMA into STAGES
// buffers guarded by "full" and "empty" mbarriers; two consumer warpgroups of 64 rows each
// (their Q and dO in registers) run query_tile_step on every tile with no CTA barrier between
// tiles. The forward's tiles, work lists and order, and its grid (heads, tiles).
template <int E>
__device__ void flash_backward_dq_tma(const TensorMap* k_map, const TensorMap* v_map, const u16* __restrict__ q,
                                      const u16* __restrict__ d_out, QUERY_TILE_TAIL) {
    constexpr int D = HOPPER_HEAD_DIM, TILE_ELEMENTS = 64 * D, ROWS = 128, STAGES = 3;
    u16* tiles_base = hopper_tiles();
    auto key_buffer = [&](int i) { return tiles_base + i * TILE_ELEMENTS; };
    auto value_buffer = [&](int i) { return tiles_base + (STAGES + i) * TILE_ELEMENTS; };
    __shared__ StageRing<STAGES> ring;
    TileWork work;
    GridSchedule(0, 0).first(work);
    const int head = work.head, kv_head = head / group, mask = mask_of_head[head];
    const int q_tiles = (seqlen + ROWS - 1) / ROWS;
    const int q_tile = order[mask * q_tiles + work.position];
    const int q0 = q_tile * ROWS;
    const unsigned list = mask * q_tiles + q_tile;
    const unsigned begin = tile_start[list], end = tile_start[list + 1];
    if (threadIdx.x == 0) {
        ring.init(1, 2 * HOPPER_WARPGROUP);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();

    warp_specialised(
        [&] {
            if (threadIdx.x != 0) return;
            for (unsigned w = begin; w < end; ++w) {
                const int j = w - begin, stage = j % STAGES;
                const int k0 = (int)(tiles[w] & 0x7fffffffu) * BN;
                ring.acquire(j);
                barrier_expect_bytes(ring.filled(j), 2 * BN * D * 2);
                for (int panel = 0; panel < 2; ++panel) {
                    load_box(key_buffer(stage) + panel * BN * 64, k_map, panel * 64, k0, kv_head, ring.filled(j));
                    load_box(value_buffer(stage) + panel * BN * 64, v_map, panel * 64, k0, kv_head, ring.filled(j));
                }
            }
        },
        [&] {
            const int warp = (threadIdx.x >> 5) - 4;
            const int row0 = q0 + warp * 16 + ((threadIdx.x & 31) >> 2);
            const size_t head_rows = (size_t)head * seqlen;
            QueryRows rows(q + head_rows * D, d_out + head_rows * D, lse + head_rows, delta + head_rows,
                                 row_start + (size_t)mask * (seqlen + 1), intervals, row0, seqlen);
            float acc[D / 2];
            #pragma unroll
            for (int i = 0; i < D / 2; ++i) acc[i] = 0.0f;
            for (unsigned w = begin; w < end; ++w) {
                const int j = w - begin, stage = j % STAGES;
                const unsigned entry = tiles[w];
                ring.wait(j);
                query_tile_step<E>(acc, rows, key_buffer(stage), value_buffer(stage), entry >> 31, (int)(entry & 0x7fffffffu) * BN,
                                   q0 + ROWS <= seqlen, seqlen, intervals, scale_log2);
                wgmma_wait<0>();
                ring.release(j);  // this thread's products of the tile have landed
                settle<D / 2>(acc);
            }
            store_rows(dq + head_rows * D, acc, row0, seqlen, scale);
        });
}

// One 64-query step of a wgmma key-tile kernel for a warpgroup's 64 keys (key0: this thread's
// first; k_rows and v_rows: the warpgroup's rows of K and V, panels of KEYS rows; sq and sdo: the
// step's Q and dO, 64-row panels; s_lse and s_delta: its LSE·log2 e and D): Sᵀ = K·Qᵀ and
// dPᵀ = V·dOᵀ in flight together, Pᵀ while dPᵀ lands, dV += Pᵀ·dO in flight while dSᵀ is formed,
// then dK += dSᵀ·Q issued and committed, not waited for. dSᵀ is left in `ds` as A fragments.
// A partial step tests each query against this thread's two keys' row intervals (the mask's
// columns).
template <int E, int KEYS>
__device__ __forceinline__ void key_tile_step(float* dk_acc, float* dv_acc, u32 (*ds)[4], const u16* k_rows, const u16* v_rows,
                                              const u16* sq, const u16* sdo, const float* s_lse, const float* s_delta,
                                              bool partial, int q0, int k0, int key0, int seqlen,
                                              KeyColumns& columns, const unsigned* column_intervals, float scale_log2) {
    constexpr int ROWS = BM;
    const int t = threadIdx.x & 3;
    const float minus_inf = __int_as_float(0xff800000);
    // st[4c + i] is key slot i / 2, query q0 + 8c + 2t + i mod 2.
    float st[ROWS / 2], dpt[ROWS / 2];
    wgmma_fence();
    scores_from_shared<E, KEYS>(st, k_rows, sq);
    wgmma_commit();
    scores_from_shared<E, KEYS>(dpt, v_rows, sdo);
    wgmma_commit();
    wgmma_wait<1>();
    settle<ROWS / 2>(st);
    // A full step inside the sequence needs no test: every cell is allowed, so every row has a
    // key and a finite LSE; a thread's columns come in pairs, read as one 8-byte word.
    if (!partial && q0 + ROWS <= seqlen && k0 + KEYS <= seqlen) {
        #pragma unroll
        for (int c = 0; c < ROWS / 8; ++c) {
            const float2 pair = *reinterpret_cast<const float2*>(&s_lse[c * 8 + t * 2]);
            #pragma unroll
            for (int i = 0; i < 4; ++i)
                st[4 * c + i] = fast_exp2(fmaf(st[4 * c + i], scale_log2, -((i & 1) ? pair.y : pair.x)));
        }
    } else {
        if (partial) { columns.queries[0].seek(q0, column_intervals); columns.queries[1].seek(q0, column_intervals); }
        #pragma unroll
        for (int i = 0; i < ROWS / 2; ++i) {
            const int column = (i >> 2) * 8 + t * 2 + (i & 1), row_q = q0 + column;
            const int slot = (i >> 1) & 1, key = key0 + slot * 8;
            const float row_lse = s_lse[column];
            bool ok = key < seqlen && row_q < seqlen && row_lse != minus_inf;
            if (ok && partial) ok = columns.queries[slot].holds(row_q, column_intervals);
            st[i] = ok ? fast_exp2(st[i] * scale_log2 - row_lse) : 0.0f;
        }
    }
    issue_values_product<E>(dv_acc, st, sdo);  // dV += Pᵀ·dO
    wgmma_wait<1>();
    settle<ROWS / 2>(dpt);
    #pragma unroll
    for (int c = 0; c < ROWS / 8; ++c) {
        const float2 pair = *reinterpret_cast<const float2*>(&s_delta[c * 8 + t * 2]);
        #pragma unroll
        for (int i = 0; i < 4; ++i) dpt[4 * c + i] = st[4 * c + i] * (dpt[4 * c + i] - ((i & 1) ? pair.y : pair.x));
    }
    as_fragments<E>(ds, dpt);
    settle<HOPPER_HEAD_DIM / 2>(dk_acc);
    wgmma_fence();
    values_product<E>(dk_acc, ds, sq);  // dK += dSᵀ·Q
    wgmma_commit();
}

// dK and dV of one (64-key tile, KV head), as flash_backward_dkdv with 64-row steps, one
// warpgroup: key_tile_step over the walk; Q and dO of the next step load into the other of two
// buffers by cp.async. For masks whose blocks split the 128-key tiles of flash_backward_key_tma.
// Shared memory: K, V (64 rows each), then [stage][Q | dO].
template <int E>
__device__ void flash_backward_dkdv_hopper(KEY_TILE_PARAMS) {
    constexpr int D = HOPPER_HEAD_DIM, ROWS = BM, KEYS = 64, TILE_ELEMENTS = 64 * D, NT = HOPPER_WARPGROUP;
    u16* sk = hopper_tiles();
    u16* sv = sk + TILE_ELEMENTS;
    auto stage_tiles = [&](int stage) { return sk + (2 + 2 * stage) * TILE_ELEMENTS; };  // Q, then dO
    __shared__ __align__(16) float s_lse[2][ROWS];
    __shared__ __align__(16) float s_delta[2][ROWS];
    // The key tiles start longest list first (by the group's first head's mask).
    const int kv_head = blockIdx.x, k_tiles = (seqlen + KEYS - 1) / KEYS;
    const int k_tile = order[mask_of_head[kv_head * group] * k_tiles + blockIdx.y];
    const int warp = threadIdx.x >> 5, g = (threadIdx.x & 31) >> 2;
    const int k0 = k_tile * KEYS, key0 = k0 + warp * 16 + g;
    load_panels_async<KEYS, NT>(sk, k + ((size_t)kv_head * seqlen + k0) * D, min(KEYS, seqlen - k0));
    load_panels_async<KEYS, NT>(sv, v + ((size_t)kv_head * seqlen + k0) * D, min(KEYS, seqlen - k0));

    KeyTileWalk<ROWS, KEYS> walk(tile_start, tiles, mask_of_head, seqlen, k_tile, kv_head, group);
    auto issue = [&](int stage) {
        if (walk.done()) return;
        const int head = walk.head, q0 = walk.row0();
        u16* sq = stage_tiles(stage);
        load_panels_async<ROWS, NT>(sq, q + ((size_t)head * seqlen + q0) * D, min(ROWS, seqlen - q0));
        load_panels_async<ROWS, NT>(sq + TILE_ELEMENTS, d_out + ((size_t)head * seqlen + q0) * D, min(ROWS, seqlen - q0));
        stage_row_statistics<ROWS, NT>(s_lse[stage], s_delta[stage], lse, delta, (size_t)head * seqlen, q0, seqlen);
    };
    issue(0);
    commit_copies();

    float dk_acc[D / 2], dv_acc[D / 2];
    #pragma unroll
    for (int i = 0; i < D / 2; ++i) dk_acc[i] = dv_acc[i] = 0.0f;
    KeyColumns columns;
    for (int stage = 0; !walk.done(); stage ^= 1) {
        const bool partial = walk.entry() >> 31;
        const int q0 = walk.row0();
        columns.follow(walk.head, mask_of_head[walk.head], column_start, column_intervals, key0, seqlen);
        walk.advance();
        wait_copies<0>();  // this step's Q, dO and row statistics (and, on the first step, K and V)
        shared_writes_to_async_proxy();
        // Every thread is past the previous step, whose products have landed: the other stage
        // is free.
        __syncthreads();
        issue(stage ^ 1);
        commit_copies();
        const u16* sq = stage_tiles(stage);
        u32 ds[4][4];
        key_tile_step<E, KEYS>(dk_acc, dv_acc, ds, sk, sv, sq, sq + TILE_ELEMENTS, s_lse[stage], s_delta[stage], partial, q0, k0, key0,
                               seqlen, columns, column_intervals, scale_log2);
        wgmma_wait<0>();
        settle<D / 2>(dk_acc);
        settle<D / 2>(dv_acc);
    }
    store_rows(dk + (size_t)kv_head * seqlen * D, dk_acc, key0, seqlen, scale);
    store_rows(dv + (size_t)kv_head * seqlen * D, dv_acc, key0, seqlen, 1.0f);
}

// dK and dV of one (128-key tile, KV head), warp-specialised as flash_forward_tma: the first
// warpgroup gives its registers back; one of its threads loads K and V once and every step's Q
// and dO by TMA, its first warp stages the step's LSE and D rows, into STAGES buffers guarded
// by "full" and "empty" mbarriers; two consumer warpgroups of 64 keys each run key_tile_step
// on every step with no CTA barrier between steps. With DQ, each step also adds dQ = dS·K of its
// rows into the f32 dQ with vector atomics: both warpgroups' dSᵀ go to shared memory as dS
// (64 rows × 128 keys) — one of two buffers by step parity, so one warpgroup may write the next
// step's while the other still reads this one's — and each warpgroup takes 64 of dQ's columns;
// dQ must be zero beforehand. Shared memory: K, V (128 rows each), [stage][Q | dO], [2] dS.
template <int E, bool DQ>
__device__ void flash_backward_key_tma(KEY_TMA_PARAMS) {
    constexpr int D = HOPPER_HEAD_DIM, ROWS = BM, KEYS = 128, TILE_ELEMENTS = 64 * D, STAGES = 2, CONSUMERS = 2 * HOPPER_WARPGROUP;
    u16* sk = hopper_tiles();
    u16* sv = sk + 2 * TILE_ELEMENTS;
    auto stage_tiles = [&](int stage) { return sk + (4 + 2 * stage) * TILE_ELEMENTS; };  // Q, then dO
    auto ds_buffer = [&](int parity) { return stage_tiles(STAGES) + parity * TILE_ELEMENTS; };
    __shared__ __align__(16) float s_lse[STAGES][ROWS];
    __shared__ __align__(16) float s_delta[STAGES][ROWS];
    __shared__ unsigned long long kv_full;
    __shared__ StageRing<STAGES> ring;
    // The key tiles start longest list first (by the group's first head's mask); an item's head
    // is a KV head here.
    TileWork work;
    GridSchedule(0, 0).first(work);
    const int kv_head = work.head, k_tiles = (seqlen + KEYS - 1) / KEYS;
    const int k_tile = order[mask_of_head[kv_head * group] * k_tiles + work.position];
    const int k0 = k_tile * KEYS;
    if (threadIdx.x == 0) {
        barrier_init(&kv_full, 1);
        ring.init(32, CONSUMERS);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    KeyTileWalk<ROWS, KEYS> walk(tile_start, tiles, mask_of_head, seqlen, k_tile, kv_head, group);

    warp_specialised(
        [&] {
            if (threadIdx.x >= 32) return;
            const int lane = threadIdx.x;
            if (lane == 0) {
                barrier_expect_bytes(&kv_full, 2 * KEYS * D * 2);
                for (int panel = 0; panel < 2; ++panel) {
                    load_box(sk + panel * KEYS * 64, k_map, panel * 64, k0, kv_head, &kv_full);
                    load_box(sv + panel * KEYS * 64, v_map, panel * 64, k0, kv_head, &kv_full);
                }
            }
            for (int j = 0; !walk.done(); ++j, walk.advance()) {
                const int stage = j % STAGES, head = walk.head, q0 = walk.row0();
                ring.acquire(j);
                // The warp's stores of the row statistics are released by its arrivals.
                stage_row_statistics<ROWS, 32>(s_lse[stage], s_delta[stage], lse, delta, (size_t)head * seqlen, q0, seqlen);
                if (lane == 0) {
                    barrier_expect_bytes(ring.filled(j), 2 * ROWS * D * 2);
                    u16* sq = stage_tiles(stage);
                    for (int panel = 0; panel < 2; ++panel) {
                        load_box(sq + panel * ROWS * 64, q_map, panel * 64, q0, head, ring.filled(j));
                        load_box(sq + TILE_ELEMENTS + panel * ROWS * 64, do_map, panel * 64, q0, head, ring.filled(j));
                    }
                } else {
                    barrier_arrive(ring.filled(j));
                }
            }
        },
        [&] {
            const int warp = (threadIdx.x >> 5) - 4, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
            const int half = warp >> 2;  // this warpgroup's 64 keys of the tile
            const int key0 = k0 + half * 64 + (warp & 3) * 16 + g;
            // This warpgroup's rows of K and V.
            const u16* k_rows = sk + half * 64 * 64;
            const u16* v_rows = sv + half * 64 * 64;
            float dk_acc[D / 2], dv_acc[D / 2];
            #pragma unroll
            for (int i = 0; i < D / 2; ++i) dk_acc[i] = dv_acc[i] = 0.0f;
            KeyColumns columns;
            barrier_wait(&kv_full, 0);
            for (int j = 0; !walk.done(); ++j) {
                const int stage = j % STAGES;
                const bool partial = walk.entry() >> 31;
                const int head = walk.head, q0 = walk.row0();
                columns.follow(head, mask_of_head[head], column_start, column_intervals, key0, seqlen);
                walk.advance();
                ring.wait(j);
                const u16* sq = stage_tiles(stage);
                u32 ds[4][4];
                key_tile_step<E, KEYS>(dk_acc, dv_acc, ds, k_rows, v_rows, sq, sq + TILE_ELEMENTS, s_lse[stage], s_delta[stage], partial, q0, k0,
                                       key0, seqlen, columns, column_intervals, scale_log2);
                if constexpr (DQ) {
                    u16* sds = ds_buffer(j & 1);
                    store_transposed_fragments(sds + half * 64 * 64, ds);
                    shared_writes_to_async_proxy();
                    // Both halves of dS are written; the other warpgroup is past its product of two
                    // steps ago, which read this buffer.
                    barrier_sync<CONSUMERS>(1);
                    float dq_part[ROWS / 2];
                    wgmma_fence();
                    #pragma unroll
                    for (int step = 0; step < 8; ++step)
                        wgmma_scores<E, 1>(dq_part, panel_step<64>(sds, step), transposed_rows<KEYS>(sk + half * KEYS * 64, step), step);
                    wgmma_commit();
                    wgmma_wait<0>();
                    settle<ROWS / 2>(dq_part);
                    // dq_part[4c + i]: row q0 + 16·(warp mod 4) + g + 8·(i / 2 mod 2), column
                    // 64·half + 8c + 2t + i mod 2.
                    float* dq_rows = dq + ((size_t)head * seqlen + q0) * D + half * 64 + t * 2;
                    #pragma unroll
                    for (int slot = 0; slot < 2; ++slot) {
                        const int row = (warp & 3) * 16 + g + slot * 8;
                        if (q0 + row >= seqlen) continue;
                        #pragma unroll
                        for (int c = 0; c < 8; ++c)
                            add_pair(dq_rows + (size_t)row * D + c * 8, dq_part[4 * c + 2 * slot] * scale, dq_part[4 * c + 2 * slot + 1] * scale);
                    }
                } else {
                    wgmma_wait<0>();
                }
                // Every product reading this stage has landed, and its statistics are read.
                ring.release(j);
                settle<D / 2>(dk_acc);
                settle<D / 2>(dv_acc);
            }
            store_rows(dk + (size_t)kv_head * seqlen * D, dk_acc, key0, seqlen, scale);
            store_rows(dv + (size_t)kv_head * seqlen * D, dv_acc, key0, seqlen, 1.0f);
        });
}

#define FLASH_BACKWARD_DQ_HOPPER(SUFFIX, E) \
extern "C" __global__ void __launch_bounds__(HOPPER_WARPGROUP, 2) flash_backward_dq_hopper_##SUFFIX(const __grid_constant__ FlashParams p) { \
    flash_backward_dq_hopper<E>(p.q, p.k, p.v, p.d_out, QUERY_TILE_TAIL_ARGS(p)); } \
extern "C" __global__ void __launch_bounds__(3 * HOPPER_WARPGROUP, 1) flash_backward_dq_tma_##SUFFIX(const __grid_constant__ FlashParams p) { \
    flash_backward_dq_tma<E>(&p.k_map, &p.v_map, p.q, p.d_out, QUERY_TILE_TAIL_ARGS(p)); }
#define FLASH_BACKWARD_DKDV_HOPPER(SUFFIX, E) \
extern "C" __global__ void __launch_bounds__(HOPPER_WARPGROUP, 2) flash_backward_dkdv_hopper_##SUFFIX(const __grid_constant__ FlashParams p) { \
    flash_backward_dkdv_hopper<E>(KEY_TILE_ARGS(p)); }
#define FLASH_BACKWARD_KEY_TMA(NAME, SUFFIX, E, DQ) \
extern "C" __global__ void __launch_bounds__(3 * HOPPER_WARPGROUP, 1) NAME##_##SUFFIX(const __grid_constant__ FlashParams p) { \
    flash_backward_key_tma<E, DQ>(&p.q_map, &p.k_map, &p.v_map, &p.do_map, KEY_TILE_TAIL_ARGS(p)); }
#define FLASH_BACKWARD_HOPPER(SUFFIX, E) \
FLASH_BACKWARD_DQ_HOPPER(SUFFIX, E) \
FLASH_BACKWARD_DKDV_HOPPER(SUFFIX, E) \
FLASH_BACKWARD_KEY_TMA(flash_backward_dkdv_tma, SUFFIX, E, false) \
FLASH_BACKWARD_KEY_TMA(flash_backward_fused_tma, SUFFIX, E, true)
FLASH_BACKWARD_HOPPER(bf16_d128, 1)
FLASH_BACKWARD_HOPPER(f16_d128, 2)

#endif
