/* Small-batch matrix products (see matmul_kernels.h): a portable path plus
 * x86-64 AVX2 and AVX-512 paths chosen at run time.
 *
 * As for the attention kernels, wheels are built for the baseline ISA (no
 * -march flags); the x86 paths are compiled with GCC/Clang function target
 * attributes and taken only when the CPU (and OS) has them. Other compilers
 * and CPUs get the portable path, whose inner loops compilers
 * auto-vectorize.
 *
 * nn (W [K, N]): a block of columns is computed for a tile of rows at a
 * time; for every k the tile's accumulators (rows x block columns) take
 * x[r, k] * W[k, block]. The block's weights come from memory for the first
 * tile and from L2 for the next ones.
 * nt (W [N, K]): a tile of rows x a group of 4 outputs keeps one vector of
 * partial sums per (row, output); every weight row of the group is read as
 * a contiguous stream, prefetched into L2 ahead of use, once per row tile.
 * On the AVX2 path the outputs of a group lie a third or a quarter of the
 * columns apart, so that the weights are read as distant streams (see
 * mm_nt_slab_avx2).
 */
#include "matmul_kernels.h"

#include <stddef.h>
#include <string.h>

#if (defined(__GNUC__) || defined(__clang__)) && (defined(__x86_64__) || defined(__i386__)) && \
    !defined(PKV_PORTABLE_ONLY)
#define PKV_MM_X86_DISPATCH 1
#include <cpuid.h>
#include <immintrin.h>
#else
#define PKV_MM_X86_DISPATCH 0
#endif

#if defined(__GNUC__) || defined(__clang__)
#define PKV_MM_INLINE static inline __attribute__((always_inline))
#else
#define PKV_MM_INLINE static inline
#endif

/* The x86 nt kernels prefetch the weight rows of the output group
 * MM_PREFETCH_GROUPS groups ahead into L2 while the row tiles run: rows
 * of a few KiB are too short for the hardware prefetchers to reach full speed
 * on their own (measured on Zen 4, K = 576: 13 GB/s without, 19 to 24 GB/s
 * with; prefetching into L1 gained little). */
#ifndef MM_PREFETCH_HINT
#define MM_PREFETCH_HINT _MM_HINT_T1
#endif
#ifndef MM_PREFETCH_GROUPS
#define MM_PREFETCH_GROUPS 8
#endif

/* Rows of x per slab of the x86 nt kernels (see mm_nt_avx512). */
#ifndef MM_SLAB_ROWS
#define MM_SLAB_ROWS 128
#endif

#if PKV_MM_X86_DISPATCH
/* Weights an nt tile prefetches for every 16 floats of its k loop, while
 * kk < k_end (k_end 0: none): row_bytes 0, 4 lines (the next 256 bytes from
 * `base`: a group of 4 adjacent weight rows); else one line of each of the
 * tile's rows, row_bytes apart from `base` on (the AVX2 groups of distant
 * rows, see mm_nt_slab_avx2). */
typedef struct {
    const char *base;
    int64_t k_end, row_bytes;
} mm_prefetch_span;

/* The share of row tile `tile` (of `tiles`) in prefetching the output group
 * MM_PREFETCH_GROUPS groups after the one at c0 (the 4 weight rows of a
 * group are contiguous in memory): tile t takes the t-th of `tiles` equal
 * parts, 4 lines per 16 floats of k, so that it finishes its part within its
 * own k loop and the reads from memory go on while the later row tiles
 * compute. Prefetching only in the first row tile left the bus idle for the
 * rest of the group: at 16 rows the product took about the sum of its memory
 * and arithmetic times (68 GFLOPS on Zen 4, against 100 so). None when the
 * group ahead is not a full group before n_end. */
static inline mm_prefetch_span mm_prefetch_share(const float *w, int64_t k, int64_t c0, int64_t n_end,
                                                 int64_t tile, int64_t tiles)
{
    mm_prefetch_span pf = {NULL, 0, 0};
    const int64_t g0 = c0 + MM_PREFETCH_GROUPS * 4;
    if (g0 + 4 <= n_end) {
        const int64_t lines = (4 * k * (int64_t)sizeof(float) + 63) / 64;
        const int64_t first = lines * tile / tiles, last = lines * (tile + 1) / tiles;
        pf.base = (const char *)(w + g0 * k) + first * 64;
        pf.k_end = (last - first + 3) / 4 * 16;
    }
    return pf;
}

