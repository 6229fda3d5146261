"""GPU-only checks (marked `gpu`): run on the device host with `pytest -m gpu`; results are committed
under results/ by the device session. The same properties as the CPU tests, with the real mechanisms:
registered (pinned) host memory read by the Triton zero-copy kernel, CUDA graphs, NVML counters."""
import dataclasses
import time

import pytest
import torch

from labkit.engine import Engine, HybridModel, OffloadCache, get_strategy
from labkit.engine.model.gather import gather_rows, scatter_rows
from labkit.engine.model.kv import KVPool
from labkit.engine.model.layers import delta_rule_chunked, delta_rule_reference
from labkit.engine.transfer import STRATEGIES
from labkit.shapes import PRESETS
from labkit.engine.drive.runner import DecodeRunner

pytestmark = pytest.mark.gpu
REF = PRESETS["qwen3.8-flash-next-standin"]
# The reference layout with fewer layers and a smaller vocabulary: same head dims, row and key bytes.
MID = dataclasses.replace(REF, name="mid", layers=8, vocab=4096)


@pytest.mark.parametrize("seed", [0, 1])
def test_zero_copy_kernel_reads_pinned_host_rows(seed):
    g = torch.Generator().manual_seed(seed)
    pool = KVPool("host", 3, 64, 256, 2048, torch.device("cuda"))
    assert pool.pinned
    pool.data.random_(generator=g)
    rows = torch.randint(0, pool.data.shape[1], (3 * 777,), generator=g)
    src = pool.data.view(-1, 256)
    for rpp, nw in [(1, 4), (4, 4), (8, 8)]:
        out = torch.full((rows.numel(), 256), -1, dtype=torch.int64, device="cuda")
        gather_rows(src, rows.cuda(), out, rows_per_prog=rpp, num_warps=nw)
        assert torch.equal(out.cpu(), src[rows])
    vals = torch.randint(-2**62, 2**62, (5, 256), generator=g).cuda()
    wr = torch.tensor([3, 99, 1000, 5000, 16000]).cuda()
    scatter_rows(vals, wr, src)
    torch.cuda.synchronize()
    assert torch.equal(src[wr.cpu()], vals.cpu())


@pytest.mark.parametrize("seed,select_block", [(0, 1), (1, 1), (0, 16)])
def test_every_strategy_matches_resident_on_cuda(seed, select_block):
    """Captured graphs (whole or piecewise) from the first step; select_block=16 adds block selection
    inside the capture and block_dma's one copy per 16-row block."""
    model = HybridModel(MID, "cuda", seed=seed)
    g = torch.Generator().manual_seed(seed)
    lens = [3000 + seed * 777, 5000]
    out = {}
    for name in STRATEGIES:
        st = get_strategy(name)
        cache = OffloadCache.allocate(model, st.medium, 2, 6000)
        e = Engine(model, cache, st, budget=512, prefill_chunk=2048, select_block=select_block)
        for s, n in enumerate(lens):
            e.prefill(s, torch.randint(0, MID.vocab, (n,), generator=torch.Generator().manual_seed(s + 10 * seed)).cuda())
        r = DecodeRunner(e, 2)
        r.prepare(warmup=0)     # captured graphs (full or piecewise) from the first step on
        res = []
        for _ in range(3):
            r.step()
            res.append((r.state.logits.clone(), r.state.last_sel.clone(), r.state.staging.clone()))
        torch.cuda.synchronize()
        out[name] = res
    for name, res in out.items():
        for (lg, sel, rows), (lg0, sel0, rows0) in zip(res, out["resident"]):
            assert torch.equal(sel, sel0), name
            assert torch.equal(rows, rows0), name
            assert torch.equal(lg, lg0), name


@pytest.mark.parametrize("seed", [0, 1])
def test_index_kernel_matches_reference(seed):
    from labkit.engine.model.indexer import index_scores_reference, index_scores_triton
    from labkit.engine.model.kv import quantize_index_keys
    g = torch.Generator(device="cuda").manual_seed(seed)
    B, cap, L, Hi, D = 3, 5000, 4321, 4, 64
    k8, sc = quantize_index_keys(torch.randn(B, cap, D, generator=g, device="cuda"))
    q = torch.randn(B, Hi, D, generator=g, device="cuda").to(torch.bfloat16)
    w = torch.randn(B, Hi, generator=g, device="cuda").to(torch.bfloat16)
    lens = torch.tensor([4321, 17, 3000], device="cuda")
    a = index_scores_triton(q, w, k8[:, :L], sc[:, :L], lens)
    b = index_scores_reference(q, w, k8[:, :L], sc[:, :L], lens)
    fin = torch.isfinite(b)
    assert torch.equal(fin, torch.isfinite(a))
    assert torch.allclose(a[fin], b[fin], rtol=2e-2, atol=1e-2 * b[fin].abs().max().item())


