/* Max pooling of 8-bit codes in channels-last memory (qtensor/pool.max_pool2d_codes): for each output pixel
 * (n, i, j) and channel c, out = max over the kh x kw window of in[n, i sh + di, j sw + dj, c], no padding, no
 * dilation. max is exact on codes (uint8, or int8 when sgn), so every body gives the same codes. */
#include "common.h"

typedef struct {
    const uint8_t *in; uint8_t *out; int64_t h, w, c, kh, kw, sh, sw, ho, wo, p0, p1; int sgn, avx2;
} pool_job;

static void pool_scalar(const pool_job *j) {
    for (int64_t p = j->p0; p < j->p1; ++p) {
        const int64_t n = p / (j->ho * j->wo), i = p / j->wo % j->ho, jj = p % j->wo;
        const uint8_t *base = j->in + ((n * j->h + i * j->sh) * j->w + jj * j->sw) * j->c;
        uint8_t *o = j->out + p * j->c;
        for (int64_t ch = 0; ch < j->c; ++ch) {
            int best = j->sgn ? -128 : 0;
            for (int64_t di = 0; di < j->kh; ++di)
                for (int64_t dj = 0; dj < j->kw; ++dj) {
                    const uint8_t u = base[(di * j->w + dj) * j->c + ch];
                    const int v = j->sgn ? (int)(int8_t)u : (int)u;
                    best = v > best ? v : best;
                }
            o[ch] = (uint8_t)best;
        }
    }
}

/* 32 channels a step (16, then the scalar tail): the window's rows loaded and max-ed in registers */
__attribute__((target("avx2,fma"), always_inline))
static inline void pool_body(const pool_job *j, const int sgn) {
    const int64_t c = j->c, w = j->w, kh = j->kh, kw = j->kw, rs = w * c, ho = j->ho, wo = j->wo;
    const int64_t step = j->sw * c, row = j->sh * rs, image = j->h * rs;
    int64_t n = j->p0 / (ho * wo), i = j->p0 / wo % ho, jj = j->p0 % wo;  /* the first pixel's place, then stepped */
    for (int64_t p = j->p0; p < j->p1; ++p) {
        const uint8_t *base = j->in + n * image + i * row + jj * step;
        uint8_t *o = j->out + p * c;
        if (++jj == wo) {
            jj = 0;
            if (++i == ho) { i = 0; ++n; }
        }
        int64_t ch = 0;
        for (; ch + 32 <= c; ch += 32) {
            __m256i m = _mm256_loadu_si256((const __m256i *)(base + ch));
            for (int64_t di = 0; di < kh; ++di)
                for (int64_t dj = 0; dj < kw; ++dj) {
                    const __m256i v = _mm256_loadu_si256((const __m256i *)(base + di * rs + dj * c + ch));
                    m = sgn ? _mm256_max_epi8(m, v) : _mm256_max_epu8(m, v);
                }
            _mm256_storeu_si256((__m256i *)(o + ch), m);
        }
        for (; ch + 16 <= c; ch += 16) {
            __m128i m = _mm_loadu_si128((const __m128i *)(base + ch));
            for (int64_t di = 0; di < kh; ++di)
                for (int64_t dj = 0; dj < kw; ++dj) {
                    const __m128i v = _mm_loadu_si128((const __m128i *)(base + di * rs + dj * c + ch));
                    m = sgn ? _mm_max_epi8(m, v) : _mm_max_epu8(m, v);
                }
            _mm_storeu_si128((__m128i *)(o + ch), m);
        }
        for (; ch < c; ++ch) {
            int best = sgn ? -128 : 0;
            for (int64_t di = 0; di < kh; ++di)
                for (int64_t dj = 0; dj < kw; ++dj) {
                    const uint8_t u = base[di * rs + dj * c + ch];
                    const int v = sgn ? (int)(int8_t)u : (int)u;
                    best = v > best ? v : best;
                }
            o[ch] = (uint8_t)best;
        }
    }
}

__attribute__((target("avx2,fma")))
static void pool_avx2(const pool_job *j) {
    if (j->sgn) pool_body(j, 1); else pool_body(j, 0);
}

static void *pool_run(void *p) {
    const pool_job *j = p;
    if (j->avx2) pool_avx2(j); else pool_scalar(j);
    return NULL;
}

/* in: (n, h, w, c) dense codes; out: (n, ho, wo, c) dense, ho = (h - kh) / sh + 1, wo likewise (the caller checks) */
void lb_maxpool_codes(const uint8_t *in, int sgn, int64_t n, int64_t h, int64_t w, int64_t c, int64_t kh, int64_t kw,
                      int64_t sh, int64_t sw, uint8_t *out, int nthreads, int isa) {
    const int64_t ho = (h - kh) / sh + 1, wo = (w - kw) / sw + 1, npix = n * ho * wo;
    pool_job jobs[MAX_THREADS];
    int nt = threads_for(nthreads, npix);
    for (int t = 0; t < nt; ++t) {
        pool_job jb = {in, out, h, w, c, kh, kw, sh, sw, ho, wo, npix * t / nt, npix * (t + 1) / nt, sgn, use_avx2(isa)};
        jobs[t] = jb;
    }
    fan_out(pool_run, jobs, sizeof(pool_job), nt);
}

