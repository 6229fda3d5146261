"""The published model's tables: the box's bound against the peer's step, the peer's own fixed-vs-per-request
split, and the box predicted at the peer's points (each checked against its definition, not a stored output)."""
import json
import statistics

import pytest

from labkit import costmodel as C
from labkit import peer as P
from labkit.docs import reference_tables as R
from labkit.results import REPO, load_run
from labkit.shapes import PRESETS, metrics_shape

ANATOMY_RUN = "results/20261203-060711-decode-64k-h200"      # an H200 decode run with step anatomies


def test_the_bound_is_each_cards_bytes_at_the_cards_bandwidth():
    text = R.peer_bound_table()
    s, box = PRESETS["qwen3.8-flash-next"], C.gpu("rtx3090")
    by = C.phase_bytes(s, "resident", 4096, 8, 2048, "w4a16")
    split = {"weights": 4, "deltanet": 4, "experts": 4, "hc": 4, "head": 4, "transfer": 2, "attention": 2}
    card = sum(v / split.get(ph, 1) for ph, v in by.items() if ph != "ngram")
    row = next(line for line in text.splitlines() if line.startswith("| 4K c=8 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[2] == f"{card / 1e9:.2f}" and cells[3] == f"{card / (box.hbm_gbps * 1e6):.2f}"
    peer = P.headline()
    step = peer[(peer.metric == "tpot_ms") & (peer.context_len == 4096) & (peer.concurrency == 8)]["median"].iloc[0]
    assert cells[1] == f"{step:.2f}"
    # more requests read more distinct experts: the bytes per card grow with the batch at 4K
    reads = [float(line.split("|")[3]) for line in text.splitlines() if line.startswith("| 4K c=")]
    assert reads == sorted(reads) and reads[-1] > reads[0]


def test_the_peers_split_is_a_least_squares_line_through_its_4k_steps():
    fit = R.peer_fit()
    pts = P.headline()
    t = pts[(pts.metric == "tpot_ms") & (pts.context_len == 4096)].sort_values("concurrency")
    resid = [m - (fit["fixed_ms"] + fit["per_request_ms"] * c) for c, m in zip(t.concurrency, t["median"])]
    assert abs(sum(resid)) < 1e-9 and len(resid) == 4          # least squares: the residuals sum to zero
    assert fit["c1_ms"][4096] == pytest.approx(statistics.median(
        P.load().query("metric == 'tpot_ms' and context_len == 4096 and concurrency == 1 and primary")["median"]))


def test_the_box_predicted_at_the_peers_points_in_both_splits():
    run = load_run(REPO / ANATOMY_RUN)
    shape, src = metrics_shape(run.metrics), C.gpu_for_name(run.manifest["gpu_name"])
    pred = R.box_predictions(run.metrics, shape, src)
    for split, n, _ in R.BOX_SPLITS:
        p = pred[pred.split == split]
        assert set(p.gpus) == {n}
        steps = p[p.metric == "tpot_ms"].set_index(["context_len", "concurrency"])["predicted"]
        for metric in ("decode_tok_s", "decode_aggregate_tok_s"):
            for _, r in p[p.metric == metric].iterrows():     # tokens a second = c x 1000 / the same step
                assert r.predicted == pytest.approx(r.concurrency * 1e3 / steps[(r.context_len, r.concurrency)])
    tp = pred[(pred.split == "tensor") & (pred.metric == "tpot_ms")].iloc[0]
    ar = C.allreduce_ms(4, tp.concurrency * shape.hidden * 2, C.gpu("rtx3090").link_gbps, C.ALLREDUCE_US)
    assert tp["allreduce_ms"] == pytest.approx(2 * shape.layers * ar)
    at = R.box_predictions(run.metrics, shape, src, allreduce_us=70.0)
    tp = at[(at.split == "tensor") & (at.metric == "tpot_ms")].iloc[0]
    ar = C.allreduce_ms(4, tp.concurrency * shape.hidden * 2, C.gpu("rtx3090").link_gbps, 70.0)
    assert tp["allreduce_ms"] == pytest.approx(2 * shape.layers * ar)
    # the peer comparison matches every predicted point the peer measured
    cmp = P.compare(pred[pred.split == "tensor"][["context_len", "concurrency", "metric", "predicted"]], P.load())
    assert cmp["median"].notna().sum() == 14


def test_the_anatomy_table_carries_each_points_phases_and_only_the_shapes_phases():
    path = "results/20261206-042517-reference-w4a16-h100"       # the published shape's W4A16 grid, with anatomies
    text = R.anatomy_of(path)
    m = load_run(REPO / path).metrics
    d = m[(m.experiment == "decode") & (m.status == "ok") & m.anat_closure.notna()]
    lines = [ln for ln in text.splitlines() if ln.startswith("| ") and not ln.startswith("| c |")]
    assert len(lines) == len(d)
    head = [c.strip() for c in text.splitlines()[2].strip("|").split("|")]
    assert "experts" in head and "hc" in head and "other" not in head      # the MoE shape's phases; none all-zero
    r = d[(d.strategy == "zero_copy") & (d.context_len == 1 << 20) & (d.concurrency == 4)].iloc[0]
    row = next(ln for ln in lines if ln.startswith("| 4 | 1M | zero_copy |"))
    cells = dict(zip(head, [c.strip() for c in row.strip("|").split("|")]))
    assert cells["experts"] == f"{r.anat_experts_ms:.2f}" and cells["transfer"] == f"{r.anat_transfer_ms:.2f}"
    assert cells["step ms"] == f"{r.step_ms_median:.2f}" and cells["sum / step"] == f"{r.anat_closure:.3f}"


def test_a_swept_bench_shows_the_engines_kernel_and_the_fastest_of_the_sweep(tmp_path, monkeypatch):
    """A bench of many tiles and splits: the table keeps bf16, the engine's kernel and the earlier one, and one row per
    part and batch names the fastest swept variant with its time against the engine's kernel."""
    rows = []
    for part, c in R.PARTS_C:
        rows.append({"part": part, "weights": "bf16", "variant": "default", "concurrency": c, "ms": 2.0})
        for i, v in enumerate(["default", "dequant", *[f"v{k}" for k in range(6)]]):
            # v3 is the fastest swept variant everywhere; default at 1.0 ms
            rows.append({"part": part, "weights": "w4a16", "variant": v, "concurrency": c,
                         "ms": {"default": 1.0, "dequant": 3.0, "v3": 0.8}.get(v, 1.1 + 0.01 * i)})
    for r in rows:
        r.update(bytes=1e9, ms_median=r["ms"], ms_min=r["ms"], ms_max=r["ms"], gbps=1e9 / r["ms"] / 1e6,
                 of_hbm_read=0.5 / r["ms"])
    (tmp_path / "b.json").write_text(json.dumps({"shape": "s", "device": "d", "hbm_read_gbps": 3000, "rows": rows}))
    monkeypatch.setattr(R, "REPO", tmp_path)
    text = R.weights_bench_table("b.json")
    main, best = text.split("The other tiles")
    assert "| v" not in main and main.count("| default |") == 4 and main.count("| dequant |") == 4
    best_rows = [ln for ln in best.splitlines() if ln.startswith("| dense") or ln.startswith("| experts")]
    assert len(best_rows) == 4 and all("| v3 | 0.80 |" in ln and "0.80×" in ln for ln in best_rows), best_rows


def test_the_peer_is_checked_against_its_own_setup_over_the_all_reduce_band():
    """The 4-card tensor-parallel prediction is the one compared with the 4-card peer, at both ends of the
    unmeasured all-reduce band; the 3-stage box is a prediction with no peer column beside it."""
    text = R.peer_table(ANATOMY_RUN)
    head, tp_block, layers_block = text.split("\n\n**")
    lo, hi = C.ALLREDUCE_BAND_US
    assert head.startswith("4x RTX 3090, tensor parallel (the peer's setup)") and "3x" not in head
    assert f"predicted, all-reduce {lo:g}–{hi:g} µs (unmeasured)" in tp_block
    assert "a prediction, not a check" in layers_block and "peer (median" not in layers_block
    assert "within" not in layers_block.split("\n\n", 1)[1]
    run = load_run(REPO / ANATOMY_RUN)
    shape, src = metrics_shape(run.metrics), C.gpu_for_name(run.manifest["gpu_name"])
    rows = R.peer_tensor_rows(ANATOMY_RUN)
    for x, end in ((lo, 0), (hi, -1)):
        p = R.box_predictions(run.metrics, shape, src, allreduce_us=x)
        step = p[(p.split == "tensor") & (p.metric == "tpot_ms")].set_index(["context_len", "concurrency"])["step_ms"]
        r = next(r for r in rows if r["metric"] == "tpot_ms" and (r["context_len"], r["concurrency"]) == (4096, 1))
        assert r["predicted"][end] == pytest.approx(step[(4096, 1)])
    # a measured latency replaces the band: one number
    one = R.peer_tensor_rows(ANATOMY_RUN, allreduce_us=40.0)
    assert all(len(r["predicted"]) == 1 for r in one)
    assert "40 µs (measured)" in R.peer_table(ANATOMY_RUN, allreduce_us=40.0)


def test_the_fixed_term_is_never_fitted_on_the_point_it_is_judged_on():
    """Each c = 1 point's fixed term comes from the other three depths, each c > 1 point's from the four c = 1
    points: the 4K c = 1 point is no longer matched exactly by a term fitted on it."""
    run = load_run(REPO / ANATOMY_RUN)
    shape, src = metrics_shape(run.metrics), C.gpu_for_name(run.manifest["gpu_name"])
    p = R.box_predictions(run.metrics, shape, src, allreduce_us=C.ALLREDUCE_BAND_US[0])
    step = p[(p.split == "tensor") & (p.metric == "tpot_ms")].set_index(["context_len", "concurrency"])["step_ms"]
    c1 = R.peer_fit()["c1_ms"]
    rows = {(r["metric"], r["context_len"], r["concurrency"]): r for r in R.peer_tensor_rows(ANATOMY_RUN)}
    for d in R.PEER_DEPTHS:
        others = [o for o in R.PEER_DEPTHS if o != d]
        fixed = statistics.fmean(c1[o] - step[(o, 1)] for o in others)
        r = rows[("tpot_ms", d, 1)]
        assert r["fixed_ms"] == pytest.approx(fixed) and r["with_fixed"] == pytest.approx(step[(d, 1)] + fixed)
        assert "other c = 1 depths" in r["fixed_on"]
    assert rows[("tpot_ms", 4096, 1)]["with_fixed_error"] != pytest.approx(0.0, abs=1e-6)
    every = statistics.fmean(c1[o] - step[(o, 1)] for o in R.PEER_DEPTHS)
    r8 = rows[("tpot_ms", 4096, 8)]
    assert r8["fixed_ms"] == pytest.approx(every) and r8["fixed_on"] == "the c = 1 points"
    # the fixed term does not depend on the latency the band is read at (every step waits it alike)
    hi = R.box_predictions(run.metrics, shape, src, allreduce_us=C.ALLREDUCE_BAND_US[1])
    step_hi = hi[(hi.split == "tensor") & (hi.metric == "tpot_ms")].set_index(["context_len", "concurrency"])["step_ms"]
    fixed_hi = statistics.fmean(c1[o] - step_hi[(o, 1)] for o in R.PEER_DEPTHS)
    assert step_hi[(4096, 8)] + fixed_hi == pytest.approx(step[(4096, 8)] + every, abs=1e-6)


def test_a_point_out_of_reach_says_which_term_is_missing_and_by_how_much():
    text = R.peer_table(ANATOMY_RUN)
    rows = {(r["metric"], r["context_len"], r["concurrency"]): r for r in R.peer_tensor_rows(ANATOMY_RUN)}
    for key, r in rows.items():
        line = next(ln for ln in text.splitlines() if ln.startswith(f"| {key[0]} {R._ctx(key[1])} c={key[2]} |"))
        missing = line.rstrip(" |").rsplit("|", 1)[1].strip()
        out = r["within"] is None or abs(r["with_fixed_error"]) > 0.15 + 1e-9
        assert (missing != "—") == out, line
        if out and key[2] > 1:
            assert f"{r['missing_after_fixed_ms']:+.1f} ms a step" in missing and "per-request term" in missing


def test_each_streaming_phase_is_set_against_its_own_bytes_at_the_measured_rate():
    """`phase_bounds`: a phase's bound is its bytes at the run's rate (the routed experts at the distinct experts the
    point read, the dense products against the QSA and DeltaNet phases together, `transfer` at the link's rate);
    a phase the point did not run, or whose rate was not measured, has no bound."""
    import pandas as pd

    from labkit.docs.reference_tables import phase_bounds
    from labkit.shapes import PRESETS
    s = PRESETS["qwen3.8-flash-next"]
    r = pd.Series({"concurrency": 4, "context_len": 65536, "experts_read_per_layer": 30.0, "h2d_bytes_per_step": 2e8,
                   "anat_experts_ms": 6.0, "anat_hc_ms": 1.5, "anat_weights_ms": 0.7, "anat_deltanet_ms": 2.3,
                   "anat_head_ms": 0.5, "anat_index_score_ms": 0.2, "anat_transfer_ms": 4.0})
    b = phase_bounds(r, s, "w4a16", 3000.0, 50.0)
    wb = s.step_weight_bytes(4, "w4a16", 30.0)
    assert b["experts"] == (6.0, pytest.approx(wb["experts"] / 3e9))
    assert b["weights + deltanet"] == (pytest.approx(3.0), pytest.approx(wb["dense"] / 3e9))
    assert b["transfer"] == (4.0, pytest.approx(2e8 / 50e6))
    assert b["index_score"][1] == pytest.approx(4 * 65536 * s.index_key_bytes * s.attn_layers / 3e9)
    assert s.step_weight_bytes(4, "w4a16", 40.0)["experts"] > wb["experts"]        # the bound follows the experts read
    assert "transfer" not in phase_bounds(r, s, "w4a16", 3000.0, float("nan"))
    assert "transfer" not in phase_bounds(r.drop("anat_transfer_ms"), s, "w4a16", 3000.0, 50.0)
