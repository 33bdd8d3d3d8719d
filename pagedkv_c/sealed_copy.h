/* Drain the sealed-page log and copy the pages out in one step (the shared tier's offload).
 *
 * Called with the cache's lock held, so that an entry still in the log (its page not
 * written again since the seal: see sealed_log.h) describes exactly the bytes copied:
 * the consumer needs no second check of the copy. Plain C, no allocation: safe
 * without the GIL.
 *
 * Each taken page fills one record of ``record_bytes`` bytes in ``records``: its
 * token ids (int32, page_size of them, -1 when the index keeps none) at
 * ``token_offset`` and its K/V at ``body_offset``, for each layer in order the page's
 * ``page_bytes`` bytes as laid out in the pool (K then V). Its 128-bit hash (lo, hi)
 * goes to ``hashes[2 * k]``. Bytes of a record outside those two ranges are not written.
 */
#ifndef PAGEDKV_SEALED_COPY_H
#define PAGEDKV_SEALED_COPY_H

#include <stdint.h>
#include <string.h>

#include "sealed_log.h"

/* Take pending entries in seal order: the first ``max_pages`` are copied into ``records``
 * (see above). With ``discard_rest`` the entries after them leave the log uncopied
 * (counted in ``*num_discarded``); without, they stay pending for the next call.
 * Returns the number of pages copied. */
static inline int64_t pkv_sealed_log_take_copies(pkv_sealed_log *log, const uint8_t *pool, size_t layer_stride,
                                                 size_t page_bytes, int64_t num_layers, int64_t max_pages,
                                                 int discard_rest, uint8_t *records, size_t record_bytes,
                                                 size_t token_offset, size_t body_offset, uint64_t *hashes,
                                                 int64_t *num_discarded)
{
    int64_t a, layer, k = 0, discarded = 0;
    for (a = log->head; a < log->tail; a++) {
        const int64_t slot = a % log->capacity;
        const int32_t page = log->page_ids[slot];
        if (page < 0)
            continue;  /* withdrawn: the page was written again */
        if (k >= max_pages) {
            if (!discard_rest)
                break;  /* stays pending from here */
            log->position_of[page] = -1;
            discarded++;
            continue;
        }
        log->position_of[page] = -1;
        uint8_t *record = records + (size_t)k * record_bytes;
        hashes[2 * k] = log->hashes[2 * slot];
        hashes[2 * k + 1] = log->hashes[2 * slot + 1];
        memcpy(record + token_offset, log->token_ids + slot * log->page_size,
               (size_t)log->page_size * sizeof(int32_t));
        for (layer = 0; layer < num_layers; layer++)
            memcpy(record + body_offset + (size_t)layer * page_bytes,
                   pool + (size_t)layer * layer_stride + (size_t)page * page_bytes, page_bytes);
        k++;
    }
    log->head = a;
    *num_discarded = discarded;
    return k;
}

#endif
