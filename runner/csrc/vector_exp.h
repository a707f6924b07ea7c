/* e^x on 16 floats, for the attention kernels' softmax and the gated SiLU (AVX-512).
 *
 * x = n ln2 + r with |r| <= ln2 / 2 (ln2 split in two so the reduction is exact), e^r by its
 * Taylor series to degree 7 (error below 1e-8), times 2^n: about 1 ulp.
 */
#ifndef KVCACHE_VECTOR_EXP_H
#define KVCACHE_VECTOR_EXP_H

#include <immintrin.h>

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

#endif
