/* lowbit's native row, conv and elementwise passes (common.h: the shared rules; linear.c: the Linears). */
#include "common.h"

typedef struct {
    const float *x; int64_t k, ldx, ldo; float levels, eps, qmax; int mode; void *out;
    float *scale, *negzp; int64_t r0, r1; int body, bad, bw;  /* body: body_of; bw: codes64_avx512bw runs */
} grid_job;

typedef struct {
    float *raw; int64_t n, ldr; const float *a, *w, *s, *bias; int fused; int64_t r0, r1; int body;  /* body_of */
} epi_job;

/* (s, -z) of one row from lo = min(x, 0), hi = max(x, 0): _row_grids' float32 arithmetic. 1: not finite. */
static int row_grid(float lo, float hi, float levels, float eps, float *s, float *nz) {
    float width = hi - lo;
    if (!(width < INFINITY)) return 1;
    float sc = width / levels;
    sc = sc < eps ? eps : sc;
    *s = sc;
    *nz = nearbyintf(lo / sc);
    return 0;
}

static void out_tail(const grid_job *j, const float *xr, int64_t m, int64_t i0, float inv, float nz) {
    if (j->mode == 0) {
        float *o = (float *)j->out + m * j->ldo;
        for (int64_t i = i0; i < j->k; ++i) { float v = xr[i] * inv - nz; o[i] = v > j->qmax ? j->qmax : v; }
    } else {
        uint8_t *o = (uint8_t *)j->out + m * j->ldo;
        for (int64_t i = i0; i < j->k; ++i) {
            float v = nearbyintf(xr[i] * inv - nz);
            v = v < 0.f ? 0.f : v;
            o[i] = (uint8_t)(v > j->qmax ? j->qmax : v);
        }
    }
}

static void grid_scalar(grid_job *j) {
    for (int64_t m = j->r0; m < j->r1; ++m) {
        const float *xr = j->x + m * j->ldx;
        float lo = 0.f, hi = 0.f, s, nz;
        int bad = 0;
        for (int64_t i = 0; i < j->k; ++i) {
            float v = xr[i];
            bad |= bad_bits(v); lo = v < lo ? v : lo; hi = v > hi ? v : hi;
        }
        if (bad || row_grid(lo, hi, j->levels, j->eps, &s, &nz)) { j->bad = 1; return; }
        j->scale[m] = s; j->negzp[m] = nz;
        out_tail(j, xr, m, 0, 1.0f / s, nz);
    }
}

__attribute__((target("avx2,fma")))
static void grid_avx2(grid_job *j) {
    const __m256i expo = _mm256_set1_epi32(0x7f800000);
    const int64_t k = j->k, k8 = k & ~(int64_t)7;
    for (int64_t m = j->r0; m < j->r1; ++m) {
        const float *xr = j->x + m * j->ldx;
        __m256 vlo = _mm256_setzero_ps(), vhi = _mm256_setzero_ps();
        __m256i vbad = _mm256_setzero_si256();
        for (int64_t i = 0; i < k8; i += 8) {
            __m256 v = _mm256_loadu_ps(xr + i);
            vbad = _mm256_or_si256(vbad, _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_castps_si256(v), expo), expo));
            vlo = _mm256_min_ps(v, vlo);  /* a NaN lane keeps the running value: the bits check catches it */
            vhi = _mm256_max_ps(v, vhi);
        }
        float l8[8], h8[8], lo = 0.f, hi = 0.f, s, nz;
        _mm256_storeu_ps(l8, vlo); _mm256_storeu_ps(h8, vhi);
        int bad = !_mm256_testz_si256(vbad, vbad);
        for (int t = 0; t < 8; ++t) { lo = l8[t] < lo ? l8[t] : lo; hi = h8[t] > hi ? h8[t] : hi; }
        for (int64_t i = k8; i < k; ++i) { float v = xr[i]; bad |= bad_bits(v); lo = v < lo ? v : lo; hi = v > hi ? v : hi; }
        if (bad || row_grid(lo, hi, j->levels, j->eps, &s, &nz)) { j->bad = 1; return; }
        j->scale[m] = s; j->negzp[m] = nz;
        const float inv = 1.0f / s;
        const __m256 vinv = _mm256_set1_ps(inv), vnz = _mm256_set1_ps(nz), vq = _mm256_set1_ps(j->qmax);
        if (j->mode == 0) {
            float *o = (float *)j->out + m * j->ldo;
            for (int64_t i = 0; i < k8; i += 8) {
                __m256 v = _mm256_sub_ps(_mm256_mul_ps(_mm256_loadu_ps(xr + i), vinv), vnz);
                _mm256_storeu_ps(o + i, _mm256_min_ps(v, vq));
            }
        } else {
            uint8_t *o = (uint8_t *)j->out + m * j->ldo;
            const __m256 zero = _mm256_setzero_ps();
            for (int64_t i = 0; i < k8; i += 8) {
                __m256 v = _mm256_sub_ps(_mm256_mul_ps(_mm256_loadu_ps(xr + i), vinv), vnz);
                v = _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                __m256i q = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(v, zero), vq));
                __m128i q16 = _mm_packus_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
                _mm_storel_epi64((__m128i *)(o + i), _mm_packus_epi16(q16, q16));
            }
        }
        out_tail(j, xr, m, k8, inv, nz);
    }
}

