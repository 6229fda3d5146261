"""Every experiment's notebook takes the frozen plan and nothing else: its parameters cell is `plan` (the JSON
`labkit run` hands over), `params` (names as `labkit run NAME --help` lists, planned in the notebook when no
plan came) and `run_dir` (render a run folder) — never a hand-kept mirror of the experiment's SPEC."""
import papermill as pm

from labkit.execute import NOTEBOOKS
from labkit.experiments import EXPERIMENTS


def test_every_experiment_notebook_takes_the_plan():
    for name, exp in EXPERIMENTS.items():
        nb = NOTEBOOKS / exp.notebook
        assert nb.is_file(), name
        assert set(pm.inspect_notebook(str(nb))) == {"plan", "params", "run_dir"}, name


def test_design_parameter_names_present():
    names = {p.name for p in EXPERIMENTS["decode"].spec}
    assert {"shape", "device", "strategies", "context_lens", "budgets", "concurrency", "repeats", "steps"} <= names
