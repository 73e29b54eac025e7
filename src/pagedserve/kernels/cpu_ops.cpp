// Fused CPU kernels of the decoder's hot path (see kernels/__init__.py for when they are used).
//
// Each kernel replaces a chain of small torch ops whose per-op dispatch cost, not arithmetic,
// dominated a decode step. All arithmetic is float32 whatever the storage dtype (float32 or
// bfloat16); every kernel has a torch reference in the model code and a test comparing the
// two. Work is split over rows (tokens, sequences, or sequence x KV head) with
// at::parallel_for, ATen's own thread pool. Inner loops are written for the compiler to
// vectorize; the few AVX-512 intrinsics have a portable fallback beside them.

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
          // The slots are scattered over the cache and cold: request all their lines first,
          // so the misses overlap instead of stalling one token's stores at a time.
          for (int64_t t = begin; t < end; ++t)
            for (int64_t byte = 0; byte < kv * static_cast<int64_t>(sizeof(C)); byte += 64) {
              __builtin_prefetch(reinterpret_cast<const char*>(kc + slot[t] * kv) + byte, 1);
              __builtin_prefetch(reinterpret_cast<const char*>(vc + slot[t] * kv) + byte, 1);
            }
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
  TORCH_CHECK(q.dim() == 3 && q.size(2) > 0, "paged_decode_attention: q must be [B, H, D], D > 0");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.size(2) > 0,
              "paged_decode_attention: k_cache must be [N, block_size, KVH, D], KVH > 0");
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
                  lens.scalar_type() == at::kLong && lens.dim() == 1 && lens.numel() == batch,
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
        // A work item is one sequence and a range of its KV heads: all of them when there are
        // enough sequences to share the threads (each block is then read front to back, a
        // token's KV heads side by side), one per item otherwise.
        const int64_t split = batch >= 2 * at::get_num_threads() ? 1 : kv_heads;
        const int64_t per_item = kv_heads / split;
        at::parallel_for(0, batch * split, 1, [&](int64_t begin, int64_t end) {
          std::vector<float> qf(per_item * group * d), acc(per_item * group * d), row(kv), scores;
          std::vector<const float*> cache_rows;
          for (int64_t item = begin; item < end; ++item) {
            const int64_t b = item / split, h0 = item % split * per_item, n = len[b];
            const int64_t rows = per_item * group;  // query heads h0 * group ... of this item
            const int64_t* blocks = table + b * max_blocks;
            load(qp + (b * heads + h0 * group) * d, qf.data(), rows * d);
            for (int64_t i = 0; i < rows * d; ++i) qf[i] *= static_cast<float>(scale);
            scores.resize(rows * n);
            // token t's K/V of heads h0 ...: row t % block_size of block blocks[t / block_size]
            // (walked block by block: no integer division per token)
            auto for_each_row = [&](const C* cache, auto&& f) {
              for (int64_t start = 0, j = 0; start < n; start += block_size, ++j) {
                const C* base = cache + blocks[j] * block_size * kv + h0 * d;
                for (int64_t t = start; t < std::min(n, start + block_size); ++t)
                  f(t, as_float(base + (t - start) * kv, row.data(), per_item * d));
              }
            };
            if constexpr (std::is_same_v<C, float>) {  // four keys per horizontal sum
              cache_rows.clear();
              for_each_row(kc, [&](int64_t, const float* k) { cache_rows.push_back(k); });
              for (int64_t r = 0; r < rows; ++r)
                scores_of_row(qf.data() + r * d, cache_rows.data(), r / group * d, n, d,
                              scores.data() + r * n);
            } else {
              for_each_row(kc, [&](int64_t t, const float* k) {  // scores[r, t] = q_r . k_t
                for (int64_t r = 0; r < rows; ++r)
                  scores[r * n + t] = dot(qf.data() + r * d, k + r / group * d, d);
              });
            }
            std::vector<float> total(rows);
            for (int64_t r = 0; r < rows; ++r) {  // softmax over t
              float* sr = scores.data() + r * n;
              const float m = max_of(sr, n);
              for (int64_t t = 0; t < n; ++t) sr[t] = fast_exp(sr[t] - m);
              total[r] = sum(sr, n);
            }
            std::fill(acc.begin(), acc.end(), 0.f);
            // acc[r] = sum_t p[r, t] v_t
            bool in_registers = false;  // float32 rows read in place, d a multiple of 16
            if constexpr (std::is_same_v<C, float>) in_registers = d % 16 == 0 && d <= 128;
            if (in_registers) {
              cache_rows.clear();
              for_each_row(vc, [&](int64_t, const float* v) { cache_rows.push_back(v); });
              for (int64_t r = 0; r < rows; ++r) {
                const float* p = scores.data() + r * n;
                float* a = acc.data() + r * d;
                const float* const* vr = cache_rows.data();
                const int64_t off = r / group * d;
                switch (d / 16) {
                  case 1: weighted_rows<1>(p, vr, off, n, a); break;
                  case 2: weighted_rows<2>(p, vr, off, n, a); break;
                  case 3: weighted_rows<3>(p, vr, off, n, a); break;
                  case 4: weighted_rows<4>(p, vr, off, n, a); break;
                  case 5: weighted_rows<5>(p, vr, off, n, a); break;
                  case 6: weighted_rows<6>(p, vr, off, n, a); break;
                  case 7: weighted_rows<7>(p, vr, off, n, a); break;
                  default: weighted_rows<8>(p, vr, off, n, a); break;
                }
              }
            } else {
              for_each_row(vc, [&](int64_t t, const float* v) {
                for (int64_t r = 0; r < rows; ++r) {
                  const float p = scores[r * n + t];
                  const float* vr = v + r / group * d;
                  float* a = acc.data() + r * d;
                  for (int64_t i = 0; i < d; ++i) a[i] += p * vr[i];
                }
              });
            }
            for (int64_t r = 0; r < rows; ++r) {
              float* a = acc.data() + r * d;
              for (int64_t i = 0; i < d; ++i) a[i] /= total[r];
            }
            store(acc.data(), op + (b * heads + h0 * group) * d, rows * d);
          }
        });
      });
    });
  });
  return out;
}

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