static inline int cpu_avx512bw(void) {
    static int known = -1;
    if (known < 0) { __builtin_cpu_init(); known = cpu_avx512() && __builtin_cpu_supports("avx512bw"); }
    return known;
}

/* grid_avx512's u8 codes of one row on whole 64-float blocks (AVX-512BW): the same per-lane float steps and rounding
 * conversion, four vectors' int32 codes (already inside [0, qmax], qmax <= 255) narrowed by two saturating packs that
 * change no value and one lane permutation, one 64-byte store in place of four masked narrowing stores (~10% of the
 * pass at 512 x 384). Returns the number of codes written (a multiple of 64). */
__attribute__((target("avx512f,avx512bw")))
static int64_t codes64_avx512bw(const float *xr, int64_t k, float inv, float nz, float qmax, uint8_t *o) {
    const __m512 vinv = _mm512_set1_ps(inv), vnz = _mm512_set1_ps(nz), vq = _mm512_set1_ps(qmax);
    const __m512 zero = _mm512_setzero_ps();
    const __m512i perm = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
    const int64_t k64 = k & ~(int64_t)63;
    for (int64_t i = 0; i < k64; i += 64) {
        __m512i q[4];
        for (int u = 0; u < 4; ++u) {
            __m512 v = _mm512_sub_ps(_mm512_mul_ps(_mm512_loadu_ps(xr + i + 16 * u), vinv), vnz);
            v = _mm512_min_ps(_mm512_max_ps(v, zero), vq);
            q[u] = _mm512_cvt_roundps_epi32(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        }
        const __m512i b8 = _mm512_packus_epi16(_mm512_packus_epi32(q[0], q[1]), _mm512_packus_epi32(q[2], q[3]));
        _mm512_storeu_si512(o + i, _mm512_permutexvar_epi32(perm, b8));
    }
    return k64;
}

/* grid_avx2 on 16 lanes (use_avx512; session 31: ~20 GB/s → see benchmarks/README, MiniLM's 512×384 rows on Zen 5):
 * two min and two max chains, the tail as masked loads (zeros: min(·, 0) and max(·, 0) are unchanged by them), the
 * codes clamped to [0, qmax] before the conversion rounds half to even (the bounds are integers: the same codes as
 * grid_avx2's round then clamp) and stored by the saturating u32 → u8 narrowing, the tail masked. */
__attribute__((target("avx512f")))
static void grid_avx512(grid_job *j) {
    const __m512i expo = _mm512_set1_epi32(0x7f800000);
    const int64_t k = j->k, k32 = k & ~(int64_t)31, k16 = k & ~(int64_t)15;
    const __mmask16 tail = (__mmask16)((1u << (k - k16)) - 1u);
    for (int64_t m = j->r0; m < j->r1; ++m) {
        const float *xr = j->x + m * j->ldx;
        __m512 lo0 = _mm512_setzero_ps(), hi0 = lo0, lo1 = lo0, hi1 = lo0;
        __mmask16 bad = 0;
        int64_t i = 0;
        for (; i < k32; i += 32) {
            const __m512 a = _mm512_loadu_ps(xr + i), b = _mm512_loadu_ps(xr + i + 16);
            bad |= _mm512_cmpeq_epi32_mask(_mm512_and_si512(_mm512_castps_si512(a), expo), expo)
                 | _mm512_cmpeq_epi32_mask(_mm512_and_si512(_mm512_castps_si512(b), expo), expo);
            lo0 = _mm512_min_ps(a, lo0); hi0 = _mm512_max_ps(a, hi0);  /* (a NaN lane keeps the running value) */
            lo1 = _mm512_min_ps(b, lo1); hi1 = _mm512_max_ps(b, hi1);
        }
        for (; i < k; i += 16) {
            const __m512 a = _mm512_maskz_loadu_ps(i < k16 ? (__mmask16)0xFFFF : tail, xr + i);
            bad |= _mm512_cmpeq_epi32_mask(_mm512_and_si512(_mm512_castps_si512(a), expo), expo);
            lo0 = _mm512_min_ps(a, lo0); hi0 = _mm512_max_ps(a, hi0);
        }
        float s, nz;
        const float lo = _mm512_reduce_min_ps(_mm512_min_ps(lo0, lo1)), hi = _mm512_reduce_max_ps(_mm512_max_ps(hi0, hi1));
        if (bad || row_grid(lo, hi, j->levels, j->eps, &s, &nz)) { j->bad = 1; return; }
        j->scale[m] = s; j->negzp[m] = nz;
        const float inv = 1.0f / s;
        const __m512 vinv = _mm512_set1_ps(inv), vnz = _mm512_set1_ps(nz), vq = _mm512_set1_ps(j->qmax);
        if (j->mode == 0) {
            float *o = (float *)j->out + m * j->ldo;
            for (i = 0; i < k; i += 16) {
                const __mmask16 mk = i < k16 ? (__mmask16)0xFFFF : tail;
                const __m512 v = _mm512_sub_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(mk, xr + i), vinv), vnz);
                _mm512_mask_storeu_ps(o + i, mk, _mm512_min_ps(v, vq));
            }
        } else {
            uint8_t *o = (uint8_t *)j->out + m * j->ldo;
            const __m512 zero = _mm512_setzero_ps();
            for (i = j->bw ? codes64_avx512bw(xr, k, inv, nz, j->qmax, o) : 0; i < k; i += 16) {
                const __mmask16 mk = i < k16 ? (__mmask16)0xFFFF : tail;
                __m512 v = _mm512_sub_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(mk, xr + i), vinv), vnz);
                v = _mm512_min_ps(_mm512_max_ps(v, zero), vq);
                const __m512i q = _mm512_cvt_roundps_epi32(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                _mm512_mask_cvtusepi32_storeu_epi8(o + i, mk, q);
            }
        }
    }
}

