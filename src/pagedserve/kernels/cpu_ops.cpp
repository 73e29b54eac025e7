// Fused CPU kernels of the decoder's hot path (see kernels/__init__.py for when they are used).
//
// Each kernel replaces a chain of small torch ops whose per-op dispatch cost, not arithmetic,
// dominated a decode step. All arithmetic is float32 whatever the storage dtype (float32,
// bfloat16 or float16); every kernel has a torch reference in the model code and a test
// comparing the two. Work is split over rows (tokens, or sequence x KV head) with
// at::parallel_for, ATen's own thread pool.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

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

inline float dot(const float* a, const float* b, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)  // one horizontal sum per dot instead of LANES scalar adds
  __m512 v = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) v = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), v);
  float s = _mm512_reduce_add_ps(v);
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
#else
  float acc[LANES] = {};
  for (; i + LANES <= n; i += LANES)
    for (int l = 0; l < LANES; ++l) acc[l] += a[i + l] * b[i + l];
  float s = 0.f;
  for (int l = 0; l < LANES; ++l) s += acc[l];
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
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
          for (int64_t i = 0; i < inter; ++i) g[i] = g[i] / (1.f + fast_exp(-g[i])) * u[i];
          store(g.data(), o + t * inter, inter);
        }
      });
    });
  });
  return out;
}

// Rotary embedding (Su et al. 2021, rotate-half layout) of the q and k parts of the fused
// projection qkv [T, (H + 2 KVH) D], then the new K/V written to their cache slots:
// k_cache/v_cache [num_blocks, block_size, KVH, D], row slot_mapping[t] of the flattened
// [num_blocks * block_size, KVH, D] view (PagedAttention sec. 4.1). cos/sin_signed [T, D]
// float32 (sin with its first half negated: rotate_half(x) * sin == roll(x) * sin_signed).
// Returns the rotated queries [T, H, D] of q_dtype.
Tensor rotary_write_kv(const Tensor& qkv, const Tensor& cos, const Tensor& sin,
                       Tensor k_cache, Tensor v_cache, const Tensor& slot_mapping,
                       int64_t num_heads, int64_t num_kv_heads, at::ScalarType q_dtype) {
  const int64_t d = k_cache.size(3), tokens = qkv.size(0);
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == (num_heads + 2 * num_kv_heads) * d,
              "rotary_write_kv: qkv must be [T, (H + 2 KVH) D]");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                  cos.numel() == tokens * d && sin.numel() == tokens * d,
              "rotary_write_kv: cos/sin must be float32 [T, D]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.size(2) == num_kv_heads && v_cache.sizes() == k_cache.sizes() &&
                  v_cache.scalar_type() == k_cache.scalar_type(),
              "rotary_write_kv: k_cache/v_cache must be contiguous [N, bs, KVH, D] alike");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.numel() == tokens,
              "rotary_write_kv: slot_mapping must be int64 [T]");
  Tensor qkvc = qkv.contiguous(), cosc = cos.contiguous(), sinc = sin.contiguous();
  Tensor slots = slot_mapping.contiguous();
  Tensor q = at::empty({tokens, num_heads, d}, qkvc.options().dtype(q_dtype));
  const int64_t width = qkvc.size(1), half = d / 2, kv = num_kv_heads * d;
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(slot[t] >= 0 && slot[t] < num_slots, "rotary_write_kv: slot out of range");
  dispatch(qkvc.scalar_type(), "rotary_write_kv", [&](auto i_tag) {
    using I = decltype(i_tag);
    const I* src = qkvc.data_ptr<I>();
    dispatch(k_cache.scalar_type(), "rotary_write_kv_cache", [&](auto c_tag) {
      using C = decltype(c_tag);
      C* kc = k_cache.data_ptr<C>();
      C* vc = v_cache.data_ptr<C>();
      dispatch(q_dtype, "rotary_write_kv_q", [&](auto q_tag) {
        using Q = decltype(q_tag);
        Q* qo = q.data_ptr<Q>();
        at::parallel_for(0, tokens, 1, [&](int64_t begin, int64_t end) {
          std::vector<float> x(std::max(d, kv)), y(d);
          for (int64_t t = begin; t < end; ++t) {
            const float* c = cosc.data_ptr<float>() + t * d;
            const float* s = sinc.data_ptr<float>() + t * d;
            const I* row = src + t * width;
            for (int64_t h = 0; h < num_heads + num_kv_heads; ++h) {
              load(row + h * d, x.data(), d);
              for (int64_t i = 0; i < half; ++i) y[i] = x[i] * c[i] + x[i + half] * s[i];
              for (int64_t i = half; i < d; ++i) y[i] = x[i] * c[i] + x[i - half] * s[i];
              if (h < num_heads)
                store(y.data(), qo + (t * num_heads + h) * d, d);
              else
                store(y.data(), kc + slot[t] * kv + (h - num_heads) * d, d);
            }
            load(row + (num_heads + num_kv_heads) * d, x.data(), kv);
            store(x.data(), vc + slot[t] * kv, kv);
          }
        });
      });
    });
  });
  return q;
}

