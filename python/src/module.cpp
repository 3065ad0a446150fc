// python/src/module.cpp — the nanobind extension tokenmix._tokenmix.
//
// A thin, zero-copy layer over the public C++ API (include/tokenmix/*.hpp). Arrays arrive as
// nb::ndarray — NumPy arrays through the buffer protocol / DLPack, PyTorch CPU tensors through
// DLPack — and are wrapped, strides and all, in tokenmix::TensorView without a copy. Every
// function here takes its outputs as arguments: allocation, layouts ([B,T,H,d_h] vs
// [B,H,T,d_h]) and the choice between NumPy and PyTorch live in the Python package
// (python/tokenmix/__init__.py), which is the documented interface.
//
// Conventions:
//   * only float32 CPU arrays are accepted; anything else raises TypeError naming the argument
//     and its dtype/device (no silent conversion: a float64 input would be a hidden copy);
//   * tokenmix::ArgumentError → tokenmix.ArgumentError (a ValueError),
//     tokenmix::UnsupportedError → tokenmix.UnsupportedError (a NotImplementedError),
//     tokenmix::FileError → tokenmix.FileError (an OSError); each carries the C++ message and
//     an attribute `code` with the ErrorCode name ("shape_mismatch", ...);
//   * the GIL is released around every computation; objects (layer, cache) carry a mutex so two
//     Python threads using one object do not race.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <tuple>
#include <vector>

#include "tokenmix/tokenmix.hpp"

namespace nb = nanobind;
namespace tmx = tokenmix;
using namespace nb::literals;

