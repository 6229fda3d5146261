"""`StepBuffers`: what the model's decode step reads and writes of a batch's state, declared.

The runner (`drive/runner.DecodeState`) owns the buffers, with fixed addresses so a CUDA graph can replay the
step; the model's `Engine.decode_segments` reads these and only these (tests/test_layout.py checks the
attributes the step touches against this list), so a new driver of the step knows what it must provide.
"""
from __future__ import annotations

from typing import Protocol

import torch


class StepBuffers(Protocol):
    batch: int                   # requests in the batch
    span: slice                  # their cache slots, a contiguous range
    slots: torch.Tensor          # [batch] int64: the same slots on the device
    k: int                       # rows kept per request and QSA layer (the budget, capped by the window)
    window: int                  # positions the indexer scores: the longest request now plus the steps to come
    tokens: torch.Tensor         # [batch]: this step's input tokens, overwritten with the next ones
    x_in: torch.Tensor           # [batch, hidden x hc]: a pipeline stage's input stream (no embedding)
    x_out: torch.Tensor          # [batch, hidden x hc]: a pipeline stage's output stream
    logits: torch.Tensor         # [batch, vocab]
    staging: torch.Tensor        # [batch x k, row words] int64: the loaded rows on the device
    rows_buf: torch.Tensor       # [QSA layers, batch x k] int64: each layer's selected pool rows
    last_sel: torch.Tensor       # [QSA layers, batch, k] int64: the selection, written in place
    last_valid: torch.Tensor     # [QSA layers, batch, k] bool
    experts_read: torch.Tensor   # [1] int64: distinct routed experts read, summed over the step's MoE layers
    trace: torch.Tensor | None   # recorded selections replayed instead of the indexer's, or None
    trace_step: torch.Tensor     # [] int64: the trace's step now

    def mark(self, phase: str, new_block: bool = False) -> None:
        """A phase boundary of the step (for its anatomy; nothing when the step is not being marked)."""
