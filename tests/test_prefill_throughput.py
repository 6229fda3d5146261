"""FlashOffloading's prefill throughput at toy size on a CPU: the offloaded prefill leaves the same KV and logits as
no offload, a slot reused for the next prompt starts clean, the chunk and prompts held are the largest the byte
formulas allow under the cap, the formulas match the live tensors of a CPU prefill and the allocator's peaks of the
committed H200 runs, a config that cannot fit is a failed row while the sweep goes on, and bad input is one line."""
from __future__ import annotations

import dataclasses
import math
import sys
import types
import weakref
from pathlib import Path

import pandas as pd
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from labkit import experiments
from labkit.engine import Engine, HybridModel, OffloadCache, get_strategy
from labkit.experiments.prefill_throughput import measure as M
from labkit.engine.model import attention, layers
from labkit.engine.model.prefill_batch import PrefillRequest, plan_forward
from labkit.experiments.prefill_throughput.fit import (activation_bytes, activation_bytes_per_token,
                                                       activation_fixed_bytes, cap_holding, chunk_step, fit,
                                                       fla_activation_bytes_per_token, fla_activation_fixed_bytes,
                                                       forward_shape, hc_frame_bytes_per_token, held_weight_bytes,
                                                       moe_activation_bytes_per_token, moe_activation_fixed_bytes,
                                                       padded, prefix_bytes, slot_bytes)
from labkit.params import BadInput
from labkit.shapes import ModelShape

REPO = Path(__file__).resolve().parents[1]
TINY = ModelShape.from_name("tiny")
MOE = ModelShape.from_name("tiny-moe")            # the published shape's parts: experts, hyper-connections
CPU = torch.device("cpu")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Toy tensors: a second thread is pure overhead, and on busy shared cores OpenMP's waiting makes it 10x."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def model():
    return HybridModel(TINY, CPU, seed=0)


def _batch(model, config, T, in_flight, chunk=64):
    f = dataclasses.replace(fit(TINY, T, 3, 1 << 40, config, chunk), in_flight=in_flight)
    return M.Batch(model, config, T, f)


def test_offloaded_prefill_leaves_the_kv_and_logits_of_no_offload(model):
    """Three prompts of 320 tokens (two pages, five chunks) through each config: the same KV rows per prompt, the
    same index keys, the same logits; the KV went to host RAM only where it should."""
    T = 320
    prompts = M.make_prompts(TINY, T, 3, seed=1, dev=CPU)
    none, pre = _batch(model, "none", T, 3), _batch(model, "prefill", T, 3)
    assert none.cache.pool.medium == "device" and pre.cache.pool.medium == "host"
    a, b = none.prefill_all(prompts), pre.prefill_all(prompts)
    for i in range(3):
        assert torch.equal(a[i], b[i]), i
        assert torch.equal(none.kv_rows(i), pre.kv_rows(i)), i
        assert torch.equal(none.cache.index.keys[:, i, :T].view(torch.uint8), pre.cache.index.keys[:, i, :T].view(torch.uint8))
    assert not torch.equal(a[0], a[1])            # different prompts, different logits: the check can fail
    # the hand-off moved the last prompt's device bytes: the KV itself only with no offload
    assert torch.equal(none.recv_kv, none.kv_rows(2)) and pre.recv_kv is None
    assert none.handoff_bytes - pre.handoff_bytes == TINY.attn_layers * T * TINY.row_bytes


def test_a_reused_slot_starts_clean(model):
    """One slot for three prompts (each waits for the last one's hand-off): the logits of three slots, so the
    DeltaNet state and pages of a reused slot carry nothing over; a warm-up's short prompt in slot 0 neither."""
    T = 192
    prompts = M.make_prompts(TINY, T, 3, seed=2, dev=CPU)
    three = _batch(model, "prefill", T, 3)
    wide = three.prefill_all(prompts)
    for config in ("none", "prefill"):
        one = _batch(model, config, T, 1)
        one.warm_up(prompts[2][:100])
        got = one.prefill_all(prompts)
        assert all(torch.equal(x, y) for x, y in zip(got, wide)), config
        assert torch.equal(one.kv_rows(0), three.kv_rows(2)), config


