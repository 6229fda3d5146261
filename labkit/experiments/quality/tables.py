"""The quality experiment's generated tables (`labkit docs`): perplexity ratio to dense and attention-mass recall
per corpus, policy and budget (docs/quality.md), selected per token or in blocks (docs/pulseinfer.md), and with
the prefix prefilled sparsely too (docs/quality.md); each value with its 95% bootstrap interval over sequences.
Each reads the committed run folder it is given: docs/runs.toml names it, labkit/docs binds each block to its
function and run."""
from __future__ import annotations

import pandas as pd

from ...report.summary import md_table as _md
from ...results import REPO, load_run
from ...stats import Interval, perplexity_ratio


def _quality_interval(g: pd.DataFrame, col: str, digits: int = 3) -> str:
    """One summary row's `value [lo, hi]` (labkit.stats.Interval.text)."""
    r = g.iloc[0]
    return Interval(r[col], r[f"{col}_lo"], r[f"{col}_hi"], int(r[f"{col}_n"])).text(digits)


def _quality_lead(run: str, mf: dict) -> str:
    p = mf["parameters"]
    ctx = p["seq_len"] - p["eval_tokens"]
    return (f"SmolLM2-135M on CPU, run `{run.split('/')[-1]}`: per corpus n = {p['n_sequences']} sequences of "
            f"{p['seq_len']:,} tokens drawn with seed {p['seed']} from the eval split"
            + (" (yaml: non-overlapping windows of its one eval document)" if "yaml" in p["corpora"] else "")
            + f", the last {p['eval_tokens']} decoded sparsely after a {ctx:,}-token dense "
            f"prefill; value [95% bootstrap interval over sequences], perplexity pooled over a corpus's sequences; "
            f"wall {mf['wall_s'] / 60:.0f} min on {mf.get('cpu_count')} shared CPU cores"
            + (f", {mf['torch_threads']} torch thread" + ("s" if mf["torch_threads"] > 1 else "") if "torch_threads" in mf else "")
            + ".")


def quality_table(folder: str) -> str:
    """Perplexity ratio to dense per corpus and policy (single-token selection) at every budget of the run, and
    attention-mass recall at 256, each with its 95% bootstrap interval over the evaluation sequences and n."""
    run = load_run(REPO / folder)
    q = run.table("quality_summary")
    q = q[(q.policy != "dense") & (q.selection == "token")]
    rows = []
    for (corpus, pol), g in q.groupby(["corpus", "policy"], sort=True):
        g = g.set_index("budget")
        row = {"corpus": corpus, "policy": pol}
        for b in sorted(q.budget.unique()):
            row[f"ppl ratio @{b}"] = _quality_interval(g.loc[[b]], "ppl_ratio")
        row["mass recall @256"] = _quality_interval(g.loc[[256]], "mass_recall")
        row["n"] = int(g["ppl_ratio_n"].min())
        rows.append(row)
    return _quality_lead(folder, run.manifest) + "\n\n" + _md(pd.DataFrame(rows))


def quality_blocks_table(folder: str) -> str:
    """Perplexity ratio to dense (pooled over a corpus's sequences) and attention-mass recall per policy,
    selected per token or in whole blocks of 16, at the budgets the run measured blocks at, each with its 95%
    bootstrap interval over the evaluation sequences and n."""
    run = load_run(REPO / folder)
    q = run.table("quality_summary")
    budgets = sorted(q[q.block > 1].budget.unique())
    q = q[q.budget.isin(budgets) & ~q.policy.isin(["dense", "oracle_shared"])]
    rows = []
    for (pol, corpus, block), g in q.groupby(["policy", "corpus", "block"], sort=True):
        g = g.set_index("budget")
        row = {"policy": pol, "selection": g["selection"].iloc[0], "corpus": corpus}
        for b in budgets:
            row[f"ppl ratio @{b}"] = _quality_interval(g.loc[[b]], "ppl_ratio")
            row[f"mass recall @{b}"] = _quality_interval(g.loc[[b]], "mass_recall")
        row["n"] = int(g["ppl_ratio_n"].min())
        rows.append(row)
    return _quality_lead(folder, run.manifest) + "\n\n" + _md(pd.DataFrame(rows))


def quality_sparse_prefill_table(folder: str) -> str:
    """Per corpus, policy and budget: the perplexity ratio to dense with the prefix prefilled densely and with it
    prefilled under the same selection, what sparse prefill adds (the sparse-prefill perplexity over the
    dense-prefill one, paired per sequence), and the prefix rows' attention-mass recall and recall@budget against
    the shared oracle; each with its 95% bootstrap interval over the evaluation sequences and n."""

    run = load_run(REPO / folder)
    mf, q, m = run.manifest, run.table("quality_summary"), run.metrics
    p = mf["parameters"]
    q = q[(q.policy != "dense") & (q.selection == "token")].set_index(["corpus", "policy", "budget", "protocol"])
    m = m[(m.status == "ok") & (m.policy != "dense")]
    rows = []
    for (corpus, pol, b), g in m.groupby(["corpus", "policy", "budget"], sort=True):
        pair = g.pivot_table(index=["document", "start"], columns="protocol", values=["nll_sum", "n_tokens"])
        added = perplexity_ratio(pair["nll_sum"]["sparse_prefill"], pair["nll_sum"]["dense_prefill"],
                                 pair["n_tokens"]["sparse_prefill"])
        sp = q.loc[[(corpus, pol, b, "sparse_prefill")]]
        rows.append({"corpus": corpus, "policy": pol, "budget": int(b),
                     "ppl ratio, dense prefill": _quality_interval(q.loc[[(corpus, pol, b, "dense_prefill")]], "ppl_ratio"),
                     "ppl ratio, sparse prefill": _quality_interval(sp, "ppl_ratio"),
                     "sparse / dense prefill": added.text(3),
                     "prefill mass recall": _quality_interval(sp, "prefill_mass_recall"),
                     "prefill recall@budget": _quality_interval(sp, "prefill_oracle_overlap"),
                     "n": int(sp["ppl_ratio_n"].min())})
    ctx = p["seq_len"] - p["eval_tokens"]
    lead = (f"SmolLM2-135M on CPU, run `{folder.split('/')[-1]}`: per corpus n = "
            f"{p['n_sequences']} sequences of {p['seq_len']:,} tokens drawn with seed {p['seed']} from the eval split; "
            f"the {ctx:,}-token prefix prefilled densely (dense prefill) or with every row attending to its top-budget "
            f"causal past chosen by the policy (sparse prefill), then the last {p['eval_tokens']} decoded sparsely; "
            f"both against the same dense prefill + dense decode. Prefill recalls are over the prefix rows with more "
            f"past than the budget (recall@budget: the selection's overlap with the shared oracle's). Value [95% "
            f"bootstrap interval over sequences]; wall {mf['wall_s'] / 60:.0f} min on {mf.get('cpu_count')} shared "
            f"CPU cores, {mf.get('torch_threads', 1)} torch thread.")
    return lead + "\n\n" + _md(pd.DataFrame(rows))
