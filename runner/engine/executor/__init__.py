"""Where a step's plan runs: the worker that holds a model (or its tensor-parallel share) and its
KV pool (worker.py), the step's plan as one value (plan.py), and the executors that hand it to
one worker in this process or to N worker processes joined by torch.distributed
(multiproc.py, over the collectives of runner/model/tensor_parallel.py).

May import: engine (config), engine.kv (block transfers), runner.kv_pool.store, attention, backends,
model, sampling.
"""