/* 4 lines from p on. */
PKV_MM_INLINE void mm_prefetch_lines(const char *p)
{
    _mm_prefetch(p, MM_PREFETCH_HINT);
    _mm_prefetch(p + 64, MM_PREFETCH_HINT);
    _mm_prefetch(p + 128, MM_PREFETCH_HINT);
    _mm_prefetch(p + 192, MM_PREFETCH_HINT);
}

/* The prefetches of the step at kk (a multiple of 16; none past the tile's
 * part): one test per step (a loop over lines with a bound each cost about
 * 10% at one row). */
PKV_MM_INLINE void mm_prefetch_step(mm_prefetch_span pf, int64_t kk)
{
    if (kk < pf.k_end)
        mm_prefetch_lines(pf.base + kk * 16);
}
#endif

/* ------------------------------------------------------------ portable path */

/* Rows per tile of the portable nn kernel. */
#define MM_SCALAR_NN_ROWS 4
/* Lanes of the portable nt partial sums. */
#define MM_SCALAR_LANES 8

static void mm_nn_scalar(const float *x, const float *w, float *out, int64_t m, int64_t k, int64_t n,
                         int64_t n_begin, int64_t n_end)
{
    float acc[MM_SCALAR_NN_ROWS][PKV_MM_BLOCK_COLS];
    int64_t c0, m0, r, kk, j;
    for (c0 = n_begin; c0 < n_end; c0 += PKV_MM_BLOCK_COLS) {
        const int64_t cols = n_end - c0 < PKV_MM_BLOCK_COLS ? n_end - c0 : PKV_MM_BLOCK_COLS;
        for (m0 = 0; m0 < m; m0 += MM_SCALAR_NN_ROWS) {
            const int64_t rows = m - m0 < MM_SCALAR_NN_ROWS ? m - m0 : MM_SCALAR_NN_ROWS;
            for (r = 0; r < rows; r++)
                for (j = 0; j < cols; j++) acc[r][j] = 0.0f;
            for (kk = 0; kk < k; kk++) {
                const float *wr = w + kk * n + c0;
                for (r = 0; r < rows; r++) {
                    const float xv = x[(m0 + r) * k + kk];
                    for (j = 0; j < cols; j++) acc[r][j] += xv * wr[j];
                }
            }
            for (r = 0; r < rows; r++) memcpy(out + (m0 + r) * n + c0, acc[r], (size_t)cols * sizeof(float));
        }
    }
}

static float mm_lanes8_sum(const float *s)
{
    return ((s[0] + s[4]) + (s[2] + s[6])) + ((s[1] + s[5]) + (s[3] + s[7]));
}

static void mm_nt_scalar(const float *x, const float *w, float *out, int64_t m, int64_t k, int64_t n,
                         int64_t n_begin, int64_t n_end)
{
    float s[MM_SCALAR_LANES];
    int64_t row, col, kk, l;
    for (col = n_begin; col < n_end; col++) {
        const float *wr = w + col * k;
        for (row = 0; row < m; row++) {
            const float *xr = x + row * k;
            for (l = 0; l < MM_SCALAR_LANES; l++) s[l] = 0.0f;
            for (kk = 0; kk + MM_SCALAR_LANES <= k; kk += MM_SCALAR_LANES)
                for (l = 0; l < MM_SCALAR_LANES; l++) s[l] += xr[kk + l] * wr[kk + l];
            for (l = 0; kk + l < k; l++) s[l] += xr[kk + l] * wr[kk + l];
            out[row * n + col] = mm_lanes8_sum(s);
        }
    }
}

#if PKV_MM_X86_DISPATCH
/* ------------------------------------------------------- x86-64 AVX2 + FMA */

#define PKV_MM_AVX2 __attribute__((target("avx2,fma")))
/* nn: rows per tile and columns per sub-block (2 vectors): 8 accumulators. */
#define MM_AVX2_NN_ROWS 4
#define MM_AVX2_NN_COLS 16
/* nt: tiles of up to 3 rows x 4 outputs or 4 rows x 3 outputs (12
 * accumulators of the 16 vector registers); the latter from this many rows. */
#define MM_AVX2_NT_THREE_FROM_ROWS 4
/* Distant groups (mm_nt_slab_avx2): used when a part of the columns has at
 * least this many; prefetched this many groups ahead from this many row
 * tiles on. */
#ifndef MM_AVX2_FAR_MIN_PART
#define MM_AVX2_FAR_MIN_PART 16
#endif
#ifndef MM_AVX2_FAR_PREFETCH_GROUPS
#define MM_AVX2_FAR_PREFETCH_GROUPS 4
#endif
#ifndef MM_AVX2_FAR_PREFETCH_TILES
#define MM_AVX2_FAR_PREFETCH_TILES 2
#endif

