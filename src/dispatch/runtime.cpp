// src/dispatch/runtime.cpp — ISA choice (one per public call), threads and version.
#include <omp.h>

#include <cstdlib>
#include <string>

#include "kernels/attention_kernels.hpp"
#include "tokenmix/error.hpp"
#include "tokenmix/runtime.hpp"

#ifndef TOKENMIX_VERSION
#define TOKENMIX_VERSION "0.0.0"
#endif

namespace tokenmix {
namespace {

// Paths this build compiled: portable always; AVX2/AVX-512 where the SIMD kernels were built.
bool compiled(Isa isa) {
  return isa == Isa::portable || kernels::simd_forward_kernel(isa) != nullptr;
}

bool cpu_supports(Isa isa) {
  const CpuFeatures& f = cpu_features();
  switch (isa) {
    case Isa::portable: return true;
    case Isa::avx2: return f.avx2_fma;
    case Isa::avx512: return f.avx512f;
    case Isa::automatic: return true;
  }
  return false;
}

std::string list(const std::vector<Isa>& isas) {
  std::string s;
  for (Isa i : isas) s += (s.empty() ? "" : ", ") + std::string(to_string(i));
  return s;
}

}  // namespace

const char* to_string(Isa isa) noexcept {
  switch (isa) {
    case Isa::automatic: return "auto";
    case Isa::portable: return "portable";
    case Isa::avx2: return "avx2";
    case Isa::avx512: return "avx512";
  }
  return "unknown";
}

Isa parse_isa(const std::string& text, const char* what) {
  for (Isa i : {Isa::automatic, Isa::portable, Isa::avx2, Isa::avx512}) {
    if (text == to_string(i)) return i;
  }
  throw ArgumentError(ErrorCode::invalid_argument,
                      std::string(what) + " must be one of auto, portable, avx2, avx512; got '" +
                          text + "'");
}

std::vector<Isa> available_isas() {
  std::vector<Isa> out;
  for (Isa i : {Isa::portable, Isa::avx2, Isa::avx512}) {
    if (compiled(i) && cpu_supports(i)) out.push_back(i);
  }
  return out;
}

Isa resolve_isa(Isa requested) {
  if (requested == Isa::automatic) {
    if (const char* env = std::getenv("TOKENMIX_ISA"); env != nullptr && *env != '\0') {
      requested = parse_isa(env, "environment variable TOKENMIX_ISA");
    }
  }
  const std::vector<Isa> available = available_isas();
  if (requested == Isa::automatic) return available.back();
  if (!compiled(requested)) {
    throw UnsupportedError(std::string("isa '") + to_string(requested) +
                           "' was requested but this build has no kernels for it (available: " +
                           list(available) + ")");
  }
  if (!cpu_supports(requested)) {
    throw UnsupportedError(std::string("isa '") + to_string(requested) +
                           "' was requested but this CPU/OS does not support it (available: " +
                           list(available) + ")");
  }
  return requested;
}

int default_threads() { return omp_get_max_threads(); }

std::string describe_kernel(Isa isa) {
  switch (isa) {
    case Isa::portable:
      return "attention_{fwd,bwd}_f32_portable: exact fp32, two-pass softmax per query row, "
             "O(T_k*d_h) scratch per worker, OpenMP over (batch, head, 64-row block)";
    case Isa::avx2:
    case Isa::avx512:
      if (!compiled(isa)) return std::string(to_string(isa)) + ": not compiled in this build";
      return std::string("attention_fwd_f32_") + to_string(isa) +
             ": fused flash forward (Highway), GQA heads stacked in SIMD lanes, online softmax "
             "over 64-key tiles, causal tile skipping; attention_bwd_f32_" +
             to_string(isa) +
             ": flash backward recomputing tiles (one pass owning dK/dV/dQ per KV head when "
             "B*H_kv >= 8, else two passes: dQ with queries in lanes, dK/dV with keys in lanes)";
    case Isa::automatic: return describe_kernel(resolve_isa(Isa::automatic));
  }
  return "unknown";
}

const char* version() noexcept { return TOKENMIX_VERSION; }

}  // namespace tokenmix
