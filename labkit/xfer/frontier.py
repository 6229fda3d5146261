"""The N frontier of a `first:N` pair: perplexity ratio (from `labkit.xfer.ablation`) against measured TTFT
speedup, per N and prompt length — the figure a user picks N from.

TTFT is measured end to end in one process on the transformers backend (`experiment.mapped_ttft_once`:
the real small model `first:N`, the mapper, /dev/shm write and read, the large model's last-token
forward) against the large model's own prefill + first token (`experiment.large_ttft_once`). Within a
repeat the large prefill is timed once and then every (N, mapper) in turn, so slow drifts of a shared
CPU hit all of them alike; medians over `repeats` after one warm-up.

    python -m labkit.xfer.frontier --ablation DIR --out results/<run> [--lens 2048,4096] [--repeats 2]

writes a run folder (experiment xfer, rendered by notebooks/xfer.ipynb): `metrics.parquet` (TTFT rows
with `small_layers` and `mapper`), `ablation.parquet` (the ablation's summary), `frontier.parquet`
(one row per N, mapper and length: ppl ratio, top-1 agreement, speedup, stage medians).
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import pandas as pd
import torch


def join(ablation: pd.DataFrame, ttft: pd.DataFrame) -> pd.DataFrame:
    """One row per (N, mapper, prompt length): quality beside the measured speedup."""
    q = ablation[ablation["stage"] == "frontier"].rename(columns={"config": "mapper"})
    t = ttft[(ttft["kind"] == "ttft") & (ttft["strategy"] == "mapped")]
    keep = ["small_layers", "mapper", "context_len", "speedup", "ttft_ms_median", "small_prefill_ms", "mapping_ms",
            "write_ms", "read_ms", "decode_first_ms", "first_token_agree"]
    large = ttft[(ttft["kind"] == "ttft") & (ttft["strategy"] == "large_prefill")][["context_len", "ttft_ms_median"]]
    large = large.groupby("context_len", as_index=False).median().rename(columns={"ttft_ms_median": "large_ttft_ms"})
    out = t[keep].merge(q, on=["small_layers", "mapper"], how="left").merge(large, on="context_len", how="left")
    return out.sort_values(["mapper", "context_len", "small_layers"]).reset_index(drop=True)


@torch.no_grad()
def measure(large_name: str, mappers: dict, lens, repeats: int, root: Path, log=print) -> list[dict]:
    """mappers: {(N, name): path}. Rows kind=ttft, one (large_prefill, mapped) pair per (N, name, length)."""
    from labkit.quality.corpora import sequences
    from labkit.xfer.experiment import large_ttft_once, mapped_ttft_once, ttft_rows
    from labkit.xfer.mapper import Mapper
    from labkit.xfer.pair import plan_pair
    from labkit.xfer.producer import Producer
    from labkit.xfer.transfer import load_models

    first = None
    prods = {}
    for (n, name), path in sorted(mappers.items()):
        pair = plan_pair(large_name, f"first:{n}")
        models = load_models(pair, large_model=(first.large, first.tokenizer) if first else None)
        first = first or models
        prods[(n, name)] = (Producer(models, Mapper.load(path, expect=pair), root, dtype=torch.float32), models)
    tok = first.tokenizer
    rows = []
    for n_tok in lens:
        docs = sequences(tok, "prose", n_tok, repeats + 1, split="eval")
        t_large, acc = [], {k: ([], [], []) for k in prods}
        for r in range(repeats + 1):
            ids = docs[r % len(docs)][1].view(1, -1)
            tl, first_true = large_ttft_once(first.large, ids)
            for k, (prod, models) in prods.items():
                tm, part, first_mapped = mapped_ttft_once(prod, models, ids)
                if r:
                    acc[k][0].append(tm)
                    acc[k][1].append(part)
                    acc[k][2].append(first_true == first_mapped)
            if r:
                t_large.append(tl)
            if log:
                log(f"{n_tok} tokens, repeat {r}{' (warm-up)' if r == 0 else ''}: large {tl * 1e3:.0f} ms")
        for (n, name), (tm, parts, eq) in acc.items():
            pair_rows = ttft_rows(n_tok, t_large, tm, parts, eq, prods[(n, name)][0].bytes_for(n_tok - 1),
                                  small_layers=n, mapper=name,
                                  feature_dim=max(w.shape[0] for w in prods[(n, name)][0].mapper.weights.values()))
            rows += pair_rows
            if log:
                m = pair_rows[1]
                log(f"TTFT {n_tok} tokens N={n} {name}: large {m['ttft_ms_median'] * m['speedup']:.0f} ms, mapped "
                    f"{m['ttft_ms_median']:.0f} ms ({m['speedup']:.2f}x; small {m['small_prefill_ms']:.0f}, "
                    f"mapping {m['mapping_ms']:.0f}, write {m['write_ms']:.0f}, read {m['read_ms']:.0f}, "
                    f"last+first {m['decode_first_ms']:.0f} ms)")
    return rows


def main(argv=None) -> int:
    from labkit.results import Run
    from labkit.xfer import shm

    ap = argparse.ArgumentParser(prog="python -m labkit.xfer.frontier", description=__doc__.splitlines()[0])
    ap.add_argument("--ablation", required=True, help="folder with ablation.csv / ablation_rows.csv / ablation.json")
    ap.add_argument("--mapper-dir", default=str(Path.home() / ".cache" / "labkit" / "xfer" / "ablation"))
    ap.add_argument("--mappers", default="frontier,frontier_old_default", help="mapper names of the ablation's frontier")
    ap.add_argument("--lens", default="2048,4096")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    ab = Path(a.ablation)
    meta = json.loads((ab / "ablation.json").read_text())
    summary = pd.read_csv(ab / "ablation.csv")
    names = [x for x in a.mappers.split(",") if x]
    mappers = {(n, name): Path(a.mapper_dir) / f"first{n}-{name}.safetensors" for n in meta["ns"] for name in names}
    mappers = {k: p for k, p in mappers.items() if p.is_file()}
    lens = [int(x) for x in a.lens.split(",")]
    params = {"large": meta["large"], "small": f"first:{meta['ablation_n']}", "frontier_ns": meta["ns"],
              "ttft_lens": lens, "repeats": a.repeats, "backend": "transformers", "torch_threads": a.threads,
              "mappers": sorted(set(names)), "ablation": meta, "out_dir": a.out}
    run = Run.create(a.out, "xfer", params)
    log = lambda m: print(time.strftime("%H:%M:%S"), m, flush=True)  # noqa: E731
    t0 = time.perf_counter()
    base = {"experiment": "xfer", "device": "cpu", "gpu_name": "cpu", "shape": meta["large"], "status": "ok", "error": None}
    rows = measure(meta["large"], mappers, lens, a.repeats, shm.default_root(), log=log)
    for r in rows:
        run.add(dict(base, **r))
    run.write_table("ablation", summary)
    rows_path = ab / "ablation_rows.csv"
    if rows_path.is_file():
        run.write_table("ablation_rows", pd.read_csv(rows_path))
    shutil.copy(ab / "ablation.json", run.path / "ablation.json")
    fr = join(summary, run.metrics())
    run.write_table("frontier", fr)
    run.finish("ok", wall_compute_s=round(time.perf_counter() - t0, 1))
    print(fr.round(3).to_string())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
