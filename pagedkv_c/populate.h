/* Page-aligned memory, faulted in ahead of its first write by a thread that
 * has time: the writer then takes no page fault. */
#ifndef PAGEDKV_POPULATE_H
#define PAGEDKV_POPULATE_H
#include <stddef.h>
#include <stdlib.h>
#if defined(__linux__)
#include <sys/mman.h>
#endif
#if defined(_WIN32)
#include <malloc.h>
#endif

#define PKV_OS_PAGE ((size_t)4096)

/* `n` bytes aligned to PKV_OS_PAGE, or NULL; free with pkv_page_free. */
static inline void *pkv_page_alloc(size_t n)
{
#if defined(_WIN32)
    return _aligned_malloc(n, PKV_OS_PAGE);
#else
    void *p = NULL;
    return posix_memalign(&p, PKV_OS_PAGE, n) == 0 ? p : NULL;
#endif
}

static inline void pkv_page_free(void *p)
{
#if defined(_WIN32)
    _aligned_free(p);
#else
    free(p);
#endif
}

/* Fault in [p, p + n) for writing without changing its bytes (Linux >= 5.14,
 * MADV_POPULATE_WRITE), so that later writes take no page fault; `p` is page
 * aligned. Returns 0 on success, -1 where the kernel cannot (nothing done). */
static inline int pkv_populate_write(void *p, size_t n)
{
#if defined(__linux__) && defined(MADV_POPULATE_WRITE)
    return n == 0 || madvise(p, n, MADV_POPULATE_WRITE) == 0 ? 0 : -1;
#else
    (void)p;
    (void)n;
    return -1;
#endif
}
#endif
