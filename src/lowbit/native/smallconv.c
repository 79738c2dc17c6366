/* A dense int8 conv whose window is small (C_in kh roundup(kw, 4) <= SC_MAX_TAPS padded taps: an image model's first
 * conv, 1 or 3 input channels), with its requantizing epilogue in one pass (common.h: the shared rules; smallconv.py:
 * the Python side; kernels/conv_small.py: where it is taken).
 *
 * oneDNN blocks its int8 convs over input channels; with one to three of them most of each block is padding
 * (SmallCNN's 1 -> 16 3x3 conv at batch 64: ~530 µs in oneDNN's call for 7 M products on the Zen 4 EPYC, ~220 here).
 * Each thread copies the images of its output rows into a buffer padded with the input zero point (the conv's zero
 * padding) and wide enough that every window row reads as whole 4-byte quads (the taps past kw meet zero weights).
 * Per output row, the quads of each pixel's window at fixed offsets:
 *   acc[o] = sum_k p_k w[o, k] - zx wsum[o]         (exact int32: the zero point's share subtracted once)
 * on a VNNI CPU (with AVX-512BW for the masked stores) four taps per vpdpbusd (u8 x s8 summed in int32, no
 * saturation), the weight quads of 32 channels held in registers over the row, two pixels at a time; else two taps
 * per vpmaddwd on the codes widened to int16 (exact too), 16 channels a pixel; else the scalar body. The epilogue is
 * acc_code's (common.h, lb_dwconv's and lb_conv_epilogue's), so the codes are the split-weight conv's, and oneDNN's
 * but at exact float ties.
 */
#include "common.h"

#define SC_MAX_TAPS 64

typedef struct {
    const uint8_t *x; int64_t h, w, sn, sc_, sh, sw; int64_t kp, cout, cp; const int8_t *w4; const int16_t *w2;
    const int32_t *wsum; int kh, kw, sy, sx, py, px, dy, dx, zx; int64_t oh, ow; const float *sc, *bias;
    float inv, z, vlo, vhi; uint8_t *out; int64_t r0, r1; int body; uint8_t *pad; int64_t hp, wpad; int16_t *pad16;
} sc_job;

/* Each body turns the np windows at quad pointers q[t] + i sx (i < np; tap 4t + e at q[t][i sx + e]) into np pixels
 * of cout codes at o. */
static void px_scalar(const sc_job *j, const uint8_t *const *q, int64_t np, uint8_t *o) {
    for (int64_t i = 0; i < np; ++i, o += j->cout)
        for (int64_t c = 0; c < j->cout; ++c) {
            int32_t acc = 0;
            for (int64_t t = 0; t < j->kp; ++t)
                acc += (int32_t)q[t >> 2][i * j->sx + (t & 3)] * j->w2[(t >> 1) * j->cp * 2 + c * 2 + (t & 1)];
            o[c] = acc_code(acc - j->zx * j->wsum[c], j->sc[c], j->bias, c, j->inv, j->z, j->vlo, j->vhi);
        }
}

/* the epilogue of 8 sums (channels c..c+8) to 8 codes in the low half */
__attribute__((target("avx2,fma"), always_inline))
static inline __m128i epi8_avx2(__m256i acc, __m256 sc, __m256 bias, __m256 inv, __m256 lo, __m256 hi, __m256 z) {
    __m256 t = _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(acc), sc), bias);
    __m256 v = _mm256_min_ps(_mm256_max_ps(_mm256_mul_ps(t, inv), lo), hi);
    v = _mm256_round_ps(_mm256_add_ps(v, z), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256i r = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(v, _mm256_setzero_ps()), _mm256_set1_ps(255.f)));
    __m128i r16 = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
    return _mm_packus_epi16(r16, r16);
}

static inline void store16(uint8_t *o, __m128i v, int64_t n) {
    if (n >= 16) {
        _mm_storeu_si128((__m128i *)o, v);
    } else {
        uint8_t codes[16];
        _mm_storeu_si128((__m128i *)codes, v);
        memcpy(o, codes, (size_t)n);
    }
}

