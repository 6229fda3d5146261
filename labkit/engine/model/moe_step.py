"""A decode step's experts in three launches after the router's product (with it four a layer, where they were nine
kernels), for W4A16 weights:

    out, distinct = moe_step(y, both, moe)     # both = y @ [router | shared gate]: [T, experts + 1]

1. `routing.route_plan(..., shared=True)`: each token's top k, their softmax and the plan (the pairs grouped by
   expert), with a group a token for the shared expert (its id is the routed stack's count);
2. the gate|up product of every group in one `_w4_rows_kernel` launch (`SHARED`: the group of that id takes the
   shared expert's weight, held apart from the routed stack), silu(gate) * up;
3. the down product of every group, the last program of an output block to arrive writing each token's weighted
   sum of its k rows plus sigmoid(gate logit) times its shared row (`COMBINE`, `w4_decode._combine_tail`).

What it replaces, per layer at one request on an H100 (`docs/reference-model.md`): the shared expert's two
products (~9 µs for 2.6 MB, each a launch's fixed cost), the weighted sum's kernel (~2.6 µs) and the gaps
between them. The router and the shared gate are already one product (`MoE.router_gate`). The rounding is the
separate path's: each pair's row and the shared row bf16, the weighted sum fp32, one rounding at the end.
"""
from __future__ import annotations

import torch

from ... import envs
from ...shapes import W4_GROUP
from .arch import HAVE_TRITON
from .routing import route_kernel_applies, route_plan
from .grouped_gemv import w4_rows
from .quant import QuantWeight

MOE_STEP = envs.owner_value("LABKIT_MOE_STEP")     # off: the shared expert and the weighted sum apart (an A/B)


def applies(moe, y: torch.Tensor, experts) -> bool:
    """The router's own choice (no recorded routing), W4A16 routed and shared weights of the same dims, a decode
    step's few tokens where the routing launch runs."""
    s = moe.s
    return (MOE_STEP and HAVE_TRITON and experts is None and y.dim() == 2
            and all(isinstance(w, QuantWeight) for w in (moe.w_gu, moe.w_d, moe.shared_gu, moe.shared_d))
            and moe.shared_gu.N == moe.w_gu.N and moe.shared_d.N == moe.w_d.N and moe.w_gu.K % W4_GROUP == 0
            and moe.w_d.K % W4_GROUP == 0 and route_kernel_applies(y.shape[0], s.experts, moe.k, y))


def moe_step(y: torch.Tensor, both: torch.Tensor, moe) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [T, hidden] bf16, the distinct routed experts read [1] int32) for the normed input y [T, hidden] and
    both = y @ `moe.router_gate` [T, experts + 1] (the router's logits, then the shared gate's)."""
    return torch.ops.labkit.moe_step(y, both, moe.route_bias, *_parts(moe.w_gu), *_parts(moe.w_d),
                                     *_parts(moe.shared_gu), *_parts(moe.shared_d), moe.k)


def _parts(w: QuantWeight):
    return w.q, w.scales, w.zeros


@torch.library.custom_op("labkit::moe_step", mutates_args=())
def _moe_step_op(y: torch.Tensor, both: torch.Tensor, bias: torch.Tensor, q_gu: torch.Tensor, s_gu: torch.Tensor,
                 z_gu: torch.Tensor, q_d: torch.Tensor, s_d: torch.Tensor, z_d: torch.Tensor, qs_gu: torch.Tensor,
                 ss_gu: torch.Tensor, zs_gu: torch.Tensor, qs_d: torch.Tensor, ss_d: torch.Tensor,
                 zs_d: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    E = q_gu.shape[0]
    logits, gate_logit = both[:, :E], both[:, E:E + 1]
    _, p, groups, back, distinct = route_plan(logits, bias, k, shared=True)
    y = y.contiguous()
    T = y.shape[0]
    # N and K from the packed codes [E, N', K/2] (no QuantWeight modules made at every call)
    act = w4_rows(y, q_gu, s_gu, z_gu, groups, q_gu.shape[1] // 2, 2 * q_gu.shape[2], glu=True, gather=True, rows=1,
                  block_n=None, group_tile=None, split=None, shared=(qs_gu, ss_gu, zs_gu, T))
    out = w4_rows(act, q_d, s_d, z_d, groups, q_d.shape[1], 2 * q_d.shape[2], glu=False, gather=False, rows=1,
                  block_n=None, group_tile=None, split=None, shared=(qs_d, ss_d, zs_d, T),
                  combine=(back, p, gate_logit, k))
    return out, distinct


@_moe_step_op.register_fake
def _(y, both, bias, q_gu, s_gu, z_gu, q_d, s_d, z_d, qs_gu, ss_gu, zs_gu, qs_d, ss_d, zs_d, k):
    return y.new_empty((y.shape[0], q_d.shape[1])), y.new_empty((1,), dtype=torch.int32)
