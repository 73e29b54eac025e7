// Attention: rotary_write_kv (rotary + the paged K/V write) and paged_decode_attention.
#include "ops.h"
#include "common.h"

namespace OPS_NAMESPACE {

// Per token t: rotary embedding of the heads + kv_heads query and key heads of
// qkv[t] = q | k | v (each head d wide), queries into q [tokens, heads, d], keys and values
// into row slots[t] of the caches [num_slots, kv_heads, d]. sin is sin_signed (see below).
template <typename I, typename C, typename Q>
void rotary_write_kv_rows(const I* qkv, const float* cos, const float* sin,
                          const int64_t* slots, C* k_cache, C* v_cache, Q* q, int64_t tokens,
                          int64_t heads, int64_t kv_heads, int64_t d) {
  const int64_t half = d / 2, kv = kv_heads * d, width = (heads + 2 * kv_heads) * d;
  at::parallel_for(0, tokens, 1, [&](int64_t begin, int64_t end) {
    // The slots are scattered over the cache and cold: request all their lines first, so the
    // misses overlap instead of stalling one token's stores at a time.
    for (int64_t t = begin; t < end; ++t)
      for (int64_t byte = 0; byte < kv * static_cast<int64_t>(sizeof(C)); byte += 64) {
        __builtin_prefetch(reinterpret_cast<const char*>(k_cache + slots[t] * kv) + byte, 1);
        __builtin_prefetch(reinterpret_cast<const char*>(v_cache + slots[t] * kv) + byte, 1);
      }
    std::vector<float> x(std::max(d, kv)), y(d);
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cos + t * d;
      const float* s = sin + t * d;
      const I* row = qkv + t * width;
      for (int64_t h = 0; h < heads + kv_heads; ++h) {
        convert(row + h * d, x.data(), d);
        for (int64_t i = 0; i < half; ++i) y[i] = x[i] * c[i] + x[i + half] * s[i];
        for (int64_t i = half; i < d; ++i) y[i] = x[i] * c[i] + x[i - half] * s[i];
        if (h < heads)
          convert(y.data(), q + (t * heads + h) * d, d);
        else
          convert(y.data(), k_cache + slots[t] * kv + (h - heads) * d, d);
      }
      convert(row + (heads + kv_heads) * d, v_cache + slots[t] * kv, kv);
    }
  });
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
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(slot[t] >= 0 && slot[t] < num_slots, "rotary_write_kv: slot out of range");
  dispatch(qkvc.scalar_type(), "rotary_write_kv", [&](auto i_tag) {
    dispatch(k_cache.scalar_type(), "rotary_write_kv_cache", [&](auto c_tag) {
      using C = decltype(c_tag);
      dispatch(q_dtype, "rotary_write_kv_q", [&](auto q_tag) {
        rotary_write_kv_rows(qkvc.data_ptr<decltype(i_tag)>(), cosc.data_ptr<float>(),
                             sinc.data_ptr<float>(), slot, k_cache.data_ptr<C>(),
                             v_cache.data_ptr<C>(), q.data_ptr<decltype(q_tag)>(), tokens,
                             num_heads, num_kv_heads, d);
      });
    });
  });
  return q;
}

// scores[t] = q . (keys[t] + offset)[0 .. d) for t < n, four keys at a time: each query
// vector is loaded once for four keys, and one reduce_add4 replaces four horizontal sums.
inline void scores_of_row(const float* q, const float* const* keys, int64_t offset, int64_t n,
                          int64_t d, float* scores) {
  int64_t t = 0;
  for (; t + 4 <= n; t += 4) {
    const float *k0 = keys[t] + offset, *k1 = keys[t + 1] + offset;
    const float *k2 = keys[t + 2] + offset, *k3 = keys[t + 3] + offset;
    F32x16 a0 = F32x16::zero(), a1 = a0, a2 = a0, a3 = a0;
    for_each_vec(d, [&](int64_t i, int64_t c) {
      const F32x16 qv = F32x16::load(q + i, c);
      a0 = fma(qv, F32x16::load(k0 + i, c), a0);
      a1 = fma(qv, F32x16::load(k1 + i, c), a1);
      a2 = fma(qv, F32x16::load(k2 + i, c), a2);
      a3 = fma(qv, F32x16::load(k3 + i, c), a3);
    });
    reduce_add4(a0, a1, a2, a3, scores + t);
  }
  for (; t < n; ++t) scores[t] = dot(q, keys[t] + offset, d);
}

