"""MLflow tracking: run tree of a job and of a multirun, and no MLflow at all when tracking is off."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline import tracking, tracking_queue
from pipeline_fakes import run_app, seed_mlflow_db, write_fake_stages

pytestmark = pytest.mark.slow  # pipeline jobs and MLflow stores


def runs_of(outputs):
    tracker = tracking.open_tracker({"enabled": True, "experiment": "eagle3"}, outputs)
    return tracker.client.search_runs([tracker.experiment_id], max_results=1000)


def parent_of(run):
    return run.data.tags.get("mlflow.parentRunId")


def test_flatten_and_numeric():
    tree = {"a": {"b": 1, "c": [1, 2]}, "d": "x", "e": True, "f": 2.5, "g": float("nan")}
    assert tracking.flatten(tree) == {"a.b": 1, "a.c": [1, 2], "d": "x", "e": True, "f": 2.5, "g": tree["g"]}
    assert tracking.numeric(tree, prefix="s.") == {"s.a.b": 1.0, "s.f": 2.5}


def test_stage_logging_is_a_noop_outside_a_stage_and_when_off():
    """A stage's log calls reach the tracker only inside `activate` with tracking on and a run; a recording
    tracker shows both that nothing leaks outside and that the same calls do arrive inside."""

    class Recorder:
        enabled = True

        def __init__(self):
            self.calls = []

        def log_metrics(self, run_id, metrics, step=None):
            self.calls.append(("metrics", run_id, dict(metrics), step))

        def log_artifact(self, run_id, path, artifact_path=None):
            self.calls.append(("artifact", run_id, str(path)))

    rec = Recorder()
    tracking.log_metrics({"loss": 1.0}, step=1)  # no active run
    with tracking.activate(rec, None):  # a tracker but no run
        tracking.log_metrics({"loss": 1.0}, step=1)
    with tracking.activate(tracking.NullTracker(), "some-run"):  # tracking off
        tracking.log_metrics({"loss": 1.0}, step=1)
        tracking.log_artifact("/nonexistent")
    assert rec.calls == [] and tracking._active is None
    with tracking.activate(rec, "stage-run"):
        tracking.log_metrics({"loss": 1.0, "note": "text"}, step=2)
        tracking.log_artifact("/some/file")
    assert tracking._active is None
    assert rec.calls[0][:2] == ("metrics", "stage-run") and rec.calls[0][2] == {"loss": 1.0}
    assert rec.calls[0][3] == 2 and rec.calls[1][:2] == ("artifact", "stage-run")


def test_tracking_off_never_imports_mlflow(tmp_path):
    code = ("import sys; from pipeline.tracking import open_tracker; "
            f"t = open_tracker({{'enabled': False}}, {str(tmp_path)!r}); print(t.enabled, 'mlflow' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_a_job_has_one_run_with_a_nested_run_per_executed_stage(tmp_path):
    write_fake_stages(tmp_path / "fakes")
    out = tmp_path / "out"
    r = run_app(["+stage=export", "export.max_m=5"], tmp_path / "fakes", out)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "mlflow ui --backend-store-uri sqlite:///" in r.stdout
    r = run_app(["+stage=export", "export.max_m=6"], tmp_path / "fakes", out)  # only export runs again
    assert r.returncode == 0, r.stdout + r.stderr
    runs = runs_of(out)
    jobs = [x for x in runs if parent_of(x) is None]
    assert len(jobs) == 2
    stages_by_job = {j.info.run_id: sorted(x.info.run_name for x in runs if parent_of(x) == j.info.run_id)
                     for j in jobs}
    assert sorted(stages_by_job.values()) == [["draft", "export", "taps", "target"], ["export"]]
    second = next(j for j in jobs if stages_by_job[j.info.run_id] == ["export"])
    assert second.data.params["export.max_m"] == "6"
    assert second.data.tags["target.cached"] == "true" and second.data.tags["export.cached"] == "false"
    assert second.data.metrics["target.value"] == 1.0, "cached stages' numbers reach the job run"
    export_run = next(x for x in runs if parent_of(x) == second.info.run_id)
    assert export_run.data.tags["stage"] == "export" and export_run.data.tags["key"]
    assert export_run.data.tags["git_commit"] and export_run.data.params["export.max_m"] == "6"
    assert export_run.data.metrics["step_metric"] == 1.0, "a stage's log_metrics reaches its own run"


@pytest.mark.parametrize("launcher", ["basic", "joblib"])
def test_multirun_gives_one_parent_and_a_child_per_job(tmp_path, launcher):
    write_fake_stages(tmp_path / "fakes")
    out = tmp_path / "out"
    args = ["-m", "runtime.chain=1,2,3"]
    if launcher == "joblib":
        args += ["hydra/launcher=joblib", "hydra.launcher.n_jobs=2"]
    r = run_app(args, tmp_path / "fakes", out)
    assert r.returncode == 0, r.stdout + r.stderr
    runs = runs_of(out)
    parents = [x for x in runs if parent_of(x) is None]
    assert len(parents) == 1, [x.info.run_name for x in parents]
    parent = parents[0]
    assert parent.info.status == "FINISHED" and "runtime.chain=1,2,3" in parent.data.tags["sweep"]
    children = [x for x in runs if parent_of(x) == parent.info.run_id]
    assert sorted(c.data.params["runtime.chain"] for c in children) == ["1", "2", "3"]
    assert sorted(c.data.metrics["eval.chain"] for c in children) == [1.0, 2.0, 3.0]
    built = [x for x in runs if x.info.run_name == "export"]
    assert len(built) == 1, "one export for the whole sweep"
    assert len([p for p in (out / "store" / "export").iterdir() if p.is_dir()]) == 1


def test_experiment_opens_as_model_training_in_the_ui(tmp_path):
    from pipeline_fakes import seed_mlflow_db

    seed_mlflow_db(tmp_path)
    tracker = tracking.open_tracker({"enabled": True, "experiment": "eagle3"}, tmp_path)
    kind = lambda: tracker.client.get_experiment(tracker.experiment_id).tags.get("mlflow.experimentKind")  # noqa: E731
    assert kind() == "custom_model_development"
    tracker.client.delete_experiment_tag(tracker.experiment_id, "mlflow.experimentKind")  # a store made before
    assert kind() is None
    tracking.open_tracker({"enabled": True, "experiment": "eagle3"}, tmp_path)
    assert kind() == "custom_model_development"


# --- concurrency, degraded tracking, stale runs (issue 26) ---------------------------------------------------

REPO = Path(__file__).resolve().parents[1]

OPEN_AT_GO = """
import sys, time
from pathlib import Path
from mlflow.tracking import MlflowClient  # noqa: F401  (imported before the barrier: the opens start together)
import mlflow.store.tracking.sqlalchemy_store  # noqa: F401
from pipeline import tracking
outputs, go = Path(sys.argv[1]), Path(sys.argv[2])
Path(sys.argv[3]).touch()
while not go.exists():
    time.sleep(0.005)
