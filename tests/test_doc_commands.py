"""Every command the docs quote does something: `labkit` subcommands and their options exist, `labkit run NAME`
names an experiment and each `-p KEY=` is one of its parameters, `labkit study NAME -p KEY=` is one of the
study's keywords, and a quoted `python -m MODULE` has a main. Read from README.md, docs/, notebooks/ and the
docstrings under labkit/ and scripts/ — a quoted command that silently does nothing fails here."""
from __future__ import annotations

import argparse
import importlib.util
import json
import re
from pathlib import Path

import pytest

from labkit import experiments
from labkit.experiments import studies
from labkit.cli import build_parser

REPO = Path(__file__).resolve().parents[1]
CMD = re.compile(r"(?<![\w/.-])labkit (run|study|report|runs|predict|compare|nightly|lab|serve|shapes|docs|node)\b"
                 r"([^`\n|)\"]*)")
PYM = re.compile(r"python3? -m (labkit[\w.]*)")
PLACEHOLDER = re.compile(r"^[A-Z_]+$|^<.*>$|^\[|^\.\.\.$|\{")
PLACEHOLDER_KEYS = {"key", "name", "k"}


def _texts():
    for p in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "Makefile"]:
        yield p, p.read_text()
    for p in sorted((REPO / "notebooks").glob("*.ipynb")):
        nb = json.loads(p.read_text())
        yield p, "\n".join("".join(c["source"]) for c in nb["cells"])
    for p in sorted([*(REPO / "labkit").rglob("*.py"), *(REPO / "scripts").glob("*.py")]):
        yield p, p.read_text()


def _quoted():
    out = []
    for path, text in _texts():
        for m in CMD.finditer(text):
            out.append((path.relative_to(REPO), m.group(1), m.group(2)))
    return out


QUOTED = _quoted()


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    ap = build_parser()
    act = next(a for a in ap._actions if isinstance(a, argparse._SubParsersAction))
    return dict(act.choices)


SUBS = _subparsers()


def _options(sub: str) -> set[str]:
    return {o for a in SUBS[sub]._actions for o in a.option_strings}


def test_the_docs_quote_commands():
    """The extraction finds what it should (a broken pattern would make every check below vacuous)."""
    kinds = {k for _, k, _ in QUOTED}
    assert {"run", "report", "runs", "predict", "study"} <= kinds and len(QUOTED) > 100


@pytest.mark.parametrize("sub", sorted({k for _, k, _ in QUOTED}))
def test_each_quoted_subcommand_exists(sub):
    assert sub in SUBS, [str(p) for p, k, _ in QUOTED if k == sub][:3]


def test_quoted_options_exist():
    bad = []
    for path, sub, rest in QUOTED:
        if sub not in SUBS:
            continue
        if path.name == "Makefile":        # its comments are prose ("labkit lab passes --allow-root" to Jupyter)
            continue
        for opt in re.findall(r"(?:^|(?<=\s))(--?[a-z][\w-]*)", rest):
            if opt not in _options(sub) and opt not in ("-p",):
                bad.append(f"{path}: labkit {sub} ... {opt}")
    assert not bad, bad


def _pairs(rest: str) -> list[str]:
    return [k for k in re.findall(r"-p\s+['\"]?([a-z_]\w*)=", rest) if k not in PLACEHOLDER_KEYS]


def test_quoted_runs_name_experiments_and_their_parameters():
    bad = []
    for path, sub, rest in QUOTED:
        if sub != "run":
            continue
        words = rest.split()
        if not words or words[0].startswith("-") or PLACEHOLDER.match(words[0]):
            continue
        name = words[0].rstrip(".,:;")
        if name not in experiments.EXPERIMENTS:
            bad.append(f"{path}: unknown experiment {name!r}")
            continue
        params = {p.name for p in experiments.get(name).spec}
        bad += [f"{path}: labkit run {name} has no parameter {k!r}" for k in _pairs(rest) if k not in params]
    assert not bad, bad


def test_quoted_studies_name_studies_and_their_keywords():
    bad = []
    for path, sub, rest in QUOTED:
        if sub != "study":
            continue
        words = rest.split()
        if not words or words[0].startswith("-") or PLACEHOLDER.match(words[0]):
            continue
        name = words[0].rstrip(".,:;")
        if name not in studies.STUDIES:
            bad.append(f"{path}: unknown study {name!r}")
            continue
        keys = studies.module(name).DEFAULTS
        bad += [f"{path}: labkit study {name} has no keyword {k!r}" for k in _pairs(rest) if k not in keys]
    assert not bad, bad


def test_quoted_python_modules_have_a_main():
    bad = []
    for path, text in _texts():
        for mod in PYM.findall(text):
            mod = mod.rstrip(".")
            spec = importlib.util.find_spec(mod)
            if spec is None or spec.origin is None:
                bad.append(f"{path}: python -m {mod}: no such module")
                continue
            origin = Path(spec.origin)
            src = (origin.parent / "__main__.py") if origin.name == "__init__.py" else origin
            if not src.exists() or "__main__" not in src.read_text():
                bad.append(f"{path}: python -m {mod} runs nothing")
    assert not bad, bad


def test_every_subcommand_answers_help(capsys):
    from labkit.cli import main
    for sub in ("run", "study"):
        assert main([sub, "--help"]) == 0
    assert "crossmodel-frontier" in capsys.readouterr().out
