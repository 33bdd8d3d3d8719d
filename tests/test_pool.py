"""PagePool against a plain-Python reference: an ordered free queue plus ref counts."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pagedkv import OutOfPagesError, PagePool


def snapshot(pool):
    return (
        pool.num_free,
        pool.free_pages().tolist(),
        [pool.ref_count(p) for p in range(pool.num_pages)],
    )


def test_allocation_order_is_least_recently_freed_first():
    pool = PagePool(6)
    assert pool.allocate(3).tolist() == [0, 1, 2]
    pool.free([2, 0])
    # Never-used pages 3..5 were "freed" at construction, before 2 and 0.
    assert pool.free_pages().tolist() == [3, 4, 5, 2, 0]
    assert pool.allocate(5).tolist() == [3, 4, 5, 2, 0]
    assert pool.num_free == 0
    pool.check_invariants()


def test_allocate_returns_int32_with_ref_count_one():
    pool = PagePool(4)
    ids = pool.allocate(2)
    assert ids.dtype == np.int32 and ids.shape == (2,)
    assert [pool.ref_count(int(p)) for p in ids] == [1, 1]
    assert pool.allocate(0).shape == (0,)


def test_shared_page_is_freed_only_by_its_last_reference():
    pool = PagePool(2)
    (page,) = pool.allocate(1)
    pool.incref([page, page])
    assert pool.ref_count(page) == 3
    pool.free([page])
    pool.free([page])
    assert pool.num_free == 1
    pool.free([page])
    assert pool.num_free == 2
    with pytest.raises(ValueError, match="not allocated"):
        pool.free([page])
    pool.check_invariants()


def test_out_of_pages_changes_nothing():
    pool = PagePool(3)
    pool.allocate(2)
    before = snapshot(pool)
    with pytest.raises(OutOfPagesError, match="^Cannot allocate 2 pages: only 1 of the 3 pages is free"):
        pool.allocate(2)
    assert issubclass(OutOfPagesError, MemoryError)
    assert snapshot(pool) == before


@pytest.mark.parametrize(
    "call, args, exc, match",
    [
        ("free", ([7],), ValueError, r"expected page ids in \[0, 3\], got 7"),
        ("free", ([-1],), ValueError, "got -1"),
        ("free", ([0, 0],), ValueError, "listed more than once"),
        ("free", ([0, 3],), ValueError, "page 3 is not allocated"),
        ("free", ([0.5],), TypeError, "expected integers"),
        ("free", (None,), TypeError, "page_ids"),
        ("incref", ("0",), TypeError, "page_ids"),
        ("free", ([[0]],), ValueError, "1-D"),
        ("incref", ([3],), ValueError, "page 3 is not allocated"),
        ("incref", ([4],), ValueError, "got 4"),
        ("allocate", (-1,), ValueError, "n"),
        ("allocate", (5,), ValueError, "n <= 4"),
        ("allocate", (1.0,), TypeError, "integer"),
        ("allocate", (True,), TypeError, "integer"),
        ("ref_count", (4,), ValueError, "page_id"),
    ],
)
def test_bad_input_raises_and_changes_nothing(call, args, exc, match):
    pool = PagePool(4)
    pool.allocate(3)
    pool.free([1])
    before = snapshot(pool)
    with pytest.raises(exc, match=match):
        getattr(pool, call)(*args)
    assert snapshot(pool) == before
    pool.check_invariants()


@pytest.mark.parametrize("num_pages", [0, -3, 2**31])
def test_bad_num_pages(num_pages):
    with pytest.raises(ValueError, match="num_pages"):
        PagePool(num_pages)


@given(st.integers(1, 40), st.data())
def test_free_order_matches_reference(num_pages, data):
    pool = PagePool(num_pages)
    queue = list(range(num_pages))  # reference free queue, head first
    held = []
    for _ in range(30):
        if held and data.draw(st.booleans()):
            chosen = data.draw(st.lists(st.sampled_from(held), unique=True, min_size=1))
            pool.free(chosen)
            for p in chosen:
                held.remove(p)
                queue.append(p)
        else:
            n = data.draw(st.integers(0, len(queue)))
            got = pool.allocate(n).tolist()
            assert got == queue[:n]
            held += got
            del queue[:n]
        assert pool.free_pages().tolist() == queue


class PoolMachine(RuleBasedStateMachine):
    """Random allocate/free/incref, failing calls included, against a reference."""

    def __init__(self):
        super().__init__()
        self.num_pages = 12
        self.pool = PagePool(self.num_pages)
        self.free_queue = list(range(self.num_pages))
        self.refs = {}

    @rule(n=st.integers(0, 14))
    def allocate(self, n):
        if n > len(self.free_queue):
            before = snapshot(self.pool)
            with pytest.raises((OutOfPagesError, ValueError)):
                self.pool.allocate(n)
            assert snapshot(self.pool) == before
            return
        got = self.pool.allocate(n).tolist()
        assert got == self.free_queue[:n]
        del self.free_queue[:n]
        for p in got:
            self.refs[p] = 1

    @rule(data=st.data())
    def free(self, data):
        ids = data.draw(st.lists(st.integers(-1, self.num_pages), max_size=4))
        valid = (
            all(p in self.refs for p in ids) and len(set(ids)) == len(ids)
        )
        if not valid:
            before = snapshot(self.pool)
            with pytest.raises(ValueError):
                self.pool.free(ids)
            assert snapshot(self.pool) == before
            return
        self.pool.free(ids)
        for p in ids:
            self.refs[p] -= 1
            if self.refs[p] == 0:
                del self.refs[p]
                self.free_queue.append(p)

    @precondition(lambda self: self.refs)
    @rule(data=st.data())
    def incref(self, data):
        ids = data.draw(st.lists(st.sampled_from(sorted(self.refs)), max_size=4))
        self.pool.incref(ids)
        for p in ids:
            self.refs[p] += 1

    @invariant()
    def matches_reference(self):
        self.pool.check_invariants()
        assert self.pool.num_free == len(self.free_queue)
        assert self.pool.free_pages().tolist() == self.free_queue
        for p in range(self.num_pages):
            assert self.pool.ref_count(p) == self.refs.get(p, 0)


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
