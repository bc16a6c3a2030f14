"""Bad config values are refused when the config is composed, before any stage runs, naming key and value."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from pipeline.app import CONF_DIR
from pipeline.validate import ConfigError, check_config
from pipeline_fakes import run_app, write_fake_stages


def compose_cfg(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def test_the_default_and_smoke_configs_pass():
    check_config(compose_cfg())
    check_config(compose_cfg("+experiment=smoke", "runtime.chain=7", "runtime.temperature=0.5"))


@pytest.mark.parametrize("override, named", [
    ("runtime.chain=abc", "runtime.chain='abc': an int in [0, 7]"),
    ("runtime.chain=8", "runtime.chain=8: an int in [0, 7]"),
    ("runtime.chain=-1", "runtime.chain=-1"),
    ("runtime.chain=2.5", "runtime.chain=2.5"),
    ("runtime.max_new_tokens=0", "runtime.max_new_tokens=0: an int in [1, inf]"),
    ("runtime.temperature=-0.1", "runtime.temperature=-0.1: a number in [0.0, inf]"),
    ("runtime.temperature=hot", "runtime.temperature='hot'"),
    ("runtime.n_prompts=0", "runtime.n_prompts=0"),
    ("runtime.policy=greedy", "runtime.policy='greedy': one of static, adaptive"),
    ("engine.kind=gpu", "engine.kind='gpu': one of pte, eager, cuda"),
    ("engine=cuda engine.quant=int8", "engine.quant='int8': one of bf16, w4_g32, w4_g128"),
    ("engine=cuda engine.compile=max", "engine.compile='max': one of none, inductor"),
    ("engine=cuda engine.compile=inductor engine.quant=w4_g32",
     "engine.compile='inductor': none with engine.quant=w4_g32"),
    ("engine=cuda engine.compile=inductor engine.quant=w4_g128",
     "engine.compile='inductor': none with engine.quant=w4_g128"),
    ("engine=cuda engine.device=cpu", "engine.device='cpu': a CUDA device: cuda or cuda:N"),
    ("engine=cuda engine.max_m=17", "engine.max_m=17: an int in [2, 16]"),
    ("engine=cuda engine.max_m=4 engine.default_chain=4", "engine.default_chain=4: an int in [1, 3]"),
    ("engine=cuda engine.min_prefill_chunk=4", "engine.min_prefill_chunk=4: null or above engine.max_m=8"),
    ("engine=cuda engine.max_prefill_chunk=3000", "engine.max_prefill_chunk=3000: an int in [9, 2048]"),
    ("engine=cuda engine.max_m=4 runtime.chain=4", "runtime.chain=4: an int in [0, 3]"),
    ("engine=eager engine.device=tpu", "engine.device='tpu': a torch device: cpu, cuda or cuda:N"),
    ("engine.exact=maybe", "engine.exact='maybe': one of True, False, auto"),
    ("engine.exact_width=1", "engine.exact_width=1: an int in [2, 8]"),
    ("engine.exact=true engine.exact_width=3 runtime.chain=4", "runtime.chain=4: at most engine.exact_width - 1 = 2"),
    ("runtime.prompts=/no/such/prompts.txt", "runtime.prompts='/no/such/prompts.txt': an existing file"),
    ("export.max_m=1", "export.max_m=1: an int in [2, inf]"),
    ("export.max_m=17 export.max_prefill_chunk=32", "export.max_m=17: the small-M kernels take at most 16 rows"),
    ("export.default_chain=8", "export.default_chain=8: the default K must lie in [1, max_m-1] = [1, 7]"),
    ("export.backend=cuda", "export.backend='cuda': one of portable, xnnpack"),
    ("export.quant=int8", "export.quant='int8': one of fp32, 8da4w_draft, 8da4w_offsets"),
    ("export.min_prefill_chunk=4", "straddles the dispatch threshold max_m=8"),
    ("target=hf", "target.path='???'"),
    ("target=hf target.path=/no/such/dir", "target.path='/no/such/dir': an existing directory"),
    ("draft=load draft.path=/no/such/draft", "draft.path='/no/such/draft': an existing directory"),
    ("draft=load draft.path=. draft.aux_layer_convention=hf",
     "draft.aux_layer_convention='hf': one of auto, embedding_first, layer_output"),
    ("taps.source=web", "taps.source='web': one of generate, corpus"),
    ("taps.target_quant=int4", "taps.target_quant='int4': one of auto, none, 8da4w_offsets, 8da_file, w4_g32"),
    ("taps.target_quant=w4_file", "taps.target_quant='w4_file': a scheme that does not follow a GGUF file"),
    ("device=tpu", "device='tpu': one of cpu, cuda"),
    ("threads=0", "threads=0"),
    ("+experiment=smoke runtime.prompt_len=1000",
     "runtime.prompt_len=1000 + runtime.max_new_tokens=48 = 1048 exceeds export.max_seq_len=128"),
    ("engine.exact=true engine.exact_width=8 runtime.max_new_tokens=1978",
     "runtime.prompt_len=64 + runtime.max_new_tokens=1978 = 2042 exceeds export.max_seq_len=2048 less exact mode's 7"),
    ("runtime.max_new_tokens=2000", "runtime.prompt_len=64 + runtime.max_new_tokens=2000 = 2064 exceeds "
                                    "export.max_seq_len=2048"),
    ("export.max_seq_len=1", "export.max_seq_len=1"),
    ("runtime.prompts_too_long=truncate", "runtime.prompts_too_long='truncate': one of error, skip"),
])
def test_each_bad_value_is_refused_naming_the_key_and_the_value(override, named):
    cfg = compose_cfg(*override.split())
    with pytest.raises(ConfigError) as e:
        check_config(cfg)
    assert named in str(e.value)


@pytest.mark.parametrize("override, new", [
    ("export.quant=none", "fp32"), ("export.quant=int4_draft", "8da4w_draft"), ("export.quant=int4", "8da4w_offsets"),
    ("engine=cuda engine.quant=none", "bf16"), ("engine=cuda engine.quant=int4", "w4_g32"),
    ("engine=cuda engine.quant=int4_g128", "w4_g128"),
])
def test_an_old_scheme_name_is_refused_naming_the_new_one(override, new):
    """A retired scheme name (models.choices.RENAMED) is never read as whatever it might mean now: `none` means
    only off, and `int4` named four schemes."""
    key, old = override.split()[-1].split("=")
    with pytest.raises(ConfigError) as e:
        check_config(compose_cfg(*override.split()))
    assert f"{key}={old!r}: renamed {new} (one of " in str(e.value)


def test_the_cuda_engine_without_a_cuda_device_is_refused_before_any_stage():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    with pytest.raises(ConfigError, match="engine='cuda': pte or eager on a machine where torch sees no CUDA"):
        check_config(compose_cfg("engine=cuda"))


def test_an_engine_choice_that_does_not_exist_is_refused_naming_the_choices():
    from hydra.errors import MissingConfigException

    with pytest.raises(MissingConfigException, match=r"(?s)Could not find 'engine/gpu'.*cuda.*eager.*pte"):
        compose_cfg("engine=gpu")


def test_an_option_of_another_engine_is_refused():
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException, match="Could not override 'engine.quant'"):
        compose_cfg("engine.quant=w4_g32")  # engine=pte has no weights of its own: export.quant is the .pte's


def test_every_problem_is_listed_at_once():
    with pytest.raises(ConfigError) as e:
        check_config(compose_cfg("runtime.chain=99", "runtime.max_new_tokens=0", "runtime.temperature=-1"))
    assert all(k in str(e.value) for k in ("runtime.chain", "runtime.max_new_tokens", "runtime.temperature"))


@pytest.mark.parametrize("content, why", [
    (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\xff\xfe", "not UTF-8 text"),
    (b'{"prompt": "ok"}\nnot json\n', "line 2 is not JSON"),
])
def test_an_unreadable_prompt_file_is_refused_naming_the_file(tmp_path, content, why):
    path = tmp_path / ("p.jsonl" if b"{" in content else "p.txt")
    path.write_bytes(content)
    with pytest.raises(ConfigError) as e:
        check_config(compose_cfg(f"runtime.prompts={path}"))
    assert str(path) in str(e.value) and why in str(e.value)


def test_a_bad_value_stops_the_job_before_the_first_stage(tmp_path):
    write_fake_stages(tmp_path / "fakes")
    t0 = time.perf_counter()
    r = run_app(["tracking=none", "runtime.chain=abc"], tmp_path / "fakes", tmp_path / "out")
    assert r.returncode != 0
    assert "runtime.chain='abc'" in r.stdout + r.stderr
    assert not (tmp_path / "out" / "store").exists(), "no stage ran"
    assert time.perf_counter() - t0 < 120


def hf_checkpoint(root: Path, max_position_embeddings: int, words: int = 300) -> Path:
    """A directory with what the length checks read of a Hugging Face checkpoint: config.json and a
    whitespace tokenizer.json (w0 ... w{words-1})."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers

    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps({"model_type": "llama", "max_position_embeddings": max_position_embeddings}))
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(words)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(root / "tokenizer.json"))
    return root


