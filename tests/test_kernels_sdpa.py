"""Split-K mid-M SDPA against its reference: every M, GQA, causal tail, valid length and window,
empty splits, a context far shorter than the cache, the model's strided q, export tracing; a row's bits the
same in every call it is in. CPU runs use Triton's interpreter (see
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
        assert check(model_q(B, Hkv * G, M, D), k, v, q_pos, split_keys=64, programs=2, block_n=32), \
            f"M={M} seed {seed}"


def test_valid_length_window_and_empty_splits(interpret, seed):
    B, Hkv, G, L, D = 2, 1, 2, 160, 16
    k, v = (torch.randn(B, Hkv, L, D).to(torch.bfloat16) for _ in range(2))
    q_pos = torch.tensor([120, 121, 122])
    q = model_q(B, Hkv * G, 3, D)
    assert check(q, k, v, q_pos, torch.tensor([101]), split_keys=48, block_n=16), f"seed {seed}"  # 101 % 16 != 0
    assert check(q, k, v, q_pos, window=37, split_keys=48, programs=2, block_n=16), f"seed {seed}"
    assert check(q, k, v, torch.tensor([5, 6, 7]), split_keys=16, block_n=16), f"seed {seed}"  # most splits empty
    assert check(q, k, v, q_pos, split_keys=32, programs=3, block_n=16), f"seed {seed}"  # 5 splits: not a power of 2


def test_a_rows_bits_do_not_depend_on_the_other_rows_of_its_call(interpret, seed):
    """The exact mode's premise: a row at position p gives the same bits alone and as the first of max_m rows,
    whose last positions move `end` across split boundaries (p + 7 >= 128: splits of 64 keys here)."""
    B, Hkv, G, L, D = 1, 2, 2, 256, 32
    k, v = (torch.randn(B, Hkv, L, D).to(torch.bfloat16) for _ in range(2))
    for p in (100, 124, 126, 127):
        q = model_q(B, Hkv * G, MAX_M, D)
        wide = S.launch_sdpa(q, k, v, torch.arange(p, p + MAX_M), split_keys=64, programs=2, block_n=16)
        alone = S.launch_sdpa(q[:, :, :1], k, v, torch.tensor([p]), split_keys=64, programs=2, block_n=16)
        assert torch.equal(wide[:, :, :1], alone), f"p={p} seed {seed}"


def test_a_context_far_shorter_than_the_cache_is_exact_and_call_independent(interpret, seed, monkeypatch):
    """Splits at fixed key counts: at a context of a few splits in a cache of many, a row's bits are the same alone,
    first or last of a call, beside rows many splits further on, under a valid length, over other keys past its
    position, and whichever program computes each split; and every call equals the reference. The reduce merges
    4 splits at a time here, so a row's merge runs over several blocks."""
    monkeypatch.setattr(S, "REDUCE_BLOCK", 4)
    B, Hkv, G, L, D = 1, 2, 3, 2048, 32  # a cache of 64 splits of 32 keys; contexts of 4-9 splits
    launch = dict(split_keys=32, block_n=16)
    k, v = (torch.randn(B, Hkv, L, D).to(torch.bfloat16) for _ in range(2))
    for p in (int(torch.randint(100, 280, ())), 159, 160):  # one at random; the last key of a split, the first of one
        q = model_q(B, Hkv * G, MAX_M, D)
        row = q[:, :, :1]
        alone = S.launch_sdpa(row, k, v, torch.tensor([p]), **launch)
        assert torch.equal(alone, S.launch_sdpa(row, k, v, torch.tensor([p]), programs=3, **launch)), p
        assert torch.equal(alone, S.launch_sdpa(row, k, v, torch.tensor([p]), torch.tensor([L]), **launch)), p
        calls = {"first": (q, torch.arange(p, p + MAX_M), 0),
                 "last": (q.flip(2), torch.arange(p - MAX_M + 1, p + 1), MAX_M - 1),
                 "beside far rows": (q, torch.tensor([p] + [p + 40 * i for i in range(1, MAX_M)]), 0)}
        for name, (qq, pos, i) in calls.items():
            out = S.launch_sdpa(qq, k, v, pos, **launch)
            assert torch.equal(out[:, :, i:i + 1], alone), f"{name}: p={p} seed {seed}"
            ref = S.sdpa_reference(qq.double(), k.double(), v.double(), pos)
            assert rel_err(out, ref) < 1e-2, f"{name}: p={p} seed {seed}"
        k2, v2 = k.clone(), v.clone()  # keys past p (the padding rows' slots) changed: invisible to the row
        k2[:, :, p + 1:], v2[:, :, p + 1:] = (torch.randn(B, Hkv, L - p - 1, D).to(torch.bfloat16) for _ in range(2))
        assert torch.equal(S.launch_sdpa(row, k2, v2, torch.tensor([p]), **launch), alone), f"p={p} seed {seed}"
        assert rel_err(alone, S.sdpa_reference(row.double(), k.double(), v.double(), torch.tensor([p]))) < 1e-2


