"""The small-batch matrix-product kernel (pagedkv_c._matmul) against float64 NumPy.

Every SIMD path the CPU has (and the portable one) is checked on random shapes,
including every row count from 1 to 70, counts around the slabs of 128 rows, and
sizes that are not multiples of the kernel's tiles (up to 8 rows, 4 outputs, 8 or
16 lanes, blocks of 64 columns), in both weight layouts. A row's result must not depend on the other rows of the batch
nor on the thread count (bit for bit), and bad arguments are refused before
anything is computed.
"""
import contextlib
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from pagedkv_c import _matmul

AVAILABLE_ISAS = _matmul.kernel_info()["available_isas"]


@contextlib.contextmanager
def kernel_path(isa):
    """Run the kernel on the SIMD path ``isa`` inside the block."""
    previous = _matmul._set_isa(isa)
    try:
        yield
    finally:
        _matmul._set_isa(previous)


def check_product(x, w, transpose_w, num_threads=1):
    """Kernel result against float64 x @ w (or x @ w.T), within float32 rounding of |x| @ |w|."""
    got = _matmul.matmul(x, w, transpose_w=transpose_w, num_threads=num_threads)
    w64 = w.astype(np.float64).T if transpose_w else w.astype(np.float64)
    want = x.astype(np.float64) @ w64
    # Bound of a float32 sum of k products: k * eps * sum |x_i w_i| (generous by far for random data).
    bound = np.abs(x).astype(np.float64) @ np.abs(w64) * (x.shape[1] + 2) * np.finfo(np.float32).eps
    assert got.dtype == np.float32 and got.shape == want.shape and got.flags.c_contiguous
    assert np.all(np.abs(got - want) <= bound + 1e-30)
    return got


@pytest.mark.parametrize("isa", AVAILABLE_ISAS)
@pytest.mark.parametrize("transpose_w", [False, True])
def test_every_row_count_up_to_70_matches_float64(isa, transpose_w):
    rng = np.random.default_rng(70)
    k, n = 37, 131  # k: 2 lanes of 16 + 5; n: 2 blocks of 64 + 3, 32 groups of 4 + 3
    w = rng.standard_normal((n, k) if transpose_w else (k, n), dtype=np.float32)
    with kernel_path(isa):
        for m in range(1, 71):
            check_product(rng.standard_normal((m, k), dtype=np.float32), w, transpose_w)


@pytest.mark.parametrize("isa", AVAILABLE_ISAS)
@settings(max_examples=40, deadline=None)
@given(m=st.integers(1, 70), k=st.integers(1, 200), n=st.integers(1, 300), transpose_w=st.booleans(),
       threads=st.integers(1, 3), seed=st.integers(0, 2**32 - 1))
def test_random_shapes_match_float64_and_rows_are_independent(isa, m, k, n, transpose_w, threads, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k), dtype=np.float32)
    w = rng.standard_normal((n, k) if transpose_w else (k, n), dtype=np.float32)
    with kernel_path(isa):
        got = check_product(x, w, transpose_w)
        # Bit for bit: the same rows alone, another batch around them, other thread counts.
        row = int(rng.integers(0, m))
        alone = _matmul.matmul(x[row:row + 1].copy(), w, transpose_w=transpose_w)
        assert np.array_equal(alone[0], got[row])
        assert np.array_equal(_matmul.matmul(x, w, transpose_w=transpose_w, num_threads=threads), got)
        assert np.array_equal(_matmul.matmul(x[::-1].copy(), w, transpose_w=transpose_w), got[::-1])


@pytest.mark.parametrize("isa", AVAILABLE_ISAS)
def test_model_sized_products_match_float64(isa):
    """The shapes of a SmolLM2-135M decode step (576 = 36 x 16 lanes, 1536, 960, 3072 outputs)."""
    rng = np.random.default_rng(135)
    with kernel_path(isa):
        for k, n in [(576, 960), (1536, 576), (576, 3072)]:
            w = rng.standard_normal((n, k), dtype=np.float32)
            for m in (1, 4, 16):
                x = rng.standard_normal((m, k), dtype=np.float32)
                got = check_product(x, w, True, num_threads=2)
                assert np.array_equal(got, _matmul.matmul(x, np.ascontiguousarray(w), transpose_w=True))


