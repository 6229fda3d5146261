"""hot_cache on CPU: the correctness contract (same selections, same gathered bytes, same logits as
`resident`) across evictions, requests of different lengths, capacities from 1 row to more than the
budget and every policy; its counters against an independent slot-by-slot model in plain Python; hits
served from the device slots and only misses read from the host (shown by changing the host rows under
it); bad settings refused. The kernels run under TRITON_INTERPRET=1 against their references in a
subprocess (the variable must be set before triton is imported)."""
import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from labkit.experiments.decode_session import derive
from labkit.experiments import plan as plan_experiment


def plan(given):
    return derive(plan_experiment("decode", given))
from labkit.params import BadInput
from labkit.engine import Engine, HybridModel, OffloadCache, get_strategy
from labkit.engine.transfer.hot_cache import COUNTERS, LRFU_DECAY, POLICIES, HotIndex
from labkit.shapes import PRESETS
from labkit.engine.drive.runner import DecodeRunner

TINY = PRESETS["tiny"]
LENS = [70, 260, 150]          # three requests of different lengths
BUDGET = 32


def _tokens(n, seed):
    return torch.randint(0, TINY.vocab, (n,), generator=torch.Generator().manual_seed(seed))


def _decode(model, name, steps, **settings):
    st = get_strategy(name, **settings)
    cache = OffloadCache.allocate(model, st.medium, len(LENS), 320, page_size=16)
    e = Engine(model, cache, st, BUDGET, prefill_chunk=128)
    for slot, n in enumerate(LENS):
        e.prefill(slot, _tokens(n, slot))
    r = DecodeRunner(e, len(LENS))
    out = []
    for _ in range(steps):
        r.step()
        out.append((r.state.logits.clone(), r.state.last_sel.clone(), r.state.staging.clone(),
                    r.state.rows_buf.clone(), {k: int(v) for k, v in zip(COUNTERS, st.index.step.sum(0))}
                    if name == "hot_cache" else None))
    return out, st, r


@pytest.fixture(scope="module")
def model():
    return HybridModel(TINY, "cpu", seed=0)


@pytest.fixture(scope="module")
def resident(model):
    return _decode(model, "resident", 4)[0]


@pytest.mark.parametrize("capacity,policy", [(1, "lru"), (5, "lfu"), (BUDGET, "lrfu"), (BUDGET + 9, "lru"),
                                             (3 * BUDGET, "lfu"), (40, "lrfu")])
def test_hot_cache_matches_resident(model, resident, capacity, policy):
    out, st, _ = _decode(model, "hot_cache", 4, hot_capacity=capacity, hot_policy=policy)
    for (lg, sel, rows, _, _), (lg0, sel0, rows0, _, _) in zip(out, resident):
        assert torch.equal(sel, sel0), "selection differs from resident"
        assert torch.equal(rows, rows0), "gathered bytes differ from resident"
        assert torch.equal(lg, lg0), "logits differ from resident"
    c = st.counters()
    assert c["hits"] + c["misses"] == 4 * len(LENS) * BUDGET * TINY.attn_layers
    assert c["h2d_bytes"] == c["misses"] * TINY.row_bytes
    if capacity < BUDGET:
        assert c["evictions"] > 0, "a small cache must evict"
    for layer in range(TINY.attn_layers):
        for b in range(len(LENS)):
            assert len(st.index.resident_rows(layer, b)) <= capacity


def test_fused_path_matches_resident_within_bf16(model, resident):
    out, st, _ = _decode(model, "hot_cache", 4, hot_capacity=20, hot_fused=True)
    for (lg, sel, *_), (lg0, sel0, *_) in zip(out, resident):
        assert torch.equal(sel, sel0)
        rel = (lg.float() - lg0.float()).norm() / lg0.float().norm()
        assert rel < 3e-2, rel
    assert st.counters()["evictions"] > 0


@pytest.mark.parametrize("capacity,policy,fused", [(1, "lru", False), (5, "lfu", False), (40, "lrfu", False),
                                                   (20, "lru", True)])
