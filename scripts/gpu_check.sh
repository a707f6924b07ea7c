#!/usr/bin/env bash
# GPU check of the CUDA runner, one command for a session that has the GPU (issue 39):
#   1. the CUDA tests (the CUDA, GPU bench, Triton and engine ones);
#   2. asynchronous scheduling on CUDA (tests/engine/test_async_scheduling_cuda.py);
#   2b. deterministic mode on CUDA (scripts/gpu_determinism.py), only when
#       GPU_CHECK_DETERMINISM_S is set: it needs a run of its own (see DETERMINISM_S below);
#   3. the shared-prefix decode against the plain one (bench.gpu_cascade: the data the
#      cost model is fitted to and checked by, with its verdict);
#   4. the shared-prefix workload four ways (prefix cache off, on, on eagerly, on with
#      shared-prefix attention), with the bytes a decode step reads both ways;
#   5. nano-vllm's benchmark against transformers' continuous batching (bench.gpu_bench),
#      decode time beside its memory floor;
#   6. the host's time per engine step, if time is left.
# Every stage runs under `timeout` (SIGINT first, so pytest still prints its summary and Python a
# traceback of where it stuck), and no stage's limit reaches past GPU_CHECK_TOTAL_S (570 s) from
# the start: about 7 minutes in all, under 10 whatever hangs (a stage with under 20 s left is
# skipped; the last, optional one only starts before 520 s). Each stage's JSON lands beside the result file, and
# everything goes to stdout too (the device tool returns the output's tail).
#
# usage: scripts/gpu_check.sh [RESULT_FILE]   default: $OUT/gpu_check.txt (else /tmp/...)
#        scripts/gpu_check.sh --dry-run [RESULT_FILE]   every stage at toy sizes on the CPU
#                                                       (Triton's interpreter): a minute or two
#        scripts/gpu_check.sh --fetch-wheels   here, before the GPU run: the wheels (Python 3.12,
#            x86-64) of what the engine imports and the H200 image lacks (redis, pyzmq, msgspec)
#            into .whl/ (add /.whl/ to .git/info/exclude); carry ".whl" in the device run, and
#            the check installs them into /tmp/site when the engine's imports fail without them.
# knobs: GPU_CHECK_TESTS_S (110), GPU_CHECK_ASYNC_S (240), GPU_CHECK_CASCADE_S (45),
#        GPU_CHECK_SHARED_S (90), GPU_CHECK_BENCH_S (170), GPU_CHECK_TOTAL_S (570), GPU_CHECK_TESTS (the test files),
#        GPU_CHECK_BENCH_ARGS (extra gpu_bench flags; default "--hf-deadline-s 90"),
#        PYTHON (default: python3, else python)
set -u
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--fetch-wheels" ]; then
  PY="${PYTHON:-$(command -v python3 || command -v python)}"
  wheels=""
  for name in redis pyzmq msgspec; do  # the versions this machine runs, for the same behaviour
    wheels="$wheels $name==$("$PY" -c "import importlib.metadata as m; print(m.version('$name'))")"
  done
  # shellcheck disable=SC2086  # a list of requirements on purpose
  exec "$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any -d .whl $wheels
fi
DRY=0
if [ "${1:-}" = "--dry-run" ]; then
  DRY=1
  shift
