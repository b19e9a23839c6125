// The mask IR on the device: a row's allowed keys (or a column's queries) as partial tiles test
// them. Needs primitives.cuh.
#pragma once

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
