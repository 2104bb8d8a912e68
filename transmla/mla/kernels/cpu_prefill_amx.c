/* Absorbed MLA prefill on the CPU, bf16, on AMX tiles: the contract of cpu_prefill.c (causal, no
 * padding; query token t sees the rows s <= t + S - T; value = the first DC columns of a row), for
 * bf16 queries and rows, fp32 accumulation, bf16 output.
 *
 * Why: PyTorch's fused SDPA runs bf16 on AMX here, but needs the value as wide as the key (9 x (96 +
 * 96) multiply-adds per query-key pair at 25% of SmolLM2's cache against 9 x (96 + 64)), and its
 * time at long context is mostly outside the products: one layer at 8K, one thread, takes 170 ms with
 * 16-wide heads and 250 ms with 96-wide ones, against the source's 64-wide GQA at 210 ms.
 *
 * Flash attention over blocks of QB query tokens (QB * H rows, padded to tiles of 16) against KB = 64
 * keys, per tile of 16 query rows (tile registers: 0-3 = accumulators, 4 = A operand, 5-7 = B operands):
 * - scores: 16 x 64 fp32 in tiles 0-3, the rows' queries (A, 16 x 32 bf16 per step) against the
 *   block's keys packed in AMX's pair layout ([32 / 2][16 keys][2] per 16 keys and 32 dims), summed
 *   over ceil(W / 32) steps (W zero-padded to a multiple of 32);
 * - the online softmax on 16 rows in AVX-512 registers (base 2, the scale applied to the fp32
 *   scores), the causal limit per row only on blocks that cross it; the probabilities rounded to
 *   bf16 into a 16 x 64 buffer; the outputs' rows rescaled in memory only when their max moved;
 * - the value product: the outputs (fp32, 16 x DC, up to 4 column tiles at a time) loaded into tiles
 *   0-3, += probabilities (A, 16 x 32 keys) times the values packed in pair layout ([32 / 2][16
 *   columns][2] per 32 keys and 16 columns), stored back.
 * Compiled by cpu_prefill.py on first use (-O3 -march=native), once per shape; the build fails (and
 * callers keep PyTorch's SDPA) where the CPU lacks AMX-BF16 or AVX512-BF16.
 */
#include "cpu_amx.h"

#ifndef H
#error "define H (query heads), W (row width) and DC (value width)"
#endif

#define KB 64                      /* keys per block: 4 score tiles of 16 */
#define QB 16                      /* query tokens per block */
#define MB (QB * H)                /* query rows per block */
#define MP ((MB + 15) / 16 * 16)   /* ... padded to whole tiles */
#define WP ((W + 31) / 32 * 32)    /* row width padded to AMX's depth of 32 bf16 */
#define WS (WP / 32)               /* depth steps of the scores */
#define CT (DC / 16)               /* column tiles of the value (DC % 16 == 0 is checked by the caller) */

/* Packed per key block k (keys beyond S are zero):
 *   keys   kp + k * WS * 4 * PAIRS: [WS][4 key groups][16 dim pairs][16 keys][2]
 *   values vp + k * 2 * CT * PAIRS: [2 key halves][CT column tiles][16 key pairs][16 columns][2]
 * rows: sequence b's row s at rows + b * batch_stride + s * W. */
void mla_prefill_amx_pack(const bf16 *rows, long batch_stride, long B, long S, bf16 *kp, bf16 *vp) {
    const long nb = (S + KB - 1) / KB;
    for (long b = 0; b < B; b++)
        for (long k = 0; k < nb; k++) {
            bf16 *kd = kp + (b * nb + k) * WS * 4 * PAIRS;
            bf16 *vd = vp + (b * nb + k) * 2 * CT * PAIRS;
            for (int j = 0; j < KB; j++) {
                const long s = k * KB + j;
                const bf16 *src = rows + b * batch_stride + s * W;
                for (int w = 0; w < WP; w++) {
                    const bf16 x = s < S && w < W ? src[w] : 0;
                    kd[(((w / 32) * 4 + j / 16) * 16 + (w % 32) / 2) * 32 + (j % 16) * 2 + w % 2] = x;
                    if (w < DC)
                        vd[(((j / 32) * CT + w / 16) * 16 + (j % 32) / 2) * 32 + (w % 16) * 2 + j % 2] = x;
                }
            }
        }
}

/* The online softmax of one tile's 16 rows of KB scores (s, fp32, row stride KB; rows listed in
 * run_max / run_sum / o by the tile's first row): keys j >= vis[i] of row i are masked when vis is
 * given; the probabilities, rounded to bf16, into p (row stride KB); the rows of o (stride DC)
 * rescaled where their max moved. scale2 = softmax scale * log2 e. */
