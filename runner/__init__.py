"""The runtime: the speculative loop (runner.generate) over an Engine (runner.engine: the .pte, or the eager
modules), and the text around it (runner.text). The package itself imports no torch."""

from runner import quiet

quiet.install()
