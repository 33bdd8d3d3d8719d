/* Row copy for scatters into the K/V pool.
 *
 * Rows written by a store are not read again soon by the writing core (the
 * pool is far larger than the caches), so on x86-64 they are written with
 * SSE2 non-temporal stores: no read-for-ownership of the destination lines
 * and no eviction of useful cache contents. SSE2 is part of x86-64, so no
 * run-time dispatch is needed. Elsewhere, or for unaligned rows, memcpy.
 * Call pkv_stream_fence() once after a batch of pkv_stream_copy calls.
 */
#ifndef PAGEDKV_STREAM_COPY_H
#define PAGEDKV_STREAM_COPY_H
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
static inline void pkv_stream_copy(char *dst, const char *src, size_t n)
{
    if ((((uintptr_t)dst) & 15) != 0 || (n & 15) != 0) {
        memcpy(dst, src, n);
        return;
    }
    for (size_t i = 0; i < n; i += 16) {
        __m128i v = _mm_loadu_si128((const __m128i *)(src + i));
        _mm_stream_si128((__m128i *)(dst + i), v);
    }
}
static inline void pkv_stream_fence(void) { _mm_sfence(); }
#else
static inline void pkv_stream_copy(char *dst, const char *src, size_t n) { memcpy(dst, src, n); }
static inline void pkv_stream_fence(void) {}
#endif
#endif
