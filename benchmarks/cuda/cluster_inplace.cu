// In place by thread-block clusters that hold whole experts on chip: the kernels of benchmarks/probe_cluster_inplace.py.
//
// Every expert's cells are permuted the same way (x[k] = x[src[k]], cells of `cw` words). A cluster of C blocks takes
// one expert at a time (its cluster id, then every `clusters` on). Block r of the cluster owns cells [r*S, (r+1)*S):
//   gather:  it loads the sources x[src[k]] of its output cells (scattered loads), the cluster meets at its barrier
//            (every byte of the expert is then on chip), and it stores its cells in order (one contiguous run);
//   scatter: it loads its own input cells (one contiguous run), the cluster meets, and it stores each cell k at
//            x[dst[k]] (scattered stores; dst is the inverse permutation).
// Words of 16 bytes (R of them a thread held in registers, the rest staged in dynamic shared memory through
// cp.async) or of 4 bytes (shared memory only). One barrier an expert: a block loads its next expert while the
// cluster's other blocks may still store this one. sm_90 and newer. Built by the probe's docstring command.
#include <cstdint>
struct __align__(16) w16 { unsigned a, b, c, d; };

__device__ __forceinline__ unsigned cl_rank() { unsigned r; asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r)); return r; }
__device__ __forceinline__ unsigned cl_id() { unsigned r; asm volatile("mov.u32 %0, %%clusterid.x;" : "=r"(r)); return r; }
__device__ __forceinline__ unsigned cl_count() { unsigned r; asm volatile("mov.u32 %0, %%nclusterid.x;" : "=r"(r)); return r; }
__device__ __forceinline__ void cl_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void cp16(void* s, const void* g) {
    unsigned a = (unsigned)__cvta_generic_to_shared(s);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(a), "l"(g) : "memory");
}
__device__ __forceinline__ void cp4(void* s, const void* g) {
    unsigned a = (unsigned)__cvta_generic_to_shared(s);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(a), "l"(g) : "memory");
}
__device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }
// 4-byte-word variant (scale maps): smem only, no registers
template <bool GATHER>
__device__ __forceinline__ void body4(unsigned* x, const int* __restrict__ tab, int cells, int cw, long long ew, int slice,
                                      int experts, int stcs) {
    extern __shared__ unsigned buf4[];
    const int k0 = (int)cl_rank() * slice;
    const int k1 = min(k0 + slice, cells);
    const int n = max(k1 - k0, 0) * cw;
    for (int e = (int)cl_id(); e < experts; e += (int)cl_count()) {
        unsigned* xe = x + (long long)e * ew;
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
            const int q = i / cw;
            const int j = i - q * cw;
            if (GATHER) cp4(buf4 + i, xe + (long long)__ldg(tab + k0 + q) * cw + j);
            else cp4(buf4 + i, xe + (long long)k0 * cw + i);
        }
        cp_wait();
        cl_sync();
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
            unsigned* o;
            if (GATHER) o = xe + (long long)k0 * cw + i;
            else { const int q = i / cw; o = xe + (long long)__ldg(tab + k0 + q) * cw + (i - q * cw); }
            if (stcs) __stcs(o, buf4[i]); else *o = buf4[i];
        }
        __syncthreads();
    }
}

