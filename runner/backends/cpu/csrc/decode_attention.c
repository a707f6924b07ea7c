/* Decode attention over a paged KV cache, for the CPU: one query token per sequence.
 *
 * q [S, Hq, D]; caches [blocks, B, Hkv, D]; block_tables [S, max_blocks] int32; context_lens
 * [S] int32; out [S, Hq, D]; all float32 and contiguous. Sequence s attends to its first
 * C = context_lens[s] tokens, read in place through its block table: no gather, no padding, and
 * blocks that several sequences share (a system prompt) stay in cache for all of them. With a
 * sliding window W > 0, only to its last W: keys max(0, C - W) .. C - 1, the others never read.
 *
 * One task per (sequence, KV head) computes the G = Hq / Hkv query heads of that KV head
 * together, so each key and value row is loaded once for G heads (GQA). The softmax is the
 * streaming one: per block, scores, then a running max and sum, and the accumulator rescaled
 * when the max moves, so the result is exact softmax(q k^T * scale) v up to float rounding.
 * With a logit soft cap c > 0 (Gemma 2), each score s is c tanh(s / c) before any of that.
 *
 * When all sequences start with the same `shared_blocks` blocks (a system prompt), those keys
 * are scored first for every row at once, 16 rows per vector lane (attention_tile.h: each key
 * read once per 16 rows instead of once per G), and each task then carries that softmax state
 * on through its own later keys. That pass sees every key of the shared blocks, so with a window
 * it runs only when every window reaches back to key 0 (else shared_blocks is taken as 0).
 *
 * The caches hold float32, or float16 with kv_half (widened as they are read: attention_tile.h).
 *
 * AVX-512 intrinsics; built with -march=native by runner/backends/cpu/loader.py, on AVX-512 machines
 * only. D must be a multiple of 16 up to 256, G at most 8 and B at most 256 (the loader checks).
 */
#include <stdlib.h>
#include <string.h>

#include "attention_tile.h"
#include "shared_prefix.h"

enum { LANES = 16, MAX_GROUP = 8, MAX_VECS = 16, MAX_BLOCK = 256 };

/* The task body: keys first_key .. context - 1 (first_key anywhere in a block: the first pass
 * then reads from its offset to the block's end). G, VECS (= D / 16) and HALF (float16 caches)
 * are constants in each instance, so q and the accumulators live in registers. */
