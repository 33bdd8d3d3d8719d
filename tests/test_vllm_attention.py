"""pagedkv.vllm.PagedAttentionBackend: pagedkv's paged attention as vLLM's CPU attention backend.

In real vLLM instances (each in its own process: this file run as a script, ``build`` makes a
model, ``run`` one instance), greedy float32 tokens with ``PAGEDKV_VLLM_ATTENTION=1`` equal
those of vLLM's native CPU attention, for one batch of prompts of different lengths: some
share a prefix with a prompt run before (prefix-cache hits, queries that start
mid-sequence), one is longer than the chunked-prefill budget (``max_num_batched_tokens``), and
the batch mixes prefills and decodes. Models: a random-weight 2-layer Llama (GQA) and a
Mistral-style model whose sliding window (40 tokens) is shorter than the prompts, both with
``initializer_range=0.4`` so that the output depends on the context (checked). One engine
per model and backend, the two backends of a model side by side.

In process: one layer's output for a mixed batch (decode, prefill, prefix hit, chunk) against
float64 dense attention over the same K/V, with and without a window, soft-capping and sinks;
the plugin's switch; refusals.

Skips, saying why, when vLLM or transformers is missing; with ``PAGEDKV_REQUIRE_VLLM=1`` (CI)
a missing piece is a failure instead.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))

from _vllm_support import (  # noqa: E402
    build_tiny_model,
    finish_instance,
    instance_env,
    missing_vllm,
    start_instance,
)

BLOCK = 32
MAX_TOKENS = 8
BUDGET = 128      # max_num_batched_tokens: LONG is prefilled in chunks

# Token ids < 512 (the models' vocabulary).
A = [(i * 37 + 11) % 500 + 3 for i in range(150)]
A_EDIT = A[:3] + [(A[3] + 1) % 500 + 3] + A[4:]
A_LATE = A[:112] + [(A[112] + 1) % 500 + 3] + A[113:]   # within reach of the last tokens' windows
B = A[:100] + [(i * 13 + 1) % 450 + 20 for i in range(30)]      # shares 3 full blocks with A
C = [(i * 7 + 5) % 400 + 50 for i in range(5)]
LONG = [(i * 53 + 29) % 490 + 9 for i in range(300)]
# First A alone (its blocks enter the prefix cache), then one batch.
BATCHES = [[A], [B, C, LONG, A_EDIT, A, A_LATE]]


# ------------------------------------------------------------------ the instance processes
def _run_instance(spec_path, out_path):
    spec = json.loads(Path(spec_path).read_text())
    from vllm import LLM, SamplingParams
    llm = LLM(model=spec["model"], dtype="float32", max_model_len=512, enforce_eager=True,
              skip_tokenizer_init=True, block_size=BLOCK, kv_cache_memory_bytes=2**26, seed=0,
              max_num_batched_tokens=BUDGET, enable_prefix_caching=True)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, detokenize=False, ignore_eos=True)
    results = []
    for batch in spec["batches"]:
        outputs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        results.append([{"tokens": list(o.outputs[0].token_ids), "num_cached_tokens": o.num_cached_tokens}
                        for o in outputs])
    Path(out_path).write_text(json.dumps({"results": results}))


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if sys.argv[1] == "build":
        build_tiny_model(sys.argv[3], sys.argv[2])
    else:
        _run_instance(sys.argv[2], sys.argv[3])
    sys.exit(0)


# ------------------------------------------------------------------ the tests
import subprocess  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

REQUIRED = os.environ.get("PAGEDKV_REQUIRE_VLLM") == "1"
ANNOUNCEMENT = "PagedAttentionBackend replaces vLLM's CPU attention"

if missing_vllm():
    if REQUIRED:
        raise ImportError(f"PAGEDKV_REQUIRE_VLLM=1 but these are missing: {missing_vllm()}")
    pytest.skip(f"missing {', '.join(missing_vllm())}", allow_module_level=True)


@pytest.fixture(scope="module", params=["llama", "mistral"])
def runs(request, tmp_path_factory):
    """Both backends on one model: native vLLM CPU attention and pagedkv's, side by side."""
    kind = request.param
    tmp = tmp_path_factory.mktemp(f"vllm-attention-{kind}")
    model = tmp / kind
    subprocess.run([sys.executable, str(HERE), "build", kind, str(model)], check=True, env=instance_env(),
                   timeout=300)
    spec = {"model": str(model), "batches": BATCHES}
    started = [start_instance(HERE, tmp, "native", spec, instance_env(PAGEDKV_VLLM_ATTENTION="0")),
               start_instance(HERE, tmp, "pagedkv", spec, instance_env(PAGEDKV_VLLM_ATTENTION="1"))]
    found = {name: finish_instance(tmp, s)["results"] for name, s in zip(("native", "pagedkv"), started)}
    found["kind"] = kind
    found["logs"] = {name: (tmp / f"{name}.log").read_text() for name in ("native", "pagedkv")}
    return found