template <bool GATHER, int CWS, int R>  // CWS: log2 of 16-byte words per cell, or -1 for any; R: words a thread holds in registers
__device__ __forceinline__ void body(w16* x, const int* __restrict__ tab, int cells, int cw, long long ew, int slice,
                                     int experts, int stcs) {
    extern __shared__ w16 buf[];
    const int k0 = (int)cl_rank() * slice;
    const int k1 = min(k0 + slice, cells);
    const int n = max(k1 - k0, 0) * cw;
    const int nr = min(n, R * (int)blockDim.x);  // words [0, nr) in registers, [nr, n) in shared memory
    for (int e = (int)cl_id(); e < experts; e += (int)cl_count()) {
        w16* xe = x + (long long)e * ew;
        int4 r[R > 0 ? R : 1];
#pragma unroll
        for (int j = 0; j < R; ++j) {
            const int i = threadIdx.x + j * blockDim.x;
            if (i < nr) {
                if (GATHER) {
                    const int q = CWS >= 0 ? (i >> CWS) : i / cw;
                    r[j] = __ldcg((const int4*)(xe + (long long)__ldg(tab + k0 + q) * cw + (i - q * cw)));
                } else {
                    r[j] = __ldcg((const int4*)(xe + (long long)k0 * cw + i));
                }
            }
        }
        if (GATHER) {
            for (int i = nr + threadIdx.x; i < n; i += blockDim.x) {
                const int q = CWS >= 0 ? (i >> CWS) : i / cw;
                const int j = i - q * cw;
                cp16(buf + (i - nr), xe + (long long)__ldg(tab + k0 + q) * cw + j);
            }
        } else {
            const w16* in = xe + (long long)k0 * cw;
            for (int i = nr + threadIdx.x; i < n; i += blockDim.x) cp16(buf + (i - nr), in + i);
        }
        cp_wait();
        cl_sync();  // every block of the cluster has its cells of expert e on chip: stores may overwrite any of them
#pragma unroll
        for (int j = 0; j < R; ++j) {
            const int i = threadIdx.x + j * blockDim.x;
            if (i < nr) {
                int4* o;
                if (GATHER) {
                    o = (int4*)(xe + (long long)k0 * cw + i);
                } else {
                    const int q = CWS >= 0 ? (i >> CWS) : i / cw;
                    o = (int4*)(xe + (long long)__ldg(tab + k0 + q) * cw + (i - q * cw));
                }
                if (stcs) __stcs(o, r[j]); else *o = r[j];
            }
        }
        if (GATHER) {
            w16* out = xe + (long long)k0 * cw;
            if (stcs) for (int i = nr + threadIdx.x; i < n; i += blockDim.x) __stcs((int4*)(out + i), *(int4*)(buf + i - nr));
            else for (int i = nr + threadIdx.x; i < n; i += blockDim.x) out[i] = buf[i - nr];
        } else {
            for (int i = nr + threadIdx.x; i < n; i += blockDim.x) {
                const int q = CWS >= 0 ? (i >> CWS) : i / cw;
                const int j = i - q * cw;
                w16* o = xe + (long long)__ldg(tab + k0 + q) * cw + j;
                if (stcs) __stcs((int4*)o, *(int4*)(buf + i - nr)); else *o = buf[i - nr];
            }
        }
        __syncthreads();  // buf is loaded again for the next expert
    }
}

#define K(NAME, G, S, R, T) \
    extern "C" __global__ void __launch_bounds__(T, 1) NAME(w16* x, const int* tab, int cells, int cw, long long ew, \
        int slice, int experts, int stcs) { body<G, S, R>(x, tab, cells, cw, ew, slice, experts, stcs); }
K(clu_gather_any, true, -1, 0, 1024)
K(clu_gather_c8, true, 3, 0, 1024)
K(clu_scatter_any, false, -1, 0, 1024)
K(clu_scatter_c8, false, 3, 0, 1024)
K(clu_gather_any_r16, true, -1, 16, 512)
K(clu_gather_c8_r16, true, 3, 16, 512)
K(clu_scatter_any_r16, false, -1, 16, 512)
K(clu_scatter_c8_r16, false, 3, 16, 512)

extern "C" __global__ void __launch_bounds__(1024, 1) clu_gather_w4(unsigned* x, const int* tab, int cells, int cw,
    long long ew, int slice, int experts, int stcs) { body4<true>(x, tab, cells, cw, ew, slice, experts, stcs); }
extern "C" __global__ void __launch_bounds__(1024, 1) clu_scatter_w4(unsigned* x, const int* tab, int cells, int cw,
    long long ew, int slice, int experts, int stcs) { body4<false>(x, tab, cells, cw, ew, slice, experts, stcs); }

// Pipelined scatter (a persistent grid: each cluster takes experts e, e + clusters, ...): right after a thread stores
// word i of expert e from shared memory it loads word i of its next expert into the same slot (cp.async), so a
// multiprocessor reads the next expert while it writes this one; the cluster meets once an expert, after its loads.
// A slot is read into a register before its store is issued and only then loaded again, by the same thread.
template <int CWS>
__device__ __forceinline__ void body_pipe(w16* x, const int* __restrict__ tab, int cells, int cw, long long ew,
                                          int slice, int experts, int stcs) {
    extern __shared__ w16 buf[];
    const int k0 = (int)cl_rank() * slice;
    const int n = max(min(k0 + slice, cells) - k0, 0) * cw;
    const int step = (int)cl_count();
    int e = (int)cl_id();
    if (e < experts) {
        const w16* in = x + (long long)e * ew + (long long)k0 * cw;
        for (int i = threadIdx.x; i < n; i += blockDim.x) cp16(buf + i, in + i);
    }
    for (; e < experts; e += step) {
        cp_wait();
        cl_sync();  // every block holds its run of expert e
        w16* xe = x + (long long)e * ew;
        const bool more = e + step < experts;
        const w16* next = x + (long long)(e + step) * ew + (long long)k0 * cw;
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
            const int q = CWS >= 0 ? (i >> CWS) : i / cw;
            int4* o = (int4*)(xe + (long long)__ldg(tab + k0 + q) * cw + (i - q * cw));
            const int4 v = *(const int4*)(buf + i);
            if (stcs) __stcs(o, v); else *o = v;
            if (more) cp16(buf + i, next + i);
        }
    }
}
extern "C" __global__ void __launch_bounds__(1024, 1) clu_pipe_any(w16* x, const int* tab, int cells, int cw,
    long long ew, int slice, int experts, int stcs) { body_pipe<-1>(x, tab, cells, cw, ew, slice, experts, stcs); }
