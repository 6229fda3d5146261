"""A cost model that turns one measured step anatomy into predicted step times on other GPUs and points.

    model = CostModel.fit(run_dir, strategy="zero_copy", context_len=65536, concurrency=1)
    model.predict(gpu("rtx3090"), context_len=1 << 20, concurrency=4, budget=2048)   # a Prediction
    labkit predict RUN_DIR --gpu rtx3090 --gpus 3                                    # the same, as a table

Each phase of the anatomy (`runner.py`: weights, deltanet, index_score, selection, transfer,
attention, head, other) is read as `t = fixed + bytes / bandwidth`:
- `bytes` is what the phase must move at a point, from the shape (`phase_bytes`): the weights its
  GEMMs stream, the DeltaNet states (per request), the index keys scored (per request and token), the
  scores the selection passes read, the selected rows (over the host link for the offloaded
  strategies, twice through HBM for `resident`'s gather);
- `bandwidth` is the source GPU's memory bandwidth (or host link) times the efficiency this run
  achieved on a contiguous read (`hbm_read` probe row; link: the zero-copy gather probe). Where a
  phase ran faster than that (L2-resident data), its own achieved rate is used instead;
- `fixed` is what is left of the measured phase time: kernel launches and latency, taken as the same
  on every GPU (an assumption: launch latency is roughly constant across recent NVIDIA GPUs).
- the score and selection kernels stream at their own rate, timed by the run's probe at its largest
  batch x context; rows moved by host threads (strategies with `moved_by = "cpu"`) take time in proportion to
  the rows, with no fixed part. Where the host's RAM bandwidth was measured (`labkit.hostmem`: the manifest's
  `host_memory_bandwidth`, or the run's `host_copy` probe rows), such a CPU-staged transfer is two parts
  (`Staged`): the host threads' gather, a share of that bandwidth, and the one staged copy over the link; on
  another box the gather scales with its host's measured bandwidth (`host_scale`), the copy with its link.
On another GPU the bandwidths scale by the spec ratios (`data/gpus.toml`: memory GB/s, PCIe link),
efficiency assumed equal. Several GPUs (`gpus=3`, the reference box) split the layers into stages run
one after another at a step (no pipelining): the step is the same sum plus one activation hand-off
per stage boundary; memory per GPU is checked against the card.

Validation, honestly: `validate(run)` fits on one point per strategy and predicts every other point
of the same run; the error per point is reported beside the prediction.
"""
from __future__ import annotations

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

import json
import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import pandas as pd

from .atomic import read_regular_at
from .engine.transfer import STRATEGIES
from .params import BadInput, tokens_label
from .shapes import ModelShape

PHASES = ("weights", "deltanet", "index_score", "selection", "transfer", "attention", "experts", "hc", "ngram", "head",
          "other")
LINK_GBPS = {3: 15.75, 4: 31.5, 5: 63.0, 6: 121.0}       # x16 payload rate per PCIe generation
SELECT_PASSES = 7            # reads of the fp32 scores by the radix select (4 histograms, count, write) + the write of them
HANDOFF_MS = 0.02            # one activation hand-off between stages (a few KiB, latency-bound)
# An all-reduce of a few KiB among cards on PCIe without NVLink is latency-bound: NCCL's ring over PCIe (through
# host memory where peer-to-peer is off, as on GeForce cards) takes tens of microseconds. Not measured here (the
# lab's GPUs are one per machine): an assumption, given with the predictions that use it, which a box's owner
# replaces with their own measurement (`--allreduce-us`; `--calibration` with a `labkit run probe` folder made on the
# box, whose `allreduce` rows time NCCL among its GPUs; or a calibration JSON's `allreduce_us`, e.g. from
# nccl-tests' all_reduce_perf at 16 KB). Without one, a tensor-parallel prediction is given over `ALLREDUCE_BAND_US`,
# not at one value: `ALLREDUCE_US` is only the value inside the band a single-number call falls back on.
ALLREDUCE_US = 30.0
ALLREDUCE_BAND_US = (10.0, 100.0)
CALIBRATION_CAP = 1 << 20      # bytes of a calibration JSON (a few hundred)
CALIBRATION_TOP = 1e6          # GB/s, TFLOP/s or µs: any rate or latency of a real card is below this
MEMORY_RESERVE_GIB = 1.5     # CUDA context, workspaces, graphs


def _on_device(strategy: str) -> bool:
    """KV in device memory (the baseline's gather reads and writes HBM), by the strategy's declared medium."""
    return strategy in STRATEGIES and STRATEGIES[strategy].medium == "device"


def _host_moved(strategy: str) -> bool:
    """Rows moved by host threads (or one host-issued copy each): time in proportion to the rows."""
    return strategy in STRATEGIES and STRATEGIES[strategy].moved_by == "cpu"


