"""The sweep core and the declared parameter checks: the grid's order, a failing point as a failed row while
the sweep goes on, the timers' counts and units, "auto" per device, and the one-line messages of declared
checks."""
import time

import pytest
import torch

from labkit import sweep
from labkit.params import DEVICE, OUT_DIR, SEED, SHAPE, BadInput, Param, check_declared, fill_auto, resolve
from labkit.results import load_run


def test_grid_is_nested_loop_order():
    rows = sweep.grid(ctx=[1, 2], mode=["a", "b"], n=[7])
    assert rows == [{"ctx": 1, "mode": "a", "n": 7}, {"ctx": 1, "mode": "b", "n": 7},
                    {"ctx": 2, "mode": "a", "n": 7}, {"ctx": 2, "mode": "b", "n": 7}]
    assert sweep.grid(ctx=[1], mode=[]) == []


def test_failed_point_is_a_row_and_the_sweep_goes_on(tmp_path):
    run = sweep.open_run({"out_dir": str(tmp_path / "r"), "x": 1}, "toy")
    for i in range(3):
        with sweep.point(run, {"experiment": "toy"}, i=i):
            if i == 1:
                raise RuntimeError("no memory\nsecond line")
            run.add({"experiment": "toy", "status": "ok", "error": None, "i": i})
    freed = []
    row = sweep.attempt(lambda: 1 / 0, {"experiment": "toy"}, on_fail=freed.append, i=3)
    run.add(row)
    run.finish()
    m = load_run(run.path).metrics
    assert list(m["status"]) == ["ok", "failed", "ok", "failed"]
    assert m["error"][1] == "RuntimeError: no memory"            # one line
    assert list(row) == ["experiment", "status", "error", "i"] and isinstance(freed[0], ZeroDivisionError)
    assert load_run(run.path).manifest["parameters"] == {"out_dir": str(tmp_path / "r"), "x": 1}
    with pytest.raises(KeyboardInterrupt):                         # Ctrl-C still ends the sweep
        with sweep.point(run):
            raise KeyboardInterrupt


def test_timers_count_and_unit():
    calls = []
    ms = sweep.wall_ms(lambda: (calls.append(1), time.sleep(0.01)), 3, torch.device("cpu"), warmup=2)
    assert len(ms) == 3 and len(calls) == 5 and all(9 <= t < 200 for t in ms)
    for mode in ("isolated", "queued", "chained"):
        calls.clear()
        ms = sweep.event_ms(lambda: (calls.append(1), time.sleep(0.005)), 4, torch.device("cpu"), warmup=1, mode=mode)
        assert len(ms) == 4 and len(calls) == 5 and min(ms) >= 4
    s = sweep.timed(lambda: time.sleep(0.002), 5, torch.device("cpu"), timer="wall")
    assert s.n == 5 and s.min <= s.median <= s.max
    with pytest.raises(ValueError, match="isolated, queued or chained"):
        sweep.event_ms(lambda: None, 1, torch.device("cpu"), mode="nope")


def test_headline_prints_lines_or_why_not(capsys):
    sweep.headline(sweep.summary_lines(lambda: ["a 1.0", "b 2.0"]), name="toy")
    sweep.headline(sweep.summary_lines(lambda: [][0]), name="toy")
    sweep.headline(["hidden"], enabled=False)
    out = capsys.readouterr().out.splitlines()
    assert out == ["toy: a 1.0", "toy: b 2.0", "toy: no summary (IndexError: list index out of range)"]


def test_declared_checks_are_one_line():
    spec = [Param("n", "list[int]", [1], "", gt=0), Param("r", "float", 1.0, "", ge=0, le=2),
            Param("mode", "str", "a", "", choices=("a", "b")), Param("lazy", "str", "x", "", choices=lambda: ["x"]),
            Param("budget", "int", "auto", "", gt=0, auto={"cuda": 2048, "cpu": 64}), SHAPE, DEVICE, SEED, OUT_DIR]
    assert resolve(spec, {}, "toy")["budget"] == "auto"            # decided later, not checked yet
    for given, message in [({"n": "4,0"}, "n must be > 0, got 0"), ({"r": "-1"}, "r must be >= 0, got -1.0"),
                           ({"r": "3"}, "r must be <= 2, got 3.0"), ({"mode": "c"}, "mode must be one of a, b; got 'c'"),
                           ({"lazy": "y"}, "lazy must be one of x"), ({"budget": "-3"}, "budget must be > 0, got -3")]:
        with pytest.raises(BadInput, match=message):
            resolve(spec, given, "toy")
    p = fill_auto(spec, resolve(spec, {}, "toy"), "cpu")
    assert p["budget"] == 64 and p["shape"] == "tiny"
    assert fill_auto(spec, resolve(spec, {"budget": "0"}, "toy"), "cuda")["budget"] == 2048   # 0 means auto too
    assert fill_auto(spec, resolve(spec, {"budget": "16"}, "toy"), "cuda")["budget"] == 16
    with pytest.raises(BadInput):
        check_declared(spec, {"mode": "z"})
    assert SEED.but(help="selections").help == "selections" and SEED.help == "weights and cache contents"


def test_a_files_table_is_checked_against_its_spec():
    from labkit.params import check_table
    spec = [Param("name", "str", None, ""), Param("timeout_s", "int", None, "", gt=0), Param("cpu", "table", {}, "")]
    assert check_table(spec, {"name": "a"}, "entry") == {"name": "a", "timeout_s": None, "cpu": {}}
    for table, message in [({"retries": 3}, "entry: unknown key(s) retries; it takes cpu, name, timeout_s"),
                           ({"timeout_s": "10"}, "entry: `timeout_s` must be a whole number, got '10'"),
                           ({"timeout_s": True}, "entry: `timeout_s` must be a whole number, got True"),
                           ({"timeout_s": 0}, "entry: timeout_s must be > 0, got 0"),
                           ({"cpu": 4}, "entry: `cpu` must be a table of name = value, got 4")]:
        with pytest.raises(BadInput) as ex:
            check_table(spec, table, "entry")
        assert str(ex.value) == message
