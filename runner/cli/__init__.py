"""The command line's parts (cli.py at the top level is the entry point): `kvcache generate`
over batch files (reading, path checks, the crash-safe output and its lock, the sampling
defaults of sampling_defaults.py), the one check on
every file a command writes, the engine's options, the option builders the commands share
(common_options.py), the `report` command, a stdout that fails,
and process start-up. The `bench` and `bench-serve` commands live in bench/ (top level).

May import: kvcache, engine, sampling, report. Never bench: cli.py registers its commands.
"""
