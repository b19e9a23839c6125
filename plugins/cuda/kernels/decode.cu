// Split-KV decoding (Flash-Decoding) on tensor cores. A block takes (KV head and row tile,
// sequence) and WARPS consecutive splits of the keys, one a warp: the block's query rows (16 · MT of
// the KV head's group, GQA's heads times the step's new tokens) sit once in shared memory, and each
// warp streams its own 32-key tiles of K and V through a cp.async ring, scores them with
// mma.sync (S = Q·Kᵀ, P·V), keeps an online softmax and leaves its split's partial O and LSE;
// `decode_merge` folds the splits by their LSE.
//
// Q and O: [heads_q][rows][D] with rows = queries · batch (sequence b's token i at b·queries + i);
// packed K and V: [heads_kv][keys][D] at key_offsets[b]; paged: [slots][heads_kv][D], sequence
// b's token t in slot pages[page_offsets[b] + t / page_size] · page_size + t % page_size.
// Sequence b's new token i sees keys 0 ..= kv_lens[b] + keys_after − queries + i: keys_after is 0
// for a whole cache, and for a block of one (a context-parallel rank's shard) the keys of the
// sequence after the block, which the new tokens see too.
//
// Launch: the merge after the split kernel, on grid (ceil(group rows / MERGE_ROWS), heads_kv,
// batch) with MERGE_ROWS · 32 threads. The split kernel: grid (splits / WARPS, heads_kv ·
// row_tiles, batch), WARPS · 32 threads, `splits` (the total, a multiple of WARPS) in DecodeArgs;
// dynamic shared memory, set as the function's maximum first (it is over 48 KB), of
//     bytes = 2 · (D + 8) · (16 · MT + 2 · WARPS · STAGES · TILE) = 2 · (D + 8) · (16 · MT + 768)
// (Q's rows and each warp's K and V ring, rows padded by 8 values so ldmatrix's eight row
// addresses fall in distinct banks). With 228 KB an SM, 1 KB of it reserved per block:
//     D  64, MT 1: 112 896 bytes, 2 blocks an SM     D 128, MT 1: 213 248 bytes, 1 block an SM
//     D  64, MT 2: 115 200 bytes, 2 blocks an SM     D 128, MT 2: 217 600 bytes, 1 block an SM
// Either way 8 KB of K and V a warp-tile at D 64 (16 KB at 128) × 2 tiles ahead × 8 (4) warps:
// 128 KB of loads in flight per SM while the warps compute, 192 KB of ring in all.

#define WARPS 4
#define STAGES 3
#define TILE 32
// Rows of the group a merge block folds, a warp each.
#define MERGE_ROWS 4
// A tile's keys as n8 tiles of S and as k16 steps of P·V.
#define KEY_TILES (TILE / 8)
#define KEY_STEPS (TILE / 16)
#define NEG_INF __int_as_float(0xff800000)

// Mirrors `DecodeArgs` in decode.rs; a size check on each side keeps the two in step.
struct DecodeArgs {
    const unsigned short* q;
    const unsigned short* k;
    const unsigned short* v;
    float* part_out;
    float* part_lse;
    unsigned short* out;
    float* lse;
    const unsigned* kv_lens;
    const unsigned long long* key_offsets;
    const unsigned* page_offsets;
    const unsigned* pages;
    unsigned batch, heads_kv, group, queries, splits, row_tiles, rows, page_size;
    unsigned long long keys;
    float scale_log2;
    unsigned keys_after;
};
static_assert(sizeof(DecodeArgs) == 136, "DecodeArgs must match decode.rs");

// E: 1 = bf16, 2 = fp16.
template <int E>
__device__ __forceinline__ unsigned short store(float x) {
    if (E == 1) {
        unsigned bits = __float_as_uint(x);
        bits += 0x7fffu + ((bits >> 16) & 1u);
        return (unsigned short)(bits >> 16);
    }
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
    return h;
}

__device__ __forceinline__ size_t key_row(const DecodeArgs& a, unsigned b, unsigned kv_head, unsigned t, unsigned d) {
    if (a.page_size == 0) return ((size_t)kv_head * a.keys + a.key_offsets[b] + t) * d;
    size_t slot = (size_t)a.pages[a.page_offsets[b] + t / a.page_size] * a.page_size + t % a.page_size;
    return (slot * a.heads_kv + kv_head) * d;
}

