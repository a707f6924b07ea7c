"""Shared-prefix attention inside the decode graphs (runner/model/cuda_graphs.py): a step whose
rows share leading blocks replays the shared-prefix graph over its plan buffers, filled from
the step's host tables, and gives the plain step's logits and greedy tokens.

On the CPU the graphs' step runs eagerly through the Triton interpreter (the same buffers, the
same fixed grids); the CUDA parametrisations capture real graphs.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvcache import LLM, SamplingParams
from runner.attention.metadata import AttentionMetadata
from runner.backends.triton.attention import triton_backend
from runner.backends.triton.cascade_cost import ALWAYS, NEVER
from runner.kv_pool.store import KVStore
from runner.model.cuda_graphs import DecodeGraphs, prefix_chunk_capacity
from runner.model.loader import load_model
from tests.backends.triton.triton_cases import DEVICES

BLOCK = 16


def test_prefix_chunk_capacity_bounds_every_grouping() -> None:
    """For every way to split a batch into groups of at least min_group members, the chunks
    (ceil(n / members) a group) fit the capacity."""

    def splits(rows: int, least: int) -> list[list[int]]:
        if rows == 0:
            return [[]]
        out = [[rows]] if rows >= least else []
        for n in range(least, rows + 1):
            out += [[n] + rest for rest in splits(rows - n, least)]
        return out

    for rows in range(1, 17):
        for members in (1, 2, 3, 5, 64):
            for least in (2, 4):
                cap = prefix_chunk_capacity(rows, members, least)
                for groups in splits(rows, least):
                    assert sum(-(-n // members) for n in groups) <= cap
                for used in range(rows + 1):  # rows outside every group
                    for groups in splits(used, least):
                        assert sum(-(-n // members) for n in groups) <= cap


def _shared_step(
    kv: KVStore, vocab: int, groups: list[tuple[int, list[int]]], gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """A decode step: each group (prefix blocks, each member's own tokens after them, the new
    one included) over blocks drawn at random from the store."""
    perm = iter(torch.randperm(kv.num_blocks, generator=gen).tolist())
    tables: list[list[int]] = []
    ctxs: list[int] = []
    for prefix, owns in groups:
        shared = [next(perm) for _ in range(prefix)]
        for own in owns:
            tables.append(shared + [next(perm) for _ in range(-(-own // BLOCK))])
            ctxs.append(prefix * BLOCK + own)
    meta = AttentionMetadata.build([1] * len(ctxs), ctxs, tables, BLOCK, kv.device)
    ids = torch.randint(3, vocab, (len(ctxs),), generator=gen).to(kv.device)
    positions = torch.tensor([c - 1 for c in ctxs], device=kv.device)
    return ids, positions, meta


@pytest.mark.parametrize("device", DEVICES)
def test_shared_prefix_graphs_match_the_plain_step(
    make_tiny_model: Callable[..., Path], device: str
) -> None:
    """Steps with groups (then other groups, then none) replay the shared-prefix graph, the
    plan refilled in the same buffers each time; logits and K/V equal the plain eager step's."""
    path = make_tiny_model("qwen3", max_position_embeddings=256)
    model = load_model(path, device=device, dtype=torch.float32).model
    kv = KVStore(
        model.num_layers, 64, BLOCK, model.num_kv_heads, model.head_dim, torch.float32, device
    )
    gen = torch.Generator().manual_seed(0)
    kv.tensor.copy_(torch.randn(kv.tensor.shape, generator=gen))
    graphs = DecodeGraphs(model, kv, BLOCK, 8, 256, device, batch_sizes=[4, 8], cascade=ALWAYS)
    graphs.capture()
    assert sorted(graphs.plans) == [4, 8]
    steps = [
        ([(3, [1, 9, 16]), (2, [4, 5])], [[0, 1, 2], [3, 4]]),  # 5 rows: the graph of 8
        ([(4, [2, 3, 7, 1])], [[0, 1, 2, 3]]),  # 4 rows, other blocks
        ([(0, [40]), (0, [7])], None),  # nothing shared: the plain graph
    ]
    plain = triton_backend(NEVER)
    told: list[tuple[list[int], object]] = []  # what each replay tells its listeners
    graphs.step_listeners.append(lambda contexts, plan: told.append((list(contexts), plan)))
    for n, (groups, members) in enumerate(steps):
        ids, pos, meta = _shared_step(kv, model.vocab_size, groups, gen)
        kv_eager = copy.copy(kv)
        kv_eager.tensor = kv.tensor.clone()
        with torch.inference_mode():
            ref = model.compute_logits(model(ids, pos, meta, kv_eager, plain))
        got = graphs.run(ids, pos, meta)
        plan = graphs.last_plan
        assert (plan is None) == (members is None)
        if plan is not None:
            assert sorted(g.members for g in plan.groups) == members
            # The device buffers hold the plan: every member skips its prefix in its own pass.
            skips = plan.seq_prefix_lens.cpu().tolist()
            assert [s > 0 for s in skips[: meta.num_seqs]] == [
                any(r in m for m in members) for r in range(meta.num_seqs)
            ]
        assert graphs.num_prefix_replays == min(n + 1, 2)
        assert told[-1] == (meta.context_lens_host, plan) and len(told) == n + 1
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(kv.tensor, kv_eager.tensor, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
def test_engine_greedy_with_shared_prefix_graphs_equals_eager(
    make_tiny_model: Callable[..., Path], device: str
) -> None:
    """Prompts behind one 40-token prefix (two shared blocks in the prefix cache): the engine's
    decode graphs with the plan on for every group give the eager engine's greedy tokens, and
    their steps did read the prefix once."""
    path = make_tiny_model("qwen3", max_position_embeddings=256)
    shared = [(7 * i) % 200 + 3 for i in range(40)]
    prompts = [shared + [5 + i, 9 + 2 * i, 11] for i in range(5)]
    params = SamplingParams(max_tokens=4 if device == "cpu" else 12, temperature=0, ignore_eos=True)
    kwargs = dict(
        device=device, dtype="float32", attention_backend="triton", max_model_len=256,
        num_kv_blocks=128, max_num_seqs=8,
    )  # fmt: skip
    eager = LLM(str(path), enforce_eager=True, **kwargs)  # type: ignore[arg-type]
    want = [o.token_ids for o in eager.generate(prompts, params)]
    del eager
    llm = LLM(str(path), **kwargs)  # type: ignore[arg-type]
    worker = llm.runner.executor.local  # the worker in this process: its model and pool
    graphs = DecodeGraphs(
        worker.model, worker.kv, llm.config.block_size, 8, 256, device, cascade=ALWAYS
    )
    graphs.capture()
    worker.graphs = graphs  # on the CPU the engine builds none: the graphs' step runs eagerly
    got = [o.token_ids for o in llm.generate(prompts, params)]
    assert got == want
    assert graphs.num_prefix_replays > 0
