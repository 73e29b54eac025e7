// Attention: rotary_write_kv (rotary + the paged K/V write) and paged_decode_attention.
#include "ops.h"
#include "common.h"

#include <c10/util/Float8_e4m3fn.h>

#include <atomic>
#include <memory>

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
  // The K (then V) rows are gathered a chunk of blocks at a time (a bfloat16 chunk converted
  // once fits in L2) and walked TILE rows at a time, every query head of the item over each
  // tile in turn, so a tile's rows serve all the heads from L1. The blocks are scattered and
  // each spans a few pages, where the hardware prefetchers stop: the rows AHEAD further on
  // (K's, then V's) are prefetched into L2 as the walk goes, a tile's worth at each tile, so
  // their misses overlap the work on the rows before them (small tiles spread the prefetches
  // out; larger tiles, or no prefetch, measured slower: benchmarks/decode_attention.py). A
  // head's floats do not depend on the tile size: tiles start at multiples of 4 keys into a
  // chunk, scores_of_row's step, and each head's value sum runs over the keys in order.
  constexpr int64_t TILE = 4, AHEAD = 32;
  const int64_t chunk_blocks = std::max<int64_t>(1, 256 / block_size);
  const int64_t chunk = chunk_blocks * block_size;
  const int64_t row_bytes = width * static_cast<int64_t>(sizeof(C));
  at::parallel_for(0, batch * split, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(rows * d), acc(rows * d), scores, total(rows);
    std::vector<float> buf(std::is_same_v<C, float> ? 0 : chunk * width);  // converted rows
    std::vector<const float*> chunk_rows(chunk);
    std::vector<const C*> src;  // the item's K rows, then its V rows
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / split, h0 = item % split * per_item, end_key = seq_lens[b];
      // keys start .. end_key - 1: all of them, or a sliding window's last ones (the blocks
      // before it are never read)
      const int64_t start = window > 0 ? std::max<int64_t>(0, end_key - window) : 0;
      const int64_t n = end_key - start;
      const int64_t* blocks = block_tables + b * max_blocks;
      // key start + i is row (start + i) % block_size of block blocks[(start + i) / block_size]
      src.resize(2 * n);
      for (int64_t i = 0; i < n; ++i) {
        const int64_t t = start + i, at = (blocks[t / block_size] * block_size +
                                           t % block_size) * kv + h0 * d;
        src[i] = k_cache + at;
        src[n + i] = v_cache + at;
      }
      int64_t fetched = 0;  // src rows prefetched so far
      auto prefetch_to = [&](int64_t row) {
        for (const int64_t stop = std::min(row, 2 * n); fetched < stop; ++fetched)
          for (int64_t byte = 0; byte < row_bytes; byte += 64)
            __builtin_prefetch(reinterpret_cast<const char*>(src[fetched]) + byte, 0, 2);
      };
      convert(q + (b * heads + h0 * group) * d, qf.data(), rows * d);
      scale_by(qf.data(), scale, rows * d);
      scores.resize(rows * n);
      // f(first, count, rows) for each tile of the keys (first counted from start): rows[i]
      // is key start + first + i's row of the item's KV heads as float32, read in place or
      // converted into buf; `base` 0 for K, n for V
      auto for_each_tile = [&](int64_t base, auto&& f) {
        for (int64_t c0 = 0; c0 < n; c0 += chunk) {
          const int64_t count = std::min(chunk, n - c0);
          for (int64_t i = 0; i < count; ++i) {
            if (!std::is_same_v<C, float>) prefetch_to(base + c0 + i + AHEAD);
            chunk_rows[i] = as_float(src[base + c0 + i], buf.data() + i * width, width);
          }
          for (int64_t t = 0; t < count; t += TILE) {
            prefetch_to(base + c0 + t + TILE + AHEAD);
            f(c0 + t, std::min(TILE, count - t), chunk_rows.data() + t);
          }
        }
      };
      // f(r, o) for each query head r of the item, o the offset of its KV head in a row
      auto for_each_head = [&](auto&& f) {
        for (int64_t h = 0, r = 0; h < per_item; ++h)
          for (int64_t g = 0; g < group; ++g, ++r) f(r, h * d);
      };
      // scores[r, t] = q_r . k_t
      for_each_tile(0, [&](int64_t first, int64_t count, const float* const* k) {
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
      for_each_tile(n, [&](int64_t first, int64_t count, const float* const* v) {
        for_each_head([&](int64_t r, int64_t o) {
          weighted_sum(scores.data() + r * n + first, v, o, count, d, acc.data() + r * d);
        });
      });
      for (int64_t r = 0; r < rows; ++r) scale_by(acc.data() + r * d, 1.f / total[r], d);
      convert(acc.data(), out + (b * heads + h0 * group) * d, rows * d);
    }
  });
}

// The checks both paged attention ops over an unquantized cache make: q [rows, H, D], D > 0;
// k_cache/v_cache [N, block_size, KVH, D], KVH > 0, contiguous alike; H a multiple of KVH.
inline void check_paged_attention(const char* name, const Tensor& q, const Tensor& k_cache,
                                  const Tensor& v_cache, int64_t window) {
  TORCH_CHECK(window >= 0, name, ": window must be >= 0");
  TORCH_CHECK(q.dim() == 3 && q.size(2) > 0, name, ": q must be [rows, H, D], D > 0");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.size(2) > 0, name,
              ": k_cache must be [N, block_size, KVH, D], KVH > 0");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes() &&
                  v_cache.scalar_type() == k_cache.scalar_type(),
              name, ": k_cache/v_cache must be contiguous alike");
  TORCH_CHECK(k_cache.size(3) == q.size(2) && q.size(1) % k_cache.size(2) == 0, name,
              ": head_dim or head counts do not match the cache");
}

// Every entry of a block table [n] inside the cache's num_blocks.
inline void check_block_ids(const char* name, const int64_t* table, int64_t n,
                            int64_t num_blocks) {
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(table[i] >= 0 && table[i] < num_blocks, name, ": block id out of range");
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
  check_paged_attention("paged_decode_attention", q, k_cache, v_cache, window);
  const int64_t batch = q.size(0), heads = q.size(1), d = q.size(2);
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2);
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
  check_block_ids("paged_decode_attention", table, batch * max_blocks, k_cache.size(0));
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