extern "C" __global__ void __launch_bounds__(1024, 1) clu_pipe_c8(w16* x, const int* tab, int cells, int cw,
    long long ew, int slice, int experts, int stcs) { body_pipe<3>(x, tab, cells, cw, ew, slice, experts, stcs); }

// Pipelined scatter with a spill: a block's first `in_shared` words of its run stay in shared memory as above, the
// rest in its own region of a global scratch (block b: spill + b * (slice * cw - in_shared) words; small enough to
// stay in L2), so an expert larger than a cluster's shared memory, or a block small enough for two a multiprocessor,
// still crosses device memory once. A spilled word goes through a register: the thread reads the scratch word, stores
// it, then loads its next expert's word into the same scratch word.
template <int CWS>
__device__ __forceinline__ void body_spill(w16* x, const int* __restrict__ tab, int cells, int cw, long long ew,
                                           int slice, int experts, int stcs, w16* spill, int in_shared) {
    extern __shared__ w16 buf[];
    const int k0 = (int)cl_rank() * slice;
    const int n = max(min(k0 + slice, cells) - k0, 0) * cw;
    const int ns = min(n, in_shared);
    int4* mine = (int4*)(spill + (long long)blockIdx.x * max(slice * cw - in_shared, 0));
    const int step = (int)cl_count();
    int e = (int)cl_id();
    if (e < experts) {
        const w16* in = x + (long long)e * ew + (long long)k0 * cw;
        for (int i = threadIdx.x; i < ns; i += blockDim.x) cp16(buf + i, in + i);
#pragma unroll 4
        for (int i = ns + threadIdx.x; i < n; i += blockDim.x) mine[i - ns] = __ldcs((const int4*)(in + i));
    }
    for (; e < experts; e += step) {
        cp_wait();
        cl_sync();  // every block holds its run of expert e (shared memory and scratch)
        w16* xe = x + (long long)e * ew;
        const bool more = e + step < experts;
        const w16* next = x + (long long)(e + step) * ew + (long long)k0 * cw;
        for (int i = threadIdx.x; i < ns; i += blockDim.x) {
            const int q = CWS >= 0 ? (i >> CWS) : i / cw;
            int4* o = (int4*)(xe + (long long)__ldg(tab + k0 + q) * cw + (i - q * cw));
            const int4 v = *(const int4*)(buf + i);
            if (stcs) __stcs(o, v); else *o = v;
            if (more) cp16(buf + i, next + i);
        }
#pragma unroll 4
        for (int i = ns + threadIdx.x; i < n; i += blockDim.x) {
            const int q = CWS >= 0 ? (i >> CWS) : i / cw;
            int4* o = (int4*)(xe + (long long)__ldg(tab + k0 + q) * cw + (i - q * cw));
            const int4 v = __ldcg(mine + (i - ns));
            if (stcs) __stcs(o, v); else *o = v;
            if (more) mine[i - ns] = __ldcs((const int4*)(next + i));
        }
    }
}
extern "C" __global__ void __launch_bounds__(1024, 1) clu_spill_any(w16* x, const int* tab, int cells, int cw,
    long long ew, int slice, int experts, int stcs, w16* spill, int in_shared) {
    body_spill<-1>(x, tab, cells, cw, ew, slice, experts, stcs, spill, in_shared);
}
extern "C" __global__ void __launch_bounds__(1024, 1) clu_spill_c8(w16* x, const int* tab, int cells, int cw,
    long long ew, int slice, int experts, int stcs, w16* spill, int in_shared) {
    body_spill<3>(x, tab, cells, cw, ew, slice, experts, stcs, spill, in_shared);
}
