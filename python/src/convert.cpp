// python/src/convert.cpp — Python arguments → tokenmix views, spans and options.
//
// Arrays are imported without a copy (DLPack or the buffer protocol) and checked here: CPU,
// native-endian float32 (the attention tensors: float32, bfloat16 or float16), the expected rank.
// A NumPy array of ml_dtypes.bfloat16 is imported as its uint16 view (NumPy exports that dtype
// neither through DLPack nor through the buffer protocol): same memory, same strides. An object
// nanobind cannot import as an array is diagnosed (diagnose_array) so the error names the function,
// the argument and the reason: a non-native byte order ('>f4') is a TypeError like any other dtype,
// a byte stride that is not a multiple of the element size an ArgumentError (tokenmix views address
// whole elements).
#include <bit>
#include <climits>
#include <optional>
#include <string>

#include "bindings.hpp"

namespace tokenmix_py {
namespace {

std::string dtype_name(nb::dlpack::dtype dt) {
  const auto code = static_cast<nb::dlpack::dtype_code>(dt.code);
  std::string base;
  switch (code) {
    case nb::dlpack::dtype_code::Int:
      base = "int";
      break;
    case nb::dlpack::dtype_code::UInt:
      base = "uint";
      break;
    case nb::dlpack::dtype_code::Float:
      base = "float";
      break;
    case nb::dlpack::dtype_code::Bfloat:
      base = "bfloat";
      break;
    case nb::dlpack::dtype_code::Complex:
      base = "complex";
      break;
    case nb::dlpack::dtype_code::Bool:
      return "bool";
    default:
      base = "dtype" + std::to_string(dt.code) + "_";
      break;
  }
  return base + std::to_string(dt.bits);
}

template <class Array>
std::string array_shape(const Array& a) {
  std::int64_t shape[8] = {};
  const size_t rank = a.ndim() < 8 ? a.ndim() : 8;
  for (size_t i = 0; i < rank; ++i) shape[i] = static_cast<std::int64_t>(a.shape(i));
  return shape_string(shape, rank);
}

// What the attention tensors may be (the message of a wrong dtype).
constexpr const char* kFloatingExpected =
    "expected float32, bfloat16 (ml_dtypes.bfloat16 / torch.bfloat16) or float16 (no implicit "
    "conversion is made)";

// The NumPy dtype string of native float32: '<f4' on little-endian machines.
constexpr const char* kNativeF32 = std::endian::native == std::endian::little ? "<f4" : ">f4";

std::string py_str(nb::handle h) {
  return nb::str(h).c_str();
}

// Why `obj` could not be imported as an array (nanobind's importer only says "no"). Raises.
// Which dtypes an argument may have, for the messages of diagnose_array and check_array.
enum class Accept {
  f32,       // float32 only (every float array but the attention tensors)
  floating,  // float32, bfloat16 or float16 (q, k, v, out, dout, dq, dk, dv)
  any,       // checked later against a list (in_typed: masks, offsets, ...)
};

// NumPy's float16, or an ml_dtypes.bfloat16 dtype object.
bool numpy_half(nb::handle dtype) {
  const std::string name = py_str(dtype.attr("name"));
  return name == "float16" || name == "bfloat16";
}

[[noreturn]] void diagnose_array(nb::handle obj, const std::string& what, bool writable,
                                 Accept accept) {
  const std::string type_name = nb::type_name(obj.type()).c_str();
  if (obj.is_none()) type_error(what + " must be a numpy.ndarray or a torch.Tensor; got None");
  // NumPy arrays (and look-alikes): dtype byte order, byte strides, writability.
  if (nb::hasattr(obj, "dtype") && nb::hasattr(obj, "strides") && nb::hasattr(obj, "flags")) {
    nb::object dtype = obj.attr("dtype");
    if (nb::hasattr(dtype, "isnative") && !nb::cast<bool>(dtype.attr("isnative"))) {
      type_error(what + " has dtype '" + py_str(dtype.attr("str")) +
                 "' (non-native byte order); expected native-endian float32 ('" + kNativeF32 +
                 "'): convert with .astype(numpy.float32) (no implicit conversion is made)");
    }
    const auto itemsize = nb::cast<std::int64_t>(dtype.attr("itemsize"));
    for (nb::handle s : nb::iter(obj.attr("strides"))) {
      const auto stride = nb::cast<std::int64_t>(s);
      if (itemsize > 0 && stride % itemsize != 0) {
        argument_error(tmx::ErrorCode::invalid_argument,
                       what + " has a byte stride of " + std::to_string(stride) +
                           ", not a multiple of its element size (" + std::to_string(itemsize) +
                           " bytes; strides " + py_str(obj.attr("strides")) +
                           "); tokenmix addresses whole elements: copy it with "
                           "numpy.ascontiguousarray first");
      }
    }
    const bool f32 = py_str(dtype.attr("char")) == "f";
    if (accept == Accept::f32 && !f32) {
      type_error(what + " has dtype " + py_str(dtype) +
                 "; tokenmix computes in float32 only (convert with .astype(numpy.float32); no "
                 "implicit conversion is made)");
    }
    if (accept == Accept::floating && !f32 && !numpy_half(dtype)) {
      type_error(what + " has dtype " + py_str(dtype) + "; " + kFloatingExpected);
    }
    if (writable && !nb::cast<bool>(obj.attr("flags").attr("writeable"))) {
      value_error(what + " is read-only; outputs must be writable");
    }
  }
  // Anything with __dlpack__ (PyTorch, ...): its own refusal says why.
  if (nb::hasattr(obj, "__dlpack__")) {
    try {
      obj.attr("__dlpack__")();
    } catch (const nb::python_error& e) {
      type_error(what + " (" + type_name +
                 ") cannot be passed without a copy: " + py_str(e.value()));
    }
  }
  type_error(what + " must be a numpy.ndarray or a torch.Tensor (float32, on the CPU); got " +
             type_name);
}

// An imported array. A NumPy ml_dtypes.bfloat16 array arrives as its uint16 view (`bf16_bits`).
template <class Array>
struct Imported {
  Array array;
  bool bf16_bits = false;
};

constexpr nb::dlpack::dtype kF16{static_cast<std::uint8_t>(nb::dlpack::dtype_code::Float), 16, 1};
constexpr nb::dlpack::dtype kBF16{static_cast<std::uint8_t>(nb::dlpack::dtype_code::Bfloat), 16, 1};

// The tokenmix dtype of an imported array, if it is one the library takes.
template <class Array>
std::optional<tmx::DType> library_dtype(const Imported<Array>& im) {
  const nb::dlpack::dtype dt = im.array.dtype();
  if (im.bf16_bits) return tmx::DType::bf16;  // always a uint16 view (import_array)
  if (dt == nb::dtype<float>()) return tmx::DType::f32;
  if (dt == kBF16) return tmx::DType::bf16;
  if (dt == kF16) return tmx::DType::f16;
  if (dt == nb::dtype<bool>()) return tmx::DType::boolean;
  if (dt == nb::dtype<std::int32_t>()) return tmx::DType::i32;
  if (dt == nb::dtype<std::int64_t>()) return tmx::DType::i64;
  return std::nullopt;
}

template <class Array>
std::string imported_dtype_name(const Imported<Array>& im) {
  return im.bf16_bits ? "bfloat16" : dtype_name(im.array.dtype());
}

// Checks device, dtype (float32; with Accept::floating also bfloat16 and float16) and rank;
// `what` is "fn: name". Returns the dtype.
template <class Array>
tmx::DType check_array(const Imported<Array>& im, const std::string& what, size_t rank,
                       Accept accept) {
  const Array& a = im.array;
  if (a.device_type() != nb::device::cpu::value) {
    type_error(what + " must be a CPU array/tensor; got device type " +
               std::to_string(a.device_type()) + " (move it with .cpu() first)");
  }
  const auto dt = library_dtype(im);
  if (accept == Accept::floating) {
    if (!dt || (*dt != tmx::DType::f32 && *dt != tmx::DType::bf16 && *dt != tmx::DType::f16)) {
      type_error(what + " has dtype " + imported_dtype_name(im) + "; " + kFloatingExpected);
    }
  } else if (dt != tmx::DType::f32) {
    type_error(what + " has dtype " + imported_dtype_name(im) +
               "; tokenmix computes in float32 only (convert with .astype(numpy.float32) or "
               ".float(); no implicit conversion is made)");
  }
  if (rank != 0 && a.ndim() != rank) {
    value_error(what + " must have " + std::to_string(rank) + " dimensions; got " +
                std::to_string(a.ndim()) + " (shape " + array_shape(a) + ")");
  }
  return *dt;
}

// A NumPy array of ml_dtypes.bfloat16 (a native 2-byte bfloat16): its uint16 view, else None.
nb::object bf16_bits_view(nb::handle obj) {
  if (!nb::hasattr(obj, "dtype") || !nb::hasattr(obj, "view")) return nb::none();
  nb::object dtype = obj.attr("dtype");
  if (!nb::hasattr(dtype, "name") || py_str(dtype.attr("name")) != "bfloat16" ||
      !nb::hasattr(dtype, "type") || !nb::hasattr(dtype.attr("type"), "__module__") ||
      py_str(dtype.attr("type").attr("__module__")).rfind("ml_dtypes", 0) != 0 ||
      nb::cast<std::int64_t>(dtype.attr("itemsize")) != 2) {
    return nb::none();
  }
  try {
    return obj.attr("view")(nb::module_::import_("numpy").attr("uint16"));
  } catch (const nb::python_error&) {
    return nb::none();  // diagnose_array says why
  }
}

template <class Array>
Imported<Array> import_array(const ArrayArg& a, const char* fn, const char* name, bool writable,
                             Accept accept) {
  Imported<Array> im;
  // No implicit conversion: a converted array would be a hidden copy (and, for outputs, lost).
  if (nb::try_cast(a.obj, im.array, false)) return im;
  // ml_dtypes.bfloat16: the same memory seen as uint16 (zero-copy, strides and writability
  // kept; the view holds the array alive for the call).
  if (nb::object bits = bf16_bits_view(a.obj); !bits.is_none()) {
    if (nb::try_cast(bits, im.array, false) && im.array.dtype() == nb::dtype<std::uint16_t>()) {
      im.bf16_bits = true;
      return im;
    }
  }
  diagnose_array(a.obj, std::string(fn) + ": " + name, writable, accept);
}

// A view of rank `rank` (1 ≤ rank ≤ 4) whose dtype is one of `allowed` (device and rank checked
// as for the float32 views; the unused trailing axes get size 1 and stride 0).
template <class View, class Array>
View make_typed_view(const Imported<Array>& im, const char* fn, const char* name, size_t rank,
                     std::initializer_list<tmx::DType> allowed) {
  const Array& a = im.array;
  const std::string what = std::string(fn) + ": " + name;
  std::string names;
  size_t i = 0;
  for (tmx::DType d : allowed) {
    names += (i == 0 ? "" : (i + 1 == allowed.size() ? " or " : ", "));
    names += python_dtype_name(d);
    ++i;
  }
  if (a.device_type() != nb::device::cpu::value) {
    type_error(what + " must be a CPU array/tensor; got device type " +
               std::to_string(a.device_type()) + " (move it with .cpu() first)");
  }
  const auto dt = library_dtype(im);
  bool ok = false;
  for (tmx::DType d : allowed) ok = ok || (dt && *dt == d);
  if (!ok) {
    type_error(what + " has dtype " + imported_dtype_name(im) + "; expected " + names +
               " (no implicit conversion is made)");
  }
  if (a.ndim() != rank) {
    value_error(what + " must have " + std::to_string(rank) + " dimension" +
                (rank == 1 ? "" : "s") + "; got " + std::to_string(a.ndim()) + " (shape " +
                array_shape(a) + ")");
  }
  View v;
  v.data = const_cast<Array&>(a).data();
  v.dtype = *dt;
  v.rank = static_cast<int>(rank);
  for (size_t j = 0; j < 4; ++j) {
    v.shape[j] = j < rank ? static_cast<std::int64_t>(a.shape(j)) : 1;
    v.strides[j] = j < rank ? a.stride(j) : 0;
  }
  return v;
}

// `im` by value (a reference-counted handle): nanobind 2's const data() is a const pointer.
template <class View, class Array>
View make_view(Imported<Array> im, const char* fn, const char* name, size_t rank, Accept accept) {
  const tmx::DType dtype = check_array(im, std::string(fn) + ": " + name, rank, accept);
  Array& a = im.array;
  View v;
  v.data = a.data();
  v.dtype = dtype;
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

template <class Array>
bool c_contiguous(const Array& a) {
  std::int64_t expected = 1;
  for (size_t i = a.ndim(); i-- > 0;) {
    if (a.shape(i) != 1 && a.stride(i) != expected) return false;
    expected *= static_cast<std::int64_t>(a.shape(i));
  }
  return true;
}

template <class T, class Array>
SpanArg<T> make_span(Imported<Array> im, const char* fn, const char* name, size_t rank) {
  check_array(im, std::string(fn) + ": " + name, rank, Accept::f32);
  Array& a = im.array;
  if (!c_contiguous(a)) value_error(std::string(fn) + ": " + name + " must be C-contiguous");
  SpanArg<T> s;
  s.data = {static_cast<T*>(a.data()), a.size()};
  for (size_t i = 0; i < rank && i < s.shape.size(); ++i) {
    s.shape[i] = static_cast<std::int64_t>(a.shape(i));
  }
  return s;
}

}  // namespace

tmx::ConstTensorView in4(const ArrayArg& a, const char* fn, const char* name) {
  return make_view<tmx::ConstTensorView>(import_array<InArray>(a, fn, name, false, Accept::f32), fn,
                                         name, 4, Accept::f32);
}
tmx::ConstTensorView in3(const ArrayArg& a, const char* fn, const char* name) {
  return make_view<tmx::ConstTensorView>(import_array<InArray>(a, fn, name, false, Accept::f32), fn,
                                         name, 3, Accept::f32);
}
tmx::TensorView out4(const ArrayArg& a, const char* fn, const char* name) {
  return make_view<tmx::TensorView>(import_array<OutArray>(a, fn, name, true, Accept::f32), fn,
                                    name, 4, Accept::f32);
}
tmx::TensorView out3(const ArrayArg& a, const char* fn, const char* name) {
  return make_view<tmx::TensorView>(import_array<OutArray>(a, fn, name, true, Accept::f32), fn,
                                    name, 3, Accept::f32);
}
tmx::TensorView out3_opt(const std::optional<ArrayArg>& a, const char* fn, const char* name) {
  if (!a) return {};
  return out3(*a, fn, name);
}

tmx::ConstTensorView in_float(const ArrayArg& a, const char* fn, const char* name, size_t rank) {
  return make_view<tmx::ConstTensorView>(
      import_array<InArray>(a, fn, name, false, Accept::floating), fn, name, rank,
      Accept::floating);
}
tmx::TensorView out_float(const ArrayArg& a, const char* fn, const char* name, size_t rank) {
  return make_view<tmx::TensorView>(import_array<OutArray>(a, fn, name, true, Accept::floating), fn,
                                    name, rank, Accept::floating);
}

const char* python_dtype_name(tmx::DType d) {
  switch (d) {
    case tmx::DType::f32:
      return "float32";
    case tmx::DType::bf16:
      return "bfloat16";
    case tmx::DType::f16:
      return "float16";
    case tmx::DType::boolean:
      return "bool";
    case tmx::DType::i32:
      return "int32";
    case tmx::DType::i64:
      return "int64";
    case tmx::DType::int8:  // KV-cache element types only, never an array's dtype
    case tmx::DType::fp8_e4m3:
      break;
  }
  return tmx::to_string(d);
}

void check_same_dtype(const char* fn, std::initializer_list<NamedView> views) {
  std::string names;  // "q, k, v and out"
  size_t i = 0;
  for (const NamedView& nv : views) {
    names += (i == 0 ? "" : (i + 1 == views.size() ? " and " : ", ")) + std::string(nv.name);
    ++i;
  }
  const NamedView& first = *views.begin();
  for (const NamedView& nv : views) {
    if (nv.dtype != first.dtype) {
      type_error(std::string(fn) + ": " + nv.name + " has dtype " + python_dtype_name(nv.dtype) +
                 " but " + first.name + " has " + python_dtype_name(first.dtype) + "; " + names +
                 " must have one dtype (float32, bfloat16 or float16; no implicit conversion is "
                 "made)");
    }
  }
}

tmx::ConstTensorView in_typed(const ArrayArg& a, const char* fn, const char* name, size_t rank,
                              std::initializer_list<tmx::DType> allowed) {
  return make_typed_view<tmx::ConstTensorView>(
      import_array<InArray>(a, fn, name, false, Accept::any), fn, name, rank, allowed);
}
tmx::ConstTensorView in_typed_opt(const std::optional<ArrayArg>& a, const char* fn,
                                  const char* name, size_t rank,
                                  std::initializer_list<tmx::DType> allowed) {
  if (!a) return {};
  return in_typed(*a, fn, name, rank, allowed);
}
tmx::TensorView out_typed_opt(const std::optional<ArrayArg>& a, const char* fn, const char* name,
                              size_t rank, std::initializer_list<tmx::DType> allowed) {
  if (!a) return {};
  return make_typed_view<tmx::TensorView>(import_array<OutArray>(*a, fn, name, true, Accept::any),
                                          fn, name, rank, allowed);
}

SpanArg<const float> in_span(const ArrayArg& a, const char* fn, const char* name, size_t rank) {
  return make_span<const float>(import_array<InArray>(a, fn, name, false, Accept::f32), fn, name,
                                rank);
}
SpanArg<float> out_span(const ArrayArg& a, const char* fn, const char* name, size_t rank) {
  return make_span<float>(import_array<OutArray>(a, fn, name, true, Accept::f32), fn, name, rank);
}

std::string shape_string(const std::int64_t* shape, size_t rank) {
  std::string s = "(";
  for (size_t i = 0; i < rank; ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  if (rank == 1) s += ",";
  return s + ")";
}

// ---------------------------------------------------------------------------------------------
// Options

tmx::CausalAlign parse_align(const char* fn, const std::string& s) {
  return tmx::parse_causal_align(s, (std::string(fn) + ": align").c_str());
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
  // KV-cache element types only (quantized: V per row, K per channel per tile; SPEC "Quantized KV
  // cache").
  if (s == "int8") return tmx::DType::int8;
  if (s == "fp8_e4m3" || s == "float8_e4m3fn") return tmx::DType::fp8_e4m3;
  value_error("dtype must be 'f32', 'bf16', 'f16', 'int8' or 'fp8_e4m3'; got '" + s + "'");
}

namespace {

// int(x) of an integer argument (int of any size, NumPy integer), as a long long; `overflow` set
// (and the value meaningless) when it does not fit. Not an integer → TypeError naming `what`.
long long integer_value(const IntArg& arg, const std::string& what, nb::object& index,
                        int& overflow) {
  index = nb::steal(PyNumber_Index(arg.obj.ptr()));  // int(x) for integers only
  if (!index.is_valid()) {
    PyErr_Clear();
    type_error(what + " must be an integer; got " + nb::type_name(arg.obj.type()).c_str());
  }
  overflow = 0;
  const long long v = PyLong_AsLongLongAndOverflow(index.ptr(), &overflow);
  if (v == -1 && overflow == 0 && PyErr_Occurred()) throw nb::python_error();
  return v;
}

}  // namespace

std::int64_t int64_arg(const IntArg& arg, const char* fn, const char* name) {
  const std::string what = std::string(fn) + ": " + name;
  nb::object index;
  int overflow = 0;
  const long long v = integer_value(arg, what, index, overflow);
  if (overflow != 0) {
    argument_error(tmx::ErrorCode::overflow,
                   what + " must fit in a signed 64-bit integer; got " + py_str(index));
  }
  return static_cast<std::int64_t>(v);
}

int thread_count(const IntArg& threads, const char* fn) {
  const std::string what = std::string(fn) + ": threads";
  nb::object index;
  int overflow = 0;
  const long long v = integer_value(threads, what, index, overflow);
  if (overflow != 0 || v < 0 || v > INT_MAX) {
    argument_error(
        tmx::ErrorCode::invalid_argument,
        what + " must be in [0, " + std::to_string(INT_MAX) + "] (0 = all); got " + py_str(index));
  }
  return static_cast<int>(v);
}

tmx::AttentionOptions attention_options(const char* fn, std::optional<double> scale, bool causal,
                                        const std::string& align, const IntArg& threads,
                                        const std::string& isa) {
  tmx::AttentionOptions o;
  o.scale = scale;
  o.causal = causal;
  o.align = parse_align(fn, align);
  o.threads = thread_count(threads, fn);
  o.isa = tmx::parse_isa(isa, "isa");
  return o;
}

void add_variants(tmx::AttentionOptions& o, const char* fn, const VariantArgs& va) {
  using D = tmx::DType;
  if (va.window) o.window = int64_arg(*va.window, fn, "window");
  o.softcap = va.softcap;
  o.alibi_slopes = in_typed_opt(va.alibi_slopes, fn, "alibi_slopes", 1, {D::f32});
  o.sinks = in_typed_opt(va.sinks, fn, "sinks", 1, {D::f32});
  o.mask = in_typed_opt(va.mask, fn, "mask", 4, {D::boolean, D::f32});
  o.key_lengths = in_typed_opt(va.key_lengths, fn, "key_lengths", 1, {D::i32, D::i64});
}

void add_dropout(tmx::AttentionOptions& o, const char* fn, double p, const IntArg& seed,
                 const IntArg& offset) {
  o.dropout.p = p;  // (the library checks 0 <= p < 1)
  // Any int64 seed, as its 64 bits (PyTorch's generators hand out signed 64-bit values).
  o.dropout.seed = static_cast<std::uint64_t>(int64_arg(seed, fn, "dropout_seed"));
  const std::int64_t off = int64_arg(offset, fn, "dropout_offset");
  if (off < 0) {
    argument_error(
        tmx::ErrorCode::invalid_argument,
        std::string(fn) + ": dropout_offset must be in [0, 2^32); got " + std::to_string(off));
  }
  o.dropout.offset = static_cast<std::uint64_t>(off);
}

tmx::RopeOptions rope_options(const std::string& pairing, double base, std::int64_t offset) {
  tmx::RopeOptions o;
  o.pairing = parse_pairing(pairing);
  o.base = base;
  o.position_offset = offset;
  return o;
}

nb::ndarray<nb::numpy, float> numpy_view(float* data, std::initializer_list<size_t> shape,
                                         nb::handle owner) {
  return nb::ndarray<nb::numpy, float>(data, shape.size(), shape.begin(), owner);
}

}  // namespace tokenmix_py
