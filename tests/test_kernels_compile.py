"""Every Triton kernel the engine can launch compiles for the GPUs the lab names, without a GPU.

The reference box is Ampere (sm_86, RTX 3090; sm_80 is the A100), users have Ada (sm_89), the device host is
Hopper (sm_90). The interpreter runs what a compiler may refuse (an fp8 type the architecture has no load for,
inline PTX it cannot assemble, a tile whose shared memory it cannot give): so each kernel is compiled for each
architecture by Triton's own compiler and ptxas, at the reference shape's tiles, from the launches the
engine's wrappers make as they would on that GPU (`aot.launches`: the wrappers take that GPU's decisions —
the fp8 operand, PDL, the inline-PTX store — and nothing runs). Its shared memory is checked against the
architecture's limit.

`test_every_kernel_is_compiled_or_excluded` is the inventory: a `@triton.jit` kernel in `labkit/` that no
driver below launches and no exclusion names, with its reason, fails it.
"""
from __future__ import annotations

import ast
import concurrent.futures as cf
import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))
import aot  # noqa: E402

from labkit.shapes import ModelShape  # noqa: E402

REF = ModelShape.from_name("qwen3.8-flash-next")

# kernels no driver launches, each with why it is not compiled here
EXCLUDED = {
    "_decode_kernel": "fp8.decode's test kernel: the e4m3 decode it wraps is compiled inside the index scorer and "
                      "sparse prefill's key tile on every architecture",
}


def _e(*shape, dtype=torch.bfloat16):
    return torch.empty(shape, dtype=dtype)


# ------------------------------------------------------------------ drivers: the engine's launches

