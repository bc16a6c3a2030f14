"""Temporary (call 134): what bench/_old_int4_gluon.py, a copy of a97837f's kernels/int4_gluon.py, takes from
int4_gemm: a97837f's prep kernel (bf16, its M_OUT and strides), the PDL switch and the split-K counters."""

import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kernels._jit import lazy_jit
from kernels.int4_gemm import USE_PDL, counters  # noqa: F401


@lazy_jit(do_not_specialize=["M", "M_OUT"])
def _int4_prep_kernel(x_ptr, xp_ptr, xs_ptr, M, M_OUT, K, stride_xm, stride_xs_m, stride_xs_g,
                      GROUP: tl.constexpr, BLOCK_M: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    g = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    cols = tl.arange(0, GROUP)
    x = tl.load(x_ptr + offs_m[:, None] * stride_xm + g * GROUP + cols[None, :], mask=m_ok[:, None], other=0.0)
    tl.store(xs_ptr + offs_m * stride_xs_m + g * stride_xs_g, tl.sum(x.to(tl.float32), axis=1))
    x = tl.reshape(tl.permute(tl.reshape(x, (BLOCK_M, 4, GROUP // 32, 2, 4)), (0, 2, 4, 1, 3)), (BLOCK_M, GROUP))
    tl.store(xp_ptr + offs_m[:, None] * K + g * GROUP + cols[None, :], x, mask=(offs_m < M_OUT)[:, None])
