"""Run an experiment's notebook under papermill into a run folder, then render its report.

This is what `labkit run`, `make sweep` and the nightly runner call: one papermill run (one kernel) per
experiment, so a crash or an out-of-memory in one cannot poison the next. The caller has planned the
experiment (`experiments.plan`: parsed and checked once, bad input one line before anything is written);
the notebook receives that frozen plan as one JSON parameter, `plan`, and runs it as it is.
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
from pathlib import Path

from .params import BadInput, Plan
from .results import REPO, new_run_id

NOTEBOOKS = REPO / "notebooks"


def notebook_parameters(path: Path) -> set[str]:
    """The names a notebook's `parameters` cell sets (a plain notebook run by the nightly)."""
    import papermill
    return set(papermill.inspect_notebook(str(path)).keys())

# ipykernel logs "Kernel is running over TCP without encryption ..." at every start: a warning about the
# kernel's 127.0.0.1 sockets that a user of `make sweep` cannot act on. The kernel's own log is kept to
# errors; everything the notebook prints still comes through. (IPC sockets would avoid the warning, but
# nbclient then no longer enforces cell timeouts, which the nightly runner relies on.)
KERNEL_ARGS = {"extra_arguments": ["--IPKernelApp.log_level=ERROR"]}


def rerender_notebook(exp, run_dir: str | Path) -> Path:
    """Execute the experiment's notebook against an existing run folder (`run_dir=`): today's figures of the
    tables the run wrote, nothing measured again. The executed notebook replaces the folder's; the first
    execution's papermill record (parameters, times) is kept under `metadata.labkit.measured_by`."""
    import nbformat
    import papermill as pm
    run_dir = Path(run_dir).resolve()
    target = run_dir / exp.notebook
    measured = None
    if target.is_file():
        old = nbformat.read(target, as_version=4).metadata
        measured = old.get("labkit", {}).get("measured_by") or old.get("papermill")
    where = os.path.relpath(run_dir, REPO) if run_dir.is_relative_to(REPO) else str(run_dir)
    os.environ["LABKIT_PLAIN_PROGRESS"] = "1"
    pm.execute_notebook(str(NOTEBOOKS / exp.notebook), str(target), parameters={"run_dir": where}, progress_bar=False,
                        cwd=str(REPO), kernel_name="python3", **KERNEL_ARGS)
    if measured:
        nb = nbformat.read(target, as_version=4)
        nb.metadata.setdefault("labkit", {})["measured_by"] = measured
        nbformat.write(nb, target)
    return target


@contextlib.contextmanager
def _sigint_to_kernels():
    """Ctrl-C reaches only this process (a Jupyter kernel runs in a session of its own): pass it on to our
    kernels, so the experiment's own clean-up runs there (servers stopped, run folder marked interrupted) and
    the cell fails with KeyboardInterrupt. A second Ctrl-C interrupts this process as usual."""
    import signal

    import psutil
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    me = psutil.Process()

    def forward(signum, frame):
        signal.signal(signal.SIGINT, old)
        for ch in me.children(recursive=True):
            try:
                if any("ipykernel" in a for a in ch.cmdline()):
                    ch.send_signal(signal.SIGINT)
            except psutil.Error:
                pass

    old = signal.signal(signal.SIGINT, forward)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


def run_notebook(plan: Plan, out_dir: str | Path | None = None, root: str | Path = "results",
                 log_output: bool = True, timeout: int | None = None) -> tuple[Path, Exception | None]:
    """Execute the plan's notebook into a run folder; returns (folder, error or None). The report is rendered
    even when the notebook failed part-way (what was measured is kept)."""
    import papermill as pm

    from .experiments import get
    exp = get(plan.experiment)
    nb = NOTEBOOKS / exp.notebook
    if not nb.is_file():
        raise BadInput(f"notebook {nb} is missing")
    out = Path(out_dir or plan.params.get("out_dir") or Path(root) / new_run_id(plan.experiment))
    if (out / "metrics.parquet").exists():
        raise BadInput(f"{out} already holds a run; choose another --out")
    out.mkdir(parents=True, exist_ok=True)
    plan = plan.replace(out_dir=str(out.resolve()))
    os.environ["LABKIT_PLAIN_PROGRESS"] = "1"
    error = None
    try:
        with _sigint_to_kernels():
            pm.execute_notebook(str(nb), str(out / exp.notebook), parameters={"plan": plan.to_json()},
                                log_output=False, progress_bar=False, cwd=str(REPO), kernel_name="python3",
                                execution_timeout=timeout, stdout_file=sys.stdout if log_output else None,
                                stderr_file=sys.stderr if log_output else None, **KERNEL_ARGS)
    except Exception as ex:     # PapermillExecutionError, dead kernel: keep what was measured
        error = ex
    try:
        from .report.notebook import render_report
        render_report(out)
    except Exception as ex:
        error = error or ex
    return out, error


def run_experiment(name: str, given: dict, out_dir: str | Path | None = None, **kw) -> tuple[Path, Exception | None]:
    """Plan experiment `name` from `given` (one BadInput line on bad input), then `run_notebook`."""
    from .experiments import plan
    return run_notebook(plan(name, given), out_dir, **kw)
