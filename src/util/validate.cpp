#include "util/validate.hpp"

#include <unistd.h>

#include <algorithm>
#include <array>
#include <climits>
#include <limits>
#include <numeric>
#include <sstream>
#include <string>

namespace tokenmix::detail {

void fail(ErrorCode code, const char* fn, const std::string& message) {
  std::string text(fn);
  text.append(": ").append(message);
  throw ArgumentError(code, text);
}

double physical_memory_bytes() {
  const long pages = sysconf(_SC_PHYS_PAGES), page_bytes = sysconf(_SC_PAGESIZE);
  if (pages <= 0 || page_bytes <= 0) return 0.0;
  return static_cast<double>(pages) * static_cast<double>(page_bytes);
}

std::int64_t checked_mul(std::int64_t a, std::int64_t b, const char* fn, const char* what) {
  std::int64_t r = 0;
  if (__builtin_mul_overflow(a, b, &r)) {
    fail(ErrorCode::overflow, fn,
         std::string(what) + " overflows 64-bit arithmetic (" + std::to_string(a) + " * " +
             std::to_string(b) + ")");
  }
  return r;
}

std::string shape_string(const ConstTensorView& v) {
  std::ostringstream os;
  os << '[';
  for (int i = 0; i < v.rank; ++i) os << (i ? ", " : "") << v.dim(i);
  os << ']';
  return os.str();
}

namespace {

// Largest element offset Σ (shape_i − 1)·stride_i, or −1 for a view with no elements.
std::int64_t max_offset(const ConstTensorView& v) {
  std::int64_t off = 0;
  for (int i = 0; i < v.rank; ++i) {
    if (v.dim(i) == 0) return -1;
    off += (v.dim(i) - 1) * v.stride(i);
  }
  return off;
}

std::int64_t element_count(const ConstTensorView& v) {
  std::int64_t n = 1;
  for (int i = 0; i < v.rank; ++i) n *= v.dim(i);
  return n;
}

}  // namespace

void check_view(const ConstTensorView& v, int rank, const char* fn, const char* name) {
  const std::string n(name);
  if (v.rank != rank) {
    fail(ErrorCode::shape_mismatch, fn,
         n + " must have rank " + std::to_string(rank) + "; got rank " + std::to_string(v.rank));
  }
  if (v.dtype != DType::f32) {
    throw UnsupportedError(std::string(fn) + ": " + n + " has dtype " + to_string(v.dtype) +
                           "; only f32 is supported by this operation");
  }
  check_view_extent(v, fn, name);
}

void check_activation(const ConstTensorView& v, int rank, const char* fn, const char* name) {
  const std::string n(name);
  if (v.rank != rank) {
    fail(ErrorCode::shape_mismatch, fn,
         n + " must have rank " + std::to_string(rank) + "; got rank " + std::to_string(v.rank));
  }
  if (v.dtype != DType::f32 && v.dtype != DType::bf16 && v.dtype != DType::f16) {
    throw UnsupportedError(std::string(fn) + ": " + n + " has dtype " + to_string(v.dtype) +
                           "; attention tensors must be f32, bf16 or f16");
  }
  check_view_extent(v, fn, name);
}

DType common_dtype(const char* fn,
                   std::initializer_list<std::pair<const char*, ConstTensorView>> views,
                   const char* together) {
  const auto& first = *views.begin();
  for (const auto& [name, v] : views) {
    if (v.empty() || v.dtype == first.second.dtype) continue;
    fail(ErrorCode::invalid_argument, fn,
         std::string(name) + " has dtype " + to_string(v.dtype) + " but " + first.first +
             " has dtype " + to_string(first.second.dtype) + "; " + together +
             " must all have one dtype (f32, bf16 or f16; lse stays f32)");
  }
  return first.second.dtype;
}

void check_view_extent(const ConstTensorView& v, const char* fn, const char* name) {
  const std::string n(name);
  const int rank = v.rank;
  for (int i = 0; i < rank; ++i) {
    if (v.dim(i) < 0) {
      fail(ErrorCode::invalid_argument, fn,
           n + ".shape[" + std::to_string(i) + "] must be >= 0; got " + std::to_string(v.dim(i)));
    }
    if (v.stride(i) < 0) {
      fail(ErrorCode::invalid_argument, fn,
           n + ".strides[" + std::to_string(i) + "] must be >= 0; got " +
               std::to_string(v.stride(i)));
    }
  }
  // Element count and the largest offset, in bytes, must fit in int64 (so no index overflows).
  // (The names of the products are built only when one overflows: this runs for every view of
  // every call, and a tiny call is a few microseconds.)
  std::int64_t count = 1, offset = 0;
  for (int i = 0; i < rank; ++i) {
    std::int64_t product = 0;
    if (__builtin_mul_overflow(count, v.dim(i), &product)) {
      checked_mul(count, v.dim(i), fn, (n + " element count").c_str());  // throws
    }
    count = product;
    if (v.dim(i) > 0) {
      std::int64_t step = 0;
      if (__builtin_mul_overflow(v.dim(i) - 1, v.stride(i), &step)) {
        checked_mul(v.dim(i) - 1, v.stride(i), fn, (n + " extent").c_str());  // throws
      }
      std::int64_t sum = 0;
      if (__builtin_add_overflow(offset, step, &sum)) {
        fail(ErrorCode::overflow, fn,
             n + " extent overflows 64-bit arithmetic (" + std::to_string(offset) + " + " +
                 std::to_string(step) + ")");
      }
      offset = sum;
    }
  }
  // Bytes spanned, (offset + 1) · element size, without forming offset + 1 when it overflows.
  const auto elem_bytes = static_cast<std::int64_t>(std::max<std::size_t>(size_of(v.dtype), 1));
  if (offset > INT64_MAX / elem_bytes - 1) {
    fail(ErrorCode::overflow, fn,
         n + " byte extent overflows 64-bit arithmetic ((largest element offset " +
             std::to_string(offset) + " + 1) * " + std::to_string(elem_bytes) + " bytes)");
  }
  if (count > 0 && v.data == nullptr) {
    fail(ErrorCode::null_pointer, fn,
         n + ".data must not be null for a tensor of shape " + shape_string(v));
  }
}

void check_dim(const ConstTensorView& v, int axis, std::int64_t expected, const char* fn,
               const char* name, const char* axis_name, const char* expected_from) {
  if (v.dim(axis) != expected) {
    fail(ErrorCode::shape_mismatch, fn,
         std::string(name) + ".shape[" + std::to_string(axis) + "] (" + axis_name +
             ") must equal " + expected_from + " = " + std::to_string(expected) + "; got " +
             std::to_string(v.dim(axis)) + " (" + name + " shape " + shape_string(v) + ")");
  }
}

bool views_overlap(const ConstTensorView& a, const ConstTensorView& b) {
  if (a.data == nullptr || b.data == nullptr) return false;
  const std::int64_t ma = max_offset(a), mb = max_offset(b);
  if (ma < 0 || mb < 0) return false;
  const auto* pa = static_cast<const char*>(a.data);
  const auto* pb = static_cast<const char*>(b.data);
  // Element sizes (f32 4 bytes, bf16/f16 2, ...).
  const auto ea = static_cast<std::int64_t>(std::max<std::size_t>(size_of(a.dtype), 1));
  const auto eb = static_cast<std::int64_t>(std::max<std::size_t>(size_of(b.dtype), 1));
  // Byte ranges [begin, end) of each view; disjoint ranges cannot share an element.
  if (pa + (ma + 1) * ea <= pb || pb + (mb + 1) * eb <= pa) return false;
  // Intersecting ranges of views with different element sizes: reported as overlap
  // (conservative; interleaving tensors of different dtypes in one buffer is not supported).
  if (ea != eb) return true;
  const std::int64_t bytes = ea;

  // The ranges intersect: decide exactly for interleaved views (e.g. q, k, v as slices of one
  // packed [B, T, 3, H, d_h] buffer). Exact membership is cheap when the view's strides are
  // nested (each stride ≥ the extent of all smaller-stride dims), which every view that does not
  // overlap itself satisfies; otherwise we conservatively report overlap.
  const ConstTensorView& big = element_count(a) >= element_count(b) ? a : b;
  const ConstTensorView& small = &big == &a ? b : a;
  std::array<int, 4> order{0, 1, 2, 3};  // big's dims by decreasing stride (insertion sort)
  for (int i = 1; i < big.rank && i < 4; ++i) {
    for (int j = i; j > 0 && big.stride(order[j]) > big.stride(order[j - 1]); --j) {
      std::swap(order[j], order[j - 1]);
    }
  }
  std::int64_t inner_extent = 1;  // elements spanned by the dims with smaller strides
  for (int i = big.rank - 1; i >= 0; --i) {
    const int d = order[i];
    if (big.dim(d) > 1 && big.stride(d) < inner_extent) return true;  // not nested
    if (big.dim(d) > 1) inner_extent = big.stride(d) * (big.dim(d) - 1) + inner_extent;
  }
  const auto* pbig = static_cast<const char*>(big.data);
  const auto* psmall = static_cast<const char*>(small.data);
  // Is the byte address `addr` (relative to big.data) an element of `big`?
  auto member = [&](std::int64_t rel) {
    if (rel < 0 || rel % bytes != 0) return false;
    std::int64_t e = rel / bytes;
    for (int i = 0; i < big.rank; ++i) {
      const int d = order[i];
      if (big.dim(d) <= 1 || big.stride(d) == 0) continue;
      const std::int64_t idx = std::min(e / big.stride(d), big.dim(d) - 1);
      e -= idx * big.stride(d);
    }
    return e == 0;
  };
  // Partial overlap of an element (misaligned pointers) counts as overlap.
  const std::int64_t base = psmall - pbig;
  if (base % bytes != 0) return true;
  std::array<std::int64_t, 4> idx{};
  const std::int64_t n = element_count(small);
  for (std::int64_t k = 0; k < n; ++k) {
    std::int64_t off = 0;
    for (int i = 0; i < small.rank; ++i) off += idx[i] * small.stride(i);
    if (member(base + off * bytes)) return true;
    for (int i = small.rank - 1; i >= 0; --i) {
      if (++idx[i] < small.dim(i)) break;
      idx[i] = 0;
    }
  }
  return false;
}

void check_align(const char* fn, const char* name, CausalAlign align) {
  if (align != CausalAlign::bottom_right && align != CausalAlign::top_left) {
    fail(ErrorCode::invalid_argument, fn,
         std::string(name) + " must be CausalAlign::bottom_right or CausalAlign::top_left; got " +
             "the value " + std::to_string(static_cast<long long>(align)));
  }
}

void check_no_overlap(const char* fn, std::initializer_list<NamedView> outputs,
                      std::initializer_list<NamedView> inputs) {
  for (const auto& [name, v] : outputs) {
    if (v.data == nullptr || max_offset(v) < 0) continue;  // no element, nothing to race on
    for (int i = 0; i < v.rank; ++i) {
      if (v.stride(i) == 0 && v.dim(i) > 1) {
        fail(ErrorCode::aliasing, fn,
             std::string("output ") + name + " overlaps itself: " + name + ".strides[" +
                 std::to_string(i) + "] is 0 on an axis of size " + std::to_string(v.dim(i)) +
                 ", so every index of that axis writes the same element (shape " + shape_string(v) +
                 ")");
      }
    }
  }
  for (auto o = outputs.begin(); o != outputs.end(); ++o) {
    for (const auto& in : inputs) {
      if (views_overlap(o->second, in.second)) {
        fail(ErrorCode::aliasing, fn,
             std::string("output ") + o->first + " overlaps input " + in.first +
                 " in memory; outputs must not share memory with inputs");
      }
    }
    for (auto o2 = std::next(o); o2 != outputs.end(); ++o2) {
      if (views_overlap(o->second, o2->second)) {
        fail(ErrorCode::aliasing, fn,
             std::string("outputs ") + o->first + " and " + o2->first +
                 " overlap in memory; each output needs its own memory");
      }
    }
  }
}

}  // namespace tokenmix::detail
