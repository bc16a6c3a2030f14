"""The schemes that follow a GGUF's own precision (export.quant=8da_file, engine.quant=w4_file): the type of each
weight is read from the file under our names, each linear gets the bits its type says, the result stays closer to
the fp32 target than rounding every linear to 4 bits, and a target without a file is refused by name.

The file is a tiny llama-architecture GGUF written here with a different GGML type per kind of tensor (4-bit Q4_0
and Q4_1, 5- to 8-bit Q5_0, Q5_1 and Q8_0, float F16 and F32), its lm_head tied to a Q8_0 token table as in both
real presets' files.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")
pytest.importorskip("torchao")

from omegaconf import OmegaConf  # noqa: E402
from tokenizers import Tokenizer, models as tok_models, pre_tokenizers, trainers  # noqa: E402

from models import load_target  # noqa: E402
from models.gguf import WEIGHT_TYPES, read_weight_types  # noqa: E402
from models.quantize import (GroupOffsetLinear, file_bits, linear_bits, quantize_8da4w_offsets,  # noqa: E402
                             quantize_8da8w, quantize_file)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TEXT = "def add(a, b):\n    return a + b\nThe quick brown fox jumps over the lazy dog. Numbers 12345.\n"
# GGUF tensor kind -> the type the tiny file stores it in, and the bits the schemes give that type
FILE = {"attn_q": "Q4_0", "attn_k": "Q4_1", "attn_v": "Q8_0", "attn_output": "Q5_0", "ffn_gate": "Q4_1",
        "ffn_up": "Q5_1", "ffn_down": "F16", "token_embd": "Q8_0"}
OURS = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj"}
BITS = {"Q4_0": 4, "Q4_1": 4, "Q8_0": 8, "Q5_0": 8, "Q5_1": 8, "F16": 32}
HIDDEN, LAYERS, HEADS = 128, 2, 4


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's Q/K row permutation (convert_hf_to_gguf.py), which transformers' reader undoes."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_mixed_gguf(path: Path) -> Path:
    """A tiny llama GGUF (tied embeddings) whose tensor kinds have the types of FILE, norms F32."""
    tok = Tokenizer(tok_models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator([TEXT] * 20, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|bos|>", "<|eos|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    vocab = tok.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    merges = [m if isinstance(m, str) else " ".join(m) for m in json.loads(tok.to_str())["model"]["merges"]]
    config = transformers.LlamaConfig(vocab_size=len(tokens), hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                                      num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=2,
                                      max_position_embeddings=128, rms_norm_eps=1e-5, tie_word_embeddings=True,
                                      bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("mixed")
    for add, value in ((w.add_block_count, LAYERS), (w.add_context_length, 128), (w.add_embedding_length, HIDDEN),
                       (w.add_feed_forward_length, 2 * HIDDEN), (w.add_head_count, HEADS), (w.add_head_count_kv, 2),
                       (w.add_layer_norm_rms_eps, 1e-5), (w.add_rope_freq_base, 10000.0),
                       (w.add_vocab_size, len(tokens)), (w.add_rope_dimension_count, HIDDEN // HEADS)):
        add(value)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL] * 2 + [gguf.TokenType.NORMAL] * (len(tokens) - 2))
    w.add_token_merges(merges)
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    w.add_add_bos_token(False)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, LAYERS)
    for hf_name, t in model.named_parameters():  # the tied lm_head is not listed: no output.weight
        base, suffix = hf_name.rsplit(".", 1)
        name = f"{names.get_name(base)}.{suffix}"
        a = (t.detach().float() * (0.05 if t.dim() == 2 else 1.0)).numpy()
        if base.endswith("q_proj"):
            a = permute(a, HEADS)
        if base.endswith("k_proj"):
            a = permute(a, 2)
        kind = next((k for s, k in FILE.items() if f".{s}." in f".{name}"), "F32") if a.ndim == 2 else "F32"
        qtype = gguf.GGMLQuantizationType[kind]
        if kind in ("F32", "F16"):
            w.add_tensor(name, a.astype(np.float32 if kind == "F32" else np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(a, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> Path:
    """The target stage's artifact of the mixed file (target=gguf), converted once."""
    from pipeline.stages.target import convert_gguf

    root = tmp_path_factory.mktemp("fileq")
    path = write_mixed_gguf(root / "mixed.gguf")
    out = root / "target"
    out.mkdir()
    cfg = OmegaConf.create({"target": {"kind": "gguf", "path": str(path), "package": None, "tap_layers": None},
                            "paths": {"store": str(root / "store")}})
    convert_gguf(cfg, out)
    return out


def test_the_weight_types_are_the_files_under_our_names(converted):
    types = read_weight_types(converted)
    assert types == json.loads((converted / WEIGHT_TYPES).read_text())
    for i in range(LAYERS):
        for kind, ours in OURS.items():
            assert types[f"layers.{i}.{ours}.weight"] == FILE[kind], (i, kind)
        assert types[f"layers.{i}.input_layernorm.weight"] == "F32"
    assert types["embed_tokens.weight"] == types["lm_head.weight"] == "Q8_0"  # tied: the head is the token table
    assert types["norm.weight"] == "F32"


