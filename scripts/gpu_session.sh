#!/usr/bin/env bash
# One device session on a CUDA host that has torch/Triton/NVML but no internet: install the carried
# wheels (./.whl, see README "Running on a GPU host without internet"), then run what MODE says.
#   scripts/gpu_session.sh tests            GPU tests + link probe + a small decode sweep (pipeline check)
#   scripts/gpu_session.sh sweep [ARGS...]  the reference decode sweep (labkit run decode ARGS)
#   scripts/gpu_session.sh roofline         link probe beside the shared probe (agreement), GPU tests
#   scripts/gpu_session.sh pulse            PulseInfer (issue 11), ~7 min: block transfers, concurrency scaling at 1M,
#                                           GPU pulse tests, the Mooncake trace replay per placement policy
#   scripts/gpu_session.sh explore          the explorer's "measure now" pressed on the GPU (tests/test_gpu_explore.py),
#                                           then the committed nightly's decode-small entry resumed (--date 2026-11-29)
#   scripts/gpu_session.sh multigpu         (x2 host) the layer split vs one GPU, pipelined micro-batches, gather
#                                           scaling (labkit.bench.multigpu), then the multi-GPU tests
#   scripts/gpu_session.sh hotdecode        issue 10's decode-speed targets, ~6 min: resident / zero_copy / hot_cache at 1M,
#                                           concurrency 1, on the indexer's selections and on recorded traces of three
#                                           densities; hot_cache's bookkeeping in line (hot_defer=false) and fused beside
#                                           them; then the hot-cache GPU tests
#   scripts/gpu_session.sh pulse2           issue 11's transfers, ~5 min: block transfers (pipelined coalesced, batched DMA)
#                                           at 1/12 requests' selections, the switched round with block_dma / coalesced /
#                                           zero_copy transfers over 16-position blocks, the pulse GPU tests
#   scripts/gpu_session.sh pulse3           batched DMA with/without the prefer-overlap hint (blocks, switched round with
#                                           block_dma over 16-position blocks), a short trace replay with block_dma, ~5 min
#   scripts/gpu_session.sh pulse4           scheduler graphs with a host strategy (GPU tests), then a decode-heavier trace
#                                           replay (inputs x0.5, 256 output tokens) with graphs on and block_dma, ~8 min
#   scripts/gpu_session.sh pulsetrace       pulse4's trace replay alone: 32 requests, thresholds 4096 and 8192, ~8 min
#   scripts/gpu_session.sh pulse5           batched DMA split into calls of 64/128/512 units (blocks, switched rounds),
#                                           the concurrency scaling at 1M with block_dma and compiled steps, ~7 min
#   scripts/gpu_session.sh hot              issue 10 items 5-6 in ~6 min: prefill resident/sync/rotating at 248K (its last
#                                           PREFILL_TAIL tokens), a 1M prompt's last chunk under a 24 GiB cap, capacity and
#                                           goodput at 30 ms TPOT under 24 GiB, then the hot-cache and prefill GPU tests
# Results land in results/<run-id>/ and, when $OUT is set, are copied there too.
set -u
MODE=${1:-tests}; shift || true
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-$PWD}
[ -d /tmp/site/share/jupyter ] && export JUPYTER_PATH=/tmp/site/share/jupyter   # nbconvert templates, ipykernel spec
OUT=${OUT:-/tmp/labkit-out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.max,pcie.link.width.current,memory.total --format=csv | tee "$OUT/machine.txt"
free -g | tee -a "$OUT/machine.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/machine.txt"
stamp=$(date -u +%Y%m%d-%H%M%S)
# each run folder under $OUT as one .tgz (few files come back); a file named in $1 is copied into each first
pack_out() { (cd "$OUT" && for d in */; do [ -n "${1:-}" ] && cp "$1" "$d"; tar czf "${d%/}.tgz" "$d" && rm -rf "$d"; done); }
# the Mooncake replay with every step from CUDA graphs, block_dma over 16-position blocks, inputs x0.5 and up to
# 256 output tokens (decode-heavier than the eager replays): $1 requests, $2 policies, $3 timeout (s)
graphs_trace() {
    timeout "$3" python3 -m labkit.bench.pulse_trace --out "$OUT/$stamp-pulse-trace-graphs-h200" \
        -p n_requests="$1" -p length_scale=${PULSE_SCALE:-0.5} -p max_output=256 -p capacity=65536 \
        -p strategy=block_dma -p select_block=16 -p graphs=true -p policies="$2" \
        -p timeline_every=10 -p transport=inprocess 2>&1 | grep -v DEBUG | tail -8
}
case "$MODE" in
  tests)
    timeout 300 python3 -m pytest -m gpu -q -rA tests/test_gpu.py 2>&1 | tail -40 | tee "$OUT/gpu_tests.txt"
    python3 -m labkit probe --out "results/$stamp-probe-h200" -p repeats=20 2>&1 | tail -5
    python3 -m labkit run decode --out "results/$stamp-decode-smoke" -p context_lens=8K,64K -p concurrency=1,2 \
        -p budgets=2048,512 -p repeats=2 -p steps=5 -p prefill_lens=16K 2>&1 | tail -15
    for d in results/$stamp-*; do tar czf "$OUT/$(basename "$d").tgz" "$d"; done
    ;;
  sweep)
    # Written straight under $OUT so a run cut short by the session's limit still comes back.
    timeout ${SWEEP_TIMEOUT:-480} python3 -m labkit run decode --out "$OUT/$stamp-decode-h200" "$@" 2>&1 | tr '\r' '\n' | grep -v '^\s*$' | tail -40
    timeout ${TEST_TIMEOUT:-100} python3 -m pytest -m gpu -q -rA tests/test_gpu.py 2>&1 | grep -v DEBUG | tail -40 | tee "$OUT/gpu_tests.txt"
    ;;
  roofline)
    # The roofline issue's record: the link probe next to the independent shared probe (run back to back;
    # copy ../shared/probes/pcie_probe.py to .devcarry/ and carry it), then the decode sweep with anatomies.
    if [ -f .devcarry/pcie_probe.py ]; then
      mkdir -p "$OUT/$stamp-probe-h200"
      timeout 150 python3 .devcarry/pcie_probe.py "$OUT/$stamp-probe-h200" > "$OUT/$stamp-probe-h200/shared_probe.log" 2>&1
      mv "$OUT/$stamp-probe-h200/pcie_probe.json" "$OUT/$stamp-probe-h200/shared_pcie_probe.json" 2>/dev/null
      timeout 200 python3 -c "from labkit.bench.probe import run; run({'out_dir': '$OUT/$stamp-probe-h200-lab'})" 2>&1 | tail -3
      mv "$OUT/$stamp-probe-h200/"* "$OUT/$stamp-probe-h200-lab/" && rmdir "$OUT/$stamp-probe-h200"
      python3 -m labkit.bench.agreement "$OUT/$stamp-probe-h200-lab/shared_pcie_probe.json" "$OUT/$stamp-probe-h200-lab"
    fi
    timeout ${TEST_TIMEOUT:-150} python3 -m pytest -m gpu -q -rA tests/test_gpu.py -p no:cacheprovider 2>&1 | grep -v DEBUG | tail -40 > "$OUT/gpu_tests.txt"
    tail -3 "$OUT/gpu_tests.txt"
    pack_out
    ;;
  trace)
    # zero_copy (and resident) timed on the indexer's own selections and on a recorded real trace
    common="-p strategies=resident,zero_copy -p context_lens=64K,1M -p concurrency=1,4 -p budgets=2048 -p prefill_lens= -p probe=false -p repeats=3 -p steps=20"
    timeout 200 python3 -m labkit run decode --out "$OUT/$stamp-decode-indexer-h200" $common 2>&1 | tail -3
    timeout 200 python3 -m labkit run decode --out "$OUT/$stamp-decode-trace-h200" $common \
        -p selection=trace:labkit/data/smollm2-135m-prose-indexer-b2048.npz 2>&1 | tail -3
    pack_out
    timeout ${TEST_TIMEOUT:-150} python3 -m pytest -m gpu -q -rA tests/test_gpu.py 2>&1 | grep -v DEBUG | tail -40 | tee "$OUT/gpu_tests.txt"
    ;;
  multigpu)
    # written straight under $OUT: a run cut short by the session's limit still comes back
    timeout ${SWEEP_TIMEOUT:-400} python3 -m labkit.bench.multigpu --out "$OUT/$stamp-multigpu-h200x2" \
        -p context_lens=64K,1M -p concurrency=1,4,8 -p micro_batches=2 "$@" 2>&1 | tr '\r' '\n' | grep -v '^\s*$' | tail -40
    timeout ${TEST_TIMEOUT:-150} python3 -m pytest -m gpu -q -rA -p no:cacheprovider tests/test_gpu_multi.py \
        tests/test_gpu.py -k "multi or pipeline" 2>&1 | grep -v DEBUG | tail -40 | tee "$OUT/$stamp-multigpu-h200x2/gpu_tests_x2.txt"
    nvidia-smi topo -m > "$OUT/$stamp-multigpu-h200x2/topo.txt" 2>&1
    ;;
  hot)
    # Each step under its own timeout, most wanted first; every run folder is written straight under $OUT
    # (manifest.json, metrics.csv/parquet) and tarred at the end (a step cut short still leaves its rows).
    tail=${PREFILL_TAIL:-64K}     # 0: the whole 248K prompt (~50 s per mode on the H200 instead of ~20)
    timeout ${PREFILL_TIMEOUT:-110} python3 -m labkit.bench.prefill --out "$OUT/$stamp-prefill-248k-h200" \
        -p context_lens=248K -p modes=resident,sync,rotating -p tail_tokens=$tail 2>&1 | tail -6
    # 1M tokens under a 24 GiB cap: the rotating buffers (4 x 2 GiB) fit beside the weights; resident's
    # 24 GiB pool cannot (a failed row with the allocator's message). Only the last chunk is computed
    # (its prefix, 1M - 8K rows per layer, is in the pinned pool): the full prompt's attention alone is
    # ~1e17 FLOP, past a session's limit; `hot1m` below runs it whole.
    timeout ${CAP1M_TIMEOUT:-70} python3 -m labkit.bench.prefill --out "$OUT/$stamp-prefill-1m-cap24-h200" \
        -p context_lens=1M -p modes=rotating,resident -p mem_cap_gib=24 -p tail_tokens=8K 2>&1 | tail -4
    timeout ${CAPACITY_TIMEOUT:-130} python3 -m labkit.bench.capacity --out "$OUT/$stamp-capacity-cap24-h200" \
        -p context_len=${CAPACITY_CONTEXT:-32K} -p mem_cap_gib=24 -p host_cap_gib=${HOST_CAP_GIB:-40} -p tpot_ms=30 \
        -p selection=${CAPACITY_SELECTION:-trace:labkit/data/smollm2-135m-prose-indexer-b2048.npz} -p steps=10 -p repeats=2 2>&1 | tail -8
    timeout ${TEST_TIMEOUT:-140} python3 -m pytest -m gpu -q -rA -p no:cacheprovider tests/test_gpu_prefill.py \
        tests/test_gpu_hot_cache.py 2>&1 | grep -v DEBUG | tail -40 > "$OUT/gpu_tests.txt"
    tail -3 "$OUT/gpu_tests.txt"
    for d in "$OUT"/*/; do cp "$OUT/gpu_tests.txt" "$d" 2>/dev/null; done
    pack_out
    ;;
  hotdecode)
    # Each run straight under $OUT with its own timeout (a run cut short still leaves its rows), tarred at the end.
    common="-p context_lens=1M -p concurrency=1 -p budgets=2048 -p prefill_lens= -p probe=false -p repeats=5 -p steps=20 -p hot_capacity=4096"
    D=labkit/data/smollm2-135m
    run() { name=$1; shift; timeout ${RUN_TIMEOUT:-100} python3 -m labkit run decode --out "$OUT/$stamp-hotdecode-$name-h200" $common "$@" 2>&1 \
              | tr '\r' '\n' | grep -E "^(decode|labkit|Error|[A-Za-z]*Error)" | tail -2; }
    run indexer -p strategies=resident,zero_copy,hot_cache -p selection=indexer
    run prose-b64 -p strategies=resident,zero_copy,hot_cache -p selection=trace:$D-prose-indexer-b64.npz
    run code-b64 -p strategies=resident,zero_copy,hot_cache -p selection=trace:$D-code-indexer-b64.npz -p anatomy=false
    run prose-b256 -p strategies=resident,zero_copy,hot_cache -p selection=trace:$D-prose-indexer-b256.npz -p anatomy=false
    if [ -z "${HOT_SHORT:-}" ]; then    # the comparisons: the old dense trace, the in-line bookkeeping, the fused kernel
      run prose-b2048 -p strategies=resident,zero_copy,hot_cache -p selection=trace:$D-prose-indexer-b2048.npz -p anatomy=false
      run indexer-inline -p strategies=zero_copy,hot_cache -p selection=indexer -p hot_defer=false -p anatomy=false
      run prose-b64-inline -p strategies=resident,hot_cache -p selection=trace:$D-prose-indexer-b64.npz -p hot_defer=false -p anatomy=false
      run prose-b64-fused -p strategies=resident,hot_cache -p selection=trace:$D-prose-indexer-b64.npz -p hot_fused=true -p anatomy=false
    fi
    timeout ${TEST_TIMEOUT:-150} python3 -m pytest -m gpu -q -rA -p no:cacheprovider tests/test_gpu_hot_cache.py 2>&1 \
        | grep -v DEBUG | tail -40 > "$OUT/gpu_tests_hot.txt"
    tail -3 "$OUT/gpu_tests_hot.txt"
    pack_out gpu_tests_hot.txt
    ;;
  pulse2)
    export LABKIT_SESSION=$stamp
    timeout 200 python3 -m labkit.bench.pulse_blocks --context 65536 --budget 2048 --block 16 64 --requests 1 12 \
        --repeats 10 --run-dir "$OUT/$stamp-pulse-blocks-h200" 2>&1 | grep -v '^{' | tail -3
    mkdir -p "$OUT/$stamp-pulse-switch-h200"
    # one switched round per transfer mechanism, the same block selection (16 positions) for each, then
    # zero_copy with per-token selection (the earlier rounds' setting)
    for st in block_dma:16 coalesced:16 zero_copy:16 zero_copy:1; do
      timeout 150 python3 -m labkit.bench.pulse --strategy ${st%:*} --select-block ${st#*:} --context 65536 \
          --offload-batch 4 --normal-batch 4 --normal-context 8192 --steps 10 \
          --out "$OUT/$stamp-pulse-switch-h200/${st%:*}-b${st#*:}.json" 2>&1 | tail -2 | cut -c1-600
    done
    timeout 240 python3 -m pytest -m gpu -q -rA -p no:cacheprovider tests/test_gpu_pulse.py \
        tests/test_gpu.py -k "pulse or every_strategy" 2>&1 | grep -v DEBUG \
        | tail -40 > "$OUT/$stamp-pulse-switch-h200/gpu_pulse_tests.txt"
    tail -3 "$OUT/$stamp-pulse-switch-h200/gpu_pulse_tests.txt"
    pack_out
    ;;
  pulse3)
    # batched DMA with and without the prefer-overlap hint: block transfers, the switched round with
    # block_dma over 16-position blocks, then a short trace replay with block_dma (no switching vs switching)
    export LABKIT_SESSION=$stamp
    timeout 120 python3 -m labkit.bench.pulse_blocks --context 65536 --budget 2048 --block 16 --requests 4 12 \
        --repeats 10 --run-dir "$OUT/$stamp-pulse-blocks-h200" 2>&1 | grep -v '^{' | tail -3
    mkdir -p "$OUT/$stamp-pulse-switch-h200"
    for ov in true false; do
      timeout 150 python3 -m labkit.bench.pulse --strategy block_dma --select-block 16 --set dma_prefer_overlap=$ov \
          --context 65536 --offload-batch 4 --normal-batch 4 --normal-context 8192 --steps 10 \
          --out "$OUT/$stamp-pulse-switch-h200/block_dma-b16-overlap-$ov.json" 2>&1 | tail -2 | cut -c1-600
    done
    timeout ${TRACE_TIMEOUT:-200} python3 -m labkit.bench.pulse_trace --out "$OUT/$stamp-pulse-trace-blockdma-h200" \
        -p n_requests=${PULSE_REQUESTS:-16} -p max_output=64 -p capacity=65536 -p strategy=block_dma -p select_block=16 \
        -p policies=noswitch:4096,threshold:4096 -p timeline_every=5 -p transport=inprocess 2>&1 | grep -v DEBUG | tail -8
    pack_out
    ;;
  pulse4)
    # issue 11 with block_dma over 16-position blocks: the scheduler's graphs with a host strategy (GPU
    # tests first), then a decode-heavier trace replay with graphs on (every policy's steps from CUDA
    # graphs, host loads between pieces): inputs x0.5, 256 output tokens, 24 requests
    export LABKIT_SESSION=$stamp
    timeout 200 python3 -m pytest -m gpu -q -rA -p no:cacheprovider tests/test_gpu_pulse.py -k "graphs or scaling" \
        2>&1 | grep -v DEBUG | tail -12 | tee "$OUT/gpu_pulse4_tests.txt"
    graphs_trace ${PULSE_REQUESTS:-24} noswitch:4096,threshold:4096,adaptive ${TRACE_TIMEOUT:-330}
    pack_out gpu_pulse4_tests.txt
    ;;
  pulsetrace)
    # pulse4's trace replay alone, more requests and a second static threshold (p99 over 24 requests is
    # their maximum): PULSE_REQUESTS (32), PULSE_POLICIES, TRACE_TIMEOUT; policies are written as they end
    export LABKIT_SESSION=$stamp
    graphs_trace ${PULSE_REQUESTS:-32} ${PULSE_POLICIES:-noswitch:4096,threshold:4096,adaptive,threshold:8192} \
        ${TRACE_TIMEOUT:-520}
    pack_out
    ;;
  pulse5)
    # issue 11, transfers: the batched DMA split into calls of 64 / 128 / 512 units (one call's copies
    # running while the driver takes in the next), the switched round per split, the concurrency scaling
    # at 1M with block_dma and compiled steps
    export LABKIT_SESSION=$stamp
    timeout 100 python3 -m labkit.bench.pulse_blocks --context 65536 --budget 2048 --block 16 --requests 4 12 \
        --repeats 10 --dma-split 64 128 512 --run-dir "$OUT/$stamp-pulse-blocks-h200" 2>&1 | grep -v '^{' | tail -2
    mkdir -p "$OUT/$stamp-pulse-switch-h200"
    for n in 0 128 0 128; do
      timeout 70 python3 -m labkit.bench.pulse --strategy block_dma --select-block 16 --set dma_units_per_call=$n \
          --context 65536 --offload-batch 4 --normal-batch 4 --normal-context 8192 --steps 10 \
          --out "$OUT/$stamp-pulse-switch-h200/block_dma-b16-per$n-$(date +%H%M%S).json" 2>&1 | tail -1 | cut -c1-400
    done
    timeout ${SCALING_TIMEOUT:-240} python3 -m labkit.bench.pulse_scaling --context 1048576 --requests 1,2,4,8,16 --steps 6 \
        --strategy block_dma --select-block 16 --compile --out "$OUT/$stamp-pulse-scaling-blockdma-h200" 2>&1 | tail -12
    pack_out
    ;;
  hot1m)
    # The whole 1M-token prompt under the 24 GiB cap, rotating buffers; chunks.csv records each chunk as it
    # is enqueued, so a run cut short by the limit still says how far it got.
    timeout ${PREFILL_TIMEOUT:-560} python3 -m labkit.bench.prefill --out "$OUT/$stamp-prefill-1m-full-cap24-h200" \
        -p context_lens=1M -p modes=rotating -p mem_cap_gib=24 2>&1 | tail -4
    pack_out
    ;;
  pulse)
    # Run folders straight under $OUT (a run cut short still comes back), one session id in every manifest
    # (the pulse report finds its companions by it). Render later on a machine with Jupyter:
    #   labkit report results/<stamp>-pulse-trace-h200   (its notebook draws the scaling and block figures too)
    # Pass LABKIT_GIT_SHA=$(git rev-parse --short HEAD) when the tree travels without .git.
    export LABKIT_SESSION=$stamp
    SECONDS=0
    budget=${PULSE_BUDGET_S:-420}
    # 1. block-granular transfers of one QSA layer's selection: per-head 8 KB units vs coalesced vs zero_copy,
    #    each against a contiguous pinned copy of the same bytes in the same process (~20 s)
    timeout 120 python3 -m labkit.bench.pulse_blocks --context 65536 --budget 2048 --block 16 64 --repeats 20 \
        --run-dir "$OUT/$stamp-pulse-blocks-h200" 2>&1 | grep -v '^{' | tail -3
    # 2. every request offloaded at 1M: one batch vs two switched, 1..16 requests, with the bound (~90 s)
    timeout 200 python3 -m labkit.bench.pulse_scaling --context 1048576 --requests 1,2,3,4,6,8,12,16 --steps 8 \
        --out "$OUT/$stamp-pulse-scaling-h200" 2>&1 | tail -30
    # 3. the pulse GPU tests (switching changes no token; graphs; overlap; block transfers) (~60 s)
    timeout 150 python3 -m pytest -m gpu -q -rA -p no:cacheprovider tests/test_gpu_pulse.py 2>&1 | grep -v DEBUG \
        | tail -40 > "$OUT/$stamp-gpu-pulse-tests.txt"
    tail -3 "$OUT/$stamp-gpu-pulse-tests.txt"
    # 4. the trace replay with what is left: policies most wanted first (metrics written after each policy)
    left=$(( budget - SECONDS )); [ $left -lt 60 ] && left=60
    echo "trace replay: ${left}s left"
    timeout $left python3 -m labkit.bench.pulse_trace --out "$OUT/$stamp-pulse-trace-h200" \
        -p n_requests=${PULSE_REQUESTS:-32} -p max_output=64 -p capacity=65536 -p rate=1.0 \
        -p policies=noswitch:4096,threshold:4096,adaptive,threshold:16384,threshold:8192 -p timeline_every=5 -p transport=auto \
        2>&1 | grep -v DEBUG | tail -15
    echo "pulse mode: ${SECONDS}s"
    pack_out
    ;;
  explore)
    # "measure now": the explorer's button over the committed H200 runs; the live run folder is kept
    LABKIT_LIVE_OUT="$OUT/$stamp-explore-live-h200" timeout ${TEST_TIMEOUT:-400} python3 -m pytest -m gpu -q -rA -s \
        tests/test_gpu_explore.py 2>&1 | grep -v DEBUG | tail -30 | tee "$OUT/gpu_explore_test.txt"
    # the committed nightly: its decode-small entry again (the failed attempt is kept as decode-small.attempt-1)
    timeout ${NIGHTLY_TIMEOUT:-900} python3 -m labkit nightly --plan nightly/test_plan.toml --date 2026-11-29 \
        --only decode-small 2>&1 | tr '\r' '\n' | grep -v '^\s*$' | tail -30 | tee "$OUT/nightly_resume.txt"
    tar czf "$OUT/nightly-2026-11-29.tgz" results/nightly-2026-11-29 results/index.html
    ;;
esac
ls -la "$OUT"
