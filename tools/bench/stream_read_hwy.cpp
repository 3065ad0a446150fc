// tools/bench/stream_read_hwy.cpp — the streaming-read ceiling's inner loop, compiled per Highway
// target and dispatched at run time to the widest vectors the CPU has (AVX-512, AVX2, NEON).
//
// The ceiling must be what one core can read, not what the bench's baseline (SSE2) build can
// add up: on a Xeon (docs/performance.md, D-bench-3) SSE2 read 10.8 GB/s per core where 512-bit
// loads read 16 GB/s (numpy.max, and this loop, agree), so the old ceiling flattered every
// memory-bound ratio by about 1.4×.
// clang-format off
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "stream_read_hwy.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
// clang-format: the include below must follow foreach_target.h
#include "hwy/highway.h"
// clang-format on

#include <cstddef>

HWY_BEFORE_NAMESPACE();
namespace tokenmix::bench::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// Σ p[0, n), n a multiple of 4 vectors: four independent vector sums (every load is used, so the
// compiler cannot drop the read).
float SumFloats(const float* HWY_RESTRICT p, std::size_t n) {
  const hn::ScalableTag<float> d;
  const std::size_t N = hn::Lanes(d);
  auto a0 = hn::Zero(d), a1 = hn::Zero(d), a2 = hn::Zero(d), a3 = hn::Zero(d);
  for (std::size_t i = 0; i + 4 * N <= n; i += 4 * N) {
    a0 = hn::Add(a0, hn::LoadU(d, p + i));
    a1 = hn::Add(a1, hn::LoadU(d, p + i + N));
    a2 = hn::Add(a2, hn::LoadU(d, p + i + 2 * N));
    a3 = hn::Add(a3, hn::LoadU(d, p + i + 3 * N));
  }
  return hn::GetLane(hn::SumOfLanes(d, hn::Add(hn::Add(a0, a1), hn::Add(a2, a3))));
}

}  // namespace tokenmix::bench::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace tokenmix::bench {
HWY_EXPORT(SumFloats);

float sum_floats_widest(const float* p, std::size_t n) {
  return HWY_DYNAMIC_DISPATCH(SumFloats)(p, n);
}
}  // namespace tokenmix::bench
#endif
