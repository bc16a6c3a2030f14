"""The draft stage: train on taps into a speculators checkpoint with a report, or load one and refuse misfits."""

import pytest
import torch
from omegaconf import OmegaConf

from models import load_speculators, save_speculators, tiny_draft, tiny_target
from pipeline import tracking
from pipeline.stages import draft as draft_stage
from pipeline.stages import taps
from pipeline.store import Store
from models.draft import predicted_tau

CODE = "".join(f"class C{i}:\n    def get(self, x):\n        return self.v{i % 5} + x\n\n" for i in range(200))
V = 300


def build(store, stage, fn, upstream):
    art, _ = store.get_or_build(stage, stage[0] * 64, fn, config={}, upstream={k: a.key for k, a in upstream.items()},
                                schema_version=1)
    return art


@pytest.fixture(scope="module")
def env(tmp_path_factory, text_target):
    root = tmp_path_factory.mktemp("draft_stage")
    target, target_art, data_cfg = text_target(root, CODE, chunk=1500, overlap=2500, vocab_size=V)
    cfg = OmegaConf.create({
        "device": "cpu", "seed": 0, "data": data_cfg,
        "taps": dict(source="generate", seq_len=32, prompt_len=8, mask_prompt=True, train_sequences=12,
                     held_out_sequences=4, shard_sequences=6, batch_size=6, dtype="bfloat16"),
        "draft": dict(kind="train", draft_vocab_size=32000, intermediate_size=None, init_from_target=True,
                      train=dict(steps=6, batch_size=4, lr=3e-3, min_lr=3e-4, warmup=2, betas=[0.9, 0.95],
                                 weight_decay=0.0, grad_clip=0.5, ttt_steps=7, decay=0.8, autocast=None,
                                 eval_every=None, log_every=1, checkpoint_every_s=60)),
    })
    store = Store(root / "store")
    taps_art = build(store, "taps", lambda out: taps.run(cfg, {"target": target_art}, out), {"target": target_art})
    return cfg, store, target, {"target": target_art, "taps": taps_art}


def run_draft(cfg, store, upstream, **draft_overrides):
    cfg = OmegaConf.merge(cfg, {"draft": draft_overrides})
    key = draft_stage.__name__ + repr(sorted(draft_overrides.items()))
    art, _ = store.get_or_build("draft", str(abs(hash(key))), lambda out: draft_stage.run(cfg, upstream, out),
                                config={}, upstream={}, schema_version=1)
    return art


@pytest.fixture(scope="module")
def trained(env, request):
    cfg, store, target, upstream = env
    logged = []
    mp = pytest.MonkeyPatch()
    mp.setattr(tracking, "log_metrics", lambda metrics, step=None: logged.append((step, dict(metrics))))
    try:
        art = run_draft(cfg, store, upstream)
    finally:
        mp.undo()
    return art, logged


def test_train_writes_a_speculators_draft_that_fits_the_target(env, trained):
    cfg, store, target, upstream = env
    art, _ = trained
    draft = load_speculators(art.path, target)  # validates hidden size, vocab, taps, d2t
    assert draft.cfg.draft_vocab_size == V and not draft.d2t.any()  # V <= draft_vocab_size: whole vocab
    assert torch.equal(draft.embed_tokens.weight, target.embed_tokens.weight)
    r = art.report
    assert r["target_key"] == upstream["target"].key and r["taps_key"] == upstream["taps"].key
    accs = [r[f"held_out_acc_{i}"] for i in range(7)]
    assert all(0 <= a <= 1 for a in accs)
    alpha = [r[f"predicted_acceptance_pos_{i}"] for i in range(7)]
    assert all(0 <= a <= 1 for a in alpha)
    assert r["predicted_tau"] == pytest.approx(predicted_tau(alpha), abs=1e-3)
    assert 1 <= r["predicted_tau"] <= 8 and r["steps"] == 6 and r["vocab_coverage"] == 1.0


def test_train_on_long_taps_reports_predicted_tau_by_answer_position(env, tmp_path):
    """taps.long_* + draft.train.long_every: the draft also trains on the long split, and its report carries
    predicted tau by the answer position a chain starts at, for the buckets the held-out answers reach."""
    cfg, _, _, upstream = env
    cfg = OmegaConf.merge(cfg, {"taps": {"held_out_seq_len": 96, "held_out_prompt_len": 8, "long_seq_len": 96,
                                         "long_prompt_len": [40, 60], "long_sequences": 12}})
    store = Store(tmp_path)
    long_taps = build(store, "taps", lambda out: taps.run(cfg, {"target": upstream["target"]}, out),
                      {"target": upstream["target"]})
    upstream = {"target": upstream["target"], "taps": long_taps}
    r = run_draft(cfg, store, upstream, train={"long_every": 2, "long_batch_size": 2}).report
    assert r["long_sequences"] == 12
    names = [k for k in r if k.startswith("predicted_tau_pos_")]
    assert names == ["predicted_tau_pos_0_64", "predicted_tau_pos_64_256"]  # answers of 88 tokens
    assert all(1 <= r[k] <= 8 for k in names) and r["held_out_slots_pos_64_256"] > 0
    with pytest.raises(ValueError, match="needs long taps"):
        run_draft(OmegaConf.merge(cfg, {"taps": {"long_sequences": 0}}), store,
                  {"target": upstream["target"], "taps": env[3]["taps"]}, train={"long_every": 2, "steps": 1})


