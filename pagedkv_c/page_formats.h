/* Page formats: how one head row (one token's head_dim values of one KV head)
 * is laid out in a page.
 *
 * A page of one layer is [2][page_size][num_kv_heads][row bytes], K then V,
 * whatever the format; only the bytes of a head row differ. Scales are part of
 * the row they decode, so a page's data and scales are one run of bytes: a page
 * copy, a checksum, a snapshot or a tier value needs no knowledge of the format.
 *
 *   PKV_FORMAT_F32   D float32                                   4 D bytes
 *   PKV_FORMAT_F16   D IEEE float16                              2 D bytes
 *   PKV_FORMAT_BF16  D bfloat16 (the upper half of a float32,    2 D bytes
 *                    rounded to nearest even; NaN stays NaN)
 *   PKV_FORMAT_INT8  D int8 q_i, then a bfloat16 scale d:        D + 2 bytes
 *                    (R x)_i = d * q_i (symmetric, one scale per row, rotated)
 *   PKV_FORMAT_INT4  see pkv_int4 below                          ceil(D / 2) + 2 * ceil(D / 32) bytes
 *
 * Quantized rows: the scale is computed from the row's largest magnitude and
 * rounded up to bfloat16 (bfloat16 has float32's range, so no finite row
 * overflows it; rounding up keeps every |x_i| / d within the integer range);
 * values are rounded to the nearest integer, ties to even (rint in the default
 * rounding mode). A row holding a NaN or an infinity is stored with a NaN scale
 * and zero integers: it decodes to NaN in every element, so attention over it
 * gives NaN as it would over float pages, never a finite value.
 *
 * Formats with PKV_FORMAT_ROTATED(fmt) store R x instead of x, R the
 * orthonormal Walsh-Hadamard transform over blocks of P values (P the largest
 * power of two dividing D, at most 256; Sylvester order, scaled by 1/sqrt(P)):
 * R is symmetric and its own inverse, so scores q.k = (R q).(R k) and outputs
 * sum w_i v_i = R (sum w_i R v_i). Rotation spreads a channel outlier over the
 * block, which is what lets a 4-bit grid hold the row (QuaRot, Ashkboos et al.
 * 2024; llama.cpp rotates quantized caches the same way).
 */
#ifndef PAGEDKV_PAGE_FORMATS_H
#define PAGEDKV_PAGE_FORMATS_H

#include <math.h>
#include <stdint.h>
#include <string.h>

typedef enum {
    PKV_FORMAT_F32 = 0,
    PKV_FORMAT_F16 = 1,
    PKV_FORMAT_BF16 = 2,
    PKV_FORMAT_INT8 = 3,
    PKV_FORMAT_INT4 = 4
} pkv_format;

/* Element type of the rows a store receives. */
typedef enum {
    PKV_INPUT_F32 = 0,
    PKV_INPUT_F16 = 1,
    PKV_INPUT_BF16 = 2
} pkv_input;

#define PKV_INT4_BLOCK 32
#define PKV_FORMAT_ROTATED(fmt) ((fmt) == PKV_FORMAT_INT8 || (fmt) == PKV_FORMAT_INT4)

/* Bytes of one head row of head_dim values. */
static inline int64_t pkv_row_bytes(pkv_format fmt, int64_t head_dim)
{
    switch (fmt) {
    case PKV_FORMAT_F32: return 4 * head_dim;
    case PKV_FORMAT_F16: return 2 * head_dim;
    case PKV_FORMAT_BF16: return 2 * head_dim;
    case PKV_FORMAT_INT8: return head_dim + 2;
    case PKV_FORMAT_INT4:
        return (head_dim + 1) / 2 + 2 * ((head_dim + PKV_INT4_BLOCK - 1) / PKV_INT4_BLOCK);
    }
    return -1;
}

/* ---------------------------------------------------------------- scalars */