/* Lanes < count set (count in 0..8), as a maskload/maskstore mask. */
PKV_MM_AVX2 static inline __m256i mm_mask_avx2(int64_t count)
{
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(count < 0 ? 0 : count > 8 ? 8 : count)), lanes);
}

PKV_MM_AVX2 PKV_MM_INLINE void mm_nn_tile_avx2(const float *x, const float *w, float *out, int64_t k,
                                               int64_t n, int64_t c0, __m256i mask0, __m256i mask1,
                                               const int rows)
{
    __m256 acc[MM_AVX2_NN_ROWS][2];
    const float *wp = w + c0;
    int64_t kk;
    int r;
#pragma GCC unroll 4
    for (r = 0; r < rows; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (kk = 0; kk < k; kk++, wp += n) {
        const __m256 w0 = _mm256_maskload_ps(wp, mask0);
        const __m256 w1 = _mm256_maskload_ps(wp + 8, mask1);
#pragma GCC unroll 4
        for (r = 0; r < rows; r++) {
            const __m256 b = _mm256_broadcast_ss(x + r * k + kk);
            acc[r][0] = _mm256_fmadd_ps(b, w0, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(b, w1, acc[r][1]);
        }
    }
#pragma GCC unroll 4
    for (r = 0; r < rows; r++) {
        _mm256_maskstore_ps(out + r * n + c0, mask0, acc[r][0]);
        _mm256_maskstore_ps(out + r * n + c0 + 8, mask1, acc[r][1]);
    }
}

PKV_MM_AVX2 static void mm_nn_avx2(const float *x, const float *w, float *out, int64_t m, int64_t k,
                                   int64_t n, int64_t n_begin, int64_t n_end)
{
    int64_t c0, m0;
    for (c0 = n_begin; c0 < n_end; c0 += MM_AVX2_NN_COLS) {
        const __m256i mask0 = mm_mask_avx2(n_end - c0), mask1 = mm_mask_avx2(n_end - c0 - 8);
        for (m0 = 0; m0 + MM_AVX2_NN_ROWS <= m; m0 += MM_AVX2_NN_ROWS)
            mm_nn_tile_avx2(x + m0 * k, w, out + m0 * n, k, n, c0, mask0, mask1, MM_AVX2_NN_ROWS);
        switch (m - m0) {
        case 3: mm_nn_tile_avx2(x + m0 * k, w, out + m0 * n, k, n, c0, mask0, mask1, 3); break;
        case 2: mm_nn_tile_avx2(x + m0 * k, w, out + m0 * n, k, n, c0, mask0, mask1, 2); break;
        case 1: mm_nn_tile_avx2(x + m0 * k, w, out + m0 * n, k, n, c0, mask0, mask1, 1); break;
        default: break;
        }
    }
}

/* outs rows of w (c0, c0 + stride, .., c0 + (outs - 1) * stride; outs 1..nout)
 * x `rows` rows of x, nout 4 (rows 1..3) or 3 (rows 1..4): 12 accumulators
 * at most. A group of fewer than nout outputs repeats its last row (computed,
 * not stored). */
PKV_MM_AVX2 PKV_MM_INLINE void mm_nt_tile_avx2(const float *x, const float *w, float *out, int64_t k,
                                               int64_t n, int64_t c0, int64_t stride, int outs,
                                               __m256i ktail, mm_prefetch_span pf, const int rows,
                                               const int nout)
{
    __m256 acc[4][4];
    const float *wr[4];
    int64_t kk;
    int r, j;
    for (j = 0; j < 4; j++) wr[j] = w + (c0 + (j < outs ? j : outs - 1) * stride) * k;
#pragma GCC unroll 4
    for (r = 0; r < rows; r++)
#pragma GCC unroll 4
        for (j = 0; j < nout; j++) acc[r][j] = _mm256_setzero_ps();
    for (kk = 0; kk + 8 <= k; kk += 8) {
        if (kk % 16 == 0 && kk < pf.k_end) {
            if (pf.row_bytes == 0) {
                mm_prefetch_lines(pf.base + kk * 16);
            } else {
                const char *p = pf.base + kk * (int64_t)sizeof(float);
#pragma GCC unroll 4
                for (j = 0; j < nout; j++) _mm_prefetch(p + j * pf.row_bytes, MM_PREFETCH_HINT);
            }
        }
        __m256 a[4];
#pragma GCC unroll 4
        for (j = 0; j < nout; j++) a[j] = _mm256_loadu_ps(wr[j] + kk);
#pragma GCC unroll 4
        for (r = 0; r < rows; r++) {
            const __m256 xv = _mm256_loadu_ps(x + r * k + kk);
#pragma GCC unroll 4
            for (j = 0; j < nout; j++) acc[r][j] = _mm256_fmadd_ps(xv, a[j], acc[r][j]);
        }
    }
    if (kk < k) {
        __m256 a[4];
#pragma GCC unroll 4
        for (j = 0; j < nout; j++) a[j] = _mm256_maskload_ps(wr[j] + kk, ktail);
#pragma GCC unroll 4
        for (r = 0; r < rows; r++) {
            const __m256 xv = _mm256_maskload_ps(x + r * k + kk, ktail);
#pragma GCC unroll 4
            for (j = 0; j < nout; j++) acc[r][j] = _mm256_fmadd_ps(xv, a[j], acc[r][j]);
        }
    }
    /* The sums of a row with one shuffle tree (as in mm_nt_tile_avx512); a
     * group of 3 takes its third accumulator again as the fourth. */
#pragma GCC unroll 4
    for (r = 0; r < rows; r++) {
        const __m256 a3 = nout == 4 ? acc[r][3] : acc[r][2];
        const __m256 t0 = _mm256_add_ps(_mm256_unpacklo_ps(acc[r][0], acc[r][1]),
                                        _mm256_unpackhi_ps(acc[r][0], acc[r][1]));
        const __m256 t1 = _mm256_add_ps(_mm256_unpacklo_ps(acc[r][2], a3), _mm256_unpackhi_ps(acc[r][2], a3));
        const __m256 u = _mm256_add_ps(_mm256_shuffle_ps(t0, t1, _MM_SHUFFLE(1, 0, 1, 0)),
                                       _mm256_shuffle_ps(t0, t1, _MM_SHUFFLE(3, 2, 3, 2)));
        const __m128 q = _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1));
        if (outs == 4 && stride == 1) {
            _mm_storeu_ps(out + r * n + c0, q);
        } else {
            float sums[4];
            _mm_storeu_ps(sums, q);
            for (j = 0; j < outs; j++) out[r * n + c0 + j * stride] = sums[j];
        }
    }
}

