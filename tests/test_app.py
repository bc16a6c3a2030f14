"""The Hydra app: composition, cache keys across stages, stage discovery, and the end-of-run report."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from hydra import compose, initialize_config_dir

from pipeline import hardware, stages
from pipeline.app import CONF_DIR, needed_stages, plan_keys, stages_until
from pipeline.store import Store
from pipeline_fakes import SPECS, run_app, write_fake_stages


def compose_cfg(*overrides: str, resolve: bool = True):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=list(overrides))
    if resolve:
        hardware.resolve(cfg)
    return cfg


def stage_modules() -> dict:
    return {name: stages.load(name) for name in stages.ORDER[:-1]}


def export_key(*overrides: str) -> str:
    return plan_keys(compose_cfg(*overrides), stage_modules())["export"]


def test_default_config_composes_with_every_group():
    cfg = compose_cfg()
    for group in ("target", "data", "taps", "draft", "export", "runtime", "tracking"):
        assert group in cfg, group
    assert cfg.device == "cpu" and cfg.target.kind == "tiny" and cfg.data.kind == "stdlib"
    assert stages_until(cfg) == stages.ORDER
    assert stages_until(compose_cfg("+stage=draft")) == ("target", "taps", "draft")


def test_smoke_preset_shrinks_and_composes_with_other_choices(tmp_path):
    smoke = compose_cfg("+experiment=smoke")
    assert smoke.target.model.n_layers < compose_cfg().target.model.n_layers
    assert smoke.target.model.max_seq_len == smoke.target.train.seq_len and smoke.export.max_seq_len <= 128
    mixed = compose_cfg("+experiment=smoke", "target=hf", f"target.path={tmp_path}", "data=text",
                        f"data.paths=[{tmp_path}/a.txt]")
    assert mixed.target.kind == "hf" and mixed.export.max_seq_len == 128 and mixed.data.kind == "text"


def test_gpu_preset_fits_its_own_windows_and_passes_validation():
    from pipeline.validate import check_config

    gpu = compose_cfg("+experiment=gpu")
    check_config(gpu)
    assert gpu.target.model.n_layers > compose_cfg().target.model.n_layers
    assert gpu.taps.held_out_seq_len <= gpu.export.max_seq_len
    assert gpu.target.model.max_seq_len == gpu.target.train.long_seq_len >= gpu.export.max_seq_len
    assert gpu.draft.draft_vocab_size >= gpu.target.tokenizer.vocab_size


GPU_TOKENS = 1_500_000  # on-policy tokens the GPU experiment trains every draft on, at least


def on_policy_tokens(cfg) -> int:
    return cfg.taps.train_sequences * (cfg.taps.seq_len - cfg.taps.prompt_len)


@pytest.mark.parametrize("preset", ["gemma3_270m", "smollm2_135m", "tiny"])
def test_gpu_experiment_sizes_taps_and_draft_for_every_target(preset):
    """+experiment=gpu, merged after the target preset: 1.5M+ on-policy tokens shaped like the eval, a trained
    TTT step for every K the .pte offers (ttt_steps follows export.max_m), and a GGUF target's subtree as the
    preset leaves it; the embedded default alone takes GPU model sizes (conf/target/tiny/gpu.yaml)."""
    plain, gpu = compose_cfg(f"target={preset}"), compose_cfg(f"target={preset}", "+experiment=gpu")
    assert on_policy_tokens(plain) < GPU_TOKENS <= on_policy_tokens(gpu) == 2048 * 1024
    assert gpu.runtime.max_new_tokens >= 1024, "answers at the length users ask for"
    assert gpu.taps.seq_len == gpu.taps.held_out_seq_len == gpu.runtime.prompt_len + gpu.runtime.max_new_tokens
    assert gpu.taps.prompt_len == gpu.taps.held_out_prompt_len == gpu.runtime.prompt_len == 64
    assert gpu.taps.seq_len <= gpu.export.max_seq_len
    assert gpu.draft.train.ttt_steps == gpu.export.max_m - 1 == 7
    wider = compose_cfg(f"target={preset}", "+experiment=gpu", "export.max_m=6", "export.min_prefill_chunk=7")
    assert wider.draft.train.ttt_steps == 5, "one owner: ttt_steps follows export.max_m"
    # SmolLM2 asks for twice the steps (conf/target/smollm2_135m/gpu.yaml); the CPU preset keeps its own
    assert (gpu.draft.train.steps, gpu.draft.train.batch_size) == (2400 if preset == "smollm2_135m" else 1200, 10)
    assert plain.draft.train.steps != gpu.draft.train.steps
    assert gpu.draft.draft_vocab_size == (8192 if preset == "tiny" else plain.draft.draft_vocab_size)
    assert gpu.draft.norm_before_residual == plain.draft.norm_before_residual  # a preset's own choice stays
    if preset == "tiny":
        assert gpu.target.model.hidden_size == 1024 and gpu.target.model.n_layers == 20
        assert gpu.target.model.vocab_size == gpu.target.tokenizer.vocab_size == 8192
    else:
        assert gpu.target == plain.target, "the experiment changes nothing of a GGUF target"
        assert "model" not in gpu.target and "tokenizer" not in gpu.target


def test_the_readmes_slurm_example_names_keys_of_the_submitit_launcher():
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["hydra/launcher=submitit_slurm"], return_hydra_config=True)
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("SlurmLauncher")
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    named = set(re.findall(r"hydra\.launcher\.(\w+)=", readme[readme.index("hydra/launcher=submitit_slurm"):]))
    assert {"partition", "gpus_per_task", "timeout_min"} <= named
    assert named <= set(launcher), named - set(launcher)


def test_same_config_gives_the_same_keys():
    assert plan_keys(compose_cfg(), stage_modules()) == plan_keys(compose_cfg(), stage_modules())


def test_runtime_chain_does_not_change_the_export_key():
    assert export_key("runtime.chain=1") == export_key("runtime.chain=4") == export_key()


def test_the_engine_group_does_not_change_the_export_key(monkeypatch):
    """export.* alone configures the export: neither the engine chosen nor any of its options moves the export key,
    also where `export.default_chain=auto` is resolved from this CPU's row tile (pinned here at 4: K = 3); an
    engine that quantises the target moves it only through the draft it will serve (taps.target_quant=auto)."""
    monkeypatch.setattr(hardware, "row_tile", lambda quant: {"tile": 4, "capability": "pinned by the test"})
    keys = {export_key(*overrides) for overrides in (
        (), ("engine=eager",), ("engine=cuda",), ("engine=cuda", "engine.max_m=4", "engine.default_chain=2"),
        ("engine=cuda", "engine.quant=w4_g32", "engine.exact=false", "taps.target_quant=none"),
        ("engine.exact=true", "engine.exact_width=4"))}
    assert len(keys) == 1
    assert export_key("engine=cuda", "engine.quant=w4_g32") not in keys
    assert compose_cfg().export.default_chain == compose_cfg("engine=cuda").export.default_chain == 3


@pytest.mark.parametrize("overrides, served", [
    ((), "none"), (("export.quant=fp32",), "none"), (("export.quant=8da4w_offsets",), "8da4w_offsets"),
    (("engine=eager", "export.quant=8da4w_offsets"), "8da4w_offsets"), (("engine=cuda",), "none"),
    (("engine=cuda", "engine.quant=w4_g128"), "w4_g128"), (("engine=cuda", "export.quant=8da4w_offsets"), "none"),
    (("export.quant=8da4w_offsets", "taps.target_quant=none"), "none"),
])
def test_the_taps_tap_the_target_as_the_engine_serves_it(overrides, served):
    """taps.target_quant=auto resolves to the served target's scheme (the .pte's for pte and eager, the CUDA
    engine's own), and the taps and draft keys follow it; the target's key does not."""
    cfg = compose_cfg(*overrides)
    assert cfg.taps.target_quant == served
    base = plan_keys(compose_cfg("taps.target_quant=none"), stage_modules())
    keys = plan_keys(cfg, stage_modules())
    assert keys["target"] == base["target"]
    if served != "none":
        assert keys["taps"] != base["taps"] and keys["draft"] != base["draft"]
    else:
        assert keys["taps"] == base["taps"]


@pytest.mark.parametrize("native", [True, False])
def test_auto_autocast_keys_as_the_dtype_this_machine_computes_natively(monkeypatch, native):
    """auto resolves to bfloat16 where the device has native bf16 and to fp32 (null) elsewhere, and the key
    holds the resolved dtype: auto builds the artifact an explicit choice of that dtype builds."""
    monkeypatch.setattr(hardware, "native_bf16", lambda device: (native, "pinned by the test"))
    explicit = "bfloat16" if native else "null"
    auto = compose_cfg()
    assert auto.target.train.autocast == auto.draft.train.autocast == ("bfloat16" if native else None)
    mods = stage_modules()
    pinned = plan_keys(compose_cfg(f"target.train.autocast={explicit}", f"draft.train.autocast={explicit}"), mods)
    other = "null" if native else "bfloat16"
    assert plan_keys(auto, mods) == pinned
    assert plan_keys(compose_cfg(f"target.train.autocast={other}"), mods)["target"] != pinned["target"]
    assert plan_keys(compose_cfg(f"draft.train.autocast={other}"), mods)["draft"] != pinned["draft"]


def test_an_unresolved_auto_never_reaches_a_key():
    with pytest.raises(ValueError, match="target.train.autocast, draft.train.autocast, export.default_chain, "
                                         "taps.target_quant = auto"):
        plan_keys(compose_cfg(resolve=False), stage_modules())


@pytest.mark.parametrize("tile, quant, chain", [(7, "8da4w_draft", 6), (6, "fp32", 5), (3, "8da4w_offsets", 2),
                                                      (2, "8da4w_offsets", 1)])
def test_auto_default_chain_keeps_the_default_window_in_one_gemm_pass(monkeypatch, tile, quant, chain):
    monkeypatch.setattr(hardware, "row_tile", lambda q: {"tile": tile, "capability": "pinned by the test"})
    cfg = compose_cfg(f"export.quant={quant}")
    assert cfg.export.default_chain == chain
    assert export_key(f"export.quant={quant}") == export_key(f"export.quant={quant}", f"export.default_chain={chain}")
    # the CUDA engine runs no .pte: its own default K is min(DEFAULT_CHAIN, engine.max_m - 1) whatever the CPU
    assert compose_cfg(f"export.quant={quant}", "engine=cuda").engine.default_chain == 6
    assert compose_cfg("engine=cuda", "engine.max_m=4").engine.default_chain == 3


def test_export_max_m_changes_the_export_key():
    assert export_key("export.max_m=4") != export_key("export.max_m=8")


def test_the_cache_length_is_the_exports_alone():
    """export.max_seq_len re-exports and retrains nothing; the cuda engine's own cache length enters no key."""
    mods = stage_modules()
    base = plan_keys(compose_cfg(), mods)
    longer = plan_keys(compose_cfg("export.max_seq_len=4096"), mods)
    assert longer["export"] != base["export"]
    assert all(longer[s] == base[s] for s in ("target", "taps", "draft"))
    assert plan_keys(compose_cfg("engine=cuda", "engine.max_seq_len=8192"), mods)["export"] == base["export"]


