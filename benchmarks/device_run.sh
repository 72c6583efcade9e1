#!/usr/bin/env bash
# Everything the GPU machine has to do, in one call per phase; logs and results under $OUT.
#   bash benchmarks/device_run.sh tests calibrate      # GPU tests + memcheck, then calibration
#   bash benchmarks/device_run.sh eval bench           # planner evaluation, then the benchmark
#   bash benchmarks/device_run.sh bench_fp8            # the benchmark with fp8 K/V
#   bash benchmarks/device_run.sh ab_warps_fp8         # A/B: fp8 with 8-warp CTAs against 4
#   bash benchmarks/device_run.sh bench_variants       # issue 16: soft cap, sinks, windows beside plain
#   bash benchmarks/device_run.sh sanitize             # issue 17: racecheck and synccheck
#   bash benchmarks/device_run.sh unified              # issue 18: the unified max's tests and A/B
#   bash benchmarks/device_run.sh ab_q_smem            # issue 18: head_dim 256, q in shared memory
#   bash benchmarks/device_run.sh ab_pow2_pages        # issue 18: small pages, shift not divide
#   bash benchmarks/device_run.sh ab_rows_per_cta      # issue 18: groups 16-32 over more CTAs
#   bash benchmarks/device_run.sh ab_class_knobs       # issue 18: every knob on every class case
#   bash benchmarks/device_run.sh check_fp8_data       # where the fp8 class bench's NaN came from
#   bash benchmarks/device_run.sh ab_occupancy         # issue 18: more CTAs an SM, short CTAs
#   bash benchmarks/device_run.sh ab_tile_tokens       # issue 18: 128-token tiles for 128-byte rows
#   bash benchmarks/device_run.sh ab_compact_merge     # issue 18: the merge over split requests only
#   bash benchmarks/device_run.sh ab_dim_split         # issue 18: d256, O's dims over warp pairs
#   bash benchmarks/device_run.sh tests_s12           # the GPU tests of session 12's unrun changes
#   bash benchmarks/device_run.sh tests_s13           # session 13's default builds, digests
#   bash benchmarks/device_run.sh calibrate eval eval_candidate  # refit (fits stream_us too),
#     both evaluations, and the offline stream_us candidate's, in one run
#   bash benchmarks/device_run.sh tests_a; then tests_b; then tests_c  # every GPU test, 3 calls
#   bash benchmarks/device_run.sh memcheck; then sanitize  # each < 10 min
#   bash benchmarks/device_run.sh calibrate_fp8 bench_fp8   # fit fp8's cost model, then bench it
#   bash benchmarks/device_run.sh device_plan plan_cost  # plan_on_device tests; planning's cost per step
#   bash benchmarks/device_run.sh dissect              # what a short call spends its time on
#   bash benchmarks/device_run.sh ncu_short            # Nsight Compute: short requests' CTAs
#   bash benchmarks/device_run.sh ncu_fp8_conflicts    # where fp8's shared-store conflicts are
#   bash benchmarks/device_run.sh merge_cost           # split_merge's merge kernel, fused's merges
#   bash benchmarks/device_run.sh pdl                  # A/B: plain launches against PDL
#   bash benchmarks/device_run.sh dist                 # 2+ GPUs: context-parallel tests and benchmark
#   bash benchmarks/device_run.sh baseline             # the bench of an older tree in .baseline/
#     (git archive REV | tar -x -C .baseline; carry .baseline): A/B against `bench` in one run
# Later phases plan with the profile `calibrate` just wrote, else with the shipped one.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
# Results go to $RES and come back as ONE archive, $OUT/results.tgz (the device tool returns at
# most 8 files), written even when the run is cut off.
OUT=${OUT:-$PWD/out}; RES=$(mktemp -d); mkdir -p "$OUT"
trap 'tar -C "$RES" -czf "$OUT/results.tgz" .' EXIT
PROFILE=splitkv/planner/profiles/nvidia-h200.yaml
# FlashInfer as the benches' live peer, if it travelled: `bash ../shared/peers/prepare_flashinfer.sh
# .peers` here, then name .peers in the device tool's carry (../shared/peers/README.md).
FI=""
if [ -f .peers/flashinfer_slim.tgz ]; then
  S=$(mktemp -d)
  python3 -m pip install -q --no-index --no-deps --target "$S/site" .peers/*.whl \
    && tar xzf .peers/flashinfer_slim.tgz -C "$S" \
    && export PYTHONPATH=$S/fi:$S/site:$PYTHONPATH FLASHINFER_WORKSPACE_BASE=$S FLASHINFER_CUDA_ARCH_LIST=9.0 \
    && FI=--flashinfer
fi
# An experiment's phase: its GPU tests' summary first (correct before fast), then its A/B
# script's table, also kept under $RES.
# SKIP_TESTS=1: the A/B tables only (their GPU tests already passed in this session's tests_s12)
gpu_tests() { [ -n "$SKIP_TESTS" ] && return; python3 -m pytest -q -p no:cacheprovider "$@" 2>&1 | tail -3; }
ab() { local log=$1; shift; python3 "$@" 2>&1 | grep -v Warning | tee -a "$RES/$log"; }
for phase in "$@"; do
  case $phase in
    tests|memcheck)
      # tests: every GPU test, then memcheck over a subset; memcheck: the subset alone (with
      # tests_only first, for two calls under the device tool's 10-minute limit)
      [ "$phase" = tests ] && python3 -m pytest -q -m gpu -rs -p no:cacheprovider tests/ 2>&1 \
        | tee "$RES/gpu_tests.log" | tail -12
      timeout 540 compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q -p no:cacheprovider \
        tests/test_gpu_decode.py tests/test_gpu_device_plan.py tests/test_gpu_fp8.py tests/test_gpu_window.py \
        tests/test_gpu_variants.py tests/test_gpu_layouts.py tests/test_gpu_isolation.py tests/test_gpu_warps8.py \
        tests/test_gpu_multi_token.py \
        -k "zero_length or bad_inputs or every_split or mqa or cluster or first_pages or launch_order or pdl or invalid_device or eager_plan or writes_the_host or nan_code or windowed or nan_in_q or beyond or with_a_window or cap_of_zero or hnd or (a_bad_q and fused) or eight_warps or ragged_query or own_window or replays_changing or query_rows_in_one_graph" 2>&1 \
        | tee "$RES/memcheck.log" | tail -4 ;;
    sanitize)
      # issue 17: racecheck and synccheck (shared-memory hazards, barrier misuse) over a matrix
      # of builds: 16-bit and fp8, clusters, 8 warps, multi-token, windows, graph-stable
      for tool in racecheck synccheck; do
        timeout $([ $tool = racecheck ] && echo 420 || echo 160) compute-sanitizer --tool $tool --error-exitcode 9 python3 -m pytest -q -p no:cacheprovider \
          tests/test_gpu_decode.py tests/test_gpu_fp8.py tests/test_gpu_multi_token.py tests/test_gpu_warps8.py \
          -k "every_split or mqa or cluster or windowed or ragged and 32 or own_window and None or graph_stable or eight_warps" 2>&1 \
          | tee "$RES/$tool.log" | tail -4
      done ;;
    calibrate)
      python3 -m splitkv.cli calibrate --plot --trials 3 --min-trial-ms 10 --out "$RES/nvidia-h200.yaml" 2>&1 | tee "$RES/calibrate.log" | tail -25
      [ -f "$RES/nvidia-h200.yaml" ] && PROFILE="$RES/nvidia-h200.yaml" ;;
    calibrate_fp8)
      # the fp8 (e4m3) fit, added as kv_fp8 to the profile the later phases plan with
      python3 -m splitkv.cli calibrate --kv-dtype fp8_e4m3 --base "$PROFILE" --trials 3 --min-trial-ms 5 \
        --out "$RES/nvidia-h200-fp8.yaml" 2>&1 | tee "$RES/calibrate_fp8.log" | tail -25
      [ -f "$RES/nvidia-h200-fp8.yaml" ] && PROFILE="$RES/nvidia-h200-fp8.yaml" ;;
    eval)
      # the 44 standard held-out shapes and issue 18's 24 class shapes (--shapes all)
      python3 benchmarks/eval_planner.py --profile "$PROFILE" --json "$RES/h200-planner.json" 2>&1 \
        | tee "$RES/eval.log" | tail -8 ;;
    eval_candidate)
      # session 13's offline refit with stream_us (results/calibration/*-stream-candidate.yaml)
      python3 benchmarks/eval_planner.py \
        --profile benchmarks/results/calibration/nvidia-h200-stream-candidate.yaml \
        --json "$RES/h200-planner-stream-candidate.json" 2>&1 | tee "$RES/eval_candidate.log" | tail -8 ;;
    eval_fp8)
      python3 benchmarks/eval_planner.py --profile "$PROFILE" --kv-dtype fp8_e4m3 \
        --json "$RES/h200-planner-fp8.json" 2>&1 | tee "$RES/eval_fp8.log" | tail -8 ;;
    bench)
      # a fresh CuPy kernel cache, so the first-call compile time is a cold one
      CUPY_CACHE_DIR=$(mktemp -d) SPLITKV_PROFILE=$PROFILE python3 -m splitkv.bench $FI --json "$RES/h200.json" --markdown "$RES/h200.md" 2>&1 \
        | grep -v Warning | tee "$RES/bench.log" | tail -22 ;;
    bench_fp8)
      # fp8 K/V (e4m3, scale 1) through the same cases; the fp8 peers are issue 15's table
      CUPY_CACHE_DIR=$(mktemp -d) SPLITKV_PROFILE=$PROFILE python3 -m splitkv.bench $FI --kv-dtype fp8_e4m3 \
        --json "$RES/h200-fp8.json" --markdown "$RES/h200-fp8.md" 2>&1 | grep -v Warning | tee "$RES/bench_fp8.log" | tail -22 ;;
    bench_classes)
      # issue 18's classes (head_dim 64/256, pages 1/64, groups 16/32, short requests)
      CUPY_CACHE_DIR=$(mktemp -d) SPLITKV_PROFILE=$PROFILE python3 -m splitkv.bench $FI --cases classes \
        --json "$RES/h200-classes.json" --markdown "$RES/h200-classes.md" 2>&1 | grep -v Warning \
        | tee "$RES/bench_classes.log" | tail -14 ;;
    bench_variants)
      # issue 16's rows: soft cap, sinks, a 4k window over 128k, beside plain (bf16, then fp8)
      python3 benchmarks/bench_variants.py --json "$RES/h200-variants.json" 2>&1 | grep -v Warning \
        | tee "$RES/bench_variants.log"
      python3 benchmarks/bench_variants.py --kv-dtype float8_e4m3fn --json "$RES/h200-variants-fp8.json" \
        2>&1 | grep -v Warning | tee "$RES/bench_variants_fp8.log" ;;
    ab_multi_warps)
      # A/B: multi-token plans with 8-warp CTAs against 4 (bf16, then fp8)
      python3 benchmarks/bench_variants.py --skip variants,windows --cases b1_n32k,b8_n32k,b32_n8k,b128_n2k \
        --q-lens 4,8,16 --warps 4,8 2>&1 | grep -v Warning | tee "$RES/ab_multi_warps.log"
      python3 benchmarks/bench_variants.py --kv-dtype float8_e4m3fn --skip variants,windows \
        --cases b1_n32k,b8_n32k,b32_n8k --q-lens 4,8 --warps 4,8 2>&1 | grep -v Warning \
        | tee -a "$RES/ab_multi_warps.log" ;;
    ab_warps_fp8)
      # A/B: fp8 with 8-warp CTAs (128-token tiles) against 4, on the bf16 wrapper's plans
      python3 benchmarks/fp8_first_look.py --cases b1_n1k,b1_n8k,b1_n32k,b8_n8k,b8_n32k,b32_n8k,b128_n2k,ragged_b32 \
        --warps 4,8 2>&1 | grep -v Warning | tee "$RES/ab_warps_fp8.log" ;;
    baseline)
      (cd .baseline && CUPY_CACHE_DIR=$(mktemp -d) PYTHONPATH=$PWD SPLITKV_PROFILE=$PWD/$PROFILE \
        python3 -m splitkv.bench --no-peer --json "$RES/h200-baseline.json" 2>&1 | grep -v Warning \
        | tee "$RES/baseline.log" | tail -16) ;;
    device_plan)
      python3 -m pytest -q -m gpu -rs -p no:cacheprovider tests/test_gpu_device_plan.py tests/test_gpu_graph_stable.py \
        tests/test_gpu_digests.py tests/test_gpu_capture.py 2>&1 | tee "$RES/gpu_device_plan.log" | tail -15 ;;
    plan_cost)
      python3 benchmarks/device_plan_cost.py --json "$RES/h200-device-plan.json" 2>&1 | grep -v Warning \
        | tee "$RES/device_plan_cost.log" ;;
    unified)
      # issue 18: the unified max's GPU tests, then its A/B (bf16 and fp8 K/V) with the fallback rate
      python3 -m pytest -q -p no:cacheprovider tests/test_gpu_unified_max.py tests/test_gpu_fuzz_run.py 2>&1 \
        | tee "$RES/unified_tests.log" | tail -15
      python3 benchmarks/ab_unified_max.py --json "$RES/h200-unified-max.json" 2>&1 | grep -v Warning \
        | tee "$RES/ab_unified.log"
      python3 benchmarks/ab_unified_max.py --kv-dtype fp8_e4m3 --json "$RES/h200-unified-max-fp8.json" 2>&1 \
        | grep -v Warning | tee "$RES/ab_unified_fp8.log" ;;
    ab_q_smem)
      # issue 18, head_dim 256: q's fragments in shared memory against registers (the spill)
      gpu_tests tests/test_gpu_q_smem.py
      ab ab_q_smem.log benchmarks/ab_q_smem.py
      ab ab_q_smem_fp8.log benchmarks/ab_q_smem.py --kv-dtype fp8_e4m3 ;;
    ab_pow2_pages)
      # issue 18, small pages: the page walk by shift against division
      gpu_tests tests/test_gpu_pow2_pages.py
      ab ab_pow2_pages.log benchmarks/ab_pow2_pages.py ;;
    ab_rows_per_cta)
      # issue 18, large GQA groups: more CTAs a kv head against more row tiles a CTA
      gpu_tests tests/test_gpu_rows_per_cta.py
      ab ab_rows_per_cta.log benchmarks/ab_rows_per_cta.py ;;
    ab_class_knobs)
      # issue 18: every experiment knob on every class case (bf16, then fp8), one table each
      ab ab_class_knobs.log benchmarks/ab_class_knobs.py --json "$RES/h200-class-knobs.json"
      ab ab_class_knobs_fp8.log benchmarks/ab_class_knobs.py --kv-dtype fp8_e4m3 \
        --json "$RES/h200-class-knobs-fp8.json" ;;
    ab_occupancy)
      # issue 18, short requests and head_dim 64: more CTAs an SM (register caps, fewer stages)
      ab ab_occupancy.log benchmarks/ab_occupancy.py ;;
    ab_tile_tokens)
      # issue 18, rows of 128 bytes (d64 16-bit, fp8 d128): 128-token tiles at 4 warps
      gpu_tests tests/test_gpu_tile_tokens.py
      ab ab_tile_tokens.log benchmarks/ab_tile_tokens.py
      ab ab_tile_tokens.log benchmarks/ab_tile_tokens.py --kv-dtype fp8_e4m3 ;;
    ab_dim_split)
      # issue 18, head_dim 256: O's head dim split between warp pairs (8 warps, 64-token tiles)
      gpu_tests tests/test_gpu_dim_split.py
      ab ab_dim_split.log benchmarks/ab_dim_split.py ;;
    ab_compact_merge)
      # issue 18: the merge kernel over the split requests only, where few of a batch split
      gpu_tests tests/test_gpu_compact_merge.py
      ab ab_compact_merge.log benchmarks/ab_compact_merge.py ;;
    check_fp8_data)
      # session 12's NaN in the fp8 class bench: which step makes the data non-finite
      ab check_fp8_data.log benchmarks/check_fp8_bench_data.py ;;
    tests_s12)
      # the GPU tests of what changed after the last full run (dee7c27): the experiments, the
      # data watch, the warps rule, and the head_dim 64/256 plans (decode, device plans)
      python3 -m pytest -q -m gpu -rs -p no:cacheprovider tests/test_gpu_tile_tokens.py \
        tests/test_gpu_compact_merge.py tests/test_gpu_dim_split.py tests/test_gpu_warps8.py \
        tests/test_gpu_reliability.py::test_the_bench_data_watch_finds_a_written_nan_and_where \
        tests/test_gpu_decode.py tests/test_gpu_device_plan.py tests/test_gpu_q_smem.py 2>&1 \
        | tee "$RES/gpu_tests_s12.log" | tail -12 ;;
    tests_s13)
      # session 13's defaults (4 CTAs an SM at head_dim 64, fp8 head_dim 128's long tiles): the
      # builds, the reference, the bits recorded before (digests: re-recorded if only the fp8
      # long-tile cases moved), device plans (their records follow the stages)
      python3 -m pytest -q -m gpu -rs -p no:cacheprovider tests/test_gpu_default_builds.py \
        tests/test_gpu_device_plan.py tests/test_gpu_digests.py tests/test_gpu_fp8.py \
        tests/test_gpu_decode.py tests/test_gpu_graph_stable.py tests/test_gpu_tile_tokens.py \
        tests/test_gpu_multi_token.py tests/test_gpu_unified_max.py 2>&1 \
        | tee "$RES/gpu_tests_s13.log" | tail -12
      python3 tests/output_digests.py --write "$RES/h200_output_digests.json" 2>&1 | tail -2 ;;
    tests_only)
      # every GPU test in one call: past the device tool's 10 minutes since session 14 (~14 min
      # on a fresh machine); tests_a, tests_b and tests_c split it into three calls
      python3 -m pytest -q -m gpu -rs -p no:cacheprovider tests/ 2>&1 | tee "$RES/gpu_tests.log" | tail -12 ;;
    tests_a|tests_b|tests_c)
      case $phase in
        tests_a) files=$(ls tests/test_gpu_[a-f]*.py) ;;              # capture .. fuzz_run
        tests_b) files=$(ls tests/test_gpu_[g-l]*.py tests/test_bench_probe.py tests/test_distributed.py) ;;
        tests_c) files=$(ls tests/test_gpu_[m-z]*.py) ;;              # multi_token .. window
      esac
      python3 -m pytest -q -m gpu -rs -p no:cacheprovider --durations=10 $files 2>&1 \
        | tee "$RES/gpu_$phase.log" | tail -16 ;;
    ncu_short)
      # issue 18's short requests (7.9% behind SDPA): where a CTA of 384 tokens waits, beside
      # b32_n8k's long CTAs (the same kernel at 95% of the floor)
      for c in short_b256_n384 b32_n8k; do
        ncu --clock-control none --kernel-name decode_partial --launch-skip 3 --launch-count 1 \
          --section SpeedOfLight --section Occupancy --section WarpStateStats \
          --section LaunchStats --section SchedulerStats \
          python3 benchmarks/profile_case.py $c 2>&1 | grep -v "^==PROF==" | tee -a "$RES/ncu_short.log" | tail -60
      done
      # and what its parts cost: page lookups, K/V copies, the softmax and MMAs (patched out)
      python3 benchmarks/dissect_latency.py --cases short_b256_n384,b32_n2k \
        --probes base,no_pages,no_kv,bare,empty 2>&1 | grep -v Warning | tee -a "$RES/ncu_short.log" | tail -8 ;;
    merge_cost)
      # session 14's lead: split_merge against fused on the same cuts at large batches; what
      # the merge kernel costs (merge_empty) and what the fused merges cost (no_merge)
      python3 benchmarks/dissect_latency.py --plan-set merge --probes base,no_merge,merge_empty \
        --json "$RES/h200-merge-cost.json" 2>&1 | grep -v Warning | tee "$RES/merge_cost.log" | tail -20 ;;
    ncu_fp8_conflicts)
      # fp8's ~7,900 shared-store bank conflicts a CTA (16-bit: ~790), constant per CTA
      # (b128_n2k 8.1 M over 1,024 CTAs, b32_n8k 2.0 M over 256; results/ncu/h200-fp8-stalls.txt):
      # which instructions (SourceCounters' tables name the SASS)
      ncu --clock-control none --kernel-name decode_partial --launch-skip 3 --launch-count 1 \
        --section SourceCounters --print-details all \
        --metrics l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum \
        python3 benchmarks/profile_case.py b128_n2k 0 float8_e4m3fn 2>&1 | grep -v "^==PROF==" \
        | tee "$RES/ncu_fp8_conflicts.log" | tail -60 ;;
    dissect)
      python3 benchmarks/dissect_latency.py --probes base,no_merge,bare,empty,cluster \
        --json "$RES/h200-dissect.json" 2>&1 | grep -v Warning | tee "$RES/dissect.log" | tail -25 ;;
    pdl)
      python3 benchmarks/ab_pdl.py 2>&1 | grep -v Warning | tee "$RES/ab_pdl.log" ;;
    dist)
      export NCCL_NVLS_ENABLE=0    # NVLink multicast stays off on shared machines
      python3 -c "import cupy; from cupy.cuda import nccl; print('cupy', cupy.__version__, 'nccl', nccl.get_version(), 'gpus', cupy.cuda.runtime.getDeviceCount())"
      timeout 330 python3 -m pytest -q -m gpu -rs -p no:cacheprovider tests/test_distributed.py 2>&1 \
        | tee "$RES/dist_tests.log" | tail -6
      timeout 250 python3 -m splitkv.distributed.launch --nproc "$(python3 -c 'import cupy; print(cupy.cuda.runtime.getDeviceCount())')" \
        --timeout 240 benchmarks/bench_distributed.py --json "$RES/h200-distributed.json" 2>&1 \
        | grep -v Warning | tee "$RES/dist_bench.log" | tail -20 ;;
    *) echo "unknown phase $phase"; exit 2 ;;
  esac
done