// ---- prefill attention over the paged cache ---------------------------------------------
//
// Every prompt row is computed by one fixed sequence of float operations that depends only on
// its own position and its request's keys: each score a chain of FMAs over the head dimension,
// the softmax's sum in 16 lanes indexed by absolute key position mod 16, the weighted sum of
// V a chain over the keys in order. Whether the prompt arrives in one pass, in chunks, after a
// prefix-cache hit or as a recompute after preemption, each row gets the same bits, and so do
// the bfloat16 matmuls that read them (a 1e-5 difference here rounds to a different bfloat16
// often enough to change answers). Rows are tiled (a few positions times the G query heads of
// one KV head) so that each K/V value loaded serves up to 12 query vectors.

// s[n][0 .. nk) = q_n . k_t for N query vectors q [N, d] against the keys of kt [d, ldk]
// (transposed, 32 keys per step; nk a multiple of 32), each score an FMA chain over d.
template <int N>
void score_tile(const float* q, int64_t d, const float* kt, int64_t ldk, int64_t nk, float* s,
                int64_t lds) {
  for (int64_t t = 0; t < nk; t += 32) {
    F32x16 acc[N][2];
    for (int n = 0; n < N; ++n) acc[n][0] = acc[n][1] = F32x16::zero();
    for (int64_t i = 0; i < d; ++i) {
      const F32x16 k0 = F32x16::load(kt + i * ldk + t), k1 = F32x16::load(kt + i * ldk + t + 16);
      for (int n = 0; n < N; ++n) {
        const F32x16 w = F32x16::set1(q[n * d + i]);
        acc[n][0] = fma(w, k0, acc[n][0]);
        acc[n][1] = fma(w, k1, acc[n][1]);
      }
    }
    for (int n = 0; n < N; ++n) {
      acc[n][0].store(s + n * lds + t);
      acc[n][1].store(s + n * lds + t + 16);
    }
  }
}

// acc[n][0 .. dp) += sum over t < nk of p[n][t] * v[t][0 .. dp) for N rows of weights p
// [N, lds] and values v [nk, dp] (dp a multiple of 64: four vectors per pass in registers).
template <int N>
void weighted_tile(const float* p, int64_t lds, const float* v, int64_t dp, int64_t nk,
                   float* acc) {
  for (int64_t c = 0; c < dp; c += 64) {
    F32x16 a[N][4];
    for (int n = 0; n < N; ++n)
      for (int j = 0; j < 4; ++j) a[n][j] = F32x16::load(acc + n * dp + c + 16 * j);
    for (int64_t t = 0; t < nk; ++t) {
      const float* row = v + t * dp + c;
      const F32x16 v0 = F32x16::load(row), v1 = F32x16::load(row + 16);
      const F32x16 v2 = F32x16::load(row + 32), v3 = F32x16::load(row + 48);
      for (int n = 0; n < N; ++n) {
        const F32x16 w = F32x16::set1(p[n * lds + t]);
        a[n][0] = fma(w, v0, a[n][0]);
        a[n][1] = fma(w, v1, a[n][1]);
        a[n][2] = fma(w, v2, a[n][2]);
        a[n][3] = fma(w, v3, a[n][3]);
      }
    }
    for (int n = 0; n < N; ++n)
      for (int j = 0; j < 4; ++j) a[n][j].store(acc + n * dp + c + 16 * j);
  }
}