static float epi_one(float r, float a, float w, float s, const float *bias, int64_t i, int fused) {
    float t = fused ? fmaf(a, w, r) : r - a * w;
    t = t * s;
    return bias ? t + bias[i] : t;
}

static void epi_scalar(epi_job *j) {
    for (int64_t m = j->r0; m < j->r1; ++m) {
        float *r = j->raw + m * j->ldr;
        for (int64_t i = 0; i < j->n; ++i) r[i] = epi_one(r[i], j->a[m], j->w[i], j->s[m], j->bias, i, j->fused);
    }
}

__attribute__((target("avx2,fma")))
static void epi_avx2(epi_job *j) {
    const int64_t n8 = j->n & ~(int64_t)7;
    for (int64_t m = j->r0; m < j->r1; ++m) {
        float *r = j->raw + m * j->ldr;
        const __m256 va = _mm256_set1_ps(j->a[m]), vs = _mm256_set1_ps(j->s[m]);
        for (int64_t i = 0; i < n8; i += 8) {
            __m256 w = _mm256_loadu_ps(j->w + i), x = _mm256_loadu_ps(r + i);
            __m256 t = j->fused ? _mm256_fmadd_ps(va, w, x) : _mm256_sub_ps(x, _mm256_mul_ps(va, w));
            t = _mm256_mul_ps(t, vs);
            if (j->bias) t = _mm256_add_ps(t, _mm256_loadu_ps(j->bias + i));
            _mm256_storeu_ps(r + i, t);
        }
        for (int64_t i = n8; i < j->n; ++i) r[i] = epi_one(r[i], j->a[m], j->w[i], j->s[m], j->bias, i, j->fused);
    }
}

/* epi_avx2 on 16 lanes (use_avx512), the tail masked: the same float32 steps per element */
__attribute__((target("avx512f")))
static void epi_avx512(epi_job *j) {
    const int64_t n16 = j->n & ~(int64_t)15;
    const __mmask16 tail = (__mmask16)((1u << (j->n - n16)) - 1u);
    for (int64_t m = j->r0; m < j->r1; ++m) {
        float *r = j->raw + m * j->ldr;
        const __m512 va = _mm512_set1_ps(j->a[m]), vs = _mm512_set1_ps(j->s[m]);
        for (int64_t i = 0; i < j->n; i += 16) {
            const __mmask16 mk = i < n16 ? (__mmask16)0xFFFF : tail;
            const __m512 w = _mm512_maskz_loadu_ps(mk, j->w + i), x = _mm512_maskz_loadu_ps(mk, r + i);
            __m512 t = j->fused ? _mm512_fmadd_ps(va, w, x) : _mm512_sub_ps(x, _mm512_mul_ps(va, w));
            t = _mm512_mul_ps(t, vs);
            if (j->bias) t = _mm512_add_ps(t, _mm512_maskz_loadu_ps(mk, j->bias + i));
            _mm512_mask_storeu_ps(r + i, mk, t);
        }
    }
}

static void *grid_run(void *p) {
    grid_job *j = p;
    if (j->body == 2) grid_avx512(j); else if (j->body) grid_avx2(j); else grid_scalar(j);
    return NULL;
}
static void *epi_run(void *p) {
    epi_job *j = p;
    if (j->body == 2) epi_avx512(j); else if (j->body) epi_avx2(j); else epi_scalar(j);
    return NULL;
}

int lb_cpu_avx2(void) { return cpu_avx2(); }
int lb_cpu_vnni(void) { return cpu_vnni(); }
int lb_cpu_amx(void) { return cpu_amx(); }
int lb_cpu_avx512(void) { return cpu_avx512(); }

int lb_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

/* Rows [0, m) of x (row stride ldx floats, unit column stride): scale[m], negzp[m] = -z, and out (row stride ldo):
 * mode 0: float32 u = min(x * (1/s) - negzp, qmax);  mode 1: uint8 clamp(round(x * (1/s) - negzp), 0, qmax).
 * Returns 1 when some row is not finite (the outputs are then partly written and must be dropped), else 0.
 * isa: 0 the scalar body, anything else the best the CPU has. */
int lb_row_grid(const float *x, int64_t m, int64_t k, int64_t ldx, float levels, float eps, float qmax, int mode,
                void *out, int64_t ldo, float *scale, float *negzp, int nthreads, int isa) {
    grid_job jobs[MAX_THREADS];
    int n = threads_for(nthreads, m), bad = 0;
    for (int t = 0; t < n; ++t) {
        grid_job jb = {x, k, ldx, ldo, levels, eps, qmax, mode, out, scale, negzp, m * t / n, m * (t + 1) / n,
                       body_of(isa), 0, body_of(isa) == 2 && cpu_avx512bw()};
        jobs[t] = jb;
    }
    fan_out(grid_run, jobs, sizeof(grid_job), n);
    for (int t = 0; t < n; ++t) bad |= jobs[t].bad;
    return bad;
}

/* In place on raw (m rows of n floats, row stride ldr): fused: raw = fl(raw + a[m] w[n]) s[m] (+ bias[n]), the sum
 * rounded once (torch's addcmul_); else raw = fl(raw - fl(a[m] w[n])) s[m] (+ bias[n]) (torch's sub_ of a product). */
