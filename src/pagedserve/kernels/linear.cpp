// Matmuls: int8_linear (the int4 mode's Q8_0 LM head), int4_linear (the int4 mode's decoder
// projections at decode's few rows) and packed_linear (float32 over weights prepacked in
// column panels, with the gated SwiGLU epilogue).
#include "ops.h"
#include "common.h"

#include <vector>

namespace OPS_NAMESPACE {

// out[0 .. R) rows (stride ldo), columns [begin, end) = x [R, k] @ W.T for W [n, k] stored as
// int8 q with one float32 scale per group of 32 along k (W = q * scale; the layout of GGUF's
// Q8_0). Each weight row is dequantized 16 weights at a time, in registers, and used for all R
// x rows at once.
template <int R>
void int8_tile(const float* x, const int8_t* q, const float* scales, float* out, int64_t ldo,
               int64_t k, int64_t begin, int64_t end) {
  const int64_t groups = k / 32;
  for (int64_t row = begin; row < end; ++row) {
    const int8_t* qr = q + row * k;
    const float* sr = scales + row * groups;
    F32x16 acc[R];
    for (int j = 0; j < R; ++j) acc[j] = F32x16::zero();
    for (int64_t i = 0; i < k; i += 16) {
      const F32x16 w = F32x16::load(qr + i) * F32x16::set1(sr[i / 32]);
      for (int j = 0; j < R; ++j) acc[j] = fma(w, F32x16::load(x + j * k + i), acc[j]);
    }
    for (int j = 0; j < R; ++j) out[j * ldo + row] = reduce_add(acc[j]);
  }
}

// out [m, n] = x [m, k] @ W.T (see int8_tile; k a multiple of 32), x in blocks of up to 8 rows:
// the weights are read once per block at a quarter of float32's bytes (decode reads the whole
// LM head every step).
inline void int8_linear_rows(const float* x, const int8_t* q, const float* scales, float* out,
                             int64_t m, int64_t k, int64_t n) {
  at::parallel_for(0, n, 256, [&](int64_t begin, int64_t end) {
    for (int64_t r0 = 0; r0 < m; r0 += 8) {
      const float* xr = x + r0 * k;
      float* o = out + r0 * n;
      switch (std::min<int64_t>(8, m - r0)) {
        case 8: int8_tile<8>(xr, q, scales, o, n, k, begin, end); break;
        case 7: int8_tile<7>(xr, q, scales, o, n, k, begin, end); break;
        case 6: int8_tile<6>(xr, q, scales, o, n, k, begin, end); break;
        case 5: int8_tile<5>(xr, q, scales, o, n, k, begin, end); break;
        case 4: int8_tile<4>(xr, q, scales, o, n, k, begin, end); break;
        case 3: int8_tile<3>(xr, q, scales, o, n, k, begin, end); break;
        case 2: int8_tile<2>(xr, q, scales, o, n, k, begin, end); break;
        default: int8_tile<1>(xr, q, scales, o, n, k, begin, end); break;
      }
    }
  });
}

// x [M, K] float32 @ W.T -> [M, N] float32, W [N, K] given as qweight int8 [N, K] and scales
// float32 [N, K / 32] (see int8_linear_rows).
Tensor int8_linear(const Tensor& x, const Tensor& qweight, const Tensor& scales) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "int8_linear: x must be float32 [M, K]");
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == at::kChar && qweight.is_contiguous() &&
                  qweight.size(1) == x.size(1) && qweight.size(1) % 32 == 0,
              "int8_linear: qweight must be contiguous int8 [N, K], K divisible by 32");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
                  scales.numel() == qweight.numel() / 32,
              "int8_linear: scales must be contiguous float32 [N, K / 32]");
  Tensor xc = x.contiguous();
  const int64_t m = xc.size(0), k = xc.size(1), n = qweight.size(0);
  Tensor out = at::empty({m, n}, xc.options());
  int8_linear_rows(xc.data_ptr<float>(), qweight.data_ptr<int8_t>(), scales.data_ptr<float>(),
                   out.data_ptr<float>(), m, k, n);
  return out;
}

