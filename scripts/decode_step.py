"""Median wall time of an engine step in which every sequence decodes, at long contexts: what a
sliding window saves, where a local layer reads only its last W keys.

    python scripts/decode_step.py /tmp/gemma3-270m                    # windows as configured
    python scripts/decode_step.py /tmp/gemma3-270m --full-attention   # every layer global

`--full-attention` runs the same weights with every layer of `layer_types` attending to its
whole context (a copy of the folder whose config says so; the weights are linked, not copied).
Prompts are seeded token ids; answers are greedy with EOS ignored.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from kvcache import LLM, SamplingParams


def full_attention_copy(folder: Path, into: Path) -> Path:
    """`folder` with every layer a full-attention one: its files linked, its config rewritten."""
    into.mkdir()
    for item in folder.iterdir():
        if item.name != "config.json":
            (into / item.name).symlink_to(item.resolve())
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    config["layer_types"] = ["full_attention"] * int(config["num_hidden_layers"])
    (into / "config.json").write_text(json.dumps(config), encoding="utf-8")
    return into


def decode_step_ms(model: Path, num_seqs: int, prompt_len: int, new_tokens: int) -> list[float]:
    """Wall ms of each step where all `num_seqs` sequences decode past their prompts."""
    llm = LLM(str(model), max_num_batched_tokens=2048, max_num_seqs=num_seqs)
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    for s in range(num_seqs):
        llm.add_request([(i * 7919 + s * 104729) % 30000 + 5 for i in range(prompt_len)], params)
    steps = []
    while llm.has_unfinished():
        start = time.perf_counter()
        llm.step()
        elapsed = time.perf_counter() - start
        running = llm.scheduler.running
        if len(running) == num_seqs and all(s.num_tokens > prompt_len + 1 for s in running):
            steps.append(1000 * elapsed)
    return steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--full-attention", action="store_true")
    parser.add_argument("--num-seqs", type=int, default=12)
    parser.add_argument("--prompt-len", type=int, default=1450)
    parser.add_argument("--new-tokens", type=int, default=40)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if args.full_attention:
            model = full_attention_copy(args.model, Path(tmp) / "full")
        steps = decode_step_ms(model, args.num_seqs, args.prompt_len, args.new_tokens)
    label = "every layer global" if args.full_attention else "windows as configured"
    print(
        f"{args.model.name} ({label}): decode step p50 {statistics.median(steps):.1f} ms over "
        f"{len(steps)} steps, {args.num_seqs} sequences at ~{args.prompt_len} tokens"
    )


if __name__ == "__main__":
    main()
