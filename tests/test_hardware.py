"""pipeline.hardware: the machine's values of the config's `auto` defaults (training dtype, row tile, threads)."""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch

from pipeline import hardware

# time(M)/time(1) at M = 1, 2, ... of XNNPACK's GEMM: the AVX-512 curves as `python -m pipeline.hardware --probe`
# measured them on a 2-core AMD EPYC with avx512_bf16; the AVX2 ones from `bench.export_latency --row-tile` on a
# 2-core AVX2 + FMA machine, which reported ranges (fp32: 1.26-1.28 for M = 2-6, 2.02-2.07 for 7-12, 2.73-2.78
# for 13-16; 8da4w: 1.76 for 2-3, 3.44-3.54 for 4-6, 5.16 for 7-9), written here as values inside them.
# A step up is a second pass of the micro-kernel over the rows.
CURVES = {
    ("AVX512", "fp32"): ([1.0, 1.36, 1.32, 1.33, 1.36, 1.47, 1.52, 2.82, 2.77, 2.5, 2.5, 2.34, 2.49, 2.54, 3.35, 3.15], 7),
    ("AVX512", "8da4w"): ([1.0, 3.35, 3.38, 3.4, 3.39, 3.5, 3.38, 3.4, 6.78, 6.97, 6.76, 6.85, 6.73, 6.85, 6.94, 6.72], 8),
    ("AVX2", "fp32"): ([1.0, 1.26, 1.27, 1.28, 1.27, 1.28, 2.02, 2.05, 2.07, 2.04, 2.06, 2.07, 2.73, 2.75, 2.78, 2.76], 6),
    ("AVX2", "8da4w"): ([1.0, 1.76, 1.76, 3.44, 3.5, 3.54, 5.16, 5.16, 5.16], 3),
}


@pytest.mark.parametrize("kind", list(CURVES), ids=lambda k: "-".join(k))
def test_the_row_tile_is_the_last_row_before_the_first_second_pass(kind):
    curve, tile = CURVES[kind]
    assert hardware.tile_from_curve(curve) == tile


def test_a_curve_without_a_step_is_one_pass_over_every_row():
    assert hardware.tile_from_curve([1.0] + [1.1] * 15) == 16


@pytest.mark.parametrize("cap, avx512_bf16, amx, isa, native", [
    ("AVX512", True, False, None, True),
    ("AVX512", False, True, None, True),
    ("AVX512", False, False, None, False),   # AVX-512 without bf16
    ("AVX2", False, False, None, False),     # the AVX2 + FMA machine
    ("AVX2", True, False, None, False),      # ATEN_CPU_CAPABILITY=avx2 on a bf16 CPU: torch emulates
    ("AVX512", True, False, "AVX2", False),  # ONEDNN_MAX_CPU_ISA=AVX2: oneDNN emulates
])
def test_native_bf16_needs_the_instructions_and_kernels_allowed_to_use_them(monkeypatch, cap, avx512_bf16, amx, isa,
                                                                           native):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: cap)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    if isa is None:
        monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    else:
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", isa)
    ok, why = hardware.native_bf16("cpu")
    assert ok is native and why
    chosen = hardware.resolve_autocast("auto", "cpu", "target.train.autocast")
    assert chosen == ("bfloat16" if native else None)


def test_an_explicit_bf16_without_native_bf16_is_kept_and_warned_about_once(monkeypatch, caplog):
    monkeypatch.setattr(hardware, "native_bf16", lambda device: (False, "no bf16 here"))
    monkeypatch.setattr(hardware, "_warned_bf16", set())
    with caplog.at_level(logging.WARNING, logger="pipeline.hardware"):
        for _ in range(3):
            assert hardware.resolve_autocast("bfloat16", "cpu", "draft.train.autocast") == "bfloat16"
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "9x slower" in warnings[0].getMessage() and "auto" in warnings[0].getMessage()
    assert hardware.resolve_autocast(None, "cpu", "draft.train.autocast") is None


