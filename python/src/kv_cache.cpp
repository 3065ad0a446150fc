// python/src/kv_cache.cpp — the KV cache (include/tokenmix/kv_cache.hpp, SPEC 4.8) and decode:
// attention of new queries against a cache, "bottom_right" causal (SPEC 4.3), with the score
// variants window, softcap, ALiBi and sinks, and rolling caches for sliding-window layers.
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "bindings.hpp"

namespace tokenmix_py {

using namespace nb::literals;

void bind_kv_cache(nb::module_& m) {
  m.def("kv_cache_bytes", &tmx::kv_cache_bytes, "n_layers"_a, "batch"_a, "tokens"_a, "heads_kv"_a,
        "head_dim"_a, "element_bytes"_a);

  nb::class_<PyKVCache>(m, "KVCache")
      .def(
          "__init__",
          [](PyKVCache* self, std::int64_t layers, std::int64_t batch, std::int64_t heads_kv,
             std::int64_t head_dim, std::int64_t capacity, const std::string& dtype,
             std::int64_t block_tokens, std::int64_t pool_blocks, std::int64_t window,
             std::optional<bool> int8_quads) {
            tmx::KVCacheConfig c;
            c.layers = layers;
            c.batch = batch;
            c.heads_kv = heads_kv;
            c.head_dim = head_dim;
            c.capacity = capacity;
            c.dtype = parse_dtype(dtype);
            c.block_tokens = block_tokens;
            c.pool_blocks = pool_blocks;
            c.window = window;
            c.int8_quads = int8_quads;
            new (self) PyKVCache(c);
          },
          "layers"_a, "batch"_a, "heads_kv"_a, "head_dim"_a, "capacity"_a, "dtype"_a = "f32",
          "block_tokens"_a = 0, "pool_blocks"_a = 0, "window"_a = 0, "int8_quads"_a = nb::none())
      .def_prop_ro("layers", [](PyKVCache& s) { return s.cache.config().layers; })
      .def_prop_ro("batch", [](PyKVCache& s) { return s.cache.config().batch; })
      .def_prop_ro("heads_kv", [](PyKVCache& s) { return s.cache.config().heads_kv; })
      .def_prop_ro("head_dim", [](PyKVCache& s) { return s.cache.config().head_dim; })
      .def_prop_ro("capacity", [](PyKVCache& s) { return s.cache.config().capacity; })
      .def_prop_ro("dtype",
                   [](PyKVCache& s) { return std::string(tmx::to_string(s.cache.config().dtype)); })
      .def_prop_ro("paged", [](PyKVCache& s) { return s.cache.paged(); })
      .def_prop_ro("int8_quads", [](PyKVCache& s) { return s.cache.int8_quads(); })
      .def_prop_ro("window", [](PyKVCache& s) { return s.cache.window(); })
      .def_prop_ro("retained_positions", [](PyKVCache& s) { return s.cache.retained_positions(); })
      .def_prop_ro("block_tokens", [](PyKVCache& s) { return s.cache.block_tokens(); })
      .def_prop_ro("pool_blocks", [](PyKVCache& s) { return s.cache.pool_blocks(); })
      .def_prop_ro("free_blocks",
                   [](PyKVCache& s) {
                     std::lock_guard<std::mutex> lock(s.mutex);
                     return s.cache.free_blocks();
                   })
      .def_prop_ro("storage_bytes", [](PyKVCache& s) { return s.cache.storage_bytes(); })
      .def_prop_ro("memory_bytes",
                   [](PyKVCache& s) {
                     std::lock_guard<std::mutex> lock(s.mutex);
                     return s.cache.memory_bytes();
                   })
      .def(
          "length",
          [](PyKVCache& s, std::int64_t seq, std::int64_t layer) {
            std::lock_guard<std::mutex> lock(s.mutex);
            return s.cache.length(seq, layer);
          },
          "seq"_a, "layer"_a = 0)
      .def(
          "first_position",
          [](PyKVCache& s, std::int64_t seq, std::int64_t layer) {
            std::lock_guard<std::mutex> lock(s.mutex);
            return s.cache.first_position(seq, layer);
          },
          "seq"_a, "layer"_a = 0)
      .def(
          "active",
          [](PyKVCache& s, std::int64_t seq) {
            std::lock_guard<std::mutex> lock(s.mutex);
            return s.cache.active(seq);
          },
          "seq"_a)
      .def(
          "append",
          [](PyKVCache& s, std::int64_t layer, ArrayArg k, ArrayArg v, std::int64_t first_seq) {
            constexpr const char* fn = "KVCache.append";
            auto kv = in4(k, fn, "k"), vv = in4(v, fn, "v");
            nb::gil_scoped_release release;
            std::lock_guard<std::mutex> lock(s.mutex);
            s.cache.append(layer, first_seq, kv, vv);
          },
          "layer"_a, "k"_a, "v"_a, "first_seq"_a = 0)
      .def(
          "truncate",
          [](PyKVCache& s, std::int64_t seq, std::int64_t new_length) {
            std::lock_guard<std::mutex> lock(s.mutex);
            s.cache.truncate(seq, new_length);
          },
          "seq"_a, "new_length"_a)
      .def(
          "copy_sequences",
          [](PyKVCache& s, PyKVCache& source, std::vector<std::int64_t> sources) {
            nb::gil_scoped_release release;
            if (&source == &s) {
              std::lock_guard<std::mutex> lock(s.mutex);
              s.cache.copy_sequences(s.cache, sources);
            } else {
              std::scoped_lock lock(s.mutex, source.mutex);
              s.cache.copy_sequences(source.cache, sources);
            }
          },
          "source"_a, "sources"_a)
      .def(
          "release",
          [](PyKVCache& s, std::int64_t seq) {
            std::lock_guard<std::mutex> lock(s.mutex);
            s.cache.release(seq);
          },
          "seq"_a)
      .def(
          "reset",
          [](PyKVCache& s, std::optional<std::int64_t> seq) {
            std::lock_guard<std::mutex> lock(s.mutex);
            if (seq) {
              s.cache.reset(*seq);
            } else {
              s.cache.reset();
            }
          },
          "seq"_a = nb::none())
      .def(
          "decode_bytes",
          [](PyKVCache& s, std::int64_t layer, std::int64_t first_seq, std::int64_t batch,
             std::int64_t window, std::int64_t tnew) {
            std::lock_guard<std::mutex> lock(s.mutex);
            return tmx::decode_bytes(s.cache, layer, first_seq, batch, window, tnew);
          },
          "layer"_a, "first_seq"_a, "batch"_a, "window"_a = 0, "tnew"_a = 1);

  m.def(
      "attention_decode",
      [](ArrayArg q, PyKVCache& cache, std::int64_t layer, ArrayArg out,
         std::optional<ArrayArg> lse, std::optional<double> scale, IntArg threads,
         const std::string& isa, std::int64_t first_seq, std::optional<IntArg> window,
         std::optional<double> softcap, std::optional<ArrayArg> alibi_slopes,
         std::optional<ArrayArg> sinks) {
        constexpr const char* fn = "attention_decode";
        tmx::DecodeOptions o;
        o.scale = scale;
        o.threads = thread_count(threads, fn);
        o.isa = tmx::parse_isa(isa, "isa");
        o.first_seq = first_seq;
        tmx::AttentionOptions variants;  // the one conversion of the variant arguments
        add_variants(variants, fn,
                     {window, softcap, alibi_slopes, sinks, std::nullopt, std::nullopt});
        o.window = variants.window;
        o.softcap = variants.softcap;
        o.alibi_slopes = variants.alibi_slopes;
        o.sinks = variants.sinks;
        // q and out: float32, bfloat16 or float16 (one dtype) on a cache of any dtype.
        auto qv = in_float(q, fn, "q", 4);
        auto ov = out_float(out, fn, "out", 4);
        check_same_dtype(fn, {{"q", qv.dtype}, {"out", ov.dtype}});
        auto lv = out3_opt(lse, fn, "lse");
        nb::gil_scoped_release release;
        std::lock_guard<std::mutex> lock(cache.mutex);
        tmx::attention_decode(qv, cache.cache, layer, ov, lv, o);
      },
      "q"_a, "cache"_a, "layer"_a, "out"_a, "lse"_a.none(), "scale"_a.none(), "threads"_a, "isa"_a,
      "first_seq"_a, "window"_a.none() = nb::none(), "softcap"_a.none() = nb::none(),
      "alibi_slopes"_a.none() = nb::none(), "sinks"_a.none() = nb::none());
}

}  // namespace tokenmix_py
