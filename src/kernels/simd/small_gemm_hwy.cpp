// src/kernels/simd/small_gemm_hwy.cpp — the layer's few-row projection chunk (kernels/
// small_gemm.hpp) with Highway, per target (x86: AVX-512 = AVX3, AVX2; AArch64: NEON), and the
// portable one. The decode step's projections read 168 MB of fp32 weights per token for a
// Llama-3-8B-shaped layer: the chunk is bound by that stream, and the portable loop (the x86-64
// baseline: 4-lane SSE2, one core at about half of what it can read on AMD Zen 5) by its
// arithmetic (docs/performance.md, D-layer-2).
//
// Per group of G ≤ 8 reduction rows: for each row m of A and each vector of columns j, P[m][j] is
// loaded (the chunk's first group: taken as 0), the G terms fl(A[m][k] · B[k][j]) are added to it
// one after the other, in k order, and it is stored. From kBlockRows rows of A on, a block of
// columns' B vectors is loaded once for all rows (AddRowsBlock), with A's part copied to a small
// panel first (APanel); below, the B rows stream through once per m (AddRows). Both prefetch the
// next group's lines into L2 as they read a group's (PrefetchAhead). Multiply and add are
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

constexpr std::int64_t kGroup = 8;  // reduction rows added per pass over the rows of P

// Rows of A from which a group's B vectors are loaded once for all of them (AddRowsBlock); fewer
// rows re-read them per row of P (AddRows), which measured faster there on two threads.
constexpr std::int64_t kBlockRows = 4;

// Vectors of columns per block: the group's B vectors stay in registers for all M rows of P
// (kGroup · kBlock of them, plus one accumulator per vector and a broadcast).
#if HWY_TARGET == HWY_AVX2
constexpr int kBlock = 1;  // 8 of 16 ymm registers
#else
constexpr int kBlock = 2;  // 16 of 32 zmm / q registers
#endif

// Prefetches into L2 the line `bytes` past row (B's same columns, a later group of rows). The
// address as an integer: past B's end (the last chunk's last group) it is no object's, and a
// prefetch of it reads nothing (no fault).
HWY_INLINE void PrefetchAhead(const float* row, std::uintptr_t bytes) {
  __builtin_prefetch(reinterpret_cast<const void*>(reinterpret_cast<std::uintptr_t>(row) + bytes),
                     0, 2);
}

// P[m][j] ← P[m][j] + Σ_{r < g} fl(a[m · K + r] · B[r][j]) for the columns [j0, n) one at a
// time, every row m < M of P (row m at p + m · ldp; the vector loops' scalar tail, n % Lanes
// columns). first: the chunk's first group, P taken as 0 (not read).
inline void AddColumnsScalar(std::int64_t M, std::int64_t K, const float* HWY_RESTRICT a,
                             const float* HWY_RESTRICT b, std::int64_t n, std::int64_t g,
                             std::int64_t j0, float* HWY_RESTRICT p, std::int64_t ldp, bool first) {
  for (std::int64_t m = 0; m < M; ++m) {
    for (std::int64_t j = j0; j < n; ++j) {
      float acc = first ? 0.0f : p[m * ldp + j];
      for (std::int64_t r = 0; r < g; ++r) acc = acc + a[m * K + r] * b[r * n + j];
      p[m * ldp + j] = acc;
    }
  }
}

