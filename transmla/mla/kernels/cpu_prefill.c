/* Absorbed MLA prefill on the CPU, fp32: many query tokens per sequence, causal, no padding.
 *
 * Contract (reference.py): sequence b has T query tokens, the last T of its S cached rows; query
 * token t sees the rows s <= t + (S - T). For query row (t, h):
 *   s_j = scale * (q[b, t, h] . rows[b, j])              over the whole row [c | k_r] (W values)
 *   out[b, t, h] = sum_j softmax(s)_j * rows[b, j, :DC]  (the value is the latent c)
 *
 * Compiled by cpu_prefill.py on first use (-O3 -march=native), once per shape: H (query heads), W
 * and DC are compile-time constants. Why a kernel: PyTorch's fused SDPA on the CPU needs the value
 * as wide as the key, so it multiplies by all W columns of the row where only DC are the value
 * (9 heads x (96 + 96) multiply-adds per query-key pair at 25% of SmolLM2's cache, against 9 x
 * (96 + 64) here).
 *
 * Flash attention over blocks: QB query tokens (QB * H query rows, contiguous in q) against KB keys,
 * one tile of RM query rows at a time, each tile doing all three steps while the key block is in L1
 * (measured: 149 against 167 ms at 4K when the block's scores, then its softmax, then its value
 * products ran as three passes over all 144 rows):
 * - scores: a small matrix product, RM rows x KB keys in registers, the row's values broadcast
 *   against the keys packed transposed ([W][KB] per block, packed once per call);
 * - an online softmax per row on those registers (base 2: q is pre-scaled by scale * log2 e), the
 *   causal limit per row only on the blocks that cross it; key blocks past a query block's last
 *   token are not visited;
 * - the value product on the first DC columns: RM rows x up to 64 columns in registers, rescaled
 *   by the row's softmax correction when loaded.
 */
#include <stdlib.h>

#include "cpu_vector.h"

#ifndef H
#error "define H (query heads), W (row width) and DC (value width)"
#endif
#define KB 64             /* keys per block (measured: 32 and 128 are slower here) */
#define QB 16             /* query tokens per block */
#define MB (QB * H)       /* query rows per block */
#define RM 6              /* query rows per register tile */
/* Key vectors per score tile and value vectors per pass of the value product, so that RM x KJ
 * accumulators + KJ operands + a broadcast fit the registers: with AVX-512 the whole block (6 x 4 + 4 of
 * 32), with AVX2 16 keys (6 x 2 + 2 + 1 of 16; the block's scores pass through p). */
#if VREGS >= 32
#define KJ (KB / L)
#define CV 4
#else
#define KJ 2
#define CV 2
#endif
#define DV (DC / L)       /* value vectors per row (DC % 16 == 0 is checked by the caller) */
#ifndef WC
#define WC 32             /* score terms summed per chunk (a sum of W fp32 products in one register
                             drifts ~sqrt(W) roundings; chunks keep the scores as exact as a GEMM's) */
#endif

/* One tile of R query rows against one key block, all in one pass while the block is in L1:
 * scores in registers (q [R][W] times the packed keys kt [W][KB]), the online softmax on them
 * (row i sees the block's keys j < vis[i]; vis[i] = KB when the block is wholly visible), the
 * probabilities through a small buffer, and o [R][DC] = o * corr + p times v [:n][:DC]. */
static inline void tile(const float *restrict q, const float *restrict kt, const float *restrict v, int n,
                        const int *restrict vis, float *restrict run_max, float *restrict run_sum,
                        float *restrict o, const int R, const int masked) {
    vf acc[RM][KB / L];   /* the block's scores (KJ < KB / L: computed KJ vectors at a time through p) */
    float p[RM][KB] __attribute__((aligned(64)));   /* partial scores, then the probabilities */
    for (int j0 = 0; j0 < KB / L; j0 += KJ) {
        for (int w0 = 0; w0 < W; w0 += WC) {   /* chunks of WC terms, summed at the end: blocked summation */
            vf part[RM][KJ];
            for (int i = 0; i < R; i++)
                for (int j = 0; j < KJ; j++) part[i][j] = splat(0.f);
            const int wn = W - w0 < WC ? W - w0 : WC;
            for (int w = w0; w < w0 + wn; w++) {
                vf k[KJ];
                for (int j = 0; j < KJ; j++) k[j] = load(kt + w * KB + (j0 + j) * L);
                for (int i = 0; i < R; i++) {
                    vf a = splat(q[i * W + w]);
                    for (int j = 0; j < KJ; j++) part[i][j] += a * k[j];
                }
            }
            if (w0 > 0)
                for (int i = 0; i < R; i++)
                    for (int j = 0; j < KJ; j++) part[i][j] += load(p[i] + (j0 + j) * L);
            for (int i = 0; i < R; i++)
                for (int j = 0; j < KJ; j++) {
                    if (w0 + WC < W || KJ < KB / L) store(p[i] + (j0 + j) * L, part[i][j]);
                    if (KJ == KB / L) acc[i][j0 + j] = part[i][j];
                }
        }
    }
    if (KJ < KB / L)   /* the scores come back from p (AVX-512 keeps them in registers) */
        for (int i = 0; i < R; i++)
            for (int j = 0; j < KB / L; j++) acc[i][j] = load(p[i] + j * L);
    float corr[RM];
    const vi lane = LANES;
    for (int i = 0; i < R; i++) {
        if (masked)
            for (int j = 0; j < KB / L; j++) acc[i][j] = sel(lane + j * L < vis[i], acc[i][j], splat(-INFINITY));
        vf m = acc[i][0];
        for (int j = 1; j < KB / L; j++) m = vmax(m, acc[i][j]);
        float tmax = hmax(m);
        if (tmax == -INFINITY) {   /* nothing visible in this block (rows before the diagonal's reach) */
            corr[i] = 1.f;
            for (int j = 0; j < KB / L; j++) store(p[i] + j * L, splat(0.f));
            continue;
        }
        tmax = tmax > run_max[i] ? tmax : run_max[i];
        corr[i] = exp2_neg(splat(run_max[i] - tmax))[0];   /* 0 on the first block (-inf) */
        run_max[i] = tmax;
        vf sum = splat(0.f);
        for (int j = 0; j < KB / L; j++) {
            vf e = exp2_neg(acc[i][j] - tmax);   /* -inf - tmax -> 0 */
            store(p[i] + j * L, e);
            sum += e;
        }
        run_sum[i] = run_sum[i] * corr[i] + hsum(sum);
    }
    for (int c0 = 0; c0 < DV; c0 += CV) {
        const int C = DV - c0 < CV ? DV - c0 : CV;
        vf out[RM][CV];
        for (int i = 0; i < R; i++)
            for (int c = 0; c < C; c++) out[i][c] = load(o + i * DC + (c0 + c) * L) * corr[i];
        for (int j = 0; j < n; j++) {
            vf x[CV];
            for (int c = 0; c < C; c++) x[c] = load(v + j * W + (c0 + c) * L);
            for (int i = 0; i < R; i++) {
                vf a = splat(p[i][j]);
                for (int c = 0; c < C; c++) out[i][c] += a * x[c];
            }
        }
        for (int i = 0; i < R; i++)
            for (int c = 0; c < C; c++) store(o + i * DC + (c0 + c) * L, out[i][c]);
    }
}

