"""Sphinx configuration: the API reference is generated from the numpydoc docstrings.

Build (from the repository root, with the package installed or built in place):
``pip install ".[docs]" && sphinx-build -W -b html docs docs/_build/html``.
"""
import inspect

import pagedkv

project = "pagedkv"
author = "The pagedkv authors"
copyright = "the pagedkv authors, MIT licence"
version = release = pagedkv.__version__

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.intersphinx",
    "numpydoc",
    "myst_parser",
]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
exclude_patterns = ["_build"]
root_doc = "index"

# Docstrings are numpydoc; Cython embeds each signature as the docstring's first line.
autodoc_default_options = {"members": True, "undoc-members": False, "show-inheritance": True}
autodoc_docstring_signature = True
autodoc_member_order = "bysource"
# The integrations import their engines at import time; the reference is built from their
# docstrings alone, the same whether or not the engines are installed.
autodoc_mock_imports = ["torch", "transformers", "vllm"]
numpydoc_show_class_members = False
numpydoc_class_members_toctree = False
numpydoc_xref_param_type = False

# Links between the Markdown pages and to heading anchors.
myst_heading_anchors = 3

html_theme = "alabaster"
html_static_path: list[str] = []
intersphinx_mapping: dict[str, tuple[str, None]] = {}

# The Markdown build (docs/reference/api.md, scripts/api_markdown.sh) keeps numpydoc's
# parameter types: sphinx-markdown-builder drops definition-list classifiers otherwise.
exclude_patterns.append("reference")


def _own_init_signature(app, what, name, obj, options, signature, return_annotation):
    """A class whose base is mocked (``autodoc_mock_imports``) shows its own ``__init__``'s signature."""
    init = getattr(obj, "__dict__", {}).get("__init__") if what == "class" else None
    if init is None or signature != "(*args: Any, **kwargs: Any)":
        return None
    own = inspect.signature(init)
    own = own.replace(parameters=list(own.parameters.values())[1:], return_annotation=inspect.Signature.empty)
    return str(own), return_annotation


def setup(app):
    """Render ``name : type`` in the Markdown builder (when it is installed)."""
    app.connect("autodoc-process-signature", _own_init_signature)
    try:
        from sphinx_markdown_builder.translator import MarkdownTranslator
    except ImportError:
        return

    def visit_classifier(self, node):
        self.add(" : ")

    def depart_classifier(self, node):
        pass

    def keep_text(self, node):
        """Abbreviations (``*args``) print as their text."""

    MarkdownTranslator.visit_classifier = visit_classifier
    MarkdownTranslator.depart_classifier = depart_classifier
    MarkdownTranslator.visit_abbreviation = keep_text
    MarkdownTranslator.depart_abbreviation = keep_text
