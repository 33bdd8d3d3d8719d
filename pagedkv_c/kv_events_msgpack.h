/* MessagePack encoding of KV event records as one vLLM KVEventBatch
 * (vllm/distributed/kv_events.py, vLLM 0.26): the array
 * [ts, events, data_parallel_rank], each event a map tagged by "type".
 * The log already holds the events as vLLM counts them (consecutive pages
 * of one sequence form one BlockStored, consecutive removals one
 * BlockRemoved). Field list and order: pagedkv/events.py documents them.
 * Plain C straight from the log's units, run without the GIL.
 */
#ifndef PAGEDKV_KV_EVENTS_MSGPACK_H
#define PAGEDKV_KV_EVENTS_MSGPACK_H
#include <stdint.h>
#include <string.h>
#include "kv_events.h"

static uint8_t *pkv_mp_be(uint8_t *p, uint64_t v, int bytes)
{
    for (int i = bytes - 1; i >= 0; i--) {
        p[i] = (uint8_t)(v & 0xff);
        v >>= 8;
    }
    return p + bytes;
}

static uint8_t *pkv_mp_uint(uint8_t *p, uint64_t v)
{
    if (v < 128) { *p++ = (uint8_t)v; return p; }
    if (v < 256) { *p++ = 0xcc; *p++ = (uint8_t)v; return p; }
    if (v < 65536) { *p++ = 0xcd; return pkv_mp_be(p, v, 2); }
    if (v < 4294967296ULL) { *p++ = 0xce; return pkv_mp_be(p, v, 4); }
    *p++ = 0xcf;
    return pkv_mp_be(p, v, 8);
}

static uint8_t *pkv_mp_int(uint8_t *p, int64_t v)
{
    if (v >= 0) return pkv_mp_uint(p, (uint64_t)v);
    if (v >= -32) { *p++ = (uint8_t)(0xe0 | (v + 32)); return p; }
    if (v >= -128) { *p++ = 0xd0; *p++ = (uint8_t)(int8_t)v; return p; }
    if (v >= -32768) { *p++ = 0xd1; return pkv_mp_be(p, (uint64_t)(uint16_t)(int16_t)v, 2); }
    if (v >= INT32_MIN) { *p++ = 0xd2; return pkv_mp_be(p, (uint64_t)(uint32_t)(int32_t)v, 4); }
    *p++ = 0xd3;
    return pkv_mp_be(p, (uint64_t)v, 8);
}

static uint8_t *pkv_mp_header(uint8_t *p, uint64_t n, uint8_t fix, uint8_t b16, uint8_t b32)
{
    if (n < 16) { *p++ = (uint8_t)(fix | n); return p; }
    if (n < 65536) { *p++ = b16; return pkv_mp_be(p, n, 2); }
    *p++ = b32;
    return pkv_mp_be(p, n, 4);
}
#define pkv_mp_array(p, n) pkv_mp_header((p), (n), 0x90, 0xdc, 0xdd)
#define pkv_mp_map(p, n) pkv_mp_header((p), (n), 0x80, 0xde, 0xdf)

static uint8_t *pkv_mp_str(uint8_t *p, const char *s, size_t n)
{
    if (n < 32) *p++ = (uint8_t)(0xa0 | n);
    else if (n < 256) { *p++ = 0xd9; *p++ = (uint8_t)n; }
    else if (n < 65536) { *p++ = 0xda; p = pkv_mp_be(p, n, 2); }
    else { *p++ = 0xdb; p = pkv_mp_be(p, n, 4); }
    memcpy(p, s, n);
    return p + n;
}
#define PKV_MP_KEY(p, literal) pkv_mp_str((p), (literal), sizeof(literal) - 1)

/* 8 bytes of v, big-endian (one byte swap and one store where available). */
static inline uint8_t *pkv_mp_be64(uint8_t *p, uint64_t v)
{
#if defined(__GNUC__) || defined(__clang__)
#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    v = __builtin_bswap64(v);
#endif
    memcpy(p, &v, 8);
    return p + 8;
#else
    return pkv_mp_be(p, v, 8);
#endif
}

/* A page hash: vLLM's int form (the low 64 bits) or 16 big-endian bytes. */
static inline uint8_t *pkv_mp_hash(uint8_t *p, uint64_t lo, uint64_t hi, int as_bytes)
{
    if (!as_bytes) {
        if (lo >> 32) { /* nearly every hash: uint 64 */
            *p++ = 0xcf;
            return pkv_mp_be64(p, lo);
        }
        return pkv_mp_uint(p, lo);
    }
    *p++ = 0xc4;
    *p++ = 16;
    p = pkv_mp_be64(p, hi);
    return pkv_mp_be64(p, lo);
}

