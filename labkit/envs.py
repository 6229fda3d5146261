"""Every environment variable labkit reads, declared once (as vLLM's `envs.py` does): name, type, default and
what it changes. Nothing else in `labkit/` reads `LABKIT_*`.

Two kinds:

- **Engine switches** change what the engine computes (which kernel runs, the weights' layout, whether block
  pieces are compiled). They are A/B levers, so each is also a decode parameter (`labkit run decode -p
  gemv=auto,off` measures both in one run), and every run's manifest records the switches in force
  (`manifest["engine"]`): a committed run says how it was made. The module that uses a switch holds its value
  in one module global (`owner`), read when the engine is built; `apply` sets those globals in a process, so a
  sweep can change a switch between points (torch.compile guards on module globals and recompiles).
- **Plumbing** says where things are or how a process was started (caches, the results folder, a session
  name); it changes no measured figure and is recorded only where set.

Values parse strictly: a bool is one of 1/0, true/false, on/off, yes/no; anything else is one `BadInput` line
naming the variable and what it takes (`check_environment`, called by the CLI before anything runs).
"""
from __future__ import annotations

import difflib
import importlib
import itertools
import os
import sys
from dataclasses import dataclass, field

from .params import BadInput, Param

_TRUE, _FALSE = ("1", "true", "on", "yes"), ("0", "false", "off", "no")


@dataclass(frozen=True)
class Var:
    name: str                   # LABKIT_...
    kind: str                   # "bool", "int", "choice", "str"
    default: object
    effect: str                 # what it changes, one line
    choices: tuple = ()         # for "choice": the canonical values
    aliases: dict = field(default_factory=dict)     # other spellings of a choice -> canonical
    param: str = ""             # engine switches: the decode parameter's name
    owner: str = ""             # engine switches: "module:GLOBAL" holding the value in the engine
    to_owner: dict | None = None    # canonical value -> the owner's representation (None: the same)
    minimum: int | None = None

    @property
    def engine(self) -> bool:
        return bool(self.owner)

    def parse(self, raw: str | None):
        """The canonical value of `raw` (None: the default); a bad value is one BadInput line."""
        if raw is None or raw == "":
            return self.default
        s = str(raw).strip()
        if self.kind == "bool":
            if s.lower() in _TRUE:
                return True
            if s.lower() in _FALSE:
                return False
            raise BadInput(f"{self.name}={raw!r}: expected on or off (1/0, true/false, yes/no)")
        if self.kind == "int":
            try:
                v = int(s)
            except ValueError:
                raise BadInput(f"{self.name}={raw!r}: expected an integer") from None
            if self.minimum is not None and v < self.minimum:
                raise BadInput(f"{self.name}={raw!r}: must be >= {self.minimum}")
            return v
        if self.kind == "choice":
            v = self.aliases.get(s.lower(), s.lower())
            if v not in self.choices:
                raise BadInput(f"{self.name}={raw!r}: one of {', '.join(self.choices)}")
            return v
        return s


def _switch(name, kind, default, effect, param, owner, **kw) -> Var:
    return Var(name, kind, default, effect, param=param, owner=owner, **kw)


_ONOFF = {"1": "on", "0": "off", "true": "on", "false": "off", "yes": "on", "no": "off"}