void lb_row_epilogue(float *raw, int64_t m, int64_t n, int64_t ldr, const float *a, const float *w, const float *s,
                     const float *bias, int fused, int nthreads, int isa) {
    epi_job jobs[MAX_THREADS];
    int nt = threads_for(nthreads, m);
    for (int t = 0; t < nt; ++t) {
        epi_job jb = {raw, n, ldr, a, w, s, bias, fused, m * t / nt, m * (t + 1) / nt,
                      body_of(isa)};
        jobs[t] = jb;
    }
    fan_out(epi_run, jobs, sizeof(epi_job), nt);
}

/* ---- the split-weight conv's epilogue (kernels/conv_split._wsplit_conv + avx2._acc_epilogue + qstore.codes) ---- */

typedef struct {
    const float *hi, *lo; int64_t ps, gs, groups, cpg; const float *sc, *bias; float inv, z, vlo, vhi;
    uint8_t *out; int64_t p0, p1; int avx2;
} conv_job;

static uint8_t conv_code(float h, float l, float sc, const float *bias, int64_t ch, const conv_job *j) {
    float t = l + (h + h);                 /* fl(lo + 2 hi): 2 hi is exact */
    t = t * sc;                            /* · fl(s_x s_w) */
    if (bias) t = t + bias[ch];
    float v = t * j->inv;                  /* · float32(1 / s_out) */
    v = v > j->vlo ? v : j->vlo;           /* qstore's clamp of v (ReLU floor / narrow grid), -inf/inf if none; */
    v = v < j->vhi ? v : j->vhi;           /* maxps / minps as the vector body: NaN becomes vlo (acc_code) */
    float r = nearbyintf(v + j->z);        /* round half to even of fl(v + z) */
    r = r < 0.f ? 0.f : r;                 /* the 8-bit storage's saturation */
    return (uint8_t)(r > 255.f ? 255.f : r);
}

static void conv_scalar(conv_job *j) {
    const int64_t c_all = j->groups * j->cpg;
    for (int64_t p = j->p0; p < j->p1; ++p)
        for (int64_t g = 0; g < j->groups; ++g) {
            const float *h = j->hi + p * j->ps + g * j->gs, *l = j->lo + p * j->ps + g * j->gs;
            for (int64_t c = 0; c < j->cpg; ++c) {
                int64_t ch = g * j->cpg + c;
                j->out[p * c_all + ch] = conv_code(h[c], l[c], j->sc[ch], j->bias, ch, j);
            }
        }
}

__attribute__((target("avx2,fma")))
static void conv_avx2(conv_job *j) {
    const int64_t c_all = j->groups * j->cpg, c8 = j->cpg & ~(int64_t)7;
    const __m256 vinv = _mm256_set1_ps(j->inv), vz = _mm256_set1_ps(j->z), vlo = _mm256_set1_ps(j->vlo),
                 vhi = _mm256_set1_ps(j->vhi), zero = _mm256_setzero_ps(), top = _mm256_set1_ps(255.f);
    for (int64_t p = j->p0; p < j->p1; ++p)
        for (int64_t g = 0; g < j->groups; ++g) {
            const float *h = j->hi + p * j->ps + g * j->gs, *l = j->lo + p * j->ps + g * j->gs;
            const int64_t base = g * j->cpg;
            uint8_t *o = j->out + p * c_all + base;
            for (int64_t c = 0; c < c8; c += 8) {
                __m256 hv = _mm256_loadu_ps(h + c);
                __m256 t = _mm256_add_ps(_mm256_loadu_ps(l + c), _mm256_add_ps(hv, hv));
                t = _mm256_mul_ps(t, _mm256_loadu_ps(j->sc + base + c));
                if (j->bias) t = _mm256_add_ps(t, _mm256_loadu_ps(j->bias + base + c));
                __m256 v = _mm256_mul_ps(t, vinv);
                v = _mm256_min_ps(_mm256_max_ps(v, vlo), vhi);
                v = _mm256_round_ps(_mm256_add_ps(v, vz), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                __m256i q = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(v, zero), top));
                __m128i q16 = _mm_packus_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
                _mm_storel_epi64((__m128i *)(o + c), _mm_packus_epi16(q16, q16));
            }
            for (int64_t c = c8; c < j->cpg; ++c) o[c] = conv_code(h[c], l[c], j->sc[base + c], j->bias, base + c, j);
        }
}

static void *conv_run(void *p) { conv_job *j = p; if (j->avx2) conv_avx2(j); else conv_scalar(j); return NULL; }

/* npix pixels (channels innermost) of a conv's two raw float32 sums: hi / lo at pixel p, group g, channel c of the
 * group at hi[p ps + g gs + c] / lo[...]; out[p C + g cpg + c] = clamp(round(fl(clamp(fl(fl(fl(lo + 2 hi) sc) + bias)
 * inv, vlo, vhi) + z)), 0, 255) (uint8, C = groups cpg; bias may be NULL). */