def test_deferred_bookkeeping_equals_in_line(model, capacity, policy, fused):
    """Reading first (by reverse-index lookup) and choosing victims after (`defer`, the default) leaves
    exactly what choosing first leaves: logits, gathered rows, slots, index, keys and counters."""
    a, sa, _ = _decode(model, "hot_cache", 4, hot_capacity=capacity, hot_policy=policy, hot_fused=fused)
    b, sb, _ = _decode(model, "hot_cache", 4, hot_capacity=capacity, hot_policy=policy, hot_fused=fused,
                       hot_defer=False)
    assert sa.defer and not sb.defer
    for (lg, sel, rows, _, cnt), (lg0, sel0, rows0, _, cnt0) in zip(a, b):
        assert torch.equal(sel, sel0) and torch.equal(lg, lg0) and cnt == cnt0
        if not fused:                    # (the fused path writes no staging rows in line)
            assert torch.equal(rows, rows0)
    S, R = sa.index.slots, sa.index.n_rows
    assert torch.equal(sa.data[:, :S], sb.data[:, :S])
    for name in ("slot_row", "key"):
        assert torch.equal(getattr(sa.index, name)[:, :S], getattr(sb.index, name)[:, :S]), name
    assert torch.equal(sa.index.rev[:, :R], sb.index.rev[:, :R])
    assert sa.counters() == sb.counters() and sa.counters()["evictions"] + sa.counters()["hits"] > 0