VARS: list[Var] = [
    # --- engine switches: they change what is computed (recorded in every manifest) ---
    _switch("LABKIT_GEMV", "choice", "auto", "the lab's GEMV kernel for small-row products: auto (one row on "
            "K-major weights), on (1-16 rows, any layout), off (cuBLAS)", "gemv", "labkit.engine.model.gemv:_MODE",
            choices=("auto", "on", "off"), aliases=_ONOFF, to_owner={"auto": "auto", "on": "1", "off": "0"}),
    _switch("LABKIT_GEMV_PDL", "choice", "auto", "programmatic dependent launch for the GEMV: auto (on for "
            "K-major, off for row-major), on, off", "gemv_pdl", "labkit.engine.model.gemv:_PDL_MODE",
            choices=("auto", "on", "off"), aliases=_ONOFF),
    _switch("LABKIT_GEMV_GLU", "bool", True, "the FFN's gate/up product fused with SiLU in the GEMV",
            "gemv_glu", "labkit.engine.model.gemv:_GLU"),
    _switch("LABKIT_GEMV_NORM", "bool", True, "the residual add and RMSNorm inside the GEMV", "gemv_norm",
            "labkit.engine.model.gemv:_NORM"),
    _switch("LABKIT_GEMV_NORM_ROWS", "int", 1, "rows up to which 'auto' fuses the norm into the GEMV",
            "gemv_norm_rows", "labkit.engine.model.gemv:_NORM_ROWS", minimum=0),
    _switch("LABKIT_GEMV_ROWS", "int", 1, "rows up to which 'auto' takes the GEMV on K-major weights",
            "gemv_rows", "labkit.engine.model.gemv:_ROWS", minimum=0),
    _switch("LABKIT_GEMV_SWAP", "bool", True, "the GEMV's tensor-core path as out^T = w^T @ x^T (2-16 rows)",
            "gemv_swap", "labkit.engine.model.gemv:_SWAP"),
    _switch("LABKIT_DN_FUSED", "bool", True, "DeltaNet's mixer after its projection as two Triton kernels",
            "dn_fused", "labkit.engine.model.deltanet_step:FUSED_MIX"),
    _switch("LABKIT_DN_PDL", "bool", False, "programmatic dependent launch for DeltaNet's mixer kernels",
            "dn_pdl", "labkit.engine.model.deltanet_step:MIX_PDL"),
    _switch("LABKIT_HC_PDL", "bool", True, "programmatic dependent launch for the hyper-connections' mix kernels",
            "hc_pdl", "labkit.engine.model.hc_mix:HC_PDL"),
    _switch("LABKIT_HC_FUSED", "bool", True, "the hyper-connections' mix at decode as two Triton kernels",
            "hc_fused", "labkit.engine.model.hc_mix:HC_FUSED"),
    _switch("LABKIT_MOE_GEMM", "bool", True, "a prefill chunk's routed experts as grouped GEMMs (off: the "
            "decode step's grouped kernel, a row at a time)", "moe_gemm", "labkit.engine.model.moe_gemm:MOE_GEMM"),
    _switch("LABKIT_MOE_STEP", "bool", True, "a decode step's W4A16 experts in three launches (the shared expert "
            "in the routed products' launches, the weighted sum in the down product's end)", "moe_step",
            "labkit.engine.model.moe_step:MOE_STEP"),
    _switch("LABKIT_W4_SPLIT_WAVES", "bool", False, "a W4A16 decode product's K split chosen by the waves its "
            "programs take, not rounded up to fill the multiprocessors", "w4_split_waves",
            "labkit.engine.model.grouped_gemv:W4_SPLIT_WAVES"),
    _switch("LABKIT_W4_X_AHEAD", "bool", True, "a W4A16 decode product's x read as 32-bit pairs, each K tile's "
            "loaded with its weight a tile ahead", "w4_x_ahead", "labkit.engine.model.grouped_gemv:W4_X_AHEAD"),
    _switch("LABKIT_W4_ONE", "bool", True, "a dense W4A16 decode product's plan (one group of every row) taken as "
            "known by its kernel, not read at each program's start", "w4_one", "labkit.engine.model.w4_decode:W4_ONE"),
    _switch("LABKIT_W4_PIPE", "int", 0, "a W4A16 decode product's K loop a tile a turn under Triton's software "
            "pipeliner with this many stages (0: two tiles a turn by hand)", "w4_pipe",
            "labkit.engine.model.grouped_gemv:W4_PIPE", minimum=0),
    _switch("LABKIT_QSA_FUSED", "bool", True, "the QSA heads' q/k norms, RoPE and KV row in one kernel",
            "qsa_fused", "labkit.engine.model.qsa_step:FUSED_QSA"),
    _switch("LABKIT_SELECT_BLOCK", "int", 0, "keys a selection program takes (0: the heuristic)",
            "select_block_keys", "labkit.engine.model.select:FIXED_BLOCK", minimum=0),
    _switch("LABKIT_WEIGHTS", "choice", "nk", "the weights' layout: nk (K-major, a checkpoint's nn.Linear) or kn",
            "weights", "labkit.engine.model.layers:K_MAJOR", choices=("nk", "kn"),
            to_owner={"nk": True, "kn": False}),
    _switch("LABKIT_COMPILE", "bool", True, "torch.compile the block pieces", "compile_blocks",
            "labkit.engine.model.hybrid:COMPILE"),
    _switch("LABKIT_HOT_PLAN", "choice", "kernel", "the hot cache's plan: one Triton kernel, or the torch ops "
            "(its reference)", "hot_plan", "labkit.engine.transfer.hot_cache:PLAN", choices=("kernel", "torch")),
    _switch("LABKIT_PREFILL_ATTN", "choice", "auto", "prefill's dense attention: split (cuDNN over the prefix with "
            "the GQA group folded into the queries, plus the chunk's causal square, merged by log-sum-exp), sdpa "
            "(SDPA per KV head under a lower-right causal mask), auto (split where cuDNN attention runs)",
            "prefill_attn", "labkit.engine.model.attention:PREFILL_KERNEL", choices=("auto", "split", "sdpa")),
    _switch("LABKIT_DN_PREFILL", "choice", "auto", "prefill's chunked delta rule: fla (flash-linear-attention's "
            "Triton kernel), torch (fp32 products, a Python loop over 64-token chunks), auto (fla where installed, "
            "on CUDA)", "dn_prefill", "labkit.engine.model.layers:DN_PREFILL", choices=("auto", "fla", "torch")),
    _switch("LABKIT_ARCH", "choice", "auto", "the GPU features the kernels use: auto (each where the GPU has it), "
            "portable (the Ampere path on any GPU: fp8 keys decoded in the kernel, no PDL, no inline PTX, SDPA "
            "prefill), native (every native feature; refused on a GPU without one)", "arch",
            "labkit.engine.model.arch:MODE", choices=("auto", "native", "portable")),
    # --- plumbing: where things are and how a process was started (no figure changes) ---
    Var("LABKIT_CACHE", "str", "", "models' and vLLM's cache root (default ~/.cache/labkit)"),
    Var("LABKIT_RESULTS", "str", "", "the results folder the explorer browses (default results/)"),
    Var("LABKIT_SESSION", "str", "", "a name for the runs of one device session (their reports meet)"),
    Var("LABKIT_GIT_SHA", "str", "", "the commit of a tree copied without .git"),
    Var("LABKIT_RUN_DRIVER", "str", "", "the pid of the `labkit run` that started a notebook kernel"),
    Var("LABKIT_PLAIN_PROGRESS", "bool", False, "text progress on stderr instead of widgets (papermill)"),
    Var("LABKIT_STRATEGIES", "str", "", "extra transfer-strategy files, separated by the path separator"),
    Var("LABKIT_VLLM_PYTHON", "str", "", "the Python of the venv that holds vLLM"),
    Var("LABKIT_WATCH_PARENT", "int", 0, "a launcher exits when this pid is gone"),
    Var("LABKIT_XFER_SHM", "str", "", "the cross-model KV files' root (default /dev/shm/labkit-xfer)"),
    Var("LABKIT_XFER_KEY", "str", "", "the per-user secret that authenticates KV files (default "
        "~/.config/labkit/xfer.key, made 0600 on first use)"),
    Var("LABKIT_LAB_TOKEN", "str", "", "the lab's token (default: a fresh one)"),
    # set by `labkit node` for the Ray processes of a cluster node (labkit/cluster)
    Var("LABKIT_NODE_KIND", "str", "", "the machine kind a cluster node advertises (h200, rtx3090, cpu)"),
    Var("LABKIT_NODE_REPO", "str", "", "the checkout a cluster node runs its entries in"),
    Var("LABKIT_NODE_COMMIT", "str", "", "the commit a cluster node advertised when it joined"),
    Var("LABKIT_NODE_SCRATCH", "str", "", "where a cluster node's entries run before their folders go to the head"),
    Var("LABKIT_NODE_OMP_NUM_THREADS", "str", "", "the node's own OMP_NUM_THREADS, given back to its entries "
        "(Ray sets 1 for its workers)"),
]
BY_NAME: dict[str, Var] = {v.name: v for v in VARS}
BY_PARAM: dict[str, Var] = {v.param: v for v in VARS if v.param}
SWITCHES: list[Var] = [v for v in VARS if v.engine]


