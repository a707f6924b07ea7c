/* Products on bfloat16 pair panels (WEIGHTS_BF16_PAIRS, cpu_weight_dtype="bfloat16-dot"): x and
 * the weights both rounded to bfloat16, multiplied in pairs by AVX512-BF16's dot product, which
 * does twice the multiply-adds of a float32 FMA per instruction. panel_gemm() hands them here.
 *
 * Layout: panel p holds columns 16p .. 16p + 15 as [ceil(K / 2)][16][2] bfloat16: for each pair
 * of k (k, k + 1) and each column, its two weights side by side, K zero-padded to even. x is
 * first rounded to bfloat16 (to nearest even, as torch rounds; the instruction reads subnormals
 * as zero) into groups of 16 rows, [pairs][16] 32-bit pairs a group, so a tile's 16 rows of
 * one pair are one cache line, read at fixed offsets from one pointer (16 row pointers of their
 * own spill registers: 1.2x slower). One 64-byte load of the panel then
 * feeds 16 instructions of 32 multiply-adds. A pair's two products are exact in float32 and
 * summed before they are added to the accumulator: a sequential sum over pairs, so a row's
 * result still does not depend on the other rows of the call. */

#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>

#include "panel_tiling.h"

#ifdef __AVX512BF16__
enum { PARALLEL_ROUNDING = 1 << 15 }; /* elements of x: below, one thread rounds them all */

long panel_gemm_has_pairs(void) { return 1; }

/* rows x panels of y from group g of xg (x's pairs, as above), as panel_tile. */
static inline __attribute__((always_inline)) void pair_tile(
    const unsigned *restrict xg, const void *restrict panel, long stride, float *restrict y,
    long pairs, long ldy, long col0, long row0, const int rows, const int panels)
{
    __m512 acc[MAX_ROWS][WIDE];
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < panels; j++)
            acc[r][j] = _mm512_setzero_ps();
    const unsigned *xk = xg + row0 / MAX_ROWS * pairs * MAX_ROWS;
    for (long k = 0; k < pairs; k++, xk += MAX_ROWS) {
        __m512bh w[WIDE];
        for (int j = 0; j < panels; j++) {
            const char *at = (const char *)panel + j * stride + k * 64;
            w[j] = (__m512bh)_mm512_loadu_si512((const void *)at);
            __builtin_prefetch(at + PREFETCH_AHEAD, 0, PREFETCH_LOCALITY);
        }
        for (int r = 0; r < rows; r++) {
            __m512bh s = (__m512bh)_mm512_set1_epi32((int)xk[r]);
            for (int j = 0; j < panels; j++)
                acc[r][j] = _mm512_dpbf16_ps(acc[r][j], w[j], s);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < panels; j++)
            _mm512_storeu_ps(y + (row0 + r) * ldy + col0 + j * LANES, acc[r][j]);
}

#define PAIR_CASE(R, W) \
    case R: \
        pair_tile(xg, panel, stride, y, pairs, ldy, p * LANES, row0, R, W); \
        break;

/* Rows row0 .. row0 + rows - 1 (rows <= 16, row0 a multiple of 16) against panel p, or
 * against WIDE panels from p when `wide` (rows <= FEW_ROWS, p + WIDE <= panels): the switch
 * makes both constants. */
static void pair_block(const unsigned *xg, const void *packed, float *y, long pairs, long panels,
                       long p, long row0, int rows, int wide)
{
    const long stride = pairs * 64, ldy = panels * LANES;
    const char *panel = (const char *)packed + p * stride;
    TILE_SWITCH(PAIR_CASE)
}

/* x [M, K] float32 rounded to bfloat16 pairs in groups of 16 rows (layout above), the odd
 * K's last pair padded with a zero, in the calling thread's buffer (thread_buffer). */
static const unsigned *pair_groups(const float *x, long ldx, long M, long K, long pairs)
{
    const long groups = (M + MAX_ROWS - 1) / MAX_ROWS;
    unsigned *out = thread_buffer(groups * pairs * MAX_ROWS);
    if (out == NULL)
        return NULL;
    /* A decode step's few rows are not worth a parallel region of their own. */
#pragma omp parallel for schedule(static) if (M * K >= PARALLEL_ROUNDING)
    for (long r = 0; r < M; r++) {
        const float *row = x + r * ldx;
        unsigned *dst = out + r / MAX_ROWS * pairs * MAX_ROWS + r % MAX_ROWS;
        for (long k = 0; k < K; k += 32) {
            const long left = K - k;
            const __mmask16 lo = left >= 16 ? 0xFFFF : (__mmask16)((1u << left) - 1);
            const __mmask16 hi = left >= 32 ? 0xFFFF
                                 : left > 16 ? (__mmask16)((1u << (left - 16)) - 1)
                                             : 0;
            __m512i both = (__m512i)_mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(hi, row + k + 16),
                                                        _mm512_maskz_loadu_ps(lo, row + k));
            unsigned lanes[16] __attribute__((aligned(64)));
            _mm512_store_si512((void *)lanes, both);
            const long n = left >= 32 ? 16 : (left + 1) / 2;
            for (long i = 0; i < n; i++)
                dst[(k / 2 + i) * MAX_ROWS] = lanes[i];
        }
    }
    return out;
}

struct pair_args {
    const unsigned *xg;
    const void *packed;
    float *y;
    long pairs, panels;
};

static void pair_task(const void *args, long p, long row0, int rows, int wide)
{
    const struct pair_args *a = args;
    pair_block(a->xg, a->packed, a->y, a->pairs, a->panels, p, row0, rows, wide);
}

void pair_gemm(const float *x, long ldx, const void *packed, float *y, long M, long K,
               long panels)
{
    const long pairs = (K + 1) / 2;
    const unsigned *xg = pair_groups(x, ldx, M, K, pairs);
    if (xg == NULL) { /* no memory for the rounded rows: NaN, never stale numbers, and a word */
        fprintf(stderr, "pair_gemm: no memory to round %ld rows of %ld\n", M, K);
        fill_nan(y, M, panels);
        return;
    }
    const struct pair_args args = {xg, packed, y, pairs, panels};
    walk_tiles(M, panels, pairs * 4, pair_task, &args);
}
#else
PRODUCT_NOT_BUILT(pair_gemm, panel_gemm_has_pairs)
#endif
