/* Paged attention item kernels: a portable path plus x86-64 AVX2 and AVX-512
 * paths chosen at run time (see attention_kernels.h).
 *
 * Wheels are built for the baseline ISA of their platform (no -march flags);
 * the x86 paths are compiled with GCC/Clang function target attributes and
 * taken only when __builtin_cpu_supports says the CPU (and OS) has them.
 * Other compilers (MSVC) and other CPUs (arm64) get the portable path, whose
 * 8-lane loops compilers auto-vectorize.
 */
#include "attention_kernels.h"
#include "page_formats.h"

#include <math.h>
#include <stddef.h>
#include <string.h>

/* Define PKV_PORTABLE_ONLY to build the portable path alone (as MSVC and
 * non-x86 builds get it). */
#if (defined(__GNUC__) || defined(__clang__)) && (defined(__x86_64__) || defined(__i386__)) && \
    !defined(PKV_PORTABLE_ONLY)
#define PKV_X86_DISPATCH 1
#include <cpuid.h>
#include <immintrin.h>
#else
#define PKV_X86_DISPATCH 0
#endif

/* Software prefetch: a hint only, so compilers without it simply skip it.
 * Decode reads each K/V row once, in an order (one item's heads of scattered
 * pages) that hardware prefetchers follow poorly; prefetching into L2
 * (locality 2 = prefetcht1) rather than L1 measured about 1.5x faster. */
#if defined(__GNUC__) || defined(__clang__)
#ifndef PKV_PREFETCH_LOCALITY
#define PKV_PREFETCH_LOCALITY 2
#endif
#define PKV_PREFETCH(p) __builtin_prefetch((p), 0, PKV_PREFETCH_LOCALITY)
#elif defined(_MSC_VER) && (defined(_M_X64) || defined(_M_IX86))
#include <xmmintrin.h>
#define PKV_PREFETCH(p) _mm_prefetch((const char *)(p), _MM_HINT_T1)
#else
#define PKV_PREFETCH(p) ((void)(p))
#endif
/* 1: prefetch the K/V rows of the chunk PKV_PREFETCH_AHEAD chunks ahead
 * while computing this one. */
#ifndef PKV_PREFETCH_CHUNKS
#define PKV_PREFETCH_CHUNKS 1
#endif
#ifndef PKV_PREFETCH_AHEAD
#define PKV_PREFETCH_AHEAD 1
#endif
/* Kernels with KV_TOUCH_AHEAD 1 read the rows a chunk ahead with plain loads,
 * one per 64-byte line in one burst, instead of prefetch hints spread over the
 * chunk, when a chunk's burst is at most PKV_TOUCH_MAX_BYTES (it must stay in L2
 * beside the chunk in use) and the item has at most PKV_TOUCH_MAX_ROWS query
 * rows per KV head (decode; prefill tiles have the arithmetic to hide the
 * memory behind). On a Zen 2 core (AVX2) the hints left decode over K/V in
 * memory at 6 GB/s, whatever their distance or locality, against 16 GB/s for a
 * plain read; the loads took SmolLM2's layer (3 KV heads of 64, float32) to 9 to
 * 10 GB/s, and rows of 8 KV heads did not gain. Only the AVX2 float32 kernel
 * has it: float16 and bfloat16 pages gained 0 to 7% there, int8 and int4 pages
 * lost 13% and 5%; the AVX-512 path keeps the hints, which measured well on
 * Zen 4 (docs/benchmarks.md). */
#ifndef PKV_TOUCH_MAX_BYTES
#define PKV_TOUCH_MAX_BYTES (32 * 1024)
#endif
#ifndef PKV_TOUCH_MAX_ROWS
#define PKV_TOUCH_MAX_ROWS 8
#endif

int64_t pkv_scratch_floats(int64_t max_rows, int64_t head_dim)
{
    const int64_t dim_pad = (head_dim + 15) / 16 * 16;
    /* qs, acc, qs_sink; s; m, l; quantized q and q_sink with their factors */
    return 3 * max_rows * dim_pad + max_rows * PKV_CHUNK_TOKENS + 2 * max_rows +
           2 * max_rows * (dim_pad / 4 + 1);
}

/* Quantize one query row of D values for integer scores (llama.cpp quantizes
 * the query to its key type the same way): levels rint(q_i / d) in [-127,
 * 127] with d = max |q_i| / 127 in float32 (q_i / d computed as q_i * (1 / d)),
 * stored as level + 128 in out[0 .. D); returns d (0 for a zero row). NaN
 * when the row holds an inf or NaN, or 1 / d overflows: the row is then
 * scored in float. */
static inline float pkv_quantize_query(const float *q, int64_t D, int64_t dim_pad, uint8_t *out)
{
    float amax = 0.0f;
    int64_t i;
    for (i = 0; i < D; i++) {
        const float a = fabsf(q[i]);
        if (!(a <= 3.4028234663852886e38f))
            return NAN;
        if (a > amax)
            amax = a;
    }
    const float d = amax / 127.0f;
    if (d == 0.0f) {
        memset(out, 128, (size_t)dim_pad);
        return 0.0f;
    }
    const float inv = 1.0f / d;
    if (!(inv <= 3.4028234663852886e38f))
        return NAN;
    for (i = 0; i < D; i++) {
        float r = rintf(q[i] * inv);
        if (r > 127.0f) r = 127.0f;
        if (r < -127.0f) r = -127.0f;
        out[i] = (uint8_t)((int32_t)r + 128);
    }
    for (; i < dim_pad; i++)
        out[i] = 128;
    return d;
}

/* ------------------------------------------------------- split decode merge */

void pkv_merge_partitions(const pkv_attention_args *a, int64_t token, int64_t head,
                          int64_t first_partial, int64_t num_partials)
{
    const int64_t D = a->head_dim, Hq = a->num_kv_heads * a->group_size;
    float *out = a->out + (token * Hq + head) * D;
    /* the sink logit in the log2 domain; -inf: no sink term */
    const double sink = a->sink_logits == NULL ? -INFINITY
                                               : a->sink_logits[head] * 1.4426950408889634;
    double acc[PKV_MAX_HEAD_DIM];
    double max_score = -INFINITY, total = 0.0;
    int has_nan = 0, has_sum = 0, has_blocked = 0;
    int64_t i, d;
    for (i = 0; i < num_partials; i++) {
        const int64_t row = (first_partial + i) * Hq + head;
        const float l = a->part_sum[row];
        if (isnan(l)) {
            has_nan = 1;
        } else if (l > 0.0f) {
            has_sum = 1;
            if (a->part_max[row] > max_score) max_score = a->part_max[row];
        } else if (signbit(l)) {
            has_blocked = 1; /* admitted keys, every score -inf */
        }
    }
    if (!has_nan && sink != -INFINITY) {
        /* The sink term joins once: M = max(m_i, sink), L = sum l_i 2**(m_i - M)
         * + 2**(sink - M). Partitions without a positive sum weigh 0 (their
         * zeros, or the NaN of 0 * inf in V, reach the output as in dense
         * softmax, whose weights are then all 0 but the sink's). */
        if (sink > max_score) max_score = sink;
        for (d = 0; d < D; d++) acc[d] = 0.0;
        for (i = 0; i < num_partials; i++) {
            const int64_t row = (first_partial + i) * Hq + head;
            const float l = a->part_sum[row];
            const float *part = a->part_acc + row * D;
            const double w = l > 0.0f ? exp2((double)a->part_max[row] - max_score) : 0.0;
            total += (double)l * w;
            for (d = 0; d < D; d++) acc[d] += (double)part[d] * w;
        }
        total += exp2(sink - max_score);
        for (d = 0; d < D; d++) out[d] = (float)(acc[d] / total);
        if (PKV_FORMAT_ROTATED(a->format))
            pkv_rotate(out, D);
        if (a->lse != NULL)
            a->lse[token * Hq + head] = (float)((max_score + log2(total)) * 0.6931471805599453);
        return;
    }
    if (has_nan || (!has_sum && has_blocked)) {
        /* dense softmax: exp(s - max) is NaN, or 0/0 */
        for (d = 0; d < D; d++) out[d] = NAN;
        if (a->lse != NULL) a->lse[token * Hq + head] = NAN;
        return;
    }
    if (!has_sum) {
        /* no key admitted in any partition */
        for (d = 0; d < D; d++) out[d] = 0.0f;
        if (a->lse != NULL) a->lse[token * Hq + head] = -INFINITY;
        return;
    }
    for (d = 0; d < D; d++) acc[d] = 0.0;
    for (i = 0; i < num_partials; i++) {
        const int64_t row = (first_partial + i) * Hq + head;
        const float l = a->part_sum[row];
        const float *part = a->part_acc + row * D;
        /* Partitions without a positive sum add their sums at weight 0: zeros,
         * or the NaN that 0 * inf gave where a weight-0 key has an inf V. */
        const double w = l > 0.0f ? exp2((double)a->part_max[row] - max_score) : 0.0;
        total += (double)l * w;
        for (d = 0; d < D; d++) acc[d] += (double)part[d] * w;
    }
    for (d = 0; d < D; d++) out[d] = (float)(acc[d] / total);
    if (PKV_FORMAT_ROTATED(a->format))
        pkv_rotate(out, D); /* the partitions summed R v */
    if (a->lse != NULL)
        a->lse[token * Hq + head] = (float)((max_score + log2(total)) * 0.6931471805599453);
}

