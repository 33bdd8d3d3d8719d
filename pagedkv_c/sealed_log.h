/* Sealed-page log: the pages a KVCache sealed since its consumer last drained
 * the log, in seal order, for a consumer that copies sealed pages elsewhere
 * (a shared prefix tier). Only pages that are in the prefix index at their
 * seal are logged (their 128-bit page hash keys them outside the process).
 *
 * Bounded: at most ``capacity`` entries wait; a seal that finds the log full
 * is not logged and counted in num_dropped (the newest entry is dropped, so
 * the pending ones stay in seal order). A page written again before the log
 * is drained (its seal cleared) has its pending entry withdrawn, counted in
 * num_withdrawn: the entry would describe bytes the page no longer holds.
 *
 * Entries live at absolute positions [head, tail), slot position % capacity;
 * position_of[page] is the position of the page's pending entry or -1, so a
 * withdrawal is O(1). Plain C, no allocation after init: safe without the GIL.
 */
#ifndef PAGEDKV_SEALED_LOG_H
#define PAGEDKV_SEALED_LOG_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    int64_t capacity;       /* entries that can wait at once */
    int64_t page_size;      /* token ids per entry */
    int64_t num_pages;      /* pages of the pool (size of position_of) */
    int64_t head, tail;     /* absolute positions: pending entries in [head, tail) */
    int32_t *page_ids;      /* (capacity,) page id, or -1 for a withdrawn entry */
    uint64_t *hashes;       /* (capacity, 2) page hash: lo, hi */
    int32_t *token_ids;     /* (capacity, page_size) token ids, -1 when the index keeps none */
    uint64_t *checksums;    /* (capacity,) page checksum at the seal (page_checksum.h) */
    int64_t *position_of;   /* (num_pages,) position of the page's pending entry, or -1 */
    int64_t num_logged;     /* entries ever appended */
    int64_t num_dropped;    /* seals not logged because the log was full */
    int64_t num_withdrawn;  /* entries withdrawn because their page was written again */
} pkv_sealed_log;

/* Allocate the log's arrays; 0 on success, -1 when out of memory (nothing held). */
static inline int pkv_sealed_log_init(pkv_sealed_log *log, int64_t capacity, int64_t page_size, int64_t num_pages)
{
    int64_t i;
    memset(log, 0, sizeof(*log));
    log->capacity = capacity;
    log->page_size = page_size;
    log->num_pages = num_pages;
    log->page_ids = (int32_t *)malloc((size_t)capacity * sizeof(int32_t));
    log->hashes = (uint64_t *)malloc((size_t)capacity * 2 * sizeof(uint64_t));
    log->token_ids = (int32_t *)malloc((size_t)capacity * (size_t)page_size * sizeof(int32_t));
    log->checksums = (uint64_t *)malloc((size_t)capacity * sizeof(uint64_t));
    log->position_of = (int64_t *)malloc((size_t)num_pages * sizeof(int64_t));
    if (!log->page_ids || !log->hashes || !log->token_ids || !log->checksums || !log->position_of) {
        free(log->page_ids);
        free(log->hashes);
        free(log->token_ids);
        free(log->checksums);
        free(log->position_of);
        memset(log, 0, sizeof(*log));
        return -1;
    }
    for (i = 0; i < num_pages; i++)
        log->position_of[i] = -1;
    return 0;
}

static inline void pkv_sealed_log_free(pkv_sealed_log *log)
{
    free(log->page_ids);
    free(log->hashes);
    free(log->token_ids);
    free(log->checksums);
    free(log->position_of);
    memset(log, 0, sizeof(*log));
}

/* Append a sealed page; ``token_ids`` NULL fills the entry's token ids with -1. */
static inline void pkv_sealed_log_push(pkv_sealed_log *log, int32_t page, uint64_t hash_lo, uint64_t hash_hi,
                                       const int32_t *token_ids, uint64_t checksum)
{
    int64_t slot, t;
    if (log->tail - log->head >= log->capacity) {
        log->num_dropped++;
        return;
    }
    slot = log->tail % log->capacity;
    log->page_ids[slot] = page;
    log->hashes[2 * slot] = hash_lo;
    log->hashes[2 * slot + 1] = hash_hi;
    if (token_ids != NULL) {
        memcpy(log->token_ids + slot * log->page_size, token_ids, (size_t)log->page_size * sizeof(int32_t));
    } else {
        for (t = 0; t < log->page_size; t++)
            log->token_ids[slot * log->page_size + t] = -1;
    }
    log->checksums[slot] = checksum;
    log->position_of[page] = log->tail;
    log->tail++;
    log->num_logged++;
}

/* The page is written again: withdraw its pending entry, if any. */
static inline void pkv_sealed_log_withdraw(pkv_sealed_log *log, int32_t page)
{
    const int64_t position = log->position_of[page];
    if (position >= 0) {
        log->page_ids[position % log->capacity] = -1;
        log->position_of[page] = -1;
        log->num_withdrawn++;
    }
}

/* Withdraw every pending entry (the pages' seals were replaced wholesale). */
static inline void pkv_sealed_log_clear(pkv_sealed_log *log)
{
    int64_t a;
    for (a = log->head; a < log->tail; a++) {
        const int32_t page = log->page_ids[a % log->capacity];
        if (page >= 0)
            pkv_sealed_log_withdraw(log, page);
    }
    log->head = log->tail;
}

/* Pending entries that were not withdrawn. */
static inline int64_t pkv_sealed_log_count(const pkv_sealed_log *log)
{
    int64_t a, n = 0;
    for (a = log->head; a < log->tail; a++)
        n += log->page_ids[a % log->capacity] >= 0;
    return n;
}

/* Move every pending entry, in seal order, into the output arrays (room for
 * pkv_sealed_log_count entries) and empty the log. */
static inline void pkv_sealed_log_drain(pkv_sealed_log *log, int32_t *page_ids, uint64_t *hashes,
                                        int32_t *token_ids, uint64_t *checksums)
{
    int64_t a, k = 0;
    for (a = log->head; a < log->tail; a++) {
        const int64_t slot = a % log->capacity;
        const int32_t page = log->page_ids[slot];
        if (page < 0)
            continue;
        page_ids[k] = page;
        hashes[2 * k] = log->hashes[2 * slot];
        hashes[2 * k + 1] = log->hashes[2 * slot + 1];
        memcpy(token_ids + k * log->page_size, log->token_ids + slot * log->page_size,
               (size_t)log->page_size * sizeof(int32_t));
        checksums[k] = log->checksums[slot];
        log->position_of[page] = -1;
        k++;
    }
    log->head = log->tail;
}

#endif