// acc[0 .. 16 D16) += sum over t < n of p[t] * (rows[t] + offset)[0 .. 16 D16): the
// accumulator stays in registers across the tokens instead of a load and store per token.
template <int D16>
inline void weighted_rows(const float* p, const float* const* rows, int64_t offset, int64_t n,
                          float* acc) {
  F32x16 a[D16];
  for (int j = 0; j < D16; ++j) a[j] = F32x16::load(acc + 16 * j);
  for (int64_t t = 0; t < n; ++t) {
    const F32x16 w = F32x16::set1(p[t]);
    const float* v = rows[t] + offset;
    for (int j = 0; j < D16; ++j) a[j] = fma(w, F32x16::load(v + 16 * j), a[j]);
  }
  for (int j = 0; j < D16; ++j) a[j].store(acc + 16 * j);
}

// acc[0 .. d) += sum over t < n of p[t] * (rows[t] + offset)[0 .. d): for a d that is a
// multiple of 16 up to 128 with the accumulator in registers, else row by row.
inline void weighted_sum(const float* p, const float* const* rows, int64_t offset, int64_t n,
                         int64_t d, float* acc) {
  if (d % 16 != 0 || d > 128) {
    for (int64_t t = 0; t < n; ++t) axpy(p[t], rows[t] + offset, acc, d);
    return;
  }
  switch (d / 16) {
    case 1: return weighted_rows<1>(p, rows, offset, n, acc);
    case 2: return weighted_rows<2>(p, rows, offset, n, acc);
    case 3: return weighted_rows<3>(p, rows, offset, n, acc);
    case 4: return weighted_rows<4>(p, rows, offset, n, acc);
    case 5: return weighted_rows<5>(p, rows, offset, n, acc);
    case 6: return weighted_rows<6>(p, rows, offset, n, acc);
    case 7: return weighted_rows<7>(p, rows, offset, n, acc);
    default: return weighted_rows<8>(p, rows, offset, n, acc);
  }
}

