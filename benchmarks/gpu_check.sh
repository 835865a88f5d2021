#!/usr/bin/env bash
# GPU checks of the CUDA backends, as one script that finishes within 7 minutes on one H200,
# one line per step — `STEP name: PASS | FAIL(rc) | TIMEOUT in N s` — and a summary; logs and
# JSON under $OUT (default ./gpu-check-out):
#   preflight         versions of Python, torch and its CUDA, Triton, transformers, nvcc, ninja,
#                     gcc and the driver; stops here when something needed is missing
#   build-native      the cuda-native extension (verbose), in parallel with the next step
#   ops-cuda-triton   op checks, quick grid, CUDA_LAUNCH_BLOCKING=1 (rows print as they finish)
#   ops-cuda-native   the same
#   engine-*          the whole quick suite per backend, CUDA graphs strict (a failed capture fails)
#   bandwidth         decode attention against the copy bandwidth, error-checked per backend
#                     (cuda-triton at each decode tile x warps of benchmarks/kernel_registers.py)
#                     (cuda-triton at each decode tile x warps of benchmarks/kernel_registers.py)
#   end-to-end        output tokens/s on a random-weight Llama vs transformers generate
#   tp2               with two or more GPUs: the engine rows at tensor-parallel size 2 (NCCL)
#
#   bash benchmarks/gpu_check.sh [--smoke]
#
# --smoke: the CPU parts only (preflight without a GPU, the two benchmark scripts on tiny shapes
# through Triton's interpreter), so CI runs the script itself. Packages missing on the GPU
# machine (msgspec, pyzmq) can be put as wheels in .whl/; only those for this Python are used.
set -uo pipefail
cd "$(dirname "$0")/.."
SMOKE=0
[ "${1:-}" = "--smoke" ] && SMOKE=1
OUT=${OUT:-$PWD/gpu-check-out}
mkdir -p "$OUT"
: >"$OUT/steps.txt"
export PYTHONUNBUFFERED=1
PY=python3

tag=$($PY -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
wheels=$(compgen -G ".whl/*-${tag}-*.whl" || true)
if [ -n "$wheels" ]; then
  # shellcheck disable=SC2086
  $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/pagedllm-site $wheels \
    && export PYTHONPATH=/tmp/pagedllm-site${PYTHONPATH:+:$PYTHONPATH}
elif compgen -G ".whl/*.whl" >/dev/null; then
  echo "note: .whl/ has no wheels for $tag; using what this Python has"
fi
# the checkout is the package: importable as `pagedllm` without installing it
mkdir -p /tmp/pagedllm-pkg && ln -sfn "$PWD" /tmp/pagedllm-pkg/pagedllm
export PYTHONPATH=/tmp/pagedllm-pkg:${PYTHONPATH:-}

failed=0
verdict() { # rc seconds name
  local v
  if [ "$1" -eq 0 ]; then v=PASS; elif [ "$1" -eq 124 ] || [ "$1" -eq 137 ]; then v=TIMEOUT; else v="FAIL($1)"; fi
  [ "$v" = PASS ] || failed=1
  echo "STEP $3: $v in $2 s" | tee -a "$OUT/steps.txt"
}
step() { # name timeout command...: runs in the foreground, output shown and logged
  local name=$1 limit=$2 t0=$SECONDS
  shift 2
  echo "== $name (at most ${limit} s; log: $OUT/$name.log)"
  timeout -k 5 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
  verdict "${PIPESTATUS[0]}" $((SECONDS - t0)) "$name"
}

date -u +"%Y-%m-%d %H:%M UTC"
step preflight 30 $PY -m pagedllm.benchmarks.gpu_preflight "$SMOKE"
if [ "$failed" -ne 0 ]; then
  echo "stopping: the preflight failed"
  exit 1
fi

if [ "$SMOKE" -eq 1 ]; then
  step bandwidth 120 $PY -m pagedllm.benchmarks.gpu_decode_bandwidth --smoke
  step end-to-end 120 $PY -m pagedllm.benchmarks.gpu_end_to_end --smoke
else
  # a build killed by a timeout leaves torch's lock file, and every later load waits on it
  find "${PAGEDLLM_CACHE:-$HOME/.cache/pagedllm}/cuda_native" -name lock -delete 2>/dev/null
  build_start=$SECONDS
  (timeout -k 5 110 env PAGEDLLM_BUILD_VERBOSE=1 $PY -c \
    "from pagedllm.backends.cuda_native.build import load_extension; load_extension(); print('built')" \
    >"$OUT/build-native.log" 2>&1) &
  build_pid=$!
  echo "== build-native in the background (log: $OUT/build-native.log)"
  step ops-cuda-triton 100 env CUDA_LAUNCH_BLOCKING=1 $PY -m pagedllm.cli conformance \
    --backend cuda-triton --ops-only --quick --json "$OUT/ops-cuda-triton.json"
  wait "$build_pid"
  verdict $? $((SECONDS - build_start)) build-native
  tail -3 "$OUT/build-native.log"
  step ops-cuda-native 30 env CUDA_LAUNCH_BLOCKING=1 $PY -m pagedllm.cli conformance \
    --backend cuda-native --ops-only --quick --json "$OUT/ops-cuda-native.json"
  for backend in cuda-triton cuda-native; do  # the speed tier at its full shapes: decode against the bandwidth
    step "perf-$backend" 30 $PY -m pagedllm.cli conformance --backend "$backend" --perf-only \
      --json "$OUT/perf-$backend.json"
  done
  for backend in cuda-triton cuda-native; do
    step "engine-$backend" 60 env PAGEDLLM_STRICT_GRAPHS=1 PAGEDLLM_LOG_LEVEL=INFO $PY -m pagedllm.cli \
      conformance --backend "$backend" --quick --json "$OUT/engine-$backend.json"
  done
  step bandwidth 60 $PY -m pagedllm.benchmarks.gpu_decode_bandwidth  # cuda-triton: six decode configs
  step end-to-end 50 $PY -m pagedllm.benchmarks.gpu_end_to_end
  if [ "$(nvidia-smi -L 2>/dev/null | wc -l)" -ge 2 ]; then
    step tp2 50 $PY -m pagedllm.cli conformance --backend cuda --quick --tensor-parallel-size 2
  else
    echo "STEP tp2: SKIPPED (one GPU)" | tee -a "$OUT/steps.txt"
  fi
fi
echo
echo "== summary"
cat "$OUT/steps.txt"
exit $failed
