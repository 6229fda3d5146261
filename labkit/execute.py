"""Run an experiment's notebook under papermill into a run folder, then render its report.

This is what `labkit run`, `make sweep` and the nightly runner call: one papermill run (one kernel) per
experiment, so a crash or an out-of-memory in one cannot poison the next. The caller has planned the
experiment (`experiments.plan`: parsed and checked once, bad input one line before anything is written);
the notebook receives that frozen plan as one JSON parameter, `plan`, and runs it as it is.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import nbformat
import pandas as pd
import papermill as pm
import psutil
from papermill.iorw import LocalHandler, papermill_io

from . import envs, experiments
from .atomic import check_writable, describe_os_error, write_bytes, write_text, write_text_or_in_place
from .outdir import make_fresh_folder, prepare_out_dir
from .params import BadInput, Plan
from .report.notebook import render_report
from .results import REPO, derive_status, git_sha, machine_info, new_run_id
from .stops import measured_points

NOTEBOOKS = REPO / "notebooks"


def notebook_parameters(path: Path) -> set[str]:
    """The names a notebook's `parameters` cell sets (a plain notebook run by the nightly)."""
    return set(pm.inspect_notebook(str(path)).keys())

# ipykernel logs "Kernel is running over TCP without encryption ..." at every start: a warning about the
# kernel's 127.0.0.1 sockets that a user of `make sweep` cannot act on. The kernel's own log is kept to
# errors; everything the notebook prints still comes through. (IPC sockets would avoid the warning, but
# nbclient then no longer enforces cell timeouts, which the nightly runner relies on.)
KERNEL_ARGS = {"extra_arguments": ["--IPKernelApp.log_level=CRITICAL"]}


class _WholeNotebookWrites:
    """papermill's I/O for absolute local paths, except that each save of the executed notebook (papermill
    saves after every cell) replaces it whole through `atomic.write_text`: never written through a link
    planted at its name, never left half-written by a full disk or a kill. Reads are papermill's own."""

    def __init__(self):
        self._local = LocalHandler()

    def read(self, path):
        return self._local.read(path)

    def listdir(self, path):
        return self._local.listdir(path)

    def write(self, buf, path):
        write_text(path, buf)

    def pretty_path(self, path):
        return path


_whole_writes_on = False


def notebook_writes_whole() -> None:
    """Route papermill's writes to absolute paths through `_WholeNotebookWrites` (once per process); callers
    pass absolute output paths."""
    global _whole_writes_on
    if not _whole_writes_on:
        papermill_io.register("/", _WholeNotebookWrites())     # checked before papermill's own "local"
        _whole_writes_on = True


def rerender_notebook(exp, run_dir: str | Path) -> Path:
    """Execute the experiment's notebook against an existing run folder (`run_dir=`): today's figures of the
    tables the run wrote, nothing measured again. The executed notebook replaces the folder's; the first
    execution's papermill record (parameters, times) is kept under `metadata.labkit.measured_by`. When the
    execution fails, the folder's notebook is the one it had before (or none), not the failed one."""
    run_dir = Path(run_dir).resolve()
    target = run_dir / exp.notebook
    measured, before = None, None
    if target.is_file():
        before = target.read_bytes()
        old = nbformat.reads(before.decode("utf-8"), as_version=4).metadata
        measured = old.get("labkit", {}).get("measured_by") or old.get("papermill")
    where = os.path.relpath(run_dir, REPO) if run_dir.is_relative_to(REPO) else str(run_dir)
    envs.set_env("LABKIT_PLAIN_PROGRESS", "1")
    notebook_writes_whole()
    try:
        pm.execute_notebook(str(NOTEBOOKS / exp.notebook), str(target), parameters={"run_dir": where},
                            progress_bar=False, cwd=str(REPO), kernel_name="python3", **KERNEL_ARGS)
    except BaseException:
        with contextlib.suppress(OSError):
            if before is not None:
                write_bytes(target, before)
            else:
                target.unlink(missing_ok=True)
        raise
    if measured:
        nb = nbformat.read(target, as_version=4)
        nb.metadata.setdefault("labkit", {})["measured_by"] = measured
        write_text(target, nbformat.writes(nb))
    return target


