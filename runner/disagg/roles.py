"""A worker's role and its handover: `kvcache serve --role prefill|decode|both` with
`--handover zmq[://HOST:PORT] | redis://HOST:PORT/DB`. Both (the default) is the colocated
engine, unchanged. A prefill worker answers /kvcache/prefill/...; a decode worker /kvcache/pull
before the request itself (routes.py)."""

from __future__ import annotations

from dataclasses import dataclass

from kvcache.redaction import redact_url
from runner.disagg.held import DEFAULT_TTL_S, HeldHandovers
from runner.disagg.publish import Publisher
from runner.disagg.pull import DEFAULT_CHUNK_BLOCKS, Puller
from runner.disagg.redis_transport import RedisHandover
from runner.disagg.zmq_transport import ZmqHandoverServer
from runner.engine.api.interface import EngineInterface

ROLES = ("both", "prefill", "decode")
DEFAULT_HANDOVER = "zmq"
DEFAULT_HELD_BYTES = 1 << 30  # what a prefill worker holds for unpulled handovers
DEFAULT_DECODE_HOST_BYTES = 1 << 30  # the host tier a decode worker pulls into, when not set


@dataclass(frozen=True)
class RoleOptions:
    role: str = "both"
    handover: str = DEFAULT_HANDOVER
    chunk_blocks: int = DEFAULT_CHUNK_BLOCKS
    held_bytes: int = DEFAULT_HELD_BYTES
    ttl_s: float = DEFAULT_TTL_S

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if not self.handover.startswith(("zmq", "redis://", "rediss://")):
            shown = redact_url(self.handover)  # a mistyped URL may still carry its password
            raise ValueError(f"handover must be zmq, zmq://HOST:PORT or redis://..., got {shown!r}")
        if self.chunk_blocks < 1:
            raise ValueError(f"handover chunk must be >= 1 block, got {self.chunk_blocks}")

    @property
    def redis_url(self) -> str | None:
        return self.handover if self.handover.startswith("redis") else None

    def zmq_address(self) -> tuple[str, int]:
        """The prefill worker's bind address: zmq (a free loopback port) or zmq://HOST:PORT."""
        rest = self.handover.removeprefix("zmq").removeprefix("://")
        if not rest:
            return "127.0.0.1", 0
        host, sep, port = rest.rpartition(":")
        if not sep or not port.isdigit():
            raise ValueError(f"handover must be zmq://HOST:PORT, got {redact_url(self.handover)!r}")
        return host, int(port)


def engine_options_for(
    options: RoleOptions, engine_options: dict[str, object]
) -> dict[str, object]:
    """The engine's options for the role: a decode worker pulls into a host tier (1 GiB
    unless --host-cache-bytes says otherwise)."""
    if options.role == "decode" and not engine_options.get("host_cache_bytes"):
        return engine_options | {"host_cache_bytes": DEFAULT_DECODE_HOST_BYTES}
    return engine_options


@dataclass
class RoleParts:
    """What a role adds to a worker: its publisher (prefill) or puller (decode)."""

    options: RoleOptions
    publisher: Publisher | None = None
    puller: Puller | None = None
    llm: EngineInterface | None = None  # the worker's engine

    def close(self) -> None:
        if self.publisher is not None:
            self.publisher.close()
        if self.puller is not None:
            self.puller.close()


def build_role(llm: EngineInterface, options: RoleOptions) -> RoleParts:
    """The role's parts over ``llm``; nothing for "both"."""
    redis = RedisHandover(options.redis_url, llm.block_spec) if options.redis_url else None
    if options.role == "prefill":
        held = HeldHandovers(options.held_bytes, options.ttl_s)
        server = ZmqHandoverServer(held, *options.zmq_address()) if redis is None else None
        return RoleParts(options, publisher=Publisher(llm, held, server, redis), llm=llm)
    if options.role == "decode":
        return RoleParts(options, puller=Puller(llm, redis, options.chunk_blocks), llm=llm)
    return RoleParts(options, llm=llm)
