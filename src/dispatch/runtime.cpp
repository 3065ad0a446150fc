// src/dispatch/runtime.cpp — ISA choice (one per public call), threads and version. Which
// paths exist and which kernels they run comes from the kernel registry (dispatch/registry.cpp).
#include "tokenmix/runtime.hpp"

#include <omp.h>

#include <cstdlib>
#include <string>

#include "dispatch/cpu_cap.hpp"
#include "dispatch/registry.hpp"
#include "tokenmix/error.hpp"

#ifndef TOKENMIX_VERSION
#define TOKENMIX_VERSION "0.0.0"
#endif

namespace tokenmix {
namespace {

bool compiled(Isa isa) {
  return kernels::kernel_set(isa).compiled();
}

bool cpu_supports(const CpuFeatures& f, Isa isa) {
  return kernels::kernel_set(isa).runs_on(f);
}

// Paths compiled and runnable under features `f`, lowest first (the registry's order).
std::vector<Isa> available(const CpuFeatures& f) {
  std::vector<Isa> out;
  for (const kernels::KernelSet& s : kernels::kernel_sets()) {
    if (s.compiled() && s.runs_on(f)) out.push_back(s.isa);
  }
  return out;
}

std::string list(const std::vector<Isa>& isas) {
  std::string s;
  for (Isa i : isas) s += (s.empty() ? "" : ", ") + std::string(to_string(i));
  return s;
}

}  // namespace

const char* to_string(Isa isa) noexcept {
  switch (isa) {
    case Isa::automatic:
      return "auto";
    case Isa::portable:
      return "portable";
    case Isa::avx2:
      return "avx2";
    case Isa::avx512:
      return "avx512";
    case Isa::neon:
      return "neon";
    case Isa::avx512_bf16:
      return "avx512_bf16";
  }
  return "unknown";
}

Isa parse_isa(const std::string& text, const char* what) {
  for (Isa i :
       {Isa::automatic, Isa::portable, Isa::avx2, Isa::avx512, Isa::avx512_bf16, Isa::neon}) {
    if (text == to_string(i)) return i;
  }
  throw ArgumentError(ErrorCode::invalid_argument,
                      std::string(what) +
                          " must be one of auto, portable, avx2, avx512, avx512_bf16, neon; got '" +
                          text + "'");
}

std::vector<Isa> available_isas() {
  return available(detail::cpu_features("available_isas"));
}

Isa resolve_isa(Isa requested, const char* fn) {
  const CpuFeatures& f = detail::cpu_features(fn);  // the cap is read once per resolve
  if (requested == Isa::automatic) {
    if (const char* env = std::getenv("TOKENMIX_ISA"); env != nullptr && *env != '\0') {
      requested = parse_isa(env, (std::string(fn) + ": environment variable TOKENMIX_ISA").c_str());
    }
  }
  const std::vector<Isa> avail = available(f);
  if (requested == Isa::automatic) {  // the highest runnable path not opt-in on this CPU
    for (auto it = avail.rbegin(); it != avail.rend(); ++it)
      if (detail::automatic_may_pick(kernels::kernel_set(*it))) return *it;
    return Isa::portable;
  }
  if (!compiled(requested)) {
    throw UnsupportedError(
        std::string(fn) + ": isa '" + to_string(requested) +
        "' was requested but this build has no kernels for it (available: " + list(avail) + ")");
  }
  if (!cpu_supports(f, requested)) {
    throw UnsupportedError(
        std::string(fn) + ": isa '" + to_string(requested) +
        "' was requested but this CPU/OS does not support it (available: " + list(avail) + ")");
  }
  return requested;
}

int default_threads() {
  return omp_get_max_threads();
}

std::string describe_kernel(Isa isa) {
  if (isa == Isa::automatic) isa = resolve_isa(Isa::automatic, "describe_kernel");
  const kernels::KernelSet& set = kernels::kernel_set(isa);
  if (!set.compiled()) return std::string(to_string(isa)) + ": not compiled in this build";
  std::string names;
  auto add = [&](const char* name) {
    if (name != nullptr) names += (names.empty() ? "" : ", ") + std::string(name);
  };
  for (const auto& k : set.forward) add(k.fn != nullptr ? k.name : nullptr);
  for (const auto& k : set.backward) add(k.fn != nullptr ? k.name : nullptr);
  for (const auto& k : set.decode) add(k.fn != nullptr ? k.name : nullptr);
  return names + ": " + set.description;
}

DecodeTuning decode_tuning(Isa isa) {
  constexpr const char* fn = "decode_tuning";
  DecodeTuning t;
  t.isa = resolve_isa(isa, fn);
  t.prefetch_by_dtype = kernels::kernel_set(t.isa).decode_tunables.prefetch_by_dtype;
  const detail::DecodeChoice bf16 = detail::choose_decode(fn, t.isa, DType::bf16, false);
  t.amx_bf16 = bf16.amx;
  t.linear_prefetch = bf16.linear_prefetch;
  t.fp8_direct = detail::fp8_direct_widening(fn) &&
                 kernels::kernel_set(t.isa).decode_tunables.fp8_direct;  // as choose_decode
  // int8 and fp8 caches (K per channel per tile) never take the AMX tile products (D-kv-3): a
  // decode call over one refuses TOKENMIX_DECODE_AMX=on, this summary does not.
  t.amx_int8 = t.amx_fp8 = false;
  return t;
}

const char* version() noexcept {
  return TOKENMIX_VERSION;
}

namespace detail {

DecodeChoice choose_decode(const char* fn, Isa isa, DType cache, bool int8_quads) {
  // Only among the choices the path's registry entry has (KernelSet::decode_tunables); a switch
  // that applies to the call is read (and a bad value refused) whatever the path.
  const kernels::DecodeTunables& has = kernels::kernel_set(isa).decode_tunables;
  DecodeChoice c;
  c.fp8_direct = cache == DType::fp8_e4m3 && fp8_direct_widening(fn) && has.fp8_direct;
  c.linear_prefetch = linear_decode_prefetch(fn) && has.linear_prefetch;
  // AMX tile products for an int8, fp8 or bf16 cache (kernels/simd/amx_decode.hpp); an int8
  // cache in rows has none.
  c.amx = (cache == DType::int8 || cache == DType::fp8_e4m3 || cache == DType::bf16) &&
          decode_amx(fn, has.amx, to_string(isa), cache, cache != DType::int8 || int8_quads);
  c.kernel = kernels::select_decode(fn, isa, cache);
  return c;
}

}  // namespace detail
}  // namespace tokenmix
