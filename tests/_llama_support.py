"""Helpers shared by the model tests: where the reference data lives, and a tiny Llama GGUF."""
from pathlib import Path

import numpy as np
import pytest

REFERENCE_NAME = "smollm2_llamacpp_reference.json"
REPO_ROOT = Path(__file__).resolve().parents[1]


def shared_data_dir():
    """``<repo root>/../shared/data``, else the nearest ancestor's ``shared/data``, holding the reference."""
    for base in [REPO_ROOT.parent, *REPO_ROOT.parent.parents]:
        candidate = base / "shared" / "data"
        if (candidate / REFERENCE_NAME).is_file():
            return candidate
    return None


def find_data_file(filename):
    """Where the tests read a data file: ``<repo root>/../shared/data`` or the nearest ancestor's
    ``shared/data``, else the directory ``pagedkv data fetch`` writes to (``pagedkv.data.data_dir()``,
    ``$PAGEDKV_DATA_DIR`` if set); None if neither has it."""
    for base in [REPO_ROOT.parent, *REPO_ROOT.parent.parents]:
        candidate = base / "shared" / "data" / filename
        if candidate.is_file():
            return candidate
    from pagedkv import data

    candidate = data.data_dir() / filename
    return candidate if candidate.is_file() else None


def data_file_or_skip(filename):
    """:func:`find_data_file`, or a skip that names where it looked and how to get the file."""
    path = find_data_file(filename)
    if path is not None:
        return path
    from pagedkv import data

    names = [d.name for d in data.DATASETS.values() if d.filename == filename]
    how = (f"get it with `pagedkv data fetch {names[0]}`" if names else
           "it is not published: it comes with the project's shared data directory")
    pytest.skip(f"{filename} not found in {REPO_ROOT.parent / 'shared' / 'data'}, any ancestor's shared/data, "
                f"or {data.data_dir()} (the data directory, ${data.DATA_DIR_ENV} if set); {how}")


def _converter_permute(weight, num_heads):
    """llama.cpp convert_hf_to_gguf: interleave each head's two rotary halves."""
    rows, cols = weight.shape
    return weight.reshape(num_heads, 2, rows // num_heads // 2, cols).swapaxes(1, 2).reshape(rows, cols)


def write_tiny_llama(path, rng, *, arch="llama"):
    """Write a random tiny Llama to ``path`` as llama.cpp's converter would; return (config, HF weights)."""
    gguf = pytest.importorskip("gguf")
    cfg = dict(layers=2, hidden=32, ffn=48, heads=4, kv_heads=2, head_dim=8, vocab=50,
               base=500.0, eps=1e-5)
    hf = {"embed": rng.standard_normal((cfg["vocab"], cfg["hidden"])).astype(np.float32),
          "norm": (1 + 0.1 * rng.standard_normal(cfg["hidden"])).astype(np.float32), "layers": []}
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg["layers"])
    writer.add_context_length(64)
    writer.add_embedding_length(cfg["hidden"])
    writer.add_feed_forward_length(cfg["ffn"])
    writer.add_head_count(cfg["heads"])
    writer.add_head_count_kv(cfg["kv_heads"])
    writer.add_rope_freq_base(cfg["base"])
    writer.add_layer_norm_rms_eps(cfg["eps"])
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(cfg["vocab"])])
    writer.add_tensor("token_embd.weight", hf["embed"])
    writer.add_tensor("output_norm.weight", hf["norm"])
    h, d = cfg["hidden"], cfg["head_dim"]
    for i in range(cfg["layers"]):
        def mat(rows, cols):
            return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)
        layer = dict(q=mat(cfg["heads"] * d, h), k=mat(cfg["kv_heads"] * d, h),
                     v=mat(cfg["kv_heads"] * d, h), o=mat(h, cfg["heads"] * d),
                     gate=mat(cfg["ffn"], h), up=mat(cfg["ffn"], h), down=mat(h, cfg["ffn"]),
                     attn_norm=(1 + 0.1 * rng.standard_normal(h)).astype(np.float32),
                     ffn_norm=(1 + 0.1 * rng.standard_normal(h)).astype(np.float32))
        hf["layers"].append(layer)
        p = f"blk.{i}."
        writer.add_tensor(p + "attn_q.weight", _converter_permute(layer["q"], cfg["heads"]))
        writer.add_tensor(p + "attn_k.weight", _converter_permute(layer["k"], cfg["kv_heads"]))
        for name, key in (("attn_v", "v"), ("attn_output", "o"), ("ffn_gate", "gate"),
                          ("ffn_up", "up"), ("ffn_down", "down"), ("attn_norm", "attn_norm"),
                          ("ffn_norm", "ffn_norm")):
            writer.add_tensor(p + name + ".weight", layer[key])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return cfg, hf


def tiny_llama_path(tmp_path, seed=1):
    """Write a tiny random Llama GGUF (2 layers, 4 query / 2 KV heads of 8) and return its path."""
    path = tmp_path / "tiny.gguf"
    write_tiny_llama(path, np.random.default_rng(seed))
    return path