// The prefill attention of paged_prefill_attention below over raw pointers, arguments
// already checked: q/out [T, heads, d] with request b's query_lens[b] rows at positions
// seq_lens[b] - query_lens[b] ...; the caches, tables and window as the decode kernel's.
template <typename Q, typename C, typename O>
void paged_prefill_attention_rows(const Q* q, const C* k_cache, const C* v_cache,
                                  const int64_t* block_tables, const int64_t* seq_lens,
                                  const int64_t* query_lens, O* out, int64_t batch,
                                  int64_t heads, int64_t kv_heads, int64_t d, int64_t block_size,
                                  int64_t max_blocks, float scale, int64_t window) {
  const int64_t group = heads / kv_heads, kv = kv_heads * d;
  const int64_t dp = (d + 63) / 64 * 64;  // a V row padded for weighted_tile
  const int64_t tile_rows = std::max<int64_t>(1, 12 / group);  // positions per work item
  auto first_key = [&](int64_t pos) {  // the first key the query at pos sees
    return window > 0 ? std::max<int64_t>(0, pos + 1 - window) : int64_t{0};
  };
  // Per request: its keys from base (the first key its chunk needs, rounded down to a
  // multiple of 16 so that lanes follow absolute positions) gathered once per KV head as
  // float32, K transposed [d, ldk] and V [rows, dp]; keys before the chunk's first needed one
  // are zeros, never read from the cache (a window's freed blocks).
  std::vector<int64_t> base(batch), ldk(batch), offset(batch + 1, 0), q_start(batch + 1, 0);
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t need = first_key(seq_lens[b] - query_lens[b]);
    base[b] = need / 16 * 16;
    ldk[b] = (seq_lens[b] - base[b] + 15) / 16 * 16 + 32;
    offset[b + 1] = offset[b] + kv_heads * ldk[b] * (d + dp);
    q_start[b + 1] = q_start[b] + query_lens[b];
  }
  // filled below, padding included: zeroing it all would be a memset of every key per layer
  std::unique_ptr<float[]> keys(new float[offset[batch]]);
  at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> row(d);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / kv_heads, h = item % kv_heads;
      float* kt = keys.get() + offset[b] + h * ldk[b] * (d + dp);
      float* vg = kt + d * ldk[b];
      const int64_t* blocks = block_tables + b * max_blocks;
      const int64_t first = first_key(seq_lens[b] - query_lens[b]) - base[b];
      const int64_t last = seq_lens[b] - base[b];  // columns first .. last - 1 hold keys
      for (int64_t i = 0; i < d; ++i) {
        std::fill(kt + i * ldk[b], kt + i * ldk[b] + first, 0.f);
        std::fill(kt + i * ldk[b] + last, kt + (i + 1) * ldk[b], 0.f);
      }
      std::fill(vg, vg + first * dp, 0.f);
      for (int64_t c = first; c < last; ++c) {
        const int64_t t = c + base[b];
        const int64_t slot = blocks[t / block_size] * block_size + t % block_size;
        const float* k = as_float(k_cache + slot * kv + h * d, row.data(), d);
        for (int64_t i = 0; i < d; ++i) kt[i * ldk[b] + c] = k[i];
        convert(v_cache + slot * kv + h * d, vg + c * dp, d);
        std::fill(vg + c * dp + d, vg + (c + 1) * dp, 0.f);
      }
    }
  });
  // Work items (request, KV head, first row of a tile), costliest first, taken by the threads
  // from a shared counter: causal rows cost in proportion to their keys.
  struct Item { int64_t b, h, r0, cost; };
  std::vector<Item> items;
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t r0 = 0; r0 < query_lens[b]; r0 += tile_rows) {
      const int64_t last = seq_lens[b] - query_lens[b] + std::min(r0 + tile_rows, query_lens[b]);
      for (int64_t h = 0; h < kv_heads; ++h)
        items.push_back({b, h, r0, last - first_key(last - 1 - (tile_rows - 1))});
    }
  std::stable_sort(items.begin(), items.end(),
                   [](const Item& x, const Item& y) { return x.cost > y.cost; });
  int64_t max_ldk = 0;
  for (int64_t b = 0; b < batch; ++b) max_ldk = std::max(max_ldk, ldk[b]);
  std::atomic<int64_t> next{0};
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), items.size());
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    const int64_t rows_max = tile_rows * group;
    std::vector<float> qf(rows_max * d), s(rows_max * max_ldk), acc(rows_max * dp);
    std::vector<int64_t> lo(rows_max), hi(rows_max);
    for (int64_t i = next++; i < static_cast<int64_t>(items.size()); i = next++) {
      const Item it = items[i];
      const int64_t b = it.b, ctx = seq_lens[b] - query_lens[b];
      const int64_t nrows = std::min(tile_rows, query_lens[b] - it.r0), n_q = nrows * group;
      const int64_t pos0 = ctx + it.r0, key_end = pos0 + nrows;
      const int64_t ks = first_key(pos0) / 16 * 16;  // this tile's first key, lane-aligned
      const int64_t nk = (key_end - ks + 31) / 32 * 32;
      const float* kt = keys.get() + offset[b] + it.h * ldk[b] * (d + dp);
      const float* vg = kt + d * ldk[b];
      for (int64_t r = 0, n = 0; r < nrows; ++r)
        for (int64_t g = 0; g < group; ++g, ++n) {
          const Q* src = q + ((q_start[b] + it.r0 + r) * heads + it.h * group + g) * d;
          convert(src, qf.data() + n * d, d);
          scale_by(qf.data() + n * d, scale, d);
          lo[n] = first_key(pos0 + r) - ks;
          hi[n] = pos0 + r + 1 - ks;
        }
      for (int64_t n0 = 0; n0 < n_q; n0 += 12)
        dispatch_rows<12>(n_q - n0, [&](auto n_tag) {
          score_tile<decltype(n_tag)::value>(qf.data() + n0 * d, d, kt + (ks - base[b]),
                                             ldk[b], nk, s.data() + n0 * max_ldk, max_ldk);
        });
      std::vector<float> total(n_q);
      for (int64_t n = 0; n < n_q; ++n) {  // softmax over the row's own keys, zeros elsewhere
        float* sr = s.data() + n * max_ldk;
        const float m = max_of(sr + lo[n], hi[n] - lo[n]);
        for (int64_t t = 0; t < nk; ++t)
          sr[t] = t >= lo[n] && t < hi[n] ? fast_exp(sr[t] - m) : 0.f;
        total[n] = sum(sr, nk);
      }
      std::fill(acc.begin(), acc.begin() + n_q * dp, 0.f);
      const int64_t used = key_end - ks;
      for (int64_t n0 = 0; n0 < n_q; n0 += 6)
        dispatch_rows<6>(n_q - n0, [&](auto n_tag) {
          weighted_tile<decltype(n_tag)::value>(s.data() + n0 * max_ldk, max_ldk,
                                                vg + (ks - base[b]) * dp, dp, used,
                                                acc.data() + n0 * dp);
        });
      for (int64_t r = 0, n = 0; r < nrows; ++r)
        for (int64_t g = 0; g < group; ++g, ++n) {
          scale_by(acc.data() + n * dp, 1.f / total[n], d);
          convert(acc.data() + n * dp,
                  out + ((q_start[b] + it.r0 + r) * heads + it.h * group + g) * d, d);
        }
    }
  });
}

// Prefill attention straight over the paged cache: the rows of each request's chunk attend
// causally its cached keys and the chunk's own (already written by rotary_write_kv), read
// through the block table. q [T, H, D] with request b's query_lens[b] rows in order at
// positions seq_lens[b] - query_lens[b] ...; k_cache/v_cache [num_blocks, block_size, KVH, D];
// block_tables [B, M], seq_lens [B], query_lens [B] int64; window > 0: a sliding-window
// layer's, each query attends the last ``window`` positions (itself included). Returns
// [T, H, D] of out_dtype. Each row's result is independent of the chunking (see above).
Tensor paged_prefill_attention(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                               const Tensor& block_tables, const Tensor& seq_lens,
                               const Tensor& query_lens, double scale, at::ScalarType out_dtype,
                               int64_t window) {
  check_paged_attention("paged_prefill_attention", q, k_cache, v_cache, window);
  const int64_t tokens = q.size(0), heads = q.size(1), d = q.size(2);
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2);
  Tensor tables = block_tables.contiguous(), lens = seq_lens.contiguous();
  Tensor qlens = query_lens.contiguous();
  const int64_t batch = lens.numel();
  TORCH_CHECK(tables.scalar_type() == at::kLong && tables.dim() == 2 &&
                  tables.size(0) == batch && lens.scalar_type() == at::kLong &&
                  lens.dim() == 1 && qlens.scalar_type() == at::kLong &&
                  qlens.sizes() == lens.sizes(),
              "paged_prefill_attention: block_tables [B, M], seq_lens [B] and query_lens [B] "
              "must be int64");
  const int64_t max_blocks = tables.size(1);
  const int64_t* table = tables.data_ptr<int64_t>();
  const int64_t *len = lens.data_ptr<int64_t>(), *qlen = qlens.data_ptr<int64_t>();
  int64_t rows = 0;
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(qlen[b] >= 1 && qlen[b] <= len[b] && len[b] <= max_blocks * block_size,
                "paged_prefill_attention: query_len or seq_len outside its block table");
    rows += qlen[b];
  }
  TORCH_CHECK(rows == tokens, "paged_prefill_attention: query_lens must sum to q's rows");
  check_block_ids("paged_prefill_attention", table, batch * max_blocks, k_cache.size(0));
  Tensor qc = q.contiguous();
  Tensor out = at::empty({tokens, heads, d}, qc.options().dtype(out_dtype));
  if (tokens == 0) return out;
  dispatch(qc.scalar_type(), "paged_prefill_attention", [&](auto q_tag) {
    dispatch(k_cache.scalar_type(), "paged_prefill_attention_cache", [&](auto c_tag) {
      using C = decltype(c_tag);
      dispatch(out_dtype, "paged_prefill_attention_out", [&](auto o_tag) {
        paged_prefill_attention_rows(qc.data_ptr<decltype(q_tag)>(), k_cache.data_ptr<C>(),
                                     v_cache.data_ptr<C>(), table, len, qlen,
                                     out.data_ptr<decltype(o_tag)>(), batch, heads, kv_heads,
                                     d, block_size, max_blocks, static_cast<float>(scale),
                                     window);
      });
    });
  });
  return out;
}

