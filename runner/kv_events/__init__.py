"""KV events: what the engine's KV cache holds, published as vLLM publishes it, so that a
control plane that places requests by cache (llm-d's precise prefix-cache scorer, Dynamo's KV
router, `kvcache router`) can follow this engine as it follows a vLLM replica (docs/SERVE.md,
"KV events").

Owns: the wire schema (schema.py: ``EventBatch`` of ``BlockStored`` / ``BlockRemoved`` /
``AllBlocksCleared``, msgpack), the options (config.py: vLLM's ``--kv-events-config``), and the
publisher (publisher.py: a block-manager listener whose thread sends each step's events on a
ZeroMQ PUB socket, numbered, and answers replays of the recent ones through replay.py's
bounded ROUTER socket), and the tiers' events
(tier_events.py: the blocks the host and disk tiers hold, under media CPU and DISK).

May import: kvcache (the block manager's listener protocol and its nodes, the tiers' values).
"""
