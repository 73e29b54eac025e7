// Attention: rotary_write_kv (rotary + the paged K/V write) and paged_decode_attention.
#include "ops.h"
#include "common.h"

namespace OPS_NAMESPACE {

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

}  // namespace OPS_NAMESPACE
