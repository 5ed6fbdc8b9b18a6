/* A float32 or bf16 decode token's steps between the weights, on the CPU (fmoe_cli/models/attention.py,
   decoder.py). float32 first; bf16 compute: its section below.

   At one token, the attention's steps around its projections (the q/k norms, RoPE, the KV cache's append, the
   attention over the cache) and the layer's RMSNorms are a few thousand flops each; as eager torch ops they are
   25–45 dispatches a layer at a few µs each (docs/bench.md § The decode step's glue in C). Here each is one call.

   The values are transformers' formulas; the bits are not torch's everywhere (the same class as the expert
   kernels' rows, kernels/__init__.py): every product and sum that torch computes as one elementwise op is the
   same single rounding here (no FMA contraction: -std=c11 keeps GCC's fp-contract off), so RoPE and the norm's
   scaling have torch's bits; a reduction's order is this file's own (the mean of squares, the dot products, the
   softmax's sum), so values differ from torch's by float32 rounding. Nothing depends on the thread count (one
   thread), and every policy runs the same code, so every policy gives the resident run's bits.

   RMSNorm (Qwen3MoeRMSNorm and its copies), over n values x:
     r = 1 / sqrt(mean(x²) + ε)        y_i = w_i · (x_i · r)
   RoPE (apply_rotary_pos_emb, rotate_half), over a head's D values with the token's cos and sin:
     y_i = x_i·cos_i − x_{i+D/2}·sin_i  (i < D/2)      y_i = x_i·cos_i + x_{i−D/2}·sin_i  (i ≥ D/2)
   Attention of query head h (its key/value head g = h / (Hq/Hk)) over the cache's L positions:
     s_j = (q_h · k_{g,j}) · scale     p_j = exp(s_j − max s) / Σ exp(s − max s)     o_h = Σ_j p_j · v_{g,j}
*/
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "bf16.h"
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define DECODE_AVX2 1
#else
#define DECODE_AVX2 0
#endif
#define MAX_DIM 1024 /* the widest attention head (kernels.MAX_HEAD_DIM) */

#if DECODE_AVX2
/* The eight lanes' sum in a fixed order. */
static inline float lanes_sum(__m256 acc) {
    float lanes[8];
    _mm256_storeu_ps(lanes, acc);
    return ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
}

/* Eight bf16 values as float32 (exact). */
static inline __m256 load_bf16x8(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
#endif

/* Σ a_i·b_i over n values, a float32, b float32 or (b_bf16) bf16: eight lanes, then the lanes in a fixed order (the
   scalar build: one accumulator). */
static inline float dot_of(const float *a, const void *b, int b_bf16, int64_t n) {
    const float *bf = b;
    const uint16_t *bh = b;
    int64_t i = 0;
    float total = 0.0f;
#if DECODE_AVX2
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), b_bf16 ? load_bf16x8(bh + i) : _mm256_loadu_ps(bf + i), acc);
    total = lanes_sum(acc);
#endif
    for (; i < n; i++) total += a[i] * (b_bf16 ? bf16_to_float(bh[i]) : bf[i]);
    return total;
}

static float dot(const float *a, const float *b, int64_t n) { return dot_of(a, b, 0, n); }

/* r = 1 / sqrt(mean(x²) + ε): the mean of squares summed in double (closer to the exact value than any float
   order), rounded to float once, then ε added and the root taken in float as torch does. */
static float rms_of(double sum_of_squares, int64_t n, float eps) {
    float mean = (float)(sum_of_squares / (double)n);
    return 1.0f / sqrtf(mean + eps);
}

static float rms_scale(const float *x, int64_t n, float eps) {
    double sum = 0.0;
    for (int64_t i = 0; i < n; i++) sum += (double)x[i] * (double)x[i];
    return rms_of(sum, n, eps);
}

/* y = w · (x · r) over each of `rows` rows of n values; w is one row [n] (weight_rows 0) or one per row. */
static void rms_norm_rows(const float *x, float *y, int64_t rows, int64_t n, const float *w, int64_t weight_rows,
                          float eps) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * n, *wr = w + (weight_rows ? r * n : 0);
        float *yr = y + r * n;
        float s = rms_scale(xr, n, eps);
        for (int64_t i = 0; i < n; i++) {
            float h = xr[i] * s;
            yr[i] = wr[i] * h;
        }
    }
}

/* out = rms_norm(h + add) (add may be NULL: out = rms_norm(h)); sum (if not NULL) gets h + add, the residual
   stream's next value. One row of n floats. */
