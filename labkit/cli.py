"""`labkit`: the command line, the one front door beside the notebooks to the same experiments.

    labkit run --help                          the experiments, what each answers and needs
    labkit run decode --help                   its parameters: type, default, help
    labkit run decode -p context_lens=8K,1M -p concurrency=1,4 [--out DIR]
    labkit report RUN [--standalone] [--rerun]     RUN: as `labkit runs` lists it, or a run folder
    labkit runs [--root results]
    labkit predict [RUN] [--context 128K] [--concurrency 1,4]   the published model on 3x RTX 3090 (--gpu, --gpus)
    labkit compare RUN_A RUN_B
    labkit nightly [--plan nightly/plan.toml] [--date YYYY-MM-DD]
    labkit lab                                 JupyterLab on notebooks/
    labkit serve                               labkit's engine behind an OpenAI-compatible endpoint
    labkit export RUN [RUN ...] --format jsonl|sqlite|markdown [--out FILE]     a run's points as archive rows
    labkit import FILE.jsonl|FILE.sqlite [--source NAME] [--hardware TEXT]     archive rows into the index (external)
    labkit shapes [--json]
    labkit docs [--write]                      the measured tables in README.md and docs/ from committed runs
    labkit node --head --ip ADDR | --address HEAD:PORT --ip ADDR     a box joins the lab's Ray cluster
    labkit nightly --plan P --cluster HEAD:PORT, labkit run X ... --cluster HEAD:PORT [--on KIND]

Every argument parser of labkit lives here. Bad input prints one line and exits 2 before anything is
allocated or written; parsing a command line imports neither torch nor papermill nor plotly.
"""
from __future__ import annotations

import argparse
import errno
import json
import os
import shutil
import signal
import sys
from pathlib import Path

from . import atomic, envs, lazy, stops
from .params import RENAMED_EXPERIMENTS, BadInput, kv_pairs, parse_size, resolve_device, tokens_label

# Each command loads what it uses when it runs: `labkit --help` and bad input answer in well under a second,
# importing neither torch nor Triton, papermill, plotly or pandas (tests/test_cli.py; `labkit run X --help` asks
# torch only what "auto" becomes here), and no command but a cluster's imports Ray (tests/test_cluster.py).
costmodel = lazy.module(".costmodel", __package__)
execute = lazy.module(".execute", __package__)
experiments = lazy.module(".experiments", __package__)
results = lazy.module(".results", __package__)
shapes = lazy.module(".shapes", __package__)
studies = lazy.module(".experiments.studies", __package__)
sweep = lazy.module(".sweep", __package__)
transfer = lazy.module(".engine.transfer", __package__)
outdir = lazy.module(".outdir", __package__)
peer = lazy.module(".peer", __package__)
nightly = lazy.module(".nightly", __package__)
lab = lazy.module(".lab", __package__)
cluster = lazy.module(".cluster.executor", __package__)
node = lazy.module(".cluster.node", __package__)
export = lazy.module(".exchange.export", __package__)
importer = lazy.module(".exchange.importer", __package__)
report_compare = lazy.module(".report.compare", __package__)
report_gpus = lazy.module(".report.gpus", __package__)
report_index = lazy.module(".report.index", __package__)
report_notebook = lazy.module(".report.notebook", __package__)
readme_tables = lazy.module(".docs.readme_tables", __package__)
docs_runs = lazy.module(".docs.runs", __package__)
docs_box = lazy.module(".docs.box", __package__)
serve_cli = lazy.module(".serving.serve_cli", __package__)     # itself light: checks options before torch is imported


# ------------------------------------------------------------------------------------------ run
def experiments_help() -> str:
    w = max(map(len, experiments.EXPERIMENTS))
    lines = ["experiments (labkit run NAME --help lists a NAME's parameters):", ""]
    for e in experiments.EXPERIMENTS.values():
        once = [old for old, new in RENAMED_EXPERIMENTS.items() if new == e.name]
        lines.append(f"  {e.name:<{w}}  {e.question}")
        lines.append(f"  {'':<{w}}  needs: {e.needs}; notebook: notebooks/{e.notebook}"
                     + (f"; measures {e.system}" if e.system else "")
                     + (f"; once {' or '.join(once)} (still accepted)" if once else ""))
    return "\n".join(lines)


SWITCH_TAIL = "; several values: one sweep each, in this run (empty: as the environment says)"


def _here() -> str:
    """This machine's device type as "auto" resolves it ("cuda" or "cpu")."""
    try:
        return resolve_device("auto").type
    except Exception:           # no torch, a broken driver: the CPU values are what a run would take
        return "cpu"


def _default_text(p, here: str) -> str:
    """A parameter's default as `--help` shows it; an "auto" (or 0) with per-device values says what it becomes here."""
    show = lambda v: ",".join(map(str, v)) if isinstance(v, list) else str(v)      # noqa: E731
    default = show(p.default)
    if p.auto is not None and (p.default in ("auto", "") or p.default == 0) and here in p.auto:
        return f"{default}; here: {show(p.auto[here])}"
    if p.name == "device" and p.default == "auto":
        return f"auto; here: {here}"
    return default if default != "" else "(empty)"


