"""One benchmark of the GPU kernels against their peers and the bytes floor (on a CUDA GPU).

    python -m bench.kernels --out $OUT/kernels.json [--only check,gemm,dispatch,sdpa,model] [--forced]

Sections (each writes its results into the JSON as soon as it finishes, so a cut-off run still reports):
- env: device, copy bandwidth (device-to-device copy of 2 GiB, bytes read + written / time);
- check: kernels against their references on random inputs (poisoned outputs), torch's int4 GEMM on our
  weights, and both ops replayed from a CUDA graph (programmatic dependent launch inside a graph) against
  eager calls;
- gemm: K x N in GEMM_SHAPES, M = 1..8: ours (group 128), torch `_weight_int4pack_mm` (group 128),
  bf16 cuBLAS (F.linear), and the floor = (packed weights + scales/zeros + x + y) bytes / copy bandwidth;
  ours also `alone`: each call as if a kernel not ours ran before it (no start during the previous call's
  tail; kernels/int4_gluon.py, overlap mode), as after torch's ops in a model; and `read`: one launch that
  only reads the weights' bytes (a plain read kernel or torch's sum, the faster), what the floor's bytes cost
  in one launch without any arithmetic; `read_overlap` that read overlapped back to back as our calls are, and
  `read_dep` the same waiting for its predecessor after its first 16 KB a program, as a GEMM waits for x;
- sdpa: L in {4096, 32768, 131072}, M = 1..8, Hq 32 / Hkv 8 / D 128: ours, torch SDPA with the same bool
  mask (enable_gqa), the floor = K+V bytes / copy bandwidth;
- model: Llama-3-8B shapes with random weights, CUDA-graph replays of the cached forward at 4096 and 32768
  positions, T in {1, 2, 4, 8}: ours (kernels.transform, separate and fused q|k|v, gate|up linears, with
  the RMSNorm/RoPE/SwiGLU kernels) and the same two models on torch int4 + torch SDPA; and, without the
  RMSNorm/RoPE/SwiGLU kernels (the model's own torch code), the fused model and both torch peers; and the fused
  model with programmatic dependent launch off (`fused_nopdl`: plain graph edges), to price PDL;
- dispatch: ours against torch's int4 GEMM on every linear of the supported targets, the data behind
  kernels.rule.TORCH_INT4 (`--forced`: each of our kernels forced as well).
Launch-configuration tuning and profiling live in bench/lab/kernel_tune.py.
Timing: each measurement captures a CUDA graph of many calls that rotate over enough input copies to
exceed the 60 MB L2 several times, replays it repeatedly, and reports the median per-call time.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import statistics
import time
import traceback

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kernels import int4_gemm as G
from kernels import int4_gluon, int4_launch
from kernels import sdpa_midm as S
from kernels._jit import note_launch
from models.quantize import dequantize_w4, quantize_w4

L2_BYTES = 60e6
GEMM_SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096), (5376, 21504), (21504, 5376), (8192, 28672)]
SDPA_LENGTHS = [4096, 32768, 131072]
MS = list(range(1, 9))
LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128,
                 intermediate_size=14336, rope_theta=500000.0, rms_norm_eps=1e-5)


class Report(dict):
    """The run's results by section; `save` rewrites the JSON file, so that a cut-off run still reports."""

    def __init__(self, path: str):
        super().__init__()
        self.path = path

    def save(self) -> None:
        with open(self.path, "w") as f:
            json.dump(self, f, indent=1, default=str)


def log(*a):
    print(*a, flush=True)


def copies_for(nbytes: float) -> int:
    return max(2, math.ceil(3 * L2_BYTES / max(nbytes, 1)))


def time_calls(calls, reps: int = 25, min_us: float = 2000.0) -> float:
    """Median per-call microseconds: a CUDA graph of the calls (repeated to >= min_us), replayed `reps` times."""
    for c in calls:
        c()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for c in calls:
        c()
    torch.cuda.synchronize()
    est_us = (time.perf_counter() - t0) * 1e6 / len(calls)
    inner = max(1, math.ceil(min_us / max(est_us, 1.0) / len(calls)))
    inner = min(inner, 200)
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        for _ in range(inner):
            for c in calls:
                c()
    g.replay()
    torch.cuda.synchronize()
    times = []
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(reps):
        e0.record()
        g.replay()
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1) * 1e3 / (inner * len(calls)))
    del g
    return statistics.median(times)


def rel_err(out, ref) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


# ----------------------------------------------------------------------------- env

def measure_bandwidth() -> dict:
    """Device-to-device copy of 2 GiB, bytes read + written per second. Inside a CUDA graph `copy_` becomes a
    memcpy node run by the copy engine (measured 2.7 TB/s), so the SM copy is an elementwise kernel
    (neg: one read, one write) in the graph, and the plain copy_ is also timed eagerly with events."""
    n = 1 << 30  # 2 GiB of bf16
    a = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    b = torch.empty_like(a)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < 1.0:  # bring the clocks up from idle first
        torch.neg(a, out=b)
        torch.cuda.synchronize()
    sm_us = min(time_calls([lambda: torch.neg(a, out=b)], reps=20, min_us=0) for _ in range(2))
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    eager = []
    for _ in range(10):
        e0.record()
        b.copy_(a)
        e1.record()
        e1.synchronize()
        eager.append(e0.elapsed_time(e1) * 1e3)
    del a, b
    torch.cuda.empty_cache()
    return dict(sm_copy=2 * n * 2 / (sm_us * 1e-6), eager_copy=2 * n * 2 / (statistics.median(eager) * 1e-6))


