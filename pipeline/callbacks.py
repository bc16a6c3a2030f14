"""Hydra callbacks: the MLflow parent run of a multirun, and the sweep summary.

`MlflowSweep` (registered in conf/config.yaml under hydra.callbacks) runs in the process that launches the
sweep: at the start it creates the parent run for the sweep directory (jobs find it through
`<sweep dir>/.mlflow_parent_run`); at the end it reads every job's `result.json` (written by the app into
its job directory), hands them to `summarize_sweep` and closes the parent run, FAILED if a job failed.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from pipeline import tracking

log = logging.getLogger(__name__)

RESULT_FILE = "result.json"


def summarize_sweep(children: list[dict], sweep_dir: Path) -> dict:
    """EXTENSION POINT (eval owner): summarise a finished multirun.

    `children`: one dict per job, ordered by job number, as written to `<job dir>/result.json`:
        {"job_num": int, "overrides": ["runtime.chain=2", ...], "job_dir": str, "status": "ok" | "failed",
         "mlflow_run_id": str | None,
         "stages": {stage: {"key": str | None, "cached": bool, "path": str, "report": dict}}}
    `sweep_dir`: the Hydra sweep directory; write plots/tables there.
    Return {name: number} to log as metrics on the sweep's parent run. `pipeline.tracking.log_metrics` and
    `pipeline.tracking.log_artifact` write to the parent run while this function runs.
    """
    from pipeline.stages.eval import summarize_sweep as eval_summary  # table + plot against K, best K

    return eval_summary(children, sweep_dir)


def read_children(sweep_dir: Path) -> list[dict]:
    results = [json.loads(p.read_text()) for p in Path(sweep_dir).rglob(RESULT_FILE)]
    return sorted(results, key=lambda r: r.get("job_num", 0))


class MlflowSweep(Callback):
    def __init__(self) -> None:
        self.tracker = None
        self.parent = None

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        from pipeline.app import outputs_dir

        self.tracker = tracking.open_tracker(config.tracking, outputs_dir(config))
        sweep = " ".join(config.hydra.overrides.task)
        self.parent = tracking.sweep_parent(self.tracker, Path(config.hydra.sweep.dir), tags={"sweep": sweep})

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        children = read_children(sweep_dir)
        with tracking.activate(self.tracker, self.parent):
            try:
                tracking.log_metrics(summarize_sweep(children, sweep_dir) or {})
            except Exception:  # a broken summary must not leave the parent run open
                log.exception("the sweep summary failed; the parent run is closed without it")
        failed = [c["job_num"] for c in children if c.get("status") != "ok"]
        if self.tracker is not None and self.parent:
            self.tracker.end_run(self.parent, "FAILED" if failed else "FINISHED")
        print(f"sweep: {len(children)} job(s) in {sweep_dir}" + (f", failed: {failed}" if failed else ""))
        if self.tracker is not None and self.tracker.enabled:
            print(f"MLflow parent run {self.parent}; look at it with: {tracking.ui_command(self.tracker.uri)}")
