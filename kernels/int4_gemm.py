"""INT4 weight-only GEMM for small M: every weight byte is read once for all M <= 16 activation rows.

Format: models.quantize's w4 (`quantize_w4` writes it, `dequantize_w4` defines it; group g in W4_GROUPS):
  packed uint8 [N, K/2]  byte j of row n holds k = 2j in the low nibble and k = 2j+1 in the high nibble;
  scale_zero   bf16 [K/g, N, 2]: [..., 0] the scale, [..., 1] the zero (group-major, so one group's values for
               a tile of columns are contiguous, and a column's pair is one 32-bit word; tinygemm's layout);
  w[n, k] = (q[n, k] - zero[k // g, n]) * scale[k // g, n], with q in 0..15 and the zero an integer code in
  0..15, or any bf16 number for a group that is a 4-bit grid already (every kernel applies the zero in float32).

Two launches per call. `_int4_prep_kernel` reads x once and writes what every program of the GEMM would
otherwise recompute: x with the k order inside each group permuted (see below) and the per-group sums
X[m, g] = sum over the group of x[m, k] in float32. `_int4_mm_kernel`: one program owns BLOCK_N output
columns (and one of SPLIT_K slices of K). The weights are the left operand of the tensor-core product, so
the tile [BLOCK_N, k] is dequantised in registers and the M activation rows (padded to BLOCK_M = 16, the
width of Triton's smallest tensor-core dot) are the right operand, streamed from global to shared memory
untouched: weight traffic does not grow with M.
Dequantisation is about one integer op per weight: q | 0x4300 read as bf16 is exactly 128 + q, the
products against x run on the tensor cores, and the group's affine map is applied to the [BLOCK_N, 16]
partial sum instead of to every weight:
  sum_k x_k (q_k - z) s = s * (sum_k x_k (128 + q_k) - (128 + z) * X).
The weights are read as 32-bit words; one shift + one lop3 turns nibbles s and s+4 of a word into a
bf16x2 register. The k order inside a group is permuted (on x and the weights alike; the product sums
over k, so this is exact) so that each thread's tensor-core fragment comes from 4 contiguous words (one
16-byte load). All of it is elementwise tensor code, so the interpreter runs the same permutation the GPU
does (only the single lop3 is inline PTX, replaced by plain and/or there). With SPLIT_K > 1 each program
writes an fp32 partial; the last program of a column tile to arrive (kernels/int4_launch.py's counters)
sums the partials in split order and writes the output, so the result is deterministic.
On the GPU the GEMM is launched with programmatic dependent launch (`int4_launch.USE_PDL`): its programs
start while the prep kernel finishes and wait (griddepcontrol.wait) before the first read of its output.
Measured on the H200: docs/results.md.

On a Hopper GPU `int4_mm` hands the shapes kernels/int4_gluon.py is tuned for (and large untuned ones) to that
kernel, the same arithmetic warp-specialised in Gluon. The import goes one way: what both kernels need at
launch (the row limit, the PDL switch, the split-K counters) lives in kernels/int4_launch.py.

`int4_mm_reference` is the PyTorch definition (dequantise, then matmul) the tests compare against.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kernels import int4_gluon, int4_launch
from kernels._jit import TUNED_SMS, compiled, lazy_jit, note_launch, pdl_capable, sm_count
from kernels.int4_launch import BLOCK_M, MAX_TILES, counters
from models.quantize import dequantize_w4, unpack_w4

USE_PTX = True  # the one-instruction lop3 on the GPU (False: plain and/or, same values, one more op per pair)


# ----------------------------------------------------------------------------- reference

def int4_mm_reference(x: torch.Tensor, packed, scale_zero, group: int) -> torch.Tensor:
    """x [M, K] @ dequantize_w4(w).T -> [M, N] in x's dtype."""
    return x @ dequantize_w4(packed, scale_zero, group, x.dtype).t()


# ----------------------------------------------------------------------------- torch's int4 GEMM

