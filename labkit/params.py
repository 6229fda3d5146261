"""Parameters: what an experiment takes (`Param`, a SPEC is a list of them), how a command line's strings
become typed values (`resolve`), and the frozen plan a run executes: one dataclass per experiment, made from its
SPEC by `plan_type` (a subclass of `Plan`, one typed field per parameter).

`BadInput` carries one line for the user; front doors print it and exit non-zero, before any allocation.
This is the bottom layer: every part of labkit may import it, and it imports nothing heavy (torch only
inside `resolve_device`).
"""
from __future__ import annotations

import difflib
import json
import math
import dataclasses
from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Mapping

if TYPE_CHECKING:
    import torch


class BadInput(ValueError):
    """A parameter error worth one line to the user (no traceback)."""


class Missing(BadInput):
    """What an experiment needs is not on this machine (vLLM not installed, ...): still one line for
    `labkit run`, but a nightly plan skips the entry with this reason and runs the rest."""


@dataclass(frozen=True)
class Param:
    """One parameter: its name, type, default and help, and the checks it declares (each item of a list is
    checked): `choices` (names, or a function giving them, called only when a value is checked: the engine's
    strategies are known after it is imported), `gt` / `ge` / `lt` / `le` bounds, and `auto`: the value an "auto"
    (or 0) takes per device type ({"cuda": ..., "cpu": ...}), decided when the plan is made; `unit`, what its
    numbers count. A plan's field of the same name carries all of it (`plan_type`)."""
    name: str
    kind: str                      # "str", "int", "float", "bool", "list[str]", "list[int]", "list[float]"
                                   # ("table": a file's sub-table, `check_table` only)
    default: Any
    help: str
    choices: "tuple | Callable[[], Any]" = ()
    gt: float | None = None
    ge: float | None = None
    le: float | None = None
    auto: Mapping[str, Any] | None = None
    lt: float | None = None
    unit: str = ""                 # what one of its numbers counts ("tokens", "rows", "GB/s"); empty: none

    def but(self, **changes) -> "Param":
        """This parameter with some fields changed (another help text, default or bound)."""
        return replace(self, **changes)

    def problem(self, value: Any) -> str | None:
        """The one line saying why `value` breaks this parameter's declared checks, or None. "auto" (and the
        0 that means auto) of a parameter with `auto` defaults are not checked: they are decided later."""
        if self.auto is not None and _is_auto(value):
            return None
        items = value if isinstance(value, list) else [value]
        names = self.choices() if callable(self.choices) else self.choices
        for v in items:
            if names and v not in names:
                shown = ", ".join(str(n) if n != "" else "(empty)" for n in names)
                return f"{self.name} must be one of {shown}; got {v!r}"
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                if self.gt is not None and not v > self.gt:
                    return f"{self.name} must be > {self.gt:g}, got {v}"
                if self.ge is not None and not v >= self.ge:
                    return f"{self.name} must be >= {self.ge:g}, got {v}"
                if self.lt is not None and not v < self.lt:
                    return f"{self.name} must be < {self.lt:g}, got {v}"
                if self.le is not None and not v <= self.le:
                    return f"{self.name} must be <= {self.le:g}, got {v}"
        return None


def _is_auto(value: Any) -> bool:
    """"auto", "" or a number 0: what a parameter with declared `auto` values leaves to the machine."""
    return isinstance(value, str) and value in ("auto", "") or (not isinstance(value, bool) and value == 0
                                                               and isinstance(value, (int, float)))


def check_declared(spec: list[Param], values: Mapping[str, Any]) -> None:
    """Every declared check of `spec` over `values`; the first broken one is a BadInput line."""
    for p in spec:
        if p.name in values:
            why = p.problem(values[p.name])
            if why:
                raise BadInput(why)


def fill_auto(spec: list[Param], values: dict, device_type: str) -> dict:
    """`values` with every "auto" (or 0) of a parameter that declares `auto` replaced by its value for
    `device_type` ("cuda" or "cpu"), then every declared check run on the result."""
    for p in spec:
        if p.auto is not None and p.name in values and _is_auto(values[p.name]) and device_type in p.auto:
            values[p.name] = p.auto[device_type]
    check_declared(spec, values)
    return values


_TOML_TYPES = {"str": (str, "a string"), "int": (int, "a whole number"), "float": ((int, float), "a number"),
               "bool": (bool, "true or false"), "table": (dict, "a table of name = value")}


