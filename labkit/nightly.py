"""`labkit nightly --plan FILE`: run a plan of experiments, one papermill run (one kernel) per entry.

A plan is a TOML file (`nightly/plan.toml` is the nightly; `plans/` holds the device batches, each named
by what it measures):

    [[entry]]
    name = "decode"                 # folder name under results/nightly-<date>/
    experiment = "decode"           # a registered experiment (`labkit run --help`) ...
    # notebook = "notebooks/x.ipynb"  ... or any other notebook with a `parameters` cell ...
    # tests = "-m gpu tests/test_gpu.py"  ... or pytest arguments (a device batch's GPU tests)
    timeout_s = 3600                # per cell (optional)
    [entry.parameters]              # the names `labkit run decode --help` lists; omitted ones keep their
    repeats = 3                     # defaults ("auto": sized to the hardware)
    [entry.cpu]                     # optional overrides used only where there is no CUDA GPU
    context_lens = "256,1024"

What it guarantees:
- **Checked first.** Every entry's keys and parameter names are checked, and every entry that will run
  (all, or those `--only` names) is planned (`experiments.plan`: types and values checked against this
  machine) before anything runs or is written, and runs that plan as it is; a plain notebook's names are
  checked against its `parameters` cell (papermill itself only warns). Bad input is one line.
- **Skips what this machine lacks.** An entry whose needs are missing here (vLLM not installed: a
  `params.Missing`) is skipped with that reason in `nightly.json` and `nightly.log`; the rest run.
- **Isolated.** Each entry runs in its own kernel via `labkit.execute.run_notebook` into
  `results/nightly-<date>/<name>/`; a failure (exception, timeout, dead kernel) is recorded and the
  next entry runs.
- **Recorded.** `nightly.json` (rewritten after every entry) holds each entry's status, wall time and
  error; a failed entry's folder holds `error.txt`; every entry's folder holds `log.txt` (the kernel's
  output) and `nightly-entry.json`; `nightly.log` holds the runner's own lines with times.
- **Locked, never stuck.** One nightly per folder (`.lock`); a lock whose holder crashed, was killed or
  did not survive a reboot is cleared, with a note in `nightly.log` and `nightly.json`.
- **Scheduled** by `nightly/systemd/` (a timer and a service) or `nightly/crontab` on the GPU box.
- **Resumable.** Running the same plan again for the same date skips entries already done (ok or
  partial); a failed entry is retried after its folder is moved aside to `<name>.attempt-N` (nothing
  is overwritten).
- **Stoppable.** SIGINT (Ctrl-C), SIGTERM or SIGHUP (the SSH session or terminal that started it closed)
  stops the whole night, not just the entry running: that
  entry's kernel gets the signal and its folder is settled `interrupted`, no later entry starts,
  `nightly.json` says `stopped` (which signal, during which entry, what is not done) and `nightly.log`
  says so; the command exits 128 + the signal's number, and the same command resumes the night.
- The run index (`results/index.html`) is rebuilt after every entry.
"""
from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:     # Python 3.10
    import tomli as tomllib

import papermill as pm
import psutil

from . import envs
from .atomic import check_writable, open_append, read_regular_at, write_text, write_text_or_in_place
from .execute import (KERNEL_ARGS, NOTEBOOKS, Terminated, notebook_parameters, notebook_writes_whole, run_notebook,
                      signals_to_kernels)
from .experiments import EXPERIMENTS, get, plan as plan_experiment
from .outdir import foreign_folder_problem, make_own_folder
from .params import BadInput, Missing, Param, check_table, one_line
from .report.index import rebuild_index
from .report.notebook import render_report
from .results import REPO
from .stops import exit_code, stop_line

