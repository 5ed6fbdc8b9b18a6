/* One pass over a neuron-major expert segment, every format (fmoe_cli/kernels/__init__.py).

   A segment is n neuron rows; row i holds (gate row i, up row i, down column i), each a
   "projection" of proj_bytes: H floats (f32), H bf16, or codes then per-group metadata
   (int8, int4, int2: fmoe_cli/offload/quant.py and hqq.py). For tokens x [T, H]:

     for each neuron i:  g = x·ŵ_gate,i   u = x·ŵ_up,i   a[t] = silu(g)·u   c[t, :] += a[t]·ŵ_down,i

   Every byte of the segment is read once, in memory order per thread (fmoe_segment_forward says how
   the neurons are summed: in chunks of C, so that a split at a multiple of C gives the whole's bits,
   forward([k, n), acc = forward([0, k))) == forward([0, n)); nothing depends on the number of
   threads). bf16 compute (x in bf16) rounds g, u, silu(g) and a to bf16 as torch's bf16 ops do;
   acc stays float32 (the caller rounds the finished sum once).

   ŵ per format (q the code, per group of G along H):
     f32, bf16: ŵ = w                      int8: ŵ = q·s
     int4:      ŵ = q·s + m               int2 (HQQ): ŵ = (q − z)·s, s and z decoded from 8-bit codes
   so for a group  x·ŵ = s·Σ q·x + m·X_g  (X_g = Σ_g x; int2: m = −z·s), and a·ŵ = fma(q, a·s, a·m).
*/
#define _POSIX_C_SOURCE 200809L /* nanosleep */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <time.h>
#include "bf16.h"
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define FMOE_AVX2 1
#else
#define FMOE_AVX2 0
#endif

#ifndef PREFETCH_AHEAD
#define PREFETCH_AHEAD 8192 /* decode, int8/int4 rows: bytes the prefetch cursor runs ahead of the dots (0: none; Cursor) */
#endif
#ifndef PREFETCH_HINT
#define PREFETCH_HINT _MM_HINT_T0
#endif
#ifndef FMOE_PHASES
#define FMOE_PHASES 3 /* a benchmark build may time one phase alone */
#endif

enum { FMT_F32 = 0, FMT_BF16 = 1, FMT_INT8 = 2, FMT_INT4 = 3, FMT_INT2 = 4 };
#define FMT_DOWN_BY_NEURON 16 /* added to FMT_INT8 or FMT_INT4: down rows grouped along the neurons (§ down by neuron) */

typedef struct {
    int fmt;
    int64_t hidden;     /* H */
    int64_t proj_bytes; /* bytes of one projection row */
    int64_t group;      /* G (quantised formats) */
    int64_t meta_group; /* int2: scales per 8-bit scale group (M) */
    int down_by_neuron; /* FMT_DOWN_BY_NEURON was given */
} Format;

/* The Format of an entry point's arguments (fmt: a FMT_ code, + FMT_DOWN_BY_NEURON). */
static Format format_of(int fmt, int64_t hidden, int64_t proj_bytes, int64_t group, int64_t meta_group) {
    Format f = {fmt & (FMT_DOWN_BY_NEURON - 1), hidden, proj_bytes, group > 0 ? group : 1, meta_group > 0 ? meta_group : 1,
                (fmt & FMT_DOWN_BY_NEURON) != 0};
    return f;
}

/* The vector paths built (kernels/build.py SIMD_LEVELS): 0 scalar, 1 AVX2 (8 lanes), 2 AVX-512 (16 lanes). */
int fmoe_simd(void) {
#if FMOE_AVX2 && defined(__AVX512F__) && !defined(FMOE_NO_AVX512)
  return 2;
#else
  return FMOE_AVX2;
#endif
}

/* Tests only (tests/test_kernels.py): the prefill's int8-activation and by-neuron tiles off
   (every build has the switch), so that several tokens run the token-by-token paths whose bits the tiles must give. */
static int prefill_tiles = 1;
void fmoe_prefill_tiles(int on) { prefill_tiles = on; }

/* ---- scalar helpers ---------------------------------------------------------------- */

static inline float half_to_float(uint16_t h) {
#if FMOE_AVX2
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff, bits;
    if (exp == 0) {
        if (mant == 0) {
            bits = sign;
        } else { /* subnormal: normalise */
            exp = 127 - 15 + 1;
            while (!(mant & 0x400)) { mant <<= 1; exp--; }
            bits = sign | (exp << 23) | ((mant & 0x3ff) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000 | (mant << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

/* bf16_to_float, float_to_bf16 (round to nearest even, as torch), round_bf16: bf16.h */

#if FMOE_AVX2
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
static inline __m256 load_u8(const uint8_t *p) { /* 8 bytes -> 8 int32 */
    return (__m256)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
}
#endif

/* int2 metadata of one projection row: group g's scale s_g and zero z_g (offload/hqq.py's layout). */
static inline void int2_meta(const uint8_t *row, const Format *f, int64_t g, float *scale, float *zero) {
    int64_t quarter = f->hidden / 4, groups = f->hidden / f->group, m = f->meta_group;
    const uint8_t *scale_q = row + quarter, *zero_q = row + quarter + groups;
    const uint16_t *meta = (const uint16_t *)(row + quarter + 2 * groups); /* (σ, z) pairs: scales' groups, zeros' */
    int64_t mg = g / m, meta_groups = groups / m;
    *scale = ((float)scale_q[g] - half_to_float(meta[2 * mg + 1])) * half_to_float(meta[2 * mg]);
    *zero = ((float)zero_q[g] - half_to_float(meta[2 * meta_groups + 1])) * half_to_float(meta[2 * meta_groups]);
}

/* ŵ_j of one projection row (the scalar reference every vector path matches in value, not in bits). */
static inline float weight_at(const uint8_t *row, const Format *f, int64_t j) {
    int64_t h = f->hidden, g = j / f->group;
    switch (f->fmt) {
    case FMT_F32: return ((const float *)row)[j];
    case FMT_BF16: return bf16_to_float(((const uint16_t *)row)[j]);
    case FMT_INT8: {
        const uint16_t *meta = (const uint16_t *)(row + h);
        return (float)(int8_t)row[j] * half_to_float(meta[g]);
    }
    case FMT_INT4: {
        int64_t half = h / 2;
        int q = j < half ? row[j] & 15 : row[j - half] >> 4;
        const uint16_t *meta = (const uint16_t *)(row + half);
        return fmaf((float)q, half_to_float(meta[2 * g]), half_to_float(meta[2 * g + 1]));
    }
    default: { /* FMT_INT2 */
        int64_t quarter = h / 4;
        int q = (row[j % quarter] >> (6 - 2 * (j / quarter))) & 3;
        float s, z;
        int2_meta(row, f, g, &s, &z);
        return ((float)q - z) * s;
    }
    }
}

/* ---- phase 1: x·ŵ for one projection row ------------------------------------------------ */

/* x: one token [H] float32; xg: its per-group sums X_g (quantised formats). */
static float row_dot(const uint8_t *row, const Format *f, const float *x, const float *xg, int vector) {
    int64_t h = f->hidden, G = f->group;
#if FMOE_AVX2
    if (vector) {
        switch (f->fmt) {
        case FMT_F32: {
            const float *w = (const float *)row;
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            for (int64_t j = 0; j < h; j += 32) {
                a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + j), _mm256_loadu_ps(x + j), a0);
                a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w + j + 8), _mm256_loadu_ps(x + j + 8), a1);
                a2 = _mm256_fmadd_ps(_mm256_loadu_ps(w + j + 16), _mm256_loadu_ps(x + j + 16), a2);
                a3 = _mm256_fmadd_ps(_mm256_loadu_ps(w + j + 24), _mm256_loadu_ps(x + j + 24), a3);
            }
            return hsum8(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
        }
        case FMT_BF16: { /* x is given de-interleaved per 16: x[0,2,..,14], x[1,3,..,15] (see prepare_x) */
            const __m256i *w = (const __m256i *)row;
            const __m256i high = _mm256_set1_epi32((int)0xffff0000);
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            for (int64_t j = 0; j < h; j += 32) {
                __m256i v = _mm256_loadu_si256(w + j / 16), u = _mm256_loadu_si256(w + j / 16 + 1);
                a0 = _mm256_fmadd_ps((__m256)_mm256_slli_epi32(v, 16), _mm256_loadu_ps(x + j), a0);
                a1 = _mm256_fmadd_ps((__m256)_mm256_and_si256(v, high), _mm256_loadu_ps(x + j + 8), a1);
                a2 = _mm256_fmadd_ps((__m256)_mm256_slli_epi32(u, 16), _mm256_loadu_ps(x + j + 16), a2);
                a3 = _mm256_fmadd_ps((__m256)_mm256_and_si256(u, high), _mm256_loadu_ps(x + j + 24), a3);
            }
            return hsum8(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
        }
        case FMT_INT8: {
            const uint16_t *meta = (const uint16_t *)(row + h);
            __m256 total = _mm256_setzero_ps();
            for (int64_t g = 0; g < h / G; g++) {
                const int8_t *c = (const int8_t *)row + g * G;
                const float *xs = x + g * G;
                __m256 a0 = _mm256_setzero_ps(), a1 = a0;
                for (int64_t j = 0; j < G; j += 16) {
                    __m256i q0 = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(c + j)));
                    __m256i q1 = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(c + j + 8)));
                    a0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q0), _mm256_loadu_ps(xs + j), a0);
                    a1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q1), _mm256_loadu_ps(xs + j + 8), a1);
                }
                total = _mm256_fmadd_ps(_mm256_set1_ps(half_to_float(meta[g])), _mm256_add_ps(a0, a1), total);
            }
            return hsum8(total);
        }
        case FMT_INT4: { /* byte j: code j (low nibble), code j + H/2 (high): groups g and g + H/2G together */
            int64_t half = h / 2, paired = half / G;
            const uint16_t *meta = (const uint16_t *)(row + half);
            const __m256i low = _mm256_set1_epi32(15);
            __m256 total = _mm256_setzero_ps();
            float offsets = 0.0f;
            for (int64_t g = 0; g < paired; g++) {
                const uint8_t *c = row + g * G;
                const float *xl = x + g * G, *xh = x + half + g * G;
                __m256 l0 = _mm256_setzero_ps(), l1 = l0, h0 = l0, h1 = l0;
                for (int64_t j = 0; j < G; j += 16) {
                    __m256i b0 = (__m256i)load_u8(c + j), b1 = (__m256i)load_u8(c + j + 8);
                    l0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(b0, low)), _mm256_loadu_ps(xl + j), l0);
                    h0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(b0, 4)), _mm256_loadu_ps(xh + j), h0);
                    l1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(b1, low)), _mm256_loadu_ps(xl + j + 8), l1);
                    h1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(b1, 4)), _mm256_loadu_ps(xh + j + 8), h1);
                }
                int64_t gh = g + paired;
                total = _mm256_fmadd_ps(_mm256_set1_ps(half_to_float(meta[2 * g])), _mm256_add_ps(l0, l1), total);
                total = _mm256_fmadd_ps(_mm256_set1_ps(half_to_float(meta[2 * gh])), _mm256_add_ps(h0, h1), total);
                offsets = fmaf(half_to_float(meta[2 * g + 1]), xg[g], offsets);
                offsets = fmaf(half_to_float(meta[2 * gh + 1]), xg[gh], offsets);
            }
            return hsum8(total) + offsets;
        }
        default: { /* FMT_INT2: byte j holds codes j, j + H/4, j + H/2, j + 3H/4 (high bits first) */
            int64_t quarter = h / 4, per = quarter / G;
            const __m256i three = _mm256_set1_epi32(3);
            __m256 total = _mm256_setzero_ps();
            float offsets = 0.0f;
            for (int64_t g = 0; g < per; g++) {
                const uint8_t *c = row + g * G;
                __m256 a[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
                for (int64_t j = 0; j < G; j += 8) {
                    __m256i b = (__m256i)load_u8(c + j);
                    for (int k = 0; k < 4; k++) {
                        __m256i q = _mm256_and_si256(_mm256_srli_epi32(b, 6 - 2 * k), three);
                        a[k] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), _mm256_loadu_ps(x + k * quarter + g * G + j), a[k]);
                    }
                }
                for (int k = 0; k < 4; k++) {
                    float s, z;
                    int64_t gk = g + k * per;
                    int2_meta(row, f, gk, &s, &z);
                    total = _mm256_fmadd_ps(_mm256_set1_ps(s), a[k], total);
                    offsets = fmaf(-z * s, xg[gk], offsets);
                }
            }
            return hsum8(total) + offsets;
        }
        }
    }
#endif
    (void)G;
    (void)xg;
    float sum = 0.0f;
    for (int64_t j = 0; j < h; j++) sum = fmaf(weight_at(row, f, j), x[j], sum);
    return sum;
}

/* ---- phase 1 with int8 activations (x̂): integer dot products per block of 32 ---------------------

   The "int8 activations" mode (--activations int8, Spec.int8_activations): each token's x is quantised once per
   block b of QBLOCK = 32 weights, as llama.cpp's Q8_0:  d_b = max_b |x| / 127,  q̃_j = round(x_j / d_b),
   x̂_j = q̃_j·d_b. Then for a group g of G weights (a multiple of 32)

     int8:  x̂·ŵ = Σ_g s_g Σ_{b∈g} d_b Σ_{j∈b} q_j q̃_j
     int4:  x̂·ŵ = Σ_g (s_g Σ_{b∈g} d_b Σ_{j∈b} q_j q̃_j + m_g X̂_g),  X̂_g = Σ_{b∈g} d_b Σ_{j∈b} q̃_j

   each inner Σ an exact integer (AVX2 maddubs: unsigned × signed bytes into int16 pairs, at most
   2·127·127 < 2¹⁵; int8's signed codes go through |q̃|, sign(q, q̃)). Only gate and up (and a dense
   linear's rows) are dots over x; a down projection grouped along the neurons is an integer dot over the gated
   activations (§ down by neuron), one grouped along H stays float32 (its scales vary along the sum). */
#define QBLOCK 32

#if FMOE_AVX2 && defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && !defined(FMOE_NO_AVX512)
#define FMOE_VNNI 1
/* rows_dot_q8 (below) on AVX-512 VNNI, for G a multiple of 64: two blocks of 32 a step, each inner Σ q q̃ one
   vpdpbusd (unsigned × signed bytes, four products into each int32 lane, exact), where AVX2 needs maddubs and
   madd for one block. int8's signed codes: Σ q q̃ = Σ |q̃|·(q negated where q̃ < 0). The block sums are exact
   integers as before; the float32 sums go 16 lanes wide (the two blocks' lanes side by side), so the bits are
   this build's own, like every 16-lane path (test_kernels checks the result against x̂·ŵ). */
static inline __attribute__((always_inline)) void rows_dot_q8_vnni(const uint8_t *const *rows, int R, const Format *f,
                                                                    const int8_t *xq, const uint8_t *xa,
                                                                    const float *xd, const float *xg, float *out) {
    int64_t h = f->hidden, G = f->group;
    const __m512i zero = _mm512_setzero_si512();
    __m512 total[4], lo[4], hi[4];
    for (int r = 0; r < R; r++) total[r] = _mm512_setzero_ps();
#define BLOCK_SCALES(b) _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_set1_ps(xd[b])), _mm256_set1_ps(xd[(b) + 1]), 1)
    if (f->fmt == FMT_INT8) {
        for (int64_t g = 0; g < h / G; g++) {
            for (int r = 0; r < R; r++) lo[r] = _mm512_setzero_ps();
            for (int64_t j = g * G; j < (g + 1) * G; j += 2 * QBLOCK) {
                __m512i a = _mm512_loadu_si512((const void *)(xa + j));
                __mmask64 negative = _mm512_movepi8_mask(_mm512_loadu_si512((const void *)(xq + j)));
                __m512 d = BLOCK_SCALES(j / QBLOCK);
                for (int r = 0; r < R; r++) {
                    __m512i w = _mm512_loadu_si512((const void *)(rows[r] + j));
                    __m512i p = _mm512_dpbusd_epi32(zero, a, _mm512_mask_sub_epi8(w, negative, zero, w));
                    lo[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), d, lo[r]);
                }
            }
            for (int r = 0; r < R; r++) {
                float scale = half_to_float(((const uint16_t *)(rows[r] + h))[g]);
                total[r] = _mm512_fmadd_ps(_mm512_set1_ps(scale), lo[r], total[r]);
            }
        }
        for (int r = 0; r < R; r++) out[r] = _mm512_reduce_add_ps(total[r]);
        return;
    }
    /* int4: byte j holds code j (low nibble) and code j + H/2 (high): groups g and g + H/2G together */
    int64_t half = h / 2, paired = half / G;
    const __m512i nibble = _mm512_set1_epi8(15);
    float offsets[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int64_t g = 0; g < paired; g++) {
        int64_t gh = g + paired;
        for (int r = 0; r < R; r++) lo[r] = hi[r] = _mm512_setzero_ps();
        for (int64_t j = g * G; j < (g + 1) * G; j += 2 * QBLOCK) {
            __m512i xl = _mm512_loadu_si512((const void *)(xq + j)), xh = _mm512_loadu_si512((const void *)(xq + half + j));
            __m512 dl = BLOCK_SCALES(j / QBLOCK), dh = BLOCK_SCALES((half + j) / QBLOCK);
            for (int r = 0; r < R; r++) {
                __m512i c = _mm512_loadu_si512((const void *)(rows[r] + j));
                __m512i pl = _mm512_dpbusd_epi32(zero, _mm512_and_si512(c, nibble), xl);
                __m512i ph = _mm512_dpbusd_epi32(zero, _mm512_and_si512(_mm512_srli_epi16(c, 4), nibble), xh);
                lo[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(pl), dl, lo[r]);
                hi[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ph), dh, hi[r]);
            }
        }
        for (int r = 0; r < R; r++) {
            const uint16_t *meta = (const uint16_t *)(rows[r] + half);
            total[r] = _mm512_fmadd_ps(_mm512_set1_ps(half_to_float(meta[2 * g])), lo[r], total[r]);
            total[r] = _mm512_fmadd_ps(_mm512_set1_ps(half_to_float(meta[2 * gh])), hi[r], total[r]);
            offsets[r] = fmaf(half_to_float(meta[2 * g + 1]), xg[g], offsets[r]);
            offsets[r] = fmaf(half_to_float(meta[2 * gh + 1]), xg[gh], offsets[r]);
        }
    }
#undef BLOCK_SCALES
    for (int r = 0; r < R; r++) out[r] = _mm512_reduce_add_ps(total[r]) + offsets[r];
}
#else
#define FMOE_VNNI 0
#endif

/* AVX-VNNI: vpdpbusd on 256 bits (AVX2 CPUs from Intel's 12th generation: __AVXVNNI__; FMOE_KERNEL_ISA=avx2vnni builds
   it on any CPU that has it), or AVX-512 VNNI's 256-bit form. Unsigned × signed bytes, four products into each int32
   lane, exact (no int16 step to saturate, unlike maddubs), so the AVX2 tiles below can take int8 codes as q + 128. */
#if FMOE_AVX2 && (defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__) && !defined(FMOE_NO_AVX512)))
#define FMOE_AVX_VNNI 1
static inline __m256i dpbusd8(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
    return _mm256_dpbusd_epi32(acc, u, s);
#endif
}
#else
#define FMOE_AVX_VNNI 0
#endif

/* The int8 dot paths built: 0 none (scalar), 1 AVX2 maddubs, 2 AVX-VNNI (256-bit), 3 AVX-512 VNNI (tests' probe). */
int fmoe_int8_dots(void) { return FMOE_VNNI ? 3 : FMOE_AVX_VNNI ? 2 : FMOE_AVX2; }

#if FMOE_AVX2
/* x̂·ŵ_r for R ≤ 4 rows at once (a neuron's gate and up rows; a dense linear's output rows), sharing each load of
   the token: xq its codes q̃, xa their magnitudes |q̃| (int8's signed codes: Σ q q̃ = Σ |q̃|·sign(q, q̃), one
   unsigned × signed maddubs), xd the block scales d_b, xg X̂_g (int4). Per row: for each group, Σ_b d_b·(Σ_b q q̃)
   in float32 from zero, then times s_g into the row's total: every row's operations are its own, in the same
   order whatever R is. R is a constant at each call (inlined): int8 up to 4 rows, int4 up to 2 (registers). */
static inline __attribute__((always_inline)) void rows_dot_q8(const uint8_t *const *rows, int R, const Format *f,
                                                               const int8_t *xq, const uint8_t *xa, const float *xd,
                                                               const float *xg, float *out) {
    int64_t h = f->hidden, G = f->group;
#if FMOE_VNNI
    if (G % (2 * QBLOCK) == 0) {
        rows_dot_q8_vnni(rows, R, f, xq, xa, xd, xg, out);
        return;
    }
#endif
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 total[4], lo[4], hi[4];
    for (int r = 0; r < R; r++) total[r] = _mm256_setzero_ps();
    if (f->fmt == FMT_INT8) {
        for (int64_t g = 0; g < h / G; g++) {
            for (int r = 0; r < R; r++) lo[r] = _mm256_setzero_ps();
            for (int64_t j = g * G; j < (g + 1) * G; j += QBLOCK) {
                __m256i x = _mm256_loadu_si256((const __m256i *)(xq + j)), a = _mm256_loadu_si256((const __m256i *)(xa + j));
                __m256 d = _mm256_set1_ps(xd[j / QBLOCK]);
                for (int r = 0; r < R; r++) {
                    __m256i w = _mm256_loadu_si256((const __m256i *)(rows[r] + j));
                    __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(a, _mm256_sign_epi8(w, x)), ones);
                    lo[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), d, lo[r]);
                }
            }
            for (int r = 0; r < R; r++) {
                float scale = half_to_float(((const uint16_t *)(rows[r] + h))[g]);
                total[r] = _mm256_fmadd_ps(_mm256_set1_ps(scale), lo[r], total[r]);
            }
        }
        for (int r = 0; r < R; r++) out[r] = hsum8(total[r]);
        return;
    }
    /* int4: byte j holds code j (low nibble) and code j + H/2 (high): groups g and g + H/2G together */
    int64_t half = h / 2, paired = half / G;
    const __m256i nibble = _mm256_set1_epi8(15);
    float offsets[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int64_t g = 0; g < paired; g++) {
        int64_t gh = g + paired;
        for (int r = 0; r < R; r++) lo[r] = hi[r] = _mm256_setzero_ps();
        for (int64_t j = g * G; j < (g + 1) * G; j += QBLOCK) {
            __m256i xl = _mm256_loadu_si256((const __m256i *)(xq + j)), xh = _mm256_loadu_si256((const __m256i *)(xq + half + j));
            __m256 dl = _mm256_set1_ps(xd[j / QBLOCK]), dh = _mm256_set1_ps(xd[(half + j) / QBLOCK]);
            for (int r = 0; r < R; r++) {
                __m256i c = _mm256_loadu_si256((const __m256i *)(rows[r] + j));
                __m256i pl = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_and_si256(c, nibble), xl), ones);
                __m256i ph = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(c, 4), nibble), xh), ones);
                lo[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(pl), dl, lo[r]);
                hi[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ph), dh, hi[r]);
            }
        }
        for (int r = 0; r < R; r++) {
            const uint16_t *meta = (const uint16_t *)(rows[r] + half);
            total[r] = _mm256_fmadd_ps(_mm256_set1_ps(half_to_float(meta[2 * g])), lo[r], total[r]);
            total[r] = _mm256_fmadd_ps(_mm256_set1_ps(half_to_float(meta[2 * gh])), hi[r], total[r]);
            offsets[r] = fmaf(half_to_float(meta[2 * g + 1]), xg[g], offsets[r]);
            offsets[r] = fmaf(half_to_float(meta[2 * gh + 1]), xg[gh], offsets[r]);
        }
    }
    for (int r = 0; r < R; r++) out[r] = hsum8(total[r]) + offsets[r];
}
#endif

/* Floats of dots_q8's per-token vectors (q8_vectors) for T tokens of H inputs, and with the group sums'
   (group_sum_vectors: groups of 64 inputs at least, tokens padded to 16) after them. */
static int64_t q8_vector_floats(int64_t tokens, int64_t hidden) { return tokens * (hidden / 2 + 16); }
static int64_t q8_scratch_floats(int64_t tokens, int64_t hidden) {
    return q8_vector_floats(tokens, hidden) + (tokens + 15) / 16 * 16 * (hidden / 64);
}

/* Whether the int8-activation dots serve this format and shape (else the float32 ones run). */
static int q8_shape(const Format *f) {
    if (!FMOE_AVX2) return 0;
    int64_t h = f->hidden, G = f->group;
    if (f->fmt == FMT_INT8) return G % QBLOCK == 0 && h % G == 0;
    if (f->fmt == FMT_INT4) return G % QBLOCK == 0 && (h / 2) % G == 0;
    return 0;
}

#if FMOE_AVX2
/* One token's x̂: codes q̃ [H] and their magnitudes, block scales d [H/32] (d = max|x| / 127, q̃ = x·(1/d) rounded
   to nearest even), and (int4) the group sums X̂_g (the module docstring). Only AVX2 machines run the mode. */
