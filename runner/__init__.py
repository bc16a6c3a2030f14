"""The runtime: the speculative loop (runner.generate) over an Engine (runner.engine: the .pte, the eager
modules, or CUDA graphs), built by one factory (runner.build), its chain policies (runner.policy) and the server
(runner.serve); the text facts it reads (stop tokens, chat templates, prompt files) are models.text, the names
of its choices models.choices. The package itself imports no torch."""

from models import quiet, threads

quiet.install()
threads.openmp_default()
