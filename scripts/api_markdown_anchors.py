"""Add an HTML anchor before each object heading of the Markdown API reference.

sphinx-markdown-builder writes links to objects as ``[name](#pagedkv.KVCache.seal)``
but an anchor only for each module, so in a Markdown viewer most links lead nowhere.
This filter (stdin to stdout, used by scripts/api_markdown.sh) puts
``<a id="QUALIFIED.NAME"></a>`` before the heading of every documented object: a
level-3 heading that names a qualified object (``### *class* pagedkv.KVCache``,
``### pagedkv.snapshot.load_cache(path, ...)``) and, under a class, each level-4
member heading (``#### seal(self, seq_ids=None)`` -> ``pagedkv.KVCache.seal``).
It exits 1, naming them, if a link still has no anchor.
"""
import re
import sys

_ROLE = r"(?:\*[a-z]+\* )*"  # *class*, *exception*, *classmethod*, *property*, ...
_OBJECT = re.compile(rf"^### {_ROLE}((?:pagedkv|pagedkv_c)(?:\.\w+)+)")
_CLASS = re.compile(r"^### \*(?:class|exception)\* ")
_MEMBER = re.compile(rf"^#### {_ROLE}(\w+)")
_ANCHOR = re.compile(r'<a id="([^"]+)"></a>')
_LINK = re.compile(r"\]\(#([\w.]+)\)")


def add_anchors(lines):
    """The lines with an anchor line before each object heading."""
    out, owner = [], None
    for line in lines:
        anchor = None
        if line.startswith("### "):
            match = _OBJECT.match(line)
            anchor = match.group(1) if match else None
            if match:  # another object starts: members that follow belong to it only if it is a class
                owner = anchor if _CLASS.match(line) else None
        elif line.startswith("#### ") and owner is not None:
            match = _MEMBER.match(line)
            anchor = f"{owner}.{match.group(1)}" if match else None
        if anchor is not None and not (out and f'<a id="{anchor}">' in out[-1]):
            out.append(f'<a id="{anchor}"></a>\n')
            out.append("\n")
        out.append(line)
    return out


def main():
    lines = add_anchors(sys.stdin.readlines())
    text = "".join(lines)
    anchors = set(_ANCHOR.findall(text))
    missing = sorted(set(_LINK.findall(text)) - anchors)
    if missing:
        print(f"api_markdown_anchors.py: links without an anchor: {', '.join(missing)}", file=sys.stderr)
        sys.stdout.write(text)
        return 1
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
