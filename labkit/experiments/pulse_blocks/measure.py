"""Block-granular transfers of one QSA layer's selection (PulseInfer).

    labkit run pulse_blocks -p context=64K -p budget=2048 -p blocks=16 -p requests=1,4,12

`requests=R`: the units of R requests' selections in one transfer (what an offloaded batch of R moves
per layer: R x 4 MiB at the reference point).

The selection is made in blocks of `block` tokens (`budget / block` blocks per layer), either

- **per head** (`selection=per_head`): each KV head picks its own blocks; with a head-major pool
  (`[head][K|V][block][block * head_dim]`) every transfer unit is one head's K or V of one block:
  `block * head_dim * 2` bytes (8 KB for the reference shape at block 16);
- **retrieval head** (`selection=retrieval_head`): one head's blocks serve every head of the layer; with a
  token-major pool (`[block][block tokens][row]`) every unit is a whole block of rows:
  `block * row_bytes` (32 KB).

Both move the same bytes (`budget * row_bytes`). Variants, each timed over `repeats` calls (CUDA events
around host-synchronised calls; wall clock on CPU) and checked against `src[units]`:
- `per_unit_copy`: one `copy_` per unit (what per-head block transfers do);
- `coalesced`: CPU threads gather the units into pinned staging, one H2D copy, a scatter on the device
  into the destination order (here the attention's order: a permutation, so the scatter is real work);
- `coalesced_copy`: that one H2D copy alone (the link part of `coalesced`);
- `coalesced_pipelined` / `coalesced_pipelined_threads`: the same three steps cut into chunks of
  `chunk_bytes`, each chunk's copy issued as soon as it is gathered (`engine.coalesced.CoalescedLoader`,
  gathered by torch's intra-op threads / by a pool of Python threads), so the link waits only for the
  first chunk;
- `batched_dma`: one `cuMemcpyBatchAsync` call, a copy per unit straight from the pinned pool into the
  attention's order (`engine.batched_dma`; CUDA 13 drivers), hinted to overlap compute (copy engines);
  `batched_dma_default` without the hint (the driver picks how); `batched_dma_perN` the same units in
  calls of N (the copies of one call run while the driver takes in the next);
- `gather_only`: the pipeline's gather into pinned staging in one call, no copy (the CPU side's own
  rate: a gather-then-copy path cannot beat min(this, the link));
- `zero_copy`: the Triton gather kernel reading the units from mapped pinned host memory;
- `contiguous`: one pinned H2D copy of the same number of bytes (the link's reference).
Each row: bytes counted from the units moved, ms, GB/s and the ratio to `contiguous`.
"""
from __future__ import annotations

import statistics
import sys

import torch

from ...engine.transfer.batched_dma import BatchedDMA
from ...engine.transfer.coalesced import CoalescedLoader
from ...engine.model.gather import gather_rows
from ...params import BadInput
from ...shapes import ModelShape
from ... import sweep
from ...sweep import event_ms
from .. import for_this_machine
from . import SPEC, PulseBlocksPlan

EXPERIMENT = "pulse_blocks"


def check(p: dict) -> PulseBlocksPlan:
    """Decide the "auto" ones for this device and check what crosses parameters (one BadInput line before anything
    is allocated); returns the plan."""
    plan = PulseBlocksPlan.from_params(for_this_machine(SPEC, p))       # the declared bounds checked there
    for b in plan.blocks:
        if plan.budget % b or plan.context % b or not 0 < plan.budget <= plan.context:
            raise BadInput(f"budget {plan.budget} and context {plan.context} must be multiples of block {b}, "
                           "0 < budget <= context")
    if not plan.requests:
        raise BadInput("requests: none given")
    return plan

WORD = 8


def _host(shape, dev) -> torch.Tensor:
    pin = dev.type == "cuda"
    return torch.empty(shape, dtype=torch.int64, pin_memory=pin)