/* ------------------------------------------------------------------ float16 */

#if (defined(__GNUC__) || defined(__clang__)) && defined(__aarch64__)
/* AArch64 converts float16 in hardware (ACLE __fp16). */
static inline float pkv_h2f(uint16_t h)
{
    __fp16 x;
    memcpy(&x, &h, sizeof x);
    return (float)x;
}
#else
#define pkv_h2f pkv_fmt_h2f
#endif

/* ------------------------------------------------------------ portable path */

/* y = VTANH(x) over n floats with the path's vectors (the tail padded with
 * zeros): the softcap's tanh as the kernels compute it, for tests. */
#define PKV_TANH_ARRAY(path)                                                          \
    PKV_TARGET static void pkv_tanh_array_##path(const float *x, float *y, int64_t n) \
    {                                                                                 \
        float buf[VW];                                                                \
        int64_t i, j;                                                                 \
        for (i = 0; i < n; i += VW) {                                                 \
            for (j = 0; j < VW; j++) buf[j] = i + j < n ? x[i + j] : 0.0f;            \
            VSTORE(buf, VTANH(VLOAD(buf)));                                           \
            for (j = 0; j < VW && i + j < n; j++) y[i + j] = buf[j];                  \
        }                                                                             \
    }

typedef struct {
    float v[8];
} pkv_v8;

static inline pkv_v8 v8_set1(float x)
{
    pkv_v8 r;
    int i;
    for (i = 0; i < 8; i++) r.v[i] = x;
    return r;
}
static inline pkv_v8 v8_load(const float *p)
{
    pkv_v8 r;
    memcpy(r.v, p, sizeof r.v);
    return r;
}
static inline void v8_store(float *p, pkv_v8 a) { memcpy(p, a.v, sizeof a.v); }
static inline pkv_v8 v8_load_f16(const uint16_t *p)
{
    pkv_v8 r;
    int i;
    for (i = 0; i < 8; i++) r.v[i] = pkv_h2f(p[i]);
    return r;
}
static inline pkv_v8 v8_load_bf16(const uint16_t *p)
{
    pkv_v8 r;
    int i;
    for (i = 0; i < 8; i++) r.v[i] = pkv_fmt_bf2f(p[i]);
    return r;
}
static inline pkv_v8 v8_load_int8(const uint8_t *row, int64_t d, int64_t dim)
{
    const float scale = pkv_int8_scale(row, dim);
    pkv_v8 r;
    int i;
    for (i = 0; i < 8; i++) r.v[i] = scale * (float)pkv_int8_level(row, d + i);
    return r;
}
static inline pkv_v8 v8_load_int8_levels(const uint8_t *row)
{
    pkv_v8 r;
    int i;
    for (i = 0; i < 8; i++) r.v[i] = (float)pkv_int8_level(row, i);
    return r;
}
static inline pkv_v8 v8_load_int4(const uint8_t *row, int64_t d, int64_t dim)
{
    const float scale = pkv_int4_scale(row, dim, d); /* d .. d + 7 share a block */
    pkv_v8 r;
    int i;
    for (i = 0; i < 8; i++) r.v[i] = scale * (float)pkv_int4_level(row, d + i);
    return r;
}
static inline pkv_v8 v8_add(pkv_v8 a, pkv_v8 b)
{
    int i;
    for (i = 0; i < 8; i++) a.v[i] += b.v[i];
    return a;
}
static inline pkv_v8 v8_sub(pkv_v8 a, pkv_v8 b)
{
    int i;
    for (i = 0; i < 8; i++) a.v[i] -= b.v[i];
    return a;
}
static inline pkv_v8 v8_max(pkv_v8 a, pkv_v8 b)
{
    int i;
    for (i = 0; i < 8; i++) a.v[i] = a.v[i] > b.v[i] ? a.v[i] : b.v[i];
    return a;
}
static inline pkv_v8 v8_fma(pkv_v8 a, pkv_v8 b, pkv_v8 c)
{
    int i;
    for (i = 0; i < 8; i++) c.v[i] += a.v[i] * b.v[i];
    return c;
}
static inline pkv_v8 v8_muls(pkv_v8 a, float x)
{
    int i;
    for (i = 0; i < 8; i++) a.v[i] *= x;
    return a;
}
static inline pkv_v8 v8_exp2(pkv_v8 a)
{
    int i;
    for (i = 0; i < 8; i++) a.v[i] = a.v[i] < -126.0f ? 0.0f : exp2f(a.v[i]);
    return a;
}
static inline pkv_v8 v8_tanh(pkv_v8 a)
{
    int i;
    for (i = 0; i < 8; i++) a.v[i] = tanhf(a.v[i]);
    return a;
}
static inline float v8_hsum(pkv_v8 a)
{
    return ((a.v[0] + a.v[4]) + (a.v[1] + a.v[5])) + ((a.v[2] + a.v[6]) + (a.v[3] + a.v[7]));
}
static inline float v8_hmax(pkv_v8 a)
{
    float m = a.v[0];
    int i;
    for (i = 1; i < 8; i++) m = a.v[i] > m ? a.v[i] : m;
    return m;
}