fi
RESULT="${1:-${OUT:-/tmp}/gpu_check.txt}"
mkdir -p "$(dirname "$RESULT")"
DIR="$(dirname "$RESULT")"
TESTS_S="${GPU_CHECK_TESTS_S:-110}"
ASYNC_S="${GPU_CHECK_ASYNC_S:-240}"
CASCADE_S="${GPU_CHECK_CASCADE_S:-45}"
SHARED_S="${GPU_CHECK_SHARED_S:-90}"
BENCH_S="${GPU_CHECK_BENCH_S:-170}"
TOTAL_S="${GPU_CHECK_TOTAL_S:-570}"
# Deterministic mode on CUDA (scripts/gpu_determinism.py, 3-5 minutes) does not fit beside the
# rest: off by default; a second run gives it the time of the others, e.g.
# GPU_CHECK_DETERMINISM_S=330 GPU_CHECK_ASYNC_S=0 GPU_CHECK_CASCADE_S=0 GPU_CHECK_SHARED_S=0 \
#   GPU_CHECK_BENCH_S=0 scripts/gpu_check.sh
DETERMINISM_S="${GPU_CHECK_DETERMINISM_S:-0}"
DEFAULT_TESTS="tests/model/test_cuda.py tests/bench/test_gpu_bench.py tests/backends/triton/test_triton_attention.py"
DEFAULT_TESTS="$DEFAULT_TESTS tests/backends/triton/test_triton_rms_norm.py"
DEFAULT_TESTS="$DEFAULT_TESTS tests/backends/triton/test_triton_shared_prefix.py"
DEFAULT_TESTS="$DEFAULT_TESTS tests/backends/triton/test_triton_fused_elementwise.py"
DEFAULT_TESTS="$DEFAULT_TESTS tests/backends/triton/test_triton_plan_buffers.py"
DEFAULT_TESTS="$DEFAULT_TESTS tests/model/test_cuda_shared_prefix.py tests/model/test_cuda_fused.py"
TESTS="${GPU_CHECK_TESTS:-$DEFAULT_TESTS tests/engine/test_engine_equivalence.py}"
BENCH_ARGS="${GPU_CHECK_BENCH_ARGS:---hf-deadline-s 90}"
TOY=""  # the dry run's flags: CPU, toy sizes
HOST_ARGS="--skip-forward"
if [ "$DRY" = 1 ]; then
  TOY="--device cpu --quick"
  TESTS="${GPU_CHECK_TESTS:-tests/backends/triton/test_triton_shared_prefix.py}"
  BENCH_ARGS="${GPU_CHECK_BENCH_ARGS:---skip-hf}"
  HOST_ARGS="--skip-forward --num-seqs 4 --prompt-len 8 --max-tokens 6"
  export TRITON_INTERPRET=1
fi
# The scripts import the project from this checkout (the GPU machine does not install it).
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# The GPU machine has no network: never wait on a hub look-up.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
# The GPU image's interpreter (the one with CUDA torch) is `python3`; a bare `python` may be
# missing there or be another interpreter.
PY="${PYTHON:-$(command -v python3 || command -v python)}"
START=$(date +%s)
# The benchmarks' package: bench/ at the top (runner/bench/ before it moved there).
BENCH=bench
[ -f bench/gpu_bench.py ] || BENCH=runner.bench

# clip LIMIT_S: the limit cut to what is left of TOTAL_S (0: too little left to start)
clip() {
  local left=$((TOTAL_S - ($(date +%s) - START)))
  if [ "$left" -lt 20 ]; then echo 0; elif [ "$1" -lt "$left" ]; then echo "$1"; else echo "$left"; fi
}
section() { printf '\n== %s  (t=%ss)\n' "$1" "$(($(date +%s) - START))"; }
verdict() { # name, exit code
  case "$2" in
    0) echo "-- $1: OK" ;;
    124 | 137) echo "-- $1: TIMED OUT (exit $2)" ;;
    *) echo "-- $1: FAILED (exit $2)" ;;
  esac
}
# stage NAME LIMIT_S JSON ARGS...: one python -m run under its limit, its JSON shown after it
stage() {
  local name="$1" limit json="$3"
  limit=$(clip "$2")
  shift 3
  section "$name (limit ${limit}s)"
  if [ "$limit" = 0 ]; then
    echo "-- $name: skipped (under 20 s left of ${TOTAL_S}s)"
    return
  fi
  rm -f "$json"
  timeout -s INT -k 15 "$limit" "$PY" "$@" --out "$json"
  verdict "$name" $?
  section "$name results (JSON; partial if cut short)"
  cat "$json" 2>/dev/null || echo "(no JSON written)"
}