static inline void softmax_tile(float *s, bf16 *p, const int *vis, float *run_max, float *run_sum, float *o,
                                float scale2) {
    float bmax[16] __attribute__((aligned(64)));
    const __m512 neg_inf = _mm512_set1_ps(-INFINITY), lane = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int i = 0; i < 16; i++) {   /* pass 1: each row's max (masked scores written back as -inf) */
        __m512 x[KB / 16];
        for (int j = 0; j < KB / 16; j++) {
            x[j] = _mm512_load_ps(s + i * KB + j * 16);
            if (vis) {
                const __mmask16 keep = _mm512_cmp_ps_mask(_mm512_add_ps(lane, _mm512_set1_ps((float)(j * 16))),
                                                          _mm512_set1_ps((float)vis[i]), _CMP_LT_OQ);
                x[j] = _mm512_mask_blend_ps(keep, neg_inf, x[j]);
                _mm512_store_ps(s + i * KB + j * 16, x[j]);
            }
        }
        bmax[i] = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(x[0], x[1]), _mm512_max_ps(x[2], x[3])));
    }
    /* the 16 rows at once: new max, the correction of the old sum and outputs (1 where nothing was seen) */
    const __m512 old = _mm512_loadu_ps(run_max);
    const __m512 now = _mm512_max_ps(old, _mm512_mul_ps(_mm512_load_ps(bmax), _mm512_set1_ps(scale2)));
    const __mmask16 seen = _mm512_cmp_ps_mask(now, neg_inf, _CMP_NEQ_OQ);
    const __m512 corr = _mm512_mask_blend_ps(seen, _mm512_set1_ps(1.f), exp2_bf(_mm512_sub_ps(old, now)));
    float now_s[16] __attribute__((aligned(64))), corr_s[16] __attribute__((aligned(64))), sums[16] __attribute__((aligned(64)));
    _mm512_store_ps(now_s, now);
    _mm512_store_ps(corr_s, corr);
    _mm512_storeu_ps(run_max, now);
    for (int i = 0; i < 16; i++) {   /* pass 2: probabilities and their sums */
        if (now_s[i] == -INFINITY) {   /* nothing visible yet: p = 0 */
            memset(p + i * KB, 0, sizeof(bf16) * KB);
            sums[i] = 0.f;
            continue;
        }
        const __m512 m = _mm512_set1_ps(now_s[i]), sc = _mm512_set1_ps(scale2);
        __m512 sum = _mm512_setzero_ps();
        for (int j = 0; j < KB / 16; j++) {
            const __m512 e = exp2_bf(_mm512_fmsub_ps(_mm512_load_ps(s + i * KB + j * 16), sc, m));
            sum = _mm512_add_ps(sum, e);
            store_bf16(p + i * KB + j * 16, e);
        }
        sums[i] = _mm512_reduce_add_ps(sum);
        if (corr_s[i] != 1.f)
            for (int c = 0; c < DC / 16; c++)
                _mm512_store_ps(o + i * DC + c * 16, _mm512_mul_ps(_mm512_load_ps(o + i * DC + c * 16), _mm512_set1_ps(corr_s[i])));
    }
    _mm512_storeu_ps(run_sum, _mm512_fmadd_ps(_mm512_loadu_ps(run_sum), corr, _mm512_load_ps(sums)));
}

/* Scores of query rows q (16 rows, row stride WP) against one packed key block: tiles 0-3. */
static inline void scores(const bf16 *q, const bf16 *kblk) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int c = 0; c < WS; c++) {
        const bf16 *kc = kblk + c * 4 * PAIRS;
        _tile_loadd(4, q + c * 32, WP * 2);
        _tile_loadd(5, kc, 64);
        _tile_loadd(6, kc + PAIRS, 64);
        _tile_loadd(7, kc + 2 * PAIRS, 64);
        _tile_dpbf16ps(0, 4, 5);
        _tile_dpbf16ps(1, 4, 6);
        _tile_loadd(5, kc + 3 * PAIRS, 64);
        _tile_dpbf16ps(2, 4, 7);
        _tile_dpbf16ps(3, 4, 5);
    }
}

/* o (16 rows, row stride DC, fp32) += p (16 x KB bf16) times the packed value block, over `halves`
 * halves of 32 keys, up to 4 column tiles at a time in tiles 0-3. */
