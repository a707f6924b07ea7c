#!/usr/bin/env bash
# One benchmark of `kvcache router` over N fresh `kvcache serve` replicas on this machine.
#   scripts/bench_serve_cluster.sh MODEL N POLICY OUT.json [bench-serve options...]
# Replica i listens on 127.0.0.1:$((BASE_PORT + 1 + i)) and is pinned to core i mod ncores
# (one torch thread each); the router listens on BASE_PORT. $SERVE_OPTIONS and $ROUTER_OPTIONS
# go to every replica and to the router. Everything started here is stopped
# by its pid at the end, however the run ends.
set -euo pipefail
model=$1 n=$2 policy=$3 out=$4
shift 4
base=${BASE_PORT:-8200}
cores=$(nproc)
pids=()
cleanup() { for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT
wait_up() { for _ in $(seq 900); do curl -sf "$1/health" >/dev/null && return 0; sleep 0.2; done; echo "$1 did not come up" >&2; return 1; }
replicas=()
for i in $(seq 0 $((n - 1))); do
  port=$((base + 1 + i))
  OMP_NUM_THREADS=1 taskset -c $((i % cores)) kvcache serve --model "$model" --port "$port" \
    --served-model-name bench ${SERVE_OPTIONS:-} >"/tmp/kvcache-replica-$port.log" 2>&1 &
  pids+=($!)
  replicas+=(--replica "http://127.0.0.1:$port")
done
for i in $(seq 0 $((n - 1))); do wait_up "http://127.0.0.1:$((base + 1 + i))"; done
kvcache router "${replicas[@]}" --policy "$policy" --port "$base" ${ROUTER_OPTIONS:-} >"/tmp/kvcache-router-$base.log" 2>&1 &
pids+=($!)
wait_up "http://127.0.0.1:$base"
kvcache bench-serve --base-url "http://127.0.0.1:$base" --result-json "$out" "$@"
