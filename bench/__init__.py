"""Benchmarks a user runs from the repository root as `python -m bench.X` (each script's --help lists its options;
each writes a JSON, the recorded ones in bench/results/). bench/lab/ holds one-off investigations. Nothing outside
bench/ (and its tests) imports it."""
