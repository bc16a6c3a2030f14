"""The Hydra pipeline: stages (pipeline/stages/), the artifact store, MLflow tracking (see README.md)."""

from models import quiet

quiet.install()
