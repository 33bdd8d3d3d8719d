# Paged attention kernels over the KV pool: nogil entry points on raw arrays.
# The caller has validated every array (dtype, shape, contiguity, page ids in
# range, CSR offsets well formed); these functions only compute. They fail
# only when the per-thread scratch, the work items or the partition results of
# a split decode cannot be allocated (MemoryError).
from libc.stdint cimport int32_t, int64_t


cdef int paged_decode(
    const void* pool_layer,          # kv[layer]: (num_pages, 2, page_size, Hkv, E), C order
    int page_format,                 # pkv_format (page_formats.h): how a head row of E
                                     # elements holds D values
    int64_t page_size,               # tokens per page
    int64_t num_kv_heads,            # Hkv
    int64_t head_dim,                # D, 1 <= D <= 256
    int64_t num_qo_heads,            # Hq, a multiple of Hkv
    int64_t batch_size,              # B sequences
    const int32_t* indptr,           # shape (B + 1,): CSR offsets into indices
    const int32_t* indices,          # shape (nnz,): page ids, position order
    const int64_t* page_positions,   # shape (nnz,): first token position of each page
    const int64_t* seq_lens,         # shape (B,): tokens appended so far, >= 1
    int64_t window,                  # W in tokens; <= 0 means full attention
    int64_t sink_tokens,             # S in tokens, used only with a window
    int64_t chunk_size,              # C in tokens (chunked attention); <= 0: none
    float scale,                     # multiplies q.k before the softmax
    float softcap,                   # > 0: scores become softcap * tanh(score / softcap);
                                     # <= 0: no cap
    const float* sink_logits,        # shape (Hq,): natural-log sink logit per query head
                                     # (-inf: none), or NULL
    const float* q,                  # shape (B, Hq, D): one query per sequence
    const float* q_sink,             # shape (B, Hq, D): queries for the keys at positions
                                     # < sink_tokens, or NULL (q for every key)
    float* out,                      # shape (B, Hq, D): written
    float* lse,                      # shape (B, Hq): natural-log LSE, or NULL
    int num_threads,                 # OpenMP threads, >= 1
) except -1 nogil

cdef int paged_prefill(
    const void* pool_layer,          # as in paged_decode
    int page_format,
    int64_t page_size,
    int64_t num_kv_heads,
    int64_t head_dim,
    int64_t num_qo_heads,
    int64_t batch_size,
    const int32_t* indptr,
    const int32_t* indices,
    const int64_t* page_positions,
    const int64_t* seq_lens,         # shape (B,): includes the new tokens
    const int64_t* qo_indptr,        # shape (B + 1,): query rows of sequence b are
                                     # qo_indptr[b] .. qo_indptr[b+1]-1, its last positions
    int64_t window,
    int64_t sink_tokens,
    int64_t chunk_size,
    float scale,
    float softcap,
    const float* sink_logits,        # shape (Hq,) or NULL, as in paged_decode
    const float* q,                  # shape (T, Hq, D), T = qo_indptr[B]
    const float* q_sink,             # shape (T, Hq, D) or NULL, as in paged_decode
    float* out,                      # shape (T, Hq, D): written
    float* lse,                      # shape (T, Hq) or NULL
    int num_threads,
) except -1 nogil