# ----------------------------------------------------------------------------- check

def section_check(report: Report):
    report["check"] = {}
    for check in (check_int4, check_sdpa, check_norm_rope, check_graph_replay):
        check(report["check"])
        report.save()


def check_graph_replay(out: dict):
    """Both ops captured in a CUDA graph (with PDL edges where enabled) give the eager result on new inputs; the
    GEMMs run in sequence (each call's output is the next one's x) through every path: Gluon with the prep kernel
    and TRIGGER (so the next call's programs start before this one ends), Gluon in one launch, Triton."""
    sequence = [(4096, 14336), (14336, 4096), (4096, 4096), (4096, 5000)]  # K x N
    weights = [tuple(t.cuda() for t in quantize_w4(torch.randn(N, K, device="cuda") * 0.02, 128))
               for K, N in sequence]
    x = torch.randn(8, 4096, device="cuda").to(torch.bfloat16)
    k, v = (torch.randn(1, 8, 9000, 128, device="cuda").to(torch.bfloat16) for _ in range(2))
    q = torch.randn(1, 32, 8, 128, device="cuda").to(torch.bfloat16)
    q_pos = torch.arange(8000, 8008, device="cuda")

    def calls():
        outs, h = [], x
        for w in weights:
            h = G.int4_mm(h, *w, 128)
            outs.append(h)
        return outs + [S.sdpa_midm(q, k, v, q_pos)]

    calls()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs_g = calls()
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        q.copy_(torch.randn_like(q))
        for o in outs_g:
            o.fill_(float("nan"))
        g.replay()
        outs = calls()
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(outs_g, outs)), "graph replay differs from the eager call"
    out["graph_replay_pdl"] = dict(gemm=int4_launch.USE_PDL, sdpa=S.USE_PDL,
                                   gemm_paths=[gemm_path(K, N) for K, N in sequence])
    log(f"check graph replay: equal to eager (PDL gemm={int4_launch.USE_PDL} sdpa={S.USE_PDL}; GEMM paths in "
        f"sequence {out['graph_replay_pdl']['gemm_paths']})")


def check_int4(out: dict):
    out["use_ptx"] = G.USE_PTX
    out["use_pdl"] = int4_launch.USE_PDL
    shapes = (None, (64, 128, 4, 4, 3), (64, 256, 2, 4, 3, 96), (128, 128, 2, 4, 4), (128, 256, 1, 8, 3))
    splits = (None, (64, 256, 3, 4, 3, 96), (64, 256, 6, 4, 3, 96))  # K = 6144: 24 k-tiles of 256
    for group, K, cfgs in ((32, 4096, shapes), (128, 4096, shapes), (128, 6144, splits)):
        N = 3000
        packed, scale_zero = (t.cuda() for t in quantize_w4(torch.randn(N, K, device="cuda"), group))
        worst = 0.0
        for M in range(1, 17):
            x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
            ref = x.double() @ dequantize_w4(packed, scale_zero, group, torch.float64).t()
            for cfg in cfgs:
                y = torch.full((M, N), float("nan"), dtype=torch.bfloat16, device="cuda")
                G.launch_int4_mm(x, packed, scale_zero, group, cfg, out=y)
                e = rel_err(y, ref) if not y.isnan().any() else float("nan")
                worst = max(worst, e) if not math.isnan(e) else float("nan")
        assert worst < 1e-2, f"int4 g{group}: rel err {worst}"
        assert not G.counters(torch.device("cuda")).any(), "split-K counters not reset"
        out[f"int4_g{group}_k{K}_worst_rel_err"] = worst
        log(f"check int4 g{group} K={K} ({len(cfgs)} configs incl. the default): worst rel err {worst:.2e}")
    # the Gluon path (kernels/int4_gluon.py) through the op, on shapes it takes: split 2 and 6, untuned unsplit,
    # one launch at M <= 8 (x staged in the kernel; M > 8 takes the prep kernel on 14336x4096, the Triton kernel
    # on 4096x4096)
    worst = 0.0
    for K, N in ((4096, 14336), (14336, 4096), (21504, 5376), (4096, 16384), (4096, 4096)):
        packed, scale_zero = (t.cuda() for t in quantize_w4(torch.randn(N, K, device="cuda"), 128))
        assert int4_gluon.pick(K, N, 128, torch.device("cuda")) is not None and int4_gluon.usable(packed)
        for M in range(1, 17):
            x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
            y = G.int4_mm(x, packed, scale_zero, 128)
            worst = max(worst, rel_err(y, x.double() @ dequantize_w4(packed, scale_zero, 128, torch.float64).t()))
    assert worst < 1e-2 and not G.counters(torch.device("cuda")).any(), f"int4 gluon: rel err {worst}"
    out["int4_gluon_worst_rel_err"] = worst
    log(f"check int4 gluon path (5 shapes, M 1..16): worst rel err {worst:.2e}")
    # the peer: torch's int4 GEMM on the same weights (to_tinygemm's packing)
    packed, scale_zero = (t.cuda() for t in quantize_w4(torch.randn(1024, 4096, device="cuda"), 128))
    x = torch.randn(4, 4096, device="cuda").to(torch.bfloat16)
    ref = x.double() @ dequantize_w4(packed, scale_zero, 128, torch.float64).t()
    err = rel_err(G.tinygemm_mm(x, *G.to_tinygemm(packed, scale_zero, 128), 128), ref)
    assert err < 1e-2, f"torch int4 on our weights: rel err {err}"
    out["tinygemm_rel_err"] = err
    log(f"check tinygemm on our weights: rel err {err:.2e}")


