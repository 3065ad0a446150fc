// python/src/layer.cpp — the causal self-attention layer (include/tokenmix/layer.hpp, SPEC
// 4.1–4.5): projections, RoPE, attention, output projection; forward, backward, prefill, step.
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include <mutex>
#include <optional>
#include <string>

#include "bindings.hpp"

namespace tokenmix_py {

using namespace nb::literals;

namespace {

enum class Weight { q, k, v, o };

// A weight matrix as a writable NumPy view of the layer's storage (the view keeps the layer
// alive): W_Q [d, H_q·d_h], W_K and W_V [d, H_kv·d_h], W_O [H_q·d_h, d].
nb::ndarray<nb::numpy, float> weight_view(nb::handle h, Weight w) {
  PyLayer& s = nb::cast<PyLayer&>(h);
  const auto& c = s.layer.config();
  const size_t d = size_t(c.d_model), hq = size_t(c.heads_q * c.head_dim),
               hkv = size_t(c.heads_kv * c.head_dim);
  switch (w) {
    case Weight::q:
      return numpy_view(s.layer.w_q().data(), {d, hq}, h);
    case Weight::k:
      return numpy_view(s.layer.w_k().data(), {d, hkv}, h);
    case Weight::v:
      return numpy_view(s.layer.w_v().data(), {d, hkv}, h);
    case Weight::o:
      break;
  }
  return numpy_view(s.layer.w_o().data(), {hq, d}, h);
}

}  // namespace

void bind_layer(nb::module_& m) {
  nb::class_<PyLayer>(m, "CausalSelfAttention")
      .def(
          "__init__",
          [](PyLayer* self, std::int64_t d_model, std::int64_t heads_q, std::int64_t heads_kv,
             std::int64_t head_dim, std::optional<std::string> rope, double rope_base,
             std::optional<double> scale, IntArg threads, const std::string& isa,
             std::optional<IntArg> window, std::optional<double> softcap,
             std::optional<ArrayArg> alibi_slopes, std::optional<ArrayArg> sinks) {
            constexpr const char* fn = "CausalSelfAttention";
            tmx::LayerConfig c;
            c.d_model = d_model;
            c.heads_q = heads_q;
            c.heads_kv = heads_kv;
            c.head_dim = head_dim;
            if (rope) c.rope = rope_options(*rope, rope_base, 0);
            c.attention = attention_options(fn, scale, true, "bottom_right", threads, isa);
            // The score variants (the layer copies the ALiBi slopes and sinks it is given).
            add_variants(c.attention, fn,
                         {window, softcap, alibi_slopes, sinks, std::nullopt, std::nullopt});
            new (self) PyLayer(c);
          },
          "d_model"_a, "heads_q"_a, "heads_kv"_a, "head_dim"_a, "rope"_a.none(), "rope_base"_a,
          "scale"_a.none(), "threads"_a, "isa"_a, "window"_a.none() = nb::none(),
          "softcap"_a.none() = nb::none(), "alibi_slopes"_a.none() = nb::none(),
          "sinks"_a.none() = nb::none())
      .def_prop_ro("d_model", [](PyLayer& s) { return s.layer.config().d_model; })
      .def_prop_ro("heads_q", [](PyLayer& s) { return s.layer.config().heads_q; })
      .def_prop_ro("heads_kv", [](PyLayer& s) { return s.layer.config().heads_kv; })
      .def_prop_ro("head_dim", [](PyLayer& s) { return s.layer.config().head_dim; })
      .def_prop_ro("scale", [](PyLayer& s) { return s.layer.config().attention.scale; })
      .def_prop_ro("window", [](PyLayer& s) { return s.layer.config().attention.window; })
      .def_prop_ro("softcap", [](PyLayer& s) { return s.layer.config().attention.softcap; })
      .def_prop_ro("rope",
                   [](PyLayer& s) -> std::optional<std::string> {
                     const auto& r = s.layer.config().rope;
                     if (!r) return std::nullopt;
                     return std::string(r->pairing == tmx::RopePairing::rotate_half
                                            ? "rotate_half"
                                            : "interleaved");
                   })
      .def_prop_ro("rope_base",
                   [](PyLayer& s) {
                     const auto& r = s.layer.config().rope;
                     return r ? r->base : 10000.0;
                   })
      // Weights: NumPy views of the layer's own storage (see weight_view).
      .def_prop_ro(
          "w_q", [](nb::handle h) { return weight_view(h, Weight::q); },
          nb::rv_policy::reference_internal)
      .def_prop_ro(
          "w_k", [](nb::handle h) { return weight_view(h, Weight::k); },
          nb::rv_policy::reference_internal)
      .def_prop_ro(
          "w_v", [](nb::handle h) { return weight_view(h, Weight::v); },
          nb::rv_policy::reference_internal)
      .def_prop_ro(
          "w_o", [](nb::handle h) { return weight_view(h, Weight::o); },
          nb::rv_policy::reference_internal)
      .def(
          "init_random",
          [](PyLayer& s, std::uint64_t seed) {
            nb::gil_scoped_release release;
            std::lock_guard<std::mutex> lock(s.mutex);
            s.layer.init_random(seed);
          },
          "seed"_a)
      .def(
          "forward",
          [](PyLayer& s, ArrayArg u, ArrayArg out) {
            constexpr const char* fn = "CausalSelfAttention.forward";
            auto us = in_span(u, fn, "u", 3);
            auto os = out_span(out, fn, "out", 3);
            nb::gil_scoped_release release;
            std::lock_guard<std::mutex> lock(s.mutex);
            s.layer.forward(us.data, us.shape[0], us.shape[1], os.data);
          },
          "u"_a, "out"_a)
      .def(
          "backward",
          [](PyLayer& s, ArrayArg d_out) {
            constexpr const char* fn = "CausalSelfAttention.backward";
            auto ds = in_span(d_out, fn, "d_out", 3);
            auto* g = new tmx::LayerGradients();
            nb::capsule owner = own(g);
            std::int64_t batch = 0, seq = 0;
            {
              nb::gil_scoped_release release;
              std::lock_guard<std::mutex> lock(s.mutex);
              s.layer.backward(ds.data, *g);
              batch = s.layer.saved().batch;
              seq = s.layer.saved().seq;
            }
            const auto& c = s.layer.config();
            const size_t d = size_t(c.d_model), hq = size_t(c.heads_q * c.head_dim),
                         hkv = size_t(c.heads_kv * c.head_dim);
            nb::object d_sinks = nb::none();  // [H_q] with sinks (SPEC "Score variants")
            if (!g->d_sinks.empty())
              d_sinks = nb::cast(numpy_view(g->d_sinks.data(), {g->d_sinks.size()}, owner));
            return nb::make_tuple(numpy_view(g->d_u.data(), {size_t(batch), size_t(seq), d}, owner),
                                  numpy_view(g->d_w_q.data(), {d, hq}, owner),
                                  numpy_view(g->d_w_k.data(), {d, hkv}, owner),
                                  numpy_view(g->d_w_v.data(), {d, hkv}, owner),
                                  numpy_view(g->d_w_o.data(), {hq, d}, owner), d_sinks);
          },
          "d_out"_a)
      .def(
          "prefill",
          [](PyLayer& s, ArrayArg u, PyKVCache& cache, std::int64_t layer, ArrayArg out,
             std::int64_t first_seq) {
            constexpr const char* fn = "CausalSelfAttention.prefill";
            auto us = in_span(u, fn, "u", 3);
            auto os = out_span(out, fn, "out", 3);
            nb::gil_scoped_release release;
            std::scoped_lock lock(s.mutex, cache.mutex);
            s.layer.prefill(us.data, us.shape[0], us.shape[1], cache.cache, layer, os.data,
                            first_seq);
          },
          "u"_a, "cache"_a, "layer"_a, "out"_a, "first_seq"_a)
      .def(
          "step",
          [](PyLayer& s, ArrayArg u, PyKVCache& cache, std::int64_t layer, ArrayArg out,
             std::int64_t first_seq) {
            constexpr const char* fn = "CausalSelfAttention.step";
            auto us = in_span(u, fn, "u", 2);
            auto os = out_span(out, fn, "out", 2);
            nb::gil_scoped_release release;
            std::scoped_lock lock(s.mutex, cache.mutex);
            s.layer.step(us.data, us.shape[0], cache.cache, layer, os.data, first_seq);
          },
          "u"_a, "cache"_a, "layer"_a, "out"_a, "first_seq"_a)
      // Attention-core tensors of the last forward, copied (the layer overwrites them).
      .def("saved", [](PyLayer& s) {
        tmx::CausalSelfAttention::Saved* copy = nullptr;
        {
          nb::gil_scoped_release release;
          std::lock_guard<std::mutex> lock(s.mutex);
          copy = new tmx::CausalSelfAttention::Saved(s.layer.saved());
        }
        nb::capsule owner = own(copy);
        const auto& c = s.layer.config();
        const size_t B = size_t(copy->batch), T = size_t(copy->seq), hq = size_t(c.heads_q),
                     hkv = size_t(c.heads_kv), dh = size_t(c.head_dim);
        nb::dict d;
        d["q"] = numpy_view(copy->q.data(), {B, T, hq, dh}, owner);
        d["k"] = numpy_view(copy->k.data(), {B, T, hkv, dh}, owner);
        d["v"] = numpy_view(copy->v.data(), {B, T, hkv, dh}, owner);
        d["y"] = numpy_view(copy->y.data(), {B, T, hq, dh}, owner);
        d["lse"] = numpy_view(copy->lse.data(), {B, hq, T}, owner);
        return d;
      });
}

}  // namespace tokenmix_py
