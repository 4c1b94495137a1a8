// Out-of-place rows of 1-byte scales, padded on the right, then the 128x4 scale swizzle (the swizzled-rows
// form of an executable map, fimoe_lab/kernels/compiled.py), built ahead of time.
//
// Per expert: the swizzle's input is R rows (R % 128 == 0) of C = 4 cw bytes. Its row r is input row rows[r]'s
// c_in bytes (c_in <= C) then column_fill, or, for rows[r] < 0, every byte -1 - rows[r] (the table holds fill
// bytes, not fill codes). Output word (band * cw + kk) * 128 + 4 p + q is bytes 4 kk .. 4 kk + 3 of row
// band * 128 + 32 q + p.
//
// A block stages BAND_ROWS rows x KC words of one band in shared memory, loading along each row (consecutive
// threads read consecutive W-byte words of a row; each thread issues 8 loads before it stages them), then stores 16-byte words (band, kk, p): the words kk of
// rows p, p + 32, p + 64, p + 96, so a warp writes 512 contiguous bytes. Each byte is read and written once:
// streaming loads and stores.
//
// Grid: x = band * NK + column chunk (NK = ceil(cw / KC)), y = expert of the launch. Block: THREADS threads.

#include "tile.cuh"

#define BAND_ROWS 128
#define KC 32
#define PITCH_WORDS (KC + 1)  // a row's words in shared memory, one more so the q rows of a store sit in other banks

typedef unsigned short word2;

template <typename W>
__device__ __forceinline__ W fill_word(unsigned int byte) {
    unsigned int four = byte * 0x01010101u;
    return (W)four;
}

template <typename W>
__device__ __forceinline__ void swizzle_band(word16* __restrict__ out, const unsigned char* __restrict__ x,
                                             const int* __restrict__ rows, int c_in, int cw, int nk,
                                             int column_fill, long long in_bytes, long long out_words) {
    __shared__ int band_rows[BAND_ROWS];
    __shared__ word4 tile[BAND_ROWS * PITCH_WORDS];
    const int band = blockIdx.x / nk;
    const int kk0 = (blockIdx.x % nk) * KC;
    const int kc = min(KC, cw - kk0);
    const long long e = blockIdx.y;
    const unsigned char* xe = x + e * in_bytes;
    for (int r = threadIdx.x; r < BAND_ROWS; r += THREADS) band_rows[r] = rows[band * BAND_ROWS + r];
    __syncthreads();

    // a row's words in a whole chunk (a power of two) and each thread's share of the band's, loaded BATCH at a time
    constexpr int ROW_WORDS = KC * 4 / (int)sizeof(W);
    constexpr int PER_THREAD = BAND_ROWS * ROW_WORDS / THREADS;
    constexpr int BATCH = PER_THREAD < 8 ? PER_THREAD : 8;
    const int live_words = kc * 4 / (int)sizeof(W);
    const int c0 = kk0 * 4;
    unsigned char* staged = reinterpret_cast<unsigned char*>(tile);
    for (int k0 = 0; k0 < PER_THREAD; k0 += BATCH) {
        W v[BATCH];
#pragma unroll
        for (int k = 0; k < BATCH; ++k) {
            const int i = (k0 + k) * THREADS + (int)threadIdx.x;
            const int r = i / ROW_WORDS, j = i % ROW_WORDS;
            const int col = c0 + j * (int)sizeof(W);
            const int s = band_rows[r];
            if (j >= live_words) {
                v[k] = 0;  // past the chunk's last word: never stored
            } else if (s < 0) {
                v[k] = fill_word<W>((unsigned int)(-1 - s));
            } else if (col < c_in) {
                v[k] = __ldcs(reinterpret_cast<const W*>(xe + (long long)s * c_in + col));
            } else {
                v[k] = fill_word<W>((unsigned int)column_fill);
            }
        }
#pragma unroll
        for (int k = 0; k < BATCH; ++k) {
            const int i = (k0 + k) * THREADS + (int)threadIdx.x;
            *reinterpret_cast<W*>(staged + (i / ROW_WORDS) * PITCH_WORDS * 4 + (i % ROW_WORDS) * (int)sizeof(W)) = v[k];
        }
    }
    __syncthreads();

    word16* ob = out + e * out_words + ((long long)band * cw + kk0) * 32;
    for (int u = threadIdx.x; u < kc * 32; u += THREADS) {
        const int kk = u / 32, p = u % 32;
        word16 v;
        v.x = tile[p * PITCH_WORDS + kk];
        v.y = tile[(p + 32) * PITCH_WORDS + kk];
        v.z = tile[(p + 64) * PITCH_WORDS + kk];
        v.w = tile[(p + 96) * PITCH_WORDS + kk];
        __stcs(ob + u, v);
    }
}

#define SWIZZLE_KERNEL(NAME, W)                                                                                  \
    extern "C" __global__ void __launch_bounds__(THREADS)                                                       \
        NAME(word16* out, const unsigned char* x, const int* rows, int c_in, int cw, int nk, int column_fill,   \
             long long in_bytes, long long out_words) {                                                          \
        swizzle_band<W>(out, x, rows, c_in, cw, nk, column_fill, in_bytes, out_words);                          \
    }

SWIZZLE_KERNEL(fimoe_swizzle_w4, word4)
SWIZZLE_KERNEL(fimoe_swizzle_w2, word2)
SWIZZLE_KERNEL(fimoe_swizzle_w1, word1)
