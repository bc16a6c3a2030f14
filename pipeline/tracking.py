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
degrades instead of failing the job, and loses nothing of what it was asked to write:
- Opening: a SQLite store is created (MLflow's schema migrations, which race and fail with `duplicate column`
  when two processes run them at once) and the experiment found or created entirely under one file lock beside
  the DB, so any number of processes can start together on an empty outputs directory. A directory that cannot
  hold the DB (the lock file beside it cannot be created) is refused at once, naming it. A store that cannot be
  opened within the retry budget (bad path, locked DB, unreachable server) gives an `offline` Tracker: one
  warning, and every write of the job is kept.
- Each write during the job (start/end a run, params/metrics/tags/artifacts) is sent in order; one that fails
  is retried for `PIPELINE_TRACKING_RETRY_S` (3 s), then queued with ONE warning per kind of failure, and the
  writes after it queue behind it (`Tracker.skipped`, `Tracker.note()` count them). After a failure the store
  (or, apart, the artifact root) is left alone for a pause of 5 s doubling to 60 s, so a store that stays down
  costs a few seconds per minute; ending a run tries the queue once even during a pause, and the queue goes out
  once the store answers. A run whose create is queued has a placeholder id until it is sent.
- What is still queued when the job ends goes to `<job dir>/tracking_pending.json` (pointed at from
  `<outputs>/.tracking_pending/`); the next job on the same store replays it before it closes stale runs, as
  does `python -m pipeline.tracking sync [--outputs DIR] [JOB_DIR ...]`. So a job that ended ok ends FINISHED
  with its metrics. Replaying twice sends nothing twice (`send`). The ops, their sending and the pending files
  live in pipeline.tracking_queue; this module holds the Tracker that queues them and the `sync` command.
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

import argparse
import contextlib
import json
import logging
import math
import os
import socket
import sqlite3
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

from filelock import FileLock

from pipeline.store import pid_alive
from pipeline.tracking_queue import (MUTE, PARENT_TAG, PENDING_FILE, PENDING_TAG, PLACEHOLDER, attempts, describe,
                                     error_line, is_placeholder, now_ms, pending_files, replay, run_needed, send,
                                     write_pending)

log = logging.getLogger(__name__)

PARENT_RUN_FILE = ".mlflow_parent_run"
# The experiment's kind, as MLflow records it: model training (runs with metrics), not GenAI (traces, judges,
# prompts). The UI's view is chosen by the page address (ui_command).
EXPERIMENT_TAGS = {"mlflow.experimentKind": "custom_model_development"}
MAX_PARAM_LEN = 6000  # MLflow's limit on a param value
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
    for name in ("alembic", "mlflow.store.db.utils"):  # their INFO on each store open, for the process's life
        logging.getLogger(name).setLevel(logging.WARNING)
    for name in NOISY_LOGGERS:
        if MUTE not in logging.getLogger(name).filters:
            logging.getLogger(name).addFilter(MUTE)


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


def check_db_dir(db: Path) -> Path:
    """The lock file beside a SQLite store, created now: a directory that cannot hold the database is refused
    at once (OSError naming it), before any wait on a lock file that could never be made."""
    try:
        db.parent.mkdir(parents=True, exist_ok=True)
        lock = db.parent / ".mlflow.lock"
        lock.touch()
    except OSError as e:
        raise OSError(e.errno, f"the directory {db.parent} cannot hold the MLflow database {db.name} "
                      f"({e.strerror or e}); point tracking.uri at a writable directory") from None
    return lock


def create_db(db: Path) -> None:
    """A new SQLite store: MLflow's schema migrations run on a temporary file renamed into place, so a process
    killed during them (they take 5-15 s) leaves no half-migrated store that MLflow would refuse. The caller
    holds the lock beside `db`; temporary files of killed creators are removed."""
    from mlflow.tracking import MlflowClient

    for stale in db.parent.glob(f".{db.name}.*.tmp"):
        stale.unlink(missing_ok=True)
    tmp = db.with_name(f".{db.name}.{os.getpid()}.tmp")
    with MUTE.during():
        client = MlflowClient(tracking_uri=f"sqlite:///{tmp}")
        client.search_experiments()  # the store (and its schema) is made on first use
    engine = getattr(client._tracking_client.store, "engine", None)
    if engine is not None:
        engine.dispose()
    os.replace(tmp, db)


