// The arithmetic of a context-parallel rank's device store (plugins/cp/src/device.rs): gathering
// ranges of buffers into one, adding f32 tensors, filling, and merging two partial attention
// results by their log-sum-exps.

typedef unsigned long long u64;

// Part p copies table[2P + p] bytes from address table[p] to address table[P + p] (P parts);
// blockIdx.y is the part, blockIdx.x with the threads strides over its 16-byte chunks (parts
// start and end 16-byte aligned, see device.rs).
extern "C" __global__ void gather_parts(const u64* table) {
    const int p = blockIdx.y, parts = gridDim.y;
    const uint4* from = reinterpret_cast<const uint4*>(table[p]);
    uint4* to = reinterpret_cast<uint4*>(table[parts + p]);
    const u64 chunks = table[2 * parts + p] / 16;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < chunks; i += (u64)gridDim.x * blockDim.x)
        to[i] = from[i];
}

extern "C" __global__ void add_f32(float* target, const float* source, u64 n) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)
        target[i] += source[i];
}

extern "C" __global__ void fill_f32(float* x, float value, u64 n) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)
        x[i] = value;
}

// Folds (other_out, other_lse) into (out, lse), one warp per row of d values: the merged LSE and
// both weights from lane 0, the row's values scaled by every lane. Rows the other part did not
// see (LSE −∞) keep their values; rows only it saw take its.
extern "C" __global__ void merge_rows(float* out, float* lse, const float* other_out, const float* other_lse,
                                     u64 rows, int d) {
    const u64 row = ((u64)blockIdx.x * blockDim.x + threadIdx.x) / 32;
    const int lane = threadIdx.x & 31;
    if (row >= rows) return;
    const float minus_inf = __int_as_float(0xff800000);
    const float mine = lse[row], theirs = other_lse[row];
    if (theirs == minus_inf) return;
    float merged;
    if (mine == minus_inf) {
        merged = theirs;
    } else {
        const float top = fmaxf(mine, theirs);
        merged = top + logf(expf(mine - top) + expf(theirs - top));
    }
    const float keep = mine == minus_inf ? 0.0f : expf(mine - merged), take = expf(theirs - merged);
    for (int i = lane; i < d; i += 32) {
        const u64 at = row * d + i;
        out[at] = out[at] * keep + other_out[at] * take;
    }
    __syncwarp();
    if (lane == 0) lse[row] = merged;
}
