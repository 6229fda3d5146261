"""The cost model's arithmetic: a run whose phases follow `fixed + bytes / bandwidth` exactly is predicted
exactly at its other points, a GPU with half the memory bandwidth doubles exactly the memory-bound
part, memory limits are checked, and bad input is one line. The metrics frame is built from the model's
own byte formulas (a real sweep on this CPU has no GPU spec to scale from): it tests the algebra, the
H200 run tests the physics (README, `labkit predict`)."""
import dataclasses
from pathlib import Path

import pandas as pd
import pytest

from labkit import costmodel as C
from labkit.cli import main
from labkit.shapes import PRESETS

SHAPE = PRESETS["qwen3.8-flash-next-standin"]
H200 = C.gpu("h200")
FIXED = {"weights": 0.3, "deltanet": 1.0, "index_score": 0.05, "selection": 0.2, "transfer": 0.02,
         "attention": 0.1, "experts": 0.5, "hc": 0.2, "ngram": 0.01, "head": 0.01, "other": 0.4}
REF = PRESETS["qwen3.8-flash-next"]
HBM, LINK = 3000.0, 50.0


def _run(shape=SHAPE, weights="bf16"):
    rows = [{"experiment": "probe", "status": "ok", "strategy": "hbm_read", "gbps": HBM},
            {"experiment": "probe", "status": "ok", "strategy": "zero_copy", "gbps": LINK}]
    for strategy in ("resident", "zero_copy"):
        for c in (1, 4):
            for ctx in (8192, 65536, 1 << 20):
                by = C.phase_bytes(shape, strategy, ctx, c, 2048, weights)
                link = {"ngram"} | ({"transfer"} if strategy != "resident" else set())
                an = {ph: FIXED[ph] + by[ph] / ((LINK if ph in link else HBM) * 1e6) for ph in C.PHASES}
                rows.append({"experiment": "decode", "status": "ok", "axis": "context", "strategy": strategy,
                             "context_len": ctx, "concurrency": c, "budget": 2048, "step_ms_median": sum(an.values()),
                             "weights_dtype": weights,
                             **{f"anat_{k}_ms": v for k, v in an.items()}})
    return pd.DataFrame(rows)


@pytest.mark.parametrize("shape,weights", [(SHAPE, "bf16"), (REF, "bf16"), (REF, "w4a16")])
def test_validation_is_exact_when_the_run_follows_the_model(shape, weights):
    err = C.validate(_run(shape, weights), shape, H200)
    assert len(err) == 12 and err["error"].abs().max() < 1e-9


def test_routed_expert_bytes_grow_with_the_distinct_experts():
    one, four = (C.phase_bytes(REF, "zero_copy", 1 << 20, c, 2048, "w4a16") for c in (1, 4))
    routed = REF.step_weight_bytes(1, "w4a16")["experts"]
    assert four["experts"] - one["experts"] == pytest.approx(routed * (REF.expected_experts(4) / 10 - 1))
    assert four["ngram"] == 4 * one["ngram"] == 4 * 8 * 320 * 2
    assert one["hc"] == REF.step_weight_bytes(1)["hc"]


def test_half_bandwidth_doubles_only_the_memory_bound_part():
    m = _run()
    cm = C.CostModel.fit(m, SHAPE, "resident", 65536, 1, H200)
    slow = dataclasses.replace(H200, key="half", hbm_gbps=H200.hbm_gbps / 2)
    a, b = cm.predict(H200, 1 << 20, 1, 2048), cm.predict(slow, 1 << 20, 1, 2048)
    by = C.phase_bytes(SHAPE, "resident", 1 << 20, 1, 2048)
    for ph in C.PHASES:
        assert b.phases_ms[ph] - a.phases_ms[ph] == pytest.approx(by[ph] / (HBM * 1e6), rel=1e-9, abs=1e-12)


