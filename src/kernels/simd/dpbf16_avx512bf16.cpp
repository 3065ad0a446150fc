// src/kernels/simd/dpbf16_avx512bf16.cpp — see dpbf16.hpp. x86-64 only (src/CMakeLists.txt),
// compiled for the baseline; every function after the includes carries the AVX-512 + BF16 target
// (HWY_PUSH_ATTRIBUTES: docs/design.md, "ISA confinement"). Nothing here runs unless dispatch
// chose the avx512_bf16 path (CPUID AVX512_BF16 + OS ZMM state).
//
// vdpbf16ps (_mm512_dpbf16_ps): acc[i] += a[2i]·b[2i] + a[2i+1]·b[2i+1] in fp32; a product of
// two bf16 values is exact in fp32. The instruction treats bf16 denormal inputs as zero and
// flushes denormal results (documented in docs/design.md).
#include <immintrin.h>

#include <cstring>

#include "hwy/base.h"  // HWY_PUSH_ATTRIBUTES
#include "kernels/simd/dpbf16.hpp"

HWY_PUSH_ATTRIBUTES("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")

namespace tokenmix::kernels::dpbf16 {
namespace {

// One block of R rows × 64 lanes: 4R accumulators, 4 B vectors and 1 broadcast (R = 6: 29 of
// 32 zmm registers), the same blocking as the fp32 AVX-512 microkernel.
template <int R>
inline void Block(const std::uint16_t* a, std::int64_t a_row, const std::uint16_t* b,
                  std::int64_t pairs, float* c, std::int64_t ldc, bool accumulate,
                  const float* c_scale, float out_scale) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 4; ++v)
      acc[r][v] = accumulate ? _mm512_loadu_ps(c + r * ldc + v * 16) : _mm512_setzero_ps();
  if (accumulate && c_scale != nullptr) {
    for (int v = 0; v < 4; ++v) {
      const __m512 s = _mm512_loadu_ps(c_scale + v * 16);
      for (int r = 0; r < R; ++r) acc[r][v] = _mm512_mul_ps(acc[r][v], s);
    }
  }
  for (std::int64_t p = 0; p < pairs; ++p) {
    __m512bh bv[4];
    for (int v = 0; v < 4; ++v) bv[v] = (__m512bh)_mm512_loadu_si512(b + (p * kLanes + v * 16) * 2);
    for (int r = 0; r < R; ++r) {
      std::int32_t pair;  // A[r][2p], A[r][2p + 1] as one 32-bit broadcast
      std::memcpy(&pair, a + r * a_row + 2 * p, sizeof pair);
      const __m512bh av = (__m512bh)_mm512_set1_epi32(pair);
      for (int v = 0; v < 4; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], av, bv[v]);
    }
  }
  const __m512 os = _mm512_set1_ps(out_scale);
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 4; ++v)
      _mm512_storeu_ps(c + r * ldc + v * 16,
                       out_scale == 1.0f ? acc[r][v] : _mm512_mul_ps(acc[r][v], os));
}

}  // namespace

void GemmRows(std::int64_t rows, const std::uint16_t* a, std::int64_t a_row, const std::uint16_t* b,
              std::int64_t pairs, float* c, std::int64_t ldc, bool accumulate, const float* c_scale,
              float out_scale) {
  constexpr int kR = 6;
  for (; rows >= kR; rows -= kR, a += kR * a_row, c += kR * ldc)
    Block<kR>(a, a_row, b, pairs, c, ldc, accumulate, c_scale, out_scale);
  switch (rows) {
    case 5:
      return Block<5>(a, a_row, b, pairs, c, ldc, accumulate, c_scale, out_scale);
    case 4:
      return Block<4>(a, a_row, b, pairs, c, ldc, accumulate, c_scale, out_scale);
    case 3:
      return Block<3>(a, a_row, b, pairs, c, ldc, accumulate, c_scale, out_scale);
    case 2:
      return Block<2>(a, a_row, b, pairs, c, ldc, accumulate, c_scale, out_scale);
    case 1:
      return Block<1>(a, a_row, b, pairs, c, ldc, accumulate, c_scale, out_scale);
    default:
      return;
  }
}

void PackPairs(const float* src, std::int64_t n, std::uint16_t* dst) {
  // vcvtne2ps2bf16 rounds two fp32 vectors to 32 bf16 (nearest even, NaN stays NaN): [lo | hi];
  // vpermw then interleaves them into pairs (lo[i], hi[i]).
  alignas(64) static constexpr std::uint16_t kInterleave[32] = {
      0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
      8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i idx = _mm512_load_si512(kInterleave);
  for (std::int64_t p = 0; p < (n + 1) / 2; ++p) {
    const float* lo = src + 2 * p * kLanes;
    const bool has_hi = 2 * p + 1 < n;
    for (int v = 0; v < 4; ++v) {
      const __m512 x0 = _mm512_loadu_ps(lo + v * 16);
      const __m512 x1 = has_hi ? _mm512_loadu_ps(lo + kLanes + v * 16) : _mm512_setzero_ps();
      const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(x1, x0);  // x0 → low half, x1 → high
      _mm512_storeu_si512(dst + (p * kLanes + v * 16) * 2, _mm512_permutexvar_epi16(idx, both));
    }
  }
}

}  // namespace tokenmix::kernels::dpbf16

HWY_POP_ATTRIBUTES
