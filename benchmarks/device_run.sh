#!/usr/bin/env bash
# Everything the GPU machine runs, one phase after another; logs and results under $OUT.
#   bash benchmarks/device_run.sh tests                # every GPU test
#     TESTS='tests/kernels/test_gpu_*.py' ... tests  # a subset (files or globs), to split the run
#   bash benchmarks/device_run.sh memcheck sanitize    # compute-sanitizer: memcheck; racecheck, synccheck
#   bash benchmarks/device_run.sh calibrate eval bench # fit the cost model, evaluate it, benchmark
#   bash benchmarks/device_run.sh calibrate_fp8 eval_fp8 bench_fp8   # the same with fp8 K/V
#   bash benchmarks/device_run.sh bench_classes        # the classes of shape outside the standard set
#   bash benchmarks/device_run.sh bench_variants       # soft cap, sinks, windows, multi-token beside plain
#   bash benchmarks/device_run.sh dissect plan_cost    # what a short call spends; planning's cost a step
#   bash benchmarks/device_run.sh plan_phases          # the planning kernel's steps over batch sizes 1-32
#   bash benchmarks/device_run.sh engine_path          # the engines' path (graph-stable, capacity 256,
#                                                      # planned on the device, the torch op) beside the
#                                                      # per-shape wrapper, bf16 then fp8
#     ENGINE_ARGS='--model-layers 32 --no-op' ...      # steps of 32 layer calls (a model's depth)
#   bash benchmarks/device_run.sh first_use            # first-use probes (shipped profile hidden) against
#                                                      # the shipped profile and the roofline prior, ~5 min
#   bash benchmarks/device_run.sh first_use_fp8        # the same over fp8 K/V
#   bash benchmarks/device_run.sh calibrate_quick      # calibrate --quick, then the planner evaluation with it
#   AB_ARGS='--cases b32_n8k --set default= --set w8=warps=8' bash benchmarks/device_run.sh ab
#                                                      # an A/B (benchmarks/ab.py; AB_ARGS split on spaces)
#   ENGINES_ARGS='--graphs on --repeats 1' bash benchmarks/device_run.sh engines
#                                                      # transformers' generate_batch, splitkv vs sdpa
#   bash benchmarks/device_run.sh transformers_newest  # the transformers GPU tests on the release whose
#                                                      # wheels lie in .whl/transformers/ (carried with the
#                                                      # call: pip download --no-deps --python-version 3.12
#                                                      # --only-binary=:all: transformers==X huggingface_hub
#                                                      # kernels ... -d .whl/transformers)
#   bash benchmarks/device_run.sh dist                 # 2+ GPUs: context-parallel tests and benchmark
#   bash benchmarks/device_run.sh baseline bench       # the bench of an older tree in .baseline/, then
#     this tree's: before and after in one run (git archive REV | tar -x -C .baseline)
# eval, eval_fp8, bench, bench_fp8, bench_classes and ab plan with the profile `calibrate` (or
# `calibrate_fp8`) wrote earlier in the run, else as below.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
# Results go to $RES and come back as one archive, $OUT/results.tgz, written even when the run
# is cut off.
OUT=${OUT:-$PWD/out}; RES=$(mktemp -d); mkdir -p "$OUT"
trap 'tar -C "$RES" -czf "$OUT/results.tgz" .' EXIT
# The GPU it runs on names the result files (h100-..., h200-...), and splitkv's name for it
# (profiles.device_slug) a profile calibrated here. The phases plan with the profile shipped for
# this GPU where there is one, else with what splitkv picks on it by itself (its first use).
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 \
  | grep -o -i -E 'h100|h200|a100|l40s|b200' | head -1 | tr '[:upper:]' '[:lower:]')
