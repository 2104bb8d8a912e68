/* Absorbed MLA decode on the CPU, bf16, on AMX tiles: the contract of cpu_decode.c (one query token
 * per sequence, no padding; value = the first DC columns of a row) for bf16 queries and rows, fp32
 * accumulation and an fp32 output (the caller rounds it).
 *
 * Why: PyTorch's bf16 SDPA computes a decode step at ~23 GMAC/s on one core here (B = 8 / 32K: 480 ms
 * of attention a step for 1.5 GB of cache), far from the memory's speed; the fp32 kernel's plan in bf16
 * (rows widened to fp32 in L1) measured no faster. AMX does the products at almost no cost, so what is
 * left is reading the cache once and the softmax.
 *
 * Per sequence, blocks of KB = 64 cached rows (tile registers: 0-3 scores, 4/6 A, 5/7 B; then 0-1 the
 * probabilities, 2 an output tile, 3/5 values):
 * - scores S = K Q^T [64 keys x 16 heads], fp32, in tiles 0-3: the A operand is the cache itself (16
 *   rows of 32 bf16 at the row stride: no packing, each row read once from memory), the B operand the
 *   queries in AMX's pair layout ([32 / 2][16 heads][2] per 32 dims, packed once per call; heads past M
 *   are zero); a row width that is not a multiple of 32 ends with a 16-deep step (tiles 6 and 7);
 * - the online softmax with the 16 heads in the 16 lanes of a vector, one vector per key (base 2, the
 *   scale applied to the fp32 scores; the outputs rescaled only when a head's max moved);
 * - the value product O [16 heads x DC] += P^T V: A = P^T per 32 keys (pairs of keys' probabilities,
 *   rounded to bf16 and interleaved, then a 16 x 16 transpose of 32-bit pairs), B = the block's latent
 *   columns interleaved by key pairs (two rows -> one 64-byte tile row per 16 columns, in L1).
 * The last block's rows are copied into a zero-padded buffer (nothing is read past row S - 1).
 * Compiled by cpu_decode.py on first use (-O3 -march=native), once per shape; the build fails (and
 * callers keep PyTorch's SDPA) where the CPU lacks AMX-BF16 or AVX512-BF16.
 */
#include "cpu_amx.h"

#ifndef M
#error "define M (query rows, at most 16), W (row width) and DC (value width)"
#endif
#if M > 16
#error "at most 16 query rows"
#endif

#define KB 64                      /* keys per block: 4 score tiles of 16 */
#define WF (W / 32)                /* full depth steps of the scores */
#define WT (W % 32)                /* depth of the last step: 0 or 16 (W % 16 == 0 is checked by the caller) */
#define QT (WF + (WT > 0))         /* query tiles */
#define CT (DC / 16)               /* column tiles of the value */

/* 16 x 16 transpose of 32-bit elements: r[i][j] <- r[j][i]. */
static inline void transpose16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
        t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
    }
    for (int i = 0; i < 8; i++) {
        r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
    }
}

/* One depth step of the scores: the queries' tile (B, register b) against the block's 4 groups of 16
 * rows (A, register a, read from the cache at the row stride), into tiles 0-3. */
#define SCORE_STEP(a, b, step)                                                  \
    do {                                                                        \
        _tile_loadd(b, qp + (step) * PAIRS, 64);                                \
        _tile_loadd(a, blk + 0 * 16 * W + (step) * 32, W * 2);                 \
        _tile_dpbf16ps(0, a, b);                                                \
        _tile_loadd(a, blk + 1 * 16 * W + (step) * 32, W * 2);                 \
        _tile_dpbf16ps(1, a, b);                                                \
        _tile_loadd(a, blk + 2 * 16 * W + (step) * 32, W * 2);                 \
        _tile_dpbf16ps(2, a, b);                                                \
        _tile_loadd(a, blk + 3 * 16 * W + (step) * 32, W * 2);                 \
        _tile_dpbf16ps(3, a, b);                                                \
    } while (0)

/* S [KB][16] = the block's rows (row stride W) times the packed queries, tiles 0-3 stored to s. */
static inline void scores(const bf16 *blk, const bf16 *qp, float *s) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int c = 0; c < WF; c++) SCORE_STEP(4, 5, c);
#if WT
    SCORE_STEP(6, 7, WF);   /* the last 16 dims: tiles configured 16 deep */