def params_help(name: str) -> str:
    """`labkit run NAME --help`: the parameters in three groups (what to measure, the strategies' own settings, the
    engine's switches), each with its type, its default (an "auto" says what it becomes on this machine) and help."""
    e = experiments.get(name)
    here = _here()
    lines = [f"labkit run {e.name} [-p NAME=VALUE ...] [--out DIR]", "", e.question, f"needs: {e.needs}",
             f"notebook: notebooks/{e.notebook} (the same parameters)",
             f"this machine: {'a CUDA GPU' if here == 'cuda' else 'no CUDA GPU (CPU)'}; an auto below says what it becomes here"]
    spec = [p for p in e.spec if p.name != "out_dir"]
    settings, switches = {p.name for p in transfer.strategy_params()}, {p.name for p in envs.switch_params()}
    in_force = {k: str(v).lower() if isinstance(v, bool) else v for k, v in envs.in_force().items()}
    groups = [("parameters (lists comma-separated; sizes as 8K, 1M)", [p for p in spec if p.name not in settings | switches]),
              ("strategy settings (each applies where its strategies run)", [p for p in spec if p.name in settings]),
              ("engine switches (empty: as the shell's LABKIT_* variables say; several values: one sweep each, in this "
               "run)", [p for p in spec if p.name in switches])]
    w = max(len(p.name) for p in spec)
    kw = max(len(p.kind) for p in spec)
    for title, ps in groups:
        if not ps:
            continue
        lines += ["", title + ":"]
        for p in ps:
            text = p.help[: -len(SWITCH_TAIL)] if p.help.endswith(SWITCH_TAIL) else p.help
            d = f"(empty); here: {in_force[p.name]}" if p.name in switches and p.name in in_force \
                else _default_text(p, here)
            lines.append(f"  {p.name:<{w}}  {p.kind:<{kw}}  {text} [default {d}]")
    lines += ["", f"  {'--out DIR':<{w}}  {'':<{kw}}  run folder [default results/<run-id>]"]
    return "\n".join(lines)


def cmd_run(a) -> int:
    """Exit 0 only when the run's status is `ok`; a run a signal stopped: the one stop message, exit 128 + the
    signal (130 for Ctrl-C); otherwise one line saying what it is and why, exit 1."""
    if a.help or not a.experiment:
        print(params_help(a.experiment) if a.experiment else experiments_help())
        return 0
    given = kv_pairs(a.p)
    if a.cluster:                # on a node of the cluster; the folder comes back here (labkit/cluster)
        return cluster.run_on_cluster(a, given)
    if a.on:
        raise BadInput("--on picks a machine kind of a cluster: give --cluster ADDRESS too")
    made = None
    if a.out:
        given["out_dir"] = a.out
        out = Path(a.out)
        made = next((p for p in [*reversed(out.absolute().parents), out.absolute()] if not p.exists()), None)
        outdir.prepare_out_dir(out)            # one line now (not after the plan's checks) if it cannot be the run's
    try:
        plan = experiments.plan(a.experiment, given)      # parsed and checked once, here
        _say_if_long(a.experiment, plan)
        # papermill and pandas load here, inside the try: a Ctrl-C while they load leaves no folder behind
        execute.run_notebook, results.load_run      # noqa: B018
    except BaseException:               # bad input, or Ctrl-C before the run began
        if made is not None:            # nothing written: the folders just made go again
            shutil.rmtree(made, ignore_errors=True)
        raise
    seen: list = []                         # the signals that stopped the run, as the driver received them
    a.began = True                          # from here a second Ctrl-C leaves a folder (said by `main`)
    try:
        path, err = execute.run_notebook(plan, signals=seen)
    except execute.Terminated as t:                 # settled and rendered; say so and stop
        path, err = t.path, None
    report = path / "report.html"
    try:
        run = results.load_run(path)
        status, why = results.effective_status(run.manifest), results.status_reason(run.manifest, run.metrics)
    except (OSError, ValueError) as ex:
        run, status, why = None, "failed", f"failed: no readable manifest ({type(ex).__name__})"
    _after_run(path)
    if status == "interrupted" or seen:
        return _stopped(a.experiment, path, run, seen, report_notebook.ran_to_the_end(path))
    if status != "ok" or err is not None:
        if status == "ok":       # measured fine, then something after (e.g. the report) failed: a folder without
            # its report is not a whole run, and the manifest says so as the line does
            why = f"partial: report not written: {execute.error_line(err)}"
            try:
                mf = {**run.manifest, "status": "partial", "error": why.removeprefix("partial: ")}
                atomic.write_text_or_in_place(path / "manifest.json", json.dumps(mf, indent=1, default=str))
            except OSError:
                pass             # the line below still says it; the index then shows the run as it was
        elif err is not None and execute.error_line(err) not in why:
            why += f" ({execute.error_line(err)})"
        try:
            n_ok = int((run.metrics["status"] == "ok").sum())
        except Exception:
            n_ok = 0
        if n_ok and not report_notebook.ran_to_the_end(path):      # stopped at the measuring cell: its figures not drawn
            why += f"; `labkit report {path} --rerun` draws the {n_ok} point{'s' if n_ok != 1 else ''} measured"
        print(f"labkit: {a.experiment} run {why}", file=sys.stderr)
        if report.exists():
            print(report.resolve())
        return 1
    print(report.resolve())
    return 0


def _say_if_long(experiment: str, plan) -> None:
    """Before a run the lab expects to take longer than ten minutes here: how long, and how to shrink it. An estimate
    that cannot be made is no reason to stop a run: nothing is said."""
    try:
        est = experiments.estimate(plan)
    except Exception:
        return
    if est is not None and est.seconds > sweep.LONG_RUN_S:
        print(sweep.estimate_line(experiment, est), file=sys.stderr, flush=True)


def _stopped(experiment: str, path: Path, run, seen: list, drawn: bool) -> int:
    """A run a signal stopped: the one stop message (where it stopped, what it kept), the report's path, and the
    shell's exit status for that signal (130 for Ctrl-C)."""
    mf = run.manifest if run is not None else {}
    n = stops.measured_points(run.metrics, experiment) if run is not None else 0
    kept = stops.measured_words(n, mf) + f", kept in {path}"
    if n and not drawn:
        kept += f"; `labkit report {path} --rerun` draws them"
    elif n:
        kept += " and drawn in its report"
    signum = seen[0] if seen else None
    print(stops.stop_line(f"{experiment} run", signum, stops.where_stopped(mf), kept), file=sys.stderr)
    if (path / "report.html").exists():
        print((path / "report.html").resolve())
    return stops.exit_code(signum)


def _after_run(path: Path) -> None:
    """Rebuild the run index page beside the new run."""
    try:
        report_index.rebuild_index(path.parent)
    except Exception as ex:  # the run itself succeeded; say why the index did not update
        print(f"labkit: run index not rebuilt: {ex}", file=sys.stderr)