def test_upstream_changes_propagate_to_the_export_key():
    assert export_key("target.train.lr=1e-3") != export_key()
    keys_a = plan_keys(compose_cfg(), stage_modules())
    keys_b = plan_keys(compose_cfg("export.max_m=4"), stage_modules())
    assert keys_a["target"] == keys_b["target"] and keys_a["draft"] == keys_b["draft"]


def test_the_cuda_engine_needs_no_export_and_the_pte_engine_does(tmp_path):
    mods = {name: stages.load(name) for name in stages.ORDER}
    store = Store(tmp_path / "store")
    for engine, export_needed in (("pte", True), ("eager", True), ("cuda", False)):
        cfg = compose_cfg(f"engine={engine}")
        needed = needed_stages(cfg, mods, plan_keys(cfg, mods), store)
        assert needed >= {"target", "taps", "draft", "eval"} and ("export" in needed) == export_needed, engine


def test_second_run_is_cached_and_report_says_where_things_are(tmp_path):
    write_fake_stages(tmp_path / "fakes")
    out = tmp_path / "out"
    first = run_app(["tracking=none"], tmp_path / "fakes", out)
    assert first.returncode == 0, first.stdout + first.stderr
    second = run_app(["tracking=none", "runtime.chain=3"], tmp_path / "fakes", out)
    assert second.returncode == 0, second.stdout + second.stderr
    for name in ("target", "taps", "draft", "export"):
        assert f"cached {name} " in second.stdout, name
    assert "eval    ran (job dir)" in second.stdout
    assert f"store:   {out / 'store'}" in second.stdout
    assert sorted(p.name for p in (out / "store").iterdir() if not p.name.startswith(".")) == sorted(
        n for n in SPECS if n != "eval")


