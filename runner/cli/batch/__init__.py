"""`kvcache generate`'s parts: the run over a JSONL file (run.py), reading it (file.py), where
results go (paths.py), beam search lines (beams.py), records (records.py) and the end of a
run (finish.py)."""
