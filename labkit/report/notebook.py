"""HTML reports from the executed notebooks in a run folder, readable offline.

The notebooks use the lab's plotly renderer (`renderer.py`): every figure is plotly's JSON mimetype beside a
`<div>` plus data, and no plotly.js in the notebook (notebooks run before it embedded the 4.8 MB bundle once in
their first cell's output: dropped from the stored notebook). The report gets plotly.js once in its head: a link to
the results folder's shared copy (`results/_assets/plotly.min.js`, see `assets.py`), or embedded with
`standalone=True` (`labkit report DIR --standalone`: one file to send). Code cells are hidden; cells
tagged `remove_output` (progress bars) lose their output; widgets are not used in reports (their loader
would come from a CDN).
"""
from __future__ import annotations

import re
from pathlib import Path
import json
import signal

import nbformat

from ..atomic import write_text
from ..results import manifest_object
from ..stops import measured_points, measured_words, signal_words, where_stopped
from .assets import plotly_script
from .gpus import SECTION_TITLE, gpu_line, gpu_section


def _exporter():
    # nbconvert (and its traitlets) is the optional `lab` extra
    from nbconvert import HTMLExporter
    from nbconvert.preprocessors import TagRemovePreprocessor
    from traitlets.config import Config
    c = Config()
    c.TagRemovePreprocessor.remove_all_outputs_tags = {"remove_output"}
    c.TagRemovePreprocessor.remove_cell_tags = {"remove_cell"}
    c.TagRemovePreprocessor.enabled = True
    ex = HTMLExporter(config=c, template_name="lab")
    ex.exclude_input = True
    ex.exclude_input_prompt = True
    ex.exclude_output_prompt = True
    ex.register_preprocessor(TagRemovePreprocessor(config=c), enabled=True)
    return ex


# nbconvert's lab template links require.js and MathJax from a CDN, and plotly's notebook renderer (notebooks run
# before the lab's renderer) added a MathJax <script src=cdn> to every figure. Reports have no LaTeX and get
# plotly.js in their head, so these tags only produce failed loads (console errors) offline: drop them.
_CDN_SCRIPT = re.compile(r'<script[^>]*\ssrc="https://cdnjs\.cloudflare\.com/ajax/libs/(?:require\.js|mathjax)/[^"]*"[^>]*>\s*</script>')


def strip_cdn_scripts(html: str) -> str:
    return _CDN_SCRIPT.sub("", html)


def _is_plotlyjs_bundle(output) -> bool:
    html = output.get("data", {}).get("text/html", "") if output.get("output_type") == "display_data" else ""
    html = "".join(html) if isinstance(html, list) else html
    return len(html) > 1_000_000 and "plotly.js" in html[:5000]


def shrink_notebook(nb) -> int:
    """Drop the plotly.js bundle (~4.8 MB) that plotly's "notebook" renderer embedded in the setup cell's output of
    notebooks run before the lab's renderer (`renderer.py`, which embeds none); `render_report` puts plotly.js into
    the page itself. Returns the number of outputs dropped."""
    n = 0
    for cell in nb.cells:
        if cell.get("cell_type") == "code" and cell.get("outputs"):
            keep = [o for o in cell.outputs if not _is_plotlyjs_bundle(o)]
            n += len(cell.outputs) - len(keep)
            cell.outputs = keep
    return n


def _plotlyjs_script(out: Path, standalone: bool) -> str:
    return '<script type="text/javascript">window.PlotlyConfig = {MathJaxConfig: "local"};</script>\n' \
           + plotly_script(out, standalone)


def executed_notebooks(run_dir: str | Path) -> list[Path]:
    return sorted(p for p in Path(run_dir).glob("*.ipynb") if not p.name.startswith("."))


PAPERMILL_ERROR_TAG = "papermill-error-cell-tag"
STOPPED_EARLY = ("interrupted", "failed", "partial", "stale")


def _where(cell) -> str:
    """A failing cell in words: its number and what it does (its first line of code that is not a comment)."""
    lines = [ln.strip() for ln in "".join(cell.get("source", "")).splitlines() if ln.strip() and not ln.strip().startswith("#")]
    tags = cell.get("metadata", {}).get("tags", [])
    what = "starting the kernel (importing the lab)" if "setup" in tags else "measuring" if "remove_output" in tags \
        else f"`{lines[0][:80]}`" if lines else "a cell"
    return f"cell [{cell.get('execution_count') or '?'}], {what}"


