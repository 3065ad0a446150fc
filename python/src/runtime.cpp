// python/src/runtime.cpp — version, kernel paths (ISAs), CPU features and the TOKENMIX_CPU_CAP
// cap, default thread count (include/tokenmix/runtime.hpp).
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <optional>
#include <string>
#include <vector>

#include "bindings.hpp"

namespace tokenmix_py {

using namespace nb::literals;

void bind_runtime(nb::module_& m) {
  m.def("version", [] { return std::string(tmx::version()); });
  m.def("default_threads", &tmx::default_threads);
  m.def("available_isas", [] {
    std::vector<std::string> names;
    for (tmx::Isa i : tmx::available_isas()) names.emplace_back(tmx::to_string(i));
    return names;
  });
  m.def(
      "resolve_isa",
      [](const std::string& isa) {
        return std::string(tmx::to_string(tmx::resolve_isa(tmx::parse_isa(isa, "isa"))));
      },
      "isa"_a);
  m.def(
      "describe_kernel",
      [](const std::string& isa) { return tmx::describe_kernel(tmx::parse_isa(isa, "isa")); },
      "isa"_a);
  // The TOKENMIX_CPU_CAP cap in effect (read at each call): None when there is none.
  m.def("cpu_cap", []() -> std::optional<std::string> {
    const tmx::Isa cap = tmx::cpu_cap();
    if (cap == tmx::Isa::automatic) return std::nullopt;
    return std::string(tmx::to_string(cap));
  });
  // How the avx512 decode kernel widens an fp8 E4M3 cache (TOKENMIX_FP8_WIDEN, read at each
  // call): True = straight into fp32 bits, False = through f16 bits.
  m.def("fp8_direct_widening", [] { return tmx::fp8_direct_widening(); });
  // Which caches the avx512 / avx2 decode kernels prefetch in address order
  // (TOKENMIX_LINEAR_PREFETCH, read at each call): True = every cache dtype, False = each path's
  // per-dtype choice.
  m.def("linear_decode_prefetch", [] { return tmx::linear_decode_prefetch(); });
  // Whether int8-, fp8- or bf16-cache decode on the avx512 paths runs its products on AMX tiles
  // (TOKENMIX_DECODE_AMX, read at each call; asks Linux for the tile data the first time).
  m.def(
      "decode_amx",
      [](const std::string& cache_dtype) { return tmx::decode_amx(parse_dtype(cache_dtype)); },
      "cache_dtype"_a = "int8");
  m.def("cpu_features", [] {
    const tmx::CpuFeatures& f = tmx::cpu_features();
    nb::dict d;
    d["model"] = f.model;
    d["avx2_fma"] = f.avx2_fma;
    d["avx512f"] = f.avx512f;
    d["avx512_bf16"] = f.avx512_bf16;
    d["amx_tile"] = f.amx_tile;
    d["amx_int8"] = f.amx_int8;
    d["amx_bf16"] = f.amx_bf16;
    d["neon"] = f.neon;
    d["flags"] = f.flags();
    return d;
  });
}

}  // namespace tokenmix_py
