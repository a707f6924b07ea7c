"""KV-event options under vLLM's names (its ``--kv-events-config`` JSON), checked once."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

PUBLISHERS = ("null", "zmq")


@dataclass(frozen=True)
class KVEventsConfig:
    """Whether and where the engine publishes its KV events.

    ``endpoint`` is the PUB socket (``tcp://*:5557`` binds every interface, as vLLM's default;
    a subscriber connects to it), ``replay_endpoint`` the ROUTER socket that re-sends the last
    ``buffer_steps`` batches from a sequence number on (None: no replay), ``hwm`` the PUB
    socket's send high-water mark, ``max_queue_size`` the events waiting for the publisher's
    thread past which the oldest are dropped (a subscriber sees the gap in the sequence numbers
    and replays), ``topic`` the first frame of every message."""

    enable_kv_cache_events: bool = False
    publisher: str = "zmq"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher not in PUBLISHERS:
            raise ValueError(
                f"kv_events_config.publisher must be one of {', '.join(PUBLISHERS)}, "
                f"got {self.publisher!r}"
            )
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"kv_events_config.{name} must be an integer >= 1, got {value!r}")
        if not self.endpoint.strip():
            raise ValueError("kv_events_config.endpoint is empty")

    @property
    def publishes(self) -> bool:
        """Whether events leave the process at all."""
        return self.enable_kv_cache_events and self.publisher != "null"

    @classmethod
    def parse(cls, value: str | dict[str, object] | KVEventsConfig) -> KVEventsConfig:
        """From vLLM's JSON text (``--kv-events-config '{"enable_kv_cache_events": true}'``),
        a dict of the same keys, or a config already made; ValueError naming an unknown key
        or a bad value."""
        if isinstance(value, KVEventsConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as err:
                raise ValueError(f"kv_events_config is not JSON: {err}") from err
        if not isinstance(value, dict):
            raise ValueError(f"kv_events_config must be a JSON object, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(
                f"kv_events_config: unknown key(s) {', '.join(unknown)}; "
                f"known: {', '.join(sorted(known))}"
            )
        return cls(**value)  # type: ignore[arg-type]
