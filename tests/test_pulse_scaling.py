"""Concurrency scaling with every request offloaded (PulseInfer): the two-batch bound and its crossover,
the ping-pong round of two offloaded batches (it must change no token), and the bench's run folder on CPU.
(GPU: `scripts/device.sh pulseinfer` measures it at 1M context.)"""
import pandas as pd
import pytest
import torch

from labkit.experiments.pulse_scaling.measure import crossover_requests, two_batch_bound
from labkit.shapes import PRESETS

TINY = PRESETS["tiny"]
REF = PRESETS["qwen3.8-flash-next-standin"]


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_crossover_from_the_reference_physics():
    """DESIGN's H200 numbers: 7.0 GB of weights at 2.26 TB/s (3.1 ms) against 48 MiB of rows per request
    per step at 55 GB/s (0.92 ms): switching two batches can pay only above ~3.4 requests."""
    row = 2048 * REF.row_bytes * REF.attn_layers
    assert row == 48 * 2**20
    n = crossover_requests(7.0e9, 2260, row, 55)
    assert 3.2 < n < 3.6
    assert crossover_requests(7.0e9, 2260, row, 5.5) == pytest.approx(n / 10)    # a slower link: earlier
    with pytest.raises(ValueError):
        crossover_requests(7.0e9, 0, row, 55)