@pytest.mark.parametrize("kernels", [{}, {"dn_kernel": "fla", "attention_kernel": "split"}])
def test_chunk_and_prompts_held_are_the_largest_the_cap_allows(kernels):
    """For caps from nothing-fits to everything-fits: the choice fits under the cap, and one more chunk step (or,
    at the chunk chosen, one more prompt held) would not; the auto cap lets none hold half the prompts. With a
    CPU's kernels (the torch form, the activations a line in the chunk) and a GPU's (flash-linear-attention and
    the split attention, a step function: a QSA layer's prefix term)."""
    T, N, chunk = 512, 4, 64 if not kernels else 256
    step = chunk_step(chunk)
    for config in ("none", "prefill"):
        lo = fit(TINY, T, N, 0, config, chunk, **kernels).predicted_bytes
        for cap in [lo - 1, lo, lo + 5_000, lo + 50_000, lo + 400_000, lo + 4_000_000]:
            f = fit(TINY, T, N, cap, config, chunk, **kernels)
            assert (f.dn_kernel, f.attention_kernel) == (kernels.get("dn_kernel", "torch"),
                                                          kernels.get("attention_kernel", "sdpa"))
            if not f.fits:
                assert cap < lo and "the cap is" in f.why_not(T)
                continue
            assert f.predicted_bytes <= cap and 1 <= f.in_flight <= N and 0 < f.chunk <= chunk
            assert f.activation_bytes == activation_bytes(TINY, T, f.chunk, **kernels)
            if f.chunk < chunk:   # a step more of chunk would not fit even with one prompt held
                more = activation_bytes(TINY, T, f.chunk + step, **kernels)
                bigger = dataclasses.replace(f, chunk=f.chunk + step, in_flight=1, activation_bytes=more)
                assert bigger.predicted_bytes > cap
            if f.in_flight < N:
                assert dataclasses.replace(f, in_flight=f.in_flight + 1).predicted_bytes > cap
    if not kernels:       # a CPU plan's own
        p = experiments.plan("prefill_throughput", {"device": "cpu", "context_lens": "512", "prompts": "4"})
        fits = M.fits_of(p, TINY, 512)
        assert fits["none"].in_flight == 2 and fits["none"].chunk == 64
        assert fits["prefill"].in_flight == 4 and fits["prefill"].chunk == 64
        assert p.mem_cap_gib * 2**30 >= cap_holding(TINY, 512, 4, 2, 64)


class _LiveBytes(TorchDispatchMode):
    """The bytes of every tensor storage alive, after each op, and their peak (a CPU stand-in for the
    allocator's peak): a storage counts from the op that returned it until it is freed; an op's view of (or
    in-place write into) one of its inputs allocates nothing (a cache tensor made before is not counted)."""

    def __init__(self):
        super().__init__()
        self.live, self.now, self.peak = {}, 0, 0

    def _gone(self, key):
        self.now -= self.live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in self.live.keys() | given:
                s = t.untyped_storage()
                self.live[s.data_ptr()] = s.nbytes()
                self.now += s.nbytes()
                weakref.finalize(s, self._gone, s.data_ptr())
        self.peak = max(self.peak, self.now)
        return out


def test_activation_formula_matches_the_live_tensors_of_a_cpu_prefill():
    """A DeltaNet-only variant of `tiny` (where the peak sits) prefills one chunk of 128 and of 384 tokens: the
    live bytes per extra token are the formula's activations plus the prompt's prefix row and token id."""
    s = dataclasses.replace(TINY, name="tiny-dn", layers=3)
    m = HybridModel(s, CPU, seed=0)
    peaks = {}
    for c in (128, 384):
        cache = OffloadCache.allocate(m, "host", 1, c)
        e = Engine(m, cache, get_strategy("zero_copy"), 64, prefill_chunk=c)
        tokens = torch.randint(0, s.vocab, (c,))
        with torch.inference_mode(), _LiveBytes() as live:
            e.prefill(0, tokens)
        peaks[c] = live.peak
    slope = (peaks[384] - peaks[128]) / 256
    want = activation_bytes_per_token(s) + s.row_bytes + 8
    assert slope == pytest.approx(want, rel=0.03), (slope, want)


