"""One measured point of a lab run as one row of a public benchmark archive.

The field names are those of the public archive of 4x RTX 3090 measurements (schema version 2: one operating point
per row, JSONL with the same rows in SQLite) wherever a field means the same; `FIELDS` lists every field a row
has, in order, with what it holds for a lab point (docs/share-rows.md shows the same table). The lab's own fields
come last (`hardware`, `timings`, `labkit_*`): the archive's rows are all one rig, the lab's come from many.

How a point's rate is labelled (`output_tps_kind`, always set):
- serving (labkit's client against vLLM, llama.cpp, `labkit serve`...): `output_tok_s` is output tokens over the
  point's wall time, first token included: `single_stream_wall` at concurrency 1, `aggregate_output` above;
  `decode_tok_s` = 1000 / median TPOT (one stream's decode rate, TTFT removed); `prefill_tok_s` = prompt tokens /
  median TTFT at concurrency 1 only (above it TTFT includes queueing);
- engine decode: steady decode steps, no prefill in the window: `single_stream_decode` at concurrency 1,
  `aggregate_output` above (the batch's tokens per second); `decode_tok_s` = 1000 / median step time;
- engine prefill: `prefill_tok_s` only; `output_tok_s` stays empty and the kind says what it would be.

`context_len` is the context a request may hold (the server's max model length, the engine's cache); the depth a
point measured is `prompt_tokens`, as in the archive's depth campaigns. `launch_cmd` is the `labkit` command that
makes the same plan again (every parameter that differs from its default); `launch_argv` the server's argv (as
labkit launched it, or as the user passed it for a target with `-p server_cmd=`), the engine's own command for an
engine run; no field holds a path of the machine that measured (`no_local_paths` checks every row).

What the run recorded is all a row says: quantization from the checkpoint's name, the server's `--dtype` or the
engine's `weights_dtype`; on GPU rows NVML's power, memory, hottest reading and median clocks over the point's own
window (the run's summary where the window has none), the power limit and driver of the run's start; the busy
flag from the lab's one rule (`sweep.machine_busy`). A field the run did not record stays empty, never guessed.
An imported run (`labkit import`) gives back the rows it took in, unchanged.
"""
from __future__ import annotations

import json
import math
import re
import shlex
import urllib.parse
from pathlib import Path

import pandas as pd

from ..experiments import get
from ..params import BadInput
from ..results import REPO, load_run
from ..serving.target import is_local
from ..shapes import W4_GROUP
from ..sweep import machine_busy

SCHEMA_VERSION = 2
KINDS = ("single_stream_wall", "single_stream_decode", "aggregate_output")
SOURCE = "labkit"

