/* lowbit's native int8 Linears (common.h: the shared rules; gemm.py: the Python side): AVX2 kernels for CPUs without
 * VNNI, and their AVX-512 VNNI twins (vpdpbusd) where the CPU has it.
 *
 * Register-blocked kernels give the exact int32 sums acc[r, c] = Σ_i x[r, i] w[c, i] of u8 codes x and int8 weights
 * w (N, K): vpmaddubsw where the u8 × s8 pairs cannot saturate (codes ≤ 127, or saturation-safe weights: `pairs`).
 * One row (or a plan without packed weights): dot products of NC weight rows × up to 2 input rows in 8 accumulators
 * on the plain weights (blk_pairs; blk_sgn for other codes: |q - 128| against sign-adjusted weights, as below). From
 * BCAST_M rows: blk_bcast (`pairs`) or blk_bcast_s (any u8 codes: |q - 128| against sign-adjusted weights, ~0.83x
 * blk_bcast's speed) on weights packed once; with VNNI, blk_bcast_vnni from one row once the weights are packed. All
 * exact. Rows go in tiles whose codes stay in L2 (tile_rows), each in
 * chunks of MAX_ROWS; each thread owns whole blocks of columns, in chunks of CB columns whose sums stay in L1 until
 * the chunk's epilogue turns them into the output. blk_bcast_s's sign codes (2 bytes a code) are made per tile by each
 * thread into its own L2-sized buffer (session 27; before, one pass over the whole input wrote them to memory and every
 * column chunk read them back: 4096×384×32 0.93 → 0.78 ms with the faster tails below, 1 thread on Zen 3):
 *   a = acc - zx wsum[c]                              (the input zero point, exact in int32)
 *   mode 0  y = fl(fl(a) sc[c]) (+ bias[c])  (relu: 0 where < 0)                  float32, lowbit's epilogue
 *   mode 1  lowbit's codes of that y: clamp(round(fl(clamp(fl(y inv), vlo, vhi) + z)), 0, 255)
 *   mode 2  fbgemm's requantization (torch's quantized::linear): v = fl(fl(a) + bterm[c]) with
 *           bterm = fl(bias / fl(s_x s_w)), fl(v mult[c]) rounded by cvtps2dq (half to even; INT32_MIN past the
 *           int32 range), saturated to int16, + zo saturated, to [0, 255], then to [lo, hi]
 *   mode 3  the per-token rows: t = fl(fl(a) sc[c]); y = fl(fl(fma(ra[r], fw[c], t)) rs[r]) (+ bias[c])
 *   mode 5  mode 3 unfused: y = fl(fl(t - fl(ra[r] fw[c])) rs[r]) (+ bias[c])  (the generic per-token epilogue's
 *           floats: the 8-bit dynamic Linear without VNNI, at zx = 128 and ra = z_x - 128)
 *   (mode 4, the 8-bit per-token rows' weight split, went in session 26: mode 5 serves those rows at every M)
 * lb_conv_gemm runs a plan on a 2-d conv's patch rows (kernels/conv_split.gemm_conv), each thread making its tiles'
 * patches (pool.c lb_im2col_rows) where the many-row kernels read them.
 */
#include "common.h"
#include <pthread.h>

typedef int32_t __attribute__((may_alias, aligned(1))) i32u;  /* 4 codes read as one int32, anywhere */
#define NC 4          /* weight rows (output columns) per register block (store4 sums four) */
#ifndef MR
#define MR 2          /* input rows per register block (MR × NC accumulators) */
#endif
#define CB 64         /* output columns per epilogue chunk (a multiple of NC) */
#define MAX_ROWS 64   /* input rows per row chunk: a chunk's sums live in a (MAX_ROWS, CB) int32 buffer on the stack */
#define NB 16         /* columns per packed block of the many-row kernel (two vectors of sums) */
#ifndef MB
#define MB 4          /* input rows per many-row register block (MB × 2 accumulators) */
#endif
#ifndef BCAST_M
#define BCAST_M 2     /* rows from which a call with packed weights takes the many-row kernel (gemm.BCAST_M) */
#endif
/* bytes ahead each weight row is prefetched: one block of NC rows (at least 4 KiB), so a GEMV streaming its weights
 * from memory has the next block in flight (1×4096²: ~2x fewer stalls than none or 1 KiB, session 14) */
static int64_t pf_bytes(int64_t k) { return NC * k < 4096 ? 4096 : NC * k; }

typedef struct {
    const uint8_t *x; int64_t m, k, ldx; int32_t zx; const int8_t *w; const int32_t *wsum;
    int pairs, mode, relu; const float *sc, *bias; float inv, z, vlo, vhi; int32_t zo, lo, hi;
    const float *ra, *rs, *fw; void *out; int64_t ldo, n0, n1; int avx2; const int8_t *wp; int vnni;
    const uint8_t *xa; const int32_t *xc, *sw;  /* blk_bcast_s's inputs (xa, xc: blk_sgn's too; NULL elsewhere) */
    uint8_t *tile;  /* blk_bcast_s: this thread's buffer for a row tile's sign codes and row sums (lin_run makes them) */
    const conv_src *cv; uint8_t *patch;  /* lb_conv_gemm: the rows are cv's patches, one tile at a time into patch */
    int64_t rb, r_lo;  /* rows per tile (tile_rows); the job's rows are [r_lo, m) */
    const int8_t *wv;  /* blk_bcast_vnni's packing (lin_plan's wv), NULL where the VNNI kernels do not read it */
    int amx;  /* sums_amx makes the sums from wv (run_plan: AMX, k a multiple of 64) */
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
    if (j->mode == 5) t = (t - j->ra[r] * j->fw[c]) * j->rs[r];  /* (no contraction: -ffp-contract=off) */
    if (j->bias) t = t + j->bias[c];
    if (j->mode != 1) {
        ((float *)j->out)[r * j->ldo + c] = (j->relu && t < 0.f) ? 0.f : t;
        return;
    }
    float v = t * j->inv;
    v = v > j->vlo ? v : j->vlo;  /* maxps / minps as the vector bodies: NaN becomes vlo (common.h acc_code) */
    v = v < j->vhi ? v : j->vhi;
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

/* the four accumulators' sums into o[0, 4) (one hadd tree instead of four horizontal sums) */
__attribute__((target("avx2,fma"), always_inline))
static inline void hsum4(int32_t *o, const __m256i *a) {
    __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(a[0], a[1]), _mm256_hadd_epi32(a[2], a[3]));
    _mm_storeu_si128((__m128i *)o, _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1)));
}

/* hsum4 plus the scalar tails from i0 */
__attribute__((target("avx2,fma"), always_inline))
static inline void store4(int32_t *o, const __m256i *a, const lin_job *j, int64_t r, int64_t c0, int64_t i0) {
    hsum4(o, a);
    if (i0 < j->k)
        for (int c = 0; c < NC; ++c) o[c] += dot_scalar(j, r, c0 + c, i0);
}

/* sums of input rows [r0, r0 + nr) (nr ≤ 2) against weight rows [c0, c0 + NC) into o[r CB + c] */
__attribute__((target("avx2,fma"), always_inline))
static inline void blk_pairs(const lin_job *j, int64_t r0, const int nr, int64_t c0, int32_t *o) {
    const int64_t k = j->k, k32 = k & ~(int64_t)31, pf = pf_bytes(k);
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
            if (!(i & 63)) _mm_prefetch((const char *)(w + c * k + i + pf), _MM_HINT_T0);
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
#pragma GCC unroll 4
    for (int r = 0; r < nr; ++r)  /* (unrolled, as every loop over the sums: a rolled one keeps them on the stack) */
        store4(o + r * CB, a[r], j, r0 + r, c0, k32);
}