def test_forward_shape_is_the_schedulers():
    """The formulas' count of prompts a forward touches and of the prefix its first prompt brings is what the
    engine's first-come-first-served scheduler does, for budgets below, at and above the prompt's length."""
    for T, budget, n in [(100, 64, 5), (150, 100, 3), (128, 128, 4), (128, 64, 4), (100, 256, 6), (96, 200, 2),
                         (512, 1024, 4), (7, 3, 5)]:
        queue = [types.SimpleNamespace(slot=i, T=T, next=0) for i in range(n)]
        most = prefix = 0
        while queue:
            segs = plan_forward(queue, budget)
            most, prefix = max(most, len(segs)), max(prefix, segs[0].start)
            for r, sg in zip(queue, segs):
                r.next = sg.end
            queue = [r for r in queue if r.next < T]
        assert forward_shape(T, budget, n) == (most, prefix), (T, budget, n)


@pytest.mark.parametrize("config", ["none", "prefill"])
def test_a_batched_fit_holds_every_prompt_a_forward_touches(config):
    """Forwards of several prompts (a budget up to four prompts' worth): under caps from nothing-fits to
    everything-fits the choice fits, holds a slot for every prompt a forward touches (and with rotating buffers
    their four each), and one more chunk step would not fit; a budget that divides the prompt is one prompt a
    forward, the unbatched fit's bytes."""
    T, N, top = 256, 4, 1024
    lo = fit(TINY, T, N, 0, config, top, batched=True).predicted_bytes
    for cap in [lo - 1, lo, lo + 50_000, lo + 400_000, lo + 4_000_000, lo + 40_000_000]:
        f = fit(TINY, T, N, cap, config, top, batched=True)
        if not f.fits:
            assert cap < lo
            continue
        assert f.predicted_bytes <= cap and f.per_forward <= f.in_flight <= N
        assert f.per_forward == forward_shape(T, f.chunk, N)[0]
        assert f.prefix_bytes == prefix_bytes(TINY, T, config == "none", f.per_forward)
        if f.chunk < top:
            c = f.chunk + chunk_step(top)
            k = forward_shape(T, c, N)[0]
            more = dataclasses.replace(f, chunk=c, per_forward=k, in_flight=k,
                                       prefix_bytes=prefix_bytes(TINY, T, config == "none", k),
                                       activation_bytes=activation_bytes(TINY, T, c, batched=True, prompts=N))
            assert more.predicted_bytes > cap
    wide = fit(TINY, T, N, 1 << 40, config, top, batched=True)
    assert wide.chunk == top and wide.per_forward == N        # four prompts' worth: every prompt in one forward
    one = fit(TINY, T, N, 1 << 40, config, 128, batched=True)
    assert dataclasses.replace(one, batched=False) == fit(TINY, T, N, 1 << 40, config, 128)


def test_batched_activation_formula_matches_the_live_tensors_of_a_cpu_prefill():
    """The engine's batched prefill (a DeltaNet-only `tiny`, two prompts of 1.5 budgets each: forwards of one
    prompt's whole budget and forwards mixing the two) under budgets of 128 and 384: the live bytes per extra
    token of budget are the formula's activations at the forward's total, plus the shared prefix buffer's rows
    (1.5 a budget token), the forward's positions and its token ids gathered from the prompts."""
    s = dataclasses.replace(TINY, name="tiny-dn", layers=3)
    m = HybridModel(s, CPU, seed=0)
    peaks = {}
    for c in (128, 384):
        T = c * 3 // 2
        cache = OffloadCache.allocate(m, "host", 2, T)
        e = Engine(m, cache, get_strategy("zero_copy"), 64, prefill_chunk=c)
        prompts = [torch.randint(0, s.vocab, (T,)) for _ in range(2)]
        with torch.inference_mode(), _LiveBytes() as live:
            for _ in e.prefill_batch([PrefillRequest(i, t) for i, t in enumerate(prompts)]):
                pass
        peaks[c] = live.peak
    slope = (peaks[384] - peaks[128]) / 256
    per_token = (activation_bytes(s, 576, 384, batched=True, prompts=2) - activation_bytes(s, 192, 128, batched=True,
                                                                                            prompts=2)) / 256
    want = per_token + 1.5 * s.row_bytes + 16
    assert per_token == activation_bytes_per_token(s)
    assert slope == pytest.approx(want, rel=0.03), (slope, want)