def check_table(spec: list[Param], table: Mapping[str, Any], where: str) -> dict:
    """A table read from a file (TOML, JSON) against `spec`: unknown keys refused, each value of its declared
    type as the file gives it (no parsing of strings: `timeout_s = "10"` is refused), then the declared checks.
    Returns the table with defaults for what it leaves out; every problem is one BadInput line after `where`."""
    names = {p.name: p for p in spec}
    extra = sorted(set(table) - set(names))
    if extra:
        raise BadInput(f"{where}: unknown key(s) {', '.join(extra)}; it takes {', '.join(sorted(names))}")
    out = {}
    for p in spec:
        if p.name not in table:
            out[p.name] = p.default
            continue
        v = table[p.name]
        types, what = _TOML_TYPES[p.kind]
        if not isinstance(v, types) or (isinstance(v, bool) and p.kind != "bool"):
            raise BadInput(f"{where}: `{p.name}` must be {what}, got {v!r}")
        why = p.problem(v)
        if why:
            raise BadInput(f"{where}: {why}")
        out[p.name] = v
    return out


# The parameters most experiments take, declared once (`.but(help=...)` where one means something more).
OUT_DIR = Param("out_dir", "str", "", "run folder (empty: results/<run-id>)")
DEVICE = Param("device", "str", "auto", "auto, cpu, cuda, cuda:N")
SEED = Param("seed", "int", 0, "weights and cache contents")
SHAPE = Param("shape", "str", "auto", "model shape (auto: qwen3.8-flash-next on CUDA, tiny on CPU)",
              auto={"cuda": "qwen3.8-flash-next", "cpu": "tiny"})
# How a shape's model is held and routed (`MODEL_PARAMS`, `model_kwargs`) lives in `shapes.py`, beside the
# weight storages it names.


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")
_WHAT = {"int": "a whole number (sizes like 8K or 1M accepted)", "float": "a number", "bool": "true or false"}


# Experiments (and studies) renamed after runs of them were committed, old name -> today's: the one place an old
# name lives.
# A run folder keeps the name it was written with; reading it (`results.read_manifest`, a run's metrics) gives
# today's, so every reader sees one name, and `labkit run OLD` runs today's.
RENAMED_EXPERIMENTS = {"serve": "serve_sweep", "xfer": "crossmodel", "xfer-ablation": "crossmodel-ablation",
                       "xfer-frontier": "crossmodel-frontier", "xfer-attribution": "crossmodel-attribution"}


def experiment_name(name):
    """Today's name of an experiment called `name` when a run was written (unchanged when not renamed)."""
    return RENAMED_EXPERIMENTS.get(name, name)


_FIELD_TYPES = {"str": str, "int": int, "float": float, "bool": bool, "list[str]": tuple[str, ...],
                "list[int]": tuple[int, ...], "list[float]": tuple[float, ...], "table": Mapping[str, Any]}


def _recorded(v: Any) -> Any:
    """A held value as a manifest and a notebook's JSON record it: tuples as lists."""
    if isinstance(v, (list, tuple)):
        return [_recorded(x) for x in v]
    if isinstance(v, Mapping):
        return {k: _recorded(x) for k, x in v.items()}
    return v