def test_graph_replay_equals_eager():
    model = HybridModel(MID, "cuda", seed=3)
    logits = []
    for graphs in (False, True):
        st = get_strategy("zero_copy")
        cache = OffloadCache.allocate(model, "host", 1, 4096)
        cache.fill_random_([3000], seed=1)
        r = DecodeRunner(Engine(model, cache, st, 256), 1, graphs=graphs)
        r.prepare(warmup=1)
        r.step(); r.step()
        logits.append(r.state.logits.clone())
    assert torch.equal(logits[0], logits[1])


def test_compiled_blocks_match_eager():
    model = HybridModel(MID, "cuda", seed=5)
    logits = []
    for compile in (False, True):
        cache = OffloadCache.allocate(model, "host", 2, 4096)
        cache.fill_random_([3000, 1000], seed=2)
        r = DecodeRunner(Engine(model, cache, get_strategy("zero_copy"), 512, compile=compile), 2)
        assert r.engine.fns.compiled == compile
        r.prepare(warmup=1)
        r.step()
        logits.append(r.state.logits.float().clone())
    rel = ((logits[0] - logits[1]).norm() / logits[0].norm()).item()
    assert rel < 3e-2, rel


def test_full_budget_decode_equals_dense_prefill_on_cuda():
    model = HybridModel(MID, "cuda", seed=4)
    toks = torch.randint(0, MID.vocab, (1500,), generator=torch.Generator().manual_seed(0)).cuda()
    e = Engine(model, OffloadCache.allocate(model, "host", 1, 2048), get_strategy("zero_copy"), 4096, prefill_chunk=512)
    e.prefill(0, toks[:-1])
    r = DecodeRunner(e, 1)
    r.state.tokens.copy_(toks[-1:])
    r.step()
    pre = Engine(model, OffloadCache.allocate(model, "device", 1, 2048), get_strategy("resident"), 4096,
                 prefill_chunk=1024).prefill(0, toks)[0].float()
    rel = ((r.state.logits[0].float() - pre).norm() / pre.norm()).item()
    assert rel < 3e-2, rel


def test_delta_rule_chunked_on_cuda():
    g = torch.Generator(device="cuda").manual_seed(0)
    T, H, dk, dv = 700, 32, 128, 128
    q = torch.nn.functional.normalize(torch.randn(T, H, dk, generator=g, device="cuda"), dim=-1) * dk ** -0.5
    k = torch.nn.functional.normalize(torch.randn(T, H, dk, generator=g, device="cuda"), dim=-1)
    v = torch.randn(T, H, dv, generator=g, device="cuda")
    log_a = -torch.rand(T, H, generator=g, device="cuda") * 0.3
    beta = torch.rand(T, H, generator=g, device="cuda")
    S0 = torch.randn(H, dk, dv, generator=g, device="cuda") * 0.1
    torch.backends.cuda.matmul.allow_tf32 = False
    o_ref, S_ref = delta_rule_reference(q, k, v, log_a, beta, S0)
    o, S = delta_rule_chunked(q, k, v, log_a, beta, S0)
    assert ((o - o_ref).norm() / o_ref.norm()) < 1e-4
    assert ((S - S_ref).norm() / S_ref.norm()) < 1e-4


def test_nvml_counts_gather_and_dma_bytes():
    """NVML's unwrapped RX counter against known payloads. DMA (copy engine, 256 B TLPs) reads ~8% over
    payload on the H200 host; SM-issued zero-copy reads travel in smaller completions, ~19% over."""
    from labkit.telemetry import Sampler
    pool = KVPool("host", 1, 4096, 256, 2048, torch.device("cuda"))   # 2 GiB registered
    pool.data[0, ::97].random_()
    src = pool.data[0]
    rows = torch.randint(0, src.shape[0], (24576,), device="cuda")
    out = torch.empty((rows.numel(), 256), dtype=torch.int64, device="cuda")
    gather_rows(src, rows, out)
    torch.cuda.synchronize()
    with Sampler(gpus=[0]) as tel:
        if not tel.enabled:
            pytest.skip(tel.reason)
        time.sleep(0.05)
        a = tel.mark()
        n = 200
        for _ in range(n):
            gather_rows(src, rows, out)
        torch.cuda.synchronize()
        b = tel.mark()
        c = tel.mark()
        for _ in range(20):
            out.copy_(src[: rows.numel()], non_blocking=True)
        torch.cuda.synchronize()
        d = tel.mark()
    moved = n * rows.numel() * 2048
    zc = tel.rx_bytes(a, b) / moved
    dma = tel.rx_bytes(c, d) / (20 * rows.numel() * 2048)
    print(f"NVML RX / payload: zero-copy gather {zc:.3f}, DMA {dma:.3f}")
    assert 1.0 < dma < 1.15, dma
    assert 1.0 < zc < 1.25, zc
    assert tel.max_gap_s < 0.078          # never a full counter wrap between reads
    df = tel.frame()
    assert {"pcie_rx_gbps", "pcie_rx_sample_gbps", "util_gpu", "mem_used_bytes", "power_w", "pcie_gen"} <= set(df.columns)
    assert df["pcie_rx_gbps"].max() > 20          # the gathers ran at tens of GB/s while sampled
    assert df["pcie_rx_sample_gbps"].notna().any()


