// Host emulation of the CUDA built-ins the prebuilt kernels use, so that their source compiles with g++ and
// runs on CPU memory (tests/test_prebuilt.py): every thread of a block is an OS thread, __syncthreads is a
// barrier of the block's threads, and blocks run one after another on those threads (a thread starts the
// next block as soon as it leaves this one, so neighbouring blocks overlap as they may on a GPU).
#pragma once
#include <algorithm>
#include <barrier>

using std::max;
using std::min;

struct fimoe_dim3 {
    unsigned x, y, z;
};
inline thread_local fimoe_dim3 blockIdx, threadIdx, blockDim;
inline thread_local std::barrier<>* fimoe_block_barrier;

#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __restrict__ __restrict
#define __grid_constant__
// A block's shared memory: one array for all of its threads. Blocks of a kernel that uses it run one after
// another (emulate.cpp: a barrier between blocks), as each block has its own on a GPU.
#define __shared__ static

inline void __syncthreads() { fimoe_block_barrier->arrive_and_wait(); }

// CUDA's 16-byte vector word and the streaming (evict-first) load and store: on the host, a plain load and store.
struct alignas(16) uint4 {
    unsigned int x, y, z, w;
};
// The high 32 bits of a 32 x 32-bit product.
inline unsigned __umulhi(unsigned a, unsigned b) { return (unsigned)(((unsigned long long)a * b) >> 32); }
template <typename T>
inline T __ldcs(const T* p) {
    return *p;
}
template <typename T>
inline void __stcs(T* p, T v) {
    *p = v;
}
// The read-only cached load: a plain load.
template <typename T>
inline T __ldg(const T* p) {
    return *p;
}
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }
// The low 32 bits of (hi:lo) >> (shift % 32).
inline unsigned __funnelshift_r(unsigned lo, unsigned hi, unsigned shift) {
    return (unsigned)((((unsigned long long)hi << 32) | lo) >> (shift & 31));
}
// A warp's shuffle down, for a call every thread of the block makes (the kernels call it in block-uniform loops):
// each thread posts its value, the block meets, each reads lane + delta of its own warp (its own value past the
// warp's last lane, as on a GPU), and the block meets again before the slots are reused.
inline unsigned fimoe_shuffle_slots[1024];
inline unsigned __shfl_down_sync(unsigned, unsigned v, unsigned delta) {
    const unsigned t = threadIdx.x;
    fimoe_shuffle_slots[t] = v;
    __syncthreads();
    const unsigned got = (t % 32) + delta < 32 ? fimoe_shuffle_slots[t + delta] : v;
    __syncthreads();
    return got;
}

// Clusters (cluster.cu): emulate.cpp runs the blocks of one cluster at once, each on threads of its own, and
// clusters one after another; a block's rank, its cluster and the cluster count are the thread's, the cluster's
// barrier holds every thread of its blocks, and each block has its own dynamic shared memory.
#define FIMOE_HOST_CLUSTERS 1
inline thread_local unsigned fimoe_cluster_rank, fimoe_cluster_id, fimoe_cluster_count;
inline thread_local std::barrier<>* fimoe_cluster_barrier;
inline thread_local void* fimoe_dynamic_shared;
inline unsigned cluster_rank() { return fimoe_cluster_rank; }
inline unsigned cluster_id() { return fimoe_cluster_id; }
inline unsigned cluster_count() { return fimoe_cluster_count; }
inline void cluster_wait() { fimoe_cluster_barrier->arrive_and_wait(); }
inline void load_async(uint4* to, const uint4* from) { *to = *from; }
inline void loads_done() {}
#define DYNAMIC_SHARED(T, name) T* name = (T*)fimoe_dynamic_shared
