"""`kvcache router`: one OpenAI endpoint in front of several `kvcache serve` replicas.

Owns the routing side only: the replicas and their health (replicas.py), what each replica
has been sent as chained block hashes (prefix_index.py), or, with --kv-events, what its KV
events say it caches (event_index.py, fed by event_feed.py), how many conversations share each
block (shared_prefix.py), the work each replica has in flight (load.py), a request's hashes
computed as the engine computes them (prompt_hashes.py), the policies (policy.py), the proxy
routes with streaming pass-through and retries (app.py) and the click command (command.py);
the disaggregated router (pd.py) reads its workers' answers as pd_messages.py types them.
May import: kvcache (its hashing), engine (only requests.py's chat rendering), serve (its
request models), kv_events (the events' schema), cli (the option builders every command
shares); never the engine itself: a router loads no
model, only its tokenizer.
"""
