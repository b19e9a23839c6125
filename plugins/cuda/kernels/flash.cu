// attnbench flash attention. Forward: one CTA per (128-row query tile, query head), 4 warps of 32
// rows; 64-key tiles from the mask IR's per-tile work list (full tiles unmasked, partial tiles
// masked element-wise from each row's key intervals, empty tiles never visited); QKᵀ and PV on
// tensor cores (mma.sync m16n8k16, f32 accumulation) fed by ldmatrix from swizzled shared tiles
// that cp.async fills while the previous product runs; online softmax in registers.
// Rows with no allowed key: O = 0, LSE = −∞.
// Backward (deterministic: every output has one writer): D = rowsum(dO∘O); dK and dV per
// (64-key tile, KV head), summing the group's query heads in order over the query tiles that
// touch the key tile (the transposed work list); dQ per (64-row query tile, query head).
// On sm_90a the same work lists drive warpgroup-MMA kernels (head_dim 128), warp-specialised
// with TMA loads where the masks keep 128-row tiles (see "The wgmma forward" below).
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

// What one row of a mask allows (its keys), or one column (its queries), as a partial tile tests
// it: the interval [start, end) under a cursor, in registers, and the row's intervals after it,
// [next, last) in the mask's interval array. A partial tile first moves the cursor past the
// intervals that end before its first key (`seek`), and a thread's tiles come in increasing order
// over a head, so a row of hundreds of intervals (variable block-sparse masks) is walked once per
// head rather than scanned for every key; a key then costs two comparisons, or a load or two
// where the tile crosses an interval's end. The element loops only read (`holds`), which keeps
// the cursor's state out of their unrolled code.
struct Allowed {
    unsigned start = 0, end = 0, next = 0, last = 0;

    __device__ Allowed() = default;
    // Row (or column) r of a mask's `table` (where each row's intervals start in `intervals`);
    // nothing past the sequence.
    __device__ Allowed(const unsigned* table, int r, int seqlen, const unsigned* intervals) {
        if (r >= seqlen) return;
        const unsigned begin = table[r], count = table[r + 1] - begin;
        if (count == 0) return;
        start = intervals[2 * begin];
        end = intervals[2 * begin + 1];
        next = begin + 1;
        last = begin + count;
    }

    // Moves the cursor to the first interval that ends after `first`, the tile's first key; it
    // must not be below the first key of a tile sought before.
    __device__ __forceinline__ void seek(unsigned first, const unsigned* intervals) {
        while (first >= end && next < last) {
            start = intervals[2 * next];
            end = intervals[2 * next + 1];
            ++next;
        }
    }

    // Whether key k, at or past the sought tile's first key, is allowed (the intervals are sorted
    // and disjoint: the scan stops at the first that starts past k).
    __device__ __forceinline__ bool holds(unsigned k, const unsigned* intervals) const {
        if (k < end) return k >= start;
        for (unsigned i = next; i < last; ++i) {
            if (k < intervals[2 * i]) return false;
            if (k < intervals[2 * i + 1]) return true;
        }
        return false;
    }
};

// The columns of this thread's two keys (key0 and key0 + 8) in a key-tile kernel: the queries a
// partial step allows them, read again for every head, where the walk's query tiles start over.
struct KeyColumns {
    Allowed queries[2];
    int head = -1;

    __device__ __forceinline__ void follow(int step_head, int step_mask, const unsigned* column_start, const unsigned* column_intervals,
                                           int key0, int seqlen) {
        if (step_head == head) return;
        head = step_head;
        const unsigned* table = column_start + (size_t)step_mask * (seqlen + 1);
        #pragma unroll
        for (int slot = 0; slot < 2; ++slot) queries[slot] = Allowed(table, key0 + slot * 8, seqlen, column_intervals);
    }
};

// Shared tiles are stored swizzled: 16-byte chunk c of row r sits at chunk c ^ (r mod 8) of that
// row, so the 8 rows an ldmatrix (or a fragment load) touches fall into 8 different banks.
template <int D> __device__ __forceinline__ int swizzled(int row, int chunk) { return row * D + ((chunk ^ (row & 7)) << 3); }

__device__ __forceinline__ u32 shared_address(const void* p) { return (u32)__cvta_generic_to_shared(p); }

// 16 bytes global → shared without a register round trip; `valid` false writes zeros.
__device__ __forceinline__ void copy_async(void* dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(shared_address(dst)), "l"(src), "r"(valid ? 16 : 0) : "memory");
}
__device__ __forceinline__ void commit_copies() { asm volatile("cp.async.commit_group;" ::: "memory"); }
// Waits until at most N of this thread's committed copy groups are still in flight.
template <int N> __device__ __forceinline__ void wait_copies() { asm volatile("cp.async.wait_group %0;" :: "n"(N) : "memory"); }

// Starts copying ROWS × D 16-bit elements (global rows of width D) into a swizzled shared tile;
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

#define FWD_THREADS 128

// 2^x on the special-function unit; 2^−∞ = 0, which masked scores rely on.
__device__ __forceinline__ float fast_exp2(float x) { float y; asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x)); return y; }

// Every forward kernel's parameters: Q, K, V, O, LSE, the work lists (per query tile its key
// tiles, and the order to start the query tiles), the rows' key intervals, each head's mask;
// and the same names as arguments.
#define FORWARD_PARAMS const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v, \
    float* __restrict__ out, float* __restrict__ lse, const unsigned* __restrict__ tile_start, \
    const unsigned* __restrict__ tiles, const unsigned* __restrict__ order, const unsigned* __restrict__ row_start, \
    const unsigned* __restrict__ intervals, const int* __restrict__ mask_of_head, int seqlen, int group, float scale_log2
#define FORWARD_ARGS q, k, v, out, lse, tile_start, tiles, order, row_start, intervals, mask_of_head, seqlen, group, scale_log2

