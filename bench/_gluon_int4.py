"""Prototype (bench only): the INT4 GEMM in Gluon. Per group of k, one TMA copy each brings the weight words, x
(in the fragment order), the scale/zero words and the group sums X into a ring of shared-memory stages (one
mbarrier per stage); the weights go from shared memory straight into the tensor-core fragment's registers, and
each group's product stays in flight while the next group is unpacked (warpgroup_mma_wait(1)).

Same stored format as kernels.int4_gemm; the prep kernel here writes X group-major ([K/g, 16]) for TMA.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from kernels import int4_gemm as G

BLOCK_M = 16


@triton.jit
def _prep_kernel(x_ptr, xp_ptr, xs_ptr, M, M_OUT, K, stride_xm, GROUP: tl.constexpr, BLOCK_M: tl.constexpr):
    """xp rows 0..M_OUT-1 (rows past M written as zeros, so TMA never reads past the tensor), xs [K/g, 32]."""
    g = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    cols = tl.arange(0, GROUP)
    x = tl.load(x_ptr + offs_m[:, None] * stride_xm + g * GROUP + cols[None, :], mask=m_ok[:, None], other=0.0)
    tl.store(xs_ptr + g * 2 * BLOCK_M + offs_m, tl.sum(x.to(tl.float32), axis=1))
    x = tl.reshape(tl.permute(tl.reshape(x, (BLOCK_M, 4, GROUP // 32, 2, 4)), (0, 2, 4, 1, 3)), (BLOCK_M, GROUP))
    tl.store(xp_ptr + offs_m[:, None] * K + g * GROUP + cols[None, :], x, mask=(offs_m < M_OUT)[:, None])


@gluon.jit
def _unpack(wd, s: gl.constexpr):
    return gl.inline_asm_elementwise("lop3.b32 $0, $1, 0x000F000F, 0x43004300, 0xEA;", "=r,r", [wd >> (4 * s)],
                                     dtype=gl.int32, is_pure=True, pack=1)


@gluon.jit
def _a_operand(wd, BLOCK_N: gl.constexpr, GROUP: gl.constexpr, a_l: gl.constexpr):
    W: gl.constexpr = GROUP // 8
    o = gl.join(gl.join(_unpack(wd, 0), _unpack(wd, 2)), gl.join(_unpack(wd, 1), _unpack(wd, 3)))
    o = gl.join((o & 0xFFFF).to(gl.int16), (o >> 16).to(gl.int16))
    o = gl.reshape(o, [BLOCK_N, 4, W // 4, 2, 2, 2])
    o = gl.permute(o, [0, 2, 3, 4, 1, 5])
    w = gl.reshape(o, [BLOCK_N, GROUP]).to(gl.bfloat16, bitcast=True)
    return gl.convert_layout(w, a_l, assert_trivial=True)


@gluon.jit
def _issue(w_desc, x_desc, sz_desc, xs_desc, bar, w_s, x_s, sz_s, xs_s, n0, g, GROUP: gl.constexpr, pred):
    nbytes: gl.constexpr = (w_desc.block_type.nbytes + x_desc.block_type.nbytes + sz_desc.block_type.nbytes
                            + xs_desc.block_type.nbytes)
    mbarrier.expect(bar, nbytes, pred=pred)
    tma.async_copy_global_to_shared(w_desc, [n0, g * (GROUP // 8)], bar, w_s, pred=pred)
    tma.async_copy_global_to_shared(x_desc, [0, g * GROUP], bar, x_s, pred=pred)
    tma.async_copy_global_to_shared(sz_desc, [g, n0], bar, sz_s, pred=pred)
    tma.async_copy_global_to_shared(xs_desc, [g, 0], bar, xs_s, pred=pred)


@gluon.jit
def _producer(w_desc, x_desc, sz_desc, xs_desc, full, empty, w_smem, x_smem, sz_smem, xs_smem, n0, g0, n_g):
    """One warp: each group's four TMA copies into its stage, once the consumers have released the stage.
    (Worker partitions take no constexpr arguments: the sizes come from the descriptors and buffers.)"""
    GROUP: gl.constexpr = x_desc.block_type.shape[1]
    STAGES: gl.constexpr = w_smem.type.shape[0]
    for g in range(n_g):
        st = g % STAGES
        mbarrier.wait(empty.index(st), ((g // STAGES) - 1) & 1, pred=g >= STAGES)
        _issue(w_desc, x_desc, sz_desc, xs_desc, full.index(st), w_smem.index(st), x_smem.index(st),
               sz_smem.index(st), xs_smem.index(st), n0, g0 + g, GROUP, True)


@gluon.jit
def _stage_in(full, w_smem, sz_smem, xs_smem, g, STAGES: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr,
              GROUP: gl.constexpr, wl: gl.constexpr, a_l: gl.constexpr, sl_n: gl.constexpr, sl_m: gl.constexpr):
    """Wait for group g's stage; its weights into the fragment, its scale s and (z + 128) X."""
    st = g % STAGES
    mbarrier.wait(full.index(st), (g // STAGES) & 1)
    w = _a_operand(w_smem.index(st).load(wl), BLOCK_N, GROUP, a_l)
    sz = sz_smem.index(st).reshape([BLOCK_N]).load(sl_n)
    x_sum = xs_smem.index(st).reshape([32]).slice(0, BLOCK_M).load(sl_m)
    s = (sz << 16).to(gl.float32, bitcast=True)
    zx = ((sz & -65536).to(gl.float32, bitcast=True) + 128.0)[:, None] * x_sum[None, :]
    return w, s, zx


@gluon.jit
def _consumer(full, empty, w_smem, x_smem, sz_smem, xs_smem, n_g, GROUP: gl.constexpr, STAGES: gl.constexpr,
              BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, ASYNC: gl.constexpr):
    """One warpgroup: per group, the weights into the fragment, the product, acc += s * (part - (z + 128) X)."""
    W: gl.constexpr = GROUP // 8
    wl: gl.constexpr = gl.DistributedLinearLayout(reg_bases=[[0, 1], [0, 2], [8, 0]],
                                                  lane_bases=[[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]],
                                                  warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[BLOCK_N, W])
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_M, 16])
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    sl_n: gl.constexpr = gl.SliceLayout(1, mma)
    sl_m: gl.constexpr = gl.SliceLayout(0, mma)
    zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, mma)
    acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, mma)
    if ASYNC:
        # each group's product stays in flight while the next group is loaded, unpacked and issued; two
        # alternating accumulators so that no register copy touches a product in flight
        w_a, s_a, zx_a = _stage_in(full, w_smem, sz_smem, xs_smem, 0, STAGES, BLOCK_N, BLOCK_M, GROUP, wl, a_l, sl_n, sl_m)
        p_a = warpgroup_mma(w_a, x_smem.index(0).permute((1, 0)), zero, use_acc=False, is_async=True)
        for g in range(1, n_g - 1, 2):
            w_b, s_b, zx_b = _stage_in(full, w_smem, sz_smem, xs_smem, g, STAGES, BLOCK_N, BLOCK_M, GROUP, wl, a_l,
                                       sl_n, sl_m)
            p_b = warpgroup_mma(w_b, x_smem.index(g % STAGES).permute((1, 0)), zero, use_acc=False, is_async=True)
            d_a, w_a = warpgroup_mma_wait(1, deps=(p_a, w_a))
            mbarrier.arrive(empty.index((g - 1) % STAGES), count=1)
            acc = acc + s_a[:, None] * (d_a - zx_a)
            w_a, s_a, zx_a = _stage_in(full, w_smem, sz_smem, xs_smem, g + 1, STAGES, BLOCK_N, BLOCK_M, GROUP, wl, a_l,
                                       sl_n, sl_m)
            p_a = warpgroup_mma(w_a, x_smem.index((g + 1) % STAGES).permute((1, 0)), zero, use_acc=False,
                                is_async=True)
            d_b, w_b = warpgroup_mma_wait(1, deps=(p_b, w_b))
            mbarrier.arrive(empty.index(g % STAGES), count=1)
            acc = acc + s_b[:, None] * (d_b - zx_b)
        w_b, s_b, zx_b = _stage_in(full, w_smem, sz_smem, xs_smem, n_g - 1, STAGES, BLOCK_N, BLOCK_M, GROUP, wl, a_l,
                                   sl_n, sl_m)
        p_b = warpgroup_mma(w_b, x_smem.index((n_g - 1) % STAGES).permute((1, 0)), zero, use_acc=False, is_async=True)
        d_a, w_a = warpgroup_mma_wait(1, deps=(p_a, w_a))
        mbarrier.arrive(empty.index((n_g - 2) % STAGES), count=1)
        acc = acc + s_a[:, None] * (d_a - zx_a)
        d_b, w_b = warpgroup_mma_wait(0, deps=(p_b, w_b))
        mbarrier.arrive(empty.index((n_g - 1) % STAGES), count=1)
        acc = acc + s_b[:, None] * (d_b - zx_b)
    else:
        for g in range(n_g):
            st = g % STAGES
            w, s, zx = _stage_in(full, w_smem, sz_smem, xs_smem, g, STAGES, BLOCK_N, BLOCK_M, GROUP, wl, a_l, sl_n, sl_m)
            part = warpgroup_mma(w, x_smem.index(st).permute((1, 0)), zero, use_acc=False, is_async=True)
            part, w = warpgroup_mma_wait(0, deps=(part, w))
            # the product's completion means every warp issued it, so every warp's reads of the stage are done
            mbarrier.arrive(empty.index(st), count=1)
            acc = acc + s[:, None] * (part - zx)
    return (acc,)  # (a partition returns a tuple)