class SlotModel:
    """The policy spelled out slot by slot in plain Python (one request, one layer): what the device
    counters must agree with."""

    def __init__(self, capacity, policy):
        self.C, self.policy = capacity, policy
        self.row = [None] * capacity
        self.key = [-1.0] * capacity
        self.where = {}
        self.clock = 0

    def step(self, rows):
        self.clock += 1
        hits = misses = ins = ev = 0
        seen, prot, new = set(), set(), []
        if self.policy == "lrfu":
            self.key = [x * LRFU_DECAY for x in self.key]
        for r in rows:
            if r in self.where:
                hits += 1
                i = self.where[r]
                if r not in seen:
                    prot.add(i)
                    if self.policy == "lru":
                        self.key[i] = float(self.clock)
                    elif self.policy == "lfu":
                        self.key[i] = (self.key[i] // 2**32 + 1) * 2**32 + self.clock
                    else:
                        self.key[i] += 1.0
            else:
                misses += 1
                if r not in seen:
                    new.append(r)
            seen.add(r)
        pri = [float("inf") if i in prot else self.key[i] for i in range(self.C)]
        free = [i for i in sorted(range(self.C), key=lambda i: (pri[i], i)) if pri[i] < float("inf")]
        victims = sorted(free[:len(new)])             # the lowest keys, then taken in slot order
        for r, i in zip(new, victims):
            if self.row[i] is not None:
                del self.where[self.row[i]]
                ev += 1
            self.row[i], self.where[r] = r, i
            self.key[i] = {"lru": float(self.clock), "lfu": 2.0**32 + self.clock, "lrfu": 1.0}[self.policy]
            ins += 1
        return {"hits": hits, "misses": misses, "inserts": ins, "evictions": ev}


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("capacity", [1, 6, 24, 50])
def test_counters_agree_with_a_slot_model(policy, capacity):
    """Overlapping selections with repeats (as masked entries repeat position 0), two requests."""
    g = torch.Generator().manual_seed(capacity)
    B, k, R, steps = 2, 16, 120, 12
    idx = HotIndex(2, B, capacity, R, policy)
    models = [[SlotModel(capacity, policy) for _ in range(B)] for _ in range(2)]
    base = [torch.randperm(60, generator=g)[:k] for _ in range(B)]
    for t in range(steps):
        for layer in range(2):
            rows = []
            for b in range(B):
                keep = base[b][torch.rand(k, generator=g) < 0.7]
                fresh = torch.randperm(60, generator=g)[:k]
                sel = torch.cat([keep, fresh])[:k].clone()
                sel[-2:] = 0                                    # repeats
                rows.append(sel + b * 60)                     # request b owns rows [60b, 60b + 60)
            base = [r[:k] - b * 60 for b, r in enumerate(rows)]
            flat = torch.cat(rows)
            idx.plan(layer, flat, row_bytes=8)
            want = dict.fromkeys(COUNTERS[:4], 0)
            for b in range(B):
                for key, v in models[layer][b].step(rows[b].tolist()).items():
                    want[key] += v
            got = dict(zip(COUNTERS, idx.step[layer].tolist()))
            assert {k_: got[k_] for k_ in want} == want, (t, layer)
            assert got["h2d_bytes"] == 8 * want["misses"]
            for b in range(B):
                assert idx.resident_rows(layer, b) == set(models[layer][b].where), (t, layer, b)
            # the reverse index points at exactly the slots that hold each row
            rev, srow = idx.rev[layer], idx.slot_row[layer, :idx.slots]
            held = (srow >= 0).nonzero()[:, 0]
            assert torch.equal(rev[srow[held]].long(), held)
            assert int((rev[:R] >= 0).sum()) == held.numel()


def test_hits_come_from_the_device_and_misses_from_the_host(model):
    """Change every host row behind the cache's back (not through `store`): the next step's hits
    still return the cached bytes, its misses return the new host bytes, and the number of rows that
    came back changed is exactly the misses the counters report."""
    st = get_strategy("hot_cache", hot_capacity=3 * BUDGET)
    cache = OffloadCache.allocate(model, "host", 1, 320, page_size=16)
    e = Engine(model, cache, st, BUDGET, prefill_chunk=128)
    e.prefill(0, _tokens(200, 5))
    r = DecodeRunner(e, 1)
    r.step()
    r.step()
    before = cache.pool.data.clone()
    cache.pool.data.bitwise_not_()                      # every host row now differs from its copy
    last = model.n_attn - 1
    r.step()
    rows = r.state.rows_buf[last]
    got = r.state.staging
    from_host = (got == cache.pool.data[last][rows]).all(1)
    from_slot = (got == before[last][rows]).all(1)
    assert torch.equal(from_host, ~from_slot)
    assert int(from_host.sum()) == int(st.index.step[last, 1])   # misses counted = rows read from host
    assert int(from_slot.sum()) == int(st.index.step[last, 0]) > 0
    cache.pool.data.copy_(before)


def test_store_refreshes_a_cached_row(model):
    st = get_strategy("hot_cache", hot_capacity=8)
    cache = OffloadCache.allocate(model, "host", 1, 64, page_size=16)
    cache.fill_random_([40], seed=0)
    st.bind(cache, 1, 4)
    rows = torch.tensor([3, 9, 17, 30])
    out = torch.empty(4, cache.row_words(), dtype=torch.int64)
    st.load(cache.pool, 0, rows, out)                    # all four now cached
    vals = torch.full((1, cache.row_words()), 7, dtype=torch.int64)
    st.store(cache.pool, 0, rows[1:2], vals)
    st.load(cache.pool, 0, rows, out)
    assert int(st.index.step[0, 0]) == 4                 # all hits ...
    assert torch.equal(out[1], vals[0])                  # ... and the hit returns the new bytes


@pytest.mark.parametrize("settings,msg", [({"hot_capacity": 0}, "capacity"), ({"hot_capacity": -3}, "capacity"),
                                          ({"hot_policy": "mru"}, "unknown policy")])
def test_bad_settings_are_refused(settings, msg):
    with pytest.raises(ValueError, match=msg):
        get_strategy("hot_cache", **settings)
    with pytest.raises(BadInput, match=msg):
        plan({"device": "cpu", "strategies": "hot_cache", **{k: str(v) for k, v in settings.items()}})


def test_capacity_beyond_device_memory_is_refused_in_plan():
    with pytest.raises(BadInput, match="hot_capacity"):
        plan({"device": "cpu", "strategies": "hot_cache", "hot_capacity": "1G", "concurrency": "4"})


SCRIPT = textwrap.dedent('''
    import torch
    from labkit.engine.model import gather
    from labkit.engine.transfer import hot_gather, hot_attention as fa
    assert gather.interpret_mode() and gather.HAVE_TRITON
    for seed, (B, k, n_kv, G, D, C) in enumerate([(2, 24, 2, 2, 16, 10), (1, 40, 1, 4, 32, 64), (3, 17, 3, 2, 16, 5)]):
        g = torch.Generator().manual_seed(seed)
        W, R, S = 2 * n_kv * D // 4, 200, B * C
        src = torch.randn(R, 4 * W, generator=g).to(torch.bfloat16).view(torch.int64)
        slots0 = torch.randn(S + 1, 4 * W, generator=g).to(torch.bfloat16).view(torch.int64)
        rows = torch.stack([torch.randperm(R, generator=g)[:k] for _ in range(B)]).view(-1)
        slot = torch.where(torch.rand(B * k, generator=g) < 0.5, torch.randint(0, S, (B * k,), generator=g), -1)
        victim = torch.full((B * k,), -1)
        free = [i for i in range(S) if i not in set(slot.tolist())]
        for j, f in zip((slot < 0).nonzero()[:, 0].tolist()[::2], free):
            victim[j] = f
        valid = torch.rand(B, k, generator=g) < 0.9
        valid[:, 0] = True
        q = torch.randn(B, n_kv * G, D, generator=g).to(torch.bfloat16)
        for rpp in (1, 4):
            s1, s2 = slots0.clone(), slots0.clone()
            o1 = torch.full((B * k, W), -1, dtype=torch.int64); o2 = o1.clone()
            hot_gather.gather_hot_rows(src, rows, s1, slot, victim, o1, rows_per_prog=rpp)
            hot_gather.gather_hot_rows_reference(src, rows, s2, slot, victim, o2)
            assert torch.equal(o1, o2), "gather_hot_rows: rows"
            assert torch.equal(s1[:S], s2[:S]), "gather_hot_rows: slots"
        rev = torch.full((R + 1,), -1, dtype=torch.int32)        # the lookup (deferred) variants
        hit_rows = rows[slot >= 0]
        rev[hit_rows] = slot[slot >= 0].to(torch.int32)
        o1 = torch.full((B * k, W), -1, dtype=torch.int64); o2 = o1.clone()
        s1, s2 = slots0.clone(), slots0.clone()
        hot_gather.gather_hot_rows(src, rows, s1, None, None, o1, rev=rev)
        slot_l = rev[rows].to(torch.int64)
        hot_gather.gather_hot_rows_reference(src, rows, s2, slot_l, torch.full_like(slot_l, -1), o2)
        assert torch.equal(o1, o2) and torch.equal(s1, slots0), "gather_hot_rows(rev=): rows, slots untouched"
        st1 = torch.full((B * k, W), -1, dtype=torch.int64)
        a = fa.hot_sparse_attention(q, src, s1, rows, None, None, valid, n_kv, rev=rev, stage=st1)
        b = fa.hot_sparse_attention_reference(q, src, s2, rows, slot_l, torch.full_like(slot_l, -1), valid, n_kv)
        miss = slot_l < 0
        assert torch.equal(st1[miss], src[rows[miss]]) and (st1[~miss] == -1).all(), "fused(rev=): staged misses"
        assert torch.equal(s1, slots0), "fused(rev=): slots untouched"
        assert (a.float() - b.float()).abs().max().item() <= 0.02 * b.float().abs().max().item() + 1e-2
        wr = torch.randperm(R, generator=g)[:6]                   # a step's new rows: half of them cached
        rv = torch.full((R + 1,), -1, dtype=torch.int32)
        rv[wr[:3]] = torch.randperm(S, generator=g)[:3].to(torch.int32)
        new = torch.randn(6, 4 * W, generator=g).to(torch.bfloat16).view(torch.int64)
        p1, p2, s1, s2 = src.clone(), src.clone(), slots0.clone(), slots0.clone()
        gather.scatter_rows(new, wr, p1, rev=rv, slots=s1)        # written, and their cached copies refreshed
        p2[wr] = new
        s2[rv[wr[:3]].long()] = new[:3]
        assert torch.equal(p1, p2) and torch.equal(s1[:S], s2[:S]), "scatter_rows(rev=): pool and cached copies"
        s1, s2 = slots0.clone(), slots0.clone()                  # the deferred inserts: kept rows only
        hot_gather.insert_rows(o1, victim, s1, rows_per_prog=4)
        s2.index_copy_(0, torch.where(victim >= 0, victim, S), o1)
        assert torch.equal(s1[:S], s2[:S]) and torch.equal(s1[S], slots0[S]), "insert_rows"
        for split, bn in ((16, 16), (32, 16)):
            s1, s2 = slots0.clone(), slots0.clone()
            a = fa.hot_sparse_attention(q, src, s1, rows, slot, victim, valid, n_kv, split=split, block_n=bn)
            b = fa.hot_sparse_attention_reference(q, src, s2, rows, slot, victim, valid, n_kv)
            assert torch.equal(s1[:S], s2[:S]), "fused: slots"
            err = (a.float() - b.float()).abs().max().item()
            assert err <= 0.02 * b.float().abs().max().item() + 1e-2, ("fused: attention", err)
    from labkit.engine.transfer.hot_cache import HotIndex
    from labkit.engine.transfer.hot_plan import hot_plan
    for policy, C in (("lru", 5), ("lfu", 1), ("lrfu", 24)):      # the plan kernel == HotIndex's torch ops
        g = torch.Generator().manual_seed(C)
        B, k, R = 2, 12, 80
        a, b = HotIndex(1, B, C, R, policy), HotIndex(1, B, C, R, policy)
        base = [torch.randperm(40, generator=g)[:k] for _ in range(B)]
        for t in range(4):
            rows = []
            for r in range(B):
                keep = base[r][torch.rand(k, generator=g) < 0.6]
                sel = torch.cat([keep, torch.randperm(40, generator=g)[:k]])[:k].clone()
                sel[-2:] = 0
                rows.append(sel + r * 40)
            base = [x - r * 40 for r, x in enumerate(rows)]
            flat = torch.cat(rows)
            s1, v1 = a.plan_reference(0, flat, 8)
            s2, v2 = hot_plan(b, 0, flat, 8)
            assert torch.equal(s1, s2) and torch.equal(v1, v2), (policy, C, t, "plan outputs")
            assert torch.equal(a.rev[:, :R], b.rev[:, :R]) and torch.equal(a.slot_row[:, :B * C], b.slot_row[:, :B * C])
            assert torch.equal(a.key[:, :B * C], b.key[:, :B * C]) and torch.equal(a.total, b.total), (policy, C, t)
    print("hot kernels ok")
''')


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
def test_hot_kernels_match_references_under_interpreter():
    p = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "TRITON_INTERPRET": "1"})
    assert p.returncode == 0 and "hot kernels ok" in p.stdout, p.stderr[-3000:]


