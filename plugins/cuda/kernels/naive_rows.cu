// The naive kernel's row kernels, one block per row, for each element type (0 = f32, 1 = bf16,
// 2 = fp16; probabilities and dS are written in the inputs' type). Rows with no allowed key:
// P = 0, LSE = −∞, dS = 0.
__device__ __forceinline__ bool allowed(unsigned k, const unsigned* iv, unsigned n) {
    for (unsigned t = 0; t < n; ++t) { if (k >= iv[2 * t] && k < iv[2 * t + 1]) return true; }
    return false;
}
template <int E>
__device__ __forceinline__ void store(void* base, size_t index, float x) {
    if (E == 0) {
        ((float*)base)[index] = x;
    } else if (E == 1) {
        unsigned bits = __float_as_uint(x);
        bits += 0x7fffu + ((bits >> 16) & 1u);
        ((unsigned short*)base)[index] = (unsigned short)(bits >> 16);
    } else {
        unsigned short h;
        asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
        ((unsigned short*)base)[index] = h;
    }
}
__device__ float block_reduce(float value, bool take_max) {
    __shared__ float shared[32];
    for (int offset = 16; offset > 0; offset >>= 1) {
        float other = __shfl_down_sync(0xffffffffu, value, offset);
        value = take_max ? fmaxf(value, other) : value + other;
    }
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) shared[warp] = value;
    __syncthreads();
    int warps = (blockDim.x + 31) >> 5;
    value = threadIdx.x < warps ? shared[threadIdx.x] : (take_max ? __int_as_float(0xff800000) : 0.0f);
    if (warp == 0) {
        for (int offset = 16; offset > 0; offset >>= 1) {
            float other = __shfl_down_sync(0xffffffffu, value, offset);
            value = take_max ? fmaxf(value, other) : value + other;
        }
    }
    if (threadIdx.x == 0) shared[0] = value;
    __syncthreads();
    float result = shared[0];
    __syncthreads();
    return result;
}
template <int E>
__device__ void masked_softmax(const float* scores, void* probs, float* lse,
                               const unsigned* row_start, const unsigned* intervals, int s) {
    const int row = blockIdx.x;
    const float* line = scores + (size_t)row * s;
    const unsigned begin = row_start[row], count = row_start[row + 1] - begin;
    const unsigned* iv = intervals + 2 * begin;
    const float minus_inf = __int_as_float(0xff800000);
    float m = minus_inf;
    for (int k = threadIdx.x; k < s; k += blockDim.x) if (allowed(k, iv, count)) m = fmaxf(m, line[k]);
    m = block_reduce(m, true);
    float sum = 0.0f;
    if (m != minus_inf) for (int k = threadIdx.x; k < s; k += blockDim.x) if (allowed(k, iv, count)) sum += expf(line[k] - m);
    sum = block_reduce(sum, false);
    const float l = (m == minus_inf) ? minus_inf : m + logf(sum);
    for (int k = threadIdx.x; k < s; k += blockDim.x) {
        const float p = (m != minus_inf && allowed(k, iv, count)) ? expf(line[k] - l) : 0.0f;
        store<E>(probs, (size_t)row * s + k, p);
    }
    if (threadIdx.x == 0) lse[row] = l;
}
template <int E>
__device__ void softmax_grad(const float* scores, const float* lse, const float* dp, void* ds,
                             const unsigned* row_start, const unsigned* intervals, int s, float scale) {
    const int row = blockIdx.x;
    const float* line = scores + (size_t)row * s;
    const float* grad = dp + (size_t)row * s;
    const unsigned begin = row_start[row], count = row_start[row + 1] - begin;
    const unsigned* iv = intervals + 2 * begin;
    const float l = lse[row];
    const bool empty = l == __int_as_float(0xff800000);
    float d = 0.0f;
    if (!empty) for (int k = threadIdx.x; k < s; k += blockDim.x) if (allowed(k, iv, count)) d += expf(line[k] - l) * grad[k];
    d = block_reduce(d, false);
    for (int k = threadIdx.x; k < s; k += blockDim.x) {
        const float p = (!empty && allowed(k, iv, count)) ? expf(line[k] - l) : 0.0f;
        store<E>(ds, (size_t)row * s + k, p * (grad[k] - d) * scale);
    }
}
#define ROW_KERNELS(SUFFIX, E) \
extern "C" __global__ void masked_softmax_##SUFFIX(const float* a, void* b, float* c, const unsigned* d, const unsigned* e, int s) { masked_softmax<E>(a, b, c, d, e, s); } \
extern "C" __global__ void softmax_grad_##SUFFIX(const float* a, const float* b, const float* c, void* d, const unsigned* e, const unsigned* f, int s, float scale) { softmax_grad<E>(a, b, c, d, e, f, s, scale); }
ROW_KERNELS(f32, 0)
ROW_KERNELS(bf16, 1)
ROW_KERNELS(f16, 2)
