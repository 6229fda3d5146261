"""Capacity under a device-memory cap and the prefill bench on CPU: the capacity
arithmetic equals what the engine really allocates; bad input is one line and exit 2 before any run
folder exists; both benches write run folders with manifest.json."""
import json
import math

import pandas as pd
import pytest
import torch

from labkit.experiments.capacity.measure import fit, request_bytes
from labkit.engine import HybridModel, OffloadCache, get_strategy
from labkit.engine.model.layers import dn_state_shapes
from labkit.shapes import PRESETS

REF, TINY = PRESETS["qwen3.8-flash-next-standin"], PRESETS["tiny"]


def _cli(name, *args):
    """`labkit run NAME`, its command line run in this process (bad input stops before papermill; torch is
    loaded once, not per case): (exit code, stderr)."""
    import contextlib
    import io
    from labkit.cli import main
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = main(["run", name, *args])
    return rc, err.getvalue()


def _measure(name, out, *pairs):
    """The same experiment measured in this process (no notebook): `-p k=v` pairs as the CLI takes them."""
    from labkit import experiments
    given = dict(a.split("=", 1) for a in pairs[1::2])
    return experiments.measure(name, {**given, "out_dir": str(out)}, progress_bar=False)


def test_request_bytes_equal_the_engines_allocations():
    """One request's cache (pool on the device, index keys, DeltaNet state) and, offloaded, the hot
    cache's bound state: the bytes the arithmetic charges are the bytes the engine allocates."""
    model = HybridModel(TINY, "cpu", seed=0)
    ctx, budget, cap = 512, 64, 96
    c = OffloadCache.allocate(model, "device", 1, ctx, page_size=256)
    d = c.device_bytes()
    staging = budget * TINY.row_bytes
    assert request_bytes(TINY, ctx, "none", budget, cap) == \
        d["device_kv_bytes"] + d["device_index_bytes"] + d["device_state_bytes"] + staging
    h = OffloadCache.allocate(model, "host", 1, ctx, page_size=256)
    st = get_strategy("hot_cache", hot_capacity=cap)
    st.bind(h, 1, budget)
    idx = st.index
    hot = sum(t.numel() * t.element_size() for t in (st.data, idx.rev, idx.slot_row, idx.key, idx._owner, idx._prot))
    hd = h.device_bytes()
    got = request_bytes(TINY, ctx, "both", budget, cap)
    want = hd["device_index_bytes"] + hd["device_state_bytes"] + staging + hot
    assert got == want


def test_offloading_both_stages_holds_more_requests_at_24_gib():
    cap = 24 * 2**30
    none, pre, both = (fit(REF, 64 << 10, cap, c, host_cap=64 * 2**30) for c in ("none", "prefill", "both"))
    assert 0 < pre.requests <= none.requests < both.requests
    assert both.n_host == 64 * 2**30 // ((64 << 10) * REF.kv_bytes_per_token())
    # none: the cap minus weights, workspace and one layer-sized prefix, over a request's resident KV
    assert none.requests == (cap - REF.weight_bytes() - 2 * 2**30 - (64 << 10) * REF.row_bytes) // none.per_request_bytes


def test_a_cap_is_checked_against_the_weights_as_they_are_held():
    """The published model's bf16 weights (234 GiB) do not fit 24 GiB; its W4A16 ones with one shared bank of
    experts do, and each further bank adds one layer's routed experts (experts x gate, up, down x the W4A16 bytes
    a weight)."""
    from labkit.experiments.device_cap import check_cap, least_weight_bytes
    from labkit.params import BadInput
    from labkit.shapes import PRESETS, WEIGHT_BYTES
    s, cpu = PRESETS["qwen3.8-flash-next"], torch.device("cpu")
    bank = s.experts * 3 * s.hidden * s.expert_intermediate * WEIGHT_BYTES["w4a16"]
    assert least_weight_bytes(s, "w4a16", 24) - least_weight_bytes(s, "w4a16", 1) == pytest.approx(23 * bank, rel=1e-6)
    assert least_weight_bytes(s, "w4a16", 0) == least_weight_bytes(s, "w4a16", 1)
    assert least_weight_bytes(s, "auto") == least_weight_bytes(s, "w4a16")
    assert least_weight_bytes(s, "w4a16", s.layers) == s.weight_bytes("w4a16")
    check_cap(24, s, cpu, "w4a16", 0)                      # fits with one bank
    least = least_weight_bytes(s, "w4a16", 24) / 2**30
    with pytest.raises(BadInput, match="w4a16"):
        check_cap(least * 0.99, s, cpu, "w4a16", 24)
    check_cap(least * 1.01, s, cpu, "w4a16", 24)
    with pytest.raises(BadInput, match="bf16"):
        check_cap(24, s, cpu, "bf16", s.layers)


