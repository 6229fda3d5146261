#!/usr/bin/env bash
# One sitting on a CUDA host that has torch/Triton/NVML but no internet: install the wheels carried in
# ./.whl (docs/gpu-host.md says which), run a device batch (plans/NAME.toml, see plans/README.md) into
# $OUT, pack each run folder as one .tgz (few files come back), and list what is there.
#   scripts/device.sh gpu-tests        every single-GPU test, the link probe, a small decode sweep
#   scripts/device.sh pulseinfer       ... any plan in plans/; extra arguments go to `labkit nightly`
set -u
PLAN=${1:-gpu-tests}; shift || true
[ -f "plans/$PLAN.toml" ] || { echo "device.sh: no plan plans/$PLAN.toml ($(ls plans/*.toml | xargs -n1 basename | sed 's/.toml//' | tr '\n' ' '))" >&2; exit 2; }
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-$PWD} LABKIT_SESSION=$(date -u +%Y%m%d-%H%M%S)
[ -d /tmp/site/share/jupyter ] && export JUPYTER_PATH=/tmp/site/share/jupyter   # nbconvert templates, ipykernel spec
OUT=${OUT:-/tmp/labkit-out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.max,pcie.link.width.current,memory.total --format=csv | tee "$OUT/machine.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/machine.txt"
python3 -m labkit nightly --plan "plans/$PLAN.toml" --root "$OUT" "$@" 2>&1 | tr '\r' '\n' | grep -v '^\s*$' | tail -40
# each entry's folder as one .tgz, named <session>-<entry>
for d in "$OUT"/nightly-*/*/; do
  [ -d "$d" ] || continue
  n=$(basename "$d"); tar czf "$OUT/$LABKIT_SESSION-$n.tgz" -C "$(dirname "$d")" "$n"
done
ls -la "$OUT"
