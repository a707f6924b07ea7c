/* Products on int8 quad panels (WEIGHTS_INT8_QUADS, cpu_weight_dtype="int8-dot"): x and the
 * weights both quantized to int8, multiplied four at a time by AVX512-VNNI's vpdpbusd, which
 * sums 64 byte products into 16 int32 lanes per instruction. panel_gemm() hands them here.
 *
 * Why int8 and not bfloat16 pairs for speed: on the Sapphire Rapids this was measured on, one
 * core issues two float32 FMAs a cycle but one vdpbf16ps, so bfloat16 pairs do the same 64
 * multiply-adds a cycle as float32 (203 GF/s each, measured), while vpdpbusd runs 1.4 a cycle:
 * 2.8x float32's multiply-adds.
 *
 * Layout: panel p holds columns 16p .. 16p + 15 as [ceil(K / 4)][16][4] int8: for each quad of
 * k (k .. k + 3) and each column, its four weights side by side, K zero-padded to a multiple of
 * 4; then 64 bytes of the columns' float32 scales and 64 of their int32 offsets (128 times the
 * column's sum of weights). A column's weights are q * s, q in [-127, 127], one scale s per
 * column (runner/backends/cpu/quant.py quantize_int8_columns).
 *
 * x is quantized per row the same way (s = max |x| / 127, q = round(x / s) to nearest even, as
 * torch.round), and stored as q + 128, unsigned as vpdpbusd reads its first operand, in groups
 * of 16 rows, [quads][16] 32-bit quads a group (one cache line per quad of a tile's rows, as
 * pair_gemm.c lays out pairs). The int32 sums are exact; subtracting the column's offset takes
 * the 128 back out, and the result is scaled once by s_x * s_w: y = float(sum) * (s_x * s_w).
 * Each row's sum is its own, so a row's result does not depend on the other rows of the call.
 */

#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>

#include "panel_tiling.h"

#ifdef __AVX512VNNI__
enum { PARALLEL_QUANTIZING = 1 << 15 }; /* elements of x: below, one thread quantizes them all */

long panel_gemm_has_quads(void) { return 1; }

/* acc + u . w by vpdpbusd, written as one asm statement: GCC 12 keeps the intrinsic's
 * accumulators in the wrong registers, copying all 16 twice a k quad and spilling two to the
 * stack (a store and reload on the critical path), which cost a quarter to a third of the
 * products' speed. The asm ties acc to its register, so the loop is loads and vpdpbusd only;
 * the sums are the same integers. */
static inline __attribute__((always_inline)) __m512i dpbusd(__m512i acc, __m512i u, __m512i w)
{
    __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u), "v"(w));
    return acc;
}

/* rows x panels of y from group row0 / 16 of xq (x's quads, as above), as pair_tile. */
static inline __attribute__((always_inline)) void quad_tile(
    const unsigned *restrict xq, const float *restrict xs, const void *restrict panel,
    long stride, float *restrict y, long quads, long ldy, long col0, long row0, const int rows,
    const int panels)
{
    __m512i acc[MAX_ROWS][WIDE];
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < panels; j++)
            acc[r][j] = _mm512_setzero_si512();
    const unsigned *xk = xq + row0 / MAX_ROWS * quads * MAX_ROWS;
    for (long k = 0; k < quads; k++, xk += MAX_ROWS) {
        __m512i w[WIDE];
        for (int j = 0; j < panels; j++) {
            const char *at = (const char *)panel + j * stride + k * 64;
            w[j] = _mm512_loadu_si512((const void *)at);
            __builtin_prefetch(at + PREFETCH_AHEAD, 0, PREFETCH_LOCALITY);
        }
        for (int r = 0; r < rows; r++) {
            const __m512i s = _mm512_set1_epi32((int)xk[r]);
            for (int j = 0; j < panels; j++)
                acc[r][j] = dpbusd(acc[r][j], s, w[j]);
        }
    }
    for (int j = 0; j < panels; j++) {
        const char *tail = (const char *)panel + j * stride + quads * 64;
        const __m512 scale = _mm512_loadu_ps((const void *)tail);
        const __m512i offset = _mm512_loadu_si512((const void *)(tail + 64));
        for (int r = 0; r < rows; r++) {
            const __m512 sum = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r][j], offset));
            const __m512 both = _mm512_mul_ps(_mm512_set1_ps(xs[row0 + r]), scale);
            _mm512_storeu_ps(y + (row0 + r) * ldy + col0 + j * LANES, _mm512_mul_ps(sum, both));
        }
    }
}

#define QUAD_CASE(R, W) \
    case R: \
        quad_tile(xq, xs, panel, stride, y, quads, ldy, p * LANES, row0, R, W); \
        break;

