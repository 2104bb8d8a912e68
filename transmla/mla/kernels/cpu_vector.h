/* Vector helpers shared by the CPU kernels (cpu_decode.c, cpu_prefill.c): L floats per vector through
 * GCC/Clang vector extensions, no intrinsics: 16 where the CPU has AVX-512 (32 registers of 16 floats),
 * else 8 (AVX2's 16 registers of 8 floats; NEON runs them as pairs). Wider vectors than the registers
 * are lowered through the stack (kernels/NOTES.md), so the width follows the target. VREGS: how many
 * vectors the register file holds, for the kernels' register tiles. */
#ifndef TRANSMLA_CPU_VECTOR_H
#define TRANSMLA_CPU_VECTOR_H
#include <math.h>
#include <stddef.h>
#include <string.h>

#if defined(__AVX512F__)
#define L 16              /* floats per vector */
#define VREGS 32
#define LANES {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}
#else
#define L 8
#define VREGS 16
#define LANES {0, 1, 2, 3, 4, 5, 6, 7}
#endif

typedef float vf __attribute__((vector_size(4 * L)));
typedef int vi __attribute__((vector_size(4 * L)));

static inline vf load(const float *p) { vf v; memcpy(&v, p, sizeof v); return v; }
static inline void store(float *p, vf v) { memcpy(p, &v, sizeof v); }
static inline vf splat(float x) { return x - (vf){}; }

/* mask ? a : b, lane by lane (C has no vector ?:) */
static inline vf sel(vi mask, vf a, vf b) {
    vi ia, ib;
    memcpy(&ia, &a, sizeof ia);
    memcpy(&ib, &b, sizeof ib);
    vi r = (mask & ia) | (~mask & ib);
    vf out;
    memcpy(&out, &r, sizeof out);
    return out;
}

/* Horizontal max and sum by halving: lanes swapped in groups of L/2, ..., 2, 1 (log2 L steps instead of
 * L - 1 dependent scalar ones). */
#if L == 16
#define HALVES(v, op)                                                                                  \
    v = op(v, __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));  \
    v = op(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));  \
    v = op(v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));  \
    v = op(v, __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14))
#else
#define HALVES(v, op)                                                    \
    v = op(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3));  \
    v = op(v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5));  \
    v = op(v, __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6))
#endif

static inline vf vmax(vf a, vf b) { return sel(a > b, a, b); }
static inline vf vadd(vf a, vf b) { return a + b; }

static inline float hmax(vf v) {
    HALVES(v, vmax);
    return v[0];
}

static inline float hsum(vf v) {
    HALVES(v, vadd);
    return v[0];
}

/* 2^x for x <= 0 (the argument of a softmax after subtracting the running max): x = n + f with n the
 * nearest integer (rounded by adding and subtracting 1.5 * 2^23) and f in [-0.5, 0.5], 2^f by the Cephes
 * exp2f polynomial for that interval (relative error < 2e-9 in exact arithmetic, so the result is good
 * to fp32 rounding), 2^n by the exponent bits. Below -126 the result is 0 (it would be a denormal). */
static inline vf exp2_neg(vf x) {
    vi dead = x < -126.f;                           /* lanes whose result is 0 (-inf included) */
    x = sel(dead, splat(-1.f), x);
    vf nf = (x + 12582912.f) - 12582912.f;          /* round to nearest: exact for |x| < 2^22 */
    vi n = __builtin_convertvector(nf, vi);
    vf f = x - nf;                                  /* [-0.5, 0.5] */
    vf p = splat(1.535336188319500e-4f);
    p = p * f + 1.339887440266574e-3f;
    p = p * f + 9.618437357674640e-3f;
    p = p * f + 5.550332471162809e-2f;
    p = p * f + 2.402264791363012e-1f;
    p = p * f + 6.931472028550421e-1f;
    p = p * f + 1.0f;
    vi bits;
    memcpy(&bits, &p, sizeof bits);
    bits = bits + (n << 23);
    vf r;
    memcpy(&r, &bits, sizeof r);
    return sel(dead, splat(0.f), r);
}

#endif
