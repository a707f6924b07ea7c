"""The engine, in five subpackages by concern, each importing only those below it:

- engine.api: what callers hold. `LLM` (api/llm.py, the batch calls) over the engine's front
  (api/engine.py: requests in, outputs out, the core it owns), the narrow interfaces other
  packages call (api/interface.py: serving, blocks and events, profiling; api/engine_calls.py
  their reports and block calls), streaming, beam search.
- engine.step: one engine step. `EngineCore` (step/core.py) schedules, runs the model, samples
  and settles each step (on CUDA the next step is scheduled while the device runs this one:
  step/overlap.py); the scheduler and its policies, the model runner (a step's plan), speculative
  decoding, metrics, and building an engine's parts (step/setup.py).
- engine.executor: where a step's plan runs: one worker in this process, or tensor-parallel
  ranks in processes of their own (executor/multiproc.py).
- engine.requests: a request's way in and out. Checking and tokenizing it (requests/validation.py,
  requests/intake.py), the table of live requests and whose output is whose, stopping, text,
  outputs in vLLM's shape.
- engine.kv: the KV plumbing. Host and disk tiers, block transfers, the prefix-cache file, KV
  pool sizing.

This top level holds what all four share: `EngineConfig` (config.py) and `Sequence`
(sequence.py, one request as the scheduler sees it). api may import step, io and kv; step may
import executor, io and kv; executor imports kv; io and kv import only this top level.

May import: kvcache (the block manager), backends (the CPU weight dtypes), kv_events (the
publisher's config), sampling.
"""
