"""docs/reference/api.md: every in-page link of the Markdown API reference has its anchor."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FILTER = ROOT / "scripts" / "api_markdown_anchors.py"
REFERENCE = ROOT / "docs" / "reference" / "api.md"
pytestmark = pytest.mark.skipif(not FILTER.is_file() or not REFERENCE.is_file(),
                                reason="scripts/ and docs/ are not beside the tests (installed-wheel run)")

SAMPLE = """\
<a id="module-pagedkv"></a>

### *class* pagedkv.KVCache(num_layers)

#### seal(self, seq_ids=None)

See [seal()](#pagedkv.KVCache.seal), [load](#pagedkv.KVCache.load), [f](#pagedkv.snapshot.load_cache).

#### *classmethod* load(cls, path)

### Notes

### pagedkv.snapshot.load_cache(path, \\*, mmap=False)

#### not_a_member

"""


def _run_filter(text):
    return subprocess.run([sys.executable, str(FILTER)], input=text, capture_output=True, text=True, check=False)


def test_the_filter_anchors_classes_members_and_functions():
    result = _run_filter(SAMPLE)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    for name in ("pagedkv.KVCache", "pagedkv.KVCache.seal", "pagedkv.KVCache.load", "pagedkv.snapshot.load_cache"):
        assert out.count(f'<a id="{name}"></a>\n\n') == 1, name
    assert out.index('<a id="pagedkv.KVCache.seal">') < out.index("#### seal(")
    assert "Notes\"" not in out and "pagedkv.snapshot.load_cache.not_a_member" not in out  # a function has no members


def test_the_filter_fails_on_a_link_without_an_anchor():
    result = _run_filter(SAMPLE.replace("#pagedkv.KVCache.load)", "#pagedkv.KVCache.lost)"))
    assert result.returncode == 1 and "pagedkv.KVCache.lost" in result.stderr


def test_every_link_of_the_committed_reference_has_an_anchor():
    text = REFERENCE.read_text(encoding="utf-8")
    anchors = set(re.findall(r'<a id="([^"]+)"></a>', text))
    links = set(re.findall(r"\]\(#([\w.]+)\)", text))
    assert links and not links - anchors, sorted(links - anchors)
