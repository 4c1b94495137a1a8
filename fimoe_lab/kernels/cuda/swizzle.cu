// Out-of-place rows of 1-byte scales, padded on the right, then the 128x4 scale swizzle (the swizzled-rows
// form of an executable map, fimoe_lab/kernels/compiled.py), built ahead of time, for rows at any byte alignment.
//
// Per expert: the swizzle's input is R rows (R % 128 == 0, n_bands = R / 128) of C = 4 cw bytes. Its row r is
// input row rows[r]'s c_in bytes (c_in <= C) then column_fill, or, for rows[r] < 0, every byte -1 - rows[r]
// (the table holds fill bytes, not fill codes). Output word (band * cw + kk) * 128 + 4 p + q is bytes
// 4 kk .. 4 kk + 3 of row band * 128 + 32 q + p.
//
// A block stages one tile in shared memory: NB = TILE_WORDS / KW bands of KW words of each of their rows (KW =
// 2^kw_shift, a power of two from MIN_KW to TILE_WORDS: the row's words where they are fewer, so short rows still
// fill a tile), at a pitch of KW + 1 words, then stores 16-byte words (band, kk, p): the words kk of rows p, p + 32,
// p + 64, p + 96 of a band, so a warp writes 512 contiguous bytes. Each byte is stored once: streaming stores.
//
// Loads: a tile row's input bytes [a, a + n), a = x_e + rows[r] * c_in + 4 kk0, n = min(4 KW, c_in - 4 kk0), start
// o = a % 16 bytes into a 16-byte aligned chunk. Each row has CH = 2^ch_shift slots (consecutive threads of one
// warp): slot j loads the aligned chunk at a - o + 16 j (where it holds one of the n bytes) as one 16-byte
// streaming load, takes the next slot's first word by a warp shuffle and funnel-shifts its four 4-byte words into
// row words k = 4 j + m - o / 4 (m = 0..3: bytes a + 4 k .. a + 4 k + 3), each staged where 0 <= k < kc (kc =
// min(KW, cw - kk0); bytes past c_in: column_fill; a fill row: its byte). The host picks CH with 16 CH >= o_max +
// 4 min(KW, cw), o_max = 16 - gcd(16, c_in, in_bytes, x % 16) the largest offset a row can start at, so every row
// word lies in its row's slots. A chunk that does not lie whole in the expert's in_bytes (at an expert's first and
// last bytes, when x or in_bytes is off 16 bytes) is read bytewise, the row's bytes only: no byte outside the expert
// is read. Each thread issues BATCH loads before it stages any. Chunks also hold bytes of the neighbouring rows (a
// 90-byte row reads 96 or 112 bytes), mostly rows of the same tile: on an H100 gpt-oss's 90-byte rows ran 0.88-0.90
// of a copy (2-byte loads before: 0.56-0.58), DeepSeek-R1's 448- and 16-byte rows 0.93-0.95.
//
// Grid: x = tile of NB bands * NK + column chunk (NK = ceil(cw / KW)), y = expert of the launch. Block: THREADS.
//
// Runs of rows (fimoe_swizzle_spans): where a tile holds whole rows (NK == 1) and its rows' sources form at most
// MAX_SPANS runs of consecutive input rows (the order of the tile's rows and repeats aside), spans[tile] lists the
// runs as (first input row, rows), rows 0 past the last. A run's bytes are contiguous: the block loads the aligned
// 16-byte chunks that hold them, each once, into shared memory, run after run, and reads each row's words there at
// the row's byte offset (two 4-byte words and a funnel shift). Every input byte of the tile is read once, where the
// row slots above read a chunk for each row it touches (90-byte rows: 104 bytes a row on average).

#include <climits>

#include "tile.cuh"

#define BAND_ROWS 128
#define TILE_WORDS 32
#define MIN_KW 4
#define MAX_TILE_ROWS (BAND_ROWS * TILE_WORDS / MIN_KW)
#define CHUNK 16
#define BATCH 4  // slots a thread loads before it stages them (16-byte loads in flight)
// fimoe_swizzle_spans: the runs of input rows a tile may read, and the chunks it stages (a tile's bytes, and two
// chunks a run where runs start and end inside a chunk)
#define MAX_SPANS 8
#define STAGE_CHUNKS (BAND_ROWS * TILE_WORDS * 4 / CHUNK + 2 * MAX_SPANS)

