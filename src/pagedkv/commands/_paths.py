"""argparse types for the file options of the commands.

They run while the command line is parsed, so a path that cannot work is a usage error
(``argument --plot: ...``, exit status 2) before a model is loaded or a trace replayed,
rather than a failure once the work is done.
"""
from __future__ import annotations

import argparse
import difflib
import os
from pathlib import Path


def not_a_regular_file(path: str) -> str | None:
    """Why ``path`` cannot be read as an input file (a device or pipe, which may never end), or None.

    A path that does not exist gives None: reading it reports that.
    """
    p = Path(path)
    if p.exists() and not p.is_dir() and not p.is_file():
        return f"cannot read {path}: not a regular file (a device or a pipe, which may never end)"
    return None


def input_file(text: str) -> str:
    """argparse type: an existing regular file this process may read; returns ``text``."""
    path = Path(text)
    if not path.exists():
        raise argparse.ArgumentTypeError(f"cannot read {text}: no such file")
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"cannot read {text}: it is a directory")
    reason = not_a_regular_file(text)
    if reason:
        raise argparse.ArgumentTypeError(reason)
    if not os.access(path, os.R_OK):
        raise argparse.ArgumentTypeError(f"cannot read {text}: permission denied")
    return text


def dataset_or_path(text: str) -> str:
    """The file a FILE/TRACE argument names: ``text`` itself, or a downloaded dataset's path.

    ``text`` is returned unchanged when it exists or is no dataset name (reading it then
    reports what is wrong); a dataset name (see :mod:`pagedkv.data`) gives the path of
    its verified copy in the data directory.

    Raises
    ------
    pagedkv.data.DataError
        For a dataset that is not downloaded yet or fails its SHA-256 check; the message
        says to run ``pagedkv data fetch NAME``.
    """
    from pagedkv import data

    if os.path.exists(text) or text not in data.DATASETS:
        return text
    return data.resolve(text)


def not_a_dataset_hint(text: str) -> str:
    """The end of a "no such file" message for a FILE/TRACE argument that may be a mistyped dataset name.

    Parameters
    ----------
    text : str
        The argument as given, which names no existing file.

    Returns
    -------
    str
        ``", nor a dataset name (did you mean NAME? known: ...; see `pagedkv data list`)"``
        when ``text`` has no directory part (a bare word, as a dataset name is), with the
        suggestion only for a close match (every name that ``text`` begins, else the
        closest name); ``""`` for a path with a directory part, whose
        "no such file" says enough.
    """
    if os.sep in text or (os.altsep and os.altsep in text):
        return ""
    from pagedkv import data

    # Every name the word begins ("mooncake": both Mooncake traces), else the closest one.
    close = [name for name in data.DATASETS if text and name.startswith(text)]
    close = close or difflib.get_close_matches(text, list(data.DATASETS), n=1)
    suggestion = f"did you mean {' or '.join(close)}? " if close else ""
    return f", nor a dataset name ({suggestion}known: {', '.join(data.DATASETS)}; see `pagedkv data list`)"


def output_file(text: str) -> str:
    """argparse type: a file path that can be written (its directory exists); returns ``text``.

    The file itself is neither created nor truncated here.
    """
    path = Path(text)
    directory = path.parent
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"cannot write {text}: it is a directory")
    if not directory.exists():
        raise argparse.ArgumentTypeError(f"cannot write {text}: directory {directory} does not exist")
    if not directory.is_dir():
        raise argparse.ArgumentTypeError(f"cannot write {text}: {directory} is not a directory")
    writable = os.access(path, os.W_OK) if path.exists() else os.access(directory, os.W_OK | os.X_OK)
    if not writable:
        raise argparse.ArgumentTypeError(f"cannot write {text}: permission denied")
    return text


def plot_file(text: str) -> str:
    """argparse type: an :func:`output_file` whose extension names an image format matplotlib writes.

    matplotlib picks the format from the extension (and appends ``.png`` to a name without
    one), so the extension must be one of its supported formats.
    """
    try:
        # The canvas base class lists the formats; no pyplot state or GUI backend is needed.
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        raise argparse.ArgumentTypeError("needs matplotlib: pip install 'pagedkv[cli]'") from None
    output_file(text)
    formats = sorted(FigureCanvasBase.get_supported_filetypes())
    extension = Path(text).suffix[1:].lower()
    if extension not in formats:
        got = f"'.{extension}'" if extension else "no extension"
        raise argparse.ArgumentTypeError(
            f"cannot write {text}: expected an image file name ending in one of "
            f"{', '.join('.' + f for f in formats)}, got {got}"
        )
    return text


def redacted_url(url: str) -> str:
    """``url`` with the password of its user information replaced by ``***``, for messages."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    userinfo, at, hosts = rest.rpartition("@")
    if not at or ":" not in userinfo:
        return url
    user = userinfo.split(":", 1)[0]
    return f"{scheme}://{user}:***@{hosts}"


def redacted_in(message: str, url: str) -> str:
    """``message`` with every occurrence of ``url`` shown as :func:`redacted_url` shows it."""
    return message.replace(url, redacted_url(url))