// x [M, K] float32 @ W.T -> [M, N] float32, W [N, K] stored as int8 with one float32 scale per
// group of 32 along K (W = q * scale; the layout of GGUF's Q8_0). For a few rows: each weight
// row is dequantized once into a float buffer, then dotted with every x row, so the weights
// are read once at a quarter of float32's bytes (decode reads the whole LM head every step).
Tensor int8_linear(const Tensor& x, const Tensor& qweight, const Tensor& scales) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "int8_linear: x must be float32 [M, K]");
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == at::kChar && qweight.is_contiguous() &&
                  qweight.size(1) == x.size(1) && qweight.size(1) % 32 == 0,
              "int8_linear: qweight must be contiguous int8 [N, K], K divisible by 32");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
                  scales.numel() == qweight.numel() / 32,
              "int8_linear: scales must be contiguous float32 [N, K / 32]");
  Tensor xc = x.contiguous();
  const int64_t m = xc.size(0), k = xc.size(1), n = qweight.size(0), groups = k / 32;
  Tensor out = at::empty({m, n}, xc.options());
  const float* xp = xc.data_ptr<float>();
  const int8_t* q = qweight.data_ptr<int8_t>();
  const float* sc = scales.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, n, 256, [&](int64_t begin, int64_t end) {
#if defined(__AVX512F__)  // dequantized 16 weights at a time, in registers, for up to 8 x rows
    for (int64_t r0 = 0; r0 < m; r0 += 8) {
      const int64_t rm = std::min<int64_t>(8, m - r0);
      for (int64_t row = begin; row < end; ++row) {
        const int8_t* qr = q + row * k;
        __m512 acc[8];
        for (int j = 0; j < 8; ++j) acc[j] = _mm512_setzero_ps();
        for (int64_t g = 0; g < groups; ++g) {
          const __m512 s = _mm512_set1_ps(sc[row * groups + g]);
          for (int64_t i = g * 32; i < g * 32 + 32; i += 16) {
            const __m128i q16 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qr + i));
            const __m512 w = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q16)), s);
            for (int j = 0; j < rm; ++j)
              acc[j] = _mm512_fmadd_ps(w, _mm512_loadu_ps(xp + (r0 + j) * k + i), acc[j]);
          }
        }
        for (int j = 0; j < rm; ++j) op[(r0 + j) * n + row] = _mm512_reduce_add_ps(acc[j]);
      }
    }