// The aligned chunk at c, bytewise: its bytes in [a, b) (the row's, inside the expert), the others 0. For a chunk
// that does not lie whole in the expert's bytes.
__device__ __forceinline__ uint4 chunk_bytes(const unsigned char* c, const unsigned char* a, const unsigned char* b) {
    unsigned w[4] = {0u, 0u, 0u, 0u};
#pragma unroll 1  // a rare path: kept small (unrolled, it held 25 more registers over the whole kernel)
    for (int t = 0; t < CHUNK; ++t) {
        if (c + t >= a && c + t < b) {
            const unsigned byte = (unsigned)c[t] << (8 * (t & 3));
            if (t < 4) w[0] |= byte;
            else if (t < 8) w[1] |= byte;
            else if (t < 12) w[2] |= byte;
            else w[3] |= byte;
        }
    }
    return make_uint4(w[0], w[1], w[2], w[3]);
}

// Row word u whose first byte lies `valid` bytes before the end of the row's input (c_in): bytes past it are the
// column fill.
__device__ __forceinline__ word4 column_filled(word4 u, int valid, word4 fill) {
    if (valid >= 4) return u;
    if (valid <= 0) return fill;
    const word4 mask = 0xffffffffu >> (32 - 8 * valid);
    return (u & mask) | (fill & ~mask);
}

__device__ __forceinline__ void swizzle_tile(word16* __restrict__ out, const unsigned char* __restrict__ x,
                                             const int* __restrict__ rows, int c_in, int cw, int n_bands, int nk,
                                             int kw_shift, int ch_shift, int column_fill, long long in_bytes,
                                             long long out_words) {
    __shared__ word4 tile[MAX_TILE_ROWS * (MIN_KW + 1)];  // rows of KW + 1 words: a store's 32 rows in 32 banks
    const int kw = 1 << kw_shift, pitch = kw + 1;
    const int nb_shift = 5 - kw_shift;  // log2(TILE_WORDS / KW)
    const int band0 = (blockIdx.x / nk) << nb_shift;
    const int kk0 = (blockIdx.x % nk) * kw;
    const int kc = min(kw, cw - kk0);
    const int live_rows = min(BAND_ROWS << nb_shift, (n_bands - band0) * BAND_ROWS);
    const long long e = blockIdx.y;
    const unsigned char* xe = x + e * in_bytes;
    const unsigned char* xe_end = xe + in_bytes;
    const int c0 = kk0 * 4;
    const int n = min(4 * kc, c_in - c0);  // input bytes of a row in the tile (<= 0: column fill only)
    const word4 col_fill = (unsigned)column_fill * 0x01010101u;
    const int* tile_rows = rows + band0 * BAND_ROWS;
    const int slots = live_rows << ch_shift;
    const int ch_mask = (1 << ch_shift) - 1;

    for (int k0 = 0; k0 * THREADS < slots; k0 += BATCH) {  // uniform over the block: every lane shuffles
        uint4 v[BATCH];
        int slot[BATCH];  // the slot's row: its offset o (0 .. 15), or 16 + its fill byte; -1: no slot
#pragma unroll
        for (int k = 0; k < BATCH; ++k) {  // every row of the batch asked for before any chunk
            const int i = (k0 + k) * THREADS + (int)threadIdx.x;
            slot[k] = i < slots ? __ldg(tile_rows + (i >> ch_shift)) : INT_MIN;
        }
        // every whole chunk's load issued before any is used (no other value merges into v: no wait between them)
        unsigned edges = 0;  // bit k: slot k's chunk is read bytewise
#pragma unroll
        for (int k = 0; k < BATCH; ++k) {
            const int i = (k0 + k) * THREADS + (int)threadIdx.x;
            const int s = slot[k];
            const unsigned char* a = xe + (long long)max(s, 0) * c_in + c0;
            const int o = (int)(reinterpret_cast<unsigned long long>(a) & (CHUNK - 1));
            const unsigned char* c = a - o + (i & ch_mask) * CHUNK;
            const bool read = s >= 0 && c < a + n;
            const bool whole = c >= xe && c + CHUNK <= xe_end;
            v[k] = make_uint4(0u, 0u, 0u, 0u);
            if (read && whole) v[k] = __ldcs(reinterpret_cast<const uint4*>(c));
            edges |= (read && !whole) ? 1u << k : 0u;
            slot[k] = s >= 0 ? o : s == INT_MIN ? -1 : 15 - s;  // 15 - s = 16 + (-1 - s)
        }
        if (edges) {
#pragma unroll  // v stays in registers
            for (int k = 0; k < BATCH; ++k) {
                if (edges >> k & 1) {
                    const int i = (k0 + k) * THREADS + (int)threadIdx.x;
                    const unsigned char* a = xe + (long long)__ldg(tile_rows + (i >> ch_shift)) * c_in + c0;
                    v[k] = chunk_bytes(a - slot[k] + (i & ch_mask) * CHUNK, a, a + n);
                }
            }
        }
#pragma unroll
        for (int k = 0; k < BATCH; ++k) {
            const int i = (k0 + k) * THREADS + (int)threadIdx.x;
            const int r = i >> ch_shift, j = i & ch_mask;
            const int o = slot[k] & 15;  // fill rows: unused
            const unsigned next = __shfl_down_sync(0xffffffffu, v[k].x, 1);  // the next slot's chunk, first word
            const int sh = 8 * (o & 3);
            const word4 u[4] = {__funnelshift_r(v[k].x, v[k].y, sh), __funnelshift_r(v[k].y, v[k].z, sh),
                                __funnelshift_r(v[k].z, v[k].w, sh), __funnelshift_r(v[k].w, next, sh)};
            if (slot[k] >= 16) {
                const word4 row_fill = (unsigned)(slot[k] - 16) * 0x01010101u;
#pragma unroll
                for (int m = 0; m < 4; ++m) {
                    const int kk = 4 * j + m;
                    if (kk < kc) tile[r * pitch + kk] = row_fill;
                }
            } else if (slot[k] >= 0) {
#pragma unroll
                for (int m = 0; m < 4; ++m) {
                    const int kk = 4 * j + m - (o >> 2);
                    if (kk >= 0 && kk < kc) tile[r * pitch + kk] = column_filled(u[m], n - 4 * kk, col_fill);
                }
            }
        }
    }
    __syncthreads();

    // 16-byte words (band b of the tile, word kk, p): TILE_WORDS * 32 of them, THREADS at a time
    for (int u = threadIdx.x; u < TILE_WORDS * 32; u += THREADS) {
        const int b = u >> (kw_shift + 5), kk = (u >> 5) & (kw - 1), p = u & 31;
        if (kk < kc && b * BAND_ROWS < live_rows) {
            const int row = b * BAND_ROWS + p;
            word16 w;
            w.x = tile[row * pitch + kk];
            w.y = tile[(row + 32) * pitch + kk];
            w.z = tile[(row + 64) * pitch + kk];
            w.w = tile[(row + 96) * pitch + kk];
            __stcs(out + e * out_words + ((long long)(band0 + b) * cw + kk0 + kk) * 32 + p, w);
        }
    }
}

