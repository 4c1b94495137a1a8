// What the kernels of this directory share: a block's threads, the words each thread moves, and the word
// types (kernels/prebuilt.py reads THREADS and ITEMS as its own, checked by tests/test_prebuilt.py).
//
// One kernel per word: 16 bytes (cells and addresses 16-byte aligned), 4 bytes, 1 byte (the swizzle kernel loads
// 4, 2 or 1 byte and stores 16).
#pragma once

#define THREADS 256
#define ITEMS 8

typedef unsigned char word1;
typedef unsigned short word2;
typedef unsigned int word4;
typedef uint4 word16;