# ------------------------------------------------------------------------------------------ the rest
def cmd_study(a) -> int:
    if a.help or not a.study:
        print(studies.help_text(a.study))
        return 0
    return studies.run(a.study, kv_pairs(a.p))


def cmd_shapes(a) -> int:
    rows = [s.summary() for s in shapes.PRESETS.values()]
    if a.json:
        print(json.dumps(rows, indent=1))
    else:
        for r in rows:
            print(f"{r['name']:22s} layers={r['layers']:3d} attn_layers={r['attn_layers']:3d} row_bytes={r['row_bytes']:5d} "
                  f"index_key_bytes={r['index_key_bytes']:3d} weights={r['weight_bytes'] / 1e9:.2f} GB")
    return 0


def cmd_report(a) -> int:
    run_dir = run_folder(a.run_dir)
    run = results.load_run(run_dir)
    out = Path(a.out) if a.out else (run_dir / "report-standalone.html" if a.standalone else None)
    if a.rerun or not report_notebook.executed_notebooks(run_dir):
        # Re-execute the experiment's notebook against the folder's tables (run_dir=...), so the report
        # shows today's figures of the measured data; nothing is measured again.
        exp = experiments.EXPERIMENTS.get(run.manifest.get("experiment") or "")
        if exp is None:
            raise BadInput(f"{run_dir}: no executed notebook and no known experiment to render it with")
        run.metrics                # a table that is not one: one line now, not the notebook's traceback
        try:
            execute.rerender_notebook(exp, run_dir)
        except Exception as ex:    # the notebook failed on this folder's data: one line, the folder as it was
            print(f"labkit: {run_dir}: figures not drawn ({execute.error_line(ex)})", file=sys.stderr)
            return 1
    print(report_notebook.render_report(run_dir, out, standalone=a.standalone).resolve())
    _after_run(run_dir)       # the index links the new report (or tells how to draw one)
    return 0


# The published shape's reference run (docs/runs.toml's `reference`, this key): what `labkit predict` reads
# when no run is named, so the reference box's question is one command
PREDICT_DEFAULT_RUN = "h100"
PREDICT_MAX_CONTEXT = 1 << 26          # 64M tokens: beyond any model's context, and the memory check says so anyway
PREDICT_MAX_CONCURRENCY = 4096
PREDICT_MAX_VALUES = 64                # contexts or concurrencies in one table


def predict_default_run() -> str:
    """The folder of the published shape's reference run, as docs/runs.toml names it (`reference.h100`, W4A16)."""
    try:
        ref = docs_runs.RUNS["reference"][PREDICT_DEFAULT_RUN]
    except (OSError, KeyError, TypeError, ValueError):
        raise BadInput("no run named and no reference run in docs/runs.toml (`reference.h100`): name a decode run "
                       "with step anatomies, as `labkit runs` lists it") from None
    return str(results.REPO / ref)


def predict_values(text: str | None, what: str, top: int, sizes: bool) -> list[int] | None:
    """`--context 128K,1M` or `--concurrency 1,4`: whole numbers in 1..top, at most PREDICT_MAX_VALUES of them,
    sorted, each once. None when not given (the run's own measured points)."""
    if text is None:
        return None
    parts = [p.strip() for p in str(text).split(",")]
    if not parts or "" in parts or len(parts) > PREDICT_MAX_VALUES:
        raise BadInput(f"--{what}: one to {PREDICT_MAX_VALUES} whole numbers separated by commas, got {text!r}")
    out = set()
    for p in parts:
        try:
            v = parse_size(p) if sizes else int(p)
        except ValueError:
            raise BadInput(f"--{what}: {p!r} is not a whole number{' (e.g. 128K, 1M)' if sizes else ''}") from None
        if not 1 <= v <= top:
            raise BadInput(f"--{what} must be 1 to {top:,}, got {p}")
        out.add(v)
    return sorted(out)


def _predict_source(a):
    """The run `labkit predict` scales (named, or the published shape's reference run), checked: (run, its GPU, shape)."""
    # the reference run with the decode points docs/runs.toml joins to it (`reference_more`), as the docs read it
    more = () if a.run_dir else [results.REPO / p for p in docs_box.reference_more()]
    run = results.load_run(run_folder(a.run_dir or predict_default_run()), more)
    m, mf = run.metrics, run.manifest
    name = a.run_dir or run.path.name
    if not mf.get("gpu_name"):
        raise BadInput(f"{name}: a CPU run; labkit predict scales a GPU run's step anatomy by GPU specs")
    source = costmodel.gpu_for_name(mf.get("gpu_name") or "")
    if source is None:
        raise BadInput(f"{name}: measured on {mf.get('gpu_name')}, which labkit/data/gpus.toml does not list; the "
                       f"model needs the source GPU's specs")
    if "anat_weights_ms" not in m:
        raise BadInput(f"{name}: no step anatomy in this run (measured before anatomies existed, or anatomy=false)")
    return run, source, shapes.shape_for_run(mf["parameters"]["shape"], mf.get("shape_rev"))


def _predict_how(a, run, host) -> dict:
    """`CostModel.predict`'s options from the command line: split, weights, host scale, all-reduce, calibrations."""
    host = costmodel.check_host_gbps(host)        # the run's own figure, before anything divides by it
    if a.host_gbps is not None and (not a.host_gbps > 0 or a.host_gbps == float("inf") or not host):
        raise BadInput(f"--host-gbps must be a finite number > 0 and the run must record its host's RAM bandwidth "
                       f"({'it does not' if not host else f'got {a.host_gbps}'})")
    if a.allreduce_us is not None and not 0 <= a.allreduce_us < 1e6:
        raise BadInput(f"--allreduce-us must be 0 to 1,000,000 µs, got {a.allreduce_us}")
    how = {"split": a.split, "weights_dtype": a.weights_dtype,
           "host_scale": a.host_gbps / host if a.host_gbps else None}
    if a.allreduce_us is not None:
        how["allreduce_us"] = a.allreduce_us
    if a.calibration:
        try:
            cal = Path(a.calibration)
            how["calibration"] = (costmodel.Calibration.from_metrics(results.load_run(cal).metrics, "target", str(cal))
                                  if cal.is_dir() else costmodel.Calibration.load(cal))
            how["source_calibration"] = costmodel.Calibration.from_metrics(run.metrics, run.manifest.get("gpu_name") or "",
                                                                           str(run.path))
        except (ValueError, OSError) as ex:
            raise BadInput(f"--calibration: {ex}") from None
    return how