def test_link_phase_scales_with_the_link_and_memory_is_checked():
    m = _run()
    cm = C.CostModel.fit(m, SHAPE, "zero_copy", 65536, 1, H200)
    p = cm.predict(C.gpu("rtx3090"), 1 << 20, 1, 2048, n_gpus=3)
    rows = 12 * 2048 * SHAPE.row_bytes
    assert p.phases_ms["transfer"] == pytest.approx(FIXED["transfer"] + rows / (LINK * 31.5 / 63.0 * 1e6))
    assert p.fits                                   # 7.7 GB of weights / 3 + index keys fit a 24 GB card
    r = C.CostModel.fit(m, SHAPE, "resident", 65536, 1, H200).predict(C.gpu("rtx3090"), 1 << 20, 4, 2048, n_gpus=3)
    assert not r.fits and "does not fit" in " ".join(r.reasoning)    # 96 GiB of KV on three 24 GB cards


def test_fit_needs_an_anatomy_and_cli_refuses_bad_input(tmp_path, capsys):
    with pytest.raises(ValueError, match="no measured anatomy"):
        C.CostModel.fit(_run().drop(columns=["anat_weights_ms"]), SHAPE, "resident", 65536, 1, H200)
    assert main(["predict", str(tmp_path), "--gpu", "tpu9"]) == 2
    assert "unknown GPU 'tpu9'" in capsys.readouterr().err


@pytest.mark.parametrize("name,key", [("NVIDIA H200", "h200"), ("NVIDIA GeForce RTX 3090", "rtx3090"), ("H200", "h200"),
                                      ("", None), (None, None), ("None", None), ("nan", None), ("cpu", None),
                                      ("NVIDIA", None), ("NVIDIA GeForce", None)])
def test_gpu_for_name_never_matches_an_empty_or_vendor_only_name(name, key):
    """A CPU run has no GPU name: nothing may match it (an empty string is part of every name)."""
    g = C.gpu_for_name(name)
    assert (g.key if g else None) == key


def test_predict_says_does_not_fit_instead_of_nan(capsys):
    """The docs' tables say "does not fit" where a point's memory exceeds the GPU: the command says so too."""
    run = Path(__file__).resolve().parent.parent / "results" / "20261129-153810-decode-h200"
    if not run.is_dir():
        pytest.skip("the H200 run folder is not in this checkout")
    assert main(["predict", str(run), "--gpu", "rtx3090", "--gpus", "1"]) == 0
    table = capsys.readouterr().out.split("why (largest context")[0]
    assert "does not fit" in table and "nan" not in table.lower()


def test_tensor_parallel_shards_the_weights_and_adds_two_all_reduces_a_layer():
    m = _run(REF, "w4a16")
    cm = C.CostModel.fit(m, REF, "zero_copy", 65536, 1, H200)
    one = cm.predict(C.gpu("rtx3090"), 1 << 20, 1, 2048)
    four = cm.predict(C.gpu("rtx3090"), 1 << 20, 1, 2048, n_gpus=4, split="tensor", allreduce_us=20.0)
    by = C.phase_bytes(REF, "zero_copy", 1 << 20, 1, 2048, "w4a16")
    scale = C.gpu("rtx3090").hbm_gbps / H200.hbm_gbps
    for ph in ("weights", "experts", "deltanet", "hc"):
        saved = one.phases_ms[ph] - four.phases_ms[ph]
        assert saved == pytest.approx(by[ph] * 3 / 4 / (HBM * scale * 1e6), rel=1e-9)
    # two KV heads: four cards read half the rows each, the index scores are every card's
    assert four.phases_ms["index_score"] == pytest.approx(one.phases_ms["index_score"])
    ar = C.allreduce_ms(4, 2560 * 2, C.gpu("rtx3090").link_gbps, 20.0)
    assert four.phases_ms["allreduce"] == pytest.approx(2 * 48 * ar) and ar > 0.02
    # the layers split: the same sum plus hand-offs
    three = cm.predict(C.gpu("rtx3090"), 1 << 20, 1, 2048, n_gpus=3)
    assert three.step_ms == pytest.approx(one.step_ms + 2 * C.HANDOFF_MS)


