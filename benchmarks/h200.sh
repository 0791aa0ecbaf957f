#!/usr/bin/env bash
# One command on a CUDA machine (the H200: torch 2.11+cu130, triton 3.6, python3.12, no
# network), from a fresh copy of the repository:
#
#     bash benchmarks/h200.sh                 # every stage, in this order
#     bash benchmarks/h200.sh bench suite     # only some stages
#
# Stages, most valuable first, each under a timeout so the whole run fits in
# $H200_BUDGET_S seconds (default 570: a 10-minute command limit); what a stage prints goes
# to $OUT/<stage>.log (OUT defaults to ./h200-results) and a summary to stdout:
#   install   pip install --no-build-isolation --no-deps -e . (CXX=/opt/gcc/bin/g++ if present),
#             which also compiles the prebuilt kernels (csrc/cuda/build_kernels.py)
#   core      tests/test_cuda.py: splits, unused slots, clamped offsets, no host sync, CUDA
#             graphs, torch.compile, opcheck
#   parity    tests/test_contract.py's cuda and cuda-triton items (TREE_ATTN_TEST_BACKENDS): the parity
#             matrix (880 cases, on the default kernel choice -- the Hopper kernel on sm_90 where it
#             covers -- and again on the Triton kernel), forward-vs-forward_with_lse, the bad-input and non-finite
#             tables, after tests/warm_cuda_kernels.py has compiled
#             the specs outside the prebuilt table, in $PARITY_SHARDS (16) parallel pytest processes
#             (TREE_ATTN_TEST_SHARD=i/n), so Triton's compilations use the CPU cores, for
#             at most $PARITY_S (200) seconds; one $OUT/parity.log for all shards
#   bench     benchmarks/bench_op.py --device cuda -> $OUT/bench.{txt,json,png} (alone on the GPU)
#   triton    tests/test_triton.py and tests/test_contract.py's triton-interp items (the
#             interpreter run of the same kernels)
#   hf        tests/test_hf.py on the GPU (TREE_ATTN_TEST_DEVICE=cuda)
#   eagle3    examples/eagle3_verify.py --device cuda --check (the built-in pair): the cold-start
#             and steady-state table
#   spec      tests/test_speculative.py and tests/test_eagle3.py's CUDA items (greedy and batch with
#             and without graphs, capture once, no host sync in a round, sampling with graphs;
#             the cold-start CLI test is the eagle3 stage's run)
#   launch    benchmarks/bench_launch.py -> $OUT/launch.{log,json}: eager host cost, first call
#   e2e       benchmarks/bench_e2e.py --device cuda -> $OUT/e2e.{log,json,png}
#   tune      benchmarks/tune_cuda.py $TUNE_ARGS -> $OUT/tune.{log,json} (not in the default stages)
#   fuzz      python -m tests.test_fuzz --cuda --count $FUZZ_CUDA_CASES (2000): the differential
#             fuzzer on the GPU, batched, after compiling its kernel specs outside the prebuilt
#             table; prints failures and cases per second
#   ncu       benchmarks/ncu_profile.py --out $OUT/ncu: Nsight Compute per bench shape (tensor pipe,
#             issue slots, DRAM, stall reasons), raw CSVs under $OUT/ncu (not a default stage)
#   suite     builds tests/sim, then the rest of tests/
set -u
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-$ROOT/h200-results}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
BUDGET=${H200_BUDGET_S:-570}
# triton (the interpreter run) is not a default stage: triton 3.6's interpreter fails with
# numpy 2.x (int() of a one-element array in its range()); CI runs it with a current triton.
STAGES=${*:-install core launch e2e parity fuzz hf eagle3 spec bench suite}
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
export MAX_JOBS=${MAX_JOBS:-16}
if [ -z "${CXX:-}" ] && [ -x /opt/gcc/bin/g++ ]; then
  export CXX=/opt/gcc/bin/g++
  [ -x /opt/gcc/bin/gcc ] && export CC=/opt/gcc/bin/gcc
fi

left() { echo $((BUDGET - SECONDS)); }
# stage NAME CAP_SECONDS COMMAND...: runs COMMAND under min(CAP, time left), logs to $OUT/NAME.log
stage() {
  local name=$1 cap=$2
  shift 2
  local t=$(left)
  [ "$cap" -lt "$t" ] && t=$cap
  if [ "$t" -le 5 ]; then
    echo "== $name: skipped, no time left" | tee -a "$OUT/summary.txt"
    return
  fi
  local start=$SECONDS
  timeout --kill-after=10 "$t" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  local note=""
  [ $rc -eq 124 ] && note=" (timed out after ${t}s)"
  echo "== $name: rc=$rc in $((SECONDS - start))s$note" | tee -a "$OUT/summary.txt"
  tail -n 15 "$OUT/$name.log"
}

