"""Pickling and copying the core objects: a TypeError that says what to use instead."""
import copy
import pickle

import pytest

from pagedkv import KVCache, PagedKVCache, PagePool


@pytest.mark.parametrize("make, hints", [
    (lambda: KVCache(num_layers=1, num_kv_heads=1, head_dim=2, num_pages=4), ["fork", "gather"]),
    (lambda: PagedKVCache(2, 2), ["get_many", "put_many"]),
    (lambda: PagePool(4), ["PagePool(num_pages)", "free_pages"]),
])
def test_pickle_and_copy_raise_a_type_error_that_says_what_to_do(make, hints):
    obj = make()
    name = type(obj).__name__
    for attempt in (pickle.dumps, lambda o: pickle.dumps(o, protocol=0), copy.copy, copy.deepcopy):
        with pytest.raises(TypeError, match=f"^{name} cannot be pickled or copied") as info:
            attempt(obj)
        assert all(hint in str(info.value) for hint in hints) and "__cinit__" not in str(info.value)