@dataclass(frozen=True)
class Plan:
    """A validated experiment: every parameter resolved (typed, "auto" decided for the machine it was planned on).
    Made once, in the process the user started; a notebook receives it as JSON (`to_json`; the registry's `run`
    reads it back) and runs it without parsing or checking anything again. Each experiment's plan is a subclass
    made by `plan_type` from its SPEC: one field per parameter, read as an attribute (`plan.budgets`). However it
    is made (its constructor, `from_params`, `dataclasses.replace`), a list is held as a tuple. `params` is the
    same plan as the dict a manifest records, and `from_params` reads such a dict back."""
    experiment: ClassVar[str] = ""
    spec: ClassVar[tuple[Param, ...]] = ()         # the parameters a command line may set (derived fields aside)

    def __post_init__(self):
        for f in dataclasses.fields(self):          # frozen: a list given is held as the tuple its type says
            if isinstance(getattr(self, f.name), list):
                object.__setattr__(self, f.name, tuple(getattr(self, f.name)))

    @property
    def params(self) -> dict:
        """The plan as a manifest records it: {name: value}, lists as lists."""
        return {f.name: _recorded(getattr(self, f.name)) for f in dataclasses.fields(self)}

    def to_json(self) -> str:
        """The plan as a notebook receives it: {"experiment", "params"} (a tuple is a JSON list)."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return json.dumps({"experiment": self.experiment, "params": fields}, default=str)

    @classmethod
    def from_params(cls, values: Mapping[str, Any]) -> "Plan":
        """A plan from checked parameters as a check returns them or a manifest records them: every parameter of
        the SPEC given (a derived value may be left out: its default), no other name (a name missing or unknown is
        a ValueError: the dict is not this experiment's plan)."""
        names = [f.name for f in dataclasses.fields(cls)]
        missing = sorted({p.name for p in cls.spec} - set(values))
        unknown = sorted(set(values) - set(names))
        if missing or unknown:
            raise ValueError(f"{cls.experiment} plan: missing {missing}, unknown {unknown}")
        return cls(**values)

    @classmethod
    def from_manifest(cls, recorded: Mapping[str, Any]) -> "tuple[Plan, dict]":
        """The plan of a committed run, from the parameters its manifest records: a parameter added since the run
        was made takes its default (what the run did before it existed); returns (the plan, the recorded values
        of parameters the plan no longer takes)."""
        names = {f.name: f for f in dataclasses.fields(cls)}
        given = {k: v for k, v in recorded.items() if k in names}
        for k, f in names.items():
            if k not in given:
                given[k] = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        return cls.from_params(given), {k: v for k, v in recorded.items() if k not in names}

    @classmethod
    def field_param(cls, name: str) -> Param:
        """The `Param` a field was made from: its help, unit, choices, bounds and default."""
        return next(f.metadata["param"] for f in dataclasses.fields(cls) if f.name == name)


def plan_type(experiment: str, spec: list[Param], derived: list[Param] = ()) -> type[Plan]:
    """The frozen plan of `experiment`: one field per parameter of `spec` (typed by its kind, a list as a tuple;
    its default the parameter's; the `Param` itself in the field's metadata), then one per `derived` value that
    the experiment's check adds (not settable from a command line)."""
    def spec_field(p: Param):
        default, meta = tuple(p.default) if isinstance(p.default, list) else p.default, {"param": p}
        made = dataclasses.field(default_factory=lambda: dict(default), metadata=meta) if isinstance(default, dict) \
            else dataclasses.field(default=default, metadata=meta)
        return p.name, _FIELD_TYPES[p.kind], made

    name = "".join(w.capitalize() for w in experiment.split("_")) + "Plan"
    cls = dataclasses.make_dataclass(name, [spec_field(p) for p in [*spec, *derived]], bases=(Plan,), frozen=True,
                                     namespace={"experiment": experiment, "spec": tuple(spec)})
    cls.__doc__ = f"The checked plan of `labkit run {experiment}`: " + ", ".join(p.name for p in spec)
    return cls


def parse_value(p: Param, raw: Any) -> Any:
    """Turn a CLI string (or a notebook value) into the parameter's type; a value that is not one is a
    one-line BadInput naming the parameter and what it takes."""
    kind = p.kind
    try:
        if kind.startswith("list["):
            if isinstance(raw, str):
                if raw.strip() == "auto":
                    return "auto"
                items = [x.strip() for x in raw.split(",") if x.strip()]
            elif isinstance(raw, (list, tuple)):
                items = list(raw)
            else:
                items = [raw]
            kind = p.kind[5:-1]
            out = []
            for x in items:
                raw = x        # the item the message names
                out.append(parse_size(x) if kind == "int" else _float(p, x) if kind == "float" else str(x))
            return out
        if kind in ("int", "float") and isinstance(raw, str) and raw.strip() == "auto":
            return "auto"            # decided by the experiment for the machine it is planned on
        if kind == "int":
            return parse_size(raw)
        if kind == "float":
            return _float(p, raw)
        if kind == "bool":
            if isinstance(raw, bool):
                return raw
            word = str(raw).strip().lower()
            if word not in _TRUE + _FALSE:
                raise ValueError(raw)
            return word in _TRUE
        return str(raw)
    except (TypeError, ValueError):
        what = "a finite number" if kind == "float" and _nonfinite(raw) else _WHAT.get(kind, kind)
        raise BadInput(f"parameter {p.name}: {raw!r} is not {what}") from None


def _float(p: Param, raw: Any) -> float:
    """A float parameter's value: nan never, inf only where the parameter's default is inf (there it means "no
    limit", e.g. a closed loop's request rate); ValueError otherwise (the caller's one line)."""
    if isinstance(raw, bool):
        raise ValueError(raw)
    v = float(raw)
    if _nonfinite(v) and not (isinstance(p.default, float) and math.isinf(p.default) and v == p.default):
        raise ValueError(raw)
    return v


def _nonfinite(raw: Any) -> bool:
    try:
        return not math.isfinite(float(raw))
    except (TypeError, ValueError):
        return False


def parse_size(x: Any) -> int:
    """'8K' -> 8192, '1M' -> 1048576, '248k' -> 253952; ints pass through. ValueError for anything else
    (a word, a fraction of a token, a bool)."""
    if isinstance(x, bool):
        raise ValueError(f"{x!r} is not a whole number")
    if isinstance(x, int):
        return int(x)
    s = str(x).strip().lower()
    mult = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}.get(s[-1:], 1)
    if mult != 1:
        s = s[:-1]
    try:
        v = float(s) * mult
    except ValueError:
        raise ValueError(f"{x!r} is not a whole number") from None
    if v != v or v in (float("inf"), float("-inf")) or v != int(v):
        raise ValueError(f"{x!r} is not a whole number")
    return int(v)


