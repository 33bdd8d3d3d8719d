"""pagedkv._paged_requests: the row bookkeeping of pagedkv.transformers.PagedCache, without torch.

The end-to-end behaviour (models, generate, beams) is tested through PagedCache in
tests/test_transformers.py; here the bookkeeping runs alone on a small KVCache.
"""
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import pagedkv
from pagedkv._paged_requests import (
    PagedRequests,
    StepPages,
    check_prompts,
    default_num_pages,
)


def make_requests(num_pages=32, page_size=4, window=None, sink_tokens=0, positions="absolute", inv_freq=None,
                  enable_prefix_caching=False):
    requests = PagedRequests(window=window, sink_tokens=sink_tokens, positions=positions, inv_freq=inv_freq)
    requests.kv_cache = pagedkv.KVCache(2, 1, 4, num_pages, page_size=page_size, window=window,
                                        sink_tokens=sink_tokens, enable_prefix_caching=enable_prefix_caching)
    return requests


def never_same(row, source):
    return False


def test_module_imports_with_torch_and_transformers_blocked():
    code = textwrap.dedent("""
        import sys
        sys.modules["torch"] = None  # any import of torch raises ImportError
        sys.modules["transformers"] = None
        import pagedkv._paged_requests
        import pagedkv
        assert pagedkv._paged_requests.PagedRequests
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                            timeout=120, check=False)
    assert result.returncode == 0, result.stderr


def test_first_forward_adds_rows_and_stores_only_the_tokens_after_left_padding():
    requests = make_requests()
    # Row 0 is padded by 2 (transformers fills padding positions with 1), row 1 is not.
    positions = np.array([[1, 1, 0, 1, 2], [0, 1, 2, 3, 4]])
    assert requests.begin_step(2, 5, positions, never_same) is None
    assert requests.seq_ids == [0, 1]
    assert requests.counts.tolist() == [3, 5] and requests.stored.tolist() == [3, 5]
    assert requests.starts.tolist() == [2, 0]
    assert not requests.unpadded and not requests.dense_rows
    assert len(requests.slots) == 8
    assert requests.step_seq_ids.tolist() == [0, 1] and requests.step_seq_ids.dtype == np.int64
    assert requests.num_columns == 5 and requests.num_stored_tokens == 8
    assert [requests.kv_cache.seq_len(s) for s in requests.seq_ids] == [3, 5]
    # The next step continues each row at its own length; without position_ids at num_columns.
    requests.begin_step(2, 1, np.array([[3], [5]]), never_same)
    assert requests.unpadded and requests.dense_rows and requests.num_columns == 6
    requests.kv_cache.check_invariants()


def test_positions_that_do_not_continue_a_row_and_a_wrong_batch_size_raise():
    requests = make_requests()
    requests.begin_step(2, 3, None, never_same)
    with pytest.raises(ValueError, match="Invalid value of position_ids: row 0 holds 3 tokens"):
        requests.begin_step(2, 1, np.array([[4], [3]]), never_same)
    with pytest.raises(ValueError, match="Invalid shape of key_states: expected batch size 2"):
        requests.begin_step(3, 1, None, never_same)
    with pytest.raises(ValueError, match=r"Invalid shape of position_ids: expected \[2 or 1, 1\]"):
        requests.begin_step(2, 1, np.array([[3, 4]]), never_same)
    assert requests.num_columns == 3 and requests.num_stored_tokens == 6


def test_rows_that_repeat_an_earlier_row_share_its_pages():
    requests = make_requests()
    asked = []

    def same_keys(row, source):
        asked.append((row, source))
        return source == 0  # rows 1 and 2 repeat row 0

    requests.begin_step(3, 5, None, same_keys)
    assert requests.stored.tolist() == [5, 0, 0] and requests.counts.tolist() == [5, 5, 5]
    assert requests.unpadded and not requests.dense_rows
    assert requests.num_stored_tokens == 5 and len(requests.slots) == 5
    assert requests.kv_cache.stats()["pages_in_use"] == 2  # 5 tokens in pages of 4, shared by three rows
    assert [requests.kv_cache.seq_len(s) for s in requests.seq_ids] == [5, 5, 5]
    assert len(set(requests.seq_ids)) == 3 and (1, 0) in asked and (2, 0) in asked
    # Later forwards do not look for duplicates.
    asked.clear()
    requests.begin_step(3, 1, None, same_keys)
    assert asked == [] and requests.stored.tolist() == [1, 1, 1]


def test_crop_drops_the_newest_columns_and_never_the_left_padding():
    requests = make_requests()
    requests.begin_step(2, 4, np.array([[1, 1, 0, 1], [0, 1, 2, 3]]), never_same)
    with pytest.raises(ValueError, match="reaches the left padding"):
        requests.crop(-3)
    assert requests.num_columns == 4
    with pytest.raises(ValueError, match="expected an integer"):
        requests.crop(True)
    requests.crop(-1)
    assert requests.num_columns == 3 and [requests.kv_cache.seq_len(s) for s in requests.seq_ids] == [1, 3]
    requests.crop(2)  # a positive count is the number of columns to keep
    assert requests.num_columns == 2 and [requests.kv_cache.seq_len(s) for s in requests.seq_ids] == [0, 2]
    requests.crop(0)
    assert requests.num_columns == 2


def test_select_rows_forks_and_checks_indices_first():
    requests = make_requests()
    requests.begin_step(2, 3, np.array([[0, 1, 2], [1, 0, 1]]), never_same)
    ids = list(requests.seq_ids)
    requests.select_rows(np.arange(2))  # identity: nothing changes
    assert requests.seq_ids == ids
    with pytest.raises(ValueError, match=r"expected row indices in \[0, 2\)"):
        requests.select_rows(np.array([0, 2]))
    assert requests.seq_ids == ids
    requests.pages = StepPages(requests.kv_cache, requests.step_seq_ids)
    requests.select_rows(np.array([1, 1, 0]))
    assert requests.pages is None
    assert [requests.kv_cache.seq_len(s) for s in requests.seq_ids] == [2, 2, 3]
    # Row 0 keeps row 1's sequence, row 1 forks it, row 2 keeps row 0's sequence.
    assert requests.seq_ids[0] == ids[1] and requests.seq_ids[2] == ids[0]
    assert requests.seq_ids[1] not in ids
    requests.kv_cache.check_invariants()


def _store_step(requests, num_new, rng, batch_size=None):
    """One forward of ``num_new`` tokens on every row, with random K/V; returns what was stored."""
    requests.begin_step(batch_size or len(requests.seq_ids), num_new, None, never_same)
    kv = requests.kv_cache
    n = len(requests.slots)
    keys = rng.standard_normal((kv.num_layers, n, kv.num_kv_heads, kv.head_dim)).astype(kv.dtype)
    for layer in range(kv.num_layers):
        kv.store(layer, requests.slots, keys[layer], -keys[layer])
    return keys.reshape(kv.num_layers, len(requests.seq_ids), num_new, kv.num_kv_heads, kv.head_dim)


@pytest.mark.parametrize("indices", [
    [2, 0, 1],      # permutation: no fork, no removal
    [1, 1, 1],      # one source for every row
    [0, 1, 2, 2],   # identity prefix, then a repeat
    [2, 2, 0],      # a repeat, a dropped row
    [1],            # fewer rows
    [],             # no rows
])
def test_select_rows_keeps_each_rows_tokens_like_a_dense_index_select(indices):
    """The rows after select_rows hold the K/V of their sources, also after copy-on-write appends.

    The dense reference is what DynamicCache does: ``index_select`` of the rows.
    """
    rng = np.random.default_rng(0)
    requests = make_requests(num_pages=64)
    kv = requests.kv_cache
    dense = _store_step(requests, 6, rng, batch_size=3)  # [L, rows, tokens, H, D]; 6 tokens leave the last page half full
    source = np.array(indices, dtype=np.int64)
    added = kv.stats()["sequences_added"]
    requests.select_rows(source)
    forks = len(indices) - len(set(indices))
    assert kv.stats()["sequences_added"] - added == forks  # only repeated sources fork
    assert kv.stats()["num_sequences"] == len(indices)
    dense = dense[:, source]
    for _ in range(3):  # appends into pages shared by forks copy them first
        if not indices:
            break
        dense = np.concatenate([dense, _store_step(requests, 1, rng)], axis=2)
        for _ in range(2):
            requests.select_rows(source := rng.integers(0, len(indices), len(indices)))
            dense = dense[:, source]
    for row, seq_id in enumerate(requests.seq_ids):
        for layer in range(kv.num_layers):
            k, v, positions = kv.gather(layer, seq_id)
            np.testing.assert_array_equal(k, dense[layer, row])
            np.testing.assert_array_equal(v, -dense[layer, row])
            assert positions.tolist() == list(range(dense.shape[2]))
    kv.check_invariants()


def test_add_prompts_truncates_every_row_to_the_smallest_prefix_hit():
    requests = make_requests(enable_prefix_caching=True)
    ids, padded = check_prompts(np.arange(9)[None, :])
    assert not padded and requests.add_prompts(ids, padded) == 0
    requests.begin_step(1, 9, None, never_same)
    for layer in range(2):
        k = np.ones((9, 1, 4), dtype=np.float32)
        requests.kv_cache.store(layer, requests.slots, k, k)
    requests.reset()
    assert requests.seq_ids == [] and requests.num_columns == 0 and requests.slots is None
    prompts = np.stack([np.arange(10), np.r_[np.arange(5), np.arange(50, 55)]])
    ids, padded = check_prompts(prompts, np.ones_like(prompts))
    assert requests.add_prompts(ids, padded) == 4  # row 0 hits 8 tokens, row 1 one page of 4
    assert requests.num_columns == 4 and [requests.kv_cache.seq_len(s) for s in requests.seq_ids] == [4, 4]


def test_add_prompts_starts_every_row_cold_when_a_window_refuses_the_common_length():
    requests = make_requests(window=4, enable_prefix_caching=True)
    ids, padded = check_prompts(np.arange(17)[None, :])
    requests.add_prompts(ids, padded)
    requests.begin_step(1, 17, None, never_same)
    requests.reset()
    # Row 0 hits 16 tokens holding only the page its window needs (12-15), row 1 one page:
    # row 0 cannot go back to 4 tokens (its window released the keys), so both start cold.
    prompts = np.stack([np.arange(18), np.r_[np.arange(5), np.arange(50, 63)]])
    ids, padded = check_prompts(prompts, np.ones_like(prompts))
    assert requests.add_prompts(ids, padded) == 0
    assert requests.num_columns == 0 and [requests.kv_cache.seq_len(s) for s in requests.seq_ids] == [0, 0]
    assert requests.kv_cache.stats()["prefix_hits"] == 16 + 4  # served, then released
    requests.kv_cache.check_invariants()


def test_check_prompts_errors_and_padding():
    with pytest.raises(ValueError, match="Invalid shape of input_ids"):
        check_prompts(np.zeros((2, 0), dtype=np.int64))
    with pytest.raises(ValueError, match="Invalid shape of input_ids"):
        check_prompts(np.zeros((1, 3)))  # floats
    with pytest.raises(ValueError, match="Invalid shape of attention_mask"):
        check_prompts(np.zeros((1, 3), dtype=np.int64), np.ones((1, 2)))
    assert check_prompts([[1, 2, 3]], [[0, 1, 1]])[1] is True


def test_step_pages_reuses_its_export_only_for_its_own_seq_ids_array():
    requests = make_requests()
    requests.begin_step(2, 3, None, never_same)
    pages = StepPages(requests.kv_cache, requests.step_seq_ids)
    assert pages.page_table(requests.step_seq_ids) is pages.page_table(requests.step_seq_ids)
    assert pages.page_table(requests.step_seq_ids.copy()) is not pages.page_table(requests.step_seq_ids)
    assert (pages.page_size, pages.num_layers, pages.kv is requests.kv_cache.kv) == (4, 2, True)


def test_sink_query_rotation_turns_each_query_to_the_last_cache_position():
    inv_freq = np.array([1.0, 0.1])
    requests = make_requests(window=4, sink_tokens=2, positions="cache", inv_freq=inv_freq)
    assert requests.begin_step(1, 5, None, never_same) is None  # no query past S + W - 1 = 5
    cos, sin = requests.begin_step(1, 2, None, never_same)  # positions 5 and 6
    assert cos.shape == sin.shape == (2, 1, 2)
    angles = np.array([0, -1])[:, None] * inv_freq
    np.testing.assert_allclose(cos[:, 0], np.cos(angles))
    np.testing.assert_allclose(sin[:, 0], np.sin(angles))
    assert make_requests().sink_query_rotation(np.array([9]), np.array([1])) is None


def test_default_num_pages():
    assert default_num_pages(2, 10, 4, None, 0) == 2 * (3 + 1)
    # window 8, 2 sinks, page 4: 2 + 1 window pages, 1 sink page, plus a 10-token chunk (3 pages)
    assert default_num_pages(1, 10, 4, 8, 2) == 2 + 1 + 1 + 3 + 1
