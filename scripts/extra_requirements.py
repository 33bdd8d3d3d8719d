"""Print the requirements of one optional extra of pyproject.toml, one per line.

CI installs an extra's dependencies with ``pip install -r <(python scripts/extra_requirements.py docs)``
when the package itself is already installed, so pip does not build it again.
"""
import argparse
import tomllib
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("extra", help="name of an optional-dependencies table entry, e.g. docs")
    args = parser.parse_args()
    extras = tomllib.loads(PYPROJECT.read_text())["project"]["optional-dependencies"]
    if args.extra not in extras:
        parser.error(f"unknown extra {args.extra!r}; pyproject.toml defines {sorted(extras)}")
    print("\n".join(extras[args.extra]))


if __name__ == "__main__":
    main()
