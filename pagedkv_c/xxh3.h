/* XXH3-128 with seed 0 and the default secret: the page hash of prefix caching.
 *
 * Written from the xxHash specification (doc/xxhash_spec.md, version 0.2.0,
 * "XXH3 Algorithm Description", https://github.com/Cyan4973/xxHash): the same
 * function as XXH3_128bits() of xxHash 0.8.0 and later and as
 * xxh3_128_intdigest() of the Python xxhash package, whose digests
 * tests/test_xxh3.py compares against. Portable C11, scalar, no dependency.
 * Only seed 0 is implemented, so every "+ seed" of the specification is gone.
 *
 * The specification treats input and secret as little-endian 64- and 32-bit
 * words; the loads below are little-endian on every host. Inputs split into
 * 0, 1-3, 4-8, 9-16, 17-128, 129-240 and more than 240 bytes, each with its
 * own algorithm (section names of the specification in the comments).
 */
#ifndef PAGEDKV_XXH3_H
#define PAGEDKV_XXH3_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if defined(_MSC_VER) && (defined(_M_X64) || defined(_M_ARM64))
#include <intrin.h>
#endif

/* Hosts known to be little-endian load words with one memcpy; any other host
 * assembles them byte by byte (correct everywhere, slower). */
#if (defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__) || defined(_MSC_VER) || \
    defined(__x86_64__) || defined(__i386__) || defined(__aarch64__)
#define PKV_XXH3_LITTLE_ENDIAN 1
#else
#define PKV_XXH3_LITTLE_ENDIAN 0
#endif

#define PKV_PRIME32_1 0x9E3779B1U
#define PKV_PRIME32_2 0x85EBCA77U
#define PKV_PRIME32_3 0xC2B2AE3DU
#define PKV_PRIME64_1 0x9E3779B185EBCA87ULL
#define PKV_PRIME64_2 0xC2B2AE3D27D4EB4FULL
#define PKV_PRIME64_3 0x165667B19E3779F9ULL
#define PKV_PRIME64_4 0x85EBCA77C2B2AE63ULL
#define PKV_PRIME64_5 0x27D4EB2F165667C5ULL
#define PKV_PRIME_MX1 0x165667919E3779F9ULL
#define PKV_PRIME_MX2 0x9FB21C651E98DF25ULL

#define PKV_XXH3_SECRET_SIZE 192
/* Stripes of 64 bytes per 1024-byte block: (secret size - 64) / 8. */
#define PKV_XXH3_STRIPES_PER_BLOCK 16

/* The default secret, as published in the specification ("Seed and Secret";
 * specification text Copyright (c) Yann Collet). */
static const uint8_t pkv_xxh3_secret[PKV_XXH3_SECRET_SIZE] = {
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e,
    0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce,
    0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
};

/* ------------------------------------------------------------- primitives */

static inline uint32_t pkv_read32_le(const uint8_t *p)
{
#if PKV_XXH3_LITTLE_ENDIAN
    uint32_t v;
    memcpy(&v, p, sizeof v);
    return v;
#else
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
#endif
}

static inline uint64_t pkv_read64_le(const uint8_t *p)
{
#if PKV_XXH3_LITTLE_ENDIAN
    uint64_t v;
    memcpy(&v, p, sizeof v);
    return v;
#else
    return (uint64_t)pkv_read32_le(p) | ((uint64_t)pkv_read32_le(p + 4) << 32);
#endif
}

static inline uint32_t pkv_bswap32(uint32_t x)
{
#if defined(__GNUC__) || defined(__clang__)
    return __builtin_bswap32(x);
#else
    return ((x << 24) & 0xff000000U) | ((x << 8) & 0x00ff0000U) | ((x >> 8) & 0x0000ff00U) |
           ((x >> 24) & 0x000000ffU);
#endif
}

static inline uint64_t pkv_bswap64(uint64_t x)
{
#if defined(__GNUC__) || defined(__clang__)
    return __builtin_bswap64(x);
#else
    return ((uint64_t)pkv_bswap32((uint32_t)x) << 32) | pkv_bswap32((uint32_t)(x >> 32));
#endif
}

static inline uint32_t pkv_rotl32(uint32_t x, int r) { return (x << r) | (x >> (32 - r)); }

/* Full 64 x 64 -> 128-bit product. PKV_XXH3_PORTABLE_MUL forces the plain C
 * version (what compilers without a 128-bit type get) so that it can be tested. */