#else
    std::vector<float> w(k);
    for (int64_t row = begin; row < end; ++row) {
      const int8_t* qr = q + row * k;
      for (int64_t g = 0; g < groups; ++g) {
        const float s = sc[row * groups + g];
        for (int i = 0; i < 32; ++i) w[g * 32 + i] = s * static_cast<float>(qr[g * 32 + i]);
      }
      for (int64_t r = 0; r < m; ++r) op[r * n + row] = dot(xp + r * k, w.data(), k);
    }
#endif
  });
  return out;
}

// ---- packed_linear: float32 x @ W.T with W prepacked in column panels ----
//
// W [N, K] is stored as panels of PANEL output columns, [ceil(N / PANEL), K, PANEL] (the last
// one zero-padded; model/layers.py packs it once at load). A register tile of up to TILE_ROWS
// rows of x times one panel keeps 3 x TILE_ROWS accumulators in AVX-512 registers and streams
// the panel contiguously (GotoBLAS's register blocking, Goto & van de Geijn 2008, without
// packing x). Unlike a BLAS call it never re-packs the weight, which for the few rows of a
// decode step is a large share of the work; the next panel is prefetched while this one runs.
constexpr int PANEL = 48;
constexpr int HALF_PANEL = PANEL / 2;
constexpr int TILE_ROWS = 8;

// The SwiGLU epilogue of a gated tile: acc [MR, PANEL] holds, per row, the gate columns in
// its first half and the matching up columns in its second; c gets silu(gate) * up for the
// first ``cols`` (<= HALF_PANEL) of them.
template <int MR>
inline void gated_store(const float (*acc)[PANEL], float* c, int64_t ldc, int cols) {
  for (int r = 0; r < MR; ++r) {
    float out[HALF_PANEL];
    for (int j = 0; j < HALF_PANEL; ++j) out[j] = silu_times(acc[r][j], acc[r][HALF_PANEL + j]);
    std::copy(out, out + cols, c + r * ldc);
  }
}

template <int MR, bool GATED>
void linear_tile(const float* a, const float* panel, int64_t k, float* c,
                 int64_t ldc, int cols, const float* bias, const char* pf, int64_t pf_lines) {
#if defined(__AVX512F__)
  __m512 acc[MR][3];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
    acc[r][0] = acc[r][1] = acc[r][2] = _mm512_setzero_ps();
  int64_t pf_acc = 0;
  for (int64_t i = 0; i < k; ++i) {
    const __m512 b0 = _mm512_loadu_ps(panel + i * PANEL);
    const __m512 b1 = _mm512_loadu_ps(panel + i * PANEL + 16);
    const __m512 b2 = _mm512_loadu_ps(panel + i * PANEL + 32);
    // spread evenly over the k steps: pf_lines prefetches in all
    for (pf_acc += pf_lines; pf_acc >= k; pf_acc -= k, pf += 64) _mm_prefetch(pf, _MM_HINT_T1);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const __m512 x = _mm512_set1_ps(a[r * k + i]);
      acc[r][0] = _mm512_fmadd_ps(x, b0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(x, b1, acc[r][1]);
      acc[r][2] = _mm512_fmadd_ps(x, b2, acc[r][2]);
    }
  }
  if constexpr (GATED) {
    float buf[MR][PANEL];
    for (int r = 0; r < MR; ++r) {
      _mm512_storeu_ps(buf[r], acc[r][0]);
      _mm512_storeu_ps(buf[r] + 16, acc[r][1]);
      _mm512_storeu_ps(buf[r] + 32, acc[r][2]);
    }
    gated_store<MR>(buf, c, ldc, cols);
    return;
  }
  auto mask = [](int n) -> __mmask16 {
    return n >= 16 ? 0xFFFF : n <= 0 ? 0 : static_cast<__mmask16>((1u << n) - 1);
  };
  const __mmask16 m0 = mask(cols), m1 = mask(cols - 16), m2 = mask(cols - 32);
  __m512 bias0 = _mm512_setzero_ps(), bias1 = bias0, bias2 = bias0;
  if (bias) {
    bias0 = _mm512_maskz_loadu_ps(m0, bias);
    bias1 = _mm512_maskz_loadu_ps(m1, bias + 16);
    bias2 = _mm512_maskz_loadu_ps(m2, bias + 32);
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
    _mm512_mask_storeu_ps(c + r * ldc, m0, _mm512_add_ps(acc[r][0], bias0));
    _mm512_mask_storeu_ps(c + r * ldc + 16, m1, _mm512_add_ps(acc[r][1], bias1));
    _mm512_mask_storeu_ps(c + r * ldc + 32, m2, _mm512_add_ps(acc[r][2], bias2));
  }
#else  // the same tile in plain loops, which the compiler vectorizes along the panel
  (void)pf;
  (void)pf_lines;
  float acc[MR][PANEL] = {};
  for (int64_t i = 0; i < k; ++i)
    for (int r = 0; r < MR; ++r) {
      const float x = a[r * k + i];
      for (int j = 0; j < PANEL; ++j) acc[r][j] += x * panel[i * PANEL + j];
    }
  if constexpr (GATED) {
    gated_store<MR>(acc, c, ldc, cols);
    return;
  }
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < cols; ++j) c[r * ldc + j] = acc[r][j] + (bias ? bias[j] : 0.f);
#endif
}

