"""runner.cuda_engine.CudaEngine: on the CPU (graphs off) its buffers and calls give what EagerEngine gives; on
CUDA (skipped without one) its graph replays are lossless at every K and agree with the eager module."""

import pytest
import torch

from models import Speculator, tiny_draft, tiny_target
from runner.build import build_engine
from runner.cuda_engine import CudaEngine
from runner.engine import EagerEngine
from runner.generate import generate

pytestmark = pytest.mark.usefixtures("one_torch_thread")

WINDOWS = dict(max_m=5, default_chain=3, max_prefill_chunk=16, min_prefill_chunk=8)
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def speculator(seed: int = 0, **target) -> Speculator:
    target = tiny_target(seed=seed, n_layers=2, max_seq_len=96, **target)
    draft = tiny_draft(target, seed=seed + 1, draft_vocab_size=160)
    draft.set_vocab_map(torch.cat([torch.arange(96), torch.arange(96, 256, 2)[:64]]))
    return Speculator(target, draft).eval()


def prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (int(length),), generator=g).tolist()
            for length in torch.randint(1, 30, (n,), generator=g)]


def cyclic_speculator(seed: int = 0) -> Speculator:
    """A target whose layers add nothing, so its next token is a permutation pi of the current one, and a draft
    whose first step predicts pi(pi(x)) from the feature of x: every round accepts exactly its first proposal
    (the later steps see the same g and repeat it), so which draft row seeds the next round decides every
    round's acceptance."""
    target = tiny_target(seed=seed, n_layers=2, max_seq_len=96)
    draft = tiny_draft(target, seed=seed + 1)
    g = torch.Generator().manual_seed(seed)
    pi = torch.randperm(256, generator=g)
    H = target.cfg.hidden_size
    with torch.no_grad():
        E = torch.randn(256, H, generator=g)
        target.embed_tokens.weight.copy_(E)
        for layer in target.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        target.lm_head.weight[pi] = E  # row pi(x) is e_x: argmax after x is pi(x)
        draft.fc.weight.zero_()
        draft.fc.weight[:, :H] = torch.eye(H)  # feature = e_x
        draft.layers[0].self_attn.o_proj.weight.zero_()
        draft.layers[0].mlp.down_proj.weight.zero_()
        draft.lm_head.weight[pi[pi]] = E  # row pi(pi(x)) is e_x
    return Speculator(target, draft).eval()


def test_rounds_on_the_device_seed_each_round_from_the_accepted_row():
    engine = CudaEngine(cyclic_speculator(), device="cpu", dtype="float32", graphs=False, exact=False, **WINDOWS)
    for prompt in prompts(3, seed=5):
        base = generate(engine, prompt, chain=0, max_new_tokens=33)
        for k in range(1, WINDOWS["max_m"]):
            r = generate(engine, prompt, chain=k, max_new_tokens=33)
            assert r.output_ids == base.output_ids
            assert set(r.accepted[:-1]) == {1}, r.accepted  # the last round may be cut by the budget


@pytest.mark.parametrize("chain", [0, 1, 2, 4])
def test_cpu_buffers_give_what_the_eager_engine_gives(chain):
    """Same weights, same prompts (fresh lengths 1..29, so prefill, verify-window prefill and one-token pads
    all occur): identical tokens, identical acceptance per round, greedy and sampled."""
    eager = EagerEngine(speculator(), **WINDOWS)
    mine = CudaEngine(speculator(), device="cpu", dtype="float32", graphs=False, exact=False, **WINDOWS)
    for i, prompt in enumerate(prompts(4, seed=chain)):
        for temperature in (0.0, 0.9):
            kw = dict(chain=chain, max_new_tokens=24, temperature=temperature, seed=i)
            a, b = generate(eager, prompt, **kw), generate(mine, prompt, **kw)
            assert b.output_ids == a.output_ids
            assert b.accepted == a.accepted and b.chain_per_round == a.chain_per_round


def test_every_chain_is_lossless_against_its_own_greedy():
    engine = CudaEngine(speculator(3), device="cpu", dtype="float32", graphs=False, exact=False, **WINDOWS)
    for prompt in prompts(3, seed=7):
        base = generate(engine, prompt, chain=0, max_new_tokens=40).output_ids
        for k in range(1, WINDOWS["max_m"]):
            assert generate(engine, prompt, chain=k, max_new_tokens=40).output_ids == base