def to_tinygemm(packed, scale_zero, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Our (packed, scale_zero) -> the operands of torch's int4 GEMM (tinygemm) on the same device, the same
    weights exactly: it dequantises w = (q - 8) * scale + zero_f, so zero_f = (8 - zero) * scale. On CUDA its
    packing takes even k in the high nibble and inner k tiles (8 where K allows) that divide K / 16 (SmolLM2's
    K = 576 takes 4); on the CPU it takes the unpacked values."""
    q = unpack_w4(packed).to(torch.int32)
    inner = next(t for t in (8, 4, 2) if q.shape[1] % (16 * t) == 0)
    if packed.is_cuda:
        w = torch.ops.aten._convert_weight_to_int4pack(((q[:, 0::2] << 4) | q[:, 1::2]).to(torch.uint8).contiguous(),
                                                       inner)
    else:
        w = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.contiguous(), inner)
    s, zero = scale_zero.float().unbind(-1)
    return w, torch.stack((s, (8 - zero) * s), dim=-1).to(torch.bfloat16).contiguous()  # [K/g, N, 2]


def tinygemm_mm(x: torch.Tensor, w: torch.Tensor, sz: torch.Tensor, group: int) -> torch.Tensor:
    """x [M, K] bf16 times to_tinygemm's weight -> [M, N] bf16, through torch's int4 GEMM."""
    if x.is_cuda:
        return torch.ops.aten._weight_int4pack_mm(x, w, group, sz)
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, w, group, sz)


# ----------------------------------------------------------------------------- kernel

@lazy_jit(do_not_specialize=["M"])
def _int4_prep_kernel(x_ptr, xp_ptr, xs_ptr, M, K, stride_xm, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
                      PDL: tl.constexpr):
    """One program per group g of k: xp[:M, group] = x[:, group] in the fragment order and xs[m, g] = its sum
    (xs: [BLOCK_M, K/g], rows >= M zero)."""
    if PDL:
        gdc_launch_dependents()  # the GEMM's programs may be scheduled now; they wait for this grid's writes
    g = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    cols = tl.arange(0, GROUP)
    x = tl.load(x_ptr + offs_m[:, None] * stride_xm + g * GROUP + cols[None, :], mask=m_ok[:, None], other=0.0)
    tl.store(xs_ptr + offs_m * (K // GROUP) + g, tl.sum(x.to(tl.float32), axis=1))  # rows >= M: 0
    # The k order of _int4_mm_kernel's weight fragments: k = 8 (Q t + v) + s + 4 half (word Q t + v, shift s,
    # half 0 or 1 of the bf16 pair; Q = GROUP / 32) goes to position ((v * 4 + s) * 4 + t) * 2 + half.
    x = tl.reshape(tl.permute(tl.reshape(x, (BLOCK_M, 4, GROUP // 32, 2, 4)), (0, 2, 4, 1, 3)), (BLOCK_M, GROUP))
    tl.store(xp_ptr + offs_m[:, None] * K + g * GROUP + cols[None, :], x, mask=m_ok[:, None])


@lazy_jit(do_not_specialize=["M"])  # one binary for every M (1 would be specialised)
def _int4_mm_kernel(xp_ptr, xs_ptr, w_ptr, sz_ptr, y_ptr, ws_ptr, cnt_ptr,
                    M, N, K, stride_ym,
                    GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    BLOCK_M: tl.constexpr, SPLIT_K: tl.constexpr, PTX: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        gdc_wait()  # the prep kernel's xp and xs are complete past this point
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    words = tl.arange(0, GROUP // 8)
    cols = tl.arange(0, GROUP)
    # K % GROUP == 0 and GROUP >= 32, so a weight row is a whole number of 16-byte vectors; without the hint
    # the compiler only knows K % 16 == 0 and splits every row into 8-byte loads.
    row_words = tl.multiple_of(K // 8, 4)
    w_rows = w_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + offs_n.to(tl.int64)[:, None] * row_words
    x_rows = xp_ptr + offs_m[:, None] * K
    k_len = tl.multiple_of(K // SPLIT_K, BLOCK_K)  # the launcher checks K % (SPLIT_K * BLOCK_K) == 0
    k_start = pid_k * k_len
    Q: tl.constexpr = GROUP // 32
    G_ALL = K // GROUP
    NG: tl.constexpr = BLOCK_K // GROUP
    g_last = (k_start + k_len) // GROUP - 1

    # A group's scale, zero and X are plain loads, and under the weight stream they return only after the
    # weight tiles already in flight: loaded in the group that uses them, they would be the kernel's largest
    # stall (Nsight Compute, docs/results.md). So the first two groups of each k-tile get theirs a whole k-tile
    # ahead: each slot is reloaded, for the next k-tile, after its last use, and holds the loaded 32-bit
    # words untouched until then (a conversion or a register copy at the back-edge would wait for the load).
    # sz_ptr is scale_zero read as int32: a column's (scale, zero) pair is one word, scale in the low half.
    g = k_start // GROUP
    xs0 = tl.load(xs_ptr + offs_m * G_ALL + g)  # [BLOCK_M], zero past M
    sz0 = tl.load(sz_ptr + g * N + offs_n, mask=n_ok)
    g = tl.minimum(g + 1, g_last)
    xs1 = tl.load(xs_ptr + offs_m * G_ALL + g)
    sz1 = tl.load(sz_ptr + g * N + offs_n, mask=n_ok)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(0, k_len, BLOCK_K):  # (offset loop: the interpreter cannot range over program ids)
        for j in tl.static_range(NG):
            kg = tl.multiple_of(k_start + k0 + j * GROUP, GROUP)
            if j == 0:
                x_sum, sz = xs0, sz0
            elif j == 1:
                x_sum, sz = xs1, sz1
            else:
                g = kg // GROUP
                x_sum = tl.load(xs_ptr + offs_m * G_ALL + g)
                sz = tl.load(sz_ptr + g * N + offs_n, mask=n_ok)
            wd = tl.load(w_rows + (kg // 8 + words)[None, :], mask=n_ok[:, None])  # int32 words
            x = tl.load(x_rows + (kg + cols)[None, :], mask=m_ok[:, None], other=0.0)
            # Nibble s of a word holds k = 8 word + s (s < 8). (word >> 4s) & 0x000F000F | 0x43004300 is a
            # bf16 pair (128 + q[s], 128 + q[s+4]) in one lop3 (bf16 bits 0x4300 | q = 128 + q exactly).
            if PTX:  # force one lop3 per pair (ptxas leaves the and + or as two instructions)
                o0 = tl.inline_asm_elementwise("lop3.b32 $0, $1, 0x000F000F, 0x43004300, 0xEA;", "=r,r", [wd],
                                               dtype=tl.int32, is_pure=True, pack=1)
                o1 = tl.inline_asm_elementwise("lop3.b32 $0, $1, 0x000F000F, 0x43004300, 0xEA;", "=r,r", [wd >> 4],
                                               dtype=tl.int32, is_pure=True, pack=1)
                o2 = tl.inline_asm_elementwise("lop3.b32 $0, $1, 0x000F000F, 0x43004300, 0xEA;", "=r,r", [wd >> 8],
                                               dtype=tl.int32, is_pure=True, pack=1)
                o3 = tl.inline_asm_elementwise("lop3.b32 $0, $1, 0x000F000F, 0x43004300, 0xEA;", "=r,r", [wd >> 12],
                                               dtype=tl.int32, is_pure=True, pack=1)
            else:  # the interpreter has no inline PTX: the same values from plain ops
                o0 = (wd & 0x000F000F) | 0x43004300
                o1 = ((wd >> 4) & 0x000F000F) | 0x43004300
                o2 = ((wd >> 8) & 0x000F000F) | 0x43004300
                o3 = ((wd >> 12) & 0x000F000F) | 0x43004300
            o = tl.join(tl.join(o0, o2), tl.join(o1, o3))  # [BLOCK_N, GROUP/8 words, 4 shifts s]
            # The product sums over k, so k may be reordered on both operands. Word Q t + v (t < 4,
            # v < Q) shift s becomes fragment pair (v * 4 + s) * 4 + t: a thread holds pairs
            # t + 4i of each row in the tensor-core fragment, so its 16 pairs are its own 4 contiguous words
            # (one 16-byte load); the prep kernel stored x in the same order.
            o = tl.reshape(tl.permute(tl.reshape(o, (BLOCK_N, 4, Q, 4)), (0, 2, 3, 1)), (BLOCK_N, GROUP // 2))
            w = tl.reshape(tl.join((o & 0xFFFF).to(tl.int16), (o >> 16).to(tl.int16)), (BLOCK_N, GROUP))
            w = w.to(tl.bfloat16, bitcast=True)
            part = tl.dot(w, tl.trans(x))  # = sum_k x (q - z) + (128 + z) X,  X = the group's sum of x
            s = (sz << 16).to(tl.float32, bitcast=True)  # bf16 bits in the high half of a float32: exact
            z = (sz & -65536).to(tl.float32, bitcast=True)
            acc += s[:, None] * (part - (z + 128.0)[:, None] * x_sum[None, :])
            g = tl.minimum(kg // GROUP + NG, g_last)  # this slot's group in the next k-tile (or the last)
            if j == 0:
                xs0 = tl.load(xs_ptr + offs_m * G_ALL + g)
                sz0 = tl.load(sz_ptr + g * N + offs_n, mask=n_ok)
            elif j == 1:
                xs1 = tl.load(xs_ptr + offs_m * G_ALL + g)
                sz1 = tl.load(sz_ptr + g * N + offs_n, mask=n_ok)

    out_ok = n_ok[:, None] & m_ok[None, :]
    y_ptrs = y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None]
    if SPLIT_K == 1:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=out_ok)
    else:
        tl.store(ws_ptr + (pid_k * M + offs_m[None, :]) * N + offs_n[:, None], acc, mask=out_ok)
        tl.debug_barrier()  # every thread's partial is issued before the (release) arrival below
        arrived = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            total = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            for s_idx in tl.static_range(SPLIT_K):
                total += tl.load(ws_ptr + (s_idx * M + offs_m[None, :]) * N + offs_n[:, None], mask=out_ok,
                                 other=0.0, cache_modifier=".cg")
            tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=out_ok)
            tl.atomic_xchg(cnt_ptr + pid_n, 0)  # ready for the next launch


# ----------------------------------------------------------------------------- launch configuration

# (BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages[, register cap per thread]) per (K, N, group), from the
# tune on the H200 (bench/results/h200-int4-tune.json, "triton"; `python -m bench.lab.kernel_tune` redoes it).
# Other shapes: `default_config`.
CONFIGS: dict[tuple[int, int, int], tuple[int, ...]] = {
    (4096, 4096, 128): (64, 256, 4, 4, 3, 96),
    (4096, 14336, 128): (64, 256, 2, 4, 3),
    (14336, 4096, 128): (64, 256, 8, 4, 3, 96),
    (5376, 21504, 128): (64, 256, 3, 4, 3, 96),
    (21504, 5376, 128): (64, 256, 6, 4, 3, 96),
    (8192, 28672, 128): (64, 256, 2, 4, 3, 96),
    (4096, 1024, 128): (64, 256, 8, 4, 3, 96),   # Llama-3-8B k_proj / v_proj
    (4096, 128256, 128): (64, 256, 1, 4, 3),     # Llama-3-8B lm_head
    (4096, 6144, 128): (64, 256, 4, 4, 3, 96),   # fused q|k|v
    (4096, 28672, 128): (64, 256, 2, 4, 3, 96),  # fused gate|up
}
MAX_SPLIT = 8  # the tuned range; every slice adds an fp32 partial that the last arriver reads back


@functools.cache  # (called on every launch of a shape the table lacks)
def default_config(N: int, K: int, group: int, sms: int = TUNED_SMS) -> tuple[int, ...]:
    """What the tune favours: 64-column tiles, 4 warps, and K split (any divisor of the k-tile count up to
    MAX_SPLIT, not only powers of 2: 5376 = 21 k-tiles of 256 runs 10% faster split 3 than whole) into
    the fewest slices that give ~4 programs per SM, each slice >= 512 deep. The kernel is latency-bound, so
    resident programs matter more than tile size."""
    block_n = 64
    block_k = 256 if K % 256 == 0 and group <= 128 else (128 if K % 128 == 0 else group)
    tiles, k_tiles = triton.cdiv(N, block_n), K // block_k
    splits = [d for d in range(1, min(k_tiles, MAX_SPLIT) + 1)
              if k_tiles % d == 0 and (d == 1 or K // d >= 512)]
    split = next((d for d in splits if tiles * d >= 4 * sms), splits[-1])
    # group 128 under a 96-register cap: 5 programs per SM instead of 4, no spills (wins on 7 of 10 tuned shapes)
    return (block_n, block_k, split, 4, 3) + ((96,) if group == 128 else ())


def pick_config(N: int, K: int, group: int, sms: int = TUNED_SMS) -> tuple[int, ...]:
    return CONFIGS.get((K, N, group)) or default_config(N, K, group, sms)


def _check(x, packed, scale_zero, group: int) -> None:
    M, K = x.shape
    N = packed.shape[0]
    if M > BLOCK_M:
        raise ValueError(f"int4_mm takes M <= {BLOCK_M} rows; got {M} (use the dense path)")
    if scale_zero.shape != (K // group, N, 2) or scale_zero.dtype != torch.bfloat16 or not scale_zero.is_contiguous():
        raise ValueError(f"scale_zero must be contiguous bfloat16 [K/g, N, 2] = [{K // group}, {N}, 2]; got "
                         f"{scale_zero.dtype} {list(scale_zero.shape)} (contiguous: {scale_zero.is_contiguous()})")


def launch_int4_mm(x, packed, scale_zero, group: int, config=None, out=None) -> torch.Tensor:
    """Launch the two kernels (no op registration): x [M, K] bf16, M <= 16 -> y [M, N] bf16."""
    M, K = x.shape
    N = packed.shape[0]
    _check(x, packed, scale_zero, group)
    block_n, block_k, split, warps, stages, *max_regs = config or pick_config(N, K, group, sm_count(x.device))
    if K % (split * block_k) or block_k % group:
        raise ValueError(f"config {config} does not tile K={K} with group {group}")
    grid = (triton.cdiv(N, block_n), split)
    if grid[0] > MAX_TILES:
        raise ValueError(f"N={N} needs {grid[0]} column tiles; the counter buffer has {MAX_TILES}")
    y = out if out is not None else torch.empty((M, N), dtype=x.dtype, device=x.device)
    xp = torch.empty((M, K), dtype=x.dtype, device=x.device)
    xs = torch.empty((BLOCK_M, K // group), dtype=torch.float32, device=x.device)
    ws = torch.empty((split * M, N), dtype=torch.float32, device=x.device) if split > 1 else y
    cnt = counters(x.device) if split > 1 else y
    pdl = int4_launch.USE_PDL and pdl_capable(x.device)
    _int4_prep_kernel[(K // group,)](x, xp, xs, M, K, x.stride(0), GROUP=group, BLOCK_M=BLOCK_M, PDL=pdl,
                                     num_warps=4)
    sz = scale_zero.view(torch.int32)  # [K/g, N, 1]: one word per (group, column)
    _int4_mm_kernel[grid](xp, xs, packed, sz, y, ws, cnt, M, N, K, y.stride(0),
                          GROUP=group, BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_M=BLOCK_M, SPLIT_K=split,
                          PTX=USE_PTX and compiled(), PDL=pdl, num_warps=warps, num_stages=stages,
                          **({"launch_pdl": True} if pdl else {}),
                          **({"maxnreg": max_regs[0]} if max_regs else {}))
    note_launch(x.device, False)
    return y


@torch.library.triton_op("eagle3::int4_mm", mutates_args=())
def int4_mm(x: torch.Tensor, packed: torch.Tensor, scale_zero: torch.Tensor, group: int) -> torch.Tensor:
    """x [M, K] bf16 (M <= 16) times the INT4 weight [N, K] -> [M, N] bf16. On a Hopper GPU the shapes in
    int4_gluon.CONFIGS (and untuned large ones) take the warp-specialised Gluon kernel (kernels/int4_gluon.py),
    the rest the Triton kernel above."""
    x = x.contiguous()
    usable = int4_gluon.usable(x)
    config = int4_gluon.pick(x.shape[1], packed.shape[0], group, x.device, x.shape[0]) if usable else None
    if config is None:
        return launch_int4_mm(x, packed, scale_zero, group)
    _check(x, packed, scale_zero, group)
    return int4_gluon.launch(x, packed, scale_zero, config)


@int4_mm.register_fake
def _(x, packed, scale_zero, group):
    return x.new_empty((x.shape[0], packed.shape[0]))
