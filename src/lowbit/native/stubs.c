/* lowbit's Quantize / DeQuantize stub passes (nn/quantized/stubs.py): float32 -> 8-bit codes and back, one pass each,
 * elementwise over memory (common.h: the shared rules). Scalar, AVX2 and AVX-512 bodies with the same results. */
#include "common.h"

/* ---- the Quantize stub's per-tensor quantize (NaN check, v = x inv, clamp, codes) ---- */

typedef struct { const float *x; void *out; int64_t i0, i1; float inv, z, vlo, vhi, smin, smax; int sgn, body, nan; } qt_job;

static void qt_scalar(qt_job *j) {
    for (int64_t i = j->i0; i < j->i1; ++i) {
        float x = j->x[i];
        if (x != x) { j->nan = 1; return; }
        float v = x * j->inv;
        v = v < j->vlo ? j->vlo : v;
        v = v > j->vhi ? j->vhi : v;
        float r = nearbyintf(v + j->z);
        r = r < j->smin ? j->smin : r;
        r = r > j->smax ? j->smax : r;
        if (j->sgn) ((int8_t *)j->out)[i] = (int8_t)r; else ((uint8_t *)j->out)[i] = (uint8_t)r;
    }
}

/* The two clamps as one: with integer z, smin, smax, round(fl(v + z)) is monotone in v and maps smin - z to smin and
 * smax - z to smax, so clamp(round(fl(clamp(t, vlo, vhi) + z)), smin, smax) = round(fl(clamp(t, lo, hi) + z)) with
 * lo = max(vlo, smin - z), hi = min(vhi, smax - z) where those overlap (else every code is the one end both give:
 * lo = hi = smin - z when vhi < smin - z, smax - z when vlo > smax - z). */
static void qt_bounds(const qt_job *j, float *lo, float *hi) {
    float l = j->vlo > j->smin - j->z ? j->vlo : j->smin - j->z, h = j->vhi < j->smax - j->z ? j->vhi : j->smax - j->z;
    if (l > h) l = h = j->vhi < j->smin - j->z ? j->smin - j->z : j->smax - j->z;
    *lo = l; *hi = h;
}

/* the elements a vector body left (i0 on), scalar; the NaN flag of the whole chunk */
static void qt_tail(qt_job *j, int64_t i0, int nan) {
    if (nan) { j->nan = 1; return; }
    qt_job t = *j;
    t.i0 = i0;
    qt_scalar(&t);
    j->nan = t.nan;
}

/* cvtps2dq rounds half to even (the default MXCSR, as nearbyintf) a value already in [smin, smax]; the NaN check is
 * one OR over the chunk, read at its end. */
__attribute__((target("avx2,fma")))
static void qt_avx2(qt_job *j) {
    const float *restrict x = j->x;
    uint8_t *restrict out = j->out;
    const int64_t i1 = j->i1;
    const int sgn = j->sgn;
    float lo, hi;
    qt_bounds(j, &lo, &hi);
    const __m256 inv = _mm256_set1_ps(j->inv), z = _mm256_set1_ps(j->z), vlo = _mm256_set1_ps(lo), vhi = _mm256_set1_ps(hi);
    __m256 nan = _mm256_setzero_ps();
    int64_t i = j->i0;
    for (; i + 16 <= i1; i += 16) {
        const __m256 x0 = _mm256_loadu_ps(x + i), x1 = _mm256_loadu_ps(x + i + 8);
        nan = _mm256_or_ps(nan, _mm256_or_ps(_mm256_cmp_ps(x0, x0, _CMP_UNORD_Q), _mm256_cmp_ps(x1, x1, _CMP_UNORD_Q)));
        const __m256 v0 = _mm256_min_ps(_mm256_max_ps(_mm256_mul_ps(x0, inv), vlo), vhi);
        const __m256 v1 = _mm256_min_ps(_mm256_max_ps(_mm256_mul_ps(x1, inv), vlo), vhi);
        const __m256i q0 = _mm256_cvtps_epi32(_mm256_add_ps(v0, z)), q1 = _mm256_cvtps_epi32(_mm256_add_ps(v1, z));
        __m256i p = _mm256_packs_epi32(q0, q1);  /* lanes: q0[0-3] q1[0-3] | q0[4-7] q1[4-7] (int16, exact) */
        p = _mm256_permute4x64_epi64(p, 0xd8);   /* q0[0-7] q1[0-7] */
        const __m128i a = _mm256_castsi256_si128(p), b = _mm256_extracti128_si256(p, 1);
        _mm_storeu_si128((__m128i *)(out + i), sgn ? _mm_packs_epi16(a, b) : _mm_packus_epi16(a, b));
    }
    qt_tail(j, i, _mm256_movemask_ps(nan));
}

/* The same steps 32 floats at a time; the int32 codes are already in [smin, smax], so vpmovdb's truncation to the low
 * byte is the code in either storage (two's complement int8, or uint8). */
