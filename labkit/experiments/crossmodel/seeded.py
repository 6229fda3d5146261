"""Time to first token at the published pair's shapes: Qwen3-0.6B prefills, Qwen3-1.7B decodes, seeded weights.

The published system's TTFT (32K prompt: 3,657 -> 1,645 ms on two RTX 3090) is a question of shapes, not of
weights: how long the large model takes to prefill a prompt against how long the small one takes plus the
mapping plus one decode step of the large one. No model hub is reachable where the lab runs, so both models
are built from their published configurations (`SHAPES`) with seeded random weights (transformers'
`Qwen3ForCausalLM`, its own initialization under `torch.manual_seed`), in bf16 on the device. Quality means
nothing here (random weights); the first tokens are still compared, as a check that each path decodes.

The two paths, per prompt of T tokens (`large_ttft_once`, `mapped_ttft_once`):

- **large_prefill**: the large model's own forward over the T tokens, logits of the last one, argmax;
- **mapped**: the small model's prefill of the first T - 1 tokens capturing the hidden states the mapper
  reads; the mapper turns them into every large layer's K (before RoPE, rotated at the target positions)
  and V (`mapped_cache.mapped_kv`, the lab's own path, with the large model's K/V of the first
  `exact_prefix` tokens from a k-token forward); a cache of T - 1 positions; the large model's forward over
  the last prompt token on that cache, argmax. One GPU holds both models, so no transfer is timed: the
  published path moved the cache between two GPUs through /dev/shm (say so beside the figure).

The mapper (`fit_mapper`) has the lab's shape (features `h:-1,h:0,h:-1@-1,h:-2` of the 1,024-wide small
model + bias -> 4,097 inputs; K and V of each of the 28 large layers, 2 x 8 x 128 outputs) and is a
closed-form ridge fit (`mapper.solve`) on one seeded calibration sequence: the weights are as random as the
models'; its multiply-adds per token are what the mapped path pays, and that is the point.

Timing: CUDA synchronize around each request, one warm-up request per path and prompt length, then `repeats`
timed requests; median, min and max. Concurrency c > 1 (`concurrent_ttft`): c requests of T tokens arrive at
once and one GPU serves them in arrival order, each request's prefill alone (a 32K prefill already fills the
GPU; a serving engine with chunked prefill also finishes long prompts roughly in arrival order). A request's
latency is its first token's time minus the common arrival time; the row's `ttft_ms_median/min/max` are over
the c requests of the last of `repeats` rounds after a warm-up round; that median per-request latency is the
figure the published "warm path" per-request latency (2,393 vs 3,928 ms at concurrency 8) is compared with
(warm: models loaded, kernels compiled, the first round discarded).
"""

from __future__ import annotations

import hashlib
import json
import time
import statistics

import torch

from labkit.crossmodel.pair import LayerTable, ModelInfo, PairSpec, layer_table
from labkit import sweep
from labkit.crossmodel.features import FeatureSpec, small_pass, call, build_cache
from labkit.crossmodel.mapped_cache import large_targets, true_cache, mapped_kv, Models
from labkit.crossmodel.mapper import Fitter, Mapper, solve
from labkit.crossmodel.ttft import ttft_rows
from labkit.params import BadInput, resolve_device
from labkit.results import load_run
from . import CrossmodelPlan

# Published configuration values (Hugging Face config.json of Qwen/Qwen3-0.6B and Qwen/Qwen3-1.7B): both have
# 28 layers, 16 query and 8 KV heads of 128 and tied embeddings; the 1.7B is twice as wide (hidden 2048,
# FFN 6144 vs 1024 / 3072). Non-embedding weights 0.44B vs 1.41B: the small model is 0.31 of the large per token.
_QWEN3 = dict(num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936, rope_theta=1_000_000.0,
              max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=True, hidden_act="silu",
              attention_bias=False)
SHAPES = {
    "qwen3-0.6b": dict(_QWEN3, num_hidden_layers=28, hidden_size=1024, intermediate_size=3072),
    "qwen3-1.7b": dict(_QWEN3, num_hidden_layers=28, hidden_size=2048, intermediate_size=6144),
    # the same family at toy size for CPU tests: one small layer fewer, half the width, GQA kept
    "qwen3-tiny-small": dict(_QWEN3, num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=16, vocab_size=256, max_position_embeddings=512),
    "qwen3-tiny-large": dict(_QWEN3, num_hidden_layers=3, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=16, vocab_size=256, max_position_embeddings=512),
}
FEATURES = "h:-1,h:0,h:-1@-1,h:-2"   # the lab's default mapper input (experiments.crossmodel)
CALIB_TOKENS = 1024                   # one seeded calibration sequence for the ridge fit
LAMBDA = 0.1                          # relative ridge penalty (mapper.solve); the fit's quality is not the point


