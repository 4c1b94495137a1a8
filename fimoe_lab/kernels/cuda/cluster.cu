// In-place cell permutations by thread-block clusters that hold whole experts on chip (sm_90 and newer), built
// ahead of time.
//
// A map permutes the cells of every expert the same way: x[k] = x[src[k]] for every cell k of an expert (cells of
// `cw` 16-byte words), i.e. x[dst[j]] = x[j] with dst the inverse of src. A cluster of C blocks takes one expert at a
// time (experts cluster, cluster + clusters, ...); block r owns the expert's cells [r*S, min((r+1)*S, cells)):
//   fimoe_cluster_scatter_w16 (SCATTER_THREADS threads, shared memory only): block r loads its own input cells, one
//     contiguous run, meets the cluster at its barrier, then stores each cell j at dst[j];
//   fimoe_cluster_w16 (CLUSTER_THREADS threads, for experts shared memory alone does not hold): block r loads the
//     sources src[k] of its output cells, the first CLUSTER_REGISTER_WORDS * CLUSTER_THREADS words into registers and
//     the rest into shared memory, meets the cluster, then stores its cells in order, one contiguous run.
// At the barrier every byte of the expert has been read by some block, so the stores may overwrite any of them. Each
// byte crosses memory once. A block loads its next expert while its cluster's other blocks may still store this one
// (another expert's bytes): one barrier an expert.
//
// Grid: x = clusters * C blocks, each with the words it stages in dynamic shared memory (at least one). Where the GPU
// has no clusters (before sm_90) the kernels do nothing; kernels/prebuilt.py launches them only on sm_90 and newer.

#include "tile.cuh"

#define CLUSTER_THREADS 512
#define CLUSTER_REGISTER_WORDS 16
#define SCATTER_THREADS 1024

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
#define FIMOE_CLUSTERS 1
#endif

#if defined(FIMOE_CLUSTERS) && !defined(FIMOE_HOST_CLUSTERS)  // the host emulation brings its own (tests/cuda_host)
__device__ __forceinline__ unsigned cluster_rank() {
    unsigned r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}
__device__ __forceinline__ unsigned cluster_id() {
    unsigned r;
    asm volatile("mov.u32 %0, %%clusterid.x;" : "=r"(r));
    return r;
}
__device__ __forceinline__ unsigned cluster_count() {
    unsigned r;
    asm volatile("mov.u32 %0, %%nclusterid.x;" : "=r"(r));
    return r;
}
// Every thread of every block of the cluster arrives; the loads before are visible to the stores after.
__device__ __forceinline__ void cluster_wait() {
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
// One 16-byte word from global to shared memory without passing through registers, then the wait for all of them.
__device__ __forceinline__ void load_async(word16* to, const word16* from) {
    const unsigned at = (unsigned)__cvta_generic_to_shared(to);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(at), "l"(from) : "memory");
}
__device__ __forceinline__ void loads_done() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }
#endif

// Word i of block r's cells (i < (k1 - k0) * cw): at cell table[k0 + i / cw] (src or dst), or in the block's run.
__device__ __forceinline__ long long cell_word(const int* __restrict__ table, int k0, int cw, int i) {
    const int q = i / cw;
    return (long long)__ldg(table + k0 + q) * cw + (i - q * cw);
}

// One expert at a time as the head of this file says: SCATTER loads the block's own run and stores by dst (table),
// else loads by src (table) and stores the block's run; HELD words a thread in registers, the rest staged.
template <bool SCATTER, int HELD>
__device__ __forceinline__ void permute_by_clusters(word16* x, const int* __restrict__ table, int cells, int cw,
                                                    long long expert_words, int slice, int experts) {
#ifdef FIMOE_CLUSTERS
    DYNAMIC_SHARED(word16, staged);
    const int k0 = (int)cluster_rank() * slice;
    const int n = max(min(k0 + slice, cells) - k0, 0) * cw;  // this block's words
    const int in_registers = min(n, HELD * (int)blockDim.x);
    for (int e = (int)cluster_id(); e < experts; e += (int)cluster_count()) {
        word16* xe = x + (long long)e * expert_words;
        word16* run = xe + (long long)k0 * cw;
        word16 held[HELD > 0 ? HELD : 1];
#pragma unroll
        for (int j = 0; j < HELD; ++j) {
            const int i = (int)threadIdx.x + j * (int)blockDim.x;
            if (i < in_registers) held[j] = __ldcs(SCATTER ? run + i : xe + cell_word(table, k0, cw, i));
        }
        for (int i = in_registers + (int)threadIdx.x; i < n; i += (int)blockDim.x)
            load_async(staged + (i - in_registers), SCATTER ? run + i : xe + cell_word(table, k0, cw, i));
        loads_done();
        cluster_wait();  // every block of the cluster holds its cells of expert e: stores may overwrite any of them
#pragma unroll
        for (int j = 0; j < HELD; ++j) {
            const int i = (int)threadIdx.x + j * (int)blockDim.x;
            if (i < in_registers) __stcs(SCATTER ? xe + cell_word(table, k0, cw, i) : run + i, held[j]);
        }
        for (int i = in_registers + (int)threadIdx.x; i < n; i += (int)blockDim.x)
            __stcs(SCATTER ? xe + cell_word(table, k0, cw, i) : run + i, staged[i - in_registers]);
        __syncthreads();  // the staged words are loaded again for the next expert
    }
#endif
}

extern "C" __global__ void __launch_bounds__(CLUSTER_THREADS, 1)
    fimoe_cluster_w16(word16* x, const int* __restrict__ src, int cells, int cw, long long expert_words, int slice,
                      int experts) {
    permute_by_clusters<false, CLUSTER_REGISTER_WORDS>(x, src, cells, cw, expert_words, slice, experts);
}

extern "C" __global__ void __launch_bounds__(SCATTER_THREADS, 1)
    fimoe_cluster_scatter_w16(word16* x, const int* __restrict__ dst, int cells, int cw, long long expert_words,
                              int slice, int experts) {
    permute_by_clusters<true, 0>(x, dst, cells, cw, expert_words, slice, experts);
}