void fmoe_add_rms_norm(const float *h, const float *add, int64_t n, const float *weight, float eps, float *sum,
                       float *out) {
    const float *x = h;
    if (add != NULL) {
        for (int64_t i = 0; i < n; i++) sum[i] = h[i] + add[i];
        x = sum;
    }
    rms_norm_rows(x, out, 1, n, weight, 0, eps);
}

/* The attention's scores [position + 1], or NULL: a shape the attention functions do not take (D over MAX_DIM or odd,
   Hq not a multiple of Hk, the position outside the buffers) or no memory. */
static float *scores_for(int64_t heads_q, int64_t heads_k, int64_t dim, int64_t capacity, int64_t position) {
    if (dim > MAX_DIM || dim % 2 != 0 || heads_q % heads_k != 0 || position >= capacity) return NULL;
    return malloc((size_t)(position + 1) * sizeof(float));
}

/* scores [length] -> exp(s_j − max s) in place; returns their sum (in double). */
static double exp_scores(float *scores, int64_t length) {
    float top = -INFINITY;
    for (int64_t j = 0; j < length; j++)
        if (scores[j] > top) top = scores[j];
    double total = 0.0;
    for (int64_t j = 0; j < length; j++) {
        scores[j] = expf(scores[j] - top);
        total += scores[j];
    }
    return total;
}

/* ---- bf16 compute: the same steps on bf16 rows, with torch's bf16 roundings ----------------------------------

   A bf16 model's hidden states, weights, cos/sin and KV cache are bf16; torch's bf16 elementwise ops compute in
   float32 and round each result once to bf16 (bf16.h), and so does every step here that is one such op:
     RMSNorm (transformers': x.to(float32), its scale in float32, .to(bf16), then weight · h):
       r = 1 / sqrt(mean(x²) + ε)        y_i = bf16(w_i · bf16(x_i · r))
     the residual add: s_i = bf16(h_i + a_i)
     RoPE: y_i = bf16(bf16(x_i·cos_i) + bf16(−x_{i+D/2}·sin_i))  (i < D/2; and i ≥ D/2 with +x_{i−D/2})
   The attention follows torch's CPU SDPA (flash) on bf16 inputs: scores and sums in float32, the unnormalised
   weights exp(s_j − max s) rounded to bf16 before they weight the values, the heads' outputs divided by the sum
   and rounded to bf16:  o_h = bf16((Σ_j bf16(e_j) · v_j) · (1 / Σ_j e_j)). The reductions are this file's order. */

/* acc += p · v over n values, v bf16. */
static void axpy_bf16(float *acc, float p, const uint16_t *v, int64_t n) {
    int64_t i = 0;
#if DECODE_AVX2
    __m256 pp = _mm256_set1_ps(p);
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(acc + i, _mm256_fmadd_ps(pp, load_bf16x8(v + i), _mm256_loadu_ps(acc + i)));
#endif
    for (; i < n; i++) acc[i] += p * bf16_to_float(v[i]);
}

/* rms_norm_rows on bf16 rows (x and y may be the same rows). */
static void rms_norm_rows_bf16(const uint16_t *x, uint16_t *y, int64_t rows, int64_t n, const uint16_t *w,
                               int64_t weight_rows, float eps) {
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *xr = x + r * n, *wr = w + (weight_rows ? r * n : 0);
        uint16_t *yr = y + r * n;
        double sum = 0.0;
        for (int64_t i = 0; i < n; i++) {
            double v = bf16_to_float(xr[i]);
            sum += v * v;
        }
        float s = rms_of(sum, n, eps);
        for (int64_t i = 0; i < n; i++) {
            float h = round_bf16(bf16_to_float(xr[i]) * s);
            yr[i] = float_to_bf16(bf16_to_float(wr[i]) * h);
        }
    }
}

/* fmoe_add_rms_norm on bf16 rows. */
void fmoe_add_rms_norm_bf16(const uint16_t *h, const uint16_t *add, int64_t n, const uint16_t *weight, float eps,
                            uint16_t *sum, uint16_t *out) {
    const uint16_t *x = h;
    if (add != NULL) {
        for (int64_t i = 0; i < n; i++) sum[i] = float_to_bf16(bf16_to_float(h[i]) + bf16_to_float(add[i]));
        x = sum;
    }
    rms_norm_rows_bf16(x, out, 1, n, weight, 0, eps);
}

/* fmoe_attention_decode on bf16 rows: qkv, qk_weight, cos, sin, keys, values and out bf16 (see it for the shapes;
   the token's k, normed and rotated, and its v are written into the cache as they are). */
