"""MLflow tracking for pipeline runs: one run per job, one nested run per executed stage.

Run tree in the MLflow store (default `sqlite:///<outputs>/mlflow.db`, artifacts in `<outputs>/mlartifacts`,
experiment `tracking.experiment`):

    sweep <sweep dir>              only in a multirun: one parent per Hydra sweep directory
      job <n>: <overrides>         one per Hydra job; params = the job's whole resolved config (flattened),
                                   metrics = every stage's report numbers as `<stage>.<name>` (cached ones too),
                                   tags `<stage>.key` and `<stage>.cached` for each stage of the job
        <stage>                    one per EXECUTED stage (a cached stage gets no run of its own: its numbers
                                   live in the run that built it, tagged with the same key); params = the
                                   flattened config subtrees that entered the key, tags stage/key/upstream keys/
                                   git commit, metrics = the stage's report plus its step metrics

Stages never open runs: they call `log_metrics({...}, step=i)` and `log_artifact(path)`, which write to the
stage run being built in this process and do nothing when tracking is off (`tracking.enabled=false`) or
outside a stage. The sweep parent is created under a file lock by whichever comes first, the Hydra callback
at multirun start (pipeline.callbacks) or a job, and its id is kept in `<sweep dir>/.mlflow_parent_run`.

MLflow is imported only when tracking is on (it costs about 1.5 s), with telemetry disabled; a local SQLite
store never touches the network.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

from filelock import FileLock

log = logging.getLogger(__name__)

PARENT_RUN_FILE = ".mlflow_parent_run"
# The experiment's kind, as MLflow records it: model training (runs with metrics), not GenAI (traces, judges,
# prompts). The UI's view is chosen by the page address (ui_command).
EXPERIMENT_TAGS = {"mlflow.experimentKind": "custom_model_development"}
MAX_PARAM_LEN = 6000  # MLflow's limit on a param value
BATCH = 100  # MLflow's limit on params per log_batch call


def flatten(tree: Mapping, prefix: str = "") -> dict:
    """{'a': {'b': 1}} -> {'a.b': 1}; lists stay values."""
    flat = {}
    for k, v in tree.items():
        name = f"{prefix}{k}"
        if isinstance(v, Mapping):
            flat.update(flatten(v, name + "."))
        else:
            flat[name] = v
    return flat


def numeric(tree: Mapping, prefix: str = "") -> dict[str, float]:
    """The finite int/float leaves of a report, flattened (bools and strings are left out)."""
    return {
        k: float(v)
        for k, v in flatten(tree, prefix).items()
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    }


def default_uri(outputs: Path) -> str:
    return f"sqlite:///{Path(outputs).absolute() / 'mlflow.db'}"


UI_PORT = 5000


def ui_command(uri: str, experiment_id: str) -> str:
    """The command that serves the MLflow UI on this store (this environment's mlflow when there is one) and
    the page to open: the experiment's runs table. MLflow 3.17's UI picks its GenAI or model-training view
    from the page address (`workflowType`, then remembered by the browser), not from the experiment."""
    exe = Path(sys.executable).parent / "mlflow"
    return (f"{exe if exe.exists() else 'mlflow'} ui --backend-store-uri {uri} --port {UI_PORT}, then open "
            f"http://127.0.0.1:{UI_PORT}/#/experiments/{experiment_id}?workflowType=machine_learning")


def _quiet_env() -> None:
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    os.environ.setdefault("DO_NOT_TRACK", "true")
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    for name in ("alembic", "mlflow.store.db.utils"):
        logging.getLogger(name).setLevel(logging.WARNING)


class Tracker:
    """A thin layer over MlflowClient with explicit run ids (no global fluent-API state)."""

    enabled = True

    def __init__(self, uri: str, experiment: str, artifact_root: Path | None):
        _quiet_env()
        from mlflow.tracking import MlflowClient

        self.uri = uri
        self.client = MlflowClient(tracking_uri=uri)
        # Creating the SQLite schema and the experiment races between concurrent jobs: do it under a lock.
        lock_dir = Path(uri.removeprefix("sqlite:///")).parent if uri.startswith("sqlite:///") else None
        with FileLock(str(lock_dir / ".mlflow.lock")) if lock_dir else contextlib.nullcontext():
            found = self.client.get_experiment_by_name(experiment)
            if found is None:
                location = Path(artifact_root).absolute().as_uri() if artifact_root else None
                self.experiment_id = self.client.create_experiment(experiment, artifact_location=location,
                                                                   tags=EXPERIMENT_TAGS)
            else:
                self.experiment_id = found.experiment_id
                for k, v in EXPERIMENT_TAGS.items():
                    if found.tags.get(k) != v:
                        self.client.set_experiment_tag(self.experiment_id, k, v)

    def start_run(self, name: str, *, parent: str | None = None, tags: Mapping | None = None,
                  params: Mapping | None = None) -> str:
        tags = {k: str(v) for k, v in (tags or {}).items()}
        if parent:
            tags["mlflow.parentRunId"] = parent
        run_id = self.client.create_run(self.experiment_id, run_name=name, tags=tags).info.run_id
        if params:
            self.log_params(run_id, params)
        return run_id

    def log_params(self, run_id: str, params: Mapping) -> None:
        from mlflow.entities import Param

        items = [Param(k, _param_value(v)) for k, v in params.items()]
        for i in range(0, len(items), BATCH):
            self.client.log_batch(run_id, params=items[i : i + BATCH])

    def log_metrics(self, run_id: str, metrics: Mapping[str, float], step: int | None = None) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = [Metric(k, float(v), now, step or 0) for k, v in metrics.items()]
        for i in range(0, len(items), BATCH * 10):
            self.client.log_batch(run_id, metrics=items[i : i + BATCH * 10])

    def set_tags(self, run_id: str, tags: Mapping) -> None:
        from mlflow.entities import RunTag

        if tags:
            self.client.log_batch(run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])

    def log_artifact(self, run_id: str, path: Path, artifact_path: str | None = None) -> None:
        path = Path(path)
        if path.is_dir():
            self.client.log_artifacts(run_id, str(path), artifact_path)
        else:
            self.client.log_artifact(run_id, str(path), artifact_path)

    def end_run(self, run_id: str, status: str = "FINISHED") -> None:
        self.client.set_terminated(run_id, status)

    def children(self, parent_id: str) -> list:
        """Direct child runs of a run (used by tests and the sweep summary)."""
        return self.client.search_runs(
            [self.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{parent_id}'", max_results=10_000
        )

    @contextlib.contextmanager
    def run(self, name: str, **kw) -> Iterator[str]:
        """A run that ends FINISHED, or FAILED/KILLED when the block raises."""
        run_id = self.start_run(name, **kw)
        status = "FAILED"
        try:
            yield run_id
            status = "FINISHED"
        except KeyboardInterrupt:
            status = "KILLED"
            raise
        finally:
            self.end_run(run_id, status)


class NullTracker:
    """Tracking off: every call does nothing."""

    enabled = False
    uri = None

    def __getattr__(self, name):
        return lambda *a, **k: None

    @contextlib.contextmanager
    def run(self, name: str, **kw) -> Iterator[None]:
        yield None


def _param_value(v) -> str:
    s = str(v)
    return s if len(s) <= MAX_PARAM_LEN else s[: MAX_PARAM_LEN - 3] + "..."


def open_tracker(tracking_cfg: Mapping, outputs: Path) -> Tracker | NullTracker:
    """The tracker `tracking.*` asks for: `enabled`, `uri` (null = SQLite under outputs), `experiment`."""
    if not tracking_cfg.get("enabled", True):
        return NullTracker()
    uri = tracking_cfg.get("uri") or default_uri(outputs)
    if uri.startswith("sqlite:///"):
        Path(uri.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    artifact_root = tracking_cfg.get("artifact_root") or Path(outputs) / "mlartifacts"
    return Tracker(uri, tracking_cfg.get("experiment", "pipeline"), artifact_root)


def sweep_parent(tracker: Tracker | NullTracker, sweep_dir: Path, tags: Mapping | None = None) -> str | None:
    """The parent run of the multirun in `sweep_dir`, created by the first caller (callback or job)."""
    if not tracker.enabled:
        return None
    sweep_dir = Path(sweep_dir)
    sweep_dir.mkdir(parents=True, exist_ok=True)
    id_file = sweep_dir / PARENT_RUN_FILE
    with FileLock(str(sweep_dir / (PARENT_RUN_FILE + ".lock"))):
        if id_file.is_file():
            return id_file.read_text().strip()
        run_id = tracker.start_run(f"sweep {sweep_dir.name}", tags={"sweep_dir": str(sweep_dir.absolute()), **(tags or {})})
        id_file.write_text(run_id)
        return run_id


# The stage run being built in this process: where log_metrics / log_artifact go.
_active: tuple[Tracker, str] | None = None


@contextlib.contextmanager
def activate(tracker: Tracker | NullTracker, run_id: str | None) -> Iterator[None]:
    """Route module-level log_metrics/log_artifact to `run_id` for the duration of the block."""
    global _active
    previous = _active
    _active = (tracker, run_id) if tracker.enabled and run_id else None
    try:
        yield
    finally:
        _active = previous


def log_metrics(metrics: Mapping[str, float], step: int | None = None) -> None:
    """Log step metrics of the stage being built; a no-op when tracking is off."""
    if _active is not None:
        tracker, run_id = _active
        tracker.log_metrics(run_id, numeric(metrics), step)


def set_tags(tags: Mapping) -> None:
    """Tag the stage run being built (strings, e.g. a file's sha256); a no-op when tracking is off."""
    if _active is not None:
        tracker, run_id = _active
        tracker.set_tags(run_id, tags)


def log_artifact(path: Path | str, artifact_path: str | None = None) -> None:
    """Attach a file or directory to the stage run being built; a no-op when tracking is off."""
    if _active is not None:
        tracker, run_id = _active
        tracker.log_artifact(run_id, Path(path), artifact_path)
