"""The hot cache's bookkeeping of one layer's step as one Triton kernel (a program per request), the
same function as `HotIndex.plan`'s torch ops (its reference; `tests/test_hot_cache.py` checks them
equal, state and outputs, under TRITON_INTERPRET=1). The torch version is ~60 small kernels a layer,
~700 graph nodes a step of the reference shape; this is one (plus two tiny counter reductions).

Per request b (rows `rows[b*K:(b+1)*K]`, slots `[b*C, (b+1)*C)`), in the order of `HotIndex.plan`:
lookup in the reverse index; first occurrences through `owner` (atomic min of the entry index, then
reset); keys of first-occurrence hits touched and their slots protected; victims: the m = min(new
misses, unprotected slots) lowest (key, slot) slots, found by bisecting (count passes, no sort) on the
keys as int64: lru and lfu keys are whole numbers, so their values, and the passes are log2 of the
free keys' span (~10 for lru, where the span is the steps since the oldest use: one pass is a block-wide
reduction, and the 64 passes of the bit image cost ~4x the rest of the kernel); lrfu's fractional keys
through an order-preserving int64 image of their bits (up to 64 passes); listed in slot order through a scratch row; the
i-th new miss takes the i-th; old rows leave the reverse index, new rows enter it; per-request counts.
Barriers (`tl.debug_barrier`) separate the phases that read what other threads of the program wrote.
"""
from __future__ import annotations

import torch

