"""PagePool.free/incref with int32 arrays (the C-checked fast path) behave as with lists."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from pagedkv import PagePool


def state(pool):
    return pool.num_free, pool.free_pages().tolist(), [pool.ref_count(p) for p in range(pool.num_pages)]


def outcome(pool, call, ids):
    """(exception type and message or None, state after the call)."""
    try:
        getattr(pool, call)(ids)
        error = None
    except (ValueError, TypeError) as exc:
        error = (type(exc), str(exc))
    return error, state(pool)


def make_pool(num_pages, num_allocated, num_shared):
    pool = PagePool(num_pages)
    held = pool.allocate(num_allocated)
    pool.incref(held[:num_shared])
    return pool


@settings(max_examples=300, deadline=None)
@given(
    num_pages=st.integers(1, 8),
    data=st.data(),
    call=st.sampled_from(["free", "incref"]),
)
def test_int32_array_and_list_give_the_same_result(num_pages, data, call):
    num_allocated = data.draw(st.integers(0, num_pages))
    num_shared = data.draw(st.integers(0, num_allocated))
    ids = data.draw(st.lists(st.integers(-2, num_pages + 1), max_size=6))
    via_list = make_pool(num_pages, num_allocated, num_shared)
    via_array = make_pool(num_pages, num_allocated, num_shared)
    assert outcome(via_array, call, np.array(ids, dtype=np.int32)) == outcome(via_list, call, ids)
    via_array.check_invariants()


def test_free_of_allocate_output_round_trips():
    pool = PagePool(5)
    for _ in range(3):
        ids = pool.allocate(5)
        pool.free(ids)
        assert pool.num_free == 5
    assert pool.free_pages().tolist() == [0, 1, 2, 3, 4]
    pool.check_invariants()


def test_duplicate_in_int32_array_is_rejected_in_every_call():
    pool = PagePool(3)
    ids = pool.allocate(2)
    twice = np.array([ids[0], ids[0]], dtype=np.int32)
    for _ in range(3):  # the duplicate marks of one call must not leak into the next
        with pytest.raises(ValueError, match="listed more than once"):
            pool.free(twice)
    pool.free(ids)
    assert pool.num_free == 3


def test_read_only_int32_array_is_accepted():
    pool = PagePool(2)
    ids = pool.allocate(2)
    ids.flags.writeable = False
    pool.incref(ids)
    pool.free(ids)
    pool.free(ids)
    assert pool.num_free == 2
