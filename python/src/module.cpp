// python/src/module.cpp — the nanobind extension tokenmix._tokenmix: one bind_* call per area.
// The conventions every binding follows (zero-copy arrays, float32 only, typed errors, the GIL
// released while computing) are in bindings.hpp.
#include "bindings.hpp"

NB_MODULE(_tokenmix, m) {
  using namespace tokenmix_py;
  m.doc() = "tokenmix native extension (use the `tokenmix` package, not this module directly)";
  bind_errors(m);          // errors.cpp: first, the other areas raise these
  bind_attention(m);       // attention.cpp
  bind_ops(m);             // ops.cpp
  bind_kv_cache(m);        // kv_cache.cpp: before the layer, whose prefill/step take a KVCache
  bind_layer(m);           // layer.cpp
  bind_runtime(m);         // runtime.cpp
  bind_bench_ceilings(m);  // bench_ceilings.cpp: the benchmark ceilings (tools/bench)
}