from ..model.arch import HAVE_TRITON

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _hot_plan_kernel(rows_ptr, rev_ptr, srow_ptr, key_ptr, prot_ptr, owner_ptr, list_ptr, clk_ptr,
                         slot_ptr, victim_ptr, cnt_ptr, K, C, ROW_BYTES, DECAY,
                         POLICY: tl.constexpr, BK: tl.constexpr, BC: tl.constexpr):
        b = tl.program_id(0)
        BIG: tl.constexpr = 0x7FFFFFFFFFFFFFFF
        UNIT: tl.constexpr = 4294967296.0
        kk = tl.arange(0, BK)
        km = kk < K
        idx = b * K + kk
        rows = tl.load(rows_ptr + idx, mask=km, other=0)
        s = tl.load(rev_ptr + rows, mask=km, other=-1).to(tl.int64)
        hit = km & (s >= 0)
        tl.atomic_min(owner_ptr + rows, kk.to(tl.int64), mask=km)
        tl.debug_barrier()
        firstv = tl.load(owner_ptr + rows, mask=km, other=-1, volatile=True)
        first = km & (firstv == kk)
        tl.debug_barrier()
        tl.store(owner_ptr + rows, tl.full([BK], BIG, tl.int64), mask=km)
        new = km & (s < 0) & first
        th = hit & first
        clk = tl.load(clk_ptr)
        cc = tl.arange(0, BC)
        cm = cc < C
        base = b * C
        tl.store(prot_ptr + base + cc, tl.zeros([BC], tl.int8), mask=cm)
        if POLICY == 2:
            kv = tl.load(key_ptr + base + cc, mask=cm, other=0.0)
            tl.store(key_ptr + base + cc, kv * DECAY, mask=cm)
        tl.debug_barrier()
        tl.store(prot_ptr + s, tl.full([BK], 1, tl.int8), mask=th)
        if POLICY == 0:
            tl.store(key_ptr + s, tl.zeros([BK], tl.float64) + clk, mask=th)
        elif POLICY == 1:
            ko = tl.load(key_ptr + s, mask=th, other=0.0, volatile=True)
            tl.store(key_ptr + s, (tl.floor(ko / UNIT) + 1.0) * UNIT + clk, mask=th)
        else:
            ko = tl.load(key_ptr + s, mask=th, other=0.0, volatile=True)
            tl.store(key_ptr + s, ko + 1.0, mask=th)
        tl.debug_barrier()
        pk = tl.load(key_ptr + base + cc, mask=cm, other=0.0, volatile=True)
        pr = tl.load(prot_ptr + base + cc, mask=cm, other=1, volatile=True)
        free = cm & (pr == 0)
        m = tl.minimum(tl.sum(new.to(tl.int32), 0), tl.sum(free.to(tl.int32), 0))
        if POLICY == 2:
            bits = pk.to(tl.int64, bitcast=True)
            skey = tl.where(bits < 0, bits ^ BIG, bits)            # order-preserving image of the key
        else:
            skey = pk.to(tl.int64)      # lru/lfu keys are whole numbers below 2^53: the value is exact
        lo = tl.min(tl.where(free, skey, BIG), 0)
        hi = tl.max(tl.where(free, skey, -BIG), 0)
        while lo < hi:                  # smallest T with #(skey <= T) >= m; log2(hi - lo) passes
            mid = (lo >> 1) + (hi >> 1) + (lo & hi & 1)
            cnt = tl.sum((free & (skey <= mid)).to(tl.int32), 0)
            go = cnt >= m
            hi = tl.where(go, mid, hi)
            lo = tl.where(go, lo, mid + 1)
        below = free & (skey < hi)
        need = m - tl.sum(below.to(tl.int32), 0)
        eq = free & (skey == hi)
        chosen = below | (eq & (tl.cumsum(eq.to(tl.int32), 0) <= need))
        chosen = chosen & ((tl.zeros([BC], tl.int32) + m) > 0)
        at = tl.cumsum(chosen.to(tl.int32), 0) - 1
        tl.store(list_ptr + base + at, cc.to(tl.int64), mask=chosen)
        tl.debug_barrier()
        rank = tl.cumsum(new.to(tl.int32), 0) - 1
        ok = new & (rank < m)
        vloc = tl.load(list_ptr + base + rank, mask=ok, other=0, volatile=True)
        victim = tl.where(ok, base + vloc, -1)
        old = tl.load(srow_ptr + victim, mask=ok, other=-1)
        rold = tl.load(rev_ptr + old, mask=ok & (old >= 0), other=-1).to(tl.int64)
        ev = ok & (old >= 0) & (rold == victim)
        tl.debug_barrier()
        tl.store(rev_ptr + old, tl.full([BK], -1, tl.int32), mask=ev)
        tl.debug_barrier()
        tl.store(rev_ptr + rows, victim.to(tl.int32), mask=ok)
        tl.store(srow_ptr + victim, rows, mask=ok)
        if POLICY == 0:
            ins = tl.zeros([BK], tl.float64) + clk
        elif POLICY == 1:
            ins = tl.zeros([BK], tl.float64) + (clk + UNIT)
        else:
            ins = tl.full([BK], 1.0, tl.float64)
        tl.store(key_ptr + victim, ins, mask=ok)
        tl.store(slot_ptr + idx, s, mask=km)
        tl.store(victim_ptr + idx, victim, mask=km)
        n_miss = tl.sum((km & (s < 0)).to(tl.int64), 0)
        tl.store(cnt_ptr + b * 5 + 0, tl.sum(hit.to(tl.int64), 0))
        tl.store(cnt_ptr + b * 5 + 1, n_miss)
        tl.store(cnt_ptr + b * 5 + 2, tl.sum(ok.to(tl.int64), 0))
        tl.store(cnt_ptr + b * 5 + 3, tl.sum(ev.to(tl.int64), 0))
        tl.store(cnt_ptr + b * 5 + 4, n_miss * ROW_BYTES)


POLICY_ID = {"lru": 0, "lfu": 1, "lrfu": 2}


def hot_plan(index, layer: int, rows: torch.Tensor, row_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`HotIndex.plan` as one kernel launch (the caller checks that Triton can run here)."""
    B, C = index.batch, index.capacity
    M = rows.numel()
    K = M // B
    clk = index.clock[layer:layer + 1]
    clk.add_(1)
    slot = torch.empty(M, dtype=torch.int64, device=rows.device)
    victim = torch.empty(M, dtype=torch.int64, device=rows.device)
    cnt = index._cnt_b                                     # [B, 5] per-request counts
    _hot_plan_kernel[(B,)](rows, index.rev[layer], index.slot_row[layer], index.key[layer], index._prot8,
                           index._owner, index._list, clk, slot, victim, cnt, K, C, row_bytes, index.decay,
                           POLICY=POLICY_ID[index.policy], BK=triton.next_power_of_2(K),
                           BC=triton.next_power_of_2(C), num_warps=16 if max(K, C) >= 2048 else 4)
    st = cnt.sum(0)
    index.step[layer].copy_(st)
    index.total.add_(st)
    return slot, victim