#endif
    _tile_stored(0, s + 0 * 256, 64);
    _tile_stored(1, s + 1 * 256, 64);
    _tile_stored(2, s + 2 * 256, 64);
    _tile_stored(3, s + 3 * 256, 64);
}

/* The B operand of 32 keys' values: vb [CT][16 key pairs][16 columns][2] from rows (stride W). */
static inline void pack_values(const bf16 *rows, bf16 *vb) {
    const __m512i lo = _mm512_setr_epi32(0x200000, 0x210001, 0x220002, 0x230003, 0x240004, 0x250005, 0x260006, 0x270007,
                                         0x280008, 0x290009, 0x2a000a, 0x2b000b, 0x2c000c, 0x2d000d, 0x2e000e, 0x2f000f);
    const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));   /* words 16-31 of each row */
    for (int i = 0; i < 16; i++) {
        const bf16 *r0 = rows + 2 * i * W, *r1 = r0 + W;
        for (int t = 0; t < CT; t += 2) {   /* 32 columns of both rows: two tiles' rows */
            const __mmask32 m = CT - t > 1 ? 0xffffffffu : 0xffffu;
            const __m512i a = _mm512_maskz_loadu_epi16(m, r0 + t * 16), b = _mm512_maskz_loadu_epi16(m, r1 + t * 16);
            _mm512_store_si512(vb + (t * 16 + i) * 32, _mm512_permutex2var_epi16(a, lo, b));
            if (CT - t > 1) _mm512_store_si512(vb + ((t + 1) * 16 + i) * 32, _mm512_permutex2var_epi16(a, hi, b));
        }
    }
}

/* One sequence: q [M][W] bf16, rows [S][W] (stride W), out [M][DC] fp32; with part_max / part_sum ([M]
 * each) the output is left unnormalised (sum_j 2^(s_j - max) c_j) and the running max (base 2, scaled
 * scores) and sum written there, as cpu_decode.c does. */