def test_train_logs_step_metrics_and_held_out_acceptance(trained):
    _, logged = trained
    steps = [m for _, m in logged if "loss" in m]
    assert len(steps) == 6
    assert set(steps[0]) >= {"loss", "lr", *(f"loss_{i}" for i in range(7)), *(f"acc_{i}" for i in range(7))}
    held = [(s, m) for s, m in logged if "held_out_acc_0" in m]
    assert held and held[-1][0] == 6 and "held_out_predicted_tau" in held[-1][1] and "epoch" in held[-1][1]


def test_a_reduced_draft_vocab_gets_a_real_d2t(env):
    cfg, store, target, upstream = env
    art = run_draft(cfg, store, upstream, draft_vocab_size=40)
    draft = load_speculators(art.path, target)
    used = torch.arange(40) + draft.d2t
    assert draft.d2t.any() and bool((used[1:] > used[:-1]).all()) and int(draft.t2d.sum()) == 40
    assert 0 < art.report["vocab_coverage"] <= 1


def test_norm_before_residual_reaches_the_checkpoint_and_its_residual(env, trained):
    """draft.norm_before_residual=true: the saved config says so, and the layer's residual is the normed
    feature, so a feature scaled by 1000 gives the output of the unscaled one (it does not without)."""
    cfg, store, target, upstream = env
    art = run_draft(cfg, store, upstream, norm_before_residual=True)
    normed, plain = load_speculators(art.path, target), load_speculators(trained[0].path, target)
    assert normed.cfg.norm_before_residual and not plain.cfg.norm_before_residual
    ids = torch.randint(0, V, (1, 6))
    f = torch.randn(1, 6, target.cfg.hidden_size)
    with torch.no_grad():
        assert torch.allclose(normed(ids, f)[0], normed(ids, 1000 * f)[0], atol=1e-3, rtol=1e-3)
        assert not torch.allclose(plain(ids, f)[0], plain(ids, 1000 * f)[0], atol=1e-3, rtol=1e-3)


def test_load_validates_and_stores_a_checkpoint(env, trained):
    cfg, store, target, upstream = env
    art, _ = trained
    loaded = run_draft(cfg, store, upstream, kind="load", path=str(art.path))
    assert loaded.report["kind"] == "load" and loaded.report["target_key"] == upstream["target"].key
    assert loaded.report["layout"] == "speculators" and loaded.report["aux_layer_convention"] == "embedding_first"
    assert loaded.report["aux_layers_file"] == list(target.cfg.taps)
    assert 0 <= loaded.report["aux_agreement"] <= 1  # the held-out check of its aux layers ran
    # trained with autocast=None and evaluated the same way: same held-out numbers
    for i in range(7):
        assert loaded.report[f"held_out_acc_{i}"] == art.report[f"held_out_acc_{i}"]


def misfit(kind, target):
    if kind == "hidden size":
        return tiny_draft(tiny_target(seed=0, n_layers=3, vocab_size=V, hidden_size=32, head_dim=8))
    if kind == "vocab":
        return tiny_draft(tiny_target(seed=0, n_layers=3, vocab_size=V + 4))
    if kind == "tap layers":
        return tiny_draft(target, tap_layers=(0, 1, 2))
    draft = tiny_draft(target, draft_vocab_size=200)
    if kind == "d2t out of range":
        draft.d2t[-1] = 150  # draft id 199 -> target id 349 >= V
    elif kind == "embed_tokens differ":
        draft.embed_tokens.weight.data += 1.0
    return draft


@pytest.mark.parametrize("kind", ["hidden size", "vocab", "tap layers", "d2t out of range", "embed_tokens differ"])
def test_load_refuses_a_draft_that_does_not_fit_naming_the_field(env, tmp_path, kind):
    _, _, target, _ = env
    save_speculators(misfit(kind, target), tmp_path / "ckpt")
    dc = OmegaConf.create({"kind": "load", "path": str(tmp_path / "ckpt")})
    with pytest.raises(ValueError, match=f"does not fit the target: .*{kind}"):
        draft_stage.load(dc, target)


def test_load_refuses_a_missing_directory(env, tmp_path):
    with pytest.raises(FileNotFoundError, match="draft.path=.* is not a directory"):
        draft_stage.load(OmegaConf.create({"kind": "load", "path": str(tmp_path / "nope")}), env[2])
