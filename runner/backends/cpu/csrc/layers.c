/* Every decoder layer of an engine step in one call, for the CPU.
 *
 * A step of a small model runs ~15 operators a layer; called one by one from Python on a
 * decode step's few rows, their interpreter and dispatch costs add up to a quarter of the
 * step. Here the same kernels run back to back in C: per layer
 *   x = rms_norm(h); qkv = x Wqkv; rotate q, k (RoPE) and store k, v in the paged cache;
 *   o = attention(q): decodes in decode_attention, longer queries in prefill_attention;
 *   h += o Wo; x = rms_norm(h); h += silu_and_mul(x Wgu) Wdown,
 * with each product's bias where it has one (Qwen2) and q and k normed per head before RoPE
 * where the model does (Qwen3; rope_store.c); OLMo 2's post-norm layers instead norm q and k
 * across heads and each branch's output, not its input; Gemma 3's sandwich layers norm each
 * branch's input and output, gate with the tanh GeLU and rotate their local layers with a
 * RoPE table of their own. The operations and their order per element are those of
 * runner/model/decoder_layers.py and runner/backends/cpu/attention.py, so h comes out bit for bit as the
 * Python path computes it. Widths must be multiples of 16; runner/model/cpu_layers.py checks before
 * calling.
 */
#include <string.h>
#include <time.h>

#include "kernels.h"

enum { LANES = 16, ALIASING_FLOATS = 512 };

/* A layer's tensors in run_layers' weights array; a bias or norm it lacks is NULL. Its norms
 * tell its layout (layout_norms). */
enum {
    INPUT_NORM, QKV, QKV_BIAS, Q_NORM, K_NORM, O, O_BIAS, POST_NORM, GATE_UP, GATE_UP_BIAS,
    DOWN, DOWN_BIAS, FFN_NORM, PRE_FFN_NORM, WEIGHTS_PER_LAYER
};

/* Where a layer norms h on its way into and out of each branch; NULL: not there (into a
 * branch: h as it is). */
struct layout_norms {
    const float *attn_in, *attn_out, *mlp_in, *mlp_out;
    int qk_across; /* q and k normed across all heads (OLMo 2), not per head */
};

/* A layer's layout, told by which norms it has (one fact, one source: the pointers).
 * Pre-norm (Llama and most; no FFN_NORM): INPUT_NORM into attention, POST_NORM into the MLP.
 * Post-norm (OLMo 2; FFN_NORM, no INPUT_NORM): POST_NORM out of attention, FFN_NORM out of
 * the MLP. Sandwich (Gemma 3; both): INPUT_NORM in and POST_NORM out of attention,
 * PRE_FFN_NORM in and FFN_NORM out of the MLP. */
static struct layout_norms layout_norms(const float *const *w)
{
    const int norms_out = w[FFN_NORM] != NULL;
    return (struct layout_norms){
        .attn_in = w[INPUT_NORM],
        .attn_out = norms_out ? w[POST_NORM] : NULL,
        .mlp_in = norms_out ? w[PRE_FFN_NORM] : w[POST_NORM],
        .mlp_out = w[FFN_NORM],
        .qk_across = norms_out && !w[INPUT_NORM],
    };
}

/* How a step's sequences split between the attention kernels (runner/backends/cpu/attention.py
 * CpuSplit): decodes, one query row each, and longer queries. */
struct step_split {
    long num_decodes;
    const long *decode_rows;  /* [num_decodes]: each decode's row of the step */
    const int *decode_tables; /* [num_decodes, decode_max_blocks] */
    long decode_max_blocks;
    const int *decode_lens;   /* [num_decodes] context lengths */
    long shared_blocks;       /* leading blocks every decode's table shares (a layer whose
                               * window cuts into them reads them per task: decode_attention) */
    long num_longer;
    const int *longer_tables; /* [num_longer, longer_max_blocks] */
    long longer_max_blocks;
    const int *longer_starts, *longer_lens, *longer_contexts; /* [num_longer] each */
    long tiled_decodes; /* deterministic mode: decodes through tiled_decode_attention */
};

/* Row stride for x of a product: rows a multiple of 2 KB apart share L1 sets in the panel
 * kernel and run at half speed, so such rows get 64 bytes more (as runner/backends/cpu/kernel.py does). */
static long product_ld(long k) { return k % ALIASING_FLOATS == 0 ? k + LANES : k; }

static long max3(long a, long b, long c) { return a > b ? (a > c ? a : c) : (b > c ? b : c); }

