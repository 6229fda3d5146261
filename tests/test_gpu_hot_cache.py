"""hot_cache on the GPU (marked `gpu`; run on the device host: `python3 -m pytest -m gpu -q tests/test_gpu_hot_cache.py`).

The CPU properties with the real mechanisms: the whole decode step captured in one CUDA graph, the
slots in HBM, misses read by the kernels from registered (pinned, mapped) host memory; the device
counters equal a CPU replay of the same selections through the same bookkeeping."""
import dataclasses

import pytest
import torch

from labkit.engine import Engine, HybridModel, OffloadCache, get_strategy
from labkit.engine.fused_attention import hot_sparse_attention, hot_sparse_attention_reference
from labkit.engine.hot_cache import COUNTERS, POLICIES, HotIndex
from labkit.engine.hot_gather import gather_hot_rows, gather_hot_rows_reference
from labkit.engine.kv import KVPool
from labkit.shapes import PRESETS

pytestmark = pytest.mark.gpu
REF = PRESETS["qwen3.8-flash-next"]
MID = dataclasses.replace(REF, name="mid", layers=8, vocab=4096)
LENS = [3000, 5000]
BUDGET = 512


def _run(model, name, steps=4, **settings):
    st = get_strategy(name, **settings)
    cache = OffloadCache.allocate(model, st.medium, 2, 6000)
    e = Engine(model, cache, st, budget=BUDGET, prefill_chunk=2048)
    for s, n in enumerate(LENS):
        e.prefill(s, torch.randint(0, MID.vocab, (n,), generator=torch.Generator().manual_seed(s)).cuda())
    r = e.decoder(2)
    r.prepare(warmup=0)                 # captured from the first step on
    assert r.graph_mode == "full", r.graph_mode
    res = []
    for _ in range(steps):
        r.step()
        res.append((r.state.logits.clone(), r.state.last_sel.clone(), r.state.staging.clone(),
                    r.state.rows_buf.clone(), None if name != "hot_cache" else st.index.step.clone()))
    torch.cuda.synchronize()
    return res, st


@pytest.fixture(scope="module")
def model():
    return HybridModel(MID, "cuda", seed=0)


@pytest.fixture(scope="module")
def resident(model):
    return _run(model, "resident")[0]


@pytest.mark.parametrize("capacity", [1, 300, 2 * BUDGET])
@pytest.mark.parametrize("policy", POLICIES)
def test_hot_cache_graph_matches_resident_on_cuda(model, resident, capacity, policy):
    res, st = _run(model, "hot_cache", hot_capacity=capacity, hot_policy=policy)
    for (lg, sel, rows, *_), (lg0, sel0, rows0, *_) in zip(res, resident):
        assert torch.equal(sel, sel0)
        assert torch.equal(rows, rows0)
        assert torch.equal(lg, lg0)
    c = st.counters()
    assert c["hits"] + c["misses"] > 0 and c["h2d_bytes"] == c["misses"] * MID.row_bytes


@pytest.mark.parametrize("capacity", [64, 2 * BUDGET])
def test_fused_graph_matches_resident_within_bf16(model, resident, capacity):
    res, st = _run(model, "hot_cache", hot_capacity=capacity, hot_fused=True)
    for (lg, sel, *_), (lg0, sel0, *_) in zip(res, resident):
        assert torch.equal(sel, sel0)
        rel = (lg.float() - lg0.float()).norm() / lg0.float().norm()
        assert rel < 3e-2, rel


@pytest.mark.parametrize("policy", POLICIES)
def test_device_counters_equal_a_cpu_replay(model, policy):
    """Counters of the captured steps == the same selections replayed through HotIndex on the CPU."""
    res, st = _run(model, "hot_cache", steps=6, hot_capacity=700, hot_policy=policy)
    idx = st.index
    cpu = HotIndex(idx.layers, idx.batch, idx.capacity, idx.n_rows, policy, "cpu")
    # the runner's warm-up and capture ran steps before the recorded ones: replay only the recorded
    # steps, on a fresh GPU index (the plan kernel) and a fresh CPU one (torch ops), both empty
    gpu = HotIndex(idx.layers, idx.batch, idx.capacity, idx.n_rows, policy, "cuda")
    assert gpu.kernel
    for *_, rows, _ in res:
        for layer in range(idx.layers):
            cpu.plan(layer, rows[layer].cpu(), MID.row_bytes)
            gpu.plan(layer, rows[layer], MID.row_bytes)
            assert torch.equal(cpu.step[layer], gpu.step[layer].cpu()), (policy, layer)
            S = idx.slots                           # (the trash entry S holds whatever masked writes left)
            assert torch.equal(cpu.slot_row[layer, :S], gpu.slot_row[layer, :S].cpu())
            assert torch.equal(cpu.rev[layer, :idx.n_rows], gpu.rev[layer, :idx.n_rows].cpu())
    assert dict(zip(COUNTERS, cpu.total.tolist())) == gpu.counters()


def test_hot_kernels_read_pinned_host_rows():
    g = torch.Generator().manual_seed(0)
    pool = KVPool("host", 1, 64, 256, REF.row_bytes, torch.device("cuda"))
    assert pool.pinned
    pool.data.view(torch.bfloat16).normal_(generator=g)
    src = pool.data[0]
    B, k, C, W = 2, 700, 300, REF.row_bytes // 8
    S = B * C
    slots0 = torch.randn(S + 1, 4 * W, generator=g).to(torch.bfloat16).view(torch.int64).cuda()
    rows = torch.randperm(src.shape[0], generator=g)[:B * k].cuda()
    slot = torch.where(torch.rand(B * k, generator=g) < 0.4, torch.randint(0, S, (B * k,), generator=g), -1).cuda()
    victim = torch.full((B * k,), -1, dtype=torch.int64)
    used = set(slot.tolist())
    free = [i for i in range(S) if i not in used]
    for j, f in zip((slot.cpu() < 0).nonzero()[:, 0].tolist(), free):
        victim[j] = f
    victim = victim.cuda()
    out = torch.empty((B * k, W), dtype=torch.int64, device="cuda")
    s1 = slots0.clone()
    gather_hot_rows(src, rows, s1, slot, victim, out)
    ref_out, s2 = torch.empty_like(out), slots0.clone()
    gather_hot_rows_reference(src, rows.cpu(), s2, slot, victim, ref_out)
    torch.cuda.synchronize()
    assert torch.equal(out, ref_out) and torch.equal(s1[:S], s2[:S])
    q = torch.randn(B, REF.n_heads, REF.head_dim, generator=g).to(torch.bfloat16).cuda()
    valid = torch.ones(B, k, dtype=torch.bool, device="cuda")
    valid[1, -50:] = False
    s1, s2 = slots0.clone(), slots0.clone()
    a = hot_sparse_attention(q, src, s1, rows, slot, victim, valid, REF.n_kv_heads)
    b = hot_sparse_attention_reference(q, src, s2, rows.cpu(), slot, victim, valid, REF.n_kv_heads)
    torch.cuda.synchronize()
    assert torch.equal(s1[:S], s2[:S])
    assert torch.allclose(a.float(), b.float(), atol=2e-2, rtol=2e-2)
