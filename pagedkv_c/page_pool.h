/* Free queue and ref counts of the page allocator, as static inline
 * functions over a plain struct, so that the page tables and the cache
 * inline them into their per-page loops (calls across Cython modules cannot
 * be inlined). PagePool in _pool.pyx owns the memory.
 *
 * The free queue hands out the least recently freed page first. It is a
 * FIFO ring of page ids with lazy deletion: each page's record (page_record.h)
 * holds the absolute queue position of its live entry (-1 when the page is
 * not queued) next to its ref count. Taking a page out of the middle (a prefix
 * cache hit on a free page) only clears that position, which leaves a stale
 * entry that popping skips; a linked list would instead write both
 * neighbours. Popping reads the ring in order, so the records of the next
 * pages can be prefetched (a linked list must chase one pointer per pop).
 * When the ring fills up, its live entries are compacted in order: the ring
 * holds at least twice as many entries as there are pages, so compaction
 * runs at most once per num_pages pushes.
 */
#ifndef PAGEDKV_PAGE_POOL_H
#define PAGEDKV_PAGE_POOL_H
#include <stdint.h>
#include "page_record.h"
#include "prefetch.h"

typedef struct {
    char *rec;              /* (num_pages,) records, 1 << rec_shift bytes apart (see page_record.h) */
    int64_t rec_shift;
    int32_t *ring;          /* (mask + 1,) page ids at ring[position & mask] */
    int64_t mask;           /* ring capacity - 1, capacity a power of two >= 2 * num_pages */
    int64_t head, tail;     /* absolute positions: entries live in [head, tail) */
    int32_t num_free;       /* pages in the queue (live entries) */
    /* Metrics: queued pages whose record says cached (free pages still findable
     * by prefix hash). Kept by push, pop and remove from the record they touch
     * anyway; the cached byte is always 0 in a pool without a prefix index. A
     * change to the cached flag of a queued page must adjust it. */
    int64_t num_cached_free;
} pkv_free_queue;

/* The record of a page (only the allocator's fields are valid without a prefix index). */
PKV_INLINE pkv_page_record *pkv_rec(const pkv_free_queue *q, int32_t page)
{
    return (pkv_page_record *)(q->rec + ((int64_t)page << q->rec_shift));
}

/* Keep the live entries of [head, tail) in order, dropping stale ones. */
static inline void pkv_queue_compact(pkv_free_queue *q)
{
    int64_t a, k = q->head;
    for (a = q->head; a < q->tail; a++) {
        const int32_t page = q->ring[a & q->mask];
        if (pkv_rec(q, page)->qpos == a) {
            q->ring[k & q->mask] = page; /* k <= a: never overwrites an unread entry */
            pkv_rec(q, page)->qpos = k;
            k++;
        }
    }
    q->tail = k;
}

/* Take a queued page out of the queue in O(1) (its entry becomes stale). */
PKV_INLINE void pkv_queue_remove(pkv_free_queue *q, int32_t page)
{
    pkv_rec(q, page)->qpos = -1;
    q->num_free--;
    q->num_cached_free -= pkv_rec(q, page)->cached;
}

/* Append a page at the tail (most recently freed). */
PKV_INLINE void pkv_queue_push(pkv_free_queue *q, int32_t page)
{
    if (q->tail - q->head > q->mask)
        pkv_queue_compact(q);
    q->ring[q->tail & q->mask] = page;
    pkv_rec(q, page)->qpos = q->tail;
    q->tail++;
    q->num_free++;
    q->num_cached_free += pkv_rec(q, page)->cached;
}

/* Pop the least recently freed page; the queue must not be empty. */
PKV_INLINE int32_t pkv_queue_pop(pkv_free_queue *q)
{
    for (;;) {
        const int64_t a = q->head++;
        const int32_t page = q->ring[a & q->mask];
        if (pkv_rec(q, page)->qpos == a) {
            pkv_rec(q, page)->qpos = -1;
            q->num_free--;
            q->num_cached_free -= pkv_rec(q, page)->cached;
            return page;
        }
    }
}

/* Start loading a page's record (for a ref count change soon after). */
PKV_INLINE void pkv_prefetch_record(const pkv_free_queue *q, int32_t page)
{
    pkv_prefetch_write((const char *)pkv_rec(q, page), (size_t)1 << q->rec_shift);
}

/* Start loading the record of the entry `ahead` places after the head. */
PKV_INLINE void pkv_queue_prefetch(const pkv_free_queue *q, int64_t ahead)
{
    if (q->head + ahead < q->tail)
        pkv_prefetch_record(q, q->ring[(q->head + ahead) & q->mask]);
}

PKV_INLINE int32_t pkv_ref(const pkv_free_queue *q, int32_t page)
{
    return pkv_rec(q, page)->ref;
}

PKV_INLINE void pkv_set_ref(pkv_free_queue *q, int32_t page, int32_t count)
{
    pkv_rec(q, page)->ref = count;
}

PKV_INLINE void pkv_incref(pkv_free_queue *q, int32_t page)
{
    pkv_rec(q, page)->ref++;
}

/* Drop one reference without queueing the page; returns the new count. */
PKV_INLINE int32_t pkv_drop_ref(pkv_free_queue *q, int32_t page)
{
    return --pkv_rec(q, page)->ref;
}

/* Drop one reference; a page reaching 0 joins the queue's tail. */
PKV_INLINE int32_t pkv_decref(pkv_free_queue *q, int32_t page)
{
    const int32_t count = pkv_drop_ref(q, page);
    if (count == 0)
        pkv_queue_push(q, page);
    return count;
}

#endif
