"""RMSNorm, RoPE and the gated MLP product (SwiGLU, GeGLU) in one launch each, equal to the model's own math (models/layers.py).

Why: a cached Llama-class forward at T <= max_m is ~3000 kernel launches (Llama-3-8B shapes), and at these
sizes an elementwise kernel costs its launch and drain, not its bytes. The model's RMSNorm is 7 torch
kernels (float, pow, mean, add, rsqrt, mul, cast + the weight product) and RoPE on q and k 14 (two table
casts, two products, neg, cat and an add per tensor): 28 of the ~93 launches per layer, all replaced here
by 4. The SwiGLU product `silu(gate) * up` is 2 more (silu, mul); as one launch that lets the next kernel
start at its own start, it also lets the down projection's GEMM begin during it (kernels._jit). Measured on the
H200: docs/results.md.

Equality: every rounding torch does in bf16 is repeated. RoPE rounds cos/sin to x's dtype, then x * cos and
rotate_half(x) * sin each to bf16, then their sum (compiled without FMA contraction, `enable_fp_fusion`
off: with it, Triton 3.6 turns product-then-add into one bf16 fma and 1 value in 5 differs on the H200);
RMSNorm rounds the normalised row to x's dtype before the weight product. What may differ is RMSNorm's
fp32 sum of squares (summation order) and rsqrt's last bit, so a normalised value can land one bf16 ulp
away (tests bound it); RoPE is exact. SwiGLU rounds silu(gate) to bf16 before the product, as torch does,
and computes silu as torch's CUDA kernel does (x / (1 + expf(-x)), IEEE division; libdevice's expf is CUDA's):
exact on the GPU; the CPU interpreter's exp may differ from torch's CPU exp in the last fp32 bit.

  rms_norm(x [..., D], weight [D], eps) -> [..., D]       (x and weight bf16)
  rope(x [B, T, H*hd], cos, sin [T, rot], n_heads) -> [B, H, T, hd] contiguous, i.e. the model's
      `apply_rope(x.view(B, T, H, hd).transpose(1, 2), cos, sin)` (channels >= rot pass through);
      x may be a column slice of a wider row (the fused q|k|v output): only its last dim must be contiguous.
  swiglu(gate [..., H], up [..., H]) -> [..., H] contiguous, the model's `F.silu(gate) * up` (bf16; gate and up
      may be column slices of the fused gate|up output); geglu the same with Gemma's `gelu_tanh(gate) * up`.
  rms_norm(..., unit_offset=True) is Gemma's (1 + w) norm: normalised and scaled in fp32, cast once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from triton.language.extra.cuda import gdc_launch_dependents, libdevice

from kernels._jit import compiled, lazy_jit, note_launch, pdl_capable
from models.layers import SQRT_2_OVER_PI

ROPE_HEADS = 8  # heads per RoPE program
GELU_C = tl.constexpr(SQRT_2_OVER_PI)  # the model's constant, as a value the kernels may read
SWIGLU_BLOCK = 1024  # columns per SwiGLU program


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] as [rows, D] with a unit column stride (a view where the rows allow it)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _compile_options() -> dict:
    """No multiply-add contraction, so each product is rounded where torch rounds it (GPU only: the
    interpreter computes each op as written)."""
    return {"enable_fp_fusion": False} if compiled() else {}


@lazy_jit
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, stride_x, stride_y, D, inv_d, eps, BLOCK_D: tl.constexpr,
                     TRIGGER: tl.constexpr, UNIT_OFFSET: tl.constexpr):
    if TRIGGER:
        gdc_launch_dependents()  # the next GEMM's programs may start now (they wait for this grid's writes)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    ok = cols < D
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    inv_rms = 1.0 / tl.sqrt_rn(tl.sum(x * x, axis=0) * inv_d + eps)  # torch: mean = sum * (1 / D)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    if UNIT_OFFSET:  # Gemma: scale by (1 + w) in float32, then cast
        y = (x * inv_rms) * (1.0 + w)
    else:  # Llama: cast the normalised row back, then scale by w
        y = w * (x * inv_rms).to(y_ptr.dtype.element_ty).to(tl.float32)
    tl.store(y_ptr + row * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=ok)


@lazy_jit(do_not_specialize=["T"])
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, y_ptr, T, H, stride_xb, stride_xt, stride_c, stride_s,
                 HD: tl.constexpr, ROT: tl.constexpr, BLOCK_H: tl.constexpr):
    bt = tl.program_id(0)
    b, t = bt // T, bt % T
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    cols = tl.arange(0, HD)
    h_ok = heads[:, None] < H
    rot = cols < ROT
    first_half = cols < ROT // 2
    row = x_ptr + b * stride_xb + t * stride_xt + heads[:, None] * HD
    x = tl.load(row + cols[None, :], mask=h_ok, other=0.0)
    dt = x.dtype
    # rotate_half: column c < ROT/2 pairs with -x[c + ROT/2], column c in [ROT/2, ROT) with x[c - ROT/2]
    partner = tl.where(first_half, cols + ROT // 2, cols - ROT // 2)
    p = tl.load(row + partner[None, :], mask=h_ok & rot[None, :], other=0.0).to(tl.float32)
    p = tl.where(first_half[None, :], -p, p)
    c = tl.load(cos_ptr + t * stride_c + cols, mask=rot, other=1.0).to(dt).to(tl.float32)
    s = tl.load(sin_ptr + t * stride_s + cols, mask=rot, other=0.0).to(dt).to(tl.float32)
    xf = x.to(tl.float32)
    rotated = ((xf * c[None, :]).to(dt).to(tl.float32) + (p * s[None, :]).to(dt).to(tl.float32)).to(dt)
    y = tl.where(rot[None, :], rotated, x)
    out = y_ptr + ((b * H + heads[:, None]) * T + t) * HD + cols[None, :]  # [B, H, T, HD] contiguous
    tl.store(out, y, mask=h_ok)


@lazy_jit
def _glu_kernel(g_ptr, u_ptr, y_ptr, stride_g, stride_u, H, BLOCK: tl.constexpr, TRIGGER: tl.constexpr,
                EXPF: tl.constexpr, GELU: tl.constexpr):
    if TRIGGER:
        gdc_launch_dependents()  # the down projection's programs may start now (they wait for this grid's writes)
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < H
    g = tl.load(g_ptr + row * stride_g + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * stride_u + cols, mask=ok, other=0.0).to(tl.float32)
    if GELU:  # models.layers.gelu_tanh, operation by operation
        inner = GELU_C * (g + 0.044715 * (g * g * g))
        if EXPF:
            t = libdevice.tanh(inner)  # CUDA's tanhf, as torch's tanh kernel calls it
        else:
            e = tl.exp(-2.0 * tl.abs(inner))  # (the interpreter has no libdevice; no overflow this way)
            t = tl.where(inner < 0, -1.0, 1.0) * (1.0 - e) / (1.0 + e)
        act = (0.5 * g) * (1.0 + t)
    else:
        if EXPF:
            e = libdevice.exp(-g)  # CUDA's expf, as torch's silu kernel calls it (tl.exp is ex2.approx based)
        else:
            e = tl.exp(-g)  # (the interpreter has no libdevice; its exp is numpy's)
        act = tl.math.div_rn(g, 1.0 + e)
    act = act.to(y_ptr.dtype.element_ty).to(tl.float32)  # the model rounds act(gate) to bf16 before the product
    tl.store(y_ptr + row * H + cols, (act * u).to(y_ptr.dtype.element_ty), mask=ok)


@torch.library.triton_op("eagle3::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False) -> torch.Tensor:
    """The model's RMSNorm of x [..., D] (bf16) with weight [D] (bf16), one launch; `unit_offset`: Gemma's."""
    D = x.shape[-1]
    x2 = _rows(x)
    y = torch.empty((x2.shape[0], D), dtype=x.dtype, device=x.device)
    block = triton.next_power_of_2(D)
    trigger = pdl_capable(x.device)
    _rms_norm_kernel[(x2.shape[0],)](x2, weight, y, x2.stride(0), y.stride(0), D, 1.0 / D, eps, BLOCK_D=block,
                                     TRIGGER=trigger, UNIT_OFFSET=bool(unit_offset),
                                     num_warps=min(16, max(1, block // 256)), **_compile_options())
    note_launch(x.device, trigger)
    return y.reshape(x.shape)


@rms_norm.register_fake
def _(x, weight, eps, unit_offset=False):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.triton_op("eagle3::rope", mutates_args=())
def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The model's RoPE of x [B, T, n_heads * hd] (last dim contiguous) -> [B, n_heads, T, hd] contiguous."""
    B, T, width = x.shape
    hd = width // n_heads
    rot = cos.shape[-1]
    if width != n_heads * hd or x.stride(-1) != 1 or cos.stride(-1) != 1 or sin.stride(-1) != 1:
        raise ValueError(f"rope: x {tuple(x.shape)} must be [B, T, {n_heads} * head_dim] with contiguous "
                         f"rows of heads, and cos/sin contiguous in their last dim")
    if hd & (hd - 1) or rot % 2 or rot > hd:
        raise ValueError(f"rope: head_dim {hd} must be a power of 2 and rot_dim {rot} even and <= head_dim")
    y = torch.empty((B, n_heads, T, hd), dtype=x.dtype, device=x.device)
    _rope_kernel[(B * T, triton.cdiv(n_heads, ROPE_HEADS))](
        x, cos, sin, y, T, n_heads, x.stride(0), x.stride(1), cos.stride(0), sin.stride(0),
        HD=hd, ROT=rot, BLOCK_H=ROPE_HEADS, num_warps=4, **_compile_options())
    note_launch(x.device, False)
    return y


