// Shared helpers of the CPU kernels: float32 loads and stores of float32 or bfloat16 rows,
// reductions written so that the compiler vectorizes them, the few AVX-512 intrinsics with
// their portable fallbacks, a branch-free exp, one RMSNorm row, and the dtype dispatch.
#pragma once

#include "ops.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

namespace OPS_NAMESPACE {

using at::Tensor;

constexpr int LANES = 16;  // independent accumulators: lets the compiler use vector registers

inline float to_f(float x) { return x; }
inline float to_f(c10::BFloat16 x) { return static_cast<float>(x); }

template <typename T>
inline void load(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = to_f(src[i]);
}

// src as float32: itself, or converted into buf [n].
inline const float* as_float(const float* src, float*, int64_t) { return src; }
template <typename T>
inline const float* as_float(const T* src, float* buf, int64_t n) {
  load(src, buf, n);
  return buf;
}

template <typename T>
inline void store(const float* src, T* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(src[i]);
}

// The sum of term(i) for i < n, over LANES independent accumulators: without -ffast-math the
// compiler may only vectorize a float reduction written this way.
template <typename F>
inline float lane_sum(int64_t n, F term) {
  float acc[LANES] = {};
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES)
    for (int l = 0; l < LANES; ++l) acc[l] += term(i + l);
  float s = 0.f;
  for (int l = 0; l < LANES; ++l) s += acc[l];
  for (; i < n; ++i) s += term(i);
  return s;
}

inline float dot(const float* a, const float* b, int64_t n) {
#if defined(__AVX512F__)  // one horizontal sum per dot instead of LANES scalar adds
  int64_t i = 0;
  __m512 v = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) v = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), v);
  float s = _mm512_reduce_add_ps(v);
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
#else
  return lane_sum(n, [&](int64_t j) { return a[j] * b[j]; });
#endif
}

// scores[t] = q . (keys[t] + offset)[0 .. d) for t < n.
inline void scores_of_row(const float* q, const float* const* keys, int64_t offset, int64_t n,
                          int64_t d, float* scores) {
  int64_t t = 0;
#if defined(__AVX512F__)
  if (d % 16 == 0) {  // four dot products, then one 4-way horizontal sum
    auto half_sum = [](__m512 v) {
      return _mm256_add_ps(_mm512_castps512_ps256(v),
                           _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    };
    for (; t + 4 <= n; t += 4) {
      __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      for (int64_t i = 0; i < d; i += 16) {
        const __m512 qv = _mm512_loadu_ps(q + i);
        a0 = _mm512_fmadd_ps(qv, _mm512_loadu_ps(keys[t] + offset + i), a0);
        a1 = _mm512_fmadd_ps(qv, _mm512_loadu_ps(keys[t + 1] + offset + i), a1);
        a2 = _mm512_fmadd_ps(qv, _mm512_loadu_ps(keys[t + 2] + offset + i), a2);
        a3 = _mm512_fmadd_ps(qv, _mm512_loadu_ps(keys[t + 3] + offset + i), a3);
      }
      // hadd twice: [s0 s1 s2 s3] of the low and of the high 128 bits, then their sum
      const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(half_sum(a0), half_sum(a1)),
                                      _mm256_hadd_ps(half_sum(a2), half_sum(a3)));
      _mm_storeu_ps(scores + t, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
    }
  }
#endif
  for (; t < n; ++t) scores[t] = dot(q, keys[t] + offset, d);
}

inline float sum(const float* a, int64_t n) {
  return lane_sum(n, [&](int64_t i) { return a[i]; });
}

// max of a[0 .. n), n >= 1, over LANES running maxima (std::max_element is one serial chain).
inline float max_of(const float* a, int64_t n) {
  float lanes[LANES];
  std::fill(lanes, lanes + LANES, a[0]);
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES)
    for (int l = 0; l < LANES; ++l) lanes[l] = std::max(lanes[l], a[i + l]);
  float m = *std::max_element(lanes, lanes + LANES);
  for (; i < n; ++i) m = std::max(m, a[i]);
  return m;
}

// acc[0 .. d) += sum over t < n of p[t] * (rows[t] + offset)[0 .. d): the accumulator stays in
// registers across the tokens (D16 = d / 16 vectors) instead of a load and store per token.
template <int D16>
inline void weighted_rows(const float* p, const float* const* rows, int64_t offset, int64_t n,
                          float* acc) {
#if defined(__AVX512F__)
  __m512 a[D16];
  for (int j = 0; j < D16; ++j) a[j] = _mm512_loadu_ps(acc + 16 * j);
  for (int64_t t = 0; t < n; ++t) {
    const __m512 w = _mm512_set1_ps(p[t]);
    const float* v = rows[t] + offset;
    for (int j = 0; j < D16; ++j) a[j] = _mm512_fmadd_ps(w, _mm512_loadu_ps(v + 16 * j), a[j]);
  }
  for (int j = 0; j < D16; ++j) _mm512_storeu_ps(acc + 16 * j, a[j]);
#else
  for (int64_t t = 0; t < n; ++t)
    for (int64_t i = 0; i < 16 * D16; ++i) acc[i] += p[t] * rows[t][offset + i];
#endif
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

// One row of RMSNorm (Zhang & Sennrich 2019): out = x / sqrt(mean(x^2) + eps) * w.
template <typename O>
inline void rms_norm_row(const float* x, const float* w, O* out, int64_t n, float eps,
                         float* tmp) {
  const float inv = 1.f / std::sqrt(dot(x, x, n) / n + eps);
  for (int64_t i = 0; i < n; ++i) tmp[i] = x[i] * inv * w[i];
  store(tmp, out, n);
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
