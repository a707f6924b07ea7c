"""The measuring code, kept out of the product: it measures kvcache/ and runner/ from outside.

Owns `kvcache bench` (command.py: its command line; harness.py with systems.py, peers.py,
hf_continuous.py, beams.py, workloads.py, table.py, matmul_timer.py, background_load.py,
engine_options.py: the LLM options it sets), the
drivers of rival engines run outside the process (external.py, vllm_cpu.py with
vllm_driver.py, llama_cpp.py), the tiers' figures (tiers.py, local_redis.py), the KV store
core's microbenchmark (microbench.py), the prefill/decode interference bench over served
workers (pd_interference.py, pd_results.py, pd_interference_command.py,
pd_interference_worker.py), the GPU
bench and its profilers (gpu/bench.py, gpu/workload.py, gpu/floor.py, gpu/shared_prefix.py,
gpu/cascade.py, gpu/step_profile.py), weight-rounding quality (weight_quality.py), the soak
(soak.py, soak_checks.py, soak_workload.py) and `kvcache bench-serve` (serve/).

May import: kvcache, kv_pool (the tensors a probe allocates), attention, backends, engine,
model, sampling, serve and disagg (the served systems and their roles), cli (the one check on
written files, stdout). Never imported
by kvcache/ or runner/: only cli.py, the composition root, registers its two commands.
"""
