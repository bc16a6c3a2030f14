"""`python -m pipeline`: run the stages target -> taps -> draft -> export -> eval up to `+stage=...`
(`+stage=serve`: up to export, then serve the artifacts until stopped; pipeline/stages/serve.py).

For each stage in order: import `pipeline/stages/<name>.py`, compute its cache key from its config
subtrees and its upstream keys (`plan_keys`, a pure function of the config), then load the artifact from
the store or build it (`Store.get_or_build`, under a file lock; the log says "cached <stage> <key>").
The eval stage is not content-addressed: it runs every time and writes into the Hydra job directory.

Before anything else the composed config is checked (pipeline.validate): a bad value stops the job in a
second, naming the key. Every job writes `<job dir>/result.json` (what ran, keys, reports, or the error;
read by the multirun summary) and ends by printing where the artifacts, the job directory and the MLflow
store are. A job of a multirun that fails is recorded as failed and the sweep goes on: the summary lists
it, the sweep's parent run ends FAILED and the sweep exits with status 1 (pipeline.callbacks).

Under torchrun (`torchrun --nproc-per-node N -m pipeline ...`) every rank composes the same config and
computes the same keys; rank 0 runs the job as above (the store's lock, the renames, MLflow, result.json) and
tells the others its plan; they run their share of the stages that have work to share (taps, draft: modules
with DISTRIBUTED = True) and nothing else (`Job.help`). No key depends on the number of ranks.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import ModuleType

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, open_dict

from pipeline import distributed, hardware, stages, tracking, tracking_queue
from pipeline.sweep import RESULT_FILE
from pipeline.store import Artifact, Store, cache_key, check_artifact, corrupt_message, git_commit
from pipeline.validate import ConfigError, check_config, check_prompts_with_target

log = logging.getLogger("pipeline")

# conf/ sits beside the packages at the repository root (the package is installed editable, `pip install -e`).
CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
EXIT_BAD_CONFIG = 2


def job_dir_id() -> str:
    """The pid, and for a torchrun rank other than 0 `-rank<r>`: each rank is a Hydra job of its own."""
    return str(os.getpid()) + (f"-rank{distributed.rank()}" if not distributed.is_main() else "")


# `${pid:}` in hydra.run.dir / hydra.sweep.dir: two jobs started in the same second get directories of their
# own. Cached, so a joblib worker (which copies its launcher's resolver cache) resolves the launcher's pid.
OmegaConf.register_new_resolver("pid", job_dir_id, use_cache=True)
# `${max_chain:${export.max_m}}`: the largest K a .pte of that max_m serves (its verify window is K + 1 rows), so
# a setting that must cover every K (the draft's training-time-test steps) has max_m as its one owner.
OmegaConf.register_new_resolver("max_chain", lambda max_m: int(max_m) - 1)


def write_result(job_dir: Path, *, job_num: int, overrides: list[str], status: str, error: str | None,
                 mlflow_run_id: str | None = None, tracking_note: str | None = None, stage_results=None) -> None:
    """`<job dir>/result.json`, written atomically (the multirun summary may read it at any time)."""
    result = {"job_num": job_num, "overrides": overrides, "job_dir": str(job_dir), "status": status, "error": error,
              "mlflow_run_id": mlflow_run_id, "tracking": tracking_note, "stages": stage_results or {}}
    job_dir.mkdir(parents=True, exist_ok=True)
    tmp = job_dir / (RESULT_FILE + ".tmp")
    tmp.write_text(json.dumps(result, indent=2, default=str))
    tmp.replace(job_dir / RESULT_FILE)


def stages_until(cfg: DictConfig) -> tuple[str, ...]:
    """The stages this job runs: all of them, or up to and including `cfg.stage` (stages.until)."""
    try:
        return stages.until(cfg.get("stage") or stages.ORDER[-1])
    except ValueError as e:
        raise ValueError(f"+stage={cfg.get('stage')}: {e}") from None


def config_subtrees(cfg: DictConfig, keys: tuple[str, ...]) -> dict:
    """The resolved config subtrees that enter a stage's key (a missing key is an error, not skipped)."""
    missing = [k for k in keys if k not in cfg]
    if missing:
        raise KeyError(f"config has no {missing} (a stage's CONFIG_KEYS must name top-level config groups)")
    return {k: OmegaConf.to_container(cfg[k], resolve=True) if OmegaConf.is_config(cfg[k]) else cfg[k] for k in keys}


