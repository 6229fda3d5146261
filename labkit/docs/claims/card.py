"""The claims card: every system's rows in one list (`card`), the blocks `labkit docs --write` writes from them
(docs/claims.md's rule, card and link-rate table, the README's summary) and the card drawn (`figure`)."""
from __future__ import annotations

from pathlib import Path

import pandas as pd
import plotly.graph_objects as go

from ...report import summary as S
from ...report.units import tokens_label as _ctx
from ...results import REPO
from ..box import run_shape
from .common import PUBLISHED_SHAPE, named_run as _run, ok_metrics as _metrics
from .flash import flash_claims
from .pulse import pulse_claims
from .rule import (COLOURS, CONSTRUCTION, LINK_CHECK_TOLERANCE, OUT_OF_REGIME, TOLERANCE, UNTESTED, VERDICTS, Claim,
                   rule_text)
from .sparse import LINK_PENDING, sparse_claims
from .xfer import xfer_claims


BUILDERS = {"sparse": sparse_claims, "flash": flash_claims, "pulse": pulse_claims, "xfer": xfer_claims}


def card(systems=None) -> list[Claim]:
    """Every row of the card (or those of the named systems: keys of SYSTEMS), in the order of BUILDERS: sparse offload, FlashOffloading, PulseInfer, cross-model transfer."""
    names = list(BUILDERS) if not systems else [s for s in BUILDERS if s in set(systems)]
    unknown = set(systems or ()) - set(BUILDERS)
    if unknown:
        raise ValueError(f"unknown system(s) {', '.join(sorted(unknown))}: choose from {', '.join(BUILDERS)}")
    return [c for s in names for c in BUILDERS[s]()]


# ---- the generated blocks -----------------------------------------------------------------------------------
def _link(run: str, prefix: str) -> str:
    name = run.split("/")[-1]
    target = f"{prefix}{run}/report.html" if (REPO / run / "report.html").is_file() else f"{prefix}{run}"
    return f"[`{name}`]({target})"


def table(claims: list[Claim], prefix: str = "../") -> pd.DataFrame:
    rows = []
    for c in claims:
        pub = c.published
        rows.append({"system": c.system, "published": f"**{pub.text}** — {pub.setup}",
                     "ours in the published terms": (c.terms.text() + f"; {c.terms.what}"
                                                     + (f" (differs: {c.terms.differs})" if c.terms.differs else ""))
                     if c.terms else "not measured yet",
                     "ours against our strongest baseline": (f"{c.strongest.text()}; {c.strongest.what}"
                                                             + (f" (differs: {c.strongest.differs})" if c.strongest.differs else ""))
                     if c.strongest else "–",
                     "cost model, published hardware": f"{c.model.text()}" if c.model else
                     f"{c.construction.text()} ({c.construction.what})" if c.construction else "–",
                     "verdict": f"**{c.verdict.label()}**",
                     "why": c.verdict.reason + _basis(c)
                            + (f". Settled by: {c.settle}" if c.settle and (c.verdict.provisional or c.verdict.verdict
                                                                            in (UNTESTED, OUT_OF_REGIME)) else ""),
                     "runs": ", ".join(_link(r, prefix) for r in c.runs()) or "–"})
    return pd.DataFrame(rows)


def _basis(c: Claim) -> str:
    b = c.verdict.basis
    if b == "none":
        return ""
    if b != "stand-in":
        return f" (from: {b})"
    if c.stand_in is c.strongest:
        return " (from: the stand-in in the column of our strongest baseline)"
    return f" (from: a stand-in, {c.stand_in.text()}; {c.stand_in.what})"


def tallies(claims: list[Claim]) -> str:
    counts = pd.Series([c.verdict.verdict for c in claims], dtype=object).value_counts()
    return (f"{len(claims)} published figures; " + ", ".join(f"{int(counts.get(v, 0))} {v}" for v in VERDICTS)
            + f" ({sum(c.verdict.provisional for c in claims)} of them provisional: decided by a stand-in, a proxy or "
            "a cost model not checked on a second GPU, until the run named in the row is committed).")


def claims_block(claims: list[Claim]) -> str:
    return (tallies(claims) + " The rule: [above](#the-verdict-rule) (`labkit.docs.claims.decide`).\n\n"
            + S.md_table(table(claims)))


def summary_block(claims: list[Claim]) -> str:
    lines = []
    for c in claims:
        b = c.verdict.basis
        ours = (c.verdict.reason if c.verdict.verdict in (CONSTRUCTION, OUT_OF_REGIME, UNTESTED) else
                f"ours {c.terms.text()}" if b == "published terms" else
                f"the cost model's {c.model.text()}" if b.startswith("cost model") else
                f"a stand-in until the run that settles it: {c.stand_in.what}, {c.stand_in.text()}" if b == "stand-in" else
                c.verdict.reason)
        lines.append(f"- {c.system}: {c.published.text} — **{c.verdict.label()}**; {ours}.")
    return ("Each published figure tested in its own terms from committed runs, the verdict by one declared rule "
            "([the claims card](docs/claims.md), [notebook](notebooks/claims.ipynb)). " + tallies(claims) + "\n\n"
            + "\n".join(lines))