/* IEEE float16 -> float32, exact for all 65536 inputs. */
static inline float pkv_fmt_h2f(uint16_t h)
{
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    const uint32_t exponent = (h >> 10) & 0x1fu;
    uint32_t mantissa = h & 0x3ffu;
    uint32_t bits;
    if (exponent == 0x1fu) {
        bits = sign | 0x7f800000u | (mantissa << 13); /* inf, NaN (payload kept) */
    } else if (exponent != 0) {
        bits = sign | ((exponent + 112u) << 23) | (mantissa << 13); /* rebias 15 -> 127 */
    } else if (mantissa == 0) {
        bits = sign; /* signed zero */
    } else {
        /* subnormal half: mantissa * 2**-24; normalise into a float32 normal */
        uint32_t e = 113u;
        while ((mantissa & 0x400u) == 0) {
            mantissa <<= 1;
            e--;
        }
        bits = sign | (e << 23) | ((mantissa & 0x3ffu) << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* float32 -> IEEE float16, round to nearest even (NaN stays NaN, overflow to inf). */
static inline uint16_t pkv_fmt_f2h(float f)
{
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    const uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    uint32_t abs = x & 0x7fffffffu;
    if (abs >= 0x7f800000u) /* inf or NaN */
        return (uint16_t)(sign | 0x7c00u | (abs > 0x7f800000u ? 0x200u | ((abs >> 13) & 0x3ffu) : 0u));
    if (abs >= 0x477ff000u) /* rounds to >= 65520: inf */
        return (uint16_t)(sign | 0x7c00u);
    if (abs < 0x38800000u) { /* below the smallest normal half: subnormal or zero */
        if (abs < 0x33000000u) /* below half the smallest subnormal: zero */
            return sign;
        const uint32_t exponent = abs >> 23;
        const uint32_t mantissa = (abs & 0x7fffffu) | 0x800000u;
        const uint32_t shift = 126u - exponent; /* 14 .. 24 */
        uint32_t h = mantissa >> shift;
        const uint32_t rest = mantissa & ((1u << shift) - 1u);
        const uint32_t half = 1u << (shift - 1u);
        if (rest > half || (rest == half && (h & 1u)))
            h++;
        return (uint16_t)(sign | h);
    }
    uint32_t h = ((abs >> 13) - (112u << 10));
    const uint32_t rest = abs & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1u)))
        h++;
    return (uint16_t)(sign | h);
}