DEFAULT_PLAN = REPO / "nightly" / "plan.toml"
# A plan entry's keys, declared as an experiment's parameters are (types as TOML gives them, bounds checked
# by `params.check_table`); what the entry runs is then checked by that experiment's own SPEC.
ENTRY_SPEC = [
    Param("name", "str", None, "the entry's folder under the night's folder (letters, digits, _ . -)"),
    Param("experiment", "str", None, "an experiment of `labkit run --help`"),
    Param("notebook", "str", None, "a plain notebook with a `parameters` cell"),
    Param("tests", "str", None, "pytest arguments"),
    Param("parameters", "table", {}, "parameters on every machine"),
    Param("cpu", "table", {}, "parameters on a machine without CUDA"),
    Param("cuda", "table", {}, "parameters on a CUDA machine"),
    Param("timeout_s", "int", None, "seconds before the entry is stopped", gt=0),
    Param("description", "str", "", "what the entry is for"),
    Param("on", "str", None, "the machine kind on a cluster (labkit/cluster); a local run ignores it"),
]
ENTRY_KEYS = {p.name for p in ENTRY_SPEC}
RESERVED = {"out_dir", "run_dir"}       # set by the runner
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
DONE = ("ok", "partial")
EVERY_KIND = "every kind"       # an entry's `on` on a cluster: the same entry on each machine kind present
KIND_RE = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,31}$")      # a machine kind: h200, rtx3090, cpu


@dataclass
class Entry:
    name: str
    notebook: Path
    parameters: dict
    experiment: str | None = None
    plan: object = None            # the experiment's frozen Plan, made when the plan file is loaded
    tests: str = ""                # pytest arguments, for a tests entry
    timeout_s: int | None = None
    description: str = ""
    raw: dict = field(default_factory=dict)
    skip: str = ""                 # why it cannot run on this machine (a missing need), else empty


def _has_cuda() -> bool:
    try:
        import torch        # loaded only to ask for a GPU; a missing or broken torch reads as none
        return torch.cuda.is_available()
    except Exception:
        return False


def _resolve_notebook(nb: str, plan_dir: Path) -> Path:
    p = Path(nb)
    for cand in ([p] if p.is_absolute() else [Path.cwd() / p, REPO / p, plan_dir / p]):
        if cand.is_file():
            return cand.resolve()
    return p


PLAN_CAP = 1 << 20      # bytes; a plan is a few KiB


def plan_text(path: str | Path) -> str:
    """A plan file's text, read only as a regular file (a link is followed to where it ends; a FIFO or a device is
    never waited on) of at most PLAN_CAP bytes of UTF-8; BadInput in one line otherwise."""
    try:
        data = read_regular_at(None, Path(path).resolve(), PLAN_CAP)
    except FileNotFoundError:
        raise BadInput(f"plan {path} does not exist") from None
    except OSError as ex:
        raise BadInput(f"plan {path}: cannot be read ({ex.strerror or type(ex).__name__})") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as ex:
        raise BadInput(f"plan {path}: not UTF-8 text (byte {ex.start})") from None


def _read_plan(path: Path, only: list[str] | None) -> list:
    """The plan file's `[[entry]]` tables, the file, its TOML, its top-level keys and `only` checked."""
    try:
        plan = tomllib.loads(plan_text(path))
    except tomllib.TOMLDecodeError as ex:
        raise BadInput(f"plan {path}: not valid TOML ({ex})") from None
    raw_entries = plan.get("entry")
    if not isinstance(raw_entries, list) or not raw_entries:
        raise BadInput(f"plan {path}: no [[entry]] tables")
    unknown_top = sorted(set(plan) - {"entry", "description"})
    if unknown_top:
        raise BadInput(f"plan {path}: unknown top-level key(s) {', '.join(unknown_top)}")
    if only:
        names = {e.get("name") for e in raw_entries if isinstance(e, dict)}
        missing = sorted(set(only) - names)
        if missing:
            raise BadInput(f"--only: no entry named {', '.join(missing)} in {path}")
    return raw_entries


