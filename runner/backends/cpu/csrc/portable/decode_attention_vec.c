/* Decode attention over a paged KV cache for any CPU the C compiler targets: one query token
 * per sequence, written with the compiler's generic vectors (GCC/Clang vector extensions, 8
 * floats: AVX2 on x86-64, two NEON registers on Arm) instead of one instruction set's
 * intrinsics. It serves the machines the AVX-512 library (../decode_attention.c) cannot run on.
 *
 * q [S, Hq, D]; caches [blocks, B, Hkv, D] float32; block_tables [S, max_blocks] int32;
 * context_lens [S] int32; out [S, Hq, D]; all contiguous. Sequence s attends to its first
 * C = context_lens[s] keys in place through its table (no gather, no padding, no mask); with a
 * sliding window W > 0, to its last W only.
 *
 * Why in place matters on such a machine: a long context's decode through torch reads each
 * KV head's rows strided (flash's CPU kernel, 2-3x slower than streaming the same bytes) or
 * gathers them first (a copy a layer). Here each task, one (sequence, KV head), streams its
 * rows once for the G query heads sharing them. The softmax is the streaming one, a block at a
 * time: scores, the running max moved (what came before rescaled), e^(s - max) summed, then
 * the block's values added in, one value vector at a time for all G heads (its accumulators
 * stay in registers, the block's rows in L1). Exact softmax(q k^T scale) v up to rounding.
 */
#include <math.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

enum { W = 8, MAX_GROUP = 8, MAX_VECS = 32, MAX_BLOCK = 256 };

typedef float vf __attribute__((vector_size(W * sizeof(float))));
typedef int vi __attribute__((vector_size(W * sizeof(int))));

static inline vf load(const float *p)
{
    vf v;
    memcpy(&v, p, sizeof v); /* unaligned: one vector load */
    return v;
}

static inline void store(float *p, vf v) { memcpy(p, &v, sizeof v); }

static inline vf splat(float x) { return (vf){x, x, x, x, x, x, x, x}; }

/* The sum of a vector's lanes, as a tree of halves (3 adds, not a chain of 7). */
static inline float sum_lanes(vf v)
{
    typedef float half __attribute__((vector_size(W / 2 * sizeof(float))));
    half lo, hi;
    memcpy(&lo, &v, sizeof lo);
    memcpy(&hi, (const char *)&v + sizeof lo, sizeof hi);
    lo += hi;
    return (lo[0] + lo[2]) + (lo[1] + lo[3]);
}

/* Pairwise sums of a's and b's lanes, each 4-lane half on its own (one in-lane shuffle each
 * on x86: a full 8-lane one costs several): a0+a1, a2+a3, b0+b1, b2+b3, then a4+a5, ... */
static inline vf pair_sums(vf a, vf b)
{
    return __builtin_shufflevector(a, b, 0, 2, 8, 10, 4, 6, 12, 14)
           + __builtin_shufflevector(a, b, 1, 3, 9, 11, 5, 7, 13, 15);
}

/* Lane i of the result: the sum of dots[i]'s lanes. */
static inline vf sum_lanes8(const vf *dots)
{
    /* per half: a b c d sums of that half's lanes, then e f g h */
    const vf abcd = pair_sums(pair_sums(dots[0], dots[1]), pair_sums(dots[2], dots[3]));
    const vf efgh = pair_sums(pair_sums(dots[4], dots[5]), pair_sums(dots[6], dots[7]));
    return __builtin_shufflevector(abcd, efgh, 0, 1, 2, 3, 8, 9, 10, 11)
           + __builtin_shufflevector(abcd, efgh, 4, 5, 6, 7, 12, 13, 14, 15);
}

/* e^x for x <= 0 (clamped at -87, where e^x is negligible beside a softmax sum): x = n ln2 + r
 * with |r| <= ln2 / 2 (ln2 in two parts, so the reduction is exact), e^r by its Taylor series
 * to degree 7, times 2^n through the exponent bits. About 1 ulp. */
