"""Public inputs of the ``pagedkv`` commands: a text corpus and production serving traces.

Each dataset is one file with a name (``tinyshakespeare``, ``mooncake-conversation``...),
a public download URL pinned to a commit of the repository that publishes it, and the
SHA-256 of its bytes. :func:`fetch` downloads a file into the data directory and checks
the digest; :func:`resolve` turns a name given on the command line into the path of the
downloaded file (a path that exists is returned unchanged).

The data directory is, in order of precedence: ``$PAGEDKV_DATA_DIR``;
``$XDG_CACHE_HOME/pagedkv``; ``~/.cache/pagedkv`` (on Windows
``%LOCALAPPDATA%\\pagedkv\\Cache``; on macOS ``~/Library/Caches/pagedkv``), following
the platform conventions that ``platformdirs.user_cache_dir`` implements.
"""
from __future__ import annotations

import hashlib
import os
import sys
import tempfile
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

DATA_DIR_ENV = "PAGEDKV_DATA_DIR"
_CHUNK_BYTES = 1 << 16
_TIMEOUT_SECONDS = 30.0


@dataclass(frozen=True)
class Dataset:
    """One downloadable input file.

    Attributes
    ----------
    name : str
        Name accepted by ``pagedkv data fetch`` and by the commands in place of a path.
    filename : str
        File name inside the data directory.
    url : str
        Public download URL (pinned to a commit, so the bytes and ``sha256`` stay valid).
    sha256 : str
        Hex SHA-256 digest (64 lowercase hex digits) of the file's bytes.
    num_bytes : int
        File size in bytes.
    description : str
        What the file holds and who publishes it (with its licence).
    """

    name: str
    filename: str
    url: str
    sha256: str
    num_bytes: int
    description: str


_GITHUB_RAW = "https://raw.githubusercontent.com"
_MOONCAKE = f"{_GITHUB_RAW}/kvcache-ai/Mooncake/3cca71daccf2a7afb8fe3f0295358f70e3a69fdb/FAST25-release/traces"
_AZURE = f"{_GITHUB_RAW}/Azure/AzurePublicDataset/790921015d50dd6aae7f7e47f39ba0e235ad6b08/data"

DATASETS: dict[str, Dataset] = {
    d.name: d
    for d in [
        Dataset(
            "tinyshakespeare", "tinyshakespeare.txt",
            f"{_GITHUB_RAW}/karpathy/char-rnn/370cbcd448eb7daf32f21a6be560b70e0b33c4e3/data/tinyshakespeare/input.txt",
            "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed", 1_115_394,
            "1.1 MB of Shakespeare's plays, one plain-text file (karpathy/char-rnn; public-domain text, "
            "collection MIT); input of `pagedkv perplexity`",
        ),
        Dataset(
            "mooncake-conversation", "mooncake_conversation_trace.jsonl", f"{_MOONCAKE}/conversation_trace.jsonl",
            "b8cbb061a85206d729d91cdc2981f43c9e0d99209dce588d3af5f7934408b9df", 3_029_533,
            "12,031 chat requests of Kimi's production traffic with 512-token prefix block hashes "
            "(Mooncake, FAST'25; Apache-2.0); input of `pagedkv replay`",
        ),
        Dataset(
            "mooncake-synthetic", "mooncake_synthetic_trace.jsonl", f"{_MOONCAKE}/synthetic_trace.jsonl",
            "bd070915a98fc0ed264d7cfef2ce746002eb3076a695ec31ba2674c0111ec131", 1_136_313,
            "3,993 requests built from public datasets, Poisson arrivals, 512-token prefix block hashes "
            "(Mooncake, FAST'25; Apache-2.0); input of `pagedkv replay`",
        ),
        Dataset(
            "azure-conversation", "AzureLLMInferenceTrace_conv.csv", f"{_AZURE}/AzureLLMInferenceTrace_conv.csv",
            "2f1e5b666d4e3055fdbba98598ce2ec307767b9064e03e2fa46676dbcc7d0bf8", 719_188,
            "19,366 requests of a production conversation service, token counts only (Azure Public Dataset, "
            "2023 LLM inference trace; CC-BY-4.0, credit \"Azure Public Dataset, Microsoft\"); "
            "input of `pagedkv replay`",
        ),
        Dataset(
            "azure-code", "AzureLLMInferenceTrace_code.csv", f"{_AZURE}/AzureLLMInferenceTrace_code.csv",
            "54e9a6d2a4bd06ba1e060304b900abbc74cbea53de96506e60fe5bb4f2277fb6", 320_117,
            "requests of a production coding service, token counts only (Azure Public Dataset, 2023 LLM "
            "inference trace; CC-BY-4.0, credit \"Azure Public Dataset, Microsoft\"); input of `pagedkv replay`",
        ),
    ]
}
"""The datasets :func:`fetch` knows, by name."""


