"""Scheduling policies: the rule a step is scheduled by (what is admitted, in what order, when
running sequences decode and when prompts prefill), one class a file behind `SchedulingPolicy`
(policy.py), chosen by name once, when the scheduler is built (registry.py). The scheduler
(runner/engine/step/scheduler.py) keeps the machinery every rule shares: the queues, admission
and freeing, preemption, prefill chunks, drafts.

May import: engine (config, sequence), engine.step (the scheduler's output and admission order),
kvcache.
"""
