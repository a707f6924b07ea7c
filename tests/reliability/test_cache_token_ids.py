"""Token ids read from a prefix-cache file are checked against the vocabulary: a file holding
one outside it is refused whole, with nothing loaded (issue 24, item 7)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvcache import LLM
from tests.reliability.cache_poison import BAD_ID, GREEDY, PROMPT, poisoned_cache


def test_ids_outside_the_vocabulary_are_refused(tiny_llama_dir: Path, tmp_path: Path) -> None:
    path = tmp_path / "poisoned.safetensors"
    answer = poisoned_cache(tiny_llama_dir, path)
    llm = LLM(str(tiny_llama_dir), block_size=4, speculative_tokens=4)
    # The poisoned block's new hash leaves the block after it without a parent in the file.
    with (
        pytest.warns(UserWarning, match=r"blocks have no parent block in the file"),
        pytest.raises(ValueError, match=rf"holds token id {BAD_ID}, outside the vocabulary"),
    ):
        llm.load_prefix_cache(path)
    assert llm.block_manager.stats.blocks_cached == 0
    out = llm.generate([PROMPT], GREEDY)[0]
    assert out.finish_reason == "length" and out.token_ids == answer
