// Norms and activations: add_rms_norm, silu_and_mul.
#include "ops.h"
#include "common.h"

namespace OPS_NAMESPACE {

// One row of RMSNorm (Zhang & Sennrich 2019): out = x / sqrt(mean(x^2) + eps) * w, through
// tmp [n] when O is not float32.
template <typename O>
inline void rms_norm_row(const float* x, const float* w, O* out, int64_t n, float eps,
                         float* tmp) {
  const F32x16 inv = F32x16::set1(1.f / std::sqrt(dot(x, x, n) / n + eps));
  float* y = tmp;
  if constexpr (std::is_same_v<O, float>) y = out;
  for_each_vec(n, [&](int64_t i, int64_t c) {
    (F32x16::load(x + i, c) * inv * F32x16::load(w + i, c)).store(y + i, c);
  });
  if constexpr (!std::is_same_v<O, float>) convert(tmp, out, n);
}

// residual [rows, n] += y (when y is not null), then out = RMSNorm(residual) * w.
template <typename Y, typename O>
void add_rms_norm_rows(float* residual, const Y* y, const float* w, O* out, int64_t rows,
                       int64_t n, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> tmp(n);
    for (int64_t t = begin; t < end; ++t) {
      float* r = residual + t * n;
      if (y)
        for (int64_t i = 0; i < n; ++i) r[i] += static_cast<float>(y[t * n + i]);
      rms_norm_row(r, w, out + t * n, n, eps, tmp.data());
    }
  });
}

// residual [T, n] float32, updated in place when y is given: residual += y; returns
// RMSNorm(residual) [T, n] of out_dtype. weight [n] float32.
Tensor add_rms_norm(Tensor residual, const std::optional<Tensor>& y, const Tensor& weight,
                    double eps, at::ScalarType out_dtype) {
  TORCH_CHECK(residual.dim() == 2 && residual.is_contiguous() &&
                  residual.scalar_type() == at::kFloat,
              "add_rms_norm: residual must be a contiguous float32 [T, n] tensor");
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous(),
              "add_rms_norm: weight must be contiguous float32");
  const int64_t rows = residual.size(0), n = residual.size(1);
  TORCH_CHECK(weight.numel() == n, "add_rms_norm: weight must have n elements");
  TORCH_CHECK(!y.has_value() || y->sizes() == residual.sizes(),
              "add_rms_norm: y must have the residual's shape");
  Tensor out = at::empty({rows, n}, residual.options().dtype(out_dtype));
  Tensor yc = y.has_value() ? y->contiguous() : Tensor();
  dispatch(out_dtype, "add_rms_norm", [&](auto o_tag) {
    using O = decltype(o_tag);
    auto run = [&](auto* yp) {
      add_rms_norm_rows(residual.data_ptr<float>(), yp, weight.data_ptr<float>(),
                        out.data_ptr<O>(), rows, n, static_cast<float>(eps));
    };
    if (!yc.defined())
      run(static_cast<const float*>(nullptr));
    else
      dispatch(yc.scalar_type(), "add_rms_norm", [&](auto y_tag) {
        run(yc.data_ptr<decltype(y_tag)>());
      });
  });
  return out;
}

// x [rows, 2 inter] = gate | up -> out [rows, inter] = silu(gate) * up.
template <typename I, typename O>
void silu_and_mul_rows(const I* x, O* out, int64_t rows, int64_t inter) {
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> g(inter), u(inter);
    for (int64_t t = begin; t < end; ++t) {
      convert(x + t * 2 * inter, g.data(), inter);
      convert(x + t * 2 * inter + inter, u.data(), inter);
      for (int64_t i = 0; i < inter; ++i) g[i] = silu_times(g[i], u[i]);
      convert(g.data(), out + t * inter, inter);
    }
  });
}

// x [T, 2I] = gate | up -> silu(gate) * up [T, I] of out_dtype (SwiGLU, Shazeer 2020).
Tensor silu_and_mul(const Tensor& x, at::ScalarType out_dtype) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0, "silu_and_mul: x must be [T, 2I]");
  Tensor xc = x.contiguous();
  const int64_t rows = xc.size(0), inter = xc.size(1) / 2;
  Tensor out = at::empty({rows, inter}, xc.options().dtype(out_dtype));
  dispatch(xc.scalar_type(), "silu_and_mul", [&](auto i_tag) {
    dispatch(out_dtype, "silu_and_mul", [&](auto o_tag) {
      silu_and_mul_rows(xc.data_ptr<decltype(i_tag)>(), out.data_ptr<decltype(o_tag)>(), rows,
                        inter);
    });
  });
  return out;
}

}  // namespace OPS_NAMESPACE