def check_sdpa(out: dict):
    worst = 0.0
    B, Hkv, Gq, L, D = 1, 8, 4, 5000, 128
    k, v = (torch.randn(B, Hkv, L, D, device="cuda").to(torch.bfloat16) for _ in range(2))
    for M in range(1, 17):
        q = torch.randn(B, M, Hkv * Gq, D, device="cuda").to(torch.bfloat16).transpose(1, 2)
        q_pos = torch.arange(4321, 4321 + M, device="cuda")
        vl = torch.tensor([4900], device="cuda")
        ref = S.sdpa_reference(q.double(), k.double(), v.double(), q_pos, vl)
        for launch in (dict(), dict(split_keys=96, programs=7, block_n=32, warps=8)):
            o = S.launch_sdpa(q, k, v, q_pos, vl, **launch)
            e = rel_err(o, ref)
            worst = max(worst, e) if not math.isnan(e) else float("nan")
        o = S.launch_sdpa(q, k, v, q_pos, None, window=300)
        worst = max(worst, rel_err(o, S.sdpa_reference(q.double(), k.double(), v.double(), q_pos, None, 300)))
    assert worst < 1e-2, f"sdpa: rel err {worst}"
    out["sdpa_worst_rel_err"] = worst
    log(f"check sdpa: worst rel err {worst:.2e}")


def check_norm_rope(out: dict):
    """RoPE and SwiGLU bit-exact and RMSNorm within 3 bf16 ulps of the model's own code, at Llama-3-8B sizes. (The row's
    sum of squares is reduced in another order than torch's, so the inverse RMS can differ in its last float32
    bit and the normalised value, rounded to bf16 before the weight, by one ulp; the weight, 0.5-1.5 here,
    carries that into at most 3 ulps of the product. Most draws give 0, a few 2.)"""
    from kernels.norm_rope import rms_norm, rope, swiglu
    from models.layers import RMSNorm, Rope, apply_rope

    table = Rope(128, 40000, 500000.0, 1.0, dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                                  high_freq_factor=4.0, original_max_position_embeddings=8192))
    table = table.cuda()
    norm = RMSNorm(4096, 1e-5).cuda()
    with torch.no_grad():
        norm.weight.copy_(torch.rand(4096, device="cuda") + 0.5)
    norm = norm.to(torch.bfloat16)
    rope_diff, norm_ulps, swiglu_diff = 0, 0, 0
    for T in range(1, 9):
        cos, sin = table.tables(torch.arange(33000, 33000 + T, device="cuda"))
        row = (torch.randn(1, T, 6144, device="cuda") * 4).to(torch.bfloat16)  # a fused q|k|v row
        for x, H in ((row[..., :4096], 32), (row[..., 4096:5120], 8)):
            ref = apply_rope(x.reshape(1, T, H, 128).transpose(1, 2), cos, sin)
            rope_diff += (rope(x, cos, sin, H) != ref).sum().item()
        h = (torch.randn(1, T, 4096, device="cuda") * 3).to(torch.bfloat16)
        a, b = rms_norm(h, norm.weight, norm.eps), norm(h)
        norm_ulps = max(norm_ulps, (a.view(torch.int16).int() - b.view(torch.int16).int()).abs().max().item())
        gu = (torch.randn(1, T, 2 * 14336, device="cuda") * 4).to(torch.bfloat16)  # a fused gate|up row
        gate, up = gu[..., :14336], gu[..., 14336:]
        swiglu_diff += (swiglu(gate, up) != F.silu(gate) * up).sum().item()
    assert rope_diff == 0 and norm_ulps <= 3 and swiglu_diff == 0, \
        f"rope: {rope_diff} values differ; rms_norm: {norm_ulps} ulps; swiglu: {swiglu_diff} values differ"
    out.update(rope_values_differing=rope_diff, rms_norm_max_ulps=norm_ulps, swiglu_values_differing=swiglu_diff)
    log(f"check norm/rope/swiglu: rope and swiglu bit-exact, rms_norm within {norm_ulps} ulp")


# ----------------------------------------------------------------------------- gemm

def gemm_operands(K, N, group, copies):
    ws = []
    for _ in range(copies):
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
        ws.append(quantize_w4(w, group))
    return ws


def gemm_path(K, N, group: int = 128) -> list:
    """Which kernel `int4_mm` runs for the shape here (at M <= 8), its launch config, and for the Gluon path
    whether it triggers the next kernel's launch at its start."""
    probe = torch.empty(1, device="cuda")
    gluon = int4_gluon.pick(K, N, group, probe.device) if int4_gluon.usable(probe) else None
    if gluon:
        trigger = int4_launch.USE_PDL and int4_gluon.triggers(N, gluon[0], probe.device)
        return ["gluon", *gluon] + ["trigger"] * trigger
    return ["triton", *G.pick_config(N, K, group)]