def test_decode_point_records_what_the_hot_cache_moved():
    """One decode point through DecodeSession: per-step hits, misses and bytes are the device counters'
    means over the timed steps, and they add up to the selected rows."""
    from labkit.experiments.decode_session import DecodeSession
    pl = plan({"device": "cpu", "strategies": "hot_cache", "context_lens": "300", "budgets": "32",
               "concurrency": "2", "repeats": "1", "steps": "3", "anatomy": "false", "probe": "false",
               "prefill_lens": "", "hot_capacity": "40", "hot_policy": "lfu"})
    with DecodeSession(pl) as s:
        rec = s.measure(pl.points[0])
    assert rec["status"] == "ok", rec.get("error")
    assert rec["hot_hits_per_step"] + rec["hot_misses_per_step"] == rec["selected_rows_per_step"] == 2 * 32 * TINY.attn_layers
    assert rec["h2d_bytes_per_step"] == rec["hot_misses_per_step"] * TINY.row_bytes
    assert 0 <= rec["hot_hit_rate"] <= 1 and rec["hot_capacity"] == 40 and rec["hot_policy"] == "lfu"


FUSED_SCRIPT = textwrap.dedent('''
    import torch
    from labkit.engine import DecodeRunner, Engine, HybridModel, OffloadCache, get_strategy
    from labkit.engine.model import gather, norm_rows
    from labkit.shapes import PRESETS
    assert gather.interpret_mode()
    # the prefill's row kernels (residual add and norm, DeltaNet's gate) as eager's ops: every decode below prefills
    # the same prompts the same way, the decode steps' few rows never take those kernels, and the kernels are checked
    # against eager's ops under the interpreter in test_norm_rows.py (here they were nine tenths of the time)
    norm_rows.MIN_ROWS = 1 << 62
    T, LENS, K = PRESETS["tiny"], [70, 200], 32
    model = HybridModel(T, "cpu", seed=0)

    def decode(trace=None, steps=3, **kw):
        st = get_strategy("hot_cache", hot_capacity=20, **kw)
        c = OffloadCache.allocate(model, "host", 2, 256, page_size=16)
        e = Engine(model, c, st, K, prefill_chunk=256)
        for s, n in enumerate(LENS):
            e.prefill(s, torch.randint(0, T.vocab, (n,), generator=torch.Generator().manual_seed(s)))
        r = DecodeRunner(e, 2, trace=trace)
        out = []
        for t in range(steps):
            if trace is not None:
                r.state.tokens.copy_(torch.tensor([7 * t + 1, 11 * t + 3]))
            r.step()
            out.append((r.state.logits.clone(), r.state.last_sel.clone()))
        return out, st

    # 1. the H200 symptom: left to the indexer, QSA layer 0 selects the same rows (nothing before it
    #    differs), QSA layer 1 reads an attention output that is bf16-close, not bitwise, and may differ
    (split, _), (fused, _) = decode(steps=1), decode(steps=1, hot_fused=True)
    assert torch.equal(split[0][1][0], fused[0][1][0]), "first QSA layer of the first step must agree"
    diverged = any(not torch.equal(a[1], b[1]) for a, b in zip(split, fused))
    print("selections diverged:", diverged)
    # 2. the contract on the same selections: slots byte-identical, logits within bf16
    g = torch.Generator().manual_seed(0)
    tr = torch.stack([torch.stack([torch.randperm(70, generator=g)[:K] for _ in range(T.attn_layers)]) for _ in range(6)])
    tr[1:, :, :K // 2] = tr[:-1, :, :K // 2]          # half of each step's rows again: hits and misses
    (split, a), (fused, b) = decode(tr), decode(tr, hot_fused=True)
    for (l0, s0), (l1, s1) in zip(split, fused):
        assert torch.equal(s0, s1)
        assert ((l1.float() - l0.float()).norm() / l0.float().norm()).item() < 3e-2
    (fused0, c) = decode(tr, hot_fused=True, hot_defer=False)
    S = a.index.slots
    assert torch.equal(a.data[:, :S], b.data[:, :S]), "fused slot writes differ from the split gather's"
    assert torch.equal(c.data[:, :S], b.data[:, :S]), "in-line fused slot writes differ from the deferred ones"
    assert all(torch.equal(x[0], y[0]) for x, y in zip(fused, fused0)), "deferred fused logits differ from in-line"
    assert a.counters() == b.counters() == c.counters() and a.counters()["evictions"] > 0
    print("fused ok")
''')


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
def test_fused_decode_under_interpreter_on_the_same_selections():
    """The fused kernel in the decode step (TRITON_INTERPRET=1): reproduces the H200 'selections
    diverge' failure's cause (the indexer downstream of a bf16-close attention) and checks the
    contract where it holds, on replayed selections."""
    # DeltaNet's mixer as its torch definition: both decodes take the same one, and its kernel is checked against
    # that definition under the interpreter in test_deltanet_mix.py (here it was half of the kernels' time)
    p = subprocess.run([sys.executable, "-c", FUSED_SCRIPT], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "TRITON_INTERPRET": "1", "LABKIT_DN_FUSED": "0"})
    assert p.returncode == 0 and "fused ok" in p.stdout, p.stdout[-1000:] + p.stderr[-3000:]
    print(p.stdout.splitlines()[0])