class DataError(Exception):
    """A dataset could not be found, downloaded or verified; the message says what to do."""


def data_dir() -> Path:
    """Directory that holds the downloaded datasets (it may not exist yet).

    Returns
    -------
    pathlib.Path
        ``$PAGEDKV_DATA_DIR`` if set and non-empty; else the user cache directory:
        ``$XDG_CACHE_HOME/pagedkv`` or ``~/.cache/pagedkv`` on Linux and other POSIX
        systems, ``~/Library/Caches/pagedkv`` on macOS, ``%LOCALAPPDATA%\\pagedkv\\Cache``
        on Windows (the locations of ``platformdirs.user_cache_dir``).
    """
    override = os.environ.get(DATA_DIR_ENV)
    if override:
        return Path(override).expanduser()
    if sys.platform == "win32":
        base = os.environ.get("LOCALAPPDATA") or str(Path.home() / "AppData" / "Local")
        return Path(base) / "pagedkv" / "Cache"
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Caches" / "pagedkv"
    xdg = os.environ.get("XDG_CACHE_HOME")
    base_dir = Path(xdg) if xdg and Path(xdg).is_absolute() else Path.home() / ".cache"
    return base_dir / "pagedkv"


def get_dataset(name: str) -> Dataset:
    """The :class:`Dataset` called ``name``.

    Raises
    ------
    KeyError
        If no dataset has that name; the message lists the names.
    """
    try:
        return DATASETS[name]
    except KeyError:
        raise KeyError(f"Invalid value of name: expected one of {', '.join(DATASETS)}, got {name!r}") from None


def dataset_path(name: str) -> Path:
    """Where the file of dataset ``name`` lives once fetched (it may not exist)."""
    return data_dir() / get_dataset(name).filename


