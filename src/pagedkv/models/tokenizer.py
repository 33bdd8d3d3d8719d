"""Byte-level BPE tokenizer and ChatML prompt format built from GGUF vocabulary data.

The tokenizer is assembled with the ``tokenizers`` library from the GGUF's
``tokenizer.ggml.tokens`` and ``tokenizer.ggml.merges`` and reproduces what llama.cpp
does for the same file:

* pre-tokenization follows llama.cpp's table for ``tokenizer.ggml.pre``
  (``llama-vocab.cpp``): for ``"smollm"`` (and the StarCoder family) every digit is split
  off on its own, then the GPT-2 regex splits words; ``"llama-bpe"`` uses the Llama 3
  regex and looks whole words up before merging;
* control and user-defined tokens (``<|im_start|>``, ``<|im_end|>``, ...) are matched as
  whole tokens inside the text, as llama.cpp does with ``parse_special=True``;
* a BOS token is prepended only when ``tokenizer.ggml.add_bos_token`` says so (SmolLM2:
  no).
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

from pagedkv.models.gguf_loader import TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED, VocabularyData

# The GPT-2 split pattern, as used by the "gpt2" and "smollm" pre-tokenizers.
_PRE_DIGITS_THEN_GPT2 = frozenset(
    {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}
)
_PRE_GPT2 = frozenset({"gpt2", "mpt", "olmo", "jais"})
_PRE_LLAMA3 = frozenset({"llama-bpe", "llama3"})
_LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

SUPPORTED_PRE_TOKENIZERS = tuple(sorted(_PRE_DIGITS_THEN_GPT2 | _PRE_GPT2 | _PRE_LLAMA3))


def byte_level_alphabet() -> dict[int, str]:
    """GPT-2's byte-to-character map of byte-level BPE.

    Printable Latin-1 bytes stand for themselves; the other 68 bytes (controls, space,
    ...) map in order to U+0100 onwards, so a space is ``"Ġ"`` (U+0120).

    Returns
    -------
    dict of int to str
        256 entries.

    Notes
    -----
    Source: ``bytes_to_unicode`` of OpenAI's GPT-2 ``encoder.py`` (Radford et al., 2019).
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


