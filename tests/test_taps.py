"""The taps stage: batched greedy generation taps what the target itself computes, masks, shards, resume."""

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file

from models import tiny_target
from pipeline.artifacts import load_taps, taps_index
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


@torch.no_grad()
def test_a_prompt_prefilled_in_chunks_taps_what_one_call_taps():
    target = tiny_target(seed=0, n_layers=3, max_seq_len=64)
    prompts = torch.randint(2, 256, (2, 11))
    whole = taps.generate_tapped(target, prompts, 20, chunk=64)
    chunked = taps.generate_tapped(target, prompts, 20, chunk=4)  # 4 + 4 + 3 prompt tokens
    assert torch.equal(whole["ids"], chunked["ids"]) and torch.equal(whole["top1"], chunked["top1"])
    for name in ("taps", "final"):
        torch.testing.assert_close(whole[name], chunked[name], rtol=1e-4, atol=1e-5)


def test_prompt_lengths_go_by_batch_within_shards():
    # shards of 5 sequences, batches of 2 within a shard: (2, 2, 1) a shard, each batch the next length
    assert taps.prompt_lengths(12, (8, 12), per_shard=5, batch_size=2) == \
        [8, 8, 12, 12, 8] + [12, 12, 8, 8, 12] + [8, 8]
    assert taps.prompt_lengths(3, (7,), 5, 2) == [7, 7, 7]


def test_the_long_split_has_prompts_of_each_length_and_its_own_shards(tmp_path, target_artifact):
    """taps.long_*: sequences of long_seq_len tokens, batches taking the prompt lengths in turn; the mask of a
    row starts at its own prompt's last position; the long split enters the key and resumes shard by shard."""
    from pipeline.app import key_inputs

    target_art, data_cfg = target_artifact
    short = stage_cfg(data_cfg, prompt_len=[6, 10])
    cfg = stage_cfg(data_cfg, prompt_len=[6, 10], long_seq_len=48, long_prompt_len=[20, 30], long_sequences=5)
    assert key_inputs(cfg, taps) != key_inputs(short, taps)
    assert taps.split_lengths(cfg.taps) == {"train": (32, (6, 10)), "held_out": (40, (12,)), "long": (48, (20, 30))}
    assert taps.split_counts(cfg) == {"train": 10, "held_out": 4, "long": 5}
    art = build(tmp_path / "a", cfg, target_art)
    assert art.report["long_tokens"] == 5 * 48 and art.report["long_seq_len"] == 48
    index = taps_index(art.path)
    assert index["long_prompt_len"] == [20, 30] and index["train_prompt_len"] == [6, 10]
    assert index["shards"]["long"] == ["long-00000.safetensors", "long-00001.safetensors"]
    for split, T, lengths in (("train", 32, taps.prompt_lengths(10, (6, 10), 4, 3)),
                              ("long", 48, taps.prompt_lengths(5, (20, 30), 4, 3))):
        got = load_taps(art.path, split)
        assert got["ids"].shape == (len(lengths), T) and got["taps"].shape == (len(lengths), T, 3 * 64)
        for row, P in enumerate(lengths):
            assert torch.equal(got["ids"][row, P:], got["top1"][row, P - 1 : -1])  # greedy from the prompt on
            counted = got["mask"][row].nonzero()
            assert int(counted[0]) == P - 1, (split, row, P)
    assert sorted(set(taps.prompt_lengths(5, (20, 30), 4, 3))) == [20, 30]

    real_write, calls = taps.write_shard, []

    def crash_on_long(*args):
        calls.append(args[0].name)
        if args[0].name == "long-00001.safetensors":
            raise KeyboardInterrupt("interrupted")
        real_write(*args)

    taps.write_shard = crash_on_long
    try:
        with pytest.raises(KeyboardInterrupt):
            build(tmp_path / "b", cfg, target_art)
    finally:
        taps.write_shard = real_write
    resumed = build(tmp_path / "b", cfg, target_art)
    assert resumed.report["shards_resumed"] == len(calls) - 1
    for name in art.manifest["files"]:
        if name.endswith(".safetensors"):
            a, b = load_file(str(art.path / name)), load_file(str(resumed.path / name))
            assert all(torch.equal(a[k], b[k]) for k in a), name


@pytest.mark.parametrize("scheme", ["8da4w_offsets", "w4_g32"])
@torch.no_grad()
def test_taps_of_a_quantised_target_are_what_that_target_computes(tmp_path, target_artifact, scheme):
    """taps.target_quant: the stored answers, top-1s and taps are the quantised target's own (a stateless
    forward of the target quantised by the same scheme over the stored ids), and not the float target's."""
    from models import load_target
    from models.quantize import quantize_served

    target_art, data_cfg = target_artifact
    cfg = OmegaConf.merge(stage_cfg(data_cfg, target_quant=scheme), {"export": {"group_size": 32}})
    art = build(tmp_path, cfg, target_art)
    assert art.report["target_quant"] == scheme
    train = load_taps(art.path, "train")
    quantised = load_target(target_art.path, max_seq_len=64)
    quantize_served(quantised, scheme, 32)
    logits, tapped = quantised(train["ids"], taps=True)
    assert torch.equal(train["top1"], logits.argmax(-1))
    assert torch.equal(train["ids"][:, 8:], logits.argmax(-1)[:, 7:-1])  # on-policy: its own greedy answers
    # 8da rounds each row's input to int8: where the batched decode and the stateless forward differ in a last bit,
    # a value can land one int8 step away
    torch.testing.assert_close(train["taps"], torch.cat(tapped, -1), rtol=1e-3,
                               atol=1e-2 if scheme.startswith("8da") else 1e-4)
    float_logits, _ = load_target(target_art.path, max_seq_len=64)(train["ids"], taps=True)
    assert not torch.equal(float_logits.argmax(-1), train["top1"])  # the scheme changed what the target says


@pytest.mark.parametrize("scheme, group, dense", [("w4_g32", 32, {"lm_head"}), ("w4_g128", 128, set())])
@torch.no_grad()
def test_the_engines_schemes_give_each_linear_its_int4_kernels_weight(scheme, group, dense):
    """A w4 scheme puts on every linear but its dense ones the weight the INT4 kernels compute with, in bf16;
    a tied lm_head quantised leaves the embedding's table float, as the engine's Int4Linear does."""
    from models.quantize import dequantize_w4, quantize_served, quantize_w4

    target = tiny_target(seed=1, n_layers=2, max_seq_len=64, hidden_size=128, head_dim=32, intermediate_size=256,
                         tie_embeddings=True)  # tied, as SmolLM2's
    before = {n: m.weight.detach().clone() for n, m in target.named_modules() if isinstance(m, torch.nn.Linear)}
    table = target.embed_tokens.weight.detach().clone()
    quantize_served(target, scheme, 0)
    for name, w in before.items():
        got = dict(target.named_modules())[name].weight
        if name in dense:
            assert torch.equal(got, w), name
        else:
            expected = dequantize_w4(*quantize_w4(w, group), group).float()
            assert torch.equal(got, expected) and not torch.equal(got, w), name
    assert torch.equal(target.embed_tokens.weight, table)


def test_a_scheme_the_taps_cannot_serve_is_refused_naming_the_choices():
    from models.quantize import quantize_served

    with pytest.raises(ValueError, match=r"taps.target_quant='int4'.*none, 8da4w_offsets"):
        quantize_served(tiny_target(seed=0, n_layers=1, max_seq_len=16), "int4", 32)
