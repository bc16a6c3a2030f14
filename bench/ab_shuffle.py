"""Temporary (fifteenth session): item 25's direct kernel (no producer, no ring: each warp loads its weight words
D groups ahead straight into its mma.sync A fragment's registers) on weights stored shuffled, so that every load
instruction of a program reads one contiguous piece (a warp's 32 lanes x 16 bytes, the program's warps side by side,
and a column tile's groups one after another), as the bare read does, instead of 64-byte row segments 2-10 KB apart.
Item 25 found the row-major stream alone (`stream`: the loads only, xor-folded) as slow as the whole shipped call;
this asks whether the layout was why. Row-major and shuffled side by side, the stream and the GEMM.

    python3 -m bench.ab_shuffle $OUT/ab_shuffle.json
"""

from __future__ import annotations

import json
import sys

import torch
import triton
import triton.language as tl
from triton import constexpr_function
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

from kernels.int4_gluon import _a_operand, _gdc_launch, _gdc_wait

GROUP = 128
XS = 32  # floats per group in the sums buffer


@triton.jit
def _prep_b_kernel(x_ptr, xb_ptr, xs_ptr, M, K, stride_xm, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
                   PDL: tl.constexpr):
    """int4_gemm's prep, with the fragment order's words further transposed per group ([16 j, 4 t] -> [4 t, 16 j])
    so that a lane's B fragment of a group (words 4 j + t, j = 0..15) is 64 contiguous bytes."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    g = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, GROUP)
    x = tl.load(x_ptr + offs_m[:, None] * stride_xm + g * GROUP + cols[None, :], mask=(offs_m < M)[:, None],
                other=0.0)
    tl.store(xs_ptr + g * 32 + offs_m, tl.sum(x.to(tl.float32), axis=1))
    x = tl.reshape(tl.permute(tl.reshape(x, (BLOCK_M, 4, GROUP // 32, 2, 4)), (0, 2, 4, 1, 3)), (BLOCK_M, GROUP))
    x = tl.reshape(tl.permute(tl.reshape(x, (BLOCK_M, GROUP // 8, 4, 2)), (0, 2, 1, 3)), (BLOCK_M, GROUP))
    tl.store(xb_ptr + offs_m[:, None] * K + g * GROUP + cols[None, :], x)


@constexpr_function
def _words_layout(NW, W, R):
    warps = [[16 << i, 0] for i in range(NW.bit_length() - 1)]
    reps = [[16 * NW << i, 0] for i in range(R.bit_length() - 1)]
    return gl.DistributedLinearLayout(reg_bases=[[0, 1], [0, 2], [8, 0]] + reps,
                                      lane_bases=[[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]],
                                      warp_bases=warps, block_bases=[], shape=[16 * NW * R, W])


@constexpr_function
def _xwords_layout(NW, W):
    """[8 rows of x, 4 W words]: lane (g, t) holds row g, words 16 t .. 16 t + 15 (W = 16 per group); every warp
    the same."""
    return gl.DistributedLinearLayout(reg_bases=[[0, 1], [0, 2], [0, 4], [0, 8]],
                                      lane_bases=[[0, 16], [0, 32], [1, 0], [2, 0], [4, 0]],
                                      warp_bases=[[0, 0]] * (NW.bit_length() - 1), block_bases=[], shape=[8, 4 * W])


@gluon.jit
def _b_operand(xw, GROUP: gl.constexpr, b_l: gl.constexpr):
    """Words [8, GROUP/2] (lane t's words are the pairs 4 j + t of the fragment order) -> bf16 B [GROUP, 8]."""
    o = gl.join((xw & 0xFFFF).to(gl.int16), (xw >> 16).to(gl.int16))  # [8, 64, e]
    o = gl.permute(gl.reshape(o, [8, 4, GROUP // 8, 2]), [2, 1, 3, 0])  # [j, t, e, n]: k = 8 j + 2 t + e
    b = gl.reshape(o, [GROUP, 8]).to(gl.bfloat16, bitcast=True)
    return gl.convert_layout(b, b_l, assert_trivial=True)


@gluon.jit
def _load_w(w_ptr, sz_ptr, w_offs, sz_offs, g, N, W: gl.constexpr):
    w = gl.load(w_ptr + w_offs + g * W, cache_modifier=".cg")  # (W: the words between two groups)
    sz = gl.load(sz_ptr + sz_offs + g * N)
    return w, sz


@gluon.jit
def _copy_w(w_ptr, sz_ptr, w_offs, sz_offs, g, N, W: gl.constexpr, w_s, sz_s):
    async_copy.async_copy_global_to_shared(w_s, w_ptr + w_offs + g * W, cache_modifier=".cg")
    async_copy.async_copy_global_to_shared(sz_s, sz_ptr + sz_offs + g * N)
    async_copy.commit_group()


@gluon.jit
def _load_x(xb_ptr, xs_ptr, x_offs, xs_offs, g, W: gl.constexpr):
    return gl.load(xb_ptr + x_offs + g * 4 * W), gl.load(xs_ptr + xs_offs + g * 32)


@gluon.jit
def _consume(acc, w, sz, xw, xsum, ok, GROUP: gl.constexpr, BLOCK_N: gl.constexpr, a_l: gl.constexpr,
             b_l: gl.constexpr, mma: gl.constexpr):
    a = _a_operand(w, BLOCK_N, GROUP, a_l, False)
    b = _b_operand(xw, GROUP, b_l)
    part = mma_v2(a, b, gl.zeros([BLOCK_N, 8], gl.float32, mma))
    s = (sz << 16).to(gl.float32, bitcast=True)
    s = gl.where(ok, s, 0.0)
    zx = ((sz & -65536).to(gl.float32, bitcast=True) + 128.0)[:, None] * xsum[None, :]
    return acc + s[:, None] * (part - zx)


@gluon.jit
def _direct_kernel(xb_ptr, xs_ptr, w_ptr, sz_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, stride_w, stride_xb, stride_ym,
                   n_g, GROUP: gl.constexpr, NW: gl.constexpr, SPLIT_K: gl.constexpr, D: gl.constexpr,
                   PDL: gl.constexpr, TRIGGER: gl.constexpr, EARLY: gl.constexpr, R: gl.constexpr,
                   MODE: gl.constexpr, S: gl.constexpr, SHUF: gl.constexpr):
    """S > 0: the weights and scale/zero words by cp.async into a ring of S stages, S - 1 groups ahead (each thread
    reads back only the words it copied itself, so no barrier); S = 0: loaded D groups ahead into registers.
    MODE 0: the GEMM; 1 (hot): every program reads the weights of the first 512 rows (in L2); 2 (stream): the
    loads only, xor-folded instead of unpacked and multiplied."""
    BLOCK_N: gl.constexpr = 16 * NW * R
    W: gl.constexpr = GROUP // 8
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NW, 1], instr_shape=[16, 8])
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    words: gl.constexpr = _words_layout(NW, W, R)
    xwords: gl.constexpr = _xwords_layout(NW, W)
    if TRIGGER:
        _gdc_launch()
    pid_n = gl.program_id(0)
    pid_k = gl.program_id(1)
    n0 = pid_n * BLOCK_N
    g0 = pid_k * n_g
    last = g0 + n_g - 1
    rows = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, words))
    cols = gl.arange(0, W, layout=gl.SliceLayout(0, words))
    if MODE == 1:
        rows = rows % 512
    if SHUF:  # `shuffle` below: a tile's groups one after another, each as the words layout's (rows, lanes, warps)
        r = rows - n0
        w_offs = (pid_n * stride_w + 16 * (r % 8) + 128 * ((r // 16) % NW) + 128 * NW * ((r // 8) % 2)
                  + 256 * NW * (r // (16 * NW)))[:, None] + cols[None, :]
        GS: gl.constexpr = BLOCK_N * W
    else:
        w_offs = rows[:, None] * stride_w + cols[None, :]
        GS: gl.constexpr = W
    offs_n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, mma))
    offs_m = gl.arange(0, 8, layout=gl.SliceLayout(0, mma))
    xr = gl.arange(0, 8, layout=gl.SliceLayout(1, xwords))
    xc = gl.arange(0, 4 * W, layout=gl.SliceLayout(0, xwords))
    x_offs = xr[:, None] * stride_xb + xc[None, :]

    ws = ()
    if S > 0:
        w_smem = gl.allocate_shared_memory(gl.int32, [S, BLOCK_N, W],
                                           gl.SwizzledSharedLayout(vec=4, per_phase=1, max_phase=1, order=[1, 0]))
        sz_smem = gl.allocate_shared_memory(gl.int32, [S, BLOCK_N],
                                            gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0]))
        for j in gl.static_range(S - 1):
            _copy_w(w_ptr, sz_ptr, w_offs, offs_n, gl.minimum(g0 + j, last), N, W, w_smem.index(j), sz_smem.index(j))
    else:
        for j in gl.static_range(D):
            ws = ws + (_load_w(w_ptr, sz_ptr, w_offs, offs_n, gl.minimum(g0 + j, last), N, GS),)
    if PDL:
        _gdc_wait()
    xs = (_load_x(xb_ptr, xs_ptr, x_offs, offs_m, g0, W), _load_x(xb_ptr, xs_ptr, x_offs, offs_m, g0, W))
    acc = gl.zeros([BLOCK_N, 8], gl.float32, mma)
    kw = gl.zeros([BLOCK_N, W], gl.int32, words)
    kx = gl.zeros([8, 4 * W], gl.int32, xwords)
    for c in range(0, n_g, D):
        g = g0 + c
        for j in gl.static_range(D):
            # x for group g + j is in slot j % 2; the other slot takes group g + j + 1
            nxt = _load_x(xb_ptr, xs_ptr, x_offs, offs_m, gl.minimum(g + j + 1, last), W)
            if j % 2 == 0:
                cur = xs[0]
                xs = (cur, nxt)
            else:
                cur = xs[1]
                xs = (nxt, cur)
            if S > 0:
                gi = c + j
                _copy_w(w_ptr, sz_ptr, w_offs, offs_n, gl.minimum(g + j + S - 1, last), N, W,
                        w_smem.index((gi + S - 1) % S), sz_smem.index((gi + S - 1) % S))
                async_copy.wait_group(S - 1)
                w = w_smem.index(gi % S).load(words)
                sz = sz_smem.index(gi % S).load(gl.SliceLayout(1, mma))
            else:
                w, sz = ws[j]
            if EARLY and S == 0:  # group g + j + D's load issued before group g + j is unpacked: D + 1 slots live
                ws = ws[:j] + (_load_w(w_ptr, sz_ptr, w_offs, offs_n, gl.minimum(g + D + j, last), N, GS),) + ws[j + 1:]
            if MODE == 2:
                kw = kw ^ w
                kx = kx ^ cur[0]
            else:
                acc = _consume(acc, w, sz, cur[0], cur[1], c + j < n_g, GROUP, BLOCK_N, a_l, b_l, mma)
            if not EARLY and S == 0:
                ws = ws[:j] + (_load_w(w_ptr, sz_ptr, w_offs, offs_n, gl.minimum(g + D + j, last), N, GS),) + ws[j + 1:]

    if MODE == 2:
        acc += (gl.sum(gl.sum(kw, 1), 0) + gl.sum(gl.sum(kx, 1), 0)).to(gl.float32)
    out_ok = (offs_n < N)[:, None] & (offs_m < M)[None, :]
    y_ptrs = y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None]
    if SPLIT_K == 1:
        gl.store(y_ptrs, acc.to(gl.bfloat16), mask=out_ok)
    else:
        gl.store(ws_ptr + (pid_k * M + offs_m[None, :]) * N + offs_n[:, None], acc, mask=out_ok)
        gl.thread_barrier()
        arrived = gl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            total = gl.zeros([BLOCK_N, 8], gl.float32, mma)
            for s_idx in gl.static_range(SPLIT_K):
                total += gl.load(ws_ptr + (s_idx * M + offs_m[None, :]) * N + offs_n[:, None], mask=out_ok,
                                 other=0.0, cache_modifier=".cg")
            gl.store(y_ptrs, total.to(gl.bfloat16), mask=out_ok)
            gl.atomic_xchg(cnt_ptr + pid_n, 0)


