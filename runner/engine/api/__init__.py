"""What callers of the engine hold: `LLM` (llm.py, vLLM's batch calls: generate, chat, beam
search, the prefix-cache file) over the engine's front (engine.py: requests in, outputs out,
the `EngineCore` it owns), the interfaces serve, disagg, the CLI and the bench use
(interface.py: `ServingEngine`, `BlockEngine`, `ProfilingEngine`, and `EngineInterface`, all
three; engine_calls.py their reports and block calls), streamed
requests (streaming.py), beam search (beam_search.py) and the heap frozen for a batch call.

May import: engine (config, sequence), engine.step (the loop), engine.requests (requests and
outputs), engine.kv (the prefix-cache file and transfers), kvcache, sampling, kv_events (the
publisher the front starts); attention and
model for the types of what a profiler reads (the interface's ForwardParts).
"""
