"""The Hydra pipeline: stages (pipeline/stages/), the artifact store, MLflow tracking (see README.md)."""

from models import quiet, threads

quiet.install()
threads.openmp_default()
