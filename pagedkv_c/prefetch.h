/* Software prefetch hint, a no-op where the compiler has no builtin. */
#ifndef PAGEDKV_PREFETCH_H
#define PAGEDKV_PREFETCH_H
#include <stddef.h>
/* Inline function of a header. always_inline matters for prefetch helpers:
 * GCC deems a function that only loads and prefetches pure and drops a call
 * whose result is unused before it would inline it. */
#if defined(__GNUC__) || defined(__clang__)
#define PKV_INLINE static inline __attribute__((always_inline))
#elif defined(_MSC_VER)
#define PKV_INLINE static __forceinline
#else
#define PKV_INLINE static inline
#endif
#if defined(__GNUC__) || defined(__clang__)
/* Prefetch [p, p + n) for writing, one hint per 64-byte line. */
PKV_INLINE void pkv_prefetch_write(const char *p, size_t n)
{
    for (size_t i = 0; i < n; i += 64)
        __builtin_prefetch(p + i, 1, 3);
}
/* Prefetch the line holding p for reading. */
PKV_INLINE void pkv_prefetch_read(const char *p) { __builtin_prefetch(p, 0, 3); }
#else
PKV_INLINE void pkv_prefetch_write(const char *p, size_t n) { (void)p; (void)n; }
PKV_INLINE void pkv_prefetch_read(const char *p) { (void)p; }
#endif
#endif
