"""The .pte's int4 weights (pipeline.export_pte.int4_groups, GroupOffsetLinear): a group that holds at most 16
equally spaced values (a Q4_1 or Q4_K block of a GGUF target) comes back exactly, up to its scale's bf16 rounding;
any other group is rounded asymmetrically, within half a step; and a linear on those weights computes what the
dense linear computes, up to the int8 rounding of its input, where symmetric groups are far off on skewed blocks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pipeline.export_pte import GroupOffsetLinear, int4_groups, quantize_int4

pytestmark = pytest.mark.usefixtures("one_torch_thread")
GROUP = 32


def gguf_like(n: int, k: int, g: torch.Generator) -> torch.Tensor:
    """Q4_1-style blocks: w = d * q + m, q in 0..15, d > 0 and m drawn per block of GROUP inputs."""
    d = torch.rand(n, k // GROUP, 1, generator=g) * 0.02 + 1e-3
    m = -torch.rand(n, k // GROUP, 1, generator=g) * 0.1
    q = torch.randint(0, 16, (n, k // GROUP, GROUP), generator=g).float()
    return (d * q + m).reshape(n, k)


def rebuild(q, d, o):
    return q.double() * d.double().repeat_interleave(GROUP, 1) + o.double().repeat_interleave(GROUP, 1)


def test_a_16_level_group_comes_back_within_its_scale_rounding(seed):
    g = torch.Generator().manual_seed(seed)
    w = gguf_like(24, 4 * GROUP, g)
    q, d, o, exact = int4_groups(w, GROUP)
    assert exact.all() and q.dtype == torch.int8 and int(q.min()) >= -8 and int(q.max()) <= 7
    assert torch.equal(d, d.to(torch.bfloat16).float()), "the scales are what XNNPACK keeps (bf16)"
    bound = (2.0 ** -8) * d.double() * 7.5 + 1e-7  # |d - bf16(d)| * half the code range
    err = (rebuild(q, d, o) - w.double()).abs().reshape(24, 4, GROUP).amax(-1)
    assert (err <= bound).all(), float((err / bound).max())


def test_any_other_group_is_rounded_within_half_its_step(seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(16, 3 * GROUP, generator=g)
    q, d, o, exact = int4_groups(w, GROUP)
    assert not exact.any()
    blocks = w.double().reshape(16, 3, GROUP)
    step = (blocks.amax(-1) - blocks.amin(-1)) / 15
    err = (rebuild(q, d, o) - w.double()).abs().reshape(16, 3, GROUP).amax(-1)
    assert (err <= step / 2 * 1.01 + step * 2.0 ** -8 * 7.5).all()


def test_the_offset_linear_is_the_dense_linear_where_symmetric_groups_are_not(seed):
    g = torch.Generator().manual_seed(seed)
    dense = nn.Linear(4 * GROUP, 48, bias=True)
    with torch.no_grad():
        dense.weight.copy_(gguf_like(48, 4 * GROUP, g))
        dense.bias.copy_(torch.randn(48, generator=g))
    x = torch.randn(2, 5, 4 * GROUP, generator=g)
    ref = dense(x)
    ours = GroupOffsetLinear(dense, GROUP)
    symmetric = nn.Sequential(nn.Linear(4 * GROUP, 48, bias=True))
    symmetric[0].load_state_dict(dense.state_dict())
    quantize_int4(symmetric, GROUP)
    with torch.no_grad():
        err_ours = (ours(x) - ref).abs().max().item()
        err_sym = (symmetric(x) - ref).abs().max().item()
    assert ours.exact_share == 1.0
    assert err_ours < 0.02 * ref.abs().max().item(), err_ours  # the int8 rounding of x alone
    assert err_ours * 4 < err_sym, (err_ours, err_sym)


def test_quantize_int4_with_offsets_replaces_every_eligible_linear_and_names_the_rest():
    model = nn.Sequential(nn.Linear(2 * GROUP, 8), nn.ReLU(), nn.Linear(8, 4))
    assert quantize_int4(model, GROUP, offsets=True) == ["2"]
    assert isinstance(model[0], GroupOffsetLinear) and isinstance(model[2], nn.Linear)
    assert F.linear(torch.ones(1, 2 * GROUP), model[0].group_sums).tolist() == [[float(GROUP)] * 2]
