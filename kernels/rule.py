"""The dispatch rule: a call of M <= max_m rows takes the small-M kernels, a larger one the dense path.

max_m is the verify window's largest T (docs/design.md §5): the exported verify range [2, max_m] and decode
(T = 1) sit at or under it and prefill's minimum sits above it, so every call site resolves to one side for its
whole shape range, and the rule leaves no data-dependent guard in an exported graph.

Standard library only, so that the export path can apply the rule without importing torch's GPU kernels or
triton: `import kernels.rule` loads neither.
"""

from __future__ import annotations

# The most rows the small-M kernels take: int4_launch.BLOCK_M and sdpa_midm.MAX_M are this value. The kernels are
# built for it (the Triton GEMM's product is 16 wide, the Gluon GEMM's 8 or 16), so it is not a tuning knob.
SMALL_M_LIMIT = 16


def check_max_m(max_m: int) -> int:
    """max_m itself, if the small-M kernels can take that many rows."""
    if not 1 <= max_m <= SMALL_M_LIMIT:
        raise ValueError(f"max_m={max_m}: the small-M kernels take 1..{SMALL_M_LIMIT} rows")
    return max_m


def use_small_m(m: int, max_m: int) -> bool:
    """Whether a call of m rows takes the small-M kernels."""
    return m <= max_m
