"""Where a prefill chunk's time goes: phase lines inside the chunk, each a CUDA event on the compute stream
(on a CPU, the host clock after a synchronize-free call: the CPU runs each op as it is issued).

    marks = PrefillMarks(device)
    engine.prefill(slot, tokens, marks=marks)
    marks.chunks()      # one dict per chunk: start, end, and ms per phase

A phase runs from its mark to the next one; `Engine.block` and the prefill io mark the lines (the same marks
as the decode step's anatomy, plus prefill's own). The phases, as `PHASES` names them:

- `weights`: the products by the layers' dense weights with the norms, RoPE and activations around them (QSA's
  projections and output, the FFN, DeltaNet's input and output projections);
- `experts`: a MoE layer's router, the routed experts (their alignment, grouped products and weighted sum) and the
  shared expert;
- `hc`: the hyper-connections' mixes before each sub-block and the injection of its output into the copies;
- `ngram`: the n-gram embedding's rows read from host RAM and added to the stream;
- `deltanet`: DeltaNet's causal conv and its chunked delta-rule scan;
- `kv_write`: the chunk's K/V rows to the pool (or the rotating buffer and its write-back's enqueue) and the
  index keys to the device;
- `kv_load`: the prefix read back for attention (sync: from the pool on the compute stream; rotating: the
  wait for the load stream, whose own time is on the load stream and not on this line);
- `index_score`, `selection`: the indexer over the prefix and the top-k (sparse prefill only);
- `attention`: attention over the prefix (dense) or the selected rows (sparse);
- `other`: the embedding, the head, and whatever falls between marks.

Events are read once the prefill is over, so marking adds no synchronization (a record is ~2 us against
chunks of tens of ms and more).
"""
from __future__ import annotations

import time

import torch

PHASES = ("weights", "experts", "hc", "ngram", "deltanet", "kv_write", "kv_load", "index_score", "selection",
          "attention", "other")
# the decode step's mark names that prefill shares, folded into prefill's phases (a DeltaNet block starts
# with its input projection: "deltanet" opens a weights line; "dn_scan" opens the scan)
_ALIAS = {"ffn": "weights", "dn_ffn": "weights", "dn_weights": "weights", "deltanet": "weights", "dn_scan": "deltanet",
          "transfer": "kv_load"}


class PrefillMarks:
    def __init__(self, device: torch.device):
        self.cuda = torch.device(device).type == "cuda"
        self._chunks: list[tuple[int, int, list]] = []
        self._cur: list | None = None

    def begin_chunk(self, start: int, end: int) -> None:
        self._cur = []
        self._chunks.append((start, end, self._cur))
        self.mark("other")

    def end_chunk(self) -> None:
        self.mark("end")
        self._cur = None

    def mark(self, phase: str, new_block: bool = False) -> None:
        if self._cur is None:
            return
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
        else:
            ev = time.perf_counter()
        self._cur.append((_ALIAS.get(phase, phase), ev))

    def chunks(self) -> list[dict]:
        """Per chunk: `start`, `end`, `chunk_ms` (first mark to last) and `<phase>_ms` for every phase."""
        if self.cuda:
            torch.cuda.synchronize()
        out = []
        for start, end, evs in self._chunks:
            row = {"start": start, "end": end, **{f"{p}_ms": 0.0 for p in PHASES}}
            for (phase, a), (_, b) in zip(evs, evs[1:]):
                ms = a.elapsed_time(b) if self.cuda else (b - a) * 1e3
                key = f"{phase if phase in PHASES else 'other'}_ms"
                row[key] += ms
            row["chunk_ms"] = (evs[0][1].elapsed_time(evs[-1][1]) if self.cuda
                               else (evs[-1][1] - evs[0][1]) * 1e3) if len(evs) > 1 else 0.0
            out.append(row)
        return out


class NoMarks:
    def mark(self, phase: str, new_block: bool = False) -> None:
        pass

    def begin_chunk(self, start: int, end: int) -> None:
        pass

    def end_chunk(self) -> None:
        pass
