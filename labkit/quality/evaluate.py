"""What a top-k budget costs in quality: perplexity, attention-mass recall, indexer recall, head map.

Protocol ("dense prefill, sparse decode", as an offloading engine runs): each evaluation sequence of
`seq_len` tokens is split into a prefix of `seq_len - eval_tokens` tokens, prefilled once with dense
attention into a KV cache, and the last `eval_tokens` tokens, which are decoded teacher-forced with
the policy under test (every one of those query rows attends to at most `budget` positions of its
causal past, prefix included; their own KV comes from the sparse pass, as in real decode). The
perplexity is over the `eval_tokens - 1` next-token predictions inside the decoded block. The dense
reference is the same block decoded with full attention, so `ppl_ratio = ppl / ppl_dense` isolates
what selection costs. A budget >= the context is exactly dense (a test checks it).

Second protocol ("sparse prefill, sparse decode", `protocol=sparse_prefill`), what an engine that also
prefills sparsely computes: the prefix is prefilled with the same policy, budget and granularity active
(every prefix query row attends to at most `budget` positions of its causal past, chosen by the policy,
e.g. the indexer), then the decode block is decoded as above on top of that cache. Its dense reference is
the same dense-prefill, dense-decode block, so its `ppl_ratio` against `dense_prefill`'s at the same budget
shows what sparse prefill adds on top of sparse decode. The reference row is tagged `dense_prefill` (that is
what it is); a budget >= the context makes sparse prefill exactly dense prefill (a test checks it).

Uncertainty: every row keeps its sequence's summed NLL under the policy and under dense, so `summarize`
pools them per (corpus, policy, block, budget) into a perplexity ratio with a 95% bootstrap interval over
sequences (`labkit.stats.perplexity_ratio`: sequences, not tokens, are the independent units), and
recalls with `labkit.stats.bootstrap` over sequences.

Each function returns tidy pandas rows (one per sequence x policy x budget) or a DataFrame; the
notebook and `labkit run quality` put them into a run folder.
"""

from __future__ import annotations

import copy
import inspect
import math
import time

import pandas as pd
import torch

from labkit.quality.sparse import POLICIES, SparseController, instrument, n_layers
from labkit import sweep
from labkit.quality.corpora import CORPORA, draw_sequences, sequences
from labkit.quality.indexer import calibrate
from labkit.stats import bootstrap, perplexity_ratio

DEFAULT_BUDGETS = (64, 128, 256, 512, 1024, 2048)
DEFAULT_POLICIES = ("oracle", "oracle_shared", "indexer", "retrieval_head")
PROTOCOLS = ("dense_prefill", "sparse_prefill")


def validate(corpora, budgets, policies, seq_len: int, n_sequences: int, eval_tokens: int, seed: int = 0,
             block_variants=(), block_budgets=(), protocols=("dense_prefill",)) -> None:
    """Raise ValueError (one line) on bad parameters, before anything is loaded."""
    if not protocols:
        raise ValueError(f"protocol is empty: choose from {', '.join(PROTOCOLS)}")
    bad = [p for p in protocols if p not in PROTOCOLS]
    if bad:
        raise ValueError(f"unknown protocol {bad[0]!r}: choose from {', '.join(PROTOCOLS)}")

    if not corpora:
        raise ValueError(f"corpora is empty: choose from {', '.join(CORPORA)}")
    bad = [c for c in corpora if c not in CORPORA]
    if bad:
        raise ValueError(f"unknown corpus {bad[0]!r}: choose from {', '.join(CORPORA)}")
    bad = [p for p in policies if p not in POLICIES]
    if bad:
        raise ValueError(f"unknown policy {bad[0]!r}: choose from {', '.join(POLICIES)}")
    for b in list(budgets) + list(block_budgets):
        if not (isinstance(b, int) and b >= 1) and b != "full":
            raise ValueError(f"budgets must be positive integers or 'full', got {b!r}")
    if not 2 <= eval_tokens <= seq_len:
        raise ValueError(f"eval_tokens must be in [2, seq_len={seq_len}], got {eval_tokens}")
    if n_sequences < 2:  # an interval over sequences needs two of them
        raise ValueError(f"n_sequences must be >= 2 (intervals are over sequences), got {n_sequences}")
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    if seq_len > 8192:
        raise ValueError(f"seq_len {seq_len} exceeds SmolLM2's 8192-token context")
    for v in block_variants:
        if v < 2 or any(b % v for b in block_budgets):
            raise ValueError(f"block_variants must be >= 2 and divide every block budget, got {v}")