def test_upstream_of_a_cached_stage_is_not_loaded(tmp_path):
    import shutil

    write_fake_stages(tmp_path / "fakes")
    out = tmp_path / "out"
    assert run_app(["tracking=none"], tmp_path / "fakes", out).returncode == 0
    shutil.rmtree(out / "store" / "taps")  # the draft built from it is still in the store
    r = run_app(["tracking=none", "runtime.chain=2"], tmp_path / "fakes", out)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "taps    not needed" in r.stdout and "draft   cached" in r.stdout and "eval    ran" in r.stdout
    r = run_app(["tracking=none", "draft.train.steps=3"], tmp_path / "fakes", out)  # a new draft needs taps again
    assert r.returncode == 0 and "taps    ran" in r.stdout, r.stdout + r.stderr


def test_two_runs_started_together_keep_separate_records(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    write_fake_stages(tmp_path / "fakes")
    out = tmp_path / "out"
    with ThreadPoolExecutor(2) as pool:
        runs = list(pool.map(lambda k: run_app(["tracking=none", f"runtime.chain={k}"], tmp_path / "fakes", out),
                             (2, 3)))
    assert all(r.returncode == 0 for r in runs), [r.stderr for r in runs]
    results = sorted((json.loads(p.read_text()) for p in (out / "runs").rglob("result.json")),
                     key=lambda r: r["overrides"])
    assert [r["overrides"][-1] for r in results] == ["runtime.chain=2", "runtime.chain=3"]
    assert len({r["job_dir"] for r in results}) == 2
    for r, k in zip(results, (2, 3)):
        assert json.loads((Path(r["job_dir"]) / "metrics.json").read_text()) == {"chain": k}


def test_a_sweep_with_failing_jobs_writes_its_summary_marks_the_parent_and_exits_1(tmp_path):
    from pipeline import tracking

    write_fake_stages(tmp_path / "fakes")
    out = tmp_path / "out"
    r = run_app(["-m", "runtime.chain=2,100,5"], tmp_path / "fakes", out)
    assert r.returncode == 1, r.stdout + r.stderr
    summary = next((out / "multirun").rglob("summary.md")).read_text()
    assert "| 0 | 2 |" in summary, summary  # job 0's row
    assert "2 of 3 job(s) failed" in summary
    assert re.search(r"job 1 \(.*runtime.chain=100\): failed: invalid config", summary), summary
    assert re.search(r"job 2 \(.*runtime.chain=5\): failed: RuntimeError: fake eval failure at K=5", summary)
    tracker = tracking.open_tracker({"enabled": True, "experiment": "eagle3"}, out)
    runs = tracker.client.search_runs([tracker.experiment_id], max_results=100)
    parent = next(x for x in runs if x.info.run_name.startswith("sweep "))
    assert parent.info.status == "FAILED" and parent.data.metrics["failed_jobs"] == 2
    assert not [x.info.run_name for x in runs if x.info.status == "RUNNING"]


def test_a_stage_that_will_not_fit_stops_the_job_before_it_runs_naming_stage_path_need_and_free(tmp_path):
    fakes, out = tmp_path / "fakes", tmp_path / "out"
    write_fake_stages(fakes)
    taps = fakes / "fakestages" / "taps.py"
    taps.write_text(taps.read_text() + "\n\ndef estimate_bytes(cfg, upstream):\n    return 10**18\n")
    r = run_app(["+stage=draft", "tracking=none"], fakes, out)
    assert r.returncode != 0
    log = r.stdout + r.stderr
    assert re.search(rf"NoSpace: \[Errno 28\] taps: building [0-9a-f]{{64}} needs about \d+\.\d GB under "
                     rf"{out / 'store' / 'taps'} \(artifact and scratch, estimated\), but only .* is free there", log), log
    assert "running taps" not in log and not (out / "store" / "draft").exists()
    result = json.loads(next((out / "runs").rglob("result.json")).read_text())
    assert result["status"] == "failed" and "needs about" in result["error"]


def test_a_damaged_artifact_the_job_does_not_read_is_reported_at_a_stat_s_cost(tmp_path):
    """A cached draft means the taps are not loaded; a truncated taps file is still noticed (its size against
    the manifest), named with the repair command, and the job, which reads nothing damaged, goes on."""
    fakes, out = tmp_path / "fakes", tmp_path / "out"
    write_fake_stages(fakes)
    assert run_app(["+stage=draft", "tracking=none"], fakes, out).returncode == 0
    (taps,) = (out / "store" / "taps").glob("[0-9a-f]*")
    (taps / "taps.json").write_text("{")  # truncated
    r = run_app(["+stage=draft", "tracking=none"], fakes, out)
    assert r.returncode == 0, r.stdout + r.stderr
    log = r.stdout + r.stderr
    assert f"taps artifact {taps} does not match its manifest: taps.json is 1 bytes, the manifest records" in log
    assert "This run does not read it and goes on" in log and "python -m pipeline.store repair" in log
    result = json.loads(sorted((out / "runs").rglob("result.json"))[-1].read_text())
    assert result["status"] == "ok" and result["stages"]["draft"]["cached"] is True
    (problem,) = result["stages"]["taps"]["problems"]
    assert problem.startswith("taps.json is 1 bytes, the manifest records")