def context_of(name: str) -> int:
    return int(SHAPES[name]["max_position_embeddings"])


def build(name: str, seed: int, dtype, device) -> torch.nn.Module:
    """`Qwen3ForCausalLM` of a published shape, weights drawn by its own initialization from `seed`, on `device`."""
    # transformers is the optional `quality` extra: imported where a Hugging Face model is used
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(**SHAPES[name])
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen3ForCausalLM(cfg)
    return model.to(dtype).eval()


def info(name: str, seed: int) -> ModelInfo:
    c = SHAPES[name]
    fp = hashlib.sha256(json.dumps({"shape": c, "seed": seed}, sort_keys=True).encode()).hexdigest()[:16]
    return ModelInfo(f"{name} (seeded)", "", c["num_hidden_layers"], c["num_key_value_heads"], c["head_dim"],
                     c["hidden_size"], c["vocab_size"], fp)


def pair_spec(large: str, small: str, seed: int) -> PairSpec:
    """Two separately built models: every large layer mapped, aligned proportionally (28 -> 28: layer to layer)."""
    li, si = info(large, seed), info(small, seed + 1)
    tab: LayerTable = layer_table(li.layers, si.layers)
    return PairSpec(li, si, tab, 0, small)


@torch.no_grad()
def fit_mapper(models, seed: int, tokens: int = CALIB_TOKENS, lam: float = LAMBDA):
    """A `Mapper` of the lab's shape from a closed-form ridge fit on one seeded sequence (device float32 sums,
    solved in float64), its weights moved to the models' device and dtype."""
    pair, large, small = models.pair, models.large, models.small
    dev = next(large.parameters()).device
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, pair.large.vocab, (1, tokens), generator=g).to(dev)
    fitter = Fitter(pair, FeatureSpec.parse(FEATURES), "pre")
    (keys, layers), = fitter.groups.items()        # these features are the same for every layer: one group
    X = small_pass(small, ids, fitter.hidden_needed).features(keys).double()
    tgt = large_targets(large, true_cache(large, ids), layers, "pre")
    Y = torch.cat([torch.cat(tgt[l_], dim=1) for l_ in layers], dim=1).double()
    W = solve(X.T @ X, X.T @ Y, lam)               # [d, layers * 2 * kv_width]
    w = 2 * pair.large.kv_heads * pair.large.head_dim
    dtype = next(large.parameters()).dtype
    weights = {l_: W[:, j * w:(j + 1) * w].to(dtype).contiguous() for j, l_ in enumerate(layers)}
    return Mapper(large=pair.large.to_dict(), small=pair.small.to_dict(), table=pair.table, features=fitter.features,
                  kv_width=w // 2, weights=weights, lambdas={l_: (lam, lam) for l_ in layers},
                  r2_val={l_: (float("nan"), float("nan")) for l_ in layers},
                  corpus={"seeded_tokens": tokens, "seed": seed}, rope="pre")


def _sync(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


@torch.no_grad()
def large_ttft_once(large, ids: torch.Tensor) -> tuple[float, int]:
    """Seconds of the large model's prefill over ids [1, T] to its first token, and that token."""
    _sync(ids.device)
    t0 = time.perf_counter()
    tok = int(call(large, ids, logits_to_keep=1)[0].logits[0, -1].argmax())   # int(): waits for the device
    return time.perf_counter() - t0, tok


@torch.no_grad()
def mapped_first(models, mapper, ids: torch.Tensor, exact_prefix: int, timings: dict | None = None):
    """The mapped path over ids [1, T]: (first token, the mapped cache it decoded on, the large model's
    logits of the last prompt token). The cache holds T - 1 positions before the step, T after."""
    tm: dict = {}
    kv = mapped_kv(models, mapper, ids[:, :-1], "mapped", timings=tm, exact_prefix=exact_prefix)
    _sync(ids.device)
    t0 = time.perf_counter()
    cache = build_cache(models.large, kv)
    logits = call(models.large, ids[:, -1:], cache)[0].logits[0, -1]
    tok = int(logits.argmax())
    if timings is not None:
        timings.update(tm, decode_first_s=time.perf_counter() - t0)
    return tok, cache, logits


@torch.no_grad()
def mapped_ttft_once(models, mapper, ids: torch.Tensor, exact_prefix: int) -> tuple[float, dict, int]:
    """Seconds of the mapped path over ids [1, T] to its first token, its stage breakdown, and the token."""
    _sync(ids.device)
    t0 = time.perf_counter()
    parts: dict = {}
    tok, _, _ = mapped_first(models, mapper, ids, exact_prefix, parts)
    return time.perf_counter() - t0, parts, tok


def _prompts(n: int, T: int, vocab: int, seed: int, dev) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (1, T), generator=g).to(dev) for _ in range(n)]


