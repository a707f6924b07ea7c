"""`kvcache bench-serve`: load an OpenAI-compatible endpoint (`kvcache serve`, `kvcache router`,
or any other such server) the way `vllm bench serve` does, and report TTFT, inter-token and
end-to-end latency percentiles, throughput, the prefix cache's hit rate (from the responses'
usage) and, behind a kvcache router, how the requests spread over its replicas.

Owns the workloads (workload.py), the streaming client that times each request (client.py)
and the command with its report (command.py). Imports only httpx, click and the standard
library: it is a client, and loads no model.
"""
