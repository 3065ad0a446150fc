// src/util/huge_pages.hpp — backing a large buffer that is swept front to back with transparent
// huge pages: the KV cache's storage (kv_cache.cpp) and the streaming-read ceiling that decode is
// measured against (tools/bench), which must get the same page treatment to be a fair bar.
#pragma once

#include <cstddef>
#include <cstdint>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace tokenmix::detail {

// Linux: advise the 2 MiB-aligned interior of [data, data + bytes) as MADV_HUGEPAGE, then
// collapse it (MADV_COLLAPSE, Linux ≥ 6.1) — call after the range has been written once (advising
// before first touch was slower). A sweep then runs without a page walk every 4 KiB; the figures
// are in docs/performance.md, D-mem-1. Advisory only: any failure (older kernel, THP
// disabled) is ignored.
inline void back_with_huge_pages(void* data, std::size_t bytes) {
#if defined(__linux__)
  constexpr std::uintptr_t kHuge = std::uintptr_t{2} << 20;
  const auto begin = (reinterpret_cast<std::uintptr_t>(data) + kHuge - 1) & ~(kHuge - 1);
  const auto end = (reinterpret_cast<std::uintptr_t>(data) + bytes) & ~(kHuge - 1);
  if (end <= begin) return;
  void* p = reinterpret_cast<void*>(begin);
  if (madvise(p, end - begin, MADV_HUGEPAGE) != 0) return;
  constexpr int kCollapse = 25;  // MADV_COLLAPSE, absent from older headers
  (void)madvise(p, end - begin, kCollapse);
#else
  (void)data;
  (void)bytes;
#endif
}

}  // namespace tokenmix::detail
