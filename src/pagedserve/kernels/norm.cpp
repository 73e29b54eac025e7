// Norms and activations: add_rms_norm, silu_and_mul.
#include "ops.h"
#include "common.h"

namespace OPS_NAMESPACE {

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
  float* res = residual.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  Tensor yc = y.has_value() ? y->contiguous() : Tensor();
  dispatch(out_dtype, "add_rms_norm", [&](auto o_tag) {
    using O = decltype(o_tag);
    O* o = out.data_ptr<O>();
    auto norm_rows = [&](auto add_row) {
      at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
        std::vector<float> tmp(n);
        for (int64_t t = begin; t < end; ++t) {
          add_row(t, res + t * n);
          rms_norm_row(res + t * n, w, o + t * n, n, static_cast<float>(eps), tmp.data());
        }
      });
    };
    if (!yc.defined()) {
      norm_rows([](int64_t, float*) {});
      return;
    }
    dispatch(yc.scalar_type(), "add_rms_norm", [&](auto y_tag) {
      using Y = decltype(y_tag);
      const Y* yp = yc.data_ptr<Y>();
      norm_rows([&](int64_t t, float* r) {
        for (int64_t i = 0; i < n; ++i) r[i] += to_f(yp[t * n + i]);
      });
    });
  });
  return out;
}

// x [T, 2I] = gate | up -> silu(gate) * up [T, I] of out_dtype (SwiGLU, Shazeer 2020).
Tensor silu_and_mul(const Tensor& x, at::ScalarType out_dtype) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0, "silu_and_mul: x must be [T, 2I]");
  Tensor xc = x.contiguous();
  const int64_t rows = xc.size(0), inter = xc.size(1) / 2;
  Tensor out = at::empty({rows, inter}, xc.options().dtype(out_dtype));
  dispatch(xc.scalar_type(), "silu_and_mul", [&](auto i_tag) {
    using I = decltype(i_tag);
    const I* xp = xc.data_ptr<I>();
    dispatch(out_dtype, "silu_and_mul", [&](auto o_tag) {
      using O = decltype(o_tag);
      O* o = out.data_ptr<O>();
      at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
        std::vector<float> g(inter), u(inter);
        for (int64_t t = begin; t < end; ++t) {
          load(xp + t * 2 * inter, g.data(), inter);
          load(xp + t * 2 * inter + inter, u.data(), inter);
          for (int64_t i = 0; i < inter; ++i) g[i] = silu_times(g[i], u[i]);
          store(g.data(), o + t * inter, inter);
        }
      });
    });
  });
  return out;
}

}  // namespace OPS_NAMESPACE