// Forward: one CTA of 4 warps per (64·M-row query tile, query head), each warp 16·M rows (M
// 16-row blocks sharing every K and V fragment it loads: at M = 2, half the shared-memory traffic
// per product of 16-row warps; M = 1 for masks whose blocks split 128-row tiles, see flash.rs). Q stays in shared memory; K and V tiles arrive by cp.async into one
// buffer each, overlapped with compute: V(j) loads during S = Q·K(j)ᵀ, K(j+1) during the
// softmax and O += P·V(j). Dynamic shared memory: (64·M + 2·64)·D 16-bit elements.
template <int E, int D, int M>
__device__ void flash_forward(FORWARD_PARAMS) {
    constexpr int BM_FWD = 64 * M, FWD_M = M;
    extern __shared__ __align__(128) u16 dynamic_shared[];
    u16* sq = dynamic_shared;
    u16* sk = sq + BM_FWD * D;
    u16* sv = sk + BN * D;
    const int head = blockIdx.x, kv_head = head / group, mask = mask_of_head[head];
    const int q_tiles = (seqlen + BM_FWD - 1) / BM_FWD;
    // Longest work lists first, so the last wave is short.
    const int q_tile = order[mask * q_tiles + blockIdx.y];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int q0 = q_tile * BM_FWD;
    const u16* kh = k + ((size_t)kv_head * seqlen) * D;
    const u16* vh = v + ((size_t)kv_head * seqlen) * D;
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

    float acc[FWD_M][D / 8][4];
    #pragma unroll
    for (int mb = 0; mb < FWD_M; ++mb)
        #pragma unroll
        for (int n = 0; n < D / 8; ++n) acc[mb][n][0] = acc[mb][n][1] = acc[mb][n][2] = acc[mb][n][3] = 0.0f;
    const float minus_inf = __int_as_float(0xff800000);
    float m[2 * FWD_M], l[2 * FWD_M];
    #pragma unroll
    for (int slot = 0; slot < 2 * FWD_M; ++slot) { m[slot] = minus_inf; l[slot] = 0.0f; }

    for (unsigned w = begin; w < end; ++w) {
        const unsigned entry = tiles[w];
        const bool partial = entry >> 31;
        const int k0 = (int)(entry & 0x7fffffffu) * BN;
        __syncthreads();  // every warp is done with V(j-1)
        load_tile_async<BN, D, FWD_THREADS>(sv, vh + (size_t)k0 * D, min(BN, seqlen - k0));
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
                for (int n = 0; n < D / 8; ++n) { acc[mb][n][i0] *= shrink; acc[mb][n][i0 + 1] *= shrink; }
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
            for (int c2 = 0; c2 < D / 16; ++c2) {
                u32 b[4];
                b_fragments<D>(b, sv, kk * 16, c2);
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
        float* o_row = out + ((size_t)head * seqlen + r) * D;
        #pragma unroll
        for (int n = 0; n < D / 8; ++n)
            *reinterpret_cast<float2*>(o_row + n * 8 + t * 2) = make_float2(acc[mb][n][i0] * inv, acc[mb][n][i0 + 1] * inv);
        if (t == 0) lse[(size_t)head * seqlen + r] = (inv == 0.0f) ? minus_inf : (m[slot] * ln2 + logf(sum));
    }
}

#define FLASH_FORWARD_TILE(NAME, SUFFIX, E, D, M) \
extern "C" __global__ void __launch_bounds__(FWD_THREADS, 2) NAME##_##SUFFIX(FORWARD_PARAMS) { \
    flash_forward<E, D, M>(FORWARD_ARGS); }
#define FLASH_FORWARD(SUFFIX, E, D) \
    FLASH_FORWARD_TILE(flash_forward, SUFFIX, E, D, 2) \
    FLASH_FORWARD_TILE(flash_forward_narrow, SUFFIX, E, D, 1)
