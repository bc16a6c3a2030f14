"""The taps stage: batched greedy generation taps what the target itself computes, masks, shards, resume."""

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file

from models import tiny_target
from pipeline.artifacts import load_taps
from pipeline.stages import taps
from pipeline.store import Store

CODE = "".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(300))


@torch.no_grad()
def test_batched_generation_equals_the_targets_own_greedy_and_taps():
    target = tiny_target(seed=0, n_layers=3, max_seq_len=64)
    prompts = torch.randint(2, 256, (3, 5))
    out = taps.generate_tapped(target, prompts, 24)
    logits, tapped = target(out["ids"], taps=True)  # stateless forward over the generated sequences
    assert torch.equal(out["ids"][:, :5], prompts)
    assert torch.equal(out["ids"][:, 5:], logits.argmax(-1)[:, 4:-1])  # greedy: each token = argmax before it
    assert torch.equal(out["top1"], logits.argmax(-1))
    torch.testing.assert_close(out["taps"], torch.cat(tapped, -1), rtol=1e-4, atol=1e-5)
    final, _ = target.hidden(out["ids"])
    torch.testing.assert_close(out["final"], final, rtol=1e-4, atol=1e-5)
    assert target.layers[0].self_attn.k_cache.shape[0] == 1  # the batch-1 cache of the exported methods is back


def test_generation_mask_counts_the_continuation_until_an_end_token():
    ids = torch.tensor([[5, 1, 5, 5, 5, 1, 5, 5], [5, 5, 5, 5, 5, 5, 5, 5], [5, 5, 5, 5, 2, 1, 5, 5]])
    mask = taps.generation_mask(ids, prompt_len=3, ends=[1, 2], mask_prompt=True)
    # position 2 predicts the first generated token; a generated end token (EOS 1 or end-of-turn 2) ends it,
    # the prompt's does not
    assert mask.tolist() == [[False, False, True, True, True, False, False, False],
                             [False, False, True, True, True, True, True, True],
                             [False, False, True, True, False, False, False, False]]
    assert taps.generation_mask(ids, 3, [], False).all()


@pytest.fixture(scope="module")
def target_artifact(tmp_path_factory, text_target):
    _, art, data_cfg = text_target(tmp_path_factory.mktemp("taps"), CODE, chunk=2000, overlap=3000, vocab_size=300)
    return art, OmegaConf.create(data_cfg)


def stage_cfg(data_cfg, **taps_overrides):
    tc = dict(source="generate", seq_len=32, prompt_len=8, mask_prompt=True, train_sequences=10,
              held_out_seq_len=40, held_out_prompt_len=12, held_out_sequences=4, shard_sequences=4,
              batch_size=3, dtype="float32")
    tc.update(taps_overrides)
    return OmegaConf.create({"device": "cpu", "seed": 0, "data": OmegaConf.to_container(data_cfg), "taps": tc})


def build(store_root: Path, cfg, target_art):
    store = Store(store_root)
    art, _ = store.get_or_build("taps", "k" * 64, lambda out: taps.run(cfg, {"target": target_art}, out),
                                config={}, upstream={"target": target_art.key}, schema_version=1)
    return art


@pytest.mark.parametrize("source", ["generate", "corpus"])
def test_stage_writes_shards_index_and_report(tmp_path, target_artifact, source):
    target_art, data_cfg = target_artifact
    art = build(tmp_path, stage_cfg(data_cfg, source=source), target_art)
    r = art.report
    assert r["source"] == source and r["target_key"] == target_art.key and r["tap_layers"] == [1, 2, 3]
    assert r["train_tokens"] == 10 * 32 and r["held_out_tokens"] == 4 * 40  # the held-out split has its own lengths
    assert r["bytes_written"] == sum(p.stat().st_size for p in art.path.iterdir() if p.name != "manifest.json")
    assert len(r["tokenizer_sha256"]) == 64
    train = load_taps(art.path, "train")
    assert train["ids"].shape == (10, 32) and train["taps"].shape == (10, 32, 3 * 64)
    assert train["final"].shape == (10, 32, 64) and train["top1"].dtype == torch.int64
    if source == "generate":  # on-policy: past the prompt every token is the target's argmax before it
        assert torch.equal(train["ids"][:, 8:], train["top1"][:, 7:-1])
        # counted: from the last prompt position on, up to the first generated <|eos|> (id 1), which the
        # random target emits for some corpus paths (the held-out split hashes the document paths)
        expected = torch.zeros(10, 32, dtype=torch.bool)
        expected[:, 7:] = True
        expected[:, 8:] &= (train["ids"][:, 8:] == 1).cumsum(1) == 0
        assert torch.equal(train["mask"], expected)
        assert r["train_counted_tokens"] == expected.sum().item()
        held = load_taps(art.path, "held_out")
        assert held["ids"].shape == (4, 40) and torch.equal(held["ids"][:, 12:], held["top1"][:, 11:-1])
    else:
        assert train["mask"].all()


def test_a_loaded_draft_gets_taps_without_a_train_split_under_another_key(tmp_path, target_artifact):
    from pipeline.app import key_inputs

    target_art, data_cfg = target_artifact
    trained = stage_cfg(data_cfg)
    loaded = OmegaConf.merge(trained, {"draft": {"kind": "load", "path": str(tmp_path)}})
    assert taps.split_counts(trained) == {"train": 10, "held_out": 4} and taps.key_extra(trained) is None
    assert taps.split_counts(loaded) == {"train": 0, "held_out": 4}
    assert key_inputs(loaded, taps) != key_inputs(trained, taps)
    art = build(tmp_path / "store", loaded, target_art)
    assert art.report["train_sequences"] == 0 and art.report["train_tokens"] == 0
    assert load_taps(art.path, "held_out")["ids"].shape == (4, 40)
    with pytest.raises(ValueError, match="no train shards"):
        load_taps(art.path, "train")


def test_stage_resumes_shard_by_shard(tmp_path, target_artifact, monkeypatch):
    target_art, data_cfg = target_artifact
    cfg = stage_cfg(data_cfg)
    reference = build(tmp_path / "ref", cfg, target_art)

    real_write, calls = taps.write_shard, []

    def crash_on_second(*args):
        calls.append(args[0].name)
        if len(calls) == 2:
            raise KeyboardInterrupt("interrupted")
        real_write(*args)

    monkeypatch.setattr(taps, "write_shard", crash_on_second)
    with pytest.raises(KeyboardInterrupt):
        build(tmp_path / "s", cfg, target_art)
    monkeypatch.setattr(taps, "write_shard", real_write)
    resumed = build(tmp_path / "s", cfg, target_art)
    assert resumed.report["shards_resumed"] == 1
    for name in reference.manifest["files"]:
        if name.endswith(".safetensors"):
            a, b = load_file(str(reference.path / name)), load_file(str(resumed.path / name))
            assert all(torch.equal(a[k], b[k]) for k in a), name


def test_the_size_estimate_is_the_shards_bytes(tmp_path, target_artifact):
    target_art, data_cfg = target_artifact
    cfg = stage_cfg(data_cfg)
    art = build(tmp_path, cfg, target_art)
    written = sum(p.stat().st_size for p in art.path.glob("*.safetensors"))
    estimate = taps.estimate_bytes(cfg, {"target": target_art})
    assert estimate <= written < estimate * 1.05, (estimate, written)  # + safetensors' headers
