/* The per-page record shared by the allocator (page_pool.h) and the prefix
 * index (prefix_index.h): 32 bytes, so a page's queue position, ref count,
 * hash and cached flag share one cache line. Allocating a page that still
 * holds a cached prefix reads its queue position and then its hash to evict
 * it, and a prefix hit compares the hash and then takes a reference: with
 * one record per page, each costs one cache miss instead of two.
 *
 * Sealing a page flags it in its record too: the seal at a sequence's
 * removal and the unseal when the page is handed out again touch the line
 * that releasing or taking the page loads anyway.
 *
 * The allocator uses only the first 16 bytes (and the seal flag). A pool without a prefix index
 * keeps 16-byte records (the allocator addresses records with a stride of
 * 1 << rec_shift bytes), so its pages take half the memory and cache lines.
 */
#ifndef PAGEDKV_PAGE_RECORD_H
#define PAGEDKV_PAGE_RECORD_H
#include <stddef.h>
#include <stdint.h>

typedef struct {
    int64_t qpos;           /* allocator: absolute position of the page's live queue entry, or -1 */
    int32_t ref;            /* allocator: ref count; 0 = free (queued) */
    uint8_t cached;         /* prefix index: 1 while the page is findable by its hash, else 0 */
    uint8_t has_tokens;     /* prefix index: 1 when the page's token ids are kept for hit checks */
    uint8_t sealed;         /* KVCache: 1 while the page is sealed (full, its K/V complete in every layer) */
    uint8_t unused;
    uint64_t lo;            /* prefix index: the page's hash while cached, low 64 bits */
    uint64_t hi;            /*   and high 64 bits */
} pkv_page_record;
typedef char pkv_page_record_is_32_bytes[sizeof(pkv_page_record) == 32 ? 1 : -1];

/* Byte offset of the seal flag, inside the allocator's first 16 bytes. */
#define PKV_SEALED_OFFSET ((int)offsetof(pkv_page_record, sealed))
typedef char pkv_sealed_flag_in_allocator_bytes[PKV_SEALED_OFFSET < 16 ? 1 : -1];

/* log2 of the record stride: 16 bytes (the allocator's fields alone, a pool
 * without a prefix index) or 32 (the whole record, shared with an index). */
#define PKV_ALLOCATOR_RECORD_SHIFT 4
#define PKV_SHARED_RECORD_SHIFT 5

#endif