void lb_conv_epilogue(const float *hi, const float *lo, int64_t npix, int64_t ps, int64_t gs, int64_t groups,
                      int64_t cpg, const float *sc, const float *bias, float inv, float z, float vlo, float vhi,
                      uint8_t *out, int nthreads, int isa) {
    conv_job jobs[MAX_THREADS];
    int nt = threads_for(nthreads, npix);
    for (int t = 0; t < nt; ++t) {
        conv_job jb = {hi, lo, ps, gs, groups, cpg, sc, bias, inv, z, vlo, vhi, out, npix * t / nt,
                       npix * (t + 1) / nt, use_avx2(isa)};
        jobs[t] = jb;
    }
    fan_out(conv_run, jobs, sizeof(conv_job), nt);
}

/* ---- the quantized add / add_relu (nn/quantized/functional_modules._fast_add) ---- */

typedef struct {
    const uint8_t *a, *b; void *out; int64_t i0, i1; int sa, sb, so; float za, zb, ka, kb, vlo, vhi, z; int avx2;
} add_job;

static float code_val(const uint8_t *p, int64_t i, int sgn) { return sgn ? (float)((const int8_t *)p)[i] : (float)p[i]; }

static void add_scalar(add_job *j) {
    for (int64_t i = j->i0; i < j->i1; ++i) {
        float acc = (code_val(j->a, i, j->sa) - j->za) * j->ka + (code_val(j->b, i, j->sb) - j->zb) * j->kb;
        acc = acc < j->vlo ? j->vlo : acc;
        acc = acc > j->vhi ? j->vhi : acc;
        float r = nearbyintf(acc) + j->z;
        if (j->so) ((int8_t *)j->out)[i] = (int8_t)r; else ((uint8_t *)j->out)[i] = (uint8_t)r;
    }
}

__attribute__((target("avx2,fma"), always_inline))
static inline __m256 load8(const uint8_t *p, const int sgn) {
    __m128i v = _mm_loadl_epi64((const __m128i *)p);
    return _mm256_cvtepi32_ps(sgn ? _mm256_cvtepi8_epi32(v) : _mm256_cvtepu8_epi32(v));
}

/* eight codes of the sum as int32: the add_scalar steps, lane by lane */
__attribute__((target("avx2,fma"), always_inline))
static inline __m256i add8(const uint8_t *a, const uint8_t *b, const int sa, const int sb, __m256 za, __m256 zb, __m256 ka,
                           __m256 kb, __m256 lo, __m256 hi, __m256 z) {
    __m256 x = _mm256_mul_ps(_mm256_sub_ps(load8(a, sa), za), ka);
    __m256 y = _mm256_mul_ps(_mm256_sub_ps(load8(b, sb), zb), kb);
    __m256 acc = _mm256_min_ps(_mm256_max_ps(_mm256_add_ps(x, y), lo), hi);
    __m256 r = _mm256_add_ps(_mm256_round_ps(acc, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), z);
    return _mm256_cvtps_epi32(r);  /* integers in the storage's range: the packs below are exact */
}

/* The vector loop for one combination of storages (constants after inlining: no branch and no reload of the job per
 * step; the job's fields are read once into locals), 16 codes a step; returns where the scalar tail starts. */
__attribute__((target("avx2,fma"), always_inline))
static inline int64_t add_body(const add_job *j, const int sa, const int sb, const int so) {
    const uint8_t *restrict a = j->a, *restrict b = j->b;
    uint8_t *restrict out = j->out;
    const __m256 za = _mm256_set1_ps(j->za), zb = _mm256_set1_ps(j->zb), ka = _mm256_set1_ps(j->ka),
                 kb = _mm256_set1_ps(j->kb), lo = _mm256_set1_ps(j->vlo), hi = _mm256_set1_ps(j->vhi),
                 z = _mm256_set1_ps(j->z);
    const int64_t i1 = j->i1;
    int64_t i = j->i0;
    for (; i + 16 <= i1; i += 16) {
        __m256i q0 = add8(a + i, b + i, sa, sb, za, zb, ka, kb, lo, hi, z);
        __m256i q1 = add8(a + i + 8, b + i + 8, sa, sb, za, zb, ka, kb, lo, hi, z);
        __m256i p = _mm256_permute4x64_epi64(_mm256_packs_epi32(q0, q1), 0xd8);  /* q0[0-7] q1[0-7] as int16 */
        __m128i l = _mm256_castsi256_si128(p), h = _mm256_extracti128_si256(p, 1);
        _mm_storeu_si128((__m128i *)(out + i), so ? _mm_packs_epi16(l, h) : _mm_packus_epi16(l, h));
    }
    return i;
}

__attribute__((target("avx2,fma")))
static void add_avx2(add_job *j) {
    int64_t i;
    switch (j->sa << 2 | j->sb << 1 | j->so) {
        case 0: i = add_body(j, 0, 0, 0); break;
        case 1: i = add_body(j, 0, 0, 1); break;
        case 2: i = add_body(j, 0, 1, 0); break;
        case 3: i = add_body(j, 0, 1, 1); break;
        case 4: i = add_body(j, 1, 0, 0); break;
        case 5: i = add_body(j, 1, 0, 1); break;
        case 6: i = add_body(j, 1, 1, 0); break;
        default: i = add_body(j, 1, 1, 1); break;
    }
    add_job t = *j;
    t.i0 = i;
    add_scalar(&t);
}

static void *add_run(void *p) { add_job *j = p; if (j->avx2) add_avx2(j); else add_scalar(j); return NULL; }

/* n codes of two dense 8-bit tensors in the same memory order (signed: int8 storage, else uint8):
 * out = round(clamp(fl(fl((a - za) ka) + fl((b - zb) kb)), vlo, vhi)) + z in the out storage. */
