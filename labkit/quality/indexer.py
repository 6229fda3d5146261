"""A 66-byte-per-token attention indexer for a real model, calibrated on held-out text.

Per attention layer the index key of a token is `B^T k` (64 values) stored as fp8 e4m3 plus one fp16
scale (amax / 448): 64 + 2 = **66 B per token per layer**, the engine's QSA index-key size. `k` is
the token's post-RoPE key with all KV heads concatenated (`Hkv * head_dim`, 192 for SmolLM2-135M).
The query side is `A^T q`, with `q` the post-RoPE query summed over each KV head's query group and
concatenated the same way, so that `q . k` is exactly the sum of the layer's attention logits over
its query heads. The indexer score of (query, token) is `(A^T q) . dequant(B^T k)`; the layer keeps
the top-`budget` tokens (one set shared by all heads, like the engine's QSA indexer).

How A and B are obtained (`calibrate`): dense forward passes over calibration text collect the
second moments `C_q = E[q q^T]` and `C_k = E[k k^T]` per layer. The rank-64 `A B^T` minimizing
`E[(q^T (I - A B^T) k)^2]` (q, k drawn independently) is, with `Lq = C_q^{1/2}`, `Lk = C_k^{1/2}`
and `Lq Lk = U S V^T`: `A = Lq^-1 U_r S_r^1/2`, `B = Lk^-1 V_r S_r^1/2` (Eckart-Young in the
whitened space). Closed form, no training; the calibration text is disjoint from evaluation text
(`labkit.quality.corpora` splits files by a hash of their name).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..engine.model.kv import dequantize_index_keys, quantize_index_keys
from labkit.quality.sparse import SparseController, instrument



def _group_query(query: torch.Tensor, n_kv: int) -> torch.Tensor:
    """[B,Hq,T,D] -> [B,T,Hkv*D]: query summed over each KV head's group."""
    b, hq, t, d = query.shape
    return query.float().view(b, n_kv, hq // n_kv, t, d).sum(2).permute(0, 2, 1, 3).reshape(b, t, n_kv * d)


def _cat_keys(key: torch.Tensor) -> torch.Tensor:
    """[B,Hkv,T,D] -> [B,T,Hkv*D]."""
    b, h, t, d = key.shape
    return key.float().permute(0, 2, 1, 3).reshape(b, t, h * d)


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row fp8 e4m3 values + fp16 scale (the stored 66-byte key): the engine's quantiser, with the
    scale kept as a trailing dimension for broadcasting here."""
    vals, scale = quantize_index_keys(x)
    return vals, scale.unsqueeze(-1)


def dequantize_fp8(vals: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return dequantize_index_keys(vals, scale.squeeze(-1))


@dataclass
class Indexer:
    """Per-layer projections: q_proj[l] [Hkv*D, r], k_proj[l] [Hkv*D, r] (r = 64)."""

    q_proj: dict[int, torch.Tensor]
    k_proj: dict[int, torch.Tensor]
    rank: int = 64
    quantize: bool = True

    @property
    def bytes_per_token(self) -> int:
        return self.rank * (1 if self.quantize else 2) + 2

    def index_keys(self, layer: int, key: torch.Tensor) -> torch.Tensor:
        """The (de)quantized index keys [B,T,r] the engine would hold for `key` [B,Hkv,T,D]."""
        kc = _cat_keys(key) @ self.k_proj[layer].to(key.device)
        if self.quantize:
            kc = dequantize_fp8(*quantize_fp8(kc))
        return kc

    def scores(self, layer: int, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
        """Index scores [B,Tq,Tk] for query [B,Hq,Tq,D] against key [B,Hkv,Tk,D]."""
        qi = _group_query(query, key.shape[1]) @ self.q_proj[layer].to(query.device)
        return qi @ self.index_keys(layer, key).transpose(1, 2)

    def state_dict(self) -> dict:
        return {"q_proj": self.q_proj, "k_proj": self.k_proj, "rank": self.rank, "quantize": self.quantize}

    @classmethod
    def from_state_dict(cls, sd: dict) -> "Indexer":
        return cls(q_proj=sd["q_proj"], k_proj=sd["k_proj"], rank=sd["rank"], quantize=sd["quantize"])


class MomentCollector:
    """calibration_sink for SparseController: accumulates E[q q^T], E[k k^T] per layer (float64)."""

    def __init__(self):
        self.cq: dict[int, torch.Tensor] = {}
        self.ck: dict[int, torch.Tensor] = {}
        self.n: dict[int, int] = {}

    def __call__(self, layer: int, query: torch.Tensor, key: torch.Tensor) -> None:
        q = _group_query(query, key.shape[1]).reshape(-1, key.shape[1] * key.shape[3]).double().cpu()
        k = _cat_keys(key).reshape(-1, key.shape[1] * key.shape[3]).double().cpu()
        self.cq[layer] = self.cq.get(layer, 0) + q.T @ q
        self.ck[layer] = self.ck.get(layer, 0) + k.T @ k
        self.n[layer] = self.n.get(layer, 0) + q.shape[0]


def _sqrt_and_inv(c: torch.Tensor, eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    w, v = torch.linalg.eigh(c)
    w = w.clamp_min(eps * w.max())
    return (v * w.sqrt()) @ v.T, (v * w.rsqrt()) @ v.T


def projections_from_moments(cq: torch.Tensor, ck: torch.Tensor, rank: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """(A, B) with A B^T the best rank-`rank` stand-in for I under the moments (module docstring)."""
    lq, lq_inv = _sqrt_and_inv(cq)
    lk, lk_inv = _sqrt_and_inv(ck)
    u, s, vh = torch.linalg.svd(lq @ lk)
    r = min(rank, s.numel())
    a = lq_inv @ u[:, :r] * s[:r].sqrt()
    b = lk_inv @ vh[:r].T * s[:r].sqrt()
    return a.float(), b.float()


@torch.no_grad()
def calibrate(model, sequences: list[torch.Tensor], rank: int = 64, quantize: bool = True) -> Indexer:
    """Fit the indexer on `sequences` (1-D token tensors) with dense attention."""
    if rank < 1:
        raise ValueError(f"indexer rank must be >= 1, got {rank}")
    col = MomentCollector()
    ctl = instrument(model, SparseController(collect_overlap=False))
    prev_layers, prev_sink = ctl.layers, ctl.calibration_sink
    ctl.layers, ctl.calibration_sink = {}, col
    try:
        dev = next(model.parameters()).device
        for ids in sequences:
            model(input_ids=ids.view(1, -1).to(dev), use_cache=False)
    finally:
        ctl.layers, ctl.calibration_sink = prev_layers, prev_sink
    qp, kp = {}, {}
    for layer in sorted(col.cq):
        n = col.n[layer]
        qp[layer], kp[layer] = projections_from_moments(col.cq[layer] / n, col.ck[layer] / n, rank)
    return Indexer(q_proj=qp, k_proj=kp, rank=rank, quantize=quantize)