def shuffle(packed, nw, r):
    """[N, K/2] uint8 -> the int32 words of each column tile (16 nw r rows) and group, one after another, each
    block in the order its load instructions read it (SHUF in the kernel)."""
    N, K = packed.shape[0], packed.shape[1] * 2
    bn, W = 16 * nw * r, GROUP // 8
    row = torch.arange(bn, device=packed.device)[:, None]
    word = torch.arange(W, device=packed.device)[None, :]
    idx = (word + 16 * (row % 8) + 128 * ((row // 16) % nw) + 128 * nw * ((row // 8) % 2)
           + 256 * nw * (row // (16 * nw))).flatten()
    assert torch.equal(idx.sort().values, torch.arange(bn * W, device=packed.device))
    w = packed.view(torch.int32).view(N // bn, bn, K // GROUP, W).permute(0, 2, 1, 3).reshape(N // bn, K // GROUP, -1)
    out = torch.empty_like(w)
    out[..., idx] = w
    return out.reshape(-1)


def direct_mm(x, packed, scale_zero, config, shuf=False, mode=0):
    """config: (warps, split, D, registers, early, row tiles per warp); packed already `shuffle`d when shuf."""
    from kernels import int4_gemm as G
    nw, split, d, regs, early, r = config
    M, K = x.shape
    N = scale_zero.shape[1]
    assert M <= 8 and K % (GROUP * split) == 0 and N % (16 * nw * r) == 0 and d % 2 == 0
    xb = torch.empty((8, K), dtype=x.dtype, device=x.device)
    xs = torch.empty((K // GROUP, XS), dtype=torch.float32, device=x.device)
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    ws = torch.empty((split * M, N), dtype=torch.float32, device=x.device) if split > 1 else y
    _prep_b_kernel[(K // GROUP,)](x, xb, xs, M, K, x.stride(0), GROUP=GROUP, BLOCK_M=8, PDL=True, num_warps=4,
                                  launch_pdl=True)
    stride_w = K // 8 * 16 * nw * r if shuf else K // 8
    _direct_kernel[(N // (16 * nw * r), split)](xb.view(torch.int32), xs, packed.view(torch.int32),
                                                scale_zero.view(torch.int32), y, ws, G.counters(x.device), M, N,
                                                stride_w, K // 2, y.stride(0), K // GROUP // split, GROUP=GROUP,
                                                NW=nw, SPLIT_K=split, D=d, PDL=True, TRIGGER=False, EARLY=bool(early),
                                                R=r, MODE=mode, S=0, SHUF=bool(shuf), num_warps=nw, maxnreg=regs,
                                                launch_pdl=True)
    return y


def compile_offline(nw=1, split=1, d=4, regs=128, early=1, r=1, mode=0, shuf=1):
    """The SASS report of one config (bench.sass) on a machine without a GPU."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from bench.sass import report
    sig = dict(xb_ptr="*i32", xs_ptr="*fp32", w_ptr="*i32", sz_ptr="*i32", y_ptr="*bf16", ws_ptr="*fp32",
               cnt_ptr="*i32", M="i32", N="i32", stride_w="i32", stride_xb="i32", stride_ym="i32", n_g="i32")
    const = dict(GROUP=GROUP, NW=nw, SPLIT_K=split, D=d, PDL=True, TRIGGER=False, EARLY=bool(early), R=r,
                 MODE=mode, S=0, SHUF=bool(shuf))
    sig.update({k: "constexpr" for k in const})
    names = list(sig)
    aligned = [a for a in ("xb_ptr", "xs_ptr", "w_ptr", "sz_ptr", "y_ptr", "ws_ptr", "cnt_ptr", "N", "stride_w",
                           "stride_xb", "stride_ym")]
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    src = GluonASTSource(fn=_direct_kernel, signature=sig, constexprs=const, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=nw, maxnreg=regs))
    return k, report(k, f"direct nw={nw} split={split} D={d} regs={regs} shuf={shuf}")


# (warps, split, D, registers, early, row tiles per warp) per shape
SHAPES = {
    (5376, 21504): [(1, 1, 4, 128, 1, 1), (4, 1, 2, 96, 1, 1), (8, 1, 2, 96, 1, 1)],
    (4096, 14336): [(1, 2, 4, 128, 1, 1), (4, 2, 2, 96, 1, 1), (8, 1, 2, 96, 1, 1)],
    (21504, 5376): [(1, 4, 4, 128, 1, 1), (4, 4, 2, 96, 1, 1), (8, 4, 2, 96, 1, 1)],
    (8192, 28672): [(1, 1, 4, 128, 1, 1), (4, 1, 2, 96, 1, 1), (8, 1, 2, 96, 1, 1)],
}


def main():
    from bench import kernels as B
    from kernels import int4_gemm as G
    out, res = sys.argv[1], {}
    torch.manual_seed(0)
    for (K, N), cfgs in SHAPES.items():
        copies = B.copies_for(N * K / 2)
        ops = B.gemm_operands(K, N, 128, copies)
        shuffled = {(c[0], c[5]): [shuffle(p, c[0], c[5]) for p, _ in ops] for c in cfgs}
        bad = []
        for M in (1, 3, 8):
            x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
            ref = G.int4_mm_reference(x, *ops[0], 128)
            for c in cfgs:
                for shuf in (0, 1):
                    w = shuffled[(c[0], c[5])][0] if shuf else ops[0][0]
                    e = B.rel_err(direct_mm(x, w, ops[0][1], c, shuf), ref)
                    if not e < 4e-3:
                        bad.append((M, c, shuf, e))
        B.log(f"{K}x{N} check: " + (f"BAD {bad}" if bad else "every config and layout within 4e-3 at M = 1, 3, 8"))
        for M in (1, 8):
            xs = [torch.randn(M, K, device="cuda").to(torch.bfloat16) for _ in range(copies)]
            variants = {"shipped": lambda i: G.int4_mm(xs[i], *ops[i], 128)}
            for c in cfgs:
                for shuf in (0, 1):
                    for mode in ((0, 2) if M == 1 else (0,)):
                        name = f"{c} {'shuffled' if shuf else 'rows'}{' stream' if mode else ''}"
                        variants[name] = (lambda i, c=c, shuf=shuf, mode=mode: direct_mm(
                            xs[i], shuffled[(c[0], c[5])][i] if shuf else ops[i][0], ops[i][1], c, shuf, mode))
            t = {}
            for rnd in range(3):
                for name, f in variants.items():
                    t.setdefault(name, []).append(B.time_calls([lambda i=i: f(i) for i in range(copies)]))
            med = {k: sorted(v)[1] for k, v in t.items()}
            res[f"{K}x{N} M={M}"] = dict(median_us=med, rounds=t)
            floor = B.weight_bytes(K, N, 128) / 4.26e6
            B.log(f"{K}x{N} M={M} (floor {floor:.1f}): " + "; ".join(f"{k} {v:.2f}" for k, v in med.items()))
            json.dump(res, open(out, "w"), indent=1)
        del ops, shuffled
        torch.cuda.empty_cache()


if __name__ == "__main__" and sys.argv[1] != "sass":
    main()

if __name__ == "__main__" and sys.argv[1] == "sass":
    k, r = compile_offline(*[int(a) for a in sys.argv[2:]])
    for key, val in r.items():
        print(f"{key}: {val}")
    open("/tmp/direct.ptx", "w").write(k.asm["ptx"])
