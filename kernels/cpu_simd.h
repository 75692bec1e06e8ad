/* The vector helpers both CPU kernels share: 16-float vectors in GCC's vector extensions
   (lowered per target_clones clone to AVX-512, AVX2 or SSE), loads and stores that allow
   any alignment, a shuffle-tree horizontal sum and max, a lane select and a vector e^x. */
#ifndef KVROUTE_CPU_SIMD_H
#define KVROUTE_CPU_SIMD_H

#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define KV_CLONES __attribute__((target_clones("avx512f", "arch=haswell", "default")))
#else
#define KV_CLONES
#endif

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));
#define INLINE static inline __attribute__((always_inline))

INLINE v16 load16(const float *p) {
    v16 x;
    memcpy(&x, p, sizeof x);
    return x;
}

INLINE void store16(float *p, v16 x) { memcpy(p, &x, sizeof x); }

INLINE float hsum16(v16 x) {
    v8 a = __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7) +
           __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15);
    v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
    return (b[0] + b[2]) + (b[1] + b[3]);
}

INLINE float hmax16(v16 x) {
    typedef int32_t v8i __attribute__((vector_size(32)));
    typedef int32_t v4i __attribute__((vector_size(16)));
    v8 a = __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7);
    v8 b = __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15);
    v8i ga = a > b;
    a = (v8)(((v8i)a & ga) | ((v8i)b & ~ga));
    v4 c = __builtin_shufflevector(a, a, 0, 1, 2, 3), e = __builtin_shufflevector(a, a, 4, 5, 6, 7);
    v4i gc = c > e;
    c = (v4)(((v4i)c & gc) | ((v4i)e & ~gc));
    const float m0 = c[0] > c[1] ? c[0] : c[1], m1 = c[2] > c[3] ? c[2] : c[3];
    return m0 > m1 ? m0 : m1;
}

INLINE v16 select16(v16i mask, v16 a, v16 b) {
    return (v16)(((v16i)a & mask) | ((v16i)b & ~mask));
}

/* e^x for 16 lanes, Cephes' expf scheme: x = n ln2 + r (ln2 split in two), a degree-7
   polynomial for e^r, 2^n in the exponent bits; within 2 ulp of expf. Clamped to the
   float range; lanes below -87.3 give 0. */
INLINE v16 exp16(v16 x) {
    const v16 lo = (v16){0} - 87.3f, hi = (v16){0} + 88.3f;
    v16i under = x < lo;
    x = select16(under, lo, x);
    x = select16(x > hi, hi, x);
    v16 fx = x * 1.44269504088896341f + 0.5f;
    v16i n = __builtin_convertvector(fx, v16i);
    n = n + (__builtin_convertvector(n, v16) > fx); /* floor, not truncation */
    v16 nf = __builtin_convertvector(n, v16);
    v16 r = x - nf * 0.693359375f - nf * -2.12194440e-4f;
    v16 p = 1.9875691500e-4f * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.0f;
    v16 out = p * (v16)((n + 127) << 23);
    return (v16)((v16i)out & ~under);
}

#endif
