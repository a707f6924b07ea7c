"""Prefill/decode disaggregation: a `kvcache serve` worker in the prefill or the decode role,
and the handover of a prompt's KV blocks between them.

Owns: the roles and the handover options (roles.py), reading a prompt's committed blocks off a
prefill worker's pool as block values (blocks.py: the one format of kvcache/tiers/block_value.py,
its storage keys and its checks), the handovers a prefill worker holds until they are pulled or
released (held.py), the transports (Redis: redis_transport.py; a direct ZeroMQ path:
zmq_transport.py), the decode side's pull into its host tier (pull.py), the workers' extra routes
(routes.py) and CPU pinning (cpus.py).

May import: kvcache (and kvcache.tiers), runner.serve, runner.engine's objects it is handed, torch
only through runner.kv_transfer. Never imports runner.router (the router imports nothing here but
the wire names in runner/disagg/wire.py).
"""
