"""The decoder's layers, pure compute (where KV lives is model.py's business).

- `QSALayer`: projections of a sparse-attention layer (query + output gate, K, V with per-head norm
  and partial RoPE, and the indexer's query, head weights and index key) and its output projection.
- `DeltaNetLayer`: gated DeltaNet (Qwen3-Next linear attention) with a fixed-size state per head:
  `S <- a*S + b * k (v - (a*S)^T k)^T`, output `S^T q`; a one-token `step` for decode and a chunked
  `forward_seq` for prefill, both checked against `delta_rule_reference` (a plain loop).
- `FFN`: SwiGLU, a dense stand-in for the active experts.
Every product with a weight goes through `gemv.matmul`: a weight-streaming GEMV for the few rows of a
decode step on the GPU, `x @ w` otherwise (CPU: unchanged results).
Weights are random and seeded, scaled 1/sqrt(fan_in) so activations stay O(1) through 48 layers.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ... import envs
from ...shapes import ModelShape, aligned_width, held_quantised
from .deltanet_prefill import causal_conv_silu_reference, scan_fla
from .deltanet_step import delta_step_reference
from .gemv import matmul, silu_glu
from .norm_rows import gated_norm
from .quant import QuantWeight

# The layers' weight layout (LABKIT_WEIGHTS, read at import): "nk" (default) each weight stored [N, K] and
# held as its [K, N] transpose (the layout of a checkpoint's nn.Linear), which the lab's one-row GEMV
# streams at 78% of the read bandwidth against cuBLAS's 69% (a step's 193 matrices on an H200,
# scripts/gemv_bench.py --layout nk); "kn" stored row-major [K, N] as before (cuBLAS 2% faster on it).
K_MAJOR = envs.owner_value("LABKIT_WEIGHTS")       # True: "nk"


def make_weight(gen: torch.Generator, fan_in: int, fan_out: int, dtype, device, pad: bool = False,
                k_major: bool | None = None, weights_dtype: str = "bf16"):
    """A [fan_in, fan_out] weight, seeded (the same values in either layout); with `pad`, zero columns after
    it up to a multiple of `shapes.ROW_ALIGN`, and the caller takes the product's first fan_out columns.
    Why the pad: row-major at a width that is not a multiple of 8 (the QSA input projection's 9,540
    columns) the product's rows are off 16-byte alignment and cuBLAS falls back to a plain GEMV kernel:
    17.5 µs for its 39 MB at M = 1 and 41 µs at M = 4, against ~13 µs for the aligned projections of
    that size (measured on an H200: results/20261202-033500-gemv-tiles-h200); K-major keeps the same
    width so that both layouts hold the same matrices. `k_major`: the layout (default `K_MAJOR`).
    `weights_dtype="w4a16"`: a `quant.QuantWeight` of the same shape (K-major, packed), where fan_in is a multiple
    of its group (else bf16: tiny shapes only)."""
    if held_quantised(weights_dtype, fan_in):
        n = aligned_width(fan_out) if pad else fan_out
        return QuantWeight.random(gen, fan_in, n, device=device)
    ld = aligned_width(fan_out) if pad else fan_out
    k_major = K_MAJOR if k_major is None else k_major
    buf = torch.zeros((ld, fan_in) if k_major else (fan_in, ld), dtype=dtype, device=device)
    for r0, r1, t in normal_rows(gen, fan_in, fan_out, device, math.sqrt(fan_in)):
        if k_major:
            buf[:fan_out, r0:r1] = t.t()                                 # stored [N, K]
        else:
            buf[r0:r1, :fan_out] = t
    return nn.Parameter(buf.t() if k_major else buf, requires_grad=False)   # held as [K, N]


# the fp32 draw of a weight is made a block of rows at a time above this: the head's [2,560, 248,320] at once
# would be 2.4 GiB of fp32 beside its bf16 copy, over a 24 GiB card's spare room when only a third of the layers
# is built (a weight under it draws as one block: the same values as before)
DRAW_BYTES = 256 << 20


def normal_rows(gen: torch.Generator, rows: int, cols: int, device, div: float = 1.0):
    """A seeded N(0, 1 / div^2) [rows, cols] matrix as (r0, r1, fp32 block of rows [r0, r1)), at most DRAW_BYTES
    a block."""
    step = max(1, DRAW_BYTES // (4 * cols))
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        yield r0, r1, torch.randn(r1 - r0, cols, generator=gen, device=device, dtype=torch.float32) / div


class RMSNorm(nn.Module):
    def __init__(self, dim: int, dtype, device, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def rope_inv_freq(half: int, theta: float, device) -> torch.Tensor:
    """RoPE's inverse frequencies [half] fp32 (the one formula: a kernel that takes them gets the same
    angles bit for bit, which matters at long context where an ulp of the angle is ~0.06 rad at 1M)."""
    return 1.0 / theta ** (torch.arange(half, device=device, dtype=torch.float32) / half)


def apply_rope(x: torch.Tensor, pos: torch.Tensor, rotary_dim: int, theta: float = 1e7) -> torch.Tensor:
    """Rotate the first `rotary_dim` dims of x [N, H, D] at positions pos [N] (neox half-split)."""
    half = rotary_dim // 2
    inv = rope_inv_freq(half, theta, x.device)
    ang = pos.to(torch.float32)[:, None] * inv[None, :]                 # [N, half]
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    x1, x2, rest = x[..., :half].float(), x[..., half:rotary_dim].float(), x[..., rotary_dim:]
    rot = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
    return torch.cat([rot, rest], dim=-1)


class QSALayer(nn.Module):
    def __init__(self, s: ModelShape, gen, dtype, device, weights_dtype: str = "bf16"):
        super().__init__()
        self.s = s
        self.q_out = 2 * s.n_heads * s.head_dim                 # query and sigmoid output gate
        self.kv_out = s.n_kv_heads * s.head_dim
        self.splits = [self.q_out, self.kv_out, self.kv_out, s.index_heads * s.index_dim, s.index_heads, s.index_dim]
        self.in_cols = sum(self.splits)          # w_in's columns past these are zero padding
        self.w_in = make_weight(gen, s.hidden, self.in_cols, dtype, device, pad=True, weights_dtype=weights_dtype)
        self.w_o = make_weight(gen, s.n_heads * s.head_dim, s.hidden, dtype, device, weights_dtype=weights_dtype)
        self.q_norm = RMSNorm(s.head_dim, dtype, device)
        self.k_norm = RMSNorm(s.head_dim, dtype, device)

    def project(self, x: torch.Tensor, pos: torch.Tensor):
        """x [N, hidden], pos [N] -> q [N, Hq, D], gate [N, Hq, D], kv_row [N, 2*Hkv*D] (K roped),
        index query [N, Hi, Di], index head weights [N, Hi], index key [N, Di]."""
        return self.heads_reference(matmul(x, self.w_in), pos)

    def heads_reference(self, y: torch.Tensor, pos: torch.Tensor, theta: float = 1e7):
        """`project` after its product y = x @ w_in: the definition `qsa_step.qsa_heads` is checked
        against (and the path wherever its kernel does not run)."""
        s = self.s
        qg, k, v = torch.split(y[:, :self.q_out + 2 * self.kv_out], self.splits[:3], dim=-1)
        q, gate = qg.view(-1, s.n_heads, 2 * s.head_dim).chunk(2, dim=-1)
        q = apply_rope(self.q_norm(q), pos, s.rotary_dim, theta)
        k = apply_rope(self.k_norm(k.view(-1, s.n_kv_heads, s.head_dim)), pos, s.rotary_dim, theta)
        kv_row = torch.cat([k.flatten(1), v], dim=-1)
        return (q, gate, kv_row, *self.index_parts(y))

    def index_parts(self, y: torch.Tensor):
        """The indexer's part of y: query [N, Hi, Di] and key [N, Di] (views), head weights [N, Hi] scaled."""
        s = self.s
        a = self.q_out + 2 * self.kv_out
        iq, iw, ik = torch.split(y[:, a:self.in_cols], self.splits[3:], dim=-1)
        return iq.view(-1, s.index_heads, s.index_dim), iw * (s.index_heads ** -0.5), ik

    def output(self, attn: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """attn [N, Hq, D] (or flat) through the sigmoid of gate [N, Hq, D] and the output projection."""
        return matmul(attn.flatten(1) * torch.sigmoid(gate.reshape(gate.shape[0], -1)), self.w_o)


class FFN(nn.Module):
    def __init__(self, s: ModelShape, gen, dtype, device, weights_dtype: str = "bf16"):
        super().__init__()
        self.w_gu = make_weight(gen, s.hidden, 2 * s.ffn_intermediate, dtype, device, weights_dtype=weights_dtype)
        self.w_d = make_weight(gen, s.ffn_intermediate, s.hidden, dtype, device, weights_dtype=weights_dtype)

    def forward(self, x):
        return matmul(silu_glu(x, self.w_gu), self.w_d)


class HyperConnection(nn.Module):
    """The residual stream as `hc_count` copies of the hidden state [N, hc * H] (Hyper-Connections, as the
    reference model's public config has them): before a sub-block, each copy RMS-normed, a low-rank product of
    all of them (`w_down`, rank `hc_lowrank`, plus `hc_count` injection logits), silu, a product back up
    (`w_up`), and the sub-block's input is the sigmoid-gated mean of the normed copies; after it, its output is
    added to each copy scaled by that copy's injection logit (`inject`). Weights bf16, as the public W4A16
    checkpoint keeps them."""

    def __init__(self, s: ModelShape, gen, dtype, device, eps: float = 1e-6):
        super().__init__()
        self.hc, self.rank, self.eps = s.hc_count, s.hc_lowrank, eps
        hh = s.hc_count * s.hidden
        self.norm_w = nn.Parameter(torch.ones(hh, dtype=dtype, device=device), requires_grad=False)
        self.w_down = make_weight(gen, hh, s.hc_lowrank + s.hc_count, dtype, device, pad=True)
        self.w_up = make_weight(gen, s.hc_lowrank, hh, dtype, device)

    def mix(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h [N, hc * H] -> the sub-block's input [N, H] and the injection logits [N, hc]."""
        N = h.shape[0]
        hf = h.float().view(N, self.hc, -1)
        xn = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + self.eps)).to(h.dtype).view(N, -1) * self.norm_w
        lr = matmul(xn, self.w_down)
        lora, inj = lr[:, :self.rank], lr[:, self.rank:self.rank + self.hc]
        gate = matmul(F.silu(lora), self.w_up)
        y = (torch.sigmoid(gate.float()) * xn.float()).view(N, self.hc, -1).mean(1)
        return y.to(h.dtype), inj


