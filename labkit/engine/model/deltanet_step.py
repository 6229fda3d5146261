"""One decode step of the gated delta rule on the GPU: the recurrence alone, or the whole mixer.

    o = delta_step(S, q, k, v, log_a, beta)       # S [B, H, dk, dv] fp32, updated in place

per request b and value head h (key head h // (H / Hk): the key heads are shared, not repeated):
    S <- exp(log_a) * S;   S <- S + beta * k (v - S^T k)^T;   o = S^T q
Written op by op this is a decay, two batched matrix-vector products, an outer product, an add and a
third product over a 2 MiB fp32 state per request and layer: six kernels and the state read four
times. The Triton kernel reads each [dk, DV] tile of the state once, writes it once, and returns o.
`delta_step_reference` is the same function in torch (the CPU path and the kernel's reference).

    g = deltanet_mix(mixer, y, S, conv)           # the decode step's default: everything between the
                                                  # layer's two projections in two kernels (below)
"""
from __future__ import annotations


import torch

from ... import envs

from .arch import HAVE_TRITON, kernels_run
from .gemv import pdl_supported

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _delta_step_kernel(S_ptr, q_ptr, k_ptr, v_ptr, la_ptr, beta_ptr, o_ptr, H, HK,
                           DK: tl.constexpr, DV: tl.constexpr, TILE: tl.constexpr):
        b, h, t = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        kh = h // (H // HK)
        i = tl.arange(0, DK)
        j = t * TILE + tl.arange(0, TILE)
        s_ptr = S_ptr + ((b * H + h) * DK + i[:, None]) * DV + j[None, :]
        S = tl.load(s_ptr)                                                # [DK, TILE] fp32
        kv = tl.load(k_ptr + (b * HK + kh) * DK + i).to(tl.float32)
        qv = tl.load(q_ptr + (b * HK + kh) * DK + i).to(tl.float32)
        vv = tl.load(v_ptr + (b * H + h) * DV + j).to(tl.float32)
        a = tl.exp(tl.load(la_ptr + b * H + h).to(tl.float32))
        beta = tl.load(beta_ptr + b * H + h).to(tl.float32)
        S = S * a
        v_old = tl.sum(S * kv[:, None], axis=0)                           # [TILE]
        S = S + (beta * kv)[:, None] * (vv - v_old)[None, :]
        tl.store(s_ptr, S)
        tl.store(o_ptr + (b * H + h) * DV + j, tl.sum(S * qv[:, None], axis=0))


def delta_step_reference(S, q, k, v, log_a, beta):
    """torch ops: S [B, H, dk, dv] fp32 in place; q, k [B, Hk, dk]; v [B, H, dv]; log_a, beta [B, H]."""
    rep = S.shape[1] // q.shape[1]
    q, k = q.float().repeat_interleave(rep, 1), k.float().repeat_interleave(rep, 1)
    S.mul_(log_a.float().exp()[..., None, None])
    v_old = torch.einsum("bhkv,bhk->bhv", S, k)
    S.add_(torch.einsum("bhk,bhv->bhkv", k * beta.float()[..., None], v.float() - v_old))
    return torch.einsum("bhkv,bhk->bhv", S, q)


