// src/api/attention.cpp — public attention entry points: validate, choose the kernel, call it.
#include "tokenmix/attention.hpp"

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <type_traits>

#include "api/problem.hpp"
#include "api/short_query.hpp"
#include "api/variants.hpp"
#include "dispatch/registry.hpp"
#include "kernels/attention_kernels.hpp"
#include "kernels/kernel_skeleton.hpp"
#include "tokenmix/error.hpp"
#include "util/validate.hpp"

namespace tokenmix {
namespace {

using detail::check_dim;
using detail::check_lse;
using detail::check_view;
using detail::fail;
using detail::make_problem;
using detail::strided;

// Checks that `x` has the shape of q ([B,T_q,H_q,d_h]) or k ([B,T_k,H_kv,d_h]).
void check_like(const char* fn, const ConstTensorView& x, const char* name, std::int64_t b,
                std::int64_t t, std::int64_t h, std::int64_t d, const char* like) {
  detail::check_activation(x, 4, fn, name);
  const std::string from = std::string(like) + ".shape";
  check_dim(x, 0, b, fn, name, "B", (from + "[0]").c_str());
  check_dim(x, 1, t, fn, name, "T", (from + "[1]").c_str());
  check_dim(x, 2, h, fn, name, "H", (from + "[2]").c_str());
  check_dim(x, 3, d, fn, name, "d_h", (from + "[3]").c_str());
}

}  // namespace

namespace {

// The arguments of the useful-work counts: sizes ≥ 0 and a known alignment.
void check_count_args(const char* fn, std::int64_t T_q, std::int64_t T_k, CausalAlign align) {
  if (T_q < 0)
    fail(ErrorCode::invalid_argument, fn, "T_q must be >= 0; got " + std::to_string(T_q));
  if (T_k < 0)
    fail(ErrorCode::invalid_argument, fn, "T_k must be >= 0; got " + std::to_string(T_k));
  detail::check_align(fn, "align", align);
}

// Σ_{t<T_q} clamp(t + a, 0, T_k), exact in 128 bits (|sum| ≤ T_q·T_k < 2^126): 0 for t < z =
// 1 − a, t + a on [z, s) with s = T_k − a, and T_k from max(z, s) on (bounds clamped to [0, T_q]).
__int128 clamped_sum(std::int64_t T_q, std::int64_t T_k, __int128 a) {
  using I = __int128;
  const auto clamp_t = [&](I x) { return std::clamp<I>(x, 0, T_q); };
  const I z = clamp_t(1 - a), s = std::max(z, clamp_t(I{T_k} - a));
  const I linear = (s - z) * ((z + a) + (s - 1 + a)) / 2;  // arithmetic series z+a … s−1+a
  return linear + (I{T_q} - s) * T_k;
}

// P = Σ_{t<T_q} pairs(t), exact in 128 bits. Causal: pairs(t) = clamp(p(t) + 1, 0, T_k) with
// p(t) = t + shift. A window W ≥ 1 (0 = none) removes the keys u ≤ p(t) − W, i.e.
// clamp(p(t) − W + 1, 0, T_k) of them (never more than the row has: p(t) − W + 1 ≤ p(t) + 1).
__int128 pairs_exact(std::int64_t T_q, std::int64_t T_k, bool causal, CausalAlign align,
                     std::int64_t window = 0) {
  using I = __int128;
  const I shift = align == CausalAlign::bottom_right ? I{T_k} - T_q : I{0};
  const I all = causal ? clamped_sum(T_q, T_k, 1 + shift) : I{T_q} * T_k;
  return window > 0 ? all - clamped_sum(T_q, T_k, 1 + shift - window) : all;
}

void check_window_arg(const char* fn, std::int64_t window) {
  if (window < 1) {
    fail(ErrorCode::invalid_argument, fn,
         "window must be >= 1 (the last W positions up to p(t)); got " + std::to_string(window));
  }
}

std::string approx(__int128 x) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "about %.6g", static_cast<double>(x));
  return buf;
}

}  // namespace

std::int64_t visible_keys(std::int64_t t, std::int64_t T_q, std::int64_t T_k, bool causal,
                          CausalAlign align) {
  constexpr const char* fn = "visible_keys";
  check_count_args(fn, T_q, T_k, align);
  if (t < 0 || t >= T_q) {
    fail(ErrorCode::invalid_argument, fn,
         "t must be in [0, T_q = " + std::to_string(T_q) + "); got " + std::to_string(t));
  }
  if (!causal) return T_k;
  // t + 1 + (T_k − T_q) ≤ T_k and > −T_q for t in [0, T_q): no overflow.
  const std::int64_t shift = align == CausalAlign::bottom_right ? T_k - T_q : 0;
  return std::clamp<std::int64_t>(t + 1 + shift, 0, T_k);
}

