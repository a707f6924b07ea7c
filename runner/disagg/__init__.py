"""Prefill/decode disaggregation: a `kvcache serve` worker in the prefill or the decode role,
and the handover of a prompt's KV blocks between them (docs/DISAGGREGATION.md).

Owns: the roles and their options (roles.py, serve_role.py: the role starter cli.py hands the
serve command, which never imports this package), reading a prompt's committed blocks off a
prefill worker's pool as block values and checking them on arrival (blocks.py: the one format
of kvcache/tiers/block_value.py, its storage keys and its checks), the handovers a prefill
worker holds until pulled, released or expired (held.py), filling an open handover as the
prefill commits its blocks (commit_tap.py), publishing them (publish.py), the transports
(zmq_transport.py: direct; redis_transport.py: the shared Redis tier), the decode side's pull
into its host tier (pull.py), the workers' extra routes (routes.py) and CPU pinning (cpus.py).
The pd_interference bench that drives these workers lives in bench/ (pd_interference*.py).

May import: kvcache (and kvcache.tiers), serve (its app, which the roles extend), engine
(interface.py: the engine is an `EngineInterface`, never its parts; sequence.py, a queued
request's samples). Never imports bench (it measures disagg from outside), nor
runner.router: the router (runner/router/pd.py) speaks to the workers over HTTP only.
"""