/* The groups c = c_begin, c_begin + step, .. < c_end, each of the nout
 * outputs c, c + stride, .. (stride 1: step nout, the last group may be
 * short; else step 1, full groups), for each group the rows in tiles of at
 * most 3 (nout 4) or 4 (nout 3) rows of equal size (to one row: a short last
 * tile would read the weights again for few rows). */
PKV_MM_AVX2 static void mm_nt_groups_avx2(const float *x, const float *w, float *out, int64_t m, int64_t k,
                                          int64_t n, int64_t c_begin, int64_t c_end, int64_t stride,
                                          int64_t n_end, const int nout)
{
    const __m256i ktail = mm_mask_avx2(k % 8);
    const int max_rows = nout == 4 ? 3 : 4;
    const int64_t tiles = (m + max_rows - 1) / max_rows;
    const int64_t step = stride == 1 ? nout : 1;
    const int64_t lines = (k * (int64_t)sizeof(float) + 63) / 64;
    int64_t c0, t;
    for (c0 = c_begin; c0 < c_end; c0 += step) {
        const int outs = stride != 1 || c_end - c0 >= nout ? nout : (int)(c_end - c0);
        for (t = 0; t < tiles; t++) {
            const int64_t m0 = m * t / tiles, m1 = m * (t + 1) / tiles;
            mm_prefetch_span pf = {NULL, 0, 0};
            if (stride == 1) {
                if (nout == 4) pf = mm_prefetch_share(w, k, c0, n_end, t, tiles);
            } else if (tiles >= MM_AVX2_FAR_PREFETCH_TILES && c0 + MM_AVX2_FAR_PREFETCH_GROUPS < c_end) {
                const int64_t first = lines * t / tiles, last = lines * (t + 1) / tiles;
                pf.base = (const char *)(w + (c0 + MM_AVX2_FAR_PREFETCH_GROUPS) * k) + first * 64;
                pf.k_end = (last - first) * 16;
                pf.row_bytes = stride * k * (int64_t)sizeof(float);
            }
            const float *xt = x + m0 * k;
            float *ot = out + m0 * n;
            if (nout == 4) {
                switch (m1 - m0) {
                case 3: mm_nt_tile_avx2(xt, w, ot, k, n, c0, stride, outs, ktail, pf, 3, 4); break;
                case 2: mm_nt_tile_avx2(xt, w, ot, k, n, c0, stride, outs, ktail, pf, 2, 4); break;
                case 1: mm_nt_tile_avx2(xt, w, ot, k, n, c0, stride, outs, ktail, pf, 1, 4); break;
                default: break;
                }
            } else {
                switch (m1 - m0) {
                case 4: mm_nt_tile_avx2(xt, w, ot, k, n, c0, stride, outs, ktail, pf, 4, 3); break;
                case 3: mm_nt_tile_avx2(xt, w, ot, k, n, c0, stride, outs, ktail, pf, 3, 3); break;
                case 2: mm_nt_tile_avx2(xt, w, ot, k, n, c0, stride, outs, ktail, pf, 2, 3); break;
                case 1: mm_nt_tile_avx2(xt, w, ot, k, n, c0, stride, outs, ktail, pf, 1, 3); break;
                default: break;
                }
            }
        }
    }
}

