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

/// Multiply-adds (an upper bound of a call's work, e.g. B·H_q·T_q·T_k·d_h) below which a call
/// runs on the calling thread: waking a team costs more than it saves for such a call (and on a
/// busy machine a worker that is not scheduled at once makes the caller wait at the barrier for
/// far longer). The results do not depend on the thread count, so this choice never changes
/// them.
inline constexpr double kSerialWork = 1 << 18;

/// The threads a call of about `work` multiply-adds uses: 1 below kSerialWork, else `threads`.
inline int threads_for_work(int threads, double work) {
  return work < kSerialWork ? 1 : threads;
}

/// Runs body(ctx) on a team of `team` threads: one OpenMP parallel region, opened here in plain
/// code (kernel_skeleton.cpp) for kernels compiled per Highway target, which share out their
/// units inside it with an orphaned `omp for`. (clang 14 cannot outline a parallel region inside
/// a Highway-targeted function: the outlined body loses the target attribute and the compiler
/// crashes; an orphaned `omp for` is not outlined.) Thread sanitizer builds thus see the SIMD
/// kernels' threads like every other kernel's. A team of one outside any parallel region runs
/// body(ctx) directly, with no region: its orphaned `omp for` binds to the implicit one-thread
/// region and runs every unit in order (inside a caller's region, a one-thread region is still
/// opened, so that the `omp for` cannot bind to the caller's team).
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