@pytest.mark.parametrize("isa", AVAILABLE_ISAS)
def test_every_row_of_up_to_20_rows_equals_the_row_alone(isa):
    """nt splits the rows into tiles of equal size (up to 8 rows on AVX-512, 3 on AVX2) and
    prefetches the weights ahead within each thread's columns: whatever tile a row falls in,
    and on 1 or 2 threads, its outputs are those of the row alone, bit for bit."""
    rng = np.random.default_rng(20)
    k, n = 83, 301  # 5 lanes of 16 + 3; 4 blocks of 64 + 45, 75 groups of 4 + 1
    w = rng.standard_normal((n, k), dtype=np.float32)
    x = rng.standard_normal((20, k), dtype=np.float32)
    with kernel_path(isa):
        alone = np.concatenate([_matmul.matmul(x[i:i + 1].copy(), w, transpose_w=True) for i in range(20)])
        check_product(x, w, True)
        for m in range(1, 21):
            for threads in (1, 2):
                got = _matmul.matmul(x[:m].copy(), w, transpose_w=True, num_threads=threads)
                assert np.array_equal(got, alone[:m]), (m, threads)


@pytest.mark.parametrize("isa", AVAILABLE_ISAS)
def test_row_counts_around_the_slabs_of_128_rows(isa):
    """Long products run in slabs of 128 rows: rows on both sides of a slab boundary."""
    rng = np.random.default_rng(128)
    w = rng.standard_normal((70, 45), dtype=np.float32)
    with kernel_path(isa):
        for m in (127, 128, 129, 300):
            x = rng.standard_normal((m, 45), dtype=np.float32)
            got = check_product(x, w, True, num_threads=2)
            assert np.array_equal(got[129:130] if m > 129 else got[-1:],
                                  _matmul.matmul(x[129:130].copy() if m > 129 else x[-1:].copy(), w, transpose_w=True))


def test_special_values_propagate_like_ieee():
    x = np.ones((2, 20), np.float32)
    x[1, 3] = np.inf
    w = np.ones((3, 20), np.float32)
    w[2, 7] = np.nan
    got = _matmul.matmul(x, w, transpose_w=True)
    assert got[0, 0] == 20 and got[0, 1] == 20 and np.isnan(got[0, 2])
    assert np.isposinf(got[1, 0]) and np.isposinf(got[1, 1]) and np.isnan(got[1, 2])
    assert _matmul.matmul(np.zeros((0, 5), np.float32), np.ones((5, 3), np.float32)).shape == (0, 3)
    assert np.array_equal(_matmul.matmul(np.ones((2, 0), np.float32), np.ones((0, 3), np.float32)), np.zeros((2, 3)))


def test_kernel_info_names_the_paths():
    info = _matmul.kernel_info()
    assert info["isa"] in info["available_isas"] and "scalar" in info["available_isas"]
    assert info["block_cols"] == 64 and info["max_threads"] >= 1
    with pytest.raises(ValueError, match="Invalid value of name"):
        _matmul._set_isa("sse9")