def test_exact_runs_every_target_call_at_max_m_rows_and_a_row_the_same_at_every_width():
    """bf16: every target call after the prefill runs max_m rows (the call's own, then padding), so a row's
    logits are bit-equal whether it is decoded alone or verified among other rows."""
    engine = CudaEngine(speculator(2), device="cpu", dtype="bfloat16", graphs=False, exact=True, **WINDOWS)
    widths = []
    engine.spec.target.register_forward_hook(lambda mod, args, out: widths.append(args[0].shape[-1]))
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, 256, (11,), generator=g).tolist()

    def first_row_logits(rows: list[int]) -> torch.Tensor:
        engine.reset()
        engine.prefill(torch.tensor([prompt]), torch.arange(len(prompt)))
        tokens, pos = torch.tensor([rows]), len(prompt) + torch.arange(len(rows))
        out = engine.target_decode(tokens, pos) if len(rows) == 1 else engine.target_verify(tokens, pos)
        return out[-1][0, 0].float().clone()

    alone = first_row_logits([7])
    for T in range(2, WINDOWS["max_m"] + 1):
        assert torch.equal(first_row_logits([7, *torch.randint(3, 256, (T - 1,), generator=g).tolist()]), alone)
    assert widths == [len(prompt), WINDOWS["max_m"]] * WINDOWS["max_m"]
    assert engine.meta["max_seq_len"] == 96 - (WINDOWS["max_m"] - 1)  # the padding rows' slots stay inside


def test_exact_rounds_are_lossless_up_to_a_full_cache():
    engine = CudaEngine(speculator(4), device="cpu", dtype="bfloat16", graphs=False, exact=True, **WINDOWS)
    assert engine.meta["exact_width"] == WINDOWS["max_m"]  # the eval's exact_width metric reads it
    assert "exact_width" not in CudaEngine(speculator(4), device="cpu", dtype="bfloat16", graphs=False, exact=False,
                                           **WINDOWS).meta
    for prompt in prompts(3, seed=9):
        base = generate(engine, prompt, chain=0, max_new_tokens=200)
        assert base.stop_reason == "cache_full"
        for k in range(1, WINDOWS["max_m"]):
            assert generate(engine, prompt, chain=k, max_new_tokens=200).output_ids == base.output_ids


def test_a_window_outside_the_captured_range_is_refused_naming_it():
    engine = CudaEngine(speculator(), device="cpu", dtype="float32", graphs=False, exact=False, **WINDOWS)
    with pytest.raises(ValueError, match=r"target_verify takes T in \[2, 5\].*T=6"):
        engine.target_verify(torch.zeros(1, 6, dtype=torch.long), torch.arange(6))
    with pytest.raises(ValueError, match="target_decode takes T=1; got T=2"):
        engine.target_decode(torch.zeros(1, 2, dtype=torch.long), torch.arange(2))
    with pytest.raises(ValueError, match=r"speculate takes k in \[0, 4\].*k=5"):
        engine.speculate(5, 1, 10)


def test_bad_settings_are_refused_before_any_work():
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device, got cpu"):
        CudaEngine(speculator(), device="cpu", exact=False, **WINDOWS)
    with pytest.raises(ValueError, match="dtype must be one of .*got 'float16'"):
        CudaEngine(speculator(), device="cpu", dtype="float16", graphs=False, exact=False, **WINDOWS)
    with pytest.raises(ValueError, match="kernels take bfloat16 on CUDA"):
        CudaEngine(speculator(), device="cpu", dtype="float32", graphs=False, kernels=True, exact=False, **WINDOWS)
    with pytest.raises(ValueError, match="max_m=17"):
        CudaEngine(speculator(), device="cpu", dtype="float32", graphs=False, exact=False, **{**WINDOWS, "max_m": 17})


@cuda
@pytest.mark.parametrize("kernels", [False, True])
@pytest.mark.parametrize("exact", [False, True])
def test_graph_replays_are_lossless_at_every_chain(kernels, exact):
    engine = CudaEngine(speculator(5), device="cuda", kernels=kernels, exact=exact, **WINDOWS)
    for prompt in prompts(3, seed=11):
        base = generate(engine, prompt, chain=0, max_new_tokens=48).output_ids
        for k in range(1, WINDOWS["max_m"]):
            assert generate(engine, prompt, chain=k, max_new_tokens=48).output_ids == base


@cuda
@pytest.mark.parametrize("exact", [False, True])
def test_graph_replays_on_the_kernels_rings_are_lossless_and_give_the_flat_caches_tokens(exact, monkeypatch):
    """The kernels on a windowed target: its ring (window 8 + 16 slots, which a prompt and 48 tokens wrap up to
    three times) gives every K the K = 0 tokens, and those are the same engine's tokens on a flat cache."""
    windowed = dict(sliding_window=[8, None])
    ring = CudaEngine(speculator(5, **windowed), device="cuda", kernels=True, exact=exact, **WINDOWS)
    monkeypatch.setattr("models.target.ring_slots", lambda cfg, length, max_t: None)
    flat = CudaEngine(speculator(5, **windowed), device="cuda", kernels=True, exact=exact, **WINDOWS)
    assert [e.spec.target.layers[0].self_attn.k_cache.shape[2] for e in (ring, flat)] == [8 + 16, 96]
    for prompt in prompts(3, seed=11):
        base = generate(ring, prompt, chain=0, max_new_tokens=48).output_ids
        assert generate(flat, prompt, chain=0, max_new_tokens=48).output_ids == base
        for k in range(1, WINDOWS["max_m"]):
            assert generate(ring, prompt, chain=k, max_new_tokens=48).output_ids == base