namespace {

std::int64_t visible_pairs_checked(const char* fn, std::int64_t T_q, std::int64_t T_k, bool causal,
                                   CausalAlign align, std::int64_t window) {
  check_count_args(fn, T_q, T_k, align);
  const __int128 p = pairs_exact(T_q, T_k, causal, align, window);
  if (p > INT64_MAX) {
    fail(ErrorCode::overflow, fn,
         std::string("the number of visible pairs for T_q = ") + std::to_string(T_q) +
             ", T_k = " + std::to_string(T_k) + (causal ? ", causal " : ", no mask ") +
             (causal ? to_string(align) : "") +
             (window > 0 ? ", window " + std::to_string(window) : std::string()) + " is " +
             approx(p) + ", which exceeds 2^63 - 1 (int64)");
  }
  return static_cast<std::int64_t>(p);
}

}  // namespace

std::int64_t visible_pairs(std::int64_t T_q, std::int64_t T_k, bool causal, CausalAlign align) {
  return visible_pairs_checked("visible_pairs", T_q, T_k, causal, align, 0);
}

std::int64_t visible_pairs_windowed(std::int64_t T_q, std::int64_t T_k, bool causal,
                                    CausalAlign align, std::int64_t window) {
  constexpr const char* fn = "visible_pairs_windowed";
  check_window_arg(fn, window);
  return visible_pairs_checked(fn, T_q, T_k, causal, align, window);
}

std::int64_t visible_keys_windowed(std::int64_t t, std::int64_t T_q, std::int64_t T_k, bool causal,
                                   CausalAlign align, std::int64_t window) {
  constexpr const char* fn = "visible_keys_windowed";
  check_window_arg(fn, window);
  check_count_args(fn, T_q, T_k, align);
  if (t < 0 || t >= T_q) {
    fail(ErrorCode::invalid_argument, fn,
         "t must be in [0, T_q = " + std::to_string(T_q) + "); got " + std::to_string(t));
  }
  const std::int64_t end = visible_keys(t, T_q, T_k, causal, align);
  // p(t) − W + 1, the first key in the window, clamped; p(t) ≥ −T_q, W < 2^63: in 128 bits.
  const __int128 p = __int128{t} + (align == CausalAlign::bottom_right ? T_k - T_q : 0);
  const __int128 begin = std::clamp<__int128>(p - window + 1, 0, end);  // u ≥ 0, ≤ end
  return end - static_cast<std::int64_t>(begin);
}

namespace {

// 4 · d_h · H_q · P · B (SPEC "Useful-work counts"); errors name the public function `fn`.
double forward_flops_checked(const char* fn, std::int64_t B, std::int64_t T_q, std::int64_t T_k,
                             std::int64_t H_q, std::int64_t d_h, bool causal, CausalAlign align,
                             std::int64_t window = 0) {
  check_count_args(fn, T_q, T_k, align);
  const std::pair<const char*, std::int64_t> sizes[] = {{"B", B}, {"H_q", H_q}, {"d_h", d_h}};
  for (auto [name, x] : sizes) {
    if (x < 0)
      fail(ErrorCode::invalid_argument, fn,
           std::string(name) + " must be >= 0; got " + std::to_string(x));
  }
  // SPEC "Useful-work counts": 4 · d_h · H_q · P · B.
  return 4.0 * static_cast<double>(d_h) * static_cast<double>(H_q) *
         static_cast<double>(pairs_exact(T_q, T_k, causal, align, window)) * static_cast<double>(B);
}

}  // namespace

double forward_flops(std::int64_t B, std::int64_t T_q, std::int64_t T_k, std::int64_t H_q,
                     std::int64_t d_h, bool causal, CausalAlign align) {
  return forward_flops_checked("forward_flops", B, T_q, T_k, H_q, d_h, causal, align);
}

double forward_flops_windowed(std::int64_t B, std::int64_t T_q, std::int64_t T_k, std::int64_t H_q,
                              std::int64_t d_h, bool causal, CausalAlign align,
                              std::int64_t window) {
  constexpr const char* fn = "forward_flops_windowed";
  check_window_arg(fn, window);
  return forward_flops_checked(fn, B, T_q, T_k, H_q, d_h, causal, align, window);
}

