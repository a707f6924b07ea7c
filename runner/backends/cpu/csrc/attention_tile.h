/* What the attention kernels share: a tile of 16 query rows (one per vector
 * lane) walking paged keys 16 at a time (prefill_attention.c, and the shared-prefix part of
 * decode_attention.c).
 *
 * With every lane a query row, a 16 x 16 tile of scores is 16 vectors, one per key: each is a
 * sum over d of key[d] (broadcast) * q^T[d], so no horizontal sum is ever needed, and the
 * streaming softmax (running max and sum per row) is plain vector arithmetic. Values go the
 * same way: out^T[d] += value[d] (broadcast) * p. AVX-512; D a multiple of 16 up to 256.
 *
 * Tiles read float32 keys. A float16 cache (kv_cache_dtype="float16") is widened first, once
 * per step, by widen_blocks: a tile reads every key up to its last row's position, so widening
 * as the tiles read would widen a long context once per tile of 16 rows (+26% of a
 * 1,400-token prompt's attention, against ~2% for one pass first).
 */
#ifndef KVCACHE_ATTENTION_TILE_H
#define KVCACHE_ATTENTION_TILE_H

#include <immintrin.h>
#include <math.h>

#include "vector_exp.h"

enum { TILE = 16, TILE_MAX_DIM = 256 };

/* A tile's softmax state: per lane (row) the running max and sum, and out^T unnormalised. */
struct tile_state {
    __m512 running_max, running_sum;
    float acc[TILE_MAX_DIM][TILE] __attribute__((aligned(64)));
};

/* Where a tile reads its keys: token t of the sequence is row t % B of block table[t / B], at
 * head `head` of rows `row_stride` floats apart. */
struct paged_keys {
    const float *k_cache, *v_cache;
    const int *table;
    long block_size, row_stride, head, d;
};

/* 16 elements of a cache row from element `at` on, as float32 (exactly: every half is a
 * float). */
static inline __attribute__((always_inline)) __m512 load_cache16(const void *cache, long at,
                                                                 const int half)
{
    if (half)
        return _mm512_cvtph_ps(
            _mm256_loadu_si256((const __m256i *)((const unsigned short *)cache + at)));
    return _mm512_loadu_ps((const float *)cache + at);
}

/* Blocks table[0 .. n - 1] of float16 caches, widened to float32 into k_out and v_out in that
 * order; `row` elements a block (a multiple of 16). */
static void widen_blocks(const void *k_cache, const void *v_cache, const int *table, long n,
                         long row, float *k_out, float *v_out)
{
    #pragma omp parallel for schedule(static)
    for (long b = 0; b < n; b++) {
        const long src = (long)table[b] * row;
        for (long i = 0; i < row; i += TILE) {
            _mm512_storeu_ps(k_out + b * row + i, load_cache16(k_cache, src + i, 1));
            _mm512_storeu_ps(v_out + b * row + i, load_cache16(v_cache, src + i, 1));
        }
    }
}

/* n scores in place, each s as softcap * tanh(s / softcap) (vector_exp.h). */
static inline void soft_cap_scores(float *scores, long n, float softcap)
{
    const __m512 cap = _mm512_set1_ps(softcap);
    for (long t = 0; t < n; t += TILE) {
        const __mmask16 live = n - t >= TILE ? 0xFFFF : (__mmask16)((1u << (n - t)) - 1);
        _mm512_mask_storeu_ps(scores + t, live,
                              soft_cap_ps(_mm512_maskz_loadu_ps(live, scores + t), cap));
    }
}

/* a * b, rounded on its own: a builtin with a rounding mode, which GCC never contracts with a
 * following add into an FMA (it may contract _mm512_mul_ps, a plain vector multiply). */