int fmoe_attention_decode_bf16(uint16_t *qkv, int64_t heads_q, int64_t heads_k, int64_t dim,
                               const uint16_t *qk_weight, float eps, const uint16_t *cos, const uint16_t *sin,
                               uint16_t *keys, uint16_t *values, int64_t capacity, int64_t position, float scale,
                               uint16_t *out) {
    int64_t half = dim / 2, length = position + 1, group = heads_q / heads_k;
    float *scores = scores_for(heads_q, heads_k, dim, capacity, position);
    if (scores == NULL) return -1;
    if (qk_weight != NULL) rms_norm_rows_bf16(qkv, qkv, heads_q + heads_k, dim, qk_weight, 1, eps);
    uint16_t rotated[MAX_DIM];
    for (int64_t h = 0; h < heads_q + heads_k; h++) { /* RoPE: each product and the sum rounded to bf16 */
        uint16_t *x = qkv + h * dim;
        for (int64_t i = 0; i < dim; i++) {
            float c = bf16_to_float(cos[i]), s = bf16_to_float(sin[i]);
            float other = i < half ? -bf16_to_float(x[i + half]) : bf16_to_float(x[i - half]);
            rotated[i] = float_to_bf16(round_bf16(bf16_to_float(x[i]) * c) + round_bf16(other * s));
        }
        memcpy(x, rotated, (size_t)dim * sizeof(uint16_t));
    }
    for (int64_t g = 0; g < heads_k; g++) { /* the cache's append */
        memcpy(keys + (g * capacity + position) * dim, qkv + (heads_q + g) * dim, (size_t)dim * sizeof(uint16_t));
        memcpy(values + (g * capacity + position) * dim, qkv + (heads_q + heads_k + g) * dim,
               (size_t)dim * sizeof(uint16_t));
    }
    float q[MAX_DIM], acc[MAX_DIM];
    for (int64_t h = 0; h < heads_q; h++) {
        const uint16_t *k = keys + (h / group) * capacity * dim, *v = values + (h / group) * capacity * dim;
        for (int64_t i = 0; i < dim; i++) q[i] = bf16_to_float(qkv[h * dim + i]);
        for (int64_t j = 0; j < length; j++) scores[j] = dot_of(q, k + j * dim, 1, dim) * scale;
        float inverse = (float)(1.0 / exp_scores(scores, length));
        memset(acc, 0, (size_t)dim * sizeof(float));
        for (int64_t j = 0; j < length; j++) axpy_bf16(acc, round_bf16(scores[j]), v + j * dim, dim);
        for (int64_t i = 0; i < dim; i++) out[h * dim + i] = float_to_bf16(acc[i] * inverse);
    }
    free(scores);
    return 0;
}

/* One decode token's attention on float32 rows.
   qkv [Hq + Hk + Hv, D]: the token's projections (q heads, then k heads, then v heads), overwritten: q and k
     normed (qk_weight [Hq + Hk, D], one row per head, or NULL: no norm) and rotated.
   cos, sin [D]: the token's rotary embedding.
   keys, values [Hk, capacity, D]: the cache's buffers; the token's k and v are written at position `position`,
     and the attention reads positions [0, position].
   out [Hq, D]: the heads' outputs, in order (transformers' transpose and reshape of one token).
   Returns 0, or -1: D over MAX_DIM or odd, or no memory for the scores. */
int fmoe_attention_decode(float *qkv, int64_t heads_q, int64_t heads_k, int64_t dim, const float *qk_weight,
                          float eps, const float *cos, const float *sin, float *keys, float *values,
                          int64_t capacity, int64_t position, float scale, float *out) {
    int64_t half = dim / 2, length = position + 1, group = heads_q / heads_k;
    float *scores = scores_for(heads_q, heads_k, dim, capacity, position);
    if (scores == NULL) return -1;
    if (qk_weight != NULL) rms_norm_rows(qkv, qkv, heads_q + heads_k, dim, qk_weight, 1, eps);
    float rotated[MAX_DIM];
    for (int64_t h = 0; h < heads_q + heads_k; h++) { /* RoPE: x·cos + rotate_half(x)·sin, each op rounded */
        float *x = qkv + h * dim;
        for (int64_t i = 0; i < half; i++) {
            float a = x[i] * cos[i], b = (-x[i + half]) * sin[i];
            rotated[i] = a + b;
        }
        for (int64_t i = half; i < dim; i++) {
            float a = x[i] * cos[i], b = x[i - half] * sin[i];
            rotated[i] = a + b;
        }
        memcpy(x, rotated, (size_t)dim * sizeof(float));
    }
    for (int64_t g = 0; g < heads_k; g++) { /* the cache's append */
        memcpy(keys + (g * capacity + position) * dim, qkv + (heads_q + g) * dim, (size_t)dim * sizeof(float));
        memcpy(values + (g * capacity + position) * dim, qkv + (heads_q + heads_k + g) * dim,
               (size_t)dim * sizeof(float));
    }
    for (int64_t h = 0; h < heads_q; h++) {
        const float *q = qkv + h * dim;
        const float *k = keys + (h / group) * capacity * dim, *v = values + (h / group) * capacity * dim;
        for (int64_t j = 0; j < length; j++) scores[j] = dot(q, k + j * dim, dim) * scale;
        double total = exp_scores(scores, length);
        float inverse = (float)(1.0 / total);
        float *o = out + h * dim;
        memset(o, 0, (size_t)dim * sizeof(float));
        for (int64_t j = 0; j < length; j++) {
            float p = scores[j] * inverse;
            const float *vj = v + j * dim;
            for (int64_t i = 0; i < dim; i++) o[i] += p * vj[i];
        }
    }
    free(scores);
    return 0;
}