def single_ttft(models, mapper, T: int, repeats: int, seed: int, exact_prefix: int) -> list[dict]:
    """The two rows (large_prefill, mapped) at concurrency 1: a warm-up request each, then `repeats`."""
    dev = next(models.large.parameters()).device
    t_large, t_map, parts, eq = [], [], [], []
    for r, ids in enumerate(_prompts(repeats + 1, T, models.pair.large.vocab, seed, dev)):
        tl, first_true = large_ttft_once(models.large, ids)
        tm, part, first_mapped = mapped_ttft_once(models, mapper, ids, exact_prefix)
        if r == 0:
            continue   # warm-up
        t_large.append(tl), t_map.append(tm), parts.append(part), eq.append(first_true == first_mapped)
    return ttft_rows(T, t_large, t_map, parts, eq, 0, cache_tokens=T - 1)


def concurrent_ttft(models, mapper, T: int, c: int, repeats: int, seed: int, exact_prefix: int) -> list[dict]:
    """The two rows at concurrency `c`: per-request latency of c requests arriving together, served in order
    (module docstring); a warm-up round, then `repeats` rounds; the rows hold the last round's c requests."""
    dev = next(models.large.parameters()).device
    prompts = _prompts(c, T, models.pair.large.vocab, seed, dev)
    rows = []
    lat = {}
    for strategy in ("large_prefill", "mapped"):
        for r in range(repeats + 1):
            _sync(dev)
            t0 = time.perf_counter()
            done = []
            for ids in prompts:
                if strategy == "large_prefill":
                    large_ttft_once(models.large, ids)
                else:
                    mapped_ttft_once(models, mapper, ids, exact_prefix)
                done.append(time.perf_counter() - t0)
        lat[strategy] = done            # the last round
    for strategy in ("large_prefill", "mapped"):
        x = lat[strategy]
        rows.append({"kind": "ttft", "backend": "transformers", "context_len": T, "concurrency": c, "requests": c,
                     "repeats": repeats, "strategy": strategy, "ttft_ms_median": statistics.median(x) * 1e3,
                     "ttft_ms_min": min(x) * 1e3, "ttft_ms_max": max(x) * 1e3,
                     "round_ms": max(lat[strategy]) * 1e3, "cache_tokens": T - 1})
    rows[1]["speedup"] = rows[0]["ttft_ms_median"] / rows[1]["ttft_ms_median"]
    return rows


# ---- `labkit run crossmodel -p weights=seeded` ---------------------------------------------------------------------
def check(given: dict) -> CrossmodelPlan:
    """The plan of a seeded run (its device decided), each problem one line (BadInput) before anything is built."""
    p = dict(given)
    if p["weights"] != "seeded":
        raise BadInput(f"weights must be checkpoint or seeded, got {p['weights']!r}")
    for role in ("large", "small"):
        if p[role] not in SHAPES:
            raise BadInput(f"weights=seeded: {role}={p[role]!r} is not a known shape: choose from {', '.join(SHAPES)}")
    lc, sc = SHAPES[p["large"]], SHAPES[p["small"]]
    if (lc["vocab_size"], lc["num_key_value_heads"], lc["head_dim"]) != (sc["vocab_size"], sc["num_key_value_heads"],
                                                                         sc["head_dim"]) or p["large"] == p["small"]:
        raise BadInput(f"weights=seeded: {p['small']} -> {p['large']} is not a pair of one family (same vocabulary, "
                       "KV heads and head_dim, two different shapes)")
    if p["backend"] != "transformers":
        raise BadInput(f"weights=seeded times the transformers path only, got backend={p['backend']!r}")
    if p["dtype"] not in ("float32", "bfloat16"):
        raise BadInput(f"dtype must be float32 or bfloat16, got {p['dtype']!r}")
    ctx = min(context_of(p["large"]), context_of(p["small"]))
    if not p["ttft_lens"]:
        raise BadInput("weights=seeded measures TTFT only: give ttft_lens")
    for n in p["ttft_lens"]:
        if not p["exact_prefix"] + 2 <= n <= ctx:
            raise BadInput(f"ttft_lens: {n} tokens must be in [{p['exact_prefix'] + 2}, {ctx}] (the shapes' context; "
                           f"exact_prefix={p['exact_prefix']} tokens come from the large model)")
    if not p["concurrency"] or any(c < 1 for c in p["concurrency"]) or p["repeats"] < 1:
        raise BadInput("concurrency and repeats must be >= 1")
    if p["exact_prefix"] < 0:
        raise BadInput(f"exact_prefix must be >= 0, got {p['exact_prefix']}")
    p["device"] = str(resolve_device(p["device"]))
    return CrossmodelPlan.from_params(p)