def cmd_predict(a) -> int:
    """Predicted step time and tok/s of a measured decode run on another GPU (a prediction, labelled): by default
    the published shape's reference run on the reference box (3x RTX 3090), at its contexts or `--context`."""
    if not 1 <= a.gpus <= 64:
        raise BadInput(f"--gpus must be 1 to 64, got {a.gpus}")
    try:
        target = costmodel.gpu(a.gpu)
    except ValueError as ex:
        raise BadInput(str(ex)) from None
    contexts = predict_values(a.context, "context", PREDICT_MAX_CONTEXT, sizes=True)
    conc = predict_values(a.concurrency, "concurrency", PREDICT_MAX_CONCURRENCY, sizes=False)
    run, source, shape = _predict_source(a)
    m, mf = run.metrics, run.manifest
    host = (mf.get("host_memory_bandwidth") or {}).get("copy_all_gbps")      # CPU-staged gathers' bound (labkit.hostmem)
    how = _predict_how(a, run, host)
    # a tensor split's all-reduce latency, unless measured (the option, or the calibration's): the band's two ends
    band = (costmodel.ALLREDUCE_BAND_US if a.split == "tensor" and a.gpus > 1
            and costmodel.measured_allreduce_us(how.get("allreduce_us"), how.get("calibration")) is None else None)
    tabs = [costmodel.predict_table(m, shape, source, target, a.gpus, contexts=contexts, concurrency=conc,
                                    host_gbps=host, **how, **({"allreduce_us": x} if band else {}))
            .assign(allreduce_us=x if band else None) for x in (band or (None,))]
    err = costmodel.validate(m, shape, source, host_gbps=host)
    if a.json:
        rows = [{k: (None if isinstance(v, float) and v != v else v) for k, v in r.items()}
                for t in tabs for r in t.to_dict("records")]   # a point that does not fit: null, not NaN (not JSON)
        print(json.dumps({"run": mf.get("run_id"), "shape": shape.name, "prediction": rows,
                          "allreduce_us_band": list(band) if band else None,
                          "validation_on_source": err.to_dict("records")}, indent=1, default=str))
        return 0
    measured = (costmodel.measured_allreduce_us(how.get("allreduce_us"), how.get("calibration"))
                if a.split == "tensor" and a.gpus > 1 else None)
    _print_prediction(a, tabs, err, target, source, shape, mf, band, measured)
    return 0


def _print_prediction(a, tabs, err, target, source, shape, mf, band=None, measured=None) -> None:
    """The table `labkit predict` prints: one line of what it is, one row per point, each point that does not fit
    the card's memory said so, then the reasoning at the largest context and the check on the source run. `band`:
    the all-reduce latencies of `tabs`' two tables (an unmeasured tensor split): each figure as the band's lo–hi;
    `measured`: the one measured latency a tensor split took instead, said with where it came from."""
    tab = tabs[0]
    split = "" if a.gpus == 1 else (", each layer split over them" if a.split == "tensor" else ", layers in stages")
    held = a.weights_dtype or (mf.get("parameters") or {}).get("weights_dtype") or "bf16"
    named = "" if a.run_dir else " (docs/runs.toml's reference run: the published shape)"
    print(f"PREDICTED (not measured) on {a.gpus} x {target.name} (PCIe gen{target.pcie_gen} x{target.pcie_width}, "
          f"{target.hbm_gbps} GB/s memory, {target.memory_gib:g} GiB{split}), shape {shape.name}, {held} weights, "
          f"from the anatomy of {mf['run_id']}{named} on {source.name}:")
    cols = ["strategy", "concurrency", "context_len", "predicted_step_ms", "predicted_tok_s", "memory_gib_per_gpu"]
    show = tab[cols].round(2).astype(object)
    show["context_len"] = [tokens_label(v) for v in tab["context_len"]]
    for c in ("predicted_step_ms", "predicted_tok_s"):      # a point whose memory exceeds the GPU: said, not NaN
        show[c] = ["–".join(f"{t[c].iloc[i]:.2f}" for t in tabs) if fits else "does not fit"
                   for i, fits in enumerate(tab["fits"])]
    print(show.to_string(index=False))
    if band:
        print(f"\nall-reduce latency unmeasured: each step and tok/s is the band over {band[0]:g}–{band[1]:g} µs an "
              f"all-reduce (lo–hi); a measured one (--allreduce-us, allreduce_us in a --calibration JSON, or a "
              f"--calibration folder of `labkit run probe` on the box's 2 or more GPUs) replaces the band")
    elif measured is not None:
        print(f"\nall-reduce latency {measured:g} µs, measured "
              f"({'--allreduce-us' if a.allreduce_us is not None else f'the --calibration {a.calibration}'})")
    usable = target.memory_gib - costmodel.MEMORY_RESERVE_GIB
    if not tab["fits"].all():
        print(f"\n'does not fit': the point needs more than the {usable:.1f} GiB usable of each card's "
              f"{target.memory_gib:g} GiB (memory_gib_per_gpu: weights, index keys and, for a strategy that keeps "
              f"the KV on the card, the KV)")
    print("\nwhy (largest context, lowest concurrency):")
    for strategy, g in tab.groupby("strategy"):
        r = g[g["concurrency"] == g["concurrency"].min()].sort_values("context_len").iloc[-1]
        print(f"  {strategy}: " + r["reasoning"].replace("; ", "\n    "))
    if not err.empty:
        print(f"\nthe same model predicting this run's own points on {source.key} (fit on one point per strategy): "
              f"median |error| {err['error'].abs().median():.1%}, worst {err['error'].abs().max():.1%}")