static void quantize_x(const float *x, const Format *f, int8_t *xq, uint8_t *xa, float *xd, float *xg) {
    int64_t h = f->hidden;
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int64_t b = 0; b < h / QBLOCK; b++) {
        const float *v = x + b * QBLOCK;
        __m256 v0 = _mm256_loadu_ps(v), v1 = _mm256_loadu_ps(v + 8), v2 = _mm256_loadu_ps(v + 16), v3 = _mm256_loadu_ps(v + 24);
        __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v0, magnitude), _mm256_and_ps(v1, magnitude)),
                                 _mm256_max_ps(_mm256_and_ps(v2, magnitude), _mm256_and_ps(v3, magnitude)));
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
        float d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
        __m256 scale = _mm256_set1_ps(id);
        __m256i q0 = _mm256_cvtps_epi32(_mm256_mul_ps(v0, scale)), q1 = _mm256_cvtps_epi32(_mm256_mul_ps(v1, scale));
        __m256i q2 = _mm256_cvtps_epi32(_mm256_mul_ps(v2, scale)), q3 = _mm256_cvtps_epi32(_mm256_mul_ps(v3, scale));
        __m256i total = _mm256_add_epi32(_mm256_add_epi32(q0, q1), _mm256_add_epi32(q2, q3));
        __m128i t4 = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
        t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0x4e));
        int sum = _mm_cvtsi128_si32(_mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0xb1)));
        __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(q0, q1), _mm256_packs_epi32(q2, q3));
        packed = _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)(xq + b * QBLOCK), packed);
        _mm256_storeu_si256((__m256i *)(xa + b * QBLOCK), _mm256_abs_epi8(packed));
        xd[b] = d;
        if (xg) { /* X̂_g: the blocks' d_b·Σ q̃, in order */
            int64_t g = b * QBLOCK / f->group;
            xg[g] = (b * QBLOCK) % f->group == 0 ? d * (float)sum : fmaf(d, (float)sum, xg[g]);
        }
    }
}
#endif

/* ---- several tokens: ŵ once per row, then float32 dots ------------------------------------ */

/* One projection row -> ŵ [H] float32, in the order row_dot's x is in (bf16 format: de-interleaved per 16). */
static void decode_row(const uint8_t *row, const Format *f, float *w, int vector) {
    int64_t h = f->hidden, G = f->group;
#if FMOE_AVX2
    if (vector) {
        switch (f->fmt) {
        case FMT_F32: memcpy(w, row, sizeof(float) * h); return;
        case FMT_BF16: {
            const __m256i high = _mm256_set1_epi32((int)0xffff0000);
            for (int64_t j = 0; j < h; j += 16) {
                __m256i v = _mm256_loadu_si256((const __m256i *)(row + 2 * j));
                _mm256_storeu_ps(w + j, (__m256)_mm256_slli_epi32(v, 16));
                _mm256_storeu_ps(w + j + 8, (__m256)_mm256_and_si256(v, high));
            }
            return;
        }
        case FMT_INT8: {
            const uint16_t *meta = (const uint16_t *)(row + h);
            for (int64_t g = 0; g < h / G; g++) {
                __m256 s = _mm256_set1_ps(half_to_float(meta[g]));
                for (int64_t j = g * G; j < (g + 1) * G; j += 8)
                    _mm256_storeu_ps(w + j, _mm256_mul_ps(_mm256_cvtepi32_ps(
                        _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(row + j)))), s));
            }
            return;
        }
        case FMT_INT4: {
            int64_t half = h / 2, paired = half / G;
            const uint16_t *meta = (const uint16_t *)(row + half);
            const __m256i low = _mm256_set1_epi32(15);
            for (int64_t g = 0; g < paired; g++) {
                int64_t gh = g + paired;
                __m256 sl = _mm256_set1_ps(half_to_float(meta[2 * g])), ml = _mm256_set1_ps(half_to_float(meta[2 * g + 1]));
                __m256 sh = _mm256_set1_ps(half_to_float(meta[2 * gh])), mh = _mm256_set1_ps(half_to_float(meta[2 * gh + 1]));
                for (int64_t j = g * G; j < (g + 1) * G; j += 8) {
                    __m256i b = (__m256i)load_u8(row + j);
                    _mm256_storeu_ps(w + j, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(b, low)), sl, ml));
                    _mm256_storeu_ps(w + half + j, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4)), sh, mh));
                }
            }
            return;
        }
        default: { /* FMT_INT2 */
            int64_t quarter = h / 4, per = quarter / G;
            const __m256i three = _mm256_set1_epi32(3);
            for (int64_t g = 0; g < per; g++)
                for (int k = 0; k < 4; k++) {
                    float sc, z;
                    int2_meta(row, f, g + k * per, &sc, &z);
                    __m256 s = _mm256_set1_ps(sc), m = _mm256_set1_ps(-z * sc);
                    for (int64_t j = g * G; j < (g + 1) * G; j += 8) {
                        __m256 q = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32((__m256i)load_u8(row + j), 6 - 2 * k), three));
                        _mm256_storeu_ps(w + k * quarter + j, _mm256_fmadd_ps(q, s, m));
                    }
                }
            return;
        }
        }
    }
#endif
    (void)G;
    for (int64_t j = 0; j < h; j++) w[j] = weight_at(row, f, j);
}

/* out[t] = ŵ·x_t for every token: four tokens at a time share each load of ŵ. */
static void dot_tokens(const float *w, const float *x, int64_t tokens, int64_t h, float *out, int vector) {
    int64_t t = 0;
#if FMOE_AVX2
    if (vector) {
        for (; t + 4 <= tokens; t += 4) {
            const float *x0 = x + t * h, *x1 = x0 + h, *x2 = x1 + h, *x3 = x2 + h;
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
            for (int64_t j = 0; j < h; j += 16) {
                __m256 v = _mm256_loadu_ps(w + j), u = _mm256_loadu_ps(w + j + 8);
                a0 = _mm256_fmadd_ps(v, _mm256_loadu_ps(x0 + j), a0);
                a1 = _mm256_fmadd_ps(v, _mm256_loadu_ps(x1 + j), a1);
                a2 = _mm256_fmadd_ps(v, _mm256_loadu_ps(x2 + j), a2);
                a3 = _mm256_fmadd_ps(v, _mm256_loadu_ps(x3 + j), a3);
                b0 = _mm256_fmadd_ps(u, _mm256_loadu_ps(x0 + j + 8), b0);
                b1 = _mm256_fmadd_ps(u, _mm256_loadu_ps(x1 + j + 8), b1);
                b2 = _mm256_fmadd_ps(u, _mm256_loadu_ps(x2 + j + 8), b2);
                b3 = _mm256_fmadd_ps(u, _mm256_loadu_ps(x3 + j + 8), b3);
            }
            out[t] = hsum8(_mm256_add_ps(a0, b0)), out[t + 1] = hsum8(_mm256_add_ps(a1, b1));
            out[t + 2] = hsum8(_mm256_add_ps(a2, b2)), out[t + 3] = hsum8(_mm256_add_ps(a3, b3));
        }
        for (; t < tokens; t++) { /* the same sums, one token */
            const float *x0 = x + t * h;
            __m256 a0 = _mm256_setzero_ps(), b0 = a0;
            for (int64_t j = 0; j < h; j += 16) {
                a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + j), _mm256_loadu_ps(x0 + j), a0);
                b0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + j + 8), _mm256_loadu_ps(x0 + j + 8), b0);
            }
            out[t] = hsum8(_mm256_add_ps(a0, b0));
        }
        return;
    }
#endif
    for (; t < tokens; t++) {
        float sum = 0.0f;
        for (int64_t j = 0; j < h; j++) sum = fmaf(w[j], x[t * h + j], sum);
        out[t] = sum;
    }
}

/* ---- several tokens: register-blocked products on decoded rows (T > PREFILL_FROM) -----------------

   A prefill gives an expert several tokens. ŵ is decoded a few rows at a time into an L1/L2-resident float
   block, and the products run in register tiles that share each load over several rows and tokens:
     dots (gate, up; a dense linear's rows): a tile of DOT_ROWS rows × DOT_TOKENS tokens, one VL-lane
       accumulator per (row, token) along H, then its horizontal sum;
     down: a tile of DOWN_TOKENS tokens × 2·VL columns, the neurons of a block added in order (the first one's
       product, then one fma per neuron), the tile kept in registers across them.
   VL: 16 lanes where the compiler targets AVX-512 (-march=native on such a CPU), else 8 (AVX2). Every output's
   operations are the same whatever tile it falls in (a remainder tile runs the same sequence), so no bit depends
   on T's remainder, the tiling or the thread count (the vector width, like the compiler, is the machine's). */
#ifndef FMOE_PREFILL_FROM
#define FMOE_PREFILL_FROM 1
#endif
/* More tokens than this: these paths. From 2 tokens they cost less CPU than decoding each row and dotting it with
   four tokens at a time (one a3b expert, 2–4 tokens: 10–25 % less; docs/bench.md § CPU expert kernels). */
#define PREFILL_FROM FMOE_PREFILL_FROM
#define DOT_ROWS 4
#define DOWN_NEURONS 16 /* down rows decoded at once (a block's partial sum stays in c between blocks) */

#if FMOE_AVX2
#if defined(__AVX512F__) && !defined(FMOE_NO_AVX512)
typedef __m512 vec;
#define VL 16
#define DOT_TOKENS 4
#define DOWN_TOKENS 8
#define vzero _mm512_setzero_ps
#define vload _mm512_loadu_ps
#define vstore _mm512_storeu_ps
#define vfma _mm512_fmadd_ps
#define vmul _mm512_mul_ps
#define vset1 _mm512_set1_ps
#define vsum _mm512_reduce_add_ps
#else
typedef __m256 vec;
#define VL 8
#define DOT_TOKENS 3
#define DOWN_TOKENS 6
#define vzero _mm256_setzero_ps
#define vload _mm256_loadu_ps
#define vstore _mm256_storeu_ps
#define vfma _mm256_fmadd_ps
#define vmul _mm256_mul_ps
#define vset1 _mm256_set1_ps
#define vsum hsum8
#endif

/* out[r·rs + t·ts] = ŵ_r·x_t for R rows (w, h apart) × TT tokens (x, h apart); R, TT constants when inlined. */
static inline __attribute__((always_inline)) void dots_tile(const float *w, int R, const float *x, int TT, int64_t h,
                                                             float *out, int64_t rs, int64_t ts) {
    vec acc[DOT_ROWS][DOT_TOKENS];
    for (int r = 0; r < R; r++)
        for (int t = 0; t < TT; t++) acc[r][t] = vzero();
    for (int64_t j = 0; j < h; j += VL) {
        vec xv[DOT_TOKENS];
        for (int t = 0; t < TT; t++) xv[t] = vload(x + t * h + j);
        for (int r = 0; r < R; r++) {
            vec wv = vload(w + r * h + j);
            for (int t = 0; t < TT; t++) acc[r][t] = vfma(wv, xv[t], acc[r][t]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int t = 0; t < TT; t++) out[r * rs + t * ts] = vsum(acc[r][t]);
}

#define DOTS_TILE_CASE(R, TT) case (R) * 8 + (TT): dots_tile(w, R, x, TT, h, out, rs, ts); return
#define DOTS_TILE_ROWS(R) DOTS_TILE_CASE(R, 3); DOTS_TILE_CASE(R, 2); DOTS_TILE_CASE(R, 1)
static void dots_tile_any(const float *w, int R, const float *x, int TT, int64_t h, float *out, int64_t rs, int64_t ts) {
    switch (R * 8 + TT) { /* a constant shape for each inlined copy */
#if DOT_TOKENS == 4
    DOTS_TILE_CASE(4, 4); DOTS_TILE_CASE(3, 4); DOTS_TILE_CASE(2, 4); DOTS_TILE_CASE(1, 4);
#endif
    DOTS_TILE_ROWS(4); DOTS_TILE_ROWS(3); DOTS_TILE_ROWS(2); DOTS_TILE_CASE(1, 3); DOTS_TILE_CASE(1, 2);
    default: dots_tile(w, 1, x, 1, h, out, rs, ts); return;
    }
}

/* out[r·rs + t·ts] = ŵ_r·x_t for `rows` decoded rows w [rows, H] and every token x [T, H]. */
static void dots_rows(const float *w, int64_t rows, const float *x, int64_t tokens, int64_t h, float *out, int64_t rs,
                      int64_t ts) {
    for (int64_t r = 0; r < rows; r += DOT_ROWS) {
        int R = rows - r < DOT_ROWS ? (int)(rows - r) : DOT_ROWS;
        for (int64_t t = 0; t < tokens; t += DOT_TOKENS) {
            int TT = tokens - t < DOT_TOKENS ? (int)(tokens - t) : DOT_TOKENS;
            dots_tile_any(w + r * h, R, x + t * h, TT, h, out + r * rs + t * ts, rs, ts);
        }
    }
}

/* c[t, j:j+2VL] for TT tokens: init ? Σ_n : c + Σ_n of a_n[t]·ŵ_n[j:j+2VL] over n < N, in order (the first a
   product when init, else an fma onto c; then one fma per neuron). a_n[t] = a[n·as + t]; w [N, H] decoded down rows. */
static inline __attribute__((always_inline)) void down_tile(const float *w, int64_t N, const float *a, int64_t as,
                                                             int TT, int64_t h, float *c, int init) {
    vec acc[DOWN_TOKENS][2];
    vec w0 = vload(w), w1 = vload(w + VL);
    for (int t = 0; t < TT; t++) {
        vec at = vset1(a[t]);
        if (init) {
            acc[t][0] = vmul(at, w0), acc[t][1] = vmul(at, w1);
        } else {
            acc[t][0] = vfma(at, w0, vload(c + t * h)), acc[t][1] = vfma(at, w1, vload(c + t * h + VL));
        }
    }
    for (int64_t n = 1; n < N; n++) {
        w0 = vload(w + n * h), w1 = vload(w + n * h + VL);
        for (int t = 0; t < TT; t++) {
            vec at = vset1(a[n * as + t]);
            acc[t][0] = vfma(at, w0, acc[t][0]), acc[t][1] = vfma(at, w1, acc[t][1]);
        }
    }
    for (int t = 0; t < TT; t++) vstore(c + t * h, acc[t][0]), vstore(c + t * h + VL, acc[t][1]);
}

#define DOWN_TILE_CASE(TT) case TT: down_tile(w, N, a, as, TT, h, c, init); return
static void down_tile_any(const float *w, int64_t N, const float *a, int64_t as, int TT, int64_t h, float *c, int init) {
    switch (TT) {
#if DOWN_TOKENS == 8
    DOWN_TILE_CASE(8); DOWN_TILE_CASE(7);
#endif
    DOWN_TILE_CASE(6); DOWN_TILE_CASE(5); DOWN_TILE_CASE(4); DOWN_TILE_CASE(3); DOWN_TILE_CASE(2);
    default: down_tile(w, N, a, as, 1, h, c, init); return;
    }
}

/* c [T, H] (init: =, else +=) Σ_n a_n[t]·ŵ_n over N decoded down rows w [N, H], in order (H a multiple of 2VL). */
static void down_block(const float *w, int64_t N, const float *a, int64_t as, int64_t tokens, int64_t h, float *c,
                       int init) {
    for (int64_t t = 0; t < tokens; t += DOWN_TOKENS) {
        int TT = tokens - t < DOWN_TOKENS ? (int)(tokens - t) : DOWN_TOKENS;
        for (int64_t j = 0; j < h; j += 2 * VL) down_tile_any(w + j, N, a + t, as, TT, h, c + t * h + j, init);
    }
}
#endif

/* A down row -> ŵ [H] float32 in natural order (decode_row's, except bf16's, which decode_row de-interleaves). */
static __attribute__((unused)) void decode_down(const uint8_t *row, const Format *f, float *w, int vector) {
#if FMOE_AVX2
    if (vector && f->fmt == FMT_BF16) {
        for (int64_t j = 0; j < f->hidden; j += 8)
            _mm256_storeu_ps(w + j, (__m256)_mm256_slli_epi32(
                _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)row + j))), 16));
        return;
    }
#endif
    decode_row(row, f, w, vector);
}

/* ---- down: c[t, :] (+)= a[t]·ŵ over one row ----------------------------------------------- */

/* c [T, H]: a chunk's partial sum. init: the chunk's first neuron writes c (no add). For int4/int2 a
   neuron's contribution is fma(q, a·s, a·m), then added; for int8 q·(a·s) is fused into the add. */
static void row_axpy(const uint8_t *restrict row, const Format *f, const float *restrict a, int64_t tokens,
                     float *restrict c, int init,
                     int vector) {
    int64_t h = f->hidden, G = f->group;
#if FMOE_AVX2
    if (vector) {
        switch (f->fmt) {
        case FMT_F32:
        case FMT_BF16: {
            for (int64_t j = 0; j < h; j += 8) {
                __m256 v = f->fmt == FMT_F32 ? _mm256_loadu_ps((const float *)row + j)
                    : (__m256)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)row + j))), 16);
                for (int64_t t = 0; t < tokens; t++) {
                    float *o = c + t * h + j;
                    __m256 at = _mm256_set1_ps(a[t]);
                    _mm256_storeu_ps(o, init ? _mm256_mul_ps(at, v) : _mm256_fmadd_ps(at, v, _mm256_loadu_ps(o)));
                }
            }
            return;
        }
        case FMT_INT8: {
            const uint16_t *meta = (const uint16_t *)(row + h);
            for (int64_t g = 0; g < h / G; g++) {
                float s = half_to_float(meta[g]);
                for (int64_t j = g * G; j < (g + 1) * G; j += 8) {
                    __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(row + j))));
                    for (int64_t t = 0; t < tokens; t++) {
                        float *o = c + t * h + j;
                        __m256 as = _mm256_set1_ps(a[t] * s);
                        _mm256_storeu_ps(o, init ? _mm256_mul_ps(q, as) : _mm256_fmadd_ps(q, as, _mm256_loadu_ps(o)));
                    }
                }
            }
            return;
        }
        case FMT_INT4: {
            int64_t half = h / 2, paired = half / G;
            const uint16_t *meta = (const uint16_t *)(row + half);
            const __m256i low = _mm256_set1_epi32(15);
            for (int64_t g = 0; g < paired; g++) {
                int64_t gh = g + paired;
                float sl = half_to_float(meta[2 * g]), ml = half_to_float(meta[2 * g + 1]);
                float sh = half_to_float(meta[2 * gh]), mh = half_to_float(meta[2 * gh + 1]);
                for (int64_t j = g * G; j < (g + 1) * G; j += 8) {
                    __m256i b = (__m256i)load_u8(row + j);
                    __m256 ql = _mm256_cvtepi32_ps(_mm256_and_si256(b, low));
                    __m256 qh = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
                    for (int64_t t = 0; t < tokens; t++) {
                        float *o = c + t * h + j, *p = o + half;
                        __m256 cl = _mm256_fmadd_ps(ql, _mm256_set1_ps(a[t] * sl), _mm256_set1_ps(a[t] * ml));
                        __m256 ch = _mm256_fmadd_ps(qh, _mm256_set1_ps(a[t] * sh), _mm256_set1_ps(a[t] * mh));
                        _mm256_storeu_ps(o, init ? cl : _mm256_add_ps(_mm256_loadu_ps(o), cl));
                        _mm256_storeu_ps(p, init ? ch : _mm256_add_ps(_mm256_loadu_ps(p), ch));
                    }
                }
            }
            return;
        }
        default: { /* FMT_INT2 */
            int64_t quarter = h / 4, per = quarter / G;
            const __m256i three = _mm256_set1_epi32(3);
            for (int64_t g = 0; g < per; g++) {
                float s[4], z[4];
                for (int k = 0; k < 4; k++) int2_meta(row, f, g + k * per, &s[k], &z[k]);
                for (int64_t j = g * G; j < (g + 1) * G; j += 8) {
                    __m256i b = (__m256i)load_u8(row + j);
                    for (int k = 0; k < 4; k++) {
                        __m256 q = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(b, 6 - 2 * k), three));
                        for (int64_t t = 0; t < tokens; t++) {
                            float *o = c + t * h + k * quarter + j;
                            float as = a[t] * s[k];
                            __m256 v = _mm256_fmadd_ps(q, _mm256_set1_ps(as), _mm256_set1_ps(-as * z[k]));
                            _mm256_storeu_ps(o, init ? v : _mm256_add_ps(_mm256_loadu_ps(o), v));
                        }
                    }
                }
            }
            return;
        }
        }
    }
#endif
    (void)G;
    for (int64_t j = 0; j < h; j++) {
        float w = weight_at(row, f, j);
        for (int64_t t = 0; t < tokens; t++) c[t * h + j] = init ? a[t] * w : fmaf(a[t], w, c[t * h + j]);
    }
}

/* Several neurons' down rows at once (int8, int4): c[t, :] (+)= Σ_r a_r[t]·ŵ_down,r, each element's operations
   those of row_axpy neuron after neuron (the first a product or a sum onto c, then one fma or add per row, in
   order): the same bits, with c loaded and stored once per R ≤ AXPY_ROWS rows instead of once per row. */
#define AXPY_ROWS 4
#if FMOE_AVX2
static inline __attribute__((always_inline)) void rows_axpy_q(const uint8_t *const *rows, int R, const Format *f,
                                                               const float *a, int64_t a_stride, int64_t tokens,
                                                               float *restrict c, int init) {
    int64_t h = f->hidden, G = f->group;
    float scaled[2][AXPY_ROWS][32], shifted[2][AXPY_ROWS][32]; /* a_r[t]·s (and a_r[t]·m) of the group(s) */
    if (f->fmt == FMT_INT8) {
        for (int64_t g = 0; g < h / G; g++) {
            for (int r = 0; r < R; r++) {
                float s = half_to_float(((const uint16_t *)(rows[r] + h))[g]);
                for (int64_t t = 0; t < tokens; t++) scaled[0][r][t] = a[r * a_stride + t] * s;
            }
            for (int64_t j = g * G; j < (g + 1) * G; j += 8) {
                __m256 q[AXPY_ROWS];
                for (int r = 0; r < R; r++)
                    q[r] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(rows[r] + j))));
                for (int64_t t = 0; t < tokens; t++) {
                    float *o = c + t * h + j;
                    __m256 v = init ? _mm256_mul_ps(q[0], _mm256_broadcast_ss(&scaled[0][0][t]))
                                    : _mm256_fmadd_ps(q[0], _mm256_broadcast_ss(&scaled[0][0][t]), _mm256_loadu_ps(o));
                    for (int r = 1; r < R; r++) v = _mm256_fmadd_ps(q[r], _mm256_broadcast_ss(&scaled[0][r][t]), v);
                    _mm256_storeu_ps(o, v);
                }
            }
        }
        return;
    }
    int64_t half = h / 2, paired = half / G; /* int4: groups g (low nibbles) and g + H/2G (high) together */
    const __m256i low = _mm256_set1_epi32(15);
    for (int64_t g = 0; g < paired; g++) {
        int64_t gh = g + paired;
        for (int r = 0; r < R; r++) {
            const uint16_t *meta = (const uint16_t *)(rows[r] + half);
            float sl = half_to_float(meta[2 * g]), ml = half_to_float(meta[2 * g + 1]);
            float sh = half_to_float(meta[2 * gh]), mh = half_to_float(meta[2 * gh + 1]);
            for (int64_t t = 0; t < tokens; t++) {
                float at = a[r * a_stride + t];
                scaled[0][r][t] = at * sl, shifted[0][r][t] = at * ml, scaled[1][r][t] = at * sh, shifted[1][r][t] = at * mh;
            }
        }
        for (int64_t j = g * G; j < (g + 1) * G; j += 8) {
            __m256 ql[AXPY_ROWS], qh[AXPY_ROWS];
            for (int r = 0; r < R; r++) {
                __m256i b = (__m256i)load_u8(rows[r] + j);
                ql[r] = _mm256_cvtepi32_ps(_mm256_and_si256(b, low)), qh[r] = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
            }
            for (int64_t t = 0; t < tokens; t++) {
                float *o = c + t * h + j, *p = o + half;
                __m256 vl = init ? _mm256_setzero_ps() : _mm256_loadu_ps(o), vh = init ? vl : _mm256_loadu_ps(p);
                for (int r = 0; r < R; r++) {
                    __m256 cl = _mm256_fmadd_ps(ql[r], _mm256_broadcast_ss(&scaled[0][r][t]), _mm256_broadcast_ss(&shifted[0][r][t]));
                    __m256 ch = _mm256_fmadd_ps(qh[r], _mm256_broadcast_ss(&scaled[1][r][t]), _mm256_broadcast_ss(&shifted[1][r][t]));
                    vl = init && r == 0 ? cl : _mm256_add_ps(vl, cl), vh = init && r == 0 ? ch : _mm256_add_ps(vh, ch);
                }
                _mm256_storeu_ps(o, vl), _mm256_storeu_ps(p, vh);
            }
        }
    }
}
#endif

