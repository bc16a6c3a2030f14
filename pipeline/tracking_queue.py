"""Tracking's replay queue: an MLflow write as an op, how one is sent, and where the unsent ones are kept until
the store answers.

Every write of a Tracker (create, params, metrics, tags, artifact, end) is an op, a JSON-able dict naming its run
by id or by placeholder (`pending-<hex>`: a run whose create is not sent yet). `send` sends one through
MlflowClient, and sending an op twice changes nothing, so a replay after a half-sent queue is safe. `attempts`
tries a call again within a budget while MLflow's own per-attempt logging is muted (`MUTE`), since the Tracker
logs one warning per kind of failure instead. What a job could not send goes to its `tracking_pending.json`
(`write_pending`), with a pointer under `<outputs>/.tracking_pending/` (`pending_files` finds them); `replay`
sends one such file under its lock and `sync` every one of a tracker's store. pipeline.tracking holds the
Tracker that queues the ops in memory and the `python -m pipeline.tracking sync` command.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from filelock import FileLock

# Its records are tracking's: whoever sets the level of pipeline.tracking's logger sets theirs.
log = logging.getLogger("pipeline.tracking")

PENDING_FILE = "tracking_pending.json"  # beside a job's result.json: the writes its tracker could not send
PENDING_INDEX = ".tracking_pending"  # under the outputs dir: one pointer file per pending file, for `sync`
PLACEHOLDER = "pending-"  # the id of a run whose create is queued
PARENT_TAG = "mlflow.parentRunId"
PENDING_TAG = "pipeline.client_id"  # the placeholder a run was made under: a replayed create finds it again
BATCH = 100  # MLflow's limit on params per log_batch call


class _Mute(logging.Filter):
    """Drops the records of the logger it is attached to while this thread is inside a tracking call.

    MLflow's own muting, not models.quiet's: it drops every record, errors too (a failed call is retried and its
    last exception raised by `attempts`), and only this thread's, while `quiet.muted` sets a logger's level for
    the whole process and keeps its errors.
    """

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


MUTE = _Mute()


def attempts(fn: Callable, budget_s: float):
    """fn(), tried again after 0.25, 0.5, 1, 1 ... s while within `budget_s`; then its last exception."""
    deadline = time.monotonic() + budget_s
    delay = 0.25
    while True:
        try:
            with MUTE.during():
                return fn()
        except Exception:
            if time.monotonic() + delay >= deadline:
                raise
        time.sleep(delay)
        delay = min(2 * delay, 1.0)


def error_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else type(e).__name__


def now_ms() -> int:
    return int(time.time() * 1000)


def is_placeholder(run_id) -> bool:
    return isinstance(run_id, str) and run_id.startswith(PLACEHOLDER)


def run_needed(op: dict) -> str | None:
    """The run that must exist before the op is sent: a create's parent, any other op's run."""
    return op["tags"].get(PARENT_TAG) if op["op"] == "create" else op["run"]


def describe(op: dict) -> str:
    return {"create": f"start_run {op.get('name')!r}", "end": f"end_run {op.get('status')}",
            "artifact": f"log_artifact {Path(op.get('path', '')).name}"}.get(op["op"], f"log_{op['op']}")


def send(client, experiment_id: str, op: dict, ids: dict[str, str]) -> None:
    """One op through MlflowClient. Placeholders are mapped through `ids` (a create adds its run). Sending an
    op twice changes nothing: a create first looks for a run made under its placeholder, MLflow drops a metric
    equal to one it holds (key, value, timestamp, step), params and tags are set to the same values."""
    from mlflow.entities import Metric, Param, RunTag

    kind, run = op["op"], ids.get(op["run"], op["run"])
    if kind == "create":
        tags = {k: ids.get(v, v) if k == PARENT_TAG else v for k, v in op["tags"].items()}
        found = client.search_runs([experiment_id], filter_string=f"tags.`{PENDING_TAG}` = '{op['run']}'",
                                   max_results=1) if op.get("retried") else []
        op["retried"] = True  # a create tried once may have reached the store though its answer did not
        ids[op["run"]] = found[0].info.run_id if found else client.create_run(
            experiment_id, start_time=op["start_time"], tags=tags, run_name=op["name"]).info.run_id
    elif kind == "params":
        items = [Param(k, v) for k, v in op["params"].items()]
        for i in range(0, len(items), BATCH):
            client.log_batch(run, params=items[i:i + BATCH])
    elif kind == "metrics":
        items = [Metric(k, v, ts, step) for k, v, ts, step in op["metrics"]]
        for i in range(0, len(items), BATCH * 10):
            client.log_batch(run, metrics=items[i:i + BATCH * 10])
    elif kind == "tags":
        client.log_batch(run, tags=[RunTag(k, v) for k, v in op["tags"].items()])
    elif kind == "artifact":
        path = Path(op["path"])
        if not path.exists():
            log.warning("MLflow: %s is gone; run %s goes without it", path, run)
            return
        (client.log_artifacts if path.is_dir() else client.log_artifact)(run, str(path), op["artifact_path"])
    elif kind == "end":
        client.set_terminated(run, op["status"], end_time=op["end_time"])
    else:
        raise ValueError(f"unknown tracking op {kind!r}")


def _index_entry(outputs: Path, pending: Path) -> Path:
    return Path(outputs) / PENDING_INDEX / (hashlib.sha256(str(pending).encode()).hexdigest()[:20] + ".json")


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)


def write_pending(directory: Path, tracker) -> Path:
    """`<directory>/tracking_pending.json`: the tracker's queue, the placeholders it resolved and where to
    send them (written atomically), plus its pointer under `<outputs>/.tracking_pending/`."""
    directory.mkdir(parents=True, exist_ok=True)
    pending = (directory / PENDING_FILE).absolute()
    _write_json(pending, {"uri": tracker.uri, "experiment": tracker.experiment, "artifact_root": tracker.artifact_root,
                          "created_at": now_ms(), "pid": os.getpid(), "ids": tracker._ids, "ops": tracker._queue})
    if tracker.outputs is not None:
        try:
            entry = _index_entry(tracker.outputs, pending)
            entry.parent.mkdir(parents=True, exist_ok=True)
            _write_json(entry, {"pending": str(pending)})
        except OSError as e:
            log.warning("MLflow: could not note %s under %s (%s): `python -m pipeline.tracking sync %s` replays it",
                        pending, tracker.outputs / PENDING_INDEX, e, directory)
    log.warning("MLflow: %d write(s) could not be sent; kept in %s for the next job or `python -m "
                "pipeline.tracking sync`", len(tracker._queue), pending)
    return pending


def pending_files(outputs: Path) -> list[Path]:
    """The pending files noted under `<outputs>/.tracking_pending/`, oldest first; stale pointers removed."""
    found = []
    for entry in sorted((Path(outputs) / PENDING_INDEX).glob("*.json")):
        try:
            pending = Path(json.loads(entry.read_text())["pending"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if pending.is_file():
            found.append(pending)
        else:
            entry.unlink(missing_ok=True)
    return sorted(found, key=lambda p: p.stat().st_mtime)


def replay(tracker, pending: Path) -> int | None:
    """Send a pending file's ops through `tracker` (which must be open on its uri and experiment), under the
    file's lock: the file is removed once every op went, else rewritten with what is left. Returns the
    number of ops left (0: done), or None when the file is not for this tracker."""
    pending = Path(pending)
    with FileLock(str(pending) + ".lock"):
        try:
            data = json.loads(pending.read_text())
        except FileNotFoundError:
            return 0  # another process replayed it
        if (data.get("uri"), data.get("experiment")) != (tracker.uri, tracker.experiment):
            return None
        ops, ids = data["ops"], data.get("ids", {})
        done = 0
        for op in ops:
            try:
                attempts(lambda: send(tracker.client, tracker.experiment_id, op, ids), tracker.retry_s)  # noqa: B023
            except Exception as e:
                log.warning("MLflow: replaying %s stopped at %s (%s: %s); %d op(s) left for a later job", pending,
                            describe(op), type(e).__name__, error_line(e), len(ops) - done)
                _write_json(pending, {**data, "ids": ids, "ops": ops[done:]})
                return len(ops) - done
            if op["op"] == "end":  # a later job may have ended it as KILLED before this replay
                with contextlib.suppress(Exception):
                    tracker.client.delete_tag(ids.get(op["run"], op["run"]), "mlflow.note.content")
            done += 1
        pending.unlink()
        if tracker.outputs is not None:
            _index_entry(tracker.outputs, pending.absolute()).unlink(missing_ok=True)
    log.info("MLflow: replayed %d write(s) from %s", done, pending)
    return 0


def sync(tracker, extra: list[Path] = ()) -> int:
    """Replay every pending file noted under the tracker's outputs dir (and `extra` ones) that was written for
    its store and experiment; returns how many ops are still left. A no-op when tracking is off or the store
    is not open."""
    if not tracker.enabled or getattr(tracker, "client", None) is None:
        return 0
    left = 0
    files = ([*pending_files(tracker.outputs)] if tracker.outputs is not None else []) + list(extra)
    for pending in dict.fromkeys(Path(p).absolute() for p in files):
        left += replay(tracker, pending) or 0
    return left