namespace {

using InArray = nb::ndarray<nb::ro>;  // read-only input, any dtype (checked here), any strides
using OutArray = nb::ndarray<>;       // writable output

// ---------------------------------------------------------------------------------------------
// Errors

PyObject* g_argument_error = nullptr;
PyObject* g_unsupported_error = nullptr;
PyObject* g_file_error = nullptr;

void raise_with_code(PyObject* type, const tmx::Error& e) {
  PyObject* exc = PyObject_CallFunction(type, "s", e.what());
  if (exc == nullptr) return;  // the failed call left its own Python error set
  PyObject* code = PyUnicode_FromString(tmx::to_string(e.code()));
  if (code != nullptr) {
    PyObject_SetAttrString(exc, "code", code);
    Py_DECREF(code);
  }
  PyErr_SetObject(type, exc);
  Py_DECREF(exc);
}

void translate(const std::exception_ptr& p, void*) {
  try {
    std::rethrow_exception(p);
  } catch (const tmx::UnsupportedError& e) {
    raise_with_code(g_unsupported_error, e);
  } catch (const tmx::ArgumentError& e) {
    raise_with_code(g_argument_error, e);
  } catch (const tmx::FileError& e) {
    raise_with_code(g_file_error, e);
  } catch (const tmx::Error& e) {
    raise_with_code(g_argument_error, e);
  }
  // Anything else propagates to nanobind's own translators.
}

[[noreturn]] void type_error(const std::string& msg) { throw nb::type_error(msg.c_str()); }
[[noreturn]] void value_error(const std::string& msg) { throw nb::value_error(msg.c_str()); }

// ---------------------------------------------------------------------------------------------
// Array → TensorView

std::string dtype_name(nb::dlpack::dtype dt) {
  const auto code = static_cast<nb::dlpack::dtype_code>(dt.code);
  std::string base;
  switch (code) {
    case nb::dlpack::dtype_code::Int: base = "int"; break;
    case nb::dlpack::dtype_code::UInt: base = "uint"; break;
    case nb::dlpack::dtype_code::Float: base = "float"; break;
    case nb::dlpack::dtype_code::Bfloat: base = "bfloat"; break;
    case nb::dlpack::dtype_code::Complex: base = "complex"; break;
    case nb::dlpack::dtype_code::Bool: return "bool";
    default: base = "dtype" + std::to_string(dt.code) + "_"; break;
  }
  return base + std::to_string(dt.bits);
}

std::string shape_of(const nb::ndarray<nb::ro>& a) {
  std::string s = "(";
  for (size_t i = 0; i < a.ndim(); ++i) s += (i ? ", " : "") + std::to_string(a.shape(i));
  if (a.ndim() == 1) s += ",";
  return s + ")";
}

// Checks device, dtype (float32) and rank; `what` is "fn: name".
template <class Array>
void check_array(const Array& a, const std::string& what, size_t rank) {
  if (a.device_type() != nb::device::cpu::value) {
    type_error(what + " must be a CPU array/tensor; got device type " +
               std::to_string(a.device_type()) + " (move it with .cpu() first)");
  }
  if (a.dtype() != nb::dtype<float>()) {
    type_error(what + " has dtype " + dtype_name(a.dtype()) +
               "; tokenmix computes in float32 only (convert with .astype(numpy.float32) or "
               ".float(); no implicit conversion is made)");
  }
  if (rank != 0 && a.ndim() != rank) {
    value_error(what + " must have " + std::to_string(rank) + " dimensions; got " +
                std::to_string(a.ndim()) + " (shape " + shape_of(nb::ndarray<nb::ro>(a)) + ")");
  }
}

template <class View, class Array>
View make_view(const Array& a, const char* fn, const char* name, size_t rank) {
  check_array(a, std::string(fn) + ": " + name, rank);
  View v;
  v.data = a.data();
  v.dtype = tmx::DType::f32;
  v.rank = static_cast<int>(rank);
  for (size_t i = 0; i < rank; ++i) {
    v.shape[i] = static_cast<std::int64_t>(a.shape(i));
    v.strides[i] = a.stride(i);
  }
  if (rank == 3) {  // log-sum-exp [B, H, T]: the unused 4th axis
    v.shape[3] = 1;
    v.strides[3] = 0;
  }
  return v;
}

tmx::ConstTensorView in4(const InArray& a, const char* fn, const char* name) {
  return make_view<tmx::ConstTensorView>(a, fn, name, 4);
}
tmx::ConstTensorView in3(const InArray& a, const char* fn, const char* name) {
  return make_view<tmx::ConstTensorView>(a, fn, name, 3);
}
tmx::TensorView out4(const OutArray& a, const char* fn, const char* name) {
  return make_view<tmx::TensorView>(a, fn, name, 4);
}
tmx::TensorView out3_opt(const std::optional<OutArray>& a, const char* fn, const char* name) {
  if (!a) return {};
  return make_view<tmx::TensorView>(*a, fn, name, 3);
}

// A C-contiguous float32 array as a span (the span-based APIs: softmax, layer).
template <class Array>
bool c_contiguous(const Array& a) {
  std::int64_t expected = 1;
  for (size_t i = a.ndim(); i-- > 0;) {
    if (a.shape(i) != 1 && a.stride(i) != expected) return false;
    expected *= static_cast<std::int64_t>(a.shape(i));
  }
  return true;
}

std::span<const float> in_span(const InArray& a, const char* fn, const char* name, size_t rank) {
  check_array(a, std::string(fn) + ": " + name, rank);
  if (!c_contiguous(a)) value_error(std::string(fn) + ": " + name + " must be C-contiguous");
  return {static_cast<const float*>(a.data()), a.size()};
}
std::span<float> out_span(const OutArray& a, const char* fn, const char* name, size_t rank) {
  check_array(a, std::string(fn) + ": " + name, rank);
  if (!c_contiguous(a)) value_error(std::string(fn) + ": " + name + " must be C-contiguous");
  return {static_cast<float*>(a.data()), a.size()};
}

// ---------------------------------------------------------------------------------------------
// Options

tmx::CausalAlign parse_align(const std::string& s) {
  if (s == "bottom_right") return tmx::CausalAlign::bottom_right;
  if (s == "top_left") return tmx::CausalAlign::top_left;
  value_error("align must be 'bottom_right' or 'top_left'; got '" + s + "'");
}

tmx::RopePairing parse_pairing(const std::string& s) {
  if (s == "rotate_half") return tmx::RopePairing::rotate_half;
  if (s == "interleaved") return tmx::RopePairing::interleaved;
  value_error("pairing must be 'rotate_half' or 'interleaved'; got '" + s + "'");
}

tmx::DType parse_dtype(const std::string& s) {
  if (s == "f32" || s == "float32") return tmx::DType::f32;
  if (s == "bf16" || s == "bfloat16") return tmx::DType::bf16;
  if (s == "f16" || s == "float16") return tmx::DType::f16;
  value_error("dtype must be 'f32', 'bf16' or 'f16'; got '" + s + "'");
}

tmx::AttentionOptions attention_options(std::optional<double> scale, bool causal,
                                       const std::string& align, int threads,
                                       const std::string& isa) {
  tmx::AttentionOptions o;
  o.scale = scale;
  o.causal = causal;
  o.align = parse_align(align);
  o.threads = threads;
  o.isa = tmx::parse_isa(isa, "isa");
  return o;
}

tmx::RopeOptions rope_options(const std::string& pairing, double base, std::int64_t offset) {
  tmx::RopeOptions o;
  o.pairing = parse_pairing(pairing);
  o.base = base;
  o.position_offset = offset;
  return o;
}

// A NumPy array that views `n` floats at `data`, kept alive by `owner`.
nb::ndarray<nb::numpy, float> numpy_view(float* data, std::initializer_list<size_t> shape,
                                         nb::handle owner) {
  return nb::ndarray<nb::numpy, float>(data, shape.size(), shape.begin(), owner);
}

// ---------------------------------------------------------------------------------------------
// Objects with a lock (see the header comment).

struct PyKVCache {
  explicit PyKVCache(const tmx::KVCacheConfig& c) : cache(c) {}
  tmx::KVCache cache;
  std::mutex mutex;
};

struct PyLayer {
  explicit PyLayer(const tmx::LayerConfig& c) : layer(c) {}
  tmx::CausalSelfAttention layer;
  std::mutex mutex;
};

// Lets several arrays share one heap object (the layer's gradients) without copying.
template <class T>
nb::capsule own(T* p) {
  return nb::capsule(p, [](void* q) noexcept { delete static_cast<T*>(q); });
}

}  // namespace