def int4_mm_alone(x, packed, scale_zero, group):
    """int4_mm launched as if a kernel that is not ours had run since our last launch (kernels._jit): its first
    kernel is a plain launch, so the call cannot start during the previous call's tail."""
    note_launch(x.device, False)
    return G.int4_mm(x, packed, scale_zero, group)


def weight_bytes(K, N, group):
    """The packed INT4 weights and their scale/zero words: what a GEMM call must read whatever M is."""
    return N * K // 2 + 2 * (K // group) * N * 2


def gemm_floor_bytes(M, K, N, group):
    return weight_bytes(K, N, group) + M * K * 2 + M * N * 2


@triton.jit
def _read_kernel(x_ptr, out_ptr, words_per_program, BLOCK: tl.constexpr, OVERLAP: tl.constexpr,
                 WAIT_FIRST: tl.constexpr):
    """Sums one contiguous chunk of int32 words per program: nothing but a read of the bytes. OVERLAP: launched as
    a programmatic dependent, it lets the next read launch at its start and waits for the previous one only before
    its store, so back to back each read runs during the previous one's tail (the GEMM's overlap mode).
    WAIT_FIRST: it waits after its first BLOCK words (16 KB a program), as a GEMM must wait for its input once
    its first ring is requested."""
    if OVERLAP:
        gdc_launch_dependents()
    base = tl.program_id(0).to(tl.int64) * words_per_program
    acc = tl.load(x_ptr + base + tl.arange(0, BLOCK), cache_modifier=".cg")
    if WAIT_FIRST:
        gdc_wait()
    for off in range(BLOCK, words_per_program, BLOCK):
        acc += tl.load(x_ptr + base + off + tl.arange(0, BLOCK), cache_modifier=".cg")
    if OVERLAP and not WAIT_FIRST:
        gdc_wait()
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc, 0))


READ_BLOCK = 4096  # int32 words per program and iteration (16 KB; 8 warps: four 16-byte loads a thread)


def read_ceiling(nbytes: int, copies: int, sms: int) -> dict:
    """What one launch that only reads `nbytes` costs back to back (rotating copies > L2, as the GEMMs are
    timed): the fastest of the read kernel above at 4, 8 and 16 programs per SM and torch's sum. The floor
    counts bytes at the copy bandwidth of 2 GiB; a one-wave read of tens of MB also pays the launch, the
    first requests' latency and the tail, and this is that cost with no arithmetic at all. `read_overlap_us`: the
    read kernel overlapped back to back (OVERLAP), as our GEMM calls are in the overlap mode, which hides most of
    that cost; `read_dep_us`: overlapped but waiting for the previous read after its first 16 KB a program
    (WAIT_FIRST), as a GEMM waits for its input after its first ring."""
    out = torch.empty(16 * sms, dtype=torch.int32, device="cuda")
    modes = {"read": (False, False), "read_overlap": (True, False), "read_dep": (True, True)}
    times = {mode: {} for mode in modes}
    for per_sm in (4, 8, 16):
        programs = per_sm * sms
        per = math.ceil(nbytes / 4 / programs / READ_BLOCK) * READ_BLOCK
        bufs = [torch.randint(0, 1 << 20, (programs * per,), dtype=torch.int32, device="cuda") for _ in range(copies)]
        for mode, (ovl, wait_first) in modes.items():
            read = lambda b: _read_kernel[(programs,)](b, out, per, BLOCK=READ_BLOCK, OVERLAP=ovl,
                                                       WAIT_FIRST=wait_first, num_warps=8, launch_pdl=ovl)
            read(bufs[0])  # it reads every word
            assert torch.equal(out[:programs].long() & 0xFFFFFFFF, bufs[0].view(programs, per).sum(1) & 0xFFFFFFFF)
            times[mode][f"read kernel, {per_sm} per SM"] = time_calls([lambda b=b: read(b) for b in bufs])
        del bufs
    bufs = [torch.randn(nbytes // 2, device="cuda").to(torch.bfloat16) for _ in range(copies)]
    times["read"]["torch.sum"] = time_calls([lambda b=b: b.sum() for b in bufs])
    del bufs
    torch.cuda.empty_cache()
    ceilings = {}
    for mode, t in times.items():
        best = min(t, key=t.get)
        ceilings.update({f"{mode}_us": t[best], f"{mode}_how": best, f"{mode}_all": t})
    return ceilings


def section_gemm(report: Report):
    bw, sms = report["env"]["copy_bw"], report["env"]["sms"]
    rows = []
    for K, N in GEMM_SHAPES:
        copies = copies_for(N * K / 2)
        ops = gemm_operands(K, N, 128, copies)
        tg = [G.to_tinygemm(*o, 128) for o in ops]
        nb = copies_for(N * K * 2)
        wb = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) for _ in range(nb)]
        read = read_ceiling(weight_bytes(K, N, 128), copies, sms)
        log(f"read {K}x{N}: {read['read_us']:.1f} us ({read['read_how']}), overlapped {read['read_overlap_us']:.1f} "
            f"({read['read_overlap_how']}), waiting after the first ring {read['read_dep_us']:.1f} "
            f"({read['read_dep_how']}); " + ", ".join(f"{k} {v:.1f}" for k, v in read["read_all"].items()))
        path = gemm_path(K, N)  # (the same for every M <= 8)
        for M in MS:
            xs = [torch.randn(M, K, device="cuda").to(torch.bfloat16) for _ in range(max(copies, nb))]
            ours = time_calls([lambda i=i: G.int4_mm(xs[i], *ops[i], 128) for i in range(copies)])
            alone = time_calls([lambda i=i: int4_mm_alone(xs[i], *ops[i], 128) for i in range(copies)])
            peer = time_calls([lambda i=i: G.tinygemm_mm(xs[i], *tg[i], 128) for i in range(copies)])
            dense = time_calls([lambda i=i: F.linear(xs[i], wb[i]) for i in range(nb)])
            floor = gemm_floor_bytes(M, K, N, 128) / bw * 1e6
            row = dict(K=K, N=N, M=M, ours_us=ours, ours_alone_us=alone, torch_int4_us=peer, bf16_us=dense,
                       floor_us=floor, floor_frac=floor / ours, read_us=read["read_us"],
                       read_overlap_us=read["read_overlap_us"], read_dep_us=read["read_dep_us"], config=path)
            rows.append(row)
            log(f"gemm {K}x{N} M={M}: ours {ours:.1f} (alone {alone:.1f}) torch-int4 {peer:.1f} bf16 {dense:.1f} "
                f"floor {floor:.1f} ({floor / ours:.2f})")
        # group 32 at M = 1 and 8 (reported, no goal)
        ops32 = gemm_operands(K, N, 32, copies)
        for M in (1, 8):
            xs = [torch.randn(M, K, device="cuda").to(torch.bfloat16) for _ in range(copies)]
            t = time_calls([lambda i=i: G.int4_mm(xs[i], *ops32[i], 32) for i in range(copies)])
            floor = gemm_floor_bytes(M, K, N, 32) / bw * 1e6
            rows.append(dict(K=K, N=N, M=M, group=32, ours_us=t, floor_us=floor, floor_frac=floor / t))
        del ops, tg, wb, ops32
        torch.cuda.empty_cache()
        report["gemm"] = rows
        report.save()