def sha256_of(path: str | os.PathLike) -> str:
    """Hex SHA-256 digest of a file's bytes, read in 64 KiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK_BYTES), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _manual_instructions(dataset: Dataset) -> str:
    return (f"To place it by hand, download {dataset.url} on a machine with network access and copy it to "
            f"{data_dir() / dataset.filename} (its SHA-256 must be {dataset.sha256}; "
            f"set {DATA_DIR_ENV} to use another directory)")


def verify(name: str, path: str | os.PathLike | None = None) -> Path:
    """Check that the file of dataset ``name`` has the recorded SHA-256.

    Parameters
    ----------
    name : str
        Dataset name (see :data:`DATASETS`).
    path : path-like or None
        File to check; default: :func:`dataset_path` of ``name``.

    Returns
    -------
    pathlib.Path
        The file's path.

    Raises
    ------
    KeyError
        For an unknown name.
    DataError
        If the file is missing or its digest differs (the message gives both digests
        and how to fetch it again).
    """
    dataset = get_dataset(name)
    file_path = Path(path) if path is not None else dataset_path(name)
    if not file_path.is_file():
        raise DataError(f"{name} is not downloaded yet ({file_path} does not exist): run `pagedkv data fetch {name}`")
    actual = sha256_of(file_path)
    if actual != dataset.sha256:
        raise DataError(f"{file_path} has SHA-256 {actual}, expected {dataset.sha256} for {name}: the file is "
                        f"damaged or not the published one; delete it and run `pagedkv data fetch {name}`")
    return file_path


def fetch(
    name: str,
    *,
    url: str | None = None,
    force: bool = False,
    progress: Callable[[int, int | None], None] | None = None,
    timeout: float = _TIMEOUT_SECONDS,
    notify: Callable[[str], None] | None = None,
) -> Path:
    """Download dataset ``name`` into :func:`data_dir` and check its SHA-256.

    A file already in place with the right digest is kept (nothing is downloaded unless
    ``force``). The download goes to a temporary file in the same directory, which
    replaces the destination only once its digest matches, so an interrupted or wrong
    download never leaves a file that :func:`resolve` would accept.

    Parameters
    ----------
    name : str
        Dataset name (see :data:`DATASETS`).
    url : str or None
        Download from this URL instead of the dataset's own (a mirror, or a
        ``file://`` URL of a local copy).
    force : bool
        Download even if a verified copy is already in place.
    progress : callable or None
        Called as ``progress(num_bytes_read, total_bytes_or_None)`` after each chunk.
    timeout : float
        Seconds to wait for the server to connect or send data.
    notify : callable or None
        Called with one line of text when a copy already in place fails its SHA-256
        check and is downloaded again (it stays in place until the new bytes verify).

    Returns
    -------
    pathlib.Path
        Path of the verified file.

    Raises
    ------
    KeyError
        For an unknown name.
    DataError
        If the download fails (the message names the URL tried and how to place the
        file by hand) or the downloaded bytes do not have the recorded SHA-256 (nothing
        is written then).
    """
    dataset = get_dataset(name)
    destination = data_dir() / dataset.filename
    if not force and destination.is_file():
        actual = sha256_of(destination)
        if actual == dataset.sha256:
            return destination
        if notify is not None:
            notify(f"{destination} failed its check (SHA-256 {actual}, expected {dataset.sha256}): the copy "
                   f"is damaged or not the published one; downloading {name} again")
    source = url or dataset.url
    if destination.parent.exists() and not destination.parent.is_dir():
        raise DataError(f"the data directory {destination.parent} is a file, not a directory "
                        f"(set {DATA_DIR_ENV} to a directory)")
    try:
        destination.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DataError(f"cannot create the data directory {destination.parent}: {exc.strerror or exc} "
                        f"(set {DATA_DIR_ENV} to use another directory)") from exc
    digest = hashlib.sha256()
    fd, tmp_name = tempfile.mkstemp(prefix=f".{dataset.filename}.", suffix=".part", dir=destination.parent)
    try:
        with os.fdopen(fd, "wb") as out:
            try:
                with urllib.request.urlopen(source, timeout=timeout) as response:
                    length = response.headers.get("Content-Length")
                    total = int(length) if length and length.isdigit() else None
                    done = 0
                    for chunk in iter(lambda: response.read(_CHUNK_BYTES), b""):
                        out.write(chunk)
                        digest.update(chunk)
                        done += len(chunk)
                        if progress is not None:
                            progress(done, total)
            except (urllib.error.URLError, OSError, ValueError) as exc:
                reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
                raise DataError(f"cannot download {name} from {source}: {reason}. "
                                f"{_manual_instructions(dataset)}") from exc
        actual = digest.hexdigest()
        if actual != dataset.sha256:
            raise DataError(f"the download of {name} from {source} has SHA-256 {actual}, expected {dataset.sha256}; "
                            f"nothing was saved. {_manual_instructions(dataset)}")
        os.replace(tmp_name, destination)
    finally:
        if os.path.exists(tmp_name):
            os.unlink(tmp_name)
    return destination


def resolve(name_or_path: str) -> str:
    """The file a command argument stands for: an existing path, or a dataset name.

    Parameters
    ----------
    name_or_path : str
        A path, or a name from :data:`DATASETS`. An existing path wins over a name.

    Returns
    -------
    str
        ``name_or_path`` itself if it exists; else the path of the downloaded dataset.

    Raises
    ------
    DataError
        If it names a dataset that is not downloaded (or whose copy fails the SHA-256
        check); the message says to run ``pagedkv data fetch NAME``.
    FileNotFoundError
        If it is neither an existing path nor a dataset name; the message lists the
        names.
    """
    if os.path.exists(name_or_path):
        return name_or_path
    if name_or_path in DATASETS:
        return str(verify(name_or_path))
    raise FileNotFoundError(f"no such file: {name_or_path} (nor a dataset name: {', '.join(DATASETS)}; "
                            "see `pagedkv data list`)")


__all__ = ["DATASETS", "DATA_DIR_ENV", "DataError", "Dataset", "data_dir", "dataset_path",
           "fetch", "get_dataset", "resolve", "sha256_of", "verify"]