// ---- int4_linear: x @ W.T for W in 4-bit groups (model/quant.py Int4Linear) ----
//
// W [N, K] is held as codes uint8 [N, K / 2] (per group of 32 channels, 16 bytes: channel i in
// byte i's low nibble, channel 16 + i in its high one) and bfloat16 (scale, zero) pairs
// [N, K / 32, 2]: w = (q - 8) * scale + zero. x is quantized per call to int16 with one float
// scale per row and group, x ~= xs * xq (xs = max |x| / 32767: a relative error near 2^-16,
// below the bfloat16 rounding the int4 mode's activations already carry; int8, as in
// llama.cpp's Q8 activations, measured once 3-4x that rounding on SmolLM2: docs/performance.md),
// so a group's dot product is integer arithmetic (vpmaddwd on AVX2):
//   sum_k w_k x_k ~= scale * xs * (sum_k q_k xq_k - 8 sum_k xq_k) + zero * sum_k x_k,
// the last sum exact. The codes of a weight row are unpacked once per block of INT4_ROWS
// rows of x.
constexpr int INT4_ROWS = 4;

template <int R, typename OutT>
void int4_tile(const int16_t* xq, const float* xscale, const float* xsum, const float* xqsum,
               const uint8_t* codes,
               const at::BFloat16* scale_zero, OutT* out, int64_t ldo, int64_t k,
               int64_t begin, int64_t end) {
  const int64_t groups = k / 32;
  for (int64_t row = begin; row < end; ++row) {
    const uint8_t* c = codes + row * (k / 2);
    const at::BFloat16* sz = scale_zero + row * groups * 2;
    Q4Acc acc[R];
    float shifted[R];
    for (int j = 0; j < R; ++j) acc[j] = Q4Acc::zero(), shifted[j] = 0.f;
    for (int64_t g = 0; g < groups; ++g) {
      const Q4Group w = Q4Group::load(c + 16 * g);
      const float scale = static_cast<float>(sz[2 * g]), zero = static_cast<float>(sz[2 * g + 1]);
      for (int j = 0; j < R; ++j) {
        const int64_t i = j * groups + g;
        acc[j].add(w, xq + j * k + 32 * g, scale * xscale[i]);
        // explicit fmas, not left to contraction: tiles of different R may not then fuse
        // differently, and a row's result stays the same whatever rows share its call
        shifted[j] = std::fma(zero, xsum[i], std::fma(-8.f * scale, xqsum[i], shifted[j]));
      }
    }
    for (int j = 0; j < R; ++j)
      out[j * ldo + row] = static_cast<OutT>(acc[j].total() + shifted[j]);
  }
}

// One group of 32 floats -> int16 codes q = round(x * 32767 / max |x|) (0 for an all-zero
// group); returns the scale max |x| / 32767 and sets *qsum = scale * sum q.
inline float quantize_group_q16(const float* x, int16_t* q, float* qsum) {
  float amax = 0.f;
  for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float inv = amax > 0.f ? 32767.f / amax : 0.f;
  int32_t total = 0;
  for (int i = 0; i < 32; ++i) {  // fmin/fmax: a NaN gives a code, not undefined behaviour
    q[i] = static_cast<int16_t>(
        std::fmax(-32767.f, std::fmin(32767.f, std::nearbyint(x[i] * inv))));
    total += q[i];
  }
  *qsum = amax / 32767.f * static_cast<float>(total);
  return amax / 32767.f;
}

// x [M, K] float32 or bfloat16 @ W.T -> [M, N] of x's dtype (a bfloat16 result is the float
// one rounded to nearest even, as torch rounds), for W given as codes uint8 [N, K / 2] and
// scale_zero bfloat16 [N, K / 32, 2] (see int4_tile; K a multiple of 32). Taking and giving
// bfloat16 spares the int4 mode's activations two conversions a projection.
Tensor int4_linear(const Tensor& x, const Tensor& codes, const Tensor& scale_zero) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 32 == 0,
              "int4_linear: x must be [M, K], K divisible by 32");
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kByte && codes.is_contiguous() &&
                  codes.size(1) * 2 == k,
              "int4_linear: codes must be contiguous uint8 [N, K / 2]");
  const int64_t n = codes.size(0);
  TORCH_CHECK(scale_zero.scalar_type() == at::kBFloat16 && scale_zero.is_contiguous() &&
                  scale_zero.numel() == n * (k / 32) * 2,
              "int4_linear: scale_zero must be contiguous bfloat16 [N, K / 32, 2]");
  Tensor xc = x.contiguous();
  Tensor out = at::empty({m, n}, xc.options());
  dispatch(xc.scalar_type(), "int4_linear", [&](auto t) {
    using T = decltype(t);
    const T* xp = xc.data_ptr<T>();
    const int64_t groups = k / 32;
    std::vector<int16_t> xq(m * k);
    std::vector<float> xscale(m * groups), xsum(m * groups), xqsum(m * groups);
    float group[32];
    for (int64_t i = 0; i < m * groups; ++i) {
      for (int j = 0; j < 32; ++j) group[j] = static_cast<float>(xp[32 * i + j]);
      xscale[i] = quantize_group_q16(group, xq.data() + 32 * i, &xqsum[i]);
      xsum[i] = sum(group, 32);
    }
    T* o = out.data_ptr<T>();
    const uint8_t* c = codes.data_ptr<uint8_t>();
    const at::BFloat16* sz = scale_zero.data_ptr<at::BFloat16>();
    at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
      for (int64_t r0 = 0; r0 < m; r0 += INT4_ROWS) {
        const int16_t* q = xq.data() + r0 * k;
        const float* xs = xscale.data() + r0 * groups;
        const float* su = xsum.data() + r0 * groups;
        const float* qs = xqsum.data() + r0 * groups;
        switch (std::min<int64_t>(INT4_ROWS, m - r0)) {
          case 4: int4_tile<4>(q, xs, su, qs, c, sz, o + r0 * n, n, k, begin, end); break;
          case 3: int4_tile<3>(q, xs, su, qs, c, sz, o + r0 * n, n, k, begin, end); break;
          case 2: int4_tile<2>(q, xs, su, qs, c, sz, o + r0 * n, n, k, begin, end); break;
          default: int4_tile<1>(q, xs, su, qs, c, sz, o + r0 * n, n, k, begin, end); break;
        }
      }
    });
  });
  return out;
}

