"""Hydra callback: the MLflow parent run of a multirun, and the sweep summary.

`MlflowSweep` (registered in conf/config.yaml under hydra.callbacks) runs in the process that launches the
sweep: at the start it creates the parent run for the sweep directory (jobs find it through
`<sweep dir>/.mlflow_parent_run`); at the end it reads every job's `result.json`, writes the summary
(pipeline.sweep) and closes the parent run, FAILED if a job failed, in which case the sweep exits with status 1.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from pipeline import sweep, tracking

log = logging.getLogger(__name__)


class MlflowSweep(Callback):
    def __init__(self) -> None:
        self.tracker = None
        self.parent = None

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        self.tracker = tracking.open_tracker(config.tracking, config.paths.outputs)
        overrides = " ".join(config.hydra.overrides.task)
        self.parent = tracking.sweep_parent(self.tracker, Path(config.hydra.sweep.dir), tags={"sweep": overrides})

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        results = sweep.read_results(sweep_dir)
        with tracking.activate(self.tracker, self.parent):
            try:
                tracking.log_metrics(sweep.summarize(results, sweep_dir))
            except Exception:  # a broken summary must not leave the parent run open
                log.exception("the sweep summary failed; the parent run is closed without it")
        failed = [r["job_num"] for r in results if r.get("status") != "ok"]
        if self.tracker is not None and self.parent:
            self.tracker.end_run(self.parent, "FAILED" if failed else "FINISHED")
            self.tracker.finish(sweep_dir)  # what could not be sent: the next job replays it
        print(f"sweep: {len(results)} job(s) in {sweep_dir}" + (f", failed: {failed}" if failed else ""))
        if self.tracker is not None and self.tracker.enabled and self.tracker.experiment_id is not None:
            print(f"MLflow parent run {self.tracker.resolve(self.parent)}; look at it with: "
                  f"{tracking.ui_command(self.tracker.uri, self.tracker.experiment_id)}")
        if failed:
            sys.exit(1)