def test_calibrations_replace_the_datasheet_ratios(tmp_path):
    cm = C.CostModel.fit(_run(), SHAPE, "zero_copy", 65536, 1, H200)
    src = C.Calibration("NVIDIA H200", 4000.0, 50.0)
    path = tmp_path / "cal.json"
    path.write_text('{"gpu_name": "NVIDIA H100", "hbm_read_gbps": 2000.0, "link_gbps": 25.0}')
    tgt = C.Calibration.load(path)
    p = cm.predict(C.gpu("h100"), 1 << 20, 1, 2048, calibration=tgt, source_calibration=src)
    by = C.phase_bytes(SHAPE, "zero_copy", 1 << 20, 1, 2048)
    assert p.phases_ms["weights"] == pytest.approx(FIXED["weights"] + by["weights"] / (HBM / 2 * 1e6))
    assert p.phases_ms["transfer"] == pytest.approx(FIXED["transfer"] + by["transfer"] / (LINK / 2 * 1e6))
    with pytest.raises(ValueError, match="missing"):
        path.write_text('{"gpu_name": "x"}')
        C.Calibration.load(path)


def test_cross_check_is_exact_between_runs_that_follow_the_model():
    """Two synthetic runs of one model on GPUs whose probes read 3000 and 1500 GB/s and 50 and 25 GB/s of link:
    each point predicted from the other run's same point, with the runs' own probes, errs by nothing."""
    global HBM, LINK
    a = _run(REF, "w4a16")
    saved = HBM, LINK
    HBM, LINK = 1500.0, 25.0
    try:
        b = _run(REF, "w4a16")
    finally:
        HBM, LINK = saved
    for src, tgt in ((a, b), (b, a)):
        t = C.cross_check(src, tgt, REF, C.gpu("h200"), C.gpu("h100"))
        assert len(t) == 12 and t["error"].abs().max() < 1e-9
    slow = b.copy()
    slow.loc[slow.experiment == "decode", "step_ms_median"] *= 1.1
    assert C.cross_check(a, slow, REF, C.gpu("h200"), C.gpu("h100"))["error"].max() < -0.08


# ---- `labkit predict` with no run: the published shape on the reference box, at any context -------------------
def _reference_run() -> Path:
    from labkit.docs.runs import RUNS
    run = Path(__file__).resolve().parent.parent / RUNS["reference"]["h100"]
    if not run.is_dir():
        pytest.skip("the reference run folder is not in this checkout")
    return run


def test_predict_with_no_run_is_the_published_shape_on_three_3090s_at_any_context(capsys):
    """The 3090 owner's question, one command: `labkit predict --context 128K` reads docs/runs.toml's reference
    run (the published shape, W4A16) and predicts 3 x RTX 3090 at exactly the context asked, one row a point."""
    run = _reference_run()
    assert main(["predict", "--context", "128K", "--concurrency", "1,4"]) == 0
    out = capsys.readouterr().out
    head, table = out.splitlines()[0], out.split("why (largest context")[0]
    assert head.startswith("PREDICTED (not measured) on 3 x NVIDIA GeForce RTX 3090"), head
    assert "shape qwen3.8-flash-next," in head and "w4a16 weights" in head and run.name[:15] in head, head
    rows = [ln.split() for ln in table.splitlines()[2:] if ln.split() and ln.split()[0] in ("resident", "zero_copy")]
    assert len(rows) == 4 and {r[2] for r in rows} == {"128K"} and {r[1] for r in rows} == {"1", "4"}, table
    assert "nan" not in table.lower()