/* Any u8 codes, few rows (no packed weights: one row, or a plan below BCAST_M rows), session 26: blk_bcast_s's identity
 * on the plain weights. With a = q - 128 and the byte mask s = (a < 0 ? 0xFF : 0) (sign_rows: per row, each 32 codes
 * as 32 |a| then 32 s, rows kq 8 bytes apart as sign_codes' groups; xc[r] = Σ_{a < 0} |a| over [0, k32)):
 *   Σ_i q w = Σ_{i < k32} |a| (w xor s) + xc[r] + Σ_{i >= k32} (q - 128) w + 128 wsum[c]
 * (a w = |a| (w xor s) + |a| where a < 0: -w = ~w + 1). No vpmaddubsw pair leaves [-32768, 32512] (|a| ≤ 128); the
 * xor costs about what the int16 products of the kernel it replaces (blk_words) cost twice. */
__attribute__((target("avx2,fma"), always_inline))
static inline void blk_sgn(const lin_job *j, int64_t r0, const int nr, int64_t c0, int32_t *o) {
    const int64_t k = j->k, k32 = k & ~(int64_t)31, pf = pf_bytes(k), ld = (k + 3) / 4 * 8;
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
            if (!(i & 63)) _mm_prefetch((const char *)(w + c * k + i + pf), _MM_HINT_T0);
            wv[c] = _mm256_loadu_si256((const __m256i *)(w + c * k + i));
        }
#pragma GCC unroll 4
        for (int r = 0; r < nr; ++r) {
            const uint8_t *g = j->xa + (r0 + r) * ld + 2 * i;
            const __m256i av = _mm256_loadu_si256((const __m256i *)g), sv = _mm256_loadu_si256((const __m256i *)(g + 32));
#pragma GCC unroll 4
            for (int c = 0; c < NC; ++c)
                a[r][c] = _mm256_add_epi32(a[r][c], _mm256_madd_epi16(_mm256_maddubs_epi16(av, _mm256_xor_si256(wv[c], sv)),
                                                                      ones));
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < nr; ++r) {
        int32_t *orow = o + r * CB;
        hsum4(orow, a[r]);
        const uint8_t *xr = j->x + (r0 + r) * j->ldx;
        for (int c = 0; c < NC; ++c) {
            uint32_t t = (uint32_t)j->xc[r0 + r] + 128u * (uint32_t)j->wsum[c0 + c];  /* (wrapping: the sum is exact) */
            for (int64_t i = k32; i < k; ++i) t += (uint32_t)(((int32_t)xr[i] - 128) * w[c * k + i]);
            orow[c] = (int32_t)((uint32_t)orow[c] + t);
        }
    }
}

/* Many rows (m ≥ BCAST_M, `pairs`; blk_bcast_s below for any codes): weights packed once (gemm.pack_bcast) as
 * blocks of NB columns, wp[(b kq + g) 64 + 4 c + t] = w[b NB + c, 4 g + t] (kq = ceil(k / 4) groups of 4; zeros
 * past n and k).
 * Each step broadcasts 4 codes of an input row to every lane and multiplies them with one group of 16 columns (two
 * vectors): MB rows × 16 columns of int32 sums in registers, no horizontal sums, each weight block read once per
 * MB rows from L1 / L2 (the dot-product blocks above reread the input rows per 4 columns). Sums of rows
 * [r0, r0 + nr) against block b land in o[r CB + c], c < 16. */
__attribute__((target("avx2,fma"), always_inline))
static inline void blk_bcast(const lin_job *j, int64_t r0, const int nr, int64_t b, int32_t *o) {
    const int64_t kq = (j->k + 3) / 4, kf = j->k / 4;
    const int8_t *wp = j->wp + b * kq * 64;
    const __m256i ones = _mm256_set1_epi16(1);
    const uint8_t *xr[MB];
    __m256i a[MB][2];
#pragma GCC unroll 6
    for (int r = 0; r < nr; ++r) {
        xr[r] = j->x + (r0 + r) * j->ldx;
        a[r][0] = a[r][1] = _mm256_setzero_si256();
    }
    for (int64_t g = 0; g < kq; ++g) {
        _mm_prefetch((const char *)(wp + kq * 64 + g * 64), _MM_HINT_T0);  /* the next block's line: weights streaming
                                                                              from memory arrive ahead (4096²: 1.3x at M = 8) */
        const __m256i w0 = _mm256_loadu_si256((const __m256i *)(wp + g * 64));
        const __m256i w1 = _mm256_loadu_si256((const __m256i *)(wp + g * 64 + 32));
        if (g == kf) {  /* the last, partial group: its missing codes meet zero weights (never read past the row) */
#pragma GCC unroll 6
            for (int r = 0; r < nr; ++r) {
                int32_t v = 0;
                memcpy(&v, xr[r] + 4 * g, (size_t)(j->k - 4 * kf));
                const __m256i xb = _mm256_set1_epi32(v);
                a[r][0] = _mm256_add_epi32(a[r][0], _mm256_madd_epi16(_mm256_maddubs_epi16(xb, w0), ones));
                a[r][1] = _mm256_add_epi32(a[r][1], _mm256_madd_epi16(_mm256_maddubs_epi16(xb, w1), ones));
            }
            break;
        }
#pragma GCC unroll 6
        for (int r = 0; r < nr; ++r) {
            const __m256i xb = _mm256_set1_epi32(*(const i32u *)(xr[r] + 4 * g));
            a[r][0] = _mm256_add_epi32(a[r][0], _mm256_madd_epi16(_mm256_maddubs_epi16(xb, w0), ones));
            a[r][1] = _mm256_add_epi32(a[r][1], _mm256_madd_epi16(_mm256_maddubs_epi16(xb, w1), ones));
        }
    }
#pragma GCC unroll 6
    for (int r = 0; r < nr; ++r) {
        _mm256_storeu_si256((__m256i *)(o + r * CB), a[r][0]);
        _mm256_storeu_si256((__m256i *)(o + r * CB + 8), a[r][1]);
    }
}

/* blk_bcast for any u8 codes (not `pairs`) on a CPU without VNNI (session 25: 1.2-1.3x the int16 words kernel it
 * replaced, ~0.83x the pairs kernel; the xor is the difference). With a = q - 128 in [-128, 127], |a| in [0, 128]
 * and the byte mask s = 0xFF where a < 0 (else 0), w ^ s is w or ~w = -w - 1, so
 *   Σ_i q w = Σ_i |a| (w ^ s) + Σ_{i: a < 0} |a| + 128 Σ_i w
 * and no vpmaddubsw pair of |a| × (w ^ s) can saturate: a ≥ 0 gives |a| ≤ 127 against w in [-128, 127], a < 0 gives
 * |a| ≤ 128 against ~w in [-128, 127], so a pair sum lies in [-32768, 32512]. The xor runs beside the multiplies (a
 * sign instruction would share their ports: 77 against 97 GMAC/s peak on Zen 3). sign_codes lays the codes out per
 * row and group of 4 as |a| then s (8 bytes; zeros past k) with the row's Σ_{a < 0} |a| in xc; the accumulators start
 * at xc[r] + sw[c] (sw = 128 Σ w per column, zero past n: gemm.LinearPlan._pack). Weights packed as blk_bcast's. */
