"""The INT4 small-M GEMM on Hopper, warp-specialised in Gluon: the path `int4_mm` takes for the shapes in CONFIGS
and for untuned weights of at least MIN_WEIGHTS.

Same stored format, k permutation and per-group affine map as kernels/int4_gemm.py (read its docstring first):
  sum_k x_k (q_k - z) s = s * (sum_k x_k (128 + q_k) - (128 + z) X),
and the same weight-stationary tile: a program owns BLOCK_N = 64 output columns and one of SPLIT_K slices of K.
What differs is who moves the bytes. A program is a ring of STAGES shared-memory stages, one group of k each,
with a `full` mbarrier (the stage's bytes have landed) and an `empty` one (the consumers are done with it),
served by warp-specialised partitions:
- `_producer`, one warp, issues per group the TMA copies of the weight words [64, g/8] and the scale/zero words
  [1, 64] (and, with the prep kernel, of x [BLOCK_M, g] and its sums) as soon as the stage is released. The
  consumers run no address arithmetic and no cp.async, and wait on one barrier a group; scale, zero and the
  sums arrive with the weights, not as plain loads whose latency the consumers would have to hide.
- `_consumer`, one warpgroup, moves the weight words from shared memory straight into the wgmma A operand's
  registers: their layout (`words`) is chosen so that the unpack, join and permutation produce exactly that
  operand, which `convert_layout(..., assert_trivial=True)` checks at compile time. Each group's product is
  waited for before the next is issued: with two in flight (two accumulators, `warpgroup_mma_wait(1)`) ptxas
  serialises every wgmma (C7514).
- `_stager`, one warp, in one launch only: x by cp.async X_DEPTH groups ahead into a staging ring, then
  permuted in registers into the stage with its sums. Its per-group chain runs beside the producer's, so it
  does not delay the weights' copies, and it costs no warps: Gluon pads the one-warp producer partition to a
  warpgroup, so a program is 8 warps with or without it.

x reaches the stages in one of two ways:
- With the prep kernel (`_prep_kernel`), in fp16: fp16's 10 mantissa bits hold a nibble at bits 4-7 of a half
  as well as at bits 0-3, so a word unpacks with one shift and four lop3 (bf16: three and four), which shortens
  the consumers' chain on long loops of groups. Odd k (the nibbles read in place at bits 4-7) then read as
  1024 + 16 q, even k as 1024 + q, so the prep kernel divides x at odd k by 16 and, against fp16's range,
  scales each row's group by a power of 2 r:
    r sum_k x_k (q_k - z) = P - C - z X,  C = 1024 Sl + 64 Sh,  X = Sl + Sh  (Sl, Sh: x r summed over even, odd k)
  where P is the fp16 product; the epilogue multiplies by s / r. It writes x in the fragment order, padded to
  BLOCK_M rows, and per group C, X and 1/r for the BLOCK_M rows (rows >= M zero) into a [K/g, 4 BLOCK_M]
  float32 buffer: 128 or 256 bytes a group, because a TMA destination must be 128-byte aligned.
- In one launch (M <= a config's 4th entry, one_launch_m), in bf16 by the stager, which writes what the prep
  kernel would for the first ROWS = the next power of 2 >= M rows: the stage's other rows repeat them, and
  their products land in output rows >= M, which are never stored. x shares the weights' stage: a ring or a
  slot of x of its own costs the consumers one more barrier wait a group, more than the decoupling frees.
  One launch takes the prep kernel's launch and its wait off the critical path; on long loops of groups the
  stager's permutation and sums compete with the consumers for issue slots, hence the per-shape limit.

Launch:
- The product is BLOCK_M = 8 wide for M <= 8 (wgmma n = 8, where Triton's dot would fall back to mma.sync),
  else 16; x is padded to BLOCK_M rows so that no TMA box reaches past its tensor.
- 64 registers a thread, no spills (the 16-wide product takes 80: under 64 ptxas serialises its wgmma), so 4
  programs fit an SM. Fewer registers fit 5, which loses back to back: more of the next call's programs land
  greedily on the SMs that free first.
- Under programmatic dependent launch (`int4_launch.USE_PDL`) the programs start while the previous kernel runs
  and issue their first ring of weight and scale/zero copies before waiting for it (`_first_ring`): those bytes
  depend on no earlier kernel.
- Overlap mode, for grids of >= TRIGGER_PER_SM programs per SM: the GEMM lets the next kernel launch at its
  start (griddepcontrol.launch_dependents), so back to back the next call's programs issue their first ring
  during this call's tail. Sparser grids do not: the block scheduler places programs that arrive while SMs are
  busy greedily (0 to 4 on an SM), which a sparse grid does not absorb. A call's first kernel (the prep kernel,
  or the GEMM in one launch) is itself a programmatic dependent only after a launch of ours that triggers
  (`kernels._jit`): after one that does not, waiting costs more than it saves.
- Split-K as in int4_gemm: fp32 partials, summed in split order by the last program of a column tile to arrive.
Only on a Hopper GPU (TMA, wgmma, cp.async), group 128, N % 64 == 0, and not while a graph is being traced
(`usable`); everything else takes kernels/int4_gemm.py, which the CPU tests run under the interpreter.
Measured on the H200: docs/results.md.
"""