def _link(gen, width) -> str:
    """PCIe link as `5 x16` (manifests hold floats or None)."""
    def num(v):
        try:
            f = float(v)
        except (TypeError, ValueError):
            return None
        return f"{f:g}" if f == f and f not in (float("inf"), float("-inf")) else None
    g, w = num(gen), num(width)
    return f"{g} x{w}" if g and w else "-"


def cmd_runs(a) -> int:
    """A header, then one line per run, grouped by machine kind: the run (its folder under the root: what
    `labkit report` takes), experiment, status (stale when its process died here; a run committed from another
    machine whose manifest still says running reads as its points are), kind, machine (whole), link, sha, and the manifest's own name where
    it differs from the folder's (several runs may share a name; their folders never do)."""
    root = Path(a.root)
    if not root.is_dir():
        raise BadInput(f"--root {a.root} is not a folder")
    df = results.list_runs(root)
    if df.empty:
        print(f"no runs under {a.root}")
        return 0
    def text(v) -> str:
        return v if isinstance(v, str) else ""          # None / NaN from the table: empty

    rows = []
    for r in df.to_dict("records"):
        where = Path(r["path"])
        # the GPUs the run used (count, a power cap) where the manifest recorded them, else its GPU's name
        host = text(r.get("host"))
        machine = report_gpus.short_machine(r) or text(r.get("gpu_name")) or (host if host.upper().startswith("CPU") else f"CPU {host}")
        last = "" if where.name == text(r["run_id"]) else text(r["run_id"])
        if text(r.get("status")) == "unreadable":      # say why, whole, where a name would go
            machine, last = "", text(r.get("error"))
        rel = os.path.relpath(where, root)
        run = rel if _is_default_root(root) else str(where)       # as `labkit report` takes it from here
        sha = text(r.get("git_sha")).split()
        rows.append([run, text(r["experiment"]), text(r["status"]), report_index.machine_kind(r) if machine else "",
                     machine.strip(), _link(r.get("pcie_gen"), r.get("pcie_width")), sha[0][:18] if sha else "", last])
    rows.sort(key=lambda row: row[3])        # grouped by machine kind (stable: newest first within a kind)
    rows.insert(0, ["RUN", "EXPERIMENT", "STATUS", "KIND", "MACHINE", "LINK", "SHA", "NAME"])
    widths = [max(len(row[i]) for row in rows) for i in range(7)]      # ids and machines are never cut
    for row in rows:
        cells = [c.ljust(w) for c, w in zip(row[:7], widths)]
        print((" ".join(cells) + ("  " + row[7] if row[7] else "")).rstrip())
    return 0


def _is_default_root(root: Path) -> bool:
    return root.resolve() == Path("results").resolve()


def run_folder(arg: str) -> Path:
    """A run as `labkit runs` lists it (its folder under results/), or a run folder given by its path; the same for
    every command that takes a run. One line when it is neither."""
    p = Path(arg)
    if (p / "manifest.json").is_file():
        return p
    if not p.is_absolute():
        for root in (Path("results"), results.REPO / "results"):      # here, or the repository's (run from another folder)
            if (root / p / "manifest.json").is_file():
                return root / p
    if p.is_dir():
        raise BadInput(f"{arg} is not a run folder: no manifest.json")
    raise BadInput(f"{arg} is not a run: no folder {arg}, nor results/{arg} (`labkit runs` lists the runs)")


def cmd_docs(a) -> int:
    return readme_tables.main(write_files=a.write)


def cmd_compare(a) -> int:
    a.run_a, a.run_b = str(run_folder(a.run_a)), str(run_folder(a.run_b))
    return report_compare.cmd_compare(a)


def cmd_nightly(a) -> int:
    if a.cluster and not a.dry_run:      # each entry a job on the Ray cluster (labkit/cluster)
        return cluster.cmd_nightly_cluster(a)
    if a.on:
        raise BadInput("--on picks a machine kind of a cluster: give --cluster ADDRESS too")
    return nightly.cmd_nightly(a)


def cmd_node(a) -> int:
    return node.cmd_node(a)


def cmd_lab(a) -> int:
    return lab.cmd_lab(a)


def cmd_serve(a) -> int:
    return serve_cli.cmd_serve(a)


def cmd_export(a) -> int:
    a.runs = [str(run_folder(r)) for r in a.runs]
    return export.cmd_export(a)


def cmd_import(a) -> int:
    return importer.cmd_import(a)


def _add_exchange(sub) -> None:
    """`export` and `import`: a run's points as the rows benchmark archives share, and such rows in."""
    ex = sub.add_parser("export", help="a run's measured points as benchmark-archive rows (docs/share-rows.md)")
    ex.add_argument("runs", nargs="+", metavar="RUN", help="run folders, or runs as `labkit runs` lists them (an "
                                                           "imported run gives back the rows it took in)")
    ex.add_argument("--format", default="jsonl", help="jsonl (default), sqlite (a runs table) or markdown (to paste)")
    ex.add_argument("--out", help="file to write (default: stdout; sqlite needs one, and adds to an existing one)")
    ex.set_defaults(fn=cmd_export)

    im = sub.add_parser("import", help="benchmark-archive rows (JSONL or SQLite) into the results as an external run")
    im.add_argument("file", help="a JSONL file (one archive row per line) or a SQLite file with a `runs` table "
                                 "(what `labkit export --format sqlite` writes)")
    im.add_argument("--source", help="what the figures call these rows (default: the file's name), e.g. owner/repo@commit")
    im.add_argument("--hardware", help="the machine the rows were measured on, as their source states it")
    im.add_argument("--root", default="results", help="results folder (default results)")
    im.set_defaults(fn=cmd_import)