@torch.inference_mode()
def test_a_batched_batch_reuses_slots_and_hands_each_prompt_off(model):
    """The experiment's batched switch: three prompts of 160 tokens several to a forward (a 256-token budget)
    through two slots, the third prompt admitted into the first one's slot as soon as it is handed off. The
    forwards are then those of the engine's batched prefill with a slot for every prompt, so the logits and the
    KV are its own, bit for bit (the engine's tests pin that to one-prompt prefill); the last hand-off took the
    third prompt's KV whole."""
    T = 160
    prompts = M.make_prompts(TINY, T, 3, seed=5, dev=CPU)
    f = dataclasses.replace(fit(TINY, T, 3, 1 << 40, "none", 256, batched=True), in_flight=2)
    assert f.batched and f.chunk == 256 and f.per_forward == 2
    b = M.Batch(model, "none", T, f)
    got = b.prefill_all(prompts)
    cache = OffloadCache.allocate(model, "device", 3, T)
    gen = Engine(model, cache, get_strategy("resident"), 2048).prefill_batch(
        [PrefillRequest(i, t) for i, t in enumerate(prompts)], 256)
    try:
        while True:
            next(gen)
    except StopIteration as done:
        want = done.value
    assert all(torch.equal(x, y) for x, y in zip(got, want)) and not torch.equal(got[0], got[1])
    kv = torch.empty_like(b.kv_rows(0))
    for layer in range(cache.pool.attn_layers):
        cache.read_prefix(layer, 2, T, kv[layer])
    assert torch.equal(b.kv_rows(0), kv) and torch.equal(b.recv_kv, kv)