/* A prefill's T tokens' attention (issue 39 §4): token t exactly as fmoe_attention_decode computes it at position
   `position + t` (its q/k norms and RoPE from its own row of cos and sin, its k and v appended, the attention over
   [0, position + t]: causal), one after the other, so the cache and every output have the bits of T decode steps.
   qkv [T, Hq + Hk + Hv, D], cos and sin [T, D], out [T, Hq, D]; the rest as fmoe_attention_decode. */
int fmoe_attention_prefill(float *qkv, int64_t tokens, int64_t heads_q, int64_t heads_k, int64_t dim,
                           const float *qk_weight, float eps, const float *cos, const float *sin, float *keys,
                           float *values, int64_t capacity, int64_t position, float scale, float *out) {
    int64_t width = (heads_q + 2 * heads_k) * dim;
    for (int64_t t = 0; t < tokens; t++)
        if (fmoe_attention_decode(qkv + t * width, heads_q, heads_k, dim, qk_weight, eps, cos + t * dim,
                                  sin + t * dim, keys, values, capacity, position + t, scale, out + t * heads_q * dim))
            return -1;
    return 0;
}

/* fmoe_attention_prefill on bf16 rows (fmoe_attention_decode_bf16 token by token). */
int fmoe_attention_prefill_bf16(uint16_t *qkv, int64_t tokens, int64_t heads_q, int64_t heads_k, int64_t dim,
                                const uint16_t *qk_weight, float eps, const uint16_t *cos, const uint16_t *sin,
                                uint16_t *keys, uint16_t *values, int64_t capacity, int64_t position, float scale,
                                uint16_t *out) {
    int64_t width = (heads_q + 2 * heads_k) * dim;
    for (int64_t t = 0; t < tokens; t++)
        if (fmoe_attention_decode_bf16(qkv + t * width, heads_q, heads_k, dim, qk_weight, eps, cos + t * dim,
                                       sin + t * dim, keys, values, capacity, position + t, scale,
                                       out + t * heads_q * dim))
            return -1;
    return 0;
}

/* One decode token's router (transformers' TopKRouter, float32): logits_e = x · W_e over the E rows of W [E, H],
   p = softmax(logits) (exp of each logit minus the largest, divided by their sum), the K largest p in descending
   order (ties: the lower expert first, as torch.topk), divided by their sum where `normalise`.
   logits [E], weights [K] (float32) and index [K] (int64) are written. Returns 0, or -1: no memory for the softmax. */
/* Whether probability a ranks before b in torch.topk's order: NaN above every number (a damaged weight or an
   overflow makes the scores NaN; they must still name K distinct experts), then by value. */
static int ranks_before(float a, float b) { return (isnan(a) && !isnan(b)) || a > b; }