def _add_peer(sub) -> None:
    """`peer`: a peer's measurements of the reference model on 4x RTX 3090 (docs/peer-data.md)."""
    pe = sub.add_parser("peer", help="a peer's measured decode, prefill and concurrency of the reference model on "
                                     "4x RTX 3090 (docs/peer-data.md)")
    pe.add_argument("what", nargs="?", default="show", choices=("show", "rebuild"),
                    help="show: print the primary points [default]; rebuild: re-derive the shipped file from the "
                         "peer's raw JSONL folder")
    pe.add_argument("raw_dir", nargs="?", metavar="RAW_DIR", help="rebuild: the peer's benchmarks/2026-08-28/raw folder")
    pe.add_argument("--file", help="rebuild: the file to rewrite [default: the shipped one]")
    pe.set_defaults(fn=cmd_peer)


def cmd_peer(a) -> int:
    if a.what == "rebuild" and not a.raw_dir:
        raise BadInput("labkit peer rebuild needs RAW_DIR: the peer's benchmarks/2026-08-28/raw folder")
    return peer.cmd(a.what, a.raw_dir, a.file)


def _add_run_and_study(sub) -> None:
    """`run`: an experiment into a run folder; `study`: a cross-model study."""
    r = sub.add_parser("run", add_help=False, help="run an experiment into a run folder (labkit run --help lists them)",
                       usage="labkit run [EXPERIMENT] [-p NAME=VALUE ...] [--out DIR] [--help]")
    r.add_argument("experiment", nargs="?", help="the experiment (labkit run --help lists them)")
    r.add_argument("-p", action="append", metavar="NAME=VALUE", help="parameter (lists comma-separated)")
    r.add_argument("--out", help="run folder (default results/<run-id>)")
    r.add_argument("--cluster", metavar="ADDRESS", help="run on a node of the Ray cluster at HEAD_IP:PORT (docs/cluster.md)")
    r.add_argument("--on", metavar="KIND", help="with --cluster: the machine kind to run on (h200, rtx3090, cpu)")
    r.add_argument("-h", "--help", action="store_true", help="the experiments, or EXPERIMENT's parameters")
    r.set_defaults(fn=cmd_run)

    st = sub.add_parser("study", add_help=False, help="a cross-model study (labkit study --help lists them)",
                        usage="labkit study [NAME] [-p KEY=VALUE ...] [--help]")
    st.add_argument("study", nargs="?", help="the study (labkit study --help lists them)")
    st.add_argument("-p", action="append", metavar="KEY=VALUE", help="keyword of the study")
    st.add_argument("-h", "--help", action="store_true", help="the studies, or NAME's keywords")
    st.set_defaults(fn=cmd_study)


def _add_reading(sub) -> None:
    """Read run folders: `report`, `runs`, `predict`, `compare`."""
    rp = sub.add_parser("report", help="write DIR/report.html (plotly.js linked from results/_assets)")
    rp.add_argument("run_dir", metavar="RUN", help="a run as `labkit runs` lists it, or its folder")
    rp.add_argument("--standalone", action="store_true",
                    help="embed plotly.js: one self-contained file to send (default DIR/report-standalone.html)")
    rp.add_argument("--out", help="HTML file to write instead of DIR/report.html")
    rp.add_argument("--rerun", action="store_true",
                    help="re-execute the experiment's notebook on the folder's tables first (today's figures, no new measurement)")
    rp.set_defaults(fn=cmd_report)

    ls = sub.add_parser("runs", help="list run folders: one a line, its RUN what report, compare and predict take")
    ls.add_argument("--root", default="results", help="the folder of runs [default results]")
    ls.set_defaults(fn=cmd_runs)

    pr = sub.add_parser("predict", help="predict a decode run's table on another GPU from its step anatomy (default: "
                                        "the published model on 3x RTX 3090)")
    pr.add_argument("run_dir", metavar="RUN", nargs="?", default=None,
                    help="a GPU decode run with step anatomies, as `labkit runs` lists it, or its folder [default: the "
                         "published shape's reference run, docs/runs.toml's reference.h100 (W4A16, on an H100)]")
    pr.add_argument("--gpu", default="rtx3090", help="target GPU key in labkit/data/gpus.toml [default rtx3090]")
    pr.add_argument("--gpus", type=int, default=3,
                    help="GPUs the model is split over [default 3: the reference box; 1 for one card]")
    pr.add_argument("--context", metavar="TOKENS[,TOKENS...]",
                    help="contexts to predict, any length (e.g. 128K or 32K,128K,1M) [default: the run's measured ones]")
    pr.add_argument("--concurrency", metavar="N[,N...]",
                    help="concurrent requests to predict (e.g. 1 or 1,4,8) [default: the run's measured ones]")
    pr.add_argument("--split", choices=("layers", "tensor"), default="layers",
                    help="how the GPUs share the model: layers (stages in turn) or tensor (every layer sharded, "
                         "two all-reduces a layer) [default layers]")
    pr.add_argument("--allreduce-us", type=float, default=None,
                    help="one all-reduce's measured latency between your cards in µs (tensor split; without it, "
                         "or an all-reduce in the --calibration, the prediction is the band over 10–100 µs)")
    pr.add_argument("--calibration", help="rates measured on the target card: a calibration JSON (gpu_name, "
                    "hbm_read_gbps, link_gbps, optionally allreduce_us) or a probe or decode run folder made there "
                    "(its probe rows; a `labkit run probe` on 2 or more GPUs adds the all-reduce latency); the run's "
                    "own probe calibrates the source")
    pr.add_argument("--weights-dtype", choices=shapes.WEIGHT_DTYPES, help="predict the model held in these weights")
    pr.add_argument("--host-gbps", type=float, help="the target box's host RAM copy bandwidth (GB/s, all cores, as "
                    "`labkit run probe` measures it there): scales CPU-staged gathers (default: this run's host)")
    pr.add_argument("--json", action="store_true", help="the prediction and its check on the source run as JSON")
    pr.set_defaults(fn=cmd_predict)

    c = sub.add_parser("compare", help="compare two runs point by point (HTML page with ratios)")
    c.add_argument("run_a", metavar="RUN_A", help="the baseline run, as `labkit runs` lists it, or its folder")
    c.add_argument("run_b", metavar="RUN_B", help="the run compared with it (ratios are B / A)")
    c.add_argument("--out", help="HTML file to write (default: next to RUN_B, compare-A-vs-B.html)")
    c.set_defaults(fn=cmd_compare)


