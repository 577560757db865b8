#!/usr/bin/env bash
# The GPU session's commands, in one place (the device runs this from the repo root).
# usage: bash bench/gpu_run.sh tests|call71a [S] [S] [S]|call71b [S] [S] [S]|call71c [S]|call70e [S]|call70d [S] [S]|call70c [S] [S]|call70b [S]|call70a [S]|call69c [S] [S]|call69b [S] [S]|call69a [S] [S]|call68f [S] [S]|call68e [S]|call68d [S]|call68c [S] [S] [S]|call68b [S] [S] [S]|call68a [S]|call67e [S]|call67d [S]|call67c [S]|call67a [S] [S]|call67b [TRAINER] [S]|call65a [S] [S]|call65b [S] [S]|gpu1 [S]|gpu1rest [S]|call63c [S] [S]|call63a [S]|call53a TRAINER [S]|call52a [S]|call51c [S] [S] [S]|call51a TRAINER [S]|call51b [S] [S]|call50e [S]|call50d [S] [S] [S]|call50c [S]|call50b [S] [S]|call50a [S] [S]|call49a [S] [S]|call49b [S] [S]|call49c [S] [S]|call49d [S]|savercopy [MODEL] [S]|baseline44 [S]|call44a [S]|call44b [S]|call44c [S] [S]|call44d [S]|call45a [S] [S]|call45b [S]|call45c [S] [S]|call46a [S] [S]|call46b [S] [S]|call46c [S] [S] [S]|call46d [S] [S]|call44e [S] [S]|collcost [S]|call48d [S]|call48c [S] [S] [S]|call48b [S] [S]|call48a [S]|call47a [S] [S] [S]|call47b [S] [S] [TRAINERS]|trainer7b TRAINER [S]|profile44 [MODEL] [S] [TRAINERS]|session5 [S] [S]|session6 [S] [S] [S]|issue31 [SECONDS]|megatron31 [SECONDS]|trainers|trainer-syncs|colo-bench-trainers [MODEL]|verify|colo-bench|small|demos|bench|peer|multi|race34|issue34|bench34|bench2|moe2 [LAYERS]|bench8|tune|tune-test|lora43 [S] [S]|lora43b [S] [S]|lora43c [S] [S]|all   (OUT must name a writable folder)
# The wheels the GPU image lacks travel in .whl/ (structlog, pytest-asyncio,
# torch-memory-saver 0.0.10, megatron-core 0.16.1, and for the benchmark's peer
# checkpoint-engine 0.4.2 with what it imports: loguru, pyzmq, pydantic, fastapi 0.120,
# starlette, httpx; see the README).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers, pytest; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__, 'pytest', pytest.__version__)"