@rope.register_fake
def _(x, cos, sin, n_heads):
    B, T, width = x.shape
    return x.new_empty((B, n_heads, T, width // n_heads))


def _glu(gate: torch.Tensor, up: torch.Tensor, gelu: bool, name: str) -> torch.Tensor:
    if gate.shape != up.shape or gate.dtype != torch.bfloat16 or up.dtype != torch.bfloat16:
        raise ValueError(f"{name}: gate {tuple(gate.shape)} {gate.dtype} and up {tuple(up.shape)} {up.dtype} must "
                         f"be bf16 of one shape")
    H = gate.shape[-1]
    g2, u2 = _rows(gate), _rows(up)
    y = torch.empty((g2.shape[0], H), dtype=gate.dtype, device=gate.device)
    trigger = pdl_capable(gate.device)
    _glu_kernel[(g2.shape[0], triton.cdiv(H, SWIGLU_BLOCK))](
        g2, u2, y, g2.stride(0), u2.stride(0), H, BLOCK=SWIGLU_BLOCK, TRIGGER=trigger, EXPF=compiled(), GELU=gelu,
        num_warps=4, **_compile_options())
    note_launch(gate.device, trigger)
    return y.reshape(gate.shape)


@torch.library.triton_op("eagle3::swiglu", mutates_args=())
def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The model's `F.silu(gate) * up` for bf16 gate and up [..., H] (rows may be strided), one launch."""
    return _glu(gate, up, False, "swiglu")


@torch.library.triton_op("eagle3::geglu", mutates_args=())
def geglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The model's `gelu_tanh(gate) * up` (Gemma's MLP) for bf16 gate and up [..., H], one launch."""
    return _glu(gate, up, True, "geglu")


def _glu_fake(gate, up):
    return torch.empty_like(gate, memory_format=torch.contiguous_format)


swiglu.register_fake(_glu_fake)
geglu.register_fake(_glu_fake)