def _sync_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipeline.tracking",
                                     description="Replay the MLflow writes jobs could not send (tracking_pending.json).")
    parser.add_argument("command", choices=("sync",))
    parser.add_argument("paths", nargs="*", type=Path,
                        help="job dirs or pending files besides those noted under the outputs dir")
    parser.add_argument("--outputs", type=Path, default=None,
                        help="the pipeline's outputs dir (default: $PIPELINE_OUTPUTS, else outputs)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    outputs = args.outputs or Path(os.environ.get("PIPELINE_OUTPUTS") or "outputs")
    files = list(dict.fromkeys(f.absolute() for f in [*pending_files(outputs),
                                                          *(p / PENDING_FILE if p.is_dir() else p for p in args.paths)]))
    groups: dict[tuple, list[Path]] = {}
    for f in files:
        try:
            data = json.loads(f.read_text())
        except (OSError, ValueError) as e:
            print(f"error: {f} is not a readable pending file ({e})", file=sys.stderr)
            return 2
        groups.setdefault((data["uri"], data["experiment"], data.get("artifact_root")), []).append(f)
    left = 0
    for (uri, experiment, artifact_root), group in groups.items():
        try:
            tracker = Tracker(uri, experiment, artifact_root, outputs=outputs)
        except Exception as e:
            print(f"MLflow tracking at {uri} cannot be opened ({type(e).__name__}: {error_line(e)}): {len(group)} "
                  f"pending file(s) left", file=sys.stderr)
            left += len(group)
            continue
        for f in group:
            n = replay(tracker, f)
            left += n or 0
            print(f"{'replayed' if not n else f'{n} op(s) left in'} {f}")
    if not files:
        print(f"nothing to sync under {outputs}")
    return 1 if left else 0


class Tracker:
    """A thin layer over MlflowClient with explicit run ids (no global fluent-API state) that loses no call.

    Every write (create, params, metrics, tags, artifact, end) is an op: sent at once when nothing is queued
    before it, else queued behind what is (the order of a run's writes is kept). A send that fails is retried
    for `retry_s`, then queued, with ONE warning per kind of failure; the store (or, apart, the artifact root)
    is then left alone for a pause of 5 s doubling to 60 s, after which the queue is sent again in order. A
    run whose create did not reach the store gets a placeholder id (`pending-<hex>`) that later writes use
    and the create resolves. What is still queued when the job ends is written to the job's
    `tracking_pending.json` (`finish`), and the next job or `python -m pipeline.tracking sync` replays it
    (`sync`). A tracker whose store could not be opened (`offline`) queues everything from the start."""

    enabled = True

    def __init__(self, uri: str, experiment: str, artifact_root: Path | None, *, required: bool = False,
                 outputs: Path | None = None, offline: str | None = None):
        global _busy_s
        _quiet_env()
        _busy_s = _env_float("PIPELINE_SQLITE_BUSY_S", SQLITE_BUSY_S)
        self.uri = uri
        self.experiment = experiment
        self.artifact_root = None if artifact_root is None else str(Path(artifact_root).absolute())
        self.outputs = None if outputs is None else Path(outputs).absolute()
        self.required = required
        self.offline = offline  # why the store could not be opened; None when it is open
        self.retry_s = _env_float("PIPELINE_TRACKING_RETRY_S", RETRY_S)
        self.skipped: dict[str, int] = {}  # kind of failure -> writes not sent at once because of it
        self._kinds: dict[tuple, str] = {}  # (channel, exception type, MLflow error code) -> kind of failure
        self._pause: dict[str, tuple[float, float, str]] = {}  # channel -> (until, length, kind)
        self._queue: list[dict] = []  # ops not sent yet, in the order they were made
        self._ids: dict[str, str] = {}  # placeholder -> the run id its create got
        self.pending_file: Path | None = None  # where `finish` wrote the queue
        self.client, self.experiment_id = None, None
        if offline is not None:
            return
        db = _sqlite_path(uri)
        if db is not None:
            lock = check_db_dir(db)
        # MLflow creates the schema when the client is made: that and the experiment happen under one lock.
        with FileLock(str(lock), timeout=OPEN_LOCK_S) if db else contextlib.nullcontext():
            if db is not None and not db.exists():
                create_db(db)
            self.client, self.experiment_id = attempts(lambda: self._open(db, experiment, artifact_root),
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

    # --- failures: one warning per kind, then a pause ---------------------------------------------------
    def _failed(self, what: str, channel: str, e: Exception, seconds: float) -> str:
        if self.required:
            raise TrackingError(f"MLflow tracking at {self.uri} failed ({what}): {type(e).__name__}: "
                                f"{error_line(e)} (tracking.required=true makes this fatal)") from e
        key = (channel, type(e).__name__, str(getattr(e, "error_code", "")))
        if key not in self._kinds:
            self._kinds[key] = f"{type(e).__name__}: {error_line(e)}"
            log.warning("MLflow tracking at %s: %s failed (%.1f s of tries): %s. Kept for later; later failures "
                        "like it are counted, not logged, and the job goes on (its result.json and metrics.json "
                        "hold every result; what is not sent by the end of the job goes to its %s).", self.uri,
                        what, seconds, self._kinds[key], PENDING_FILE)
        _, length, _ = self._pause.get(channel, (0.0, 0.0, ""))
        length = min(2 * length, PAUSE_S[1]) if length else PAUSE_S[0]
        self._pause[channel] = (time.monotonic() + length, length, self._kinds[key])
        return self._kinds[key]

    def _call(self, what: str, fn: Callable, *, channel: str = "store"):
        """fn() (a read: search_runs), retried; its result, or None when it failed or the store is paused."""
        until, length, _ = self._pause.get(channel, (0.0, 0.0, ""))
        if self.client is None or (length and time.monotonic() < until):
            return None
        t0 = time.monotonic()
        try:
            return attempts(fn, 0.0 if length else self.retry_s)
        except Exception as e:
            self._failed(what, channel, e, time.monotonic() - t0)
            return None

    # --- writes: send in order, or queue ------------------------------------------------------------------
    def _write(self, op: dict, *, urgent: bool = False) -> bool:
        """Queue `op` and send the queue as far as it goes; True when `op` itself was sent. `urgent` (a run's
        end): the queue is tried once even during a pause."""
        self._queue.append(op)
        kind = self._flush(urgent=urgent)
        if any(o is op for o in self._queue):
            kind = kind or self.offline and f"store not open ({self.offline})" or "queued behind earlier failures"
            self.skipped[kind] = self.skipped.get(kind, 0) + 1
            return False
        return True

    def _flush(self, *, urgent: bool = False) -> str | None:
        """Send the queued ops in order (each channel stops at its first failure; an op on a run whose create
        is not sent waits for it); returns the kind of the last failure, None when none happened."""
        if self.client is None or not self._queue:
            return None
        kept, blocked, failure = [], set(), None
        for op in self._queue:
            channel = "artifacts" if op["op"] == "artifact" else "store"
            until, length, kind = self._pause.get(channel, (0.0, 0.0, ""))
            waiting = is_placeholder(run_needed(op)) and run_needed(op) not in self._ids
            if channel in blocked or waiting or (length and time.monotonic() < until and not urgent):
                kept.append(op)
                failure = failure or (kind if length else None)
                continue
            t0 = time.monotonic()
            try:
                attempts(lambda: send(self.client, self.experiment_id, op, self._ids), 0.0 if length else self.retry_s)  # noqa: B023
            except Exception as e:
                failure = self._failed(describe(op), channel, e, time.monotonic() - t0)
                blocked.add(channel)
                kept.append(op)
                continue
            if length:
                del self._pause[channel]
                log.info("MLflow tracking at %s answers again (%d write(s) kept so far)", self.uri,
                         sum(self.skipped.values()))
        self._queue = kept
        return failure

    def resolve(self, run_id: str | None) -> str | None:
        """The MLflow id behind a placeholder once its create was sent; the id itself otherwise."""
        return self._ids.get(run_id, run_id) if run_id else run_id

    def start_run(self, name: str, *, parent: str | None = None, tags: Mapping | None = None,
                  params: Mapping | None = None) -> str:
        """The new run's id, or a placeholder (`pending-<hex>`) when its create is queued."""
        tags = {k: str(v) for k, v in {**(tags or {}), "pid": os.getpid(), "host": socket.gethostname()}.items()}
        if parent:
            tags[PARENT_TAG] = parent
        placeholder = PLACEHOLDER + uuid.uuid4().hex
        tags[PENDING_TAG] = placeholder  # finds the run again should a replayed create have been sent already
        self._write({"op": "create", "run": placeholder, "name": name, "tags": tags, "start_time": now_ms()})
        if params:
            self.log_params(placeholder, params)
        return self.resolve(placeholder)

    def log_params(self, run_id: str | None, params: Mapping) -> None:
        if run_id is not None and params:
            self._write({"op": "params", "run": run_id, "params": {k: _param_value(v) for k, v in params.items()}})

    def log_metrics(self, run_id: str | None, metrics: Mapping[str, float], step: int | None = None) -> None:
        if run_id is not None and metrics:
            now = now_ms()
            self._write({"op": "metrics", "run": run_id,
                         "metrics": [[k, float(v), now, step or 0] for k, v in metrics.items()]})

    def set_tags(self, run_id: str | None, tags: Mapping) -> None:
        if run_id is not None and tags:
            self._write({"op": "tags", "run": run_id, "tags": {k: str(v) for k, v in tags.items()}})

    def log_artifact(self, run_id: str | None, path: Path, artifact_path: str | None = None) -> None:
        if run_id is not None:
            self._write({"op": "artifact", "run": run_id, "path": str(Path(path).absolute()),
                         "artifact_path": artifact_path})

    def end_run(self, run_id: str | None, status: str = "FINISHED") -> bool:
        """End a run; False when the end is queued (it is sent once the store answers, or replayed)."""
        if run_id is None:
            return False
        return self._write({"op": "end", "run": run_id, "status": status, "end_time": now_ms()}, urgent=True)

    def children(self, parent_id: str) -> list:
        """Direct child runs of a run (used by tests and the sweep summary)."""
        return self._call("search_runs", lambda: self.client.search_runs(
            [self.experiment_id], filter_string=f"tags.`{PARENT_TAG}` = '{self.resolve(parent_id)}'",
            max_results=10_000
        )) or []

    def finish(self, directory: Path) -> Path | None:
        """At the end of a job: send the queue once more, then write what is left to
        `<directory>/tracking_pending.json` (and its pointer under `<outputs>/.tracking_pending/`, where
        `sync` looks); returns that file, None when everything was sent."""
        self._flush(urgent=True)
        if not self._queue:
            return None
        self.pending_file = write_pending(Path(directory), self)
        return self.pending_file

    def note(self) -> str | None:
        """What tracking could not send at once in this process, in one line; None when nothing."""
        if not self.skipped and not self.offline:
            return None
        kinds = "; ".join(f"{kind} ({n})" for kind, n in self.skipped.items())
        line = (f"MLflow store {self.uri} not open for this job ({self.offline}); " if self.offline else "") + \
            f"{sum(self.skipped.values())} MLflow write(s) not sent at once" + (f": {kinds}" if kinds else "")
        if self.pending_file is not None:
            line += (f"; {len(self._queue)} kept in {self.pending_file}, replayed by the next job or "
                     f"`python -m pipeline.tracking sync`")
        return line

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


class RankTracker(NullTracker):
    """A torchrun rank other than 0: rank 0 tracks the job, so this rank writes nothing to MLflow."""

    def __init__(self, rank: int):
        self.reason = f"rank {rank} of a torchrun job: rank 0 tracks it"


def _param_value(v) -> str:
    s = str(v)
    return s if len(s) <= MAX_PARAM_LEN else s[: MAX_PARAM_LEN - 3] + "..."


def open_tracker(tracking_cfg: Mapping, outputs: Path) -> Tracker | NullTracker:
    """The tracker `tracking.*` asks for: `enabled`, `uri` (null = SQLite under outputs), `experiment`,
    `artifact_root`, `required`. A store that cannot be opened gives an offline Tracker (every write kept
    for the next job) and a warning, or with `required` a TrackingError."""
    if not tracking_cfg.get("enabled", True):
        return NullTracker()
    from pipeline import distributed

    if not distributed.is_main():  # torchrun: one job, tracked once
        return RankTracker(distributed.rank())
    uri = tracking_cfg.get("uri") or default_uri(outputs)
    required = bool(tracking_cfg.get("required", False))
    artifact_root = tracking_cfg.get("artifact_root") or Path(outputs) / "mlartifacts"
    experiment = tracking_cfg.get("experiment", "pipeline")
    try:
        return Tracker(uri, experiment, artifact_root, required=required, outputs=outputs)
    except Exception as e:
        error = f"{type(e).__name__}: {error_line(e)}"
        if required:
            raise TrackingError(f"MLflow tracking at {uri} cannot be opened ({error}); tracking.required=true "
                                "makes this fatal") from e
        log.warning("MLflow tracking at %s cannot be opened (%s): this job's runs are kept in its %s for the "
                    "next job or `python -m pipeline.tracking sync` (its result.json and metrics.json hold every "
                    "result; tracking.required=true makes this an error)", uri, error, PENDING_FILE)
        return Tracker(uri, experiment, artifact_root, outputs=outputs, offline=error)


def close_stale_runs(tracker: Tracker | NullTracker, tags: Mapping[str, str] | None = None) -> list[str]:
    """End as KILLED every RUNNING run of the experiment that a process on this host started and that process
    is gone (a SIGKILLed job never ends its runs); `tags` narrows the search (e.g. {"job_dir": ...}). Runs of
    other hosts, or without a `pid` tag, are left alone. Returns the ids of the runs it ended."""
    if not tracker.enabled or tracker.client is None:
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
        if not is_placeholder(run_id):  # a queued create: the next job of the sweep tries again
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


if __name__ == "__main__":
    sys.exit(_sync_main())
