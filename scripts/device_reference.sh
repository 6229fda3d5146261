#!/usr/bin/env bash
# The published model's device sitting, in steps (each under its own time limit, so one that fails or runs
# long leaves the others): GPU tests of the portable path and the MoE parts, the weight-stream bench, the
# split's memory check, and entries of plans/reference-model.toml (run folders packed into $OUT).
#   scripts/device_reference.sh tests bench decode-w4a16:330   # any of: tests bench split ENTRY, each STEP:SECONDS
# ENTRY is an entry of plans/reference-model.toml, or of the plan PLAN names (PLAN=plans/claims.toml ...).
# The device host's copy of the tree may carry a stale .git: give the commit that runs in the command, as
#   export LABKIT_GIT_SHA=<short sha here>[-dirty]; scripts/device_reference.sh ...
# (every manifest records it; without it the sha git reports there is recorded, with a warning).
set -u
[ -n "${LABKIT_GIT_SHA:-}" ] || echo "device_reference: LABKIT_GIT_SHA not set; manifests record $(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown), which may not be the commit that runs" >&2
OUT=${OUT:-/tmp/labkit-out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
PLAN=${PLAN:-plans/reference-model.toml}
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-$PWD} LABKIT_SESSION=${LABKIT_SESSION:-$(date -u +%Y%m%d-%H%M%S)}
nvidia-smi --query-gpu=name,driver_version,power.limit,power.default_limit,clocks.max.sm,pcie.link.gen.max,memory.total --format=csv | tee -a "$OUT/machine.txt"
for arg in "$@"; do
  step=${arg%%:*}; limit=${arg#*:}; [ "$limit" = "$arg" ] && limit=300
  t0=$(date +%s)
  case $step in
    tests) timeout "$limit" python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_hostmem.py tests/test_gpu_portable.py \
            tests/test_gpu_description.py tests/test_gpu_prefill_throughput.py tests/test_gpu_claims.py ${TESTS_K:+-k "$TESTS_K"} 2>&1 | tee "$OUT/tests.txt" | tail -25 ;;
    bench) timeout "$limit" python3 scripts/weights_bench.py "$OUT" ${BENCH_VARIANTS:+--variants "$BENCH_VARIANTS"} 2>&1 | tail -40 ;;
    split) timeout "$limit" python3 scripts/split_memory_check.py "$OUT" 2>&1 | tail -12 ;;
    *) before=$(ls -d results/*/ 2>/dev/null | sort)
       timeout "$limit" python3 - "$PLAN" "$step" <<'PY' 2>&1 | grep -v "^\s*$" | tail -15
import sys, tomllib
from labkit.experiments import measure
# the plan read as TOML here: labkit.nightly needs papermill, which the device host does not have
plan, name = sys.argv[1:3]
entries = tomllib.load(open(plan, "rb"))["entry"]
entry = next((e for e in entries if e["name"] == name), None)
if entry is None:
    sys.exit(f"device_reference: {plan} has no entry {name!r}")
measure(entry["experiment"], dict(entry["parameters"]), progress_bar=False)
PY
       for d in $(comm -13 <(echo "$before") <(ls -d results/*/ | sort)); do
         tar czf "$OUT/$(basename "$d").tgz" -C results "$(basename "$d")"
       done ;;
  esac
  echo "== $step: $(( $(date +%s) - t0 )) s"
done
ls -la "$OUT"