int fmoe_router_decode(const float *x, const float *w, int64_t experts, int64_t hidden, int64_t k, int normalise,
                       float *logits, float *weights, int64_t *index) {
    if (k > experts) return -2;
    float *p = malloc((size_t)experts * (sizeof(float) + 1)); /* the softmax, made once, and which are taken */
    if (p == NULL) return -1;
    unsigned char *taken = (unsigned char *)(p + experts);
    memset(taken, 0, (size_t)experts);
    float top = -INFINITY;
    for (int64_t e = 0; e < experts; e++) {
        logits[e] = dot(x, w + e * hidden, hidden);
        if (logits[e] > top) top = logits[e];
    }
    double total = 0.0;
    for (int64_t e = 0; e < experts; e++) {
        p[e] = expf(logits[e] - top);
        total += p[e];
    }
    float sum = (float)total;
    for (int64_t e = 0; e < experts; e++) p[e] /= sum;
    for (int64_t j = 0; j < k; j++) { /* selection: K is small (2–8 of 8–128) */
        int64_t best = -1;
        for (int64_t e = 0; e < experts; e++)
            if (!taken[e] && (best < 0 || ranks_before(p[e], p[best]))) best = e;
        index[j] = best;
        weights[j] = p[best];
        taken[best] = 1;
    }
    free(p);
    if (normalise) {
        float s = 0.0f;
        for (int64_t j = 0; j < k; j++) s += weights[j];
        for (int64_t j = 0; j < k; j++) weights[j] /= s;
    }
    return 0;
}

/* The weighted sum of a token's K expert outputs (float32), in routing order: out_h = Σ_k w_k · y_{k,h}, each
   product rounded, then added in k order, as torch's `(y · w).sum(0)` over a [K, H] tensor. */
void fmoe_combine_decode(const float *y, const float *w, int64_t k, int64_t hidden, float *out) {
    for (int64_t h = 0; h < hidden; h++) out[h] = 0.0f;
    for (int64_t j = 0; j < k; j++) {
        const float *row = y + j * hidden;
        float wj = w[j];
        for (int64_t h = 0; h < hidden; h++) {
            float p = row[h] * wj;
            out[h] += p;
        }
    }
}

/* fmoe_combine_decode of bf16 outputs y [K, H] as torch computes `(y · wᵀ).sum(0)` on them: each product in float32,
   rounded to bf16 where the weights are bf16 (`weights_bf16`: Qwen's routers) and left float32 where they are
   float32 (Mixtral's: the product promotes), added in k order in float32, the sum rounded once to bf16 (torch's bf16
   sum accumulates in float32; the `.to(bf16)` of a float32 sum rounds the same once). */
static void combine_bf16(const uint16_t *y, const float *w, int weights_bf16, int64_t k, int64_t hidden, float *acc,
                         uint16_t *out) {
    for (int64_t h = 0; h < hidden; h++) acc[h] = 0.0f;
    for (int64_t j = 0; j < k; j++) {
        const uint16_t *row = y + j * hidden;
        float wj = w[j];
        for (int64_t h = 0; h < hidden; h++) {
            float p = bf16_to_float(row[h]) * wj;
            acc[h] += weights_bf16 ? round_bf16(p) : p;
        }
    }
    for (int64_t h = 0; h < hidden; h++) out[h] = float_to_bf16(acc[h]);
}

/* ---- a resident float32 decode token in one call ------------------------------------------------------------

   Every step above, and the kernels' rows (experts.c), for a whole decode token of a resident float32 model
   (fmoe_cli/models/token.py): per decoder layer
     n = rms_norm(h)                               input norm
     qkv = n · Wqkvᵀ (+ b)                         the fused q/k/v rows (fmoe_linear_forward)
     a = attention(qkv)                            q/k norms, RoPE, the KV append, the attention
     s = h + a·Woᵀ (+ b)    n = rms_norm(s)        o_proj, residual add, post-attention norm
     (w, e) = router(n)                            the top-k softmax
     y_k = expert_{e_k}(n)   h = s + Σ_k w_k·y_k   the K resident experts (fmoe_segments_forward), combine, add
   then logits = rms_norm(h) · Wheadᵀ (+ b). The same functions, in the same order, on the same values as the
   per-step path (models/decoder.py, attention.py, offload/engine.py), so the logits are its bits; the residual
   adds are one float32 rounding each, as torch's. Each layer's routing (experts and weights) is returned for the
   engine's bookkeeping. */

int fmoe_linear_forward(int fmt, const uint8_t *rows, int64_t outputs, int64_t hidden, int64_t proj_bytes,
                        int64_t group, int64_t meta_group, const void *x, int x_bf16, int64_t tokens, float *y,
                        int threads, int q8);
int fmoe_segments_forward(int fmt, int64_t count, const uint8_t *const *segments, const int64_t *neurons,
                          int64_t hidden, int64_t proj_bytes, int64_t group, int64_t meta_group, int64_t chunk,
                          const void *x, int x_bf16, int64_t tokens, float *acc, uint16_t *out_bf16, int threads,
                          int q8);

/* Rows of one format (kernels.Spec) over `hidden` inputs: a dense linear's [outputs, proj_bytes], or a layer's
   experts (each [neurons, 3, proj_bytes]). */
