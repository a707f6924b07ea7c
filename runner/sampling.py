"""SamplingParams (vLLM's names) and the batched sampler."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

_GREEDY_BELOW = 1e-5


@dataclass
class SamplingParams:
    """How to pick each next token; temperature 0 means greedy.

    `top_k` of -1 or 0 disables top-k; `top_p` of 1 and `min_p` of 0 disable theirs. A `seed`
    gives the request its own random stream, so its text does not depend on its batch-mates.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stop_strings: tuple[str, ...] = field(init=False, repr=False, default=())

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first field out of range. The engine calls this again
        when a request is added, since a dataclass can be changed after construction."""
        _check_int("max_tokens", self.max_tokens, minimum=1)
        _check_number("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        _check_number("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k, minimum=-1)
        _check_number("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None:
            _check_int("seed", self.seed, minimum=0)
            if self.seed >= 2**63:
                raise ValueError(f"seed must be < 2**63, got {self.seed}")
        if self.stop is None:
            self.stop_strings = ()
        elif isinstance(self.stop, str):
            self.stop_strings = (self.stop,) if self.stop else ()
        elif isinstance(self.stop, list | tuple) and all(isinstance(s, str) for s in self.stop):
            self.stop_strings = tuple(s for s in self.stop if s)
        else:
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if self.stop_token_ids is not None:
            if not isinstance(self.stop_token_ids, list | tuple) or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0
                for t in self.stop_token_ids
            ):
                raise ValueError(
                    f"stop_token_ids must be a list of non-negative ints, got "
                    f"{self.stop_token_ids!r}"
                )
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")

    @property
    def greedy(self) -> bool:
        # Below this, logits / temperature overflows float32: treat it as the greedy limit.
        return self.temperature < _GREEDY_BELOW


def _check_int(name: str, value: object, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def _check_number(name: str, value: object) -> None:
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")


def request_generator(
    params: SamplingParams, engine_rng: torch.Generator, device: torch.device
) -> torch.Generator | None:
    """The request's own random stream (None when greedy): seeded by `params.seed`, else by a
    draw from the engine's generator, so a seeded request samples the same in any batch."""
    if params.greedy:
        return None
    seed = params.seed
    if seed is None:
        seed = int(torch.randint(0, 2**62, (1,), generator=engine_rng, device=engine_rng.device))
    return torch.Generator(device=device).manual_seed(seed)


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> list[int]:
    """Pick one token per row of `logits` [N, vocab] (float32).

    Greedy rows are one batched argmax. Sampled rows are drawn one by one with their own
    generator: a per-request stream is what makes a seeded request reproducible whatever else
    shares its batch. The result comes back to the host in one transfer.
    """
    tokens = torch.argmax(logits, dim=-1)  # [N]
    for row, (p, gen) in enumerate(zip(params, generators, strict=True)):
        if p.greedy:
            continue
        tokens[row] = _sample_row(logits[row], p, gen)
    return [int(t) for t in tokens.tolist()]


def _sample_row(
    logits: torch.Tensor, p: SamplingParams, generator: torch.Generator | None
) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p filters, then one draw. `logits` is [vocab]."""
    scaled = logits / p.temperature
    if 0 < p.top_k < scaled.numel():
        kth = torch.topk(scaled, p.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # Keep the smallest set whose mass reaches top_p: drop a token once the mass *before*
        # it already reaches top_p (so the top token always stays).
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        drop = mass_before >= p.top_p
        drop[0] = False  # the most likely token always survives, however small top_p is
        probs = probs.scatter(0, order, sorted_probs.masked_fill(drop, 0.0))
    if p.min_p > 0.0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    return torch.multinomial(probs, 1, generator=generator)[0]