__attribute__((target("avx2,fma"), always_inline))
static inline void blk_bcast_s(const lin_job *j, int64_t r0, const int nr, int64_t b, int32_t *o, const int half) {
    const int64_t kq = (j->k + 3) / 4;
    const int8_t *wp = j->wp + b * kq * 64;
    const __m256i ones = _mm256_set1_epi16(1);
    const __m256i s0 = _mm256_loadu_si256((const __m256i *)(j->sw + b * NB)),
                  s1 = _mm256_loadu_si256((const __m256i *)(j->sw + b * NB + 8));
    const uint8_t *xr[MB];
    __m256i a[MB][2];
#pragma GCC unroll 6
    for (int r = 0; r < nr; ++r) {
        xr[r] = j->xa + (r0 + r) * kq * 8;
        const __m256i c = _mm256_set1_epi32(j->xc[r0 + r]);
        a[r][0] = _mm256_add_epi32(s0, c);
        a[r][1] = _mm256_add_epi32(s1, c);
    }
    for (int64_t g = 0; g < kq; ++g) {
        _mm_prefetch((const char *)(wp + kq * 64 + g * 64), _MM_HINT_T0);  /* as blk_bcast */
        const __m256i w0 = _mm256_loadu_si256((const __m256i *)(wp + g * 64));
        const __m256i w1 = half ? w0 : _mm256_loadu_si256((const __m256i *)(wp + g * 64 + 32));
#pragma GCC unroll 6
        for (int r = 0; r < nr; ++r) {
            const __m256i xb = _mm256_set1_epi32(*(const i32u *)(xr[r] + 8 * g));
            const __m256i sb = _mm256_set1_epi32(*(const i32u *)(xr[r] + 8 * g + 4));
            a[r][0] = _mm256_add_epi32(a[r][0], _mm256_madd_epi16(_mm256_maddubs_epi16(xb, _mm256_xor_si256(w0, sb)), ones));
            if (!half)
                a[r][1] = _mm256_add_epi32(a[r][1], _mm256_madd_epi16(_mm256_maddubs_epi16(xb, _mm256_xor_si256(w1, sb)), ones));
        }
    }
#pragma GCC unroll 6
    for (int r = 0; r < nr; ++r) {
        _mm256_storeu_si256((__m256i *)(o + r * CB), a[r][0]);
        if (!half) _mm256_storeu_si256((__m256i *)(o + r * CB + 8), a[r][1]);
    }
}

/* With AVX-512 VNNI (cpu_vnni): vpdpbusd adds four u8 × s8 products to an int32 lane in one step, exact for any u8
 * codes (no int16 stage to saturate), so every plan takes these two, `pairs` or not. blk_dot_vnni: blk_pairs's dot
 * products (one row, or a plan without the 4-group packing); blk_bcast_vnni: blk_bcast on the same packing, one
 * group of 16 columns × 4 codes as one 512-bit vector, RV_R rows × RV_V such vectors in registers. 6 × 4 (24 sums, 4
 * weight vectors and 6 broadcast codes per 24 vpdpbusd) ran 1.4-1.7x session 16's 16 rows × 1 vector (one broadcast
 * load per vpdpbusd) at 4-512 rows on a Zen 5 EPYC, 1.0-1.1x fbgemm and oneDNN at 16-128 rows (session 31); 8 × 3,
 * 4 × 4, 12 × 2 and 14 × 2 were 0-10 % slower, 7 × 3 10-30 %. Every loop over the sums is unrolled (a loop left
 * rolled puts them on the stack). */
__attribute__((target("avx2,fma,avx512f,avx512bw,avx512vl,avx512vnni"), always_inline))
static inline void blk_dot_vnni(const lin_job *j, int64_t r0, const int nr, int64_t c0, int32_t *o) {
    const int64_t k = j->k, k64 = k & ~(int64_t)63, pf = pf_bytes(k);
    const int8_t *w = j->w + c0 * k;
    __m512i a[MR][NC];
#pragma GCC unroll 4
    for (int r = 0; r < nr; ++r)
#pragma GCC unroll 4
        for (int c = 0; c < NC; ++c) a[r][c] = _mm512_setzero_si512();
    for (int64_t i = 0; i < k64; i += 64) {
        __m512i wv[NC];
#pragma GCC unroll 4
        for (int c = 0; c < NC; ++c) {
            _mm_prefetch((const char *)(w + c * k + i + pf), _MM_HINT_T1);  /* into L2: NC rows × pf bytes ahead would overrun L1 */
            wv[c] = _mm512_loadu_si512((const void *)(w + c * k + i));
        }
#pragma GCC unroll 4
        for (int r = 0; r < nr; ++r) {
            __m512i xv = _mm512_loadu_si512((const void *)(j->x + (r0 + r) * j->ldx + i));
#pragma GCC unroll 4
            for (int c = 0; c < NC; ++c) a[r][c] = _mm512_dpbusd_epi32(a[r][c], xv, wv[c]);
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < nr; ++r) {  /* (both halves extracted: a cast of the low half made GCC copy all 8 sums twice
                                     * per step of the loop above, 16 moves per 8 vpdpbusd) */
        __m256i h[NC];
#pragma GCC unroll 4
        for (int c = 0; c < NC; ++c)
            h[c] = _mm256_add_epi32(_mm512_extracti64x4_epi64(a[r][c], 0), _mm512_extracti64x4_epi64(a[r][c], 1));
        store4(o + r * CB, h, j, r0 + r, c0, k64);
    }
}

#ifndef RV_R
#define RV_R 6        /* input rows per register block of blk_bcast_vnni (at most 8: rows_vnni's remainders) */
#endif
#if RV_R > 8
#error "RV_R above 8: rows_vnni's remainder cases stop at 7"
#endif
#ifndef RV_V
#define RV_V 4        /* 16-column vectors per register block (RV_R × RV_V accumulators, RV_V weight vectors) */
#endif
#ifndef RV_PF
#define RV_PF 16384   /* bytes ahead the weight stream is prefetched into L1 */
#endif
/* rows [r0, r0 + nr) against the nv blocks of chunk ch (16 nv columns) into o (row stride CB): per group of 4 codes,
 * nv weight vectors (consecutive: gemm.pack_vnni lays each chunk's blocks out group by group, one stream) and nr
 * broadcast codes feed nr nv vpdpbusd */
__attribute__((target("avx2,fma,avx512f,avx512bw,avx512vl,avx512vnni"), always_inline))
static inline void blk_bcast_vnni(const lin_job *j, int64_t r0, const int nr, int64_t ch, const int nv, int32_t *o) {
    const int64_t kq = (j->k + 3) / 4, kf = j->k / 4, ldx = j->ldx, gs = nv * 64;
    const int8_t *wp = j->wv + ch * kq * (RV_V * 64);
    const uint8_t *x = j->x + r0 * ldx;
    __m512i a[RV_R][RV_V];
#pragma GCC unroll 16
    for (int r = 0; r < nr; ++r)
#pragma GCC unroll 4
        for (int v = 0; v < nv; ++v) a[r][v] = _mm512_setzero_si512();
    for (int64_t g = 0; g < kf; ++g) {
        __m512i w[RV_V];
#pragma GCC unroll 4
        for (int v = 0; v < nv; ++v) {
            _mm_prefetch((const char *)(wp + g * gs + v * 64 + RV_PF), _MM_HINT_T0);  /* (never faults past the end) */
            w[v] = _mm512_loadu_si512((const void *)(wp + g * gs + v * 64));
        }
#pragma GCC unroll 16
        for (int r = 0; r < nr; ++r) {
            const __m512i xb = _mm512_set1_epi32(*(const i32u *)(x + r * ldx + 4 * g));
#pragma GCC unroll 4
            for (int v = 0; v < nv; ++v) a[r][v] = _mm512_dpbusd_epi32(a[r][v], xb, w[v]);
        }
    }
    if (kq > kf) {  /* the last k % 4 codes, zeros past k in the packing */
#pragma GCC unroll 16
        for (int r = 0; r < nr; ++r) {
            int32_t c4 = 0;
            memcpy(&c4, x + r * ldx + 4 * kf, (size_t)(j->k - 4 * kf));
            const __m512i xb = _mm512_set1_epi32(c4);
#pragma GCC unroll 4
            for (int v = 0; v < nv; ++v)
                a[r][v] = _mm512_dpbusd_epi32(a[r][v], xb, _mm512_loadu_si512((const void *)(wp + kf * gs + v * 64)));
        }
    }
#pragma GCC unroll 16
    for (int r = 0; r < nr; ++r)
#pragma GCC unroll 4
        for (int v = 0; v < nv; ++v) _mm512_storeu_si512((void *)(o + r * CB + v * NB), a[r][v]);
}

/* every row against chunk b's nv blocks: whole blocks of RV_R rows, then the rest (constant shapes: registers) */
__attribute__((target("avx2,fma,avx512f,avx512bw,avx512vl,avx512vnni"), always_inline))
static inline void rows_vnni(const lin_job *j, int64_t b, const int nv, int32_t *o) {
    int64_t r = 0;
    for (; r + RV_R <= j->m; r += RV_R) blk_bcast_vnni(j, r, RV_R, b, nv, o + r * CB);
#define RV_REST(n) case n: blk_bcast_vnni(j, r, n < RV_R ? n : RV_R, b, nv, o + r * CB); break;
    switch (j->m - r) {  /* (each case a constant: n >= RV_R never comes) */
        RV_REST(7) RV_REST(6) RV_REST(5) RV_REST(4) RV_REST(3) RV_REST(2) RV_REST(1)
    }
#undef RV_REST
}

/* the chunk's sums of columns [cs, ce) for every row by the VNNI kernels: blk_bcast_vnni on j->wv's chunks of RV_V
 * blocks (64 columns: the column chunks and the threads' ranges start on them), else the dot products */
__attribute__((target("avx2,fma,avx512f,avx512bw,avx512vl,avx512vnni")))
static void sums_vnni(const lin_job *j, int64_t cs, int64_t ce, int32_t *buf) {
    if (j->wv) {
        for (int64_t c0 = cs; c0 < ce; c0 += RV_V * NB) {
            const int64_t left = (j->ldo - c0 + NB - 1) / NB;  /* (the chunk's blocks as packed: ldo is the plan's n) */
            int32_t *o = buf + (c0 - cs);
            switch (left >= RV_V ? RV_V : left) {
#if RV_V > 3
                case 3: rows_vnni(j, c0 / (RV_V * NB), 3, o); break;
#endif
#if RV_V > 2
                case 2: rows_vnni(j, c0 / (RV_V * NB), 2, o); break;
#endif
                case 1: rows_vnni(j, c0 / (RV_V * NB), 1, o); break;
                default: rows_vnni(j, c0 / (RV_V * NB), RV_V, o); break;
            }
        }
        return;
    }
    for (int64_t c0 = cs; c0 < ce; c0 += NC) {
        int32_t *o = buf + (c0 - cs);
        if (c0 + NC > ce) {  /* the columns past the last whole block: scalar dots */
            for (int64_t c = c0; c < ce; ++c)
                for (int64_t r = 0; r < j->m; ++r) buf[r * CB + (c - cs)] = dot_scalar(j, r, c, 0);
            continue;
        }
        int64_t r = 0;
        for (; r + MR <= j->m; r += MR) blk_dot_vnni(j, r, MR, c0, o + r * CB);
        switch (j->m - r) {
            case 3: blk_dot_vnni(j, r, 3 < MR ? 3 : MR, c0, o + r * CB); break;
            case 2: blk_dot_vnni(j, r, 2 < MR ? 2 : MR, c0, o + r * CB); break;
            case 1: blk_dot_vnni(j, r, 1, c0, o + r * CB); break;
        }
    }
}

/* With AMX int8 (cpu_amx): the same sums from the same packing by tile dot products. A B tile is 16 groups of 4 codes
 * (64 codes of k) × one block of 16 columns, i.e. 16 consecutive group vectors of blk_bcast_vnni's packing at the
 * chunk's group stride; an A tile is 16 rows × those 64 codes of x. tdpbusd adds each u8 × s8 group of 4 products to
 * its int32 sum: the exact Σ_k x w of every (row, column), as vpdpbusd (k a multiple of 64: run_plan). Tiles 0-3: the
 * sums of up to 16 rows × the chunk's nv blocks, 4: the rows' codes, 5: one block's weights. */
#if RV_V > 4
#error "RV_V above 4: sums_amx keeps a chunk's blocks in tiles 0-3"
#endif
#ifndef AMX_M
#define AMX_M 8  /* rows from which run_plan takes sums_amx: a rows plan, 1 thread, Xeon (session 51), AMX / VNNI time at
                  * 1 / 2 / 4 / 8 / 16 / 64 / 512 rows: 1.16 / 1.04 / 1.05 / 0.95 / 0.84 / 0.61 / 0.54 (384 -> 384),
                  * 1.49 / 1.26 / 1.21 / 0.74 / 0.55 / 0.46 / 0.53 (1536 -> 384), 1.52 / 1.28 / 1.38 / 0.92 / 0.75 / 0.63 /
                  * 0.70 (384 -> 1536) */
#endif
typedef struct __attribute__((packed)) {
    uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16];
} amx_cfg;