@contextlib.contextmanager
def signals_to_kernels(seen: list):
    """Ctrl-C (or SIGTERM, e.g. from `timeout`, or SIGHUP, a closed SSH session or terminal) reaches only this
    process (a Jupyter kernel runs in a session of its own): pass it on to our kernels as SIGINT, so the experiment's own clean-up runs there (servers
    stopped, tables written) and the cell fails with KeyboardInterrupt; `seen` records the signal so the run
    ends `interrupted`. A second signal interrupts this process as usual."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    me = psutil.Process()
    sigs = (signal.SIGINT, *ENDING)

    def interrupt() -> bool:
        """SIGINT to every kernel of ours; whether there was one."""
        sent = False
        for ch in me.children(recursive=True):
            try:
                if any("ipykernel" in a for a in ch.cmdline()):
                    ch.send_signal(signal.SIGINT)
                    sent = True
            except psutil.Error:
                pass
        return sent

    def when_up(deadline: float) -> None:
        # the signal came while the kernel was still starting: it goes to the kernel as soon as there is one,
        # or the run would go on to measure everything the user just stopped
        while time.monotonic() < deadline and not interrupt():
            time.sleep(0.2)

    def forward(signum, frame):
        seen.append(signum)
        for s, h in old.items():
            signal.signal(s, h)
        if not interrupt():
            threading.Thread(target=when_up, args=(time.monotonic() + 120,), daemon=True).start()

    old = {s: signal.signal(s, forward) for s in sigs}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


# Signals that end the driver itself, not just the run (SIGTERM: asked to stop; SIGHUP: its terminal is gone)
ENDING = (signal.SIGTERM, signal.SIGHUP)


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP reached the driver during a run: raised by `run_notebook` after the run folder was
    settled (`interrupted`) and its report rendered, so a driver that loops over runs stops as the signal asks."""

    def __init__(self, path: Path, signum: int | None = None):
        self.signum = signum if signum is not None else signal.SIGTERM
        super().__init__(f"terminated ({signal.Signals(self.signum).name}) during the run in {path}")
        self.path = path


def error_line(err: BaseException) -> str:
    """One line for an error: papermill's `ename: evalue` with a KeyboardInterrupt that carries no message
    named for what it was, never a bare `KeyboardInterrupt:`."""
    ename = getattr(err, "ename", None)
    if ename:
        evalue = (getattr(err, "evalue", "") or "").strip()
        if not evalue:
            evalue = "interrupted by a signal" if ename == "KeyboardInterrupt" else "no message"
        return f"{ename}: {evalue.splitlines()[-1]}"
    text = str(err).strip()
    if isinstance(err, KeyboardInterrupt) or not text:
        text = text or ("interrupted by a signal" if isinstance(err, KeyboardInterrupt) else "no message")
    return f"{type(err).__name__}: {text.splitlines()[-1]}"


def _was_interrupt(err: BaseException | None) -> bool:
    return isinstance(err, KeyboardInterrupt) or getattr(err, "ename", None) == "KeyboardInterrupt"


def settle_status(out: Path, experiment: str, params: dict, error: BaseException | None, interrupted: bool,
                  started: float | None = None, stopped_by: int | None = None) -> str:
    """After the notebook: make the manifest's status the shared rule's verdict. The notebook's own finish
    path writes it when it ran to the end; a signal, a dead kernel or an exception outside that path leaves
    `running` (or an `ok` over the rows measured so far), so the status is derived here from the rows and
    how the kernel ended. A folder the notebook never got to make a manifest in (stopped while the kernel
    was starting) gets one with the machine it ran on and the wall time since `started` (the driver's start).
    `stopped_by`: the signal the driver received, recorded by name (`stopped_by`) for the stop's words."""
    mf_path = out / "manifest.json"
    try:
        mf = json.loads(mf_path.read_text())
    except (OSError, ValueError):
        t0 = dt.datetime.fromtimestamp(started, dt.timezone.utc) if started else dt.datetime.now(dt.timezone.utc)
        mf = {"run_id": out.name, "experiment": experiment, "created": t0.isoformat(timespec="seconds"),
              "git_sha": git_sha(), **machine_info(), "parameters": params, "status": "running"}
    interrupted = interrupted or _was_interrupt(error)
    if error is None and not interrupted and mf.get("status") not in (None, "running"):
        return mf["status"]              # the notebook finished and wrote its verdict
    try:
        m = pd.read_parquet(out / "metrics.parquet")
        sts = list(m["status"]) if "status" in m else []
    except Exception:
        sts = []
    status = derive_status(sts, interrupted=interrupted, error=error is not None or mf.get("status") == "running")
    if mf.get("status") in ("failed",) and not interrupted:
        status = "failed"                # the notebook's own word that nothing counts
    mf["status"] = status
    if error is not None:
        mf["error"] = error_line(error)
    elif interrupted:
        mf["error"] = "interrupted by a signal"
    if interrupted and stopped_by is not None:
        mf["stopped_by"] = signal.Signals(int(stopped_by)).name
    if started:                          # from the driver's start: the kernel's start-up counts too
        mf["wall_s"] = round(time.time() - started, 1)
    elif "wall_s" not in mf and mf.get("created"):
        try:
            mf["wall_s"] = round((dt.datetime.now(dt.timezone.utc) - dt.datetime.fromisoformat(mf["created"])).total_seconds(), 1)
        except ValueError:
            pass
    write_text_or_in_place(mf_path, json.dumps(mf, indent=1, default=str))   # whole; in place on a full disk
    return status


