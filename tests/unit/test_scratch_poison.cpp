// tests/unit/test_scratch_poison.cpp — every test of this binary runs with the kernels' scratch
// poisoned (src/kernels/scratch_arena.hpp, scratch_poisoning), and the poisoning itself works.
//
// Scratch is reused across calls (a thread's pool blocks, decode's thread_local buffer), so a
// kernel that reads an element of it that the same call did not write gets whatever an earlier
// call left there: often small and finite, within an oracle test's tolerance. Filled with 0xFF
// bytes before each use, such an element is NaN (fp32, bf16, fp16) and fails the test.
#include <gtest/gtest.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels/scratch_arena.hpp"
#include "tokenmix/tokenmix.hpp"

namespace {

using namespace tokenmix;

// Turns poisoning on before the first test, however the binary is started (ctest, a filter, a
// debugger), and leaves it on.
class PoisonScratchForEveryTest : public ::testing::Environment {
 public:
  void SetUp() override { kernels::set_scratch_poisoning(true); }
};
[[maybe_unused]] ::testing::Environment* const kPoisonEnvironment =
    ::testing::AddGlobalTestEnvironment(new PoisonScratchForEveryTest);

bool all_poison(const std::byte* p, std::int64_t bytes) {
  for (std::int64_t i = 0; i < bytes; ++i) {
    if (p[i] != std::byte{0xFF}) return false;
  }
  return true;
}

TEST(ScratchPoison, OnForEveryTestOfThisBinary) {
  EXPECT_TRUE(kernels::scratch_poisoning());
}

TEST(ScratchPoison, PooledAndOwnArenasAndReusableBuffersArePoisonedOnEveryUse) {
  ASSERT_TRUE(kernels::scratch_poisoning());
  // A pooled arena (small) and an arena of its own (above kPooledScratchBytes), each written
  // over by its user and then taken again: the second use sees poison, not the first one's data.
  for (const std::int64_t floats : {std::int64_t{1000}, kernels::kPooledScratchBytes}) {
    kernels::ScratchLayout layout;
    const auto slot = layout.add<float>(floats);
    for (int use = 0; use < 2; ++use) {
      const kernels::ScratchArena arena(layout, 2, "scratch");
      for (int w = 0; w < 2; ++w) {
        float* f = arena.at(slot, w);
        EXPECT_TRUE(all_poison(reinterpret_cast<const std::byte*>(f), floats * 4))
            << floats << " floats, use " << use << ", worker " << w;
        EXPECT_TRUE(std::isnan(f[0]) && std::isnan(f[floats - 1]));
        std::memset(f, 0, static_cast<std::size_t>(floats) * sizeof(float));
      }
    }
  }
  kernels::ReusableScratch reusable;
  for (const std::int64_t bytes : {std::int64_t{4096}, std::int64_t{64}, std::int64_t{8192}}) {
    std::byte* p = reusable.reserve(bytes, {}, "scratch");
    EXPECT_TRUE(all_poison(p, bytes)) << bytes << " bytes";
    std::memset(p, 0, static_cast<std::size_t>(bytes));
  }
}

TEST(ScratchPoison, OffLeavesTheContentsAlone) {
  kernels::set_scratch_poisoning(false);
  kernels::ReusableScratch reusable;
  std::byte* p = reusable.reserve(256, {}, "scratch");
  std::memset(p, 0x11, 256);
  p = reusable.reserve(256, {}, "scratch");
  const bool kept = p[0] == std::byte{0x11} && p[255] == std::byte{0x11};
  kernels::set_scratch_poisoning(true);
  EXPECT_TRUE(kept);
}

// A decode step right after one that filled the same thread's buffer with finite values still
// gives the poisoned run's answer: the same bits as with a fresh buffer (decode's scratch is
// written before it is read).
TEST(ScratchPoison, DecodeReadsOnlyWhatItWrote) {
  ASSERT_TRUE(kernels::scratch_poisoning());
  KVCacheConfig c;
  c.batch = 1, c.layers = 1, c.heads_kv = 2, c.head_dim = 37, c.capacity = 300;
  c.dtype = DType::int8;
  KVCache cache(c);
  const std::int64_t n = 131, hq = 4;
  std::vector<float> k(static_cast<std::size_t>(n * c.heads_kv * c.head_dim)), v(k.size());
  std::uint32_t s = 12345;
  const auto next = [&] {
    s = s * 1664525u + 1013904223u;
    return static_cast<float>(s >> 8) / 16777216.0f * 2.0f - 1.0f;
  };
  for (float& x : k) x = next();
  for (float& x : v) x = next();
  cache.append(0, 0, ConstTensorView::bthd(k.data(), 1, n, c.heads_kv, c.head_dim),
               ConstTensorView::bthd(v.data(), 1, n, c.heads_kv, c.head_dim));
  std::vector<float> q(static_cast<std::size_t>(hq * c.head_dim));
  for (float& x : q) x = next();
  const auto run = [&] {
    std::vector<float> out(q.size(), std::nanf(""));
    attention_decode(ConstTensorView::bthd(q.data(), 1, 1, hq, c.head_dim), cache, 0,
                     TensorView::bthd(out.data(), 1, 1, hq, c.head_dim), {}, {});
    return out;
  };
  const std::vector<float> first = run();
  for (const float x : first) ASSERT_TRUE(std::isfinite(x));
  kernels::set_scratch_poisoning(false);
  const std::vector<float> unpoisoned = run();
  kernels::set_scratch_poisoning(true);
  EXPECT_EQ(0, std::memcmp(first.data(), unpoisoned.data(), first.size() * sizeof(float)));
}

}  // namespace
