// In-place cell permutation of every expert through an L2-resident ring of scratch slots, in one persistent launch.
//
// Defining equation. x holds E experts of W 16-byte words each (expert e at x + e * W). A map of cells of C words
// (C * 16 = cell bytes, W = n * C) and an int32 permutation src of 0..n-1, the same for every expert, asks for
//     x'[e][i * C + c] = x[e][src[i] * C + c]        for every expert e, cell i < n and word c < C,
// with x' written over x's own storage (engines keep the address for CUDA graphs).
//
// Work items. An expert's W words are cut into T tiles of TW words (TW a multiple of THREADS * ITEMS; the last
// tile may be short). Two kinds of item per tile:
//     A(e, t): gather tile t of x'[e] out of place, from x[e], into scratch slot e % S (x read streaming);
//     B(e, t): copy tile t of scratch slot e % S back over x[e] (contiguous; scratch read, x written streaming).
// The scratch holds S slots of one expert (S = ring >= 2), small enough (S x a few MB) to stay in the L2: x is read
// once from DRAM and written once, as a copy does, and the scratch bytes ideally never reach DRAM.
//
// Order handed out. Items are numbered by one global ticket counter (ctl[0]); with K = S - 1 (lookahead):
//     A(0, *), A(1, *), ..., A(K - 1, *)                   (the first min(K, E) experts)
//     then for j = 0, 1, ..., E - 1:  B(j, *), A(j + K, *)  (A(j + K, *) only where j + K < E)
// each "X(e, *)" being its T tiles in order: 2 E T items in all.
//
// Dependencies (per-expert completion counters in ctl, each bumped once per finished tile):
//     B(e, t) waits until every A(e, *) is done  (B overwrites x[e], which every A(e, *) reads);
//     A(e, t) with e >= S waits until every B(e - S, *) is done  (A(e) reuses the slot of e - S, which B reads).
// A block finishing a tile: all its stores, __syncthreads, then one thread __threadfence + atomicAdd (release).
// A block starting an item: one thread spins on an acquire load of the counter, __threadfence, __syncthreads.
//
// Why it cannot deadlock. Every item waits only on items with smaller tickets: A(e) for e < K waits on nothing;
// A(j + K), in round j, waits on B(j - 1), handed out in round j - 1 (j + K >= S means j >= 1); B(j), in round j,
// waits on A(j), handed out in the first part (j < K) or in round j - K < j. A block takes a ticket only while it is
// running, and a running block is never evicted. So the unfinished item of the smallest ticket is held by a running
// block whose earlier item (a smaller ticket) is finished, and whose own waits are on smaller, finished, tickets:
// it finishes, and by induction every item does. This holds for any grid size (a block also holds at most one
// ticket it has not started: the next one, taken early, always larger than the one it works on); a persistent
// grid of no more blocks than fit on the GPU only keeps the waiting short.
//
// Reset. ctl has 2 + 2 E int32: [0] ticket, [1] blocks exited, [2 + e] A tiles of expert e done, [2 + E + e] B tiles
// done. It must be zero before the first launch; the last block to exit zeroes it again, so the next launch on the
// stream finds it zero (a launch that did not complete leaves it to be zeroed by the host).
//
// flags: bit 0: A stores the scratch with an L2 evict_last policy (else a plain store); bit 1: B discards each whole
// 128-byte scratch line of its tile from the L2 after reading it (discard.global.L2: no write-back of dead scratch
// to DRAM; the scratch bytes are undefined after). Host asserts: 16-byte-aligned x, 128-byte-aligned scratch,
// slot_words >= W and a multiple of 8, W < 2^31, 2 E T < 2^31, S >= 2.

#include "tile.cuh"

#ifndef FIMOE_HOST
__device__ __forceinline__ int l2_load_acquire(const int* p) {
    int v;
    asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ unsigned long long l2_evict_last_policy() {
    unsigned long long policy;
    asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(policy));
    return policy;
}
__device__ __forceinline__ void l2_store_hinted(word16* p, word16 v, unsigned long long policy) {
    asm volatile("st.global.L2::cache_hint.v4.u32 [%0], {%1, %2, %3, %4}, %5;" ::"l"(p), "r"(v.x), "r"(v.y),
                 "r"(v.z), "r"(v.w), "l"(policy)
                 : "memory");
}
__device__ __forceinline__ void l2_discard_line(word16* p) {
    asm volatile("discard.global.L2 [%0], 128;" ::"l"(p) : "memory");
}
#endif

// Ticket -> (is_b, expert, tile), in the order above.
__device__ __forceinline__ void l2_item(int item, int n_experts, int ring, int n_tiles, int& is_b, int& e, int& t) {
    const int k = ring - 1;
    const int lead = min(k, n_experts);
    if (item < lead * n_tiles) {
        is_b = 0;
        e = item / n_tiles;
        t = item - e * n_tiles;
        return;
    }
    int h = item - lead * n_tiles;
    const int paired = max(n_experts - k, 0);  // rounds j < paired: B(j, *) then A(j + K, *)
    if (h < paired * 2 * n_tiles) {
        const int j = h / (2 * n_tiles);
        const int r = h - j * 2 * n_tiles;
        is_b = r < n_tiles;
        e = is_b ? j : j + k;
        t = is_b ? r : r - n_tiles;
        return;
    }
    h -= paired * 2 * n_tiles;
    const int j = h / n_tiles;
    is_b = 1;
    e = paired + j;
    t = h - j * n_tiles;
}

