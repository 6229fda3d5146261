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
from .gemv import is_k_major, matmul, silu_glu
from .grouped_gemv import grouped
from . import moe_gemm, moe_step
from .routing import choose, plan, route, route_plan
from .layers import make_weight
from .quant import QuantWeight


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
        router = make_weight(gen, s.hidden, s.experts, dtype, device)
        if bank is None:
            bank = (make_experts(gen, s.experts, s.hidden, 2 * s.expert_intermediate, dtype, device, weights_dtype),
                    make_experts(gen, s.experts, s.expert_intermediate, s.hidden, dtype, device, weights_dtype))
        self.w_gu, self.w_d = bank
        self.shared_gu = make_weight(gen, s.hidden, 2 * s.shared_intermediate, dtype, device,
                                     weights_dtype=weights_dtype)
        self.shared_d = make_weight(gen, s.shared_intermediate, s.hidden, dtype, device, weights_dtype=weights_dtype)
        gate = make_weight(gen, s.hidden, 1, dtype, device)
        # the router's columns and the shared expert's gate as one [hidden, experts + 1] weight, held as the router
        # is: one product a layer where there were two (the gate's one column alone took cuBLAS's two-kernel dot,
        # ~4 µs a layer at decode on an H100)
        if is_k_major(router):
            joined = torch.cat([router.t(), gate.reshape(1, -1)], 0).t()
        else:
            joined = torch.cat([router, gate.reshape(-1, 1)], 1)
        self.router_gate = nn.Parameter(joined, requires_grad=False)
        # added to the router's logits where it chooses (a recorded or skewed routing: `hybrid.routing_biases`)
        self.register_buffer("route_bias", torch.zeros(s.experts, device=device), persistent=False)

    @property
    def router(self) -> torch.Tensor:
        """The router [hidden, experts] (a view of `router_gate`)."""
        return self.router_gate[:, :self.s.experts]

    @property
    def shared_gate(self) -> torch.Tensor:
        """The shared expert's gate [hidden, 1] (a view of `router_gate`)."""
        return self.router_gate[:, self.s.experts:]

    def bank(self):
        return self.w_gu, self.w_d

    def forward(self, y: torch.Tensor, experts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """y [T, hidden] -> (out [T, hidden], the distinct experts read [1] int32). `experts` [T, k]: a routing
        to use instead of the router's (a recorded one), its weights still the router's softmax over them."""
        T = y.shape[0]
        both = matmul(y, self.router_gate)
        if moe_step.applies(self, y, experts):   # a decode step, W4A16: three launches (moe_step says which)
            return moe_step.moe_step(y, both, self)
        logits, gate_logit = both[:, :self.s.experts], both[:, self.s.experts:]
        shared = matmul(silu_glu(y, self.shared_gu), self.shared_d)
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
