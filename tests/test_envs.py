"""Engine switches and plumbing variables: declared once, parsed strictly, recorded in every run."""
from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from labkit import envs
from labkit.params import BadInput

REPO = Path(__file__).resolve().parents[1]


def _is_environ(node) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "environ" and isinstance(node.value, ast.Name) \
        and node.value.id == "os"


def _labkit_const(node) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("LABKIT_")


def test_only_envs_reads_labkit_variables():
    """No module but labkit/envs.py touches a LABKIT_* variable through os.environ or os.getenv (they go through
    `envs.get` / `envs.set_env`, which parse strictly and know every name)."""
    offenders = []
    for path in (REPO / "labkit").rglob("*.py"):
        if path.name == "envs.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            hit = False
            if isinstance(node, ast.Subscript) and _is_environ(node.value) and _labkit_const(node.slice):
                hit = True
            if isinstance(node, ast.Call) and node.args and _labkit_const(node.args[0]):
                f = node.func
                hit = (isinstance(f, ast.Attribute) and (_is_environ(f.value) or f.attr == "getenv"))
            if hit:
                offenders.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not offenders, offenders


def test_every_switch_owner_exists_and_holds_the_environment_value():
    for v in envs.SWITCHES:
        mod, attr = envs._owner(v)
        assert hasattr(mod, attr), v.owner
        held = getattr(mod, attr)
        assert held == envs.owner_value(v.name), (v.name, held)


@pytest.mark.parametrize("name,raw,ok", [
    ("LABKIT_GEMV_GLU", "true", True), ("LABKIT_GEMV_GLU", "off", False), ("LABKIT_GEMV", "1", "on"),
    ("LABKIT_GEMV", "OFF", "off"), ("LABKIT_WEIGHTS", "kn", "kn"), ("LABKIT_GEMV_ROWS", "4", 4)])
def test_values_parse_to_canonical(name, raw, ok):
    assert envs.BY_NAME[name].parse(raw) == ok


@pytest.mark.parametrize("name,raw", [("LABKIT_GEMV_GLU", "maybe"), ("LABKIT_GEMV", "2"), ("LABKIT_WEIGHTS", "mn"),
                                      ("LABKIT_GEMV_ROWS", "-1"), ("LABKIT_SELECT_BLOCK", "x")])
def test_bad_values_are_one_line(name, raw):
    """Before, `LABKIT_GEMV_GLU=true` turned the fusion off (only "1" meant on): a bad value is now refused."""
    with pytest.raises(BadInput, match=name):
        envs.BY_NAME[name].parse(raw)


def test_cli_refuses_a_bad_or_unknown_variable_in_one_line():
    env = {**os.environ, "LABKIT_GEMV_GLU": "maybe"}
    r = subprocess.run([sys.executable, "-m", "labkit", "shapes"], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "LABKIT_GEMV_GLU" in r.stderr, r.stderr
    env = {**os.environ, "LABKIT_GEMV_GLUE": "1"}
    r = subprocess.run([sys.executable, "-m", "labkit", "shapes"], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "LABKIT_GEMV_GLU" in r.stderr and "unknown" in r.stderr, r.stderr


def test_apply_sets_the_engine_and_in_force_reads_it_back():
    from labkit.engine.model import gemv, layers
    before = envs.apply({"gemv": "off", "weights": "kn", "gemv_glu": False})
    try:
        assert gemv.mode() == "0" and layers.K_MAJOR is False and gemv._GLU is False
        f = envs.in_force()
        assert f["gemv"] == "off" and f["weights"] == "kn" and f["gemv_glu"] is False
    finally:
        envs.apply(before)
    assert gemv.mode() == envs.owner_value("LABKIT_GEMV") and envs.in_force()["weights"] == "nk"


def test_variants_are_the_product_of_given_switches():
    p = {v.param: [] for v in envs.SWITCHES}
    assert envs.variants(p) == [{}]
    p["gemv"], p["gemv_glu"] = ["auto", "off"], [True, False]
    vs = envs.variants(p)
    assert len(vs) == 4 and {envs.variant_name(v) for v in vs} == {
        "gemv=auto,gemv_glu=on", "gemv=auto,gemv_glu=off", "gemv=off,gemv_glu=on", "gemv=off,gemv_glu=off"}


def test_a_decode_run_records_the_switches_and_sweeps_them(tmp_path):
    """One decode run over gemv=auto,off on the CPU: the manifest holds the engine's switches, each row says which
    variant measured it, and both variants' rows are there (a comparison in one run, not two environments)."""
    from labkit import experiments
    from labkit.results import load_run
    out = tmp_path / "run"
    plan = experiments.plan("decode", {"device": "cpu", "shape": "tiny", "context_lens": "256", "budgets": "32",
                                       "concurrency": "1", "strategies": "resident,zero_copy", "repeats": "1",
                                       "steps": "2", "prefill_lens": "", "probe": "false", "anatomy": "false",
                                       "gemv": "auto,off", "out_dir": str(out)})
    experiments.run(plan, progress_bar=False)
    man, m = load_run(out)[:2] if isinstance(load_run(out), tuple) else (None, None)
    import json
    import pandas as pd
    man = json.loads((out / "manifest.json").read_text())
    m = pd.read_parquet(out / "metrics.parquet")
    assert set(man["engine"]) == {v.param for v in envs.SWITCHES} and man["engine"]["weights"] in ("nk", "kn")
    dec = m[m["experiment"] == "decode"]
    assert set(dec["engine_variant"]) == {"gemv=auto", "gemv=off"}
    assert (dec["status"] == "ok").all() and len(dec) == 4


def test_a_bad_switch_parameter_is_one_line():
    from labkit import experiments
    with pytest.raises(BadInput, match="gemv"):
        experiments.plan("decode", {"device": "cpu", "gemv": "fast"})
