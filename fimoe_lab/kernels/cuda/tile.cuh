// What the kernels of this directory share: a block's threads, the words each thread moves, the word types and a
// fill byte repeated over a word (kernels/prebuilt.py reads THREADS and ITEMS as its own, checked by
// tests/test_prebuilt.py).
//
// One kernel per word: 16 bytes (cells and addresses 16-byte aligned), 4 bytes, 1 byte (the swizzle kernel loads
// and stores 16).
#pragma once

#define THREADS 256
#define ITEMS 8

typedef unsigned char word1;
typedef unsigned int word4;
typedef uint4 word16;

// A word of byte b repeated (a fill).
__device__ __forceinline__ void splat(word1& w, unsigned b) { w = (word1)b; }
__device__ __forceinline__ void splat(word4& w, unsigned b) { w = b * 0x01010101u; }
__device__ __forceinline__ void splat(word16& w, unsigned b) { w.x = w.y = w.z = w.w = b * 0x01010101u; }

// A block's dynamic shared memory as an array `name` of T (the host emulation defines its own).
#ifndef DYNAMIC_SHARED
#define DYNAMIC_SHARED(T, name) extern __shared__ T name[]
#endif
