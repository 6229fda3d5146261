"""Run folders: write, load, list.

A run folder `results/<run-id>/` holds (the contract reports, tests and the index rely on):
- `manifest.json`: run_id, created, git_sha, host, gpu_name, driver, cuda, torch, pcie_gen, pcie_width,
  labkit version, the experiment and its parameters, the writing processes (`writers`: pid and start time on
  `host`), and (when finished) status and wall time; `gpus`: each GPU the run used as it was set (power limit
  enforced and default, maximum clocks, link, peer access between each pair) and, when finished, what it did
  (`observed`: clocks, power, temperature and clock-event reasons over the run's NVML samples), or `none`
  saying why there is no GPU;
- `metrics.parquet`: one tidy row per measured point (`METRIC_COLUMNS` at least), rewritten after every
  point so a crash loses nothing already measured;
- `telemetry.parquet`: the NVML/host time series;
- other tables (`<name>.parquet`), the executed notebook(s) and `report.html`.
"""
from __future__ import annotations

import datetime as dt
import errno
import hashlib
import json
import os
import platform
import socket
import subprocess
import sys
from pathlib import Path

import fastjsonschema
import pandas as pd
import psutil

from . import __version__, envs, lazy
from .atomic import open_replacing_at, read_regular_at, replacing_at, write_bytes_at, write_text_or_in_place_at
from .hostmem import for_manifest
from .outdir import make_fresh_folder, make_own_folder, open_own_folder
from .params import RENAMED_EXPERIMENTS, BadInput, experiment_name, one_line
from .telemetry import Sampler, cpu_model, describe_gpus, host_memory, link_info, machine_load, observed

torch = lazy.module("torch")        # listing and reading runs (`labkit runs`, the reports) never needs it

# rows and manifests written since the reference shape followed the public config carry shape_rev 2; a run
# without it that names "qwen3.8-flash-next" was made with the stand-in (`shapes.shape_for_run`)
SHAPE_REV = 2

METRIC_COLUMNS = ["run_id", "experiment", "status", "error", "device", "gpu_name", "shape", "strategy",
                  "context_len", "budget", "concurrency", "repeats", "step_ms_median", "step_ms_min",
                  "step_ms_max", "tok_s", "h2d_bytes_per_step", "nvml_rx_bytes_per_step", "device_kv_bytes",
                  "host_kv_bytes"]

REPO = Path(__file__).resolve().parent.parent


def git_sha(repo: Path = REPO) -> str:
    """The commit's short sha, `-dirty` when tracked code differs from it. Changes under results/ do not
    count: runs write there (a run folder, a report redrawn), and "dirty" must mean the code changed."""
    if envs.get("LABKIT_GIT_SHA"):      # a copy of the tree without .git (e.g. a GPU host session)
        return envs.get("LABKIT_GIT_SHA")
    try:
        out = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=repo, capture_output=True, text=True, timeout=5)
        sha = out.stdout.strip() or "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)results"],
                               cwd=repo, capture_output=True, text=True, timeout=5).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except Exception:
        return "unknown"


def run_gpus(params: dict) -> list[int]:
    """The CUDA indices of the GPUs a run's parameters name: `device_list`, else every `cuda[:N]` in `device`
    or `devices` (comma-separated; `auto`/`cuda` is GPU 0, `auto` for `devices` every GPU), else GPU 0 where
    there is one. Empty on a machine without CUDA or for a CPU run."""
    if not torch.cuda.is_available():
        return []
    names = params.get("device_list")
    if not isinstance(names, list):
        given = next((params[k] for k in ("device", "devices") if isinstance(params.get(k), str)), None)
        if given is None:
            return [0]
        if given.strip() == "auto" and "devices" in params and "device" not in params:
            return list(range(torch.cuda.device_count()))
        names = [d.strip() for d in given.split(",") if d.strip()]
    out = []
    for d in names:
        d = str(d)
        if d in ("auto", "cuda"):
            out.append(0)
        elif d.startswith("cuda:") and d[5:].isdigit() and int(d[5:]) < torch.cuda.device_count():
            out.append(int(d[5:]))
    return list(dict.fromkeys(out))          # a device named twice is one GPU


