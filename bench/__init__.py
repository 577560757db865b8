"""Research harnesses beside the package: the GPU sync benchmark against its limits and
checkpoint-engine, the multi-GPU benchmark, probes and timelines (run from the repo root:
``python -m bench.gpu_sync``). They use colo's public modules; the package never imports them."""