/* ---- NCHW -> NHWC of 8-bit codes (an (n, c, h, w) contiguous tensor into channels-last memory): out[i, p, ch] =
 * in[i, ch, p] per image i and pixel p, in blocks of 64 pixels (each block's reads: 64 bytes per channel, its writes
 * 64 c contiguous bytes), jobs split over (image, block). A byte move, so every body gives the same bytes. ---- */

typedef struct { const uint8_t *in; uint8_t *out; int64_t c, hw, nblk, b0, b1; } nhwc_job;

static void *nhwc_run(void *p) {
    const nhwc_job *j = p;
    const int64_t c = j->c, hw = j->hw;
    for (int64_t b = j->b0; b < j->b1; ++b) {
        const int64_t i = b / j->nblk, p0 = b % j->nblk * 64, p1 = p0 + 64 < hw ? p0 + 64 : hw;
        const uint8_t *src = j->in + i * c * hw;
        uint8_t *dst = j->out + i * c * hw;
        if (c == 3) {  /* an image's three planes (the common stem input), interleaved in one sweep */
            const uint8_t *restrict s0 = src, *restrict s1 = src + hw, *restrict s2 = src + 2 * hw;
            uint8_t *restrict d = dst;
            for (int64_t q = p0; q < p1; ++q) {
                d[3 * q] = s0[q];
                d[3 * q + 1] = s1[q];
                d[3 * q + 2] = s2[q];
            }
            continue;
        }
        for (int64_t ch = 0; ch < c; ++ch) {
            const uint8_t *s = src + ch * hw;
            for (int64_t q = p0; q < p1; ++q) dst[q * c + ch] = s[q];
        }
    }
    return NULL;
}

/* the (image, 64-pixel block) jobs of a layout copy, split over the threads; run: nhwc_run or nchw_run */
static void layout_copy(void *(*run)(void *), const uint8_t *in, int64_t n, int64_t c, int64_t hw, uint8_t *out,
                        int nthreads) {
    const int64_t nblk = (hw + 63) / 64, total = n * nblk;
    nhwc_job jobs[MAX_THREADS];
    int nt = threads_for(nthreads, total);
    for (int t = 0; t < nt; ++t) {
        nhwc_job jb = {in, out, c, hw, nblk, total * t / nt, total * (t + 1) / nt};
        jobs[t] = jb;
    }
    fan_out(run, jobs, sizeof(nhwc_job), nt);
}

void lb_to_nhwc(const uint8_t *in, int64_t n, int64_t c, int64_t hw, uint8_t *out, int nthreads) {
    layout_copy(nhwc_run, in, n, c, hw, out, nthreads);
}

/* ---- NHWC -> NCHW of 8-bit codes (channels-last memory into a contiguous (n, c, h, w) tensor, e.g. before a
 * flatten): out[i, ch, p] = in[i, p, ch], in blocks of 64 pixels; inside a block, 16-pixel x 16-channel tiles are
 * transposed in SSE2 registers (four unpack stages: bytes, pairs, quads, eights), the edges byte by byte. A byte
 * move, so every body gives the same bytes. ---- */

static inline void t16x16(const uint8_t *src, int64_t ss, uint8_t *dst, int64_t ds) {
    __m128i a[16], b[16];
    for (int r = 0; r < 16; ++r) a[r] = _mm_loadu_si128((const __m128i *)(src + r * ss));
    for (int r = 0; r < 8; ++r) {  /* rows 2r, 2r + 1 interleaved: columns 0-7, then 8-15 */
        b[2 * r] = _mm_unpacklo_epi8(a[2 * r], a[2 * r + 1]);
        b[2 * r + 1] = _mm_unpackhi_epi8(a[2 * r], a[2 * r + 1]);
    }
    for (int g = 0; g < 4; ++g) {  /* rows 4g..4g+3: a[4g + k] holds columns 4k..4k+3, 4 bytes each */
        a[4 * g] = _mm_unpacklo_epi16(b[4 * g], b[4 * g + 2]);
        a[4 * g + 1] = _mm_unpackhi_epi16(b[4 * g], b[4 * g + 2]);
        a[4 * g + 2] = _mm_unpacklo_epi16(b[4 * g + 1], b[4 * g + 3]);
        a[4 * g + 3] = _mm_unpackhi_epi16(b[4 * g + 1], b[4 * g + 3]);
    }
    for (int h = 0; h < 2; ++h)  /* rows 8h..8h+7: b[8h + m] holds columns 2m, 2m + 1, 8 bytes each */
        for (int k = 0; k < 4; ++k) {
            b[8 * h + 2 * k] = _mm_unpacklo_epi32(a[8 * h + k], a[8 * h + 4 + k]);
            b[8 * h + 2 * k + 1] = _mm_unpackhi_epi32(a[8 * h + k], a[8 * h + 4 + k]);
        }
    for (int m = 0; m < 8; ++m) {  /* column 2m (and 2m + 1): rows 0-7 from b[m], rows 8-15 from b[8 + m] */
        _mm_storeu_si128((__m128i *)(dst + 2 * m * ds), _mm_unpacklo_epi64(b[m], b[8 + m]));
        _mm_storeu_si128((__m128i *)(dst + (2 * m + 1) * ds), _mm_unpackhi_epi64(b[m], b[8 + m]));
    }
}

