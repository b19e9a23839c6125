// Where results leave the kernels (sm_90a): accumulator rows into global memory, the forward's
// O / l and LSE.
#pragma once

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

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

#endif
