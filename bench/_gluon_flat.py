"""Temporary (fifteenth session): the Gluon INT4 GEMM without warp specialisation, so that two calls fit an SM.

The shipped kernel is 8 warps at 64 registers (the one-warp producer is padded to a warp group): 16K registers a
program, 4 a SM, so back to back the next call's programs become resident only as this call's exit, and land
greedily on the SMs that free first (bench/NOTES.md items 22 and 30). Here one warp group does everything: one
thread issues each stage's TMA copies (the first ring before the wait for the previous kernel, each later group
once the warp group has finished with the stage it reuses), so a program is 4 warps, 8K registers and 26 KB of
shared memory: 8 fit an SM, and the next call's programs (3.4 a SM on 4096x14336) can all be placed at once beside
this call's. The next call is let launch only after this call's own wait (`griddepcontrol.launch_dependents` after
`griddepcontrol.wait`), so at most two calls are resident: the running one and the next, waiting. x from the prep
kernel (fp16), as the shipped prep path; the split-K sum as shipped.
"""

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from kernels import int4_gemm
from kernels.int4_gluon import (BLOCK_N, GROUP, _a_operand, _gdc_launch, _gdc_wait, _issue_weights, _issue_x,
                                _prep_kernel, _shared_layouts)
from kernels._jit import note_launch


@gluon.jit
def _flat_kernel(w_desc, x_desc, sz_desc, xs_desc, y_ptr, ws_ptr, cnt_ptr, M, N, K, stride_ym,
                 GROUP: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, SPLIT_K: gl.constexpr,
                 STAGES: gl.constexpr, PDL: gl.constexpr, TRIGGER: gl.constexpr):
    W: gl.constexpr = GROUP // 8
    words: gl.constexpr = gl.DistributedLinearLayout(reg_bases=[[0, 1], [0, 2], [8, 0]],
                                                     lane_bases=[[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]],
                                                     warp_bases=[[16, 0], [32, 0]], block_bases=[],
                                                     shape=[BLOCK_N, W])
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_M, 16])
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    cols: gl.constexpr = gl.SliceLayout(0, mma)
    pid_n = gl.program_id(0)
    pid_k = gl.program_id(1)
    n0 = pid_n * BLOCK_N
    n_g = (K // GROUP) // SPLIT_K
    g0 = pid_k * n_g
    nbytes: gl.constexpr = (w_desc.block_type.nbytes + sz_desc.block_type.nbytes + x_desc.block_type.nbytes
                            + xs_desc.block_type.nbytes)

    w_smem = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_N, W], w_desc.layout)
    x_smem = gl.allocate_shared_memory(gl.float16, [STAGES, BLOCK_M, GROUP], x_desc.layout)
    sz_smem = gl.allocate_shared_memory(gl.int32, [STAGES, 1, BLOCK_N], sz_desc.layout)
    xs_smem = gl.allocate_shared_memory(gl.float32, [STAGES, 1, 4 * BLOCK_M], sz_desc.layout)
    full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(full.index(i), count=1)

    first = gl.minimum(n_g, STAGES)
    for g in range(first):
        _issue_weights(w_desc, sz_desc, full.index(g), w_smem.index(g), sz_smem.index(g), n0, g0 + g, nbytes)
    if PDL:
        _gdc_wait()
    if TRIGGER:
        _gdc_launch()
    for g in range(first):
        _issue_x(x_desc, xs_desc, full.index(g), x_smem.index(g), xs_smem.index(g), g0 + g)

    zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, mma)
    acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, mma)
    for g in range(n_g):
        st = g % STAGES
        mbarrier.wait(full.index(st), (g // STAGES) & 1)
        w = _a_operand(w_smem.index(st).load(words), BLOCK_N, GROUP, a_l, True)
        sz = sz_smem.index(st).reshape([BLOCK_N]).load(gl.SliceLayout(1, mma))
        xs = xs_smem.index(st).reshape([4 * BLOCK_M])
        s = (sz << 16).to(gl.float32, bitcast=True)
        z = (sz & -65536).to(gl.float32, bitcast=True)
        x_sum = xs.slice(BLOCK_M, BLOCK_M).load(cols)
        zx = xs.slice(0, BLOCK_M).load(cols)[None, :] + z[:, None] * x_sum[None, :]
        s = s[:, None] * xs.slice(2 * BLOCK_M, BLOCK_M).load(cols)[None, :]
        part = warpgroup_mma(w, x_smem.index(st).permute((1, 0)), zero, use_acc=False, is_async=True)
        part, w = warpgroup_mma_wait(0, deps=(part, w))
        gl.thread_barrier()  # every warp is done with the stage (its words, scale/zero, sums and x)
        if g + STAGES < n_g:
            _issue_weights(w_desc, sz_desc, full.index(st), w_smem.index(st), sz_smem.index(st), n0,
                           g0 + g + STAGES, nbytes)
            _issue_x(x_desc, xs_desc, full.index(st), x_smem.index(st), xs_smem.index(st), g0 + g + STAGES)
        acc = acc + s * (part - zx)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(full.index(i))

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


def launch(x, packed, scale_zero, split, stages=4, trigger=True, regs=64):
    """x [M, K] bf16 (M <= 8) times the INT4 weight [N, K] (group 128), prep kernel then the flat kernel."""
    M, K = x.shape
    N = packed.shape[0]
    assert M <= 8 and K % (GROUP * split) == 0 and N % BLOCK_N == 0
    block_m = 8
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    ws = torch.empty((split * M, N), dtype=torch.float32, device=x.device) if split > 1 else y
    w_layout, x_layout, words = _shared_layouts(block_m)
    w_desc = TensorDescriptor.from_tensor(packed.view(torch.int32), [BLOCK_N, GROUP // 8], w_layout)
    sz_desc = TensorDescriptor.from_tensor(scale_zero.view(torch.int32).view(K // GROUP, N), [1, BLOCK_N], words)
    xp = torch.empty((block_m, K), dtype=torch.float16, device=x.device)
    xs = torch.empty((K // GROUP, 4 * block_m), dtype=torch.float32, device=x.device)
    _prep_kernel[(K // GROUP,)](x, xp, xs, M, K, x.stride(0), GROUP=GROUP, BLOCK_M=block_m, PDL=True,
                                num_warps=4, launch_pdl=True)
    x_desc = TensorDescriptor.from_tensor(xp, [block_m, GROUP], x_layout)
    xs_desc = TensorDescriptor.from_tensor(xs, [1, 4 * block_m], words)
    _flat_kernel[(N // BLOCK_N, split)](w_desc, x_desc, sz_desc, xs_desc, y, ws, int4_gemm.counters(x.device), M, N,
                                       K, y.stride(0), GROUP=GROUP, BLOCK_N=BLOCK_N, BLOCK_M=block_m, SPLIT_K=split,
                                       STAGES=stages, PDL=True, TRIGGER=trigger, num_warps=4, maxnreg=regs,
                                       launch_pdl=True)
    note_launch(x.device, trigger)
    return y
