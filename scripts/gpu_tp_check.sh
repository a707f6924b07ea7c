#!/usr/bin/env bash
# Tensor parallelism on CUDA: for a machine with two or more GPUs (NCCL between the ranks).
# Runs the CUDA test of tests/engine/test_tensor_parallel.py (greedy tokens of two ranks on
# cuda:0 and cuda:1 against one rank), then the CPU tests of the same file (gloo), under one
# time limit. usage: scripts/gpu_tp_check.sh   knobs: GPU_TP_CHECK_S (480), PYTHON (python3)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
LIMIT="${GPU_TP_CHECK_S:-480}"
GPUS="$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())')"
if [ "$GPUS" -lt 2 ]; then
    echo "NOT RUN: tensor parallel on CUDA needs two GPUs, this machine has $GPUS"
    exit 0
fi
PYTHONPATH="$PWD" timeout --signal=INT "$LIMIT" "$PYTHON" -m pytest -q -x \
    tests/engine/test_tensor_parallel.py