// ---- the quantized cache's write (kv/quant.py) ----------------------------------------

// The half-range scale of kv/quant.py: bfloat16, rounded up from half / qmax (as float32
// math, the way torch computes it), at least 1e-30.
inline c10::BFloat16 round_up_scale(float half, double qmax) {
  const float factor = static_cast<float>((1.0 + 1.0 / 128) / qmax);
  return c10::BFloat16(std::max(half * factor, 1e-30f));
}

// code (already within +-qmax) -> its stored form: int8, e4m3 bits, or a nibble (code + 8)
template <int KIND>
inline uint8_t encode(float code) {
  if constexpr (KIND == 0)
    return static_cast<uint8_t>(static_cast<int8_t>(std::nearbyint(code)));
  else if constexpr (KIND == 1)
    return c10::Float8_e4m3fn(code).x;
  else
    return static_cast<uint8_t>(std::nearbyint(code) + 8.f);
}

template <int KIND>
constexpr double kind_qmax() {
  return KIND == 0 ? 127.0 : KIND == 1 ? 448.0 : 7.0;
}

// Calls f(std::integral_constant<int, KIND>{}) for a quantized cache's kind (0 int8, 1 fp8,
// 2 int4), checked by the caller.
template <typename F>
void dispatch_kind(int64_t kind, F&& f) {
  if (kind == 0)
    f(std::integral_constant<int, 0>{});
  else if (kind == 1)
    f(std::integral_constant<int, 1>{});
  else
    f(std::integral_constant<int, 2>{});
}

// The checks both quantized-cache ops make of the codes [N, block_size, KVH, CD] and the
// parameters (k_scale/k_zero [N, KVH, D], v_scale [N, block_size, KVH] bfloat16).
inline void check_quantized_cache(const char* name, int64_t kind, const Tensor& k_codes,
                                  const Tensor& v_codes, const Tensor& k_scale,
                                  const Tensor& k_zero, const Tensor& v_scale, int64_t kv_heads,
                                  int64_t d) {
  TORCH_CHECK(kind >= 0 && kind <= 2, name, ": kind must be 0 (int8), 1 (fp8) or 2 (int4)");
  TORCH_CHECK(k_codes.dim() == 4 && k_codes.size(2) == kv_heads && kv_heads > 0, name,
              ": k_codes must be [N, block_size, KVH, CD]");
  const int64_t num_blocks = k_codes.size(0), block_size = k_codes.size(1);
  TORCH_CHECK(k_codes.size(3) == (kind == 2 ? d / 2 : d), name,
              ": the codes' last dim does not match head_dim");
  TORCH_CHECK(k_codes.is_contiguous() && v_codes.is_contiguous() &&
                  v_codes.sizes() == k_codes.sizes() && k_codes.element_size() == 1 &&
                  v_codes.element_size() == 1,
              name, ": k_codes/v_codes must be contiguous one-byte tensors alike");
  for (const Tensor* t : {&k_scale, &k_zero, &v_scale})
    TORCH_CHECK(t->is_contiguous() && t->scalar_type() == at::kBFloat16, name,
                ": scales and offsets must be contiguous bfloat16");
  TORCH_CHECK(k_scale.sizes() == at::IntArrayRef({num_blocks, kv_heads, d}) &&
                  k_zero.sizes() == k_scale.sizes() &&
                  v_scale.sizes() == at::IntArrayRef({num_blocks, block_size, kv_heads}),
              name, ": k_scale/k_zero [N, KVH, D], v_scale [N, block_size, KVH]");
}

// Stores one code of a row of codes (two per byte for int4).
template <int KIND>
inline void put_code(uint8_t* row, int64_t c, float code) {
  const uint8_t e = encode<KIND>(code);
  if constexpr (KIND == 2)
    row[c / 2] = c % 2 ? static_cast<uint8_t>((row[c / 2] & 0x0F) | (e << 4))
                       : static_cast<uint8_t>((row[c / 2] & 0xF0) | e);
  else
    row[c] = e;
}