FIELDS: list[tuple[str, str]] = [
    ("schema_version", "2: the archive's schema"),
    ("record_kind", "`measurement`"),
    ("run_id", "`labkit/<run id>/<point>`, unique per row"),
    ("date", "the run's date (UTC)"),
    ("source", "`labkit`"),
    ("source_path", "the run folder, relative to the repository: `results/<run id>`"),
    ("source_refs", "the same as a reference: `{scope: repo, path: results/<run id>}`"),
    ("model", "the checkpoint's name without its quantization suffix; an engine run: its shape (random weights)"),
    ("model_variant", "the checkpoint's name as served, quantization included; an engine run: its shape and weights"),
    ("checkpoint_ref", "the checkpoint's file or folder name as served (no path)"),
    ("quant", "`bf16`, `f32`, `gguf-q4_k_m`, `awq`, `w4a16`, ... from the checkpoint's name, the server's dtype or the engine's weights"),
    ("quant_method", "the quantization's family (`gguf`, `awq`, `gptq`, `fp8`, `w4a16`); `none` for bf16, f16 or f32 weights"),
    ("weight_bits", "bits per weight of that quantization"),
    ("activation_bits", "bits per activation: 16 for bf16/f16 weights and weight-only quantizations, 32 for f32; else empty"),
    ("weight_format", "`gguf` or `safetensors` (vLLM's default load format, or its `--load-format`); empty for the engine (random weights, no file)"),
    ("group_size", "values per quantization group: 128 for the engine's w4a16; empty where the run does not record it"),
    ("symmetric", "whether the quantization has no zero points: false for the engine's w4a16; empty where not recorded"),
    ("quant_recipe", "what is quantized how: the engine's w4a16 layout; empty where not recorded"),
    ("quant_raw", "the quantization as the run wrote it (the checkpoint's suffix, vLLM's `--dtype`, the engine's `weights_dtype`)"),
    ("weight_path", "`${MODEL_ROOT}/<checkpoint>` for a launched or local server's checkpoint; empty for the engine"),
    ("engine", "`vllm`, `llama.cpp`, `sglang`, `labkit-serve`, or `labkit` (the lab's own engine)"),
    ("engine_raw", "the engine as the run recorded it (a target: what it said it is)"),
    ("engine_version", "vLLM's /version, llama.cpp's build, the lab's version and commit"),
    ("objective", "`single_stream` at concurrency 1, else `aggregate`"),
    ("output_tps_kind", "`single_stream_wall`, `single_stream_decode` or `aggregate_output` (see above), always set"),
    ("tp", "tensor-parallel size where the lab launched the server (1 for the engine); empty for a target"),
    ("pp", "pipeline stages (1 for the engine and a launched server); empty for a target"),
    ("dp", "data-parallel size (1 for the engine, vLLM's `--data-parallel-size` or 1); empty for a target"),
    ("instances", "servers measured at once: 1 (the engine, a launched server); empty for a target"),
    ("context_len", "the context one request may hold: the server's max model length, the engine's cache"),
    ("power_limit_w", "the GPU's enforced power limit as NVML read it at the run's start (the lowest of the run's GPUs)"),
    ("spec_decode", "vLLM's `--speculative-config` where the launch set one; empty: none (the engine decodes one token a step)"),
    ("kv_cache_dtype", "vLLM's `--kv-cache-dtype` or its `cache_config_info` metric, the engine's bf16 rows; else empty"),
    ("concurrency", "requests in flight (closed loop); the engine's batch"),
    ("prompt_tokens", "prompt tokens per request at the point (mean); the engine: the cached context"),
    ("gen_tokens", "output tokens per request; the engine: decode steps timed"),
    ("output_tok_s", "output tokens per second of the kind above"),
    ("req_s", "completed requests per second (serving)"),
    ("total_tok_s", "prompt and output tokens per second (serving)"),
    ("ttft_p50_ms", "median time to first token"),
    ("ttft_p99_ms", "99th percentile of it"),
    ("itl_p50_ms", "median gap between streamed tokens (vLLM's ITL)"),
    ("tpot_p50_ms", "median (E2EL - TTFT) / (output tokens - 1) per request; the engine: its median step"),
    ("e2e_p99_ms", "99th percentile of request latency"),
    ("prefill_tok_s", "prompt tokens per second of prefill"),
    ("decode_tok_s", "one stream's decode tokens per second, first token excluded"),
    ("vram_peak_mib", "NVML's peak device memory over the point (the engine's allocator peak where NVML is absent)"),
    ("avg_power_w", "NVML's mean board power over the point"),
    ("max_temp_c", "NVML's hottest GPU reading over the point (over the run where the point's window has none)"),
    ("quality", "empty: a lab point measures speed (the quality experiment's runs are not exported)"),
    ("curve", "empty: each lab point is its own row"),
    ("samples", "what the point's figures are over: repeats and timed steps, or requests completed and failed"),
    ("knobs", "the point's other settings: strategy, budget, host KV tier, workload, the server's argv"),
    ("launch_argv", "the server's argv (launched: as labkit started it; a target: `-p server_cmd=`); the engine: the `labkit` command"),
    ("launch_cmd", "the exact `labkit` command of the run (paths replaced by ${MODEL_ROOT}-style names)"),
    ("normalization_status", "`exact`: every field read from the run folder, none inferred"),
    ("notes", "what a reader must know: random weights, CPU timings, a remote server, a busy machine"),
    ("hardware", "labkit: the machine (GPUs and link, or CPU and cores; a remote target's is unknown)"),
    ("timings", "labkit: CUDA, CPU or remote (CPU timings never compare with GPU rows)"),
    ("labkit_experiment", "labkit: the experiment that measured the point (decode, prefill, serve_sweep; a decode run's prefill points: prefill)"),
    ("labkit_strategy", "labkit: the strategy or server configuration"),
    ("labkit_busy", "labkit: why the machine was busy at the point (the run's busy rule: step spread, load), empty when it was not"),
    ("labkit_driver", "labkit: the NVIDIA driver the run's GPUs ran under"),
    ("labkit_sm_clock_mhz", "labkit: the median SM clock over the point (NVML; over the run's busy samples where the point's window has none)"),
    ("labkit_mem_clock_mhz", "labkit: the median memory clock, the same way"),
]
FIELD_NAMES = [f for f, _ in FIELDS]
# the SQLite column types (the archive's); a row's numbers are written as these types say (`_finish`), so a row
# read back from SQLite or parquet is the same row
INTEGER = {"schema_version", "weight_bits", "activation_bits", "group_size", "tp", "pp", "dp", "instances",
           "context_len", "power_limit_w", "concurrency", "prompt_tokens", "gen_tokens", "vram_peak_mib"}
REAL = {"output_tok_s", "req_s", "total_tok_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms",
        "tpot_p50_ms", "e2e_p99_ms", "prefill_tok_s", "decode_tok_s", "avg_power_w", "max_temp_c",
        "labkit_sm_clock_mhz", "labkit_mem_clock_mhz"}