FLASH_FORWARD(bf16_d64, 1, 64)
FLASH_FORWARD(bf16_d128, 1, 128)
FLASH_FORWARD(f16_d64, 2, 64)
FLASH_FORWARD(f16_d128, 2, 128)

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
// A 64 × 128 accumulator's rows r and r + 8 (this thread's, r = row0) into f32 global rows of 128,
// times `factor`; rows at or past `seqlen` are skipped.
__device__ __forceinline__ void store_rows(float* dst, const float* acc, int row0, int seqlen, float factor) {
    const int t = threadIdx.x & 3;
    #pragma unroll
    for (int slot = 0; slot < 2; ++slot) {
        const int r = row0 + slot * 8;
        if (r >= seqlen) continue;
        #pragma unroll
        for (int c = 0; c < 16; ++c)
            *reinterpret_cast<float2*>(dst + (size_t)r * 128 + c * 8 + t * 2) =
                make_float2(acc[4 * c + 2 * slot] * factor, acc[4 * c + 2 * slot + 1] * factor);
    }
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

// The online softmax of one key tile for a warpgroup's 64 rows, in place of its scores s
// (s[4c + i]: this thread's row slot i / 2 — rows row0 and row0 + 8 — key k0 + 8c + 2t + i mod 2,
// the layout of mma.sync's C): cells the mask (`partial`, from the slots' key intervals) or the
// sequence exclude become −inf, m and l move to the tile's maximum and sum, `shrink` is what O's
// rows must be scaled by and `moved` whether any row of the warp needs it.
template <int KEYS>
__device__ __forceinline__ void online_softmax(float* s, float* m, float* l, float* shrink, bool* moved, bool partial, int k0, int seqlen,
                                               Allowed* keys, const unsigned* intervals, float scale_log2) {
    const int t = threadIdx.x & 3;
    const float minus_inf = __int_as_float(0xff800000);
    if (partial || k0 + KEYS > seqlen) {
        if (partial) { keys[0].seek(k0, intervals); keys[1].seek(k0, intervals); }
        #pragma unroll
        for (int c = 0; c < KEYS / 8; ++c)
            #pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int slot = i >> 1, key = k0 + c * 8 + t * 2 + (i & 1);
                bool ok = key < seqlen;
                if (ok && partial) ok = keys[slot].holds(key, intervals);
                if (!ok) s[4 * c + i] = minus_inf;
            }
    }
    #pragma unroll
    for (int slot = 0; slot < 2; ++slot) {
        float mx = minus_inf;
        #pragma unroll
        for (int c = 0; c < KEYS / 8; ++c) mx = fmaxf(mx, fmaxf(s[4 * c + 2 * slot], s[4 * c + 2 * slot + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        mx = fmaxf(m[slot], mx * scale_log2);
        const float base = (mx == minus_inf) ? 0.0f : mx;
        shrink[slot] = fast_exp2(m[slot] - base);
        moved[slot] = __any_sync(0xffffffffu, mx != m[slot]);
        m[slot] = mx;
        float sum = 0.0f;
        #pragma unroll
        for (int c = 0; c < KEYS / 8; ++c) {
            float* pair = s + 4 * c + 2 * slot;
            pair[0] = fast_exp2(fmaf(pair[0], scale_log2, -base));
            pair[1] = fast_exp2(fmaf(pair[1], scale_log2, -base));
            sum += pair[0] + pair[1];
        }
        l[slot] = l[slot] * shrink[slot] + sum;
    }
}
// O's rows (a 64 × 128 accumulator, slots as online_softmax's) times `shrink` where they moved.
__device__ __forceinline__ void rescale_rows(float* o, const float* shrink, const bool* moved) {
    #pragma unroll
    for (int slot = 0; slot < 2; ++slot)
        if (moved[slot]) {
            #pragma unroll
            for (int c = 0; c < 16; ++c) { o[4 * c + 2 * slot] *= shrink[slot]; o[4 * c + 2 * slot + 1] *= shrink[slot]; }
        }
}
// The forward's end for this thread's rows row0 and row0 + 8 of `head`: O / l into `out` (f32) and
// the LSE (natural log) into `lse`; a row without any allowed key gets O = 0 and LSE = −inf.
__device__ __forceinline__ void store_forward_rows(float* out, float* lse, const float* o, const float* m, const float* l, int head, int row0, int seqlen) {
    const int t = threadIdx.x & 3;
    const float minus_inf = __int_as_float(0xff800000), ln2 = 0.6931471805599453f;
    #pragma unroll
    for (int slot = 0; slot < 2; ++slot) {
        float sum = l[slot];
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        const float inv = (m[slot] == minus_inf || sum == 0.0f) ? 0.0f : 1.0f / sum;
        const int r = row0 + slot * 8;
        if (r >= seqlen) continue;
        float* o_row = out + ((size_t)head * seqlen + r) * 128;
        #pragma unroll
        for (int j = 0; j < 16; ++j)
            *reinterpret_cast<float2*>(o_row + j * 8 + t * 2) = make_float2(o[4 * j + 2 * slot] * inv, o[4 * j + 2 * slot + 1] * inv);
        if (t == 0) lse[(size_t)head * seqlen + r] = (inv == 0.0f) ? minus_inf : (m[slot] * ln2 + logf(sum));
    }
}

// The wgmma forward, with a producer warp (FlashAttention-3's warp specialisation): one CTA of
// three warpgroups per query head and 128-row query tile (or two 64-row ones). The first
// warpgroup gives its registers back and one of its threads issues every load — Q once, then
// each K and V tile of the work list — as TMA copies that swizzle the tiles as wgmma reads them
// (every product reads its B operand from shared memory through a descriptor) and signal an
// mbarrier when their bytes have landed; the other two (64 rows each) only compute: no cp.async
// address arithmetic and no CTA barrier per tile. K and V have STAGES buffers each, each with a
// "full" barrier (the producer's copies landed) and an "empty" one (the consumers are done with
// it).
struct __align__(64) TensorMap { unsigned long long opaque[16]; };

__device__ __forceinline__ void barrier_init(unsigned long long* bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(shared_address(bar)), "r"(count) : "memory");
}
// This thread's arrival, announcing `bytes` more to come by TMA before the phase completes.
__device__ __forceinline__ void barrier_expect_bytes(unsigned long long* bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(shared_address(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void barrier_arrive(unsigned long long* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(shared_address(bar)) : "memory");
}
// Until the barrier's phase of parity `parity` has completed (a fresh barrier counts the phase
// before its first, parity 1, as completed).
__device__ __forceinline__ void barrier_wait(unsigned long long* bar, unsigned parity) {
    asm volatile("{\n.reg .pred done;\nwait:\n"
                 "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
                 "@!done bra wait;\n}\n" :: "r"(shared_address(bar)), "r"(parity) : "memory");
}
// Rows row.. of one 64-column panel (columns column..column + 63) of head `head` of a
// [heads][seqlen][128] 16-bit tensor, as the map's box (64 columns × its rows) lays them out with
// the 128-byte swizzle; rows past the sequence arrive as zeros. Completes on `bar`.
__device__ __forceinline__ void load_box(u16* dst, const TensorMap* map, int column, int row, int head, unsigned long long* bar) {
    asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];"
                 :: "r"(shared_address(dst)), "l"(reinterpret_cast<unsigned long long>(map)), "r"(column), "r"(row), "r"(head),
                    "r"(shared_address(bar)) : "memory");
}

// The maps are the kernel's __grid_constant__ parameters: TMA reads them where they are.
#define TMA_FORWARD_PARAMS const TensorMap* q_map, const TensorMap* k_map, const TensorMap* v_map, const u16* __restrict__ q_global, float* __restrict__ out, float* __restrict__ lse, const unsigned* __restrict__ tile_start, \
    const unsigned* __restrict__ tiles, const unsigned* __restrict__ order, const unsigned* __restrict__ row_start, \
    const unsigned* __restrict__ intervals, const int* __restrict__ mask_of_head, int seqlen, int group, float scale_log2

// KEYS 128: both consumer warpgroups share one 128-row query tile (Q in shared memory, loaded
// once by TMA) and each 128-key tile of its list. KEYS 64, for masks whose blocks split 128-row
// tiles: each consumer warpgroup has a 64-row query tile of its own — two neighbours in the
// order, so of similar lengths — with Q in registers, its own list of 64-key tiles, its own
// buffers and barriers, and its own producer thread (threads 0 and 32).
template <int E, int KEYS>
__device__ void flash_forward_tma(TMA_FORWARD_PARAMS) {
    constexpr bool SHARED = KEYS == 128;
    constexpr int D = 128, ROWS = SHARED ? 128 : 64, STAGES = SHARED ? 2 : 3, LISTS = SHARED ? 1 : 2;
    constexpr int TILE_BYTES = KEYS * D * 2, CONSUMERS = HOPPER_WARPGROUP * (SHARED ? 2 : 1);
    u16* sq = hopper_tiles();
    u16* kv_base = sq + (SHARED ? ROWS * D : 0);
    auto key_buffer = [&](int list, int index) { return kv_base + (list * 2 * STAGES + index) * KEYS * D; };
    auto value_buffer = [&](int list, int index) { return kv_base + (list * 2 * STAGES + STAGES + index) * KEYS * D; };
    __shared__ unsigned long long q_full, k_full[LISTS][STAGES], k_empty[LISTS][STAGES], v_full[LISTS][STAGES], v_empty[LISTS][STAGES];
    const int head = blockIdx.x, kv_head = head / group, mask = mask_of_head[head];
    const int q_tiles = (seqlen + ROWS - 1) / ROWS;
    // This block's query tiles: one, or (KEYS 64) one per consumer warpgroup, the second
    // possibly past the last.
    auto query_tile = [&](int list) {
        const int position = blockIdx.y * LISTS + list;
        return position < q_tiles ? (int)order[mask * q_tiles + position] : -1;
    };
    auto list_bounds = [&](int q_tile, unsigned& begin, unsigned& end) {
        begin = end = 0;
        if (q_tile >= 0) {
            begin = tile_start[mask * q_tiles + q_tile];
            end = tile_start[mask * q_tiles + q_tile + 1];
        }
    };
    if (threadIdx.x == 0) {
        barrier_init(&q_full, 1);
        for (int list = 0; list < LISTS; ++list)
            for (int i = 0; i < STAGES; ++i) {
                barrier_init(&k_full[list][i], 1);
                barrier_init(&v_full[list][i], 1);
                barrier_init(&k_empty[list][i], CONSUMERS);
                barrier_init(&v_empty[list][i], CONSUMERS);
            }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();

    if (threadIdx.x < HOPPER_WARPGROUP) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
        if (threadIdx.x % 32 != 0 || threadIdx.x / 32 >= LISTS) return;
        const int list = threadIdx.x / 32, q_tile = query_tile(list);
        unsigned begin, end;
        list_bounds(q_tile, begin, end);
        if constexpr (SHARED) {
            barrier_expect_bytes(&q_full, ROWS * D * 2);
            for (int panel = 0; panel < 2; ++panel) load_box(sq + panel * ROWS * 64, q_map, panel * 64, q_tile * ROWS, head, &q_full);
        }
        for (unsigned w = begin; w < end; ++w) {
            const int j = w - begin, stage = j % STAGES;
            const unsigned parity = ((j / STAGES) & 1) ^ 1;
            const int k0 = (int)(tiles[w] & 0x7fffffffu) * KEYS;
            barrier_wait(&k_empty[list][stage], parity);
            barrier_expect_bytes(&k_full[list][stage], TILE_BYTES);
            for (int panel = 0; panel < 2; ++panel)
                load_box(key_buffer(list, stage) + panel * KEYS * 64, k_map, panel * 64, k0, kv_head, &k_full[list][stage]);
            barrier_wait(&v_empty[list][stage], parity);
            barrier_expect_bytes(&v_full[list][stage], TILE_BYTES);
            for (int panel = 0; panel < 2; ++panel)
                load_box(value_buffer(list, stage) + panel * KEYS * 64, v_map, panel * 64, k0, kv_head, &v_full[list][stage]);
        }
        return;
    }
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");

    const int warp = (threadIdx.x >> 5) - 4, lane = threadIdx.x & 31, g = lane >> 2;
    const int half = warp >> 2;  // this consumer warpgroup
    const int list = SHARED ? 0 : half, q_tile = query_tile(list);
    if (q_tile < 0) return;
    unsigned begin, end;
    list_bounds(q_tile, begin, end);
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
    if constexpr (SHARED) barrier_wait(&q_full, 0);
    else load_row_fragments(q_fragments, q_global + (size_t)head * seqlen * D, row0, seqlen);
    u32 p[KEYS / 16][4];

    // Tile j's scores are computed while tile j−1's P·V runs, so the softmax of j overlaps a
    // product in flight (FlashAttention-3's intra-warpgroup pipelining); O is rescaled for j's
    // maximum once j−1's product has landed.
    for (unsigned w = begin; w < end; ++w) {
        const int j = w - begin, stage = j % STAGES;
        const unsigned entry = tiles[w];
        const bool partial = entry >> 31;
        const int k0 = (int)(entry & 0x7fffffffu) * KEYS;
        barrier_wait(&k_full[list][stage], (j / STAGES) & 1);
        float s[KEYS / 2];
        wgmma_fence();
        if constexpr (SHARED) scores_from_shared_n128<E, ROWS>(s, q_rows, key_buffer(list, stage));
        else scores_from_registers<E>(s, q_fragments, key_buffer(list, stage));
        wgmma_commit();
        if (j > 0) {
            const int previous = (j - 1) % STAGES;
            barrier_wait(&v_full[list][previous], ((j - 1) / STAGES) & 1);
            values_product<E, KEYS>(o, p, value_buffer(list, previous));
            wgmma_commit();
            wgmma_wait<1>();
        } else {
            wgmma_wait<0>();
        }
        settle<KEYS / 2>(s);
        barrier_arrive(&k_empty[list][stage]);  // this thread's scores are read: K's buffer may refill
        float shrink[2];
        bool moved[2];
        online_softmax<KEYS>(s, m, l, shrink, moved, partial, k0, seqlen, keys, intervals, scale_log2);
        // Tile j−1's product has landed: O, P and its V buffer are free.
        wgmma_wait<0>();
        settle<D / 2>(o);
        if (j > 0) barrier_arrive(&v_empty[list][(j - 1) % STAGES]);
        rescale_rows(o, shrink, moved);
        as_fragments<E, KEYS / 16>(p, s);
    }
    if (begin < end) {
        const int j = end - begin, previous = (j - 1) % STAGES;
        barrier_wait(&v_full[list][previous], ((j - 1) / STAGES) & 1);
        wgmma_fence();
        values_product<E, KEYS>(o, p, value_buffer(list, previous));
        wgmma_commit();
        wgmma_wait<0>();
        settle<D / 2>(o);
    }
    store_forward_rows(out, lse, o, m, l, head, row0, seqlen);
}

// The narrow shape reads Q by address (into registers), the wide one through its map.
#define FLASH_FORWARD_TMA_TILE(NAME, SUFFIX, E, KEYS) \
extern "C" __global__ void __launch_bounds__(3 * HOPPER_WARPGROUP, 1) NAME##_##SUFFIX( \
    const __grid_constant__ TensorMap q_map, const __grid_constant__ TensorMap k_map, const __grid_constant__ TensorMap v_map, \
    const u16* __restrict__ q_global, float* __restrict__ out, float* __restrict__ lse, const unsigned* __restrict__ tile_start, \
    const unsigned* __restrict__ tiles, const unsigned* __restrict__ order, const unsigned* __restrict__ row_start, \
    const unsigned* __restrict__ intervals, const int* __restrict__ mask_of_head, int seqlen, int group, float scale_log2) { \
    flash_forward_tma<E, KEYS>(&q_map, &k_map, &v_map, q_global, out, lse, tile_start, tiles, order, row_start, intervals, mask_of_head, seqlen, group, scale_log2); }
#define FLASH_FORWARD_TMA(SUFFIX, E) \
    FLASH_FORWARD_TMA_TILE(flash_forward_tma, SUFFIX, E, 128) \
    FLASH_FORWARD_TMA_TILE(flash_forward_narrow_tma, SUFFIX, E, 64)
FLASH_FORWARD_TMA(bf16_d128, 1)
FLASH_FORWARD_TMA(f16_d128, 2)
#endif

template <int E> __device__ __forceinline__ float to_float(u16 x);
template <> __device__ __forceinline__ float to_float<1>(u16 x) { return __uint_as_float((u32)x << 16); }
template <> __device__ __forceinline__ float to_float<2>(u16 x) { float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x)); return f; }

