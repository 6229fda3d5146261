"""How a decode step's tokens reach their experts: the router's top k, their weights, and the plan that groups
the (token, expert) pairs by expert so a grouped launch streams each chosen expert's weight once.

    experts, p, groups, back = route_plan(logits, bias, k)   # one launch at decode; torch's ops past it
    groups, back = plan(experts)                              # a given routing (a recorded one)

Choosing is by logits + bias (a recorded or skewed routing's bias), weighting by the softmax of the unbiased
logits over the k. Every plan is built from device ops only (no host sync): a CUDA graph replays it.
"""
from __future__ import annotations

import torch

from .arch import HAVE_TRITON, kernels_run
from .grouped_gemv import Groups

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _plan_pairs(e, r, rm, R, k, tok_ptr, wid_ptr, seg_ptr, ngrp_ptr, back_ptr):
        """`plan` of the pairs e [RP] (pair r: token r // k's choice; rm: r < R): every quantity a count over all
        pairs ([RP, RP] comparisons), so no two threads write one place and the result is the stable sort's."""
        ri, rj = r[:, None], r[None, :]
        same = (e[None, :] == e[:, None]) & rm[None, :]
        before = ((e[None, :] < e[:, None]) & rm[None, :]) | (same & (rj < ri))
        rank = tl.sum(before.to(tl.int32), axis=1)                      # pair r's place in expert order
        first = (tl.sum((same & (rj < ri)).to(tl.int32), axis=1) == 0) & rm    # its expert's first pair
        gid = tl.sum((first[None, :] & (e[None, :] < e[:, None])).to(tl.int32), axis=1)   # its group
        tl.store(back_ptr + r, rank.to(tl.int64), mask=rm)
        # place i of the order holds the pair whose rank is i; group g starts at its first pair's rank
        at = (rank[None, :] == ri) & rm[None, :]
        tl.store(tok_ptr + r, tl.sum(tl.where(at, rj // k, 0), axis=1).to(tl.int64), mask=rm)
        starts = first[None, :] & (gid[None, :] == ri)
        has = tl.sum(starts.to(tl.int32), axis=1) > 0
        tl.store(seg_ptr + r, tl.where(has, tl.sum(tl.where(starts, rank[None, :], 0), axis=1), R), mask=r <= R)
        tl.store(wid_ptr + r, tl.sum(tl.where(starts, e[None, :], 0), axis=1).to(tl.int64), mask=rm)
        n_groups = tl.sum(first.to(tl.int32), axis=0)
        tl.store(ngrp_ptr + r, n_groups + r * 0, mask=r == 0)
        return n_groups

    @triton.jit
    def _plan_kernel(e_ptr, tok_ptr, wid_ptr, seg_ptr, ngrp_ptr, back_ptr, R, k, RP: tl.constexpr):
        """`plan` for one step's few pairs in one program."""
        r = tl.arange(0, RP)
        rm = r < R
        e = tl.load(e_ptr + r, mask=rm, other=0)
        _plan_pairs(e, r, rm, R, k, tok_ptr, wid_ptr, seg_ptr, ngrp_ptr, back_ptr)

    @triton.jit
    def _route_plan_kernel(lg_ptr, bias_ptr, ex_ptr, p_ptr, tok_ptr, wid_ptr, seg_ptr, ngrp_ptr, back_ptr, dist_ptr,
                           T, E, lg_st, k: tl.constexpr, TP: tl.constexpr, EP: tl.constexpr, KP: tl.constexpr,
                           RP: tl.constexpr, SHARED: tl.constexpr):
        """`route` and `plan` of a decode step in one program: each token's top k of its router logits (chosen by
        logits + bias, largest first, the lowest index among equals), their softmax over the k (fp32, unbiased
        logits), written to ex [T, k] and p [T, k]; then the pairs read back (this program wrote them: the
        barrier orders it) and planned. SHARED: T more groups after the routed ones, weight id E (the shared
        expert), group ng + t the one row T k + t of token t (one group of T rows would stream the weight once
        a row in one program, T times the others' time: the launch's tail); `dist` gets the distinct routed
        experts."""
        t = tl.arange(0, TP)
        tm = t < T
        ei = tl.arange(0, EP)
        em = ei < E
        lg = tl.load(lg_ptr + t[:, None] * lg_st + ei[None, :], mask=tm[:, None] & em[None, :], other=0.0)
        lg = lg.to(tl.float32)
        sc = tl.where(em[None, :], lg + tl.load(bias_ptr + ei, mask=em, other=0.0)[None, :], float("-inf"))
        j = tl.arange(0, KP)
        chosen = tl.zeros([TP, KP], dtype=tl.int32)
        w = tl.full([TP, KP], float("-inf"), dtype=tl.float32)
        for i in tl.static_range(k):
            top = tl.max(sc, axis=1)
            idx = tl.min(tl.where(sc == top[:, None], ei[None, :], EP), axis=1)            # [TP]
            hit = ei[None, :] == idx[:, None]
            chosen = tl.where(j[None, :] == i, idx[:, None], chosen)
            w = tl.where(j[None, :] == i, tl.sum(tl.where(hit, lg, 0.0), axis=1)[:, None], w)
            sc = tl.where(hit, float("-inf"), sc)
        w = tl.exp(w - tl.max(w, axis=1)[:, None])
        p = w / tl.sum(w, axis=1)[:, None]
        om = tm[:, None] & (j[None, :] < k)
        tl.store(ex_ptr + t[:, None] * k + j[None, :], chosen.to(tl.int64), mask=om)
        tl.store(p_ptr + t[:, None] * k + j[None, :], p, mask=om)
        tl.debug_barrier()
        R = T * k
        r = tl.arange(0, RP)
        rm = r < R
        e = tl.load(ex_ptr + r, mask=rm, other=0)
        ng = _plan_pairs(e, r, rm, R, k, tok_ptr, wid_ptr, seg_ptr, ngrp_ptr, back_ptr)
        if SHARED:
            tl.debug_barrier()                   # after the plan's own stores to seg and the count
            tl.store(tok_ptr + R + t, t.to(tl.int64), mask=tm)
            tl.store(wid_ptr + ng + t, E + t.to(tl.int64) * 0, mask=tm)
            tl.store(seg_ptr + ng + 1 + t, R + 1 + t, mask=tm)            # seg[ng] = R: the plan's end
            one = t == 0
            tl.store(ngrp_ptr + t * 0, ng + T + t * 0, mask=one)
            tl.store(dist_ptr + t * 0, ng + t * 0, mask=one)


# the pairs one program plans (a decode step's: c requests x 10 experts); more take the torch ops (a prefill chunk)
PLAN_KERNEL_MAX = 64


def plan(experts: torch.Tensor) -> tuple[Groups, torch.Tensor]:
    """The (token, expert) pairs of `experts` [T, k] grouped by expert: (Groups over the T*k pairs in expert
    order, with `tok` the token of each; the permutation that puts the pairs back in token order). Up to
    PLAN_KERNEL_MAX pairs in one launch (`_plan_kernel`: a decode step's plan was some twenty small ops a layer),
    more through torch's sort."""
    T, k = experts.shape
    R = T * k
    if R <= PLAN_KERNEL_MAX and kernels_run(experts):
        dev = experts.device
        tok, wid, back = (torch.empty(R, dtype=torch.int64, device=dev) for _ in range(3))
        seg, n_groups = torch.empty(R + 1, dtype=torch.int32, device=dev), torch.empty(1, dtype=torch.int32, device=dev)
        _plan_kernel[(1,)](experts.contiguous(), tok, wid, seg, n_groups, back, R, k,
                           RP=triton.next_power_of_2(R + 1), num_warps=4)
        return Groups(tok, wid, seg, n_groups), back
    return plan_reference(experts)


def route_plan(logits: torch.Tensor, bias: torch.Tensor, k: int, shared: bool = False):
    """`route` (choosing by logits + bias, the weights the softmax of the unbiased logits over the k) and `plan` of
    its choices: (experts [T, k] int64, weights [T, k] fp32, Groups, the permutation back). One launch for a
    decode step's few pairs where kernels run (the router's top-k through torch was two kernels and the weights'
    softmax and gather three more, a layer), else the torch ops. `shared` (the launch only: `moe_step`): the
    plan has T more groups of weight id E (the shared expert), group ng + t row T k + t of token t, and a sixth
    return, the distinct routed experts [1] int32 (the plan's count less the shared groups)."""
    T, E = logits.shape
    if not route_kernel_applies(T, E, k, logits):
        if shared:
            raise ValueError("route_plan: the shared expert's group is planned by the launch only")
        experts, p = choose(logits, bias, k)
        return (experts, p, *plan(experts))
    dev = logits.device
    R = T * k
    experts = torch.empty((T, k), dtype=torch.int64, device=dev)
    p = torch.empty((T, k), dtype=torch.float32, device=dev)
    tok = torch.empty(R + T * shared, dtype=torch.int64, device=dev)
    wid = torch.empty(R + T * shared, dtype=torch.int64, device=dev)
    back = torch.empty(R, dtype=torch.int64, device=dev)
    seg = torch.empty(R + 1 + T * shared, dtype=torch.int32, device=dev)
    n_groups, distinct = (torch.empty(1, dtype=torch.int32, device=dev) for _ in range(2))
    _route_plan_kernel[(1,)](logits, bias, experts, p, tok, wid, seg, n_groups, back, distinct, T, E,
                             logits.stride(0), k=k, TP=triton.next_power_of_2(T), EP=triton.next_power_of_2(E),
                             KP=triton.next_power_of_2(k), RP=triton.next_power_of_2(R + 1), SHARED=shared,
                             num_warps=4)
    out = experts, p, Groups(tok, wid, seg, n_groups), back
    return (*out, distinct) if shared else out


def route_kernel_applies(T: int, E: int, k: int, t: torch.Tensor) -> bool:
    """Whether `route_plan` is one launch: a decode step's few pairs, a router one program scores, kernels run."""
    return T * k <= PLAN_KERNEL_MAX and kernels_run(t) and E <= ROUTE_KERNEL_MAX_EXPERTS


# the widest router one program scores (the reference shape's 512 experts)
ROUTE_KERNEL_MAX_EXPERTS = 1024


def plan_reference(experts: torch.Tensor) -> tuple[Groups, torch.Tensor]:
    """`plan` in torch ops (device ops only, no host sync: a CUDA graph replays it)."""
    T, k = experts.shape
    flat = experts.reshape(-1)
    sorted_e, order = torch.sort(flat, stable=True)
    R = flat.shape[0]
    new = torch.ones(R, dtype=torch.bool, device=flat.device)
    new[1:] = sorted_e[1:] != sorted_e[:-1]
    gid = torch.cumsum(new.to(torch.int32), 0) - 1                                  # group of each pair
    seg = torch.full((R + 1,), R, dtype=torch.int32, device=flat.device)
    seg.scatter_reduce_(0, gid.to(torch.int64), torch.arange(R, dtype=torch.int32, device=flat.device), "amin")
    wid = torch.zeros(R, dtype=torch.int64, device=flat.device)
    wid.scatter_(0, gid.to(torch.int64), sorted_e)
    n_groups = gid[-1:].to(torch.int32) + 1
    return Groups(order // k, wid, seg, n_groups), torch.argsort(order)


def choose(logits: torch.Tensor, bias: torch.Tensor, k: int, experts: torch.Tensor | None = None):
    """In torch ops: the experts [T, k] (chosen by logits + bias, unless given: a recorded routing) and their
    weights, the softmax of the unbiased logits over them [T, k] fp32."""
    if experts is None:
        experts, _ = route(logits.float() + bias, k)
    return experts, torch.softmax(torch.gather(logits.float(), 1, experts), dim=-1)


def route(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k experts of each token and their weights (softmax over the k, fp32): ([T, k] int64, [T, k])."""
    top, idx = torch.topk(logits.float(), k, dim=-1)
    return idx, torch.softmax(top, dim=-1)
