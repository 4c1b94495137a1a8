// Out-of-place maps of the strided form (fimoe_lab/kernels/compiled.py, Strided), built ahead of time: one
// launch per map, with the form's digits as data instead of a source index per cell.
//
// Per expert, output word w (0 <= w < n_words) has mixed-radix digits over the form's shape, the word within its
// cell the innermost; inside the box (every digit below its live extent) it is input word offset + sum(digit[d] *
// stride[d]) (strides in words, possibly negative), outside it the fill word. The form is an int64 table (layout
// below); a block copies it to shared memory, and a digit is w mod radix after w / radix by a multiply
// (Granlund-Montgomery: q = (umulhi(w, magic) + w) >> shift, exact for w < 2^31).
//
// A block moves THREADS * ITEMS consecutive output words of one expert, consecutive threads consecutive words (whole
// lines stored, a cell's words loaded together), every thread loading its ITEMS words into registers before storing
// any, so ITEMS loads are in flight per thread. Grid: x = chunk of words, y = expert of the launch.

#include "tile.cuh"

// The form table: the number of digits, the source word of all digits 0, the fill byte (-1: every word is in the
// box), then per digit, innermost first: radix, live, stride, magic, shift; FORM_WORDS entries in all (the digits
// past the form's unread).
#define MAX_DIGITS 8
#define FORM_DIGITS 0
#define FORM_OFFSET 1
#define FORM_FILL 2
#define FORM_HEAD 3
#define FORM_PER_DIGIT 5
#define FORM_WORDS 43

struct Form {
    long long w[FORM_WORDS];
};

template <typename W>
__device__ __forceinline__ void strided_words(W* __restrict__ out, const W* __restrict__ x, const Form& f, int n_words,
                                              long long in_words, long long out_words) {
    const int nd = (int)f.w[FORM_DIGITS];
    const long long e = blockIdx.y;
    const W* xe = x + e * in_words;
    W* oe = out + e * out_words;
    W fill;
    splat(fill, (unsigned)(f.w[FORM_FILL] & 0xff));
    const int base = (int)blockIdx.x * (THREADS * ITEMS) + (int)threadIdx.x;
    W v[ITEMS];
    int to[ITEMS];  // the output word of item k, or -1 past the expert
#pragma unroll
    for (int k = 0; k < ITEMS; ++k) {
        const int word = base + k * THREADS;
        to[k] = -1;
        if (word < n_words) {
            unsigned c = (unsigned)word;
            long long s = f.w[FORM_OFFSET];
            bool live = true;
#pragma unroll
            for (int d = 0; d < MAX_DIGITS; ++d) {
                if (d < nd) {
                    const long long* g = f.w + FORM_HEAD + FORM_PER_DIGIT * d;
                    const unsigned q = (__umulhi(c, (unsigned)g[3]) + c) >> (unsigned)g[4];
                    const unsigned digit = c - q * (unsigned)g[0];
                    live = live && digit < (unsigned)g[1];
                    s += (long long)digit * g[2];
                    c = q;
                }
            }
            v[k] = live ? __ldcs(xe + s) : fill;
            to[k] = word;
        }
    }
#pragma unroll
    for (int k = 0; k < ITEMS; ++k) {
        if (to[k] >= 0) __stcs(oe + to[k], v[k]);
    }
}

#define STRIDED_KERNEL(NAME, W)                                                                                  \
    extern "C" __global__ void __launch_bounds__(THREADS)                                                      \
        NAME(W* out, const W* x, const __grid_constant__ Form form, int n_words, long long in_words,            \
             long long out_words) {                                                                             \
        strided_words<W>(out, x, form, n_words, in_words, out_words);                                           \
    }

STRIDED_KERNEL(fimoe_strided_w16, word16)
STRIDED_KERNEL(fimoe_strided_w4, word4)
STRIDED_KERNEL(fimoe_strided_w1, word1)
