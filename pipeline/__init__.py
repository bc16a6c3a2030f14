"""The Hydra pipeline: stages (pipeline/stages/), the artifact store, MLflow tracking (see README.md)."""

from pipeline.hardware import openmp_env
from runner import quiet

openmp_env()  # before torch is first imported: OpenMP reads it once

quiet.install()
