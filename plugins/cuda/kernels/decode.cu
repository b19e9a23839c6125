// Split-KV decoding (Flash-Decoding). One block takes (split, KV head and row tile, sequence): it
// reads its keys and values once for up to R query rows (8 or 16) of the KV head's group (GQA's
// heads times the step's new tokens), each warp over its own 32-key tiles with an online softmax, and
// leaves the tile's partial O and LSE; `decode_merge` folds the splits by their LSE.
//
// Q and O: [heads_q][rows][D] with rows = queries · batch (sequence b's token i at b·queries + i);
// packed K and V: [heads_kv][keys][D] at key_offsets[b]; paged: [slots][heads_kv][D], sequence
// b's token t in slot pages[page_offsets[b] + t / page_size] · page_size + t % page_size.
// Sequence b's new token i sees keys 0 ..= kv_lens[b] − queries + i.

#define WARPS 4
#define TILE 32
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
    unsigned pad;
};
static_assert(sizeof(DecodeArgs) == 136, "DecodeArgs must match decode.rs");

// E: 1 = bf16, 2 = fp16.
template <int E>
__device__ __forceinline__ float load(unsigned short bits) {
    if (E == 1) return __uint_as_float(((unsigned)bits) << 16);
    float x;
    asm("cvt.f32.f16 %0, %1;" : "=f"(x) : "h"(bits));
    return x;
}
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

template <int E, int D, int ROWS>
__device__ void decode_split(const DecodeArgs a) {
    constexpr int PER_LANE = D / 32;
    // 8 + 33 KB at D = 128 (under the 48 KB of static shared memory); the queries' tile holds the
    // warps' merged O once the keys are done.
    __shared__ float q_tile[ROWS][D];
    __shared__ __align__(16) unsigned short k_tile[WARPS][TILE][D + 2];  // + 2: lanes reading rows hit distinct banks
    __shared__ float warp_high[WARPS][ROWS], warp_sum[WARPS][ROWS];
    float (*warp_out)[D] = q_tile;

    const unsigned split = blockIdx.x, kv_head = blockIdx.y / a.row_tiles, tile = blockIdx.y % a.row_tiles;
    const unsigned b = blockIdx.z;
    const unsigned lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const unsigned group_rows = a.group * a.queries;
    const unsigned first_row = tile * ROWS;
    const unsigned row_count = min((unsigned)ROWS, group_rows - first_row);
    const unsigned kv_len = a.kv_lens[b];
    const unsigned chunk = (kv_len + a.splits - 1) / a.splits;
    const unsigned begin = min(split * chunk, kv_len), end = min(begin + chunk, kv_len);

    // The tile's query rows; row j sees keys up to kv_len − queries + (first_row + j) mod queries.
    for (unsigned at = threadIdx.x; at < ROWS * D; at += blockDim.x) {
        unsigned j = at / D, c = at % D;
        float x = 0.0f;
        if (j < row_count) {
            unsigned r = first_row + j;
            unsigned head = kv_head * a.group + r / a.queries;
            unsigned row = b * a.queries + r % a.queries;
            x = load<E>(a.q[((size_t)head * a.rows + row) * D + c]);
        }
        q_tile[j][c] = x;
    }
    __syncthreads();

    float high[ROWS], sum[ROWS], acc[ROWS][PER_LANE], p[ROWS];
#pragma unroll
    for (unsigned j = 0; j < ROWS; ++j) {
        high[j] = NEG_INF;
        sum[j] = 0.0f;
        for (int c = 0; c < PER_LANE; ++c) acc[j][c] = 0.0f;
    }
    for (unsigned base = begin + warp * TILE; base < end; base += WARPS * TILE) {
        // The warp's 32 keys into shared memory, 8 bytes a lane: a row of 128 (two of 64) a load.
        constexpr int CHUNKS = D / 4;  // 4 values (8 bytes) per load
        for (unsigned at = lane; at < TILE * CHUNKS; at += 32) {
            unsigned t = at / CHUNKS, c = (at % CHUNKS) * 4;
            uint2 bits = make_uint2(0u, 0u);
            if (base + t < end) bits = *(const uint2*)(a.k + key_row(a, b, kv_head, base + t, D) + c);
            unsigned* to = (unsigned*)&k_tile[warp][t][c];
            to[0] = bits.x;
            to[1] = bits.y;
        }
        __syncwarp();
        // Lane l scores key base + l against every row.
        const unsigned t = base + lane;
        float score[ROWS];
#pragma unroll
        for (unsigned j = 0; j < ROWS; ++j) score[j] = 0.0f;
        for (int c = 0; c < D; c += 2) {
            unsigned pair = *(const unsigned*)&k_tile[warp][lane][c];
            float k0 = load<E>((unsigned short)(pair & 0xffffu)), k1 = load<E>((unsigned short)(pair >> 16));
#pragma unroll
            for (unsigned j = 0; j < ROWS; ++j) score[j] += q_tile[j][c] * k0 + q_tile[j][c + 1] * k1;
        }
#pragma unroll
        for (unsigned j = 0; j < ROWS; ++j) {
            const unsigned last = kv_len - a.queries + (first_row + j) % a.queries;
            float s = (t < end && t <= last && j < row_count) ? score[j] * a.scale_log2 : NEG_INF;
            float top = s;
            for (int o = 16; o > 0; o >>= 1) top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, o));
            float new_high = fmaxf(high[j], top);
            p[j] = new_high == NEG_INF ? 0.0f : exp2f(s - new_high);
            float rescale = new_high == NEG_INF ? 1.0f : exp2f(high[j] - new_high);
            float tile_sum = p[j];
            for (int o = 16; o > 0; o >>= 1) tile_sum += __shfl_xor_sync(0xffffffffu, tile_sum, o);
            sum[j] = sum[j] * rescale + tile_sum;
            high[j] = new_high;
#pragma unroll
            for (int c = 0; c < PER_LANE; ++c) acc[j][c] *= rescale;
        }
        // P·V: lane l holds dims l·PER_LANE .. of every row; values are read straight from memory,
        // one coalesced row a key; each key's probabilities come from the lane that scored it.
        const unsigned keys_here = min((unsigned)TILE, end - base);
