"""The notebooks and the CLI take the same parameter names (papermill only warns about unknown ones)."""
import papermill as pm

from labkit.bench import decode, probe
from labkit.execute import EXPERIMENTS, NOTEBOOKS


def test_notebook_parameters_match_experiment_specs():
    for exp, mod in (("decode", decode), ("probe", probe)):
        nb = NOTEBOOKS / EXPERIMENTS[exp].notebook
        names = set(pm.inspect_notebook(str(nb)))
        assert names == {p.name for p in mod.SPEC} | {"run_dir"}, exp


def test_design_parameter_names_present():
    names = {p.name for p in decode.SPEC}
    assert {"shape", "device", "strategies", "context_lens", "budgets", "concurrency", "repeats", "steps"} <= names
