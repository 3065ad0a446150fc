// src/kernels/kernel_skeleton.hpp — what every kernel (portable and SIMD) does around its
// arithmetic: how many workers a call uses, how a work-unit number splits into its indices,
// and a dense copy of strided rows. Per-worker scratch: scratch_arena.hpp.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>

namespace tokenmix::kernels {

/// Workers of a parallel loop over `units` independent units: min(threads, units), at least 1.
inline int team_size(int threads, std::int64_t units) {
  return static_cast<int>(std::clamp<std::int64_t>(threads, 1, std::max<std::int64_t>(1, units)));
}

/// Runs body(ctx) on a team of `team` threads: one OpenMP parallel region, opened here in plain
/// code (kernel_skeleton.cpp) for kernels compiled per Highway target, which share out their
/// units inside it with an orphaned `omp for`. (clang 14 cannot outline a parallel region inside
/// a Highway-targeted function: the outlined body loses the target attribute and the compiler
/// crashes; an orphaned `omp for` is not outlined.) Thread sanitizer builds thus see the SIMD
/// kernels' threads like every other kernel's.
void RunTeam(int team, void (*body)(void*), void* ctx);

/// Splits a work-unit number into mixed-radix digits, fastest first:
///   Unravel(unit, n0, n1) = {unit % n0, unit / n0 % n1, unit / (n0 · n1)}
/// (the last digit is the rest, e.g. the batch index).
template <class... Radix>
std::array<std::int64_t, sizeof...(Radix) + 1> Unravel(std::int64_t unit, Radix... radix) {
  std::array<std::int64_t, sizeof...(Radix) + 1> out{};
  std::size_t k = 0;
  ((out[k++] = unit % radix, unit /= radix), ...);
  out[k] = unit;
  return out;
}

}  // namespace tokenmix::kernels
