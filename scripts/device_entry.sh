#!/usr/bin/env bash
# One plan entry on a GPU host, in this process's Python (no notebook, so no carried wheels): the entry's
# parameters exactly as `labkit nightly` would pass them, the run folder under results/ (where a resumable
# experiment's resume=auto looks on the next call), packed as one .tgz into $OUT. Draw its report where
# the notebook path is installed: `labkit report results/RUN --rerun`.
#   scripts/device_entry.sh plans/pulseinfer-windows.toml pulse-trace-windows
set -u
PLAN=$1 ENTRY=$2
OUT=${OUT:-/tmp/labkit-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD LABKIT_SESSION=$(date -u +%Y%m%d-%H%M%S)
nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.max,pcie.link.width.current,memory.total --format=csv | tee "$OUT/machine.txt"
before=$(ls -d results/*/ 2>/dev/null | sort)
python3 - "$PLAN" "$ENTRY" <<'PY'
import sys
from labkit.experiments import measure
from labkit.nightly import load_plan
plan, name = sys.argv[1:3]
entry = next((e for e in load_plan(plan) if e.name == name), None)
if entry is None or entry.experiment is None:
    sys.exit(f"device_entry: {plan} has no experiment entry {name!r}")
measure(entry.experiment, dict(entry.parameters), progress_bar=False)
PY
rc=$?
for d in $(comm -13 <(echo "$before") <(ls -d results/*/ | sort)); do
  tar czf "$OUT/$(basename "$d").tgz" -C results "$(basename "$d")"
done
ls -la "$OUT"
exit $rc
