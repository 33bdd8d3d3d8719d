/* KV events of the prefix cache: a bounded, ordered log of pages entering
 * the prefix index (stored), leaving it (removed) and of index resets
 * (cleared), recorded where they happen (the index insert, the index
 * removal) and drained by KVCache.take_kv_events. The event kinds are those
 * of vLLM's KV events (vllm/distributed/kv_events.py: BlockStored,
 * BlockRemoved, AllBlocksCleared); _kv_events.pyx turns records into them.
 *
 * Layout: one array of 16-byte units holding events already grouped as vLLM
 * counts them. An event is a header unit (kind, flags, number of pages),
 * then for a stored event with a parent the parent's hash, then one unit per
 * page hash. A page that continues the open event (the next page of the same
 * sequence, or another removal) costs one unit and two counter increments,
 * and a run of stored pages is one copy of their hashes, so the recording
 * hot path writes 16 bytes per page and the drain needs no pass over the
 * records. Token ids of stored pages go, in order, to a
 * second array; a reader finds them by counting.
 *
 * `capacity` bounds the page records (an AllBlocksCleared counts as one)
 * kept between two drains; the arrays grow by doubling. When the log is
 * full, or memory runs out, a new record is dropped and counted instead:
 * recording never blocks and never fails, and the drainer learns how many it
 * lost. After a drop the next page starts a new event with its parent, so
 * the events kept stay exact.
 */
#ifndef PAGEDKV_KV_EVENTS_H
#define PAGEDKV_KV_EVENTS_H
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "prefetch.h" /* PKV_INLINE */

enum { PKV_KV_STORED = 0, PKV_KV_REMOVED = 1, PKV_KV_CLEARED = 2 };

/* A page hash, or a header: lo = kind | PKV_KV_HAS_PARENT | PKV_KV_HAS_TOKENS,
 * hi = pages in the event (0 for cleared). */
typedef struct {
    uint64_t lo, hi;
} pkv_kv_unit;

#define PKV_KV_KIND_MASK 0xffu
#define PKV_KV_HAS_PARENT 0x100u /* stored: a parent unit follows the header */
#define PKV_KV_HAS_TOKENS 0x200u /* stored: page_size token ids per page, in order */

#define PKV_KV_NO_EVENT (~(uint64_t)0) /* open_flags when no event is open */

typedef struct pkv_kv_events {
    pkv_kv_unit *units;          /* (allocated,) headers, parents and page hashes */
    int32_t *tokens;             /* (token_allocated,) token ids of stored pages */
    int64_t allocated;           /* units allocated */
    int64_t token_allocated;     /* token ids allocated */
    int64_t capacity;            /* most page records kept between two drains */
    int64_t count;               /* page records kept (a cleared counts one) */
    int64_t num_units;           /* units used */
    int64_t num_tokens;          /* token ids kept */
    int64_t page_size;           /* token ids per stored page */
    /* The open event, which the next page may extend: its header's index and
     * flags, and its pages so far (written to the header when it closes, so
     * that the hot path touches only the unit it appends). */
    int64_t open;
    uint64_t open_flags;         /* PKV_KV_NO_EVENT when none is open */
    int64_t open_pages;
    int64_t num_events;          /* events (headers) kept */
    int64_t num_stored;          /* stored page records in closed events */
    int64_t num_removed;         /* removed page records in closed events */
    int64_t dropped;             /* records dropped since the last drain */
    int64_t total_recorded;      /* records kept over the log's life, up to the last drain */
    int64_t total_dropped;       /* records dropped over the log's life */
    /* Buffers of a drain that its reader gave back, reused by the next drain:
     * fresh memory costs a page fault per 4 KiB on first write. */
    pkv_kv_unit *spare_units;
    int32_t *spare_tokens;
    int64_t spare_allocated, spare_token_allocated;
} pkv_kv_events;

/* Write the open event's page count into its header; no event is open after. */
PKV_INLINE void pkv_kv_events_close(pkv_kv_events *ev)
{
    if (ev->open_flags != PKV_KV_NO_EVENT) {
        ev->units[ev->open].hi = (uint64_t)ev->open_pages;
        if ((ev->open_flags & PKV_KV_KIND_MASK) == PKV_KV_STORED)
            ev->num_stored += ev->open_pages;
        else if ((ev->open_flags & PKV_KV_KIND_MASK) == PKV_KV_REMOVED)
            ev->num_removed += ev->open_pages;
    }
    ev->open = -1;
    ev->open_flags = PKV_KV_NO_EVENT;
    ev->open_pages = 0;
}

