#!/usr/bin/env bash
# One device call: build against the machine's torch, run the whole test
# suite (GPU tests included), then the boundary benchmarks. Logs go to $OUT.
#   tools/gpu_suite.sh [build|tests|gpu|check|bench|onegpu|stress|all]
# gpu: only the tests that need a GPU (pytest -m gpu), JOBS (default 6) at a
# time through pytest-xdist when it is installed: the whole suite no longer
# fits one 10-minute call on one GPU (the DCP4/DCP8 tests spawn many ranks).
# check: the one-rank check of the peer kernels (python -m
# torch_sdcp.bench.kernel_check), then the same under compute-sanitizer
# memcheck (host API results of cuda-python's symbol lookup not reported).
# bench at SDCP_GPU_WORLD=1 is the kernel side alone (no peer): rows 1 to
# 4096 by default.
# onegpu: python -m torch_sdcp.bench --one-gpu N for N in ONEGPU_WORLDS
# (default 1 2 4 8) at rows ONEGPU_ROWS (default 1,32,128): N virtual ranks in
# one process on GPU 0 against each other, world 1 beside them (the kernel side
# with HBM in place of NVLink, not a multi-GPU figure; each rank's 64 steps in
# a CUDA graph of its own); once per word of ONEGPU_PDL (default "on off"):
# SDCP_PDL=1 (PDL on, as the kernels run by default), then SDCP_PDL=0, whose
# co-residency rule counts each rank's grid once instead of twice (the 32-row
# cells of Output/LSE and the query run only there); tables,
# bench.json and the log per run under $OUT/onegpu-N (PDL on) and
# $OUT/onegpu-N-nopdl; exits 1 when a run fails (a reference check, an
# error); ONEGPU_ARGS adds options (e.g. --blocks-per-sm 3, --one-gpu-method
# one-graph).
# stress: tools/stress.py on the shared-GPU failure tests (rows mismatch, void
# calls, call tags, query view, CUDA aborts), STRESS_ROUNDS (default 2) rounds of
# STRESS_PARALLEL (default 6) pytest processes at once, each bounded by
# STRESS_TIMEOUT (default 270 s); counts wrong results; $OUT/stress.json.
# SDCP_GPU_WORLD=N (default 2) runs the boundary GPU tests and the benchmarks
# at world size N (DCP4 / DCP8 on machines with 4 or 8 GPUs); the benchmarks
# then also run the sparse decode step.
set -uo pipefail
what=${1:-all}
OUT=${OUT:-/tmp/sdcp-out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
# setup.py builds for the visible GPUs (H200: sm_90) unless TORCH_CUDA_ARCH_LIST says otherwise.
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
{ nvidia-smi; nvidia-smi topo -m; python3 -c 'import torch; print(torch.__version__, torch.cuda.device_count())'; } \
  > "$OUT/machine.txt" 2>&1
if ! python3 -c 'import torch_sdcp' 2>/dev/null; then
  start=$(date +%s)
  MAX_JOBS=16 python3 -m pip install --no-deps --no-build-isolation -e . > "$OUT/build.log" 2>&1 \
    || { tail -50 "$OUT/build.log"; exit 1; }
  echo "build: $(( $(date +%s) - start )) s"
fi
world=${SDCP_GPU_WORLD:-2}
export SDCP_GPU_WORLD=$world
if [[ $what == tests || $what == all ]]; then
  timeout ${TEST_TIMEOUT:-540} python3 -m pytest -q -rs --durations=15 test 2>&1 | tee "$OUT/tests.log" | tail -40
fi
if [[ $what == gpu ]]; then
  par=()
  python3 -c 'import xdist' 2>/dev/null && par=(-n "${JOBS:-6}")
  timeout ${TEST_TIMEOUT:-540} python3 -m pytest -v -rs -m gpu "${par[@]}" test 2>&1 | tee "$OUT/tests-gpu.log" | tail -60
fi
if [[ $what == check ]]; then
  timeout ${CHECK_TIMEOUT:-150} python3 -m torch_sdcp.bench.kernel_check 2>&1 | tee "$OUT/check.log" | tail -3
  timeout ${CHECK_TIMEOUT:-150} compute-sanitizer --tool memcheck --report-api-errors no --print-limit 20 \
    python3 -m torch_sdcp.bench.kernel_check 2>&1 | tee "$OUT/memcheck.log" | tail -3
fi
if [[ $what == bench || $what == all ]]; then
  timeout ${BENCH_TIMEOUT:-300} python3 -m torch_sdcp.bench --world-size "$world" --out "$OUT/bench" ${BENCH_ARGS:-} \
    2>&1 | tee "$OUT/bench.log" | tail -60
  timeout ${BENCH_TIMEOUT:-300} python3 -m torch_sdcp.bench --world-size "$world" --boundaries decode --sparse \
    --out "$OUT/bench-sparse" 2>&1 | tee "$OUT/bench-sparse.log" | tail -8
fi
if [[ $what == onegpu ]]; then
  failed=0
  for pdl in ${ONEGPU_PDL:-on off}; do
    case $pdl in
      on) sdcp_pdl=1 suffix= ;;
      off) sdcp_pdl=0 suffix=-nopdl ;;
      *) echo "ONEGPU_PDL: expected words 'on' or 'off', got '$pdl'"; exit 2 ;;
    esac
    for n in ${ONEGPU_WORLDS:-1 2 4 8}; do
      run=onegpu-$n$suffix
      SDCP_PDL=$sdcp_pdl timeout ${ONEGPU_TIMEOUT:-240} python3 -m torch_sdcp.bench --one-gpu "$n" \
        --rows "${ONEGPU_ROWS:-1,32,128}" --out "$OUT/$run" ${ONEGPU_ARGS:-} > "$OUT/$run.log" 2>&1
      rc=$?
      if [[ -f $OUT/$run/tables.txt ]]; then cat "$OUT/$run/tables.txt"; else tail -20 "$OUT/$run.log"; fi
      [[ $rc == 0 ]] || { echo "onegpu N=$n PDL $pdl: exit $rc (log: $OUT/$run.log)"; failed=1; }
    done
  done
  exit $failed
fi
if [[ $what == stress ]]; then
  python3 tools/stress.py --rounds "${STRESS_ROUNDS:-2}" --parallel "${STRESS_PARALLEL:-6}" \
    --timeout "${STRESS_TIMEOUT:-270}" -m gpu --out "$OUT/stress.json" 2>&1 | tee "$OUT/stress.log" | tail -40
  exit "${PIPESTATUS[0]}"
fi