/* The down rows of R ≤ AXPY_ROWS consecutive neurons (rows[r], a_r = a + r·a_stride): init, the chunk's first. */
static void down_rows(const uint8_t *const *rows, int R, const Format *f, const float *a, int64_t a_stride,
                      int64_t tokens, float *c, int init, int vector) {
#if FMOE_AVX2
    if (vector && tokens <= 32 && (f->fmt == FMT_INT8 || f->fmt == FMT_INT4)) {
        if (tokens == 1 && R == AXPY_ROWS) { /* decode: constants, so the a·s broadcasts leave the inner loop */
            rows_axpy_q(rows, AXPY_ROWS, f, a, a_stride, 1, c, init);
            return;
        }
        switch (R) { /* a constant R for each inlined copy */
        case 4: rows_axpy_q(rows, 4, f, a, a_stride, tokens, c, init); return;
        case 3: rows_axpy_q(rows, 3, f, a, a_stride, tokens, c, init); return;
        case 2: rows_axpy_q(rows, 2, f, a, a_stride, tokens, c, init); return;
        default: rows_axpy_q(rows, 1, f, a, a_stride, tokens, c, init); return;
        }
    }
#endif
    for (int r = 0; r < R; r++) row_axpy(rows[r], f, a + r * a_stride, tokens, c, init && r == 0, vector);
}

static inline float silu(float g) { return g / (1.0f + expf(-g)); }

/* The gated activation of one (token, neuron): silu(g)·u; bf16 compute rounds each result to bf16 as torch's
   bf16 ops do. */
static inline float gated(float g, float u, int bf16) {
    if (!bf16) return silu(g) * u;
    g = round_bf16(g), u = round_bf16(u);
    return round_bf16(round_bf16(silu(g)) * u);
}

/* Floats of one thread's scratch for prefill_chunk: decoded gate and up rows, their dots, a, decoded down rows. */
static int64_t prefill_floats(int64_t tokens, int64_t hidden) {
    int64_t padded = (tokens + 15) / 16 * 16, h = (hidden + 15) / 16 * 16;
    return (2 * DOT_ROWS + DOWN_NEURONS) * h + (2 * DOT_ROWS + DOWN_NEURONS) * padded;
}

/* Whether the vector paths cover this shape (else the scalar paths run: same values, other roundings). */
static int vector_shape(const Format *f) {
    int64_t h = f->hidden, G = f->group;
    if (!FMOE_AVX2 || h % 32) return 0;
    switch (f->fmt) {
    case FMT_INT8: return G % 16 == 0 && h % G == 0;
    case FMT_INT4: return G % 16 == 0 && (h / 2) % G == 0;
    case FMT_INT2: return G % 8 == 0 && (h / 4) % G == 0;
    default: return 1;
    }
}

/* x [T, H] (float32, or bf16 when x_bf16) -> float32 in the layout row_dot reads (bf16 format: each 16
   de-interleaved), and the per-group sums X_g. */
static void prepare_x(const void *x, int x_bf16, int64_t tokens, const Format *f, int vector, float *xf, float *xg) {
    int64_t h = f->hidden;
    for (int64_t t = 0; t < tokens; t++) {
        float *out = xf + t * h;
        for (int64_t j = 0; j < h; j++)
            out[j] = x_bf16 ? bf16_to_float(((const uint16_t *)x)[t * h + j]) : ((const float *)x)[t * h + j];
        if (f->fmt == FMT_BF16 && vector) {
            float block[16];
            for (int64_t j = 0; j < h; j += 16) {
                for (int k = 0; k < 8; k++) {
                    block[k] = out[j + 2 * k];
                    block[8 + k] = out[j + 2 * k + 1];
                }
                memcpy(out + j, block, sizeof block);
            }
        }
        if (f->fmt >= FMT_INT8) {
            int64_t groups = h / f->group;
            for (int64_t g = 0; g < groups; g++) {
                float s = 0.0f;
                for (int64_t j = g * f->group; j < (g + 1) * f->group; j++) s += out[j];
                xg[t * groups + g] = s;
            }
        }
    }
}

/* The calling thread's workspace, kept between calls (no fresh pages per call; a host lane calling from
   another thread has its own). */
static float *workspace(int64_t floats) {
    static __thread float *buffer = NULL;
    static __thread int64_t size = 0;
    if (floats > size) {
        free(buffer);
        buffer = malloc(sizeof(float) * floats);
        size = buffer ? floats : 0;
    }
    return buffer;
}

/* The tokens as the dots read them: x in float32 (row_dot's layout), its group sums, and in the int8-activation
   mode (q8) its codes q̃, their magnitudes and the block scales d (then xg holds X̂_g). */
typedef struct {
    const float *xf, *xg, *xd;
    const int8_t *xq;
    const uint8_t *xa;
    int64_t tokens, groups;
    int vector, q8;
} Tokens;

/* Fill `x` from x_in [T, H] in the calling thread's workspace, with `extra` floats after it (64-byte aligned)
   for the caller; returns them, or NULL when memory runs out. */
static float *prepare_tokens(Tokens *x, const void *x_in, int x_bf16, int64_t tokens, const Format *f, int q8,
                             int64_t extra) {
    int64_t h = f->hidden, groups = h / f->group > 0 ? h / f->group : 1, blocks = h / QBLOCK;
    x->tokens = tokens, x->groups = groups, x->vector = vector_shape(f), x->q8 = q8 && q8_shape(f);
    int64_t q8_floats = x->q8 ? tokens * blocks + 2 * ((tokens * h + 3) / 4) : 0; /* d, then q̃ and |q̃| */
    float *xf = workspace(tokens * h + tokens * groups + q8_floats + extra + 16);
    if (!xf) return NULL;
    float *xg = xf + tokens * h, *xd = xg + tokens * groups;
    int8_t *xq = (int8_t *)(xd + (x->q8 ? tokens * blocks : 0));
    uint8_t *xa = (uint8_t *)(xq + 4 * ((tokens * h + 3) / 4));
    float *rest = xd + q8_floats;
    prepare_x(x_in, x_bf16, tokens, f, x->vector, xf, xg);
#if FMOE_AVX2
    if (x->q8)
        for (int64_t t = 0; t < tokens; t++)
            quantize_x(xf + t * h, f, xq + t * h, xa + t * h, xd + t * blocks, f->fmt == FMT_INT4 ? xg + t * groups : NULL);
#endif
    x->xf = xf, x->xg = xg, x->xd = xd, x->xq = xq, x->xa = xa;
    return rest + (16 - ((uintptr_t)rest / sizeof(float)) % 16) % 16;
}

#if FMOE_AVX2
#define ROWS_DOT_Q8(rows, R, f, x, t, out) \
    rows_dot_q8(rows, R, f, (x)->xq + (t) * (f)->hidden, (x)->xa + (t) * (f)->hidden, \
                (x)->xd + (t) * ((f)->hidden / QBLOCK), (x)->xg + (t) * (x)->groups, out)
#endif

/* x_t·ŵ for a neuron's gate and up rows (`row`, `row + proj_bytes`): the float32 dots, or the int8-activation
   ones (the two rows at once). */
static void gate_up_dots(const uint8_t *row, const Format *f, const Tokens *x, int64_t t, float *g, float *u) {
    int64_t h = f->hidden;
#if FMOE_AVX2
    if (x->q8) {
        const uint8_t *rows[2] = {row, row + f->proj_bytes};
        float out[2];
        ROWS_DOT_Q8(rows, 2, f, x, t, out);
        *g = out[0], *u = out[1];
        return;
    }
#endif
    *g = row_dot(row, f, x->xf + t * h, x->xg + t * x->groups, x->vector);
    *u = row_dot(row + f->proj_bytes, f, x->xf + t * h, x->xg + t * x->groups, x->vector);
}

/* ---- threads: a pool that never makes the caller wait for a thread the OS has not run ---------

   The caller publishes a job of `total` chunks and computes chunks itself; helper threads, woken,
   claim the chunks left. The caller waits only for chunks a helper has claimed and not finished, never
   for a helper to wake up: on a machine busy with other work a job costs at most what one thread
   alone would, plus one chunk. Helpers sleep on a condition variable between jobs (no spinning that
   would take the CPU from the caller). One job at a time: a second caller (a host lane's thread
   beside the main one) computes its chunks alone. */

typedef void (*ChunkFn)(void *job, int64_t chunk, int64_t worker);

/* A job is published in three steps, so that a helper still in claim_chunks for the job before (it loaded the
   exhausted ticket and was descheduled) cannot claim a chunk of the next one: (1) the ticket is closed (a value
   no generation's claim matches), (2) the job's fields are written, (3) the ticket opens at the new generation.
   A helper reads a job's fields only between loading a ticket of its generation with a chunk left and the CAS that
   claims that chunk, or after the CAS: had the fields changed in between, the ticket would have changed too and
   the CAS fails. (Until 27 Nov the fields were written while the finished job's exhausted ticket was still up: a
   stale helper could read the next job's larger total, claim chunk `total` of the old generation, run it with the
   next job's fn — or the next fn with the previous job pointer — and count it into the next job's `done`, so the
   caller could return before a chunk was finished. Seen once as a SIGFPE; tests/test_kernels.py's pool stress test
   fails on that code with FMOE_POOL_STALL_NS.) */
#define TICKET_CLOSED UINT64_MAX

static struct {
    pthread_mutex_t busy, lock;
    pthread_cond_t wake;
    _Atomic uint64_t ticket; /* generation << 32 | next chunk; TICKET_CLOSED while a job is being written */
    _Atomic int64_t done;    /* chunks finished in this generation */
    _Atomic int64_t total, limit; /* chunks; helpers with an id below limit take part (relaxed: the ticket orders) */
    ChunkFn fn;
    void *job;
    uint32_t generation; /* under lock */
    int64_t helpers;     /* threads started (they live as long as the process) */
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER};

/* FMOE_POOL_STALL_NS (tests only): a helper sleeps this long between loading the ticket and claiming, and the caller
   between writing a job and opening it, widening the windows the protocol above must survive. */
static long stall_ns = -1;

static void stall(void) {
    if (stall_ns > 0) {
        struct timespec t = {0, stall_ns};
        nanosleep(&t, NULL);
    }
}

/* Chunks run since the library was loaded: each job's chunks run exactly once (tests/test_kernels.py). */
static _Atomic int64_t chunks_run;
int64_t fmoe_pool_chunks_run(void) { return atomic_load(&chunks_run); }

static void claim_chunks(uint32_t generation, int64_t worker) {
    for (;;) {
        uint64_t ticket = atomic_load(&pool.ticket);
        stall();
        if (ticket == TICKET_CLOSED || (uint32_t)(ticket >> 32) != generation) return;
        if ((int64_t)(ticket & 0xffffffffu) >= atomic_load_explicit(&pool.total, memory_order_relaxed)) return;
        /* the caller's scratch has no room for this worker (limit is the job's) */
        if (worker >= atomic_load_explicit(&pool.limit, memory_order_relaxed)) return;
        if (!atomic_compare_exchange_weak(&pool.ticket, &ticket, ticket + 1)) continue;
        pool.fn(pool.job, (int64_t)(ticket & 0xffffffffu), worker); /* the job stays until every chunk is done */
        atomic_fetch_add_explicit(&chunks_run, 1, memory_order_relaxed);
        atomic_fetch_add(&pool.done, 1);
    }
}

static void *helper_main(void *arg) {
    int64_t worker = (int64_t)(intptr_t)arg;
    uint32_t seen = 0;
    for (;;) {
        pthread_mutex_lock(&pool.lock);
        while (pool.generation == seen) pthread_cond_wait(&pool.wake, &pool.lock);
        seen = pool.generation;
        pthread_mutex_unlock(&pool.lock);
        claim_chunks(seen, worker);
    }
    return NULL;
}

/* Run fn(job, k, worker) for k in [0, total) on up to `threads` threads; worker < `threads` always. */
static void parallel_chunks(int64_t total, ChunkFn fn, void *job, int64_t threads) {
    if (threads <= 1 || total <= 1 || total > 0xffffffffLL || pthread_mutex_trylock(&pool.busy) != 0) {
        for (int64_t k = 0; k < total; k++) fn(job, k, 0);
        atomic_fetch_add_explicit(&chunks_run, total, memory_order_relaxed);
        return;
    }
    if (stall_ns < 0) {
        const char *env = getenv("FMOE_POOL_STALL_NS");
        stall_ns = env ? atol(env) : 0;
    }
    while (pool.helpers < threads - 1) {
        pthread_t thread;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int failed = pthread_create(&thread, &attr, helper_main, (void *)(intptr_t)(pool.helpers + 1));
        pthread_attr_destroy(&attr);
        if (failed) break;
        pool.helpers++;
    }
    atomic_store(&pool.ticket, TICKET_CLOSED); /* (1) */
    pool.fn = fn, pool.job = job; /* (2) */
    atomic_store_explicit(&pool.total, total, memory_order_relaxed);
    atomic_store_explicit(&pool.limit, threads, memory_order_relaxed);
    atomic_store(&pool.done, 0);
    stall();
    pthread_mutex_lock(&pool.lock);
    uint32_t generation = ++pool.generation;
    if (generation == UINT32_MAX) generation = pool.generation = 1; /* never the closed ticket's generation */
    atomic_store(&pool.ticket, (uint64_t)generation << 32); /* (3) */
    pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.lock);
    claim_chunks(generation, 0);
    while (atomic_load(&pool.done) < total) sched_yield(); /* chunks a helper holds */
    pthread_mutex_unlock(&pool.busy);
}

/* ---- the pass ------------------------------------------------------------------------------ */

/* Chunk partials held at once: at most this many floats (bounds the workspace of a long prefill). */
#define PARTIAL_FLOATS (4 << 20)

typedef struct {
    const Format *f;
    const uint8_t *segment;
    int64_t neurons, chunk, first, stride, row_bytes;
    int x_bf16;
    const Tokens *x;
    float *part, *scratch;
} Pass;

/* ---- decode: one token (T = 1), the hot path ----------------------------------------------

   A chunk's neurons go AXPY_ROWS at a time: their gate and up rows dotted with x together (one pass
   over x for both rows of a neuron), then their down rows added onto the chunk's partial sum c in one
   pass over c (c loaded and stored once per AXPY_ROWS rows). Each row's sums are its own, in a fixed
   order, whatever the split, the thread or the token count of other calls: a chunk's bits depend on
   its rows and x alone. ŵ never exists: codes are widened and converted in registers, each group's
   scale (and offset) applied once per group: x·ŵ = Σ_g s_g·Σ_{j∈g} q_j x_j + m_g·X_g. */
#if FMOE_AVX2
/* Metadata of one row as float32: n float16 values (n ≤ META_FLOATS, a multiple of 8; one_shape checks). */
#define META_FLOATS 256
static inline void meta_floats(const uint8_t *meta, int64_t n, float *out) {
    for (int64_t i = 0; i < n; i += 8) _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(meta + 2 * i))));
}

/* The decode paths' prefetch cursor (int8, int4 and bf16 rows; f32 needs none: the hardware prefetcher keeps up
   with its one stream a row, and on the AMD EPYC the cursor made f32 rows 5–24 % slower while it made bf16 rows
   7–12 % faster: docs/bench.md § CPU expert kernels, "bf16 rows"). The dot loops step it by the bytes each group reads, and it prefetches the lines up to
   PREFETCH_AHEAD bytes past them into L1: a few lines a group, spread over the work. It replaced a burst of the next
   four neurons' rows (216 int4 lines) before each four: on the AMD EPYC (Zen 3, 32 KB L1, AVX2) one a3b int4 expert
   from RAM on one thread took 0.65x the time with the cursor at 8 KB, 0.75x at 4 KB (docs/bench.md § CPU expert
   kernels, 27 Nov). Prefetches change no values. */
typedef struct { const char *next, *due, *end; } Cursor;

/* A cursor over [start, end) (rows read in order from start), or NULL: no prefetching. */
static inline Cursor *cursor_at(Cursor *c, const Format *f, const uint8_t *start, const uint8_t *end) {
    if (!PREFETCH_AHEAD || f->fmt == FMT_F32 || f->fmt > FMT_INT4) return NULL;
    c->next = (const char *)((uintptr_t)start & ~(uintptr_t)63), c->due = (const char *)start + PREFETCH_AHEAD;
    c->end = (const char *)end;
    return c;
}

/* `bytes` more read: prefetch up to PREFETCH_AHEAD past them. */
static inline __attribute__((always_inline)) void cursor_step(Cursor *pf, int64_t bytes) {
    if (!pf) return;
    pf->due += bytes;
    const char *stop = pf->due < pf->end ? pf->due : pf->end;
    for (; pf->next < stop; pf->next += 64) _mm_prefetch(pf->next, PREFETCH_HINT);
}

/* The code bytes of one projection row (what the dot loops step); the rest of proj_bytes is its metadata. */
static inline int64_t code_bytes(const Format *f) {
    return f->fmt == FMT_F32 ? 4 * f->hidden : f->fmt == FMT_BF16 ? 2 * f->hidden : f->fmt == FMT_INT4 ? f->hidden / 2 : f->hidden;
}

/* VL codes -> VL floats (int8: signed bytes; int4: bytes as int32, then the low or the high nibble). */
#if VL == 16
#define vq8(p) _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p))))
typedef __m512i veci;
#define vu8(p) _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p)))
/* the low nibble as a float in one step: vpermps reads the low 4 bits of each lane as the index into 0, 1, …, 15
   (the and + convert it replaces: the same floats, one uop less a vector) */
#define vnibble_low(b) _mm512_permutexvar_ps(b, _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0))
#define vnibble_high(b) _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4))
#define vadd _mm512_add_ps
#define vbroadcast(p) _mm512_set1_ps(*(p))
#else
#define vq8(p) _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p))))
typedef __m256i veci;
#define vu8(p) ((__m256i)load_u8(p))
#define vnibble_low(b) _mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(15)))
#define vnibble_high(b) _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4))
#define vadd _mm256_add_ps
#define vbroadcast(p) _mm256_broadcast_ss(p)
#endif

/* int8 gate and up (G weights a group, a constant where inlined): Σ_g s_g·Σ_{j∈g} q_j x_j per row. */
static inline __attribute__((always_inline)) void gate_up_int8(const uint8_t *row, const uint8_t *up, int64_t h,
                                                                int64_t G, const float *x, float *g, float *u, Cursor *pf) {
    float sg[META_FLOATS], su[META_FLOATS];
    meta_floats(row + h, h / G, sg), meta_floats(up + h, h / G, su);
    vec tg = vzero(), tu = tg;
    for (int64_t g0 = 0; g0 < h; g0 += G) {
        cursor_step(pf, 2 * G);
        vec ga = vzero(), gb = ga, ua = ga, ub = ga;
        for (int64_t j = g0; j < g0 + G; j += 2 * VL) {
            vec xa = vload(x + j), xb = vload(x + j + VL);
            ga = vfma(vq8(row + j), xa, ga), gb = vfma(vq8(row + j + VL), xb, gb);
            ua = vfma(vq8(up + j), xa, ua), ub = vfma(vq8(up + j + VL), xb, ub);
        }
        tg = vfma(vbroadcast(sg + g0 / G), vadd(ga, gb), tg);
        tu = vfma(vbroadcast(su + g0 / G), vadd(ua, ub), tu);
    }
    *g = vsum(tg), *u = vsum(tu);
}

/* int4 gate and up: byte j holds code j (low nibble) and code j + H/2 (high), groups g and g + H/2G together;
   Σ_g s_g·Σ_{j∈g} q_j x_j + Σ_g m_g·X_g per row. */
static inline __attribute__((always_inline)) void gate_up_int4(const uint8_t *row, const uint8_t *up, int64_t h,
                                                                int64_t G, const float *x, const float *xg, float *g,
                                                                float *u, Cursor *pf) {
    int64_t half = h / 2, paired = half / G;
    float mg[META_FLOATS], mu[META_FLOATS]; /* (s, m) per group */
    meta_floats(row + half, 2 * (h / G), mg), meta_floats(up + half, 2 * (h / G), mu);
    vec tg = vzero(), tu = tg;
    float og = 0.0f, ou = 0.0f;
    for (int64_t g = 0; g < paired; g++) {
        int64_t gh = g + paired, j0 = g * G;
        cursor_step(pf, 2 * G);
        vec gl = vzero(), gh_ = gl, ul = gl, uh = gl;
        for (int64_t j = j0; j < j0 + G; j += VL) {
            vec xl = vload(x + j), xh = vload(x + half + j);
            veci bg = vu8(row + j), bu = vu8(up + j);
            gl = vfma(vnibble_low(bg), xl, gl), gh_ = vfma(vnibble_high(bg), xh, gh_);
            ul = vfma(vnibble_low(bu), xl, ul), uh = vfma(vnibble_high(bu), xh, uh);
        }
        tg = vfma(vbroadcast(mg + 2 * g), gl, tg), tg = vfma(vbroadcast(mg + 2 * gh), gh_, tg);
        tu = vfma(vbroadcast(mu + 2 * g), ul, tu), tu = vfma(vbroadcast(mu + 2 * gh), uh, tu);
        og = fmaf(mg[2 * g + 1], xg[g], og), og = fmaf(mg[2 * gh + 1], xg[gh], og);
        ou = fmaf(mu[2 * g + 1], xg[g], ou), ou = fmaf(mu[2 * gh + 1], xg[gh], ou);
    }
    *g = vsum(tg) + og, *u = vsum(tu) + ou;
}

/* int8 down rows of AXPY_ROWS neurons onto c. */
static inline __attribute__((always_inline)) void down_int8(const uint8_t *const *rows, int64_t h, int64_t G,
                                                             const float *a, float *restrict c, int init, Cursor *pf) {
    float s[AXPY_ROWS][META_FLOATS];
    for (int r = 0; r < AXPY_ROWS; r++) meta_floats(rows[r] + h, h / G, s[r]);
    for (int64_t g = 0; g < h / G; g++) {
        cursor_step(pf, AXPY_ROWS * G);
        vec s0 = vset1(a[0] * s[0][g]), s1 = vset1(a[1] * s[1][g]), s2 = vset1(a[2] * s[2][g]), s3 = vset1(a[3] * s[3][g]);
        for (int64_t j = g * G; j < (g + 1) * G; j += VL) {
            vec v = init ? vmul(vq8(rows[0] + j), s0) : vfma(vq8(rows[0] + j), s0, vload(c + j));
            v = vfma(vq8(rows[1] + j), s1, v);
            v = vfma(vq8(rows[2] + j), s2, v);
            vstore(c + j, vfma(vq8(rows[3] + j), s3, v));
        }
    }
}

/* int4 down rows of AXPY_ROWS neurons onto c: groups g (low nibbles, c[j]) and g + H/2G (high, c[j + H/2])
   together; the rows' offsets first (Σ_r a_r·m_r of the group, once per element), then a_r·s_r·q per row. */
static inline __attribute__((always_inline)) void down_int4(const uint8_t *const *rows, int64_t h, int64_t G,
                                                             const float *a, float *restrict c, int init, Cursor *pf) {
    int64_t half = h / 2, paired = half / G;
    float m[AXPY_ROWS][META_FLOATS];
    for (int r = 0; r < AXPY_ROWS; r++) meta_floats(rows[r] + half, 2 * (h / G), m[r]);
    for (int64_t g = 0; g < paired; g++) {
        int64_t gh = g + paired;
        cursor_step(pf, AXPY_ROWS * G);
        vec sl[AXPY_ROWS], sh[AXPY_ROWS];
        float ml = 0.0f, mh = 0.0f;
        for (int r = 0; r < AXPY_ROWS; r++) {
            sl[r] = vset1(a[r] * m[r][2 * g]), sh[r] = vset1(a[r] * m[r][2 * gh]);
            ml = fmaf(a[r], m[r][2 * g + 1], ml), mh = fmaf(a[r], m[r][2 * gh + 1], mh);
        }
        vec bl = vset1(ml), bh = vset1(mh);
        for (int64_t j = g * G; j < (g + 1) * G; j += VL) {
            vec vl = init ? bl : vadd(vload(c + j), bl);
            vec vh = init ? bh : vadd(vload(c + half + j), bh);
            for (int r = 0; r < AXPY_ROWS; r++) {
                veci b = vu8(rows[r] + j);
                vl = vfma(vnibble_low(b), sl[r], vl), vh = vfma(vnibble_high(b), sh[r], vh);
            }
            vstore(c + j, vl), vstore(c + half + j, vh);
        }
    }
}

