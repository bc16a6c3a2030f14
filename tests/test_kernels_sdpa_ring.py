"""sdpa_midm on a ring cache (models.target: position p in slot p % L, `slot_pos` the position each slot holds):
after several wraps a row gives the bits of the flat cache the ring stands for and of every other call it could be
in (alone, first or last of max_m rows, beside a rejected window's stale slots), and equals the reference; through
kernels.transform a windowed target on rings gives the logits of the same target on flat caches bit for bit.
CPU runs use Triton's interpreter (kernels/_jit.py)."""

import copy
import dataclasses

import pytest
import torch

from kernels import dispatch
from kernels import sdpa_midm as S
from kernels.transform import to_kernels
from models.config import TargetConfig
from models.target import Transformer

MAX_M = 8
WINDOW, SLACK = 40, 8  # a ring of window + max_t slots, as models.target sizes it
L = WINDOW + SLACK
LAUNCH = dict(split_keys=32, block_n=16)  # windows across 2-3 splits, splits across the ring's wrap


def rel_err(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def model_q(B, Hq, M, D):
    """q as the model makes it: a [B, Hq, M, D] view of a [B, M, Hq, D] buffer."""
    return torch.randn(B, M, Hq, D).to(torch.bfloat16).transpose(1, 2)


def ring_of(kf, vf, through: int, stale: int = 0):
    """(k, v, slot_pos) of a ring of L slots after positions 0..through were written from the flat kf/vf
    [B, Hkv, positions, D], and `stale` positions past `through` by a window since rejected (other keys): each slot
    holds the last position written there."""
    k = torch.zeros(*kf.shape[:2], L, kf.shape[3], dtype=kf.dtype)
    v, slot_pos = torch.zeros_like(k), torch.full((L,), -1, dtype=torch.long)
    for p in range(through + stale + 1):
        new = p > through
        k[:, :, p % L] = torch.randn_like(kf[:, :, p]) if new else kf[:, :, p]
        v[:, :, p % L] = torch.randn_like(vf[:, :, p]) if new else vf[:, :, p]
        slot_pos[p % L] = p
    return k, v, slot_pos


def test_a_wrapped_ring_gives_the_flat_caches_bits_and_the_reference(interpret, seed, monkeypatch):
    """Rows of every width at positions where the window crosses the ring's wrap and the splits' boundaries, several
    wraps in: bit for bit the rows over the flat cache (same positions, splits and order), and the reference.
    (The reduce merges 2 splits at a time in both, so its blocks do not depend on the caches' lengths.)"""
    monkeypatch.setattr(S, "REDUCE_BLOCK", 2)
    B, Hkv, G, D, N = 1, 2, 2, 16, 256
    kf, vf = (torch.randn(B, Hkv, N, D).to(torch.bfloat16) for _ in range(2))
    starts = [95, 141, 190, int(torch.randint(L, N - MAX_M, ()))]  # 141: window across the wrap at 144
    for M, P in zip((1, 3, 8, int(torch.randint(1, MAX_M + 1, ()))), starts):
        q, pos = model_q(B, Hkv * G, M, D), torch.arange(P, P + M)
        k, v, slot_pos = ring_of(kf, vf, P + M - 1)
        ring = S.launch_sdpa(q, k, v, pos, window=WINDOW, k_pos=slot_pos, **LAUNCH)
        flat = S.launch_sdpa(q, kf, vf, pos, window=WINDOW, **LAUNCH)
        assert torch.equal(ring, flat), f"M={M} P={P} seed {seed}"
        ref = S.sdpa_reference(q.double(), k.double(), v.double(), pos, window=WINDOW, k_pos=slot_pos)
        assert rel_err(ring, ref) < 1e-2, f"M={M} P={P} seed {seed}"
        assert rel_err(ref, S.sdpa_reference(q.double(), kf.double(), vf.double(), pos, window=WINDOW)) < 1e-6  # (fp32 sums)


def test_a_ring_rows_bits_do_not_depend_on_its_call(interpret, seed):
    """The exact mode's premise on a ring: a row at p gives the same bits alone (the ring written through p), first
    of max_m rows (through p + 7: the slots of 8 older positions hold newer ones), last of max_m rows, over the
    stale slots of a rejected window past p, and whichever program computes each split."""
    B, Hkv, G, D, N = 1, 2, 3, 16, 256
    kf, vf = (torch.randn(B, Hkv, N, D).to(torch.bfloat16) for _ in range(2))
    for p in (127, 128, 143, 144, int(torch.randint(L, N - MAX_M, ()))):  # split boundaries; the wrap at 144
        q = model_q(B, Hkv * G, MAX_M, D)
        row = q[:, :, :1]

        def call(qq, pos, through, stale=0, **launch):
            k, v, slot_pos = ring_of(kf, vf, through, stale)
            return S.launch_sdpa(qq, k, v, pos, window=WINDOW, k_pos=slot_pos, **{**LAUNCH, **launch})

        alone = call(row, torch.tensor([p]), p)
        assert torch.equal(call(q, torch.arange(p, p + MAX_M), p + MAX_M - 1)[:, :, :1], alone), f"first: p={p}"
        assert torch.equal(call(q.flip(2), torch.arange(p - MAX_M + 1, p + 1), p)[:, :, -1:], alone), f"last: p={p}"
        assert torch.equal(call(row, torch.tensor([p]), p, stale=5), alone), f"stale: p={p} seed {seed}"
        assert torch.equal(call(row, torch.tensor([p]), p, programs=1), alone), f"one program: p={p} seed {seed}"


def test_dispatch_takes_rings_on_both_sides_of_max_m(interpret, seed):
    B, Hkv, G, D = 1, 2, 2, 16
    kf, vf = (torch.randn(B, Hkv, 200, D).to(torch.bfloat16) for _ in range(2))
    k, v, slot_pos = ring_of(kf, vf, 150)
    for M in (3, 6):  # the kernel at max_m = 4, torch's SDPA over the ring's mask above
        q, pos = model_q(B, Hkv * G, M, D), torch.arange(151 - M, 151)
        out = dispatch.attention(q, k, v, pos, 4, WINDOW, k_pos=slot_pos)
        ref = S.sdpa_reference(q.double(), kf.double(), vf.double(), pos, window=WINDOW)
        assert rel_err(out, ref) < 1e-2, f"M={M} seed {seed}"


def test_a_ring_without_its_window_or_slot_positions_is_refused():
    k = torch.zeros(1, 1, L, 16).to(torch.bfloat16)
    q = torch.zeros(1, 1, 1, 16).to(torch.bfloat16)
    with pytest.raises(ValueError, match="window of 1 to L"):
        S.launch_sdpa(q, k, k, torch.tensor([3]), k_pos=torch.zeros(L, dtype=torch.long))
    with pytest.raises(ValueError, match=r"k_pos \[L=48\]"):
        S.launch_sdpa(q, k, k, torch.tensor([3]), window=WINDOW, k_pos=torch.zeros(L + 1, dtype=torch.long))


GEMMA = TargetConfig(vocab_size=256, hidden_size=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                     intermediate_size=128, max_seq_len=64, sliding_window=[8, None], norm_unit_offset=True,
                     output_norms=True, qk_norm=True, hidden_act="gelu_pytorch_tanh", attn_scale=0.2,
                     rope_local_theta=10000.0, rope_theta=1e6)


@torch.no_grad()
def test_a_target_on_rings_gives_the_logits_of_its_flat_caches_through_the_kernels(interpret, monkeypatch):
    """kernels.transform on a Gemma-3-like target whose windowed layer holds a ring of 8 + 8 slots (set up before
    the transform, as runner.cuda_engine does): every call of 1-4 rows (the kernel's side of max_m = 4) over 50
    positions, the ring wrapped three times and a rejected window rewritten, gives the flat-cache model's logits
    bit for bit, and a call of 8 rows (torch's SDPA over the ring's mask) its logits within bf16 noise. Linears
    stay bf16 (the INT4 GEMM is not what is tested); splits hold 8 positions."""
    monkeypatch.setitem(S.CONFIG, "split_keys", 8)
    monkeypatch.setitem(S.CONFIG, "block_n", 8)
    monkeypatch.setattr(S, "REDUCE_BLOCK", 2)
    torch.manual_seed(0)
    flat = Transformer(GEMMA).to(torch.bfloat16).eval()
    ring = copy.deepcopy(flat)
    ring.setup_cache(max_t=8)
    assert [layer.self_attn.k_cache.shape[2] for layer in ring.layers] == [16, 64]
    dense = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")
    flat, ring = (to_kernels(m, max_m=4, fuse=False, norm_rope=False, dense=dense) for m in (flat, ring))
    tokens = torch.randint(0, 256, (1, 64), generator=torch.Generator().manual_seed(1))
    pos = 0
    for T in (4, 1, 3, 2, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4):  # 50 positions
        args = (tokens[:, pos:pos + T], torch.arange(pos, pos + T))
        assert torch.equal(ring(*args), flat(*args)), f"T={T} at {pos}"
        pos += T
    pos -= 3  # a verify window after a rejection: other tokens at the last 3 positions
    args = (tokens[:, pos:pos + 4].flip(1), torch.arange(pos, pos + 4))
    assert torch.equal(ring(*args), flat(*args))
    args = (tokens[:, pos:pos + 8], torch.arange(pos, pos + 8))
    assert rel_err(ring(*args), flat(*args)) < 1e-2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_ring_of_gemma3s_shape_is_call_independent_and_gives_the_flat_bits(seed, monkeypatch):
    """Gemma 3 270M's sliding layers at the default launch: window 512 + 128 slots, 4 query heads on one KV head of
    256, several wraps in. A row alone equals the same row first and last of 8-row calls and over a rejected
    window's slots, bit for bit; every call equals the reference, and the flat cache's bits where the reduce
    merges as many splits at a time in both."""
    B, Hkv, G, D, N, window = 1, 1, 4, 256, 4096, 512
    ring_len = window + 128
    kf, vf = (torch.randn(B, Hkv, N, D, device="cuda").to(torch.bfloat16) for _ in range(2))

    def ring(through, stale=0):
        positions = torch.arange(through + stale + 1, device="cuda")[-ring_len:]
        slots = positions % ring_len
        k, v = kf.clone()[:, :, :ring_len], vf.clone()[:, :, :ring_len]
        k[:, :, slots], v[:, :, slots] = kf[:, :, positions], vf[:, :, positions]
        new = slots[positions > through]
        k[:, :, new], v[:, :, new] = (torch.randn_like(k[:, :, new]) for _ in range(2))
        slot_pos = torch.full((ring_len,), -1, dtype=torch.long, device="cuda")
        slot_pos[slots] = positions
        return k, v, slot_pos

    for p in (int(torch.randint(ring_len, N - MAX_M, ())), 1279, 1280, 2559, 3 * ring_len):
        q = model_q(B, Hkv * G, MAX_M, D).cuda()
        k, v, slot_pos = ring(p)
        alone = S.launch_sdpa(q[:, :, :1], k, v, torch.tensor([p], device="cuda"), window=window, k_pos=slot_pos)
        calls = {"first": (q, torch.arange(p, p + MAX_M, device="cuda"), 0, p + MAX_M - 1, 0),
                 "last": (q.flip(2), torch.arange(p - MAX_M + 1, p + 1, device="cuda"), MAX_M - 1, p, 0),
                 "stale": (q[:, :, :1], torch.tensor([p], device="cuda"), 0, p, 5)}
        for name, (qq, pos, i, through, stale) in calls.items():
            k, v, slot_pos = ring(through, stale)
            out = S.launch_sdpa(qq, k, v, pos, window=window, k_pos=slot_pos)
            assert torch.equal(out[:, :, i:i + 1], alone), f"{name}: p={p} seed {seed}"
            if not stale:
                with monkeypatch.context() as m:
                    m.setattr(S, "REDUCE_BLOCK", 2)
                    assert torch.equal(S.launch_sdpa(qq, k, v, pos, window=window, k_pos=slot_pos),
                                       S.launch_sdpa(qq, kf, vf, pos, window=window)), f"{name}: p={p} seed {seed}"
            ref = S.sdpa_reference(qq.double(), k.double(), v.double(), pos, window=window, k_pos=slot_pos)
            assert rel_err(out, ref) < 4e-3, f"{name}: p={p} seed {seed}"
