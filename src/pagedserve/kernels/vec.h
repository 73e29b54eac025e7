// F32x16, the one SIMD type of the CPU kernels: 16 floats, an __m512 under AVX-512 and
// otherwise the target's own vectors (two of 8 floats with AVX, four of 4 with SSE or NEON)
// through the GCC/Clang vector extension. The kernels are written once against it; the
// instruction-set branches live only in this file.
//
// Not a plain float[16] for the portable build: GCC copies such a struct through the stack
// at every returned value, and lowers a 64-byte vector extension type without AVX-512 to
// stack traffic as well; vectors of the target's width stay in registers.
//
// Every function is force-inlined: a kernel's accumulators (arrays of F32x16) must stay in
// registers, which needs the compiler to see through each call.
#pragma once

#include "ops.h"  // OPS_NAMESPACE: each build's copy of this type is its own symbol

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <cstdint>

#define VEC_INLINE inline __attribute__((always_inline))

namespace OPS_NAMESPACE {

#if defined(__AVX2__)
// 8 bytes of int4 codes (channel 2i in byte i's low nibble, 2i + 1 in its high one) as 16
// bytes, one code each, in channel order
VEC_INLINE __m128i unpack_nibbles(const uint8_t* p) {
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  const __m128i low = _mm_set1_epi8(0x0F);
  return _mm_unpacklo_epi8(_mm_and_si128(b, low), _mm_and_si128(_mm_srli_epi16(b, 4), low));
}
#endif

#if defined(__AVX512F__)

struct F32x16 {
  __m512 v;

  static VEC_INLINE F32x16 zero() { return {_mm512_setzero_ps()}; }
  static VEC_INLINE F32x16 set1(float x) { return {_mm512_set1_ps(x)}; }
  static VEC_INLINE F32x16 load(const float* p) { return {_mm512_loadu_ps(p)}; }
  // p[0 .. n) and zeros after it (n may be <= 0 or >= 16); never reads past p + n
  static VEC_INLINE F32x16 load(const float* p, int64_t n) {
    if (n >= 16) return load(p);
    return {_mm512_maskz_loadu_ps(mask(n), p)};
  }
  // 16 int8 as float
  static VEC_INLINE F32x16 load(const int8_t* p) {
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q))};
  }
  // 16 fp8 e4m3 codes as float: the byte sign-extended and moved up by 20 bits, masked to
  // its sign and 7 exponent+mantissa bits, is a float32 of the same mantissa and an exponent
  // 120 too small (subnormals included), which a multiply by 2**120 corrects
  static VEC_INLINE F32x16 load_fp8(const uint8_t* p) {
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    __m512i x = _mm512_slli_epi32(_mm512_cvtepi8_epi32(q), 20);
    x = _mm512_and_si512(x, _mm512_set1_epi32(static_cast<int32_t>(0x87F00000u)));
    return {_mm512_mul_ps(_mm512_castsi512_ps(x), _mm512_set1_ps(0x1p120f))};
  }
  // 16 int4 codes from 8 bytes (channel 2i in byte i's low nibble, 2i + 1 in its high one),
  // as float code (0 .. 15)
  static VEC_INLINE F32x16 load_uint4(const uint8_t* p) {
    return {_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(unpack_nibbles(p)))};
  }
  VEC_INLINE void store(float* p) const { _mm512_storeu_ps(p, v); }
  // the first n lanes only (none for n <= 0)
  VEC_INLINE void store(float* p, int64_t n) const {
    if (n >= 16)
      store(p);
    else
      _mm512_mask_storeu_ps(p, mask(n), v);
  }

  friend VEC_INLINE F32x16 operator+(F32x16 a, F32x16 b) { return {_mm512_add_ps(a.v, b.v)}; }
  friend VEC_INLINE F32x16 operator*(F32x16 a, F32x16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
  // a * b + c
  friend VEC_INLINE F32x16 fma(F32x16 a, F32x16 b, F32x16 c) {
    return {_mm512_fmadd_ps(a.v, b.v, c.v)};
  }
  // per lane a > b ? a : b, so b when either is NaN (vmaxps's rule)
  friend VEC_INLINE F32x16 max(F32x16 a, F32x16 b) { return {_mm512_max_ps(a.v, b.v)}; }
  friend VEC_INLINE float reduce_add(F32x16 a) { return _mm512_reduce_add_ps(a.v); }
  friend VEC_INLINE float reduce_max(F32x16 a) { return _mm512_reduce_max_ps(a.v); }
  // out[0 .. 4) = the sums of a, b, c, d: halves added, then two rounds of hadd, sharing the
  // shuffles that four separate reduce_adds would each do
  friend VEC_INLINE void reduce_add4(F32x16 a, F32x16 b, F32x16 c, F32x16 d, float* out) {
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(halves(a), halves(b)),
                                    _mm256_hadd_ps(halves(c), halves(d)));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
  }

 private:
  static VEC_INLINE __mmask16 mask(int64_t n) {
    return n <= 0 ? 0 : static_cast<__mmask16>((1u << n) - 1);
  }
  static VEC_INLINE __m256 halves(F32x16 a) {  // low 8 lanes + high 8 lanes
    return _mm256_add_ps(_mm512_castps512_ps256(a.v),
                         _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a.v), 1)));
  }
};

