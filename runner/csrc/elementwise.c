/* Row-wise work between the products, for the CPU: RMSNorm and the gated SiLU.
 *
 * torch runs RMSNorm as five passes over the rows (square, mean, add, rsqrt, two scalings) and
 * the gated activation as two (silu, multiply), each its own parallel region; in a decode step
 * of a small model, where a row is 576 floats, those regions cost more than the arithmetic.
 * Here each is one pass, with the same operations in the same order per element as
 * transformers' code (float32 throughout), so results differ only in the order of the
 * sum of squares. Built with the other kernels by runner/cpu_kernel_loader.py (AVX-512 machines).
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

/* out[r] = silu(gate) * up, gate_up[r] = [gate (width) | up (width)]; width a multiple of 16;
 * rows of out ldo floats apart. silu(g) = g / (1 + e^-g), as torch computes it. */
void silu_and_mul_rows(const float *gate_up, float *out, long ldo, long rows, long width)
{
    #pragma omp parallel for schedule(static) if (rows * width > PARALLEL_FLOATS)
    for (long r = 0; r < rows; r++) {
        const float *gate = gate_up + r * 2 * width, *up = gate + width;
        float *o = out + r * ldo;
        for (long i = 0; i < width; i += LANES) {
            __m512 g = _mm512_loadu_ps(gate + i);
            __m512 denom = _mm512_add_ps(_mm512_set1_ps(1.0f),
                                         exp_any(_mm512_sub_ps(_mm512_setzero_ps(), g)));
            __m512 silu = _mm512_div_ps(g, denom);
            _mm512_storeu_ps(o + i, _mm512_mul_ps(silu, _mm512_loadu_ps(up + i)));
        }
    }
}

/* out [rows, width], contiguous. */
void silu_and_mul(const float *gate_up, float *out, long rows, long width)
{
    silu_and_mul_rows(gate_up, out, width, rows, width);
}