def machine_info() -> dict:
    """What the machine was: host, CPU, GPU, driver, CUDA, torch, PCIe link (read now)."""
    info = {"host": socket.gethostname(), "platform": platform.platform(), "cpu_model": cpu_model(), "cpu_count": os.cpu_count(),
            "python": platform.python_version(), "torch": torch.__version__,
            "cuda": torch.version.cuda if torch.cuda.is_available() else None,
            "gpu_name": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "driver": None, "pcie_gen": None, "pcie_width": None}
    try:
        import triton  # a broken or absent Triton is recorded as none, not a failed run
        info["triton"] = triton.__version__
    except Exception:
        info["triton"] = None
    info.update(host_memory())
    info["host_memory_bandwidth"] = for_manifest()      # this host's RAM bandwidth: kept once per host (labkit.hostmem)
    if torch.cuda.is_available():
        info.update({k: v for k, v in link_info(0).items() if k != "gpu_name" or v})
    return info


# ------------------------------------------------------------------------------------------- run status
# One rule for every experiment (the CLI, the notebooks, the run index and `labkit runs` all read it):
#   ok           every point measured is ok (and at least one was)
#   partial      some point failed, some was measured
#   failed       nothing was measured (no ok point), or the run ended with an error before any point
#   interrupted  a signal (Ctrl-C, SIGTERM) ended the run
#   running      a process of the run is still alive
#   stale        the manifest says running but every process that wrote it on this machine is gone (killed,
#                crashed); one written on another machine that still says running reads as its points do
STATUSES = ("ok", "partial", "failed", "interrupted", "running", "stale")


def derive_status(point_statuses, interrupted: bool = False, error: bool = False) -> str:
    """The run's status from its points' statuses. `error`: the run ended with an exception (what was
    measured before it still counts: partial when something was, failed when nothing was)."""
    sts = [s for s in point_statuses if s is not None]
    if interrupted:
        return "interrupted"
    n_ok = sum(1 for s in sts if s == "ok")
    if n_ok == 0:
        return "failed"
    if error or n_ok < len(sts):
        return "partial"
    return "ok"


def status_reason(manifest: dict, metrics: "pd.DataFrame | None" = None) -> str:
    """One line saying why a run is not ok (empty when it is)."""
    st = effective_status(manifest)
    if st == "ok":
        return ""
    parts = [st]
    if metrics is not None and "status" in metrics and len(metrics):
        bad = metrics[metrics["status"] != "ok"]
        parts.append(f"{len(bad)} of {len(metrics)} points failed" if len(bad) else f"{len(metrics)} points measured")
        if len(bad) and "error" in bad and bad["error"].notna().any():
            parts.append(str(bad["error"].dropna().iloc[0]).strip().splitlines()[0][:200].rstrip(" :"))
    elif metrics is not None:
        parts.append("no point measured")
    if manifest.get("error"):
        parts.append(str(manifest["error"]).strip().splitlines()[0][:200].rstrip(" :"))
    if st == "stale":
        parts.append("its process died without writing a status")
    return ": ".join(parts)


def _proc_start(pid: int) -> float | None:
    try:
        return round(psutil.Process(pid).create_time(), 2)
    except Exception:
        return None


def writer_entry(pid: int | None = None) -> dict:
    """This process (or `pid`) as a writer of a run: pid and start time (a reused pid is not the writer)."""
    pid = pid or os.getpid()
    return {"pid": pid, "started": _proc_start(pid)}


def _writer_alive(w: dict) -> bool:
    started = _proc_start(int(w.get("pid") or 0)) if w.get("pid") else None
    return started is not None and (w.get("started") is None or abs(started - float(w["started"])) < 1.0)