def _device(model) -> torch.device:
    return next(model.parameters()).device


def forward(model, ids: torch.Tensor, cache=None, use_cache: bool = True):
    """(logits, cache) of one forward; passes the KV cache under the name this transformers uses
    (`cache` from 5.2x, `past_key_values` before)."""
    kw = {}
    if cache is not None:
        name = "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"
        kw[name] = cache
    out = model(input_ids=ids, use_cache=use_cache, **kw)
    new = out.get("cache", None) if "cache" in out else out.get("past_key_values", None)
    return out.logits, new


@torch.no_grad()
def prefill(model, ids: torch.Tensor, eval_tokens: int, policy: str | None = None, budget: int | None = None):
    """KV cache of the prefix of `ids` (1-D) and the decode block's ids [1, eval_tokens].

    Without a policy the prefix is prefilled densely (the controller's layers switched off for the pass).
    With one (`sparse_prefill`), every prefix row attends to at most `budget` positions of its causal past,
    chosen by `policy` at the controller's granularity; the prefix rows' statistics are then the controller's
    (`prefill_stats`) until the next `reset_stats`. The controller is dense again afterwards either way."""
    ctl = instrument(model)
    saved = ctl.layers
    ctl.layers = {}
    try:
        ids = ids.view(1, -1).to(_device(model))
        n_pre = ids.shape[1] - eval_tokens
        cache = None
        if policy is not None and policy != "dense":
            ctl.set_all(policy, budget, n_layers(model))
            ctl.reset_stats()
        if n_pre > 0:
            cache = forward(model, ids[:, :n_pre])[1]
    finally:
        ctl.layers = saved
    return cache, ids[:, n_pre:]


def prefill_stats(ctl: SparseController) -> dict:
    """Mass recall and recall@budget against oracle_shared over the sparsified prefix rows of the last
    sparse prefill (NaN where no prefix row had more past than the budget)."""
    return {"prefill_mass_recall": ctl.mass_recall(), "prefill_oracle_overlap": ctl.oracle_overlap()}


@torch.no_grad()
def decode_block_nll(model, cache, block: torch.Tensor) -> tuple[float, int]:
    """Summed next-token NLL inside `block` [1, E] decoded on top of (a copy of) `cache`."""
    logits = forward(model, block, copy.deepcopy(cache), use_cache=cache is not None)[0].float()
    nll = torch.nn.functional.cross_entropy(logits[0, :-1], block[0, 1:], reduction="sum")
    return float(nll), block.shape[1] - 1


def measure_point(model, ctl: SparseController, cache, block, policy: str | None, budget: int | None) -> dict:
    """One (policy, budget) on one prefilled sequence: nll, tokens, recalls, seconds."""
    ctl.set_all(policy, budget, n_layers(model))
    ctl.reset_stats()
    t0 = time.perf_counter()
    nll, n = decode_block_nll(model, cache, block)
    dt = time.perf_counter() - t0
    rec = {
        "nll_sum": nll,
        "n_tokens": n,
        "ppl": math.exp(nll / n),
        "mass_recall": ctl.mass_recall() if policy not in (None, "dense") else 1.0,
        "oracle_overlap": ctl.oracle_overlap() if policy not in (None, "dense") else 1.0,
        "seconds": dt,
    }
    ctl.set_all(None, None, n_layers(model))
    return rec


