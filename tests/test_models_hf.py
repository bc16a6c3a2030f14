"""Local Hugging Face checkpoints: equality with transformers (logits, greedy decoding), and refusals.

transformers is a test dependency only. Checkpoints are tiny random models saved in the test; weights are
re-drawn with a larger spread than HF's init (std 0.02) so logits are well separated and greedy
comparisons are not decided by float noise on near ties.
"""

import json
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")

from models import load_hf_target  # noqa: E402

COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, bos_token_id=None, eos_token_id=None,
              pad_token_id=None, torch_dtype="float32", attn_implementation="eager")
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}

# name -> (config class, model class, extra config)
CASES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(rope_theta=500000.0, rope_scaling=LLAMA3_ROPE)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=8, head_dim=16)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True, use_sliding_window=True,
                                                       sliding_window=8, max_window_layers=1)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=16, attention_bias=True)),
    "llama_geglu": ("LlamaConfig", "LlamaForCausalLM", dict(hidden_act="gelu_pytorch_tanh")),
}


def make_hf(name, tmp_path_factory, **extra):
    cfg_cls, model_cls, case_extra = CASES[name]
    config = getattr(transformers, cfg_cls)(**{**COMMON, **case_extra, **extra})
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0, 0.15 if p.dim() == 2 else 0.1)
    path = tmp_path_factory.mktemp(name)
    model.save_pretrained(path)
    return model, path


@pytest.fixture(scope="module", params=sorted(CASES))
def hf_pair(request, tmp_path_factory):
    hf, path = make_hf(request.param, tmp_path_factory)
    ours, tokenizer = load_hf_target(path, max_seq_len=64, tap_layers=(0, 1, 2))
    return request.param, hf, ours, path, tokenizer


@torch.no_grad()
def test_logits_match_transformers(hf_pair):
    name, hf, ours, _, tokenizer = hf_pair
    assert tokenizer is None
    if name == "qwen2":
        assert ours.cfg.tie_embeddings and ours.cfg.sliding_window == [None, 8]
    if name == "mistral":
        assert ours.cfg.sliding_window == [8, 8]
    assert ours.cfg.hidden_act == ("gelu_pytorch_tanh" if name == "llama_geglu" else "silu")
    tokens = torch.randint(0, 256, (2, 24))
    ref = hf(tokens).logits
    got = ours(tokens)
    rel = (got - ref).norm() / ref.norm()
    assert rel < 1e-4, f"{name}: relative error {rel:.2e}"
    # taps follow HF's hidden_states index convention (the last HF entry is post-norm, so compare 0..L-1)
    out = hf(tokens, output_hidden_states=True)
    _, taps = ours(tokens, taps=True)
    for tap, idx in zip(taps[:2], (0, 1)):
        torch.testing.assert_close(tap, out.hidden_states[idx], rtol=1e-4, atol=1e-4)


@torch.no_grad()
def test_cached_greedy_matches_transformers_generate(hf_pair):
    name, hf, ours, _, _ = hf_pair
    torch.manual_seed(1)
    prompt = torch.randint(0, 256, (1, 8))
    ref = hf.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=32,
                      pad_token_id=0)[0, 8:]
    ours.reset_cache()
    logits = ours(prompt, torch.arange(8), last_only=True)
    tok = logits[:, -1].argmax(-1, keepdim=True)
    got = [int(tok)]
    for pos in range(8, 8 + 31):
        tok = ours(tok, torch.tensor([pos]))[:, -1].argmax(-1, keepdim=True)
        got.append(int(tok))
    assert got == ref.tolist(), f"{name}: greedy diverged"


@torch.no_grad()
def test_sharded_checkpoint_and_tokenizer_path(tmp_path_factory):
    hf, path = make_hf("llama", tmp_path_factory)
    sharded = tmp_path_factory.mktemp("sharded")
    hf.save_pretrained(sharded, max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").exists()
    (sharded / "tokenizer.json").write_text("{}")
    ours, tokenizer = load_hf_target(sharded)
    assert tokenizer == sharded / "tokenizer.json"
    assert ours.cfg.max_seq_len == 128
    tokens = torch.randint(0, 256, (1, 16))
    torch.testing.assert_close(ours(tokens), hf(tokens).logits, rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return make_hf("llama", tmp_path_factory)[1]


def edited_copy(src, dst, config_edit=None, tensor_edit=None):
    shutil.copytree(src, dst)
    if config_edit:
        d = json.loads((dst / "config.json").read_text())
        config_edit(d)
        (dst / "config.json").write_text(json.dumps(d))
    if tensor_edit:
        from safetensors.torch import load_file, save_file

        state = load_file(str(dst / "model.safetensors"))
        tensor_edit(state)
        save_file(state, str(dst / "model.safetensors"))
    return dst


CONFIG_REFUSALS = {
    "model_type": (lambda d: d.update(model_type="gpt2"), r"config\.json: model_type='gpt2': unsupported"),
    "rope_scaling": (lambda d: d.update(rope_scaling={"rope_type": "yarn", "factor": 4.0}),
                     r"config\.json: rope_scaling=.*'yarn' is not implemented"),
    "hidden_act": (lambda d: d.update(hidden_act="gelu"), r"config\.json: hidden_act='gelu': only silu"),
    # a Llama-family config that sets it is refused; gemma3_text accepts it (models/hf.py)
    "attn_logit_softcapping": (lambda d: d.update(attn_logit_softcapping=50.0),
                               r"config\.json: attn_logit_softcapping=50\.0: attention logit soft-capping"),
    "mlp_bias": (lambda d: d.update(mlp_bias=True), r"config\.json: mlp_bias=True"),
}


@pytest.mark.parametrize("key", sorted(CONFIG_REFUSALS))
def test_refuses_unsupported_config(llama_dir, tmp_path, key):
    edit, message = CONFIG_REFUSALS[key]
    with pytest.raises(ValueError, match=message):
        load_hf_target(edited_copy(llama_dir, tmp_path / "c", config_edit=edit))


def test_refuses_bad_tensors(llama_dir, tmp_path):
    def drop(s):
        del s["model.layers.1.mlp.up_proj.weight"]

    def extra(s):
        s["model.layers.0.self_attn.o_proj.bias"] = torch.zeros(64)

    def reshape(s):
        s["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(16, 64)

    with pytest.raises(ValueError, match=r"missing tensor 'model\.layers\.1\.mlp\.up_proj\.weight'"):
        load_hf_target(edited_copy(llama_dir, tmp_path / "a", tensor_edit=drop))
    with pytest.raises(ValueError, match=r"model\.safetensors: unexpected tensor 'model\.layers\.0\.self_attn\.o_proj\.bias'"):
        load_hf_target(edited_copy(llama_dir, tmp_path / "b", tensor_edit=extra))
    with pytest.raises(ValueError, match=r"model\.safetensors: tensor 'model\.layers\.0\.self_attn\.k_proj\.weight' "
                                         r"has shape \(16, 64\), expected \(32, 64\)"):
        load_hf_target(edited_copy(llama_dir, tmp_path / "c", tensor_edit=reshape))
    with pytest.raises(FileNotFoundError, match="config.json: not found"):
        load_hf_target(tmp_path / "nowhere")