def machine_id() -> str | None:
    """This machine, as a run's manifest records it: a digest of /etc/machine-id (host names repeat across
    machines: every VM of a cloud image may be `vm`); None where there is none."""
    for f in ("/etc/machine-id", "/var/lib/dbus/machine-id"):
        try:
            raw = Path(f).read_text().strip()
        except OSError:
            continue
        if raw:
            return hashlib.sha256(raw.encode()).hexdigest()[:16]
    return None


def checkable_here(manifest: dict) -> bool:
    """Can this machine tell whether the run's processes are alive: was it written here, with its writers
    recorded? By the manifest's machine id where it has one, else by host name and writers of this boot: a
    manifest without them (written before they were recorded, or committed from another machine that shares
    a host name, as every `vm` does) says nothing this machine can check."""
    if manifest.get("machine_id"):
        return manifest["machine_id"] == machine_id()
    writers = manifest.get("writers") or []
    if manifest.get("host") != socket.gethostname() or not writers:
        return False
    # no machine id (written before it was recorded): writers that started before this machine booted were
    # another machine's processes as likely as this one's, so the host name alone decides nothing
    return any(w.get("started") is None or float(w["started"]) >= _boot_time() - 1 for w in writers)


def _boot_time() -> float:
    try:
        return psutil.boot_time()
    except Exception:
        return 0.0


def effective_status(manifest: dict, points=None) -> str:
    """The manifest's status, except for one that still says `running`. Written here, with its writers recorded,
    it is `stale` when every writer is gone. Written elsewhere (a run committed from another machine) its
    processes cannot be checked here: with its points' statuses (`points`, metrics.parquet's `status` column)
    it reads as what those points are (ok, partial, failed by the one rule), without them it keeps its word."""
    st = manifest.get("status") or "running"
    if st != "running":
        return st
    if checkable_here(manifest):
        return st if any(_writer_alive(w) for w in manifest.get("writers") or []) else "stale"
    if points is None:
        return st
    return derive_status(list(points))


def point_statuses(run_dir: str | Path):
    """A run folder's points' statuses (metrics.parquet's `status` column); [] when it has none."""
    mp = Path(run_dir) / "metrics.parquet"
    if not mp.is_file():          # a FIFO or a device at that name is never opened
        return []
    try:
        return list(pd.read_parquet(mp, columns=["status"])["status"])
    except Exception:
        return []


def _exists_at(fd: int, name: str) -> bool:
    try:
        os.stat(name, dir_fd=fd, follow_symlinks=False)
        return True
    except FileNotFoundError:
        return False


def new_run_id(experiment: str) -> str:
    now = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
    return f"{now}-{experiment}"


