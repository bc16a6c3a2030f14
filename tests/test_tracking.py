"""MLflow tracking: run tree of a job and of a multirun, and no MLflow at all when tracking is off."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pipeline import tracking
from pipeline_fakes import run_app, write_fake_stages


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
    tracking.log_metrics({"loss": 1.0}, step=1)  # no active run: nothing happens, no error
    with tracking.activate(tracking.NullTracker(), "some-run"):
        tracking.log_metrics({"loss": 1.0}, step=1)
        tracking.log_artifact("/nonexistent")


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