void lb_qadd(const uint8_t *a, int sa, const uint8_t *b, int sb, void *out, int so, int64_t n, float za, float zb,
             float ka, float kb, float vlo, float vhi, float z, int nthreads, int isa) {
    add_job jobs[MAX_THREADS];
    int nt = threads_for(nthreads, n);
    for (int t = 0; t < nt; ++t) {
        add_job jb = {a, b, out, n * t / nt, n * (t + 1) / nt, sa, sb, so, za, zb, ka, kb, vlo, vhi, z, use_avx2(isa)};
        jobs[t] = jb;
    }
    fan_out(add_run, jobs, sizeof(add_job), nt);
}

/* ---- depthwise int8 conv, exact int32 sums and the requantizing epilogue (8-bit codes on any x86 CPU) ---- */

typedef struct {
    const uint8_t *x; int64_t c, h, w, oh, ow; const int16_t *wt; int kh, kw, sy, sx, py, px, dy, dx; int16_t zx;
    const float *sc, *bias; float inv, z, vlo, vhi; uint8_t *out; int64_t r0, r1;
    const struct dw_layout *lay;  /* the AVX2 body's per-call vectors (NULL: the scalar body) */
} dw_job;

static uint8_t dw_code(int32_t acc, int64_t ch, const dw_job *j) {
    return acc_code(acc, j->sc[ch], j->bias, ch, j->inv, j->z, j->vlo, j->vhi);
}

#define DW_MAX_TAPS 64

/* The in-bounds taps of output pixel (n, y, x): input rows src[t] and weight rows wts[t] (zero padding adds 0: the
 * out-of-bounds taps are left out); toff: the taps' offsets from the window's corner, for interior pixels. */
static inline __attribute__((always_inline)) int dw_taps(const dw_job *j, int64_t n, int64_t y, int64_t x,
                                                       const int64_t *toff, const uint8_t **src, const int16_t **wts) {
    const int64_t y0 = y * j->sy - j->py, x0 = x * j->sx - j->px;
    int nt = 0;
    if (y0 >= 0 && x0 >= 0 && y0 + (int64_t)(j->kh - 1) * j->dy < j->h && x0 + (int64_t)(j->kw - 1) * j->dx < j->w) {
        const uint8_t *base = j->x + ((n * j->h + y0) * j->w + x0) * j->c;  /* interior: every tap */
        const int ntaps = j->kh * j->kw;
        const int16_t *wt = j->wt;
        const int64_t c = j->c;
        for (int t = 0; t < ntaps; ++t) { src[t] = base + toff[t]; wts[t] = wt + (int64_t)t * c; }
        return ntaps;
    }
    for (int i = 0; i < j->kh; ++i) {
        int64_t iy = y0 + (int64_t)i * j->dy;
        if (iy < 0 || iy >= j->h) continue;
        for (int k = 0; k < j->kw; ++k) {
            int64_t ix = x0 + (int64_t)k * j->dx;
            if (ix < 0 || ix >= j->w) continue;
            src[nt] = j->x + ((n * j->h + iy) * j->w + ix) * j->c;
            wts[nt++] = j->wt + (i * j->kw + k) * j->c;
        }
    }
    return nt;
}

static void dw_offsets(const dw_job *j, int64_t *toff) {
    for (int i = 0; i < j->kh; ++i)
        for (int k = 0; k < j->kw; ++k) toff[i * j->kw + k] = ((int64_t)i * j->dy * j->w + (int64_t)k * j->dx) * j->c;
}

/* channels [c0, C) of one output pixel from its taps, in the scalar body */
static void dw_pixel_scalar(const dw_job *j, const uint8_t **src, const int16_t **wts, int nt, int64_t c0, uint8_t *o) {
    for (int64_t c = c0; c < j->c; ++c) {
        int32_t acc = 0;
        for (int t = 0; t < nt; ++t) acc += ((int32_t)src[t][c] - j->zx) * wts[t][c];
        o[c] = dw_code(acc, c, j);
    }
}

/* The AVX2 body (session 28): every pixel's 16-channel groups in tap pairs through vpmaddwd, two pixels of a row at
 * a time. vpmaddwd adds a pair's two int16 products q w into an int32 lane exactly (|2 · 255 · 128| < 2^31); the
 * epi16 unpacks interleave within 128-bit lanes, so a group's sums come out as channels [0-3, 8-11] (lo) and
 * [4-7, 12-15] (hi), and the per-call vectors below are laid out in that order (DW_LANE). The zero point leaves the
 * loop: the sums start at -zx Σ_t w_t (cst), and a tap in the zero padding reads a row of zx codes (zrow), adding
 * zx w_t back, so acc = Σ_t (q_t - zx) w_t over the in-bounds taps, exactly as the scalar body sums it. An odd
 * last tap pairs with zrow against a zero weight. Before, interior pixels took the pairs with the zero point
 * subtracted per code, one pixel at a time, and border pixels (27 % of a 14 x 14 map) 16-bit products per tap. */
static const int DW_LANE[16] = {0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15};

/* per-call layout for the AVX2 body: pair weights (group-major: group g, pair p at (g np + p) 32 int16: the pair's
 * two taps interleaved as the codes' unpacklo, then unpackhi), and per group of 16 channels in DW_LANE order the
 * sums' start -zx Σ w (int32), the scales and the biases; then c codes of zx */
typedef struct dw_layout { int16_t *wp; int32_t *cst; float *sc, *bias; uint8_t *zrow; } dw_layout;

