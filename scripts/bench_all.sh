#!/usr/bin/env bash
# Every workload of docs/BENCHMARKS.md's tables, each system measured side by side in one
# process. Writes docs/bench/<workload>.txt (the table) and .json (the rows).
set -uo pipefail
cd "$(dirname "$0")/.."
out=docs/bench
mkdir -p "$out"
run() {  # run NAME ARGS...
  local name=$1; shift
  kvcache bench "$@" --json "$out/$name.json" 2>/dev/null | tee "$out/$name.txt"
}
run shared_system_prompt --workload shared_system_prompt \
  --systems engine,engine-nocache,engine-static,hf-static,hf-cb
run no_sharing --workload no_sharing --systems engine,engine-nocache,hf-static
run mixed_lengths --workload mixed_lengths --systems engine,engine-static,hf-static --no-check
run mixed_lengths_batch8 --workload mixed_lengths --systems engine,engine-static,hf-static \
  --max-num-seqs 8 --no-check
run few_shot --workload few_shot --systems engine,engine-nocache,hf-static
run multi_turn --workload multi_turn --systems engine,engine-nocache,hf-static
run long_prompt --workload long_prompt --systems engine,engine-nochunk \
  --max-num-batched-tokens 64 --no-check
run long_documents --workload long_documents --systems engine,engine-kv16,hf-static
run weights_shared --workload shared_system_prompt \
  --systems engine,engine-bf16,engine-bf16dot,hf-static
run weights_no_sharing --workload no_sharing --systems engine,engine-bf16,engine-bf16dot,hf-static
run weights_batch8 --workload mixed_lengths \
  --systems engine,engine-bf16,engine-int8,engine-bf16dot --max-num-seqs 8 --no-check
run weights_one_stream --workload mixed_lengths \
  --systems engine,engine-bf16,engine-int8,engine-bf16dot --max-num-seqs 1 --no-check
# Gemma 3 270M's shape (random weights, the default tokenizer): sliding-window layers.
gemma=$(mktemp -d)/gemma3-270m
python scripts/shaped_model.py gemma3-270m "$gemma" >/dev/null 2>&1
run gemma3_long_documents --model "$gemma" --workload long_documents \
  --systems engine,engine-bf16dot,hf-static
rm -rf "$(dirname "$gemma")"
kvcache bench --workload core | tee "$out/core.txt"
