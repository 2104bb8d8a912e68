/* AMX helpers shared by the bf16 kernels (cpu_prefill_amx.c, cpu_decode_amx.c): the Linux permission
 * for the tile state, bf16 rounding and the softmax's exp2. Built with -march=native; a CPU without
 * AMX-BF16 / AVX512-BF16 fails the build (#error) and callers keep PyTorch's SDPA. */
#ifndef TRANSMLA_CPU_AMX_H
#define TRANSMLA_CPU_AMX_H
#define _GNU_SOURCE
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#if !defined(__AMX_TILE__) || !defined(__AMX_BF16__) || !defined(__AVX512BF16__)
#error "needs AMX-BF16 and AVX512-BF16"
#endif

typedef uint16_t bf16;

#define PAIRS 512                  /* bf16 in one B tile: 16 pair rows x 16 columns x 2 */
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* Linux hands out AMX state only to processes that ask: 0 when granted (oneDNN asks too). Every AMX
 * library exports it under this one name; cpu_build.CKernel calls it once after loading. */
int mla_amx_permit(void) { return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 0 : -1; }

/* This thread's tile registers 0-7: 16 rows of 64 bytes each; with depth_tail (16) tile 6 is an A operand
 * of depth_tail bf16 per row and tile 7 a B operand of depth_tail / 2 pair rows (a row width that is not a
 * multiple of 32). Released by _tile_release(). */
static inline void configure_tiles(int depth_tail) {
    struct {
        uint8_t palette, start_row, reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int i = 0; i < 8; i++) {
        cfg.colsb[i] = 64;
        cfg.rows[i] = 16;
    }
    if (depth_tail) {
        cfg.colsb[6] = depth_tail * 2;
        cfg.rows[7] = depth_tail / 2;
    }
    _tile_loadconfig(&cfg);
}

/* Round 16 floats to bf16 (to nearest even) into dst. */
static inline void store_bf16(bf16 *dst, __m512 x) { _mm256_storeu_si256((__m256i *)dst, (__m256i)_mm512_cvtneps_pbh(x)); }

/* 2^x for x <= 0 (-inf included): x = n + f, n the nearest integer, 2^f on [-0.5, 0.5] by a degree-4
 * polynomial (fitted here for relative error: 2.6e-6, far below the bf16 rounding of the probabilities
 * it makes), times 2^n by vscalefps, which flushes to 0 below the smallest float (x clamped at -200). */
static inline __m512 exp2_bf(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-200.f));
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(9.570100345e-03f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.591786653e-02f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402474433e-01f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931217909e-01f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.999992847e-01f));
    return _mm512_scalef_ps(p, n);
}

#endif