static inline vf exp_nonpositive(vf x)
{
    const vi low = x < splat(-87.0f); /* all ones where true */
    x = (vf)(((vi)x & ~low) | ((vi)splat(-87.0f) & low));
    const vf round = splat(12582912.0f); /* 1.5 * 2^23: adding it rounds to an integer */
    vf n = (x * splat(1.44269504088896341f) + round) - round;
    vf r = x - n * splat(0.693359375f);
    r = r - n * splat(-2.12194440e-4f);
    vf p = splat(1.0f / 5040);
    p = p * r + splat(1.0f / 720);
    p = p * r + splat(1.0f / 120);
    p = p * r + splat(1.0f / 24);
    p = p * r + splat(1.0f / 6);
    p = p * r + splat(0.5f);
    p = p * r + splat(1.0f);
    p = p * r + splat(1.0f);
    vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
    vf scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* The scores of 8 keys, rows `row_stride` floats apart from `keys` on, against q (VECS
 * vectors): 8 independent chains of products, then one tree of pairwise sums. */
static inline __attribute__((always_inline)) vf score_keys(const vf *q, const float *keys,
                                                          long row_stride, const int VECS)
{
    vf dots[W];
    for (int i = 0; i < W; i++)
        dots[i] = q[0] * load(keys + i * row_stride);
    for (int v = 1; v < VECS; v++)
        for (int i = 0; i < W; i++)
            dots[i] += q[v] * load(keys + i * row_stride + v * W);
    return sum_lanes8(dots); /* lane i: key i's score */
}

/* acc[g][v0 .. v0 + VB - 1] += sum over the block's n keys of p[g][t] * value t. */
static inline __attribute__((always_inline)) void add_values(
    vf acc[][MAX_VECS], float scores[][MAX_BLOCK], const float *values, long row_stride,
    long n, int v0, const int G, const int VB)
{
    vf a[MAX_GROUP][4];
    for (int g = 0; g < G; g++)
        for (int j = 0; j < VB; j++)
            a[g][j] = acc[g][v0 + j];
    for (long t = 0; t < n; t++) {
        for (int j = 0; j < VB; j++) {
            const vf value = load(values + t * row_stride + (v0 + j) * W);
            for (int g = 0; g < G; g++)
                a[g][j] += splat(scores[g][t]) * value;
        }
    }
    for (int g = 0; g < G; g++)
        for (int j = 0; j < VB; j++)
            acc[g][v0 + j] = a[g][j];
}

/* One block's n keys and values (rows `row_stride` floats apart) into one head's state. */
static inline __attribute__((always_inline)) void attend_block(
    vf (*restrict qv)[MAX_VECS], vf (*restrict acc)[MAX_VECS], float *restrict running_max,
    float *restrict running_sum, const float *keys, const float *values, long n,
    long row_stride, const int G, const int VECS)
{
    float scores[MAX_GROUP][MAX_BLOCK] __attribute__((aligned(32)));
    long t = 0;
    for (; t + W <= n; t += W) /* 8 keys at once: 8 chains of products, summed as one */
        for (int g = 0; g < G; g++)
            store(scores[g] + t, score_keys(qv[g], keys + t * row_stride, row_stride, VECS));
    for (; t < n; t++) {
        for (int g = 0; g < G; g++) {
            vf dot = qv[g][0] * load(keys + t * row_stride);
            for (int v = 1; v < VECS; v++)
                dot += qv[g][v] * load(keys + t * row_stride + v * W);
            scores[g][t] = sum_lanes(dot);
        }
    }
    for (int g = 0; g < G; g++) {
        float block_max = scores[g][0];
        for (long i = 1; i < n; i++)
            block_max = scores[g][i] > block_max ? scores[g][i] : block_max;
        if (block_max > running_max[g]) { /* rescale what came before to the new max */
            const float shrink = exp_nonpositive(splat(running_max[g] - block_max))[0];
            running_sum[g] *= shrink;
            for (int v = 0; v < VECS; v++)
                acc[g][v] *= splat(shrink);
            running_max[g] = block_max;
        }
        vf total = splat(0.0f);
        long i = 0;
        for (; i + W <= n; i += W) {
            vf p = exp_nonpositive(load(scores[g] + i) - splat(running_max[g]));
            store(scores[g] + i, p);
            total += p;
        }
        float rest = sum_lanes(total);
        for (; i < n; i++) { /* the block's last few keys */
            scores[g][i] = exp_nonpositive(splat(scores[g][i] - running_max[g]))[0];
            rest += scores[g][i];
        }
        running_sum[g] += rest;
    }
    /* Value vectors a few at a time, so that G x VB sums run side by side (one at a time,
     * each sum waits on its previous product: a chain of the product's latency). */
    const int VB = G <= 3 ? 4 : G == 4 ? 2 : 1; /* at most 12 sums and 3 broadcasts */
    int v = 0;
    for (; v + VB <= VECS; v += VB)
        add_values(acc, scores, values, row_stride, n, v, G, VB);
    for (; v < VECS; v++)
        add_values(acc, scores, values, row_stride, n, v, G, 1);
}

/* One task: KV heads head0 .. head0 + heads - 1 of one sequence (G query heads each), keys
 * first .. context - 1. A block's rows of all those heads lie together, so with every head of
 * a sequence in one task the task streams each block's keys and values as one run. */
static inline __attribute__((always_inline)) void attend(
    const float *restrict q, const float *restrict k_cache, const float *restrict v_cache,
    const int *restrict table, long first, long context, float *restrict out, long hkv,
    long head0, long heads, long block_size, float scale, const int G, const int VECS)
{
    const long d = (long)VECS * W, row_stride = hkv * d;
    vf qv[heads][MAX_GROUP][MAX_VECS], acc[heads][MAX_GROUP][MAX_VECS];
    float running_max[heads][MAX_GROUP], running_sum[heads][MAX_GROUP];
    for (long h = 0; h < heads; h++)
        for (int g = 0; g < G; g++) {
            for (int v = 0; v < VECS; v++) {
                qv[h][g][v] = load(q + (h * G + g) * d + v * W) * splat(scale);
                acc[h][g][v] = splat(0.0f);
            }
            running_max[h][g] = -INFINITY;
            running_sum[h][g] = 0.0f;
        }
    for (long end; first < context; first = end) {
        const long block = first / block_size, within = first - block * block_size;
        end = (block + 1) * block_size < context ? (block + 1) * block_size : context;
        const long offset = (((long)table[block] * block_size + within) * hkv + head0) * d;
        for (long h = 0; h < heads; h++)
            attend_block(qv[h], acc[h], running_max[h], running_sum[h], k_cache + offset + h * d,
                         v_cache + offset + h * d, end - first, row_stride, G, VECS);
    }
    for (long h = 0; h < heads; h++)
        for (int g = 0; g < G; g++) {
            const vf inv = splat(1.0f / running_sum[h][g]);
            for (int v = 0; v < VECS; v++)
                store(out + (h * G + g) * d + v * W, acc[h][g][v] * inv);
        }
}

#define ATTEND(G, V)                                                                        \
    attend(qs, k_cache, v_cache, table, first, context, os, hkv, head0, heads, block_size,   \
           scale, G, V)
#define GROUP_CASES(V)                                                                      \
    switch (group) {                                                                        \
    case 1: ATTEND(1, V); break; case 2: ATTEND(2, V); break;                               \
    case 3: ATTEND(3, V); break; case 4: ATTEND(4, V); break;                               \
    default: ATTEND(group, V); break;                                                       \
    }

/* KV heads per task: all of a sequence's (one stream of its blocks) when there are enough
 * sequences for the threads; else split, so that one long context still uses every thread. */
static long heads_per_task(long num_seqs, long hkv)
{
#ifdef _OPENMP
    const long threads = omp_get_max_threads();
#else
    const long threads = 1;
#endif
    long split = 1;
    while (split < hkv && num_seqs * split < threads)
        split++;
    while (hkv % split)
        split++;
    return hkv / split;
}

/* Returns 0, or -1 when the shapes are outside what it handles (nothing written): G = Hq / Hkv
 * at most 8, D a multiple of 8 up to 256, B at most 256. window: keys per query (0: all). */
int decode_attention_vec(const float *q, const float *k_cache, const float *v_cache,
                         const int *block_tables, const int *context_lens, float *out,
                         long num_seqs, long hq, long hkv, long d, long block_size,
                         long max_blocks, long window, float scale)
{
    const long group = hkv > 0 ? hq / hkv : 0;
    if (group < 1 || group > MAX_GROUP || group * hkv != hq || d % W || d > MAX_VECS * W
        || block_size < 1 || block_size > MAX_BLOCK || window < 0)
        return -1;
    const long heads = heads_per_task(num_seqs, hkv), tasks = hkv / heads;
    #pragma omp parallel for collapse(2) schedule(dynamic, 1) /* dynamic: contexts differ */
    for (long s = 0; s < num_seqs; s++) {
        for (long task = 0; task < tasks; task++) {
            const long head0 = task * heads;
            const float *qs = q + (s * hq + head0 * group) * d;
            float *os = out + (s * hq + head0 * group) * d;
            const int *table = block_tables + s * max_blocks;
            const long context = context_lens[s];
            if (context <= 0) { /* nothing to attend to: a zero row, never a division by 0 */
                memset(os, 0, (size_t)(heads * group * d) * sizeof(float));
                continue;
            }
            const long first = window && context > window ? context - window : 0;
            switch (d / W) {
            case 8: GROUP_CASES(8); break;   /* head size 64 */
            case 16: GROUP_CASES(16); break; /* head size 128 */
            default: GROUP_CASES(d / W); break;
            }
        }
    }
    return 0;
}
