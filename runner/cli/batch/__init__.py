"""`kvcache generate`'s parts: the run over a JSONL file (run.py), reading it (file.py), where
results go (paths.py), beam-search lines (beams.py), the output records on disk and what
--resume keeps of them (records.py), and the files written around the run: the prefix cache and
the metrics (finish.py)."""
