"""Benchmarks a user runs from the repository root as `python -m bench.X` (each script's --help lists its options;
each writes a JSON, the recorded ones in bench/results/), and the parts they share, one job each (gguf_write,
quality, pte_profile, bytes_floor, machine, hf_run, targets: no `__main__`). bench/lab/ holds one-off
investigations. Nothing outside bench/ (and its tests) imports it."""

from models import threads

threads.openmp_default()  # before a bench imports torch: the same threads as the pipeline's (models/threads.py)
