// src/dispatch/registry.hpp — which kernel runs, for every ISA path and dtype, and how it may be
// tuned per CPU: the one table (dispatch/registry.cpp) that dispatch, `tokenmix info` and the
// tests read.
//
// One KernelSet per ISA path (portable, avx2, avx512, neon, avx512_bf16 — avx512 with the
// AVX512-BF16 bf16 forward, appended last); an x86 build compiles no neon
// kernels and an AArch64 build no avx2/avx512 ones (their entries are there, not compiled).
// Each names its forward, backward and decode kernels per dtype (activations for
// forward/backward, the KV cache's element type for decode) and describes them. Adding a
// path = one entry here plus its kernel files; adding a dtype = filling its column. A null kernel
// means "not built / not implemented": dispatch throws UnsupportedError naming it, never
// substitutes another.
//
// The one rule that picks a kernel of another set is explicit (select_forward/select_backward):
// a set serves T_k ≤ max_keys (the SIMD kernels index key positions with int32 lanes); a larger
// problem runs the portable kernel of the same dtype.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>

#include "kernels/attention_kernels.hpp"
#include "tokenmix/runtime.hpp"
#include "tokenmix/tensor.hpp"

namespace tokenmix::kernels {

inline constexpr int kDTypeCount = 3;  // DType::f32, bf16, f16 (index = the enum's value)
/// Decode columns: the KV-cache element types f32, bf16, f16, int8, fp8_e4m3 (cache_column).
inline constexpr int kCacheDTypeCount = 5;
/// The decode column of a cache dtype (f32 0, bf16 1, f16 2, int8 3, fp8_e4m3 4); −1 if none.
inline constexpr int cache_column(DType dtype) {
  switch (dtype) {
    case DType::f32:
    case DType::bf16:
    case DType::f16:
      return static_cast<int>(dtype);
    case DType::int8:
      return 3;
    case DType::fp8_e4m3:
      return 4;
    default:
      return -1;
  }
}

template <class Fn>
struct NamedKernel {
  const char* name = nullptr;  // attention_<fwd|bwd|decode>_<dtype>_<isa>, the symbol's name
  Fn fn = nullptr;             // null: not built or not implemented
};

/// Which of decode's per-CPU choices a path's decode kernels implement
/// (KernelSet::decode_tunables).
struct DecodeTunables {
  bool fp8_direct = false;  ///< fp8 codes widened straight into fp32 bits (DecodeArgs::fp8_direct)
  bool linear_prefetch = false;  ///< every cache dtype prefetched in address order on request
  bool amx = false;              ///< AMX tile products (DecodeArgs::amx; int8 quads, fp8, bf16)
  /// The prefetch order per cache dtype when linear_prefetch is not chosen, for `tokenmix info`.
  const char* prefetch_by_dtype = "row by row";
};

struct KernelSet {
  Isa isa = Isa::portable;
  bool (*runs_on)(const CpuFeatures&) = nullptr;       // the CPU/OS features the path needs
  NamedKernel<ForwardKernel> forward[kDTypeCount];     // by activation dtype
  NamedKernel<BackwardKernel> backward[kDTypeCount];   // by activation dtype
  NamedKernel<DecodeKernel> decode[kCacheDTypeCount];  // by KV-cache dtype (cache_column)
  std::int64_t max_keys = 0;                           // forward/backward serve T_k ≤ max_keys
  const char* description = "";
  /// The forward and backward kernels honour AttentionProblem::var (ScoreVariants: window,
  /// softcap, ALiBi, sinks, masks, key lengths). A call using a variant on a set without it
  /// throws UnsupportedError naming the kernel and the variant (never another set's kernel).
  bool score_variants = false;
  /// Isa::automatic may pick this path (the highest runnable path with this flag, or whose
  /// `preferred_on` holds for the CPU). False: opt-in (TOKENMIX_ISA / options.isa) except where
  /// `preferred_on` says otherwise, for a path measured faster than the one below it on some CPUs
  /// and slower on others (docs/performance.md, D-bf16-2).
  bool automatic = true;
  /// Decode's per-CPU tuning that this path's decode kernels take (DecodeArgs): the entry carries
  /// its tuning with its kernels, as XNNPACK's configs do. Dispatch picks the values once per call
  /// from the CPU and the TOKENMIX_* switches (dispatch/cpu_cap.hpp: decode_tuning), only among
  /// what the entry has; `tokenmix info` prints them for the resolved path.
  DecodeTunables decode_tunables;
  /// For a path with `automatic` false: the CPUs (vendor AuthenticAMD, CPUID display family) on
  /// which Isa::automatic picks it all the same; null: none (dispatch/cpu_cap.hpp).
  bool (*preferred_on)(bool amd, unsigned family) = nullptr;

  /// Built into this binary (its f32 forward exists): the path can run where the CPU can.
  bool compiled() const { return forward[0].fn != nullptr; }
};

/// Every path: portable, avx2, avx512 (x86, lowest first), neon (AArch64), avx512_bf16 (x86,
/// above avx512). At most one SIMD
/// family is compiled into a build, so the compiled and runnable ones are in ascending order.
std::span<const KernelSet> kernel_sets();
/// The set of a concrete path (not Isa::automatic).
const KernelSet& kernel_set(Isa isa);

/// The kernel that runs for a resolved path, dtype and T_k (the T_k rule above). Throws
/// UnsupportedError naming `entry`, the kernel and the dtype if the table has none, and, when
/// `variants` (the score variants the call uses, e.g. "window, softcap") is not empty, naming the
/// kernel and the variants if its set lacks score_variants.
NamedKernel<ForwardKernel> select_forward(const char* entry, Isa isa, DType dtype, std::int64_t tk,
                                          std::string_view variants = {});
NamedKernel<BackwardKernel> select_backward(const char* entry, Isa isa, DType dtype,
                                            std::int64_t tk, std::string_view variants = {});
NamedKernel<DecodeKernel> select_decode(const char* entry, Isa isa, DType cache_dtype);

}  // namespace tokenmix::kernels
