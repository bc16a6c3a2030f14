"""Exact mode on 8da4w .pte programs: every K gives the program's own exact K=0 tokens bit for bit.

8da4w rounds each linear's input to int8 per row, so a 1e-7 difference in a row turns into whole steps and
flips near ties; without exact mode a row's logits depend on its call's width and key length. One program
(grouped-query attention, a sliding-window layer beside a full one) is exported with XNNPACK, and every check
compares logits with torch.equal on fresh random prompts.
"""

import os

import pytest
import torch
from omegaconf import OmegaConf

from models import Speculator, tiny_draft, tiny_target
from pipeline.export_pte import export_pte
from pipeline.hardware import resolve_exact, resolve_exact_width
from runner.engine import ExactEngine, PteEngine
from runner.generate import generate, prefill

from oracle import Oracle

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.slow]  # exports an 8da4w program

MAX_M, VOCAB = 4, 384
SHAPE = dict(n_layers=2, hidden_size=128, n_heads=4, n_kv_heads=2, head_dim=32, intermediate_size=256,
             sliding_window=[8, None])


@pytest.fixture(scope="module")
def exact(tmp_path_factory):
    """(the 8da4w_offsets program, the same program in exact mode at max_m rows)."""
    target = tiny_target(seed=0, vocab_size=VOCAB, max_seq_len=64, **SHAPE)
    path = tmp_path_factory.mktemp("exact") / "model.pte"
    export_pte(Speculator(target, tiny_draft(target, seed=1)).eval(), max_m=MAX_M, default_chain=2,
               max_prefill_chunk=16, min_prefill_chunk=5, backend="xnnpack", quant="8da4w_offsets", out_path=path,
               manifest_hash="0" * 64, progress=False, draft_chains=False)  # exactness is the target's
    program = PteEngine(path)
    return program, ExactEngine(program, MAX_M)


def fresh_prompt(n: int) -> list[int]:
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    return torch.randint(0, VOCAB, (n,), generator=g).tolist()


def window_logits(engine, prompt: list[int], continuation: list[int], k: int) -> torch.Tensor:
    """The target's logits at the positions of `continuation` after `prompt`, read in calls of k+1 rows
    (k = 0: target_decode), as rounds that accept all k proposals read them."""
    P = len(prompt)
    engine.reset()
    prefill(engine, prompt, features=False)
    rows = []
    for i in range(0, len(continuation), k + 1):
        window = continuation[i : i + k + 1]
        call, pos = torch.tensor([window]), torch.arange(P + i, P + i + len(window))
        rows.append((engine.target_decode(call, pos)[1] if len(window) == 1 else engine.target_verify(call, pos)[2])[0])
    return torch.cat(rows)


def test_a_rows_logits_are_the_same_bits_in_every_window(exact):
    """12 positions read at K = 0..max_m-1 (12 is a multiple of every window): the same bits everywhere,
    the padding rows of short calls included in what later calls may not see."""
    _, engine = exact
    for prompt_len in (6, 16, 19):  # one chunk, the largest chunk, a chunk and a tail
        prompt, continuation = fresh_prompt(prompt_len), fresh_prompt(12)
        want = window_logits(engine, prompt, continuation, 0)
        for k in range(1, MAX_M):
            got = window_logits(engine, prompt, continuation, k)
            assert torch.equal(got, want), (f"prompt {prompt_len}, K={k}: rows differ by up to "
                                            f"{float((got - want).abs().max()):.2e}")


@pytest.mark.parametrize("spoil", [None, "first", "last"])
def test_every_k_gives_the_exact_k0_tokens(exact, spoil):
    """Through runner.generate: the random draft (almost every proposal rejected) and an oracle draft that
    proposes the K=0 continuation (all accepted, or spoiled at the first or last proposal of a round)."""
    _, engine = exact
    prompt = fresh_prompt(9)
    base = generate(engine, prompt, chain=0, max_new_tokens=30)
    seq = prompt + base.output_ids
    for k in range(1, MAX_M):
        wrong = {None: lambda j: False, "first": lambda j: j == 0, "last": lambda j: j == k - 1}[spoil]
        assert generate(engine, prompt, chain=k, max_new_tokens=30).output_ids == base.output_ids, k
        res = generate(Oracle(engine, seq, wrong), prompt, chain=k, max_new_tokens=30)
        assert res.output_ids == base.output_ids, (spoil, k)
        assert max(res.accepted) == (k if spoil is None else k - 1 if spoil == "last" else 0), res.accepted


def test_exact_mode_reads_the_same_attention_as_the_t1_decode(tiny_pte):
    """The exact call's attention (eagle3::exact_sdpa) hides the slots after each row's position (the padding
    rows' writes included): in fp32 the exact rows are the T = 1 decode's rows up to float noise."""
    from runner.engine import EagerEngine

    eager = EagerEngine(tiny_pte.speculator(), max_m=tiny_pte.max_m, default_chain=2, max_prefill_chunk=16)
    engine = ExactEngine(eager, tiny_pte.max_m)
    prompt, continuation = [(5 * i + 1) % 250 for i in range(11)], [(3 * i + 7) % 250 for i in range(10)]
    want = window_logits(eager, prompt, continuation, 0)
    for k in (0, 2, tiny_pte.max_m - 1):
        torch.testing.assert_close(window_logits(engine, prompt, continuation, k), want, rtol=1e-5, atol=1e-5)


