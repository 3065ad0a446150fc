// tools/cli/cmd_info.cpp — `tokenmix info`: version, CPU, ISA features, kernel paths, threads.
#include <CLI/CLI.hpp>
#include <cstdlib>
#include <iostream>
#include <string>

#include "common.hpp"

namespace tokenmix::cli {
namespace {

int run_info() {
  const Isa chosen = resolve_isa(Isa::automatic);  // may throw (bad TOKENMIX_ISA): before output
  // May throw (a bad TOKENMIX_FP8_WIDEN / TOKENMIX_LINEAR_PREFETCH / TOKENMIX_DECODE_AMX, or `on`
  // where the path or the CPU has no tile products): before any output too.
  const DecodeTuning tuning = decode_tuning(chosen);
  const CpuFeatures& cpu = cpu_features();
  std::cout << "tokenmix " << version() << "\n";
  std::cout << "cpu:             " << (cpu.model.empty() ? "(unknown)" : cpu.model) << "\n";
  std::string flags;
  for (const auto& f : cpu.flags()) flags += (flags.empty() ? "" : " ") + f;
  std::cout << "cpu features:    "
            << (flags.empty() ? "(none of avx2_fma, avx512f, neon, ...)" : flags) << "\n";
  if (const Isa cap = cpu_cap(); cap != Isa::automatic)
    std::cout << "cpu cap:         " << to_string(cap)
              << " (TOKENMIX_CPU_CAP: features above it are hidden)\n";
  std::cout << "available paths:";
  for (Isa isa : available_isas()) std::cout << " " << to_string(isa);
  std::cout << "\n";
  for (Isa isa : available_isas())
    std::cout << "  " << to_string(isa) << ": " << describe_kernel(isa) << "\n";
  std::cout << "kernel path:     " << to_string(chosen) << " (automatic"
            << (std::getenv("TOKENMIX_ISA") != nullptr
                    ? std::string(", TOKENMIX_ISA=") + std::getenv("TOKENMIX_ISA")
                    : std::string())
            << ") - " << describe_kernel(chosen) << "\n";
  // Decode's tuning on that path (its registry entry's choices, picked for this CPU): each line
  // says whether a TOKENMIX_* switch or the automatic choice decided it.
  const auto how = [](const char* var) {
    const char* env = std::getenv(var);
    return env != nullptr && *env != '\0' ? std::string(var) + "=" + env : std::string("automatic");
  };
  const std::string path = to_string(chosen);
  std::cout << "fp8 cache:       "
            << (tuning.fp8_direct ? "direct widening into fp32 bits" : "widening through f16 bits")
            << " on " << path << " (" << how("TOKENMIX_FP8_WIDEN") << ")\n";
  std::cout << "decode prefetch: "
            << (tuning.linear_prefetch ? std::string("address order for every cache dtype")
                                       : tuning.prefetch_by_dtype)
            << " on " << path << " (" << how("TOKENMIX_LINEAR_PREFETCH") << ")\n";
  const std::string amx_how = how("TOKENMIX_DECODE_AMX");
  std::cout << "int8 decode:     "
            << (tuning.amx_int8 ? "AMX-INT8 tile products in units of >= 4 rows (cache in quads)"
                                : "FMA products (K per channel per tile: no AMX tile products)")
            << " on " << path << " (" << amx_how << ")\n";
  std::cout << "fp8 decode:      "
            << (tuning.amx_fp8 ? "AMX-BF16 tile products in units of >= 16 rows"
                               : "FMA products (K per channel per tile: no AMX tile products)")
            << " on " << path << " (" << amx_how << ")\n";
  std::cout << "bf16 decode:     "
            << (tuning.amx_bf16 ? "AMX-BF16 tile products in units of >= 32 rows"
                                : "FMA products (no AMX-BF16 tile products)")
            << " on " << path << " (" << amx_how << ")\n";
  std::cout << "threads:         " << default_threads() << " (default; --threads overrides)\n";
  return kExitOk;
}

}  // namespace

Command add_info_command(CLI::App& parent) {
  CLI::App* sub = parent.add_subcommand(
      "info", "Show the version, CPU model and features, kernel paths and the thread count");
  return {sub, [] { return run_info(); }};
}

}  // namespace tokenmix::cli
