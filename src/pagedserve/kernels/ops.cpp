// Fused CPU kernels of the decoder's hot path (see kernels/__init__.py for when they are used):
// the torch registration of every op. Each kernel replaces a chain of small torch ops whose
// per-op dispatch cost, not arithmetic, dominated a decode step. All arithmetic is float32
// whatever the storage dtype (float32 or bfloat16); every kernel has a torch reference in the
// model code and a test comparing the two. Work is split over rows (tokens, sequences, or
// sequence x KV head) with at::parallel_for, ATen's own thread pool.
#include <torch/library.h>

#include "ops.h"

// The op namespace: torch.ops.pagedserve, or another one for a second build in the same
// process (the test of the portable, non-AVX-512 build).
TORCH_LIBRARY(OPS_NAMESPACE, m) {
  m.def("add_rms_norm(Tensor(a!) residual, Tensor? y, Tensor weight, float eps, "
        "ScalarType out_dtype) -> Tensor");
  m.def("silu_and_mul(Tensor x, ScalarType out_dtype) -> Tensor");
  m.def("argmax(Tensor x) -> Tensor");
  m.def("int8_linear(Tensor x, Tensor qweight, Tensor scales) -> Tensor");
  m.def("int4_linear(Tensor x, Tensor codes, Tensor scale_zero) -> Tensor");
  m.def("packed_linear(Tensor x, Tensor packed, Tensor? bias, int n, "
        "Tensor(a!)? out_buffer=None, bool gated=False) -> Tensor(a)");
  m.def("packed_linear_bf16(Tensor x, Tensor packed, int n, ScalarType out_dtype, "
        "Tensor(a!)? out_buffer=None) -> Tensor(a)");
  m.def("rotary_write_kv(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) k_cache, "
        "Tensor(b!) v_cache, Tensor slot_mapping, int num_heads, int num_kv_heads, "
        "ScalarType q_dtype) -> Tensor");
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor seq_lens, float scale, ScalarType out_dtype, int window=0) -> Tensor");
  m.def("paged_prefill_attention(Tensor q, Tensor k_cache, Tensor v_cache, "
        "Tensor block_tables, Tensor seq_lens, Tensor query_lens, float scale, "
        "ScalarType out_dtype, int window=0) -> Tensor");
  m.def("rotary_write_kv_quant(Tensor qkv, Tensor cos, Tensor sin, Tensor slot_mapping, "
        "Tensor seq_starts, Tensor open_rows, Tensor(a!) k_open, Tensor(b!) v_open, "
        "Tensor(c!) k_codes, Tensor(d!) v_codes, Tensor(e!) k_scale, Tensor(f!) k_zero, "
        "Tensor(g!) v_scale, Tensor(h!)? k_out, int num_heads, int num_kv_heads, int kind, "
        "ScalarType q_dtype) -> Tensor");
  m.def("paged_decode_attention_quant(Tensor q, Tensor k_codes, Tensor v_codes, "
        "Tensor k_scale, Tensor k_zero, Tensor v_scale, Tensor k_open, "
        "Tensor v_open, Tensor block_tables, Tensor seq_lens, Tensor open_rows, float scale, "
        "ScalarType out_dtype, int window, int kind) -> Tensor");
}

TORCH_LIBRARY_IMPL(OPS_NAMESPACE, CPU, m) {
  m.impl("add_rms_norm", &OPS_NAMESPACE::add_rms_norm);
  m.impl("silu_and_mul", &OPS_NAMESPACE::silu_and_mul);
  m.impl("argmax", &OPS_NAMESPACE::argmax);
  m.impl("int8_linear", &OPS_NAMESPACE::int8_linear);
  m.impl("int4_linear", &OPS_NAMESPACE::int4_linear);
  m.impl("packed_linear", &OPS_NAMESPACE::packed_linear);
  m.impl("packed_linear_bf16", &OPS_NAMESPACE::packed_linear_bf16);
  m.impl("rotary_write_kv", &OPS_NAMESPACE::rotary_write_kv);
  m.impl("paged_decode_attention", &OPS_NAMESPACE::paged_decode_attention);
  m.impl("paged_prefill_attention", &OPS_NAMESPACE::paged_prefill_attention);
  m.impl("rotary_write_kv_quant", &OPS_NAMESPACE::rotary_write_kv_quant);
  m.impl("paged_decode_attention_quant", &OPS_NAMESPACE::paged_decode_attention_quant);
}
