// The prebuilt kernels of fimoe_lab/kernels/cuda compiled for the host (prelude.h), one entry point per
// kernel: emulate_<kernel>(grid x, grid y, threads, the kernel's own parameters).
#include <memory>
#include <thread>
#include <vector>

#include "cluster.cu"
#include "cycles.cu"
#include "gather.cu"
#include "strided.cu"
#include "swizzle.cu"

// separate_blocks: every thread waits for the block's others before the next block (kernels with shared memory)
template <typename Body>
static void run_grid(Body body, unsigned gx, unsigned gy, unsigned threads, bool separate_blocks = false) {
    std::barrier<> bar(threads);
    std::vector<std::thread> pool;
    for (unsigned t = 0; t < threads; ++t) {
        pool.emplace_back([&, t] {
            fimoe_block_barrier = &bar;
            threadIdx = {t, 0, 0};
            blockDim = {threads, 1, 1};
            for (unsigned y = 0; y < gy; ++y) {
                for (unsigned x = 0; x < gx; ++x) {
                    blockIdx = {x, y, 0};
                    body();
                    if (separate_blocks) bar.arrive_and_wait();
                }
            }
        });
    }
    for (auto& th : pool) th.join();
}

#define EMULATE(NAME, W)                                                                                        \
    extern "C" void emulate_##NAME(unsigned gx, unsigned gy, unsigned threads, W* x, W* scratch, const int* dst, \
                                   const int* src, int n_slots, int bm, int bw, int nc, long long cell_words,     \
                                   long long expert_words, long long scratch_words, int save) {                 \
        run_grid([&] { NAME(x, scratch, dst, src, n_slots, bm, bw, nc, cell_words, expert_words, scratch_words, save); }, \
                 gx, gy, threads);                                                                              \
    }

EMULATE(fimoe_cycles_w16, word16)
EMULATE(fimoe_cycles_w4, word4)
EMULATE(fimoe_cycles_w1, word1)

#define EMULATE_GATHER(NAME, W)                                                                                 \
    extern "C" void emulate_##NAME(unsigned gx, unsigned gy, unsigned threads, W* out, const W* x, const int* src, \
                                   const W* fills, int n_out, int bm, int bw, int nc, long long cell_words,       \
                                   long long in_words, long long out_words) {                                   \
        run_grid([&] { NAME(out, x, src, fills, n_out, bm, bw, nc, cell_words, in_words, out_words); }, gx, gy,  \
                 threads);                                                                                      \
    }

EMULATE_GATHER(fimoe_gather_w16, word16)
EMULATE_GATHER(fimoe_gather_w4, word4)
EMULATE_GATHER(fimoe_gather_w1, word1)

#define EMULATE_SWIZZLE(NAME)                                                                                   \
    extern "C" void emulate_##NAME(unsigned gx, unsigned gy, unsigned threads, word16* out, const unsigned char* x, \
                                   const int* rows, int c_in, int cw, int n_bands, int nk, int kw_shift,          \
                                   int ch_shift, int column_fill, long long in_bytes, long long out_words) {     \
        run_grid([&] { NAME(out, x, rows, c_in, cw, n_bands, nk, kw_shift, ch_shift, column_fill, in_bytes,       \
                            out_words); },                                                                      \
                 gx, gy, threads, true);                                                                        \
    }

EMULATE_SWIZZLE(fimoe_swizzle)

#define EMULATE_SWIZZLE_SPANS(NAME)                                                                             \
    extern "C" void emulate_##NAME(unsigned gx, unsigned gy, unsigned threads, word16* out, const unsigned char* x, \
                                   const int* rows, const int* spans, int c_in, int cw, int n_bands, int kw_shift, \
                                   int column_fill, long long in_bytes, long long out_words) {                   \
        run_grid([&] { NAME(out, x, rows, spans, c_in, cw, n_bands, kw_shift, column_fill, in_bytes, out_words); }, \
                 gx, gy, threads, true);                                                                        \
    }

EMULATE_SWIZZLE_SPANS(fimoe_swizzle_spans)

#define EMULATE_STRIDED(NAME, W)                                                                                \
    extern "C" void emulate_##NAME(unsigned gx, unsigned gy, unsigned threads, W* out, const W* x, Form form,    \
                                   int n_words, long long in_words, long long out_words) {                       \
        run_grid([&] { NAME(out, x, form, n_words, in_words, out_words); }, gx, gy, threads);                   \
    }

EMULATE_STRIDED(fimoe_strided_w16, word16)
EMULATE_STRIDED(fimoe_strided_w4, word4)
EMULATE_STRIDED(fimoe_strided_w1, word1)

// The cluster kernels: the `cluster` blocks of one cluster at once, `threads` threads each, clusters one after
// another (each takes its own experts); a block's dynamic shared memory is its own `shared_bytes`.
#define EMULATE_CLUSTER(NAME)                                                                                     \
    extern "C" void emulate_##NAME(unsigned gx, unsigned gy, unsigned threads, unsigned cluster,                  \
                                   unsigned shared_bytes, word16* x, const int* table, int cells, int cw,         \
                                   long long expert_words, int slice, int experts) {                              \
        const unsigned clusters = gx / cluster;                                                                   \
        for (unsigned c = 0; c < clusters; ++c) {                                                                 \
            std::barrier<> whole(cluster * threads);                                                              \
            std::vector<std::unique_ptr<std::barrier<>>> blocks;                                                  \
            for (unsigned r = 0; r < cluster; ++r) blocks.push_back(std::make_unique<std::barrier<>>(threads));   \
            std::vector<std::vector<word16>> shared(cluster, std::vector<word16>((shared_bytes + 15) / 16));     \
            std::vector<std::thread> pool;                                                                        \
            for (unsigned r = 0; r < cluster; ++r) {                                                              \
                for (unsigned t = 0; t < threads; ++t) {                                                          \
                    pool.emplace_back([&, r, t] {                                                                 \
                        fimoe_block_barrier = blocks[r].get();                                                    \
                        fimoe_cluster_barrier = &whole;                                                           \
                        fimoe_cluster_rank = r;                                                                   \
                        fimoe_cluster_id = c;                                                                     \
                        fimoe_cluster_count = clusters;                                                           \
                        fimoe_dynamic_shared = shared[r].data();                                                  \
                        blockIdx = {c * cluster + r, 0, 0};                                                       \
                        threadIdx = {t, 0, 0};                                                                    \
                        blockDim = {threads, 1, 1};                                                               \
                        NAME(x, table, cells, cw, expert_words, slice, experts);                                  \
                    });                                                                                           \
                }                                                                                                 \
            }                                                                                                     \
            for (auto& th : pool) th.join();                                                                      \
        }                                                                                                         \
        (void)gy;                                                                                                 \
    }

EMULATE_CLUSTER(fimoe_cluster_w16)
EMULATE_CLUSTER(fimoe_cluster_scatter_w16)
