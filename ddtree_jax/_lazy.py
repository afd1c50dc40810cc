"""PEP 562 lazy exports shared by the package ``__init__`` files: a public name is imported from
its defining module on first use, so importing the package (and the command line's argument
checks) does not import JAX."""

from __future__ import annotations

import importlib
from collections.abc import Callable


def lazy_exports(package: str, exports: dict[str, str], namespace: dict) -> tuple[Callable, Callable]:
    """``(__getattr__, __dir__)`` for ``package`` whose names map to modules in ``exports``;
    ``namespace`` is the package's ``globals()`` (a resolved name is cached there)."""

    def __getattr__(name: str):
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def __dir__():
        return sorted(set(namespace) | set(exports))

    return __getattr__, __dir__
