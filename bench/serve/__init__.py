"""`kvcache bench-serve`: load an OpenAI-compatible endpoint (`kvcache serve`, `kvcache router`,
or any other such server, on its chat or completions route, with its API key) the way
`vllm bench serve` does, and report TTFT, time per output token, inter-token and end-to-end
latency percentiles (under vLLM's result names too), throughput, the prefix cache's hit rate
(from the responses' usage) and, behind a kvcache router, how the requests spread over its
replicas; optionally the same load against llama.cpp's llama-server on the same GGUF.

Owns the workloads (workload.py, with the shared system prompt of system_prompt.py), the
streaming client that times each request (client.py), what hit rate a multi-turn run could
get (hit_model.py), a run against a server and the llama-server comparison (runs.py,
llama_server.py, compare.py), the report (report.py) and the command (command.py). Imports
httpx, click, the standard library, runner.cli's check on the file it writes and, for
llama-server, runner.model's lookup of the default GGUF file: it is a client, and loads no
model.
"""