# ----------------------------------------------------------------------------- dispatch

# (model, linear, K, N) as kernels.transform builds them (q|k|v and gate|up fused), at the group it picks
DISPATCH_SHAPES = [
    ("smollm2_135m", "qkv", 576, 960), ("smollm2_135m", "o", 576, 576), ("smollm2_135m", "gate_up", 576, 3072),
    ("smollm2_135m", "down", 1536, 576), ("smollm2_135m", "lm_head", 576, 49152),
    ("gemma3_270m", "qkv", 640, 1536), ("gemma3_270m", "o", 1024, 640), ("gemma3_270m", "gate_up", 640, 4096),
    ("gemma3_270m", "down", 2048, 640), ("gemma3_270m", "lm_head", 640, 262144),
    ("gpu_preset", "qkv", 1024, 1536), ("gpu_preset", "o", 1024, 1024), ("gpu_preset", "gate_up", 1024, 5632),
    ("gpu_preset", "down", 2816, 1024), ("gpu_preset", "lm_head", 1024, 8192),
    ("llama3_8b", "qkv", 4096, 6144), ("llama3_8b", "o", 4096, 4096), ("llama3_8b", "gate_up", 4096, 28672),
    ("llama3_8b", "down", 14336, 4096), ("llama3_8b", "lm_head", 4096, 128256),
    ("square", "2048x4096", 2048, 4096), ("square", "2048x8192", 2048, 8192), ("square", "3072x8192", 3072, 8192),
]


def section_dispatch(report: Report, forced: bool = False):
    """Ours against torch's int4 GEMM (same weights, same group) and bf16 cuBLAS at M = 1..8 on every linear of
    the supported targets, at the group kernels.transform gives the shape: which path a dispatch rule should take."""
    rows = []
    for model, name, K, N in DISPATCH_SHAPES:
        try:
            rows += dispatch_rows(model, name, K, N, forced)
        except Exception:  # one shape a peer refuses leaves the others measured
            report.setdefault("errors", {})[f"dispatch {model} {name}"] = traceback.format_exc()[-1500:]
            log(f"dispatch {model} {name} {K}x{N} FAILED:\n{traceback.format_exc()[-1500:]}")
        torch.cuda.empty_cache()
        report["dispatch"] = rows
        report.save()


def gluon_one_launch(K: int, N: int, group: int) -> tuple | None:
    """The Gluon path's one-launch configuration for a shape it can take (group 128, N a multiple of 64): the
    default split with x staged by the kernel itself at every M <= 8."""
    if group != int4_gluon.GROUP or N % int4_gluon.BLOCK_N or K % group or K < 2 * group:
        return None
    return (*int4_gluon.default_config(K, N, torch.cuda.get_device_properties(0).multi_processor_count), 8)


