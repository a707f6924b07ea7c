"""One engine step: the loop (core.py) that schedules a batch (scheduler.py, by the rule of a
policy in policies/: continuous or static batching; admission.py), runs the model
(model_runner.py), picks the step's tokens from its logits (tokens.py; guessed tokens:
speculative.py) and settles the step (settle.py, the whole finishing path; overlap.py
on CUDA; a failing batch is retried item by item: isolation.py); the engine's lock, held
interrupts, step timing and metrics, and building an engine's parts (setup.py).

May import: engine (config, sequence), engine.executor (the workers), engine.requests (intake, the
request table, stopping, outputs), engine.kv (tiers, transfers, pool sizing), kvcache and
runner.kv_pool.store, attention, backends (the registry and the CPU and Triton kernels), model,
sampling, kv_events.
"""
