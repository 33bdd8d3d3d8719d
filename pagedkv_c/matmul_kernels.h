/* Small-batch float32 matrix products that read each weight once per call.
 *
 *   out[M, N] = x[M, K] @ W
 *
 * with W stored row-major either as [K, N] ("nn": the layout of a weight
 * used as x @ W) or as [N, K] ("nt": x @ W.T, e.g. a tied output
 * projection). A decode step multiplies a few activation rows (one per
 * sequence of the batch) by every weight matrix of the model: BLAS GEMM
 * packs and re-reads the weights for such small M, while these kernels
 * stream every weight once from memory and apply it to all M rows (the rows
 * of a block of columns are kept in registers or in L1/L2 while the block
 * is used), so a batch of a few rows costs about what one row costs.
 *
 * Work is split into column blocks of PKV_MM_BLOCK_COLS outputs; a block
 * is computed by one thread, and every output element is the same
 * arithmetic whichever block, thread, or row count it is computed with:
 *   nn: a float32 sum over k in increasing order (fused multiply-adds on
 *       the SIMD paths);
 *   nt: per-lane float32 partial sums over k (VW lanes), then a fixed
 *       reduction tree of the lanes.
 * So a row's result does not depend on the other rows of the batch nor on
 * the number of threads (it can differ between SIMD paths by rounding).
 *
 * The Cython module `pagedkv_c._matmul` validates every argument (dtype,
 * shape, contiguity, sizes) and spreads the blocks over OpenMP threads;
 * nothing here allocates or checks. Portable C99 outside the x86 dispatch
 * section, which needs GCC or Clang.
 */
#ifndef PAGEDKV_MATMUL_KERNELS_H
#define PAGEDKV_MATMUL_KERNELS_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Output columns per work block. */
#define PKV_MM_BLOCK_COLS 64

/* Instruction-set paths, in increasing order of preference (same values as
 * pkv_isa of attention_kernels.h). */
typedef enum {
    PKV_MM_ISA_SCALAR = 0, /* portable C, any compiler and CPU */
    PKV_MM_ISA_AVX2 = 1,   /* x86-64 AVX2 + FMA */
    PKV_MM_ISA_AVX512 = 2  /* x86-64 AVX-512F (+ AVX2, FMA) */
} pkv_mm_isa;

/* Columns n_begin .. n_end - 1 of out for all m rows, computed block by
 * block (PKV_MM_BLOCK_COLS columns from n_begin on). x: [m, k] row-major; w: [k, n] (nn) or [n, k] (nt)
 * row-major; out: [m, n] row-major. m, k, n >= 1. */
typedef void (*pkv_mm_block_kernel)(const float *x, const float *w, float *out, int64_t m,
                                    int64_t k, int64_t n, int64_t n_begin, int64_t n_end);

/* 1 if this CPU and build can run the path. */
int pkv_mm_isa_available(pkv_mm_isa isa);
/* Best path this CPU and build support. */
pkv_mm_isa pkv_mm_best_isa(void);
/* Short lower-case name: "scalar", "avx2", "avx512". */
const char *pkv_mm_isa_name(pkv_mm_isa isa);
/* Block kernel of a path (must be available); transpose_w: 0 nn, 1 nt. */
pkv_mm_block_kernel pkv_mm_get_kernel(pkv_mm_isa isa, int transpose_w);

#ifdef __cplusplus
}
#endif

#endif /* PAGEDKV_MATMUL_KERNELS_H */