@gluon.jit
def _int4_mm_gluon(w_desc, x_desc, sz_desc, xs_desc, y_ptr, ws_ptr, cnt_ptr, M, N, K, stride_ym,
                   GROUP: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, SPLIT_K: gl.constexpr,
                   STAGES: gl.constexpr, REGS: gl.constexpr, ASYNC: gl.constexpr):
    W: gl.constexpr = GROUP // 8
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_M, 16])
    sl_n: gl.constexpr = gl.SliceLayout(1, mma)
    sl_m: gl.constexpr = gl.SliceLayout(0, mma)

    pid_n = gl.program_id(0)
    pid_k = gl.program_id(1)
    n0 = pid_n * BLOCK_N
    n_g = (K // GROUP) // SPLIT_K
    g0 = pid_k * n_g

    w_smem = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_N, W], w_desc.layout)
    x_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_M, GROUP], x_desc.layout)
    sz_smem = gl.allocate_shared_memory(gl.int32, [STAGES, 1, BLOCK_N], sz_desc.layout)
    xs_smem = gl.allocate_shared_memory(gl.float32, [STAGES, 1, 32], xs_desc.layout)  # 128 B: TMA alignment
    full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(full.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    acc, = gl.warp_specialize([
        (_consumer, (full, empty, w_smem, x_smem, sz_smem, xs_smem, n_g, GROUP, STAGES, BLOCK_N, BLOCK_M, ASYNC)),
        (_producer, (w_desc, x_desc, sz_desc, xs_desc, full, empty, w_smem, x_smem, sz_smem, xs_smem, n0, g0, n_g)),
    ], [1], [REGS])
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(full.index(i))
        mbarrier.invalidate(empty.index(i))

    offs_n = n0 + gl.arange(0, BLOCK_N, layout=sl_n)
    offs_m = gl.arange(0, BLOCK_M, layout=sl_m)
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


def layouts(block_n, block_m, group):
    return dict(w=gl.NVMMASharedLayout.get_default_for([block_n, group // 8], gl.int32),
                x=gl.NVMMASharedLayout.get_default_for([block_m, group], gl.bfloat16),
                sz=gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2),
                xs=gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2))


def launch(x, packed, scale_zero, group, split, stages=4, block_n=64, maxnreg=64, block_m=None, pad=True,
           asynchronous=False, out=None):
    """block_m: the product's width (8 or 16; default the smallest >= M); pad: x padded to block_m rows."""
    M, K = x.shape
    N = packed.shape[0]
    block_m = block_m or (8 if M <= 8 else 16)
    n_g = K // group // split
    assert K % (group * split) == 0 and n_g >= 2 and (n_g % 2 == 0 or not asynchronous) and N % block_n == 0 and M <= block_m
    y = out if out is not None else torch.empty((M, N), dtype=x.dtype, device=x.device)
    m_out = block_m if pad else M
    xp = torch.empty((m_out, K), dtype=x.dtype, device=x.device)
    xs = torch.empty((K // group, 32), dtype=torch.float32, device=x.device)
    ws = torch.empty((split * M, N), dtype=torch.float32, device=x.device) if split > 1 else y
    cnt = G.counters(x.device)
    _prep_kernel[(K // group,)](x, xp, xs, M, m_out, K, x.stride(0), GROUP=group, BLOCK_M=BLOCK_M, num_warps=4)
    lay = layouts(block_n, block_m, group)
    w_desc = TensorDescriptor.from_tensor(packed.view(torch.int32), [block_n, group // 8], lay["w"])
    x_desc = TensorDescriptor.from_tensor(xp, [block_m, group], lay["x"])
    sz_desc = TensorDescriptor.from_tensor(scale_zero.view(torch.int32).view(K // group, N), [1, block_n], lay["sz"])
    xs_desc = TensorDescriptor.from_tensor(xs, [1, 32], lay["xs"])  # 128 B: a TMA destination is 128-byte aligned
    _int4_mm_gluon[(N // block_n, split)](w_desc, x_desc, sz_desc, xs_desc, y, ws, cnt, M, N, K, y.stride(0),
                                          GROUP=group, BLOCK_N=block_n, BLOCK_M=block_m, SPLIT_K=split,
                                          STAGES=stages, REGS=maxnreg, ASYNC=asynchronous, num_warps=4, maxnreg=maxnreg)
    return y
