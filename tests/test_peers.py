"""The CPU peer benchmark's testable parts: bench.gguf_write (our Llama-family target -> a GGUF that
transformers' reader turns back into the same tensors and logits, and that llama.cpp decodes to our greedy
tokens), bench.quality's losses, and the benchmark's bookkeeping (bench.bytes_floor's bytes per step, bench.peers'
common prefixes and the summary's lossless flags). Random tiny targets
with widely spread weights, so that greedy decoding is not decided by float noise. The llama.cpp check skips,
naming the install command, where llama_cpp is not installed."""

from __future__ import annotations


import pytest
import torch

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from tokenizers import Tokenizer, decoders, models as tok_models, pre_tokenizers, trainers  # noqa: E402

from models import TargetConfig, Transformer  # noqa: E402
from bench import gguf_write, quality  # noqa: E402
from models import gguf as mg  # noqa: E402
from models.quiet import quiet_transformers  # noqa: E402


pytestmark = pytest.mark.usefixtures("one_torch_thread")

TEXT = "def add(a, b):\n    return a + b\n\nclass Point:\n    def __init__(self, x, y):\n        self.x = x\n"


def tokenizer(vocab_size: int) -> Tokenizer:
    tok = Tokenizer(tok_models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([TEXT] * 20, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|eos|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    return tok


def target(tie: bool, seed: int = 0, vocab_size: int = 320) -> Transformer:
    cfg = TargetConfig(vocab_size=vocab_size, hidden_size=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                       intermediate_size=128, rope_theta=50000.0, tie_embeddings=tie, max_seq_len=96)
    model = Transformer(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.15)
    return model


def read_back(path):
    with quiet_transformers(progress=False):
        return transformers.AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32).eval()


@pytest.mark.parametrize("tie", [True, False])
def test_write_gguf_reads_back_as_the_same_tensors_and_logits(tmp_path, tie):
    model, tok = target(tie), tokenizer(300)  # 300 tokenizer ids, 320 embedding rows: 20 padded
    path = gguf_write.write_gguf(model, tok, tmp_path / "t.gguf")
    hf = read_back(path)
    theirs = hf.state_dict()
    for name, t in model.state_dict().items():
        if name == "lm_head.weight":
            assert torch.equal(theirs["lm_head.weight"], t)
            continue
        assert torch.equal(theirs["model." + name], t), name  # the Q/K permutation undone exactly
    assert hf.config.tie_word_embeddings == tie
    ids = torch.randint(0, 320, (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, ref = model(ids), hf(ids).logits
    assert ours.std() > 0.5
    assert (ours - ref).abs().max() < 1e-4 * ours.abs().max()
    # the file is one our own GGUF reader accepts as a llama-architecture file with a gpt2 vocabulary
    info = mg.inspect_gguf(path)
    assert (info.architecture, info.tokenizer_model, info.n_tokens, info.add_bos) == ("llama", "gpt2", 320, False)


def test_quantised_types_read_back_close(tmp_path):
    model, tok = target(True), tokenizer(300)
    ids = torch.randint(0, 320, (1, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = model(ids)
        for dtype, tol in (("f16", 2e-3), ("q8_0", 5e-2)):
            got = read_back(gguf_write.write_gguf(model, tok, tmp_path / f"{dtype}.gguf", dtype=dtype))(ids).logits
            assert (got - ref).norm() / ref.norm() < tol, dtype


def test_llama_permute_is_what_transformers_undoes():
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    w = torch.randn(2 * 16, 64)
    back = LlamaTensorProcessor()._reverse_permute_weights(gguf_write.llama_permute(w, 2).numpy(), 4, 2)
    assert torch.equal(torch.from_numpy(back), w)


def test_write_gguf_refuses_what_the_llama_architecture_lacks(tmp_path):
    cfg = TargetConfig(vocab_size=64, hidden_size=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16,
                       intermediate_size=64, qk_norm=True)
    with pytest.raises(mg.GGUFError, match="qk_norm"):
        gguf_write.write_gguf(Transformer(cfg), tokenizer(64), tmp_path / "x.gguf")
    with pytest.raises(mg.GGUFError, match="dtype"):
        gguf_write.write_gguf(target(True), tokenizer(300), tmp_path / "x.gguf", dtype="q3_k")
    assert not list(tmp_path.iterdir())


def test_bytes_per_step(tmp_path):
    from bench.bytes_floor import gguf_weight_bytes, target_weight_bytes

    tied, untied = target(True), target(False)
    n_tied = sum(p.numel() for p in tied.parameters())
    assert target_weight_bytes(tied, "fp32") == 4 * n_tied
    assert target_weight_bytes(untied, "fp32") == 4 * n_tied  # the untied embedding is read one row a step
    matrices = sum(p.numel() for p in tied.parameters() if p.ndim == 2)
    assert target_weight_bytes(tied, "8da4w_offsets") == 4 * (n_tied - matrices) + matrices // 2 + matrices // 32 * 6
    tok = tokenizer(300)
    f32 = gguf_weight_bytes(gguf_write.write_gguf(tied, tok, tmp_path / "tied.gguf"))
    assert f32 == 4 * n_tied
    assert gguf_weight_bytes(gguf_write.write_gguf(untied, tok, tmp_path / "untied.gguf")) == 4 * n_tied


def test_summary_flags_mismatches_and_picks_the_best_of_ours():
    from bench.peers import Run, System, best_ours, common_prefix, summarise

    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2 and common_prefix([1, 2], [1, 2]) == 2
    ref = {0: [5, 6, 7, 8]}

    def system(name, family, chain, tokens, rate, policy="static"):
        s = System(name, family, None, 100, "fp32", chain, policy)
        s.runs = [(rep, 0, Run(tokens, 3, 3 / rate, {"tau": 2.0})) for rep in range(3)]
        return s

    rows = summarise([system("ours fp32 K=0", "ours", 0, [5, 6, 7, 8], 50.0),
                      system("ours fp32 K=3", "ours", 3, [5, 6, 9, 9], 90.0),
                      system("ours fp32 adaptive", "ours", 7, [5, 6, 7, 8], 95.0, "adaptive"),
                      system("llama.cpp f32", "llama.cpp", None, [5, 6, 7, 8], 120.0)], ref, 1)
    by = {r["system"]: r for r in rows}
    assert by["ours fp32 K=0"]["same_as_reference"] and by["llama.cpp f32"]["same_as_reference"]
    assert by["ours fp32 K=3"]["common_prefix_per_prompt"] == [2]
    assert by["ours fp32 K=3"]["lossless_vs_own_k0"] is False
    assert by["ours fp32 K=3"]["tokens_per_s_median"] == pytest.approx(90.0)
    assert by["ours fp32 adaptive"]["lossless_vs_own_k0"] is True and by["ours fp32 adaptive"]["policy"] == "adaptive"
    assert best_ours(rows)["system"] == "ours fp32 K=3"  # the best static K; the faster adaptive row is compared with it


def test_llama_cpp_in_a_process_of_its_own_decodes_our_greedy_tokens_and_scores_our_loss(tmp_path):
    """The GGUF check on a random target, through bench.llama_run's child process (how the GPU bench runs it):
    llama.cpp's greedy tokens from the prompt ids are ours, plain and with prompt lookup, its loss over windows
    is our eager loss, and on our own greedy continuation its argmax agrees at every position."""
    from bench import llama_run
    from bench.peers import llama_available

    why = llama_available()
    if why is not None:
        pytest.skip(why)
    model, tok = target(True, seed=3), tokenizer(300)
    path = gguf_write.write_gguf(model, tok, tmp_path / "t.gguf")
    prompt = tok.encode(TEXT).ids[:12]
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(16):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    windows = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (20, 9)]
    got = llama_run.in_child({"path": str(path), "prompts": [prompt], "new_tokens": 16, "pld": [2], "threads": 1,
                              "windows": windows, "agree": [ids], "prompt_len": len(prompt)})
    assert [row["outputs"] for row in got["rows"].values()] == [[ids[len(prompt):]]] * 2
    assert got["quality"]["loss"] == pytest.approx(quality.eager_loss(model, windows), rel=1e-3)
    assert got["quality"]["greedy_agreement"] == 1.0


@pytest.mark.parametrize("seed", [0, 1])
def test_llama_runs_numpy_loss_is_the_torch_one(seed):
    """bench.llama_run.nll (numpy, no torch in llama.cpp's process) against bench.quality._nll on fresh logits."""
    from bench import llama_run

    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())) + seed)
    logits = torch.randn(7, 50, generator=g) * 5
    targets = torch.randint(0, 50, (7,), generator=g).tolist()
    assert llama_run.nll(logits.numpy(), targets) == pytest.approx(quality._nll(logits, targets), rel=1e-9)


@pytest.mark.slow  # an exported program
def test_the_pte_loss_and_greedy_reference_are_the_eager_targets(tiny_pte, seed):
    """The quality section's three readings of one fp32 model agree: the .pte's target_verify windows give the
    eager stateless loss (within float noise, whatever the window length against max_m), and the eager cached
    greedy reference gives the .pte's own K=0 tokens."""
    from runner.engine import PteEngine
    from runner.generate import generate

    g = torch.Generator().manual_seed(seed)
    spec = tiny_pte.speculator()
    vocab = spec.target.cfg.vocab_size
    windows = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (2 * tiny_pte.max_m, 13, 2)]
    engine = PteEngine(tiny_pte.path)
    eager = quality.eager_loss(spec.target, windows)
    assert abs(quality.pte_loss(engine, windows) - eager) < 1e-4 * max(1.0, eager)
    assert quality.eager_loss(spec.target, windows[:1]) != pytest.approx(eager), "the windows are all scored"

    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (9, 20)]
    reference = quality.eager_greedy(spec.target, prompts, 12)
    for i, prompt in enumerate(prompts):
        assert generate(engine, prompt, chain=0, max_new_tokens=12).output_ids == reference[i]