from __future__ import annotations

import functools

import torch
import triton.language as tl
from triton import constexpr_function
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kernels import int4_launch
from kernels._jit import TUNED_SMS, capability, last_launch_triggers, lazy_jit, note_launch, sm_count

GROUP = 128
BLOCK_N = 64
MAX_SPLIT = 16

# (split, stages, registers[, one_launch_m]) per (K, N), tuned on the H200 (bench/results/h200-int4-tune.json,
# "gluon"; `python -m bench.lab.kernel_tune` redoes it) for the shapes where this path beats kernels/int4_gemm.py (None: a
# shape where it does not); one_launch_m: x staged by the kernel itself (one launch) at M <= one_launch_m (<= 8),
# by the prep kernel above. Other shapes: `pick`.
CONFIGS: dict[tuple[int, int], tuple | None] = {
    (4096, 14336): (2, 4, 64, 2),  # split 2: enough programs per SM for the overlap mode
    (14336, 4096): (8, 4, 64, 8),
    (5376, 21504): (1, 4, 64),
    (21504, 5376): (6, 6, 64, 8),
    (8192, 28672): (1, 4, 64),
    (4096, 128256): (1, 4, 64),  # Llama-3-8B lm_head
    (4096, 28672): (1, 4, 64),   # fused gate|up
    (4096, 4096): (8, 2, 64, 8), (4096, 1024): (8, 4, 64, 8), (4096, 6144): (4, 2, 64, 8),
}
X_DEPTH = 2  # groups of x the stager copies ahead (deeper is no faster: its chain, not x's latency, sets its pace)
MIN_WEIGHTS = 1 << 25  # untuned shapes below this many weights stay on the Triton kernel
# A grid of at least this many programs per SM runs in the overlap mode (module docstring).
TRIGGER_PER_SM = 3


@gluon.jit
def _unpack(wd, s: gl.constexpr, FP16: gl.constexpr):
    """Nibbles s and s+4 of each word -> a 16-bit pair with no conversion: bf16 (128 + q) (the nibble shifted to
    bits 0-3 of each half, one lop3, as in int4_gemm), or, with FP16, fp16 (1024 + q) for even s and
    (1024 + 16 q) for odd s, read in place at bits 4-7: fp16's 10 mantissa bits hold both, so a word takes one
    shift (by 8, for s = 2, 3) instead of three."""
    if FP16:
        v = wd >> 8 if s >= 2 else wd
        if s % 2 == 1:
            return gl.inline_asm_elementwise("lop3.b32 $0, $1, 0x00F000F0, 0x64006400, 0xEA;", "=r,r", [v],
                                             dtype=gl.int32, is_pure=True, pack=1)
        return gl.inline_asm_elementwise("lop3.b32 $0, $1, 0x000F000F, 0x64006400, 0xEA;", "=r,r", [v],
                                         dtype=gl.int32, is_pure=True, pack=1)
    return gl.inline_asm_elementwise("lop3.b32 $0, $1, 0x000F000F, 0x43004300, 0xEA;", "=r,r", [wd >> (4 * s)],
                                     dtype=gl.int32, is_pure=True, pack=1)