/* g = x·ŵ_gate, u = x·ŵ_up of one neuron (row: its gate row, then its up row), float32 x. */
static void gate_up_one(const uint8_t *row, const Format *f, const float *x, const float *xg, float *g, float *u, Cursor *pf) {
    int64_t h = f->hidden, G = f->group;
    const uint8_t *up = row + f->proj_bytes;
    switch (f->fmt) {
    case FMT_F32: {
        const float *wg = (const float *)row, *wu = (const float *)up;
        vec g0 = vzero(), g1 = g0, g2 = g0, g3 = g0, u0 = g0, u1 = g0, u2 = g0, u3 = g0;
        for (int64_t j = 0; j < h; j += 4 * VL) {
            vec x0 = vload(x + j), x1 = vload(x + j + VL), x2 = vload(x + j + 2 * VL), x3 = vload(x + j + 3 * VL);
            g0 = vfma(vload(wg + j), x0, g0), u0 = vfma(vload(wu + j), x0, u0);
            g1 = vfma(vload(wg + j + VL), x1, g1), u1 = vfma(vload(wu + j + VL), x1, u1);
            g2 = vfma(vload(wg + j + 2 * VL), x2, g2), u2 = vfma(vload(wu + j + 2 * VL), x2, u2);
            g3 = vfma(vload(wg + j + 3 * VL), x3, g3), u3 = vfma(vload(wu + j + 3 * VL), x3, u3);
        }
        *g = vsum(vadd(vadd(g0, g1), vadd(g2, g3))), *u = vsum(vadd(vadd(u0, u1), vadd(u2, u3)));
        return;
    }
    case FMT_BF16: { /* x de-interleaved per 16 (prepare_x): even weights' x, then odd weights' */
        const __m256i high = _mm256_set1_epi32((int)0xffff0000);
        __m256 g0 = _mm256_setzero_ps(), g1 = g0, u0 = g0, u1 = g0;
        for (int64_t j = 0; j < h; j += 16) {
            cursor_step(pf, 2 * 16 * 2); /* 16 bf16 weights of the gate row and of the up row */
            __m256 xe = _mm256_loadu_ps(x + j), xo = _mm256_loadu_ps(x + j + 8);
            __m256i vg = _mm256_loadu_si256((const __m256i *)(row + 2 * j)), vu = _mm256_loadu_si256((const __m256i *)(up + 2 * j));
            g0 = _mm256_fmadd_ps((__m256)_mm256_slli_epi32(vg, 16), xe, g0);
            g1 = _mm256_fmadd_ps((__m256)_mm256_and_si256(vg, high), xo, g1);
            u0 = _mm256_fmadd_ps((__m256)_mm256_slli_epi32(vu, 16), xe, u0);
            u1 = _mm256_fmadd_ps((__m256)_mm256_and_si256(vu, high), xo, u1);
        }
        *g = hsum8(_mm256_add_ps(g0, g1)), *u = hsum8(_mm256_add_ps(u0, u1));
        return;
    }
    case FMT_INT8: /* a3b's G = 128: a constant, the group loop unrolled */
        if (G == 128) gate_up_int8(row, up, h, 128, x, g, u, pf);
        else gate_up_int8(row, up, h, G, x, g, u, pf);
        return;
    default: /* FMT_INT4 */
        if (G == 64) gate_up_int4(row, up, h, 64, x, xg, g, u, pf);
        else gate_up_int4(row, up, h, G, x, xg, g, u, pf);
        return;
    }
}

/* c (+)= Σ_r a_r·ŵ_down,r for R = AXPY_ROWS consecutive neurons' down rows (init: c is written, the chunk's
   first rows). Per element: the first row's product (or fma onto c), then one fma per row, in order. int4's
   offsets m_r,g enter once per group and element: c_j += Σ_r a_r·m_r,g(j) (a sum over the R rows, in order)
   before the rows' a_r·s_r,g·q_r,j. */
static void down_one(const uint8_t *const *rows, const Format *f, const float *a, float *restrict c, int init, Cursor *pf) {
    int64_t h = f->hidden, G = f->group;
    switch (f->fmt) {
    case FMT_F32: {
        const float *w0 = (const float *)rows[0], *w1 = (const float *)rows[1], *w2 = (const float *)rows[2], *w3 = (const float *)rows[3];
        vec a0 = vset1(a[0]), a1 = vset1(a[1]), a2 = vset1(a[2]), a3 = vset1(a[3]);
        for (int64_t j = 0; j < h; j += VL) {
            vec v = init ? vmul(a0, vload(w0 + j)) : vfma(a0, vload(w0 + j), vload(c + j));
            v = vfma(a1, vload(w1 + j), v);
            v = vfma(a2, vload(w2 + j), v);
            vstore(c + j, vfma(a3, vload(w3 + j), v));
        }
        return;
    }
    case FMT_BF16: {
        __m256 a0 = _mm256_set1_ps(a[0]), a1 = _mm256_set1_ps(a[1]), a2 = _mm256_set1_ps(a[2]), a3 = _mm256_set1_ps(a[3]);
#define BF16_8(r, j) ((__m256)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(rows[r] + 2 * (j)))), 16))
        for (int64_t j = 0; j < h; j += 8) {
            cursor_step(pf, AXPY_ROWS * 8 * 2); /* 8 bf16 weights of each of the four down rows */
            __m256 v = init ? _mm256_mul_ps(a0, BF16_8(0, j)) : _mm256_fmadd_ps(a0, BF16_8(0, j), _mm256_loadu_ps(c + j));
            v = _mm256_fmadd_ps(a1, BF16_8(1, j), v);
            v = _mm256_fmadd_ps(a2, BF16_8(2, j), v);
            _mm256_storeu_ps(c + j, _mm256_fmadd_ps(a3, BF16_8(3, j), v));
        }
#undef BF16_8
        return;
    }
    case FMT_INT8:
        if (G == 128) down_int8(rows, h, 128, a, c, init, pf);
        else down_int8(rows, h, G, a, c, init, pf);
        return;
    default: /* FMT_INT4 */
        if (G == 64) down_int4(rows, h, 64, a, c, init, pf);
        else down_int4(rows, h, G, a, c, init, pf);
        return;
    }
}
#endif

/* Whether the decode path (T = 1) serves this format (else pass_chunk's general one). */
static int one_shape(const Format *f, const Tokens *x) {
#if FMOE_AVX2
    if (!x->vector || x->tokens != 1) return 0;
    int64_t h = f->hidden, G = f->group;
    switch (f->fmt) {
    case FMT_F32: return h % (4 * VL) == 0;
    case FMT_BF16: return h % 16 == 0;
    case FMT_INT8: return G % (2 * VL) == 0 && h % G == 0 && (h / G) % 8 == 0 && h / G <= META_FLOATS;
    case FMT_INT4: return G % VL == 0 && (h / 2) % G == 0 && (2 * h / G) % 8 == 0 && 2 * h / G <= META_FLOATS;
    default: return 0;
    }
#else
    (void)f, (void)x;
    return 0;
#endif
}

/* Chunk first + k for one token: its partial sum c = Σ over its neurons, in order, of a·ŵ_down (from zero). */
static void pass_chunk_one(const Pass *p, int64_t k) {
#if FMOE_AVX2
    const Format *f = p->f;
    const Tokens *x = p->x;
    float *c = p->part + k * f->hidden;
    int64_t i0 = (p->first + k) * p->chunk, i1 = i0 + p->chunk > p->neurons ? p->neurons : i0 + p->chunk;
    const uint8_t *down[AXPY_ROWS];
    float a[AXPY_ROWS];
    int64_t i = i0;
    Cursor cursor, *pf = cursor_at(&cursor, f, p->segment + i0 * p->row_bytes, p->segment + p->neurons * p->row_bytes);
    int64_t meta = p->row_bytes - 3 * code_bytes(f); /* a neuron's bytes the dot loops do not step */
    for (; i + AXPY_ROWS <= i1; i += AXPY_ROWS) {
        for (int r = 0; r < AXPY_ROWS; r++) {
            const uint8_t *row = p->segment + (i + r) * p->row_bytes;
            float g, u;
            if (x->q8)
                cursor_step(pf, 2 * code_bytes(f)), gate_up_dots(row, f, x, 0, &g, &u);
            else
                gate_up_one(row, f, x->xf, x->xg, &g, &u, pf);
            if (p->x_bf16) { /* torch's bf16 ops: each result rounded to bf16 */
                g = round_bf16(g), u = round_bf16(u);
                a[r] = round_bf16(round_bf16(silu(g)) * u);
            } else {
                a[r] = silu(g) * u;
            }
            down[r] = row + 2 * f->proj_bytes;
            cursor_step(pf, meta);
        }
        if (FMOE_PHASES & 2) down_one(down, f, a, c, i == i0, pf);
    }
    for (; i < i1; i++) { /* a chunk's last neurons, fewer than AXPY_ROWS: one at a time */
        const uint8_t *row = p->segment + i * p->row_bytes;
        float g, u, one;
        if (x->q8)
            gate_up_dots(row, f, x, 0, &g, &u);
        else
            gate_up_one(row, f, x->xf, x->xg, &g, &u, NULL);
        if (p->x_bf16) {
            g = round_bf16(g), u = round_bf16(u);
            one = round_bf16(round_bf16(silu(g)) * u);
        } else {
            one = silu(g) * u;
        }
        if (FMOE_PHASES & 2) row_axpy(row + 2 * f->proj_bytes, f, &one, 1, c, i == i0, 1);
    }
#else
    (void)p, (void)k;
#endif
}

#if FMOE_AVX2
/* ---- several tokens, int8 and int4: ŵ in registers (no float block) -------------------------------------

   prefill_chunk decodes a few rows into a float block and multiplies it in register tiles; at an expert's few
   tokens (a3b's prefill: ~4 of 64 each) that block costs more than the products: each weight is written as a float
   and read back from L2 (4 + 4·⌈T/3⌉ bytes a weight at 0.5 byte of codes). Here (int8 and int4, float32 tokens) the
   codes are widened and converted in registers inside the tiles, with the very operations decode_row and the
   tiles run, in the same order per output:
     ŵ_j = fma(q_j, s_g, m_g) (int4) or q_j·s_g (int8), rounded once, as decode_row computes it;
     dots: per (row, token) one VL-lane accumulator along H in j order, then its horizontal sum (dots_tile's);
     down: per (token, column) the block's first neuron a product (or an fma onto c), then one fma per neuron in
       order (down_tile's).
   So every output has the bits of the float-block path (tests/test_kernels.py compares them at several T), a token's
   outputs do not depend on the tile it falls in, and a chunk's bits on its rows and tokens alone. Tiles: gate and
   up rows of one neuron × FUSED_TOKENS tokens (dots); DOWN_TOKENS tokens × 2·VL columns of one group (down). */
#define FUSED_TOKENS 4
#define FUSED_AHEAD 2 /* neurons ahead whose rows are prefetched */
/* down tiles' tokens: with AVX2's 16 registers, 5 × 2 accumulators leave room for ŵ, s, m and a (6 spilled one) */
#if VL == 16
#define FUSED_DOWN_TOKENS 8
#else
#define FUSED_DOWN_TOKENS 5
#endif

/* Whether dots_q8's tiles (int8 activations: AVX-512 VNNI's, else dots_q8_narrow's) serve these rows and tokens: whole
   blocks of 32 inputs a group, fused_meta's metadata. */
static int q8_tile_shape(const Format *f, const Tokens *x) {
    int64_t h = f->hidden, G = f->group;
    if (!prefill_tiles || !x->vector || !x->q8 || G % QBLOCK) return 0;
    if (f->fmt == FMT_INT8) return h % G == 0 && (h / G) % 8 == 0 && h / G <= META_FLOATS;
    return f->fmt == FMT_INT4 && (h / 2) % G == 0 && (2 * h / G) % 8 == 0 && 2 * h / G <= META_FLOATS;
}

/* Whether the fused paths serve this shape (else prefill_chunk's float block). int8 activations: the gate and up dots
   in dots_q8's tiles where q8_tile_shape, else rows_dot_q8 token by token (prefill_chunk's). */
static int fused_shape(const Format *f, const Tokens *x) {
    int64_t h = f->hidden, G = f->group;
    if (!x->vector) return 0;
    if (f->fmt == FMT_BF16) return VL == 8 && h % 16 == 0; /* decode_row's AVX2 layout (x de-interleaved per 16) */
    if (G % (2 * VL)) return 0;
    if (f->fmt == FMT_INT8) return h % G == 0 && (h / G) % 8 == 0 && h / G <= META_FLOATS;
    if (f->fmt == FMT_INT4) return (h / 2) % G == 0 && (2 * h / G) % 8 == 0 && 2 * h / G <= META_FLOATS;
    return 0;
}

/* The float32 metadata of one row: int8 s_g, int4 (s_g, m_g) pairs (META_FLOATS at most). */
static inline void fused_meta(const uint8_t *row, const Format *f, float *out) {
    int64_t h = f->hidden, G = f->group;
    if (f->fmt == FMT_BF16) return; /* none */
    if (f->fmt == FMT_INT8) meta_floats(row + h, h / G, out);
    else meta_floats(row + h / 2, 2 * (h / G), out);
}

/* o0[t·ts], o1[t·ts] = ŵ_0·x_t, ŵ_1·x_t for TT tokens (x, h apart) and two rows r0, r1 (meta: their fused_meta). */
static inline __attribute__((always_inline)) void dots_fused(const uint8_t *r0, const uint8_t *r1, int fmt, int64_t h,
                                                              int64_t G, const float *m0, const float *m1,
                                                              const float *x, int TT, float *o0, float *o1, int64_t ts) {
    vec acc0[FUSED_TOKENS], acc1[FUSED_TOKENS];
    for (int t = 0; t < TT; t++) acc0[t] = vzero(), acc1[t] = vzero();
#if VL == 8
    if (fmt == FMT_BF16) { /* decode_row's order: per 16, the even weights (x's first 8), then the odd ones */
        const __m256i high = _mm256_set1_epi32((int)0xffff0000);
        for (int64_t j = 0; j < h; j += 16) {
            __m256i v0 = _mm256_loadu_si256((const __m256i *)(r0 + 2 * j)), v1 = _mm256_loadu_si256((const __m256i *)(r1 + 2 * j));
            vec e0 = (__m256)_mm256_slli_epi32(v0, 16), e1 = (__m256)_mm256_slli_epi32(v1, 16);
            for (int t = 0; t < TT; t++) {
                vec xv = vload(x + t * h + j);
                acc0[t] = vfma(e0, xv, acc0[t]), acc1[t] = vfma(e1, xv, acc1[t]);
            }
            vec d0 = (__m256)_mm256_and_si256(v0, high), d1 = (__m256)_mm256_and_si256(v1, high);
            for (int t = 0; t < TT; t++) {
                vec xv = vload(x + t * h + j + 8);
                acc0[t] = vfma(d0, xv, acc0[t]), acc1[t] = vfma(d1, xv, acc1[t]);
            }
        }
    } else
#endif
    if (fmt == FMT_INT8) {
        for (int64_t g = 0; g < h / G; g++) {
            vec s0 = vset1(m0[g]), s1 = vset1(m1[g]);
            for (int64_t j = g * G; j < (g + 1) * G; j += VL) {
                vec w0 = vmul(vq8(r0 + j), s0), w1 = vmul(vq8(r1 + j), s1);
                for (int t = 0; t < TT; t++) {
                    vec xv = vload(x + t * h + j);
                    acc0[t] = vfma(w0, xv, acc0[t]), acc1[t] = vfma(w1, xv, acc1[t]);
                }
            }
        }
    } else { /* int4: the low half's columns (low nibbles), then the high half's (high nibbles of the same bytes) */
        int64_t half = h / 2;
        for (int64_t g = 0; g < half / G; g++) {
            vec s0 = vset1(m0[2 * g]), z0 = vset1(m0[2 * g + 1]), s1 = vset1(m1[2 * g]), z1 = vset1(m1[2 * g + 1]);
            for (int64_t j = g * G; j < (g + 1) * G; j += VL) {
                vec w0 = vfma(vnibble_low(vu8(r0 + j)), s0, z0), w1 = vfma(vnibble_low(vu8(r1 + j)), s1, z1);
                for (int t = 0; t < TT; t++) {
                    vec xv = vload(x + t * h + j);
                    acc0[t] = vfma(w0, xv, acc0[t]), acc1[t] = vfma(w1, xv, acc1[t]);
                }
            }
        }
        for (int64_t g = half / G; g < h / G; g++) {
            vec s0 = vset1(m0[2 * g]), z0 = vset1(m0[2 * g + 1]), s1 = vset1(m1[2 * g]), z1 = vset1(m1[2 * g + 1]);
            for (int64_t j = g * G; j < (g + 1) * G; j += VL) {
                vec w0 = vfma(vnibble_high(vu8(r0 + j - half)), s0, z0), w1 = vfma(vnibble_high(vu8(r1 + j - half)), s1, z1);
                for (int t = 0; t < TT; t++) {
                    vec xv = vload(x + t * h + j);
                    acc0[t] = vfma(w0, xv, acc0[t]), acc1[t] = vfma(w1, xv, acc1[t]);
                }
            }
        }
    }
    for (int t = 0; t < TT; t++) o0[t * ts] = vsum(acc0[t]), o1[t * ts] = vsum(acc1[t]);
}

/* CASES(fmt) with fmt a constant for each of the fused formats (int8, bf16, int4): each inlined copy its own. */
#define BY_FUSED_FORMAT(fmt, CASES) \
    if ((fmt) == FMT_INT8) { CASES(FMT_INT8) } else if ((fmt) == FMT_BF16) { CASES(FMT_BF16) } else { CASES(FMT_INT4) }
#define DOTS_FUSED(fmt, TT) dots_fused(r0, r1, fmt, h, G, m0, m1, x + t * h, TT, o0 + t * ts, o1 + t * ts, ts)
#define DOTS_FUSED_CASES(fmt) switch (TT) { \
    case 4: DOTS_FUSED(fmt, 4); break; case 3: DOTS_FUSED(fmt, 3); break; \
    case 2: DOTS_FUSED(fmt, 2); break; default: DOTS_FUSED(fmt, 1); break; }
/* o0[t·ts], o1[t·ts] for every token x [T, H]: tiles of FUSED_TOKENS tokens (a constant shape for each inlined copy). */
static void dots_fused_rows(const uint8_t *r0, const uint8_t *r1, const Format *f, const float *m0, const float *m1,
                            const float *x, int64_t tokens, float *o0, float *o1, int64_t ts) {
    int64_t h = f->hidden, G = f->group;
    for (int64_t t = 0; t < tokens; t += FUSED_TOKENS) {
        int TT = tokens - t < FUSED_TOKENS ? (int)(tokens - t) : FUSED_TOKENS;
        BY_FUSED_FORMAT(f->fmt, DOTS_FUSED_CASES)
    }
}

/* VL bf16 weights -> floats, in order (decode_down's; fused_shape takes bf16 rows only where VL is 8). */
static inline vec bf16_vec(const uint16_t *b) {
#if VL == 8
    return (vec)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)b)), 16);
#else
    return (vec)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)b)), 16);
#endif
}

/* c[t, j:j+2VL] for TT tokens, columns j.. of one group: down_tile's sums with ŵ decoded in registers from the N
   rows (meta: their fused_meta, ms floats apart). */
static inline __attribute__((always_inline)) void down_fused_tile(const uint8_t *const *rows, int64_t N, int fmt,
                                                                   const float *meta, int64_t ms, int64_t j, int64_t h,
                                                                   int64_t G, const float *a, int64_t as, int TT,
                                                                   float *c, int init) {
    vec acc[FUSED_DOWN_TOKENS][2], w0, w1;
    int64_t g = j / G, half = h / 2;
#define DOWN_FUSED_ROW(n) do { \
        const float *m = meta + (n) * ms; \
        if (fmt == FMT_BF16) { /* natural order (decode_down's) */ \
            w0 = bf16_vec((const uint16_t *)rows[n] + j), w1 = bf16_vec((const uint16_t *)rows[n] + j + VL); \
        } else if (fmt == FMT_INT8) { \
            vec s = vset1(m[g]); \
            w0 = vmul(vq8(rows[n] + j), s), w1 = vmul(vq8(rows[n] + j + VL), s); \
        } else if (j < half) { \
            vec s = vset1(m[2 * g]), z = vset1(m[2 * g + 1]); \
            w0 = vfma(vnibble_low(vu8(rows[n] + j)), s, z), w1 = vfma(vnibble_low(vu8(rows[n] + j + VL)), s, z); \
        } else { \
            vec s = vset1(m[2 * g]), z = vset1(m[2 * g + 1]); \
            w0 = vfma(vnibble_high(vu8(rows[n] + j - half)), s, z); \
            w1 = vfma(vnibble_high(vu8(rows[n] + j - half + VL)), s, z); \
        } \
    } while (0)
    DOWN_FUSED_ROW(0);
    for (int t = 0; t < TT; t++) {
        vec at = vset1(a[t]);
        if (init) {
            acc[t][0] = vmul(at, w0), acc[t][1] = vmul(at, w1);
        } else {
            acc[t][0] = vfma(at, w0, vload(c + t * h + j)), acc[t][1] = vfma(at, w1, vload(c + t * h + j + VL));
        }
    }
    for (int64_t n = 1; n < N; n++) {
        DOWN_FUSED_ROW(n);
        for (int t = 0; t < TT; t++) {
            vec at = vset1(a[n * as + t]);
            acc[t][0] = vfma(at, w0, acc[t][0]), acc[t][1] = vfma(at, w1, acc[t][1]);
        }
    }
#undef DOWN_FUSED_ROW
    for (int t = 0; t < TT; t++) vstore(c + t * h + j, acc[t][0]), vstore(c + t * h + j + VL, acc[t][1]);
}

#define DOWN_FUSED(fmt, TT) down_fused_tile(rows, N, fmt, meta, ms, j, h, G, a + t, as, TT, c + t * h, init)
#if FUSED_DOWN_TOKENS == 8
#define DOWN_FUSED_WIDE(fmt) case 8: DOWN_FUSED(fmt, 8); break; case 7: DOWN_FUSED(fmt, 7); break; \
    case 6: DOWN_FUSED(fmt, 6); break;
#else
#define DOWN_FUSED_WIDE(fmt)
#endif
#define DOWN_FUSED_CASES(fmt) switch (TT) { DOWN_FUSED_WIDE(fmt) \
    case 5: DOWN_FUSED(fmt, 5); break; case 4: DOWN_FUSED(fmt, 4); break; \
    case 3: DOWN_FUSED(fmt, 3); break; case 2: DOWN_FUSED(fmt, 2); break; default: DOWN_FUSED(fmt, 1); break; }
/* c [T, H] (init: =, else +=) Σ_n a_n[t]·ŵ_n over N down rows, in order: down_block's sums, ŵ in registers. */
static void down_fused_block(const uint8_t *const *rows, int64_t N, const Format *f, const float *meta, int64_t ms,
                             const float *a, int64_t as, int64_t tokens, float *c, int init) {
    int64_t h = f->hidden, G = f->group;
    for (int64_t t = 0; t < tokens; t += FUSED_DOWN_TOKENS) {
        int TT = tokens - t < FUSED_DOWN_TOKENS ? (int)(tokens - t) : FUSED_DOWN_TOKENS;
        for (int64_t j = 0; j < h; j += 2 * VL) {
            BY_FUSED_FORMAT(f->fmt, DOWN_FUSED_CASES)
        }
    }
}

/* ---- several tokens with int8 activations: a neuron's gate and up rows × Q8_TOKENS tokens ----------------------------

   With --activations int8 the gate and up dots over several tokens ran rows_dot_q8 once per token: every token
   unpacked the rows' codes again (int4: an and, a shift and an and per 64 code bytes; int8: a sign flip per row and
   token) and built its block scales again. dots_q8 unpacks each 64 code bytes once for a tile of up to Q8_TOKENS
   tokens, and reads each token's block scales from vectors laid out once a call (q8_vectors: d_b in lanes 0–7,
   d_{b+1} in 8–15, as rows_dot_q8_vnni pairs them). int8's signed codes: vpdpbusd multiplies unsigned by signed bytes,
   so a row's codes go in as q + 128 (one xor per 64 codes, shared by the tile's tokens) onto an accumulator that starts
   at −128·Σ q̃ of the lane's four inputs (q8_vectors, once a token): each lane's sum is Σ q q̃ exactly, the integer
   rows_dot_q8_vnni gets with |q̃| and the flipped signs. Per (row, token) the operations are then rows_dot_q8_vnni's,
   in its order: the integer block sums (exact, whatever the tile), the same float32 fmas per group, the same
   horizontal sum and the same offsets. So a token's g and u have the bits decode (T = 1) gives them, whatever tile it
   falls in, and prefill_fused's down rows follow (prefill_chunk's sums): tests/test_kernels.py compares both.

   AVX2 (dots_q8_narrow; and AVX-512 without VNNI, or groups that are no multiple of 64, where rows_dot_q8 runs its
   AVX2 path): the same tiles on 256 bits, rows_dot_q8's AVX2 operations per (row, token), one block of 32 a step.
   The integer block sums: with AVX-VNNI as above (q + 128 onto −128·Σ q̃, vpdpbusd on 256 bits); with AVX2 alone
   maddubs and madd with ones, as rows_dot_q8 (int8: |q̃| × q with q̃'s sign, a sign flip per row and token, since q + 128
   up to 255 times q̃ would saturate maddubs' int16 pairs at 2·255·127; int4: the nibbles, unpacked once for the tile,
   times q̃, at most 2·15·127). */
#define Q8_TOKENS 4

/* Whether rows_dot_q8 runs its AVX-512 VNNI path on these rows (and dots_q8 its tiles; else dots_q8_narrow's). */
static inline int q8_wide(const Format *f) { return FMOE_VNNI && f->group % (2 * QBLOCK) == 0; }

#if FMOE_VNNI
/* Token t's vectors for step s of 64 inputs (S = H/64 steps), 32 floats at dv + (t·S + s)·32: its block scales,
   lane l = d_{2s + l/8}, then (int8 rows) 16 int32, lane l = −128·Σ_{k<4} q̃_{64s + 4l + k}. */
