# Page checksum of the K/V pool (page_checksum.h): XXH3-128 of each layer's
# page bytes, then the low 64 bits of XXH3-128 over those 16-byte digests.
# cimport these from sibling modules; page_checksums() is the checked Python entry.
from libc.stdint cimport int32_t, int64_t, uint8_t, uint64_t

cdef extern from "page_checksum.h":
    # Scratch bytes per layer that pkv_page_checksum needs (one canonical digest).
    const int PKV_CHECKSUM_DIGEST_BYTES
    # Checksum of page page_id; layer L of the pool at pool + L * layer_stride,
    # page p of a layer at p * page_bytes from there (bytes); scratch holds
    # 16 * num_layers bytes. page_id must be a page of the pool.
    uint64_t pkv_page_checksum(const uint8_t* pool, size_t layer_stride, size_t page_bytes,
                               int64_t num_layers, int64_t page_id, uint8_t* scratch) noexcept nogil
    # The same for n pages: out[i] is the checksum of page_ids[i].
    void pkv_page_checksums(const uint8_t* pool, size_t layer_stride, size_t page_bytes,
                            int64_t num_layers, const int32_t* page_ids, int64_t n,
                            uint64_t* out, uint8_t* scratch) noexcept nogil
