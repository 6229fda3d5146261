"""The one command line: `labkit run --help` lists every experiment with its question and needs, `labkit run X
--help` every parameter with its type and default, unknown names get the closest ones, and bad input is one
line in well under 2 s because nothing heavy is imported to parse a command line."""
import json
import os
import subprocess
import sys
import time

import pytest

from labkit.experiments import EXPERIMENTS
from labkit.params import RENAMED_EXPERIMENTS

ENV = {**os.environ, "PYTHONWARNINGS": "ignore"}


def labkit(*args, **kw):
    return subprocess.run([sys.executable, "-m", "labkit", *args], capture_output=True, text=True, env=ENV, **kw)


def labkit_here(capsys, *args) -> subprocess.CompletedProcess:
    """The same command line run in this process (a help text per experiment: one import of labkit, not one
    per case); the tests above and below run it as a process of its own."""
    from labkit.cli import main
    capsys.readouterr()
    rc = main(list(args))
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(args, rc, out, err)


def test_run_help_lists_every_experiment():
    r = labkit("run", "--help")
    assert r.returncode == 0
    for name, e in EXPERIMENTS.items():
        assert f"  {name} " in r.stdout and e.question in r.stdout and e.needs in r.stdout, name


@pytest.mark.parametrize("name", sorted(EXPERIMENTS))
def test_experiment_help_lists_its_parameters(name, capsys):
    r = labkit_here(capsys, "run", name, "--help")
    assert r.returncode == 0, r.stderr
    for p in EXPERIMENTS[name].spec:
        if p.name != "out_dir":
            line = next((l for l in r.stdout.splitlines() if l.split()[:1] == [p.name]), None)
            assert line and p.kind in line and p.help[:30] in line, (name, p.name)


@pytest.mark.parametrize("old", sorted(RENAMED_EXPERIMENTS))
def test_an_old_name_runs_todays_and_says_so(old, capsys):
    """A renamed experiment or study keeps its old name on the command line (committed plans and habits), and
    shows the new."""
    new = RENAMED_EXPERIMENTS[old]
    sub = "run" if new in EXPERIMENTS else "study"
    r = labkit_here(capsys, sub, old, "--help")
    assert r.returncode == 0 and r.stdout.startswith(f"labkit {sub} {new} "), r.stdout[:200]
    if sub == "run":
        assert f"once {old}" in labkit_here(capsys, "run", "--help").stdout


def test_unknown_names_get_the_closest_ones(tmp_path):
    r = labkit("run", "decod")
    assert r.returncode == 2 and r.stderr.strip() == (
        f"labkit: unknown experiment 'decod'; did you mean decode? (labkit run --help lists {len(EXPERIMENTS)})")
    r = labkit("run", "decode", "-p", "budget=64", "--out", str(tmp_path / "never"))
    assert r.returncode == 2 and "did you mean budgets?" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "never").exists()


def test_bad_input_fails_fast_and_imports_nothing_heavy(tmp_path):
    """Parsing stops before torch, papermill or plotly load: a type error, an unknown parameter and an
    unknown experiment each answer in one line, well within 2 s even on a loaded 2-core machine."""
    code = ("import sys, time; t = time.perf_counter()\n"
            "from labkit.cli import main\n"
            "rc = main(sys.argv[1:])\n"
            "heavy = sorted(m for m in ('torch', 'papermill', 'plotly', 'triton', 'pandas') if m in sys.modules)\n"
            "print(rc, round(time.perf_counter() - t, 3), ','.join(heavy))\n")
    for args in (["run", "decode", "-p", "repeats=abc"], ["run", "pulse_scaling", "-p", "bogus=1"],
                 ["run", "nope"], ["run", "serve", "-p", "concurrency=x"]):
        t0 = time.perf_counter()
        r = subprocess.run([sys.executable, "-c", code, *args, "--out", str(tmp_path / "never")], capture_output=True,
                           text=True, env=ENV)
        wall = time.perf_counter() - t0
        rc, inside, heavy = r.stdout.split() + [""] * (3 - len(r.stdout.split()))
        assert rc == "2" and heavy == "", (args, r.stdout, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert wall < 2.0, (args, wall)
    assert not (tmp_path / "never").exists()


def test_cli_and_notebook_take_the_same_names():
    """A plan's parameters are the SPEC's names, resolved: what `labkit run` hands the notebook."""
    from labkit import experiments
    pl = experiments.plan("decode", {"device": "cpu", "context_lens": "1K", "budgets": "64", "concurrency": "1"})
    assert set(pl.params) == {p.name for p in EXPERIMENTS["decode"].spec}
    assert pl.params["context_lens"] == [1024] and pl.params["shape"] == "tiny"
    assert type(pl)(**json.loads(pl.to_json())["params"]) == pl        # what the notebook's `experiments.run` reads


def test_a_strategy_file_that_is_not_there_is_one_line():
    r = subprocess.run([sys.executable, "-m", "labkit", "run", "decode", "--help"], capture_output=True, text=True,
                       env={**ENV, "LABKIT_STRATEGIES": "/nonexistent/toy.py"})
    assert r.returncode == 2 and r.stderr.strip() == "labkit: LABKIT_STRATEGIES names /nonexistent/toy.py, which is not a Python file"