@pytest.mark.parametrize("L,heads", [(4096, 8), (32768, 8), (131072, 8), (32768, 2), (600, 8), (32768, 1)])
def test_default_programs_fill_at_most_one_wave_and_no_more_than_the_splits(L, heads):
    sms, split_keys = 132, S.CONFIG["split_keys"]
    slots = S.CONFIG["programs_per_sm"] * sms
    programs = S.default_programs(L, heads, split_keys, sms)
    assert 1 <= programs <= S.split_count(L, split_keys) and programs * heads <= slots
    if S.split_count(L, split_keys) >= slots // heads:  # splits enough: the wave is full
        assert programs * heads > slots - heads


def test_split_boundaries_are_fixed_key_counts():
    assert S.CONFIG["split_keys"] % S.CONFIG["block_n"] == 0
    assert [S.split_count(L, 256) for L in (1, 256, 257, 32768)] == [1, 1, 2, 128]
    with pytest.raises(ValueError, match="multiple of block_n"):
        k = torch.randn(1, 1, 64, 16).to(torch.bfloat16)
        S.launch_sdpa(torch.randn(1, 1, 1, 16).to(torch.bfloat16), k, k, torch.tensor([3]), split_keys=40, block_n=16)


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
        for launch in ({}, dict(split_keys=128, programs=5, block_n=128, stages=2)):
            assert check(model_q(B, Hkv * G, M, D, "cuda"), k, v, q_pos, torch.tensor([4900], device="cuda"),
                         tol=4e-3, **launch), f"M={M} {launch} seed {seed}"


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_rows_are_call_independent_at_a_short_context_in_a_long_cache(seed):
    """The default launch on a 32K-key cache at a ~2K context: a row alone equals the same row in max_m-row calls
    (first, last, beside far rows), bit for bit, and every call equals the reference."""
    B, Hkv, G, L, D = 1, 3, 3, 32768, 64
    k, v = (torch.randn(B, Hkv, L, D, device="cuda").to(torch.bfloat16) for _ in range(2))
    for p in (int(torch.randint(1800, 2300, ())), 2047, 2048):
        q = model_q(B, Hkv * G, MAX_M, D, "cuda")
        alone = S.launch_sdpa(q[:, :, :1], k, v, torch.tensor([p], device="cuda"))
        calls = {"first": (q, torch.arange(p, p + MAX_M, device="cuda"), 0),
                 "last": (q.flip(2), torch.arange(p - MAX_M + 1, p + 1, device="cuda"), MAX_M - 1),
                 "beside far rows": (q, torch.tensor([p] + [p + 3000 * i for i in range(1, MAX_M)], device="cuda"), 0)}
        for name, (qq, pos, i) in calls.items():
            out = S.launch_sdpa(qq, k, v, pos)
            assert torch.equal(out[:, :, i:i + 1], alone), f"{name}: p={p} seed {seed}"
            ref = S.sdpa_reference(qq.double(), k.double(), v.double(), pos)
            assert rel_err(out, ref) < 4e-3, f"{name}: p={p} seed {seed}"
