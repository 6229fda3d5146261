"""Mixture of experts as the reference model routes it: a router scores `experts` per token, the top
`experts_per_tok` are kept with their softmax weights renormalised over them, each token's output is their
weighted sum plus a shared expert gated by a sigmoid.

    moe = MoE(shape, gen, dtype, device, weights_dtype="w4a16")
    out, groups = moe(y)        # y [T, hidden] normed input -> [T, hidden]; groups: distinct experts read (device)

Where the bytes go: a decode step of c requests reads each distinct expert its tokens chose once (`plan`:
the (token, expert) pairs sorted by expert, one group an expert; `grouped_gemv` streams a group's weight once
for all its rows), so the bytes grow with the distinct experts, up to `experts_per_tok` x c of them, not with
c x `experts_per_tok`. The plan is built from device ops only (no host sync): a CUDA graph replays it. A prefill
chunk's hundreds of rows an expert take grouped GEMMs instead (`moe_gemm`: the pairs sorted by expert, blocks of
rows through the tensor cores).

Routing is the router's (random seeded weights: close to uniform over experts) or, with `route="recorded"`,
drawn from a recorded expert-frequency distribution (`Routing`), a parameter of the decode experiment.
"""
from __future__ import annotations

import torch
from torch import nn

from ...shapes import ModelShape, held_quantised
from .gemv import matmul, silu_glu
from .grouped_gemv import Groups, grouped
from . import moe_gemm
from .arch import HAVE_TRITON, kernels_run
from .layers import make_weight
from .quant import QuantWeight


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
        tl.store(ngrp_ptr + r, tl.sum(first.to(tl.int32), axis=0) + r * 0, mask=r == 0)

    @triton.jit
    def _plan_kernel(e_ptr, tok_ptr, wid_ptr, seg_ptr, ngrp_ptr, back_ptr, R, k, RP: tl.constexpr):
        """`plan` for one step's few pairs in one program."""
        r = tl.arange(0, RP)
        rm = r < R
        e = tl.load(e_ptr + r, mask=rm, other=0)
        _plan_pairs(e, r, rm, R, k, tok_ptr, wid_ptr, seg_ptr, ngrp_ptr, back_ptr)

    @triton.jit
    def _route_plan_kernel(lg_ptr, bias_ptr, ex_ptr, p_ptr, tok_ptr, wid_ptr, seg_ptr, ngrp_ptr, back_ptr, T, E,
                           lg_st, k: tl.constexpr, TP: tl.constexpr, EP: tl.constexpr, KP: tl.constexpr,
                           RP: tl.constexpr):
        """`route` and `plan` of a decode step in one program: each token's top k of its router logits (chosen by
        logits + bias, largest first, the lowest index among equals), their softmax over the k (fp32, unbiased
        logits), written to ex [T, k] and p [T, k]; then the pairs read back (this program wrote them: the
        barrier orders it) and planned."""
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
        _plan_pairs(e, r, rm, R, k, tok_ptr, wid_ptr, seg_ptr, ngrp_ptr, back_ptr)


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


def route_plan(logits: torch.Tensor, bias: torch.Tensor, k: int):
    """`route` (choosing by logits + bias, the weights the softmax of the unbiased logits over the k) and `plan` of
    its choices: (experts [T, k] int64, weights [T, k] fp32, Groups, the permutation back). One launch for a
    decode step's few pairs where kernels run (the router's top-k through torch was two kernels and the weights'
    softmax and gather three more, a layer), else the torch ops."""
    T, E = logits.shape
    if T * k > PLAN_KERNEL_MAX or not kernels_run(logits) or E > ROUTE_KERNEL_MAX_EXPERTS:
        experts, p = choose(logits, bias, k)
        return (experts, p, *plan(experts))
    dev = logits.device
    R = T * k
    experts = torch.empty((T, k), dtype=torch.int64, device=dev)
    p = torch.empty((T, k), dtype=torch.float32, device=dev)
    tok, wid, back = (torch.empty(R, dtype=torch.int64, device=dev) for _ in range(3))
    seg, n_groups = torch.empty(R + 1, dtype=torch.int32, device=dev), torch.empty(1, dtype=torch.int32, device=dev)
    _route_plan_kernel[(1,)](logits, bias, experts, p, tok, wid, seg, n_groups, back, T, E, logits.stride(0), k=k,
                             TP=triton.next_power_of_2(T), EP=triton.next_power_of_2(E),
                             KP=triton.next_power_of_2(k), RP=triton.next_power_of_2(R + 1), num_warps=4)
    return experts, p, Groups(tok, wid, seg, n_groups), back


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


