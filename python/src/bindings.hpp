// python/src/bindings.hpp — what the translation units of the extension tokenmix._tokenmix share.
//
// A thin, zero-copy layer over the public C++ API (include/tokenmix/*.hpp). Arrays arrive as
// Python objects (NumPy arrays through DLPack / the buffer protocol, PyTorch CPU tensors through
// DLPack) and are wrapped, strides and all, in tokenmix::TensorView without a copy. Every
// function takes its outputs as arguments: allocation, layouts ([B,T,H,d_h] vs [B,H,T,d_h]) and
// the choice between NumPy and PyTorch live in the Python package (python/tokenmix), which is
// the documented interface.
//
// Conventions (the same in every bind_* function):
//   * only native-endian float32 CPU arrays are accepted — the attention tensors may also be
//     bfloat16 or float16, all of one call in one dtype (in_float, check_same_dtype); anything
//     else raises TypeError naming the argument and what it got (no silent conversion: a float64
//     input would be a hidden copy);
//   * an array argument is taken as an `ArrayArg` (any Python object) and converted inside the
//     function (in4, out4, in_span, ...), so a failed conversion is reported with the function,
//     the argument and the reason — never nanobind's generic "incompatible function arguments";
//   * tokenmix::ArgumentError → tokenmix.ArgumentError (a ValueError),
//     tokenmix::UnsupportedError → tokenmix.UnsupportedError (a NotImplementedError),
//     tokenmix::FileError → tokenmix.FileError (an OSError),
//     tokenmix::ResourceError → tokenmix.ResourceError (a MemoryError); each carries the C++
//     message and an attribute `code` with the ErrorCode name ("shape_mismatch", ...);
//   * the GIL is released around every computation; objects (layer, cache) carry a mutex so two
//     Python threads using one object do not race.
//
// Files: errors.cpp (exception types, translator), convert.cpp (arrays, options), attention.cpp,
// ops.cpp (RoPE, softmax, merge), kv_cache.cpp (cache, decode), layer.cpp, runtime.cpp,
// bench_ceilings.cpp (the benchmark ceilings of tools/bench, for tokenmix.bench) and module.cpp
// (NB_MODULE, calling each bind_* in turn).
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <array>
#include <cstdint>
#include <initializer_list>
#include <mutex>
#include <optional>
#include <span>
#include <string>

#include "tokenmix/tokenmix.hpp"

namespace tokenmix_py {

namespace nb = nanobind;
namespace tmx = tokenmix;

/// An array argument exactly as Python passed it; converted by in4/out4/in_span/... below.
struct ArrayArg {
  nb::handle obj;
};

/// An integer argument exactly as Python passed it (an int of any size, a NumPy integer, ...);
/// converted by thread_count below, which names the argument when it does not fit.
struct IntArg {
  nb::handle obj;
};

}  // namespace tokenmix_py

namespace nanobind::detail {

/// Accept any object (None only where the argument is declared `.none()`), so the conversion
/// and its error message happen in the function body, which knows the function and argument.
template <class Arg>
struct any_object_caster {
  template <class Flags>  // uint8_t in nanobind 2, uint32_t in nanobind 3
  bool from_python(handle src, Flags, cleanup_list*) noexcept {
    static_cast<type_caster<Arg>*>(this)->value.obj = src;
    return true;
  }
};
template <>
struct type_caster<tokenmix_py::ArrayArg> : any_object_caster<tokenmix_py::ArrayArg> {
  NB_TYPE_CASTER(tokenmix_py::ArrayArg, const_name("Array"))
};
template <>
struct type_caster<tokenmix_py::IntArg> : any_object_caster<tokenmix_py::IntArg> {
  NB_TYPE_CASTER(tokenmix_py::IntArg, const_name("int"))
};

}  // namespace nanobind::detail