t = tracking.open_tracker({"enabled": True, "experiment": "eagle3", "required": True}, outputs)
t.end_run(t.start_run("p"))
print(t.experiment_id)
"""


def test_processes_opening_one_empty_outputs_dir_together_all_succeed(tmp_path):
    out, go = tmp_path / "out", tmp_path / "go"
    procs = [subprocess.Popen([sys.executable, "-c", OPEN_AT_GO, str(out), str(go), str(tmp_path / f"ready{i}")],
                              cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(3)]
    deadline = time.monotonic() + 30
    while not all((tmp_path / f"ready{i}").exists() for i in range(3)) and time.monotonic() < deadline:
        time.sleep(0.01)
    go.touch()
    results = [(p.wait(60), *p.communicate()) for p in procs]
    assert [rc for rc, _, _ in results] == [0, 0, 0], [err[-2000:] for _, _, err in results]
    assert len({o.strip() for _, o, _ in results}) == 1, "one experiment for all of them"
    assert len(runs_of(out)) == 3


def hold_lock(db: Path):
    """A connection holding an EXCLUSIVE lock on `db` (readers and writers wait) until closed."""
    import sqlite3

    con = sqlite3.connect(db, isolation_level=None, check_same_thread=False)
    con.execute("BEGIN EXCLUSIVE")
    return con


def test_a_locked_store_costs_a_few_seconds_and_one_warning(tmp_path, caplog):
    seed_mlflow_db(tmp_path)
    tracker = tracking.open_tracker({"enabled": True, "experiment": "eagle3"}, tmp_path)
    run = tracker.start_run("r")
    con = hold_lock(tmp_path / "mlflow.db")
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="pipeline.tracking"):
        for i in range(20):
            tracker.log_metrics(run, {"loss": 1.0}, step=i)  # skipped, not raised
    assert time.monotonic() - t0 < 10
    warnings = [r for r in caplog.records if r.name == "pipeline.tracking" and r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "database is locked" in warnings[0].getMessage()
    assert tracker.uri in warnings[0].getMessage()
    assert sum(tracker.skipped.values()) == 20 and "20" in tracker.note()
    con.close()
    tracker.end_run(run)  # the run's end is tried even during the pause; the store is back: the queue goes first
    assert tracker.client.get_run(run).info.status == "FINISHED"
    tracker.log_metrics(run, {"loss": 2.0}, step=99)
    assert [m.step for m in tracker.client.get_metric_history(run, "loss")] == [*range(20), 99], \
        "the writes made while the store was locked reach it once it answers, in order"


LOCKING_DRAFT = '''
import json, os, subprocess, sys, time
from pathlib import Path
from pipeline import tracking

SCHEMA_VERSION = 1
UPSTREAM = ("taps",)
CONFIG_KEYS = ("draft",)
CONTENT_ADDRESSED = True

LOCKER = """
import sqlite3, sys, time
from pathlib import Path
con = sqlite3.connect(sys.argv[1], isolation_level=None)
con.execute("BEGIN EXCLUSIVE")
Path(sys.argv[2]).write_text("locked")
t0 = time.monotonic()
while not Path(sys.argv[3]).exists() and time.monotonic() - t0 < 60:
    time.sleep(0.02)
