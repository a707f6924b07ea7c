"""Host time of an engine step: what a GPU waits on between its kernels, measured on the CPU.

    python scripts/host_step.py                      # 256 sequences, 100-token prompts, 300 out
    python scripts/host_step.py --num-seqs 64 --profile
    python scripts/host_step.py --skip-forward       # the host alone, caches as a GPU leaves them

On a GPU a decode step of the bench's model is a few milliseconds, and the engine's Python
before and after it (scheduling, building inputs, sampling bookkeeping, stop checks, caching
full blocks, the step's metrics row) runs while the GPU waits. This builds the bench's tiny
random model (its forward is cheap and beside the point), runs greedy decoding with EOS
ignored, and prints the median of each step's wall time minus its model forward (timed with
forward hooks), over the steps where every sequence decodes. `--profile` adds cProfile's
slowest functions outside the forward.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.gpu.workload import build_random_model
from kvcache import LLM, SamplingParams


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--num-seqs", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=100)
    p.add_argument("--max-tokens", type=int, default=300)
    p.add_argument("--profile", action="store_true", help="print cProfile's top functions")
    p.add_argument("--sort", default="tottime", help="with --profile: tottime or cumulative")
    p.add_argument(
        "--skip-forward",
        action="store_true",
        help="replace the model's forward and LM head by zeros: the host's own time, with the "
        "caches as a GPU step leaves them (a CPU forward evicts every sequence's objects)",
    )
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # the forward is not what is measured; keep it off the other core

    folder = build_random_model("tiny", Path(tempfile.mkdtemp()) / "tiny", torch.float32, "cpu")
    config_file = folder / "config.json"  # room for long contexts (rope needs no more weights)
    config = json.loads(config_file.read_text())
    config["max_position_embeddings"] = max(4096, args.prompt_len + args.max_tokens)
    config_file.write_text(json.dumps(config))
    per_seq = -(-(args.prompt_len + args.max_tokens) // 16)
    llm = LLM(
        str(folder),
        max_num_seqs=args.num_seqs,
        num_kv_blocks=args.num_seqs * per_seq + 64,  # no preemption
        max_num_batched_tokens=16384,  # prompts in quickly: the decode steps are measured
    )
    prompts = [
        [5 + (i * 7 + j) % 300 for j in range(args.prompt_len)] for i in range(args.num_seqs)
    ]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))

    forward_s: list[float] = []
    started: list[float] = []

    def before(*_: Any) -> None:
        started.append(time.perf_counter())

    def after(*_: Any) -> None:
        forward_s.append(time.perf_counter() - started.pop())

    model = llm.runner.model  # the CausalLM: its forward is the step's model work
    if args.skip_forward:
        skip_forward(model)
    model.register_forward_pre_hook(before)
    model.register_forward_hook(after)
    first_step = len(llm.recorder.steps)
    profile = cProfile.Profile() if args.profile else None
    if profile is not None:
        profile.enable()
    llm.generate(prompts, params)
    if profile is not None:
        profile.disable()

    # A step's wall time is from its start to the next one's: the whole loop, metrics included.
    steps = llm.recorder.steps[first_step:]
    host_ms = [
        1000 * (after["t_start_s"] - step["t_start_s"] - fwd)
        for step, after, fwd in zip(steps, steps[1:], forward_s, strict=False)
        if step["num_decode_tokens"] == args.num_seqs and step["num_prefill_tokens"] == 0
    ]
    print(
        f"{args.num_seqs} sequences, {len(host_ms)} decode steps: host time per step median "
        f"{statistics.median(host_ms):.3f} ms, mean {statistics.mean(host_ms):.3f} ms, max "
        f"{max(host_ms):.1f} ms; forward median {1000 * statistics.median(forward_s):.3f} ms"
    )
    if profile is not None:
        pstats.Stats(profile).sort_stats(args.sort).print_stats(40)


def skip_forward(model: Any) -> None:
    """The model's forward returns zeros [T, hidden] and its LM head zeros [N, vocab] (greedy
    then picks token 0 every step): what is left of a step is the host's work, touching objects
    that a CPU forward has not pushed out of the caches, as on a GPU, where the CPU only
    launches the step. Nothing is written to the KV cache."""
    hidden, vocab = model.hidden_size, model.vocab_size

    def zeros_hidden(input_ids: torch.Tensor, *_: Any) -> torch.Tensor:
        return torch.zeros(input_ids.shape[0], hidden)

    def zeros_logits(rows: torch.Tensor) -> torch.Tensor:
        return torch.zeros(rows.shape[0], vocab)

    model.forward = zeros_hidden
    model.compute_logits = zeros_logits


if __name__ == "__main__":
    main()