// The tile's row r, word kk (bytes 4 kk .. 4 kk + 3) from the staged runs: `at` is the row's first byte in `staged`
// or, for a fill row, -1 - its fill byte.
__device__ __forceinline__ word4 staged_word(const word4* staged, int at, int kk, int c_in, word4 col_fill) {
    if (at < 0) return (unsigned)(-1 - at) * 0x01010101u;
    const int off = at + 4 * kk;
    const word4 u = __funnelshift_r(staged[off >> 2], staged[(off >> 2) + 1], 8 * (off & 3));
    return column_filled(u, c_in - 4 * kk, col_fill);
}

__device__ __forceinline__ void swizzle_spans_tile(word16* __restrict__ out, const unsigned char* __restrict__ x,
                                                   const int* __restrict__ rows, const int* __restrict__ spans,
                                                   int c_in, int cw, int n_bands, int kw_shift, int column_fill,
                                                   long long in_bytes, long long out_words) {
    __shared__ uint4 stage[STAGE_CHUNKS + 1];  // + 1: a row's last word may take its funnel's second word past the runs
    __shared__ int row_at[MAX_TILE_ROWS];     // a tile row's first byte in stage, or -1 - its fill byte
    __shared__ int span_first[MAX_SPANS], span_rows[MAX_SPANS], span_skew[MAX_SPANS], span_base[MAX_SPANS + 1];
    const int kw = 1 << kw_shift;
    const int nb_shift = 5 - kw_shift;
    const int band0 = blockIdx.x << nb_shift;
    const int live_rows = min(BAND_ROWS << nb_shift, (n_bands - band0) * BAND_ROWS);
    const long long e = blockIdx.y;
    const unsigned char* xe = x + e * in_bytes;
    const unsigned char* xe_end = xe + in_bytes;
    const int* tile_rows = rows + band0 * BAND_ROWS;
    const word4 col_fill = (unsigned)column_fill * 0x01010101u;

    if (threadIdx.x == 0) {  // each run's chunks: their first slot in stage, the run's first byte past its chunk
        int base = 0;
        for (int s = 0; s < MAX_SPANS; ++s) {
            const int first = __ldg(spans + (blockIdx.x * MAX_SPANS + s) * 2);
            const int n = __ldg(spans + (blockIdx.x * MAX_SPANS + s) * 2 + 1);
            const unsigned char* a = xe + (long long)first * c_in;
            const int skew = (int)(reinterpret_cast<unsigned long long>(a) & (CHUNK - 1));
            span_first[s] = first;
            span_rows[s] = n;
            span_skew[s] = skew;
            span_base[s] = base;
            base += n > 0 ? (skew + n * c_in + CHUNK - 1) / CHUNK : 0;
        }
        span_base[MAX_SPANS] = base;
    }
    __syncthreads();

    for (int r = threadIdx.x; r < live_rows; r += THREADS) {
        const int v = __ldg(tile_rows + r);
        int at = v;
        for (int s = 0; s < MAX_SPANS; ++s) {
            if (v >= span_first[s] && v < span_first[s] + span_rows[s]) {
                at = span_base[s] * CHUNK + span_skew[s] + (v - span_first[s]) * c_in;
            }
        }
        row_at[r] = at;
    }

    const int total = span_base[MAX_SPANS];
    for (int i0 = threadIdx.x; i0 < total; i0 += BATCH * THREADS) {
        uint4 v[BATCH];
        const unsigned char* c[BATCH];
        int span[BATCH];
        unsigned edges = 0;  // bit k: chunk k is read bytewise (it does not lie whole in the expert)
#pragma unroll
        for (int k = 0; k < BATCH; ++k) {  // every whole chunk's load issued before any is staged
            const int i = i0 + k * THREADS;
            int s = 0;
#pragma unroll
            for (int t = 1; t < MAX_SPANS; ++t) s += i >= span_base[t] ? 1 : 0;
            span[k] = s;
            c[k] = xe + (long long)span_first[s] * c_in - span_skew[s] + (long long)(i - span_base[s]) * CHUNK;
            const bool whole = c[k] >= xe && c[k] + CHUNK <= xe_end;
            v[k] = make_uint4(0u, 0u, 0u, 0u);
            if (i < total && whole) v[k] = __ldcs(reinterpret_cast<const uint4*>(c[k]));
            edges |= (i < total && !whole) ? 1u << k : 0u;
        }
        if (edges) {
#pragma unroll
            for (int k = 0; k < BATCH; ++k) {
                if (edges >> k & 1) {
                    const unsigned char* a = xe + (long long)span_first[span[k]] * c_in;
                    v[k] = chunk_bytes(c[k], a, a + (long long)span_rows[span[k]] * c_in);
                }
            }
        }
#pragma unroll
        for (int k = 0; k < BATCH; ++k) {
            if (i0 + k * THREADS < total) stage[i0 + k * THREADS] = v[k];
        }
    }
    __syncthreads();

    const word4* staged = reinterpret_cast<const word4*>(stage);
    for (int u = threadIdx.x; u < TILE_WORDS * 32; u += THREADS) {  // 16-byte words (band b, word kk, p)
        const int b = u >> (kw_shift + 5), kk = (u >> 5) & (kw - 1), p = u & 31;
        if (kk < cw && b * BAND_ROWS < live_rows) {
            const int row = b * BAND_ROWS + p;
            word16 w;
            w.x = staged_word(staged, row_at[row], kk, c_in, col_fill);
            w.y = staged_word(staged, row_at[row + 32], kk, c_in, col_fill);
            w.z = staged_word(staged, row_at[row + 64], kk, c_in, col_fill);
            w.w = staged_word(staged, row_at[row + 96], kk, c_in, col_fill);
            __stcs(out + e * out_words + ((long long)(band0 + b) * cw + kk) * 32 + p, w);
        }
    }
}

#define SWIZZLE_KERNEL(NAME)                                                                                     \
    extern "C" __global__ void __launch_bounds__(THREADS)                                                       \
        NAME(word16* out, const unsigned char* x, const int* rows, int c_in, int cw, int n_bands, int nk,        \
             int kw_shift, int ch_shift, int column_fill, long long in_bytes, long long out_words) {             \
        swizzle_tile(out, x, rows, c_in, cw, n_bands, nk, kw_shift, ch_shift, column_fill, in_bytes, out_words); \
    }

SWIZZLE_KERNEL(fimoe_swizzle)

#define SWIZZLE_SPANS_KERNEL(NAME)                                                                                \
    extern "C" __global__ void __launch_bounds__(THREADS)                                                        \
        NAME(word16* out, const unsigned char* x, const int* rows, const int* spans, int c_in, int cw,           \
             int n_bands, int kw_shift, int column_fill, long long in_bytes, long long out_words) {              \
        swizzle_spans_tile(out, x, rows, spans, c_in, cw, n_bands, kw_shift, column_fill, in_bytes, out_words);   \
    }

SWIZZLE_SPANS_KERNEL(fimoe_swizzle_spans)