// Quantizes the full block held in open rows k/v [block_size, kv_heads, d] into block
// ``block`` of the codes: K per channel with offset, V per token (kv/quant.py's formulas, in
// the same float32 steps as its torch code, so both store the same bytes).
template <int KIND, typename R>
void quantize_open_block(const R* k, const R* v, uint8_t* k_codes, uint8_t* v_codes,
                         c10::BFloat16* k_scale, c10::BFloat16* k_zero,
                         c10::BFloat16* v_scale, int64_t block, int64_t block_size,
                         int64_t kv_heads, int64_t d) {
  constexpr double qmax = kind_qmax<KIND>();
  const float fq = static_cast<float>(qmax);
  const int64_t cd = KIND == 2 ? d / 2 : d, row = kv_heads * d, crow = kv_heads * cd;
  uint8_t* kc = k_codes + block * block_size * crow;
  uint8_t* vc = v_codes + block * block_size * crow;
  for (int64_t h = 0; h < kv_heads; ++h) {
    for (int64_t c = 0; c < d; ++c) {  // K: channel c of head h over the block's tokens
      float lo = static_cast<float>(k[h * d + c]), hi = lo;
      for (int64_t t = 1; t < block_size; ++t) {
        const float x = static_cast<float>(k[t * row + h * d + c]);
        lo = std::min(lo, x);
        hi = std::max(hi, x);
      }
      const c10::BFloat16 zero((lo + hi) * 0.5f);
      const float zf = static_cast<float>(zero);
      const c10::BFloat16 scale = round_up_scale(std::max(hi - zf, zf - lo), qmax);
      const float sf = static_cast<float>(scale);
      k_zero[(block * kv_heads + h) * d + c] = zero;
      k_scale[(block * kv_heads + h) * d + c] = scale;
      for (int64_t t = 0; t < block_size; ++t) {
        const float x = static_cast<float>(k[t * row + h * d + c]);
        put_code<KIND>(kc + t * crow + h * cd, c, std::clamp((x - zf) / sf, -fq, fq));
      }
    }
    for (int64_t t = 0; t < block_size; ++t) {  // V: token t's row of head h
      const R* x = v + t * row + h * d;
      float absmax = 0.f;
      for (int64_t c = 0; c < d; ++c) absmax = std::max(absmax, std::abs(static_cast<float>(x[c])));
      const c10::BFloat16 scale = round_up_scale(absmax, qmax);
      const float sf = static_cast<float>(scale);
      v_scale[(block * block_size + t) * kv_heads + h] = scale;
      for (int64_t c = 0; c < d; ++c)
        put_code<KIND>(vc + t * crow + h * cd, c,
                       std::clamp(static_cast<float>(x[c]) / sf, -fq, fq));
    }
  }
}

// Rotary (as rotary_write_kv) of each token's q and k heads, then its K/V written to row
// slot % block_size of its sequence's open row; a token that completes its block (the row's
// last slot) has the block quantized into block slot / block_size. Sequences run in parallel,
// each one's tokens in order (seq_starts [S + 1], open_rows [S]).
template <int KIND, typename I, typename R, typename Q>
void rotary_write_kv_quant_rows(const I* qkv, const float* cos, const float* sin,
                                const int64_t* slots, const int64_t* seq_starts,
                                const int64_t* open_rows, int64_t num_seqs, R* k_open,
                                R* v_open, uint8_t* k_codes, uint8_t* v_codes,
                                c10::BFloat16* k_scale, c10::BFloat16* k_zero,
                                c10::BFloat16* v_scale, Q* q, float* k_out, int64_t heads,
                                int64_t kv_heads, int64_t d, int64_t block_size) {
  const int64_t half = d / 2, kv = kv_heads * d, width = (heads + 2 * kv_heads) * d;
  at::parallel_for(0, num_seqs, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> x(std::max(d, kv)), y(d);
    for (int64_t s = begin; s < end; ++s) {
      R* ko = k_open + open_rows[s] * block_size * kv;
      R* vo = v_open + open_rows[s] * block_size * kv;
      for (int64_t t = seq_starts[s]; t < seq_starts[s + 1]; ++t) {
        const float* c = cos + t * d;
        const float* sn = sin + t * d;
        const I* src = qkv + t * width;
        const int64_t r = slots[t] % block_size;
        for (int64_t h = 0; h < heads + kv_heads; ++h) {
          convert(src + h * d, x.data(), d);
          for (int64_t i = 0; i < half; ++i) y[i] = x[i] * c[i] + x[i + half] * sn[i];
          for (int64_t i = half; i < d; ++i) y[i] = x[i] * c[i] + x[i - half] * sn[i];
          if (h < heads) {
            convert(y.data(), q + (t * heads + h) * d, d);
          } else {
            convert(y.data(), ko + r * kv + (h - heads) * d, d);
            if (k_out != nullptr) std::copy(y.begin(), y.end(), k_out + t * kv + (h - heads) * d);
          }
        }
        convert(src + (heads + kv_heads) * d, vo + r * kv, kv);
        if (r == block_size - 1)
          quantize_open_block<KIND>(ko, vo, k_codes, v_codes, k_scale, k_zero, v_scale,
                                    slots[t] / block_size, block_size, kv_heads, d);
      }
    }
  });
}