static inline void pkv_mul128(uint64_t a, uint64_t b, uint64_t *lo, uint64_t *hi)
{
#if defined(__SIZEOF_INT128__) && !defined(PKV_XXH3_PORTABLE_MUL)
    const unsigned __int128 product = (unsigned __int128)a * b;
    *lo = (uint64_t)product;
    *hi = (uint64_t)(product >> 64);
#elif defined(_MSC_VER) && defined(_M_X64) && !defined(PKV_XXH3_PORTABLE_MUL)
    *lo = _umul128(a, b, hi);
#elif defined(_MSC_VER) && defined(_M_ARM64) && !defined(PKV_XXH3_PORTABLE_MUL)
    *lo = a * b;
    *hi = __umulh(a, b);
#else
    /* Schoolbook multiplication on 32-bit halves; no partial sum overflows. */
    const uint64_t lo_lo = (a & 0xFFFFFFFFULL) * (b & 0xFFFFFFFFULL);
    const uint64_t hi_lo = (a >> 32) * (b & 0xFFFFFFFFULL);
    const uint64_t lo_hi = (a & 0xFFFFFFFFULL) * (b >> 32);
    const uint64_t hi_hi = (a >> 32) * (b >> 32);
    const uint64_t cross = (lo_lo >> 32) + (hi_lo & 0xFFFFFFFFULL) + lo_hi;
    *hi = (hi_lo >> 32) + (cross >> 32) + hi_hi;
    *lo = (cross << 32) | (lo_lo & 0xFFFFFFFFULL);
#endif
}

/* lowerHalf(p) xor higherHalf(p) of the 128-bit product p = a * b. */
static inline uint64_t pkv_mul128_fold64(uint64_t a, uint64_t b)
{
    uint64_t lo, hi;
    pkv_mul128(a, b, &lo, &hi);
    return lo ^ hi;
}

/* avalanche() of the specification ("Final Mixing Step"). */
static inline uint64_t pkv_xxh3_avalanche(uint64_t x)
{
    x ^= x >> 37;
    x *= PKV_PRIME_MX1;
    return x ^ (x >> 32);
}

/* avalanche_XXH64() of the specification. */
static inline uint64_t pkv_xxh64_avalanche(uint64_t x)
{
    x ^= x >> 33;
    x *= PKV_PRIME64_2;
    x ^= x >> 29;
    x *= PKV_PRIME64_3;
    return x ^ (x >> 32);
}

/* ------------------------------------------------------ 0 to 16 bytes */

/* "Empty input". */
static inline void pkv_xxh3_128_empty(uint64_t *lo, uint64_t *hi)
{
    const uint8_t *s = pkv_xxh3_secret;
    *lo = pkv_xxh64_avalanche(pkv_read64_le(s + 64) ^ pkv_read64_le(s + 72));
    *hi = pkv_xxh64_avalanche(pkv_read64_le(s + 80) ^ pkv_read64_le(s + 88));
}

/* "1-3 bytes of input". */
static inline void pkv_xxh3_128_1to3(const uint8_t *in, size_t len, uint64_t *lo, uint64_t *hi)
{
    const uint8_t *s = pkv_xxh3_secret;
    const uint32_t combined = (uint32_t)in[len - 1] | ((uint32_t)len << 8) | ((uint32_t)in[0] << 16) |
                              ((uint32_t)in[len >> 1] << 24);
    const uint64_t low = (uint64_t)(pkv_read32_le(s) ^ pkv_read32_le(s + 4)) ^ combined;
    const uint64_t high = (uint64_t)(pkv_read32_le(s + 8) ^ pkv_read32_le(s + 12)) ^
                          (uint64_t)pkv_rotl32(pkv_bswap32(combined), 13);
    *lo = pkv_xxh64_avalanche(low);
    *hi = pkv_xxh64_avalanche(high);
}

/* "4-8 bytes of input". */
static inline void pkv_xxh3_128_4to8(const uint8_t *in, size_t len, uint64_t *lo, uint64_t *hi)
{
    const uint8_t *s = pkv_xxh3_secret;
    const uint64_t first = pkv_read32_le(in);
    const uint64_t last = pkv_read32_le(in + len - 4);
    const uint64_t value = (pkv_read64_le(s + 16) ^ pkv_read64_le(s + 24)) ^ (first | (last << 32));
    uint64_t low, high;
    pkv_mul128(value, PKV_PRIME64_1 + ((uint64_t)len << 2), &low, &high);
    high += low << 1;
    low ^= high >> 3;
    low ^= low >> 35;
    low *= PKV_PRIME_MX2;
    low ^= low >> 28;
    *lo = low;
    *hi = pkv_xxh3_avalanche(high);
}

