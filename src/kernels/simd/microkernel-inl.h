// src/kernels/simd/microkernel-inl.h — the one register-blocked microkernel behind every SIMD
// attention product (forward and backward), per Highway target.
//
//   C[R rows][M lanes] (+)= Σ_{k<K} A_r[k] · B[k][M lanes],   M = kV · Lanes
//
// A is read by scalar broadcast straight from a row-major operand (a K, V, Q or dO row of the
// caller's tensor, or a P/dS buffer): element (r, k) at a[r·a_row + k·a_k]. B is a packed
// buffer of M-float rows (aligned). C lives in memory and is loaded/stored once per call; the
// accumulators stay in registers across the whole k loop.
//
// Highway "-inl" header: included once per target from a foreach_target translation unit.
#if defined(TOKENMIX_KERNELS_SIMD_MICROKERNEL_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef TOKENMIX_KERNELS_SIMD_MICROKERNEL_INL_H_
#undef TOKENMIX_KERNELS_SIMD_MICROKERNEL_INL_H_
#else
#define TOKENMIX_KERNELS_SIMD_MICROKERNEL_INL_H_
#endif

#include <cstdint>

#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace tokenmix::kernels::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// Register blocking per target: kR rows × kV vectors of accumulators.
#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
constexpr int kR = 6, kV = 4;  // 24 of 32 zmm registers: M = 64 lanes
#elif HWY_TARGET == HWY_AVX2
constexpr int kR = 3, kV = 3;  // 9 of 16 ymm registers: M = 24 lanes
#else
constexpr int kR = 2, kV = 2;  // fallback targets (not dispatched to by tokenmix)
#endif

template <int R, class D>
HWY_INLINE void MicroKernel(D d, const float* HWY_RESTRICT a, std::int64_t a_row, std::int64_t a_k,
                            const float* HWY_RESTRICT b, std::int64_t ldb, std::int64_t K,
                            float* HWY_RESTRICT c, std::int64_t ldc, bool accumulate) {
  using V = hn::Vec<D>;
  const std::int64_t N = static_cast<std::int64_t>(hn::Lanes(d));
  V acc[R][kV];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kV; ++v) acc[r][v] = accumulate ? hn::Load(d, c + r * ldc + v * N) : hn::Zero(d);
  for (std::int64_t k = 0; k < K; ++k) {
    V bv[kV];
    for (int v = 0; v < kV; ++v) bv[v] = hn::Load(d, b + k * ldb + v * N);
    for (int r = 0; r < R; ++r) {
      const V ar = hn::Set(d, a[r * a_row + k * a_k]);
      for (int v = 0; v < kV; ++v) acc[r][v] = hn::MulAdd(ar, bv[v], acc[r][v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kV; ++v) hn::Store(acc[r][v], d, c + r * ldc + v * N);
}

// C[rows][M] (+)= A B over any number of rows: blocks of kR, then one remainder block.
template <int R = kR, class D>
HWY_INLINE void GemmRows(D d, std::int64_t rows, const float* a, std::int64_t a_row, std::int64_t a_k,
                         const float* b, std::int64_t ldb, std::int64_t K, float* c, std::int64_t ldc,
                         bool accumulate) {
  if constexpr (R == kR) {
    for (; rows >= kR; rows -= kR, a += kR * a_row, c += kR * ldc) {
      MicroKernel<kR>(d, a, a_row, a_k, b, ldb, K, c, ldc, accumulate);
    }
  }
  if constexpr (R > 1) {
    if (rows == R - 1) {
      MicroKernel<R - 1>(d, a, a_row, a_k, b, ldb, K, c, ldc, accumulate);
    } else {
      GemmRows<R - 1>(d, rows, a, a_row, a_k, b, ldb, K, c, ldc, accumulate);
    }
  }
}

// Copies rows [0, rows) of a strided matrix (row stride `ld`, column stride `cs`) transposed
// into dst[col][lane0 + row] (dst row length M), scaling by `scale`. Used to pack Qᵀ, dOᵀ, Kᵀ, Vᵀ.
HWY_INLINE void PackTransposed(const float* src, std::int64_t ld, std::int64_t cs, std::int64_t rows,
                               std::int64_t cols, float scale, float* dst, std::int64_t M) {
  for (std::int64_t r = 0; r < rows; ++r) {
    const float* row = src + r * ld;
    for (std::int64_t x = 0; x < cols; ++x) dst[x * M + r] = scale * row[x * cs];
  }
}

}  // namespace tokenmix::kernels::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // include guard toggle