@dataclass(frozen=True)
class Staged:
    """A CPU-staged transfer (host threads gather the selected rows into pinned staging, one copy crosses the link),
    split in its two parts at the rates this run achieved: the gather, bound by host RAM, and the copy, by the link."""
    gather_gbps: float          # selected rows' bytes per second the host threads gathered
    dma_gbps: float             # the staged copy's rate (the probe's contiguous pinned H2D, else the spec link)
    host_gbps: float            # the host's measured RAM copy bandwidth: the gather's bound

    @classmethod
    def split(cls, nbytes: float, t_ms: float, host_gbps: float, dma_gbps: float) -> "Staged":
        dma_ms = nbytes / (dma_gbps * 1e6)
        return cls(nbytes / (max(t_ms - dma_ms, 1e-6) * 1e6), dma_gbps, host_gbps)

    def ms(self, nbytes: float, host_scale: float = 1.0, link_scale: float = 1.0) -> float:
        return nbytes / (self.gather_gbps * host_scale * 1e6) + nbytes / (self.dma_gbps * link_scale * 1e6)

    def reason(self, nbytes: float, host_scale: float, link_scale: float) -> str:
        return (f"transfer (CPU-staged): gather {nbytes / 1e6:.1f} MB at {self.gather_gbps * host_scale:.1f} GB/s "
                f"(x{host_scale:.2f} of this host's; {self.gather_gbps / self.host_gbps:.0%} of its measured RAM copy "
                f"{self.host_gbps:.1f} GB/s) + one copy at {self.dma_gbps * link_scale:.0f} GB/s (host link, x{link_scale:.2f})")


@dataclass(frozen=True)
class GPU:
    key: str
    name: str
    hbm_gbps: float
    pcie_gen: int
    pcie_width: int
    sms: int
    memory_gib: float
    bf16_tflops: float = 0.0      # datasheet dense bf16, FP32 accumulate (the prefill prediction's scale)
    boost_mhz: float = 0.0        # the boost clock the tensor rate is computed at (0: the document gives none)
    tdp_w: float = 0.0            # the default power limit; a run's manifest records the one in force
    arch: str = ""                # ampere / ada / hopper
    note: str = ""

    @property
    def link_gbps(self) -> float:
        return LINK_GBPS[self.pcie_gen] * self.pcie_width / 16


def gpus() -> dict[str, GPU]:
    data = tomllib.loads(resources.files("labkit").joinpath("data/gpus.toml").read_text())
    return {k: GPU(key=k, **v) for k, v in data.items()}


def gpu(key: str) -> GPU:
    table = gpus()
    if key not in table:
        raise ValueError(f"unknown GPU {key!r}: choose from {', '.join(table)} (or add it to labkit/data/gpus.toml)")
    return table[key]


def gpu_for_name(name: str | None) -> GPU | None:
    """The spec entry whose name a measured device's name contains (e.g. 'NVIDIA H200' -> h200), or whose
    name contains a measured name that still names a model ('H200'). None for a CPU run: an empty name,
    'None'/'nan' as a table stores a missing one, or a vendor word alone would otherwise be part of
    every name and match the first GPU of the list."""
    got = str(name or "").strip().lower()
    if got in ("", "none", "nan", "cpu") or not any(ch.isdigit() for ch in got):
        return None
    for g in gpus().values():
        spec = g.name.lower()
        if spec in got or got in spec:
            return g
    return None


def gpu_kind(name: str) -> str:
    """A GPU's kind as one word: `NVIDIA GeForce RTX 3090` -> rtx3090 (its key here), else its name's words joined."""
    g = gpu_for_name(name)
    if g is not None:
        return g.key
    words = [w for w in re.split(r"[^a-z0-9]+", name.lower()) if w and w not in ("nvidia", "geforce", "tesla")]
    return "".join(words)[:32] or "gpu"