/* "9-16 bytes of input". */
static inline void pkv_xxh3_128_9to16(const uint8_t *in, size_t len, uint64_t *lo, uint64_t *hi)
{
    const uint8_t *s = pkv_xxh3_secret;
    const uint64_t first = pkv_read64_le(in);
    const uint64_t last = pkv_read64_le(in + len - 8);
    const uint64_t val1 = (pkv_read64_le(s + 32) ^ pkv_read64_le(s + 40)) ^ first ^ last;
    const uint64_t val2 = (pkv_read64_le(s + 48) ^ pkv_read64_le(s + 56)) ^ last;
    uint64_t low, high, low2, high2;
    pkv_mul128(val1, PKV_PRIME64_1, &low, &high);
    low += (uint64_t)(len - 1) << 54;
    high += (val2 & 0xFFFFFFFF00000000ULL) + (uint64_t)(uint32_t)val2 * PKV_PRIME32_2;
    low ^= pkv_bswap64(high);
    pkv_mul128(low, PKV_PRIME64_2, &low2, &high2);
    high2 += high * PKV_PRIME64_2;
    *lo = pkv_xxh3_avalanche(low2);
    *hi = pkv_xxh3_avalanche(high2);
}

/* ---------------------------------------------------- 17 to 240 bytes */

/* mixStep() with seed 0: 16 bytes of input against 16 bytes of secret. */
static inline uint64_t pkv_xxh3_mix16(const uint8_t *in, const uint8_t *secret)
{
    return pkv_mul128_fold64(pkv_read64_le(in) ^ pkv_read64_le(secret),
                             pkv_read64_le(in + 8) ^ pkv_read64_le(secret + 8));
}

/* mixTwoChunks() with seed 0, on the two accumulators acc[0], acc[1]. */
static inline void pkv_xxh3_mix32(uint64_t acc[2], const uint8_t *in1, const uint8_t *in2, const uint8_t *secret)
{
    acc[0] += pkv_xxh3_mix16(in1, secret);
    acc[1] += pkv_xxh3_mix16(in2, secret + 16);
    acc[0] ^= pkv_read64_le(in2) + pkv_read64_le(in2 + 8);
    acc[1] ^= pkv_read64_le(in1) + pkv_read64_le(in1 + 8);
}

/* "Step 3. Finalization" of medium inputs. */
static inline void pkv_xxh3_128_medium_final(const uint64_t acc[2], size_t len, uint64_t *lo, uint64_t *hi)
{
    const uint64_t high = acc[0] * PKV_PRIME64_1 + acc[1] * PKV_PRIME64_4 + (uint64_t)len * PKV_PRIME64_2;
    *lo = pkv_xxh3_avalanche(acc[0] + acc[1]);
    *hi = (uint64_t)0 - pkv_xxh3_avalanche(high);
}

/* "17-128 bytes of input": pairs of 16-byte chunks from both ends, innermost
 * pair first. */
static inline void pkv_xxh3_128_17to128(const uint8_t *in, size_t len, uint64_t *lo, uint64_t *hi)
{
    uint64_t acc[2] = {(uint64_t)len * PKV_PRIME64_1, 0};
    ptrdiff_t i = (ptrdiff_t)((len - 1) >> 5);
    for (; i >= 0; i--) {
        pkv_xxh3_mix32(acc, in + 16 * i, in + len - 16 * i - 16, pkv_xxh3_secret + 32 * i);
    }
    pkv_xxh3_128_medium_final(acc, len, lo, hi);
}

/* "129-240 bytes of input". */
static inline void pkv_xxh3_128_129to240(const uint8_t *in, size_t len, uint64_t *lo, uint64_t *hi)
{
    uint64_t acc[2] = {(uint64_t)len * PKV_PRIME64_1, 0};
    const size_t num_chunks = len >> 5;
    size_t i;
    for (i = 0; i < 4; i++) {
        pkv_xxh3_mix32(acc, in + 32 * i, in + 32 * i + 16, pkv_xxh3_secret + 32 * i);
    }
    acc[0] = pkv_xxh3_avalanche(acc[0]);
    acc[1] = pkv_xxh3_avalanche(acc[1]);
    for (i = 4; i < num_chunks; i++) {
        pkv_xxh3_mix32(acc, in + 32 * i, in + 32 * i + 16, pkv_xxh3_secret + 32 * (i - 4) + 3);
    }
    /* The last 32 bytes, halves swapped, against secret bytes 103..135. */
    pkv_xxh3_mix32(acc, in + len - 16, in + len - 32, pkv_xxh3_secret + 103);
    pkv_xxh3_128_medium_final(acc, len, lo, hi);
}

