"""RMSNorm, RoPE and SwiGLU kernels against the model's own code (models/layers.py), on fresh random inputs.
RoPE and SwiGLU must be bit-exact on the GPU; RMSNorm may differ by one bf16 ulp (fp32 summation order),
rarely. CPU runs use Triton's interpreter (see kernels/_jit.py), whose exp is numpy's, not torch's: there
SwiGLU may be one ulp off, rarely."""

import pytest
import torch
import torch.nn.functional as F

from kernels.norm_rope import geglu, rms_norm, rope, swiglu
from models.layers import RMSNorm, Rope, apply_rope, gelu_tanh

CUDA = torch.cuda.is_available()


def ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """bf16 ulp distance between same-signed values (int16 bit patterns are monotonic per sign)."""
    return (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()


def check_rope(B, T, H, hd, rot_factor, wider, device, scaling=None):
    table = Rope(hd, 64, 500000.0, rot_factor, scaling).to(device)
    pos = torch.randint(0, 64 - T, (1,)).item() + torch.arange(T, device=device)
    cos, sin = table.tables(pos)
    row = torch.randn(B, T, (H + wider) * hd, device=device).to(torch.bfloat16) * 3
    x = row[..., wider * hd:]  # a column slice of a wider row, as in the fused q|k|v output
    out = rope(x, cos, sin, H)
    ref = apply_rope(x.reshape(B, T, H, hd).transpose(1, 2), cos, sin)
    assert out.shape == (B, H, T, hd) and out.is_contiguous()
    assert torch.equal(out, ref), f"{(out != ref).sum().item()} of {out.numel()} differ"


def check_rms_norm(shape, device, unit_offset=False):
    D = shape[-1]
    norm = RMSNorm(D, eps=1e-5, unit_offset=unit_offset).to(device)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(D) * 0.5 + (0 if unit_offset else 1))
    norm = norm.to(torch.bfloat16)
    x = (torch.randn(*shape, device=device) * torch.rand(*shape[:-1], 1, device=device) * 4).to(torch.bfloat16)
    out, ref = rms_norm(x, norm.weight, norm.eps, unit_offset), norm(x)
    assert out.shape == x.shape and out.dtype == torch.bfloat16
    same_sign = (out.sign() == ref.sign()) | (ref == 0)
    assert same_sign.all() and ulps(out, ref).max() <= 1
    assert (out == ref).float().mean() > 0.98


def check_swiglu(T, H, device, bitwise, gelu=False):
    """gate and up as the two halves of one row, as the fused gate|up GEMM returns them; values wide enough
    that the activation meets both its tails. gelu: Gemma's GeGLU (tanh GELU) instead of SwiGLU."""
    row = (torch.randn(1, T, 2 * H, device=device) * 4).to(torch.bfloat16)
    gate, up = row[..., :H], row[..., H:]
    out, ref = (geglu(gate, up), gelu_tanh(gate) * up) if gelu else (swiglu(gate, up), F.silu(gate) * up)
    assert out.shape == ref.shape and out.is_contiguous() and out.dtype == torch.bfloat16
    if bitwise:
        assert torch.equal(out, ref), f"{(out != ref).sum().item()} of {out.numel()} differ"
    elif gelu:
        # the interpreter's tanh is built from exp; 1 + tanh cancels in GELU's negative tail, where its last
        # bits decide a value near zero: within a bf16 ulp where |gate| < 3, and absolutely small everywhere
        body = (gate.abs() < 3) & (ref != 0) & (out.sign() == ref.sign())
        assert body.float().mean() > 0.3 and ulps(out, ref)[body].max() <= 1
        assert (out.float() - ref.float()).abs().max() <= 1e-2 * ref.float().abs().max()
    else:
        same_sign = (out.sign() == ref.sign()) & (ref != 0)
        assert ulps(out, ref)[same_sign].max() <= 1 and (out == ref).float().mean() > 0.999


@pytest.mark.parametrize("T,H", [(1, 64), (3, 1500), (8, 2048)])  # H: one block, a masked second, two whole
def test_swiglu_matches_the_models_product(interpret, seed, T, H):
    check_swiglu(T, H, "cpu", bitwise=False)


@pytest.mark.parametrize("T,H", [(1, 64), (3, 1500)])
def test_geglu_matches_gemmas_product(interpret, seed, T, H):
    check_swiglu(T, H, "cpu", bitwise=False, gelu=True)


def test_swiglu_refuses_mismatched_inputs(interpret):
    x = torch.zeros(2, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="must be bf16 of one shape"):
        swiglu(x, torch.zeros(2, 4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="must be bf16 of one shape"):
        swiglu(x, x.float())


@pytest.mark.parametrize("B,T,H,hd,rot_factor,wider", [(1, 1, 4, 16, 1.0, 0), (2, 3, 5, 32, 1.0, 2),
                                                        (1, 4, 9, 16, 0.5, 3), (2, 2, 3, 64, 0.25, 1)])
def test_rope_equals_the_models_rope(interpret, seed, B, T, H, hd, rot_factor, wider):
    check_rope(B, T, H, hd, rot_factor, wider, "cpu")


def test_rope_with_llama3_scaled_tables(interpret, seed):
    check_rope(1, 5, 4, 32, 1.0, 1, "cpu", scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                                         high_freq_factor=4.0, original_max_position_embeddings=16))


@pytest.mark.parametrize("shape", [(1, 1, 64), (2, 3, 96), (7, 256)])
def test_rms_norm_matches_the_models_norm(interpret, seed, shape):
    check_rms_norm(shape, "cpu")
    check_rms_norm(shape, "cpu", unit_offset=True)


def test_rope_refuses_shapes_it_cannot_map(interpret):
    cos = sin = torch.ones(2, 16)
    with pytest.raises(ValueError, match=r"must be \[B, T, 3 \* head_dim\]"):
        rope(torch.zeros(1, 2, 50, dtype=torch.bfloat16), cos, sin, 3)
    with pytest.raises(ValueError, match="head_dim 24 must be a power of 2"):
        rope(torch.zeros(1, 2, 48, dtype=torch.bfloat16), cos, sin, 2)


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_matches_the_models_modules(seed):
    for B, T, H, hd, rot_factor, wider in ((1, 1, 32, 128, 1.0, 0), (1, 8, 8, 128, 1.0, 32), (2, 3, 5, 64, 0.5, 1)):
        check_rope(B, T, H, hd, rot_factor, wider, "cuda")
    for shape in ((1, 1, 4096), (1, 8, 4096), (3, 5000)):
        check_rms_norm(shape, "cuda")
        check_rms_norm(shape, "cuda", unit_offset=True)
    for T, H in ((1, 14336), (8, 14336), (3, 1500)):
        check_swiglu(T, H, "cuda", bitwise=True)
        check_swiglu(T, H, "cuda", bitwise=True, gelu=True)
