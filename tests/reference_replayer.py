"""Pure-Python reference of prefix-caching trace replay, for tests.

Written from the policy, not from the core: plain dicts and an OrderedDict,
page keys interned exactly (no hashing, so no collisions), every step spelled
out. The policy:

* The pool has ``num_pages`` pages; free pages wait in a queue, initially in
  id order. Allocation takes the head (least recently freed); a page that
  still carried a key loses it (an eviction). Freed pages join the tail.
* Page ``g`` of a prompt covers tokens ``[g * page_size, (g + 1) * page_size)``
  and lies in block ``g // pages_per_block`` at index ``g % pages_per_block``.
  Its key is the chain ``(key of page g - 1, block id, index)``, so equal keys
  mean equal block ids all the way from the start. Only full prompt pages
  (``g < P // page_size``) have keys.
* A request of ``P`` prompt and ``O`` output tokens is served the longest run
  of leading pages whose keys are cached, at most ``(P - 1) // page_size``
  pages (the last prompt token is always computed). Matched pages are taken
  (off the free queue if free).
* The request is admitted only if everything it needs fits at once: its new
  pages plus the matched pages that sit in the free queue must not exceed the
  free pages. Otherwise nothing changes (no match is taken, no counter moves).
* The prompt's new pages are taken first (all of them), then every full
  prompt page from the first unmatched one on gets its key, unless another
  page already holds that key (then it stays without one). Then the output's
  new pages are taken. Then the request ends: its pages are released from the
  last to the first, each reaching ref count 0 joining the free queue's tail.
"""
from __future__ import annotations

from collections import OrderedDict


class ReferenceReplayer:
    """Reference model of a page manager with prefix caching over external block ids.

    Parameters
    ----------
    num_pages : int
        Pages in the pool.
    page_size : int
        Tokens per page.
    block_tokens : int
        Tokens per block id, a multiple of ``page_size``.
    """

    def __init__(self, num_pages: int, page_size: int, block_tokens: int):
        assert block_tokens % page_size == 0
        self.page_size = page_size
        self.pages_per_block = block_tokens // page_size
        self.free = OrderedDict((page, None) for page in range(num_pages))  # first = next handed out
        self.ref_count = [0] * num_pages
        self.key_of_page: list[int | None] = [None] * num_pages
        self.page_of_key: dict[int, int] = {}
        self._interned: dict[tuple, int] = {}
        # Counters.
        self.num_requests = 0
        self.num_rejected = 0
        self.prompt_tokens = 0
        self.hit_tokens = 0
        self.pages_allocated = 0
        self.pages_matched = 0
        self.pages_freed = 0
        self.evictions = 0
        self.duplicate_keys = 0      # full pages left unkeyed because another page held the key
        self.cached_tokens: list[int] = []

    # ------------------------------------------------------------------ keys
    def _keys(self, block_ids, num_full_pages: int) -> list[int]:
        keys, parent = [], None
        for g in range(num_full_pages):
            link = (parent, int(block_ids[g // self.pages_per_block]), g % self.pages_per_block)
            parent = self._interned.setdefault(link, len(self._interned))
            keys.append(parent)
        return keys

    # ------------------------------------------------------------- allocator
    def _take_new(self) -> int:
        page, _ = self.free.popitem(last=False)
        key = self.key_of_page[page]
        if key is not None:
            del self.page_of_key[key]
            self.key_of_page[page] = None
            self.evictions += 1
        self.ref_count[page] = 1
        self.pages_allocated += 1
        return page

    def _release(self, page: int) -> None:
        self.ref_count[page] -= 1
        if self.ref_count[page] == 0:
            self.free[page] = None
        self.pages_freed += 1

    # --------------------------------------------------------------- request
    def run(self, prompt_tokens: int, output_tokens: int, block_ids) -> int:
        """Replay one request; return the tokens served from cache, -1 if rejected."""
        ps = self.page_size
        self.num_requests += 1
        prompt_pages = -(-prompt_tokens // ps)
        total_pages = -(-(prompt_tokens + output_tokens) // ps)
        keys = self._keys(block_ids, prompt_tokens // ps)
        matched = []
        for key in keys[:(prompt_tokens - 1) // ps]:
            page = self.page_of_key.get(key)
            if page is None:
                break
            matched.append(page)
        matched_free = sum(1 for page in matched if self.ref_count[page] == 0)
        if total_pages - len(matched) + matched_free > len(self.free):
            self.num_rejected += 1
            self.cached_tokens.append(-1)
            return -1

        pages = []
        for page in matched:
            if self.ref_count[page] == 0:
                del self.free[page]
            self.ref_count[page] += 1
            pages.append(page)
        self.pages_matched += len(matched)
        for _ in range(prompt_pages - len(matched)):
            pages.append(self._take_new())
        for g in range(len(matched), len(keys)):
            if keys[g] in self.page_of_key:
                self.duplicate_keys += 1
                continue
            self.page_of_key[keys[g]] = pages[g]
            self.key_of_page[pages[g]] = keys[g]
        for _ in range(total_pages - prompt_pages):
            pages.append(self._take_new())
        for page in reversed(pages):
            self._release(page)

        cached = len(matched) * ps
        self.prompt_tokens += prompt_tokens
        self.hit_tokens += cached
        self.cached_tokens.append(cached)
        return cached

    # ------------------------------------------------------------ inspection
    def free_queue(self) -> list[int]:
        """Free pages in hand-out order."""
        return list(self.free)

    def cached_pages(self) -> list[int]:
        """Pages that carry a key, increasing."""
        return sorted(self.page_of_key.values())