__attribute__((target("avx512f")))
static void qt_avx512(qt_job *j) {
    const float *restrict x = j->x;
    uint8_t *restrict out = j->out;
    const int64_t i1 = j->i1;
    float lo, hi;
    qt_bounds(j, &lo, &hi);
    const __m512 inv = _mm512_set1_ps(j->inv), z = _mm512_set1_ps(j->z), vlo = _mm512_set1_ps(lo), vhi = _mm512_set1_ps(hi);
    __mmask16 nan = 0;
    int64_t i = j->i0;
    for (; i + 32 <= i1; i += 32) {
        const __m512 x0 = _mm512_loadu_ps(x + i), x1 = _mm512_loadu_ps(x + i + 16);
        nan |= _mm512_cmp_ps_mask(x0, x0, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(x1, x1, _CMP_UNORD_Q);
        const __m512 v0 = _mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(x0, inv), vlo), vhi);
        const __m512 v1 = _mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(x1, inv), vlo), vhi);
        _mm_storeu_si128((__m128i *)(out + i), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_add_ps(v0, z))));
        _mm_storeu_si128((__m128i *)(out + i + 16), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_add_ps(v1, z))));
    }
    qt_tail(j, i, nan != 0);
}

static void *qt_run(void *p) {
    qt_job *j = p;
    if (j->body == 2) qt_avx512(j); else if (j->body == 1) qt_avx2(j); else qt_scalar(j);
    return NULL;
}

/* out[i] = clamp(round(fl(clamp(fl(x inv), vlo, vhi) + z)), smin, smax) (int8 if sgn, else uint8) for n floats;
 * returns 1 (out partly written) if some x is NaN. */
int lb_quantize(const float *x, int64_t n, float inv, float z, float vlo, float vhi, int sgn, void *out, int nthreads,
                int isa) {
    qt_job jobs[MAX_THREADS];
    int nt = threads_for(nthreads, n), nan = 0;
    for (int t = 0; t < nt; ++t) {
        qt_job jb = {x, out, n * t / nt, n * (t + 1) / nt, inv, z, vlo, vhi, sgn ? -128.f : 0.f, sgn ? 127.f : 255.f,
                     sgn, body_of(isa), 0};
        jobs[t] = jb;
    }
    fan_out(qt_run, jobs, sizeof(qt_job), nt);
    for (int t = 0; t < nt; ++t) nan |= jobs[t].nan;
    return nan;
}

/* ---- the DeQuantize stub's per-tensor dequantize: out = fl(fl(q - z) s), torch's dequantize (q - z is exact) ---- */

typedef struct { const void *q; float *out; int64_t i0, i1; float z, s; int sgn, body; } dq_job;

static void dq_scalar(const dq_job *j) {
    const uint8_t *u = j->q;
    const int8_t *s8 = j->q;
    for (int64_t i = j->i0; i < j->i1; ++i) j->out[i] = ((j->sgn ? (float)s8[i] : (float)u[i]) - j->z) * j->s;
}

/* the codes a vector body left (i on), scalar */
static void dq_rest(const dq_job *j, int64_t i) {
    dq_job t = *j;
    t.i0 = i;
    dq_scalar(&t);
}

/* The same steps 16 (AVX2) or 32 (AVX-512) codes at a time: widened to int32, converted (exact), q - z, times s. */
__attribute__((target("avx2,fma")))
static void dq_avx2(const dq_job *j) {
    const uint8_t *restrict q = j->q;
    float *restrict out = j->out;
    const __m256 z = _mm256_set1_ps(j->z), s = _mm256_set1_ps(j->s);
    int64_t i = j->i0;
    for (; i + 16 <= j->i1; i += 16) {
        const __m128i b = _mm_loadu_si128((const __m128i *)(q + i));
        const __m128i hi = _mm_unpackhi_epi64(b, b);
        const __m256i c0 = j->sgn ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b);
        const __m256i c1 = j->sgn ? _mm256_cvtepi8_epi32(hi) : _mm256_cvtepu8_epi32(hi);
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_sub_ps(_mm256_cvtepi32_ps(c0), z), s));
        _mm256_storeu_ps(out + i + 8, _mm256_mul_ps(_mm256_sub_ps(_mm256_cvtepi32_ps(c1), z), s));
    }
    dq_rest(j, i);
}

__attribute__((target("avx512f")))
static void dq_avx512(const dq_job *j) {
    const uint8_t *restrict q = j->q;
    float *restrict out = j->out;
    const __m512 z = _mm512_set1_ps(j->z), s = _mm512_set1_ps(j->s);
    int64_t i = j->i0;
    for (; i + 32 <= j->i1; i += 32) {
        const __m128i b0 = _mm_loadu_si128((const __m128i *)(q + i)), b1 = _mm_loadu_si128((const __m128i *)(q + i + 16));
        const __m512i c0 = j->sgn ? _mm512_cvtepi8_epi32(b0) : _mm512_cvtepu8_epi32(b0);
        const __m512i c1 = j->sgn ? _mm512_cvtepi8_epi32(b1) : _mm512_cvtepu8_epi32(b1);
        _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(c0), z), s));
        _mm512_storeu_ps(out + i + 16, _mm512_mul_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(c1), z), s));
    }
    dq_rest(j, i);
}

static void *dq_run(void *p) {
    const dq_job *j = p;
    if (j->body == 2) dq_avx512(j); else if (j->body == 1) dq_avx2(j); else dq_scalar(j);
    return NULL;
}

/* out[i] = fl(fl(q[i] - z) s) for n codes (int8 if sgn, else uint8) */
void lb_dequantize(const void *q, int64_t n, int sgn, float z, float s, float *out, int nthreads, int isa) {
    dq_job jobs[MAX_THREADS];
    int nt = threads_for(nthreads, n);
    for (int t = 0; t < nt; ++t) {
        dq_job jb = {q, out, n * t / nt, n * (t + 1) / nt, z, s, sgn, body_of(isa)};
        jobs[t] = jb;
    }
    fan_out(dq_run, jobs, sizeof(dq_job), nt);
}
