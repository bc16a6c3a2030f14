"""The Hydra pipeline: stages (pipeline/stages/), the artifact store, MLflow tracking (see README.md)."""

from models import quiet
from pipeline.hardware import openmp_env

openmp_env()  # before torch is first imported: OpenMP reads it once (models.quiet imports no torch)

quiet.install()
