// Shared helpers of the CPU kernels: row conversions between float32 and the storage dtypes,
// row reductions and updates over F32x16 (vec.h), a branch-free exp and SwiGLU's product, and
// the dtype dispatch of the torch bindings.
#pragma once

#include "ops.h"
#include "vec.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

namespace OPS_NAMESPACE {

using at::Tensor;

// dst[i] = src[i] for i < n, converting float32 <-> bfloat16 (round to nearest even).
template <typename S, typename D>
inline void convert(const S* src, D* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<D>(static_cast<float>(src[i]));
}

// src as float32: itself, or converted into buf [n].
inline const float* as_float(const float* src, float*, int64_t) { return src; }
template <typename T>
inline const float* as_float(const T* src, float* buf, int64_t n) {
  convert(src, buf, n);
  return buf;
}

inline float dot(const float* a, const float* b, int64_t n) {
  F32x16 acc = F32x16::zero();
  for_each_vec(n, [&](int64_t i, int64_t c) {
    acc = fma(F32x16::load(a + i, c), F32x16::load(b + i, c), acc);
  });
  return reduce_add(acc);
}

inline float sum(const float* a, int64_t n) {
  F32x16 acc = F32x16::zero();
  for_each_vec(n, [&](int64_t i, int64_t c) { acc = acc + F32x16::load(a + i, c); });
  return reduce_add(acc);
}

// max of a[0 .. n), n >= 1, NaNs skipped (std::max_element is one serial chain).
inline float max_of(const float* a, int64_t n) {
  F32x16 m = F32x16::set1(a[0]);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) m = max(F32x16::load(a + i), m);
  float s = reduce_max(m);
  for (; i < n; ++i) s = std::max(s, a[i]);
  return s;
}

// y[0 .. n) += s * x[0 .. n)
inline void axpy(float s, const float* x, float* y, int64_t n) {
  const F32x16 sv = F32x16::set1(s);
  for_each_vec(n, [&](int64_t i, int64_t c) {
    fma(sv, F32x16::load(x + i, c), F32x16::load(y + i, c)).store(y + i, c);
  });
}

// x[0 .. n) *= s
inline void scale_by(float* x, float s, int64_t n) {
  const F32x16 sv = F32x16::set1(s);
  for_each_vec(n, [&](int64_t i, int64_t c) { (F32x16::load(x + i, c) * sv).store(x + i, c); });
}

// exp, branch-free so that loops over it vectorize (std::exp does not): x = n ln2 + r,
// |r| <= ln2 / 2, exp(r) by its degree-6 Taylor polynomial (relative error < 3e-7), 2^n put
// straight into the exponent bits; x is clamped to [-87, 88], inside float's normal range.
inline float fast_exp(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = x - n * 0.693147180559945309f;
  float p = 1.f / 720;
  p = p * r + 1.f / 120;
  p = p * r + 1.f / 24;
  p = p * r + 1.f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// SwiGLU's product for one column: silu(g) * u (silu_and_mul and the gated GEMM's epilogue).
inline float silu_times(float g, float u) { return g / (1.f + fast_exp(-g)) * u; }

// Calls f(std::integral_constant<int, n>{}) for 1 <= n <= MAX (n clamped into that range): a
// tile's row count as a template argument, so that its accumulators are a fixed set of
// registers. One comparison per smaller count: a tile's work dwarfs the chain.
template <int MAX, typename F>
inline void dispatch_rows(int64_t n, F&& f) {
  if constexpr (MAX > 1) {
    if (n < MAX) return dispatch_rows<MAX - 1>(n, std::forward<F>(f));
  }
  return f(std::integral_constant<int, MAX>{});
}

// Calls f(T{}) with T the C++ type of dtype: float32 or bfloat16, the dtypes the model's
// float32 path and its int4 linear layers produce.
template <typename F>
void dispatch(at::ScalarType dtype, const char* name, F&& f) {
  if (dtype == at::kFloat)
    f(float{});
  else if (dtype == at::kBFloat16)
    f(c10::BFloat16{});
  else
    TORCH_CHECK(false, name, ": unsupported dtype ", dtype, " (float32 or bfloat16)");
}

}  // namespace OPS_NAMESPACE