// P[m][j] ← P[m][j] + Σ_{r < G} fl(a[r] · B[r][j]), term by term in r order, for one row m of P
// (G = 0: g rows, known at run time; first: P taken as 0). Each B vector's line of the next group
// (the rows G·n floats on, same columns) is prefetched into L2 as it is read: the group's G row
// streams are more than the hardware prefetchers keep ahead of. The one-token step of a
// Llama-3-8B-shaped layer on AMD Zen 4 (M = 1, 168 MB of weights), best step of each round: one
// thread 9.4–10.3 → 7.1–8.1 ms (AVX-512) and 8.8–9.2 → 7.4–7.8 ms (AVX2), two threads 5–8 %
// faster (docs/performance.md, D-layer-4).
template <int G>
HWY_INLINE void AddRows(const float* HWY_RESTRICT a, const float* HWY_RESTRICT b, std::int64_t n,
                        std::int64_t g, float* HWY_RESTRICT p, bool first) {
  const hn::ScalableTag<float> d;
  const std::int64_t N = static_cast<std::int64_t>(hn::Lanes(d));
  const std::int64_t rows = G > 0 ? G : g;
  std::int64_t j = 0;
  const std::uintptr_t next_group = static_cast<std::uintptr_t>(rows * n) * sizeof(float);  // bytes
  for (; j + N <= n; j += N) {
    auto acc = first ? hn::Zero(d) : hn::LoadU(d, p + j);
    for (std::int64_t r = 0; r < rows; ++r) {
      const float* row = b + r * n + j;
      PrefetchAhead(row, next_group);
      acc = hn::Add(acc, hn::Mul(hn::Set(d, a[r]), hn::LoadU(d, row)));
    }
    hn::StoreU(acc, d, p + j);
  }
  AddColumnsScalar(1, 0, a, b, n, rows, j, p, n, first);
}

// The same sums for every row m < M of P at once, over the VB·N columns from j: the G·VB vectors
// of B are loaded once and serve all M rows (a[m · ka + r] = A[m][k + r]; first: P taken as 0).
// With several rows the arithmetic per B byte keeps the loads from running ahead, so the next
// group's rows (G·n floats on) are prefetched into L2 meanwhile, at the same columns: on one AMD
// Zen 5 core, M = 8 read the weights at 8–10 GB/s without either (B re-read per row, no
// prefetch) and 15–19 with both.
template <int G, int VB, class D>
HWY_INLINE void AddRowsBlock(D d, std::int64_t M, std::int64_t ka, const float* HWY_RESTRICT a,
                             const float* HWY_RESTRICT b, std::int64_t n, std::int64_t j,
                             float* HWY_RESTRICT p, std::int64_t ldp, bool first) {
  const std::int64_t N = static_cast<std::int64_t>(hn::Lanes(d));
  const std::uintptr_t next_group = static_cast<std::uintptr_t>(G * n) * sizeof(float);  // bytes
  hn::Vec<D> bv[G][VB];
  for (int r = 0; r < G; ++r) {
    for (int v = 0; v < VB; ++v) {
      const float* row = b + r * n + j + v * N;
      PrefetchAhead(row, next_group);
      bv[r][v] = hn::LoadU(d, row);
    }
  }
  for (std::int64_t m = 0; m < M; ++m) {
    hn::Vec<D> acc[VB];
    for (int v = 0; v < VB; ++v)
      acc[v] = first ? hn::Zero(d) : hn::LoadU(d, p + m * ldp + j + v * N);
    for (int r = 0; r < G; ++r) {
      const auto ar = hn::Set(d, a[m * ka + r]);
      for (int v = 0; v < VB; ++v) acc[v] = hn::Add(acc[v], hn::Mul(ar, bv[r][v]));
    }
    for (int v = 0; v < VB; ++v) hn::StoreU(acc[v], d, p + m * ldp + j + v * N);
  }
}

// Rows of P per pass of the block path, and reduction rows of A copied per pass (APanel).
constexpr std::int64_t kPanelRows = 8;
constexpr std::int64_t kPanelK = 128;

// A[0 : rows, ks : ks + len) copied to rows kPanelK floats (512 bytes) apart. A's own rows are K
// floats apart (the layer's 4096: 16 KiB), which puts the M elements the block path broadcasts
// for one k in the same L1 set, with the B rows (16 KiB apart as well): the copy's rows fall in
// distinct sets. In a model k loop on AMD Zen 4 (8 rows × 3 vectors of mul + add pairs, each
// row's element of A broadcast), A rows 16 KiB apart took 0.69–0.96 ns per pair and 16.06 KiB
// apart 0.38–0.43; the layer's step of 8 sequences, 2 threads: 12.0–17.6 → 9.7–12.7 ms
// (docs/performance.md, D-layer-6).
struct APanel {
  alignas(64) float a[kPanelRows * kPanelK];
  void copy(std::int64_t rows, std::int64_t K, const float* A, std::int64_t ks, std::int64_t len) {
    for (std::int64_t m = 0; m < rows; ++m)
      std::copy(A + m * K + ks, A + m * K + ks + len, a + m * kPanelK);
  }
};

