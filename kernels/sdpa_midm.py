"""Split-K attention for 1 <= M <= 16 query rows over a long KV cache (decode M = 1, verify M = K + 1).

  q       [B, Hq, M, D]  (any strides, last dim contiguous)
  k, v    [B, Hkv, L, D] (the static cache; last dim contiguous), Hq = G * Hkv (GQA)
  q_pos   int [M]        absolute position of each query row
  valid_len  int [1] device tensor or None: keys at positions >= valid_len are ignored
  window  0 = none, else a key at position j is visible to row m only if j > q_pos[m] - window
  k_pos   int [L] device tensor or None: the position each slot holds (-1: none), for a ring cache
          (models.target: position p in slot p % L; a window of at most L, and the call's rows within
          L - window positions of each other, as the ring's slack makes them); None: a flat cache, key j at
          position j
A key is visible to row m iff its position j satisfies q_pos[m] - window < j <= q_pos[m] (and j < valid_len); on
a ring, the slot must hold it: k_pos[j % L] == j, which for every slot s is k_pos[s] in that range and >= 0. The
range of positions read, [lo, end) with end = max(q_pos) + 1 and lo = min(q_pos) - window + 1 (0 without a
window), is computed on the device, so the launch has no host sync and can be captured in a CUDA graph; a CUDA
graph reads the live `k_pos`, which the model rewrites in place.

Positions, not slots, are cut into splits of SPLIT_KEYS (CONFIG["split_keys"]), split s holding positions
[s * SPLIT_KEYS, (s + 1) * SPLIT_KEYS), and a split's tiles walk its positions in order, loading position j from
slot j % L on a ring. So a row meets the same splits, tiles and summation order in every call, whatever the other
rows, the call's width and however often the ring has wrapped: its output bits depend on its own position and the
keys at its visible positions, which is what the engine's exact mode needs (a call's last position moving the
boundaries made one SmolLM2 prompt in four leave the K = 0 tokens at some K on the H200). Over a ring a row takes
the positions, splits and tiles it takes over the flat cache the ring stands for (as models/exact_sdpa.cpp walks a
row's positions at their slots), so it gets the same bits wherever the reduce merges as many splits at a time. The
work follows the window and the context, not the cache: only the splits in [lo, end) are computed and merged.

Kernel 1 (grid PROGRAMS x B*Hkv): a program owns one KV head and a run of consecutive splits of the call's range
(PROGRAMS fills one wave of programs, see `default_programs`; which program computes a split does not change its
bits). All G*M query rows of that KV head (G heads x M rows, padded to BLOCK_R >= 16) stay resident, so each K/V
tile is loaded once for every q head and every row: KV traffic is independent of G and M. Online softmax in fp32
(exp2 domain) gives a partial (m, l, acc) per row and split. Kernel 2 (grid B*Hkv x G*M; programmatic dependent
launch on the GPU, so it is scheduled while kernel 1 runs) merges a row's own splits (from the one of its first
visible position to the one of its last, in order, REDUCE_BLOCK at a time from its first) with a log-sum-exp reduce
and writes the output as a [B, M, Hq, D] buffer returned as its [B, Hq, M, D] view, so the usual
`.transpose(1, 2).reshape(B, M, Hq*D)` that follows is free.

`sdpa_reference` is the PyTorch definition the tests compare against.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kernels._jit import TUNED_SMS, lazy_jit, note_launch, pdl_capable, sm_count
from kernels.rule import SMALL_M_LIMIT

MAX_M = SMALL_M_LIMIT  # the most query rows a call takes (kernels.rule)
LOG2E = 1.4426950408889634


# ----------------------------------------------------------------------------- reference

def visible(q_pos: torch.Tensor, L: int, valid_len=None, window: int = 0, k_pos=None) -> torch.Tensor:
    """bool [M, L]: slot j visible to query row m; slot j holds position j, or k_pos[j] on a ring (-1: none)."""
    j = torch.arange(L, device=q_pos.device) if k_pos is None else k_pos
    mask = (j[None, :] <= q_pos[:, None]) & (j[None, :] >= 0)
    if valid_len is not None:
        mask = mask & (j[None, :] < valid_len.reshape(-1)[:1])
    if window:
        mask = mask & (j[None, :] > q_pos[:, None] - window)
    return mask


def sdpa_reference(q, k, v, q_pos, valid_len=None, window: int = 0, scale: float | None = None, k_pos=None):
    """Attention in float32, written out: softmax(q k^T * scale, masked) v with GQA. -> [B, Hq, M, D] in q's dtype."""
    B, Hq, M, D = q.shape
    G = Hq // k.shape[1]
    scale = D ** -0.5 if scale is None else scale
    kf = k.float().repeat_interleave(G, dim=1)
    vf = v.float().repeat_interleave(G, dim=1)
    s = (q.float() @ kf.transpose(-2, -1)) * scale
    s = s.masked_fill(~visible(q_pos, k.shape[2], valid_len, window, k_pos), float("-inf"))
    return (torch.softmax(s, dim=-1) @ vf).to(q.dtype)


