"""The Hydra app: composition, cache keys across stages, stage discovery, and the end-of-run report."""

from __future__ import annotations

from hydra import compose, initialize_config_dir

from pipeline import stages
from pipeline.app import CONF_DIR, plan_keys, stages_until
from pipeline_fakes import SPECS, run_app, write_fake_stages


def compose_cfg(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


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
    assert smoke.target.model.max_seq_len == smoke.target.max_seq_len <= 128
    mixed = compose_cfg("+experiment=smoke", "target=hf", f"target.path={tmp_path}", "data=text",
                        f"data.paths=[{tmp_path}/a.txt]")
    assert mixed.target.kind == "hf" and mixed.target.max_seq_len == 128 and mixed.data.kind == "text"


def test_same_config_gives_the_same_keys():
    assert plan_keys(compose_cfg(), stage_modules()) == plan_keys(compose_cfg(), stage_modules())


def test_runtime_chain_does_not_change_the_export_key():
    assert export_key("runtime.chain=1") == export_key("runtime.chain=4") == export_key()


def test_export_max_m_changes_the_export_key():
    assert export_key("export.max_m=4") != export_key("export.max_m=8")


def test_upstream_changes_propagate_to_the_export_key():
    assert export_key("target.train.lr=1e-3") != export_key()
    keys_a = plan_keys(compose_cfg(), stage_modules())
    keys_b = plan_keys(compose_cfg("export.max_m=4"), stage_modules())
    assert keys_a["target"] == keys_b["target"] and keys_a["draft"] == keys_b["draft"]


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
    r = run_app(["tracking=none", "draft.kind=other"], tmp_path / "fakes", out)  # a new draft needs taps again
    assert r.returncode == 0 and "taps    ran" in r.stdout, r.stdout + r.stderr
