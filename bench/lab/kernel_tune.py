"""Tuning and profiling of the GPU kernels (on a CUDA GPU): where the launch configurations in kernels/ come from.

    python -m bench.lab.kernel_tune --out $OUT/tune.json [--sdpa]      # GEMM (and SDPA) launch configurations
    python -m bench.lab.kernel_tune --profile --out $OUT/profile.json  # where a forward's time goes, T = 1 vs 2

- tune: a few launch configurations per GEMM shape (bench.kernels' GEMM_SHAPES and the Llama-3-8B model's own
  shapes), timed at M = 1 and 8; the winners are installed in kernels.int4_gemm.CONFIGS for the rest of the run
  and written to the JSON (copy them into the code); on Hopper also every split for kernels/int4_gluon.py, at 2,
  4 and 6 stages with x from the prep kernel and staged in the kernel (one launch), timed at M = 1, 2, 4 and 8,
  one launch kept up to the M before which it never lost (one_launch_m); its CONFIGS get the shapes where it
  beats the Triton kernel by more than 3% (None for the others). `--sdpa`: kernels.sdpa_midm.CONFIG as well.
- profile: the kernels whose summed CUDA time or count differs most between T = 1 and T = 2 in a cached forward
  of the Llama-3-8B-shaped model on the kernels (ctx 4096).
The recorded runs are bench/results/h200-int4-tune.json and h200-sdpa-tune.json; docs/results.md cites them.
Timing, the floor and the report are bench.kernels'.
"""

from __future__ import annotations

import argparse
import copy
import math
import time

import torch

from bench.kernels import (GEMM_SHAPES, Report, copies_for, gemm_floor_bytes, gemm_operands, llama3_8b, log,
                           run_sections, sdpa_inputs, sdpa_time_ours, set_cache_capacity, start_report, time_calls,
                           time_forward)
from kernels import int4_gemm as G
from kernels import int4_gluon
from kernels import sdpa_midm as S

# Llama-3-8B k/v, lm_head, fused q|k|v and fused gate|up: tuned for the whole-model table, not reported
MODEL_SHAPES = [(4096, 1024), (4096, 128256), (4096, 6144), (4096, 28672)]


TUNE_GLUON_MS = (1, 2, 4, 8)  # the Gluon path's configs are timed at these M (the Triton kernel's at 1 and 8)
# (BLOCK_N, BLOCK_K, warps, stages[, register cap]); SPLIT_K in {1, 2, 4, 8} is added per shape
GEMM_CANDIDATES = [
    (64, 128, 4, 4), (64, 256, 4, 3), (64, 256, 4, 4), (64, 512, 4, 3), (128, 128, 4, 4), (128, 256, 8, 3),
    (64, 256, 4, 3, 96), (64, 128, 4, 4, 96),  # 96 registers: 5 programs per SM instead of 4, no spills
]


