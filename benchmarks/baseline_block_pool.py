"""Pure-Python prefix-caching page manager, built the way vLLM's v1 block pool is.

The baseline of ``bench_replay.py``. Its structure follows vLLM's Python
block pool (``vllm/v1/core/block_pool.py`` and ``kv_cache_utils.py``): one
``KVCacheBlock`` object per page with ``ref_cnt`` and ``block_hash``, a
``FreeKVCacheBlockQueue`` that links the block objects into a doubly linked
list (fake head and tail, O(1) removal from the middle), a dict from block
hash to cached block, and a Python hash call per page, chained on the
parent's hash.

The policy is pagedkv's, so that both produce identical hit counts on the
same trace: least recently freed first, a request's pages freed tail first,
at most ``(P - 1) // page_size`` pages served, and one cached page per hash
(a new full page whose hash is already cached stays uncached; vLLM keeps
duplicates, which changes which page is evicted later). Page hashes use the
same hash function as pagedkv (XXH3-128 from the ``xxhash`` package, or
SHA-256 truncated to 128 bits from ``hashlib``) over the same bytes per page:
parent hash, salt (zeros), block id, index of the page in its block, pages per block and a domain tag.
"""
from __future__ import annotations

import hashlib
import struct

import xxhash

_PAGE_KEY = struct.Struct("<qIIB")    # block id (int64), page index in the block, pages per block (uint32), tag 0x42
_ROOT_HASH = bytes(16)                # parent hash of a prompt's first page
_SALT = bytes(16)                     # no per-request salt


class KVCacheBlock:
    """Metadata of one page: id, reference count, hash when cached, free-queue links."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free_block", "next_free_block")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None
        self.prev_free_block: KVCacheBlock | None = None
        self.next_free_block: KVCacheBlock | None = None


class FreeKVCacheBlockQueue:
    """Free blocks as a doubly linked list of the block objects themselves.

    A deque cannot remove a block from the middle in O(1); a cached free
    block that a new request matches must leave the queue, hence the
    intrusive links. Order: the head is handed out next (least recently
    freed); freed blocks join the tail.
    """

    def __init__(self, blocks: list[KVCacheBlock]):
        self.num_free_blocks = len(blocks)
        self.head = KVCacheBlock(-1)  # fake head and tail: no branch for an empty list
        self.tail = KVCacheBlock(-1)
        previous = self.head
        for block in blocks:
            previous.next_free_block = block
            block.prev_free_block = previous
            previous = block
        previous.next_free_block = self.tail
        self.tail.prev_free_block = previous

    def popleft(self) -> KVCacheBlock:
        block = self.head.next_free_block
        if block is self.tail:
            raise ValueError("no free blocks")
        self.head.next_free_block = block.next_free_block
        block.next_free_block.prev_free_block = self.head
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1
        return block

    def remove(self, block: KVCacheBlock) -> None:
        block.prev_free_block.next_free_block = block.next_free_block
        block.next_free_block.prev_free_block = block.prev_free_block
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self.tail.prev_free_block
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = self.tail
        self.tail.prev_free_block = block
        self.num_free_blocks += 1

    def block_ids(self) -> list[int]:
        """Free block ids in hand-out order (for checks)."""
        out, block = [], self.head.next_free_block
        while block is not self.tail:
            out.append(block.block_id)
            block = block.next_free_block
        return out


class BlockPool:
    """Blocks, the free queue and the hash -> cached block map.

    Parameters
    ----------
    num_blocks : int
        Pages in the pool.
    """

    def __init__(self, num_blocks: int):
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached_block_hash_to_block: dict[bytes, KVCacheBlock] = {}
        self.num_evictions = 0

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get(block_hash)

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop ``num_blocks`` from the free queue's head, evicting cached ones."""
        if num_blocks > self.free_block_queue.num_free_blocks:
            raise ValueError(f"cannot get {num_blocks} free blocks from the pool")
        new_blocks = []
        for _ in range(num_blocks):
            block = self.free_block_queue.popleft()
            if block.block_hash is not None:
                self._evict_cached_block(block)
            block.ref_cnt = 1
            new_blocks.append(block)
        return new_blocks

    def _evict_cached_block(self, block: KVCacheBlock) -> None:
        del self.cached_block_hash_to_block[block.block_hash]
        block.block_hash = None
        self.num_evictions += 1

    def touch(self, blocks: list[KVCacheBlock]) -> None:
        """Take a reference to matched blocks, pulling free ones off the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def cache_full_blocks(self, blocks: list[KVCacheBlock], block_hashes: list[bytes],
                          num_cached_blocks: int, num_full_blocks: int) -> None:
        """Make blocks ``num_cached_blocks .. num_full_blocks - 1`` findable by hash."""
        table = self.cached_block_hash_to_block
        for i in range(num_cached_blocks, num_full_blocks):
            block_hash = block_hashes[i]
            if block_hash in table:  # one page per hash (pagedkv's policy)
                continue
            blocks[i].block_hash = block_hash
            table[block_hash] = blocks[i]

    def free_blocks(self, ordered_blocks) -> None:
        """Drop one reference per block; blocks reaching 0 join the queue's tail in the given order."""
        for block in ordered_blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)