def dispatch_rows(model: str, name: str, K: int, N: int, forced: bool) -> list[dict]:
    """One shape at M = 1..8, at the group kernels.transform gives it (128 where K allows, else 32): what
    `dispatch.int4_matmul` runs (`picked`, on `path`), our kernel as `int4_mm` picks it (`kernel`), each of ours
    forced with `forced` (the Triton kernel; the Gluon kernel in one launch), torch's int4 GEMM and bf16 cuBLAS."""
    from kernels import dispatch

    rows = []
    group = 128 if K % 128 == 0 else 32
    copies = copies_for(N * K / 2)
    ops = gemm_operands(K, N, group, copies)
    tg = [G.to_tinygemm(*o, group) for o in ops]
    nb = copies_for(N * K * 2)
    wb = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) for _ in range(nb)]
    one = gluon_one_launch(K, N, group)
    for M in MS:
        xs = [torch.randn(M, K, device="cuda").to(torch.bfloat16) for _ in range(max(copies, nb))]
        row = dict(model=model, linear=name, K=K, N=N, M=M, group=group, path=dispatch.int4_path(K, N, group, M))
        row["picked_us"] = time_calls([lambda i=i: dispatch.int4_matmul(xs[i], *ops[i], group, tg[i])
                                       for i in range(copies)])
        row["kernel_us"] = time_calls([lambda i=i: G.int4_mm(xs[i], *ops[i], group) for i in range(copies)])
        if forced:
            row["triton_us"] = time_calls([lambda i=i: G.launch_int4_mm(xs[i], *ops[i], group) for i in range(copies)])
            row["gluon_us"] = (time_calls([lambda i=i: int4_gluon.launch(xs[i], *ops[i], one) for i in range(copies)])
                               if one else None)
        row["torch_int4_us"] = time_calls([lambda i=i: G.tinygemm_mm(xs[i], *tg[i], group) for i in range(copies)])
        row["bf16_us"] = time_calls([lambda i=i: F.linear(xs[i], wb[i]) for i in range(nb)])
        rows.append(row)
    log(f"dispatch {model} {name} {K}x{N} g{group}: picked " + " ".join(f"{r['picked_us']:.1f}" for r in rows)
        + " | ours " + " ".join(f"{r['kernel_us']:.1f}" for r in rows)
        + (" | triton " + " ".join(f"{r['triton_us']:.1f}" for r in rows) if forced else "")
        + (" | gluon " + " ".join(f"{r['gluon_us']:.1f}" for r in rows) if forced and one else "")
        + " | torch-int4 " + " ".join(f"{r['torch_int4_us']:.1f}" for r in rows))
    return rows


# ----------------------------------------------------------------------------- sdpa

SDPA_HEADS = (32, 8, 128)  # Hq, Hkv, D


def sdpa_inputs(L, M):
    """Rotating copies of the cache (enough to exceed the L2 several times) and of q, with q at the last M
    positions, as verify rows are."""
    Hq, Hkv, D = SDPA_HEADS
    copies = copies_for(2 * Hkv * L * D * 2)
    kv = [(torch.randn(1, Hkv, L, D, device="cuda", dtype=torch.bfloat16),
           torch.randn(1, Hkv, L, D, device="cuda", dtype=torch.bfloat16)) for _ in range(copies)]
    qs = [torch.randn(1, M, Hq, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2) for _ in range(copies)]
    q_pos = torch.arange(L - M, L, device="cuda")
    return kv, qs, q_pos


def sdpa_time_ours(kv, qs, q_pos, reps=25):
    vl = torch.tensor([kv[0][0].shape[2]], device="cuda")
    return time_calls([lambda i=i: S.sdpa_midm(qs[i], *kv[i], q_pos, vl) for i in range(len(kv))], reps=reps)


def section_sdpa(report: Report):
    bw = report["env"]["copy_bw"]
    Hq, Hkv, D = SDPA_HEADS
    rows = []
    for L in SDPA_LENGTHS:
        for M in MS:
            kv, qs, q_pos = sdpa_inputs(L, M)
            ours = sdpa_time_ours(kv, qs, q_pos)
            mask = S.visible(q_pos, L)
            peer = time_calls([lambda i=i: F.scaled_dot_product_attention(qs[i], *kv[i], attn_mask=mask,
                                                                           enable_gqa=True) for i in range(len(kv))],
                              reps=10 if L > 32768 else 25)
            o = S.sdpa_midm(qs[0], *kv[0], q_pos)
            ref = F.scaled_dot_product_attention(qs[0].float(), kv[0][0].float(), kv[0][1].float(),
                                                 attn_mask=mask, enable_gqa=True)
            floor = (2 * Hkv * L * D * 2 + 2 * Hq * M * D * 2) / bw * 1e6
            row = dict(L=L, M=M, ours_us=ours, torch_us=peer, floor_us=floor, floor_frac=floor / ours,
                       speedup=peer / ours, rel_err_vs_torch_fp32=rel_err(o, ref))
            rows.append(row)
            log(f"sdpa L={L} M={M}: ours {ours:.1f} torch {peer:.1f} floor {floor:.1f} ({floor / ours:.2f}) "
                f"x{peer / ours:.1f}")
            del kv, qs, ref
            torch.cuda.empty_cache()
        report["sdpa"] = rows
        report.save()


# ----------------------------------------------------------------------------- whole model

class TinyGemmLinear(torch.nn.Module):
    def __init__(self, lin):
        super().__init__()
        self.group = lin.group
        self.w, self.sz = G.to_tinygemm(lin.packed, lin.scale_zero, lin.group)
        self.bias = lin.bias

    def forward(self, x):
        y = torch.ops.aten._weight_int4pack_mm(x.reshape(-1, x.shape[-1]), self.w, self.group, self.sz)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], y.shape[-1])


def torch_peer(model):
    """Same quantised weights on torch's int4 GEMM; attention through torch SDPA with the model's mask.
    Everything else stays as `model` has it (with or without the RMSNorm/RoPE/SwiGLU kernels)."""
    from kernels.transform import Int4Linear
    from models.layers import Attention

    def attend(self, q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale, enable_gqa=True)

    for module in list(model.modules()):
        if isinstance(module, Attention):
            cls = type(module)
            module.__class__ = type(f"TorchSdpa{cls.__name__}", (cls,), {"attend": attend})
        for name, child in list(module.named_children()):
            if isinstance(child, Int4Linear):
                setattr(module, name, TinyGemmLinear(child))
    return model