// The asm below carries "memory" so the compiler keeps it in order with the waits and barriers
// that make the copies visible. `.L2::128B` lets L2 fetch a whole 128-byte line for a copy's 16
// bytes: the neighbouring lanes want the rest of it, and a step is one pass over the cache (on
// an H200, 2026-12-07, 2.6% off the time at 64K and 256K keys; 128 bytes beat 256).
__device__ __forceinline__ void cp_async(unsigned to, const unsigned short* from, unsigned bytes) {
    asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;"
                 ::"r"(to), "l"(__cvta_generic_to_global(from)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int PENDING>
__device__ __forceinline__ void wait_copies() { asm volatile("cp.async.wait_group %0;" ::"n"(PENDING) : "memory"); }

__device__ __forceinline__ void ldmatrix(unsigned (&r)[4], unsigned at) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(at) : "memory");
}
__device__ __forceinline__ void ldmatrix_trans(unsigned (&r)[4], unsigned at) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(at) : "memory");
}

// c += a · b for one m16n8k16 tile.
template <int E>
__device__ __forceinline__ void mma(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    if (E == 1)
        asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    else
        asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two values into one register, `lo` in the low half (the lower column of a fragment); cvt puts
// its first source in the high half.
template <int E>
__device__ __forceinline__ unsigned pack(float lo, float hi) {
    unsigned r;
    if (E == 1) asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    else asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// Keys base .. base + TILE − 1 of K and V into a ring stage (K's rows, then V's), 16 bytes a copy,
// rows coalesced; keys from `end` on are zero-filled (source size 0 reads nothing).
template <int D>
__device__ __forceinline__ void load_tile(const DecodeArgs& a, unsigned to, unsigned b, unsigned kv_head,
                                          unsigned base, unsigned end, unsigned lane) {
    constexpr unsigned CHUNKS = D / 8, STRIDE = (D + 8) * 2;
    // key_row once a key (lane l's is key base + l) rather than once a chunk, which would read a
    // paged cache's table D / 8 times over; lanes copying that key's chunks take it by shuffle.
    const unsigned long long mine = lane < TILE && base + lane < end ? key_row(a, b, kv_head, base + lane, D) : 0;
#pragma unroll
    for (unsigned pass = 0; pass < TILE * CHUNKS / 32; ++pass) {
        const unsigned t = pass * (32 / CHUNKS) + lane / CHUNKS, c = lane % CHUNKS * 8;
        const unsigned long long row = __shfl_sync(0xffffffffu, mine, t);
        const unsigned bytes = base + t < end ? 16 : 0, at = to + t * STRIDE + c * 2;
        cp_async(at, a.k + row + c, bytes);
        cp_async(at + TILE * STRIDE, a.v + row + c, bytes);
    }
}

template <int E, int D, int MT>
__device__ void decode_split(const DecodeArgs a) {
    constexpr unsigned ROWS = 16 * MT, STRIDE = D + 8, STAGE_BYTES = 2 * TILE * STRIDE * 2, NT = D / 8, KS = D / 16;
    // Q's A-fragments stay in registers (4 a k16 step and m-tile: 16 / 32 / 32 at D 64 m1 / D 128
    // m1 / D 64 m2) beside O's 4 · NT · MT accumulators; at D 128 m2 they would be 64 more on top of
    // O's 128 and S's 32, past 255, so that variant reloads them from shared memory each tile.
    constexpr bool Q_HELD = MT * D <= 128;
    extern __shared__ __align__(16) unsigned short shared[];

    const unsigned lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const unsigned kv_head = blockIdx.y / a.row_tiles, first_row = blockIdx.y % a.row_tiles * ROWS;
    const unsigned b = blockIdx.z, split = blockIdx.x * WARPS + warp;
    const unsigned group_rows = a.group * a.queries;
    const unsigned row_count = min(ROWS, group_rows - first_row);
    const unsigned kv_len = a.kv_lens[b];
    // Chunks in whole tiles so every tile but a split's last is full.
    const unsigned chunk = ((kv_len + a.splits - 1) / a.splits + TILE - 1) / TILE * TILE;
    const unsigned begin = (unsigned)min((unsigned long long)split * chunk, (unsigned long long)kv_len);
    const unsigned end = begin + min(chunk, kv_len - begin), tiles = (end - begin + TILE - 1) / TILE;
    const unsigned q_tile = (unsigned)__cvta_generic_to_shared(shared);
    const unsigned ring = q_tile + ROWS * STRIDE * 2 + warp * STAGES * STAGE_BYTES;

    // The ring's first tiles go out before Q is read, so Q's loads overlap them. A group is
    // committed even when empty so that group i is always tile i.
    for (unsigned s = 0; s < STAGES - 1; ++s) {
        if (s < tiles) load_tile<D>(a, ring + s * STAGE_BYTES, b, kv_head, begin + s * TILE, end, lane);
        commit();
    }
    for (unsigned at = threadIdx.x; at < ROWS * NT; at += WARPS * 32) {
        const unsigned j = at / NT, c = at % NT * 8;
        uint4 x = make_uint4(0u, 0u, 0u, 0u);
        if (j < row_count) {
            const unsigned r = first_row + j;
            const unsigned head = kv_head * a.group + r / a.queries, row = b * a.queries + r % a.queries;
            x = *(const uint4*)(a.q + ((size_t)head * a.rows + row) * D + c);
        }
        *(uint4*)(shared + j * STRIDE + c) = x;
    }
    __syncthreads();

    // ldmatrix row addresses: lanes 0-15 give rows 0-15 at column 0 and lanes 16-31 the same rows
    // at column 8 (Q as A; V, transposed, as B for two n8 tiles); for K, lanes 8i .. 8i + 7 give
    // keys 0-7 at column 8i (B for one n8 tile over two k16 steps).
    const unsigned rows16 = ((lane & 15) * STRIDE + lane / 16 * 8) * 2;
    const unsigned keys8 = ((lane & 7) * STRIDE + lane / 8 * 8) * 2;
    unsigned q_held[Q_HELD ? MT * KS : 1][4];
    if constexpr (Q_HELD)
        for (unsigned m = 0; m < MT; ++m)
            for (unsigned k = 0; k < KS; ++k)
                ldmatrix(q_held[m * KS + k], q_tile + rows16 + (m * 16 * STRIDE + k * 16) * 2);

    // Lane (g, i) = (lane / 4, lane % 4) holds rows g and g + 8 of each m-tile, columns 2i, 2i + 1
    // of each n8 tile; h picks the row.
    const unsigned g = lane >> 2, pair = (lane & 3) * 2;
    float high[MT][2], total[MT][2], o[MT][NT][4] = {};
    unsigned limit[MT][2];  // keys from here on are past the split's end or the row's causal limit
#pragma unroll
    for (unsigned m = 0; m < MT; ++m)
#pragma unroll
        for (unsigned h = 0; h < 2; ++h) {
            const unsigned r = first_row + m * 16 + h * 8 + g;
            // Signed: a block shorter than the new tokens leaves early rows no key at all.
            const long long last = (long long)kv_len + a.keys_after - a.queries + r % a.queries + 1;
            limit[m][h] = (unsigned)max(0LL, min((long long)end, last));
            high[m][h] = NEG_INF;
            total[m][h] = 0.0f;
        }

    for (unsigned i = 0; i < tiles; ++i) {
        // Tile i has landed for this lane; the barrier shows it to the warp and retires every
        // lane's reads of tile i − 1, whose stage the copy below refills.
        wait_copies<STAGES - 2>();
        __syncwarp();
        const unsigned next = i + STAGES - 1;
        if (next < tiles)
            load_tile<D>(a, ring + next % STAGES * STAGE_BYTES, b, kv_head, begin + next * TILE, end, lane);
        commit();
        const unsigned k_tile = ring + i % STAGES * STAGE_BYTES, v_tile = k_tile + TILE * STRIDE * 2;
        const unsigned base = begin + i * TILE;

        float s[MT][KEY_TILES][4] = {};
#pragma unroll
        for (unsigned kc = 0; kc < D / 32; ++kc) {
            unsigned kb[KEY_TILES][4];
#pragma unroll
            for (unsigned j = 0; j < KEY_TILES; ++j) ldmatrix(kb[j], k_tile + keys8 + (j * 8 * STRIDE + kc * 32) * 2);
#pragma unroll
            for (unsigned ks = 0; ks < 2; ++ks) {
#pragma unroll
                for (unsigned m = 0; m < MT; ++m) {
                    unsigned qa[4];
                    if constexpr (Q_HELD) {
                        for (unsigned r = 0; r < 4; ++r) qa[r] = q_held[m * KS + kc * 2 + ks][r];
                    } else {
                        ldmatrix(qa, q_tile + rows16 + (m * 16 * STRIDE + (kc * 2 + ks) * 16) * 2);
                    }
#pragma unroll
                    for (unsigned j = 0; j < KEY_TILES; ++j) mma<E>(s[m][j], qa, kb[j][2 * ks], kb[j][2 * ks + 1]);
                }
            }
        }

        // Online softmax in the log2 domain; the quad's four lanes share a row, so its max is
        // theirs, while each lane's share of the sum waits for the end.
        unsigned p[MT][KEY_STEPS][4];
#pragma unroll
        for (unsigned m = 0; m < MT; ++m) {
#pragma unroll
            for (unsigned h = 0; h < 2; ++h) {
                float top = high[m][h];
#pragma unroll
                for (unsigned j = 0; j < KEY_TILES; ++j)
#pragma unroll
                    for (unsigned e = 0; e < 2; ++e) {
                        float& x = s[m][j][2 * h + e];
                        x = base + j * 8 + pair + e < limit[m][h] ? x * a.scale_log2 : NEG_INF;
                        top = fmaxf(top, x);
                    }
                top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, 1));
                top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, 2));
                const float rescale = top == NEG_INF ? 1.0f : exp2f(high[m][h] - top);
                high[m][h] = top;
                total[m][h] *= rescale;
#pragma unroll
                for (unsigned n = 0; n < NT; ++n) {
                    o[m][n][2 * h] *= rescale;
                    o[m][n][2 * h + 1] *= rescale;
                }
#pragma unroll
                for (unsigned j = 0; j < KEY_TILES; ++j)
#pragma unroll
                    for (unsigned e = 0; e < 2; ++e) {
                        float& x = s[m][j][2 * h + e];
                        x = top == NEG_INF ? 0.0f : exp2f(x - top);
                        total[m][h] += x;
                    }
            }
            // S's C-fragments of n8 tiles 2ks, 2ks + 1 are P's A-fragment of k16 step ks.
#pragma unroll
            for (unsigned ks = 0; ks < KEY_STEPS; ++ks) {
                p[m][ks][0] = pack<E>(s[m][2 * ks][0], s[m][2 * ks][1]);
                p[m][ks][1] = pack<E>(s[m][2 * ks][2], s[m][2 * ks][3]);
                p[m][ks][2] = pack<E>(s[m][2 * ks + 1][0], s[m][2 * ks + 1][1]);
                p[m][ks][3] = pack<E>(s[m][2 * ks + 1][2], s[m][2 * ks + 1][3]);
            }
        }

