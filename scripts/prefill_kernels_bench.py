"""Prefill's two big kernels against their bounds, in one process: dense attention of an 8K-token chunk over
prefixes of 8K-248K tokens (SDPA per KV head under a lower-right causal mask, the split cuDNN path, and cuDNN
alone on contiguous K/V with no mask: the kernel's ceiling at this shape) and DeltaNet's chunked delta rule
(the torch form and flash-linear-attention's kernel, checked equal), beside the dense bf16 peak of an 8192^3
GEMM measured here.

    python3 scripts/prefill_kernels_bench.py OUT_DIR [--prefixes 8K,64K,248K] [--repeats 5]

Writes OUT_DIR/prefill_kernels.json and .md. About 1-2 minutes on an H200.
"""
import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from labkit.engine.model import attention as A  # noqa: E402
from labkit.engine.model import layers as L  # noqa: E402
from labkit.params import parse_size  # noqa: E402
from labkit.shapes import ModelShape  # noqa: E402
from labkit.sweep import event_ms  # noqa: E402


def timed(fn, repeats: int, warmup: int = 2) -> dict:
    """GPU time of each call alone (CUDA events, a synchronize before each: the sweep core's isolated timer)."""
    ts = event_ms(fn, repeats, torch.device("cuda"), warmup=warmup, mode="isolated")
    return {"ms_median": statistics.median(ts), "ms_min": min(ts), "ms_max": max(ts), "repeats": repeats}


def gemm_peak(repeats: int) -> dict:
    n = 8192
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    t = timed(lambda: a @ b, repeats * 2, warmup=3)
    return {**t, "tflops": 2 * n ** 3 / t["ms_median"] / 1e9}


def attention(s: ModelShape, T: int, S: int, repeats: int, peak: float) -> list[dict]:
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(T, s.n_heads, s.head_dim, generator=g, device="cuda", dtype=torch.bfloat16)
    rows = torch.randn(S, 2 * s.n_kv_heads * s.head_dim, generator=g, device="cuda", dtype=torch.bfloat16)
    k, v = A.split_rows(rows, s.n_kv_heads, s.head_dim)
    pairs = T * (S - T) + T * (T + 1) / 2
    flops = 4 * s.n_heads * s.head_dim * pairs
    out = []
    ref = A.grouped_sdpa_attention(q, k, v).float()
    got = A.split_prefill_attention(q, k, v).float()
    err = (got - ref).abs().max().item()
    with A.fast_sdpa(q.device):
        variants = {"sdpa_lower_right": lambda: A.grouped_sdpa_attention(q, k, v),
                    "split_cudnn": lambda: A.split_prefill_attention(q, k, v)}
        qh = q.transpose(0, 1).unsqueeze(0).contiguous()
        kf = k.transpose(0, 1).repeat_interleave(s.n_heads // s.n_kv_heads, 0).unsqueeze(0).contiguous()
        vf = v.transpose(0, 1).repeat_interleave(s.n_heads // s.n_kv_heads, 0).unsqueeze(0).contiguous()
        ceiling = lambda: A._cudnn(qh, kf, vf, causal=False)     # noqa: E731  (all T x S pairs, no mask)
        for name, fn in variants.items():
            t = timed(fn, repeats)
            out.append({"kernel": name, "T": T, "S": S, **t, "tflops": flops / t["ms_median"] / 1e9,
                        "of_gemm_peak": flops / t["ms_median"] / 1e9 / peak,
                        "max_abs_err_vs_sdpa": err if name == "split_cudnn" else 0.0})
        t = timed(ceiling, repeats)
        full = 4 * s.n_heads * s.head_dim * T * S
        out.append({"kernel": "cudnn_no_mask_contiguous", "T": T, "S": S, **t, "tflops": full / t["ms_median"] / 1e9,
                    "of_gemm_peak": full / t["ms_median"] / 1e9 / peak})
    return out


def deltanet(s: ModelShape, T: int, repeats: int) -> list[dict]:
    g = torch.Generator(device="cuda").manual_seed(1)
    H, dk, dv = s.dn_v_heads, s.dn_head_dim, s.dn_head_dim
    q = torch.nn.functional.normalize(torch.randn(T, H, dk, generator=g, device="cuda"), dim=-1) * dk ** -0.5
    k = torch.nn.functional.normalize(torch.randn(T, H, dk, generator=g, device="cuda"), dim=-1)
    v = torch.randn(T, H, dv, generator=g, device="cuda")
    log_a = -torch.rand(T, H, generator=g, device="cuda") * 0.1
    beta = torch.rand(T, H, generator=g, device="cuda")
    S0 = torch.randn(H, dk, dv, generator=g, device="cuda") * 0.1
    o_t, S_t = L.delta_rule_chunked(q, k, v, log_a, beta, S0)
    out = [{"kernel": "dn_torch", "T": T, **timed(lambda: L.delta_rule_chunked(q, k, v, log_a, beta, S0), repeats)}]
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule  # noqa: F401
    except ImportError as ex:
        return out + [{"kernel": "dn_fla", "T": T, "error": str(ex)}]
    before = L.DN_PREFILL
    L.DN_PREFILL = "fla"
    try:
        o_f, S_f = L.delta_rule_prefill(q, k, v, log_a, beta, S0)
        t = timed(lambda: L.delta_rule_prefill(q, k, v, log_a, beta, S0), repeats)
    finally:
        L.DN_PREFILL = before
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()      # noqa: E731
    return out + [{"kernel": "dn_fla", "T": T, **t, "rel_err_out": rel(o_f, o_t), "rel_err_state": rel(S_f, S_t)}]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--prefixes", default="8K,64K,248K")
    ap.add_argument("--chunk", default="8K")
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("prefill_kernels_bench: needs a CUDA GPU")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    s = ModelShape.from_name("qwen3.8-flash-next")
    T = parse_size(a.chunk)
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "cudnn": torch.backends.cudnn.version(), "gemm": gemm_peak(a.repeats)}
    peak = res["gemm"]["tflops"]
    res["attention"] = [r for S in a.prefixes.split(",") for r in attention(s, T, max(T, parse_size(S)), a.repeats, peak)]
    res["deltanet"] = deltanet(s, T, a.repeats)
    (out / "prefill_kernels.json").write_text(json.dumps(res, indent=1))
    lines = [f"# Prefill kernels on {res['gpu']} (torch {res['torch']}, cuDNN {res['cudnn']})", "",
             f"Dense bf16 peak (8192^3 GEMM): **{peak:.0f} TFLOPS**", "",
             "| kernel | chunk | keys | ms (median, min-max) | TFLOPS | of GEMM peak |", "|---|---|---|---|---|---|"]
    for r in res["attention"]:
        lines.append(f"| {r['kernel']} | {r['T']:,} | {r['S']:,} | {r['ms_median']:.2f} ({r['ms_min']:.2f}-{r['ms_max']:.2f}) "
                     f"| {r['tflops']:.0f} | {r['of_gemm_peak']:.0%} |")
    lines += ["", "| DeltaNet scan | tokens | ms (median, min-max) | rel. error vs torch (out, state) |", "|---|---|---|---|"]
    for r in res["deltanet"]:
        if "error" in r:
            lines.append(f"| {r['kernel']} | {r['T']:,} | not run: {r['error']} | |")
            continue
        err = f"{r['rel_err_out']:.1e}, {r['rel_err_state']:.1e}" if "rel_err_out" in r else "reference"
        lines.append(f"| {r['kernel']} | {r['T']:,} | {r['ms_median']:.2f} ({r['ms_min']:.2f}-{r['ms_max']:.2f}) | {err} |")
    (out / "prefill_kernels.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