def _notebook_owners() -> dict:
    """A notebook that belongs to one experiment only is that experiment (shared ones need `experiment`)."""
    users: dict = {}
    for name, ex in EXPERIMENTS.items():
        users.setdefault((NOTEBOOKS / ex.notebook).resolve(), []).append(name)
    return {nb: names[0] for nb, names in users.items() if len(names) == 1}


def _check_entry(e, i: int, path: Path, seen: set) -> tuple[str, str]:
    """An entry's name (folder-safe, used once), keys, `on` and its one kind: (name, where its lines say)."""
    where = f"plan {path.name} entry {i}"
    if not isinstance(e, dict):
        raise BadInput(f"{where}: not a table")
    name = e.get("name")
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise BadInput(f"{where}: `name` must be a folder-safe word (letters, digits, _ . -), got {name!r}")
    where = f"plan {path.name} entry {name!r}"
    if name in seen:
        raise BadInput(f"{where}: name used twice")
    seen.add(name)
    check_table(ENTRY_SPEC, e, where)        # keys, their types, timeout_s > 0
    if "on" in e and not (isinstance(e["on"], str) and (e["on"] == EVERY_KIND or KIND_RE.match(e["on"]))):
        raise BadInput(f"{where}: `on` is a machine kind (h200, rtx3090, cpu, ...) or \"{EVERY_KIND}\", "
                       f"got {e['on']!r}")
    if sum(k in e for k in ("experiment", "notebook", "tests")) != 1:
        raise BadInput(f"{where}: give exactly one of `experiment`, `notebook` or `tests`")
    if "tests" in e and (not e["tests"].strip() or set(e) & {"parameters", "cpu", "cuda"}):
        raise BadInput(f"{where}: `tests` is a string of pytest arguments, and takes no parameters")
    return name, where


def _entry_notebook(e: dict, where: str, path: Path, by_notebook: dict) -> tuple[Path, str | None]:
    """The notebook an entry runs and the experiment it is (None: a plain notebook)."""
    if "experiment" in e:
        try:
            exp = get(e["experiment"]).name           # the registry's own line for an unknown name
        except BadInput as ex:
            raise BadInput(f"{where}: {ex}") from None
        nb = (NOTEBOOKS / EXPERIMENTS[exp].notebook)
    else:
        nb = _resolve_notebook(str(e["notebook"]), path.parent)
        exp = by_notebook.get(nb.resolve()) if nb.is_file() else None
    if not nb.is_file():
        raise BadInput(f"{where}: notebook {nb} is missing")
    return nb, exp


def _check_parameter_names(e: dict, where: str, nb: Path, exp: str | None) -> None:
    """The names in every parameter table, used on this machine or not: none the runner sets, each one the
    experiment's SPEC (or the plain notebook's `parameters` cell) has."""
    for key in ("parameters", "cpu", "cuda"):
        names = set(e.get(key, {}) or {})
        reserved = sorted(names & RESERVED)
        if reserved:
            raise BadInput(f"{where}: {', '.join(reserved)} is set by the nightly runner, not the plan")
        if exp is not None:
            spec = {p.name for p in EXPERIMENTS[exp].spec}
            unknown = sorted(names - spec)
            if unknown:
                raise BadInput(f"{where}: {exp} has no parameter(s) {', '.join(unknown)} "
                               f"(`labkit run {exp} --help` lists them)")
            continue
        try:
            known = notebook_parameters(nb)
        except Exception as ex:
            raise BadInput(f"{where}: cannot read {nb.name}'s parameters ({type(ex).__name__}: {ex})") from None
        if not known:
            raise BadInput(f"{where}: {nb.name} has no cell tagged `parameters`")
        unknown = sorted(names - known)
        if unknown:
            raise BadInput(f"{where}: {nb.name} has no parameter(s) {', '.join(unknown)}; it has {', '.join(sorted(known))}")