static void attend_one(const bf16 *q, const bf16 *rows, long S, float scale2, float *out, float *part_max,
                       float *part_sum) {
    bf16 qp[QT * PAIRS] __attribute__((aligned(64)));
    float o[16 * DC] __attribute__((aligned(64)));
    float s[KB * 16] __attribute__((aligned(64)));
    bf16 pt[2 * PAIRS] __attribute__((aligned(64)));         /* P^T per 32 keys: [16 heads][32 keys] */
    bf16 vb[2 * CT * PAIRS] __attribute__((aligned(64)));    /* values per 32 keys */
    bf16 tail[KB * W] __attribute__((aligned(64)));
    memset(qp, 0, sizeof qp);
    for (int h = 0; h < M; h++)
        for (int w = 0; w < W; w++)   /* [step][dim pair][head][2] */
            qp[(w / 32) * PAIRS + ((w % 32) / 2) * 32 + h * 2 + w % 2] = q[h * W + w];
    memset(o, 0, sizeof o);
    const __m512 sc = _mm512_set1_ps(scale2), zero = _mm512_setzero_ps();
    const __m512i pair = _mm512_setr_epi32(0x100000, 0x110001, 0x120002, 0x130003, 0x140004, 0x150005, 0x160006,
                                           0x170007, 0x180008, 0x190009, 0x1a000a, 0x1b000b, 0x1c000c, 0x1d000d,
                                           0x1e000e, 0x1f000f);   /* words (e0[h], e1[h]) */
    __m512 run_max = _mm512_set1_ps(-INFINITY), run_sum = zero;
    for (long s0 = 0; s0 < S; s0 += KB) {
        const int n = S - s0 < KB ? (int)(S - s0) : KB;
        const bf16 *blk = rows + s0 * W;
        if (n < KB) {   /* the last rows, zero-padded to a block */
            memcpy(tail, blk, sizeof(bf16) * n * W);
            memset(tail + n * W, 0, sizeof(bf16) * (KB - n) * W);
            blk = tail;
        }
        scores(blk, qp, s);
        __m512 bmax = _mm512_set1_ps(-INFINITY);
        for (int k = 0; k < n; k++) bmax = _mm512_max_ps(bmax, _mm512_load_ps(s + k * 16));
        const __m512 now = _mm512_max_ps(run_max, _mm512_mul_ps(bmax, sc));
        const __mmask16 moved = _mm512_cmp_ps_mask(now, run_max, _CMP_NEQ_OQ);
        if (moved) {   /* a head's max moved: rescale its sum and output (others: exactly 1) */
            const __m512 corr = _mm512_mask_blend_ps(moved, _mm512_set1_ps(1.f), exp2_bf(_mm512_sub_ps(run_max, now)));
            run_sum = _mm512_mul_ps(run_sum, corr);
            float cs[16] __attribute__((aligned(64)));
            _mm512_store_ps(cs, corr);
            for (int h = 0; h < M; h++)
                if (cs[h] != 1.f)
                    for (int c = 0; c < CT; c++)
                        _mm512_store_ps(o + h * DC + c * 16, _mm512_mul_ps(_mm512_load_ps(o + h * DC + c * 16), _mm512_set1_ps(cs[h])));
            run_max = now;
        }
        const int halves = n > 32 ? 2 : 1;
        for (int half = 0; half < halves; half++) {
            __m512i z[16];
            for (int i = 0; i < 16; i++) {   /* key pair i: dword h = (p[2i][h], p[2i + 1][h]) in bf16 */
                const int k = half * 32 + 2 * i;
                const __m512 e0 = k < n ? exp2_bf(_mm512_fmsub_ps(_mm512_load_ps(s + k * 16), sc, now)) : zero;
                const __m512 e1 = k + 1 < n ? exp2_bf(_mm512_fmsub_ps(_mm512_load_ps(s + (k + 1) * 16), sc, now)) : zero;
                run_sum = _mm512_add_ps(run_sum, _mm512_add_ps(e0, e1));
                z[i] = _mm512_permutexvar_epi16(pair, (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
            }
            transpose16(z);   /* row h: the 32 keys' probabilities of head h, in pairs */
            for (int h = 0; h < 16; h++) _mm512_store_si512(pt + half * PAIRS + h * 32, z[h]);
            pack_values(blk + half * 32 * W, vb + half * CT * PAIRS);
        }
        _tile_loadd(0, pt, 64);
        if (halves > 1) _tile_loadd(1, pt + PAIRS, 64);
        for (int c = 0; c < CT; c++) {   /* O[:, 16c:16c+16] += P^T V */
            _tile_loadd(2, o + c * 16, DC * 4);
            _tile_loadd(5, vb + c * PAIRS, 64);
            _tile_dpbf16ps(2, 0, 5);
            if (halves > 1) {
                _tile_loadd(3, vb + (CT + c) * PAIRS, 64);
                _tile_dpbf16ps(2, 1, 3);
            }
            _tile_stored(2, o + c * 16, DC * 4);
        }
    }
    float mx[16] __attribute__((aligned(64))), sm[16] __attribute__((aligned(64)));
    _mm512_store_ps(mx, run_max);
    _mm512_store_ps(sm, run_sum);
    for (int h = 0; h < M; h++) {
        float inv = sm[h] > 0.f ? 1.f / sm[h] : 0.f;   /* S = 0: zeros */
        if (part_max) { part_max[h] = mx[h]; part_sum[h] = sm[h]; inv = 1.f; }
        for (int c = 0; c < CT; c++)
            _mm512_storeu_ps(out + h * DC + c * 16, _mm512_mul_ps(_mm512_load_ps(o + h * DC + c * 16), _mm512_set1_ps(inv)));
    }
}

/* q [B][M][W] bf16 contiguous; rows: sequence b's row j at rows + b * batch_stride + j * W (bf16);
 * out [B][M][DC] fp32. scale: the softmax scale (natural base). part_max, part_sum: NULL, or [B][M]
 * each (fp32) for unnormalised parts. The calling thread's tile configuration is set here and released. */
void mla_decode_amx(const bf16 *q, const bf16 *rows, long batch_stride, long B, long S, float scale, float *out,
                    float *part_max, float *part_sum) {
    configure_tiles(WT);   /* tiles 6 and 7 for the last 16 dims when W is not a multiple of 32 */
    const float scale2 = scale * 1.4426950408889634f;   /* log2(e): the softmax runs in base 2 */
    for (long b = 0; b < B; b++)
        attend_one(q + b * M * W, rows + b * batch_stride, S, scale2, out + b * M * DC,
                   part_max ? part_max + b * M : NULL, part_sum ? part_sum + b * M : NULL);
    _tile_release();
}