class Run:
    """A run folder being written."""

    def __init__(self, path: Path, manifest: dict):
        self.path, self.manifest = Path(path), manifest
        self.records: list[dict] = []
        self.gpu_watch = None         # a light NVML sampler over the run's GPUs (clocks, power, clock events)
        self._fd: int | None = None

    @property
    def fd(self) -> int:
        """The run folder's handle, opened once and checked (this user's alone) on the handle itself: every file of
        the run is created through it, so a link swapped into the folder's path meanwhile redirects nothing."""
        if self._fd is None:
            self._fd = open_own_folder(self.path, "run folder")
        return self._fd

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def __del__(self):
        try:
            self.close()
        except Exception:       # interpreter shutdown: the fd goes with the process
            pass

    @property
    def run_id(self) -> str:
        return self.manifest["run_id"]

    @classmethod
    def create(cls, out_dir: str | Path | None, experiment: str, params: dict, root: str | Path = "results") -> "Run":
        """Make the folder and write manifest.json. `out_dir` empty/None -> `<root>/<new run id>`, a folder made
        by this call (`-2`, `-3`, ... after the id when another run took it in the same second)."""
        if out_dir:
            path = make_own_folder(Path(out_dir), "run folder")  # this user's alone (no other user can plant links in it)
        else:
            path = make_fresh_folder(Path(root), new_run_id(experiment), "results root")
        run = cls(path, {})
        if _exists_at(run.fd, "metrics.parquet"):
            run.close()
            raise FileExistsError(f"{path} already holds a run (metrics.parquet); choose another --out")
        run.manifest = {"run_id": path.name, "experiment": experiment,
                        "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                        "git_sha": git_sha(), "labkit": __version__, **machine_info(), "parameters": params,
                        "engine": envs.in_force(), "environment": envs.plumbing_in_force(),
                        "status": "running", "writers": _writers(), "machine_id": machine_id(),
                        "machine_load_before": machine_load(), "shape_rev": SHAPE_REV}
        if envs.get("LABKIT_SESSION"):     # runs made by one device session (their reports meet)
            run.manifest["session"] = envs.get("LABKIT_SESSION")
        gpus = run_gpus(params)
        run.manifest["gpus"] = describe_gpus(gpus)
        run._write_manifest()
        if gpus:
            # clocks and clock events over the whole run, for the experiments that sample no telemetry of
            # their own (prefill, capacity, ...); 2 Hz of a few NVML reads, no PCIe counters
            try:
                run.gpu_watch = Sampler(gpus=gpus, counters=False, slow_period=0.5).start()
            except Exception:  # NVML without a handle for a card: the run goes on, its section says not sampled
                run.gpu_watch = None
        return run

    def _write_manifest(self) -> None:
        # whole or absent (fsync + rename); on a full disk the existing manifest is rewritten in its own
        # blocks, so the final status can still say what happened
        write_text_or_in_place_at(self.fd, "manifest.json", json.dumps(self.manifest, indent=1, default=str))

    def update_manifest(self, **fields) -> None:
        self.manifest.update(fields)
        self._write_manifest()

    def add(self, record: dict) -> None:
        """Append one metrics row and rewrite metrics.parquet (atomic), so nothing measured is lost."""
        row = {"run_id": self.run_id, "shape_rev": SHAPE_REV, **record}
        self.records.append(row)
        self.write_table("metrics", self.metrics())

    def metrics(self) -> pd.DataFrame:
        df = pd.DataFrame(self.records)
        for c in METRIC_COLUMNS:
            if c not in df.columns:
                df[c] = None
        front = [c for c in METRIC_COLUMNS]
        return df[front + [c for c in df.columns if c not in front]]

    def write_table(self, name: str, df: pd.DataFrame) -> Path:
        path = self.path / f"{name}.parquet"
        df = df.copy()
        for c in df.columns:   # mixed None/str/number object columns: store as text, keep numbers numeric
            if df[c].dtype == object:
                num = pd.to_numeric(df[c], errors="coerce")
                df[c] = num if num.notna().sum() == df[c].notna().sum() else df[c].astype("string")
        with replacing_at(self.fd, path.name, self.path) as tmp:     # whole or absent, no stray temporary file
            df.to_parquet(tmp, index=False)
        return path

    add_table = write_table

    def write_csv(self, name: str, df: pd.DataFrame) -> Path:
        """`<name>.csv` beside the tables (a copy for spreadsheets), whole or absent, never through a link."""
        path = self.path / f"{name}.csv"
        with open_replacing_at(self.fd, path.name) as f:
            df.to_csv(f, index=False)
        return path

    def write_file(self, name: str, text: str) -> Path:
        """Any other text file of the run (a summary), whole or absent, never through a link."""
        if Path(name).name != name or name in ("", ".", ".."):
            raise ValueError(f"write_file: {name!r} is not a file name of the run folder")
        write_bytes_at(self.fd, name, text.encode("utf-8"))
        return self.path / name

    def finish(self, status: str | None = None, *, interrupted: bool | None = None,
               error: BaseException | str | None = None, **fields) -> str:
        """Write the final status, derived from the points by `derive_status` (the one rule), and the wall
        time; returns the status. `error`: the exception that ended the run early (recorded in one line).
        Called in a `finally` or `except` block while an exception propagates, that exception decides:
        KeyboardInterrupt (Ctrl-C, or SIGTERM turned into one) -> interrupted, anything else -> an error.
        `status` given explicitly is written as is: for run folders built by hand (test fixtures, imports);
        experiments never pass it (a test checks)."""
        if status is not None:
            if status not in STATUSES:
                raise ValueError(f"unknown run status {status!r}: one of {', '.join(STATUSES)}")
        else:
            if interrupted is None and error is None:
                exc = sys.exc_info()[1]
                interrupted = isinstance(exc, KeyboardInterrupt)
                error = exc if exc is not None and not interrupted else None
            status = derive_status([r.get("status") for r in self.records], interrupted=bool(interrupted),
                                   error=error is not None)
            if error is not None and not isinstance(error, str):
                error = one_line(error)
            if error is not None:
                fields["error"] = error
        created = dt.datetime.fromisoformat(self.manifest["created"])
        wall = (dt.datetime.now(dt.timezone.utc) - created).total_seconds()
        self._observe_gpus()
        self.update_manifest(status=status, wall_s=round(wall, 1), machine_load_after=machine_load(), **fields)
        return status

    def _observe_gpus(self) -> None:
        """Each GPU's `observed` entry: from the run's own telemetry where its experiment sampled the GPU (its
        measured window), else from the run's watch (the whole run)."""
        watch, self.gpu_watch = self.gpu_watch, None
        if watch is not None:
            watch.stop()
        devices = (self.manifest.get("gpus") or {}).get("devices") or []
        if not devices:
            return
        try:
            tel = pd.read_parquet(self.path / "telemetry.parquet") if (self.path / "telemetry.parquet").is_file() else None
        except Exception:  # a table cut short: the watch still says what the GPUs did
            tel = None
        own = watch.frame() if watch is not None else None
        for d in devices:
            seen = observed(tel, d["index"]) if tel is not None else {"samples": 0}
            if seen["samples"]:
                seen["source"] = "telemetry.parquet (the measured window)"
            else:
                seen = observed(own, d["index"]) if own is not None else {"samples": 0}
                seen["source"] = "the run's NVML watch, every 0.5 s" if seen["samples"] else \
                    (watch.reason if watch is not None and watch.reason else "not sampled")
            d["observed"] = seen