#else  // 16 floats as the target's own vectors (GCC/Clang vector extension): two of 8 with
        // AVX, four of 4 otherwise (SSE, NEON); each operation is a loop over them

#if defined(__AVX__)
constexpr int VEC_PART = 8;
#else
constexpr int VEC_PART = 4;
#endif
constexpr int VEC_PARTS = 16 / VEC_PART;
typedef float PartF32 __attribute__((vector_size(4 * VEC_PART)));

struct F32x16 {
  PartF32 v[VEC_PARTS];

  static VEC_INLINE F32x16 zero() {
    F32x16 r;
    for (int j = 0; j < VEC_PARTS; ++j) r.v[j] = PartF32{};
    return r;
  }
  static VEC_INLINE F32x16 set1(float x) {
    F32x16 r;
    for (int j = 0; j < VEC_PARTS; ++j) r.v[j] = x - PartF32{};  // x - 0 keeps -0
    return r;
  }
  static VEC_INLINE F32x16 load(const float* p) {
    F32x16 r;
    for (int j = 0; j < VEC_PARTS; ++j) __builtin_memcpy(&r.v[j], p + j * VEC_PART, sizeof r.v[j]);
    return r;
  }
  static VEC_INLINE F32x16 load(const float* p, int64_t n) {
    if (n >= 16) return load(p);
    float lanes[16] = {};
    for (int l = 0; l < n; ++l) lanes[l] = p[l];
    return load(lanes);
  }
  static VEC_INLINE F32x16 load(const int8_t* p) {
#if defined(__AVX2__)  // GCC leaves the widening int8 -> float of 16 lanes scalar
    F32x16 r;
    for (int j = 0; j < 2; ++j) {
      const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * j));
      r.v[j] = reinterpret_cast<PartF32>(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)));
    }
    return r;
#else
    float lanes[16];
    for (int l = 0; l < 16; ++l) lanes[l] = p[l];
    return load(lanes);
#endif
  }
  static VEC_INLINE F32x16 load_fp8(const uint8_t* p) {
    float lanes[16];
    for (int l = 0; l < 16; ++l) {
      const uint32_t bits = (static_cast<uint32_t>(static_cast<int32_t>(
                                 static_cast<int8_t>(p[l]))) << 20) & 0x87F00000u;
      float f;
      __builtin_memcpy(&f, &bits, sizeof f);
      lanes[l] = f * 0x1p120f;
    }
    return load(lanes);
  }
  static VEC_INLINE F32x16 load_uint4(const uint8_t* p) {
#if defined(__AVX2__)  // GCC leaves the nibbles' widening scalar too
    const __m128i b = unpack_nibbles(p);
    F32x16 r;
    r.v[0] = reinterpret_cast<PartF32>(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b)));
    r.v[1] = reinterpret_cast<PartF32>(
        _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(b, 8))));
    return r;