typedef struct {
    const uint8_t *rows;
    const float *bias; /* [outputs] or NULL */
    int64_t outputs, hidden, code, proj_bytes, group, meta_group, chunk, q8;
} DecodeRows;

typedef struct {
    const float *input_norm, *post_norm; /* [H] */
    float input_eps, post_eps, qk_eps, scale;
    DecodeRows qkv, o;                   /* [(Hq + 2·Hk)·D, H] and [H, Hq·D] */
    int64_t heads_q, heads_k, dim;
    const float *qk_weight;              /* [Hq + Hk, D] or NULL */
    float *keys, *values;                /* [Hk, capacity, D]: the cache's buffers, reserved for this token */
    int64_t capacity;
    const float *router;                 /* [E, H] */
    int64_t experts, top_k, normalise;
    const uint8_t *const *expert_rows;   /* [E]: each expert's rows, `neurons` of them */
    int64_t neurons;
    DecodeRows expert;                   /* the experts' format (rows, bias, outputs unused) */
    int64_t weights_bf16;                /* bf16 compute: the router's weights rounded to bf16 (Qwen's; Mixtral's not) */
} DecodeLayer;

typedef struct {
    int64_t layers, hidden;
    DecodeLayer *layer;
    const float *norm; /* the final norm [H] */
    float norm_eps;
    DecodeRows head;   /* [V, H] */
    int64_t threads, threads_min_bytes; /* kernels.threads_for: `threads` from threads_min_bytes of rows up */
    /* bf16 compute: layer i's router on its normed token x [H] (bf16), writing index [K] and weights [K] (float32,
       the router's values): the caller's own (models/token.py: transformers' router module, torch's bits, which
       no C sum order reproduces at bf16: its F.linear's rounding, its softmax's exp, torch.topk's order among the
       ties bf16 logits often have). Returns 0, or nonzero: the token fails. */
    int (*route)(int64_t layer, const uint16_t *x, int64_t *index, float *weights);
} DecodeModel;

static int threads_for(const DecodeModel *m, int64_t nbytes) {
    return nbytes >= m->threads_min_bytes ? (int)m->threads : 1;
}

/* y [outputs] = x · ŵᵀ (+ b): models/dense.py kernel_forward of one float32 row. */
static int rows_forward(const DecodeModel *m, const DecodeRows *r, const float *x, float *y) {
    if (fmoe_linear_forward((int)r->code, r->rows, r->outputs, r->hidden, r->proj_bytes, r->group, r->meta_group, x,
                            0, 1, y, threads_for(m, r->outputs * r->proj_bytes), (int)r->q8))
        return -1;
    if (r->bias != NULL)
        for (int64_t i = 0; i < r->outputs; i++) y[i] = y[i] + r->bias[i];
    return 0;
}

/* Layer l's K routed experts (index [K], routing order) on its normed token x (float32, or bf16: x_bf16): their
   outputs acc [K, H] float32 and, where out_bf16 is given, each rounded to bf16 (kernels.segments_forward's stacked
   outputs, the per-step path's `_resident_decode`). */
static int routed_experts(const DecodeModel *m, const DecodeLayer *l, const void *x, int x_bf16, const int64_t *index,
                          float *acc, uint16_t *out_bf16) {
    int64_t K = l->top_k;
    const uint8_t *segments[64];
    int64_t neurons[64];
    if (K > 64) return -1; /* models/token.py MAX_TOP_K: such a model takes the per-step path */
    for (int64_t k = 0; k < K; k++) segments[k] = l->expert_rows[index[k]], neurons[k] = l->neurons;
    const DecodeRows *e = &l->expert;
    return fmoe_segments_forward((int)e->code, K, segments, neurons, m->hidden, e->proj_bytes, e->group, e->meta_group,
                                 e->chunk, x, x_bf16, 1, acc, out_bf16,
                                 threads_for(m, 3 * K * l->neurons * e->proj_bytes), (int)e->q8)
               ? -1 : 0;
}

/* One decoder layer on the residual stream h [H] (updated in place); its routing into index [K], weights [K].
   work: floats for the layer's rows (decode_work). */