def test_8da_file_gives_each_linear_the_bits_of_its_type(converted):
    target = load_target(converted).eval()
    table = target.embed_tokens.weight.detach().clone()
    by_bits = quantize_file(target, read_weight_types(converted), 32)
    bits = linear_bits(target)
    want = {f"layers.{i}.{ours}": BITS[FILE[kind]] for i in range(LAYERS) for kind, ours in OURS.items()}
    assert bits == {**want, "lm_head": 8}
    assert {int(b): len(names) for b, names in by_bits.items()} == {4: 6, 8: 7, 32: 2}
    assert isinstance(target.layers[0].self_attn.q_proj, GroupOffsetLinear)
    assert target.layers[0].self_attn.q_proj.grid_share == 1.0  # a Q4_0 block is a grid the offsets keep
    # the tied head is quantised on the head alone: the embedding keeps its fp32 table
    assert type(target.embed_tokens.weight) is nn.Parameter and torch.equal(target.embed_tokens.weight, table)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@torch.no_grad()
def test_following_the_file_stays_closer_to_fp32_than_4_bits_everywhere(converted):
    target = load_target(converted).eval()
    tokens = torch.randint(0, target.cfg.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))
    ref = target(tokens)
    file_q = copy.deepcopy(target)
    quantize_file(file_q, read_weight_types(converted), 32)
    four = copy.deepcopy(target)
    quantize_8da4w_offsets(four, 32)
    err_file, err_four = rel(file_q(tokens), ref), rel(four(tokens), ref)
    assert err_file < 0.05 and err_file < err_four / 2, (err_file, err_four)


@torch.no_grad()
def test_an_8_bit_linear_is_much_closer_than_a_4_bit_one():
    torch.manual_seed(0)
    lin = nn.Linear(256, 64, bias=False)
    x = torch.randn(8, 256)
    eight = nn.Sequential(copy.deepcopy(lin))
    quantize_8da8w(eight, {"0"})
    four = GroupOffsetLinear(copy.deepcopy(lin), 32)
    err8, err4 = rel(eight(x), lin(x)), rel(four(x), lin(x))
    assert err8 < err4 / 8, (err8, err4)


def test_a_target_without_a_file_is_refused_naming_the_scheme(converted):
    from models.config import TargetConfig
    from models.target import Transformer

    tiny = Transformer(TargetConfig(vocab_size=64, hidden_size=64, n_layers=1, n_heads=2, n_kv_heads=1,
                                    head_dim=32, intermediate_size=128, max_seq_len=32))
    assert read_weight_types(converted.parent / "store") is None  # a directory without weight_types.json
    with pytest.raises(ValueError, match=r"export\.quant=8da_file .*no weight_types\.json.*export\.quant=8da4w_offsets"):
        quantize_file(tiny, None, 32)
    types = read_weight_types(converted)
    types.pop("layers.0.mlp.down_proj.weight")
    with pytest.raises(ValueError, match=r"layers\.0\.mlp\.down_proj\.weight has no GGML type"):
        quantize_file(load_target(converted), types, 32)


def test_the_config_check_refuses_the_file_schemes_without_a_gguf_target(tmp_path):
    from hydra import compose, initialize_config_dir

    from pipeline.app import CONF_DIR
    from pipeline.hardware import resolve
    from pipeline.validate import ConfigError, check_config

    for override, key in (("export.quant=8da_file", "export.quant='8da_file'"),
                          ("engine=cuda engine.quant=w4_file device=cuda", "engine.quant='w4_file'")):
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose(config_name="config", overrides=["+experiment=smoke", "tracking=none",
                                                           f"paths.outputs={tmp_path}", *override.split()])
        try:
            resolve(cfg)
        except Exception:  # engine=cuda resolves `auto` against a GPU this machine may not have
            pass
        with pytest.raises(ConfigError, match=rf"{key}: a scheme that does not follow a GGUF file.*target=tiny"):
            check_config(cfg)


@torch.no_grad()
def test_w4_file_puts_only_the_files_4_bit_linears_on_the_int4_kernels(converted, interpret):
    from kernels.transform import Int4Linear, SharedInputInt4, to_kernels
    from models.quantize import dequantize_w4

    ref = load_target(converted, max_seq_len=32).eval()
    bits = file_bits(ref, read_weight_types(converted), "engine.quant=w4_file", "engine.quant=w4_g32")
    dense = ("lm_head", *(name for name, b in bits.items() if b > 4))
    target = to_kernels(copy.deepcopy(ref), max_m=4, group=32, dense=dense)
    for name, m in target.named_modules():  # the reference: the kernels' weights where they hold one, else its own
        if isinstance(m, Int4Linear):
            ref.get_submodule(name).weight.data = dequantize_w4(m.packed, m.scale_zero, m.group, torch.float32)
    target, ref = target.to(torch.bfloat16), ref.to(torch.bfloat16)
    tokens = torch.randint(0, target.cfg.vocab_size, (1, 10), generator=torch.Generator().manual_seed(0))
    pos = 0
    for T in (6, 3, 1):  # a prefill above max_m (dense path), then kernel-sized calls
        args = (tokens[:, pos:pos + T], torch.arange(pos, pos + T))
        assert rel(target(*args).float(), ref(*args).float()) < 2e-2, T
        pos += T
    layer = target.layers[0]
    # q and k are 4-bit but v is not: no shared GEMM for them, which would hold v in 4 bits
    assert isinstance(layer.self_attn.q_proj, Int4Linear) and isinstance(layer.self_attn.k_proj, Int4Linear)
    assert type(layer.self_attn.v_proj) is nn.Linear and type(layer.self_attn.o_proj) is nn.Linear
    assert not any(isinstance(m, SharedInputInt4) for m in layer.modules())
    assert isinstance(layer.mlp.gate_proj, Int4Linear)
    assert type(layer.mlp.up_proj) is nn.Linear and type(layer.mlp.down_proj) is nn.Linear
    assert type(target.lm_head) is nn.Linear