__attribute__((target("amx-tile,amx-int8"), always_inline))
static inline void amx_load_cfg(int rt) {
    amx_cfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 6; ++t) { cfg.colsb[t] = 64; cfg.rows[t] = (uint8_t)(t == 5 ? 16 : rt); }
    _tile_loadconfig(&cfg);
}

#define AMX_BLK(v) do { _tile_loadd(5, wk + v * 64, gs); _tile_dpbusd(v, 4, 5); } while (0)
__attribute__((target("amx-tile,amx-int8")))
static void sums_amx(const lin_job *j, int64_t cs, int64_t ce, int32_t *buf) {
    const int64_t kq = j->k / 4, ks = j->k / 64, ldx = j->ldx;
    int cur = -1;
    for (int64_t c0 = cs; c0 < ce; c0 += RV_V * NB) {
        const int64_t left = (j->ldo - c0 + NB - 1) / NB;
        const int nv = left >= RV_V ? RV_V : (int)left;
        const int64_t gs = nv * 64;
        const int8_t *wp = j->wv + (c0 / (RV_V * NB)) * kq * (RV_V * 64);
        int32_t *o = buf + (c0 - cs);
        for (int64_t r0 = 0; r0 < j->m; r0 += 16) {
            const int rt = j->m - r0 < 16 ? (int)(j->m - r0) : 16;
            if (rt != cur) { amx_load_cfg(rt); cur = rt; }
            _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
            const uint8_t *x = j->x + r0 * ldx;
            for (int64_t kk = 0; kk < ks; ++kk) {
                const int8_t *wk = wp + kk * 16 * gs;
                _tile_loadd(4, x + kk * 64, ldx);
                AMX_BLK(0);
                if (nv > 1) AMX_BLK(1);
                if (nv > 2) AMX_BLK(2);
                if (nv > 3) AMX_BLK(3);
            }
            int32_t *d = o + r0 * CB;
            _tile_stored(0, d, CB * 4);
            if (nv > 1) _tile_stored(1, d + NB, CB * 4);
            if (nv > 2) _tile_stored(2, d + 2 * NB, CB * 4);
            if (nv > 3) _tile_stored(3, d + 3 * NB, CB * 4);
        }
    }
    _tile_release();
}
#undef AMX_BLK

/* rows [r0, r0 + nr) against packed block b by the plan's kernel (half: blk_bcast_s's first 8 columns only) */
__attribute__((target("avx2,fma"), always_inline))
static inline void blk_packed(const lin_job *j, int64_t r0, const int nr, int64_t b, int32_t *o, const int half) {
    if (j->xa)
        blk_bcast_s(j, r0, nr, b, o, half);
    else
        blk_bcast(j, r0, nr, b, o);
}

/* every row's sums against block b into o (half: the block's last column is below its 9th) */
__attribute__((target("avx2,fma"), always_inline))
static inline void rows_bcast(const lin_job *j, int64_t b, int32_t *o, const int half) {
    int64_t r = 0;
    for (; r + MB <= j->m; r += MB) blk_packed(j, r, MB, b, o + r * CB, half);
    switch (j->m - r) {
        case 5: blk_packed(j, r, 5 < MB ? 5 : MB, b, o + r * CB, half); break;
        case 4: blk_packed(j, r, 4 < MB ? 4 : MB, b, o + r * CB, half); break;
        case 3: blk_packed(j, r, 3 < MB ? 3 : MB, b, o + r * CB, half); break;
        case 2: blk_packed(j, r, 2, b, o + r * CB, half); break;
        case 1: blk_packed(j, r, 1, b, o + r * CB, half); break;
    }
}

