// src/kernels/scratch_arena.hpp — the per-worker scratch memory of every kernel, declared once.
//
// A kernel lists its per-worker buffers in a ScratchLayout (element type and count, in the order
// it wants them in memory); the layout puts each at a 64-byte aligned offset and knows the size
// of one worker's region (a multiple of 64 bytes, so every worker's region is aligned too). A
// ScratchArena allocates `workers` such regions in one block and hands out typed pointers:
//
//   ScratchLayout layout;
//   const auto qt = layout.add<float>(dh * M);        // sizes are checked for int64 overflow
//   const ScratchArena arena(layout, team, site, "per-worker scratch");  // ResourceError if not
//   float* q = arena.at(qt, omp_get_thread_num());
//
// Every allocation a kernel makes goes through allocate_bytes(), which throws ResourceError
// naming the entry point, the kernel, what the memory was for and its size in bytes, instead of
// returning null (issue: an unchecked aligned allocation crashed the AVX2 kernels for
// d_h = 2^26). Allocation happens before the parallel region, in the caller's thread, so the
// exception reaches the caller.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>

namespace tokenmix::kernels {

/// Who is asking, for error messages: the public entry point and the kernel it dispatched to.
struct CallSite {
  const char* entry = "tokenmix";
  const char* kernel = "kernel";
};

inline constexpr std::int64_t kScratchAlign = 64;  // bytes: a cache line, a full zmm register

/// a·b and a + b for sizes in bytes; throw ResourceError(overflow) naming `site` and `what`.
std::int64_t scratch_mul(std::int64_t a, std::int64_t b, const CallSite& site, const char* what);
std::int64_t scratch_add(std::int64_t a, std::int64_t b, const CallSite& site, const char* what);

struct AlignedFree {
  void operator()(std::byte* p) const noexcept;
};
using AlignedBytes = std::unique_ptr<std::byte[], AlignedFree>;

/// `bytes` bytes aligned to kScratchAlign, or ResourceError(out_of_memory) naming the entry
/// point, the kernel, `what` and the size. Never returns null (0 bytes gives a 64-byte block).
AlignedBytes allocate_bytes(std::int64_t bytes, const CallSite& site, const char* what);

/// Test aid against kernels that read scratch they did not write in the same call. While
/// poisoning is on, every scratch block handed to a kernel (ScratchArena, ReusableScratch, the
/// layer's partial products) is filled with 0xFF bytes first: NaN as fp32, bf16 or fp16, −1 as
/// an integer. A stale element then turns an output into NaN instead of a small wrong value that
/// a tolerance can hide (D-ci-6: an int8 cache's decode with d_h < 4 read stale partial
/// scores; the float64-oracle test passed because they were ≈ 1e-9, and fails when poisoned).
/// It starts on when the environment variable TOKENMIX_POISON_SCRATCH is "1" (read at the first
/// scratch request); the unit tests turn it on for every test (tests/unit/test_scratch_poison.cpp)
/// and the Python tests through the variable (python/tests/conftest.py). Off, poison_scratch
/// costs one relaxed atomic load and a predictable branch.
bool scratch_poisoning();
void set_scratch_poisoning(bool on);
inline void poison_scratch(void* p, std::int64_t bytes) {
  if (bytes > 0 && scratch_poisoning()) std::memset(p, 0xFF, static_cast<std::size_t>(bytes));
}

/// A buffer of `count` elements of T at byte `offset` of each worker's region.
template <class T>
struct Slot {
  std::int64_t offset = 0, count = 0;
};

/// The per-worker buffers of one kernel call, in memory order, each 64-byte aligned.
class ScratchLayout {
 public:
  explicit ScratchLayout(const CallSite& site = {}) : site_(site) {}

  template <class T>
  Slot<T> add(std::int64_t count) {
    const std::int64_t bytes = scratch_mul(count, sizeof(T), site_, "a scratch buffer");
    const Slot<T> slot{bytes_, count};
    bytes_ = round_up(scratch_add(bytes_, bytes, site_, "the per-worker scratch"));
    return slot;
  }
  /// Bytes of one worker's region (a multiple of kScratchAlign).
  std::int64_t bytes() const { return bytes_; }
  const CallSite& site() const { return site_; }

 private:
  std::int64_t round_up(std::int64_t x) const {
    return scratch_add(x, kScratchAlign - 1, site_, "the per-worker scratch") / kScratchAlign *
           kScratchAlign;
  }
  CallSite site_;
  std::int64_t bytes_ = 0;
};

/// Non-owning view of `workers` regions of `stride` bytes each (see ScratchLayout).
struct WorkerScratch {
  std::byte* base = nullptr;
  std::int64_t stride = 0;  // bytes per worker, a multiple of kScratchAlign

  template <class T>
  T* at(Slot<T> slot, int worker) const {
    return reinterpret_cast<T*>(base + worker * stride + slot.offset);
  }
};

/// Owns the scratch of one call: `workers` regions of layout.bytes() each, allocated with
/// allocate_bytes (ResourceError on failure, naming `what`). A small arena (at most
/// kPooledScratchBytes) reuses a block of the calling thread's pool instead (a few blocks per
/// thread, kept for the next call and taken in stack order: arenas are locals of a kernel call),
/// so a tiny call makes no heap allocation. The memory's contents are unspecified either way
/// (poisoned under TOKENMIX_POISON_SCRATCH=1).
inline constexpr std::int64_t kPooledScratchBytes = 256 * 1024;

class ScratchArena {
 public:
  ScratchArena(const ScratchLayout& layout, std::int64_t workers, const char* what);
  ~ScratchArena();
  ScratchArena(const ScratchArena&) = delete;
  ScratchArena& operator=(const ScratchArena&) = delete;

  template <class T>
  T* at(Slot<T> slot, int worker) const {
    return view_.at(slot, worker);
  }
  const WorkerScratch& view() const { return view_; }

 private:
  AlignedBytes memory_;  // a block of its own (large arenas), or empty
  int pooled_ = -1;      // else the index of the calling thread's pool block it holds
  WorkerScratch view_;
};

/// A buffer reused across calls (e.g. thread_local, for decode steps): grows through
/// allocate_bytes when a call needs more, never shrinks. Each reserve() poisons the bytes asked
/// for under TOKENMIX_POISON_SCRATCH=1 (the contents are unspecified otherwise).
class ReusableScratch {
 public:
  std::byte* reserve(std::int64_t bytes, const CallSite& site, const char* what) {
    if (bytes > capacity_) {
      memory_.reset();  // free first: the old block is not needed any more
      capacity_ = 0;
      memory_ = allocate_bytes(bytes, site, what);
      capacity_ = bytes;
    }
    poison_scratch(memory_.get(), bytes);
    return memory_.get();
  }

 private:
  AlignedBytes memory_;
  std::int64_t capacity_ = 0;
};

}  // namespace tokenmix::kernels
