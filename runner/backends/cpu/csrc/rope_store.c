/* One token's step between the qkv product and attention, for runner/backends/cpu/csrc/layers.c: q and k
 * normed where the model norms them (per head: Qwen3, Gemma 3; across heads: OLMo 2), rotated
 * (RoPE), k and v written to the paged cache. The operations and their order per element are
 * those of runner/model/decoder_layers.py Attention.forward and runner/model/layers.py apply_rope, so the
 * results are bit for bit the module path's.
 */
#include <immintrin.h>
#include <string.h>

#include "kernels.h"

enum { LANES = 16 };

/* Rotate-half RoPE of one head, as runner/model/layers.py apply_rope computes it: x * cos, then
 * cat(x2, x1) * sin, then their sum, each rounded on its own (no fused multiply-add, which
 * would round once and differ from torch in the last bit). cos/sin as rope_cos_sin lays them
 * out: cos repeated over both halves, sin negated over the first. Only the first `rot` of the
 * d dimensions rotate (rotate-half among themselves: partial rotary); the rest pass through. */
__attribute__((optimize("fp-contract=off")))
static void rotate(const float *restrict x, const float *restrict cos, const float *restrict sin,
                   float *restrict y, long d, long rot)
{
    long half = rot / 2;
    for (long i = 0; i < rot; i++) {
        float direct = x[i] * cos[i];
        float rotated = x[i < half ? i + half : i - half] * sin[i];
        y[i] = direct + rotated;
    }
    for (long i = rot; i < d; i++)
        y[i] = x[i];
}

/* n floats (a multiple of 16) as float16, rounded to nearest even as torch's .half() does. */
static void store_half(unsigned short *restrict dst, const float *restrict src, long n)
{
    for (long i = 0; i < n; i += LANES)
        _mm256_storeu_si256((__m256i *)(dst + i),
                            _mm512_cvtps_ph(_mm512_loadu_ps(src + i),
                                            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

/* RoPE (after q_norm / k_norm where they are not NULL: per head, or across all heads with
 * qk_across) of one token's q heads into q, and of its k heads into the cache slot k (none
 * where k is NULL); v copied beside them (float32 slots, or float16 ones when kv_half: rounded
 * as they are stored). row: the token's qkv [(hq + 2 hkv) * d]. normed: scratch of
 * (hq + hkv) * d floats. rot: the rotated dims of a head (0: none, the layer has no RoPE). */
void rotate_and_store(const float *row, const float *q_norm, const float *k_norm,
                      const float *cos, const float *sin, float *q, void *k, void *v, long hq,
                      long hkv, long d, long rot, float eps, float *normed, int kv_half,
                      int qk_across)
{
    const float *q_src = row, *k_src = row + hq * d;
    if (q_norm && qk_across) { /* OLMo 2: one norm across all heads */
        rms_norm_rows(q_src, hq * d, q_norm, normed, hq * d, 1, hq * d, eps);
        rms_norm_rows(k_src, hkv * d, k_norm, normed + hq * d, hkv * d, 1, hkv * d, eps);
        q_src = normed;
        k_src = normed + hq * d;
    } else if (q_norm) { /* Qwen3, Gemma 3: one per head */
        rms_norm_rows(q_src, d, q_norm, normed, d, hq, d, eps);
        rms_norm_rows(k_src, d, k_norm, normed + hq * d, d, hkv, d, eps);
        q_src = normed;
        k_src = normed + hq * d;
    }
    for (long head = 0; head < hq; head++)
        rotate(q_src + head * d, cos, sin, q + head * d, d, rot);
    if (!k)
        return;
    const float *v_src = row + (hq + hkv) * d;
    if (!kv_half) {
        for (long head = 0; head < hkv; head++)
            rotate(k_src + head * d, cos, sin, (float *)k + head * d, d, rot);
        memcpy(v, v_src, hkv * d * sizeof(float));
        return;
    }
    float rotated[hkv * d];
    for (long head = 0; head < hkv; head++)
        rotate(k_src + head * d, cos, sin, rotated + head * d, d, rot);
    store_half(k, rotated, hkv * d);
    store_half(v, v_src, hkv * d);
}