def drive_decode_indexer():
    from labkit.engine.model import indexer, select
    for B, L in ((1, 65536), (4, 1 << 20)):
        q, w = _e(B, REF.index_heads, REF.index_dim), _e(B, REF.index_heads)
        keys = _e(B, L, REF.index_dim, dtype=torch.float8_e4m3fn)
        sc, lens = _e(B, L, dtype=torch.float16), torch.full((B,), L)
        indexer.index_scores_triton(q, w, keys, sc, lens)
        s = _e(B, L, dtype=torch.float32)
        rows, table = _e(B, 2048, dtype=torch.int64), _e(B, L // 16, dtype=torch.int64)
        select.select_topk(s, 2048, pages=(rows, table, 16))
        select.select_topk_triton(s, 2048, bound=True)


def drive_gemv():
    from labkit.engine.model import gemv
    for name, (K, N, _) in REF.weight_matrices().items():
        if name in ("moe.w_gu", "moe.w_d"):          # the routed experts: the grouped kernel's (drive_experts)
            continue
        for M in (1, 4, 16):
            for k_major in (True, False):
                w = _e(N, K).t() if k_major else _e(K, N)
                if not gemv.layout_ok(w) or N == 1:        # a one-column product is torch's (matmul's rule)
                    continue
                x = _e(M, K)
                glu = name.endswith("w_gu")
                gemv.gemv(x, w, glu=glu)
                if M == 1:
                    gemv.gemv(x, w, glu=glu, norm=(_e(M, K), _e(K), 1e-6))


def drive_deltanet():
    from labkit.engine.model import deltanet_prefill, deltanet_step
    from labkit.engine.model.layers import DeltaNetLayer
    H, HK, D = REF.dn_v_heads, REF.dn_k_heads, REF.dn_head_dim
    for B in (1, 4):
        deltanet_step.delta_step(_e(B, H, D, D, dtype=torch.float32), _e(B, H, D), _e(B, H, D), _e(B, H, D),
                                 _e(B, H, dtype=torch.float32), _e(B, H))
        mixer = _layer(DeltaNetLayer)
        C = 2 * HK * D + H * D
        y = _e(B, C + H * D + 2 * H)
        deltanet_step.deltanet_mix(mixer, y, _e(B, H, D, D, dtype=torch.float32), _e(B, C, REF.dn_conv - 1))
    C = 2 * HK * D + H * D
    deltanet_prefill.causal_conv_silu(_e(8192, C), _e(C, REF.dn_conv - 1), _e(C, REF.dn_conv))


def drive_qsa_step():
    from labkit.engine.model import qsa_step
    from labkit.engine.model.layers import QSALayer
    mixer = _layer(QSALayer)
    for B in (1, 4):
        qsa_step.qsa_heads(mixer, _e(B, REF.weight_matrices()["qsa.w_in"][1]), _e(B, dtype=torch.int64))


def drive_transfers():
    from labkit.engine.model import gather
    from labkit.engine.transfer import hot_attention, hot_gather, hot_plan
    from labkit.engine.transfer.hot_cache import HotIndex
    W = REF.row_bytes // 8
    k, n_kv, D = 2048, REF.n_kv_heads, REF.head_dim
    for B in (1, 4):
        M = B * k
        src, rows, out = _e(1 << 16, W, dtype=torch.int64), _e(M, dtype=torch.int64), _e(M, W, dtype=torch.int64)
        gather.gather_rows(src, rows, out)
        gather.gather_rows_paced(src, rows, out, 64)
        gather.scatter_rows(out, rows, src)
        slots, slot, victim = _e(4096 * B + 1, W, dtype=torch.int64), _e(M, dtype=torch.int64), _e(M, dtype=torch.int64)
        hot_gather.gather_hot_rows(src, rows, slots, slot, victim, out)
        hot_gather.gather_hot_rows(src, rows, slots, None, None, out, rev=_e(1 << 16, dtype=torch.int32))
        hot_gather.insert_rows(out, victim, slots)
        q, valid = _e(B, REF.n_heads, D), _e(B, k, dtype=torch.bool)
        hot_attention.hot_sparse_attention(q, src, slots, rows, slot, victim, valid, n_kv)
        hot_attention.hot_sparse_attention(q, src, slots, rows, slot, victim, valid, n_kv,
                                           rev=_e(1 << 16, dtype=torch.int32), stage=_e(M, W, dtype=torch.int64))
        index = HotIndex(REF.attn_layers, B, 4096, 1 << 16)
        hot_plan.hot_plan(index, 0, rows, REF.row_bytes)


def drive_sparse_prefill():
    from labkit.engine.model import sparse_prefill as P
    T, S, Hi, Di = 8192, 1 << 18, REF.index_heads, REF.index_dim
    iq, iw = _e(T, Hi, Di), _e(T, Hi)
    keys, sc, qp = _e(S, Di, dtype=torch.float8_e4m3fn), _e(S, dtype=torch.float16), torch.arange(S - T, S)
    for splits in (1, 4):
        P.prefill_select_triton(iq, iw, keys, sc, qp, 2048, splits=splits)
    P.prefill_select_triton(iq, iw, keys, sc, qp, 2048, method="exact")
    # the collect tiles the bench sweeps
    for bt, bs, warps in ((64, 64, 4), (16, 64, 8)):
        P.prefill_select_triton(iq, iw, keys, sc, qp, 2048, bt_sampled=bt, bs_sampled=bs, warps_sampled=warps,
                                splits=4, hoist=bt == 64)
    q, kv = _e(T, REF.n_heads, REF.head_dim), _e(S, REF.n_kv_heads, REF.head_dim)
    P.sparse_prefill_attention(q, kv, kv, torch.zeros(T, 2048, dtype=torch.int64), torch.ones(T, 2048, dtype=torch.bool))
    from labkit.engine.model.attention import merge_by_lse     # dense prefill's two partial attentions merged
    o, lse = _e(1, REF.n_heads, T, REF.head_dim), _e(1, REF.n_heads, T, dtype=torch.float32)
    merge_by_lse(o, lse, o, lse)


def drive_experts():
    """The routed experts at decode (one request, four) and in a prefill chunk, bf16 and W4A16, and the W4A16
    dense products (one group); the router's top-k and plan in one launch; the W4A16 products through each of the
    two decode kernels (`grouped_gemv.W4_KERNEL`: the tensor-core kernel as the engine takes it for dense products
    of 2-16 rows, and for every product)."""
    from labkit.engine.model import grouped_gemv as G
    from labkit.engine.model.routing import plan, route_plan
    from labkit.engine.model.grouped_gemv import Groups, dequantize_w4, grouped_gemv
    from labkit.engine.model.quant import QuantWeight
    H, I, E, k = REF.hidden, REF.expert_intermediate, 16, REF.experts_per_tok
    for T in (1, 4):
        route_plan(_e(T, REF.experts), _e(REF.experts, dtype=torch.float32), k)
    _drive_moe_step(H, I, k)
    saved = G.W4_KERNEL
    try:
        for kernel in ("auto", "dot"):
            G.W4_KERNEL = kernel
            _drive_experts(H, I, E, k, Groups, QuantWeight, plan, grouped_gemv, dequantize_w4)
    finally:
        G.W4_KERNEL = saved


def _drive_experts(H, I, E, k, Groups, QuantWeight, plan, grouped_gemv, dequantize_w4):
    for quant in (False, True):
        if quant:
            gu = QuantWeight(_e(E, 2 * I, H // 2, dtype=torch.uint8), _e(E, 2 * I, H // 128), _e(E, 2 * I, H // 128,
                                                                                                  dtype=torch.uint8))
            d = QuantWeight(_e(E, H, I // 2, dtype=torch.uint8), _e(E, H, I // 128), _e(E, H, I // 128, dtype=torch.uint8))
        else:
            gu, d = _e(E, 2 * I, H), _e(E, H, I)
        g = torch.Generator().manual_seed(0)      # the same routing, so the same launches, in every process
        for T in (1, 4, 8192):
            groups, _ = plan(torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]))
            act = grouped_gemv(_e(T, H), gu, groups, glu=True)
            grouped_gemv(act, d, groups, gather=False)
        if quant:                # the chunk's grouped GEMMs as the published shape takes them (W4A16)
            _drive_moe_gemm(gu, d, E, k, H, g)
        for M in (1, 4):
            for K, N, glu in ((H, 2 * I, True), (H, 13824, False), (6144, H, False)):
                w = QuantWeight(_e(1, N, K // 2, dtype=torch.uint8), _e(1, N, K // 128), _e(1, N, K // 128,
                                                                                            dtype=torch.uint8))
                if quant:
                    grouped_gemv(_e(M, K), w, Groups.one(M, "cpu"), glu=glu)
                    if M == 1:
                        dequantize_w4(w)            # a prefill chunk's dense product: dequantised, then cuBLAS


def _drive_moe_step(H, I, k):
    """A decode step's W4A16 experts in three launches (`moe_step`: the routing with the shared expert's group, the
    gate|up launch with the shared weight beside the stack, the down launch ending in the weighted sum)."""
    from labkit.engine.model import moe_step
    from labkit.engine.model.quant import QuantWeight

    def w4(E, N, K):
        return QuantWeight(_e(E, N, K // 2, dtype=torch.uint8), _e(E, N, K // 128), _e(E, N, K // 128,
                                                                                   dtype=torch.uint8))
    E = REF.experts
    gu, d, sgu, sd = w4(E, 2 * I, H), w4(E, H, I), w4(1, 2 * I, H), w4(1, H, I)
    for T in (1, 4):
        torch.ops.labkit.moe_step(_e(T, H), _e(T, E + 1), _e(E, dtype=torch.float32), gu.q, gu.scales, gu.zeros,
                                  d.q, d.scales, d.zeros, sgu.q, sgu.scales, sgu.zeros, sd.q, sd.scales, sd.zeros, k)


def _drive_moe_gemm(gu, d, E, k, H, g):
    """A prefill chunk's routed experts as the engine takes them (`moe_gemm.routed_experts`: the two grouped GEMMs
    and the combine with the shared expert)."""
    from labkit.engine.model import moe_gemm
    T = 8192
    experts = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    moe_gemm.routed_experts(_e(T, H), gu, d, experts, _e(T, k, dtype=torch.float32), E, _e(T, H), _e(T, 1))


def drive_hc_mix():
    """The hyper-connections' two-launch mix at decode (one request, four), with the injection and n-gram rows
    pending and with a tensor to add; the chunk mix of prefill (pending with the n-gram rows, and a tensor to add), its
    residual add and norm."""
    from labkit.engine.model.hc_mix import Pending, hc_mix
    from labkit.engine.model.layers import HyperConnection
    hc = _layer(HyperConnection)
    H, HH = REF.hidden, REF.hidden * REF.hc_count
    for M in (1, 4):
        hc_mix(hc, _e(M, HH), Pending(_e(M, REF.hc_count), _e(M, H), _e(M, H)))
        hc_mix(hc, _e(M, HH), _e(M, HH))
    from labkit.engine.model import hc_chunk          # a prefill chunk's mixes
    hc_chunk.mix(hc, _e(8192, HH), Pending(_e(8192, REF.hc_count), _e(8192, H), _e(8192, H)))
    hc_chunk.mix(hc, _e(8192, HH), _e(8192, HH))
    from labkit.engine.model.layers import RMSNorm    # a prefill chunk's residual add and norm
    from labkit.engine.model.norm_rows import add_norm
    add_norm(_e(8192, H), _e(8192, H), RMSNorm(H, torch.bfloat16, "cpu"))
    from labkit.engine.model.norm_rows import gated_norm       # DeltaNet's output gate over a chunk
    gated_norm(_e(8192, REF.dn_v_heads, REF.dn_head_dim), _e(8192, REF.dn_v_heads * REF.dn_head_dim),
               RMSNorm(REF.dn_head_dim, torch.bfloat16, "cpu"))


DRIVERS = [drive_decode_indexer, drive_gemv, drive_deltanet, drive_qsa_step, drive_transfers, drive_sparse_prefill,
           drive_experts, drive_hc_mix]


@functools.lru_cache(maxsize=None)
def _layer(cls):
    """One layer of the reference shape on the CPU (random weights, tens of MB): the wrappers read its shape,
    its weights' dtypes and strides."""
    return cls(REF, torch.Generator().manual_seed(0), torch.bfloat16, "cpu")


# ------------------------------------------------------------------ the compile

def record(cc: int) -> list:
    from labkit.engine.model import arch
    return _record(cc, arch.MODE)


@functools.lru_cache(maxsize=None)
def _record(cc: int, mode: str) -> list:
    with aot.launches(cc) as rec:
        for drive in DRIVERS:
            drive()
    return aot.unique(rec)


def to_compile(cc: int) -> list:
    """Every launch for sm_86 (the reference box) and sm_90 (the device host). sm_80 lowers as sm_86 does
    (mma.sync, no wgmma; Triton leaves LLVM's SLP vectorizer off for sm_80 alone, so its code differs from sm_86's
    throughout): one launch of each kernel and operand types. sm_89 lowers as sm_86 does but for fp8 (Triton's
    NVIDIA backend tells the two apart by the native e4m3 type and its conversions, from capability 89) and grants the
    same shared memory a block: a launch identical to one of sm_86's (signature, constexprs, attributes, warps
    and stages) with no fp8 operand gives the same code, compiled and checked already for sm_86; so sm_89
    compiles, one of each kernel and operand types, the launches whose code differs from sm_86's (those the
    native e4m3 load changes). No launch is left out for shared memory: sm_80 gives more than sm_86, sm_89 the
    same."""
    launches = record(cc)
    if cc in (86, 90):
        return launches
    if cc == 89:
        same_as_86 = {launch.key() for launch in record(86)}
        launches = [launch for launch in launches if launch.key() not in same_as_86
                    or any("fp8" in str(t) for _, t in launch.operands())]
    seen, out = set(), []
    for launch in launches:
        key = (launch.name, launch.operands())
        if key not in seen:
            seen.add(key)
            out.append(launch)
    return out


def _compile_share(i: int, n: int) -> list[dict]:
    """Process i of n side by side: every n-th launch, from the i-th, of every architecture's list in turn, so the
    processes share the long compiles (sm_86's and sm_90's full lists) evenly."""
    jobs = [(cc, launch) for cc in aot.ARCHS for launch in to_compile(cc)]
    return [aot.compile_one(launch, cc) for cc, launch in jobs[i::n]]


def jit_kernels() -> set[str]:
    """Every function decorated with triton.jit in labkit/, by name."""
    names = set()
    for path in (REPO / "labkit").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef):
                for d in node.decorator_list:
                    src = ast.unparse(d)
                    if src.startswith("triton.jit"):
                        names.add(node.name)
    return names


