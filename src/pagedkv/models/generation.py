"""Generation (greedy or sampled) and teacher-forced scoring on top of any attention backend."""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from pagedkv_c._checks import checked_int

from pagedkv.models.attention_backend import AttentionBackend
from pagedkv.models.llama import LlamaModel


@dataclass
class GenerationResult:
    """Output and timing of :func:`generate` (and :func:`generate_greedy`).

    Attributes
    ----------
    token_ids : list of list of int
        Generated ids per prompt, in prompt order; a stop token that ended a sequence is
        included as its last id.
    num_prompt_tokens : int
        Prompt tokens prefilled, over all prompts.
    num_decode_tokens : int
        Tokens fed through decode steps, over all sequences (every generated token but
        the first of each sequence, which comes out of the prefill).
    prefill_seconds : float
        Wall time from the start of the sequences (prefix-cache lookups, tier fetches
        included) to the first token of every prompt, in seconds.
    decode_seconds : float
        Wall time of the decode steps, in seconds.
    num_cached_tokens : int
        Prompt tokens whose K/V the backend's prefix cache (or its shared tier) served,
        over all prompts: they were not prefilled. 0 without prefix caching.
    """

    token_ids: list[list[int]]
    num_prompt_tokens: int
    num_decode_tokens: int
    prefill_seconds: float
    decode_seconds: float
    num_cached_tokens: int = 0

    @property
    def num_computed_tokens(self) -> int:
        """Prompt tokens the prefill computed: ``num_prompt_tokens - num_cached_tokens``."""
        return self.num_prompt_tokens - self.num_cached_tokens

    @property
    def prefill_tokens_per_second(self) -> float:
        """Prompt tokens (computed and reused) per second of prefill wall time."""
        return self.num_prompt_tokens / self.prefill_seconds if self.prefill_seconds > 0 else float("nan")

    @property
    def computed_tokens_per_second(self) -> float:
        """Computed prompt tokens (those the prefix cache did not serve) per second of prefill wall time."""
        return self.num_computed_tokens / self.prefill_seconds if self.prefill_seconds > 0 else float("nan")

    @property
    def decode_tokens_per_second(self) -> float:
        """Decoded tokens (over the whole batch) per second of decode wall time."""
        return self.num_decode_tokens / self.decode_seconds if self.decode_seconds > 0 else float("nan")


def _check_positive(name: str, value, allow_none: bool = False) -> None:
    if allow_none and value is None:
        return
    checked_int(value, name, 1, 2**62)  # TypeError for a float or a bool, ValueError out of range


def sample_token(
    logits: np.ndarray,
    rng: np.random.Generator | None = None,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float = 1.0,
) -> int:
    """Choose the next token from one row of logits: greedy, or sampled with temperature, top-k and top-p.

    With ``temperature == 0`` (or ``top_k == 1``) the result is ``argmax(logits)`` (the
    lowest id among equal maxima) and ``rng`` is not used. Otherwise the token is drawn
    from ``softmax(logits / temperature)`` restricted first to the ``top_k`` most likely
    ids, then to the smallest set of most likely ids whose probability sums to at least
    ``top_p`` (renormalised), with one ``rng.random()`` draw.

    Parameters
    ----------
    logits : numpy.ndarray
        Shape ``[vocab_size]``, float (float32 from the model); computed in float64.
    rng : numpy.random.Generator or None
        Source of the draw; required unless the choice is greedy.
    temperature : float
        >= 0; 0 is greedy. Values below 1 sharpen the distribution, above 1 flatten it.
    top_k : int or None
        Keep only the ``top_k`` most likely ids (>= 1); None keeps all.
    top_p : float
        Nucleus mass in ``(0, 1]``; 1 keeps all.

    Returns
    -------
    int
        Token id in ``[0, vocab_size)``.

    Raises
    ------
    ValueError
        For ``logits`` not 1-D and non-empty, or a parameter out of range.
    TypeError
        If a draw is needed and ``rng`` is not a ``numpy.random.Generator``.

    Notes
    -----
    Top-k sampling: Fan et al., "Hierarchical Neural Story Generation", ACL 2018.
    Top-p (nucleus) sampling: Holtzman et al., "The Curious Case of Neural Text
    Degeneration", ICLR 2020. Ties at the top-k boundary are broken by
    :func:`numpy.argpartition`.
    """
    _check_sampling(temperature, top_k, top_p)
    row = np.asarray(logits)
    if row.ndim != 1 or row.size == 0:
        raise ValueError(f"Invalid shape of logits: expected [vocab_size] with vocab_size >= 1, got {row.shape}")
    if temperature == 0 or top_k == 1:
        return int(np.argmax(row))
    if not isinstance(rng, np.random.Generator):
        raise TypeError(f"Invalid type of rng: expected numpy.random.Generator, got {type(rng).__name__}")
    ids, probs = sampling_distribution(row, temperature=temperature, top_k=top_k, top_p=top_p)
    cumulative = np.cumsum(probs)
    index = int(np.searchsorted(cumulative, rng.random() * cumulative[-1], side="right"))
    return int(ids[min(index, ids.size - 1)])