void attention_forward(ConstTensorView q, ConstTensorView k, ConstTensorView v, TensorView out,
                       TensorView lse, const AttentionOptions& options) {
  constexpr const char* fn = "attention_forward";
  kernels::ForwardArgs args;
  detail::VariantData variants;
  args.p = make_problem(fn, q, k, &v, options, variants);
  const auto& p = args.p;
  check_like(fn, out, "out", p.batch, p.tq, p.hq, p.dh, "q");
  if (!lse.empty()) check_lse(fn, lse, "lse", p);
  // SPEC "Reduced precision": q, k, v, out share one dtype (f32, bf16, f16); lse is f32.
  args.dtype =
      detail::common_dtype(fn, {{"q", q}, {"k", k}, {"v", v}, {"out", out}}, "q, k, v and out");
  detail::check_no_overlap(fn, {{"out", out}, {"lse", lse}},
                           {{"q", q},
                            {"k", k},
                            {"v", v},
                            {"options.mask", detail::mask_if_f32(options)},
                            {"options.alibi_slopes", options.alibi_slopes},
                            {"options.sinks", options.sinks}});
  detail::check_bool_mask_disjoint(fn, options, {{"out", out}, {"lse", lse}});
  const Isa isa = resolve_isa(options.isa, fn);  // the one dispatch decision of this call

  args.q = strided(q);
  args.k = strided(k);
  args.v = strided(v);
  args.out = strided(out);
  args.lse = lse.empty() ? kernels::Out{} : strided(lse);
  const auto kernel =
      kernels::select_forward(fn, isa, args.dtype, p.tk, variants.names);  // registry.cpp
  args.p.site = {fn, kernel.name};
  if (detail::short_query_applies(p, isa, args.dtype)) {  // T_q ≤ 16: split-KV (short_query.cpp)
    detail::short_query_forward(args, isa, out, lse);
    return;
  }
  kernel.fn(args);
}

void attention_backward(ConstTensorView q, ConstTensorView k, ConstTensorView v,
                        ConstTensorView out, ConstTensorView lse, ConstTensorView dout,
                        TensorView dq, TensorView dk, TensorView dv,
                        const AttentionOptions& options, TensorView dsinks) {
  constexpr const char* fn = "attention_backward";
  kernels::BackwardArgs args;
  detail::VariantData variants;
  args.p = make_problem(fn, q, k, &v, options, variants);
  const auto& p = args.p;
  check_like(fn, out, "out", p.batch, p.tq, p.hq, p.dh, "q");
  check_lse(fn, lse, "lse", p);
  check_like(fn, dout, "dout", p.batch, p.tq, p.hq, p.dh, "q");
  check_like(fn, dq, "dq", p.batch, p.tq, p.hq, p.dh, "q");
  check_like(fn, dk, "dk", p.batch, p.tk, p.hkv, p.dh, "k");
  check_like(fn, dv, "dv", p.batch, p.tk, p.hkv, p.dh, "k");
  // SPEC "Reduced precision": one dtype for the activations and gradients; lse is f32.
  args.dtype = detail::common_dtype(fn,
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
                            {"options.mask", detail::mask_if_f32(options)},
                            {"options.alibi_slopes", options.alibi_slopes},
                            {"options.sinks", options.sinks}});
  detail::check_bool_mask_disjoint(fn, options,
                                   {{"dq", dq}, {"dk", dk}, {"dv", dv}, {"dsinks", dsinks}});
  const Isa isa = resolve_isa(options.isa, fn);
  // No element of dq, dk or dv (B = 0, d_h = 0, or T_q = T_k = 0): nothing for a kernel to write,
  // however large the other sizes (a [2^31, 0, H, d_h] batch must not cost 2^31 empty units).
  // dσ_h = −Σ_i P_i,sink · D_i over no rows, or with D_i = dO_i · O_i = 0 at d_h = 0: zero.
  const auto no_elements = [](const TensorView& t) {
    for (int i = 0; i < t.rank; ++i)
      if (t.dim(i) == 0) return true;
    return false;
  };
  if (no_elements(dq) && no_elements(dk) && no_elements(dv)) {
    for (std::int64_t h = 0; h < dsinks.dim(0) && !dsinks.empty(); ++h)
      static_cast<float*>(dsinks.data)[h * dsinks.strides[0]] = 0.0f;
    return;
  }

  args.q = strided(q);
  args.k = strided(k);
  args.v = strided(v);
  args.out = strided(out);
  args.lse = strided(lse);
  args.dout = strided(dout);
  args.dq = strided(dq);
  args.dk = strided(dk);
  args.dv = strided(dv);
  const auto kernel =
      kernels::select_backward(fn, isa, args.dtype, p.tk, variants.names);  // registry.cpp
  args.p.site = {fn, kernel.name};
  kernel.fn(args);
  // dσ_h from L, O and dO, the same for every kernel path (SPEC "Score variants": sinks).
  if (!dsinks.empty()) detail::sinks_gradient(p, args.dtype, args.out, args.dout, args.lse, dsinks);
}

