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

Every run is tagged `pid` and `host` (the process that started it), so `close_stale_runs` can end as KILLED
the runs a SIGKILLed job left RUNNING; a job that ends by an exception or a signal ends its own runs FAILED or
KILLED (`Tracker.run`).

Stages never open runs: they call `log_metrics({...}, step=i)` and `log_artifact(path)`, which write to the
stage run being built in this process and do nothing when tracking is off (`tracking.enabled=false`) or
outside a stage. The sweep parent is created under a file lock by whichever comes first, the Hydra callback
at multirun start (pipeline.callbacks) or a job, and its id is kept in `<sweep dir>/.mlflow_parent_run`.

MLflow is a view, never the record: a job's `result.json` and the eval's `metrics.json` are. So tracking
degrades instead of failing the job:
- Opening: a SQLite store is created (MLflow's schema migrations, which race and fail with `duplicate column`
  when two processes run them at once) and the experiment found or created entirely under one file lock beside
  the DB, so any number of processes can start together on an empty outputs directory. A store that cannot be
  opened within the retry budget (bad path, locked DB, unreachable server) gives a `DegradedTracker`: one
  warning, tracking off for this job.
- Each call during the job (start/end a run, log params/metrics/tags/artifacts) is retried for
  `PIPELINE_TRACKING_RETRY_S` (3 s), then skipped with ONE warning per kind of failure; later failures of that
  kind are counted (`Tracker.skipped`, `Tracker.note()`), not logged. After a failure the store (or, apart,
  the artifact root) is left alone for a pause of 5 s doubling to 60 s, so a store that stays down costs a few
  seconds per minute, not the retry budget on every step metric; ending a run is still tried once during a
  pause (an end that fails is retried when the store answers again), and any success ends the pause.
- Bounded waits: SQLite's busy timeout is `PIPELINE_SQLITE_BUSY_S` (2 s; MLflow's own is 20 s) and MLflow's
  HTTP retries/timeout are set to a few seconds (MLFLOW_HTTP_REQUEST_*), each only where the environment does
  not set it.
- `tracking.required=true` turns every one of these failures into a `TrackingError` naming the URI.

Under torchrun only rank 0 tracks (the other ranks get a `RankTracker`, which writes nothing), so a job of N
ranks is one job run with one run per stage, as with one process.

MLflow is imported only when tracking is on (it costs about 1.5 s), with telemetry disabled; a local SQLite
store never touches the network.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import socket
import sqlite3
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

from filelock import FileLock

log = logging.getLogger(__name__)

PARENT_RUN_FILE = ".mlflow_parent_run"
# The experiment's kind, as MLflow records it: model training (runs with metrics), not GenAI (traces, judges,
# prompts). The UI's view is chosen by the page address (ui_command).
EXPERIMENT_TAGS = {"mlflow.experimentKind": "custom_model_development"}
MAX_PARAM_LEN = 6000  # MLflow's limit on a param value
BATCH = 100  # MLflow's limit on params per log_batch call
RETRY_S = 3.0  # per tracking call (PIPELINE_TRACKING_RETRY_S)
SQLITE_BUSY_S = 2.0  # how long a SQLite statement waits for another process's lock (PIPELINE_SQLITE_BUSY_S)
PAUSE_S = (5.0, 60.0)  # after a failure: first pause, longest pause
OPEN_LOCK_S = 120  # waiting for another process creating the store (its migrations take 5-15 s here)
HTTP_ENV = {  # MLflow's defaults retry an unreachable server for about 4 minutes
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER": "0.5",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "5",
}
# MLflow's and urllib3's own per-attempt logging of a failure (a traceback for each one): our single warning
# per kind of failure replaces it during our calls.
NOISY_LOGGERS = ("mlflow.store.db.utils", "mlflow.utils.rest_utils", "urllib3.connectionpool",
                 "mlflow.tracking._tracking_service.client")


class TrackingError(RuntimeError):
    """Tracking failed and `tracking.required=true`."""


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


class _Mute(logging.Filter):
    """Drops the records of the logger it is attached to while this thread is inside a tracking call."""

    def __init__(self) -> None:
        super().__init__()
        self._depth = threading.local()

    def filter(self, record: logging.LogRecord) -> bool:
        return not getattr(self._depth, "n", 0)

    @contextlib.contextmanager
    def during(self) -> Iterator[None]:
        self._depth.n = getattr(self._depth, "n", 0) + 1
        try:
            yield
        finally:
            self._depth.n -= 1


_MUTE = _Mute()
_busy_s = SQLITE_BUSY_S


