/* lowbit's native small-M Linears for CPUs without VNNI (common.h: the shared rules; layers.py: the Python side).
 *
 * One register-blocked kernel gives the exact int32 sums acc[r, c] = Σ_i x[r, i] w[c, i] of u8 codes x and int8
 * weights w (N, K): vpmaddubsw where the u8 × s8 pairs cannot saturate (codes ≤ 127, or saturation-safe weights:
 * `pairs`), else int16 products through vpmaddwd; both exact. A block is NC weight rows × up to 2 input rows held in
 * 8 accumulators; each thread owns whole blocks of columns, in chunks of CB columns whose sums stay in L1 until
 * the chunk's epilogue turns them into the output:
 *   a = acc - zx wsum[c]                              (the input zero point, exact in int32)
 *   mode 0  y = fl(fl(a) sc[c]) (+ bias[c])  (relu: 0 where < 0)                  float32, lowbit's epilogue
 *   mode 1  lowbit's codes of that y: clamp(round(fl(clamp(fl(y inv), vlo, vhi) + z)), 0, 255)
 *   mode 2  fbgemm's requantization (torch's quantized::linear): v = fl(fl(a) + bterm[c]) with
 *           bterm = fl(bias / fl(s_x s_w)), fl(v mult[c]) rounded by cvtps2dq (half to even; INT32_MIN past the
 *           int32 range), saturated to int16, + zo saturated, to [0, 255], then to [lo, hi]
 *   mode 3  the per-token rows: t = fl(fl(a) sc[c]); y = fl(fl(fma(ra[r], fw[c], t)) rs[r]) (+ bias[c])
 */
#include "common.h"

#ifndef NC
#define NC 4          /* weight rows (output columns) per register block */
#endif
#ifndef MR
#define MR 2          /* input rows per register block (MR × NC accumulators) */
#endif
#define CB 64         /* output columns per epilogue chunk (a multiple of NC) */
#define MAX_ROWS 64
#define PF 1024      /* bytes ahead each weight row is prefetched */   /* input rows per call: the chunk's sums live in a (MAX_ROWS, CB) int32 buffer on the stack */

typedef struct {
    const uint8_t *x; int64_t m, k, ldx; int32_t zx; const int16_t *xs; const int8_t *w; const int32_t *wsum;
    int pairs, mode, relu; const float *sc, *bias; float inv, z, vlo, vhi; int32_t zo, lo, hi;
    const float *ra, *rs, *fw; void *out; int64_t ldo, n0, n1; int avx2;
} lin_job;

static int32_t cvt_rne(float f) {  /* cvtps2dq */
    if (!(f >= -2147483648.0f && f < 2147483648.0f)) return INT32_MIN;
    return (int32_t)nearbyintf(f);
}

static int32_t sat16(int32_t v) { return v < -32768 ? -32768 : v > 32767 ? 32767 : v; }

static void store_one(const lin_job *j, int64_t r, int64_t c, int32_t acc) {
    int32_t a = j->zx ? acc - j->zx * j->wsum[c] : acc;
    if (j->mode == 2) {
        float f = (float)a;
        if (j->bias) f = f + j->bias[c];
        int32_t q = sat16(sat16(cvt_rne(f * j->sc[c])) + j->zo);
        q = q < 0 ? 0 : q > 255 ? 255 : q;
        q = q < j->lo ? j->lo : q;
        ((uint8_t *)j->out)[r * j->ldo + c] = (uint8_t)(q > j->hi ? j->hi : q);
        return;
    }
    float t = (float)a * j->sc[c];
    if (j->mode == 3) t = fmaf(j->ra[r], j->fw[c], t) * j->rs[r];
    if (j->bias) t = t + j->bias[c];
    if (j->mode != 1) {
        ((float *)j->out)[r * j->ldo + c] = (j->relu && t < 0.f) ? 0.f : t;
        return;
    }
    float v = t * j->inv;
    v = v < j->vlo ? j->vlo : v;
    v = v > j->vhi ? j->vhi : v;
    float q = nearbyintf(v + j->z);
    q = q < 0.f ? 0.f : q;
    ((uint8_t *)j->out)[r * j->ldo + c] = (uint8_t)(q > 255.f ? 255.f : q);
}

