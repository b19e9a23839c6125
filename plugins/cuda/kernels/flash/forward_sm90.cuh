// The warp-specialised TMA forward (sm_90a) and its instantiations. Needs every header above.
#pragma once

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

// The maps are the kernel's __grid_constant__ parameters: TMA reads them where they are.
#define TMA_FORWARD_PARAMS const TensorMap* q_map, const TensorMap* k_map, const TensorMap* v_map, const u16* __restrict__ q_global, float* __restrict__ out, float* __restrict__ lse, const unsigned* __restrict__ tile_start, \
    const unsigned* __restrict__ tiles, const unsigned* __restrict__ order, const unsigned* __restrict__ row_start, \
    const unsigned* __restrict__ intervals, const int* __restrict__ mask_of_head, int seqlen, int group, float scale_log2, int heads

// KEYS 128: both consumer warpgroups share one 128-row query tile (Q in shared memory, loaded
// by TMA) and each 128-key tile of its list. KEYS 64, for masks whose blocks split 128-row
// tiles: each consumer warpgroup has a 64-row query tile of its own — two neighbours in the
// order, so of similar lengths — with Q in registers, its own list of 64-key tiles, its own
// buffers and barriers, and its own producer thread (threads 0 and 32). `Schedule` hands out the
// items; the rings' uses run on from one item to the next, so a persistent block's producer
// loads an item's first tiles while the consumers finish the last one's.
template <int E, int KEYS, class Schedule>
__device__ void flash_forward_tma(TMA_FORWARD_PARAMS) {
    constexpr bool SHARED = KEYS == 128;
    constexpr int D = 128, ROWS = SHARED ? 128 : 64, STAGES = SHARED ? 2 : 3, LISTS = SHARED ? 1 : 2;
    constexpr int TILE_BYTES = KEYS * D * 2, CONSUMERS = HOPPER_WARPGROUP * (SHARED ? 2 : 1);
    u16* sq = hopper_tiles();
    u16* kv_base = sq + (SHARED ? ROWS * D : 0);
    auto key_buffer = [&](int list, int index) { return kv_base + (list * 2 * STAGES + index) * KEYS * D; };
    auto value_buffer = [&](int list, int index) { return kv_base + (list * 2 * STAGES + STAGES + index) * KEYS * D; };
    // Q's one buffer is a ring of one stage: a persistent block reloads it per item.
    __shared__ StageRing<1> q_ring;
    __shared__ StageRing<STAGES> k_ring[LISTS], v_ring[LISTS];
    const int q_tiles = (seqlen + ROWS - 1) / ROWS, positions = (q_tiles + LISTS - 1) / LISTS;
    // An item's query tiles: one, or (KEYS 64) one per consumer warpgroup, the second possibly
    // past the last.
    auto query_tile = [&](const TileWork& work, int mask, int list) {
        const int position = work.position * LISTS + list;
        return position < q_tiles ? (int)order[mask * q_tiles + position] : -1;
    };
    auto list_bounds = [&](int mask, int q_tile, unsigned& begin, unsigned& end) {
        begin = end = 0;
        if (q_tile >= 0) {
            begin = tile_start[mask * q_tiles + q_tile];
            end = tile_start[mask * q_tiles + q_tile + 1];
        }
    };
    if (threadIdx.x == 0) {
        q_ring.init(1, CONSUMERS);
        for (int list = 0; list < LISTS; ++list) {
            k_ring[list].init(1, CONSUMERS);
            v_ring[list].init(1, CONSUMERS);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();

    warp_specialised(
        [&] {
            if (threadIdx.x % 32 != 0 || threadIdx.x / 32 >= LISTS) return;
            const int list = threadIdx.x / 32;
            Schedule schedule(heads, positions);
            TileWork work;
            int uses = 0;
            for (int item = 0, more = schedule.first(work); more; more = schedule.next(work), ++item) {
                const int head = work.head, kv_head = head / group, mask = mask_of_head[head];
                const int q_tile = query_tile(work, mask, list);
                unsigned begin, end;
                list_bounds(mask, q_tile, begin, end);
                if constexpr (SHARED) {
                    if constexpr (Schedule::PERSISTENT) q_ring.acquire(item);
                    barrier_expect_bytes(q_ring.filled(item), ROWS * D * 2);
                    for (int panel = 0; panel < 2; ++panel)
                        load_box(sq + panel * ROWS * 64, q_map, panel * 64, q_tile * ROWS, head, q_ring.filled(item));
                }
                for (unsigned w = begin; w < end; ++w) {
                    const int j = uses + (int)(w - begin), stage = j % STAGES;
                    const int k0 = (int)(tiles[w] & 0x7fffffffu) * KEYS;
                    k_ring[list].acquire(j);
                    barrier_expect_bytes(k_ring[list].filled(j), TILE_BYTES);
                    for (int panel = 0; panel < 2; ++panel)
                        load_box(key_buffer(list, stage) + panel * KEYS * 64, k_map, panel * 64, k0, kv_head, k_ring[list].filled(j));
                    v_ring[list].acquire(j);
                    barrier_expect_bytes(v_ring[list].filled(j), TILE_BYTES);
                    for (int panel = 0; panel < 2; ++panel)
                        load_box(value_buffer(list, stage) + panel * KEYS * 64, v_map, panel * 64, k0, kv_head, v_ring[list].filled(j));
                }
                uses += (int)(end - begin);
            }
        },
        [&] {
            const int warp = (threadIdx.x >> 5) - 4, lane = threadIdx.x & 31, g = lane >> 2;
            const int half = warp >> 2;  // this consumer warpgroup
            const int list = SHARED ? 0 : half;
            Schedule schedule(heads, positions);
            TileWork work;
            int uses = 0;
            for (int item = 0, more = schedule.first(work); more; more = schedule.next(work), ++item) {
                const int head = work.head, mask = mask_of_head[head], q_tile = query_tile(work, mask, list);
                if (q_tile < 0) continue;
                unsigned begin, end;
                list_bounds(mask, q_tile, begin, end);
                const unsigned* table_rows = row_start + (size_t)mask * (seqlen + 1);
                const int row0 = q_tile * ROWS + (SHARED ? half * 64 : 0) + (warp & 3) * 16 + g;
                Allowed keys[2];
                #pragma unroll
                for (int slot = 0; slot < 2; ++slot) keys[slot] = Allowed(table_rows, row0 + slot * 8, seqlen, intervals);
                float o[D / 2];
                #pragma unroll
                for (int i = 0; i < D / 2; ++i) o[i] = 0.0f;
                const float minus_inf = __int_as_float(0xff800000);
                float m[2] = {minus_inf, minus_inf}, l[2] = {0.0f, 0.0f};
                // This warpgroup's rows of Q, in shared memory or as fragments in registers.
                const u16* q_rows = sq + half * 64 * 64;
                u32 q_fragments[SHARED ? 1 : 8][4];
                if constexpr (SHARED) q_ring.wait(item);
                else load_row_fragments(q_fragments, q_global + (size_t)head * seqlen * D, row0, seqlen);
                u32 p[KEYS / 16][4];

                // Tile t's scores are computed while tile t−1's P·V runs, so the softmax of t
                // overlaps a product in flight (FlashAttention-3's intra-warpgroup pipelining); O
                // is rescaled for t's maximum once t−1's product has landed. j counts the rings'
                // uses across items.
                for (unsigned w = begin; w < end; ++w) {
                    const int t = (int)(w - begin), j = uses + t, stage = j % STAGES;
                    const unsigned entry = tiles[w];
                    const bool partial = entry >> 31;
                    const int k0 = (int)(entry & 0x7fffffffu) * KEYS;
                    k_ring[list].wait(j);
                    float s[KEYS / 2];
                    wgmma_fence();
                    if constexpr (SHARED) scores_from_shared_n128<E, ROWS>(s, q_rows, key_buffer(list, stage));
                    else scores_from_registers<E>(s, q_fragments, key_buffer(list, stage));
                    wgmma_commit();
                    if (t > 0) {
                        const int previous = (j - 1) % STAGES;
                        v_ring[list].wait(j - 1);
                        values_product<E, KEYS>(o, p, value_buffer(list, previous));
                        wgmma_commit();
                        wgmma_wait<1>();
                    } else {
                        wgmma_wait<0>();
                    }
                    settle<KEYS / 2>(s);
                    k_ring[list].release(j);  // this thread's scores are read: K's buffer may refill
                    float shrink[2];
                    bool moved[2];
                    online_softmax<KEYS>(s, m, l, shrink, moved, partial, k0, seqlen, keys, intervals, scale_log2);
                    // Tile t−1's product has landed: O, P and its V buffer are free.
                    wgmma_wait<0>();
                    settle<D / 2>(o);
                    if (t > 0) v_ring[list].release(j - 1);
                    rescale_rows(o, shrink, moved);
                    as_fragments<E, KEYS / 16>(p, s);
                }
                // Every score of the item has been read: Q's buffer may take the next item's.
                if constexpr (SHARED && Schedule::PERSISTENT) q_ring.release(item);
                if (begin < end) {
                    const int j = uses + (int)(end - begin), previous = (j - 1) % STAGES;
                    v_ring[list].wait(j - 1);
                    wgmma_fence();
                    values_product<E, KEYS>(o, p, value_buffer(list, previous));
                    wgmma_commit();
                    wgmma_wait<0>();
                    settle<D / 2>(o);
                    if constexpr (Schedule::PERSISTENT) v_ring[list].release(j - 1);
                }
                store_forward_rows(out, lse, o, m, l, head, row0, seqlen);
                uses += (int)(end - begin);
            }
        });
}

// The narrow shape reads Q by address (into registers), the wide one through its map. Each comes
// with either scheduler: NAME on the grid, NAME_persistent one block an SM.
#define FLASH_FORWARD_TMA_TILE(NAME, SUFFIX, E, KEYS, SCHEDULE) \
extern "C" __global__ void __launch_bounds__(3 * HOPPER_WARPGROUP, 1) NAME##_##SUFFIX(const __grid_constant__ FlashParams p) { \
    flash_forward_tma<E, KEYS, SCHEDULE>(&p.q_map, &p.k_map, &p.v_map, p.q, p.out, p.lse, p.tile_start, p.tiles, p.order, \
                                         p.interval_start, p.intervals, p.mask_of_head, p.seqlen, p.group, p.scale_log2, p.heads); }
#define FLASH_FORWARD_TMA(SUFFIX, E) \
    FLASH_FORWARD_TMA_TILE(flash_forward_tma, SUFFIX, E, 128, GridSchedule) \
    FLASH_FORWARD_TMA_TILE(flash_forward_narrow_tma, SUFFIX, E, 64, GridSchedule) \
    FLASH_FORWARD_TMA_TILE(flash_forward_tma_persistent, SUFFIX, E, 128, PersistentSchedule) \
    FLASH_FORWARD_TMA_TILE(flash_forward_narrow_tma_persistent, SUFFIX, E, 64, PersistentSchedule)
FLASH_FORWARD_TMA(bf16_d128, 1)
FLASH_FORWARD_TMA(f16_d128, 2)

#endif
