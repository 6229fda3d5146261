"""The JupyterLab explorer (`notebooks/explore.ipynb`): decode runs on disk browsed with widgets, and one
point measured live. The notebook only calls this module:

    ex = Explorer(results_root, run)     # finds the runs, builds the controls and figures (run headless, as
                                         # papermill or nbconvert run it: the first view as static figures and no
                                         # widgets, so the notebook saves no widget state)
    ex.show()                            # controls, then the figures they drive (updated in place)
    ex.show_measure()                    # "measure now": button, progress, live PCIe plot, live table

`measure_point` is the one measurement path behind the button. It is the decode sweep itself
(`labkit run decode`'s sweep) on a one-point grid, written to a scratch run folder outside
`results/`: the same validation, model, caches, timing, NVML byte check and failed-row handling as a
sweep, so a live point is comparable with the runs it sits next to. The scratch folder is kept (its path
is in the record) and can be opened with `labkit report`.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import textwrap
import threading
import time
from contextlib import contextmanager
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:     # Python 3.10
    import tomli as tomllib

import comm
import IPython.display as ipd       # `ipd.display`, looked up when called: a test stands in its own
import ipywidgets as W
import nbformat
import numpy as np
import pandas as pd
import plotly.graph_objects as go
from IPython import get_ipython
from nbformat.sign import NotebookNotary

from . import envs, experiments, lazy
from .costmodel import numeric_metrics
from .params import BadInput, one_line
from .report.figures import COLORS
from .report.index import machine_label
from .report.renderer import bundle
from .report.units import tokens_label as ctx_label
from .results import REPO, load_run, run_manifests
from .telemetry import Sampler

torch = lazy.module("torch")        # browsing runs on disk needs no torch; measuring a point loads it

# figure widths (px): the first two side by side in a notebook about 1000 px wide; titles wrap to them
CTX_W, POINT_W, BUDGET_W = 560, 440, 1000

TOK_COLS = ("strategy", "context_len", "budget", "concurrency", "tok_s", "step_ms_median", "step_ms_min",
            "step_ms_max", "h2d_bytes_per_step", "nvml_rx_bytes_per_step")




def results_root(given: str | Path = "") -> Path:
    return Path(given or envs.get("LABKIT_RESULTS") or REPO / "results")


def decode_runs(root: str | Path) -> dict[str, tuple[dict, pd.DataFrame]]:
    """Every run under root with ok decode points: label -> (manifest, rows). Newest first. A run that cannot be
    read, or whose table holds text or no finite whole number where a point's numbers belong, is left out: one
    malformed run never hides the others."""
    root = Path(root)
    out = []
    for mf in run_manifests(root):
        try:
            found = _decode_run(mf, root)
        except Exception:      # a half-written or foreign folder: not a run to explore
            continue
        if found is not None:
            out.append(found)
    out.sort(key=lambda t: t[0], reverse=True)
    return {label: (mf, d) for _, label, mf, d in out}


def _decode_run(mf: Path, root: Path) -> tuple[str, str, dict, pd.DataFrame] | None:
    """(created, label, manifest, ok decode rows) of the run whose manifest is `mf`; None without decode points.
    Raises (BadInput, OSError, ValueError, ...) for a run whose rows are not what the explorer reads."""
    r = load_run(mf.parent)
    m = numeric_metrics(r.metrics, f"{mf.parent}/metrics.parquet")
    d = m[(m["experiment"] == "decode") & (m["status"] == "ok")].copy() if "experiment" in m else m.iloc[0:0]
    if d.empty:
        return None
    if "axis" not in d:
        d["axis"] = "context"
    for c in ("context_len", "budget", "concurrency"):
        if not (d[c].notna() & (d[c].abs() < 2**62)).all():
            raise ValueError(f"{mf.parent}: a decode point's {c} is not a finite number")
        d[c] = d[c].astype(int)
    # a multi-GPU run's rows name no shape (the manifest does): a missing one would be a value no
    # dropdown holds (NaN), so it is the run's shape
    run_shape = (r.manifest.get("shape_info") or {}).get("name") or (r.manifest.get("parameters") or {}).get("shape")
    d["shape"] = d["shape"].astype(object).where(d["shape"].notna(), run_shape if isinstance(run_shape, str) else "?")
    d["shape"] = d["shape"].astype(str)
    created = str(r.manifest.get("created") or "")
    label = f"{mf.parent.relative_to(root)} · {machine_label(r.manifest)} · {created[:16]}"
    return created, label, r.manifest, d


def default_point(d: pd.DataFrame) -> tuple[int, int, int]:
    """The (context, budget, concurrency) a run opens on: a point that was measured, with every figure filled.

    The sweep measures its main table (every context) at one budget per concurrency and its budget axis at
    one context only, so the smallest budget and the middle context may well be a point never measured.
    Taken instead: the (budget, concurrency) with the most contexts measured (the fullest tok/s-vs-context
    curve), then among its contexts the one with the most budgets measured (the budget axis's context, so
    the budget figure is a curve too); with no budget axis, the middle context."""
    if d.empty:
        return 0, 0, 0
    main = d[d["axis"] == "context"] if (d["axis"] == "context").any() else d
    per = main.groupby(["budget", "concurrency"])["context_len"].nunique()
    b, c = per.sort_index().idxmax()          # ties: the smallest budget, then the smallest concurrency
    ctxs = sorted(main[(main["budget"] == b) & (main["concurrency"] == c)]["context_len"].unique())
    budgets = d[d["concurrency"] == c].groupby("context_len")["budget"].nunique().reindex(ctxs)
    ctx = int(budgets.idxmax()) if budgets.max() > 1 else ctxs[len(ctxs) // 2]
    return int(ctx), int(b), int(c)


def wrap_title(text: str, width: int, note: str = "") -> str:
    """A plot title that fits a figure `width` px wide (plotly clips a long title at the right edge rather
    than wrapping it): broken into lines, with an optional `note` below it in a smaller font."""
    out = "<br>".join(textwrap.wrap(text, max(20, (width - 60) // 9)))
    if note:
        small = "<br>".join(textwrap.wrap(note, max(24, (width - 60) // 7)))
        out += f"<br><span style='font-size:12px;color:#666'>{small}</span>"
    return out


def tok_err(g: pd.DataFrame) -> dict:
    """Error bars of tok/s from the step-time spread (fastest and slowest step)."""
    hi = g["concurrency"] / (g["step_ms_min"] / 1e3) - g["tok_s"]
    lo = g["tok_s"] - g["concurrency"] / (g["step_ms_max"] / 1e3)
    return dict(type="data", symmetric=False, array=hi.clip(lower=0).tolist(), arrayminus=lo.clip(lower=0).tolist())


def cuda_note() -> str:
    """Empty when a CUDA GPU is here; otherwise why "measure now" is disabled and what to do instead."""
    if torch.cuda.is_available():
        return ""
    return (f"<b>measure now is disabled:</b> this machine has no CUDA GPU (torch {torch.__version__}, "
            "torch.cuda.is_available() is False). CPU timings are not comparable with the GPU runs; "
            "measure on a GPU box, or use <code>labkit run decode -p device=cpu</code> for a CPU run.")


def measure_point(shape: str, strategy: str, context_len: int, budget: int, concurrency: int, repeats: int = 5,
                  steps: int = 20, device: str = "cuda", scratch: str | Path | None = None, progress_bar: bool = False) -> dict:
    """One decode point measured by the sweep (the decode sweep on a one-point grid, no probe, no prefill) into a
    scratch run folder. Returns the sweep's metrics row (status `ok` or `failed` with its error) plus
    `run_dir`. Bad parameters raise `BadInput` before anything is allocated, as in a sweep."""
    out = Path(scratch) if scratch else Path(tempfile.mkdtemp(prefix="labkit-live-"))
    run = experiments.measure("decode", dict(shape=shape, device=device, strategies=strategy, context_lens=str(int(context_len)),
                         budgets=str(int(budget)), concurrency=str(int(concurrency)), repeats=int(repeats),
                         steps=int(steps), prefill_lens="", probe=False, out_dir=str(out)), progress_bar=progress_bar)
    rec = next(r for r in run.records if r.get("experiment") == "decode")
    return {**rec, "run_dir": str(run.path)}


def save_first_view(notebook: str | Path = REPO / "notebooks" / "explore.ipynb", root: str | Path = "",
                    run: str = "") -> str:
    """Store the explorer's first view over the runs under `root` (the repository's results/) as the outputs
    of the notebook's explorer cell, so the figures show the moment the notebook opens; returns the run.
    The outputs are figures in plotly's mimetype (drawn by JupyterLab's plotly extension, no kernel needed).
    `run`: the run shown; default the README's decode table (docs/runs.toml's `decode_now`), every context
    and strategy of one committed run."""
    nb = nbformat.read(notebook, as_version=4)
    cell = next(c for c in nb.cells if c.cell_type == "code" and "Explorer(" in c.source)
    if not run:
        run = Path(tomllib.loads((REPO / "docs" / "runs.toml").read_text())["runs"]["decode_now"]).name
    ex = Explorer(root, run)
    cell.outputs = ex.first_view_outputs()
    cell.execution_count = None
    nbformat.write(nb, notebook)
    NotebookNotary().sign(nb)        # this machine's lab trusts what it wrote (labkit lab signs shipped ones)
    return (ex.w_run.value or "").split(" · ")[0]


def headless_kernel() -> bool:
    """Is this a Jupyter kernel that no widget-drawing front end serves (papermill, nbconvert, nbclient)? Jupyter
    Server gives the kernels it starts (JupyterLab, Notebook 7, Voila, `labkit lab`) JPY_SESSION_NAME; VS Code and
    Colab are known by their own marks. Outside a kernel (a script, the tests) nothing records widget state: False."""
    try:
        shell = get_ipython()
    except Exception:
        return False
    if shell is None or type(shell).__name__ != "ZMQInteractiveShell":
        return False
    live = os.environ.get("JPY_SESSION_NAME") or os.environ.get("VSCODE_PID") or "google.colab" in sys.modules \
        or "__vsc_ipynb_file__" in shell.user_ns
    return not live


@contextmanager
def no_frontend():
    """Widgets made inside talk to nobody: their comms are `comm`'s DummyComm, so a headless run's notebook records
    no widget state (plotly's FigureWidget state carries its whole JavaScript: 39 MB for the explorer)."""
    made = comm.create_comm
    comm.create_comm = lambda *a, **kw: comm.DummyComm(*a, **kw)
    try:
        yield
    finally:
        comm.create_comm = made


class Explorer:
    """Widgets and FigureWidgets over the decode runs under `root`; every selection redraws in place. `widgets`:
    "auto" (widgets where a live front end draws them, else the first view as static figures), "on", "off"."""

    def __init__(self, root: str | Path = "", run: str = "", widgets: str = "auto"):
        if widgets not in ("auto", "on", "off"):
            raise ValueError(f"widgets must be auto, on or off, got {widgets!r}")
        self.interactive = widgets == "on" or (widgets == "auto" and not headless_kernel())
        if self.interactive:
            self._build(root, run)
        else:
            with no_frontend():
                self._build(root, run)

    def _build(self, root: str | Path, run: str) -> None:
        self.root = results_root(root)
        self.runs = decode_runs(self.root)
        first = next((k for k in self.runs if k.split(" · ")[0].split("/")[-1] == run), next(iter(self.runs), None))
        slider = dict(continuous_update=False, layout=W.Layout(width="460px"))
        self.w_run = W.Dropdown(options=list(self.runs), value=first, description="run", layout=W.Layout(width="760px"))
        self.w_shape = W.Dropdown(description="shape")
        self.w_strat = W.SelectMultiple(description="strategies", rows=4)
        self.w_ctx = W.SelectionSlider(options=[("-", 0)], description="context", **slider)
        self.w_budget = W.SelectionSlider(options=[("-", 0)], description="budget", **slider)
        self.w_conc = W.SelectionSlider(options=[("-", 0)], description="concurrency", **slider)
        # room above the plot for a title of up to three lines (see wrap_title)
        base = dict(template="plotly_white", height=400, margin=dict(t=90, b=40))
        # side by side in a notebook about 1000 px wide: fixed widths, or the second figure is cut off
        self.fig_ctx = go.FigureWidget(layout=dict(base, width=CTX_W, xaxis=dict(type="log", title="context (tokens)"),
                                                   yaxis=dict(title="decode tok/s (aggregate)", rangemode="tozero"),
                                                   title="tok/s vs context"))
        self.fig_point = go.FigureWidget(layout=dict(base, width=POINT_W, yaxis=dict(title="decode tok/s", rangemode="tozero"),
                                                     title="the selected point"))
        self.fig_budget = go.FigureWidget(layout=dict(base, width=BUDGET_W, xaxis=dict(type="log", title="budget"),
                                                      yaxis=dict(title="decode tok/s", type="log"), title="tok/s vs budget"))
        self.readout = W.HTML()
        self._busy = False
        self.w_run.observe(self._on_run, "value")
        self.w_shape.observe(self._on_shape, "value")
        for w in (self.w_strat, self.w_ctx, self.w_budget, self.w_conc):
            w.observe(self.update, "value")
        self._on_run()
        self._build_measure()

    # ------------------------------------------------------------------ browsing

    def run_rows(self) -> pd.DataFrame:
        """Every ok decode row of the selected run, whatever shape is selected."""
        if self.w_run.value is None:
            return pd.DataFrame(columns=["shape", "strategy", "axis", "context_len", "budget", "concurrency", "tok_s"])
        return self.runs[self.w_run.value][1]

    def rows(self) -> pd.DataFrame:
        d = self.run_rows()
        return d[d["shape"] == self.w_shape.value] if self.w_shape.value else d

    def _set_options(self, w, values, default: int, fmt=str) -> None:
        values = sorted(set(int(v) for v in values)) or [0]
        w.options = [(fmt(v), v) for v in values]
        w.value = default if default in values else values[0]

    def _on_run(self, _=None) -> None:
        self._busy = True
        try:
            # the new run's own shapes: through rows() they would still be filtered by the old run's shape
            shapes = sorted(self.run_rows()["shape"].unique())
            self.w_shape.value = None          # before the options change, so no stale value is kept
            self.w_shape.options = shapes
            self.w_shape.value = shapes[0] if shapes else None
            self._on_shape()
        finally:
            self._busy = False
        self.update()

    def _on_shape(self, _=None) -> None:
        was, self._busy = self._busy, True
        try:
            d = self.rows()
            strats = list(dict.fromkeys(d["strategy"]))
            self.w_strat.options = strats
            self.w_strat.value = tuple(strats)
            ctx, b, c = default_point(d)
            self._set_options(self.w_ctx, d["context_len"], ctx, ctx_label)
            self._set_options(self.w_budget, d["budget"], b)
            self._set_options(self.w_conc, d["concurrency"], c)
        finally:
            self._busy = was
        if not was:
            self.update()

    def selected_point(self) -> pd.DataFrame:
        d = self.rows()
        sel = d[d["strategy"].isin(list(self.w_strat.value))]
        pt = sel[(sel["context_len"] == self.w_ctx.value) & (sel["budget"] == self.w_budget.value)
                 & (sel["concurrency"] == self.w_conc.value)]
        return pt.drop_duplicates("strategy")

    def update(self, _=None) -> None:
        """Redraw the three figures in place for the current selection."""
        if self._busy:
            return
        d = self.rows()
        strats = list(self.w_strat.value)
        ctx, b, c = self.w_ctx.value, self.w_budget.value, self.w_conc.value
        sel = d[d["strategy"].isin(strats)]
        with self.fig_ctx.batch_update():
            self.fig_ctx.data = []
            g_all = sel[(sel["budget"] == b) & (sel["concurrency"] == c) & (sel["axis"] == "context")]
            for s in strats:
                g = g_all[g_all["strategy"] == s].sort_values("context_len")
                self.fig_ctx.add_scatter(x=g["context_len"].tolist(), y=g["tok_s"].tolist(), mode="lines+markers", name=s,
                                         line=dict(color=COLORS.get(s)), error_y=tok_err(g))
            self.fig_ctx.layout.shapes = [dict(type="line", x0=ctx, x1=ctx, yref="paper", y0=0, y1=1,
                                               line=dict(dash="dot", color="gray"))] if ctx else []
            self.fig_ctx.layout.title = wrap_title(f"tok/s vs context — budget {b}, concurrency {c}", CTX_W,
                                                   "" if len(g_all) else "no context sweep at this budget and concurrency")
        pt = self.selected_point()
        with self.fig_point.batch_update():
            self.fig_point.data = []
            if len(pt):
                self.fig_point.add_bar(
                    x=pt["strategy"].tolist(), y=pt["tok_s"].tolist(), error_y=tok_err(pt), name="on disk",
                    marker_color=[COLORS.get(s, "#444") for s in pt["strategy"]],
                    customdata=np.stack([pt["step_ms_median"], pt["h2d_bytes_per_step"].fillna(0) / 2**20], -1).tolist(),
                    hovertemplate="%{x}: %{y:.1f} tok/s<br>step %{customdata[0]:.2f} ms<br>H2D %{customdata[1]:.1f} MiB/step<extra></extra>")
            self.fig_point.layout.title = wrap_title(f"context {ctx_label(ctx)}, budget {b}, concurrency {c}", POINT_W,
                                                     "" if len(pt) else "not measured in this run")
        bud = sel[(sel["concurrency"] == c) & (sel["context_len"] == ctx)]
        with self.fig_budget.batch_update():
            self.fig_budget.data = []
            for s in strats:
                g = bud[bud["strategy"] == s].drop_duplicates("budget").sort_values("budget")
                if len(g):
                    self.fig_budget.add_scatter(x=g["budget"].tolist(), y=g["tok_s"].tolist(), mode="lines+markers", name=s,
                                                line=dict(color=COLORS.get(s)), error_y=tok_err(g))
            n = bud["budget"].nunique()
            axis_ctx = sorted(set(sel[sel["axis"] == "budget"]["context_len"]))
            where = f" (this run's budget axis is at context {', '.join(map(ctx_label, axis_ctx))})" if axis_ctx else ""
            self.fig_budget.layout.title = wrap_title(
                f"tok/s vs budget at context {ctx_label(ctx)}, concurrency {c}", BUDGET_W,
                "" if n > 1 else ("one budget measured here" if n else "no budget measured here") + where)
        if len(pt):
            cells = "".join(f"<tr><td>{r.strategy}</td><td>{r.tok_s:.1f} tok/s</td><td>{r.step_ms_median:.2f} ms "
                            f"({r.step_ms_min:.2f}..{r.step_ms_max:.2f})</td>"
                            f"<td>{(r.h2d_bytes_per_step or 0) / 2**20:.1f} MiB/step</td></tr>" for r in pt.itertuples())
            self.readout.value = f"<table>{cells}</table>"
        else:
            self.readout.value = "<i>no point measured at this selection</i>"

    def _fresh_widgets(self, *names: str) -> None:
        """Re-create FigureWidgets from their current content just before they are displayed. plotly's
        widget sends trace changes as deltas that only a rendered view applies; a widget filled before its
        first display would show empty axes. Built from a figure, the traces are in its initial state."""
        for n in names:
            setattr(self, n, go.FigureWidget(getattr(self, n)))

    def show(self) -> None:
        if not self.interactive:        # headless: the controls said in words, the figures as the lab's renderer draws them
            self._show_static()
            return
        self._fresh_widgets("fig_ctx", "fig_point", "fig_budget")
        if not self.runs:
            ipd.display(W.HTML(f"<b>No decode runs under {self.root}.</b> Make one with <code>make sweep</code>, "
                           "or point <code>results_root</code> (or $LABKIT_RESULTS) at a folder of runs."))
        controls = W.VBox([self.w_run, W.HBox([self.w_shape, self.w_strat]), self.w_ctx, self.w_budget, self.w_conc])
        ipd.display(controls, W.HBox([self.fig_ctx, self.fig_point]), self.fig_budget, self.readout)

    def _show_static(self) -> None:
        """The view a headless run keeps: what the controls would select, in words, then the three figures as the
        lab's renderer emits them (plotly's JSON for JupyterLab, a div for an HTML page with plotly.js)."""

        if not self.runs:
            ipd.display({"text/markdown": f"**No decode runs under `{self.root}`.** Make one with `make sweep`, or point "
                                      "`results_root` (or $LABKIT_RESULTS) at a folder of runs.",
                     "text/plain": f"No decode runs under {self.root}."}, raw=True)
            return
        run = (self.w_run.value or "").split(" · ")[0]
        ipd.display({"text/markdown": f"*The run `{run}` as the explorer opens on it. No front end draws widgets here "
                                  "(a headless run): the controls appear when the notebook runs in JupyterLab "
                                  "(`make lab`).*",
                 "text/plain": f"The run {run}; no widgets in a headless run: open the notebook in JupyterLab (make lab)."},
                raw=True)
        for fig in (self.fig_ctx, self.fig_point, self.fig_budget):
            ipd.display(bundle(go.Figure(fig)), raw=True)

    def first_view_outputs(self) -> list[dict]:
        """The first view as static notebook outputs: a line naming the run, then the three figures in
        plotly's own mimetype, which JupyterLab draws when the notebook opens, before any cell has run
        (`save_first_view` stores them in explore.ipynb; running the cell replaces them with live controls)."""
        run = (self.w_run.value or "").split(" · ")[0]
        out = [nbformat.v4.new_output("display_data", data={
            "text/markdown": f"*A saved first view of the run `{run}`. Run the notebook (Run → Run All Cells) "
                             "for the controls: every run, shape, strategy, context, budget and concurrency.*",
            "text/plain": f"A saved first view of the run {run}."})]
        for fig in (self.fig_ctx, self.fig_point, self.fig_budget):
            spec = json.loads(go.Figure(fig).to_json())
            title = str(((spec.get("layout") or {}).get("title") or {}).get("text", "")).split("<br>")[0]
            out.append(nbformat.v4.new_output("display_data", data={"application/vnd.plotly.v1+json": spec,
                                                                    "text/plain": f"figure: {title}"}))
        return out

    # ------------------------------------------------------------------ measure now

    def _build_measure(self) -> None:
        note = cuda_note()
        self.device = "cuda"
        self.w_repeats = W.IntSlider(value=5, min=1, max=20, description="repeats")
        self.w_steps = W.IntSlider(value=20, min=2, max=100, description="steps")
        self.measure = W.Button(description="measure now", button_style="primary", icon="play", disabled=bool(note),
                                tooltip="needs a CUDA GPU" if note else "runs the selected point on this GPU")
        self.why = W.HTML(note)
        self.bar = W.IntProgress(value=0, min=0, max=3, description="idle", layout=W.Layout(width="460px"))
        self.status = W.HTML()
        self.fig_pcie = go.FigureWidget(layout=dict(template="plotly_white", height=300, title="PCIe RX to the GPU (NVML, live)",
                                                    xaxis=dict(title="s"), yaxis=dict(title="GB/s", rangemode="tozero")))
        self.fig_pcie.add_scatter(x=[], y=[], mode="lines", name="PCIe RX GB/s")
        self.live = W.HTML()
        self.live_rows: list[dict] = []
        self.measure.on_click(self.measure_now)

    def _watch_pcie(self, stop: threading.Event, t0: float) -> None:
        """Plot the GPU's PCIe receive rate while the point runs (a second NVML sampler; the sweep keeps its own)."""
        dev = torch.device(self.device)
        with Sampler(gpus=[dev.index or 0] if dev.type == "cuda" else []) as tel:
            while not stop.wait(0.5):
                self.status.value = f"measuring… {time.time() - t0:.0f} s"
                f = tel.frame()
                if f.empty or "pcie_rx_gbps" not in f:
                    continue
                f = f.dropna(subset=["pcie_rx_gbps"])
                with self.fig_pcie.batch_update():
                    self.fig_pcie.data[0].x = (f["timestamp"] - t0).tolist()
                    self.fig_pcie.data[0].y = f["pcie_rx_gbps"].tolist()

    def measure_selected(self, device: str | None = None) -> dict:
        """Measure the selection (first selected strategy) with the sweep; shows it beside the stored bars."""
        device = device or self.device
        strat = (list(self.w_strat.value) or ["zero_copy"])[0]
        args = dict(shape=self.w_shape.value or "auto", strategy=strat, context_len=self.w_ctx.value,
                    budget=self.w_budget.value, concurrency=self.w_conc.value, repeats=self.w_repeats.value,
                    steps=self.w_steps.value, device=device)
        self.bar.value, self.bar.description = 1, "measuring"
        stop, t0 = threading.Event(), time.time()
        watcher = threading.Thread(target=self._watch_pcie, args=(stop, t0), daemon=True)
        watcher.start()
        try:
            rec = measure_point(**args)
        except BadInput as ex:                 # a selection the sweep refuses: one line, nothing allocated
            rec = {**args, "status": "failed", "error": str(ex)}
        finally:
            stop.set()
            watcher.join(timeout=5)
        self.bar.value = 3
        self.bar.description = "done" if rec.get("status") == "ok" else "failed"
        self.status.value = (f"{rec['strategy']}: {rec['tok_s']:.1f} tok/s in {time.time() - t0:.0f} s "
                             f"(scratch run <code>{rec['run_dir']}</code>)" if rec.get("status") == "ok"
                             else f"<b>measure now failed:</b> {rec.get('error')}")
        if rec.get("status") == "ok":
            self.fig_point.add_bar(x=[f"live {strat}"], y=[rec["tok_s"]], marker_color="black", name="live")
            self.live_rows.append({k: rec.get(k) for k in TOK_COLS})
            self.live.value = pd.DataFrame(self.live_rows).round(3).to_html(index=False)
        return rec

    def measure_now(self, _=None) -> None:
        self.measure.disabled = True
        try:
            self.measure_selected()
        except Exception as ex:      # OOM or anything else: say so, keep the notebook alive
            self.bar.description = "failed"
            self.status.value = f"<b>measure now failed:</b> {one_line(ex)}"
        finally:
            self.measure.disabled = bool(cuda_note())

    def show_measure(self) -> None:
        if not self.interactive:
            ipd.display({"text/markdown": "*Measure now is a button: it appears when the notebook runs in JupyterLab.*",
                     "text/plain": "Measure now needs JupyterLab."}, raw=True)
            return
        self._fresh_widgets("fig_pcie")
        if cuda_note():          # no GPU: no live PCIe plot to draw (it would stay empty axes); the note says why
            ipd.display(W.HBox([self.measure, self.w_repeats, self.w_steps]), self.why)
            return
        ipd.display(W.HBox([self.measure, self.w_repeats, self.w_steps]), self.why, W.HBox([self.bar, self.status]),
                self.fig_pcie, self.live)
