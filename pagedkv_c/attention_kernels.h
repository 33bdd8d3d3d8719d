/* Paged attention kernels over a KV pool, with run-time SIMD dispatch.
 *
 * The C side computes one work item: the queries of one KV-head group of one
 * sequence (all query heads that share that KV head, for one or more
 * consecutive query tokens) against the pages of that sequence. The Cython
 * module `pagedkv_c._attention` builds the work items, spreads them over
 * OpenMP threads and owns all validation; nothing here allocates or checks.
 *
 * Pool layout (FlashInfer's NHD paged layout, one layer):
 *   pool[num_pages][2][page_size][num_kv_heads][head_dim], index 0 of axis 1
 *   is K, 1 is V. A head row is head_dim values in one of the page formats of
 *   page_formats.h: float32, IEEE float16 or bfloat16 (uint16_t), or int8 /
 *   int4 rows of pkv_row_bytes bytes with their scales. Quantized rows are
 *   decoded in registers (value = scale * level, the float32 product of the
 *   decoder); int4 rows hold R x, so the query is rotated once and the
 *   output rotated back.
 *
 * Mask: the query at position p attends to the cached key at position k iff
 *   k <= p and (window <= 0 or k >= p - window + 1 or k < sink_tokens)
 *   and (chunk_size <= 0 or k >= p - p % chunk_size)
 * (chunked attention, Llama 4: the keys of the query's own chunk of
 * chunk_size positions; never together with a window).
 *
 * Softcap (Gemma 2): with softcap > 0, every score scale * q.k becomes
 * softcap * tanh(scale * q.k / softcap) before the softmax.
 *
 * Sink logits (gpt-oss): with sink_logits set, query head h adds
 * exp(sink_logits[h]) to its softmax denominator (a key without a value
 * row); the LSE includes it.
 *
 * Sink queries: with q_sink set (and a window), the keys at positions
 * k < sink_tokens are scored with the row of q_sink instead of the row of q;
 * every other key with q. Rotary scores depend only on the distance between
 * the positions q and k were rotated to, so a q_sink rotated to another
 * position gives the sinks another distance (StreamingLLM's positions inside
 * the cache) while the stored keys keep their own rotation.
 *
 * Portable C99 outside the x86 dispatch section, which needs GCC or Clang.
 */
#ifndef PAGEDKV_ATTENTION_KERNELS_H
#define PAGEDKV_ATTENTION_KERNELS_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Largest supported head dimension (elements). */
#define PKV_MAX_HEAD_DIM 256
/* Most tokens scored together before one online-softmax update (float16
 * pools; float32 pools use half as many, as their rows are twice as long). */
#ifndef PKV_CHUNK_TOKENS
#define PKV_CHUNK_TOKENS 32
#endif
/* Most KV heads in one work item. */
#define PKV_MAX_ITEM_HEADS 64

/* Instruction-set paths, in increasing order of preference. */
typedef enum {
    PKV_ISA_SCALAR = 0,  /* portable C, any compiler and CPU */
    PKV_ISA_AVX2 = 1,    /* x86-64 AVX2 + FMA + F16C */
    PKV_ISA_AVX512 = 2   /* x86-64 AVX-512F + VL (+ AVX2, FMA, F16C) */
} pkv_isa;

/* Everything a work item reads, shared by all items of one call. */
typedef struct {
    const void *pool;              /* pool of one layer, layout above */
    int32_t format;                /* pkv_format of page_formats.h */
    int64_t page_size;             /* tokens per page */
    int64_t num_kv_heads;          /* Hkv */
    int64_t head_dim;              /* D, 1 <= D <= PKV_MAX_HEAD_DIM */
    int64_t group_size;            /* query heads per KV head, Hq / Hkv */
    const int32_t *indptr;         /* [B + 1] CSR offsets into indices */
    const int32_t *indices;        /* [nnz] page ids, position order */
    const int64_t *page_positions; /* [nnz] first token position per listed page */
    const int64_t *seq_lens;       /* [B] tokens appended so far */
    int64_t window;                /* W in tokens; <= 0 means full attention */
    int64_t sink_tokens;           /* S in tokens, used only with a window */
    int64_t chunk_size;            /* C in tokens; <= 0 means no chunk mask */
    float scale;                   /* multiplies q.k before the softmax */
    float softcap;                 /* > 0: scores capped by softcap * tanh(s / softcap);
                                      <= 0: no cap */
    const float *sink_logits;      /* [Hq] natural-log sink logit per query head (-inf:
                                      none), or NULL */
    const float *q;                /* [num_tokens, Hq, D] float32 queries */
    const float *q_sink;           /* [num_tokens, Hq, D] queries for the keys at
                                      positions < sink_tokens, or NULL: q for all */
    float *out;                    /* [num_tokens, Hq, D] float32 output */
    float *lse;                    /* [num_tokens, Hq] natural-log LSE, or NULL */
    /* Partition results of the items with partial >= 0 (split decode), else NULL: */
    float *part_acc;               /* [num_partials, Hq, D] sum of 2**(s - m) * v */
    float *part_max;               /* [num_partials, Hq] m, max score (log2 domain) */
    float *part_sum;               /* [num_partials, Hq] l, sum of 2**(s - m), with the
                                      kernel's states: NaN, -0.0 (admitted keys, all
                                      scored -inf), +0.0 (no key admitted) */
} pkv_attention_args;