/* (p_2g, p_2g+1) of window i as an int32 of two int16 halves, for vpmaddwd: one 4-byte read of the image widened to
 * int16 (sc_run), which the compiler folds into the broadcast (session 27: the pair built from two byte reads, a shift
 * and an or cost ~6 instructions a broadcast; SmallCNN's 1 -> 16 conv at batch 64 went from ~720 to ~540-590 µs) */
static inline int32_t pair16(const int16_t *const *q, int64_t g, int64_t off) {
    int32_t v;
    memcpy(&v, q[g >> 1] + off + 2 * (g & 1), 4);
    return v;
}

/* two taps per vpmaddwd against the int16 weight pairs of 16 channels; two pixels at a time (the weights read once
 * for both, four independent sums) */
__attribute__((target("avx2,fma")))
static void px_avx2(const sc_job *j, const int16_t *const *q, int64_t np, uint8_t *o) {
    const int64_t g2 = j->kp >> 1, stride = j->cp * 2, cout = j->cout, sx = j->sx;
    const __m256 inv = _mm256_set1_ps(j->inv), lo = _mm256_set1_ps(j->vlo), hi = _mm256_set1_ps(j->vhi),
                 z = _mm256_set1_ps(j->z);
    float zeros[16] = {0};
    for (int64_t c = 0; c < cout; c += 16) {
        const int16_t *wb = j->w2 + c * 2;
        const float *bs = j->bias ? j->bias + c : zeros;
        const __m256 s0 = _mm256_loadu_ps(j->sc + c), s1 = _mm256_loadu_ps(j->sc + c + 8), b0 = _mm256_loadu_ps(bs),
                     b1 = _mm256_loadu_ps(bs + 8);
        const __m256i zx = _mm256_set1_epi32(j->zx);
        const __m256i k0 = _mm256_mullo_epi32(zx, _mm256_loadu_si256((const __m256i *)(j->wsum + c)));
        const __m256i k1 = _mm256_mullo_epi32(zx, _mm256_loadu_si256((const __m256i *)(j->wsum + c + 8)));
        int64_t i = 0;
        for (; i < np; i += 2) {
            const int two = i + 1 < np;
            __m256i a0 = _mm256_setzero_si256(), a1 = a0, c0 = a0, c1 = a0;
            for (int64_t g = 0; g < g2; ++g) {
                const __m256i w0 = _mm256_loadu_si256((const __m256i *)(wb + g * stride));
                const __m256i w1 = _mm256_loadu_si256((const __m256i *)(wb + g * stride + 16));
                const __m256i p0 = _mm256_set1_epi32(pair16(q, g, i * sx));
                a0 = _mm256_add_epi32(a0, _mm256_madd_epi16(p0, w0));
                a1 = _mm256_add_epi32(a1, _mm256_madd_epi16(p0, w1));
                if (two) {
                    const __m256i p1 = _mm256_set1_epi32(pair16(q, g, (i + 1) * sx));
                    c0 = _mm256_add_epi32(c0, _mm256_madd_epi16(p1, w0));
                    c1 = _mm256_add_epi32(c1, _mm256_madd_epi16(p1, w1));
                }
            }
            store16(o + i * cout + c, _mm_unpacklo_epi64(epi8_avx2(_mm256_sub_epi32(a0, k0), s0, b0, inv, lo, hi, z),
                                                         epi8_avx2(_mm256_sub_epi32(a1, k1), s1, b1, inv, lo, hi, z)),
                    cout - c);
            if (two)
                store16(o + (i + 1) * cout + c,
                        _mm_unpacklo_epi64(epi8_avx2(_mm256_sub_epi32(c0, k0), s0, b0, inv, lo, hi, z),
                                           epi8_avx2(_mm256_sub_epi32(c1, k1), s1, b1, inv, lo, hi, z)),
                        cout - c);
        }
    }
}