def phase_bytes(shape: ModelShape, strategy: str, context_len: int, concurrency: int, budget: int,
                weights_dtype: str = "bf16", experts_read: float | None = None) -> dict[str, float]:
    """Bytes each phase must move for one decode step at this point (see the module docstring). A model with
    routed experts: `experts` is the distinct routed experts (`experts_read` a layer, else the uniform-routing
    expectation at this concurrency), the shared experts and the router; `hc` the hyper-connections' mixing;
    `ngram` the n-gram embedding's rows over the host link; `weights` the QSA projections (and a dense FFN)."""
    s, B, L_a, L_d = shape, concurrency, shape.attn_layers, shape.deltanet_layers
    k = min(budget, context_len)
    mats = s.weight_matrices(routed="per_token")

    def wb(name):
        K, N, c = mats[name]
        return K * N * c * s.bytes_per_weight(name, weights_dtype, K)
    dn_state = s.dn_v_heads * s.dn_head_dim * s.dn_head_dim * 4
    rows = B * L_a * k * s.row_bytes
    dense_ffn = sum(wb(n) for n in ("ffn.w_gu", "ffn.w_d") if n in mats)
    parts = s.step_weight_bytes(B, weights_dtype, experts_read) if s.moe or s.hc_count > 1 else {}
    experts = 0.0
    if s.moe:
        experts = parts["experts"] + sum(wb(n) for n in ("moe.router", "moe.shared_gu", "moe.shared_d",
                                                         "moe.shared_gate") if n in mats)
    # the QSA input projection as the products need it (its zero padding is not counted: the model's own bytes)
    qsa_in = s.hidden * (2 * s.n_heads * s.head_dim + 2 * s.n_kv_heads * s.head_dim + s.index_heads * s.index_dim
                         + s.index_heads + s.index_dim) * L_a * s.bytes_per_weight("qsa.w_in", weights_dtype, s.hidden)
    return {
        "weights": qsa_in + wb("qsa.w_o") + dense_ffn,
        "deltanet": wb("dn.w_in") + wb("dn.w_o") + L_d * 2 * B * dn_state,
        "index_score": B * L_a * context_len * s.index_key_bytes,
        "selection": B * L_a * context_len * 4 * SELECT_PASSES,
        "transfer": rows * (2 if _on_device(strategy) else 1),        # on the device: read + write in HBM
        "attention": rows,
        "experts": experts,
        "hc": parts.get("hc", 0.0),
        "ngram": float(B * s.ngram_fetch_bytes),
        "head": s.vocab * s.hidden * 2,
        "other": 0.0,
    }


def _medium(phase: str, strategy: str) -> str:
    if phase == "ngram":                       # the n-gram table lives in host RAM whatever the KV strategy
        return "link"
    return "link" if phase == "transfer" and not _on_device(strategy) else "hbm"


@dataclass
class Prediction:
    gpu: str
    gpus: int
    strategy: str
    context_len: int
    concurrency: int
    budget: int
    step_ms: float
    phases_ms: dict[str, float]
    fits: bool
    memory_gib_per_gpu: float
    reasoning: list[str] = field(default_factory=list)

    @property
    def tok_s(self) -> float:
        return self.concurrency / (self.step_ms / 1e3)