def test_the_exact_call_attends_through_eagle3_exact_sdpa_and_the_other_calls_through_custom_sdpa(exact):
    """The exact call's attention costs the context, not the cache (models.exact_sdpa): its method calls our
    kernel and no custom_sdpa; the other target methods keep ExecuTorch's."""
    from executorch.exir._serialize._program import deserialize_pte_binary

    pte = deserialize_pte_binary(exact[0].path.read_bytes())
    ops = {plan.name: {f"{o.name}.{o.overload}" for o in plan.operators}
           for plan in getattr(pte, "program", pte).execution_plan}
    assert "eagle3::exact_sdpa.out" in ops["target_verify_exact"]
    assert not any(op.startswith("llama::custom_sdpa") for op in ops["target_verify_exact"])
    assert all("eagle3::exact_sdpa.out" not in ops[m] for m in ("target_verify", "target_decode", "prefill"))


def test_the_kernel_gives_a_row_the_same_bits_alone_and_among_others_and_the_references_values(tmp_path):
    """eagle3::exact_sdpa's ExecuTorch kernel on fresh inputs (GQA, a window): a row alone equals the same row
    among seven others bit for bit, and every row is the PyTorch reference's to float32 rounding."""
    from executorch.exir import EdgeCompileConfig, to_edge_transform_and_lower
    from executorch.runtime import Runtime

    from models import exact_sdpa
    from models.layers import load_llama_ops

    load_llama_ops()

    class Attend(torch.nn.Module):
        def __init__(self, window):
            super().__init__()
            self.window = window

        def forward(self, q, k, v, pos):
            return torch.ops.eagle3.exact_sdpa(q, k, v, pos, self.window, 0.125)

    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    k, v = torch.randn(2, 1, 96, 2, 64, generator=g)
    for window in (0, 24):
        T = torch.export.Dim("T", min=1, max=8)
        ep = torch.export.export(Attend(window), (torch.randn(1, 3, 6, 64), k, v, torch.arange(3)),
                                 dynamic_shapes=({1: T}, None, None, {0: T}), strict=False)
        path = tmp_path / f"attend-{window}.pte"
        path.write_bytes(to_edge_transform_and_lower(ep, compile_config=EdgeCompileConfig(
            _check_ir_validity=False)).to_executorch().buffer)
        method = Runtime.get().load_program(path).load_method("forward")
        q, pos = torch.randn(1, 8, 6, 64, generator=g), torch.arange(40, 48)
        rows = method.execute([q, k, v, pos])[0]
        alone = method.execute([q[:, :1].contiguous(), k, v, pos[:1]])[0]
        assert torch.equal(alone[0, 0], rows[0, 0]), f"window {window}"
        torch.testing.assert_close(rows, exact_sdpa.reference(q, k, v, pos, window, 0.125), rtol=1e-5, atol=1e-5)


def test_the_exact_width_is_refused_outside_the_programs_verify_range(exact):
    program, _ = exact
    for width in (1, MAX_M + 1):
        with pytest.raises(ValueError, match=rf"exact width {width}: .* T in \[2, {MAX_M}\]"):
            ExactEngine(program, width)
    engine = ExactEngine(program, 3)
    assert engine.meta["max_m"] == 3 and engine.meta["max_seq_len"] == program.meta["max_seq_len"] - 2
    with pytest.raises(ValueError, match="chain"):
        generate(engine, [1, 2, 3], chain=3, max_new_tokens=4)


def test_auto_exact_is_on_where_a_rows_rounding_can_flip_a_token():
    assert resolve_exact("auto", engine="pte", quant="8da4w_offsets") and resolve_exact("auto", engine="cuda", quant="fp32")
    assert resolve_exact("auto", engine="pte", quant="8da_file")  # its linears take int8 per-row activations too
    assert not resolve_exact("auto", engine="pte", quant="fp32") and not resolve_exact("auto", engine="eager",
                                                                                          quant="fp32")
    assert resolve_exact(True, engine="pte", quant="fp32") and not resolve_exact(False, engine="cuda", quant="fp32")


def test_auto_exact_width_is_max_m_on_cuda_and_the_gemm_row_tile_clamped_on_xnnpack(monkeypatch):
    import pipeline.hardware as hardware

    assert resolve_exact_width("auto", max_m=8, backend="xnnpack", quant="8da4w_offsets", engine="cuda") == 8
    assert resolve_exact_width("auto", max_m=8, backend="portable", quant="8da4w_offsets", engine="pte") == 8
    assert resolve_exact_width(5, max_m=8, backend="xnnpack", quant="8da4w_offsets", engine="pte") == 5
    for tile, want in ((8, 8), (3, 3), (1, 2), (12, 8)):
        monkeypatch.setattr(hardware, "row_tile", lambda quant, t=tile: {"tile": t, "capability": "test"})
        assert resolve_exact_width("auto", max_m=8, backend="xnnpack", quant="8da4w_offsets", engine="pte") == want
