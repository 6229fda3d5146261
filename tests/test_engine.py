"""Engine correctness on CPU (the same tests run on CUDA in test_gpu.py): every strategy against
`resident`, sparse with budget >= context against dense prefill, sparse attention against an independent
float64 softmax, DeltaNet fast paths against the loop, batched requests of different lengths against
each alone, bytes counted from what the strategies report moving."""
import math
import dataclasses

import pytest
import torch

from labkit.engine import Engine, HybridModel, OffloadCache, get_strategy
from labkit.engine.model.attention import sparse_decode_attention
from labkit.engine.model.kv import PageTable
from labkit.engine.model.layers import delta_rule_chunked, delta_rule_reference
from labkit.engine.transfer import STRATEGIES, LoadResult, TransferStrategy
from labkit.shapes import PRESETS
from labkit.engine.drive.runner import DecodeRunner

TINY = PRESETS["tiny"]
# A second shape: other head counts, GQA ratio, page-straddling rows.
ODD = dataclasses.replace(TINY, name="odd", layers=6, attn_every=3, n_heads=6, n_kv_heads=3, head_dim=16,
                          rotary_dim=4, index_dim=8, index_heads=3, dn_k_heads=1, dn_v_heads=2, hidden=48)


def _engine(model, strategy, slots, capacity, budget, page_size=16, chunk=64):
    st = get_strategy(strategy)
    cache = OffloadCache.allocate(model, st.medium, slots, capacity, page_size=page_size)
    return Engine(model, cache, st, budget, prefill_chunk=chunk)


def _tokens(n, vocab, seed):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


MOE = PRESETS["tiny-moe"]


@pytest.mark.parametrize("shape,weights", [(TINY, "bf16"), (ODD, "bf16"), (MOE, "bf16"), (MOE, "w4a16")],
                         ids=lambda v: getattr(v, "name", v))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_strategy_matches_resident(shape, weights, seed):
    g = torch.Generator().manual_seed(seed)
    lens = [int(x) for x in torch.randint(20, 300, (3,), generator=g)]
    budget = int(torch.randint(8, 64, (1,), generator=g))
    model = HybridModel(shape, "cpu", seed=seed, weights_dtype=weights, expert_banks=3 if shape.moe else None)
    out = {}
    for name in STRATEGIES:
        e = _engine(model, name, 3, 400, budget)
        for slot, n in enumerate(lens):
            e.prefill(slot, _tokens(n, shape.vocab, seed * 10 + slot))
        r = DecodeRunner(e, 3)
        logits, sels, rows = [], [], []
        for _ in range(3):
            r.step()
            logits.append(r.state.logits.clone())
            sels.append(r.state.last_sel.clone())
            rows.append(r.state.staging.clone())   # the last QSA layer's gathered bytes
        out[name] = (torch.stack(logits), torch.stack(sels), torch.stack(rows))
    ref = out["resident"]
    for name, (lg, sel, rows) in out.items():
        assert torch.equal(sel, ref[1]), f"{name}: different selection"
        assert torch.equal(rows, ref[2]), f"{name}: gathered bytes differ from resident"
        assert torch.equal(lg, ref[0]), f"{name}: logits differ from resident"