def run_seeded(plan: CrossmodelPlan, run=None, log=print):
    """Both models and the mapper once, then per prompt length and concurrency the two TTFT rows -> the run
    folder (kind=ttft, weights=seeded); returns the Run."""
    shown = log is not None
    log = log or (lambda *a, **k: None)
    run = run or sweep.open_run(plan.params, "crossmodel")      # the manifest records the plan as a dict
    dev = torch.device(plan.device)
    dtype = getattr(torch, plan.dtype)
    points = [(n, c) for n in plan.ttft_lens for c in plan.concurrency]
    gpu = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    base = {"experiment": "crossmodel", "device": dev.type, "gpu_name": gpu, "shape": f"{plan.small}->{plan.large}",
            "weights": "seeded", "dtype": plan.dtype}
    bar = sweep.bar(2 + len(points), "crossmodel", shown)
    t_start = time.perf_counter()
    try:
        bar.set_postfix_str("models")
        pair = pair_spec(plan.large, plan.small, plan.seed)
        # the small model's weights from the next seed, the seed `pair_spec` fingerprints it by
        large, small = build(plan.large, plan.seed, dtype, dev), build(plan.small, plan.seed + 1, dtype, dev)
        models = Models(pair, large, small, None)
        shapes = {plan.large: SHAPES[plan.large], plan.small: SHAPES[plan.small]}
        run.update_manifest(pair=pair.to_dict(), shapes=shapes,
                            seeded_note="published configuration values, seeded random weights (transformers' own "
                                        "initialization); both models on one device, no cache transfer timed")
        bar.update()
        bar.set_postfix_str("mapper")
        mp = fit_mapper(models, plan.seed)
        run.update_manifest(mapper={"features": FEATURES, "fit": f"closed-form ridge (relative lambda {LAMBDA}) on "
                                    f"{CALIB_TOKENS} seeded tokens", "rope": mp.rope,
                                    "macs_per_token": mp.macs_per_token(), "dtype": plan.dtype})
        bar.update()
        for n, c in points:
            bar.set_postfix_str(f"{n} tokens, c={c}")
            prompts_seed = plan.seed + n        # each length its own prompts, the same at every concurrency
            if c == 1:
                rows = single_ttft(models, mp, n, plan.repeats, prompts_seed, plan.exact_prefix)
            else:
                rows = concurrent_ttft(models, mp, n, c, plan.repeats, prompts_seed, plan.exact_prefix)
            for r in rows:
                run.add(dict(base, status="ok", error=None, **r))
            log(f"TTFT {n} tokens, c={c}: large {rows[0]['ttft_ms_median']:.1f} ms, mapped {rows[1]['ttft_ms_median']:.1f} ms "
                f"({rows[1]['speedup']:.2f}x)")
            bar.update()
    except Exception as ex:
        sweep.fail_run(run, ex, base)
        raise
    finally:
        bar.close()
    run.finish(wall_compute_s=round(time.perf_counter() - t_start, 1))
    sweep.headline(sweep.summary_lines(lambda: closing_lines(run)), shown, "crossmodel")
    return run


def closing_lines(run) -> list[str]:
    """Per prompt length and concurrency: both medians and the speedup."""
    m = load_run(run.path).metrics
    m = m[(m["status"] == "ok") & (m["kind"] == "ttft")]
    out = []
    for (n, c), g in m.groupby(["context_len", "concurrency"]):
        g = g.set_index("strategy")
        out.append(f"seeded {g['shape'].iloc[0]}, {int(n)} tokens, concurrency {int(c)}: TTFT "
                   f"{g.loc['large_prefill', 'ttft_ms_median']:.0f} ms (large model's own prefill) vs "
                   f"{g.loc['mapped', 'ttft_ms_median']:.0f} ms mapped ({g.loc['mapped', 'speedup']:.2f}x)")
    return out