def test_every_kernel_is_compiled_or_excluded():
    """A kernel is an entry (launched by a driver), a helper called from an entry's source, or excluded with
    its reason; nothing else passes."""
    launched = {launch.name for launch in record(86)} | {launch.name for launch in record(90)}
    entries = {launch.fn for launch in record(90)}
    helpers_used = set()
    for fn in entries:
        helpers_used |= {n.id for n in ast.walk(ast.parse(fn.src)) if isinstance(n, ast.Name)}
        helpers_used |= {n.attr for n in ast.walk(ast.parse(fn.src)) if isinstance(n, ast.Attribute)}
    # helpers call helpers: close over the called functions' own sources
    jit = jit_kernels()
    frontier = {h for h in helpers_used & jit}
    while frontier:
        nxt = set()
        for mod_fn in _jit_functions():
            if mod_fn.fn.__name__ in frontier:
                nxt |= {n.id for n in ast.walk(ast.parse(mod_fn.src)) if isinstance(n, ast.Name)} & jit
                nxt |= {n.attr for n in ast.walk(ast.parse(mod_fn.src)) if isinstance(n, ast.Attribute)} & jit
        frontier = nxt - helpers_used
        helpers_used |= nxt
    missing = jit - launched - helpers_used - set(EXCLUDED)
    assert not missing, f"kernels neither compiled by a driver nor excluded with a reason: {sorted(missing)}"
    assert not set(EXCLUDED) & launched, "an excluded kernel is launched: take it off the exclusions"