NB_MODULE(_tokenmix, m) {
  m.doc() = "tokenmix native extension (use the `tokenmix` package, not this module directly)";

  g_argument_error = PyErr_NewExceptionWithDoc(
      "tokenmix.ArgumentError",
      "Invalid arguments (shapes, values, pointers, aliasing, overflow). Attribute `code` names "
      "the tokenmix ErrorCode.",
      PyExc_ValueError, nullptr);
  g_unsupported_error = PyErr_NewExceptionWithDoc(
      "tokenmix.UnsupportedError",
      "A valid request this build or CPU cannot serve (e.g. a forced ISA). Attribute `code`.",
      PyExc_NotImplementedError, nullptr);
  g_file_error = PyErr_NewExceptionWithDoc(
      "tokenmix.FileError", "A malformed or unreadable file. Attribute `code`.", PyExc_OSError,
      nullptr);
  m.attr("ArgumentError") = nb::handle(g_argument_error);
  m.attr("UnsupportedError") = nb::handle(g_unsupported_error);
  m.attr("FileError") = nb::handle(g_file_error);
  nb::register_exception_translator(translate);

  // --- attention (SPEC 4.2–4.5, backward, merge) ---------------------------------------------
  m.def(
      "attention_forward",
      [](InArray q, InArray k, InArray v, OutArray out, std::optional<OutArray> lse,
         std::optional<double> scale, bool causal, const std::string& align, int threads,
         const std::string& isa) {
        constexpr const char* fn = "attention_forward";
        const auto o = attention_options(scale, causal, align, threads, isa);
        auto qv = in4(q, fn, "q"), kv = in4(k, fn, "k"), vv = in4(v, fn, "v");
        auto ov = out4(out, fn, "out");
        auto lv = out3_opt(lse, fn, "lse");
        nb::gil_scoped_release release;
        tmx::attention_forward(qv, kv, vv, ov, lv, o);
      },
      "q"_a, "k"_a, "v"_a, "out"_a, "lse"_a.none(), "scale"_a.none(), "causal"_a, "align"_a,
      "threads"_a, "isa"_a);

  m.def(
      "attention_backward",
      [](InArray q, InArray k, InArray v, InArray out, InArray lse, InArray dout, OutArray dq,
         OutArray dk, OutArray dv, std::optional<double> scale, bool causal,
         const std::string& align, int threads, const std::string& isa) {
        constexpr const char* fn = "attention_backward";
        const auto o = attention_options(scale, causal, align, threads, isa);
        auto qv = in4(q, fn, "q"), kv = in4(k, fn, "k"), vv = in4(v, fn, "v");
        auto ov = in4(out, fn, "out"), lv = in3(lse, fn, "lse"), dov = in4(dout, fn, "dout");
        auto dqv = out4(dq, fn, "dq"), dkv = out4(dk, fn, "dk"), dvv = out4(dv, fn, "dv");
        nb::gil_scoped_release release;
        tmx::attention_backward(qv, kv, vv, ov, lv, dov, dqv, dkv, dvv, o);
      },
      "q"_a, "k"_a, "v"_a, "out"_a, "lse"_a, "dout"_a, "dq"_a, "dk"_a, "dv"_a, "scale"_a.none(),
      "causal"_a, "align"_a, "threads"_a, "isa"_a);

  m.def(
      "merge_partials",
      [](InArray o1, InArray lse1, InArray o2, InArray lse2, OutArray out, OutArray lse_out) {
        constexpr const char* fn = "merge_partials";
        auto a = in4(o1, fn, "o1"), la = in3(lse1, fn, "lse1");
        auto b = in4(o2, fn, "o2"), lb = in3(lse2, fn, "lse2");
        auto ov = out4(out, fn, "out");
        auto lv = make_view<tmx::TensorView>(lse_out, fn, "lse_out", 3);
        nb::gil_scoped_release release;
        tmx::merge_partials(a, la, b, lb, ov, lv);
      },
      "o1"_a, "lse1"_a, "o2"_a, "lse2"_a, "out"_a, "lse_out"_a);

  m.def("visible_keys",
        [](std::int64_t t, std::int64_t T_q, std::int64_t T_k, bool causal, const std::string& align) {
          return tmx::visible_keys(t, T_q, T_k, causal, parse_align(align));
        },
        "t"_a, "T_q"_a, "T_k"_a, "causal"_a, "align"_a);
  m.def("visible_pairs",
        [](std::int64_t T_q, std::int64_t T_k, bool causal, const std::string& align) {
          return tmx::visible_pairs(T_q, T_k, causal, parse_align(align));
        },
        "T_q"_a, "T_k"_a, "causal"_a, "align"_a);
  m.def("forward_flops",
        [](std::int64_t B, std::int64_t T_q, std::int64_t T_k, std::int64_t H_q, std::int64_t d_h,
           bool causal, const std::string& align) {
          return tmx::forward_flops(B, T_q, T_k, H_q, d_h, causal, parse_align(align));
        },
        "B"_a, "T_q"_a, "T_k"_a, "H_q"_a, "d_h"_a, "causal"_a, "align"_a);

  // --- RoPE (SPEC 4.1) ------------------------------------------------------------------------
  m.def(
      "rope_forward",
      [](OutArray x, const std::string& pairing, double base, std::int64_t offset) {
        const auto o = rope_options(pairing, base, offset);
        auto xv = out4(x, "rope_forward", "x");
        nb::gil_scoped_release release;
        tmx::rope_forward(xv, o);
      },
      "x"_a, "pairing"_a, "base"_a, "position_offset"_a);
  m.def(
      "rope_backward",
      [](OutArray dx, const std::string& pairing, double base, std::int64_t offset) {
        const auto o = rope_options(pairing, base, offset);
        auto xv = out4(dx, "rope_backward", "dx");
        nb::gil_scoped_release release;
        tmx::rope_backward(xv, o);
      },
      "dx"_a, "pairing"_a, "base"_a, "position_offset"_a);

  // --- softmax and its Jacobian (SPEC 4.4, 4.6–4.7) -------------------------------------------
  m.def(
      "logsumexp",
      [](InArray z) {
        auto s = in_span(z, "logsumexp", "z", 1);
        nb::gil_scoped_release release;
        return tmx::logsumexp(s);
      },
      "z"_a);
  m.def(
      "softmax_rows",
      [](InArray z, OutArray a) {
        constexpr const char* fn = "softmax_rows";
        auto zs = in_span(z, fn, "z", 2);
        auto as = out_span(a, fn, "a", 2);
        if (a.shape(0) != z.shape(0) || a.shape(1) != z.shape(1)) {
          value_error(std::string(fn) + ": a must have the shape of z " + shape_of(z) +
                      "; got " + shape_of(nb::ndarray<nb::ro>(a)));
        }
        const auto rows = static_cast<std::int64_t>(z.shape(0));
        const auto n = static_cast<std::int64_t>(z.shape(1));
        nb::gil_scoped_release release;
        tmx::softmax_rows(zs, as, rows, n);
      },
      "z"_a, "a"_a);
  m.def(
      "softmax_jacobian",
      [](InArray a, OutArray jacobian) {
        auto as = in_span(a, "softmax_jacobian", "a", 1);
        auto js = out_span(jacobian, "softmax_jacobian", "jacobian", 2);
        nb::gil_scoped_release release;
        tmx::softmax_jacobian(as, js);
      },
      "a"_a, "jacobian"_a);
  m.def(
      "softmax_jacobian_vector_product",
      [](InArray a, InArray g, OutArray out) {
        constexpr const char* fn = "softmax_jacobian_vector_product";
        auto as = in_span(a, fn, "a", 1);
        auto gs = in_span(g, fn, "g", 1);
        auto os = out_span(out, fn, "out", 1);
        nb::gil_scoped_release release;
        tmx::softmax_jacobian_vector_product(as, gs, os);
      },
      "a"_a, "g"_a, "out"_a);

  // --- runtime ------------------------------------------------------------------------------
  m.def("version", [] { return std::string(tmx::version()); });
  m.def("default_threads", &tmx::default_threads);
  m.def("available_isas", [] {
    std::vector<std::string> names;
    for (tmx::Isa i : tmx::available_isas()) names.emplace_back(tmx::to_string(i));
    return names;
  });
  m.def("resolve_isa", [](const std::string& isa) {
    return std::string(tmx::to_string(tmx::resolve_isa(tmx::parse_isa(isa, "isa"))));
  }, "isa"_a);
  m.def("describe_kernel", [](const std::string& isa) {
    return tmx::describe_kernel(tmx::parse_isa(isa, "isa"));
  }, "isa"_a);
  m.def("cpu_features", [] {
    const tmx::CpuFeatures& f = tmx::cpu_features();
    nb::dict d;
    d["model"] = f.model;
    d["avx2_fma"] = f.avx2_fma;
    d["avx512f"] = f.avx512f;
    d["avx512_bf16"] = f.avx512_bf16;
    d["amx_tile"] = f.amx_tile;
    d["flags"] = f.flags();
    return d;
  });
  m.def("kv_cache_bytes", &tmx::kv_cache_bytes, "n_layers"_a, "batch"_a, "tokens"_a, "heads_kv"_a,
        "head_dim"_a, "element_bytes"_a);

  // --- KV cache and decode (kv_cache.hpp) -----------------------------------------------------
  nb::class_<PyKVCache>(m, "KVCache")
      .def(
          "__init__",
          [](PyKVCache* self, std::int64_t layers, std::int64_t batch, std::int64_t heads_kv,
             std::int64_t head_dim, std::int64_t capacity, const std::string& dtype,
             std::int64_t block_tokens, std::int64_t pool_blocks) {
            tmx::KVCacheConfig c;
            c.layers = layers;
            c.batch = batch;
            c.heads_kv = heads_kv;
            c.head_dim = head_dim;
            c.capacity = capacity;
            c.dtype = parse_dtype(dtype);
            c.block_tokens = block_tokens;
            c.pool_blocks = pool_blocks;
            new (self) PyKVCache(c);
          },
          "layers"_a, "batch"_a, "heads_kv"_a, "head_dim"_a, "capacity"_a, "dtype"_a = "f32",
          "block_tokens"_a = 0, "pool_blocks"_a = 0)
      .def_prop_ro("layers", [](PyKVCache& s) { return s.cache.config().layers; })
      .def_prop_ro("batch", [](PyKVCache& s) { return s.cache.config().batch; })
      .def_prop_ro("heads_kv", [](PyKVCache& s) { return s.cache.config().heads_kv; })
      .def_prop_ro("head_dim", [](PyKVCache& s) { return s.cache.config().head_dim; })
      .def_prop_ro("capacity", [](PyKVCache& s) { return s.cache.config().capacity; })
      .def_prop_ro("dtype", [](PyKVCache& s) { return std::string(tmx::to_string(s.cache.config().dtype)); })
      .def_prop_ro("paged", [](PyKVCache& s) { return s.cache.paged(); })
      .def_prop_ro("block_tokens", [](PyKVCache& s) { return s.cache.block_tokens(); })
      .def_prop_ro("pool_blocks", [](PyKVCache& s) { return s.cache.pool_blocks(); })
      .def_prop_ro("free_blocks", [](PyKVCache& s) {
        std::lock_guard<std::mutex> lock(s.mutex);
        return s.cache.free_blocks();
      })
      .def_prop_ro("storage_bytes", [](PyKVCache& s) { return s.cache.storage_bytes(); })
      .def_prop_ro("memory_bytes", [](PyKVCache& s) {
        std::lock_guard<std::mutex> lock(s.mutex);
        return s.cache.memory_bytes();
      })
      .def("length", [](PyKVCache& s, std::int64_t seq, std::int64_t layer) {
        std::lock_guard<std::mutex> lock(s.mutex);
        return s.cache.length(seq, layer);
      }, "seq"_a, "layer"_a = 0)
      .def("active", [](PyKVCache& s, std::int64_t seq) {
        std::lock_guard<std::mutex> lock(s.mutex);
        return s.cache.active(seq);
      }, "seq"_a)
      .def("append", [](PyKVCache& s, std::int64_t layer, InArray k, InArray v, std::int64_t first_seq) {
        auto kv = in4(k, "KVCache.append", "k"), vv = in4(v, "KVCache.append", "v");
        nb::gil_scoped_release release;
        std::lock_guard<std::mutex> lock(s.mutex);
        s.cache.append(layer, first_seq, kv, vv);
      }, "layer"_a, "k"_a, "v"_a, "first_seq"_a = 0)
      .def("truncate", [](PyKVCache& s, std::int64_t seq, std::int64_t new_length) {
        std::lock_guard<std::mutex> lock(s.mutex);
        s.cache.truncate(seq, new_length);
      }, "seq"_a, "new_length"_a)
      .def("release", [](PyKVCache& s, std::int64_t seq) {
        std::lock_guard<std::mutex> lock(s.mutex);
        s.cache.release(seq);
      }, "seq"_a)
      .def("reset", [](PyKVCache& s, std::optional<std::int64_t> seq) {
        std::lock_guard<std::mutex> lock(s.mutex);
        if (seq) s.cache.reset(*seq); else s.cache.reset();
      }, "seq"_a = nb::none())
      .def("decode_bytes", [](PyKVCache& s, std::int64_t layer, std::int64_t first_seq, std::int64_t batch) {
        std::lock_guard<std::mutex> lock(s.mutex);
        return tmx::decode_bytes(s.cache, layer, first_seq, batch);
      }, "layer"_a, "first_seq"_a, "batch"_a);

  m.def(
      "attention_decode",
      [](InArray q, PyKVCache& cache, std::int64_t layer, OutArray out,
         std::optional<OutArray> lse, std::optional<double> scale, int threads,
         const std::string& isa, std::int64_t first_seq) {
        constexpr const char* fn = "attention_decode";
        tmx::DecodeOptions o;
        o.scale = scale;
        o.threads = threads;
        o.isa = tmx::parse_isa(isa, "isa");
        o.first_seq = first_seq;
        auto qv = in4(q, fn, "q");
        auto ov = out4(out, fn, "out");
        auto lv = out3_opt(lse, fn, "lse");
        nb::gil_scoped_release release;
        std::lock_guard<std::mutex> lock(cache.mutex);
        tmx::attention_decode(qv, cache.cache, layer, ov, lv, o);
      },
      "q"_a, "cache"_a, "layer"_a, "out"_a, "lse"_a.none(), "scale"_a.none(), "threads"_a,
      "isa"_a, "first_seq"_a);

  // --- the layer (layer.hpp) ------------------------------------------------------------------
  nb::class_<PyLayer>(m, "CausalSelfAttention")
      .def(
          "__init__",
          [](PyLayer* self, std::int64_t d_model, std::int64_t heads_q, std::int64_t heads_kv,
             std::int64_t head_dim, std::optional<std::string> rope, double rope_base,
             std::optional<double> scale, int threads, const std::string& isa) {
            tmx::LayerConfig c;
            c.d_model = d_model;
            c.heads_q = heads_q;
            c.heads_kv = heads_kv;
            c.head_dim = head_dim;
            if (rope) c.rope = rope_options(*rope, rope_base, 0);
            c.attention = attention_options(scale, true, "bottom_right", threads, isa);
            new (self) PyLayer(c);
          },
          "d_model"_a, "heads_q"_a, "heads_kv"_a, "head_dim"_a, "rope"_a.none(), "rope_base"_a,
          "scale"_a.none(), "threads"_a, "isa"_a)
      .def_prop_ro("d_model", [](PyLayer& s) { return s.layer.config().d_model; })
      .def_prop_ro("heads_q", [](PyLayer& s) { return s.layer.config().heads_q; })
      .def_prop_ro("heads_kv", [](PyLayer& s) { return s.layer.config().heads_kv; })
      .def_prop_ro("head_dim", [](PyLayer& s) { return s.layer.config().head_dim; })
      .def_prop_ro("scale", [](PyLayer& s) { return s.layer.config().attention.scale; })
      .def_prop_ro("rope", [](PyLayer& s) -> std::optional<std::string> {
        const auto& r = s.layer.config().rope;
        if (!r) return std::nullopt;
        return std::string(r->pairing == tmx::RopePairing::rotate_half ? "rotate_half" : "interleaved");
      })
      .def_prop_ro("rope_base", [](PyLayer& s) {
        const auto& r = s.layer.config().rope;
        return r ? r->base : 10000.0;
      })
      // Weights: NumPy views of the layer's own storage (writable; the view keeps the layer alive).
      .def_prop_ro("w_q", [](nb::handle h) {
        PyLayer& s = nb::cast<PyLayer&>(h);
        const auto& c = s.layer.config();
        return numpy_view(s.layer.w_q().data(), {size_t(c.d_model), size_t(c.heads_q * c.head_dim)}, h);
      }, nb::rv_policy::reference_internal)
      .def_prop_ro("w_k", [](nb::handle h) {
        PyLayer& s = nb::cast<PyLayer&>(h);
        const auto& c = s.layer.config();
        return numpy_view(s.layer.w_k().data(), {size_t(c.d_model), size_t(c.heads_kv * c.head_dim)}, h);
      }, nb::rv_policy::reference_internal)
      .def_prop_ro("w_v", [](nb::handle h) {
        PyLayer& s = nb::cast<PyLayer&>(h);
        const auto& c = s.layer.config();
        return numpy_view(s.layer.w_v().data(), {size_t(c.d_model), size_t(c.heads_kv * c.head_dim)}, h);
      }, nb::rv_policy::reference_internal)
      .def_prop_ro("w_o", [](nb::handle h) {
        PyLayer& s = nb::cast<PyLayer&>(h);
        const auto& c = s.layer.config();
        return numpy_view(s.layer.w_o().data(), {size_t(c.heads_q * c.head_dim), size_t(c.d_model)}, h);
      }, nb::rv_policy::reference_internal)
      .def("init_random", [](PyLayer& s, std::uint64_t seed) {
        nb::gil_scoped_release release;
        std::lock_guard<std::mutex> lock(s.mutex);
        s.layer.init_random(seed);
      }, "seed"_a)
      .def("forward", [](PyLayer& s, InArray u, OutArray out) {
        constexpr const char* fn = "CausalSelfAttention.forward";
        auto us = in_span(u, fn, "u", 3);
        auto os = out_span(out, fn, "out", 3);
        const auto batch = static_cast<std::int64_t>(u.shape(0));
        const auto seq = static_cast<std::int64_t>(u.shape(1));
        nb::gil_scoped_release release;
        std::lock_guard<std::mutex> lock(s.mutex);
        s.layer.forward(us, batch, seq, os);
      }, "u"_a, "out"_a)
      .def("backward", [](PyLayer& s, InArray d_out) {
        constexpr const char* fn = "CausalSelfAttention.backward";
        auto ds = in_span(d_out, fn, "d_out", 3);
        auto* g = new tmx::LayerGradients();
        nb::capsule owner = own(g);
        std::int64_t batch = 0, seq = 0;
        {
          nb::gil_scoped_release release;
          std::lock_guard<std::mutex> lock(s.mutex);
          s.layer.backward(ds, *g);
          batch = s.layer.saved().batch;
          seq = s.layer.saved().seq;
        }
        const auto& c = s.layer.config();
        const size_t d = size_t(c.d_model), hq = size_t(c.heads_q * c.head_dim),
                     hkv = size_t(c.heads_kv * c.head_dim);
        return nb::make_tuple(numpy_view(g->d_u.data(), {size_t(batch), size_t(seq), d}, owner),
                              numpy_view(g->d_w_q.data(), {d, hq}, owner),
                              numpy_view(g->d_w_k.data(), {d, hkv}, owner),
                              numpy_view(g->d_w_v.data(), {d, hkv}, owner),
                              numpy_view(g->d_w_o.data(), {hq, d}, owner));
      }, "d_out"_a)
      .def("prefill", [](PyLayer& s, InArray u, PyKVCache& cache, std::int64_t layer, OutArray out,
                         std::int64_t first_seq) {
        constexpr const char* fn = "CausalSelfAttention.prefill";
        auto us = in_span(u, fn, "u", 3);
        auto os = out_span(out, fn, "out", 3);
        const auto batch = static_cast<std::int64_t>(u.shape(0));
        const auto seq = static_cast<std::int64_t>(u.shape(1));
        nb::gil_scoped_release release;
        std::scoped_lock lock(s.mutex, cache.mutex);
        s.layer.prefill(us, batch, seq, cache.cache, layer, os, first_seq);
      }, "u"_a, "cache"_a, "layer"_a, "out"_a, "first_seq"_a)
      .def("step", [](PyLayer& s, InArray u, PyKVCache& cache, std::int64_t layer, OutArray out,
                      std::int64_t first_seq) {
        constexpr const char* fn = "CausalSelfAttention.step";
        auto us = in_span(u, fn, "u", 2);
        auto os = out_span(out, fn, "out", 2);
        const auto batch = static_cast<std::int64_t>(u.shape(0));
        nb::gil_scoped_release release;
        std::scoped_lock lock(s.mutex, cache.mutex);
        s.layer.step(us, batch, cache.cache, layer, os, first_seq);
      }, "u"_a, "cache"_a, "layer"_a, "out"_a, "first_seq"_a)
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