__attribute__((target("avx2,fma")))
static void *dw_lay_out(const int16_t *wt, int ntaps, int64_t c, int zx, const float *sc, const float *bias,
                        dw_layout *l) {
    const int64_t g16 = c / 16, np = (ntaps + 1) / 2;
    const size_t wbytes = sizeof(int16_t) * 32 * (size_t)(np * g16), vbytes = sizeof(float) * 16 * (size_t)g16;
    uint8_t *mem = malloc(wbytes + 3 * vbytes + (size_t)c + 64);
    if (!mem) return NULL;
    l->wp = (int16_t *)mem;
    l->cst = (int32_t *)(mem + wbytes);
    l->sc = (float *)(mem + wbytes + vbytes);
    l->bias = bias ? (float *)(mem + wbytes + 2 * vbytes) : NULL;
    l->zrow = mem + wbytes + 3 * vbytes;
    memset(l->zrow, zx, (size_t)c + 64);  /* (+64: the group loads stay inside the block) */
    for (int64_t g = 0; g < g16; ++g) {
        for (int64_t p = 0; p < np; ++p) {
            const int t = 2 * (int)p;
            __m256i w0 = _mm256_loadu_si256((const __m256i *)(wt + (int64_t)t * c + 16 * g));
            __m256i w1 = t + 1 < ntaps ? _mm256_loadu_si256((const __m256i *)(wt + (int64_t)(t + 1) * c + 16 * g))
                                       : _mm256_setzero_si256();
            __m256i *dst = (__m256i *)(l->wp + (g * np + p) * 32);
            _mm256_storeu_si256(dst, _mm256_unpacklo_epi16(w0, w1));
            _mm256_storeu_si256(dst + 1, _mm256_unpackhi_epi16(w0, w1));
        }
        for (int i = 0; i < 16; ++i) {
            const int64_t ch = 16 * g + DW_LANE[i];
            int32_t sw = 0;
            for (int t = 0; t < ntaps; ++t) sw += wt[(int64_t)t * c + ch];
            l->cst[16 * g + i] = -zx * sw;
            l->sc[16 * g + i] = sc[ch];
            if (bias) l->bias[16 * g + i] = bias[ch];
        }
    }
    return mem;
}

/* the epilogue (common.h acc_codes8) of one group's sums (lo, hi: DW_LANE order) into o[0, 16) */
__attribute__((target("avx2,fma"), always_inline))
static inline void dw_codes16(const dw_job *j, const dw_layout *l, int64_t g, __m256i lo, __m256i hi, uint8_t *o) {
    __m256i q[2];
    for (int h = 0; h < 2; ++h)
        q[h] = acc_codes8(h ? hi : lo, l->sc + 16 * g + 8 * h, l->bias ? l->bias + 16 * g + 8 * h : NULL, j->inv,
                          j->z, j->vlo, j->vhi);
    /* per 128-bit lane: lo's channels 0-3 | 8-11 and hi's 4-7 | 12-15 pack to 0-7 | 8-15 */
    __m256i b = _mm256_packus_epi16(_mm256_packus_epi32(q[0], q[1]), _mm256_setzero_si256());
    _mm_storeu_si128((__m128i *)o, _mm256_castsi256_si128(_mm256_permute4x64_epi64(b, 0x08)));
}

/* one pair of taps (rows a, b at channel c) of one pixel into its sums lo, hi against the pair's weights wl, wh */
#define DW_PAIR(a, b, lo, hi) do { \
        __m256i d0_ = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)((a) + c))); \
        __m256i d1_ = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)((b) + c))); \
        lo = _mm256_add_epi32(lo, _mm256_madd_epi16(_mm256_unpacklo_epi16(d0_, d1_), wl)); \
        hi = _mm256_add_epi32(hi, _mm256_madd_epi16(_mm256_unpackhi_epi16(d0_, d1_), wh)); \
    } while (0)

/* the 16-channel groups of one output pixel (two = 0) or of two (two = 1: the weights loaded once for both);
 * s0, s1: the pixels' rows of codes per tap (zrow where the tap is padding, and at index ntaps) */
__attribute__((target("avx2,fma"), always_inline))
static inline void dw_groups(const dw_job *j, const dw_layout *l, const uint8_t *const *s0, const uint8_t *const *s1,
                             const int two, uint8_t *o0, uint8_t *o1) {
    const int npair = (j->kh * j->kw + 1) / 2;
    const int64_t g16 = j->c / 16;
    for (int64_t g = 0; g < g16; ++g) {
        const int64_t c = 16 * g;
        __m256i lo0 = _mm256_loadu_si256((const __m256i *)(l->cst + c)),
                hi0 = _mm256_loadu_si256((const __m256i *)(l->cst + c + 8)), lo1 = lo0, hi1 = hi0;
        const __m256i *w = (const __m256i *)(l->wp + g * npair * 32);
        for (int p = 0; p < 2 * npair; p += 2, w += 2) {
            const __m256i wl = _mm256_loadu_si256(w), wh = _mm256_loadu_si256(w + 1);
            DW_PAIR(s0[p], s0[p + 1], lo0, hi0);
            if (two) DW_PAIR(s1[p], s1[p + 1], lo1, hi1);
        }
        dw_codes16(j, l, g, lo0, hi0, o0 + c);
        if (two) dw_codes16(j, l, g, lo1, hi1, o1 + c);
    }
}

