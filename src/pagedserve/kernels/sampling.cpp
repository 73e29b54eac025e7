// Sampling: argmax.
#include "ops.h"
#include "common.h"

namespace OPS_NAMESPACE {

// Index of the largest value of each row: x [N, V] float32 -> [N] int64, the first one on a
// tie and the first NaN if a row has one (torch.argmax's rules). A vectorized max pass, then a
// search for its first occurrence: torch's CPU argmax is scalar (about 1 ns per logit).
Tensor argmax(const Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) > 0,
              "argmax: x must be a float32 [N, V] tensor with V > 0");
  Tensor xc = x.contiguous();
  const int64_t rows = xc.size(0), n = xc.size(1);
  Tensor out = at::empty({rows}, xc.options().dtype(at::kLong));
  const float* xp = xc.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* v = xp + r * n;
      float lanes[LANES];
      int nan_lanes[LANES] = {};
      std::fill(lanes, lanes + LANES, -INFINITY);
      int64_t i = 0;
      for (; i + LANES <= n; i += LANES)
        for (int l = 0; l < LANES; ++l) {
          lanes[l] = std::max(lanes[l], v[i + l]);  // NaN never replaces a value here
          nan_lanes[l] |= v[i + l] != v[i + l];
        }
      float m = *std::max_element(lanes, lanes + LANES);
      bool has_nan = *std::max_element(nan_lanes, nan_lanes + LANES);
      for (; i < n; ++i) {
        m = std::max(m, v[i]);
        has_nan |= std::isnan(v[i]);
      }
      auto hit = [&](float value) { return has_nan ? std::isnan(value) : value == m; };
      for (i = 0; i + LANES <= n; i += LANES) {  // the chunk holding the first hit
        bool any = false;
        for (int l = 0; l < LANES; ++l) any |= hit(v[i + l]);
        if (any) break;
      }
      int64_t found = i;
      while (found < n - 1 && !hit(v[found])) ++found;
      op[r] = found;
    }
  });
  return out;
}

}  // namespace OPS_NAMESPACE
