"""Coverage-guided fuzzer of pagedkv's public API (atheris / libFuzzer).

Usage (see README.md; libFuzzer options such as -max_total_time follow)::

    python tests/fuzz/fuzz_pagedkv.py tests/fuzz/corpus -max_total_time=120
    python tests/fuzz/fuzz_pagedkv.py --replay crash-<sha1>   # rerun one input, print the finding

A finding (a contract violation, an unexpected exception, a crash or a
sanitizer report) stops libFuzzer, which writes the input to ``crash-<sha1>``
(``-artifact_prefix=DIR/`` puts it elsewhere).
"""
import os
import sys

import numpy  # noqa: F401  (imported before instrumentation: its code is not the target)
import atheris

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]  # targets.py, and tests/ for reference_cache

# Python-level coverage of the targets and the reference model guides the
# mutations; the compiled core is reached through the paths they take.
with atheris.instrument_imports(include=["targets", "reference_cache", "pagedkv"]):
    import targets


def main(argv):
    if len(argv) > 1 and argv[1] == "--replay":
        for path in argv[2:]:
            with open(path, "rb") as f:
                targets.one_input(f.read())
            print(f"replayed {path}: no finding")
        return
    # internal_libfuzzer: use atheris' own libFuzzer even when a sanitizer
    # runtime that also defines libFuzzer's hooks is preloaded (README.md).
    atheris.Setup(argv, targets.one_input, internal_libfuzzer=True)
    atheris.Fuzz()


if __name__ == "__main__":
    main(sys.argv)