#define PKV_TARGET
#define vf pkv_v8
#define VW 8
#define VZERO() v8_set1(0.0f)
#define VSET1(x) v8_set1(x)
#define VLOAD(p) v8_load(p)
#define VSTORE(p, a) v8_store((p), (a))
#define VADD(a, b) v8_add((a), (b))
#define VSUB(a, b) v8_sub((a), (b))
#define VMAX(a, b) v8_max((a), (b))
#define VFMA(a, b, c) v8_fma((a), (b), (c))
#define VMULS(a, x) v8_muls((a), (x))
#define VEXP2(a) v8_exp2(a)
#define VTANH(a) v8_tanh(a)
#define VHSUM(a) v8_hsum(a)
#define VHMAX(a) v8_hmax(a)
#define VHSUM8(a0, a1, a2, a3, a4, a5, a6, a7, out)                                  \
    do {                                                                            \
        (out)[0] = v8_hsum(a0); (out)[1] = v8_hsum(a1);                             \
        (out)[2] = v8_hsum(a2); (out)[3] = v8_hsum(a3);                             \
        (out)[4] = v8_hsum(a4); (out)[5] = v8_hsum(a5);                             \
        (out)[6] = v8_hsum(a6); (out)[7] = v8_hsum(a7);                             \
    } while (0)
#define PKV_PV_WIDE 0
#define PKV_DOT_WIDE 0
#define VKEEP(v) ((void)0)

#define PKV_SUFFIX scalar_f32
#define KV_T float
#define KV_TO_F(x) (x)
#define KV_CHUNK (PKV_CHUNK_TOKENS / 2)
#define VLOAD_KV(p) v8_load(p)
#include "attention_kernels_body.h"
PKV_TANH_ARRAY(scalar)
#undef PKV_SUFFIX
#undef KV_T
#undef KV_TO_F
#undef KV_CHUNK
#undef VLOAD_KV

#define PKV_SUFFIX scalar_f16
#define KV_T uint16_t
#define KV_CHUNK PKV_CHUNK_TOKENS
#define KV_TO_F(x) pkv_h2f(x)
#define VLOAD_KV(p) v8_load_f16(p)
#include "attention_kernels_body.h"
#undef PKV_SUFFIX
#undef KV_T
#undef KV_TO_F
#undef KV_CHUNK
#undef VLOAD_KV

#define PKV_SUFFIX scalar_bf16
#define KV_T uint16_t
#define KV_CHUNK PKV_CHUNK_TOKENS
#define KV_TO_F(x) pkv_fmt_bf2f(x)
#define VLOAD_KV(p) v8_load_bf16(p)
#include "attention_kernels_body.h"
#undef PKV_SUFFIX
#undef KV_T
#undef KV_TO_F
#undef KV_CHUNK
#undef VLOAD_KV

#define PKV_SUFFIX scalar_int8
#define KV_ROTATED 1 /* int8 rows hold R x (page_formats.h) */
#define KV_T uint8_t
#define KV_CHUNK PKV_CHUNK_TOKENS
#define KV_ROW(D) ((D) + 2)
#define KV_LOAD(row, d) v8_load_int8((row), (d), dim)
#define KV_VSCALE(row) pkv_int8_scale((row), dim)
#define KV_PF_TAIL(row) PKV_PREFETCH((row) + dim + 1)
#define KV_VLOAD(row, d) v8_load_int8_levels((row) + (d))
#define KV_VGET(row, d) ((float)pkv_int8_level((row), (d)))
#define KV_GET(row, d) (pkv_int8_scale((row), dim) * (float)pkv_int8_level((row), (d)))
#define KV_ADDR(row, d) ((row) + (d))
#include "attention_kernels_body.h"
#undef PKV_SUFFIX
#undef KV_T
#undef KV_CHUNK

#define PKV_SUFFIX scalar_int4
#define KV_T uint8_t
#define KV_CHUNK PKV_CHUNK_TOKENS
#define KV_ROW(D) pkv_row_bytes(PKV_FORMAT_INT4, (D))
#define KV_LOAD(row, d) v8_load_int4((row), (d), dim)
#define KV_GET(row, d) (pkv_int4_scale((row), dim, (d)) * (float)pkv_int4_level((row), (d)))
#define KV_ADDR(row, d) ((row) + (d) / 2)
#define KV_PF_TAIL(row) PKV_PREFETCH((row) + pkv_row_bytes(PKV_FORMAT_INT4, dim) - 1)
#define KV_LINE_ELEMS 128
#define KV_ROTATED 1
#include "attention_kernels_body.h"
#undef PKV_SUFFIX
#undef KV_T
#undef KV_CHUNK

#undef PKV_TARGET
#undef vf
#undef VW
#undef VZERO
#undef VSET1
#undef VLOAD
#undef VSTORE
#undef VADD
#undef VSUB
#undef VMAX
#undef VFMA
#undef VMULS
#undef VEXP2
#undef VTANH
#undef VHSUM
#undef VHMAX
#undef VHSUM8
#undef PKV_PV_WIDE
#undef PKV_DOT_WIDE
#undef VKEEP

#if PKV_X86_DISPATCH
/* ------------------------------------------------- x86-64 AVX2 + FMA + F16C */

#define PKV_AVX2 __attribute__((target("avx2,fma,f16c")))

/* 2**x for x <= 0: x = n + f, n integer, f in [-0.5, 0.5]; 2**f by its
 * degree-7 Taylor polynomial (relative error < 1e-8), 2**n in the exponent.
 * NaN stays NaN: the compare is unordered and max returns its second
 * operand, x, when x is NaN. */
PKV_AVX2 static inline __m256 pkv_exp2_avx2(__m256 x)
{
    const __m256 lowest = _mm256_set1_ps(-126.0f);
    const __m256 keep = _mm256_cmp_ps(x, lowest, _CMP_NLT_UQ);
    const __m256 xc = _mm256_max_ps(lowest, x);
    const __m256 n = _mm256_round_ps(xc, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 f = _mm256_sub_ps(xc, n);
    __m256 p = _mm256_set1_ps(1.5252733804059841e-05f);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.5403530393381606e-04f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.3333558146428443e-03f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.6181291076284772e-03f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.5504108664821580e-02f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.4022650695910071e-01f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.9314718055994531e-01f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)), keep);
}
/* tanh for the softcap, from pkv_exp2_avx2, on a = |x| with the sign of x
 * put back last (so tanh(-0) = -0): a < 0.55: a + a**3 P(a**2), P of degree 4
 * fitted for relative error (2e-7 measured in float32); else (1 - e) / (1 + e)
 * with e = exp(-2a) <= 1, which is 1 at inf and loses no digits there (tanh
 * >= 0.5). NaN: the compare is false and e is NaN. */
#define PKV_TANH_SMALL 0.55f
#define PKV_TANH_C0 -0.33333318650020005f
#define PKV_TANH_C1 0.13332616787408744f
#define PKV_TANH_C2 -0.053855110696790214f
#define PKV_TANH_C3 0.02108201861700994f
#define PKV_TANH_C4 -0.006287600914951862f
#define PKV_MINUS_2_LOG2E -2.8853900817779268f
PKV_AVX2 static inline __m256 pkv_tanh_avx2(__m256 x)
{
    const __m256 sign = _mm256_set1_ps(-0.0f), one = _mm256_set1_ps(1.0f);
    const __m256 ax = _mm256_andnot_ps(sign, x);
    const __m256 e = pkv_exp2_avx2(_mm256_mul_ps(ax, _mm256_set1_ps(PKV_MINUS_2_LOG2E)));
    const __m256 big = _mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e));
    const __m256 x2 = _mm256_mul_ps(ax, ax);
    __m256 p = _mm256_set1_ps(PKV_TANH_C4);
    p = _mm256_fmadd_ps(p, x2, _mm256_set1_ps(PKV_TANH_C3));
    p = _mm256_fmadd_ps(p, x2, _mm256_set1_ps(PKV_TANH_C2));
    p = _mm256_fmadd_ps(p, x2, _mm256_set1_ps(PKV_TANH_C1));
    p = _mm256_fmadd_ps(p, x2, _mm256_set1_ps(PKV_TANH_C0));
    const __m256 small = _mm256_fmadd_ps(_mm256_mul_ps(ax, x2), p, ax);
    const __m256 mag = _mm256_blendv_ps(big, small,
                                        _mm256_cmp_ps(ax, _mm256_set1_ps(PKV_TANH_SMALL), _CMP_LT_OQ));
    return _mm256_or_ps(mag, _mm256_and_ps(x, sign));
}
PKV_AVX2 static inline float pkv_hsum_avx2(__m256 v)
{
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}
PKV_AVX2 static inline float pkv_hmax_avx2(__m256 v)
{
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    x = _mm_max_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}
PKV_AVX2 static inline float pkv_h2f_f16c(uint16_t h) { return _cvtsh_ss(h); }
/* 128-bit lane j of the result = [a0, a1, a2, a3] partial sums over lane j:
 * pairwise unpack, then shuffle. */