static int decode_layer(const DecodeModel *m, const DecodeLayer *l, float *h, const float *cos, const float *sin,
                        int64_t position, int64_t *index, float *weights, float *work) {
    int64_t H = m->hidden, K = l->top_k;
    float *normed = work, *sum = normed + H, *out = sum + H, *moe = out + H, *attended = moe + H;
    float *qkv = attended + l->heads_q * l->dim, *logits = qkv + l->qkv.outputs, *experts = logits + l->experts;
    fmoe_add_rms_norm(h, NULL, H, l->input_norm, l->input_eps, NULL, normed);
    if (rows_forward(m, &l->qkv, normed, qkv)) return -1;
    if (fmoe_attention_decode(qkv, l->heads_q, l->heads_k, l->dim, l->qk_weight, l->qk_eps, cos, sin, l->keys,
                              l->values, l->capacity, position, l->scale, attended))
        return -1;
    if (rows_forward(m, &l->o, attended, out)) return -1;
    fmoe_add_rms_norm(h, out, H, l->post_norm, l->post_eps, sum, normed);
    if (fmoe_router_decode(normed, l->router, l->experts, H, K, (int)l->normalise, logits, weights, index)) return -1;
    if (routed_experts(m, l, normed, 0, index, experts, NULL)) return -1;
    fmoe_combine_decode(experts, weights, K, H, moe);
    for (int64_t i = 0; i < H; i++) h[i] = sum[i] + moe[i];
    return 0;
}

/* Floats decode_layer's work takes for layer l. */
static int64_t decode_work(const DecodeModel *m, const DecodeLayer *l) {
    return 4 * m->hidden + l->heads_q * l->dim + l->qkv.outputs + l->experts + l->top_k * m->hidden;
}

/* A decode token of `bf16` compute or float32 (decode_layer_bf16 or decode_layer, each layer in turn, then the final
   norm and the head), in one workspace of the largest layer's size. */
static int decode_walk(const DecodeModel *m, int bf16, void *h, const void *cos, const void *sin, int64_t position,
                       void *logits, int64_t *index, float *weights);

/* A decode token: h [H] the token's embedding row (overwritten: the residual stream), cos and sin [D] its rotary
   embedding, `position` its place in the cache (every layer's keys and values reserved for it); logits [V];
   index [L, K] and weights [L, K] each layer's routing. Returns 0, or -1: no memory, or a shape not taken. */
int fmoe_decode_token(const DecodeModel *m, float *h, const float *cos, const float *sin, int64_t position,
                      float *logits, int64_t *index, float *weights) {
    return decode_walk(m, 0, h, cos, sin, position, logits, index, weights);
}

/* ---- a resident bf16 decode token in one call ---------------------------------------------------------------

   fmoe_decode_token's steps on a bf16 model (the same DecodeModel and DecodeLayer, every pointer of theirs that is
   float * there pointing to bf16 here: the norms' weights, the router's, the q/k norm weights, the biases, the
   cache's buffers), as the per-step path computes them at bf16 (models/decoder.py, attention.py,
   offload/engine.py): each row's float32 dot rounded once to bf16, then its bias added in bf16 (models/dense.py
   kernel_forward); the norms, the first residual add and the attention as fmoe_*_bf16 above; the router the
   caller's (DecodeModel.route: transformers' own module, called back once a layer); each expert's output rounded to bf16 (kernels.segments_forward), their weighted sum as combine_bf16
   (torch's ops on them in engine._combine_decode), the second residual add one bf16 rounding (torch's `h + moe`);
   the LM head's logits rounded to bf16. */

/* y [outputs] bf16 = x · ŵᵀ (+ b) for bf16 x; `f` [outputs] float32 scratch. */
static int rows_forward_bf16(const DecodeModel *m, const DecodeRows *r, const uint16_t *x, float *f, uint16_t *y) {
    if (fmoe_linear_forward((int)r->code, r->rows, r->outputs, r->hidden, r->proj_bytes, r->group, r->meta_group, x,
                            1, 1, f, threads_for(m, r->outputs * r->proj_bytes), (int)r->q8))
        return -1;
    const uint16_t *bias = (const uint16_t *)r->bias;
    for (int64_t i = 0; i < r->outputs; i++) {
        y[i] = float_to_bf16(f[i]);
        if (bias != NULL) y[i] = float_to_bf16(bf16_to_float(y[i]) + bf16_to_float(bias[i]));
    }
    return 0;
}

/* Bytes of decode_layer_bf16's work for layer l: bf16 rows, then float32 scratch. */
static int64_t decode_work_bf16(const DecodeModel *m, const DecodeLayer *l) {
    int64_t H = m->hidden, K = l->top_k, widest = l->qkv.outputs > H ? l->qkv.outputs : H;
    int64_t halves = 4 * H + l->heads_q * l->dim + l->qkv.outputs + K * H + 8;
    int64_t floats = widest + K * H + 16;
    if (floats < m->head.outputs) floats = m->head.outputs;
    return halves * 2 + floats * 4 + 64;
}