def inject(inj: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
    """A sub-block's output o [N, H] added to each copy of the stream, scaled by its logit: [N, hc * H]."""
    return (inj.float()[:, :, None] * o.float()[:, None, :]).to(o.dtype).flatten(1)


# ----------------------------------------------------------------------------- gated DeltaNet
def delta_rule_reference(q, k, v, log_a, beta, S0):
    """The gated delta rule, one token at a time (the definition the fast paths are checked against).
    q, k [T, H, dk] (L2-normalised, q pre-scaled), v [T, H, dv], log_a, beta [T, H], S0 [H, dk, dv] fp32.
    Returns o [T, H, dv] and the final state."""
    S = S0.clone()
    outs = []
    for t in range(q.shape[0]):
        S = S * log_a[t].exp()[:, None, None]
        kt, vt = k[t].float(), v[t].float()
        v_old = torch.einsum("hkv,hk->hv", S, kt)
        S = S + beta[t].float()[:, None, None] * torch.einsum("hk,hv->hkv", kt, vt - v_old)
        outs.append(torch.einsum("hkv,hk->hv", S, q[t].float()))
    return torch.stack(outs), S


def delta_rule_chunked(q, k, v, log_a, beta, S0, chunk: int = 64):
    """Same function as `delta_rule_reference`, chunk by chunk (WY form): within a chunk the updates
    are solved as one triangular system, so the Python loop runs T/chunk times instead of T."""
    T, H, dk = k.shape
    dv = v.shape[-1]
    pad = (-T) % chunk
    q, k, v = (F.pad(x.float(), (0, 0, 0, 0, 0, pad)) for x in (q, k, v))   # pad tokens: k=0, beta=0, decay 1
    log_a = F.pad(log_a.float(), (0, 0, 0, pad))
    beta = F.pad(beta.float(), (0, 0, 0, pad))
    n = (T + pad) // chunk
    # [H, n, C, ...]
    q, k, v = (x.view(n, chunk, H, -1).permute(2, 0, 1, 3) for x in (q, k, v))
    g = log_a.view(n, chunk, H).permute(2, 0, 1).cumsum(-1)                 # cumulative log decay in chunk
    b = beta.view(n, chunk, H).permute(2, 0, 1)
    kb = k * b[..., None]
    decay = (g[..., :, None] - g[..., None, :])                              # [H, n, C, C]
    lower = torch.tril(torch.ones(chunk, chunk, dtype=torch.bool, device=q.device), -1)
    L = torch.where(lower, decay.exp(), torch.zeros((), device=q.device))
    A = (kb @ k.transpose(-1, -2)) * L                                       # strictly lower
    eye = torch.eye(chunk, device=q.device)
    Tm = torch.linalg.solve_triangular(eye + A, eye.expand_as(A), upper=False)   # (I + A)^-1
    u = Tm @ (v * b[..., None])                                              # [H, n, C, dv]
    w = Tm @ (kb * g.exp()[..., None])                                       # [H, n, C, dk]
    causal = torch.tril(torch.ones(chunk, chunk, dtype=torch.bool, device=q.device))
    Lq = torch.where(causal, decay.exp(), torch.zeros((), device=q.device))
    qk = (q @ k.transpose(-1, -2)) * Lq                                      # [H, n, C, C]
    S = S0.float().clone()
    out = torch.empty(H, n, chunk, dv, device=q.device, dtype=torch.float32)
    g_last = g[..., -1]                                                      # [H, n]
    k_tail = k * (g_last[..., None] - g).exp()[..., None]                    # decay from t to chunk end
    qg = q * g.exp()[..., None]
    for i in range(n):
        v_new = u[:, i] - w[:, i] @ S                                        # [H, C, dv]
        out[:, i] = qg[:, i] @ S + qk[:, i] @ v_new
        S = S * g_last[:, i].exp()[:, None, None] + k_tail[:, i].transpose(-1, -2) @ v_new
    out = out.permute(1, 2, 0, 3).reshape(n * chunk, H, dv)[:T]
    return out, S


# Which kernel runs prefill's chunked delta rule (the engine switch LABKIT_DN_PREFILL, `labkit/envs.py`): "fla"
# (flash-linear-attention's Triton `chunk_gated_delta_rule`, bf16 inputs, fp32 state), "torch" (this file's
# `delta_rule_chunked`: fp32 products in a Python loop of T/64 steps), "auto" (fla where it imports, on CUDA).
DN_PREFILL = envs.owner_value("LABKIT_DN_PREFILL")


def dn_prefill_kernel(device: torch.device) -> str:
    if DN_PREFILL == "torch" or device.type != "cuda":
        return "torch"
    try:
        import fla.ops.gated_delta_rule  # noqa: F401  -- optional (flash-linear-attention): asked for where used
    except ImportError:
        if DN_PREFILL == "fla":
            raise RuntimeError("LABKIT_DN_PREFILL=fla but flash-linear-attention is not installed "
                               "(pip install fla-core)") from None
        return "torch"
    return "fla"


def delta_rule_prefill(q, k, v, log_a, beta, S0, chunk: int = 64):
    """`delta_rule_chunked`'s function on the kernel `dn_prefill_kernel` picks; the same arguments and returns."""
    if dn_prefill_kernel(q.device) == "torch":
        return delta_rule_chunked(q, k, v, log_a, beta, S0, chunk=chunk)
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule     # optional: only where dn_prefill_kernel found it
    bf = torch.bfloat16
    o, S = chunk_gated_delta_rule(q[None].to(bf), k[None].to(bf), v[None].to(bf), log_a[None].float(),
                                  beta[None].to(bf), scale=1.0, initial_state=S0[None].float(),
                                  output_final_state=True)          # q arrives scaled and normalised
    return o[0].float(), S[0]


def dn_state_shapes(s: ModelShape) -> tuple[tuple[int, int, int], tuple[int, int]]:
    """Per request and DeltaNet layer: the recurrent state [v_heads, dk, dv] and the conv window [channels, K-1]."""
    conv_ch = 2 * s.dn_k_heads * s.dn_head_dim + s.dn_v_heads * s.dn_head_dim
    return (s.dn_v_heads, s.dn_head_dim, s.dn_head_dim), (conv_ch, s.dn_conv - 1)


class DeltaNetLayer(nn.Module):
    def __init__(self, s: ModelShape, gen, dtype, device, weights_dtype: str = "bf16"):
        super().__init__()
        self.s = s
        dk, dv, nv = s.dn_k_heads * s.dn_head_dim, s.dn_v_heads * s.dn_head_dim, s.dn_v_heads
        self.splits = [dk, dk, dv, dv, nv, nv]                              # q, k, v, z (out gate), a, b
        self.conv_ch = 2 * dk + dv
        self.w_in = make_weight(gen, s.hidden, sum(self.splits), dtype, device, weights_dtype=weights_dtype)
        self.conv_w = nn.Parameter((torch.randn(self.conv_ch, s.dn_conv, generator=gen, device=device) /
                                    math.sqrt(s.dn_conv)).to(dtype), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(nv, device=device).uniform_(0, math.log(16), generator=gen), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.randn(nv, generator=gen, device=device) * 0.5, requires_grad=False)
        self.o_norm = RMSNorm(s.dn_head_dim, dtype, device)
        self.w_o = make_weight(gen, dv, s.hidden, dtype, device, weights_dtype=weights_dtype)

    def state_shapes(self):
        return dn_state_shapes(self.s)

    def _gates(self, a, b):
        log_a = -self.A_log.exp() * F.softplus(a.float() + self.dt_bias)     # log of the decay, < 0
        return log_a, torch.sigmoid(b.float())

    def _qkv(self, conv_out, n, repeat: bool = True):
        s = self.s
        dk = s.dn_k_heads * s.dn_head_dim
        q, k, v = torch.split(conv_out, [dk, dk, conv_out.shape[-1] - 2 * dk], dim=-1)
        rep = s.dn_v_heads // s.dn_k_heads if repeat else 1                  # each key head serves `rep` value heads
        q = F.normalize(q.float().view(n, s.dn_k_heads, -1), dim=-1).repeat_interleave(rep, 1) * s.dn_head_dim ** -0.5
        k = F.normalize(k.float().view(n, s.dn_k_heads, -1), dim=-1).repeat_interleave(rep, 1)
        return q, k, v.float().view(n, s.dn_v_heads, -1)

    def gated_norm(self, o, z):
        """The recurrence's output o [N, H, dv] through the per-head norm and the output gate silu(z):
        [N, H * dv], the input of the output projection."""
        fused = gated_norm(o, z, self.o_norm)           # a chunk's rows: one kernel where kernels run
        if fused is not None:
            return fused
        n = o.shape[0]
        return (self.o_norm(o.to(z.dtype)) * F.silu(z.view(n, self.s.dn_v_heads, -1))).flatten(1)

    def _out(self, o, z):
        return matmul(self.gated_norm(o, z), self.w_o)

    def mix_reference(self, y: torch.Tensor, S: torch.Tensor, conv: torch.Tensor) -> torch.Tensor:
        """Decode, from the input projection y [B, C + dv + 2 H] to the output projection's input
        [B, H * dv] (conv window, gates, recurrence, norm, gate) in torch ops; S and conv in place.
        The definition `deltanet_step.deltanet_mix` (one kernel on the GPU) is checked against."""
        q, k, v, log_a, beta, z = self.inputs_from_projection(y, conv)
        return self.gated_norm(delta_step_reference(S, q, k, v, log_a, beta), z)

    def step_inputs(self, x: torch.Tensor, conv: torch.Tensor):
        """Decode, one token per request, up to the recurrence: x [B, hidden], conv [B, C, K-1] updated in
        place -> q, k [B, Hk, dk] (per key head, not repeated), v [B, H, dv], log_a, beta [B, H], z."""
        return self.inputs_from_projection(matmul(x, self.w_in), conv)

    def inputs_from_projection(self, y: torch.Tensor, conv: torch.Tensor):
        """`step_inputs` after the input projection y = x @ w_in [B, C + dv + 2 H]."""
        B = y.shape[0]
        qkv, z, a, b = torch.split(y, [self.conv_ch, self.splits[3], self.splits[4], self.splits[5]], dim=-1)
        window = torch.cat([conv, qkv.unsqueeze(-1)], dim=-1)                # [B, C, K]
        conv.copy_(window[..., 1:])
        conv_out = F.silu((window.float() * self.conv_w.float()).sum(-1)).to(y.dtype)
        q, k, v = self._qkv(conv_out, B, repeat=False)
        log_a, beta = self._gates(a, b)
        return q, k, v, log_a, beta, z

    def output(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return self._out(o, z)

    def step(self, x: torch.Tensor, S: torch.Tensor, conv: torch.Tensor) -> torch.Tensor:
        """One token per request: x [B, hidden]; S [B, H, dk, dv] fp32 and conv [B, C, K-1] updated in place.
        The engine runs the same three parts with the recurrence as one kernel (`deltanet_step`)."""
        q, k, v, log_a, beta, z = self.step_inputs(x, conv)
        return self._out(delta_step_reference(S, q, k, v, log_a, beta), z)

    def forward_seq(self, x: torch.Tensor, S: torch.Tensor, conv: torch.Tensor, chunk: int = 64,
                    mark=None) -> torch.Tensor:
        """A prompt chunk of one request: x [T, hidden]; S [H, dk, dv], conv [C, K-1] updated in place.
        `mark(phase)`: where the projections end and the scan starts, and back (a prefill anatomy's lines)."""
        return self.forward_segments(x, [(0, x.shape[0], S, conv)], chunk, mark)

    def forward_segments(self, x: torch.Tensor, segments: list, chunk: int = 64, mark=None) -> torch.Tensor:
        """Prompt chunks of several requests in one forward: x [N, hidden] their rows one request after another,
        `segments` [(a, e, S, conv)] each request's rows [a, e) in order with its own state and conv window
        (updated in place). The projections run once over all N rows (one larger product); the causal conv and
        the scan run per request, since each continues its own recurrence."""
        mark = mark or (lambda phase: None)
        qkv, z, a, b = torch.split(matmul(x, self.w_in), [self.conv_ch, self.splits[3], self.splits[4], self.splits[5]], dim=-1)
        mark("dn_scan")
        outs = [self._scan(qkv[r0:r1], a[r0:r1], b[r0:r1], S, conv, chunk) for r0, r1, S, conv in segments]
        mark("dn_weights")
        return self._out(outs[0] if len(outs) == 1 else torch.cat(outs), z)

    def _scan(self, qkv, a, b, S, conv, chunk: int) -> torch.Tensor:
        """One request's rows from the projection's parts to the recurrence's output [T, H, dv]; S, conv in place."""
        if dn_prefill_kernel(qkv.device) == "fla":     # the conv in one kernel, q/k per key head: deltanet_prefill
            return scan_fla(self, qkv, a, b, S, conv)
        conv_out = causal_conv_silu_reference(qkv, conv, self.conv_w)  # [T, C]
        q, k, v = self._qkv(conv_out, qkv.shape[0])
        log_a, beta = self._gates(a, b)
        o, S_new = delta_rule_chunked(q, k, v, log_a, beta, S, chunk=chunk)
        S.copy_(S_new)
        return o