def test_two_batch_bound_on_both_sides_of_the_crossover():
    W, c, t = 3.0, 0.2, 1.0                      # weights ms, compute ms per request, transfer ms per request

    def C(b):
        return W + c * b if b else 0.0

    def at(n):
        a, b = -(-n // 2), n // 2
        return two_batch_bound(C(n), C(a), C(b), a * t, b * t)
    lo, hi = at(2), at(8)                        # N * t = 2 < W; 8 > W
    assert lo["extra_weight_ms"] == pytest.approx(W) and hi["extra_weight_ms"] == pytest.approx(W)
    assert lo["gain_bound"] < 1                  # below the crossover switching cannot win...
    assert hi["gain_bound"] > 1                  # ...above it it can
    # the floor is each term it names
    assert hi["switched_floor_ms"] == pytest.approx(max(C(4) * 2, 8 * t, C(4) + 4 * t))
    assert hi["no_switch_model_ms"] == pytest.approx(C(8) + 8 * t)
    # transfer-bound limit: the gain tends to (W + N(c + t)) / (N t)
    big = at(400)
    assert big["switched_floor_ms"] == pytest.approx(400 * t)


def _two_caches(model, seed):
    from labkit.engine.model.cache import OffloadCache
    out = []
    for i in range(2):
        c = OffloadCache.allocate(model, "host", 2, 192, page_size=16)
        c.fill_random_([150, 150], seed=seed + i)
        out.append(c)
    return out


def test_pingpong_round_changes_no_token():
    """Two offloaded batches alternated at their loads give the tokens of running them one after the
    other (same caches, same seeds), over several rounds, and every load is counted."""
    from labkit.engine import Engine, HybridModel, get_strategy
    from labkit.engine.drive.runner import DecodeState
    from labkit.engine.drive.switching import Loader, Timeline, pingpong_round, sequential_round
    model = HybridModel(TINY, "cpu", seed=0)
    toks = {}
    for mode in ("pingpong", "sequential"):
        es = []
        for c in _two_caches(model, 5):
            e = Engine(model, c, get_strategy("zero_copy"), 16)
            s = DecodeState(e, 2, None, 16)
            e.strategy.bind(c, 2, s.k)
            es.append((e, s))
        seen = []
        for r in range(3):
            if mode == "pingpong":
                tl = Timeline(False)
                st = pingpong_round(*es[0], *es[1], (Loader(es[0][0]), Loader(es[1][0])), tl)
                assert len(st.loads_offloaded) == 2 * TINY.attn_layers
                assert [o for o, _ in st.order[:2]] == ["a", "b"]          # each ran to its first load
                kinds = {(s["batch"], s["kind"]) for s in tl.spans()}
                assert ("offloaded B", "transfer") in kinds and ("offloaded A", "wait") in kinds
            else:
                sequential_round(es)
            seen.append([s.tokens.tolist() for _, s in es])
        toks[mode] = seen
    assert toks["pingpong"] == toks["sequential"]


@pytest.mark.parametrize("strategy,block", [("zero_copy", "1"), ("block_dma", "8")])
def test_scaling_bench_run_folder_on_cpu(tmp_path, strategy, block):
    from labkit import experiments
    from labkit.params import BadInput
    out = tmp_path / "scale"
    split = {"dma_units_per_call": "3"} if strategy == "block_dma" else {}   # a load in calls of 3 units
    small = {"shape": "tiny", "device": "cpu", "context": "128", "budget": "16", "requests": "1,2", "steps": "1",
             "page_size": "16", "strategy": strategy, "select_block": block}
    run = experiments.measure("pulse_scaling", {**small, **split, "out_dir": str(out)}, progress_bar=False)
    assert run.manifest["status"] == "ok"
    m = pd.read_parquet(out / "metrics.parquet")
    assert set(m["status"]) == {"ok"}
    if split:                                             # the setting reached the strategy, recorded per row
        assert (m["dma_units_per_call"] == 3).all()
    assert set(zip(m["concurrency"], m["mode"])) == {(1, "no_switch"), (1, "resident"), (2, "no_switch"),
                                                     (2, "switched"), (2, "resident")}
    sw = m[m["mode"] == "switched"].iloc[0]
    assert sw["h2d_bytes_per_step_counted"] == 2 * 16 * TINY.row_bytes * TINY.attn_layers
    assert (m["tok_s"] > 0).all()
    assert len(pd.read_parquet(out / "timeline.parquet")) > 0
    for bad in ({"requests": "0"}, {"select_block": "3"}, {"bogus": "1"}, {"strategy": "resident"}):
        with pytest.raises(BadInput):
            experiments.plan("pulse_scaling", {**small, **bad, "out_dir": str(tmp_path / "bad")})
    assert not (tmp_path / "bad").exists()


def test_report_pieces_find_the_session_and_join_quality(tmp_path, monkeypatch):
    """The pulse report's physics section: companion runs found by the manifests' session (not by name),
    the scaling figure with its bound and crossover, and the selection table joining block transfers with
    the committed quality run at the same budget."""
    from labkit import experiments
    from labkit.experiments.pulse import figures as F
    from labkit.experiments.pulse_blocks import figures as BF
    from labkit.experiments.pulse_scaling import figures as SF
    from labkit.results import REPO, Run
    monkeypatch.setenv("LABKIT_SESSION", "sess-1")
    experiments.measure("pulse_blocks", {"shape": "tiny", "device": "cpu", "context": "4096", "budget": "2048",
                                         "blocks": "16", "repeats": "1", "out_dir": str(tmp_path / "b")}, progress_bar=False)
    experiments.measure("pulse_scaling", {"shape": "tiny", "device": "cpu", "context": "64", "budget": "16",
                                          "requests": "2", "steps": "1", "page_size": "16",
                                          "out_dir": str(tmp_path / "x-scaling")}, progress_bar=False)
    Run.create(tmp_path / "t", "pulse", {})
    monkeypatch.setenv("LABKIT_SESSION", "other")
    Run.create(tmp_path / "stranger", "pulse_scaling", {})
    comp = F.companions(tmp_path / "t")
    assert comp == {"pulse_blocks": tmp_path / "b", "pulse_scaling": tmp_path / "x-scaling"}
    # a manifest's own `companions` come first (a replay from another device call names its runs)
    other = Run.create(tmp_path / "t2", "pulse", {})
    other.manifest["companions"] = {"pulse_scaling": "stranger", "pulse_blocks": "no-such-run"}
    other.finish("ok")
    assert F.companions(tmp_path / "t2") == {"pulse_scaling": tmp_path / "stranger"}

    # the scaling figure from a GPU-like table: bound lines and both crossovers drawn
    def row(n, mode, ms, extra, xfer):
        return {"status": "ok", "mode": mode, "concurrency": n, "tok_s": n / ms * 1e3, "context_len": 1 << 20,
                "no_switch_model_ms": ms, "switched_floor_ms": ms * 0.8, "extra_weight_ms": extra,
                "transfer_ms": xfer, "crossover_physics": 3.4}
    m = pd.DataFrame([row(n, mode, 5 + n, 3.0, 0.9 * n) for n in (2, 4, 8) for mode in ("no_switch", "switched")])
    assert SF.measured_crossover(m) == pytest.approx(2 + 2 * (3 - 1.8) / (3.6 - 1.8))
    fig = SF.scaling(m)
    assert len(fig.data) == 4 and len(fig.layout.shapes) == 2

    qdir, qsum = BF.latest_quality_summary(REPO / "results", budget=2048)
    assert qdir is not None
    bl = pd.read_parquet(tmp_path / "b" / "metrics.parquet")
    t = BF.selection_table(bl, qsum, 5.0, TINY.attn_layers)
    assert list(t["selection"]) == ["per_head", "retrieval_head"]
    assert (t["link_bytes_per_step"] == 2048 * TINY.row_bytes * TINY.attn_layers).all()
    q = qsum[qsum["budget"] == 2048].groupby("policy")["ppl_ratio"].mean()
    assert t.set_index("selection").loc["retrieval_head", "ppl_ratio"] == pytest.approx(q["retrieval_head"])
    assert t.set_index("selection").loc["per_head", "ppl_ratio"] == pytest.approx(q["oracle"])
    assert (t["step_ms_zero_copy"] > 5.0).all()
    assert len(BF.selection_figure(t).data) >= 7