// The quantized cache's write (kv/quant.py): qkv [T, (H + 2 KVH) D] and cos/sin_signed
// [T, D] as in rotary_write_kv; slot_mapping [T] int64 (each token's cache slot);
// seq_starts [S + 1] int64 (sequence s's tokens are seq_starts[s] .. seq_starts[s + 1] - 1,
// in position order) and open_rows [S] int64 (its open row); k_open/v_open [rows, block_size,
// KVH, D] float32 or bfloat16; k_codes/v_codes [N, block_size, KVH, CD] one-byte; k_scale/
// k_zero [N, KVH, D] and v_scale [N, block_size, KVH] bfloat16; kind 0 int8, 1 fp8, 2 int4.
// k_out, if given, [T, KVH, D] float32 receives the rotated keys. Returns the rotated queries
// [T, H, D] of q_dtype.
Tensor rotary_write_kv_quant(const Tensor& qkv, const Tensor& cos, const Tensor& sin,
                             const Tensor& slot_mapping, const Tensor& seq_starts,
                             const Tensor& open_rows, Tensor k_open, Tensor v_open,
                             Tensor k_codes, Tensor v_codes, Tensor k_scale, Tensor k_zero,
                             Tensor v_scale, const std::optional<Tensor>& k_out,
                             int64_t num_heads, int64_t num_kv_heads, int64_t kind,
                             at::ScalarType q_dtype) {
  const char* name = "rotary_write_kv_quant";
  TORCH_CHECK(k_open.dim() == 4 && k_open.size(3) > 0 && k_open.size(3) % 2 == 0, name,
              ": k_open must be [rows, block_size, KVH, D], D even");
  const int64_t d = k_open.size(3), tokens = qkv.size(0), block_size = k_open.size(1);
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == (num_heads + 2 * num_kv_heads) * d, name,
              ": qkv must be [T, (H + 2 KVH) D]");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                  cos.numel() == tokens * d && sin.numel() == tokens * d,
              name, ": cos/sin must be float32 [T, D]");
  TORCH_CHECK(k_open.is_contiguous() && v_open.is_contiguous() &&
                  v_open.sizes() == k_open.sizes() &&
                  v_open.scalar_type() == k_open.scalar_type() && k_open.size(2) == num_kv_heads,
              name, ": k_open/v_open must be contiguous [rows, block_size, KVH, D] alike");
  check_quantized_cache(name, kind, k_codes, v_codes, k_scale, k_zero, v_scale, num_kv_heads,
                        d);
  TORCH_CHECK(k_codes.size(1) == block_size, name, ": open rows and blocks differ in size");
  const int64_t num_blocks = k_codes.size(0);
  Tensor slots = slot_mapping.contiguous(), starts = seq_starts.contiguous();
  Tensor rows = open_rows.contiguous();
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.numel() == tokens &&
                  starts.scalar_type() == at::kLong && rows.scalar_type() == at::kLong &&
                  starts.numel() == rows.numel() + 1,
              name, ": slot_mapping [T], seq_starts [S + 1] and open_rows [S] must be int64");
  const int64_t num_seqs = rows.numel();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t* start = starts.data_ptr<int64_t>();
  const int64_t* row = rows.data_ptr<int64_t>();
  TORCH_CHECK(start[0] == 0 && start[num_seqs] == tokens, name,
              ": seq_starts must run from 0 to T");
  for (int64_t s = 0; s < num_seqs; ++s) {
    TORCH_CHECK(start[s] <= start[s + 1], name, ": seq_starts must not decrease");
    TORCH_CHECK(row[s] >= 0 && row[s] < k_open.size(0), name, ": open row out of range");
  }
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(slot[t] >= 0 && slot[t] < num_blocks * block_size, name,
                ": slot out of range");
  float* kout = nullptr;
  if (k_out.has_value()) {
    TORCH_CHECK(k_out->is_contiguous() && k_out->scalar_type() == at::kFloat &&
                    k_out->numel() == tokens * num_kv_heads * d,
                name, ": k_out must be contiguous float32 [T, KVH, D]");
    kout = k_out->data_ptr<float>();
  }
  Tensor qkvc = qkv.contiguous(), cosc = cos.contiguous(), sinc = sin.contiguous();
  Tensor q = at::empty({tokens, num_heads, d}, qkvc.options().dtype(q_dtype));
  dispatch(qkvc.scalar_type(), name, [&](auto i_tag) {
    dispatch(k_open.scalar_type(), name, [&](auto r_tag) {
      using R = decltype(r_tag);
      dispatch(q_dtype, name, [&](auto q_tag) {
        dispatch_kind(kind, [&](auto kind_tag) {
          rotary_write_kv_quant_rows<decltype(kind_tag)::value>(
              qkvc.data_ptr<decltype(i_tag)>(), cosc.data_ptr<float>(), sinc.data_ptr<float>(),
              slot, start, row, num_seqs, k_open.data_ptr<R>(), v_open.data_ptr<R>(),
              static_cast<uint8_t*>(k_codes.data_ptr()), static_cast<uint8_t*>(v_codes.data_ptr()),
              k_scale.data_ptr<c10::BFloat16>(), k_zero.data_ptr<c10::BFloat16>(),
              v_scale.data_ptr<c10::BFloat16>(), q.data_ptr<decltype(q_tag)>(), kout,
              num_heads, num_kv_heads, d, block_size);
        });
      });
    });
  });
  return q;
}

// Stored codes of a quantized KV cache (kv/quant.py) as float codes, 16 at a time: int8,
// fp8 e4m3 bits, or int4 nibbles (two per byte, minus 8). KIND: 0 int8, 1 fp8, 2 int4.
template <int KIND>
VEC_INLINE F32x16 load_codes(const uint8_t* row, int64_t i) {  // values i .. i + 15
  if constexpr (KIND == 0)
    return F32x16::load(reinterpret_cast<const int8_t*>(row) + i);
  else if constexpr (KIND == 1)
    return F32x16::load_fp8(row + i);
  else
    return load_int4(row + i / 2);
}

// scores[r][t] = q[r] . codes_t for R query rows q (each d floats, ``q_stride`` apart) and
// the n code rows keys[t] (d values each, decoded in registers): each key chunk is decoded
// once for all R rows, four keys at a time.
template <int KIND, int R>
inline void code_scores(const float* q, int64_t q_stride, const uint8_t* const* keys,
                        int64_t n, int64_t d, float* scores, int64_t s_stride) {
  int64_t t = 0;
  for (; t + 4 <= n; t += 4) {
    F32x16 acc[R][4];
    for (int r = 0; r < R; ++r)
      for (int k = 0; k < 4; ++k) acc[r][k] = F32x16::zero();
    for (int64_t i = 0; i < d; i += 16) {
      const F32x16 k0 = load_codes<KIND>(keys[t], i), k1 = load_codes<KIND>(keys[t + 1], i);
      const F32x16 k2 = load_codes<KIND>(keys[t + 2], i), k3 = load_codes<KIND>(keys[t + 3], i);
      for (int r = 0; r < R; ++r) {
        const F32x16 qv = F32x16::load(q + r * q_stride + i);
        acc[r][0] = fma(qv, k0, acc[r][0]);
        acc[r][1] = fma(qv, k1, acc[r][1]);
        acc[r][2] = fma(qv, k2, acc[r][2]);
        acc[r][3] = fma(qv, k3, acc[r][3]);
      }
    }
    for (int r = 0; r < R; ++r)
      reduce_add4(acc[r][0], acc[r][1], acc[r][2], acc[r][3], scores + r * s_stride + t);
  }
  for (; t < n; ++t) {
    F32x16 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = F32x16::zero();
    for (int64_t i = 0; i < d; i += 16) {
      const F32x16 kv = load_codes<KIND>(keys[t], i);
      for (int r = 0; r < R; ++r) acc[r] = fma(F32x16::load(q + r * q_stride + i), kv, acc[r]);
    }
    for (int r = 0; r < R; ++r) scores[r * s_stride + t] = reduce_add(acc[r]);
  }
}

// out[r] += sum over t < n of p[r][t] * codes_t for R rows (weights ``p_stride`` apart,
// outputs ``o_stride`` apart) and the n code rows vals[t] (d values each): each chunk of a
// value row is decoded once for all R rows, the R accumulators kept in registers.
template <int KIND, int R>
inline void code_weighted(const float* p, int64_t p_stride, const uint8_t* const* vals,
                          int64_t n, int64_t d, float* out, int64_t o_stride) {
  for (int64_t i = 0; i < d; i += 16) {
    F32x16 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = F32x16::load(out + r * o_stride + i);
    for (int64_t t = 0; t < n; ++t) {
      const F32x16 v = load_codes<KIND>(vals[t], i);
      for (int r = 0; r < R; ++r) acc[r] = fma(F32x16::set1(p[r * p_stride + t]), v, acc[r]);
    }
    for (int r = 0; r < R; ++r) acc[r].store(out + r * o_stride + i);
  }
}