/* Count `n` records as dropped; the next page cannot extend the open event. */
PKV_INLINE void pkv_kv_events_drop(pkv_kv_events *ev, int64_t n)
{
    ev->dropped += n;
    ev->total_dropped += n;
    pkv_kv_events_close(ev);
}

/* Room for `units` more units (and `token_ids` more ids), or 0 when memory ran out. */
static int pkv_kv_events_grow(pkv_kv_events *ev, int64_t units, int64_t token_ids)
{
    if (ev->num_units + units > ev->allocated) {
        int64_t grown = ev->allocated ? 2 * ev->allocated : 512;
        while (grown < ev->num_units + units)
            grown *= 2;
        pkv_kv_unit *p = (pkv_kv_unit *)realloc(ev->units, (size_t)grown * sizeof(pkv_kv_unit));
        if (p == NULL)
            return 0;
        ev->units = p;
        ev->allocated = grown;
    }
    if (ev->num_tokens + token_ids > ev->token_allocated) {
        int64_t grown = ev->token_allocated ? 2 * ev->token_allocated : 256 * ev->page_size;
        while (grown < ev->num_tokens + token_ids)
            grown *= 2;
        int32_t *p = (int32_t *)realloc(ev->tokens, (size_t)grown * sizeof(int32_t));
        if (p == NULL)
            return 0;
        ev->tokens = p;
        ev->token_allocated = grown;
    }
    return 1;
}

/* Open a new event with header flags `flags` (and a parent unit when
 * parent != NULL); the caller made room for its units. */
PKV_INLINE void pkv_kv_events_open(pkv_kv_events *ev, uint64_t flags, const uint64_t *parent)
{
    pkv_kv_events_close(ev);
    pkv_kv_unit *u = ev->units + ev->num_units;
    u->lo = flags;
    u->hi = 0;
    ev->open = ev->num_units++;
    if (parent != NULL) {
        u[1].lo = parent[0];
        u[1].hi = parent[1];
        ev->num_units++;
    }
    ev->open_flags = flags;
    ev->num_events++;
}

/* n consecutive pages of one sequence entered the prefix index: `hashes`
 * holds their {lo, hi} pairs (2 * n values). `parent` is NULL when the
 * first is the first page of a sequence, else {lo, hi} of the page before
 * it; `tokens` is their n * page_size token ids or NULL; `continues` says
 * the first follows the previous record's page in the same sequence, so the
 * run may extend the open event. When the log has room for fewer than n,
 * the first ones are kept and the rest counted as dropped. */
PKV_INLINE void pkv_kv_events_stored_run(pkv_kv_events *ev, const uint64_t *hashes, int64_t n,
                                         const uint64_t *parent, const int32_t *tokens, int continues)
{
    const uint64_t flags = PKV_KV_STORED | (parent != NULL ? PKV_KV_HAS_PARENT : 0) |
                           (tokens != NULL ? PKV_KV_HAS_TOKENS : 0);
    int64_t kept = ev->capacity - ev->count < n ? ev->capacity - ev->count : n;
    if (kept <= 0) {
        pkv_kv_events_drop(ev, n);
        return;
    }
    const int extend = continues && ev->open_flags != PKV_KV_NO_EVENT &&
                       (ev->open_flags | PKV_KV_HAS_PARENT) == (flags | PKV_KV_HAS_PARENT);
    const int64_t need = kept + (extend ? 0 : 2);
    const int64_t token_ids = tokens != NULL ? kept * ev->page_size : 0;
    if ((ev->num_units + need > ev->allocated || ev->num_tokens + token_ids > ev->token_allocated) &&
        !pkv_kv_events_grow(ev, need, token_ids)) {
        pkv_kv_events_drop(ev, n);
        return;
    }
    if (!extend)
        pkv_kv_events_open(ev, flags, parent);
    memcpy(ev->units + ev->num_units, hashes, (size_t)kept * sizeof(pkv_kv_unit));
    ev->num_units += kept;
    ev->open_pages += kept;
    if (tokens != NULL) {
        memcpy(ev->tokens + ev->num_tokens, tokens, (size_t)token_ids * sizeof(int32_t));
        ev->num_tokens += token_ids;
    }
    ev->count += kept;
    if (kept < n)
        pkv_kv_events_drop(ev, n - kept);
}