double backward_flops(std::int64_t B, std::int64_t T_q, std::int64_t T_k, std::int64_t H_q,
                      std::int64_t d_h, bool causal, CausalAlign align) {
  // SPEC "Useful-work counts": backward = 2.5 × forward (five products instead of two).
  return 2.5 * forward_flops_checked("backward_flops", B, T_q, T_k, H_q, d_h, causal, align);
}

double backward_flops_windowed(std::int64_t B, std::int64_t T_q, std::int64_t T_k, std::int64_t H_q,
                               std::int64_t d_h, bool causal, CausalAlign align,
                               std::int64_t window) {
  constexpr const char* fn = "backward_flops_windowed";
  check_window_arg(fn, window);
  return 2.5 * forward_flops_checked(fn, B, T_q, T_k, H_q, d_h, causal, align, window);
}

}  // namespace tokenmix

namespace tokenmix::detail {

kernels::AttentionProblem make_problem(const char* fn, const ConstTensorView& q,
                                       const ConstTensorView& k, const ConstTensorView* v,
                                       const AttentionOptions& o, VariantData& data) {
  detail::check_activation(q, 4, fn, "q");
  detail::check_activation(k, 4, fn, "k");
  if (v != nullptr) detail::check_activation(*v, 4, fn, "v");
  kernels::AttentionProblem p;
  p.batch = q.dim(0);
  p.tq = q.dim(1);
  p.hq = q.dim(2);
  p.dh = q.dim(3);
  p.tk = k.dim(1);
  p.hkv = k.dim(2);
  if (p.hq < 1)
    fail(ErrorCode::invalid_argument, fn,
         "q.shape[2] (H_q) must be >= 1; got " + std::to_string(p.hq));
  if (p.dh < 1)
    fail(ErrorCode::invalid_argument, fn,
         "q.shape[3] (d_h) must be >= 1; got " + std::to_string(p.dh));
  check_dim(k, 0, p.batch, fn, "k", "B", "q.shape[0]");
  check_dim(k, 3, p.dh, fn, "k", "d_h", "q.shape[3]");
  if (p.hkv < 1)
    fail(ErrorCode::invalid_argument, fn,
         "k.shape[2] (H_kv) must be >= 1; got " + std::to_string(p.hkv));
  if (p.hkv > p.hq) {
    fail(ErrorCode::shape_mismatch, fn,
         "k.shape[2] (H_kv) must be <= q.shape[2] (H_q = " + std::to_string(p.hq) +
             "); got H_kv = " + std::to_string(p.hkv));
  }
  if (p.hq % p.hkv != 0) {
    fail(ErrorCode::shape_mismatch, fn,
         "k.shape[2] (H_kv) must divide q.shape[2] (H_q = " + std::to_string(p.hq) +
             ") for grouped-query attention (SPEC 4.8); got H_kv = " + std::to_string(p.hkv));
  }
  if (v != nullptr) {
    check_dim(*v, 0, p.batch, fn, "v", "B", "q.shape[0]");
    check_dim(*v, 1, p.tk, fn, "v", "T_k", "k.shape[1]");
    check_dim(*v, 2, p.hkv, fn, "v", "H_kv", "k.shape[2]");
    check_dim(*v, 3, p.dh, fn, "v", "d_h", "q.shape[3]");
  }

  p.scale = detail::checked_scale(fn, o, p.dh);
  p.causal = o.causal;
  p.align = o.align;
  // A tiny call (generation's shapes) runs on the calling thread (kernel_skeleton.hpp).
  p.threads = kernels::threads_for_work(
      o.threads == 0 ? default_threads() : o.threads,
      static_cast<double>(p.batch) * p.hq * p.tq * static_cast<double>(p.tk) * p.dh);
  if (detail::uses_variants(o)) detail::prepare_variants(fn, o, p, data);
  return p;
}

void check_lse(const char* fn, const ConstTensorView& lse, const char* name,
               const kernels::AttentionProblem& p) {
  check_view(lse, 3, fn, name);
  check_dim(lse, 0, p.batch, fn, name, "B", "q.shape[0]");
  check_dim(lse, 1, p.hq, fn, name, "H_q", "q.shape[2]");
  check_dim(lse, 2, p.tq, fn, name, "T_q", "q.shape[1]");
}

}  // namespace tokenmix::detail
