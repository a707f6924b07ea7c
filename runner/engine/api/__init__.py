"""What callers of the engine hold: `LLM` (llm.py, vLLM's batch calls: generate, chat, encode,
beam search, the prefix-cache file), `EngineInterface` (interface.py, the one surface serve,
disagg, the CLI and the bench use; engine_calls.py its reports and block calls), streamed
requests (streaming.py), beam search (beam_search.py) and the heap frozen for a batch call.

May import: engine (config, sequence), engine.step (the loop), engine.io (requests and
outputs), engine.kv (the prefix-cache file and transfers), kvcache, sampling; attention and
model for the types of what a profiler reads (the interface's ForwardParts).
"""