def link_rate_block() -> str:
    """The cost model's transfer term at emulated link rates: predicted against measured zero_copy steps, per
    rate (worst and median error over the points), and the 1M points at the PCIe 4.0 rate when committed."""
    lines = ["| run | shape | link (target → measured) | points | measured step (ms) | predicted / measured: median | worst | within 10% |",
             "|---|---|---|---|---|---|---|---|"]
    stand_in = False
    for key in ("link_rate", "link_1m"):
        run = _run(key)
        if not run:
            continue
        d = _metrics(run)
        if "predicted_step_ms" not in d:
            continue
        d = d.dropna(subset=["predicted_step_ms"])
        shape = run_shape(run)
        stand_in = stand_in or shape != PUBLISHED_SHAPE
        who = shape if shape == PUBLISHED_SHAPE else f"stand-in: {shape}"
        for rate, g in d.groupby("link_gbps"):
            err = g["predicted_step_ms"] / g["step_ms_median"] - 1
            meas = g["link_gbps_at_load"] if "link_gbps_at_load" in g else g["link_gbps_measured"]
            pts = ", ".join(f"{int(c)}×{_ctx(x)}/b{int(b)}" for c, x, b in zip(g["concurrency"], g["context_len"], g["budget"]))
            lines.append(f"| [`{Path(run).name}`](../{run}) | {who} | {rate:g} → {meas.min():.1f}–{meas.max():.1f} GB/s | "
                         f"{len(g)} ({pts}) | {g['step_ms_median'].min():.2f}–{g['step_ms_median'].max():.2f} | "
                         f"{err.median():+.1%} | {err.loc[err.abs().idxmax()]:+.1%} | {int((err.abs() <= LINK_CHECK_TOLERANCE).sum())} of {len(g)} |")
    if len(lines) <= 2:
        return "(no link-rate run committed: `link_rate` in docs/runs.toml)"
    return "\n".join(lines) + (f"\n\nThe stand-in's runs check the stand-in's model only; the card's 3× RTX 3090 rows "
                               f"scale the published shape's run, whose link-rate check is {LINK_PENDING}."
                               if stand_in else "")


def blocks() -> dict[str, str]:
    claims = card()
    return {"claims": claims_block(claims), "claims-summary": summary_block(claims), "claims-rule": rule_text(),
            "link-rate": link_rate_block()}


# ---- the card, drawn ----------------------------------------------------------------------------------------
def figure(claims: list[Claim]):
    """Each row's deciding figure over the published one (1 = the published figure), with its spread as error
    bars and the verdict's colour; rows with no figure of ours sit at 1 as open grey markers. Log scale: 0.5× and
    2× are the same distance from the published figure."""
    fig = go.Figure()
    labels = [f"{c.system}: {c.published.text}" for c in claims]
    for v in VERDICTS:
        idx = [i for i, c in enumerate(claims) if c.verdict.verdict == v]
        if not idx:
            continue
        xs, lo, hi, hover, symbols = [], [], [], [], []
        for i in idx:
            c, r = claims[i], claims[i].ratio()
            if r is None:
                xs.append(1.0), lo.append(0.0), hi.append(0.0), symbols.append("circle-open")
                hover.append(f"{c.verdict.label()}: {c.verdict.reason}")
                continue
            xs.append(r.value), lo.append(max(r.value - r.lo, 0.0)), hi.append(max(r.hi - r.value, 0.0))
            symbols.append("diamond" if c.verdict.provisional else "circle")
            hover.append(f"{c.verdict.label()} ({c.verdict.basis}): {c.verdict.reason}")
        fig.add_trace(go.Scatter(
            x=xs, y=[labels[i] for i in idx], mode="markers", name=v,
            marker=dict(color=COLOURS[v], size=12, symbol=symbols, line=dict(width=2, color=COLOURS[v])),
            error_x=dict(type="data", symmetric=False, array=hi, arrayminus=lo, color=COLOURS[v], thickness=2),
            hovertext=hover, hoverinfo="text+x"))
    fig.add_vline(x=1.0, line_dash="dash", line_color="#444")
    fig.add_vrect(x0=1 - TOLERANCE, x1=1 + TOLERANCE, fillcolor="#2ca02c", opacity=0.08, line_width=0)
    fig.update_xaxes(type="log", title="ours / published (1 = the published figure; shaded: ±"
                                       f"{TOLERANCE:.0%}; diamonds: provisional)")
    fig.update_yaxes(autorange="reversed", categoryorder="array", categoryarray=labels)
    fig.update_layout(title="Do the published figures hold?", height=120 + 38 * len(claims), legend_title="verdict",
                      margin=dict(l=20, r=20, t=60, b=60))
    return fig