def selection_label(block: int) -> str:
    return "token" if block == 1 else f"block {block}"


def sweep_points(policies, budgets, block: int = 1, block_variants=(), block_budgets=(),
                 protocols=("dense_prefill",)) -> list[tuple]:
    """(protocol, policy, budget, block) measured on every sequence: the dense reference first (dense prefill,
    dense decode), then per protocol every policy at every budget with `block`, then every policy at
    `block_budgets` with each other granularity of `block_variants`."""
    pts = [(p, b, block) for p in policies for b in budgets if b != "full"]
    pts += [(p, b, v) for v in block_variants if v != block for p in policies for b in block_budgets]
    return [("dense_prefill", "dense", None, 1)] + [(pr, *pt) for pr in protocols for pt in pts]


def quality_sweep(model, tokenizer, corpora=("code", "prose"), budgets=DEFAULT_BUDGETS, policies=DEFAULT_POLICIES,
                  seq_len: int = 4096, n_sequences: int = 16, eval_tokens: int = 512, controller=None,
                  on_record=None, log=print, seed: int = 0, block: int | None = None, block_variants=(),
                  block_budgets=(), units: dict | None = None, progress_bar: bool = False,
                  protocols=("dense_prefill",)) -> pd.DataFrame:
    """Rows per (corpus, sequence, protocol, policy, budget, block), plus one `dense` row per sequence.

    Sequences: `units[corpus]` (lists of `corpora.Unit`) when given, else `n_sequences` per corpus drawn with
    `seed` from the eval split (`corpora.draw_sequences`). Every row carries the sequence's summed NLL
    (`nll_sum`) and its dense one (`nll_dense`), so intervals can be taken over sequences (`summarize`).
    `protocols`: `dense_prefill` decodes every point on the sequence's one dense prefix cache;
    `sparse_prefill` prefills the prefix again per point with its policy, budget and granularity active
    (rows add `prefill_mass_recall`, `prefill_oracle_overlap`, `prefill_seconds`).
    `controller` must carry the indexer / retrieval heads the policies need (see `prepare_policies`);
    `block` (default: the controller's) is the granularity of the main sweep.
    `on_record(row)` is called after every point (e.g. `run.add`), so a crash loses nothing measured.
    A point that raises becomes a row with status='failed' and its error; the sweep goes on.
    """
    budgets = [b for b in budgets if b != "full"]
    validate(corpora, budgets, policies, seq_len, n_sequences, eval_tokens, seed, block_variants, block_budgets,
             protocols)
    ctl = instrument(model, controller)
    block = ctl.block if block is None else block
    if units is None:
        units = {c: draw_sequences(tokenizer, c, seq_len, n_sequences, seed) for c in corpora}
    pts = sweep_points(policies, budgets, block, block_variants, block_budgets, protocols)
    bar = sweep.bar(sum(len(units[c]) for c in corpora) * len(pts), "quality points", progress_bar)
    rows = []
    try:
        for corpus in corpora:
            for i, u in enumerate(units[corpus]):
                t0 = time.perf_counter()
                cache, blk = prefill(model, u.ids, eval_tokens)
                ctl.block = 1
                dense = measure_point(model, ctl, cache, blk, None, None)
                base = {"experiment": "quality", "corpus": corpus, "document": u.document, "start": u.start,
                        "unit": u.unit, "seq_len": seq_len, "eval_tokens": eval_tokens, "context_len": seq_len}
                for protocol, policy, budget, gran in pts:
                    row = dict(base, protocol=protocol, policy=policy,
                               budget=budget if budget is not None else seq_len,
                               budget_label="full" if budget is None else str(budget), block=gran,
                               selection="dense" if policy == "dense" else selection_label(gran))
                    try:
                        ctl.block = gran
                        r = dense if policy == "dense" else \
                            _point(model, ctl, u, cache, blk, eval_tokens, protocol, policy, budget)
                        row.update(r, status="ok", error=None, ppl_dense=dense["ppl"], nll_dense=dense["nll_sum"],
                                   ppl_ratio=r["ppl"] / dense["ppl"])
                    except Exception as e:  # a failed point is recorded, the sweep goes on
                        row.update(sweep.failed_row(e))
                    finally:
                        ctl.block = block
                        ctl.set_all(None, None, n_layers(model))
                    rows.append(row)
                    if on_record:
                        on_record(row)
                    bar.update(1)
                    bar.set_postfix_str(f"{corpus} {i + 1}/{len(units[corpus])} {policy}@{row['budget_label']}"
                                        f"/{row['selection']}/{protocol}", refresh=False)
                del cache
                if log:
                    mine = [r for r in rows[-len(pts):] if r["status"] == "ok" and r["policy"] != "dense"]
                    worst = max(mine, key=lambda r: r["ppl_ratio"], default=None)
                    log(f"{corpus} {i + 1}/{len(units[corpus])} {u.label}: dense ppl {dense['ppl']:.3f}, "
                        f"{len(pts)} points in {time.perf_counter() - t0:.0f}s"
                        + (f", highest ratio {worst['ppl_ratio']:.3f} ({worst['policy']}@{worst['budget_label']}, "
                           f"{worst['selection']}, {worst['protocol']})" if worst else "")
                        + f", {sum(r['status'] != 'ok' for r in rows[-len(pts):])} failed")
    finally:
        bar.close()
    return pd.DataFrame(rows)