static int decode_layer_bf16(const DecodeModel *m, const DecodeLayer *l, uint16_t *h, const uint16_t *cos,
                             const uint16_t *sin, int64_t position, int64_t *index, float *weights, char *work) {
    int64_t H = m->hidden, K = l->top_k;
    uint16_t *normed = (uint16_t *)work, *sum = normed + H, *out = sum + H, *moe = out + H, *attended = moe + H;
    uint16_t *qkv = attended + l->heads_q * l->dim, *experts = qkv + l->qkv.outputs;
    uintptr_t after = (uintptr_t)(experts + K * H);
    float *f = (float *)((after + 63) & ~(uintptr_t)63); /* float32 scratch: the rows' sums, the experts' */
    fmoe_add_rms_norm_bf16(h, NULL, H, (const uint16_t *)l->input_norm, l->input_eps, NULL, normed);
    if (rows_forward_bf16(m, &l->qkv, normed, f, qkv)) return -1;
    if (fmoe_attention_decode_bf16(qkv, l->heads_q, l->heads_k, l->dim, (const uint16_t *)l->qk_weight, l->qk_eps,
                                   cos, sin, (uint16_t *)l->keys, (uint16_t *)l->values, l->capacity, position,
                                   l->scale, attended))
        return -1;
    if (rows_forward_bf16(m, &l->o, attended, f, out)) return -1;
    fmoe_add_rms_norm_bf16(h, out, H, (const uint16_t *)l->post_norm, l->post_eps, sum, normed);
    if (m->route == NULL || m->route(l - m->layer, normed, index, weights)) return 1;
    for (int64_t k = 0; k < K; k++)
        if (index[k] < 0 || index[k] >= l->experts) return 1;
    if (routed_experts(m, l, normed, 1, index, f, experts)) return -1;
    combine_bf16(experts, weights, (int)l->weights_bf16, K, H, f, moe);
    for (int64_t i = 0; i < H; i++) h[i] = float_to_bf16(bf16_to_float(sum[i]) + bf16_to_float(moe[i]));
    return 0;
}

/* fmoe_decode_token at bf16: h [H], cos and sin [D], logits [V] bf16; index [L, K] and weights [L, K] (float32) each
   layer's routing. Returns 0; -1: no memory, or a shape not taken; 1: a router (DecodeModel.route) declined or
   failed, or gave an expert out of range (the token's cache positions written so far are not committed: the caller
   may compute the token again, as models/token.py does on the per-step path). */
int fmoe_decode_token_bf16(const DecodeModel *m, uint16_t *h, const uint16_t *cos, const uint16_t *sin,
                           int64_t position, uint16_t *logits, int64_t *index, float *weights) {
    return decode_walk(m, 1, h, cos, sin, position, logits, index, weights);
}

static int decode_walk(const DecodeModel *m, int bf16, void *h, const void *cos, const void *sin, int64_t position,
                       void *logits, int64_t *index, float *weights) {
    int64_t bytes = m->hidden * (int64_t)sizeof(float);
    for (int64_t i = 0; i < m->layers; i++) {
        int64_t need = bf16 ? decode_work_bf16(m, &m->layer[i]) : decode_work(m, &m->layer[i]) * (int64_t)sizeof(float);
        if (need > bytes) bytes = need;
    }
    char *work = malloc((size_t)bytes);
    if (work == NULL) return -1;
    int status = 0;
    for (int64_t i = 0; i < m->layers && status == 0; i++) {
        const DecodeLayer *l = &m->layer[i];
        int64_t *e = index + i * l->top_k;
        float *w = weights + i * l->top_k;
        status = bf16 ? decode_layer_bf16(m, l, h, cos, sin, position, e, w, work)
                      : decode_layer(m, l, h, cos, sin, position, e, w, (float *)work);
    }
    if (status == 0 && bf16) {
        uint16_t *normed = (uint16_t *)work;
        uintptr_t after = (uintptr_t)(normed + m->hidden);
        float *f = (float *)((after + 63) & ~(uintptr_t)63);
        fmoe_add_rms_norm_bf16(h, NULL, m->hidden, (const uint16_t *)m->norm, m->norm_eps, NULL, normed);
        status = rows_forward_bf16(m, &m->head, normed, f, logits);
    } else if (status == 0) {
        fmoe_add_rms_norm(h, NULL, m->hidden, m->norm, m->norm_eps, NULL, (float *)work);
        status = rows_forward(m, &m->head, (float *)work, logits);
    }
    free(work);
    return status;
}
