"""`labkit run|report|probe|shapes|runs`: the command-line door to the same experiments as the notebooks.

    labkit shapes [--json]
    labkit run decode -p context_lens=8K,64K,1M -p concurrency=1,4 [--out DIR]
    labkit probe [--out DIR]
    labkit report DIR [--standalone] [--rerun]
    labkit runs [--root results]
    labkit predict DIR --gpu rtx3090 --gpus 3

Bad input prints one line and exits 2 before anything is allocated or written.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from .bench.params import BadInput, kv_pairs as _kv


def cmd_shapes(a) -> int:
    from .shapes import PRESETS
    rows = [s.summary() for s in PRESETS.values()]
    if a.json:
        print(json.dumps(rows, indent=1))
    else:
        for r in rows:
            print(f"{r['name']:22s} layers={r['layers']:3d} attn_layers={r['attn_layers']:3d} row_bytes={r['row_bytes']:5d} "
                  f"index_key_bytes={r['index_key_bytes']:3d} weights={r['weight_bytes'] / 1e9:.2f} GB")
    return 0


def _run(experiment: str, params: dict, out: str | None) -> int:
    """Exit 0 only when the run's status is `ok`; otherwise one line saying what it is and why, exit 1."""
    from .execute import Terminated, error_line, run_notebook
    from .results import effective_status, load_run, status_reason
    try:
        path, err = run_notebook(experiment, params, out)
    except Terminated as t:                 # settled and rendered; say so and stop
        path, err = t.path, None
    report = path / "report.html"
    try:
        run = load_run(path)
        status, why = effective_status(run.manifest), status_reason(run.manifest, run.metrics)
    except (OSError, ValueError) as ex:
        status, why = "failed", f"failed: no readable manifest ({type(ex).__name__})"
    _after_run(path)
    if status != "ok" or err is not None:
        if status == "ok":       # measured fine, then something after (e.g. the report) failed
            why = f"report not written: {error_line(err)}"
        elif err is not None and error_line(err) not in why and status != "interrupted":
            why += f" ({error_line(err)})"
        print(f"labkit: {experiment} run {why}", file=sys.stderr)
        if report.exists():
            print(report.resolve())
        return 1
    print(report.resolve())
    return 0


def _after_run(path: Path) -> None:
    """Rebuild the run index page beside the new run."""
    from .index import rebuild_index
    try:
        rebuild_index(path.parent)
    except Exception as ex:  # the run itself succeeded; say why the index did not update
        print(f"labkit: run index not rebuilt: {ex}", file=sys.stderr)


def cmd_run(a) -> int:
    return _run(a.experiment, _kv(a.p), a.out)


def cmd_probe(a) -> int:
    return _run("probe", _kv(a.p), a.out)


def cmd_report(a) -> int:
    from .report.notebook import executed_notebooks, render_report
    from .results import load_run
    run_dir = Path(a.run_dir)
    run = load_run(run_dir)   # one line if it is not a run folder
    out = Path(a.out) if a.out else (run_dir / "report-standalone.html" if a.standalone else None)
    if a.rerun or not executed_notebooks(run_dir):
        # Re-execute the experiment's notebook against the folder's tables (run_dir=...), so the report
        # shows today's figures of the measured data; nothing is measured again.
        from .execute import EXPERIMENTS, rerender_notebook
        exp = EXPERIMENTS.get(run.manifest.get("experiment", ""))
        if exp is None:
            raise BadInput(f"{run_dir}: no executed notebook and no known experiment to render it with")
        rerender_notebook(exp, run_dir)
    print(render_report(run_dir, out, standalone=a.standalone).resolve())
    return 0


