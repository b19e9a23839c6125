// The online softmax of a warpgroup's rows, one key tile at a time (sm_90a). Needs mask.cuh.
#pragma once

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

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

#endif