def get(name: str):
    """The parsed value of variable `name` from the environment (its default when unset)."""
    return BY_NAME[name].parse(os.environ.get(name))


def owner_value(name: str):
    """What an engine module stores for switch `name` at import: the environment's value in its form."""
    v = BY_NAME[name]
    val = get(name)
    return v.to_owner[val] if v.to_owner else val


def set_env(name: str, value) -> None:
    """Set (value not None) or clear a plumbing variable for this process and its children."""
    if name not in BY_NAME:
        raise KeyError(name)
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = str(value)


def check_environment() -> None:
    """Every LABKIT_* variable set here parses, and none is unknown (a typo is no silent default)."""
    for k, raw in os.environ.items():
        if not k.startswith("LABKIT_"):
            continue
        if k not in BY_NAME:
            close = difflib.get_close_matches(k, BY_NAME, n=1)
            raise BadInput(f"unknown environment variable {k}" + (f"; did you mean {close[0]}?" if close else ""))
        BY_NAME[k].parse(raw)


def _owner(v: Var):
    mod, attr = v.owner.split(":")
    return importlib.import_module(mod), attr


def in_force() -> dict:
    """The engine switches as the engine holds them now (canonical values), for manifests and rows. A module
    not imported yet holds what the environment says."""
    out = {}
    for v in SWITCHES:
        mod = v.owner.split(":")[0]
        if mod in sys.modules:
            held = getattr(sys.modules[mod], v.owner.split(":")[1])
            if v.to_owner:
                held = {o: c for c, o in v.to_owner.items()}.get(held, held)
            out[v.param] = held
        else:
            out[v.param] = get(v.name)
    return out