# ------------------------------------------------------------------------------------ reading manifests
# Every reader of run folders (`labkit runs`, the run index, `labkit report`, compare) reads a manifest through
# `read_manifest`: parsed, then checked against the declared schema, so one folder with a malformed manifest
# (a number where a time belongs, a list instead of an object) is one line about that folder, never a
# traceback that hides the others.
MANIFEST_SCHEMA = Path(__file__).resolve().parent / "data" / "run-manifest.schema.json"


class BadManifest(BadInput):
    """A run folder's manifest.json that cannot be read, is not JSON or does not match the schema."""


_validator = None


def _short(v, n: int = 60) -> str:
    text = json.dumps(v, default=str)
    return text if len(text) <= n else text[: n - 1] + "…"


_JSON_TYPES = {dict: "an object", list: "a list", str: "a string", bool: "true/false", int: "a number",
               float: "a number", type(None): "null"}


def manifest_problem(m) -> str:
    """Why a parsed manifest does not match `MANIFEST_SCHEMA`, in one line ("" when it does)."""
    global _validator
    if _validator is None:
        _validator = fastjsonschema.compile(json.loads(MANIFEST_SCHEMA.read_text()))
    try:
        _validator(m)
        return ""
    except fastjsonschema.JsonSchemaValueException as err:
        where = ".".join(str(p) for p in err.path[1:]) or "the manifest"
        if err.rule == "type":
            want = err.rule_definition if isinstance(err.rule_definition, list) else [err.rule_definition]
            return (f"{where} is {_JSON_TYPES.get(type(err.value), type(err.value).__name__)} ({_short(err.value)}), "
                    f"expected {' or '.join(want)}")
        if err.rule == "enum":
            return f"{where} is {_short(err.value)}, expected one of {', '.join(map(str, err.rule_definition))}"
        if err.rule == "pattern" and where == "created":
            return f"created is {_short(err.value)}, expected an ISO 8601 time"
        if err.rule == "required":
            return f"{where} lacks {', '.join(k for k in err.rule_definition if not isinstance(err.value, dict) or k not in err.value)}"
        return f"{where} is {_short(err.value)}, which the manifest's schema refuses ({err.rule})"


