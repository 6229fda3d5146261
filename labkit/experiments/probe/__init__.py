"""`labkit run probe`: the host link's limits for sparse KV gathers — contiguous pinned and pageable copies,
one copy per row, a CPU gather + one DMA, the zero-copy gather kernel, the same rows from device memory — and
the selection kernels' speed; on a host with 2 or more GPUs, NCCL all-reduce among them at a tensor-parallel decode
step's sizes (what `labkit predict --split tensor --calibration` reads). Every speed plot of the lab draws its bound
from these. Code: `labkit.experiments.probe.measure`, over `labkit.experiments.device_rates` (the link and device
rates other runs measure too), and `labkit.experiments.probe.allreduce`."""
from __future__ import annotations

from ...params import DEVICE, OUT_DIR, Param
from ... import lazy
from .. import planner

NAME = "probe"

SPEC = [
    DEVICE,
    Param("pool_gib", "float", 0.0, "host pool to gather from (0: 24 GiB on CUDA, 0.25 on CPU)", ge=0, unit="GiB"),
    Param("repeats", "int", 20, "timed calls per measurement (interleaved rounds)", gt=0),
    OUT_DIR,
]


measuring = lazy.module(".measure", __package__)     # imported once the parameters resolved
plan = planner(NAME, SPEC, measuring)
ProbePlan = plan.type        # the checked plan: plan.device, plan.pool_gib, plan.repeats, plan.out_dir


def run(plan: ProbePlan, progress_bar: bool = True):
    return measuring.run(plan, progress_bar=progress_bar)
