/* Absorbed MLA decode on the CPU, fp32: one query token per sequence, no padding.
 *
 * Contract (the same as reference.py for T_q = 1): for sequence b and query row m (a head),
 *   s_j = scale * (q[b, m] . rows[b, j])          over the whole row [c | k_r] (W = d_c + d_r values)
 *   out[b, m] = sum_j softmax(s)_j * rows[b, j, :DC]  (the value is the latent c, the first DC values)
 *
 * Compiled by cpu_decode.py on first use with the machine's C compiler (-O3 -march=native), once
 * per shape: M (query rows), W and DC are compile-time constants, so every loop below has a fixed
 * trip count and the vector code needs no tails. GCC/Clang vector extensions, no intrinsics: the
 * same source builds for AVX-512, AVX2 or NEON.
 *
 * Per sequence the cache is read once, in tiles of TILE keys that stay in L1: the scores of all
 * M rows against the tile (two rows x L/2 keys at a time, each key row loaded once for both, one
 * vector of partial sums per (row, key), then an L x L transpose-and-add gives the L scores in
 * one vector; L = 16 with AVX-512, else 8: cpu_vector.h), one online-softmax update per row per tile
 * (base 2: q is pre-scaled by scale * log2(e)), then the value product on the tile's first DC
 * columns, M accumulators per L columns.
 */
#include "cpu_vector.h"

#ifndef M
#error "define M (query rows), W (row width) and DC (value width)"
#endif
#define TILE 64           /* keys per tile: 64 x W floats stay in L1 */
#define WV (W / L)        /* vectors per row (W % 16 == 0 is checked by the caller) */
#define DV (DC / L)
/* Query vectors per row held in registers while a group of keys passes: all of them with AVX-512 (the
 * loop order is then that of one row pair against one key at a time); with 16 registers (AVX2) 2, so
 * that both rows' 2 + 2, the L partial sums and a key fit. WV is even there (W % 16 == 0, L = 8). */
#if VREGS >= 32
#define QC WV
#else
#define QC 2
#endif