def _add_nightly(sub) -> None:
    """`nightly`: a plan of experiments, resumable."""
    n = sub.add_parser("nightly", help="run a plan of experiments (one papermill kernel each), resumable")
    n.add_argument("--plan", default="nightly/plan.toml", help="TOML plan (default nightly/plan.toml; plans/ holds others)")
    n.add_argument("--date", help="nightly folder date YYYY-MM-DD (default today, UTC); same date resumes")
    n.add_argument("--root", default="results", help="results folder (default results)")
    n.add_argument("--only", help="comma-separated entry names to run")
    n.add_argument("--dry-run", action="store_true", help="check the plan and print it; run nothing")
    n.add_argument("--cluster", metavar="ADDRESS", help="fan the entries out over the Ray cluster at HEAD_IP:PORT")
    n.add_argument("--on", metavar="KIND", help="with --cluster: the kind for entries whose plan names none")
    n.set_defaults(fn=cmd_nightly)


def _add_lab(sub) -> None:
    """`lab`: JupyterLab on the notebooks."""
    lab = sub.add_parser("lab", help="JupyterLab on notebooks/ (127.0.0.1, token; prints the URL and the SSH tunnel)")
    lab.add_argument("--port", type=int, default=8888, help="port to bind on 127.0.0.1 (next free one if taken)")
    lab.add_argument("--port-exact", action="store_true", help="fail rather than move to another port")
    lab.add_argument("--token", help="access token (visible to other local users in this command's argv: prefer "
                                          "$LABKIT_LAB_TOKEN; default: that, else a random one)")
    lab.add_argument("--dir", default="", help="folder to serve (default the repository's notebooks/)")
    lab.add_argument("--edit-tracked", action="store_true",
                     help="let JupyterLab save the notebooks git tracks (default: they open read-only, so running "
                          "one never autosaves over the committed file; Save As keeps a session)")
    lab.add_argument("jupyter_args", nargs="*", metavar="-- JUPYTER_OPTION",
                     help="passed on to jupyter lab after `--`, e.g. -- --LabApp.expose_app_in_browser=True")
    lab.set_defaults(fn=cmd_lab)


def _add_serve(sub) -> None:
    """`serve`: labkit's engine behind vLLM's OpenAI API."""
    s = sub.add_parser("serve", help="serve labkit's engine behind vLLM's OpenAI API: completions, chat, /metrics (127.0.0.1); "
                                     "not the vLLM sweep, which is `labkit run serve_sweep`",
                       description="labkit's engine (a model shape with seeded random weights, not a trained model: "
                                   "its speed and protocol are real, its replies random tokens) behind vLLM's OpenAI "
                                   "API on 127.0.0.1. Two lanes of request slots, one with its KV resident, one "
                                   "offloaded to host RAM; a policy places each request; the lanes' batches can be "
                                   "switched at layer boundaries (PulseInfer).")
    s.add_argument("--shape", default="tiny", help="model shape preset or .json file (`labkit shapes` lists them); "
                                                   "weights are random, seeded by --seed [default tiny]")
    s.add_argument("--device", default="auto", help="auto (cuda where present, else cpu), cpu, cuda, cuda:N [default auto]")
    s.add_argument("--resident-slots", type=int, default=4, help="requests the resident lane holds at once [default 4]")
    s.add_argument("--offload-slots", type=int, default=4,
                   help="requests the offload lane (KV in host RAM) holds at once [default 4]")
    s.add_argument("--capacity", type=int, default=4096, help="tokens per request slot (prompt + output) [default 4096]")
    s.add_argument("--budget", type=int, default=2048, help="rows the indexer selects per QSA layer [default 2048]")
    s.add_argument("--strategy", default="zero_copy", help="the offload lane's transfer strategy [default zero_copy]")
    s.add_argument("--policy", default="threshold:2048", help="where a request goes: resident | offload | threshold:N "
                   "(prompts over N tokens offloaded) | adaptive (by calibrated step and transfer costs) "
                   "[default threshold:2048]")
    s.add_argument("--switching", default="on", help="on: the two lanes' batches switched at layer boundaries "
                   "(PulseInfer); off: they take turns [default on]")
    s.add_argument("--page-size", type=int, default=256, help="tokens per KV page [default 256]")
    s.add_argument("--prefill-chunk", type=int, default=8192, help="prompt tokens prefilled per chunk [default 8192]")
    s.add_argument("--compile", action="store_true",
                   help="torch.compile the block pieces (CUDA; one compile per batch size seen)")
    s.add_argument("--graphs", action="store_true", help="CUDA graphs per batch composition (CUDA)")
    s.add_argument("--timeline-every", type=int, default=0,
                   help="record the switching timeline every N rounds, served at /metrics (0: never) [default 0]")
    s.add_argument("--seed", type=int, default=0, help="seed of the random weights [default 0]")
    s.add_argument("--model-name", default="labkit", help="the model name the API serves and answers to [default labkit]")
    s.add_argument("--tokenizer", default="auto",
                   help="smollm2-135m | none | auto (SmolLM2's where installed): how string prompts become tokens")
    s.add_argument("--host", default="127.0.0.1", help="loopback only: 127.0.0.1, localhost or ::1 [default 127.0.0.1]")
    s.add_argument("--port", type=int, default=8000, help="TCP port [default 8000]")
    s.add_argument("--log-level", default="warning", help="the HTTP server's (uvicorn's) log level [default warning]")
    s.add_argument("--max-body-mib", type=float, default=16,
                   help="largest request body taken, in MiB (larger: HTTP 413, before it is parsed) [default 16]")
    s.add_argument("--overflow", default="on",
                   help="on | off: with threshold:N, a request whose lane is full takes a free slot of the other [default on]")
    s.add_argument("--keep-records", type=int, default=1000,
                   help="finished requests and decode rounds GET /stats keeps (the newest; totals cover all) [default 1000]")
    s.set_defaults(fn=cmd_serve)
    serve_cli.one_line_errors(s)        # `--port abc`: one line, as every other bad option of serve