def _fla_stand_in(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                  use_qk_l2norm_in_kernel=False):
    """What fla-core 0.6.0's `chunk_gated_delta_rule` allocates on its forward (its source, function by function),
    in its order and with its lifetimes; the values are not computed. `input_guard`: every input contiguous;
    `l2norm_fwd` on q and k: an output like its input and the inverse norms [.., H] fp32; `chunk_local_cumsum`: the
    cumulative decay, fp32; `chunk_gated_delta_rule_fwd_intra`: A zeros [B, T, HV, 64] in k's dtype, then
    `recompute_w_u_fwd`: w [B, T, HV, K] like k, u like v; `chunk_gated_delta_rule_fwd_h`: h [B, chunks, HV, K, V]
    like k, the final state zeros fp32, the new values like u; `chunk_fwd_o`: o like the new values."""
    assert use_qk_l2norm_in_kernel and output_final_state
    guarded = [t.contiguous() for t in (q, k, v, g, beta, initial_state)]     # held by the guard's frame
    q, k, v, g = guarded[:4]
    q, q_rstd = torch.empty_like(q), torch.empty(q.shape[:-1], dtype=torch.float32)
    k, k_rstd = torch.empty_like(k), torch.empty(k.shape[:-1], dtype=torch.float32)
    g = torch.empty_like(g, dtype=torch.float32)
    B, T, _, K = k.shape
    HV, V = v.shape[2:]
    A = torch.zeros(B, T, HV, 64, dtype=k.dtype)
    w, u = k.new_empty(B, T, HV, K), torch.zeros_like(v)
    h = k.new_empty(B, -(-T // 64), HV, K, V)
    final_state = k.new_zeros(B, HV, K, V, dtype=torch.float32)
    v_new = torch.zeros_like(u)
    o = torch.zeros_like(v_new)
    return o, final_state


def _cudnn_stand_in(q, k, v, causal):
    """What `attention._cudnn` returns from cuDNN: the output in q's layout and the log-sum-exp [B, H, Tq] fp32."""
    return torch.zeros_like(q), torch.zeros(q.shape[:3], dtype=torch.float32)


@pytest.fixture
def gpu_kernels(monkeypatch):
    """The engine's prefill on a CPU as it runs on an H100: DeltaNet through `deltanet_prefill.scan_fla` into
    flash-linear-attention (`_fla_stand_in`), dense attention split into two cuDNN calls (`_cudnn_stand_in`)."""
    fla = types.ModuleType("fla.ops.gated_delta_rule")
    fla.chunk_gated_delta_rule = _fla_stand_in
    for name in ("fla", "fla.ops", "fla.ops.gated_delta_rule"):
        monkeypatch.setitem(sys.modules, name, fla if name.endswith("rule") else types.ModuleType(name))
    monkeypatch.setattr(layers, "dn_prefill_kernel", lambda device: "fla")
    monkeypatch.setattr(attention, "prefill_kernel", lambda device: "split")
    monkeypatch.setattr(attention, "_cudnn", _cudnn_stand_in)


@pytest.mark.parametrize("layers_, T, chunk", [(3, 384, 384), (8, 448, 128)])
def test_fla_and_split_formulas_match_the_live_tensors_of_the_engine(gpu_kernels, layers_, T, chunk):
    """The engine's own prefill forward on a CPU, the two GPU kernels replaced by what they allocate: the live
    bytes at the peak are the formulas' activations plus the prefix buffer. Three DeltaNet layers in one chunk
    (the DeltaNet term: no QSA layer), and `tiny` in three chunks and a tail (a QSA layer's, with its prefix)."""
    s = dataclasses.replace(TINY, name=f"tiny-{layers_}", layers=layers_)
    m = HybridModel(s, CPU, seed=0)
    cache = OffloadCache.allocate(m, "host", 1, T)
    e = Engine(m, cache, get_strategy("zero_copy"), 64, prefill_chunk=chunk)
    tokens = torch.randint(0, s.vocab, (T,))
    with torch.inference_mode(), _LiveBytes() as live:
        e.prefill(0, tokens)
    want = activation_bytes(s, T, chunk, "fla", "split")
    dn = chunk * fla_activation_bytes_per_token(s) + fla_activation_fixed_bytes(s)
    assert (want == dn) == (s.attn_layers == 0)          # each case checks one term: the one at its peak
    assert live.peak - T * s.row_bytes == pytest.approx(want, rel=0.01), (live.peak - T * s.row_bytes, want)


@pytest.mark.parametrize("run, config", [("20261130-121336-prefill-248k-full-h200", "resident"),
                                         ("20261130-121336-prefill-248k-full-h200", "rotating"),
                                         ("20261130-121920-prefill-1m-full-cap24-h200", "rotating")])
def test_byte_formulas_match_the_allocator_peaks_of_the_h200_runs(run, config):
    """The committed H200 prefill runs (one prompt, 8K chunks; 248K resident and rotating, 1M rotating under a
    24 GiB cap): the formulas' peak within 1% of `torch.cuda.max_memory_allocated`."""
    m = pd.read_parquet(REPO / "results" / run / "metrics.parquet").set_index("mode")
    ref = ModelShape.from_name("qwen3.8-flash-next-standin")      # the runs were made with it
    r = m.loc[config]
    T, chunk = int(r["context_len"]), int(r["prefill_chunk"])
    f = fit(ref, T, 1, 1 << 50, "none" if config == "resident" else "prefill", chunk)
    assert f.chunk == chunk and f.in_flight == 1
    assert f.predicted_bytes == pytest.approx(float(r["device_mem_peak_bytes"]), rel=0.01)
    assert f.activation_bytes == chunk * activation_bytes_per_token(ref) + activation_fixed_bytes(ref)
    assert slot_bytes(ref, T, False) + ref.attn_layers * padded(T) * ref.row_bytes == slot_bytes(ref, T, True)


def test_a_config_that_cannot_fit_is_a_failed_row_and_the_sweep_goes_on(tmp_path, model):
    """A cap that holds one offloaded prompt of 256 tokens but not one with its KV on the device: none is a
    failed row that says why, prefill is measured (one prompt held), each row within the cap by the formulas
    (which count the weights the built model holds)."""
    T, N = 256, 2
    need = fit(TINY, T, N, 0, "prefill", 64, weight_bytes=model.weight_bytes()).predicted_bytes
    assert fit(TINY, T, N, need + 2_000, "none", 64, weight_bytes=model.weight_bytes()).fits is False
    run = experiments.measure("prefill_throughput", {"device": "cpu", "context_lens": str(T), "prompts": str(N),
                                                     "configs": "none,prefill", "repeats": "1",
                                                     "mem_cap_gib": str((need + 2_000) / 2**30),
                                                     "out_dir": str(tmp_path / "run")}, progress_bar=False)
    m = pd.read_parquet(run.path / "metrics.parquet").set_index("config")
    assert m.loc["none", "status"] == "failed" and "config none: one prompt of 256 tokens" in m.loc["none", "error"]
    ok = m.loc["prefill"]
    assert ok["status"] == "ok" and ok["in_flight"] == 1 and ok["chunk"] == 64 and ok["prompts_per_s"] > 0
    assert ok["prompts_per_s_min"] <= ok["prompts_per_s"] <= ok["prompts_per_s_max"]
    assert ok["predicted_bytes"] <= ok["mem_cap_bytes"] and ok["logits_finite"]
    assert ok["tok_s"] == pytest.approx(ok["prompts_per_s"] * T)
    assert run.manifest["status"] == "partial"


@pytest.mark.parametrize("given, says", [
    ({"configs": "none,bogus"}, "configs must be one of none, prefill, both"),
    ({"mem_cap_gib": "0.0001"}, "below the"),
    ({"prompts": "-2"}, "prompts must be > 0"),
    ({"context_lens": "64M", "prompts": "64"}, "of host RAM"),
    ({"batched": "true", "max_num_batched_tokens": "32"}, "below one chunk (64 tokens)"),
    ({"max_num_batched_tokens": "512"}, "set batched=true"),
    ({"shape": "tiny-moe", "weights_dtype": "bf16", "mem_cap_gib": "0.01"}, "fewer expert_banks hold less (now 8)"),
])
def test_bad_input_is_one_line_before_anything_is_allocated(given, says, tmp_path):
    out = tmp_path / "never"
    with pytest.raises(BadInput) as ex:
        experiments.plan("prefill_throughput", {"device": "cpu", "out_dir": str(out), **given})
    assert says in str(ex.value) and len(str(ex.value).splitlines()) == 1, str(ex.value)
    assert not out.exists()


def test_the_weights_counted_are_those_held():
    """W4A16 and expert banks: the formula's weights are the built model's (its matrices; the norms' and gates'
    vectors aside, under 2% at these widths), a plan's fits count them, and fewer banks count less."""
    for wd, banks in (("bf16", None), ("w4a16", None), ("w4a16", 2), ("bf16", 3)):
        m = HybridModel(MOE, CPU, weights_dtype=wd, expert_banks=banks)
        want = m.weight_bytes()
        got = held_weight_bytes(MOE, wd, m.expert_banks)
        assert 0 <= want - got <= 0.02 * want, (wd, banks, got, want)
    assert held_weight_bytes(MOE, "w4a16", 2) < held_weight_bytes(MOE, "w4a16", 8) < held_weight_bytes(MOE, "bf16", 8)
    p = experiments.plan("prefill_throughput", {"device": "cpu", "shape": "tiny-moe", "weights_dtype": "w4a16",
                                                "expert_banks": "2", "context_lens": "256", "prompts": "3"})
    assert (p.weights_dtype, p.expert_banks) == ("w4a16", 2)
    assert {f.weight_bytes for f in M.fits_of(p, MOE, 256).values()} == {held_weight_bytes(MOE, "w4a16", 2)}


def test_the_activation_formula_covers_experts_and_hyper_connections():
    """A DeltaNet-only `tiny-moe` (routed and shared experts, four hyper-connection copies) prefills one chunk of
    128 and of 384 tokens: the live bytes per extra token are the formula's (the hyper-connections' frames
    included) plus the prefix row and token id; without the hyper-connections' term it would be 15% short. The
    experts' live set (the device's grouped GEMMs) is counted beside it and is below it here and at the
    published shape, whose prefill peak stays in the DeltaNet layer or the split attention."""
    s = dataclasses.replace(MOE, name="tiny-moe-dn", layers=3)
    m = HybridModel(s, CPU, seed=0, weights_dtype="w4a16")
    peaks = {}
    for c in (128, 384):
        cache = OffloadCache.allocate(m, "host", 1, c)
        e = Engine(m, cache, get_strategy("zero_copy"), 64, prefill_chunk=c)
        with torch.inference_mode(), _LiveBytes() as live:
            e.prefill(0, torch.randint(0, s.vocab, (c,)))
        peaks[c] = live.peak
    slope = (peaks[384] - peaks[128]) / 256
    want = activation_bytes_per_token(s) + s.row_bytes + 8
    assert slope == pytest.approx(want, rel=0.03), (slope, want)
    assert abs(slope - (want - hc_frame_bytes_per_token(s))) > 0.1 * slope
    assert activation_bytes(s, 384, 384) == 384 * activation_bytes_per_token(s) + activation_fixed_bytes(s)
    ref = ModelShape.from_name("qwen3.8-flash-next")
    for shape in (s, ref):
        assert moe_activation_bytes_per_token(shape) < min(activation_bytes_per_token(shape),
                                                           fla_activation_bytes_per_token(shape))
    big = dataclasses.replace(s, experts_per_tok=16, expert_intermediate=1024)     # experts' peak: the max takes it
    assert activation_bytes(big, 256, 256) == 256 * moe_activation_bytes_per_token(big) + moe_activation_fixed_bytes(big)


@torch.inference_mode()
def test_a_batched_run_computes_what_one_at_a_time_computes():
    """The published shape's parts held as the plan entries hold them (W4A16, two expert banks): three prompts of
    160 tokens through two slots under a 256-token budget (forwards [p0, p1 to 96], [p1 from 96, p2]) leave bit
    for bit the logits and KV of one-request prefill cut where the batch cut each prompt (this CPU computes each
    row of a product alone), and the fit's bytes are the formula's terms."""
    m = HybridModel(MOE, CPU, seed=0, weights_dtype="w4a16", expert_banks=2)
    T = 160
    prompts = M.make_prompts(MOE, T, 3, seed=6, dev=CPU)
    f = dataclasses.replace(fit(MOE, T, 3, 1 << 40, "prefill", 256, batched=True,
                                weight_bytes=m.weight_bytes()), in_flight=2)
    assert f.per_forward == 2 and f.weight_bytes == m.weight_bytes()
    assert f.predicted_bytes == (m.weight_bytes() + 2 * slot_bytes(MOE, T, False) + prefix_bytes(MOE, T, False, 2)
                                 + activation_bytes(MOE, T, 256, batched=True, prompts=3)
                                 + 3 * (T * 8 + MOE.vocab * 2))
    b = M.Batch(m, "prefill", T, f)
    got = b.prefill_all(prompts)
    cache = OffloadCache.allocate(m, "host", 3, T)
    e = Engine(m, cache, get_strategy("zero_copy"), 2048, prefill_chunk=256)
    want = [e.prefill(0, prompts[0])]
    e.prefill(1, prompts[1][:96])
    want.append(e.prefill(1, prompts[1], start=96))
    want.append(e.prefill(2, prompts[2]))
    assert all(torch.equal(x, y) for x, y in zip(got, want)) and not torch.equal(got[0], got[2])
    kv = torch.empty_like(b.kv_rows(0))
    for layer in range(cache.pool.attn_layers):
        cache.read_prefix(layer, 2, T, kv[layer])
    assert torch.equal(b.kv_rows(0), kv)          # the third prompt went into the first prompt's slot


def test_the_claims_plan_entries_test_the_published_regime():
    """plans/claims.toml's three regime entries load and plan (on this CPU, their toy `[entry.cpu]` sizes), with
    the published shape, W4A16, batched forwards, a 24 GiB cap, every config and two repeats on a GPU."""
    from labkit.nightly import load_plan
    names = ["prefill-throughput-128k", "prefill-throughput-512k", "prefill-throughput-1m"]
    got = {e.name: e for e in load_plan(REPO / "plans" / "claims.toml", cuda=False, only=names)}
    assert sorted(got) == sorted(names)
    for name, (T, n) in zip(names, [("128K", 8), ("512K", 4), ("1M", 2)]):
        e = got[name]
        gpu = e.raw["parameters"]
        assert (gpu["shape"], gpu["weights_dtype"], gpu["batched"], gpu["mem_cap_gib"]) == (
            "qwen3.8-flash-next", "w4a16", True, 24)
        assert (gpu["context_lens"], gpu["prompts"], gpu["configs"]) == (T, n, "none,prefill,both")
        assert gpu["repeats"] >= 2 and e.timeout_s > 0
        assert e.plan.batched and e.plan.weights_dtype == "w4a16" and e.plan.max_num_batched_tokens >= e.plan.chunk
