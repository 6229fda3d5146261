"""The reference model's n-gram embedding, where it lives: a table too large for the device (~49 GiB in the
public 4x RTX 3090 stack), kept in host RAM; each token reads `ngram_heads` rows of hidden / ngram_heads values,
which cross the host link beside the KV rows (a second stream, counted: `ModelShape.ngram_fetch_bytes`).

    table = NgramTable(shape, device, table_bytes=4 << 30)
    emb = table.lookup(tokens, pos)          # [N, hidden] on the device: the rows concatenated

The lab draws a row per (token, position, head) by a hash rather than the token's last n-gram: the same rows a
step and bytes, no token history to keep. The table's size is a parameter (the published one by default where
it fits the host): a step's cost is its rows, not the table's size, but a small table sits in the host's caches.
Rows are read by the zero-copy gather kernel straight from pinned host memory on CUDA (no staging, inside a
CUDA graph), by index_select on CPU.
"""
from __future__ import annotations

import torch

from ...shapes import BF16_BYTES, ModelShape
from .gather import gather_rows

_HASH = (1000003, 7919, 104729)         # token, position, head: primes for a row index that looks random


class NgramTable:
    def __init__(self, s: ModelShape, device: torch.device, table_bytes: int | None = None, seed: int = 0):
        if not s.ngram_heads or s.hidden % s.ngram_heads:
            raise ValueError(f"shape {s.name} has no n-gram embedding (ngram_heads {s.ngram_heads})")
        self.s, self.device = s, torch.device(device)
        self.heads, self.width = s.ngram_heads, s.hidden // s.ngram_heads
        row = self.width * BF16_BYTES
        if row % 8:
            raise ValueError(f"an n-gram row of {row} B is not a whole number of 8-byte words")
        self.rows = max(self.heads, (table_bytes or s.ngram_table_bytes) // row)
        pin = self.device.type == "cuda"
        self.host = torch.empty((self.rows, row // 8), dtype=torch.int64, pin_memory=pin)
        # seeded random bf16 values, one 16 MiB block drawn and tiled (filling 49 GiB draw by draw takes minutes)
        g = torch.Generator().manual_seed(seed)
        block = (torch.randn((min(self.rows, (16 << 20) // row), self.width), generator=g) * 0.02).to(torch.bfloat16)
        words = block.view(torch.int64)
        for a in range(0, self.rows, words.shape[0]):
            n = min(words.shape[0], self.rows - a)
            self.host[a:a + n] = words[:n]

    @property
    def nbytes(self) -> int:
        return self.host.numel() * 8

    def row_ids(self, tokens: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """[N * heads] int64 rows of the table for tokens [N] at positions pos [N]."""
        h = torch.arange(self.heads, device=tokens.device)
        mix = tokens.to(torch.int64)[:, None] * _HASH[0] + pos.to(torch.int64)[:, None] * _HASH[1] + h[None, :] * _HASH[2]
        return (mix % self.rows).reshape(-1)

    def lookup(self, tokens: torch.Tensor, pos: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """[N, hidden] bf16 on the device: each token's `heads` rows side by side."""
        ids = self.row_ids(tokens, pos)
        n = ids.shape[0]
        out = out if out is not None else torch.empty((n, self.host.shape[1]), dtype=torch.int64, device=self.device)
        gather_rows(self.host, ids, out)
        return out.view(torch.bfloat16).view(tokens.shape[0], -1)

    def fetch_bytes(self, tokens: int) -> int:
        return tokens * self.heads * self.width * BF16_BYTES