static inline __m512 mul_unfused(__m512 a, __m512 b)
{
    return _mm512_mul_round_ps(a, b, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

/* A tile's state before its first key: no max, no sum, out^T zero. */
static inline void tile_start(struct tile_state *state, long d)
{
    for (long j = 0; j < d; j++)
        _mm512_store_ps(state->acc[j], _mm512_setzero_ps());
    state->running_max = _mm512_set1_ps(-INFINITY);
    state->running_sum = _mm512_setzero_ps();
}

/* tile_attend's body; CAP (a constant in each instance) says whether scores are capped, so the
 * uncapped instance is the loop it was before caps existed, instruction for instruction. */
static inline __attribute__((always_inline)) void tile_attend_body(
    const float qt[][TILE], const struct paged_keys *src, long key_begin, long key_end,
    const int lows[TILE], const int positions[TILE], float softcap, struct tile_state *state,
    const int CAP)
{
    const long d = src->d;
    /* Token rows a multiple of 4 KB apart (Hkv * D = 1024, 2048, ...) put the 16 keys of a
     * chunk in one L1 set, where they evict each other (96 against 135 GFLOP/s for a copy
     * first, at 8 KV heads of 128); 2 KB apart they fit the set's 8 ways, and copying costs. */
    const int aliasing = src->row_stride % 1024 == 0;
    float key_copy[TILE][TILE_MAX_DIM + TILE] __attribute__((aligned(64)));
    float value_copy[TILE][TILE_MAX_DIM + TILE] __attribute__((aligned(64)));
    float probs[TILE][TILE] __attribute__((aligned(64))); /* p per key, lanes = rows */
    const __m512i position = _mm512_loadu_si512(positions);
    const __m512i low = lows ? _mm512_loadu_si512(lows) : _mm512_set1_epi32((int)key_begin);
    for (long first = key_begin; first < key_end; first += TILE) {
        const float *keys[TILE], *values[TILE];
        for (long t = 0; t < TILE; t++) {
            long key = first + t < key_end ? first + t : key_end - 1;
            long offset = ((long)src->table[key / src->block_size] * src->block_size
                           + key % src->block_size) * src->row_stride + src->head * d;
            keys[t] = src->k_cache + offset;
            values[t] = src->v_cache + offset;
            if (aliasing) { /* read from copies whose rows are not 4 KB apart */
                for (long j = 0; j < d; j++) {
                    key_copy[t][j] = keys[t][j];
                    value_copy[t][j] = values[t][j];
                }
                keys[t] = key_copy[t];
                values[t] = value_copy[t];
            }
        }
        __m512 s[TILE];
        for (int t = 0; t < TILE; t++)
            s[t] = _mm512_setzero_ps();
        for (long j = 0; j < d; j++) {
            __m512 qj = _mm512_load_ps(qt[j]);
            for (int t = 0; t < TILE; t++)
                s[t] = _mm512_fmadd_ps(_mm512_set1_ps(keys[t][j]), qj, s[t]);
        }
        if (CAP) {
            const __m512 cap = _mm512_set1_ps(softcap);
            for (int t = 0; t < TILE; t++)
                s[t] = soft_cap_ps(s[t], cap);
        }
        /* key first + t counts for the rows whose position is at or past it and whose window
         * reaches back to it (and exists); the others give it no weight at all */
        __m512 chunk_max = state->running_max;
        __mmask16 visible[TILE];
        for (int t = 0; t < TILE; t++) {
            const __m512i key = _mm512_set1_epi32((int)(first + t));
            visible[t] = first + t < key_end
                ? _mm512_mask_cmpge_epi32_mask(_mm512_cmple_epi32_mask(low, key), position, key)
                : 0;
            chunk_max = _mm512_max_ps(chunk_max,
                                      _mm512_mask_mov_ps(state->running_max, visible[t], s[t]));
        }
        /* A row whose window starts in a later chunk has seen no key yet: its max is still
         * -inf, and -inf - -inf a NaN; its shrink is 0 instead (its sum and acc are 0 anyway).
         * Every other row's max is finite from its first key on. */
        const __mmask16 seen = _mm512_cmp_ps_mask(chunk_max, _mm512_set1_ps(-INFINITY),
                                                  _CMP_NEQ_OQ);
        __m512 shrink = _mm512_maskz_mov_ps(
            seen, exp_nonpositive(_mm512_sub_ps(state->running_max, chunk_max)));
        state->running_max = chunk_max;
        /* A multiply the compiler may not fuse with the first add below into one FMA (it may
         * fuse a plain one): tiled_decode.c repeats this sum operation for operation. */
        __m512 sum = mul_unfused(state->running_sum, shrink);
        for (int t = 0; t < TILE; t++) {
            __m512 p = _mm512_maskz_mov_ps(visible[t],
                                           exp_nonpositive(_mm512_sub_ps(s[t], chunk_max)));
            sum = _mm512_add_ps(sum, p);
            _mm512_store_ps(probs[t], p);
        }
        state->running_sum = sum;
        for (long j0 = 0; j0 < d; j0 += TILE) {
            __m512 part[TILE];
            for (int j = 0; j < TILE; j++)
                part[j] = _mm512_mul_ps(_mm512_load_ps(state->acc[j0 + j]), shrink);
            /* Only the rows that see key t add it: for the others it is no term at all, not
             * a term 0 * v (which turns an accumulated -0 into +0), so a row's sum is the same
             * whatever rows and keys its tile holds beside it (deterministic mode). */
            for (int t = 0; t < TILE; t++) {
                __m512 p = _mm512_load_ps(probs[t]);
                const float *value = values[t] + j0;
                for (int j = 0; j < TILE; j++)
                    part[j] = _mm512_mask3_fmadd_ps(_mm512_set1_ps(value[j]), p, part[j],
                                                    visible[t]);
            }
            for (int j = 0; j < TILE; j++)
                _mm512_store_ps(state->acc[j0 + j], part[j]);
        }
    }
}

static void tile_attend_capped(const float qt[][TILE], const struct paged_keys *src,
                               long key_begin, long key_end, const int lows[TILE],
                               const int positions[TILE], float softcap, struct tile_state *state)
{
    tile_attend_body(qt, src, key_begin, key_end, lows, positions, softcap, state, 1);
}

static void tile_attend_uncapped(const float qt[][TILE], const struct paged_keys *src,
                                 long key_begin, long key_end, const int lows[TILE],
                                 const int positions[TILE], struct tile_state *state)
{
    tile_attend_body(qt, src, key_begin, key_end, lows, positions, 0.0f, state, 0);
}

/* Lanes of qt [d][16] (the rows' queries, transposed and scaled) against keys key_begin ..
 * key_end - 1, carrying on from `state` (tile_start's, or where an earlier call over the keys
 * before key_begin left it: deterministic decodes go on from a shared prefix's state); lane i sees keys lows[i] .. positions[i] (lows NULL: from key_begin; a sliding
 * window's start otherwise), at least one of them. key_begin need not start a block. softcap >
 * 0: each score s counts as softcap * tanh(s / softcap) (the logit soft cap; 0: none). */
static inline void tile_attend(const float qt[][TILE], const struct paged_keys *src,
                               long key_begin, long key_end, const int lows[TILE],
                               const int positions[TILE], float softcap, struct tile_state *state)
{
    if (softcap > 0.0f)
        tile_attend_capped(qt, src, key_begin, key_end, lows, positions, softcap, state);
    else
        tile_attend_uncapped(qt, src, key_begin, key_end, lows, positions, state);
}

#endif
