// In-place cell permutations by thread-block clusters that hold whole experts on chip (sm_90 and newer), built
// ahead of time.
//
// A map permutes the cells of every expert the same way: x[k] = x[src[k]] for every cell k of an expert (cells of
// `cw` 16-byte words). A cluster of C blocks takes one expert at a time (experts cluster, cluster + clusters, ...).
// Block r of the cluster owns the expert's output cells [r*S, min((r+1)*S, cells)): it loads their sources, the
// first R*THREADS words into registers and the rest into dynamic shared memory, then the cluster meets at its
// barrier: by then every byte of the expert has been read by some block, so each block stores its cells, in order,
// over the expert. Each byte crosses memory once; the loads are whole cells from anywhere in the expert, the stores
// one contiguous run a block. A block loads the next expert while its cluster's other blocks may still store this one
// (another expert's bytes): one barrier an expert.
//
// Grid: x = clusters * C blocks of THREADS threads, each with (S * cw - R * THREADS) words of shared memory (at least
// one). Where the GPU has no clusters (before sm_90) the kernel does nothing; kernels/prebuilt.py launches it only on
// sm_90 and newer.

#include "tile.cuh"

#define CLUSTER_THREADS 512
#define CLUSTER_REGISTER_WORDS 16

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

extern "C" __global__ void __launch_bounds__(CLUSTER_THREADS, 1)
    fimoe_cluster_w16(word16* x, const int* __restrict__ src, int cells, int cw, long long expert_words, int slice,
                      int experts) {
#ifdef FIMOE_CLUSTERS
    DYNAMIC_SHARED(word16, staged);
    const int k0 = (int)cluster_rank() * slice;
    const int n = max(min(k0 + slice, cells) - k0, 0) * cw;  // this block's words
    const int in_registers = min(n, CLUSTER_REGISTER_WORDS * (int)blockDim.x);
    for (int e = (int)cluster_id(); e < experts; e += (int)cluster_count()) {
        word16* xe = x + (long long)e * expert_words;
        word16 held[CLUSTER_REGISTER_WORDS];
#pragma unroll
        for (int j = 0; j < CLUSTER_REGISTER_WORDS; ++j) {
            const int i = (int)threadIdx.x + j * (int)blockDim.x;
            if (i < in_registers) {
                const int q = i / cw;
                held[j] = __ldcs(xe + (long long)__ldg(src + k0 + q) * cw + (i - q * cw));
            }
        }
        for (int i = in_registers + (int)threadIdx.x; i < n; i += (int)blockDim.x) {
            const int q = i / cw;
            load_async(staged + (i - in_registers), xe + (long long)__ldg(src + k0 + q) * cw + (i - q * cw));
        }
        loads_done();
        cluster_wait();  // every block of the cluster holds its cells of expert e: stores may overwrite any of them
        word16* out = xe + (long long)k0 * cw;
#pragma unroll
        for (int j = 0; j < CLUSTER_REGISTER_WORDS; ++j) {
            const int i = (int)threadIdx.x + j * (int)blockDim.x;
            if (i < in_registers) __stcs(out + i, held[j]);
        }
        for (int i = in_registers + (int)threadIdx.x; i < n; i += (int)blockDim.x) out[i] = staged[i - in_registers];
        __syncthreads();  // the staged words are loaded again for the next expert
    }
#endif
}