@cuda
def test_graph_rounds_seed_each_round_from_the_accepted_row():
    engine = CudaEngine(cyclic_speculator(), device="cuda", exact=False, **WINDOWS)
    for prompt in prompts(3, seed=5):
        base = generate(engine, prompt, chain=0, max_new_tokens=33)
        for k in range(1, WINDOWS["max_m"]):
            r = generate(engine, prompt, chain=k, max_new_tokens=33)
            assert r.output_ids == base.output_ids and set(r.accepted[:-1]) == {1}, r.accepted


@cuda
def test_graph_replays_in_float32_equal_the_eager_module():
    eager = EagerEngine(speculator(9), device="cuda", **WINDOWS)
    mine = CudaEngine(speculator(9), device="cuda", dtype="float32", exact=False, **WINDOWS)
    for prompt in prompts(3, seed=13):
        for k in (0, 3):
            a = generate(eager, prompt, chain=k, max_new_tokens=48)
            b = generate(mine, prompt, chain=k, max_new_tokens=48)
            assert b.output_ids == a.output_ids and b.accepted == a.accepted


@pytest.mark.parametrize("quant, export_quant", [("bf16", "8da4w_offsets"), ("w4_g32", "8da4w_draft"),
                                                         ("w4_g128", "fp32")])
def test_the_cuda_engine_is_built_from_the_engine_group_alone(monkeypatch, quant, export_quant):
    """The eval stage's engine (pipeline.artifacts.load_engine) is the engine group's: its weights are
    engine.quant's, never export.quant's, and its windows are engine.*'s, never export.*'s."""
    from types import SimpleNamespace

    from hydra import compose, initialize_config_dir

    from pipeline import artifacts, hardware
    from pipeline.app import CONF_DIR
    from runner import cuda_engine

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[
            "engine=cuda", f"engine.quant={quant}", "engine.max_m=6", "engine.max_prefill_chunk=64",
            f"export.quant={export_quant}", "export.max_m=8", "export.default_chain=4", "export.max_prefill_chunk=128"])
    hardware.resolve(cfg)
    seen = {}
    monkeypatch.setattr(cuda_engine, "CudaEngine", lambda spec, **kw: seen.update(kw) or "engine")
    monkeypatch.setattr("models.load_target", lambda path, max_seq_len: tiny_target(seed=0, max_seq_len=max_seq_len))
    monkeypatch.setattr("models.load_speculators", lambda path, target: tiny_draft(target, seed=1))
    upstream = {"target": SimpleNamespace(path="target"), "draft": SimpleNamespace(path="draft")}
    assert artifacts.engine_upstream(cfg) == ("target", "draft")
    assert artifacts.load_engine(cfg, upstream) == "engine"
    assert seen["kernels"] == (quant != "bf16") and seen.get("group") == {"bf16": None, "w4_g32": 32,
                                                                           "w4_g128": 128}[quant]
    assert (seen["max_m"], seen["default_chain"], seen["max_prefill_chunk"], seen["min_prefill_chunk"]) == (6, 5, 64, 7)
    assert seen["exact"] is True and seen["device"] == "cuda"


def test_an_unknown_cuda_quant_is_refused_before_any_weights_are_read(tmp_path):
    with pytest.raises(ValueError, match=r"engine.quant='int8': expected one of bf16, w4_g32, w4_g128"):
        build_engine({"kind": "cuda", "quant": "int8", "device": "cuda", "compile": "none", "exact": False,
                      "max_seq_len": 128, **WINDOWS},
                     target=tmp_path / "absent",
                     draft=tmp_path / "absent")


def test_compiled_calls_give_the_uncompiled_engines_tokens_at_every_chain():
    """`compile` puts each captured width through torch.compile (the aot_eager backend here: inductor's C++
    build would take minutes of CI; its GPU run is in docs/results.md): the compiled calls are the ones the
    loop runs (dynamo saw graphs), every K gives the uncompiled engine's tokens, and the 2 * max_m widths of
    every K compile a handful of graphs (automatic dynamic shapes), not one per width."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    uncompiled = CudaEngine(speculator(), device="cpu", dtype="float32", graphs=False, exact=False, **WINDOWS)
    mine = CudaEngine(speculator(), device="cpu", dtype="float32", graphs=False, compile="aot_eager", exact=False,
                      **WINDOWS)
    for prompt in prompts(2, seed=11):
        for k in range(WINDOWS["max_m"]):
            assert generate(mine, prompt, chain=k, max_new_tokens=20).output_ids == \
                generate(uncompiled, prompt, chain=k, max_new_tokens=20).output_ids
    assert 0 < counters["stats"]["unique_graphs"] <= 6 < 2 * WINDOWS["max_m"]
    with pytest.raises(ValueError, match="compile='inductor' takes the dense engine"):
        CudaEngine(speculator(), device="cpu", dtype="float32", graphs=False, kernels=True, compile="inductor",
                   exact=False, **WINDOWS)