BOOL = {"symmetric"}
NESTED = ("source_refs", "quality", "curve", "samples", "knobs", "launch_argv", "spec_decode")   # lists and objects


# ------------------------------------------------------------------------------------------ names and paths
_GGUF_QUANT = re.compile(r"[-_.](i?q\d(?:_[0-9a-z]+)*|bf16|f16|f32)$", re.I)
_OTHER_QUANT = re.compile(r"[-_](awq|gptq|fp8|int4|int8|w4a16|w8a8|nvfp4|bf16|fp16)(?:[-_].*)?$", re.I)
_DTYPES = {"bfloat16": "bf16", "float16": "f16", "half": "f16", "float32": "f32", "float": "f32", "auto": None}


def split_checkpoint(name: str) -> tuple[str, str | None]:
    """(model, quant) from a checkpoint's file or folder name: `SmolLM2-135M-Instruct-Q4_1.gguf` ->
    (`SmolLM2-135M-Instruct`, `gguf-q4_1`), `Qwen3.6-27B-AWQ` -> (`Qwen3.6-27B`, `awq`)."""
    base = Path(str(name)).name
    if base.lower().endswith(".gguf"):
        stem = base[:-5]
        m = _GGUF_QUANT.search(stem)
        return (stem[:m.start()], f"gguf-{m.group(1).lower()}") if m else (stem, "gguf")
    m = _OTHER_QUANT.search(base)
    return (base[:m.start()], m.group(1).lower()) if m else (base, None)


def weight_bits(quant: str | None) -> int | None:
    q = (quant or "").lower()
    for pat, bits in ((r"f32|float32", 32), (r"bf16|f16|fp16", 16), (r"nvfp4|int4|w4a16|awq|gptq|q4|iq4", 4),
                      (r"fp8|int8|w8a8|q8", 8), (r"q6", 6), (r"q5", 5), (r"q3|iq3", 3), (r"q2|iq2", 2)):
        if re.search(pat, q):
            return bits
    return None


def redact(value, kind: str = "LOCAL"):
    """A value with this machine's paths replaced: the repository's by their relative path, others by
    `${MODEL_ROOT}/name` (models) or `${LOCAL}/name`."""
    if not isinstance(value, str) or not value:
        return value
    p = Path(value).expanduser()
    if value.startswith(("/", "~")):
        try:
            return str(p.resolve().relative_to(REPO))
        except ValueError:
            return "${%s}/%s" % (kind, p.name)
    return value


_PATH_IN_TEXT = re.compile(r"(?<![\w$}.])(~?/[^\s'\",:}\]]+)")


def redact_text(text: str, kind: str = "LOCAL") -> str:
    """`redact` for every path inside a longer text (a JSON argument, a command)."""
    return _PATH_IN_TEXT.sub(lambda m: redact(m.group(1), kind), text) if isinstance(text, str) else text


def no_local_paths(row: dict) -> list[str]:
    """The fields of `row` that still name a path of this machine (empty when none does)."""
    home, repo = str(Path.home()), str(REPO)
    bad = []
    for k, v in row.items():
        text = str(v) if not isinstance(v, str) else v
        if home in text or repo in text or re.search(r"(^|[\s=:'\"\[,])/(root|home|tmp|work|Users|mnt|data)/", text):
            bad.append(k)
    return bad


# ------------------------------------------------------------------------------------------ the command
def labkit_command(mf: dict) -> str:
    """`labkit run EXPERIMENT -p name=value ...`: every parameter of the run that differs from its default (the
    same plan again), `out_dir` left out, paths redacted."""
    exp = mf.get("experiment")
    try:
        spec = get(exp).spec
    except BadInput:
        return f"labkit run {exp}"
    given = mf.get("parameters") or {}
    parts = ["labkit", "run", str(exp)]
    for prm in spec:
        if prm.name in PER_RUN or prm.name not in given or (prm.name.startswith("trace") and given.get("workload") != "trace"):
            continue
        v = given[prm.name]
        if _same(v, prm.default):
            continue
        text = ",".join(_text(x) for x in v) if isinstance(v, list) else _text(v)
        if prm.name == "target":
            text = _target_text(text)
        if prm.name == "server_cmd":           # a command of words: each path shared as `${...}/name`
            text = shlex.join(shared_argv(shlex.split(text)))
            parts += ["-p", shlex.quote(f"server_cmd={text}")]
            continue
        parts += ["-p", shlex.quote(f"{prm.name}={redact(text, 'MODEL_ROOT' if prm.name == 'model' else 'LOCAL')}")]
    return " ".join(parts)


# drawn for each run, not chosen: a command that repeats them would not repeat the run (a fresh salt is the point)
PER_RUN = ("out_dir", "prompt_salt")


