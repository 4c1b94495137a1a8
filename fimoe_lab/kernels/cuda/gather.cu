// Out-of-place cell gathers (an executable map, fimoe_lab/kernels/compiled.py), built ahead of time.
//
// Per expert: output cell i = input cell src[i] (src[i] >= 0), or every word of fill -1 - src[i]
// (fills[-1 - src[i]]: the fill byte repeated over a word). A block writes BM output cells x BW words
// of each: consecutive threads write consecutive words, so stores are whole lines and loads are
// whole lines of a cell wherever the cell spans them. Each word is read and written once: streaming
// loads and stores (__ldcs / __stcs: evict first).
//
// Grid: x = tile * NC + column chunk (NC = cell words / BW), y = expert of the launch. Block:
// THREADS threads, each moving ITEMS words, so BM * BW = THREADS * ITEMS.

#include "tile.cuh"

template <typename W>
__device__ __forceinline__ void gather_tile(W* __restrict__ out, const W* __restrict__ x, const int* __restrict__ src,
                                            const W* __restrict__ fills, int n_out, int bm, int bw, int nc,
                                            long long cell_words, long long in_words, long long out_words) {
    const int tile = blockIdx.x / nc;
    const long long col0 = (long long)(blockIdx.x % nc) * bw;
    const long long e = blockIdx.y;
    const W* xe = x + e * in_words;
    W* oe = out + e * out_words;
#pragma unroll
    for (int k = 0; k < ITEMS; ++k) {
        const int i = k * THREADS + (int)threadIdx.x;
        const int cell = tile * bm + i / bw;
        if (cell < n_out) {
            const long long col = col0 + i % bw;
            const int s = src[cell];
            const W v = s >= 0 ? __ldcs(xe + (long long)s * cell_words + col) : fills[-1 - s];
            __stcs(oe + (long long)cell * cell_words + col, v);
        }
    }
}

#define GATHER_KERNEL(NAME, W)                                                                                    \
    extern "C" __global__ void __launch_bounds__(THREADS)                                                       \
        NAME(W* out, const W* x, const int* src, const W* fills, int n_out, int bm, int bw, int nc,             \
             long long cell_words, long long in_words, long long out_words) {                                    \
        gather_tile<W>(out, x, src, fills, n_out, bm, bw, nc, cell_words, in_words, out_words);                 \
    }

GATHER_KERNEL(fimoe_gather_w16, word16)
GATHER_KERNEL(fimoe_gather_w4, word4)
GATHER_KERNEL(fimoe_gather_w1, word1)