/* L vectors of partial sums -> one vector whose lane j is the total of a[j] (a is consumed). */
#if L == 16
static inline vf transpose_add(vf a[16]) {
    vf u[8], w[4], x[2];
    for (int j = 0; j < 8; j++)  /* lanes 0-7: a[j]'s 8 partials, 8-15: a[j + 8]'s */
        u[j] = __builtin_shufflevector(a[j], a[j + 8], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
             + __builtin_shufflevector(a[j], a[j + 8], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    for (int j = 0; j < 4; j++)  /* groups of 4 lanes: a[j], a[j + 4], a[j + 8], a[j + 12] */
        w[j] = __builtin_shufflevector(u[j], u[j + 4], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27)
             + __builtin_shufflevector(u[j], u[j + 4], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int j = 0; j < 2; j++)  /* pairs of lanes: a[j], a[j + 2], a[j + 4], ... a[j + 14] */
        x[j] = __builtin_shufflevector(w[j], w[j + 2], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29)
             + __builtin_shufflevector(w[j], w[j + 2], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
    /* lane 2k: pair k of x[0] = a[2k]; lane 2k + 1: pair k of x[1] = a[2k + 1] */
    return __builtin_shufflevector(x[0], x[1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30)
         + __builtin_shufflevector(x[0], x[1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
}
#else
static inline vf transpose_add(vf a[8]) {
    vf u[4], w[2];
    for (int j = 0; j < 4; j++)  /* lanes 0-3: a[j]'s 4 partials, 4-7: a[j + 4]'s */
        u[j] = __builtin_shufflevector(a[j], a[j + 4], 0, 1, 2, 3, 8, 9, 10, 11)
             + __builtin_shufflevector(a[j], a[j + 4], 4, 5, 6, 7, 12, 13, 14, 15);
    for (int j = 0; j < 2; j++)  /* pairs of lanes: a[j], a[j + 2], a[j + 4], a[j + 6] */
        w[j] = __builtin_shufflevector(u[j], u[j + 2], 0, 1, 8, 9, 4, 5, 12, 13)
             + __builtin_shufflevector(u[j], u[j + 2], 2, 3, 10, 11, 6, 7, 14, 15);
    /* lane 2k: pair k of w[0] = a[2k]; lane 2k + 1: pair k of w[1] = a[2k + 1] */
    return __builtin_shufflevector(w[0], w[1], 0, 8, 2, 10, 4, 12, 6, 14)
         + __builtin_shufflevector(w[0], w[1], 1, 9, 3, 11, 5, 13, 7, 15);
}
#endif

/* One sequence: q [M][W] (already times scale * log2 e), rows [S][W], out [M][DC]. With part_max and
 * part_sum (each [M]) the output is left unnormalised (sum_j 2^(s_j - max) c_j) and the running max
 * (base 2) and sum are written there, for a caller that merges parts of one sequence. */
static void attend_one(const float *restrict q, const float *restrict rows, long S, float *restrict out,
                       float *restrict part_max, float *restrict part_sum) {
    float acc[M][DC] __attribute__((aligned(64)));
    float p[M][TILE] __attribute__((aligned(64)));
    float run_max[M], run_sum[M];
    memset(acc, 0, sizeof acc);
    for (int m = 0; m < M; m++) { run_max[m] = -INFINITY; run_sum[m] = 0.f; }
    vf qa[WV], qb[WV];
    const vi lane = LANES;
    for (long start = 0; start < S; start += TILE) {
        const float *tile = rows + start * W;
        int n = S - start < TILE ? (int)(S - start) : TILE;
        int n16 = (n + L - 1) / L * L;              /* the softmax runs L keys at a time */
        /* scores, two query rows x 8 keys at a time (each key row loaded once for both) */
        for (int m0 = 0; m0 < M; m0 += 2) {
            const int m1 = m0 + 1 < M ? m0 + 1 : m0;  /* odd M: the last row twice (same result) */
            for (int c = 0; c < WV; c++) { qa[c] = load(q + m0 * W + c * L); qb[c] = load(q + m1 * W + c * L); }
            for (int j0 = 0; j0 < n16; j0 += L / 2) {
                vf a[L];
                for (int j = 0; j < L; j++) a[j] = splat(0.f);
                for (int c0 = 0; c0 < WV; c0 += QC)   /* QC query vectors of both rows stay in registers */
                    for (int j = 0; j < L / 2; j++)
                        if (j0 + j < n)
                            for (int c = c0; c < c0 + QC; c++) {
                                vf k = load(tile + (j0 + j) * W + c * L);
                                a[j] += qa[c] * k;
                                a[j + L / 2] += qb[c] * k;
                            }
                vf t = transpose_add(a);  /* lanes 0..L/2-1: row m0's scores of keys j0.., the rest: row m1's */
                memcpy(&p[m0][j0], &t, L / 2 * sizeof(float));
                memcpy(&p[m1][j0], (float *)&t + L / 2, L / 2 * sizeof(float));
            }
        }
        /* online softmax over this tile, per row (base 2: q carries log2 e) */
        for (int m = 0; m < M; m++) {
            vf vmax = splat(-INFINITY);
            for (int j0 = 0; j0 < n16; j0 += L)
                vmax = sel((lane + j0 < n) & (load(&p[m][j0]) > vmax), load(&p[m][j0]), vmax);
            float tmax = hmax(vmax);
            tmax = tmax > run_max[m] ? tmax : run_max[m];
            float corr = exp2_neg(splat(run_max[m] - tmax))[0];   /* 0 on the first tile (-inf) */
            run_max[m] = tmax;
            vf sum = splat(0.f);
            for (int j0 = 0; j0 < n16; j0 += L) {
                vf e = sel(lane + j0 < n, exp2_neg(load(&p[m][j0]) - tmax), splat(0.f));
                store(&p[m][j0], e);
                sum += e;
            }
            run_sum[m] = run_sum[m] * corr + hsum(sum);
            if (corr != 1.f)
                for (int c = 0; c < DV; c++) store(&acc[m][c * L], load(&acc[m][c * L]) * corr);
        }
        /* value product on the first DC columns: acc[m] += sum_j p[m][j] rows[j, :DC] */
        for (int c = 0; c < DV; c++) {
            vf av[M];
            for (int m = 0; m < M; m++) av[m] = load(&acc[m][c * L]);
            for (int j = 0; j < n; j++) {
                vf v = load(tile + j * W + c * L);
                for (int m = 0; m < M; m++) av[m] += p[m][j] * v;
            }
            for (int m = 0; m < M; m++) store(&acc[m][c * L], av[m]);
        }
    }
    for (int m = 0; m < M; m++) {
        float inv = run_sum[m] > 0.f ? 1.f / run_sum[m] : 0.f;  /* S = 0: zeros */
        if (part_max) { part_max[m] = run_max[m]; part_sum[m] = run_sum[m]; inv = 1.f; }
        for (int c = 0; c < DV; c++) store(out + m * DC + c * L, load(&acc[m][c * L]) * inv);
    }
}

/* q [B][M][W] contiguous; rows: sequence b's row j at rows + b * batch_stride + j * W;
 * out [B][M][DC] contiguous. scale: the softmax scale (natural base). part_max, part_sum: NULL, or
 * [B][M] each for unnormalised parts (see attend_one). */
void mla_decode_fp32(const float *q, const float *rows, long batch_stride, long B, long S, float scale, float *out,
                     float *part_max, float *part_sum) {
    const float k = scale * 1.4426950408889634f;   /* log2(e): the softmax runs in base 2 */
    float qs[M * W] __attribute__((aligned(64)));
    for (long b = 0; b < B; b++) {
        for (int i = 0; i < M * W; i++) qs[i] = q[b * M * W + i] * k;
        attend_one(qs, rows + b * batch_stride, S, out + b * M * DC,
                   part_max ? part_max + b * M : NULL, part_sum ? part_sum + b * M : NULL);
    }
}
