"""`module(name)`: a stand-in that imports `name` on first attribute access.

The command line lists experiments and parses their parameters (strategy settings included) without
importing torch, Triton or plotly, so bad input fails in a second; the modules that declare those
parameters use heavy packages only inside the functions that measure.
"""
from __future__ import annotations

import importlib
from types import ModuleType


class _Lazy(ModuleType):
    def __init__(self, name: str):
        super().__init__(name)
        self.__dict__["_lazy_target"] = name

    def __getattr__(self, attr: str):
        mod = importlib.import_module(self.__dict__["_lazy_target"])
        return getattr(mod, attr)


def module(name: str) -> ModuleType:
    return _Lazy(name)
