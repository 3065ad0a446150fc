// tests/unit/test_small_gemm.cpp — the layer's few-row projection chunk (kernels/small_gemm.hpp)
// on every ISA path: bitwise the portable loop's result (the same multiplies and adds in the same
// order, no fused multiply-add), and the float64 product at fp32 rounding level, over row counts
// 1..13 (below and from the SIMD path's 4-row block on, past its 8-row panels of A), widths that
// straddle every vector width and its 2-vector column blocks (a scalar tail), and reduction ranges
// that straddle the SIMD path's 8-row groups and 128-row panels and the portable loop's 4-row
// groups; P's rows n floats apart and
// small_gemm_row_stride(n) apart (the layer's). P is poisoned first: the chunk writes the first
// n elements of each row, and the padding after them must stay poisoned.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "kernels/small_gemm.hpp"
#include "test_util.hpp"
#include "tokenmix/error.hpp"

namespace tokenmix::testing {
namespace {

class SmallGemmChunk : public PerIsaTest {};

TEST_P(SmallGemmChunk, BitwisePortableAndFloat64AtFp32Level) {
  const kernels::SmallGemmChunk simd = kernels::small_gemm_chunk(GetParam());
  // [k0, k1): empty, shorter than a group, exact groups, groups plus a remainder (K = 45); more
  // than one 128-row panel of A, whole or from and to odd rows (K = 300).
  using Ranges = std::vector<std::pair<std::int64_t, std::int64_t>>;
  const std::pair<std::int64_t, Ranges> cases[] = {
      {45, {{0, 0}, {0, 1}, {3, 6}, {0, 8}, {5, 18}, {0, 45}, {2, 45}}},
      {300, {{0, 300}, {7, 291}, {128, 256}}}};
  for (const auto& [K, ranges] : cases) {
    // Rows below and from kBlockRows (4) on, up to and past the 8 rows of a panel (8 + 3: the
    // rest row by row; 8 + 5: a second panel).
    for (std::int64_t M : {1, 3, 4, 5, 8, 11, 13}) {
      for (std::int64_t n : {1, 7, 16, 33, 48, 64, 131}) {
        const std::vector<float> A = testkit::random_normal(static_cast<std::size_t>(M * K), 7);
        const std::vector<float> B = testkit::random_normal(static_cast<std::size_t>(K * n), 8);
        for (auto [k0, k1] : ranges) {
          for (const std::int64_t ldp : {n, kernels::small_gemm_row_stride(n)}) {
            SCOPED_TRACE("K=" + std::to_string(K) + " M=" + std::to_string(M) +
                         " n=" + std::to_string(n) + " ldp=" + std::to_string(ldp) + " k=[" +
                         std::to_string(k0) + "," + std::to_string(k1) + ")");
            std::vector<float> got(static_cast<std::size_t>(M * ldp), kPoison);
            std::vector<float> want(got.size(), kPoison);
            simd(M, K, A.data(), B.data(), n, k0, k1, got.data(), ldp);
            kernels::small_gemm_chunk_portable(M, K, A.data(), B.data(), n, k0, k1, want.data(),
                                               ldp);
            double max_err = 0.0, max_ref = 0.0;
            for (std::int64_t m = 0; m < M; ++m) {
              for (std::int64_t j = n; j < ldp; ++j) {  // the padding: never written
                const std::size_t i = static_cast<std::size_t>(m * ldp + j);
                ASSERT_EQ(std::bit_cast<std::uint32_t>(got[i]),
                          std::bit_cast<std::uint32_t>(kPoison))
                    << "padding (" << m << ", " << j << ") written";
                ASSERT_EQ(std::bit_cast<std::uint32_t>(want[i]),
                          std::bit_cast<std::uint32_t>(kPoison))
                    << "padding (" << m << ", " << j << ") written by the portable loop";
              }
              for (std::int64_t j = 0; j < n; ++j) {
                const std::size_t i = static_cast<std::size_t>(m * ldp + j);
                ASSERT_EQ(std::bit_cast<std::uint32_t>(got[i]),
                          std::bit_cast<std::uint32_t>(want[i]))
                    << "element (" << m << ", " << j << "): " << got[i] << " vs portable "
                    << want[i];
                double ref = 0.0, mag = 0.0;
                for (std::int64_t k = k0; k < k1; ++k) {
                  const double t = double(A[static_cast<std::size_t>(m * K + k)]) *
                                   double(B[static_cast<std::size_t>(k * n + j)]);
                  ref += t;
                  mag += std::fabs(t);
                }
                // fp32 summation of k1 − k0 terms: within (k1 − k0 + 1) · 2^−24 of Σ|terms|.
                EXPECT_LE(std::fabs(got[i] - ref), (k1 - k0 + 1) * 0x1.0p-24 * mag + 1e-30)
                    << "element (" << m << ", " << j << ")";
                max_err = std::max(max_err, std::fabs(got[i] - ref));
                max_ref = std::max(max_ref, std::fabs(ref));
              }
            }
            if (k1 > k0) {
              EXPECT_LE(max_err, 1e-5 * max_ref);
            }
          }
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllIsas, SmallGemmChunk, AllIsas(), IsaName);

// The layer's row stride for P: whole lines, never a multiple of 1 KiB (rows 4 KiB apart alias).
TEST(SmallGemmRowStride, WholeLinesNeverAMultipleOfOneKiB) {
  EXPECT_EQ(kernels::small_gemm_row_stride(1), 16);
  EXPECT_EQ(kernels::small_gemm_row_stride(16), 16);
  EXPECT_EQ(kernels::small_gemm_row_stride(131), 144);
  EXPECT_EQ(kernels::small_gemm_row_stride(256), 272);
  EXPECT_EQ(kernels::small_gemm_row_stride(1024), 1040);
  EXPECT_EQ(kernels::small_gemm_row_stride(4096), 4112);
  for (std::int64_t n = 1; n <= 5000; ++n) {
    const std::int64_t ldp = kernels::small_gemm_row_stride(n);
    ASSERT_GE(ldp, n);
    ASSERT_EQ(ldp % 16, 0) << n;
    ASSERT_NE(ldp % 256, 0) << n;
    ASSERT_LE(ldp - n, 31) << n;
  }
}

TEST(SmallGemmChunkErrors, AutomaticIsNotAPath) {
  EXPECT_THROW(kernels::small_gemm_chunk(Isa::automatic), UnsupportedError);
}

}  // namespace
}  // namespace tokenmix::testing