// The decode attention of paged_decode_attention below over raw pointers: q/out
// [batch, heads, d]; k_cache/v_cache [num_blocks, block_size, kv_heads, d]; block_tables
// [batch, max_blocks] and seq_lens [batch], both already checked against the cache; window > 0
// attends only the last ``window`` keys of each sequence (0: all).
template <typename Q, typename C, typename O>
void paged_decode_attention_rows(const Q* q, const C* k_cache, const C* v_cache,
                                 const int64_t* block_tables, const int64_t* seq_lens, O* out,
                                 int64_t batch, int64_t heads, int64_t kv_heads, int64_t d,
                                 int64_t block_size, int64_t max_blocks, float scale,
                                 int64_t window) {
  const int64_t group = heads / kv_heads, kv = kv_heads * d;
  // A work item is one sequence and a range of its KV heads: all of them when there are
  // enough sequences to share the threads (each block is then read front to back, a token's
  // KV heads side by side), one per item otherwise.
  const int64_t split = batch >= 2 * at::get_num_threads() ? 1 : kv_heads;
  const int64_t per_item = kv_heads / split;
  const int64_t rows = per_item * group;  // the query heads of one item
  const int64_t width = per_item * d;     // the item's part of a cache row
  // The K (then V) rows are gathered a chunk of blocks at a time and each query head then runs
  // over the whole chunk: a long run of independent rows keeps many cache misses in flight
  // (the blocks are scattered), and a bfloat16 chunk converted once fits in L2.
  const int64_t chunk_blocks = std::max<int64_t>(1, 256 / block_size);
  const int64_t chunk = chunk_blocks * block_size;
  at::parallel_for(0, batch * split, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(rows * d), acc(rows * d), scores, total(rows);
    std::vector<float> buf(std::is_same_v<C, float> ? 0 : chunk * width);  // converted rows
    std::vector<const float*> chunk_rows(chunk);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / split, h0 = item % split * per_item, end_key = seq_lens[b];
      // keys start .. end_key - 1: all of them, or a sliding window's last ones (the blocks
      // before it are never read)
      const int64_t start = window > 0 ? std::max<int64_t>(0, end_key - window) : 0;
      const int64_t n = end_key - start;
      const int64_t* blocks = block_tables + b * max_blocks;
      convert(q + (b * heads + h0 * group) * d, qf.data(), rows * d);
      scale_by(qf.data(), scale, rows * d);
      scores.resize(rows * n);
      // f(first, count, rows) for each chunk of the keys (first counted from start): rows[i]
      // is key start + first + i's row of the item's KV heads as float32, read in place or
      // converted into buf. Key t is row t % block_size of block blocks[t / block_size],
      // walked block by block.
      auto for_each_chunk = [&](const C* cache, auto&& f) {
        for (int64_t first = 0; first < n; first += chunk) {
          const int64_t count = std::min(chunk, n - first), t0 = start + first;
          for (int64_t i = 0, j = t0 / block_size, r = t0 % block_size; i < count; ++j, r = 0) {
            const C* base = cache + blocks[j] * block_size * kv + h0 * d;
            for (; r < block_size && i < count; ++r, ++i)
              chunk_rows[i] = as_float(base + r * kv, buf.data() + i * width, width);
          }
          f(first, count, chunk_rows.data());
        }
      };
      // f(r, o) for each query head r of the item, o the offset of its KV head in a row
      auto for_each_head = [&](auto&& f) {
        for (int64_t h = 0, r = 0; h < per_item; ++h)
          for (int64_t g = 0; g < group; ++g, ++r) f(r, h * d);
      };
      // scores[r, t] = q_r . k_t
      for_each_chunk(k_cache, [&](int64_t first, int64_t count, const float* const* k) {
        for_each_head([&](int64_t r, int64_t o) {
          scores_of_row(qf.data() + r * d, k, o, count, d, scores.data() + r * n + first);
        });
      });
      for (int64_t r = 0; r < rows; ++r) {  // softmax over t, normalized at the end
        float* sr = scores.data() + r * n;
        const float m = max_of(sr, n);
        for (int64_t t = 0; t < n; ++t) sr[t] = fast_exp(sr[t] - m);
        total[r] = sum(sr, n);
      }
      // acc[r] = sum_t p[r, t] v_t
      std::fill(acc.begin(), acc.end(), 0.f);
      for_each_chunk(v_cache, [&](int64_t first, int64_t count, const float* const* v) {
        for_each_head([&](int64_t r, int64_t o) {
          weighted_sum(scores.data() + r * n + first, v, o, count, d, acc.data() + r * d);
        });
      });
      for (int64_t r = 0; r < rows; ++r) scale_by(acc.data() + r * d, 1.f / total[r], d);
      convert(acc.data(), out + (b * heads + h0 * group) * d, rows * d);
    }
  });
}

// Decode attention straight over the paged cache (PagedAttention sec. 4.1): one query per
// sequence, each of its G = H / KVH query heads per KV head reading the K/V rows of that head
// through the block table, so K/V are read once per (sequence, KV head) and never gathered.
// q [B, H, D]; k_cache/v_cache [num_blocks, block_size, KVH, D]; block_tables [B, M] int64;
// seq_lens [B] int64 (keys 0 .. seq_len - 1, all in the cache); window > 0: a sliding-window
// layer's, only the last ``window`` keys are attended (and read). Returns [B, H, D] of
// out_dtype.
Tensor paged_decode_attention(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                              const Tensor& block_tables, const Tensor& seq_lens, double scale,
                              at::ScalarType out_dtype, int64_t window) {
  TORCH_CHECK(window >= 0, "paged_decode_attention: window must be >= 0");
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
  const int64_t max_blocks = tables.size(1);
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
    dispatch(k_cache.scalar_type(), "paged_decode_attention_cache", [&](auto c_tag) {
      using C = decltype(c_tag);
      dispatch(out_dtype, "paged_decode_attention_out", [&](auto o_tag) {
        paged_decode_attention_rows(qc.data_ptr<decltype(q_tag)>(), k_cache.data_ptr<C>(),
                                    v_cache.data_ptr<C>(), table, len,
                                    out.data_ptr<decltype(o_tag)>(), batch, heads, kv_heads,
                                    d, block_size, max_blocks, static_cast<float>(scale),
                                    window);
      });
    });
  });
  return out;
}

}  // namespace OPS_NAMESPACE
