/* Hash -> page index of the prefix cache, as static inline functions over a
 * plain struct, so that the allocator, the page tables and the cache inline
 * them into their per-page loops (calls across Cython modules cannot be
 * inlined). PrefixIndex in _prefix.pyx owns the memory and documents the
 * design: open addressing with linear probing over a power-of-two table at
 * most a quarter full, 8-byte slots, backward-shift deletion (no tombstones),
 * and the full hash in the page's record (page_record.h), which it shares
 * with the allocator.
 */
#ifndef PAGEDKV_PREFIX_INDEX_H
#define PAGEDKV_PREFIX_INDEX_H
#include <stdint.h>
#include "page_record.h"
#include "prefetch.h"
#include "kv_events.h"

/* A slot: 8 bytes, eight per cache line. The low 32 bits of the hash give
 * the home slot (the capacity is at most 2**31) and filter matches; the full
 * 128 bits are compared in the page's record. */
typedef struct {
    uint32_t lo32;    /* hash, low 32 bits */
    int32_t page;     /* page id, or -1 for an empty slot */
} pkv_index_slot;

typedef struct {
    pkv_index_slot *slots;  /* (mask + 1,) */
    int64_t mask;           /* capacity - 1 */
    pkv_page_record *pages; /* (num_pages,) the pool's records (hash, cached flag) */
    int64_t num_cached;     /* pages in the index */
    int64_t evictions;      /* cached pages dropped because the allocator reused them */
    pkv_kv_events *events;  /* KV event log of every removal, or NULL (kv_events.h) */
} pkv_index;

PKV_INLINE int pkv_index_is_cached(const pkv_index *ix, int32_t page)
{
    return ix->pages[page].cached;
}

/* Start loading the home slot of a hash (for a find or insert soon after). */
PKV_INLINE void pkv_index_prefetch(const pkv_index *ix, uint64_t lo)
{
    pkv_prefetch_read((const char *)&ix->slots[lo & (uint64_t)ix->mask]);
}

/* Start loading the home slot of a cached page and the next line (a
 * removal finds the entry from there and looks at the rest of its run). */
PKV_INLINE void pkv_index_prefetch_page(const pkv_index *ix, int32_t page)
{
    if (ix->pages[page].cached) {
        const int64_t home = (int64_t)(ix->pages[page].lo & (uint64_t)ix->mask);
        pkv_prefetch_write((const char *)&ix->slots[home], sizeof(pkv_index_slot));
        if ((home & 7) == 7) /* the last slot of its line (the table is line-aligned) */
            pkv_prefetch_write((const char *)&ix->slots[(home + 1) & ix->mask], sizeof(pkv_index_slot));
    }
}

/* The slot holding the hash (lo, hi), or the empty slot that ends its probe
 * run (where it would be inserted). */
PKV_INLINE int64_t pkv_index_probe(const pkv_index *ix, uint64_t lo, uint64_t hi)
{
    int64_t i = (int64_t)(lo & (uint64_t)ix->mask);
    for (;;) {
        const pkv_index_slot *s = &ix->slots[i];
        if (s->page == -1 || (s->lo32 == (uint32_t)lo && ix->pages[s->page].lo == lo &&
                              ix->pages[s->page].hi == hi))
            return i;
        i = (i + 1) & ix->mask;
    }
}

/* The page cached under the hash (lo, hi), or -1. */
PKV_INLINE int32_t pkv_index_find(const pkv_index *ix, uint64_t lo, uint64_t hi)
{
    return ix->slots[pkv_index_probe(ix, lo, hi)].page;
}

/* Make an uncached page findable by (lo, hi); 0 (nothing done) if the hash is taken. */
PKV_INLINE int pkv_index_insert(pkv_index *ix, uint64_t lo, uint64_t hi, int32_t page)
{
    const int64_t i = pkv_index_probe(ix, lo, hi);
    if (ix->slots[i].page != -1)
        return 0;
    ix->slots[i].lo32 = (uint32_t)lo;
    ix->slots[i].page = page;
    ix->pages[page].lo = lo;
    ix->pages[page].hi = hi;
    ix->pages[page].cached = 1;
    ix->num_cached++;
    return 1;
}

/* Make a cached page unfindable (its content is about to change or go). */
PKV_INLINE void pkv_index_remove(pkv_index *ix, int32_t page)
{
    const int64_t mask = ix->mask;
    int64_t i = (int64_t)(ix->pages[page].lo & (uint64_t)mask), j;
    /* The entry lies in the run that starts at its home slot. Pages do not
     * record their slot: deletion moves entries, and updating the records
     * of moved pages would cost a cache miss each. */
    while (ix->slots[i].page != page)
        i = (i + 1) & mask;
    if (ix->events != NULL)
        pkv_kv_events_removed(ix->events, ix->pages[page].lo, ix->pages[page].hi);
    /* Backward-shift deletion: pull later entries of the probe run into the
     * hole unless their home slot lies cyclically in (hole, entry]. */
    for (j = i;;) {
        j = (j + 1) & mask;
        if (ix->slots[j].page == -1)
            break;
        const int64_t home = (int64_t)(ix->slots[j].lo32 & (uint64_t)mask);
        if (i <= j ? (i < home && home <= j) : (home > i || home <= j))
            continue;
        ix->slots[i] = ix->slots[j];
        i = j;
    }
    ix->slots[i].page = -1;
    ix->pages[page].cached = 0;
    ix->pages[page].has_tokens = 0;
    ix->num_cached--;
}

/* Drop a cached page that the allocator is handing out again. */
PKV_INLINE void pkv_index_evict(pkv_index *ix, int32_t page)
{
    pkv_index_remove(ix, page);
    if (ix->evictions < INT64_MAX)  /* a counter holds at the top: a snapshot may start it there */
        ix->evictions++;
}

#endif
