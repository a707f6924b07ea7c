"""Sampling: SamplingParams (params.py), the batched sampler and its fast candidate path,
penalties, a request's logit rules, log-probabilities, and structured outputs (grammars).

May import: nothing else of the project (the engine applies these to its sequences).
"""
