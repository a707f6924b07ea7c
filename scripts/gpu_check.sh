#!/usr/bin/env bash
# GPU check of the CUDA runner: the CUDA tests, then the throughput bench against transformers'
# continuous batching. Every stage runs under `timeout` (SIGINT first, so pytest still prints its
# summary and Python a traceback of where it stuck): typically about 7 minutes, and about 9 at
# most whatever hangs (every stage at its limit; the last, optional one only starts before
# 520 s). Everything, the bench JSON included, lands in one file, and goes to stdout too (the
# device tool returns the output's tail).
#
# usage: scripts/gpu_check.sh [RESULT_FILE]     default: $OUT/gpu_check.txt (else /tmp/...)
# knobs: GPU_CHECK_TESTS_S (default 150), GPU_CHECK_BENCH_S (default 340),
#        GPU_CHECK_TESTS (the test files; default: the CUDA, GPU bench, Triton and engine ones),
#        GPU_CHECK_BENCH_ARGS (extra runner.bench.gpu_bench flags, e.g. "--num-seqs 128"),
#        PYTHON (default: python3, else python)
set -u
cd "$(dirname "$0")/.."
RESULT="${1:-${OUT:-/tmp}/gpu_check.txt}"
mkdir -p "$(dirname "$RESULT")"
BENCH_JSON="$(dirname "$RESULT")/gpu_bench.json"
TESTS_S="${GPU_CHECK_TESTS_S:-150}"
BENCH_S="${GPU_CHECK_BENCH_S:-340}"
DEFAULT_TESTS="tests/model/test_cuda.py tests/bench/test_gpu_bench.py tests/backends/triton/test_triton_attention.py"
DEFAULT_TESTS="$DEFAULT_TESTS tests/backends/triton/test_triton_rms_norm.py"
TESTS="${GPU_CHECK_TESTS:-$DEFAULT_TESTS tests/engine/test_engine_equivalence.py}"
# The scripts import the project from this checkout (the GPU machine does not install it).
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# The GPU machine has no network: never wait on a hub look-up.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
# The GPU image's interpreter (the one with CUDA torch) is `python3`; a bare `python` may be
# missing there or be another interpreter.
PY="${PYTHON:-$(command -v python3 || command -v python)}"
START=$(date +%s)

section() { printf '\n== %s  (t=%ss)\n' "$1" "$(($(date +%s) - START))"; }
verdict() {  # name, exit code
  case "$2" in
    0) echo "-- $1: OK" ;;
    124 | 137) echo "-- $1: TIMED OUT (exit $2)" ;;
    *) echo "-- $1: FAILED (exit $2)" ;;
  esac
}

{
  section "environment"
  date -u
  git rev-parse --short HEAD 2>/dev/null || true
  timeout 20 nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version \
    --format=csv 2>&1 || echo "nvidia-smi unavailable"
  timeout 60 "$PY" -c 'import torch, triton, transformers
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
print("triton", triton.__version__, "transformers", transformers.__version__)
print("device", torch.cuda.get_device_name() if torch.cuda.is_available() else "none")'

  section "tests (limit ${TESTS_S}s)"
  # shellcheck disable=SC2086  # TESTS is a list of paths on purpose
  timeout -s INT -k 15 "$TESTS_S" "$PY" -m pytest -v --tb=short -rs -p no:cacheprovider --durations=10 \
    $TESTS
  verdict "tests" $?

  section "bench (limit ${BENCH_S}s)"
  rm -f "$BENCH_JSON"
  # shellcheck disable=SC2086  # GPU_CHECK_BENCH_ARGS is a list of flags on purpose
  timeout -s INT -k 15 "$BENCH_S" "$PY" -m runner.bench.gpu_bench --out "$BENCH_JSON" ${GPU_CHECK_BENCH_ARGS:-}
  verdict "bench" $?

  section "bench results (JSON; partial if the bench was cut short)"
  cat "$BENCH_JSON" 2>/dev/null || echo "(no bench JSON written)"

  # This host's Python between steps, on its own CPU (tiny model, ~10 s): set against the
  # bench's decode_step_ms_median, it says whether the GPU waits on the host. Only with time
  # to spare: the whole check must stay inside the device tool's 10 minutes a command.
  section "host time per step (limit 30s)"
  if [ $(($(date +%s) - START)) -lt 520 ]; then
    timeout -s INT -k 5 30 "$PY" scripts/host_step.py --skip-forward
    verdict "host step" $?
  else
    echo "-- host step: skipped (the check has run for over 520 s)"
  fi
  section "done"
} 2>&1 | tee "$RESULT"

echo "gpu check results: $RESULT"
