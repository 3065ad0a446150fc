// src/kernels/simd/small_gemm_hwy.cpp — the layer's few-row projection chunk (kernels/
// small_gemm.hpp) with Highway, per target (x86: AVX-512 = AVX3, AVX2; AArch64: NEON), and the
// portable one. The decode step's projections read 168 MB of fp32 weights per token for a
// Llama-3-8B-shaped layer: the chunk is bound by that stream, and the portable loop (the x86-64
// baseline: 4-lane SSE2, one core at about half of what it can read on AMD Zen 5) by its
// arithmetic (docs/performance.md, 2026-12-01).
//
// Per group of G ≤ 8 reduction rows: for each row m of A and each vector of columns j, P[m][j] is
// loaded, the G terms fl(A[m][k] · B[k][j]) are added to it one after the other, in k order, and
// it is stored — P stays in L1 while the B rows stream through once per m. Multiply and add are
// separate instructions and this file is compiled with -ffp-contract=off (src/CMakeLists.txt),
// so no FMA fuses them: the same operations as the portable loop, element by element.
// Highway's per-target re-inclusion: these includes must follow foreach_target.h, in order.
// clang-format off
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/simd/small_gemm_hwy.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
// clang-format: the includes below must follow foreach_target.h
#include "hwy/highway.h"
// clang-format on

#include <algorithm>
#include <cstdint>
#include <string>

#include "kernels/simd/work_units.hpp"
#include "kernels/small_gemm.hpp"
#include "tokenmix/error.hpp"

HWY_BEFORE_NAMESPACE();
namespace tokenmix::kernels::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

constexpr std::int64_t kGroup = 8;  // reduction rows added per pass over a row of P

// P[m][j] ← P[m][j] + Σ_{r < G} fl(a[r] · B[r][j]), term by term, for one row m of P.
template <int G>
HWY_INLINE void AddRows(const float* HWY_RESTRICT a, const float* HWY_RESTRICT b, std::int64_t n,
                        std::int64_t g, float* HWY_RESTRICT p) {
  const hn::ScalableTag<float> d;
  const std::int64_t N = static_cast<std::int64_t>(hn::Lanes(d));
  const std::int64_t rows = G > 0 ? G : g;
  std::int64_t j = 0;
  for (; j + N <= n; j += N) {
    auto acc = hn::LoadU(d, p + j);
    for (std::int64_t r = 0; r < rows; ++r)
      acc = hn::Add(acc, hn::Mul(hn::Set(d, a[r]), hn::LoadU(d, b + r * n + j)));
    hn::StoreU(acc, d, p + j);
  }
  for (; j < n; ++j) {
    float acc = p[j];
    for (std::int64_t r = 0; r < rows; ++r) acc = acc + a[r] * b[r * n + j];
    p[j] = acc;
  }
}

void SmallGemmChunkSimd(std::int64_t M, std::int64_t K, const float* A, const float* B,
                        std::int64_t n, std::int64_t k0, std::int64_t k1, float* P) {
  std::fill(P, P + M * n, 0.0f);
  for (std::int64_t k = k0; k < k1; k += kGroup) {
    const std::int64_t g = std::min(kGroup, k1 - k);
    for (std::int64_t m = 0; m < M; ++m) {
      if (g == kGroup) {
        AddRows<kGroup>(A + m * K + k, B + k * n, n, g, P + m * n);
      } else {
        AddRows<0>(A + m * K + k, B + k * n, n, g, P + m * n);
      }
    }
  }
}

}  // namespace tokenmix::kernels::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace tokenmix::kernels {

void small_gemm_chunk_portable(std::int64_t M, std::int64_t K, const float* A, const float* B,
                               std::int64_t n, std::int64_t k0, std::int64_t k1, float* P) {
  std::fill(P, P + M * n, 0.0f);
  for (std::int64_t k = k0; k < k1; k += 4) {
    const float* b0 = B + k * n;
    for (std::int64_t m = 0; m < M; ++m) {
      const float* a = A + m * K + k;
      float* __restrict pm = P + m * n;
      if (k + 4 <= k1) {  // four rows per pass over P's row: the same sums as one by one
        const float a0 = a[0], a1 = a[1], a2 = a[2], a3 = a[3];
        const float* __restrict r0 = b0;
        const float* __restrict r1 = b0 + n;
        const float* __restrict r2 = b0 + 2 * n;
        const float* __restrict r3 = b0 + 3 * n;
        for (std::int64_t j = 0; j < n; ++j)
          pm[j] = (((pm[j] + a0 * r0[j]) + a1 * r1[j]) + a2 * r2[j]) + a3 * r3[j];
      } else {
        for (std::int64_t r = 0; r < k1 - k; ++r) {
          const float ar = a[r];
          const float* __restrict br = b0 + r * n;
          for (std::int64_t j = 0; j < n; ++j) pm[j] = pm[j] + ar * br[j];
        }
      }
    }
  }
}

SmallGemmChunk small_gemm_chunk(Isa isa) {
  SmallGemmChunk fn = nullptr;
  switch (isa) {
    case Isa::portable:
      return &small_gemm_chunk_portable;
    case Isa::avx2:
      fn = TOKENMIX_SIMD_AVX2(SmallGemmChunkSimd);
      break;
    case Isa::avx512:
    case Isa::avx512_bf16:
      fn = TOKENMIX_SIMD_AVX512(SmallGemmChunkSimd);
      break;
    case Isa::neon:
      fn = TOKENMIX_SIMD_NEON(SmallGemmChunkSimd);
      break;
    case Isa::automatic:
      break;
  }
  if (fn == nullptr) {
    throw UnsupportedError("small_gemm_chunk: no projection kernel for ISA path '" +
                           std::string(to_string(isa)) + "' in this build");
  }
  return fn;
}

}  // namespace tokenmix::kernels
#endif  // HWY_ONCE