// Calls f(std::integral_constant<int, R>{}, first) for the rows of a group of ``rows``,
// four at a time, then the rest.
template <typename F>
inline void in_fours(int64_t rows, F&& f) {
  int64_t r = 0;
  for (; r + 4 <= rows; r += 4) f(std::integral_constant<int, 4>{}, r);
  switch (rows - r) {
    case 3: return f(std::integral_constant<int, 3>{}, r);
    case 2: return f(std::integral_constant<int, 2>{}, r);
    case 1: return f(std::integral_constant<int, 1>{}, r);
    default: return;
  }
}

// The decode attention of paged_decode_attention_quant below over raw pointers: as
// paged_decode_attention_rows, but K and V are codes (k_codes/v_codes [num_blocks,
// block_size, kv_heads, cd], cd = d, or d / 2 for int4) with K's per-channel scales and
// offsets (k_scale/k_zero [num_blocks, kv_heads, d]) and V's per-token scales (v_scale
// [num_blocks, block_size, kv_heads]), and each sequence's own (last) block is read from its
// open row of k_open/v_open [rows, block_size, kv_heads, d]. Codes are decoded in registers
// (code_scores, code_weighted), once for all the query heads of a KV head; a block's K
// scales are folded into the query once per block (q . (s * c + z) = (q * s) . c + q . z)
// and a token's V scale into its weight.
template <int KIND, typename Q, typename R, typename O>
void paged_decode_attention_quant_rows(
    const Q* q, const void* k_codes, const void* v_codes, const c10::BFloat16* k_scale,
    const c10::BFloat16* k_zero, const c10::BFloat16* v_scale,
    const R* k_open, const R* v_open, const int64_t* block_tables, const int64_t* seq_lens,
    const int64_t* open_rows, O* out, int64_t batch, int64_t heads, int64_t kv_heads,
    int64_t d, int64_t block_size, int64_t max_blocks, float scale, int64_t window) {
  const int64_t group = heads / kv_heads;
  const int64_t cd = KIND == 2 ? d / 2 : d;  // bytes of one row of codes
  const int64_t split = batch >= 2 * at::get_num_threads() ? 1 : kv_heads;
  const int64_t per_item = kv_heads / split;
  const int64_t rows = per_item * group;
  const auto* kc = static_cast<const uint8_t*>(k_codes);
  const auto* vc = static_cast<const uint8_t*>(v_codes);
  at::parallel_for(0, batch * split, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(rows * d), qs(group * d), acc(rows * d), scores, total(rows), bias(group);
    std::vector<float> buf(block_size * d), pv(group * block_size);
    std::vector<const float*> row_ptr(block_size);
    std::vector<const uint8_t*> code_ptr(block_size);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / split, h0 = item % split * per_item, end_key = seq_lens[b];
      const int64_t start = window > 0 ? std::max<int64_t>(0, end_key - window) : 0;
      const int64_t n = end_key - start, own = (end_key - 1) / block_size;
      const int64_t* blocks = block_tables + b * max_blocks;
      convert(q + (b * heads + h0 * group) * d, qf.data(), rows * d);
      scale_by(qf.data(), scale, rows * d);
      scores.resize(rows * n);
      // f(j, h, first, count, r0): block j's keys first .. first + count - 1 (counted from
      // start; rows r0 .. of the block) for KV head h0 + h
      auto for_each_block = [&](auto&& f) {
        for (int64_t j = start / block_size; j <= own; ++j) {
          const int64_t t0 = std::max(start, j * block_size);
          const int64_t count = std::min(end_key, (j + 1) * block_size) - t0;
          for (int64_t h = 0; h < per_item; ++h) f(j, h, t0 - start, count, t0 - j * block_size);
        }
      };
      // the own block's rows of head h0 + h from an open row, as float32 (in buf)
      auto open_rows_of = [&](const R* opened, int64_t h, int64_t count, int64_t r0) {
        for (int64_t i = 0; i < count; ++i)
          row_ptr[i] = as_float(
              opened + ((open_rows[b] * block_size + r0 + i) * kv_heads + h0 + h) * d,
              buf.data() + i * d, d);
      };
      auto code_rows_of = [&](const uint8_t* codes, int64_t j, int64_t h, int64_t count,
                              int64_t r0) {
        for (int64_t i = 0; i < count; ++i)
          code_ptr[i] = codes + ((blocks[j] * block_size + r0 + i) * kv_heads + h0 + h) * cd;
      };
      for_each_block([&](int64_t j, int64_t h, int64_t first, int64_t count, int64_t r0) {
        float* sr = scores.data() + h * group * n + first;  // row h * group + g at g * n
        if (j == own) {  // unquantized open rows
          open_rows_of(k_open, h, count, r0);
          for (int64_t g = 0; g < group; ++g)
            scores_of_row(qf.data() + (h * group + g) * d, row_ptr.data(), 0, count, d,
                          sr + g * n);
          return;
        }
        const int64_t ph = (blocks[j] * kv_heads + h0 + h) * d;
        for (int64_t g = 0; g < group; ++g) {  // the block's K scales folded into the query
          const float* qr = qf.data() + (h * group + g) * d;
          float* qsr = qs.data() + g * d;
          float bz = 0.f;
          for (int64_t c = 0; c < d; ++c) {
            qsr[c] = qr[c] * static_cast<float>(k_scale[ph + c]);
            bz += qr[c] * static_cast<float>(k_zero[ph + c]);
          }
          bias[g] = bz;
        }
        code_rows_of(kc, j, h, count, r0);
        in_fours(group, [&](auto rows_tag, int64_t g0) {
          code_scores<KIND, decltype(rows_tag)::value>(qs.data() + g0 * d, d, code_ptr.data(),
                                                       count, d, sr + g0 * n, n);
        });
        for (int64_t g = 0; g < group; ++g)
          for (int64_t t = 0; t < count; ++t) sr[g * n + t] += bias[g];
      });
      for (int64_t r = 0; r < rows; ++r) {  // softmax over t, normalized at the end
        float* sr = scores.data() + r * n;
        const float m = max_of(sr, n);
        for (int64_t t = 0; t < n; ++t) sr[t] = fast_exp(sr[t] - m);
        total[r] = sum(sr, n);
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for_each_block([&](int64_t j, int64_t h, int64_t first, int64_t count, int64_t r0) {
        const float* p = scores.data() + h * group * n + first;
        float* ah = acc.data() + h * group * d;
        if (j == own) {
          open_rows_of(v_open, h, count, r0);
          for (int64_t g = 0; g < group; ++g)
            weighted_sum(p + g * n, row_ptr.data(), 0, count, d, ah + g * d);
          return;
        }
        // each token's V scale into its weights
        const c10::BFloat16* vs = v_scale + (blocks[j] * block_size + r0) * kv_heads + h0 + h;
        for (int64_t t = 0; t < count; ++t) {
          const float s = static_cast<float>(vs[t * kv_heads]);
          for (int64_t g = 0; g < group; ++g) pv[g * block_size + t] = p[g * n + t] * s;
        }
        code_rows_of(vc, j, h, count, r0);
        in_fours(group, [&](auto rows_tag, int64_t g0) {
          code_weighted<KIND, decltype(rows_tag)::value>(pv.data() + g0 * block_size,
                                                         block_size, code_ptr.data(), count,
                                                         d, ah + g0 * d, d);
        });
      });
      for (int64_t r = 0; r < rows; ++r) scale_by(acc.data() + r * d, 1.f / total[r], d);
      convert(acc.data(), out + (b * heads + h0 * group) * d, rows * d);
    }
  });
}

