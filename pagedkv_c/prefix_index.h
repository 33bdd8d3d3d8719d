/* Hash -> page index of the prefix cache, as static inline functions over a
 * plain struct, so that the allocator, the page tables and the cache inline
 * them into their per-page loops (calls across Cython modules cannot be
 * inlined). PrefixIndex in _prefix.pyx owns the memory and documents the
 * design: open addressing with linear probing over a power-of-two table at
 * most a quarter full, 16-byte slots, backward-shift deletion (no tombstones),
 * and a per-page record of the slot so that removal needs no search.
 */
#ifndef PAGEDKV_PREFIX_INDEX_H
#define PAGEDKV_PREFIX_INDEX_H
#include <stdint.h>
#include "prefetch.h"

typedef struct {
    uint64_t lo;      /* hash, low 64 bits (also picks the home slot) */
    uint32_t hi32;    /* hash, bits 64..95: filters before the full check */
    int32_t page;     /* page id, or -1 for an empty slot */
} pkv_index_slot;

/* Per-page record, 16 bytes (a row of two uint64 in the owning NumPy
 * array): what a page operation needs shares one cache line. */
typedef struct {
    uint64_t hi;            /* high 64 bits of the page's hash while cached */
    int32_t slot;           /* the page's slot, -1 if not cached */
    uint8_t has_tokens;     /* 1: the page's token ids are kept for hit checks */
    uint8_t unused[3];
} pkv_index_page;
typedef char pkv_index_page_is_16_bytes[sizeof(pkv_index_page) == 16 ? 1 : -1];

typedef struct {
    pkv_index_slot *slots;  /* (mask + 1,) */
    int64_t mask;           /* capacity - 1 */
    pkv_index_page *pages;  /* (num_pages,) */
    int64_t num_cached;     /* pages in the index */
    int64_t evictions;      /* cached pages dropped because the allocator reused them */
} pkv_index;

PKV_INLINE int pkv_index_is_cached(const pkv_index *ix, int32_t page)
{
    return ix->pages[page].slot >= 0;
}

/* Start loading the home slot of a hash (for a find or insert soon after). */
PKV_INLINE void pkv_index_prefetch(const pkv_index *ix, uint64_t lo)
{
    pkv_prefetch_read((const char *)&ix->slots[lo & (uint64_t)ix->mask]);
}

/* Start loading the slot of a cached page and its successor (a removal
 * looks at the next entry of the run). */
PKV_INLINE void pkv_index_prefetch_page(const pkv_index *ix, int32_t page)
{
    const int32_t slot = ix->pages[page].slot;
    if (slot >= 0) {
        pkv_prefetch_write((const char *)&ix->slots[slot], sizeof(pkv_index_slot));
        pkv_prefetch_write((const char *)&ix->slots[(slot + 1) & ix->mask], sizeof(pkv_index_slot));
    }
}

/* The page cached under the hash (lo, hi), or -1. */
PKV_INLINE int32_t pkv_index_find(const pkv_index *ix, uint64_t lo, uint64_t hi)
{
    const uint32_t hi32 = (uint32_t)hi;
    int64_t i = (int64_t)(lo & (uint64_t)ix->mask);
    while (ix->slots[i].page != -1) {
        const pkv_index_slot *s = &ix->slots[i];
        if (s->lo == lo && s->hi32 == hi32 && ix->pages[s->page].hi == hi)
            return s->page;
        i = (i + 1) & ix->mask;
    }
    return -1;
}

/* Make an uncached page findable by (lo, hi); 0 (nothing done) if the hash is taken. */
PKV_INLINE int pkv_index_insert(pkv_index *ix, uint64_t lo, uint64_t hi, int32_t page)
{
    const uint32_t hi32 = (uint32_t)hi;
    int64_t i = (int64_t)(lo & (uint64_t)ix->mask);
    while (ix->slots[i].page != -1) {
        const pkv_index_slot *s = &ix->slots[i];
        if (s->lo == lo && s->hi32 == hi32 && ix->pages[s->page].hi == hi)
            return 0;
        i = (i + 1) & ix->mask;
    }
    ix->slots[i].lo = lo;
    ix->slots[i].hi32 = hi32;
    ix->slots[i].page = page;
    ix->pages[page].slot = (int32_t)i;
    ix->pages[page].hi = hi;
    ix->num_cached++;
    return 1;
}

/* Make a cached page unfindable (its content is about to change or go). */
PKV_INLINE void pkv_index_remove(pkv_index *ix, int32_t page)
{
    const int64_t mask = ix->mask;
    int64_t i = ix->pages[page].slot, j = i;
    /* Backward-shift deletion: pull later entries of the probe run into the
     * hole unless their home slot lies cyclically in (hole, entry]. */
    for (;;) {
        j = (j + 1) & mask;
        const int32_t moved = ix->slots[j].page;
        if (moved == -1)
            break;
        const int64_t home = (int64_t)(ix->slots[j].lo & (uint64_t)mask);
        if (i <= j ? (i < home && home <= j) : (home > i || home <= j))
            continue;
        ix->slots[i] = ix->slots[j];
        ix->pages[moved].slot = (int32_t)i;
        i = j;
    }
    ix->slots[i].page = -1;
    ix->pages[page].slot = -1;
    ix->pages[page].has_tokens = 0;
    ix->num_cached--;
}

/* Drop a cached page that the allocator is handing out again. */
PKV_INLINE void pkv_index_evict(pkv_index *ix, int32_t page)
{
    pkv_index_remove(ix, page);
    ix->evictions++;
}

#endif
