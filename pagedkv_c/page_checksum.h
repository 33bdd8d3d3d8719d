/* Page checksum: one 64-bit value over a page's K/V bytes in every layer.
 *
 * For each layer L, d_L is XXH3-128 (pagedkv_c/xxh3.h, seed 0) of that
 * layer's page bytes (K then V, ``page_bytes`` long, exactly as laid out in
 * the pool), written as its 16-byte canonical digest (big-endian high half,
 * then big-endian low half: what ``xxhash.xxh3_128(b).digest()`` returns).
 * The checksum is the low 64 bits of XXH3-128 over d_0 .. d_{L-1}; with zero
 * layers, over the empty string. Hashing each layer on its own reads every
 * layer's page as one contiguous run of bytes, and a digest of digests lets a
 * reader that holds one layer at a time (a file, a network value) compute the
 * same value.
 *
 * Pure C, no allocation, no global state: safe without the GIL and from
 * several threads at once.
 */
#ifndef PAGEDKV_PAGE_CHECKSUM_H
#define PAGEDKV_PAGE_CHECKSUM_H

#include <stddef.h>
#include <stdint.h>

#include "xxh3.h"

/* Bytes of scratch space pkv_page_checksum needs: 16 per layer. */
#define PKV_CHECKSUM_DIGEST_BYTES 16

static inline void pkv_store64_be(uint8_t *out, uint64_t x)
{
    int i;
    for (i = 7; i >= 0; i--) {
        out[i] = (uint8_t)(x & 0xFF);
        x >>= 8;
    }
}

/* Canonical 16-byte digest of XXH3-128 of ``len`` bytes at ``data``. */
static inline void pkv_xxh3_128_canonical(const void *data, size_t len, uint8_t out[16])
{
    uint64_t lo, hi;
    pkv_xxh3_128(data, len, &lo, &hi);
    pkv_store64_be(out, hi);
    pkv_store64_be(out + 8, lo);
}

/* Checksum of page ``page_id`` of a pool whose layer L starts at
 * ``pool + L * layer_stride`` and whose page p of a layer starts at
 * ``p * page_bytes`` from there (all in bytes). ``scratch`` holds at least
 * ``16 * num_layers`` bytes. The caller has checked that ``page_id`` is a
 * page of the pool. */
static inline uint64_t pkv_page_checksum(const uint8_t *pool, size_t layer_stride, size_t page_bytes,
                                         int64_t num_layers, int64_t page_id, uint8_t *scratch)
{
    uint64_t lo, hi;
    int64_t layer;
    const uint8_t *page = pool + (size_t)page_id * page_bytes;
    for (layer = 0; layer < num_layers; layer++) {
        pkv_xxh3_128_canonical(page + (size_t)layer * layer_stride, page_bytes,
                               scratch + (size_t)layer * PKV_CHECKSUM_DIGEST_BYTES);
    }
    pkv_xxh3_128(scratch, (size_t)num_layers * PKV_CHECKSUM_DIGEST_BYTES, &lo, &hi);
    (void)hi;
    return lo;
}

/* Checksums of ``n`` pages, ``out[i]`` for ``page_ids[i]``; same layout and
 * scratch rules as pkv_page_checksum. */
static inline void pkv_page_checksums(const uint8_t *pool, size_t layer_stride, size_t page_bytes,
                                      int64_t num_layers, const int32_t *page_ids, int64_t n,
                                      uint64_t *out, uint8_t *scratch)
{
    int64_t i;
    for (i = 0; i < n; i++) {
        out[i] = pkv_page_checksum(pool, layer_stride, page_bytes, num_layers, page_ids[i], scratch);
    }
}

#endif