@pytest.mark.parametrize(
    ("x", "w", "kwargs", "error", "message"),
    [
        ([[1.0]], np.ones((1, 1), np.float32), {}, TypeError, "Invalid type of x: expected numpy.ndarray, got list"),
        (np.ones((2, 3), np.float64), np.ones((3, 4), np.float32), {}, TypeError,
         "Invalid dtype of x: expected float32 .*, got float64"),
        (np.ones((2, 3), np.float32), np.ones((3, 4), np.float16), {}, TypeError,
         "Invalid dtype of w: expected float32 .*, got float16"),
        (np.ones((2, 3), np.dtype(">f4")), np.ones((3, 4), np.float32), {}, TypeError, "Invalid dtype of x"),
        (np.ones(3, np.float32), np.ones((3, 4), np.float32), {}, ValueError,
         r"Invalid shape of x: expected a 2-D array, got shape \(3,\)"),
        (np.ones((3, 2), np.float32).T, np.ones((3, 4), np.float32), {}, ValueError,
         "Invalid layout of x: expected a C-contiguous"),
        (np.ones((2, 3), np.float32), np.ones((4, 3), np.float32).T, {}, ValueError,
         "Invalid layout of w: expected a C-contiguous"),
        (np.ones((2, 3), np.float32), np.ones((4, 4), np.float32), {}, ValueError,
         r"Invalid shape of w: expected \(3, N\) to match x of shape \(2, 3\), got \(4, 4\)"),
        (np.ones((2, 3), np.float32), np.ones((3, 4), np.float32), {"transpose_w": True}, ValueError,
         r"Invalid shape of w: expected \(N, 3\) .*\(transpose_w\), got \(3, 4\)"),
        (np.ones((2, 3), np.float32), np.ones((3, 4), np.float32), {"num_threads": 0}, ValueError,
         "Invalid value of num_threads: expected 1 <= num_threads <= 1024, got 0"),
        (np.ones((2, 3), np.float32), np.ones((3, 4), np.float32), {"num_threads": 2.0}, TypeError,
         "Invalid type of num_threads: expected an integer"),
    ],
)
def test_bad_arguments_are_refused_with_their_name(x, w, kwargs, error, message):
    with pytest.raises(error, match=message):
        _matmul.matmul(x, w, **kwargs)


def test_misaligned_arrays_are_refused():
    buffer = np.zeros(2 * 3 + 1, np.float32).view(np.uint8)[2:2 + 24]
    x = buffer.view(np.float32).reshape(2, 3)
    assert not x.flags.aligned
    with pytest.raises(ValueError, match="Invalid layout of x"):
        _matmul.matmul(x, np.ones((3, 4), np.float32))


FORK_AFTER_TEAM = """
import os, signal, sys, numpy as np
from pagedkv import KVCache, attention
from pagedkv_c import _matmul
x = np.ones((3, 70), np.float32)
w = np.arange(70 * 300, dtype=np.float32).reshape(300, 70) / 1000
if sys.argv[1] == "attention":  # the team ran in the other module of the same OpenMP runtime
    cache = KVCache(num_layers=1, num_kv_heads=2, head_dim=64, num_pages=64, page_size=16)
    cache.add_sequence(0); cache.add_sequence(1)
    slots = cache.append([0, 1], [100, 100])
    kv = np.ones((200, 2, 64), np.float32)
    cache.store(0, slots, kv, kv)
    attention.decode(np.ones((2, 4, 64), np.float32), cache, 0, [0, 1], num_threads=2)
parent = _matmul.matmul(x, w, transpose_w=True, num_threads=2)
pid = os.fork()
if pid == 0:
    signal.alarm(60)  # a hung child dies of SIGALRM
    child = _matmul.matmul(x, w, transpose_w=True, num_threads=2)
    ok = np.array_equal(child, parent) and _matmul.kernel_info()["max_threads"] == 1
    os._exit(0 if ok else 3)
_, status = os.waitpid(pid, 0)
print("signal", os.WTERMSIG(status) if os.WIFSIGNALED(status) else "exit", os.WEXITSTATUS(status))
"""


@pytest.mark.skipif(not _matmul.kernel_info()["openmp"] or not hasattr(os, "fork") or
                    _matmul.kernel_info()["max_threads"] < 2, reason="needs OpenMP with 2 threads and os.fork")
@pytest.mark.parametrize("team_in", ["matmul", "attention"])
def test_a_child_forked_after_a_multithreaded_call_runs_on_one_thread(team_in):
    """GNU OpenMP's pool does not survive fork: a child runs the kernel on one thread."""
    got = subprocess.run([sys.executable, "-P", "-c", FORK_AFTER_TEAM, team_in], capture_output=True,
                         text=True, check=True, timeout=120).stdout.strip()
    assert got == "signal exit 0"