static void q8_vectors_wide(const Tokens *x, const Format *f, float *dv) {
    int64_t h = f->hidden, steps = h / (2 * QBLOCK);
    const __m512i offset = _mm512_set1_epi8((char)0x80); /* 128 as an unsigned byte */
    for (int64_t t = 0; t < x->tokens; t++) {
        const float *xd = x->xd + t * (h / QBLOCK);
        for (int64_t s = 0; s < steps; s++) {
            float *v = dv + (t * steps + s) * 32;
            _mm512_storeu_ps(v, _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_set1_ps(xd[2 * s])),
                                                   _mm256_set1_ps(xd[2 * s + 1]), 1));
            if (f->fmt == FMT_INT8) {
                __m512i sums = _mm512_dpbusd_epi32(_mm512_setzero_si512(), offset,
                                                   _mm512_loadu_si512((const void *)(x->xq + t * h + 64 * s)));
                _mm512_storeu_si512((void *)(v + 16), _mm512_sub_epi32(_mm512_setzero_si512(), sums));
            }
        }
    }
}

/* o0[t], o1[t] = x̂_t·ŵ_0, x̂_t·ŵ_1 for tokens t0 … t0 + TT − 1 and two rows r0, r1 (m0, m1: their fused_meta; dv:
   q8_vectors); rows_dot_q8_vnni's operations per (row, token). TT, fmt: constants where inlined. */
static inline __attribute__((always_inline)) void dots_q8(const uint8_t *r0, const uint8_t *r1, int fmt, int64_t h,
                                                           int64_t G, const float *m0, const float *m1, const Tokens *x,
                                                           int64_t t0, int TT, const float *dv, float *o0, float *o1,
                                                           int64_t ts) {
    const __m512i zero = _mm512_setzero_si512();
    int64_t steps = h / (2 * QBLOCK);
    const int8_t *xq[Q8_TOKENS];
    const float *d[Q8_TOKENS];
    __m512 total0[Q8_TOKENS], total1[Q8_TOKENS], lo0[Q8_TOKENS], lo1[Q8_TOKENS];
    for (int t = 0; t < TT; t++) {
        xq[t] = x->xq + (t0 + t) * h, d[t] = dv + (t0 + t) * steps * 32;
        total0[t] = total1[t] = _mm512_setzero_ps();
    }
    if (fmt == FMT_INT8) { /* Σ q q̃ = −128·Σ q̃ + Σ (q + 128)·q̃ per lane */
        const __m512i offset = _mm512_set1_epi8((char)0x80);
        for (int64_t g = 0; g < h / G; g++) {
            for (int t = 0; t < TT; t++) lo0[t] = lo1[t] = _mm512_setzero_ps();
            for (int64_t j = g * G; j < (g + 1) * G; j += 2 * QBLOCK) {
                __m512i w0 = _mm512_xor_si512(_mm512_loadu_si512((const void *)(r0 + j)), offset);
                __m512i w1 = _mm512_xor_si512(_mm512_loadu_si512((const void *)(r1 + j)), offset);
                for (int t = 0; t < TT; t++) {
                    const float *v = d[t] + j / (2 * QBLOCK) * 32;
                    __m512i xt = _mm512_loadu_si512((const void *)(xq[t] + j));
                    __m512i start = _mm512_loadu_si512((const void *)(v + 16));
                    __m512 dt = _mm512_loadu_ps(v);
                    __m512i p0 = _mm512_dpbusd_epi32(start, w0, xt), p1 = _mm512_dpbusd_epi32(start, w1, xt);
                    lo0[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p0), dt, lo0[t]);
                    lo1[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p1), dt, lo1[t]);
                }
            }
            __m512 s0 = _mm512_set1_ps(m0[g]), s1 = _mm512_set1_ps(m1[g]);
            for (int t = 0; t < TT; t++)
                total0[t] = _mm512_fmadd_ps(s0, lo0[t], total0[t]), total1[t] = _mm512_fmadd_ps(s1, lo1[t], total1[t]);
        }
        for (int t = 0; t < TT; t++) o0[t * ts] = _mm512_reduce_add_ps(total0[t]), o1[t * ts] = _mm512_reduce_add_ps(total1[t]);
        return;
    }
    /* int4: byte j holds code j (low nibble) and code j + H/2 (high): groups g and g + H/2G together */
    int64_t half = h / 2, paired = half / G;
    const __m512i nibble = _mm512_set1_epi8(15);
    __m512 hi0[Q8_TOKENS], hi1[Q8_TOKENS];
    for (int64_t g = 0; g < paired; g++) {
        int64_t gh = g + paired;
        for (int t = 0; t < TT; t++) lo0[t] = lo1[t] = hi0[t] = hi1[t] = _mm512_setzero_ps();
        for (int64_t j = g * G; j < (g + 1) * G; j += 2 * QBLOCK) {
            __m512i c0 = _mm512_loadu_si512((const void *)(r0 + j)), c1 = _mm512_loadu_si512((const void *)(r1 + j));
            __m512i l0 = _mm512_and_si512(c0, nibble), h0 = _mm512_and_si512(_mm512_srli_epi16(c0, 4), nibble);
            __m512i l1 = _mm512_and_si512(c1, nibble), h1 = _mm512_and_si512(_mm512_srli_epi16(c1, 4), nibble);
            for (int t = 0; t < TT; t++) {
                __m512i xl = _mm512_loadu_si512((const void *)(xq[t] + j));
                __m512i xh = _mm512_loadu_si512((const void *)(xq[t] + half + j));
                __m512 dl = _mm512_loadu_ps(d[t] + j / (2 * QBLOCK) * 32);
                __m512 dh = _mm512_loadu_ps(d[t] + (half + j) / (2 * QBLOCK) * 32);
                lo0[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(zero, l0, xl)), dl, lo0[t]);
                hi0[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(zero, h0, xh)), dh, hi0[t]);
                lo1[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(zero, l1, xl)), dl, lo1[t]);
                hi1[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(zero, h1, xh)), dh, hi1[t]);
            }
        }
        __m512 sl0 = _mm512_set1_ps(m0[2 * g]), sh0 = _mm512_set1_ps(m0[2 * gh]);
        __m512 sl1 = _mm512_set1_ps(m1[2 * g]), sh1 = _mm512_set1_ps(m1[2 * gh]);
        for (int t = 0; t < TT; t++) {
            total0[t] = _mm512_fmadd_ps(sh0, hi0[t], _mm512_fmadd_ps(sl0, lo0[t], total0[t]));
            total1[t] = _mm512_fmadd_ps(sh1, hi1[t], _mm512_fmadd_ps(sl1, lo1[t], total1[t]));
        }
    }
    for (int t = 0; t < TT; t++) o0[t * ts] = _mm512_reduce_add_ps(total0[t]), o1[t * ts] = _mm512_reduce_add_ps(total1[t]);
}
#endif

/* dots_q8's token vectors, once a call: AVX-512 VNNI's (q8_vectors_wide), or (AVX-VNNI, int8 rows) dots_q8_narrow's,
   8 int32 at dv + (t·B + b)·8 for token t's block b of 32 inputs (B = H/32): lane l = −128·Σ_{k<4} q̃_{32b + 4l + k}. */
static void q8_vectors(const Tokens *x, const Format *f, float *dv) {
#if FMOE_VNNI
    if (q8_wide(f)) {
        q8_vectors_wide(x, f, dv);
        return;
    }
#endif
#if FMOE_AVX_VNNI
    if (f->fmt == FMT_INT8) {
        const __m256i offset = _mm256_set1_epi8((char)0x80);
        int64_t blocks = f->hidden / QBLOCK;
        for (int64_t t = 0; t < x->tokens; t++)
            for (int64_t b = 0; b < blocks; b++) {
                __m256i sums = dpbusd8(_mm256_setzero_si256(), offset,
                                       _mm256_loadu_si256((const __m256i *)(x->xq + t * f->hidden + QBLOCK * b)));
                _mm256_storeu_si256((__m256i *)(dv + (t * blocks + b) * 8), _mm256_sub_epi32(_mm256_setzero_si256(), sums));
            }
    }
#else
    (void)x, (void)f, (void)dv;
#endif
}

/* Q8_NARROW_ROWS rows × TT tokens a tile on 256 bits (AVX2's 16 registers: per (row, token) two accumulators, int4
   three; the group totals are touched once a group). */
#ifndef Q8_NARROW_TOKENS
#define Q8_NARROW_TOKENS 4
#endif
/* o[r][t·ts] = x̂_t·ŵ_r for tokens t0 … t0 + TT − 1 and R rows (m: their fused_meta; dv: q8_vectors), rows_dot_q8's
   AVX2 operations per (row, token): per block the exact integer lanes (4 inputs each), then
   lo = fma(float(p), d_b, lo) from zero per group, total = fma(s_g, lo, total), its horizontal sum (int4: the groups g
   and g + H/2G of a byte's two nibbles together, s_g's fma then s_{g+H/2G}'s; the offsets after, q8_offsets).
   R, TT, fmt: constants where inlined. */
static inline __attribute__((always_inline)) void dots_q8_narrow(const uint8_t *const *rows, int R, int fmt, int64_t h,
                                                                  int64_t G, const float *const *m, const Tokens *x,
                                                                  int64_t t0, int TT, const float *dv,
                                                                  float *const *o, int64_t ts) {
    int64_t blocks = h / QBLOCK;
    const int8_t *xq[Q8_NARROW_TOKENS];
    const float *xd[Q8_NARROW_TOKENS];
    __m256 total[2][Q8_NARROW_TOKENS], lo[2][Q8_NARROW_TOKENS];
    for (int t = 0; t < TT; t++) {
        xq[t] = x->xq + (t0 + t) * h, xd[t] = x->xd + (t0 + t) * blocks;
        for (int r = 0; r < R; r++) total[r][t] = _mm256_setzero_ps();
    }
    if (fmt == FMT_INT8) {
#if FMOE_AVX_VNNI /* Σ q q̃ = −128·Σ q̃ + Σ (q + 128)·q̃ per lane */
        const __m256i offset = _mm256_set1_epi8((char)0x80);
        const int32_t *start = (const int32_t *)dv + t0 * blocks * 8;
#else /* Σ q q̃ = Σ |q̃|·(q with q̃'s sign) */
        const __m256i ones = _mm256_set1_epi16(1);
        const uint8_t *xa[Q8_NARROW_TOKENS];
        for (int t = 0; t < TT; t++) xa[t] = x->xa + (t0 + t) * h;
        (void)dv;
#endif
        for (int64_t g = 0; g < h / G; g++) {
            for (int t = 0; t < TT; t++)
                for (int r = 0; r < R; r++) lo[r][t] = _mm256_setzero_ps();
            for (int64_t j = g * G; j < (g + 1) * G; j += QBLOCK) {
                __m256i w[2];
                for (int r = 0; r < R; r++) {
                    w[r] = _mm256_loadu_si256((const __m256i *)(rows[r] + j));
#if FMOE_AVX_VNNI
                    w[r] = _mm256_xor_si256(w[r], offset);
#endif
                }
                for (int t = 0; t < TT; t++) {
                    __m256i xt = _mm256_loadu_si256((const __m256i *)(xq[t] + j));
                    __m256 d = _mm256_broadcast_ss(xd[t] + j / QBLOCK);
#if FMOE_AVX_VNNI
                    __m256i first = _mm256_loadu_si256((const __m256i *)(start + (t * blocks + j / QBLOCK) * 8));
#else
                    __m256i at = _mm256_loadu_si256((const __m256i *)(xa[t] + j));
#endif
                    for (int r = 0; r < R; r++) {
#if FMOE_AVX_VNNI
                        __m256i p = dpbusd8(first, w[r], xt);
#else
                        __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(at, _mm256_sign_epi8(w[r], xt)), ones);
#endif
                        lo[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), d, lo[r][t]);
                    }
                }
            }
            for (int r = 0; r < R; r++) {
                __m256 sg = _mm256_set1_ps(m[r][g]);
                for (int t = 0; t < TT; t++) total[r][t] = _mm256_fmadd_ps(sg, lo[r][t], total[r][t]);
            }
        }
        for (int r = 0; r < R; r++)
            for (int t = 0; t < TT; t++) o[r][t * ts] = hsum8(total[r][t]);
        return;
    }
    /* int4: byte j holds code j (low nibble) and code j + H/2 (high): groups g and g + H/2G together */
    int64_t half = h / 2, paired = half / G;
    const __m256i nibble = _mm256_set1_epi8(15);
#if !FMOE_AVX_VNNI
    const __m256i ones = _mm256_set1_epi16(1);
#endif
    __m256 hi[2][Q8_NARROW_TOKENS];
    for (int64_t g = 0; g < paired; g++) {
        int64_t gh = g + paired;
        for (int t = 0; t < TT; t++)
            for (int r = 0; r < R; r++) lo[r][t] = hi[r][t] = _mm256_setzero_ps();
        for (int64_t j = g * G; j < (g + 1) * G; j += QBLOCK) {
            __m256i cl[2], ch[2];
            for (int r = 0; r < R; r++) {
                __m256i c = _mm256_loadu_si256((const __m256i *)(rows[r] + j));
                cl[r] = _mm256_and_si256(c, nibble), ch[r] = _mm256_and_si256(_mm256_srli_epi16(c, 4), nibble);
            }
            for (int t = 0; t < TT; t++) {
                __m256i xl = _mm256_loadu_si256((const __m256i *)(xq[t] + j));
                __m256i xh = _mm256_loadu_si256((const __m256i *)(xq[t] + half + j));
                __m256 dl = _mm256_broadcast_ss(xd[t] + j / QBLOCK), dh = _mm256_broadcast_ss(xd[t] + (half + j) / QBLOCK);
                for (int r = 0; r < R; r++) {
#if FMOE_AVX_VNNI
                    __m256i pl = dpbusd8(_mm256_setzero_si256(), cl[r], xl), ph = dpbusd8(_mm256_setzero_si256(), ch[r], xh);
#else
                    __m256i pl = _mm256_madd_epi16(_mm256_maddubs_epi16(cl[r], xl), ones);
                    __m256i ph = _mm256_madd_epi16(_mm256_maddubs_epi16(ch[r], xh), ones);
#endif
                    lo[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(pl), dl, lo[r][t]);
                    hi[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ph), dh, hi[r][t]);
                }
            }
        }
        for (int r = 0; r < R; r++) {
            __m256 sl = _mm256_set1_ps(m[r][2 * g]), sh = _mm256_set1_ps(m[r][2 * gh]);
            for (int t = 0; t < TT; t++) {
                total[r][t] = _mm256_fmadd_ps(sl, lo[r][t], total[r][t]);
                total[r][t] = _mm256_fmadd_ps(sh, hi[r][t], total[r][t]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int t = 0; t < TT; t++) o[r][t * ts] = hsum8(total[r][t]);
}

/* The tokens' group sums X̂_g (int4) as vectors over tokens: xgt[(b·groups + g)·16 + lane] = X̂_g of token 16b + lane
   (zero past T), so that q8_offsets takes 16 tokens an fma. */
static void group_sum_vectors(const Tokens *x, float *xgt) {
    int64_t groups = x->groups, padded = (x->tokens + 15) / 16 * 16;
    for (int64_t t = 0; t < padded; t++)
        for (int64_t g = 0; g < groups; g++)
            xgt[((t / 16) * groups + g) * 16 + t % 16] = t < x->tokens ? x->xg[t * groups + g] : 0.0f;
}

/* o[t·ts] += Σ_g m_g·X̂_g of an int4 row (m: its fused_meta) for every token: rows_dot_q8_vnni's offsets (a float32
   fma chain over the groups g, g + H/2G, g + 1, …, from zero), 16 tokens at a time in the lanes, then added to the
   dot. */
static void q8_offsets(const float *m, const Tokens *x, const float *xgt, float *o, int64_t ts) {
    int64_t groups = x->groups, paired = groups / 2;
    for (int64_t t0 = 0; t0 < x->tokens; t0 += VL) { /* AVX2: each 16 tokens' vectors as two halves of 8 */
        const float *xb = xgt + (t0 / 16) * groups * 16 + t0 % 16;
        vec off = vzero();
        for (int64_t g = 0; g < paired; g++) {
            off = vfma(vset1(m[2 * g + 1]), vload(xb + g * 16), off);
            off = vfma(vset1(m[2 * (g + paired) + 1]), vload(xb + (g + paired) * 16), off);
        }
        float lanes[VL];
        vstore(lanes, off);
        for (int64_t t = t0; t < x->tokens && t < t0 + VL; t++) o[t * ts] += lanes[t - t0];
    }
}

#if FMOE_VNNI
#define DOTS_Q8(fmt, TT) dots_q8(r0, r1, fmt, h, G, m0, m1, x, t, TT, dv, o0 + t * ts, o1 + t * ts, ts)
#define DOTS_Q8_CASES(fmt) switch (TT) { \
    case 4: DOTS_Q8(fmt, 4); break; case 3: DOTS_Q8(fmt, 3); break; \
    case 2: DOTS_Q8(fmt, 2); break; default: DOTS_Q8(fmt, 1); break; }
#endif
#define DOTS_Q8_NARROW(fmt, TT) dots_q8_narrow(rows, 2, fmt, h, G, meta, x, t, TT, dv, out, ts)
#define DOTS_Q8_NARROW_CASES(fmt) switch (TT) { \
    case 4: DOTS_Q8_NARROW(fmt, 4); break; case 3: DOTS_Q8_NARROW(fmt, 3); break; \
    case 2: DOTS_Q8_NARROW(fmt, 2); break; default: DOTS_Q8_NARROW(fmt, 1); break; }
/* dots_q8_rows' tiles on 256 bits (a function of its own: the AVX-512 build's wide tiles keep their code). */
static __attribute__((noinline)) void dots_q8_narrow_rows(const uint8_t *r0, const uint8_t *r1, const Format *f,
                                                           const float *m0, const float *m1, const Tokens *x,
                                                           const float *dv, float *o0, float *o1, int64_t ts) {
    int64_t h = f->hidden, G = f->group;
    for (int64_t t = 0; t < x->tokens; t += Q8_NARROW_TOKENS) {
        int TT = x->tokens - t < Q8_NARROW_TOKENS ? (int)(x->tokens - t) : Q8_NARROW_TOKENS;
        const uint8_t *rows[2] = {r0, r1};
        const float *meta[2] = {m0, m1};
        float *out[2] = {o0 + t * ts, o1 + t * ts};
        if (f->fmt == FMT_INT8) { DOTS_Q8_NARROW_CASES(FMT_INT8) } else { DOTS_Q8_NARROW_CASES(FMT_INT4) }
    }
}

/* o0[t·ts], o1[t·ts] for every token: tiles of Q8_TOKENS tokens (a constant shape for each inlined copy), then
   int4's offsets (xgt: group_sum_vectors). */
static void dots_q8_rows(const uint8_t *r0, const uint8_t *r1, const Format *f, const float *m0, const float *m1,
                         const Tokens *x, const float *dv, const float *xgt, float *o0, float *o1, int64_t ts) {
#if FMOE_VNNI
    int64_t h = f->hidden, G = f->group;
    if (q8_wide(f)) {
        for (int64_t t = 0; t < x->tokens; t += Q8_TOKENS) {
            int TT = x->tokens - t < Q8_TOKENS ? (int)(x->tokens - t) : Q8_TOKENS;
            if (f->fmt == FMT_INT8) { DOTS_Q8_CASES(FMT_INT8) } else { DOTS_Q8_CASES(FMT_INT4) }
        }
    } else
#endif
        dots_q8_narrow_rows(r0, r1, f, m0, m1, x, dv, o0, o1, ts);
    if (f->fmt == FMT_INT4) q8_offsets(m0, x, xgt, o0, ts), q8_offsets(m1, x, xgt, o1, ts);
}

/* Floats of one thread's scratch for prefill_fused: the gate and up dots, a of a block, the down rows' metadata (and
   with int8 activations dots_q8's token vectors: q8_scratch_floats). */
static int64_t fused_floats(int64_t tokens, int64_t hidden) {
    int64_t padded = (tokens + 15) / 16 * 16;
    return (2 + DOWN_NEURONS) * padded + DOWN_NEURONS * META_FLOATS + q8_scratch_floats(tokens, hidden);
}

/* prefill_chunk for fused_shape: chunk k's partial sum c, its neurons in blocks of DOWN_NEURONS. Per neuron: its gate
   and up dots over every token (dots_fused; int8 activations: dots_q8, or rows_dot_q8 a token), a[t]; per block: c
   (the block's first: =, else +=) Σ a·ŵ_down in neuron order (down_fused_block). prefill_chunk's sums exactly. */
static void prefill_fused(const Pass *p, int64_t k, float *scratch) {
    const Format *f = p->f;
    const Tokens *x = p->x;
    int64_t tokens = x->tokens, h = f->hidden, pb = f->proj_bytes, padded = (tokens + 15) / 16 * 16;
    float *gu = scratch, *a = gu + 2 * padded, *meta = a + DOWN_NEURONS * padded, *dv = meta + DOWN_NEURONS * META_FLOATS;
    float *xgt = dv + q8_vector_floats(tokens, h);
    float mg[META_FLOATS], mu[META_FLOATS];
    int q8_tiles = q8_tile_shape(f, x);
    if (q8_tiles) q8_vectors(x, f, dv), group_sum_vectors(x, xgt);
    float *c = p->part + k * tokens * h;
    int64_t i0 = (p->first + k) * p->chunk, i1 = i0 + p->chunk > p->neurons ? p->neurons : i0 + p->chunk;
    const uint8_t *down[DOWN_NEURONS];
    for (int64_t b0 = i0; b0 < i1; b0 += DOWN_NEURONS) {
        int64_t b1 = b0 + DOWN_NEURONS < i1 ? b0 + DOWN_NEURONS : i1;
        for (int64_t n = b0; n < b1; n++) {
            const uint8_t *row = p->segment + n * p->row_bytes;
#ifndef FMOE_NO_PREFETCH
            if (n + FUSED_AHEAD < i1) { /* a later neuron's rows towards L2 while this one computes */
                const char *from = (const char *)(row + FUSED_AHEAD * p->row_bytes), *to = from + p->row_bytes;
                for (; from < to; from += 64) _mm_prefetch(from, _MM_HINT_T1);
            }
#endif
            fused_meta(row, f, mg), fused_meta(row + pb, f, mu);
            if (!x->q8) {
                dots_fused_rows(row, row + pb, f, mg, mu, x->xf, tokens, gu, gu + padded, 1);
            } else if (q8_tiles) {
                dots_q8_rows(row, row + pb, f, mg, mu, x, dv, xgt, gu, gu + padded, 1);
            } else {
                for (int64_t t = 0; t < tokens; t++) gate_up_dots(row, f, x, t, gu + t, gu + padded + t);
            }
            float *an = a + (n - b0) * padded;
            for (int64_t t = 0; t < tokens; t++) an[t] = gated(gu[t], gu[padded + t], p->x_bf16);
            down[n - b0] = row + 2 * pb;
            fused_meta(row + 2 * pb, f, meta + (n - b0) * META_FLOATS);
        }
        down_fused_block(down, b1 - b0, f, meta, META_FLOATS, a, padded, tokens, c, b0 == i0);
    }
}
#endif

#if FMOE_AVX2
/* pass_chunk for T > PREFILL_FROM tokens (vector shapes): chunk k's partial sum c, its neurons in blocks of
   DOWN_NEURONS. Per block: each DOT_ROWS neurons' gate and up rows decoded, their dots over every token in register
   tiles (int8 activations: each token's integer dots, as decode); a[t] per neuron; the block's down rows decoded,
   then c (the block's first: =, else +=) Σ a·ŵ_down in neuron order. So each element of c is the chunk's neurons
   added in order from zero, as in every path. */
static void prefill_chunk(const Pass *p, int64_t k, float *scratch) {
    const Format *f = p->f;
    const Tokens *x = p->x;
    int64_t tokens = x->tokens, h = f->hidden, pb = f->proj_bytes, padded = (tokens + 15) / 16 * 16;
    float *wg = scratch, *wd = wg + 2 * DOT_ROWS * h, *gu = wd + DOWN_NEURONS * h, *a = gu + 2 * DOT_ROWS * padded;
    float *c = p->part + k * tokens * h;
    int64_t i0 = (p->first + k) * p->chunk, i1 = i0 + p->chunk > p->neurons ? p->neurons : i0 + p->chunk;
    for (int64_t b0 = i0; b0 < i1; b0 += DOWN_NEURONS) {
        int64_t b1 = b0 + DOWN_NEURONS < i1 ? b0 + DOWN_NEURONS : i1;
        for (int64_t n0 = b0; n0 < b1; n0 += DOT_ROWS) {
            int64_t m = n0 + DOT_ROWS < b1 ? DOT_ROWS : b1 - n0;
#ifndef FMOE_NO_PREFETCH
            { /* the next DOT_ROWS neurons' rows towards L2 while these compute (memory and arithmetic overlap) */
                int64_t next = n0 + DOT_ROWS < i1 ? n0 + DOT_ROWS : i1, end = next + DOT_ROWS < i1 ? next + DOT_ROWS : i1;
                const char *from = (const char *)(p->segment + next * p->row_bytes), *to = (const char *)(p->segment + end * p->row_bytes);
                for (; from < to; from += 64) _mm_prefetch(from, _MM_HINT_T1);
            }
#endif
            if (!x->q8) { /* rows: the m gate rows, then the m up rows */
                for (int64_t i = 0; i < m; i++) {
                    const uint8_t *row = p->segment + (n0 + i) * p->row_bytes;
                    decode_row(row, f, wg + i * h, 1);
                    decode_row(row + pb, f, wg + (m + i) * h, 1);
                }
                dots_rows(wg, 2 * m, x->xf, tokens, h, gu, padded, 1);
            }
            for (int64_t i = 0; i < m; i++) {
                const uint8_t *row = p->segment + (n0 + i) * p->row_bytes;
                float *an = a + (n0 - b0 + i) * padded;
                for (int64_t t = 0; t < tokens; t++) {
                    float g, u;
                    if (x->q8)
                        gate_up_dots(row, f, x, t, &g, &u);
                    else
                        g = gu[i * padded + t], u = gu[(m + i) * padded + t];
                    an[t] = gated(g, u, p->x_bf16);
                }
                decode_down(row + 2 * pb, f, wd + (n0 - b0 + i) * h, 1);
            }
        }
        down_block(wd, b1 - b0, a, padded, tokens, h, c, b0 == i0);
    }
}
#endif