/* Columns n_begin .. n_end - 1 for a slab of rows. The outputs of a group
 * lie a third or a quarter of the columns apart, so that the group reads 3
 * or 4 distant streams of weights: on Zen 2 (K = 576, one row) 21 GB/s
 * against 12.5 for groups of 4 adjacent weight rows with the prefetches of
 * the AVX-512 path, as a plain sum over memory reads 19 GB/s from 4 to 8
 * distant streams and 12.5 from one. Up to 3 rows take groups of 4 outputs
 * (one tile); from 4 rows on, groups of 3 outputs in tiles of up to 4 rows,
 * so that 4 rows read each weight once (4 rows: 12 to 17% faster than two
 * tiles of 2 rows x 4 outputs; 12 and 16 rows 8 to 10%). The streams run
 * without software prefetches in a single row tile (the hardware prefetchers
 * keep up; prefetches cost 10 to 20% at one row) and with them from 2 tiles
 * on, where the arithmetic of a group hides the next groups' reads. The
 * columns past the parts (at most 3) take adjacent groups. */
PKV_MM_AVX2 static void mm_nt_slab_avx2(const float *x, const float *w, float *out, int64_t m, int64_t k,
                                        int64_t n, int64_t n_begin, int64_t n_end)
{
    const int nout = m >= MM_AVX2_NT_THREE_FROM_ROWS ? 3 : 4;
    const int64_t part = (n_end - n_begin) / nout;
    if (part >= MM_AVX2_FAR_MIN_PART) {
        if (nout == 4) mm_nt_groups_avx2(x, w, out, m, k, n, n_begin, n_begin + part, part, n_end, 4);
        else mm_nt_groups_avx2(x, w, out, m, k, n, n_begin, n_begin + part, part, n_end, 3);
        if (n_begin + nout * part < n_end)
            mm_nt_groups_avx2(x, w, out, m, k, n, n_begin + nout * part, n_end, 1, n_end, 4);
    } else {
        mm_nt_groups_avx2(x, w, out, m, k, n, n_begin, n_end, 1, n_end, 4);
    }
}

/* ------------------------------------------------------------ x86-64 AVX-512 */

#define PKV_MM_AVX512 __attribute__((target("avx512f,avx2,fma")))
/* nn: rows per tile x the whole 64-column block (4 vectors): 24 accumulators. */
#define MM_AVX512_NN_ROWS 6
/* nt: most rows per tile of 4 outputs (1 to 8, see mm_nt_slab_avx512). */
#ifndef MM_AVX512_NT_ROWS
#define MM_AVX512_NT_ROWS 8
#endif

PKV_MM_AVX512 static inline __mmask16 mm_mask_avx512(int64_t count)
{
    return count >= 16 ? (__mmask16)0xffff : count <= 0 ? (__mmask16)0 : (__mmask16)((1u << count) - 1u);
}

