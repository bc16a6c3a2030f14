"""What an exact attention that stops at each row's position would cost in the .pte's exact call (issue 44).

The exact call needs a row's bits to be independent of the call it is in. custom_sdpa gives that only under a
mask over every cache slot, so its cost follows max_seq_len, not the context. A kernel that runs each row's
keys 0..pos in one fixed order (online softmax per row, key by key) is exact by construction and costs the
context. This probe builds such a kernel as a torch C++ extension (not an ExecuTorch op) and times it against
llama::custom_sdpa with the full-cache mask and without a mask, on one layer's shapes, then scales by layers:

    python -m bench.lab.exact_attention [--heads 9 --kv-heads 3 --head-dim 64 --layers 30 --cache 512]
        [--contexts 64,112,160] [--out bench/results/cpu-exact-attention-probe.json]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch.utils.cpp_extension import load_inline

SOURCE = r"""
#include <torch/extension.h>
#include <cmath>
#include <vector>

// q [T, Hq, D], caches [S, Hkv, D], pos [T] -> out [T, Hq, D]; float32. Row t of head h reads keys 0..pos[t] of
// its KV head in index order: its bits depend on q[t, h], those keys and nothing else.
torch::Tensor exact_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor pos, double scale) {
  const int64_t T = q.size(0), Hq = q.size(1), D = q.size(2), Hkv = k.size(1);
  const int64_t G = Hq / Hkv;
  auto out = torch::empty_like(q);
  const float* qp = q.data_ptr<float>(); const float* kp = k.data_ptr<float>(); const float* vp = v.data_ptr<float>();
  const int64_t* pp = pos.data_ptr<int64_t>(); float* op = out.data_ptr<float>();
  std::vector<float> s(k.size(0));
  for (int64_t t = 0; t < T; ++t) {
    const int64_t n = pp[t] + 1;
    for (int64_t h = 0; h < Hq; ++h) {
      const float* qr = qp + (t * Hq + h) * D;
      const int64_t kh = h / G;
      float m = -INFINITY;
      for (int64_t j = 0; j < n; ++j) {
        const float* kr = kp + (j * Hkv + kh) * D;
        float acc = 0.f;
        for (int64_t d = 0; d < D; ++d) acc += qr[d] * kr[d];
        s[j] = acc * (float)scale;
        m = s[j] > m ? s[j] : m;
      }
      float l = 0.f;
      float* o = op + (t * Hq + h) * D;
      for (int64_t d = 0; d < D; ++d) o[d] = 0.f;
      for (int64_t j = 0; j < n; ++j) {
        const float p = std::exp(s[j] - m);
        l += p;
        const float* vr = vp + (j * Hkv + kh) * D;
        for (int64_t d = 0; d < D; ++d) o[d] += p * vr[d];
      }
      for (int64_t d = 0; d < D; ++d) o[d] /= l;
    }
  }
  return out;
}
"""


def build():
    return load_inline("eagle3_exact_attention_probe", cpp_sources=SOURCE, functions=["exact_attention"],
                       extra_cflags=["-O3", "-march=native", "-ffast-math"], verbose=False)


def timed(fn, reps: int) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--cache", type=int, default=512)
    ap.add_argument("--contexts", default="64,112,160", help="the call's first positions")
    ap.add_argument("--out", default=None, help="write the figures here as JSON")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--reps", type=int, default=200)
    args = ap.parse_args()
    from models.layers import load_llama_ops

    load_llama_ops()
    torch.set_num_threads(1)
    ext = build()
    T, Hq, Hkv, D, S = args.rows, args.heads, args.kv_heads, args.head_dim, args.cache
    result = {"cpu": torch.backends.cpu.get_cpu_capability(), "threads": 1, "rows": T, "cache": S, "heads": Hq,
              "kv_heads": Hkv, "head_dim": D, "layers": args.layers, "ms_for_all_layers": {}}
    for P in map(int, args.contexts.split(",")):
        q = torch.randn(1, T, Hq, D)
        kc, vc = torch.randn(1, S, Hkv, D), torch.randn(1, S, Hkv, D)
        pos = torch.arange(P, P + T)
        mask = torch.full((T, S), float("-inf"))
        mask[torch.arange(S)[None, :] <= pos[:, None]] = 0.0
        scale = D ** -0.5
        full = lambda: torch.ops.llama.custom_sdpa(q, kc, vc, P, mask, 0.0, False, scale)  # noqa: E731
        causal = lambda: torch.ops.llama.custom_sdpa(q, kc, vc, P, None, 0.0, True, scale)  # noqa: E731
        mine = lambda: ext.exact_attention(q[0], kc[0], vc[0], pos, scale)  # noqa: E731
        err = (mine() - full()[0]).abs().max().item()
        alone = ext.exact_attention(q[0, :1].contiguous(), kc[0], vc[0], pos[:1], scale)  # row 0 alone
        same = torch.equal(alone[0], mine()[0])
        rows = {name: timed(fn, args.reps) * args.layers for name, fn in (
            ("custom_sdpa, mask over every slot", full), ("custom_sdpa, causal to the context", causal),
            ("sequential per row to its position", mine))}
        result["ms_for_all_layers"][P] = {**{k: round(v, 3) for k, v in rows.items()},
                                          "max_abs_difference": err, "row_alone_equal": same}
        print(f"{result['cpu']}, 1 thread, {T} rows at position {P}, cache {S}, {Hq}/{Hkv} heads x {D}, "
              f"{args.layers} layers: max |difference| from custom_sdpa {err:.2e}, a row alone = among {T}: {same}")
        for name, ms in rows.items():
            print(f"  {name:>36}: {ms:6.2f} ms")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)

if __name__ == "__main__":
    main()