static int32_t dot_scalar(const lin_job *j, int64_t r, int64_t c, int64_t i0) {
    const uint8_t *xr = j->x + r * j->ldx;
    const int8_t *wr = j->w + c * j->k;
    int32_t s = 0;
    for (int64_t i = i0; i < j->k; ++i) s += (int32_t)xr[i] * wr[i];
    return s;
}

/* sums of input rows [r0, r0 + nr) (nr ≤ 2) against weight rows [c0, c0 + NC) into o[r CB + c] */
__attribute__((target("avx2,fma"), always_inline))
static inline void blk_pairs(const lin_job *j, int64_t r0, const int nr, int64_t c0, int32_t *o) {
    const int64_t k = j->k, k32 = k & ~(int64_t)31;
    const int8_t *w = j->w + c0 * k;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i a[MR][NC];
#pragma GCC unroll 4
    for (int r = 0; r < nr; ++r)
#pragma GCC unroll 4
        for (int c = 0; c < NC; ++c) a[r][c] = _mm256_setzero_si256();
    for (int64_t i = 0; i < k32; i += 32) {
        __m256i wv[NC];
#pragma GCC unroll 4
        for (int c = 0; c < NC; ++c) {
            if (!(i & 63)) _mm_prefetch((const char *)(w + c * k + i + PF), _MM_HINT_T0);
            wv[c] = _mm256_loadu_si256((const __m256i *)(w + c * k + i));
        }
#pragma GCC unroll 4
        for (int r = 0; r < nr; ++r) {
            __m256i xv = _mm256_loadu_si256((const __m256i *)(j->x + (r0 + r) * j->ldx + i));
#pragma GCC unroll 4
            for (int c = 0; c < NC; ++c)  /* u8 × s8 pairs into int16 (no saturation: `pairs`), then int32 */
                a[r][c] = _mm256_add_epi32(a[r][c], _mm256_madd_epi16(_mm256_maddubs_epi16(xv, wv[c]), ones));
        }
    }
    for (int r = 0; r < nr; ++r)
        for (int c = 0; c < NC; ++c) o[r * CB + c] = hsum8(a[r][c]) + dot_scalar(j, r0 + r, c0 + c, k32);
}

__attribute__((target("avx2,fma"), always_inline))
static inline void blk_words(const lin_job *j, int64_t r0, const int nr, int64_t c0, int32_t *o) {
    const int64_t k = j->k, k16 = k & ~(int64_t)15;
    const int8_t *w = j->w + c0 * k;
    __m256i a[MR][NC];
#pragma GCC unroll 4
    for (int r = 0; r < nr; ++r)
#pragma GCC unroll 4
        for (int c = 0; c < NC; ++c) a[r][c] = _mm256_setzero_si256();
    for (int64_t i = 0; i < k16; i += 16) {
        __m256i wv[NC];
#pragma GCC unroll 4
        for (int c = 0; c < NC; ++c) wv[c] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + c * k + i)));
#pragma GCC unroll 4
        for (int r = 0; r < nr; ++r) {
            __m256i xv = _mm256_loadu_si256((const __m256i *)(j->xs + (r0 + r) * k + i));
#pragma GCC unroll 4
            for (int c = 0; c < NC; ++c)  /* int16 products summed in pairs into int32: exact for any u8 code */
                a[r][c] = _mm256_add_epi32(a[r][c], _mm256_madd_epi16(xv, wv[c]));
        }
    }
    for (int r = 0; r < nr; ++r)
        for (int c = 0; c < NC; ++c) o[r * CB + c] = hsum8(a[r][c]) + dot_scalar(j, r0 + r, c0 + c, k16);
}