#else
    float lanes[16];
    for (int l = 0; l < 8; ++l) {
      lanes[2 * l] = static_cast<float>(p[l] & 15);
      lanes[2 * l + 1] = static_cast<float>(p[l] >> 4);
    }
    return load(lanes);
#endif
  }
  VEC_INLINE void store(float* p) const {
    for (int j = 0; j < VEC_PARTS; ++j) __builtin_memcpy(p + j * VEC_PART, &v[j], sizeof v[j]);
  }
  VEC_INLINE void store(float* p, int64_t n) const {
    if (n >= 16) return store(p);
    float lanes[16];
    store(lanes);
    for (int l = 0; l < n; ++l) p[l] = lanes[l];
  }

  friend VEC_INLINE F32x16 operator+(F32x16 a, F32x16 b) {
    for (int j = 0; j < VEC_PARTS; ++j) a.v[j] += b.v[j];
    return a;
  }
  friend VEC_INLINE F32x16 operator*(F32x16 a, F32x16 b) {
    for (int j = 0; j < VEC_PARTS; ++j) a.v[j] *= b.v[j];
    return a;
  }
  // a multiply and an add, fused where the target has FMA (GCC contracts them by default in
  // C++): std::fma would be a library call on a target without it
  friend VEC_INLINE F32x16 fma(F32x16 a, F32x16 b, F32x16 c) {
    for (int j = 0; j < VEC_PARTS; ++j) c.v[j] += a.v[j] * b.v[j];
    return c;
  }
  friend VEC_INLINE F32x16 max(F32x16 a, F32x16 b) {
    for (int j = 0; j < VEC_PARTS; ++j) a.v[j] = a.v[j] > b.v[j] ? a.v[j] : b.v[j];
    return a;
  }
  friend VEC_INLINE float reduce_add(F32x16 a) {
    PartF32 s = a.v[0];
    for (int j = 1; j < VEC_PARTS; ++j) s += a.v[j];
    float r = s[0];
    for (int l = 1; l < VEC_PART; ++l) r += s[l];
    return r;
  }
  friend VEC_INLINE float reduce_max(F32x16 a) {
    PartF32 s = a.v[0];
    for (int j = 1; j < VEC_PARTS; ++j) s = s > a.v[j] ? s : a.v[j];
    float r = s[0];
    for (int l = 1; l < VEC_PART; ++l) r = r > s[l] ? r : s[l];
    return r;
  }
  friend VEC_INLINE void reduce_add4(F32x16 a, F32x16 b, F32x16 c, F32x16 d, float* out) {
    out[0] = reduce_add(a);
    out[1] = reduce_add(b);
    out[2] = reduce_add(c);
    out[3] = reduce_add(d);
  }
};

#endif

// 16 pairs of bfloat16 weights (32 values, 64 bytes; pair l feeds output lane l), for dot
// products with a pair of bfloat16 activations (packed_linear_bf16). With AVX512-BF16 the
// pairs stay packed for ``vdpbf16ps``; elsewhere they are widened once per load, even and odd
// members apart, so that every row of a tile reuses them.
struct BF16Pairs {
#if defined(__AVX512BF16__)
  __m512i v;
  static VEC_INLINE BF16Pairs load(const uint16_t* p) { return {_mm512_loadu_si512(p)}; }
#else
  F32x16 even, odd;
  static VEC_INLINE BF16Pairs load(const uint16_t* p) {
    float e[16], o[16];
    for (int l = 0; l < 16; ++l) {
      const uint32_t lo = static_cast<uint32_t>(p[2 * l]) << 16,
                     hi = static_cast<uint32_t>(p[2 * l + 1]) << 16;
      __builtin_memcpy(&e[l], &lo, 4);
      __builtin_memcpy(&o[l], &hi, 4);
    }
    return {F32x16::load(e), F32x16::load(o)};
  }
#endif
};