def section_tune(report: Report, sdpa: bool):
    bw, sms = report["env"]["copy_bw"], report["env"]["sms"]
    table, detail, gluon_table = {}, {}, {}
    for K, N in GEMM_SHAPES + MODEL_SHAPES:
        copies = copies_for(N * K / 2)
        ops = gemm_operands(K, N, 128, copies)
        xs = {M: [torch.randn(M, K, device="cuda").to(torch.bfloat16) for _ in range(copies)] for M in TUNE_GLUON_MS}
        best, rows = None, []
        t_shape = time.time()
        for bn, bk, warps, stages, *max_regs in GEMM_CANDIDATES:
            for split in (1, 2, 3, 4, 6, 7, 8):
                if K % (split * bk) or K // split < 512:
                    continue
                tiles = math.ceil(N / bn)
                if split > 1 and tiles * split > 8 * sms:
                    continue
                if split == 1 and tiles < 66 and K >= 4096:
                    continue
                cfg = (bn, bk, split, warps, stages, *max_regs)
                try:
                    ts = [time_calls([lambda i=i, M=M: G.launch_int4_mm(xs[M][i], *ops[i], 128, cfg)
                                      for i in range(copies)], reps=10) for M in (1, 8)]
                except Exception as e:  # a config the compiler refuses (shared memory, registers)
                    rows.append((cfg, str(e)[:120]))
                    continue
                rows.append((cfg, ts))
                score = max(ts)
                if best is None or score < best[0]:
                    best = (score, cfg)
        floor = gemm_floor_bytes(8, K, N, 128) / bw * 1e6
        table[(K, N, 128)] = best[1]
        table[(K, N, 32)] = best[1][:5]  # (the register cap is for group 128's epilogue)
        detail[f"{K}x{N}"] = dict(best=best[1], best_us=best[0], floor_us_m8=floor, rows=rows)
        log(f"tune {K}x{N}: best {best[1]} {best[0]:.1f} us (floor {floor:.1f} us) "
            f"[{time.time() - t_shape:.0f} s]")
        if int4_gluon.usable(xs[1][0]):  # the Gluon path: every split, x from the prep kernel or staged in it
            groups, rows_gl = K // int4_gluon.GROUP, {}
            for split in [d for d in range(1, int4_gluon.MAX_SPLIT + 1) if groups % d == 0 and groups // d >= 2]:
                for cfg in ((split, st, 64) + one for st in (2, 4, 6) for one in ((), (8,))):
                    rows_gl[cfg] = [time_calls([lambda i=i, M=M, c=cfg: int4_gluon.launch(
                        xs[M][i], *ops[i], c) for i in range(copies)], reps=10) for M in TUNE_GLUON_MS]
            # each (split, stages) in one launch up to the largest M before which it never lost to the prep kernel
            tried = {}
            for cfg in [c for c in rows_gl if len(c) == 3]:
                prep, one = rows_gl[cfg], rows_gl[cfg + (8,)]
                wins = next((i for i, (a, b) in enumerate(zip(one, prep)) if a >= b), len(prep))
                times = one[:wins] + prep[wins:]
                tried[cfg + ((TUNE_GLUON_MS[wins - 1],) if wins else ())] = times
            cfg = min(tried, key=lambda c: max(tried[c]))
            # the shape takes this path where it beats the Triton kernel's best by more than 3%
            gluon_table[(K, N)] = cfg if max(tried[cfg]) < 0.97 * best[0] else None
            detail[f"{K}x{N}"]["gluon"] = dict(rows={str(c): v for c, v in rows_gl.items()}, best=cfg,
                                               best_us=max(tried[cfg]), taken=gluon_table[(K, N)] is not None)
            log(f"   gluon: best {cfg} {max(tried[cfg]):.1f} us -> {'gluon' if gluon_table[(K, N)] else 'triton'}")
        del ops, xs
        torch.cuda.empty_cache()
    G.CONFIGS.update(table)
    int4_gluon.CONFIGS.update(gluon_table)
    report["tune"] = dict(gemm_configs={f"{k[0]},{k[1]},{k[2]}": v for k, v in table.items()}, gemm=detail,
                          gluon_configs={f"{k[0]},{k[1]}": v for k, v in gluon_table.items()})
    report.save()
    if sdpa:
        tune_sdpa(report)


def tune_sdpa(report: Report):
    """SDPA launch configurations (block_n, warps, stages, programs per SM) timed at L = 32768 and 131072, M = 1
    and 8; the lowest sum is installed in kernels.sdpa_midm.CONFIG."""
    sdpa_rows, best = [], None
    for block_n, warps, stages, pps in [(64, 4, 3, 2), (64, 4, 3, 3), (64, 4, 3, 4), (64, 4, 4, 2),
                                        (64, 8, 3, 2), (128, 4, 2, 2), (128, 8, 3, 2), (32, 4, 4, 4)]:
        S.CONFIG.update(block_n=block_n, warps=warps, stages=stages, programs_per_sm=pps)
        try:
            ts = [sdpa_time_ours(*sdpa_inputs(L, M), reps=8) for L in (32768, 131072) for M in (1, 8)]
        except Exception as e:
            sdpa_rows.append(((block_n, warps, stages, pps), str(e)[:120]))
            continue
        sdpa_rows.append(((block_n, warps, stages, pps), ts))
        score = sum(ts)
        if best is None or score < best[0]:
            best = (score, (block_n, warps, stages, pps))
        log(f"tune sdpa {(block_n, warps, stages, pps)}: {['%.1f' % t for t in ts]}")
    block_n, warps, stages, pps = best[1]
    S.CONFIG.update(block_n=block_n, warps=warps, stages=stages, programs_per_sm=pps)
    report["tune"].update(sdpa_config=dict(S.CONFIG), sdpa=sdpa_rows)
    report.save()


def profile_forward(model, ctx: int, T: int, top: int = 14) -> dict:
    """Kernel time of one eager cached forward, summed by kernel name (CUDA time, us)."""
    from torch.profiler import ProfilerActivity, profile

    tokens = torch.randint(0, model.cfg.vocab_size, (1, T), device="cuda")
    pos = torch.arange(ctx, ctx + T, device="cuda")
    with torch.no_grad():
        model(tokens, pos)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            model(tokens, pos)
            torch.cuda.synchronize()
    rows = [(e.key[:90], e.count, e.device_time_total) for e in prof.key_averages()]
    rows.sort(key=lambda r: -r[2])
    return dict(kernels=sum(r[1] for r in rows), total_us=sum(r[2] for r in rows), top=rows[:top])


def section_profile(report: Report):
    """Where a cached forward's time goes at T = 1 against T = 2 (kernels/transform on Llama-3-8B shapes,
    ctx 4096): the kernels whose summed CUDA time or count differs most."""
    from kernels.transform import to_kernels

    model = llama3_8b(max_seq_len=4096 + 256)
    out = {}
    for name, fuse in (("fused", True), ("ours", False)):
        m = to_kernels(copy.deepcopy(model), max_m=8, group=128, fuse=fuse)
        set_cache_capacity(m, 4096 + 256)
        profs = {T: profile_forward(m, 4096, T, top=400) for T in (1, 2)}
        by = {T: {r[0]: (r[1], r[2]) for r in p["top"]} for T, p in profs.items()}
        diff = sorted(((by[2].get(k, (0, 0))[1] - by[1].get(k, (0, 0))[1], by[1].get(k, (0, 0))[0],
                        by[2].get(k, (0, 0))[0], k) for k in set(by[1]) | set(by[2])), reverse=True)
        out[name] = dict(T1=dict(kernels=profs[1]["kernels"], total_us=profs[1]["total_us"]),
                         T2=dict(kernels=profs[2]["kernels"], total_us=profs[2]["total_us"]), diff=diff[:25])
        log(f"profile {name}: T=1 {profs[1]['kernels']} kernels {profs[1]['total_us']:.0f} us; "
            f"T=2 {profs[2]['kernels']} kernels {profs[2]['total_us']:.0f} us; graph replay "
            f"T=1 {time_forward(m, 4096, 1):.0f} us, T=2 {time_forward(m, 4096, 2):.0f} us")
        for d, c1, c2, k in diff[:12]:
            log(f"   {d:+9.1f} us  x{c1}->x{c2}  {k}")
        del m
        torch.cuda.empty_cache()
    report["profile_t1_t2"] = out
    report.save()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="kernel_tune.json", help="the JSON file, rewritten after every section")
    ap.add_argument("--sdpa", action="store_true", help="tune SDPA's launch configuration as well")
    ap.add_argument("--profile", action="store_true", help="profile a forward at T = 1 against T = 2 instead of tuning")
    args = ap.parse_args(argv)
    report = start_report(args.out)
    if args.profile:
        run_sections(report, [("profile", section_profile)])
    else:
        run_sections(report, [("tune", lambda r: section_tune(r, sdpa=args.sdpa))])


if __name__ == "__main__":
    main()