# ----------------------------------------------------------------------------- kernels

@lazy_jit(do_not_specialize=["M", "SPLITS", "PROGRAMS", "window"])
def _sdpa_split_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, kpos_ptr, vlen_ptr, ml_ptr, acc_ptr,
                       M, L, qk_scale, window,
                       stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kl,
                       stride_vb, stride_vh, stride_vl,
                       SPLITS, PROGRAMS, SPLIT_KEYS: tl.constexpr, H_KV: tl.constexpr, G: tl.constexpr,
                       M_PAD: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr,
                       HAS_VLEN: tl.constexpr, HAS_WINDOW: tl.constexpr, RING: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        gdc_launch_dependents()  # the reduce grid may be scheduled now; it waits for this grid's writes
    pid_p = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H_KV
    h = pid_bh % H_KV
    r = tl.arange(0, BLOCK_R)  # row r = head g * M_PAD + query row m
    g = r // M_PAD
    m = r % M_PAD
    row_ok = (g < G) & (m < M)
    pos = tl.load(pos_ptr + m, mask=row_ok, other=-1).to(tl.int32)
    # The call's positions [lo, end); a ring's run past its L slots. Kernel 2 repeats lo's computation.
    last_pos = tl.max(pos, axis=0)
    end = last_pos + 1
    if not RING:
        end = tl.minimum(end, L)
    if HAS_VLEN:
        end = tl.minimum(end, tl.load(vlen_ptr).to(tl.int32))
    lo = last_pos * 0
    if HAS_WINDOW:
        lo = tl.maximum(tl.min(tl.where(row_ok, pos, last_pos), axis=0) - window + 1, 0)
    s_first = lo // SPLIT_KEYS
    # splits [s_first, s_first + busy) hold positions of this call; partial i of a head is split s_first + i
    busy = tl.maximum(tl.minimum(tl.cdiv(end, SPLIT_KEYS) - s_first, SPLITS), 0)
    per = tl.cdiv(busy, PROGRAMS)  # this program's splits: [pid_p * per, +per), in one run of key tiles
    t_lo = (s_first + pid_p * per) * SPLIT_KEYS
    t_hi = tl.minimum(tl.minimum((s_first + (pid_p + 1) * per) * SPLIT_KEYS, end), (s_first + busy) * SPLIT_KEYS)

    d = tl.arange(0, D)
    q = tl.load(q_ptr + b * stride_qb + (h * G + g)[:, None] * stride_qh + m[:, None] * stride_qm + d[None, :],
                mask=row_ok[:, None], other=0.0)
    k_base = k_ptr + b * stride_kb + h * stride_kh
    v_base = v_ptr + b * stride_vb + h * stride_vh
    m_i = tl.full((BLOCK_R,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_R,), tl.float32)
    acc = tl.zeros((BLOCK_R, D), tl.float32)
    n = tl.arange(0, BLOCK_N)
    # One loop over the tiles of all this program's splits (so the loads stay pipelined across split boundaries);
    # the state restarts at each split's first tile and is stored after its last: every split computes exactly
    # what a program of its own would, whichever program runs it.
    for j0 in range(t_lo, t_hi, BLOCK_N):  # (offset loop: the interpreter cannot range over loads)
        first = j0 % SPLIT_KEYS == 0
        m_i = tl.where(first, float("-inf"), m_i)
        l_i = tl.where(first, 0.0, l_i)
        acc = tl.where(first, 0.0, acc)
        j = j0 + n  # positions
        j_ok = j < t_hi
        slot = j
        if RING:
            slot = j % L
        kt = tl.load(k_base + slot[:, None] * stride_kl + d[None, :], mask=j_ok[:, None], other=0.0)
        s = tl.dot(q, tl.trans(kt)) * qk_scale  # log2 domain
        vis = (j[None, :] <= pos[:, None]) & j_ok[None, :]
        if HAS_WINDOW:
            vis = vis & (j[None, :] > pos[:, None] - window)
        if RING:  # the slot holds position j (not an older or a newer one, nor none)
            held = tl.load(kpos_ptr + slot, mask=j_ok, other=-1).to(tl.int32)
            vis = vis & (held == j)[None, :]
        s = tl.where(vis, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet stays 0
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        vt = tl.load(v_base + slot[:, None] * stride_vl + d[None, :], mask=j_ok[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt)
        m_i = m_new
        if ((j0 + BLOCK_N) % SPLIT_KEYS == 0) | (j0 + BLOCK_N >= t_hi):  # the split's last tile
            part = pid_bh * SPLITS + j0 // SPLIT_KEYS - s_first
            tl.store(ml_ptr + (part * 2) * BLOCK_R + r, m_i)
            tl.store(ml_ptr + (part * 2 + 1) * BLOCK_R + r, l_i)
            tl.store(acc_ptr + (part * BLOCK_R + r)[:, None] * D + d[None, :], acc,
                     mask=row_ok[:, None])  # padding: unread


@lazy_jit(do_not_specialize=["M", "SPLITS", "window"])
def _sdpa_reduce_kernel(ml_ptr, acc_ptr, o_ptr, pos_ptr, vlen_ptr, M, L, window, stride_ob, stride_oh, stride_om,
                        SPLITS, SPLIT_KEYS: tl.constexpr, H_KV: tl.constexpr, G: tl.constexpr, M_PAD: tl.constexpr,
                        BLOCK_R: tl.constexpr, D: tl.constexpr, BLOCK_S: tl.constexpr, HAS_VLEN: tl.constexpr,
                        HAS_WINDOW: tl.constexpr, RING: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        gdc_launch_dependents()  # the next kernel (o_proj's GEMM) may start now; it waits for this grid's writes
        gdc_wait()  # every split's partial is written past this point
    pid_bh = tl.program_id(0)
    pid_r = tl.program_id(1)  # = g * M + m over the valid rows
    g = pid_r // M
    m = pid_r % M
    r = g * M_PAD + m
    b = pid_bh // H_KV
    h = pid_bh % H_KV
    # The row's own splits, from the one of its first visible position to the one of its last, merged in blocks
    # from its first: the set and the order of the merge follow its position alone (the call's other rows may
    # have busied more splits; this row saw nothing there). The call's first split, as kernel 1 found it, only
    # locates the partials.
    pos_m = tl.load(pos_ptr + m).to(tl.int32)
    last = pos_m + 1
    if not RING:
        last = tl.minimum(last, L)
    if HAS_VLEN:
        last = tl.minimum(last, tl.load(vlen_ptr).to(tl.int32))
    row_lo = pos_m * 0
    call_lo = pos_m * 0
    if HAS_WINDOW:
        i = tl.arange(0, M_PAD)
        call_pos = tl.load(pos_ptr + i, mask=i < M, other=0).to(tl.int32)
        call_lo = tl.maximum(tl.min(tl.where(i < M, call_pos, pos_m), axis=0) - window + 1, 0)
        row_lo = tl.maximum(pos_m - window + 1, 0)
    s_first = call_lo // SPLIT_KEYS
    s_end = tl.minimum(tl.cdiv(last, SPLIT_KEYS), s_first + SPLITS)
    d = tl.arange(0, D)
    m_run = tl.max(tl.full((BLOCK_S,), float("-inf"), tl.float32), axis=0)
    num = tl.zeros((D,), tl.float32)
    den = tl.sum(tl.zeros((BLOCK_S,), tl.float32), axis=0)
    for s0 in range(row_lo // SPLIT_KEYS, s_end, BLOCK_S):  # blocks of BLOCK_S splits in order, merged online
        s_ok = s0 + tl.arange(0, BLOCK_S) < s_end
        part = pid_bh * SPLITS + s0 + tl.arange(0, BLOCK_S) - s_first
        m_s = tl.load(ml_ptr + (part * 2) * BLOCK_R + r, mask=s_ok, other=float("-inf"))
        l_s = tl.load(ml_ptr + (part * 2 + 1) * BLOCK_R + r, mask=s_ok, other=0.0)
        acc = tl.load(acc_ptr + (part * BLOCK_R + r)[:, None] * D + d[None, :], mask=s_ok[:, None], other=0.0)
        m_new = tl.maximum(m_run, tl.max(m_s, axis=0))
        c = tl.where(m_run == float("-inf"), 0.0, tl.exp2(m_run - m_new))
        w = tl.where(m_s == float("-inf"), 0.0, tl.exp2(m_s - m_new))
        num = num * c + tl.sum(w[:, None] * acc, axis=0)
        den = den * c + tl.sum(w * l_s, axis=0)
        m_run = m_new
    out = num / den
    tl.store(o_ptr + b * stride_ob + (h * G + g) * stride_oh + m * stride_om + d, out.to(o_ptr.dtype.element_ty))


# ----------------------------------------------------------------------------- launch

# Launch configuration. block_n, warps, stages and programs_per_sm were tuned on the H200
# (bench/results/h200-sdpa-tune.json; `python -m bench.lab.kernel_tune --sdpa` redoes them); split_keys, the keys a
# split holds, on the H100 (bench/results/h100-sdpa-context.json; `python -m bench.lab.sdpa_context`).
CONFIG = dict(block_n=64, warps=4, stages=3, programs_per_sm=2, split_keys=256)
USE_PDL = True  # programmatic dependent launch of the reduce kernel (GPU only)
REDUCE_BLOCK = 128  # the most splits the reduce merges at a time (one block up to a 32K cache of 256-key splits)


def split_count(L: int, split_keys: int, ring: bool = False) -> int:
    """The partials a KV head keeps: a flat cache of L keys has a split every `split_keys` positions from 0; a call
    on a ring of L slots reads at most L consecutive positions (window + the rows' spread, which the ring's slack
    holds), which meet one split more than L keys from a boundary do."""
    return triton.cdiv(L, split_keys) + ring


def default_programs(L: int, heads: int, split_keys: int, sms: int = TUNED_SMS, ring: bool = False) -> int:
    """Split programs per KV head: enough for CONFIG programs per SM in one wave (a second, partial wave of
    short programs costs a pipeline fill and drain each), and no more than the cache has splits. Program p takes
    the p-th run of consecutive splits of the call's range, so a short context leaves the others idle at once."""
    want = max(1, CONFIG["programs_per_sm"] * sms // heads)
    return min(want, split_count(L, split_keys, ring))


def launch_sdpa(q, k, v, q_pos, valid_len=None, window: int = 0, scale: float | None = None, k_pos=None,
                split_keys: int | None = None, programs: int | None = None, block_n: int | None = None,
                warps: int | None = None, stages: int | None = None):
    B, Hq, M, D = q.shape
    _, Hkv, L, _ = k.shape
    ring = k_pos is not None
    if M > MAX_M:
        raise ValueError(f"sdpa_midm takes M <= {MAX_M} query rows; got {M} (use the dense path)")
    if Hq % Hkv or D & (D - 1) or k.stride(-1) != 1 or v.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("sdpa_midm needs Hq % Hkv == 0, power-of-2 head_dim and contiguous last dims")
    if ring and (not 0 < window <= L or k_pos.shape != (L,)):
        raise ValueError(f"sdpa_midm on a ring needs k_pos [L={L}] (got {list(k_pos.shape)}) and a window of 1 to L "
                         f"positions (got {window})")
    block_n = block_n or CONFIG["block_n"]
    split_keys = split_keys or CONFIG["split_keys"]
    if split_keys % block_n:
        raise ValueError(f"sdpa_midm: split_keys ({split_keys}) must be a multiple of block_n ({block_n})")
    warps = warps or CONFIG["warps"]
    stages = stages or CONFIG["stages"]
    G = Hq // Hkv
    m_pad = triton.next_power_of_2(M)
    block_r = max(16, triton.next_power_of_2(G) * m_pad)
    splits = split_count(L, split_keys, ring)
    programs = min(programs or default_programs(L, B * Hkv, split_keys, sm_count(q.device), ring), splits)
    scale = D ** -0.5 if scale is None else scale
    ml = torch.empty((B * Hkv * splits * 2, block_r), dtype=torch.float32, device=q.device)
    acc = torch.empty((B * Hkv * splits * block_r, D), dtype=torch.float32, device=q.device)
    out = torch.empty((B, M, Hq, D), dtype=q.dtype, device=q.device).transpose(1, 2)
    vlen = valid_len if valid_len is not None else q_pos
    pdl = USE_PDL and pdl_capable(q.device)
    flags = dict(SPLIT_KEYS=split_keys, H_KV=Hkv, G=G, M_PAD=m_pad, BLOCK_R=block_r, D=D,
                 HAS_VLEN=valid_len is not None, HAS_WINDOW=window > 0, RING=ring, PDL=pdl)
    _sdpa_split_kernel[(programs, B * Hkv)](
        q, k, v, q_pos, k_pos if ring else q_pos, vlen, ml, acc, M, L, scale * LOG2E, window,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), splits, programs,
        BLOCK_N=block_n, num_warps=warps, num_stages=stages, **flags)
    _sdpa_reduce_kernel[(B * Hkv, G * M)](
        ml, acc, out, q_pos, vlen, M, L, window, out.stride(0), out.stride(1), out.stride(2), splits,
        BLOCK_S=min(REDUCE_BLOCK, triton.next_power_of_2(splits)),
        num_warps=4 if splits * D <= 8192 else 8, **flags, **({"launch_pdl": True} if pdl else {}))
    note_launch(q.device, pdl)
    return out


@torch.library.triton_op("eagle3::sdpa_midm", mutates_args=())
def sdpa_midm(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
              valid_len: torch.Tensor | None = None, window: int = 0, scale: float | None = None,
              k_pos: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of M <= 16 query rows over the cache (a ring with `k_pos`); see the module docstring.
    -> [B, Hq, M, D]."""
    return launch_sdpa(q, k, v, q_pos, valid_len, window, scale, k_pos)


@sdpa_midm.register_fake
def _(q, k, v, q_pos, valid_len=None, window=0, scale=None, k_pos=None):
    B, Hq, M, D = q.shape
    return q.new_empty((B, M, Hq, D)).transpose(1, 2)
