"""One W4A16 product as the engine launches it at one request, for Nsight Compute: the QSA input projection's
shape (2,560 x 13,696) dense, or with `experts` a decode step's experts of the published shape (the routed and the
shared expert in `moe_step`'s launches). Needs a CUDA GPU; e.g.

    ncu --kernel-name regex:_w4_rows --launch-skip 3 --launch-count 1 --set full --csv --page details \\
        python3 scripts/ncu_w4.py dense > ncu_w4_dense.csv
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from labkit.engine.model.experts import MoE  # noqa: E402
from labkit.engine.model.grouped_gemv import Groups, grouped_gemv  # noqa: E402
from labkit.engine.model.quant import QuantWeight  # noqa: E402
from labkit.shapes import PRESETS  # noqa: E402


def main():
    if not torch.cuda.is_available():
        sys.exit("ncu_w4: needs a CUDA GPU")
    what = sys.argv[1] if len(sys.argv) > 1 else "dense"
    if what not in ("dense", "experts"):
        sys.exit(f"ncu_w4: dense or experts, got {what!r}")
    g = torch.Generator(device="cuda").manual_seed(0)
    if what == "experts":
        moe = MoE(PRESETS["qwen3.8-flash-next"], g, torch.bfloat16, "cuda", weights_dtype="w4a16")
        y = torch.randn(1, moe.s.hidden, generator=g, device="cuda").bfloat16()
        for _ in range(4):
            moe(y)
    else:
        w = QuantWeight.random(g, 2560, 13696, device="cuda")
        x = torch.randn(1, 2560, generator=g, device="cuda").bfloat16()
        for _ in range(4):
            grouped_gemv(x, w, Groups.one(1, "cuda"))
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