def test_predict_says_which_contexts_do_not_fit_the_box_and_json_has_null_not_nan(capsys):
    """A context whose memory exceeds a 3090 reads "does not fit" (resident at 1M holds its KV on the cards) with
    the usable memory it exceeds; the JSON is strict JSON, such a point's tok/s null."""
    _reference_run()
    assert main(["predict", "--context", "100000,1M", "--concurrency", "1"]) == 0
    out = capsys.readouterr().out
    resident_1m = next(ln for ln in out.splitlines() if ln.split()[:3] == ["resident", "1", "1M"])
    assert "does not fit" in resident_1m and "22.5 GiB usable" in out, out
    assert any(ln.split()[:3] == ["zero_copy", "1", "97.7K"] for ln in out.splitlines()), out   # any length, as asked
    assert main(["predict", "--context", "1M", "--concurrency", "1", "--json"]) == 0
    import json

    def no_nan(word):
        raise AssertionError(f"{word} in the JSON")
    doc = json.loads(capsys.readouterr().out, parse_constant=no_nan)
    res = next(r for r in doc["prediction"] if r["strategy"] == "resident")
    assert res["fits"] is False and res["predicted_tok_s"] is None and doc["shape"] == "qwen3.8-flash-next"


@pytest.mark.parametrize("args,said", [(["--context", "0"], "--context must be 1 to"),
                                       (["--context", "lots"], "is not a whole number"),
                                       (["--context", "1,,2"], "separated by commas"),
                                       (["--context", "1G"], "--context must be 1 to"),
                                       (["--concurrency", "0"], "--concurrency must be 1 to"),
                                       (["--concurrency", "2.5"], "is not a whole number"),
                                       (["--gpus", "0"], "--gpus must be 1 to"),
                                       (["--allreduce-us", "nan"], "--allreduce-us must be")])
def test_predict_options_out_of_range_are_one_line(args, said, capsys):
    assert main(["predict", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert said in err and len(err.splitlines()) == 1, err


def test_a_measured_all_reduce_latency_comes_from_the_option_or_the_calibration(tmp_path):
    m = _run(REF, "w4a16")
    cm = C.CostModel.fit(m, REF, "zero_copy", 65536, 1, H200)
    box = C.gpu("rtx3090")
    (tmp_path / "cal.json").write_text('{"gpu_name": "RTX 3090", "hbm_read_gbps": 800, "link_gbps": 20, '
                                       '"allreduce_us": 55}')
    cal = C.Calibration.load(tmp_path / "cal.json")
    assert cal.allreduce_us == 55 and C.measured_allreduce_us(None, cal) == 55
    assert C.measured_allreduce_us(40.0, cal) == 40.0          # the option wins over the calibration
    assert C.measured_allreduce_us(None, None) is None          # nothing measured: the caller gives the band
    assert C.measured_allreduce_us(0.0, None) == 0.0
    src = C.Calibration("H200", HBM, 50.0)

    def ar(**kw):
        return cm.predict(box, 4096, 1, 2048, n_gpus=4, split="tensor", **kw).phases_ms["allreduce"]
    assert ar(calibration=cal, source_calibration=src) == pytest.approx(
        2 * 48 * C.allreduce_ms(4, 2560 * 2, box.link_gbps, 55.0))
    assert ar(allreduce_us=0.0) == pytest.approx(2 * 48 * C.allreduce_ms(4, 2560 * 2, box.link_gbps, 0.0))


def test_an_unmeasured_tensor_split_prints_the_all_reduce_band_and_a_measured_one_a_number(capsys):
    args = ["predict", "--gpus", "4", "--split", "tensor", "--context", "4K", "--concurrency", "1"]
    assert main(args) == 0
    out = capsys.readouterr().out
    lo, hi = C.ALLREDUCE_BAND_US
    assert f"band over {lo:g}–{hi:g} µs" in out
    row = next(ln.split() for ln in out.splitlines() if ln.split()[:1] == ["resident"])
    a, b = (float(x) for x in row[3].split("–"))
    assert b - a == pytest.approx(2 * 48 * (hi - lo) / 1e3, abs=0.02)       # 48 layers, two all-reduces each
    assert main([*args, "--allreduce-us", "40"]) == 0
    out = capsys.readouterr().out
    assert "band over" not in out
    row = next(ln.split() for ln in out.splitlines() if ln.split()[:1] == ["resident"])
    assert a < float(row[3]) < b