def _tokens(run):
    return [[r["tokens"] for r in batch] for batch in run]


def test_the_switch_selects_the_backend(runs):
    assert ANNOUNCEMENT in runs["logs"]["pagedkv"]
    assert ANNOUNCEMENT not in runs["logs"]["native"]


def test_model_output_depends_on_context(runs):
    # Otherwise wrong K/V would not change the tokens and the comparison could not see it.
    tokens = _tokens(runs["native"])
    assert tokens[1][5] != tokens[1][4]          # A_LATE against A
    assert len({tuple(t) for t in tokens[1][:4]}) == 4
    if runs["kind"] == "llama":
        assert tokens[1][3] != tokens[1][4]      # A_EDIT (its 4th token) against A
    else:
        # Token 3 is outside what the 2 windowed layers reach from the last tokens (2 x 40).
        assert tokens[1][3] == tokens[1][4]


def test_greedy_tokens_equal_native_cpu_attention(runs):
    assert _tokens(runs["pagedkv"]) == _tokens(runs["native"])


def test_prefix_cache_hits_happened(runs):
    # The batch ran queries that start mid-sequence: A reuses its 4 full blocks and, with full
    # attention, B and A_LATE the 3 they share with A (vLLM's sliding-window manager finds fewer
    # hits: it needs the blocks a window reaches, and released the older ones).
    cached = {name: [r["num_cached_tokens"] for r in runs[name][1]] for name in ("native", "pagedkv")}
    assert cached["pagedkv"] == cached["native"]
    assert cached["native"][4] == 4 * BLOCK
    if runs["kind"] == "llama":
        assert cached["native"] == [3 * BLOCK, 0, 0, 0, 4 * BLOCK, 3 * BLOCK]


# ------------------------------------------------------------------ in process
@pytest.fixture(scope="module")
def backend():
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")     # vLLM's and torch's imports warn about their own deprecations
        import pagedkv.vllm  # noqa: F401  (where vLLM finds the backend)
        import pagedkv.vllm_attention as module
        from vllm.v1.attention.backend import CommonAttentionMetadata
    return module, CommonAttentionMetadata


