"""What the two INT4 GEMM kernels (kernels/int4_gemm.py in Triton, kernels/int4_gluon.py in Gluon) share at
launch: the row limit, the programmatic-dependent-launch switch and the split-K arrival counters.

With SPLIT_K > 1 every program of a column tile writes an fp32 partial and increments the tile's counter; the
last to arrive sums the partials in split order, writes the output and resets the counter. So a counter is
zero between launches, one buffer per device serves every launch of either kernel, and a CUDA graph can
replay launches that use it, provided it was allocated before the capture.
"""

from __future__ import annotations

import torch

from kernels.rule import SMALL_M_LIMIT

BLOCK_M = SMALL_M_LIMIT  # the most activation rows a call takes (kernels.rule), all of them in one product
USE_PDL = True  # programmatic dependent launch between our kernels (GPU only; read at every launch)
MAX_TILES = 1 << 15  # column tiles a launch may have: the counter buffer's length

_COUNTERS: dict[torch.device, torch.Tensor] = {}


def counters(device) -> torch.Tensor:
    """The per-device split-K arrival counters (all zero between launches). Allocate before graph capture."""
    device = torch.device(device)
    if device not in _COUNTERS:
        _COUNTERS[device] = torch.zeros(MAX_TILES, dtype=torch.int32, device=device)
    return _COUNTERS[device]