/* the chunk's sums of columns [cs, ce) (cs a multiple of NB) for every row by blk_packed; a last block of at most 8
 * columns takes half of blk_bcast_s (session 28: MobileNetV2's projections to 24 channels multiplied 32) */
__attribute__((target("avx2,fma")))
static void sums_bcast(const lin_job *j, int64_t cs, int64_t ce, int32_t *buf) {
    for (int64_t c0 = cs; c0 < ce; c0 += NB) {
        if (ce - c0 <= NB / 2)
            rows_bcast(j, c0 / NB, buf + (c0 - cs), 1);
        else
            rows_bcast(j, c0 / NB, buf + (c0 - cs), 0);
    }
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
        for (; r + MR <= j->m; r += MR) blk_sgn(j, r, MR, c0, o + r * CB);
        switch (j->m - r) {
            case 3: blk_sgn(j, r, 3 < MR ? 3 : MR, c0, o + r * CB); break;
            case 2: blk_sgn(j, r, 2 < MR ? 2 : MR, c0, o + r * CB); break;
            case 1: blk_sgn(j, r, 1, c0, o + r * CB); break;
        }
    }
}

/* mode 1's codes of columns [c, c + 8) (o: the chunk's sums as in epi_avx2) as int32 in [INT32_MIN, 255]: store_one's
 * float32 steps in its order (common.h acc_codes8; a NaN became vlo at the max, as in store_one) */
__attribute__((target("avx2,fma"), always_inline))
static inline __m256i codes8(const lin_job *j, int64_t c, const int32_t *o, const int32_t *zw) {
    __m256i acc = _mm256_loadu_si256((const __m256i *)(o + c));
    if (zw) acc = _mm256_sub_epi32(acc, _mm256_loadu_si256((const __m256i *)(zw + c)));
    return acc_codes8(acc, j->sc + c, j->bias ? j->bias + c : NULL, j->inv, j->z, j->vlo, j->vhi);
}

/* the chunk's epilogue, columns [cs, ce) of row r from o = sums + r CB - cs; zw (NULL where zx = 0): the chunk's
 * zx wsum[c] at zw[c], made once per chunk by lin_run (a vpmulld per 8 sums before) */
__attribute__((target("avx2,fma")))
static void epi_avx2(const lin_job *j, int64_t r, int64_t cs, int64_t ce, const int32_t *o, const int32_t *zw) {
    const __m256 zero = _mm256_setzero_ps();
    int64_t c = cs;
    if (j->mode == 1) {  /* 32 codes a step, four packs instead of twelve (session 28: K = 16 spent 1.7x its sums here) */
        uint8_t *dst = (uint8_t *)j->out + r * j->ldo;
        /* the packs leave dwords of 4 codes in column order 0, 2, 4, 6, 1, 3, 5, 7 */
        const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
        for (; c + 32 <= ce; c += 32) {
            __m256i p01 = _mm256_packus_epi32(codes8(j, c, o, zw), codes8(j, c + 8, o, zw));
            __m256i p23 = _mm256_packus_epi32(codes8(j, c + 16, o, zw), codes8(j, c + 24, o, zw));
            __m256i b = _mm256_permutevar8x32_epi32(_mm256_packus_epi16(p01, p23), order);
            _mm256_storeu_si256((__m256i *)(dst + c), b);
        }
        for (; c + 8 <= ce; c += 8) {
            __m256i q = codes8(j, c, o, zw);
            __m128i q16 = _mm_packus_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
            _mm_storel_epi64((__m128i *)(dst + c), _mm_packus_epi16(q16, q16));
        }
    }
    for (; c + 8 <= ce; c += 8) {  /* (the other modes) */
        __m256i acc = _mm256_loadu_si256((const __m256i *)(o + c));
        if (zw) acc = _mm256_sub_epi32(acc, _mm256_loadu_si256((const __m256i *)(zw + c)));
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
        if (j->mode == 5)
            t = _mm256_mul_ps(_mm256_sub_ps(t, _mm256_mul_ps(_mm256_set1_ps(j->ra[r]), _mm256_loadu_ps(j->fw + c))),
                              _mm256_set1_ps(j->rs[r]));
        if (j->bias) t = _mm256_add_ps(t, _mm256_loadu_ps(j->bias + c));
        _mm256_storeu_ps((float *)j->out + r * j->ldo + c, j->relu ? _mm256_max_ps(zero, t) : t);
    }
    for (; c < ce; ++c) store_one(j, r, c, o[c]);
}

/* the chunk's sums of columns [cs, ce) for every row into buf[r CB + c - cs] */
static void chunk_sums(const lin_job *j, int64_t cs, int64_t ce, int32_t *buf) {
    if (j->amx) {
        sums_amx(j, cs, ce, buf);
        return;
    }
    if (j->vnni) {
        sums_vnni(j, cs, ce, buf);
        return;
    }
    if (j->wp) {
        sums_bcast(j, cs, ce, buf);
        return;
    }
    for (int64_t c0 = cs; c0 < ce; c0 += NC) {
        if (j->avx2 && c0 + NC <= ce) {
            sums_avx2(j, c0, buf + (c0 - cs));
            continue;
        }
        for (int64_t c = c0; c < ce && c < c0 + NC; ++c)
            for (int64_t r = 0; r < j->m; ++r) buf[r * CB + (c - cs)] = dot_scalar(j, r, c, 0);
    }
}

/* rows per tile of lin_run: as many whole row chunks as keep the many-row kernels' codes (k bytes a row, 2k for
 * blk_bcast_s's |a| and masks) within TILE_BYTES, so the column chunks after the first read them from L2 rather than
 * from L3 (4096×384²: the codes are 3 MiB, read once per 64 columns) */
#ifndef TILE_BYTES
#define TILE_BYTES (256 << 10)
#endif
#ifndef ROWS_SPLIT_BYTES
#define ROWS_SPLIT_BYTES (64 << 10)
#endif
static int64_t tile_rows(int64_t m, int64_t k, int packed, int sgn, int conv) {
    if (!packed) return m;
    const int64_t row = k * ((sgn ? 2 : 0) + (conv || !sgn ? 1 : 0));  /* (a conv's patch rows too) */
    const int64_t r = TILE_BYTES / (row > 0 ? row : 1) / MAX_ROWS * MAX_ROWS;
    return r < MAX_ROWS ? (MAX_ROWS < m ? MAX_ROWS : m) : r < m ? r : m;
}

/* blk_bcast_s's codes of u8 x (rows [r0, r1) of k codes; row stride ldx), a = q ^ 0x80 = q - 128: per row, each
 * group of 4 codes as |a| then the mask s = (a < 0 ? 0xFF : 0), 8 bytes per group, zeros past k (rows of 8 kq bytes,
 * kq = ceil(k / 4), in xa), and xc[r] = Σ_{a < 0} |a| (sign_codes) */
typedef struct { const uint8_t *x; int64_t k, ldx, r0, r1; uint8_t *xa; int32_t *xc; } sign_job;
static void *sign_codes(void *p);