@pytest.mark.parametrize("block", [4, 8])
def test_block_selection_every_strategy_matches_resident(block):
    """select_block: every strategy (block_dma's one copy per run included) delivers resident's bytes, and
    what is selected is whole aligned blocks of `block` positions, the last one cut at the length."""
    g = torch.Generator().manual_seed(block)
    lens = [int(x) for x in torch.randint(40, 300, (3,), generator=g)]
    budget = 4 * block
    model = HybridModel(ODD, "cpu", seed=block)
    out = {}
    for name in STRATEGIES:
        st = get_strategy(name)
        cache = OffloadCache.allocate(model, st.medium, 3, 400, page_size=16)
        e = Engine(model, cache, st, budget, prefill_chunk=64, select_block=block)
        for slot, n in enumerate(lens):
            e.prefill(slot, _tokens(n, ODD.vocab, block * 10 + slot))
        r = DecodeRunner(e, 3)
        res = []
        for _ in range(3):
            r.step()
            res.append((r.state.logits.clone(), r.state.last_sel.clone(), r.state.last_valid.clone(),
                        r.state.staging.clone()))
        out[name] = res
    for name, res in out.items():
        for (lg, sel, val, rows), (lg0, sel0, val0, rows0) in zip(res, out["resident"]):
            assert torch.equal(sel, sel0) and torch.equal(rows, rows0) and torch.equal(lg, lg0), name
    for step, (_, sel, valid, _) in enumerate(out["resident"]):
        for b, n in enumerate(lens):
            length = n + step + 1                       # the prompt, the steps before, this step's token
            for layer in range(sel.shape[0]):
                s, v = sel[layer, b].view(-1, block), valid[layer, b].view(-1, block)
                kept = s[:, 0][v[:, 0]]
                assert (kept % block == 0).all()           # aligned blocks, in ascending order
                assert (kept.diff() > 0).all()
                want = (kept[:, None] + torch.arange(block)).clamp(max=length)
                got = torch.where(v, s, torch.full_like(s, length))[v[:, 0]]
                assert torch.equal(got, want)              # whole blocks; past the length not valid