/* ------------------------------------------------ more than 240 bytes */

/* accumulate(): one 64-byte stripe into the eight accumulators. */
static inline void pkv_xxh3_accumulate(uint64_t acc[8], const uint8_t *stripe, const uint8_t *secret)
{
    int i;
    for (i = 0; i < 8; i++) {
        const uint64_t data = pkv_read64_le(stripe + 8 * i);
        const uint64_t keyed = data ^ pkv_read64_le(secret + 8 * i);
        acc[i ^ 1] += data;
        acc[i] += (keyed & 0xFFFFFFFFULL) * (keyed >> 32);
    }
}

/* round_scramble(), with the last 64 bytes of the secret. */
static inline void pkv_xxh3_scramble(uint64_t acc[8])
{
    const uint8_t *s = pkv_xxh3_secret + PKV_XXH3_SECRET_SIZE - 64;
    int i;
    for (i = 0; i < 8; i++) {
        uint64_t a = acc[i];
        a ^= a >> 47;
        a ^= pkv_read64_le(s + 8 * i);
        acc[i] = a * PKV_PRIME32_1;
    }
}

/* finalMerge(). */
static inline uint64_t pkv_xxh3_merge(const uint64_t acc[8], uint64_t init, const uint8_t *secret)
{
    uint64_t result = init;
    int i;
    for (i = 0; i < 4; i++) {
        result += pkv_mul128_fold64(acc[2 * i] ^ pkv_read64_le(secret + 16 * i),
                                    acc[2 * i + 1] ^ pkv_read64_le(secret + 16 * i + 8));
    }
    return pkv_xxh3_avalanche(result);
}

/* SSE2 (part of every x86-64 CPU, so no run-time dispatch): the same
 * accumulate and scramble on two 64-bit lanes at a time, the
 * specification's "vectorized" form (xxHash's own SSE2 path does the same).
 * Large inputs (page checksums of whole K/V pages) run at memory speed
 * instead of about half of it. PKV_XXH3_SCALAR forces the scalar code. */
#if (defined(__SSE2__) || defined(_M_X64)) && !defined(PKV_XXH3_SCALAR)
#include <emmintrin.h>
#define PKV_XXH3_SSE2 1

static inline void pkv_xxh3_accumulate_sse2(__m128i acc[4], const uint8_t *stripe, const uint8_t *secret)
{
    int i;
    for (i = 0; i < 4; i++) {
        const __m128i data = _mm_loadu_si128((const __m128i *)(stripe + 16 * i));
        const __m128i keyed = _mm_xor_si128(data, _mm_loadu_si128((const __m128i *)(secret + 16 * i)));
        /* low 32 bits times high 32 bits of each 64-bit lane */
        const __m128i product = _mm_mul_epu32(keyed, _mm_shuffle_epi32(keyed, _MM_SHUFFLE(0, 3, 0, 1)));
        /* acc[i ^ 1] += data[i]: swap the two 64-bit lanes */
        const __m128i swapped = _mm_shuffle_epi32(data, _MM_SHUFFLE(1, 0, 3, 2));
        acc[i] = _mm_add_epi64(acc[i], _mm_add_epi64(product, swapped));
    }
}

static inline void pkv_xxh3_scramble_sse2(__m128i acc[4])
{
    const uint8_t *s = pkv_xxh3_secret + PKV_XXH3_SECRET_SIZE - 64;
    const __m128i prime = _mm_set1_epi32((int)PKV_PRIME32_1);
    int i;
    for (i = 0; i < 4; i++) {
        __m128i a = acc[i];
        a = _mm_xor_si128(a, _mm_srli_epi64(a, 47));
        a = _mm_xor_si128(a, _mm_loadu_si128((const __m128i *)(s + 16 * i)));
        /* 64 x 32-bit product: low half times prime, plus high half times prime shifted */
        {
            const __m128i low = _mm_mul_epu32(a, prime);
            const __m128i high = _mm_mul_epu32(_mm_shuffle_epi32(a, _MM_SHUFFLE(0, 3, 0, 1)), prime);
            acc[i] = _mm_add_epi64(low, _mm_slli_epi64(high, 32));
        }
    }
}
#endif

