// Out-of-place rows of 1-byte scales, padded on the right, then the 128x4 scale swizzle (the swizzled-rows
// form of an executable map, fimoe_lab/kernels/compiled.py), built ahead of time.
//
// Per expert: the swizzle's input is R rows (R % 128 == 0, n_bands = R / 128) of C = 4 cw bytes. Its row r is
// input row rows[r]'s c_in bytes (c_in <= C) then column_fill, or, for rows[r] < 0, every byte -1 - rows[r]
// (the table holds fill bytes, not fill codes). Output word (band * cw + kk) * 128 + 4 p + q is bytes
// 4 kk .. 4 kk + 3 of row band * 128 + 32 q + p.
//
// A block stages one tile in shared memory: NB = TILE_WORDS / KW bands of KW words of each of their rows
// (KW = 2^kw_shift, a power of two from MIN_KW to TILE_WORDS: the row's words where they are fewer, so short
// rows still fill a tile), loading along each row (consecutive threads read consecutive W-byte words; each
// thread issues BATCH loads before it stages them: all of its 4-byte words, 8 narrower ones). It then stores
// 16-byte words (band, kk, p): the words kk of rows p, p + 32, p + 64, p + 96 of a band, so a warp writes 512
// contiguous bytes. Each byte is read and written once: streaming loads and stores.
//
// Grid: x = tile of NB bands * NK + column chunk (NK = ceil(cw / KW)), y = expert of the launch. Block: THREADS.

#include "tile.cuh"

#define BAND_ROWS 128
#define TILE_WORDS 32
#define MIN_KW 4
#define MAX_TILE_ROWS (BAND_ROWS * TILE_WORDS / MIN_KW)

template <typename W>
__device__ __forceinline__ void swizzle_tile(word16* __restrict__ out, const unsigned char* __restrict__ x,
                                             const int* __restrict__ rows, int c_in, int cw, int n_bands, int nk,
                                             int kw_shift, int column_fill, long long in_bytes, long long out_words) {
    __shared__ int tile_rows[MAX_TILE_ROWS];
    __shared__ word4 tile[MAX_TILE_ROWS * (MIN_KW + 1)];  // rows of KW + 1 words: a store's 32 rows in 32 banks
    const int kw = 1 << kw_shift, pitch = kw + 1;
    const int nb_shift = 5 - kw_shift;  // log2(TILE_WORDS / KW)
    const int band0 = (blockIdx.x / nk) << nb_shift;
    const int kk0 = (blockIdx.x % nk) * kw;
    const int kc = min(kw, cw - kk0);
    const int live_rows = min(BAND_ROWS << nb_shift, (n_bands - band0) * BAND_ROWS);
    const long long e = blockIdx.y;
    const unsigned char* xe = x + e * in_bytes;
    for (int r = threadIdx.x; r < live_rows; r += THREADS) tile_rows[r] = rows[band0 * BAND_ROWS + r];
    __syncthreads();

    // each row's W-byte words in the tile: 2^rw_shift; every thread loads the same share of the tile's
    constexpr int PER_THREAD = BAND_ROWS * TILE_WORDS * 4 / (int)sizeof(W) / THREADS;
    const int rw_shift = kw_shift + 2 - (sizeof(W) == 4 ? 2 : sizeof(W) == 2 ? 1 : 0);
    const int live_words = kc * 4 / (int)sizeof(W);
    const int c0 = kk0 * 4;
    unsigned char* staged = reinterpret_cast<unsigned char*>(tile);
    // loads in flight a thread: all 16 of 4-byte words (on an H100 the 4-byte maps ran 0.86-0.93 -> 0.91-0.95 of a
    // copy, 40 registers); 8 at a time of narrower ones (2-byte words 32 at once: 0.56 -> 0.43, 63 registers)
    constexpr int BATCH = sizeof(W) == 4 ? PER_THREAD : 8;
    for (int k0 = 0; k0 < PER_THREAD; k0 += BATCH) {
        W v[BATCH];
#pragma unroll
        for (int k = 0; k < BATCH; ++k) {
            const int i = (k0 + k) * THREADS + (int)threadIdx.x;
            const int r = i >> rw_shift, j = i & ((1 << rw_shift) - 1);
            const int col = c0 + j * (int)sizeof(W);
            v[k] = 0;  // past the tile's last live word or row: never stored
            if (j < live_words && r < live_rows) {
                const int s = tile_rows[r];
                if (s < 0) {
                    splat(v[k], (unsigned int)(-1 - s));
                } else if (col < c_in) {
                    v[k] = __ldcs(reinterpret_cast<const W*>(xe + (long long)s * c_in + col));
                } else {
                    splat(v[k], (unsigned int)column_fill);
                }
            }
        }
#pragma unroll
        for (int k = 0; k < BATCH; ++k) {
            const int i = (k0 + k) * THREADS + (int)threadIdx.x;
            const int r = i >> rw_shift, j = i & ((1 << rw_shift) - 1);
            *reinterpret_cast<W*>(staged + r * pitch * 4 + j * (int)sizeof(W)) = v[k];
        }
    }
    __syncthreads();

    // 16-byte words (band b of the tile, word kk, p): TILE_WORDS * 32 of them, THREADS at a time
    for (int u = threadIdx.x; u < TILE_WORDS * 32; u += THREADS) {
        const int b = u >> (kw_shift + 5), kk = (u >> 5) & (kw - 1), p = u & 31;
        if (kk < kc && b * BAND_ROWS < live_rows) {
            const int row = b * BAND_ROWS + p;
            word16 v;
            v.x = tile[row * pitch + kk];
            v.y = tile[(row + 32) * pitch + kk];
            v.z = tile[(row + 64) * pitch + kk];
            v.w = tile[(row + 96) * pitch + kk];
            __stcs(out + e * out_words + ((long long)(band0 + b) * cw + kk0 + kk) * 32 + p, v);
        }
    }
}

#define SWIZZLE_KERNEL(NAME, W)                                                                                  \
    extern "C" __global__ void __launch_bounds__(THREADS)                                                       \
        NAME(word16* out, const unsigned char* x, const int* rows, int c_in, int cw, int n_bands, int nk,        \
             int kw_shift, int column_fill, long long in_bytes, long long out_words) {                           \
        swizzle_tile<W>(out, x, rows, c_in, cw, n_bands, nk, kw_shift, column_fill, in_bytes, out_words);       \
    }

SWIZZLE_KERNEL(fimoe_swizzle_w4, word4)
SWIZZLE_KERNEL(fimoe_swizzle_w2, word2)
SWIZZLE_KERNEL(fimoe_swizzle_w1, word1)
