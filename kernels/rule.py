"""The dispatch rule: a call of M <= max_m rows takes the small-M kernels, a larger one the dense path.

max_m is the verify window's largest T (docs/design.md §5): the exported verify range [2, max_m] and decode
(T = 1) sit at or under it and prefill's minimum sits above it, so every call site resolves to one side for its
whole shape range, and the rule leaves no data-dependent guard in an exported graph.

Within the small-M side, `int4_path` picks the INT4 GEMM shape by shape: ours (kernels/int4_gemm.py, or its Gluon
form on Hopper) or torch's int4 GEMM (tinygemm) where that one is faster, as measured on the H200 at every M.

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


# (K, N, group) -> the row counts M at which torch's int4 GEMM beats ours by more than 2% on the H200 (`python -m
# bench.kernels --only dispatch`, bench/results/h200-dispatch.json): every weight shape of the supported targets
# and of Llama-3-8B as kernels.transform builds them (q|k|v and gate|up fused), at M = 1..8. Below about 2^23
# weights torch's one launch (2.4-4.3 us) beats our prep + GEMM launches (5.7-13 us) at every M, so a shape not
# measured takes torch's under TORCH_INT4_BELOW weights and ours above; Llama-3-8B's take ours at every M.
_EVERY_M = frozenset(range(1, SMALL_M_LIMIT + 1))
TORCH_INT4: dict[tuple[int, int, int], frozenset[int]] = {
    **{shape: _EVERY_M for shape in (
        (576, 960, 32), (576, 576, 32), (576, 3072, 32), (1536, 576, 128),        # SmolLM2-135M
        (640, 1536, 128), (1024, 640, 128), (640, 4096, 128), (2048, 640, 128),   # Gemma 3 270M
        (1024, 1536, 128), (1024, 1024, 128), (1024, 5632, 128), (2816, 1024, 128))},  # +experiment=gpu
    (1024, 8192, 128): frozenset(range(1, 6)),  # +experiment=gpu lm_head
    (2048, 4096, 128): frozenset(range(1, 8)), (2048, 8192, 128): frozenset(range(1, 4)),
    (3072, 8192, 128): frozenset(range(1, 4)),
    (576, 49152, 32): frozenset(), (640, 262144, 128): frozenset(),  # SmolLM2's and Gemma's lm_head
    (4096, 6144, 128): frozenset(), (4096, 4096, 128): frozenset(), (4096, 28672, 128): frozenset(),
    (14336, 4096, 128): frozenset(), (4096, 128256, 128): frozenset(),  # Llama-3-8B
}
TORCH_INT4_BELOW = 1 << 23


def torch_int4_rows(K: int, N: int, group: int) -> frozenset[int]:
    """The row counts at which an [*, K] x [K, N] call of this group runs on torch's int4 GEMM (empty: never, so
    a layer keeps no second copy of its weights)."""
    if (K, N, group) in TORCH_INT4:
        return TORCH_INT4[(K, N, group)]
    return _EVERY_M if K * N < TORCH_INT4_BELOW else frozenset()


def int4_path(K: int, N: int, group: int, m: int) -> str:
    """'torch' where torch's int4 GEMM is the faster for an [m, K] x [K, N] call at this group, else 'ours'. A
    shape that takes one GEMM at every M decides without reading m, so a traced call with a symbolic row count
    stays dynamic; a mixed one reads it (and a trace specialises on it)."""
    rows = torch_int4_rows(K, N, group)
    if rows == _EVERY_M or not rows:
        return "torch" if rows else "ours"
    return "torch" if int(m) in rows else "ours"