class LlamaTokenizer:
    """Byte-level BPE tokenizer of a GGUF model (``tokenizer.ggml.model == "gpt2"``).

    Parameters
    ----------
    vocab : VocabularyData
        Tokenizer data read by :func:`pagedkv.models.gguf_loader.load_llama_gguf`.

    Raises
    ------
    ValueError
        If the vocabulary is not byte-level BPE, or its ``tokenizer.ggml.pre`` is not one
        of :data:`SUPPORTED_PRE_TOKENIZERS`.

    Attributes
    ----------
    vocab_size : int
        Number of token ids.
    bos_token_id, eos_token_id : int or None
        From the GGUF metadata.
    stop_token_ids : frozenset of int
        Tokens that end generation: ``eos_token_id`` plus ``<|im_end|>``,
        ``<|endoftext|>`` and ``<|eot_id|>`` where present (llama.cpp's end-of-generation
        set is built from the same names).
    chat_template : str or None
        The GGUF's Jinja chat template, kept for reference.
    missing_bytes : frozenset of int
        Byte values without a token of their own. Text containing them cannot be encoded
        losslessly: like llama.cpp, :meth:`encode` drops those bytes (SmolLM2 lacks six
        ASCII control bytes and the UTF-8 lead bytes 0xF1 and 0xF2 of U+40000..U+BFFFF,
        among others that never occur in UTF-8).

    Notes
    -----
    Source of the splitting rules: llama.cpp ``src/llama-vocab.cpp``
    (``llm_tokenizer_bpe``) and the Hugging Face ``tokenizer.json`` of SmolLM2
    (``Digits(individual_digits=True)`` followed by ``ByteLevel``).
    """

    def __init__(self, vocab: VocabularyData) -> None:
        from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

        if vocab.model != "gpt2":
            raise ValueError(
                f"Invalid value of tokenizer.ggml.model: expected 'gpt2' (byte-level BPE), got {vocab.model!r}"
            )
        pre = vocab.pre
        if pre not in SUPPORTED_PRE_TOKENIZERS:
            raise ValueError(
                f"Invalid value of tokenizer.ggml.pre: expected one of {list(SUPPORTED_PRE_TOKENIZERS)}, got {pre!r}"
            )
        merges = []
        for merge in vocab.merges:
            # llama.cpp splits at the first space after the first character.
            cut = merge.find(" ", 1)
            if cut < 0:
                raise ValueError(f"Invalid value of tokenizer.ggml.merges: expected 'left right', got {merge!r}")
            merges.append((merge[:cut], merge[cut + 1 :]))
        token_to_id = {token: i for i, token in enumerate(vocab.tokens)}
        bpe = models.BPE(
            vocab=token_to_id, merges=merges, ignore_merges=pre in _PRE_LLAMA3
        )
        tokenizer = Tokenizer(bpe)
        if pre in _PRE_LLAMA3:
            tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Split(Regex(_LLAMA3_PATTERN), behavior="isolated"),
                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
                ]
            )
        elif pre in _PRE_DIGITS_THEN_GPT2:
            tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Digits(individual_digits=True),
                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
                ]
            )
        else:
            tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tokenizer.decoder = decoders.ByteLevel()
        added = [
            AddedToken(token, special=kind == TOKEN_TYPE_CONTROL, normalized=False)
            for token, kind in zip(vocab.tokens, vocab.token_types, strict=True)
            if kind in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED)
        ]
        tokenizer.add_tokens(added)
        self._tokenizer = tokenizer
        self._tokens = list(vocab.tokens)
        self.vocab_size = len(vocab.tokens)
        self.bos_token_id = vocab.bos_token_id
        self.eos_token_id = vocab.eos_token_id
        self.add_bos_token = vocab.add_bos_token
        self.chat_template = vocab.chat_template
        stop = {vocab.eos_token_id} if vocab.eos_token_id is not None else set()
        for name in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>"):
            if name in token_to_id:
                stop.add(token_to_id[name])
        self.stop_token_ids = frozenset(stop)
        self.missing_bytes = frozenset(
            b for b, char in byte_level_alphabet().items() if char not in token_to_id
        )

    def can_encode(self, text: str) -> bool:
        """True if :meth:`decode` of :meth:`encode` gives ``text`` back (no byte is missing)."""
        missing = self.missing_bytes
        return not missing or not any(b in missing for b in text.encode("utf-8"))

    def encode(self, text: str, *, add_bos: bool | None = None) -> list[int]:
        """Token ids of ``text``; special-token strings in it become their ids.

        Parameters
        ----------
        text : str
        add_bos : bool or None
            Prepend ``bos_token_id``; None follows ``tokenizer.ggml.add_bos_token``.

        Returns
        -------
        list of int
            Ids in ``[0, vocab_size)``. Bytes listed in :attr:`missing_bytes` are
            dropped, as llama.cpp drops them (see :meth:`can_encode`).

        Raises
        ------
        TypeError
            If ``text`` is not a str.
        """
        if not isinstance(text, str):
            raise TypeError(f"Invalid type of text: expected str, got {type(text).__name__}")
        ids = self._tokenizer.encode(text, add_special_tokens=False).ids
        if (self.add_bos_token if add_bos is None else add_bos) and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, token_ids: Iterable[int], *, skip_special_tokens: bool = False) -> str:
        """Text of ``token_ids`` (exact inverse of :meth:`encode` for valid UTF-8).

        Parameters
        ----------
        token_ids : iterable of int
            Ids in ``[0, vocab_size)``.
        skip_special_tokens : bool
            Drop control tokens such as ``<|im_end|>`` instead of rendering them.

        Returns
        -------
        str
            Incomplete UTF-8 byte sequences (a character split across tokens, cut at the
            end) come out as U+FFFD.

        Raises
        ------
        ValueError
            If an id is outside ``[0, vocab_size)``.
        """
        ids = [int(t) for t in token_ids]
        for t in ids:
            if not 0 <= t < self.vocab_size:
                raise ValueError(
                    f"Invalid token id of token_ids: expected [0, {self.vocab_size}), got {t}"
                )
        return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        """Id of the token string ``token`` (byte-level alphabet), or None."""
        return self._tokenizer.token_to_id(token)

    def id_to_token(self, token_id: int) -> str:
        """Token string of ``token_id`` in the byte-level alphabet (``"Ġ"`` = space)."""
        if not 0 <= token_id < self.vocab_size:
            raise ValueError(
                f"Invalid token id of token_id: expected [0, {self.vocab_size}), got {token_id}"
            )
        return self._tokens[token_id]


