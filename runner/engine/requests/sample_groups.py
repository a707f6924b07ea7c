"""Parallel sampling (`SamplingParams.n`): one request, n samples of the same prompt.

Each sample is a sequence of its own (request id "<id>#<j>"), so the scheduler, the sampler and
the report need nothing new, and the prompt's full blocks are computed once: the first sample
to be admitted computes them and the others find them in the prefix cache (admission holds a
request back for a step while another computes the prefix it is about to share). The group
collects the samples' outputs and hands back one RequestOutput when the last one finishes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from runner.engine.requests.outputs import RequestOutput
from runner.sampling.params import SamplingParams

SEED_RANGE = 2**63  # SamplingParams accepts seeds below this


def sample_params(params: SamplingParams, index: int) -> SamplingParams:
    """Sample `index`'s own parameters: n of 1, and a seeded request's seed plus the index (as
    vLLM does), so the samples differ from each other and each repeats in any batch."""
    seed = None if params.seed is None else (params.seed + index) % SEED_RANGE
    # The prompt's log-probabilities are the same for every sample: sample 0 computes them.
    prompt_logprobs = params.prompt_logprobs if index == 0 else None
    return dataclasses.replace(params, n=1, seed=seed, prompt_logprobs=prompt_logprobs)


def sample_request_id(request_id: str, index: int) -> str:
    return f"{request_id}#{index}"


@dataclass
class SampleGroup:
    """The samples of one request that have finished so far, by index."""

    request_id: str
    n: int
    done: dict[int, RequestOutput] = field(default_factory=dict)

    def add(self, index: int, output: RequestOutput) -> RequestOutput | None:
        """Record sample `index`'s output; returns the request's output once all are in."""
        self.done[index] = output
        return self.merged() if len(self.done) == self.n else None

    def merged(self) -> RequestOutput:
        """One RequestOutput for the request: `outputs` holds every sample in index order; the
        flat fields (text, token_ids, finish_reason, logprobs, metrics) are sample 0's, and
        `error` names the first sample that failed."""
        samples = [self.done[j] for j in range(self.n)]
        first = samples[0]
        failed = [(j, s.error) for j, s in enumerate(samples) if s.error]
        return dataclasses.replace(
            first,
            request_id=self.request_id,
            error=f"sample {failed[0][0]}: {failed[0][1]}" if failed else None,
            # Each sample's own output already holds its one CompletionOutput: renumber it.
            outputs=[dataclasses.replace(s.outputs[0], index=j) for j, s in enumerate(samples)],
        )