#pragma unroll
        for (unsigned ks = 0; ks < KEY_STEPS; ++ks)
#pragma unroll
            for (unsigned dp = 0; dp < D / 16; ++dp) {
                unsigned vb[4];
                ldmatrix_trans(vb, v_tile + rows16 + (ks * 16 * STRIDE + dp * 16) * 2);
#pragma unroll
                for (unsigned m = 0; m < MT; ++m) {
                    mma<E>(o[m][2 * dp], p[m][ks], vb[0], vb[1]);
                    mma<E>(o[m][2 * dp + 1], p[m][ks], vb[2], vb[3]);
                }
            }
    }

    const size_t item = (((size_t)b * a.heads_kv + kv_head) * a.splits + split) * group_rows + first_row;
#pragma unroll
    for (unsigned m = 0; m < MT; ++m)
#pragma unroll
        for (unsigned h = 0; h < 2; ++h) {
            float sum = total[m][h];
            sum += __shfl_xor_sync(0xffffffffu, sum, 1);
            sum += __shfl_xor_sync(0xffffffffu, sum, 2);
            const unsigned r = m * 16 + h * 8 + g;
            if (r < row_count) {
                const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
                float* to = a.part_out + (item + r) * D + pair;
#pragma unroll
                for (unsigned n = 0; n < NT; ++n)
                    *(float2*)(to + n * 8) = make_float2(o[m][n][2 * h] * inv, o[m][n][2 * h + 1] * inv);
                // LSE in natural log, as the reference and the merge take it.
                if (pair == 0)
                    a.part_lse[item + r] = sum > 0.0f ? (high[m][h] + log2f(sum)) * 0.6931471805599453f : NEG_INF;
            }
        }
}