PKV_AVX2 static inline __m256 pkv_sum4_lanes_avx2(__m256 a0, __m256 a1, __m256 a2, __m256 a3)
{
    const __m256 t0 = _mm256_add_ps(_mm256_unpacklo_ps(a0, a1), _mm256_unpackhi_ps(a0, a1));
    const __m256 t1 = _mm256_add_ps(_mm256_unpacklo_ps(a2, a3), _mm256_unpackhi_ps(a2, a3));
    return _mm256_add_ps(_mm256_shuffle_ps(t0, t1, _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm256_shuffle_ps(t0, t1, _MM_SHUFFLE(3, 2, 3, 2)));
}
/* [u0 lanes 0+1, u1 lanes 0+1] (128-bit lanes) */
PKV_AVX2 static inline __m256 pkv_pair_lanes_avx2(__m256 u0, __m256 u1)
{
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}
/* out[i] = sum of the lanes of ai (11 adds). */
PKV_AVX2 static inline void pkv_hsum8_avx2(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4,
                                           __m256 a5, __m256 a6, __m256 a7, float *out)
{
    _mm256_storeu_ps(out, pkv_pair_lanes_avx2(pkv_sum4_lanes_avx2(a0, a1, a2, a3),
                                              pkv_sum4_lanes_avx2(a4, a5, a6, a7)));
}

/* bfloat16 -> float32: the 16 bits move to the top of the word. */
PKV_AVX2 static inline __m256 pkv_bf16_avx2(const uint16_t *p)
{
    const __m128i b = _mm_loadu_si128((const __m128i *)(const void *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(b), 16));
}
PKV_AVX2 static inline __m256 pkv_int8_levels_avx2(const uint8_t *p)
{
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(const void *)p)));
}
PKV_AVX2 static inline __m256 pkv_int8_avx2(const uint8_t *row, int64_t d, int64_t dim)
{
    return _mm256_mul_ps(pkv_int8_levels_avx2(row + d), _mm256_set1_ps(pkv_int8_scale(row, dim)));
}
/* The int4 levels of values d .. d + 15 as 16 bytes in value order (value 2j
 * in the low nibble of byte j): the SIMD twin of pkv_int4_level. */
PKV_AVX2 static inline __m128i pkv_int4_levels16(__m128i packed)
{
    const __m128i mask = _mm_set1_epi8(0x0f);
    const __m128i lo = _mm_and_si128(packed, mask);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(packed, 4), mask);
    return _mm_sub_epi8(_mm_unpacklo_epi8(lo, hi), _mm_set1_epi8(8));
}
PKV_AVX2 static inline __m256 pkv_int4_avx2(const uint8_t *row, int64_t d, int64_t dim)
{
    int32_t w;
    memcpy(&w, row + d / 2, 4);
    const __m128i q = pkv_int4_levels16(_mm_cvtsi32_si128(w));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)),
                         _mm256_set1_ps(pkv_int4_scale(row, dim, d)));
}

#define PKV_TARGET PKV_AVX2
#define vf __m256
#define VW 8
#define VZERO() _mm256_setzero_ps()
#define VSET1(x) _mm256_set1_ps(x)
#define VLOAD(p) _mm256_loadu_ps(p)
#define VSTORE(p, a) _mm256_storeu_ps((p), (a))
#define VADD(a, b) _mm256_add_ps((a), (b))
#define VSUB(a, b) _mm256_sub_ps((a), (b))
#define VMAX(a, b) _mm256_max_ps((a), (b))
#define VFMA(a, b, c) _mm256_fmadd_ps((a), (b), (c))
#define VMULS(a, x) _mm256_mul_ps((a), _mm256_set1_ps(x))
#define VEXP2(a) pkv_exp2_avx2(a)
#define VTANH(a) pkv_tanh_avx2(a)
#define VHSUM(a) pkv_hsum_avx2(a)
#define VHMAX(a) pkv_hmax_avx2(a)
#define VHSUM8(a0, a1, a2, a3, a4, a5, a6, a7, out) pkv_hsum8_avx2(a0, a1, a2, a3, a4, a5, a6, a7, out)
#define PKV_PV_WIDE 0
#define PKV_DOT_WIDE 0
#define VKEEP(v) __asm__("" : "+x"(v))

#define PKV_SUFFIX avx2_f32
#define KV_T float
#define KV_TO_F(x) (x)
#define KV_CHUNK (PKV_CHUNK_TOKENS / 2)
#define KV_TOUCH_AHEAD 1
#define VLOAD_KV(p) _mm256_loadu_ps(p)
#include "attention_kernels_body.h"
PKV_TANH_ARRAY(avx2)
#undef PKV_SUFFIX
#undef KV_T
#undef KV_TO_F
#undef KV_CHUNK
#undef VLOAD_KV

#define PKV_SUFFIX avx2_f16
#define KV_T uint16_t
#define KV_CHUNK PKV_CHUNK_TOKENS
#define KV_TO_F(x) pkv_h2f_f16c(x)
#define VLOAD_KV(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)(p)))
#include "attention_kernels_body.h"
#undef PKV_SUFFIX
#undef KV_T
#undef KV_TO_F
#undef KV_CHUNK
#undef VLOAD_KV

#define PKV_SUFFIX avx2_bf16
#define KV_T uint16_t
#define KV_CHUNK PKV_CHUNK_TOKENS
#define KV_TO_F(x) pkv_fmt_bf2f(x)
#define VLOAD_KV(p) pkv_bf16_avx2(p)
#include "attention_kernels_body.h"
#undef PKV_SUFFIX
#undef KV_T
#undef KV_TO_F
#undef KV_CHUNK
#undef VLOAD_KV

#define PKV_SUFFIX avx2_int8
#define KV_ROTATED 1 /* int8 rows hold R x (page_formats.h) */
#define KV_T uint8_t
#define KV_CHUNK PKV_CHUNK_TOKENS
#define KV_ROW(D) ((D) + 2)
#define KV_LOAD(row, d) pkv_int8_avx2((row), (d), dim)
#define KV_VSCALE(row) pkv_int8_scale((row), dim)
#define KV_PF_TAIL(row) PKV_PREFETCH((row) + dim + 1)
#define KV_VLOAD(row, d) pkv_int8_levels_avx2((row) + (d))
#define KV_VGET(row, d) ((float)pkv_int8_level((row), (d)))
#define KV_GET(row, d) (pkv_int8_scale((row), dim) * (float)pkv_int8_level((row), (d)))
#define KV_ADDR(row, d) ((row) + (d))
#include "attention_kernels_body.h"
#undef PKV_SUFFIX
#undef KV_T
#undef KV_CHUNK