namespace tokenmix_py {

// ---------------------------------------------------------------------------------------------
// Errors (errors.cpp)

/// Creates tokenmix.ArgumentError, UnsupportedError, FileError and ResourceError in `m` and
/// registers the translator of tokenmix::Error. Must run before any other bind_* function.
void bind_errors(nb::module_& m);

[[noreturn]] void type_error(const std::string& msg);
[[noreturn]] void value_error(const std::string& msg);
/// Throws tokenmix::ArgumentError(code, msg); the translator turns it into tokenmix.ArgumentError.
[[noreturn]] void argument_error(tmx::ErrorCode code, const std::string& msg);

// ---------------------------------------------------------------------------------------------
// Arrays → views (convert.cpp). `fn` is the entry point, `name` the argument ("q", "out", ...).

using InArray = nb::ndarray<nb::ro>;  // read-only input, any dtype (checked), any strides
using OutArray = nb::ndarray<>;       // writable output

tmx::ConstTensorView in4(const ArrayArg& a, const char* fn, const char* name);
tmx::ConstTensorView in3(const ArrayArg& a, const char* fn, const char* name);
tmx::TensorView out4(const ArrayArg& a, const char* fn, const char* name);
tmx::TensorView out3(const ArrayArg& a, const char* fn, const char* name);
tmx::TensorView out3_opt(const std::optional<ArrayArg>& a, const char* fn, const char* name);

/// The attention tensors (q, k, v, out, dout, dq, dk, dv; SPEC "Reduced precision"): rank
/// `rank`, float32, bfloat16 or float16 — NumPy float16 and ml_dtypes.bfloat16 arrays (the
/// latter through its uint16 view: NumPy exports bfloat16 neither by DLPack nor by the buffer
/// protocol), torch.bfloat16 and torch.float16 tensors — zero-copy, strides kept. Another dtype →
/// TypeError naming the argument and the three dtypes. One call's tensors must share the dtype:
/// check_same_dtype.
tmx::ConstTensorView in_float(const ArrayArg& a, const char* fn, const char* name, size_t rank);
tmx::TensorView out_float(const ArrayArg& a, const char* fn, const char* name, size_t rank);

/// An argument name and its dtype, for check_same_dtype.
struct NamedView {
  const char* name;
  tmx::DType dtype;
};
/// TypeError "<fn>: <name> has dtype X but <first> has Y; <all names> must have one dtype ..."
/// unless every view has the first one's dtype (mixed dtypes in one call; L stays float32 and is
/// not listed).
void check_same_dtype(const char* fn, std::initializer_list<NamedView> views);
/// "float32", "bfloat16", "float16", "bool", "int32", "int64": NumPy's name of a dtype.
const char* python_dtype_name(tmx::DType d);

/// Views of the variant arguments (masks, key lengths, varlen offsets, ALiBi slopes, sinks):
/// rank `rank` (the unused trailing axes size 1, stride 0), dtype one of `allowed` (another →
/// TypeError naming the argument and the allowed dtypes), any strides (0 broadcasts).
tmx::ConstTensorView in_typed(const ArrayArg& a, const char* fn, const char* name, size_t rank,
                              std::initializer_list<tmx::DType> allowed);
tmx::ConstTensorView in_typed_opt(const std::optional<ArrayArg>& a, const char* fn,
                                  const char* name, size_t rank,
                                  std::initializer_list<tmx::DType> allowed);
tmx::TensorView out_typed_opt(const std::optional<ArrayArg>& a, const char* fn, const char* name,
                              size_t rank, std::initializer_list<tmx::DType> allowed);

/// A C-contiguous float32 array seen as a span, with its shape (the span-based APIs: softmax,
/// the layer). Points into the argument's own memory, which the caller holds for the call.
template <class T>
struct SpanArg {
  std::span<T> data;
  std::array<std::int64_t, 4> shape{};  ///< the first `rank` entries are the array's shape
};
SpanArg<const float> in_span(const ArrayArg& a, const char* fn, const char* name, size_t rank);
SpanArg<float> out_span(const ArrayArg& a, const char* fn, const char* name, size_t rank);

/// "(2, 3)" — a shape as Python prints it.
std::string shape_string(const std::int64_t* shape, size_t rank);

// ---------------------------------------------------------------------------------------------
// Options (convert.cpp)

/// "bottom_right" | "top_left" through tokenmix::parse_causal_align (the one spelling and parser
/// of the library and the CLI): another value → tokenmix.ArgumentError (a ValueError, code
/// "invalid_argument") whose message starts "<fn>: align must be one of bottom_right, top_left".
tmx::CausalAlign parse_align(const char* fn, const std::string& s);
tmx::RopePairing parse_pairing(const std::string& s);
tmx::DType parse_dtype(const std::string& s);
/// A thread count from any Python integer (int of any size, NumPy integer): outside
/// [0, INT_MAX] → ArgumentError naming `fn` and `threads`, not an integer → TypeError (nanobind's
/// own int caster would only say "incompatible function arguments").
int thread_count(const IntArg& threads, const char* fn);
/// A size (the useful-work counts' T_q, B, ...) from any Python integer: beyond int64 →
/// ArgumentError(overflow) naming `fn` and `name`, not an integer → TypeError; the range the
/// size must be in is the library's to check (ArgumentError, e.g. a negative T_q).
std::int64_t int64_arg(const IntArg& arg, const char* fn, const char* name);
tmx::AttentionOptions attention_options(const char* fn, std::optional<double> scale, bool causal,
                                        const std::string& align, const IntArg& threads,
                                        const std::string& isa);
/// The score-variant arguments of the attention entry points (SPEC "Score variants used by real
/// models"), exactly as Python passed them; None = off.
struct VariantArgs {
  std::optional<IntArg> window;          ///< W ≥ 1 (the library checks the range)
  std::optional<double> softcap;         ///< c > 0
  std::optional<ArrayArg> alibi_slopes;  ///< [H_q] float32
  std::optional<ArrayArg> sinks;         ///< [H_q] float32
  std::optional<ArrayArg> mask;          ///< [B, H_q, T_q, T_k] bool or float32, broadcastable
  std::optional<ArrayArg> key_lengths;   ///< [B] int32 or int64
};
/// Fills the variant fields of `o` (views of the arrays, no copy); errors name `fn`.
void add_variants(tmx::AttentionOptions& o, const char* fn, const VariantArgs& va);
/// Sets o.dropout from the bindings' dropout_p, dropout_seed (any int64, used as its 64 bits)
/// and dropout_offset (>= 0; the library checks < 2^32 and p); errors name `fn`.
void add_dropout(tmx::AttentionOptions& o, const char* fn, double p, const IntArg& seed,
                 const IntArg& offset);
tmx::RopeOptions rope_options(const std::string& pairing, double base, std::int64_t offset);

/// A NumPy array that views float32 `data` of `shape`, kept alive by `owner`.
nb::ndarray<nb::numpy, float> numpy_view(float* data, std::initializer_list<size_t> shape,
                                         nb::handle owner);

/// Lets several arrays share one heap object (the layer's gradients) without copying.
template <class T>
nb::capsule own(T* p) {
  return nb::capsule(p, [](void* q) noexcept { delete static_cast<T*>(q); });
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

// ---------------------------------------------------------------------------------------------
// The areas, one translation unit each.

void bind_attention(nb::module_& m);  // attention_forward/backward, useful-work counts
void bind_ops(nb::module_& m);        // RoPE, softmax and its Jacobian, merge_partials
void bind_kv_cache(nb::module_& m);   // KVCache, attention_decode, kv_cache_bytes
void bind_layer(nb::module_& m);      // CausalSelfAttention (needs KVCache bound first)
void bind_runtime(nb::module_& m);    // version, ISAs, CPU features, threads
/// The benchmark ceilings of tools/bench/ceilings.hpp (tokenmix_ceilings), for tokenmix.bench.
void bind_bench_ceilings(nb::module_& m);

}  // namespace tokenmix_py