def _sha256_128(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()[:16]


HASH_FUNCTIONS = {"xxh3_128": xxhash.xxh3_128_digest, "sha256": _sha256_128}


def hash_request_pages(block_ids: list[int], pages_per_block: int, num_full_pages: int,
                       hash_function=xxhash.xxh3_128_digest) -> list[bytes]:
    """Chained 128-bit hash of each full prompt page, one Python hash call per page."""
    hashes = []
    parent = _ROOT_HASH
    for page in range(num_full_pages):
        parent = hash_function(
            parent + _SALT + _PAGE_KEY.pack(block_ids[page // pages_per_block], page % pages_per_block, pages_per_block, 0x42))
        hashes.append(parent)
    return hashes


class PrefixCachingManager:
    """Per-request logic around the block pool: match, allocate, cache, free.

    Parameters
    ----------
    num_blocks : int
        Pages in the pool.
    block_size : int
        Tokens per page.
    block_tokens : int
        Tokens per external block id, a multiple of ``block_size``.
    hash_name : str
        ``"xxh3_128"`` or ``"sha256"``.
    """

    def __init__(self, num_blocks: int, block_size: int, block_tokens: int, hash_name: str = "xxh3_128"):
        self.block_pool = BlockPool(num_blocks)
        self.hash_function = HASH_FUNCTIONS[hash_name]
        self.block_size = block_size
        self.pages_per_block = block_tokens // block_size
        self.num_blocks = num_blocks
        self.blocks_allocated = 0
        self.blocks_matched = 0
        self.blocks_freed = 0
        self.prompt_tokens = 0
        self.hit_tokens = 0

    def get_computed_blocks(self, block_hashes: list[bytes], num_prompt_tokens: int) -> list[KVCacheBlock]:
        """Longest run of cached leading pages, never the page of the last prompt token."""
        computed = []
        get = self.block_pool.get_cached_block
        for block_hash in block_hashes[:(num_prompt_tokens - 1) // self.block_size]:
            block = get(block_hash)
            if block is None:
                break
            computed.append(block)
        return computed

    def replay_request(self, num_prompt_tokens: int, num_output_tokens: int, block_ids: list[int]) -> int:
        """Serve one request start to end; return the tokens served from cache, -1 if rejected."""
        bs = self.block_size
        total_blocks = -(-(num_prompt_tokens + num_output_tokens) // bs)
        if total_blocks > self.num_blocks:  # alone in the pool: it fits iff it fits the pool
            return -1
        pool = self.block_pool
        block_hashes = hash_request_pages(block_ids, self.pages_per_block, num_prompt_tokens // bs,
                                          self.hash_function)
        computed = self.get_computed_blocks(block_hashes, num_prompt_tokens)
        pool.touch(computed)
        prompt_blocks = -(-num_prompt_tokens // bs)
        blocks = computed + pool.get_new_blocks(prompt_blocks - len(computed))
        pool.cache_full_blocks(blocks, block_hashes, len(computed), len(block_hashes))
        blocks += pool.get_new_blocks(total_blocks - prompt_blocks)
        pool.free_blocks(reversed(blocks))
        self.blocks_matched += len(computed)
        self.blocks_allocated += total_blocks - len(computed)
        self.blocks_freed += total_blocks
        cached = len(computed) * bs
        self.prompt_tokens += num_prompt_tokens
        self.hit_tokens += cached
        return cached