@pytest.mark.parametrize("name,args,msg", [
    ("capacity", ["-p", "mem_cap_gib=0.0001"], "weights"),
    ("capacity", ["-p", "configs=none,gpu"], "configs must be one of none, prefill, both; got 'gpu'"),
    ("capacity", ["-p", "hot_policy=mru"], "unknown policy"),
    ("capacity", ["-p", "hot_capacity=0"], "capacity"),
    ("capacity", ["-p", "mem_cap_gib=0.002", "-p", "context_len=1M", "-p", "workspace_gib=0"], "no request"),
    ("capacity", ["-p", "mem_cap_gib=-1"], "mem_cap_gib"),
    ("prefill", ["-p", "modes=resident,async"], "modes must be one of resident, sync, rotating; got 'async'"),
    ("prefill", ["-p", "mem_cap_gib=0.0001"], "weights"),
    ("prefill", ["-p", "context_lens=256", "-p", "tail_tokens=256"], "tail_tokens"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, name, args, msg):
    out = tmp_path / "run"
    rc, err = _cli(name, "--out", str(out), "-p", "device=cpu", *args)
    assert rc == 2, err[-2000:]
    lines = err.strip().splitlines()
    assert len(lines) == 1 and msg in lines[0], err
    assert not out.exists(), "a run folder was created before the input was checked"


def test_capacity_run_on_cpu(tmp_path):
    out = tmp_path / "cap"
    _measure("capacity", out, "-p", "device=cpu", "-p", "context_len=128",
             "-p", "mem_cap_gib=0.006", "-p", "workspace_gib=0", "-p", "hot_capacity=16", "-p", "budget=16",
             "-p", "max_batch=2", "-p", "steps=2", "-p", "repeats=1", "-p", "tpot_ms=100000")
    man = json.loads((out / "manifest.json").read_text())
    assert man["experiment"] == "capacity" and man["status"] == "ok" and len(man["fits"]) == 3
    g = pd.read_csv(out / "goodput.csv").set_index("config")
    assert list(g.index) == ["none", "prefill", "both"]
    assert (g["good_batch"] == 2).all() and (g["goodput_tok_s"] > 0).all()
    m = pd.read_csv(out / "metrics.csv")
    assert set(m["strategy"]) == {"resident", "hot_cache"}
    assert math.isclose(g.loc["both", "goodput_tok_s"], 2 / (m[m.config == "both"]["tpot_ms"].iloc[0] / 1e3))


def test_prefill_bench_on_cpu(tmp_path):
    out = tmp_path / "pf"
    _measure("prefill", out, "-p", "device=cpu", "-p", "context_lens=200", "-p", "tail_tokens=72", "-p", "chunk=64")
    m = pd.read_csv(out / "metrics.csv").set_index("mode")
    assert list(m.index) == ["resident", "sync", "rotating"] and (m["status"] == "ok").all()
    assert (m["computed_tokens"] == 72).all() and m.loc["resident", "vs_resident"] == 1.0
    assert m.loc["rotating", "prefill_buffer_bytes"] == min(4, TINY.attn_layers) * 200 * TINY.row_bytes
    assert json.loads((out / "manifest.json").read_text())["parameters"]["tail_tokens"] == 72


def test_labkit_run_capacity_notebook_holds_issue_10s_figures(tmp_path):
    """`labkit run capacity` under papermill on a CPU: the goodput bars of its own measurement, and beside
    them the committed companions' figures (hit rate and bytes vs capacity per policy from the density
    replay; the H200 decode run's hot-cache hit rate and step anatomy per strategy)."""
    from browser_util import REPO, figures_in_notebook_report
    from labkit.execute import run_experiment
    replay = REPO / "results/20261130-hot-replay-density-cpu"
    decode = REPO / "results/20261130-094624-hotdecode-prose-b64-h200"
    out, err = run_experiment("capacity", {"device": "cpu", "context_len": "128", "mem_cap_gib": "0.006", "workspace_gib": "0",
                                         "hot_capacity": "16", "budget": "16", "max_batch": "2", "steps": "2", "repeats": "1",
                                         "tpot_ms": "100000", "replay_run": str(replay), "decode_run": str(decode)},
                            out_dir=tmp_path / "run", log_output=False, timeout=600)
    assert err is None, err
    g = pd.read_parquet(out / "goodput.parquet")
    assert list(g["config"]) == ["none", "prefill", "both"] and (g["goodput_tok_s"] > 0).all()
    assert figures_in_notebook_report(out) == 1 + 2 + 2          # goodput; replay x2; decode hit rate + anatomy
    assert (out / "report.html").exists()
    rc, err = _cli("capacity", "-p", "replay_run=/nonexistent", "--out", str(tmp_path / "never"))
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "replay_run" in err
    assert not (tmp_path / "never").exists()


def test_capacity_defaults_are_sized_to_this_machine(tmp_path):
    """With its defaults on a CPU, the cap is a share of the RAM available (never 24 GiB on a machine that
    has less) and the timed batch small enough to step: every row measured, none failed."""
    import psutil
    from labkit.experiments.capacity import CPU_MAX_BATCH
    from labkit.experiments import plan
    p = plan("capacity", {"device": "cpu"}).params
    assert 0 < p["mem_cap_gib"] * 2**30 <= psutil.virtual_memory().total / 4 + 2**30
    assert p["max_batch"] == CPU_MAX_BATCH
    out = tmp_path / "cap"
    _measure("capacity", out, "-p", "device=cpu", "-p", "steps=2", "-p", "repeats=1")
    m = pd.read_csv(out / "metrics.csv")
    assert (m["status"] == "ok").all(), m.get("error")
    assert m["batch"].max() <= CPU_MAX_BATCH


def test_a_timed_batch_larger_than_the_ram_is_refused_before_allocating(tmp_path):
    """A cap the size of the whole RAM, timed at its full capacity on a CPU: one line, exit 2, no folder."""
    import psutil
    cap = psutil.virtual_memory().total / 2**30
    out = tmp_path / "run"
    rc, err = _cli("capacity", "--out", str(out), "-p", "device=cpu", "-p", f"mem_cap_gib={cap:.1f}",
                   "-p", "max_batch=1000000000")
    assert rc == 2, err[-2000:]
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "of host RAM" in lines[0] and "available now" in lines[0], err
    assert not out.exists()
