"""The engine's Triton kernels compiled for a GPU architecture on a machine without a GPU.

`launches(cc)` records every kernel launch the engine's own Python wrappers make, as they would make them on a
GPU of compute capability `cc`: Triton's launcher runs as usual up to the compile (binding the arguments,
specializing on dtypes and alignment, reading the constexprs and the launch options) and a cache hook then
records the launch and stops it. `arch.pretend(cc)` makes the wrappers take the decisions they take on that
GPU (the fp8 operand, PDL, the inline-PTX store). `compile_all` compiles each recorded launch for that
architecture with Triton's own compiler and ptxas, and returns each kernel's shared memory and registers.

This stands in for the CUDA driver (there is none here) with an object that names the target and launches
nothing; what it checks is the compiler's verdict, which needs no GPU.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.driver import driver

from labkit.engine.model import arch

ARCHS = (80, 86, 89, 90)
# the largest shared memory one block may ask for (`arch.SMEM_PER_BLOCK`: 163 KB on sm_80, 99 KB on sm_86 and
# sm_89, 227 KB on sm_90)
SMEM_LIMIT = {cc: arch.SMEM_PER_BLOCK[(cc // 10, cc % 10)] for cc in ARCHS}
REGS_LIMIT = 255


@dataclass
class Launch:
    fn: object               # the JITFunction
    signature: dict
    constants: dict
    attrs: dict
    num_warps: int
    num_stages: int

    @property
    def name(self) -> str:
        return self.fn.fn.__name__

    def const(self, arg: str):
        """The constexpr `arg` of this launch (None when it is not one)."""
        i = self.fn.arg_names.index(arg)
        return self.constants.get((i,), self.constants.get(arg))

    def operands(self) -> tuple:
        """The pointer arguments' element types: launches that differ only in constexprs share them."""
        return tuple(sorted((k, v) for k, v in self.signature.items() if str(v).startswith("*")))

    def key(self) -> tuple:
        return (self.name, repr(sorted(self.signature.items())), repr(sorted(self.constants.items(), key=str)),
                repr(sorted(self.attrs.items(), key=str)), self.num_warps, self.num_stages)


class _NoLaunchDriver:
    """What Triton's launcher asks of the active driver before it compiles: a device (the architecture itself,
    so each architecture gets its own binder cache), a stream and the target."""

    def __init__(self, cc: int):
        self.cc = cc

    def get_current_device(self):
        return self.cc

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return GPUTarget("cuda", self.cc, 32)


@contextlib.contextmanager
def launches(cc: int):
    """Record, in the list this yields, each kernel launch made inside the block as on a GPU of capability cc
    (80, 86, 89, 90); no kernel runs, so the wrappers' outputs are left unwritten."""
    recorded: list[Launch] = []

    def hook(*, fn, compile, **_):
        recorded.append(Launch(fn.jit_function, dict(compile["signature"]), dict(compile["constants"]),
                               dict(compile["configs"][0]), compile["num_warps"], compile["num_stages"]))
        return True                         # skip the compile and the launch: compile_all does the compile

    saved, saved_driver = knobs.runtime.jit_cache_hook, driver._active
    knobs.runtime.jit_cache_hook = hook
    driver.set_active(_NoLaunchDriver(cc))
    try:
        with arch.pretend((cc // 10, cc % 10)):
            yield recorded
    finally:
        knobs.runtime.jit_cache_hook = saved
        driver._active = saved_driver


def unique(recorded: list[Launch]) -> list[Launch]:
    seen, out = set(), []
    for r in recorded:
        if r.key() not in seen:
            seen.add(r.key())
            out.append(r)
    return out


def compile_one(launch: Launch, cc: int) -> dict:
    """Compile one recorded launch for capability cc; its name, shared memory and registers."""
    src = ASTSource(fn=launch.fn, signature=launch.signature, constexprs=launch.constants, attrs=launch.attrs)
    k = triton.compile(src, target=GPUTarget("cuda", cc, 32),
                       options={"num_warps": launch.num_warps, "num_stages": launch.num_stages})
    return {"kernel": launch.name, "cc": cc, "shared": k.metadata.shared, "regs": k.n_regs if hasattr(k, "n_regs")
            else None, "warps": launch.num_warps}