__attribute__((target("avx2,fma")))
static void sums_avx2(const lin_job *j, int64_t c0, int32_t *o) {
    int64_t r = 0;
    if (j->pairs) {
        for (; r + MR <= j->m; r += MR) blk_pairs(j, r, MR, c0, o + r * CB);
        switch (j->m - r) {
            case 3: blk_pairs(j, r, 3 < MR ? 3 : MR, c0, o + r * CB); break;
            case 2: blk_pairs(j, r, 2 < MR ? 2 : MR, c0, o + r * CB); break;
            case 1: blk_pairs(j, r, 1, c0, o + r * CB); break;
        }
    } else {
        for (; r + MR <= j->m; r += MR) blk_words(j, r, MR, c0, o + r * CB);
        switch (j->m - r) {
            case 3: blk_words(j, r, 3 < MR ? 3 : MR, c0, o + r * CB); break;
            case 2: blk_words(j, r, 2 < MR ? 2 : MR, c0, o + r * CB); break;
            case 1: blk_words(j, r, 1, c0, o + r * CB); break;
        }
    }
}

/* the chunk's epilogue, columns [cs, ce) of row r from o = sums + r CB - cs */
__attribute__((target("avx2,fma")))
static void epi_avx2(const lin_job *j, int64_t r, int64_t cs, int64_t ce, const int32_t *o) {
    const __m256 zero = _mm256_setzero_ps();
    const __m256i vzx = _mm256_set1_epi32(j->zx);
    int64_t c = cs;
    for (; c + 8 <= ce; c += 8) {
        __m256i acc = _mm256_loadu_si256((const __m256i *)(o + c));
        if (j->zx) acc = _mm256_sub_epi32(acc, _mm256_mullo_epi32(vzx, _mm256_loadu_si256((const __m256i *)(j->wsum + c))));
        __m256 f = _mm256_cvtepi32_ps(acc);
        if (j->mode == 2) {
            if (j->bias) f = _mm256_add_ps(f, _mm256_loadu_ps(j->bias + c));
            __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(f, _mm256_loadu_ps(j->sc + c)));
            __m256i p = _mm256_adds_epi16(_mm256_packs_epi32(q, q), _mm256_set1_epi16((int16_t)j->zo));
            p = _mm256_packus_epi16(p, p);  /* lane l: its 4 codes in bytes 0-3 */
            p = _mm256_min_epu8(_mm256_max_epu8(p, _mm256_set1_epi8((char)j->lo)), _mm256_set1_epi8((char)j->hi));
            uint8_t *dst = (uint8_t *)j->out + r * j->ldo + c;
            int32_t lo4 = _mm_cvtsi128_si32(_mm256_castsi256_si128(p)), hi4 = _mm_cvtsi128_si32(_mm256_extracti128_si256(p, 1));
            memcpy(dst, &lo4, 4);
            memcpy(dst + 4, &hi4, 4);
            continue;
        }
        __m256 t = _mm256_mul_ps(f, _mm256_loadu_ps(j->sc + c));
        if (j->mode == 3)
            t = _mm256_mul_ps(_mm256_fmadd_ps(_mm256_set1_ps(j->ra[r]), _mm256_loadu_ps(j->fw + c), t), _mm256_set1_ps(j->rs[r]));
        if (j->bias) t = _mm256_add_ps(t, _mm256_loadu_ps(j->bias + c));
        if (j->mode != 1) {
            _mm256_storeu_ps((float *)j->out + r * j->ldo + c, j->relu ? _mm256_max_ps(zero, t) : t);
            continue;
        }
        __m256 v = _mm256_mul_ps(t, _mm256_set1_ps(j->inv));
        v = _mm256_min_ps(_mm256_max_ps(v, _mm256_set1_ps(j->vlo)), _mm256_set1_ps(j->vhi));
        v = _mm256_round_ps(_mm256_add_ps(v, _mm256_set1_ps(j->z)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        __m256i q = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(v, zero), _mm256_set1_ps(255.f)));
        __m128i q16 = _mm_packus_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
        _mm_storel_epi64((__m128i *)((uint8_t *)j->out + r * j->ldo + c), _mm_packus_epi16(q16, q16));
    }
    for (; c < ce; ++c) store_one(j, r, c, o[c]);
}