PKV_MM_AVX512 PKV_MM_INLINE void mm_nn_tile_avx512(const float *x, const float *w, float *out, int64_t k,
                                                   int64_t n, int64_t c0, const __mmask16 *mask,
                                                   const int rows)
{
    __m512 acc[MM_AVX512_NN_ROWS][4];
    const float *wp = w + c0;
    int64_t kk;
    int r;
#pragma GCC unroll 6
    for (r = 0; r < rows; r++) acc[r][0] = acc[r][1] = acc[r][2] = acc[r][3] = _mm512_setzero_ps();
    for (kk = 0; kk < k; kk++, wp += n) {
        const __m512 w0 = _mm512_maskz_loadu_ps(mask[0], wp);
        const __m512 w1 = _mm512_maskz_loadu_ps(mask[1], wp + 16);
        const __m512 w2 = _mm512_maskz_loadu_ps(mask[2], wp + 32);
        const __m512 w3 = _mm512_maskz_loadu_ps(mask[3], wp + 48);
#pragma GCC unroll 6
        for (r = 0; r < rows; r++) {
            const __m512 b = _mm512_set1_ps(x[r * k + kk]);
            acc[r][0] = _mm512_fmadd_ps(b, w0, acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(b, w1, acc[r][1]);
            acc[r][2] = _mm512_fmadd_ps(b, w2, acc[r][2]);
            acc[r][3] = _mm512_fmadd_ps(b, w3, acc[r][3]);
        }
    }
#pragma GCC unroll 6
    for (r = 0; r < rows; r++) {
        float *o = out + r * n + c0;
        _mm512_mask_storeu_ps(o, mask[0], acc[r][0]);
        _mm512_mask_storeu_ps(o + 16, mask[1], acc[r][1]);
        _mm512_mask_storeu_ps(o + 32, mask[2], acc[r][2]);
        _mm512_mask_storeu_ps(o + 48, mask[3], acc[r][3]);
    }
}

PKV_MM_AVX512 static void mm_nn_avx512(const float *x, const float *w, float *out, int64_t m, int64_t k,
                                       int64_t n, int64_t n_begin, int64_t n_end)
{
    int64_t c0, m0;
    for (c0 = n_begin; c0 < n_end; c0 += PKV_MM_BLOCK_COLS) {
        const __mmask16 mask[4] = {mm_mask_avx512(n_end - c0), mm_mask_avx512(n_end - c0 - 16),
                                   mm_mask_avx512(n_end - c0 - 32), mm_mask_avx512(n_end - c0 - 48)};
        for (m0 = 0; m0 + MM_AVX512_NN_ROWS <= m; m0 += MM_AVX512_NN_ROWS)
            mm_nn_tile_avx512(x + m0 * k, w, out + m0 * n, k, n, c0, mask, MM_AVX512_NN_ROWS);
        switch (m - m0) {
        case 5: mm_nn_tile_avx512(x + m0 * k, w, out + m0 * n, k, n, c0, mask, 5); break;
        case 4: mm_nn_tile_avx512(x + m0 * k, w, out + m0 * n, k, n, c0, mask, 4); break;
        case 3: mm_nn_tile_avx512(x + m0 * k, w, out + m0 * n, k, n, c0, mask, 3); break;
        case 2: mm_nn_tile_avx512(x + m0 * k, w, out + m0 * n, k, n, c0, mask, 2); break;
        case 1: mm_nn_tile_avx512(x + m0 * k, w, out + m0 * n, k, n, c0, mask, 1); break;
        default: break;
        }
    }
}

/* outs rows of w (c0 .. c0 + outs - 1, outs 1..4) x `rows` rows of x. Every
 * (row, output) pair keeps one vector of 16 per-lane partial sums over k,
 * reduced at the end by one fixed shuffle tree, so the number of rows of a
 * tile changes how often a weight row is read, not the result. A group of
 * fewer than 4 outputs repeats its last row (computed, not stored). */
PKV_MM_AVX512 PKV_MM_INLINE void mm_nt_tile_avx512(const float *x, const float *w, float *out, int64_t k,
                                                   int64_t n, int64_t c0, int outs, __mmask16 ktail,
                                                   mm_prefetch_span pf, const int rows)
{
    __m512 acc[MM_AVX512_NT_ROWS][4];
    const float *wr[4];
    int64_t kk;
    int r, j;
#pragma GCC unroll 4
    for (j = 0; j < 4; j++) wr[j] = w + (c0 + (j < outs ? j : outs - 1)) * k;
#pragma GCC unroll 8
    for (r = 0; r < rows; r++)
#pragma GCC unroll 4
        for (j = 0; j < 4; j++) acc[r][j] = _mm512_setzero_ps();
#define MM_NT_STEP_AVX512()                                                                           \
    do {                                                                                              \
        __m512 a[4];                                                                                  \
        _Pragma("GCC unroll 4") for (j = 0; j < 4; j++) a[j] = _mm512_loadu_ps(wr[j] + kk);          \
        _Pragma("GCC unroll 8") for (r = 0; r < rows; r++) {                                          \
            const __m512 xv = _mm512_loadu_ps(x + r * k + kk);                                        \
            _Pragma("GCC unroll 4") for (j = 0; j < 4; j++) acc[r][j] =                               \
                _mm512_fmadd_ps(xv, a[j], acc[r][j]);                                                 \
        }                                                                                             \
    } while (0)
    /* Two copies of the k loop: a tile that prefetches on every step (the only
     * tile of up to 8 rows) tests nothing per step (the test cost 2 to 4% at
     * one row, where a step is only 4 loads and 4 FMAs). */
    if (pf.k_end >= k) {
        for (kk = 0; kk + 16 <= k; kk += 16) {
            mm_prefetch_lines(pf.base + kk * 16);
            MM_NT_STEP_AVX512();
        }
    } else {
        for (kk = 0; kk + 16 <= k; kk += 16) {
            mm_prefetch_step(pf, kk);
            MM_NT_STEP_AVX512();
        }
    }
#undef MM_NT_STEP_AVX512
    if (kk < k) {
        __m512 a[4];
#pragma GCC unroll 4
        for (j = 0; j < 4; j++) a[j] = _mm512_maskz_loadu_ps(ktail, wr[j] + kk);
#pragma GCC unroll 8
        for (r = 0; r < rows; r++) {
            const __m512 xv = _mm512_maskz_loadu_ps(ktail, x + r * k + kk);
#pragma GCC unroll 4
            for (j = 0; j < 4; j++) acc[r][j] = _mm512_fmadd_ps(xv, a[j], acc[r][j]);
        }
    }
    /* The four sums of a row with one shuffle tree: per 128-bit lane, lanes (0+2)+(1+3) of each
     * accumulator side by side, then the four 128-bit lanes (0+2)+(1+3). An
     * output's sum involves only its own lanes, so every output takes the same
     * arithmetic whatever its group and tile. */
#pragma GCC unroll 8
    for (r = 0; r < rows; r++) {
        const __m512 t0 = _mm512_add_ps(_mm512_unpacklo_ps(acc[r][0], acc[r][1]),
                                        _mm512_unpackhi_ps(acc[r][0], acc[r][1]));
        const __m512 t1 = _mm512_add_ps(_mm512_unpacklo_ps(acc[r][2], acc[r][3]),
                                        _mm512_unpackhi_ps(acc[r][2], acc[r][3]));
        const __m512 u = _mm512_add_ps(_mm512_shuffle_ps(t0, t1, _MM_SHUFFLE(1, 0, 1, 0)),
                                       _mm512_shuffle_ps(t0, t1, _MM_SHUFFLE(3, 2, 3, 2)));
        const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(u),
                                       _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(u), 1)));
        const __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
        if (outs == 4) {
            _mm_storeu_ps(out + r * n + c0, q);
        } else {
            float sums[4];
            _mm_storeu_ps(sums, q);
            for (j = 0; j < outs; j++) out[r * n + c0 + j] = sums[j];
        }
    }
}