profiled_rows() {  # profiled_rows LIMIT: every real trainer's rows at Qwen2-1.5B, each trainer's child profiling
  # one more plain sync per plan (COLO_BENCH_PROFILE), their sync-first tables in profiles.txt
  rm -rf /tmp/prof
  COLO_BENCH_PROFILE=/tmp/prof timeout "$1" python3 -m colo.cli bench --device cuda --model qwen2-1.5b \
    --transports packed --trainers hf,fsdp,megatron --reps 3 --out "$OUT/colo-bench-trainers-1.5b.json" 2>&1 \
    | tee "$OUT/trainers.log" | tail -12
  for f in /tmp/prof/*sync-first.txt; do
    [ -f "$f" ] && { echo "== $f"; sed -n 1,30p "$f" | cut -c1-200; } >> "$OUT/profiles.txt"
  done
}

gpu_tests() {  # gpu_tests LIMIT TEST...: the GPU tests named, under a limit; their log in gpu-tests.log
  local limit=$1; shift
  timeout "$limit" python3 -m pytest -q -p no:cacheprovider -m gpu -rf --tb=short "$@" 2>&1 \
    | tee "$OUT/gpu-tests.log" | tail -8
}

demo() {  # demo NAME ARGS...: one run of the demo on CUDA, its trace replayed
  local name=$1; shift
  # one log for every demo: the device returns at most 8 files
  python3 -m colo.cli demo --device cuda --quiet --trace "$OUT/$name.jsonl" "$@" > /tmp/demo.log 2>&1
  local code=$?
  { echo "== demo $name ($*): exit $code"; cat /tmp/demo.log; } >> "$OUT/demos.log"
  echo "demo $name: exit $code; $(grep -c '"sync.finished"' "$OUT/$name.jsonl") verified syncs; $(grep -E 'FAILED|mean reward' /tmp/demo.log | tail -1)"
  python3 -m colo.cli replay "$OUT/$name.jsonl" | tail -1
}

gpu2_suite() {  # gpu2_suite LIMIT: every gpu2 test of the repository whole, three at a time, timed; gpu2-tests.log
  local par t0
  par=$(python3 -c "import xdist" 2>/dev/null && echo "-n 3")
  t0=$(date +%s)
  timeout "$1" python3 -m pytest -v -p no:cacheprovider -m gpu2 $par --timeout=240 --durations=20 \
    --continue-on-collection-errors tests 2>&1 | tee "$OUT/gpu2-tests.log" \
    | grep -E "PASSED|FAILED|ERROR|passed|failed|s call" | tail -30
  echo "pytest -m gpu2: exit ${PIPESTATUS[0]} after $(( $(date +%s) - t0 )) s" | tee -a "$OUT/gpu2-tests.log"
}

tp2_rows() {  # tp2_rows LIMIT: Qwen2-7B at TP=2, every row of the synthetic layout; bench-gpu2.json and .log
  timeout "$1" python3 -m bench.multi_gpu --device cuda --gpus 2 --model qwen2-7b \
    --out "$OUT/bench-gpu2.json" 2>&1 | tee "$OUT/bench-gpu2.log" | grep -v '^{' | tail -14
}

tp2_megatron_rows() {  # tp2_megatron_rows LIMIT [ARGS...]: the same with colo's real megatron-core trainer, its packed rows
  local limit=$1; shift
  timeout "$limit" python3 -m bench.multi_gpu --device cuda --gpus 2 --model qwen2-7b --trainer megatron \
    --rows colo-packed,colo-packed-serial "$@" --out "$OUT/bench-gpu2-megatron.json" 2>&1 \
    | tee "$OUT/bench-gpu2-megatron.log" | grep -v '^{' | grep -iv warn | tail -12
}

engine_rows() {  # engine_rows JSON: each trainer row's stages and the engine's account of each cycle (ms)
  [ -f "$1" ] || return 0
  python3 -c "
import json, sys
for t in json.load(open(sys.argv[1]))['trainers']:
    for r in t['rows']:
        ms = lambda d: {k: round(v * 1e3, 2) for k, v in d.items()}
        print(t['trainer'], r['plan'], 'sync', [round(x * 1e3, 2) for x in r['sync_s_all']], 'stages', ms(r['stage_s']))
        for c in r.get('engine_s_all', []):
            print('   engine', ms(c))
" "$1"
}
offload_rows() {  # offload_rows JSON: each row's plain pause, verified offloads and what verification adds (ms)
  [ -f "$1" ] || return 0
  python3 -c "
import json, sys
for t in json.load(open(sys.argv[1]))['trainers']:
    for r in t['rows']:
        print(t['trainer'], r['plan'], 'pause', round(r['step_s'].get('trainer_pause_s', 0) * 1e3, 1), 'verified offload',
              [round(x * 1e3, 1) for x in r.get('trainer_offload_verified_s_all', [])], 'adds',
              round(r.get('offload_verify_adds_s', 0) * 1e3, 1), 'sync adds', round(r.get('verify_adds_s', 0) * 1e3, 2),
              'beside', r.get('digest_beside_offload'), 'engine digest', r.get('verify_parts', {}).get('engine_digest_s'))
" "$1"
}
pause_rows() {  # pause_rows JSON: each row's pause and onload by tag and part (ms), each against the link
  [ -f "$1" ] || return 0
  python3 -c "
import json, sys
for t in json.load(open(sys.argv[1]))['trainers']:
    for r in t['rows']:
        ms = lambda d: {k: round(v * 1e3, 1) for k, v in d.items()}
        print(t['trainer'], r['plan'], 'pause', ms(r.get('trainer_pause_parts_s', {})), 'onload',
              ms(r.get('trainer_onload_parts_s', {})))
        print('   of link', {k: round(v['of_link'], 3) for k, v in r.get('trainer_rates', {}).items()})
" "$1"
}
trainer_bench() {  # trainer_bench MODEL TRAINERS REPS LIMIT NAME: colo bench's real-trainer rows into
  # colo-bench-trainers-NAME.json and trainers-NAME.log, then each row's sync-first engine account, offloads and pauses
  local json="$OUT/colo-bench-trainers-$5.json"
  timeout "$4" python3 -m colo.cli bench --device cuda --model "$1" --transports packed --trainers "$2" \
    --reps "$3" --out "$json" 2>&1 | tee "$OUT/trainers-$5.log" | grep -E "^\| $1 \| |retain"
  engine_rows "$json" | grep -E "sync-first" | cut -c1-300
  offload_rows "$json"
  pause_rows "$json"
}

settled_rows() {  # settled_rows TRAINER LIMIT: the trainer's Qwen2-7B rows with one second between the engine's
  # wake-up and each sync (COLO_BENCH_SETTLE_S), each cycle's engine account
  COLO_BENCH_SETTLE_S=1 timeout "$2" python3 -m colo.cli bench --device cuda --model qwen2-7b \
    --transports packed --trainers "$1" --reps 3 --out "$OUT/colo-bench-trainers-7b-$1-settled.json" 2>&1 \
    | tee "$OUT/trainers-7b-$1-settled.log" | grep -E "^\| qwen2-7b \| "
  engine_rows "$OUT/colo-bench-trainers-7b-$1-settled.json"
}
ab_base() {  # ab_base TGZ: this tree's bench and colo copied to /tmp/base, TGZ's files over them (an A/B's "before")
  rm -rf /tmp/base && mkdir -p /tmp/base && cp -r bench colo /tmp/base/ && tar xzf "$1" -C /tmp/base
}

ab_rows() {  # ab_rows DIR LABEL LIMIT [ARGS...]: Qwen2-7B at TP=2, the synthetic layout's colo-packed rows with the
  # package in DIR (this tree, or /tmp/base), into ab-LABEL.json; every run's output in ab.log
  local dir=$1 label=$2 limit=$3; shift 3
  echo "== $label" | tee -a "$OUT/ab.log"
  (cd "$dir" && PYTHONPATH=/tmp/site:$dir timeout "$limit" python3 -m bench.multi_gpu --device cuda --gpus 2 \
    --model qwen2-7b --rows colo-packed "$@" --out "$OUT/ab-$label.json" 2>&1 | tee -a "$OUT/ab.log" \
    | grep -E "^\| (sync|offload)-first|^limits|^floors")
}

collcost_runs() {  # collcost_runs LIMIT: what one all-gather costs the host (bench/collective_cost.py: torch.distributed's
  # call, a coalesced one of 8 outputs, the process group's own), as torch.distributed is set up by default, with its
  # flight recorder off, and that without recordStream; about 20 s each; collcost-*.json and collcost.log
  local env name vars
  for env in "default" "TORCH_FR_BUFFER_SIZE=0" "TORCH_FR_BUFFER_SIZE=0 TORCH_NCCL_AVOID_RECORD_STREAMS=1"; do
    name=$(echo "$env" | tr ' =' '-_')
    echo "== $env" | tee -a "$OUT/collcost.log"
    vars=""; [ "$env" = default ] || vars="$env"
    env $vars timeout "$1" python3 -m bench.collective_cost "$OUT/collcost-$name.json" --device cuda \
      2>&1 | tee -a "$OUT/collcost.log"
  done
}

case "${1:-tests}" in
  call71a)  # issue 46, 2026-12-01 (twenty-first session), two GPUs: every gpu2 test with each Megatron rank sending its
    # engine rank its own slices (no gather; limit: arg 2), then Qwen2-7B at TP=2, colo-packed beside slime-style at
    # 1024 and 2048 MiB (limit: arg 3 each), then colo's real megatron-core trainer at 2048 MiB (limit: arg 4)
    gpu2_suite "${2:-240}"
    for size in 1024 2048; do
      echo "== bucket $size MiB" | tee -a "$OUT/multi-sync-2x-qwen2-7b-own-slices.log"
      timeout "${3:-150}" python3 -m bench.multi_gpu --device cuda --gpus 2 --model qwen2-7b --bucket-mib "$size" \
        --rows colo-packed,slime-style --out "$OUT/multi-sync-2x-qwen2-7b-own-slices-bucket$size.json" 2>&1 \
        | tee -a "$OUT/multi-sync-2x-qwen2-7b-own-slices.log" | grep -E "^\| (sync|offload)-first|^limits|^floors|^target"
    done
    tp2_megatron_rows "${4:-170}" --bucket-mib 2048
    ;;
  call71c)  # issue 46, 2026-12-01 (twenty-first session), one GPU: each rank's own slices extracted on the device and
    # uploaded from pinned host memory (two ranks sharing the GPU: nothing of it is a collective), against the CPU's,
    # and the extractor's upload-stream test (limit: arg 2)
    t0=$(date +%s)
    timeout "${2:-200}" python3 -m pytest -v -p no:cacheprovider -m gpu --durations=10 tests/gpu/test_tp_slices_cuda.py \
      "tests/extractors/test_megatron.py::test_an_upload_from_pinned_host_runs_on_its_stream_and_the_callers_stream_waits_for_it" \
      2>&1 | tee "$OUT/gpu-tp-slices.log" | grep -E "PASSED|FAILED|ERROR|passed|failed|s call|^E " | head -30
    echo "pytest: exit ${PIPESTATUS[0]} after $(( $(date +%s) - t0 )) s" | tee -a "$OUT/gpu-tp-slices.log"
    ;;
  call71b)  # issue 46, 2026-12-01 (twenty-first session), four GPUs: every gpu4 test (limit: arg 2), then the whole
    # Qwen3-30B-A3B shape (48 layers, 128 experts, 61 GB bf16; trainer TP=4 + EP=4, engine TP-MoE over 4; attention,
    # embedding and lm_head as each rank's own slice, experts by all_to_all) at 1024 MiB buckets, one rep (limit: arg 3),
    # then Qwen2-7B at TP=4 (limit: arg 4)
    t0=$(date +%s)
    timeout "${2:-200}" python3 -m pytest -v -p no:cacheprovider -m gpu4 --timeout=180 --durations=10 \
      tests/bench/test_multi_gpu.py 2>&1 | tee "$OUT/gpu4-tests.log" | grep -E "PASSED|FAILED|ERROR|passed|failed|s call"
    echo "pytest -m gpu4: exit ${PIPESTATUS[0]} after $(( $(date +%s) - t0 )) s" | tee -a "$OUT/gpu4-tests.log"
    timeout "${3:-300}" python3 -m bench.multi_gpu --device cuda --gpus 4 --model qwen3-30b-a3b --reps 1 \
      --bucket-mib 1024 --out "$OUT/multi-sync-4x-qwen3-30b-a3b-own-slices.json" 2>&1 \
      | tee "$OUT/multi-sync-4x-qwen3-30b-a3b-own-slices.log" | grep -v '^{' | tail -16
    timeout "${4:-150}" python3 -m bench.multi_gpu --device cuda --gpus 4 --model qwen2-7b --bucket-mib 1024 \
      --rows colo-packed,slime-style --out "$OUT/multi-sync-4x-qwen2-7b-own-slices.json" 2>&1 \
      | tee "$OUT/multi-sync-4x-qwen2-7b-own-slices.log" | grep -v '^{' | tail -14
    ;;
  call70e)  # issue 44, 2026-12-01 (twentieth session), one GPU: hf's and fsdp's rows at Qwen2-1.5B, three reps, each
    # pause by tag and part (where 0.936-0.951 of the link goes at 1.5B; limit: arg 2)
    trainer_bench qwen2-1.5b hf,fsdp 3 "${2:-170}" 1.5b
    ;;
  call70d)  # issue 44, 2026-12-01 (twentieth session), one GPU: the GPU test of a real trainer's pause (each pause now
    # timed by tag and part) with pytest's exit and time (limit: arg 2); fsdp's rows at Qwen2-7B with the nineteenth
    # session's code, three reps (call70a's limit ended it after hf's; arg 3)
    t0=$(date +%s)
    timeout "${2:-120}" python3 -m pytest -q -p no:cacheprovider -m gpu -rf --tb=short --durations=4 \
      tests/gpu/test_real_trainers.py::test_a_trainer_pauses_and_resumes_exactly_its_tags_with_the_parameters_in_place \
      2>&1 | tee "$OUT/gpu-tests.log" | tail -8
    echo "GPU tests: exit ${PIPESTATUS[0]} after $(( $(date +%s) - t0 )) s" | tee -a "$OUT/gpu-tests.log"
    trainer_bench qwen2-7b fsdp 3 "${3:-400}" 7b-fsdp
    ;;
  call70b)  # issue 44, 2026-12-01 (twentieth session), one GPU: Megatron's rows at Qwen2-7B with the nineteenth
    # session's code, three reps, each pause and onload by tag and part (TrainerMemory.last_pause_s; limit: arg 2)
    trainer_bench qwen2-7b megatron 3 "${2:-450}" 7b-megatron
    ;;
  call70c)  # issue 44, 2026-12-01 (twentieth session), one GPU: the GPU tests of a real trainer's pause and of the flat
    # weights' (each pause now timed by tag and part) with pytest's exit and time (limit: arg 2); every real trainer's
    # rows at Qwen2-1.5B, five reps (three did not settle a 5 % target), each pause by tag and part (arg 3)
    t0=$(date +%s)
    timeout "${2:-150}" python3 -m pytest -q -p no:cacheprovider -m gpu -rf --tb=short --durations=8 \
      tests/gpu/test_real_trainers.py::test_a_trainer_pauses_and_resumes_exactly_its_tags_with_the_parameters_in_place \
      tests/device/test_one_copy.py 2>&1 | tee "$OUT/gpu-tests.log" | tail -14
    echo "GPU tests: exit ${PIPESTATUS[0]} after $(( $(date +%s) - t0 )) s" | tee -a "$OUT/gpu-tests.log"
    trainer_bench qwen2-1.5b hf,fsdp,megatron 5 "${3:-330}" 1.5b
    ;;
  call70a)  # issue 44, 2026-12-01 (twentieth session), one GPU: hf's and fsdp's rows at Qwen2-7B with the code of
    # the nineteenth session (a sync-first sync's engine digest beside the trainer's offload, the offload's checks on
    # a stream of their own), not measured at 7B yet; one bench process for both, three reps (limit: arg 2)
    trainer_bench qwen2-7b hf,fsdp 3 "${2:-560}" 7b-hf-fsdp
    ;;
  call69b)  # issue 44, 2026-12-01 (nineteenth session), one GPU: a sync-first sync's engine digest taken beside the
    # trainer's offload (EngineClient.live_digest) and the offload's checks beside the optimizer state's pause: the
    # GPU tests of both (the demos of every plan, the recovery's probe, a real trainer's overlapped offload) with
    # pytest's exit and time (limit: arg 2); every real trainer's rows at Qwen2-1.5B, three reps (arg 3)
    t0=$(date +%s)
    timeout "${2:-200}" python3 -m pytest -q -p no:cacheprovider -m gpu -rf --tb=short --durations=8 \
      tests/gpu/test_real_trainers.py::test_a_trainer_pauses_and_resumes_exactly_its_tags_with_the_parameters_in_place \
      tests/gpu/test_one_gpu.py -k "recovers_a_failed_sync or pauses_and_resumes or runs_each_plan" \
      2>&1 | tee "$OUT/gpu-tests.log" | tail -14
    echo "GPU tests: exit ${PIPESTATUS[0]} after $(( $(date +%s) - t0 )) s" | tee -a "$OUT/gpu-tests.log"
    timeout "${3:-280}" python3 -m colo.cli bench --device cuda --model qwen2-1.5b \
      --transports packed --trainers hf,fsdp,megatron --reps 3 --out "$OUT/colo-bench-trainers-1.5b.json" 2>&1 \
      | tee "$OUT/trainers.log" | grep -E "^\| qwen2-1.5b \| |retain"
    engine_rows "$OUT/colo-bench-trainers-1.5b.json" | grep -E "sync-first" | cut -c1-300
    offload_rows "$OUT/colo-bench-trainers-1.5b.json"
    ;;
  call69c)  # issue 44, 2026-12-01 (nineteenth session), one GPU: the rest of the one-GPU tests call69b's change
    # reaches (every framework trainer's demo in both plans, one bucket, the one-rank one-copy syncs over four steps,
    # fifty syncs' memory, the one-copy handoff) and a real trainer's offload with its checks on their own stream, with
    # pytest's exit and time (limit: arg 2); hf's and Megatron's rows at Qwen2-1.5B, three reps (arg 3)
    t0=$(date +%s)
    timeout "${2:-400}" python3 -m pytest -q -p no:cacheprovider -m gpu -rf --tb=short --durations=12 \
      tests/gpu/test_one_gpu.py tests/gpu/test_real_trainers.py tests/device/test_one_copy.py \
      -k "each_framework_trainer or one_bucket or one_rank_trainers_one_copy or fifty_syncs or test_one_copy or pauses_and_resumes" \
      2>&1 | tee "$OUT/gpu-tests.log" | tail -20
    echo "GPU tests: exit ${PIPESTATUS[0]} after $(( $(date +%s) - t0 )) s" | tee -a "$OUT/gpu-tests.log"
    timeout "${3:-170}" python3 -m colo.cli bench --device cuda --model qwen2-1.5b \
      --transports packed --trainers hf,megatron --reps 3 --out "$OUT/colo-bench-trainers-1.5b.json" 2>&1 \
      | tee "$OUT/trainers.log" | grep -E "^\| qwen2-1.5b \| |retain"
    offload_rows "$OUT/colo-bench-trainers-1.5b.json"
    ;;
  call69a)  # issue 44, 2026-12-01 (nineteenth session), one GPU: the GPU tests of the probe's reference taken only
    # where a probe may read it (a real trainer's want_reference, a recovery's probe in both plans) with pytest's
    # exit and time (limit: arg 2); every real trainer's rows at Qwen2-1.5B, three reps after two warm-ups, ten more
    # syncs per plan under cProfile (COLO_BENCH_PYPROFILE), the profiles in pyprofiles.tgz (arg 3)
    t0=$(date +%s)
    timeout "${2:-200}" python3 -m pytest -q -p no:cacheprovider -m gpu -rf --tb=short --durations=8 \
      tests/gpu/test_real_trainers.py::test_a_trainer_pauses_and_resumes_exactly_its_tags_with_the_parameters_in_place \
      tests/gpu/test_one_gpu.py -k "recovers_a_failed_sync or pauses_and_resumes or runs_each_plan" \
      2>&1 | tee "$OUT/gpu-tests.log" | tail -14
    echo "GPU tests: exit ${PIPESTATUS[0]} after $(( $(date +%s) - t0 )) s" | tee -a "$OUT/gpu-tests.log"
    rm -rf /tmp/py
    COLO_BENCH_PYPROFILE=/tmp/py timeout "${3:-330}" python3 -m colo.cli bench --device cuda --model qwen2-1.5b \
      --transports packed --trainers hf,fsdp,megatron --reps 3 --out "$OUT/colo-bench-trainers-1.5b.json" 2>&1 \
      | tee "$OUT/trainers.log" | grep -E "^\| qwen2-1.5b \| |retain"
    engine_rows "$OUT/colo-bench-trainers-1.5b.json" | grep -E "sync-first" | cut -c1-300
    python3 -c "
import json, sys
for t in json.load(open(sys.argv[1]))['trainers']:
    for r in t['rows']:
        print(t['trainer'], r['plan'], 'pause', round(r['step_s'].get('trainer_pause_s', 0) * 1e3, 1), 'verified offload',
              [round(x * 1e3, 1) for x in r.get('trainer_offload_verified_s_all', [])], 'adds', round(r.get('offload_verify_adds_s', 0) * 1e3, 1))
" "$OUT/colo-bench-trainers-1.5b.json" 2>/dev/null
    [ -d /tmp/py ] && tar czf "$OUT/pyprofiles.tgz" -C /tmp py && grep -A22 "== by tottime" /tmp/py/pysync-hf-*sync-first.txt | cut -c1-160
    ;;
  call68d)  # 2026-12-01 (eighteenth session), two GPUs: every gpu2 test with the copying kernel's relative table
    # (16-byte units, a plan's table uploaded once) (limit: arg 2)
    gpu2_suite "${2:-240}"
    ;;
  call68c)  # issue 44, 2026-12-01 (eighteenth session), one GPU: a plan's copying-kernel table made and uploaded once
    # (PlannedCopies: sources as offsets from each sync's buffer; call68b's planned loads spent 0.4-0.7 ms laying and
    # uploading it, the device idle) beside the table laid at each launch, by bench/copy_kernel.py (limit: arg 2);
    # the one-GPU tests of the device digest, the demos and the one-copy handoff, with pytest's exit and time (arg 3);
    # every real trainer's rows at Qwen2-1.5B, three reps (arg 4)
    timeout "${2:-120}" python3 -m bench.copy_kernel "$OUT/copy-kernel.json" 2>&1 | tee "$OUT/copy-kernel.log" \
      | grep -E "WRONG|one copy [0-9]|laid|planned" | grep -E "WRONG|2048 iters   64|one copy [0-9]"
    t0=$(date +%s)
    timeout "${3:-200}" python3 -m pytest -q -p no:cacheprovider -m gpu -rf --tb=short --durations=8 \
      tests/gpu/test_digest_cuda.py tests/gpu/test_one_gpu.py tests/device/test_one_copy.py \
      2>&1 | tee "$OUT/gpu-tests.log" | tail -14
    echo "GPU tests: exit ${PIPESTATUS[0]} after $(( $(date +%s) - t0 )) s" | tee -a "$OUT/gpu-tests.log"
    timeout "${4:-240}" python3 -m colo.cli bench --device cuda --model qwen2-1.5b --transports packed \
      --trainers hf,fsdp,megatron --reps 3 --out "$OUT/colo-bench-trainers-1.5b.json" 2>&1 | tee "$OUT/trainers.log" \
      | grep -E "^\| qwen2-1.5b \| |retain"
    engine_rows "$OUT/colo-bench-trainers-1.5b.json" | grep -E "sync-first|^   engine .*route_plan" | cut -c1-400
    ;;
  call68f)  # issue 44, 2026-12-01 (eighteenth session), one GPU: call68c's GPU tests cut at its 200 s limit after 40
    # passed (the device digest's whole, 34, first): the one-GPU tests that load through a plan's kept table (one
    # bucket, Megatron's strided runs, fifty syncs' memory) and the one-copy handoff's, with pytest's exit and time
    # (limit: arg 2); then Megatron's rows at Qwen2-7B, three reps (arg 3)
    t0=$(date +%s)
    timeout "${2:-180}" python3 -m pytest -q -p no:cacheprovider -m gpu -rf --tb=short --durations=8 \
      tests/gpu/test_one_gpu.py tests/device/test_one_copy.py \
      -k "one_bucket_verifies_every_sync or sync-first-megatron or fifty_syncs or test_one_copy" \
      2>&1 | tee "$OUT/gpu-tests.log" | tail -14
    echo "GPU tests: exit ${PIPESTATUS[0]} after $(( $(date +%s) - t0 )) s" | tee -a "$OUT/gpu-tests.log"
    timeout "${3:-300}" python3 -m colo.cli bench --device cuda --model qwen2-7b --transports packed \
      --trainers megatron --reps 3 --out "$OUT/colo-bench-trainers-7b-megatron.json" 2>&1 \
      | tee "$OUT/trainers-7b-megatron.log" | grep -E "^\| qwen2-7b \| |retain"
    engine_rows "$OUT/colo-bench-trainers-7b-megatron.json" | cut -c1-400
    ;;
  call68e)  # issue 44, 2026-12-01 (eighteenth session), one GPU: Megatron's and hf's rows at Qwen2-7B with call68c's
    # code, three reps (limit: arg 2 per trainer)
    for trainer in megatron hf; do
      timeout "${2:-280}" python3 -m colo.cli bench --device cuda --model qwen2-7b --transports packed \
        --trainers "$trainer" --reps 3 --out "$OUT/colo-bench-trainers-7b-$trainer.json" 2>&1 \
        | tee "$OUT/trainers-7b-$trainer.log" | grep -E "^\| qwen2-7b \| |retain"
      engine_rows "$OUT/colo-bench-trainers-7b-$trainer.json" | cut -c1-400
    done
    ;;
  call68b)  # issue 44, 2026-12-01 (eighteenth session), one GPU: the copying kernel of a one-copy load (2.2-2.8 ms
    # of device time at Qwen2-1.5B where one device copy is 1.46, call67d/call68a) swept by bench/copy_kernel.py over
    # launch shapes, in its 4-byte and its new 16-byte variant (limit: arg 2); the device digest's GPU tests with the
    # 16-byte variant (arg 3); every real trainer's rows at 1.5B, three reps, the 16-byte variant on (arg 4)
    timeout "${2:-150}" python3 -m bench.copy_kernel "$OUT/copy-kernel.json" 2>&1 | tee "$OUT/copy-kernel.log"
    t0=$(date +%s)
    timeout "${3:-150}" python3 -m pytest -q -p no:cacheprovider -m gpu -rf --tb=short tests/gpu/test_digest_cuda.py \
      2>&1 | tee "$OUT/gpu-tests.log" | tail -6
    echo "GPU tests: exit ${PIPESTATUS[0]} after $(( $(date +%s) - t0 )) s" | tee -a "$OUT/gpu-tests.log"
    timeout "${4:-300}" python3 -m colo.cli bench --device cuda --model qwen2-1.5b --transports packed \
      --trainers hf,fsdp,megatron --reps 3 --out "$OUT/colo-bench-trainers-1.5b.json" 2>&1 | tee "$OUT/trainers.log" \
      | grep -E "^qwen2-1.5b |^\| qwen2-1.5b \| |retain"
    engine_rows "$OUT/colo-bench-trainers-1.5b.json"
    ;;
  call68a)  # issue 44, 2026-12-01 (eighteenth session), one GPU: why Megatron's offload-first load keeps the engine's
    # device busy 61-64 ms at Qwen2-1.5B where hf's same bytes take 57-59 (call67d): hf's and Megatron's rows, one rep,
    # then one more plain sync per plan under torch.profiler in both processes (the engine's trace now recorded too),
    # each engine trace's device work summed by bench/device_trace.py (limit: arg 2)
    rm -rf /tmp/prof
    COLO_BENCH_PROFILE=/tmp/prof timeout "${2:-300}" python3 -m colo.cli bench --device cuda --model qwen2-1.5b \
      --transports packed --trainers hf,megatron --reps 1 --out "$OUT/colo-bench-trainers-profiled.json" 2>&1 \
      | tee "$OUT/trainers-profiled.log" | grep -E "^qwen2-1.5b |^\| qwen2-1.5b \| "
    python3 -m bench.device_trace /tmp/prof/*-engine.json --json "$OUT/engine-device-work.json" 2>&1 \
      | tee "$OUT/engine-device-work.log"
    tar czf "$OUT/profiles.tgz" -C /tmp prof
    ;;
  call67e)  # 2026-11-30 (seventeenth session), two GPUs: every gpu2 test with the engine's lanes read back in one copy
    # and the ring's table written by numpy (a TP engine's ranks each sum and read back their shards) (limit: arg 2)
    gpu2_suite "${2:-240}"
    ;;
  call67d)  # issue 44, 2026-11-30 (seventeenth session), one GPU: call67c's rows with the kernel table written into
    # the pinned ring by numpy instead of torch's copy_ (which splits a table above 32 K elements over the process's
    # OpenMP threads): the upload took 0.3-0.6 ms in most of call67a-c's planned loads and 3.2-3.7 ms in two of
    # call67b's three at 7B, the allocations beside it 0.01-0.02 ms, and keeping the allocator's segment (call67c)
    # changed neither (limit: arg 2)
    timeout "${2:-300}" python3 -m colo.cli bench --device cuda --model qwen2-1.5b --transports packed \
      --trainers hf,fsdp,megatron --reps 3 --out "$OUT/colo-bench-trainers-1.5b.json" 2>&1 | tee "$OUT/trainers.log" \
      | grep -E "^qwen2-1.5b |^\| qwen2-1.5b \| |retain"
    engine_rows "$OUT/colo-bench-trainers-1.5b.json"
    ;;
  call67c)  # issue 44, 2026-11-30 (seventeenth session), one GPU: call67a's rows again with one small allocation kept
    # on the device for the process (b978fb0's colo.digest._SMALL_SEGMENT, taken out again after call67b), so that the engine's release (empty_cache) no longer
    # costs the next load's first small allocations a new segment: call67a's planned loads spent 0.4-3.7 ms of their
    # 1.0-4.4 ms queueing in the table's upload, 0.02 ms in the allocation after it (limit: arg 2)
    timeout "${2:-300}" python3 -m colo.cli bench --device cuda --model qwen2-1.5b --transports packed \
      --trainers hf,fsdp,megatron --reps 3 --out "$OUT/colo-bench-trainers-1.5b.json" 2>&1 | tee "$OUT/trainers.log" \
      | grep -E "^qwen2-1.5b |^\| qwen2-1.5b \| |retain"
    engine_rows "$OUT/colo-bench-trainers-1.5b.json"
    ;;
  call67a)  # issue 44, 2026-11-30 (seventeenth session), one GPU: every real trainer at Qwen2-1.5B, 3 reps, with the
    # engine's end digest reading every group of lanes back in one copy, and each planned load's host time split
    # into its parts (route_plan_<part>_s: the table laid on the buffer, the launch's upload, scratch, kernel;
    # call66b's fsdp queued that launch 4.1-4.4 ms, call66a's 0.8-1.5) (limit: arg 2); then the device digest's
    # GPU tests with pytest's exit and time (limit: arg 3)
    timeout "${2:-420}" python3 -m colo.cli bench --device cuda --model qwen2-1.5b --transports packed \
      --trainers hf,fsdp,megatron --reps 3 --out "$OUT/colo-bench-trainers-1.5b.json" 2>&1 | tee "$OUT/trainers.log" \
      | grep -E "^qwen2-1.5b |^\| qwen2-1.5b \| |retain"
    engine_rows "$OUT/colo-bench-trainers-1.5b.json"
    t0=$(date +%s)
    timeout "${3:-200}" python3 -m pytest -q -p no:cacheprovider -m gpu -rf --tb=short tests/gpu/test_digest_cuda.py \
      2>&1 | tee "$OUT/gpu-tests.log" | tail -6
    echo "GPU tests: exit ${PIPESTATUS[0]} after $(( $(date +%s) - t0 )) s" | tee -a "$OUT/gpu-tests.log"
    ;;
  call67b)  # issue 44, 2026-11-30 (seventeenth session), one GPU: one real trainer's rows at Qwen2-7B (arg 2:
    # megatron, hf or fsdp), three reps, with call67a's code: what --verify every adds at 7B with one read-back
    # of the load's lanes (call66d: 0.051, the end's digest 2.8 ms) (limit: arg 3)
    timeout "${3:-420}" python3 -m colo.cli bench --device cuda --model qwen2-7b --transports packed \
      --trainers "${2:-megatron}" --reps 3 --out "$OUT/colo-bench-trainers-7b-${2:-megatron}.json" 2>&1 \
      | tee "$OUT/trainers-7b-${2:-megatron}.log" | grep -E "^qwen2-7b |^\| qwen2-7b \| |retain"
    engine_rows "$OUT/colo-bench-trainers-7b-${2:-megatron}.json"
    ;;
  call66e)  # 2026-11-30 (sixteenth session), two GPUs: every gpu2 test after the engine answers its digest with the
    # load's end (a TP engine's ranks each answer their shards' digest there; limit: arg 2)
    gpu2_suite "${2:-240}"
    ;;
  call66c)  # issue 44, 2026-11-30 (sixteenth session), one GPU: call66b's GPU tests whole (its 190 s limit cut them
    # after 33 of 41 passed, before pytest's summary): the real trainers' verified syncs, the device digest, the
    # handoff around a user's loop, with pytest's exit and time (limit: arg 2)
    t0=$(date +%s)
    timeout "${2:-320}" python3 -m pytest -q -p no:cacheprovider -m gpu -rf --tb=short tests/gpu/test_real_trainers.py \
      tests/gpu/test_digest_cuda.py tests/gpu/test_handoff_gpu.py 2>&1 | tee "$OUT/gpu-tests.log" | tail -6
    echo "GPU tests: exit ${PIPESTATUS[0]} after $(( $(date +%s) - t0 )) s" | tee -a "$OUT/gpu-tests.log"
    ;;
  call66d)  # issue 44, 2026-11-30 (sixteenth session), one GPU: Megatron's rows at Qwen2-7B, three reps, with the
    # digest answered by the load's end (what --verify every adds at 7B now; limit: arg 2)
    timeout "${2:-420}" python3 -m colo.cli bench --device cuda --model qwen2-7b --transports packed \
      --trainers megatron --reps 3 --out "$OUT/colo-bench-trainers-7b-megatron.json" 2>&1 \
      | tee "$OUT/trainers-7b-megatron.log" | grep -E "^qwen2-7b |^\| qwen2-7b \| |retain"
    engine_rows "$OUT/colo-bench-trainers-7b-megatron.json"
    ;;
  call66b)  # issue 44, 2026-11-30 (sixteenth session), one GPU: verification after the engine answers its digest
    # with the load's end (colo.engine.reference.client.EngineClient.digest: no request of its own once one was
    # asked): every real trainer's rows at Qwen2-1.5B with each cycle's engine account (limit: arg 2), then the GPU
    # tests of the real trainers' verified syncs and of the device digest (limit: arg 3)
    timeout "${2:-400}" python3 -m colo.cli bench --device cuda --model qwen2-1.5b --transports packed \
      --trainers hf,fsdp,megatron --reps 3 --out "$OUT/colo-bench-trainers-1.5b.json" 2>&1 | tee "$OUT/trainers.log" \
      | grep -E "^qwen2-1.5b |^\| qwen2-1.5b \| |retain"
    engine_rows "$OUT/colo-bench-trainers-1.5b.json"
    t0=$(date +%s)
    gpu_tests "${3:-300}" tests/gpu/test_real_trainers.py tests/gpu/test_digest_cuda.py tests/gpu/test_handoff_gpu.py
    echo "GPU tests: exit after $(( $(date +%s) - t0 )) s" | tee -a "$OUT/gpu-tests.log"
    ;;
  call66a)  # issue 44, 2026-11-30 (sixteenth session), one GPU: hf's and fsdp's rows at Qwen2-1.5B with the route
    # each engine load took (route_*_s: colo.engine.reference.model.LOAD_ROUTES) beside its queueing: baseline44's
    # hf sync-first queued 4.5 ms a load in its plain cycles and 1.1 ms in its verified ones, call51c 1 ms in both
    # (limit: arg 2)
    timeout "${2:-300}" python3 -m colo.cli bench --device cuda --model qwen2-1.5b --transports packed \
      --trainers hf,fsdp --reps 3 --out "$OUT/colo-bench-trainers-1.5b.json" 2>&1 | tee "$OUT/trainers.log" \
      | grep -E "^qwen2-1.5b |^\| qwen2-1.5b \| |retain"
    engine_rows "$OUT/colo-bench-trainers-1.5b.json"
    ;;
  call65a)  # 2026-11-30 (fifteenth session), two GPUs, main after both branches merged (megatron-one-copy for issue 44,
    # moe-expert-scatter for issue 46): every gpu2 test (limit: arg 2; call64b's MoE cuda test failed on the branch,
    # fixed since), then on GPU 0 the one-copy tests call64a's limit cut before pytest's summary, each test's verdict
    # as it ends and pytest's exit with the time (limit: arg 3)
    gpu2_suite "${2:-240}"
    t0=$(date +%s)
    CUDA_VISIBLE_DEVICES=0 timeout "${3:-330}" python3 -m pytest -v -p no:cacheprovider -m gpu -rf --tb=short \
      --durations=15 tests/gpu/test_real_trainers.py tests/device/test_one_copy_megatron.py \
      "tests/gpu/test_digest_cuda.py::test_copies_of_strided_tensors_runs_on_the_device_give_the_whole_tensors_lanes" \
      tests/device/test_one_copy.py 2>&1 | tee "$OUT/gpu-tests.log" | grep -E "PASSED|FAILED|ERROR|passed|failed|s call" | tail -40
    echo "one-copy GPU tests: exit ${PIPESTATUS[0]} after $(( $(date +%s) - t0 )) s" | tee -a "$OUT/gpu-tests.log"
    ;;
  call65b)  # 2026-11-30 (fifteenth session), one GPU, main after both branches merged: Megatron's and hf's rows at
    # Qwen2-1.5B (Megatron's sync in one request out of its flat buffer; limit: arg 2), then Megatron's rows at
    # Qwen2-7B with one rep each (call64c's 320 s limit cut them; limit: arg 3)
    timeout "${2:-150}" python3 -m colo.cli bench --device cuda --model qwen2-1.5b --transports packed \
      --trainers megatron,hf --reps 3 --out "$OUT/colo-bench-trainers-1.5b.json" 2>&1 | tee "$OUT/trainers.log" \
      | grep -E "^qwen2-1.5b |^\| qwen2-1.5b \| |retain"
    engine_rows "$OUT/colo-bench-trainers-1.5b.json"
    timeout "${3:-400}" python3 -m colo.cli bench --device cuda --model qwen2-7b --transports packed \
      --trainers megatron --reps 1 --out "$OUT/colo-bench-trainers-7b-megatron.json" 2>&1 | tee "$OUT/trainers-7b-megatron.log" \
      | grep -E "^qwen2-7b |^\| qwen2-7b \| |retain"
    engine_rows "$OUT/colo-bench-trainers-7b-megatron.json"
    ;;
  all)
    bash "$0" tests
    bash "$0" demos
    bash "$0" bench
    ;;
  colo-bench)  # the user's command on the GPU: colo bench --device cuda, the sizes of a GPU, every flag as documented
    python3 -m colo.cli bench --device cuda --model qwen2-1.5b,qwen2-7b --reps 3 --out "$OUT/colo-bench-cuda.json" \
      2>&1 | tee "$OUT/colo-bench-cuda.log" | tail -12
    ;;
  colo-bench-trainers)  # issue 31 items 3 and 4: colo bench --device cuda with the real trainers' rows (every
    # transition, torch_memory_saver's own backup beside them) at one model: qwen2-1.5b (default) or qwen2-7b
    python3 -m colo.cli bench --device cuda --model "${2:-qwen2-1.5b}" --reps 3 --trainers all \
      --out "$OUT/colo-bench-trainers-${2:-qwen2-1.5b}.json" 2>&1 | tee "$OUT/colo-bench-trainers-${2:-qwen2-1.5b}.log" | tail -24
    ;;
  issue31)  # issue 31 in one call that fits what is left of a session's device time: checkpoint-engine alone at
    # Qwen2-7B (item 5), colo's packed 7B sync with the limits of its own run beside it, then the real trainers'
    # colo bench rows at Qwen2-1.5B (items 3 and 4; --out holds each trainer's rows as they are done, so a run
    # stopped at its time limit keeps them); the optional argument: that last run's limit in seconds
    timeout 120 python3 -m bench.peer "$OUT/peer-7b.json" --model qwen2-7b --buckets-gib 2 2>&1 \
      | tee "$OUT/issue31.log" | tail -4
    timeout 100 python3 -m colo.cli bench --device cuda --model qwen2-7b --transports packed --trainers none \
      --out "$OUT/colo-bench-7b.json" 2>&1 | tee -a "$OUT/issue31.log" | tail -3
    timeout "${2:-330}" python3 -m colo.cli bench --device cuda --model qwen2-1.5b --transports packed --trainers all \
      --reps 3 --out "$OUT/colo-bench-trainers-1.5b.json" 2>&1 | tee -a "$OUT/issue31.log" | tail -16
    ;;
  megatron31)  # issue 31: the paused one-rank Megatron trainer's sync from views of its host backup (never run on
    # a GPU before): its demos under both plans, then its colo bench row at Qwen2-1.5B (limit: the optional argument)
    python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_one_gpu.py -k "framework and megatron" \
      2>&1 | tee "$OUT/gpu-tests.log" | tail -8
    timeout "${2:-150}" python3 -m colo.cli bench --device cuda --model qwen2-1.5b --transports packed --trainers megatron \
      --reps 3 --out "$OUT/colo-bench-megatron-1.5b.json" 2>&1 | tee "$OUT/megatron.log" | tail -16
    ;;
  session5)  # one GPU, what the session of 2026-11-27 (evening) changed or landed: the device digest's tests (the
    # engine summing a verified load as it writes it, probed once per engine: never run on a GPU), the handoff
    # around a user's own loop from a checkpoint, every one-GPU demo; then the real trainers' rows at Qwen2-1.5B
    # with what verification adds to a sync (issue 44's baseline). Limits: arg 2 for the tests, arg 3 the bench
    timeout "${2:-360}" python3 -m pytest -q -p no:cacheprovider -m gpu --durations=12 tests/gpu/test_digest_cuda.py \
      tests/gpu/test_handoff_gpu.py tests/gpu/test_one_gpu.py 2>&1 | tee "$OUT/gpu-tests.log" | tail -30
    timeout "${3:-200}" python3 -m colo.cli bench --device cuda --model qwen2-1.5b --transports packed \
      --trainers hf,fsdp,megatron --reps 3 --out "$OUT/colo-bench-trainers-1.5b.json" 2>&1 | tee "$OUT/trainers.log" | tail -20
    ;;
  session6)  # one GPU, 2026-11-27 (night): the handoff around a user's own loop alone first (it failed in
    # session5's run, the reason cut off), then the device digest's and the one-GPU tests, then the real trainers'
    # rows at Qwen2-1.5B with what verification adds to a sync (issue 44's baseline). Limits: args 2, 3, 4
    timeout "${2:-150}" python3 -m pytest -q -p no:cacheprovider -m gpu -rf --tb=long tests/gpu/test_handoff_gpu.py \
      > "$OUT/gpu-handoff.log" 2>&1; echo "handoff test: exit $?"; grep -E "^E |passed|failed|Error" "$OUT/gpu-handoff.log" | tail -40
    timeout "${3:-240}" python3 -m pytest -q -p no:cacheprovider -m gpu -rf --tb=short --durations=12 \
      tests/gpu/test_digest_cuda.py tests/gpu/test_one_gpu.py 2>&1 | tee "$OUT/gpu-tests.log" | tail -25
    timeout "${4:-180}" python3 -m colo.cli bench --device cuda --model qwen2-1.5b --transports packed \
      --trainers hf,fsdp,megatron --reps 3 --out "$OUT/colo-bench-trainers-1.5b.json" 2>&1 | tee "$OUT/trainers.log" | tail -20
    ;;
  call64a)  # issue 44, 2026-11-30 (fourteenth session), one GPU, branch megatron-one-copy: the Megatron trainer at one
    # rank syncs out of its flat buffer in one request (q, k, v as strided views of the fused QKV): its GPU tests,
    # then Megatron's and hf's rows at Qwen2-1.5B (limit of the rows: arg 2)
    gpu_tests 240 tests/gpu/test_real_trainers.py tests/device/test_one_copy_megatron.py \
      "tests/gpu/test_digest_cuda.py::test_copies_of_strided_tensors_runs_on_the_device_give_the_whole_tensors_lanes" \
      tests/device/test_one_copy.py
    timeout "${2:-240}" python3 -m colo.cli bench --device cuda --model qwen2-1.5b --transports packed \
      --trainers megatron,hf --reps 3 --out "$OUT/colo-bench-trainers-1.5b.json" 2>&1 | tee "$OUT/trainers.log" \
      | grep -E "^qwen2-1.5b |^\| qwen2-1.5b \| |retain"
    engine_rows "$OUT/colo-bench-trainers-1.5b.json"
    ;;
  call64c)  # issue 44, branch megatron-one-copy, one GPU: Megatron's rows at Qwen2-7B with one rep each (the device
    # time left), its sync in one request out of the flat buffer (limit: arg 2)
    timeout "${2:-330}" python3 -m colo.cli bench --device cuda --model qwen2-7b --transports packed \
      --trainers megatron --reps 1 --out "$OUT/colo-bench-trainers-7b-megatron.json" 2>&1 | tee "$OUT/trainers-7b-megatron.log" \
      | grep -E "^qwen2-7b |^\| qwen2-7b \| |retain"
    engine_rows "$OUT/colo-bench-trainers-7b-megatron.json"
    ;;
  named)  # the GPU tests named after the limit: named LIMIT TEST... (a failure's whole report in gpu-tests.log)
    timeout "$2" python3 -m pytest -q -p no:cacheprovider -m gpu -rf --tb=long "${@:3}" 2>&1 | tee "$OUT/gpu-tests.log" | tail -60
    ;;
  gpu1rest)  # the one-GPU tests gpu1 did not reach within 540 s on 2026-11-30 (thirteenth session: 54 of 60 passed, then
    # its limit): fsdp's one-copy sync-first over several steps, adapters through CUDA IPC, the one-copy tests (the
    # packed path through device staging among them). Limit: arg 2
    timeout "${2:-300}" python3 -m pytest -q -p no:cacheprovider -m gpu -rf --tb=short --durations=10 \
      "tests/gpu/test_real_trainers.py::test_a_one_rank_trainers_one_copy_sync_is_exact_over_several_steps[fsdp-sync-first]" \
      tests/gpu/test_adapters_cuda.py tests/device/test_one_copy.py 2>&1 | tee "$OUT/gpu-tests.log" | tail -20
    ;;
  gpu1)  # every one-GPU test in one call: the handoff around a user's own loop, the device digest, the one-GPU
    # demos, the real trainers; colo's engine begun before the trainer is built (146e4d1) has not run on a GPU
    # before this. Limit: arg 2
    timeout "${2:-540}" python3 -m pytest -q -p no:cacheprovider -m gpu -rf --tb=short --durations=15 \
      tests/gpu/test_handoff_gpu.py tests/gpu/test_digest_cuda.py tests/gpu/test_one_gpu.py tests/gpu/test_real_trainers.py \
      tests/gpu/test_adapters_cuda.py tests/device/test_one_copy.py tests/device/test_flat_digest.py \
      2>&1 | tee "$OUT/gpu-tests.log" | tail -30
    ;;
  baseline44)  # issue 44's baseline whole: every real trainer's rows at Qwen2-1.5B, both plans, what
    # --verify every adds to each (earlier calls' limits ended them after hf's rows); limit: arg 2
    timeout "${2:-540}" python3 -m colo.cli bench --device cuda --model qwen2-1.5b --transports packed \
      --trainers hf,fsdp,megatron --reps 3 --out "$OUT/colo-bench-trainers-1.5b.json" 2>&1 | tee "$OUT/trainers.log" | tail -24
    ;;
  call44a)  # issue 44, 2026-11-29 (fifth session), first call: the device digest's GPU tests (colo's engine sums a
    # verified load from tables made once: colo.digest.Blocks), the copy probe (a model's tensors copied one by
    # one, in one foreach call, in one Triton launch with and without the digest's lanes: bench/copy_probe.py),
    # then baseline44's rows with the engine's own account of its loads (engine_s). Limit of the rows: arg 2
    timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_digest_cuda.py 2>&1 \
      | tee "$OUT/digest-tests.log" | tail -4
    timeout 120 python3 -m bench.copy_probe "$OUT/copy-probe-1.5b.json" 2>&1 | tee "$OUT/copy-probe.log"
    timeout 120 python3 -m bench.copy_probe "$OUT/copy-probe-7b.json" --model qwen2-7b 2>&1 | tee -a "$OUT/copy-probe.log"
    bash "$0" baseline44 "${2:-420}"
    ;;
  call44b)  # issue 44, second call of 2026-11-29 (fifth session): baseline44's rows after colo's engine loads a
    # batch of device tensors in one launch (and sums it in that launch), the sender packs one, and a one-rank
    # FSDP2 trainer keeps its resident extractor (limit: arg 2); then the device digest's GPU tests (the copying
    # kernel, the engine's one-launch load, the one-launch pack against the per-tensor pack)
    bash "$0" baseline44 "${2:-430}"
    timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_digest_cuda.py 2>&1 \
      | tee "$OUT/digest-tests.log" | tail -4
    ;;
  call44c)  # issue 44, third call of 2026-11-29 (fifth session): every real trainer's rows at Qwen2-1.5B after the
    # engine plans a bucket layout once (limit: arg 2), each trainer's child profiling one more plain sync per plan
    # (COLO_BENCH_PROFILE: where the sender's time goes now); then the GPU tests of what changed: the device digest's
    # (the copying kernel, the one-launch load and pack), the demos on CUDA with each framework trainer under both
    # plans, tensors larger than the bucket through the packed path (limit: arg 3)
    profiled_rows "${2:-360}"
    tar czf "$OUT/profiles.tgz" -C /tmp prof 2>/dev/null
    gpu_tests "${3:-190}" tests/gpu/test_digest_cuda.py \
      "tests/gpu/test_one_gpu.py::test_demo_on_cuda_with_each_framework_trainer_verifies_every_sync" \
      "tests/gpu/test_one_gpu.py::test_on_cuda_tensors_larger_than_the_bucket_arrive_bit_exact_within_two_buckets[packed]"
    ;;
  call45a)  # issue 44, first call of 2026-11-29 (sixth session): every real trainer's rows at Qwen2-1.5B after a
    # sync-first sync's digests are checked against the trainer's offload digest (Scheduler._check_at_offload) and
    # Megatron's fused QKV is split straight into staging at one rank, each trainer's child profiling one more plain
    # sync per plan (limit: arg 2); then the GPU tests of what changed: the device digest's (the one-launch pack
    # around tensors already in place), the demos on CUDA under each plan and with each framework trainer (the
    # deferred check's digest.checked), the hf trainer's one-copy syncs over several steps (limit: arg 3)
    profiled_rows "${2:-320}"
    gpu_tests "${3:-240}" tests/gpu/test_digest_cuda.py \
      "tests/gpu/test_one_gpu.py::test_demo_on_cuda_with_each_framework_trainer_verifies_every_sync" \
      "tests/gpu/test_one_gpu.py::test_demo_on_cuda_runs_each_plan_with_verified_syncs" \
      "tests/gpu/test_real_trainers.py::test_a_one_rank_trainers_one_copy_sync_is_exact_over_several_steps"
    ;;
  call45b)  # issue 44, second call of 2026-11-29 (sixth session): the GPU tests call45a's limit cut (the demo on
    # CUDA under sync-first and single-stage, the hf trainer's one-copy syncs over several steps). Limit: arg 2
    gpu_tests "${2:-200}" \
      "tests/gpu/test_one_gpu.py::test_demo_on_cuda_runs_each_plan_with_verified_syncs" \
      "tests/gpu/test_real_trainers.py::test_a_one_rank_trainers_one_copy_sync_is_exact_over_several_steps"
    ;;
  call45c)  # issue 44, last call of 2026-11-29 (sixth session): every real trainer's rows at Qwen2-1.5B after the
    # optimizer's masters and moments are one allocation each (the trainer's pause and onload) and the kernels' tables
    # go up through a pinned ring instead of a pin per launch (limit: arg 2); then the GPU tests of what changed: the
    # device digest's (the ring among them), a framework trainer's demo training under each plan, the hf trainer's
    # tags and one-copy syncs over several steps (limit: arg 3)
    profiled_rows "${2:-270}"
    gpu_tests "${3:-170}" tests/gpu/test_digest_cuda.py \
      "tests/gpu/test_real_trainers.py" \
      "tests/gpu/test_one_gpu.py::test_demo_on_cuda_with_each_framework_trainer_verifies_every_sync[sync-first-megatron]" \
      "tests/gpu/test_one_gpu.py::test_demo_on_cuda_with_each_framework_trainer_verifies_every_sync[offload-first-fsdp]"
    ;;
  call46a)  # issue 46 on two GPUs (nvidia-h200-x2), first call of 2026-11-29 (seventh session): Qwen2-7B at TP=2
    # after an offload-first gather uploads the host copy's parts on a stream of its own (the next part goes up
    # while this one is gathered) and run by run (a strided q, k or v no longer through pageable memory): the
    # synthetic Megatron layout's rows, every transport, both plans (limit: arg 2); colo's real megatron-core
    # trainer's packed rows (limit: arg 3). Every row's shard digests checked on both ranks.
    tp2_rows "${2:-150}"
    tp2_megatron_rows "${3:-140}"
    ;;
  call46b)  # issue 46 on two GPUs, second call: Qwen2-7B at TP=2 with the synthetic layout, every row, after the
    # upload stream waits for the caller's stream before a call's first upload and before one into new memory
    # (call46a's offload-first baselines took wrong bytes), colo's packed rows profiled: each rank's Chrome traces
    # in one archive and, in the JSON, its device time and its host's busiest ops (limit: arg 2). Then every gpu2
    # test of the repository, three at a time, under a limit (arg 3; the issue's target is 5 minutes), timed as
    # a whole; each test stopped at 240 s by pytest-timeout so that a slow one fails with its traceback. The
    # traces of the two-GPU demos come back in one archive (where a demo's time goes); last, the one-GPU test
    # of the extractor's upload stream
    rm -rf /tmp/prof && mkdir -p /tmp/prof
    timeout "${2:-140}" python3 -m bench.multi_gpu --device cuda --gpus 2 --model qwen2-7b --profile /tmp/prof \
      --out "$OUT/bench-gpu2.json" 2>&1 | tee "$OUT/bench-gpu2.log" | grep -v '^{' | tail -14
    tar -czf "$OUT/bench-gpu2-profiles.tgz" -C /tmp/prof . 2>/dev/null
    par=$(python3 -c "import xdist" 2>/dev/null && echo "-n 3")
    rm -rf /tmp/g2
    t0=$(date +%s)
    timeout "${3:-300}" python3 -m pytest -v -p no:cacheprovider -m gpu2 $par --timeout=240 --durations=20 \
      --continue-on-collection-errors \
      --basetemp=/tmp/g2 tests 2>&1 | tee "$OUT/gpu2-tests.log" | grep -E "PASSED|FAILED|ERROR|passed|failed|s call" | tail -40
    echo "pytest -m gpu2: exit ${PIPESTATUS[0]} after $(( $(date +%s) - t0 )) s" | tee -a "$OUT/gpu2-tests.log"
    (cd /tmp/g2 && find . -name '*.jsonl' | tar czf "$OUT/gpu2-traces.tgz" -T -) 2>/dev/null
    gpu_tests 60 "tests/extractors/test_megatron.py::test_an_upload_from_pinned_host_runs_on_its_stream_and_the_callers_stream_waits_for_it"
    ;;
  call46c)  # issue 46 on two GPUs, third call: the real megatron-core trainer's bench test alone (call46b: its
    # packed rows over their staging bound; the peaks in its message; limit: arg 2); Qwen2-7B at TP=2, the
    # synthetic layout's every row (the upload stream's fences measured without a profiler: call46b's CUPTI
    # slowed every row after the first profiled one) and colo's real megatron-core trainer's packed rows, each
    # colo-packed row followed by one more sync with the extraction under cProfile (--host-profile: where the
    # gather stage's host time goes; limits: args 3 and 4)
    timeout "${2:-90}" python3 -m pytest -q -p no:cacheprovider -m gpu2 -rf --tb=short \
      tests/bench/test_multi_gpu.py::test_bench_gpus_2_real_megatron_trainer_cuda 2>&1 | tee "$OUT/gpu2-tests.log" | tail -8
    timeout "${3:-150}" python3 -m bench.multi_gpu --device cuda --gpus 2 --model qwen2-7b --host-profile /tmp/hp \
      --out "$OUT/bench-gpu2.json" 2>&1 | tee "$OUT/bench-gpu2.log" | grep -v '^{' | tail -14
    timeout "${4:-140}" python3 -m bench.multi_gpu --device cuda --gpus 2 --model qwen2-7b --trainer megatron \
      --rows colo-packed,colo-packed-serial --host-profile /tmp/hp-megatron --out "$OUT/bench-gpu2-megatron.json" \
      2>&1 | tee "$OUT/bench-gpu2-megatron.log" | grep -v '^{' | grep -iv warn | tail -12
    tar -czf "$OUT/host-profiles.tgz" -C /tmp hp hp-megatron 2>/dev/null
    ;;
  call46d)  # issue 46 on two GPUs, fourth call: the offload-first upload stream measured against the extractor
    # before it, on one machine, alternating (call46a/c ran on machines whose host-bound rows differed by up to a
    # third): Qwen2-7B at TP=2, the synthetic layout's colo-packed rows, twice each, with colo/extractors/megatron.py
    # now and as of 835f5aa (.whl/megatron-835f5aa.tgz over a copy of this tree; limit per run: arg 2); then the
    # real megatron-core trainer's bench test (its 130 MiB down_proj in 64 MiB buckets, now gathered by range;
    # limit: arg 3)
    ab_base .whl/megatron-835f5aa.tgz
    for round in 1 2; do
      for side in now before; do
        dir=$PWD; [ "$side" = before ] && dir=/tmp/base
        ab_rows "$dir" "$side-$round" "${2:-100}"
      done
    done
    timeout "${3:-90}" python3 -m pytest -q -p no:cacheprovider -m gpu2 -rf --tb=short \
      tests/bench/test_multi_gpu.py::test_bench_gpus_2_real_megatron_trainer_cuda 2>&1 | tee "$OUT/gpu2-tests.log" | tail -8
    ;;
  call44e)  # issue 44, 2026-11-29 (seventh session), one GPU: the extractor's upload-stream test (its call streams
    # now kept per call); hf's rows at Qwen2-1.5B with the optimizer's state as before 27bf731 (.whl/before-27bf731-
    # colo.tgz: this package at 835f5aa with 27bf731 reverted; limit: arg 2), then hf's and Megatron's rows now with
    # torch_memory_saver's own backup in the same run (limit: arg 3): does 27bf731 slow hf's offload-first sync
    # (59.8 ms before it, 66.7 ms in the one run after it, on another machine)?
    gpu_tests 40 "tests/extractors/test_megatron.py::test_an_upload_from_pinned_host_runs_on_its_stream_and_the_callers_stream_waits_for_it"
    rm -rf /tmp/base && mkdir -p /tmp/base && tar xzf .whl/before-27bf731-colo.tgz -C /tmp/base
    (cd /tmp/base && PYTHONPATH=/tmp/site:/tmp/base timeout "${2:-130}" python3 -m colo.cli bench --device cuda \
      --model qwen2-1.5b --transports packed --trainers hf --reps 3 --out "$OUT/trainers-before-27bf731.json" 2>&1 \
      | tee "$OUT/trainers-before.log" | tail -12)
    timeout "${3:-250}" python3 -m colo.cli bench --device cuda --model qwen2-1.5b --transports packed \
      --trainers hf,megatron --reps 3 --out "$OUT/trainers-now.json" 2>&1 | tee "$OUT/trainers-now.log" | tail -16
    ;;
  call49a)  # issue 44, 2026-11-29 (ninth session), one GPU: the rows of fsdp and Megatron at Qwen2-1.5B now that
    # their weights are one flat buffer each (fsdp's one-rank shards read by the engine straight from it, 1c21bc2;
    # Megatron's paused as one copy, 6ec9a14) and torch_memory_saver's own backup in the same run (limit: arg 2);
    # then the GPU tests of what changed: the trainers' tags paused and resumed in place and their one-copy syncs
    # over four steps (hf and fsdp), the demo with the Megatron trainer under each plan (limit: arg 3)
    timeout "${2:-230}" python3 -m colo.cli bench --device cuda --model qwen2-1.5b --transports packed \
      --trainers fsdp,megatron --reps 3 --out "$OUT/colo-bench-trainers-1.5b.json" 2>&1 | tee "$OUT/trainers.log" \
      | tail -16
    gpu_tests "${3:-220}" tests/gpu/test_real_trainers.py \
      "tests/gpu/test_one_gpu.py::test_demo_on_cuda_with_each_framework_trainer_verifies_every_sync[offload-first-megatron]" \
      "tests/gpu/test_one_gpu.py::test_demo_on_cuda_with_each_framework_trainer_verifies_every_sync[sync-first-megatron]"
    ;;
  collcost)  # issue 46 (prepared 2026-11-29, eighth session), two GPUs: what one all-gather costs the host
    # (collcost_runs); limit per run: arg 2
    collcost_runs "${2:-90}"
    ;;
  call64b)  # issue 46, 2026-11-30 (fourteenth session), two GPUs, branch moe-expert-scatter: every gpu2 test on the
    # changed TP engine load (limit: arg 2), then the Qwen3-30B-A3B shape cut to 4 layers (128 experts of 768), trainer
    # TP=2 + EP=2, engine TP-MoE over 2, its experts sent by all_to_all as each engine rank's slice (limit: arg 3)
    gpu2_suite "${2:-260}"
    timeout "${3:-200}" python3 -m bench.multi_gpu --device cuda --gpus 2 --model qwen3-30b-a3b --layers 4 --reps 3 \
      --out "$OUT/bench-moe2.json" 2>&1 | tee "$OUT/bench-moe2.log" | grep -v '^{' | tail -30
    ;;
  call63c)  # issue 46, 2026-11-30 (thirteenth session), two GPUs, after call63a: every gpu2 test on the changed
    # extractor and packed slots (limit: arg 2), then colo's real megatron-core trainer's packed rows at 2048 MiB
    # (limit: arg 3; the ninth session's were at 1024 MiB: 0.0891 / 0.2297 s)
    gpu2_suite "${2:-300}"
    tp2_megatron_rows "${3:-170}" --bucket-mib 2048
    ;;
  call63a)  # issue 46, 2026-11-30 (thirteenth session), two GPUs: Qwen2-7B at TP=2, the synthetic layout's colo-packed
    # rows beside slime-style at 2048 and then 1024 MiB (as call49c and call49b), after the sender's host work per
    # sync was cut: a slot's views made from a plan kept per bucket layout, the norms copied into staging in the
    # bucket's one batched copy (every bucket gathered in place: no pack, no thread hop), a fused source's parts cut
    # once per call. Does sync-first reach issue 46's 0.5 of its floor and 3x slime-style (ninth session at 2048 MiB:
    # 0.0705 s, 0.487, 2.19x; at 1024 MiB: 0.0835 s, 1.93x)? Limit per run: arg 2; one log for both
    for size in 2048 1024; do
      echo "== bucket $size MiB" | tee -a "$OUT/multi-sync-h200x2-qwen2-7b-2026-11-30-13.log"
      timeout "${2:-150}" python3 -m bench.multi_gpu --device cuda --gpus 2 --model qwen2-7b --bucket-mib "$size" \
        --rows colo-packed,slime-style --out "$OUT/multi-sync-h200x2-qwen2-7b-2026-11-30-13-bucket$size.json" 2>&1 \
        | tee -a "$OUT/multi-sync-h200x2-qwen2-7b-2026-11-30-13.log" \
        | grep -E "^\| (sync|offload)-first|^limits|^floors|^target"
    done
    ;;
  call53a)  # issue 44, 2026-11-30 (twelfth session), one GPU: call52a for another real trainer (arg 2: fsdp or megatron;
    # limit: arg 3)
    settled_rows "$2" "${3:-480}"
    ;;
  call52a)  # issue 44, run in the twelfth session (2026-11-30): is the driver's clearing of
    # the 91 GB of optimizer state and 15 GB of weights the trainer just released what keeps the one-copy 7B
    # offload-first sync at 1.10 (its copies at 51 GB/s on the device, a packed sync of the same bytes at 53.4)? hf's
    # 7B rows with one second between the engine's wake-up and each sync (COLO_BENCH_SETTLE_S; limit: arg 2)
    settled_rows hf "${2:-440}"
    ;;
  call51c)  # issue 44, 2026-11-30 (eleventh session), one GPU, run at 73c2e2a: the copying kernel told that its table
    # is 16-byte aligned (colo.digest.Copies.aligned, reverted after: 1.787 / 8.903 ms against 1.784 / 9.015 at
    # Qwen2-1.5B / 7B, no gain): the device digest's GPU tests (exact bytes and lanes; limit: arg 2),
    # bench.copy_probe at Qwen2-1.5B and 7B (there, with the A/B of the aligned and 4-byte variants; limit: arg 3 each), then every real trainer's rows at Qwen2-1.5B with each cycle's engine account (limit: arg 4)
    gpu_tests "${2:-110}" tests/gpu/test_digest_cuda.py
    timeout "${3:-90}" python3 -m bench.copy_probe "$OUT/copy-probe-1.5b.json" 2>&1 | tee "$OUT/copy-probe.log"
    timeout "${3:-90}" python3 -m bench.copy_probe "$OUT/copy-probe-7b.json" --model qwen2-7b --reps 3 2>&1 \
      | tee -a "$OUT/copy-probe.log"
    timeout "${4:-300}" python3 -m colo.cli bench --device cuda --model qwen2-1.5b --transports packed \
      --trainers hf,fsdp,megatron --reps 3 --out "$OUT/colo-bench-trainers-1.5b.json" 2>&1 | tee "$OUT/trainers.log" \
      | grep -E "^\| qwen2-1.5b \| |retain"
    engine_rows "$OUT/colo-bench-trainers-1.5b.json"
    ;;
  call51a)  # issue 44, 2026-11-30 (eleventh session), one GPU: one real trainer's rows at Qwen2-7B (arg 2: hf, fsdp or
    # megatron) after the tenth session's changes (the optimizer state paused before the weights; fsdp's extractor
    # kept over its flat buffer; a request's views made only when read; the engine's collector paused; the allocator's
    # cache returned before the pauses), three cycles of each kind, each cycle's engine account (limit: arg 3)
    timeout "${3:-480}" python3 -m colo.cli bench --device cuda --model qwen2-7b --transports packed \
      --trainers "$2" --reps 3 --out "$OUT/colo-bench-trainers-7b-$2.json" 2>&1 | tee "$OUT/trainers-7b-$2.log" \
      | grep -E "^qwen2-7b |^\| qwen2-7b \| |retain"
    engine_rows "$OUT/colo-bench-trainers-7b-$2.json"
    ;;
  call51b)  # issue 44, 2026-11-30 (eleventh session), one GPU: every real trainer's rows at Qwen2-1.5B after the engine's
    # collector pause and the allocator's cache returned before the pauses, each cycle's engine account (is hf's
    # 3.9 ms queue gone; limit: arg 2), then Megatron's packed rows with 1024 MiB buckets (3 instead of 6: where its
    # offload-first's 1.17 goes; limit: arg 3)
    timeout "${2:-380}" python3 -m colo.cli bench --device cuda --model qwen2-1.5b --transports packed \
      --trainers hf,fsdp,megatron --reps 3 --out "$OUT/colo-bench-trainers-1.5b.json" 2>&1 | tee "$OUT/trainers.log" \
      | grep -E "^qwen2-1.5b (hf|fsdp|megatron)|^\| qwen2-1.5b \| |retain"
    engine_rows "$OUT/colo-bench-trainers-1.5b.json"
    timeout "${3:-150}" python3 -m colo.cli bench --device cuda --model qwen2-1.5b --transports packed \
      --trainers megatron --bucket-mib 1024 --reps 3 --out "$OUT/colo-bench-megatron-1.5b-bucket1024.json" 2>&1 \
      | tee "$OUT/megatron-bucket1024.log" | grep -E "^\| qwen2-1.5b \| "
    engine_rows "$OUT/colo-bench-megatron-1.5b-bucket1024.json"
    ;;
  call50e)  # issue 44, 2026-11-30 (tenth session), one GPU: every real trainer's rows at Qwen2-1.5B as the cycle now
    # runs (the trainer's optimizer state paused before its weights, colo.core.phases; fsdp's extractor kept over its
    # flat buffer; a request's views made only when read), three cycles of each kind (limit: arg 2)
    timeout "${2:-380}" python3 -m colo.cli bench --device cuda --model qwen2-1.5b --transports packed \
      --trainers hf,fsdp,megatron --reps 3 --out "$OUT/colo-bench-trainers-1.5b.json" 2>&1 | tee "$OUT/trainers.log" \
      | grep -E "^qwen2-1.5b (hf|fsdp|megatron)|^\| qwen2-1.5b \| |retain"
    python3 -c "import json, sys; [print(t['trainer'], r['plan'], t['pause_order'], {k: round(v * 1e3, 2) for k, v in r['engine_s'].items()}, {k: round(v * 1e3, 2) for k, v in r['stage_s'].items()}) for t in json.load(open(sys.argv[1]))['trainers'] for r in t['rows']]" \
      "$OUT/colo-bench-trainers-1.5b.json"
    ;;
  call50d)  # issue 44, 2026-11-30 (tenth session), one GPU: after fsdp's extractor kept over its flat buffer and the
    # request's views made only when read: the GPU tests of the one-copy syncs (hf and fsdp, both plans, four steps
    # exact; limit: arg 2), hf's and fsdp's rows at Qwen2-1.5B (limit: arg 3), then hf's with the optimizer state
    # paused before the weights (COLO_BENCH_PAUSE_ORDER: call50c found host<->device copies at half the link's rate
    # for tens of ms after a release; limit: arg 4)
    gpu_tests "${2:-100}" tests/gpu/test_real_trainers.py -k one_copy
    timeout "${3:-200}" python3 -m colo.cli bench --device cuda --model qwen2-1.5b --transports packed \
      --trainers hf,fsdp --reps 2 --out "$OUT/colo-bench-trainers-1.5b.json" 2>&1 | tee "$OUT/trainers.log" | tail -9
    python3 -c "import json, sys; [print(t['trainer'], r['plan'], {k: round(v * 1e3, 2) for k, v in r['engine_s'].items()}, {k: round(v * 1e3, 2) for k, v in r['stage_s'].items()}) for t in json.load(open(sys.argv[1]))['trainers'] for r in t['rows']]" \
      "$OUT/colo-bench-trainers-1.5b.json"
    COLO_BENCH_PAUSE_ORDER=optimizer,weights timeout "${4:-120}" python3 -m colo.cli bench --device cuda \
      --model qwen2-1.5b --transports packed --trainers hf --reps 2 --out "$OUT/colo-bench-hf-1.5b-reordered.json" \
      2>&1 | tee "$OUT/trainers-reordered.log" | grep -E "^\| qwen2"
    python3 -c "import json, sys; [print(t['trainer'], r['plan'], t['pause_order'], {k: round(v * 1e3, 2) for k, v in r['engine_s'].items()}) for t in json.load(open(sys.argv[1]))['trainers'] for r in t['rows']]" \
      "$OUT/colo-bench-hf-1.5b-reordered.json"
    ;;
  call50c)  # issue 44, 2026-11-30 (tenth session), one GPU: call50b found the engine's one-copy offload-first
    # copies slow on the device itself (device_s 62-63 ms for 3.09 GB, 49-50 GB/s) where the same copies in a process
    # of their own ran at 54.5 GB/s out of a read-only or a read-write mapping: what differs is that the trainer has
    # just released 21.6 GB. The machine's NUMA layout; copies right after this process freed 18 GiB and right after
    # another process paused an 18 GiB memory-saver region, then two seconds later (bench/saver_copy.py); opening a
    # trainer's buffer by size (bench/ipc_open.py); hf's rows at Qwen2-1.5B with one second between the engine's
    # wake-up and each sync (COLO_BENCH_SETTLE_S; limit: arg 2)
    lscpu | grep -iE "^numa|model name"; nvidia-smi topo -m | head -4
    timeout 150 python3 -m bench.saver_copy "$OUT/saver-copy-qwen2-1.5b.json" --model qwen2-1.5b --free-gib 18 \
      2>&1 | tee "$OUT/saver-copy.log"
    timeout 120 python3 -m bench.ipc_open "$OUT/ipc-open.json" 2>&1 | tee "$OUT/ipc-open.log"
    COLO_BENCH_SETTLE_S=1 timeout "${2:-150}" python3 -m colo.cli bench --device cuda --model qwen2-1.5b \
      --transports packed --trainers hf --reps 3 --out "$OUT/colo-bench-hf-1.5b-settled.json" 2>&1 \
      | tee "$OUT/trainers.log" | tail -8
    python3 -c "import json, sys; [print(t['trainer'], r['plan'], 'settle', t['settle_s'], {k: round(v * 1e3, 2) for k, v in r['engine_s'].items()}) for t in json.load(open(sys.argv[1]))['trainers'] for r in t['rows']]" \
      "$OUT/colo-bench-hf-1.5b-settled.json"
    ;;
  call50b)  # issue 44, 2026-11-30 (tenth session), one GPU: call50a found the memory-saver region no slower a
    # destination than plain memory (54.1-54.4 of 55.2 GB/s); now the source: out of a second mapping of the
    # segment pinned read-only as the engine pins the trainer's backup, and read-write (bench/saver_copy.py);
    # what opening a trainer's buffer costs the engine by size (bench/ipc_open.py); then hf's and fsdp's rows at
    # Qwen2-1.5B with the engine's own device span of each load (device_s) and fsdp's extractor kept over its flat
    # buffer (limit: arg 2); then fsdp's GPU tests (limit: arg 3)
    timeout 120 python3 -m bench.saver_copy "$OUT/saver-copy-qwen2-1.5b.json" --model qwen2-1.5b \
      2>&1 | tee "$OUT/saver-copy.log"
    timeout 120 python3 -m bench.ipc_open "$OUT/ipc-open.json" 2>&1 | tee "$OUT/ipc-open.log"
    timeout "${2:-200}" python3 -m colo.cli bench --device cuda --model qwen2-1.5b --transports packed \
      --trainers hf,fsdp --reps 3 --out "$OUT/colo-bench-trainers-1.5b.json" 2>&1 | tee "$OUT/trainers.log" | tail -12
    python3 -c "import json, sys; [print(t['trainer'], r['plan'], {k: round(v * 1e3, 2) for k, v in r['engine_s'].items()}) for t in json.load(open(sys.argv[1]))['trainers'] for r in t['rows']]" \
      "$OUT/colo-bench-trainers-1.5b.json"
    gpu_tests "${3:-150}" tests/gpu/test_real_trainers.py -k fsdp
    ;;
  call50a)  # issue 44, 2026-11-30 (tenth session), one GPU: where the one-copy offload-first sync writes
    # (bench/saver_copy.py: plain memory, a memory-saver region as the engine allocates, after a wake-up, one
    # allocation holding every tensor; limit: arg 2), then hf's and fsdp's rows at Qwen2-1.5B, one more sync per
    # plan under torch.profiler: where the one-copy sync-first sync's 6-10 ms beyond its copy go (limit: arg 3)
    timeout "${2:-120}" python3 -m bench.saver_copy "$OUT/saver-copy-qwen2-1.5b.json" --model qwen2-1.5b \
      2>&1 | tee "$OUT/saver-copy.log"
    rm -rf /tmp/prof
    COLO_BENCH_PROFILE=/tmp/prof timeout "${3:-260}" python3 -m colo.cli bench --device cuda --model qwen2-1.5b \
      --transports packed --trainers hf,fsdp --reps 3 --out "$OUT/colo-bench-trainers-profiled.json" 2>&1 \
      | tee "$OUT/trainers-profiled.log" | tail -12
    for f in /tmp/prof/*sync-first.txt; do
      [ -f "$f" ] && { echo "== $f"; sed -n 1,24p "$f" | cut -c1-230; }
    done
    tar czf "$OUT/profiles.tgz" -C /tmp prof
    ;;
  savercopy)  # issue 44 (prepared 2026-11-29, ninth session; not run yet), one GPU: where the one-copy offload-first
    # sync writes. A model's tensors (arg 2, default qwen2-1.5b) copied one by one out of a registered /dev/shm segment
    # into plain device memory, into a memory-saver region as colo's engine allocates its parameters, and into that
    # region after a pause and a resume (bench/saver_copy.py; about 30 s; limit: arg 3)
    timeout "${3:-120}" python3 -m bench.saver_copy "$OUT/saver-copy-${2:-qwen2-1.5b}.json" --model "${2:-qwen2-1.5b}" \
      2>&1 | tee "$OUT/saver-copy.log"
    ;;
  call49d)  # issue 44, 2026-11-29 (ninth session), one GPU, with what device time was left: the limits' new
    # helpers' GPU test, then the FSDP2 trainer's rows at Qwen2-1.5B beside host->device out of a registered /dev/shm
    # segment, whole and in the model's 338 tensors one by one (where the one-copy offload-first sync's time goes;
    # limit: arg 2)
    gpu_tests 60 tests/gpu/test_bench_limits.py
    timeout "${2:-170}" python3 -m colo.cli bench --device cuda --model qwen2-1.5b --transports packed \
      --trainers fsdp --reps 3 --out "$OUT/colo-bench-fsdp-1.5b.json" 2>&1 | tee "$OUT/trainers.log" | tail -12
    python3 -c "import json, sys; l = json.load(open(sys.argv[1]))['limits']; print({k: v for k, v in l.items() if 'registered' in k or 'pinned' in k})" \
      "$OUT/colo-bench-fsdp-1.5b.json"
    ;;
  call49c)  # issue 46, 2026-11-29 (ninth session), two GPUs: Qwen2-7B at TP=2 with 2048 MiB buckets, the synthetic
    # layout's colo-packed rows beside slime-style at the same size (call49b: 1024 MiB took sync-first from 0.10-0.13 s
    # to 0.084 s and offload-first to 0.189 s, 0.889 of its floor; limit: arg 2); then colo's real megatron-core
    # trainer's packed rows at 1024 MiB (limit: arg 3)
    ab_rows "$PWD" bucket2048 "${2:-120}" --bucket-mib 2048 --rows colo-packed,slime-style
    tp2_megatron_rows "${3:-150}" --bucket-mib 1024
    ;;
  call49b)  # issue 46, 2026-11-29 (ninth session), two GPUs: what one all-gather costs the host (collcost_runs; limit
    # per run: arg 2); then Qwen2-7B at TP=2, the synthetic layout's colo-packed rows as set up by default, with
    # torch's flight recorder off, and with 1024 MiB buckets beside slime-style at the same size (the issue fixes the
    # staging bound as 2 x bucket + 64 MiB, not the bucket; limit per run: arg 3)
    collcost_runs "${2:-90}"
    ab_rows "$PWD" fr-default "${3:-120}"
    TORCH_FR_BUFFER_SIZE=0 ab_rows "$PWD" fr-off "${3:-120}"
    ab_rows "$PWD" bucket1024 "${3:-120}" --bucket-mib 1024 --rows colo-packed,slime-style
    ;;
  call48d)  # issue 44, 2026-11-29 (eighth session), one GPU, with what device time was left: Megatron's rows at
    # Qwen2-1.5B after a sender stopped polling its events beside a gather thread (f70b65a; six 512 MiB buckets are
    # gathered in a thread) and the row-parallel blocks' change; limit: arg 2
    timeout "${2:-150}" python3 -m colo.cli bench --device cuda --model qwen2-1.5b --transports packed \
      --trainers megatron --reps 3 --out "$OUT/colo-bench-megatron-1.5b.json" 2>&1 | tee "$OUT/trainers.log" | tail -12
    ;;
  call48c)  # issue 46, 2026-11-29 (eighth session), two GPUs, last call: the upload test (its first upload now after
    # the default stream, new memory after the caller's); every gpu2 test of the repository whole, three at a time,
    # timed (limit: arg 2; the issue's 5 minutes); Qwen2-7B at TP=2, every row of the synthetic layout (limit: arg 3);
    # its colo-packed rows with megatron.py of f70b65a (.whl/ab-f70b65a-megatron.tgz: the caller's stream waited for
    # at each call and before each row-parallel tensor's first block; limit: arg 4)
    gpu_tests 60 "tests/extractors/test_megatron.py::test_an_upload_from_pinned_host_runs_on_its_stream_and_the_callers_stream_waits_for_it"
    gpu2_suite "${2:-250}"
    tp2_rows "${3:-160}"
    ab_base .whl/ab-f70b65a-megatron.tgz
    ab_rows /tmp/base before "${4:-100}"
    ;;
  call48b)  # issue 46, 2026-11-29 (eighth session), two GPUs: no event-loop polling beside a gather thread (f70b65a)
    # against its parent (.whl/ab-b27a6a9-transports.tgz: colo/transports/base.py and packed.py of b27a6a9 over a copy
    # of this tree) on one machine: now, before, now; Qwen2-7B at TP=2, the synthetic layout's colo-packed rows (limit
    # per run: arg 2; the first run on a fresh machine needs about 20 s more); then the real megatron-core trainer's
    # packed rows (limit: arg 3)
    ab_base .whl/ab-b27a6a9-transports.tgz
    for run in now-1 before-1 now-2; do
      dir=$PWD; [ "${run%-*}" = before ] && dir=/tmp/base
      ab_rows "$dir" "$run" "${2:-110}"
    done
    tp2_megatron_rows "${3:-140}"
    ;;
  call48a)  # issue 46, 2026-11-29 (eighth session), two GPUs: a call's row-gathered outputs in one coalesced
    # all-gather, 48 MiB row-parallel blocks, an in-place bucket's event recorded without a thread hop (fc13b32,
    # d83ec55), measured against megatron.py and packed.py of 4e8e47b (.whl/ab-4e8e47b.tgz over a copy of this tree)
    # on one machine, alternating: Qwen2-7B at TP=2, the synthetic layout's colo-packed rows (limit per run: arg 2);
    # the second "now" run also profiles each rank's extraction (cProfile: the calls left). First the upload test
    gpu_tests 60 "tests/extractors/test_megatron.py::test_an_upload_from_pinned_host_runs_on_its_stream_and_the_callers_stream_waits_for_it"
    ab_base .whl/ab-4e8e47b.tgz
    for round in 1 2; do
      for side in now before; do
        dir=$PWD; [ "$side" = before ] && dir=/tmp/base
        extra=""; [ "$side$round" = now2 ] && extra="--host-profile /tmp/hp"
        ab_rows "$dir" "$side-$round" "${2:-100}" $extra
      done
    done
    [ -d /tmp/hp ] && tar czf "$OUT/host-profiles.tgz" -C /tmp hp && head -30 /tmp/hp/host-sync-first-rank0.txt | cut -c1-150
    ;;
  call47a)  # prepared for the session after 2026-11-29's seventh (two GPUs, nvidia-h200-x2; not run yet): every
    # gpu2 test of the repository whole, three at a time, timed (limit: arg 2; the issue's 5 minutes), after the
    # two mends its last whole run lacked (the real trainer's bound, the notebook's collection); then Qwen2-7B at
    # TP=2, the synthetic layout's every row and colo's real megatron-core trainer's packed rows (limits: args 3, 4)
    gpu2_suite "${2:-300}"
    tp2_rows "${3:-150}"
    tp2_megatron_rows "${4:-140}"
    ;;
  call47b)  # prepared for the session after 2026-11-29's seventh (one GPU; not run yet): the FSDP2 trainer's rows at
    # Qwen2-1.5B now that its masters and moments are DTensors over one buffer each (its pause: 0.83-0.85 of the link
    # before; limit: arg 2), then its GPU tests (the one-GPU demo under each plan with fsdp; limit: arg 3). hf's rows
    # alone take more than 130 s (call44e): an A/B of 27bf731 needs about 200 s a side
    # (arg 4: the trainers, default fsdp; fsdp,megatron adds Megatron's rows after 27bf731)
    timeout "${2:-200}" python3 -m colo.cli bench --device cuda --model qwen2-1.5b --transports packed \
      --trainers "${4:-fsdp}" --reps 3 --out "$OUT/colo-bench-fsdp-1.5b.json" 2>&1 | tee "$OUT/trainers.log" | tail -14
    gpu_tests "${3:-150}" "tests/gpu/test_one_gpu.py::test_demo_on_cuda_with_each_framework_trainer_verifies_every_sync" \
      tests/gpu/test_real_trainers.py
    ;;
  call44d)  # issue 44, last call of 2026-11-29 (fifth session): the FSDP2 trainer's rows at Qwen2-1.5B after colo's
    # engine keeps its row blocks, planned layouts and summed-load tables across a release that the memory saver
    # paused (every cycle releases the engine's weights); every verified cycle checks the digest. Limit: arg 2
    timeout "${2:-170}" python3 -m colo.cli bench --device cuda --model qwen2-1.5b --transports packed \
      --trainers fsdp --reps 3 --out "$OUT/colo-bench-fsdp-1.5b.json" 2>&1 | tee "$OUT/trainers.log" | tail -8
    ;;
  trainer7b)  # issue 44 item 5: one real trainer's rows at Qwen2-7B (hf, fsdp or megatron: arg 2), both plans,
    # what --verify every adds; bf16 parameters, fp32 masters and moments: needs an H200. Limit: arg 3
    timeout "${3:-560}" python3 -m colo.cli bench --device cuda --model qwen2-7b --transports packed \
      --trainers "$2" --reps 3 --out "$OUT/colo-bench-trainers-7b-$2.json" 2>&1 | tee "$OUT/trainers-7b-$2.log" | tail -24
    ;;
  profile44)  # issue 44 item 3's first step: where a sync's time goes. Every real trainer's rows at one model
    # (arg 2, default qwen2-1.5b; --reps 1; the trainers: arg 4, default all three), then one more plain sync per plan under torch.profiler
    # (colo/apps/bench_trainers.py PROFILE_ENV): the trainer process's kernels and operators. Limit: arg 3
    rm -rf /tmp/prof
    COLO_BENCH_PROFILE=/tmp/prof timeout "${3:-500}" python3 -m colo.cli bench --device cuda --model "${2:-qwen2-1.5b}" \
      --transports packed --trainers "${4:-hf,fsdp,megatron}" --reps 1 --out "$OUT/colo-bench-trainers-profiled.json" 2>&1 \
      | tee "$OUT/trainers-profiled.log" | tail -10
    for f in /tmp/prof/*sync-first.txt /tmp/prof/*offload-first.txt; do
      [ -f "$f" ] && { echo "== $f"; sed -n 1,24p "$f" | cut -c1-230; }
    done
    tar czf "$OUT/profiles.tgz" -C /tmp prof
    ;;
  verify31)  # issue 31 item 2 after colo's engine began to sum a verified load as it writes it and to be probed
    # once per engine: the device digest's GPU tests (the summed load from pinned memory among them), then the
    # real trainers' rows at Qwen2-1.5B with what verification adds to a sync (verify_adds_of_sync; limit: arg 2)
    python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_digest_cuda.py 2>&1 | tee "$OUT/gpu-tests.log" | tail -8
    timeout "${2:-300}" python3 -m colo.cli bench --device cuda --model qwen2-1.5b --transports packed \
      --trainers hf,fsdp,megatron --reps 3 --out "$OUT/colo-bench-trainers-1.5b.json" 2>&1 | tee "$OUT/trainers.log" | tail -16
    ;;
  verify)  # issue 31 item 2: the device digest's GPU tests, the one-GPU tests (every demo verifies every
    # sync through it), and colo bench --device cuda with verify_s per row
    python3 -m pytest -q -p no:cacheprovider -m gpu --durations=8 tests/gpu/test_digest_cuda.py tests/gpu/test_one_gpu.py \
      2>&1 | tee "$OUT/gpu-tests.log" | tail -22
    python3 -m colo.cli bench --device cuda --model qwen2-1.5b,qwen2-7b --reps 3 --out "$OUT/colo-bench-cuda.json" \
      2>&1 | tee "$OUT/colo-bench-cuda.log" | tail -8
    ;;
  trainers)  # issue 31 item 1: bf16 real trainers (hf one-copy), their GPU tests, the device digest
    python3 -m pytest -q -p no:cacheprovider -m gpu --durations=10 tests/gpu/test_real_trainers.py tests/gpu/test_digest_cuda.py \
      tests/gpu/test_one_gpu.py -k "real_trainers or digest or framework or one_bucket or larger_than" \
      2>&1 | tee "$OUT/gpu-tests.log" | tail -25
    python3 -m bench.digest_speed "$OUT/digest-speed.json" 2>&1 | tail -8
    ;;
  trainer-syncs)  # issue 31 items 3 and 4: each real trainer's syncs and transitions at 1.5B (further args: bench.trainer_syncs)
    python3 -m bench.trainer_syncs "$OUT/trainer-syncs.json" --trace-dir /tmp/ts "${@:2}" 2>&1 | tee "$OUT/trainer-syncs.log" | tail -20
    ;;
  lora43)  # issue 43 on one GPU: LoRA adapters into colo's engine through CUDA IPC (its GPU test: never run on a
    # GPU before), then the adapter sync's rows beside the full sync of the same model at Qwen2-1.5B and
    # Qwen2-7B (packed, rank 8), each against 1.2 x its bytes / pinned host->device + 5 ms measured in the same
    # run. Limits: arg 2 the tests, arg 3 the bench
    timeout "${2:-200}" python3 -m pytest -q -p no:cacheprovider -m gpu -rf --tb=short tests/gpu/test_adapters_cuda.py \
      2>&1 | tee "$OUT/gpu-adapters.log" | tail -8
    # the engine verbs' new arguments (digest order=, logits adapter=) under a plain verified demo
    demo plain3 --steps 3
    timeout "${3:-330}" python3 -m colo.cli bench --device cuda --model qwen2-1.5b,qwen2-7b --transports packed \
      --trainers none --lora-rank 8 --reps 5 --out "$OUT/colo-bench-lora-cuda.json" 2>&1 | tee "$OUT/colo-bench-lora.log" | tail -14
    ;;
  lora43b)  # issue 43, where the adapter sync's time goes on one GPU: the sender and colo's engine's adapter host in
    # one process under cProfile (bench/adapter_profile.py, Qwen2-1.5B rank 8), after the adapters' GPU test, then
    # colo bench's adapter rows at Qwen2-1.5B and 7B again. Limits: arg 2 the test and the profile, arg 3 the bench
    timeout "${2:-150}" python3 -m pytest -q -p no:cacheprovider -m gpu -rf --tb=short tests/gpu/test_adapters_cuda.py \
      2>&1 | tee "$OUT/gpu-adapters.log" | tail -3
    timeout "${2:-150}" python3 -m bench.adapter_profile "$OUT/adapter-profile-1.5b.txt" --model qwen2-1.5b 2>&1 | head -30
    timeout "${3:-200}" python3 -m colo.cli bench --device cuda --model qwen2-1.5b,qwen2-7b --transports packed \
      --trainers none --lora-rank 8 --reps 5 --out "$OUT/colo-bench-lora-cuda.json" 2>&1 | tee "$OUT/colo-bench-lora.log" | tail -5
    ;;
  lora43c)  # issue 43 after the one-request stage (10522d7): the device digest's tests (the batched kernel now
    # takes a meta table; Spans: one launch per word size) and the adapters' GPU test, where the time goes now
    # (bench/adapter_profile.py, Qwen2-1.5B rank 8), then colo bench's adapter rows at Qwen2-1.5B and 7B against
    # 1.2 x bytes / pinned host->device + 5 ms of the same run. Limits: arg 2 the tests and the profile, arg 3 the bench
    timeout "${2:-200}" python3 -m pytest -q -p no:cacheprovider -m gpu -rf --tb=short tests/gpu/test_digest_cuda.py \
      tests/gpu/test_adapters_cuda.py 2>&1 | tee "$OUT/gpu-digest-adapters.log" | tail -4
    timeout "${2:-200}" python3 -m bench.adapter_profile "$OUT/adapter-profile-1.5b.txt" --model qwen2-1.5b 2>&1 | head -3
    timeout "${3:-240}" python3 -m colo.cli bench --device cuda --model qwen2-1.5b,qwen2-7b --transports packed \
      --trainers none --lora-rank 8 --reps 5 --out "$OUT/colo-bench-lora-cuda.json" 2>&1 | tee "$OUT/colo-bench-lora.log" | tail -6
    ;;
  tests)
    python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_one_gpu.py tests/device/test_cuda_memory.py tests/transports/test_staging_pipeline.py tests/device/test_one_copy.py 2>&1 | tee "$OUT/gpu-tests.log" | tail -15
    ;;
  small)  # issue 18's demo-model target: the demo's own syncs (transfer_s, verification beside it) in one
    # 512 MiB bucket and in the default 1 MiB buckets, both source plans, every sync verified; and one
    # timeline of the host path (bench/sync_timeline.py) for where the time goes
    for plan in offload-first sync-first; do
      for b in 512 1; do
        python3 -m colo.cli demo --device cuda --quiet --steps 12 --verify every --plan $plan --bucket-mib $b \
          --trace "$OUT/small-$plan-$b.jsonl" > /tmp/small.log 2>&1 || { echo "demo $plan $b failed"; tail -5 /tmp/small.log; }
        python3 -c "
import json, statistics as st, sys
e = [json.loads(l) for l in open(sys.argv[1])]
s = [x for x in e if x['event'] == 'sync.finished'][1:]
t = sorted(x['transfer_s'] * 1e3 for x in s); v = [x['verify_s'] * 1e3 for x in s]
print(f'{sys.argv[2]} {sys.argv[3]} MiB: transfer ms median {st.median(t):.2f} min {t[0]:.2f} max {t[-1]:.2f} over {len(t)} syncs '
      f'(first sync excluded); verify ms median {st.median(v):.1f}; failed phases {sum(x[\"event\"] == \"phase.failed\" for x in e)}')
" "$OUT/small-$plan-$b.jsonl" $plan $b
      done
    done
    python3 bench/sync_timeline.py "$OUT/small-timeline.json" -- --device cuda --steps 12 --verify none --quiet \
      --bucket-mib 512 --trace /tmp/small-timeline.jsonl | grep "^sync" | tail -3 | cut -c1-200
    ;;
  demos)
    demo gpu-demo --steps 8
    for trainer in megatron fsdp; do
      for plan in offload-first sync-first; do
        demo "gpu-$trainer-$plan" --trainer "$trainer" --plan "$plan" --steps 3 --mem-fraction-static 0.5
      done
    done
    ;;
  bench)  # Qwen2-7B and Qwen2-1.5B shapes: colo's syncs, their floors, and first checkpoint-engine, each
    # model in a process of its own (python -m bench.peer) before any of colo's rows; further arguments
    # go to bench.gpu_sync (--models qwen2-7b; --layers 2 --reps 1: a quick check of the whole path)
    python3 -m bench.gpu_sync "$OUT/bench-gpu.json" "${@:2}" 2>&1 | tee "$OUT/bench-gpu.log" | tail -60
    ;;
  peer)  # checkpoint-engine alone, as a user runs it: its default, a persistent process group, each bucket
    # cap; further arguments go to bench.peer (--model qwen2-1.5b, --buckets-gib 0.5,1,2,4, --reps 3)
    python3 -m bench.peer "$OUT/peer.json" "${@:2}" 2>&1 | tee "$OUT/peer.log" | tail -25
    ;;
  multi)  # two GPUs: every trainer under both source plans, a killed engine rank, a GPU count too large
    python3 -m pytest -q -p no:cacheprovider -m gpu2 tests/gpu/test_two_gpus.py 2>&1 | tee "$OUT/gpu2-tests.log" | tail -15
    ;;
  tune)  # issue 17: record a Qwen2-1.5B demo, tune it, run at the recommendation and at +0.03 (every run
    # kept, whatever the one before did: the traces say why a run failed where it did)
    demo gpu-tune-baseline --model qwen2-1.5b --steps 2 --mem-fraction-static 0.5 --bucket-mib 64
    python3 -m colo.cli tune "$OUT/gpu-tune-baseline.jsonl" | tee "$OUT/gpu-tune.txt"
    python3 -m colo.cli tune "$OUT/gpu-tune-baseline.jsonl" --json > /tmp/tune.json
    mfs=$(python3 -c "import json; print(json.load(open('/tmp/tune.json'))['mem_fraction_static'])")
    bucket=$(python3 -c "import json; print(json.load(open('/tmp/tune.json'))['bucket_mib'])")
    above=$(python3 -c "print(round($mfs + 0.03, 2))")
    demo gpu-tune-at --model qwen2-1.5b --steps 2 --mem-fraction-static "$mfs" --bucket-mib "$bucket"
    python3 -m colo.cli tune "$OUT/gpu-tune-at.jsonl" | tee -a "$OUT/gpu-tune.txt"
    demo gpu-tune-above --model qwen2-1.5b --steps 2 --mem-fraction-static "$above" --bucket-mib "$bucket"
    nvidia-smi --query-gpu=memory.used,memory.total --format=csv,noheader
    ;;
  tune-test)  # issue 17's gpu test; its traces and tune output come back in $OUT
    COLO_GPU_TUNE_OUT="$OUT" python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_tune.py 2>&1 \
      | tee "$OUT/gpu-tune-test.log" | tail -30
    ;;
  moe2)  # issue 15's rehearsal on two GPUs (nvidia-h200-x2): the Qwen3-30B-A3B shape cut to 4 layers
    # (128 experts of 768 each, 6.2 GB), trainer TP=2 + EP=2, engine TP-MoE over 2; the same code as bench8
    python3 -m bench.multi_gpu --device cuda --gpus 2 --model qwen3-30b-a3b --layers "${2:-4}" \
      --out "$OUT/bench-moe2.json" 2>&1 | tee "$OUT/bench-moe2.log" | tail -40
    ;;
  bench8)  # issue 15 on nvidia-h200-x8: Qwen3-30B-A3B shapes (61 GB bf16), trainer TP=8 + EP=8, engine TP=8
    # (TP-MoE); refused with exit 2 on a machine with fewer than 8 GPUs
    python3 -m bench.multi_gpu --device cuda --gpus 8 --model qwen3-30b-a3b --out "$OUT/bench-moe8.json" 2>&1 \
      | tee "$OUT/bench-moe8.log" | tail -40
    ;;
  race34)  # issue 34 item 2: the sender's streams against a gather still landing on the default stream (one GPU)
    python3 -m pytest -q -p no:cacheprovider -m gpu tests/transports/test_staging_pipeline.py "${@:2}" 2>&1 \
      | tee -a "$OUT/race.log" | tail -6
    ;;
  issue34)  # issue 34 on two GPUs (nvidia-h200-x2), part 1: the two-GPU demos, every trainer under every plan,
    # a killed engine rank (further arguments go to pytest: -k, --deselect)
    # three at a time where pytest-xdist is installed (the GPU image has it): each run holds a quarter
    # of each GPU for its engine rank
    par=$(python3 -c "import xdist" 2>/dev/null && echo "-n 3")
    # (-v: each test's line as it ends, so a run stopped at its time limit still says which passed)
    python3 -m pytest -v -p no:cacheprovider -m gpu2 $par --durations=14 tests/gpu/test_two_gpus.py "${@:2}" \
      2>&1 | tee "$OUT/gpu2-tests.log" | grep -E "PASSED|FAILED|ERROR|passed|failed|s call" | tail -30
    ;;
  bench34)  # part 2: the benchmark's gpu2 tests, then Qwen2-7B TP=2 with the synthetic Megatron layout (every
    # row, the baselines beside colo) and with colo's real megatron-core trainer (its packed rows); every
    # row's digests checked; the optional argument: the real trainer's run's limit in seconds
    # side by side (each measures only its own process's memory), each stopped at 120 s by
    # pytest-timeout so that a slow one fails with its traceback instead of taking the summary along
    par=$(python3 -c "import xdist" 2>/dev/null && echo "-n 3")
    timeout 150 python3 -m pytest -v -p no:cacheprovider -m gpu2 $par --timeout=120 --durations=4 \
      tests/bench/test_multi_gpu.py 2>&1 | tee "$OUT/gpu2-bench-tests.log" | grep -E "PASSED|FAILED|Error|^E |passed|failed" | tail -20
    # --profile: one more packed sync per plan under torch.profiler, each rank's Chrome trace (one
    # archive: the device returns at most 8 files) and a summary of its GPU time in the JSON's rows
    mkdir -p /tmp/prof
    timeout 230 python3 -m bench.multi_gpu --device cuda --gpus 2 --model qwen2-7b --profile /tmp/prof \
      --out "$OUT/bench-gpu2.json" 2>&1 | tee "$OUT/bench-gpu2.log" | grep -v '^{' | tail -12
    tar -czf "$OUT/bench-gpu2-profiles.tgz" -C /tmp/prof . 2>/dev/null
    timeout "${2:-200}" python3 -m bench.multi_gpu --device cuda --gpus 2 --model qwen2-7b --trainer megatron \
      --rows colo-packed,colo-packed-serial --out "$OUT/bench-gpu2-megatron.json" 2>&1 | tee "$OUT/bench-gpu2-megatron.log" \
      | grep -v '^{' | grep -iv warn | tail -12
    ;;
  bench2)  # two GPUs: trainer TP=2 (Megatron layout), engine TP=2, Qwen2-7B shapes
    python3 -m bench.multi_gpu --device cuda --gpus 2 --model qwen2-7b --out "$OUT/bench-gpu2.json" 2>&1 \
      | tee "$OUT/bench-gpu2.log" | tail -40
    ;;
esac
