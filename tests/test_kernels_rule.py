"""kernels/rule.py: the dispatch rule loads neither torch nor triton, sends M <= max_m rows (and only those)
to the small-M kernels, and is the row limit the kernels themselves take."""

import subprocess
import sys
from pathlib import Path

import pytest

from kernels.rule import SMALL_M_LIMIT, check_max_m, use_small_m


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