def _jit_functions():
    import importlib
    out = []
    for path in (REPO / "labkit").rglob("*.py"):
        text = path.read_text()
        if "triton.jit" not in text:
            continue
        mod = importlib.import_module(".".join(path.relative_to(REPO).with_suffix("").parts))
        out += [v for v in vars(mod).values() if isinstance(v, triton.runtime.jit.JITFunction)]
    return out


def test_the_decisions_follow_the_architecture():
    """On Ampere the index keys reach the kernels as bytes, PDL and the inline-PTX store are off; on Hopper the
    native forms are taken (unless arch=portable)."""
    def facts(cc):
        rec = record(cc)
        k_types = {launch.signature.get("k_ptr") for launch in rec if launch.name in
                   ("_index_score_kernel", "_sample_kernel", "_collect_sampled_kernel")}
        asm = {launch.const("ASM") for launch in rec if launch.name == "_collect_sampled_kernel"}
        gdc = {launch.const("USE_GDC") for launch in rec if launch.name == "_gemv_kernel"}
        return k_types, asm, gdc
    assert facts(86) == ({"*u8"}, {False}, {False})
    assert facts(80) == ({"*u8"}, {False}, {False})
    assert facts(89) == ({"*fp8e4nv"}, {False}, {False})
    assert facts(90) == ({"*fp8e4nv"}, {True}, {True, False})
    from labkit.engine.model import arch
    saved, arch.MODE = arch.MODE, "portable"
    try:
        assert facts(90) == ({"*u8"}, {False}, {False})
    finally:
        arch.MODE = saved