// The block path for rows [0, M) of P (M ≤ kPanelRows) and reduction rows [ks, ks + len) of A
// (len ≤ kPanelK), A's part in `panel`; first: the chunk's first rows (P taken as 0 at first).
template <class D>
void AddPanel(D d, std::int64_t M, const APanel& panel, const float* B, std::int64_t n,
              std::int64_t ks, std::int64_t len, float* P, std::int64_t ldp, bool first) {
  const std::int64_t N = static_cast<std::int64_t>(hn::Lanes(d));
  for (std::int64_t r0 = 0; r0 < len; r0 += kGroup) {
    const std::int64_t g = std::min(kGroup, len - r0);
    const bool first_group = first && r0 == 0;
    const float* a = panel.a + r0;
    const float* b = B + (ks + r0) * n;
    if (g < kGroup) {  // the last, short group: row by row
      for (std::int64_t m = 0; m < M; ++m)
        AddRows<0>(a + m * kPanelK, b, n, g, P + m * ldp, first_group);
      continue;
    }
    std::int64_t j = 0;
    for (; j + kBlock * N <= n; j += kBlock * N)
      AddRowsBlock<kGroup, kBlock>(d, M, kPanelK, a, b, n, j, P, ldp, first_group);
    for (; j + N <= n; j += N)
      AddRowsBlock<kGroup, 1>(d, M, kPanelK, a, b, n, j, P, ldp, first_group);
    AddColumnsScalar(M, kPanelK, a, b, n, g, j, P, ldp, first_group);
  }
}

void SmallGemmChunkSimd(std::int64_t M, std::int64_t K, const float* A, const float* B,
                        std::int64_t n, std::int64_t k0, std::int64_t k1, float* P,
                        std::int64_t ldp) {
  const hn::ScalableTag<float> d;
  if (k1 <= k0) {
    for (std::int64_t m = 0; m < M; ++m) std::fill(P + m * ldp, P + m * ldp + n, 0.0f);
    return;
  }
  for (std::int64_t m0 = 0; m0 < M; m0 += kPanelRows) {
    const std::int64_t rows = std::min(kPanelRows, M - m0);
    const float* A_rows = A + m0 * K;
    float* P_rows = P + m0 * ldp;
    if (rows >= kBlockRows) {
      APanel panel;
      for (std::int64_t ks = k0; ks < k1; ks += kPanelK) {
        const std::int64_t len = std::min(kPanelK, k1 - ks);
        panel.copy(rows, K, A_rows, ks, len);
        AddPanel(d, rows, panel, B, n, ks, len, P_rows, ldp, ks == k0);
      }
      continue;
    }
    for (std::int64_t k = k0; k < k1; k += kGroup) {
      const std::int64_t g = std::min(kGroup, k1 - k);
      for (std::int64_t m = 0; m < rows; ++m) {
        if (g == kGroup) {
          AddRows<kGroup>(A_rows + m * K + k, B + k * n, n, g, P_rows + m * ldp, k == k0);
        } else {
          AddRows<0>(A_rows + m * K + k, B + k * n, n, g, P_rows + m * ldp, k == k0);
        }
      }
    }
  }
}

}  // namespace tokenmix::kernels::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace tokenmix::kernels {

void small_gemm_chunk_portable(std::int64_t M, std::int64_t K, const float* A, const float* B,
                               std::int64_t n, std::int64_t k0, std::int64_t k1, float* P,
                               std::int64_t ldp) {
  for (std::int64_t m = 0; m < M; ++m) std::fill(P + m * ldp, P + m * ldp + n, 0.0f);
  for (std::int64_t k = k0; k < k1; k += 4) {
    const float* b0 = B + k * n;
    for (std::int64_t m = 0; m < M; ++m) {
      const float* a = A + m * K + k;
      float* __restrict pm = P + m * ldp;
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