def test_the_exported_cache_fits_the_context_the_checkpoint_was_trained_for(tmp_path):
    ckpt = hf_checkpoint(tmp_path / "ckpt", 100)
    with pytest.raises(ConfigError) as e:
        check_config(compose_cfg("target=hf", f"target.path={ckpt}"))
    assert "export.max_seq_len=2048: at most 100, the max_position_embeddings the target was trained for" in str(e.value)
    with pytest.raises(ConfigError) as e:
        check_config(compose_cfg("target=hf", f"target.path={ckpt}", "export.max_seq_len=100", "export.max_prefill_chunk=64",
                                 "runtime.prompt_len=64", "runtime.max_new_tokens=48"))
    assert "runtime.prompt_len=64 + runtime.max_new_tokens=48 = 112 exceeds export.max_seq_len=100" in str(e.value)
    check_config(compose_cfg("target=hf", f"target.path={ckpt}", "export.max_seq_len=100", "export.max_prefill_chunk=64", "runtime.prompt_len=52",
                             "runtime.max_new_tokens=48"))


def test_prompt_file_lines_are_counted_with_the_checkpoint_tokenizer_naming_file_and_lines(tmp_path, caplog):
    ckpt = hf_checkpoint(tmp_path / "ckpt", 100)
    prompts = tmp_path / "prompts.txt"  # 100 - 48 = 52 tokens of room; line 2 is short in tokens, long in bytes
    prompts.write_text("w1 w2\n" + " ".join(["w299"] * 40) + "\n" + " ".join(["w7"] * 60) + "\n")
    args = ("target=hf", f"target.path={ckpt}", "export.max_seq_len=100", "export.max_prefill_chunk=64", "runtime.max_new_tokens=48",
            f"runtime.prompts={prompts}")
    with pytest.raises(ConfigError) as e:
        check_config(compose_cfg(*args))
    assert f"prompt file {prompts}: line(s) 3 hold more than 52 tokens" in str(e.value)
    with caplog.at_level("WARNING", logger="pipeline.validate"):
        check_config(compose_cfg(*args, "runtime.prompts_too_long=skip"))
    assert any(f"prompt file {prompts}: line(s) 3" in r.getMessage() and "left out" in r.getMessage()
               for r in caplog.records)


def test_a_long_prompt_file_line_is_refused_with_the_stored_target_s_tokenizer(tmp_path):
    """The tiny target's tokenizer is the target stage's output: once it is stored, the job's plan counts the
    lines with it before building or evaluating anything."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers

    from pipeline.validate import check_prompts_with_target

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("w1 w2\n" + " ".join(["w3"] * 100) + "\n")
    cfg = compose_cfg("+experiment=smoke", f"runtime.prompts={prompts}")  # 128 - 48 = 80 tokens of room
    check_config(cfg)  # the bytes cannot tell: left to the target's tokenizer
    target = tmp_path / "target"
    target.mkdir()
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(10)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(target / "tokenizer.json"))
    (target / "config.json").write_text(json.dumps({"max_seq_len": 64}))  # the export's length counts, not this
    with pytest.raises(ConfigError, match=rf"prompt file {prompts}: line\(s\) 2 hold more than 80 tokens.*"
                                          rf"export.max_seq_len=128"):
        check_prompts_with_target(cfg, target)