#define PKV_SUFFIX avx2_int4
#define KV_T uint8_t
#define KV_CHUNK PKV_CHUNK_TOKENS
#define KV_ROW(D) pkv_row_bytes(PKV_FORMAT_INT4, (D))
#define KV_LOAD(row, d) pkv_int4_avx2((row), (d), dim)
#define KV_GET(row, d) (pkv_int4_scale((row), dim, (d)) * (float)pkv_int4_level((row), (d)))
#define KV_ADDR(row, d) ((row) + (d) / 2)
#define KV_PF_TAIL(row) PKV_PREFETCH((row) + pkv_row_bytes(PKV_FORMAT_INT4, dim) - 1)
#define KV_LINE_ELEMS 128
#define KV_ROTATED 1
#include "attention_kernels_body.h"
#undef PKV_SUFFIX
#undef KV_T
#undef KV_CHUNK

#undef PKV_TARGET
#undef vf
#undef VW
#undef VZERO
#undef VSET1
#undef VLOAD
#undef VSTORE
#undef VADD
#undef VSUB
#undef VMAX
#undef VFMA
#undef VMULS
#undef VEXP2
#undef VTANH
#undef VHSUM
#undef VHMAX
#undef VHSUM8
#undef PKV_PV_WIDE
#undef PKV_DOT_WIDE
#undef VKEEP

/* ------------------------------------------------------------ x86-64 AVX-512 */

#define PKV_AVX512 __attribute__((target("avx512f,avx512vl,avx2,fma,f16c")))

/* As pkv_exp2_avx2, NaN included. */
PKV_AVX512 static inline __m512 pkv_exp2_avx512(__m512 x)
{
    const __m512 lowest = _mm512_set1_ps(-126.0f);
    const __mmask16 keep = _mm512_cmp_ps_mask(x, lowest, _CMP_NLT_UQ);
    const __m512 xc = _mm512_max_ps(lowest, x);
    const __m512 n = _mm512_roundscale_ps(xc, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(xc, n);
    __m512 p = _mm512_set1_ps(1.5252733804059841e-05f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.5403530393381606e-04f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-03f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-03f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-02f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-01f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-01f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_maskz_mov_ps(keep, _mm512_scalef_ps(p, n));
}
/* As pkv_tanh_avx2 (AVX-512F integer ops for the sign, no AVX-512DQ). */
PKV_AVX512 static inline __m512 pkv_tanh_avx512(__m512 x)
{
    const __m512i sign = _mm512_set1_epi32((int)0x80000000u);
    const __m512 one = _mm512_set1_ps(1.0f);
    const __m512 ax = _mm512_castsi512_ps(_mm512_andnot_si512(sign, _mm512_castps_si512(x)));
    const __m512 e = pkv_exp2_avx512(_mm512_mul_ps(ax, _mm512_set1_ps(PKV_MINUS_2_LOG2E)));
    const __m512 big = _mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e));
    const __m512 x2 = _mm512_mul_ps(ax, ax);
    __m512 p = _mm512_set1_ps(PKV_TANH_C4);
    p = _mm512_fmadd_ps(p, x2, _mm512_set1_ps(PKV_TANH_C3));
    p = _mm512_fmadd_ps(p, x2, _mm512_set1_ps(PKV_TANH_C2));
    p = _mm512_fmadd_ps(p, x2, _mm512_set1_ps(PKV_TANH_C1));
    p = _mm512_fmadd_ps(p, x2, _mm512_set1_ps(PKV_TANH_C0));
    const __m512 small = _mm512_fmadd_ps(_mm512_mul_ps(ax, x2), p, ax);
    const __m512 mag = _mm512_mask_blend_ps(
        _mm512_cmp_ps_mask(ax, _mm512_set1_ps(PKV_TANH_SMALL), _CMP_LT_OQ), big, small);
    return _mm512_castsi512_ps(
        _mm512_or_si512(_mm512_castps_si512(mag), _mm512_and_si512(_mm512_castps_si512(x), sign)));
}
PKV_AVX512 static inline float pkv_hsum_avx512(__m512 v)
{
    __m256 y = _mm256_add_ps(_mm512_castps512_ps256(v),
                             _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(y), _mm256_extractf128_ps(y, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}
PKV_AVX512 static inline float pkv_hmax_avx512(__m512 v)
{
    __m256 y = _mm256_max_ps(_mm512_castps512_ps256(v),
                             _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(y), _mm256_extractf128_ps(y, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    x = _mm_max_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}
PKV_AVX512 static inline float pkv_h2f_f16c512(uint16_t h) { return _cvtsh_ss(h); }
/* As pkv_sum4_lanes_avx2, in each of the four 128-bit lanes. */
PKV_AVX512 static inline __m512 pkv_sum4_lanes_avx512(__m512 a0, __m512 a1, __m512 a2, __m512 a3)
{
    const __m512 t0 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
    const __m512 t1 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
    return _mm512_add_ps(_mm512_shuffle_ps(t0, t1, _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(t0, t1, _MM_SHUFFLE(3, 2, 3, 2)));
}
/* [u0 lanes 0+1, u0 lanes 2+3, u1 lanes 0+1, u1 lanes 2+3] (128-bit lanes) */
PKV_AVX512 static inline __m512 pkv_pair_lanes_avx512(__m512 u0, __m512 u1)
{
    return _mm512_add_ps(_mm512_shuffle_f32x4(u0, u1, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(u0, u1, _MM_SHUFFLE(3, 1, 3, 1)));
}
/* out[i] = sum of the lanes of ai: within 128-bit lanes, then across them. */
PKV_AVX512 static inline void pkv_hsum8_avx512(__m512 a0, __m512 a1, __m512 a2, __m512 a3,
                                               __m512 a4, __m512 a5, __m512 a6, __m512 a7,
                                               float *out)
{
    const __m512 z = pkv_pair_lanes_avx512(pkv_sum4_lanes_avx512(a0, a1, a2, a3),
                                           pkv_sum4_lanes_avx512(a4, a5, a6, a7));
    _mm256_storeu_ps(out, _mm512_castps512_ps256(pkv_pair_lanes_avx512(z, z)));
}

/* s[i * stride + j] = sum of the lanes of aij (4 rows i x 4 tokens j): the
 * tree of pkv_hsum8_avx512 (same sums, same order) run once over all 16
 * accumulators, so that every shuffle and add serves 16 results, not 8. */
#define VHSUM4X4(a00, a01, a02, a03, a10, a11, a12, a13, a20, a21, a22, a23, a30, a31, a32, a33, \
                 s, stride)                                                                    \
    do {                                                                                      \
        const __m512 w_ = pkv_pair_lanes_avx512(                                              \
            pkv_pair_lanes_avx512(pkv_sum4_lanes_avx512(a00, a01, a02, a03),                 \
                                  pkv_sum4_lanes_avx512(a10, a11, a12, a13)),                \
            pkv_pair_lanes_avx512(pkv_sum4_lanes_avx512(a20, a21, a22, a23),                 \
                                  pkv_sum4_lanes_avx512(a30, a31, a32, a33)));               \
        _mm_storeu_ps((s), _mm512_castps512_ps128(w_));                                       \
        _mm_storeu_ps((s) + (stride), _mm512_extractf32x4_ps(w_, 1));                        \
        _mm_storeu_ps((s) + 2 * (stride), _mm512_extractf32x4_ps(w_, 2));                    \
        _mm_storeu_ps((s) + 3 * (stride), _mm512_extractf32x4_ps(w_, 3));                    \
    } while (0)

/* VHSUM4X4 for 8-lane (256-bit) accumulators. */
#define PKV_HSUM4X4_YMM(a00, a01, a02, a03, a10, a11, a12, a13, a20, a21, a22, a23, a30, a31, \
                        a32, a33, s, stride)                                               \
    do {                                                                                    \
        const __m256 r01_ = pkv_pair_lanes_avx2(pkv_sum4_lanes_avx2(a00, a01, a02, a03),    \
                                                pkv_sum4_lanes_avx2(a10, a11, a12, a13));   \
        const __m256 r23_ = pkv_pair_lanes_avx2(pkv_sum4_lanes_avx2(a20, a21, a22, a23),    \
                                                pkv_sum4_lanes_avx2(a30, a31, a32, a33));   \
        _mm_storeu_ps((s), _mm256_castps256_ps128(r01_));                                   \
        _mm_storeu_ps((s) + (stride), _mm256_extractf128_ps(r01_, 1));                      \
        _mm_storeu_ps((s) + 2 * (stride), _mm256_castps256_ps128(r23_));                    \
        _mm_storeu_ps((s) + 3 * (stride), _mm256_extractf128_ps(r23_, 1));                  \
    } while (0)

PKV_AVX512 static inline __m512 pkv_bf16_avx512(const uint16_t *p)
{
    const __m256i b = _mm256_loadu_si256((const __m256i *)(const void *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}
PKV_AVX512 static inline __m512 pkv_int8_levels_avx512(const uint8_t *p)
{
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(const void *)p)));
}
PKV_AVX512 static inline __m512 pkv_int8_avx512(const uint8_t *row, int64_t d, int64_t dim)
{
    return _mm512_mul_ps(pkv_int8_levels_avx512(row + d), _mm512_set1_ps(pkv_int8_scale(row, dim)));
}
PKV_AVX512 static inline __m512 pkv_int4_avx512(const uint8_t *row, int64_t d, int64_t dim)
{
    const __m128i q = pkv_int4_levels16(_mm_loadl_epi64((const __m128i *)(const void *)(row + d / 2)));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)),
                         _mm512_set1_ps(pkv_int4_scale(row, dim, d)));
}