@dataclass
class CostModel:
    shape: ModelShape
    strategy: str
    source: GPU
    hbm_eff_gbps: float                 # achieved contiguous read on the source GPU
    link_eff_gbps: float                # achieved host-link gather on the source GPU
    fixed_ms: dict[str, float]
    bw_gbps: dict[str, float]           # per phase, on the source GPU
    fit_point: dict
    weights_dtype: str = "bf16"
    staged: Staged | None = None        # a CPU-staged transfer's two parts, where the host's RAM was measured

    @classmethod
    def fit(cls, metrics: pd.DataFrame, shape: ModelShape, strategy: str, context_len: int, concurrency: int,
            source: GPU, link_gbps: float | None = None, host_gbps: float | None = None) -> "CostModel":
        """`link_gbps`: the host link's achieved gather rate, where the run measured it at this point's own
        load (else the run's zero-copy probe row). `host_gbps`: the host's measured RAM copy bandwidth (else the
        run's `host_copy` probe rows), which splits a CPU-staged transfer into its gather and its copy."""
        d = metrics[(metrics["experiment"] == "decode") & (metrics["status"] == "ok")]
        if "axis" in d:
            d = d[d["axis"] == "context"]
        row = d[(d["strategy"] == strategy) & (d["context_len"] == context_len) & (d["concurrency"] == concurrency)]
        if row.empty or "anat_weights_ms" not in row or row["anat_weights_ms"].isna().all():
            raise ValueError(f"no measured anatomy for {strategy} at context {context_len}, concurrency {concurrency}")
        r = row.iloc[0]
        hbm = _probe_gbps(metrics, "hbm_read") or 0.6 * source.hbm_gbps
        link = link_gbps or _probe_gbps(metrics, "zero_copy") or 0.8 * source.link_gbps
        wd = _str(r.get("weights_dtype")) or "bf16"
        by = phase_bytes(shape, strategy, context_len, concurrency, int(r["budget"]), wd,
                         _num(r.get("experts_read_per_layer")))
        # The selection kernels' own throughput, where the run's probe timed them at its largest size:
        # their passes and atomics stream far below a plain read.
        kernel_rate = {ph: _kernel_gbps(metrics, name, shape, ph) for ph, name in
                       (("index_score", "index_score"), ("selection", "select"))}
        fixed, bw, staged = {}, {}, None
        for ph in PHASES:
            t = _num(r.get(f"anat_{ph}_ms")) or 0.0            # a run from before a phase was marked: none of it
            if ph == "transfer" and _host_moved(strategy):
                # Moved by host threads or one copy per row: time goes with the rows, nothing is fixed.
                fixed[ph], bw[ph] = 0.0, (by[ph] / (t * 1e6) if t > 0 else link)
                host = host_gbps or _probe_gbps(metrics, "host_copy")
                if host and t > 0 and by[ph]:
                    staged = Staged.split(by[ph], t, host, _probe_gbps(metrics, "contiguous") or source.link_gbps)
                continue
            base = kernel_rate.get(ph) or (link if _medium(ph, strategy) == "link" else hbm)
            need = by[ph] / (base * 1e6) if by[ph] else 0.0          # ms at the achieved bandwidth
            if t >= need:
                fixed[ph], bw[ph] = t - need, base
            else:                                                      # faster than streaming: L2-resident
                fixed[ph], bw[ph] = 0.0, by[ph] / (t * 1e6)
        return cls(shape, strategy, source, hbm, link, fixed, bw,
                   {"context_len": context_len, "concurrency": concurrency, "budget": int(r["budget"]),
                    "step_ms": float(r["step_ms_median"])}, wd, staged)

    def predict(self, target: GPU, context_len: int, concurrency: int, budget: int, n_gpus: int = 1,
                link_scale: float | None = None, split: str = "layers", calibration: "Calibration | None" = None,
                source_calibration: "Calibration | None" = None, allreduce_us: float | None = None,
                weights_dtype: str | None = None, host_scale: float | None = None) -> Prediction:
        """`link_scale`: the host link's rate as a multiple of the source's measured one (an emulated or
        measured link), in place of the spec ratio of the two GPUs' links. `calibration` /
        `source_calibration`: rates measured on the target and source cards (`Calibration`): their ratios in
        place of the datasheets'. `split` over `n_gpus`: "layers" (stages one after another at a step, a
        hand-off between them) or "tensor" (every layer's weights 1/n on each card, which read them at once;
        the KV rows of a card's KV heads; two all-reduces of the block's output a layer over the cards' links,
        `allreduce_us` each plus the ring's bytes; without it the target calibration's measured `allreduce_us`, else
        the unmeasured `ALLREDUCE_US`: see `measured_allreduce_us`). `weights_dtype`: predict the model held
        otherwise. `host_scale`: the target host's measured RAM bandwidth over this one's (a CPU-staged gather's
        scale; 1: the same host)."""
        if split not in ("layers", "tensor"):
            raise ValueError(f"unknown split {split!r}: layers or tensor")
        wd = weights_dtype or self.weights_dtype
        allreduce_us = measured_allreduce_us(allreduce_us, calibration)
        allreduce_us = ALLREDUCE_US if allreduce_us is None else allreduce_us
        by = phase_bytes(self.shape, self.strategy, context_len, concurrency, budget, wd)
        tp = n_gpus if split == "tensor" else 1
        shards = {ph: tp for ph in ("weights", "deltanet", "experts", "hc", "head")}
        # the KV heads split over the cards (a card with more cards than KV heads reads a replicated head's rows)
        kv_split = min(tp, self.shape.n_kv_heads)
        shards.update(transfer=kv_split, attention=kv_split)
        phases, why = {}, []
        for ph in PHASES:
            if ph == "transfer" and self.staged is not None:
                ls, hs = link_scale or target.link_gbps / self.source.link_gbps, host_scale or 1.0
                phases[ph] = self.staged.ms(by[ph] / shards["transfer"], hs, ls)
                why.append(self.staged.reason(by[ph] / shards["transfer"], hs, ls))
                continue
            link = _medium(ph, self.strategy) == "link"
            if link and link_scale:
                scale = link_scale
            elif calibration is not None and source_calibration is not None:
                scale = calibration.ratio(source_calibration, "link" if link else "hbm")
            else:
                scale = (target.link_gbps / self.source.link_gbps) if link else (target.hbm_gbps / self.source.hbm_gbps)
            bw = self.bw_gbps[ph] * scale
            b = by[ph] / shards.get(ph, 1)
            t = self.fixed_ms[ph] + (b / (bw * 1e6) if b else 0.0)
            phases[ph] = t
            if b:
                why.append(f"{ph}: {self.fixed_ms[ph]:.3f} ms fixed + {b / 1e6:.1f} MB at {bw:.0f} GB/s "
                           f"({'host link' if link else 'memory'}, x{scale:.2f} of {self.source.key})")
        step = sum(phases.values())
        if split == "layers":
            step += HANDOFF_MS * (n_gpus - 1)
            if n_gpus > 1:
                why.append(f"{n_gpus} stages in sequence: + {n_gpus - 1} hand-offs of {HANDOFF_MS} ms")
        elif n_gpus > 1:
            ar = allreduce_ms(n_gpus, concurrency * self.shape.hidden * 2, target.link_gbps, allreduce_us)
            phases["allreduce"] = 2 * self.shape.layers * ar
            step += phases["allreduce"]
            why.append(f"tensor parallel over {n_gpus}: 2 all-reduces a layer x {self.shape.layers} layers of "
                       f"{ar * 1e3:.1f} us ({allreduce_us:g} us each + the ring's bytes over the link)")
        mem = self._memory_gib(context_len, concurrency, wd) / n_gpus
        fits = mem <= target.memory_gib - MEMORY_RESERVE_GIB
        if not fits:
            why.append(f"does not fit: {mem:.1f} GiB per GPU > {target.memory_gib - MEMORY_RESERVE_GIB:.1f} GiB usable")
        return Prediction(target.key, n_gpus, self.strategy, context_len, concurrency, budget, step, phases, fits, mem, why)

    def _memory_gib(self, context_len: int, concurrency: int, weights_dtype: str = "bf16") -> float:
        s = self.shape
        dev = s.weight_bytes(weights_dtype) + concurrency * context_len * s.index_key_bytes * s.attn_layers
        if _on_device(self.strategy):
            dev += concurrency * context_len * s.kv_bytes_per_token()
        return dev / 2**30



