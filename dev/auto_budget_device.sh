#!/usr/bin/env bash
# One device call for issue 21: the engine's CUDA tests and benchmarks/auto_budget.py, by part.
#   dev/auto_budget_device.sh OUT suite ops int4gi int4gibase int4split int4moe int4vs int4tiles int4step tests tiny demo continuous moonlight kimi steps intervals admission one sync servevsengine soak soak32 trace fresh decode
# suite: every CUDA-marked test with its duration (SUITE_S, TEST_S, WORKERS); ops: the MoE kernels' tests
# (INT4 included) natively on the GPU
# The results name their commit: run `python dev/stamp.py` here and carry .provenance.json (or pass
# DDTREE_COMMIT=<commit> in the device command); the device's copy of .git can be stale.
# Each part's files land under OUT (the device tool brings back 8 files at most: pick parts to fit).
set -uo pipefail
out=$1
shift
export PYTHONPATH=src PYTHONUNBUFFERED=1
label=$(python3 -c "import sys; sys.path.insert(0, 'benchmarks'); import common; print(common.commit())") || exit 1
[ -n "${DDTREE_COMMIT:-}" ] || [ -f .provenance.json ] || { echo "no provenance: run dev/stamp.py and carry .provenance.json" >&2; exit 1; }
echo "commit $label"
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader
for part in "$@"; do
  start=$(date +%s)
  case $part in
    tests) timeout 420 python3 -m pytest -q -p no:cacheprovider -m cuda -n 4 tests/engine tests/benchmarks 2>&1 \
             | tee "$out/cuda_tests.log" | tail -15 ;;
    suite) { echo "# commit $label; $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); $(date -u +%FT%TZ)"
             echo "# pytest -m cuda -n ${WORKERS:-8} --timeout ${TEST_S:-200} --durations=0 -rA tests"
             timeout "${SUITE_S:-300}" python3 -m pytest -q -p no:cacheprovider -m cuda -n "${WORKERS:-8}" \
               --timeout "${TEST_S:-200}" --durations=0 -rA tests; } > "$out/cuda_suite.log" 2>&1
           echo "suite rc $?"; grep -E "^(FAILED|ERROR)|passed|failed|Timeout" "$out/cuda_suite.log" | head -40 ;;
    ops) # 8 workers: with 4 these did not finish within OPS_S on an H100
      timeout "${OPS_S:-120}" python3 -m pytest -q -p no:cacheprovider -n 8 tests/ops/test_int4.py tests/ops/test_moe.py \
        tests/ops/test_moe_decode.py 2>&1 | tee "$out/ops.log" | tail -6 ;;
    int4gi) # the interleaved INT4 order (session 47): its tests natively, one layer in both orders, K2.6 rounds
      timeout 150 python3 -m pytest -q -p no:cacheprovider -n 8 tests/ops/test_int4.py tests/ops/test_int4_interleaved.py \
        > "$out/int4_tests.log" 2>&1; tail -1 "$out/int4_tests.log"
      timeout "${INT4_S:-200}" python3 benchmarks/moe_paths.py --configs kimi-k2.6 --tokens 1 9 65 2080 \
        --tiles auto,16x64x64:gi,64x64x64:gi --out "$out" 2>&1 | grep "^{" | cut -c1-400
      # the same few-row tile on mma.sync instead of wgmma (which waits after every group's dot there)
      DISABLE_MMA_V3=1 TRITON_CACHE_DIR=/tmp/triton-mma2 timeout "${INT4_S:-200}" python3 benchmarks/moe_paths.py \
        --configs kimi-k2.6 --tokens 1 9 65 --tiles 16x64x64:gi --out "$out/mma2" 2>&1 | grep "^{" | cut -c1-300
      timeout "${ROUND_S:-300}" python3 benchmarks/engine_round.py --config kimi-k2.6 --layers 4 --batches 1 8 32 \
        --budgets 4 8 16 --e2e-batches --out "$out" 2>&1 | tail -3 ;;
    int4step) # the interleaved tiles at 128-column K steps beside 256 (session 51: 168 registers, 3 CTAs an SM at 64 rows)
      timeout "${INT4_S:-240}" python3 benchmarks/moe_paths.py --configs kimi-k2.6 --tokens 1 9 65 2080 \
        --tiles auto,16x64x64:gi,16x64x64:gi128,64x64x64s2:gi,64x64x64s2:gi128,64x64x64s3:gi128 --out "$out" 2>&1 \
        | grep "^{" | cut -c1-600 ;;
    int4moe) timeout "${INT4_S:-150}" python3 benchmarks/moe_paths.py --configs kimi-k2.6 kimi-k2 --tokens 1 9 65 2080 \
               --tiles auto --out "$out" 2>&1 | tail -12 ;;
    int4vs) # the INT4 layer at HEAD beside INT4_BASE's (default 9820291, before the row kernels' restructure), one run
      # (HEAD's auto takes the interleaved order on sm_90 since 2b09ade; 9820291's is the checkpoint's)
      # the base tree: .base/<commit> when carried (git archive here), else from the device's .git
      base=${INT4_BASE:-9820291}; rm -rf /tmp/int4base && mkdir -p /tmp/int4base
      if [ -d ".base/$base" ]; then cp -r ".base/$base/." /tmp/int4base; else git archive "$base" src benchmarks/moe_paths.py \
        benchmarks/common.py benchmarks/configs | tar -x -C /tmp/int4base || { echo "no $base in this .git"; continue; }; fi
      timeout "${INT4_S:-150}" python3 benchmarks/moe_paths.py --configs kimi-k2.6 --tokens ${INT4_TOKENS:-1 9 65 2080} \
        --tiles auto,1x32x256,1x8x256 --out "$out/int4head" 2>&1 | grep "^| kimi"
      DDTREE_COMMIT=$base timeout "${INT4_S:-150}" python3 /tmp/int4base/benchmarks/moe_paths.py --configs kimi-k2.6 \
        --tokens ${INT4_TOKENS:-1 9 65 2080} --tiles auto --out "$out/int4base" 2>&1 | grep "^| kimi" ;;
    int4gibase) # the interleaved tiles at HEAD beside GI_BASE's (.base/<commit>, carried: git archive src
                # benchmarks/moe_paths.py benchmarks/common.py benchmarks/configs), the same tiles, one run
      base=${GI_BASE:-dfe49df}
      [ -d ".base/$base" ] || { echo "no .base/$base here"; continue; }
      timeout "${INT4_S:-200}" python3 benchmarks/moe_paths.py --configs kimi-k2.6 --tokens ${INT4_TOKENS:-1 9 65 2080} \
        --tiles "${GI_TILES:-16x64x64:gi,64x64x64s2:gi,64x128x64w8s2:gi}" --out "$out/int4head" 2>&1 | grep "^| kimi"
      DDTREE_COMMIT=$base timeout "${INT4_S:-200}" python3 .base/$base/benchmarks/moe_paths.py \
        --configs kimi-k2.6 --tokens ${INT4_TOKENS:-1 9 65 2080} --tiles "${GI_TILES:-16x64x64:gi,64x64x64s2:gi,64x128x64w8s2:gi}" \
        --out "$out/int4base" 2>&1 | grep "^| kimi" ;;
    int4split) timeout "${INT4_S:-200}" python3 dev/int4_kernel_split.py --tokens ${INT4_TOKENS:-1 9 65 2080} \
                 --tiles ${INT4_SPLIT_TILES:-16x64x64 64x64x64s2} 2>&1 | tee "$out/int4_split.log" ;;
    tpbase) # issue 25: engine_round (Moonlight) just before the tensor-parallel commits and just after, one run;
            # each tree git-archived here under .base/<commit> (carry .base)
      for c in ${TP_BASES:-b02c2c6 fd3c16f}; do
        [ -d ".base/$c" ] || { echo "no .base/$c here"; continue; }
        DDTREE_COMMIT=$c PYTHONPATH=.base/$c/src timeout "${TPB_S:-240}" python3 .base/$c/benchmarks/engine_round.py \
          --batches ${TPB_BATCHES:-1 32} --budgets 16 --e2e-batches 1 8 --lengths 4 --out "$out/tp-$c" > "$out/tp-$c.log" 2>&1
        echo "tpbase $c rc $?"; grep -A6 "^## Bars" "$out/tp-$c"/*.md | head -8
      done ;;
    int4tiles) timeout "${INT4_S:-240}" python3 benchmarks/moe_paths.py --configs kimi-k2.6 --tokens ${INT4_TOKENS:-1 9 65} \
                 --tiles "${INT4_TILES:-auto,16x32x128,1x32x256,2x32x256,1x64x256,1x16x256,1x32x512,4x32x128}" \
                 --out "$out/int4tiles" 2>&1 | grep -v "^|" | tail -12 ;;
    int4big) # the INT4 tl.dot path at many rows (a B = 32 verify) by tile, warps, stages and unpacking:
             # at 4 warps its gate_up tile at BLOCK_M 64 compiles to 255 registers and 120 KB of shared
             # memory (one CTA per SM)
      timeout "${INT4_S:-240}" python3 benchmarks/moe_paths.py --configs kimi-k2.6 --tokens ${INT4_TOKENS:-544 2080} \
        --tiles "${INT4_TILES:-auto,16x32x128:word,32x32x128,32x64x64,64x128x64w8,64x128x64w8s2}" \
        --out "$out/int4big" 2>&1 | grep "^| kimi" ;;
    moebf16) timeout "${MOE_S:-200}" python3 benchmarks/moe_paths.py --configs moonlight-16b-a3b kimi-k2 \
               --tokens ${MOE_TOKENS:-65 256 544 1024} --tiles auto --out "$out/bf16" 2>&1 | tail -12 ;;
    tiny) python3 benchmarks/auto_budget.py --pair tiny --batches 1 4 --budgets 4 16 --new 32 --prefix 64 --wrong \
            --out-dir /tmp/tiny 2>&1 | grep -A3 "Bars\|^  " ;;
    demo) timeout "${DEMO_S:-420}" python3 benchmarks/auto_budget.py --pair demo --passes "${PASSES:-5}" --out-dir "$out" 2>&1 | tee "$out/demo.log" | grep -v "^|" | grep -v "measuring round costs" ;;
    continuous) mkdir -p "$out/continuous" && timeout "${DEMO_S:-420}" python3 benchmarks/auto_budget.py --pair demo \
                  --passes "${PASSES:-5}" --schedule continuous --out-dir "$out/continuous" 2>&1 \
                  | tee "$out/continuous/demo.log" | grep -v "^|" | grep -v "measuring round costs" ;;
    moonlight) python3 benchmarks/auto_budget.py --pair moonlight-16b-a3b --wrong --warmup-new 32 --passes "${PASSES:-3}" --out-dir "$out" 2>&1 \
                 | tee "$out/moonlight.log" | grep -v "^|" ;;
    kimi) python3 benchmarks/auto_budget.py --pair kimi-k2 --layers 4 --wrong --warmup-new 32 --passes "${PASSES:-3}" --out-dir "$out" 2>&1 \
            | tee "$out/kimi.log" | grep -v "^|" ;;
    servevsengine) # needs the serving wheels carried in .whl/ (docs/notes/server.md), pyzmq's among them
      python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && \
        PYTHONPATH=/tmp/site:$PYTHONPATH timeout "${SVE_S:-420}" python3 benchmarks/serve_vs_engine.py ${SVE_ARGS:-} --out-dir "$out" 2>&1 \
        | tee "$out/serve_vs_engine.log" | grep -v "^|" | tail -24 ;;
    soak32) # the soak in float32: the serving path's texts against served alone, where near ties are rare
      python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && \
        PYTHONPATH=/tmp/site:$PYTHONPATH timeout "${SOAK_S:-360}" python3 benchmarks/serve_soak.py \
        --requests "${SOAK_N:-3000}" --concurrency 64 --serve-args "--max-batch 32 --dtype float32 ${SOAK_ARGS:-}" --out-dir "$out/fp32" 2>&1 \
        | tee "$out/serve_soak_fp32.log" | tail -20 ;;
    soak) # 36's GPU soak: the serving wheels carried in .whl/, as for servevsengine
      python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && \
        PYTHONPATH=/tmp/site:$PYTHONPATH timeout "${SOAK_S:-360}" python3 benchmarks/serve_soak.py \
        --requests "${SOAK_N:-3000}" --concurrency 64 --out-dir "$out" 2>&1 | tee "$out/serve_soak.log" | tail -20 ;;
    intervals) for b in ${INTERVAL_B:-1 32}; do python3 dev/step_intervals.py --batch $b --prompts $((2 * b > 16 ? 2 * b : 16)) --configs ar ddtree,8 ddtree,auto --warmup; done 2>&1 \
                 | grep -v "measuring round costs" | tee "$out/step_intervals.log" ;;
    admission) python3 dev/admission_profile.py --batch 32 --prompts 120 ${ADMISSION_ARGS:-} 2>&1 | tee "$out/admission_profile.log" \
                 | grep -E "wall|prefill|admit" | head -40 ;;
    trace) # where a served first token's time goes at c = 1 (issue 36's TTFT bar)
      python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && \
        PYTHONPATH=/tmp/site:$PYTHONPATH timeout 120 python3 dev/first_token_trace.py --device cuda --requests 30 \
        --mode "${TRACE_MODE:-ar}" ${TRACE_ARGS:-} 2>&1 | tail -"${TRACE_LINES:-16}" | tee "$out/first_token_trace.log" ;;
    decode) # where a served token's time goes at c = 1 in decode (issue 36's ar gap): engine at max_batch 1 / 64,
            # the core's turns marked, httpx and raw clients, py-spy of the core (its wheel in .whl/)
      python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && \
        PY_SPY=/tmp/site/bin/py-spy PYTHONPATH=/tmp/site:$PYTHONPATH timeout "${DECODE_S:-300}" python3 dev/decode_trace.py \
        --device cuda ${DECODE_ARGS:---py-spy 4} 2>&1 | grep -v "^ddtree serve" | tee "$out/decode_trace.log" | tail -60 ;;
    fresh) # issue 22's fresh-server bar: a new server's first pass over the cells against its second
      python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && \
        PYTHONPATH=/tmp/site:$PYTHONPATH timeout "${FRESH_S:-360}" python3 benchmarks/serve_fresh.py ${FRESH_ARGS:-} \
        --out-dir "$out" 2>&1 | tee "$out/serve_fresh.log" | grep -v "^|" | tail -30 ;;
    one) timeout 200 python3 -m pytest -q -p no:cacheprovider -m cuda -rA $ONE 2>&1 | tail -15 ;;
    sync) python3 dev/scalar_write_sync.py 2>&1 | tee "$out/scalar_write_sync.log" ;;
    steps) for b in 8 32; do python3 dev/demo_step_profile.py --batch $b --prompts $((4*b)) --configs ar,1 ddtree,16 ddtree,32 ddtree,auto ddtree,auto@0 ddtree,auto@32; done 2>&1 \
             | tee "$out/steps.log" | grep "wall" ;;
    *) echo "unknown part $part" ;;
  esac
  echo "== $part took $(( $(date +%s) - start )) s"
done