/* One work item: tokens first_token .. first_token + num_tokens - 1 of q, at
 * positions first_position + i, all query heads of KV heads kv_head ..
 * kv_head + num_kv_heads - 1, reading the listed pages first_page ..
 * end_page - 1 of sequence seq (entries of indices, within indptr[seq] ..
 * indptr[seq + 1]). The KV heads of an item are computed independently of
 * each other (same arithmetic as one head per item); grouping them only
 * makes the item read each token's K/V row as one contiguous run.
 *
 * Split decode (Flash-Decoding, Dao et al. 2023; vLLM's paged_attention_v2):
 * an item with partial >= 0 reads one partition of a sequence's pages and
 * writes its unnormalized result to row partial + i of part_acc, part_max and
 * part_sum instead of out and lse; pkv_merge_partitions combines the
 * partitions of a query row afterwards. */
typedef struct {
    int64_t seq;
    int64_t kv_head;
    int64_t num_kv_heads;
    int64_t first_token;
    int64_t num_tokens;
    int64_t first_position;
    int64_t first_page;
    int64_t end_page;
    int64_t partial;   /* -1: final result to out and lse */
} pkv_work_item;

/* Computes one work item. next, if not NULL, is the item this thread will
 * most likely run next: the rows of its first chunk are prefetched while
 * the last chunk of this one is computed (only a hint; a wrong guess costs
 * speed, never results). scratch holds pkv_scratch_floats floats. */
typedef void (*pkv_item_kernel)(const pkv_attention_args *args, const pkv_work_item *item,
                                const pkv_work_item *next, float *scratch);

/* Floats of scratch one work item of at most max_rows (query, head) rows
 * needs (with room for the sink queries); rows = num_kv_heads * num_tokens *
 * group_size. */
int64_t pkv_scratch_floats(int64_t max_rows, int64_t head_dim);

/* Merge the num_partials partition results of query row head (0 <= head < Hq)
 * of token: part rows first_partial .. first_partial + num_partials - 1, in
 * that order, into out and lse (if not NULL) with the log-sum-exp rescaling,
 * M = max m_i, L = sum l_i 2**(m_i - M), out = sum acc_i 2**(m_i - M) / L, in
 * double. The result is what one pass over all the partitions' keys gives:
 * NaN if a partition met a NaN or +inf score or if the admitted keys all
 * score -inf, zeros and LSE -inf if no key is admitted; the inf and NaN that
 * V rows brought into a partition's sums reach the output. With sink_logits,
 * the row's sink term joins the denominator here, once, after the merge. */
void pkv_merge_partitions(const pkv_attention_args *args, int64_t token, int64_t head,
                          int64_t first_partial, int64_t num_partials);

/* Best path this CPU and build support. */
pkv_isa pkv_best_isa(void);
/* 1 if this CPU and build can run the path. */
int pkv_isa_available(pkv_isa isa);
/* 1 if the path scores int8 pages with integer dot products against the
 * query quantized per row to int8 (AVX-512 VNNI), 0 if in float32. */
int pkv_int8_integer_scores(pkv_isa isa);
/* Short lower-case name: "scalar", "avx2", "avx512". */
const char *pkv_isa_name(pkv_isa isa);
/* Item kernel of a path for a page format (pkv_format; path must be available). */
pkv_item_kernel pkv_get_kernel(pkv_isa isa, int format);

/* y[i] = tanh(x[i]) as the path's kernels compute it for the softcap (tests). */
void pkv_tanh_array(pkv_isa isa, const float *x, float *y, int64_t n);

#ifdef __cplusplus
}
#endif

#endif /* PAGEDKV_ATTENTION_KERNELS_H */