def ran_to_the_end(run_dir: str | Path) -> bool:
    """Did the folder's executed notebook(s) run every cell (no error output): are its figures drawn?"""
    nbs = executed_notebooks(run_dir)
    try:
        return bool(nbs) and not any(o.get("output_type") == "error" for p in nbs
                                     for c in nbformat.read(p, as_version=4).cells for o in c.get("outputs", []))
    except (OSError, nbformat.reader.NotJSONError, ValueError):     # cut off (a full disk): not drawn
        return False


def mark_stopped(nb, run_dir: Path) -> bool:
    """A run that stopped early (Ctrl-C, a signal, an error) says so at the top, in words: its status, where it
    stopped, how long it ran, what was measured and whether the figures below draw it. Papermill's red
    "An Exception was encountered" cell goes, and an interrupt's traceback becomes one line: a Ctrl-C that
    lands while a module is importing chains whatever that import was trying (jsonschema's optional
    `rfc3987`, say), which reads as a missing dependency when it is not one. Returns whether it marked."""
    try:
        mf = manifest_object(run_dir / "manifest.json")
    except (OSError, ValueError):
        mf = {}
    status = mf.get("status")
    errors_left = any(o.get("output_type") == "error" for c in nb.cells for o in c.get("outputs", []))
    had_papermill_cell = any(PAPERMILL_ERROR_TAG in c.get("metadata", {}).get("tags", []) for c in nb.cells)
    if status not in STOPPED_EARLY and not had_papermill_cell:
        return False
    nb.cells = [c for c in nb.cells if PAPERMILL_ERROR_TAG not in c.get("metadata", {}).get("tags", [])]
    where, stop_at = "", None
    for k, c in enumerate(nb.cells):
        for i, o in enumerate(c.get("outputs", [])):
            if o.get("output_type") != "error":
                continue
            if stop_at is None:
                where, stop_at = _where(c), k
            if o.get("ename") == "KeyboardInterrupt":
                c["outputs"][i] = nbformat.v4.new_output("stream", name="stderr",
                                                         text="stopped here: interrupted by a signal (Ctrl-C)\n")
    if stop_at is not None:      # the cells after the stop never ran: their headings would head nothing
        nb.cells = nb.cells[: stop_at + 1]
    try:
        import pandas as pd
        n_ok = measured_points(pd.read_parquet(run_dir / "metrics.parquet"), mf.get("experiment", ""))
    except Exception:
        n_ok = 0
    rel = run_dir.as_posix()
    measured = measured_words(n_ok, mf) + ("" if n_ok == 0 else ", drawn below" if not errors_left else
                                           f", kept in metrics.parquet: `labkit report {rel} --rerun` draws them")
    why = str(mf.get("error") or "").strip().splitlines()[:1]
    if status == "interrupted":
        sig = mf.get("stopped_by")
        why = [f"by {signal_words(signal_number(sig)) if sig else 'Ctrl-C or a signal'}"]
    at = where_stopped(mf)
    place = ", ".join(x for x in (at, f"in {where}" if where else "") if x)
    text = (f"**This run stopped early: {status or 'not finished'}**" + (f" ({why[0]})" if why else "") + "."
            + (f" It stopped {place}; {measured}." if place else f" {measured[:1].upper()}{measured[1:]}."))
    banner = nbformat.v4.new_markdown_cell(text)
    banner.metadata["tags"] = ["labkit-stopped"]
    first_md = next((i for i, c in enumerate(nb.cells) if c.cell_type == "markdown"), -1)
    nb.cells.insert(first_md + 1, banner)
    return True


def _header_cell(nb) -> int:
    """Where a report names its run: the first cell whose output begins `**Run**` (every notebook's header),
    else the banner that says the run stopped, else the title (the first markdown cell), else the top."""
    for i, c in enumerate(nb.cells):
        outputs = c.get("outputs", []) if c.get("cell_type") == "code" else []
        if any("".join(o.get("data", {}).get("text/markdown", "")).lstrip().startswith("**Run**") for o in outputs):
            return i
    return next((i for i, c in enumerate(nb.cells) if "labkit-stopped" in c.get("metadata", {}).get("tags", [])),
                next((i for i, c in enumerate(nb.cells) if c.cell_type == "markdown"), -1))