static void *nchw_run(void *p) {
    const nhwc_job *j = p;  /* the same job fields: in is channels-last, out contiguous */
    const int64_t c = j->c, hw = j->hw, c16 = c & ~(int64_t)15;
    for (int64_t b = j->b0; b < j->b1; ++b) {
        const int64_t i = b / j->nblk, p0 = b % j->nblk * 64, p1 = p0 + 64 < hw ? p0 + 64 : hw;
        const uint8_t *src = j->in + i * c * hw;
        uint8_t *dst = j->out + i * c * hw;
        int64_t q = p0;
        for (; q + 16 <= p1; q += 16) {
            for (int64_t ch = 0; ch < c16; ch += 16) t16x16(src + q * c + ch, c, dst + ch * hw + q, hw);
            for (int64_t ch = c16; ch < c; ++ch)
                for (int64_t r = q; r < q + 16; ++r) dst[ch * hw + r] = src[r * c + ch];
        }
        for (int64_t ch = 0; ch < c; ++ch)
            for (int64_t r = q; r < p1; ++r) dst[ch * hw + r] = src[r * c + ch];
    }
    return NULL;
}

void lb_to_nchw(const uint8_t *in, int64_t n, int64_t c, int64_t hw, uint8_t *out, int nthreads) {
    layout_copy(nchw_run, in, n, c, hw, out, nthreads);
}

/* ---- patches of a conv (kernels/conv_split.gemm_conv: the conv as the Linear over its output pixels) ---- */

/* rows [r0, r1) of the patches of s (common.h) into out, row r0 first (k = kh kw c bytes a row) */
void lb_im2col_rows(const conv_src *s, int64_t r0, int64_t r1, uint8_t *out) {
    const int64_t kc = s->kw * s->c;
    uint8_t *o = out;
    for (int64_t r = r0; r < r1; ++r) {
        const int64_t b = r / (s->oh * s->ow), i = r / s->ow % s->oh, jj = r % s->ow;
        const int64_t x0 = jj * s->sx - s->px;
        for (int64_t di = 0; di < s->kh; ++di, o += kc) {
            const int64_t y = i * s->sy - s->py + di * s->dy;
            if (y < 0 || y >= s->h) {
                memset(o, s->zx, (size_t)kc);
                continue;
            }
            const uint8_t *row = s->x + (b * s->h + y) * s->w * s->c;
            if (s->dx == 1 && x0 >= 0 && x0 + s->kw <= s->w) {  /* the row's kw taps are one run of kw c bytes */
                memcpy(o, row + x0 * s->c, (size_t)kc);
                continue;
            }
            for (int64_t dj = 0; dj < s->kw; ++dj) {
                const int64_t x = x0 + dj * s->dx;
                if (x < 0 || x >= s->w)
                    memset(o + dj * s->c, s->zx, (size_t)s->c);
                else
                    memcpy(o + dj * s->c, row + x * s->c, (size_t)s->c);
            }
        }
    }
}

typedef struct { const conv_src *s; uint8_t *out; int64_t r0, r1; } col_job;

static void *col_run(void *p) {
    const col_job *j = p;
    lb_im2col_rows(j->s, j->r0, j->r1, j->out + j->r0 * j->s->kh * j->s->kw * j->s->c);
    return NULL;
}

/* Channels-last u8 codes x (n, h, w, c) as the rows of a kh x kw conv's patches: out (n oh ow, kh kw c) with
 * out[(b oh + i) ow + jj, (di kw + dj) c + ch] = x[b, i sy - py + di dy, jj sx - px + dj dx, ch], and zx where that
 * pixel lies in the padding (a tap at the zero point adds (zx - zx) w = 0 to the sums). */
void lb_im2col(const uint8_t *x, int64_t n, int64_t c, int64_t h, int64_t w, int64_t kh, int64_t kw, int64_t sy,
               int64_t sx, int64_t py, int64_t px, int64_t dy, int64_t dx, int zx, int64_t oh, int64_t ow, uint8_t *out,
               int nthreads) {
    const conv_src s = {x, h, w, c, kh, kw, sy, sx, py, px, dy, dx, oh, ow, zx};
    col_job jobs[MAX_THREADS];
    const int64_t rows = n * oh * ow;
    int nt = threads_for(nthreads, rows);
    for (int t = 0; t < nt; ++t) {
        col_job jb = {&s, out, rows * t / nt, rows * (t + 1) / nt};
        jobs[t] = jb;
    }
    fan_out(col_run, jobs, sizeof(col_job), nt);
}
