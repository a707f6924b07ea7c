#!/usr/bin/env bash
# GPU check of the CUDA runner: one command that settles each target of the GPU work (issue 48)
# in at most 8.5 minutes on one H200, warm-up included. Its stages, the likeliest to fail first,
# each under its own time limit:
#   1. the CUDA tests, the fused-kernel and shared-prefix ones first;
#   2. nano-vllm's benchmark (Qwen3-0.6B shape), decode time beside its memory floor;
#   3. the SmolLM2-135M shape, the same workload;
#   4. the shared-prefix workload four ways (prefix cache off, on, on eagerly, on with
#      shared-prefix attention), with the K/V bytes read from the plans each way executed;
#   5. float32 greedy equality with transformers, every feature on, on prompts that form a
#      prefix group (so shared-prefix attention runs);
#   6. deterministic mode: 256 requests each alone against all batched.
# Each stage writes its JSON beside the result file as soon as it (or, for stage 4, each way)
# ends, so a cut keeps what was measured. The run ends with one line per target: PASS, FAIL or
# NOT RUN with its figure (bench/gpu/verdict.py). Every stage runs under `timeout` (SIGINT
# first, so pytest still prints its summary and Python a traceback of where it stuck); the
# limits add up to 495 s, and none reaches past GPU_CHECK_TOTAL_S (510 s) from the start (a
# stage with under 20 s left is skipped).
#
# usage: scripts/gpu_check.sh [RESULT_FILE]   default: $OUT/gpu_check.txt (else /tmp/...)
#        scripts/gpu_check.sh --dry-run [RESULT_FILE]   every stage at toy sizes on the CPU
#                                                       (Triton's interpreter): a few minutes
#        scripts/gpu_check.sh --fetch-wheels   here, before the GPU run: the wheels (Python 3.12,
#            x86-64) of what the engine imports and the H200 image lacks (redis, pyzmq, msgspec)
#            into .whl/ (add /.whl/ to .git/info/exclude); carry ".whl" in the device run, and
#            the check installs them into /tmp/site when the engine's imports fail without them.
# knobs: GPU_CHECK_TESTS_S (100), GPU_CHECK_BENCH_S (110), GPU_CHECK_SMOLLM2_S (60),
#        GPU_CHECK_SHARED_S (90), GPU_CHECK_GREEDY_S (45), GPU_CHECK_DETERMINISM_S (90),
#        GPU_CHECK_TOTAL_S (510), GPU_CHECK_TESTS (the test files), PYTHON (default: python3,
#        else python)
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
TESTS_S="${GPU_CHECK_TESTS_S:-100}"
BENCH_S="${GPU_CHECK_BENCH_S:-110}"
SMOLLM2_S="${GPU_CHECK_SMOLLM2_S:-60}"
SHARED_S="${GPU_CHECK_SHARED_S:-90}"
GREEDY_S="${GPU_CHECK_GREEDY_S:-45}"
DETERMINISM_S="${GPU_CHECK_DETERMINISM_S:-90}"
TOTAL_S="${GPU_CHECK_TOTAL_S:-510}"
# The fused kernels and shared-prefix attention first: the newest work, the likeliest to fail.
DEFAULT_TESTS="tests/model/test_cuda_fused.py tests/model/test_cuda_shared_prefix.py"
DEFAULT_TESTS="$DEFAULT_TESTS tests/backends/triton/test_triton_fused_elementwise.py"
DEFAULT_TESTS="$DEFAULT_TESTS tests/backends/triton/test_triton_shared_prefix.py"
DEFAULT_TESTS="$DEFAULT_TESTS tests/backends/triton/test_triton_plan_buffers.py"
DEFAULT_TESTS="$DEFAULT_TESTS tests/engine/test_async_scheduling_cuda.py tests/model/test_cuda.py"
DEFAULT_TESTS="$DEFAULT_TESTS tests/backends/triton/test_triton_attention.py"
DEFAULT_TESTS="$DEFAULT_TESTS tests/backends/triton/test_triton_rms_norm.py"
DEFAULT_TESTS="$DEFAULT_TESTS tests/model/test_blend.py::test_placing_and_blending_on_cuda"
DEFAULT_TESTS="$DEFAULT_TESTS tests/tiers/test_deferred_copies.py::test_cuda_host_tier_overlapped_equals_tierless"
TESTS="${GPU_CHECK_TESTS:-$DEFAULT_TESTS}"
TOY=""  # the dry run's flags: CPU, toy sizes
# Deterministic mode: 256 requests behind a 512-token prompt, 16 tokens each, every one alone
# and all batched (SmolLM2's shape: 256 requests one at a time fit the stage's limit).
DET_ARGS="--shape smollm2-135m --num-seqs 256 --alone 256 --prefix-len 512 --new-tokens 16"
if [ "$DRY" = 1 ]; then
  TOY="--device cpu --quick"
  TESTS="${GPU_CHECK_TESTS:-tests/backends/triton/test_triton_plan_buffers.py}"
  DET_ARGS=""
  # Deterministic mode's toy run takes over two minutes in the interpreter on two loaded cores.
  DETERMINISM_S="${GPU_CHECK_DETERMINISM_S:-240}"
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
TESTS_RC_FILE="$DIR/gpu_tests.rc"

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
# stage NAME LIMIT_S JSON ARGS...: one python run under its limit, its JSON shown after it
stage() {
  local name="$1" limit json="$3"
  limit=$(clip "$2")
  shift 3
  section "$name (limit ${limit}s)"
  rm -f "$json"
  if [ "$limit" = 0 ]; then
    echo "-- $name: skipped (under 20 s left of ${TOTAL_S}s)"
    return
  fi
  timeout -s INT -k 10 "$limit" "$PY" "$@" --out "$json"
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
  imports="import bench.gpu.bench, bench.gpu.verdict; from kvcache import LLM"
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

  limit=$(clip "$TESTS_S")
  section "CUDA tests (limit ${limit}s)"
  rm -f "$TESTS_RC_FILE"
  if [ "$limit" = 0 ]; then
    echo "-- tests: skipped"
  else
    # shellcheck disable=SC2086  # TESTS is a list of paths on purpose
    OUT="${OUT:-$DIR}" timeout -s INT -k 10 "$limit" "$PY" -m pytest -q --tb=short -rs \
      -p no:cacheprovider --durations=5 $TESTS
    rc=$?
    echo "$rc" >"$TESTS_RC_FILE"
    verdict "tests" "$rc"
  fi

  # shellcheck disable=SC2086  # TOY is a list of flags on purpose
  stage "nano-vllm benchmark (Qwen3-0.6B)" "$BENCH_S" "$DIR/gpu_bench.json" \
    -m bench.gpu.bench --skip-hf --skip-check $TOY
  # shellcheck disable=SC2086
  stage "SmolLM2-135M shape" "$SMOLLM2_S" "$DIR/gpu_smollm2.json" \
    -m bench.gpu.bench --shape smollm2-135m --skip-hf --skip-check $TOY
  # shellcheck disable=SC2086
  stage "shared-prefix workload" "$SHARED_S" "$DIR/gpu_shared_prefix.json" \
    -m bench.gpu.bench --workload shared-prefix --skip-hf --skip-check $TOY
  # shellcheck disable=SC2086
  stage "float32 greedy equality" "$GREEDY_S" "$DIR/gpu_greedy.json" \
    -m bench.gpu.bench --check-only $TOY
  # shellcheck disable=SC2086
  stage "deterministic mode" "$DETERMINISM_S" "$DIR/gpu_determinism.json" \
    scripts/gpu_determinism.py --stages answers --no-control $DET_ARGS $TOY

  section "verdict"
  [ "$DRY" = 1 ] && echo "(DRY RUN: toy sizes; the lines show the check runs, not the targets)"
  rc_arg=""
  [ -s "$TESTS_RC_FILE" ] && rc_arg="--tests-rc $(cat "$TESTS_RC_FILE")"
  # shellcheck disable=SC2086
  timeout 30 "$PY" -m bench.gpu.verdict "$DIR" $rc_arg
  section "done"
} 2>&1 | tee "$RESULT"

echo "gpu check results: $RESULT"
