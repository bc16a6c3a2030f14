"""The dispatch rule applied: calls of M <= max_m rows run on the small-M kernels, larger ones on the dense path.

The rule itself (`use_small_m`, and why max_m bounds every call site's shape range; `int4_path`, which INT4 GEMM
serves a shape) is kernels/rule.py, free of torch so that the export path can apply it alone; docs/design.md §5.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.int4_gemm import int4_mm, tinygemm_mm
from kernels.rule import int4_path, use_small_m
from kernels.sdpa_midm import sdpa_midm, visible
from models.quantize import dequantize_w4


def int4_matmul(x2: torch.Tensor, packed, scale_zero, group: int, tinygemm=None) -> torch.Tensor:
    """x2 [M, K] bf16 (M <= the kernels' row limit) -> [M, N] on the faster INT4 GEMM for the shape
    (rule.int4_path): ours, or torch's on `tinygemm` (int4_gemm.to_tinygemm of the same weights), which a
    caller whose shape takes torch's at some M must pass."""
    M, K = x2.shape
    if int4_path(K, packed.shape[0], group, M) == "torch":
        if tinygemm is None:
            raise ValueError(f"int4_matmul: [{M}, {K}] x [{K}, {packed.shape[0]}] group {group} takes torch's int4 "
                             f"GEMM (kernels.rule.TORCH_INT4), which needs the weights in its layout (tinygemm)")
        return tinygemm_mm(x2, *tinygemm, group)
    return int4_mm(x2, packed, scale_zero, group)


def int4_linear(x: torch.Tensor, packed, scale_zero, group: int, max_m: int, bias=None,
                tinygemm=None) -> torch.Tensor:
    """x [..., K] bf16 -> [..., N]: the faster INT4 GEMM when the rows fit (int4_matmul); wider calls (the
    prompt's) on torch's int4 GEMM where the layer keeps its layout (one launch at any M), else dequantise +
    dense matmul (about ten eager launches a layer, which made an INT4 prompt slower than a bf16 one)."""
    if x.dtype != torch.bfloat16:
        raise ValueError(f"int4_linear takes bfloat16 activations; got {x.dtype}")
    x2 = x.reshape(-1, x.shape[-1])
    if use_small_m(x2.shape[0], max_m):
        y = int4_matmul(x2, packed, scale_zero, group, tinygemm)
    elif tinygemm is not None:
        y = tinygemm_mm(x2, *tinygemm, group)
    else:
        y = x2 @ dequantize_w4(packed, scale_zero, group, x.dtype).t()
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], packed.shape[0])


def attention(q, k, v, q_pos, max_m: int, window: int = 0, scale: float | None = None, valid_len=None, k_pos=None):
    """q [B,Hq,M,D] over the cache k/v [B,Hkv,L,D] under key <= q_pos (and window, valid_len); a ring cache with
    k_pos [L], the position each slot holds (kernels.sdpa_midm)."""
    if use_small_m(q.shape[2], max_m):
        return sdpa_midm(q, k, v, q_pos, valid_len, window, scale, k_pos)
    mask = visible(q_pos, k.shape[2], valid_len, window, k_pos)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