// ---- packed_linear: float32 x @ W.T with W prepacked in column panels ----
//
// W [N, K] is stored as panels of PANEL output columns, [ceil(N / PANEL), K, PANEL] (the last
// one zero-padded; model/layers.py packs it once at load). A register tile of up to TILE_ROWS
// rows of x times one panel keeps 3 x TILE_ROWS F32x16 accumulators in registers and streams
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

// c [MR, cols] (row stride ldc) = a [MR, k] @ panel [k, PANEL] (+ bias), or its SwiGLU when
// GATED. Meanwhile pf_lines cache lines from pf on (the next panel) are prefetched.
template <int MR, bool GATED>
void linear_tile(const float* a, const float* panel, int64_t k, float* c, int64_t ldc, int cols,
                 const float* bias, const char* pf, int64_t pf_lines) {
  F32x16 acc[MR][3];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = acc[r][2] = F32x16::zero();
  int64_t pf_acc = 0;
  for (int64_t i = 0; i < k; ++i) {
    const F32x16 b0 = F32x16::load(panel + i * PANEL);
    const F32x16 b1 = F32x16::load(panel + i * PANEL + 16);
    const F32x16 b2 = F32x16::load(panel + i * PANEL + 32);
    // spread evenly over the k steps: pf_lines prefetches in all (into L2)
    for (pf_acc += pf_lines; pf_acc >= k; pf_acc -= k, pf += 64) __builtin_prefetch(pf, 0, 2);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const F32x16 x = F32x16::set1(a[r * k + i]);
      acc[r][0] = fma(x, b0, acc[r][0]);
      acc[r][1] = fma(x, b1, acc[r][1]);
      acc[r][2] = fma(x, b2, acc[r][2]);
    }
  }
  if constexpr (GATED) {
    float buf[MR][PANEL];
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < 3; ++j) acc[r][j].store(buf[r] + 16 * j);
    gated_store<MR>(buf, c, ldc, cols);
  } else {
    F32x16 b[3] = {F32x16::zero(), F32x16::zero(), F32x16::zero()};
    if (bias)
      for (int j = 0; j < 3; ++j) b[j] = F32x16::load(bias + 16 * j, cols - 16 * j);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < 3; ++j) (acc[r][j] + b[j]).store(c + r * ldc + 16 * j, cols - 16 * j);
  }
}