// Decode attention straight over a quantized paged cache (kv/quant.py; PagedAttention sec.
// 4.1): q [B, H, D] float32 or bfloat16; k_codes/v_codes [N, block_size, KVH, CD] (int8, or
// uint8 holding fp8 e4m3 bits or two int4 nibbles, CD = D / 2); k_scale/k_zero [N, KVH, D]
// and v_scale [N, block_size, KVH] bfloat16; k_open/v_open [rows, block_size, KVH, D] float32
// or bfloat16: each
// sequence's own (last) block, unquantized, in row open_rows[b]; block_tables [B, M],
// seq_lens [B], open_rows [B] int64; kind 0 int8, 1 fp8, 2 int4; window as in
// paged_decode_attention. Returns [B, H, D] of out_dtype.
Tensor paged_decode_attention_quant(const Tensor& q, const Tensor& k_codes,
                                    const Tensor& v_codes, const Tensor& k_scale,
                                    const Tensor& k_zero, const Tensor& v_scale,
                                    const Tensor& k_open, const Tensor& v_open,
                                    const Tensor& block_tables, const Tensor& seq_lens,
                                    const Tensor& open_rows, double scale,
                                    at::ScalarType out_dtype, int64_t window, int64_t kind) {
  const char* name = "paged_decode_attention_quant";
  TORCH_CHECK(window >= 0, name, ": window must be >= 0");
  TORCH_CHECK(q.dim() == 3 && q.size(2) > 0 && q.size(2) % 16 == 0, name,
              ": q must be [B, H, D] with D a multiple of 16");
  const int64_t batch = q.size(0), heads = q.size(1), d = q.size(2);
  TORCH_CHECK(k_codes.dim() == 4 && k_codes.size(2) > 0 && heads % k_codes.size(2) == 0, name,
              ": k_codes must be [N, block_size, KVH, CD], KVH dividing the query heads");
  const int64_t num_blocks = k_codes.size(0), block_size = k_codes.size(1);
  const int64_t kv_heads = k_codes.size(2);
  check_quantized_cache(name, kind, k_codes, v_codes, k_scale, k_zero, v_scale, kv_heads, d);
  for (const Tensor* t : {&k_open, &v_open})
    TORCH_CHECK(t->is_contiguous() && t->dim() == 4 && t->size(1) == block_size &&
                    t->size(2) == kv_heads && t->size(3) == d &&
                    t->scalar_type() == k_open.scalar_type() && t->size(0) == k_open.size(0),
                name, ": k_open/v_open must be contiguous [rows, block_size, KVH, D] alike");
  Tensor tables = block_tables.contiguous(), lens = seq_lens.contiguous();
  Tensor orows = open_rows.contiguous();
  TORCH_CHECK(tables.scalar_type() == at::kLong && tables.dim() == 2 && tables.size(0) == batch &&
                  lens.scalar_type() == at::kLong && lens.numel() == batch &&
                  orows.scalar_type() == at::kLong && orows.numel() == batch,
              name, ": block_tables [B, M], seq_lens [B] and open_rows [B] must be int64");
  const int64_t max_blocks = tables.size(1);
  const int64_t* table = tables.data_ptr<int64_t>();
  const int64_t* len = lens.data_ptr<int64_t>();
  const int64_t* orow = orows.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(len[b] >= 1 && len[b] <= max_blocks * block_size, name,
                ": seq_len outside its block table");
    TORCH_CHECK(orow[b] >= 0 && orow[b] < k_open.size(0), name, ": open row out of range");
  }
  check_block_ids(name, table, batch * max_blocks, num_blocks);
  Tensor qc = q.contiguous();
  Tensor out = at::empty({batch, heads, d}, qc.options().dtype(out_dtype));
  dispatch(qc.scalar_type(), name, [&](auto q_tag) {
    dispatch(k_open.scalar_type(), name, [&](auto r_tag) {
      using R = decltype(r_tag);
      dispatch(out_dtype, name, [&](auto o_tag) {
        dispatch_kind(kind, [&](auto kind_tag) {
          paged_decode_attention_quant_rows<decltype(kind_tag)::value>(
              qc.data_ptr<decltype(q_tag)>(), k_codes.data_ptr(), v_codes.data_ptr(),
              k_scale.data_ptr<c10::BFloat16>(), k_zero.data_ptr<c10::BFloat16>(),
              v_scale.data_ptr<c10::BFloat16>(),
              k_open.data_ptr<R>(), v_open.data_ptr<R>(), table, len, orow,
              out.data_ptr<decltype(o_tag)>(), batch, heads, kv_heads, d, block_size,
              max_blocks, static_cast<float>(scale), window);
        });
      });
    });
  });
  return out;
}

}  // namespace OPS_NAMESPACE