GPU=${GPU:-gpu}
SLUG=$(python3 -c "import cupy; from splitkv.planner.profiles import device_slug; \
print(device_slug(cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()))" 2>/dev/null)
SLUG=${SLUG:-$GPU}
PROFILE=""
[ -f "splitkv/planner/profiles/$SLUG.yaml" ] && PROFILE="splitkv/planner/profiles/$SLUG.yaml"
echo "device_run: $GPU ($SLUG), planning with ${PROFILE:-the profile splitkv picks (first use)}"
# the logs without the libraries' warnings, a line at a time (a phase cut off keeps its lines)
quiet() { grep --line-buffered -v Warning; }
# FlashInfer as the benches' live peer, where .peers/ holds its slim archive
# (flashinfer_slim.tgz) and the wheels it needs: installed into a temporary folder, and the
# bench phases pass --flashinfer.
FI=""
if [ -f .peers/flashinfer_slim.tgz ]; then
  S=$(mktemp -d)
  python3 -m pip install -q --no-index --no-deps --target "$S/site" .peers/*.whl \
    && tar xzf .peers/flashinfer_slim.tgz -C "$S" \
    && export PYTHONPATH=$S/fi:$S/site:$PYTHONPATH FLASHINFER_WORKSPACE_BASE=$S FLASHINFER_CUDA_ARCH_LIST=9.0 \
    && FI=--flashinfer
fi
for phase in "$@"; do
  case $phase in
    tests)
      # shellcheck disable=SC2086  # TESTS: files or globs, split and expanded
      python3 -m pytest -q -m gpu -rs -p no:cacheprovider --durations=10 ${TESTS:-tests/} 2>&1 \
        | tee "$RES/gpu_tests.log" | tail -16 ;;
    memcheck)
      # out-of-bounds and uninitialised accesses, over a subset that reaches every kernel path
      timeout 540 compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q -p no:cacheprovider \
        tests/kernels/test_gpu_decode.py tests/runtime/test_gpu_device_plan.py tests/kernels/test_gpu_fp8.py tests/kernels/test_gpu_window.py \
        tests/kernels/test_gpu_variants.py tests/runtime/test_gpu_layouts.py tests/runtime/test_gpu_isolation.py tests/kernels/test_gpu_experiments.py \
        tests/kernels/test_gpu_multi_token.py \
        -k "zero_length or bad_inputs or every_split or mqa or cluster or first_pages or launch_order or pdl or invalid_device or eager_plan or writes_the_host or nan_code or windowed or nan_in_q or beyond or with_a_window or cap_of_zero or hnd or (a_bad_q and fused) or eight_warps or ragged_query or own_window or replays_changing or query_rows_in_one_graph" 2>&1 \
        | tee "$RES/memcheck.log" | tail -4 ;;
    sanitize)
      # racecheck and synccheck (shared-memory hazards, barrier misuse) over a matrix of builds:
      # 16-bit and fp8, clusters, 8 warps, multi-token, windows, graph-stable
      for tool in racecheck synccheck; do
        timeout $([ $tool = racecheck ] && echo 420 || echo 160) compute-sanitizer --tool $tool --error-exitcode 9 python3 -m pytest -q -p no:cacheprovider \
          tests/kernels/test_gpu_decode.py tests/kernels/test_gpu_fp8.py tests/kernels/test_gpu_multi_token.py tests/kernels/test_gpu_experiments.py \
          -k "every_split or mqa or cluster or windowed or ragged and 32 or own_window and None or graph_stable or eight_warps" 2>&1 \
          | tee "$RES/$tool.log" | tail -4
      done ;;
    calibrate)
      # --verbose: the log keeps a line per plan timed; the tail shows the fit and the plans' table
      python3 -m splitkv.cli calibrate --plot --verbose --trials 3 --min-trial-ms 10 --out "$RES/$SLUG.yaml" 2>&1 | tee "$RES/calibrate.log" | tail -32
      [ -f "$RES/$SLUG.yaml" ] && PROFILE="$RES/$SLUG.yaml" ;;
    calibrate_fp8)
      # the fp8 (e4m3) fit, added as kv_fp8 to the profile the later phases plan with
      python3 -m splitkv.cli calibrate --kv-dtype fp8_e4m3 ${PROFILE:+--base "$PROFILE"} --verbose --trials 3 --min-trial-ms 5 \
        --out "$RES/$SLUG-fp8.yaml" 2>&1 | tee "$RES/calibrate_fp8.log" | tail -32
      [ -f "$RES/$SLUG-fp8.yaml" ] && PROFILE="$RES/$SLUG-fp8.yaml" ;;
    eval)
      # the 44 standard held-out shapes and the 24 class shapes (--shapes all)
      python3 benchmarks/eval_planner.py ${PROFILE:+--profile "$PROFILE"} --json "$RES/$GPU-planner.json" 2>&1 \
        | tee "$RES/eval.log" | tail -8 ;;
    eval_fp8)
      python3 benchmarks/eval_planner.py ${PROFILE:+--profile "$PROFILE"} --kv-dtype fp8_e4m3 \
        --json "$RES/$GPU-planner-fp8.json" 2>&1 | tee "$RES/eval_fp8.log" | tail -8 ;;
    bench)
      # a fresh CuPy kernel cache, so the first-call compile time is a cold one
      CUPY_CACHE_DIR=$(mktemp -d) env ${PROFILE:+SPLITKV_PROFILE=$PROFILE} python3 -m splitkv.bench $FI --json "$RES/$GPU.json" --markdown "$RES/$GPU.md" 2>&1 \
        | quiet | tee "$RES/bench.log" | tail -22 ;;
    bench_fp8)
      # fp8 K/V (e4m3, scale 1) through the same cases, beside the fp8 peers' numbers
      CUPY_CACHE_DIR=$(mktemp -d) env ${PROFILE:+SPLITKV_PROFILE=$PROFILE} python3 -m splitkv.bench $FI --kv-dtype fp8_e4m3 \
        --json "$RES/$GPU-fp8.json" --markdown "$RES/$GPU-fp8.md" 2>&1 | quiet | tee "$RES/bench_fp8.log" | tail -22 ;;
    bench_classes)
      # head_dim 64/256, pages 1/64, groups 16/32, short requests (splitkv/bench/cases.py)
      CUPY_CACHE_DIR=$(mktemp -d) env ${PROFILE:+SPLITKV_PROFILE=$PROFILE} python3 -m splitkv.bench $FI --cases classes \
        --json "$RES/$GPU-classes.json" --markdown "$RES/$GPU-classes.md" 2>&1 | quiet \
        | tee "$RES/bench_classes.log" | tail -14 ;;
    bench_variants)
      # soft cap, sinks, ALiBi, a 4k window over 128k, multi-token decode, beside plain (bf16, then fp8)
      python3 benchmarks/bench_variants.py --json "$RES/$GPU-variants.json" 2>&1 | quiet \
        | tee "$RES/bench_variants.log"
      python3 benchmarks/bench_variants.py --kv-dtype float8_e4m3fn --json "$RES/$GPU-variants-fp8.json" \
        2>&1 | quiet | tee "$RES/bench_variants_fp8.log" ;;
    first_use)
      # the planner evaluation's 68 shapes planned by the first-use probes' model, the shipped
      # profile and the roofline prior, each against the best plan measured in the same run
      CUPY_CACHE_DIR=$(mktemp -d) python3 benchmarks/eval_first_use.py --json "$RES/$GPU-first-use.json" 2>&1 \
        | quiet | tee "$RES/first_use.log" | tail -12 ;;
    first_use_fp8)
      # the same with fp8 K/V (e4m3): each model plans with its fp8 fit where it has one
      CUPY_CACHE_DIR=$(mktemp -d) python3 benchmarks/eval_first_use.py --kv-dtype fp8_e4m3 \
        --json "$RES/$GPU-first-use-fp8.json" 2>&1 | quiet | tee "$RES/first_use_fp8.log" | tail -12 ;;
    calibrate_quick)
      # `splitkv calibrate --quick` as a user runs it (an empty user cache), then the planner
      # evaluation under the profile it wrote, to set beside the shipped profile's
      XDG_CACHE_HOME=$(mktemp -d) python3 -m splitkv.cli calibrate --quick --out "$RES/$SLUG-quick.yaml" \
        2>&1 | tee "$RES/calibrate_quick.log" | tail -20
      python3 benchmarks/eval_planner.py --profile "$RES/$SLUG-quick.yaml" --json "$RES/$GPU-planner-quick.json" \
        2>&1 | tee "$RES/eval_quick.log" | tail -8 ;;
    dissect)
      # the same plans with parts of the kernel cut out: what each part of a short call costs
      python3 benchmarks/dissect_latency.py --probes base,no_merge,bare,empty,cluster \
        --json "$RES/$GPU-dissect.json" 2>&1 | quiet | tee "$RES/dissect.log" | tail -25 ;;
    plan_cost)
      # the host's plan() (choose_plan, then with the upload), then planning on the device
      python3 benchmarks/plan_host_cost.py 2>&1 | quiet | tee "$RES/plan_host_cost.log"
      python3 benchmarks/device_plan_cost.py --json "$RES/$GPU-device-plan.json" 2>&1 | quiet \
        | tee "$RES/device_plan_cost.log" ;;
    plan_phases)
      # the planning kernel's steps over batch sizes 1-32, its scratch in shared memory, then
      # in global memory
      for scratch in auto global; do
        python3 benchmarks/device_plan_cost.py --phases --scratch $scratch \
          --cases b1_n8k,b2_n8k,b4_n8k,b8_n8k,b16_n8k,b24_n8k,b32_n8k \
          --json "$RES/$GPU-plan-phases-$scratch.json" 2>&1 | quiet | tee "$RES/plan_phases_$scratch.log"
      done ;;
    engine_path)
      # $ENGINE_ARGS: more options (--cases ...), split on spaces
      read -r -a engine_args <<< "${ENGINE_ARGS:-}"
      python3 benchmarks/engine_path.py "${engine_args[@]}" --json "$RES/engine-path.json" 2>&1 \
        | quiet | tee "$RES/engine_path.log"
      python3 benchmarks/engine_path.py "${engine_args[@]}" --kv-dtype fp8_e4m3 \
        --json "$RES/engine-path-fp8.json" 2>&1 | quiet | tee "$RES/engine_path_fp8.log" ;;
    ab)
      # benchmarks/ab.py with $AB_ARGS (split on spaces, no globbing)
      read -r -a ab_args <<< "$AB_ARGS"
      env ${PROFILE:+SPLITKV_PROFILE=$PROFILE} python3 benchmarks/ab.py "${ab_args[@]}" --json "$RES/$GPU-ab.json" 2>&1 \
        | quiet | tee "$RES/ab.log" ;;
    dist)
      # NVLink multicast stays off on shared machines (NCCL's and torch's)
      export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
      gpus=$(python3 -c 'import cupy; print(cupy.cuda.runtime.getDeviceCount())')
      python3 -c "import cupy, torch; print('cupy', cupy.__version__, 'torch', torch.__version__, 'nccl', torch.cuda.nccl.version(), 'gpus', $gpus)"
      timeout 330 python3 -m pytest -q -m gpu -rs -p no:cacheprovider tests/integrations/test_distributed.py 2>&1 \
        | tee "$RES/dist_tests.log" | tail -6
      timeout 250 torchrun --nproc-per-node "$gpus" --max-restarts 0 benchmarks/bench_distributed.py \
        --timeout 240 --json "$RES/$GPU-distributed.json" 2>&1 \
        | quiet | tee "$RES/dist_bench.log" | tail -20 ;;
    transformers_newest)
      # the wheels of a newer transformers (and what it needs beyond the machine's) put in front
      # of the installed one, in a subshell so later phases keep the machine's
      (T=$(mktemp -d) && python3 -m pip install -q --no-index --no-deps --target "$T" .whl/transformers/*.whl \
        && export PYTHONPATH=$T:$PYTHONPATH \
        && python3 -c "import transformers, torch; print('transformers', transformers.__version__, 'torch', torch.__version__)" \
        && python3 -m pytest -q -m gpu -rs -p no:cacheprovider --durations=10 \
          ${TESTS:-tests/integrations/test_transformers_gpu.py} 2>&1 | tee "$RES/gpu_tests_transformers_newest.log" | tail -16) ;;
    engines)
      # transformers' continuous batching, paged|splitkv beside paged|sdpa ($ENGINES_ARGS: the
      # script's options, split on spaces; default its whole grid, about 15 minutes)
      read -r -a engines_args <<< "${ENGINES_ARGS:-}"
      python3 benchmarks/transformers_throughput.py --out "$RES" "${engines_args[@]}" 2>&1 \
        | quiet | tee "$RES/engines.log" | tail -14 ;;
    baseline)
      # the bench of the tree in .baseline/ with its own shipped profile, for a before and after
      # in one run beside `bench`
      (cd .baseline && CUPY_CACHE_DIR=$(mktemp -d) PYTHONPATH=$PWD \
        env ${PROFILE:+SPLITKV_PROFILE=$PWD/$PROFILE} \
        python3 -m splitkv.bench --no-peer --json "$RES/$GPU-baseline.json" 2>&1 | quiet \
        | tee "$RES/baseline.log" | tail -16) ;;
    *) echo "unknown phase $phase"; exit 2 ;;
  esac
done