static inline __attribute__((always_inline)) void attend(
    const float *restrict q, const void *restrict k_cache, const void *restrict v_cache,
    const int *restrict table, long context, float *restrict out,
    long hkv, long head, long block_size, float scale, float softcap, long first_key,
    const float *start_max, const float *start_sum, const float *start_acc,
    const int G, const int VECS, const int HALF)
{
    const long d = (long)VECS * LANES;
    const long row_stride = hkv * d; /* elements from one token's row to the next in a block */
    __m512 qv[MAX_GROUP][MAX_VECS], acc[MAX_GROUP][MAX_VECS];
    float running_max[MAX_GROUP], running_sum[MAX_GROUP];
    float scores[MAX_GROUP][MAX_BLOCK] __attribute__((aligned(64)));
    for (int g = 0; g < G; g++) {
        for (int v = 0; v < VECS; v++) {
            qv[g][v] = _mm512_mul_ps(_mm512_loadu_ps(q + g * d + v * LANES), _mm512_set1_ps(scale));
            acc[g][v] = start_acc ? _mm512_loadu_ps(start_acc + g * d + v * LANES)
                                  : _mm512_setzero_ps();
        }
        running_max[g] = start_acc ? start_max[g] : -INFINITY;
        running_sum[g] = start_acc ? start_sum[g] : 0.0f;
    }
    for (long first = first_key, end; first < context; first = end) {
        /* keys first .. end - 1: the rest of first's block, or of the context */
        const long block = first / block_size, within = first - block * block_size;
        end = (block + 1) * block_size < context ? (block + 1) * block_size : context;
        const long n = end - first;
        const long offset = (((long)table[block] * block_size + within) * hkv + head) * d;
        for (long t = 0; t < n; t++) {
            __m512 key[MAX_VECS]; /* loaded (and widened) once for the G heads */
            for (int v = 0; v < VECS; v++)
                key[v] = load_cache16(k_cache, offset + t * row_stride + v * LANES, HALF);
            for (int g = 0; g < G; g++) {
                __m512 dot = _mm512_mul_ps(qv[g][0], key[0]);
                for (int v = 1; v < VECS; v++)
                    dot = _mm512_fmadd_ps(qv[g][v], key[v], dot);
                scores[g][t] = _mm512_reduce_add_ps(dot);
            }
        }
        for (int g = 0; g < G; g++) {
            /* A branch once a block, outside the key loops, taken the same way all call: uncapped
             * decodes run as fast as before (a constant like G would double the instances). */
            if (softcap > 0.0f)
                soft_cap_scores(scores[g], n, softcap);
            float block_max = scores[g][0];
            for (long t = 1; t < n; t++)
                block_max = scores[g][t] > block_max ? scores[g][t] : block_max;
            float new_max = block_max > running_max[g] ? block_max : running_max[g];
            if (new_max > running_max[g]) { /* rescale what came before to the new max */
                /* the vector exp: a libm call here would spill every register */
                float shrink = _mm512_cvtss_f32(
                    exp_nonpositive(_mm512_set1_ps(running_max[g] - new_max)));
                running_sum[g] *= shrink;
                for (int v = 0; v < VECS; v++)
                    acc[g][v] = _mm512_mul_ps(acc[g][v], _mm512_set1_ps(shrink));
                running_max[g] = new_max;
            }
            __m512 total = _mm512_setzero_ps();
            for (long t = 0; t < n; t += LANES) {
                __mmask16 live = n - t >= LANES ? 0xFFFF : (__mmask16)((1u << (n - t)) - 1);
                __m512 s = _mm512_maskz_loadu_ps(live, scores[g] + t);
                __m512 p = _mm512_maskz_mov_ps(live, exp_nonpositive(
                    _mm512_sub_ps(s, _mm512_set1_ps(new_max))));
                _mm512_mask_storeu_ps(scores[g] + t, live, p);
                total = _mm512_add_ps(total, p);
            }
            running_sum[g] += _mm512_reduce_add_ps(total);
        }
        for (long t = 0; t < n; t++) {
            for (int v = 0; v < VECS; v++) {
                __m512 vv = load_cache16(v_cache, offset + t * row_stride + v * LANES, HALF);
                for (int g = 0; g < G; g++)
                    acc[g][v] = _mm512_fmadd_ps(_mm512_set1_ps(scores[g][t]), vv, acc[g][v]);
            }
        }
    }
    for (int g = 0; g < G; g++) {
        __m512 inv = _mm512_set1_ps(1.0f / running_sum[g]);
        for (int v = 0; v < VECS; v++)
            _mm512_storeu_ps(out + g * d + v * LANES, _mm512_mul_ps(acc[g][v], inv));
    }
}

#define ATTEND(G, V, H)                                                                 \
    attend(qs, k_cache, v_cache, table, context, os, hkv, head, block_size, scale,       \
           softcap, first_key,                                                           \
           start ? start->max + s * hq + head * group : NULL,                            \
           start ? start->sum + s * hq + head * group : NULL,                            \
           start ? start->acc + (s * hq + head * group) * d : NULL, G, V, H)
#define GROUP_CASES(V, H)                                                           \
    switch (group) {                                                                \
    case 1: ATTEND(1, V, H); break; case 2: ATTEND(2, V, H); break;                \
    case 3: ATTEND(3, V, H); break; case 4: ATTEND(4, V, H); break;                \
    case 5: ATTEND(5, V, H); break; case 6: ATTEND(6, V, H); break;                \
    case 7: ATTEND(7, V, H); break; case 8: ATTEND(8, V, H); break;                \
    }
