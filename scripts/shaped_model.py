"""Save a seeded random model of a real shape, with the default model's tokenizer, so that the
CLI and `kvcache bench --model FOLDER` can run text workloads on architectures whose weights
cannot be downloaded here (throughput does not depend on weight values).

    python scripts/shaped_model.py gemma3-270m /tmp/gemma3-270m
    kvcache bench --model /tmp/gemma3-270m --workload long_documents --systems engine,hf-static

Shapes: bench/gpu/workload.py SHAPES. A vocabulary larger than the tokenizer's (Gemma's
262,144 against SmolLM2's 49,152) keeps the model's real LM head; ids past the tokenizer decode
to nothing.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from bench.gpu.workload import SHAPES, build_random_model
from runner.model.loader import load_tokenizer, resolve_model_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("folder", type=Path)
    args = parser.parse_args()
    build_random_model(args.shape, args.folder, torch.float32, "cpu")
    default = resolve_model_dir(None)
    tokenizer = load_tokenizer(default)
    if tokenizer is None:
        raise SystemExit(f"the default model in {default} has no tokenizer")
    tokenizer.save_pretrained(args.folder)
    print(f"saved a random {args.shape} model with the default tokenizer in {args.folder}")


if __name__ == "__main__":
    main()