def sampling_distribution(
    logits: np.ndarray,
    *,
    temperature: float,
    top_k: int | None = None,
    top_p: float = 1.0,
) -> tuple[np.ndarray, np.ndarray]:
    """The ids that :func:`sample_token` may draw and their probabilities.

    Parameters
    ----------
    logits : numpy.ndarray
        Shape ``[vocab_size]``.
    temperature : float
        > 0.
    top_k : int or None
        As for :func:`sample_token`.
    top_p : float
        As for :func:`sample_token`.

    Returns
    -------
    ids : numpy.ndarray
        int64, shape ``[n]``: the kept ids, most likely first (equal logits: lower id
        first).
    probs : numpy.ndarray
        float64, shape ``[n]``: their probabilities after temperature, top-k and top-p,
        summing to 1.

    Raises
    ------
    ValueError
        For ``temperature <= 0`` or another parameter out of range.
    """
    _check_sampling(temperature, top_k, top_p)
    if temperature == 0:
        raise ValueError("Invalid value of temperature: expected > 0 for a distribution, got 0 (greedy)")
    x = np.asarray(logits, dtype=np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        z = x / temperature
        if not np.isfinite(z).all() and np.isfinite(x).all():
            # a temperature so small that logits / T overflow: the same order from the shifted logits,
            # whose largest is 0 and the others -inf at worst (probability 0), never +inf - +inf
            z = (x - x.max()) / temperature
    if top_k is not None and top_k < z.size:
        ids = np.argpartition(-z, top_k - 1)[:top_k]
    else:
        ids = np.arange(z.size)
    ids = ids[np.lexsort((ids, -z[ids]))]  # most likely first, ties by id
    probs = np.exp(z[ids] - z[ids[0]])
    probs /= probs.sum()
    if top_p < 1.0:
        # The smallest prefix whose mass reaches top_p.
        keep = min(int(np.searchsorted(np.cumsum(probs), top_p, side="left")) + 1, ids.size)
        ids, probs = ids[:keep], probs[:keep] / probs[:keep].sum()
    return ids.astype(np.int64, copy=False), probs


def _check_sampling(temperature, top_k, top_p) -> None:
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float, np.integer, np.floating)) \
            or not 0 <= temperature < float("inf"):
        raise ValueError(f"Invalid value of temperature: expected a finite number >= 0, got {temperature!r}")
    _check_positive("top_k", top_k, allow_none=True)
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float, np.integer, np.floating)) or not 0 < top_p <= 1:
        raise ValueError(f"Invalid value of top_p: expected 0 < top_p <= 1, got {top_p!r}")