def parse_switches(given: dict) -> dict:
    """`{param: raw}` -> `{param: canonical}` for engine switches (a bad value is one BadInput line)."""
    out = {}
    for k, raw in given.items():
        v = BY_PARAM[k]
        try:
            out[k] = v.parse(raw)
        except BadInput as ex:
            raise BadInput(str(ex).replace(v.name, k, 1)) from None
    return out


def apply(values: dict) -> dict:
    """Set engine switches in this process (`{param: canonical value}`); returns the previous values, so a
    caller can put them back."""
    before = in_force()
    for k, val in values.items():
        v = BY_PARAM[k]
        mod, attr = _owner(v)
        setattr(mod, attr, v.to_owner[val] if v.to_owner else val)
    return {k: before[k] for k in values}


def plumbing_in_force() -> dict:
    """The plumbing variables set in this process (for a manifest: how it was started)."""
    return {v.name: os.environ[v.name] for v in VARS if not v.engine and os.environ.get(v.name)
            and v.name != "LABKIT_LAB_TOKEN"}


def switch_params() -> list:
    """The engine switches as sweep parameters (decode's `-p gemv=auto,off`): empty takes the value in force
    (the environment's, recorded in the manifest); several values measure each in one run."""
    return [Param(v.param, "list[str]", [], f"engine switch ({v.name}): {v.effect}; several values: one sweep "
                  "each, in this run (empty: as the environment says)") for v in SWITCHES]


def check_switch_params(p: dict) -> dict:
    """Parse the switch parameters of resolved params `p` in place (canonical values); one BadInput line."""
    for v in SWITCHES:
        if v.param in p:
            p[v.param] = [parse_switches({v.param: raw})[v.param] for raw in p[v.param] or []]
    return p


def variants(p: dict) -> list[dict]:
    """The combinations of the switch parameters given in `p` (`[{}]` when none is given)."""
    given = [(v.param, p[v.param]) for v in SWITCHES if p.get(v.param)]
    return [dict(zip([k for k, _ in given], combo)) for combo in itertools.product(*[vals for _, vals in given])]


def variant_name(values: dict) -> str:
    return ",".join(f"{k}={_fmt(v)}" for k, v in values.items())


def _fmt(v) -> str:
    return ("on" if v else "off") if isinstance(v, bool) else str(v)