@pytest.mark.slow
def test_the_row_tile_is_measured_once_per_machine_and_cached(monkeypatch, tmp_path):
    """The real probe (an XNNPACK program timed at M = 1..16, in a process of its own), then the cache."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    first = hardware.row_tile("fp32")
    assert 2 <= first["tile"] <= hardware.MAX_PROBE_ROWS and len(first["ratio_to_m1"]) == hardware.MAX_PROBE_ROWS
    assert first["capability"] == torch.backends.cpu.get_cpu_capability()
    assert hardware.tile_from_curve(first["ratio_to_m1"]) == first["tile"]
    cached = json.loads(hardware.cache_file().read_text())
    assert list(cached.values()) == [first]
    monkeypatch.setattr(hardware, "_measure_in_subprocess", lambda quant: pytest.fail("measured twice"))
    assert hardware.row_tile("fp32") == first


def test_default_chain_auto_measures_no_row_tile_where_executorch_is_not_installed(monkeypatch, caplog):
    """A GPU machine that trains a draft has no ExecuTorch: `auto` keeps min(DEFAULT_CHAIN, max_m - 1)."""
    from pipeline.export_pte import DEFAULT_CHAIN

    monkeypatch.setattr(hardware, "has_executorch", lambda: False)
    monkeypatch.setattr(hardware, "row_tile", lambda *a, **kw: pytest.fail("measured a row tile without ExecuTorch"))
    with caplog.at_level(logging.INFO, logger="pipeline.hardware"):
        for max_m in (2, 4, 8):
            assert hardware.resolve_default_chain("auto", max_m=max_m, backend="xnnpack",
                                                  quant="8da4w_offsets") == min(DEFAULT_CHAIN, max_m - 1)
    assert "ExecuTorch is not installed" in caplog.text
    assert hardware.resolve_default_chain(3, max_m=8, backend="xnnpack", quant="8da4w_offsets") == 3


def run_governor(gov, seconds_at, steps):
    """Drive `gov` for `steps` steps whose time is seconds_at(threads now); -> the thread count of every step."""
    counts = []
    for _ in range(steps):
        counts.append(torch.get_num_threads())
        gov.tick(seconds_at(counts[-1]))
    return counts


def test_the_thread_governor_keeps_whichever_count_steps_faster_and_follows_a_change(monkeypatch):
    import random

    n = torch.get_num_threads()
    rng = random.Random()
    fast, slow = sorted(rng.uniform(0.1, 2.0) for _ in range(2))
    slow = max(slow, 1.3 * fast)  # apart by more than the noise below
    noise = lambda: rng.uniform(0.97, 1.03)  # noqa: E731
    try:
        torch.set_num_threads(1)
        hardware.govern_threads(2)
        gov = hardware.ThreadGovernor("cpu", every=20, trial=3)  # 4 of every 25 steps try the other
        assert torch.get_num_threads() == 2  # a governed loop starts at the governed count
        # in 50 steps at most two trials of 3 steps and a warm-up step each run at the other count
        quiet = run_governor(gov, lambda t: (fast if t == 2 else slow) * noise(), 100)
        assert quiet[:10].count(1) >= 3  # the first trial comes within the first steps
        assert quiet[-50:].count(2) >= 50 - 2 * 4
        busy = run_governor(gov, lambda t: (slow if t == 2 else fast) * noise(), 100)  # a neighbour arrives
        assert busy[-50:].count(1) >= 50 - 2 * 4
        again = run_governor(gov, lambda t: (fast if t == 2 else slow) * noise(), 100)  # and leaves
        assert again[-50:].count(2) >= 50 - 2 * 4
        gov.close()
        assert torch.get_num_threads() == 2
    finally:
        hardware.govern_threads(None)
        torch.set_num_threads(n)


@pytest.mark.parametrize("governed, device", [(None, "cpu"), (1, "cpu"), (2, "cuda")])
def test_the_thread_governor_leaves_a_fixed_count_alone(governed, device):
    n = torch.get_num_threads()
    try:
        hardware.govern_threads(governed)
        gov = hardware.ThreadGovernor(device, every=2, trial=1)
        assert set(run_governor(gov, lambda t: 1.0 / t if t > 1 else 5.0, 20)) == {n}
    finally:
        hardware.govern_threads(None)
        torch.set_num_threads(n)


def test_default_threads_are_the_cores_this_process_may_use(monkeypatch):
    from omegaconf import OmegaConf

    from pipeline.app import set_threads

    mask = os.sched_getaffinity(0)
    try:  # a process narrowed to one core (taskset, a container's cpuset) counts one
        os.sched_setaffinity(0, {min(mask)})
        assert hardware.usable_cores() == 1
    finally:
        os.sched_setaffinity(0, mask)
    assert hardware.usable_cores() == len(mask)
    monkeypatch.setattr(hardware, "usable_cores", lambda: 6)
    n = torch.get_num_threads()
    try:
        assert set_threads(OmegaConf.create({"threads": None})) == 6
        assert hardware._governed == 6
        assert set_threads(OmegaConf.create({"threads": None}), jobs_at_once=4) == 1
        assert hardware._governed is None  # one thread each: nothing to choose
        assert set_threads(OmegaConf.create({"threads": 3})) == 3 == torch.get_num_threads()
        assert hardware._governed is None  # the user's count stays
    finally:
        hardware.govern_threads(None)
        torch.set_num_threads(n)
