"""`labkit run probe`: the host link's limits for sparse KV gathers — contiguous pinned and pageable copies,
one copy per row, a CPU gather + one DMA, the zero-copy gather kernel, the same rows from device memory — and
the selection kernels' speed. Every speed plot of the lab draws its bound from these. Code: `labkit.experiments.probe.measure`."""
from __future__ import annotations

from ...params import Param, Plan
from .. import checked

NAME = "probe"

SPEC = [
    Param("device", "str", "auto", "auto, cpu, cuda, cuda:N"),
    Param("pool_gib", "float", 0.0, "host pool to gather from (0: 24 GiB on CUDA, 0.25 on CPU)"),
    Param("repeats", "int", 20, "timed calls per measurement (interleaved rounds)"),
    Param("out_dir", "str", "", "run folder (empty: results/<run-id>)"),
]


def plan(given: dict) -> Plan:
    def check():          # the measuring module, imported once the parameters resolved
        from .measure import check
        return check
    return checked(NAME, SPEC, given, check)


def run(plan: Plan, progress_bar: bool = True):
    from . import measure as probe
    return probe.run(dict(plan.params), progress_bar=progress_bar)
