"""A prefix-cache file whose answer block is relabelled with token ids outside the vocabulary,
re-hashed and re-checksummed as a crafter would (no MAC key is set): everything else in it is
as the engine saved it (shared by the tests of issue 24, item 7)."""

from __future__ import annotations

from pathlib import Path

from kvcache import LLM, SamplingParams
from kvcache.hashing import hash_packed_block, pack_tokens, unpack_tokens
from kvcache.tiers import BlockValue, decode, encode
from runner.engine.kv.prefix_cache_file import _LEN, MAGIC

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]  # two blocks of 4
BAD_ID = 10**6


def poisoned_cache(model: Path, path: Path) -> list[int]:
    """Save the cache of one greedy answer to PROMPT (block size 4), then give the block after
    the prompt, the answer's first, guessed tokens past the vocabulary; returns the answer."""
    llm = LLM(str(model), block_size=4)
    answer = llm.generate([PROMPT], GREEDY)[0].token_ids
    llm.save_prefix_cache(path)
    data = path.read_bytes()
    (head_len,) = _LEN.unpack_from(data, len(MAGIC))
    offset = len(MAGIC) + _LEN.size + head_len
    out = [data[:offset]]
    while offset < len(data):
        (length,) = _LEN.unpack_from(data, offset)
        raw = data[offset + _LEN.size : offset + _LEN.size + length]
        offset += _LEN.size + length
        value = decode(raw, llm.block_spec)
        assert isinstance(value, BlockValue)
        tokens = unpack_tokens(value.tokens)
        if not value.top and tokens[0] == answer[0]:  # the guesses offered after the prompt
            packed = pack_tokens([tokens[0]] + [BAD_ID] * (len(tokens) - 1))
            key = hash_packed_block(value.parent, packed)
            raw = encode(llm.block_spec, key, value.parent, packed, value.kv, top=False)
        out.append(_LEN.pack(len(raw)) + raw)
    path.write_bytes(b"".join(out))
    return answer