def delta_step(S, q, k, v, log_a, beta, tile: int = 32):
    B, H, DK, DV = S.shape
    if not kernels_run(S) or DV % tile or DK & (DK - 1) or tile & (tile - 1):
        return delta_step_reference(S, q, k, v, log_a, beta)
    assert S.is_contiguous() and S.dtype == torch.float32
    o = torch.empty((B, H, DV), dtype=torch.float32, device=S.device)
    _delta_step_kernel[(B, H, DV // tile)](S, q.contiguous(), k.contiguous(), v.contiguous(), log_a.contiguous(),
                                            beta.contiguous(), o, H, q.shape[1], DK=DK, DV=DV, TILE=tile, num_warps=4)
    return o


# ---------------------------------------------------------------------------- the whole mixer, two kernels
# Between its two projections a DeltaNet block's decode step is a dozen small operations (split, conv
# window shift, conv + silu, two l2 norms, softplus and sigmoid gates, the recurrence, the per-head norm,
# the output gate). torch.compile fuses them into ~9 kernels of 1-2 µs each (measured on an H200 at
# batch 1: ~17 µs a layer, 0.6 ms of a 4.7 ms step over 36 layers, the recurrence itself ~3 µs of it).
# `deltanet_mix` runs them as two kernels:
# 1. the recurrence, one program per (request, value head, DV tile) as `_delta_step_kernel`: each
#    recomputes its key head's q and k from the conv window (256 channels x K taps, from L2) and its
#    tile's v, reads its [dk, TILE] slice of the state once, writes it once, and stores its slice of o
#    (fp32). The conv window is only read here: several programs read the same q/k channels, so none
#    may shift them yet.
# 2. per (request, value head): o's norm over dv, the output gate, the bf16 output for the output
#    projection; and the conv window's shift (a key head's q/k channels by its first value head).
# One program per (request, key head) doing all of it was tried first: 16 programs at batch 1, 16 µs
# a layer, no faster than the kernels it replaced. Roundings follow the torch definition
# (`DeltaNetLayer.mix_reference`): the conv output, the recurrence output, the norm and the gate are
# rounded to the activation dtype where the torch ops round them.
FUSED_MIX = envs.owner_value("LABKIT_DN_FUSED")
# programmatic dependent launch (sm90+) for both, off by default (LABKIT_DN_PDL=1 turns it on): each
# launches while the kernel before it ends, reads what does not depend on it (the state tile, the norm
# weight) and then waits, and lets the next kernel (the output projection's GEMV, which prefetches its
# weights) do the same. Predicted -0.05 ms a step; measured on an H200 at 64K slower: 3.244 -> 3.319 ms at
# c = 1, 4.897 -> 5.037 at c = 4 (results/20261203-060400-norm-gemv-h200; the mixer's programs, launched
# early, sit on SM slots the input projection's GEMV would use, and its kernel time rose 0.25 -> 0.95 ms).
MIX_PDL = envs.owner_value("LABKIT_DN_PDL")

if HAVE_TRITON:
    @triton.jit
    def _conv_silu(y_ptr, conv_ptr, cw_ptr, c, conv_sc, conv_sj, CONV_K: tl.constexpr):
        """conv + silu over channels c of one request: the window is the conv state, then the new input.
        Returns the output rounded to the activation dtype, as fp32. Reads only."""
        acc = tl.load(y_ptr + c).to(tl.float32) * tl.load(cw_ptr + c * CONV_K + (CONV_K - 1)).to(tl.float32)
        for j in tl.static_range(CONV_K - 1):
            acc += (tl.load(conv_ptr + c * conv_sc + j * conv_sj).to(tl.float32)
                    * tl.load(cw_ptr + c * CONV_K + j).to(tl.float32))
        return (acc * tl.sigmoid(acc)).to(y_ptr.dtype.element_ty).to(tl.float32)

    @triton.jit
    def _shift_window(y_ptr, conv_ptr, c, conv_sc, conv_sj, CONV_K: tl.constexpr):
        for j in tl.static_range(CONV_K - 2):
            tl.store(conv_ptr + c * conv_sc + j * conv_sj, tl.load(conv_ptr + c * conv_sc + (j + 1) * conv_sj))
        tl.store(conv_ptr + c * conv_sc + (CONV_K - 2) * conv_sj, tl.load(y_ptr + c))

    @triton.jit
    def _mix_recur_kernel(y_ptr, conv_ptr, cw_ptr, S_ptr, alog_ptr, dtb_ptr, o_ptr,
                          y_sb, conv_sb, conv_sc, conv_sj, S_sb, q_scale,
                          H: tl.constexpr, HK: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                          TILE: tl.constexpr, CONV_K: tl.constexpr, USE_GDC: tl.constexpr):
        b, h, t = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        kh = h // (H // HK)
        C: tl.constexpr = 2 * HK * DK + H * DV                  # conv channels: q, k, v
        yb, cb = y_ptr + b * y_sb, conv_ptr + b * conv_sb
        i = tl.arange(0, DK)
        j = t * TILE + tl.arange(0, TILE)
        # the state tile and the layer's gate parameters depend on nothing of this step: loaded first, so
        # that launched early (PDL, during the input projection) they arrive while the projection ends
        s_p = S_ptr + b * S_sb + (h * DK + i[:, None]) * DV + j[None, :]
        S = tl.load(s_p)                                                   # [DK, TILE] fp32
        alog, dtb = tl.load(alog_ptr + h), tl.load(dtb_ptr + h)
        if USE_GDC:
            tl.extra.cuda.gdc_wait()                 # the projection y is written
            tl.extra.cuda.gdc_launch_dependents()
        q = _conv_silu(yb, cb, cw_ptr, kh * DK + i, conv_sc, conv_sj, CONV_K)
        k = _conv_silu(yb, cb, cw_ptr, HK * DK + kh * DK + i, conv_sc, conv_sj, CONV_K)
        q = q / tl.maximum(tl.sqrt(tl.sum(q * q, 0)), 1e-12) * q_scale
        k = k / tl.maximum(tl.sqrt(tl.sum(k * k, 0)), 1e-12)
        v = _conv_silu(yb, cb, cw_ptr, 2 * HK * DK + h * DV + j, conv_sc, conv_sj, CONV_K)
        a = tl.load(yb + C + H * DV + h).to(tl.float32) + dtb
        softplus = tl.where(a > 20.0, a, tl.log(1.0 + tl.exp(a)))
        decay = tl.exp(-tl.exp(alog) * softplus)
        beta = tl.sigmoid(tl.load(yb + C + H * DV + H + h).to(tl.float32))
        S = S * decay
        v_old = tl.sum(S * k[:, None], axis=0)
        S = S + (beta * k)[:, None] * (v - v_old)[None, :]
        tl.store(s_p, S)
        tl.store(o_ptr + (b * H + h) * DV + j, tl.sum(S * q[:, None], axis=0))

    @triton.jit
    def _mix_out_kernel(y_ptr, conv_ptr, o_ptr, nw_ptr, out_ptr, y_sb, conv_sb, conv_sc, conv_sj, out_sb, eps,
                        H: tl.constexpr, HK: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                        CONV_K: tl.constexpr, USE_GDC: tl.constexpr):
        b, h = tl.program_id(0), tl.program_id(1)
        REP: tl.constexpr = H // HK
        C: tl.constexpr = 2 * HK * DK + H * DV
        yb, cb = y_ptr + b * y_sb, conv_ptr + b * conv_sb
        jv = tl.arange(0, DV)
        nw = tl.load(nw_ptr + jv)
        if USE_GDC:
            tl.extra.cuda.gdc_wait()                 # the recurrence's o is written, its window reads done
            tl.extra.cuda.gdc_launch_dependents()
        o = tl.load(o_ptr + (b * H + h) * DV + jv).to(nw.dtype).to(tl.float32)
        o = (o * (1.0 / tl.sqrt(tl.sum(o * o, 0) / DV + eps))).to(nw.dtype)
        o = (o.to(tl.float32) * nw.to(tl.float32)).to(nw.dtype).to(tl.float32)
        z = tl.load(yb + C + h * DV + jv).to(tl.float32)
        gate = (z * tl.sigmoid(z)).to(nw.dtype).to(tl.float32)
        tl.store(out_ptr + b * out_sb + h * DV + jv, (o * gate).to(out_ptr.dtype.element_ty))
        # the window shift, now that every program of the recurrence has read it: v channels of this
        # head; q and k channels of its key head by the key head's first value head
        _shift_window(yb, cb, 2 * HK * DK + h * DV + jv, conv_sc, conv_sj, CONV_K)
        if h % REP == 0:
            i = tl.arange(0, DK)
            kh = h // REP
            _shift_window(yb, cb, kh * DK + i, conv_sc, conv_sj, CONV_K)
            _shift_window(yb, cb, HK * DK + kh * DK + i, conv_sc, conv_sj, CONV_K)


def deltanet_mix(mixer, y: torch.Tensor, S: torch.Tensor, conv: torch.Tensor, tile: int = 32) -> torch.Tensor:
    """A DeltaNet layer's decode step between its projections: y = x @ w_in [B, C + dv + 2 H] ->
    [B, H * dv] (the output projection's input); S [B, H, dk, dv] fp32 and conv [B, C, K-1] in place.
    Two Triton kernels where they run (`FUSED_MIX`, CUDA; CPU under the interpreter), else
    `mixer.mix_reference` (torch ops)."""
    s = mixer.s
    B = y.shape[0]
    H, HK, D = s.dn_v_heads, s.dn_k_heads, s.dn_head_dim
    tile = min(tile, D)
    usable = (FUSED_MIX and kernels_run(y) and D & (D - 1) == 0 and H % HK == 0 and s.dn_conv >= 2
              and D % tile == 0 and y.stride(1) == 1 and S.dtype == torch.float32
              and S.shape == (B, H, D, D) and S[0].is_contiguous())
    if not usable:
        return mixer.mix_reference(y, S, conv)
    o = torch.empty((B, H, D), dtype=torch.float32, device=y.device)
    out = torch.empty((B, H * D), dtype=y.dtype, device=y.device)
    gdc = MIX_PDL and pdl_supported(y.device)
    pdl = {"launch_pdl": True} if gdc else {}
    _mix_recur_kernel[(B, H, D // tile)](y, conv, mixer.conv_w, S, mixer.A_log, mixer.dt_bias, o,
                                         y.stride(0), conv.stride(0), conv.stride(1), conv.stride(2), S.stride(0),
                                         D ** -0.5, H=H, HK=HK, DK=D, DV=D, TILE=tile, CONV_K=s.dn_conv,
                                         USE_GDC=gdc, num_warps=4, **pdl)
    _mix_out_kernel[(B, H)](y, conv, o, mixer.o_norm.weight, out, y.stride(0), conv.stride(0), conv.stride(1),
                            conv.stride(2), out.stride(0), mixer.o_norm.eps, H=H, HK=HK, DK=D, DV=D,
                            CONV_K=s.dn_conv, USE_GDC=gdc, num_warps=4, **pdl)
    return out