def _same(a, b) -> bool:
    """Equal as a command line writes them (a resolved 0.0 is the default "0")."""
    def text(v):
        return [_text(x) for x in v] if isinstance(v, list) else [_text(v)]
    return text(a) == text(b)


def _text(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return "inf" if math.isinf(v) else f"{v:g}"
    return str(v)


def _target_text(url: str) -> str:
    """A target's URL as shared: loopback as is (it says only "this machine"), another host by a name."""
    if is_local(url):
        return url
    u = urllib.parse.urlsplit(url)
    return f"{u.scheme}://${{TARGET_HOST}}" + (f":{u.port}" if u.port else "") + u.path


def hardware(mf: dict) -> str:
    t = mf.get("target") or {}
    if t and not t.get("local"):
        return "remote server (not seen from the measuring machine)"
    if mf.get("gpu_name"):
        n = len(mf.get("parameters", {}).get("device_list") or []) or 1
        link = f", PCIe {mf['pcie_gen']} x{mf['pcie_width']}" if mf.get("pcie_gen") else ""
        return f"{n}x {mf['gpu_name']}{link}"
    return f"CPU: {mf.get('cpu_model') or 'unknown'} ({mf.get('cpu_count')} cores)"


def power_limit(mf: dict) -> float | None:
    """The enforced power limit NVML read at the run's start (the lowest of its GPUs), or an older manifest's own key."""
    if not _gpu_here(mf):
        return None
    devs = ((mf.get("gpus") or {}).get("devices") or []) if isinstance(mf.get("gpus"), dict) else []
    got = [_num(d.get("power_limit_w")) for d in devs if isinstance(d, dict)]
    got = [v for v in got if v]
    if got:
        return float(min(got))
    for k in ("power_limit_w", "gpu_power_limit_w", "enforced_power_limit_w"):
        v = mf.get(k)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return float(v)
    return None


def _gpu_here(mf: dict) -> bool:
    """The run's GPU fields describe the machine that served: a GPU run, not a server on another machine."""
    t = mf.get("target") or {}
    return bool(mf.get("gpu_name")) and not (t and not t.get("local"))


def shared_argv(argv: list[str]) -> list[str]:
    """A command's words as shared: the program's path as `${ENGINE_ROOT}/name`, others' paths as `${MODEL_ROOT}/name`."""
    return [redact(a, "ENGINE_ROOT") if i == 0 else redact_text(a, "MODEL_ROOT") for i, a in enumerate(argv)]


def _num(v):
    """A number as JSON takes it: NaN and missing as None, whole floats of counts kept as floats."""
    if v is None or isinstance(v, str):
        return v
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(f) or math.isinf(f) else f


def _int(v):
    f = _num(v)
    return None if f is None or isinstance(f, str) else int(round(f))


# ------------------------------------------------------------------------------------------ rows
def rows_of_run(path: str | Path) -> tuple[list[dict], int]:
    """(one row per measured point of the run at `path`, the number of failed points left out). A run of an
    experiment whose points are not a served or generated rate (probe, quality...) is one BadInput line. A decode
    run's prefill points are rows too; an imported run (`labkit import`) gives back the rows it took in."""
    run = load_run(path)
    mf, m = {**run.manifest, "folder": run.path.name}, run.metrics
    exp = mf.get("experiment")
    if exp == "external":
        return external_rows(run), 0
    makers = {"decode": _decode_rows, "prefill": _prefill_rows, "serve_sweep": _serve_rows}
    if exp not in makers:
        raise BadInput(f"{path}: a {exp} run; export writes the points of decode, prefill and serve_sweep runs "
                       f"(what an engine or server generates), and runs `labkit import` made")
    kinds = (exp, "prefill") if exp == "decode" else (exp,)
    pts = m[m["experiment"].isin(kinds)] if "experiment" in m else m
    ok = pts[pts["status"] == "ok"] if "status" in pts else pts
    tel = run.telemetry
    windows = _windows(run, ok)
    if exp == "decode" and "experiment" in ok:
        made = _decode_rows(ok[ok["experiment"] == "decode"], mf, tel, windows) \
            + _prefill_rows(ok[ok["experiment"] == "prefill"], mf, tel, windows)
    else:
        made = makers[exp](ok, mf, tel, windows)
    return [_finish(r, mf) for r in _unique(made)], int(len(pts) - len(ok))


def _unique(rows: list[dict]) -> list[dict]:
    """Each row's run_id unique (two points of the same settings: `-2`, `-3` ... after the second and on)."""
    seen: dict[str, int] = {}
    for r in rows:
        n = seen[r["run_id"]] = seen.get(r["run_id"], 0) + 1
        if n > 1:
            r["run_id"] = f"{r['run_id']}-{n}"
    return rows


def external_rows(run) -> list[dict]:
    """The rows an imported run took in, as they were (`importer.lab_frame` keeps each row's JSON)."""
    m = run.metrics
    if "archive_row" not in m:
        raise BadInput(f"{run.path}: imported before labkit kept each row whole; import its file again to export it")
    return [{f: r.get(f) for f in FIELD_NAMES} for r in (json.loads(t) for t in m["archive_row"].dropna())]


def _common(mf: dict, exp: str, point: str, concurrency, row=None) -> dict:
    c = _int(concurrency) or 1
    cmd = labkit_command(mf)
    folder = f"results/{mf.get('folder') or mf['run_id']}"
    return {"schema_version": SCHEMA_VERSION, "record_kind": "measurement", "run_id": f"{SOURCE}/{mf['run_id']}/{point}",
            "date": str(mf.get("created", ""))[:10], "source": SOURCE, "source_path": folder,
            "source_refs": [{"scope": "repo", "path": folder}],
            "objective": "single_stream" if c == 1 else "aggregate", "concurrency": c,
            "power_limit_w": power_limit(mf), "launch_cmd": cmd, "launch_argv": shlex.split(cmd),
            "normalization_status": "exact", "hardware": hardware(mf),
            "timings": mf.get("timings_label") or ("CUDA" if mf.get("gpu_name") else "CPU"),
            "labkit_experiment": exp, "labkit_busy": busy(mf, row),
            "labkit_driver": mf.get("driver") if _gpu_here(mf) else None}


def busy(mf: dict, row=None) -> str:
    """Why the machine was busy at this point (the lab's one rule: the point's slowest step over its fastest,
    other processes' load at the run's start or end), "" when nothing says so."""
    spread = []
    if row is not None and _num(row.get("step_ms_min")) and _num(row.get("step_ms_max")):
        spread = [float(row["step_ms_max"]) / float(row["step_ms_min"])]
    return machine_busy(mf, spread).replace("1 of 1 points' slowest step", "the point's slowest step")


def _finish(row: dict, mf: dict) -> dict:
    """Every field in FIELDS order (missing ones empty), numbers of the field's type, no local path left."""
    out = {f: typed(f, row.get(f)) for f in FIELD_NAMES}
    if out["labkit_busy"]:
        out["notes"] = f"{out['notes']}; busy machine: {out['labkit_busy']}"
    bad = no_local_paths(out)
    if bad:
        raise BadInput(f"{mf['run_id']}: fields {', '.join(bad)} still name a local path; not exported")
    return out


def typed(field: str, v):
    """`v` as the field's column type holds it (a whole float of an INTEGER field an int, a REAL's int a float,
    SQLite's 0/1 of a BOOL field a bool), so a row read back from SQLite or parquet is the same row."""
    if v is None or isinstance(v, str) and field not in NESTED:
        return v
    if field in BOOL:
        return bool(v) if isinstance(v, (bool, int, float)) and v == v else None
    if field in INTEGER or field in REAL:
        f = _num(v)
        if f is None or isinstance(f, str):
            return f
        return int(f) if field in INTEGER and f == int(f) else float(f) if field in REAL else f
    if field in NESTED and isinstance(v, str):
        try:
            return json.loads(v)
        except ValueError:
            return v
    return v


def _engine_weights(mf: dict) -> str:
    """The engine's weights as it held them: `weights_dtype` resolved (auto: w4a16 for a mixture of experts)."""
    p = mf.get("parameters") or {}
    w = p.get("weights_dtype") or "bf16"
    if w == "auto":
        w = "w4a16" if (mf.get("shape_info") or {}).get("experts") else "bf16"
    return str(w)


def _engine_identity(mf: dict) -> dict:
    shape = (mf.get("parameters") or {}).get("shape") or (mf.get("shape_info") or {}).get("name")
    w = _engine_weights(mf)
    quant = {"w4a16": {"quant_method": "w4a16", "weight_bits": 4, "group_size": W4_GROUP, "symmetric": False,
                       "quant_recipe": f"int4 weights with a bf16 scale and a 4-bit zero per {W4_GROUP} values along K "
                                       "(AWQ's layout) in the layers' projections and experts; embedding, norms and "
                                       "hyper-connections bf16; random seeded codes"}}.get(w, {"weight_bits": weight_bits(w)})
    return {"model": shape, "model_variant": f"{shape} ({w}, random weights)", "checkpoint_ref": shape, "quant": w,
            "quant_raw": (mf.get("parameters") or {}).get("weights_dtype") or w, "activation_bits": 16, **quant,
            "kv_cache_dtype": "bf16", "engine": "labkit", "engine_raw": "labkit",
            "engine_version": f"{mf.get('labkit')} ({mf.get('git_sha')})", "tp": 1,
            "pp": len((mf.get("parameters") or {}).get("device_list") or []) or 1, "dp": 1, "instances": 1}


def _engine_note(mf: dict) -> str:
    note = "labkit's engine: the shape's layers with random weights, KV offloaded to host RAM per strategy"
    return note + ("; CPU timings, not comparable with GPU rows" if not mf.get("gpu_name") else "")


def _decode_rows(d: pd.DataFrame, mf: dict, tel: pd.DataFrame, windows: dict) -> list[dict]:
    if "axis" in d:
        d = d[d["axis"].isna() | (d["axis"] == "context")]
    out = []
    for _, r in d.iterrows():
        c = _int(r.get("concurrency")) or 1
        step = _num(r.get("step_ms_median"))
        point = f"decode-{r['strategy']}-ctx{_int(r['context_len'])}-c{c}-b{_int(r.get('budget'))}"
        out.append({**_common(mf, "decode", point, c, r), **_engine_identity(mf), **_nvml(tel, windows.get(r.name), r, mf),
                    "output_tps_kind": "single_stream_decode" if c == 1 else "aggregate_output",
                    "context_len": _int(r["context_len"]), "prompt_tokens": _int(r["context_len"]),
                    "gen_tokens": _int(r.get("steps")), "output_tok_s": _num(r.get("tok_s")),
                    "tpot_p50_ms": step, "decode_tok_s": 1000.0 / step if step else None,
                    "samples": _clean({"repeats": _int(r.get("repeats")), "steps": _int(r.get("steps"))}),
                    "knobs": _clean({"strategy": r["strategy"], "budget": _int(r.get("budget")),
                                     "h2d_bytes_per_step": _num(r.get("h2d_bytes_per_step")),
                                     "graph_mode": r.get("graph_mode")}),
                    "notes": _engine_note(mf), "labkit_strategy": r["strategy"]})
    return out


def _prefill_rows(d: pd.DataFrame, mf: dict, tel: pd.DataFrame, windows: dict) -> list[dict]:
    out = []
    for _, r in d.iterrows():
        c = _int(r.get("concurrency")) or 1
        mode = r.get("mode") if isinstance(r.get("mode"), str) else r.get("prefill_mode")
        mode = mode if isinstance(mode, str) else None
        point = "-".join(x for x in ("prefill", str(r["strategy"]), mode, f"ctx{_int(r['context_len'])}") if x)
        out.append({**_common(mf, "prefill", point, c, r), **_engine_identity(mf), **_nvml(tel, windows.get(r.name), r, mf),
                    "output_tps_kind": "single_stream_decode" if c == 1 else "aggregate_output",
                    "context_len": _int(r["context_len"]), "prompt_tokens": _int(r["context_len"]), "gen_tokens": 0,
                    "prefill_tok_s": _num(r.get("tok_s")), "ttft_p50_ms": _num(r.get("step_ms_median")),
                    "samples": _clean({"repeats": _int(r.get("repeats"))}),
                    "knobs": _clean({"strategy": r["strategy"], "mode": mode, "chunk": _int(r.get("prefill_chunk")),
                                     "mem_cap_bytes": _num(r.get("mem_cap_bytes"))}),
                    "notes": _engine_note(mf) + "; a prefill point: no output tokens",
                    "labkit_strategy": r["strategy"]})
    return out


def _serve_rows(d: pd.DataFrame, mf: dict, tel: pd.DataFrame, windows: dict) -> list[dict]:
    if "client" in d:
        d = d[d["client"] == "labkit"]            # vLLM's client rows are the cross-check of the same points
    ident = _server_identity(mf)
    knobs = {**ident.pop("_knobs"), "prompt_salt": (mf.get("parameters") or {}).get("prompt_salt")}
    argv = ident.pop("_argv")
    out = []
    for _, r in d.iterrows():
        c = _int(r.get("concurrency")) or 1
        tpot, ttft = _num(r.get("tpot_ms_median")), _num(r.get("ttft_ms_median"))
        done = _num(r.get("completed")) or 0
        prompt = _num(r.get("total_input_tokens")) / done if done and _num(r.get("total_input_tokens")) else _num(r.get("input_len"))
        gen = _num(r.get("total_output_tokens")) / done if done and _num(r.get("total_output_tokens")) else _num(r.get("output_len"))
        out.append({**_common(mf, "serve_sweep", str(r.get("point_id") or r.name), c), **ident,
                    **_nvml(tel, windows.get(r.name), r, mf), "launch_argv": argv,
                    "output_tps_kind": "single_stream_wall" if c == 1 else "aggregate_output",
                    "context_len": _int((mf.get("parameters") or {}).get("context_len")),
                    "prompt_tokens": _int(prompt), "gen_tokens": _int(gen),
                    "output_tok_s": _num(r.get("output_throughput")), "req_s": _num(r.get("request_throughput")),
                    "total_tok_s": _num(r.get("total_token_throughput")), "ttft_p50_ms": ttft,
                    "ttft_p99_ms": _num(r.get("ttft_ms_p99")), "itl_p50_ms": _num(r.get("itl_ms_median")),
                    "tpot_p50_ms": tpot, "e2e_p99_ms": _num(r.get("e2el_ms_p99")),
                    "decode_tok_s": 1000.0 / tpot if tpot else None,
                    "prefill_tok_s": prompt / (ttft / 1000.0) if c == 1 and prompt and ttft else None,
                    "samples": _clean({"completed": _int(r.get("completed")), "failed": _int(r.get("failed"))}),
                    "knobs": _clean({**knobs, "workload": r.get("workload"), "send": r.get("send"),
                                     "trace_rate": _num(r.get("trace_rate")), "offload_gib": _num(r.get("offload_gib")),
                                     "prefix_cache_hit_tokens": _num(r.get("prefix_cache_hit_tokens"))}),
                    "notes": _serve_note(mf), "labkit_strategy": r.get("strategy")})
    return out


def _serve_note(mf: dict) -> str:
    t = mf.get("target")
    parts = ["labkit's load generator (streaming /v1/completions, random token prompts salted per run, ignore_eos)"]
    if t:
        parts.append(f"a server the user runs ({t.get('engine')}), measured as it ran")
    else:
        parts.append(f"vLLM launched by labkit: {mf.get('vllm_note') or mf.get('vllm_distribution')}")
    if mf.get("timings_label") == "CPU":
        parts.append("CPU timings, not comparable with GPU rows")
    return "; ".join(parts)


def _quant_fields(name: str, dtype_given: str | None, default: str | None = "bf16") -> dict:
    """quant, quant_method, quant_raw, weight and activation bits from a checkpoint's name and the server's dtype
    (`default` where neither says: a launched vLLM's bf16 checkpoint; nothing for a target)."""
    model, quant = split_checkpoint(name)
    raw = _raw_quant(name) if quant else dtype_given
    quant = quant or (_DTYPES.get(dtype_given, dtype_given) if dtype_given else default)
    if quant is None:
        return {"model": model, "quant": None, "quant_method": None, "quant_raw": None, "weight_bits": None,
                "activation_bits": None}
    unq = quant in ("bf16", "f16", "f32", "fp16")
    method = "none" if unq else quant.split("-")[0]
    acts = {"f32": 32}.get(quant, 16) if unq or method in ("gguf", "awq", "gptq", "w4a16") else None
    return {"model": model, "quant": quant, "quant_method": method, "quant_raw": raw or quant,
            "weight_bits": weight_bits(quant), "activation_bits": acts}


def _raw_quant(name: str) -> str | None:
    base = Path(str(name)).name
    stem = base[:-5] if base.lower().endswith(".gguf") else base
    m = (_GGUF_QUANT if base.lower().endswith(".gguf") else _OTHER_QUANT).search(stem)
    return stem[m.start() + 1:] if m else None


def _server_identity(mf: dict) -> dict:
    """model, quant, engine, version, parallelism and the server's argv, from what the run recorded."""
    t = mf.get("target")
    if t:
        return _target_identity(mf, t)
    srv = (mf.get("servers") or [{}])[0]
    argv = shlex.split(srv.get("command") or "")
    path = str(mf.get("model_path") or "")
    name = Path(path).name
    fmt = _flag(argv, "--load-format")
    return {**_quant_fields(name, _flag(argv, "--dtype")), "model_variant": name, "checkpoint_ref": name,
            "weight_format": "gguf" if name.lower().endswith(".gguf") else fmt if fmt and fmt != "auto" else "safetensors",
            "weight_path": redact(path, "MODEL_ROOT") if path else None,
            "kv_cache_dtype": _flag(argv, "--kv-cache-dtype") or "auto", "engine": "vllm", "engine_raw": "vllm",
            "engine_version": mf.get("vllm_version"), "tp": _int(_flag(argv, "--tensor-parallel-size", "-tp") or 1),
            "pp": _int(_flag(argv, "--pipeline-parallel-size", "-pp") or 1),
            "dp": _int(_flag(argv, "--data-parallel-size", "-dp") or 1), "instances": 1,
            "spec_decode": _spec(_flag(argv, "--speculative-config")), "_argv": shared_argv(argv) or None,
            "_knobs": {"server_argv": [redact_text(a, "MODEL_ROOT") for a in argv[argv.index("serve"):]] if "serve" in argv else None}}


def _spec(text: str | None):
    if not text:
        return None
    try:
        v = json.loads(text)
    except ValueError:
        return {"method": text}
    return v if isinstance(v, dict) else {"method": text}


def _target_identity(mf: dict, t: dict) -> dict:
    served = mf.get("served_model")
    root = next((m.get("root") for m in t.get("models") or [] if isinstance(m, dict) and m.get("id") == served), None)
    path = (t.get("props") or {}).get("model_path") or (root if root and ("/" in str(root) or str(root).endswith(".gguf")) else None)
    name = Path(str(path)).name if path else served
    cache = t.get("cache_config") or {}
    version = t.get("engine_version") or ((t.get("version") or {}).get("version") if isinstance(t.get("version"), dict) else None)
    gguf = str(name).lower().endswith(".gguf") or t.get("engine") == "llama.cpp"
    cmd = t.get("launch_cmd")
    return {**_quant_fields(str(name), None, None), "model_variant": name, "checkpoint_ref": name,
            "weight_format": "gguf" if gguf else None, "weight_path": redact(str(path), "MODEL_ROOT") if path else None,
            "kv_cache_dtype": cache.get("cache_dtype"), "engine": t.get("engine"), "engine_raw": t.get("engine"),
            "engine_version": version, "tp": None, "pp": None, "_knobs": {"served_model": redact(served, "MODEL_ROOT")},
            "_argv": shared_argv(shlex.split(cmd)) if cmd else None}


def _flag(argv: list[str], *names: str):
    for i, a in enumerate(argv):
        for n in names:
            if a == n and i + 1 < len(argv):
                return argv[i + 1]
            if a.startswith(n + "="):
                return a.split("=", 1)[1]
    return None


def _clean(d: dict) -> dict:
    return {k: v for k, v in d.items() if v is not None and not (isinstance(v, float) and math.isnan(v))}


# ------------------------------------------------------------------------------------------ power and memory
def _windows(run, rows: pd.DataFrame) -> dict:
    """Each point's (start, end) in Unix seconds, where the run recorded it: the engine's own timestamps, or the
    serving point's first send and last end."""
    out = {}
    if {"t_start", "t_end"} <= set(rows.columns):
        for i, r in rows.iterrows():
            if _num(r["t_start"]) and _num(r["t_end"]):
                out[i] = (float(r["t_start"]), float(r["t_end"]))
    req = run.table("requests") if "point_id" in rows else pd.DataFrame()
    if not req.empty and {"point_id", "send_time", "end_time"} <= set(req.columns):
        span = req.groupby("point_id").agg(t0=("send_time", "min"), t1=("end_time", "max"))
        for i, r in rows.iterrows():
            if r.get("point_id") in span.index:
                out[i] = tuple(span.loc[r["point_id"], ["t0", "t1"]])
    return out


def _nvml(tel: pd.DataFrame, window, row, mf: dict) -> dict:
    """vram_peak_mib, avg_power_w (summed over GPUs at each sample), max_temp_c and the median SM and memory
    clocks over the point's window from NVML; the temperature and clocks the run observed over all its busy
    samples where the window has none. Nothing for a server on another machine (this machine's GPU is not its)."""
    out = {"vram_peak_mib": None, "avg_power_w": None, "max_temp_c": None,
           "labkit_sm_clock_mhz": None, "labkit_mem_clock_mhz": None}
    if not _gpu_here(mf):
        return out
    peak = _num(row.get("device_mem_peak_bytes"))
    if peak:
        out["vram_peak_mib"] = int(peak / 2**20)
    out.update(_observed(mf))
    if window is None or tel is None or tel.empty or "timestamp" not in tel or "gpu" not in tel:
        return out
    w = tel[(tel["timestamp"] >= window[0]) & (tel["timestamp"] <= window[1]) & tel["gpu"].notna()]
    if w.empty:
        return out
    if "power_w" in w and w["power_w"].notna().any():
        out["avg_power_w"] = float(w.groupby("gpu")["power_w"].mean().sum())
    if "mem_used_bytes" in w and w["mem_used_bytes"].notna().any():
        out["vram_peak_mib"] = int(w.groupby("timestamp")["mem_used_bytes"].sum().max() / 2**20)
    for col, key, how in (("temp_c", "max_temp_c", "max"), ("sm_clock_mhz", "labkit_sm_clock_mhz", "median"),
                          ("mem_clock_mhz", "labkit_mem_clock_mhz", "median")):
        if col in w and pd.to_numeric(w[col], errors="coerce").notna().any():
            out[key] = float(getattr(pd.to_numeric(w[col], errors="coerce"), how)())
    return out


def _observed(mf: dict) -> dict:
    """The run's own NVML summary (`telemetry.observed`, per GPU in the manifest): hottest reading, median clocks."""
    devs = ((mf.get("gpus") or {}).get("devices") or []) if isinstance(mf.get("gpus"), dict) else []
    seen = [d.get("observed") or {} for d in devs if isinstance(d, dict)]
    out = {}
    for src, key, how in (("temp_c", "max_temp_c", "max"), ("sm_clock_mhz", "labkit_sm_clock_mhz", "median"),
                          ("mem_clock_mhz", "labkit_mem_clock_mhz", "median")):
        vals = [_num((s.get(src) or {}).get(how)) for s in seen if isinstance(s.get(src), dict)]
        vals = [v for v in vals if v is not None]
        if vals:
            out[key] = float(max(vals) if how == "max" else min(vals))
    return out