/* One tile of 1 .. 8 rows (a constant in each case, so that the
 * accumulators stay in registers). */
#define MM_NT_TILE_CASE(R)                                                                           \
    case R: mm_nt_tile_avx512(x, w, out, k, n, c0, outs, ktail, pf, R); break
PKV_MM_AVX512 static void mm_nt_rows_avx512(const float *x, const float *w, float *out, int64_t k, int64_t n,
                                            int64_t c0, int outs, __mmask16 ktail, mm_prefetch_span pf,
                                            int rows)
{
    switch (rows) {
        MM_NT_TILE_CASE(1); MM_NT_TILE_CASE(2); MM_NT_TILE_CASE(3); MM_NT_TILE_CASE(4);
        MM_NT_TILE_CASE(5); MM_NT_TILE_CASE(6); MM_NT_TILE_CASE(7); MM_NT_TILE_CASE(8);
        default: break;
    }
}
#undef MM_NT_TILE_CASE

/* Groups of 4 outputs, the rows of the slab in tiles of at most
 * MM_AVX512_NT_ROWS rows of equal size (to one row; a short last tile would
 * read the weights again for few rows). 8 rows x 4 outputs keep 32
 * accumulators. The tiles take the groups MM_PREFETCH_GROUPS at a time:
 * tile 1 runs over those groups, then tile 2 over the same groups, and so
 * on, so that the rows of x a tile reads stay in L1 while the weights come
 * from L2, where the prefetches put them (measured on Zen 4 at 16 rows,
 * weights from memory: tiles of 4 rows run group by group 67 to 80 GFLOPS,
 * 6 or 7 rows 82 to 92, 8 rows 96 to 100, 8 rows over 8 groups at a time
 * 100 to 104; 105 with every weight in L2). */
