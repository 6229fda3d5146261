"""The hyper-connections' two-launch mix (`labkit/engine/model/hc_mix.py`) timed alone, a setting at a time.

    python3 scripts/hc_mix_bench.py OUT_DIR [--variants default,no-pdl,...] [--module FILE]

16 mixes of the published shape back to back in a CUDA graph (each its own weights, 13 MB a mix: past L2), each
taking the last one's output as its sub-block's, at one request and four; µs a mix, median over the graph's
replays, against the time its weights take at the HBM read rate measured in the same process (a variant that skips
a kernel: the other's weights). A variant changes
module settings (`VARIANTS`); `down-only` / `up-only` skip the other kernel's launch (the skipped kernel's outputs
stay as allocated: a timing, not a result). `--module FILE` times another version of the module (a copy of an
earlier commit's file, imports made absolute) beside this one, under the name `module`. Writes
OUT_DIR/hc_mix_bench.json.
"""
import argparse
import importlib.util
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from weights_bench import hbm_read_gbps, nbytes, timed_graph  # noqa: E402

from labkit.engine.model import hc_mix as X  # noqa: E402
from labkit.engine.model.layers import HyperConnection  # noqa: E402
from labkit.shapes import PRESETS  # noqa: E402

VARIANTS = {
    "default": {},
    "no-pdl": {"HC_PDL": False},
    "down-4-warps": {"HC_WARPS_DOWN": 4},
    "tail-rows-1": {"HC_TAIL_ROWS": 1},
    "bk-128": {"HC_BK": 128},
    "bk-512": {"HC_BK": 512},
    "bn-down-32": {"HC_BN_DOWN": 32},
    "bn-up-16": {"HC_BN_UP": 16},
    "down-only": {"_hc_up_kernel": "skip"},
    "up-only": {"_hc_down_kernel": "skip"},
}


class _Skip:
    """A kernel whose launches do nothing (`down-only`, `up-only`)."""
    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def chain(mod, hcs, rows: int, dev):
    g = torch.Generator(device=dev).manual_seed(rows)
    H, hc = hcs[0].w_up.shape[1] // hcs[0].hc, hcs[0].hc
    h0 = torch.randn(rows, hc * H, generator=g, device=dev).bfloat16()
    y0 = torch.randn(rows, H, generator=g, device=dev).bfloat16()
    inj0 = torch.randn(rows, hc, generator=g, device=dev).bfloat16()

    def run():
        h, d = h0, mod.Pending(inj0, y0)
        for w in hcs:
            h, y, _, inj = mod.hc_mix(w, h, d)
            d = mod.Pending(inj, y)
    return run


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--module", help="another version of hc_mix.py, timed as the variant 'module'")
    ap.add_argument("--count", type=int, default=16)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("hc_mix_bench: needs a CUDA GPU")
    dev = torch.device("cuda")
    s = PRESETS["qwen3.8-flash-next"]
    gen = torch.Generator(device=dev).manual_seed(0)
    hcs = [HyperConnection(s, gen, torch.bfloat16, dev) for _ in range(a.count)]
    per_mix = sum(nbytes(w.w_down) + nbytes(w.w_up) + nbytes(w.norm_w) for w in hcs) / a.count
    out = {"device": torch.cuda.get_device_name(), "hbm_read_gbps": hbm_read_gbps(dev), "bytes_per_mix": per_mix,
           "count": a.count, "rows": []}
    # a variant that skips a kernel reads only the other's weights: its bound is those bytes'
    down_b = sum(nbytes(w.w_down) + nbytes(w.norm_w) for w in hcs) / a.count
    up_b = sum(nbytes(w.w_up) + nbytes(w.norm_w) for w in hcs) / a.count
    mods = [(v, X, VARIANTS[v]) for v in a.variants.split(",") if v]
    if a.module:
        spec = importlib.util.spec_from_file_location("hc_mix_other", a.module)
        other = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(other)
        mods.append(("module", other, {}))
    for name, mod, settings in mods:
        saved = {k: getattr(mod, k) for k in settings}
        for k, v in settings.items():
            setattr(mod, k, _Skip() if v == "skip" else v)
        read = {"down-only": down_b, "up-only": up_b}.get(name, per_mix)
        bound_us = read / out["hbm_read_gbps"] / 1e3
        try:
            for rows in (1, 4):
                ts = timed_graph(chain(mod, hcs, rows, dev), dev)
                us = statistics.median(ts) * 1e3 / a.count
                out["rows"].append({"variant": name, "rows": rows, "us_per_mix": us, "bytes": read,
                                    "us_min": min(ts) * 1e3 / a.count, "us_max": max(ts) * 1e3 / a.count,
                                    "of_bound": bound_us / us})
                print(f"{name:14s} c={rows} {us:6.2f} µs a mix ({bound_us / us:4.0%} of the read rate; bound "
                      f"{bound_us:.2f} µs)", flush=True)
        except Exception as ex:            # a setting the kernels refuse: recorded, the bench goes on
            out["rows"].append({"variant": name, "error": f"{type(ex).__name__}: {ex}"[:300]})
            print(f"{name}: {type(ex).__name__}: {ex}"[:300], flush=True)
        finally:
            for k, v in saved.items():
                setattr(mod, k, v)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "hc_mix_bench.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
