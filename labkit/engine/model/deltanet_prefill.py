"""DeltaNet's prefill of a chunk between its input projection and its output gate, on the GPU:

    o = scan_fla(layer, qkv, a, b, S, conv)      # o [T, H, dv] bf16; S [H, dk, dv] fp32, conv [C, K-1] in place

Written op by op (`layers.DeltaNetLayer.forward_seq`'s torch form) the short causal conv runs in fp32 over a
transposed copy of the chunk, and q and k are normalised in fp32 and repeated from the 16 key heads to the 32
value heads before flash-linear-attention's kernel casts them back to bf16: on an H200 at the reference shape
~3 ms of a layer-chunk's ~3.9 ms, the scan itself 0.87 ms. Here the conv and its silu are one kernel of the
lab's own over the window's and the chunk's rows (`causal_conv_silu`, bf16 out, fp32 sums), and
flash-linear-attention's `chunk_gated_delta_rule` takes q and k per key head (its grouped values: value head h
reads key head h // (H / Hk), as the repeat did) and normalises them in its kernel. Nothing in fp32 or repeated
goes through HBM.

`causal_conv_silu_reference` is the torch form's conv (the definition the kernel is tested against).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .arch import HAVE_TRITON, kernels_run

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _conv_silu_kernel(x_ptr, win_ptr, w_ptr, o_ptr, T, C, x_st, o_st, K: tl.constexpr, BT: tl.constexpr,
                          BC: tl.constexpr):
        """out[t, c] = silu(sum_j w[c, j] r[t + j, c]) over r = the window's K-1 rows (win [C, K-1]), then the
        chunk's x [T, C]: read from where each lives (no copy of the chunk behind the window)."""
        t = tl.program_id(0) * BT + tl.arange(0, BT)
        c = tl.program_id(1) * BC + tl.arange(0, BC)
        cm = c < C
        m = (t < T)[:, None] & cm[None, :]
        acc = tl.zeros([BT, BC], dtype=tl.float32)
        for j in tl.static_range(K):
            wj = tl.load(w_ptr + c * K + j, mask=cm, other=0.0).to(tl.float32)
            r = t + j - (K - 1)                                   # the row in the chunk; < 0: in the window
            xv = tl.load(x_ptr + r[:, None].to(tl.int64) * x_st + c[None, :], mask=m & (r >= 0)[:, None], other=0.0)
            wv = tl.load(win_ptr + c[None, :].to(tl.int64) * (K - 1) + (r + K - 1)[:, None],
                         mask=m & (r < 0)[:, None], other=0.0)
            acc += (xv.to(tl.float32) + wv.to(tl.float32)) * wj[None, :]
        out = acc * tl.sigmoid(acc)
        tl.store(o_ptr + t[:, None].to(tl.int64) * o_st + c[None, :], out.to(o_ptr.dtype.element_ty), mask=m)


def causal_conv_silu_reference(qkv: torch.Tensor, conv: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The torch form: qkv [T, C] (rows may be strided), conv [C, K-1] the window before the chunk (updated in
    place to the chunk's last K-1 rows), w [C, K]. Returns silu of the depthwise causal conv [T, C] in qkv's dtype,
    summed in fp32."""
    seq = torch.cat([conv.to(qkv.dtype), qkv.t()], dim=-1)                 # [C, K-1+T]
    conv.copy_(seq[:, -(w.shape[1] - 1):])
    return F.silu(F.conv1d(seq.unsqueeze(0).float(), w.float().unsqueeze(1), groups=w.shape[0])[0].t()).to(qkv.dtype)


def causal_conv_silu(qkv: torch.Tensor, conv: torch.Tensor, w: torch.Tensor, bt: int = 32,
                     bc: int = 128) -> torch.Tensor:
    """`causal_conv_silu_reference` in one kernel where Triton runs (CUDA, or its interpreter on CPU tensors)."""
    T, C = qkv.shape
    K = w.shape[1]
    if conv.shape != (C, K - 1) or w.shape[0] != C:
        raise ValueError(f"causal_conv_silu: qkv {tuple(qkv.shape)}, conv {tuple(conv.shape)}, w {tuple(w.shape)} do "
                         "not fit [T, C], [C, K-1], [C, K]")
    if not kernels_run(qkv) or qkv.stride(1) != 1 or T < K - 1 or conv.dtype != qkv.dtype:
        return causal_conv_silu_reference(qkv, conv, w)
    out = torch.empty((T, C), dtype=qkv.dtype, device=qkv.device)
    _conv_silu_kernel[(triton.cdiv(T, bt), triton.cdiv(C, bc))](qkv, conv.contiguous(), w.contiguous(), out, T, C,
                                                                qkv.stride(0), out.stride(0), K=K, BT=bt, BC=bc)
    conv.copy_(qkv[T - (K - 1):].t())                   # the next chunk's window, after the kernel read the old one
    return out


def scan_fla(layer, qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, S: torch.Tensor,
             conv: torch.Tensor) -> torch.Tensor:
    """A DeltaNet layer's chunk from its projection's parts (qkv [T, C], the gate inputs a, b [T, H]) to the
    recurrence's output [T, H, dv] in bf16, on `causal_conv_silu` and flash-linear-attention's kernel."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule     # optional (flash-linear-attention): fla path only
    s = layer.s
    T, dh = qkv.shape[0], s.dn_head_dim
    dk = s.dn_k_heads * dh
    y = causal_conv_silu(qkv, conv, layer.conv_w)
    q = y[:, :dk].reshape(1, T, s.dn_k_heads, dh)
    k = y[:, dk:2 * dk].reshape(1, T, s.dn_k_heads, dh)
    v = y[:, 2 * dk:].reshape(1, T, s.dn_v_heads, dh)
    log_a, beta = layer._gates(a, b)
    o, S_new = chunk_gated_delta_rule(q, k, v, log_a[None].float(), beta[None].to(torch.bfloat16), scale=dh ** -0.5,
                                      initial_state=S[None].float(), output_final_state=True,
                                      use_qk_l2norm_in_kernel=True)
    S.copy_(S_new[0])
    return o[0]