def _env_float(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        return default


def _quiet_env() -> None:
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    os.environ.setdefault("DO_NOT_TRACK", "true")
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    for k, v in HTTP_ENV.items():
        os.environ.setdefault(k, v)
    for name in ("alembic", "mlflow.store.db.utils"):
        logging.getLogger(name).setLevel(logging.WARNING)
    for name in NOISY_LOGGERS:
        if _MUTE not in logging.getLogger(name).filters:
            logging.getLogger(name).addFilter(_MUTE)


def _sqlite_busy(conn, cursor, statement, parameters, context, executemany):
    """SQLAlchemy hook: MLflow sets `PRAGMA busy_timeout = 20000` in every session; wait `_busy_s` instead."""
    if statement.lstrip().upper().startswith("PRAGMA BUSY_TIMEOUT"):
        statement = f"PRAGMA busy_timeout = {int(_busy_s * 1000)};"
    return statement, parameters


def _sqlite_path(uri: str) -> Path | None:
    return Path(uri.removeprefix("sqlite:///").split("?")[0]) if uri.startswith("sqlite:///") else None


def _check_sqlite(db: Path) -> None:
    """Open the DB and read its header, waiting at most the busy timeout: MLflow's engine creation retries an
    unopenable file for about 100 s."""
    con = sqlite3.connect(db, timeout=_busy_s)
    try:
        con.execute("PRAGMA schema_version").fetchone()
    finally:
        con.close()


def _attempts(fn: Callable, budget_s: float):
    """fn(), tried again after 0.25, 0.5, 1, 1 ... s while within `budget_s`; then its last exception."""
    deadline = time.monotonic() + budget_s
    delay = 0.25
    while True:
        try:
            with _MUTE.during():
                return fn()
        except Exception:
            if time.monotonic() + delay >= deadline:
                raise
        time.sleep(delay)
        delay = min(2 * delay, 1.0)


def _line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else type(e).__name__


def pid_alive(pid: int) -> bool:
    """Whether `pid` is a live process on this host (a zombie is not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state not in ("Z", "X")


class Tracker:
    """A thin layer over MlflowClient with explicit run ids (no global fluent-API state). Every call is
    retried, then skipped with a warning (see the module docstring); a skipped start_run returns None, and
    calls on a None run do nothing."""

    enabled = True

    def __init__(self, uri: str, experiment: str, artifact_root: Path | None, *, required: bool = False):
        global _busy_s
        _quiet_env()
        _busy_s = _env_float("PIPELINE_SQLITE_BUSY_S", SQLITE_BUSY_S)
        self.uri = uri
        self.required = required
        self.retry_s = _env_float("PIPELINE_TRACKING_RETRY_S", RETRY_S)
        self.skipped: dict[str, int] = {}  # kind of failure -> calls lost to it
        self._kinds: dict[tuple, str] = {}  # (channel, exception type, MLflow error code) -> kind of failure
        self._pause: dict[str, tuple[float, float, str]] = {}  # channel -> (until, length, kind)
        self._unended: dict[str, str] = {}  # run id -> status, for run ends that failed
        db = _sqlite_path(uri)
        if db is not None:
            db.parent.mkdir(parents=True, exist_ok=True)
        # MLflow creates the schema when the client is made: that and the experiment happen under one lock.
        with FileLock(str(db.parent / ".mlflow.lock"), timeout=OPEN_LOCK_S) if db else contextlib.nullcontext():
            self.client, self.experiment_id = _attempts(lambda: self._open(db, experiment, artifact_root),
                                                        self.retry_s)

    def _open(self, db: Path | None, experiment: str, artifact_root: Path | None) -> tuple:
        from mlflow.tracking import MlflowClient

        if db is not None:
            _check_sqlite(db)
        client = MlflowClient(tracking_uri=self.uri)
        engine = getattr(client._tracking_client.store, "engine", None)
        if engine is not None and engine.dialect.name == "sqlite":
            from sqlalchemy import event

            if not event.contains(engine, "before_cursor_execute", _sqlite_busy):
                event.listen(engine, "before_cursor_execute", _sqlite_busy, retval=True)
        found = client.get_experiment_by_name(experiment)
        if found is None:
            location = Path(artifact_root).absolute().as_uri() if artifact_root else None
            return client, client.create_experiment(experiment, artifact_location=location, tags=EXPERIMENT_TAGS)
        for k, v in EXPERIMENT_TAGS.items():
            if found.tags.get(k) != v:
                client.set_experiment_tag(found.experiment_id, k, v)
        return client, found.experiment_id

    def _call(self, what: str, fn: Callable, *, channel: str = "store", end: bool = False):
        """fn() (MLflow calls), retried; its result, or None when it failed or was skipped (a pause after a
        failure on `channel`: the store, or the artifact root). A run's `end` is tried once during a pause."""
        until, length, kind = self._pause.get(channel, (0.0, 0.0, ""))
        if length and time.monotonic() < until and not end:
            self.skipped[kind] += 1
            return None
        t0 = time.monotonic()
        try:
            result = _attempts(fn, 0.0 if length else self.retry_s)  # a failing channel had its retries
        except Exception as e:
            if self.required:
                raise TrackingError(f"MLflow tracking at {self.uri} failed ({what}): {type(e).__name__}: "
                                    f"{_line(e)} (tracking.required=true makes this fatal)") from e
            key = (channel, type(e).__name__, str(getattr(e, "error_code", "")))
            if key not in self._kinds:
                self._kinds[key] = f"{type(e).__name__}: {_line(e)}"
                log.warning("MLflow tracking at %s: %s failed (%.1f s of tries): %s. Skipped; later failures "
                            "like it are counted, not logged, and the job goes on (its result.json and "
                            "metrics.json hold every result).", self.uri, what, time.monotonic() - t0,
                            self._kinds[key])
            kind = self._kinds[key]
            self.skipped[kind] = self.skipped.get(kind, 0) + 1
            length = min(2 * length, PAUSE_S[1]) if length else PAUSE_S[0]
            self._pause[channel] = (time.monotonic() + length, length, kind)
            return None
        if length:
            del self._pause[channel]
            log.info("MLflow tracking at %s answers again (%d call(s) skipped so far)", self.uri,
                     sum(self.skipped.values()))
            if channel == "store":
                self._end_unended()
        return result

    def _end_unended(self) -> None:
        for run_id, status in list(self._unended.items()):
            try:
                _attempts(lambda: self.client.set_terminated(run_id, status), 0.0)  # noqa: B023
            except Exception:
                return
            del self._unended[run_id]

    def start_run(self, name: str, *, parent: str | None = None, tags: Mapping | None = None,
                  params: Mapping | None = None) -> str | None:
        tags = {k: str(v) for k, v in {**(tags or {}), "pid": os.getpid(), "host": socket.gethostname()}.items()}
        if parent:
            tags["mlflow.parentRunId"] = parent
        run = self._call(f"start_run {name!r}",
                         lambda: self.client.create_run(self.experiment_id, run_name=name, tags=tags))
        if run is None:
            return None
        if params:
            self.log_params(run.info.run_id, params)
        return run.info.run_id

    def log_params(self, run_id: str | None, params: Mapping) -> None:
        from mlflow.entities import Param

        if run_id is None:
            return
        items = [Param(k, _param_value(v)) for k, v in params.items()]
        for i in range(0, len(items), BATCH):
            self._call("log_params", lambda i=i: self.client.log_batch(run_id, params=items[i : i + BATCH]))

    def log_metrics(self, run_id: str | None, metrics: Mapping[str, float], step: int | None = None) -> None:
        from mlflow.entities import Metric

        if run_id is None:
            return
        now = int(time.time() * 1000)
        items = [Metric(k, float(v), now, step or 0) for k, v in metrics.items()]
        n = BATCH * 10
        for i in range(0, len(items), n):
            self._call("log_metrics", lambda i=i: self.client.log_batch(run_id, metrics=items[i : i + n]))

    def set_tags(self, run_id: str | None, tags: Mapping) -> None:
        from mlflow.entities import RunTag

        if run_id is not None and tags:
            items = [RunTag(k, str(v)) for k, v in tags.items()]
            self._call("set_tags", lambda: self.client.log_batch(run_id, tags=items))

    def log_artifact(self, run_id: str | None, path: Path, artifact_path: str | None = None) -> None:
        if run_id is None:
            return
        path = Path(path)
        log_fn = self.client.log_artifacts if path.is_dir() else self.client.log_artifact
        self._call(f"log_artifact {path.name}", lambda: log_fn(run_id, str(path), artifact_path),
                   channel="artifacts")

    def end_run(self, run_id: str | None, status: str = "FINISHED") -> bool:
        """End a run; False when that failed (it is tried again once the store answers)."""
        if run_id is None:
            return False
        ok = self._call(f"end_run {status}", lambda: self.client.set_terminated(run_id, status) or True, end=True)
        if not ok:
            self._unended[run_id] = status
        return bool(ok)

    def children(self, parent_id: str) -> list:
        """Direct child runs of a run (used by tests and the sweep summary)."""
        return self._call("search_runs", lambda: self.client.search_runs(
            [self.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{parent_id}'", max_results=10_000
        )) or []

    def note(self) -> str | None:
        """What tracking lost in this process, in one line; None when nothing."""
        if not self.skipped:
            return None
        kinds = "; ".join(f"{kind} ({n})" for kind, n in self.skipped.items())
        return f"{sum(self.skipped.values())} MLflow call(s) skipped after failures: {kinds}"

    @contextlib.contextmanager
    def run(self, name: str, **kw) -> Iterator[str | None]:
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
    experiment_id = None
    reason = "tracking.enabled=false"

    def __getattr__(self, name):
        return lambda *a, **k: None

    def note(self) -> str | None:
        return None

    @contextlib.contextmanager
    def run(self, name: str, **kw) -> Iterator[None]:
        yield None


class DegradedTracker(NullTracker):
    """Tracking on, but its store could not be opened: off for this job, and why."""

    def __init__(self, uri: str, error: str):
        self.uri = uri
        self.reason = f"{uri} unusable: {error}"

    def note(self) -> str:
        return f"MLflow tracking off for this job ({self.reason})"


class RankTracker(NullTracker):
    """A torchrun rank other than 0: rank 0 tracks the job, so this rank writes nothing to MLflow."""

    def __init__(self, rank: int):
        self.reason = f"rank {rank} of a torchrun job: rank 0 tracks it"


def _param_value(v) -> str:
    s = str(v)
    return s if len(s) <= MAX_PARAM_LEN else s[: MAX_PARAM_LEN - 3] + "..."


def open_tracker(tracking_cfg: Mapping, outputs: Path) -> Tracker | NullTracker:
    """The tracker `tracking.*` asks for: `enabled`, `uri` (null = SQLite under outputs), `experiment`,
    `artifact_root`, `required`. A store that cannot be opened gives a DegradedTracker and a warning, or
    with `required` a TrackingError."""
    if not tracking_cfg.get("enabled", True):
        return NullTracker()
    from pipeline import distributed

    if not distributed.is_main():  # torchrun: one job, tracked once
        return RankTracker(distributed.rank())
    uri = tracking_cfg.get("uri") or default_uri(outputs)
    required = bool(tracking_cfg.get("required", False))
    artifact_root = tracking_cfg.get("artifact_root") or Path(outputs) / "mlartifacts"
    try:
        return Tracker(uri, tracking_cfg.get("experiment", "pipeline"), artifact_root, required=required)
    except Exception as e:
        error = f"{type(e).__name__}: {_line(e)}"
        if required:
            raise TrackingError(f"MLflow tracking at {uri} cannot be opened ({error}); tracking.required=true "
                                "makes this fatal") from e
        log.warning("MLflow tracking at %s cannot be opened (%s): tracking is off for this job (its result.json "
                    "and metrics.json hold every result; tracking.required=true makes this an error)", uri, error)
        return DegradedTracker(uri, error)


def close_stale_runs(tracker: Tracker | NullTracker, tags: Mapping[str, str] | None = None) -> list[str]:
    """End as KILLED every RUNNING run of the experiment that a process on this host started and that process
    is gone (a SIGKILLed job never ends its runs); `tags` narrows the search (e.g. {"job_dir": ...}). Runs of
    other hosts, or without a `pid` tag, are left alone. Returns the ids of the runs it ended."""
    if not tracker.enabled:
        return []
    host = socket.gethostname()
    where = " and ".join(["attributes.status = 'RUNNING'", f"tags.host = '{host}'",
                          *(f"tags.`{k}` = '{v}'" for k, v in (tags or {}).items())])
    runs = tracker._call("search_runs (stale runs)", lambda: tracker.client.search_runs(
        [tracker.experiment_id], filter_string=where, max_results=10_000)) or []
    closed = []
    for run in runs:
        pid = run.data.tags.get("pid", "")
        if not pid.isdigit() or pid_alive(int(pid)):
            continue
        tracker.set_tags(run.info.run_id, {"mlflow.note.content": f"Ended as KILLED by a later job: process {pid} "
                                           f"on {host}, which started it, was gone with the run still RUNNING."})
        if tracker.end_run(run.info.run_id, "KILLED"):
            closed.append(run.info.run_id)
    if closed:
        log.info("ended as KILLED %d run(s) left RUNNING by processes that are gone: %s", len(closed),
                 ", ".join(closed))
    return closed


def sweep_parent(tracker: Tracker | NullTracker, sweep_dir: Path, tags: Mapping | None = None) -> str | None:
    """The parent run of the multirun in `sweep_dir`, created by the first caller (callback or job); None when
    tracking is off or the run could not be created."""
    if not tracker.enabled:
        return None
    sweep_dir = Path(sweep_dir)
    sweep_dir.mkdir(parents=True, exist_ok=True)
    id_file = sweep_dir / PARENT_RUN_FILE
    with FileLock(str(sweep_dir / (PARENT_RUN_FILE + ".lock"))):
        if id_file.is_file():
            return id_file.read_text().strip()
        run_id = tracker.start_run(f"sweep {sweep_dir.name}",
                                   tags={"sweep_dir": str(sweep_dir.absolute()), **(tags or {})})
        if run_id:
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