def _add_shapes_and_docs(sub) -> None:
    """`shapes` and `docs`."""
    sh = sub.add_parser("shapes", help="list model shape presets")
    sh.add_argument("--json", action="store_true", help="every preset's summary as JSON")
    sh.set_defaults(fn=cmd_shapes)

    d = sub.add_parser("docs", help="the measured tables of README.md and docs/, generated from committed runs: "
                                    "printed (nothing written) unless --write")
    d.add_argument("--write", action="store_true", help="rewrite the generated blocks in README.md and docs/ in place "
                                                        "(without it: print every block to stdout, write nothing)")
    d.set_defaults(fn=cmd_docs)


def _add_node(sub) -> None:
    """`node`: this box into the lab's Ray cluster."""
    nd = sub.add_parser("node", help="join this box to the lab's Ray cluster (or start it with --head), advertising "
                                     "its GPU kind and labkit commit (docs/cluster.md)")
    nd.add_argument("--head", action="store_true", help="start the cluster on this box")
    nd.add_argument("--address", help="HEAD_IP:PORT of the cluster to join")
    nd.add_argument("--ip", help="this box's address on the lab's private network (required; never 0.0.0.0)")
    nd.add_argument("--port", type=int, default=6379, help="the head's port (default 6379)")
    nd.add_argument("--kind", help="declare the machine kind instead of detecting it (h200, rtx3090, cpu)")
    nd.add_argument("--gpus", type=int, help="with --kind: how many entries of that kind the box runs at once")
    nd.add_argument("--token-file", help="Ray's cluster token (default $RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token; "
                                         "the head creates it)")
    nd.add_argument("--num-cpus", type=int, help="CPUs Ray may schedule on this box (default: all)")
    nd.add_argument("--temp-dir", help="Ray's session folder (default /tmp/ray)")
    nd.add_argument("--scratch", help="where entries run before their folders go to the head (default: a temp folder)")
    nd.add_argument("--dashboard", action="store_true", help="start Ray's dashboard on the head, bound to --ip")
    nd.add_argument("--dry-run", action="store_true", help="print the ray start command; start nothing")
    nd.set_defaults(fn=cmd_node)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="labkit", description="KV-cache offload lab: `labkit run --help` lists the experiments")
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    _add_run_and_study(sub)
    _add_reading(sub)
    _add_nightly(sub)
    _add_lab(sub)
    _add_serve(sub)
    _add_shapes_and_docs(sub)
    _add_node(sub)
    _add_exchange(sub)
    _add_peer(sub)
    for choice in sub._choices_actions:          # `labkit X --help` opens with what X does, as `labkit --help` lists it
        parser = sub.choices[choice.dest]
        if not parser.description:
            parser.description = choice.help
    return ap


def _without_p(argv: list[str]) -> str | None:
    """The first NAME=VALUE given to `run` or `study` without its `-p` (argparse would call it an unrecognized
    argument and say no more)."""
    if not argv or argv[0] not in ("run", "study"):
        return None
    takes_value = ("-p", "--out", "--cluster", "--on")
    for before, tok in zip(argv[1:], argv[2:]):
        if "=" in tok and not tok.startswith("-") and before not in takes_value:
            return tok
    return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    loose = _without_p(argv)
    if loose:
        name = next((t for t in argv[1:] if not t.startswith("-") and "=" not in t), "NAME")
        print(f"labkit: {loose}: a parameter takes -p before it: labkit {argv[0]} {name} -p {loose} "
              f"(labkit {argv[0]} {name} --help lists them)", file=sys.stderr)
        return 2
    try:
        a = build_parser().parse_args(argv)
    except KeyboardInterrupt:      # before the command was known
        print(stops.stop_line("labkit", signal.SIGINT, "before it began"), file=sys.stderr)
        return stops.exit_code(signal.SIGINT)
    try:
        envs.check_environment()       # a mistyped or malformed LABKIT_* is one line, not a silent default
        rc = a.fn(a)
        sys.stdout.flush()          # inside the try: a closed pipe is caught below, not at exit
        return rc
    except (BadInput, FileNotFoundError, FileExistsError) as ex:
        print(f"labkit: {ex}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:     # Ctrl-C outside a run's kernel (planning, reading, drawing): files are whole or absent
        if a.cmd == "run" and getattr(a, "began", False):      # a second Ctrl-C, while the stopped run was drawn
            line = stops.stop_line(f"{a.experiment} run", signal.SIGINT, "twice", "what it measured is kept in its folder "
                             "(`labkit runs` lists it; `labkit report RUN --rerun` draws it)")
        elif a.cmd == "run" and a.experiment:
            line = stops.stop_line(f"{a.experiment} run", signal.SIGINT, "before it began", "nothing was written")
        else:
            line = stops.stop_line(a.cmd, signal.SIGINT)
        print(line, file=sys.stderr)
        return stops.exit_code(signal.SIGINT)
    except BrokenPipeError:
        # the reader went away (`labkit runs | head`): what it read is what it wanted. Point stdout at
        # /dev/null so the interpreter's final flush does not fail again on the closed pipe.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    except OSError as ex:        # a read-only or full file system, a folder we may not write: one line
        print(f"labkit: {atomic.describe_os_error(ex)}", file=sys.stderr)
        return 2 if ex.errno in (errno.EROFS, errno.EACCES, errno.EPERM) else 1


if __name__ == "__main__":
    sys.exit(main())
