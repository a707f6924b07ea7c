"""One engine step's plan as a value: what every worker needs to run the step's forward pass,
and nothing that lives only in the engine (no sequences, no scheduler state). The engine builds
it once (runner/engine/step/model_runner.py); one worker in this process consumes it as it is,
N tensor-parallel workers receive it pickled (multiproc.py)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from runner.sampling.logprobs import TokenLogprobs


@dataclass(frozen=True)
class PromptLogprobRows:
    """Rows of the step whose logits score prompt tokens: row i predicts targets[i], with the
    widths[i] likeliest tokens beside it."""

    rows: list[int]
    targets: list[int]
    widths: list[int]


@dataclass(frozen=True)
class StepRows:
    """Which of the step's hidden rows go through the LM head: `logit_rows` (None: every row,
    each item sampling one token), and those scoring prompt tokens."""

    logit_rows: list[int] | None
    prompt_logprobs: PromptLogprobRows | None = None


@dataclass(frozen=True)
class StepPlan:
    """The flat inputs of one forward pass over a batch of N items and T tokens."""

    input_ids: np.ndarray  # int64 [T]
    positions: np.ndarray  # int64 [T]
    slot_mapping: np.ndarray  # int64 [T]: block * block_size + offset of each token's K/V
    query_start_loc: np.ndarray  # int32 [N + 1]
    context_lens: np.ndarray  # int32 [N]
    block_tables: np.ndarray  # int32 [N, W]
    query_lens: list[int]
    rows: StepRows

    @property
    def decode_only(self) -> bool:
        return all(q == 1 for q in self.query_lens)


@dataclass(frozen=True)
class StepOutput:
    """A forward pass's result: float32 logits [rows, vocab] of the rows that sample (on a
    tensor-parallel rank other than 0: no columns), and the prompt tokens' log-probabilities."""

    logits: torch.Tensor
    prompt_logprobs: list[TokenLogprobs] | None = None
