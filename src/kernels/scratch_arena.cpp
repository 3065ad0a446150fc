// src/kernels/scratch_arena.cpp — the one allocation function of the kernels (scratch_arena.hpp).
#include "kernels/scratch_arena.hpp"

#include <atomic>
#include <cstdlib>
#include <new>
#include <string>

#include "tokenmix/error.hpp"
#include "util/validate.hpp"

namespace tokenmix::kernels {
namespace {

[[noreturn]] void overflow(const CallSite& site, const char* what, const std::string& expr) {
  throw ResourceError(ErrorCode::overflow, std::string(site.entry) + ": the size of " + what +
                                               " for kernel " + site.kernel +
                                               " overflows 64-bit arithmetic (" + expr + " bytes)");
}

}  // namespace

std::int64_t scratch_mul(std::int64_t a, std::int64_t b, const CallSite& site, const char* what) {
  std::int64_t r = 0;
  if (a < 0 || b < 0 || __builtin_mul_overflow(a, b, &r)) {
    overflow(site, what, std::to_string(a) + " * " + std::to_string(b));
  }
  return r;
}

std::int64_t scratch_add(std::int64_t a, std::int64_t b, const CallSite& site, const char* what) {
  std::int64_t r = 0;
  if (a < 0 || b < 0 || __builtin_add_overflow(a, b, &r)) {
    overflow(site, what, std::to_string(a) + " + " + std::to_string(b));
  }
  return r;
}

void AlignedFree::operator()(std::byte* p) const noexcept {
  ::operator delete[](p, std::align_val_t{kScratchAlign});
}

namespace {
std::atomic<int> poisoning{-1};  // -1: TOKENMIX_POISON_SCRATCH not read yet; else 0 or 1
}  // namespace

bool scratch_poisoning() {
  int on = poisoning.load(std::memory_order_relaxed);
  if (on < 0) {
    const char* env = std::getenv("TOKENMIX_POISON_SCRATCH");
    int expected = -1;
    poisoning.compare_exchange_strong(expected, env != nullptr && std::string(env) == "1");
    on = poisoning.load(std::memory_order_relaxed);
  }
  return on == 1;
}

void set_scratch_poisoning(bool on) {
  poisoning.store(on ? 1 : 0);
}

AlignedBytes allocate_bytes(std::int64_t bytes, const CallSite& site, const char* what) {
  if (bytes < 0) overflow(site, what, std::to_string(bytes));
  const std::size_t n = bytes == 0 ? kScratchAlign : static_cast<std::size_t>(bytes);
  // Scratch larger than the machine's physical memory can never be used: refuse it here rather
  // than let an overcommitting kernel (vm.overcommit_memory = 1) hand out address space that
  // the kernel's first pass over it would turn into an out-of-memory kill.
  // (Asked once: sysconf(_SC_PHYS_PAGES) is a system call, and a tiny kernel call allocates
  // several times; the machine's memory does not change while the process runs.)
  static const double physical = detail::physical_memory_bytes();
  if (physical > 0 && static_cast<double>(bytes) > physical) {
    throw ResourceError(ErrorCode::out_of_memory,
                        std::string(site.entry) + ": cannot allocate " + std::to_string(bytes) +
                            " bytes for " + what + " of kernel " + site.kernel +
                            " (more than the machine's physical memory, " +
                            std::to_string(static_cast<long long>(physical)) + " bytes)");
  }
  void* p = ::operator new[](n, std::align_val_t{kScratchAlign}, std::nothrow);
  if (p == nullptr) {
    throw ResourceError(ErrorCode::out_of_memory, std::string(site.entry) + ": cannot allocate " +
                                                      std::to_string(bytes) + " bytes for " + what +
                                                      " of kernel " + site.kernel +
                                                      " (the system refused the allocation)");
  }
  return AlignedBytes(static_cast<std::byte*>(p));
}

namespace {

// The calling thread's blocks for small arenas (ScratchArena): block i serves the i-th arena
// alive at once on this thread; it grows to the largest request it has served (at most
// kPooledScratchBytes) and lives as long as the thread.
struct ScratchPool {
  static constexpr int kBlocks = 4;
  AlignedBytes block[kBlocks];
  std::int64_t capacity[kBlocks] = {};
  int used = 0;
};
thread_local ScratchPool scratch_pool;

}  // namespace

ScratchArena::ScratchArena(const ScratchLayout& layout, std::int64_t workers, const char* what) {
  const std::int64_t bytes = scratch_mul(workers, layout.bytes(), layout.site(), what);
  ScratchPool& pool = scratch_pool;
  if (bytes <= kPooledScratchBytes && pool.used < ScratchPool::kBlocks) {
    const int i = pool.used;
    if (pool.capacity[i] < bytes) {
      pool.block[i].reset();
      pool.capacity[i] = 0;
      pool.block[i] = allocate_bytes(bytes, layout.site(), what);
      pool.capacity[i] = bytes;
    }
    pooled_ = i;
    pool.used = i + 1;
    view_ = {pool.block[i].get(), layout.bytes()};
    poison_scratch(view_.base, bytes);
    return;
  }
  memory_ = allocate_bytes(bytes, layout.site(), what);
  view_ = {memory_.get(), layout.bytes()};
  poison_scratch(view_.base, bytes);
}

ScratchArena::~ScratchArena() {
  if (pooled_ >= 0) scratch_pool.used = pooled_;  // the last arena taken is the first released
}

}  // namespace tokenmix::kernels