def load_plan(path: str | Path, cuda: bool | None = None, only: list[str] | None = None) -> list[Entry]:
    """Parse and check a plan; raises BadInput (one line) on the first problem. Nothing runs or is written.
    With `only`, just those entries are returned and planned (the others' keys and names are still checked);
    an entry whose needs this machine lacks comes back with `skip` saying why instead of refusing the plan."""
    path = Path(path)
    raw_entries = _read_plan(path, only)
    cuda = _has_cuda() if cuda is None else cuda
    entries, seen = [], set()
    by_notebook = _notebook_owners()
    for i, e in enumerate(raw_entries, start=1):
        name, where = _check_entry(e, i, path, seen)
        if "tests" in e:
            entries.append(Entry(name, Path(str(REPO / "tests")), {}, None, None, e["tests"], e.get("timeout_s"),
                                 str(e.get("description", "")), e))
            continue
        nb, exp = _entry_notebook(e, where, path, by_notebook)
        params = {}
        for key in ("parameters", "cuda" if cuda else "cpu"):
            params.update(e.get(key, {}))
        _check_parameter_names(e, where, nb, exp)
        params = {k: (",".join(map(str, v)) if isinstance(v, list) else v) for k, v in params.items()}
        planned, skip = None, ""
        if exp is not None and (not only or name in only):
            try:
                planned = plan_experiment(exp, params)
            except Missing as ex:          # this machine lacks what it needs: skipped, the rest still run
                skip = str(ex)
            except BadInput as ex:
                raise BadInput(f"{where}: {ex}") from None
        entries.append(Entry(name, nb, params, exp, planned, "", e.get("timeout_s"), str(e.get("description", "")),
                             e, skip))
    return [e for e in entries if not only or e.name in only]


class _Tee:
    """Kernel output to the console and to the entry's log.txt."""

    def __init__(self, *streams):
        self.streams = streams

    def write(self, s):
        for st in self.streams:
            try:
                st.write(s)
                st.flush()
            except Exception:
                pass
        return len(s)

    def flush(self):
        for st in self.streams:
            try:
                st.flush()
            except Exception:
                pass


def _write_json(path: Path, obj) -> None:
    write_text_or_in_place(path, json.dumps(obj, indent=1, default=str))     # whole; in place on a full disk


def _entry_status(folder: Path) -> str | None:
    f = folder / "nightly-entry.json"
    if not f.is_file():
        return None
    try:
        return json.loads(f.read_text()).get("status")
    except Exception:
        return None


def _set_aside(folder: Path) -> Path:
    n = 1
    while (folder.parent / f"{folder.name}.attempt-{n}").exists():
        n += 1
    dest = folder.parent / f"{folder.name}.attempt-{n}"
    folder.rename(dest)
    return dest


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


class _Lock:
    """One nightly per folder. The lock file names its holder (pid, process start time, boot id), so a
    lock left by a run that crashed, was killed or outlived a reboot is recognised as stale (holder gone,
    pid now someone else's, or another boot), cleared, and reported in `notes` — it never blocks later runs."""

    def __init__(self, path: Path):
        self.path = path
        self.notes: list[str] = []

    @staticmethod
    def _holder_alive(info: dict) -> tuple[bool, str]:
        pid = int(info.get("pid") or 0)
        if pid <= 0:
            return False, "the lock names no process"
        if info.get("boot_id") and info["boot_id"] != _boot_id():
            return False, f"pid {pid} held it before this machine rebooted"
        try:
            proc = psutil.Process(pid)
            if info.get("proc_started") and proc.create_time() > float(info["proc_started"]) + 1:
                return False, f"pid {pid} now belongs to another process"
        except psutil.NoSuchProcess:
            return False, f"pid {pid} has exited (crashed or killed)"
        except psutil.AccessDenied:          # exists, owned by someone else
            return True, ""
        return True, ""

    def _read(self) -> dict:
        text = self.path.read_text().strip()
        try:
            info = json.loads(text)
            return info if isinstance(info, dict) else {"pid": int(info)}
        except ValueError:
            return {"pid": int(text)} if text.isdigit() else {}

    def __enter__(self):
        try:
            # 0644: anyone may see who holds the night (no secret in it), only we write it; not executable
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | getattr(os, "O_NOFOLLOW", 0), 0o644)
        except FileExistsError:
            info = self._read()
            alive, why = self._holder_alive(info)
            if alive:
                raise BadInput(f"another nightly (pid {info.get('pid')}, since {info.get('started', '?')}) is running "
                               f"in {self.path.parent}")
            self.notes.append(f"cleared a stale lock (started {info.get('started', '?')}): {why}")
            self.path.unlink(missing_ok=True)
            return self.__enter__()
        me = psutil.Process()
        os.write(fd, json.dumps({"pid": me.pid, "proc_started": me.create_time(), "boot_id": _boot_id(),
                                 "host": os.uname().nodename,
                                 "started": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}).encode())
        os.close(fd)
        return self

    def __exit__(self, *a):
        self.path.unlink(missing_ok=True)


