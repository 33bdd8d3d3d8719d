/* 128-bit page hashing backend for prefix caching.
 *
 * When the build found xxhash.h (the xxHash library, BSD-2-Clause), XXH3-128
 * is compiled in header-only (XXH_INLINE_ALL): no run-time dependency. Without
 * it pkv_xxh3_128 reports 0 and the caller falls back to the Python `xxhash`
 * package, which computes the same function.
 */
#ifndef PAGEDKV_HASH128_H
#define PAGEDKV_HASH128_H

#include <stddef.h>
#include <stdint.h>

#if defined(PAGEDKV_HAVE_XXHASH) && PAGEDKV_HAVE_XXHASH
#define XXH_INLINE_ALL
#include <xxhash.h>
#define PKV_XXH3_IN_C 1
static inline int pkv_xxh3_128(const void *data, size_t len, uint64_t *lo, uint64_t *hi)
{
    XXH128_hash_t h = XXH3_128bits(data, len);
    *lo = h.low64;
    *hi = h.high64;
    return 1;
}
#else
#define PKV_XXH3_IN_C 0
static inline int pkv_xxh3_128(const void *data, size_t len, uint64_t *lo, uint64_t *hi)
{
    (void)data; (void)len; (void)lo; (void)hi;
    return 0;
}
#endif

#endif
