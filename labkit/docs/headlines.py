"""The README's headline lines, one per system (block `headlines`): each line joins figures of several
experiments' committed runs (ratios within one run, and where a figure was repeated in separate processes its range
across them), so it lives here in labkit/docs/ rather than beside one experiment. The runs are docs/runs.toml's."""
from __future__ import annotations

import pandas as pd

from ..experiments.capacity.tables import capacity_rows
from ..experiments.decode.tables import decode_ratio_rows
from ..experiments.prefill.tables import prefill_rows
from ..experiments.pulse_scaling.tables import pulse_rows
from ..report import summary as S
from ..report.units import tokens_label as _ctx
from ..results import REPO, load_run
from ..stats import across_runs
from . import box
from .reference_tables import prefill_points
from .roofline_tables import gemv_chain
from .runs import RUNS


def _span(lo: float, hi: float) -> str:
    """A min-max range at two decimals, three where two would print the same number twice."""
    for d in (2, 3):
        a, b = f"{lo:.{d}f}", f"{hi:.{d}f}"
        if a != b:
            return f"{a}–{b}"
    return a


def _selection_words(run: str) -> str:
    """How a decode run picked its rows, in words: two figures of one ratio from runs that select differently
    differ for that reason, and the line says so instead of putting one outside the other's range."""
    sel = str((load_run(REPO / run).manifest.get("parameters") or {}).get("selection", "indexer"))
    return "on a recorded selection trace" if sel.startswith("trace:") else f"with the {sel}'s own selections"


def headlines() -> str:
    """The README's one line per system, every figure computed here from the same committed runs as the docs'
    tables: ratios within one run, and where a figure was repeated, its range across processes. The sparse-offload
    and baseline lines read the published shape's decode grid (`reference`), each naming its shape and GPU."""
    ref = box.run_setup(box.reference_run())            # its metrics with `reference_more`'s points, its words
    d = S.decode_table(ref["metrics"])
    d1 = d[d["concurrency"] == 1].set_index(["strategy", "context_len"])
    top = int(d1.index.get_level_values(1).max())
    lines = [_sparse_offload_line(d1, top, ref["words"]), _baseline_line(ref), _prefill_line(), _hot_cache_line(top),
             _pulse_line(), _xfer_line(), _two_gpus_line()]
    return "\n".join(lines)


def _sparse_offload_line(d1: pd.DataFrame, top: int, setup: str) -> str:
    """The published shape's grid at one request: zero_copy against resident at the longest context, and how
    its step grows from 64K; the stand-in shape's repeats across processes in a clause that says so."""
    rep = across_runs(decode_ratio_rows(RUNS["repeats_hot1m"]), ["figure"], "value").set_index("figure")
    zc_rep = rep.loc[[f for f in rep.index if f.startswith("zero_copy")][0]]
    zc, res = d1.loc[("zero_copy", top)], d1.loc[("resident", top)]
    grow = zc["step_ms_median"] / d1.loc[("zero_copy", 64 << 10), "step_ms_median"] - 1
    return (f"- **Sparse offload** of the published model ({setup}) decodes at {_ctx(top)} tokens at "
            f"{zc['tok_s']:.1f} tok/s with `zero_copy` against {res['tok_s']:.1f} fully resident "
            f"({zc['tok_s'] / res['tok_s']:.2f}× {_selection_words(box.reference_run())}; the stand-in shape on an H200: "
            f"{_span(zc_rep['min'], zc_rep['max'])}× across {int(zc_rep['n'])} processes "
            f"{_selection_words(RUNS['repeats_hot1m'][0])}), and its step grows only "
            f"{grow:.0%} from 64K to {_ctx(top)}: the transfer per step is fixed "
            f"([reference model](docs/reference-model.md), [spreads](docs/spreads.md)).")


