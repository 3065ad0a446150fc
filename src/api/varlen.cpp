// src/api/varlen.cpp — variable-length batches (SPEC "Score variants": varlen; FlashAttention's
// varlen API): sequences packed along the token axis with offsets cu_seqlens_q / cu_seqlens_k.
//
// Implemented as a loop over the sequences, each one B = 1 kernel call on offset views of the
// packed tensors (no copy): the parallelism is within each sequence (its heads and row blocks),
// the kernel path is chosen once, and each sequence's alignment, window and ALiBi positions are
// its own (T_q, T_k are the sequence's lengths). A sequence with no keys gets O = 0 and
// L = −∞ (σ_h with sinks), dQ = 0; one with no queries gets dK = dV = 0 — written here, without
// a kernel call.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "api/variants.hpp"
#include "dispatch/registry.hpp"
#include "kernels/attention_kernels.hpp"
#include "kernels/kernel_skeleton.hpp"
#include "kernels/kv_element.hpp"
#include "tokenmix/attention.hpp"
#include "tokenmix/error.hpp"
#include "util/validate.hpp"

namespace tokenmix {
namespace {

using detail::check_dim;
using detail::check_view;
using detail::fail;
using detail::strided;

std::string str(std::int64_t x) {
  return std::to_string(x);
}

// The checked offsets of one cu_seqlens tensor, as int64.
std::vector<std::int64_t> offsets(const char* fn, const ConstTensorView& cu, const char* name,
                                  std::int64_t total, const char* total_name) {
  const std::string n(name);
  if (cu.rank != 1) {
    fail(ErrorCode::shape_mismatch, fn,
         n + " must have rank 1 ([n + 1] offsets); got rank " + str(cu.rank));
  }
  if (cu.dtype != DType::i32 && cu.dtype != DType::i64) {
    throw UnsupportedError(std::string(fn) + ": " + n + " has dtype " + to_string(cu.dtype) +
                           "; expected i32 or i64");
  }
  detail::check_view_extent(cu, fn, name);
  if (cu.dim(0) < 1) {
    fail(ErrorCode::shape_mismatch, fn,
         n + ".shape[0] must be >= 1 (n + 1 offsets for n sequences); got " + str(cu.dim(0)));
  }
  std::vector<std::int64_t> off(static_cast<std::size_t>(cu.dim(0)));
  for (std::int64_t i = 0; i < cu.dim(0); ++i) {
    off[static_cast<std::size_t>(i)] =
        cu.dtype == DType::i32 ? static_cast<const std::int32_t*>(cu.data)[i * cu.stride(0)]
                               : static_cast<const std::int64_t*>(cu.data)[i * cu.stride(0)];
  }
  if (off[0] != 0) fail(ErrorCode::invalid_argument, fn, n + "[0] must be 0; got " + str(off[0]));
  for (std::size_t i = 1; i < off.size(); ++i) {
    if (off[i] < off[i - 1]) {
      fail(ErrorCode::invalid_argument, fn,
           n + "[" + str(static_cast<std::int64_t>(i)) + "] = " + str(off[i]) + " is less than " +
               n + "[" + str(static_cast<std::int64_t>(i) - 1) + "] = " + str(off[i - 1]) +
               " (offsets must be non-decreasing)");
    }
  }
  if (off.back() != total) {
    fail(ErrorCode::invalid_argument, fn,
         n + "[" + str(cu.dim(0) - 1) + "] = " + str(off.back()) + " must equal " + total_name +
             " = " + str(total) + " (the last offset ends the packed tensor)");
  }
  return off;
}

// A rank-3 [total, H, d_h] view shaped like q or k.
void check_like3(const char* fn, const ConstTensorView& x, const char* name, std::int64_t t,
                 std::int64_t h, std::int64_t d, const char* like) {
  detail::check_activation(x, 3, fn, name);
  const std::string from = std::string(like) + ".shape";
  check_dim(x, 0, t, fn, name, "total", (from + "[0]").c_str());
  check_dim(x, 1, h, fn, name, "H", (from + "[1]").c_str());
  check_dim(x, 2, d, fn, name, "d_h", (from + "[2]").c_str());
}

// The checked problem of a varlen call (batch = 1; tq, tk set per sequence) and its offsets.
struct Varlen {
  kernels::AttentionProblem p;
  std::int64_t total_q = 0, total_k = 0;
  std::vector<std::int64_t> cu_q, cu_k;
  detail::VariantData variants;
};

void make_varlen(const char* fn, const ConstTensorView& q, const ConstTensorView& k,
                 const ConstTensorView& v, const ConstTensorView& cu_seqlens_q,
                 const ConstTensorView& cu_seqlens_k, const AttentionOptions& o, Varlen& w) {
  detail::check_activation(q, 3, fn, "q");
  detail::check_activation(k, 3, fn, "k");
  detail::check_activation(v, 3, fn, "v");
  kernels::AttentionProblem& p = w.p;
  w.total_q = q.dim(0);
  w.total_k = k.dim(0);
  p.batch = 1;
  p.hq = q.dim(1);
  p.dh = q.dim(2);
  p.hkv = k.dim(1);
  if (p.hq < 1)
    fail(ErrorCode::invalid_argument, fn, "q.shape[1] (H_q) must be >= 1; got " + str(p.hq));
  if (p.dh < 1)
    fail(ErrorCode::invalid_argument, fn, "q.shape[2] (d_h) must be >= 1; got " + str(p.dh));
  check_dim(k, 2, p.dh, fn, "k", "d_h", "q.shape[2]");
  if (p.hkv < 1) {
    fail(ErrorCode::invalid_argument, fn, "k.shape[1] (H_kv) must be >= 1; got " + str(p.hkv));
  }
  if (p.hkv > p.hq || p.hq % p.hkv != 0) {
    fail(ErrorCode::shape_mismatch, fn,
         "k.shape[1] (H_kv) must divide q.shape[1] (H_q = " + str(p.hq) +
             ") for grouped-query attention (SPEC 4.8); got H_kv = " + str(p.hkv));
  }
  check_dim(v, 0, w.total_k, fn, "v", "total_k", "k.shape[0]");
  check_dim(v, 1, p.hkv, fn, "v", "H_kv", "k.shape[1]");
  check_dim(v, 2, p.dh, fn, "v", "d_h", "q.shape[2]");
  p.scale = detail::checked_scale(fn, o, p.dh);
  p.causal = o.causal;
  p.align = o.align;
  // A tiny call runs on the calling thread (kernel_skeleton.hpp; total_q · total_k bounds the
  // pairs of all sequences).
  p.threads = kernels::threads_for_work(
      o.threads == 0 ? default_threads() : o.threads,
      static_cast<double>(w.total_q) * p.hq * static_cast<double>(w.total_k) * p.dh);
  if (!o.mask.empty()) {
    throw UnsupportedError(std::string(fn) +
                           ": options.mask is not supported by the varlen entry points (each "
                           "sequence has its own T_q, T_k); use attention_forward on a padded "
                           "batch instead");
  }
  if (!o.key_lengths.empty()) {
    throw UnsupportedError(std::string(fn) +
                           ": options.key_lengths is not supported by the varlen entry points "
                           "(cu_seqlens_k already gives each sequence's keys)");
  }
  if (detail::uses_variants(o)) detail::prepare_variants(fn, o, p, w.variants);
  w.cu_q = offsets(fn, cu_seqlens_q, "cu_seqlens_q", w.total_q, "total_q = q.shape[0]");
  w.cu_k = offsets(fn, cu_seqlens_k, "cu_seqlens_k", w.total_k, "total_k = k.shape[0]");
  if (w.cu_k.size() != w.cu_q.size()) {
    fail(ErrorCode::shape_mismatch, fn,
         "cu_seqlens_k.shape[0] must equal cu_seqlens_q.shape[0] = " + str(w.cu_q.size()) +
             " (n + 1 for n sequences); got " + str(w.cu_k.size()));
  }
  // Dropout: sequence i draws its mask as batch row b = i (D.3; each sequence runs as a B = 1
  // call whose Dropout::batch_base is i), t and u counted within the sequence.
  if (o.dropout.p != 0.0) {
    p.var.dropout = detail::checked_dropout(
        fn, o.dropout, static_cast<std::int64_t>(w.cu_q.size()) - 1, p.hq, w.total_q, w.total_k);
  }
}

void check_lse2(const char* fn, const ConstTensorView& lse, const Varlen& w) {
  check_view(lse, 2, fn, "lse");
  check_dim(lse, 0, w.p.hq, fn, "lse", "H_q", "q.shape[1]");
  check_dim(lse, 1, w.total_q, fn, "lse", "total_q", "q.shape[0]");
}

// Rows [r0, r0 + n) of a rank-3 [total, H, d_h] view as the kernels' [1, n, H, d_h]. The offset
// is taken in bytes of the view's dtype (a bf16/f16 view's float pointer is only an address).
template <class V>
auto rows(const V& x, std::int64_t r0) {
  auto s = strided(x);
  using Ptr = decltype(s.data);
  using Byte = std::conditional_t<std::is_same_v<Ptr, const float*>, const char*, char*>;
  const auto bytes = r0 * x.stride(0) * static_cast<std::int64_t>(size_of(x.dtype));
  s.data = reinterpret_cast<Ptr>(reinterpret_cast<Byte>(s.data) + bytes);
  s.s3 = x.stride(2);
  s.s2 = x.stride(1);
  s.s1 = x.stride(0);
  s.s0 = 0;  // B = 1
  return s;
}
// Columns [t0, …) of a rank-2 [H_q, total] LSE view as the kernels' [1, H_q, n].
template <class V>
auto lse_cols(const V& x, std::int64_t t0) {
  auto s = strided(x);
  s.data += t0 * x.stride(1);
  s.s0 = 0;
  s.s1 = x.stride(0);
  s.s2 = x.stride(1);
  s.s3 = 0;
  return s;
}

// Sets rows [0, n) of a [1, n, H, d_h] view of element type `dtype` to `value`.
void fill_rows(DType dtype, const kernels::Out& x, std::int64_t n, std::int64_t heads,
               std::int64_t dh, float value) {
  for (std::int64_t t = 0; t < n; ++t)
    for (std::int64_t h = 0; h < heads; ++h)
      for (std::int64_t i = 0; i < dh; ++i)
        kernels::store_element(dtype, x.data, t * x.s1 + h * x.s2 + i * x.s3, value);
}

}  // namespace

void attention_forward_varlen(ConstTensorView q, ConstTensorView k, ConstTensorView v,
                              ConstTensorView cu_seqlens_q, ConstTensorView cu_seqlens_k,
                              TensorView out, TensorView lse, const AttentionOptions& options) {
  constexpr const char* fn = "attention_forward_varlen";
  Varlen w;
  make_varlen(fn, q, k, v, cu_seqlens_q, cu_seqlens_k, options, w);
  const kernels::AttentionProblem& p = w.p;
  check_like3(fn, out, "out", w.total_q, p.hq, p.dh, "q");
  if (!lse.empty()) check_lse2(fn, lse, w);
  // SPEC "Reduced precision": q, k, v, out share one dtype (f32, bf16, f16); lse is f32.
  const DType dtype =
      detail::common_dtype(fn, {{"q", q}, {"k", k}, {"v", v}, {"out", out}}, "q, k, v and out");
  detail::check_no_overlap(fn, {{"out", out}, {"lse", lse}},
                           {{"q", q},
                            {"k", k},
                            {"v", v},
                            {"options.alibi_slopes", options.alibi_slopes},
                            {"options.sinks", options.sinks}});
  const Isa isa = resolve_isa(options.isa, fn);

  // Every sequence's kernel (the T_k rule of registry.cpp) first: an unsupported request throws
  // before any output is written.
  std::vector<kernels::NamedKernel<kernels::ForwardKernel>> kernels_of;
  for (std::size_t i = 0; i + 1 < w.cu_q.size(); ++i) {
    kernels_of.push_back(
        kernels::select_forward(fn, isa, dtype, w.cu_k[i + 1] - w.cu_k[i], w.variants.names));
  }
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  for (std::size_t i = 0; i + 1 < w.cu_q.size(); ++i) {
    const std::int64_t q0 = w.cu_q[i], nq = w.cu_q[i + 1] - q0;
    const std::int64_t k0 = w.cu_k[i], nk = w.cu_k[i + 1] - k0;
    kernels::ForwardArgs args;
    args.dtype = dtype;
    args.p = p;
    args.p.tq = nq;
    args.p.tk = nk;
    args.p.var.dropout.batch_base = static_cast<std::int64_t>(i);  // (D.3: b = i)
    args.q = rows(q, q0);
    args.k = rows(k, k0);
    args.v = rows(v, k0);
    args.out = rows(out, q0);
    args.lse = lse.empty() ? kernels::Out{} : lse_cols(lse, q0);
    const auto& kernel = kernels_of[i];
    if (nq == 0) continue;
    if (nk == 0) {  // no key: O = 0, L = −∞ (σ_h with sinks)
      fill_rows(dtype, args.out, nq, p.hq, p.dh, 0.0f);
      if (args.lse.data != nullptr) {
        for (std::int64_t h = 0; h < p.hq; ++h)
          for (std::int64_t t = 0; t < nq; ++t)
            args.lse.data[h * args.lse.s1 + t * args.lse.s2] =
                p.var.sinks != nullptr ? p.var.sinks[h] : kNegInf;
      }
      continue;
    }
    args.p.site = {fn, kernel.name};
    kernel.fn(args);
  }
}

void attention_backward_varlen(ConstTensorView q, ConstTensorView k, ConstTensorView v,
                               ConstTensorView out, ConstTensorView lse, ConstTensorView dout,
                               ConstTensorView cu_seqlens_q, ConstTensorView cu_seqlens_k,
                               TensorView dq, TensorView dk, TensorView dv,
                               const AttentionOptions& options, TensorView dsinks) {
  constexpr const char* fn = "attention_backward_varlen";
  Varlen w;
  make_varlen(fn, q, k, v, cu_seqlens_q, cu_seqlens_k, options, w);
  const kernels::AttentionProblem& p = w.p;
  check_like3(fn, out, "out", w.total_q, p.hq, p.dh, "q");
  check_lse2(fn, lse, w);
  check_like3(fn, dout, "dout", w.total_q, p.hq, p.dh, "q");
  check_like3(fn, dq, "dq", w.total_q, p.hq, p.dh, "q");
  check_like3(fn, dk, "dk", w.total_k, p.hkv, p.dh, "k");
  check_like3(fn, dv, "dv", w.total_k, p.hkv, p.dh, "k");
  const DType dtype = detail::common_dtype(fn,
                                           {{"q", q},
                                            {"k", k},
                                            {"v", v},
                                            {"out", out},
                                            {"dout", dout},
                                            {"dq", dq},
                                            {"dk", dk},
                                            {"dv", dv}},
                                           "q, k, v, out, dout, dq, dk and dv");
  detail::check_dsinks(fn, options, dsinks, p.hq);
  detail::check_no_overlap(fn, {{"dq", dq}, {"dk", dk}, {"dv", dv}, {"dsinks", dsinks}},
                           {{"q", q},
                            {"k", k},
                            {"v", v},
                            {"out", out},
                            {"lse", lse},
                            {"dout", dout},
                            {"options.alibi_slopes", options.alibi_slopes},
                            {"options.sinks", options.sinks}});
  const Isa isa = resolve_isa(options.isa, fn);

  std::vector<kernels::NamedKernel<kernels::BackwardKernel>> kernels_of;  // as in the forward
  for (std::size_t i = 0; i + 1 < w.cu_q.size(); ++i) {
    kernels_of.push_back(
        kernels::select_backward(fn, isa, dtype, w.cu_k[i + 1] - w.cu_k[i], w.variants.names));
  }
  for (std::size_t i = 0; i + 1 < w.cu_q.size(); ++i) {
    const std::int64_t q0 = w.cu_q[i], nq = w.cu_q[i + 1] - q0;
    const std::int64_t k0 = w.cu_k[i], nk = w.cu_k[i + 1] - k0;
    kernels::BackwardArgs args;
    args.dtype = dtype;
    args.p = p;
    args.p.tq = nq;
    args.p.tk = nk;
    args.p.var.dropout.batch_base = static_cast<std::int64_t>(i);  // (D.3: b = i)
    args.q = rows(q, q0);
    args.k = rows(k, k0);
    args.v = rows(v, k0);
    args.out = rows(out, q0);
    args.lse = lse_cols(lse, q0);
    args.dout = rows(dout, q0);
    args.dq = rows(dq, q0);
    args.dk = rows(dk, k0);
    args.dv = rows(dv, k0);
    const auto& kernel = kernels_of[i];
    if (nq == 0 || nk == 0) {  // nothing attends: zero gradients for the sequence's rows
      fill_rows(dtype, args.dq, nq, p.hq, p.dh, 0.0f);
      fill_rows(dtype, args.dk, nk, p.hkv, p.dh, 0.0f);
      fill_rows(dtype, args.dv, nk, p.hkv, p.dh, 0.0f);
      continue;
    }
    args.p.site = {fn, kernel.name};
    kernel.fn(args);
  }
  if (!dsinks.empty()) {
    kernels::AttentionProblem all = p;  // every packed row as one [1, total_q] problem
    all.tq = w.total_q;
    detail::sinks_gradient(all, dtype, rows(out, 0), rows(dout, 0), lse_cols(lse, 0), dsinks);
  }
}

}  // namespace tokenmix