/* The hashes of n consecutive units. */
static uint8_t *pkv_mp_hashes(uint8_t *p, const pkv_kv_unit *u, int64_t n, int as_bytes)
{
    if (as_bytes) {
        for (int64_t j = 0; j < n; j++)
            p = pkv_mp_hash(p, u[j].lo, u[j].hi, 1);
    } else {
        for (int64_t j = 0; j < n; j++)
            p = pkv_mp_hash(p, u[j].lo, 0, 0);
    }
    return p;
}

/* Bytes that pkv_kv_events_encode writes at most for a log's units. */
static size_t pkv_kv_events_encode_bound(int64_t num_units, int64_t num_events, int64_t num_tokens,
                                         size_t medium_len)
{
    /* Per event: its map with every key and fixed value (under 256 bytes)
     * and the medium; per unit (hash or parent): at most 18 bytes; per token
     * id 5 bytes. */
    return 64 + (size_t)num_events * (256 + medium_len) + (size_t)num_units * 18 + (size_t)num_tokens * 5;
}

/* Write the events of units[0, num_units) (kv_events.h) into out
 * (pkv_kv_events_encode_bound bytes) as one batch of num_events events;
 * return its length. window < 0: full attention. */
static size_t pkv_kv_events_encode(const pkv_kv_unit *u, int64_t num_units, int64_t num_events,
                                   const int32_t *tokens, int64_t page_size, double ts, int64_t rank,
                                   const char *medium, size_t medium_len, int64_t window, int hash_bytes,
                                   uint8_t *out)
{
    uint8_t *p = out;
    uint64_t ts_bits;
    memcpy(&ts_bits, &ts, 8);
    p = pkv_mp_array(p, 3);
    *p++ = 0xcb;
    p = pkv_mp_be(p, ts_bits, 8);
    p = pkv_mp_array(p, (uint64_t)num_events);
    for (int64_t i = 0; i < num_units;) {
        const uint64_t kind = u[i].lo & PKV_KV_KIND_MASK, flags = u[i].lo;
        const int64_t pages = (int64_t)u[i].hi;
        i++;
        if (kind == PKV_KV_STORED) {
            p = pkv_mp_map(p, window >= 0 ? 11 : 10);
            p = PKV_MP_KEY(p, "type");
            p = PKV_MP_KEY(p, "BlockStored");
            p = PKV_MP_KEY(p, "block_hashes");
            p = pkv_mp_array(p, (uint64_t)pages);
            const pkv_kv_unit *parent = (flags & PKV_KV_HAS_PARENT) ? &u[i++] : NULL;
            p = pkv_mp_hashes(p, u + i, pages, hash_bytes);
            i += pages;
            p = PKV_MP_KEY(p, "parent_block_hash");
            if (parent != NULL)
                p = pkv_mp_hash(p, parent->lo, parent->hi, hash_bytes);
            else
                *p++ = 0xc0;
            p = PKV_MP_KEY(p, "token_ids");
            if (flags & PKV_KV_HAS_TOKENS) {
                const int64_t n = pages * page_size;
                p = pkv_mp_array(p, (uint64_t)n);
                for (int64_t t = 0; t < n; t++)
                    p = pkv_mp_int(p, tokens[t]);
                tokens += n;
            } else {
                p = pkv_mp_array(p, 0);
            }
            p = PKV_MP_KEY(p, "block_size");
            p = pkv_mp_uint(p, (uint64_t)page_size);
            p = PKV_MP_KEY(p, "lora_id");
            *p++ = 0xc0;
            p = PKV_MP_KEY(p, "medium");
            p = pkv_mp_str(p, medium, medium_len);
            p = PKV_MP_KEY(p, "lora_name");
            *p++ = 0xc0;
            p = PKV_MP_KEY(p, "group_idx");
            *p++ = 0;
            p = PKV_MP_KEY(p, "kv_cache_spec_kind");
            if (window >= 0) {
                p = PKV_MP_KEY(p, "sliding_window");
                p = PKV_MP_KEY(p, "kv_cache_spec_sliding_window");
                p = pkv_mp_uint(p, (uint64_t)window);
            } else {
                p = PKV_MP_KEY(p, "full_attention");
            }
        } else if (kind == PKV_KV_REMOVED) {
            p = pkv_mp_map(p, 4);
            p = PKV_MP_KEY(p, "type");
            p = PKV_MP_KEY(p, "BlockRemoved");
            p = PKV_MP_KEY(p, "block_hashes");
            p = pkv_mp_array(p, (uint64_t)pages);
            p = pkv_mp_hashes(p, u + i, pages, hash_bytes);
            i += pages;
            p = PKV_MP_KEY(p, "medium");
            p = pkv_mp_str(p, medium, medium_len);
            p = PKV_MP_KEY(p, "group_idx");
            *p++ = 0;
        } else {
            p = pkv_mp_map(p, 1);
            p = PKV_MP_KEY(p, "type");
            p = PKV_MP_KEY(p, "AllBlocksCleared");
        }
    }
    p = pkv_mp_uint(p, (uint64_t)rank);
    return (size_t)(p - out);
}

#endif