/* Floats of scratch run_layers needs for `rows` tokens. */
long layers_scratch(long rows, long hidden, long inter, long hq, long hkv, long d)
{
    long in = max3(product_ld(hidden), product_ld(hq * d), product_ld(inter));
    long qkv = (hq + 2 * hkv) * d;
    return rows * (in + 2 * qkv + 4 * hq * d + hidden + 2 * inter);
}

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* y [M, panels * 16] = x @ packed (+ bias, as torch adds it: a second rounding), its wall time
 * added to *seconds (the bench's share of a step in the products). */
static void product(const float *x, long ldx, const void *packed, int wtype, const float *bias,
                    float *y, long M, long K, long panels, double *seconds)
{
    double start = now();
    panel_gemm(x, ldx, packed, wtype, y, M, K, panels);
    *seconds += now() - start;
    if (!bias)
        return;
    const long n = panels * LANES;
    for (long r = 0; r < M; r++)
        for (long i = 0; i < n; i++)
            y[r * n + i] = y[r * n + i] + bias[i];
}

/* h += a * m, rounded as torch's residual + branch * m (two roundings: no fused multiply-add);
 * m is 1 (exact) except for Granite's residual_multiplier. */
__attribute__((optimize("fp-contract=off")))
static void add_rows(float *h, const float *a, long n, float m)
{
    for (long i = 0; i < n; i++)
        h[i] = a[i] * m + h[i];
}

/* A branch's input: y [rows, hidden] (rows ldy apart) = norm(h), or h as it is where norm is
 * NULL. */
static void branch_input(const float *h, const float *norm, float *y, long ldy, long rows,
                         long hidden, float eps)
{
    if (norm) {
        rms_norm_rows(h, hidden, norm, y, ldy, rows, hidden, eps);
        return;
    }
    for (long r = 0; r < rows; r++)
        memcpy(y + r * ldy, h + r * hidden, hidden * sizeof(float));
}

/* h += norm(out) * m (norm: none where NULL), out [rows, hidden]; normed in place (each row is
 * read whole before it is written). */
static void add_branch(float *h, float *out, const float *norm, long rows, long hidden,
                       float eps, float m)
{
    if (norm)
        rms_norm_rows(out, hidden, norm, out, hidden, rows, hidden, eps);
    add_rows(h, out, rows * hidden, m);
}

/* A decode kernel: decode_attention, or tiled_decode_attention in deterministic mode. */
typedef int (*decode_kernel)(const float *, const void *, const void *, const int *, const int *,
                             float *, long, long, long, long, long, long, long, long, float,
                             float, int);

/* attn [rows, hq * d] = attention of q [rows, hq * d] over the paged cache, each query over its
 * last `window` keys (0: all), scores soft-capped at softcap (0: not). decoded, decode_q:
 * scratch of rows * hq * d floats each. Returns 0 or -1 (a kernel refused). */
static int attend(const float *q, const void *k_cache, const void *v_cache, float *attn,
                  long rows, long hq, long hkv, long d, long block_size,
                  const struct step_split *split, long window, float scale, float softcap,
                  float *decode_q, float *decoded, int kv_half)
{
    const long width = hq * d;
    const decode_kernel decode = split->tiled_decodes ? tiled_decode_attention : decode_attention;
    if (split->num_decodes == rows) /* decodes only, in row order: q and attn as they are */
        return decode(q, k_cache, v_cache, split->decode_tables, split->decode_lens, attn, rows,
                      hq, hkv, d, block_size, split->decode_max_blocks, split->shared_blocks,
                      window, scale, softcap, kv_half);
    if (split->num_decodes) {
        for (long i = 0; i < split->num_decodes; i++)
            memcpy(decode_q + i * width, q + split->decode_rows[i] * width, width * sizeof(float));
        if (decode(decode_q, k_cache, v_cache, split->decode_tables, split->decode_lens, decoded,
                   split->num_decodes, hq, hkv, d, block_size, split->decode_max_blocks,
                   split->shared_blocks, window, scale, softcap, kv_half))
            return -1;
        for (long i = 0; i < split->num_decodes; i++)
            memcpy(attn + split->decode_rows[i] * width, decoded + i * width, width * sizeof(float));
    }
    if (split->num_longer)
        return prefill_attention(q, width, k_cache, v_cache, split->longer_tables,
                                 split->longer_starts, split->longer_lens, split->longer_contexts,
                                 attn, split->num_longer, hq, hkv, d, block_size,
                                 split->longer_max_blocks, window, scale, softcap, kv_half);
    return 0;
}

/* h [rows, hidden] float32, updated in place through all layers. weights: WEIGHTS_PER_LAYER per
 * layer (see the enum: norms, packed products, their biases, q/k norms; NULL where the model
 * has none). kv: the store of float32 elements, or float16 ones when kv_half; layer l's keys at
 * element 2l * cache_elems and values at (2l + 1) * cache_elems, each [blocks, block_size,
 * hkv, d]. cos/sin and cos2/sin2: two RoPE tables, [rows, rot] each, by token (rot <= d: the
 * rotated dims of a head; cos2/sin2 NULL where no layer uses them); rope_layers [num_layers]:
 * the table each layer rotates with, 1 (cos/sin) or 2 (cos2/sin2: Gemma 3's local layers), or
 * 0 where it uses no RoPE (NULL: every layer the first);
 * windows [num_layers]: each layer's sliding window, 0 where it sees the whole context (NULL:
 * no layer has one);
 * slots [rows] (negative: skip). softcap: every layer's attention logit soft cap (Gemma 2;
 * 0: none). residual: what each branch is multiplied by before it is added back (1, or
 * Granite's residual_multiplier). scratch: layers_scratch floats. The
 * products' wall time is added to seconds[0] and the attention kernels' to seconds[1]
 * (`kvcache report`'s breakdown of a step). Returns 0, or -1 if an attention kernel refused (h
 * is then partly updated). weight_type: what the packed products hold (panel_gemm.c's
 * WEIGHTS_*). gelu: the MLP gates with the tanh GeLU (Gemma), not SiLU. */
int run_layers(float *h, long rows, long hidden, long inter, long hq, long hkv, long d,
               const float *const *weights, long num_layers, void *kv, long cache_elems,
               long block_size, const struct step_split *split, const float *cos,
               const float *sin, const float *cos2, const float *sin2, long rot,
               const int *rope_layers, const int *windows, const long *slots, float eps,
               float scale, float softcap, float residual, float *scratch, double *seconds,
               int weight_type, int kv_half, int gelu)
{
    const long elem = kv_half ? 2 : 4; /* bytes of one cache element */
    const long q_width = hq * d, qkv_width = (hq + 2 * hkv) * d;
    /* in: the x of each product, rows product_ld(its K) apart within in_ld floats a row. */
    const long in_ld = max3(product_ld(hidden), product_ld(q_width), product_ld(inter));
    float *in = scratch, *qkv = in + rows * in_ld, *normed = qkv + rows * qkv_width;
    float *q = normed + rows * qkv_width, *attn = q + rows * q_width;
    float *decode_q = attn + rows * q_width, *decoded = decode_q + rows * q_width;
    float *out = decoded + rows * q_width, *gate_up = out + rows * hidden;
    for (long layer = 0; layer < num_layers; layer++) {
        const float *const *w = weights + layer * WEIGHTS_PER_LAYER;
        char *k_cache = (char *)kv + 2 * layer * cache_elems * elem;
        char *v_cache = k_cache + cache_elems * elem;
        const struct layout_norms norms = layout_norms(w);
        /* A layer without RoPE (SmolLM3's every 4th) rotates no dims: q and k copied as they are;
         * one with a table of its own reads the second. */
        const int table = rope_layers ? rope_layers[layer] : 1;
        const long layer_rot = table ? rot : 0;
        const float *layer_cos = table == 2 ? cos2 : cos, *layer_sin = table == 2 ? sin2 : sin;
        branch_input(h, norms.attn_in, in, product_ld(hidden), rows, hidden, eps);
        product(in, product_ld(hidden), w[QKV], weight_type, w[QKV_BIAS], qkv, rows, hidden,
                qkv_width / LANES, seconds);
        for (long t = 0; t < rows; t++) {
            long slot = slots[t];
            char *k = slot < 0 ? NULL : k_cache + slot * hkv * d * elem;
            char *v = slot < 0 ? NULL : v_cache + slot * hkv * d * elem;
            rotate_and_store(qkv + t * qkv_width, w[Q_NORM], w[K_NORM], layer_cos + t * rot,
                             layer_sin + t * rot, q + t * q_width, k, v, hq, hkv, d, layer_rot,
                             eps, normed + t * qkv_width, kv_half, norms.qk_across);
        }
        const double attention_start = now();
        const long window = windows ? windows[layer] : 0;
        if (attend(q, k_cache, v_cache, attn, rows, hq, hkv, d, block_size, split, window, scale,
                   softcap, decode_q, decoded, kv_half))
            return -1;
        seconds[1] += now() - attention_start;
        const float *o_in = attn;
        if (product_ld(q_width) != q_width) {
            for (long t = 0; t < rows; t++)
                memcpy(in + t * product_ld(q_width), attn + t * q_width, q_width * sizeof(float));
            o_in = in;
        }
        product(o_in, product_ld(q_width), w[O], weight_type, w[O_BIAS], out, rows, q_width,
                hidden / LANES, seconds);
        add_branch(h, out, norms.attn_out, rows, hidden, eps, residual);
        branch_input(h, norms.mlp_in, in, product_ld(hidden), rows, hidden, eps);
        product(in, product_ld(hidden), w[GATE_UP], weight_type, w[GATE_UP_BIAS], gate_up, rows,
                hidden, 2 * inter / LANES, seconds);
        if (gelu)
            gelu_tanh_and_mul_rows(gate_up, in, product_ld(inter), rows, inter);
        else
            silu_and_mul_rows(gate_up, in, product_ld(inter), rows, inter);
        product(in, product_ld(inter), w[DOWN], weight_type, w[DOWN_BIAS], out, rows, inter,
                hidden / LANES, seconds);
        add_branch(h, out, norms.mlp_out, rows, hidden, eps, residual);
    }
    return 0;
}