def generate(
    model: LlamaModel,
    backend: AttentionBackend,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float = 1.0,
    seed: int | np.random.Generator | None = None,
    stop_token_ids: Iterable[int] = (),
    seq_ids: Sequence[int] | None = None,
    prefill_chunk_size: int | None = None,
    on_token: Callable[[int, int], None] | None = None,
    release: bool = True,
) -> GenerationResult:
    """Generate for several prompts, decoding them as one batch; greedy unless a temperature is given.

    All prompts are prefilled together (a ragged batch, optionally in chunks), then each
    decode step feeds one token per still-running sequence. A sequence stops after
    emitting a stop token or ``max_new_tokens`` tokens. Each token is chosen by
    :func:`sample_token` from the logits of its sequence.

    Parameters
    ----------
    model : LlamaModel
    backend : AttentionBackend
        Must not hold ``seq_ids`` yet; they are added here (and removed at the end, also
        after an error, when ``release`` is true).
    prompts : sequence of int sequences
        ``[batch_size]`` non-empty prompts, token ids in ``[0, vocab_size)``.
    max_new_tokens : int
        Upper bound of generated tokens per sequence, >= 1.
    temperature : float
        >= 0; 0 (the default) is greedy (argmax), and then ``top_k``, ``top_p`` and
        ``seed`` have no effect.
    top_k : int or None
        Sample among the ``top_k`` most likely tokens only (>= 1; 1 is greedy).
    top_p : float
        Nucleus sampling: among the most likely tokens whose probability sums to at
        least ``top_p``, in ``(0, 1]`` (default 1: all).
    seed : int, numpy.random.Generator or None
        Seed of the ``numpy.random.default_rng`` that draws the tokens (or a generator
        to draw from); the same seed, prompts and settings give the same tokens. None:
        fresh entropy from the operating system.
    stop_token_ids : iterable of int
        Ids that end a sequence (e.g. ``tokenizer.stop_token_ids``).
    seq_ids : sequence of int or None
        Sequence ids to use in ``backend``; default ``0 .. batch_size-1``.
    prefill_chunk_size : int or None
        Feed at most this many prompt tokens per sequence per forward pass (None: whole
        prompts at once).
    on_token : callable or None
        Called as ``on_token(prompt_index, token_id)`` for every generated token, in
        generation order (for streaming).
    release : bool
        Remove the sequences from ``backend`` at the end.

    Returns
    -------
    GenerationResult

    Raises
    ------
    ValueError
        For an empty prompt list or prompt, a token id out of range, ``max_new_tokens``
        or ``prefill_chunk_size`` < 1, a sampling parameter out of range, or ``seq_ids``
        of the wrong length, repeated or already in ``backend``; raised before the
        backend changes. Errors of :meth:`LlamaModel.forward` (and of the backend)
        propagate.

    Notes
    -----
    Tokens are drawn in prompt order within each step, so a batch's output for a seed
    depends on the batch composition as well as on the seed.
    """
    _check_positive("max_new_tokens", max_new_tokens)
    _check_positive("prefill_chunk_size", prefill_chunk_size, allow_none=True)
    _check_sampling(temperature, top_k, top_p)
    if len(prompts) == 0 or any(len(p) == 0 for p in prompts):
        raise ValueError("Invalid value of prompts: expected at least one prompt, each non-empty")
    ids = list(range(len(prompts))) if seq_ids is None else [int(s) for s in seq_ids]
    if len(ids) != len(prompts):
        raise ValueError(f"Invalid length of seq_ids: expected {len(prompts)}, got {len(ids)}")
    if len(set(ids)) != len(ids) or any(s in backend for s in ids):
        raise ValueError(f"Invalid value of seq_ids: expected distinct ids new to the backend, got {ids}")
    stop = frozenset(int(t) for t in stop_token_ids)
    prompt_arrays = [np.asarray(p, dtype=np.int64) for p in prompts]
    vocab_size = model.config.vocab_size
    for p in prompt_arrays:
        if p.ndim != 1 or not np.issubdtype(p.dtype, np.integer) or p.min() < 0 or p.max() >= vocab_size:
            raise ValueError(f"Invalid value of prompts: expected 1-D token ids in [0, {vocab_size})")
    greedy = temperature == 0 or top_k == 1
    rng = None if greedy else np.random.default_rng(seed)

    def choose(row: np.ndarray) -> int:
        """Next token id from one row of logits, shape (vocab_size,): argmax or a sample."""
        if greedy:
            return int(np.argmax(row))
        return sample_token(row, rng, temperature=temperature, top_k=top_k, top_p=top_p)

    start = time.perf_counter()
    cached = [0] * len(ids)
    prefix_caching = getattr(backend, "prefix_caching", False)
    for i, s in enumerate(ids):
        if prefix_caching:  # the prompt's cached start is not prefilled again
            cached[i] = backend.add_sequence(s, prompt_arrays[i])
        else:
            backend.add_sequence(s)
    try:
        outputs, prefill_seconds, decode_seconds, num_decode_tokens = _generation_loop(
            model, backend, ids, prompt_arrays, max_new_tokens, stop, prefill_chunk_size, on_token, choose,
            cached, start,
        )
    finally:
        if release:
            for s in ids:
                backend.remove_sequence(s)
    return GenerationResult(
        token_ids=outputs,
        num_prompt_tokens=int(sum(p.size for p in prompt_arrays)),
        num_decode_tokens=num_decode_tokens,
        prefill_seconds=prefill_seconds,
        decode_seconds=decode_seconds,
        num_cached_tokens=sum(cached),
    )


def generate_greedy(
    model: LlamaModel,
    backend: AttentionBackend,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    stop_token_ids: Iterable[int] = (),
    seq_ids: Sequence[int] | None = None,
    prefill_chunk_size: int | None = None,
    on_token: Callable[[int, int], None] | None = None,
    release: bool = True,
) -> GenerationResult:
    """Generate greedily (argmax): :func:`generate` with ``temperature=0``.

    Parameters, return value and errors are those of :func:`generate`.
    """
    return generate(model, backend, prompts, max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids,
                    seq_ids=seq_ids, prefill_chunk_size=prefill_chunk_size, on_token=on_token, release=release)


