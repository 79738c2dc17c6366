/* What lowbit's native C files share (see lowbit/native/__init__.py for the math and the contract).
 *
 * Every float operation in them is the float32 operation torch's ops (or fbgemm's, where a pass replaces an
 * fbgemm call) perform on the same operands, in the same order: products and quotients correctly rounded, no
 * contraction (built with -ffp-contract=off; a fused multiply-add is explicit, where torch's addcmul_ fuses too),
 * round half to even; integer sums exact. An AVX2 body where the CPU has it (checked at run time), a scalar body
 * with the same results otherwise.
 */
#ifndef LOWBIT_NATIVE_COMMON_H
#define LOWBIT_NATIVE_COMMON_H
#include <cpuid.h>
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define MAX_THREADS 64

/* A 2-d conv's input as the rows of its patches (pool.c lb_im2col_rows; linear.c lb_conv_gemm): channels-last u8
 * codes x (n, h, w, c), a kh x kw window at strides (sy, sx), padding (py, px), dilation (dy, dx), output oh x ow,
 * padding taps at the zero point zx. Row (b oh + i) ow + jj holds output pixel (b, i, jj)'s window tap by tap
 * ((di kw + dj) c + ch). */
typedef struct { const uint8_t *x; int64_t h, w, c, kh, kw, sy, sx, py, px, dy, dx, oh, ow; int zx; } conv_src;
void lb_im2col_rows(const conv_src *s, int64_t r0, int64_t r1, uint8_t *out);

static inline int bad_bits(float v) { uint32_t b; memcpy(&b, &v, 4); return (b & 0x7f800000u) == 0x7f800000u; }

static inline int cpu_avx2(void) {
    static int known = -1;
    if (known < 0) { __builtin_cpu_init(); known = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"); }
    return known;
}

/* Run fn on jobs[0..n), one per thread of the OpenMP pool. Loaded after torch, this object's libgomp.so.1 is the
 * one torch's CPU ops already run on (the same soname): the same warm threads, no second pool competing for the
 * cores. Built without OpenMP (or for one job), the jobs run one after another on the caller's thread. */
static inline void fan_out(void *(*fn)(void *), void *jobs, size_t size, int n) {
    if (n == 1) {  /* no parallel region for one job: ~1.5 µs less per small call */
        fn(jobs);
        return;
    }
#ifdef _OPENMP
#pragma omp parallel for num_threads(n) schedule(static, 1)
#endif
    for (int t = 0; t < n; ++t) fn((char *)jobs + t * size);
}

static inline int threads_for(int nthreads, int64_t rows) {
    if (nthreads > MAX_THREADS) nthreads = MAX_THREADS;
    if (nthreads > rows) nthreads = (int)rows;
    return nthreads < 1 ? 1 : nthreads;
}

/* AVX-512 VNNI (vpdpbusd: four u8 × s8 products and the int32 sum in one exact step) */
static inline int cpu_vnni(void) {
    static int known = -1;
    if (known < 0) {
        __builtin_cpu_init();
        known = cpu_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vnni")
                && __builtin_cpu_supports("avx512vl");
    }
    return known;
}

/* AMX int8 (tdpbusd: a 16 x 64 u8 tile times a 64 x 16 s8 tile into 16 x 16 exact int32 sums): the CPU has AMX-TILE
 * and AMX-INT8 (cpuid 7.0 EDX bits 24, 25) and Linux lets this process use the tile data (arch_prctl
 * ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA; granted once per process, asked before any thread runs a tile) */
static inline int cpu_amx(void) {
    static int known = -1;
    if (known < 0) {
        unsigned a = 0, b = 0, c = 0, d = 0;
        int ok = cpu_vnni() && __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d >> 24 & 1u) && (d >> 25 & 1u);
        known = ok && syscall(SYS_arch_prctl, 0x1023L, 18L) == 0;
    }
    return known;
}

/* AVX-512F (the stubs' 512-bit elementwise bodies) */
static inline int cpu_avx512(void) {
    static int known = -1;
    if (known < 0) { __builtin_cpu_init(); known = cpu_avx2() && __builtin_cpu_supports("avx512f"); }
    return known;
}

/* isa: 0 the scalar bodies, 1 the best this CPU has, 2 the AVX2 bodies even where AVX-512 is present, 3 the best but
 * AMX (the VNNI kernels where the CPU has AMX too) (tests pin each) */
static inline int use_avx2(int isa) { return isa == 0 ? 0 : cpu_avx2(); }
static inline int use_vnni(int isa) { return isa == 1 || isa == 3 ? cpu_vnni() : 0; }
static inline int use_amx(int isa) { return isa == 1 ? cpu_amx() : 0; }
static inline int use_avx512(int isa) { return isa == 1 || isa == 3 ? cpu_avx512() : 0; }
/* the elementwise passes' body (stubs.c, rowquant.c's row grids and epilogue): 2 AVX-512F, 1 AVX2 + FMA, 0 scalar */
static inline int body_of(int isa) { return use_avx512(isa) ? 2 : use_avx2(isa); }

/* The integer conv epilogue (lb_dwconv, lb_smallconv; lb_conv_epilogue on float sums): the u8 code of
 * clamp(round(fl(clamp(fl(fl(fl(acc) sc) + bias) inv, vlo, vhi) + z)), 0, 255), bias NULL for none. */
static inline uint8_t acc_code(int32_t acc, float sc, const float *bias, int64_t ch, float inv, float z, float vlo,
                               float vhi) {
    float t = (float)acc * sc;             /* fl(acc) (exact below 2^24, as the split sums' fl(lo + 2 hi)) · fl(s_x s_w) */
    if (bias) t = t + bias[ch];
    float v = t * inv;
    v = v > vlo ? v : vlo;                 /* maxps / minps, as the vector bodies: a NaN (non-finite scales only) */
    v = v < vhi ? v : vhi;                 /* becomes vlo, never a NaN cast to uint8 */
    float r = nearbyintf(v + z);
    r = r < 0.f ? 0.f : r;
    return (uint8_t)(r > 255.f ? 255.f : r);
}

/* acc_code on 8 lanes (its float32 steps in its order): int32 codes in [INT32_MIN, 255] for 8 exact sums, scales sc
 * and biases bias (NULL: none). acc_code's rounding then clamp to [0, 255] is cvtps2dq (round half to even) after a
 * min with 255; the caller's unsigned-saturating packs give the 0 below (negative, -inf: INT32_MIN). No NaN reaches
 * the min: the max with vlo (maxps: its second operand for a NaN, as acc_code's clamp) makes it vlo. */
__attribute__((target("avx2,fma"), always_inline))
static inline __m256i acc_codes8(__m256i acc, const float *sc, const float *bias, float inv, float z, float vlo,
                                 float vhi) {
    __m256 t = _mm256_mul_ps(_mm256_cvtepi32_ps(acc), _mm256_loadu_ps(sc));
    if (bias) t = _mm256_add_ps(t, _mm256_loadu_ps(bias));
    __m256 v = _mm256_min_ps(_mm256_max_ps(_mm256_mul_ps(t, _mm256_set1_ps(inv)), _mm256_set1_ps(vlo)),
                             _mm256_set1_ps(vhi));
    return _mm256_cvtps_epi32(_mm256_min_ps(_mm256_set1_ps(255.f), _mm256_add_ps(v, _mm256_set1_ps(z))));
}

#endif
