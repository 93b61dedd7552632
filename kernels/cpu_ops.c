/* Tandem's native CPU kernels (loaded by kernels/cpu_ops.py, which documents the layouts
 * and builds this file with the system's C compiler, once per machine).
 *
 * Per row, token by token: the token's keys of all KV heads read as one contiguous run, each
 * converted to float once and dotted with the query heads that share it; one softmax per
 * query head; the values likewise; the output rounded once. One entry point for either cache
 * dtype.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_DIM 256

static inline float bf16_to_f32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}
static inline uint16_t f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40);  /* NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u);  /* round to nearest even */
    return (uint16_t)(bits >> 16);
}

/* e^x for x <= 0 (scores minus their max), vectorizable (libm's expf is not, here):
   2^(x log2 e) split into 2^i * 2^f, 2^f by a degree-6 polynomial on [0, 1) (relative error
   ~2e-7), 2^i added to the exponent bits. */
static inline float exp_nonpositive(float x) {
    float t = (x < -87.0f ? -87.0f : x) * 1.4426950409f;
    float fi = floorf(t), f = t - fi;
    float p = 1.5403530e-4f;
    p = p * f + 1.3333558e-3f;
    p = p * f + 9.6181291e-3f;
    p = p * f + 5.5504109e-2f;
    p = p * f + 2.4022651e-1f;
    p = p * f + 6.9314718e-1f;
    p = p * f + 1.0f;
    int32_t bits;
    memcpy(&bits, &p, 4);
    bits += (int32_t)fi * (1 << 23);
    memcpy(&p, &bits, 4);
    return p;
}

/* dim elements at p (bfloat16 or float32) into float. */
static inline void load_row(const void *p, int is_bf16, int64_t dim, float *dst) {
    if (is_bf16) {
        const uint16_t *h = (const uint16_t *)p;
        for (int64_t d = 0; d < dim; d++) dst[d] = bf16_to_f32(h[d]);
    } else {
        memcpy(dst, p, (size_t)dim * 4);
    }
}

/* The bfloat16 products with AVX512-BF16 (when -march=native has it and head_dim is a
   multiple of 32): scores by VDPBF16PS, whose bf16 x bf16 products are exact in float32, for
   16 keys at a time, the 16 partial-sum vectors reduced together by a transpose; values
   converted to float32 once per token and accumulated for up to 4 query heads at once in
   registers. Without it, the plain loops below (the compiler vectorizes them). */
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define TANDEM_BF16_DOT 1

