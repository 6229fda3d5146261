"""What to send: synthetic requests (fixed or ranged lengths, closed-loop concurrency or Poisson arrivals)
and trace replay (the Mooncake conversation trace: arrival times, lengths, shared 512-token prefix blocks).

Prompts are token ids (the OpenAI completions API takes a list of ints), so input lengths are exact and
no tokenizer is needed on the client side. Ids come from a seeded generator over `[first_id, vocab_size)`,
skipping the low ids where tokenizers keep their special tokens.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from labkit.params import BadInput

FIRST_ID = 256          # below this: special/control tokens in common vocabularies
TRACE_BLOCK = 512       # Mooncake hash_ids name 512-token blocks


@dataclass
class RequestSpec:
    index: int
    prompt: list[int]
    output_len: int
    arrival_s: float | None = None      # offset from the start (open loop); None: as soon as a slot is free
    meta: dict = field(default_factory=dict)

    @property
    def input_len(self) -> int:
        return len(self.prompt)


def _lengths(rng: np.random.Generator, n: int, base: int, range_ratio: float) -> np.ndarray:
    """vLLM's random dataset convention: uniform in [base*(1-r), base*(1+r)] (r=0: fixed)."""
    if range_ratio <= 0:
        return np.full(n, base, dtype=np.int64)
    lo, hi = max(1, int(base * (1 - range_ratio))), max(1, int(base * (1 + range_ratio)))
    return rng.integers(lo, hi + 1, size=n)


def poisson_arrivals(n: int, rate: float, seed: int = 0, burstiness: float = 1.0) -> list[float]:
    """Arrival offsets (s) of `n` requests at `rate` req/s, generated exactly as `vllm bench serve` generates
    them for `--seed seed --request-rate rate --burstiness b`: one gamma(shape=b, scale=1/(rate*b)) gap per
    request (b=1: exponential, a Poisson process; b=inf: constant gaps), drawn from numpy's legacy generator
    seeded with `seed`, accumulated, then rescaled so the last arrival lands at n/rate (vLLM's own
    normalisation: both clients offer the same load). rate=inf: all at 0."""
    if not np.isfinite(rate):
        return [0.0] * n
    if rate <= 0 or not burstiness > 0:
        raise BadInput(f"request rate and burstiness must be > 0, got {rate} and {burstiness}")
    if burstiness == float("inf"):
        gaps = [1.0 / rate] * n
    else:
        rs, theta = np.random.RandomState(seed), 1.0 / (rate * burstiness)
        gaps = [float(rs.gamma(shape=burstiness, scale=theta)) for _ in range(n)]   # one draw per request, as vLLM
    t = np.cumsum(gaps).tolist()
    if t and t[-1] != 0:
        f = (n / rate) / t[-1]
        t = [x * f for x in t]
    return t


def synthetic(n: int, input_len: int, output_len: int, vocab_size: int, input_range: float = 0.0,
              output_range: float = 0.0, request_rate: float = float("inf"), seed: int = 0,
              burstiness: float = 1.0) -> list[RequestSpec]:
    if n < 1 or input_len < 1 or output_len < 1:
        raise BadInput("num_prompts, input length and output length must be >= 1")
    rng = np.random.default_rng(seed)
    ins, outs = _lengths(rng, n, input_len, input_range), _lengths(rng, n, output_len, output_range)
    arrivals = poisson_arrivals(n, request_rate, seed, burstiness) if np.isfinite(request_rate) else [None] * n
    return [RequestSpec(i, rng.integers(FIRST_ID, vocab_size, size=int(ins[i])).tolist(), int(outs[i]), arrivals[i])
            for i in range(n)]


