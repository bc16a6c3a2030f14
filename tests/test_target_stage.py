"""The target stage: the smoke target trains quickly, resumes exactly, and target=hf converts (with its chat
template) or refuses. target=gguf: tests/test_gguf.py."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from safetensors.torch import save_file
from tokenizers import Tokenizer

from models import load_target, tiny_target
from models.hf import hf_weight_names
from pipeline import tracking
from pipeline.app import CONF_DIR, Job


def compose_cfg(tmp_path: Path, *overrides: str):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=["+experiment=smoke", "+stage=target", "tracking=none",
                                                        f"paths.outputs={tmp_path / 'out'}", *overrides])


def run_target(tmp_path: Path, *overrides: str):
    job = Job(compose_cfg(tmp_path, *overrides), tmp_path / "job")
    return job.run()["target"]


def test_smoke_target_trains_in_under_a_minute(tmp_path):
    t0 = time.perf_counter()
    art = run_target(tmp_path)
    elapsed = time.perf_counter() - t0
    assert elapsed < 60, f"smoke target stage took {elapsed:.0f} s"
    assert {"tokenizer.json", "config.json", "model.safetensors"} <= set(art.manifest["files"])
    report = art.report
    assert math.isfinite(report["held_out_loss"]) and report["held_out_loss"] < math.log(512), report
    model = load_target(art.path)
    assert model.cfg.n_layers == 4 and model.cfg.max_seq_len == 64  # the training windows; the export sets its own
    tok = Tokenizer.from_file(str(art.path / "tokenizer.json"))
    text = "def add(a, b):\n    return a + b\n"
    assert tok.decode(tok.encode(text).ids) == text, "byte-level BPE round-trips"
    assert tok.token_to_id("<|bos|>") == 0 and tok.token_to_id("<|eos|>") == 1
    with torch.no_grad():
        logits = model(torch.tensor([tok.encode(text).ids]))
    assert logits.shape[-1] == 512 and torch.isfinite(logits).all()


def test_interrupted_training_resumes_to_the_same_model(tmp_path, monkeypatch):
    overrides = ("target.train.steps=12", "target.train.log_every=4", "target.train.eval_every=6",
                 "target.train.checkpoint_every_s=0", "data.max_bytes=200000")
    straight = run_target(tmp_path / "a", *overrides)

    real_log = tracking.log_metrics

    def crash_at_8(metrics, step=None):
        if step == 8:
            raise KeyboardInterrupt("simulated crash")
        real_log(metrics, step)

    monkeypatch.setattr(tracking, "log_metrics", crash_at_8)
    with pytest.raises(KeyboardInterrupt):
        run_target(tmp_path / "b", *overrides)
    scratch = list((tmp_path / "b" / "out" / "store" / ".scratch" / "target").iterdir())
    assert len(scratch) == 1 and (scratch[0] / "train_state.pt").is_file()
    monkeypatch.setattr(tracking, "log_metrics", real_log)
    resumed = run_target(tmp_path / "b", *overrides)
    assert resumed.report["resumed_at"] == 7  # the checkpoint written after step 7; step 8 crashed
    assert resumed.key == straight.key
    assert resumed.report["held_out_loss"] == pytest.approx(straight.report["held_out_loss"], abs=1e-5)
    assert not scratch[0].exists(), "scratch removed after success"


def test_the_last_steps_train_on_long_windows_at_the_same_tokens_per_step(tmp_path):
    from omegaconf import OmegaConf

    from pipeline.stages.target import window_shape

    t = OmegaConf.create({"steps": 10, "batch_size": 8, "seq_len": 64, "long_steps": 3, "long_seq_len": 256})
    assert [window_shape(s, t) for s in (0, 6, 7, 9)] == [(8, 64), (8, 64), (2, 256), (2, 256)]
    assert window_shape(9, OmegaConf.create({"steps": 10, "batch_size": 8, "seq_len": 64})) == (8, 64)
    art = run_target(tmp_path, "target.train.steps=6", "target.train.long_steps=2", "target.train.long_seq_len=128",
                     "target.model.max_seq_len=128", "data.max_bytes=200000")
    assert load_target(art.path).cfg.max_seq_len == 128  # RoPE and cache to the longest window trained
    assert art.report["long_seq_len"] == 128 and math.isfinite(art.report["held_out_loss_long"])


def write_hf_checkpoint(path: Path, tokenizer_from: Path) -> None:
    """A 2-layer llama checkpoint in Hugging Face layout, written by hand from a random tiny target."""
    model = tiny_target(seed=3, n_layers=2, vocab_size=512, max_seq_len=64)
    c = model.cfg
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
        "num_hidden_layers": c.n_layers, "num_attention_heads": c.n_heads, "num_key_value_heads": c.n_kv_heads,
        "head_dim": c.head_dim, "intermediate_size": c.intermediate_size, "rope_theta": c.rope_theta,
        "rms_norm_eps": c.rms_norm_eps, "tie_word_embeddings": c.tie_embeddings, "max_position_embeddings": 64}))
    ours = model.state_dict()
    save_file({hf: ours[k].contiguous() for hf, k in hf_weight_names(c).items()}, str(path / "model.safetensors"))
    (path / "tokenizer.json").write_bytes(tokenizer_from.read_bytes())
    return model


def test_hf_target_is_converted_to_our_format(tmp_path):
    from pipeline import data

    tok = data.train_tokenizer(["def f(x):\n    return x * 2\n" * 50], vocab_size=300)
    tok.save(str(tmp_path / "tok.json"))
    source = write_hf_checkpoint(tmp_path / "hf", tmp_path / "tok.json")
    art = run_target(tmp_path, "target=hf", f"target.path={tmp_path / 'hf'}")
    assert art.report["n_layers"] == 2 and art.report["source"] == str((tmp_path / "hf").absolute())
    model = load_target(art.path)
    tokens = torch.randint(0, 512, (1, 16))
    with torch.no_grad():
        assert torch.equal(model(tokens), source.eval()(tokens))
    assert (art.path / "tokenizer.json").read_bytes() == (tmp_path / "tok.json").read_bytes()
    assert not (art.path / "chat_template.jinja").exists() and art.report["chat_template"] is False


def test_hf_target_keeps_the_chat_template(tmp_path):
    """tokenizer_config.json's chat_template becomes the artifact's chat_template.jinja (models.text)."""
    from models.text import load_chat_template
    from pipeline import data

    tok = data.train_tokenizer(["def f(x):\n    return x * 2\n" * 50], vocab_size=300)
    tok.save(str(tmp_path / "tok.json"))
    write_hf_checkpoint(tmp_path / "hf", tmp_path / "tok.json")
    template = "{% for m in messages %}<|user|>{{ m['content'] }}{% endfor %}<|assistant|>"
    (tmp_path / "hf" / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    art = run_target(tmp_path, "target=hf", f"target.path={tmp_path / 'hf'}")
    assert load_chat_template(art.path) == template and art.report["chat_template"] is True
    assert "chat_template.jinja" in art.manifest["files"]


@pytest.mark.parametrize("case", ["missing", "empty", "malformed"])
def test_bad_hf_target_is_a_clear_error(tmp_path, case):
    path = tmp_path / "ckpt"
    if case != "missing":
        path.mkdir()
    if case == "malformed":
        (path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises((FileNotFoundError, ValueError), match=r"target=hf|target\.path"):
        run_target(tmp_path, "target=hf", f"target.path={path}")


def test_corpus_split_depends_only_on_the_document_id(tmp_path, monkeypatch):
    from pipeline import data

    # relative paths, so the document ids (and so the split) are the same on every run
    monkeypatch.chdir(tmp_path)
    (tmp_path / "corpus").mkdir()
    for i in range(40):
        (tmp_path / "corpus" / f"f{i:02d}.txt").write_text(f"text {i}\n" * 3)
    cfg = {"kind": "text", "paths": ["corpus/*.txt"], "held_out_fraction": 0.2}
    full = data.documents(cfg)
    capped = data.documents({**cfg, "max_bytes": 400})
    held = {d.id for d in full if d.held_out}
    assert 0 < len(held) < 40
    capped_held = {d.id for d in capped if d.held_out}
    assert capped_held and capped_held <= held, "capping never moves a file across the split"
    assert [d.id for d in full] == sorted(d.id for d in full)


def test_text_corpus_split_does_not_move_with_the_corpus(tmp_path):
    """Ids are paths relative to the pattern's directory: the same files in two places (absolute patterns,
    one nested deeper) get the same ids and the same split; two patterns naming one id are refused."""
    from pipeline import data

    for where in ("a", "b/c"):
        (tmp_path / where / "sub").mkdir(parents=True)
        for i in range(30):
            (tmp_path / where / ("sub" if i % 3 == 0 else "") / f"f{i:02d}.txt").write_text(f"text {i}\n")
    splits = [[(d.id, d.held_out) for d in data.documents(
        {"kind": "text", "paths": [str(tmp_path / where / "**" / "*.txt")], "held_out_fraction": 0.3})]
        for where in ("a", "b/c")]
    assert splits[0] == splits[1] and len(splits[0]) == 30
    assert "sub/f00.txt" in dict(splits[0]), "ids keep the path below the pattern's directory"
    assert 0 < sum(h for _, h in splits[0]) < 30
    with pytest.raises(ValueError, match=r"both have the id 'f\d\d\.txt'"):
        data.documents({"kind": "text", "paths": [str(tmp_path / "a" / "*.txt"), str(tmp_path / "b/c" / "*.txt")]})


def test_text_corpus_reads_jsonl_and_cuts_a_single_file(tmp_path):
    from pipeline import data

    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps({"body": f"doc {i}"}) for i in range(30)))
    docs = data.documents({"kind": "text", "paths": [str(tmp_path / "a.jsonl")], "text_field": "body",
                           "held_out_fraction": 0.3})
    assert len(docs) == 30 and docs[0].text == "doc 0" and any(d.held_out for d in docs)
    (tmp_path / "one.txt").write_text("".join(f"line {i}\n" for i in range(100)))
    one = data.documents({"kind": "text", "paths": [str(tmp_path / "one.txt")], "held_out_fraction": 0.1})
    assert [d.held_out for d in one] == [False, True]
    assert one[0].text + one[1].text == (tmp_path / "one.txt").read_text()
    assert one[1].text.startswith("line 90")
    with pytest.raises(FileNotFoundError, match="matches no file"):
        data.documents({"kind": "text", "paths": [str(tmp_path / "nope*.txt")]})
