"""Fixtures shared by the model tests: the llama.cpp reference data and SmolLM2-135M.

Both are session-scoped, so the model (about 6 s to load, 0.5 GB of float32 weights) is
read once for every test module. The model tests run NumPy's BLAS on one thread: on a
small shared machine a second BLAS thread made decode steps several times slower (see
pagedkv.models.threads), and one thread keeps the products bit-reproducible.
"""
import json
import time

import pytest
from hypothesis import settings

from _llama_support import REFERENCE_NAME, data_file_or_skip

# Property tests check results, not speed: on a loaded 2-core machine (CI, sanitizer builds)
# one example can take longer than hypothesis' default 200 ms deadline.
settings.register_profile("pagedkv", deadline=None)
settings.load_profile("pagedkv")


@pytest.fixture(scope="session")
def reference():
    """The llama.cpp reference outputs of SmolLM2-135M-Instruct (../shared/data)."""
    return json.loads(data_file_or_skip(REFERENCE_NAME).read_text())


@pytest.fixture(scope="session")
def one_blas_thread():
    """Limit NumPy's BLAS to one thread for the rest of the session."""
    pytest.importorskip("threadpoolctl", reason="threadpoolctl sets the BLAS thread count")
    from pagedkv.models.threads import blas_threads

    with blas_threads(1):
        yield


@pytest.fixture(scope="session")
def smollm2(one_blas_thread):
    """(LlamaModel, LlamaTokenizer) of SmolLM2-135M-Instruct, or a skip saying how to install it."""
    pytest.importorskip("gguf", reason="the gguf package is needed to read the model")
    pytest.importorskip("tokenizers", reason="the tokenizers package is needed for the vocabulary")
    from pagedkv.models import LlamaModel, find_smollm2_gguf

    try:
        path = find_smollm2_gguf()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    start = time.perf_counter()
    model, tokenizer = LlamaModel.from_gguf(path, num_threads=1)
    print(f"SmolLM2-135M loaded in {time.perf_counter() - start:.2f} s")
    return model, tokenizer