/* v[i] holds 16 partial sums of key i: the result's lane i is their total. */
static inline __attribute__((always_inline)) __m512 sum16(const __m512 *v) {
    __m512 x[8], y[4];
    for (int i = 0; i < 8; i++)
        x[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int j = 0; j < 4; j++) {
        __m512d a = _mm512_castps_pd(x[2 * j]), b = _mm512_castps_pd(x[2 * j + 1]);
        y[j] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    /* y[j]'s 128-bit lane k: keys 4j..4j+3, their sums over lane k of the partials */
    __m512 w0 = _mm512_add_ps(_mm512_shuffle_f32x4(y[0], y[1], _MM_SHUFFLE(2, 0, 2, 0)),
                              _mm512_shuffle_f32x4(y[0], y[1], _MM_SHUFFLE(3, 1, 3, 1)));
    __m512 w1 = _mm512_add_ps(_mm512_shuffle_f32x4(y[2], y[3], _MM_SHUFFLE(2, 0, 2, 0)),
                              _mm512_shuffle_f32x4(y[2], y[3], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(w0, w1, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(w0, w1, _MM_SHUFFLE(3, 1, 3, 1)));
}

/* Scores of one query head (bf16, unscaled) against n <= 16 keys at k (stride s_tok). */
static inline __attribute__((always_inline)) __m512 dot16(const __m512bh *qv, int nq,
                                                          const uint16_t *k, int64_t s_tok,
                                                          int n) {
    __m512 acc[16];
    for (int i = 0; i < 16; i++) {
        const uint16_t *row = k + (i < n ? i : n - 1) * s_tok;  /* past n: a repeat, unused */
        __m512 a = _mm512_setzero_ps();
        for (int c = 0; c < nq; c++)
            a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(row + 32 * c), qv[c]);
        acc[i] = a;
    }
    return sum16(acc);
}

/* Ask for the block's K and V (block_size token rows from each base) to come to L2: the
   blocks of a row lie anywhere in a cache far bigger than L3, so without the hint every
   block starts with a stall the hardware prefetcher cannot see coming. */
static inline void prefetch_block(const uint16_t *kb, const uint16_t *vb, int64_t bytes) {
    for (int64_t off = 0; off < bytes; off += 64) {
        _mm_prefetch((const char *)kb + off, _MM_HINT_T1);
        _mm_prefetch((const char *)vb + off, _MM_HINT_T1);
    }
}

/* Block by block (its keys of every head stay in L1 while each query head takes them),
   prefetching the K and V of the block PREFETCH_BLOCKS ahead. */
#define PREFETCH_BLOCKS 4
static void scores_bf16(const uint16_t *q, int64_t sq_head, const uint16_t *k,
                        const uint16_t *v, int64_t s_block, int64_t s_tok, int64_t s_head,
                        const int64_t *table, int64_t ctx, int64_t block_size,
                        int64_t num_q_heads, int64_t group, int64_t dim, float scale,
                        float *scores) {
    int nq = (int)(dim / 32);
    int64_t num_blocks = (ctx + block_size - 1) / block_size, bytes = block_size * s_tok * 2;
    __m512 sv = _mm512_set1_ps(scale);
    for (int64_t b = 0; b < num_blocks && b < PREFETCH_BLOCKS; b++)
        prefetch_block(k + table[b] * s_block, v + table[b] * s_block, bytes);
    for (int64_t b = 0; b < num_blocks; b++) {
        if (b + PREFETCH_BLOCKS < num_blocks) {
            int64_t ahead = table[b + PREFETCH_BLOCKS] * s_block;
            prefetch_block(k + ahead, v + ahead, bytes);
        }
        const uint16_t *kb = k + table[b] * s_block;
        int64_t end = (b + 1) * block_size < ctx ? (b + 1) * block_size : ctx;
        for (int64_t t0 = b * block_size; t0 < end; t0 += 16) {
            int n = (int)(end - t0 < 16 ? end - t0 : 16);
            const uint16_t *kt = kb + (t0 - b * block_size) * s_tok;
            for (int64_t h = 0; h < num_q_heads; h++) {
                __m512bh qv[MAX_DIM / 32];
                for (int c = 0; c < nq; c++)
                    qv[c] = (__m512bh)_mm512_loadu_si512(q + h * sq_head + 32 * c);
                __m512 s = dot16(qv, nq, kt + (h / group) * s_head, s_tok, n);
                _mm512_mask_storeu_ps(scores + h * ctx + t0, (__mmask16)((1u << n) - 1u),
                                      _mm512_mul_ps(s, sv));
            }
        }
    }
}

static inline __attribute__((always_inline)) __m512 bf16x16(const uint16_t *p) {
    __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}

/* acc[g][0 : 16 * NV] += sum over the n tokens at vt (stride s_tok) of p[g][t] v[t], for G
   query heads sharing one KV head; the accumulators held in registers across the tokens. */
static inline __attribute__((always_inline)) void values_tile(
        const uint16_t *vt, int64_t s_tok, int64_t n, const float *p, int64_t ctx, int G,
        int NV, float *acc, int64_t dim) {
    __m512 o[4][4];
    for (int g = 0; g < G; g++)
        for (int j = 0; j < NV; j++) o[g][j] = _mm512_loadu_ps(acc + g * dim + 16 * j);
    for (int64_t t = 0; t < n; t++) {
        const uint16_t *row = vt + t * s_tok;
        __m512 vf[4];
        for (int j = 0; j < NV; j++) vf[j] = bf16x16(row + 16 * j);
        for (int g = 0; g < G; g++) {
            __m512 pg = _mm512_set1_ps(p[g * ctx + t]);
            for (int j = 0; j < NV; j++) o[g][j] = _mm512_fmadd_ps(pg, vf[j], o[g][j]);
        }
    }
    for (int g = 0; g < G; g++)
        for (int j = 0; j < NV; j++) _mm512_storeu_ps(acc + g * dim + 16 * j, o[g][j]);
}

/* Block by block (the scores pass prefetched them), every query head's accumulators
   updated from the block's values: up to 4 heads and 64 columns at a time. acc is zero. */
static void values_bf16(const uint16_t *v, int64_t s_block, int64_t s_tok, int64_t s_head,
                        const int64_t *table, int64_t ctx, int64_t block_size,
                        int64_t num_q_heads, int64_t group, int64_t dim, const float *scores,
                        float *acc) {
    int64_t num_blocks = (ctx + block_size - 1) / block_size;
    for (int64_t b = 0; b < num_blocks; b++) {
        const uint16_t *vb = v + table[b] * s_block;
        int64_t t0 = b * block_size, n = ctx - t0 < block_size ? ctx - t0 : block_size;
        for (int64_t h0 = 0; h0 < num_q_heads;) {
            int64_t kv = h0 / group, left = (kv + 1) * group - h0;  /* this KV head's rest */
            int G = (int)(left < 4 ? left : 4);
            for (int64_t d0 = 0; d0 < dim; d0 += 64) {
                int NV = dim - d0 >= 64 ? 4 : 2;  /* dim is a multiple of 32 */
                const uint16_t *vt = vb + kv * s_head + d0;
                const float *p = scores + h0 * ctx + t0;
                float *a = acc + h0 * dim + d0;
                /* constant G and NV: the accumulators stay in registers */
#define TILE(g, nv) values_tile(vt, s_tok, n, p, ctx, g, nv, a, dim)
                switch (G * 8 + NV) {
                case 12: TILE(1, 4); break;
                case 20: TILE(2, 4); break;
                case 28: TILE(3, 4); break;
                case 36: TILE(4, 4); break;
                case 10: TILE(1, 2); break;
                case 18: TILE(2, 2); break;
                case 26: TILE(3, 2); break;
                default: TILE(4, 2); break;
                }
#undef TILE
            }
            h0 += G;
        }
    }
}
#endif

/* One row: every query head over its ctx keys. Token by token, the token's keys of every
   KV head are read together (one contiguous run of the cache: the read streams), each
   converted once and dotted with the query heads that share it; one softmax per query head;
   then the values the same way, accumulated for every query head. Scratch (float32):
   qf and acc [num_q_heads][dim], scores [num_q_heads][ctx]. vector: take the AVX512-BF16
   path when the library has it (bfloat16, dim a multiple of 32). The first `skip` keys
   are read but take no weight (a sliding window that starts inside the table's first
   block); sinks (NULL: none): one logit per query head added to its softmax's
   denominator. */
static void decode_row(const void *q, int64_t sq_head, const char *k, const char *v,
                       int is_bf16, int64_t elem, int64_t s_block, int64_t s_tok,
                       int64_t s_head, const int64_t *table, int64_t ctx, int64_t block_size,
                       int64_t num_q_heads, int64_t num_kv_heads, int64_t dim, float scale,
                       int vector, int64_t skip, const float *sinks, float *qf, float *acc,
                       float *scores, void *out) {
    int64_t group = num_q_heads / num_kv_heads;
    float row[MAX_DIM];
#ifdef TANDEM_BF16_DOT
    vector = vector && is_bf16 && dim % 32 == 0;
    if (vector)
        scores_bf16((const uint16_t *)q, sq_head, (const uint16_t *)k, (const uint16_t *)v,
                    s_block, s_tok, s_head, table, ctx, block_size, num_q_heads, group, dim,
                    scale, scores);
#else
    vector = 0;
#endif
    if (!vector) {
        for (int64_t h = 0; h < num_q_heads; h++) {
            for (int64_t d = 0; d < dim; d++)
                qf[h * dim + d] =
                    scale * (is_bf16 ? bf16_to_f32(((const uint16_t *)q)[h * sq_head + d])
                                     : ((const float *)q)[h * sq_head + d]);
        }
        for (int64_t t = 0; t < ctx; t++) {
            int64_t base = table[t / block_size] * s_block + (t % block_size) * s_tok;
            for (int64_t kv = 0; kv < num_kv_heads; kv++) {
                load_row(k + (base + kv * s_head) * elem, is_bf16, dim, row);
                for (int64_t g = 0; g < group; g++) {
                    const float *qh = qf + (kv * group + g) * dim;
                    float s = 0.0f;
                    for (int64_t d = 0; d < dim; d++) s += qh[d] * row[d];
                    scores[(kv * group + g) * ctx + t] = s;
                }
            }
        }
    }
    for (int64_t h = 0; h < num_q_heads; h++) {
        float *sh = scores + h * ctx, m = -INFINITY, sum = 0.0f;
        for (int64_t t = skip; t < ctx; t++) m = sh[t] > m ? sh[t] : m;
        if (sinks != NULL) m = sinks[h] > m ? sinks[h] : m;
        for (int64_t t = 0; t < skip; t++) sh[t] = 0.0f;
        for (int64_t t = skip; t < ctx; t++) sh[t] = exp_nonpositive(sh[t] - m);
        for (int64_t t = skip; t < ctx; t++) sum += sh[t];
        if (sinks != NULL) sum += exp_nonpositive(sinks[h] - m);
        float inv = 1.0f / sum;
        for (int64_t t = 0; t < ctx; t++) sh[t] *= inv;
        for (int64_t d = 0; d < dim; d++) acc[h * dim + d] = 0.0f;
    }
#ifdef TANDEM_BF16_DOT
    if (vector)
        values_bf16((const uint16_t *)v, s_block, s_tok, s_head, table, ctx, block_size,
                    num_q_heads, group, dim, scores, acc);
#endif
    if (!vector) {
        for (int64_t t = 0; t < ctx; t++) {
            int64_t base = table[t / block_size] * s_block + (t % block_size) * s_tok;
            for (int64_t kv = 0; kv < num_kv_heads; kv++) {
                load_row(v + (base + kv * s_head) * elem, is_bf16, dim, row);
                for (int64_t g = 0; g < group; g++) {
                    int64_t h = kv * group + g;
                    float p = scores[h * ctx + t];
                    float *o = acc + h * dim;
                    for (int64_t d = 0; d < dim; d++) o[d] += p * row[d];
                }
            }
        }
    }
    for (int64_t i = 0; i < num_q_heads * dim; i++) {
        if (is_bf16) ((uint16_t *)out)[i] = f32_to_bf16(acc[i]);
        else ((float *)out)[i] = acc[i];
    }
}

/* 1 when this build has the AVX512-BF16 path. */
int tandem_has_bf16_dot(void) {
#ifdef TANDEM_BF16_DOT
    return 1;
#else
    return 0;
#endif
}

/* q [rows][num_q_heads][dim] (strides sq_row, sq_head; dim contiguous), caches with strides
   s_block, s_tok, s_head (dim contiguous), tables [rows][s_table] int64 of which the first
   table_width entries are valid, context_lens [rows]; out [rows][num_q_heads][dim]
   contiguous; is_bf16: the caches' (and q's, out's) element type, bfloat16, else float32.
   window > 0: a sliding layer's, only a row's last `window` keys are attended (its blocks
   before them never read); sinks: NULL, or [num_q_heads] logits (gpt-oss).
   Returns 0; -1 for a head_dim past MAX_DIM, -2 for a context length outside
   [1, table_width * block_size] (nothing is read), -3 when scratch cannot be allocated. */
int tandem_decode_attention(const void *q, int64_t sq_row, int64_t sq_head, const void *k,
                  const void *v, int64_t s_block, int64_t s_tok, int64_t s_head,
                  const int64_t *tables, int64_t s_table, int64_t table_width,
                  const int64_t *context_lens, int64_t rows, int64_t num_q_heads,
                  int64_t num_kv_heads, int64_t dim, int64_t block_size, float scale,
                  void *out, int is_bf16, int vector, int64_t window, const float *sinks) {
    int64_t elem = is_bf16 ? 2 : 4, max_ctx = 0;
    if (dim > MAX_DIM) return -1;
    for (int64_t r = 0; r < rows; r++) {
        if (context_lens[r] < 1 || context_lens[r] > table_width * block_size) return -2;
        if (context_lens[r] > max_ctx) max_ctx = context_lens[r];
    }
    /* one row at a time: its scaled queries, accumulators and scores */
    size_t scratch_floats = (size_t)(num_q_heads * (2 * dim + max_ctx));
    float *scratch = (float *)malloc(sizeof(float) * scratch_floats);
    if (scratch == NULL) return -3;
    float *qf = scratch, *acc = scratch + num_q_heads * dim, *scores = acc + num_q_heads * dim;
    for (int64_t r = 0; r < rows; r++) {
        const char *qr = (const char *)q + r * sq_row * elem;
        char *outr = (char *)out + r * num_q_heads * dim * elem;
        /* a window reads from the block holding its first key: the table and the context
           start there, the keys before the window in that block skipped */
        int64_t ctx = context_lens[r];
        int64_t first = window > 0 && ctx > window ? ctx - window : 0;
        int64_t first_block = first / block_size, start = first_block * block_size;
        decode_row(qr, sq_head, (const char *)k, (const char *)v, is_bf16, elem, s_block,
                   s_tok, s_head, tables + r * s_table + first_block, ctx - start,
                   block_size, num_q_heads, num_kv_heads, dim, scale, vector, first - start,
                   sinks, qf, acc, scores, outr);
    }
    free(scratch);
    return 0;
}

/* The residual stream's add and HF's RMSNorm over bfloat16 rows, fused: per row
   h += y (rounded), then out = w * bf16(h * rsqrt(mean(h^2) + eps)) in transformers' order
   (the normalized row rounded before the weight multiplies it). y may be NULL (no add). */
void tandem_add_rms_norm_bf16(uint16_t *h, const uint16_t *y, const uint16_t *w,
                              uint16_t *out, int64_t rows, int64_t dim, float eps) {
    float hf[4096];
    for (int64_t r = 0; r < rows; r++) {
        uint16_t *hr = h + r * dim, *outr = out + r * dim;
        float sq = 0.0f;
        for (int64_t c = 0; c < dim; c += 4096) {
            int64_t n = dim - c < 4096 ? dim - c : 4096;
            for (int64_t i = 0; i < n; i++) {
                float x = bf16_to_f32(hr[c + i]);
                if (y) {
                    x = bf16_to_f32(f32_to_bf16(x + bf16_to_f32(y[r * dim + c + i])));
                    hr[c + i] = f32_to_bf16(x);
                }
                hf[i] = x;
                sq += x * x;
            }
        }
        float inv = 1.0f / sqrtf(sq / (float)dim + eps);
        for (int64_t i = 0; i < dim; i++) {
            float normed = bf16_to_f32(f32_to_bf16(bf16_to_f32(hr[i]) * inv));
            outr[i] = f32_to_bf16(bf16_to_f32(w[i]) * normed);
        }
    }
}

/* HF's rotate-half RoPE over bfloat16 heads, in torch's roundings: out = bf16(bf16(x * cos)
   + bf16(rotate_half(x) * sin)), rotate_half(x) = [-x[half:], x[:half]]. x: [rows][heads][dim]
   with strides (sx_row, sx_head), dim contiguous; cos, sin: [rows][dim]; out contiguous. */
void tandem_rope_bf16(const uint16_t *x, int64_t sx_row, int64_t sx_head, const uint16_t *cos,
                      const uint16_t *sin, uint16_t *out, int64_t rows, int64_t heads,
                      int64_t dim) {
    int64_t half = dim / 2;
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *c = cos + r * dim, *s = sin + r * dim;
        for (int64_t h = 0; h < heads; h++) {
            const uint16_t *xh = x + r * sx_row + h * sx_head;
            uint16_t *o = out + (r * heads + h) * dim;
            for (int64_t i = 0; i < dim; i++) {
                float xi = bf16_to_f32(xh[i]);
                float rot = i < half ? -bf16_to_f32(xh[i + half]) : bf16_to_f32(xh[i - half]);
                float a = bf16_to_f32(f32_to_bf16(xi * bf16_to_f32(c[i])));
                float b = bf16_to_f32(f32_to_bf16(rot * bf16_to_f32(s[i])));
                o[i] = f32_to_bf16(a + b);
            }
        }
    }
}