#define PKV_TARGET PKV_AVX512
#define vf __m512
#define VW 16
#define VZERO() _mm512_setzero_ps()
#define VSET1(x) _mm512_set1_ps(x)
#define VLOAD(p) _mm512_loadu_ps(p)
#define VSTORE(p, a) _mm512_storeu_ps((p), (a))
#define VADD(a, b) _mm512_add_ps((a), (b))
#define VSUB(a, b) _mm512_sub_ps((a), (b))
#define VMAX(a, b) _mm512_max_ps((a), (b))
#define VFMA(a, b, c) _mm512_fmadd_ps((a), (b), (c))
#define VMULS(a, x) _mm512_mul_ps((a), _mm512_set1_ps(x))
#define VEXP2(a) pkv_exp2_avx512(a)
#define VTANH(a) pkv_tanh_avx512(a)
#define VHSUM(a) pkv_hsum_avx512(a)
#define VHMAX(a) pkv_hmax_avx512(a)
#define VHSUM8(a0, a1, a2, a3, a4, a5, a6, a7, out) pkv_hsum8_avx512(a0, a1, a2, a3, a4, a5, a6, a7, out)
#define PKV_PV_WIDE 1
#define PKV_DOT_WIDE 1
#define VKEEP(v) __asm__("" : "+v"(v))

#define PKV_SUFFIX avx512_f32
#define KV_T float
#define KV_TO_F(x) (x)
#define KV_CHUNK (PKV_CHUNK_TOKENS / 2)
#define VLOAD_KV(p) _mm512_loadu_ps(p)
#include "attention_kernels_body.h"
PKV_TANH_ARRAY(avx512)
#undef PKV_SUFFIX
#undef KV_T
#undef KV_TO_F
#undef KV_CHUNK
#undef VLOAD_KV

/* float16 pools score with 256-bit vectors (registers 16-31 need AVX-512VL):
 * the lane throughput of the FMAs and conversions is the same on cores that
 * split 512-bit operations in two (Zen 4: measured 9.8 against 11.2 ns per
 * token of 4 query heads), and the horizontal sums, which compete with the
 * conversions for the same ports, halve. float32 pools keep 512-bit scores
 * (9.5 against 9.9 ns). */
#define sf __m256
#define SW 8
#define SZERO() _mm256_setzero_ps()
#define SLOAD(p) _mm256_loadu_ps(p)
#define KV_SLOAD(row, d) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)((row) + (d))))
#define SFMA(a, b, c) _mm256_fmadd_ps((a), (b), (c))
#define SKEEP(v) __asm__("" : "+v"(v))
#define SHSUM4X4 PKV_HSUM4X4_YMM
#define PKV_SUFFIX avx512_f16
#define KV_T uint16_t
#define KV_CHUNK PKV_CHUNK_TOKENS
#define KV_TO_F(x) pkv_h2f_f16c512(x)
#define VLOAD_KV(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(const void *)(p)))
#include "attention_kernels_body.h"
#undef PKV_SUFFIX
#undef KV_T
#undef KV_TO_F
#undef KV_CHUNK
#undef VLOAD_KV

/* bfloat16 pools: the float16 scheme, with the shift for the conversion. */
#define sf __m256
#define SW 8
#define SZERO() _mm256_setzero_ps()
#define SLOAD(p) _mm256_loadu_ps(p)
#define KV_SLOAD(row, d) pkv_bf16_avx2((row) + (d)) /* the AVX2 conversion, inlined here */
#define SFMA(a, b, c) _mm256_fmadd_ps((a), (b), (c))
#define SKEEP(v) __asm__("" : "+v"(v))
#define SHSUM4X4 PKV_HSUM4X4_YMM
#define PKV_SUFFIX avx512_bf16
#define KV_T uint16_t
#define KV_CHUNK PKV_CHUNK_TOKENS
#define KV_TO_F(x) pkv_fmt_bf2f(x)
#define VLOAD_KV(p) pkv_bf16_avx512(p)
#include "attention_kernels_body.h"
#undef PKV_SUFFIX
#undef KV_T
#undef KV_TO_F
#undef KV_CHUNK
#undef VLOAD_KV

#define PKV_SUFFIX avx512_int8
#define KV_ROTATED 1 /* int8 rows hold R x (page_formats.h) */
#define KV_T uint8_t
#define KV_CHUNK PKV_CHUNK_TOKENS
#define KV_ROW(D) ((D) + 2)
#define KV_LOAD(row, d) pkv_int8_avx512((row), (d), dim)
#define KV_VSCALE(row) pkv_int8_scale((row), dim)
#define KV_PF_TAIL(row) PKV_PREFETCH((row) + dim + 1)
#define KV_VLOAD(row, d) pkv_int8_levels_avx512((row) + (d))
#define KV_VGET(row, d) ((float)pkv_int8_level((row), (d)))
#define KV_GET(row, d) (pkv_int8_scale((row), dim) * (float)pkv_int8_level((row), (d)))
#define KV_ADDR(row, d) ((row) + (d))
#include "attention_kernels_body.h"
#undef PKV_SUFFIX
#undef KV_T
#undef KV_CHUNK

