"""`labkit study NAME -p k=v`: the studies of the registry (`labkit.experiments.STUDIES`), their keywords checked.

A study is longer and more specialised than an experiment (the cross-model mapper ablation over feature sets and
depths, the TTFT frontier, the per-layer attribution: the figures of `docs/cross-model.md`) and keeps its own
folder of CSVs or a crossmodel run folder; each is the `study(**keywords)` of its module, whose `DEFAULTS` declare
its keywords (their types are the defaults'), checked before anything loads: one line names an unknown, missing
or malformed one."""
from __future__ import annotations

import importlib

from ..params import BadInput, experiment_name
from . import STUDIES


def module(name: str):
    """The module of study `name` (or of its old name, `params.RENAMED_EXPERIMENTS`)."""
    name = experiment_name(name)
    if name not in STUDIES:
        raise BadInput(f"unknown study {name!r}: {', '.join(STUDIES)}")
    return importlib.import_module(STUDIES[name].where)


def coerce(name: str, given: dict) -> dict:
    """Strings from a command line as the types of the study's DEFAULTS (bool: true/false/1/0)."""
    defaults = module(name).DEFAULTS
    out = {}
    for k, raw in given.items():
        if k not in defaults:
            raise BadInput(f"study {name}: unknown keyword {k!r}; takes {', '.join(defaults)}")
        d = defaults[k]
        try:
            if isinstance(d, bool):
                if str(raw).lower() not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
                    raise ValueError
                out[k] = str(raw).lower() in ("1", "true", "yes", "on")
            elif isinstance(d, int):
                out[k] = int(raw)
            elif isinstance(d, float):
                out[k] = float(raw)
            else:
                out[k] = str(raw)
        except ValueError:
            raise BadInput(f"study {name}: {k}={raw!r} is not a {type(d).__name__}") from None
    return out


def help_text(name: str | None) -> str:
    if not name:
        w = max(map(len, STUDIES))
        return "\n".join(["labkit study NAME [-p KEY=VALUE ...]   (labkit study NAME --help: its keywords)", ""] +
                         [f"  {n:<{w}}  {s.question}" for n, s in STUDIES.items()])
    m, name = module(name), experiment_name(name)
    lines = [f"labkit study {name} [-p KEY=VALUE ...]", "", STUDIES[name].question, "",
             "keywords (required: " + (", ".join(m.REQUIRED) or "none") + "):"]
    w = max(map(len, m.DEFAULTS))
    lines += [f"  {k:<{w}}  {type(v).__name__:<5}  default {v!r}" for k, v in m.DEFAULTS.items()]
    return "\n".join(lines)


def run(name: str, given: dict) -> int:
    return module(name).study(**coerce(name, given))