// Decode attention straight over the paged cache (PagedAttention sec. 4.1): one query per
// sequence, each of its G = H / KVH query heads per KV head reading the K/V rows of that head
// through the block table, so K/V are read once per (sequence, KV head) and never gathered.
// q [B, H, D]; k_cache/v_cache [num_blocks, block_size, KVH, D]; block_tables [B, M] int64;
// seq_lens [B] int64 (keys 0 .. seq_len - 1, all in the cache). Returns [B, H, D] of out_dtype.
Tensor paged_decode_attention(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                              const Tensor& block_tables, const Tensor& seq_lens, double scale,
                              at::ScalarType out_dtype) {
  TORCH_CHECK(q.dim() == 3, "paged_decode_attention: q must be [B, H, D]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes() &&
                  v_cache.scalar_type() == k_cache.scalar_type(),
              "paged_decode_attention: k_cache/v_cache must be contiguous alike");
  const int64_t batch = q.size(0), heads = q.size(1), d = q.size(2);
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == d && heads % kv_heads == 0,
              "paged_decode_attention: head_dim or head counts do not match the cache");
  Tensor tables = block_tables.contiguous(), lens = seq_lens.contiguous();
  TORCH_CHECK(tables.scalar_type() == at::kLong && tables.dim() == 2 && tables.size(0) == batch &&
                  lens.scalar_type() == at::kLong && lens.numel() == batch,
              "paged_decode_attention: block_tables [B, M] and seq_lens [B] must be int64");
  const int64_t max_blocks = tables.size(1), group = heads / kv_heads, kv = kv_heads * d;
  const int64_t* table = tables.data_ptr<int64_t>();
  const int64_t* len = lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b)
    TORCH_CHECK(len[b] >= 1 && len[b] <= max_blocks * block_size,
                "paged_decode_attention: seq_len outside its block table");
  for (int64_t i = 0; i < batch * max_blocks; ++i)
    TORCH_CHECK(table[i] >= 0 && table[i] < k_cache.size(0),
                "paged_decode_attention: block id out of range");
  Tensor qc = q.contiguous();
  Tensor out = at::empty({batch, heads, d}, qc.options().dtype(out_dtype));
  dispatch(qc.scalar_type(), "paged_decode_attention", [&](auto q_tag) {
    using Q = decltype(q_tag);
    const Q* qp = qc.data_ptr<Q>();
    dispatch(k_cache.scalar_type(), "paged_decode_attention_cache", [&](auto c_tag) {
      using C = decltype(c_tag);
      const C* kc = k_cache.data_ptr<C>();
      const C* vc = v_cache.data_ptr<C>();
      dispatch(out_dtype, "paged_decode_attention_out", [&](auto o_tag) {
        using O = decltype(o_tag);
        O* op = out.data_ptr<O>();
        at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
          std::vector<float> qf(group * d), acc(group * d), row(d), scores;
          for (int64_t item = begin; item < end; ++item) {
            const int64_t b = item / kv_heads, h = item % kv_heads, n = len[b];
            const int64_t* blocks = table + b * max_blocks;
            for (int64_t g = 0; g < group; ++g) {
              load(qp + (b * heads + h * group + g) * d, qf.data() + g * d, d);
              for (int64_t i = 0; i < d; ++i) qf[g * d + i] *= static_cast<float>(scale);
            }
            scores.assign(group * n, 0.f);
            for (int64_t t = 0; t < n; ++t) {  // scores[g, t] = q_g . k_t
              const float* k = as_float(kc + (blocks[t / block_size] * block_size + t % block_size) * kv + h * d, row.data(), d);
              for (int64_t g = 0; g < group; ++g) scores[g * n + t] = dot(qf.data() + g * d, k, d);
            }
            std::vector<float> total(group, 0.f);
            for (int64_t g = 0; g < group; ++g) {  // softmax over t
              float* s = scores.data() + g * n;
              const float m = *std::max_element(s, s + n);
              float sum = 0.f;
              for (int64_t t = 0; t < n; ++t) {
                s[t] = fast_exp(s[t] - m);
                sum += s[t];
              }
              total[g] = sum;
            }
            std::fill(acc.begin(), acc.end(), 0.f);
            for (int64_t t = 0; t < n; ++t) {  // acc[g] = sum_t p[g, t] v_t
              const float* v = as_float(vc + (blocks[t / block_size] * block_size + t % block_size) * kv + h * d, row.data(), d);
              for (int64_t g = 0; g < group; ++g) {
                const float p = scores[g * n + t];
                float* a = acc.data() + g * d;
                for (int64_t i = 0; i < d; ++i) a[i] += p * v[i];
              }
            }
            for (int64_t g = 0; g < group; ++g) {
              float* a = acc.data() + g * d;
              for (int64_t i = 0; i < d; ++i) a[i] /= total[g];
              store(a, op + (b * heads + h * group + g) * d, d);
            }
          }
        });
      });
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(pagedserve, m) {
  m.def("add_rms_norm(Tensor(a!) residual, Tensor? y, Tensor weight, float eps, "
        "ScalarType out_dtype) -> Tensor");
  m.def("silu_and_mul(Tensor x, ScalarType out_dtype) -> Tensor");
  m.def("rotary_write_kv(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) k_cache, "
        "Tensor(b!) v_cache, Tensor slot_mapping, int num_heads, int num_kv_heads, "
        "ScalarType q_dtype) -> Tensor");
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor seq_lens, float scale, ScalarType out_dtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedserve, CPU, m) {
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("rotary_write_kv", &rotary_write_kv);
  m.impl("paged_decode_attention", &paged_decode_attention);
}