static void *lin_run(void *p) {
    const lin_job *j = p;
    int32_t buf[MAX_ROWS * CB];
    for (int64_t cs = j->n0; cs < j->n1; cs += CB) {
        const int64_t ce = cs + CB < j->n1 ? cs + CB : j->n1;
        for (int64_t c0 = cs; c0 < ce; c0 += NC) {
            if (j->avx2 && c0 + NC <= ce) {
                sums_avx2(j, c0, buf + (c0 - cs));
                continue;
            }
            for (int64_t c = c0; c < ce && c < c0 + NC; ++c)
                for (int64_t r = 0; r < j->m; ++r) buf[r * CB + (c - cs)] = dot_scalar(j, r, c, 0);
        }
        for (int64_t r = 0; r < j->m; ++r) {
            if (j->avx2) {
                epi_avx2(j, r, cs, ce, buf + r * CB - cs);
                continue;
            }
            for (int64_t c = cs; c < ce; ++c) store_one(j, r, c, buf[r * CB + (c - cs)]);
        }
    }
    return NULL;
}

/* A layer's constants, made once (lowbit.native.gemm.LinearPlan mirrors this layout): int8 weights w (n, k)
 * contiguous, wsum[c] = Σ_i w[c, i] (read only when a call's zx != 0), the mode's per-column vectors (sc / bias;
 * mode 2: mult / bterm; mode 3: fw too; bias may be NULL) and scalars (inv, z, vlo, vhi: mode 1; zo, lo, hi: mode
 * 2). pairs: every u8 × s8 pair sum fits int16 (codes ≤ 127 or saturation-safe weights). */
typedef struct {
    const int8_t *w; const int32_t *wsum; const float *sc, *bias, *fw;
    int64_t k, n; int32_t pairs, mode, relu, zo, lo, hi; float inv, z, vlo, vhi;
} lin_plan;

/* out (m, n), row stride n, from u8 codes x (m, k; row stride ldx; zero point zx) through plan p (ra, rs: mode 3's
 * per-row vectors). Returns 1 when out of memory, 2 when m > MAX_ROWS (nothing written). */
int lb_linear_run(const lin_plan *p, const uint8_t *x, int64_t m, int64_t ldx, int zx, const float *ra,
                  const float *rs, void *out, int nthreads, int isa) {
    if (m > MAX_ROWS) return 2;
    const int avx2 = use_avx2(isa);
    const int64_t k = p->k, n = p->n;
    int16_t *xs = NULL;
    if (avx2 && !p->pairs) {
        xs = malloc(sizeof(int16_t) * (size_t)(m * k > 0 ? m * k : 1));
        if (!xs) return 1;
        for (int64_t r = 0; r < m; ++r)
            for (int64_t i = 0; i < k; ++i) xs[r * k + i] = x[r * ldx + i];
    }
    const int64_t blocks = (n + NC - 1) / NC;
    lin_job jobs[MAX_THREADS];
    int nt = threads_for(nthreads, blocks);
    for (int t = 0; t < nt; ++t) {
        int64_t n0 = blocks * t / nt * NC, n1 = blocks * (t + 1) / nt * NC;
        lin_job jb = {x, m, k, ldx, zx, xs, p->w, p->wsum, p->pairs, p->mode, p->relu, p->sc, p->bias, p->inv, p->z,
                      p->vlo, p->vhi, p->zo, p->lo, p->hi, ra, rs, p->fw, out, n, n0, n1 < n ? n1 : n, avx2};
        jobs[t] = jb;
    }
    fan_out(lin_run, jobs, sizeof(lin_job), nt);
    free(xs);
    return 0;
}

/* ---- the 8-bit dynamic Linear's few-row route without VNNI (nn/quantized/dynamic/per_token._weight_split) ---- */

typedef struct {
    const int16_t *xs; int64_t m, k; const int8_t *w; int64_t n; const float *sw, *a, *wsum, *s, *bias; float *out;
    int64_t n0, n1; int avx2;
} ws_job;