def key_inputs(cfg: DictConfig, mod: ModuleType) -> dict:
    """The config subtrees of a stage's CONFIG_KEYS, plus `_extra` from its optional `key_extra(cfg)` hook
    (facts outside the config, e.g. a fingerprint of an input directory)."""
    inputs = config_subtrees(cfg, tuple(mod.CONFIG_KEYS))
    extra = mod.key_extra(cfg) if hasattr(mod, "key_extra") else None
    if extra:
        inputs["_extra"] = extra
    return inputs


def add_fingerprints(cfg: DictConfig, mods: dict[str, ModuleType]) -> None:
    """Put `data.fingerprint` (a hash of the corpus contents) into the config when a stage keys on data."""
    if any("data" in m.CONFIG_KEYS for m in mods.values()) and "fingerprint" not in cfg.data:
        from pipeline import data

        t0 = time.perf_counter()
        fp = data.fingerprint(OmegaConf.to_container(cfg.data, resolve=True))
        with open_dict(cfg):
            cfg.data.fingerprint = fp
        log.info("data fingerprint %s (%.1f s)", fp[:12], time.perf_counter() - t0)


def plan_keys(cfg: DictConfig, mods: dict[str, ModuleType]) -> dict[str, str | None]:
    """{stage: cache key} for the given stage modules in order (None for the eval stage). The config's `auto`
    values must be resolved first (pipeline.hardware.resolve): a key holds what a stage uses."""
    if left := hardware.unresolved(cfg):
        raise ValueError(f"{', '.join(left)} = auto: resolve the machine's values (pipeline.hardware.resolve) "
                         "before computing cache keys")
    keys: dict[str, str | None] = {}
    for name, mod in mods.items():
        if not stages.content_addressed(mod):
            keys[name] = None
            continue
        upstream = {u: keys[u] for u in stages.upstream(mod, cfg)}
        keys[name] = cache_key(name, mod.SCHEMA_VERSION, key_inputs(cfg, mod), upstream)
    return keys


def needed_stages(cfg: DictConfig, mods: dict[str, ModuleType], keys: dict[str, str | None],
                  store: Store) -> set[str]:
    """The stages this job must load or build: the last one, and, transitively, the upstream of every
    needed stage whose artifact is not in the store yet (the eval stage always runs, so it needs all its
    upstream). A cached draft, say, means the taps are never loaded."""
    needed: set[str] = set()

    def need(name: str) -> None:
        if name in needed:
            return
        needed.add(name)
        if keys[name] is None or not store.exists(name, keys[name]):
            for u in stages.upstream(mods[name], cfg):
                need(u)

    if mods:
        need(list(mods)[-1])
    return needed


def shared(mod: ModuleType) -> bool:
    """Whether every torchrun rank runs a share of this stage (DISTRIBUTED = True), or rank 0 alone."""
    return bool(getattr(mod, "DISTRIBUTED", False))