def _prefill_line() -> str:
    """Prefill: the published shape's prompts against their bounds (`reference_prefill`), then the stand-in shape's
    long prompt, its variants in the anatomy run and attention's rate, said to be the stand-in's."""
    pts = prefill_points(RUNS["reference_prefill"][box.REFERENCE_GPU])
    res = pts[pts["mode"] == "resident"].sort_values("context_len")
    lo, hi = res.iloc[0], res.iloc[-1]
    rot = pts[(pts["mode"] == "rotating") & (pts["context_len"] == hi["context_len"])]
    setup = f"{lo['shape']}, {lo['weights_dtype']} weights, on one {str(lo['gpu_name']).replace('NVIDIA ', '')}"
    published = (f"- **Prefill** of the published model ({setup}) runs a {_ctx(lo['context_len'])} prompt at "
                 f"{lo['tok_s']:,.0f} tok/s ({lo['tok_s'] / lo['bound_tok_s']:.0%} of its bound) and a "
                 f"{_ctx(hi['context_len'])} one at {hi['tok_s']:,.0f} ({hi['tok_s'] / hi['bound_tok_s']:.0%})"
                 + (f", {float(rot['tok_s'].iloc[0]) / hi['tok_s']:.2f}× of that with the KV going to host RAM through "
                    f"the rotating buffers" if len(rot) else "") + _capped_words(pts)
                 + ". The stand-in shape (bf16, dense FFN, an H200): ")
    return published + _standin_prefill_words()


def _capped_words(pts: pd.DataFrame) -> str:
    """The longest prompt prefilled under a device-memory cap, where one was."""
    cap = pts[pts["mem_cap_gib"].fillna(0) > 0].sort_values("context_len")
    if cap.empty:
        return ""
    r = cap.iloc[-1]
    return (f"; a whole {_ctx(r['context_len'])}-token prompt under a {r['mem_cap_gib']:.0f} GiB cap in "
            f"{r['seconds']:.0f} s ({r['tok_s']:,.0f} tok/s)")


def _standin_prefill_words() -> str:
    """The stand-in shape's long prompt: today's variant against the first one in the anatomy run, attention's rate."""
    all_ = load_run(REPO / RUNS["prefill_anatomy"]).metrics
    all_ = all_[(all_["experiment"] == "prefill") & (all_["status"] == "ok")]
    m = all_[all_["mode"] == "resident"]
    first, best = m.iloc[0], m.loc[m["tok_s"].idxmax()]
    rot = all_[(all_["mode"] == "rotating") & (all_["engine_variant"] == best["engine_variant"])]
    return (f"a {_ctx(int(best['context_len']))} prompt at {best['tok_s']:,.0f} tok/s "
            f"({best['tok_s'] / first['tok_s']:.2f}× the {first['tok_s']:,.0f} before in the same run): attention at "
            f"{best['attention_of_gemm_peak']:.0%} of the GEMM peak measured beside it (two cuDNN calls merged by "
            f"log-sum-exp) and DeltaNet's scan on flash-linear-attention's kernel; the rotating buffers keep "
            f"{float(rot['tok_s'].iloc[0]) / best['tok_s']:.2f}× of it with the KV going to host RAM, and every prefill run "
            f"times its chunks by phase against their bounds. {_prefill_now_words()} ([prefill](docs/prefill-capacity.md)).")


def _prefill_now_words() -> str:
    """Today's dense prompt and QSA's sparse prefill (the short prompt and the longest), from their runs."""
    def ok(run):
        m = load_run(REPO / run).metrics
        return m[(m["experiment"] == "prefill") & (m["status"] == "ok")].iloc[0]
    now = ok(RUNS["prefill_now"])
    sparse = sorted((ok(run) for run in RUNS["prefill_sparse"]), key=lambda r: r["context_len"])
    short, long_ = sparse[0], sparse[-1]
    cap = long_.get("mem_cap_bytes")
    under = f" under a {cap / 2**30:.0f} GiB cap" if cap is not None and pd.notna(cap) else ""
    return (f"With DeltaNet's conv on a kernel of the lab's own the same prompt runs at {now['tok_s']:,.0f} tok/s; QSA's "
            f"sparse prefill (each query's top {int(short['budget']):,} rows) at {short['tok_s']:,.0f} tok/s, and a whole "
            f"{_ctx(int(long_['context_len']))}-token prompt{under} in {long_['step_ms_median'] / 1e3:.0f} s")