// D[h][q] = Σ dO∘O over the head dimension, one warp per row; the row of dQ is cleared for the
// atomic sums of the fused backward.
template <int E, int D>
__device__ void flash_delta(const u16* __restrict__ d_out, const float* __restrict__ out, float* __restrict__ delta,
                            float* __restrict__ dq, int rows) {
    const int row = blockIdx.x * (THREADS / 32) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (row >= rows) return;
    float sum = 0.0f;
    for (int i = lane; i < D; i += 32) {
        sum += to_float<E>(d_out[(size_t)row * D + i]) * out[(size_t)row * D + i];
        dq[(size_t)row * D + i] = 0.0f;
    }
    for (int offset = 16; offset > 0; offset >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    if (lane == 0) delta[row] = sum;
}

// The backward's paired products for the warp's 16 rows × N rows of two shared tiles:
// x = xa·xtᵀ and y = ya·ytᵀ (S and dP, or Sᵀ and dPᵀ), each B fragment feeding one product;
// `a_fragments(kk, xa, ya)` supplies the A fragments of the 16 columns at kk·16.
template <int E, int D, int N, class Fragments>
__device__ __forceinline__ void paired_products(float (*x)[4], float (*y)[4], Fragments a_fragments, const u16* xt, const u16* yt) {
    #pragma unroll
    for (int n = 0; n < N / 8; ++n) {
        x[n][0] = x[n][1] = x[n][2] = x[n][3] = 0.0f;
        y[n][0] = y[n][1] = y[n][2] = y[n][3] = 0.0f;
    }
    #pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
        u32 xa[4], ya[4];
        a_fragments(kk, xa, ya);
        #pragma unroll
        for (int n16 = 0; n16 < N / 16; ++n16) {
            u32 b[4];
            bt_fragments<D>(b, xt, n16 * 16, kk);
            mma<E>(x[2 * n16], xa, b);
            mma<E>(x[2 * n16 + 1], xa, b + 2);
            bt_fragments<D>(b, yt, n16 * 16, kk);
            mma<E>(y[2 * n16], ya, b);
            mma<E>(y[2 * n16 + 1], ya, b + 2);
        }
    }
}

