"""Time to first token of the cross-model path against the large model's own prefill, one prompt at a time: the
timing both the cross-model experiment and its TTFT studies (frontier, seeded weights) take, and the two tidy rows
(large_prefill, mapped) it makes of repeated timings."""
from __future__ import annotations

import time
from pathlib import Path

import pandas as pd
import torch

from labkit.crossmodel import shm
from labkit.crossmodel.features import build_cache, call


def _stats(xs) -> dict:
    s = sorted(xs)
    return {"median": s[len(s) // 2] if len(s) % 2 else (s[len(s) // 2 - 1] + s[len(s) // 2]) / 2,
            "min": s[0], "max": s[-1]}


@torch.no_grad()
def large_ttft_once(large, ids: torch.Tensor) -> tuple[float, int]:
    """Seconds of the large model's own prefill + first token over ids [1, T], and that token."""
    t0 = time.perf_counter()
    logits = call(large, ids, logits_to_keep=1)[0].logits[0, -1]
    return time.perf_counter() - t0, int(logits.argmax())


@torch.no_grad()
def mapped_ttft_once(prod, models, ids: torch.Tensor) -> tuple[float, dict, int]:
    """Seconds of the producer path (small prefill + mapping + /dev/shm write + read into a cache + the
    large model's last-token forward) over ids [1, T], its stage breakdown, and its first token."""
    large = models.large
    t1 = time.perf_counter()
    info = prod.produce(ids[0].tolist())
    t2 = time.perf_counter()
    hdr = shm.validate(info["path"], ids[0].tolist(), prod.fingerprint, models.pair.large.layers,
                       models.pair.large.kv_heads, models.pair.large.head_dim)
    f = shm.KVFile(info["path"], hdr)
    kv = [tuple(x.transpose(0, 1).unsqueeze(0).clone() for x in f.layer(i)) for i in range(hdr.num_layers)]
    f.close()
    t3 = time.perf_counter()
    first = int(call(large, ids[:, -1:], build_cache(large, kv))[0].logits[0, -1].argmax())
    t4 = time.perf_counter()
    Path(info["path"]).unlink(missing_ok=True)
    return t4 - t1, {"small_prefill_s": info["small_prefill_s"], "mapping_s": info["mapping_s"],
                     "prefix_s": info["prefix_s"], "write_s": info["write_s"], "read_s": t3 - t2, "decode_first_s": t4 - t3}, first


def ttft_rows(n: int, t_large: list, t_map: list, parts: list, firsts_equal: list, shm_bytes: int, **extra) -> list[dict]:
    """The two tidy rows (large_prefill, mapped) of one prompt length from repeated timings (seconds)."""
    a, b = _stats(t_large), _stats(t_map)
    base = {"kind": "ttft", "backend": "transformers", "context_len": n, "concurrency": 1, "repeats": len(t_large), **extra}
    br = {k: float(pd.Series([x[k] for x in parts]).median()) * 1e3 for k in
          ("small_prefill_s", "mapping_s", "prefix_s", "write_s", "read_s", "decode_first_s") if k in parts[0]}
    return [dict(base, strategy="large_prefill", ttft_ms_median=a["median"] * 1e3, ttft_ms_min=a["min"] * 1e3,
                 ttft_ms_max=a["max"] * 1e3),
            dict(base, strategy="mapped", ttft_ms_median=b["median"] * 1e3, ttft_ms_min=b["min"] * 1e3,
                 ttft_ms_max=b["max"] * 1e3, speedup=a["median"] / b["median"],
                 first_token_agree=float(sum(firsts_equal) / len(firsts_equal)),
                 **{k.replace("_s", "_ms"): v for k, v in br.items()}, shm_bytes=shm_bytes)]