/* Rows row0 .. row0 + rows - 1 (rows <= 16, row0 a multiple of 16) against panel p, or
 * against WIDE panels from p when `wide` (rows <= FEW_ROWS, p + WIDE <= panels). */
static void quad_block(const unsigned *xq, const float *xs, const void *packed, float *y,
                       long quads, long panels, long p, long row0, int rows, int wide)
{
    const long stride = quads * 64 + 128, ldy = panels * LANES;
    const char *panel = (const char *)packed + p * stride;
    TILE_SWITCH(QUAD_CASE)
}

/* Row r of x [M, K] quantized (layout above) into out, its scale into scales[r]. */
static void quantize_row(const float *row, long K, long quads, unsigned *dst, float *scale)
{
    __m512 peak = _mm512_setzero_ps();
    for (long k = 0; k < K; k += 16) {
        const __mmask16 m = K - k >= 16 ? 0xFFFF : (__mmask16)((1u << (K - k)) - 1);
        peak = _mm512_max_ps(peak, _mm512_abs_ps(_mm512_maskz_loadu_ps(m, row + k)));
    }
    const float amax = _mm512_reduce_max_ps(peak);
    /* An all-zero row (or one of subnormals) keeps scale 1: every q is then 0. */
    const float s = amax > 0 ? amax / 127.0f : 1.0f;
    *scale = s;
    const __m512 vs = _mm512_set1_ps(s);
    for (long k = 0; k < 4 * quads; k += 16) {
        const long left = K - k;
        const __mmask16 m = left >= 16 ? 0xFFFF : left > 0 ? (__mmask16)((1u << left) - 1) : 0;
        const __m512 v = _mm512_div_ps(_mm512_maskz_loadu_ps(m, row + k), vs);
        __m512i q = _mm512_cvt_roundps_epi32(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        q = _mm512_min_epi32(_mm512_max_epi32(q, _mm512_set1_epi32(-127)), _mm512_set1_epi32(127));
        /* 16 values of k .. k + 15 (padding: q 0), offset by 128, as bytes: four quads. */
        const __m128i bytes = _mm512_cvtepi32_epi8(_mm512_add_epi32(q, _mm512_set1_epi32(128)));
        unsigned lanes[4];
        _mm_storeu_si128((void *)lanes, bytes);
        const long n = (4 * quads - k) >= 16 ? 4 : (4 * quads - k) / 4;
        for (long i = 0; i < n; i++)
            dst[(k / 4 + i) * MAX_ROWS] = lanes[i];
    }
}

/* x [M, K] quantized into groups of 16 rows, and its row scales after them, in the calling
 * thread's buffer (thread_buffer). */
static const unsigned *quad_groups(const float *x, long ldx, long M, long K, long quads,
                                   const float **scales)
{
    const long groups = (M + MAX_ROWS - 1) / MAX_ROWS;
    unsigned *out = thread_buffer(groups * quads * MAX_ROWS + groups * MAX_ROWS);
    if (out == NULL)
        return NULL;
    float *row_scales = (float *)(out + groups * quads * MAX_ROWS);
#pragma omp parallel for schedule(static) if (M * K >= PARALLEL_QUANTIZING)
    for (long r = 0; r < M; r++)
        quantize_row(x + r * ldx, K, quads, out + r / MAX_ROWS * quads * MAX_ROWS + r % MAX_ROWS,
                     row_scales + r);
    *scales = row_scales;
    return out;
}

struct quad_args {
    const unsigned *xq;
    const float *xs;
    const void *packed;
    float *y;
    long quads, panels;
};

static void quad_task(const void *args, long p, long row0, int rows, int wide)
{
    const struct quad_args *a = args;
    quad_block(a->xq, a->xs, a->packed, a->y, a->quads, a->panels, p, row0, rows, wide);
}

void quad_gemm(const float *x, long ldx, const void *packed, float *y, long M, long K,
               long panels)
{
    const long quads = (K + 3) / 4;
    const float *xs = NULL;
    const unsigned *xq = quad_groups(x, ldx, M, K, quads, &xs);
    if (xq == NULL) { /* no memory for the quantized rows: NaN, never stale numbers, and a word */
        fprintf(stderr, "quad_gemm: no memory to quantize %ld rows of %ld\n", M, K);
        fill_nan(y, M, panels);
        return;
    }
    const struct quad_args args = {xq, xs, packed, y, quads, panels};
    walk_tiles(M, panels, quads * 4, quad_task, &args);
}
#else
PRODUCT_NOT_BUILT(quad_gemm, panel_gemm_has_quads)
#endif