/* ---- down projections grouped along the neurons (FMT_DOWN_BY_NEURON; offload/quant.py quantize_down) ----------

   int8 and int4 experts whose I and G are multiples of DOWN_GROUP = 32 store the down projection in groups of 32
   neurons: a tile of R = G/32 hidden values × 32 neurons shares s (int8) or (s, m) (int4), and the group's down
   weights lie in its 32 rows' down projections, row p ("piece" p) holding the hidden values [p·hp, (p+1)·hp),
   hp = H/32, as blocks of W = gcd(16, hp) hidden values: for block b, neuron quad k, value i, neuron j of the quad
     int8: byte ((b·8 + k)·W + i)·4 + j   (neuron 4k + j)
     int4: byte ((b·4 + k)·W + i)·4 + j   (low nibble: neuron 4k + j, high nibble: neuron 16 + 4k + j)
   then the piece's hp/R tiles' metadata. One int32 lane is four neurons of one hidden value. For one token, with
   a_n the group's gated activations, the group adds to c[h]
     float activations:  v = s·Σ_n q_n·a_n                (int4: v = fma(s, Σ_n q_n·a_n, m·Σ_n a_n))
     int8 activations:   a quantised per group as x is per block (d = max|a| / 127, ã = round(a / d)), and
                         v = Σ_n q_n·ã_n · (s·d)            (int4: v = fma(s, Σ q ã, m·Σ ã)·d)
   each Σ over n = 0, 1, …, 31 in order (float: one fma per neuron from zero; int8 activations: an exact integer),
   then c[h] = v (the chunk's first group) or c[h] + v. Every build (scalar, AVX2, AVX-512) computes these very
   operations per h, so a group's contribution has the same bits in all of them (tests/test_kernels.py). A split is
   at a multiple of the chunk, itself a multiple of 32 (kernels.quant_spec checks): groups are never cut. */
#define DOWN_GROUP 32

static inline int64_t down_width(int64_t hp) { /* W = gcd(16, hp) */
    int64_t w = 16;
    while (hp % w) w /= 2;
    return w;
}

/* The code bytes of one int8 or int4 projection row (code_bytes' for these formats, in every build). */
static inline int64_t down_code_bytes(const Format *f) { return f->fmt == FMT_INT8 ? f->hidden : f->hidden / 2; }

/* q of neuron n (< 32) at hidden value i (< hp) of one piece. */
static inline int down_code(const uint8_t *piece, const Format *f, int64_t i, int n) {
    int64_t W = down_width(f->hidden / DOWN_GROUP), b = i / W, ii = i % W;
    if (f->fmt == FMT_INT8) return (int8_t)piece[((b * 8 + n / 4) * W + ii) * 4 + n % 4];
    uint8_t byte = piece[((b * 4 + (n % 16) / 4) * W + ii) * 4 + n % 4];
    return n < 16 ? byte & 15 : byte >> 4;
}

/* s and m (int8: 0) of hidden value i of one piece. */
static inline void down_meta(const uint8_t *piece, const Format *f, int64_t i, float *s, float *m) {
    const uint16_t *meta = (const uint16_t *)(piece + down_code_bytes(f));
    int64_t t = i / (f->group / DOWN_GROUP);
    if (f->fmt == FMT_INT8) *s = half_to_float(meta[t]), *m = 0.0f;
    else *s = half_to_float(meta[2 * t]), *m = half_to_float(meta[2 * t + 1]);
}

/* The group's a quantised as quantize_x quantises a block of x: d = max|a| / 127, ã = a·(1/d) rounded to nearest
   even; returns d and the exact Σ ã in *sum. */
static float quantize_group(const float *a, int8_t *aq, int *sum) {
    float amax = 0.0f;
    for (int n = 0; n < DOWN_GROUP; n++) amax = fmaxf(amax, fabsf(a[n]));
    float d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
    int total = 0;
    for (int n = 0; n < DOWN_GROUP; n++) aq[n] = (int8_t)lrintf(a[n] * id), total += aq[n];
    *sum = total;
    return d;
}

/* One piece's hidden values [i0, i1) (scalar: the reference every vector path matches bit for bit). a: float
   activations, or (aq) the quantised ones with d and asum. */
static void down_piece_scalar(const uint8_t *piece, const Format *f, int64_t i0, int64_t i1, const float *a,
                              float asum_f, const int8_t *aq, float d, int asum, float *c, int init) {
    for (int64_t i = i0; i < i1; i++) {
        float s, m, v;
        down_meta(piece, f, i, &s, &m);
        if (aq) {
            int32_t dot = 0;
            for (int n = 0; n < DOWN_GROUP; n++) dot += down_code(piece, f, i, n) * aq[n];
            v = f->fmt == FMT_INT8 ? (float)dot * (s * d) : fmaf(s, (float)dot, m * (float)asum) * d;
        } else {
            float acc = 0.0f;
            for (int n = 0; n < DOWN_GROUP; n++) acc = fmaf((float)down_code(piece, f, i, n), a[n], acc);
            v = f->fmt == FMT_INT8 ? s * acc : fmaf(s, acc, m * asum_f);
        }
        c[i] = init ? v : c[i] + v;
    }
}

/* Whether the vector paths below serve this shape: blocks of 16 hidden values, a3b's tiles (int8 R = 4, int4 R = 2). */
static int down_vector_shape(const Format *f) {
#if FMOE_AVX2
    int64_t hp = f->hidden / DOWN_GROUP, R = f->group / DOWN_GROUP;
    return hp % 16 == 0 && R == (f->fmt == FMT_INT8 ? 4 : 2);
#else
    (void)f;
    return 0;
#endif
}

#if FMOE_AVX2
#if VL == 16
/* s (and m) per lane of block b's 16 hidden values. */
static inline void down_meta_lanes(const uint8_t *meta, int fmt, int64_t b, __m512 *s, __m512 *m) {
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    if (fmt == FMT_INT8) { /* 4 tiles of 4 values */
        __m128 t = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)(meta + 8 * b)));
        *s = _mm512_permutexvar_ps(_mm512_srli_epi32(lane, 2), _mm512_castps128_ps512(t));
    } else { /* 8 tiles of 2 values, (s, m) each */
        __m512 t = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(meta + 32 * b)));
        __m512i pair = _mm512_slli_epi32(_mm512_srli_epi32(lane, 1), 1);
        *s = _mm512_permutexvar_ps(pair, t);
        *m = _mm512_permutexvar_ps(_mm512_add_epi32(pair, _mm512_set1_epi32(1)), t);
    }
}
#else
static inline void down_meta_lanes(const uint8_t *meta, int fmt, int64_t b8, __m256 *s, __m256 *m) {
    /* b8: the block of 8 hidden values */
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    if (fmt == FMT_INT8) { /* 2 tiles of 4 values */
        uint32_t two;
        memcpy(&two, meta + 4 * b8, 4);
        __m256 t = _mm256_castps128_ps256(_mm_cvtph_ps(_mm_cvtsi32_si128((int)two)));
        *s = _mm256_permutevar8x32_ps(t, _mm256_srli_epi32(lane, 2));
    } else { /* 4 tiles of 2 values */
        __m256 t = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(meta + 16 * b8)));
        __m256i pair = _mm256_slli_epi32(_mm256_srli_epi32(lane, 1), 1);
        *s = _mm256_permutevar8x32_ps(t, pair);
        *m = _mm256_permutevar8x32_ps(t, _mm256_add_epi32(pair, _mm256_set1_epi32(1)));
    }
}
#endif

/* The integer dot of 8 hidden values' codes (`codes`: a block's half, its rows 64 bytes apart) with one group's
   int8 activations (`quad`: ã four to an int32) as AVX2 computes it: maddubs and madd with ones (int8: |ã| × q with
   ã's sign; int4: the low and high nibbles against ã's first and second halves). Exact in int32. */
static inline __m256i down_dot8_maddubs(const uint8_t *codes, const int32_t *quad, int int8) {
    const __m256i ones = _mm256_set1_epi16(1), nibble = _mm256_set1_epi8(15);
    __m256i dot = _mm256_setzero_si256();
    for (int k = 0; k < (int8 ? 8 : 4); k++) {
        __m256i w = _mm256_loadu_si256((const __m256i *)(codes + 64 * k)), x = _mm256_set1_epi32(quad[k]);
        if (int8) {
            dot = _mm256_add_epi32(dot, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(x), _mm256_sign_epi8(w, x)), ones));
        } else {
            __m256i xh = _mm256_set1_epi32(quad[4 + k]);
            dot = _mm256_add_epi32(dot, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_and_si256(w, nibble), x), ones));
            dot = _mm256_add_epi32(dot, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(w, 4), nibble), xh), ones));
        }
    }
    return dot;
}

/* down_piece_scalar over the whole piece, VL hidden values a step (down_vector_shape). */
static void down_piece_vector(const uint8_t *piece, const Format *f, const float *a, float asum_f, const int8_t *aq,
                              float d, int asum, float *c, int init) {
    int64_t hp = f->hidden / DOWN_GROUP;
    const uint8_t *meta = piece + down_code_bytes(f);
    int int8 = f->fmt == FMT_INT8;
    int32_t quad[8];
    if (aq) memcpy(quad, aq, DOWN_GROUP);
#if VL == 16
    for (int64_t b = 0; b < hp / 16; b++) {
        const uint8_t *codes = piece + b * (int8 ? 512 : 256);
        __m512 s, m = _mm512_setzero_ps(), v;
        down_meta_lanes(meta, f->fmt, b, &s, &m);
        if (aq) {
#if FMOE_VNNI
            __m512i dot = _mm512_setzero_si512();
            if (int8) { /* (q + 128)·ã, then − 128·Σ ã: unsigned × signed bytes */
                const __m512i bias = _mm512_set1_epi8((char)0x80);
                for (int k = 0; k < 8; k++)
                    dot = _mm512_dpbusd_epi32(dot, _mm512_xor_si512(_mm512_loadu_si512((const void *)(codes + 64 * k)), bias),
                                              _mm512_set1_epi32(quad[k]));
                dot = _mm512_sub_epi32(dot, _mm512_set1_epi32(128 * asum));
            } else {
                const __m512i nibble = _mm512_set1_epi8(15);
                for (int k = 0; k < 4; k++) {
                    __m512i w = _mm512_loadu_si512((const void *)(codes + 64 * k));
                    dot = _mm512_dpbusd_epi32(dot, _mm512_and_si512(w, nibble), _mm512_set1_epi32(quad[k]));
                    dot = _mm512_dpbusd_epi32(dot, _mm512_and_si512(_mm512_srli_epi16(w, 4), nibble),
                                              _mm512_set1_epi32(quad[4 + k]));
                }
            }
#else /* AVX-512 without VNNI: each 256-bit half as AVX2 does */
            __m512i dot = _mm512_inserti64x4(_mm512_castsi256_si512(down_dot8_maddubs(codes, quad, int8)),
                                             down_dot8_maddubs(codes + 32, quad, int8), 1);
#endif
            __m512 sum = _mm512_cvtepi32_ps(dot), dd = _mm512_set1_ps(d);
            v = int8 ? _mm512_mul_ps(sum, _mm512_mul_ps(s, dd))
                     : _mm512_mul_ps(_mm512_fmadd_ps(s, sum, _mm512_mul_ps(m, _mm512_set1_ps((float)asum))), dd);
        } else {
            __m512 acc = _mm512_setzero_ps();
            if (int8) {
                for (int k = 0; k < 8; k++) {
                    __m512i w = _mm512_loadu_si512((const void *)(codes + 64 * k));
                    for (int j = 0; j < 4; j++)
                        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(w, 24 - 8 * j), 24)),
                                              _mm512_set1_ps(a[4 * k + j]), acc);
                }
            } else { /* a nibble as a float in one step: vpermps reads the low 4 bits of the lane (vnibble_low's trick) */
                const __m512 values = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
                __m512i w[4];
                for (int k = 0; k < 4; k++) w[k] = _mm512_loadu_si512((const void *)(codes + 64 * k));
                for (int hi = 0; hi < 2; hi++) /* neurons 0..15 (low nibbles), then 16..31 */
                    for (int k = 0; k < 4; k++)
                        for (int j = 0; j < 4; j++)
                            acc = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(w[k], 8 * j + 4 * hi), values),
                                                  _mm512_set1_ps(a[16 * hi + 4 * k + j]), acc);
            }
            v = int8 ? _mm512_mul_ps(s, acc) : _mm512_fmadd_ps(s, acc, _mm512_mul_ps(m, _mm512_set1_ps(asum_f)));
        }
        float *o = c + 16 * b;
        _mm512_storeu_ps(o, init ? v : _mm512_add_ps(_mm512_loadu_ps(o), v));
    }
#else /* AVX2: each block of 16 as two halves of 8 */
    const __m256i low = _mm256_set1_epi32(15);
    for (int64_t b8 = 0; b8 < hp / 8; b8++) {
        int64_t b = b8 / 2, h2 = b8 % 2;
        const uint8_t *codes = piece + b * (int8 ? 512 : 256) + 32 * h2;
        __m256 s, m = _mm256_setzero_ps(), v;
        down_meta_lanes(meta, f->fmt, b8, &s, &m);
        if (aq) {
            __m256 sum = _mm256_cvtepi32_ps(down_dot8_maddubs(codes, quad, int8)), dd = _mm256_set1_ps(d);
            v = int8 ? _mm256_mul_ps(sum, _mm256_mul_ps(s, dd))
                     : _mm256_mul_ps(_mm256_fmadd_ps(s, sum, _mm256_mul_ps(m, _mm256_set1_ps((float)asum))), dd);
        } else {
            __m256 acc = _mm256_setzero_ps();
            if (int8) {
                for (int k = 0; k < 8; k++) {
                    __m256i w = _mm256_loadu_si256((const __m256i *)(codes + 64 * k));
                    for (int j = 0; j < 4; j++)
                        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(w, 24 - 8 * j), 24)),
                                              _mm256_set1_ps(a[4 * k + j]), acc);
                }
            } else {
                __m256i w[4];
                for (int k = 0; k < 4; k++) w[k] = _mm256_loadu_si256((const __m256i *)(codes + 64 * k));
                for (int hi = 0; hi < 2; hi++)
                    for (int k = 0; k < 4; k++)
                        for (int j = 0; j < 4; j++)
                            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(w[k], 8 * j + 4 * hi), low)),
                                                  _mm256_set1_ps(a[16 * hi + 4 * k + j]), acc);
            }
            v = int8 ? _mm256_mul_ps(s, acc) : _mm256_fmadd_ps(s, acc, _mm256_mul_ps(m, _mm256_set1_ps(asum_f)));
        }
        float *o = c + 8 * b8;
        _mm256_storeu_ps(o, init ? v : _mm256_add_ps(_mm256_loadu_ps(o), v));
    }
#endif
}
#endif

/* c [H] (init: =, else +=) the down projection of one group of 32 neurons (`rows`: its first neuron's row, row_bytes
   apart) for one token with gated activations a [32]; q8: a quantised (the int8-activation mode). */
static void down_group(const uint8_t *rows, int64_t row_bytes, const Format *f, const float *a, int q8, float *c,
                       int init) {
    int64_t hp = f->hidden / DOWN_GROUP;
    int8_t aq[DOWN_GROUP];
    int asum = 0;
    float d = 0.0f, asum_f = 0.0f;
    if (q8) d = quantize_group(a, aq, &asum);
    else
        for (int n = 0; n < DOWN_GROUP; n++) asum_f += a[n];
    int vector = down_vector_shape(f);
    for (int64_t p = 0; p < DOWN_GROUP; p++) {
        const uint8_t *piece = rows + p * row_bytes + 2 * f->proj_bytes;
#if FMOE_AVX2
        if (vector) {
            down_piece_vector(piece, f, a, asum_f, q8 ? aq : NULL, d, asum, c + p * hp, init);
            continue;
        }
#endif
        (void)vector;
        down_piece_scalar(piece, f, 0, hp, a, asum_f, q8 ? aq : NULL, d, asum, c + p * hp, init);
    }
}

#if FMOE_AVX2
/* ---- several tokens (a prefill): a group's down pieces × DOWN_TILE_TOKENS tokens ------------------------------------

   A prefill's tokens each ran down_group alone: every token loaded and unpacked the group's 32 pieces' codes again.
   Here each 16 hidden values' codes of a piece (int8 512 bytes, int4 256) are loaded once and a tile of up to
   DOWN_TILE_TOKENS tokens takes them from registers. Per (token, hidden value) the operations are down_piece_vector's,
   in its order:
     float activations: each neuron's 16 codes converted once for the tile (the same exact floats), one fma per neuron
       n = 0, 1, …, 31 from zero, then s·acc (int4: fma(s, acc, m·Σ a));
     int8 activations (VNNI): the exact integer Σ_n q_n·ã_n, each token's ã broadcast a quad (four neurons) at a time
       into vpdpbusd (int8: the codes + 128 onto an accumulator starting at −128·Σ ã, the integer decode gets with
       − 128·Σ ã after them), then the same float32 products (int4: fma and product);
   then c = v or c + v. So a token's down has the bits decode gives it, whatever tile it falls in
   (tests/test_kernels.py compares a prefill's tokens with any others and, int8 activations, with one call each).
   AVX2 (down_float_tile8, down_q8_tile8): a tile is one block of 16 hidden values as down_piece_vector's two halves of
   8 × up to 4 tokens (16 registers), the same operations; int8 activations' integers through AVX-VNNI as above, else
   maddubs and madd with ones as down_piece_vector (int8: |ã| × q with ã's sign; int4: the nibbles, unpacked once a
   tile). */

/* The tokens' activations of one group: a [T, 32] (float), asum[t] = Σ_n a_n (float: a float32 sum in n order from
   zero, down_group's; quantised: the exact Σ ã as an int32), and with int8 activations quad[t·8 + k] = ã_{4k..4k+3}
   of token t as one int32 and d[t] (quantize_group). */
typedef struct { const float *a, *asum, *d; const int32_t *quad, *qsum; } GroupTokens;

#if VL == 16
#define DOWN_TILE_TOKENS 8
#define DOWN_Q8_TILES FMOE_VNNI /* AVX-512 without VNNI: int8 activations' down token by token */

/* c_t[16·nb : 16·nb + 16] (c_t = c + t·h; init: =, else +=) for TT tokens from t0 and NB blocks of 16 hidden values
   of one piece (codes: the first block's, 512 (int8) or 256 (int4) bytes a block; s, m: each block's scales), float
   activations. Two blocks: two accumulators a token (the fma chains' latency hidden at a few tokens). */
static inline __attribute__((always_inline)) void down_float_tile(const uint8_t *codes, int NB, int fmt,
                                                                   const __m512 *s, const __m512 *m,
                                                                   const GroupTokens *a, int64_t t0, int TT, float *c,
                                                                   int64_t h, int init) {
    const __m512 values = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const int64_t block = fmt == FMT_INT8 ? 512 : 256;
    __m512 acc[2][DOWN_TILE_TOKENS], wn[2];
    for (int nb = 0; nb < NB; nb++)
        for (int t = 0; t < TT; t++) acc[nb][t] = _mm512_setzero_ps();
    /* neuron n = 4k + j (int4: then 16 + 4k + j, the high nibbles) in order: its 16 codes a block as floats
       (down_piece_vector's values), the shifts constants (j unrolled) */
#define DOWN_FLOAT_NEURONS(HI) \
    for (int k = 0; k < (fmt == FMT_INT8 ? 8 : 4); k++) { \
        __m512i w[2]; \
        for (int nb = 0; nb < NB; nb++) w[nb] = _mm512_loadu_si512((const void *)(codes + nb * block + 64 * k)); \
        _Pragma("GCC unroll 4") \
        for (int j = 0; j < 4; j++) { \
            for (int nb = 0; nb < NB; nb++) \
                wn[nb] = fmt == FMT_INT8 ? _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(w[nb], 24 - 8 * j), 24)) \
                                         : _mm512_permutexvar_ps(_mm512_srli_epi32(w[nb], 8 * j + 4 * (HI)), values); \
            for (int t = 0; t < TT; t++) { \
                __m512 at = _mm512_set1_ps(a->a[(t0 + t) * DOWN_GROUP + 16 * (HI) + 4 * k + j]); \
                for (int nb = 0; nb < NB; nb++) acc[nb][t] = _mm512_fmadd_ps(wn[nb], at, acc[nb][t]); \
            } \
        } \
    }
    DOWN_FLOAT_NEURONS(0)
    if (fmt == FMT_INT4) DOWN_FLOAT_NEURONS(1)
#undef DOWN_FLOAT_NEURONS
    for (int t = 0; t < TT; t++)
        for (int nb = 0; nb < NB; nb++) {
            __m512 v = fmt == FMT_INT8 ? _mm512_mul_ps(s[nb], acc[nb][t])
                                       : _mm512_fmadd_ps(s[nb], acc[nb][t], _mm512_mul_ps(m[nb], _mm512_set1_ps(a->asum[t0 + t])));
            float *o = c + (t0 + t) * h + 16 * nb;
            _mm512_storeu_ps(o, init ? v : _mm512_add_ps(_mm512_loadu_ps(o), v));
        }
}

#if FMOE_VNNI
/* down_float_tile with int8 activations: the exact integers Σ_n q_n·ã_n, four neurons (one quad of ã) a vpdpbusd,
   each 64 code bytes loaded and unpacked once for the tile's tokens (int8: q + 128), then down_piece_vector's floats. */
static inline __attribute__((always_inline)) void down_q8_tile(const uint8_t *codes, int NB, int fmt,
                                                                const __m512 *s, const __m512 *m,
                                                                const GroupTokens *a, int64_t t0, int TT, float *c,
                                                                int64_t h, int init) {
    const __m512i bias = _mm512_set1_epi8((char)0x80), nibble = _mm512_set1_epi8(15);
    const int64_t block = fmt == FMT_INT8 ? 512 : 256;
    __m512i dot[2][DOWN_TILE_TOKENS];
    for (int t = 0; t < TT; t++)
        for (int nb = 0; nb < NB; nb++)
            dot[nb][t] = fmt == FMT_INT8 ? _mm512_set1_epi32(-128 * a->qsum[t0 + t]) : _mm512_setzero_si512();
    for (int k = 0; k < (fmt == FMT_INT8 ? 8 : 4); k++) {
        __m512i lo[2], hi[2];
        for (int nb = 0; nb < NB; nb++) {
            __m512i w = _mm512_loadu_si512((const void *)(codes + nb * block + 64 * k));
            if (fmt == FMT_INT8) lo[nb] = _mm512_xor_si512(w, bias);
            else lo[nb] = _mm512_and_si512(w, nibble), hi[nb] = _mm512_and_si512(_mm512_srli_epi16(w, 4), nibble);
        }
        for (int t = 0; t < TT; t++) {
            const int32_t *quad = a->quad + (t0 + t) * 8;
            __m512i ql = _mm512_set1_epi32(quad[k]);
            for (int nb = 0; nb < NB; nb++) dot[nb][t] = _mm512_dpbusd_epi32(dot[nb][t], lo[nb], ql);
            if (fmt == FMT_INT4) {
                __m512i qh = _mm512_set1_epi32(quad[4 + k]);
                for (int nb = 0; nb < NB; nb++) dot[nb][t] = _mm512_dpbusd_epi32(dot[nb][t], hi[nb], qh);
            }
        }
    }
    for (int t = 0; t < TT; t++) {
        __m512 dd = _mm512_set1_ps(a->d[t0 + t]);
        for (int nb = 0; nb < NB; nb++) {
            __m512 sum = _mm512_cvtepi32_ps(dot[nb][t]), v;
            if (fmt == FMT_INT8) v = _mm512_mul_ps(sum, _mm512_mul_ps(s[nb], dd));
            else v = _mm512_mul_ps(_mm512_fmadd_ps(s[nb], sum, _mm512_mul_ps(m[nb], _mm512_set1_ps((float)a->qsum[t0 + t]))), dd);
            float *o = c + (t0 + t) * h + 16 * nb;
            _mm512_storeu_ps(o, init ? v : _mm512_add_ps(_mm512_loadu_ps(o), v));
        }
    }
}
#endif

#if FMOE_VNNI
#define DOWN_TILE(fmt, NB, TT) do { \
        if (q8) down_q8_tile(codes, NB, fmt, s, m, a, t, TT, cb, h, init); \
        else down_float_tile(codes, NB, fmt, s, m, a, t, TT, cb, h, init); \
    } while (0)
