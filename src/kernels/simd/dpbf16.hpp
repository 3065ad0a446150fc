// src/kernels/simd/dpbf16.hpp — the AVX512-BF16 products of the bf16 forward (path
// avx512_bf16): `vdpbf16ps`, two bf16 products per fp32 lane accumulated in fp32, on 64 lanes
// (4 zmm). Highway 1.0.3 has no target with AVX512-BF16 (its AVX3_ZEN4 / native
// ReorderWidenMulAccumulate came later), so these are intrinsics in their own translation unit
// (dpbf16_avx512bf16.cpp, compiled with -mavx512bf16) called once per tile by the Highway
// AVX-512 forward kernel (attention_fwd_f32_hwy.cpp). Called only where the CPU has
// AVX512-BF16 and the OS saves ZMM state (CpuFeatures::avx512_bf16).
//
// Operand layout, "pairs": a bf16 matrix whose reduction index k runs in pairs (k = 2p, 2p + 1):
//   A (broadcast): row r holds a[r·a_row + 2p], a[r·a_row + 2p + 1] next to each other;
//   B (vectors):   b[(p·64 + lane)·2 + {0, 1}] = B[2p][lane], B[2p + 1][lane].
#pragma once

#include <cstdint>

namespace tokenmix::kernels::dpbf16 {

inline constexpr std::int64_t kLanes = 64;  // C columns: the AVX-512 forward's M

/// C[r][0..64) = out_scale · (c_scale ⊙ C[r] (if accumulate) + Σ_p A_r[2p..2p+1] · B[p][·][0..1])
/// for r < rows; C rows ldc floats apart. c_scale (64 lane factors) may be null (= 1).
void GemmRows(std::int64_t rows, const std::uint16_t* a, std::int64_t a_row, const std::uint16_t* b,
              std::int64_t pairs, float* c, std::int64_t ldc, bool accumulate, const float* c_scale,
              float out_scale);

/// Rows [0, n) of an fp32 [n][64] buffer rounded to bf16 (nearest even) as B pairs
/// [ceil(n / 2)][64][2]; an odd last row is paired with zeros.
void PackPairs(const float* src, std::int64_t n, std::uint16_t* dst);

}  // namespace tokenmix::kernels::dpbf16
