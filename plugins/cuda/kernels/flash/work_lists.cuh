// How the backward's key-tile kernels walk their work lists: the query rows that see a key
// tile, head by head and tile by tile, and those rows' statistics staged in shared memory.
#pragma once

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