PKV_MM_AVX512 static void mm_nt_slab_avx512(const float *x, const float *w, float *out, int64_t m, int64_t k,
                                            int64_t n, int64_t n_begin, int64_t n_end)
{
    const __mmask16 ktail = mm_mask_avx512(k % 16);
    const int64_t tiles = (m + MM_AVX512_NT_ROWS - 1) / MM_AVX512_NT_ROWS;
    int64_t s0, c0, t;
    for (s0 = n_begin; s0 < n_end; s0 += 4 * MM_PREFETCH_GROUPS) {
        const int64_t s1 = s0 + 4 * MM_PREFETCH_GROUPS < n_end ? s0 + 4 * MM_PREFETCH_GROUPS : n_end;
        for (t = 0; t < tiles; t++) {
            const int64_t m0 = m * t / tiles, m1 = m * (t + 1) / tiles;
            for (c0 = s0; c0 < s1; c0 += 4) {
                const int outs = n_end - c0 < 4 ? (int)(n_end - c0) : 4;
                mm_nt_rows_avx512(x + m0 * k, w, out + m0 * n, k, n, c0, outs, ktail,
                                  mm_prefetch_share(w, k, c0, n_end, t, tiles), (int)(m1 - m0));
            }
        }
    }
}

/* nt over slabs of at most MM_SLAB_ROWS rows: the rows of x that the output
 * groups of a slab read again and again stay in L2 (a slab reads the weights
 * once more, which costs little beside the arithmetic of that many rows). */
PKV_MM_AVX512 static void mm_nt_avx512(const float *x, const float *w, float *out, int64_t m, int64_t k,
                                       int64_t n, int64_t n_begin, int64_t n_end)
{
    int64_t s0;
    for (s0 = 0; s0 < m; s0 += MM_SLAB_ROWS)
        mm_nt_slab_avx512(x + s0 * k, w, out + s0 * n, m - s0 < MM_SLAB_ROWS ? m - s0 : MM_SLAB_ROWS, k, n,
                          n_begin, n_end);
}

PKV_MM_AVX2 static void mm_nt_avx2(const float *x, const float *w, float *out, int64_t m, int64_t k,
                                   int64_t n, int64_t n_begin, int64_t n_end)
{
    int64_t s0;
    for (s0 = 0; s0 < m; s0 += MM_SLAB_ROWS)
        mm_nt_slab_avx2(x + s0 * k, w, out + s0 * n, m - s0 < MM_SLAB_ROWS ? m - s0 : MM_SLAB_ROWS, k, n,
                        n_begin, n_end);
}
#endif /* PKV_MM_X86_DISPATCH */

/* ------------------------------------------------------------------ dispatch */

#if PKV_MM_X86_DISPATCH
static int mm_cpuid1_ecx_has(unsigned int bits)
{
    unsigned int eax, ebx, ecx, edx;
    if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx))
        return 0;
    return (ecx & bits) == bits;
}
#endif

int pkv_mm_isa_available(pkv_mm_isa isa)
{
    switch (isa) {
    case PKV_MM_ISA_SCALAR:
        return 1;
#if PKV_MM_X86_DISPATCH
    case PKV_MM_ISA_AVX2:
        /* __builtin_cpu_supports checks that the OS saves the AVX state; FMA
         * is read from CPUID leaf 1 (ECX bit 12). */
        __builtin_cpu_init();
        return __builtin_cpu_supports("avx2") && mm_cpuid1_ecx_has(1u << 12);
    case PKV_MM_ISA_AVX512:
        return pkv_mm_isa_available(PKV_MM_ISA_AVX2) && __builtin_cpu_supports("avx512f");
#endif
    default:
        return 0;
    }
}

pkv_mm_isa pkv_mm_best_isa(void)
{
    if (pkv_mm_isa_available(PKV_MM_ISA_AVX512))
        return PKV_MM_ISA_AVX512;
    if (pkv_mm_isa_available(PKV_MM_ISA_AVX2))
        return PKV_MM_ISA_AVX2;
    return PKV_MM_ISA_SCALAR;
}

const char *pkv_mm_isa_name(pkv_mm_isa isa)
{
    switch (isa) {
    case PKV_MM_ISA_AVX2:
        return "avx2";
    case PKV_MM_ISA_AVX512:
        return "avx512";
    default:
        return "scalar";
    }
}

pkv_mm_block_kernel pkv_mm_get_kernel(pkv_mm_isa isa, int transpose_w)
{
    switch (isa) {
#if PKV_MM_X86_DISPATCH
    case PKV_MM_ISA_AVX512:
        return transpose_w ? mm_nt_avx512 : mm_nn_avx512;
    case PKV_MM_ISA_AVX2:
        return transpose_w ? mm_nt_avx2 : mm_nn_avx2;
#endif
    default:
        return transpose_w ? mm_nt_scalar : mm_nn_scalar;
    }
}