#else
#define DOWN_TILE(fmt, NB, TT) down_float_tile(codes, NB, fmt, s, m, a, t, TT, cb, h, init)
#endif
#define DOWN_TILE_TT(fmt, NB) switch (TT) { \
    case 8: DOWN_TILE(fmt, NB, 8); break; case 4: DOWN_TILE(fmt, NB, 4); break; \
    case 2: DOWN_TILE(fmt, NB, 2); break; default: DOWN_TILE(fmt, NB, 1); break; }
#define DOWN_TILE_CASES(fmt) if (two) { DOWN_TILE_TT(fmt, 2) } else { DOWN_TILE_TT(fmt, 1) }
#else /* AVX2 */
#define DOWN_TILE_TOKENS 4
#define DOWN_Q8_TILES 1

/* c_t[0:16] (c_t = c + t·h; init: =, else +=) for TT tokens from t0 and one block of 16 hidden values of one piece
   (codes: the block's, its halves 32 bytes apart in each 64; s, m: the halves' scales), float activations:
   down_piece_vector's AVX2 operations, each neuron's codes converted once for the tile. */
static inline __attribute__((always_inline)) void down_float_tile8(const uint8_t *codes, int fmt, const __m256 *s,
                                                                    const __m256 *m, const GroupTokens *a, int64_t t0,
                                                                    int TT, float *c, int64_t h, int init) {
    const __m256i low = _mm256_set1_epi32(15);
    __m256 acc[2][DOWN_TILE_TOKENS], wn[2];
    for (int t = 0; t < TT; t++) acc[0][t] = acc[1][t] = _mm256_setzero_ps();
    for (int hi = 0; hi < (fmt == FMT_INT8 ? 1 : 2); hi++) /* int4: neurons 0..15 (low nibbles), then 16..31 */
        for (int k = 0; k < (fmt == FMT_INT8 ? 8 : 4); k++) {
            __m256i w[2];
            for (int h2 = 0; h2 < 2; h2++) w[h2] = _mm256_loadu_si256((const __m256i *)(codes + 64 * k + 32 * h2));
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++) { /* neuron 16·hi + 4k + j */
                for (int h2 = 0; h2 < 2; h2++)
                    wn[h2] = fmt == FMT_INT8
                        ? _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(w[h2], 24 - 8 * j), 24))
                        : _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(w[h2], 8 * j + 4 * hi), low));
                for (int t = 0; t < TT; t++) {
                    __m256 at = _mm256_broadcast_ss(a->a + (t0 + t) * DOWN_GROUP + 16 * hi + 4 * k + j);
                    for (int h2 = 0; h2 < 2; h2++) acc[h2][t] = _mm256_fmadd_ps(wn[h2], at, acc[h2][t]);
                }
            }
        }
    for (int t = 0; t < TT; t++)
        for (int h2 = 0; h2 < 2; h2++) {
            __m256 v = fmt == FMT_INT8 ? _mm256_mul_ps(s[h2], acc[h2][t])
                                       : _mm256_fmadd_ps(s[h2], acc[h2][t], _mm256_mul_ps(m[h2], _mm256_set1_ps(a->asum[t0 + t])));
            float *o = c + (t0 + t) * h + 8 * h2;
            _mm256_storeu_ps(o, init ? v : _mm256_add_ps(_mm256_loadu_ps(o), v));
        }
}

/* down_float_tile8 with int8 activations: the exact integers Σ_n q_n·ã_n a quad of neurons at a time (AVX-VNNI: int8
   codes + 128 onto −128·Σ ã, one vpdpbusd a token; else |ã| × q with ã's sign, maddubs and madd with ones), then
   down_piece_vector's floats. */
static inline __attribute__((always_inline)) void down_q8_tile8(const uint8_t *codes, int fmt, const __m256 *s,
                                                                 const __m256 *m, const GroupTokens *a, int64_t t0,
                                                                 int TT, float *c, int64_t h, int init) {
    const __m256i nibble = _mm256_set1_epi8(15);
#if FMOE_AVX_VNNI
    const __m256i bias = _mm256_set1_epi8((char)0x80);
#else
    const __m256i ones = _mm256_set1_epi16(1);
#endif
    __m256i dot[2][DOWN_TILE_TOKENS];
    for (int t = 0; t < TT; t++)
        dot[0][t] = dot[1][t] = FMOE_AVX_VNNI && fmt == FMT_INT8 ? _mm256_set1_epi32(-128 * a->qsum[t0 + t])
                                                                 : _mm256_setzero_si256();
    for (int k = 0; k < (fmt == FMT_INT8 ? 8 : 4); k++) {
        __m256i lo[2], hi[2];
        for (int h2 = 0; h2 < 2; h2++) {
            __m256i w = _mm256_loadu_si256((const __m256i *)(codes + 64 * k + 32 * h2));
#if FMOE_AVX_VNNI
            if (fmt == FMT_INT8) lo[h2] = _mm256_xor_si256(w, bias);
#else
            if (fmt == FMT_INT8) lo[h2] = w;
#endif
            else lo[h2] = _mm256_and_si256(w, nibble), hi[h2] = _mm256_and_si256(_mm256_srli_epi16(w, 4), nibble);
        }
        for (int t = 0; t < TT; t++) {
            const int32_t *quad = a->quad + (t0 + t) * 8;
            __m256i ql = _mm256_set1_epi32(quad[k]);
            if (fmt == FMT_INT8) {
#if FMOE_AVX_VNNI
                for (int h2 = 0; h2 < 2; h2++) dot[h2][t] = dpbusd8(dot[h2][t], lo[h2], ql);
#else
                __m256i qa = _mm256_abs_epi8(ql);
                for (int h2 = 0; h2 < 2; h2++)
                    dot[h2][t] = _mm256_add_epi32(dot[h2][t], _mm256_madd_epi16(_mm256_maddubs_epi16(qa, _mm256_sign_epi8(lo[h2], ql)), ones));
#endif
            } else {
                __m256i qh = _mm256_set1_epi32(quad[4 + k]);
                for (int h2 = 0; h2 < 2; h2++) {
#if FMOE_AVX_VNNI
                    dot[h2][t] = dpbusd8(dpbusd8(dot[h2][t], lo[h2], ql), hi[h2], qh);
#else
                    dot[h2][t] = _mm256_add_epi32(dot[h2][t], _mm256_madd_epi16(_mm256_maddubs_epi16(lo[h2], ql), ones));
                    dot[h2][t] = _mm256_add_epi32(dot[h2][t], _mm256_madd_epi16(_mm256_maddubs_epi16(hi[h2], qh), ones));
#endif
                }
            }
        }
    }
    for (int t = 0; t < TT; t++) {
        __m256 dd = _mm256_set1_ps(a->d[t0 + t]);
        for (int h2 = 0; h2 < 2; h2++) {
            __m256 sum = _mm256_cvtepi32_ps(dot[h2][t]), v;
            if (fmt == FMT_INT8) v = _mm256_mul_ps(sum, _mm256_mul_ps(s[h2], dd));
            else v = _mm256_mul_ps(_mm256_fmadd_ps(s[h2], sum, _mm256_mul_ps(m[h2], _mm256_set1_ps((float)a->qsum[t0 + t]))), dd);
            float *o = c + (t0 + t) * h + 8 * h2;
            _mm256_storeu_ps(o, init ? v : _mm256_add_ps(_mm256_loadu_ps(o), v));
        }
    }
}

#define DOWN_TILE8(fmt, TT) do { \
        if (q8) down_q8_tile8(codes, fmt, s, m, a, t, TT, cb, h, init); \
        else down_float_tile8(codes, fmt, s, m, a, t, TT, cb, h, init); \
    } while (0)
#define DOWN_TILE_CASES(fmt) switch (TT) { \
    case 4: DOWN_TILE8(fmt, 4); break; case 2: DOWN_TILE8(fmt, 2); break; default: DOWN_TILE8(fmt, 1); break; }
#endif

/* c [T, H] (init: =, else +=) the down projection of one group of 32 neurons (down_group's `rows`) for every token
   (down_vector_shape); q8: int8 activations (DOWN_Q8_TILES). AVX-512: two blocks of 16 hidden values a tile while a
   piece has two left; AVX2: one block, as two halves of 8. */
static void down_group_tokens(const uint8_t *rows, int64_t row_bytes, const Format *f, const GroupTokens *a, int q8,
                              int64_t tokens, float *c, int init) {
    int64_t h = f->hidden, hp = h / DOWN_GROUP, blocks = hp / 16;
    int int8 = f->fmt == FMT_INT8;
    for (int64_t p = 0; p < DOWN_GROUP; p++) {
        const uint8_t *piece = rows + p * row_bytes + 2 * f->proj_bytes, *meta = piece + down_code_bytes(f);
        for (int64_t b = 0; b < blocks; b += VL == 16 ? 2 : 1) {
            const uint8_t *codes = piece + b * (int8 ? 512 : 256);
            vec s[2], m[2] = {vzero(), vzero()};
#if VL == 16
            int two = b + 1 < blocks;
            for (int nb = 0; nb < 1 + two; nb++) down_meta_lanes(meta, f->fmt, b + nb, &s[nb], &m[nb]);
#else
            for (int h2 = 0; h2 < 2; h2++) down_meta_lanes(meta, f->fmt, 2 * b + h2, &s[h2], &m[h2]);
#endif
            float *cb = c + p * hp + 16 * b;
            for (int64_t t = 0, TT; t < tokens; t += TT) { /* tiles of DOWN_TILE_TOKENS, then halves (fewer copies) */
                for (TT = DOWN_TILE_TOKENS; TT > tokens - t;) TT /= 2;
                if (int8) { DOWN_TILE_CASES(FMT_INT8) } else { DOWN_TILE_CASES(FMT_INT4) }
            }
        }
    }
}

/* Whether several tokens take the tiles: gate and up in dots_fused's (float activations) or dots_q8's (int8
   activations), the down in down_group_tokens'. */
static int by_neuron_tiles(const Format *f, const Tokens *x) {
    if (!prefill_tiles || x->tokens < 2 || !down_vector_shape(f)) return 0;
    return x->q8 ? DOWN_Q8_TILES && q8_tile_shape(f, x) : fused_shape(f, x);
}

/* pass_chunk_by_neuron for by_neuron_tiles: per group, each neuron's gate and up dots over every token in
   dots_fused's or dots_q8's tiles (prefill_fused's bits; with int8 activations decode's), a[t], each token's Σ a (int8
   activations: its group quantised, quantize_group), then the group's down for every token (down_group_tokens:
   decode's bits). */
static void by_neuron_tiles_chunk(const Pass *p, int64_t k, float *scratch) {
    const Format *f = p->f;
    const Tokens *x = p->x;
    int64_t tokens = x->tokens, h = f->hidden, pb = f->proj_bytes, padded = (tokens + 15) / 16 * 16;
    float *c = p->part + k * tokens * h, *a = scratch, *gu = a + DOWN_GROUP * padded, *asum = gu + 2 * padded;
    float *d = asum + padded;
    int32_t *qsum = (int32_t *)(d + padded), *quad = qsum + padded;
    float *dv = (float *)(quad + 8 * padded), *xgt = dv + q8_vector_floats(tokens, h);
    float mg[META_FLOATS], mu[META_FLOATS];
    if (x->q8) q8_vectors(x, f, dv), group_sum_vectors(x, xgt);
    GroupTokens group = {a, asum, d, quad, qsum};
    int64_t i0 = (p->first + k) * p->chunk, i1 = i0 + p->chunk > p->neurons ? p->neurons : i0 + p->chunk;
    for (int64_t g0 = i0; g0 < i1; g0 += DOWN_GROUP) {
        const uint8_t *rows = p->segment + g0 * p->row_bytes;
        for (int n = 0; n < DOWN_GROUP; n++) {
            const uint8_t *row = rows + n * p->row_bytes;
#ifndef FMOE_NO_PREFETCH
            if (g0 + n + FUSED_AHEAD < i1) { /* a later neuron's rows towards L2 while this one computes */
                const char *from = (const char *)(row + FUSED_AHEAD * p->row_bytes), *to = from + p->row_bytes;
                for (; from < to; from += 64) _mm_prefetch(from, _MM_HINT_T1);
            }
#endif
            fused_meta(row, f, mg), fused_meta(row + pb, f, mu);
            if (x->q8)
                dots_q8_rows(row, row + pb, f, mg, mu, x, dv, xgt, gu, gu + padded, 1);
            else
                dots_fused_rows(row, row + pb, f, mg, mu, x->xf, tokens, gu, gu + padded, 1);
            for (int64_t t = 0; t < tokens; t++) a[t * DOWN_GROUP + n] = gated(gu[t], gu[padded + t], p->x_bf16);
        }
        for (int64_t t = 0; t < tokens; t++) {
            const float *at = a + t * DOWN_GROUP;
            if (x->q8) {
                d[t] = quantize_group(at, (int8_t *)(quad + 8 * t), &qsum[t]);
            } else {
                float sum = 0.0f;
                for (int n = 0; n < DOWN_GROUP; n++) sum += at[n];
                asum[t] = sum;
            }
        }
        down_group_tokens(rows, p->row_bytes, f, &group, x->q8, tokens, c, g0 == i0);
    }
}
#endif

/* Floats of one thread's scratch for pass_chunk_by_neuron: a of a group for every token, and (several tokens, float32
   dots) DOT_ROWS neurons' decoded gate and up rows and their dots, or (by_neuron_tiles_chunk) a neuron's gate and up
   dots, dots_q8's token vectors and the tokens' GroupTokens (13 floats a token beside a). */
static int64_t by_neuron_floats(int64_t tokens, int64_t hidden) {
    int64_t padded = (tokens + 15) / 16 * 16, floats = 2 * DOT_ROWS * ((hidden + 15) / 16 * 16 + padded);
    int64_t tiles = 13 * padded + q8_scratch_floats(tokens, hidden);
    return DOWN_GROUP * padded + (tiles > floats ? tiles : floats) + 16;
}

/* pass_chunk for FMT_DOWN_BY_NEURON rows: chunk k's partial sum c [T, H], its neurons a group of 32 at a time: each
   neuron's gate and up dots per token (int8 activations: gate_up_dots; one float32 token: gate_up_one, prefetching;
   several: prefill_chunk's decoded rows in register tiles), a[t], then the group's down for each token (down_group;
   a token's down has the same bits whatever the other tokens). Several tokens where by_neuron_tiles (AVX-512 or AVX2;
   int8 activations on AVX-512 without VNNI not): by_neuron_tiles_chunk, the same bits. scratch: by_neuron_floats. */
static void pass_chunk_by_neuron(const Pass *p, int64_t k, float *scratch) {
    const Format *f = p->f;
    const Tokens *x = p->x;
#if FMOE_AVX2
    if (by_neuron_tiles(f, x) && FMOE_PHASES == 3) {
        by_neuron_tiles_chunk(p, k, scratch);
        return;
    }
#endif
    int64_t tokens = x->tokens, h = f->hidden;
    float *c = p->part + k * tokens * h, *a = scratch; /* a[t·32 + n] */
    int64_t i0 = (p->first + k) * p->chunk, i1 = i0 + p->chunk > p->neurons ? p->neurons : i0 + p->chunk;
#if FMOE_AVX2
    int64_t padded = (tokens + 15) / 16 * 16;
    Cursor cursor, *pf = tokens == 1 ? cursor_at(&cursor, f, p->segment + i0 * p->row_bytes,
                                                 p->segment + p->neurons * p->row_bytes) : NULL;
    int one = one_shape(f, x) && !x->q8;
    int tiles = tokens > 1 && !x->q8 && x->vector;
    float *wg = a + DOWN_GROUP * padded, *gu = wg + 2 * DOT_ROWS * ((h + 15) / 16 * 16);
#endif
    for (int64_t g0 = i0; g0 < i1; g0 += DOWN_GROUP) {
        const uint8_t *rows = p->segment + g0 * p->row_bytes;
#if FMOE_AVX2
        if (tiles) { /* DOT_ROWS neurons: gate rows, then up rows, decoded; their dots over every token */
            for (int n0 = 0; n0 < DOWN_GROUP; n0 += DOT_ROWS) {
                for (int i = 0; i < DOT_ROWS; i++) {
                    const uint8_t *row = rows + (n0 + i) * p->row_bytes;
                    decode_row(row, f, wg + i * h, 1);
                    decode_row(row + f->proj_bytes, f, wg + (DOT_ROWS + i) * h, 1);
                }
                dots_rows(wg, 2 * DOT_ROWS, x->xf, tokens, h, gu, padded, 1);
                for (int i = 0; i < DOT_ROWS; i++)
                    for (int64_t t = 0; t < tokens; t++)
                        a[t * DOWN_GROUP + n0 + i] = gated(gu[i * padded + t], gu[(DOT_ROWS + i) * padded + t], p->x_bf16);
            }
        } else
#endif
        for (int n = 0; n < DOWN_GROUP; n++) {
            const uint8_t *row = rows + n * p->row_bytes;
            for (int64_t t = 0; t < tokens; t++) {
                float g, u;
#if FMOE_AVX2
                if (one) { /* the cursor steps a row a neuron: its down piece is read from L1/L2 after the group */
                    gate_up_one(row, f, x->xf, x->xg, &g, &u, pf); /* steps by the gate and up codes */
                    cursor_step(pf, p->row_bytes - 2 * down_code_bytes(f));
                } else {
                    cursor_step(pf, p->row_bytes);
                    gate_up_dots(row, f, x, t, &g, &u);
                }
#else
                gate_up_dots(row, f, x, t, &g, &u);
#endif
                a[t * DOWN_GROUP + n] = gated(g, u, p->x_bf16);
            }
        }
        if (FMOE_PHASES & 2)
            for (int64_t t = 0; t < tokens; t++)
                down_group(rows, p->row_bytes, f, a + t * DOWN_GROUP, x->q8, c + t * h, g0 == i0);
        else if (g0 == i0)
            memset(c, 0, sizeof(float) * tokens * h);
    }
}

/* Chunk first + k: its partial sum c = Σ over its neurons, in order, of a[t]·ŵ_down (from zero). */
static void pass_chunk(void *job, int64_t k, int64_t worker) {
    const Pass *p = job;
    const Format *f = p->f;
    const Tokens *x = p->x;
    if (f->down_by_neuron) {
        pass_chunk_by_neuron(p, k, p->scratch + worker * p->stride);
        return;
    }
    if (one_shape(f, x) && (FMOE_PHASES & 1)) {
        pass_chunk_one(p, k);
        return;
    }
    int64_t tokens = x->tokens, hidden = f->hidden, proj_bytes = f->proj_bytes;
    int decoded = tokens > 1 && !x->q8; /* ŵ of the gate and up rows once, then every token's float32 dots */
    int64_t padded = (tokens + 15) / 16 * 16;
    float *at = p->scratch + worker * p->stride, *ut = at + AXPY_ROWS * padded, *wt = ut + padded; /* a_r[t]: r < 4 */
#if FMOE_AVX2
    if (tokens > PREFILL_FROM && x->vector && FMOE_PHASES == 3) { /* several tokens (a prefill): register tiles */
        if (fused_shape(f, x))
            prefill_fused(p, k, p->scratch + worker * p->stride);
        else
            prefill_chunk(p, k, p->scratch + worker * p->stride);
        return;
    }
#endif
    float *c = p->part + k * tokens * hidden;
    int64_t i0 = (p->first + k) * p->chunk, i1 = i0 + p->chunk > p->neurons ? p->neurons : i0 + p->chunk;
    const uint8_t *down[AXPY_ROWS];
    int held = 0; /* neurons whose a is computed and whose down rows wait in `down` */
    for (int64_t i = i0; i < (FMOE_PHASES & 1 ? i1 : i0); i++) {
        const uint8_t *row = p->segment + i * p->row_bytes;
        float *a = at + held * padded;
        if (decoded) {
            decode_row(row, f, wt, x->vector);
            dot_tokens(wt, x->xf, tokens, hidden, a, x->vector);
            decode_row(row + proj_bytes, f, wt, x->vector);
            dot_tokens(wt, x->xf, tokens, hidden, ut, x->vector);
        }
        for (int64_t t = 0; t < tokens; t++) {
            float g, u;
            if (decoded)
                g = a[t], u = ut[t];
            else
                gate_up_dots(row, f, x, t, &g, &u);
            a[t] = gated(g, u, p->x_bf16);
        }
        down[held++] = row + 2 * proj_bytes;
        if (held == AXPY_ROWS || i + 1 == i1) {
            if (FMOE_PHASES & 2) down_rows(down, held, f, at, padded, tokens, c, i + 1 - held == i0, x->vector);
            held = 0;
        }
    }
    if (!(FMOE_PHASES & 1) || !(FMOE_PHASES & 2)) memset(c, 0, sizeof(float) * tokens * hidden);
}

/* Floats of one thread's scratch in a pass (pass_chunk): a[t], u[t] of AXPY_ROWS neurons (several tokens: and one
   decoded row ŵ), or prefill_chunk's, on cache lines of its own. */
static int64_t pass_stride(int64_t tokens, int64_t hidden) {
    int64_t stride = ((tokens + 15) / 16 * 16) * (AXPY_ROWS + 1) + (tokens > 1 ? (hidden + 15) / 16 * 16 : 0);
    if (tokens > PREFILL_FROM && prefill_floats(tokens, hidden) > stride) stride = prefill_floats(tokens, hidden);
    if (by_neuron_floats(tokens, hidden) > stride) stride = by_neuron_floats(tokens, hidden); /* FMT_DOWN_BY_NEURON */
#if FMOE_AVX2
    if (tokens > PREFILL_FROM && fused_floats(tokens, hidden) > stride) stride = fused_floats(tokens, hidden);
#endif
    return stride;
}

/* acc [T, H] += the partial sums c_0, c_1, … of `count` chunks (part: [count, T, H]), in chunk order per element:
   acc = ((acc + c_0) + c_1) + …, the split-exact sum (both entry points below). */
static void add_chunk_sums(float *restrict acc, const float *restrict part, int64_t count, int64_t tokens,
                           int64_t hidden) {
    for (int64_t t = 0; t < tokens; t++)
        for (int64_t k = 0; k < count; k++) {
            const float *c = part + (k * tokens + t) * hidden;
            float *o = acc + t * hidden;
            for (int64_t j = 0; j < hidden; j++) o[j] += c[j];
        }
}

/* The float32 results rounded once to bf16 (torch's rounding), when the caller asked for them. */
static void round_out_bf16(uint16_t *out_bf16, const float *acc, int64_t n) {
    if (out_bf16)
        for (int64_t j = 0; j < n; j++) out_bf16[j] = float_to_bf16(acc[j]);
}

/* acc [T, H] float32 (+)= the segment's partial output; out_bf16 (optional): acc rounded to bf16.
   The neurons go in chunks of `chunk` (C) from the segment's start: each chunk's partial sum c_k starts
   from zero and adds its neurons in order, then acc = ((acc + c_0) + c_1) + …, so a split at a multiple
   of C, the second part continuing the first's acc, gives the whole's bits (with q8 too: x̂ depends on x
   alone). A thread takes whole chunks and streams each chunk's rows in memory order (gate, up, down of
   each neuron in turn). q8: the int8-activation dots for gate and up where they serve the format.
   Returns 0, -1 when memory runs out, or -2 when FMT_DOWN_BY_NEURON rows would be cut inside a group. */
int fmoe_segment_forward(int fmt, const uint8_t *segment, int64_t neurons, int64_t hidden, int64_t proj_bytes,
                         int64_t group, int64_t meta_group, int64_t chunk, const void *x, int x_bf16,
                         int64_t tokens, float *acc, int accumulate, uint16_t *out_bf16, int threads, int q8) {
    Format f = format_of(fmt, hidden, proj_bytes, group, meta_group);
    if (chunk < 1) chunk = 1;
    if (f.down_by_neuron && (chunk % DOWN_GROUP || neurons % DOWN_GROUP)) return -2; /* would cut a down group */
    int64_t chunks = (neurons + chunk - 1) / chunk;
    if (threads < 1 || neurons * hidden * tokens < (1 << 16)) threads = 1; /* small: threads cost more than they save */
    int64_t width = threads; /* threads taking part: the per-thread scratch */
    int64_t batch = PARTIAL_FLOATS / (tokens * hidden); /* chunks computed before they are added into acc */
    if (batch < width) batch = width;
    if (batch > chunks) batch = chunks;
    if (batch < 1) batch = 1;
    int64_t stride = pass_stride(tokens, hidden);
    Tokens xs;
    float *part = prepare_tokens(&xs, x, x_bf16, tokens, &f, q8, batch * tokens * hidden + 16 + width * stride);
    if (!part) return -1;
    float *scratch = part + batch * tokens * hidden;
    scratch += (16 - ((uintptr_t)scratch / sizeof(float)) % 16) % 16; /* 64-byte aligned */
    if (!accumulate) memset(acc, 0, sizeof(float) * tokens * hidden);
    Pass pass = {&f, segment, neurons, chunk, 0, stride, 3 * proj_bytes, x_bf16, &xs, part, scratch};
    for (int64_t first = 0; first < chunks; first += batch) {
        int64_t count = first + batch > chunks ? chunks - first : batch;
        pass.first = first;
        parallel_chunks(count, pass_chunk, &pass, threads);
        add_chunk_sums(acc, part, count, tokens, hidden);
    }
    round_out_bf16(out_bf16, acc, tokens * hidden);
    return 0;
}

