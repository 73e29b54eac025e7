// Sampling: argmax.
#include "ops.h"
#include "common.h"

namespace OPS_NAMESPACE {

// out[r] = the index of the largest of x[r, 0 .. n), r < rows: the first one on a tie and the
// first NaN if the row has one (torch.argmax's rules). A max pass, then a search for its first
// occurrence. Plain loops over LANES independent lanes, which the compiler vectorizes: the NaN
// bookkeeping needs per-lane compares that F32x16 does not have.
inline void argmax_rows(const float* x, int64_t* out, int64_t rows, int64_t n) {
  constexpr int LANES = 16;
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* v = x + r * n;
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
      out[r] = found;
    }
  });
}

// Index of the largest value of each row: x [N, V] float32 -> [N] int64 (see argmax_rows;
// torch's CPU argmax is scalar, about 1 ns per logit).
Tensor argmax(const Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) > 0,
              "argmax: x must be a float32 [N, V] tensor with V > 0");
  Tensor xc = x.contiguous();
  Tensor out = at::empty({xc.size(0)}, xc.options().dtype(at::kLong));
  argmax_rows(xc.data_ptr<float>(), out.data_ptr<int64_t>(), xc.size(0), xc.size(1));
  return out;
}

}  // namespace OPS_NAMESPACE
