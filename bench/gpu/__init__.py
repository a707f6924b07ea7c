"""The GPU bench and its profilers: the bench itself (bench.py) over its workload
(workload.py), decode time against the memory floor (floor.py), the shared-prefix workload four
ways (shared_prefix.py, cascade.py), where a step's time goes (step_profile.py), and the
verdict lines of scripts/gpu_check.sh (verdict.py)."""
