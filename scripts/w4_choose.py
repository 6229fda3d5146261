"""The W4A16 decode settings a device sitting measures the step with, chosen by a rule written before the bench ran:
of the weight bench's variants that the GPU tests checked (bit for bit against the engine's earlier forms; `waves`,
which changes only how many ways a launch cuts K, a path every split count shares, against the definition within
the bench's tolerance), the one whose four parts (dense and experts, one request and four) take the least time
together; printed as the engine switches' environment lines.

    python3 scripts/w4_choose.py OUT/weights_bench.json OUT/gpu-tests.txt > chosen.env
"""
import json
import sys

# a variant's engine switches (`labkit/envs.py`), each spelled out so a variant means the same whatever the
# defaults are (`default`: the engine's own); a variant not here is not a candidate
SWITCHES = {"default": {},
            "xahead": {"LABKIT_W4_X_AHEAD": "1", "LABKIT_W4_ONE": "0", "LABKIT_W4_PIPE": "0"},
            "xahead-one": {"LABKIT_W4_X_AHEAD": "1", "LABKIT_W4_ONE": "1", "LABKIT_W4_PIPE": "0"},
            "xahead-pipe3": {"LABKIT_W4_X_AHEAD": "1", "LABKIT_W4_ONE": "0", "LABKIT_W4_PIPE": "3"},
            "xahead-pipe4": {"LABKIT_W4_X_AHEAD": "1", "LABKIT_W4_ONE": "0", "LABKIT_W4_PIPE": "4"},
            "waves": {"LABKIT_W4_X_AHEAD": "1", "LABKIT_W4_ONE": "1", "LABKIT_W4_PIPE": "0",
                      "LABKIT_W4_SPLIT_WAVES": "1"}}
PARTS = {("dense", 1), ("dense", 4), ("experts", 1), ("experts", 4)}


def choose(bench: dict, tests_passed: bool) -> tuple[str, dict]:
    """(variant, its timed parts' ms) with the least total; `default` when the GPU tests did not pass."""
    if not tests_passed:
        return "default", {}
    times: dict[str, dict] = {}
    for r in bench["rows"]:
        if r.get("weights") == "w4a16" and r.get("kernel") == "lab" and r["variant"] in SWITCHES:
            times.setdefault(r["variant"], {})[(r["part"], r["concurrency"])] = r["ms_median"]
    whole = {v: t for v, t in times.items() if set(t) >= PARTS}
    if "default" not in whole:
        return "default", {}
    best = min(whole, key=lambda v: sum(whole[v][p] for p in PARTS))
    return best, whole[best]


def main():
    bench = json.load(open(sys.argv[1]))
    tests = open(sys.argv[2]).read()
    passed = " passed" in tests and " failed" not in tests and " error" not in tests
    v, t = choose(bench, passed)
    print(f"# chosen: {v} (GPU tests {'passed' if passed else 'not passed'}); " +
          ", ".join(f"{p}@{c}: {ms:.3f} ms" for (p, c), ms in sorted(t.items())))
    for k, val in SWITCHES[v].items():
        print(f"export {k}={val}")


if __name__ == "__main__":
    main()
