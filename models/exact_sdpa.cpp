// eagle3::exact_sdpa.out, the ExecuTorch kernel of models/exact_sdpa.py (which says why it exists).
//
// q [1, T, Hq, D], caches [1, S, Hkv, D], input_pos [T] -> out [1, T, Hq, D], float32, contiguous. Row t of q
// head h attends the keys of KV head h / (Hq / Hkv) from max(0, pos - window + 1) (window 0: from 0) to pos, one
// key after another in position order: the scores and their max, then exp and the weighted sum of the values. Its
// bits depend on that row and those keys only. ring > 0: the caches are a ring of S = ring slots, position j at
// slot j % ring (window in [1, ring]), so the same keys are visited in the same order as in a flat cache. Rows run
// in parallel on the runtime's threadpool; a row is never split, so the thread count does not change a bit either.
#include <executorch/extension/kernel_util/make_boxed_from_unboxed_functor.h>
#include <executorch/runtime/kernel/kernel_includes.h>
#include <executorch/runtime/kernel/thread_parallel_interface.h>

#include <cmath>
#include <vector>

using executorch::aten::ScalarType;
using executorch::aten::Tensor;
using executorch::runtime::KernelRuntimeContext;

namespace eagle3 {

Tensor& exact_sdpa_out(KernelRuntimeContext& ctx, const Tensor& q, const Tensor& k, const Tensor& v,
                       const Tensor& input_pos, int64_t window, double scale, int64_t ring, Tensor& out) {
  ET_KERNEL_CHECK_MSG(ctx, q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && q.size(0) == 1 && k.size(0) == 1,
                      InvalidArgument, out, "exact_sdpa: q [1, T, Hq, D] and caches [1, S, Hkv, D]");
  ET_KERNEL_CHECK_MSG(ctx, q.scalar_type() == ScalarType::Float && k.scalar_type() == ScalarType::Float &&
                      v.scalar_type() == ScalarType::Float && input_pos.scalar_type() == ScalarType::Long,
                      InvalidArgument, out, "exact_sdpa: float32 q and caches, int64 positions");
  ET_KERNEL_CHECK_MSG(ctx, k.size(3) == q.size(3) && q.size(2) % k.size(2) == 0 && input_pos.numel() == q.size(1),
                      InvalidArgument, out, "exact_sdpa: head sizes, GQA grouping or positions do not match");
  ET_KERNEL_CHECK_MSG(ctx, ring == 0 || (ring == k.size(1) && window > 0 && window <= ring), InvalidArgument, out,
                      "exact_sdpa: a ring holds the cache's slots and a window of 1 to ring positions");
  ET_KERNEL_CHECK(ctx, executorch::runtime::resize_tensor(out, q.sizes()) == executorch::runtime::Error::Ok,
                  InvalidArgument, out);
  const int64_t T = q.size(1), Hq = q.size(2), D = q.size(3), S = k.size(1), Hkv = k.size(2);
  const int64_t G = Hq / Hkv;
  const float* qp = q.const_data_ptr<float>();
  const float* kp = k.const_data_ptr<float>();
  const float* vp = v.const_data_ptr<float>();
  const int64_t* pp = input_pos.const_data_ptr<int64_t>();
  float* op = out.mutable_data_ptr<float>();
  const float sc = static_cast<float>(scale);
  for (int64_t t = 0; t < T; ++t) {
    ET_KERNEL_CHECK_MSG(ctx, pp[t] >= 0 && (ring > 0 || pp[t] < S), InvalidArgument, out,
                        "exact_sdpa: position outside the cache");
  }
  executorch::extension::parallel_for(0, T * Hq, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> s(S);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t t = i / Hq, h = i % Hq, kh = h / G, p = pp[t];
      const int64_t j0 = window > 0 && p - window + 1 > 0 ? p - window + 1 : 0;
      const float* qr = qp + i * D;
      float m = 0.f;
      for (int64_t j = j0; j <= p; ++j) {
        const float* kr = kp + ((ring > 0 ? j % ring : j) * Hkv + kh) * D;
        float acc = 0.f;
        for (int64_t d = 0; d < D; ++d) acc += qr[d] * kr[d];
        s[j - j0] = acc * sc;
        m = (j == j0 || s[j - j0] > m) ? s[j - j0] : m;
      }
      float* o = op + i * D;
      for (int64_t d = 0; d < D; ++d) o[d] = 0.f;
      float l = 0.f;
      for (int64_t j = j0; j <= p; ++j) {
        const float e = std::exp(s[j - j0] - m);
        l += e;
        const float* vr = vp + ((ring > 0 ? j % ring : j) * Hkv + kh) * D;
        for (int64_t d = 0; d < D; ++d) o[d] += e * vr[d];
      }
      const float inv = 1.f / l;
      for (int64_t d = 0; d < D; ++d) o[d] *= inv;
    }
  });
  return out;
}

}  // namespace eagle3

EXECUTORCH_LIBRARY(eagle3, "exact_sdpa.out", eagle3::exact_sdpa_out);
