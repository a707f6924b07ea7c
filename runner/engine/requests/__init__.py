"""A request's way into the engine and its output's way out: checking and tokenizing a call
(validation.py, prompt_inputs.py), turning it into sequences (intake.py), parallel samples
(sample_groups.py), the table of live requests and whose finished output is whose
(request_table.py), stopping (stopping.py, incremental_text.py) and outputs in vLLM's shape
(outputs.py). Nothing here runs a step.

May import: engine (config, sequence), kvcache, sampling.
"""