def make_experts(gen, n: int, K: int, N: int, dtype, device, weights_dtype: str):
    """`n` experts' K-major weights [n, N, K]: bf16 (seeded, N(0, 1/K)) or W4A16 (where K is a multiple of its
    group)."""
    if held_quantised(weights_dtype, K):
        return QuantWeight.random(gen, K, N, experts=n, device=device)
    w = torch.empty((n, N, K), dtype=dtype, device=device)
    for i in range(n):      # one expert at a time: the fp32 draw of all of them would be twice their size
        w[i] = (torch.randn((N, K), generator=gen, device=device) / K ** 0.5).to(dtype)
    return nn.Parameter(w, requires_grad=False)


class MoE(nn.Module):
    """A layer's routed experts, its shared expert and the router. `bank`: the layer's routed experts may be
    another layer's (`HybridModel`'s `expert_banks`: where every layer's experts do not fit the device, layers
    share banks; a step reads the same bytes, the device holds fewer)."""

    def __init__(self, s: ModelShape, gen, dtype, device, weights_dtype: str = "bf16", bank=None):
        super().__init__()
        self.s, self.k = s, s.experts_per_tok
        self.router = make_weight(gen, s.hidden, s.experts, dtype, device)
        if bank is None:
            bank = (make_experts(gen, s.experts, s.hidden, 2 * s.expert_intermediate, dtype, device, weights_dtype),
                    make_experts(gen, s.experts, s.expert_intermediate, s.hidden, dtype, device, weights_dtype))
        self.w_gu, self.w_d = bank
        self.shared_gu = make_weight(gen, s.hidden, 2 * s.shared_intermediate, dtype, device,
                                     weights_dtype=weights_dtype)
        self.shared_d = make_weight(gen, s.shared_intermediate, s.hidden, dtype, device, weights_dtype=weights_dtype)
        self.shared_gate = make_weight(gen, s.hidden, 1, dtype, device)
        # added to the router's logits where it chooses (a recorded or skewed routing: `hybrid.routing_biases`)
        self.register_buffer("route_bias", torch.zeros(s.experts, device=device), persistent=False)

    def bank(self):
        return self.w_gu, self.w_d

    def forward(self, y: torch.Tensor, experts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """y [T, hidden] -> (out [T, hidden], the distinct experts read [1] int32). `experts` [T, k]: a routing
        to use instead of the router's (a recorded one), its weights still the router's softmax over them."""
        T = y.shape[0]
        logits = matmul(y, self.router)
        shared, gate_logit = matmul(silu_glu(y, self.shared_gu), self.shared_d), matmul(y, self.shared_gate)
        if moe_gemm.applies(y):    # a prefill chunk: pairs sorted by expert, one GEMM launch a product
            experts, p = choose(logits, self.route_bias, self.k, experts)
            return moe_gemm.routed_experts(y, self.w_gu, self.w_d, experts, p, self.s.experts, shared, gate_logit)
        if experts is None:        # the router's own choice: its top-k, weights and plan in one launch
            experts, p, groups, back = route_plan(logits, self.route_bias, self.k)
        else:
            experts, p = choose(logits, self.route_bias, self.k, experts)
            groups, back = plan(experts)
        act = grouped(y, self.w_gu, groups, glu=True)                                  # [T*k, I], expert order
        down = grouped(act, self.w_d, groups, gather=False)                            # [T*k, hidden]
        routed = (down[back].view(T, self.k, -1).float() * p[..., None]).sum(1)
        gate = torch.sigmoid(gate_logit.float())
        return (routed + gate * shared.float()).to(y.dtype), groups.n_groups

    def reference(self, y: torch.Tensor) -> torch.Tensor:
        """Token by token, expert by expert, dense weights (the definition `forward` is checked against)."""
        def dense(w):
            return w.dequantize() if isinstance(w, QuantWeight) else w.transpose(1, 2)
        wgu, wd = dense(self.w_gu), dense(self.w_d)
        sgu = self.shared_gu.dequantize()[0] if isinstance(self.shared_gu, QuantWeight) else self.shared_gu
        sd = self.shared_d.dequantize()[0] if isinstance(self.shared_d, QuantWeight) else self.shared_d
        logits = (y @ self.router)
        experts, p = route(logits, self.k)
        out = []
        for t in range(y.shape[0]):
            acc = torch.zeros(y.shape[1], dtype=torch.float32, device=y.device)
            for j in range(self.k):
                e = int(experts[t, j])
                g, u = (y[t].float() @ wgu[e].float()).chunk(2)
                a = (torch.nn.functional.silu(g) * u).to(y.dtype)
                acc += p[t, j] * (a.float() @ wd[e].float()).to(y.dtype).float()
            g, u = (y[t].float() @ sgu.float()).chunk(2)
            sh = ((torch.nn.functional.silu(g) * u).to(y.dtype).float() @ sd.float()).to(y.dtype)
            gate = torch.sigmoid((y[t] @ self.shared_gate).float())
            out.append((acc + gate * sh.float()).to(y.dtype))
        return torch.stack(out)
