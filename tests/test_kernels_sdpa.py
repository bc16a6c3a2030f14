"""Split-K mid-M SDPA against its plain reference: every M, GQA, causal tail, valid length and window,
empty splits, the model's strided q, export tracing. CPU runs use Triton's interpreter (see
kernels/_jit.py for why setting TRITON_INTERPRET in a fixture is enough)."""


import pytest
import torch

from kernels import sdpa_midm as S

MAX_M = 8
CUDA = torch.cuda.is_available()


def rel_err(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def model_q(B, Hq, M, D, device="cpu"):
    """q as the model makes it: a [B, Hq, M, D] view of a [B, M, Hq, D] buffer."""
    return torch.randn(B, M, Hq, D, device=device).to(torch.bfloat16).transpose(1, 2)


def check(q, k, v, q_pos, valid_len=None, window=0, tol=1e-2, **launch):
    out = S.launch_sdpa(q, k, v, q_pos, valid_len, window, **launch)
    ref = S.sdpa_reference(q.double(), k.double(), v.double(), q_pos, valid_len, window)
    assert out.shape == ref.shape and not out.isnan().any()
    return rel_err(out, ref) < tol


def test_every_m_with_gqa_and_a_causal_tail(interpret, seed):
    B, Hkv, G, L, D = 1, 2, 4, 200, 32
    k, v = (torch.randn(B, Hkv, L, D).to(torch.bfloat16) for _ in range(2))
    for M in range(1, MAX_M + 1):
        P = 150 + M  # rows at P..P+M-1: each row sees a different prefix
        q_pos = torch.arange(P, P + M)
        assert check(model_q(B, Hkv * G, M, D), k, v, q_pos, splits=4, block_n=32), f"M={M} seed {seed}"


def test_valid_length_window_and_empty_splits(interpret, seed):
    B, Hkv, G, L, D = 2, 1, 2, 160, 16
    k, v = (torch.randn(B, Hkv, L, D).to(torch.bfloat16) for _ in range(2))
    q_pos = torch.tensor([120, 121, 122])
    q = model_q(B, Hkv * G, 3, D)
    assert check(q, k, v, q_pos, torch.tensor([101]), splits=4, block_n=16), f"seed {seed}"  # 101 % 16 != 0
    assert check(q, k, v, q_pos, window=37, splits=4, block_n=16), f"seed {seed}"
    assert check(q, k, v, torch.tensor([5, 6, 7]), splits=8, block_n=16), f"seed {seed}"  # most splits empty
    assert check(q, k, v, q_pos, splits=7, block_n=16), f"seed {seed}"  # a split count that is not a power of 2


def test_a_rows_bits_do_not_depend_on_the_other_rows_of_its_call(interpret, seed):
    """The exact mode's premise: a row at position p gives the same bits alone and as the first of max_m rows,
    whose last positions move `end` across split boundaries (p + 7 >= 128 = 4 splits of 32 keys here)."""
    B, Hkv, G, L, D = 1, 2, 2, 256, 32
    k, v = (torch.randn(B, Hkv, L, D).to(torch.bfloat16) for _ in range(2))
    for p in (100, 124, 126, 127):
        q = model_q(B, Hkv * G, MAX_M, D)
        wide = S.launch_sdpa(q, k, v, torch.arange(p, p + MAX_M), splits=4, block_n=16)
        alone = S.launch_sdpa(q[:, :, :1], k, v, torch.tensor([p]), splits=4, block_n=16)
        assert torch.equal(wide[:, :, :1], alone), f"p={p} seed {seed}"


@pytest.mark.parametrize("L,heads", [(4096, 8), (32768, 8), (131072, 8), (32768, 2), (600, 8)])
def test_default_splits_fill_at_most_one_wave_of_long_enough_splits(L, heads):
    sms, block_n = 132, S.CONFIG["block_n"]
    slots = S.CONFIG["programs_per_sm"] * sms
    splits = S.default_splits(L, heads, block_n, sms)
    assert 1 <= splits and splits * heads <= slots
    assert splits == 1 or L // splits >= S.CONFIG["min_tiles_per_split"] * block_n
    if L // (S.CONFIG["min_tiles_per_split"] * block_n) >= slots // heads:  # keys enough: the wave is full
        assert splits * heads > slots - heads


def test_op_traces_into_an_exported_graph(interpret):
    k, v = (torch.randn(1, 2, 64, 16).to(torch.bfloat16) for _ in range(2))

    class Attn(torch.nn.Module):
        def forward(self, q, q_pos):
            return S.sdpa_midm(q, k, v, q_pos)

    t = torch.export.Dim("t", min=1, max=MAX_M)
    ep = torch.export.export(Attn(), (torch.randn(1, 4, 3, 16).to(torch.bfloat16), torch.arange(30, 33)),
                             dynamic_shapes=({2: t}, {0: t}))
    assert any("sdpa_midm" in str(n.target) for n in ep.graph.nodes)
    q, q_pos = torch.randn(1, 4, 5, 16).to(torch.bfloat16), torch.arange(40, 45)
    assert rel_err(ep.module()(q, q_pos), S.sdpa_reference(q, k, v, q_pos)) < 1e-2


def test_more_rows_than_the_kernel_takes_are_refused():
    k = torch.randn(1, 1, 32, 16).to(torch.bfloat16)
    with pytest.raises(ValueError, match="M <= 16"):
        S.launch_sdpa(torch.randn(1, 1, 17, 16).to(torch.bfloat16), k, k, torch.arange(17))


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_matches_reference(seed):
    B, Hkv, G, L, D = 1, 8, 4, 5000, 128
    k, v = (torch.randn(B, Hkv, L, D, device="cuda").to(torch.bfloat16) for _ in range(2))
    for M in range(1, 17):
        q_pos = torch.arange(4321, 4321 + M, device="cuda")
        for launch in ({}, dict(splits=64, block_n=128, stages=2)):
            assert check(model_q(B, Hkv * G, M, D, "cuda"), k, v, q_pos, torch.tensor([4900], device="cuda"),
                         tol=4e-3, **launch), f"M={M} {launch} seed {seed}"
