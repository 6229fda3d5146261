"""The W4A16 decode kernels' machine code for one GPU architecture, without a GPU: registers a thread, spills, and
the instructions their K loop issues a weight byte, for the engine's launch and for each setting given.

    python3 scripts/w4_sass.py                                  # sm_90, the engine's settings
    python3 scripts/w4_sass.py --cc 86 --set W4_X_AHEAD=True --set "W4_X_AHEAD=True;W4_WARPS=2" --dump /tmp/sass
    python3 scripts/w4_sass.py --product dense4 --set "w4_decode.W4_MAXNREG=128"

Each `--set` is one compile with module settings changed (NAME=VALUE, several joined by ";"; `grouped_gemv`'s unless
prefixed `w4_decode.`). The launches are the ones the engine makes for the QSA input projection (2,560 x 13,696) at
one row (the row kernel) and at four (`dense4`: the tensor-core kernel), and for the routed experts' gate|up at one
row; Triton's compiler and ptxas compile them (`tests/aot.py`), `nvdisasm` lists them, and the loop is the innermost
span between a backward branch and its target that holds the products. Registers depend on the Triton version:
compile with the GPU host's (`pip install --target DIR triton==X`, `PYTHONPATH=DIR`) to read what it runs.

A loop's instructions a weight byte bound the stream by the issue rate, 4 warp instructions a cycle a
multiprocessor: at 14 a byte an H100 (132 SMs at 1.755 GHz) issues for at most 2.1 TB/s, two thirds of its HBM
read, before any latency is counted.
"""
from __future__ import annotations

import argparse
import ast
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests"), str(REPO / "scripts")]


