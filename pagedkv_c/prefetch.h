/* Software prefetch hint, a no-op where the compiler has no builtin. */
#ifndef PAGEDKV_PREFETCH_H
#define PAGEDKV_PREFETCH_H
#include <stddef.h>
#if defined(__GNUC__) || defined(__clang__)
/* Prefetch [p, p + n) for writing, one hint per 64-byte line. */
static inline void pkv_prefetch_write(const char *p, size_t n)
{
    for (size_t i = 0; i < n; i += 64)
        __builtin_prefetch(p + i, 1, 3);
}
/* Prefetch the line holding p for reading. */
static inline void pkv_prefetch_read(const char *p) { __builtin_prefetch(p, 0, 3); }
#else
static inline void pkv_prefetch_write(const char *p, size_t n) { (void)p; (void)n; }
static inline void pkv_prefetch_read(const char *p) { (void)p; }
#endif
#endif