/* int8 scores with AVX-512 VNNI: vpdpbusd multiplies unsigned by signed
 * bytes, so the query is stored as level + 128 and 128 * sum(k) (one more
 * vpdpbusd per key vector, shared by the query rows) taken off. Every lane
 * sum is an exact integer below 2**24 (at most 4 * 256 / 64 * 255 * 128 per
 * lane, 256 * 127 * 127 in all), so the float horizontal sums are exact.
 * Bytes past head_dim are masked out of both loads. */
#define PKV_AVX512VNNI __attribute__((target("avx512f,avx512vl,avx512bw,avx512vnni,avx2,fma,f16c")))

PKV_AVX512VNNI static inline __mmask32 pkv_bytes_mask(int64_t left)
{
    return left >= 32 ? ~(__mmask32)0 : (((__mmask32)1 << left) - 1);
}

/* 256-bit vectors, as for float16 scores: Zen 4 splits 512-bit operations in
 * two, and the horizontal sums, which cost more here than the dot products,
 * halve. */
PKV_AVX512VNNI static inline void pkv_dot_i8_4x4_vnni(const uint8_t *qb, int64_t q_stride,
                                                      const uint8_t *const *k,
                                                      const uint8_t *const *pf, int64_t dim,
                                                      float *s, int64_t s_stride)
{
    const __m256i ones = _mm256_set1_epi8(1);
    __m256i a00 = _mm256_setzero_si256(), a01 = a00, a02 = a00, a03 = a00;
    __m256i a10 = a00, a11 = a00, a12 = a00, a13 = a00;
    __m256i a20 = a00, a21 = a00, a22 = a00, a23 = a00;
    __m256i a30 = a00, a31 = a00, a32 = a00, a33 = a00;
    __m256i k0s = a00, k1s = a00, k2s = a00, k3s = a00;
    int64_t d;
    for (d = 0; d < dim; d += 32) {
        const __mmask32 m = pkv_bytes_mask(dim - d);
        if (pf != NULL && (d & 63) == 0) {
            PKV_PREFETCH(pf[0] + d); PKV_PREFETCH(pf[1] + d);
            PKV_PREFETCH(pf[2] + d); PKV_PREFETCH(pf[3] + d);
        }
        const __m256i x0 = _mm256_maskz_loadu_epi8(m, k[0] + d), x1 = _mm256_maskz_loadu_epi8(m, k[1] + d);
        const __m256i x2 = _mm256_maskz_loadu_epi8(m, k[2] + d), x3 = _mm256_maskz_loadu_epi8(m, k[3] + d);
        k0s = _mm256_dpbusd_epi32(k0s, ones, x0); k1s = _mm256_dpbusd_epi32(k1s, ones, x1);
        k2s = _mm256_dpbusd_epi32(k2s, ones, x2); k3s = _mm256_dpbusd_epi32(k3s, ones, x3);
        __m256i w = _mm256_maskz_loadu_epi8(m, qb + d);
        a00 = _mm256_dpbusd_epi32(a00, w, x0); a01 = _mm256_dpbusd_epi32(a01, w, x1);
        a02 = _mm256_dpbusd_epi32(a02, w, x2); a03 = _mm256_dpbusd_epi32(a03, w, x3);
        w = _mm256_maskz_loadu_epi8(m, qb + q_stride + d);
        a10 = _mm256_dpbusd_epi32(a10, w, x0); a11 = _mm256_dpbusd_epi32(a11, w, x1);
        a12 = _mm256_dpbusd_epi32(a12, w, x2); a13 = _mm256_dpbusd_epi32(a13, w, x3);
        w = _mm256_maskz_loadu_epi8(m, qb + 2 * q_stride + d);
        a20 = _mm256_dpbusd_epi32(a20, w, x0); a21 = _mm256_dpbusd_epi32(a21, w, x1);
        a22 = _mm256_dpbusd_epi32(a22, w, x2); a23 = _mm256_dpbusd_epi32(a23, w, x3);
        w = _mm256_maskz_loadu_epi8(m, qb + 3 * q_stride + d);
        a30 = _mm256_dpbusd_epi32(a30, w, x0); a31 = _mm256_dpbusd_epi32(a31, w, x1);
        a32 = _mm256_dpbusd_epi32(a32, w, x2); a33 = _mm256_dpbusd_epi32(a33, w, x3);
    }
    if (pf != NULL) {
        /* the line holding the scale, past the values */
        PKV_PREFETCH(pf[0] + dim + 1); PKV_PREFETCH(pf[1] + dim + 1);
        PKV_PREFETCH(pf[2] + dim + 1); PKV_PREFETCH(pf[3] + dim + 1);
    }
#define PKV_I8F(a) _mm256_cvtepi32_ps(a)
    PKV_HSUM4X4_YMM(PKV_I8F(a00), PKV_I8F(a01), PKV_I8F(a02), PKV_I8F(a03),
                    PKV_I8F(a10), PKV_I8F(a11), PKV_I8F(a12), PKV_I8F(a13),
                    PKV_I8F(a20), PKV_I8F(a21), PKV_I8F(a22), PKV_I8F(a23),
                    PKV_I8F(a30), PKV_I8F(a31), PKV_I8F(a32), PKV_I8F(a33), s, s_stride);
    /* 128 * sum(k) of the 4 keys, taken off each row's 4 sums */
    const __m256 u = pkv_sum4_lanes_avx2(PKV_I8F(k0s), PKV_I8F(k1s), PKV_I8F(k2s), PKV_I8F(k3s));
    const __m128 kc = _mm_mul_ps(_mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1)),
                                 _mm_set1_ps(128.0f));
#undef PKV_I8F
    _mm_storeu_ps(s, _mm_sub_ps(_mm_loadu_ps(s), kc));
    _mm_storeu_ps(s + s_stride, _mm_sub_ps(_mm_loadu_ps(s + s_stride), kc));
    _mm_storeu_ps(s + 2 * s_stride, _mm_sub_ps(_mm_loadu_ps(s + 2 * s_stride), kc));
    _mm_storeu_ps(s + 3 * s_stride, _mm_sub_ps(_mm_loadu_ps(s + 3 * s_stride), kc));
}

PKV_AVX512VNNI static inline void pkv_dot_i8_1x4_vnni(const uint8_t *qb, const uint8_t *const *k,
                                                      int64_t dim, float *s)
{
    const __m256i ones = _mm256_set1_epi8(1);
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
    __m256i k0s = a0, k1s = a0, k2s = a0, k3s = a0;
    int64_t d;
    for (d = 0; d < dim; d += 32) {
        const __mmask32 m = pkv_bytes_mask(dim - d);
        const __m256i x0 = _mm256_maskz_loadu_epi8(m, k[0] + d), x1 = _mm256_maskz_loadu_epi8(m, k[1] + d);
        const __m256i x2 = _mm256_maskz_loadu_epi8(m, k[2] + d), x3 = _mm256_maskz_loadu_epi8(m, k[3] + d);
        const __m256i w = _mm256_maskz_loadu_epi8(m, qb + d);
        k0s = _mm256_dpbusd_epi32(k0s, ones, x0); k1s = _mm256_dpbusd_epi32(k1s, ones, x1);
        k2s = _mm256_dpbusd_epi32(k2s, ones, x2); k3s = _mm256_dpbusd_epi32(k3s, ones, x3);
        a0 = _mm256_dpbusd_epi32(a0, w, x0); a1 = _mm256_dpbusd_epi32(a1, w, x1);
        a2 = _mm256_dpbusd_epi32(a2, w, x2); a3 = _mm256_dpbusd_epi32(a3, w, x3);
    }
    /* integer lane sums: exact, and below 2**24 */
    const __m256 u = pkv_sum4_lanes_avx2(
        _mm256_cvtepi32_ps(_mm256_sub_epi32(a0, _mm256_slli_epi32(k0s, 7))),
        _mm256_cvtepi32_ps(_mm256_sub_epi32(a1, _mm256_slli_epi32(k1s, 7))),
        _mm256_cvtepi32_ps(_mm256_sub_epi32(a2, _mm256_slli_epi32(k2s, 7))),
        _mm256_cvtepi32_ps(_mm256_sub_epi32(a3, _mm256_slli_epi32(k3s, 7))));
    _mm_storeu_ps(s, _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1)));
}

