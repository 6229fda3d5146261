"""The lab's headline H200 ratios, each measured in several separate processes: a ratio inside one
process is stable, a figure across processes moves (clocks, placement, what ran before), so the
spreads the docs quote come from here.

    python3 scripts/repeats.py OUT_DIR [--processes 3] [--only hot1m,decode64k,...] [--timeout-s 300]

Each (name, process) is one run folder `OUT_DIR/<name>-p<i>` made by `labkit.experiments.measure` in a
fresh Python process (no notebook: `labkit report DIR` draws it later); the processes of one name run
one after another, names in the order below. A failing process is recorded (`repeats.json`) and the
rest go on. `labkit docs` turns the folders into the across-process table (median, min, max, n).
"""
import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

TRACE = "trace:labkit/data/smollm2-135m-prose-indexer-b2048.npz"
SETS = {
    # FlashOffloading's and zero-copy's step against resident at 1M, c = 1 (the indexer's selections)
    "hot1m": ("decode", {"strategies": "resident,zero_copy,hot_cache", "context_lens": "1M", "concurrency": "1",
                         "budgets": "2048", "prefill_lens": "", "probe": False, "repeats": 5, "selection": "indexer"}),
    # the resident step against the weight-streaming roofline (read bandwidth measured in the same run)
    "decode64k": ("decode", {"strategies": "resident,zero_copy", "context_lens": "64K", "concurrency": "1,4",
                             "budgets": "2048", "prefill_lens": "", "probe": False, "repeats": 5,
                             "selection": "indexer"}),
    # requests held and goodput under a 24 GiB device cap, with and without offload
    "capacity": ("capacity", {"context_len": 32768, "mem_cap_gib": 24, "host_cap_gib": 40, "tpot_ms": 30,
                              "selection": TRACE, "steps": 10, "repeats": 2}),
    # PulseInfer's concurrency scaling at 1M: where offloading overtakes keeping everything resident
    "pulse_scaling": ("pulse_scaling", {"requests": "1,2,4,6,8,16", "steps": 6, "strategy": "block_dma",
                                        "select_block": 16, "dma_units_per_call": 512, "compile": True}),
    # prefill of a 248K prompt with the KV going to host RAM (rotating buffers) against resident
    "prefill248k": ("prefill", {"context_lens": "248K", "modes": "resident,rotating"}),
}
CHILD = ("import json, sys; from labkit.experiments import measure; "
         "measure(sys.argv[1], json.loads(sys.argv[2]), progress_bar=False)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("--processes", type=int, default=3)
    ap.add_argument("--only", default=",".join(SETS))
    ap.add_argument("--timeout-s", type=float, default=300)
    a = ap.parse_args()
    names = [n.strip() for n in a.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in SETS]
    if unknown or a.processes < 1:
        sys.exit(f"repeats: unknown set(s) {unknown} (known: {', '.join(SETS)})" if unknown
                 else "repeats: --processes must be >= 1")
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    log_path = out / "repeats.json"          # one log per folder: a later call adds its sets to it
    log = json.loads(log_path.read_text()) if log_path.exists() else []
    for name in names:
        exp, given = SETS[name]
        for i in range(1, a.processes + 1):
            folder = out / f"{name}-p{i}"
            t = time.time()
            try:
                p = subprocess.run([sys.executable, "-c", CHILD, exp, json.dumps({**given, "out_dir": str(folder)})],
                                   capture_output=True, text=True, timeout=a.timeout_s)
                rc, tail = p.returncode, (p.stdout + p.stderr)[-800:]
            except subprocess.TimeoutExpired:
                rc, tail = "timeout", ""
            log.append({"name": name, "experiment": exp, "process": i, "folder": folder.name, "rc": rc,
                        "wall_s": round(time.time() - t, 1), "tail": tail if rc != 0 else ""})
            print(f"{name} p{i}: rc={rc} in {log[-1]['wall_s']} s", flush=True)
            log_path.write_text(json.dumps(log, indent=1))


if __name__ == "__main__":
    main()