def _generation_loop(model, backend, ids, prompt_arrays, max_new_tokens, stop, prefill_chunk_size, on_token, choose,
                     cached, start):
    """Prefill every prompt from its ``cached`` tokens on, then decode the running sequences as one batch.

    ``choose`` picks each token; ``start`` is when the sequences were added (perf_counter).
    """
    outputs: list[list[int]] = [[] for _ in prompt_arrays]
    last_logits = np.empty((len(prompt_arrays), model.config.vocab_size), dtype=np.float32)
    chunk = prefill_chunk_size or max(p.size for p in prompt_arrays)
    offsets = list(cached)
    while True:
        rows = [i for i, p in enumerate(prompt_arrays) if offsets[i] < p.size]
        if not rows:
            break
        pieces = [prompt_arrays[i][offsets[i] : offsets[i] + chunk] for i in rows]
        logits = model.forward(backend, [ids[i] for i in rows], pieces)
        for row, i in enumerate(rows):
            offsets[i] += pieces[row].size
            if offsets[i] == prompt_arrays[i].size:
                last_logits[i] = logits[row]
    running = []
    for i in range(len(prompt_arrays)):
        token = choose(last_logits[i])
        outputs[i].append(token)
        if on_token is not None:
            on_token(i, token)
        if token not in stop and max_new_tokens > 1:
            running.append(i)
    prefill_seconds = time.perf_counter() - start

    start = time.perf_counter()
    num_decode_tokens = 0
    while running:
        logits = model.forward(backend, [ids[i] for i in running], [[outputs[i][-1]] for i in running])
        num_decode_tokens += len(running)
        still = []
        for row, i in enumerate(running):
            token = choose(logits[row])
            outputs[i].append(token)
            if on_token is not None:
                on_token(i, token)
            if token not in stop and len(outputs[i]) < max_new_tokens:
                still.append(i)
        running = still
    return outputs, prefill_seconds, time.perf_counter() - start, num_decode_tokens


def log_softmax_nll(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """Negative log-likelihood of ``targets`` under ``logits``, in float64.

    Parameters
    ----------
    logits : numpy.ndarray
        float32, shape ``[n, vocab_size]``.
    targets : numpy.ndarray
        int, shape ``[n]``.

    Returns
    -------
    numpy.ndarray
        float64, shape ``[n]``: ``logsumexp(logits[i]) - logits[i, targets[i]]`` (nats).
    """
    z = logits.astype(np.float64)
    peak = z.max(axis=-1, keepdims=True)
    log_norm = np.log(np.exp(z - peak).sum(axis=-1)) + peak[:, 0]
    return log_norm - z[np.arange(z.shape[0]), targets]


def score_tokens(
    model: LlamaModel,
    backend: AttentionBackend,
    token_ids: Sequence[int] | np.ndarray,
    *,
    seq_id: int = 0,
    chunk_size: int = 1,
    on_progress: Callable[[int], None] | None = None,
    release: bool = True,
) -> np.ndarray:
    """Teacher-forced negative log-likelihood of every token given all earlier ones.

    Tokens are fed in order through ``model.forward``: with ``chunk_size=1`` (the
    default) one token per forward, i.e. through the decode path, which is what a
    sliding-window cache is meant to serve; larger chunks score through the prefill path.

    Parameters
    ----------
    model : LlamaModel
    backend : AttentionBackend
        Must not hold ``seq_id`` yet; its window and sinks decide what each token sees.
    token_ids : sequence of int or 1-D int array
        ``[N]`` ids, N >= 2, in ``[0, vocab_size)``.
    seq_id : int
        Sequence id to use in ``backend``.
    chunk_size : int
        Tokens per forward pass, >= 1.
    on_progress : callable or None
        Called with the number of tokens fed by each forward pass (for a progress bar).
    release : bool
        Remove the sequence from ``backend`` at the end.

    Returns
    -------
    numpy.ndarray
        float64, shape ``[N - 1]``: entry ``i`` is ``-log p(token[i+1] | token[:i+1])``
        in nats. ``exp(mean)`` is the perplexity.

    Raises
    ------
    ValueError
        If fewer than two tokens are given or ``chunk_size`` < 1 (before the backend
        changes).
    """
    _check_positive("chunk_size", chunk_size)
    tokens = np.asarray(token_ids)
    if tokens.ndim != 1 or tokens.size < 2 or not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(
            f"Invalid shape of token_ids: expected a 1-D integer sequence of at least 2 ids, got shape {tokens.shape}"
        )
    tokens = tokens.astype(np.int64, copy=False)
    backend.add_sequence(seq_id)
    nll = np.empty(tokens.size - 1, dtype=np.float64)
    try:
        # Token N-1 is only a target: feed tokens 0..N-2.
        for begin in range(0, tokens.size - 1, chunk_size):
            end = min(begin + chunk_size, tokens.size - 1)
            logits = model.forward(backend, [seq_id], [tokens[begin:end]], all_logits=True)
            nll[begin:end] = log_softmax_nll(logits, tokens[begin + 1 : end + 1])
            if on_progress is not None:
                on_progress(end - begin)
    finally:
        if release:
            backend.remove_sequence(seq_id)
    return nll
