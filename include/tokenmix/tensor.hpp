// tokenmix/tensor.hpp — non-owning strided views over caller memory.
//
// Attention tensors are always described by their *logical* shape [B, T, H, d_h] ("BTHD", SPEC
// "Names and shapes"); the strides (in elements, not bytes) say where each element lives. So the
// contiguous BTHD layout and PyTorch's SDPA layout [B, H, T, d_h] are both plain views — no copy:
//
//   auto q  = tokenmix::TensorView::bthd(ptr, B, T, H, D);  // strides {T*H*D, H*D, D, 1}
//   auto qt = tokenmix::TensorView::bhtd(ptr, B, T, H, D);  // memory [B,H,T,D]: {H*T*D, D, T*D, 1}
//
// Row log-sum-exp tensors have logical shape [B, H, T] (rank 3).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <type_traits>

namespace tokenmix {

/// Element type of a view. Attention tensors (q, k, v, out and their gradients) are f32, bf16 or
/// f16, one dtype per call (row log-sum-exp stays f32; SPEC "Reduced precision"); bf16/f16 are
/// also KV-cache storage; boolean (one byte, nonzero = true) and the integer types describe
/// masks, key lengths and varlen offsets. int8 and fp8_e4m3 are KV-cache element types only
/// (KVCacheConfig::dtype: quantized per (token, KV head) row with an fp32 scale, SPEC "Reduced
/// precision → Quantized KV cache"); no tensor view of the API takes them.
enum class DType : std::uint8_t {
  f32 = 0,
  bf16 = 1,
  f16 = 2,
  boolean = 3,
  i32 = 4,
  i64 = 5,
  int8 = 6,
  fp8_e4m3 = 7
};

const char* to_string(DType dtype) noexcept;
std::size_t size_of(DType dtype) noexcept;

/// A rank ≤ 4 strided view. `Pointer` is `void*` for outputs and `const void*` for inputs.
template <class Pointer>
struct BasicTensorView {
  Pointer data = nullptr;
  DType dtype = DType::f32;
  int rank = 4;
  std::array<std::int64_t, 4> shape{};    ///< logical sizes; entries past `rank` are ignored
  std::array<std::int64_t, 4> strides{};  ///< in elements; may be any non-negative values

  std::int64_t dim(int i) const noexcept { return shape[static_cast<std::size_t>(i)]; }
  std::int64_t stride(int i) const noexcept { return strides[static_cast<std::size_t>(i)]; }
  bool empty() const noexcept { return data == nullptr; }

  /// Contiguous [B, T, H, D] float32.
  template <class T>
  static BasicTensorView bthd(T* p, std::int64_t B, std::int64_t T_, std::int64_t H,
                              std::int64_t D) {
    return {p, DType::f32, 4, {B, T_, H, D}, {T_ * H * D, H * D, D, 1}};
  }
  /// Logical [B, T, H, D] over memory laid out as [B, H, T, D] (PyTorch SDPA layout).
  template <class T>
  static BasicTensorView bhtd(T* p, std::int64_t B, std::int64_t T_, std::int64_t H,
                              std::int64_t D) {
    return {p, DType::f32, 4, {B, T_, H, D}, {H * T_ * D, D, T_ * D, 1}};
  }
  /// Contiguous row log-sum-exp [B, H, T] float32.
  template <class T>
  static BasicTensorView bht(T* p, std::int64_t B, std::int64_t H, std::int64_t T_) {
    return {p, DType::f32, 3, {B, H, T_, 1}, {H * T_, T_, 1, 0}};
  }

  /// A mutable view converts to a read-only one.
  operator BasicTensorView<const void*>() const  // NOLINT(google-explicit-constructor)
      requires(!std::is_same_v<Pointer, const void*>) {
    return {data, dtype, rank, shape, strides};
  }
};

using TensorView = BasicTensorView<void*>;             ///< writable (outputs, in-place ops)
using ConstTensorView = BasicTensorView<const void*>;  ///< read-only (inputs)

}  // namespace tokenmix