// The work split of the packed kernels: items are (block of rows, panel) pairs, split over
// threads; a row block stays in L2 while the thread's panels stream past it. For each tile of
// up to TILE_ROWS rows of an item, tile(r0, rows, p, pf, pf_lines) multiplies rows r0 ..
// r0 + rows - 1 by panel p, meanwhile prefetching pf_lines cache lines from pf on (its share
// of the next item's panel). row_bytes: bytes of one row of x; panel_bytes: of one panel.
template <typename Tile>
inline void for_each_panel_tile(int64_t m, int64_t row_bytes, const char* packed,
                                int64_t panels, int64_t panel_bytes, Tile&& tile) {
  // as few row blocks as keep each under ~1 MB (in L2 beside a panel), of equal size: every
  // block streams the whole weight once
  const int64_t wanted = std::max<int64_t>(1, (m * row_bytes + (1 << 20) - 1) >> 20);
  const int64_t block_rows = ((m + wanted - 1) / wanted + TILE_ROWS - 1) / TILE_ROWS * TILE_ROWS;
  const int64_t blocks = (m + block_rows - 1) / block_rows;  // rounding may leave fewer: none empty
  at::parallel_for(0, blocks * panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t blk = item / panels, p = item % panels;
      const int64_t r_begin = blk * block_rows, r_end = std::min(m, r_begin + block_rows);
      const int64_t tiles = (r_end - r_begin + TILE_ROWS - 1) / TILE_ROWS;
      // the tiles of this panel share the prefetch of the next item's panel
      const bool prefetch = item + 1 < end;
      const char* next = packed + ((item + 1) % panels) * panel_bytes;
      const int64_t next_lines = (panel_bytes + 63) / 64, per_tile = (next_lines + tiles - 1) / tiles;
      for (int64_t t = 0; t < tiles; ++t) {
        const int64_t r0 = r_begin + t * TILE_ROWS, rows = std::min<int64_t>(TILE_ROWS, r_end - r0);
        const int64_t first = t * per_tile;
        const int64_t pf_lines = prefetch ? std::max<int64_t>(0, std::min(per_tile, next_lines - first)) : 0;
        tile(r0, rows, p, next + 64 * first, pf_lines);
      }
    }
  });
}

// out [m, n] = x [m, k] @ W.T (+ bias [n]), W packed as [P, k, PANEL] panels (see above); or,
// gated, out [m, n] = silu(x @ gate.T) * (x @ up.T) with HALF_PANEL gate columns and their up
// columns per panel.
inline void packed_linear_rows(const float* x, const float* packed, const float* bias,
                               float* out, int64_t m, int64_t k, int64_t n, int64_t panels,
                               bool gated) {
  const int64_t per_panel = gated ? HALF_PANEL : PANEL;  // output columns of one panel
  const int64_t panel_size = k * PANEL;
  for_each_panel_tile(m, k * 4, reinterpret_cast<const char*>(packed), panels, panel_size * 4,
                      [&](int64_t r0, int64_t rows, int64_t p, const char* pf, int64_t pf_lines) {
    const int cols = static_cast<int>(std::min<int64_t>(per_panel, n - p * per_panel));
    const float* panel = packed + p * panel_size;
    const float* a = x + r0 * k;
    float* c = out + r0 * n + p * per_panel;
    const float* b = bias ? bias + p * PANEL : nullptr;
    dispatch_rows<TILE_ROWS>(rows, [&](auto mr) {
      if (gated)
        linear_tile<decltype(mr)::value, true>(a, panel, k, c, n, cols, b, pf, pf_lines);
      else
        linear_tile<decltype(mr)::value, false>(a, panel, k, c, n, cols, b, pf, pf_lines);
    });
  });
}

// x [M, K] float32 -> [M, N] float32 = x @ W.T (+ bias [N]), written into out_buffer's first M * N
// elements when given (the result is a view of it), W packed as [P, K, PANEL] with
// P = ceil(N / PANEL).
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
  const int64_t m = xc.size(0), k = xc.size(1);
  TORCH_CHECK(!out_buffer || (out_buffer->scalar_type() == at::kFloat && out_buffer->is_contiguous() &&
                              out_buffer->numel() >= m * n),
              "packed_linear: out_buffer must be contiguous float32 with at least M * n elements");
  // a caller's buffer spares the page faults of a fresh allocation (large ones are mmap'ed)
  Tensor out = out_buffer ? out_buffer->flatten().narrow(0, 0, m * n).view({m, n})
                          : at::empty({m, n}, xc.options());
  if (m == 0) return out;
  packed_linear_rows(xc.data_ptr<float>(), packed.data_ptr<float>(),
                     bias ? bias->data_ptr<float>() : nullptr, out.data_ptr<float>(), m, k, n,
                     packed.size(0), gated);
  return out;
}

// ---- packed_linear_bf16: bfloat16 x @ W.T with W bfloat16, prepacked in panels of pairs ----
//
// W [N, K] (K even) is stored as [P, K / 2, PANEL, 2]: for each input pair i, panel p holds
// (W[c, 2i], W[c, 2i + 1]) for its PANEL output columns c, so one 64-byte load gives 16
// columns' pairs and one vdpbf16ps (AVX512-BF16) multiplies them by a row's broadcast pair,
// accumulating in float32. The register tiling and the work split are packed_linear's. Unlike
// a oneDNN bfloat16 matmul it never re-packs the weight per call, which for the few dozen rows
// of a batched decode step costs more than the multiply (docs/performance.md).

