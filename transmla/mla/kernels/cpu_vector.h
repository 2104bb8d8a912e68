/* Vector helpers shared by the CPU kernels (cpu_decode.c, cpu_prefill.c): 16 floats per vector
 * through GCC/Clang vector extensions, no intrinsics (the same source builds for AVX-512, AVX2 or NEON). */
#ifndef TRANSMLA_CPU_VECTOR_H
#define TRANSMLA_CPU_VECTOR_H
#include <math.h>
#include <stddef.h>
#include <string.h>

#define L 16              /* floats per vector */

typedef float vf __attribute__((vector_size(64)));
typedef int vi __attribute__((vector_size(64)));

static inline vf load(const float *p) { vf v; memcpy(&v, p, sizeof v); return v; }
static inline void store(float *p, vf v) { memcpy(p, &v, sizeof v); }
static inline vf splat(float x) { return (vf){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }

static inline float hmax(vf v) {
    float m = v[0];
    for (int i = 1; i < L; i++) m = v[i] > m ? v[i] : m;
    return m;
}

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

static inline float hsum(vf v) {
    float s = 0.f;
    for (int i = 0; i < L; i++) s += v[i];
    return s;
}

/* 2^x for x <= 0 (the argument of a softmax after subtracting the running max): x = n + f,
 * f in [0, 1), 2^f by its degree-6 minimax polynomial (relative error < 2e-7), 2^n by the exponent
 * bits. Below -126 the result is 0 (it would be a denormal). */
static inline vf exp2_neg(vf x) {
    vi dead = x < -126.f;                           /* lanes whose result is 0 */
    x = sel(dead, splat(-1.f), x);
    vi n = __builtin_convertvector(x, vi);         /* truncates toward 0: n >= x for x < 0 */
    vf nf = __builtin_convertvector(n, vf);
    n = n + (nf > x);                               /* floor: a true comparison is -1 */
    nf = __builtin_convertvector(n, vf);
    vf f = x - nf;                                  /* [0, 1) */
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