MANIFEST_CAP = 4 << 20     # bytes; a run's manifest is a few KiB


def _os_why(ex: OSError) -> str:
    if ex.errno == errno.ELOOP:
        return "a symlink, not followed"
    return ex.strerror or type(ex).__name__


def manifest_object(path: str | Path) -> dict:
    """A manifest.json's JSON object, unchecked against the schema, read as `read_manifest` reads it (a regular
    file under MANIFEST_CAP, no link followed); OSError or ValueError (not JSON, not an object) otherwise. For
    readers that take what they find (an estimate from earlier runs, a report's header)."""
    m = json.loads(read_regular_at(None, Path(path), MANIFEST_CAP).decode("utf-8"))
    if not isinstance(m, dict):
        raise ValueError(f"{path}: not a JSON object")
    return m


def read_manifest(path: str | Path) -> dict:
    """A run folder's manifest (`path`: the folder or its manifest.json), checked against the schema;
    BadManifest (one line: the file and why) otherwise."""
    path = Path(path)
    mf = path if path.name == "manifest.json" else path / "manifest.json"
    try:
        # a regular file under the cap, no link followed: a FIFO or /dev/zero there neither hangs nor fills memory
        m = json.loads(read_regular_at(None, mf, MANIFEST_CAP).decode("utf-8"))
    except FileNotFoundError:
        raise
    except OSError as ex:
        raise BadManifest(f"{mf}: cannot be read ({_os_why(ex)})") from None
    except UnicodeDecodeError:
        raise BadManifest(f"{mf}: not UTF-8 text") from None
    except ValueError as ex:
        raise BadManifest(f"{mf}: not valid JSON ({str(ex).splitlines()[0]})") from None
    why = manifest_problem(m)
    if why:
        raise BadManifest(f"{mf}: {why}")
    if m.get("experiment") in RENAMED_EXPERIMENTS:
        m["experiment"] = experiment_name(m["experiment"])
    return m


class LoadedRun:
    def __init__(self, path: str | Path, more: tuple = ()):
        """`more`: run folders whose decode points join this run's metrics (a grid whose strategies one device
        sitting measured in two processes, read as one, as docs/runs.toml's `reference_more` names them)."""
        self.path = Path(path)
        self.more = tuple(Path(p) for p in more)
        mf = self.path / "manifest.json"
        if not mf.is_file():
            raise FileNotFoundError(f"{self.path} is not a run folder: no manifest.json")
        self.manifest = read_manifest(mf)

    def table(self, name: str) -> pd.DataFrame:
        """`<name>.parquet` ("" table when absent); BadInput in one line when the file is not a table."""
        p = self.path / f"{name}.parquet"
        if not p.is_file():
            return pd.DataFrame()
        try:
            return pd.read_parquet(p)
        except Exception as ex:        # a truncated or foreign file: say which, not pyarrow's traceback
            why = (str(ex).strip().splitlines() or ["no message"])[0]
            raise BadInput(f"{p}: not a readable table ({type(ex).__name__}: "
                           f"{why if len(why) <= 160 else why[:159] + '…'})") from None

    @property
    def metrics(self) -> pd.DataFrame:
        df = self.table("metrics")
        for p in self.more:
            o = LoadedRun(p).metrics
            df = pd.concat([df, o[o["experiment"] == "decode"]], ignore_index=True)
        if "experiment" in df and df["experiment"].isin(list(RENAMED_EXPERIMENTS)).any():
            df["experiment"] = df["experiment"].replace(RENAMED_EXPERIMENTS)
        return df if not df.empty else pd.DataFrame(columns=METRIC_COLUMNS)

    @property
    def telemetry(self) -> pd.DataFrame:
        return self.table("telemetry")


