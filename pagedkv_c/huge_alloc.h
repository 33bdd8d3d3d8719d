/* Large tables read at random (the prefix index): 2 MiB-aligned and, on
 * Linux, advised into transparent huge pages, so that a random probe costs
 * one cache miss instead of a cache miss plus a TLB miss. Elsewhere, or if
 * the aligned allocation fails, plain malloc. Free with pkv_huge_free. */
#ifndef PAGEDKV_HUGE_ALLOC_H
#define PAGEDKV_HUGE_ALLOC_H
#include <stdlib.h>
#if defined(__linux__)
#include <sys/mman.h>
#endif

#define PKV_HUGE_PAGE ((size_t)2 << 20)

static inline void *pkv_huge_alloc(size_t n)
{
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    if (n >= PKV_HUGE_PAGE) {
        void *p = NULL;
        size_t rounded = (n + PKV_HUGE_PAGE - 1) & ~(PKV_HUGE_PAGE - 1);
        if (posix_memalign(&p, PKV_HUGE_PAGE, rounded) == 0) {
            madvise(p, rounded, MADV_HUGEPAGE); /* a hint: failure is harmless */
            return p;
        }
    }
#endif
    return malloc(n);
}

static inline void pkv_huge_free(void *p) { free(p); }
#endif
