"""GPU kernels for verify-sized calls (M <= max_m rows), each beside its plain PyTorch reference.

- int4_gemm: INT4 weight-only GEMM, weight-stationary for M <= 16 (`int4_mm`, `quantize_int4`,
  `int4_mm_reference`); on a Hopper GPU `int4_mm` runs the tuned and the large group-128 shapes on
  int4_gluon, the same arithmetic warp-specialised in Gluon (a TMA producer warp feeding one consumer
  warpgroup; up to a per-shape M one launch, x staged by a stager warp of its own; a grid of >= 3 programs per
  SM lets the next kernel start during its tail, and a call starts early only after a launch of ours that
  allows it: `kernels._jit`);
- sdpa_midm: split-K attention for M <= 16 query rows over a long GQA KV cache (`sdpa_midm`,
  `sdpa_reference`);
- norm_rope: the model's RMSNorm, RoPE and SwiGLU product in one launch each, equal to models/layers.py
  (`rms_norm`, `rope`, `swiglu`);
- dispatch: the one rule, M <= max_m -> these kernels, else the dense path;
- transform: `to_kernels(model)` puts a models/ Transformer on them (CUDA; CPU under TRITON_INTERPRET=1).
All ops are `torch.library.triton_op`s (eagle3::int4_mm, eagle3::sdpa_midm, eagle3::rms_norm,
eagle3::rope, eagle3::swiglu) with fake implementations, so they trace into torch.export graphs.
Benchmarks and notes: bench/kernels.py, bench/NOTES.md.
"""