def _point(model, ctl, u, cache, blk, eval_tokens: int, protocol: str, policy: str, budget: int) -> dict:
    """One (protocol, policy, budget) on one sequence: on the shared dense prefix cache, or on this point's own
    prefix cache prefilled under its selection (`sparse_prefill`, with what that prefill kept)."""
    if protocol == "dense_prefill":
        return measure_point(model, ctl, cache, blk, policy, budget)
    tp = time.perf_counter()
    sparse_cache, _ = prefill(model, u.ids, eval_tokens, policy, budget)
    pre = dict(prefill_stats(ctl), prefill_seconds=time.perf_counter() - tp)
    r = dict(measure_point(model, ctl, sparse_cache, blk, policy, budget), **pre)
    del sparse_cache
    return r


PREFILL_STATS = ("prefill_mass_recall", "prefill_oracle_overlap")
SUMMARY_KEYS = ["corpus", "protocol", "policy", "block", "selection", "budget", "budget_label"]


def summarize(df: pd.DataFrame) -> pd.DataFrame:
    """Per (corpus, protocol, policy, block, budget): the pooled perplexity and its ratio to dense with a 95%
    bootstrap interval over sequences (`stats.perplexity_ratio`, sequences paired with their own dense decode),
    mean attention-mass recall and recall@budget against `oracle_shared` with bootstrap intervals over sequences
    (`stats.bootstrap`), and the same two over the prefix rows where sparse prefill ran (`prefill_*`). Interval
    columns: `x`, `x_lo`, `x_hi`, `x_n` (`Interval.as_dict`). Frames without `protocol` are `dense_prefill`."""
    ok = df[df["status"] == "ok"].copy()
    # frames from before block variants / windows / the sparse-prefill protocol
    for col, default in (("block", 1), ("start", 0), ("protocol", "dense_prefill")):
        if col not in ok.columns:
            ok[col] = default
    ok["protocol"] = ok["protocol"].fillna("dense_prefill")
    if "selection" not in ok.columns:
        ok["selection"] = ["dense" if p == "dense" else selection_label(b) for p, b in zip(ok["policy"], ok["block"])]
    unit = ["corpus", "document", "start"]
    dense = ok[ok["policy"] == "dense"].drop_duplicates(unit).set_index(unit)["nll_sum"].rename("nll_base")
    rows = []
    for key, g in ok.groupby(SUMMARY_KEYS, sort=True, dropna=False):
        g = g.join(dense, on=unit).dropna(subset=["nll_base"])
        if g.empty:
            continue
        r = dict(zip(SUMMARY_KEYS, key))
        r.update(nll_sum=float(g["nll_sum"].sum()), n_tokens=int(g["n_tokens"].sum()), n_sequences=len(g))
        r["ppl"] = math.exp(r["nll_sum"] / r["n_tokens"])
        r.update(perplexity_ratio(g["nll_sum"], g["nll_base"], g["n_tokens"]).as_dict("ppl_ratio"))
        for m in ("mass_recall", "oracle_overlap") + tuple(m for m in PREFILL_STATS if m in g.columns):
            v = g[m].dropna()
            r.update(bootstrap(v).as_dict(m) if len(v) else {m: math.nan, f"{m}_lo": math.nan,
                                                               f"{m}_hi": math.nan, f"{m}_n": 0})
        rows.append(r)
    return pd.DataFrame(rows).sort_values(["corpus", "protocol", "policy", "block", "budget"]).reset_index(drop=True)