// acc[l] + x0 * w.even[l] + x1 * w.odd[l], for the bfloat16 pair x (x0 in its low 16 bits):
// the products are exact in float32, the sums rounded to float32 (``vdpbf16ps``, or two
// FMAs elsewhere; the two may round differently, each the same for every row)
VEC_INLINE F32x16 dot_pairs(F32x16 acc, uint32_t x, BF16Pairs w) {
#if defined(__AVX512BF16__)
  return {_mm512_dpbf16_ps(acc.v, (__m512bh)_mm512_set1_epi32(static_cast<int>(x)),
                           (__m512bh)w.v)};
#else
  const uint32_t lo = x << 16, hi = x & 0xFFFF0000u;
  float x0, x1;
  __builtin_memcpy(&x0, &lo, 4);
  __builtin_memcpy(&x1, &hi, 4);
  return fma(F32x16::set1(x1), w.odd, fma(F32x16::set1(x0), w.even, acc));
#endif
}

// 16 int4 codes (see load_uint4) as float code - 8, the signed value of a symmetric code
VEC_INLINE F32x16 load_int4(const uint8_t* p) {
  return F32x16::load_uint4(p) + F32x16::set1(-8.f);
}

// One group of 32 4-bit codes, widened to int16, for int4 x int16 dot products (int4_linear):
// from 16 bytes, code i in byte i's low nibble and code 16 + i in its high one.
struct Q4Group {
#if defined(__AVX2__)
  __m256i lo, hi;  // codes 0 .. 15 and 16 .. 31
  static VEC_INLINE Q4Group load(const uint8_t* p) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m128i low = _mm_set1_epi8(0x0F);
    return {_mm256_cvtepu8_epi16(_mm_and_si128(b, low)),
            _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(b, 4), low))};
  }
#else
  int16_t v[32];
  static VEC_INLINE Q4Group load(const uint8_t* p) {
    Q4Group g;
    for (int i = 0; i < 16; ++i) g.v[i] = p[i] & 15, g.v[16 + i] = p[i] >> 4;
    return g;
  }
#endif
};

// Float lanes whose total is a sum of scaled int4 x int16 group dot products (int4_linear).
struct Q4Acc {
#if defined(__AVX2__)
  __m256 v;
  static VEC_INLINE Q4Acc zero() { return {_mm256_setzero_ps()}; }
  // += scale * sum_i g_i * x_i for 32 int16 x: vpmaddwd's pairs of int16 products summed to
  // int32 (at most 32 * 15 * 32767 in all, no overflow)
  VEC_INLINE void add(const Q4Group& g, const int16_t* x, float scale) {
    const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
    const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 16));
    const __m256i sums = _mm256_add_epi32(_mm256_madd_epi16(g.lo, x0), _mm256_madd_epi16(g.hi, x1));
    v = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_set1_ps(scale), v);
  }
  VEC_INLINE float total() const {
    const __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
  }
#else
  float v;
  static VEC_INLINE Q4Acc zero() { return {0.f}; }
  VEC_INLINE void add(const Q4Group& g, const int16_t* x, float scale) {
    int32_t dot = 0;
    for (int i = 0; i < 32; ++i) dot += static_cast<int32_t>(g.v[i]) * x[i];
    v += static_cast<float>(dot) * scale;
  }
  VEC_INLINE float total() const { return v; }
#endif
};

// Calls f(i, 16) for each whole vector of [0, n) and f(i, n - i) for the tail, if any: written
// with the partial loads and stores, f's body serves both, and on whole vectors (a constant
// 16) they compile to plain ones.
template <typename F>
VEC_INLINE void for_each_vec(int64_t n, F&& f) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) f(i, int64_t{16});
  if (i < n) f(i, n - i);
}

}  // namespace OPS_NAMESPACE
