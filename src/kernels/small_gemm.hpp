// src/kernels/small_gemm.hpp — the reduction chunk of the layer's few-row projections
// (src/model/layer.cpp, small_gemm: a decode step's Q, K, V and O = U W for M ≤ 8 rows), per ISA
// path. One chunk of reduction rows [k0, k1):
//
//   P[m][j] = Σ_{k0 ≤ k < k1} A[m][k] · B[k][j]      m < M, j < n   (4.1 / 4.5, one part)
//
// summed strictly in k order from P = 0, each term a rounded product added with a separate
// rounding (no fused multiply-add): P ← P + fl(a·b). Every path computes exactly these operations
// per element, so its bits are the portable loop's on every ISA and for any vector width (the
// SIMD path only reads B rows with wider vectors). The layer's sum of the chunks, in chunk order,
// is the caller's.
#pragma once

#include <cstdint>

#include "tokenmix/runtime.hpp"

namespace tokenmix::kernels {

/// P [M][n] (row m at P + m · ldp, ldp ≥ n) ← A[:, k0:k1] · B[k0:k1, :] as above; A [M][K]
/// row-major, B [K][n] row-major. The first n elements of each row of P are written (not
/// accumulated into); the ldp − n after them are not touched.
using SmallGemmChunk = void (*)(std::int64_t M, std::int64_t K, const float* A, const float* B,
                                std::int64_t n, std::int64_t k0, std::int64_t k1, float* P,
                                std::int64_t ldp);

/// The portable chunk (plain C++, the reference for the others).
void small_gemm_chunk_portable(std::int64_t M, std::int64_t K, const float* A, const float* B,
                               std::int64_t n, std::int64_t k0, std::int64_t k1, float* P,
                               std::int64_t ldp);

/// The row stride the layer gives P for n columns: n rounded up to whole 64-byte lines, and one
/// line more where that is a multiple of 1 KiB. Rows a multiple of 4 KiB apart (n = 4096: 16 KiB)
/// fall in the same L1 sets and alias in the store-to-load forwarding of x86 cores: the SIMD
/// chunk's 4–8-row path, which loads and stores a line of every row of P in turn, spent 40 % of
/// an 8-row step in the load after those stores on AMD Zen 4 (docs/performance.md, D-layer-5).
inline std::int64_t small_gemm_row_stride(std::int64_t n) {
  const std::int64_t lines = (n + 15) / 16 * 16;
  return lines % 256 == 0 ? lines + 16 : lines;
}

/// The chunk of a resolved path (not Isa::automatic): the SIMD one of avx2 / avx512 /
/// avx512_bf16 / neon (Highway, src/kernels/simd/small_gemm_hwy.cpp), the portable one for
/// portable. Throws UnsupportedError if this build lacks the path's target.
SmallGemmChunk small_gemm_chunk(Isa isa);

}  // namespace tokenmix::kernels