class Job:
    """One Hydra job: runs the stages, tracks them, records the result."""

    def __init__(self, cfg: DictConfig, job_dir: Path, *, job_num: int = 0, overrides: list[str] | None = None,
                 sweep_dir: Path | None = None):
        self.cfg = cfg
        self.job_dir = Path(job_dir)
        self.job_num = job_num
        self.overrides = list(overrides or [])
        self.sweep_dir = sweep_dir
        self.store = Store(Path(cfg.paths.store).absolute())
        self.tracker = tracking.open_tracker(cfg.tracking, cfg.paths.outputs)
        self.results: dict[str, dict] = {}
        self.run_id: str | None = None
        self._cached_at_start: set[str] = set()

    def run(self) -> dict:
        """Run the stages; returns {stage: Artifact | report}. Under torchrun, rank 0 runs this job as one
        process would and the other ranks `help` it (they return {})."""
        names = stages_until(self.cfg)
        mods = {name: stages.load(name, self.cfg.stage_package) for name in names}
        hardware.resolve(self.cfg)  # `auto` -> this machine's values (main has done it already; a no-op then)
        add_fingerprints(self.cfg, mods)
        keys = plan_keys(self.cfg, mods)
        if not distributed.is_main():
            self.help(mods, keys)
            return {}
        commit = git_commit(Path(__file__).parent)
        tracking_queue.sync(self.tracker)  # what earlier jobs could not send: their runs end as they ended
        tracking.close_stale_runs(self.tracker)  # left RUNNING by a job that was killed (SIGKILL) before this one
        parent = tracking.sweep_parent(self.tracker, self.sweep_dir) if self.sweep_dir else None
        name = f"job {self.job_num}: {' '.join(self.overrides)}" if self.sweep_dir else \
            "pipeline" + (f": {' '.join(self.overrides)}" if self.overrides else "")
        params = tracking.flatten(OmegaConf.to_container(self.cfg, resolve=True))
        tags = {"job_dir": str(self.job_dir), "git_commit": commit, "mlflow.source.git.commit": commit,
                "mlflow.source.name": "python -m pipeline", "stages": ",".join(names)}
        status, error = "failed", None
        try:
            with self.tracker.run(name, parent=parent, tags=tags, params=params) as self.run_id:
                artifacts: dict[str, Artifact] = {}
                needed = needed_stages(self.cfg, mods, keys, self.store)
                if "eval" in mods and keys.get("target") and self.store.exists("target", keys["target"]):
                    check_prompts_with_target(self.cfg, self.store.path("target", keys["target"]))
                self._cached_at_start = {n for n in needed if keys[n] is not None and self.store.exists(n, keys[n])}
                distributed.broadcast({"keys": keys, "needed": sorted(needed), "cached": sorted(self._cached_at_start)},
                                      "the job's plan")
                for stage_name, mod in mods.items():
                    if stage_name in needed:
                        artifacts[stage_name] = self._run_stage(stage_name, mod, keys, artifacts, commit)
                    else:
                        self._note_unneeded(stage_name, keys[stage_name])
            status = "ok"
            return artifacts
        except BaseException as e:
            error = f"{type(e).__name__}: {e}"
            raise
        finally:
            self.tracker.finish(self.job_dir)  # writes it could not send go to tracking_pending.json, beside:
            write_result(self.job_dir, job_num=self.job_num, overrides=self.overrides, status=status, error=error,
                         mlflow_run_id=self.tracker.resolve(self.run_id), tracking_note=self.tracker.note(),
                         stage_results=self.results)

    def help(self, mods: dict[str, ModuleType], keys: dict[str, str | None]) -> None:
        """A rank other than 0: run this rank's share of each stage rank 0 builds that has work to share
        (a stage module with DISTRIBUTED = True: taps, draft), and nothing else. Rank 0 holds the store's lock,
        writes the artifact and tracks the job; this rank reads the upstream artifacts rank 0 stored (waiting
        at their locks), runs `mod.run(cfg, upstream, None)` (no `out`: it writes only into the stage's
        scratch dir), then waits for the artifact rank 0 renames into the store. Stages with nothing to share
        (target, export, eval) run on rank 0 only; this rank is done after the last shared one."""
        r, n = distributed.rank(), distributed.world_size()
        plan = distributed.broadcast(None, "the job's plan")
        if plan["keys"] != keys:
            differ = sorted(k for k in keys if keys[k] != plan["keys"].get(k))
            raise distributed.RankFailure(f"rank {r} computed other cache keys than rank 0 for {differ}: the ranks "
                                          "see different configs, code or corpora")
        for name, mod in mods.items():
            if keys[name] is None or name not in plan["needed"] or not shared(mod):
                continue
            if name in plan["cached"]:
                log.info("rank %d: %s %s is in the store; nothing to share", r, name, keys[name])
                continue
            upstream = {u: self.store.wait_for(u, keys[u]) for u in stages.upstream(mod, self.cfg)}
            if distributed.broadcast(None, f"whether rank 0 builds {name}") != "build":
                log.info("rank %d: cached %s %s", r, name, keys[name])
                continue
            log.info("rank %d of %d: running its share of %s %s", r, n, name, keys[name])
            t0 = time.perf_counter()
            with self.store.helping(name, keys[name]):
                mod.run(self.cfg, upstream, None)
            self.store.wait_for(name, keys[name])  # rank 0 stores the artifact; this rank reads it
            log.info("rank %d: its share of %s done in %.1f s; rank 0 stored it", r, name, time.perf_counter() - t0)
        log.info("rank %d of %d: done (rank 0 runs the stages that have nothing to share)", r, n)

    def _note_unneeded(self, name: str, key: str) -> None:
        """A stage nothing downstream needs loaded (its consumers are cached): report it without loading."""
        manifest = self.store.manifest(name, key)
        if manifest is None:
            log.info("skipping %s %s: not built, and nothing downstream needs it", name, key)
            self.results[name] = {"key": key, "cached": False, "path": None, "report": {}, "skipped": True}
            return
        log.info("cached %s %s (not loaded: nothing downstream needs it)", name, key)
        self.results[name] = {"key": key, "cached": True, "path": str(self.store.path(name, key)),
                              "report": manifest.get("report", {})}
        problems = check_artifact(self.store.path(name, key), hash_files="quick").problems
        if problems:  # nothing this job reads is damaged, so it goes on; the store needs a repair
            log.warning("%s", corrupt_message(self.store.root, name, self.store.path(name, key), problems, read=False))
            self.results[name]["problems"] = list(problems)
        self.tracker.log_metrics(self.run_id, tracking.numeric(self.results[name]["report"], prefix=f"{name}."))
        self.tracker.set_tags(self.run_id, {f"{name}.key": key, f"{name}.cached": "true"})

    def _run_stage(self, name: str, mod: ModuleType, keys: dict, artifacts: dict, commit: str):
        key = keys[name]
        # Upstream artifacts are loaded only when this stage must be built (see needed_stages).
        upstream = {u: artifacts[u] for u in stages.upstream(mod, self.cfg) if u in artifacts}
        subtrees = key_inputs(self.cfg, mod)
        upstream_keys = {u: keys[u] for u in stages.upstream(mod, self.cfg) if keys[u] is not None}
        stage_tags = {"stage": name, "key": key or "", "git_commit": commit,
                      **{f"upstream.{u}": k for u, k in upstream_keys.items()}}

        announce = key is not None and shared(mod) and name not in self._cached_at_start

        def build(out: Path) -> dict:
            nonlocal announce
            if announce:  # the other ranks run their share of it now (Job.help)
                distributed.broadcast("build", f"whether rank 0 builds {name}")
                announce = False
            log.info("running %s%s", name, f" {key}" if key else "")
            t0 = time.perf_counter()
            with self.tracker.run(name, parent=self.run_id, tags=stage_tags,
                                  params=tracking.flatten(subtrees)) as stage_run:
                with tracking.activate(self.tracker, stage_run):
                    report = mod.run(self.cfg, upstream, out)
                report = dict(report or {})
                report.setdefault("seconds", round(time.perf_counter() - t0, 2))
                self.tracker.log_metrics(stage_run, tracking.numeric(report))
            log.info("%s done in %.1f s", name, time.perf_counter() - t0)
            return report

        if key is None:
            out = self.job_dir
            report = build(out)
            cached, result = False, report
        else:
            estimate = (lambda: mod.estimate_bytes(self.cfg, upstream)) if hasattr(mod, "estimate_bytes") else None
            artifact, cached = self.store.get_or_build(
                name, key, build, config=subtrees, upstream=upstream_keys, schema_version=mod.SCHEMA_VERSION,
                estimate=estimate)
            if announce:  # another job stored it meanwhile
                distributed.broadcast("cached", f"whether rank 0 builds {name}")
            out, report, result = artifact.path, artifact.report, artifact
        self.results[name] = {"key": key, "cached": cached, "path": str(out), "report": report}
        self.tracker.log_metrics(self.run_id, tracking.numeric(report, prefix=f"{name}."))
        if key is None:  # the eval stage's numbers are the job's own: also under metrics.json's names
            self.tracker.log_metrics(self.run_id, tracking.numeric(report))
        self.tracker.set_tags(self.run_id, {f"{name}.key": key or "", f"{name}.cached": str(cached).lower()})
        return result

    def summary(self) -> str:
        lines = ["", "artifacts:"]
        for name, r in self.results.items():
            what = "cached" if r["cached"] else ("ran" if r["key"] else "ran (job dir)")
            if r.get("skipped"):
                what, r = "not needed", dict(r, path="(not built; every stage after it is cached)")
            lines.append(f"  {name:7} {what:13} {r['path']}")
        lines.append(f"job dir: {self.job_dir}")
        lines.append(f"store:   {self.store.root}   (python -m pipeline.store list|verify --root {self.store.root})")
        if self.tracker.enabled:
            lines.append(f"MLflow:  {self.tracker.uri}   (run {self.tracker.resolve(self.run_id)})")
            if self.tracker.experiment_id is not None:
                lines.append(f"  look at it with: {tracking.ui_command(self.tracker.uri, self.tracker.experiment_id)}")
            if note := self.tracker.note():
                lines.append(f"  {note}")
        else:
            lines.append(f"MLflow:  off ({self.tracker.reason})")
        return "\n".join(lines)


