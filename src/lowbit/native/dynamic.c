/* The per-token dynamic Linear in one call (nn/quantized/dynamic/per_token._vnni_native on a CPU with AVX-512 VNNI,
 * no_vnni._native_rows8 without: the row grids, then one Linear pass), where the Python path makes two native calls
 * and four tensors around them. */
#include "common.h"

int lb_row_grid(const float *x, int64_t m, int64_t k, int64_t ldx, float levels, float eps, float qmax, int mode,
                void *out, int64_t ldo, float *scale, float *negzp, int nthreads, int isa);
int lb_linear_run(const void *p, const uint8_t *x, int64_t m, int64_t ldx, int zx, const float *ra, const float *rs,
                  void *out, int nthreads, int isa);
int lb_linear_run_sc(const void *p, const float *sc, const uint8_t *x, int64_t m, int64_t ldx, int zx, void *out,
                     int nthreads, int isa);

/* x (m, k; row stride ldx): each row's grid on [0, 255] and its u8 codes (lb_row_grid mode 1) into codes (m, k) and
 * grid[0, m) = s, grid[m, 2m) = -z, then out (m, n) float32:
 *   one row  (p1 given: mode "float"):           sc = fl(s_w s) in a buffer of this call's (the plan is shared by
 *                                                threads), lb_linear_run_sc at zero point z (= -(-z))
 *   else     (pr: mode "rows"):                  grid[2m, 3m) = cn = fl(-z + 128), lb_linear_run at zero point 128
 *                                                with (cn, s): the Python path's tensors and calls, the same floats;
 *            (sub: pr in mode "rows_sub")        cn = c = fl(-128 - (-z)) = z - 128 instead (the generic epilogue's c)
 * Returns 1 when some row is not finite (nothing usable written), 2 when out of memory. */
int lb_dyn_linear(const float *x, int64_t m, int64_t k, int64_t ldx, int64_t n, const void *p1, const float *sw,
                  const void *pr, int sub, uint8_t *codes, float *grid, float *out, int nt_grid, int nt_lin, int isa) {
    float *scale = grid, *negzp = grid + m, *cn = grid + 2 * m;
    if (lb_row_grid(x, m, k, ldx, 255.f, 1e-8f, 255.f, 1, codes, k, scale, negzp, nt_grid, isa)) return 1;
    if (p1) {  /* one row */
        float *sc = malloc((size_t)n * sizeof *sc);
        if (!sc) return 2;
        for (int64_t j = 0; j < n; ++j) sc[j] = sw[j] * scale[0];
        const int r = lb_linear_run_sc(p1, sc, codes, 1, k, (int)(-negzp[0]), out, nt_lin, isa);
        free(sc);
        return r ? 2 : 0;
    }
    for (int64_t i = 0; i < m; ++i) cn[i] = sub ? -128.f - negzp[i] : negzp[i] + 128.f;
    return lb_linear_run(pr, codes, m, k, 128, cn, scale, out, nt_lin, isa) ? 2 : 0;
}

/* 1 when each of the n floats at x is finite, else 0: the x86 dynamic Linear's NaN / Inf check (torch.ao's fbgemm op
 * quantizes a NaN to a code: finite outputs). A float is NaN or ±Inf when its bits without the sign, as an int32,
 * exceed FLT_MAX's 0x7f7fffff: one max over x, two accumulators (AVX2 or AVX-512F bodies). */
__attribute__((target("avx2")))
static int finite_avx2(const float *x, int64_t n) {
    const __m256i mag = _mm256_set1_epi32(0x7fffffff), top = _mm256_set1_epi32(0x7f7fffff);
    __m256i a = _mm256_setzero_si256(), b = _mm256_setzero_si256();
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) {
        a = _mm256_max_epi32(a, _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(x + j)), mag));
        b = _mm256_max_epi32(b, _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(x + j + 8)), mag));
    }
    __m256i over = _mm256_cmpgt_epi32(_mm256_max_epi32(a, b), top);
    if (!_mm256_testz_si256(over, over)) return 0;
    for (; j < n; ++j) if (bad_bits(x[j])) return 0;
    return 1;
}

__attribute__((target("avx512f")))
static int finite_avx512(const float *x, int64_t n) {
    const __m512i mag = _mm512_set1_epi32(0x7fffffff);
    __m512i a = _mm512_setzero_si512(), b = _mm512_setzero_si512();
    int64_t j = 0;
    for (; j + 32 <= n; j += 32) {
        a = _mm512_max_epi32(a, _mm512_and_si512(_mm512_loadu_si512(x + j), mag));
        b = _mm512_max_epi32(b, _mm512_and_si512(_mm512_loadu_si512(x + j + 16), mag));
    }
    if (_mm512_cmpgt_epi32_mask(_mm512_max_epi32(a, b), _mm512_set1_epi32(0x7f7fffff))) return 0;
    for (; j < n; ++j) if (bad_bits(x[j])) return 0;
    return 1;
}

/* isa as the other passes: 0 the scalar body, 2 the AVX2 one even where AVX-512F is present */
int lb_all_finite(const float *x, int64_t n, int isa) {
    if (use_avx512(isa)) return finite_avx512(x, n);
    if (use_avx2(isa)) return finite_avx2(x, n);
    for (int64_t j = 0; j < n; ++j) if (bad_bits(x[j])) return 0;
    return 1;
}
