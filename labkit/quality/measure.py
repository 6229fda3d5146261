"""What a top-k budget costs in quality: perplexity, attention-mass recall, indexer recall, head map.

Protocol ("dense prefill, sparse decode", as an offloading engine runs): each evaluation sequence of
`seq_len` tokens is split into a prefix of `seq_len - eval_tokens` tokens, prefilled once with dense
attention into a KV cache, and the last `eval_tokens` tokens, which are decoded teacher-forced with
the policy under test (every one of those query rows attends to at most `budget` positions of its
causal past, prefix included; their own KV comes from the sparse pass, as in real decode). The
perplexity is over the `eval_tokens - 1` next-token predictions inside the decoded block. The dense
reference is the same block decoded with full attention, so `ppl_ratio = ppl / ppl_dense` isolates
what selection costs. A budget >= the context is exactly dense (a test checks it).

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

DEFAULT_BUDGETS = (64, 128, 256, 512, 1024, 2048)
DEFAULT_POLICIES = ("oracle", "oracle_shared", "indexer", "retrieval_head")


def validate(corpora, budgets, policies, seq_len: int, n_sequences: int, eval_tokens: int) -> None:
    """Raise ValueError (one line) on bad parameters, before anything is loaded."""
    from labkit.quality.corpora import CORPORA

    bad = [c for c in corpora if c not in CORPORA]
    if bad:
        raise ValueError(f"unknown corpus {bad[0]!r}: choose from {', '.join(CORPORA)}")
    bad = [p for p in policies if p not in POLICIES]
    if bad:
        raise ValueError(f"unknown policy {bad[0]!r}: choose from {', '.join(POLICIES)}")
    for b in budgets:
        if not (isinstance(b, int) and b >= 1) and b != "full":
            raise ValueError(f"budgets must be positive integers or 'full', got {b!r}")
    if not 2 <= eval_tokens <= seq_len:
        raise ValueError(f"eval_tokens must be in [2, seq_len={seq_len}], got {eval_tokens}")
    if n_sequences < 1:
        raise ValueError(f"n_sequences must be >= 1, got {n_sequences}")
    if seq_len > 8192:
        raise ValueError(f"seq_len {seq_len} exceeds SmolLM2's 8192-token context")


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
def prefill(model, ids: torch.Tensor, eval_tokens: int):
    """Dense KV cache of the prefix of `ids` (1-D) and the decode block's ids [1, eval_tokens]."""
    ctl = instrument(model)
    saved = ctl.layers
    ctl.layers = {}
    try:
        ids = ids.view(1, -1).to(_device(model))
        n_pre = ids.shape[1] - eval_tokens
        cache = None
        if n_pre > 0:
            cache = forward(model, ids[:, :n_pre])[1]
    finally:
        ctl.layers = saved
    return cache, ids[:, n_pre:]


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


def quality_sweep(model, tokenizer, corpora=("code", "prose"), budgets=DEFAULT_BUDGETS, policies=DEFAULT_POLICIES,
                  seq_len: int = 4096, n_sequences: int = 2, eval_tokens: int = 512, controller=None,
                  on_record=None, log=print) -> pd.DataFrame:
    """Rows per (corpus, sequence, policy, budget), plus one `dense` row per sequence.

    `controller` must carry the indexer / retrieval heads the policies need (see `prepare_policies`).
    `on_record(row)` is called after every point (e.g. `run.add`), so a crash loses nothing measured.
    A point that raises becomes a row with status='failed' and its error; the sweep goes on.
    """
    from labkit.quality.corpora import sequences

    budgets = [b for b in budgets if b != "full"]
    validate(corpora, budgets, policies, seq_len, n_sequences, eval_tokens)
    ctl = instrument(model, controller)
    rows = []
    for corpus in corpora:
        for name, ids in sequences(tokenizer, corpus, seq_len, n_sequences, split="eval"):
            cache, block = prefill(model, ids, eval_tokens)
            dense = measure_point(model, ctl, cache, block, None, None)
            base = {"experiment": "quality", "corpus": corpus, "document": name, "seq_len": seq_len,
                    "eval_tokens": eval_tokens, "context_len": seq_len}
            pts = [("dense", None)] + [(p, b) for p in policies for b in budgets]
            for policy, budget in pts:
                row = dict(base, policy=policy, budget=budget if budget is not None else seq_len,
                           budget_label="full" if budget is None else str(budget))
                try:
                    r = dense if policy == "dense" else measure_point(model, ctl, cache, block, policy, budget)
                    row.update(r, status="ok", error=None, ppl_dense=dense["ppl"],
                               ppl_ratio=r["ppl"] / dense["ppl"])
                except Exception as e:  # a failed point is recorded, the sweep goes on
                    row.update(status="failed", error=f"{type(e).__name__}: {e}")
                rows.append(row)
                if on_record:
                    on_record(row)
                if log:
                    log(f"{corpus}/{name} {policy}@{row['budget_label']}: ppl {row.get('ppl', float('nan')):.3f} "
                        f"ratio {row.get('ppl_ratio', float('nan')):.4f} recall {row.get('mass_recall', float('nan')):.3f} "
                        f"({row.get('seconds', 0):.1f}s)")
            del cache
    return pd.DataFrame(rows)


def summarize(df: pd.DataFrame) -> pd.DataFrame:
    """Per (corpus, policy, budget): token-weighted perplexity, its ratio to dense, mean recalls."""
    ok = df[df["status"] == "ok"]
    g = ok.groupby(["corpus", "policy", "budget", "budget_label"], as_index=False).agg(
        nll_sum=("nll_sum", "sum"), n_tokens=("n_tokens", "sum"), mass_recall=("mass_recall", "mean"),
        oracle_overlap=("oracle_overlap", "mean"), n_sequences=("document", "nunique"))
    g["ppl"] = (g["nll_sum"] / g["n_tokens"]).map(math.exp)
    dense = g[g["policy"] == "dense"].set_index("corpus")["ppl"]
    g["ppl_ratio"] = g["ppl"] / g["corpus"].map(dense)
    return g.sort_values(["corpus", "policy", "budget"]).reset_index(drop=True)


@torch.no_grad()
def head_share_map(model, tokenizer, corpora=("code", "prose"), seq_len: int = 4096, n_sequences: int = 1,
                   eval_tokens: int = 512, split: str = "eval", sink_window: int = 16,
                   recent_window: int = 64) -> pd.DataFrame:
    """Mid-context attention share per (corpus, layer, head), averaged over the decoded block's rows.

    share = dense attention mass on positions [sink_window, t - recent_window] for query position t.
    """
    from labkit.quality.corpora import sequences

    ctl = instrument(model)
    rows = []
    for corpus in corpora:
        acc = None
        for name, ids in sequences(tokenizer, corpus, seq_len, n_sequences, split=split):
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
        acc = acc / n_sequences
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
    from labkit.quality.corpora import sequences
    from labkit.quality.indexer import calibrate

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