def add_gpu_cells(nb, run_dir: Path) -> bool:
    """The run's GPUs as the manifest recorded them: one line under the report's header, beside the figures
    (power limit of default, clocks, what held them down, peer access), and the machine section with the detail
    at the end. A manifest from before runs recorded its GPUs adds nothing. Returns whether it added."""
    try:
        mf = manifest_object(run_dir / "manifest.json")
    except (OSError, ValueError):
        return False
    line = gpu_line(mf)
    if not line:
        return False
    section = gpu_section(mf)
    cell = nbformat.v4.new_markdown_cell(f"**GPUs** {line}" + (f" (detail: *{SECTION_TITLE}*, at the end)" if section else ""))
    cell.metadata["tags"] = ["labkit-gpus"]
    nb.cells.insert(_header_cell(nb) + 1, cell)
    if section:
        end = nbformat.v4.new_markdown_cell(section)
        end.metadata["tags"] = ["labkit-gpus"]
        nb.cells.append(end)
    return True
def signal_number(name: str) -> int | None:
    try:
        return int(signal.Signals[name])
    except KeyError:
        return None


_NIGHT = re.compile(r"^nightly-(\d{4}-\d{2}-\d{2})$")


def report_title(run_dir: Path) -> tuple[str, str]:
    """The report's title, and for a nightly entry a line saying what it is. A nightly entry's folder (and run id)
    is the plan's entry name (`decode-small`), which alone says neither the experiment nor the night: its title
    names all three, `labkit nightly 2026-11-29: decode, entry decode-small`. Other runs keep their folder's name
    (their run id names the experiment), with the experiment added where the name does not hold it."""
    info: dict = {}
    for name in ("nightly-entry.json", "manifest.json"):      # the entry's record first: it exists for failed entries
        try:
            info = {**json.loads((run_dir / name).read_text()), **{k: v for k, v in info.items() if v}}
        except (OSError, ValueError):
            pass
    exp = info.get("experiment") or next((p.stem for p in executed_notebooks(run_dir)), "")
    night = _NIGHT.match(run_dir.parent.name)
    if night:
        date = night.group(1)
        return (f"labkit nightly {date}: {exp}, entry {run_dir.name}" if exp else f"labkit nightly {date}: entry {run_dir.name}",
                f"Nightly run of {date}, entry `{run_dir.name}`" + (f" (experiment `{exp}`)" if exp else "") + ".")
    return (f"labkit report {run_dir.name}" + (f" ({exp})" if exp and exp.replace("_", "-") not in run_dir.name.replace("_", "-")
                                               else ""), "")


def render_report(run_dir: str | Path, out: str | Path | None = None, shrink: bool = True, standalone: bool = False) -> Path:
    """Write `run_dir/report.html` (or `out`) from the executed notebook(s) in the folder (one page,
    sections in order); `standalone` embeds plotly.js instead of linking the results folder's copy."""
    run_dir = Path(run_dir)
    nbs = executed_notebooks(run_dir)
    if not nbs:
        raise FileNotFoundError(f"{run_dir} holds no executed notebook to render")
    ex = _exporter()
    parts = []
    for path in nbs:
        one = nbformat.read(path, as_version=4)
        if shrink_notebook(one) and shrink:   # the run folder keeps the notebook without the 4.8 MB bundle
            write_text(path, nbformat.writes(one))     # whole or unchanged (a full disk must not cut it)
        parts.append(one)
    nb = parts[0]
    for more in parts[1:]:   # several notebooks (e.g. probe + sweep): one page
        nb.cells.extend(more.cells)
    mark_stopped(nb, run_dir)
    add_gpu_cells(nb, run_dir)
    nb.metadata.pop("widgets", None)   # widget state would pull the widget manager from a CDN; reports are widget-free
    title, where = report_title(run_dir)
    nb.metadata["title"] = title
    if where:           # a nightly entry: which night, entry and experiment, under the notebook's heading
        first_md = next((i for i, c in enumerate(nb.cells) if c.cell_type == "markdown"), -1)
        nb.cells.insert(first_md + 1, nbformat.v4.new_markdown_cell(where))
    html, _ = ex.from_notebook_node(nb, resources={"metadata": {"name": f"labkit {run_dir.name}"}})
    # plotly.js exactly once, from the installed package, before any figure: readable offline
    out = Path(out) if out else run_dir / "report.html"
    html = strip_cdn_scripts(html).replace("<head>", "<head>\n" + _plotlyjs_script(out, standalone), 1)
    write_text(out, html)            # whole or absent
    return out
