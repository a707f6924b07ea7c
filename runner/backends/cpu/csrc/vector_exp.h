/* e^x on 16 floats, for the attention kernels' softmax and the gated SiLU, and tanh from it for
 * their logit soft cap (AVX-512).
 *
 * x = n ln2 + r with |r| <= ln2 / 2 (ln2 split in two so the reduction is exact), e^r by its
 * Taylor series to degree 7 (error below 1e-8), times 2^n: about 1 ulp.
 */
#ifndef KVCACHE_VECTOR_EXP_H
#define KVCACHE_VECTOR_EXP_H

#include <immintrin.h>
#include <stdint.h>

/* e^x for x in [-87, 88], where it is a normal float. */
static inline __m512 exp_in_range(__m512 x)
{
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.0f / 5040);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* e^x for x <= 0. Below -87 it returns e^-87, negligible beside any softmax sum it joins. */
static inline __m512 exp_nonpositive(__m512 x)
{
    return exp_in_range(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)));
}

/* e^x for any float x, clamped to [-87, 88] first (silu needs no more). */
static inline __m512 exp_any(__m512 x)
{
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
    return exp_in_range(x);
}

/* tanh on 16 floats, within a few ulp of the correctly rounded float over the whole line
 * (relative; tests/backends/cpu/test_cpu_features.py measures it). For |x| >= TANH_SERIES_END, (1 - e) /
 * (1 + e) with e = e^-2|x| <= 0.55 (exp_in_range's ~1 ulp): 1 - e >= 0.45 loses nothing to
 * cancellation, and past |x| = 43.5 e is e^-87, which leaves exactly 1. Below it 1 - e would
 * cancel (at |x| = 0.01 it would keep only ~17 of the result's 24 bits), so there the Taylor
 * series to degree 11, whose first omitted term is under 3e-9 relative. The sign is x's:
 * tanh(-x) = -tanh(x) exactly. A NaN stays NaN (the clamp in exp_nonpositive would make it 1). */
#define TANH_SERIES_END 0.3f
static inline __m512 tanh_ps(__m512 x)
{
    const __m512 ax = _mm512_abs_ps(x);
    const __m512 one = _mm512_set1_ps(1.0f);
    const __m512 e = exp_nonpositive(_mm512_mul_ps(ax, _mm512_set1_ps(-2.0f)));
    const __m512 far = _mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e));
    const __m512 x2 = _mm512_mul_ps(ax, ax);
    __m512 c = _mm512_set1_ps(-1382.0f / 155925);
    c = _mm512_fmadd_ps(c, x2, _mm512_set1_ps(62.0f / 2835));
    c = _mm512_fmadd_ps(c, x2, _mm512_set1_ps(-17.0f / 315));
    c = _mm512_fmadd_ps(c, x2, _mm512_set1_ps(2.0f / 15));
    c = _mm512_fmadd_ps(c, x2, _mm512_set1_ps(-1.0f / 3));
    /* |x| + |x|^3 c(x^2) in one fused step: the rest's rounding errors count |x|^2 / 3 times
     * less than the leading term's */
    const __m512 near = _mm512_fmadd_ps(_mm512_mul_ps(ax, x2), c, ax);
    const __mmask16 is_near = _mm512_cmp_ps_mask(ax, _mm512_set1_ps(TANH_SERIES_END), _CMP_LT_OQ);
    __m512 magnitude = _mm512_mask_mov_ps(far, is_near, near);
    magnitude = _mm512_mask_mov_ps(magnitude, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), x);
    const __m512i sign = _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(INT32_MIN));
    return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(magnitude), sign));
}

/* The logit soft cap on 16 scores: cap * tanh(s / cap), in that order (transformers' Gemma 2:
 * divide, tanh, multiply), cap > 0: every score then lies within [-cap, cap]. */
static inline __m512 soft_cap_ps(__m512 s, __m512 cap)
{
    return _mm512_mul_ps(cap, tanh_ps(_mm512_div_ps(s, cap)));
}

#endif
