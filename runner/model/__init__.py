"""The model: the decoder (decoder.py) and its layers over flat token batches, the
architectures it runs, loading (Hugging Face folders, GGUF files, the embedded default),
readying it for the CPU kernels (cpu_prepack.py, cpu_layers.py: a whole step's layers in C)
and CUDA graphs of its decode step.

May import: runner.kv_pool.store, attention (the metadata and the backend a forward pass gets),
backends (the kernels the layers call).
"""
