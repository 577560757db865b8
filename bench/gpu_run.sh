#!/usr/bin/env bash
# The GPU session's commands, in one place (the device runs this from the repo root).
# usage: bash bench/gpu_run.sh tests|bench|all   (OUT must name a writable folder)
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers, pytest; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__, 'pytest', pytest.__version__)"
case "${1:-tests}" in
  all)
    bash "$0" tests
    bash "$0" bench
    ;;
  tests)
    python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py tests/test_cuda_memory.py 2>&1 | tee "$OUT/gpu-tests.log"
    python3 -m colo.cli demo --device cuda --steps 8 --quiet --trace "$OUT/gpu-demo.jsonl" 2>&1 | tee "$OUT/gpu-demo.log"
    python3 -m colo.cli replay "$OUT/gpu-demo.jsonl" | tail -5
    ;;
  bench)
    python3 -m colo.apps.bench_gpu "$OUT/bench-gpu.json" 2>&1 | tee "$OUT/bench-gpu.log"
    ;;
esac