static inline float pkv_fmt_bf2f(uint16_t b)
{
    const uint32_t bits = (uint32_t)b << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* float32 -> bfloat16, round to nearest even; NaN stays a (quiet) NaN. */
static inline uint16_t pkv_fmt_f2bf(float f)
{
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    if ((x & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((x >> 16) | 0x40u);
    x += 0x7fffu + ((x >> 16) & 1u);
    return (uint16_t)(x >> 16);
}

/* Smallest bfloat16 >= f, for finite f >= 0 (a scale rounded up). */
static inline uint16_t pkv_fmt_f2bf_up(float f)
{
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    uint16_t b = (uint16_t)(x >> 16);
    if ((x & 0xffffu) != 0)
        b++; /* carries into the exponent correctly; f < 2**128 stays finite or becomes inf */
    return b;
}

static inline float pkv_fmt_load(pkv_input kind, const void *src, int64_t i)
{
    switch (kind) {
    case PKV_INPUT_F32: return ((const float *)src)[i];
    case PKV_INPUT_F16: return pkv_fmt_h2f(((const uint16_t *)src)[i]);
    case PKV_INPUT_BF16: return pkv_fmt_bf2f(((const uint16_t *)src)[i]);
    }
    return 0.0f;
}

/* --------------------------------------------------------------- rotation */

static inline int64_t pkv_rotation_block(int64_t head_dim)
{
    int64_t p = 1;
    while (p < 256 && head_dim % (2 * p) == 0)
        p *= 2;
    return p;
}

/* x <- R x in place (R its own inverse). */
static inline void pkv_rotate(float *x, int64_t head_dim)
{
    const int64_t p = pkv_rotation_block(head_dim);
    if (p == 1)
        return;
    const float norm = 1.0f / sqrtf((float)p);
    for (int64_t base = 0; base < head_dim; base += p) {
        float *b = x + base;
        for (int64_t h = 1; h < p; h *= 2) {
            for (int64_t i = 0; i < p; i += 2 * h) {
                for (int64_t j = i; j < i + h; j++) {
                    const float a = b[j], c = b[j + h];
                    b[j] = a + c;
                    b[j + h] = a - c;
                }
            }
        }
        for (int64_t j = 0; j < p; j++)
            b[j] *= norm;
    }
}

/* ------------------------------------------------------------ row codecs */

/* Quantize n values to integers in [-limit, limit] with one scale, rounded up
 * to bfloat16; returns the scale's bits. Non-finite input: NaN scale, zeros. */
static inline uint16_t pkv_quantize_symmetric(const float *x, int64_t n, int32_t limit, int32_t *q)
{
    float amax = 0.0f;
    int finite = 1;
    for (int64_t i = 0; i < n; i++) {
        const float a = fabsf(x[i]);
        if (!(a <= 3.4028234663852886e38f))
            finite = 0;
        else if (a > amax)
            amax = a;
    }
    if (!finite) {
        for (int64_t i = 0; i < n; i++)
            q[i] = 0;
        return 0x7fc0u;
    }
    const uint16_t bits = pkv_fmt_f2bf_up(amax / (float)limit);
    const float d = pkv_fmt_bf2f(bits);
    const float inv = d > 0.0f ? 1.0f / d : 0.0f;
    for (int64_t i = 0; i < n; i++) {
        float r = rintf(x[i] * inv);
        if (r > (float)limit) r = (float)limit;
        if (r < (float)-limit) r = (float)-limit;
        q[i] = (int32_t)r;
    }
    return bits;
}

/* Clip factors of the int4 scale: each block takes the one with the least squared error. */
static const float pkv_q4_clips[6] = {1.0f, 0.95f, 0.9f, 0.85f, 0.8f, 0.75f};

/* One int4 block of n values: levels q_i in [-8, 7] with x_i ~ d * q_i, where
 * d = f * m / -8 rounded to bfloat16, m the value of largest magnitude (the
 * first one on ties; it lands on level -8 with f = 1, as in llama.cpp's
 * q4_0), q_i = clamp(floor(x_i / d + 8.5), 0, 15) - 8, and f the clip factor of
 * least squared error (the first on ties). Returns the scale's bits;
 * non-finite input: NaN scale, zeros. */
static inline uint16_t pkv_quantize_q4(const float *x, int64_t n, int32_t *q)
{
    float m = 0.0f, amax = 0.0f;
    for (int64_t i = 0; i < n; i++) {
        const float a = fabsf(x[i]);
        if (!(a <= 3.4028234663852886e38f)) {
            for (int64_t j = 0; j < n; j++)
                q[j] = 0;
            return 0x7fc0u;
        }
        if (a > amax) {
            amax = a;
            m = x[i];
        }
    }
    uint16_t best_bits = 0;
    double best_err = 0.0;
    int32_t trial[PKV_INT4_BLOCK];
    for (int c = 0; c < 6; c++) {
        const uint16_t bits = pkv_fmt_f2bf(pkv_q4_clips[c] * m / -8.0f);
        const float d = pkv_fmt_bf2f(bits);
        const float inv = d != 0.0f ? 1.0f / d : 0.0f;
        double err = 0.0; /* double: no overflow for any finite row */
        for (int64_t i = 0; i < n; i++) {
            float r = floorf(x[i] * inv + 8.5f);
            if (r < 0.0f) r = 0.0f;
            if (r > 15.0f) r = 15.0f;
            trial[i] = (int32_t)r - 8;
            const double e = (double)d * (double)trial[i] - (double)x[i];
            err += e * e;
        }
        if (c == 0 || err < best_err) {
            best_err = err;
            best_bits = bits;
            for (int64_t i = 0; i < n; i++)
                q[i] = trial[i];
        }
    }
    return best_bits;
}

/* Encode one head row; scratch holds head_dim floats. */
static inline void pkv_encode_row(pkv_format fmt, pkv_input kind, const void *src, int64_t head_dim,
                                  uint8_t *dst, float *scratch)
{
    int64_t i;
    switch (fmt) {
    case PKV_FORMAT_F32:
        for (i = 0; i < head_dim; i++) {
            const float v = pkv_fmt_load(kind, src, i);
            memcpy(dst + 4 * i, &v, 4);
        }
        return;
    case PKV_FORMAT_F16:
        for (i = 0; i < head_dim; i++) {
            const uint16_t h = kind == PKV_INPUT_F16 ? ((const uint16_t *)src)[i]
                                                     : pkv_fmt_f2h(pkv_fmt_load(kind, src, i));
            memcpy(dst + 2 * i, &h, 2);
        }
        return;
    case PKV_FORMAT_BF16:
        for (i = 0; i < head_dim; i++) {
            const uint16_t b = kind == PKV_INPUT_BF16 ? ((const uint16_t *)src)[i]
                                                      : pkv_fmt_f2bf(pkv_fmt_load(kind, src, i));
            memcpy(dst + 2 * i, &b, 2);
        }
        return;
    case PKV_FORMAT_INT8:
    case PKV_FORMAT_INT4: {
        int32_t q[256];
        for (i = 0; i < head_dim; i++)
            scratch[i] = pkv_fmt_load(kind, src, i);
        if (PKV_FORMAT_ROTATED(fmt))
            pkv_rotate(scratch, head_dim);
        if (fmt == PKV_FORMAT_INT8) {
            const uint16_t d = pkv_quantize_symmetric(scratch, head_dim, 127, q);
            for (i = 0; i < head_dim; i++)
                dst[i] = (uint8_t)(int8_t)q[i];
            memcpy(dst + head_dim, &d, 2);
            return;
        }
        /* int4: blocks of PKV_INT4_BLOCK values in llama.cpp's q4_0 grid
         * (levels -8 .. 7 times the block's scale, stored as q + 8 in a nibble:
         * value 2j in the low nibble of byte j, 2j + 1 in the high one), with the
         * scale clipped for the least squared error; the bfloat16 scales of the
         * blocks follow the packed values. */
        const int64_t packed = (head_dim + 1) / 2;
        const int64_t num_blocks = (head_dim + PKV_INT4_BLOCK - 1) / PKV_INT4_BLOCK;
        int finite = 1;
        uint16_t scales[256 / PKV_INT4_BLOCK];
        if (packed > 0) /* always (head_dim >= 1); GCC -O3 warns (-Wstringop-overflow) without it */
            memset(dst, 0, (size_t)packed);
        for (int64_t blk = 0; blk < num_blocks; blk++) {
            const int64_t b = blk * PKV_INT4_BLOCK;
            const int64_t n = head_dim - b < PKV_INT4_BLOCK ? head_dim - b : PKV_INT4_BLOCK;
            scales[blk] = pkv_quantize_q4(scratch + b, n, q + b);
            if (scales[blk] == 0x7fc0u)
                finite = 0;
        }
        for (int64_t blk = 0; blk < num_blocks; blk++) {
            const uint16_t d = finite ? scales[blk] : (uint16_t)0x7fc0u; /* one non-finite value: the whole row NaN */
            memcpy(dst + packed + 2 * blk, &d, 2);
        }
        for (i = 0; i < head_dim; i++)
            dst[i / 2] |= (uint8_t)((q[i] + 8) << (4 * (i & 1)));
        return;
    }
    }
}

/* Element access for readers that decode a row in place (the attention
 * kernels): value i of an int8 or int4 row before any inverse rotation is
 * pkv_int8_scale * pkv_int8_level or pkv_int4_scale * pkv_int4_level, the
 * same float32 product as pkv_decode_row. A change of the int4 layout changes
 * these three functions and the decoder below, nothing else in C. */
static inline float pkv_int8_scale(const uint8_t *row, int64_t head_dim)
{
    uint16_t bits;
    memcpy(&bits, row + head_dim, 2);
    return pkv_fmt_bf2f(bits);
}

static inline int32_t pkv_int8_level(const uint8_t *row, int64_t i)
{
    return (int32_t)(int8_t)row[i];
}

/* Byte offset of the int4 block scales in a row. */
static inline int64_t pkv_int4_scales_offset(int64_t head_dim)
{
    return (head_dim + 1) / 2;
}

/* Scale of the block holding value i. */
static inline float pkv_int4_scale(const uint8_t *row, int64_t head_dim, int64_t i)
{
    uint16_t bits;
    memcpy(&bits, row + pkv_int4_scales_offset(head_dim) + 2 * (i / PKV_INT4_BLOCK), 2);
    return pkv_fmt_bf2f(bits);
}

static inline int32_t pkv_int4_level(const uint8_t *row, int64_t i)
{
    return (int32_t)((row[i / 2] >> (4 * (i & 1))) & 0xfu) - 8;
}

/* Decode one head row into float32 (undoing the rotation of rotated formats). */
static inline void pkv_decode_row(pkv_format fmt, const uint8_t *src, int64_t head_dim, float *x)
{
    int64_t i;
    switch (fmt) {
    case PKV_FORMAT_F32:
        memcpy(x, src, (size_t)(4 * head_dim));
        return;
    case PKV_FORMAT_F16:
        for (i = 0; i < head_dim; i++) {
            uint16_t h;
            memcpy(&h, src + 2 * i, 2);
            x[i] = pkv_fmt_h2f(h);
        }
        return;
    case PKV_FORMAT_BF16:
        for (i = 0; i < head_dim; i++) {
            uint16_t b;
            memcpy(&b, src + 2 * i, 2);
            x[i] = pkv_fmt_bf2f(b);
        }
        return;
    case PKV_FORMAT_INT8: {
        uint16_t bits;
        memcpy(&bits, src + head_dim, 2);
        const float d = pkv_fmt_bf2f(bits);
        for (i = 0; i < head_dim; i++)
            x[i] = d * (float)(int8_t)src[i];
        pkv_rotate(x, head_dim);
        return;
    }
    case PKV_FORMAT_INT4: {
        const int64_t packed = (head_dim + 1) / 2;
        for (i = 0; i < head_dim; i++) {
            uint16_t bits;
            memcpy(&bits, src + packed + 2 * (i / PKV_INT4_BLOCK), 2);
            const int32_t q = (int32_t)((src[i / 2] >> (4 * (i & 1))) & 0xfu) - 8;
            x[i] = pkv_fmt_bf2f(bits) * (float)q;
        }
        pkv_rotate(x, head_dim);
        return;
    }
    }
}

#endif