/* Head sizes 64 and 128 get constant-size code, float32 and float16 caches each. */
#define SIZE_CASES(H)                                                               \
    switch (d / LANES) {                                                            \
    case 4: GROUP_CASES(4, H); break;                                               \
    case 8: GROUP_CASES(8, H); break;                                               \
    default: ATTEND(group, d / LANES, H); break;                                    \
    }

/* Returns 0, or -1 when the shapes are outside what the kernel handles or memory runs out
 * (nothing written). With shared_blocks > 0, every sequence's table starts with the same
 * shared_blocks blocks and every context is longer than they are (the caller checks); they are
 * scored together unless a window cuts into them. window: keys per query (0: all). softcap:
 * the logit soft cap (0: none; never negative). */
int decode_attention(const float *q, const void *k_cache, const void *v_cache,
                     const int *block_tables, const int *context_lens, float *out,
                     long num_seqs, long hq, long hkv, long d, long block_size,
                     long max_blocks, long shared_blocks, long window, float scale,
                     float softcap, int kv_half)
{
    long group = hkv > 0 ? hq / hkv : 0;
    if (group < 1 || group > MAX_GROUP || group * hkv != hq || d % LANES || d > MAX_VECS * LANES
        || block_size < 1 || block_size > MAX_BLOCK || shared_blocks < 0 || window < 0
        || !(softcap >= 0.0f))
        return -1;
    if (!windows_cover_all(context_lens, num_seqs, window))
        shared_blocks = 0; /* some window starts past key 0: each task reads its own keys */
    const long shared_keys = shared_blocks * block_size;
    struct prefix_state shared = {NULL, NULL, NULL};
    const struct prefix_state *start = NULL;
    if (shared_blocks) {
        shared.max = malloc(num_seqs * hq * (d + 2) * sizeof(float));
        if (!shared.max)
            return -1;
        shared.sum = shared.max + num_seqs * hq;
        shared.acc = shared.sum + num_seqs * hq;
        if (!kv_half)
            score_shared_prefix(q, k_cache, v_cache, block_tables, shared_keys, num_seqs, hq, hkv,
                                d, block_size, scale, softcap, &shared);
        else if (score_half_prefix(q, k_cache, v_cache, block_tables, shared_blocks, num_seqs,
                                   hq, hkv, d, block_size, scale, softcap, &shared)) {
            free(shared.max);
            return -1;
        }
        start = &shared;
    }
    /* Head-major: consecutive tasks read the same KV head's rows, so a prefix the sequences
     * share stays in each core's cache; dynamic, since contexts differ in length. */
    #pragma omp parallel for collapse(2) schedule(dynamic, 1)
    for (long head = 0; head < hkv; head++) {
        for (long s = 0; s < num_seqs; s++) {
            const float *qs = q + (s * hq + head * group) * d;
            float *os = out + (s * hq + head * group) * d;
            const int *table = block_tables + s * max_blocks;
            long context = context_lens[s];
            if (context <= 0) { /* nothing to attend to: a zero row, never a division by 0 */
                for (long i = 0; i < group * d; i++)
                    os[i] = 0.0f;
                continue;
            }
            /* past the shared pass's keys, or where the window starts (then no shared pass) */
            const long first_key = window && context - window > shared_keys ? context - window
                                                                             : shared_keys;
            if (kv_half) {
                SIZE_CASES(1)
            } else {
                SIZE_CASES(0)
            }
        }
    }
    free(shared.max);
    return 0;
}

/* y[i] = softcap * tanh(x[i] / softcap), i < n: the kernels' own cap (soft_cap_scores), for
 * tests (tests/backends/cpu/test_cpu_features.py holds its tanh to torch.tanh with softcap 1). */
void soft_cap_rows(const float *x, float *y, long n, float softcap)
{
    memcpy(y, x, (size_t)n * sizeof(float));
    soft_cap_scores(y, n, softcap);
}