def _run_plain_notebook(entry: Entry, out: Path, log, seen: list) -> Exception | None:
    """A notebook that is not a registered experiment: papermill into `out`, then the report. A signal is
    passed on to its kernel (as for experiments) and recorded in `seen`."""
    params = dict(entry.parameters)
    if "out_dir" in notebook_parameters(entry.notebook):
        params["out_dir"] = str(out.resolve())
    envs.set_env("LABKIT_PLAIN_PROGRESS", "1")     # text progress, not widgets (a report's widgets need a CDN)
    err = None
    notebook_writes_whole()
    try:
        with signals_to_kernels(seen):
            pm.execute_notebook(str(entry.notebook), str((out / entry.notebook.name).absolute()), parameters=params,
                                progress_bar=False, cwd=str(REPO), kernel_name="python3",
                                execution_timeout=entry.timeout_s, log_output=False, stdout_file=log, stderr_file=log,
                                **KERNEL_ARGS)
    except Exception as ex:
        err = ex
    try:
        render_report(out)
    except Exception as ex:
        err = err or ex
    return err


def _run_tests(entry: Entry, out: Path, logf) -> Exception | None:
    """pytest with the entry's arguments in its own process; its output is the entry's log and tests.txt."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", *shlex.split(entry.tests)]
    try:
        p = subprocess.run(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           timeout=entry.timeout_s)
    except subprocess.TimeoutExpired as ex:
        write_text(out / "tests.txt", (ex.stdout or b"").decode(errors="replace") if isinstance(ex.stdout, bytes)
                   else (ex.stdout or ""))
        return RuntimeError(f"pytest {entry.tests}: timed out after {entry.timeout_s} s")
    write_text(out / "tests.txt", p.stdout)
    logf.write(p.stdout)
    last = p.stdout.strip().splitlines()[-1] if p.stdout.strip() else ""
    return None if p.returncode == 0 else RuntimeError(f"pytest {entry.tests}: {last}")


class Stopped(KeyboardInterrupt):
    """SIGINT, SIGTERM or SIGHUP reached the nightly runner: the whole night stops (not just the entry)."""

    def __init__(self, signum: int):
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


def _signal_name(signum: int) -> str:
    return signal.Signals(signum).name


class _StopOnSignals:
    """While a nightly runs, SIGINT, SIGTERM and SIGHUP raise `Stopped` in the runner (an entry's kernel gets the
    signal passed on by `labkit.execute`, which records it). After the first one, further signals are only
    noted, so the record of the stop is written whole."""

    def __init__(self):
        self.first: int | None = None

    def _handler(self, signum, frame):
        if self.first is None:
            self.first = signum
            raise Stopped(signum)

    def __enter__(self):
        self.old = {}
        if threading.current_thread() is threading.main_thread():
            self.old = {s: signal.signal(s, self._handler) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
        return self

    def quiet(self) -> None:
        """From now on every signal is only noted (the record is being written)."""
        if self.first is None:
            self.first = 0

    def __exit__(self, *a):
        for s, h in self.old.items():
            signal.signal(s, h)


def run_entry(entry: Entry, out: Path) -> tuple[str, float, Exception | None, int | None]:
    """Run one entry into `out` (its own kernel). Returns (status, wall seconds, error, the signal that
    stopped it or None)."""
    make_own_folder(out, "entry folder")
    t0 = time.time()
    err: Exception | None = None
    seen: list = []          # signals passed on to the entry's kernel
    with open_append(out / "log.txt") as logf:
        logf.write(f"== {dt.datetime.now(dt.timezone.utc).isoformat(timespec='seconds')} entry {entry.name}: "
                   f"{('pytest ' + entry.tests) if entry.tests else entry.notebook.name} parameters "
                   f"{json.dumps(entry.parameters)} timeout {entry.timeout_s}\n")
        logf.flush()
        tee = _Tee(sys.stderr, logf)
        saved = sys.stdout, sys.stderr
        sys.stdout = sys.stderr = tee        # run_notebook streams the kernel's output to sys.stdout/err
        try:
            if entry.tests:
                err = _run_tests(entry, out, logf)
            elif entry.experiment is not None:
                _, err = run_notebook(entry.plan, out, timeout=entry.timeout_s, signals=seen)
            else:
                err = _run_plain_notebook(entry, out, tee, seen)
        except Terminated as ex:             # SIGTERM or SIGHUP during an experiment: its folder is settled
            seen.append(ex.signum)
            err = ex
        except Stopped as ex:                # a signal outside a kernel (pytest entries, between steps)
            seen.append(ex.signum)
            err = ex
        except KeyboardInterrupt as ex:
            seen.append(signal.SIGINT)
            err = ex
        except Exception as ex:              # anything at all: recorded, the night goes on
            err = ex
        finally:
            sys.stdout, sys.stderr = saved
    wall = time.time() - t0
    if seen:
        return "interrupted", wall, err, int(seen[0])
    status = "failed" if err is not None else "ok"
    mf = out / "manifest.json"
    if err is None and mf.is_file():
        try:
            status = json.loads(mf.read_text()).get("status", "ok")   # "partial": some points failed
            status = status if status in DONE else "failed"
        except Exception:
            pass
    return status, wall, err, None


def _error_text(err: Exception) -> str:
    s = str(err).strip()
    return f"{type(err).__name__}: {s}" if s else type(err).__name__


def _one_line(err: Exception) -> str:
    if getattr(err, "ename", None):           # PapermillExecutionError: the notebook's own exception
        evalue = str(getattr(err, "evalue", "")).strip().splitlines()
        return f"{err.ename}: {evalue[0] if evalue else ''} (cell {getattr(err, 'exec_count', '?')})"[:400]
    return one_line(err)[:400]


LOG_NAME = "nightly.log"


def _logged(echo, path: Path):
    """`echo`, plus every line appended with a UTC time to the nightly folder's log (a scheduled run has
    no terminal; each entry's kernel output is in `<entry>/log.txt`)."""
    def out(msg: str) -> None:
        echo(msg)
        with open_append(path) as f:
            f.write(f"{dt.datetime.now(dt.timezone.utc).isoformat(timespec='seconds')} {msg}\n")
    return out


