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
  const bool fp8_direct = fp8_direct_widening();   // may throw (bad TOKENMIX_FP8_WIDEN): ditto
  const bool linear = linear_decode_prefetch();    // may throw (bad TOKENMIX_LINEAR_PREFETCH)
  // May throw (bad TOKENMIX_DECODE_AMX, or `on` where a cache's tile products cannot run).
  const bool amx_int8 = decode_amx(DType::int8), amx_fp8 = decode_amx(DType::fp8_e4m3),
             amx_bf16 = decode_amx(DType::bf16);
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
  const char* widen_env = std::getenv("TOKENMIX_FP8_WIDEN");
  const bool widen_forced = widen_env != nullptr && *widen_env != '\0';
  std::cout << "fp8 cache:       " << (fp8_direct ? "direct" : "f16")
            << " widening on avx512/avx2 ("
            << (widen_forced ? std::string("TOKENMIX_FP8_WIDEN=") + widen_env
                             : std::string("automatic"))
            << ")\n";
  const char* linear_env = std::getenv("TOKENMIX_LINEAR_PREFETCH");
  const bool linear_forced = linear_env != nullptr && *linear_env != '\0';
  std::cout << "decode prefetch: address order for "
            << (linear ? "every cache dtype"
                       : "f32 on avx512, all but int8/fp8 on avx2 (the others row by row)")
            << " ("
            << (linear_forced ? std::string("TOKENMIX_LINEAR_PREFETCH=") + linear_env
                              : std::string("automatic"))
            << ")\n";
  const char* amx_env = std::getenv("TOKENMIX_DECODE_AMX");
  const bool amx_forced = amx_env != nullptr && *amx_env != '\0';
  const std::string amx_how =
      amx_forced ? std::string("TOKENMIX_DECODE_AMX=") + amx_env : std::string("automatic");
  std::cout << "int8 decode:     "
            << (amx_int8 ? "AMX-INT8 tile products in units of >= 4 rows on avx512"
                         : "FMA products (no AMX-INT8 tile products)")
            << " (" << amx_how << ")\n";
  std::cout << "fp8 decode:      "
            << (amx_fp8 ? "AMX-BF16 tile products in units of >= 16 rows on avx512"
                        : "FMA products (no AMX-BF16 tile products)")
            << " (" << amx_how << ")\n";
  std::cout << "bf16 decode:     "
            << (amx_bf16 ? "AMX-BF16 tile products in units of >= 32 rows on avx512"
                         : "FMA products (no AMX-BF16 tile products)")
            << " (" << amx_how << ")\n";
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