template <int NI>
__device__ __forceinline__ void inplace_l2(word16* x, word16* scratch, const int* __restrict__ src, int* ctl,
                                           int n_experts, int ring, int n_tiles, int tile_words, int cell_words,
                                           int cell_shift, int expert_words, long long slot_words, int flags) {
    __shared__ int s_item[2];
    __shared__ int s_last;
    const int tid = (int)threadIdx.x;
    const int total = 2 * n_experts * n_tiles;
    int* const a_done = ctl + 2;
    int* const b_done = ctl + 2 + n_experts;
#ifndef FIMOE_HOST
    const unsigned long long policy = (flags & 1) ? l2_evict_last_policy() : 0ull;
#endif

    if (tid == 0) s_item[0] = atomicAdd(&ctl[0], 1);
    __syncthreads();
    for (int slot_k = 0;; slot_k ^= 1) {
        const int item = s_item[slot_k];  // every thread reads it before the barrier below: block-uniform
        if (item >= total) break;
        int is_b, e, t;
        l2_item(item, n_experts, ring, n_tiles, is_b, e, t);
        if (tid == 0) {
            s_item[slot_k ^ 1] = atomicAdd(&ctl[0], 1);  // the next ticket, taken early (always a larger one)
            const int* flag = is_b ? a_done + e : (e >= ring ? b_done + (e - ring) : nullptr);
            if (flag != nullptr) {
                while (l2_load_acquire(flag) < n_tiles) __nanosleep(64);
                __threadfence();
            }
        }
        __syncthreads();  // the item's dependencies are done; the next ticket is posted

        const int w_begin = t * tile_words;
        const int w_end = min(w_begin + tile_words, expert_words);
        word16* const xe = x + (long long)e * expert_words;
        word16* const slot = scratch + (long long)(e % ring) * slot_words;
        if (!is_b) {
            for (int w0 = w_begin; w0 < w_end; w0 += THREADS * NI) {
                // Every item's source index first (its src entry), then every word: all loads in flight at once.
                int from[NI];
#pragma unroll
                for (int k = 0; k < NI; ++k) {
                    const int w = min(w0 + k * THREADS + tid, w_end - 1);
                    const int cell = cell_shift >= 0 ? w >> cell_shift : w / cell_words;
                    from[k] = __ldg(src + cell) * cell_words + (w - cell * cell_words);
                }
                word16 v[NI];
#pragma unroll
                for (int k = 0; k < NI; ++k) {
                    if (w0 + k * THREADS + tid < w_end) v[k] = __ldcs(xe + from[k]);
                }
#pragma unroll
                for (int k = 0; k < NI; ++k) {
                    const int w = w0 + k * THREADS + tid;
                    if (w < w_end) {
#ifndef FIMOE_HOST
                        if (flags & 1) {
                            l2_store_hinted(slot + w, v[k], policy);
                            continue;
                        }
#endif
                        slot[w] = v[k];
                    }
                }
            }
        } else {
            for (int w0 = w_begin; w0 < w_end; w0 += THREADS * NI) {
                word16 v[NI];
#pragma unroll
                for (int k = 0; k < NI; ++k) {
                    const int w = w0 + k * THREADS + tid;
                    if (w < w_end) v[k] = __ldcg(slot + w);
                }
#pragma unroll
                for (int k = 0; k < NI; ++k) {
                    const int w = w0 + k * THREADS + tid;
                    if (w < w_end) __stcs(xe + w, v[k]);
                }
            }
            if (flags & 2) {
                __syncthreads();  // every word of the tile is read (and stored) before its lines are dropped
                // whole 128-byte lines (8 words) inside the tile only: a line shared with the next tile is kept
                for (int line = (w_begin >> 3) + tid; line < (w_end >> 3); line += THREADS) {
                    l2_discard_line(slot + ((long long)line << 3));
                }
            }
        }
        __syncthreads();  // every store of the tile (and discard) is done before it is counted
        if (tid == 0) {
            __threadfence();
            atomicAdd(is_b ? b_done + e : a_done + e, 1);
        }
    }

    // The last block out zeroes the counters for the next launch (no block reads them any more).
    __syncthreads();
    if (tid == 0) {
        __threadfence();
        s_last = atomicAdd(&ctl[1], 1) == (int)gridDim.x - 1;
    }
    __syncthreads();
    const int last = s_last;
    __syncthreads();  // every thread has read s_last before any thread leaves
    if (last) {
        __threadfence();
        for (int i = tid; i < 2 + 2 * n_experts; i += THREADS) ctl[i] = 0;
    }
}

// NI words a thread per step: 8 (113 registers on sm_90: 2 blocks an SM) or 4 (at most 64: 4 blocks an SM); the same
// bytes in flight an SM either way. Tiles are a multiple of THREADS * 8 words for both.
#define INPLACE_L2_KERNEL(NAME, NI, MIN_BLOCKS)                                                                    \
    extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS)                                          \
        NAME(word16* x, word16* scratch, const int* src, int* ctl, int n_experts, int ring, int n_tiles,        \
             int tile_words, int cell_words, int cell_shift, int expert_words, long long slot_words, int flags) { \
        inplace_l2<NI>(x, scratch, src, ctl, n_experts, ring, n_tiles, tile_words, cell_words, cell_shift,       \
                       expert_words, slot_words, flags);                                                        \
    }

INPLACE_L2_KERNEL(fimoe_inplace_l2_i8, 8, 2)
INPLACE_L2_KERNEL(fimoe_inplace_l2_i4, 4, 4)