/* ---- a layer's experts in one call ----------------------------------------------------------- */

/* Segments computed in one job, at most, and their chunks' partial sums held at once, at most (more: one call
   each). 1 MB: a3b's eight experts at a decode step (8 × 12 chunks × 2048 floats) fit; eight experts of 64 neurons
   in chunks of one (4 MB of partials) cost 1.4× the CPU of one call each (benchmarks/kernels.py --layer 8
   --intermediate 64), their partials out of the caches. */
#define GROUP_SEGMENTS 64
#define GROUP_PARTIAL_FLOATS (1 << 18)

typedef struct {
    Pass pass[GROUP_SEGMENTS];
    int64_t first_chunk[GROUP_SEGMENTS + 1]; /* segment e's chunks are [first_chunk[e], first_chunk[e + 1]) */
    int64_t count;
} Group;

static void group_chunk(void *job, int64_t k, int64_t worker) {
    const Group *p = job;
    int64_t e = 0;
    while (k >= p->first_chunk[e + 1]) e++;
    pass_chunk((void *)&p->pass[e], k - p->first_chunk[e], worker);
}

/* Several segments for the same tokens x (a layer's activated experts at a decode step) in one call:
   acc [count, T, H] float32 = each segment's partial output, exactly as fmoe_segment_forward computes it
   alone (its chunks counted from its own start, each from zero, then added in order into its acc from
   zero), so the grouping changes no bit; out_bf16 (optional): acc rounded to bf16. The chunks of every
   segment are one job for the threads: one wake of the pool, one ctypes call. Returns 0, -1 when memory
   runs out, or -2 (fmoe_segment_forward). */
int fmoe_segments_forward(int fmt, int64_t count, const uint8_t *const *segments, const int64_t *neurons,
                          int64_t hidden, int64_t proj_bytes, int64_t group, int64_t meta_group, int64_t chunk,
                          const void *x, int x_bf16, int64_t tokens, float *acc, uint16_t *out_bf16, int threads,
                          int q8) {
    int64_t size = tokens * hidden, total = 0, work = 0;
    if (chunk < 1) chunk = 1;
    for (int64_t e = 0; e < count; e++)
        if ((fmt & FMT_DOWN_BY_NEURON) && (chunk % DOWN_GROUP || neurons[e] % DOWN_GROUP)) return -2; /* a cut group */
    for (int64_t e = 0; e < count; e++) total += (neurons[e] + chunk - 1) / chunk, work += neurons[e];
    if (count > GROUP_SEGMENTS || total * size > GROUP_PARTIAL_FLOATS) { /* one call each */
        for (int64_t e = 0; e < count; e++)
            if (fmoe_segment_forward(fmt, segments[e], neurons[e], hidden, proj_bytes, group, meta_group, chunk, x,
                                     x_bf16, tokens, acc + e * size, 0, out_bf16 ? out_bf16 + e * size : NULL,
                                     threads, q8))
                return -1;
        return 0;
    }
    Format f = format_of(fmt, hidden, proj_bytes, group, meta_group);
    if (threads < 1 || work * hidden * tokens < (1 << 16)) threads = 1;
    int64_t width = threads;
    int64_t stride = pass_stride(tokens, hidden);
    Tokens xs;
    float *part = prepare_tokens(&xs, x, x_bf16, tokens, &f, q8, total * size + 16 + width * stride);
    if (!part) return -1;
    float *scratch = part + total * size;
    scratch += (16 - ((uintptr_t)scratch / sizeof(float)) % 16) % 16; /* 64-byte aligned */
    Group job;
    job.count = count, job.first_chunk[0] = 0;
    for (int64_t e = 0; e < count; e++) {
        job.first_chunk[e + 1] = job.first_chunk[e] + (neurons[e] + chunk - 1) / chunk;
        Pass pass = {&f, segments[e], neurons[e], chunk, 0, stride, 3 * proj_bytes, x_bf16, &xs,
                     part + job.first_chunk[e] * size, scratch};
        job.pass[e] = pass;
    }
    parallel_chunks(total, group_chunk, &job, threads);
    memset(acc, 0, sizeof(float) * count * size);
    for (int64_t e = 0; e < count; e++) /* acc_e = ((0 + c_0) + c_1) + … */
        add_chunk_sums(acc + e * size, part + job.first_chunk[e] * size, job.first_chunk[e + 1] - job.first_chunk[e],
                       tokens, hidden);
    round_out_bf16(out_bf16, acc, count * size);
    return 0;
}

/* ---- a prefill's experts in one call ------------------------------------------------------------ */

/* A prefill gives each of a layer's experts its own few tokens (a3b's 64-token prompt: 100–128 experts a layer, 1–30
   tokens each), one kernel call each before: a ctypes call, a wake of the pool and a wait for its last chunk per
   expert. Here the experts are the pool's job: each thread takes a whole expert at a time (the largest first, from
   `order`) and computes it alone with fmoe_segment_forward on one thread, so each expert's output has exactly the
   bits it has in its own call (nothing depends on the thread count), with one call and one wake a layer. */
typedef struct {
    int fmt, x_bf16, q8;
    const uint8_t *const *segments;
    const int64_t *neurons, *tokens, *order;
    int64_t hidden, proj_bytes, group, meta_group, chunk;
    const void *const *xs;
    float *const *accs;
    uint16_t *const *outs;
    _Atomic int failed;
} Experts;

static void expert_task(void *job, int64_t k, int64_t worker) {
    Experts *p = job;
    int64_t e = p->order ? p->order[k] : k;
    (void)worker;
    if (fmoe_segment_forward(p->fmt, p->segments[e], p->neurons[e], p->hidden, p->proj_bytes, p->group, p->meta_group,
                             p->chunk, p->xs[e], p->x_bf16, p->tokens[e], p->accs[e], 0, p->outs ? p->outs[e] : NULL, 1,
                             p->q8))
        atomic_store(&p->failed, 1);
}

/* accs[e] [tokens[e], H] float32 = segment e's partial output for its tokens xs[e] (float32, or bf16 when x_bf16), as
   fmoe_segment_forward computes it alone; outs[e] (outs optional): accs[e] rounded to bf16. order (optional): the
   experts in the order the threads take them. Returns 0, or -1 when memory runs out. */
int fmoe_experts_forward(int fmt, int64_t count, const uint8_t *const *segments, const int64_t *neurons, int64_t hidden,
                         int64_t proj_bytes, int64_t group, int64_t meta_group, int64_t chunk, const void *const *xs,
                         int x_bf16, const int64_t *tokens, float *const *accs, uint16_t *const *outs,
                         const int64_t *order, int threads, int q8) {
    Experts job = {fmt, x_bf16, q8, segments, neurons, tokens, order, hidden, proj_bytes, group, meta_group, chunk, xs,
                   accs, outs, 0};
    parallel_chunks(count, expert_task, &job, threads < 1 ? 1 : threads);
    return atomic_load(&job.failed) ? -1 : 0;
}

/* ---- a prefill's weighted sum of its experts' outputs ---------------------------------------------------------

   out_t = Σ_k w_tk · y_tk over a token's K routed slots, in routing order: each product rounded to float32, then
   added from 0 in k order (fmoe_combine_decode's formula, token by token). The rows y_tk are read where the experts
   left them (expert e's output rows [T_e, H], its tokens ascending: the engine's `outputs`), so no gather into
   routing order first (torch's cat, index, product and sum: ~2 ms of one thread a layer of `big` at 64 tokens, while
   the pool's other thread waited). Chunks of COMBINE_TOKENS tokens go to the pool; each output is computed whole by
   one thread, so no bit depends on the split or the thread count. */
#define COMBINE_TOKENS 4

typedef struct {
    int64_t tokens, k, hidden;
    const int64_t *ids;         /* [T·K]: the expert of routed slot p = t·K + j */
    const int64_t *rows;        /* [T·K]: slot p's row in expert order (the routing's layout) */
    const float *const *bases;  /* by expert id: its output rows */
    const int64_t *starts;      /* by expert id: the row in expert order of its first output row */
    const float *weights;       /* [T·K] */
    float *out;                 /* [T, H] */
} Combine;

static void combine_chunk(void *job, int64_t c, int64_t worker) {
    const Combine *p = job;
    int64_t h = p->hidden, t1 = (c + 1) * COMBINE_TOKENS < p->tokens ? (c + 1) * COMBINE_TOKENS : p->tokens;
    (void)worker;
    for (int64_t t = c * COMBINE_TOKENS; t < t1; t++) {
        float *restrict o = p->out + t * h;
        for (int64_t i = 0; i < h; i++) o[i] = 0.0f;
        for (int64_t j = 0; j < p->k; j++) {
            int64_t slot = t * p->k + j, e = p->ids[slot];
            const float *restrict y = p->bases[e] + (p->rows[slot] - p->starts[e]) * h;
            float w = p->weights[slot];
            for (int64_t i = 0; i < h; i++) {
                float product = y[i] * w;
                o[i] += product;
            }
        }
    }
}

/* out [T, H] float32 = the weighted sum above, on up to `threads` threads (the pool). */
void fmoe_combine_prefill(int64_t tokens, int64_t k, int64_t hidden, const int64_t *ids, const int64_t *rows,
                          const float *const *bases, const int64_t *starts, const float *weights, float *out,
                          int threads) {
    Combine job = {tokens, k, hidden, ids, rows, bases, starts, weights, out};
    parallel_chunks((tokens + COMBINE_TOKENS - 1) / COMBINE_TOKENS, combine_chunk, &job, threads < 1 ? 1 : threads);
}

/* ---- one dense projection: y = x·ŵᵀ (models/dense.py) -------------------------------------- */

/* Output rows handed out at a time: each output is one row's dot, so the chunking changes no bits. */
#define LINEAR_ROWS 32

#if FMOE_AVX2
/* ---- a dense projection's many tokens: tokens in the lanes (int8, int4 rows; T ≥ GEMM_FROM) -----------------------

   At a prefill's 64 tokens a dense linear's rows are each dotted with every token; the tiles above decode 4 rows into
   a float block and stream the tokens from L2 once per 3 tokens, at ~45 GFLOPS a thread. Here, per job of
   LINEAR_ROWS rows and slice of GEMM_K inputs, the rows' slice is decoded once into an L1 block ŵ [rows, GEMM_K]
   (decode_row's values), and a register tile of GEMM_R rows × 2·VL tokens runs over it: the tokens are the lanes
   (x transposed once a call: xt [H, T'] with T' the tokens padded to VL, zeros after T), one broadcast of ŵ_r,k and
   one fma per lane a step, the tile's sums kept between slices in the job's accumulator block [rows, T'].
   Each output (o, t) is one float32 chain in input order, y = fma(ŵ_o,k, x_t,k, y) from y = 0, k = 0, 1, …, H − 1:
   the same operations whatever tile, slice split, job or thread it falls in, and whatever the other tokens are. */
#define GEMM_FROM 8  /* tokens from which a dense linear takes this path (fewer: the tiles above) */
#define GEMM_K 64    /* inputs a slice: ŵ [LINEAR_ROWS, 64] and x's [64, T'] stay in L1 (T' ≤ 64: 8 + 16 KB) */
#define GEMM_R 6     /* rows a tile: 6 × 2 accumulators, two token loads and a broadcast in AVX2's 16 registers */

/* ŵ_k for k in [k0, k0 + GEMM_K) of one int8 or int4 row (decode_row's values) into w. */
static void decode_slice(const uint8_t *row, const Format *f, int64_t k0, float *w) {
    int64_t h = f->hidden, G = f->group;
    int64_t g = k0 / G, next = (g + 1) * G; /* j's group, and where the next one starts (no division a vector) */
    if (f->fmt == FMT_INT8) {
        const uint16_t *meta = (const uint16_t *)(row + h);
        for (int64_t j = k0; j < k0 + GEMM_K; j += VL) {
            if (j == next) g++, next += G;
            vstore(w + j - k0, vmul(vq8(row + j), vset1(half_to_float(meta[g]))));
        }
        return;
    }
    int64_t half = h / 2;
    const uint16_t *meta = (const uint16_t *)(row + half);
    for (int64_t j = k0; j < k0 + GEMM_K; j += VL) {
        if (j == next) g++, next += G;
        vec s = vset1(half_to_float(meta[2 * g])), m = vset1(half_to_float(meta[2 * g + 1]));
        vec q = j < half ? vnibble_low(vu8(row + j)) : vnibble_high(vu8(row + j - half));
        vstore(w + j - k0, vfma(q, s, m));
    }
}

/* acc[r·T' + t..] (first: from zero) += Σ_k ŵ[r, k]·xt[k, t..] over the slice, for R rows × V·VL tokens. */
static inline __attribute__((always_inline)) void gemm_tile(const float *w, int R, const float *xt, int64_t padded,
                                                             int V, float *acc, int first) {
    vec c[GEMM_R][2];
    for (int r = 0; r < R; r++)
        for (int v = 0; v < V; v++) c[r][v] = first ? vzero() : vload(acc + r * padded + v * VL);
    for (int64_t k = 0; k < GEMM_K; k++) {
        vec x0 = vload(xt + k * padded), x1 = V == 2 ? vload(xt + k * padded + VL) : x0;
        for (int r = 0; r < R; r++) {
            vec wr = vset1(w[r * GEMM_K + k]);
            c[r][0] = vfma(wr, x0, c[r][0]);
            if (V == 2) c[r][1] = vfma(wr, x1, c[r][1]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int v = 0; v < V; v++) vstore(acc + r * padded + v * VL, c[r][v]);
}

#define GEMM_TILE_CASE(R, V) case (R) * 4 + (V): gemm_tile(w, R, xt, padded, V, acc, first); return
#define GEMM_TILE_ROWS(R) GEMM_TILE_CASE(R, 2); GEMM_TILE_CASE(R, 1)
static void gemm_tile_any(const float *w, int R, const float *xt, int64_t padded, int V, float *acc, int first) {
    switch (R * 4 + V) { /* a constant shape for each inlined copy */
    GEMM_TILE_ROWS(6); GEMM_TILE_ROWS(5); GEMM_TILE_ROWS(4); GEMM_TILE_ROWS(3); GEMM_TILE_ROWS(2);
    GEMM_TILE_CASE(1, 2);
    default: gemm_tile(w, 1, xt, padded, 1, acc, first); return;
    }
}

/* Output rows [o0, o1) (at most LINEAR_ROWS) for every token: y[t, o] = Σ_k ŵ_o,k·x_t,k in k order. scratch:
   ŵ's slice [LINEAR_ROWS, GEMM_K], then the accumulators [LINEAR_ROWS, T']. */
static void gemm_rows(const uint8_t *rows, const Format *f, int64_t o0, int64_t o1, const float *xt, int64_t tokens,
                      float *y, int64_t outputs, float *scratch) {
    int64_t h = f->hidden, padded = (tokens + VL - 1) / VL * VL, n = o1 - o0;
    float *w = scratch, *acc = w + LINEAR_ROWS * GEMM_K;
    for (int64_t k0 = 0; k0 < h; k0 += GEMM_K) {
        for (int64_t i = 0; i < n; i++) decode_slice(rows + (o0 + i) * f->proj_bytes, f, k0, w + i * GEMM_K);
        for (int64_t t = 0; t < padded; t += 2 * VL) {
            int V = padded - t >= 2 * VL ? 2 : 1;
            for (int64_t r = 0; r < n; r += GEMM_R) {
                int R = n - r < GEMM_R ? (int)(n - r) : GEMM_R;
                gemm_tile_any(w + r * GEMM_K, R, xt + k0 * padded + t, padded, V, acc + r * padded + t, k0 == 0);
            }
        }
    }
    for (int64_t t = 0; t < tokens; t++)
        for (int64_t i = 0; i < n; i++) y[t * outputs + o0 + i] = acc[i * padded + t];
}

/* Whether a dense call takes gemm_rows: int8 or int4 rows of whole slices, float32 tokens, T ≥ GEMM_FROM. */
static int gemm_shape(const Format *f, const Tokens *x) {
    int64_t h = f->hidden, G = f->group;
    if (!x->vector || x->q8 || x->tokens < GEMM_FROM || h % GEMM_K || G % VL) return 0;
    return f->fmt == FMT_INT8 || (f->fmt == FMT_INT4 && (h / 2) % GEMM_K == 0);
}
#endif

typedef struct {
    const Tokens *x;
    const Format *f;
    const uint8_t *rows; /* O rows, proj_bytes apart */
    float *y, *scratch;
    int64_t outputs, stride;
    const float *xt; /* gemm_shape: x transposed [H, T'] (else NULL) */
    const float *dv, *xgt; /* q8_tile_shape: the tokens' block scale and group sum vectors for dots_q8 (else NULL) */
} Linear;

/* Output rows [32k, 32k + 32): y[t, o] = x_t·ŵ_o. */
static void linear_chunk(void *job, int64_t k, int64_t worker) {
    const Linear *p = job;
    const Tokens *x = p->x;
    int64_t h = p->f->hidden, tokens = x->tokens;
    const Format *f = p->f;
    int64_t o0 = k * LINEAR_ROWS, o1 = o0 + LINEAR_ROWS > p->outputs ? p->outputs : o0 + LINEAR_ROWS;
    float *w = p->scratch + worker * p->stride, *dots = w + (h + 15) / 16 * 16;
#if FMOE_AVX2
    Cursor cursor, *pf = tokens == 1 ? cursor_at(&cursor, f, p->rows + o0 * f->proj_bytes, p->rows + p->outputs * f->proj_bytes) : NULL;
    if (x->q8) { /* int8: 4 rows at a time, int4: 2, sharing the token's loads (each row's sum its own) */
        int64_t o = o0;
        float out[4];
        if (p->dv) { /* several tokens: dots_q8's tiles, two rows × 4 tokens (rows_dot_q8's bits per row and token) */
            float m0[META_FLOATS], m1[META_FLOATS];
            for (; o + 2 <= o1; o += 2) {
                const uint8_t *r0 = p->rows + o * f->proj_bytes, *r1 = r0 + f->proj_bytes;
                fused_meta(r0, f, m0), fused_meta(r1, f, m1);
                dots_q8_rows(r0, r1, f, m0, m1, x, p->dv, p->xgt, p->y + o, p->y + o + 1, p->outputs);
            }
        }
        for (; o + 4 <= o1 && f->fmt == FMT_INT8; o += 4) {
            const uint8_t *rows[4] = {p->rows + o * f->proj_bytes, p->rows + (o + 1) * f->proj_bytes,
                                      p->rows + (o + 2) * f->proj_bytes, p->rows + (o + 3) * f->proj_bytes};
            cursor_step(pf, 4 * f->proj_bytes);
            for (int64_t t = 0; t < tokens; t++) {
                ROWS_DOT_Q8(rows, 4, f, x, t, out);
                for (int r = 0; r < 4; r++) p->y[t * p->outputs + o + r] = out[r];
            }
        }
        for (; o + 2 <= o1; o += 2) {
            const uint8_t *rows[2] = {p->rows + o * f->proj_bytes, p->rows + (o + 1) * f->proj_bytes};
            cursor_step(pf, 2 * f->proj_bytes);
            for (int64_t t = 0; t < tokens; t++) {
                ROWS_DOT_Q8(rows, 2, f, x, t, out);
                p->y[t * p->outputs + o] = out[0], p->y[t * p->outputs + o + 1] = out[1];
            }
        }
        for (; o < o1; o++) {
            const uint8_t *rows[1] = {p->rows + o * f->proj_bytes};
            for (int64_t t = 0; t < tokens; t++) ROWS_DOT_Q8(rows, 1, f, x, t, p->y + t * p->outputs + o);
        }
        return;
    }
#endif
#if FMOE_AVX2
    if (p->xt) { /* many tokens, int8/int4 rows: the tokens in the lanes */
        gemm_rows(p->rows, f, o0, o1, p->xt, tokens, p->y, p->outputs, p->scratch + worker * p->stride);
        return;
    }
    if (tokens == 1 && one_shape(f, x)) { /* decode: two output rows a pass through the experts' gate/up dots (each
        row's sum its own, so the chunking changes no bits; row_dot, the old path, reads ~2-3x the instructions) */
        int64_t o = o0, meta = 2 * (f->proj_bytes - code_bytes(f));
        for (; o + 2 <= o1; o += 2) {
            gate_up_one(p->rows + o * f->proj_bytes, f, x->xf, x->xg, p->y + o, p->y + o + 1, pf);
            cursor_step(pf, meta);
        }
        for (; o < o1; o++) p->y[o] = row_dot(p->rows + o * f->proj_bytes, f, x->xf, x->xg, x->vector);
        return;
    }
    if (tokens > PREFILL_FROM && x->vector) { /* several tokens: DOT_ROWS rows decoded, then register tiles */
        for (int64_t o = o0; o < o1; o += DOT_ROWS) {
            int64_t m = o + DOT_ROWS < o1 ? DOT_ROWS : o1 - o;
            for (int64_t i = 0; i < m; i++) decode_row(p->rows + (o + i) * f->proj_bytes, f, w + i * h, 1);
            dots_rows(w, m, x->xf, tokens, h, p->y + o, 1, p->outputs);
        }
        return;
    }
#endif
    for (int64_t o = o0; o < o1; o++) {
        const uint8_t *row = p->rows + o * f->proj_bytes;
        if (tokens == 1) {
            p->y[o] = row_dot(row, f, x->xf, x->xg, x->vector);
            continue;
        }
        decode_row(row, f, w, x->vector); /* ŵ once, then every token's dot */
        dot_tokens(w, x->xf, tokens, h, dots, x->vector);
        for (int64_t t = 0; t < tokens; t++) p->y[t * p->outputs + o] = dots[t];
    }
}

/* y [T, O] float32 = x [T, H] · ŵᵀ for O rows of one projection each (the expert rows' formats, proj_bytes
   apart), x float32 or bf16; q8: the int8-activation dots where they serve the format. Returns 0, or -1
   when memory runs out. */
int fmoe_linear_forward(int fmt, const uint8_t *rows, int64_t outputs, int64_t hidden, int64_t proj_bytes,
                        int64_t group, int64_t meta_group, const void *x, int x_bf16, int64_t tokens, float *y,
                        int threads, int q8) {
    Format f = format_of(fmt, hidden, proj_bytes, group, meta_group);
    if (threads < 1 || outputs * hidden * tokens < (1 << 16)) threads = 1;
    int64_t stride = tokens > 1 ? (hidden + 15) / 16 * 16 + (tokens + 15) / 16 * 16 : 0; /* ŵ and the dots */
    if (tokens > PREFILL_FROM) stride = DOT_ROWS * ((hidden + 15) / 16 * 16); /* DOT_ROWS rows of ŵ */
    int64_t transposed = 0;
#if FMOE_AVX2
    int64_t padded = (tokens + VL - 1) / VL * VL; /* gemm_rows' T' */
    int64_t gemm_stride = LINEAR_ROWS * (GEMM_K + padded); /* gemm_rows' ŵ slice and accumulators */
    if (tokens >= GEMM_FROM) {
        if (gemm_stride > stride) stride = gemm_stride;
        transposed = hidden * padded;
    }
#endif
    stride = (stride + 15) / 16 * 16; /* each thread's scratch on its own cache lines */
    Tokens xs;
    float *scratch = prepare_tokens(&xs, x, x_bf16, tokens, &f, q8, threads * stride + transposed + q8_scratch_floats(tokens, hidden));
    if (!scratch) return -1;
    Linear job = {&xs, &f, rows, y, scratch, outputs, stride, NULL, NULL, NULL};
#if FMOE_AVX2
    /* dots_q8's tiles: int4 rows; int8 rows where vpdpbusd takes the codes + 128 (with AVX2 alone each row and token
       keeps its sign flip, and rows_dot_q8's 4 rows a token ran faster than 2 rows × 4 tokens: a3b's q rows 0.88–0.95×
       with the tiles, benchmarks/results/2026-11-28-avx2-tiles.md) */
    int q8_tiles = f.fmt == FMT_INT4 || FMOE_AVX_VNNI || q8_wide(&f);
    if (tokens > 1 && q8_tiles && q8_tile_shape(&f, &xs)) { /* dots_q8's vectors, once a call */
        float *dv = scratch + threads * stride + transposed, *xgt = dv + q8_vector_floats(tokens, hidden);
        q8_vectors(&xs, &f, dv), group_sum_vectors(&xs, xgt);
        job.dv = dv, job.xgt = xgt;
    }
#endif
#if FMOE_AVX2
    if (transposed && gemm_shape(&f, &xs)) { /* x [T, H] -> xt [H, T'], the padding's tokens zero */
        float *xt = scratch + threads * stride;
        for (int64_t k = 0; k < hidden; k++) {
            for (int64_t t = 0; t < tokens; t++) xt[k * padded + t] = xs.xf[t * hidden + k];
            for (int64_t t = tokens; t < padded; t++) xt[k * padded + t] = 0.0f;
        }
        job.xt = xt;
    }
#endif
    parallel_chunks((outputs + LINEAR_ROWS - 1) / LINEAR_ROWS, linear_chunk, &job, threads);
    return 0;
}
