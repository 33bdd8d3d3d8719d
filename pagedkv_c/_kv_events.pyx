"""KV events of the prefix cache: the bounded C log and its conversion to Python.

The core records one event per page that enters the prefix index
(``BlockStored``), per cached page that leaves it (``BlockRemoved``: evicted
when the allocator hands the page out again, or dropped from the index
because its content is about to change) and per reset of the index
(``AllBlocksCleared``), in the order they happen, into a bounded C log
(``kv_events.h``). The event kinds and fields are those of vLLM's KV events
(``vllm/distributed/kv_events.py``); :mod:`pagedkv.events` encodes them for
the wire.
"""

cdef class KVEventLog:
    """Bounded, ordered log of prefix-cache events of one :class:`KVCache`.

    Made by ``KVCache(..., enable_kv_events=True)``; read it through
    :meth:`KVCache.take_kv_events`.

    Parameters
    ----------
    capacity : int
        Most events kept between two drains, ``1 <= capacity <= 2**31``. The
        log grows by doubling up to it (40 bytes per event, plus ``4 *
        page_size`` bytes of token ids per stored page).
    page_size : int
        Tokens per page, ``>= 1``.

    Notes
    -----
    A full log drops new events and counts them; recording never blocks.
    """

    def __cinit__(self, int64_t capacity, int64_t page_size):
        if not 1 <= capacity <= 2**31:
            raise ValueError(f"Invalid value of kv_events_capacity: expected 1 <= kv_events_capacity <= 2**31, "
                             f"got {capacity}")
        if page_size < 1:
            raise ValueError(f"Invalid value of page_size: expected >= 1, got {page_size}")
        self.log.capacity = capacity
        self.log.page_size = page_size

    def __dealloc__(self):
        pkv_kv_events_free(&self.log)

    @property
    def capacity(self):
        """Most events kept between two drains (int)."""
        return self.log.capacity

    @property
    def num_pending(self):
        """Events recorded since the last drain (int)."""
        return self.log.count

    @property
    def total_recorded(self):
        """Events recorded over the cache's life (int), dropped ones excluded."""
        return self.log.total_recorded

    @property
    def total_dropped(self):
        """Events dropped because the log was full, over the cache's life (int)."""
        return self.log.total_dropped

    cdef tuple take(self):
        """The recorded events as Python tuples and the number dropped; clears both.

        Consecutive stored pages of one sequence become one ``BlockStored``
        with several hashes, consecutive removals one ``BlockRemoved``, as
        vLLM batches them.
        """
        cdef list events = []
        cdef Py_ssize_t i, t
        cdef pkv_kv_event* e
        cdef int previous = -1
        cdef int32_t* tok
        cdef list hashes, token_ids
        for i in range(self.log.count):
            e = &self.log.records[i]
            if e.kind == PKV_KV_STORED:
                h = (int(e.hi) << 64) | int(e.lo)
                if e.has_tokens:
                    tok = self.log.tokens + e.token_offset
                    ids = [tok[t] for t in range(self.log.page_size)]
                else:
                    ids = []
                if e.continues and previous == PKV_KV_STORED:
                    event = events[len(events) - 1]
                    (<list>event[1]).append(h)
                    (<list>event[3]).extend(ids)
                else:
                    parent = ((int(e.parent_hi) << 64) | int(e.parent_lo)) if e.has_parent else None
                    events.append(("BlockStored", [h], parent, ids, self.log.page_size))
            elif e.kind == PKV_KV_REMOVED:
                h = (int(e.hi) << 64) | int(e.lo)
                if previous == PKV_KV_REMOVED:
                    (<list>events[len(events) - 1][1]).append(h)
                else:
                    events.append(("BlockRemoved", [h]))
            else:
                events.append(("AllBlocksCleared",))
            previous = e.kind
        dropped = self.log.dropped
        pkv_kv_events_reset(&self.log)
        return events, dropped