def drop_broken_notebook(path: Path) -> bool:
    """Remove an executed notebook that is not whole JSON (papermill's last write was cut off, e.g. by a
    full disk): a file is whole or absent, and removing it frees the space the status needs. True if removed."""
    if not path.is_file():
        return False
    try:
        with open(path, encoding="utf-8") as f:
            json.load(f)
        return False
    except (ValueError, UnicodeDecodeError):
        path.unlink()
        return True


def run_notebook(plan: Plan, out_dir: str | Path | None = None, root: str | Path = "results",
                 log_output: bool = True, timeout: int | None = None,
                 signals: list | None = None) -> tuple[Path, Exception | None]:
    """Execute the plan's notebook into a run folder; returns (folder, error or None). The report is rendered
    even when the notebook failed part-way (what was measured is kept). `signals`: a list that receives the
    signals that interrupted the run (a caller that loops over runs stops on them)."""
    exp = experiments.get(plan.experiment)
    nb = NOTEBOOKS / exp.notebook
    if not nb.is_file():
        raise BadInput(f"notebook {nb} is missing")
    given = out_dir or plan.params.get("out_dir")
    # no folder given: a new one made here (`-2`, ... when another run took the id in the same second)
    out = prepare_out_dir(Path(given) if given else make_fresh_folder(Path(root), new_run_id(plan.experiment), "--root"),
                          others_ok=out_dir is not None)     # a caller's own folder (the nightly's, with its log)
    # a read-only or foreign folder: one line before anything runs
    check_writable(out, "--out" if out_dir or plan.params.get("out_dir") else "run folder")
    plan = dataclasses.replace(plan, out_dir=str(out.resolve()))
    envs.set_env("LABKIT_PLAIN_PROGRESS", "1")
    envs.set_env("LABKIT_RUN_DRIVER", os.getpid())      # the manifest names us beside the kernel (stale check)
    error, seen, started = None, (signals if signals is not None else []), time.time()
    notebook_writes_whole()
    try:
        with signals_to_kernels(seen):
            pm.execute_notebook(str(nb), str((out / exp.notebook).absolute()), parameters={"plan": plan.to_json()},
                                log_output=False, progress_bar=False, cwd=str(REPO), kernel_name="python3",
                                execution_timeout=timeout, stdout_file=sys.stdout if log_output else None,
                                stderr_file=sys.stderr if log_output else None, **KERNEL_ARGS)
    except (Exception, KeyboardInterrupt) as ex:     # PapermillExecutionError, dead kernel: keep what was measured
        error = ex
    if drop_broken_notebook(out / exp.notebook) and error is None:
        error = OSError("the executed notebook was cut off while being written (is the disk full?)")
    try:
        settle_status(out, plan.experiment, dict(plan.params), error, bool(seen), started, seen[0] if seen else None)
    except OSError as ex:         # not even the status could be written (a full disk): say so, do not trace back
        error = error or ex
        print(f"labkit: the run's status could not be written: {describe_os_error(ex)}", file=sys.stderr)
    ending = next((s for s in seen if s in ENDING), None)
    if error is not None and ending is None:
        _draw_what_was_measured(exp, out)
    try:
        render_report(out)
    except Exception as ex:
        error = error or ex
    if ending is not None:
        raise Terminated(out, ending)
    return out, error


def _draw_what_was_measured(exp, out: Path) -> None:
    """A run stopped part-way (Ctrl-C, an error) with points measured: its notebook stopped at the measuring
    cell, so its figures were never drawn. Draw them from the folder's tables (`labkit report DIR --rerun`,
    nothing measured again); a second Ctrl-C skips this and keeps the notebook as it stopped."""
    try:
        n_ok = measured_points(pd.read_parquet(out / "metrics.parquet"), exp.name)     # the sweep's points, not probe rows
    except Exception:
        return
    if not n_ok:
        return
    print(f"labkit: drawing the {n_ok} point{'s' if n_ok != 1 else ''} measured before it stopped "
          f"(Ctrl-C skips this)", file=sys.stderr, flush=True)
    nb = out / exp.notebook
    keep = out / f".{exp.notebook}.as-stopped"
    if nb.is_file():
        write_bytes(keep, nb.read_bytes())
    try:
        rerender_notebook(exp, out)
        keep.unlink(missing_ok=True)
    except (Exception, KeyboardInterrupt) as ex:       # the stopped notebook stays; the report says --rerun
        if keep.is_file():
            keep.replace(nb)
        drop_broken_notebook(nb)        # a copy or redraw cut off (a full disk): whole or absent
        print(f"labkit: figures not drawn ({error_line(ex)})", file=sys.stderr, flush=True)


def run_experiment(name: str, given: dict, out_dir: str | Path | None = None, **kw) -> tuple[Path, Exception | None]:
    """Plan experiment `name` from `given` (one BadInput line on bad input), then `run_notebook`."""
    return run_notebook(experiments.plan(name, given), out_dir, **kw)