static inline void values(float *o, const bf16 *p, const bf16 *vblk, int halves) {
    for (int t0 = 0; t0 < CT; t0 += 4) {
        const int n = CT - t0 < 4 ? CT - t0 : 4;
        float *ot = o + t0 * 16;
        _tile_loadd(0, ot, DC * 4);
        if (n > 1) _tile_loadd(1, ot + 16, DC * 4);
        if (n > 2) _tile_loadd(2, ot + 32, DC * 4);
        if (n > 3) _tile_loadd(3, ot + 48, DC * 4);
        for (int h = 0; h < halves; h++) {
            const bf16 *vh = vblk + (h * CT + t0) * PAIRS;
            _tile_loadd(4, p + h * 32, KB * 2);
            _tile_loadd(5, vh, 64);
            _tile_dpbf16ps(0, 4, 5);
            if (n > 1) { _tile_loadd(6, vh + PAIRS, 64); _tile_dpbf16ps(1, 4, 6); }
            if (n > 2) { _tile_loadd(7, vh + 2 * PAIRS, 64); _tile_dpbf16ps(2, 4, 7); }
            if (n > 3) { _tile_loadd(5, vh + 3 * PAIRS, 64); _tile_dpbf16ps(3, 4, 5); }
        }
        _tile_stored(0, ot, DC * 4);
        if (n > 1) _tile_stored(1, ot + 16, DC * 4);
        if (n > 2) _tile_stored(2, ot + 32, DC * 4);
        if (n > 3) _tile_stored(3, ot + 48, DC * 4);
    }
}

/* One sequence: q [T][H][W] bf16 (contiguous, unscaled), the packed blocks of its S rows, out
 * [T][H][DC] bf16; scale2 = softmax scale * log2 e. Query blocks first, first + step, ... Returns 0,
 * -1 when out of memory. The calling thread's tile configuration is set here and released. */
int mla_prefill_amx(const bf16 *q, const bf16 *kp, const bf16 *vp, long T, long S, float scale2, bf16 *out,
                    long first, long step) {
    const long offset = S - T;
    bf16 *qpad = aligned_alloc(64, sizeof(bf16) * MP * WP);
    float *o = aligned_alloc(64, sizeof(float) * MP * DC);
    if (!qpad || !o) {
        free(qpad);
        free(o);
        return -1;
    }
    float sbuf[16 * KB] __attribute__((aligned(64)));
    bf16 pbuf[16 * KB] __attribute__((aligned(64)));
    float run_max[MP], run_sum[MP];
    int vis[MP];
    configure_tiles(0);
    const long nqb = (T + QB - 1) / QB;
    for (long qb = first; qb < nqb; qb += step) {
        const long t0 = qb * QB;
        const int nrows = (int)((T - t0 < QB ? T - t0 : QB) * H);
        const int tiles = (nrows + 15) / 16;
        memset(qpad, 0, sizeof(bf16) * MP * WP);
        for (int r = 0; r < nrows; r++) memcpy(qpad + r * WP, q + (t0 * H + r) * W, sizeof(bf16) * W);
        memset(o, 0, sizeof(float) * MP * DC);
        for (int r = 0; r < MP; r++) { run_max[r] = -INFINITY; run_sum[r] = 0.f; }
        long last = t0 + nrows / H - 1 + offset;   /* the last key the block's last token sees */
        if (last > S - 1) last = S - 1;
        for (long k = 0; k * KB <= last; k++) {
            const long s0 = k * KB;
            const int masked = s0 + KB - 1 > t0 + offset;   /* else every row sees the whole block */
            const int halves = last - s0 + 1 > 32 ? 2 : 1;  /* keys past `last` have probability 0 */
            const bf16 *kblk = kp + k * WS * 4 * PAIRS, *vblk = vp + k * 2 * CT * PAIRS;
            if (masked)
                for (int r = 0; r < MP; r++) {   /* row r sees the block's keys j < vis[r]; padding rows none */
                    const long n = t0 + r / H + offset - s0 + 1;
                    vis[r] = r >= nrows || n < 0 ? 0 : n < KB ? (int)n : KB;
                }
            for (int tile = 0; tile < tiles; tile++) {
                const int r0 = tile * 16;
                scores(qpad + r0 * WP, kblk);
                _tile_stored(0, sbuf, KB * 4);
                _tile_stored(1, sbuf + 16, KB * 4);
                _tile_stored(2, sbuf + 32, KB * 4);
                _tile_stored(3, sbuf + 48, KB * 4);
                softmax_tile(sbuf, pbuf, masked ? vis + r0 : NULL, run_max + r0, run_sum + r0, o + r0 * DC, scale2);
                values(o + r0 * DC, pbuf, vblk, halves);
            }
        }
        bf16 *dst = out + t0 * H * DC;
        for (int r = 0; r < nrows; r++) {   /* every real row sees key 0: run_sum > 0 */
            const float inv = 1.f / run_sum[r];
            for (int c = 0; c < DC / 16; c++)
                store_bf16(dst + r * DC + c * 16, _mm512_mul_ps(_mm512_load_ps(o + r * DC + c * 16), _mm512_set1_ps(inv)));
        }
    }
    _tile_release();
    free(qpad);
    free(o);
    return 0;
}
