"""Triton's interpreter (TRITON_INTERPRET=1: the kernels run in numpy on CPU tensors, the tests' way of checking
them without a GPU) without a cost that is not the kernels'.

A launch patches `triton.language` for the interpreter (each builtin wrapped) and undoes it at its end. Each call
of a `@triton.jit` helper from inside the kernel patches again (Triton 3.x, `InterpretedFunction.__call__`): a scan
of the package's members, ~0.7 ms, that finds every builtin wrapped already, and is never undone. A kernel calling
helpers in its loops spent a third of its time there (sparse prefill's interpreter check: 49 -> 33 s of CPU).
`fast_device_calls` makes a helper call patch each set of language modules once a launch (the first call from a
module that sees `triton.language.core`, as Triton's own helpers do, still patches it); the kernel runs the same
ops on the same values.
"""
from __future__ import annotations

import inspect
import os

ON = os.environ.get("TRITON_INTERPRET", "0") == "1"
try:  # only under the interpreter, and Triton is optional
    if ON:
        import triton.language as tl
        from triton.runtime import interpreter as ti
except Exception:  # pragma: no cover - depends on the install
    ON = False

_patched: set[int] = set()       # ids of the language modules patched in the running launch
_langs: dict = {}                # helper -> ids of the language modules its globals name


def _launch(run):
    def launch(self, *args, **kwargs):
        _patched.clear()         # the launch's own patch is undone at its end: helpers patch again in the next
        return run(self, *args, **kwargs)
    return launch


def _device_call(self, *args, **kwargs):
    langs = _langs.get(self.fn)
    if langs is None:
        langs = _langs[self.fn] = frozenset(id(v) for v in self.fn.__globals__.values()
                                            if inspect.ismodule(v) and v in (tl, tl.core))
    if not langs <= _patched:
        ti._patch_lang(self.fn)
        _patched.update(langs)
    fn = self.rewrite()
    try:
        return fn(*args, **kwargs)
    except Exception as e:
        raise ti.InterpreterError(repr(e)) from e


def fast_device_calls() -> bool:
    """Install the once-a-launch patching (idempotent); False where this Triton's interpreter has not the shape it
    was written for (then nothing changes)."""
    if not ON:
        return False
    f, g = ti.InterpretedFunction, ti.GridExecutor
    if getattr(f.__call__, "__name__", "") == "_device_call":
        return True
    if not all(hasattr(x, n) for x, n in ((ti, "_patch_lang"), (ti, "InterpreterError"), (f, "rewrite"),
                                          (g, "__call__"))):
        return False
    g.__call__ = _launch(g.__call__)
    f.__call__ = _device_call
    return True