// A warp per row of the group (MERGE_ROWS rows a block), for a KV head and sequence: the splits'
// partials folded by their LSE into O (in the inputs' type, or f32 for a caller that merges
// further) and the LSE. Lanes take the splits' LSEs 32 at a time; each lane holds D / 32 columns
// of O, and the partials' loads of consecutive splits are independent, so they overlap instead of
// queueing behind one another as a thread-per-column loop over the splits makes them.
template <int E, int D, bool F32_OUT>
__device__ void decode_merge(const DecodeArgs a) {
    constexpr unsigned C = D / 32;
    static_assert(C == 2 || C == 4, "the merge loads a lane's columns as one float2 or float4");
    const unsigned lane = threadIdx.x & 31, j = blockIdx.x * MERGE_ROWS + (threadIdx.x >> 5);
    const unsigned kv_head = blockIdx.y, b = blockIdx.z, group_rows = a.group * a.queries;
    if (j >= group_rows) return;
    const size_t item = ((size_t)b * a.heads_kv + kv_head) * a.splits;
    float top = NEG_INF;
    for (unsigned s = lane; s < a.splits; s += 32) top = fmaxf(top, a.part_lse[(item + s) * group_rows + j]);
#pragma unroll
    for (unsigned step = 16; step > 0; step >>= 1) top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, step));
    float total = 0.0f, value[C] = {};
    if (top != NEG_INF) {
        for (unsigned first = 0; first < a.splits; first += 32) {
            const unsigned s = first + lane, count = min(32u, a.splits - first);
            const float weight = s < a.splits ? expf(a.part_lse[(item + s) * group_rows + j] - top) : 0.0f;
            total += weight;
#pragma unroll 8
            for (unsigned t = 0; t < count; ++t) {
                const float w = __shfl_sync(0xffffffffu, weight, t);
                const float* from = a.part_out + ((item + first + t) * group_rows + j) * D + lane * C;
                if constexpr (C == 4) {
                    const float4 x = *(const float4*)from;
                    value[0] += w * x.x, value[1] += w * x.y, value[2] += w * x.z, value[3] += w * x.w;
                } else {
                    const float2 x = *(const float2*)from;
                    value[0] += w * x.x, value[1] += w * x.y;
                }
            }
        }
#pragma unroll
        for (unsigned step = 16; step > 0; step >>= 1) total += __shfl_xor_sync(0xffffffffu, total, step);
    }
    const unsigned head = kv_head * a.group + j / a.queries, row = b * a.queries + j % a.queries;
    const size_t at = (size_t)head * a.rows + row;