def _units(selection: str, s: ModelShape, context: int, budget: int, block: int, g: torch.Generator):
    """(host pool [n_units, unit_words], selected unit ids [M]) for one layer."""
    nb_ctx, nb_sel = context // block, budget // block
    if selection == "per_head":
        unit_words = block * s.head_dim * 2 // WORD
        pool = _host((s.n_kv_heads * 2 * nb_ctx, unit_words), torch.device("cuda" if torch.cuda.is_available() else "cpu"))
        ids = []
        for h in range(s.n_kv_heads):
            blocks = torch.randperm(nb_ctx, generator=g)[:nb_sel].sort().values
            for kv in range(2):
                ids.append((h * 2 + kv) * nb_ctx + blocks)
        return pool, torch.cat(ids)
    unit_words = block * s.row_bytes // WORD
    pool = _host((nb_ctx, unit_words), torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    return pool, torch.randperm(nb_ctx, generator=g)[:nb_sel].sort().values


@torch.inference_mode()
def block_probe(shape: ModelShape, device: str = "cuda", context: int = 65536, budget: int = 2048, block: int = 16,
                repeats: int = 20, threads: int = 0, seed: int = 0, requests: int = 1,
                chunk_bytes: int = 8 << 20, dma_split_units: tuple = (128, 512)) -> list[dict]:
    if budget % block or context % block or budget > context:
        raise ValueError(f"budget {budget} and context {context} must be multiples of block {block}, budget <= context")
    if requests < 1:
        raise ValueError(f"requests must be >= 1, got {requests}")
    dev = torch.device(device)
    g = torch.Generator().manual_seed(seed)
    if threads:
        torch.set_num_threads(threads)
    rows = []
    contiguous_gbps = {}
    loaders = {b: CoalescedLoader(threads, chunk_bytes, backend=b) for b in ("threads", "torch")}
    dma, dma_default, dma_split = _dma_copiers(dev, dma_split_units)
    for selection in ("per_head", "retrieval_head"):
        # R requests' selections: R x budget of R x context (units of distinct requests never coincide)
        pool, ids = _units(selection, shape, context * requests, budget * requests, block, g)
        pool.view(torch.bfloat16).normal_(generator=g)
        M, W = ids.numel(), pool.shape[1]
        nbytes = M * W * WORD
        ids_dev = ids.to(dev)
        perm = torch.randperm(M, generator=g).to(dev)           # the attention's order of the units
        dst = torch.empty((M, W), dtype=torch.int64, device=dev)
        stage = _host((M, W), dev)
        stage_dev = torch.empty((M, W), dtype=torch.int64, device=dev)
        ref = pool[ids]

        def per_unit():
            for j, u in enumerate(ids.tolist()):
                dst[j].copy_(pool[u], non_blocking=True)

        def coalesced():
            torch.index_select(pool, 0, ids, out=stage)
            stage_dev.copy_(stage, non_blocking=True)
            dst.index_copy_(0, perm, stage_dev)

        def coalesced_copy():
            stage_dev.copy_(stage, non_blocking=True)

        def zero_copy():
            gather_rows(pool, ids_dev, dst)

        def contiguous():
            stage_dev.copy_(pool[:M] if M <= pool.shape[0] else stage, non_blocking=True)

        def pipelined(backend):
            return lambda: loaders[backend].load(pool, ids, dst, order=perm)

        def gather_only():            # the default pipeline's gather, all of it in one call, no copy
            lt = loaders["torch"]
            src_v, ids_v, _, _, _ = lt.pieces(pool, ids, stage)
            torch.index_select(src_v, 0, ids_v, out=stage.view(ids_v.numel(), -1))

        variants = {"per_unit_copy": (per_unit, lambda: dst), "coalesced": (coalesced, lambda: dst[perm]),
                    "coalesced_pipelined": (pipelined("torch"), lambda: dst[perm]),
                    "coalesced_pipelined_threads": (pipelined("threads"), lambda: dst[perm]),
                    "gather_only": (gather_only, lambda: stage), "coalesced_copy": (coalesced_copy, None),
                    "zero_copy": (zero_copy, lambda: dst), "contiguous": (contiguous, None)}
        if requests > 1:            # ~0.4 s per unit copy a call at 12 requests: not worth the session
            variants.pop("per_unit_copy")
        if dma is not None:
            ids_cpu, perm_cpu = ids.cpu(), perm.cpu()     # the pointer arrays are built on the host
            variants["batched_dma"] = (lambda: dma.copy(pool, ids_cpu, dst, order=perm_cpu), lambda: dst[perm])
            variants["batched_dma_default"] = (lambda: dma_default.copy(pool, ids_cpu, dst, order=perm_cpu),
                                               lambda: dst[perm])
            for n, d in dma_split.items():
                variants[f"batched_dma_per{n}"] = (lambda d=d: d.copy(pool, ids_cpu, dst, order=perm_cpu),
                                                   lambda: dst[perm])
        head = {"experiment": "pulse_blocks", "device": str(dev), "shape": shape.name, "selection": selection,
                "block": block, "budget": budget, "context_len": context, "requests": requests,
                "chunk_bytes": chunk_bytes, "threads": loaders["threads"].threads, "unit_bytes": W * WORD, "units": M,
                "bytes": nbytes}
        rows += _time_variants(variants, dst, ref, repeats, dev, head)
        contiguous_gbps[selection] = next(r["gbps"] for r in rows[::-1] if r["strategy"] == "contiguous")
    for loader in loaders.values():
        loader.close()
    for r in rows:
        r["ratio_to_contiguous"] = r["gbps"] / contiguous_gbps[r["selection"]]
    return rows


def _dma_copiers(dev, split_units) -> tuple:
    """The batched DMA copiers (default, without overlap preference, and one per units-per-call), or Nones where
    there is no CUDA or the driver is too old (the other variants still run)."""
    if dev.type != "cuda":
        return None, None, {}
    try:
        return BatchedDMA(), BatchedDMA(prefer_overlap=False), {n: BatchedDMA(units_per_call=n) for n in split_units}
    except RuntimeError as ex:
        print(f"pulse_blocks: batched_dma skipped: {ex}", file=sys.stderr)
        return None, None, {}


def _time_variants(variants: dict, dst, ref, repeats: int, dev, head: dict) -> list[dict]:
    """Each variant timed (after one warm call: Triton JIT, staging buffers) and its result checked against the
    reference rows where it leaves them somewhere; a wrong result is a failed row."""
    rows = []
    for name, (fn, result) in variants.items():
        dst.zero_()
        ms = event_ms(fn, repeats, dev, warmup=1)
        correct = None
        if result is not None:
            correct = bool(torch.equal(result().cpu(), ref))
        med = statistics.median(ms)
        rows.append({**head, "strategy": name, "ms_median": med, "ms_min": min(ms), "gbps": head["bytes"] / med / 1e6,
                     "correct": correct, "status": "ok" if correct in (None, True) else "failed"})
    return rows


def headline(m) -> list[str]:
    """Per selection granularity at the largest block and request count: GB/s of each transfer against one
    contiguous copy of the same bytes."""
    ok = m[(m["experiment"] == "pulse_blocks") & (m["status"] == "ok")]
    ok = ok[(ok["block"] == ok["block"].max()) & (ok["requests"] == ok["requests"].max())]
    lines = []
    for sel, d in ok.groupby("selection", sort=False):
        best = d.sort_values("gbps", ascending=False)
        lines.append(f"{sel}, blocks of {int(d['block'].iloc[0])}: " + ", ".join(
            f"{r.strategy} {r.gbps:.1f}" for r in best.head(4).itertuples()) + " GB/s"
            + f" (contiguous {float(d.loc[d['strategy'] == 'contiguous', 'gbps'].max()):.1f})")
    return lines[:4]


def run(plan: PulseBlocksPlan, progress_bar: bool = True):
    """Measure a checked plan into a run folder; returns the Run."""
    run = sweep.open_run(plan.params, EXPERIMENT)
    gpu = run.manifest.get("gpu_name") or "cpu"
    points = sweep.grid(req=list(plan.requests), b=list(plan.blocks))
    with sweep.bar(len(points), EXPERIMENT, progress_bar) as bar:
        for pt in points:
            req, b = pt["req"], pt["b"]
            bar.set_postfix_str(f"block {b}, {req} request(s)")
            with sweep.point(run, {"experiment": EXPERIMENT}, block=b, requests=req):
                for r in block_probe(ModelShape.from_name(plan.shape), plan.device, plan.context, plan.budget, b,
                                     plan.repeats, plan.threads, seed=plan.seed, requests=req,
                                     chunk_bytes=plan.chunk_bytes, dma_split_units=plan.dma_split):
                    run.add({**r, "gpu_name": gpu})
            bar.update()
    run.finish()                 # the shared rule over the rows
    sweep.headline(sweep.summary_lines(lambda: headline(run.metrics())), progress_bar, EXPERIMENT)
    return run