/* AVX-512BW (the VNNI body's masked byte stores; every VNNI CPU so far has it) */
static int cpu_avx512bw(void) {
    static int known = -1;
    if (known < 0) { __builtin_cpu_init(); known = __builtin_cpu_supports("avx512bw"); }
    return known;
}

/* n (< 16 allowed) of 16 codes stored, masked */
__attribute__((target("avx2,fma,avx512f,avx512vl,avx512bw,avx512vnni"), always_inline))
static inline void store16_512(uint8_t *o, __m128i v, int64_t n) {
    _mm_mask_storeu_epi8(o, n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1), v);
}

/* the epilogue of 16 sums to 16 codes (AVX-512F) */
__attribute__((target("avx2,fma,avx512f,avx512vl,avx512bw,avx512vnni"), always_inline))
static inline __m128i epi16_512(__m512i acc, __m512i k, __m512 sc, __m512 bias, __m512 inv, __m512 lo, __m512 hi, __m512 z) {
    __m512 t = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc, k)), sc), bias);
    __m512 v = _mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(t, inv), lo), hi);
    v = _mm512_roundscale_ps(_mm512_add_ps(v, z), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    v = _mm512_min_ps(_mm512_max_ps(v, _mm512_setzero_ps()), _mm512_set1_ps(255.f));
    return _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(v));
}

/* four taps per vpdpbusd against the int8 weight quads of 32 channels (two blocks of 16), held over the row; two
 * pixels at a time, so four independent sums are in flight */
__attribute__((target("avx2,fma,avx512f,avx512vl,avx512bw,avx512vnni")))
static void px_vnni(const sc_job *j, const uint8_t *const *q, int64_t np, uint8_t *o) {
    const int64_t g4 = j->kp >> 2, stride = j->cp * 4, cout = j->cout, sx = j->sx;
    const __m512 inv = _mm512_set1_ps(j->inv), lo = _mm512_set1_ps(j->vlo), hi = _mm512_set1_ps(j->vhi),
                 z = _mm512_set1_ps(j->z);
    float zeros[32] = {0};
    __m512i w0[SC_MAX_TAPS / 4], w1[SC_MAX_TAPS / 4];
    for (int64_t c = 0; c < cout; c += 32) {
        const int two = c + 16 < cout;  /* a second block of 16 channels (cp is a multiple of 16: its weights exist) */
        for (int64_t g = 0; g < g4; ++g) {
            w0[g] = _mm512_loadu_si512((const void *)(j->w4 + c * 4 + g * stride));
            w1[g] = two ? _mm512_loadu_si512((const void *)(j->w4 + (c + 16) * 4 + g * stride)) : _mm512_setzero_si512();
        }
        const float *bs = j->bias ? j->bias + c : zeros;
        const __m512 s0 = _mm512_loadu_ps(j->sc + c), b0 = _mm512_loadu_ps(bs);
        const __m512 s1 = two ? _mm512_loadu_ps(j->sc + c + 16) : s0, b1 = two ? _mm512_loadu_ps(bs + 16) : b0;
        const __m512i zx = _mm512_set1_epi32(j->zx);
        const __m512i k0 = _mm512_mullo_epi32(zx, _mm512_loadu_si512((const void *)(j->wsum + c)));
        const __m512i k1 = two ? _mm512_mullo_epi32(zx, _mm512_loadu_si512((const void *)(j->wsum + c + 16))) : k0;
        int64_t i = 0;
        for (; i + 2 <= np; i += 2) {
            __m512i a00 = _mm512_setzero_si512(), a01 = a00, a10 = a00, a11 = a00;
            for (int64_t g = 0; g < g4; ++g) {
                int32_t v0, v1;
                memcpy(&v0, q[g] + i * sx, 4);
                memcpy(&v1, q[g] + (i + 1) * sx, 4);
                const __m512i p0 = _mm512_set1_epi32(v0), p1 = _mm512_set1_epi32(v1);
                a00 = _mm512_dpbusd_epi32(a00, p0, w0[g]);
                a10 = _mm512_dpbusd_epi32(a10, p1, w0[g]);
                if (two) {
                    a01 = _mm512_dpbusd_epi32(a01, p0, w1[g]);
                    a11 = _mm512_dpbusd_epi32(a11, p1, w1[g]);
                }
            }
            store16_512(o + i * cout + c, epi16_512(a00, k0, s0, b0, inv, lo, hi, z), cout - c);
            store16_512(o + (i + 1) * cout + c, epi16_512(a10, k0, s0, b0, inv, lo, hi, z), cout - c);
            if (two) {
                store16_512(o + i * cout + c + 16, epi16_512(a01, k1, s1, b1, inv, lo, hi, z), cout - c - 16);
                store16_512(o + (i + 1) * cout + c + 16, epi16_512(a11, k1, s1, b1, inv, lo, hi, z), cout - c - 16);
            }
        }
        for (; i < np; ++i) {
            __m512i a0 = _mm512_setzero_si512(), a1 = a0;
            for (int64_t g = 0; g < g4; ++g) {
                int32_t v0;
                memcpy(&v0, q[g] + i * sx, 4);
                const __m512i p0 = _mm512_set1_epi32(v0);
                a0 = _mm512_dpbusd_epi32(a0, p0, w0[g]);
                if (two) a1 = _mm512_dpbusd_epi32(a1, p0, w1[g]);
            }
            store16_512(o + i * cout + c, epi16_512(a0, k0, s0, b0, inv, lo, hi, z), cout - c);
            if (two) store16_512(o + i * cout + c + 16, epi16_512(a1, k1, s1, b1, inv, lo, hi, z), cout - c - 16);
        }
    }
}