def _launches(cc: int, product: str):
    """The recorded W4A16 launches of `product`: 'dense' (the QSA input projection at one row: the row kernel),
    'dense4' (the same at four rows: the tensor-core kernel `w4_decode`), 'experts' (gate|up at one row)."""
    import aot
    from labkit.engine.model import grouped_gemv as G
    from labkit.engine.model.routing import plan
    from labkit.engine.model.quant import QuantWeight
    from labkit.shapes import ModelShape
    s = ModelShape.from_name("qwen3.8-flash-next")

    def w4(E, N, K):
        return QuantWeight(torch.empty(E, N, K // 2, dtype=torch.uint8), torch.empty(E, N, K // 128),
                           torch.empty(E, N, K // 128, dtype=torch.uint8))
    with aot.launches(cc) as rec:
        if product in ("dense", "dense4"):
            rows = 4 if product == "dense4" else 1
            N, K = s.weight_matrices()["qsa.w_in"][1], s.weight_matrices()["qsa.w_in"][0]
            G.grouped_gemv(torch.empty(rows, K, dtype=torch.bfloat16), w4(1, N, K), G.Groups.one(rows, "cpu"))
        else:
            idx = torch.arange(s.experts_per_tok)[None]
            groups, _ = plan(idx)
            G.grouped_gemv(torch.empty(1, s.hidden, dtype=torch.bfloat16), w4(16, 2 * s.expert_intermediate, s.hidden),
                           groups, glu=True)
    return [r for r in aot.unique(rec) if r.name in ("_w4_rows_kernel", "_w4_dot_kernel")]


def _nvdisasm() -> str:
    import triton
    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm")


def loop_body(sass: list[str]) -> list[str]:
    """The instructions of the K loop: of the spans from a backward branch's target to the branch, the shortest
    of those that hold the most FFMA (the outer loop over a group's rows holds the same products and more)."""
    labels = {}
    for i, line in enumerate(sass):
        m = re.match(r"^\.(L_x_\d+):", line.strip())
        if m:
            labels[m.group(1)] = i
    spans = []
    for i, line in enumerate(sass):
        m = re.search(r"\bBRA\b.*\.(L_x_\d+)", line)
        if m and m.group(1) in labels and labels[m.group(1)] < i:
            body = [ln for ln in sass[labels[m.group(1)]:i + 1] if re.match(r"^\s*/\*[0-9a-f]{4}\*/", ln)]
            spans.append((-sum(" FFMA " in ln for ln in body), len(body), body))
    return min(spans, key=lambda s: s[:2])[2] if spans else []


def inspect(launch, cc: int, dump: Path | None, tag: str) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    src = ASTSource(fn=launch.fn, signature=launch.signature, constexprs=launch.constants, attrs=launch.attrs)
    from labkit.engine.model import grouped_gemv as G
    from labkit.engine.model import w4_decode as D
    glu = bool(launch.const("GLU"))
    cap = G.W4_MAXNREG.get(glu) if launch.name == "_w4_rows_kernel" else D.W4_MAXNREG
    k = triton.compile(src, target=GPUTarget("cuda", cc, 32),
                       options={"num_warps": launch.num_warps, "num_stages": launch.num_stages,
                                **({"maxnreg": cap} if cap else {})})
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        sass = subprocess.run([_nvdisasm(), "-c", f.name], capture_output=True, text=True, check=True).stdout
        res = subprocess.run([_nvdisasm().replace("nvdisasm", "cuobjdump"), "-res-usage", f.name],
                             capture_output=True, text=True, check=True).stdout
    lines = sass.splitlines()
    body = loop_body(lines)
    BN = launch.const("BN")
    GT = launch.const("GT") if launch.name == "_w4_rows_kernel" else 1
    glu = bool(launch.const("GLU"))
    threads = 32 * launch.num_warps
    # the row kernel: two K tiles an iteration by hand, one under Triton's pipeliner (PIPE), each [BN, GT, 16] words
    # of 4 bytes; the tensor-core kernel: one group of 128 values [BN, 16] words (each twice for a gate|up weight)
    tiles = 2 if launch.name == "_w4_rows_kernel" and not launch.const("PIPE") else 1
    bytes_thread = tiles * BN * GT * 64 * (2 if glu else 1) / threads
    ops = {}
    for ln in body:
        m = re.search(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", ln)
        if m:
            ops[m.group(1)] = ops.get(m.group(1), 0) + 1
    if dump:
        dump.mkdir(parents=True, exist_ok=True)
        (dump / f"{tag}.sass").write_text(sass)
        (dump / f"{tag}.ptx").write_text(k.asm["ptx"])
    regs = re.search(r"REG:(\d+)", res)
    spill = re.search(r"STACK:(\d+)", res)
    return {"regs": int(regs.group(1)) if regs else None, "spills": int(spill.group(1)) if spill else None,
            "loop": len(body), "bytes_thread": bytes_thread,
            "per_byte": len(body) / bytes_thread if body else float("nan"),
            "top": sorted(ops.items(), key=lambda kv: -kv[1])[:10]}


def settings(text: str):
    """The weight bench's `knobs` for "NAME=VALUE;..." (`grouped_gemv`'s names unless prefixed `w4_decode.`)."""
    from weights_bench import knobs
    pairs = [item.split("=", 1) for item in text.split(";") if item]
    return knobs(**{(n if n.startswith("w4_decode.") else f"grouped_gemv.{n}"): ast.literal_eval(v) for n, v in pairs})


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cc", type=int, default=90, help="compute capability (80, 86, 89, 90)")
    ap.add_argument("--set", action="append", default=[""], help="grouped_gemv settings, NAME=VALUE[;NAME=VALUE]")
    ap.add_argument("--product", default="dense,experts", help="dense, dense4 (four rows: the tensor-core kernel), "
                    "experts (comma-separated)")
    ap.add_argument("--dump", type=Path, help="write each compile's SASS and PTX here")
    a = ap.parse_args()
    print("| settings | product | kernel | regs | spills | loop instr | weight bytes a thread | instr a byte | "
          "most issued |")
    print("|---|---|---|---|---|---|---|---|---|")
    for text in a.set:
        for product in a.product.split(","):
            with settings(text):
                for i, launch in enumerate(_launches(a.cc, product)):
                    tag = f"{product}-{text or 'engine'}-{i}".replace("=", "").replace(",", "_")
                    r = inspect(launch, a.cc, a.dump, tag)
                    top = " ".join(f"{k}:{v}" for k, v in r["top"][:6])
                    print(f"| {text or 'engine'} | {product} | {launch.name} | {r['regs']} | {r['spills']} | "
                          f"{r['loop']} | "
                          f"{r['bytes_thread']:.0f} | {r['per_byte']:.1f} | {top} |", flush=True)


if __name__ == "__main__":
    main()