"""


def run(cfg, upstream, out):
    outputs = Path(cfg.paths.outputs)
    locked = outputs / "locked"
    subprocess.Popen([sys.executable, "-c", LOCKER, str(outputs / "mlflow.db"), str(locked), str(outputs / "release")],
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # not the job's
    while not locked.exists():
        time.sleep(0.01)
    tracking.log_metrics({"step_metric": 1.0}, step=1)
    (out / "draft.json").write_text("{}")
    return {"value": 1.0}
'''


def test_a_store_locked_by_another_process_during_a_stage_does_not_fail_the_job(tmp_path, monkeypatch):
    # The lock is held until the job has ended: every MLflow call after it starts fails.
    monkeypatch.setenv("PIPELINE_TRACKING_RETRY_S", "1")
    monkeypatch.setenv("PIPELINE_SQLITE_BUSY_S", "0.5")
    fakes, out = tmp_path / "fakes", tmp_path / "out"
    write_fake_stages(fakes)
    (fakes / "fakestages" / "draft.py").write_text(LOCKING_DRAFT)
    try:
        t0 = time.monotonic()
        r = run_app(["+stage=export"], fakes, out)
        elapsed = time.monotonic() - t0
    finally:
        (out / "release").touch()
    assert r.returncode == 0, r.stdout + r.stderr
    assert elapsed < 20
    log = r.stdout + r.stderr
    assert len([line for line in log.splitlines() if "WARNING" in line and "database is locked" in line]) == 1, log
    result = json.loads(next((out / "runs").rglob("result.json")).read_text())
    assert result["status"] == "ok" and result["stages"]["draft"]["cached"] is False
    assert (Path(result["stages"]["draft"]["path"]) / "draft.json").is_file()
    assert result["stages"]["export"]["path"] and Path(result["stages"]["export"]["path"]).is_dir()


BAD_URI = "sqlite:////proc/nope/mlflow.db"  # no one can create a directory under /proc, root included


@pytest.mark.parametrize("uri, directory", [(BAD_URI, "/proc/nope"), ("sqlite:////proc/x.db", "/proc")])
def test_a_directory_that_cannot_hold_the_store_is_refused_at_once_naming_it(tmp_path, caplog, uri, directory):
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="pipeline.tracking"):
        tracker = tracking.open_tracker({"enabled": True, "uri": uri}, tmp_path)
    assert time.monotonic() - t0 < 5, "no wait on a lock file that can never be created"
    assert tracker.offline and uri in tracker.note()
    warning = next(r.getMessage() for r in caplog.records if uri in r.getMessage())
    assert f"the directory {directory} cannot hold the MLflow database" in warning
    with tracker.run("x") as run_id:  # every write kept, none sent
        tracker.log_metrics(run_id, {"a": 1.0})
    assert [op["op"] for op in tracker._queue] == ["create", "metrics", "end"]
    with pytest.raises(tracking.TrackingError, match=f"{directory} cannot hold"):
        tracking.open_tracker({"enabled": True, "uri": uri, "required": True}, tmp_path)


UNREACHABLE = """
import socket, sys, time
from pipeline import tracking
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()  # nothing listens there
t0 = time.monotonic()
t = tracking.open_tracker({"enabled": True, "uri": f"http://127.0.0.1:{port}"}, sys.argv[1])
print(t.offline is not None, round(time.monotonic() - t0, 1))
"""


def test_an_unreachable_server_takes_the_job_offline_quickly(tmp_path):
    r = subprocess.run([sys.executable, "-c", UNREACHABLE, str(tmp_path)], cwd=REPO, capture_output=True,
                       text=True, timeout=30, env=dict(os.environ, NO_PROXY="127.0.0.1", no_proxy="127.0.0.1"))
    assert r.returncode == 0, r.stderr
    offline, seconds = r.stdout.split()
    assert offline == "True" and float(seconds) < 15


def test_an_unwritable_artifact_root_skips_the_artifact_only(tmp_path, caplog):
    seed_mlflow_db(tmp_path)
    tracker = tracking.open_tracker({"enabled": True, "experiment": "art", "artifact_root": "/proc/nope/art"},
                                    tmp_path)
    (tmp_path / "result.txt").write_text("x")
    with caplog.at_level(logging.WARNING, logger="pipeline.tracking"):
        with tracker.run("r") as run_id:
            with tracking.activate(tracker, run_id):
                tracking.log_artifact(tmp_path / "result.txt")
                tracking.log_metrics({"after": 1.0})
    assert any("log_artifact" in r.getMessage() for r in caplog.records)
    run = tracker.client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.metrics["after"] == 1.0


def test_a_job_with_an_unusable_store_succeeds_unless_tracking_is_required(tmp_path):
    write_fake_stages(tmp_path / "fakes")
    out = tmp_path / "out"
    t0 = time.monotonic()
    r = run_app(["+stage=taps", f"tracking.uri='{BAD_URI}'"], tmp_path / "fakes", out)
    assert r.returncode == 0, r.stdout + r.stderr
    assert time.monotonic() - t0 < 20
    assert "/proc/nope/mlflow.db" in r.stdout + r.stderr
    r = run_app(["+stage=taps", f"tracking.uri='{BAD_URI}'", "tracking.required=true"], tmp_path / "fakes", out)
    assert r.returncode != 0
    assert "TrackingError" in r.stderr and "/proc/nope/mlflow.db" in r.stderr


def test_runs_end_failed_or_killed_and_carry_pid_and_host(tmp_path):
    seed_mlflow_db(tmp_path)
    tracker = tracking.open_tracker({"enabled": True, "experiment": "eagle3"}, tmp_path)
    ids = {}
    for exc, status in ((RuntimeError, "FAILED"), (KeyboardInterrupt, "KILLED")):
        with pytest.raises(exc):
            with tracker.run(status) as ids[status]:
                raise exc("boom")
    for status, run_id in ids.items():
        run = tracker.client.get_run(run_id)
        assert run.info.status == status
        assert run.data.tags["pid"] == str(os.getpid()) and run.data.tags["host"] == socket.gethostname()


START_AND_WAIT = """
import sys, time
from pipeline import tracking
t = tracking.open_tracker({"enabled": True, "experiment": "eagle3"}, sys.argv[1])
print(t.start_run("doomed"), flush=True)
time.sleep(120)
"""


def test_runs_of_a_sigkilled_job_are_closed_as_killed(tmp_path):
    seed_mlflow_db(tmp_path)
    p = subprocess.Popen([sys.executable, "-c", START_AND_WAIT, str(tmp_path)], cwd=REPO, stdout=subprocess.PIPE,
                         text=True)
    doomed = p.stdout.readline().strip()
    p.send_signal(signal.SIGKILL)
    p.wait()
    tracker = tracking.open_tracker({"enabled": True, "experiment": "eagle3"}, tmp_path)
    alive = tracker.start_run("alive")  # this process's own run is not stale
    assert tracker.client.get_run(doomed).info.status == "RUNNING"
    assert tracking.close_stale_runs(tracker) == [doomed]
    assert tracker.client.get_run(doomed).info.status == "KILLED"
    assert tracker.client.get_run(alive).info.status == "RUNNING"
    assert tracking.close_stale_runs(tracker) == []
    assert tracking.close_stale_runs(tracking.NullTracker()) == []


# --- no record lost: what a job could not send is replayed (issue 45) -----------------------------------------


def wait_unlocked(db: Path, timeout: float = 30.0) -> None:
    """Until no process holds a lock on the SQLite file `db` (the locker exits once released)."""
    import sqlite3

    deadline = time.monotonic() + timeout
    while True:
        con = sqlite3.connect(db, timeout=0.1, isolation_level=None)
        try:
            con.execute("BEGIN EXCLUSIVE")
            con.execute("COMMIT")
            return
        except sqlite3.OperationalError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
        finally:
            con.close()


def run_locked_job(tmp_path, monkeypatch):
    """A job whose MLflow store is held under BEGIN EXCLUSIVE by another process from inside its draft stage
    until after the job has ended: the draft's metrics and end, and the export's whole run, cannot be sent."""
    monkeypatch.setenv("PIPELINE_TRACKING_RETRY_S", "0.5")
    monkeypatch.setenv("PIPELINE_SQLITE_BUSY_S", "0.2")
    fakes, out = tmp_path / "fakes", tmp_path / "out"
    write_fake_stages(fakes)
    (fakes / "fakestages" / "draft.py").write_text(LOCKING_DRAFT)
    try:
        r = run_app(["+stage=export"], fakes, out)
    finally:
        (out / "release").touch()
    assert r.returncode == 0, r.stdout + r.stderr
    wait_unlocked(out / "mlflow.db")
    (job_dir,) = {p.parent for p in (out / "runs").rglob("result.json")}
    return fakes, out, job_dir, json.loads((job_dir / "result.json").read_text())


def job_runs(out):
    runs = runs_of(out)
    return [x for x in runs if parent_of(x) is None], runs


def assert_recorded_in_full(out, job_dir):
    jobs, runs = job_runs(out)
    job = next(j for j in jobs if j.data.tags.get("job_dir") == str(job_dir))
    assert job.info.status == "FINISHED", "the job ended ok: its run ends FINISHED"
    assert job.data.metrics["draft.value"] == 1.0 and job.data.metrics["export.value"] == 1.0
    stages = {x.info.run_name: x for x in runs if parent_of(x) == job.info.run_id}
    assert sorted(stages) == ["draft", "export", "taps", "target"]
    assert all(x.info.status == "FINISHED" for x in stages.values())
    assert stages["draft"].data.metrics["step_metric"] == 1.0 and stages["draft"].data.metrics["value"] == 1.0
    assert stages["export"].data.params["export.max_m"], "a stage run created only at replay has its params"
    assert not (job_dir / tracking_queue.PENDING_FILE).exists()
    assert not list((out / tracking_queue.PENDING_INDEX).iterdir())
    return job


def test_a_job_that_ends_while_the_store_is_locked_is_replayed_by_the_next_job(tmp_path, monkeypatch):
    fakes, out, job_dir, result = run_locked_job(tmp_path, monkeypatch)
    assert result["status"] == "ok" and tracking_queue.PENDING_FILE in result["tracking"]
    pending = json.loads((job_dir / tracking_queue.PENDING_FILE).read_text())
    assert {"metrics", "end", "create"} <= {op["op"] for op in pending["ops"]}
    jobs, _ = job_runs(out)
    assert [j.info.status for j in jobs] == ["RUNNING"], "nothing of its end reached the store"

    r = run_app(["+stage=target"], fakes, out)  # the next job: replays first, then closes stale runs
    assert r.returncode == 0, r.stdout + r.stderr
    job = assert_recorded_in_full(out, job_dir)
    assert job.info.run_id == result["mlflow_run_id"]
    assert len(job_runs(out)[0]) == 2, "each job once"


def test_tracking_sync_replays_a_pending_file_once(tmp_path, monkeypatch):
    _, out, job_dir, _ = run_locked_job(tmp_path, monkeypatch)
    sync = [sys.executable, "-m", "pipeline.tracking", "sync", "--outputs", str(out)]
    r = subprocess.run(sync, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and f"replayed {job_dir / tracking_queue.PENDING_FILE}" in r.stdout, r.stdout + r.stderr
    assert_recorded_in_full(out, job_dir)
    r = subprocess.run(sync, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "nothing to sync" in r.stdout, r.stdout + r.stderr
    assert len(job_runs(out)[0]) == 1 and len(job_runs(out)[1]) == 5, "a second sync sends nothing twice"


def test_a_replay_cut_short_sends_nothing_twice(tmp_path):
    """A pending file replayed up to a failure, then again: every run, metric and tag exactly once."""
    seed_mlflow_db(tmp_path)
    tracker = tracking.open_tracker({"enabled": True, "experiment": "eagle3"}, tmp_path)
    offline = tracking.Tracker(tracker.uri, "eagle3", None, outputs=tmp_path, offline="test")
    with offline.run("job") as job:
        for step in range(3):
            offline.log_metrics(job, {"loss": float(step)}, step=step)
        with offline.run("stage", parent=job) as stage:
            offline.set_tags(stage, {"k": "v"})
    pending = offline.finish(tmp_path / "job")
    ops = json.loads(pending.read_text())["ops"]
    cut = dict(ops[4], op="no-such-op")  # the replay stops there, after the job's run and its metrics were sent
    pending.write_text(json.dumps({**json.loads(pending.read_text()), "ops": [*ops[:4], cut, *ops[4:]]}))
    assert tracking_queue.replay(tracker, pending) == len(ops) - 3
    left = json.loads(pending.read_text())
    left["ops"] = ops[1:]  # the metrics again, as a replay killed before it rewrote the file would leave them
    pending.write_text(json.dumps(left))
    assert tracking_queue.replay(tracker, pending) == 0 and not pending.exists()
    runs = tracker.client.search_runs([tracker.experiment_id])
    assert sorted(r.info.run_name for r in runs) == ["job", "stage"]
    job_run = next(r for r in runs if r.info.run_name == "job")
    assert [m.value for m in tracker.client.get_metric_history(job_run.info.run_id, "loss")] == [0.0, 1.0, 2.0]
    assert all(r.info.status == "FINISHED" for r in runs)