: >"$OUT/summary.txt"
{
  echo "host $(hostname), $(date -u +%FT%TZ), CXX=${CXX:-default}"
  $PY -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'NO CUDA')"
  $PY -c "import triton; print('triton', triton.__version__)" 2>&1 | tail -1
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null
} | tee -a "$OUT/summary.txt"

PYTEST="$PY -m pytest -q -rfE -p no:cacheprovider"
for s in $STAGES; do
  case $s in
    install) stage install 240 $PY -m pip install --no-build-isolation --no-deps -v -e . ;;
    core) stage core 150 $PYTEST tests/test_cuda.py ;;
    parity)
      # First every spec outside the prebuilt table, compiled once each in parallel into
      # Triton's disk cache (else each shard compiles the ones it meets, serially).
      stage warm 150 $PY -m tests.warm_cuda_kernels
      t=$(left); cap=${PARITY_S:-200}; [ "$cap" -lt "$t" ] && t=$cap
      start=$SECONDS; pids=(); n=${PARITY_SHARDS:-16}
      for i in $(seq 0 $((n - 1))); do
        OMP_NUM_THREADS=1 TREE_ATTN_TEST_BACKENDS=cuda,cuda-triton TREE_ATTN_TEST_SHARD=$i/$n timeout --kill-after=10 "$t" \
          $PYTEST tests/test_contract.py -k "not test_table_names" >"$OUT/parity-$i.log" 2>&1 &
        pids+=($!)
      done
      rcs=""; for p in "${pids[@]}"; do wait "$p"; rcs="$rcs $?"; done
      echo "== parity: shard rcs$rcs in $((SECONDS - start))s (124 = timed out after ${t}s)" | tee -a "$OUT/summary.txt"
      # One log for all shards (a shard's result line and its failures), not n files.
      for i in $(seq 0 $((n - 1))); do
        echo "shard $i/$n: $(grep -E "passed|failed|error" "$OUT/parity-$i.log" | tail -n 1)"
        grep -E "^(FAILED|ERROR)" "$OUT/parity-$i.log" | head -n 50
      done >"$OUT/parity.log"
      [ -n "${KEEP_SHARD_LOGS:-}" ] || rm -f "$OUT"/parity-*.log
      grep "^shard" "$OUT/parity.log"; grep -h -E "^(FAILED|ERROR)" "$OUT/parity.log" | head -n 20 ;;
    bench)
      stage bench 200 $PY benchmarks/bench_op.py --device cuda --json "$OUT/bench.json" --plot "$OUT/bench.png"
      cp "$OUT/bench.log" "$OUT/bench.txt" ;;
    launch) stage launch 150 $PY benchmarks/bench_launch.py --breakdown --json "$OUT/launch.json" ;;
    e2e) stage e2e ${E2E_S:-300} $PY benchmarks/bench_e2e.py --device cuda --json "$OUT/e2e.json" --png "$OUT/e2e.png" ;;
    triton) stage triton 200 env TREE_ATTN_TEST_BACKENDS=triton-interp $PYTEST tests/test_triton.py tests/test_contract.py ;;
    hf) stage hf 300 env TREE_ATTN_TEST_DEVICE=cuda $PYTEST tests/test_hf.py ;;
    eagle3) stage eagle3 200 $PY examples/eagle3_verify.py --device cuda --check ;;
    spec) stage spec 300 $PYTEST tests/test_speculative.py tests/test_eagle3.py -k "cuda and not cold_start" ;;
    fuzz) stage fuzz ${FUZZ_S:-300} $PY -m tests.test_fuzz --cuda --count ${FUZZ_CUDA_CASES:-2000} ;;
    ncu) stage ncu ${NCU_S:-300} $PY benchmarks/ncu_profile.py --out "$OUT/ncu" ;;
    tune) stage tune ${TUNE_S:-420} $PY benchmarks/tune_cuda.py --max-seconds $(( ${TUNE_S:-420} - 40 )) --json "$OUT/tune.json" ${TUNE_ARGS:-} ;;
    suite)
      stage sim-build 200 $PY -m pip install --no-build-isolation --no-deps ./tests/sim
      # The contract's cpu and sim items (its cuda ones ran in the parity stage).
      stage suite 600 env TREE_ATTN_TEST_BACKENDS=cpu,sim,sim-vector $PYTEST tests --ignore=tests/test_cuda.py \
        --ignore=tests/test_triton.py ;;
    *) echo "unknown stage $s (install core launch e2e parity fuzz hf eagle3 spec bench triton suite tune ncu)"; exit 2 ;;
  esac
done
echo "== done in ${SECONDS}s; logs in $OUT" | tee -a "$OUT/summary.txt"