def _dense(q, keys, values, positions, scale, window, softcap, sinks):
    """float64 causal attention of queries at ``positions`` over keys at 0 .. len(keys) - 1."""
    hq, hkv = q.shape[1], keys.shape[1]
    k = np.repeat(keys.astype(np.float64), hq // hkv, axis=1)
    v = np.repeat(values.astype(np.float64), hq // hkv, axis=1)
    scores = np.einsum("thd,mhd->thm", q.astype(np.float64), k) * scale
    if softcap is not None:
        scores = softcap * np.tanh(scores / softcap)
    key_pos = np.arange(len(keys))[None, None, :]
    p = np.asarray(positions)[:, None, None]
    mask = key_pos <= p
    if window is not None:
        mask &= key_pos >= p - window + 1
    scores = np.where(mask, scores, -np.inf)
    top = scores.max(axis=-1, keepdims=True)
    extra = 0.0
    if sinks is not None:
        s = np.asarray(sinks, np.float64)[None, :, None]
        top = np.maximum(top, s)
        extra = np.exp(s - top)
    weights = np.exp(scores - top)
    return np.einsum("thm,mhd->thd", weights, v) / (weights.sum(axis=-1, keepdims=True) + extra)


def _step(module, common_cls, rng, ctx, new, window, *, hq=4, hkv=2, dim=32, page=16, num_blocks=64,
          softcap=None, sinks=None):
    """One layer and step: K/V of every position written through do_kv_cache_update, then forward.

    ``ctx[b]`` tokens are cached before the step, ``new[b]`` are its queries. Blocks are
    scattered; with a window, blocks wholly before the earliest query's window are replaced by
    block 0 (vLLM's null block), which holds NaN.
    """
    import torch
    from types import SimpleNamespace
    impl = module.PagedAttentionImpl(hq, dim, 0.17, hkv, None, window, "auto", softcap,
                                     sinks=None if sinks is None else torch.tensor(sinks, dtype=torch.float32))
    builder = module.PagedAttentionMetadataBuilder(SimpleNamespace(block_size=page, dtype=torch.float32), ["l0"],
                                                   None, torch.device("cpu"))
    kv_cache = torch.zeros((num_blocks, hkv, page, 2 * dim), dtype=torch.float32)
    seq_lens = [c + n for c, n in zip(ctx, new)]
    max_blocks = max(-(-s // page) for s in seq_lens) + 2
    ids = rng.permutation(np.arange(1, num_blocks))
    table = np.zeros((len(ctx), max_blocks), dtype=np.int32)
    used = 0
    for b, s in enumerate(seq_lens):
        k = -(-s // page)
        table[b, :k] = ids[used:used + k]
        used += k
    keys = [rng.standard_normal((s, hkv, dim)).astype(np.float32) for s in seq_lens]
    values = [rng.standard_normal((s, hkv, dim)).astype(np.float32) for s in seq_lens]
    # Everything, with a padding row, as vLLM's slot mapping gives it.
    slots = np.concatenate([table[b, np.arange(s) // page] * page + np.arange(s) % page
                            for b, s in enumerate(seq_lens)] + [[-1]])
    all_k = torch.from_numpy(np.concatenate(keys + [np.zeros((1, hkv, dim), np.float32)]))
    all_v = torch.from_numpy(np.concatenate(values + [np.zeros((1, hkv, dim), np.float32)]))
    impl.do_kv_cache_update(None, all_k, all_v, kv_cache, torch.from_numpy(slots))
    if window is not None:
        kv_cache[0] = float("nan")
        for b, c in enumerate(ctx):
            table[b, :max(c - window + 1, 0) // page] = 0
    qo = np.concatenate([[0], np.cumsum(new)]).astype(np.int32)
    q = rng.standard_normal((int(qo[-1]) + 2, hq, dim)).astype(np.float32)   # 2 padding rows
    common = common_cls(
        query_start_loc=torch.from_numpy(qo), query_start_loc_cpu=torch.from_numpy(qo),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), num_reqs=len(ctx), num_actual_tokens=int(qo[-1]),
        max_query_len=int(max(new)), max_seq_len=int(max(seq_lens)), block_table_tensor=torch.from_numpy(table),
        slot_mapping=torch.zeros(int(qo[-1]), dtype=torch.int64))
    metadata = builder.build(0, common)
    output = torch.full((q.shape[0], hq, dim), 7.0)
    impl.forward(None, torch.from_numpy(q), None, None, kv_cache, metadata, output)
    out = output.numpy()
    for b in range(len(ctx)):
        rows = slice(int(qo[b]), int(qo[b + 1]))
        want = _dense(q[rows], keys[b], values[b], range(ctx[b], seq_lens[b]), 0.17, window, softcap, sinks)
        np.testing.assert_allclose(out[rows], want, atol=2e-5, rtol=0)
    assert (out[int(qo[-1]):] == 7.0).all()      # padding rows untouched


@pytest.mark.parametrize("window", [None, 8, 21])
@pytest.mark.parametrize("options", [{}, {"softcap": 3.0, "sinks": [0.5, -1.0, 2.0, -np.inf]}])
def test_mixed_step_matches_dense_attention(backend, window, options):
    module, common_cls = backend
    rng = np.random.default_rng(5)
    # decode, prefill from scratch, prefix hit (queries start mid-block), a chunk of a long prompt
    _step(module, common_cls, rng, ctx=[37, 0, 33, 50], new=[1, 20, 10, 7], window=window, **options)


@pytest.mark.parametrize("window", [None, 8])
def test_decode_step_matches_dense_attention(backend, window):
    module, common_cls = backend
    rng = np.random.default_rng(6)
    _step(module, common_cls, rng, ctx=[37, 0, 15, 64, 5], new=[1, 1, 1, 1, 1], window=window)


@pytest.mark.parametrize("args, named", [
    ({"alibi_slopes": [1.0, 0.5, 0.25, 0.125]}, "ALiBi"),
    ({"kv_cache_dtype": "fp8"}, "fp8"),
    ({"attn_type": "encoder_decoder"}, "cross attention"),
    ({"kv_sharing_target_layer_name": "model.layers.0.self_attn.attn"}, "KV sharing"),
])
def test_unsupported_features_are_refused_by_name(backend, args, named):
    module, _ = backend
    with pytest.raises(NotImplementedError, match=named):
        module.PagedAttentionImpl(4, 32, 0.17, 2, **args)


def test_switch_registers_the_override_only_when_set(backend, monkeypatch):
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from pagedkv import _vllm_plugin
    native = AttentionBackendEnum.CPU_ATTN.get_path()
    try:
        monkeypatch.delenv("PAGEDKV_VLLM_ATTENTION", raising=False)
        _vllm_plugin.register()
        assert AttentionBackendEnum.CPU_ATTN.get_path() == native
        monkeypatch.setenv("PAGEDKV_VLLM_ATTENTION", "1")
        _vllm_plugin.register()
        assert AttentionBackendEnum.CPU_ATTN.get_path() == "pagedkv.vllm.PagedAttentionBackend"
        assert AttentionBackendEnum.CPU_ATTN.get_class().__name__ == "PagedAttentionBackend"
        monkeypatch.setenv("PAGEDKV_VLLM_ATTENTION", "maybe")
        with pytest.raises(ValueError, match="PAGEDKV_VLLM_ATTENTION"):
            _vllm_plugin.register()
    finally:
        AttentionBackendEnum.CPU_ATTN.clear_override()


def test_entry_point_is_registered():
    from importlib.metadata import entry_points
    points = [e for e in entry_points(group="vllm.general_plugins") if e.value == "pagedkv._vllm_plugin:register"]
    assert points, "pagedkv's vllm.general_plugins entry point is not installed (pip install pagedkv)"
