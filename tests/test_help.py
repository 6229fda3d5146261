"""Help for every option of every command, in the words a newcomer needs: what an "auto" becomes on this machine,
the parameters grouped (what to measure, the strategies' settings, the engine's switches), what `labkit docs` does
without --write, what `labkit serve`'s weights are, and a NAME=VALUE without its -p answered with the fix."""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest

from browser_util import REPO
from labkit.cli import build_parser

ENV = {**os.environ, "PYTHONWARNINGS": "ignore", "PYTHONPATH": str(REPO)}


def labkit(*args):
    return subprocess.run([sys.executable, "-m", "labkit", *args], capture_output=True, text=True, env=ENV, cwd=REPO)


def _subparsers():
    ap = build_parser()
    sub = next(a for a in ap._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices


@pytest.mark.parametrize("cmd", sorted(_subparsers()))
def test_every_option_of_every_command_has_help(cmd):
    parser = _subparsers()[cmd]
    assert parser.description, f"labkit {cmd} --help does not say what it does"
    bare = [a.dest for a in parser._actions if not a.help or a.help == argparse.SUPPRESS]
    assert not bare, f"labkit {cmd}: no help for {bare}"


def test_run_help_says_what_auto_becomes_here_and_groups_the_parameters():
    import torch
    here = "cuda" if torch.cuda.is_available() else "cpu"
    out = labkit("run", "decode", "--help").stdout
    from labkit.experiments.decode import SPEC
    shape = next(p for p in SPEC if p.name == "shape").auto[here]
    ctx = ",".join(map(str, next(p for p in SPEC if p.name == "context_lens").auto[here]))
    line = {ln.split()[0]: ln for ln in out.splitlines() if ln.startswith("  ") and ln.split()}
    assert line["shape"].endswith(f"[default auto; here: {shape}]")
    assert line["context_lens"].endswith(f"[default auto; here: {ctx}]")
    assert line["device"].endswith(f"[default auto; here: {here}]")
    assert line["gemv"].endswith("[default (empty); here: auto]")     # an engine switch: the value in force
    heads = [ln for ln in out.splitlines() if ln and not ln.startswith(" ") and ln.endswith(":")]
    assert [h.split(" (")[0] for h in heads] == ["parameters", "strategy settings", "engine switches"]
    assert out.index("hot_capacity") > out.index("strategy settings") and out.index("gemv ") > out.index("engine switches")


def test_docs_says_what_it_does_without_write():
    out = labkit("docs", "--help").stdout
    assert "printed (nothing written) unless --write" in " ".join(out.split())


def test_serve_says_its_weights_are_seeded_random():
    out = " ".join(labkit("serve", "--help").stdout.split())
    assert "seeded random weights, not a trained model" in out and "replies random tokens" in out
    readme = " ".join((REPO / "README.md").read_text().split())
    assert "`labkit serve` (labkit's engine with seeded random weights" in readme


@pytest.mark.parametrize("args", [["run", "decode", "context_lens=8K"], ["run", "decode", "-p", "repeats=1", "steps=2"]])
def test_a_parameter_without_its_p_gets_the_fix(args):
    r = labkit(*args)
    loose = args[-1]
    assert r.returncode == 2 and r.stderr.strip() == (
        f"labkit: {loose}: a parameter takes -p before it: labkit run decode -p {loose} "
        "(labkit run decode --help lists them)")


def test_serve_start_line_says_its_weights_are_seeded_random():
    import socket
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "labkit", "serve", "--device", "cpu", "--tokenizer", "none",
                             "--port", str(port)], cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        first = proc.stdout.readline()
    finally:
        proc.terminate()
        proc.communicate(timeout=60)
    assert first.startswith("labkit serve: shape tiny with seeded random weights (seed 0), not a trained model: the "
                            "engine's speed and protocol are real, its replies are random tokens; lanes "), first
