"""GPU-only end-to-end tests: the device path, two GPUs, tune on a GPU (bench/gpu_run.sh runs them there)."""