// c [MR, cols] (row stride ldc) = a [MR, k] @ panel, in OutT (float, or bfloat16 rounded to
// nearest even); pf as in linear_tile.
template <int MR, typename OutT>
void bf16_tile(const uint16_t* a, const uint16_t* panel, int64_t k, OutT* c, int64_t ldc,
               int cols, const char* pf, int64_t pf_lines) {
  F32x16 acc[MR][3];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = acc[r][2] = F32x16::zero();
  const int64_t pairs = k / 2;
  int64_t pf_acc = 0;
  for (int64_t i = 0; i < pairs; ++i) {
    const uint16_t* w = panel + i * 2 * PANEL;
    const BF16Pairs b0 = BF16Pairs::load(w), b1 = BF16Pairs::load(w + 32),
                    b2 = BF16Pairs::load(w + 64);
    for (pf_acc += pf_lines; pf_acc >= pairs; pf_acc -= pairs, pf += 64) __builtin_prefetch(pf, 0, 2);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      uint32_t x;
      std::memcpy(&x, a + r * k + 2 * i, 4);
      acc[r][0] = dot_pairs(acc[r][0], x, b0);
      acc[r][1] = dot_pairs(acc[r][1], x, b1);
      acc[r][2] = dot_pairs(acc[r][2], x, b2);
    }
  }
  for (int r = 0; r < MR; ++r) {
    if constexpr (std::is_same_v<OutT, float>) {
      for (int j = 0; j < 3; ++j) acc[r][j].store(c + r * ldc + 16 * j, cols - 16 * j);
    } else {
      float buf[PANEL];
      for (int j = 0; j < 3; ++j) acc[r][j].store(buf + 16 * j);
      for (int j = 0; j < cols; ++j) c[r * ldc + j] = static_cast<OutT>(buf[j]);
    }
  }
}

// x [M, K] bfloat16 -> [M, N] of out_dtype (float32 or bfloat16) = x @ W.T, W bfloat16 packed
// as [P, K / 2, PANEL, 2] with P = ceil(N / PANEL) (see above), float32 accumulation; written
// into out_buffer's first M * N elements when given (as packed_linear). A row's result does
// not depend on the other rows.
Tensor packed_linear_bf16(const Tensor& x, const Tensor& packed, int64_t n,
                          at::ScalarType out_dtype, const std::optional<Tensor>& out_buffer) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.size(1) % 2 == 0,
              "packed_linear_bf16: x must be bfloat16 [M, K] with K even");
  const int64_t k = x.size(1);
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kBFloat16 &&
                  packed.is_contiguous() && packed.size(1) * 2 == k &&
                  packed.size(2) == PANEL && packed.size(3) == 2,
              "packed_linear_bf16: packed must be contiguous bfloat16 [P, K / 2, ", PANEL,
              ", 2] with x's K");
  TORCH_CHECK(n > (packed.size(0) - 1) * PANEL && n <= packed.size(0) * PANEL,
              "packed_linear_bf16: n=", n, " does not fit ", packed.size(0), " panels");
  TORCH_CHECK(out_dtype == at::kFloat || out_dtype == at::kBFloat16,
              "packed_linear_bf16: out_dtype must be float32 or bfloat16");
  Tensor xc = x.contiguous();
  const int64_t m = xc.size(0);
  TORCH_CHECK(!out_buffer || (out_buffer->scalar_type() == out_dtype &&
                              out_buffer->is_contiguous() && out_buffer->numel() >= m * n),
              "packed_linear_bf16: out_buffer must be contiguous, of out_dtype, with at least "
              "M * n elements");
  Tensor out = out_buffer ? out_buffer->flatten().narrow(0, 0, m * n).view({m, n})
                          : at::empty({m, n}, xc.options().dtype(out_dtype));
  if (m == 0) return out;
  const auto* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  const int64_t panel_size = k * PANEL;
  auto run = [&](auto* o) {
    for_each_panel_tile(m, k * 2, reinterpret_cast<const char*>(wp), packed.size(0),
                        panel_size * 2,
                        [&](int64_t r0, int64_t rows, int64_t p, const char* pf, int64_t pf_lines) {
      const int cols = static_cast<int>(std::min<int64_t>(PANEL, n - p * PANEL));
      dispatch_rows<TILE_ROWS>(rows, [&](auto mr) {
        bf16_tile<decltype(mr)::value>(xp + r0 * k, wp + p * panel_size, k, o + r0 * n + p * PANEL,
                                       n, cols, pf, pf_lines);
      });
    });
  };
  if (out_dtype == at::kFloat)
    run(out.data_ptr<float>());
  else
    run(out.data_ptr<at::BFloat16>());
  return out;
}

}  // namespace OPS_NAMESPACE
