"""What a stored block must prove before it is served, in a tier and in a prefix-cache file:
flipped bytes are dropped with their descendants (with a warning) and change no answer; with a
cache key, a value made without it (prompt B's K/V relabelled with prompt A's tokens) is never
served. Without a key a stored block is trusted input, like the model's files: the crafted value
is served then, which is why the docs say so."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvcache import LLM, SamplingParams
from kvcache.tiers import BlockValue, DiskTier, decode, encode
from runner.engine.kv.prefix_cache_file import MAGIC
from runner.engine.kv.transfer import read_blocks

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
PROMPT_A = [3 + (i * 7) % 290 for i in range(49)]  # three full blocks and one token
PROMPT_B = [3 + (i * 11 + 5) % 290 for i in range(49)]


def cold(model: Path, prompt: list[int]) -> list[int]:
    return LLM(str(model), enable_prefix_caching=False).generate([prompt], GREEDY)[0].token_ids


def relabel(llm: LLM, source: list[int], target: list[int]) -> list[tuple[str, bytes]]:
    """Values for ``target``'s blocks holding ``source``'s K/V, made by an engine without the
    victim's key: (storage key, value) for each full block."""
    from kvcache import block_hashes
    from kvcache.hashing import pack_tokens

    llm.generate([source], GREEDY)
    nodes = llm.block_manager._match(source, llm._root(None))  # noqa: SLF001 - the attacker's own
    payloads = read_blocks(llm.kv, [n.block_id for n in nodes])
    root = llm._root(None)  # noqa: SLF001
    hashes = block_hashes(target, 16, root)
    out = []
    for i, payload in enumerate(payloads):
        parent = hashes[i - 1] if i else root
        tokens = pack_tokens(target[i * 16 : (i + 1) * 16])
        value = encode(llm.block_spec, hashes[i], parent, tokens, payload, top=i == 0)
        out.append((llm.tiers.store.key_of(hashes[i]) if llm.tiers else "", value))
    return out


@pytest.mark.parametrize("key", [None, "victim-key"])
def test_a_crafted_tier_value_is_never_served_with_a_key(
    tiny_llama_dir: Path, tmp_path: Path, key: str | None
) -> None:
    attacker = LLM(str(tiny_llama_dir), disk_cache_dir=str(tmp_path / "attacker"))
    disk = DiskTier(tmp_path / "shared", 10**8)
    for storage_key, value in relabel(attacker, PROMPT_B, PROMPT_A):
        disk.put(storage_key, value)
    victim = LLM(str(tiny_llama_dir), disk_cache_dir=str(tmp_path / "shared"), cache_key=key)
    out = victim.generate([PROMPT_A], GREEDY)[0]
    rejected = victim.stats()["cache_tiers"]["tiers"]["disk"]["rejected_blocks"]
    if key is None:  # trusted input: the relabelled K/V are served (the documented boundary)
        assert out.num_cached_tokens == 48 and rejected == 0
    else:
        assert out.num_cached_tokens == 0 and rejected == 1
        assert out.token_ids == cold(tiny_llama_dir, PROMPT_A)


def entries(path: Path) -> tuple[int, list[tuple[int, int]]]:
    """Where a cache file's values start, and (offset, length) of each."""
    import struct

    data = path.read_bytes()
    (head,) = struct.unpack_from("<Q", data, len(MAGIC))
    offset = len(MAGIC) + 8 + head
    start, out = offset, []
    while offset < len(data):
        (length,) = struct.unpack_from("<Q", data, offset)
        out.append((offset + 8, length))
        offset += 8 + length
    return start, out


def test_flipped_kv_bytes_in_a_cache_file_drop_that_block_and_below(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    llm = LLM(str(tiny_llama_dir))
    llm.generate([PROMPT_A, PROMPT_B], GREEDY)
    path = tmp_path / "cache.kvc"
    saved = llm.save_prefix_cache(path)
    _, values = entries(path)
    data = bytearray(path.read_bytes())
    offset, length = values[0]  # a top block: everything below it goes too
    value = decode(bytes(data[offset : offset + length]), llm.block_spec)
    assert isinstance(value, BlockValue)
    kv_start = offset + length - 8 - len(value.kv)
    for i in range(kv_start + 100, kv_start + 100 + 4096):
        data[i] ^= 0x5A  # 4 KiB of this block's K/V flipped
    path.write_bytes(bytes(data))
    warm = LLM(str(tiny_llama_dir))
    with pytest.warns(UserWarning, match="1 blocks failed their checks .checksum mismatch."):
        loaded = warm.load_prefix_cache(path)
    assert 0 < loaded < saved
    warm.block_manager.check_integrity()
    outs = warm.generate([PROMPT_A, PROMPT_B], GREEDY)
    assert [o.token_ids for o in outs] == [cold(tiny_llama_dir, p) for p in (PROMPT_A, PROMPT_B)]
    assert sorted(o.num_cached_tokens for o in outs)[0] == 0  # the damaged chain was computed


def test_a_keyed_cache_file_loads_only_with_its_key(tiny_llama_dir: Path, tmp_path: Path) -> None:
    signer = LLM(str(tiny_llama_dir), cache_key="k1")
    signer.generate([PROMPT_A], GREEDY)
    path = tmp_path / "signed.kvc"
    saved = signer.save_prefix_cache(path)
    assert LLM(str(tiny_llama_dir), cache_key="k1").load_prefix_cache(path) == saved
    assert LLM(str(tiny_llama_dir)).load_prefix_cache(path) == saved  # no key: trusted input
    with pytest.warns(UserWarning, match="MAC mismatch"):
        assert LLM(str(tiny_llama_dir), cache_key="k2").load_prefix_cache(path) == 0
    unsigned = tmp_path / "unsigned.kvc"
    plain = LLM(str(tiny_llama_dir))
    plain.generate([PROMPT_A], GREEDY)
    plain.save_prefix_cache(unsigned)
    with pytest.warns(UserWarning, match="no MAC"):
        assert LLM(str(tiny_llama_dir), cache_key="k1").load_prefix_cache(unsigned) == 0


def test_a_crafted_cache_file_is_not_served_with_a_key(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    attacker = LLM(str(tiny_llama_dir), disk_cache_dir=str(tmp_path / "scratch"))
    crafted = relabel(attacker, PROMPT_B, PROMPT_A)
    honest = LLM(str(tiny_llama_dir), cache_key="victim")
    path = tmp_path / "crafted.kvc"
    honest.save_prefix_cache(path)  # an empty, signed cache: its envelope
    with open(path, "ab") as f:
        for _, value in crafted:
            f.write(len(value).to_bytes(8, "little") + value)
    victim = LLM(str(tiny_llama_dir), cache_key="victim")
    with pytest.warns(UserWarning, match="no MAC"):
        assert victim.load_prefix_cache(path) == 0
    out = victim.generate([PROMPT_A], GREEDY)[0]
    assert out.num_cached_tokens == 0 and out.token_ids == cold(tiny_llama_dir, PROMPT_A)
