// src/dispatch/cpu_cap.hpp — internal: CPU features as capped by TOKENMIX_CPU_CAP, with errors
// naming the calling entry point (runtime.hpp documents the variable).
#pragma once

#include "tokenmix/runtime.hpp"

namespace tokenmix::detail {

/// TOKENMIX_CPU_CAP, read now: Isa::automatic when unset or empty (no cap), else the highest
/// path whose CPU features the library may see. ArgumentError naming `fn` on another value.
Isa cpu_cap(const char* fn);

/// cpu_features() under the cap read now (one read per call; errors name `fn`).
const CpuFeatures& cpu_features(const char* fn);

}  // namespace tokenmix::detail
