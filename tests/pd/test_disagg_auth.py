"""The workers' disaggregation routes with --api-key: every one but /health takes the server's
key (the Bearer scheme in any case, the key itself exactly), and nothing they answer shows the
handover's Redis password: not the info route, not the params a prefill answers, not a failed
pull's reason."""

from __future__ import annotations

import httpx
import pytest
import redis

from kvcache.redaction import redact_url
from tests.pd.conftest import Worker, WorkerFactory
from tests.pd.test_handover import PROMPT
from tests.redis_server import RedisServer

KEY = "sk-pd-key"
SECRET = "hunter2-pd"


def keyed(value: str | bytes) -> dict[bytes, bytes]:
    """An Authorization header of these bytes (latin-1, as HTTP sends a header)."""
    return {b"authorization": value if isinstance(value, bytes) else value.encode("latin-1")}


def test_the_info_routes_take_the_key_and_hide_the_redis_password(
    worker: WorkerFactory, redis_server: RedisServer
) -> None:
    redis.Redis.from_url(redis_server.url).config_set("requirepass", SECRET)
    url = f"redis://:{SECRET}@127.0.0.1:{redis_server.port}/0"
    auth = keyed(f"Bearer {KEY}")
    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    with worker("prefill", url, KEY) as prefill, worker("decode", url, KEY) as decode:
        for side in (prefill, decode):
            for path in ("/kvcache/disagg", "/kvcache/metrics"):
                assert httpx.get(f"{side.url}{path}").status_code == 401, path
                assert httpx.get(f"{side.url}{path}", headers=keyed("Bearer x")).status_code == 401
            assert httpx.get(f"{side.url}/health").status_code == 200  # no key needed
            info = httpx.get(f"{side.url}/kvcache/disagg", headers=auth)
            assert info.status_code == 200 and SECRET not in info.text
            assert info.json()["handover"] == redact_url(url)
        answer = httpx.post(
            f"{prefill.url}/kvcache/prefill/v1/completions", json=body, headers=auth, timeout=60
        )
        assert answer.status_code == 200 and SECRET not in answer.text
        params = answer.json()["kv_transfer_params"]
        pulled = httpx.post(f"{decode.url}/kvcache/pull", json=params, headers=auth, timeout=60)
        assert pulled.json()["blocks"] == params["num_blocks"] > 0  # the password works
        redis_server.stop()  # a failed pull's reason names the server, not its password
        other = params | {"prompt_token_ids": params["prompt_token_ids"][::-1]}  # not cached
        pulled = httpx.post(f"{decode.url}/kvcache/pull", json=other, headers=auth, timeout=60)
        assert pulled.status_code == 200 and pulled.json()["reason"] is not None
        assert SECRET not in pulled.text


@pytest.mark.parametrize(
    ("authorization", "status"),
    [
        (f"Bearer {KEY}", 200),
        (f"bearer {KEY}", 200),  # the scheme is case-insensitive (RFC 9110)
        (f"BEARER {KEY}", 200),
        (f"Bearer {KEY.upper()}", 401),  # the key is not
        (f"Bearer {KEY[:-1]}x", 401),  # as long as the key, one character off
        (f"Bearer {KEY[:-1]}", 401),
        (f"Bearer {KEY}x", 401),
        (KEY, 401),
        (f"Basic {KEY}", 401),
        (f"Bearer {KEY}\u00e9".encode("latin-1"), 401),  # a byte past ASCII: 401, not 500
    ],
)
def test_the_handover_routes_compare_the_key(
    worker: WorkerFactory, authorization: str | bytes, status: int
) -> None:
    with worker("decode", api_key=KEY) as decode:
        assert pull_status(decode, authorization) == status


def pull_status(decode: Worker, authorization: str | bytes) -> int:
    """A pull of an empty handover (a short prompt: no full block, nothing to fetch)."""
    params: dict[str, object] = {"transport": "zmq", "endpoint": "tcp://127.0.0.1:1"}
    params |= {"handover_id": "h", "prompt_token_ids": [1, 2, 3]}
    url = f"{decode.url}/kvcache/pull"
    return httpx.post(url, json=params, headers=keyed(authorization), timeout=60).status_code