def strategies_logits(out, device: str, context_lens: str) -> "pd.DataFrame":
    """One decode run over resident, zero_copy and hot_cache at `context_lens` and one and two requests: its rows."""
    import pandas as pd

    from labkit import experiments
    plan = experiments.plan("decode", {"device": device, "shape": "tiny", "context_lens": context_lens, "budgets": "32",
                                       "concurrency": "1,2", "strategies": "resident,zero_copy,hot_cache",
                                       "repeats": "1", "steps": "2", "prefill_lens": "", "probe": "false",
                                       "anatomy": "false", "out_dir": str(out)})
    experiments.run(plan, progress_bar=False)
    d = pd.read_parquet(out / "metrics.parquet")
    d = d[d["experiment"] == "decode"]
    assert (d["status"] == "ok").all() and len(d) == 12
    by_point = d.groupby(["context_len", "concurrency", "logits_after_steps"])["logits_sha"]
    assert (by_point.nunique() == 1).all(), d[["strategy", "context_len", "concurrency", "logits_sha"]]
    assert by_point.first().nunique() == 4
    return d


def test_a_decode_run_gives_every_strategy_the_resident_logits(tmp_path):
    """FlashOffloading's "the set of attended tokens does not change, only where it is stored": one decode run
    on the CPU over resident, zero_copy and hot_cache (the KV in another pool and read through another path) at
    two contexts and batches. Each point's `logits_sha` is the resident's at the same point and step count, and
    the points differ from each other (the hash sees the context: a constant would pass the first check)."""
    strategies_logits(tmp_path / "run", "cpu", "256,640")
