"""PageMap: a fixed-capacity hash map from logical page index to page id.

A page table indexed densely by logical page needs memory proportional to the
largest token index ever seen. The classic ``PagedKVCache`` accepts any
non-negative int64 token index, so it maps logical pages to page ids through
this open-addressing table instead: memory is proportional to the number of
resident pages, and lookup, insert and remove are O(1) on average.
"""
import numpy as np

from pagedkv_c._types cimport page_id_t, int64_t, NO_PAGE
from pagedkv_c._checks cimport check_int
from libc.stdint cimport uint64_t

# Marks an unused table slot; logical page indices are never negative.
cdef enum:
    EMPTY_KEY = -1

# 2**64 / golden ratio: Knuth's multiplicative (Fibonacci) hashing constant.
# Multiplying spreads consecutive logical pages over the whole table, and the
# top bits of the product are the best mixed, so the slot is taken from them.
cdef uint64_t _FIBONACCI = 0x9E3779B97F4A7C15ULL

_INT64_MAX = 2**63 - 1
_INT32_MAX = 2**31 - 2


cdef class PageMap:
    """Map logical page index (int64, >= 0) -> page id (int32), at most ``capacity`` entries.

    Parameters
    ----------
    capacity : int
        Most entries held at once, ``1 <= capacity <= 2**31 - 2`` (in pages).
        The table has the smallest power-of-two length >= ``2 * capacity``,
        so its load factor never exceeds 1/2.

    Notes
    -----
    Open addressing with linear probing and Fibonacci hashing (Knuth, The Art
    of Computer Programming vol. 3, section 6.4). Removal uses backward-shift
    deletion (Knuth's Algorithm R): the entries after the removed one that
    probed past it are moved back, so the table never holds tombstones and a
    lookup stops at the first empty slot. Because the capacity is fixed and
    the table is at least twice as long, an insert always finds an empty slot
    and the table never grows.
    """

    def __cinit__(self, capacity):
        cdef Py_ssize_t cap = <Py_ssize_t>check_int(capacity, "capacity", 1, _INT32_MAX)
        cdef Py_ssize_t length = 2
        cdef int log2_length = 1
        while length < 2 * cap:
            length *= 2
            log2_length += 1
        self.capacity = cap
        self._num_entries = 0
        self._mask = length - 1
        self._shift = 64 - log2_length
        self._keys = np.full(length, EMPTY_KEY, dtype=np.int64)
        self._values = np.full(length, NO_PAGE, dtype=np.int32)

    # ------------------------------------------------------------------ C API
    # Counters are updated as `self.x = self.x + 1`, not `self.x += 1`: with the
    # debug build's nonecheck on, Cython rejects in-place operators on attributes
    # in nogil code.
    cdef Py_ssize_t home_slot(self, int64_t logical_page) noexcept nogil:
        """Slot where the probe for ``logical_page`` starts."""
        return <Py_ssize_t>((<uint64_t>logical_page * _FIBONACCI) >> self._shift)

    cdef Py_ssize_t find_slot(self, int64_t logical_page) noexcept nogil:
        """Slot holding ``logical_page``, or -1 when it is absent."""
        cdef Py_ssize_t slot = self.home_slot(logical_page)
        cdef int64_t key
        while True:
            key = self._keys[slot]
            if key == logical_page:
                return slot
            if key == EMPTY_KEY:
                return -1
            slot = (slot + 1) & self._mask

    cdef page_id_t lookup(self, int64_t logical_page) noexcept nogil:
        """Page id of ``logical_page``, or NO_PAGE when it is absent."""
        cdef Py_ssize_t slot = self.find_slot(logical_page)
        if slot < 0:
            return NO_PAGE
        return self._values[slot]

    cdef void insert(self, int64_t logical_page, page_id_t page_id) noexcept nogil:
        """Add an absent key (caller checked absence and that the map is not full)."""
        cdef Py_ssize_t slot = self.home_slot(logical_page)
        while self._keys[slot] != EMPTY_KEY:
            slot = (slot + 1) & self._mask
        self._keys[slot] = logical_page
        self._values[slot] = page_id
        self._num_entries = self._num_entries + 1

    cdef bint remove(self, int64_t logical_page) noexcept nogil:
        """Remove a key if present (backward-shift deletion); return whether it was."""
        cdef Py_ssize_t hole = self.find_slot(logical_page)
        if hole < 0:
            return False
        cdef Py_ssize_t slot = (hole + 1) & self._mask
        cdef Py_ssize_t home
        cdef int64_t key
        while True:
            key = self._keys[slot]
            if key == EMPTY_KEY:
                break
            home = self.home_slot(key)
            # The entry may fill the hole only if the hole lies on its probe
            # path, i.e. cyclically within [home, slot).
            if ((slot - home) & self._mask) >= ((slot - hole) & self._mask):
                self._keys[hole] = key
                self._values[hole] = self._values[slot]
                hole = slot
            slot = (slot + 1) & self._mask
        self._keys[hole] = EMPTY_KEY
        self._values[hole] = NO_PAGE
        self._num_entries = self._num_entries - 1
        return True

    cdef void remove_all(self) noexcept nogil:
        cdef Py_ssize_t slot
        for slot in range(self._mask + 1):
            self._keys[slot] = EMPTY_KEY
            self._values[slot] = NO_PAGE
        self._num_entries = 0

    # ------------------------------------------------------------- Python API
    def __len__(self):
        """Number of entries (in pages)."""
        return self._num_entries

    @property
    def table_length(self):
        """Length of the open-addressing table (in slots, a power of two)."""
        return self._mask + 1

    def find(self, logical_page):
        """Return the page id mapped from ``logical_page``, or -1 when absent.

        Raises
        ------
        TypeError, ValueError
            ``logical_page`` is not an integer in ``[0, 2**63 - 1]``.
        """
        cdef int64_t key = check_int(logical_page, "logical_page", 0, _INT64_MAX)
        return self.lookup(key)

    def assign(self, logical_page, page_id):
        """Map ``logical_page`` to ``page_id``, replacing any previous page id.

        Raises
        ------
        TypeError, ValueError
            ``logical_page`` is not an integer in ``[0, 2**63 - 1]`` or
            ``page_id`` not one in ``[0, 2**31 - 2]``.
        OverflowError
            The key is new and the map already holds ``capacity`` entries.
        """
        cdef int64_t key = check_int(logical_page, "logical_page", 0, _INT64_MAX)
        cdef page_id_t value = <page_id_t>check_int(page_id, "page_id", 0, _INT32_MAX)
        cdef Py_ssize_t slot = self.find_slot(key)
        if slot >= 0:
            self._values[slot] = value
            return
        if self._num_entries >= self.capacity:
            raise OverflowError(f"PageMap is full: it holds its capacity of {self.capacity} entries")
        self.insert(key, value)

    def discard(self, logical_page):
        """Remove ``logical_page`` if present; return True if it was.

        Raises
        ------
        TypeError, ValueError
            ``logical_page`` is not an integer in ``[0, 2**63 - 1]``.
        """
        cdef int64_t key = check_int(logical_page, "logical_page", 0, _INT64_MAX)
        return self.remove(key)

    def clear(self):
        """Remove every entry."""
        self.remove_all()

    def to_dict(self):
        """Return the entries as a ``dict`` {logical page index: page id}."""
        cdef Py_ssize_t slot
        out = {}
        for slot in range(self._mask + 1):
            if self._keys[slot] != EMPTY_KEY:
                out[self._keys[slot]] = self._values[slot]
        return out

    def check_invariants(self):
        """Verify the table; raise AssertionError naming the first bad slot.

        Checks: every key is non-negative, present once, and reachable from
        its home slot without crossing an empty slot; the entry count matches.
        """
        cdef Py_ssize_t slot, probe, count = 0
        cdef int64_t key
        seen = set()
        for slot in range(self._mask + 1):
            key = self._keys[slot]
            if key == EMPTY_KEY:
                if self._values[slot] != NO_PAGE:
                    raise AssertionError(f"slot {slot} is empty but holds page id {self._values[slot]}")
                continue
            if key < 0:
                raise AssertionError(f"slot {slot} holds negative key {key}")
            if key in seen:
                raise AssertionError(f"key {key} is stored twice")
            seen.add(key)
            count += 1
            probe = self.home_slot(key)
            while probe != slot:
                if self._keys[probe] == EMPTY_KEY:
                    raise AssertionError(
                        f"key {key} in slot {slot} is unreachable: empty slot {probe} on its probe path"
                    )
                probe = (probe + 1) & self._mask
        if count != self._num_entries:
            raise AssertionError(f"table holds {count} entries but the count is {self._num_entries}")
        if count > self.capacity:
            raise AssertionError(f"table holds {count} entries, more than its capacity {self.capacity}")

    def __repr__(self):
        return f"PageMap(capacity={self.capacity}, entries={self._num_entries})"
