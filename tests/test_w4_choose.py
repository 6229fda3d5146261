"""scripts/w4_choose.py: the rule a device sitting takes its W4A16 settings by. The fastest variant over the four
parts wins only where the GPU tests passed and it timed every part; its switches are the environment lines."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import w4_choose  # noqa: E402

PARTS = (("dense", 1), ("dense", 4), ("experts", 1), ("experts", 4))


def _bench(times: dict) -> dict:
    return {"rows": [{"part": p, "concurrency": c, "weights": "w4a16", "kernel": "lab", "variant": v,
                      "ms_median": ms} for v, parts in times.items() for (p, c), ms in parts.items()]}


def test_the_fastest_checked_variant_with_every_part_is_chosen():
    base = dict(zip(PARTS, (1.7, 2.8, 1.4, 4.0)))
    faster = dict(zip(PARTS, (1.5, 2.7, 1.3, 3.7)))
    fastest_but_partial = dict(zip(PARTS, (0.5, 0.5, 0.5)))     # no experts at four: not a candidate
    bench = _bench({"default": base, "xahead": faster, "xahead-pipe3": fastest_but_partial,
                    "not-a-switch": dict(zip(PARTS, (0.1,) * 4))})
    v, t = w4_choose.choose(bench, tests_passed=True)
    assert v == "xahead" and t[("dense", 1)] == 1.5
    assert w4_choose.choose(bench, tests_passed=False) == ("default", {})
    # a slower variant never replaces the default
    assert w4_choose.choose(_bench({"default": faster, "xahead-one": base}), True)[0] == "default"
    assert w4_choose.SWITCHES["xahead-pipe3"]["LABKIT_W4_PIPE"] == "3"


def test_every_switch_a_variant_sets_is_an_engine_switch_that_parses_and_no_two_variants_run_alike():
    from labkit import envs
    names = sorted({n for lines in w4_choose.SWITCHES.values() for n in lines})
    settings = set()
    for v, lines in w4_choose.SWITCHES.items():
        for name, raw in lines.items():
            assert envs.BY_NAME[name].engine, (v, name)
        full = tuple(envs.BY_NAME[n].parse(lines.get(n)) for n in names)     # unset: the default
        if v != "default":
            assert full not in settings, v
            settings.add(full)
