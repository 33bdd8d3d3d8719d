"""The Python examples of README.md run as written."""
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks():
    if not README.is_file():
        return []
    return re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.S)


@pytest.mark.skipif(not README.is_file(), reason="README.md is not beside the tests (installed-wheel run)")
@pytest.mark.parametrize("index", range(len(python_blocks()) or 1))
def test_readme_python_example_runs(index, capsys):
    blocks = python_blocks()
    assert blocks, "README.md has no ```python example"
    if "LlamaModel.from_gguf()" in blocks[index]:
        # The model API example needs SmolLM2-135M and the model extras.
        for module in ("gguf", "tokenizers", "threadpoolctl"):
            pytest.importorskip(module, reason=f"the model example needs {module}")
        from pagedkv.models import find_smollm2_gguf

        try:
            find_smollm2_gguf()
        except FileNotFoundError as exc:
            pytest.skip(str(exc))
    if "pagedkv.metrics" in blocks[index]:
        pytest.importorskip("prometheus_client", reason='the metrics example needs pip install "pagedkv[metrics]"')
    exec(compile(blocks[index], f"README.md example {index}", "exec"), {})
    printed = capsys.readouterr().out
    if "LlamaModel.from_gguf()" in blocks[index]:
        # The greedy answer the example's comment promises, then the speed line.
        assert "The capital of France is Paris." in printed and "decode: " in printed
    if "layer_attention=" in blocks[index]:
        assert "[5, 5, 5, 5, 5, 19]\n44\n" in printed, printed
    if "[ 0 10 20 30] [4 3 4]" in blocks[index]:
        # The output the example's comments promise.
        assert "[ 0 10 20 30] [4 3 4]" in printed and "\n20\n" in "\n" + printed