def tokens_label(v) -> str:
    """A token count as people write it, the way `parse_size` reads it back: 256, 1K, 4K, 64K, 248K, 1M, 1.5K
    (never 0K or 4.0K). The one label of sizes in tables, figures and messages."""
    v = int(v)
    for unit, n in (("M", 1 << 20), ("K", 1 << 10)):
        if v >= n:
            q = v / n
            return f"{q:.0f}{unit}" if q == int(q) else f"{q:.3g}{unit}"
    return str(v)


def resolve(spec: list[Param], given: dict, experiment: str) -> dict:
    """Defaults + given values, unknown names rejected, each value's declared checks run ("auto" ones are
    checked when `fill_auto` decides them)."""
    names = {p.name: p for p in spec}
    unknown = sorted(set(given) - set(names))
    if unknown:
        close = {u: difflib.get_close_matches(u, names, n=1, cutoff=0.6) for u in unknown}
        hints = [f"{u} (did you mean {c[0]}?)" if c else u for u, c in close.items()]
        raise BadInput(f"{experiment}: unknown parameter(s) {', '.join(hints)}; `labkit run {experiment} --help` "
                       f"lists its {len(names)}")
    values = {p.name: parse_value(p, given[p.name]) if p.name in given else p.default for p in spec}
    check_declared(spec, values)
    return values


def resolve_device(device: str) -> "torch.device":
    import torch        # here only: every command line parses through this module, and most never need torch
    if device in ("", "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise BadInput(f"device {device!r} is not a device name (auto, cpu, cuda, cuda:N)") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise BadInput(f"device={device} but this machine has no CUDA GPU (torch {torch.__version__}); use device=cpu or auto")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise BadInput(f"device={device} but only {torch.cuda.device_count()} CUDA device(s) exist")
    elif dev.type != "cpu":
        raise BadInput(f"device {device!r}: only cpu and cuda are supported")
    return dev


def gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def check_positive(name: str, values: list[int]) -> None:
    bad = [v for v in values if v <= 0]
    if bad:
        raise BadInput(f"{name} must be > 0, got {bad[0]}")


def one_line(ex: BaseException) -> str:
    """An exception as one line, `Type: the first line of its message` (500 characters at most): the one form a
    failed row, a manifest, a record or a printed line gives an error in (`execute.error_line` reads papermill's
    errors, which carry the notebook's own exception, into the same form)."""
    msg = str(ex).strip().splitlines()[0] if str(ex).strip() else "no message"
    return f"{type(ex).__name__}: {msg}"[:500]



def kv_pairs(pairs: list[str] | None) -> dict:
    """`-p key=value` pairs as given on a command line (values stay strings: the spec parses them)."""
    out = {}
    for p in pairs or []:
        if "=" not in p:
            raise BadInput(f"-p {p!r}: expected key=value")
        k, v = p.split("=", 1)
        out[k.strip()] = v.strip()
    return out


def keywords(given: dict, defaults: dict, required: tuple = (), where: str = ""):
    """A study's keyword arguments against its declared `defaults` (names `required` must be given): the
    values as attributes, or one BadInput line naming what is unknown or missing."""
    unknown = sorted(set(given) - set(defaults))
    missing = [k for k in required if given.get(k) in (None, "")]
    if unknown or missing:
        raise BadInput(f"{where}: unknown {unknown} / missing {missing}; takes {', '.join(defaults)}")
    return SimpleNamespace(**{**defaults, **given})
