"""Compiled core of pagedkv (Cython). Use the public API in ``pagedkv`` instead.

Run from the root of a source checkout (``python -c``, ``python -m``, a REPL),
Python finds this source directory before the installed package. When the
directory holds no compiled modules (the checkout was installed with
``pip install .``, not built in place), the compiled modules are imported
from the installed copy instead.
"""
from __future__ import annotations

import importlib.machinery as _machinery
import os as _os
import sys as _sys


def _has_compiled_core(directory: str) -> bool:
    return any(_os.path.isfile(_os.path.join(directory, "_pool" + suffix))
               for suffix in _machinery.EXTENSION_SUFFIXES)


def _installed_core(here: str) -> str | None:
    """Directory of another ``pagedkv_c`` that holds compiled modules, or None."""
    for finder in _sys.meta_path:
        find_spec = getattr(finder, "find_spec", None)
        if find_spec is None:
            continue
        if finder is _machinery.PathFinder:
            # Every sys.path entry but the one that resolves to this directory.
            paths = [entry for entry in _sys.path
                     if _os.path.realpath(_os.path.join(entry or _os.getcwd(), "pagedkv_c")) != here]
            spec = find_spec("pagedkv_c", paths)
        else:  # e.g. the finder of an editable install
            try:
                spec = find_spec("pagedkv_c", None)
            except Exception:  # a third-party finder that cannot answer
                continue
        locations = list(spec.submodule_search_locations or []) if spec is not None else []
        for location in locations:
            if _os.path.realpath(location) != here and _has_compiled_core(location):
                return str(location)
    return None


_here = _os.path.realpath(__path__[0])
if not _has_compiled_core(_here):
    _installed = _installed_core(_here)
    if _installed is not None:
        __path__.append(_installed)