def _baseline_line(ref: dict) -> str:
    """The published shape's resident step at 64K, one request, against its weight-read bound in the same run;
    the stand-in shape's, which the lab's GEMV brought near its bound, beside it as the stand-in's."""
    gshare = gemv_chain(RUNS["gemv_kmajor"])["share_m1"]
    roof = load_run(REPO / RUNS["roofline"]).metrics

    def at_64k(m):
        r = m[(m.experiment == "decode") & (m.status == "ok") & (m.strategy == "resident") & (m.concurrency == 1)
              & (m.context_len == 64 << 10)].iloc[0]
        bw = float(m[(m.experiment == "probe") & (m.strategy == "hbm_read")]["gbps"].median())
        return r, float(r.step_weight_bytes) / bw / 1e6
    r, bound = at_64k(ref["metrics"])
    s, s_bound = at_64k(roof)
    return (f"- **The baseline**: the published model's `resident` step ({ref['words']}) "
            f"takes {r.step_ms_median:.2f} ms at 64K ({r.tok_s:.0f} tok/s), {r.step_ms_median / bound:.1f}× the "
            f"{bound:.2f} ms its {r.step_weight_bytes / 1e9:.2f} GB of weights take to read once from HBM, the phases "
            f"against their bounds in [the reference model](docs/reference-model.md); the stand-in shape's (bf16, dense "
            f"FFN, an H200) steps at {s.step_ms_median / s_bound:.1f}× its bound, its one-row GEMV streaming the weights at "
            f"{gshare['gemv_best']:.0%} of the read bandwidth, cuBLAS at {gshare['cublas']:.0%} ([roofline](docs/roofline.md)).")


def _hot_cache_line(top: int) -> str:
    caps = across_runs(capacity_rows(RUNS["repeats_capacity"]), ["figure"], "value").set_index("figure")
    cap = caps.loc[[f for f in caps.index if f.startswith("goodput")][0]]
    pre = across_runs(prefill_rows(RUNS["repeats_prefill"]), ["figure"], "value").iloc[0]
    hot = []
    hot_decode = RUNS["hot_decode"]
    for run, how in hot_decode:
        m = load_run(REPO / run).metrics.set_index("strategy")
        if how == hot_decode[-1][1] and m.loc["hot_cache", "selection"].startswith("trace:"):   # the latest
            hot.append(m.loc["resident", "step_ms_median"] / m.loc["hot_cache", "step_ms_median"])
    return (f"- **FlashOffloading's hot cache** reaches {min(hot):.3f}–{max(hot):.3f}× resident speed at {_ctx(top)} on recorded "
            f"selections (one process each, with the step of its runs: {hot_decode[-1][1].split(', ')[-1]}); its rotating prefill buffers cost nothing against resident prefill "
            f"({pre['median']:.2f}×, {_span(pre['min'], pre['max'])}× across {int(pre['n'])} processes, a 248K prompt with "
            f"the KV going to host RAM) and run a whole 1M-token prompt under a 24 GiB cap, and offload in both "
            f"stages gives {cap['median']:.2f}× the goodput of none ({_span(cap['min'], cap['max'])}× across {int(cap['n'])} "
            f"processes) ([hot cache](docs/hot-cache.md), "
            f"[prefill](docs/prefill-capacity.md)).")