/* fbgemm's two float sums of the split weights (q_w >> 1 on scale 2 s_w, q_w & 1 on s_w), added, then the per-row
 * epilogue: y = fl(fl(fl(t + a w_sum) · s) + bias), the first add rounded once (addcmul_ / add_(alpha)) */
static void ws_store(const ws_job *j, int64_t r, int64_t c, int32_t hi, int32_t lo) {
    float t = (float)hi * (2.0f * j->sw[c]) + (float)lo * j->sw[c];
    t = fmaf(j->a[r], j->wsum[c], t) * j->s[r];
    j->out[r * j->n + c] = j->bias ? t + j->bias[c] : t;
}

static void ws_scalar(ws_job *j) {
    for (int64_t c = j->n0; c < j->n1; ++c)
        for (int64_t r = 0; r < j->m; ++r) {
            int32_t hi = 0, lo = 0;
            for (int64_t i = 0; i < j->k; ++i) {
                int w = j->w[c * j->k + i], x = j->xs[r * j->k + i];
                hi += x * (w >> 1);  /* (arithmetic shift: floor, as torch's bitwise_right_shift) */
                lo += x * (w & 1);
            }
            ws_store(j, r, c, hi, lo);
        }
}

__attribute__((target("avx2,fma")))
static void ws_avx2(ws_job *j) {
    const int64_t k = j->k, k16 = k & ~(int64_t)15;
    const __m256i one = _mm256_set1_epi16(1);
    for (int64_t c = j->n0; c < j->n1; ++c) {
        const int8_t *wr = j->w + c * k;
        for (int64_t r = 0; r < j->m; ++r) {
            const int16_t *xr = j->xs + r * k;
            __m256i ah = _mm256_setzero_si256(), al = _mm256_setzero_si256();
            for (int64_t i = 0; i < k16; i += 16) {  /* q in [0, 255] times halves in [-64, 63] / {0, 1}: exact pairs */
                __m256i w = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(wr + i)));
                __m256i x = _mm256_loadu_si256((const __m256i *)(xr + i));
                ah = _mm256_add_epi32(ah, _mm256_madd_epi16(x, _mm256_srai_epi16(w, 1)));
                al = _mm256_add_epi32(al, _mm256_madd_epi16(x, _mm256_and_si256(w, one)));
            }
            int32_t hi = hsum8(ah), lo = hsum8(al);
            for (int64_t i = k16; i < k; ++i) { hi += xr[i] * (wr[i] >> 1); lo += xr[i] * (wr[i] & 1); }
            ws_store(j, r, c, hi, lo);
        }
    }
}

static void *ws_run(void *p) { ws_job *j = p; if (j->avx2) ws_avx2(j); else ws_scalar(j); return NULL; }

/* out (m, n) float32 = the split-weight route's result for u8 codes q (m, k) (zero point 0: the per-token grids enter
 * through a = -z_x per row and s = s_x per row), int8 weights w (n, k) with scales sw, w_sum = Σ ŵ per column, bias
 * (may be NULL). Returns 1 when out of memory. */
int lb_dyn_wsplit(const uint8_t *q, int64_t m, int64_t k, const int8_t *w, int64_t n, const float *sw, const float *a,
                  const float *wsum, const float *s, const float *bias, float *out, int nthreads, int isa) {
    int16_t *xs = malloc(sizeof(int16_t) * (size_t)(m * k > 0 ? m * k : 1));
    if (!xs) return 1;
    for (int64_t i = 0; i < m * k; ++i) xs[i] = q[i];
    ws_job jobs[MAX_THREADS];
    int nt = threads_for(nthreads, n);
    for (int t = 0; t < nt; ++t) {
        ws_job jb = {xs, m, k, w, n, sw, a, wsum, s, bias, out, n * t / nt, n * (t + 1) / nt, use_avx2(isa)};
        jobs[t] = jb;
    }
    fan_out(ws_run, jobs, sizeof(ws_job), nt);
    free(xs);
    return 0;
}
