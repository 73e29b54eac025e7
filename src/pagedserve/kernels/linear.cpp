// Matmuls: int8_linear (the int4 mode's Q8_0 LM head) and packed_linear (float32 over
// weights prepacked in column panels, with the gated SwiGLU epilogue).
#include "ops.h"
#include "common.h"

namespace OPS_NAMESPACE {

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

}  // namespace OPS_NAMESPACE
