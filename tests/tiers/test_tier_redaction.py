"""A ``--remote-cache`` URL's password never reaches a log line or a warning: a Redis URL with a
password that cannot connect (nothing listens on its port) fails reads and writes, and every
message the tiers log, warn or raise shows the URL with ``***`` for the password."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from tier_values import ROOT, SPEC, chain

from kvcache import LLM, SamplingParams
from kvcache.tiers import Pending, RemoteTier, TieredStore
from tests.redis_server import free_port

SECRET = "hunter2-not-for-logs"


def test_tier_messages_hide_the_password(caplog: pytest.LogCaptureFixture) -> None:
    url = f"redis://:{SECRET}@127.0.0.1:{free_port()}/0"
    caplog.set_level(logging.DEBUG)
    store = TieredStore(SPEC, [RemoteTier(url, timeout_s=0.2)])  # warns through logging
    links = chain(list(range(100, 108)))
    assert store.lookup([h for h, _, _ in links], ROOT, [t for _, _, t in links]) == []
    key, parent, tokens = links[0]
    store.write(("remote",), [Pending(key, parent, tokens, True, bytes(SPEC.block_nbytes))])
    store.flush()
    store.close()
    messages = [record.getMessage() for record in caplog.records]
    assert any("remote tier unavailable" in m and "127.0.0.1" in m for m in messages)
    assert any(":***@127.0.0.1" in m for m in messages)
    assert not [m for m in messages if SECRET in m]
    with pytest.raises(ValueError) as err:
        RemoteTier(f"http://:{SECRET}@127.0.0.1:1/0")
    assert SECRET not in str(err.value)


def test_an_engine_with_an_unreachable_tier_logs_no_password(
    tiny_llama_dir: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    caplog.set_level(logging.DEBUG)
    url = f"redis://user:{SECRET}@127.0.0.1:{free_port()}/0"
    llm = LLM(str(tiny_llama_dir), remote_cache_url=url)
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    llm.generate([[3 + i % 200 for i in range(40)]], params)
    llm.flush_cache_tiers()
    assert llm.stats()["cache_tiers"]["tiers"]["remote"]["errors"] >= 1
    out, err = capsys.readouterr()
    assert SECRET not in out + err
    assert not [r.getMessage() for r in caplog.records if SECRET in r.getMessage()]
