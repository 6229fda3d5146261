"""QSA indexer: score every past token from its compressed index key, keep the top `budget`.

score[t] = scale[t] * sum_h w[h] * relu(q[h] . key8[t])   (DeepSeek-style lightning indexer; the
per-token scale factors out of the relu because it is positive). Keys are fp8 with one fp16 scale:
`index_dim + 2` bytes per token per layer, resident on the device.
"""
from __future__ import annotations

import torch

NEG_INF = float("-inf")


def index_scores(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, scales: torch.Tensor,
                 lens: torch.Tensor) -> torch.Tensor:
    """q [B, Hi, D], w [B, Hi], keys [B, cap, D] fp8, scales [B, cap] fp16, lens [B] -> scores [B, cap] fp32,
    -inf at positions >= lens (not yet written)."""
    cap = keys.shape[1]
    k = keys.to(q.dtype)                                            # [B, cap, D]
    s = torch.bmm(k, q.transpose(1, 2))                             # [B, cap, Hi]
    s = torch.relu(s).to(torch.float32)
    s = torch.bmm(s, w.to(torch.float32).unsqueeze(-1)).squeeze(-1) * scales.to(torch.float32)
    pos = torch.arange(cap, device=keys.device)
    return s.masked_fill(pos[None, :] >= lens[:, None], NEG_INF)


def select_topk(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k positions per row, sorted ascending (friendlier gathers), and which of them are real
    (fewer than k tokens written -> the rest are -inf and masked in attention)."""
    vals, pos = torch.topk(scores, k, dim=-1, sorted=False)
    pos, order = torch.sort(pos, dim=-1)
    valid = torch.gather(vals, -1, order) > NEG_INF
    # Unwritten positions point at row 0 instead: their bytes are still moved (k rows a step) but are
    # real, finite data, so the masked softmax weight 0 never meets a NaN from uninitialised memory.
    return torch.where(valid, pos, torch.zeros_like(pos)), valid
