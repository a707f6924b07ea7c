"""The command line's parts (cli.py at the top level is the entry point): `kvcache generate`
over batch files (reading, path checks, the crash-safe output and its lock), the one check on
every file a command writes, the engine's options, `report` and `bench` commands, a stdout that
fails, and process start-up.

May import: kvcache, engine, sampling, report, bench, disagg (the bench of the served systems).
"""
