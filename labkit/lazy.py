"""`module(name, package)`: a stand-in that imports `name` (relative to `package` when it starts with a dot)
on first attribute access.

The command line lists experiments and parses their parameters (strategy settings included) without
importing torch, Triton or plotly, so bad input fails in a second; the modules that declare those
parameters use heavy packages only inside the functions that measure.
"""
from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType


class _Lazy(ModuleType):
    def __init__(self, name: str):
        super().__init__(name)
        self.__dict__["_lazy_target"] = name

    def __getattr__(self, attr: str):
        mod = importlib.import_module(self.__dict__["_lazy_target"])
        return getattr(mod, attr)


def module(name: str, package: str | None = None) -> ModuleType:
    """`package` resolves a relative `name` (".measure" from an experiment's `__package__`); nothing is imported
    here. tests/test_layout.py counts a labkit module named this way as an import of it."""
    return _Lazy(importlib.util.resolve_name(name, package) if name.startswith(".") else name)
