"""Ember: an OpenAI- and Anthropic-compatible LLM inference server.

In a source checkout the subpackages live in top-level folders (`kernels/` is `ember.kernels`, ...). When the
checkout's root is on `sys.path` (pytest, `python -m`, a script that adds it), those folders would also be found as
top-level packages and shadow installed distributions of the same name: Hugging Face's `kernels`, which transformers
5.25 and later imports, is one. `_CheckoutShadowFinder` makes such a top-level import find the installed
distribution; Ember's own code imports its folders only as `ember.<name>`.
"""
from __future__ import annotations

import importlib.machinery
import sys
from pathlib import Path

_CHECKOUT = Path(__file__).resolve().parent.parent
_FOLDERS = frozenset({"kernels", "engine", "server", "parsers", "grammar"})


def _is_checkout(entry: object) -> bool:
    try:
        return Path(str(entry) or ".").resolve() == _CHECKOUT
    except (OSError, ValueError):
        return False


class _CheckoutShadowFinder:
    """Finds a top-level import of one of the checkout's folder names on `sys.path` without the checkout's root;
    when no installed distribution has the name, the normal search goes on (and finds the folder, as before)."""

    @classmethod
    def find_spec(cls, name: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec | None:
        if path is not None or name not in _FOLDERS:
            return None
        return importlib.machinery.PathFinder.find_spec(name, [p for p in sys.path if not _is_checkout(p)])


if (_CHECKOUT / "pyproject.toml").is_file() and all((_CHECKOUT / name).is_dir() for name in _FOLDERS):
    sys.meta_path.insert(0, _CheckoutShadowFinder)