static void *lin_run(void *p) {
    const lin_job *j0 = p;
    int32_t buf[MAX_ROWS * CB], zw[CB];  /* a row chunk's sums; the column chunk's zx wsum (epi_avx2) */
    const size_t osz = (j0->mode == 1 || j0->mode == 2) ? 1 : sizeof(float);
    const int64_t rb = j0->rb, kq8 = (j0->k + 3) / 4 * 8;
    int32_t *txc = j0->tile ? (int32_t *)(j0->tile + rb * kq8) : NULL;  /* the tile's row sums, after its codes */
    /* row tiles whose codes stay in L2 while every column chunk reads them */
    for (int64_t t0 = j0->r_lo; t0 < j0->m; t0 += rb) {
        const int64_t t1 = t0 + rb < j0->m ? t0 + rb : j0->m;
        const uint8_t *src = j0->x;  /* row r of the codes at src + (r - base) ld */
        int64_t base = 0, ld = j0->ldx;
        if (j0->cv) {  /* a conv's patch rows of this tile, made by the thread that reads them (lb_conv_gemm) */
            lb_im2col_rows(j0->cv, t0, t1, j0->patch);
            src = j0->patch;
            base = t0;
            ld = j0->k;
        }
        if (j0->tile) {  /* blk_bcast_s's codes of this tile, made by the thread that reads them (file comment) */
            sign_job sj = {src + (t0 - base) * ld, j0->k, ld, 0, t1 - t0, j0->tile, txc};
            sign_codes(&sj);
        }
        for (int64_t cs = j0->n0; cs < j0->n1; cs += CB) {
            const int64_t ce = cs + CB < j0->n1 ? cs + CB : j0->n1;
            for (int64_t r0 = t0; r0 < t1; r0 += MAX_ROWS) {  /* rows in chunks of MAX_ROWS: this chunk as a job */
                lin_job jr = *j0;
                const lin_job *j = &jr;
                jr.m = t1 - r0 < MAX_ROWS ? t1 - r0 : MAX_ROWS;
                jr.x = src + (r0 - base) * ld;
                jr.ldx = ld;
                jr.xa = j0->tile ? j0->tile + (r0 - t0) * kq8 : j0->xa ? j0->xa + r0 * kq8 : NULL;
                jr.xc = j0->tile ? txc + (r0 - t0) : j0->xc ? j0->xc + r0 : NULL;
                jr.ra = j0->ra ? j0->ra + r0 : NULL;
                jr.rs = j0->rs ? j0->rs + r0 : NULL;
                jr.out = (char *)j0->out + (size_t)(r0 * j0->ldo) * osz;
                chunk_sums(j, cs, ce, buf);
                if (j->avx2 && j->zx && r0 == t0)
                    for (int64_t c = cs; c < ce; ++c) zw[c - cs] = j->zx * j->wsum[c];
                for (int64_t r = 0; r < j->m; ++r) {
                    if (j->avx2) {
                        epi_avx2(j, r, cs, ce, buf + r * CB - cs, j->zx ? zw - cs : NULL);
                        continue;
                    }
                    for (int64_t c = cs; c < ce; ++c) store_one(j, r, c, buf[r * CB + (c - cs)]);
                }
            }
        }
    }
    return NULL;
}

/* 32 codes v (already q ^ 0x80) as 8 groups of |a| and s: groups 0-3 in *g03, 4-7 in *g47 (32 bytes each); their
 * Σ_{a < 0} |a| added to *neg */
__attribute__((target("avx2,fma"), always_inline))
static inline void sign32v(const __m256i v, __m256i *g03, __m256i *g47, __m256i *neg) {
    const __m256i zero = _mm256_setzero_si256();
    const __m256i a = _mm256_abs_epi8(v), s = _mm256_cmpgt_epi8(zero, v);
    *neg = _mm256_add_epi64(*neg, _mm256_sad_epu8(_mm256_and_si256(a, s), zero));
    const __m256i lo = _mm256_unpacklo_epi32(a, s), hi = _mm256_unpackhi_epi32(a, s);
    *g03 = _mm256_permute2x128_si256(lo, hi, 0x20);
    *g47 = _mm256_permute2x128_si256(lo, hi, 0x31);
}

/* sign32v's 64 bytes stored at dst */
__attribute__((target("avx2,fma"), always_inline))
static inline void sign32(const __m256i v, uint8_t *dst, __m256i *neg) {
    __m256i g03, g47;
    sign32v(v, &g03, &g47, neg);
    _mm256_storeu_si256((__m256i *)dst, g03);
    _mm256_storeu_si256((__m256i *)(dst + 32), g47);
}

/* sign_codes for dense rows of fewer than 32 codes, k % 8 == 0 (session 26): there each group of 4 codes maps to 8
 * bytes whatever its row, so the rows' codes go through sign32 as one array, 32 at a time, and each 64-bit lane of the negative
 * sums (8 codes) belongs to one row; only the array's last 8-24 codes take the padded block. Rows with fewer than
 * 32 codes (an image model's 1x1 convs: k = 16, 24) ran the padded block on every row before: 100352 × 16 codes 2.0
 * ms of the 8.7 ms Linear. */
__attribute__((target("avx2,fma")))
static void sign_flat(const sign_job *j) {
    const __m256i flip = _mm256_set1_epi8((char)0x80), zero = _mm256_setzero_si256();
    const int64_t k = j->k, total = (j->r1 - j->r0) * k;
    const uint8_t *src = j->x + j->r0 * k;
    uint8_t *dst = j->xa + j->r0 * 2 * k;  /* (kq 8 = 2 k) */
    int64_t row = j->r0, left = k, i = 0;
    int64_t acc = 0;
    int64_t lanes[4];
    for (; i < total; i += 32) {
        __m256i neg = zero;
        int n8 = 4;
        if (i + 32 <= total) {
            sign32(_mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(src + i)), flip), dst + 2 * i, &neg);
        } else {  /* the last 8, 16 or 24 codes through a block of code 128 (|a| = 0, s = 0) */
            uint8_t tail[32], out[64];
            memset(tail, 0x80, sizeof tail);
            memcpy(tail, src + i, (size_t)(total - i));
            sign32(_mm256_xor_si256(_mm256_loadu_si256((const __m256i *)tail), flip), out, &neg);
            memcpy(dst + 2 * i, out, (size_t)(2 * (total - i)));
            n8 = (int)((total - i) / 8);
        }
        _mm256_storeu_si256((__m256i *)lanes, neg);
        for (int t = 0; t < n8; ++t) {
            acc += lanes[t];
            if ((left -= 8) == 0) {
                j->xc[row++] = (int32_t)acc;
                acc = 0;
                left = k;
            }
        }
    }
}

__attribute__((target("avx2,fma")))
static void *sign_codes(void *p) {
    const sign_job *j = p;
    const __m256i flip = _mm256_set1_epi8((char)0x80);
    const int64_t k = j->k, kq = (k + 3) / 4, k32 = k & ~(int64_t)31, t = k - k32;
    if (j->ldx == k && k % 8 == 0 && k < 32) {
        sign_flat(j);
        return NULL;
    }
    /* a row's tail of 8, 16 or 24 codes by vector loads, a = 0 past it (the flip only over the tail's bytes): rows of
     * k % 8 == 0 codes from 32 up went through sign_flat until session 27, whose per-lane bookkeeping (a vector
     * stored and reread as four int64) cost ~0.16 ns a code, most of the pass; a memcpy'd tail block per row cost
     * calls */
    static const uint8_t half[64] = {0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80,
                                     0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80,
                                     0x80, 0x80, 0x80, 0x80};
    const __m256i tflip = _mm256_loadu_si256((const __m256i *)(half + 32 - t % 32));
    for (int64_t r = j->r0; r < j->r1; ++r) {
        const uint8_t *xr = j->x + r * j->ldx;
        uint8_t *dst = j->xa + r * kq * 8;
        __m256i neg = _mm256_setzero_si256();
        for (int64_t i = 0; i < k32; i += 32)
            sign32(_mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(xr + i)), flip), dst + 2 * i, &neg);
        if (t && t % 8 == 0) {
            const uint8_t *xt = xr + k32;
            const __m128i lo = t >= 16 ? _mm_loadu_si128((const __m128i *)xt) : _mm_loadl_epi64((const __m128i *)xt);
            const __m128i hi = t == 24 ? _mm_loadl_epi64((const __m128i *)(xt + 16)) : _mm_setzero_si128();
            __m256i g03, g47;
            sign32v(_mm256_xor_si256(_mm256_set_m128i(hi, lo), tflip), &g03, &g47, &neg);
            if (t == 8) {
                _mm_storeu_si128((__m128i *)(dst + 2 * k32), _mm256_castsi256_si128(g03));
            } else {
                _mm256_storeu_si256((__m256i *)(dst + 2 * k32), g03);
                if (t == 24) _mm_storeu_si128((__m128i *)(dst + 2 * k32 + 32), _mm256_castsi256_si128(g47));
            }
        } else if (t) {  /* the tail through a block of code 128 (a = 0: |a| = 0, s = 0, the groups' zero padding) */
            uint8_t tail[32], out[64];
            memset(tail, 0x80, sizeof tail);
            memcpy(tail, xr + k32, (size_t)t);
            sign32(_mm256_xor_si256(_mm256_loadu_si256((const __m256i *)tail), flip), out, &neg);
            memcpy(dst + 2 * k32, out, (size_t)(8 * kq - 2 * k32));
        }
        j->xc[r] = (int32_t)(_mm256_extract_epi64(neg, 0) + _mm256_extract_epi64(neg, 1) + _mm256_extract_epi64(neg, 2) +
                             _mm256_extract_epi64(neg, 3));
    }
    return NULL;
}