def measured_allreduce_us(given: float | None = None, calibration: "Calibration | None" = None) -> float | None:
    """The all-reduce latency a prediction may take as measured: the one given (`--allreduce-us`), else the target
    calibration's `allreduce_us` (a probe's NCCL all-reduce at a step's size); None when neither is: the caller then
    reports the band `ALLREDUCE_BAND_US`, not one value."""
    if given is not None:
        return given
    return calibration.allreduce_us if calibration is not None and calibration.allreduce_us is not None else None


def allreduce_ms(n: int, nbytes: float, link_gbps: float, latency_us: float = ALLREDUCE_US) -> float:
    """One ring all-reduce of `nbytes` over `n` cards: the latency plus 2 (n - 1) / n of the bytes over a link."""
    return (latency_us + 2 * (n - 1) / n * nbytes / (link_gbps * 1e3)) / 1e3


@dataclass(frozen=True)
class Calibration:
    """Rates measured on one card by a short calibration (`labkit calibrate`, or a probe or decode run's probe rows):
    its HBM read, its host link's zero-copy gather, optionally its dense bf16 GEMM and the latency of one NCCL
    all-reduce among the box's cards at a tensor-parallel step's size (`allreduce_us`: a JSON's, or a probe run's
    `allreduce` row at concurrency 1, measured where the box has 2 or more GPUs). A prediction between two
    calibrated cards scales each phase by these ratios rather than the datasheets'; a measured all-reduce latency
    replaces the unmeasured band of a tensor-parallel prediction."""
    gpu_name: str
    hbm_read_gbps: float
    link_gbps: float
    bf16_tflops: float | None = None
    source: str = ""
    allreduce_us: float | None = None

    def ratio(self, other: "Calibration", what: str) -> float:
        if what == "hbm":
            return self.hbm_read_gbps / other.hbm_read_gbps
        if what == "link":
            return self.link_gbps / other.link_gbps
        if what == "compute" and self.bf16_tflops and other.bf16_tflops:
            return self.bf16_tflops / other.bf16_tflops
        raise ValueError(f"no {what} rate in both calibrations")

    @classmethod
    def from_metrics(cls, m: pd.DataFrame, gpu_name: str, source: str = "") -> "Calibration":
        m = numeric_metrics(m, f"{source}/metrics.parquet" if source else "the run's metrics.parquet")
        hbm, link = _probe_gbps(m, "hbm_read"), _probe_gbps(m, "zero_copy")
        if not hbm or not link:
            raise ValueError(f"{source or 'this run'}: no hbm_read and zero_copy probe rows to calibrate from")
        return cls(gpu_name, hbm, link, _probe_gbps(m, "gemm_bf16"), source, _probe_allreduce_us(m, source))

    @classmethod
    def load(cls, path) -> "Calibration":
        """A calibration JSON object, read only as a regular file under CALIBRATION_CAP (a link followed to where it
        ends, a FIFO or a device never waited on), its rates finite numbers > 0; ValueError in one line otherwise."""
        try:
            d = json.loads(read_regular_at(None, Path(path).resolve(), CALIBRATION_CAP).decode("utf-8"))
        except UnicodeDecodeError:
            raise ValueError(f"calibration {path}: not UTF-8 text") from None
        except OSError as ex:
            raise ValueError(f"calibration {path}: cannot be read ({ex.strerror or type(ex).__name__})") from None
        except ValueError as ex:
            raise ValueError(f"calibration {path}: not valid JSON ({str(ex).splitlines()[0]})") from None
        if not isinstance(d, dict):
            raise ValueError(f"calibration {path}: not a JSON object")
        missing = {"gpu_name", "hbm_read_gbps", "link_gbps"} - set(d)
        if missing:
            raise ValueError(f"calibration {path}: missing {', '.join(sorted(missing))}")
        for k in ("hbm_read_gbps", "link_gbps", "bf16_tflops", "allreduce_us"):
            v, zero_ok = d.get(k), k == "allreduce_us"
            if v is None and k in ("bf16_tflops", "allreduce_us"):
                continue
            if not (isinstance(v, (int, float)) and not isinstance(v, bool) and (v >= 0 if zero_ok else v > 0)
                    and v < CALIBRATION_TOP):      # NaN and infinity fail both
                raise ValueError(f"calibration {path}: `{k}` must be a finite number {'>= 0' if zero_ok else '> 0'} "
                                 f"below {CALIBRATION_TOP:,.0f}, got {v!r}")
        if not isinstance(d["gpu_name"], str) or not isinstance(d.get("source", ""), str):
            raise ValueError(f"calibration {path}: `gpu_name` and `source` are strings")
        return cls(**{k: d[k] for k in ("gpu_name", "hbm_read_gbps", "link_gbps", "bf16_tflops", "source",
                                         "allreduce_us") if k in d})