// dQ of one (64-row query tile, query head): S and P recomputed per key tile as in the forward
// pass, dP = dO·Vᵀ, dS = P∘(dP − D), dQ += dS·K; scaled at the end. Q and dO are staged through
// the K and V buffers into registers; K(j+1) (into the other of two K buffers) and V(j+1) load
// while dS and dQ of tile j are computed.
template <int E, int D>
__device__ void flash_backward_dq(const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v,
                                  const u16* __restrict__ d_out, const float* __restrict__ lse, const float* __restrict__ delta,
                                  float* __restrict__ dq,
                                  const unsigned* __restrict__ tile_start, const unsigned* __restrict__ tiles,
                                  const unsigned* __restrict__ row_start, const unsigned* __restrict__ intervals,
                                  const int* __restrict__ mask_of_head, int seqlen, int group, float scale, float scale_log2) {
    __shared__ __align__(128) u16 sk_buffers[2][BN * D];
    __shared__ __align__(128) u16 sv[BN * D];
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

    u32 qa[D / 16][4], da[D / 16][4];
    load_tile_async<BM, D, THREADS>(sk_buffers[0], q + ((size_t)head * seqlen + q0) * D, min(BM, seqlen - q0));
    load_tile_async<BM, D, THREADS>(sv, d_out + ((size_t)head * seqlen + q0) * D, min(BM, seqlen - q0));
    commit_copies();
    wait_copies<0>();
    __syncthreads();
    #pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
        a_fragment<D>(qa[kk], sk_buffers[0], warp * 16, kk);
        a_fragment<D>(da[kk], sv, warp * 16, kk);
    }
    __syncthreads();

    float acc[D / 8][4];
    #pragma unroll
    for (int n = 0; n < D / 8; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
    const u16* kh = k + ((size_t)kv_head * seqlen) * D;
    const u16* vh = v + ((size_t)kv_head * seqlen) * D;
    const unsigned list = mask * ((seqlen + BM - 1) / BM) + q_tile;
    const unsigned begin = tile_start[list], end = tile_start[list + 1];
    if (begin < end) {
        const int k0 = (int)(tiles[begin] & 0x7fffffffu) * BN;
        load_tile_async<BN, D, THREADS>(sk_buffers[0], kh + (size_t)k0 * D, min(BN, seqlen - k0));
        load_tile_async<BN, D, THREADS>(sv, vh + (size_t)k0 * D, min(BN, seqlen - k0));
    }
    commit_copies();
    for (unsigned w = begin; w < end; ++w) {
        const unsigned entry = tiles[w];
        const bool partial = entry >> 31;
        const int k0 = (int)(entry & 0x7fffffffu) * BN;
        const u16* sk = sk_buffers[(w - begin) & 1];
        wait_copies<0>();  // K(j) and V(j)
        __syncthreads();  // ... for every thread; and every warp is done with K(j-1)'s buffer
        float s[BN / 8][4], dp[BN / 8][4];
        paired_products<E, D, BN>(s, dp, [&](int kk, u32* xa, u32* ya) {
            #pragma unroll
            for (int i = 0; i < 4; ++i) { xa[i] = qa[kk][i]; ya[i] = da[kk][i]; }
        }, sk, sv);
        __syncthreads();  // every warp is done with V(j)
        if (w + 1 < end) {
            const int k1 = (int)(tiles[w + 1] & 0x7fffffffu) * BN;
            load_tile_async<BN, D, THREADS>(sk_buffers[(w + 1 - begin) & 1], kh + (size_t)k1 * D, min(BN, seqlen - k1));
            load_tile_async<BN, D, THREADS>(sv, vh + (size_t)k1 * D, min(BN, seqlen - k1));
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

// LSE (times log2 e) and D of query rows q0.. of a head, ROWS of them, into shared memory; rows
// past the sequence get −inf and 0.
template <int ROWS, int NT>
__device__ __forceinline__ void stage_row_statistics(float* s_lse, float* s_delta, const float* lse, const float* delta,
                                                     size_t head_row0, int q0, int seqlen) {
    const float log2e = 1.4426950408889634f;
    for (int i = threadIdx.x; i < ROWS; i += NT) {
        const bool in = q0 + i < seqlen;
        s_lse[i] = in ? lse[head_row0 + q0 + i] * log2e : __int_as_float(0xff800000);
        s_delta[i] = in ? delta[head_row0 + q0 + i] : 0.0f;
    }
}

// A key tile's (KEYS keys) walk over the query rows that see it: each query head of the KV group
// in order, each query tile of its list for this key tile, in ROWS-row parts (a part past the
// sequence's end is skipped). `head == last_head`: done.
template <int ROWS, int KEYS = BN>
struct KeyTileWalk {
    const unsigned* tile_start;
    const unsigned* tiles;
    const int* mask_of_head;
    int seqlen, k_tiles, k_tile, head, last_head, part;
    unsigned w, end;

    __device__ KeyTileWalk(const unsigned* tile_start_, const unsigned* tiles_, const int* mask_of_head_,
                           int seqlen_, int k_tile_, int kv_head, int group)
        : tile_start(tile_start_), tiles(tiles_), mask_of_head(mask_of_head_), seqlen(seqlen_),
          k_tiles((seqlen_ + KEYS - 1) / KEYS), k_tile(k_tile_), head(kv_head * group), last_head((kv_head + 1) * group), part(0) {
        open_list();
        settle();
    }
    __device__ bool done() const { return head >= last_head; }
    __device__ unsigned entry() const { return tiles[w]; }
    // The first query row of the current step.
    __device__ int row0() const { return (int)(tiles[w] & 0x7fffffffu) * BM + part * ROWS; }
    __device__ void advance() {
        if (++part == BM / ROWS) { part = 0; ++w; }
        settle();
    }

  private:
    __device__ void open_list() {
        const unsigned list = mask_of_head[head] * k_tiles + k_tile;
        w = tile_start[list];
        end = tile_start[list + 1];
        part = 0;
    }
    // Moves to the first step at or after the current one that exists.
    __device__ void settle() {
        while (head < last_head) {
            if (w < end) {
                if (row0() < seqlen) return;
                part = 0;
                ++w;
            } else if (++head < last_head) {
                open_list();
            }
        }
    }
};

// The key-tile kernels' parameters after their four 16-bit inputs (Q, K, V and dO, by address
// or by TMA map): LSE, D, the f32 gradients, the key tiles' work lists and order, the mask's
// columns.
#define KEY_TILE_TAIL const float* __restrict__ lse, const float* __restrict__ delta, \
    float* __restrict__ dq, float* __restrict__ dk, float* __restrict__ dv, \
    const unsigned* __restrict__ tile_start, const unsigned* __restrict__ tiles, const unsigned* __restrict__ order, \
    const unsigned* __restrict__ column_start, const unsigned* __restrict__ column_intervals, \
    const int* __restrict__ mask_of_head, int seqlen, int group, float scale, float scale_log2
#define KEY_TILE_TAIL_ARGS lse, delta, dq, dk, dv, tile_start, tiles, order, column_start, column_intervals, mask_of_head, seqlen, group, scale, scale_log2
#define KEY_TILE_PARAMS const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v, const u16* __restrict__ d_out, KEY_TILE_TAIL
#define KEY_TILE_ARGS q, k, v, d_out, KEY_TILE_TAIL_ARGS

// dK and dV of one (64-key tile, KV head): for each step of the walk, Sᵀ = K·Qᵀ, Pᵀ,
// dV += Pᵀ·dO, dPᵀ = V·dOᵀ, dSᵀ = Pᵀ∘(dPᵀ − D), dK += dSᵀ·Q; dK scaled at the end. K and V stay
// in shared memory; Q and dO of the next step load into the other of two buffers while this one
// runs. With DQ, each step also adds its share of dQ = dS·K (the step's 32 rows over the tile's
// 64 keys, through shared memory) into the f32 dQ with vector atomics: five products per step
// instead of the seven of the deterministic pair (this kernel without DQ, then the dQ kernel,
// which recomputes S and dP). dQ must be zero beforehand (the D kernel clears it).
// Dynamic shared memory: [stage][Q | dO] (2·2·BQ rows), K and V (BN rows each), dS (BQ × BN).
template <int E, int D, bool DQ>
__device__ void flash_backward_dkdv(KEY_TILE_PARAMS) {
    extern __shared__ __align__(128) u16 dynamic_shared[];
    u16* buffers = dynamic_shared;
    u16* sk = buffers + 2 * 2 * BQ * D;
    u16* sv = sk + BN * D;
    u16* sds = sv + BN * D;
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
    load_tile_async<BN, D, THREADS>(sv, v + ((size_t)kv_head * seqlen + k0) * D, min(BN, seqlen - k0));
    commit_copies();

    KeyTileWalk<BQ> walk(tile_start, tiles, mask_of_head, seqlen, k_tile, kv_head, group);
    auto issue = [&](int stage) {
        if (walk.done()) return;
        const int head = walk.head, q0 = walk.row0();
        u16* sq = buffers + stage * 2 * BQ * D;
        load_tile_async<BQ, D, THREADS>(sq, q + ((size_t)head * seqlen + q0) * D, min(BQ, seqlen - q0));
        load_tile_async<BQ, D, THREADS>(sq + BQ * D, d_out + ((size_t)head * seqlen + q0) * D, min(BQ, seqlen - q0));
        stage_row_statistics<BQ, THREADS>(s_lse[stage], s_delta[stage], lse, delta, (size_t)head * seqlen, q0, seqlen);
    };
    issue(0);
    commit_copies();

    float dk_acc[D / 8][4], dv_acc[D / 8][4];
    #pragma unroll
    for (int n = 0; n < D / 8; ++n) {
        dk_acc[n][0] = dk_acc[n][1] = dk_acc[n][2] = dk_acc[n][3] = 0.0f;
        dv_acc[n][0] = dv_acc[n][1] = dv_acc[n][2] = dv_acc[n][3] = 0.0f;
    }
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
        const u16* sq = buffers + stage * 2 * BQ * D;
        const u16* sdo = sq + BQ * D;
        // Sᵀ and dPᵀ for the warp's 16 keys × 32 queries.
        float st[BQ / 8][4], dpt[BQ / 8][4];
        paired_products<E, D, BQ>(st, dpt, [&](int kk, u32* ka, u32* va) {
            a_fragment<D>(ka, sk, warp * 16, kk);
            a_fragment<D>(va, sv, warp * 16, kk);
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
        // dV += Pᵀ·dO and dK += dSᵀ·Q, 16 queries at a time.
        #pragma unroll
        for (int kk = 0; kk < BQ / 16; ++kk) {
            u32 pa[4] = {pack2<E>(st[2 * kk][0], st[2 * kk][1]), pack2<E>(st[2 * kk][2], st[2 * kk][3]),
                         pack2<E>(st[2 * kk + 1][0], st[2 * kk + 1][1]), pack2<E>(st[2 * kk + 1][2], st[2 * kk + 1][3])};
            u32 sa[4] = {pack2<E>(dpt[2 * kk][0], dpt[2 * kk][1]), pack2<E>(dpt[2 * kk][2], dpt[2 * kk][3]),
                         pack2<E>(dpt[2 * kk + 1][0], dpt[2 * kk + 1][1]), pack2<E>(dpt[2 * kk + 1][2], dpt[2 * kk + 1][3])};
            #pragma unroll
            for (int c2 = 0; c2 < D / 16; ++c2) {
                u32 b[4];
                b_fragments<D>(b, sdo, kk * 16, c2);
                mma<E>(dv_acc[2 * c2], pa, b);
                mma<E>(dv_acc[2 * c2 + 1], pa, b + 2);
                b_fragments<D>(b, sq, kk * 16, c2);
                mma<E>(dk_acc[2 * c2], sa, b);
                mma<E>(dk_acc[2 * c2 + 1], sa, b + 2);
            }
        }
        if constexpr (DQ) {
            __syncthreads();  // every warp's dS is in place
            // This warp's D/4 columns of the step's dQ rows, over the tile's 64 keys.
            constexpr int C2 = D / 64;  // 16-column blocks per warp
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
                    u32 b[4];
                    b_fragments<D>(b, sk, kk * 16, warp * C2 + c);
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
                    const int col = (warp * C2 + (n >> 1)) * 16 + (n & 1) * 8 + t * 2;
                    const int r0 = q0 + mb * 16 + g, r1 = r0 + 8;
                    if (r0 < seqlen) add_pair(dqh + (size_t)r0 * D + col, acc[mb][n][0] * scale, acc[mb][n][1] * scale);
                    if (r1 < seqlen) add_pair(dqh + (size_t)r1 * D + col, acc[mb][n][2] * scale, acc[mb][n][3] * scale);
                }
        }
        __syncthreads();  // every warp is done with this buffer (and dS) before it is refilled
    }
    float* dkh = dk + ((size_t)kv_head * seqlen) * D;
    float* dvh = dv + ((size_t)kv_head * seqlen) * D;
    #pragma unroll
    for (int n = 0; n < D / 8; ++n) {
        const int col = n * 8 + t * 2;
        if (key0 < seqlen) {
            *reinterpret_cast<float2*>(dkh + (size_t)key0 * D + col) = make_float2(dk_acc[n][0] * scale, dk_acc[n][1] * scale);
            *reinterpret_cast<float2*>(dvh + (size_t)key0 * D + col) = make_float2(dv_acc[n][0], dv_acc[n][1]);
        }
        if (key1 < seqlen) {
            *reinterpret_cast<float2*>(dkh + (size_t)key1 * D + col) = make_float2(dk_acc[n][2] * scale, dk_acc[n][3] * scale);
            *reinterpret_cast<float2*>(dvh + (size_t)key1 * D + col) = make_float2(dv_acc[n][2], dv_acc[n][3]);
        }
    }
}

#define FLASH_BACKWARD(SUFFIX, E, D) \
extern "C" __global__ void __launch_bounds__(THREADS) flash_delta_##SUFFIX(const u16* d_out, const float* out, float* delta, float* dq, int rows) { \
    flash_delta<E, D>(d_out, out, delta, dq, rows); } \
extern "C" __global__ void __launch_bounds__(THREADS) flash_backward_dq_##SUFFIX( \
    const u16* q, const u16* k, const u16* v, const u16* d_out, const float* lse, const float* delta, float* dq, \
    const unsigned* tile_start, const unsigned* tiles, const unsigned* row_start, const unsigned* intervals, \
    const int* mask_of_head, int seqlen, int group, float scale, float scale_log2) { \
    flash_backward_dq<E, D>(q, k, v, d_out, lse, delta, dq, tile_start, tiles, row_start, intervals, mask_of_head, seqlen, group, scale, scale_log2); } \
extern "C" __global__ void __launch_bounds__(THREADS) flash_backward_dkdv_##SUFFIX(KEY_TILE_PARAMS) { \
    flash_backward_dkdv<E, D, false>(KEY_TILE_ARGS); } \