@torch.no_grad()
def head_share_map(model, tokenizer, corpora=("code", "prose"), seq_len: int = 4096, n_sequences: int = 1,
                   eval_tokens: int = 512, split: str = "eval", sink_window: int = 16,
                   recent_window: int = 64) -> pd.DataFrame:
    """Mid-context attention share per (corpus, layer, head), averaged over the decoded block's rows.

    share = dense attention mass on positions [sink_window, t - recent_window] for query position t.
    """
    ctl = instrument(model)
    rows = []
    for corpus in corpora:
        acc, seen = None, 0
        for name, ids in sequences(tokenizer, corpus, seq_len, n_sequences, split=split):
            seen += 1
            cache, block = prefill(model, ids, eval_tokens)
            ctl.layers, ctl.collect_head_share = {}, True
            ctl.sink_window, ctl.recent_window = sink_window, recent_window
            ctl.reset_stats()
            try:
                decode_block_nll(model, cache, block)
            finally:
                ctl.collect_head_share = False
            m = ctl.head_share()
            acc = m if acc is None else acc + m
        acc = acc / seen
        for layer in range(acc.shape[0]):
            for head in range(acc.shape[1]):
                rows.append({"corpus": corpus, "split": split, "layer": layer, "head": head,
                             "mid_share": float(acc[layer, head])})
    return pd.DataFrame(rows)


def choose_retrieval_heads(share: pd.DataFrame) -> dict[int, int]:
    """Per layer the query head with the largest mid-context share (averaged over corpora)."""
    m = share.groupby(["layer", "head"], as_index=False)["mid_share"].mean()
    best = m.loc[m.groupby("layer")["mid_share"].idxmax()]
    return {int(r.layer): int(r.head) for r in best.itertuples()}


def prepare_policies(model, tokenizer, policies, corpora=("code", "prose"), seq_len: int = 4096,
                     calib_sequences: int = 2, eval_tokens: int = 512, sink_window: int = 16,
                     recent_window: int = 64, log=print):
    """A controller with what the policies need, fitted on the *calibration* split only.

    Returns (controller, calibration head map DataFrame or None).
    """
    ctl = SparseController(sink_window=sink_window, recent_window=recent_window)
    share = None
    if "indexer" in policies:
        seqs = [ids for c in corpora for _, ids in sequences(tokenizer, c, seq_len, calib_sequences, "calibration")]
        t0 = time.perf_counter()
        ctl.indexer = calibrate(model, seqs)
        if log:
            log(f"indexer calibrated on {len(seqs)} x {seq_len} calibration tokens in {time.perf_counter() - t0:.1f}s")
    if "retrieval_head" in policies:
        share = head_share_map(model, tokenizer, corpora, seq_len, calib_sequences, eval_tokens, "calibration",
                               sink_window, recent_window)
        ctl.retrieval_heads = choose_retrieval_heads(share)
    instrument(model, ctl)
    return ctl, share