/* image n of x copied into pad (cin, hp, wp): zero point around it (the conv's zero padding), margins zx too */
static void pad_image(const sc_job *j, int64_t n, int64_t hp, int64_t wp, uint8_t *pad) {
    const int64_t cin = j->kp / (j->kh * ((j->kw + 3) & ~3));
    memset(pad, j->zx, (size_t)(cin * hp * wp));
    for (int64_t ci = 0; ci < cin; ++ci)
        for (int64_t y = 0; y < j->h; ++y) {
            const uint8_t *src = j->x + n * j->sn + ci * j->sc_ + y * j->sh;
            uint8_t *dst = pad + (ci * hp + y + j->py) * wp + j->px;
            if (j->sw == 1) memcpy(dst, src, (size_t)j->w);
            else for (int64_t xx = 0; xx < j->w; ++xx) dst[xx] = src[xx * j->sw];
        }
}

/* the padded image widened to int16 for the AVX2 body (n codes) */
__attribute__((target("avx2,fma")))
static void widen16(const uint8_t *src, int64_t n, int16_t *dst) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm256_storeu_si256((__m256i *)(dst + i), _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(src + i))));
    for (; i < n; ++i) dst[i] = src[i];
}

static void *sc_run(void *arg) {
    const sc_job *j = arg;
    void (*px)(const sc_job *, const uint8_t *const *, int64_t, uint8_t *) = j->body == 2 ? px_vnni : px_scalar;
    const int64_t kwp = (j->kw + 3) & ~3, quads = j->kp / 4, per_row = kwp / 4, oh = j->oh, ow = j->ow;
    const int64_t hp = j->hp, wpad = j->wpad, cin = j->kp / (j->kh * kwp);
    uint8_t *pad = j->pad;
    const uint8_t *qp[SC_MAX_TAPS / 4];
    const int16_t *qp16[SC_MAX_TAPS / 4];
    int64_t cur = -1;
    for (int64_t r = j->r0; r < j->r1; ++r) {
        const int64_t n = r / oh, y = r % oh;
        if (n != cur) {
            pad_image(j, n, hp, wpad, pad);
            if (j->body == 1) widen16(pad, cin * hp * wpad, j->pad16);
            cur = n;
        }
        for (int64_t t = 0; t < quads; ++t) {
            const int64_t rw = t / per_row, ci = rw / j->kh, i = rw % j->kh;
            const int64_t off = (ci * hp + y * j->sy + i * j->dy) * wpad + 4 * (t % per_row);
            qp[t] = pad + off;
            if (j->body == 1) qp16[t] = j->pad16 + off;
        }
        if (j->body == 1)
            px_avx2(j, qp16, ow, j->out + (n * oh + y) * ow * j->cout);
        else
            px(j, qp, ow, j->out + (n * oh + y) * ow * j->cout);
    }
    return NULL;
}