def repeated(n_prompts: int, input_len: int, output_len: int, vocab_size: int, seed: int = 0) -> list[RequestSpec]:
    """Each of `n_prompts` distinct prompts twice, the repeat after all first sends (cold, cold, ..., warm, warm):
    what a host KV tier must serve when the device cache has no room to keep them."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(FIRST_ID, vocab_size, size=input_len).tolist() for _ in range(n_prompts)]
    out = [RequestSpec(i, p, output_len, None, {"prompt_id": i, "send": "first"}) for i, p in enumerate(prompts)]
    out += [RequestSpec(n_prompts + i, p, output_len, None, {"prompt_id": i, "send": "repeat"}) for i, p in enumerate(prompts)]
    return out


def salted(specs: list[RequestSpec], salt: int, vocab_size: int) -> list[RequestSpec]:
    """The same requests with every prompt position shifted by a per-run offset (`salt` seeds one offset per
    position, modulo the ids' range): prompts that were equal stay equal and prompts that shared a prefix still
    share it, within the run, while no prompt starts like any of an earlier run with another salt. A server
    that outlives the run (its prefix cache too) then serves every measured prompt cold."""
    if not salt or not specs:
        return specs
    span = vocab_size - FIRST_ID
    longest = max(len(s.prompt) for s in specs)
    shift = np.random.default_rng([int(salt), 1 << 33]).integers(1, span, size=longest)
    for s in specs:
        ids = np.asarray(s.prompt, dtype=np.int64)
        s.prompt = (FIRST_ID + (ids - FIRST_ID + shift[:len(ids)]) % span).tolist()
    return specs


def load_trace(path: str | Path) -> list[dict]:
    p = Path(path)
    if not p.is_file():
        raise BadInput(f"trace {p} does not exist")
    rows = []
    with open(p) as f:
        for ln, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                r = json.loads(line)
                rows.append({"timestamp": float(r["timestamp"]), "input_length": int(r["input_length"]),
                             "output_length": int(r["output_length"]), "hash_ids": list(r.get("hash_ids", []))})
            except (ValueError, KeyError, TypeError) as ex:
                raise BadInput(f"trace {p}:{ln}: not a trace record ({type(ex).__name__}: {ex})") from None
    if not rows:
        raise BadInput(f"trace {p} holds no requests")
    return rows


def trace_replay(path: str | Path, n: int, rate_multiplier: float, max_context: int, vocab_size: int,
                 max_output: int = 0, start: int = 0, seed: int = 0) -> list[RequestSpec]:
    """The first `n` requests of a trace (from `start`), arrivals scaled by `rate_multiplier` (2.0 = twice
    as fast), lengths capped to the model: output to `max_output` (if > 0), input to what leaves room for
    the output in `max_context`. Equal hash ids give equal 512-token blocks, so shared prefixes stay shared."""
    if rate_multiplier <= 0:
        raise BadInput(f"trace rate multiplier must be > 0, got {rate_multiplier}")
    rows = load_trace(path)[start:start + n]
    if not rows:
        raise BadInput(f"trace has no requests from index {start}")
    t0 = rows[0]["timestamp"]
    out = []
    for i, r in enumerate(rows):
        olen = max(1, min(r["output_length"], max_output) if max_output > 0 else r["output_length"])
        olen = min(olen, max_context - 1)
        ilen = max(1, min(r["input_length"], max_context - olen))
        ids: list[int] = []
        for h in r["hash_ids"]:
            if len(ids) >= ilen:
                break
            ids += np.random.default_rng([seed, int(h)]).integers(FIRST_ID, vocab_size, size=TRACE_BLOCK).tolist()
        if len(ids) < ilen:     # a trailing partial block unique to this request
            ids += np.random.default_rng([seed, 1 << 40, i]).integers(FIRST_ID, vocab_size, size=ilen - len(ids)).tolist()
        out.append(RequestSpec(i, ids[:ilen], olen, (r["timestamp"] - t0) / 1000.0 / rate_multiplier,
                               {"trace_input_length": r["input_length"], "trace_output_length": r["output_length"],
                                "trace_timestamp_ms": r["timestamp"]}))
    return out
