"""Temporary trial (fourteenth session): the prep path of kernels/int4_gluon.py with fp16 operands, so that the
unpack is one shift and four lop3 a word instead of three shifts and four lop3 (bench/NOTES.md, the sixth
session's list and item 28's call 110).

fp16 has 10 mantissa bits: `w & 0x000F000F | 0x64006400` is (1024 + q) for the nibbles at bits 0-3 of each
half, and `w & 0x00F000F0 | 0x64006400` is (1024 + 16 q) for those at bits 4-7, so only the shift by 8 is left.
Nibble s of a word is natural k = 8 w + s + 4 half, so the bits 4-7 nibbles (s odd) are the odd k. The prep
kernel therefore writes, per row m and group g, x scaled by a power of 2 r (max |x r| in [2^14, 2^15), so fp16
neither overflows nor loses bf16's bits), its odd k divided by 16 more, and the sums the epilogue needs:
  P = sum_k x'_k w'_k = r sum_k x_k q_k + 1024 Sl + 64 Sh   (Sl, Sh: sums of x r over even, odd k)
  r sum_k x_k (q_k - z) = P - C - z X,   C = 1024 Sl + 64 Sh,  X = Sl + Sh
so y += s / r * (P - C - z X). The X buffer's 32 floats a group hold C (rows 0-7), X (8-15) and 1/r (16-23):
BLOCK_M = 8 only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kernels import int4_gemm
from kernels import int4_gluon as G
from kernels._jit import last_launch_triggers, note_launch

BLOCK_M = 8


@triton.jit
def _prep16_kernel(x_ptr, xp_ptr, xs_ptr, M, K, stride_xm, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
                   XS: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    g = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, GROUP)
    x = tl.load(x_ptr + offs_m[:, None] * stride_xm + g * GROUP + cols[None, :], mask=(offs_m < M)[:, None],
                other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    e = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF  # biased exponent of the row's max
    er = tl.minimum(tl.maximum(127 + 14 + 127 - e, 1), 253)  # r = 2^(14 - (e - 127)), clamped to normals
    r = (er << 23).to(tl.float32, bitcast=True)[:, None]
    rinv = ((254 - er) << 23).to(tl.float32, bitcast=True)
    odd = (cols % 2 == 1)[None, :]
    xh = tl.where(odd, x * r * 0.0625, x * r).to(tl.float16)
    xf = xh.to(tl.float32)
    sl = tl.sum(tl.where(odd, 0.0, xf), axis=1)
    sh = tl.sum(tl.where(odd, xf * 16.0, 0.0), axis=1)
    tl.store(xs_ptr + g * XS + offs_m, 1024.0 * sl + 64.0 * sh)
    tl.store(xs_ptr + g * XS + BLOCK_M + offs_m, sl + sh)
    tl.store(xs_ptr + g * XS + 2 * BLOCK_M + offs_m, rinv)
    xh = tl.reshape(tl.permute(tl.reshape(xh, (BLOCK_M, 4, GROUP // 32, 2, 4)), (0, 2, 4, 1, 3)), (BLOCK_M, GROUP))
    tl.store(xp_ptr + offs_m[:, None] * K + g * GROUP + cols[None, :], xh)


@gluon.jit
def _unpack16(wd, s: gl.constexpr):
    """Nibbles s and s+4 of each word -> the fp16 pair (1024 + q) (s even) or (1024 + 16 q) (s odd)."""
    v = wd >> 8 if s >= 2 else wd
    if s % 2 == 1:
        return gl.inline_asm_elementwise("lop3.b32 $0, $1, 0x00F000F0, 0x64006400, 0xEA;", "=r,r", [v],
                                         dtype=gl.int32, is_pure=True, pack=1)
    else:
        return gl.inline_asm_elementwise("lop3.b32 $0, $1, 0x000F000F, 0x64006400, 0xEA;", "=r,r", [v],
                                         dtype=gl.int32, is_pure=True, pack=1)


@gluon.jit
def _a_operand16(wd, BLOCK_N: gl.constexpr, GROUP: gl.constexpr, a_l: gl.constexpr):
    W: gl.constexpr = GROUP // 8
    o = gl.join(gl.join(_unpack16(wd, 0), _unpack16(wd, 2)), gl.join(_unpack16(wd, 1), _unpack16(wd, 3)))
    o = gl.join((o & 0xFFFF).to(gl.int16), (o >> 16).to(gl.int16))
    o = gl.permute(gl.reshape(o, [BLOCK_N, 4, W // 4, 2, 2, 2]), [0, 2, 3, 4, 1, 5])
    w = gl.reshape(o, [BLOCK_N, GROUP]).to(gl.float16, bitcast=True)
    return gl.convert_layout(w, a_l, assert_trivial=True)


@gluon.jit
def _consumer16(full, empty, w_smem, x_smem, sz_smem, xs_smem, n_g, GROUP: gl.constexpr, STAGES: gl.constexpr,
                BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr):
    W: gl.constexpr = GROUP // 8
    words: gl.constexpr = gl.DistributedLinearLayout(reg_bases=[[0, 1], [0, 2], [8, 0]],
                                                     lane_bases=[[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]],
                                                     warp_bases=[[16, 0], [32, 0]], block_bases=[],
                                                     shape=[BLOCK_N, W])
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_M, 16])
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, mma)
    acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, mma)
    for g in range(n_g):
        st = g % STAGES
        mbarrier.wait(full.index(st), (g // STAGES) & 1)
        w = _a_operand16(w_smem.index(st).load(words), BLOCK_N, GROUP, a_l)
        sz = sz_smem.index(st).reshape([BLOCK_N]).load(gl.SliceLayout(1, mma))
        xs = xs_smem.index(st).reshape([xs_smem.type.shape[2]])
        c = xs.slice(0, BLOCK_M).load(gl.SliceLayout(0, mma))
        x_sum = xs.slice(BLOCK_M, BLOCK_M).load(gl.SliceLayout(0, mma))
        rinv = xs.slice(2 * BLOCK_M, BLOCK_M).load(gl.SliceLayout(0, mma))
        s = (sz << 16).to(gl.float32, bitcast=True)
        z = (sz & -65536).to(gl.float32, bitcast=True)
        zx = c[None, :] + z[:, None] * x_sum[None, :]
        sr = s[:, None] * rinv[None, :]
        part = warpgroup_mma(w, x_smem.index(st).permute((1, 0)), zero, use_acc=False, is_async=True)
        part, w = warpgroup_mma_wait(0, deps=(part, w))
        mbarrier.arrive(empty.index(st), count=1)
        acc = acc + sr * (part - zx)
    return (acc,)


@gluon.jit
def _kernel16(w_desc, x_desc, sz_desc, xs_desc, y_ptr, ws_ptr, cnt_ptr, M, N, K, stride_ym,
              GROUP: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, SPLIT_K: gl.constexpr,
              STAGES: gl.constexpr, REGS: gl.constexpr, PDL: gl.constexpr, X_LAYOUT: gl.constexpr,
              TRIGGER: gl.constexpr):
    W: gl.constexpr = GROUP // 8
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_M, 16])
    if TRIGGER:
        G._gdc_launch()
    pid_n = gl.program_id(0)
    pid_k = gl.program_id(1)
    n0 = pid_n * BLOCK_N
    n_g = (K // GROUP) // SPLIT_K
    g0 = pid_k * n_g
    w_smem = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_N, W], w_desc.layout)
    x_smem = gl.allocate_shared_memory(gl.float16, [STAGES, BLOCK_M, GROUP], X_LAYOUT)
    sz_smem = gl.allocate_shared_memory(gl.int32, [STAGES, 1, BLOCK_N], sz_desc.layout)
    xs_smem = gl.allocate_shared_memory(gl.float32, [STAGES, 1, G.XS_WIDTH], sz_desc.layout)
    full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(full.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    acc, = gl.warp_specialize([
        (_consumer16, (full, empty, w_smem, x_smem, sz_smem, xs_smem, n_g, GROUP, STAGES, BLOCK_N, BLOCK_M)),
        (G._producer, (w_desc, x_desc, sz_desc, xs_desc, full, empty, w_smem, x_smem, sz_smem, xs_smem, n0, g0,
                       n_g, PDL)),
    ], [1], [REGS])
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(full.index(i))
        mbarrier.invalidate(empty.index(i))
    offs_n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, mma))
    offs_m = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, mma))
    out_ok = (offs_n < N)[:, None] & (offs_m < M)[None, :]
    y_ptrs = y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None]
    if SPLIT_K == 1:
        gl.store(y_ptrs, acc.to(gl.bfloat16), mask=out_ok)
    else:
        gl.store(ws_ptr + (pid_k * M + offs_m[None, :]) * N + offs_n[:, None], acc, mask=out_ok)
        gl.thread_barrier()
        arrived = gl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            total = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, mma)
            for s_idx in gl.static_range(SPLIT_K):
                total += gl.load(ws_ptr + (s_idx * M + offs_m[None, :]) * N + offs_n[:, None], mask=out_ok,
                                 other=0.0, cache_modifier=".cg")
            gl.store(y_ptrs, total.to(gl.bfloat16), mask=out_ok)
            gl.atomic_xchg(cnt_ptr + pid_n, 0)


def x_layout():
    return gl.NVMMASharedLayout.get_default_for([BLOCK_M, G.GROUP], gl.float16)


def launch16(x, packed, scale_zero, config, out=None):
    """The prep path of int4_gluon.launch with fp16 operands (M <= 8)."""
    split, stages, regs = config[:3]
    M, K = x.shape
    N = packed.shape[0]
    assert M <= BLOCK_M and K % (G.GROUP * split) == 0
    y = out if out is not None else torch.empty((M, N), dtype=x.dtype, device=x.device)
    ws = torch.empty((split * M, N), dtype=torch.float32, device=x.device) if split > 1 else y
    pdl = int4_gemm.USE_PDL
    trigger = pdl and G.triggers(N, split, x.device)
    follows = pdl and last_launch_triggers(x.device)
    w_layout, _, words = G._shared_layouts(BLOCK_M)
    w_desc = TensorDescriptor.from_tensor(packed.view(torch.int32), [G.BLOCK_N, G.GROUP // 8], w_layout)
    sz_desc = TensorDescriptor.from_tensor(scale_zero.view(torch.int32).view(K // G.GROUP, N), [1, G.BLOCK_N], words)
    xp = torch.empty((BLOCK_M, K), dtype=torch.float16, device=x.device)
    xs = torch.empty((K // G.GROUP, G.XS_WIDTH.value), dtype=torch.float32, device=x.device)
    _prep16_kernel[(K // G.GROUP,)](x, xp, xs, M, K, x.stride(0), GROUP=G.GROUP, BLOCK_M=BLOCK_M,
                                    XS=G.XS_WIDTH.value, PDL=pdl, num_warps=4, launch_pdl=follows)
    xl = x_layout()
    x_desc = TensorDescriptor.from_tensor(xp, [BLOCK_M, G.GROUP], xl)
    xs_desc = TensorDescriptor.from_tensor(xs, [1, G.XS_WIDTH.value], words)
    _kernel16[(N // G.BLOCK_N, split)](w_desc, x_desc, sz_desc, xs_desc, y, ws, int4_gemm.counters(x.device), M, N,
                                       K, y.stride(0), GROUP=G.GROUP, BLOCK_N=G.BLOCK_N, BLOCK_M=BLOCK_M,
                                       SPLIT_K=split, STAGES=stages, REGS=regs, PDL=pdl, X_LAYOUT=xl,
                                       TRIGGER=trigger, num_warps=4, maxnreg=regs, launch_pdl=pdl)
    note_launch(x.device, trigger)
    return y