def _pulse_line() -> str:
    pul = across_runs(pulse_rows(RUNS["repeats_pulse_scaling"]), ["figure"], "value").set_index("figure")
    sw = pul.loc[[f for f in pul.index if "switched / one" in f][0]]
    trace = next(r for r in RUNS["pulse_trace"] if "151530" in r)
    t = load_run(REPO / trace).metrics
    base = float(t.loc[t.policy.str.startswith("noswitch"), "output_throughput"].iloc[0])
    thr = t[t.policy.str.startswith("threshold")]["output_throughput"] / base
    win = load_run(REPO / RUNS["pulse_trace_windows"])
    ws = win.table("window_summary").set_index("arm").loc["threshold (fitted)"]
    return (f"- **PulseInfer's switching** with a static length threshold ({ws['policy'].split(':')[1]}, chosen on "
            f"{len(win.manifest['calibration'])} calibration windows) gives {ws['throughput_ratio']:.2f}× "
            f"({ws['throughput_ratio_min']:.2f}–{ws['throughput_ratio_max']:.2f}) the throughput of offloading without switching "
            f"and {ws['tpot_p99_ratio']:.2f}× ({ws['tpot_p99_ratio_min']:.2f}–{ws['tpot_p99_ratio_max']:.2f}) its p99 TPOT, "
            f"median (min–max) over {int(ws['throughput_ratio_n'])} held-out windows of {win.manifest['parameters']['window_size']} "
            f"Mooncake requests; the {thr.min():.2f}–{thr.max():.2f}× of one {int(t.n_requests.iloc[0])}-request window "
            f"with thresholds read off it does not hold; at 1M two switched "
            f"batches gave {_span(sw['min'], sw['max'])}× one offloaded batch across {int(sw['n'])} processes "
            f"([PulseInfer](docs/pulseinfer.md)).")


def _xfer_line() -> str:
    tt = load_run(REPO / RUNS["xfer_ttft"]).metrics
    tt = tt[(tt["kind"] == "ttft") & (tt["strategy"] == "mapped") & (tt["backend"] == "transformers")
            & (tt["rank"].fillna(0) == 0)]
    fr = load_run(REPO / RUNS["xfer_frontier"]).table("frontier")
    fr = fr[fr["stage"] == "frontier"].set_index("small_layers")
    n8, n20 = fr.loc[8], fr.loc[int(fr.index.max())]
    iv = lambda r, c: f"{r[c]:.2f} [{r[c + '_lo']:.2f}, {r[c + '_hi']:.2f}]"  # noqa: E731
    return (f"- **Cross-model KV transfer** (CPU, SmolLM2-135M and its first 8 layers) cuts TTFT "
            f"{tt[tt.context_len >= 2048].speedup.min():.1f}–{tt[tt.context_len >= 2048].speedup.max():.1f}× at "
            f"{int(tt[tt.context_len >= 2048].context_len.min()):,}–{int(tt.context_len.max()):,} tokens on the "
            f"transformers path; on held-out text its perplexity ratio at N = 8 is {iv(n8, 'ppl_ratio_prose')} on prose and "
            f"{iv(n8, 'ppl_ratio_code')} on code (95% intervals over {int(n8['ppl_ratio_prose_n'])} sequences each), "
            f"{iv(n20, 'ppl_ratio')} pooled at N = {int(fr.index.max())} ([cross-model](docs/cross-model.md)).")


def _two_gpus_line() -> str:
    first, rerun = (load_run(REPO / r).metrics for r in RUNS["multigpu"])
    gth = rerun[(rerun.experiment == "gather") & (rerun.status == "ok")]
    links = gth[gth["mode"] == "together"].gbps_aggregate.iloc[0] / gth[gth["mode"] == "alone"].gbps.max()
    dec = rerun[(rerun.experiment == "decode") & (rerun.status == "ok") & (rerun.strategy == "zero_copy")]
    at = dec[(dec.context_len == dec.context_len.max()) & (dec.concurrency == dec.concurrency.max())]
    best = at.sort_values("tok_s").groupby("layout").last()          # the multi-GPU table's choice per layout
    pipe = best.loc["pipelined", "tok_s"] / best.loc["1gpu", "tok_s"]
    n = int(dec.concurrency.max())
    return (f"- **Two GPUs**: the links add up ({links:.2f}×), and pipelined micro-batches reach {pipe:.2f}× one GPU at "
            f"{_ctx(int(dec.context_len.max()))} × {n} requests with `zero_copy` ([multi-GPU](docs/multi-gpu.md)).")
