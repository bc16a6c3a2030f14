"""INT4 small-M GEMM: the format, the kernel against its reference for every M, split-K, export tracing.

CPU runs use Triton's interpreter. `kernels` decides compile-or-interpret when a kernel is launched (see
kernels/_jit.py), so the fixture below may set TRITON_INTERPRET after any other module imported triton.
"""


import pytest
import torch

from kernels import int4_gemm as G
from models.quantize import dequantize_w4, quantize_w4, unpack_w4

MAX_M = 8
CUDA = torch.cuda.is_available()


def rel_err(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def reference64(x, packed, scale_zero, group):
    return x.double() @ dequantize_w4(packed, scale_zero, group, torch.float64).t()


def test_packing_puts_even_k_in_the_low_nibble(seed):
    w = torch.randn(8, 64)
    packed, scale_zero = quantize_w4(w, 32)
    q = unpack_w4(packed)
    assert torch.equal(packed & 0xF, q[:, 0::2]) and torch.equal(packed >> 4, q[:, 1::2])
    assert packed.shape == (8, 32) and scale_zero.shape == (2, 8, 2) and scale_zero.dtype == torch.bfloat16


@pytest.mark.parametrize("group", [32, 128])
def test_quantisation_error_is_within_one_step_and_zero_is_a_level(seed, group):
    """Fresh random groups (not 4-bit grids), some all of one sign: every weight comes back within a step (half,
    plus half for the rounded zero), and 0 is one of each group's levels (an integer zero in 0..15)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(16, 256, generator=g) * 3
    w[:4] = w[:4].abs() + 1  # groups of one sign: their range still takes in 0
    w[4:8] = -w[4:8].abs() - 1
    packed, scale_zero = quantize_w4(w, group)
    err = (dequantize_w4(packed, scale_zero, group, torch.float32) - w).abs()
    step = scale_zero[..., 0].float().t().repeat_interleave(group, dim=1)
    assert (err <= step + 1e-6).all(), f"seed {seed}"
    zero = scale_zero[..., 1].float()
    assert torch.equal(zero, zero.round()) and 0 <= zero.min() and zero.max() <= 15


@pytest.mark.parametrize("group", [32, 128])
def test_a_4bit_gguf_block_comes_back_within_its_bf16_rounding(seed, group):
    """A group of 16 equally spaced levels from an arbitrary minimum (a Q4_1 block; both ends present, as
    llama.cpp's quantiser makes them) is kept: each weight within the bf16 rounding of its scale and zero, far
    under the half step a zero rounded to a code would cost."""
    g = torch.Generator().manual_seed(seed)
    N, K = 8, 256
    d = torch.rand(N, K // group, 1, generator=g) * 0.1 + 0.01
    m = (torch.rand(N, K // group, 1, generator=g) - 0.8) * 15 * d  # the block's minimum, anywhere near 0
    q = torch.randint(0, 16, (N, K // group, group), generator=g)
    q[..., 0], q[..., 1] = 0, 15
    w = (m + d * q).reshape(N, K)
    packed, scale_zero = quantize_w4(w, group)
    err = (dequantize_w4(packed, scale_zero, group, torch.float32) - w).abs()
    step, low = (x.expand(N, K // group, group).reshape(N, K) for x in (d, m.abs()))
    # bf16 keeps the scale and the minimum each within 2^-8 of itself: a code q <= 15 errs by (q d + |m|) 2^-8
    assert (err <= (step * 15 + low) * 2 ** -8 + 1e-6).all(), f"seed {seed}"


@pytest.mark.parametrize("group,config,K", [
    (32, (64, 64, 1, 4, 1), 256),    # N=80 leaves a masked tile edge; 4 k-tiles of 2 groups
    (32, (32, 128, 1, 4, 1), 256),   # 4 groups per k-tile: groups past the second load their own
    (128, (32, 128, 2, 4, 1), 256),  # split-K: partials + last-arriver reduce
    (128, (32, 128, 2, 4, 1), 768),  # split-K over 3 groups each: the next group's scale/zero are preloaded
    (128, (32, 128, 3, 4, 1), 768),  # a split that is not a power of 2
])
def test_kernel_matches_reference_for_every_m(interpret, seed, group, config, K):
    N = 80
    packed, scale_zero = quantize_w4(torch.randn(N, K), group)
    for M in range(1, MAX_M + 1):
        x = torch.randn(M, K).to(torch.bfloat16)
        out = torch.full((M, N), float("nan"), dtype=torch.bfloat16)
        G.launch_int4_mm(x, packed, scale_zero, group, config, out=out)
        assert not out.isnan().any(), f"unwritten outputs at M={M} (seed {seed})"
        # 4e-3: about twice the bf16 rounding of the output (the interpreter rounds to nearest, as the GPU)
        assert rel_err(out, reference64(x, packed, scale_zero, group)) < 4e-3, f"M={M} seed {seed}"
    if config[2] > 1:
        assert not G.counters(torch.device("cpu")).any(), "split-K arrival counters must be reset"


@pytest.mark.parametrize("group", [32, 128])
def test_prep_writes_x_in_fragment_order_and_group_sums(interpret, seed, group):
    """The prep kernel's contract with the GEMM: xp[:, g*G + c'] = x[:, g*G + src(c')] with position
    c' = ((v*4 + s)*4 + t)*2 + half taking k = 8(Q t + v) + s + 4 half (Q = G/32), and xs = per-group sums
    of x in float32 with rows M..15 zero (the GEMM reads all 16 rows unmasked)."""
    M, K = 5, 2 * group
    x = torch.randn(M, K).to(torch.bfloat16)
    xp = torch.full((M, K), float("nan"), dtype=torch.bfloat16)
    xs = torch.full((G.BLOCK_M, K // group), float("nan"))
    G._int4_prep_kernel[(K // group,)](x, xp, xs, M, K, x.stride(0), GROUP=group, BLOCK_M=G.BLOCK_M, PDL=False)
    src = fragment_order(K, group)
    assert torch.equal(xp, x[:, src])
    sums = x.float().reshape(M, K // group, group).sum(-1)
    assert torch.allclose(xs[:M], sums, rtol=1e-5, atol=1e-5) and not xs[M:].any()


def fragment_order(K, group):
    """src[c] = the k whose x the prep kernels write at position c: c = ((v*4 + s)*4 + t)*2 + half within a group
    takes k = 8(Q t + v) + s + 4 half (Q = group/32)."""
    Q, c = group // 32, torch.arange(group)
    half, t, s, v = c % 2, (c // 2) % 4, (c // 8) % 4, c // 32
    return torch.cat([g * group + 8 * (Q * t + v) + s + 4 * half for g in range(K // group)])


@pytest.mark.parametrize("M,block_m", [(3, 8), (11, 16)])
def test_gluon_prep_scales_x_so_the_fp16_product_is_exact(interpret, seed, M, block_m):
    """int4_gluon's prep kernel for its fp16 product: with the Gluon kernel's weight operand (1024 + q at even k,
    1024 + 16 q at odd k), sum over groups of s/r (P - C - z X) must equal x @ W.T in float64 to rounding,
    for a row beyond fp16's range (1e5) and a group of tiny values; x r stays below 2^15 and rows >= M are
    zero. Tolerance: C and X are float32 sums of terms 1024 times the product's, which leaves up to 2.5e-6 of
    sum |x||w| in 80 random draws (the bf16 output rounds at 4e-3)."""
    from kernels import int4_gluon
    K, N, group = 256, 16, 128
    packed, scale_zero = quantize_w4(torch.randn(N, K), group)
    x = torch.randn(M, K).to(torch.bfloat16)
    x[1] *= 1e5
    x[2, :group] *= 1e-6
    xp = torch.full((block_m, K), float("nan"), dtype=torch.float16)
    xs = torch.full((K // group, 4 * block_m), float("nan"))
    int4_gluon._prep_kernel[(K // group,)](x, xp, xs, M, K, x.stride(0), GROUP=group, BLOCK_M=block_m, PDL=False)
    assert xp.isfinite().all() and xp.abs().max() < 2 ** 15 and not xp[M:].any()
    assert not xs[:, :2 * block_m].reshape(-1, 2, block_m)[..., M:].any(), "C and X of rows >= M must be zero"
    q = unpack_w4(packed).double()
    wk = torch.where(torch.arange(K) % 2 == 1, 1024 + 16 * q, 1024 + q)[:, fragment_order(K, group)]
    y = torch.zeros(M, N, dtype=torch.float64)
    for g in range(K // group):
        ks = slice(g * group, (g + 1) * group)
        P = xp[:M, ks].double() @ wk[:, ks].t()
        c, x_sum, r_inv = (xs[g, i * block_m:i * block_m + M].double()[:, None] for i in range(3))
        s, z = scale_zero[g].double().unbind(-1)
        y += s * r_inv * (P - c - z * x_sum)
    ref = reference64(x, packed, scale_zero, group)
    magnitude = x.double().abs() @ dequantize_w4(packed, scale_zero, group, torch.float64).abs().t()
    assert ((y - ref).abs() <= 1e-5 * magnitude.amax(1, keepdim=True)).all(), f"seed {seed}"


def test_op_matches_the_reference(interpret, seed):
    packed, scale_zero = quantize_w4(torch.randn(64, 128), 32)
    x = torch.randn(3, 128).to(torch.bfloat16)
    out = G.int4_mm(x, packed, scale_zero, 32)
    assert rel_err(out, G.int4_mm_reference(x, packed, scale_zero, 32)) < 2e-2


def test_op_traces_into_an_exported_graph(interpret):
    packed, scale_zero = quantize_w4(torch.randn(64, 128), 128)

    class Lin(torch.nn.Module):
        def forward(self, x):
            return G.int4_mm(x, packed, scale_zero, 128)

    m = torch.export.Dim("m", min=1, max=MAX_M)
    ep = torch.export.export(Lin(), (torch.randn(4, 128).to(torch.bfloat16),), dynamic_shapes=({0: m},))
    assert any("int4_mm" in str(n.target) for n in ep.graph.nodes)
    x = torch.randn(7, 128).to(torch.bfloat16)
    assert rel_err(ep.module()(x), reference64(x, packed, scale_zero, 128)) < 1e-2


def test_more_rows_than_the_kernel_takes_are_refused():
    packed, scale_zero = quantize_w4(torch.randn(64, 128), 128)
    with pytest.raises(ValueError, match="M <= 16"):
        G.launch_int4_mm(torch.randn(17, 128).to(torch.bfloat16), packed, scale_zero, 128)


@pytest.mark.parametrize("K,N,split", [
    (5376, 21504, 3),  # 21 k-tiles of 256: 336 column tiles need 3 slices for 4 programs per SM (528)
    (21504, 5376, 7),  # 84 k-tiles, 84 column tiles: 7 slices (588) is the first divisor past 528
    (8192, 28672, 2),  # 448 tiles: 2 slices
    (4096, 4096, 8),   # 64 tiles: 8 slices would still leave 512 programs, and 8 is the cap
    (18944, 3584, 2),  # 74 k-tiles: no divisor between 2 and the cap, so the largest allowed
    (96, 64, 1),       # slices must stay >= 512 deep
])
def test_default_config_splits_k_by_divisors_up_to_the_cap(K, N, split):
    block_n, block_k, got, *_ = G.default_config(N, K, 128 if K % 128 == 0 else 32, sms=132)
    assert got == split and (K // block_k) % got == 0 and got <= G.MAX_SPLIT


def test_scale_zero_in_another_layout_is_refused():
    packed, scale_zero = quantize_w4(torch.randn(64, 128), 32)
    x = torch.randn(2, 128).to(torch.bfloat16)
    for bad in (scale_zero.transpose(0, 1), scale_zero[..., 0], scale_zero.float()):
        with pytest.raises(ValueError, match=r"scale_zero must be contiguous bfloat16 \[K/g, N, 2\] = \[4, 64, 2\]"):
            G.launch_int4_mm(x, packed, bad, 32)


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("group", [32, 128])
def test_gpu_kernel_matches_reference(seed, group):
    N, K = 3000, 4096  # N not a multiple of any BLOCK_N
    packed, scale_zero = (t.cuda() for t in quantize_w4(torch.randn(N, K), group))
    for M in range(1, 17):
        x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
        for config in (None, (64, 128, 4, 4, 3), (64, 256, 2, 4, 3, 96), (128, 256, 1, 8, 3)):
            out = torch.full((M, N), float("nan"), dtype=torch.bfloat16, device="cuda")
            G.launch_int4_mm(x, packed, scale_zero, group, config, out=out)
            assert not out.isnan().any(), f"unwritten outputs M={M} {config} seed {seed}"
            assert rel_err(out, reference64(x, packed, scale_zero, group)) < 4e-3, f"M={M} {config} seed {seed}"


HOPPER = CUDA and torch.cuda.get_device_capability()[0] == 9


@pytest.mark.parametrize("K,N,at_1,at_8,above_8", [
    (8192, 28672, (1, 4, 64), (1, 4, 64), (1, 4, 64)),  # tuned: 448 column tiles, K unsplit, the prep kernel
    (4096, 14336, (2, 4, 64, 2), (2, 4, 64), (2, 4, 64)),  # tuned: one launch at M <= 2, the prep kernel above
    (4096, 4096, (8, 2, 64, 8), (8, 2, 64, 8), None),  # tuned: one launch at M <= 8; above, the Triton kernel
    (14336, 4096, (8, 4, 64, 8), (8, 4, 64, 8), (8, 4, 64)),  # tuned: one launch at M <= 8; above, the prep kernel
    (8192, 8192, (4, 4, 64), (4, 4, 64), (4, 4, 64)),  # untuned, 64M weights: 128 tiles need 4 slices of 16 groups
    (4096, 16384, (1, 4, 64), (1, 4, 64), (1, 4, 64)),  # untuned: 256 tiles >= 1.5 per SM (198), unsplit
    (4096, 12288, (4, 4, 64), (4, 4, 64), (4, 4, 64)),  # untuned: 192 tiles < 198; 3 slices do not divide 32
    (2048, 4096, None, None, None),                     # untuned and under 2^25 weights: the Triton kernel
    (4096, 8192 + 32, None, None, None),                # N not a multiple of 64
])
def test_gluon_path_is_picked_for_tuned_and_large_group_128_shapes(K, N, at_1, at_8, above_8):
    from kernels import int4_gluon
    assert int4_gluon.pick(K, N, 128, torch.device("cpu")) == at_1
    assert int4_gluon.pick(K, N, 128, torch.device("cpu"), rows=8) == at_8
    assert int4_gluon.pick(K, N, 32, torch.device("cpu")) is None, "group 32 stays on the Triton kernel"
    assert int4_gluon.pick(K, N, 128, torch.device("cpu"), rows=9) == above_8


def test_cpu_tensors_never_take_the_gluon_path():
    from kernels import int4_gluon
    assert not int4_gluon.usable(torch.randn(2, 128).to(torch.bfloat16))


@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (TMA, wgmma)")
@pytest.mark.parametrize("K,N,config", [(4096, 1024, (1, 4, 64)), (4096, 1024, (4, 3, 64)), (3072, 512, (3, 6, 64)),
                                        (4096, 1024, (8, 4, 64, 8)), (4096, 1024, (8, 2, 64, 8)),
                                        (3072, 512, (1, 3, 64, 3)), (8192, 8192, None),
                                        (4096, 4096, None)])
def test_gpu_gluon_kernel_matches_reference(seed, K, N, config):
    """Every M in 1..16 (the 8- and 16-wide products), split-K with whole and partial waves, x from the prep
    kernel or staged in the kernel (one launch up to the M in a 4th config entry, the prep kernel above); None:
    the op's own choice, which must be this path for these shapes."""
    from kernels import int4_gluon
    packed, scale_zero = (t.cuda() for t in quantize_w4(torch.randn(N, K), 128))
    if config is None:
        assert int4_gluon.pick(K, N, 128, torch.device("cuda")) is not None
    for M in range(1, 17):
        x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
        if config is None:
            out = G.int4_mm(x, packed, scale_zero, 128)
        else:
            out = torch.full((M, N), float("nan"), dtype=torch.bfloat16, device="cuda")
            int4_gluon.launch(x, packed, scale_zero, config, out=out)
        assert not out.isnan().any(), f"unwritten outputs M={M} {config} seed {seed}"
        assert rel_err(out, reference64(x, packed, scale_zero, 128)) < 4e-3, f"M={M} {config} seed {seed}"
    assert not G.counters(torch.device("cuda")).any(), "split-K arrival counters must be reset"


def replays_match_eager(calls, x, check=lambda outs: None, replays: int = 2):
    """calls() captured in a CUDA graph; each replay on fresh x (outputs poisoned first) must equal eager calls
    bitwise and pass check(outputs). Returns the graph's outputs."""
    calls()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs_g = calls()
    for _ in range(replays):
        x.copy_(torch.randn_like(x))
        for o in outs_g:
            o.fill_(float("nan"))
        graph.replay()
        eager = calls()
        torch.cuda.synchronize()
        for j, (a, b) in enumerate(zip(outs_g, eager)):
            assert torch.equal(a, b), f"output {j}: graph replay differs from the eager call"
        check(outs_g)
    return outs_g


def test_only_grids_of_three_programs_per_sm_trigger_the_next_launch():
    """A sparse grid must not let the next call's programs start early: the block scheduler piles them onto a
    few SMs (kernels/int4_gluon.py, overlap mode)."""
    from kernels import int4_gluon
    cpu = torch.device("cpu")  # counts as the tuned GPU's SMs
    sms = G.sm_count(cpu)
    tiles = lambda programs: programs * int4_gluon.BLOCK_N
    assert int4_gluon.triggers(tiles(3 * sms), 1, cpu) and int4_gluon.triggers(tiles(sms), 3, cpu)
    assert not int4_gluon.triggers(tiles(3 * sms - 1), 1, cpu) and not int4_gluon.triggers(tiles(sms), 2, cpu)


@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (TMA, wgmma)")
def test_gpu_calls_in_sequence_replayed_from_a_graph_match_eager_and_reference(seed):
    """Each call's output is the next call's x, captured in one CUDA graph: the first three grids trigger the next
    launch at their start (so the next call's programs, and its prep kernel if it has one, are resident before
    this call ends); the last two stage x in one launch, the third of them triggering, the last not, and the first
    stages x in one launch at M = 1 and takes the prep kernel at M = 5 and 8. Every replay on fresh x equals the
    eager calls bitwise and each stage its float64 reference."""
    from kernels import int4_gluon
    dev = torch.device("cuda")
    sequence = [((4096, 14336), (2, 4, 64, 4)), ((14336, 4096), (8, 4, 64)), ((4096, 4096), (8, 4, 64, 8)),
                ((4096, 1024), (8, 4, 64, 8))]
    assert [int4_gluon.triggers(N, cfg[0], dev) for (K, N), cfg in sequence] == [True, True, True, False]
    weights = [tuple(t.cuda() for t in quantize_w4(torch.randn(N, K) * 0.05, 128)) for (K, N), _ in sequence]
    for M in (1, 5, 8):
        x = torch.randn(M, 4096, device="cuda").to(torch.bfloat16)

        def calls():
            outs, h = [], x
            for w, (_, cfg) in zip(weights, sequence):
                h = int4_gluon.launch(h, *w, cfg)
                outs.append(h)
            return outs

        def check(outs_g):
            for j, w in enumerate(weights):
                ref = reference64(x if j == 0 else outs_g[j - 1], *w, 128)
                assert rel_err(outs_g[j], ref) < 4e-3, f"stage {j} M={M} seed {seed}"

        replays_match_eager(calls, x, check)
    assert not G.counters(dev).any(), "split-K arrival counters must be reset"


@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (griddepcontrol)")
def test_gpu_call_after_a_triggering_kernel_or_torch_ops_matches_eager(seed):
    """The GEMM's first kernel is a programmatic dependent only after a launch of ours that triggers (the RMSNorm
    and SwiGLU kernels do; RoPE and a torch op do not): in a CUDA graph each order gives the eager result
    bitwise."""
    from kernels import _jit
    from kernels.norm_rope import rms_norm, rope, swiglu
    from kernels.transform import Int4Linear
    dev = torch.device("cuda")
    lin = Int4Linear(torch.nn.Linear(4096, 1024, bias=False), 128, 8).cuda()  # one launch (CONFIGS)
    w = (torch.rand(4096, device="cuda") + 0.5).to(torch.bfloat16)
    cos, sin = torch.rand(2, 3, 128, device="cuda").unbind(0)
    x = torch.randn(1, 3, 4096, device="cuda").to(torch.bfloat16)

    def calls():
        h = rms_norm(x, w, 1e-5)
        assert _jit.last_launch_triggers(dev)
        a = lin(h)  # launched as a dependent of the norm
        r = rope(a, cos, sin, 8)
        assert not _jit.last_launch_triggers(dev)
        b = lin(h)  # after RoPE: plain launch
        h2 = h * 2
        _jit.note_launch(dev, False)  # as KernelMLP says after torch's SwiGLU product
        c = lin(h2)
        s = swiglu(h, h2)
        assert _jit.last_launch_triggers(dev)
        d = lin(s)  # launched as a dependent of the SwiGLU kernel
        return a, r, b, c, d

    outs_g = replays_match_eager(calls, x)
    assert torch.equal(outs_g[0], outs_g[2])