# The metrics columns read as numbers (with every `anat_*` column): a run whose table holds text in one is refused
# in one line, not met as a traceback mid-table; text that reads as a number ("65536.0") is taken as that number
NUMERIC_COLUMNS = ("context_len", "concurrency", "budget", "repeats", "step_ms_median", "step_ms_min", "step_ms_max",
                   "tok_s", "gbps", "experts_read_per_layer", "ranks")


def numeric_metrics(m: pd.DataFrame, where: str = "the run's metrics.parquet") -> pd.DataFrame:
    """`m` with its NUMERIC_COLUMNS (and `anat_*`) as numbers; BadInput naming the column and a value that is not."""
    out = m
    for c in [c for c in m.columns if c in NUMERIC_COLUMNS or str(c).startswith("anat_")]:
        if pd.api.types.is_numeric_dtype(m[c]) and not pd.api.types.is_bool_dtype(m[c]):
            continue
        col = m[c].astype(object)
        num = pd.to_numeric(col, errors="coerce")
        bad = col[num.isna() & col.notna()]
        if not bad.empty:
            v = str(bad.iloc[0])
            raise BadInput(f"{where}: column `{c}` holds {v[:40] + ('…' if len(v) > 40 else '')!r}, not a number")
        if out is m:
            out = m.copy()
        out[c] = num.astype(float)
    return out


def check_host_gbps(host_gbps):
    """`host_gbps` (a run manifest's `host_memory_bandwidth.copy_all_gbps`, None where not measured) when it is a
    finite number >= 0; BadInput in one line otherwise. A caller that divides by it checks it first."""
    if host_gbps is not None and not (isinstance(host_gbps, (int, float)) and not isinstance(host_gbps, bool)
                                      and 0 <= host_gbps < CALIBRATION_TOP):
        raise BadInput(f"the run's manifest: host_memory_bandwidth.copy_all_gbps is {host_gbps!r}, not a finite "
                       f"number >= 0")
    return host_gbps


def _decode_grid(m: pd.DataFrame, where: str, host_gbps=None) -> pd.DataFrame:
    """The run's metrics with numbers where numbers are read, its decode points' context, concurrency and budget
    finite and > 0 (each becomes an int), the host's RAM bandwidth (from the manifest) a finite number > 0 where
    given; BadInput in one line otherwise."""
    check_host_gbps(host_gbps)
    m = numeric_metrics(m, where)
    d = _decode_points(m)
    for c in ("context_len", "concurrency", "budget"):
        v = d[c] if c in d else pd.Series(dtype=float)
        bad = v[~((v > 0) & (v < 2**62))]          # NaN and infinity fail too
        if not bad.empty:
            raise BadInput(f"{where}: a decode point's `{c}` is {float(bad.iloc[0])!r}, not a whole number > 0")
    return m


def _num(v) -> float | None:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return None if f != f else f


def _str(v) -> str | None:
    return v if isinstance(v, str) and v else None


def _kernel_gbps(m: pd.DataFrame, name: str, shape: ModelShape, phase: str) -> float | None:
    """Bytes per second of one selection kernel at the largest batch x context the probe timed (one
    layer), in this model's byte accounting."""
    p = m[(m["experiment"] == "probe") & (m["strategy"] == name) & (m["status"] == "ok")]
    if p.empty or "context_len" not in p:
        return None
    p = p.assign(n=p["context_len"] * p["concurrency"]).sort_values("n")
    r = p.iloc[-1]
    one = phase_bytes(shape, "resident", int(r["context_len"]), int(r["concurrency"]), 1)[phase] / shape.attn_layers
    return one / (float(r["step_ms_median"]) * 1e6)


def _probe_gbps(m: pd.DataFrame, strategy: str) -> float | None:
    p = m[(m["experiment"] == "probe") & (m["strategy"] == strategy) & (m["status"] == "ok")]
    return None if p.empty or p["gbps"].isna().all() else float(p["gbps"].max())