{
  section "environment"
  date -u
  git rev-parse --short HEAD 2>/dev/null || true
  [ "$DRY" = 1 ] && echo "DRY RUN: toy sizes on the CPU; no figure here means anything"
  timeout 20 nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version \
    --format=csv 2>&1 || echo "nvidia-smi unavailable"
  # The engine imports redis, pyzmq and msgspec, which the H200 image lacks: carried wheels
  # (--fetch-wheels above) go into /tmp/site when the imports fail without them.
  imports="import $BENCH.gpu_bench, $BENCH.gpu_cascade; from kvcache import LLM"
  if ! timeout 60 "$PY" -c "$imports" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl && export PYTHONPATH="/tmp/site:$PYTHONPATH"
  fi
  if timeout 60 "$PY" -c "$imports"; then
    echo "-- imports: OK"
  else
    echo "-- imports: FAILED (scripts/gpu_check.sh --fetch-wheels, then carry .whl)"
  fi
  timeout 60 "$PY" -c 'import torch, triton, transformers
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
print("triton", triton.__version__, "transformers", transformers.__version__)
print("device", torch.cuda.get_device_name() if torch.cuda.is_available() else "none")'

  section "tests (limit ${TESTS_S}s)"
  # shellcheck disable=SC2086  # TESTS is a list of paths on purpose
  timeout -s INT -k 15 "$(clip "$TESTS_S")" "$PY" -m pytest -v --tb=short -rs -p no:cacheprovider \
    --durations=10 $TESTS
  verdict "tests" $?

  # Asynchronous scheduling on CUDA: greedy tokens as the plain loop's, no host sync in an
  # overlapped step (skipped without CUDA, so the dry run only checks that it starts).
  limit=$(clip "$ASYNC_S")
  section "asynchronous scheduling (limit ${limit}s)"
  if [ "$limit" = 0 ]; then
    echo "-- async scheduling: skipped (under 20 s left of ${TOTAL_S}s)"
  else
    OUT="${OUT:-$DIR}" timeout -s INT -k 15 "$limit" "$PY" -m pytest -q -s -p no:cacheprovider \
      tests/engine/test_async_scheduling_cuda.py
    verdict "async scheduling" $?
  fi

  # Deterministic mode on CUDA: answers bitwise equal cache on, off and alone, and its cost
  # (GPU_CHECK_TOTAL_S keeps the whole check inside the device tool's 10 minutes).
  if [ "$DETERMINISM_S" != 0 ]; then
    # shellcheck disable=SC2086
    stage "deterministic mode" "$DETERMINISM_S" "$DIR/gpu_determinism.json" \
      scripts/gpu_determinism.py $TOY
  fi

  # shellcheck disable=SC2086  # TOY and BENCH_ARGS are lists of flags on purpose
  stage "cascade cost model" "$CASCADE_S" "$DIR/gpu_cascade.json" -m "$BENCH.gpu_cascade" $TOY
  # shellcheck disable=SC2086
  stage "shared-prefix workload" "$SHARED_S" "$DIR/gpu_shared_prefix.json" \
    -m "$BENCH.gpu_bench" --workload shared-prefix --skip-hf --skip-check $TOY
  # shellcheck disable=SC2086
  stage "bench" "$BENCH_S" "$DIR/gpu_bench.json" -m "$BENCH.gpu_bench" $TOY $BENCH_ARGS

  # This host's Python between steps, on its own CPU (tiny model, ~10 s): set against the
  # bench's decode_step_ms_median, it says whether the GPU waits on the host. Only with time
  # to spare: the whole check must stay inside the device tool's 10 minutes a command.
  section "host time per step (limit 30s)"
  if [ $(($(date +%s) - START)) -lt 520 ]; then
    # shellcheck disable=SC2086
    timeout -s INT -k 5 30 "$PY" scripts/host_step.py $HOST_ARGS
    verdict "host step" $?
  else
    echo "-- host step: skipped (the check has run for over 520 s)"
  fi
  section "done"
} 2>&1 | tee "$RESULT"

echo "gpu check results: $RESULT"
