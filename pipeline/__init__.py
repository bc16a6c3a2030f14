"""The Hydra pipeline: stages (pipeline/stages/), the artifact store, MLflow tracking (see README.md)."""

from runner import quiet

quiet.install()