#undef PKV_TARGET
#define PKV_TARGET PKV_AVX512VNNI
#define PKV_SUFFIX avx512vnni_int8
#define KV_ROTATED 1 /* int8 rows hold R x (page_formats.h) */
#define KV_T uint8_t
#define KV_CHUNK PKV_CHUNK_TOKENS
#define KV_ROW(D) ((D) + 2)
#define KV_LOAD(row, d) pkv_int8_avx512((row), (d), dim)
#define KV_VSCALE(row) pkv_int8_scale((row), dim)
#define KV_PF_TAIL(row) PKV_PREFETCH((row) + dim + 1)
#define KV_VLOAD(row, d) pkv_int8_levels_avx512((row) + (d))
#define KV_VGET(row, d) ((float)pkv_int8_level((row), (d)))
#define KV_GET(row, d) (pkv_int8_scale((row), dim) * (float)pkv_int8_level((row), (d)))
#define KV_ADDR(row, d) ((row) + (d))
#define KV_INT_DOT 1
#define KV_INT_DOT_4X4(qb, q_stride, k, pf, dim, s, s_stride) \
    pkv_dot_i8_4x4_vnni((qb), (q_stride), (k), (pf), (dim), (s), (s_stride))
#define KV_INT_DOT_1X4(qb, k, dim, s) pkv_dot_i8_1x4_vnni((qb), (k), (dim), (s))
#define KV_KSCALE(row) pkv_int8_scale((row), dim)
#include "attention_kernels_body.h"
#undef PKV_SUFFIX
#undef KV_T
#undef KV_CHUNK
#undef KV_INT_DOT_4X4
#undef KV_INT_DOT_1X4
#undef KV_KSCALE
#undef PKV_TARGET
#define PKV_TARGET PKV_AVX512

#define PKV_SUFFIX avx512_int4
#define KV_T uint8_t
#define KV_CHUNK PKV_CHUNK_TOKENS
#define KV_ROW(D) pkv_row_bytes(PKV_FORMAT_INT4, (D))
#define KV_LOAD(row, d) pkv_int4_avx512((row), (d), dim)
#define KV_GET(row, d) (pkv_int4_scale((row), dim, (d)) * (float)pkv_int4_level((row), (d)))
#define KV_ADDR(row, d) ((row) + (d) / 2)
#define KV_PF_TAIL(row) PKV_PREFETCH((row) + pkv_row_bytes(PKV_FORMAT_INT4, dim) - 1)
#define KV_LINE_ELEMS 128
#define KV_ROTATED 1
#include "attention_kernels_body.h"
#undef PKV_SUFFIX
#undef KV_T
#undef KV_CHUNK

#undef PKV_TARGET
#undef vf
#undef VW
#undef VZERO
#undef VSET1
#undef VLOAD
#undef VSTORE
#undef VADD
#undef VSUB
#undef VMAX
#undef VFMA
#undef VMULS
#undef VEXP2
#undef VTANH
#undef VHSUM
#undef VHMAX
#undef VHSUM8
#undef VHSUM4X4
#undef PKV_PV_WIDE
#undef PKV_DOT_WIDE
#undef VKEEP

#endif /* PKV_X86_DISPATCH */

/* ------------------------------------------------------------------ dispatch */

#if PKV_X86_DISPATCH
static int pkv_cpuid1_ecx_has(unsigned int bits)
{
    unsigned int eax, ebx, ecx, edx;
    if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx))
        return 0;
    return (ecx & bits) == bits;
}
#endif

int pkv_isa_available(pkv_isa isa)
{
    switch (isa) {
    case PKV_ISA_SCALAR:
        return 1;
#if PKV_X86_DISPATCH
    case PKV_ISA_AVX2:
        /* __builtin_cpu_supports checks that the OS saves the AVX state; FMA
         * and F16C are read from CPUID leaf 1 (ECX bits 12 and 29), as not
         * every compiler knows those feature names. */
        __builtin_cpu_init();
        return __builtin_cpu_supports("avx2") && pkv_cpuid1_ecx_has((1u << 12) | (1u << 29));
    case PKV_ISA_AVX512:
        return pkv_isa_available(PKV_ISA_AVX2) && __builtin_cpu_supports("avx512f") &&
               __builtin_cpu_supports("avx512vl");
#endif
    default:
        return 0;
    }
}

#if PKV_X86_DISPATCH
/* AVX-512 VNNI (and BW, for the byte masks) for the integer int8 scores. */
static int pkv_int8_vnni_available(void)
{
#ifdef PKV_INT8_FLOAT_SCORES /* measurement switch: the float-conversion scores */
    return 0;
#endif
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vnni");
}
#endif

int pkv_int8_integer_scores(pkv_isa isa)
{
#if PKV_X86_DISPATCH
    return isa == PKV_ISA_AVX512 && pkv_int8_vnni_available();
#else
    (void)isa;
    return 0;
#endif
}

pkv_isa pkv_best_isa(void)
{
    if (pkv_isa_available(PKV_ISA_AVX512))
        return PKV_ISA_AVX512;
    if (pkv_isa_available(PKV_ISA_AVX2))
        return PKV_ISA_AVX2;
    return PKV_ISA_SCALAR;
}

const char *pkv_isa_name(pkv_isa isa)
{
    switch (isa) {
    case PKV_ISA_AVX2:
        return "avx2";
    case PKV_ISA_AVX512:
        return "avx512";
    default:
        return "scalar";
    }
}

void pkv_tanh_array(pkv_isa isa, const float *x, float *y, int64_t n)
{
    switch (isa) {
#if PKV_X86_DISPATCH
    case PKV_ISA_AVX512:
        pkv_tanh_array_avx512(x, y, n);
        return;
    case PKV_ISA_AVX2:
        pkv_tanh_array_avx2(x, y, n);
        return;
#endif
    default:
        pkv_tanh_array_scalar(x, y, n);
    }
}

#define PKV_KERNEL_OF_FORMAT(path, format)                              \
    ((format) == PKV_FORMAT_F16    ? attend_item_##path##_f16        \
     : (format) == PKV_FORMAT_BF16 ? attend_item_##path##_bf16       \
     : (format) == PKV_FORMAT_INT8 ? attend_item_##path##_int8       \
     : (format) == PKV_FORMAT_INT4 ? attend_item_##path##_int4       \
                                   : attend_item_##path##_f32)

pkv_item_kernel pkv_get_kernel(pkv_isa isa, int format)
{
    switch (isa) {
#if PKV_X86_DISPATCH
    case PKV_ISA_AVX512:
        if (format == PKV_FORMAT_INT8 && pkv_int8_vnni_available())
            return attend_item_avx512vnni_int8;
        return PKV_KERNEL_OF_FORMAT(avx512, format);
    case PKV_ISA_AVX2:
        return PKV_KERNEL_OF_FORMAT(avx2, format);
#endif
    default:
        return PKV_KERNEL_OF_FORMAT(scalar, format);
    }
}