# two processes side by side, each compiling every other launch of every architecture (so the two finish together),
# each importing torch and recording the launches once
PROCESSES = 2


@pytest.mark.slow
def test_every_kernel_compiles_for_ampere_ada_and_hopper(tmp_path):
    """Every architecture compiled (two processes side by side, each a share of every architecture's launches), a
    fresh Triton cache: ptxas assembles every launch, and no kernel asks for more shared memory than the
    architecture gives a block."""
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path)}
    env.pop("TRITON_INTERPRET", None)
    script = ("import sys, json; sys.path.insert(0, 'tests'); import test_kernels_compile as t; "
              "print(json.dumps(t._compile_share(int(sys.argv[1]), int(sys.argv[2]))))")

    def run(i):
        return i, subprocess.run([sys.executable, "-c", script, str(i), str(PROCESSES)], capture_output=True,
                                 text=True, timeout=1200, env=env, cwd=REPO)

    with cf.ThreadPoolExecutor(PROCESSES) as pool:
        results = dict(pool.map(run, range(PROCESSES)))
    import json
    failures = {i: p.stderr[-2500:] for i, p in results.items() if p.returncode}
    if failures and all("ptxas" in e and "not found" in e for e in failures.values()):
        pytest.skip("this Triton install has no ptxas")
    assert not failures, failures
    by_cc: dict[int, list] = {}
    for p in results.values():
        for line in p.stdout.strip().splitlines():
            if line.startswith("["):
                for c in json.loads(line):
                    by_cc.setdefault(c["cc"], []).append(c)
    assert sorted(by_cc) == sorted(aot.ARCHS), sorted(by_cc)
    for cc, compiled in by_cc.items():
        assert len(compiled) == len(to_compile(cc)) >= (5 if cc == 89 else 20), (cc, len(compiled))
        over = [c for c in compiled if c["shared"] > aot.SMEM_LIMIT[cc]]
        assert not over, f"sm_{cc}: shared memory over {aot.SMEM_LIMIT[cc]} B: {over}"
    # sm_89's own code: the kernels reading the index keys as native e4m3
    assert {"_index_score_kernel", "_sample_kernel", "_collect_sampled_kernel"} <= {c["kernel"] for c in by_cc[89]}
