"""Fake-quantization study of KV page formats on SmolLM2-135M-Instruct (pagedkv's NumPy model).

K and V rows (one token, one KV head: head_dim=64 values, keys after RoPE) are quantized and
dequantized inside PagedBackend.store (monkeypatched here, not in the repository) before they
reach a float32 pool. The text is scored through the prefill path in chunks (all logits), so
every query reads the quantized K/V of every key it sees, its own token included, as a decode
step over a quantized cache would.

Metrics against a float32-cache reference run (same tokens, same window): perplexity, mean KL
divergence KL(p_ref || p_quant) of the next-token distribution, top-1 agreement.

This is how the schemes of the int8 and int4 page formats were chosen (docs/page_formats.md);
``bench_page_formats.py`` measures the formats as built.

Usage:
  python benchmarks/page_format_schemes.py --tokens 4096 --schemes fp16,bf16,i8_row [--window 1024]
  python benchmarks/page_format_schemes.py --table
Results are appended as JSON lines to --out (default benchmarks/results/page_format_schemes.jsonl);
the float32 reference logits are kept beside it (805 MB at 4,096 tokens) and reused.
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent / "results"
D = 64

# ---------------------------------------------------------------------------------------------
# Building blocks. Every function maps float32 [..., 64] -> float32 [..., 64] (dequantized).


def f16(a):
    """Round to float16 (round to nearest even), back to float32."""
    return np.asarray(a, np.float32).astype(np.float16).astype(np.float32)


def bf16(a):
    """Round float32 to bfloat16 (round to nearest even on the top 16 bits), back to float32."""
    u = np.ascontiguousarray(a, np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.astype(np.uint32).view(np.float32)


def rnd(x):
    """Round half away from zero (C roundf)."""
    return np.sign(x) * np.floor(np.abs(x) + 0.5)


def _hadamard(n):
    h = np.array([[1.0]])
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return (h / np.sqrt(n)).astype(np.float32)  # orthonormal, symmetric: its own inverse


H64 = _hadamard(D)


def blocks(x, size):
    return x.reshape(*x.shape[:-1], D // size, size)


def inv_scale(d):
    return np.where(d != 0, 1.0 / np.where(d != 0, d, 1.0), 0.0).astype(np.float32)


def least_error(b, shape, clip, grid):
    """``grid(f)`` (the dequantized blocks of ``b`` for clip factor ``f``) of the least squared error per
    block over ``clip`` (the first factor on ties), reshaped to ``shape``."""
    best, best_err = None, None
    for f in clip:
        y = grid(f)
        if len(clip) == 1:
            return y.reshape(shape)
        err = ((y - b) ** 2).sum(-1, keepdims=True)
        if best is None:
            best, best_err = y, err
        else:
            take = err < best_err
            best = np.where(take, y, best)
            best_err = np.where(take, err, best_err)
    return best.reshape(shape)


def q_sym(x, size, qmax, clip=(1.0,)):
    """Symmetric: d = fp16(f * absmax / qmax), q = clamp(roundf(x / d), -qmax, qmax).

    With several clip factors f, each block keeps the one with the least squared error.
    """
    b = blocks(x, size)
    amax = np.abs(b).max(-1, keepdims=True)

    def grid(f):
        d = f16(amax * np.float32(f) / np.float32(qmax))
        return np.clip(rnd(b * inv_scale(d)), -qmax, qmax) * d

    return least_error(b, x.shape, clip, grid)


def q4_0(x, size=32, clip=(1.0,)):
    """llama.cpp q4_0 convention: m = the value of largest magnitude (signed), d = fp16(f * m / -8),
    q = clamp(floor(x / d + 8.5), 0, 15) - 8 (levels -8..7; the extreme value maps to -8)."""
    b = blocks(x, size)
    idx = np.abs(b).argmax(-1)[..., None]
    m = np.take_along_axis(b, idx, -1)

    def grid(f):
        d = f16(m * np.float32(f) / np.float32(-8.0))
        return (np.clip(np.floor(b * inv_scale(d) + 8.5), 0, 15) - 8) * d

    return least_error(b, x.shape, clip, grid)


def q_asym(x, size, levels=15, clip=(1.0,)):
    """Asymmetric: lo = fp16(f*min), d = fp16((f*max - f*min) / levels), q = clamp(roundf((x - lo) / d), 0, levels),
    y = lo + q * d."""
    b = blocks(x, size)
    mn = b.min(-1, keepdims=True)
    mx = b.max(-1, keepdims=True)

    def grid(f):
        lo = f16(mn * np.float32(f))
        d = f16((mx - mn) * np.float32(f) / np.float32(levels))
        return lo + np.clip(rnd((b - lo) * inv_scale(d)), 0, levels) * d

    return least_error(b, x.shape, clip, grid)


# QLoRA's NF4 levels (bitsandbytes table), ascending; 0 is level 7.
NF4 = np.array([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0], dtype=np.float32)
NF4_MID = ((NF4[1:] + NF4[:-1]) / 2).astype(np.float32)


def q_nf4(x, size=32, clip=(1.0,)):
    """NF4: d = fp16(f * absmax), q = index of the nearest NF4 level to x / d, y = NF4[q] * d."""
    b = blocks(x, size)
    amax = np.abs(b).max(-1, keepdims=True)

    def grid(f):
        d = f16(amax * np.float32(f))
        return NF4[np.searchsorted(NF4_MID, b * inv_scale(d))] * d  # ties go to the upper level

    return least_error(b, x.shape, clip, grid)


def rotated(fn):
    """fn applied to the row after the normalized 64-point Hadamard rotation (H/8), rotated back."""
    return lambda x: fn(x @ H64) @ H64


CLIP6 = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75)

# name -> (function on rows, bytes per 64-value row incl. scales)
ROW = {
    "f32": (lambda x: x, 256),
    "fp16": (f16, 128),
    "bf16": (bf16, 128),
    # int8
    "i8_row": (lambda x: q_sym(x, 64, 127), 66),
    "i8_b32": (lambda x: q_sym(x, 32, 127), 68),
    "i8_row_h": (rotated(lambda x: q_sym(x, 64, 127)), 66),
    # int4
    "q4_0": (lambda x: q4_0(x, 32), 36),
    "q4_0_h": (rotated(lambda x: q4_0(x, 32)), 36),
    "s4_b32": (lambda x: q_sym(x, 32, 7), 36),
    "s4_b32_h": (rotated(lambda x: q_sym(x, 32, 7)), 36),
    "a4_row_h": (rotated(lambda x: q_asym(x, 64)), 36),
    "a4_row": (lambda x: q_asym(x, 64), 36),
    "a4_b32": (lambda x: q_asym(x, 32), 40),
    "a4_b32_h": (rotated(lambda x: q_asym(x, 32)), 40),
    "nf4_b32_h": (rotated(lambda x: q_nf4(x, 32)), 36),
    "nf4_b32": (lambda x: q_nf4(x, 32), 36),
    "nf4_row_h": (rotated(lambda x: q_nf4(x, 64)), 34),
    # MSE-optimal clipping among absmax * CLIP6
    "q4_0_h_c": (rotated(lambda x: q4_0(x, 32, CLIP6)), 36),
    "s4_b32_h_c": (rotated(lambda x: q_sym(x, 32, 7, CLIP6)), 36),
    "a4_row_h_c": (rotated(lambda x: q_asym(x, 64, 15, CLIP6)), 36),
    "nf4_b32_h_c": (rotated(lambda x: q_nf4(x, 32, CLIP6)), 36),
    "nf4_row_h_c": (rotated(lambda x: q_nf4(x, 64, CLIP6)), 34),
    "a4_b32_h_c": (rotated(lambda x: q_asym(x, 32, 15, CLIP6)), 40),
    # other widths, for K/V splits at the same average bytes (5-bit: 40 B + 4, 3-bit: 24 B + 4)
    "a5_row_h_c": (rotated(lambda x: q_asym(x, 64, 31, CLIP6)), 44),
    "a3_row_h_c": (rotated(lambda x: q_asym(x, 64, 7, CLIP6)), 28),
    "s4_b16_h_c": (rotated(lambda x: q_sym(x, 16, 7, CLIP6)), 40),
    "s5_row_h_c": (rotated(lambda x: q_sym(x, 64, 15, CLIP6)), 42),
    "s5_row_h": (rotated(lambda x: q_sym(x, 64, 15)), 42),
    "s6_row_h_c": (rotated(lambda x: q_sym(x, 64, 31, CLIP6)), 50),
}


def first_page(fn_rest, fn_first, page=16):
    """Rows of positions < page use fn_first (e.g. int8), the others fn_rest."""
    def apply(x, pos):
        y = fn_rest(x)
        sink = pos < page
        if sink.any():
            y[sink] = fn_first(x[sink])
        return y
    return apply


def scheme(spec):
    """'NAME' (K and V alike), 'K:NAME,V:NAME' as 'kNAME/vNAME', and '+p8' suffix for the
    first page (positions 0..15) at int8 (i8_row_h). Returns (kfn(x,pos), vfn(x,pos), bytes_k, bytes_v)."""
    first8 = spec.endswith("+p8")
    base = spec[:-3] if first8 else spec
    if "/" in base:
        kname, vname = base.split("/")
    else:
        kname = vname = base
    out = []
    for name in (kname, vname):
        fn, nbytes = ROW[name]
        if first8:
            out.append(first_page(fn, ROW["i8_row_h"][0]))
        else:
            out.append(lambda x, pos, fn=fn: fn(x))
        out.append(nbytes)
    kfn, kb, vfn, vb = out
    return kfn, vfn, kb, vb


# ---------------------------------------------------------------------------------------------


def log_softmax64(logits):
    z = logits.astype(np.float64)
    z -= z.max(-1, keepdims=True)
    z -= np.log(np.exp(z).sum(-1, keepdims=True))
    return z


def run_scheme(model, tokens, spec, window, sinks, chunk, ref_logits, threads, open_page=False):
    from pagedkv.models.paged_backend import PagedBackend, max_pages_per_sequence

    c = model.config
    n = tokens.size
    pages = max_pages_per_sequence(n, 16, window, sinks, chunk)
    backend = PagedBackend.for_config(c, pages, page_size=16, dtype=np.float32, window=window,
                                      sink_tokens=sinks, num_threads=threads)
    pending = []  # open_page: quantized K/V written over the full-precision ones after the forward
    if spec != "f32":
        kfn, vfn, _, _ = scheme(spec)
        original = backend.store

        def store(batch, layer, k, v):
            pos = batch.positions
            k2 = np.ascontiguousarray(kfn(np.asarray(k, np.float32), pos), np.float32)
            v2 = np.ascontiguousarray(vfn(np.asarray(v, np.float32), pos), np.float32)
            if open_page:
                original(batch, layer, k, v)
                pending.append((batch, layer, k2, v2))
            else:
                original(batch, layer, k2, v2)

        backend.store = store
    backend.add_sequence(0)
    nll = np.empty(n - 1)
    kl = np.empty(n - 1)
    top1 = np.empty(n - 1, bool)
    logits_all = np.empty((n - 1, c.vocab_size), np.float32) if ref_logits is None else None
    start = time.perf_counter()
    for begin in range(0, n - 1, chunk):
        end = min(begin + chunk, n - 1)
        logits = model.forward(backend, [0], [tokens[begin:end]], all_logits=True)
        for batch, layer, k2, v2 in pending:  # the page seals: quantize it
            original(batch, layer, k2, v2)
        pending.clear()
        lp = log_softmax64(logits)
        nll[begin:end] = -lp[np.arange(end - begin), tokens[begin + 1:end + 1]]
        if ref_logits is None:
            logits_all[begin:end] = logits
            kl[begin:end] = 0.0
            top1[begin:end] = True
        else:
            ref = log_softmax64(ref_logits[begin:end])
            kl[begin:end] = (np.exp(ref) * (ref - lp)).sum(-1)
            top1[begin:end] = ref_logits[begin:end].argmax(-1) == logits.argmax(-1)
    seconds = time.perf_counter() - start
    backend.remove_sequence(0)
    return nll, kl, top1, seconds, logits_all


def table(path):
    """Markdown table of the results file: the last record of each (scheme, tokens, window, sinks)."""
    recs = {}
    for line in Path(path).read_text().splitlines():
        r = json.loads(line)
        recs[(r["scheme"], r["tokens"], r["window"], r["sinks"])] = r
    out = ["| scheme | tokens | window | bytes/row K+V avg (% of fp16) | perplexity | delta vs fp16 | mean KL | "
           "p99 KL | top-1 agree | s | command |", "|" + "---|" * 11]
    for key, r in sorted(recs.items(), key=lambda kv: kv[0][2] is not None):  # full attention first
        fp = recs.get(("fp16", r["tokens"], r["window"], r["sinks"]))
        delta = f"{100 * (r['ppl'] / fp['ppl'] - 1):+.3f}%" if fp else "n/a"
        nbytes = (r["bytes_k"] + r["bytes_v"]) / 2
        win = "full" if r["window"] is None else f"{r['window']}" + (f"+{r['sinks']} sinks" if r["sinks"] else "")
        out.append(f"| {r['scheme']} | {r['tokens']} | {win} | {nbytes:g} ({100 * nbytes / 128:.1f}%) | "
                   f"{r['ppl']:.4f} | {delta} | {r['kl']:.2e} | {r.get('kl_p99', 0):.2e} | {r['top1']:.4f} | "
                   f"{r['seconds']:.0f} | `{r['command']}` |")
    return "\n".join(out)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--schemes", default="fp16")
    p.add_argument("--window", type=int, default=None)
    p.add_argument("--sinks", type=int, default=0)
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--open-page", action="store_true",
                   help="keep the open page (the 16-token page being filled) in float32 until it seals: "
                        "scores in page-aligned chunks of 16 and quantizes each page after its chunk")
    p.add_argument("--out", default=str(HERE / "page_format_schemes.jsonl"))
    p.add_argument("--table", action="store_true", help="print the markdown table of --out and exit")
    args = p.parse_args()
    if args.table:
        print(table(args.out))
        return
    command = "python benchmarks/page_format_schemes.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    HERE.mkdir(parents=True, exist_ok=True)

    from pagedkv.commands.perplexity import first_token_ids
    from pagedkv.models import LlamaModel

    from bench_llama import find_text

    model, tok = LlamaModel.from_gguf(None, num_threads=args.threads)
    path = find_text()
    if path is None:
        raise SystemExit("tinyshakespeare not found: run `pagedkv data fetch tinyshakespeare`")
    text = Path(path).read_text(encoding="utf-8")
    tokens = first_token_ids(text, tok, args.tokens, str(path))
    assert tokens.size == args.tokens
    wtag = f"w{args.window}s{args.sinks}" if args.window else "full"
    ref_path = HERE / f"ref_{args.tokens}_{wtag}.npy"
    if ref_path.exists():
        ref = np.load(ref_path, mmap_mode="r")
    else:
        nll, _, _, sec, ref = run_scheme(model, tokens, "f32", args.window, args.sinks, args.chunk, None,
                                         args.threads)
        np.save(ref_path, ref)
        rec = dict(scheme="f32", tokens=args.tokens, window=args.window, sinks=args.sinks, bytes_k=256,
                   bytes_v=256, ppl=float(np.exp(nll.mean())), mean_nll=float(nll.mean()), kl=0.0, top1=1.0,
                   seconds=sec, command=command)
        print(json.dumps(rec), flush=True)
        with open(args.out, "a") as fh:
            fh.write(json.dumps(rec) + "\n")
        ref = np.load(ref_path, mmap_mode="r")
    for spec in args.schemes.split(","):
        if spec == "f32":
            continue
        _, _, kb, vb = scheme(spec)
        chunk = 16 if args.open_page else args.chunk
        nll, kl, top1, sec, _ = run_scheme(model, tokens, spec, args.window, args.sinks, chunk, ref,
                                           args.threads, args.open_page)
        rec = dict(scheme=spec + (" open-page-f32" if args.open_page else ""), tokens=args.tokens, window=args.window, sinks=args.sinks, bytes_k=kb, bytes_v=vb,
                   ppl=float(np.exp(nll.mean())), mean_nll=float(nll.mean()), kl=float(kl.mean()),
                   kl_p99=float(np.quantile(kl, 0.99)), top1=float(top1.mean()), seconds=sec, command=command)
        print(json.dumps(rec), flush=True)
        with open(args.out, "a") as fh:
            fh.write(json.dumps(rec) + "\n")


if __name__ == "__main__":
    main()