def cmd_predict(a) -> int:
    """Predicted step time and tok/s of a measured decode run on another GPU (a prediction, labelled)."""
    from . import costmodel as C
    from .results import load_run
    from .shapes import ModelShape
    if a.gpus < 1:
        raise BadInput(f"--gpus must be >= 1, got {a.gpus}")
    try:
        target = C.gpu(a.gpu)
    except ValueError as ex:
        raise BadInput(str(ex)) from None
    run = load_run(Path(a.run_dir))
    m, mf = run.metrics, run.manifest
    source = C.gpu_for_name(mf.get("gpu_name") or "")
    if source is None:
        raise BadInput(f"{a.run_dir}: measured on {mf.get('gpu_name') or 'a CPU'}, which labkit/data/gpus.toml does not "
                       f"list; the model needs the source GPU's specs")
    if "anat_weights_ms" not in m:
        raise BadInput(f"{a.run_dir}: no step anatomy in this run (measured before anatomies existed, or anatomy=false)")
    shape = ModelShape.from_name(mf["parameters"]["shape"])
    tab = C.predict_table(m, shape, source, target, a.gpus)
    err = C.validate(m, shape, source)
    if a.json:
        print(json.dumps({"prediction": tab.to_dict("records"), "validation_on_source": err.to_dict("records")}, indent=1,
                         default=str))
        return 0
    print(f"PREDICTED (not measured) on {a.gpus} x {target.name} (PCIe gen{target.pcie_gen} x{target.pcie_width}, "
          f"{target.hbm_gbps} GB/s memory), from the anatomy of {mf['run_id']} on {source.name}:")
    cols = ["strategy", "concurrency", "context_len", "predicted_step_ms", "predicted_tok_s", "fits", "memory_gib_per_gpu"]
    print(tab[cols].round(2).to_string(index=False))
    print("\nwhy (largest context, concurrency 1):")
    for strategy, g in tab.groupby("strategy"):
        r = g[g["concurrency"] == g["concurrency"].min()].sort_values("context_len").iloc[-1]
        print(f"  {strategy}: " + r["reasoning"].replace("; ", "\n    "))
    if not err.empty:
        print(f"\nthe same model predicting this run's own points on {source.key} (fit on one point per strategy): "
              f"median |error| {err['error'].abs().median():.1%}, worst {err['error'].abs().max():.1%}")
    return 0


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
    """One short line per run: id, experiment, status (stale when its process died), machine, link, sha;
    the folder only when it is not `<root>/<run id>`."""
    from .results import list_runs
    root = Path(a.root)
    if not root.is_dir():
        raise BadInput(f"--root {a.root} is not a folder")
    df = list_runs(root)
    if df.empty:
        print(f"no runs under {a.root}")
        return 0
    def text(v) -> str:
        return v if isinstance(v, str) else ""          # None / NaN from the table: empty

    rows = []
    for r in df.to_dict("records"):
        where = Path(r["path"])
        machine = text(r.get("gpu_name")) or "CPU " + text(r.get("host"))
        rows.append([text(r["run_id"]) or where.name, text(r["experiment"]), text(r["status"]), machine.strip()[:24],
                     _link(r.get("pcie_gen"), r.get("pcie_width")), text(r.get("git_sha"))[:12],
                     "" if where.name == text(r["run_id"]) else os.path.relpath(where, root)])   # only when not the id
    widths = [min(max(len(row[i]) for row in rows), cap) for i, cap in enumerate((44, 13, 11, 24, 7, 12))]
    for row in rows:
        cells = [c[:w].ljust(w) for c, w in zip(row[:6], widths)]
        print((" ".join(cells) + ("  " + row[6] if row[6] else "")).rstrip())
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="labkit", description="KV-cache offload lab")
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("shapes", help="list model shape presets")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_shapes)
    r = sub.add_parser("run", help="run an experiment notebook under papermill into a run folder")
    r.add_argument("experiment")
    r.add_argument("-p", action="append", metavar="KEY=VALUE", help="parameter (lists comma-separated)")
    r.add_argument("--out", help="run folder (default results/<run-id>)")
    r.set_defaults(fn=cmd_run)
    p = sub.add_parser("probe", help="measure the host link's limits")
    p.add_argument("-p", action="append", metavar="KEY=VALUE")
    p.add_argument("--out")
    p.set_defaults(fn=cmd_probe)
    rp = sub.add_parser("report", help="write DIR/report.html (plotly.js linked from results/_assets)")
    rp.add_argument("run_dir")
    rp.add_argument("--standalone", action="store_true",
                    help="embed plotly.js: one self-contained file to send (default DIR/report-standalone.html)")
    rp.add_argument("--out", help="HTML file to write instead of DIR/report.html")
    rp.add_argument("--rerun", action="store_true",
                    help="re-execute the experiment's notebook on the folder's tables first (today's figures, no new measurement)")
    rp.set_defaults(fn=cmd_report)
    pr = sub.add_parser("predict", help="predict a decode run's table on another GPU from its step anatomy")
    pr.add_argument("run_dir")
    pr.add_argument("--gpu", default="rtx3090", help="target GPU key in labkit/data/gpus.toml")
    pr.add_argument("--gpus", type=int, default=1, help="GPUs the layers are split over (the reference box: 3)")
    pr.add_argument("--json", action="store_true")
    pr.set_defaults(fn=cmd_predict)
    ls = sub.add_parser("runs", help="list run folders")
    ls.add_argument("--root", default="results")
    ls.set_defaults(fn=cmd_runs)
    for hook in _extensions():
        hook(sub)
    return ap


def _extensions():
    """Sub-commands that live beside their modules (each module's `add_cli(subparsers)`)."""
    from . import compare, lab, nightly
    from .serving import engine_server
    return [nightly.add_cli, compare.add_cli, lab.add_cli, engine_server.add_cli]


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    try:
        return a.fn(a)
    except (BadInput, FileNotFoundError, FileExistsError) as ex:
        print(f"labkit: {ex}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
