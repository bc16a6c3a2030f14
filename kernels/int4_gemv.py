"""INT4 GEMV for M <= 4 rows on the CUDA cores: one launch, no prep kernel (prototype, issue 7)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._jit import compiled, lazy_jit


@triton.jit
def _pair(wd, PTX: tl.constexpr):
    """(wd & 0x000F000F) | 0x43004300: the bf16 pair (128 + q[s], 128 + q[s+4]) of nibbles s, s+4 (pre-shifted)."""
    if PTX:
        return tl.inline_asm_elementwise("lop3.b32 $0, $1, 0x000F000F, 0x43004300, 0xEA;", "=r,r", [wd],
                                         dtype=tl.int32, is_pure=True, pack=1)
    return (wd & 0x000F000F) | 0x43004300


@lazy_jit(do_not_specialize=["M"])
def _int4_gemv_kernel(x_ptr, w_ptr, sz_ptr, y_ptr, M, N, K, stride_xm, stride_ym,
                      GROUP: tl.constexpr, BLOCK_N: tl.constexpr, M_PAD: tl.constexpr, PTX: tl.constexpr):
    """One program: BLOCK_N columns over all of K, one group per iteration. Per word (8 weights): 3 shifts
    and 4 lop3 give four bf16 pairs 128 + q, 8 ops widen them to float32; per weight one fma makes it
    (q - z) s exactly and one fma per row of x adds it into an elementwise accumulator, reduced at the end."""
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_m = tl.arange(0, M_PAD)
    m_ok = offs_m < M
    W: tl.constexpr = GROUP // 8
    words = tl.arange(0, W)
    # element (word i, e, half h) holds k = 8 i + s + 4 h with s = 0, 2, 1, 3 for e = 0..3 (the joins' order)
    e = tl.arange(0, 4)
    kk = words[:, None, None] * 8 + ((e >> 1) | ((e & 1) << 1))[None, :, None] + tl.arange(0, 2)[None, None, :] * 4
    x_offs = offs_m[:, None, None, None, None] * stride_xm + kk[None, None] + 0 * offs_n[None, :, None, None, None]
    x_ok = m_ok[:, None, None, None, None] & (kk >= 0)[None, None] & n_ok[None, :, None, None, None]
    acc = tl.zeros((M_PAD, BLOCK_N, W, 4, 2), dtype=tl.float32)
    for g in range(0, K // GROUP):
        wd = tl.load(w_ptr + offs_n[:, None] * (K // 8) + g * W + words[None, :], mask=n_ok[:, None], other=0)
        p = tl.join(tl.join(_pair(wd, PTX), _pair(wd >> 4, PTX)), tl.join(_pair(wd >> 8, PTX), _pair(wd >> 12, PTX)))
        p = tl.reshape(p, (BLOCK_N, W, 4))  # pairs for s = 0, 1, 2, 3 (join order: (0, 1), (2, 3))
        f = tl.join(p << 16, p & -65536).to(tl.float32, bitcast=True)  # [N, W, 4, 2]: 128 + q[8 i + s + 4 h]
        sz = tl.load(sz_ptr + g * N + offs_n, mask=n_ok, other=0)
        s = (sz << 16).to(tl.float32, bitcast=True)
        c = -((sz & -65536).to(tl.float32, bitcast=True) + 128.0) * s
        wf = f * s[:, None, None, None] + c[:, None, None, None]  # (q - z) s
        x = tl.load(x_ptr + g * GROUP + x_offs, mask=x_ok, other=0.0).to(tl.float32)
        acc += wf[None] * x
    y = tl.sum(tl.reshape(acc, (M_PAD, BLOCK_N, GROUP)), axis=2)
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], y.to(tl.bfloat16),
             mask=m_ok[:, None] & n_ok[None, :])


def launch_int4_gemv(x, packed, scale_zero, group, block_n=16, warps=4, stages=4, out=None):
    M, K = x.shape
    N = packed.shape[0]
    y = out if out is not None else torch.empty((M, N), dtype=x.dtype, device=x.device)
    m_pad = max(1, triton.next_power_of_2(M))
    _int4_gemv_kernel[(triton.cdiv(N, block_n),)](x, packed.view(torch.int32), scale_zero.view(torch.int32), y, M,
                                                   N, K, x.stride(0), y.stride(0), GROUP=group, BLOCK_N=block_n,
                                                   M_PAD=m_pad, PTX=compiled(), num_warps=warps, num_stages=stages)
    return y