/* blk_sgn's codes: per row, each 32 codes (a = q - 128) as 32 |a| then 32 s, 64 bytes per 32 codes, rows kq 8 bytes apart
 * (sign_codes' row stride), and xc[r] = Σ_{a < 0} |a| over [0, k32) (the tail stays with the codes) */
__attribute__((target("avx2,fma")))
static void *sign_rows(void *p) {
    const sign_job *j = p;
    const __m256i flip = _mm256_set1_epi8((char)0x80), zero = _mm256_setzero_si256();
    const int64_t k32 = j->k & ~(int64_t)31, ld = (j->k + 3) / 4 * 8;
    for (int64_t r = j->r0; r < j->r1; ++r) {
        const uint8_t *xr = j->x + r * j->ldx;
        uint8_t *dst = j->xa + r * ld;
        __m256i neg = zero;
        for (int64_t i = 0; i < k32; i += 32) {
            const __m256i v = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(xr + i)), flip);
            const __m256i a = _mm256_abs_epi8(v), s = _mm256_cmpgt_epi8(zero, v);
            neg = _mm256_add_epi64(neg, _mm256_sad_epu8(_mm256_and_si256(a, s), zero));
            _mm256_storeu_si256((__m256i *)(dst + 2 * i), a);
            _mm256_storeu_si256((__m256i *)(dst + 2 * i + 32), s);
        }
        j->xc[r] = (int32_t)(_mm256_extract_epi64(neg, 0) + _mm256_extract_epi64(neg, 1) + _mm256_extract_epi64(neg, 2) +
                             _mm256_extract_epi64(neg, 3));
    }
    return NULL;
}

/* The calling thread's buffer for sign_codes' and sign_rows' output, kept between calls up to SIGN_KEEP bytes (a
 * fresh malloc of megabytes per call is a fresh mapping, page-faulted on every write) and freed when the thread ends
 * (the key's destructor); a larger call takes its own malloc, freed by sign_release. NULL when out of memory. */
#define SIGN_KEEP ((size_t)64 << 20)
typedef struct { uint8_t *p; size_t cap; } sign_store;
static pthread_key_t sign_key;
static pthread_once_t sign_once = PTHREAD_ONCE_INIT;
static void sign_drop(void *v) { sign_store *st = v; free(st->p); free(st); }
static void sign_init(void) { pthread_key_create(&sign_key, sign_drop); }

static uint8_t *sign_buffer(size_t bytes) {
    if (bytes > SIGN_KEEP) return malloc(bytes);
    pthread_once(&sign_once, sign_init);
    sign_store *st = pthread_getspecific(sign_key);
    if (!st) {
        st = calloc(1, sizeof *st);
        if (!st || pthread_setspecific(sign_key, st)) { free(st); return NULL; }
    }
    if (bytes > st->cap) {
        free(st->p);  /* (nothing to keep: every call writes the buffer whole) */
        st->p = malloc(bytes);
        st->cap = st->p ? bytes : 0;
    }
    return st->p;
}

static void sign_release(uint8_t *buf, size_t bytes) { if (bytes > SIGN_KEEP) free(buf); }

/* A layer's constants, made once (lowbit.native.gemm.LinearPlan mirrors this layout): int8 weights w (n, k)
 * contiguous, wsum[c] = Σ_i w[c, i] (read when a call's zx != 0, and by blk_sgn), the mode's per-column vectors
 * (sc / bias; mode 2: mult / bterm; modes 3 and 5: fw too; bias may be NULL) and scalars (inv, z, vlo, vhi: mode 1;
 * zo, lo, hi: mode 2). pairs: every u8 × s8 pair sum fits int16 (codes ≤ 127 or saturation-safe weights).
 * wp: the AVX2 many-row kernels' packing of w in groups of 4 codes (NULL until a call with BCAST_M rows or more
 * makes it);
 * sw: 128 Σ w per column, zeros past n to a whole block, made with wp for a plan without `pairs` (blk_bcast_s).
 * wv: blk_bcast_vnni's packing (gemm.pack_vnni: chunks of RV_V blocks, each chunk's blocks group by group), made
 * instead of wp by a plan's first call where the VNNI kernels run; they read it from one row. */
typedef struct {
    const int8_t *w; const int32_t *wsum; const float *sc, *bias, *fw;
    int64_t k, n; int32_t pairs, mode, relu, zo, lo, hi; float inv, z, vlo, vhi; const int8_t *wp; const int32_t *sw;
    const int8_t *wv;
} lin_plan;

/* How run_plan splits a call of m rows over nthreads threads: the kernels it takes and the threads' shares. */
typedef struct { const int8_t *wv, *wp; int sgn, by_rows, nt; int64_t unit, blocks; } lin_split;

static lin_split plan_split(const lin_plan *p, int64_t m, int nthreads, int isa, int conv) {
    lin_split sp;
    const int avx2 = use_avx2(isa), vnni = use_vnni(isa);
    /* the many-row kernels: blk_bcast_vnni (any plan, from one row: its 1 × 4 block ran 1.2-2x blk_dot_vnni at one
     * row on Zen 5, session 31), blk_bcast (`pairs`), blk_bcast_s (any other plan) */
    sp.wv = avx2 && vnni ? p->wv : NULL;
    sp.wp = avx2 && !vnni && p->wp && m >= BCAST_M && (p->pairs || p->sw) ? p->wp : NULL;
    sp.sgn = sp.wp && !p->pairs;
    sp.unit = sp.wv ? RV_V * NB : sp.wp ? NB : NC;
    sp.blocks = (p->n + sp.unit - 1) / sp.unit;
    /* threads own whole blocks of columns; or, where each thread would make the sign codes or patches of every row for
     * weights small enough to share (n k <= ROWS_SPLIT_BYTES), whole tiles of rows (session 27: with columns split, a
     * 16 -> 32 3x3 at batch 64 made its patches on both threads and ran at 0.95x im2col first, 2 threads); or where
     * there are fewer column blocks than threads the rows would keep busy (a 64-column layer at 64 rows, SmallCNN's
     * fc1 64x1568->64: one block, so one thread, session 49), whole tiles of rows too: every (row, column) sum and
     * its epilogue are the same operations whichever thread makes them, so the output is the same bit for bit */
    sp.by_rows = (sp.wp || sp.wv) && (((sp.sgn || conv) && p->n * p->k <= ROWS_SPLIT_BYTES)
                                       || sp.blocks < threads_for(nthreads, m));
    sp.nt = threads_for(nthreads, sp.by_rows ? m : sp.blocks);
    return sp;
}

/* plan_split's choice for a call of m rows (conv: lb_conv_gemm's, else lb_linear_run's): threads * 2 + by_rows (tests,
 * benchmarks) */
int lb_linear_split(const lin_plan *p, int64_t m, int nthreads, int isa, int conv) {
    const lin_split sp = plan_split(p, m, nthreads, isa, conv);
    return sp.nt * 2 + sp.by_rows;
}

/* out (m, n), row stride n, from u8 codes x (m, k; row stride ldx; zero point zx) through plan p (ra, rs: modes 3
 * and 5's per-row vectors), rows in chunks of MAX_ROWS; the many-row kernel from BCAST_M rows where p->wp is made. cv
 * (lb_conv_gemm; x NULL): the rows are cv's patches, made per tile by the threads. Returns 1 when out of memory
 * (nothing written). */