/* AVX2 (most x86-64 CPUs since 2013; chosen at run time with GCC and Clang):
 * four 64-bit lanes at a time, about twice the SSE2 rate on K/V pages.
 * PKV_XXH3_NO_AVX2 leaves it out. */
#if defined(PKV_XXH3_SSE2) && defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__)) && \
    !defined(PKV_XXH3_NO_AVX2)
#include <immintrin.h>
#define PKV_XXH3_AVX2 1
#define PKV_XXH3_AVX2_FN __attribute__((target("avx2")))

static inline PKV_XXH3_AVX2_FN void pkv_xxh3_accumulate_avx2(__m256i acc[2], const uint8_t *stripe,
                                                              const uint8_t *secret)
{
    int i;
    for (i = 0; i < 2; i++) {
        const __m256i data = _mm256_loadu_si256((const __m256i *)(stripe + 32 * i));
        const __m256i keyed = _mm256_xor_si256(data, _mm256_loadu_si256((const __m256i *)(secret + 32 * i)));
        const __m256i product = _mm256_mul_epu32(keyed, _mm256_shuffle_epi32(keyed, _MM_SHUFFLE(0, 3, 0, 1)));
        const __m256i swapped = _mm256_shuffle_epi32(data, _MM_SHUFFLE(1, 0, 3, 2));
        acc[i] = _mm256_add_epi64(acc[i], _mm256_add_epi64(product, swapped));
    }
}

static inline PKV_XXH3_AVX2_FN void pkv_xxh3_scramble_avx2(__m256i acc[2])
{
    const uint8_t *s = pkv_xxh3_secret + PKV_XXH3_SECRET_SIZE - 64;
    const __m256i prime = _mm256_set1_epi32((int)PKV_PRIME32_1);
    int i;
    for (i = 0; i < 2; i++) {
        __m256i a = acc[i];
        a = _mm256_xor_si256(a, _mm256_srli_epi64(a, 47));
        a = _mm256_xor_si256(a, _mm256_loadu_si256((const __m256i *)(s + 32 * i)));
        {
            const __m256i low = _mm256_mul_epu32(a, prime);
            const __m256i high = _mm256_mul_epu32(_mm256_shuffle_epi32(a, _MM_SHUFFLE(0, 3, 0, 1)), prime);
            acc[i] = _mm256_add_epi64(low, _mm256_slli_epi64(high, 32));
        }
    }
}

/* The stripe loop of pkv_xxh3_128_large with AVX2 (same order of operations). */
static PKV_XXH3_AVX2_FN void pkv_xxh3_large_avx2(uint64_t acc[8], const uint8_t *in, size_t len)
{
    const size_t block_bytes = 64 * PKV_XXH3_STRIPES_PER_BLOCK;
    const size_t num_blocks = (len - 1) / block_bytes;
    const uint8_t *s = pkv_xxh3_secret;
    __m256i vacc[2];
    size_t block, n;
    vacc[0] = _mm256_loadu_si256((const __m256i *)acc);
    vacc[1] = _mm256_loadu_si256((const __m256i *)(acc + 4));
    for (block = 0; block < num_blocks; block++) {
        const uint8_t *b = in + block * block_bytes;
        for (n = 0; n < PKV_XXH3_STRIPES_PER_BLOCK; n++) {
            pkv_xxh3_accumulate_avx2(vacc, b + 64 * n, s + 8 * n);
        }
        pkv_xxh3_scramble_avx2(vacc);
    }
    {
        const uint8_t *b = in + num_blocks * block_bytes;
        const size_t num_stripes = (len - num_blocks * block_bytes - 1) / 64;
        for (n = 0; n < num_stripes; n++) {
            pkv_xxh3_accumulate_avx2(vacc, b + 64 * n, s + 8 * n);
        }
        pkv_xxh3_accumulate_avx2(vacc, in + len - 64, s + PKV_XXH3_SECRET_SIZE - 71);
    }
    _mm256_storeu_si256((__m256i *)acc, vacc[0]);
    _mm256_storeu_si256((__m256i *)(acc + 4), vacc[1]);
}
#endif

/* Large inputs: full 1024-byte blocks (each 16 stripes, then a scramble) while
 * more than a block remains; then the last block's stripes but its last, and
 * the input's last 64 bytes as a final stripe. */