def _writers() -> list[dict]:
    """This process, and the driver that started it (`labkit run` sets LABKIT_RUN_DRIVER for its kernel)."""
    out = [writer_entry()]
    drv = envs.get("LABKIT_RUN_DRIVER")
    if drv.isdigit() and int(drv) != os.getpid():
        out.append(writer_entry(int(drv)))
    return out


def load_run(path: str | Path, more: tuple = ()) -> LoadedRun:
    return LoadedRun(path, more)


# The results folder's one folder that is not a run: the assets its reports share (plotly.js, `report.assets`)
ASSETS = "_assets"


RUN_DEPTH = 3      # folders below a results root where runs sit: a run, a nightly's entry, one more level


def run_manifests(root: str | Path) -> list[Path]:
    """Every run folder's manifest.json under root (at most RUN_DEPTH folders down, never through a link), sorted;
    the shared assets' manifest (`_assets/manifest.json`: what the reports link, not a run) is not one."""
    level = [Path(root)]
    found = [level[0] / "manifest.json"] if level[0].name != ASSETS and os.path.lexists(level[0] / "manifest.json") else []
    for _ in range(RUN_DEPTH):
        below = []
        for d in level:
            try:
                entries = list(os.scandir(d))
            except OSError:
                continue
            for e in entries:
                if e.name != ASSETS and e.is_dir(follow_symlinks=False):
                    below.append(Path(e.path))
                    if os.path.lexists(os.path.join(e.path, "manifest.json")):
                        found.append(Path(e.path) / "manifest.json")
        level = below
    return sorted(found)


UNREADABLE = "unreadable"      # `list_runs`' word for a run folder whose manifest.json cannot be parsed


def mtime_iso(path: Path) -> str | None:
    try:
        return dt.datetime.fromtimestamp(path.stat().st_mtime, dt.timezone.utc).isoformat(timespec="seconds")
    except OSError:
        return None


def list_runs(root: str | Path = "results") -> pd.DataFrame:
    """One row per run folder under root (newest first); a folder whose manifest cannot be read or does not
    match the schema is listed with status `unreadable` and an `error` saying why (one line)."""
    rows = []
    for mf in run_manifests(root):
        try:
            m = read_manifest(mf)
        except (BadManifest, OSError) as ex:  # listed, not dropped: a broken manifest is a run someone must look at
            why = str(ex).removeprefix(f"{mf}: ") if isinstance(ex, BadManifest) else type(ex).__name__
            rows.append({"path": str(mf.parent), "run_id": mf.parent.name, "experiment": None,
                         "created": mtime_iso(mf), "status": UNREADABLE, "gpu_name": None, "pcie_gen": None,
                         "pcie_width": None, "git_sha": None, "host": None,
                         "error": f"manifest.json unreadable: {why}"})
            continue
        rows.append({"path": str(mf.parent), "run_id": m.get("run_id"), "experiment": m.get("experiment"),
                     "created": m.get("created"),
                     "status": effective_status(m, point_statuses(mf.parent) if m.get("status") in (None, "running") else None),
                     "gpu_name": m.get("gpu_name"),
                     "pcie_gen": m.get("pcie_gen"), "pcie_width": m.get("pcie_width"), "git_sha": m.get("git_sha"),
                     "host": m.get("host"), "cluster": m.get("cluster"), "gpus": m.get("gpus")})
    df = pd.DataFrame(rows)
    return df.sort_values("created", ascending=False) if not df.empty else df