def default_system_prompt(template_source) -> str | None:
    """System prompt that a model's ChatML template inserts when the chat has none.

    Pass the tokenizer: ``default_system_prompt(tokenizer)`` (or its
    ``tokenizer.chat_template`` text). SmolLM2-Instruct's template (in the GGUF's
    ``tokenizer.chat_template``, the same as the model card's) starts a chat without a
    system message with the system turn ``<|im_start|>system``, a newline, then
    ``You are a helpful AI assistant named SmolLM, trained by Hugging Face`` and
    ``<|im_end|>``.

    Parameters
    ----------
    template_source : LlamaTokenizer, str or None
        A tokenizer (its ``chat_template`` is read), the Jinja template text itself, or
        None (a model without a template).

    Returns
    -------
    str or None
        The literal system message of the template, or None if it has none.

    Raises
    ------
    TypeError
        If ``template_source`` is none of the above.

    Examples
    --------
    >>> model, tokenizer = LlamaModel.from_gguf()  # doctest: +SKIP
    >>> format_chatml("What is a KV cache?", default_system=default_system_prompt(tokenizer))  # doctest: +SKIP
    """
    if template_source is None or isinstance(template_source, str):
        chat_template = template_source
    elif isinstance(getattr(template_source, "chat_template", 0), (str, type(None))):
        chat_template = template_source.chat_template  # a LlamaTokenizer, or any object with the attribute
    else:
        raise TypeError("Invalid type of template_source: expected a LlamaTokenizer, its chat_template "
                        f"(str) or None, got {type(template_source).__name__}")
    if not chat_template:
        return None
    match = re.search(r"<\|im_start\|>system\n(.*?)<\|im_end\|>", chat_template, re.DOTALL)
    return match.group(1) if match else None


def format_chatml(
    messages: str | Sequence[tuple[str, str]] | Sequence[dict],
    *,
    default_system: str | None = None,
    add_generation_prompt: bool = True,
) -> str:
    """Render a chat in ChatML, the format of SmolLM2-Instruct.

    Each message becomes ``<|im_start|>{role}\\n{content}<|im_end|>\\n``; when the first
    message is not a system message and ``default_system`` is given, a system message
    with that text comes first; ``add_generation_prompt`` appends
    ``<|im_start|>assistant\\n``. This is what SmolLM2's Jinja template produces.

    Parameters
    ----------
    messages : str, or sequence of (role, content) pairs or of {"role", "content"} dicts
        Roles are ``"system"``, ``"user"`` or ``"assistant"``. A single string is one
        user message: ``format_chatml("Hi")`` equals ``format_chatml([("user", "Hi")])``.
    default_system : str or None
        See :func:`default_system_prompt`.
    add_generation_prompt : bool
        Open an assistant turn for the model to complete.

    Returns
    -------
    str

    Raises
    ------
    TypeError
        If ``messages`` is neither a string nor a sequence of (role, content) pairs or
        {"role", "content"} dicts with string roles and contents.
    ValueError
        If a role is not one of the three above.
    """
    if isinstance(messages, str):
        messages = [("user", messages)]
    pairs = []
    for m in messages:
        if isinstance(m, dict) and set(m) >= {"role", "content"}:
            pair = (m["role"], m["content"])
        elif isinstance(m, (tuple, list)) and len(m) == 2:
            pair = (m[0], m[1])
        else:
            pair = None
        if pair is None or not all(isinstance(part, str) for part in pair):
            raise TypeError("Invalid type of messages: expected a string (one user message) or a sequence of "
                            f"(role, content) string pairs or {{'role': ..., 'content': ...}} dicts, got an item {m!r}")
        pairs.append(pair)
    for role, _ in pairs:
        if role not in ("system", "user", "assistant"):
            raise ValueError(
                f"Invalid role of messages: expected 'system', 'user' or 'assistant', got {role!r}"
            )
    parts = []
    if default_system is not None and (not pairs or pairs[0][0] != "system"):
        parts.append(f"<|im_start|>system\n{default_system}<|im_end|>\n")
    parts.extend(f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in pairs)
    if add_generation_prompt:
        parts.append("<|im_start|>assistant\n")
    return "".join(parts)