static inline void pkv_xxh3_128_large(const uint8_t *in, size_t len, uint64_t *lo, uint64_t *hi)
{
    const size_t block_bytes = 64 * PKV_XXH3_STRIPES_PER_BLOCK;
    const size_t num_blocks = (len - 1) / block_bytes;
    const uint8_t *s = pkv_xxh3_secret;
    uint64_t acc[8] = {PKV_PRIME32_3, PKV_PRIME64_1, PKV_PRIME64_2, PKV_PRIME64_3,
                       PKV_PRIME64_4, PKV_PRIME32_2, PKV_PRIME64_5, PKV_PRIME32_1};
    size_t block, n;
#ifdef PKV_XXH3_AVX2
    if (__builtin_cpu_supports("avx2")) {
        pkv_xxh3_large_avx2(acc, in, len);
        *lo = pkv_xxh3_merge(acc, (uint64_t)len * PKV_PRIME64_1, s + 11);
        *hi = pkv_xxh3_merge(acc, ~((uint64_t)len * PKV_PRIME64_2), s + PKV_XXH3_SECRET_SIZE - 75);
        return;
    }
#endif
#ifdef PKV_XXH3_SSE2
    __m128i vacc[4];
    for (n = 0; n < 4; n++)
        vacc[n] = _mm_loadu_si128((const __m128i *)(acc + 2 * n));
    for (block = 0; block < num_blocks; block++) {
        const uint8_t *b = in + block * block_bytes;
        for (n = 0; n < PKV_XXH3_STRIPES_PER_BLOCK; n++) {
            pkv_xxh3_accumulate_sse2(vacc, b + 64 * n, s + 8 * n);
        }
        pkv_xxh3_scramble_sse2(vacc);
    }
    {
        const uint8_t *b = in + num_blocks * block_bytes;
        const size_t num_stripes = (len - num_blocks * block_bytes - 1) / 64;
        for (n = 0; n < num_stripes; n++) {
            pkv_xxh3_accumulate_sse2(vacc, b + 64 * n, s + 8 * n);
        }
        pkv_xxh3_accumulate_sse2(vacc, in + len - 64, s + PKV_XXH3_SECRET_SIZE - 71);
    }
    for (n = 0; n < 4; n++)
        _mm_storeu_si128((__m128i *)(acc + 2 * n), vacc[n]);
#else
    for (block = 0; block < num_blocks; block++) {
        const uint8_t *b = in + block * block_bytes;
        for (n = 0; n < PKV_XXH3_STRIPES_PER_BLOCK; n++) {
            pkv_xxh3_accumulate(acc, b + 64 * n, s + 8 * n);
        }
        pkv_xxh3_scramble(acc);
    }
    {
        const uint8_t *b = in + num_blocks * block_bytes;
        const size_t num_stripes = (len - num_blocks * block_bytes - 1) / 64;
        for (n = 0; n < num_stripes; n++) {
            pkv_xxh3_accumulate(acc, b + 64 * n, s + 8 * n);
        }
        pkv_xxh3_accumulate(acc, in + len - 64, s + PKV_XXH3_SECRET_SIZE - 71);
    }
#endif
    *lo = pkv_xxh3_merge(acc, (uint64_t)len * PKV_PRIME64_1, s + 11);
    *hi = pkv_xxh3_merge(acc, ~((uint64_t)len * PKV_PRIME64_2), s + PKV_XXH3_SECRET_SIZE - 75);
}

/* ----------------------------------------------------------------- entry */

/* XXH3-128 of ``len`` bytes at ``data`` (seed 0): the low and high 64-bit
 * halves (XXH128_hash_t's low64 / high64; the Python package's integer digest
 * is hi * 2**64 + lo). */
static inline void pkv_xxh3_128(const void *data, size_t len, uint64_t *lo, uint64_t *hi)
{
    const uint8_t *in = (const uint8_t *)data;
    if (len <= 16) {
        if (len > 8) {
            pkv_xxh3_128_9to16(in, len, lo, hi);
        } else if (len >= 4) {
            pkv_xxh3_128_4to8(in, len, lo, hi);
        } else if (len > 0) {
            pkv_xxh3_128_1to3(in, len, lo, hi);
        } else {
            pkv_xxh3_128_empty(lo, hi);
        }
    } else if (len <= 128) {
        pkv_xxh3_128_17to128(in, len, lo, hi);
    } else if (len <= 240) {
        pkv_xxh3_128_129to240(in, len, lo, hi);
    } else {
        pkv_xxh3_128_large(in, len, lo, hi);
    }
}

#endif