extern "C" __global__ void __launch_bounds__(THREADS) flash_backward_fused_##SUFFIX(KEY_TILE_PARAMS) { \
    flash_backward_dkdv<E, D, true>(KEY_TILE_ARGS); }
FLASH_BACKWARD(bf16_d64, 1, 64)
FLASH_BACKWARD(bf16_d128, 1, 128)
FLASH_BACKWARD(f16_d64, 2, 64)
FLASH_BACKWARD(f16_d128, 2, 128)

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
#define QUERY_TILE_TAIL_ARGS lse, delta, dq, tile_start, tiles, order, row_start, intervals, mask_of_head, seqlen, group, scale, scale_log2

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
    __shared__ unsigned long long full[STAGES], empty[STAGES];
    const int head = blockIdx.x, kv_head = head / group, mask = mask_of_head[head];
    const int q_tiles = (seqlen + ROWS - 1) / ROWS;
    const int q_tile = order[mask * q_tiles + blockIdx.y];
    const int q0 = q_tile * ROWS;
    const unsigned list = mask * q_tiles + q_tile;
    const unsigned begin = tile_start[list], end = tile_start[list + 1];
    if (threadIdx.x == 0) {
        for (int i = 0; i < STAGES; ++i) {
            barrier_init(&full[i], 1);
            barrier_init(&empty[i], 2 * HOPPER_WARPGROUP);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();

    if (threadIdx.x < HOPPER_WARPGROUP) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
        if (threadIdx.x != 0) return;
        for (unsigned w = begin; w < end; ++w) {
            const int j = w - begin, stage = j % STAGES;
            const int k0 = (int)(tiles[w] & 0x7fffffffu) * BN;
            barrier_wait(&empty[stage], ((j / STAGES) & 1) ^ 1);
            barrier_expect_bytes(&full[stage], 2 * BN * D * 2);
            for (int panel = 0; panel < 2; ++panel) {
                load_box(key_buffer(stage) + panel * BN * 64, k_map, panel * 64, k0, kv_head, &full[stage]);
                load_box(value_buffer(stage) + panel * BN * 64, v_map, panel * 64, k0, kv_head, &full[stage]);
            }
        }
        return;
    }
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");

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
        barrier_wait(&full[stage], (j / STAGES) & 1);
        query_tile_step<E>(acc, rows, key_buffer(stage), value_buffer(stage), entry >> 31, (int)(entry & 0x7fffffffu) * BN,
                           q0 + ROWS <= seqlen, seqlen, intervals, scale_log2);
        wgmma_wait<0>();
        barrier_arrive(&empty[stage]);  // this thread's products of the tile have landed
        settle<D / 2>(acc);
    }
    store_rows(dq + head_rows * D, acc, row0, seqlen, scale);
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
    __shared__ unsigned long long kv_full, full[STAGES], empty[STAGES];
    // The key tiles start longest list first (by the group's first head's mask).
    const int kv_head = blockIdx.x, k_tiles = (seqlen + KEYS - 1) / KEYS;
    const int k_tile = order[mask_of_head[kv_head * group] * k_tiles + blockIdx.y];
    const int k0 = k_tile * KEYS;
    if (threadIdx.x == 0) {
        barrier_init(&kv_full, 1);
        for (int i = 0; i < STAGES; ++i) {
            barrier_init(&full[i], 32);
            barrier_init(&empty[i], CONSUMERS);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    KeyTileWalk<ROWS, KEYS> walk(tile_start, tiles, mask_of_head, seqlen, k_tile, kv_head, group);

    if (threadIdx.x < HOPPER_WARPGROUP) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
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
            barrier_wait(&empty[stage], ((j / STAGES) & 1) ^ 1);
            // The warp's stores of the row statistics are released by its arrivals.
            stage_row_statistics<ROWS, 32>(s_lse[stage], s_delta[stage], lse, delta, (size_t)head * seqlen, q0, seqlen);
            if (lane == 0) {
                barrier_expect_bytes(&full[stage], 2 * ROWS * D * 2);
                u16* sq = stage_tiles(stage);
                for (int panel = 0; panel < 2; ++panel) {
                    load_box(sq + panel * ROWS * 64, q_map, panel * 64, q0, head, &full[stage]);
                    load_box(sq + TILE_ELEMENTS + panel * ROWS * 64, do_map, panel * 64, q0, head, &full[stage]);
                }
            } else {
                barrier_arrive(&full[stage]);
            }
        }
        return;
    }
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");

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
        barrier_wait(&full[stage], (j / STAGES) & 1);
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
        barrier_arrive(&empty[stage]);
        settle<D / 2>(dk_acc);
        settle<D / 2>(dv_acc);
    }
    store_rows(dk + (size_t)kv_head * seqlen * D, dk_acc, key0, seqlen, scale);
    store_rows(dv + (size_t)kv_head * seqlen * D, dv_acc, key0, seqlen, 1.0f);
}

