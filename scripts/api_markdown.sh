#!/usr/bin/env bash
# The API reference as Markdown, readable where the repository is browsed: builds the Sphinx
# sources of docs/ with sphinx-markdown-builder (the `docs` extra pins it and Sphinx, so the
# output depends only on the docstrings), adds the anchors its in-page links need
# (scripts/api_markdown_anchors.py) and writes docs/reference/api.md.
#
# Usage: bash scripts/api_markdown.sh           regenerate docs/reference/api.md
#        bash scripts/api_markdown.sh --check   fail if it differs from the docstrings (CI)
# Needs the package importable (installed, or built in place with PYTHONPATH) and the extra:
# pip install -r <(python scripts/extra_requirements.py docs)
set -euo pipefail
cd "$(dirname "$0")/.."
out=$(mktemp -d "${TMPDIR:-/tmp}/pagedkv-api-md.XXXXXX")
trap 'rm -rf "$out"' EXIT
sphinx-build -W --keep-going -q -b markdown docs "$out"
{
    echo "<!-- Generated from the docstrings by scripts/api_markdown.sh: do not edit by hand. -->"
    echo
    # The other pages of docs/ are one directory up from docs/reference/; every object
    # heading gets the anchor its links name (the builder writes them for modules only).
    sed -E 's/\]\(([a-z_]+\.md)/](..\/\1/g' "$out/api.md" | python scripts/api_markdown_anchors.py
} > "$out/reference.md"
if [ "${1:-}" = "--check" ]; then
    if ! diff -u docs/reference/api.md "$out/reference.md" > "$out/diff"; then
        head -40 "$out/diff" >&2
        echo "api_markdown.sh: docs/reference/api.md is out of date; run: bash scripts/api_markdown.sh" >&2
        exit 1
    fi
    echo "api_markdown.sh: docs/reference/api.md matches the docstrings"
else
    mkdir -p docs/reference
    cp "$out/reference.md" docs/reference/api.md
    echo "api_markdown.sh: wrote docs/reference/api.md"
fi
