/* The per-token dynamic Linear in one call (nn/quantized/dynamic/per_token._vnni_native on a CPU with AVX-512 VNNI,
 * no_vnni._native_rows8 without: the row grids, then one Linear pass), where the Python path makes two native calls
 * and four tensors around them. */
#include "common.h"

int lb_row_grid(const float *x, int64_t m, int64_t k, int64_t ldx, float levels, float eps, float qmax, int mode,
                void *out, int64_t ldo, float *scale, float *negzp, int nthreads, int isa);
int lb_linear_run(const void *p, const uint8_t *x, int64_t m, int64_t ldx, int zx, const float *ra, const float *rs,
                  void *out, int nthreads, int isa);

/* x (m, k; row stride ldx): each row's grid on [0, 255] and its u8 codes (lb_row_grid mode 1) into codes (m, k) and
 * grid[0, m) = s, grid[m, 2m) = -z, then out (m, n) float32:
 *   one row  (p1 given: mode "float", its scales sc):  sc = fl(s_w s), lb_linear_run at zero point z (= -(-z))
 *   else     (pr: mode "rows"):                  grid[2m, 3m) = cn = fl(-z + 128), lb_linear_run at zero point 128
 *                                                with (cn, s): the Python path's tensors and calls, the same floats;
 *            (sub: pr in mode "rows_sub")        cn = c = fl(-128 - (-z)) = z - 128 instead (the generic epilogue's c)
 * Returns 1 when some row is not finite (nothing usable written), 2 when out of memory. */
int lb_dyn_linear(const float *x, int64_t m, int64_t k, int64_t ldx, int64_t n, const void *p1, float *sc,
                  const float *sw, const void *pr, int sub, uint8_t *codes, float *grid, float *out, int nt_grid,
                  int nt_lin, int isa) {
    float *scale = grid, *negzp = grid + m, *cn = grid + 2 * m;
    if (lb_row_grid(x, m, k, ldx, 255.f, 1e-8f, 255.f, 1, codes, k, scale, negzp, nt_grid, isa)) return 1;
    if (p1) {  /* one row */
        for (int64_t j = 0; j < n; ++j) sc[j] = sw[j] * scale[0];
        return lb_linear_run(p1, codes, 1, k, (int)(-negzp[0]), NULL, NULL, out, nt_lin, isa) ? 2 : 0;
    }
    for (int64_t i = 0; i < m; ++i) cn[i] = sub ? -128.f - negzp[i] : negzp[i] + 128.f;
    return lb_linear_run(pr, codes, m, k, 128, cn, scale, out, nt_lin, isa) ? 2 : 0;
}
