/* Row-wise work between the products, for the CPU: RMSNorm and the gated SiLU and GeLU.
 *
 * torch runs RMSNorm as five passes over the rows (square, mean, add, rsqrt, two scalings) and
 * the gated activation as two (silu, multiply), each its own parallel region; in a decode step
 * of a small model, where a row is 576 floats, those regions cost more than the arithmetic.
 * Here each is one pass, with the same operations in the same order per element as
 * transformers' code (float32 throughout), so results differ only in the order of the
 * sum of squares. Built with the other kernels by runner/backends/cpu/loader.py (AVX-512 machines).
 */
#include <immintrin.h>

#include "vector_exp.h"

/* Below this many floats a call runs on one thread: a decode step's rows are done in a few
 * microseconds, less than waking the other threads costs. */
enum { LANES = 16, PARALLEL_FLOATS = 32768 };

/* y[r] = w * (x[r] * rsqrt(mean(x[r]^2) + eps)) for rows of dim floats (a multiple of 16),
 * ldx and ldy floats apart. */
void rms_norm_rows(const float *x, long ldx, const float *w, float *y, long ldy, long rows,
                   long dim, float eps)
{
    #pragma omp parallel for schedule(static) if (rows * dim > PARALLEL_FLOATS)
    for (long r = 0; r < rows; r++) {
        const float *xr = x + r * ldx;
        float *yr = y + r * ldy;
        __m512 squares = _mm512_setzero_ps();
        for (long i = 0; i < dim; i += LANES) {
            __m512 v = _mm512_loadu_ps(xr + i);
            squares = _mm512_fmadd_ps(v, v, squares);
        }
        float inv = 1.0f / __builtin_sqrtf(_mm512_reduce_add_ps(squares) / (float)dim + eps);
        __m512 scale = _mm512_set1_ps(inv);
        for (long i = 0; i < dim; i += LANES) {
            __m512 normed = _mm512_mul_ps(_mm512_loadu_ps(xr + i), scale);
            _mm512_storeu_ps(yr + i, _mm512_mul_ps(_mm512_loadu_ps(w + i), normed));
        }
    }
}

/* x, y [rows, dim], contiguous. */
void rms_norm(const float *x, const float *w, float *y, long rows, long dim, float eps)
{
    rms_norm_rows(x, dim, w, y, dim, rows, dim, eps);
}

/* One row of a gated activation: out[i] = act(gate[i]) * up[i] for width floats (a multiple
 * of 16). */
typedef void (*gated_row_fn)(const float *gate, const float *up, float *out, long width);

/* The rows of gate_up [rows, 2 * width], each [gate (width) | up (width)], through `row` into
 * out, whose rows are ldo floats apart. Each row function keeps its own compile attributes
 * (the GeLU's rounding depends on them), so a row is a call rather than an inlined body. */
static void gated_rows(gated_row_fn row, const float *gate_up, float *out, long ldo, long rows,
                       long width)
{
    #pragma omp parallel for schedule(static) if (rows * width > PARALLEL_FLOATS)
    for (long r = 0; r < rows; r++) {
        const float *gate = gate_up + r * 2 * width;
        row(gate, gate + width, out + r * ldo, width);
    }
}

/* silu(g) = g / (1 + e^-g), as torch computes it. */
static void silu_row(const float *gate, const float *up, float *o, long width)
{
    for (long i = 0; i < width; i += LANES) {
        __m512 g = _mm512_loadu_ps(gate + i);
        __m512 denom = _mm512_add_ps(_mm512_set1_ps(1.0f),
                                     exp_any(_mm512_sub_ps(_mm512_setzero_ps(), g)));
        __m512 silu = _mm512_div_ps(g, denom);
        _mm512_storeu_ps(o + i, _mm512_mul_ps(silu, _mm512_loadu_ps(up + i)));
    }
}

/* out[r] = silu(gate) * up, gate_up[r] = [gate (width) | up (width)]; width a multiple of 16;
 * rows of out ldo floats apart. */
void silu_and_mul_rows(const float *gate_up, float *out, long ldo, long rows, long width)
{
    gated_rows(silu_row, gate_up, out, ldo, rows, width);
}

/* out [rows, width], contiguous. */
void silu_and_mul(const float *gate_up, float *out, long rows, long width)
{
    silu_and_mul_rows(gate_up, out, width, rows, width);
}

/* e^v for 8 doubles with v in [-20, 0]: v = n ln2 + r, |r| <= ln2 / 2 (ln2 split so n ln2 is
 * exact), e^r by its Taylor series to degree 11 (truncation below 1e-14), times 2^n. */
