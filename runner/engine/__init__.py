"""The engine: `LLM` (llm.py, the batch calls; `EngineInterface`, interface.py, is all that
other packages may call, and engine_calls.py its reports and block calls) over the loop
(core.py) that schedules, runs the model, samples and settles each step (on CUDA the next step
is scheduled while the device runs this one: overlap.py); the scheduler and its admission
rule, sequences and requests, stopping, streaming, outputs, speculative decoding, beam search,
metrics, and building an engine's parts (setup.py) with its model runner (model_runner.py) and
KV pool sizing (memory.py).

May import: kvcache (the block manager) and kvcache.store, attention, backends (the registry
and the CPU kernels), model, sampling, kv_events (the publisher a config turns on).
"""