/* One page entered the prefix index (pkv_kv_events_stored_run of one page). */
PKV_INLINE void pkv_kv_events_stored(pkv_kv_events *ev, uint64_t lo, uint64_t hi,
                                     const uint64_t *parent, const int32_t *tokens, int continues)
{
    const uint64_t hash[2] = {lo, hi};
    pkv_kv_events_stored_run(ev, hash, 1, parent, tokens, continues);
}

/* A page left the prefix index (evicted, or about to be written again). */
PKV_INLINE void pkv_kv_events_removed(pkv_kv_events *ev, uint64_t lo, uint64_t hi)
{
    if (ev->count == ev->capacity) {
        pkv_kv_events_drop(ev, 1);
        return;
    }
    const int extend = ev->open_flags == PKV_KV_REMOVED;
    if (ev->num_units + 2 > ev->allocated && !pkv_kv_events_grow(ev, 2, 0)) {
        pkv_kv_events_drop(ev, 1);
        return;
    }
    if (!extend)
        pkv_kv_events_open(ev, PKV_KV_REMOVED, NULL);
    pkv_kv_unit *u = ev->units + ev->num_units++;
    u->lo = lo;
    u->hi = hi;
    ev->open_pages++;
    ev->count++;
}

/* Every page left the prefix index at once (a reset). */
PKV_INLINE void pkv_kv_events_cleared(pkv_kv_events *ev)
{
    if (ev->count == ev->capacity || (ev->num_units + 1 > ev->allocated && !pkv_kv_events_grow(ev, 1, 0))) {
        pkv_kv_events_drop(ev, 1);
        return;
    }
    pkv_kv_events_open(ev, PKV_KV_CLEARED, NULL);
    pkv_kv_events_close(ev);
    ev->count++;
}

/* Records kept over the log's life, the pending ones included. */
PKV_INLINE int64_t pkv_kv_events_total_recorded(const pkv_kv_events *ev)
{
    return ev->total_recorded + ev->count;
}

/* Forget the kept records (after a drain) and the count of dropped ones. */
PKV_INLINE void pkv_kv_events_reset(pkv_kv_events *ev)
{
    ev->total_recorded += ev->count;
    ev->count = ev->num_units = ev->num_tokens = 0;
    ev->num_events = ev->num_stored = ev->num_removed = 0;
    ev->open = -1;
    ev->open_flags = PKV_KV_NO_EVENT;
    ev->open_pages = 0;
    ev->dropped = 0;
}

/* Hand the kept units and token ids (and their allocated sizes) over to the
 * caller, who gives them back with pkv_kv_events_give_back or frees them,
 * and continue on the spare buffers (the previous drain's), else on new ones
 * of the same size. The caller reads the counts (count, num_units, ...)
 * before, after pkv_kv_events_close; they start from 0. */
static void pkv_kv_events_detach(pkv_kv_events *ev, pkv_kv_unit **units, int64_t *allocated,
                                 int32_t **tokens, int64_t *token_allocated)
{
    *units = ev->units;
    *allocated = ev->allocated;
    *tokens = ev->tokens;
    *token_allocated = ev->token_allocated;
    if (ev->spare_units != NULL) {
        ev->units = ev->spare_units;
        ev->allocated = ev->spare_allocated;
    } else {
        ev->units = ev->allocated ? (pkv_kv_unit *)malloc((size_t)ev->allocated * sizeof(pkv_kv_unit)) : NULL;
        if (ev->units == NULL)
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
    ev->spare_units = NULL;
    ev->spare_tokens = NULL;
    ev->spare_allocated = ev->spare_token_allocated = 0;
    pkv_kv_events_reset(ev);
}

/* Take back the buffers of a drain as spares (freed if spares are held). */
static void pkv_kv_events_give_back(pkv_kv_events *ev, pkv_kv_unit *units, int64_t allocated,
                                    int32_t *tokens, int64_t token_allocated)
{
    if (ev->spare_units == NULL && units != NULL) {
        ev->spare_units = units;
        ev->spare_allocated = allocated;
    } else {
        free(units);
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
    free(ev->units);
    free(ev->tokens);
    free(ev->spare_units);
    free(ev->spare_tokens);
    ev->units = ev->spare_units = NULL;
    ev->tokens = ev->spare_tokens = NULL;
    ev->allocated = ev->token_allocated = ev->count = ev->num_units = ev->num_tokens = 0;
}

#endif