/* pixel (n, y, x)'s tap rows into s[0, ntaps] (zrow: padding, and the odd pair's second) */
static inline void dw_rows(const dw_job *j, const dw_layout *l, int64_t n, int64_t y, int64_t x, const int64_t *toff,
                           const uint8_t **s) {
    const int ntaps = j->kh * j->kw;
    const int64_t y0 = y * j->sy - j->py, x0 = x * j->sx - j->px;
    s[ntaps] = l->zrow;
    if (y0 >= 0 && x0 >= 0 && y0 + (int64_t)(j->kh - 1) * j->dy < j->h && x0 + (int64_t)(j->kw - 1) * j->dx < j->w) {
        const uint8_t *base = j->x + ((n * j->h + y0) * j->w + x0) * j->c;
        for (int t = 0; t < ntaps; ++t) s[t] = base + toff[t];
        return;
    }
    for (int i = 0; i < j->kh; ++i) {
        const int64_t iy = y0 + (int64_t)i * j->dy;
        for (int k = 0; k < j->kw; ++k) {
            const int64_t ix = x0 + (int64_t)k * j->dx;
            s[i * j->kw + k] = iy < 0 || iy >= j->h || ix < 0 || ix >= j->w
                ? l->zrow : j->x + ((n * j->h + iy) * j->w + ix) * j->c;
        }
    }
}

__attribute__((target("avx2,fma")))
static void dw_run_avx2(dw_job *j, const dw_layout *l) {
    const uint8_t *s0[DW_MAX_TAPS + 2], *s1[DW_MAX_TAPS + 2];
    const int16_t *wts[DW_MAX_TAPS];  /* every tap's weights, for the channel tail */
    int64_t toff[DW_MAX_TAPS];
    const int ntaps = j->kh * j->kw;
    for (int t = 0; t < ntaps; ++t) wts[t] = j->wt + (int64_t)t * j->c;
    dw_offsets(j, toff);
    const int64_t c16 = j->c & ~(int64_t)15;
    for (int64_t r = j->r0; r < j->r1; ++r) {
        const int64_t n = r / j->oh, y = r % j->oh;
        uint8_t *row = j->out + (n * j->oh + y) * j->ow * j->c;
        for (int64_t x = 0; x < j->ow; x += 2) {
            const int np = x + 1 < j->ow ? 2 : 1;
            uint8_t *o[2] = {row + x * j->c, row + (x + 1) * j->c};
            dw_rows(j, l, n, y, x, toff, s0);
            if (np == 2) {
                dw_rows(j, l, n, y, x + 1, toff, s1);
                dw_groups(j, l, s0, s1, 1, o[0], o[1]);
            } else {
                dw_groups(j, l, s0, s0, 0, o[0], o[0]);
            }
            if (c16 < j->c)  /* the channel tail on the same tap rows (a padding tap's zrow adds (zx - zx) w = 0) */
                for (int q = 0; q < np; ++q) dw_pixel_scalar(j, q ? s1 : s0, wts, ntaps, c16, o[q]);
        }
    }
}

static void *dw_run(void *p) {
    dw_job *j = p;
    if (j->lay) {
        dw_run_avx2(j, j->lay);
        return NULL;
    }
    const uint8_t *src[DW_MAX_TAPS];
    const int16_t *wts[DW_MAX_TAPS];
    int64_t toff[DW_MAX_TAPS];
    dw_offsets(j, toff);
    for (int64_t r = j->r0; r < j->r1; ++r) {
        const int64_t n = r / j->oh, y = r % j->oh;
        for (int64_t x = 0; x < j->ow; ++x)
            dw_pixel_scalar(j, src, wts, dw_taps(j, n, y, x, toff, src, wts), 0,
                            j->out + ((n * j->oh + y) * j->ow + x) * j->c);
    }
    return NULL;
}

/* Depthwise conv of channels-last u8 codes x (n, h, w, c) with zero point zx and int16 weights wt (kh, kw, c):
 * acc = sum over in-bounds taps of (x - zx) wt (zero padding = the zero point: centred 0), exact in int32; then
 * out (n, oh, ow, c) = the conv epilogue's codes of fl(acc) (see lb_conv_epilogue). */
void lb_dwconv(const uint8_t *x, int64_t n, int64_t c, int64_t h, int64_t w, const int16_t *wt, int kh, int kw,
               int sy, int sx, int py, int px, int dy, int dx, int zx, int64_t oh, int64_t ow, const float *sc,
               const float *bias, float inv, float z, float vlo, float vhi, uint8_t *out, int nthreads, int isa) {
    dw_job jobs[MAX_THREADS];
    int64_t rows = n * oh;
    int nt = threads_for(nthreads, rows);
    dw_layout lay;  /* the AVX2 body's vectors (none for fewer than 16 channels or without memory: the scalar body) */
    void *mem = use_avx2(isa) && c >= 16 ? dw_lay_out(wt, kh * kw, c, zx, sc, bias, &lay) : NULL;
    for (int t = 0; t < nt; ++t) {
        dw_job jb = {x, c, h, w, oh, ow, wt, kh, kw, sy, sx, py, px, dy, dx, (int16_t)zx, sc, bias, inv, z, vlo, vhi,
                     out, rows * t / nt, rows * (t + 1) / nt, mem ? &lay : NULL};
        jobs[t] = jb;
    }
    fan_out(dw_run, jobs, sizeof(dw_job), nt);
    free(mem);
}