def without_norm_rope(model):
    """The model's own RMSNorm, RoPE and SwiGLU code back in place of kernels.norm_rope (same weights)."""
    from kernels.transform import KernelMLP, KernelRMSNorm
    from models.layers import Attention, RMSNorm

    for module in model.modules():
        if isinstance(module, KernelRMSNorm):
            module.__class__ = RMSNorm
        if isinstance(module, Attention):
            module.kernel_rope = False
        if isinstance(module, KernelMLP):
            module.kernel_swiglu = False
    return model


def set_cache_capacity(model, capacity: int):
    """Resize every KV cache (and the key positions the mask is built from) to `capacity` slots, filled with
    random values, so the peer's whole-buffer attention reads what ours reads."""
    for layer in model.layers:
        a = layer.self_attn
        shape = (1, a.n_kv_heads, capacity, a.head_dim)
        a.k_cache = torch.randn(shape, device="cuda", dtype=torch.bfloat16) * 0.5
        a.v_cache = torch.randn(shape, device="cuda", dtype=torch.bfloat16) * 0.5
    model.key_pos = torch.arange(capacity, device="cuda")


def time_forward(model, ctx: int, T: int, reps: int = 30) -> float:
    tokens = torch.randint(0, model.cfg.vocab_size, (1, T), device="cuda")
    pos = torch.arange(ctx, ctx + T, device="cuda")
    with torch.no_grad():
        return time_calls([lambda: model(tokens, pos)], reps=reps, min_us=0)


def llama3_8b(max_seq_len: int):
    """The models/ target with Llama-3-8B shapes and random bf16 weights on the GPU, ready for graph capture."""
    from models.config import TargetConfig
    from models.target import Transformer

    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = Transformer(TargetConfig(**LLAMA3_8B, max_seq_len=max_seq_len, tap_layers=None))
    torch.set_default_dtype(torch.float32)
    model.eval()
    model._check_cached_call = lambda tokens, input_pos: None  # its int() host sync cannot be graph-captured
    return model


def section_model(report: Report):
    from kernels.transform import to_kernels

    contexts, Ts = (4096, 32768), (1, 2, 4, 8)
    t0 = time.time()
    model = llama3_8b(max_seq_len=max(contexts) + 256)
    cfg = model.cfg
    fused = to_kernels(copy.deepcopy(model), max_m=8, group=128, fuse=True)
    to_kernels(model, max_m=8, group=128, fuse=False)
    torch.cuda.empty_cache()
    log(f"model: built and quantised in {time.time() - t0:.0f} s; "
        f"{torch.cuda.memory_allocated() / 1e9:.1f} GB allocated")
    peer = torch_peer(copy.deepcopy(model))
    peer_fused = torch_peer(copy.deepcopy(fused))  # the same fused q|k|v and gate|up weights on torch's kernels
    # the same weights with the model's own RMSNorm/RoPE/SwiGLU code instead of kernels.norm_rope
    fused_plain = without_norm_rope(copy.deepcopy(fused))
    variants = (("ours", model), ("fused", fused), ("torch", peer), ("torch_fused", peer_fused),
                ("fused_plain", fused_plain), ("torch_plain", without_norm_rope(copy.deepcopy(peer))),
                ("torch_fused_plain", torch_peer(copy.deepcopy(fused_plain))),
                ("fused_nopdl", fused))  # the default model with plain graph edges instead of dependent launches
    weight_bytes = sum(b.numel() * b.element_size() for n, b in model.named_buffers()
                       if n.endswith(("packed", "scale_zero")))
    out = dict(weight_bytes=weight_bytes, rows=[])
    bw = report["env"]["copy_bw"]
    for ctx in contexts:
        cap = ctx + 256
        for m in {id(m): m for _, m in variants}.values():  # (fused_nopdl is the fused model itself)
            set_cache_capacity(m, cap)
        torch.cuda.empty_cache()
        kv_bytes = 2 * cfg.n_layers * cfg.n_kv_heads * ctx * cfg.head_dim * 2
        for T in Ts:
            row = dict(ctx=ctx, T=T, floor_us=(weight_bytes + kv_bytes) / bw * 1e6)
            for name, m in variants:
                pdl = int4_launch.USE_PDL, S.USE_PDL
                if name.endswith("_nopdl"):  # read at launch, so the captured graph has plain edges
                    int4_launch.USE_PDL = S.USE_PDL = False
                try:
                    row[f"{name}_us"] = time_forward(m, ctx, T)
                except Exception as e:
                    row[f"{name}_error"] = repr(e)[:300]
                finally:
                    int4_launch.USE_PDL, S.USE_PDL = pdl
            log(f"model ctx={ctx} T={T}: {row}")
            out["rows"].append(row)
            report["model"] = out
            report.save()
    with torch.no_grad():  # the two paths agree on the same weights (same cache contents after this copy)
        for other in (peer, fused, fused_plain):
            for la, lb in zip(model.layers, other.layers):
                lb.self_attn.k_cache.copy_(la.self_attn.k_cache)
                lb.self_attn.v_cache.copy_(la.self_attn.v_cache)
        tok = torch.randint(0, cfg.vocab_size, (1, 8), device="cuda")
        pos = torch.arange(30000, 30008, device="cuda")
        a, b, c = model(tok, pos).float(), peer(tok, pos).float(), fused(tok, pos).float()
        out["logits_rel_err_vs_torch"] = rel_err(a, b)
        out["argmax_agree"] = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
        out["fused_vs_separate_rel_err"] = rel_err(c, a)
        out["norm_rope_vs_plain_rel_err"] = rel_err(c, fused_plain(tok, pos).float())
    report["model"] = out
    report.save()


