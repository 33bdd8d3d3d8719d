/* Page checksums one layer at a time (page_checksum.h, split in two steps).
 *
 * A page's checksum is the low 64 bits of XXH3-128 over the 16-byte digests
 * of its bytes in each layer. Computing the digests of one layer's run of
 * pages as soon as those bytes are read from (or about to be written to) a
 * file lets a snapshot check a pool while its bytes are still in the CPU's
 * cache, instead of reading the whole pool again afterwards; combining the
 * digests gives exactly pkv_page_checksum's value.
 *
 * Pure C, no allocation, no global state: safe without the GIL.
 */
#ifndef PAGEDKV_PAGE_DIGESTS_H
#define PAGEDKV_PAGE_DIGESTS_H

#include <stddef.h>
#include <stdint.h>

#include "page_checksum.h"

/* Digests of pages [first, first + n) of one layer whose page 0 starts at
 * ``layer_base`` (pages ``page_bytes`` apart): the digest of page p goes to
 * ``digests + (p * num_layers + layer) * 16``. Pages with ``skip[p]`` nonzero
 * are left alone (``skip`` may be NULL). The caller has checked the ranges. */
static inline void pkv_layer_digests(const uint8_t *layer_base, size_t page_bytes, int64_t first, int64_t n,
                                     int64_t layer, int64_t num_layers, const uint8_t *skip, uint8_t *digests)
{
    int64_t p;
    for (p = first; p < first + n; p++) {
        if (skip != NULL && skip[p]) {
            continue;
        }
        pkv_xxh3_128_canonical(layer_base + (size_t)p * page_bytes, page_bytes,
                               digests + ((size_t)p * (size_t)num_layers + (size_t)layer) * PKV_CHECKSUM_DIGEST_BYTES);
    }
}

/* out[p] = low 64 bits of XXH3-128 over the ``num_layers`` digests of page p,
 * for p in [0, n) without ``skip[p]`` (``skip`` may be NULL). */
static inline void pkv_combine_digests(const uint8_t *digests, int64_t num_layers, int64_t n, const uint8_t *skip,
                                       uint64_t *out)
{
    int64_t p;
    uint64_t lo, hi;
    size_t row = (size_t)num_layers * PKV_CHECKSUM_DIGEST_BYTES;
    for (p = 0; p < n; p++) {
        if (skip != NULL && skip[p]) {
            continue;
        }
        pkv_xxh3_128(digests + (size_t)p * row, row, &lo, &hi);
        (void)hi;
        out[p] = lo;
    }
}

#endif
