/* KV events of the prefix cache: a bounded, ordered log of pages entering
 * the prefix index (stored), leaving it (removed) and of index resets
 * (cleared), recorded where they happen (the index insert, the index
 * removal) and drained by KVCache.take_kv_events. The event kinds are those
 * of vLLM's KV events (vllm/distributed/kv_events.py: BlockStored,
 * BlockRemoved, AllBlocksCleared); _kv_events.pyx turns records into them.
 *
 * The log grows by doubling up to `capacity` records; when it is full, or
 * memory runs out, a new record is dropped and counted instead: recording
 * never blocks and never fails, and the drainer learns how many it lost.
 */
#ifndef PAGEDKV_KV_EVENTS_H
#define PAGEDKV_KV_EVENTS_H
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "prefetch.h" /* PKV_INLINE */

enum { PKV_KV_STORED = 0, PKV_KV_REMOVED = 1, PKV_KV_CLEARED = 2 };

typedef struct {
    uint64_t lo, hi;             /* the page's 128-bit hash (stored, removed) */
    uint64_t parent_lo, parent_hi; /* stored: the previous page's hash, when has_parent */
    int64_t token_offset;        /* stored with tokens: first of its page_size ids in tokens */
    uint8_t kind;                /* PKV_KV_STORED / _REMOVED / _CLEARED */
    uint8_t has_parent;          /* stored: 0 for the first page of a sequence */
    uint8_t has_tokens;          /* stored: 0 for pages keyed by external block ids */
    uint8_t continues;           /* stored: next page of the same sequence as the record before */
    uint8_t unused[4];
} pkv_kv_event;

typedef struct pkv_kv_events {
    pkv_kv_event *records;       /* (allocated,) */
    int32_t *tokens;             /* (token_allocated,) token ids of stored records */
    int64_t allocated;           /* records allocated, <= capacity */
    int64_t token_allocated;     /* token ids allocated */
    int64_t capacity;            /* most records kept between two drains */
    int64_t count;               /* records kept */
    int64_t num_tokens;          /* token ids kept */
    int64_t page_size;           /* token ids per stored page */
    int64_t dropped;             /* records dropped since the last drain */
    int64_t total_recorded;      /* records kept over the log's life */
    int64_t total_dropped;       /* records dropped over the log's life */
    /* Buffers of a drain that its reader gave back, reused by the next drain:
     * fresh memory costs a page fault per 4 KiB on first write. */
    pkv_kv_event *spare_records;
    int32_t *spare_tokens;
    int64_t spare_allocated, spare_token_allocated;
} pkv_kv_events;

/* A free slot for one more record (and, with tokens, page_size ids), or NULL
 * after counting the record as dropped. */
PKV_INLINE pkv_kv_event *pkv_kv_events_slot(pkv_kv_events *ev, int with_tokens)
{
    if (ev->count == ev->allocated) {
        int64_t grown = ev->allocated ? 2 * ev->allocated : 256;
        if (grown > ev->capacity)
            grown = ev->capacity;
        pkv_kv_event *records = grown > ev->allocated
            ? (pkv_kv_event *)realloc(ev->records, (size_t)grown * sizeof(pkv_kv_event)) : NULL;
        if (records == NULL) {
            ev->dropped++;
            ev->total_dropped++;
            return NULL;
        }
        ev->records = records;
        ev->allocated = grown;
    }
    if (with_tokens && ev->num_tokens + ev->page_size > ev->token_allocated) {
        int64_t grown = ev->token_allocated ? 2 * ev->token_allocated : 256 * ev->page_size;
        while (grown < ev->num_tokens + ev->page_size)
            grown *= 2;
        int32_t *tokens = (int32_t *)realloc(ev->tokens, (size_t)grown * sizeof(int32_t));
        if (tokens == NULL) {
            ev->dropped++;
            ev->total_dropped++;
            return NULL;
        }
        ev->tokens = tokens;
        ev->token_allocated = grown;
    }
    pkv_kv_event *e = &ev->records[ev->count++];
    memset(e, 0, sizeof(*e));
    ev->total_recorded++;
    return e;
}

/* A page entered the prefix index under (lo, hi). `parent` is NULL for the
 * first page of a sequence, else {lo, hi} of the previous page; `tokens` is
 * its page_size token ids or NULL; `continues` says it follows the previous
 * record's page in the same sequence (consumers may merge the two). */