#define FLASH_BACKWARD_DQ_HOPPER(SUFFIX, E) \
extern "C" __global__ void __launch_bounds__(HOPPER_WARPGROUP, 2) flash_backward_dq_hopper_##SUFFIX( \
    const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v, const u16* __restrict__ d_out, QUERY_TILE_TAIL) { \
    flash_backward_dq_hopper<E>(q, k, v, d_out, QUERY_TILE_TAIL_ARGS); } \
extern "C" __global__ void __launch_bounds__(3 * HOPPER_WARPGROUP, 1) flash_backward_dq_tma_##SUFFIX( \
    const __grid_constant__ TensorMap k_map, const __grid_constant__ TensorMap v_map, const u16* __restrict__ q, \
    const u16* __restrict__ d_out, QUERY_TILE_TAIL) { \
    flash_backward_dq_tma<E>(&k_map, &v_map, q, d_out, QUERY_TILE_TAIL_ARGS); }
#define FLASH_BACKWARD_DKDV_HOPPER(SUFFIX, E) \
extern "C" __global__ void __launch_bounds__(HOPPER_WARPGROUP, 2) flash_backward_dkdv_hopper_##SUFFIX(KEY_TILE_PARAMS) { \
    flash_backward_dkdv_hopper<E>(KEY_TILE_ARGS); }
#define FLASH_BACKWARD_KEY_TMA(NAME, SUFFIX, E, DQ) \
extern "C" __global__ void __launch_bounds__(3 * HOPPER_WARPGROUP, 1) NAME##_##SUFFIX( \
    const __grid_constant__ TensorMap q_map, const __grid_constant__ TensorMap k_map, const __grid_constant__ TensorMap v_map, \
    const __grid_constant__ TensorMap do_map, KEY_TILE_TAIL) { \
    flash_backward_key_tma<E, DQ>(&q_map, &k_map, &v_map, &do_map, KEY_TILE_TAIL_ARGS); }
#define FLASH_BACKWARD_HOPPER(SUFFIX, E) \
FLASH_BACKWARD_DQ_HOPPER(SUFFIX, E) \
FLASH_BACKWARD_DKDV_HOPPER(SUFFIX, E) \
FLASH_BACKWARD_KEY_TMA(flash_backward_dkdv_tma, SUFFIX, E, false) \
FLASH_BACKWARD_KEY_TMA(flash_backward_fused_tma, SUFFIX, E, true)
FLASH_BACKWARD_HOPPER(bf16_d128, 1)
FLASH_BACKWARD_HOPPER(f16_d128, 2)
#endif
