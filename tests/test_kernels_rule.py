"""kernels/rule.py: the dispatch rule loads neither torch nor triton, sends M <= max_m rows (and only those)
to the small-M kernels, and is the row limit the kernels themselves take."""

import subprocess
import sys
from pathlib import Path

import pytest

import json

from kernels.rule import SMALL_M_LIMIT, TORCH_INT4, TORCH_INT4_BELOW, check_max_m, int4_path, use_small_m

ROOT = Path(__file__).resolve().parents[1]


def test_import_loads_neither_torch_nor_triton():
    code = "import sys, kernels.rule; print(sorted(m for m in ('torch', 'triton') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[1]).stdout
    assert out.strip() == "[]", f"import kernels.rule loaded {out.strip()}"


def test_small_m_is_exactly_m_at_most_max_m():
    for max_m in range(1, SMALL_M_LIMIT + 1):
        sides = [use_small_m(m, max_m) for m in range(1, 2 * SMALL_M_LIMIT + 1)]
        assert sides == [m <= max_m for m in range(1, 2 * SMALL_M_LIMIT + 1)]
        assert sides == sorted(sides, reverse=True), "monotonic: once a call is too large, every larger one is"


def test_max_m_within_what_the_kernels_take():
    assert [check_max_m(m) for m in (1, SMALL_M_LIMIT)] == [1, SMALL_M_LIMIT]
    for bad in (0, SMALL_M_LIMIT + 1):
        with pytest.raises(ValueError):
            check_max_m(bad)


def test_kernels_take_their_row_limit_from_the_rule():
    from kernels import int4_gemm, int4_launch, sdpa_midm

    assert int4_launch.BLOCK_M == int4_gemm.BLOCK_M == sdpa_midm.MAX_M == SMALL_M_LIMIT


def test_int4_path_takes_torch_exactly_where_the_table_says():
    for (K, N, group), rows in TORCH_INT4.items():
        assert rows <= set(range(1, SMALL_M_LIMIT + 1)), (K, N, group)
        got = {m for m in range(1, SMALL_M_LIMIT + 1) if int4_path(K, N, group, m) == "torch"}
        assert got == rows, (K, N, group)
    # unmeasured shapes: torch's below the size threshold at every M, ours above it
    small, large = (96, 64, 32), (4096, TORCH_INT4_BELOW // 4096, 128)
    assert all(int4_path(*small, m) == "torch" for m in range(1, 9))
    assert all(int4_path(*large, m) == "ours" for m in range(1, 9))


def test_int4_path_is_never_slower_than_torch_on_the_measured_h200_run():
    """Every weight shape of the supported targets and of Llama-3-8B at M = 1..8: the GEMM the rule picks took
    at most 3% (the run's noise) longer than the faster of ours and torch's int4 GEMM, in the same run."""
    rows = json.loads((ROOT / "bench/results/h200-dispatch.json").read_text())["dispatch"]
    shapes = {(r["K"], r["N"], r["group"]) for r in rows}
    assert shapes <= set(TORCH_INT4), f"measured shapes missing from TORCH_INT4: {shapes - set(TORCH_INT4)}"
    for r in rows:
        for run in (r, r["forced_run"]):
            picked = run["torch_int4_us"] if int4_path(r["K"], r["N"], r["group"], r["M"]) == "torch" else run["kernel_us"]
            assert picked <= 1.03 * min(run["kernel_us"], run["torch_int4_us"]), (r["model"], r["linear"], r["M"], run)