def test_select_blocks_keeps_the_best_blocks():
    """Against a brute-force reference: the blocks kept are those with the largest best-position score."""
    from labkit.engine.model.select import select_blocks
    g = torch.Generator().manual_seed(0)
    B, L, block, k = 3, 203, 8, 40
    lens = torch.tensor([203, 150, 9])
    scores = torch.randn(B, L, generator=g)
    scores[torch.arange(L)[None, :] >= lens[:, None]] = float("-inf")
    pos, valid = select_blocks(scores, k, block, lens)
    for b in range(B):
        nb = -(-int(lens[b]) // block)
        best = [max(scores[b, i * block:min((i + 1) * block, L)].tolist()) for i in range(nb)]
        want = sorted(sorted(range(nb), key=lambda i: -best[i])[:k // block])
        got = sorted(set((pos[b][valid[b]] // block).tolist()))
        assert got == want
        assert int(valid[b].sum()) == sum(min(block, int(lens[b]) - i * block) for i in want)
        # what is not valid points at written rows (below the length), and a padding block is a whole run of
        # consecutive positions (one copy, as any block), not position 0 once per entry
        assert (pos[b][~valid[b]] < lens[b]).all()
    pad = ~valid[2].view(-1, block).any(-1)               # request 2 (9 tokens) has 2 blocks of the 5 kept
    assert int(pad.sum()) == 3 and (pos[2].view(-1, block)[pad] == torch.arange(block)).all()
    with pytest.raises(ValueError, match="multiple"):
        select_blocks(scores, 30, block, lens)


def test_select_block_is_checked():
    model = HybridModel(TINY, "cpu", seed=0)
    cache = OffloadCache.allocate(model, "host", 1, 64, page_size=16)
    for bad in (0, 3, 32):          # below 1; divides neither the budget 40 nor the page 16; not the budget 48
        with pytest.raises(ValueError, match="select_block"):
            Engine(model, cache, get_strategy("zero_copy"), 48 if bad != 3 else 40, select_block=bad)


def test_sparse_with_full_budget_equals_dense_prefill():
    """Decode with budget >= context (sparse path, recurrent DeltaNet step) == prefill of the same
    tokens (dense attention, chunked DeltaNet): the last token's logits agree within bf16 rounding."""
    model = HybridModel(TINY, "cpu", seed=3)
    toks = _tokens(150, TINY.vocab, 7)
    e = _engine(model, "zero_copy", 1, 256, budget=4096)
    e.prefill(0, toks[:-1])
    r = DecodeRunner(e, 1)
    r.state.tokens.copy_(toks[-1:])
    r.step()
    dec = r.state.logits[0].float()
    e2 = _engine(model, "resident", 1, 256, budget=4096, chunk=32)
    pre = e2.prefill(0, toks)[0].float()
    rel = (dec - pre).norm() / pre.norm()
    assert rel < 3e-2, rel
    for layer_sel in r.state.last_sel[:, 0]:      # every written position (149 + the new token) selected
        assert set(layer_sel.tolist()) == set(range(150))


def _attention_float64(q, rows, n_kv):
    """Decode attention written out head by head in float64: the independent reference."""
    B, Hq, D = q.shape
    out = torch.zeros(B, Hq, D, dtype=torch.float64)
    kv = rows.double().view(B, rows.shape[1], 2, n_kv, D)
    for b in range(B):
        for h in range(Hq):
            g = h // (Hq // n_kv)
            k, v = kv[b, :, 0, g], kv[b, :, 1, g]                 # [n, D]
            logits = (k @ q[b, h].double()) / math.sqrt(D)
            w = torch.exp(logits - logits.max())
            out[b, h] = (w / w.sum()) @ v
    return out


def test_sparse_attention_matches_float64_reference_and_masks():
    torch.manual_seed(0)
    q = torch.randn(2, 4, 32, dtype=torch.bfloat16)
    rows = torch.randn(2, 50, 2 * 2 * 32, dtype=torch.bfloat16)
    perm = torch.randperm(50)
    valid = torch.ones(2, 50, dtype=torch.bool)
    a = sparse_decode_attention(q, rows[:, perm], valid, 2)         # order of selected rows must not matter
    assert torch.allclose(a.double(), _attention_float64(q, rows, 2), atol=2e-2, rtol=2e-2)
    # masking: invalid rows contribute nothing, however large their logits
    valid2 = valid.clone(); valid2[:, 40:] = False
    poisoned = rows.clone(); poisoned[:, 40:] = 1e4
    c = sparse_decode_attention(q, poisoned, valid2, 2)
    assert torch.allclose(c.double(), _attention_float64(q, rows[:, :40], 2), atol=2e-2, rtol=2e-2)


def test_prefill_chunk_size_does_not_change_results():
    model = HybridModel(TINY, "cpu", seed=5)
    toks = _tokens(200, TINY.vocab, 9)
    a = _engine(model, "resident", 1, 256, 32, chunk=200).prefill(0, toks)
    b = _engine(model, "resident", 1, 256, 32, chunk=48).prefill(0, toks)
    assert ((a.float() - b.float()).norm() / a.float().norm()) < 3e-2


@pytest.mark.parametrize("seed", [0, 1])
def test_delta_rule_chunked_matches_loop(seed):
    g = torch.Generator().manual_seed(seed)
    T, H, dk, dv = 150, 3, 16, 8
    q = torch.nn.functional.normalize(torch.randn(T, H, dk, generator=g), dim=-1) * dk ** -0.5
    k = torch.nn.functional.normalize(torch.randn(T, H, dk, generator=g), dim=-1)
    v = torch.randn(T, H, dv, generator=g)
    log_a = -torch.rand(T, H, generator=g) * 0.5
    beta = torch.rand(T, H, generator=g)
    S0 = torch.randn(H, dk, dv, generator=g) * 0.1
    o_ref, S_ref = delta_rule_reference(q, k, v, log_a, beta, S0)
    for chunk in (16, 64):
        o, S = delta_rule_chunked(q, k, v, log_a, beta, S0, chunk=chunk)
        assert torch.allclose(o, o_ref, atol=1e-4, rtol=1e-4)
        assert torch.allclose(S, S_ref, atol=1e-4, rtol=1e-4)


def test_deltanet_step_matches_loop():
    model = HybridModel(TINY, "cpu", seed=0, dtype=torch.float32)
    layer = next(b.mixer for b in model.blocks if b.kind == "dn")
    (H, dk, dv), (C, K1) = layer.state_shapes()
    x = torch.randn(12, TINY.hidden)
    S = torch.zeros(1, H, dk, dv); conv = torch.zeros(1, C, K1)
    steps = torch.cat([layer.step(x[t:t + 1], S, conv) for t in range(12)])
    S2 = torch.zeros(H, dk, dv); conv2 = torch.zeros(C, K1)
    seq = layer.forward_seq(x, S2, conv2, chunk=4)
    assert torch.allclose(steps, seq, atol=1e-4, rtol=1e-3)
    assert torch.allclose(S[0], S2, atol=1e-5)
    assert torch.allclose(conv[0], conv2, atol=1e-5)


def test_batched_requests_of_different_lengths_equal_each_alone():
    model = HybridModel(TINY, "cpu", seed=1)
    lens = [37, 180]
    both = _engine(model, "zero_copy", 2, 256, 24)
    for s, n in enumerate(lens):
        both.prefill(s, _tokens(n, TINY.vocab, s))
    rb = DecodeRunner(both, 2)
    rb.step()
    for s, n in enumerate(lens):
        alone = _engine(model, "zero_copy", 1, 256, 24)
        alone.prefill(0, _tokens(n, TINY.vocab, s))
        ra = DecodeRunner(alone, 1)
        ra.state.tokens.copy_(rb.state.tokens[s:s + 1] * 0 + _first_token(2, TINY.vocab)[s])
        ra.step()
        assert torch.equal(ra.state.last_sel[:, 0], rb.state.last_sel[:, s])
        assert torch.allclose(ra.state.logits[0].float(), rb.state.logits[s].float(), atol=1e-2, rtol=1e-2)


def _first_token(batch, vocab):
    # DecodeState's seeded first tokens (what rb used before its step)
    return torch.randint(0, vocab, (batch,), generator=torch.Generator().manual_seed(batch))


def test_short_context_masks_unwritten_positions():
    """Context below the budget: exactly the written positions are valid, the rest masked."""
    model = HybridModel(TINY, "cpu", seed=2)
    e = _engine(model, "host_gather", 1, 128, budget=64)
    e.prefill(0, _tokens(20, TINY.vocab, 0))
    r = DecodeRunner(e, 1)
    r.step()
    assert r.state.k == 64
    for layer in range(model.n_attn):
        sel, valid = r.state.last_sel[layer, 0], r.state.last_valid[layer, 0]
        assert int(valid.sum()) == 21                                  # 20 prompt tokens + the new one
        assert sorted(sel[valid].tolist()) == list(range(21))
        assert (sel[~valid] == 0).all()                                # masked slots point at a real row


class Counting(TransferStrategy):
    """Moves rows like host_gather and counts them itself, independently of the runner's sums."""
    name, medium, graphable = "counting", "host", False

    def __init__(self):
        self.rows = 0

    def load(self, pool, layer, rows, out):
        self.rows += rows.numel()
        out.copy_(pool.data[layer][rows])
        return LoadResult(rows.numel(), rows.numel() * pool.row_bytes)


@pytest.mark.parametrize("conc,ctx,budget", [(1, 300, 64), (3, 300, 64), (2, 40, 64)])
def test_bytes_moved_are_summed_from_load_results(conc, ctx, budget):
    model = HybridModel(TINY, "cpu", seed=0)
    st = Counting()
    cache = OffloadCache.allocate(model, "host", conc, 400, page_size=16)
    cache.fill_random_([ctx] * conc, seed=1)
    r = DecodeRunner(Engine(model, cache, st, budget), conc)
    r.step()
    r.step()
    k = min(budget, cache.capacity)
    assert st.rows == 2 * r.rows_per_step                              # two steps counted by the strategy
    assert r.h2d_bytes_per_step == r.rows_per_step * TINY.row_bytes == conc * k * TINY.attn_layers * TINY.row_bytes
    if ctx >= budget:
        assert r.h2d_bytes_per_step == TINY.h2d_bytes_per_step(budget, [ctx] * conc)


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_each_strategy_reports_what_it_moved(name):
    model = HybridModel(TINY, "cpu", seed=0)
    st = get_strategy(name)
    cache = OffloadCache.allocate(model, st.medium, 2, 200, page_size=16)
    cache.fill_random_([150, 90], seed=1)
    r = DecodeRunner(Engine(model, cache, st, 32), 2)
    r.step()
    assert r.rows_per_step == 2 * 32 * TINY.attn_layers
    assert r.h2d_bytes_per_step == (0 if st.medium == "device" else r.rows_per_step * TINY.row_bytes)


def test_page_table_non_contiguous_pages_are_translated():
    pt = PageTable(n_pages=8, page_size=4, n_slots=2, max_pages_per_slot=4, device=torch.device("cpu"))
    pt.reserve(0, 8)          # pages 0,1
    pt.reserve(1, 8)          # pages 2,3
    pt.reserve(0, 16)         # pages 4,5 (slot 0 is no longer contiguous)
    rows = pt.rows(torch.tensor([0, 1]), torch.tensor([[0, 5, 9, 15], [0, 3, 4, 7]]))
    assert rows.tolist() == [[0, 5, 17, 23], [8, 11, 12, 15]]
    assert pt.runs(0, 0, 16) == [(0, 0, 8), (8, 16, 8)]
    assert pt.runs(0, 6, 10) == [(6, 6, 2), (8, 16, 2)]
    with pytest.raises(MemoryError):
        pt.reserve(1, 100)


def test_fragmented_pool_gives_same_outputs():
    """Requests whose pages interleave in the pool decode exactly like contiguous ones."""
    model = HybridModel(TINY, "cpu", seed=4)
    toks = [_tokens(90, TINY.vocab, i) for i in range(2)]
    outs = []
    for interleave in (False, True):
        e = _engine(model, "host_gather", 2, 128, 32, page_size=8)
        if interleave:   # grow both slots page by page so their pages alternate
            for n in range(8, 96, 8):
                e.cache.pages.reserve(0, n); e.cache.pages.reserve(1, n)
        for s in range(2):
            e.prefill(s, toks[s])
        r = DecodeRunner(e, 2)
        r.step()
        outs.append(r.state.logits.clone())
    assert torch.equal(outs[0], outs[1])


def test_engine_rejects_bad_budget_and_mismatched_pool():
    model = HybridModel(TINY, "cpu", seed=0)
    cache = OffloadCache.allocate(model, "host", 1, 64)
    with pytest.raises(ValueError, match="budget"):
        Engine(model, cache, get_strategy("zero_copy"), 0)
    with pytest.raises(ValueError, match="needs a device pool"):
        Engine(model, cache, get_strategy("resident"), 16)
    with pytest.raises(ValueError, match="unknown strategy"):
        get_strategy("warp")


def test_anatomy_accounts_for_the_step_on_cpu():
    """Eager anatomy: phases are non-negative, add up to the marked step, and runs of DeltaNet blocks
    are one interval each (fewer marks than blocks), their FFN split out at the QSA blocks' FFN time."""
    from labkit.engine.drive.runner import PHASES
    model = HybridModel(TINY, "cpu", seed=0)
    e = _engine(model, "zero_copy", 2, 400, 32)
    e.cache.fill_random_([300, 200], seed=1)
    r = DecodeRunner(e, 2)
    # One marked step: its phases must add up to it exactly. (Over several steps the medians of the parts
    # need not add up to the median of the sums: on a busy 2-core box they differed by 30%.)
    import time
    t0 = time.perf_counter()
    one = r.anatomy(repeats=1)
    wall_ms = (time.perf_counter() - t0) * 1e3
    assert sum(one[k] for k in PHASES) == pytest.approx(one["marked_step_ms"], rel=1e-9)
    assert 0.5 * wall_ms <= one["marked_step_ms"] <= wall_ms      # the marks cover the step, not a part of it
    anat = r.anatomy(repeats=3)
    phases = {k: anat[k] for k in PHASES}
    assert all(v >= 0 for v in phases.values()) and phases["weights"] > 0 and phases["deltanet"] > 0
    runs_of_dn = TINY.attn_layers                      # pattern dn,dn,dn,qsa: one DeltaNet run per QSA block
    assert anat["n_marks"] == runs_of_dn + 7 * TINY.attn_layers + 2      # 7 per QSA block, head, end