/* The body lb_smallconv runs for isa: 2 VNNI, 1 AVX2, 0 scalar. */
int lb_smallconv_body(int isa) { return use_vnni(isa) && cpu_avx512bw() ? 2 : use_avx2(isa) ? 1 : 0; }

/* Dense conv of u8 codes x (n, c, h, w) at element strides (sn, sc, sh, sw), zero point zx (zero padding: zx), weights
 * packed by layers.smallconv_weight: w4 (kp / 4, cp, 4) int8 and w2 (kp / 2, cp, 2) int16 over the taps (c, i, k) in
 * that order, kp = k rounded up to 4 (zero weights past k), cp = cout rounded up to 16 (zero channels), wsum[o] =
 * sum_k w[o, k]; sc / bias hold cp floats. out (n, oh, ow, cout) uint8 = the epilogue's codes (file comment). 1: the
 * window has more than SC_MAX_TAPS taps (nothing written). */
int lb_smallconv(const uint8_t *x, int64_t n, int64_t c, int64_t h, int64_t w, int64_t sn, int64_t sc_, int64_t sh,
                 int64_t sw, const int8_t *w4, const int16_t *w2, const int32_t *wsum, int64_t cout, int64_t cp, int kh,
                 int kw, int sy, int sx, int py, int px, int dy, int dx, int zx, int64_t oh, int64_t ow, const float *sc,
                 const float *bias, float inv, float z, float vlo, float vhi, uint8_t *out, int nthreads, int isa) {
    const int64_t kwp = (kw + 3) & ~3, kp = c * kh * kwp;
    if (kp > SC_MAX_TAPS || cp % 16 || cp < cout || dx != 1) return 1;
    /* each thread's padded image: the zero point around it (the conv's zero padding), and room for a last quad that
     * reaches past kw (its taps meet zero weights) */
    const int64_t hp = h + 2 * (int64_t)py, reach = (ow - 1) * sx + kwp, wide = w + 2 * (int64_t)px;
    const int64_t wpad = reach > wide ? reach : wide;
    sc_job jobs[MAX_THREADS];
    const int64_t rows = n * oh;
    const int nt = threads_for(nthreads, rows), body = lb_smallconv_body(isa);
    /* each thread's padded image, and its int16 copy for the AVX2 body (after all of them, 64-byte aligned) */
    const int64_t per = c * hp * wpad, wide_at = (nt * per + 63) & ~(int64_t)63;
    uint8_t *pads = malloc((size_t)(body == 1 ? wide_at + nt * per * 2 : nt * per));
    if (!pads) return 2;
    for (int t = 0; t < nt; ++t) {
        sc_job jb = {x, h, w, sn, sc_, sh, sw, kp, cout, cp, w4, w2, wsum, kh, kw, sy, sx, py, px, dy, dx, zx, oh, ow,
                     sc, bias, inv, z, vlo, vhi, out, rows * t / nt, rows * (t + 1) / nt, body, pads + t * per,
                     hp, wpad, body == 1 ? (int16_t *)(pads + wide_at) + t * per : NULL};
        jobs[t] = jb;
    }
    fan_out(sc_run, jobs, sizeof(sc_job), nt);
    free(pads);
    return 0;
}
