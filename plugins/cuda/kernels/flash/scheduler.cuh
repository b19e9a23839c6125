// Tile schedulers: which work items a block of a forward-order kernel takes. An item is a query
// head and a position in its mask's longest-first order of query tiles (a position is one
// block's share: one tile, or one per consumer warpgroup). A kernel is instantiated with one
// scheduler; both walk the items in the same order, heads inside positions, so every head's
// longest list starts before any head's second and the heads of a KV group read the same K and
// V tiles while they are in L2. The host sizes the grid to match (`Schedule` in launch.rs).
#pragma once

struct TileWork {
    int head, position;
};

// One item per block, on a grid of (heads, positions): the hardware hands out the blocks, a
// block's barriers and rings serve one item.
struct GridSchedule {
    static constexpr bool PERSISTENT = false;
    __device__ GridSchedule(int, int) {}
    __device__ bool first(TileWork& work) const {
        work = {(int)blockIdx.x, (int)blockIdx.y};
        return true;
    }
    __device__ bool next(TileWork&) const { return false; }
};

// gridDim.x blocks (one an SM) for every item: block b takes items b, b + gridDim.x, … of the
// order. Launch and set-up are paid once a block, and a block's next item starts loading while
// its last one finishes; the split is static, so the longest-first order is what balances it.
struct PersistentSchedule {
    static constexpr bool PERSISTENT = true;
    int heads, items, index;
    __device__ PersistentSchedule(int heads_, int positions) : heads(heads_), items(heads_ * positions), index(blockIdx.x) {}
    __device__ bool first(TileWork& work) const { return at(work); }
    __device__ bool next(TileWork& work) {
        index += gridDim.x;
        return at(work);
    }

  private:
    __device__ bool at(TileWork& work) const {
        if (index >= items) return false;
        work = {index % heads, index / heads};
        return true;
    }
};