@pytest.mark.parametrize("n_dev", [1, 2, 3])
def test_pipeline_matches_single_gpu(n_dev):
    """N=1 runs on the one-GPU host (the stage path: hand-off buffers, per-stage pools); N>1 needs N GPUs."""
    from labkit.engine.drive.pipeline import PipelineEngine, model_block_costs, place_layers, split_model
    if torch.cuda.device_count() < n_dev:
        pytest.skip(f"needs {n_dev} GPUs, this host has {torch.cuda.device_count()}")
    toks = torch.randint(0, MID.vocab, (3000,), generator=torch.Generator().manual_seed(0))
    # the one-device reference: the same CPU-initialised weights as a single stage on cuda:0, plain Engine
    ref_model = split_model(HybridModel(MID, "cpu", seed=9), [(0, MID.layers)], ["cuda:0"])[0]
    e = Engine(ref_model, OffloadCache.allocate(ref_model, "host", 1, 4096), get_strategy("zero_copy"), 512)
    e.prefill(0, toks.cuda())
    r = DecodeRunner(e, 1); r.prepare(1); r.step()
    model = HybridModel(MID, "cpu", seed=9)
    stages = split_model(model, place_layers(model_block_costs(model, 512), n_dev), [f"cuda:{i}" for i in range(n_dev)])
    pipe = PipelineEngine(stages, "zero_copy", 512, n_slots=1, capacity=4096)
    pipe.prefill(0, toks)
    pr = pipe.decoder(1); pr.prepare(1); pr.step()
    torch.cuda.synchronize()
    assert torch.equal(pr.state.logits.cpu(), r.state.logits.cpu())


def test_sweep_on_the_default_cuda_device(tmp_path):
    """The sweep with device=auto ("cuda", no index) runs every strategy (a regression once: set_device)."""
    from labkit import experiments
    from labkit.results import load_run
    r = experiments.measure("decode", dict(device="auto", shape="tiny", context_lens="300", budgets="64", concurrency="1,2", repeats=1,
                       steps=2, prefill_lens="512", probe=False, per_row_steps=1, out_dir=str(tmp_path / "r")),
                  progress_bar=False)
    m = load_run(r.path).metrics
    assert (m["status"] == "ok").all(), m["error"].dropna().tolist()