static int run_plan(const lin_plan *p, const uint8_t *x, int64_t m, int64_t ldx, int zx, const float *ra,
                    const float *rs, void *out, int nthreads, int isa, const conv_src *cv) {
    const int avx2 = use_avx2(isa), vnni = use_vnni(isa);
    const lin_split sp = plan_split(p, m, nthreads, isa, cv != NULL);
    const int8_t *wv = sp.wv, *wp = sp.wp;
    const int sgn = sp.sgn, by_rows = sp.by_rows, nt = sp.nt;
    /* sums_amx from AMX_M rows (a conv's patches: the VNNI kernels) */
    const int amx = wv && !cv && m >= AMX_M && p->k % 64 == 0 && use_amx(isa);
    const int sgn1 = avx2 && !wp && !vnni && !p->pairs && p->wsum;  /* blk_sgn (few rows) */
    const int64_t k = p->k, n = p->n, unit = sp.unit, blocks = sp.blocks;
    /* each thread's buffers for one row tile: blk_bcast_s's codes and row sums, a conv's patch rows (lin_run makes
     * them); blk_sgn: every row's codes, made here (sign_rows) */
    const int64_t rb = tile_rows(m, k, wp != NULL || wv != NULL, sgn, cv != NULL);
    const int64_t tile_bytes = sgn ? rb * ((k + 3) / 4) * 8 + rb * 4 : 0;
    /* (each thread's slice on whole cache lines, so its int32 row sums stay aligned after an odd patch size) */
    const int64_t per_thread = (tile_bytes + (cv ? rb * k : 0) + 63) & ~(int64_t)63;
    const size_t xa_bytes = (size_t)(m * ((k + 3) / 4) * 8);
    const size_t xa_all = sgn || cv ? (size_t)(nt * per_thread) : xa_bytes + sizeof(int32_t) * (size_t)m;
    uint8_t *xa = NULL;
    if (sgn || sgn1 || cv) {
        xa = sign_buffer(xa_all);
        if (!xa) return 1;
    }
    if (sgn1) {
        sign_job sj[MAX_THREADS];  /* (rows split over the threads: the pass reads and writes past the caches) */
        const int ns = threads_for(nthreads, m * k >= (1 << 16) ? m : 1);
        for (int t = 0; t < ns; ++t) {
            sign_job jb = {x, k, ldx, m * t / ns, m * (t + 1) / ns, xa, (int32_t *)(xa + xa_bytes)};
            sj[t] = jb;
        }
        fan_out(sign_rows, sj, sizeof(sign_job), ns);
    }
    uint8_t *xp = NULL;  /* blk_bcast_vnni's RV_R rows each read one line per 16 groups: where the row stride maps
                            fewer than RV_R of them to distinct L1 sets (4 KiB apart), the codes are copied onto a padded
                            stride first (128×4096²: 3x faster than thrashing one set with session 16's 16 rows; with 6
                            rows no faster or slower on Zen 5's 12-way L1, kept for 8-way ones: 6 rows and 4 weight
                            streams 64 KiB apart share a set there) */
    int64_t stride = 4096, g = ldx % 4096;
    while (g) { int64_t t = stride % g; stride = g; g = t; }
    if (wv && !cv && m >= 4 && 4096 / stride < RV_R) {
        const int64_t ldp = (k + 63) / 64 * 64 + 64;
        xp = malloc((size_t)(m * ldp));
        if (!xp) { if (xa) sign_release(xa, xa_all); return 1; }
        for (int64_t r = 0; r < m; ++r) memcpy(xp + r * ldp, x + r * ldx, (size_t)k);
        x = xp;
        ldx = ldp;
    }
    lin_job jobs[MAX_THREADS];
    for (int t = 0; t < nt; ++t) {
        int64_t n0 = by_rows ? 0 : blocks * t / nt * unit, n1 = by_rows ? n : blocks * (t + 1) / nt * unit;
        lin_job jb = {x, by_rows ? m * (t + 1) / nt : m, k, ldx, zx, p->w, p->wsum, p->pairs, p->mode, p->relu, p->sc,
                      p->bias, p->inv, p->z, p->vlo, p->vhi, p->zo, p->lo, p->hi, ra, rs, p->fw, out, n, n0,
                      n1 < n ? n1 : n, avx2, wp, vnni, NULL, NULL, NULL, NULL, cv,
                      cv ? xa + t * per_thread + tile_bytes : NULL, rb, by_rows ? m * t / nt : 0};
        if (!sgn && !sgn1 && !p->pairs && !vnni)
            jb.avx2 = 0;  /* (a plan without pairs or wsum: the scalar sums; linear_plan makes wsum for such plans) */
        if (sgn) {
            jb.tile = xa + t * per_thread;
            jb.sw = p->sw;
        } else if (sgn1) {
            jb.xa = xa;
            jb.xc = (const int32_t *)(xa + xa_bytes);
            jb.sw = p->sw;
        }
        jb.wv = wv;
        jb.amx = amx;
        jobs[t] = jb;
    }
    fan_out(lin_run, jobs, sizeof(lin_job), nt);
    if (xa) sign_release(xa, xa_all);
    free(xp);
    return 0;
}

int lb_linear_run(const lin_plan *p, const uint8_t *x, int64_t m, int64_t ldx, int zx, const float *ra,
                  const float *rs, void *out, int nthreads, int isa) {
    return run_plan(p, x, m, ldx, zx, ra, rs, out, nthreads, isa, NULL);
}

/* lb_linear_run of a "float" plan with the column scales sc in place of p->sc, for this call only (a copy of the plan on
 * the stack): lb_dyn_linear's one row, whose scales fl(s_w s_x) change per call while the plan is shared by every thread
 * calling the layer (a per-plan buffer written per call gave one thread another's scales, session 37). */
int lb_linear_run_sc(const lin_plan *p, const float *sc, const uint8_t *x, int64_t m, int64_t ldx, int zx, void *out,
                     int nthreads, int isa) {
    lin_plan own = *p;
    own.sc = sc;
    return run_plan(&own, x, m, ldx, zx, NULL, NULL, out, nthreads, isa, NULL);
}

/* A 2-d conv of one group as plan p's Linear over its output pixels (kernels/conv_split.gemm_conv), without the patches
 * in memory: channels-last u8 codes x (n, h, w, c) on zero point zx, a kh x kw window (conv_src's geometry; p->k =
 * kh kw c, the weights tap by tap), out (n oh ow, p->n) as run_plan's; each thread makes its tiles' patch rows
 * (lb_im2col_rows) where the many-row kernels read them (session 27: the patches of SmallCNN's 32 -> 32 3x3 at batch 64
 * were 3.6 MB written by lb_im2col and read back, ~0.4 ms of a 2.5 ms conv). 1: out of memory; 3: not taken (fewer
 * than BCAST_M rows, weights not packed, a per-token rows mode, or p->k is not the window's): nothing written. */
int lb_conv_gemm(const lin_plan *p, const uint8_t *x, int64_t n, int64_t c, int64_t h, int64_t w, int64_t kh,
                 int64_t kw, int64_t sy, int64_t sx, int64_t py, int64_t px, int64_t dy, int64_t dx, int zx, int64_t oh,
                 int64_t ow, void *out, int nthreads, int isa) {
    const int64_t m = n * oh * ow;
    if (!use_avx2(isa) || !(use_vnni(isa) ? p->wv : p->wp) || m < BCAST_M || p->mode == 3 || p->mode == 5
        || p->k != kh * kw * c || (!use_vnni(isa) && !p->pairs && !p->sw))
        return 3;
    const conv_src cv = {x, h, w, c, kh, kw, sy, sx, py, px, dy, dx, oh, ow, zx};
    return run_plan(p, NULL, m, p->k, zx, NULL, NULL, out, nthreads, isa, &cv);
}