#pragma unroll 4
        for (unsigned key = 0; key < keys_here; ++key) {
            const unsigned short* value = a.v + key_row(a, b, kv_head, base + key, D) + lane * PER_LANE;
            float x[PER_LANE];
            if (PER_LANE == 4) {
                uint2 bits = *(const uint2*)value;
                x[0] = load<E>((unsigned short)(bits.x & 0xffffu));
                x[1] = load<E>((unsigned short)(bits.x >> 16));
                x[PER_LANE > 2 ? 2 : 0] = load<E>((unsigned short)(bits.y & 0xffffu));
                x[PER_LANE > 3 ? 3 : 0] = load<E>((unsigned short)(bits.y >> 16));
            } else {
                unsigned bits = *(const unsigned*)value;
                x[0] = load<E>((unsigned short)(bits & 0xffffu));
                x[1] = load<E>((unsigned short)(bits >> 16));
            }
#pragma unroll
            for (unsigned j = 0; j < ROWS; ++j) {
                float weight = __shfl_sync(0xffffffffu, p[j], key);
#pragma unroll
                for (int c = 0; c < PER_LANE; ++c) acc[j][c] += weight * x[c];
            }
        }
        __syncwarp();
    }
    // Every warp is past its keys before the queries' tile takes the merged O.
    __syncthreads();

    // The warps' partials into one: each warp's high and sum, then O weighted in turn.
    if (lane == 0) {
        for (unsigned j = 0; j < ROWS; ++j) {
            warp_high[warp][j] = high[j];
            warp_sum[warp][j] = sum[j];
        }
    }
    for (unsigned at = threadIdx.x; at < ROWS * D; at += blockDim.x) warp_out[at / D][at % D] = 0.0f;
    __syncthreads();
    for (unsigned j = 0; j < ROWS; ++j) {
        float top = NEG_INF;
        for (int w = 0; w < WARPS; ++w) top = fmaxf(top, warp_high[w][j]);
        float weight = high[j] == NEG_INF ? 0.0f : exp2f(high[j] - top);
        for (int w = 0; w < WARPS; ++w) {
            if (w == (int)warp)
                for (int c = 0; c < PER_LANE; ++c) warp_out[j][lane * PER_LANE + c] += weight * acc[j][c];
            __syncthreads();
        }
    }
    const size_t item = (((size_t)b * a.heads_kv + kv_head) * a.splits + split) * group_rows;
    for (unsigned at = threadIdx.x; at < row_count * D; at += blockDim.x) {
        unsigned j = at / D, c = at % D;
        float top = NEG_INF, total = 0.0f;
        for (int w = 0; w < WARPS; ++w) top = fmaxf(top, warp_high[w][j]);
        for (int w = 0; w < WARPS; ++w)
            if (warp_high[w][j] != NEG_INF) total += warp_sum[w][j] * exp2f(warp_high[w][j] - top);
        size_t row = item + first_row + j;
        a.part_out[row * D + c] = total > 0.0f ? warp_out[j][c] / total : 0.0f;
        // LSE in natural log, as the reference and the merge take it.
        if (c == 0) a.part_lse[row] = total > 0.0f ? (top + log2f(total)) * 0.6931471805599453f : NEG_INF;
    }
}

// One block per (row of the group, KV head, sequence), D threads: the splits' partials folded
// by their LSE into O (in the inputs' type) and the LSE.
template <int E, int D>
__device__ void decode_merge(const DecodeArgs a) {
    const unsigned j = blockIdx.x, kv_head = blockIdx.y, b = blockIdx.z, c = threadIdx.x;
    const unsigned group_rows = a.group * a.queries;
    const size_t item = ((size_t)b * a.heads_kv + kv_head) * a.splits;
    float top = NEG_INF;
    for (unsigned s = 0; s < a.splits; ++s) top = fmaxf(top, a.part_lse[(item + s) * group_rows + j]);
    float total = 0.0f, value = 0.0f;
    if (top != NEG_INF) {
        for (unsigned s = 0; s < a.splits; ++s) {
            size_t row = (item + s) * group_rows + j;
            float weight = expf(a.part_lse[row] - top);
            total += weight;
            value += weight * a.part_out[row * D + c];
        }
    }
    unsigned head = kv_head * a.group + j / a.queries;
    unsigned row = b * a.queries + j % a.queries;
    size_t at = (size_t)head * a.rows + row;
    a.out[at * D + c] = store<E>(total > 0.0f ? value / total : 0.0f);
    if (c == 0) a.lse[at] = total > 0.0f ? top + logf(total) : NEG_INF;
}

#define INSTANTIATE(E, D, NAME)                                                                   \
    extern "C" __global__ void __launch_bounds__(WARPS * 32) decode_split_##NAME##_##D##_r8(const DecodeArgs a) { \
        decode_split<E, D, 8>(a);                                                                \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(WARPS * 32) decode_split_##NAME##_##D##_r16(const DecodeArgs a) { \
        decode_split<E, D, 16>(a);                                                               \
    }                                                                                            \
    extern "C" __global__ void decode_merge_##NAME##_##D(const DecodeArgs a) { decode_merge<E, D>(a); }
INSTANTIATE(1, 64, bf16)
INSTANTIATE(1, 128, bf16)
INSTANTIATE(2, 64, fp16)
INSTANTIATE(2, 128, fp16)
