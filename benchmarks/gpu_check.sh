#!/usr/bin/env bash
# GPU checks of the CUDA backends, as one script that finishes within 8 minutes on one H200:
#   1. the full conformance suite for cuda-triton and for cuda-native (tables);
#   2. decode-attention bandwidth (batch 64 x context 4096, head 128, GQA 8:1, bf16, block 16)
#      next to the device's copy bandwidth and torch SDPA on a contiguous cache;
#   3. end-to-end output tokens/s on a ~1B random-weight Llama vs transformers generate;
#   4. with two or more GPUs: the conformance engine rows at tensor-parallel size 2 (NCCL).
#
#   bash benchmarks/gpu_check.sh
#
# Needs python3 with a CUDA torch, triton, transformers and nvcc. Packages missing there
# (msgspec and pyzmq on this project's GPU machines) can be put as wheels in .whl/:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     -d .whl msgspec pyzmq
set -uo pipefail
cd "$(dirname "$0")/.."
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/pagedllm-site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/pagedllm-site${PYTHONPATH:+:$PYTHONPATH}
fi
# the checkout is the package: make it importable as `pagedllm` without installing it
mkdir -p /tmp/pagedllm-pkg && ln -sfn "$PWD" /tmp/pagedllm-pkg/pagedllm
export PYTHONPATH=/tmp/pagedllm-pkg:${PYTHONPATH:-}
export PYTHONUNBUFFERED=1

date -u +"%Y-%m-%d %H:%M UTC"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, '| triton', triton.__version__, '| transformers', transformers.__version__)"
status=0
for backend in cuda-triton cuda-native; do
  echo; echo "== conformance --backend $backend"
  timeout 170 python3 -m pagedllm.entrypoints.cli conformance --backend "$backend" || status=1
done
echo; echo "== decode attention bandwidth"
timeout 60 python3 -m pagedllm.benchmarks.gpu_decode_bandwidth || status=1
echo; echo "== end to end (--backend cuda)"
timeout 180 python3 -m pagedllm.benchmarks.gpu_end_to_end || status=1
if [ "$(nvidia-smi -L 2>/dev/null | wc -l)" -ge 2 ]; then
  echo; echo "== tensor parallel: the engine rows at 2 ranks (NCCL) against one"
  timeout 240 python3 -m pagedllm.entrypoints.cli conformance --backend cuda --quick --tensor-parallel-size 2 || status=1
else
  echo; echo "== tensor parallel: skipped (one GPU here)"
fi
exit $status
