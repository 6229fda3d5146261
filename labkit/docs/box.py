"""The reference box (3x RTX 3090, layers in stages) predicted from the published shape's run: the one path every
doc that predicts that box takes, the same as `labkit predict` with no run named (docs/runs.toml's `reference.h100`,
its manifest's shape and host RAM bandwidth, `costmodel.predict_table`), so no two docs print different figures
for one point. A stand-in run may be scaled beside it, labelled as such (`stand_in_table`)."""
from __future__ import annotations

import pandas as pd

from .. import costmodel as C
from ..report import summary as S
from ..report.units import tokens_label as _ctx
from ..results import REPO, load_run
from ..shapes import shape_for_run
from .runs import RUNS

BOX_KEY, BOX_CARDS = "rtx3090", 3      # the published box (labkit predict's defaults)
REFERENCE_GPU = "h100"                 # docs/runs.toml's `reference` key labkit predict reads by default


def reference_run() -> str:
    """The published shape's decode run `labkit predict` scales by default (`reference.h100`)."""
    return RUNS["reference"][REFERENCE_GPU]


def reference_more() -> list[str]:
    """Runs whose decode points join the reference run's (`reference_more.h100`: strategies a device sitting
    measured in another process)."""
    return list((RUNS.get("reference_more") or {}).get(REFERENCE_GPU, ()))


def _load(run: str):
    """A committed run, with `reference_more`'s decode points joined where it is the reference run."""
    return load_run(REPO / run, [REPO / p for p in reference_more()] if run == reference_run() else ())


def reference_metrics() -> pd.DataFrame:
    """The reference run's metrics with the decode points of `reference_more` joined."""
    return _load(reference_run()).metrics


def run_setup(run: str) -> dict:
    """A committed decode run as `labkit predict` reads it: metrics, shape (its manifest's), source GPU, host RAM
    bandwidth, and the run in words (shape, weights, GPU)."""
    lr = _load(run)
    mf, m = lr.manifest, lr.metrics
    shape = shape_for_run(mf["parameters"]["shape"], mf.get("shape_rev"))
    source = C.gpu_for_name(mf.get("gpu_name") or "")
    host = C.check_host_gbps((mf.get("host_memory_bandwidth") or {}).get("copy_all_gbps"))
    held = (mf.get("parameters") or {}).get("weights_dtype") or "bf16"
    words = f"{shape.name}, {held} weights, on one {source.name.replace('NVIDIA ', '')}"
    return {"metrics": m, "shape": shape, "source": source, "host": host, "words": words, "run": run}


def run_shape(run: str) -> str:
    """The shape a committed run was made with, as its manifest names it (name and revision: a stand-in reads as
    one, though its metrics' `shape` column may carry the published name)."""
    mf = load_run(REPO / run).manifest
    name = (mf.get("parameters") or {}).get("shape")
    return shape_for_run(name, mf.get("shape_rev")).name if name else ""


def box_table(run: str | None = None, contexts=None, concurrency=None, gpus: int = BOX_CARDS) -> pd.DataFrame:
    """`labkit predict RUN --gpu rtx3090 --gpus 3` as a table (default RUN: the published shape's reference run)."""
    s = run_setup(run or reference_run())
    return C.predict_table(s["metrics"], s["shape"], s["source"], C.gpu(BOX_KEY), gpus, contexts=contexts,
                           concurrency=concurrency, host_gbps=s["host"], split="layers", weights_dtype=None,
                           host_scale=None)


def box_errors(run: str | None = None) -> pd.DataFrame:
    """The same model predicting the run's own points (`labkit predict`'s check on the source run)."""
    s = run_setup(run or reference_run())
    return C.validate(s["metrics"], s["shape"], s["source"], host_gbps=s["host"])


def _cell(r) -> str:
    return f"{r['predicted_tok_s']:.1f}" if r["fits"] else "does not fit"


def box_block(stand_in: str = "", contexts=None, concurrency=(1, 4)) -> str:
    """The reference box's predicted decode from the published shape's run (resident and zero_copy), each row
    naming the run it scales; a stand-in run's prediction for the same point in its own, labelled column."""
    ref = run_setup(reference_run())
    tab = box_table(contexts=contexts, concurrency=list(concurrency))
    tab = tab[tab["strategy"].isin(["resident", "zero_copy"])]
    old = None
    if stand_in:
        o = box_table(stand_in, contexts=sorted(tab["context_len"].unique()), concurrency=list(concurrency))
        old = o.set_index(["strategy", "concurrency", "context_len"])
    name = ref["run"].rsplit("/", 1)[-1]
    rows = []
    for _, r in tab.iterrows():
        row = {"strategy": r["strategy"], "c": int(r["concurrency"]), "context": _ctx(r["context_len"]),
               "PREDICTED tok/s": _cell(r), "GiB per GPU": f"{r['memory_gib_per_gpu']:.1f}",
               "scales the run of": ref["words"]}
        if old is not None:
            k = (r["strategy"], r["concurrency"], r["context_len"])
            row["stand-in shape's prediction, tok/s"] = _cell(old.loc[k]) if k in old.index else "–"
        rows.append(row)
    head = (f"PREDICTED on {BOX_CARDS}× {C.gpu(BOX_KEY).name.replace('NVIDIA GeForce ', '')} (layers in stages), "
            f"from the published shape's run `{name}` ({ref['words']}), as `labkit predict` prints it")
    if old is not None:
        so = run_setup(stand_in)
        head += (f"; the last column scales the stand-in run `{stand_in.rsplit('/', 1)[-1]}` ({so['words']}) the "
                 "same way, a stand-in for comparison only")
    return head + ":\n\n" + S.md_table(pd.DataFrame(rows))