static inline __m512d exp_double(__m512d v)
{
    static const double taylor[] = {1.0 / 3628800, 1.0 / 362880, 1.0 / 40320, 1.0 / 5040,
                                    1.0 / 720,     1.0 / 120,    1.0 / 24,    1.0 / 6,
                                    0.5,           1.0,          1.0};
    __m512d n = _mm512_roundscale_pd(_mm512_mul_pd(v, _mm512_set1_pd(1.4426950408889634)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512d r = _mm512_fnmadd_pd(n, _mm512_set1_pd(0x1.62e42fefa3800p-1), v);
    r = _mm512_fnmadd_pd(n, _mm512_set1_pd(0x1.ef35793c76730p-45), r);
    __m512d p = _mm512_set1_pd(1.0 / 39916800);
    for (int i = 0; i < (int)(sizeof taylor / sizeof *taylor); i++)
        p = _mm512_fmadd_pd(p, r, _mm512_set1_pd(taylor[i]));
    return _mm512_scalef_pd(p, n);
}

/* tanh of 8 doubles to about 1e-13 relative: (1 - e) / (1 + e) with e = e^-2|u| (|u| clamped
 * to 10, where tanh is 1 to far below a float's precision), and where that would cancel
 * (|u| < 2^-10) its odd series to u^7 instead; the sign of u put back last. */
static inline __m512d tanh_double(__m512d u)
{
    const __m512d one = _mm512_set1_pd(1.0);
    __m512d a = _mm512_min_pd(_mm512_abs_pd(u), _mm512_set1_pd(10.0));
    __m512d e = exp_double(_mm512_mul_pd(a, _mm512_set1_pd(-2.0)));
    __m512d t = _mm512_div_pd(_mm512_sub_pd(one, e), _mm512_add_pd(one, e));
    __m512d a2 = _mm512_mul_pd(a, a);
    __m512d series = _mm512_fmadd_pd(_mm512_set1_pd(-17.0 / 315), a2, _mm512_set1_pd(2.0 / 15));
    series = _mm512_fmadd_pd(series, a2, _mm512_set1_pd(-1.0 / 3));
    series = _mm512_fmadd_pd(_mm512_mul_pd(series, a2), a, a);
    __mmask8 small = _mm512_cmp_pd_mask(a, _mm512_set1_pd(0x1p-10), _CMP_LT_OQ);
    t = _mm512_mask_blend_pd(small, t, series);
    return _mm512_or_pd(t, _mm512_and_pd(u, _mm512_set1_pd(-0.0)));
}

/* tanh of 16 floats, each half widened to double and its tanh rounded back once: correctly
 * rounded but where a 1e-13 error straddles a rounding boundary (none in 10^7 random values
 * against torch's double tanh, rounded). Not vector_exp.h's tanh_ps, the attention soft cap's:
 * that one stays in float for the score loop's speed and is off by up to 2.4 ulp, which the
 * GeLU would pass on as differences from torch's F.gelu. */
static inline __m512 tanh_float(__m512 u)
{
    __m256 high = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(u), 1));
    __m256 lo = _mm512_cvtpd_ps(tanh_double(_mm512_cvtps_pd(_mm512_castps512_ps256(u))));
    __m256 hi = _mm512_cvtpd_ps(tanh_double(_mm512_cvtps_pd(high)));
    return _mm512_insertf32x8(_mm512_castps256_ps512(lo), hi, 1);
}

/* gelu_tanh(x) = 0.5 x (1 + tanh(beta (x + kappa x^3))) with torch's roundings: beta and kappa
 * rounded to float, x + kappa x^3 in one fused multiply-add (as torch's build of its vector
 * kernel computes it: two to eight times fewer differences from F.gelu than with two
 * roundings), every other operation rounded on its own. torch's vector tanh (SLEEF's) is within
 * one ulp but not always correctly rounded, so a few values in 10^3 differ from F.gelu by one
 * ulp of tanh (tests/test_cpu_layers_gemma.py bounds it). The modules call this same kernel
 * (MLP.forward), so the C layers and the module path agree bit for bit. */
__attribute__((optimize("fp-contract=off")))
static void gelu_tanh_row(const float *gate, const float *up, float *o, long width)
{
    const __m512 beta = _mm512_set1_ps((float)0.79788456080286535588);
    const __m512 kappa = _mm512_set1_ps(0.044715f);
    const __m512 half = _mm512_set1_ps(0.5f), one = _mm512_set1_ps(1.0f);
    for (long i = 0; i < width; i += LANES) {
        __m512 x = _mm512_loadu_ps(gate + i);
        __m512 cube = _mm512_mul_ps(_mm512_mul_ps(x, x), x);
        __m512 inner = _mm512_mul_ps(beta, _mm512_fmadd_ps(kappa, cube, x));
        __m512 gelu = _mm512_mul_ps(_mm512_mul_ps(half, x),
                                    _mm512_add_ps(one, tanh_float(inner)));
        _mm512_storeu_ps(o + i, _mm512_mul_ps(gelu, _mm512_loadu_ps(up + i)));
    }
}

/* out[r] = gelu_tanh(gate) * up, gate_up[r] = [gate (width) | up (width)]; width a multiple of
 * 16; rows of out ldo floats apart. */
void gelu_tanh_and_mul_rows(const float *gate_up, float *out, long ldo, long rows, long width)
{
    gated_rows(gelu_tanh_row, gate_up, out, ldo, rows, width);
}

/* out [rows, width], contiguous. */
void gelu_tanh_and_mul(const float *gate_up, float *out, long rows, long width)
{
    gelu_tanh_and_mul_rows(gate_up, out, width, rows, width);
}