// x [M, K] float32 -> [M, N] float32 = x @ W.T (+ bias [N]), written into out_buffer's first M * N
// elements when given (the result is a view of it), W packed as [P, K, PANEL] with
// P = ceil(N / PANEL). Work items are (block of rows, panel) pairs, split over threads; a row
// block stays in L2 while the thread's panels stream past it.
// gated: W is a SwiGLU gate|up projection packed with HALF_PANEL gate columns and their up
// columns per panel (P = ceil(n / HALF_PANEL)); the result is silu(x @ gate.T) * (x @ up.T),
// [M, n], computed in the tile's epilogue (no [M, 2n] intermediate, no silu_and_mul pass).
Tensor packed_linear(const Tensor& x, const Tensor& packed, const std::optional<Tensor>& bias,
                     int64_t n, const std::optional<Tensor>& out_buffer, bool gated) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "packed_linear: x must be float32 [M, K]");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kFloat && packed.is_contiguous() &&
                  packed.size(1) == x.size(1) && packed.size(2) == PANEL,
              "packed_linear: packed must be contiguous float32 [P, K, ", PANEL, "] with x's K");
  const int64_t per_panel = gated ? HALF_PANEL : PANEL;  // output columns of one panel
  TORCH_CHECK(n > (packed.size(0) - 1) * per_panel && n <= packed.size(0) * per_panel,
              "packed_linear: n=", n, " does not fit ", packed.size(0),
              gated ? " gated panels" : " panels");
  TORCH_CHECK(!(gated && bias), "packed_linear: a gated projection takes no bias");
  TORCH_CHECK(!bias || (bias->scalar_type() == at::kFloat && bias->is_contiguous() &&
                        bias->numel() == n),
              "packed_linear: bias must be contiguous float32 [n]");
  Tensor xc = x.contiguous();
  const int64_t m = xc.size(0), k = xc.size(1), panels = packed.size(0);
  TORCH_CHECK(!out_buffer || (out_buffer->scalar_type() == at::kFloat && out_buffer->is_contiguous() &&
                              out_buffer->numel() >= m * n),
              "packed_linear: out_buffer must be contiguous float32 with at least M * n elements");
  // a caller's buffer spares the page faults of a fresh allocation (large ones are mmap'ed)
  Tensor out = out_buffer ? out_buffer->flatten().narrow(0, 0, m * n).view({m, n})
                          : at::empty({m, n}, xc.options());
  if (m == 0) return out;
  const float* xp = xc.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  const float* bp = bias ? bias->data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  // as few row blocks as keep each under ~1 MB (in L2 beside a panel), of equal size: every
  // block streams the whole weight once
  const int64_t wanted = std::max<int64_t>(1, (m * k * 4 + (1 << 20) - 1) >> 20);
  const int64_t block_rows = ((m + wanted - 1) / wanted + TILE_ROWS - 1) / TILE_ROWS * TILE_ROWS;
  const int64_t blocks = (m + block_rows - 1) / block_rows;  // rounding may leave fewer: none empty
  const int64_t panel_size = k * PANEL;
  at::parallel_for(0, blocks * panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t blk = item / panels, p = item % panels;
      const int64_t r_begin = blk * block_rows, r_end = std::min(m, r_begin + block_rows);
      const int64_t tiles = (r_end - r_begin + TILE_ROWS - 1) / TILE_ROWS;
      const int cols = static_cast<int>(std::min<int64_t>(per_panel, n - p * per_panel));
      const float* panel = wp + p * panel_size;
      // the tiles of this panel share the prefetch of the next item's panel
      const bool prefetch = item + 1 < end;
      const char* next = reinterpret_cast<const char*>(wp + ((item + 1) % panels) * panel_size);
      const int64_t next_lines = (panel_size * 4 + 63) / 64, per_tile = (next_lines + tiles - 1) / tiles;
      for (int64_t t = 0; t < tiles; ++t) {
        const int64_t r0 = r_begin + t * TILE_ROWS, rows = std::min<int64_t>(TILE_ROWS, r_end - r0);
        const int64_t first = t * per_tile;
        const int64_t pf_lines = prefetch ? std::max<int64_t>(0, std::min(per_tile, next_lines - first)) : 0;
        const char* pf = next + 64 * first;
        const float* a = xp + r0 * k;
        float* c = op + r0 * n + p * per_panel;
        const float* b = bp ? bp + p * PANEL : nullptr;
        auto tile = [&](auto gated_tag) {
          constexpr bool G = decltype(gated_tag)::value;
          switch (rows) {
            case 8: linear_tile<8, G>(a, panel, k, c, n, cols, b, pf, pf_lines); break;
            case 7: linear_tile<7, G>(a, panel, k, c, n, cols, b, pf, pf_lines); break;
            case 6: linear_tile<6, G>(a, panel, k, c, n, cols, b, pf, pf_lines); break;
            case 5: linear_tile<5, G>(a, panel, k, c, n, cols, b, pf, pf_lines); break;
            case 4: linear_tile<4, G>(a, panel, k, c, n, cols, b, pf, pf_lines); break;
            case 3: linear_tile<3, G>(a, panel, k, c, n, cols, b, pf, pf_lines); break;
            case 2: linear_tile<2, G>(a, panel, k, c, n, cols, b, pf, pf_lines); break;
            default: linear_tile<1, G>(a, panel, k, c, n, cols, b, pf, pf_lines); break;
          }
        };
        if (gated)
          tile(std::true_type{});
        else
          tile(std::false_type{});
      }
    }
  });
  return out;
}

}  // namespace