def _probe_allreduce_us(m: pd.DataFrame, source: str = "") -> float | None:
    """The probe's all-reduce latency among the box's GPUs at one decode step's size, concurrency 1 (the shape's
    hidden x 2 bytes: what a tensor-parallel layer sends twice), in µs: the row's median, among the most GPUs the
    run measured (several probes' rows merged: the median of theirs). None where the run has no such row."""
    if not {"strategy", "concurrency", "step_ms_median"} <= set(m.columns):
        return None
    p = m[(m["experiment"] == "probe") & (m["strategy"] == "allreduce") & (m["status"] == "ok")
          & (m["concurrency"] == 1) & m["step_ms_median"].notna()]
    if p.empty:
        return None
    if "ranks" in p:
        p = p[p["ranks"] == p["ranks"].max()]
    us = float(p["step_ms_median"].median()) * 1e3
    if not 0 <= us < CALIBRATION_TOP:
        raise ValueError(f"{source or 'this run'}: its all-reduce latency is {us!r} µs, not a finite number >= 0")
    return us


def _decode_points(m: pd.DataFrame) -> pd.DataFrame:
    d = m[(m["experiment"] == "decode") & (m["status"] == "ok")]
    return d[d["axis"] == "context"] if "axis" in d else d


def fit_point(m: pd.DataFrame, strategy: str) -> tuple[int, int]:
    """The point a run's model is fitted on: concurrency 1 (or the lowest) at the context nearest 64K."""
    d = _decode_points(m)
    d = d[(d["strategy"] == strategy) & d.get("anat_weights_ms", pd.Series(dtype=float)).notna()]
    if d.empty:
        raise ValueError(f"no {strategy} point with an anatomy in this run")
    c = int(d["concurrency"].min())
    ctx = min(d[d["concurrency"] == c]["context_len"], key=lambda x: abs(x - 65536))
    return int(ctx), c


def validate(m: pd.DataFrame, shape: ModelShape, source: GPU, host_gbps: float | None = None,
             where: str = "the run's metrics.parquet") -> pd.DataFrame:
    """Fit on one point per strategy, predict every measured point of that strategy: the error table."""
    rows = []
    m = _decode_grid(m, where, host_gbps)
    d = _decode_points(m)
    for strategy in sorted(d["strategy"].unique()):
        try:
            ctx0, c0 = fit_point(m, strategy)
        except ValueError:
            continue
        cm = CostModel.fit(m, shape, strategy, ctx0, c0, source, host_gbps=host_gbps)
        for _, r in d[d["strategy"] == strategy].iterrows():
            p = cm.predict(source, int(r["context_len"]), int(r["concurrency"]), int(r["budget"]))
            rows.append({"strategy": strategy, "context_len": int(r["context_len"]), "concurrency": int(r["concurrency"]),
                         "fit_point": f"{tokens_label(ctx0)} c={c0}", "measured_ms": float(r["step_ms_median"]),
                         "predicted_ms": p.step_ms, "error": p.step_ms / float(r["step_ms_median"]) - 1})
    return pd.DataFrame(rows)


def predict_table(m: pd.DataFrame, shape: ModelShape, source: GPU, target: GPU, n_gpus: int = 1,
                  contexts=None, concurrency=None, host_gbps: float | None = None, where: str = "the run's metrics.parquet",
                  **how) -> pd.DataFrame:
    """Predicted tok/s on `target` for each strategy of the run at its measured contexts and concurrencies.
    `how`: `CostModel.predict`'s split, calibrations, all-reduce latency, weights dtype and the target host's
    `host_scale`; `host_gbps`: this host's RAM bandwidth (`CostModel.fit`). `where`: what a refusal of the
    table's values names."""
    m = _decode_grid(m, where, host_gbps)
    d = _decode_points(m)
    contexts = contexts or sorted(int(x) for x in d["context_len"].unique())
    concurrency = concurrency or sorted(int(x) for x in d["concurrency"].unique())
    budget = int(d["budget"].iloc[0]) if not d.empty else 2048
    rows = []
    for strategy in sorted(d["strategy"].unique()):
        try:
            cm = CostModel.fit(m, shape, strategy, *fit_point(m, strategy), source, host_gbps=host_gbps)
        except ValueError:
            continue
        for c in concurrency:
            for ctx in contexts:
                p = cm.predict(target, ctx, c, budget, n_gpus, **how)
                rows.append({"gpu": target.key, "gpus": n_gpus, "split": how.get("split", "layers"),
                             "strategy": strategy, "context_len": ctx, "concurrency": c,
                             "predicted_step_ms": p.step_ms, "predicted_tok_s": p.tok_s if p.fits else None,
                             "fits": p.fits, "memory_gib_per_gpu": p.memory_gib_per_gpu,
                             **{f"{k}_ms": v for k, v in p.phases_ms.items()}, "reasoning": "; ".join(p.reasoning)})
    return pd.DataFrame(rows)


# ---- prefill: the anatomy scaled phase by phase ---------------------------------------------------------------
COMPUTE_PHASES = ("weights", "deltanet", "attention", "index_score", "selection")