PKV_INLINE void pkv_kv_events_stored(pkv_kv_events *ev, uint64_t lo, uint64_t hi,
                                     const uint64_t *parent, const int32_t *tokens, int continues)
{
    pkv_kv_event *e = pkv_kv_events_slot(ev, tokens != NULL);
    if (e == NULL)
        return;
    e->kind = PKV_KV_STORED;
    e->lo = lo;
    e->hi = hi;
    if (parent != NULL) {
        e->has_parent = 1;
        e->parent_lo = parent[0];
        e->parent_hi = parent[1];
    }
    if (tokens != NULL) {
        e->has_tokens = 1;
        e->token_offset = ev->num_tokens;
        memcpy(ev->tokens + ev->num_tokens, tokens, (size_t)ev->page_size * sizeof(int32_t));
        ev->num_tokens += ev->page_size;
    }
    e->continues = (uint8_t)(continues != 0);
}

/* A page left the prefix index (evicted, or about to be written again). */
PKV_INLINE void pkv_kv_events_removed(pkv_kv_events *ev, uint64_t lo, uint64_t hi)
{
    pkv_kv_event *e = pkv_kv_events_slot(ev, 0);
    if (e == NULL)
        return;
    e->kind = PKV_KV_REMOVED;
    e->lo = lo;
    e->hi = hi;
}

/* Every page left the prefix index at once (a reset). */
PKV_INLINE void pkv_kv_events_cleared(pkv_kv_events *ev)
{
    pkv_kv_event *e = pkv_kv_events_slot(ev, 0);
    if (e != NULL)
        e->kind = PKV_KV_CLEARED;
}

/* Forget the kept records (after a drain) and the count of dropped ones. */
PKV_INLINE void pkv_kv_events_reset(pkv_kv_events *ev)
{
    ev->count = 0;
    ev->num_tokens = 0;
    ev->dropped = 0;
}

/* Hand the kept records and token ids (and their allocated sizes) over to
 * the caller, who gives them back with pkv_kv_events_give_back or frees
 * them, and continue on the spare buffers (the previous drain's), else on
 * new ones of the same size. */
static void pkv_kv_events_detach(pkv_kv_events *ev, pkv_kv_event **records, int64_t *allocated,
                                 int32_t **tokens, int64_t *token_allocated)
{
    *records = ev->records;
    *allocated = ev->allocated;
    *tokens = ev->tokens;
    *token_allocated = ev->token_allocated;
    if (ev->spare_records != NULL) {
        ev->records = ev->spare_records;
        ev->allocated = ev->spare_allocated;
    } else {
        ev->records = ev->allocated ? (pkv_kv_event *)malloc((size_t)ev->allocated * sizeof(pkv_kv_event)) : NULL;
        if (ev->records == NULL)
            ev->allocated = 0;
    }
    if (ev->spare_tokens != NULL) {
        ev->tokens = ev->spare_tokens;
        ev->token_allocated = ev->spare_token_allocated;
    } else {
        ev->tokens = ev->token_allocated ? (int32_t *)malloc((size_t)ev->token_allocated * sizeof(int32_t)) : NULL;
        if (ev->tokens == NULL)
            ev->token_allocated = 0;
    }
    ev->spare_records = NULL;
    ev->spare_tokens = NULL;
    ev->spare_allocated = ev->spare_token_allocated = 0;
    pkv_kv_events_reset(ev);
}

/* Take back the buffers of a drain as spares (freed if spares are held). */
static void pkv_kv_events_give_back(pkv_kv_events *ev, pkv_kv_event *records, int64_t allocated,
                                    int32_t *tokens, int64_t token_allocated)
{
    if (ev->spare_records == NULL && records != NULL) {
        ev->spare_records = records;
        ev->spare_allocated = allocated;
    } else {
        free(records);
    }
    if (ev->spare_tokens == NULL && tokens != NULL) {
        ev->spare_tokens = tokens;
        ev->spare_token_allocated = token_allocated;
    } else {
        free(tokens);
    }
}

PKV_INLINE void pkv_kv_events_free(pkv_kv_events *ev)
{
    free(ev->records);
    free(ev->tokens);
    free(ev->spare_records);
    free(ev->spare_tokens);
    ev->records = ev->spare_records = NULL;
    ev->tokens = ev->spare_tokens = NULL;
    ev->allocated = ev->token_allocated = ev->count = ev->num_tokens = 0;
}

#endif
