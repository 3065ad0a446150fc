// src/util/validate.hpp — argument checking shared by every public entry point.
//
// Each check throws a typed tokenmix error whose message starts with the entry point's name
// and names the argument, what was expected and what was given.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>

#include "tokenmix/attention.hpp"
#include "tokenmix/error.hpp"
#include "tokenmix/tensor.hpp"

namespace tokenmix::detail {

/// Formats "fn: message" and throws ArgumentError(code).
[[noreturn]] void fail(ErrorCode code, const char* fn, const std::string& message);

/// a·b, throwing ArgumentError(overflow) naming `what` if it does not fit in int64.
std::int64_t checked_mul(std::int64_t a, std::int64_t b, const char* fn, const char* what);

/// Bytes of physical memory (sysconf), or 0 if unknown. Allocations larger than this can never
/// be used: they are refused with ErrorCode::out_of_memory before any attempt (an overcommitting
/// kernel would hand out the address space and kill the process on its first pass over it).
double physical_memory_bytes();

/// "[2, 3, 4, 5]" for a view's logical shape.
std::string shape_string(const ConstTensorView& v);

/// Checks one view: rank, f32 dtype (UnsupportedError otherwise), non-negative sizes and
/// strides, non-null data unless it has no elements, and that the largest element offset and
/// byte extent fit in 64-bit arithmetic.
void check_view(const ConstTensorView& v, int rank, const char* fn, const char* name);

/// check_view for an attention activation (q, k, v, out, dout, dq, dk, dv; SPEC "Reduced
/// precision"): dtype f32, bf16 or f16 (UnsupportedError naming the dtype otherwise).
void check_activation(const ConstTensorView& v, int rank, const char* fn, const char* name);

/// The one dtype of a call's activations: every non-empty view of `views` must have the dtype of
/// the first; otherwise ArgumentError(invalid_argument) naming both views and their dtypes and
/// `together` (e.g. "q, k, v and out").
DType common_dtype(const char* fn,
                   std::initializer_list<std::pair<const char*, ConstTensorView>> views,
                   const char* together);

/// The part of check_view after rank and dtype (for views of any dtype and rank 1–4): sizes and
/// strides ≥ 0, non-null data unless empty, largest offset and byte extent within int64.
void check_view_extent(const ConstTensorView& v, const char* fn, const char* name);

/// Logical-dimension check: v.shape[axis] == expected.
void check_dim(const ConstTensorView& v, int axis, std::int64_t expected, const char* fn,
               const char* name, const char* axis_name, const char* expected_from);

/// True if some element address of `a` is also an element address of `b`.
bool views_overlap(const ConstTensorView& a, const ConstTensorView& b);

/// Throws ArgumentError(invalid_argument) naming `name` unless `align` is a CausalAlign value.
void check_align(const char* fn, const char* name, CausalAlign align);

/// Throws ArgumentError(aliasing) if any output overlaps itself (a zero stride on an axis of
/// size > 1: threads would race on one element), any input or another output.
/// Empty views (null data) are ignored.
using NamedView = std::pair<const char*, ConstTensorView>;
void check_no_overlap(const char* fn, std::initializer_list<NamedView> outputs,
                      std::initializer_list<NamedView> inputs);

}  // namespace tokenmix::detail