def predict_prefill(row: dict, source: GPU, target: GPU, n_gpus: int = 1) -> dict:
    """A measured prefill (a `labkit run prefill` metrics row with its anatomy sums) on `target` x `n_gpus`.

    Each compute phase's time scales by the datasheets' dense bf16 rates (source / target: the kernels keep the
    efficiency they had here, which a GeForce card's attention kernels may not), the other phases by the memory
    bandwidths. Several GPUs split the layers; a prompt's chunks pipeline through the stages, so a chunk's time
    divides by `n_gpus` (stages taken as balanced, the hand-off of a chunk's activations, 32 MB at 8K tokens,
    left out). Also the target's dense bound: the prompt's FLOPs at n_gpus x the datasheet rate, which no
    dense prefill can beat."""
    if not (source.bf16_tflops and target.bf16_tflops):
        raise ValueError(f"{source.key} or {target.key} has no bf16_tflops in labkit/data/gpus.toml")
    compute = sum(row.get(f"anatomy_{ph}_ms", 0.0) or 0.0 for ph in COMPUTE_PHASES)
    rest = float(row["anatomy_chunk_ms"]) - compute
    ms = (compute * source.bf16_tflops / target.bf16_tflops + rest * source.hbm_gbps / target.hbm_gbps) / n_gpus
    tokens = float(row["computed_tokens"])
    flops = float(row.get("prefill_flops") or 0.0)
    bound = tokens / (flops / (n_gpus * target.bf16_tflops * 1e12)) if flops else float("nan")
    return {"tok_s": tokens / ms * 1e3, "ms": ms, "dense_bound_tok_s": bound, "n_gpus": n_gpus, "gpu": target.key}


# ---- the model checked across two real GPUs ------------------------------------------------------------------
def cross_check(src: pd.DataFrame, tgt: pd.DataFrame, shape: ModelShape, src_gpu: GPU, tgt_gpu: GPU) -> pd.DataFrame:
    """Every decode point measured on both GPUs, predicted on the target from the source's anatomy at that
    same point (its phases scaled by the two runs' own calibrations: the probe's HBM read and zero-copy link),
    and every prefill length by `predict_prefill` with the same calibrations: predicted against measured."""
    cal_s = Calibration.from_metrics(src, src_gpu.name, "source")
    cal_t = Calibration.from_metrics(tgt, tgt_gpu.name, "target")
    rows = []
    ds, dt = _decode_points(src), _decode_points(tgt)
    for _, r in ds.iterrows():
        m = dt[(dt.strategy == r.strategy) & (dt.context_len == r.context_len) & (dt.concurrency == r.concurrency)]
        if m.empty or _num(r.get("anat_weights_ms")) is None:
            continue
        cm = CostModel.fit(src, shape, r.strategy, int(r.context_len), int(r.concurrency), src_gpu)
        p = cm.predict(tgt_gpu, int(r.context_len), int(r.concurrency), int(r.budget),
                       calibration=cal_t, source_calibration=cal_s)
        meas = float(m.iloc[0].step_ms_median)
        rows.append({"kind": "decode", "strategy": r.strategy, "context_len": int(r.context_len),
                     "concurrency": int(r.concurrency), "source_ms": float(r.step_ms_median), "predicted_ms": p.step_ms,
                     "measured_ms": meas, "error": p.step_ms / meas - 1})
    ps = src[(src.experiment == "prefill") & (src.status == "ok")]
    pt = tgt[(tgt.experiment == "prefill") & (tgt.status == "ok")]
    for _, r in ps.iterrows():
        m = pt[pt.context_len == r.context_len]
        if m.empty:
            continue
        ratio = cal_t.ratio(cal_s, "hbm")
        # prefill's compute phases scale by the GEMM rate where both runs measured it, else the datasheets'
        comp = (cal_t.bf16_tflops / cal_s.bf16_tflops) if cal_t.bf16_tflops and cal_s.bf16_tflops else \
            (tgt_gpu.bf16_tflops / src_gpu.bf16_tflops)
        ms = float(r.step_ms_median) * _prefill_share(r, comp, ratio)
        meas = float(m.iloc[0].step_ms_median)
        rows.append({"kind": "prefill", "strategy": r.strategy, "context_len": int(r.context_len), "concurrency": 1,
                     "source_ms": float(r.step_ms_median), "predicted_ms": ms, "measured_ms": meas,
                     "error": ms / meas - 1})
    return pd.DataFrame(rows)


def _prefill_share(r, compute_ratio: float, hbm_ratio: float) -> float:
    """A prefill's time on the target over the source: its compute share by the compute ratio, the rest by the
    memory ratio (a decode run's prefill rows carry no anatomy: taken as compute-bound, the prompt's products)."""
    tot = _num(r.get("anatomy_chunk_ms"))
    if not tot:
        return 1 / compute_ratio
    comp = sum(_num(r.get(f"anatomy_{ph}_ms")) or 0.0 for ph in COMPUTE_PHASES)
    return (comp / compute_ratio + (tot - comp) / hbm_ratio) / tot