def set_threads(cfg: DictConfig, jobs_at_once: int = 1) -> int:
    """torch threads of this (the main) thread: `threads`, or the cores this process may use shared among the jobs
    running at once, which the CPU training loops may lower to one thread while that steps faster
    (pipeline.hardware.ThreadGovernor). The ExecuTorch runtime's pool takes this count when the process loads
    its first .pte (runner.engine.size_runtime_pool); every other thread's OpenMP team stays at one
    (models/threads.py). -> the count."""
    import torch

    n = int(cfg.get("threads") or max(1, hardware.usable_cores() // max(1, jobs_at_once)))
    hardware.govern_threads(None if cfg.get("threads") else n)
    torch.set_num_threads(n)
    return n


def parallel_jobs(hc) -> int:
    """How many jobs the launcher runs at once (joblib's n_jobs; -1 = all cores); 1 for the basic launcher."""
    launcher = hc.get("launcher") or {}
    if "joblib" not in str(launcher.get("_target_", "")).lower():
        return 1
    n = int(launcher.get("n_jobs") or 1)
    return hardware.usable_cores() if n < 0 else n


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")  # so a killed job's MLflow runs end KILLED, not RUNNING


def outputs_of(argv: list[str]) -> Path | None:
    """paths.outputs as a command line sets it (an override, else $PIPELINE_OUTPUTS, else `outputs`, as
    conf/config.yaml reads them); None where Hydra makes no job directory (--help, --cfg) or the value is not a
    plain path (an interpolation, a sweep, another primary config)."""
    from hydra._internal.utils import get_args_parser
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        args, _ = get_args_parser().parse_known_args(argv)
        overrides = OverridesParser.create().parse_overrides(args.overrides)
    except Exception:  # Hydra reports a malformed command line itself
        return None
    if args.help or args.hydra_help or args.cfg or args.info or args.shell_completion or args.config_name:
        return None
    given = [o for o in overrides if o.key_or_group == "paths.outputs"]
    if not given:
        return Path(os.environ.get("PIPELINE_OUTPUTS", "outputs"))
    value = given[-1].value()
    return Path(value) if isinstance(value, str) and "${" not in value else None


def check_outputs(outputs: Path | None) -> None:
    """Make paths.outputs and write a file in it, or exit (EXIT_BAD_CONFIG) with one line naming it and the
    system's reason (a file, under a file, read-only): Hydra's first mkdir under it would end the job with a
    traceback before anything of ours runs."""
    if outputs is None:
        return
    try:
        outputs.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=outputs).close()
    except OSError as e:
        why = "not a directory" if isinstance(e, FileExistsError) else e.strerror
        print(f"error: paths.outputs={outputs} cannot hold the job's files ({why}: {e.filename}): set "
              "paths.outputs=DIR or $PIPELINE_OUTPUTS", file=sys.stderr)
        sys.exit(EXIT_BAD_CONFIG)


def main() -> None:
    """`python -m pipeline [overrides]`: paths.outputs checked (`check_outputs`), then the Hydra app."""
    check_outputs(outputs_of(sys.argv[1:]))
    hydra_main()


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
def hydra_main(cfg: DictConfig) -> None:
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _interrupt)
    hc = HydraConfig.get()
    multirun = hc.mode == RunMode.MULTIRUN
    job_dir, job_num, overrides = Path(hc.runtime.output_dir), hc.job.num if multirun else 0, list(hc.overrides.task)
    try:
        check_config(cfg)  # every value, in a second, before anything is measured or built
        resolved = hardware.resolve(cfg)  # `auto` -> this machine's value, before any key is computed
        if resolved:
            check_config(cfg)  # what depends on the resolved values (runtime.chain against max_m)
    except ConfigError as e:
        write_result(job_dir, job_num=job_num, overrides=overrides, status="failed", error=str(e))
        log.error("%s", e)
        if multirun:
            return  # recorded: the sweep summary lists the job as failed
        sys.exit(EXIT_BAD_CONFIG)
    # torchrun's ranks on one machine share its cores
    set_threads(cfg, parallel_jobs(hc) if multirun else distributed.local_world_size())
    distributed.init(str(cfg.device))
    try:
        job = Job(cfg, job_dir, job_num=job_num, overrides=overrides,
                  sweep_dir=Path(hc.sweep.dir) if multirun else None)
        try:
            job.run()
        except Exception as e:
            distributed.record_error(e)
            if not multirun:
                raise
            # Hydra would re-raise it after the batch, before the sweep summary: record it and go on instead.
            log.exception("job %d (%s) failed; the sweep goes on", job_num, " ".join(overrides))
            return
    finally:
        distributed.teardown()
    if distributed.is_main():
        print(job.summary())
