// The CPU kernels' entry points, one per op (defined by op family in norm.cpp,
// attention.cpp, sampling.cpp and linear.cpp; registered with torch in ops.cpp). Shapes and
// dtypes are documented at each definition.
#pragma once

#include <ATen/ATen.h>

#include <optional>

// The op namespace: torch.ops.pagedserve, or another one for a second build in the same
// process (the test of the portable, non-AVX-512 build). The C++ functions live in a
// namespace of the same name, so two builds never share a symbol.
#ifndef OPS_NAMESPACE
#define OPS_NAMESPACE pagedserve
#endif

namespace OPS_NAMESPACE {

using at::Tensor;

Tensor add_rms_norm(Tensor residual, const std::optional<Tensor>& y, const Tensor& weight,
                    double eps, at::ScalarType out_dtype);
Tensor silu_and_mul(const Tensor& x, at::ScalarType out_dtype);
Tensor rotary_write_kv(const Tensor& qkv, const Tensor& cos, const Tensor& sin,
                       Tensor k_cache, Tensor v_cache, const Tensor& slot_mapping,
                       int64_t num_heads, int64_t num_kv_heads, at::ScalarType q_dtype);
Tensor paged_decode_attention(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                              const Tensor& block_tables, const Tensor& seq_lens, double scale,
                              at::ScalarType out_dtype, int64_t window);
Tensor paged_prefill_attention(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                               const Tensor& block_tables, const Tensor& seq_lens,
                               const Tensor& query_lens, double scale, at::ScalarType out_dtype,
                               int64_t window);
Tensor rotary_write_kv_quant(const Tensor& qkv, const Tensor& cos, const Tensor& sin,
                             const Tensor& slot_mapping, const Tensor& seq_starts,
                             const Tensor& open_rows, Tensor k_open, Tensor v_open,
                             Tensor k_codes, Tensor v_codes, Tensor k_scale, Tensor k_zero,
                             Tensor v_scale, const std::optional<Tensor>& k_out,
                             int64_t num_heads, int64_t num_kv_heads, int64_t kind,
                             at::ScalarType q_dtype);
Tensor paged_decode_attention_quant(const Tensor& q, const Tensor& k_codes,
                                    const Tensor& v_codes, const Tensor& k_scale,
                                    const Tensor& k_zero, const Tensor& v_scale,
                                    const Tensor& k_open, const Tensor& v_open,
                                    const Tensor& block_tables, const Tensor& seq_lens,
                                    const Tensor& open_rows, double scale,
                                    at::ScalarType out_dtype, int64_t window, int64_t kind);
Tensor argmax(const Tensor& x);
Tensor int8_linear(const Tensor& x, const Tensor& qweight, const Tensor& scales);
Tensor int4_linear(const Tensor& x, const Tensor& codes, const Tensor& scale_zero);
Tensor packed_linear(const Tensor& x, const Tensor& packed, const std::optional<Tensor>& bias,
                     int64_t n, const std::optional<Tensor>& out_buffer, bool gated);
Tensor packed_linear_bf16(const Tensor& x, const Tensor& packed, int64_t n,
                          at::ScalarType out_dtype, const std::optional<Tensor>& out_buffer);

}  // namespace OPS_NAMESPACE