@gluon.jit
def _a_operand(wd, BLOCK_N: gl.constexpr, GROUP: gl.constexpr, a_l: gl.constexpr, FP16: gl.constexpr):
    """Words [BLOCK_N, GROUP/8] in `_consumer`'s `words` layout -> the bf16 (fp16) A operand [BLOCK_N, GROUP] with
    no data movement: the same k permutation as int4_gemm (word Q t + v, shift s -> pair (v * 4 + s) * 4 + t,
    Q = GROUP/32)."""
    W: gl.constexpr = GROUP // 8
    o = gl.join(gl.join(_unpack(wd, 0, FP16), _unpack(wd, 2, FP16)),
                gl.join(_unpack(wd, 1, FP16), _unpack(wd, 3, FP16)))  # [N, W, s1, s0]
    o = gl.join((o & 0xFFFF).to(gl.int16), (o >> 16).to(gl.int16))  # [N, W, s1, s0, half]
    o = gl.permute(gl.reshape(o, [BLOCK_N, 4, W // 4, 2, 2, 2]), [0, 2, 3, 4, 1, 5])  # [N, v, s1, s0, t, half]
    w = gl.reshape(o, [BLOCK_N, GROUP]).to(gl.float16 if FP16 else gl.bfloat16, bitcast=True)
    return gl.convert_layout(w, a_l, assert_trivial=True)


@gluon.jit
def _gdc_wait():
    """griddepcontrol.wait: the previous kernel's writes (the prep kernel's x and X, or x itself in the one-launch
    mode) are complete and visible past this point."""
    gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _gdc_launch():
    """griddepcontrol.launch_dependents: the next kernel's programs may be scheduled (once every program of this
    grid has said so or exited); they wait for this grid's completion before their first dependent access."""
    gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [], dtype=gl.int32,
                              is_pure=False, pack=1)


@gluon.jit
def _issue_weights(w_desc, sz_desc, bar, w_s, sz_s, n0, g, nbytes: gl.constexpr):
    mbarrier.expect(bar, nbytes)  # every TMA byte of the stage (with the prep kernel, x's and X's copies too)
    tma.async_copy_global_to_shared(w_desc, [n0, g * w_desc.block_type.shape[1]], bar, w_s)
    tma.async_copy_global_to_shared(sz_desc, [g, n0], bar, sz_s)


@gluon.jit
def _issue_x(x_desc, xs_desc, bar, x_s, xs_s, g):
    tma.async_copy_global_to_shared(x_desc, [0, g * x_desc.block_type.shape[1]], bar, x_s)
    tma.async_copy_global_to_shared(xs_desc, [g, 0], bar, xs_s)


@gluon.jit
def _first_ring(w_desc, sz_desc, full, w_smem, sz_smem, n0, g0, n_g, nbytes: gl.constexpr, pdl):
    """The first ring's weights and scale/zero, then the programmatic-dependency wait (`pdl`): they depend on no
    earlier kernel, so their DRAM latency overlaps the previous kernel and this grid's launch. -> groups issued."""
    first = gl.minimum(n_g, w_smem.type.shape[0])
    for g in range(first):
        _issue_weights(w_desc, sz_desc, full.index(g), w_smem.index(g), sz_smem.index(g), n0, g0 + g, nbytes)
    if pdl:
        _gdc_wait()
    return first


@gluon.jit
def _producer(w_desc, x_desc, sz_desc, xs_desc, full, empty, w_smem, x_smem, sz_smem, xs_smem, n0, g0, n_g, pdl):
    """One warp: each group's copies into its stage once the consumers released the stage's previous group; x
    and X (the prep kernel's output) only after `_first_ring`'s wait. In one launch (x_desc None) the weights and
    scale/zero only: x is `_stager`'s, and the weights depend on no earlier kernel, so `pdl` is False there.
    (Worker partitions take no constexpr arguments: the sizes come from the descriptors and buffers.)"""
    STAGES: gl.constexpr = w_smem.type.shape[0]
    nbytes: gl.constexpr = (w_desc.block_type.nbytes + sz_desc.block_type.nbytes
                            + (x_desc.block_type.nbytes + xs_desc.block_type.nbytes if x_desc is not None else 0))
    first = _first_ring(w_desc, sz_desc, full, w_smem, sz_smem, n0, g0, n_g, nbytes, pdl)
    if x_desc is not None:
        for g in range(first):
            _issue_x(x_desc, xs_desc, full.index(g), x_smem.index(g), xs_smem.index(g), g0 + g)
    for g in range(first, n_g):
        st = g % STAGES
        mbarrier.wait(empty.index(st), ((g // STAGES) - 1) & 1)
        _issue_weights(w_desc, sz_desc, full.index(st), w_smem.index(st), sz_smem.index(st), n0, g0 + g, nbytes)
        if x_desc is not None:
            _issue_x(x_desc, xs_desc, full.index(st), x_smem.index(st), xs_smem.index(st), g0 + g)


@constexpr_function
def _x_words(W):
    """One warp over [rows, W] words of x (bf16 pairs), 16 bytes a thread: the cp.async and the staging reads."""
    return gl.BlockedLayout(size_per_thread=[1, 4], threads_per_warp=[32 * 4 // W, W // 4], warps_per_cta=[1, 1],
                            order=[1, 0])


@gluon.jit
def _copy_x(xw_ptr, stride_xw, M, g, ok, stage):
    """cp.async of x[:ROWS, group g] (bf16 pairs, natural order) into a staging buffer; rows >= M zero-filled."""
    ROWS: gl.constexpr = stage.type.shape[0]
    W: gl.constexpr = stage.type.shape[1]
    layout: gl.constexpr = _x_words(W)
    rows = gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, W, layout=gl.SliceLayout(0, layout))
    async_copy.async_copy_global_to_shared(stage, xw_ptr + rows[:, None] * stride_xw + g * W + cols[None, :],
                                           mask=((rows < M)[:, None] & (cols >= 0)[None, :]) & ok)
    async_copy.commit_group()


@gluon.jit
def _stage_x(xw, bar, x_s, xs_s):
    """What the prep kernel writes, for one group and this program: x in the fragment's k order into the stage
    and its sums X, for the ROWS rows of xw (the stage's other rows repeat them: only output rows < M are
    stored), then the stage's second arrival (the first is the weights' expect). Natural k =
    32 t + 8 v + 4 half + s goes to ((v * 4 + s) * 4 + t) * 2 + half: in words (bf16 pairs), natural word
    16 t + 4 v + 2 half + s // 2 holds s and s + 1, and the pair (half 0, half 1) of each s is one word of the
    result, at (v * 4 + s) * 4 + t."""
    BLOCK_M: gl.constexpr = x_s.type.shape[0]
    GROUP: gl.constexpr = x_s.type.shape[1]
    ROWS: gl.constexpr = xw.shape[0]
    lo_f = (xw << 16).to(gl.float32, bitcast=True)
    hi_f = (xw & -65536).to(gl.float32, bitcast=True)
    xs_s.reshape([xs_s.type.shape[1]]).slice(0, ROWS).store(gl.sum(lo_f + hi_f, axis=1))
    a, b = gl.split(gl.permute(gl.reshape(xw, [ROWS, 4, GROUP // 32, 2, 2]), [0, 1, 2, 4, 3]))  # half 0, 1
    even = (a & 0xFFFF) | (b << 16)  # s = 2 w: (half 0, half 1)
    odd = ((a >> 16) & 0xFFFF) | (b & -65536)  # s = 2 w + 1
    xp = gl.permute(gl.join(even, odd), [0, 2, 3, 4, 1])  # [M, t, v, w, s % 2] -> [M, v, w, s % 2, t]
    words: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=x_s.type.layout.swizzle_byte_width,
                                               element_bitwidth=32, rank=2)
    xp = gl.reshape(xp, [ROWS, GROUP // 2])
    for i in gl.static_range(BLOCK_M.bit_length() - ROWS.bit_length()):  # rows >= ROWS repeat the first ROWS
        xp = gl.reshape(gl.permute(gl.join(xp, xp), [2, 0, 1]), [xp.shape[0] * 2, GROUP // 2])
    x_s._reinterpret(gl.int32, [BLOCK_M, GROUP // 2], words).store(xp)
    fence_async_shared()  # the generic-proxy writes above before the tensor core's (async-proxy) reads
    mbarrier.arrive(bar, count=1)


@gluon.jit
def _stager(xw_ptr, stride_xw, M, full, empty, x_smem, xs_smem, staging, g0, n_g, pdl):
    """One warp, one launch, no prep kernel: x by cp.async into a staging ring DEPTH groups ahead, then, once the
    consumers released the stage, permuted from there into it with its sums (`_stage_x`). A warp of its own, beside
    `_producer`, so that its per-group chain (copy wait, two warp barriers, the permutation, the fence, the
    arrive) does not delay the weights' copies; it takes one of the three warps Gluon pads the producer's warp
    group with, so a program is still 8 warps."""
    STAGES: gl.constexpr = x_smem.type.shape[0]
    DEPTH: gl.constexpr = staging.type.shape[0] - 1
    layout: gl.constexpr = _x_words(staging.type.shape[2])
    if pdl:
        _gdc_wait()  # x is the previous kernel's output
    for g in gl.static_range(DEPTH):
        _copy_x(xw_ptr, stride_xw, M, g0 + g, g < n_g, staging.index(g))
    for g in range(n_g):
        st = g % STAGES
        _copy_x(xw_ptr, stride_xw, M, g0 + g + DEPTH, g + DEPTH < n_g, staging.index((g + DEPTH) % (DEPTH + 1)))
        async_copy.wait_group(DEPTH)
        gl.thread_barrier()  # every lane's copy of group g has landed
        xw = staging.index(g % (DEPTH + 1)).load(layout)
        gl.thread_barrier()  # every lane has read it before its buffer is refilled
        if g >= STAGES:
            mbarrier.wait(empty.index(st), ((g // STAGES) - 1) & 1)
        _stage_x(xw, full.index(st), x_smem.index(st), xs_smem.index(st))


@gluon.jit
def _consumer(full, empty, w_smem, x_smem, sz_smem, xs_smem, n_g, GROUP: gl.constexpr, STAGES: gl.constexpr,
              BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr):
    """One warpgroup: per group, the weights into the fragment, the product P, then acc += s * (P - (z + 128) X)
    (bf16 x, the stager's), or acc += s / r * (P - C - z X) (fp16 x, `_prep_kernel`'s)."""
    W: gl.constexpr = GROUP // 8
    FP16: gl.constexpr = x_smem.dtype == gl.float16
    # thread (g, t) of warp w holds rows 16w + g and 16w + g + 8, words 4t..4t+3 (16 bytes): the rows and k
    # pairs of its wgmma A fragment once unpacked and permuted (see _a_operand)
    words: gl.constexpr = gl.DistributedLinearLayout(reg_bases=[[0, 1], [0, 2], [8, 0]],
                                                     lane_bases=[[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]],
                                                     warp_bases=[[16, 0], [32, 0]], block_bases=[],
                                                     shape=[BLOCK_N, W])
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_M, 16])
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    cols: gl.constexpr = gl.SliceLayout(0, mma)
    zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, mma)
    acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, mma)
    for g in range(n_g):
        st = g % STAGES
        mbarrier.wait(full.index(st), (g // STAGES) & 1)
        w = _a_operand(w_smem.index(st).load(words), BLOCK_N, GROUP, a_l, FP16)
        sz = sz_smem.index(st).reshape([BLOCK_N]).load(gl.SliceLayout(1, mma))
        xs = xs_smem.index(st).reshape([4 * BLOCK_M])
        s = (sz << 16).to(gl.float32, bitcast=True)  # bf16 bits in the high half of a float32: exact
        z = (sz & -65536).to(gl.float32, bitcast=True)
        if FP16:
            x_sum = xs.slice(BLOCK_M, BLOCK_M).load(cols)
            zx = xs.slice(0, BLOCK_M).load(cols)[None, :] + z[:, None] * x_sum[None, :]
            s = s[:, None] * xs.slice(2 * BLOCK_M, BLOCK_M).load(cols)[None, :]
        else:
            zx = (z + 128.0)[:, None] * xs.slice(0, BLOCK_M).load(cols)[None, :]
            s = s[:, None]
        part = warpgroup_mma(w, x_smem.index(st).permute((1, 0)), zero, use_acc=False, is_async=True)
        part, w = warpgroup_mma_wait(0, deps=(part, w))
        # the product is complete, so every warp has issued it and every warp's reads of the stage are done
        mbarrier.arrive(empty.index(st), count=1)
        acc = acc + s * (part - zx)
    return (acc,)  # (a partition returns a tuple)


@lazy_jit(do_not_specialize=["M"])
def _prep_kernel(x_ptr, xp_ptr, xs_ptr, M, K, stride_xm, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
                 PDL: tl.constexpr):
    """One program per group g of k, for the fp16 product (module docstring): per row m < BLOCK_M (rows >= M
    zero) a power of 2 r with max |x r| in [2^14, 2^15) over the group (clamped to normal floats), so that fp16
    neither overflows nor rounds bf16's 8 bits; xp[m, g] = fp16(x r), odd k divided by 16 more, in the fragment's
    k order; xs[g, m] = C = 1024 Sl + 64 Sh, xs[g, BLOCK_M + m] = X = Sl + Sh and xs[g, 2 BLOCK_M + m] = 1/r,
    where Sl, Sh sum x r over even, odd k (from the fp16 values themselves, so that P - C is exactly r times
    x's product with q). The GEMM's X buffer is group-major for its TMA boxes."""
    if PDL:
        gdc_launch_dependents()  # the GEMM's programs may be scheduled now; they wait for this grid's writes
        gdc_wait()  # launched as a dependent itself: the previous kernel's x (and its reads of our buffers) are done
    g = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, GROUP)
    x = tl.load(x_ptr + offs_m[:, None] * stride_xm + g * GROUP + cols[None, :], mask=(offs_m < M)[:, None],
                other=0.0).to(tl.float32)
    e = (tl.max(tl.abs(x), axis=1).to(tl.int32, bitcast=True) >> 23) & 0xFF  # biased exponent of the row's max
    er = tl.minimum(tl.maximum(268 - e, 1), 253)  # r = 2^(14 - (e - 127)), and 1/r, normal floats
    r = (er << 23).to(tl.float32, bitcast=True)[:, None]
    odd = (cols % 2 == 1)[None, :]
    xh = tl.where(odd, x * r * 0.0625, x * r).to(tl.float16)
    xf = xh.to(tl.float32)
    sl = tl.sum(tl.where(odd, 0.0, xf), axis=1)
    sh = tl.sum(tl.where(odd, xf * 16.0, 0.0), axis=1)
    row = xs_ptr + g * 4 * BLOCK_M + offs_m
    tl.store(row, 1024.0 * sl + 64.0 * sh)
    tl.store(row + BLOCK_M, sl + sh)
    tl.store(row + 2 * BLOCK_M, ((254 - er) << 23).to(tl.float32, bitcast=True))
    # int4_gemm's fragment order: k = 8 (Q t + v) + s + 4 half goes to position ((v * 4 + s) * 4 + t) * 2 + half
    xh = tl.reshape(tl.permute(tl.reshape(xh, (BLOCK_M, 4, GROUP // 32, 2, 4)), (0, 2, 4, 1, 3)), (BLOCK_M, GROUP))
    tl.store(xp_ptr + offs_m[:, None] * K + g * GROUP + cols[None, :], xh)


@gluon.jit
def _int4_mm_kernel(w_desc, x_desc, sz_desc, xs_desc, xw_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, K, stride_xw, stride_ym,
                    GROUP: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, SPLIT_K: gl.constexpr,
                    STAGES: gl.constexpr, REGS: gl.constexpr, PDL: gl.constexpr, X_LAYOUT: gl.constexpr,
                    X_DEPTH: gl.constexpr, TRIGGER: gl.constexpr, ROWS: gl.constexpr):
    """X_DEPTH = 0: x (fp16) and its sums from `_prep_kernel` by TMA (x_desc, xs_desc); X_DEPTH > 0: x from xw_ptr
    (bf16 pairs) by the stager's cp.async, X_DEPTH groups ahead, its first ROWS rows only, no prep kernel (x_desc
    and xs_desc None). TRIGGER: the next kernel, if it is a programmatic dependent, may be scheduled as soon as
    every program has started."""
    W: gl.constexpr = GROUP // 8
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_M, 16])
    if TRIGGER:
        _gdc_launch()
    pid_n = gl.program_id(0)
    pid_k = gl.program_id(1)
    n0 = pid_n * BLOCK_N
    n_g = (K // GROUP) // SPLIT_K  # groups of this slice (the launcher checks the division)
    g0 = pid_k * n_g

    w_smem = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_N, W], w_desc.layout)
    x_smem = gl.allocate_shared_memory(gl.float16 if X_DEPTH == 0 else gl.bfloat16, [STAGES, BLOCK_M, GROUP],
                                       X_LAYOUT)
    sz_smem = gl.allocate_shared_memory(gl.int32, [STAGES, 1, BLOCK_N], sz_desc.layout)
    xs_smem = gl.allocate_shared_memory(gl.float32, [STAGES, 1, 4 * BLOCK_M], sz_desc.layout)
    full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(full.index(i), count=1 if X_DEPTH == 0 else 2)  # (+ the stager's store of x)
        mbarrier.init(empty.index(i), count=1)
    if X_DEPTH == 0:
        acc, = gl.warp_specialize([
            (_consumer, (full, empty, w_smem, x_smem, sz_smem, xs_smem, n_g, GROUP, STAGES, BLOCK_N, BLOCK_M)),
            (_producer, (w_desc, x_desc, sz_desc, xs_desc, full, empty, w_smem, x_smem, sz_smem, xs_smem, n0, g0,
                         n_g, PDL)),
        ], [1], [REGS])
    else:
        staging = gl.allocate_shared_memory(gl.int32, [X_DEPTH + 1, ROWS, GROUP // 2],
                                            gl.SwizzledSharedLayout(vec=4, per_phase=1, max_phase=1, order=[1, 0]))
        acc, = gl.warp_specialize([
            (_consumer, (full, empty, w_smem, x_smem, sz_smem, xs_smem, n_g, GROUP, STAGES, BLOCK_N, BLOCK_M)),
            (_producer, (w_desc, x_desc, sz_desc, xs_desc, full, empty, w_smem, x_smem, sz_smem, xs_smem, n0, g0, n_g,
                         False)),
            (_stager, (xw_ptr, stride_xw, M, full, empty, x_smem, xs_smem, staging, g0, n_g, PDL)),
        ], [1, 1], [REGS, REGS])
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(full.index(i))
        mbarrier.invalidate(empty.index(i))

    # Split-K as in int4_gemm: fp32 partials, the last program of a column tile to arrive sums them in order.
    # The same protocol is written out in int4_gemm._int4_mm_kernel: a Gluon kernel cannot call a @triton.jit
    # function (Gluon's tensors carry explicit layouts, Triton's do not, and the Triton kernel must also run
    # under the interpreter), so the protocol is written twice: a change to one is a change to both.
    offs_n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, mma))
    offs_m = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, mma))
    out_ok = (offs_n < N)[:, None] & (offs_m < M)[None, :]
    y_ptrs = y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None]
    if SPLIT_K == 1:
        gl.store(y_ptrs, acc.to(gl.bfloat16), mask=out_ok)
    else:
        gl.store(ws_ptr + (pid_k * M + offs_m[None, :]) * N + offs_n[:, None], acc, mask=out_ok)
        gl.thread_barrier()  # every thread's partial is issued before the (release) arrival below
        arrived = gl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            total = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, mma)
            for s_idx in gl.static_range(SPLIT_K):
                total += gl.load(ws_ptr + (s_idx * M + offs_m[None, :]) * N + offs_n[:, None], mask=out_ok,
                                 other=0.0, cache_modifier=".cg")
            gl.store(y_ptrs, total.to(gl.bfloat16), mask=out_ok)
            gl.atomic_xchg(cnt_ptr + pid_n, 0)  # ready for the next launch


# ----------------------------------------------------------------------------- launch

def default_config(K: int, N: int, sms: int = TUNED_SMS) -> tuple[int, int, int]:
    """What the tune favoured: K unsplit when the column tiles alone give 1.5 programs per SM, else the fewest
    slices (dividing K's groups, >= 2 groups each, <= MAX_SPLIT) that give 3.5 per SM; 4 stages, 64 registers."""
    tiles, groups = N // BLOCK_N, K // GROUP
    splits = [d for d in range(1, min(MAX_SPLIT, groups // 2) + 1) if groups % d == 0] or [1]
    split = 1 if tiles >= 1.5 * sms else next((d for d in splits if tiles * d >= 3.5 * sms), splits[-1])
    return split, 4, 64


def pick(K: int, N: int, group: int, device, rows: int = 1) -> tuple | None:
    """This path's config for the shape and M = rows, or None where kernels/int4_gemm.py should run it. Above a
    config's one_launch_m, a shape under MIN_WEIGHTS goes to the Triton kernel (faster there than the prep kernel
    and this path) and a larger one keeps the split with the prep kernel."""
    if group != GROUP or N % BLOCK_N or K % GROUP or K < 2 * GROUP:
        return None
    if (K, N) in CONFIGS:
        config = CONFIGS[(K, N)]
        if config is None or len(config) == 3 or rows <= config[3]:
            return config
        return config[:3] if K * N >= MIN_WEIGHTS else None
    return default_config(K, N, sm_count(device)) if K * N >= MIN_WEIGHTS else None


def triggers(N: int, split: int, device) -> bool:
    """Whether the grid for N columns in `split` slices of K runs in the overlap mode: it lets the next kernel
    launch at its start (TRIGGER)."""
    return N // BLOCK_N * split >= TRIGGER_PER_SM * sm_count(device)


def usable(x: torch.Tensor) -> bool:
    """A Hopper GPU, eagerly (a traced or fake tensor takes the Triton kernel, which traces through
    torch.library.wrap_triton)."""
    if x.device.type != "cuda" or torch.compiler.is_compiling():
        return False
    if isinstance(x, torch._subclasses.FakeTensor):
        return False
    return capability(x.device)[0] == 9


@functools.cache
def _shared_layouts(block_m: int) -> tuple:
    """(weights, x, one-row words) shared-memory layouts of the TMA boxes."""
    return (gl.NVMMASharedLayout.get_default_for([BLOCK_N, GROUP // 8], gl.int32),
            gl.NVMMASharedLayout.get_default_for([block_m, GROUP], gl.bfloat16),
            gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2))


def launch(x, packed, scale_zero, config, out=None) -> torch.Tensor:
    """x [M, K] bf16 (M <= 16) times the INT4 weight [N, K] (group 128) -> [M, N] bf16, on this path.
    config: (split, stages, registers[, one_launch_m]): x staged in the kernel itself (one launch, no prep kernel)
    at M <= one_launch_m where x's rows are 16-byte aligned, else by the prep kernel."""
    split, stages, regs, *rest = config
    M, K = x.shape
    N = packed.shape[0]
    n_g = K // GROUP // split if K % (GROUP * split) == 0 else 0
    if M > 16 or n_g < 1 or N % BLOCK_N:
        raise ValueError(f"int4_gluon: M={M} (<= 16), K={K} (split {split} into whole groups of {GROUP}) and "
                         f"N={N} (a multiple of {BLOCK_N}) do not fit")
    block_m = 8 if M <= 8 else 16
    one_launch = bool(rest) and M <= min(rest[0], 8) and x.stride(0) % 8 == 0 and x.data_ptr() % 16 == 0
    regs = regs if block_m == 8 else max(regs, 80)  # (a 16-wide product under 64 registers serialises its wgmma)
    y = out if out is not None else torch.empty((M, N), dtype=x.dtype, device=x.device)
    ws = torch.empty((split * M, N), dtype=torch.float32, device=x.device) if split > 1 else y
    pdl = int4_launch.USE_PDL
    trigger = pdl and triggers(N, split, x.device)  # the overlap mode (module docstring)
    follows = pdl and last_launch_triggers(x.device)  # the call's first kernel launched as a dependent
    w_layout, x_layout, words = _shared_layouts(block_m)
    w_desc = TensorDescriptor.from_tensor(packed.view(torch.int32), [BLOCK_N, GROUP // 8], w_layout)
    sz_desc = TensorDescriptor.from_tensor(scale_zero.view(torch.int32).view(K // GROUP, N), [1, BLOCK_N], words)
    if one_launch:
        x_desc = xs_desc = None
        xw = x.view(torch.int32)
    else:
        xp = torch.empty((block_m, K), dtype=torch.float16, device=x.device)
        xs = torch.empty((K // GROUP, 4 * block_m), dtype=torch.float32, device=x.device)
        _prep_kernel[(K // GROUP,)](x, xp, xs, M, K, x.stride(0), GROUP=GROUP, BLOCK_M=block_m, PDL=pdl,
                                    num_warps=4, launch_pdl=follows)
        x_desc = TensorDescriptor.from_tensor(xp, [block_m, GROUP], x_layout)
        xs_desc = TensorDescriptor.from_tensor(xs, [1, 4 * block_m], words)
        xw = None
    _int4_mm_kernel[(N // BLOCK_N, split)](w_desc, x_desc, sz_desc, xs_desc, xw, y, ws, int4_launch.counters(x.device),
                                           M, N, K, x.stride(0) // 2, y.stride(0), GROUP=GROUP, BLOCK_N=BLOCK_N,
                                           BLOCK_M=block_m, SPLIT_K=split, STAGES=stages, REGS=regs, PDL=pdl,
                                           X_LAYOUT=x_layout, X_DEPTH=X_DEPTH if one_launch else 0,
                                           TRIGGER=trigger, ROWS=1 << (M - 1).bit_length() if one_launch else block_m,
                                           num_warps=4, maxnreg=regs, launch_pdl=follows if one_launch else pdl)
    note_launch(x.device, trigger)
    return y