#pragma unroll
    for (unsigned c = 0; c < C; ++c) {
        const float o = total > 0.0f ? value[c] / total : 0.0f;
        if (F32_OUT)
            ((float*)a.out)[at * D + lane * C + c] = o;
        else
            a.out[at * D + lane * C + c] = store<E>(o);
    }
    if (lane == 0) a.lse[at] = total > 0.0f ? top + logf(total) : NEG_INF;
}

#define SPLIT(E, D, MT, NAME)                                                                        \
    extern "C" __global__ void __launch_bounds__(WARPS * 32) decode_split_##NAME##_##D##_m##MT(const DecodeArgs a) { \
        decode_split<E, D, MT>(a);                                                                  \
    }
#define INSTANTIATE(E, D, NAME) \
    SPLIT(E, D, 1, NAME)        \
    SPLIT(E, D, 2, NAME)        \
    extern "C" __global__ void __launch_bounds__(MERGE_ROWS * 32) decode_merge_##NAME##_##D(const DecodeArgs a) { decode_merge<E, D, false>(a); } \
    extern "C" __global__ void __launch_bounds__(MERGE_ROWS * 32) decode_merge_f32_##NAME##_##D(const DecodeArgs a) { decode_merge<E, D, true>(a); }
INSTANTIATE(1, 64, bf16)
INSTANTIATE(1, 128, bf16)
INSTANTIATE(2, 64, fp16)
INSTANTIATE(2, 128, fp16)