def night_record(rec_path: Path, lock: "_Lock", echo, date: str) -> dict:
    """The night's record so far (a fresh one where there is none or it cannot be read), with what taking the
    lock noticed echoed and kept in its notes."""
    try:
        record = json.loads(rec_path.read_text()) if rec_path.is_file() else {}
    except Exception:
        record = {}
    for note in lock.notes:
        echo(f"nightly {date}: {note}")
        record.setdefault("notes", []).append(f"{dt.datetime.now(dt.timezone.utc).isoformat(timespec='seconds')} {note}")
    return record


def run_plan(plan: str | Path, date: str | None = None, root: str | Path = "results", only: list[str] | None = None,
             echo=print) -> dict:
    """Run (or resume) a plan into `<root>/nightly-<date>/`; returns the nightly record."""
    date = date or dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d")
    if not re.match(r"^\d{4}-\d{2}-\d{2}$", date):
        raise BadInput(f"--date {date!r}: expected YYYY-MM-DD")
    root = Path(root)
    night = root / f"nightly-{date}"
    # the night's folder must be ours alone, and the root must not let another user replace it (the root may
    # be shared with the sticky bit, as /tmp is): one line, before the plan is even read
    why = foreign_folder_problem(night)
    if why:
        raise BadInput(f"--root {night} {why}")
    entries = load_plan(plan, only=only)
    make_own_folder(night, "--root")
    check_writable(night, "--root")       # a read-only results folder: one line, nothing run
    rec_path = night / "nightly.json"
    echo = _logged(echo, night / LOG_NAME)
    lock = _Lock(night / ".lock")
    with lock, _StopOnSignals() as stop:
        echo(f"nightly {date}: plan {plan}, pid {os.getpid()}, host {os.uname().nodename}")
        record = night_record(rec_path, lock, echo, date)
        text = plan_text(plan)
        if record.get("stopped"):            # resumed after a stop: keep its word in the history
            record.setdefault("earlier_stops", []).append(record.pop("stopped"))
        record.update({"date": date, "plan": str(Path(plan)), "plan_sha256": hashlib.sha256(text.encode()).hexdigest()[:16],
                       "started": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "finished": None,
                       "cuda": _has_cuda()})
        by_name = {e["name"]: e for e in record.get("entries", [])}
        order = [e.name for e in entries] + [n for n in by_name if n not in {e.name for e in entries}]
        try:
            stopped = _run_entries(entries, night, root, record, by_name, order, rec_path, echo)
        except Stopped as ex:                # between entries (skipping, setting aside, the index)
            stopped = (ex.signum, None)
        stop.quiet()
        record["entries"] = [by_name[n] for n in order if n in by_name]
        if stopped:
            signum, during = stopped
            left = [e.name for e in entries if by_name.get(e.name, {}).get("status") not in DONE]
            record["stopped"] = {"signal": _signal_name(signum), "entry": during,
                                 "at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                                 "not_done": left}
            _write_json(rec_path, record)
            echo(f"nightly {date}: stopped by {_signal_name(signum)}" + (f" during {during}" if during else "")
                 + f"; {len(left)} entr{'y' if len(left) == 1 else 'ies'} not done ({', '.join(left) or 'none'}); "
                 f"the same command resumes it")
        else:
            record["finished"] = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
            _write_json(rec_path, record)
            done = sum(e.get("status") in DONE for e in record["entries"])
            skipped = sum(e.get("status") == "skipped" for e in record["entries"])
            echo(f"nightly {date}: finished, {done} of {len(record['entries'])} entries done"
                 + (f", {skipped} skipped (needs missing on this machine)" if skipped else ""))
    try:
        rebuild_index(root)
    except Exception as ex:
        echo(f"labkit: run index not rebuilt: {ex}")
    return record


def _run_entries(entries, night: Path, root: Path, record: dict, by_name: dict, order: list, rec_path: Path,
                 echo) -> tuple[int, str] | None:
    """The night's entries in order, `record` rewritten after each; (signal, entry) when a signal stopped it."""
    for i, entry in enumerate(entries, start=1):
        out = night / entry.name
        prev = by_name.get(entry.name, {})
        if out.exists() and _entry_status(out) in DONE:
            echo(f"[{i}/{len(entries)}] {entry.name}: already done ({_entry_status(out)}), skipped")
            done = json.loads((out / "nightly-entry.json").read_text())
            by_name[entry.name] = {**prev, **done, "skipped_on_resume": True}
            continue
        if entry.skip:                  # a need missing on this machine: say so, run the rest
            echo(f"[{i}/{len(entries)}] {entry.name}: skipped — {entry.skip}")
            by_name[entry.name] = {"name": entry.name, "experiment": entry.experiment, "status": "skipped",
                                   "error": entry.skip, "wall_s": 0.0, "folder": None,
                                   "earlier_attempts": list(prev.get("earlier_attempts", []))}
            record["entries"] = [by_name[n] for n in order if n in by_name]
            _write_json(rec_path, record)
            continue
        attempts = list(prev.get("earlier_attempts", []))
        if out.exists():
            attempts.append(str(_set_aside(out).name))
        echo(f"[{i}/{len(entries)}] {entry.name}: running {entry.notebook.name} {entry.parameters or '(defaults)'}")
        started = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
        status, wall, err, signum = run_entry(entry, out)
        if signum is not None:
            err = Stopped(signum)             # the entry's word: stopped, not failed
        info = {"name": entry.name, "experiment": entry.experiment, "notebook": str(entry.notebook.relative_to(REPO))
                if entry.notebook.is_relative_to(REPO) else str(entry.notebook),
                "parameters": entry.parameters, "timeout_s": entry.timeout_s, "status": status, "started": started,
                "wall_s": round(wall, 1), "error": _one_line(err) if err else None, "folder": entry.name,
                "earlier_attempts": attempts}
        if err is not None:
            write_text(out / "error.txt", f"entry {entry.name} {'stopped' if signum else 'failed'} after {wall:.1f} s\n"
                                          f"{_error_text(err)}\n"
                                          f"kernel output: log.txt; executed notebook (failing cell marked): "
                                          f"{out / entry.notebook.name}\n")
        _write_json(out / "nightly-entry.json", info)
        by_name[entry.name] = info
        record["entries"] = [by_name[n] for n in order if n in by_name]
        _write_json(rec_path, record)
        echo(f"[{i}/{len(entries)}] {entry.name}: {status} in {wall:.1f} s" + (f" — {info['error']}" if err else ""))
        if signum is not None:
            return signum, entry.name
        try:
            rebuild_index(root)
        except Exception as ex:
            echo(f"labkit: run index not rebuilt: {ex}")
    return None


def cmd_nightly(a) -> int:
    only = [n.strip() for n in a.only.split(",") if n.strip()] if a.only else None
    if a.dry_run:
        for e in load_plan(a.plan, only=only):
            what = f"pytest {e.tests}" if e.tests else f"{e.experiment or '-'} {e.notebook.name} {e.parameters or '(defaults)'}"
            print(f"{e.name}: " + (f"skipped here — {e.skip}" if e.skip else what
                                   + (f" timeout {e.timeout_s} s" if e.timeout_s else "")))
        return 0
    rec = run_plan(a.plan, a.date, a.root, only=only)
    for e in rec.get("entries", []):
        if e.get("status") == "skipped":
            print(f"  skipped {e['name']}: {e.get('error')}")
    bad = [e for e in rec.get("entries", []) if e.get("status") not in DONE + ("skipped",)]
    night = Path(a.root) / f"nightly-{rec['date']}"
    if rec.get("stopped"):
        st = rec["stopped"]
        signum = int(signal.Signals[st["signal"]])
        print(stop_line(f"nightly {rec['date']}", signum, f"during {st['entry']}" if st.get("entry") else "",
                        f"not done: {', '.join(st['not_done']) or 'none'}; record {night / 'nightly.json'}; run the same "
                        "command again to resume"), file=sys.stderr)
        return exit_code(signum)
    done = sum(e.get("status") in DONE for e in rec.get("entries", []))
    print(f"nightly {rec['date']}: {done} of {len(rec['entries'])} entries done; "
          f"record {night / 'nightly.json'}; index {Path(a.root) / 'index.html'}")
    for e in bad:
        print(f"  FAILED {e['name']}: {e.get('error')} (see {night / e['name'] / 'error.txt'})")
    return 1 if bad else 0
