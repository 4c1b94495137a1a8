// In-place cell permutations along a cycle plan (fimoe_lab/kernels/cycles.py), built ahead of time.
//
// A cycle plan lists the moved cells tile after tile: slot k writes cell dst[k] with cell src[k]
// (src[k] >= 0, a cell that some slot of the same tile writes) or with saved cell -1 - src[k]
// (copied aside first, where a cycle runs over a tile edge). A block moves one tile of BM slots
// x BW words of each cell: it loads every source word into registers, waits for the whole block
// (__syncthreads also orders the block's memory accesses), then stores. No other block touches
// the tile's cells, so each moved word crosses memory once.
//
// Grid: x = tile * NC + column chunk (NC = cell words / BW), y = expert of the chunk. Block:
// THREADS threads, each holding ITEMS words, so BM * BW <= THREADS * ITEMS.
// save != 0: the pass before, copying saved cell dst[k] (k < n_slots) to scratch slot k.
//
// Each word is read and written once, so loads and stores are streaming (__ldcs / __stcs: evict first). At least
// three blocks an SM (__launch_bounds__): 76 registers a thread on sm_90 where the indices-first order asks 93.
// A thread loads every item's cell indices before any word (the indices of all its items in flight at once), then
// every word; after the barrier it only stores.

#include "tile.cuh"

template <typename W>
__device__ __forceinline__ void cycle_tile(W* __restrict__ x, W* __restrict__ scratch, const int* __restrict__ dst,
                                           const int* __restrict__ src, int n_slots, int bm, int bw, int nc,
                                           long long cell_words, long long expert_words, long long scratch_words,
                                           int save) {
    const int tile = blockIdx.x / nc;
    const long long col0 = (long long)(blockIdx.x % nc) * bw;
    const long long e = blockIdx.y;
    W* xe = x + e * expert_words;
    W* se = scratch + e * scratch_words;
    // Every item's cell indices first, with no branch (an item past the tile or the plan reads slot 0's and uses
    // nothing): all of them are in flight at once, so no data load below waits behind another item's index.
    int from_cell[ITEMS], to_cell[ITEMS];
#pragma unroll
    for (int k = 0; k < ITEMS; ++k) {
        const int i = k * THREADS + (int)threadIdx.x;
        const int slot = tile * bm + i / bw;
        const int at = (i < bm * bw && slot < n_slots) ? slot : 0;
        const int d = dst[at], s = src[at];
        to_cell[k] = save ? slot : d;    // save: scratch slot k takes cell dst[k]
        from_cell[k] = save ? d : s;     // else: cell dst[k] takes cell src[k], or saved cell -1 - src[k]
    }
    W v[ITEMS];
#pragma unroll
    for (int k = 0; k < ITEMS; ++k) {
        const int i = k * THREADS + (int)threadIdx.x;
        if (i < bm * bw && tile * bm + i / bw < n_slots) {
            const long long col = col0 + i % bw;
            const int s = from_cell[k];
            v[k] = __ldcs(s >= 0 ? xe + (long long)s * cell_words + col : se + (long long)(-1 - s) * cell_words + col);
        }
    }
    __syncthreads();  // every load of the tile is done before any store overwrites a source
#pragma unroll
    for (int k = 0; k < ITEMS; ++k) {
        const int i = k * THREADS + (int)threadIdx.x;
        if (i < bm * bw && tile * bm + i / bw < n_slots) {
            const long long col = col0 + i % bw;
            __stcs((save ? se : xe) + (long long)to_cell[k] * cell_words + col, v[k]);
        }
    }
}

#define CYCLE_KERNEL(NAME, W)                                                                                       \
    extern "C" __global__ void __launch_bounds__(THREADS, 3)                                                      \
        NAME(W* x, W* scratch, const int* dst, const int* src, int n_slots, int bm, int bw, int nc,               \
             long long cell_words, long long expert_words, long long scratch_words, int save) {                   \
        cycle_tile<W>(x, scratch, dst, src, n_slots, bm, bw, nc, cell_words, expert_words, scratch_words, save); \
    }

CYCLE_KERNEL(fimoe_cycles_w16, word16)
CYCLE_KERNEL(fimoe_cycles_w4, word4)
CYCLE_KERNEL(fimoe_cycles_w1, word1)