# ----------------------------------------------------------------------------- tables

def print_tables(report: Report):
    if "gemm" in report:
        log("\nGEMM (us; group 128; floor_frac = floor/ours)")
        log(f"{'K x N':>13} {'M':>2} {'ours':>7} {'alone':>7} {'t-int4':>7} {'bf16':>7} {'floor':>6} {'frac':>5} "
            f"{'read':>6} {'read_overlap':>12} {'read_dep':>8} {'floor/read/overlap/dep':>22}")
        for r in report["gemm"]:
            if r.get("group") == 32:
                continue
            fracs = "/".join(f"{r['floor_us'] / r[k]:.2f}" for k in ("read_us", "read_overlap_us", "read_dep_us"))
            log(f"{r['K']:>6}x{r['N']:<6} {r['M']:>2} {r['ours_us']:7.1f} {r['ours_alone_us']:7.1f} "
                f"{r['torch_int4_us']:7.1f} {r['bf16_us']:7.1f} {r['floor_us']:6.1f} {r['floor_frac']:5.2f} "
                f"{r['read_us']:6.1f} {r['read_overlap_us']:12.1f} {r['read_dep_us']:8.1f} {fracs:>22}")
    if "dispatch" in report:
        log("\nDispatch (us at M = 1..8: picked / torch int4, t where it picked torch's; ! where the pick is slower "
            "than torch's by > 3%)")
        rows = report["dispatch"]
        for i in range(0, len(rows), len(MS)):
            r0 = rows[i]
            cells = " ".join(f"{r['picked_us']:5.1f}/{r['torch_int4_us']:5.1f}{'t' if r['path'] == 'torch' else ' '}"
                             f"{'!' if r['picked_us'] > 1.03 * r['torch_int4_us'] else ' '}" for r in rows[i:i + len(MS)])
            log(f"{r0['model']:>12} {r0['linear']:>9} {r0['K']:>5}x{r0['N']:<6} g{r0['group']:<3} {cells}")
    if "sdpa" in report:
        log("\nSDPA (us; Hq 32, Hkv 8, D 128)")
        log(f"{'L':>7} {'M':>2} {'ours':>7} {'torch':>8} {'floor':>6} {'frac':>5} {'speedup':>7}")
        for r in report["sdpa"]:
            log(f"{r['L']:>7} {r['M']:>2} {r['ours_us']:7.1f} {r['torch_us']:8.1f} {r['floor_us']:6.1f} "
                f"{r['floor_frac']:5.2f} {r['speedup']:7.1f}")
    if "model" in report:
        log("\nModel (Llama-3-8B shapes, CUDA-graph forward, us)")
        for r in report["model"]["rows"]:
            cols = "  ".join(f"{n} {r.get(n + '_us', float('nan')):7.0f}" for n in
                             ("ours", "fused", "torch", "torch_fused", "fused_plain", "torch_plain",
                              "torch_fused_plain", "fused_nopdl"))
            log(f"ctx {r['ctx']:>6} T={r['T']}: {cols}  floor {r['floor_us']:6.0f}")


def start_report(path: str) -> Report:
    """A report with the device, its SM count and the copy bandwidth every floor is counted at."""
    report = Report(path)
    props = torch.cuda.get_device_properties(0)
    report["env"] = dict(device=props.name, sms=props.multi_processor_count, torch=torch.__version__,
                         triton=triton.__version__, date=time.strftime("%Y-%m-%d %H:%M"))
    bws = measure_bandwidth()
    report["env"].update(bws, copy_bw=max(bws.values()))
    log(f"env: {report['env']}")
    report.save()
    return report


def run_sections(report: Report, plan) -> None:
    """Runs each (name, section) in turn; a section that fails is recorded in the report and the next one runs."""
    for name, fn in plan:
        t0 = time.time()
        try:
            fn(report)
        except Exception:
            report.setdefault("errors", {})[name] = traceback.format_exc()[-2000:]
            log(f"section {name} FAILED:\n{traceback.format_exc()[-2000:]}")
            report.save()
        log(f"[{name}: {time.time() - t0:.0f} s]")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench_kernels.json", help="the JSON file, rewritten after every section")
    ap.add_argument("--only", default="check,gemm,sdpa,model", help="sections: check, gemm, dispatch, sdpa, model")
    ap.add_argument("--forced", action="store_true", help="dispatch: also time each of our kernels forced")
    args = ap.parse_args(argv)
    report = start_report(args.out)
    sections = args.only.split(",")
    plan = [(n, f) for n, f in (("check", section_check), ("gemm", section_gemm),
                                ("dispatch", lambda r: section_dispatch(r, args.forced)), ("sdpa", section_sdpa),
                                ("model", section_model)) if n in sections]
    run_sections(report, plan)
    print_tables(report)


if __name__ == "__main__":
    main()
