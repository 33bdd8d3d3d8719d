/* Free queue and ref counts of the page allocator, as static inline
 * functions over a plain struct, so that the page tables and the cache
 * inline them into their per-page loops (calls across Cython modules cannot
 * be inlined). PagePool in _pool.pyx owns the memory and documents the
 * design: an intrusive circular doubly linked list with a sentinel, least
 * recently freed page at the head. Each page has a 16-byte record
 * [prev, next, ref count, unused], so one page operation touches one cache
 * line; row num_pages is the sentinel. A page outside the queue has both
 * links set to -1.
 */
#ifndef PAGEDKV_PAGE_POOL_H
#define PAGEDKV_PAGE_POOL_H
#include <stdint.h>
#include "prefetch.h"

enum { PKV_PREV = 0, PKV_NEXT = 1, PKV_REF = 2, PKV_RECORD = 4 };

typedef struct {
    int32_t *rec;       /* (num_pages + 1) x PKV_RECORD int32 */
    int32_t sentinel;   /* = num_pages */
    int32_t num_free;   /* pages in the queue */
} pkv_free_queue;

PKV_INLINE int32_t *pkv_record(const pkv_free_queue *q, int32_t page)
{
    return q->rec + (int64_t)PKV_RECORD * page;
}

/* Unlink a page from anywhere in the queue in O(1). */
PKV_INLINE void pkv_queue_remove(pkv_free_queue *q, int32_t page)
{
    int32_t *r = pkv_record(q, page);
    const int32_t before = r[PKV_PREV], after = r[PKV_NEXT];
    pkv_record(q, before)[PKV_NEXT] = after;
    pkv_record(q, after)[PKV_PREV] = before;
    r[PKV_PREV] = -1;
    r[PKV_NEXT] = -1;
    q->num_free--;
}

/* Append a page at the tail (most recently freed). */
PKV_INLINE void pkv_queue_push(pkv_free_queue *q, int32_t page)
{
    int32_t *s = pkv_record(q, q->sentinel), *r = pkv_record(q, page);
    const int32_t tail = s[PKV_PREV];
    pkv_record(q, tail)[PKV_NEXT] = page;
    r[PKV_PREV] = tail;
    r[PKV_NEXT] = q->sentinel;
    s[PKV_PREV] = page;
    q->num_free++;
}

/* The head of the queue (least recently freed); the queue must not be empty. */
PKV_INLINE int32_t pkv_queue_head(const pkv_free_queue *q)
{
    return pkv_record(q, q->sentinel)[PKV_NEXT];
}

PKV_INLINE int pkv_queue_contains(const pkv_free_queue *q, int32_t page)
{
    return pkv_record(q, page)[PKV_NEXT] != -1;
}

PKV_INLINE int32_t pkv_ref(const pkv_free_queue *q, int32_t page)
{
    return pkv_record(q, page)[PKV_REF];
}

PKV_INLINE void pkv_set_ref(pkv_free_queue *q, int32_t page, int32_t count)
{
    pkv_record(q, page)[PKV_REF] = count;
}

PKV_INLINE void pkv_incref(pkv_free_queue *q, int32_t page)
{
    pkv_record(q, page)[PKV_REF]++;
}

/* Drop one reference without queueing the page; returns the new count. */
PKV_INLINE int32_t pkv_drop_ref(pkv_free_queue *q, int32_t page)
{
    return --pkv_record(q, page)[PKV_REF];
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