/* The tiles of `nrows` query rows: full tiles of RM, then one of the rest (a constant per case, so
 * each is compiled with its accumulators in registers). */
#define TILES(call)                                         \
    do {                                                    \
        int r_ = 0;                                         \
        for (; r_ + RM <= nrows; r_ += RM) call(r_, RM);     \
        switch (nrows - r_) {                                \
            case 5: call(r_, 5); break;                     \
            case 4: call(r_, 4); break;                     \
            case 3: call(r_, 3); break;                     \
            case 2: call(r_, 2); break;                     \
            case 1: call(r_, 1); break;                     \
        }                                                   \
    } while (0)

/* rows: sequence b's row j at rows + b * batch_stride + j * W, S rows per sequence; packed
 * [B][ceil(S / KB)][W][KB] (keys beyond S are zero). */
void mla_prefill_pack(const float *rows, long batch_stride, long B, long S, float *packed) {
    const long nb = (S + KB - 1) / KB;
    for (long b = 0; b < B; b++)
        for (long k = 0; k < nb; k++) {
            float *dst = packed + (b * nb + k) * W * KB;
            for (int j = 0; j < KB; j++) {
                const long s = k * KB + j;
                const float *src = rows + b * batch_stride + s * W;
                for (int w = 0; w < W; w++) dst[w * KB + j] = s < S ? src[w] : 0.f;
            }
        }
}

/* One sequence: q [T][H][W] (pre-scaled by scale * log2 e, contiguous), packed [ceil(S / KB)][W][KB],
 * rows [S][W] (the values), out [T][H][DC]. Query blocks first, first + step, ... (threads take
 * interleaved blocks: the causal work grows with t). Returns 0, or -1 when out of memory. */
int mla_prefill_fp32(const float *q, const float *packed, const float *rows, long T, long S, float *out,
                     long first, long step) {
    const long offset = S - T;
    float *o = aligned_alloc(64, sizeof(float) * MB * DC);   /* unnormalised outputs */
    if (!o) return -1;
    float run_max[MB], run_sum[MB];
    int vis[MB];
    const long nqb = (T + QB - 1) / QB;
    for (long qb = first; qb < nqb; qb += step) {
        const long t0 = qb * QB;
        const int nrows = (int)((T - t0 < QB ? T - t0 : QB) * H);
        const float *qblk = q + t0 * H * W;
        memset(o, 0, sizeof(float) * nrows * DC);
        for (int r = 0; r < nrows; r++) { run_max[r] = -INFINITY; run_sum[r] = 0.f; }
        long last = t0 + nrows / H - 1 + offset;   /* the last key the block's last token sees */
        if (last > S - 1) last = S - 1;
        for (long k = 0; k * KB <= last; k++) {
            const long s0 = k * KB;
            const int n = (int)(last - s0 + 1 < KB ? last - s0 + 1 : KB);
            const float *kt = packed + k * W * KB;
            const float *v = rows + s0 * W;
            /* the block is wholly visible to every row when the block's first token sees its last key */
            const int masked = s0 + KB - 1 > t0 + offset;
            if (masked)
                for (int r = 0; r < nrows; r++) {
                    const long lim = t0 + r / H + offset - s0;   /* row r sees keys j <= lim of the block */
                    vis[r] = lim + 1 < n ? (int)(lim + 1) : n;
                }
#define TILE(r, R) (masked ? tile(qblk + (r) * W, kt, v, n, vis + (r), run_max + (r), run_sum + (r), o + (r) * DC, R, 1) \
                           : tile(qblk + (r) * W, kt, v, KB, vis, run_max + (r), run_sum + (r), o + (r) * DC, R, 0))
            TILES(TILE);
        }
        float *dst = out + t0 * H * DC;
        for (int r = 0; r < nrows; r++) {   /* every row sees key 0: run_sum > 0 */
            const float inv = 1.f / run_sum[r];
            for (int c = 0; c < DV; c++) store(dst + r * DC + c * L, load(o + r * DC + c * L) * inv);
        }
    }
    free(o);
    return 0;
}