@pytest.mark.parametrize("B,L,k", [(1, 1 << 20, 2048), (16, 1 << 20, 2048), (4, 65536 + 77, 2048), (16, 8192, 2048), (2, 3000, 3000)])
def test_radix_select_matches_reference_on_cuda(B, L, k):
    from labkit.engine.model.select import bound_run, select_topk_reference, select_topk_triton
    g = torch.Generator(device="cuda").manual_seed(B)
    s = torch.randn(B, L, generator=g, device="cuda")
    s[0, L // 2:] = float("-inf")                                   # a request with fewer tokens written
    if B > 1:
        s[1] = torch.randint(0, 3, (L,), generator=g, device="cuda").float()   # massive ties
    rpos, rvalid = select_topk_reference(s, k)
    for bound in (None, False, True):          # the default; the plain passes; the run-maxima bound forced
        if bound and not bound_run(B, L, k, force=True):
            continue
        pos, valid = select_topk_triton(s, k, bound=bound)
        assert torch.equal(pos, rpos) and torch.equal(valid, rvalid), bound


def test_bounded_select_on_rising_and_ascending_scores_on_cuda():
    """Batch 16 x 1M, where the bound is on by default: scores rising with position (the best at the end,
    so the bound is looser) and strictly ascending ones (its candidates overflow: the rows are read whole)."""
    from labkit.engine.model.select import bound_run, select_topk_reference, select_topk_triton
    B, L, k = 16, 1 << 20, 2048
    assert bound_run(B, L, k) == 256
    g = torch.Generator(device="cuda").manual_seed(3)
    s = torch.randn(B, L, generator=g, device="cuda") + torch.linspace(0, 6, L, device="cuda")
    s[B // 2:] = torch.arange(L, device="cuda", dtype=torch.float32)
    pos, valid = select_topk_triton(s, k)
    rpos, rvalid = select_topk_reference(s, k)
    assert torch.equal(pos, rpos) and torch.equal(valid, rvalid)
    # the candidate count per row against its definition (a count off would only cost time, not change
    # the selection: a row over its cap is read whole): rising rows fit, ascending ones overflow
    from labkit.engine.model import select
    cap, sub = select.candidate_cap(L), 256
    cnt = torch.zeros(B, dtype=torch.int32, device="cuda")
    select._bounded_candidates(s, k, 2048, L // 2048, sub, cap,
                               torch.zeros(4 * B * 256, dtype=torch.int32, device="cuda"), cnt, 4)
    key = select.order_keys(s)
    lb = torch.topk(key.view(B, -1, sub).amax(-1), k, dim=-1).values[:, -1:]
    assert torch.equal(cnt.long(), (key >= lb).sum(-1))
    assert bool((cnt[:B // 2] <= cap).all()) and bool((cnt[B // 2:] > cap).all())


def test_anatomy_phases_add_up_to_the_graph_step():
    """The phases of a marked graph replay sum to the marked step by construction; the marks must not
    move the step by more than 5% against an unmarked replay."""
    from labkit.stats import spread
    model = HybridModel(PRESETS["tiny"], "cuda", seed=0)
    st = get_strategy("zero_copy")
    cache = OffloadCache.allocate(model, st.medium, 2, 4096)
    cache.fill_random_([3000, 2000], seed=1)
    r = DecodeRunner(Engine(model, cache, st, 256), 2, max_steps=200)
    r.prepare()
    times = []
    for _ in range(30):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); r.step(); b.record(); torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    anat = r.anatomy(repeats=5)
    phases = sum(v for k, v in anat.items() if k not in ("marked_step_ms", "mark_us", "n_marks"))
    # the phases are the marked intervals less one measured mark cost each
    expect = anat["marked_step_ms"] - anat["mark_us"] / 1e3 * (anat["n_marks"] - 1)
    assert abs(phases - expect) < 2e-2 * anat["marked_step_ms"]
    assert anat["selection"] > 0 and anat["transfer"] > 0 and anat["weights"] > 0
    print(f"anatomy tiny: marked {anat['marked_step_ms']:.3f} ms vs step {spread(times).median:.3f} ms")


@pytest.mark.parametrize("B", [1, 4])
def test_delta_step_kernel_matches_reference_on_cuda(B):
    from labkit.engine.model.deltanet_step import delta_step, delta_step_reference
    g = torch.Generator(device="cuda").manual_seed(B)
    S = torch.randn(B, 32, 128, 128, generator=g, device="cuda") * 0.05
    q, k = (torch.nn.functional.normalize(torch.randn(B, 16, 128, generator=g, device="cuda"), dim=-1) for _ in range(2))
    v = torch.randn(B, 32, 128, generator=g, device="cuda")
    la, beta = -torch.rand(B, 32, generator=g, device="cuda"), torch.rand(B, 32, generator=g, device="cuda")
    S2 = S.clone()
    o, o2 = delta_step(S, q, k, v, la, beta), delta_step_reference(S2, q, k, v, la, beta)
    assert torch.allclose(o, o2, atol=1e-4, rtol=1e-3) and torch.allclose(S, S2, atol=1e-5, rtol=1e-4)


def test_probe_weight_products_cover_every_matrix_and_path():
    """The probe's `weight_product` rows: each matrix of the shape at M = 1, 4, 16 through cuBLAS and the
    lab's GEMV, bytes the matrix's, a positive bandwidth; the GEMV switch is left as it was."""
    from labkit.experiments.probe.measure import probe_weights
    from labkit.engine.model import gemv as G
    before = G.mode()
    rows = probe_weights(torch.device("cuda"), repeats=4, shape="tiny")
    wm = PRESETS["tiny"].weight_matrices()
    assert {(r["matrix"], r["M"], r["path"]) for r in rows} == {(n, M, p) for n in wm for M in (1, 4, 16)
                                                               for p in ("cublas", "gemv")}
    for r in rows:
        K, N, count = wm[r["matrix"]]
        assert r["bytes"] == K * N * 2 and r["gbps"] > 0 and r["matrices_per_step"] == count and r["copies"] >= 1
    assert G.mode() == before
