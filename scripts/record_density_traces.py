"""Record selection traces of SmolLM2-135M at one context (8K) and several budgets, i.e. several
budget/context ratios (16/8K = 1/512 ... 2048/8K = 1/4), for the hot cache's density study (FlashOffloading).

    python scripts/record_density_traces.py OUT_DIR [--budgets 16,64,256,1024,2048] [--corpora prose,code]

The indexer policy (the quality lab's rank-64 fp8 indexer, calibrated on 1 x 8192 calibration tokens
of each corpus), a dense prefill of an 8000-token eval document, then 32 greedy steps per budget.
Writes OUT_DIR/<corpus>-indexer-<budget>.npz (schema of `labkit.quality.traces`). CPU, float32.
"""
import argparse
import time
from pathlib import Path

import torch

from labkit.models import load_model
from labkit.quality.corpora import sequences
from labkit.quality.evaluate import prepare_policies
from labkit.quality.traces import record_traces, save_trace


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--budgets", default="16,64,256,1024,2048")
    ap.add_argument("--corpora", default="prose,code")
    ap.add_argument("--prompt-len", type=int, default=8000)
    ap.add_argument("--steps", type=int, default=32)
    a = ap.parse_args()
    budgets = [int(x) for x in a.budgets.split(",")]
    corpora = a.corpora.split(",")
    out = Path(a.out)
    t0 = time.perf_counter()
    model, tok = load_model("smollm2-135m", dtype=torch.float32, device="cpu")
    ctl, _ = prepare_policies(model, tok, ["indexer"], corpora, 8192, 1, 512)
    for corpus in corpora:
        (name, ids), = sequences(tok, corpus, a.prompt_len, 1, split="eval")
        traces = record_traces(model, ids, ["indexer"], budgets, a.steps, controller=ctl,
                               meta={"model": "smollm2-135m", "corpus": corpus, "document": name})
        for (pol, b), tr in traces.items():
            save_trace(tr, out / f"{corpus}-{pol}-{b}.npz")
        print(f"{corpus}: {len(traces)} traces, {time.perf_counter() - t0:.0f}s", flush=True)


if __name__ == "__main__":
    main()