// The op namespace: torch.ops.pagedserve, or another one for a second build in the same
// process (the test of the portable, non-AVX-512 build).
#ifndef OPS_NAMESPACE
#define OPS_NAMESPACE pagedserve
#endif

TORCH_LIBRARY(OPS_NAMESPACE, m) {
  m.def("add_rms_norm(Tensor(a!) residual, Tensor? y, Tensor weight, float eps, "
        "ScalarType out_dtype) -> Tensor");
  m.def("silu_and_mul(Tensor x, ScalarType out_dtype) -> Tensor");
  m.def("argmax(Tensor x) -> Tensor");
  m.def("int8_linear(Tensor x, Tensor qweight, Tensor scales) -> Tensor");
  m.def("packed_linear(Tensor x, Tensor packed, Tensor? bias, int n, "
        "Tensor(a!)? out_buffer=None, bool gated=False) -> Tensor(a)");
  m.def("rotary_write_kv(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) k_cache, "
        "Tensor(b!) v_cache, Tensor slot_mapping, int num_heads, int num_kv_heads, "
        "ScalarType q_dtype) -> Tensor");
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor seq_lens, float scale, ScalarType out_dtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(OPS_NAMESPACE, CPU, m) {
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("argmax", &argmax);
  m.impl("int8_linear", &int8_linear);
  m.impl("packed_linear", &packed_linear);
  m.impl("rotary_write_kv", &rotary_write_kv);
  m.impl("paged_decode_attention", &paged_decode_attention);
}
